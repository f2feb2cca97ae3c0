//! Guest RAM: one memfd (so it can later be shared with another process, e.g. for local
//! migration) mapped once per RAM region.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::{Arc, RwLock};

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::layout::MemoryLayout;
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
    /// The map the regions of `guest` follow.
    pub layout: MemoryLayout,
    /// Ranges taken out of the guest's reach (released elastic blocks).
    pub fences: Arc<Fences>,
    /// Every RAM page is faulted in through this mapping ([`Memory::prefault`]).
    pub prefaulted: bool,
}

/// Smallest VM kumo builds: room for the boot structures below 1 MiB and a small guest above.
pub const MIN_MEMORY: u64 = 8 << 20;

/// Host memory kept back from any one guest: max(512 MiB, 5 % of MemTotal), for the host
/// kernel, kumo itself (page tables, per-page dirty bitmaps, buffers) and other processes.
pub fn host_reserve(total: u64) -> u64 {
    (512u64 << 20).max(total / 20)
}

/// This host's RAM, from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// MemTotal in bytes.
    pub total: u64,
}

impl HostMemory {
    pub fn read() -> Result<HostMemory> {
        let text = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| Error::Memory(format!("cannot read /proc/meminfo: {e}")))?;
        let total =
            parse_meminfo_total(&text).ok_or_else(|| Error::Memory("/proc/meminfo has no MemTotal line".into()))?;
        Ok(HostMemory { total })
    }

    /// The most guest memory one VM may have here: MemTotal minus [`host_reserve`], in whole
    /// 4 KiB pages.
    pub fn usable(&self) -> u64 {
        self.total.saturating_sub(host_reserve(self.total)) & !4095
    }
}

/// MemTotal in bytes from the text of `/proc/meminfo` (`MemTotal:   24567890 kB`).
pub fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let mut words = line.split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    let mult = match words.next() {
        None => 1,
        Some(u) if u.eq_ignore_ascii_case("kb") => 1024,
        Some(_) => return None,
    };
    n.checked_mul(mult)
}

/// The one check of a guest memory size, before anything is allocated: a multiple of 4 KiB,
/// at least [`MIN_MEMORY`], and at most what `host` can back ([`HostMemory::usable`]).
pub fn check_size(size: u64, host: &HostMemory) -> Result<()> {
    if size < MIN_MEMORY || !size.is_multiple_of(4096) {
        return Err(Error::BadMemorySize(size));
    }
    if size > host.usable() {
        return Err(Error::MemoryTooLarge { size, usable: host.usable(), total: host.total });
    }
    Ok(())
}

/// Like [`human_size`], with the exact count added where the rounded one hides it, for
/// messages about sizes that are not whole units: `4 KiB (4097 bytes)`, but `0 B`, `8 MiB`.
pub fn human_size_exact(bytes: u64) -> String {
    let h = human_size(bytes);
    if bytes < 1024 || parse_size(&h).ok() == Some(bytes) {
        h
    } else {
        format!("{h} ({bytes} bytes)")
    }
}

/// A byte count in binary units for messages: `1000 TiB`, `23.1 GiB`, `4 KiB`, `100 B`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let (mut unit, mut scale) = (0, 1024u64);
    while unit + 1 < UNITS.len() && bytes / scale >= 1024 {
        unit += 1;
        scale <<= 10;
    }
    if bytes.is_multiple_of(scale) {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        let v = format!("{:.1}", bytes as f64 / scale as f64);
        format!("{} {}", v.strip_suffix(".0").unwrap_or(&v), UNITS[unit])
    }
}

impl Memory {
    /// Fresh guest RAM of `size` bytes, checked first ([`check_size`]): vm-memory allocates a
    /// dirty bitmap per page at once, so an unchecked size could abort the process.
    pub fn new(size: u64) -> Result<Self> {
        Self::map(Self::create(size)?, size, &[])
    }

    /// Faults every RAM page in through this mapping (a migration destination prepared in
    /// advance): writing guest memory then takes no page fault.
    pub fn prefault(&mut self) -> Result<()> {
        for &(gpa, len) in self.layout.ram() {
            populate(&self.guest, gpa, len)?;
        }
        self.prefaulted = true;
        Ok(())
    }

