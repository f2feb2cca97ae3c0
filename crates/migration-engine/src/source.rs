//! The source side of a live migration: the pre-copy loop, the collector that splits rounds
//! into batches (the bandwidth cap and cancel checks sit there), the sender threads (which send
//! zero pages as runs) and the transport sinks they write through.

use kumo_sandbox::ThreadKind;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kumo_migration::PageBitmap;
use kumo_vm::GuestMemory;
use vm_memory::{Bytes, GuestAddress};

use crate::control::{CancelToken, SystemClock, TokenBucket};
use crate::transport::{Address, Conn, ZeroCopy};
use kumo_migration::format::{self, BatchFrame, Checksum, Encoder, Reply, ReplyReader, VmDescription, MAX_BATCH_PAGES};
use kumo_migration::planner::{Decision, Planner, RoundExtras, RoundStats};
use kumo_migration::StopPhaseSample;

use crate::session::*;

/// One batch handed between pipeline stages: its gfns and (for copying engines) their data.
struct Batch {
    round: u32,
    gfns: Vec<u64>,
    data: Vec<u8>,
    checksum: Checksum,
    /// Per page, whether it holds only zeros, when the collector already had to know (the
    /// bandwidth cap charges data pages only); else the sender finds out.
    zero: Option<Vec<bool>>,
}

enum Work {
    Batch(Batch),
    RoundEnd(u32),
    /// Answer once everything queued before has been written.
    Flush(SyncSender<()>),
}

/// What a sender thread hands back: its sink (for the closing records), its encoder (the
/// stream's seq) and what it counted.
type SenderEnd = Result<(Box<dyn BatchSink>, Encoder, SenderStats), MigrateError>;

/// A sender thread: owns one connection's sink and writes what it is given, returning buffers.
struct Sender {
    tx: Option<SyncSender<Work>>,
    handle: Option<std::thread::JoinHandle<SenderEnd>>,
}

impl Sender {
    fn send(&self, w: Work) -> Result<(), MigrateError> {
        let stopped = || MigrateError::Other("sender thread stopped".into());
        self.tx.as_ref().ok_or_else(stopped)?.send(w).map_err(|_| stopped())
    }

    /// Closes the queue and waits for the thread's end.
    fn finish(&mut self) -> Option<std::thread::Result<SenderEnd>> {
        drop(self.tx.take());
        self.handle.take().map(|h| h.join())
    }
}

impl Drop for Sender {
    /// A session that returns early or unwinds still joins its senders: they read guest memory
    /// through raw addresses ([`SendMem`]), which must not outlive the session.
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// One connection's wire as the sender threads see it: the transport boundary. The pre-copy
/// loop and the collector only hand a sink batches and encoded records, so a new transport is
/// a new implementation (RDMA would send region info, RDMA-write the pages and wait for the
/// completion notice) and nothing above it changes.
trait BatchSink: Send {
    /// Puts one batch on the wire: `frame`'s head, the batch's page data, the trailer.
    fn send_batch(&mut self, frame: BatchFrame, b: &Batch) -> Result<(), MigrateError>;
    /// Whether page `i` of `b` holds only zeros (read where this sink reads page data).
    fn is_zero(&self, b: &Batch, i: usize) -> bool;
    /// Writes records already encoded (RoundEnd, State, Complete, Abort).
    fn send_records(&mut self, bytes: &[u8]) -> Result<(), MigrateError>;
    /// No batch follows: returns once the transport no longer reads guest memory, with the
    /// zero-copy sends completed and those the kernel copied anyway.
    fn drain(&mut self) -> Result<(u64, u64), MigrateError> {
        Ok((0, 0))
    }
}

/// A stream socket fed from the collector's buffers (serial, overlap). Writes time out after
/// the progress deadline (`SO_SNDTIMEO`, set by the session).
struct CopySink(Conn, Duration);

impl BatchSink for CopySink {
    fn send_batch(&mut self, mut frame: BatchFrame, b: &Batch) -> Result<(), MigrateError> {
        frame.update(&b.data);
        let trailer = frame.trailer()?;
        let mut bufs = [io::IoSlice::new(frame.head()), io::IoSlice::new(&b.data), io::IoSlice::new(&trailer)];
        crate::transport::write_all_vectored(&mut self.0, &mut bufs).map_err(|e| send_err(e, self.1))
    }

    fn send_records(&mut self, bytes: &[u8]) -> Result<(), MigrateError> {
        self.0.write_all(bytes).map_err(|e| send_err(e, self.1))
    }

    fn is_zero(&self, b: &Batch, i: usize) -> bool {
        b.data.get(i * PAGE..(i + 1) * PAGE).is_some_and(format::is_zero_page)
    }
}

/// A stream socket fed straight from guest memory (zerocopy): iovecs into the guest's pages,
/// with MSG_ZEROCOPY where the kernel would otherwise copy.
struct ZeroCopySink {
    conn: Conn,
    mem: SendMem,
    zc: ZeroCopy,
    deadline: Duration,
}

impl BatchSink for ZeroCopySink {
    fn send_batch(&mut self, mut frame: BatchFrame, b: &Batch) -> Result<(), MigrateError> {
        // Only guest pages go zero-copy: the kernel reads them after sendmsg returns, which is
        // safe for guest memory (mapped for the VM's life) but not for the short-lived frame
        // head and trailer, sent by ordinary copy.
        let deadline = self.deadline;
        self.conn.write_all(frame.head()).map_err(|e| send_err(e, deadline))?;
        // Contiguous pages share one iovec.
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(b.gfns.len());
        for &g in &b.gfns {
            let a = self
                .mem
                .addr(g)
                .ok_or_else(|| MigrateError::SourceMemory(format!("page {g:#x} outside guest memory")))?;
            if b.checksum == Checksum::Full {
                // SAFETY: `a` maps a whole guest page (checked by `addr`); a full checksum is
                // only asked for while the VM is paused.
                frame.update(unsafe { std::slice::from_raw_parts(a as *const u8, PAGE) });
            }
            match iov.last_mut() {
                Some(l) if l.iov_base as usize + l.iov_len == a => l.iov_len += PAGE,
                _ => iov.push(libc::iovec { iov_base: a as *mut libc::c_void, iov_len: PAGE }),
            }
        }
        self.zc.send_iovecs(&self.conn, &mut iov).map_err(|e| send_err(e, deadline))?;
        self.conn.write_all(&frame.trailer()?).map_err(|e| send_err(e, deadline))
    }

    fn send_records(&mut self, bytes: &[u8]) -> Result<(), MigrateError> {
        self.conn.write_all(bytes).map_err(|e| send_err(e, self.deadline))
    }

