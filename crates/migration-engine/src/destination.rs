//! The destination side of a live migration: the receiver, which reads page data straight
//! into the destination's guest memory ([`format::Reader::next_record_placed`]): receiving is
//! placing, with no buffer in between.

use kumo_sandbox::ThreadKind;
use std::fs::File;
use std::io::{self, BufReader, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kumo_vm::GuestMemory;
use serde::{Deserialize, Serialize};
use vm_memory::GuestAddress;

use crate::accept::{accept_source, AcceptLimits};
use crate::transport::{Conn, Listener};
use kumo_migration::format::{self, Encoder, PagePlacer, Reader, Record, Reply, VmDescription};

use crate::session::*;

/// A barrier that a failing thread can break, so the others stop waiting instead of hanging.
struct RoundBarrier {
    state: Mutex<(usize, u64, bool)>, // (arrived, generation, broken)
    cv: std::sync::Condvar,
    n: usize,
}

impl RoundBarrier {
    fn new(n: usize) -> Self {
        RoundBarrier { state: Mutex::new((0, 0, false)), cv: std::sync::Condvar::new(), n }
    }

    /// Waits for every connection to finish the round; false if the barrier was broken.
    fn wait(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.2 {
            return false;
        }
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return true;
        }
        let gen = s.1;
        while s.1 == gen && !s.2 {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        !s.2
    }

    fn break_all(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

/// Breaks the barrier if its thread unwinds: the other receivers must not wait for a thread
/// that panicked.
struct BreakOnUnwind<'a>(&'a RoundBarrier);

impl Drop for BreakOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.break_all();
        }
    }
}

/// What the destination measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecvReport {
    pub connections: usize,
    pub pages: u64,
    pub bytes: u64,
    pub total_ms: f64,
    /// CPU time of the receiving threads (user + system).
    pub receiver_cpu_ms: f64,
    pub shared_memory: bool,
    /// The phases after the source's header arrived: the other connections, building the
    /// VM (to `Ready`), the rounds (to the last record), restoring the VM's state and resuming
    /// it.
    pub connections_ms: f64,
    pub build_ms: f64,
    pub receive_ms: f64,
    pub restore_ms: f64,
}

/// How far an incoming migration has got, shared with the destination's API while
/// [`receive_with`] runs.
#[derive(Debug, Default)]
pub struct RecvProgress {
    /// A source's stream header has been accepted.
    connected: AtomicBool,
    /// Connections dropped because they were not a kumo source.
    rejected: AtomicU64,
    pages: AtomicU64,
    /// Rounds the source has ended (counted on its first connection).
    rounds: AtomicU64,
    /// Everything arrived: the VM's state is being restored.
    restoring: AtomicBool,
}

pub use kumo_api::{RecvPhase, RecvStatus};

