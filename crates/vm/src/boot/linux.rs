//! Loading a Linux kernel into guest memory.
//!
//! Two kernel formats are accepted:
//! - a **bzImage** (`vmlinuz`), started through the x86 64-bit boot protocol: the protected-mode
//!   part of the image is loaded at [`HIMEM_START`], a `boot_params` "zero page" is written at
//!   [`ZERO_PAGE_START`], and vCPU 0 enters in long mode at `load address + 0x200` with RSI
//!   pointing at the zero page;
//! - an **ELF `vmlinux`**: its `PT_LOAD` segments are loaded at their physical addresses. If it
//!   carries the Xen `PHYS32_ENTRY` note (`CONFIG_PVH=y`) it is started through PVH: an
//!   `hvm_start_info` is written at [`PVH_INFO_START`] and vCPU 0 enters in 32-bit protected
//!   mode with paging off and EBX pointing at it. Without the note, the ELF entry point
//!   (`startup_64`) is used with the 64-bit boot protocol and a minimal zero page, as
//!   Firecracker does.
//!
//! The kernel command line goes to [`CMDLINE_START`]; an initrd is placed page-aligned at the top
//! of the RAM below the MMIO gap. The memory map handed to the kernel (e820 / PVH memmap) is
//! derived from the VM's [`MemoryLayout`]: see [`e820_map`].
//!
//! Loading only writes guest memory; setting up the vCPU (registers, page tables, GDT, CPUID)
//! is the caller's job, according to the returned [`LinuxEntry`].

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{
    boot_e820_entry, boot_params, setup_header, CAN_USE_HEAP, E820_MAX_ENTRIES_ZEROPAGE, LOADED_HIGH, XLF_KERNEL_64,
};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info, XEN_HVM_START_MAGIC_VALUE,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, BzImage, KernelLoader};
use vm_memory::{Address, ByteValued, Bytes, GuestAddress};

use crate::layout::{
    MemoryLayout, CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, HIMEM_START, PVH_INFO_START, ZERO_PAGE_START,
};

/// What to boot.
#[derive(Debug, Clone, Copy)]
pub struct LinuxBootConfig<'a> {
    /// A bzImage or an ELF vmlinux.
    pub kernel: &'a Path,
    /// Optional initial ramdisk.
    pub initrd: Option<&'a Path>,
    /// Kernel command line (printable ASCII).
    pub cmdline: &'a str,
    /// The VM's memory map; the guest memory must consist of exactly its RAM regions.
    pub layout: &'a MemoryLayout,
}

/// How vCPU 0 must start the loaded kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinuxEntry {
    /// 64-bit boot protocol: vCPU 0 enters in long mode (identity-mapped page tables, set by the caller) at `entry` with RSI = `boot_params`.
    BzImage64 { entry: u64, boot_params: u64 },
    /// PVH: vCPU 0 enters in 32-bit protected mode, paging off, at `entry` with EBX = `start_info`.
    Pvh { entry: u64, start_info: u64 },
}

/// Errors from [`load_linux`].
#[derive(thiserror::Error, Debug)]
pub enum LinuxError {
    #[error("cannot open kernel image {path}: {source}")]
    KernelOpen { path: PathBuf, source: io::Error },
    #[error("cannot read kernel image {path}: {source}")]
    KernelRead { path: PathBuf, source: io::Error },
    #[error("{path} is neither a bzImage nor an ELF vmlinux")]
    UnknownFormat { path: PathBuf },
    #[error(
        "{path}: bzImage boot protocol {version:#06x} has no 64-bit entry point \
         (needs protocol 2.12+ with XLF_KERNEL_64)"
    )]
    BzImageNot64Bit { path: PathBuf, version: u16 },
    #[error("{path}: only little-endian 64-bit x86-64 ELF kernels are supported")]
    ElfNotX86_64 { path: PathBuf },
    #[error("{path}: ELF kernel has no loadable segment")]
    ElfEmpty { path: PathBuf },
    #[error("guest memory of {mem_bytes:#x} bytes is too small to boot Linux")]
    MemoryTooSmall { mem_bytes: u64 },
    #[error(
        "kernel {path} needs guest memory up to {needed:#x}, but RAM below the MMIO gap ends at \
         {available:#x}; give the VM more memory"
    )]
    KernelTooLarge { path: PathBuf, needed: u64, available: u64 },
    #[error("failed to load kernel {path}: {source}")]
    KernelLoad { path: PathBuf, source: linux_loader::loader::Error },
    #[error("cannot open initrd {path}: {source}")]
    InitrdOpen { path: PathBuf, source: io::Error },
    #[error("cannot read initrd {path}: {source}")]
    InitrdRead { path: PathBuf, source: io::Error },
    #[error(
        "initrd {path} ({size} bytes) does not fit in guest RAM between the kernel end \
         {kernel_end:#x} and {limit:#x}; give the VM more memory"
    )]
    InitrdDoesNotFit { path: PathBuf, size: u64, kernel_end: u64, limit: u64 },
    #[error("kernel command line is {len} bytes long; this kernel accepts at most {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("invalid kernel command line: {0}")]
    InvalidCmdline(linux_loader::cmdline::Error),
    #[error("cannot write the kernel command line to guest memory: {0}")]
    CmdlineWrite(linux_loader::loader::Error),
    #[error("cannot write the boot parameters to guest memory: {0}")]
    BootParams(linux_loader::configurator::Error),
    #[error("cannot write the ACPI RSDP address into the boot parameters: {0}")]
    AcpiRsdp(vm_memory::GuestMemoryError),
}

/// e820 / PVH memory map entry type: usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 / PVH memory map entry type: reserved.
pub const E820_RESERVED: u32 = 2;

