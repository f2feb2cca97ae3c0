//! Snapshot to file and restore (`vm.snapshot`, `kumo run --restore FILE`).
//!
//! A snapshot file is one migration stream (docs/migration-format.md) written to a file
//! instead of a socket: the header with the VM's description, round 0's pages (the pages the
//! VM ever touched; never-touched pages read as zeros and are left out), `RoundEnd`, `State`
//! (the serialized [`Snapshot`]) and `Complete`. Restoring reads it with the format's checking
//! [`Reader`], so a truncated, corrupt or foreign file is refused with the byte offset where
//! it went wrong, never a panic.
//!
//! While it writes, the snapshot owns the VM's run state as a migration does
//! (`begin_migration`): the user's pause and resume are refused meanwhile, and a VM the user
//! had paused stays paused afterwards (and is restored paused).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::time::Instant;

use kumo_migration::format::{self, Reader, Record, VmDescription, Writer, MAX_BATCH_PAGES, PAGE_SIZE};
use kumo_migration_engine::SourceVm;
use serde_json::json;
use vm_memory::{Bytes, GuestAddress};

use crate::event_monitor;
use crate::host_resources::HostResources;
use crate::migration::config_from_description;
use crate::vmm::{RunningVm, Snapshot};

const PAGE: usize = PAGE_SIZE as usize;

/// Why a snapshot or a restore failed. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The request itself is wrong (a relative path, a missing directory).
    #[error("{0}")]
    BadRequest(String),
    /// The VM cannot be snapshotted now (a migration or snapshot runs, it is shutting down).
    #[error("{0}")]
    Conflict(String),
    /// Writing the file failed (disk full, permissions, ...); the VM runs on.
    #[error("{0}")]
    Write(String),
    /// The file cannot be read back: missing, truncated, corrupt or not a kumo snapshot.
    #[error("{0}")]
    Read(String),
    /// Building the VM from the file or restoring its state failed.
    #[error("{0}")]
    Vm(String),
}

type Result<T> = std::result::Result<T, SnapshotError>;

// What a snapshot wrote, and what a restore ran: API answers, whose types live in kumo-api.
pub use kumo_api::{RestoreReport, SnapshotReport};

/// Checks a snapshot target before the VM is paused: an absolute path (the API server's
/// working directory is not the client's) in an existing directory, not a directory itself,
/// not a symbolic link (kumo never writes through or replaces one).
pub fn check_target(path: &Path) -> Result<()> {
    let bad = |m: String| Err(SnapshotError::BadRequest(m));
    if !path.is_absolute() {
        return bad(format!("snapshot path {} is not absolute", path.display()));
    }
    if let Err(e) = kumo_sandbox::fs::refuse_symlink(path) {
        return bad(format!("snapshot path {e}"));
    }
    match path.parent() {
        Some(dir) if dir.is_dir() => {}
        _ => return bad(format!("snapshot path {}: its directory does not exist", path.display())),
    }
    if path.is_dir() {
        return bad(format!("snapshot path {} is a directory", path.display()));
    }
    Ok(())
}

/// Pauses `vm`, writes it to `path` and resumes it (unless the user had paused it).
pub fn snapshot_to_file(vm: &RunningVm, path: &Path) -> Result<SnapshotReport> {
    check_target(path)?;
    if let Some(why) = vm.snapshot_blocker() {
        return Err(SnapshotError::Conflict(format!("cannot snapshot: {why}")));
    }
    // Given back however this ends, a panic included (resuming the VM unless the user had
    // paused it).
    let mut lease = vm.lease_run_state().map_err(|e| SnapshotError::Conflict(format!("cannot snapshot: {e}")))?;
    let r: Result<SnapshotReport> = (|| {
        vm.migration_pause().map_err(|e| SnapshotError::Conflict(format!("cannot snapshot: {e}")))?;
        let t = Instant::now();
        let paused = vm.paused_by_user();
        let written = write_vm(vm, path);
        let paused_ms = t.elapsed().as_secs_f64() * 1e3;
        // Whatever happened, the VM runs on as it was (a user-paused VM stays paused).
        if let Err(e) = vm.migration_resume() {
            tracing::warn!("cannot resume the VM after its snapshot: {e}");
        }
        let (pages, bytes, state_bytes) = written?;
        Ok(SnapshotReport { path: path.to_path_buf(), pages, bytes, state_bytes, paused_ms, paused })
    })();
    lease.settle();
    drop(lease);
    match &r {
        Ok(rep) => event_monitor::vm_event(
            "snapshot",
            json!({"path": rep.path, "pages": rep.pages, "bytes": rep.bytes, "paused_ms": rep.paused_ms}),
        ),
        Err(e) => event_monitor::vm_event("snapshot-failed", json!({"path": path, "error": e.to_string()})),
    }
    r
}