    fn create(size: u64) -> Result<File> {
        check_size(size, &HostMemory::read()?)?;
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kumo-guest-ram".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(Error::Memory(format!("memfd_create: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size).map_err(|e| Error::Memory(format!("cannot size guest RAM to {size} bytes: {e}")))?;
        // Its size is fixed for good: a process it is shared with (local migration) can rely on
        // it never shrinking under its mappings ([`check_sealed`]).
        // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own; checked.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } < 0 {
            return Err(Error::Memory(format!("cannot seal guest RAM: {}", std::io::Error::last_os_error())));
        }
        Ok(memfd)
    }

    /// Fresh guest RAM whose ranges `anonymous` (`(gpa, len)`, 2 MiB aligned, each inside one
    /// RAM region) are private anonymous memory with transparent huge pages instead of the
    /// memfd: memory that is given away and back at run time ([`discard`]), where dropping a
    /// 2 MiB page costs what dropping one 4 KiB page of a memfd does (measured here: 128 MiB of
    /// 4 KiB memfd pages take 32–50 ms to punch, of anonymous huge pages 0.5 ms). Such a VM
    /// cannot share its memory with another process (local migration).
    pub fn with_anonymous(size: u64, anonymous: &[(u64, u64)]) -> Result<Self> {
        Self::map(Self::create(size)?, size, anonymous)
    }

    /// Fresh guest RAM that is all private anonymous memory advised huge (`--private-memory`),
    /// like QEMU's and Cloud Hypervisor's default RAM: transparent huge pages whatever the host
    /// allows shared memory (`shmem_enabled`, which says `never` on many hosts and leaves a
    /// memfd on 4 KiB pages). No other process can map it: no vhost-user backend, no local
    /// migration. `size` must be whole 2 MiB pages.
    pub fn private(size: u64) -> Result<Self> {
        let ram = MemoryLayout::new(size).ram().to_vec();
        if !Self::private_fits(size) {
            return Err(Error::Memory(format!(
                "private memory is whole 2 MiB pages: {} is not a multiple of 2 MiB",
                human_size_exact(size)
            )));
        }
        Self::with_anonymous(size, &ram)
    }

    /// Whether RAM of `size` bytes can be private ([`Memory::private`]): every RAM region whole
    /// 2 MiB pages.
    pub fn private_fits(size: u64) -> bool {
        let two_m = |v: u64| v.is_multiple_of(2 << 20);
        MemoryLayout::new(size).ram().iter().all(|&(a, l)| two_m(a) && two_m(l))
    }

    /// Whether no page of RAM is in the memfd ([`Memory::private`]): the file is empty, so
    /// handing it to another process hands over nothing.
    pub fn is_private(&self) -> bool {
        use vm_memory::GuestMemoryBackend;
        self.guest.iter().all(|r| r.file_offset().is_none())
    }

    /// Guest RAM backed by an existing memory file of exactly `size` bytes, e.g. the memfd of a
    /// VM migrating on the same host: both processes then share the same pages. It must be a
    /// memfd sealed against resizing ([`check_sealed`]).
    pub fn from_file(memfd: File, size: u64) -> Result<Self> {
        check_size(size, &HostMemory::read()?)?;
        check_sealed(&memfd)?;
        let len = memfd.metadata().map_err(|e| Error::Memory(format!("memory file: {e}")))?.len();
        if len != size {
            return Err(Error::Memory(format!("memory file holds {len} bytes, the VM needs {size}")));
        }
        Self::map(memfd, size, &[])
    }

    fn map(memfd: File, size: u64, anonymous: &[(u64, u64)]) -> Result<Self> {
        let layout = MemoryLayout::new(size);
        let mut anon = anonymous.to_vec();
        anon.sort_unstable();
        for &(a, l) in &anon {
            let inside = layout.ram().iter().any(|&(s, rl)| a >= s && l > 0 && a + l <= s + rl);
            if !inside || !a.is_multiple_of(2 << 20) || !l.is_multiple_of(2 << 20) {
                return Err(Error::Memory(format!(
                    "anonymous range [{a:#x}, {:#x}) must be whole 2 MiB pages inside one RAM region",
                    a + l
                )));
            }
        }
        if anon.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(Error::Memory("anonymous ranges overlap".into()));
        }
        let mut regions = Vec::new();
        let mut offset = 0u64;
        let region = |mmap, gpa| {
            GuestRegionMmap::new(mmap, GuestAddress(gpa)).ok_or_else(|| Error::Memory("region overflow".into()))
        };
        for &(start, len) in layout.ram() {
            // The region in pieces: memfd-backed runs around the anonymous ranges inside it.
            let mut at = start;
            let inner: Vec<(u64, u64)> = anon.iter().copied().filter(|&(a, _)| a >= start && a < start + len).collect();
            for (a, l) in inner.into_iter().chain(std::iter::once((start + len, 0))) {
                if a > at {
                    let fo = FileOffset::new(
                        memfd.try_clone().map_err(|e| Error::Memory(e.to_string()))?,
                        offset + (at - start),
                    );
                    let n = usize::try_from(a - at).map_err(|_| Error::BadMemorySize(size))?;
                    let mmap = MmapRegion::<AtomicBitmap>::from_file(fo, n)
                        .map_err(|e| Error::Memory(format!("mmap: {e}")))?;
                    advise_huge(&mmap, n);
                    regions.push(region(mmap, at)?);
                }
                if l > 0 {
                    regions.push(region(anonymous_huge(l)?, a)?);
                }
                at = a + l;
            }
            offset += len;
        }
        let guest = GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))?;
        Ok(Memory { guest, memfd, size, layout, fences: Arc::default(), prefaulted: false })
    }
}

