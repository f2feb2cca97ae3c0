//! Boot: what the VMM writes into guest memory and vCPU registers before the first instruction:
//! GDT, per-vCPU TSS, identity-mapped page tables, kumo's boot info, and the entry register state
//! for each way a guest can start (kumo guest, Linux 64-bit boot protocol, PVH). The Linux
//! loader (bzImage, ELF vmlinux, PVH; initrd, command line, e820) is `linux`.

pub mod linux;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use crate::layout::*;
use crate::memory::GuestMemory;
use crate::{Error, Result};

pub const SEL_CODE64: u16 = 0x08;
pub const SEL_DATA: u16 = 0x10;
pub const SEL_CODE32: u16 = 0x28;

const GDT_CODE64: u64 = 0x00af_9b00_0000_ffff;
const GDT_DATA: u64 = 0x00cf_9300_0000_ffff;
const GDT_UDATA: u64 = 0x00cf_f300_0000_ffff;
const GDT_UCODE64: u64 = 0x00af_fb00_0000_ffff;
const GDT_CODE32: u64 = 0x00cf_9b00_0000_ffff;
/// A 64-bit TSS is 104 bytes; an I/O permission bitmap follows it. This nested KVM ignores
/// IOPL for ring 3 but honours the bitmap, so kumo guests' ring-3 code gets ports
/// `0..IO_BITMAP_PORTS` (serial, exit and marker ports) through it.
const TSS_HEADER: u64 = 104;
pub const IO_BITMAP_PORTS: u64 = 0x600;
/// Header, bitmap, and the all-ones byte the CPU requires after the bitmap.
const TSS_SIZE: u64 = TSS_HEADER + IO_BITMAP_PORTS / 8 + 1;
const _: () = assert!(TSS_SIZE <= TSS_STRIDE, "a TSS must fit its slot");

use crate::x86::*;

/// How vCPU 0 (and, for kumo guests, every vCPU) starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// kumo guest: long mode at `rip`, RDI = boot info, RSI = vCPU index.
    KumoGuest { rip: u64 },
    /// Linux 64-bit boot protocol: long mode at `rip`, RSI = boot_params.
    Linux64 { rip: u64, boot_params: u64 },
    /// PVH: 32-bit protected mode, paging off, at `rip`, EBX = start_info.
    Pvh { rip: u64, start_info: u64 },
}

fn tss_base(cpu: u32) -> u64 {
    TSS_START + cpu as u64 * TSS_STRIDE
}

fn tss_selector(cpu: u32) -> u16 {
    ((GDT_FIRST_TSS + 2 * cpu as usize) * 8) as u16
}

/// Writes the GDT (with one TSS descriptor per vCPU) and zeroed TSSs.
pub fn write_gdt(mem: &GuestMemory, ncpus: u32) -> Result<()> {
    if ncpus == 0 || ncpus > MAX_VCPUS {
        return Err(Error::BadVcpuCount(ncpus, MAX_VCPUS));
    }
    let mut gdt = vec![0u64, GDT_CODE64, GDT_DATA, GDT_UDATA, GDT_UCODE64, GDT_CODE32];
    for cpu in 0..ncpus {
        let base = tss_base(cpu);
        let limit = TSS_SIZE - 1;
        // 16-byte system descriptor, type 0xb (busy 64-bit TSS), present.
        let low = (limit & 0xffff)
            | ((base & 0xff_ffff) << 16)
            | (0x8b << 40)
            | (((limit >> 16) & 0xf) << 48)
            | (((base >> 24) & 0xff) << 56);
        gdt.push(low);
        gdt.push(base >> 32);
        let mut tss = [0u8; TSS_SIZE as usize];
        tss[102..104].copy_from_slice(&(TSS_HEADER as u16).to_le_bytes()); // I/O map base
        tss[TSS_SIZE as usize - 1] = 0xff;
        mem.write_slice(&tss, GuestAddress(base)).map_err(|e| Error::Boot(format!("TSS: {e}")))?;
    }
    let bytes: Vec<u8> = gdt.iter().flat_map(|d| d.to_le_bytes()).collect();
    mem.write_slice(&bytes, GuestAddress(GDT_START)).map_err(|e| Error::Boot(format!("GDT: {e}")))
}

fn gdt_limit(ncpus: u32) -> u16 {
    ((GDT_FIRST_TSS + 2 * ncpus as usize) * 8 - 1) as u16
}