    fn is_zero(&self, b: &Batch, i: usize) -> bool {
        // A page of data ends its scan at its first cache line, which is cold: without a look
        // ahead the scan of a batch is a string of misses, one page apart.
        if let Some(a) = b.gfns.get(i + SCAN_AHEAD).and_then(|&g| self.mem.addr(g)) {
            prefetch(a);
        }
        b.gfns.get(i).is_some_and(|&g| self.mem.page_is_zero(g))
    }

    fn drain(&mut self) -> Result<(u64, u64), MigrateError> {
        self.zc.reap(self.conn.as_raw_fd(), false)?;
        Ok((self.zc.completions, self.zc.copied))
    }
}

/// How many pages ahead of its zero scan a sender asks for a page's first cache line. Idle
/// prefilled 2 GiB hops, zerocopy x2, nine each alternating: median 190 against 201 ms without.
const SCAN_AHEAD: usize = 8;

/// Asks the CPU for the cache line at `addr` (a hint: no fault, no effect on correctness).
fn prefetch(addr: usize) {
    // SAFETY: SSE is part of x86_64's baseline, and a prefetch only hints: it reads nothing
    // the program sees and does not fault, whatever the address.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[derive(Default)]
struct SenderStats {
    /// Pages this connection carried in all rounds (its Complete record says so), zero
    /// pages included.
    pages: u64,
    zc_completions: u64,
    zc_copied: u64,
}

/// What the sender threads share with the session.
#[derive(Clone)]
struct Shared {
    /// CPU time of the migration's threads, µs.
    cpu: Arc<AtomicU64>,
    /// Zero pages found: `Some` when they go as runs (not with `ack`: the serial engine
    /// measures the paper's batch-by-batch baseline, each batch acknowledged).
    zero: Option<Arc<AtomicU64>>,
}

/// `ack`: ask for a `Placed` notice after every batch (the serial engine waits for it).
fn spawn_sender(
    sink: Box<dyn BatchSink>,
    ack: bool,
    free: SyncSender<Vec<u8>>,
    shared: Shared,
    depth: usize,
) -> io::Result<Sender> {
    let (tx, rx) = sync_channel::<Work>(depth);
    let handle = kumo_sandbox::spawn(ThreadKind::Migration, "mig-send", move || {
        let t0 = thread_cpu_ms();
        // A sender holds only its connection and buffers: its panic fails the migration (the
        // job gives the VM back) instead of stopping the VM.
        let cpu = shared.cpu.clone();
        let r = kumo_sandbox::contain(ThreadKind::Migration, "mig-send", || sender_loop(sink, ack, rx, free, shared))
            .unwrap_or_else(|p| Err(MigrateError::Other(p.to_string())));
        add_cpu(&cpu, t0);
        r
    })?;
    Ok(Sender { tx: Some(tx), handle: Some(handle) })
}

/// Guest memory's host mapping, for zero-copy iovecs. Valid while the VM lives, which outlives
/// the migration (the session borrows the VM for its whole run).
#[derive(Clone)]
struct SendMem {
    /// (first gfn, pages, host address), one per RAM region.
    regions: Arc<[(u64, u64, usize)]>,
}

// SAFETY: the addresses refer to guest memory mappings that outlive the migration threads
// (they are joined before `migrate` returns); only the kernel reads through them.
unsafe impl Send for SendMem {}

impl SendMem {
    fn new(mem: &GuestMemory) -> SendMem {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        let regions =
            mem.iter().map(|r| (r.start_addr().0 / PAGE as u64, r.len() / PAGE as u64, r.as_ptr() as usize)).collect();
        SendMem { regions }
    }

    fn addr(&self, gfn: u64) -> Option<usize> {
        self.regions
            .iter()
            .find(|(first, n, _)| gfn >= *first && gfn < first + n)
            .map(|(first, _, host)| host + ((gfn - first) as usize) * PAGE)
    }

    /// Whether guest page `gfn` holds only zeros (false outside guest memory).
    fn page_is_zero(&self, gfn: u64) -> bool {
        let Some(a) = self.addr(gfn) else { return false };
        let words = a as *const u64;
        // Eight words OR-ed per 64-byte line, one branch per line: a page scan is bound by
        // memory (~60 ms per 512 MiB here), a branch per word made it ~90.
        (0..PAGE / 64).all(|line| {
            (0..8).fold(0u64, |acc, w| {
                // SAFETY: `a` is the host address of a whole guest page (`addr` checked the
                // gfn), mapped for the VM's life. The guest may write it meanwhile, hence
                // volatile reads; a page written after it was found zero is dirty and goes
                // again in a later round.
                acc | unsafe { std::ptr::read_volatile(words.add(line * 8 + w)) }
            }) == 0
        })
    }
}

fn sender_loop(
    mut sink: Box<dyn BatchSink>,
    ack: bool,
    rx: Receiver<Work>,
    free: SyncSender<Vec<u8>>,
    shared: Shared,
) -> SenderEnd {
    let mut enc = Encoder::new();
    let mut out = Vec::with_capacity(64);
    let mut round_pages = 0u64;
    let mut stats = SenderStats::default();
    for work in rx {
        match work {
            Work::Batch(mut b) => {
                round_pages += b.gfns.len() as u64;
                if let Some(z) = &shared.zero {
                    let n = send_zero_pages(&mut *sink, &mut enc, &mut out, &mut b)?;
                    z.fetch_add(n, Ordering::Relaxed);
                }
                if !b.gfns.is_empty() {
                    let frame = enc.batch_frame(b.round, &b.gfns, b.checksum, ack)?;
                    sink.send_batch(frame, &b)?;
                }
                let _ = free.try_send(b.data);
            }
            Work::RoundEnd(round) => {
                out.clear();
                enc.round_end(&mut out, round, round_pages);
                sink.send_records(&out)?;
                stats.pages += round_pages;
                round_pages = 0;
            }
            Work::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
    (stats.zc_completions, stats.zc_copied) = sink.drain()?;
    Ok((sink, enc, stats))
}

/// Sends the pages of `b` that hold only zeros as one `ZeroPages` record (runs of gfns, no
/// data) and leaves the others in `b` (its data compacted for the copying engines). Returns
/// how many were zero. A fresh destination's memory is zeros; it clears only pages it placed.
fn send_zero_pages(
    sink: &mut dyn BatchSink,
    enc: &mut Encoder,
    out: &mut Vec<u8>,
    b: &mut Batch,
) -> Result<u64, MigrateError> {
    let zero = b.zero.take().unwrap_or_else(|| (0..b.gfns.len()).map(|i| sink.is_zero(b, i)).collect());
    let before = b.gfns.len();
    let runs = format::split_zero_pages(&mut b.gfns, &mut b.data, |i| zero[i]);
    if runs.is_empty() {
        return Ok(0);
    }
    if !b.data.is_empty() {
        b.data.truncate(b.gfns.len() * PAGE);
    }
    out.clear();
    enc.zero_pages(out, b.round, &runs)?;
    sink.send_records(out)?;
    Ok((before - b.gfns.len()) as u64)
}

/// Splits a set of pages into batches and feeds them to the senders, copying page data into
/// pooled buffers for the copying engines (the pipeline's "map" stage).
struct Collector<'a> {
    mem: &'a GuestMemory,
    copy: bool,
    /// The paper's serial baseline: copy, send, wait for the destination's completion notice
    /// and release one batch at a time, never copying the next batch while one is in flight.
    /// Holds the reply channel the notices come on.
    lockstep: Option<(&'a mut Replies, Duration)>,
    free_rx: Receiver<Vec<u8>>,
    senders: &'a [Sender],
    next: usize,
    /// Lockstep mode's one buffer, back from the sender.
    spare: Option<Vec<u8>>,
    cancel: &'a CancelToken,
    /// The bandwidth cap, if any. It charges the pages that carry data: when zero pages go as
    /// runs, the collector tests each batch's pages itself (after re-arming them) and hands the
    /// answer on, so the senders do not test them again.
    cap: Option<TokenBucket<SystemClock>>,
    /// Zero-copy's view of guest memory, for that test (the copying engines test their copy).
    zero_test: Option<SendMem>,
    /// While the VM runs: each batch's pages are re-armed in its dirty log right before they
    /// are read, and the time that takes.
    rearm: Option<&'a dyn SourceVm>,
    rearm_time: Duration,
    /// Time spent waiting for the bandwidth cap.
    cap_wait: Duration,
}

/// How far a round has got, handed to the session's progress callback.
struct RoundProgress {
    round: u32,
    round_pages: u64,
    pages_sent: u64,
    elapsed: Duration,
}

impl Collector<'_> {
    /// Sends `pages` (`round_pages` of them) as round `round`, reporting progress at most
    /// every [`PROGRESS_INTERVAL`] and checking for a cancel between batches.
    fn send_round(
        &mut self,
        round: u32,
        pages: impl Iterator<Item = u64>,
        round_pages: u64,
        checksum: Checksum,
        progress: &mut dyn FnMut(RoundProgress),
    ) -> Result<u64, MigrateError> {
        let t0 = Instant::now();
        let last = std::cell::Cell::new(t0);
        let mut gfns = Vec::with_capacity(MAX_BATCH_PAGES);
        let mut n = 0u64;
        let mut report = |n: u64, force: bool| {
            let now = Instant::now();
            if force || now.duration_since(last.get()) >= PROGRESS_INTERVAL {
                last.set(now);
                progress(RoundProgress { round, round_pages, pages_sent: n, elapsed: now.duration_since(t0) });
            }
        };
        for g in pages {
            gfns.push(g);
            if gfns.len() == MAX_BATCH_PAGES {
                n += gfns.len() as u64;
                self.dispatch(round, std::mem::replace(&mut gfns, Vec::with_capacity(MAX_BATCH_PAGES)), checksum)?;
                report(n, false);
            }
        }
        if !gfns.is_empty() {
            n += gfns.len() as u64;
            self.dispatch(round, gfns, checksum)?;
        }
        // A round that reported along the way also reports its last batch.
        if last.get() != t0 {
            report(n, true);
        }
        for s in self.senders {
            s.send(Work::RoundEnd(round))?;
        }
        Ok(n)
    }

    fn dispatch(&mut self, round: u32, gfns: Vec<u64>, checksum: Checksum) -> Result<(), MigrateError> {
        if self.cancel.is_cancelled() {
            return Err(MigrateError::Cancelled);
        }
        if let Some(src) = self.rearm {
            let t = Instant::now();
            src.rearm_dirty(&gfns).map_err(MigrateError::Source)?;
            self.rearm_time += t.elapsed();
        }
        let mut data = Vec::new();
        if self.copy {
            // Reuse a buffer a sender has released, or allocate while the pool fills up.
            data = self.spare.take().or_else(|| self.free_rx.try_recv().ok()).unwrap_or_default();
            data.resize(gfns.len() * PAGE, 0);
            for (i, &g) in gfns.iter().enumerate() {
                self.mem
                    .read_slice(&mut data[i * PAGE..(i + 1) * PAGE], GuestAddress(g * PAGE as u64))
                    .map_err(|e| MigrateError::SourceMemory(format!("reading page {g:#x}: {e}")))?;
            }
        }
        let zero = self.pay_for(&gfns, &data)?;
        let s = &self.senders[self.next % self.senders.len()];
        self.next += 1;
        s.send(Work::Batch(Batch { round, gfns, data, checksum, zero }))?;
        if let Some((replies, timeout)) = &mut self.lockstep {
            // The batch is done when the destination has it in place, as an RDMA write is
            // done at its completion; TCP's send buffer alone would already overlap stages.
            match replies.wait(*timeout)? {
                Reply::Placed(_) => {}
                Reply::Failed(why) => return Err(MigrateError::Dest(why)),
                other => {
                    return Err(MigrateError::Other(format!("expected Placed from the destination, got {other:?}")))
                }
            }
            let buf = self.free_rx.recv().map_err(|_| MigrateError::Other("sender thread stopped".into()))?;
            self.spare = Some(buf);
        }
        Ok(())
    }

    /// Waits until the bandwidth cap has paid for a batch's page data (`data`: the copying
    /// engines' copy). Its zero pages go as runs and cost nothing, so they are found here,
    /// after the batch was re-armed (a page written after the test is dirty again), and the
    /// answer goes to the sender with the batch.
    fn pay_for(&mut self, gfns: &[u64], data: &[u8]) -> Result<Option<Vec<bool>>, MigrateError> {
        let Some(cap) = &mut self.cap else { return Ok(None) };
        let zero: Option<Vec<bool>> = match (&self.zero_test, self.copy) {
            _ if self.lockstep.is_some() => None, // serial sends every page with its data
            (_, true) => Some(data.chunks(PAGE).map(format::is_zero_page).collect()),
            (Some(m), false) => Some(gfns.iter().map(|&g| m.page_is_zero(g)).collect()),
            (None, false) => None,
        };
        let data_pages = zero.as_ref().map_or(gfns.len(), |z| z.iter().filter(|&&z| !z).count());
        let wait = cap.take((data_pages * PAGE) as u64);
        let t = Instant::now();
        sleep_unless_cancelled(wait, self.cancel)?;
        self.cap_wait += t.elapsed();
        Ok(zero)
    }
}

/// The destination's replies on the first connection, read in order.
struct Replies(ReplyReader<Conn>);

impl Replies {
    fn wait(&mut self, timeout: Duration) -> Result<Reply, MigrateError> {
        self.0.get_mut().set_read_timeout(Some(timeout))?;
        match self.0.next_reply() {
            Ok(reply) => Ok(reply),
            Err(format::Error::Io(e)) if is_timeout(&e) => Err(MigrateError::ReplyTimeout(timeout)),
            Err(e) => Err(e.into()),
        }
    }
}

/// Why a VM with private memory does not migrate with the local engine.
pub const PRIVATE_LOCAL: &str = "the local engine hands guest memory's file to the destination, and this VM's memory is private (kumo's default), in no file: use a network engine (zerocopy, overlap, serial), or start the VM with --shared-memory";

/// Why the zerocopy engine does not run over TLS.
pub const ZEROCOPY_TLS: &str = "the zerocopy engine hands guest pages to the kernel unencrypted (MSG_ZEROCOPY) and cannot run over TLS: use --engine overlap (or serial) with --tls-dir";

/// A TLS failure reading the destination's replies, said as such rather than as a stream
/// that is not kumo's.
fn tls_failure(to: &Address, e: &MigrateError) -> Option<MigrateError> {
    let io = match e {
        MigrateError::Stream(format::Error::Io(io)) | MigrateError::Io(io) => io,
        _ => return None,
    };
    crate::tls::tls_cause(io).map(|t| MigrateError::Other(format!("{to}: {t}")))
}

/// How the chosen engine moves pages, decided once from the options: the rest of the session
/// reads these instead of asking which engine runs.
struct Plan {
    connections: usize,
    /// `local`: guest memory goes to the destination over SCM_RIGHTS; no pre-copy.
    shared_memory: bool,
    /// `serial`, `overlap`: the collector copies page data into pooled buffers; `zerocopy`
    /// sends from guest memory.
    copy: bool,
    /// `serial`: one batch in flight, each acknowledged (`Placed`) before the next.
    lockstep: bool,
    /// Batches queued per sender thread.
    depth: usize,
    /// Live rounds checksum their data only when it was copied: a page sent from guest memory
    /// may change on its way (it is then dirty and sent again).
    live_checksum: Checksum,
}

impl Plan {
    fn new(opts: &MigrateOptions) -> Result<Plan, MigrateError> {
        let e = opts.engine;
        if e == MigrationEngine::Zerocopy && opts.tls.is_some() {
            return Err(MigrateError::Other(ZEROCOPY_TLS.into()));
        }
        if e == MigrationEngine::Serial && opts.connections > 1 {
            return Err(MigrateError::Other(
                "the serial engine sends one batch at a time on one connection: use --connections 1".into(),
            ));
        }
        let shared_memory = e == MigrationEngine::Local;
        let copy = e != MigrationEngine::Zerocopy;
        let lockstep = e == MigrationEngine::Serial;
        Ok(Plan {
            connections: if shared_memory { 1 } else { opts.connections.clamp(1, format::MAX_CONNECTIONS as usize) },
            shared_memory,
            copy,
            lockstep,
            depth: if lockstep { 0 } else { 4 },
            live_checksum: if copy { Checksum::Full } else { Checksum::MetadataOnly },
        })
    }
}

/// Migrates `src` to the kumo listening at `to`. On success the source VM is left paused (its
/// copy now runs at the destination). On a failure before the VM's final state has gone out,
/// dirty logging is stopped and the source VM runs on. After it has gone out, only the
/// destination's explicit `Failed` gives the VM back; any other failure is
/// [`MigrateError::Unconfirmed`] and the source stays paused: one owner at a time.
pub fn migrate(
    src: &dyn SourceVm,
    to: &Address,
    opts: &MigrateOptions,
    events: &mut dyn FnMut(Event),
) -> Result<Report, MigrateError> {
    let paused = AtomicBool::new(false);
    let r = migrate_inner(src, to, opts, events, &paused);
    // Teardown: whatever the phases left behind goes back to how the VM was.
    src.set_throttle(0);
    if let Err(e) = &r {
        src.stop_dirty_log();
        if paused.load(Ordering::Acquire) && !matches!(e, MigrateError::Unconfirmed(_)) {
            if let Err(re) = src.resume() {
                tracing::error!("migration failed ({e}) and the source VM could not be resumed: {re}");
            }
        }
        events(match e {
            MigrateError::Cancelled => Event::Cancelled,
            e => Event::Failed { error: e.to_string() },
        });
    }
    r
}

/// The phases in order: handshake; then pre-copy and stop-and-copy over the engine's pipeline
/// (or, for `local`, the pause alone: memory is shared); then commit. The destination builds
/// the VM while the source starts dirty logging and its senders.
fn migrate_inner(
    src: &dyn SourceVm,
    to: &Address,
    opts: &MigrateOptions,
    events: &mut dyn FnMut(Event),
    paused: &AtomicBool,
) -> Result<Report, MigrateError> {
    let mut s = SourceSession::new(src, to, opts, events, paused)?;
    let (mut replies, conns) = s.handshake()?;
    let (mut closing, pause_at) = if s.plan.shared_memory {
        s.wait_ready(&mut replies)?;
        s.share_memory(conns)?
    } else {
        s.transfer(conns, &mut replies)?
    };
    let downtime = s.commit(&mut closing, &mut replies, pause_at)?;
    Ok(s.report(downtime))
}

/// A connection after its last batch: its sink, its encoder (the stream's seq) and the pages it
/// carried, for the closing records (`State`, `Complete` or `Abort`).
type Closing = (Box<dyn BatchSink>, Encoder, u64);

/// Sends `Abort` with `why` on every connection that still takes it (best effort: the
/// destination may be gone).
fn abort_all(closing: &mut [Closing], why: &str) {
    for (c, enc, _) in closing {
        let mut out = Vec::new();
        enc.abort(&mut out, why);
        let _ = c.send_records(&out);
    }
}

/// The engine's pipeline as [`SourceSession::start_pipeline`] builds it.
struct Pipeline {
    /// One sender thread per connection.
    senders: Vec<Sender>,
    /// A handle on each socket, to watch its send queue drain.
    watch: Vec<Conn>,
    /// Buffers the senders give back.
    free_rx: Receiver<Vec<u8>>,
}

/// A live migration on the source, one method per phase:
/// - [`SourceSession::handshake`]: connect, send the header, `Accepted`, `Ready`;
/// - [`SourceSession::precopy`]: round 0 and the live rounds while the VM runs, until the
///   planner stops them;
/// - [`SourceSession::stop_and_copy`]: pause, the last harvest, the final round;
/// - [`SourceSession::commit`]: the VM's state and `Complete`, then the destination's `Resumed`.
///
/// `local` shares memory instead of sending it ([`SourceSession::share_memory`]): no rounds.
/// What the phases measure accumulates here and becomes the [`Report`].
struct SourceSession<'a> {
    src: &'a dyn SourceVm,
    to: &'a Address,
    opts: &'a MigrateOptions,
    events: &'a mut dyn FnMut(Event),
    /// Set once the VM is paused, so that `migrate` resumes it if the migration fails.
    paused: &'a AtomicBool,
    plan: Plan,
    desc: VmDescription,
    /// The progress deadline.
    deadline: Duration,
    t_start: Instant,
    /// CPU time of the migration's threads (µs), and this thread's when it started (ms).
    cpu: Arc<AtomicU64>,
    cpu0: f64,
    rounds: Vec<RoundReport>,
    stop_reason: String,
    /// Pages sent in the rounds so far, and of them those found zero (counted by the senders).
    sent_total: u64,
    zero: Arc<AtomicU64>,
    /// `zero` when the last round ended.
    zero_seen: u64,
    bytes: u64,
    /// Zero-copy sends completed, and those the kernel copied anyway.
    zc: (u64, u64),
    round0_samples: Vec<(f64, u64)>,
    stop: StopPhaseTimes,
    phases: PhaseTimes,
    max_throttle: u8,
    /// The planner's downtime estimate when it stopped pre-copy.
    estimated_downtime: Option<Duration>,
    /// Its latest estimate, ms: progress events carry it.
    estimate_ms: Option<f64>,
    /// The planner, once its rounds are over: it learns the stop phase's cost.
    learned: Option<Planner>,
}

impl<'a> SourceSession<'a> {
    /// Setup: the engine's plan and the stream's description; nothing is contacted yet.
    fn new(
        src: &'a dyn SourceVm,
        to: &'a Address,
        opts: &'a MigrateOptions,
        events: &'a mut dyn FnMut(Event),
        paused: &'a AtomicBool,
    ) -> Result<Self, MigrateError> {
        let (t_start, cpu0) = (Instant::now(), thread_cpu_ms());
        let plan = Plan::new(opts)?;
        if opts.tls.is_some() && matches!(to, Address::Unix(_)) {
            return Err(MigrateError::Other(crate::transport::TLS_UNIX.into()));
        }
        let mut desc = src.description();
        if plan.shared_memory && desc.private_memory {
            return Err(MigrateError::Other(PRIVATE_LOCAL.into()));
        }
        desc.connections = plan.connections as u32;
        desc.shared_memory = plan.shared_memory;
        Ok(SourceSession {
            src,
            to,
            opts,
            events,
            paused,
            plan,
            desc,
            deadline: opts.progress_timeout,
            t_start,
            cpu: Arc::new(AtomicU64::new(0)),
            cpu0,
            rounds: Vec::new(),
            stop_reason: String::from("local: memory shared, no pre-copy"),
            sent_total: 0,
            zero: Arc::default(),
            zero_seen: 0,
            bytes: 0,
            zc: (0, 0),
            round0_samples: Vec::new(),
            stop: StopPhaseTimes::default(),
            phases: PhaseTimes::default(),
            max_throttle: 0,
            estimated_downtime: None,
            estimate_ms: None,
            learned: None,
        })
    }

    fn connect(&self) -> Result<Conn, MigrateError> {
        let to = self.to;
        let c = Conn::connect_with(to, Duration::from_secs(10), self.opts.tls.as_ref())
            .map_err(|e| MigrateError::Connect { addr: to.to_string(), source: e })?;
        c.set_write_timeout(Some(self.deadline))?;
        Ok(c)
    }

    /// Handshake: the header on the first connection, the destination's `Accepted`, the memory
    /// file (local), the header on every other connection. The destination then builds the
    /// VM and answers `Ready` ([`Self::wait_ready`]): the source sets up meanwhile. Returns the
    /// reply channel and the connections.
    fn handshake(&mut self) -> Result<(Replies, Vec<Conn>), MigrateError> {
        self.phases.setup_ms = ms_since(self.t_start);
        let t = Instant::now();
        let mut conn0 = self.connect()?;
        self.phases.connect_ms = ms_since(t);
        let t = Instant::now();
        if self.plan.shared_memory && !conn0.is_unix() {
            return Err(MigrateError::Other(
                "the local engine passes guest memory over a unix socket: use --to unix:PATH".into(),
            ));
        }
        format::write_header(&mut conn0, &self.desc).map_err(|e| match e {
            format::Error::Io(io) => send_err(io, self.opts.handshake_timeout),
            e => e.into(),
        })?;
        let mut replies = Replies(ReplyReader::new(conn0.try_clone()?));
        self.accepted(&mut replies)?;
        self.phases.accepted_ms = ms_since(t);
        if self.plan.shared_memory {
            conn0.send_fd(self.src.memfd())?;
        }
        let t = Instant::now();
        let mut conns = vec![conn0];
        for _ in 1..self.plan.connections {
            let mut c = self.connect()?;
            format::write_header(&mut c, &self.desc)?;
            conns.push(c);
        }
        self.phases.more_connections_ms = ms_since(t);
        Ok((replies, conns))
    }

    /// The destination's `Ready`: it has built the VM and takes records.
    fn wait_ready(&mut self, replies: &mut Replies) -> Result<(), MigrateError> {
        let t = Instant::now();
        let ready = replies.wait(self.deadline);
        self.phases.ready_ms = ms_since(t);
        match ready? {
            Reply::Ready => Ok(()),
            Reply::Failed(why) => Err(MigrateError::Refused(why)),
            other => Err(MigrateError::Other(format!("expected Ready from the destination, got {other:?}"))),
        }
    }

    /// A kumo destination answers a valid header at once; anything else (no answer, bytes that
    /// are not a reply) is not a kumo destination. A TLS destination answers a plain header
    /// with a TLS alert: say what may be missing.
    fn accepted(&self, replies: &mut Replies) -> Result<(), MigrateError> {
        let to = self.to;
        let hint = match (to, &self.opts.tls) {
            (Address::Tcp(_), None) => "; if it listens with a TLS directory, give one here too",
            _ => "",
        };
        let not_kumo = |why: String| MigrateError::NotKumo { addr: to.to_string(), why: format!("{why}{hint}") };
        match replies.wait(self.opts.handshake_timeout) {
            Err(e) if tls_failure(to, &e).is_some() => Err(tls_failure(to, &e).unwrap_or(e)),
            Ok(Reply::Accepted) => Ok(()),
            Ok(Reply::Failed(why)) => Err(MigrateError::Refused(why)),
            Ok(other) => Err(not_kumo(format!("it answered {other:?} to the stream header"))),
            Err(MigrateError::ReplyTimeout(t)) => {
                Err(not_kumo(format!("no answer to the stream header within {} s", t.as_secs_f64())))
            }
            Err(MigrateError::Stream(e)) => Err(not_kumo(e.to_string())),
            Err(e) => Err(e),
        }
    }

    /// `local`, instead of the rounds: guest memory went with the handshake, so the VM pauses
    /// at once. Returns the connection for the closing records and when the VM was paused.
    fn share_memory(&mut self, mut conns: Vec<Conn>) -> Result<(Vec<Closing>, Instant), MigrateError> {
        let total_pages = self.desc.total_pages();
        (self.events)(Event::Started { engine: self.opts.engine, connections: 1, total_pages, touched_pages: 0 });
        self.src.pause().map_err(MigrateError::Source)?;
        self.paused.store(true, Ordering::Release);
        let pause_at = Instant::now();
        let conn = conns.pop().ok_or_else(|| MigrateError::Other("no connection to the destination".into()))?;
        Ok((vec![(Box::new(CopySink(conn, self.deadline)), Encoder::new(), 0)], pause_at))
    }

    /// The engines' phases between handshake and commit: dirty logging on, the pipeline up
    /// (while the destination builds the VM), its `Ready`, [`Self::precopy`], [`Self::stop_and_copy`], the pipeline down. Returns each connection
    /// for the closing records and when the VM was paused.
    fn transfer(&mut self, conns: Vec<Conn>, replies: &mut Replies) -> Result<(Vec<Closing>, Instant), MigrateError> {
        let (src, opts) = (self.src, self.opts);
        let t = Instant::now();
        src.start_dirty_log().map_err(MigrateError::Source)?;
        self.phases.dirty_log_start_ms = ms_since(t);
        let t = Instant::now();
        let touched = src.first_round_pages().map_err(MigrateError::Source)?;
        self.phases.touched_ms = ms_since(t);
        let total_pages = self.desc.total_pages();
        (self.events)(Event::Started {
            engine: opts.engine,
            connections: self.plan.connections,
            total_pages,
            touched_pages: touched.count(),
        });
        let t = Instant::now();
        let Pipeline { senders, watch, free_rx } = self.start_pipeline(conns)?;
        self.phases.pipeline_start_ms = ms_since(t);
        if let Err(e) = self.wait_ready(replies) {
            // The senders have nothing queued: they end as their queues close.
            let e = self.join_senders(senders, Err(e)).err();
            return Err(e.unwrap_or_else(|| MigrateError::Other("the destination sent no Ready".into())));
        }
        // Bursts of one batch: the cap holds over any stretch longer than a batch takes.
        let cap = opts
            .max_bandwidth
            .map(|rate| TokenBucket::new(rate, (MAX_BATCH_PAGES * PAGE) as u64, SystemClock::default()));
        let mut col = Collector {
            mem: src.memory(),
            copy: self.plan.copy,
            lockstep: self.plan.lockstep.then_some((replies, self.deadline)),
            free_rx,
            senders: &senders,
            next: 0,
            spare: None,
            cancel: &opts.cancel,
            zero_test: (cap.is_some() && !self.plan.copy).then(|| SendMem::new(src.memory())),
            cap,
            rearm: Some(src),
            rearm_time: Duration::ZERO,
            cap_wait: Duration::ZERO,
        };
        let mut planner = Planner::new(opts.policy, total_pages);
        let result = self.precopy(&mut col, &watch, &mut planner, touched);
        // Downtime counts from the pause request: vCPUs stop as they are kicked.
        let pause_at = Instant::now();
        let result = result.and_then(|(dirty, round)| self.stop_and_copy(&mut col, dirty, round, pause_at));
        self.phases.rearm_ms = col.rearm_time.as_secs_f64() * 1e3;
        self.phases.cap_wait_ms = col.cap_wait.as_secs_f64() * 1e3;
        drop(col);
        let closing = self.join_senders(senders, result)?;
        let stop_zero = self.take_zero();
        if let Some(last) = self.rounds.last_mut() {
            last.zero_pages = stop_zero;
        }
        self.stop.pages_ms = ms_since(pause_at) - self.stop.pause_ms - self.stop.harvest_ms;
        self.bytes = (self.sent_total - self.zero_seen) * PAGE as u64;
        self.learned = Some(planner);
        Ok((closing, pause_at))
    }

    /// Setup of the engine's pipeline: a sender thread per connection on the engine's sink
    /// (copying, or zero-copy from guest memory), and the pool of buffers they give back.
    fn start_pipeline(&self, conns: Vec<Conn>) -> Result<Pipeline, MigrateError> {
        let deadline = self.deadline;
        let send_mem = if self.plan.copy { None } else { Some(SendMem::new(self.src.memory())) };
        let sink = |conn: Conn| -> Box<dyn BatchSink> {
            match &send_mem {
                Some(mem) => {
                    let zc = ZeroCopy::new(&conn);
                    Box::new(ZeroCopySink { conn, mem: mem.clone(), zc, deadline })
                }
                None => Box::new(CopySink(conn, deadline)),
            }
        };
        // Serial: one batch in flight, each acknowledged (Placed) before the next; overlap and
        // zerocopy: a few batches queued per sender.
        let (serial, depth) = (self.plan.lockstep, self.plan.depth);
        let (free_tx, free_rx) = sync_channel::<Vec<u8>>(conns.len() * (depth + 2));
        let shared = Shared { cpu: self.cpu.clone(), zero: (!serial).then(|| self.zero.clone()) };
        let watch: Vec<Conn> = conns.iter().map(Conn::try_clone).collect::<io::Result<_>>()?;
        let senders: Vec<Sender> = conns
            .into_iter()
            .map(|c| spawn_sender(sink(c), serial, free_tx.clone(), shared.clone(), depth))
            .collect::<io::Result<_>>()?;
        // Only the senders may hold the pool's sending side: when they all stop, a collector
        // waiting for a buffer must see the channel close instead of waiting forever.
        drop(free_tx);
        Ok(Pipeline { senders, watch, free_rx })
    }

    /// Pre-copy: round 0 sends every page the guest ever touched, each later round the pages
    /// dirtied during the one before, while the VM runs, until the planner stops. Returns the
    /// pages dirty since the last round and the final round's number.
    fn precopy(
        &mut self,
        col: &mut Collector<'_>,
        watch: &[Conn],
        planner: &mut Planner,
        touched: PageBitmap,
    ) -> Result<(PageBitmap, u32), MigrateError> {
        let mut to_send = touched;
        let mut round = 0u32;
        loop {
            if self.opts.cancel.is_cancelled() {
                return Err(MigrateError::Cancelled);
            }
            let t = Instant::now();
            let n = self.send_live_round(col, round, &to_send, t)?;
            let send = t.elapsed();
            // The round ends when its pages are on the wire and delivered, not when they are
            // queued: the bandwidth the planner estimates downtime from is the real one, and
            // nothing of this round is left to send during the downtime.
            drain_pipeline(col.senders, watch, self.deadline, &self.opts.cancel)?;
            let mut dirty = PageBitmap::for_regions(&self.desc.regions);
            let th = Instant::now();
            let d = self.src.harvest_dirty(&mut dirty).map_err(MigrateError::Source)?;
            let times = RoundTimes { total: t.elapsed(), send, harvest: th.elapsed() };
            let tp = Instant::now();
            let decision = self.end_round(planner, round, n, times, d);
            self.phases.plan_ms += ms_since(tp);
            to_send = dirty;
            round += 1;
            match decision {
                Decision::Continue => {}
                Decision::NotConverging { estimated, throttle_percent } => (self.events)(Event::NotConverging {
                    round: round - 1,
                    estimated_downtime_ms: estimated.as_secs_f64() * 1e3,
                    target_ms: self.opts.policy.downtime.map(|t| t.as_secs_f64() * 1e3),
                    throttle_percent,
                }),
                Decision::StopAndCopy(reason) => {
                    self.stop_reason = planner.describe_stop(&reason);
                    self.estimated_downtime = planner.last_estimate();
                    return Ok((to_send, round));
                }
                Decision::GiveUp(why) => return Err(MigrateError::GaveUp(why.to_string())),
            }
        }
    }

    /// Sends the pages of live round `round` (started at `t`). Round 0 also samples D(t)
    /// while it runs: its length spans the workload's curve, unlike the short later rounds.
    fn send_live_round(
        &mut self,
        col: &mut Collector<'_>,
        round: u32,
        to_send: &PageBitmap,
        t: Instant,
    ) -> Result<u64, MigrateError> {
        let (round_pages, checksum, src) = (to_send.count(), self.plan.live_checksum, self.src);
        let (before, estimate_ms, events) = (self.sent_total, self.estimate_ms, &mut *self.events);
        let mut progress = |p: RoundProgress| events(progress_event(p, before, estimate_ms));
        if round > 0 {
            return col.send_round(round, to_send.gfns(), round_pages, checksum, &mut progress);
        }
        // The sampler waits on a channel that closes when the round is handed out, so a short
        // round 0 does not wait out the sampler's 50 ms (it did: up to 50 ms of every migration).
        let (done, ended) = std::sync::mpsc::channel::<()>();
        let (n, samples) = std::thread::scope(|s| {
            let sampler = kumo_sandbox::spawn_scoped(s, ThreadKind::Migration, "mig-sampler", move || {
                let mut v = Vec::new();
                while ended.recv_timeout(Duration::from_millis(50)) == Err(RecvTimeoutError::Timeout) {
                    match src.peek_dirty_count() {
                        Some(c) => v.push((t.elapsed().as_secs_f64(), c)),
                        None => break,
                    }
                }
                v
            });
            let n = col.send_round(round, to_send.gfns(), round_pages, checksum, &mut progress);
            drop(done);
            // Without its thread (none could be started) there are no samples: the model
            // falls back as it does for a short round 0.
            (n, sampler.ok().and_then(|h| h.join().ok()).unwrap_or_default())
        });
        self.round0_samples = samples;
        n
    }

    /// Ends a live round of `n` pages (its `times`; the dirty log found `d` pages): counts
    /// it, asks the planner, throttles the vCPUs as it says and reports the round.
    fn end_round(&mut self, planner: &mut Planner, round: u32, n: u64, times: RoundTimes, d: u64) -> Decision {
        let RoundTimes { total: dur, send, harvest } = times;
        self.sent_total += n;
        let zero = self.take_zero();
        // The link's rate and the Xen rule's sent pages count page data: zero pages cost the
        // wire a few bytes each, and the pages left to send are the guest's writes.
        let data = n - zero;
        let st = RoundStats { round, pages_sent: data, bytes_sent: data * PAGE as u64, duration: dur, dirty_pages: d };
        let decision = planner.after_round_with(&st, &RoundExtras { harvest: Some(harvest), rtt: None });
        // A throttle stays in force until the planner changes it (it never lowers it within a
        // migration); it ends with the migration.
        let throttle = planner.throttle_percent();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let drain = dur.saturating_sub(send + harvest);
        self.rounds.push(RoundReport {
            round,
            pages: n,
            ms: ms(dur),
            dirty_after: d,
            send_ms: ms(send),
            drain_ms: ms(drain),
            harvest_ms: ms(harvest),
            throttle_percent: throttle,
            zero_pages: zero,
        });
        let p = &mut self.phases;
        (p.send_ms, p.drain_ms, p.harvest_ms) =
            (p.send_ms + ms(send), p.drain_ms + ms(drain), p.harvest_ms + ms(harvest));
        self.src.set_throttle(throttle.into());
        self.max_throttle = self.max_throttle.max(throttle);
        self.estimate_ms = planner.estimated_downtime(d).map(|x| x.as_secs_f64() * 1e3);
        (self.events)(Event::Round {
            round,
            pages_sent: n,
            ms: dur.as_secs_f64() * 1e3,
            dirty_pages: d,
            mb_per_s: planner.bandwidth().unwrap_or(0.0) / 1e6,
            estimated_downtime_ms: self.estimate_ms,
            throttle_percent: throttle,
        });
        decision
    }

    /// Stop-and-copy: pauses the VM (asked at `pause_at`), harvests the dirty log one last time
    /// and sends those pages, fully checksummed, as round `round`.
    fn stop_and_copy(
        &mut self,
        col: &mut Collector<'_>,
        mut to_send: PageBitmap,
        round: u32,
        pause_at: Instant,
    ) -> Result<(), MigrateError> {
        let paused = self.src.pause().map_err(MigrateError::Source);
        if paused.is_ok() {
            self.paused.store(true, Ordering::Release);
        }
        self.stop.pause_ms = ms_since(pause_at);
        paused?;
        let t = Instant::now();
        // Paused: nothing to re-arm.
        col.rearm = None;
        self.src.harvest_dirty(&mut to_send).map_err(MigrateError::Source)?;
        self.stop.harvest_ms = ms_since(t);
        self.stop.pages = to_send.count();
        (self.events)(Event::StopAndCopy { reason: self.stop_reason.clone(), pages: to_send.count() });
        let t = Instant::now();
        let (before, estimate_ms, events) = (self.sent_total, self.estimate_ms, &mut *self.events);
        let mut progress = |p: RoundProgress| events(progress_event(p, before, estimate_ms));
        let n = col.send_round(round, to_send.gfns(), self.stop.pages, Checksum::Full, &mut progress)?;
        self.sent_total += n;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.rounds.push(RoundReport { round, pages: n, ms, send_ms: ms, dirty_after: 0, ..Default::default() });
        Ok(())
    }

    /// Zero pages the senders found since the last call. Exact at a round's end: the round's
    /// batches have all been through the senders then (the pipeline drained, or joined).
    fn take_zero(&mut self) -> u64 {
        let now = self.zero.load(Ordering::Relaxed);
        let new = now - self.zero_seen;
        self.zero_seen = now;
        new
    }

    /// Teardown of the pipeline: closes the queues and collects every sender, also after a
    /// failure, so no thread is left. A sender's own error (the connection broke) explains a
    /// failure better than the collector's "sender stopped", so it goes first; on a failure
    /// every connection gets `Abort`.
    fn join_senders(
        &mut self,
        senders: Vec<Sender>,
        result: Result<(), MigrateError>,
    ) -> Result<Vec<Closing>, MigrateError> {
        let mut closing = Vec::new();
        let mut first_err = None;
        for mut s in senders {
            match s.finish() {
                Some(Ok(Ok((c, e, zs)))) => {
                    self.zc.0 += zs.zc_completions;
                    self.zc.1 += zs.zc_copied;
                    closing.push((c, e, zs.pages));
                }
                Some(Ok(Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Some(Err(_)) | None => {
                    first_err.get_or_insert(MigrateError::Other("sender thread panicked".into()));
                }
            }
        }
        if let Err(e) = result {
            first_err.get_or_insert(e);
        }
        match first_err {
            Some(e) => {
                abort_all(&mut closing, &e.to_string());
                Err(e)
            }
            None => Ok(closing),
        }
    }

    /// Commit, the point of no return: after the state goes out the destination may run the
    /// VM, so a cancel that comes later is refused; one that came first backs out here. Sends
    /// the state on the first connection and `Complete` (with the pages each connection
    /// carried, which its receiver checks) on all, then waits for `Resumed`. Returns the
    /// downtime.
    fn commit(
        &mut self,
        closing: &mut [Closing],
        replies: &mut Replies,
        pause_at: Instant,
    ) -> Result<Duration, MigrateError> {
        if !self.opts.cancel.commit() {
            abort_all(closing, &MigrateError::Cancelled.to_string());
            return Err(MigrateError::Cancelled);
        }
        let t_state = Instant::now();
        let state = self.src.save_state().map_err(MigrateError::Source)?;
        let mut out = Vec::new();
        for (i, (c, enc, pages)) in closing.iter_mut().enumerate() {
            out.clear();
            if i == 0 {
                enc.state(&mut out, &state)?;
            }
            enc.complete(&mut out, *pages);
            c.send_records(&out)?;
        }
        self.bytes += state.len() as u64;
        self.stop.state_bytes = state.len() as u64;
        self.stop.state_ms = ms_since(t_state);
        // Committed: the destination has everything it needs to run the VM. From here on only
        // its explicit Failed gives the VM back to the source.
        let t_reply = Instant::now();
        let reply = replies.wait(self.deadline);
        self.stop.reply_ms = ms_since(t_reply);
        let downtime = pause_at.elapsed();
        match reply {
            Ok(Reply::Resumed) => {}
            Ok(Reply::Failed(why)) => return Err(MigrateError::Dest(why)),
            Ok(other) => return Err(MigrateError::Unconfirmed(format!("it answered {other:?} instead of Resumed"))),
            Err(e) => return Err(MigrateError::Unconfirmed(e.to_string())),
        }
        // Dirty logging stays on: this copy of the VM is over (its VMM stops it), and turning
        // the log off slot by slot took 5–9 ms here.
        add_cpu(&self.cpu, self.cpu0);
        Ok(downtime)
    }

    /// The finished migration's report; the planner learns this stop phase's cost for the
    /// next migration's estimates.
    fn report(mut self, downtime: Duration) -> Report {
        let stop = &self.stop;
        let stop_phase_model = match self.learned.as_mut() {
            Some(p) => {
                p.observe_stop_phase(&StopPhaseSample {
                    pages: stop.pages,
                    state_bytes: stop.state_bytes,
                    measured_downtime: downtime,
                    harvest: Some(Duration::from_secs_f64(stop.harvest_ms / 1e3)),
                });
                p.stop_phase_model()
            }
            None => self.opts.policy.stop_phase,
        };
        let total = self.t_start.elapsed();
        self.phases.stop_ms = downtime.as_secs_f64() * 1e3;
        (self.events)(Event::Completed {
            total_ms: total.as_secs_f64() * 1e3,
            downtime_ms: downtime.as_secs_f64() * 1e3,
        });
        Report {
            engine: self.opts.engine,
            connections: self.plan.connections,
            total_ms: total.as_secs_f64() * 1e3,
            downtime_ms: downtime.as_secs_f64() * 1e3,
            rounds: self.rounds,
            stop_reason: self.stop_reason,
            total_pages: self.sent_total,
            zero_pages: self.zero_seen,
            bytes: self.bytes,
            mb_per_s: self.bytes as f64 / total.as_secs_f64() / 1e6,
            sender_cpu_ms: self.cpu.load(Ordering::Relaxed) as f64 / 1e3,
            zerocopy_completions: self.zc.0,
            zerocopy_copied: self.zc.1,
            round0_dirty_samples: self.round0_samples,
            stop_phase: self.stop,
            phases: self.phases,
            estimated_downtime_ms: self.estimated_downtime.map(|d| d.as_secs_f64() * 1e3),
            max_throttle_percent: self.max_throttle,
            stop_phase_model,
        }
    }
}

/// How long a live round took, and two of its parts (the rest is the wire draining).
#[derive(Clone, Copy)]
struct RoundTimes {
    total: Duration,
    send: Duration,
    harvest: Duration,
}

/// A progress event for a round, `before` pages having been sent in the rounds before it.
fn progress_event(p: RoundProgress, before: u64, estimate_ms: Option<f64>) -> Event {
    let secs = p.elapsed.as_secs_f64();
    let rate = if secs > 0.0 { p.pages_sent as f64 / secs } else { 0.0 };
    Event::Progress {
        round: p.round,
        round_pages: p.round_pages,
        pages_sent: p.pages_sent,
        bytes_sent: p.pages_sent * PAGE as u64,
        total_pages_sent: before + p.pages_sent,
        total_bytes_sent: (before + p.pages_sent) * PAGE as u64,
        mb_per_s: rate * PAGE as f64 / 1e6,
        eta_ms: (rate > 0.0).then(|| p.round_pages.saturating_sub(p.pages_sent) as f64 / rate * 1e3),
        estimated_downtime_ms: estimate_ms,
    }
}

/// Waits until every sender has written what it was given and the kernel has delivered it:
/// the sockets' send queues are empty.
fn drain_pipeline(
    senders: &[Sender],
    conns: &[Conn],
    deadline: Duration,
    cancel: &CancelToken,
) -> Result<(), MigrateError> {
    let stopped = || MigrateError::Other("sender thread stopped".into());
    let mut acks = Vec::with_capacity(senders.len());
    for s in senders {
        let (tx, rx) = sync_channel(1);
        s.send(Work::Flush(tx))?;
        acks.push(rx);
    }
    for rx in acks {
        rx.recv().map_err(|_| stopped())?;
    }
    let t = Instant::now();
    for c in conns {
        while c.unsent_bytes()? > 0 {
            if cancel.is_cancelled() {
                return Err(MigrateError::Cancelled);
            }
            if t.elapsed() > deadline {
                return Err(MigrateError::NoProgress { what: "the destination took no data", after: deadline });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}

/// Sleeps for `d`, waking every 50 ms to check for a cancel.
fn sleep_unless_cancelled(d: Duration, cancel: &CancelToken) -> Result<(), MigrateError> {
    let end = Instant::now() + d;
    loop {
        if cancel.is_cancelled() {
            return Err(MigrateError::Cancelled);
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}