impl RecvProgress {
    pub fn status(&self) -> RecvStatus {
        let pages = self.pages.load(Ordering::Relaxed);
        let phase = if self.restoring.load(Ordering::Acquire) {
            RecvPhase::Restoring
        } else if self.connected.load(Ordering::Acquire) {
            RecvPhase::Receiving
        } else {
            RecvPhase::Listening
        };
        RecvStatus {
            phase,
            pages,
            bytes: pages * PAGE as u64,
            rounds: self.rounds.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }
}

/// The destination's side of the reply channel: one encoder, so replies are numbered in order.
struct Replier {
    conn: Conn,
    enc: Encoder,
}

impl Replier {
    /// Best effort: a reply that cannot be sent means the source is gone anyway.
    fn send(&mut self, r: &Reply) {
        let mut out = Vec::new();
        self.enc.reply(&mut out, r);
        let _ = self.conn.write_all(&out);
    }
}

/// One bit per page of guest memory, shared by the receiving threads. Two uses:
/// - pages faulted in: a page comes again in later rounds, and a prepared destination's memory
///   is all in: faulting a run in again is a system call and a page-table walk per run, which
///   for the scattered pages of the later rounds was a system call per page;
/// - pages written: the destination's memory starts as zeros, so a `ZeroPages` run needs
///   clearing only where a batch of an earlier round placed data.
struct PageBits(Vec<AtomicU64>);

impl PageBits {
    fn new(mem: &GuestMemory) -> Self {
        use vm_memory::{Address, GuestMemoryBackend};
        let pages = mem.last_addr().raw_value() / PAGE as u64 + 1;
        PageBits((0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }

    fn bit(&self, gfn: u64) -> Option<(&AtomicU64, u64)> {
        Some((self.0.get(usize::try_from(gfn / 64).ok()?)?, 1 << (gfn % 64)))
    }

    /// Whether every page of the run is in.
    fn all(&self, gfn: u64, n: usize) -> bool {
        (gfn..gfn + n as u64).all(|g| self.bit(g).is_some_and(|(w, b)| w.load(Ordering::Relaxed) & b != 0))
    }

    fn set(&self, gfn: u64, n: usize) {
        for (w, b) in (gfn..gfn + n as u64).filter_map(|g| self.bit(g)) {
            w.fetch_or(b, Ordering::Relaxed);
        }
    }

    fn get(&self, gfn: u64) -> bool {
        self.bit(gfn).is_some_and(|(w, b)| w.load(Ordering::Relaxed) & b != 0)
    }
}

/// Clears the pages of zero runs that hold data placed by an earlier round (the rest are
/// still the zeros the memory was created with).
fn clear_zero_runs(mem: &GuestMemory, written: &PageBits, runs: &[(u64, u64)]) -> Result<(), MigrateError> {
    use vm_memory::Bytes;
    static ZERO: [u8; PAGE] = [0; PAGE];
    for &(first, n) in runs {
        for gfn in (first..first + n).filter(|&g| written.get(g)) {
            mem.write_slice(&ZERO, GuestAddress(gfn * PAGE as u64))
                .map_err(|e| MigrateError::Other(format!("clearing zero page {gfn:#x}: {e}")))?;
        }
    }
    Ok(())
}

/// The destination's guest memory as the place batches are read into; `populated` tracks the
/// runs faulted in, unless the memory is all resident already; `written` the pages placed.
struct MemPlacer<'a> {
    mem: &'a GuestMemory,
    populated: Option<&'a PageBits>,
    written: &'a PageBits,
}

impl PagePlacer for MemPlacer<'_> {
    fn buffers(&mut self, runs: &[(u64, usize)]) -> Result<Vec<io::IoSliceMut<'_>>, String> {
        use vm_memory::GuestMemoryBackend;
        runs.iter()
            .map(|&(gfn, n)| {
                let (gpa, len) = (gfn * PAGE as u64, n * PAGE);
                self.written.set(gfn, n);
                // Best effort: a page not populated is faulted in by the read.
                if let Some(p) = self.populated.filter(|p| !p.all(gfn, n)) {
                    if kumo_vm::memory::populate(self.mem, gpa, len as u64).is_ok() {
                        p.set(gfn, n);
                    }
                }
                let slice =
                    self.mem.get_slice(GuestAddress(gpa), len).map_err(|e| format!("pages at {gpa:#x}: {e}"))?;
                let ptr = slice.ptr_guard_mut().as_ptr();
                // SAFETY: `get_slice` checked that the `len` bytes at `ptr` are guest memory
                // mapped for the VM's lifetime, which outlives this borrow of `self.mem`. The
                // destination VM does not run yet, and nothing else holds these pages: the
                // reader hands out disjoint runs (strictly increasing gfns), and receiving
                // threads place different pages (a round sends each page once; rounds are
                // separated by the barrier).
                Ok(io::IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(ptr, len) }))
            })
            .collect()
    }
}

/// Buffered reading for the small frame headers; page data bypasses the buffer (big reads
/// of an empty `BufReader` go straight to the socket).
fn buffered(c: Conn) -> BufReader<Conn> {
    BufReader::with_capacity(64 << 10, c)
}

/// Accepts one incoming migration on `listener`: builds the VM with `create` from the
/// stream's description (and the source's memory file for a local migration), fills its
/// memory, restores its state and resumes it. Connections that stay silent for `idle` fail
/// the migration. On failure the source is told why, and the caller drops the VM.
pub fn receive<V: DestVm>(
    listener: &Listener,
    idle: Duration,
    create: impl FnOnce(&VmDescription, Option<File>) -> Result<V, VmError>,
) -> Result<(V, RecvReport), MigrateError> {
    receive_with(listener, idle, &RecvProgress::default(), create)
}

/// [`receive`], telling `progress` how far it has got.
pub fn receive_with<V: DestVm>(
    listener: &Listener,
    idle: Duration,
    progress: &RecvProgress,
    create: impl FnOnce(&VmDescription, Option<File>) -> Result<V, VmError>,
) -> Result<(V, RecvReport), MigrateError> {
    receive_limited(listener, idle, &AcceptLimits::default(), progress, create)
}