/// Writes a paused VM: its description, touched pages and state.
fn write_vm(vm: &RunningVm, path: &Path) -> Result<(u64, u64, u64)> {
    let desc = SourceVm::description(vm);
    // What the guest wrote is on stable storage with the snapshot.
    vm.quiesce_disks().map_err(|e| SnapshotError::Vm(format!("cannot flush the disks: {e}")))?;
    let snap = vm.save_state().map_err(|e| SnapshotError::Vm(format!("cannot save the VM's state: {e}")))?;
    let state =
        serde_json::to_vec(&snap).map_err(|e| SnapshotError::Vm(format!("cannot encode the VM's state: {e}")))?;
    let mem = vm.memory();
    let read = |gfn: u64, buf: &mut [u8]| {
        mem.read_slice(buf, GuestAddress(gfn * PAGE as u64)).map_err(|e| format!("page {gfn:#x}: {e}"))
    };
    let (pages, bytes) = match vm.vm().touched_pages() {
        Ok(touched) => write_file(path, &desc, touched.gfns(), read, &state)?,
        Err(e) => {
            tracing::warn!("cannot tell which pages the guest touched ({e}): writing all of them");
            write_file(path, &desc, all_gfns(&desc.regions), read, &state)?
        }
    };
    Ok((pages, bytes, state.len() as u64))
}

/// Every page of `regions`, ascending.
fn all_gfns(regions: &[(u64, u64)]) -> impl Iterator<Item = u64> + '_ {
    regions.iter().flat_map(|&(gpa, len)| (gpa / PAGE as u64)..((gpa + len) / PAGE as u64))
}

/// Writes a snapshot stream to a new, uniquely named file beside `path` (never an existing
/// file, never through a link: `kumo_sandbox::fs::Staged`), syncs it and renames it to `path`
/// unless `path` is a symbolic link: a crash or a full disk never leaves a half-written file
/// under the snapshot's name. `gfns` must be strictly increasing; `read_page` fills a page's
/// 4096 bytes. Returns (pages, file size).
pub fn write_file(
    path: &Path,
    desc: &VmDescription,
    gfns: impl Iterator<Item = u64>,
    read_page: impl FnMut(u64, &mut [u8]) -> std::result::Result<(), String>,
    state: &[u8],
) -> Result<(u64, u64)> {
    let werr =
        |e: &dyn std::fmt::Display| SnapshotError::Write(format!("cannot write snapshot {}: {e}", path.display()));
    let (staged, f) = kumo_sandbox::fs::Staged::create(path).map_err(|e| werr(&e))?;
    // Test hook, debug builds only: the stream goes to this file instead (a FIFO lets
    // tests/snapshot_e2e.rs hold a snapshot in progress; fsync then fails on it).
    #[cfg(debug_assertions)]
    let f = match std::env::var_os("KUMO_TEST_SNAPSHOT_SINK") {
        Some(sink) => std::fs::OpenOptions::new().write(true).open(sink).map_err(|e| werr(&e))?,
        None => f,
    };
    // Dropping `staged` on an error removes the temporary file.
    let written = write_stream(f, desc, gfns, read_page, state, &werr)?;
    staged.commit().map_err(|e| werr(&e))?;
    Ok(written)
}