/// Identity-maps `[0, max(top, 4 GiB))` with 2 MiB pages, user-accessible (kumo guests run their
/// workloads in ring 3 over the same mapping). Returns how many GiB are mapped.
pub fn write_page_tables(mem: &GuestMemory, top: u64) -> Result<u64> {
    let gib = top.max(MMIO_GAP_END).div_ceil(1 << 30);
    if gib > MAX_IDENTITY_GIB {
        return Err(Error::Boot(format!("boot page tables map at most {MAX_IDENTITY_GIB} GiB, VM needs {gib}")));
    }
    const P_RW_US: u64 = 0x7;
    const PS: u64 = 0x80;
    let w = |v: u64, a: u64| mem.write_obj(v, GuestAddress(a)).map_err(|e| Error::Boot(format!("page tables: {e}")));
    w(PDPT_START | P_RW_US, PML4_START)?;
    for g in 0..gib {
        let pd = PD_START + g * 0x1000;
        w(pd | P_RW_US, PDPT_START + g * 8)?;
        let entries: Vec<u8> =
            (0..512u64).flat_map(|i| (((g << 30) | (i << 21)) | P_RW_US | PS).to_le_bytes()).collect();
        mem.write_slice(&entries, GuestAddress(pd)).map_err(|e| Error::Boot(format!("page tables: {e}")))?;
    }
    Ok(gib)
}

/// `struct kumo_boot_info` (guests/include/kumo.h).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KumoBootInfo {
    pub ncpus: u32,
    pub mem_bytes: u64,
    pub tsc_khz: u64,
    pub free_start: u64,
    pub free_end: u64,
    /// Guest-physical address of the elastic channel's mailbox (`kumo_elastic::mailbox`), 0
    /// without one.
    pub elastic: u64,
    pub cmdline: String,
}

pub const KUMO_BOOT_MAGIC: u64 = u64::from_le_bytes(*b"KUMOBOOT");
pub const KUMO_BOOT_VERSION: u32 = 1;
const BOOT_INFO_CMDLINE_OFFSET: usize = 120;
const BOOT_INFO_CMDLINE_MAX: usize = 3840;

impl KumoBootInfo {
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        if self.cmdline.len() >= BOOT_INFO_CMDLINE_MAX {
            return Err(Error::Boot(format!("guest command line longer than {} bytes", BOOT_INFO_CMDLINE_MAX - 1)));
        }
        let mut b = Vec::with_capacity(BOOT_INFO_CMDLINE_OFFSET + BOOT_INFO_CMDLINE_MAX);
        b.extend_from_slice(&KUMO_BOOT_MAGIC.to_le_bytes());
        b.extend_from_slice(&KUMO_BOOT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.ncpus.to_le_bytes());
        for v in [
            self.mem_bytes,
            self.tsc_khz,
            self.free_start,
            self.free_end,
            TSS_START,
            TSS_STRIDE,
            LAPIC_START,
            self.elastic,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.resize(BOOT_INFO_CMDLINE_OFFSET, 0);
        b.extend_from_slice(self.cmdline.as_bytes());
        b.resize(BOOT_INFO_CMDLINE_OFFSET + BOOT_INFO_CMDLINE_MAX, 0);
        Ok(b)
    }

    pub fn write(&self, mem: &GuestMemory) -> Result<()> {
        mem.write_slice(&self.to_bytes()?, GuestAddress(KUMO_BOOT_INFO))
            .map_err(|e| Error::Boot(format!("boot info: {e}")))
    }
}

