//! Dirty page tracking for live migration.
//!
//! Guest writes are tracked by KVM's dirty log per memory slot. Where KVM offers
//! `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`, reading the log and re-protecting pages are separate
//! steps: [`Vm::harvest_dirty`] reads (`KVM_GET_DIRTY_LOG`) and leaves the pages writable, and
//! [`Vm::rearm_dirty`] re-protects a batch of them (`KVM_CLEAR_DIRTY_LOG`) right before it is
//! sent. A page the guest writes between the two costs no fault and is sent once, as it is
//! when sent. With `KVM_DIRTY_LOG_INITIALLY_SET` (where offered) starting the log protects
//! nothing either: every page counts as dirty until its first batch re-arms it, so round 0
//! write-protects memory batch by batch as it goes, not all at once. Pages the guest never
//! touched are found with `mincore` and the memfd's `SEEK_DATA`: they are holes in the file and
//! need not be sent. The dirty-page model samples D(t) during round 0, which needs pages armed
//! from its start: with INITIALLY_SET one page in 64 ([`Sample`]) is armed at once and left
//! armed through round 0, and D(t) is estimated from it.
//!
//! KVM's log sees only the guest's own writes. Pages kumo writes into guest memory (an
//! emulation assist storing a result, later a device doing DMA) are marked by vm-memory in the
//! regions' bitmaps ([`crate::GuestMemory`]); `fetch_dirty` merges those in too.

