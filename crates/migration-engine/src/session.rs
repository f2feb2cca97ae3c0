//! Live migration sessions: the pre-copy loop on the source, the receiver on the destination,
//! and the engines that move pages between them.
//!
//! The VM is reached through [`SourceVm`] and [`DestVm`], so everything here is independent of
//! how a VMM runs its vCPUs and can be tested with plain memory. Engines:
//! - `serial`: copy a batch of up to 1,024 pages into a buffer, send it, wait until the
//!   destination reports it placed (the paper's per-batch completion notice), reuse the
//!   buffer, in order (the paper's baseline without pipelining).
//! - `overlap`: the paper's pipeline: a collector copies batch k+1 while sender threads put
//!   batch k on the wire, through bounded queues of reusable buffers; with several connections
//!   the receiver places their batches in parallel.
//! - `zerocopy`: no copy on the sender: `sendmsg(MSG_ZEROCOPY)` with iovecs straight into guest
//!   memory (live-round batches checksum their metadata only, see docs/migration-format.md).
//! - `local`: same host: the guest memory's memfd is passed over a unix socket (SCM_RIGHTS), so
//!   memory is not copied at all; only vCPU and device state cross.
//!
//! The receiver reads page data straight into the destination's guest memory
//! ([`format::Reader::next_record_placed`]): receiving is placing, with no buffer in between.

use std::fs::File;
use std::io::{self, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_vm::dirty::PageBitmap;
use kumo_vm::GuestMemory;
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use crate::control::{CancelToken, SystemClock, TokenBucket};
use crate::transport::{Address, Conn, Listener, ZeroCopy};
use kumo_migration::format::{
    self, BatchFrame, Checksum, Encoder, PagePlacer, Reader, Record, Reply, ReplyReader, VmDescription, MAX_BATCH_PAGES,
};
use kumo_migration::planner::{Decision, Planner, RoundExtras, RoundStats, StopPolicy};
use kumo_migration::{StopPhaseModel, StopPhaseSample};

const PAGE: usize = 4096;

/// How pages travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Serial,
    Overlap,
    Zerocopy,
    Local,
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "serial" => Ok(EngineKind::Serial),
            "overlap" => Ok(EngineKind::Overlap),
            "zerocopy" => Ok(EngineKind::Zerocopy),
            "local" => Ok(EngineKind::Local),
            _ => Err(format!("unknown engine `{s}`: serial, overlap, zerocopy or local")),
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineKind::Serial => "serial",
            EngineKind::Overlap => "overlap",
            EngineKind::Zerocopy => "zerocopy",
            EngineKind::Local => "local",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrateOptions {
    pub engine: EngineKind,
    pub policy: StopPolicy,
    /// Parallel connections (overlap and zerocopy).
    pub connections: usize,
    /// Progress deadline: the migration gives up (and the source runs on) when the destination
    /// takes no data, or does not answer, for this long.
    pub progress_timeout: Duration,
    /// How long a peer has to answer the stream header with `Accepted`: a peer that is not a
    /// kumo destination is rejected this quickly.
    pub handshake_timeout: Duration,
    /// Cap on the page data sent, bytes per second (all connections together).
    #[serde(default)]
    pub max_bandwidth: Option<u64>,
    /// Cancels the migration from another thread (not a setting: never serialized).
    #[serde(skip)]
    pub cancel: CancelToken,
}

/// The stop phase's fixed cost assumed before a VM's migrations have measured any: this
/// engine drains its pipeline before the pause, and its stop phases with few pages measured
/// 4–8 ms on this project's nested-KVM hosts (pause, state, the destination's restore and
/// reply). Each migration's report carries the model updated with its own measurement.
pub const STOP_PHASE_PRIOR: Duration = Duration::from_millis(6);

/// Default progress deadline, both sides.
pub const PROGRESS_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a round reports its progress (at most).
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Default handshake deadline.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            engine: EngineKind::Overlap,
            policy: StopPolicy::default(),
            connections: 1,
            progress_timeout: PROGRESS_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            max_bandwidth: None,
            cancel: CancelToken::default(),
        }
    }
}

/// Any error a VM implementation has.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a VM was asked to do when it failed, at the migration seam.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmOp {
    StartDirtyLog,
    TouchedPages,
    FetchDirty,
    Pause,
    Resume,
    SaveState,
    /// Building the destination VM from the stream's description.
    Create,
    RestoreState,
}

