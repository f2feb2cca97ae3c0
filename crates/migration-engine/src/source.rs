//! The source side of a live migration: the pre-copy loop, the collector that splits rounds
//! into batches (the bandwidth cap and cancel checks sit there), the sender threads and the
//! transport sinks they write through.

use kumo_sandbox::ThreadKind;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kumo_migration::PageBitmap;
use kumo_vm::GuestMemory;
use vm_memory::{Bytes, GuestAddress};

use crate::control::{CancelToken, SystemClock, TokenBucket};
use crate::transport::{Address, Conn, ZeroCopy};
use kumo_migration::format::{self, BatchFrame, Checksum, Encoder, Reply, ReplyReader, MAX_BATCH_PAGES};
use kumo_migration::planner::{Decision, Planner, RoundExtras, RoundStats};
use kumo_migration::StopPhaseSample;

use crate::session::*;

/// One batch handed between pipeline stages: its gfns and (for copying engines) their data.
struct Batch {
    round: u32,
    gfns: Vec<u64>,
    data: Vec<u8>,
    checksum: Checksum,
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

    fn drain(&mut self) -> Result<(u64, u64), MigrateError> {
        self.zc.reap(self.conn.as_raw_fd(), false)?;
        Ok((self.zc.completions, self.zc.copied))
    }
}

#[derive(Default)]
struct SenderStats {
    /// Pages this connection carried in all rounds (its Complete record says so).
    pages: u64,
    zc_completions: u64,
    zc_copied: u64,
}