use kvm_bindings::{kvm_clear_dirty_log, kvm_enable_cap, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iowr_nr;

use std::sync::atomic::Ordering;

/// The page set the dirty log fills, defined in the pure migration crate (its rounds send it).
pub use kumo_migration::PageBitmap;

use crate::vm::{Sample, Vm};
use crate::{Error, Result};

pub const PAGE_SIZE: u64 = 4096;
const KVMIO: u32 = 0xAE;
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// The bitmap of pages kumo wrote in `region` (through vm-memory), one bit per page.
fn vmm_bitmap(
    region: &vm_memory::GuestRegionMmap<vm_memory::bitmap::AtomicBitmap>,
) -> &vm_memory::bitmap::AtomicBitmap {
    // The region derefs to its mapping, which owns the whole-region bitmap.
    std::ops::Deref::deref(region).bitmap()
}

impl Vm {
    /// Starts tracking guest writes. Returns whether manual re-protection is in use.
    pub fn start_dirty_log(&self) -> Result<bool> {
        // The flags KVM offers (KVM_DIRTY_LOG_MANUAL_CAPS), 0 without manual protection.
        let offered = self.kvm.check_extension_raw(kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 as _) as u64;
        let manual = offered & kvm_bindings::KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as u64 != 0;
        if manual && !self.dirty_manual.load(Ordering::Acquire) {
            let init = offered & kvm_bindings::KVM_DIRTY_LOG_INITIALLY_SET as u64 != 0;
            let mut cap = kvm_enable_cap { cap: kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, ..Default::default() };
            cap.args[0] = kvm_bindings::KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as u64;
            if init {
                cap.args[0] |= kvm_bindings::KVM_DIRTY_LOG_INITIALLY_SET as u64;
            }
            self.fd.enable_cap(&cap).map_err(|e| Error::Kvm("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)", e))?;
            self.dirty_initially_set.store(init, Ordering::Release);
            self.dirty_manual.store(true, Ordering::Release);
        }
        *self.sample() = None;
        self.set_slot_flags(KVM_MEM_LOG_DIRTY_PAGES)?;
        // What kumo wrote before now is in round 0 anyway (it touched the page).
        for region in self.memory.guest.iter() {
            vmm_bitmap(region).reset();
        }
        Ok(self.dirty_manual.load(Ordering::Acquire))
    }

    /// Stops tracking guest writes (e.g. after a failed migration, so the guest runs at full speed).
    pub fn stop_dirty_log(&self) -> Result<()> {
        *self.sample() = None;
        self.set_slot_flags(0)
    }

    fn sample(&self) -> std::sync::MutexGuard<'_, Option<Sample>> {
        self.dirty_sample.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_slot_flags(&self, flags: u32) -> Result<()> {
        for (slot, region) in self.memory.guest.iter().enumerate() {
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the same live mapping the slot already has, owned by `self.memory`; only
            // the flags change.
            unsafe { self.fd.set_user_memory_region(r) }.map_err(|e| Error::Kvm("KVM_SET_USER_MEMORY_REGION", e))?;
        }
        Ok(())
    }

    /// Adds the pages the guest or kumo wrote since the last fetch to `into` and re-arms
    /// tracking for them. Returns how many pages were dirty.
    pub fn fetch_dirty(&self, into: &mut PageBitmap) -> Result<u64> {
        self.read_dirty(into, true)
    }

    /// Adds the pages the guest or kumo wrote since they were last armed to `into`, leaving
    /// them writable: [`Vm::rearm_dirty`] re-protects each batch before it is sent (without
    /// manual protection KVM re-arms them as it reads). Returns how many pages were dirty.
    pub fn harvest_dirty(&self, into: &mut PageBitmap) -> Result<u64> {
        // Round 0 is over: its sample pages are ordinary from now on.
        *self.sample() = None;
        self.read_dirty(into, false)
    }

    fn read_dirty(&self, into: &mut PageBitmap, rearm: bool) -> Result<u64> {
        let mut total = 0;
        for (slot, region) in self.memory.guest.iter().enumerate() {
            // kumo's own writes first: a page it writes after this read is caught next time.
            let vmm = vmm_bitmap(region).get_and_reset();
            let bits = self
                .fd
                .get_dirty_log(slot as u32, region.len() as usize)
                .map_err(|e| Error::Kvm("KVM_GET_DIRTY_LOG", e))?;
            let (_, _, dst) = &mut into.regions[slot];
            for (d, (k, v)) in dst.iter_mut().zip(bits.iter().zip(vmm.iter().chain(std::iter::repeat(&0)))) {
                total += (k | v).count_ones() as u64;
                *d |= k | v;
            }
            if rearm && self.dirty_manual.load(Ordering::Acquire) && bits.iter().any(|&w| w != 0) {
                self.clear_dirty_log(slot as u32, 0, (region.len() / PAGE_SIZE) as u32, &bits)?;
            }
        }
        Ok(total)
    }

    /// `KVM_CLEAR_DIRTY_LOG` on `slot`: re-protects the pages of `bits` from slot page `first`
    /// (a multiple of 64) on, `num` pages (a multiple of 64 unless the span ends the slot).
    fn clear_dirty_log(&self, slot: u32, first: u64, num: u32, bits: &[u64]) -> Result<()> {
        let mut clear = kvm_clear_dirty_log { slot, num_pages: num, first_page: first, ..Default::default() };
        clear.__bindgen_anon_1.dirty_bitmap = bits.as_ptr() as *mut libc::c_void;
        // SAFETY: `clear` points at `bits`, a bitmap of at least `num` bits that outlives the
        // call; KVM only reads it.
        let ret = unsafe { ioctl_with_ref(self.fd.as_ref(), KVM_CLEAR_DIRTY_LOG(), &clear) };
        if ret < 0 {
            return Err(Error::Kvm("KVM_CLEAR_DIRTY_LOG", vmm_sys_util::errno::Error::last()));
        }
        Ok(())
    }

    /// Re-protects `gfns` (ascending, as a batch is) so that the guest's next write to each is
    /// logged again: called for a batch right before its pages are read. A no-op without
    /// manual protection (the harvest re-armed them).
    pub fn rearm_dirty(&self, gfns: &[u64]) -> Result<()> {
        if !self.dirty_manual.load(Ordering::Acquire) || gfns.is_empty() {
            return Ok(());
        }
        let slots: Vec<(u64, u64)> =
            self.memory.guest.iter().map(|r| (r.start_addr().0 / PAGE_SIZE, r.len() / PAGE_SIZE)).collect();
        let sample = self.sample();
        for mut span in clear_spans(gfns, &slots) {
            // Round 0's sample pages stay armed from its start.
            if let Some((_, _, keep)) = sample.as_ref().and_then(|s| s.pages.regions.get(span.slot as usize)) {
                let first_word = (span.first / 64) as usize;
                for (w, k) in span.bits.iter_mut().zip(&keep[first_word..]) {
                    *w &= !k;
                }
            }
            self.clear_dirty_log(span.slot, span.first, span.num, &span.bits)?;
        }
        Ok(())
    }

    /// The pages round 0 sends: those that exist in the memfd ([`Vm::touched_pages`]). With
    /// `INITIALLY_SET` every other page counts as dirty too, so they are re-armed here; a page
    /// first written between that look and the re-arm would be lost, so the look runs
    /// again after it and the pages it adds are sent as well.
    pub fn first_round_pages(&self) -> Result<PageBitmap> {
        let touched = self.touched_pages()?;
        if !self.dirty_initially_set.load(Ordering::Acquire) {
            return Ok(touched);
        }
        for (slot, (_, pages, bits)) in touched.regions.iter().enumerate() {
            let mut holes: Vec<u64> = bits.iter().map(|w| !w).collect();
            if let Some(last) = holes.last_mut().filter(|_| pages % 64 != 0) {
                *last &= (1u64 << (pages % 64)) - 1;
            }
            self.clear_dirty_log(slot as u32, 0, *pages as u32, &holes)?;
        }
        let touched = self.touched_pages()?;
        // The sample: the first page of each 64 where round 0 sends it, armed from now on.
        let mut pages = touched.clone();
        for (slot, (_, n, bits)) in pages.regions.iter_mut().enumerate() {
            bits.iter_mut().for_each(|w| *w &= 1);
            self.clear_dirty_log(slot as u32, 0, *n as u32, bits)?;
        }
        let scale = touched.count() as f64 / pages.count().max(1) as f64;
        *self.sample() = Some(Sample { pages, scale });
        Ok(touched)
    }

    /// Distinct pages dirtied since tracking started or pages were last re-protected, without
    /// changing anything: with manual protection, `KVM_GET_DIRTY_LOG` only reads. With
    /// INITIALLY_SET, estimated from round 0's [`Sample`] (None outside round 0). `None` when
    /// manual protection is off (then a read would also clear).
    pub fn peek_dirty_count(&self) -> Result<Option<u64>> {
        if !self.dirty_manual.load(Ordering::Acquire) {
            return Ok(None);
        }
        // With INITIALLY_SET the log also holds every page not yet sent: the estimate comes
        // from round 0's sample pages, armed since it began.
        if self.dirty_initially_set.load(Ordering::Acquire) {
            let sample = self.sample();
            let Some(s) = sample.as_ref() else { return Ok(None) };
            let mut n = 0;
            for (slot, (region, (_, _, keep))) in self.memory.guest.iter().zip(&s.pages.regions).enumerate() {
                let bits = self
                    .fd
                    .get_dirty_log(slot as u32, region.len() as usize)
                    .map_err(|e| Error::Kvm("KVM_GET_DIRTY_LOG", e))?;
                n += bits.iter().zip(keep).map(|(b, k)| (b & k).count_ones() as u64).sum::<u64>();
            }
            return Ok(Some((n as f64 * s.scale).round() as u64));
        }
        let mut n = 0;
        for (slot, region) in self.memory.guest.iter().enumerate() {
            let bits = self
                .fd
                .get_dirty_log(slot as u32, region.len() as usize)
                .map_err(|e| Error::Kvm("KVM_GET_DIRTY_LOG", e))?;
            n += bits.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        }
        Ok(Some(n))
    }

    /// Pages that hold data: everything the guest or kumo ever touched. Never-touched pages
    /// read as zeros on both sides, so round 0 skips them. `mincore` on the mapping finds the
    /// resident pages (~1 ms per 512 MiB of a memfd where this process has them mapped, 0.15 ms
    /// per 2 GiB of private huge pages). It counts a page the host swapped out as absent, so
    /// the runs it calls absent are looked up again: in the memfd itself (`SEEK_DATA`: a
    /// swapped-out page is data there; the file alone would do, but it walks every page, ~5 ms
    /// per 512 MiB here), or for private anonymous ranges ([`crate::Memory::with_anonymous`],
    /// [`crate::Memory::private`]), which have no file, in `/proc/self/pagemap`
    /// ([`anonymous_in_use`]; where it cannot be read, every page `mincore` missed counts). The
    /// fenced ones (mapped `PROT_NONE`, given away) never count.
    pub fn touched_pages(&self) -> Result<PageBitmap> {
        use vm_memory::GuestMemoryRegion;
        let regions: Vec<_> = self.memory.guest.iter().map(|r| (r.start_addr().0, r.len())).collect();
        let mut bm = PageBitmap::for_regions(&regions);
        let fences = self.memory.fences.list();
        let mut resident = Vec::new();
        for (i, region) in self.memory.guest.iter().enumerate() {
            let (_, pages, bits) = &mut bm.regions[i];
            resident.resize(*pages as usize, 0u8);
            // SAFETY: the region is a live, page-aligned mapping of `region.len()` bytes and
            // `resident` has one byte per page, as mincore requires.
            let r = unsafe {
                libc::mincore(region.as_ptr() as *mut libc::c_void, region.len() as usize, resident.as_mut_ptr())
            };
            if r != 0 {
                return Err(Error::Memory(format!("mincore: {}", std::io::Error::last_os_error())));
            }
            for (a, b) in runs_of(&resident, |v| v & 1 != 0) {
                set_pages(bits, a, b - a);
            }
            let Some(fo) = region.file_offset() else {
                // Private memory: a page mincore missed may be in swap, which pagemap tells.
                for (a, b) in runs_of(&resident, |v| v & 1 == 0) {
                    if let Err(e) = anonymous_in_use(region.as_ptr(), a, b - a, bits) {
                        tracing::debug!("/proc/self/pagemap: {e}: round 0 takes every page mincore did not see");
                        set_pages(bits, a, b - a);
                    }
                }
                clear_fenced(bits, *pages, region.start_addr().0, &fences);
                continue;
            };
            for (a, b) in runs_of(&resident, |v| v & 1 == 0) {
                for (first, n) in file_data(fo.file(), fo.start() + a * PAGE_SIZE, (b - a) * PAGE_SIZE)? {
                    set_pages(bits, a + first, n);
                }
            }
        }
        Ok(bm)
    }
}

/// The runs `[a, b)` of indices of `v` whose values `f` accepts.
fn runs_of<'a>(v: &'a [u8], f: impl Fn(u8) -> bool + 'a) -> impl Iterator<Item = (u64, u64)> + 'a {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < v.len() && !f(v[i]) {
            i += 1;
        }
        let a = i;
        while i < v.len() && f(v[i]) {
            i += 1;
        }
        (a < i).then_some((a as u64, i as u64))
    })
}