impl std::fmt::Display for VmOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VmOp::StartDirtyLog => "starting dirty logging",
            VmOp::TouchedPages => "finding the touched pages",
            VmOp::FetchDirty => "reading the dirty log",
            VmOp::Pause => "pausing",
            VmOp::Resume => "resuming",
            VmOp::SaveState => "saving its state",
            VmOp::Create => "creating it",
            VmOp::RestoreState => "restoring its state",
        })
    }
}

/// A VM operation that failed: which one, and the VM's own error.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct VmError {
    pub op: VmOp,
    #[source]
    pub source: BoxError,
}

impl VmError {
    pub fn new(op: VmOp, source: impl Into<BoxError>) -> Self {
        VmError { op, source: source.into() }
    }
}

/// The source VM, as migration sees it.
pub trait SourceVm: Sync {
    fn description(&self) -> VmDescription;
    fn memory(&self) -> &GuestMemory;
    fn memfd(&self) -> BorrowedFd<'_>;
    fn start_dirty_log(&self) -> Result<(), VmError>;
    fn stop_dirty_log(&self);
    /// Pages ever touched (round 0 sends these).
    fn touched_pages(&self) -> Result<PageBitmap, VmError>;
    /// Adds pages dirtied since the last call to `into`; returns how many.
    fn fetch_dirty(&self, into: &mut PageBitmap) -> Result<u64, VmError>;
    fn pause(&self) -> Result<(), VmError>;
    fn resume(&self) -> Result<(), VmError>;
    /// vCPU, irqchip, clock and device state, opaque to migration.
    fn save_state(&self) -> Result<Vec<u8>, VmError>;
    /// Distinct pages dirtied since the last `fetch_dirty`, read without clearing; `None` if
    /// the VM cannot tell without clearing. Sampled during round 0 to measure the dirty-page
    /// curve D(t) directly.
    fn peek_dirty_count(&self) -> Option<u64> {
        None
    }
    /// Slows the vCPUs so that a migration can converge: `percent` of the time asleep (0: full
    /// speed). VMs that cannot be throttled ignore it.
    fn set_throttle(&self, _percent: u32) {}
}

/// The destination VM, built from the stream's description.
pub trait DestVm: Sync {
    fn memory(&self) -> &GuestMemory;
    fn restore_state(&self, state: &[u8]) -> Result<(), VmError>;
    fn resume(&self) -> Result<(), VmError>;
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("migration stream: {0}")]
    Stream(#[from] format::Error),
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    #[error("source VM: {0}")]
    Source(VmError),
    /// Guest memory the source cannot read.
    #[error("source VM memory: {0}")]
    SourceMemory(String),
    #[error("destination refused: {0}")]
    Refused(String),
    /// The destination reported a failure (its message, from the wire).
    #[error("destination VM: {0}")]
    Dest(String),
    /// This destination's VM failed.
    #[error("destination VM: {0}")]
    DestVm(VmError),
    #[error("no reply from the destination within {} s", .0.as_secs_f64())]
    ReplyTimeout(Duration),
    /// A deadline passed with no progress: `what` says whose.
    #[error("{what} for {} s: giving up", after.as_secs_f64())]
    NoProgress { what: &'static str, after: Duration },
    #[error("{addr} is not a kumo migration destination ({why})")]
    NotKumo { addr: String, why: String },
    /// The VM's final state went out, but the destination did not confirm that it runs the
    /// VM. It may: the source keeps its copy paused rather than risk running the guest twice.
    #[error(
        "the destination did not confirm that it runs the VM ({0}); it may be running it, so this copy stays paused: check the destination, then resume or shut down this copy"
    )]
    Unconfirmed(String),
    /// A strict downtime target cannot be met; the VM runs on at the source.
    #[error("{0}; the VM runs on here")]
    GaveUp(String),
    /// The operator cancelled the migration before the VM's final state went out; the VM
    /// runs on at the source.
    #[error("cancelled by the operator; the VM runs on here")]
    Cancelled,
    #[error("{0}")]
    Other(String),
}

/// Whether an I/O error is a socket deadline passing.
fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// The sender's view of an I/O error: a send deadline becomes "no progress".
fn send_err(e: io::Error, deadline: Duration) -> MigrateError {
    if is_timeout(&e) {
        MigrateError::NoProgress { what: "the destination took no data", after: deadline }
    } else {
        MigrateError::Io(e)
    }
}