/// Offset of the 64-bit entry point (`startup_64`) from the protected-mode load address.
pub const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// `hvm_start_info` goes at [`PVH_INFO_START`]; the module list and memory map follow it in the
/// same page.
pub const PVH_MODLIST_START: u64 = PVH_INFO_START + 0x40;
/// PVH memory map (after one module entry).
pub const PVH_MEMMAP_START: u64 = PVH_INFO_START + 0x80;
/// Longest command line for kernels that do not tell (ELF): x86 `COMMAND_LINE_SIZE` - 1.
pub const DEFAULT_CMDLINE_MAX: usize = 2047;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// `LOAD_PHYSICAL_ADDR` of x86-64 defconfigs; also the alignment of relocatable kernels.
const DEFAULT_KERNEL_PHYS: u64 = 0x100_0000;
/// `initrd_addr_max` of kernels older than boot protocol 2.03.
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x37ff_ffff;
const PAGE_SIZE: u64 = 0x1000;

/// One memory map entry: `[addr, addr + size)` of type `kind` ([`E820_RAM`], [`E820_RESERVED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// The memory map handed to Linux for a VM laid out as `layout`: RAM `[0, EBDA_START)`, reserved `[EBDA_START, 1 MiB)` (EBDA, VGA hole,
/// BIOS area), RAM from 1 MiB to the end of low RAM and RAM above 4 GiB. The MMIO gap is left
/// out. Memory below 1 MiB that does not exist is not listed.
pub fn e820_map(layout: &MemoryLayout) -> Vec<E820Entry> {
    let mut map = Vec::new();
    for &(start, len) in layout.ram() {
        let end = start + len;
        if start < HIMEM_START {
            let low_end = end.min(EBDA_START);
            if low_end > start {
                map.push(E820Entry { addr: start, size: low_end - start, kind: E820_RAM });
            }
            if end > EBDA_START {
                let rsv_end = end.min(HIMEM_START);
                map.push(E820Entry { addr: EBDA_START, size: rsv_end - EBDA_START, kind: E820_RESERVED });
            }
            if end > HIMEM_START {
                map.push(E820Entry { addr: HIMEM_START, size: end - HIMEM_START, kind: E820_RAM });
            }
        } else {
            map.push(E820Entry { addr: start, size: len, kind: E820_RAM });
        }
    }
    map
}

/// Where to put an initrd of `size` bytes: the highest page-aligned address such that it ends
/// at or below both the end of low RAM and `initrd_addr_max` (the highest address the kernel
/// accepts for the initrd's last byte), and starts at or above `kernel_end`.
/// `None` if it does not fit.
pub fn initrd_address(layout: &MemoryLayout, size: u64, kernel_end: u64, initrd_addr_max: u64) -> Option<u64> {
    let limit = layout.low_ram_end().min(initrd_addr_max.saturating_add(1));
    let start = limit.checked_sub(size)? & !(PAGE_SIZE - 1);
    (start >= align_up(kernel_end, PAGE_SIZE)).then_some(start)
}

/// The highest guest address (exclusive) a bzImage needs at boot: the loaded image itself and
/// the buffer its decompressor extracts the kernel into (`init_size` bytes from the preferred
/// load address, which relocatable kernels compute as the load address rounded up to
/// `kernel_alignment`, but at least `LOAD_PHYSICAL_ADDR` = `pref_address`).
pub fn bzimage_extent(hdr: &setup_header, load_addr: u64, image_bytes: u64) -> u64 {
    let version = hdr.version;
    let pref = if version >= 0x020a && hdr.pref_address != 0 { hdr.pref_address } else { DEFAULT_KERNEL_PHYS };
    let align =
        if hdr.kernel_alignment.is_power_of_two() { u64::from(hdr.kernel_alignment) } else { DEFAULT_KERNEL_PHYS };
    let output = if hdr.relocatable_kernel != 0 { align_up(load_addr, align).max(pref) } else { pref };
    let init_size = if version >= 0x020a { u64::from(hdr.init_size) } else { 0 };
    (load_addr + image_bytes).max(output + init_size)
}

fn align_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