/// The runs `(first page, pages)` of `[start, start + len)` of `file` that hold data (pages
/// relative to `start`), from `SEEK_DATA`/`SEEK_HOLE`.
fn file_data(file: &std::fs::File, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
    let seek = |at: u64, whence: libc::c_int| -> Result<Option<u64>> {
        let at = i64::try_from(at).map_err(|_| Error::Memory(format!("offset {at:#x} out of range")))?;
        // SAFETY: lseek on a descriptor this memory owns; it moves only the file position,
        // which nothing of kumo's uses (guest memory is read and written through its mapping).
        let r = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(file), at, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = std::io::Error::last_os_error();
        // ENXIO: no data at or after `at` (SEEK_DATA).
        if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(Error::Memory(format!("finding guest memory's holes (lseek): {e}")))
        }
    };
    let end = start + len;
    let mut runs = Vec::new();
    let mut at = start;
    while at < end {
        let Some(data) = seek(at, libc::SEEK_DATA)?.filter(|&d| d < end) else { break };
        let hole = seek(data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        if hole <= data {
            break;
        }
        // Pages, rounded out: a partly written page is data.
        let first = (data - start) / PAGE_SIZE;
        let last = (hole - start).div_ceil(PAGE_SIZE);
        runs.push((first, last - first));
        at = hole;
    }
    Ok(runs)
}

