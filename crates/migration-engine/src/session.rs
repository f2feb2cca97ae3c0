//! What both sides of a live migration share: the engines, the options, the events and the
//! report, the errors, and the seam to the VM ([`SourceVm`], [`DestVm`]). The source side
//! (the pre-copy loop and the engines' senders) is in `source.rs`, the destination side (the
//! receiver) in `destination.rs`.
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

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kumo_migration::PageBitmap;
use kumo_vm::GuestMemory;
use serde::{Deserialize, Serialize};

use crate::control::CancelToken;
use kumo_migration::format::{self, VmDescription};
use kumo_migration::planner::StopPolicy;

pub(crate) const PAGE: usize = 4096;

/// How pages travel: the one engine enum, defined in `kumo-migration`.
pub use kumo_migration::MigrationEngine;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrateOptions {
    pub engine: MigrationEngine,
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
    /// Mutual TLS to a `tcp:` destination (its files are not a setting either).
    #[serde(skip)]
    pub tls: Option<crate::tls::ClientTls>,
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
            engine: MigrationEngine::Overlap,
            policy: StopPolicy::default(),
            connections: 1,
            progress_timeout: PROGRESS_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            max_bandwidth: None,
            cancel: CancelToken::default(),
            tls: None,
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
    RearmDirty,
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
            VmOp::RearmDirty => "re-arming the dirty log",
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
    /// When a migration fails (the VM runs on here). After a migration that succeeded the
    /// VM is over and its log is left on.
    fn stop_dirty_log(&self);
    /// The pages round 0 sends: every page ever touched. Called once, after
    /// [`SourceVm::start_dirty_log`].
    fn first_round_pages(&self) -> Result<PageBitmap, VmError>;
    /// Adds the pages dirtied since they were last armed to `into`; returns how many. They
    /// may stay writable until [`SourceVm::rearm_dirty`]: every harvested page is re-armed
    /// before its data is read (or the VM is paused).
    fn harvest_dirty(&self, into: &mut PageBitmap) -> Result<u64, VmError>;
    /// Re-arms tracking for `gfns` (ascending): the guest's next write to each is logged.
    fn rearm_dirty(&self, gfns: &[u64]) -> Result<(), VmError>;
    fn pause(&self) -> Result<(), VmError>;
    fn resume(&self) -> Result<(), VmError>;
    /// vCPU, irqchip, clock and device state, opaque to migration.
    fn save_state(&self) -> Result<Vec<u8>, VmError>;
    /// Distinct pages dirtied since the last `harvest_dirty`, read without clearing; `None` if
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
    /// Whether every page of its memory is faulted in already (a destination prepared in
    /// advance): the receivers then write without faulting runs in first.
    fn resident(&self) -> bool {
        false
    }
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
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// The sender's view of an I/O error: a send deadline becomes "no progress".
pub(crate) fn send_err(e: io::Error, deadline: Duration) -> MigrateError {
    if is_timeout(&e) {
        MigrateError::NoProgress { what: "the destination took no data", after: deadline }
    } else {
        MigrateError::Io(e)
    }
}

// The events and the report are API answers: their types live in kumo-api.
pub use kumo_api::{Event, PhaseTimes, Report, RoundReport, StopPhaseTimes};

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
pub(crate) fn add_cpu(total: &AtomicU64, start_ms: f64) {
    total.fetch_add(((thread_cpu_ms() - start_ms) * 1000.0) as u64, Ordering::Relaxed);
}

pub(crate) fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