fn seg(selector: u16, type_: u8, l: u8, db: u8, s: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db,
        s,
        l,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Special registers for `entry` on vCPU `cpu` of `ncpus`, starting from KVM's defaults.
pub fn sregs_for(entry: Entry, cpu: u32, ncpus: u32, mut s: kvm_sregs) -> kvm_sregs {
    s.gdt.base = GDT_START;
    s.gdt.limit = gdt_limit(ncpus);
    s.idt.base = 0;
    s.idt.limit = 0;
    s.tr = kvm_segment {
        base: tss_base(cpu),
        limit: (TSS_SIZE - 1) as u32,
        selector: tss_selector(cpu),
        type_: 0xb,
        present: 1,
        s: 0,
        ..Default::default()
    };
    let data = seg(SEL_DATA, 3, 0, 1, 1);
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    match entry {
        Entry::Pvh { .. } => {
            s.cs = seg(SEL_CODE32, 0xb, 0, 1, 1);
            s.cr0 = CR0_PE | CR0_ET;
            s.cr4 = 0;
            s.efer = 0;
        }
        Entry::KumoGuest { .. } | Entry::Linux64 { .. } => {
            s.cs = seg(SEL_CODE64, 0xb, 1, 0, 1);
            s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
            s.cr3 = PML4_START;
            s.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
            s.efer = EFER_LME | EFER_LMA;
        }
    }
    s
}

/// General registers for `entry` on vCPU `cpu`.
pub fn regs_for(entry: Entry, cpu: u32) -> kvm_regs {
    let mut r = kvm_regs { rflags: 0x2, ..Default::default() };
    match entry {
        Entry::KumoGuest { rip } => {
            r.rip = rip;
            r.rdi = KUMO_BOOT_INFO;
            r.rsi = cpu as u64;
        }
        Entry::Linux64 { rip, boot_params } => {
            r.rip = rip;
            r.rsi = boot_params;
            r.rsp = 0x8ff0;
            r.rbp = 0x8ff0;
        }
        Entry::Pvh { rip, start_info } => {
            r.rip = rip;
            r.rbx = start_info;
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Memory;

    #[test]
    fn gdt_has_segments_and_a_busy_tss_per_vcpu() {
        let m = Memory::new(16 << 20).unwrap();
        write_gdt(&m.guest, 3).unwrap();
        let d = |i: u64| m.guest.read_obj::<u64>(GuestAddress(GDT_START + i * 8)).unwrap();
        assert_eq!(d(1), GDT_CODE64);
        assert_eq!(d(4), GDT_UCODE64);
        let tss2 = d(GDT_FIRST_TSS as u64 + 4);
        let base = ((tss2 >> 16) & 0xff_ffff) | (((tss2 >> 56) & 0xff) << 24);
        assert_eq!(base, TSS_START + 2 * TSS_STRIDE);
        assert_eq!((tss2 >> 40) & 0xff, 0x8b);
        assert_eq!(tss2 & 0xffff, TSS_SIZE - 1);
        let iomap: u16 = m.guest.read_obj(GuestAddress(TSS_START + 2 * TSS_STRIDE + 102)).unwrap();
        assert_eq!(iomap as u64, TSS_HEADER);
        assert_eq!(gdt_limit(3) as u64 + 1, (GDT_FIRST_TSS as u64 + 6) * 8);
        assert!(matches!(write_gdt(&m.guest, 0), Err(Error::BadVcpuCount(0, _))));
        assert!(matches!(write_gdt(&m.guest, MAX_VCPUS + 1), Err(Error::BadVcpuCount(..))));
    }

    #[test]
    fn page_tables_identity_map_with_user_access() {
        let m = Memory::new(16 << 20).unwrap();
        assert_eq!(write_page_tables(&m.guest, 16 << 20).unwrap(), 4);
        let pml4: u64 = m.guest.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPT_START | 7);
        // 0xfee00000 (LAPIC): GiB 3, entry 503.
        let pde: u64 = m.guest.read_obj(GuestAddress(PD_START + 3 * 0x1000 + 503 * 8)).unwrap();
        assert_eq!(pde & !0xfff, 0xfee0_0000);
        assert_eq!(pde & 0x87, 0x87);
        assert!(write_page_tables(&m.guest, 65 << 30).is_err());
    }

    #[test]
    fn boot_info_layout_matches_the_c_header() {
        let bi = KumoBootInfo {
            ncpus: 2,
            mem_bytes: 1 << 30,
            tsc_khz: 2_000_000,
            free_start: 0x200000,
            free_end: 1 << 30,
            elastic: 0x4000,
            cmdline: "pages=5".into(),
        };
        let b = bi.to_bytes().unwrap();
        assert_eq!(u64::from_le_bytes(b[72..80].try_into().unwrap()), 0x4000);
        assert_eq!(&b[0..8], b"KUMOBOOT");
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 2);
        assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()), 2_000_000);
        assert_eq!(u64::from_le_bytes(b[64..72].try_into().unwrap()), LAPIC_START);
        assert_eq!(&b[120..128], b"pages=5\0");
        let long = KumoBootInfo { cmdline: "x".repeat(4000), ..bi };
        assert!(long.to_bytes().is_err());
    }

    #[test]
    fn entry_register_state() {
        let s = sregs_for(Entry::KumoGuest { rip: 0x100000 }, 1, 2, kvm_sregs::default());
        assert_eq!(s.efer & EFER_LMA, EFER_LMA);
        assert_eq!(s.cs.l, 1);
        assert_eq!(s.tr.selector, tss_selector(1));
        assert_eq!(s.tr.base, TSS_START + TSS_STRIDE);
        let r = regs_for(Entry::KumoGuest { rip: 0x100000 }, 1);
        assert_eq!((r.rip, r.rdi, r.rsi), (0x100000, KUMO_BOOT_INFO, 1));
        let p = sregs_for(Entry::Pvh { rip: 0x1000000, start_info: PVH_INFO_START }, 0, 1, kvm_sregs::default());
        assert_eq!((p.cr0 & CR0_PG, p.efer, p.cs.db, p.cs.l), (0, 0, 1, 0));
        assert_eq!(regs_for(Entry::Pvh { rip: 5, start_info: 6 }, 0).rbx, 6);
        assert_eq!(regs_for(Entry::Linux64 { rip: 5, boot_params: 7 }, 0).rsi, 7);
    }
}