/// Sets in `bits` the pages `[first, first + pages)` of the private anonymous mapping at `host`
/// that hold data: those in this process's page tables or swapped out, by bits 63 and 62 of
/// their `/proc/self/pagemap` entries (readable without privileges, which only hide frame
/// numbers; a page on its way between NUMA nodes reads as swapped). A page never touched is
/// neither, and reads as zeros on both sides. Called for the pages `mincore` found absent:
/// it sees the resident ones in 0.15 ms per 2 GiB of huge pages here, pagemap in 1.3.
fn anonymous_in_use(host: *const u8, first: u64, pages: u64, bits: &mut [u64]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const PRESENT_OR_SWAPPED: u64 = (1 << 63) | (1 << 62);
    const CHUNK: u64 = 1 << 16;
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    let base = host as u64 / PAGE_SIZE + first;
    let mut buf = vec![0u8; (CHUNK.min(pages) * 8) as usize];
    let mut at = 0;
    while at < pages {
        let n = (pages - at).min(CHUNK);
        let bytes = &mut buf[..(n * 8) as usize];
        pagemap.read_exact_at(bytes, (base + at) * 8)?;
        for (i, e) in bytes.chunks_exact(8).enumerate() {
            if u64::from_ne_bytes(e.try_into().expect("8 bytes")) & PRESENT_OR_SWAPPED != 0 {
                let p = first + at + i as u64;
                bits[(p / 64) as usize] |= 1 << (p % 64);
            }
        }
        at += n;
    }
    Ok(())
}