/// Progress of a migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Started {
        engine: EngineKind,
        connections: usize,
        total_pages: u64,
        touched_pages: u64,
    },
    Round {
        round: u32,
        pages_sent: u64,
        ms: f64,
        dirty_pages: u64,
        mb_per_s: f64,
        estimated_downtime_ms: Option<f64>,
        /// vCPU throttle in force, percent (0: none).
        #[serde(default)]
        throttle_percent: u8,
    },
    /// The guest dirties memory faster than the migration sends it: the downtime target is not
    /// in reach, and the vCPUs are throttled by `throttle_percent` from now on.
    NotConverging {
        round: u32,
        estimated_downtime_ms: f64,
        target_ms: Option<f64>,
        throttle_percent: u8,
    },
    /// Within a round, at most every [`PROGRESS_INTERVAL`]: how far the round has got.
    Progress {
        round: u32,
        /// Pages this round sends in all, and those handed to the wire so far.
        round_pages: u64,
        pages_sent: u64,
        /// Page data of this round so far.
        bytes_sent: u64,
        /// Pages and page data of the whole migration so far.
        total_pages_sent: u64,
        total_bytes_sent: u64,
        /// This round's rate so far.
        mb_per_s: f64,
        /// When this round will end at that rate.
        eta_ms: Option<f64>,
        /// The planner's latest estimate of the downtime (none before a round has ended).
        estimated_downtime_ms: Option<f64>,
    },
    StopAndCopy {
        reason: String,
        pages: u64,
    },
    Completed {
        total_ms: f64,
        downtime_ms: f64,
    },
    Failed {
        error: String,
    },
    /// The operator cancelled the migration; the VM runs on at the source.
    Cancelled,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: u32,
    pub pages: u64,
    pub ms: f64,
    /// Pages dirty when the round ended (distinct pages dirtied during it).
    pub dirty_after: u64,
}

/// What a finished migration measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub engine: EngineKind,
    pub connections: usize,
    pub total_ms: f64,
    /// VM paused on the source until the destination said it runs it.
    pub downtime_ms: f64,
    pub rounds: Vec<RoundReport>,
    pub stop_reason: String,
    pub total_pages: u64,
    pub bytes: u64,
    pub mb_per_s: f64,
    /// CPU time of the migration's own threads on the source (user + system).
    pub sender_cpu_ms: f64,
    /// Zero-copy sends the kernel completed, and how many of those it copied anyway.
    pub zerocopy_completions: u64,
    pub zerocopy_copied: u64,
    /// (seconds into round 0, distinct pages dirtied so far): the dirty-page curve D(t),
    /// sampled every 50 ms while round 0 ran (empty if the VM cannot be sampled).
    #[serde(default)]
    pub round0_dirty_samples: Vec<(f64, u64)>,
    /// Where the downtime went.
    #[serde(default)]
    pub stop_phase: StopPhaseTimes,
    /// The planner's downtime estimate when it stopped pre-copy (none for `local`, or when no
    /// bandwidth had been measured).
    #[serde(default)]
    pub estimated_downtime_ms: Option<f64>,
    /// The highest vCPU throttle the migration applied, percent.
    #[serde(default)]
    pub max_throttle_percent: u8,
    /// The stop phase's cost, learned from this migration's measurement and those before:
    /// what the next migration of this VM starts from.
    #[serde(default)]
    pub stop_phase_model: StopPhaseModel,
}

/// The stop phase measured on the source, from the pause request to the destination's
/// `Resumed`: the parts add up to the downtime.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StopPhaseTimes {
    /// Pausing the vCPUs (kick, park).
    pub pause_ms: f64,
    /// The last dirty-log harvest.
    pub harvest_ms: f64,
    /// Pages sent while paused.
    pub pages: u64,
    /// Sending them (the senders drained).
    pub pages_ms: f64,
    /// vCPU and device state: saving, encoding, sending.
    pub state_bytes: u64,
    pub state_ms: f64,
    /// From the state sent to `Resumed`: the destination's placement, restore and resume, and
    /// the reply's way back.
    pub reply_ms: f64,
}