/// Writes the snapshot stream into `f` and syncs it. Returns (pages, file size).
fn write_stream(
    f: File,
    desc: &VmDescription,
    gfns: impl Iterator<Item = u64>,
    mut read_page: impl FnMut(u64, &mut [u8]) -> std::result::Result<(), String>,
    state: &[u8],
    werr: &dyn Fn(&dyn std::fmt::Display) -> SnapshotError,
) -> Result<(u64, u64)> {
    let mut w = Writer::start(BufWriter::with_capacity(1 << 20, f), desc).map_err(|e| werr(&io_msg(e)))?;
    let mut batch = Vec::with_capacity(MAX_BATCH_PAGES);
    let mut data = vec![0u8; MAX_BATCH_PAGES * PAGE];
    let mut pages = 0u64;
    let mut flush = |batch: &mut Vec<u64>, data: &mut [u8], w: &mut Writer<_>| -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let data = &mut data[..batch.len() * PAGE];
        for (g, page) in batch.iter().zip(data.chunks_exact_mut(PAGE)) {
            read_page(*g, page).map_err(|e| SnapshotError::Vm(format!("cannot read guest memory: {e}")))?;
        }
        let n = batch.len() as u64;
        // Zero pages go as runs of page numbers: a restored VM's memory starts as zeros.
        let zero: Vec<bool> = data.chunks_exact(PAGE).map(format::is_zero_page).collect();
        let runs = format::split_zero_pages(batch, data, |i| zero[i]);
        if !runs.is_empty() {
            w.zero_pages(0, &runs).map_err(|e| werr(&io_msg(e)))?;
        }
        if !batch.is_empty() {
            w.mem_batch(0, batch, &data[..batch.len() * PAGE]).map_err(|e| werr(&io_msg(e)))?;
        }
        pages += n;
        batch.clear();
        Ok(())
    };
    for g in gfns {
        batch.push(g);
        if batch.len() == MAX_BATCH_PAGES {
            flush(&mut batch, &mut data, &mut w)?;
        }
    }
    flush(&mut batch, &mut data, &mut w)?;
    w.round_end(0, pages).map_err(|e| werr(&io_msg(e)))?;
    w.state(state).map_err(|e| werr(&io_msg(e)))?;
    w.complete(pages).map_err(|e| werr(&io_msg(e)))?;
    let f = w.into_inner().into_inner().map_err(|e| werr(e.error()))?;
    f.sync_all().map_err(|e| werr(&e))?;
    let len = f.metadata().map_err(|e| werr(&e))?.len();
    Ok((pages, len))
}

/// A stream error, with the OS's words for I/O (e.g. "No space left on device").
fn io_msg(e: format::Error) -> String {
    match e {
        format::Error::Io(io) => io.to_string(),
        e => e.to_string(),
    }
}

/// Counts the bytes read, so errors can say where in the file they are.
struct Counting<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.n += k as u64;
        Ok(k)
    }
}

/// What a snapshot file held besides its pages.
#[derive(Debug)]
pub struct Loaded<T> {
    /// What `create` built from the description.
    pub target: T,
    pub desc: VmDescription,
    /// The `State` record.
    pub state: Vec<u8>,
    pub pages: u64,
}

/// Reads a snapshot file: `create` builds the target from the description (before any page
/// arrives), `place` puts each page into it. Every error names the file and the byte offset
/// of the header or record that was wrong.
pub fn read_file<T>(
    path: &Path,
    create: impl FnOnce(&VmDescription) -> std::result::Result<T, String>,
    mut place: impl FnMut(&T, u64, &[u8]) -> std::result::Result<(), String>,
) -> Result<Loaded<T>> {
    let name = path.display();
    // Not through a link: a path from the API must not make kumo read where it points.
    let f = kumo_sandbox::fs::open_nofollow(path)
        .map_err(|e| SnapshotError::Read(format!("cannot open snapshot {name}: {e}")))?;
    let mut input = Counting { inner: BufReader::with_capacity(1 << 20, f), n: 0 };
    let bad = |at: u64, what: &str, e: &dyn std::fmt::Display| {
        SnapshotError::Read(format!("{name} is not a valid kumo snapshot: {what} at byte {at}: {e}"))
    };
    let desc = format::read_header(&mut input).map_err(|e| bad(0, "header", &e))?;
    if desc.shared_memory || desc.connections != 1 {
        return Err(bad(0, "header", &"it describes a stream whose memory is not in the file"));
    }
    let target = create(&desc).map_err(|e| SnapshotError::Vm(format!("cannot build the VM of {name}: {e}")))?;
    let mut reader = Reader::new(input, &desc);
    let mut state = None;
    let mut pages = 0u64;
    let mut placed = kumo_migration::PageBitmap::for_regions(&desc.regions);
    loop {
        let at = reader.get_ref().n;
        let rec = match reader.next_record() {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => return Err(bad(at, &format!("record {}", reader.seq()), &e)),
        };
        match rec {
            Record::MemBatch(b) => {
                for (gfn, page) in b.pages() {
                    place(&target, gfn, page)
                        .map_err(|e| SnapshotError::Vm(format!("{name}: cannot place page {gfn:#x}: {e}")))?;
                    placed.set(gfn);
                }
                pages += b.gfns.len() as u64;
            }
            // The new VM's memory is zeros: only a page this file already placed needs clearing.
            Record::ZeroPages { runs, .. } => {
                for &(first, n) in runs {
                    for gfn in (first..first + n).filter(|&g| placed.contains(g)) {
                        place(&target, gfn, &[0; PAGE])
                            .map_err(|e| SnapshotError::Vm(format!("{name}: cannot clear page {gfn:#x}: {e}")))?;
                    }
                    pages += n;
                }
            }
            Record::State(s) => state = Some(s.to_vec()),
            Record::RoundEnd { .. } | Record::Complete { .. } => {}
            Record::Abort(why) => return Err(bad(at, "record", &format!("the snapshot was aborted: {why}"))),
        }
    }
    let mut input = reader.into_inner();
    let end = input.n;
    let mut extra = [0u8; 1];
    match input.read(&mut extra) {
        Ok(0) => {}
        Ok(_) => return Err(bad(end, "end", &"data after the Complete record")),
        Err(e) => return Err(bad(end, "end", &e)),
    }
    // The reader requires State before Complete; this only guards a grammar change.
    let state = state.ok_or_else(|| bad(end, "end", &"no VM state in the file"))?;
    Ok(Loaded { target, desc, state, pages })
}

