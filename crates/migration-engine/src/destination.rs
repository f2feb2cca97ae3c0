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
    /// Restoring the VM's state and resuming it, after the last record arrived.
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

/// The destination's guest memory as the place batches are read into.
struct MemPlacer<'a> {
    mem: &'a GuestMemory,
}

impl PagePlacer for MemPlacer<'_> {
    fn buffers(&mut self, runs: &[(u64, usize)]) -> Result<Vec<io::IoSliceMut<'_>>, String> {
        use vm_memory::GuestMemoryBackend;
        runs.iter()
            .map(|&(gfn, n)| {
                let (gpa, len) = (gfn * PAGE as u64, n * PAGE);
                // Best effort: a page not populated is faulted in by the read.
                let _ = kumo_vm::memory::populate(self.mem, gpa, len as u64);
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
/// kumo source it waits for one (`accept.rs`).
pub fn receive_limited<V: DestVm>(
    listener: &Listener,
    idle: Duration,
    limits: &AcceptLimits,
    progress: &RecvProgress,
    create: impl FnOnce(&VmDescription, Option<File>) -> Result<V, VmError>,
) -> Result<(V, RecvReport), MigrateError> {
    // The header was read unbuffered: a local migration's memory file follows it on the
    // socket, and a buffer would swallow the byte that carries it.
    let (conn0, desc) = accept_source(listener, limits, &progress.rejected)?;
    let t0 = Instant::now();
    conn0.set_read_timeout(Some(idle))?;
    conn0.set_write_timeout(Some(idle))?;
    let raw0 = conn0.try_clone()?;
    let mut conn0 = Replier { enc: Encoder::new(), conn: conn0 };
    // A valid header: say so at once, before building anything (the source's handshake).
    conn0.send(&Reply::Accepted);
    progress.connected.store(true, Ordering::Release);
    let fail = |conn0: &mut Replier, e: MigrateError| -> MigrateError {
        conn0.send(&Reply::Failed(e.to_string()));
        e
    };
    let memfd = if desc.shared_memory {
        match conn0.conn.recv_fd() {
            Ok(fd) => Some(File::from(fd)),
            Err(e) => return Err(fail(&mut conn0, e.into())),
        }
    } else {
        None
    };
    let nconn = desc.connections.max(1) as usize;
    let mut readers = vec![Reader::new(buffered(raw0), &desc)];
    // The other connections, vetted like the first; they must arrive within `idle`.
    let more = AcceptLimits { deadline: Some(idle), ..*limits };
    for i in 1..nconn {
        let (c, d) = match accept_source(listener, &more, &progress.rejected) {
            Ok(x) => x,
            Err(e) => {
                return Err(fail(
                    &mut conn0,
                    MigrateError::Other(format!("connection {i} of {nconn} did not arrive: {e}")),
                ))
            }
        };
        if d != desc {
            return Err(fail(&mut conn0, MigrateError::Other(format!("connection {i} describes another VM"))));
        }
        c.set_read_timeout(Some(idle))?;
        readers.push(Reader::secondary(buffered(c), &desc));
    }
    let vm = match create(&desc, memfd) {
        Ok(vm) => vm,
        Err(e) => return Err(fail(&mut conn0, MigrateError::DestVm(e))),
    };
    conn0.send(&Reply::Ready);
    // Shared with the first connection's receiving thread, which sends the Placed notices.
    let conn0 = Mutex::new(conn0);
    let reply = |r: &Reply| conn0.lock().unwrap_or_else(|p| p.into_inner()).send(r);

    let barrier = RoundBarrier::new(nconn);
    let cpu = AtomicU64::new(0);
    let pages = AtomicU64::new(0);
    let state: Mutex<Option<Vec<u8>>> = Mutex::new(None);
    let mem = vm.memory();
    let result: Result<(), MigrateError> = std::thread::scope(|s| {
        let handles: Vec<_> = readers
            .into_iter()
            .enumerate()
            .map(|(i, mut r)| {
                let (barrier, cpu, pages, state, reply) = (&barrier, &cpu, &pages, &state, &reply);
                kumo_sandbox::spawn_scoped(s, ThreadKind::Migration, format!("mig-recv{i}"), move || {
                    let _unwinding = BreakOnUnwind(barrier);
                    let c0 = thread_cpu_ms();
                    let mut placer = MemPlacer { mem };
                    let res = (|| -> Result<(), MigrateError> {
                        while let Some(rec) = r.next_record_placed(&mut placer).map_err(|e| recv_err(e.into(), idle))? {
                            match rec {
                                Record::MemBatch(b) => {
                                    pages.fetch_add(b.gfns.len() as u64, Ordering::Relaxed);
                                    progress.pages.fetch_add(b.gfns.len() as u64, Ordering::Relaxed);
                                    if b.ack {
                                        reply(&Reply::Placed(b.seq));
                                    }
                                }
                                // Pages of round r+1 must not land before every connection's pages
                                // of round r: a page resent later would be overwritten by its stale
                                // copy on a slower connection.
                                Record::RoundEnd { .. } if nconn > 1 => {
                                    if i == 0 {
                                        progress.rounds.fetch_add(1, Ordering::Relaxed);
                                    }
                                    if !barrier.wait() {
                                        return Err(MigrateError::Other("another connection failed".into()));
                                    }
                                }
                                Record::RoundEnd { .. } => {
                                    progress.rounds.fetch_add(1, Ordering::Relaxed);
                                }
                                Record::State(st) if i == 0 => {
                                    *state.lock().unwrap_or_else(|p| p.into_inner()) = Some(st.to_vec());
                                }
                                Record::State(_) => {
                                    return Err(MigrateError::Other(format!("state sent on connection {i}")))
                                }
                                Record::Complete { .. } => {}
                                Record::Abort(why) => {
                                    return Err(MigrateError::Other(format!("the source aborted: {why}")))
                                }
                            }
                        }
                        Ok(())
                    })();
                    if res.is_err() {
                        barrier.break_all();
                    }
                    add_cpu(cpu, c0);
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
                    barrier.break_all();
                    Err(MigrateError::Io(e))
                }
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    });
    let t_restore = Instant::now();
    progress.restoring.store(result.is_ok(), Ordering::Release);
    let finish = result.and_then(|()| {
        let st = state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| MigrateError::Other("the stream carried no VM state".into()))?;
        vm.restore_state(&st).map_err(MigrateError::DestVm)?;
        vm.resume().map_err(MigrateError::DestVm)
    });
    let restore_ms = ms_since(t_restore);
    let mut conn0 = conn0.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = finish {
        return Err(fail(&mut conn0, e));
    }
    conn0.send(&Reply::Resumed);
    let pages = pages.load(Ordering::Relaxed);
    Ok((
        vm,
        RecvReport {
            connections: nconn,
            pages,
            bytes: pages * PAGE as u64,
            total_ms: t0.elapsed().as_secs_f64() * 1e3,
            receiver_cpu_ms: cpu.load(Ordering::Relaxed) as f64 / 1e3,
            shared_memory: desc.shared_memory,
            restore_ms,
        },
    ))
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
