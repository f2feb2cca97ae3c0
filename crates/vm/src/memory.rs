//! Guest RAM: one memfd (so it can later be shared with another process, e.g. for local
//! migration) mapped once per RAM region.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::layout::ram_regions;
use crate::{Error, Result};

/// Guest memory. Each region carries a dirty bitmap that vm-memory sets on every write made
/// through its API: the pages the VMM itself writes (emulation assists, devices), which KVM's
/// dirty log does not see. Live migration merges both (`Vm::fetch_dirty`).
pub type GuestMemory = GuestMemoryMmap<AtomicBitmap>;

/// Guest RAM and the memfd behind it.
pub struct Memory {
    pub guest: GuestMemory,
    pub memfd: File,
    pub size: u64,
}

/// Smallest VM kumo builds: room for the boot structures below 1 MiB and a small guest above.
pub const MIN_MEMORY: u64 = 8 << 20;

impl Memory {
    pub fn new(size: u64) -> Result<Self> {
        if size < MIN_MEMORY || !size.is_multiple_of(4096) {
            return Err(Error::BadMemorySize(size));
        }
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kumo-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Memory(format!("memfd_create: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size).map_err(|e| Error::Memory(format!("cannot size guest RAM to {size} bytes: {e}")))?;
        Self::map(memfd, size)
    }

    /// Guest RAM backed by an existing memory file of exactly `size` bytes, e.g. the memfd of a
    /// VM migrating on the same host: both processes then share the same pages.
    pub fn from_file(memfd: File, size: u64) -> Result<Self> {
        if size < MIN_MEMORY || !size.is_multiple_of(4096) {
            return Err(Error::BadMemorySize(size));
        }
        let len = memfd.metadata().map_err(|e| Error::Memory(format!("memory file: {e}")))?.len();
        if len != size {
            return Err(Error::Memory(format!("memory file holds {len} bytes, the VM needs {size}")));
        }
        Self::map(memfd, size)
    }

    fn map(memfd: File, size: u64) -> Result<Self> {
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for (start, len) in ram_regions(size) {
            let fo = FileOffset::new(memfd.try_clone().map_err(|e| Error::Memory(e.to_string()))?, offset);
            let len_usize = usize::try_from(len).map_err(|_| Error::BadMemorySize(size))?;
            let mmap = MmapRegion::<AtomicBitmap>::from_file(fo, len_usize)
                .map_err(|e| Error::Memory(format!("mmap: {e}")))?;
            regions.push(
                GuestRegionMmap::new(mmap, GuestAddress(start))
                    .ok_or_else(|| Error::Memory("region overflow".into()))?,
            );
            offset += len;
        }
        let guest = GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))?;
        Ok(Memory { guest, memfd, size })
    }
}

/// Faults in `[gpa, gpa + len)` of guest memory in one batched kernel call
/// (`MADV_POPULATE_WRITE`). On nested hosts a demand fault per page costs several times more:
/// a migration receiver populates each incoming run of pages before copying it.
pub fn populate(mem: &GuestMemory, gpa: u64, len: u64) -> Result<()> {
    use vm_memory::GuestMemoryBackend;
    const MADV_POPULATE_WRITE: libc::c_int = 23; // Linux 5.14
    let host = mem
        .get_host_address(vm_memory::GuestAddress(gpa))
        .map_err(|e| Error::Memory(format!("populate {gpa:#x}: {e}")))?;
    // The run must lie inside one region: check its last byte maps contiguously.
    let last = mem
        .get_host_address(vm_memory::GuestAddress(gpa + len - 1))
        .map_err(|e| Error::Memory(format!("populate {gpa:#x}+{len:#x}: {e}")))?;
    if last as usize != host as usize + len as usize - 1 {
        return Err(Error::Memory(format!("populate {gpa:#x}+{len:#x} spans two regions")));
    }
    // SAFETY: the range lies within one live mapping of guest memory (checked above);
    // MADV_POPULATE_WRITE only faults pages in, it does not change their contents.
    let r = unsafe { libc::madvise(host as *mut libc::c_void, len as usize, MADV_POPULATE_WRITE) };
    if r != 0 {
        return Err(Error::Memory(format!("madvise(POPULATE_WRITE): {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// Parses sizes like `512M`, `2G`, `1048576`, `64KiB`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size (e.g. 512M, 2G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("`{s}` has an unknown unit (use K, M, G or T)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend as _};

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("12X").unwrap_err().contains("unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").unwrap_err().contains("too large"));
    }

    #[test]
    fn memory_is_memfd_backed_and_split_around_the_hole() {
        let m = Memory::new(16 << 20).unwrap();
        assert_eq!(m.guest.num_regions(), 1);
        m.guest.write_obj(0xdeadbeefu32, GuestAddress(0x1000)).unwrap();
        let mut b = [0u8; 4];
        std::os::unix::fs::FileExt::read_at(&m.memfd, &mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdeadbeef);
        assert!(matches!(Memory::new(1 << 20), Err(Error::BadMemorySize(_))));
        assert!(matches!(Memory::new((16 << 20) + 1), Err(Error::BadMemorySize(_))));
    }

    #[test]
    fn a_second_mapping_of_the_same_memfd_shares_pages() {
        let a = Memory::new(16 << 20).unwrap();
        a.guest.write_obj(0x1234_5678u32, GuestAddress(0x20_0000)).unwrap();
        let b = Memory::from_file(a.memfd.try_clone().unwrap(), 16 << 20).unwrap();
        assert_eq!(b.guest.read_obj::<u32>(GuestAddress(0x20_0000)).unwrap(), 0x1234_5678);
        b.guest.write_obj(7u32, GuestAddress(0x30_0000)).unwrap();
        assert_eq!(a.guest.read_obj::<u32>(GuestAddress(0x30_0000)).unwrap(), 7);
        let e = Memory::from_file(a.memfd.try_clone().unwrap(), 32 << 20).err().unwrap().to_string();
        assert!(e.contains("holds 16777216 bytes, the VM needs 33554432"), "{e}");
    }

    #[test]
    fn populate_faults_in_a_run_and_rejects_runs_across_regions() {
        let m = Memory::new(16 << 20).unwrap();
        populate(&m.guest, 0x10_0000, 0x40_0000).unwrap();
        assert_eq!(m.guest.read_obj::<u64>(GuestAddress(0x10_0000)).unwrap(), 0, "contents unchanged");
        assert!(populate(&m.guest, 0xff_f000, 0x2000).is_err(), "past the end of memory");
    }

    #[test]
    fn large_memory_has_two_regions() {
        // Sparse memfd: nothing is touched, so this costs no RAM.
        let m = Memory::new(4 << 30).unwrap();
        assert_eq!(m.guest.num_regions(), 2);
        assert!(m.guest.address_in_range(GuestAddress(0x1_0000_0000)));
        assert!(!m.guest.address_in_range(GuestAddress(0xc000_0000)));
    }
}