/// [`receive_with`], with bounds on how long and through how many connections that are not a
/// kumo source it waits for one (`accept.rs`). The phases in order: handshake, build, the
/// rounds, commit ([`DestSession`]).
pub fn receive_limited<V: DestVm>(
    listener: &Listener,
    idle: Duration,
    limits: &AcceptLimits,
    progress: &RecvProgress,
    create: impl FnOnce(&VmDescription, Option<File>) -> Result<V, VmError>,
) -> Result<(V, RecvReport), MigrateError> {
    let (s, readers, memfd) = DestSession::handshake(listener, idle, limits, progress)?;
    let connections_ms = ms_since(s.t0);
    let t = Instant::now();
    let vm = s.build(create, memfd)?;
    let build_ms = ms_since(t);
    let t = Instant::now();
    let received = s.receive_rounds(vm.memory(), vm.resident(), readers);
    let receive_ms = ms_since(t);
    let restore_ms = s.commit(&vm, received)?;
    let report = RecvReport { connections_ms, build_ms, receive_ms, ..s.report(restore_ms) };
    Ok((vm, report))
}

/// One connection's records, read through a buffer.
type ConnReader = Reader<BufReader<Conn>>;

/// An incoming migration on the destination, one method per phase:
/// - [`DestSession::handshake`]: the source's header vetted and `Accepted`, a local
///   migration's memory file, the stream's other connections;
/// - [`DestSession::build`]: the empty VM built from the description, `Ready`;
/// - [`DestSession::receive_rounds`]: pre-copy and stop-and-copy as the receiver sees them,
///   each connection's batches placed straight into guest memory by a thread of its own, up to
///   `State` and `Complete`;
/// - [`DestSession::commit`]: the state restored, the VM resumed, `Resumed`.
///
/// Any phase that fails tells the source why (`Failed`); the caller drops the VM.
struct DestSession<'a> {
    idle: Duration,
    progress: &'a RecvProgress,
    desc: VmDescription,
    /// The first connection's reply side, shared with its receiving thread (Placed notices).
    replier: Mutex<Replier>,
    t0: Instant,
    /// Keeps the connections' rounds in step (see [`DestSession::receive_connection`]).
    barrier: RoundBarrier,
    /// Pages placed, and the receiving threads' CPU time (µs).
    pages: AtomicU64,
    cpu: AtomicU64,
    /// The VM's state, from the first connection.
    state: Mutex<Option<Vec<u8>>>,
}

impl<'a> DestSession<'a> {
    /// Handshake: waits for a source's header (`accept.rs` vets each connection), answers
    /// `Accepted` at once, before building anything, then takes the memory file of a local
    /// migration and the stream's other connections, which must arrive within `idle` and
    /// describe the same VM. Returns each connection's reader and the memory file.
    fn handshake(
        listener: &Listener,
        idle: Duration,
        limits: &AcceptLimits,
        progress: &'a RecvProgress,
    ) -> Result<(Self, Vec<ConnReader>, Option<File>), MigrateError> {
        // The header was read unbuffered: a local migration's memory file follows it on the
        // socket, and a buffer would swallow the byte that carries it.
        let (conn0, desc) = accept_source(listener, limits, &progress.rejected)?;
        let t0 = Instant::now();
        conn0.set_read_timeout(Some(idle))?;
        conn0.set_write_timeout(Some(idle))?;
        let raw0 = conn0.try_clone()?;
        let nconn = desc.connections.max(1) as usize;
        let s = DestSession {
            idle,
            progress,
            desc,
            replier: Mutex::new(Replier { enc: Encoder::new(), conn: conn0 }),
            t0,
            barrier: RoundBarrier::new(nconn),
            pages: AtomicU64::new(0),
            cpu: AtomicU64::new(0),
            state: Mutex::new(None),
        };
        s.reply(&Reply::Accepted);
        progress.connected.store(true, Ordering::Release);
        let memfd = if s.desc.shared_memory {
            match kumo_sandbox::lock(&s.replier).conn.recv_fd() {
                Ok(fd) => Some(File::from(fd)),
                Err(e) => return Err(s.fail(e.into())),
            }
        } else {
            None
        };
        let mut readers = vec![Reader::new(buffered(raw0), &s.desc)];
        let more = AcceptLimits { deadline: Some(idle), ..*limits };
        for i in 1..nconn {
            let (c, d) = match accept_source(listener, &more, &progress.rejected) {
                Ok(x) => x,
                Err(e) => {
                    let e = MigrateError::Other(format!("connection {i} of {nconn} did not arrive: {e}"));
                    return Err(s.fail(e));
                }
            };
            if d != s.desc {
                return Err(s.fail(MigrateError::Other(format!("connection {i} describes another VM"))));
            }
            c.set_read_timeout(Some(idle))?;
            readers.push(Reader::secondary(buffered(c), &s.desc));
        }
        Ok((s, readers, memfd))
    }