/// Loads the kernel (and initrd, command line, boot parameters) described by `cfg` into `mem`,
/// whose regions must be `cfg.layout`'s, and says how to enter it.
pub fn load_linux(mem: &crate::GuestMemory, cfg: &LinuxBootConfig) -> Result<LinuxEntry, LinuxError> {
    if cfg.layout.size() <= HIMEM_START {
        return Err(LinuxError::MemoryTooSmall { mem_bytes: cfg.layout.size() });
    }
    let path = cfg.kernel;
    let mut kernel = File::open(path).map_err(|source| LinuxError::KernelOpen { path: path.to_path_buf(), source })?;
    let read_err = |source| LinuxError::KernelRead { path: path.to_path_buf(), source };
    let file_len = kernel.metadata().map_err(read_err)?.len();
    let mut head = [0u8; 0x400];
    let n = read_up_to(&mut kernel, &mut head).map_err(read_err)?;
    let head = &head[..n];

    if head.len() >= 4 && head[..4] == *b"\x7fELF" {
        load_elf(mem, cfg, &mut kernel, head)
    } else if head.len() >= 0x206 && head[0x202..0x206] == *b"HdrS" {
        load_bzimage(mem, cfg, &mut kernel, file_len)
    } else {
        Err(LinuxError::UnknownFormat { path: path.to_path_buf() })
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    f.seek(SeekFrom::Start(0))?;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn load_bzimage(
    mem: &crate::GuestMemory,
    cfg: &LinuxBootConfig,
    kernel: &mut File,
    file_len: u64,
) -> Result<LinuxEntry, LinuxError> {
    let path = cfg.kernel;
    // Read the setup header to check everything before touching guest memory.
    let mut hdr = setup_header::default();
    kernel
        .seek(SeekFrom::Start(0x1f1))
        .and_then(|_| kernel.read_exact(hdr.as_mut_slice()))
        .map_err(|source| LinuxError::KernelRead { path: path.to_path_buf(), source })?;
    let version = hdr.version;
    if version < 0x020c || hdr.xloadflags & XLF_KERNEL_64 == 0 {
        return Err(LinuxError::BzImageNot64Bit { path: path.to_path_buf(), version });
    }
    let setup_bytes = (u64::from(if hdr.setup_sects == 0 { 4 } else { hdr.setup_sects }) + 1) * 512;
    let image_bytes = file_len.saturating_sub(setup_bytes);
    let kernel_end = bzimage_extent(&hdr, HIMEM_START, image_bytes);
    let available = cfg.layout.low_ram_end();
    if kernel_end > available {
        return Err(LinuxError::KernelTooLarge { path: path.to_path_buf(), needed: kernel_end, available });
    }
    let cmdline = build_cmdline(cfg.cmdline, hdr.cmdline_size as usize)?;
    let initrd_max = u64::from(hdr.initrd_addr_max);
    let initrd = load_initrd(mem, cfg, kernel_end, if initrd_max == 0 { DEFAULT_INITRD_ADDR_MAX } else { initrd_max })?;

    let loaded = BzImage::load(mem, Some(GuestAddress(HIMEM_START)), kernel, Some(GuestAddress(HIMEM_START)))
        .map_err(|source| LinuxError::KernelLoad { path: path.to_path_buf(), source })?;
    let hdr = loaded.setup_header.unwrap_or(hdr);
    load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline).map_err(LinuxError::CmdlineWrite)?;

    let mut params = boot_params { hdr, ..Default::default() };
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.loadflags |= LOADED_HIGH | CAN_USE_HEAP;
    // Only the 16-bit setup code uses the heap; point its end just below the (unused) real-mode
    // stack as a 16-bit loader would.
    params.hdr.heap_end_ptr = 0xfe00;
    write_zero_page(mem, params, cfg, cmdline_len(&cmdline), initrd)?;
    Ok(LinuxEntry::BzImage64 {
        entry: loaded.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET,
        boot_params: ZERO_PAGE_START,
    })
}

fn load_elf(
    mem: &crate::GuestMemory,
    cfg: &LinuxBootConfig,
    kernel: &mut File,
    head: &[u8],
) -> Result<LinuxEntry, LinuxError> {
    let path = cfg.kernel;
    let kernel_end = elf_extent(kernel, head).map_err(|e| match e {
        ElfProbeError::NotX86_64 => LinuxError::ElfNotX86_64 { path: path.to_path_buf() },
        ElfProbeError::Empty => LinuxError::ElfEmpty { path: path.to_path_buf() },
        ElfProbeError::Io(source) => LinuxError::KernelRead { path: path.to_path_buf(), source },
    })?;
    let available = cfg.layout.low_ram_end();
    if kernel_end > available {
        return Err(LinuxError::KernelTooLarge { path: path.to_path_buf(), needed: kernel_end, available });
    }
    let cmdline = build_cmdline(cfg.cmdline, DEFAULT_CMDLINE_MAX)?;
    let initrd = load_initrd(mem, cfg, kernel_end, u64::from(u32::MAX))?;

    let loaded = Elf::load(mem, None, kernel, Some(GuestAddress(HIMEM_START)))
        .map_err(|source| LinuxError::KernelLoad { path: path.to_path_buf(), source })?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline).map_err(LinuxError::CmdlineWrite)?;

    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => {
            write_pvh_start_info(mem, cfg.layout, initrd)?;
            Ok(LinuxEntry::Pvh { entry: entry.raw_value(), start_info: PVH_INFO_START })
        }
        _ => {
            // No PVH note: enter startup_64 directly with a minimal zero page.
            let mut params = boot_params::default();
            params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
            params.hdr.header = KERNEL_HDR_MAGIC;
            params.hdr.kernel_alignment = DEFAULT_KERNEL_PHYS as u32;
            params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
            write_zero_page(mem, params, cfg, cmdline_len(&cmdline), initrd)?;
            Ok(LinuxEntry::BzImage64 { entry: loaded.kernel_load.raw_value(), boot_params: ZERO_PAGE_START })
        }
    }
}

/// Tells a kernel loaded by [`load_linux`] where the ACPI RSDP is: `boot_params.acpi_rsdp_addr`
/// on the 64-bit boot protocol (read by kernels of protocol 2.14+; older ones scan
/// 0xE0000–0xFFFFF, where kumo puts the RSDP too), `hvm_start_info.rsdp_paddr` on PVH.
pub fn set_acpi_rsdp(mem: &crate::GuestMemory, entry: &LinuxEntry, rsdp: u64) -> Result<(), LinuxError> {
    let err = LinuxError::AcpiRsdp;
    match *entry {
        LinuxEntry::BzImage64 { boot_params: at, .. } => {
            let mut p: boot_params = mem.read_obj(GuestAddress(at)).map_err(err)?;
            p.acpi_rsdp_addr = rsdp;
            mem.write_obj(p, GuestAddress(at)).map_err(err)
        }
        LinuxEntry::Pvh { start_info: at, .. } => {
            let mut si: hvm_start_info = mem.read_obj(GuestAddress(at)).map_err(err)?;
            si.rsdp_paddr = rsdp;
            mem.write_obj(si, GuestAddress(at)).map_err(err)
        }
    }
}

enum ElfProbeError {
    NotX86_64,
    Empty,
    Io(io::Error),
}