/// The seals guest RAM carries: its size never changes.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Checks that `f` is a memfd sealed against shrinking and growing. A memory file handed over
/// by another process (local migration) that it could still shrink would turn kumo's accesses
/// past the new end into SIGBUS: such a file is refused.
pub fn check_sealed(f: &File) -> Result<()> {
    // SAFETY: fcntl(F_GET_SEALS) on a descriptor we hold; checked.
    let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Error::Memory(format!(
            "the memory file is not a memfd ({}): refusing it (only a sealed memfd is mapped)",
            std::io::Error::last_os_error()
        )));
    }
    if seals & SIZE_SEALS != SIZE_SEALS {
        return Err(Error::Memory(
            "the memory memfd is not sealed against resizing (F_SEAL_SHRINK|F_SEAL_GROW): refusing it".into(),
        ));
    }
    Ok(())
}

/// Asks for transparent huge pages on guest memory: 2 MiB pages take the guest's TLB misses
/// (and, nested, the host's page walks) down by 512. For the memfd this takes effect where the
/// host lets shmem have them (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `advise`,
/// `within_size` or `always`; docs/design.md); elsewhere it changes nothing.
fn advise_huge(mmap: &MmapRegion<AtomicBitmap>, n: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        if matches!(shmem_huge_pages().as_deref(), Some("never" | "deny")) {
            tracing::info!(
                "guest memory gets 4 KiB pages: this host gives shared memory no huge pages \
                 (/sys/kernel/mm/transparent_hugepage/shmem_enabled); `advise` there gives guests 2 MiB pages"
            );
        }
    });
    // SAFETY: the range is `mmap`'s own mapping; MADV_HUGEPAGE only changes how its pages are
    // backed, never their contents.
    let r = unsafe { libc::madvise(mmap.as_ptr() as *mut libc::c_void, n, libc::MADV_HUGEPAGE) };
    if r != 0 {
        tracing::debug!("madvise(MADV_HUGEPAGE): {}", std::io::Error::last_os_error());
    }
}

/// The host's choice for huge pages in shared memory, which kumo's memfd guest RAM is: the
/// selected (bracketed) value of `shmem_enabled`, "always within_size advise [never] deny force".
/// None where the file is absent or unreadable.
pub fn shmem_huge_pages() -> Option<String> {
    let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    selected(&setting).map(str::to_string)
}

/// The bracketed choice of a sysfs list setting.
fn selected(setting: &str) -> Option<&str> {
    setting.split('[').nth(1)?.split(']').next()
}

/// `len` bytes of private anonymous memory, asking for transparent huge pages (Linux places
/// anonymous mappings of whole 2 MiB pages on 2 MiB boundaries; one that is not gets 4 KiB
/// pages at its ends, which only makes discarding slower).
fn anonymous_huge(len: u64) -> Result<MmapRegion<AtomicBitmap>> {
    let n = usize::try_from(len).map_err(|_| Error::BadMemorySize(len))?;
    let mmap = MmapRegion::<AtomicBitmap>::new(n).map_err(|e| Error::Memory(format!("mmap: {e}")))?;
    // SAFETY: the range is the mapping just made, which `mmap` owns; MADV_HUGEPAGE only
    // changes how its pages are backed, never their contents.
    let r = unsafe { libc::madvise(mmap.as_ptr() as *mut libc::c_void, n, libc::MADV_HUGEPAGE) };
    if r != 0 {
        tracing::debug!("madvise(MADV_HUGEPAGE): {}", std::io::Error::last_os_error());
    }
    if !(mmap.as_ptr() as usize).is_multiple_of(2 << 20) {
        tracing::warn!("anonymous guest memory not 2 MiB aligned: discarding it will be slower");
    }
    Ok(mmap)
}