    /// A reply on the first connection.
    fn reply(&self, r: &Reply) {
        kumo_sandbox::lock(&self.replier).send(r);
    }

    /// Tells the source why the migration failed, and returns the error.
    fn fail(&self, e: MigrateError) -> MigrateError {
        self.reply(&Reply::Failed(e.to_string()));
        e
    }

    /// Build: the empty VM the description asks for (on the source's memory file for a local
    /// migration), then `Ready`: the source may send records.
    fn build<V>(
        &self,
        create: impl FnOnce(&VmDescription, Option<File>) -> Result<V, VmError>,
        memfd: Option<File>,
    ) -> Result<V, MigrateError> {
        let vm = create(&self.desc, memfd).map_err(|e| self.fail(MigrateError::DestVm(e)))?;
        self.reply(&Reply::Ready);
        Ok(vm)
    }

    /// The rounds, as the receiver sees pre-copy and stop-and-copy: one thread per connection
    /// reads its records, placing page data straight into `mem`, until `Complete`. Any
    /// thread's failure stops the others (the round barrier breaks). Unless `resident`, each
    /// run is faulted in before it is read into (once).
    fn receive_rounds(&self, mem: &GuestMemory, resident: bool, readers: Vec<ConnReader>) -> Result<(), MigrateError> {
        let tracked = (!resident).then(|| PageBits::new(mem));
        let (populated, written) = (tracked.as_ref(), &PageBits::new(mem));
        std::thread::scope(|s| {
            let handles: Vec<_> = readers
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    kumo_sandbox::spawn_scoped(s, ThreadKind::Migration, format!("mig-recv{i}"), move || {
                        let _unwinding = BreakOnUnwind(&self.barrier);
                        let c0 = thread_cpu_ms();
                        let res = self.receive_connection(i, r, MemPlacer { mem, populated, written });
                        if res.is_err() {
                            self.barrier.break_all();
                        }
                        add_cpu(&self.cpu, c0);
                        res
                    })
                })
                .collect();
            let mut first = Ok(());
            for h in handles {
                let r = match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err(MigrateError::Other("receiver thread panicked".into()))),
                    Err(e) => {
                        // The other connections must not wait at a round barrier for this one.
                        self.barrier.break_all();
                        Err(MigrateError::Io(e))
                    }
                };
                if first.is_ok() {
                    first = r;
                }
            }
            first
        })
    }

    /// Connection `i`'s records, read by its own thread: batches placed (and acknowledged when
    /// asked), rounds counted, the state kept (first connection only).
    fn receive_connection(&self, i: usize, mut r: ConnReader, mut placer: MemPlacer) -> Result<(), MigrateError> {
        let (progress, multi) = (self.progress, self.barrier.n > 1);
        loop {
            // Before each record: the source waits for its bytes to be acknowledged at a
            // round's end, and this connection's replies make the kernel delay ACKs.
            r.get_ref().get_ref().quick_ack();
            let Some(rec) = r.next_record_placed(&mut placer).map_err(|e| recv_err(e.into(), self.idle))? else {
                break;
            };
            match rec {
                Record::MemBatch(b) => {
                    self.pages.fetch_add(b.gfns.len() as u64, Ordering::Relaxed);
                    progress.pages.fetch_add(b.gfns.len() as u64, Ordering::Relaxed);
                    if b.ack {
                        self.reply(&Reply::Placed(b.seq));
                    }
                }
                // Pages of a run were placed by this round's batches only if the stream named
                // them twice in a round (no kumo source does); earlier rounds' are behind the
                // barrier.
                Record::ZeroPages { runs, .. } => {
                    let n: u64 = runs.iter().map(|r| r.1).sum();
                    clear_zero_runs(placer.mem, placer.written, runs)?;
                    self.pages.fetch_add(n, Ordering::Relaxed);
                    progress.pages.fetch_add(n, Ordering::Relaxed);
                }
                // Pages of round r+1 must not land before every connection's pages of round r:
                // a page resent later would be overwritten by its stale copy on a slower
                // connection.
                Record::RoundEnd { .. } if multi => {
                    if i == 0 {
                        progress.rounds.fetch_add(1, Ordering::Relaxed);
                    }
                    if !self.barrier.wait() {
                        return Err(MigrateError::Other("another connection failed".into()));
                    }
                }
                Record::RoundEnd { .. } => {
                    progress.rounds.fetch_add(1, Ordering::Relaxed);
                }
                Record::State(st) if i == 0 => {
                    *kumo_sandbox::lock(&self.state) = Some(st.to_vec());
                }
                Record::State(_) => return Err(MigrateError::Other(format!("state sent on connection {i}"))),
                Record::Complete { .. } => {}
                Record::Abort(why) => return Err(MigrateError::Other(format!("the source aborted: {why}"))),
            }
        }
        Ok(())
    }

    /// Commit: once every connection has completed, restores the VM's state and resumes it,
    /// then tells the source (`Resumed`, or `Failed` on any error, the rounds' included).
    /// Returns how long restoring and resuming took, ms.
    fn commit<V: DestVm>(&self, vm: &V, received: Result<(), MigrateError>) -> Result<f64, MigrateError> {
        let t_restore = Instant::now();
        self.progress.restoring.store(received.is_ok(), Ordering::Release);
        let finish = received.and_then(|()| {
            let st = kumo_sandbox::lock(&self.state)
                .take()
                .ok_or_else(|| MigrateError::Other("the stream carried no VM state".into()))?;
            vm.restore_state(&st).map_err(MigrateError::DestVm)?;
            vm.resume().map_err(MigrateError::DestVm)
        });
        let restore_ms = ms_since(t_restore);
        finish.map_err(|e| self.fail(e))?;
        self.reply(&Reply::Resumed);
        Ok(restore_ms)
    }

    /// What the destination measured.
    fn report(&self, restore_ms: f64) -> RecvReport {
        let pages = self.pages.load(Ordering::Relaxed);
        RecvReport {
            connections: self.barrier.n,
            pages,
            bytes: pages * PAGE as u64,
            total_ms: self.t0.elapsed().as_secs_f64() * 1e3,
            receiver_cpu_ms: self.cpu.load(Ordering::Relaxed) as f64 / 1e3,
            shared_memory: self.desc.shared_memory,
            connections_ms: 0.0,
            build_ms: 0.0,
            receive_ms: 0.0,
            restore_ms,
        }
    }
}