/// Clears the pages of a region at `gpa` (`pages` long) in `fences` (`(gpa, len)`).
fn clear_fenced(bits: &mut [u64], pages: u64, gpa: u64, fences: &[(u64, u64)]) {
    let end = gpa + pages * PAGE_SIZE;
    for &(f, len) in fences {
        let (lo, hi) = (f.max(gpa), (f + len).min(end));
        if lo < hi {
            clear_pages(bits, (lo - gpa) / PAGE_SIZE, (hi - lo).div_ceil(PAGE_SIZE));
        }
    }
}

/// The words of `bits` that pages `[first, first + n)` fall in, each with the mask of its part.
fn page_words(first: u64, n: u64) -> impl Iterator<Item = (usize, u64)> {
    let (mut p, end) = (first, first + n);
    std::iter::from_fn(move || {
        (p < end).then(|| {
            let (w, b) = ((p / 64) as usize, p % 64);
            let k = (64 - b).min(end - p);
            p += k;
            (w, if k == 64 { !0 } else { ((1u64 << k) - 1) << b })
        })
    })
}

fn set_pages(bits: &mut [u64], first: u64, n: u64) {
    page_words(first, n).for_each(|(w, m)| bits[w] |= m);
}

fn clear_pages(bits: &mut [u64], first: u64, n: u64) {
    page_words(first, n).for_each(|(w, m)| bits[w] &= !m);
}

/// One `KVM_CLEAR_DIRTY_LOG` call: `num` pages of `slot` from slot page `first`, the pages
/// to re-arm set in `bits` (bit i: page `first + i`).
#[derive(Debug, PartialEq)]
struct ClearSpan {
    slot: u32,
    first: u64,
    num: u32,
    bits: Vec<u64>,
}