/// CPU time (user + system) of the calling thread, in ms.
pub fn thread_cpu_ms() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is Linux's per-thread usage.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Adds the calling thread's CPU time since `start_ms` to `total` (µs, atomically).
fn add_cpu(total: &AtomicU64, start_ms: f64) {
    total.fetch_add(((thread_cpu_ms() - start_ms) * 1000.0) as u64, Ordering::Relaxed);
}

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
    tx: SyncSender<Work>,
    handle: std::thread::JoinHandle<SenderEnd>,
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
) -> Sender {
    let (tx, rx) = sync_channel::<Work>(depth);
    let handle = std::thread::Builder::new()
        .name("mig-send".into())
        .spawn(move || {
            let t0 = thread_cpu_ms();
            let r = sender_loop(sink, ack, rx, free);
            add_cpu(&cpu, t0);
            r
        })
        .expect("spawn sender thread");
    Sender { tx, handle }
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
            s.tx.send(Work::RoundEnd(round)).map_err(|_| MigrateError::Other("sender thread stopped".into()))?;
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
        s.tx.send(Work::Batch(Batch { round, gfns, data, checksum }))
            .map_err(|_| MigrateError::Other("sender thread stopped".into()))?;
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
        if e == EngineKind::Serial && opts.connections > 1 {
            return Err(MigrateError::Other(
                "the serial engine sends one batch at a time on one connection: use --connections 1".into(),
            ));
        }
        let shared_memory = e == EngineKind::Local;
        let copy = e != EngineKind::Zerocopy;
        let lockstep = e == EngineKind::Serial;
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
    let (local, nconn) = (plan.shared_memory, plan.connections);
    let mut desc = src.description();
    desc.connections = nconn as u32;
    desc.shared_memory = local;
    let deadline = opts.progress_timeout;

    let connect = || -> Result<Conn, MigrateError> {
        let c = Conn::connect(to, Duration::from_secs(10))
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
    let not_kumo = |why: String| MigrateError::NotKumo { addr: to.to_string(), why };
    match replies.wait(opts.handshake_timeout) {
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
        encs.push((Box::new(CopySink(conns.pop().expect("one connection"), deadline)), Encoder::new(), 0));
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
        let senders: Vec<Sender> =
            conns.drain(..).map(|c| spawn_sender(sink(c), serial, free_tx.clone(), cpu.clone(), depth)).collect();
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
                        let sampler = s.spawn(|| {
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
                        round0_samples = sampler.join().unwrap_or_default();
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
        for s in senders {
            drop(s.tx);
            match s.handle.join() {
                Ok(Ok((c, e, zs))) => {
                    stats_zc.0 += zs.zc_completions;
                    stats_zc.1 += zs.zc_copied;
                    encs.push((c, e, zs.pages));
                }
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
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
        s.tx.send(Work::Flush(tx)).map_err(|_| stopped())?;
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

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

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
    pages: AtomicU64,
    /// Rounds the source has ended (counted on its first connection).
    rounds: AtomicU64,
    /// Everything arrived: the VM's state is being restored.
    restoring: AtomicBool,
}

/// What [`RecvProgress`] says at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvStatus {
    /// `listening` (no source yet), `receiving` or `restoring`.
    pub phase: RecvPhase,
    pub pages: u64,
    pub bytes: u64,
    pub rounds: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecvPhase {
    Listening,
    Receiving,
    Restoring,
}

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
        RecvStatus { phase, pages, bytes: pages * PAGE as u64, rounds: self.rounds.load(Ordering::Relaxed) }
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
    let conn0 = listener.accept()?;
    let t0 = Instant::now();
    conn0.set_read_timeout(Some(idle))?;
    let mut conn0 = Replier { enc: Encoder::new(), conn: conn0 };
    // The header is read unbuffered: a local migration's memory file follows it on the socket,
    // and a buffer would swallow the byte that carries it.
    let mut raw0 = conn0.conn.try_clone()?;
    let desc = match format::read_header(&mut raw0) {
        Ok(d) => d,
        Err(e) => {
            conn0.send(&Reply::Failed(e.to_string()));
            return Err(recv_err(e.into(), idle));
        }
    };
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
    for i in 1..nconn {
        let c = match accept_within(listener, idle) {
            Ok(c) => c,
            Err(e) => {
                return Err(fail(
                    &mut conn0,
                    MigrateError::Other(format!("connection {i} of {nconn} did not arrive: {e}")),
                ))
            }
        };
        c.set_read_timeout(Some(idle))?;
        let mut c = c;
        match format::read_header(&mut c).map(|d| (d, c)) {
            Ok((d, c)) if d == desc => readers.push(Reader::secondary(buffered(c), &desc)),
            Ok(_) => return Err(fail(&mut conn0, MigrateError::Other(format!("connection {i} describes another VM")))),
            Err(e) => return Err(fail(&mut conn0, e.into())),
        }
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
                s.spawn(move || {
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
            let r = h.join().unwrap_or_else(|_| Err(MigrateError::Other("receiver thread panicked".into())));
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

fn accept_within(listener: &Listener, limit: Duration) -> io::Result<Conn> {
    listener.set_nonblocking(true)?;
    let t = Instant::now();
    let r = loop {
        match listener.accept() {
            Ok(c) => break Ok(c),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && t.elapsed() < limit => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => break Err(e),
        }
    };
    listener.set_nonblocking(false)?;
    let c = r?;
    c.set_nonblocking(false)?;
    Ok(c)
}