/// Checks the ELF header and returns the end of the highest `PT_LOAD` segment (physical).
fn elf_extent(f: &mut File, head: &[u8]) -> Result<u64, ElfProbeError> {
    const PT_LOAD: u32 = 1;
    const EM_X86_64: u16 = 62;
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    // ELFCLASS64, ELFDATA2LSB, EM_X86_64, 56-byte program headers.
    if head.len() < 64 || head[4] != 2 || head[5] != 1 || u16_at(head, 0x12) != EM_X86_64 || u16_at(head, 0x36) != 56 {
        return Err(ElfProbeError::NotX86_64);
    }
    let phoff = u64_at(head, 0x20);
    let phnum = usize::from(u16_at(head, 0x38));
    let mut phdrs = vec![0u8; phnum * 56];
    f.seek(SeekFrom::Start(phoff)).and_then(|_| f.read_exact(&mut phdrs)).map_err(ElfProbeError::Io)?;
    let end = phdrs
        .chunks_exact(56)
        .filter(|p| u32_at(p, 0) == PT_LOAD && u64_at(p, 0x20) != 0)
        .map(|p| u64_at(p, 0x18).saturating_add(u64_at(p, 0x28)))
        .max()
        .ok_or(ElfProbeError::Empty)?;
    Ok(end)
}

fn build_cmdline(s: &str, kernel_max: usize) -> Result<Cmdline, LinuxError> {
    let max = if kernel_max == 0 { DEFAULT_CMDLINE_MAX } else { kernel_max }.min(CMDLINE_MAX_SIZE - 1);
    if s.len() > max {
        return Err(LinuxError::CmdlineTooLong { len: s.len(), max });
    }
    let mut cmdline = Cmdline::new(max + 1).map_err(LinuxError::InvalidCmdline)?;
    if !s.trim().is_empty() {
        // `insert_str` checks for printable ASCII (and keeps " -- " init arguments verbatim).
        cmdline.insert_str(s).map_err(|e| match e {
            linux_loader::cmdline::Error::TooLarge => LinuxError::CmdlineTooLong { len: s.len(), max },
            e => LinuxError::InvalidCmdline(e),
        })?;
    }
    Ok(cmdline)
}

fn cmdline_len(c: &Cmdline) -> u32 {
    c.as_cstring().map(|s| s.as_bytes().len() as u32).unwrap_or(0)
}

/// An initrd written to guest memory: `(address, size)`.
type Initrd = Option<(u64, u64)>;

fn load_initrd(
    mem: &crate::GuestMemory,
    cfg: &LinuxBootConfig,
    kernel_end: u64,
    initrd_addr_max: u64,
) -> Result<Initrd, LinuxError> {
    let Some(path) = cfg.initrd else {
        return Ok(None);
    };
    let mut f = File::open(path).map_err(|source| LinuxError::InitrdOpen { path: path.to_path_buf(), source })?;
    let size = f.metadata().map_err(|source| LinuxError::InitrdRead { path: path.to_path_buf(), source })?.len();
    let Some(addr) = initrd_address(cfg.layout, size, kernel_end, initrd_addr_max) else {
        return Err(LinuxError::InitrdDoesNotFit {
            path: path.to_path_buf(),
            size,
            kernel_end,
            limit: cfg.layout.low_ram_end().min(initrd_addr_max.saturating_add(1)),
        });
    };
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(|e| LinuxError::InitrdRead { path: path.to_path_buf(), source: io::Error::other(e.to_string()) })?;
    Ok(Some((addr, size)))
}

fn write_zero_page(
    mem: &crate::GuestMemory,
    mut params: boot_params,
    cfg: &LinuxBootConfig,
    cmdline_len: u32,
    initrd: Initrd,
) -> Result<(), LinuxError> {
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.ext_cmd_line_ptr = (CMDLINE_START >> 32) as u32;
    params.hdr.cmdline_size = cmdline_len;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.ext_ramdisk_image = (addr >> 32) as u32;
        params.hdr.ramdisk_size = size as u32;
        params.ext_ramdisk_size = (size >> 32) as u32;
    }
    let map = e820_map(cfg.layout);
    debug_assert!(map.len() <= E820_MAX_ENTRIES_ZEROPAGE);
    for (slot, e) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry { addr: e.addr, size: e.size, r#type: e.kind };
    }
    params.e820_entries = map.len() as u8;
    LinuxBootConfigurator::write_bootparams(&BootParams::new(&params, GuestAddress(ZERO_PAGE_START)), mem)
        .map_err(LinuxError::BootParams)
}