/// Builds a VM from a snapshot file, restores its state and runs it (paused if it was paused
/// when it was saved). Its NICs and NUMA nodes get the host resources in `ours`, as a
/// migration's destination gives them (a snapshot's NIC without one is refused). Console output
/// goes to `serial`.
pub fn restore_from_file(path: &Path, serial: Box<dyn Write + Send>, ours: &HostResources) -> Result<RunningVm> {
    restore(path, serial, ours).map(|(vm, _)| vm)
}

/// [`restore_from_file`], with what it restored.
pub fn restore(path: &Path, serial: Box<dyn Write + Send>, ours: &HostResources) -> Result<(RunningVm, RestoreReport)> {
    let t = Instant::now();
    let name = path.display();
    // A VM that does not fit what this host's operator gave is the request's fault (a 400).
    let refused = std::cell::Cell::new(false);
    let loaded = read_file(
        path,
        |desc| {
            let config = config_from_description(desc, ours).inspect_err(|_| refused.set(true))?;
            RunningVm::incoming(config, serial, None).map_err(|e| e.to_string())
        },
        |vm, gfn, page| vm.memory().write_slice(page, GuestAddress(gfn * PAGE as u64)).map_err(|e| e.to_string()),
    )
    .map_err(|e| match e {
        SnapshotError::Vm(m) if refused.get() => SnapshotError::BadRequest(m),
        e => e,
    })?;
    let vm = loaded.target;
    let snap: Snapshot = serde_json::from_slice(&loaded.state)
        .map_err(|e| SnapshotError::Read(format!("{name}: the VM state in it is not kumo's: {e}")))?;
    vm.restore_state(&snap).map_err(|e| SnapshotError::Vm(format!("cannot restore the VM of {name}: {e}")))?;
    event_monitor::vm_event(
        "restored",
        json!({"path": path, "pages": loaded.pages, "paused": snap.paused, "ms": t.elapsed().as_secs_f64() * 1e3}),
    );
    // Runs it, unless it was saved paused (then the user resumes it).
    vm.resume_incoming().map_err(|e| SnapshotError::Vm(format!("cannot run the VM of {name}: {e}")))?;
    Ok((vm, RestoreReport { path: path.to_path_buf(), paused: snap.paused, pages: loaded.pages }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const REGIONS: [(u64, u64); 2] = [(0, 64 * 4096), (1 << 32, 16 * 4096)];

    fn desc() -> VmDescription {
        VmDescription::new(2, format::Irqchip::Kernel, format::PayloadDescription::guest("test"), REGIONS.to_vec())
    }

    /// A scratch directory per test.
    fn dir(test: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-snapshot-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Page `gfn` of the test memory: its gfn repeated.
    fn page(gfn: u64) -> Vec<u8> {
        gfn.to_le_bytes().iter().copied().cycle().take(PAGE).collect()
    }

    fn gfns() -> Vec<u64> {
        // More than one batch, across both regions.
        (0..64).filter(|g| g % 3 != 1).chain((1u64 << 20)..(1 << 20) + 16).collect()
    }

    /// The names in directory `d`, sorted.
    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    /// Writes the test snapshot; returns its path.
    fn write(d: &Path) -> PathBuf {
        let p = d.join("vm.snap");
        let (pages, len) = write_file(
            &p,
            &desc(),
            gfns().into_iter(),
            |g, buf| {
                buf.copy_from_slice(&page(g));
                Ok(())
            },
            b"{\"state\":1}",
        )
        .unwrap();
        assert_eq!(pages, gfns().len() as u64);
        assert_eq!(len, std::fs::metadata(&p).unwrap().len());
        assert!(!names(d).iter().any(|n| n.starts_with(".vm.snap.")), "the temporary file is renamed");
        p
    }

    type Mem = std::cell::RefCell<std::collections::BTreeMap<u64, Vec<u8>>>;

    fn read(p: &Path) -> Result<Loaded<Mem>> {
        read_file(
            p,
            |d| {
                assert_eq!(d, &desc());
                Ok(Mem::default())
            },
            |m, g, data| {
                m.borrow_mut().insert(g, data.to_vec());
                Ok(())
            },
        )
    }

    #[test]
    fn a_written_file_reads_back_whole() {
        let d = dir("roundtrip");
        let p = write(&d);
        let l = read(&p).unwrap();
        assert_eq!(l.state, b"{\"state\":1}");
        assert_eq!(l.pages, gfns().len() as u64);
        let mem = l.target.into_inner();
        // Page 0 holds zeros: it went as a zero run, and a new VM's memory is zeros already.
        assert_eq!(mem.keys().copied().collect::<Vec<_>>(), gfns()[1..]);
        assert!(mem.iter().all(|(g, data)| *data == page(*g)));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn zero_pages_take_no_room_and_clear_only_what_the_file_placed() {
        let d = dir("zero");
        let p = d.join("zero.snap");
        let gfns: Vec<u64> = (0..64).collect();
        // Every other page zero: 32 pages of data, 32 runs of one zero page.
        let fill = |g: u64, buf: &mut [u8]| {
            buf.fill(if g.is_multiple_of(2) { 0 } else { 7 });
            Ok(())
        };
        write_file(&p, &desc(), gfns.into_iter(), fill, b"{}").unwrap();
        let size = std::fs::metadata(&p).unwrap().len();
        assert!(size < 34 * 4096, "{size} bytes for 32 pages of data");
        let l = read(&p).unwrap();
        assert_eq!(l.pages, 64);
        assert!(l.target.borrow().keys().all(|g| g % 2 == 1));
        // A stream that places a page and then says it is zero (no kumo writes that, a reader
        // must still end with zeros there).
        let mut w = Writer::start(Vec::new(), &desc()).unwrap();
        w.mem_batch(0, &[3], &[9u8; PAGE]).unwrap();
        w.zero_pages(0, &[(2, 2)]).unwrap();
        w.round_end(0, 3).unwrap();
        w.state(b"{}").unwrap();
        w.complete(3).unwrap();
        std::fs::write(&p, w.into_inner()).unwrap();
        let mem = read(&p).unwrap().target.into_inner();
        assert_eq!(mem.keys().copied().collect::<Vec<_>>(), [3]);
        assert!(mem[&3].iter().all(|&b| b == 0), "the zero run cleared the placed page");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn every_truncation_is_refused_with_the_file_and_offset() {
        let d = dir("truncated");
        let p = write(&d);
        let full = std::fs::read(&p).unwrap();
        let cut = d.join("cut.snap");
        // Every length inside the header and the small records, and a spread over the pages.
        let lens: Vec<usize> =
            (0..300).chain((300..full.len()).step_by(4093)).chain(full.len() - 30..full.len()).collect();
        for n in lens {
            std::fs::write(&cut, &full[..n]).unwrap();
            let e = read(&cut).unwrap_err().to_string();
            assert!(e.contains("cut.snap is not a valid kumo snapshot") && e.contains(" at byte "), "{n}: {e}");
            assert!(e.contains("truncated"), "at {n} bytes: {e}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corruption_anywhere_is_refused() {
        let d = dir("corrupt");
        let p = write(&d);
        let full = std::fs::read(&p).unwrap();
        let bad = d.join("bad.snap");
        // One flipped bit at a spread of places: magic, version, description, frame headers,
        // page data, state, the trailers.
        for i in (0..full.len()).step_by(997).chain([0, 9, 20, full.len() - 1, full.len() - 10]) {
            let mut b = full.clone();
            b[i] ^= 0x10;
            std::fs::write(&bad, &b).unwrap();
            let e = read(&bad).unwrap_err().to_string();
            assert!(e.contains("bad.snap is not a valid kumo snapshot"), "flip at {i}: {e}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn foreign_files_and_trailing_data_are_named() {
        let d = dir("foreign");
        let p = d.join("notes.txt");
        std::fs::write(&p, b"hello, this is not a VM").unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("notes.txt is not a valid kumo snapshot: header at byte 0"), "{e}");
        assert!(e.contains("not a kumo migration stream"), "{e}");

        let snap = write(&d);
        let mut b = std::fs::read(&snap).unwrap();
        let end = b.len();
        b.extend_from_slice(b"junk");
        std::fs::write(&snap, &b).unwrap();
        let e = read(&snap).unwrap_err().to_string();
        assert!(e.contains(&format!("end at byte {end}: data after the Complete record")), "{e}");

        let e = read(&d.join("missing.snap")).unwrap_err().to_string();
        assert!(e.contains("cannot open snapshot") && e.contains("missing.snap"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_neither_file_behind() {
        let d = dir("failed");
        let p = d.join("vm.snap");
        let e = write_file(&p, &desc(), gfns().into_iter(), |g, _| Err(format!("no page {g}")), b"{}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read guest memory: no page 0"), "{e}");
        assert!(names(&d).is_empty(), "{:?}", names(&d));
        // Not a valid record: gfns must increase.
        let e = write_file(&p, &desc(), [3u64, 2].into_iter(), |_, _| Ok(()), b"{}").unwrap_err().to_string();
        assert!(e.contains("cannot write snapshot"), "{e}");
        assert!(names(&d).is_empty(), "{:?}", names(&d));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_full_disk_is_reported() {
        // /dev/full fails every write with ENOSPC.
        let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
            eprintln!("skipping a_full_disk_is_reported: no /dev/full");
            return;
        };
        let werr = |e: &dyn std::fmt::Display| SnapshotError::Write(format!("cannot write snapshot: {e}"));
        let e = write_stream(full, &desc(), gfns().into_iter(), |_, _| Ok(()), b"{}", &werr).unwrap_err().to_string();
        assert!(e.contains("No space left on device"), "{e}");
    }

    #[test]
    fn planted_symlinks_are_never_followed_or_replaced() {
        let d = dir("symlinks");
        let victim = d.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        // The temporary name of old (`PATH.tmp`) is not used: a link there stays as it was.
        let p = d.join("vm.snap");
        std::os::unix::fs::symlink(&victim, d.join("vm.snap.tmp")).unwrap();
        write(&d);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(read(&p).is_ok());
        assert_eq!(names(&d), ["victim", "vm.snap", "vm.snap.tmp"]);
        // A link at the target is refused, before and at the write.
        let link = d.join("link.snap");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(check_target(&link).unwrap_err().to_string().contains("link.snap is a symbolic link"));
        let e = write_file(&link, &desc(), gfns().into_iter(), |_, _| Ok(()), b"{}").unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        // And restore does not read through one.
        std::os::unix::fs::symlink(&p, d.join("restore.snap")).unwrap();
        let e = read(&d.join("restore.snap")).unwrap_err().to_string();
        assert!(e.contains("cannot open snapshot") && e.contains("is a symbolic link"), "{e}");
        assert_eq!(names(&d), ["link.snap", "restore.snap", "victim", "vm.snap", "vm.snap.tmp"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn targets_are_checked_before_the_vm_pauses() {
        let d = dir("targets");
        let e = |p: &Path| check_target(p).unwrap_err().to_string();
        assert!(e(Path::new("rel/vm.snap")).contains("not absolute"));
        assert!(e(&d.join("nodir/vm.snap")).contains("directory does not exist"));
        assert!(e(&d).contains("is a directory"));
        assert!(check_target(&d.join("vm.snap")).is_ok());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