/// `ack`: ask for a `Placed` notice after every batch (the serial engine waits for it).
fn spawn_sender(
    sink: Box<dyn BatchSink>,
    ack: bool,
    free: SyncSender<Vec<u8>>,
    cpu: Arc<AtomicU64>,
    depth: usize,
) -> io::Result<Sender> {
    let (tx, rx) = sync_channel::<Work>(depth);
    let handle = kumo_sandbox::spawn(ThreadKind::Migration, "mig-send", move || {
        let t0 = thread_cpu_ms();
        // A sender holds only its connection and buffers: its panic fails the migration (the
        // job gives the VM back) instead of stopping the VM.
        let r = kumo_sandbox::contain(ThreadKind::Migration, "mig-send", || sender_loop(sink, ack, rx, free))
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
}

fn sender_loop(mut sink: Box<dyn BatchSink>, ack: bool, rx: Receiver<Work>, free: SyncSender<Vec<u8>>) -> SenderEnd {
    let mut enc = Encoder::new();
    let mut out = Vec::with_capacity(64);
    let mut round_pages = 0u64;
    let mut stats = SenderStats::default();
    for work in rx {
        match work {
            Work::Batch(b) => {
                round_pages += b.gfns.len() as u64;
                let frame = enc.batch_frame(b.round, &b.gfns, b.checksum, ack)?;
                sink.send_batch(frame, &b)?;
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
    /// The bandwidth cap, if any.
    bucket: Option<TokenBucket<SystemClock>>,
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
        if let Some(b) = &mut self.bucket {
            let wait = b.take((gfns.len() * PAGE) as u64);
            sleep_unless_cancelled(wait, self.cancel)?;
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
        let s = &self.senders[self.next % self.senders.len()];
        self.next += 1;
        s.send(Work::Batch(Batch { round, gfns, data, checksum }))?;
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

fn migrate_inner(
    src: &dyn SourceVm,
    to: &Address,
    opts: &MigrateOptions,
    events: &mut dyn FnMut(Event),
    paused: &AtomicBool,
) -> Result<Report, MigrateError> {
    let t_start = Instant::now();
    let cpu = Arc::new(AtomicU64::new(0));
    let cpu0 = thread_cpu_ms();
    let plan = Plan::new(opts)?;
    if opts.tls.is_some() && matches!(to, Address::Unix(_)) {
        return Err(MigrateError::Other(crate::transport::TLS_UNIX.into()));
    }
    let (local, nconn) = (plan.shared_memory, plan.connections);
    let mut desc = src.description();
    desc.connections = nconn as u32;
    desc.shared_memory = local;
    let deadline = opts.progress_timeout;

    let connect = || -> Result<Conn, MigrateError> {
        let c = Conn::connect_with(to, Duration::from_secs(10), opts.tls.as_ref())
            .map_err(|e| MigrateError::Connect { addr: to.to_string(), source: e })?;
        c.set_write_timeout(Some(deadline))?;
        Ok(c)
    };
    let mut conn0 = connect()?;
    if local && !conn0.is_unix() {
        return Err(MigrateError::Other(
            "the local engine passes guest memory over a unix socket: use --to unix:PATH".into(),
        ));
    }
    format::write_header(&mut conn0, &desc).map_err(|e| match e {
        format::Error::Io(io) => send_err(io, opts.handshake_timeout),
        e => e.into(),
    })?;
    let mut replies = Replies(ReplyReader::new(conn0.try_clone()?));
    // The handshake: a kumo destination answers a valid header at once; anything else (no
    // answer, bytes that are not a reply) is not a kumo destination.
    // A TLS destination answers a plain header with a TLS alert: say what may be missing.
    let hint = match (to, &opts.tls) {
        (Address::Tcp(_), None) => "; if it listens with a TLS directory, give one here too",
        _ => "",
    };
    let not_kumo = |why: String| MigrateError::NotKumo { addr: to.to_string(), why: format!("{why}{hint}") };
    match replies.wait(opts.handshake_timeout) {
        Err(e) if tls_failure(to, &e).is_some() => return Err(tls_failure(to, &e).unwrap_or(e)),
        Ok(Reply::Accepted) => {}
        Ok(Reply::Failed(why)) => return Err(MigrateError::Refused(why)),
        Ok(other) => return Err(not_kumo(format!("it answered {other:?} to the stream header"))),
        Err(MigrateError::ReplyTimeout(t)) => {
            return Err(not_kumo(format!("no answer to the stream header within {} s", t.as_secs_f64())))
        }
        Err(MigrateError::Stream(e)) => return Err(not_kumo(e.to_string())),
        Err(e) => return Err(e),
    }
    if local {
        conn0.send_fd(src.memfd())?;
    }
    let mut conns = vec![conn0];
    for _ in 1..nconn {
        let mut c = connect()?;
        format::write_header(&mut c, &desc)?;
        conns.push(c);
    }
    match replies.wait(deadline)? {
        Reply::Ready => {}
        Reply::Failed(why) => return Err(MigrateError::Refused(why)),
        other => return Err(MigrateError::Other(format!("expected Ready from the destination, got {other:?}"))),
    }
    let total_pages = desc.total_pages();
    let mem = src.memory();
    let regions: Vec<(u64, u64)> = desc.regions.clone();

    let mut rounds = Vec::new();
    let mut stop_reason = String::from("local: memory shared, no pre-copy");
    let mut bytes = 0u64;
    let mut sent_total = 0u64;
    let mut stats_zc = (0, 0);
    let pause_at;
    let mut encs: Vec<(Box<dyn BatchSink>, Encoder, u64)> = Vec::new();
    let mut round0_samples = Vec::new();
    let mut stop = StopPhaseTimes::default();
    let mut max_throttle = 0u8;
    let mut estimated_downtime = None;
    let mut learned: Option<Planner> = None;

    if local {
        events(Event::Started { engine: opts.engine, connections: 1, total_pages, touched_pages: 0 });
        src.pause().map_err(MigrateError::Source)?;
        paused.store(true, Ordering::Release);
        pause_at = Instant::now();
        let conn = conns.pop().ok_or_else(|| MigrateError::Other("no connection to the destination".into()))?;
        encs.push((Box::new(CopySink(conn, deadline)), Encoder::new(), 0));
    } else {
        src.start_dirty_log().map_err(MigrateError::Source)?;
        let touched = src.touched_pages().map_err(MigrateError::Source)?;
        events(Event::Started { engine: opts.engine, connections: nconn, total_pages, touched_pages: touched.count() });

        let copy = plan.copy;
        let send_mem = if copy { None } else { Some(SendMem::new(mem)) };
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
        let (serial, depth) = (plan.lockstep, plan.depth);
        let (free_tx, free_rx) = sync_channel::<Vec<u8>>(nconn * (depth + 2));
        // The session keeps a handle on each socket to watch its send queue drain.
        let watch: Vec<Conn> = conns.iter().map(Conn::try_clone).collect::<io::Result<_>>()?;
        let senders: Vec<Sender> = conns
            .drain(..)
            .map(|c| spawn_sender(sink(c), serial, free_tx.clone(), cpu.clone(), depth))
            .collect::<io::Result<_>>()?;
        // Only the senders may hold the pool's sending side: when they all stop, a collector
        // waiting for a buffer must see the channel close instead of waiting forever.
        drop(free_tx);
        let lockstep = serial.then_some((&mut replies, deadline));
        // Bursts of one batch: the cap holds over any stretch longer than a batch takes.
        let bucket = opts
            .max_bandwidth
            .map(|rate| TokenBucket::new(rate, (MAX_BATCH_PAGES * PAGE) as u64, SystemClock::default()));
        let cancel = &opts.cancel;
        let mut col =
            Collector { mem, copy, lockstep, free_rx, senders: &senders, next: 0, spare: None, cancel, bucket };
        let mut planner = Planner::new(opts.policy, total_pages);
        // Pages sent in rounds before the current one, and the latest downtime estimate: what
        // progress events add to a round's own count.
        let mut before = 0u64;
        let mut estimate_ms: Option<f64> = None;
        let progress_event = |p: RoundProgress, before: u64, estimate_ms: Option<f64>| {
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
        };
        let live_checksum = plan.live_checksum;

        let mut to_send = touched;
        let mut round = 0u32;
        let result = (|| -> Result<(), MigrateError> {
            loop {
                if cancel.is_cancelled() {
                    return Err(MigrateError::Cancelled);
                }
                let t = Instant::now();
                let round_pages = to_send.count();
                let mut progress = |p: RoundProgress| events(progress_event(p, before, estimate_ms));
                let n = if round == 0 {
                    // Sample D(t) while round 0 runs: its length spans the workload's curve,
                    // unlike the short later rounds.
                    let done = AtomicBool::new(false);
                    std::thread::scope(|s| {
                        let sampler = kumo_sandbox::spawn_scoped(s, ThreadKind::Migration, "mig-sampler", || {
                            let mut v = Vec::new();
                            while !done.load(Ordering::Acquire) {
                                std::thread::sleep(Duration::from_millis(50));
                                match src.peek_dirty_count() {
                                    Some(c) => v.push((t.elapsed().as_secs_f64(), c)),
                                    None => break,
                                }
                            }
                            v
                        });
                        let n = col.send_round(round, to_send.gfns(), round_pages, live_checksum, &mut progress);
                        done.store(true, Ordering::Release);
                        // Without its thread (none could be started) there are no samples: the model
                        // falls back as it does for a short round 0.
                        round0_samples = sampler.ok().and_then(|h| h.join().ok()).unwrap_or_default();
                        n
                    })?
                } else {
                    col.send_round(round, to_send.gfns(), round_pages, live_checksum, &mut progress)?
                };
                // The round ends when its pages are on the wire and delivered, not when they
                // are queued: the bandwidth the planner estimates downtime from is the real one,
                // and nothing of this round is left to send during the downtime.
                drain_pipeline(&senders, &watch, deadline, cancel)?;
                let mut dirty = PageBitmap::for_regions(&regions);
                let th = Instant::now();
                let d = src.fetch_dirty(&mut dirty).map_err(MigrateError::Source)?;
                let harvest = th.elapsed();
                let dur = t.elapsed();
                sent_total += n;
                before = sent_total;
                let st =
                    RoundStats { round, pages_sent: n, bytes_sent: n * PAGE as u64, duration: dur, dirty_pages: d };
                let decision = planner.after_round_with(&st, &RoundExtras { harvest: Some(harvest), rtt: None });
                rounds.push(RoundReport { round, pages: n, ms: dur.as_secs_f64() * 1e3, dirty_after: d });
                // A throttle stays in force until the planner changes it (it never lowers it
                // within a migration); it ends with the migration.
                let throttle = planner.throttle_percent();
                src.set_throttle(throttle.into());
                max_throttle = max_throttle.max(throttle);
                estimate_ms = planner.estimated_downtime(d).map(|x| x.as_secs_f64() * 1e3);
                events(Event::Round {
                    round,
                    pages_sent: n,
                    ms: dur.as_secs_f64() * 1e3,
                    dirty_pages: d,
                    mb_per_s: planner.bandwidth().unwrap_or(0.0) / 1e6,
                    estimated_downtime_ms: estimate_ms,
                    throttle_percent: throttle,
                });
                to_send = dirty;
                round += 1;
                match decision {
                    Decision::Continue => {}
                    Decision::NotConverging { estimated, throttle_percent } => events(Event::NotConverging {
                        round: round - 1,
                        estimated_downtime_ms: estimated.as_secs_f64() * 1e3,
                        target_ms: opts.policy.downtime.map(|t| t.as_secs_f64() * 1e3),
                        throttle_percent,
                    }),
                    Decision::StopAndCopy(reason) => {
                        stop_reason = planner.describe_stop(&reason);
                        estimated_downtime = planner.last_estimate();
                        return Ok(());
                    }
                    Decision::GiveUp(why) => return Err(MigrateError::GaveUp(why.to_string())),
                }
            }
        })();
        // Downtime counts from the pause request: vCPUs stop as they are kicked.
        pause_at = Instant::now();
        let paused_result = result.and_then(|()| {
            src.pause().map_err(MigrateError::Source)?;
            paused.store(true, Ordering::Release);
            Ok(())
        });
        stop.pause_ms = ms_since(pause_at);
        let final_result = paused_result.and_then(|()| {
            let t = Instant::now();
            src.fetch_dirty(&mut to_send).map_err(MigrateError::Source)?;
            stop.harvest_ms = ms_since(t);
            stop.pages = to_send.count();
            events(Event::StopAndCopy { reason: stop_reason.clone(), pages: to_send.count() });
            let t = Instant::now();
            let mut progress = |p: RoundProgress| events(progress_event(p, before, estimate_ms));
            let n = col.send_round(round, to_send.gfns(), stop.pages, Checksum::Full, &mut progress)?;
            sent_total += n;
            rounds.push(RoundReport { round, pages: n, ms: t.elapsed().as_secs_f64() * 1e3, dirty_after: 0 });
            Ok(())
        });
        drop(col);
        // Close the queues and collect every sender, also after a failure, so no thread is left.
        // A sender's own error (the connection broke) explains a failure better than the
        // collector's "sender stopped", so it goes first.
        let mut first_err = None;
        for mut s in senders {
            match s.finish() {
                Some(Ok(Ok((c, e, zs)))) => {
                    stats_zc.0 += zs.zc_completions;
                    stats_zc.1 += zs.zc_copied;
                    encs.push((c, e, zs.pages));
                }
                Some(Ok(Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Some(Err(_)) | None => {
                    first_err.get_or_insert(MigrateError::Other("sender thread panicked".into()));
                }
            }
        }
        if let Err(e) = final_result {
            first_err.get_or_insert(e);
        }
        if let Some(e) = first_err {
            for (mut c, mut enc, _) in encs {
                let mut out = Vec::new();
                enc.abort(&mut out, &e.to_string());
                let _ = c.send_records(&out);
            }
            return Err(e);
        }
        stop.pages_ms = ms_since(pause_at) - stop.pause_ms - stop.harvest_ms;
        bytes = sent_total * PAGE as u64;
        learned = Some(planner);
    }

    // The point of no return: after the state goes out the destination may run the VM, so a
    // cancel that comes later is refused; one that came first backs out here.
    if !opts.cancel.commit() {
        for (c, enc, _) in &mut encs {
            let mut out = Vec::new();
            enc.abort(&mut out, &MigrateError::Cancelled.to_string());
            let _ = c.send_records(&out);
        }
        return Err(MigrateError::Cancelled);
    }
    // Closing records: the state on the first connection, Complete (with the pages each
    // connection carried, which its receiver checks) on all.
    let t_state = Instant::now();
    let state = src.save_state().map_err(MigrateError::Source)?;
    let mut out = Vec::new();
    for (i, (c, enc, pages)) in encs.iter_mut().enumerate() {
        out.clear();
        if i == 0 {
            enc.state(&mut out, &state)?;
        }
        enc.complete(&mut out, *pages);
        c.send_records(&out)?;
    }
    bytes += state.len() as u64;
    stop.state_bytes = state.len() as u64;
    stop.state_ms = ms_since(t_state);
    // Committed: the destination has everything it needs to run the VM. From here on only its
    // explicit Failed gives the VM back to the source.
    let t_reply = Instant::now();
    let reply = replies.wait(deadline);
    stop.reply_ms = ms_since(t_reply);
    let downtime = pause_at.elapsed();
    match reply {
        Ok(Reply::Resumed) => {}
        Ok(Reply::Failed(why)) => return Err(MigrateError::Dest(why)),
        Ok(other) => return Err(MigrateError::Unconfirmed(format!("it answered {other:?} instead of Resumed"))),
        Err(e) => return Err(MigrateError::Unconfirmed(e.to_string())),
    }
    src.stop_dirty_log();
    add_cpu(&cpu, cpu0);
    // Learn this stop phase's cost for the next migration's estimates.
    let stop_phase_model = match learned.as_mut() {
        Some(p) => {
            p.observe_stop_phase(&StopPhaseSample {
                pages: stop.pages,
                state_bytes: stop.state_bytes,
                measured_downtime: downtime,
                harvest: Some(Duration::from_secs_f64(stop.harvest_ms / 1e3)),
            });
            p.stop_phase_model()
        }
        None => opts.policy.stop_phase,
    };
    let total = t_start.elapsed();
    events(Event::Completed { total_ms: total.as_secs_f64() * 1e3, downtime_ms: downtime.as_secs_f64() * 1e3 });
    Ok(Report {
        engine: opts.engine,
        connections: nconn,
        total_ms: total.as_secs_f64() * 1e3,
        downtime_ms: downtime.as_secs_f64() * 1e3,
        rounds,
        stop_reason,
        total_pages: sent_total,
        bytes,
        mb_per_s: bytes as f64 / total.as_secs_f64() / 1e6,
        sender_cpu_ms: cpu.load(Ordering::Relaxed) as f64 / 1e3,
        zerocopy_completions: stats_zc.0,
        zerocopy_copied: stats_zc.1,
        round0_dirty_samples: round0_samples,
        stop_phase: stop,
        estimated_downtime_ms: estimated_downtime.map(|d| d.as_secs_f64() * 1e3),
        max_throttle_percent: max_throttle,
        stop_phase_model,
    })
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