/// Gives the host pages behind `[gpa, gpa + len)` (inside one region) back to the host: the
/// guest reads zeros there afterwards. Private anonymous memory ([`Memory::with_anonymous`]) is
/// dropped with `MADV_DONTNEED`, memfd-backed memory punched out of the file (`MADV_REMOVE`).
pub fn discard(mem: &GuestMemory, gpa: u64, len: u64, anonymous: bool) -> Result<()> {
    if !gpa.is_multiple_of(4096) || !len.is_multiple_of(4096) || len == 0 {
        return Err(Error::Memory(format!("discard {gpa:#x}+{len:#x}: not whole 4 KiB pages")));
    }
    let host = host_run(mem, gpa, len, "discard")?;
    let advice = if anonymous { libc::MADV_DONTNEED } else { libc::MADV_REMOVE };
    // SAFETY: the range lies within one live mapping of guest memory (checked by host_run);
    // dropping its pages is what the caller asks for: the guest has given this memory up.
    let r = unsafe { libc::madvise(host as *mut libc::c_void, len as usize, advice) };
    if r != 0 {
        return Err(Error::Memory(format!("discard {gpa:#x}+{len:#x}: {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// Guest-physical ranges kumo has taken out of the guest's reach, each with what it is (for the
/// error a guest touching one gets).
///
/// A fenced range is mapped `PROT_NONE` in kumo, so KVM cannot fault its pages into the guest:
/// a guest access ends KVM_RUN with EFAULT and a `KVM_EXIT_MEMORY_FAULT` naming the address
/// (`KVM_CAP_MEMORY_FAULT_INFO`), or, for an access KVM emulates, with an MMIO exit at it. Both
/// are reported by the vCPU as [`crate::Error::FencedAccess`]. This was chosen over removing the
/// range from its KVM memory slot: a slot change zaps every shadow page of the VM on a host
/// without TDP (this nested one) and costs two SRCU grace periods, where `mprotect` only zaps
/// the range's own mappings through the MMU notifier. kumo itself must not touch a fenced range
/// either (it would take SIGSEGV): nothing of kumo's lives in one, and elastic VMs have no
/// devices that write guest memory at the guest's request.
#[derive(Debug, Default)]
pub struct Fences {
    /// Start GPA -> (length, what it is).
    ranges: RwLock<BTreeMap<u64, (u64, String)>>,
}

impl Fences {
    fn ranges(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, (u64, String)>> {
        self.ranges.read().unwrap_or_else(|p| p.into_inner())
    }

    fn ranges_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u64, (u64, String)>> {
        self.ranges.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `[gpa, gpa + len)` (whole pages inside one region) out of the guest's reach;
    /// `what` names it in the error of a guest that touches it. Booked before the mapping
    /// changes, so a fault on it always finds its name.
    pub fn fence(&self, mem: &GuestMemory, gpa: u64, len: u64, what: &str) -> Result<()> {
        self.ranges_mut().insert(gpa, (len, what.to_string()));
        protect(mem, gpa, len, libc::PROT_NONE).inspect_err(|_| {
            self.ranges_mut().remove(&gpa);
        })
    }

    /// Gives `[gpa, gpa + len)`, fenced before, back to the guest.
    pub fn unfence(&self, mem: &GuestMemory, gpa: u64, len: u64) -> Result<()> {
        protect(mem, gpa, len, libc::PROT_READ | libc::PROT_WRITE)?;
        self.ranges_mut().remove(&gpa);
        Ok(())
    }

    /// What the fenced range holding `gpa` is, if one does.
    pub fn find(&self, gpa: u64) -> Option<String> {
        let r = self.ranges();
        let (start, (len, what)) = r.range(..=gpa).next_back()?;
        (gpa - start < *len).then(|| what.clone())
    }

    pub fn is_empty(&self) -> bool {
        self.ranges().is_empty()
    }

    /// The fenced ranges `(gpa, len)`, in order.
    pub fn list(&self) -> Vec<(u64, u64)> {
        self.ranges().iter().map(|(&gpa, (len, _))| (gpa, *len)).collect()
    }
}

/// `mprotect` of guest memory `[gpa, gpa + len)` (whole pages inside one region).
fn protect(mem: &GuestMemory, gpa: u64, len: u64, prot: libc::c_int) -> Result<()> {
    if !gpa.is_multiple_of(4096) || !len.is_multiple_of(4096) || len == 0 {
        return Err(Error::Memory(format!("protect {gpa:#x}+{len:#x}: not whole 4 KiB pages")));
    }
    let host = host_run(mem, gpa, len, "protect")?;
    // SAFETY: the range lies within one live mapping of guest memory (checked by host_run).
    // Only its access rights change; kumo keeps no references into fenced ranges (see Fences).
    let r = unsafe { libc::mprotect(host as *mut libc::c_void, len as usize, prot) };
    if r != 0 {
        return Err(Error::Memory(format!("mprotect {gpa:#x}+{len:#x}: {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// Faults in `[gpa, gpa + len)` of guest memory in one batched kernel call
/// (`MADV_POPULATE_WRITE`). On nested hosts a demand fault per page costs several times more:
/// a migration receiver populates each incoming run of pages before copying it.
pub fn populate(mem: &GuestMemory, gpa: u64, len: u64) -> Result<()> {
    const MADV_POPULATE_WRITE: libc::c_int = 23; // Linux 5.14
    let host = host_run(mem, gpa, len, "populate")?;
    // SAFETY: the range lies within one live mapping of guest memory (checked by host_run);
    // MADV_POPULATE_WRITE only faults pages in, it does not change their contents.
    let r = unsafe { libc::madvise(host as *mut libc::c_void, len as usize, MADV_POPULATE_WRITE) };
    if r != 0 {
        return Err(Error::Memory(format!("madvise(POPULATE_WRITE): {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// The host address of `[gpa, gpa + len)`, which must lie inside one region (`what` names the
/// caller in errors).
fn host_run(mem: &GuestMemory, gpa: u64, len: u64, what: &str) -> Result<*mut u8> {
    use vm_memory::GuestMemoryBackend;
    let host = mem
        .get_host_address(vm_memory::GuestAddress(gpa))
        .map_err(|e| Error::Memory(format!("{what} {gpa:#x}: {e}")))?;
    // The run must lie inside one region: check its last byte maps contiguously.
    let last = mem
        .get_host_address(vm_memory::GuestAddress(gpa + len.max(1) - 1))
        .map_err(|e| Error::Memory(format!("{what} {gpa:#x}+{len:#x}: {e}")))?;
    if last as usize != host as usize + len.max(1) as usize - 1 {
        return Err(Error::Memory(format!("{what} {gpa:#x}+{len:#x} spans two regions")));
    }
    Ok(host)
}

/// Binds guest memory `[gpa, gpa + len)` (page-aligned, inside one region) to host NUMA node
/// `node` with `mbind(MPOL_BIND)`: pages faulted from now on come from that node, and pages
/// already there are moved (`MPOL_MF_MOVE`, those only this process maps). Guest memory is a
/// shared memfd mapping, so the policy lives in the file and holds for every mapping of it.
pub fn bind_to_host_node(mem: &GuestMemory, gpa: u64, len: u64, node: u32) -> Result<()> {
    const MPOL_MF_MOVE: libc::c_uint = 1 << 1;
    if !gpa.is_multiple_of(4096) || !len.is_multiple_of(4096) || len == 0 {
        return Err(Error::Memory(format!("bind {gpa:#x}+{len:#x}: not whole 4 KiB pages")));
    }
    let host = host_run(mem, gpa, len, "bind")?;
    let bits = u64::BITS as usize;
    let mut mask = vec![0u64; node as usize / bits + 1];
    mask[node as usize / bits] |= 1 << (node as usize % bits);
    // The kernel reads maxnode - 1 bits of the mask.
    let maxnode = (mask.len() * bits + 1) as libc::c_ulong;
    // SAFETY: the range lies within one live mapping of guest memory (checked by host_run) and
    // `mask` holds maxnode - 1 bits; mbind changes only the placement policy of those pages.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            host as *mut libc::c_void,
            len as libc::c_ulong,
            libc::MPOL_BIND,
            mask.as_ptr(),
            maxnode,
            MPOL_MF_MOVE,
        )
    };
    if r != 0 {
        return Err(Error::Memory(format!(
            "cannot bind guest memory [{gpa:#x}, {:#x}) to host node {node}: mbind: {}",
            gpa + len,
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Reads a size in bytes from a number or a [`parse_size`] string ("256M"), for
/// `#[serde(deserialize_with = ...)]` in config files, streams and API bodies.
pub fn deserialize_size<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Size {
        N(u64),
        S(String),
    }
    match <Size as serde::Deserialize>::deserialize(d)? {
        Size::N(n) => Ok(n),
        Size::S(s) => parse_size(&s).map_err(serde::de::Error::custom),
    }
}

/// Parses sizes like `512M`, `2G`, `1.5G`, `1048576`, `64KiB` (binary units up to P). A
/// decimal must come to whole bytes; sizes past 16 EiB are refused, never wrapped.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("`{s}` is not a size (e.g. 512M, 1.5G)");
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() || (num.contains('.') && frac.is_empty()) || frac.contains('.') {
        return Err(not_a_size());
    }
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        _ => return Err(format!("`{s}` has an unknown unit (use K, M, G, T or P)")),
    };
    let too_large = || format!("`{s}` is too large (sizes stop at 16 EiB)");
    // Digits as an exact u128 fraction num / 10^k; 25 digits keep num * mult below 2^128.
    let digits = format!("{int}{frac}");
    if digits.trim_start_matches('0').len() > 25 || frac.len() > 25 {
        return Err(too_large());
    }
    let n: u128 = digits.parse().map_err(|_| not_a_size())?;
    let scaled = n * mult;
    let den = 10u128.pow(frac.len() as u32);
    if !scaled.is_multiple_of(den) {
        return Err(format!("`{s}` is not a whole number of bytes"));
    }
    u64::try_from(scaled / den).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_choice_of_a_sysfs_list_is_the_bracketed_one() {
        assert_eq!(selected("always within_size advise [never] deny force\n"), Some("never"));
        assert_eq!(selected("[always] advise never\n"), Some("always"));
        assert_eq!(selected("always advise never\n"), None);
        assert_eq!(selected(""), None);
    }
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
    fn sizes_table() {
        let ok: &[(&str, u64)] = &[
            ("0", 0),
            (" 8M ", 8 << 20),
            ("1.5G", 3 << 29),
            ("1.5 GiB", 3 << 29),
            ("0.5k", 512),
            ("1P", 1 << 50),
            ("0.25M", 256 << 10),
            ("18446744073709551615", u64::MAX),
            ("000000000000000000000000000001G", 1 << 30),
        ];
        for (s, want) in ok {
            assert_eq!(parse_size(s), Ok(*want), "{s}");
        }
        let bad: &[(&str, &str)] = &[
            ("", "not a size"),
            ("G", "not a size"),
            ("-1G", "not a size"),
            ("1.G", "not a size"),
            (".5G", "not a size"),
            ("1.2.3G", "not a size"),
            ("1.3B", "whole number of bytes"),
            ("0.1K", "whole number of bytes"),
            ("18446744073709551616", "too large"),
            ("16384P", "too large"),
            ("99999999999T", "too large"),
            ("99999999999999999999999999999999999999999T", "too large"),
            ("1E", "unknown unit"),
        ];
        for (s, want) in bad {
            let e = parse_size(s).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{s}: {e}");
        }
    }

    #[test]
    fn meminfo_total() {
        let sample = "MemTotal:       24567892 kB\nMemFree:         1234567 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo_total(sample), Some(24_567_892 * 1024));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\nMemTotal: 2048 kB\n"), Some(2 << 20));
        assert_eq!(parse_meminfo_total("MemTotal: 4096\n"), Some(4096));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_meminfo_total("MemTotal: lots kB\n"), None);
        assert_eq!(parse_meminfo_total("MemTotal: 1 MB\n"), None);
        assert_eq!(parse_meminfo_total("MemTotal: 99999999999999999999 kB\n"), None);
        assert!(HostMemory::read().unwrap().total > 0);
    }

    #[test]
    fn host_reserve_and_memory_checks() {
        // Small hosts keep 512 MiB back, large ones 5 %.
        assert_eq!(HostMemory { total: 4 << 30 }.usable(), (4 << 30) - (512 << 20));
        assert_eq!(HostMemory { total: 100 << 30 }.usable(), 95 << 30);
        assert_eq!(HostMemory { total: (24 << 30) + 4096 }.usable() % 4096, 0);
        assert_eq!(HostMemory { total: 256 << 20 }.usable(), 0);
        let host = HostMemory { total: 24 << 30 };
        for ok in [MIN_MEMORY, 256 << 20, 20 << 30, host.usable()] {
            check_size(ok, &host).unwrap();
        }
        let msg = |size| check_size(size, &host).unwrap_err().to_string();
        assert!(msg(0).contains("at least 8 MiB"));
        assert!(msg(MIN_MEMORY - 4096).contains("at least 8 MiB"));
        assert!(msg((64 << 20) + 1).contains("multiple of 4 KiB"));
        assert_eq!(msg(1000 << 40), "memory 1000 TiB is more than this host can back (22.8 GiB usable of 24 GiB)");
        assert!(msg(host.usable() + 4096).contains("more than this host can back"));
        assert!(msg(!4095u64).contains("more than this host can back"));
        assert!(matches!(check_size(1 << 50, &HostMemory { total: 0 }), Err(Error::MemoryTooLarge { .. })));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_size_exact(0), "0 B");
        assert_eq!(human_size_exact(8 << 20), "8 MiB");
        assert!(human_size_exact(4097).ends_with("(4097 bytes)"), "{}", human_size_exact(4097));
        assert_eq!(human_size(100), "100 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1000 << 40), "1000 TiB");
        assert_eq!(human_size(24 << 30), "24 GiB");
        assert_eq!(human_size((23 << 30) + (1 << 27)), "23.1 GiB");
        assert_eq!(human_size(u64::MAX), "16 EiB");
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
    fn only_a_memfd_sealed_against_resizing_is_taken() {
        let m = Memory::new(16 << 20).unwrap();
        check_sealed(&m.memfd).unwrap();
        assert!(m.memfd.set_len(8 << 20).is_err(), "sealed: it cannot shrink");
        // An unsealed memfd of the right size, and a plain file, are refused.
        // SAFETY: memfd_create with a NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        let unsealed = unsafe { File::from_raw_fd(fd) };
        unsealed.set_len(16 << 20).unwrap();
        let e = Memory::from_file(unsealed, 16 << 20).err().unwrap().to_string();
        assert!(e.contains("not sealed against resizing"), "{e}");
        let plain = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(check_sealed(&plain).unwrap_err().to_string().contains("not a memfd"));
    }

    #[test]
    fn populate_faults_in_a_run_and_rejects_runs_across_regions() {
        let m = Memory::new(16 << 20).unwrap();
        populate(&m.guest, 0x10_0000, 0x40_0000).unwrap();
        assert_eq!(m.guest.read_obj::<u64>(GuestAddress(0x10_0000)).unwrap(), 0, "contents unchanged");
        assert!(populate(&m.guest, 0xff_f000, 0x2000).is_err(), "past the end of memory");
    }

    /// `/proc/self/numa_maps` lines of the mappings starting in `[start, end)`.
    fn numa_maps(start: usize, end: usize) -> Vec<String> {
        let text = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
        text.lines()
            .filter(|l| {
                let a = l.split_whitespace().next().and_then(|a| usize::from_str_radix(a, 16).ok());
                a.is_some_and(|a| (start..end).contains(&a))
            })
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn bind_to_host_node_sets_the_policy_of_each_range() {
        if !std::path::Path::new("/sys/devices/system/node/node0").is_dir() {
            eprintln!("skipping bind_to_host_node_sets_the_policy_of_each_range: no host NUMA node 0");
            return;
        }
        use vm_memory::GuestMemoryBackend;
        let m = Memory::new(16 << 20).unwrap();
        // A page touched before the bind is moved; the rest are faulted after it.
        m.guest.write_obj(1u64, GuestAddress(0x9000)).unwrap();
        let base = m.guest.get_host_address(GuestAddress(0)).unwrap() as usize;
        let at = |off: usize| {
            numa_maps(base, base + (16 << 20))
                .into_iter()
                .rfind(|l| usize::from_str_radix(l.split(' ').next().unwrap(), 16).unwrap() <= base + off)
                .unwrap_or_else(|| panic!("no numa_maps line for {:#x}", base + off))
        };
        // Two guest nodes, both on this one-node host's node 0: the first alone bound, the
        // mapping is split where the policy changes.
        bind_to_host_node(&m.guest, 0, 8 << 20, 0).unwrap();
        assert!(at(0).contains(" bind:0 "), "{}", at(0));
        assert!(at(8 << 20).contains(" default "), "{}", at(8 << 20));
        bind_to_host_node(&m.guest, 8 << 20, 8 << 20, 0).unwrap();
        m.guest.write_obj(2u64, GuestAddress(0xa0_0000)).unwrap();
        for off in [0, 8 << 20, (16 << 20) - 4096] {
            assert!(at(off).contains(" bind:0 "), "{}", at(off));
        }
        assert!(at(0).contains(" N0="), "pages on node 0: {}", at(0));
        assert!(bind_to_host_node(&m.guest, 0x1000, 0x800, 0).unwrap_err().to_string().contains("4 KiB pages"));
        assert!(bind_to_host_node(&m.guest, 15 << 20, 2 << 20, 0).is_err(), "past the end of memory");
        let e = bind_to_host_node(&m.guest, 0, 4096, 1000).unwrap_err().to_string();
        assert!(e.contains("to host node 1000: mbind"), "{e}");
    }

    #[test]
    fn large_memory_has_two_regions() {
        if HostMemory::read().unwrap().usable() < 4 << 30 {
            eprintln!("skipping large_memory_has_two_regions: this host cannot back 4 GiB");
            return;
        }
        // Sparse memfd: nothing is touched, so this costs no RAM.
        let m = Memory::new(4 << 30).unwrap();
        assert_eq!(m.guest.num_regions(), 2);
        assert!(m.guest.address_in_range(GuestAddress(0x1_0000_0000)));
        assert!(!m.guest.address_in_range(GuestAddress(0xc000_0000)));
    }

    #[test]
    fn fenced_ranges_are_named_and_come_back_as_zeros() {
        let m = Memory::with_anonymous(32 << 20, &[(16 << 20, 4 << 20)]).unwrap();
        m.guest.write_obj(7u64, GuestAddress(17 << 20)).unwrap();
        m.fences.fence(&m.guest, 16 << 20, 2 << 20, "block 0").unwrap();
        m.fences.fence(&m.guest, 18 << 20, 2 << 20, "block 1").unwrap();
        assert_eq!(m.fences.find(17 << 20).as_deref(), Some("block 0"));
        assert_eq!(m.fences.find((20 << 20) - 1).as_deref(), Some("block 1"));
        assert_eq!(m.fences.find(20 << 20), None);
        assert_eq!(m.fences.find((16 << 20) - 1), None);
        discard(&m.guest, 16 << 20, 2 << 20, true).unwrap();
        m.fences.unfence(&m.guest, 16 << 20, 2 << 20).unwrap();
        assert_eq!(m.fences.find(17 << 20), None);
        assert_eq!(m.guest.read_obj::<u64>(GuestAddress(17 << 20)).unwrap(), 0, "zeros again");
        m.fences.unfence(&m.guest, 18 << 20, 2 << 20).unwrap();
        assert!(m.fences.is_empty());
        assert!(m.fences.fence(&m.guest, 31 << 20, 4 << 20, "x").is_err(), "past the end");
        assert!(m.fences.is_empty(), "a failed fence is not booked");
    }

    #[test]
    fn private_memory_is_anonymous_in_every_region_and_whole_2m_pages() {
        let m = Memory::private(32 << 20).unwrap();
        assert!(m.is_private());
        assert!(!Memory::new(32 << 20).unwrap().is_private());
        assert!(!Memory::with_anonymous(32 << 20, &[(16 << 20, 4 << 20)]).unwrap().is_private());
        m.guest.write_obj(0x1234_5678u32, GuestAddress(0x20_0000)).unwrap();
        assert_eq!(m.guest.read_obj::<u32>(GuestAddress(0x20_0000)).unwrap(), 0x1234_5678);
        let e = Memory::private((32 << 20) + 4096).err().expect("not whole 2 MiB pages");
        assert!(e.to_string().contains("2 MiB"), "{e}");
        assert!(Memory::private_fits(32 << 20) && Memory::private_fits(6 << 30));
        assert!(!Memory::private_fits((32 << 20) + 4096));
    }

    #[test]
    fn anonymous_ranges_are_their_own_regions_and_discard_to_zeros() {
        use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};
        let m = Memory::with_anonymous(32 << 20, &[(8 << 20, 4 << 20), (28 << 20, 4 << 20)]).unwrap();
        let spans: Vec<(u64, u64)> = m.guest.iter().map(|r| (r.start_addr().0, r.len())).collect();
        assert_eq!(spans, [(0, 8 << 20), (8 << 20, 4 << 20), (12 << 20, 16 << 20), (28 << 20, 4 << 20)]);
        for gpa in [0x1000u64, 9 << 20, 20 << 20, 30 << 20] {
            m.guest.write_obj(0xa5a5_a5a5_u32, GuestAddress(gpa)).unwrap();
        }
        discard(&m.guest, 8 << 20, 4 << 20, true).unwrap();
        discard(&m.guest, 12 << 20, 16 << 20, false).unwrap();
        let r = |gpa: u64| m.guest.read_obj::<u32>(GuestAddress(gpa)).unwrap();
        assert_eq!((r(0x1000), r(9 << 20), r(20 << 20), r(30 << 20)), (0xa5a5_a5a5, 0, 0, 0xa5a5_a5a5));
        assert!(discard(&m.guest, 10 << 20, 4 << 20, true).unwrap_err().to_string().contains("spans two regions"));
        assert!(Memory::with_anonymous(32 << 20, &[(1 << 20, 2 << 20)]).is_err());
        assert!(Memory::with_anonymous(32 << 20, &[(30 << 20, 4 << 20)]).is_err());
    }
}