fn write_pvh_start_info(mem: &crate::GuestMemory, layout: &MemoryLayout, initrd: Initrd) -> Result<(), LinuxError> {
    let memmap: Vec<hvm_memmap_table_entry> = e820_map(layout)
        .iter()
        .map(|e| hvm_memmap_table_entry { addr: e.addr, size: e.size, type_: e.kind, reserved: 0 })
        .collect();
    let info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: 1,
        nr_modules: u32::from(initrd.is_some()),
        modlist_paddr: if initrd.is_some() { PVH_MODLIST_START } else { 0 },
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params = BootParams::new(&info, GuestAddress(PVH_INFO_START));
    if let Some((paddr, size)) = initrd {
        let module = hvm_modlist_entry { paddr, size, cmdline_paddr: 0, reserved: 0 };
        params.set_modules(&[module], GuestAddress(PVH_MODLIST_START));
    }
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    PvhBootConfigurator::write_bootparams(&params, mem).map_err(LinuxError::BootParams)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MMIO_GAP_END, MMIO_GAP_START};
    use std::io::Write;
    use vm_memory::GuestAddress;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn guest_mem(mem_bytes: u64) -> crate::GuestMemory {
        let ranges: Vec<(GuestAddress, usize)> =
            MemoryLayout::new(mem_bytes).ram().iter().map(|&(s, l)| (GuestAddress(s), l as usize)).collect();
        crate::GuestMemory::from_ranges(&ranges).unwrap()
    }

    /// A file in the temp dir, removed on drop.
    struct TempFile(PathBuf);
    impl TempFile {
        fn new(name: &str, bytes: &[u8]) -> TempFile {
            let p = std::env::temp_dir().join(format!("kumo-linux-{}-{name}", std::process::id()));
            std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
            TempFile(p)
        }
    }
    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn read_cstr(mem: &crate::GuestMemory, addr: u64) -> String {
        let mut buf = vec![0u8; 4096];
        mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        let end = buf.iter().position(|&b| b == 0).unwrap();
        String::from_utf8(buf[..end].to_vec()).unwrap()
    }

    // ---- pure helpers ----

    #[test]
    fn e820_small_vm() {
        let m = e820_map(&MemoryLayout::new(512 * MIB));
        assert_eq!(
            m,
            vec![
                E820Entry { addr: 0, size: EBDA_START, kind: E820_RAM },
                E820Entry { addr: EBDA_START, size: HIMEM_START - EBDA_START, kind: E820_RESERVED },
                E820Entry { addr: HIMEM_START, size: 512 * MIB - HIMEM_START, kind: E820_RAM },
            ]
        );
    }

    #[test]
    fn e820_reserves_the_acpi_area() {
        use crate::layout::{ACPI_END, ACPI_START};
        for mem in [8 * MIB, 512 * MIB, 6 * GIB] {
            let m = e820_map(&MemoryLayout::new(mem));
            assert!(
                m.iter().any(|e| e.kind == E820_RESERVED && e.addr <= ACPI_START && ACPI_END <= e.addr + e.size),
                "{m:x?}"
            );
            assert!(!m.iter().any(|e| e.kind == E820_RAM && e.addr < ACPI_END && ACPI_START < e.addr + e.size));
        }
    }

    #[test]
    fn rsdp_address_reaches_boot_params_and_pvh_start_info() {
        let mem = guest_mem(64 * MIB);
        let k = TempFile::new("bz-rsdp", &fake_bzimage());
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(64 * MIB) };
        let entry = load_linux(&mem, &cfg).unwrap();
        set_acpi_rsdp(&mem, &entry, 0xe_0000).unwrap();
        let bp: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!(({ bp.acpi_rsdp_addr }, { bp.hdr.header }), (0xe_0000, KERNEL_HDR_MAGIC));

        let mem = guest_mem(64 * MIB);
        let k = TempFile::new("elf-rsdp", &fake_elf(true));
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(64 * MIB) };
        let entry = load_linux(&mem, &cfg).unwrap();
        set_acpi_rsdp(&mem, &entry, 0xe_0000).unwrap();
        let si: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!((si.rsdp_paddr, si.magic), (0xe_0000, XEN_HVM_START_MAGIC_VALUE));
    }

    #[test]
    fn e820_large_vm_skips_mmio_gap() {
        let m = e820_map(&MemoryLayout::new(6 * GIB));
        assert_eq!(m.len(), 4);
        assert_eq!(m[2], E820Entry { addr: HIMEM_START, size: MMIO_GAP_START - HIMEM_START, kind: E820_RAM });
        assert_eq!(m[3], E820Entry { addr: MMIO_GAP_END, size: 3 * GIB, kind: E820_RAM });
        let ram: u64 = m.iter().filter(|e| e.kind == E820_RAM).map(|e| e.size).sum();
        assert_eq!(ram, 6 * GIB - (HIMEM_START - EBDA_START));
    }

    #[test]
    fn e820_exactly_gap_start() {
        let m = e820_map(&MemoryLayout::new(MMIO_GAP_START));
        assert_eq!(m.len(), 3);
        assert_eq!(m[2].addr + m[2].size, MMIO_GAP_START);
    }

    #[test]
    fn initrd_goes_to_top_of_low_ram() {
        let a = initrd_address(&MemoryLayout::new(512 * MIB), 10 * MIB + 123, 64 * MIB, 0x7fff_ffff).unwrap();
        assert_eq!(a % PAGE_SIZE, 0);
        assert!(a + 10 * MIB + 123 <= 512 * MIB);
        assert!(512 * MIB - (a + 10 * MIB + 123) < PAGE_SIZE);
        // Large VM: stays below the MMIO gap.
        let a = initrd_address(&MemoryLayout::new(8 * GIB), 5 * MIB, 64 * MIB, u64::from(u32::MAX)).unwrap();
        assert_eq!(a, MMIO_GAP_START - 5 * MIB);
    }

    #[test]
    fn initrd_respects_initrd_addr_max() {
        let a = initrd_address(&MemoryLayout::new(2 * GIB), 4 * MIB, 64 * MIB, 0x37ff_ffff).unwrap();
        assert_eq!(a, 0x3800_0000 - 4 * MIB);
    }

    #[test]
    fn initrd_that_does_not_fit() {
        assert_eq!(initrd_address(&MemoryLayout::new(128 * MIB), 100 * MIB, 64 * MIB, 0x7fff_ffff), None);
        assert_eq!(initrd_address(&MemoryLayout::new(128 * MIB), 200 * MIB, 0, 0x7fff_ffff), None);
        // Just fits.
        assert_eq!(initrd_address(&MemoryLayout::new(128 * MIB), 64 * MIB, 64 * MIB, 0x7fff_ffff), Some(64 * MIB));
    }

    #[test]
    fn bzimage_extent_covers_decompression_buffer() {
        let hdr = setup_header {
            version: 0x020f,
            relocatable_kernel: 1,
            kernel_alignment: 0x20_0000,
            pref_address: 0x100_0000,
            init_size: 0x300_0000,
            ..Default::default()
        };
        assert_eq!(bzimage_extent(&hdr, HIMEM_START, 10 * MIB), 0x400_0000);
        // A huge compressed image dominates.
        assert_eq!(bzimage_extent(&hdr, HIMEM_START, 100 * MIB), HIMEM_START + 100 * MIB);
    }

    #[test]
    fn cmdline_limits() {
        assert!(build_cmdline("console=ttyS0 panic=-1", 2047).is_ok());
        assert!(build_cmdline("", 2047).is_ok());
        let long = "a".repeat(300);
        assert!(matches!(build_cmdline(&long, 255), Err(LinuxError::CmdlineTooLong { len: 300, max: 255 })));
        assert!(matches!(build_cmdline("caf\u{e9}", 255), Err(LinuxError::InvalidCmdline(_))));
        assert!(matches!(build_cmdline("a\0b", 255), Err(LinuxError::InvalidCmdline(_))));
        let c = build_cmdline("  root=/dev/vda -- init-arg  ", 255).unwrap();
        assert_eq!(c.as_cstring().unwrap().to_str().unwrap(), "root=/dev/vda -- init-arg");
    }

    // ---- fake images ----

    const FAKE_SETUP_SECTS: u8 = 4;
    const FAKE_PAYLOAD: usize = 3 * 4096 + 17;

    fn fake_bzimage() -> Vec<u8> {
        let hdr = setup_header {
            setup_sects: FAKE_SETUP_SECTS,
            boot_flag: KERNEL_BOOT_FLAG_MAGIC,
            header: KERNEL_HDR_MAGIC,
            version: 0x020f,
            loadflags: LOADED_HIGH,
            code32_start: HIMEM_START as u32,
            initrd_addr_max: 0x7fff_ffff,
            kernel_alignment: 0x20_0000,
            relocatable_kernel: 1,
            xloadflags: XLF_KERNEL_64 | 2,
            cmdline_size: 2047,
            pref_address: 0x100_0000,
            init_size: 0x80_0000,
            ..Default::default()
        };
        let setup = (usize::from(FAKE_SETUP_SECTS) + 1) * 512;
        let mut img = vec![0u8; setup + FAKE_PAYLOAD];
        img[0x1f1..0x1f1 + std::mem::size_of::<setup_header>()].copy_from_slice(hdr.as_slice());
        for (i, b) in img[setup..].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        img
    }

    #[test]
    fn loads_fake_bzimage() {
        let img = fake_bzimage();
        let k = TempFile::new("bz", &img);
        let initrd_bytes = vec![0xabu8; 5000];
        let rd = TempFile::new("bz-initrd", &initrd_bytes);
        let mem_bytes = 64 * MIB;
        let mem = guest_mem(mem_bytes);
        let cfg = LinuxBootConfig {
            kernel: &k.0,
            initrd: Some(&rd.0),
            cmdline: "console=ttyS0 panic=-1",
            layout: &MemoryLayout::new(mem_bytes),
        };
        let entry = load_linux(&mem, &cfg).unwrap();
        assert_eq!(entry, LinuxEntry::BzImage64 { entry: HIMEM_START + 0x200, boot_params: ZERO_PAGE_START });

        // Payload at 1 MiB.
        let setup = (usize::from(FAKE_SETUP_SECTS) + 1) * 512;
        let mut got = vec![0u8; FAKE_PAYLOAD];
        mem.read_slice(&mut got, GuestAddress(HIMEM_START)).unwrap();
        assert_eq!(got, img[setup..]);

        let bp: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!({ bp.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ bp.hdr.boot_flag }, KERNEL_BOOT_FLAG_MAGIC);
        assert_eq!({ bp.hdr.type_of_loader }, 0xff);
        assert_eq!(bp.hdr.loadflags & (LOADED_HIGH | CAN_USE_HEAP), LOADED_HIGH | CAN_USE_HEAP);
        assert_eq!({ bp.hdr.code32_start }, HIMEM_START as u32);
        assert_eq!({ bp.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ bp.hdr.cmdline_size }, "console=ttyS0 panic=-1".len() as u32);
        assert_eq!(read_cstr(&mem, CMDLINE_START), "console=ttyS0 panic=-1");

        // Initrd: page aligned, at the top of RAM, contents intact.
        let (ri, rs) = ({ bp.hdr.ramdisk_image } as u64, { bp.hdr.ramdisk_size } as u64);
        assert_eq!(rs, 5000);
        assert_eq!(ri % PAGE_SIZE, 0);
        assert_eq!(ri, (mem_bytes - 5000) & !(PAGE_SIZE - 1));
        let mut rd_got = vec![0u8; 5000];
        mem.read_slice(&mut rd_got, GuestAddress(ri)).unwrap();
        assert_eq!(rd_got, initrd_bytes);

        // e820.
        let n = bp.e820_entries as usize;
        assert_eq!(n, 3);
        let table = { bp.e820_table };
        let got: Vec<E820Entry> =
            table[..n].iter().map(|e| E820Entry { addr: e.addr, size: e.size, kind: e.r#type }).collect();
        assert_eq!(got, e820_map(&MemoryLayout::new(mem_bytes)));
    }

    #[test]
    fn fake_bzimage_too_large_for_memory() {
        let k = TempFile::new("bz-big", &fake_bzimage());
        // init_size 8 MiB from 16 MiB does not fit into 16 MiB of RAM.
        let mem = guest_mem(16 * MIB);
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(16 * MIB) };
        let err = load_linux(&mem, &cfg).unwrap_err();
        assert!(matches!(err, LinuxError::KernelTooLarge { needed: 0x180_0000, .. }), "{err}");
    }

    #[test]
    fn fake_bzimage_initrd_does_not_fit() {
        let k = TempFile::new("bz-rd", &fake_bzimage());
        let rd = TempFile::new("bz-rd-initrd", &vec![1u8; 9 << 20]);
        let mem = guest_mem(32 * MIB);
        let cfg =
            LinuxBootConfig { kernel: &k.0, initrd: Some(&rd.0), cmdline: "", layout: &MemoryLayout::new(32 * MIB) };
        let err = load_linux(&mem, &cfg).unwrap_err();
        assert!(matches!(err, LinuxError::InitrdDoesNotFit { .. }), "{err}");
        assert!(err.to_string().contains("does not fit"));
    }

    #[test]
    fn old_bzimage_is_rejected() {
        let mut img = fake_bzimage();
        img[0x206] = 0x0b; // protocol 2.11
        let k = TempFile::new("bz-old", &img);
        let mem = guest_mem(64 * MIB);
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(64 * MIB) };
        assert!(matches!(load_linux(&mem, &cfg), Err(LinuxError::BzImageNot64Bit { version: 0x020b, .. })));
    }

    #[test]
    fn bad_inputs_give_clear_errors() {
        let mem = guest_mem(64 * MIB);
        let missing = Path::new("/nonexistent/kumo/vmlinuz");
        let cfg = LinuxBootConfig { kernel: missing, initrd: None, cmdline: "", layout: &MemoryLayout::new(64 * MIB) };
        let err = load_linux(&mem, &cfg).unwrap_err();
        assert!(matches!(err, LinuxError::KernelOpen { .. }));
        assert!(err.to_string().contains("/nonexistent/kumo/vmlinuz"), "{err}");

        let junk = TempFile::new("junk", &[0x55u8; 4096]);
        let cfg = LinuxBootConfig { kernel: &junk.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(64 * MIB) };
        let err = load_linux(&mem, &cfg).unwrap_err();
        assert!(err.to_string().contains("neither a bzImage nor an ELF"), "{err}");

        let k = TempFile::new("bz-noinitrd", &fake_bzimage());
        let cfg = LinuxBootConfig {
            kernel: &k.0,
            initrd: Some(Path::new("/nonexistent/initrd")),
            cmdline: "",
            layout: &MemoryLayout::new(64 * MIB),
        };
        assert!(matches!(load_linux(&mem, &cfg), Err(LinuxError::InitrdOpen { .. })));

        let small = guest_mem(MIB);
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(MIB) };
        assert!(matches!(load_linux(&small, &cfg), Err(LinuxError::MemoryTooSmall { .. })));
    }

    /// A minimal x86-64 ELF: one PT_LOAD of `FAKE_ELF_CODE` at 16 MiB, optionally a PT_NOTE with
    /// the Xen PHYS32_ENTRY note.
    const FAKE_ELF_PADDR: u64 = 0x100_0000;
    const FAKE_PVH_ENTRY: u32 = 0x100_0040;
    const FAKE_ELF_CODE: usize = 0x180;

    fn fake_elf(pvh: bool) -> Vec<u8> {
        let mut f = vec![0u8; 0x200 + FAKE_ELF_CODE];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2; // ELFCLASS64
        f[5] = 1; // little endian
        f[6] = 1; // EV_CURRENT
        f[0x10..0x12].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        f[0x12..0x14].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        f[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
        f[0x18..0x20].copy_from_slice(&FAKE_ELF_PADDR.to_le_bytes()); // e_entry
        f[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        f[0x34..0x36].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        f[0x36..0x38].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        f[0x38..0x3a].copy_from_slice(&(if pvh { 2u16 } else { 1 }).to_le_bytes()); // e_phnum
        let phdr = |f: &mut [u8], at: usize, ty: u32, off: u64, paddr: u64, sz: u64| {
            f[at..at + 4].copy_from_slice(&ty.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
            f[at + 16..at + 24].copy_from_slice(&(paddr | 0xffff_ffff_8000_0000).to_le_bytes());
            f[at + 24..at + 32].copy_from_slice(&paddr.to_le_bytes());
            f[at + 32..at + 40].copy_from_slice(&sz.to_le_bytes());
            f[at + 40..at + 48].copy_from_slice(&(sz + 0x1000).to_le_bytes()); // memsz (bss)
        };
        phdr(&mut f, 64, 1, 0x200, FAKE_ELF_PADDR, FAKE_ELF_CODE as u64);
        if pvh {
            // Note: namesz 4 "Xen\0", descsz 8, type 18, then the 32-bit entry (+ padding).
            let mut note = Vec::new();
            note.extend_from_slice(&4u32.to_le_bytes());
            note.extend_from_slice(&8u32.to_le_bytes());
            note.extend_from_slice(&18u32.to_le_bytes());
            note.extend_from_slice(b"Xen\0");
            note.extend_from_slice(&u64::from(FAKE_PVH_ENTRY).to_le_bytes());
            f[0x100..0x100 + note.len()].copy_from_slice(&note);
            phdr(&mut f, 64 + 56, 4, 0x100, 0, note.len() as u64);
        }
        for (i, b) in f[0x200..].iter_mut().enumerate() {
            *b = 0x90 ^ (i as u8);
        }
        f
    }

    #[test]
    fn loads_fake_pvh_elf() {
        let img = fake_elf(true);
        let k = TempFile::new("elf-pvh", &img);
        let rd = TempFile::new("elf-pvh-initrd", &[7u8; 100]);
        let mem_bytes = 64 * MIB;
        let mem = guest_mem(mem_bytes);
        let cfg = LinuxBootConfig {
            kernel: &k.0,
            initrd: Some(&rd.0),
            cmdline: "console=ttyS0",
            layout: &MemoryLayout::new(mem_bytes),
        };
        let entry = load_linux(&mem, &cfg).unwrap();
        assert_eq!(entry, LinuxEntry::Pvh { entry: u64::from(FAKE_PVH_ENTRY), start_info: PVH_INFO_START });
        let mut code = vec![0u8; FAKE_ELF_CODE];
        mem.read_slice(&mut code, GuestAddress(FAKE_ELF_PADDR)).unwrap();
        assert_eq!(code, img[0x200..]);

        let si: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(si.magic, XEN_HVM_START_MAGIC_VALUE);
        assert_eq!(si.version, 1);
        assert_eq!(si.cmdline_paddr, CMDLINE_START);
        assert_eq!(read_cstr(&mem, CMDLINE_START), "console=ttyS0");
        assert_eq!(si.nr_modules, 1);
        let module: hvm_modlist_entry = mem.read_obj(GuestAddress(si.modlist_paddr)).unwrap();
        assert_eq!(module.size, 100);
        assert_eq!(module.paddr, (mem_bytes - 100) & !(PAGE_SIZE - 1));
        assert_eq!(mem.read_obj::<u8>(GuestAddress(module.paddr + 99)).unwrap(), 7);
        let map = e820_map(&MemoryLayout::new(mem_bytes));
        assert_eq!(si.memmap_entries as usize, map.len());
        for (i, e) in map.iter().enumerate() {
            let m: hvm_memmap_table_entry = mem.read_obj(GuestAddress(si.memmap_paddr + 24 * i as u64)).unwrap();
            assert_eq!((m.addr, m.size, m.type_), (e.addr, e.size, e.kind));
        }
        // Everything stays inside the PVH info page.
        assert!(PVH_MEMMAP_START + 24 * map.len() as u64 <= PVH_INFO_START + 0x1000);
    }

    #[test]
    fn elf_without_pvh_note_uses_64bit_entry() {
        let k = TempFile::new("elf-64", &fake_elf(false));
        let mem = guest_mem(64 * MIB);
        let cfg =
            LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "quiet", layout: &MemoryLayout::new(64 * MIB) };
        let entry = load_linux(&mem, &cfg).unwrap();
        assert_eq!(entry, LinuxEntry::BzImage64 { entry: FAKE_ELF_PADDR, boot_params: ZERO_PAGE_START });
        let bp: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!({ bp.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ bp.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!(bp.e820_entries, 3);
    }

    #[test]
    fn elf_too_large_for_memory() {
        let k = TempFile::new("elf-big", &fake_elf(true));
        let mem = guest_mem(16 * MIB);
        let cfg = LinuxBootConfig { kernel: &k.0, initrd: None, cmdline: "", layout: &MemoryLayout::new(16 * MIB) };
        assert!(matches!(load_linux(&mem, &cfg), Err(LinuxError::KernelTooLarge { .. })));
    }

    // ---- the real Debian kernel (scripts/fetch-linux-kernel.sh) ----

    fn cached(name: &str) -> Option<PathBuf> {
        let p = match std::env::var_os("KUMO_LINUX_CACHE") {
            Some(d) => PathBuf::from(d).join(name),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/linux").join(name),
        };
        if p.exists() {
            Some(p)
        } else {
            println!("skipping: {} not found (run scripts/fetch-linux-kernel.sh)", p.display());
            None
        }
    }

    #[test]
    fn loads_real_bzimage() {
        let Some(k) = cached("vmlinuz") else { return };
        let mem_bytes = 512 * MIB;
        let mem = guest_mem(mem_bytes);
        let cmdline = "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1";
        let cfg = LinuxBootConfig { kernel: &k, initrd: Some(&k), cmdline, layout: &MemoryLayout::new(mem_bytes) };
        let entry = load_linux(&mem, &cfg).unwrap();
        assert_eq!(entry, LinuxEntry::BzImage64 { entry: HIMEM_START + 0x200, boot_params: ZERO_PAGE_START });
        let bp: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!({ bp.hdr.header }, KERNEL_HDR_MAGIC);
        assert!(bp.hdr.xloadflags & XLF_KERNEL_64 != 0);
        assert!({ bp.hdr.ramdisk_image } as u64 >= bzimage_extent(&bp.hdr, HIMEM_START, 0));
        assert_eq!(read_cstr(&mem, CMDLINE_START), cmdline);
        println!(
            "bzImage protocol {:#x}, init_size {:#x}, pref_address {:#x}",
            { bp.hdr.version },
            { bp.hdr.init_size },
            { bp.hdr.pref_address }
        );
    }

    #[test]
    fn loads_real_pvh_vmlinux() {
        let Some(k) = cached("vmlinux") else { return };
        let mem_bytes = 512 * MIB;
        let mem = guest_mem(mem_bytes);
        let cfg = LinuxBootConfig {
            kernel: &k,
            initrd: None,
            cmdline: "console=ttyS0",
            layout: &MemoryLayout::new(mem_bytes),
        };
        match load_linux(&mem, &cfg).unwrap() {
            LinuxEntry::Pvh { entry, start_info } => {
                assert_eq!(start_info, PVH_INFO_START);
                assert!((HIMEM_START..MMIO_GAP_START).contains(&entry), "{entry:#x}");
                println!("PVH entry {entry:#x}");
            }
            e => panic!("expected a PVH entry, got {e:?}"),
        }
        let si: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(si.magic, XEN_HVM_START_MAGIC_VALUE);
        assert_eq!(si.nr_modules, 0);
    }
}