/// The receiver's view of an error: a read deadline becomes "no progress".
fn recv_err(e: MigrateError, idle: Duration) -> MigrateError {
    match e {
        MigrateError::Stream(format::Error::Io(io)) | MigrateError::Io(io) if is_timeout(&io) => {
            MigrateError::NoProgress { what: "no data from the source", after: idle }
        }
        e => e,
    }
}

#[cfg(test)]
mod barrier_tests {
    use super::*;

    #[test]
    fn a_receiver_that_panics_breaks_the_round_barrier_for_the_others() {
        let barrier = RoundBarrier::new(2);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| barrier.wait());
            let panicker = s.spawn(|| {
                let _unwinding = BreakOnUnwind(&barrier);
                panic!("receiver bug (expected by the test)");
            });
            assert!(panicker.join().is_err());
            assert!(!waiter.join().unwrap(), "the other receiver stops waiting: the barrier is broken");
        });
        // A thread that ends normally leaves it alone.
        let barrier = RoundBarrier::new(1);
        drop(BreakOnUnwind(&barrier));
        assert!(barrier.wait());
    }
}

#[cfg(test)]
mod populated_tests {
    use super::*;

    #[test]
    fn runs_are_marked_across_words_and_pages_past_the_end_never_count() {
        let mem = kumo_vm::Memory::new(16 << 20).unwrap();
        let p = PageBits::new(&mem.guest);
        assert!(!p.all(60, 8));
        p.set(60, 8); // bits 60..=63 of word 0 and 0..=3 of word 1
        assert!(p.all(60, 8) && p.all(63, 2) && !p.all(59, 2) && !p.all(67, 2));
        // 4,096 pages: a run past the last one is never "all in", and setting it is harmless.
        p.set(4092, 10);
        assert!(p.all(4092, 4) && !p.all(4092, 5));
    }
}