/// The calls that re-arm `gfns` (ascending) in slots `(first gfn, pages)`: one per slot they
/// touch, from the 64-page word of the first to that of the last (KVM wants `first` a multiple
/// of 64, and `num` too unless the span ends the slot). Pages in no slot are skipped.
fn clear_spans(gfns: &[u64], slots: &[(u64, u64)]) -> Vec<ClearSpan> {
    let mut spans = Vec::new();
    for (slot, &(base, pages)) in slots.iter().enumerate() {
        let lo = gfns.partition_point(|&g| g < base);
        let hi = gfns.partition_point(|&g| g < base + pages);
        let here = &gfns[lo..hi.max(lo)];
        let (Some(&a), Some(&b)) = (here.first(), here.last()) else { continue };
        let first = (a - base) & !63;
        let num = ((b - base - first + 64) & !63).min(pages - first);
        let mut bits = vec![0u64; num.div_ceil(64) as usize];
        for &g in here {
            let i = g - base - first;
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
        spans.push(ClearSpan { slot: slot as u32, first, num: num as u32, bits });
    }
    spans
}

/// A device that writes guest memory where KVM cannot see it (a vhost-user backend in
/// another process) and keeps its own log of those writes. A migration's source merges each
/// such log with KVM's at every round; the device knows nothing of how pages travel.
pub trait DeviceDirtyLog: Send + Sync {
    /// The device's name, for errors.
    fn name(&self) -> String;
    /// Starts logging: from here on every page the device writes is in the log.
    fn start_log(&self) -> std::result::Result<(), String>;
    /// Adds the pages written since the last fetch to `into` and clears them in the log.
    /// Returns how many were set.
    fn fetch_log(&self, into: &mut PageBitmap) -> std::result::Result<u64, String>;
    /// Stops logging (a migration ended or failed).
    fn stop_log(&self);
}

/// A dirty log shared with another process: a memfd of one bit per 4 KiB guest page from
/// guest-physical address 0 (the vhost-user log layout: bit `n % 8` of byte `n / 8` is page
/// `n`), mapped here. The other process sets bits with atomic ORs; [`SharedDirtyLog::drain`]
/// swaps each 64-bit word with zero, so a bit set meanwhile lands in this fetch or the next.
pub struct SharedDirtyLog {
    file: std::fs::File,
    ptr: *mut std::sync::atomic::AtomicU64,
    words: usize,
}

// SAFETY: the mapping is only accessed through atomics; the pointer is owned by this value.
unsafe impl Send for SharedDirtyLog {}
// SAFETY: as above: every access is an atomic operation on the shared mapping.
unsafe impl Sync for SharedDirtyLog {}

impl SharedDirtyLog {
    /// A zeroed log covering guest-physical addresses below `end`.
    pub fn new(end: u64) -> std::io::Result<Self> {
        let pages = end.div_ceil(PAGE_SIZE);
        let words = (pages.div_ceil(64) as usize).max(1);
        let len = words * 8;
        // SAFETY: a plain syscall with a NUL-terminated name; the returned fd is owned below.
        let fd = unsafe { libc::memfd_create(c"kumo-dirty-log".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        // SAFETY: maps `len` bytes of the memfd just sized to `len`, shared, at a fresh address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedDirtyLog { file, ptr: ptr.cast(), words })
    }

    /// The memfd to hand to the other process.
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The log's size in bytes.
    pub fn len(&self) -> u64 {
        self.words as u64 * 8
    }

    pub fn is_empty(&self) -> bool {
        self.words == 0
    }

    fn words(&self) -> &[std::sync::atomic::AtomicU64] {
        // SAFETY: `ptr` maps `words` 8-byte words for as long as `self` lives; AtomicU64 has
        // the layout of u64 and every access goes through it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.words) }
    }

    /// Sets page `gfn`'s bit as the other process would (tests, and kumo's own writes).
    pub fn mark(&self, gfn: u64) {
        if let Some(w) = self.words().get((gfn / 64) as usize) {
            w.fetch_or(1 << (gfn % 64), Ordering::SeqCst);
        }
    }

    /// Moves every set bit into `into` (clearing it here); returns how many pages were new to
    /// `into`. Bits for pages outside `into`'s regions are dropped.
    pub fn drain(&self, into: &mut PageBitmap) -> u64 {
        let mut n = 0;
        for (i, w) in self.words().iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let gfn = i as u64 * 64 + b;
                if into.set_new(gfn) {
                    n += 1;
                }
            }
        }
        n
    }
}

impl Drop for SharedDirtyLog {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made; nothing refers to it after `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.words * 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vcpu::VcpuRun;

    #[test]
    fn shared_log_bits_move_into_the_migration_bitmap_once() {
        // RAM below 1 MiB + 8 KiB and a region at 4 GiB, as the layouts have.
        let regions = [(0u64, (1 << 20) + 8192), (1 << 32, 1 << 20)];
        let log = SharedDirtyLog::new((1 << 32) + (1 << 20)).unwrap();
        assert_eq!(log.len(), ((1u64 << 32) + (1 << 20)) / 4096 / 8);
        // The other process's layout: bit n % 8 of byte n / 8, set byte-wise.
        // SAFETY: a second shared mapping of the log's memfd, of its size, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                log.len() as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(log.file()),
                0,
            )
        } as *mut std::sync::atomic::AtomicU8;
        assert_ne!(map as *mut libc::c_void, libc::MAP_FAILED);
        // SAFETY: every gfn below is inside the mapping (the log covers 4 GiB + 1 MiB).
        let other = |gfn: u64| unsafe { (*map.add((gfn / 8) as usize)).fetch_or(1 << (gfn % 8), Ordering::SeqCst) };
        for gfn in [0u64, 7, 8, 63, 64, 257, 0x101, 300, (1 << 32) / 4096 + 5] {
            other(gfn);
        }
        let mut bm = PageBitmap::for_regions(&regions);
        // 0x101 = 257: one page; page 300 lies in no region (dropped).
        assert_eq!(log.drain(&mut bm), 7);
        let gfns: Vec<u64> = bm.gfns().collect();
        assert_eq!(gfns, vec![0, 7, 8, 63, 64, 257, (1 << 32) / 4096 + 5]);
        // Drained: a second fetch finds nothing; a page already in the bitmap is not new.
        assert_eq!(log.drain(&mut bm), 0);
        other(7);
        log.mark(9);
        assert_eq!(log.drain(&mut bm), 1);
        assert_eq!(bm.count(), 8);
        // SAFETY: the test's own mapping, not used after this.
        unsafe { libc::munmap(map.cast(), log.len() as usize) };
    }

    #[test]
    fn the_data_of_a_memfd_is_found_in_runs_of_pages() {
        use std::os::unix::fs::FileExt;
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kumo-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(4 << 20).unwrap();
        let page = |p: u64| p * PAGE_SIZE;
        assert_eq!(file_data(&f, 0, 4 << 20).unwrap(), []);
        // Pages 0, 5-6, a few bytes inside page 200, the last page.
        f.write_all_at(&[1; 4096], page(0)).unwrap();
        f.write_all_at(&[2; 8192], page(5)).unwrap();
        f.write_all_at(&[3; 10], page(200) + 100).unwrap();
        f.write_all_at(&[4; 4096], page(1023)).unwrap();
        assert_eq!(file_data(&f, 0, 4 << 20).unwrap(), [(0, 1), (5, 2), (200, 1), (1023, 1)]);
        // A region that starts 4 pages into the file and ends before its last page: pages
        // count from the region's start, and what lies outside it is not reported.
        assert_eq!(file_data(&f, page(4), page(1000)).unwrap(), [(1, 2), (196, 1)]);
        // A page punched out (memory given back) is a hole again.
        // SAFETY: fallocate on the test's own memfd.
        let r = unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                page(5) as i64,
                4096,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(file_data(&f, 0, 4 << 20).unwrap(), [(0, 1), (6, 1), (200, 1), (1023, 1)]);
    }

    #[test]
    fn runs_are_found_at_both_ends_and_between() {
        let v = [1u8, 1, 0, 0, 1, 0, 1, 1];
        assert_eq!(runs_of(&v, |x| x == 1).collect::<Vec<_>>(), [(0, 2), (4, 5), (6, 8)]);
        assert_eq!(runs_of(&v, |x| x == 0).collect::<Vec<_>>(), [(2, 4), (5, 6)]);
        assert_eq!(runs_of(&[], |x| x == 0).count(), 0);
    }

    #[test]
    fn page_ranges_set_and_clear_whole_words_and_parts() {
        let naive = |first: u64, n: u64, set: bool, bits: &mut [u64]| {
            for p in first..first + n {
                if set {
                    bits[(p / 64) as usize] |= 1 << (p % 64);
                } else {
                    bits[(p / 64) as usize] &= !(1 << (p % 64));
                }
            }
        };
        let (mut a, mut b) = (vec![0u64; 6], vec![0u64; 6]);
        for (i, &(first, n)) in
            [(0, 64), (3, 1), (60, 10), (64, 128), (5, 300), (100, 0), (383, 1), (1, 62)].iter().enumerate()
        {
            let set = i % 3 != 2;
            if set {
                set_pages(&mut a, first, n);
            } else {
                clear_pages(&mut a, first, n);
            }
            naive(first, n, set, &mut b);
            assert_eq!(a, b, "after ({first}, {n}, set {set})");
        }
    }

    #[test]
    fn private_memory_counts_the_pages_it_has() {
        use vm_memory::{Bytes, VolatileMemory};
        let m = vm_memory::MmapRegion::<()>::new(64 * 4096).unwrap();
        let s = m.as_volatile_slice();
        s.write_obj(1u8, 3 * 4096 + 5).unwrap();
        s.write_obj(1u8, 40 * 4096).unwrap();
        let mut bits = vec![0u64; 2];
        anonymous_in_use(m.as_ptr(), 0, 64, &mut bits).unwrap();
        assert_eq!(bits, [(1 << 3) | (1 << 40), 0]);
        // A part of the mapping: its pages land at their own indices.
        let mut bits = vec![0u64; 2];
        anonymous_in_use(m.as_ptr(), 10, 54, &mut bits).unwrap();
        assert_eq!(bits, [1 << 40, 0]);
    }

    #[test]
    fn fenced_pages_never_count() {
        let gpa = 16u64 << 20;
        let pages = 200; // not a multiple of 64
        let mut bits = vec![0u64; 4];
        // Fences: before the region, straddling its start, inside it, past its end.
        let fences = [(0, 4096), (gpa - 8192, 3 * 4096), (gpa + 64 * 4096, 2 * 4096), (gpa + 199 * 4096, 8192)];
        set_pages(&mut bits, 0, pages);
        clear_fenced(&mut bits, pages, gpa, &fences);
        let set: Vec<u64> = (0..256).filter(|&p| bits[p as usize / 64] & (1 << (p % 64)) != 0).collect();
        let want: Vec<u64> = (1..64).chain(66..199).collect();
        assert_eq!(set, want);
    }

    #[test]
    fn a_batch_is_re_armed_in_one_aligned_span_per_slot() {
        // Below 3 GiB, 1,000 pages (not a multiple of 64), and a slot at 4 GiB.
        let slots = [(0u64, 1000u64), ((4u64 << 30) / 4096, 4096)];
        let hi = (4u64 << 30) / 4096;
        let spans = clear_spans(&[70, 71, 200, 999, 1000, hi + 3, hi + 130], &slots);
        assert_eq!(spans.len(), 2);
        // 70..=999: from word 1 (page 64) to the slot's end (not a multiple of 64).
        let s0 = &spans[0];
        assert_eq!((s0.slot, s0.first, s0.num), (0, 64, 936));
        let set: Vec<u64> = (0..s0.num as u64).filter(|i| s0.bits[(i / 64) as usize] >> (i % 64) & 1 == 1).collect();
        assert_eq!(set, vec![6, 7, 136, 935]);
        // Page 1000 is in no slot; the second slot's pages 3 and 130: words 0..=2.
        let s1 = &spans[1];
        assert_eq!((s1.slot, s1.first, s1.num), (1, 0, 192));
        assert_eq!(s1.bits, vec![1 << 3, 0, 1 << 2]);
        assert!(clear_spans(&[], &slots).is_empty());
    }

    #[test]
    fn kvm_reports_exactly_the_pages_the_guest_wrote() {
        // Write to 0x800000 and 0x803008 (two pages), then exit through port 0x501.
        let code: &[u8] = &[
            0x48, 0xc7, 0xc0, 0x00, 0x00, 0x80, 0x00, // mov $0x800000, %rax
            0xc7, 0x00, 0x01, 0x00, 0x00, 0x00, // movl $1, (%rax)
            0xc7, 0x80, 0x08, 0x30, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, // movl $2, 0x3008(%rax)
            0x66, 0xba, 0x01, 0x05, 0xb0, 0x00, 0xee, // mov $0x501,%dx; mov $0,%al; out
        ];
        let Some(mut g) = crate::testing::RawGuest::new(code, &[]) else {
            return;
        };
        let vm = &g.vm;
        // 0x800 exists before logging starts (round 0 sends it; with INITIALLY_SET it is one of
        // round 0's sample pages, the first of its 64); 0x803 is a hole the guest writes later.
        vm_memory::Bytes::write_slice(&vm.memory.guest, &[1u8], vm_memory::GuestAddress(0x80_0000)).unwrap();
        vm.start_dirty_log().unwrap();
        let first = vm.first_round_pages().unwrap();
        let first_gfns: Vec<u64> = first.gfns().collect();
        assert!(first.count() > 0 && first.count() < 1000, "only boot structures: {}", first.count());
        assert!(first_gfns.contains(&0x800) && !first_gfns.contains(&0x803));
        // Round 0 sends its pages, re-arming each batch (not the sample pages: armed since it
        // began).
        vm.rearm_dirty(&first_gfns).unwrap();
        assert!(matches!(g.run().unwrap(), VcpuRun::Device(_)));
        let vm = &g.vm;
        // A write by kumo itself (as an emulation assist makes) at 0x900010: KVM's log does
        // not see it, the region bitmap does.
        vm_memory::Bytes::write_slice(&vm.memory.guest, &[7u8; 8], vm_memory::GuestAddress(0x90_0010)).unwrap();
        let peek = vm.peek_dirty_count().unwrap();
        assert_eq!(peek.is_some(), vm.dirty_manual.load(Ordering::Acquire), "round 0 is sampled");
        if let Some(peeked) = peek {
            // Without INITIALLY_SET both pages count; with it, 0x800 counts for its share.
            assert!(peeked >= 2, "{peeked}");
            assert_eq!(vm.peek_dirty_count().unwrap(), Some(peeked), "peeking does not clear");
        }
        let regions = [(0, 32 << 20)];
        let mut dirty = PageBitmap::for_regions(&regions);
        vm.harvest_dirty(&mut dirty).unwrap();
        let gfns: Vec<_> = dirty.gfns().collect();
        // 0x803 was a hole, re-armed (first_round_pages) before the guest's first write to it.
        assert!(gfns.contains(&0x800) && gfns.contains(&0x803), "{gfns:x?}");
        assert!(gfns.contains(&0x900), "kumo's own write is missing: {gfns:x?}");
        // Nothing else the guest wrote but its own stack-less code: at most a few extra pages
        // (the CPU sets accessed/dirty bits in the page tables). A hole or a round-0 page the
        // log still held would be more.
        assert!(gfns.len() <= 8, "{gfns:x?}");
        // Harvested, not re-armed: KVM still reports them (kumo's own bitmap was taken).
        let mut again = PageBitmap::for_regions(&regions);
        vm.harvest_dirty(&mut again).unwrap();
        let again: Vec<_> = again.gfns().collect();
        assert!(again.contains(&0x800) && again.contains(&0x803) && !again.contains(&0x900), "{again:x?}");
        // Re-armed (as their batch is before it is sent), they are clean until written again;
        // fetch_dirty (the dry run's) reads and re-arms at once.
        vm.rearm_dirty(&gfns).unwrap();
        let mut after = PageBitmap::for_regions(&regions);
        assert_eq!(vm.harvest_dirty(&mut after).unwrap(), 0);
        assert_eq!(vm.fetch_dirty(&mut after).unwrap(), 0);
        vm.stop_dirty_log().unwrap();
    }
}
