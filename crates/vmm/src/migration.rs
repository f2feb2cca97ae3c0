//! A running VM as a migration source or destination, and migration jobs for the API.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_api::{MigrateRequest, MigrationEngine};
use kumo_migration::format::VmDescription;
use kumo_migration::model::{compare, predict, Comparison, DirtyModel, PredictParams, Prediction};
use kumo_migration::planner::{RoundStats, StopPolicy, XenRule};
use kumo_migration::StopPhaseModel;
use kumo_migration_engine::{
    migrate, receive_with, Address, BoxError, CancelToken, DestVm, EngineKind, Event, Listener, MigrateError,
    MigrateOptions, RecvProgress, RecvReport, RecvStatus, Report, SourceVm, VmError, VmOp,
};
use kumo_vm::dirty::PageBitmap;
use kumo_vm::layout::ram_regions;
use kumo_vm::GuestMemory;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::vmm::{RunningVm, Snapshot};
use crate::VmConfig;

impl SourceVm for RunningVm {
    fn description(&self) -> VmDescription {
        let c = self.config();
        let payload = serde_json::to_value(c).unwrap_or(Value::Null);
        VmDescription::new(c.cpus, &c.irqchip.to_string(), payload, ram_regions(c.memory))
    }
    fn memory(&self) -> &GuestMemory {
        RunningVm::memory(self)
    }
    fn memfd(&self) -> BorrowedFd<'_> {
        RunningVm::memfd(self).as_fd()
    }
    fn start_dirty_log(&self) -> Result<(), VmError> {
        self.vm().start_dirty_log().map(drop).map_err(|e| VmError::new(VmOp::StartDirtyLog, e))
    }
    fn stop_dirty_log(&self) {
        if let Err(e) = self.vm().stop_dirty_log() {
            tracing::warn!("cannot stop dirty logging: {e}");
        }
    }
    fn touched_pages(&self) -> Result<PageBitmap, VmError> {
        self.vm().touched_pages().map_err(|e| VmError::new(VmOp::TouchedPages, e))
    }
    fn fetch_dirty(&self, into: &mut PageBitmap) -> Result<u64, VmError> {
        self.vm().fetch_dirty(into).map_err(|e| VmError::new(VmOp::FetchDirty, e))
    }
    fn pause(&self) -> Result<(), VmError> {
        self.migration_pause().map_err(|e| VmError::new(VmOp::Pause, e))
    }
    fn resume(&self) -> Result<(), VmError> {
        self.migration_resume().map_err(|e| VmError::new(VmOp::Resume, e))
    }
    fn save_state(&self) -> Result<Vec<u8>, VmError> {
        let err = |e: BoxError| VmError { op: VmOp::SaveState, source: e };
        let s = RunningVm::save_state(self).map_err(|e| err(e.into()))?;
        serde_json::to_vec(&s).map_err(|e| err(e.into()))
    }
    fn set_throttle(&self, percent: u32) {
        RunningVm::set_throttle(self, percent)
    }
    fn peek_dirty_count(&self) -> Option<u64> {
        self.vm().peek_dirty_count().ok().flatten()
    }
}

impl DestVm for RunningVm {
    fn memory(&self) -> &GuestMemory {
        RunningVm::memory(self)
    }
    fn restore_state(&self, state: &[u8]) -> Result<(), VmError> {
        let err = |e: BoxError| VmError { op: VmOp::RestoreState, source: e };
        let s: Snapshot = serde_json::from_slice(state).map_err(|e| err(format!("bad VM state: {e}").into()))?;
        RunningVm::restore_state(self, &s).map_err(|e| err(e.into()))
    }
    fn resume(&self) -> Result<(), VmError> {
        self.resume_incoming().map_err(|e| VmError::new(VmOp::Resume, e))
    }
}

/// The VM config an incoming stream describes, checked against the stream's own shape.
pub fn config_from_description(d: &VmDescription) -> Result<VmConfig, String> {
    let c: VmConfig =
        serde_json::from_value(d.payload.clone()).map_err(|e| format!("the stream's VM config is not kumo's: {e}"))?;
    if c.cpus != d.cpus || c.memory != d.memory_bytes || ram_regions(c.memory) != d.regions {
        return Err("the stream's VM config contradicts its description".into());
    }
    c.validate_shape().map_err(|e| e.to_string())?;
    Ok(c)
}

/// The lowest bandwidth cap taken, bytes/s: below it a 4 MiB batch takes seconds and the
/// progress deadline of a slow destination would be hard to tell from the cap.
pub const MIN_BANDWIDTH: u64 = 1_000_000;

/// Turns an API request into migration options.
pub fn options(req: &MigrateRequest) -> Result<(Address, MigrateOptions), String> {
    let to: Address = req.to.parse()?;
    let engine = match req.engine.unwrap_or(MigrationEngine::Overlap) {
        MigrationEngine::Serial => EngineKind::Serial,
        MigrationEngine::Overlap => EngineKind::Overlap,
        MigrationEngine::Zerocopy => EngineKind::Zerocopy,
        MigrationEngine::Local => EngineKind::Local,
    };
    let downtime = req.downtime_ms.map(Duration::from_millis);
    let xen = req.xen.unwrap_or(downtime.is_none());
    if !xen && downtime.is_none() {
        return Err("no stop rule: keep Xen's rule or give downtime_ms".into());
    }
    let connections = req.connections.unwrap_or(1);
    let max = kumo_migration::format::MAX_CONNECTIONS as usize;
    if !(1..=max).contains(&connections) {
        return Err(format!("connections must be 1..={max}, not {connections}"));
    }
    if engine == EngineKind::Serial && connections > 1 {
        return Err("the serial engine sends one batch at a time on one connection: use connections 1".into());
    }
    if let Some(b) = req.max_bandwidth.filter(|&b| b < MIN_BANDWIDTH) {
        return Err(format!("max_bandwidth must be at least {MIN_BANDWIDTH} bytes/s (1M), not {b}"));
    }
    let mut opts = MigrateOptions { engine, connections, max_bandwidth: req.max_bandwidth, ..Default::default() };
    if let Some(ms) = req.progress_timeout_ms {
        if !(100..=3_600_000).contains(&ms) {
            return Err(format!("progress_timeout_ms must be 100..=3600000, not {ms}"));
        }
        opts.progress_timeout = Duration::from_millis(ms);
    }
    let strict = req.strict.unwrap_or(false);
    if strict && downtime.is_none() {
        return Err("strict needs downtime_ms: it makes the downtime target a promise".into());
    }
    opts.policy = StopPolicy {
        xen: xen.then(XenRule::default),
        downtime,
        strict,
        transfer_margin: kumo_migration::planner::TRANSFER_MARGIN,
        ..Default::default()
    };
    Ok((to, opts))
}

/// The dirty-page model fitted to a migration, and its prediction next to the measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    pub fitted: bool,
    /// Why the model could not be fitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// What the fit used: round 0's samples of D(t), or the rounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fit_source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub m: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tau_s: Option<f64>,
    #[serde(default)]
    pub observations: Vec<(f64, f64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_pages_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Prediction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Comparison>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predict_error: Option<String>,
}

/// Fits the dirty-page model to the live rounds' observations (round length, pages dirtied
/// during it) and predicts the whole migration from them, to compare with what happened.
pub fn model_report(r: &Report, policy: StopPolicy, total_pages: u64) -> ModelReport {
    // Prefer D(t) sampled during round 0: a direct measurement of the curve, so the rounds
    // after it are predicted out of sample. Otherwise fit the rounds' (length, pages dirtied).
    let (obs, source): (Vec<(f64, f64)>, &str) = if r.round0_dirty_samples.len() >= 3 {
        (r.round0_dirty_samples.iter().map(|&(t, d)| (t, d as f64)).collect(), "round 0, sampled every 50 ms")
    } else {
        let live: Vec<_> =
            r.rounds.iter().filter(|x| x.dirty_after > 0 || x.round + 1 < r.rounds.len() as u32).collect();
        (
            live.iter().take(live.len().saturating_sub(1).max(2)).map(|x| (x.ms / 1e3, x.dirty_after as f64)).collect(),
            "rounds",
        )
    };
    let mut out = ModelReport {
        fitted: false,
        why: None,
        fit_source: None,
        m: None,
        tau_s: None,
        observations: obs,
        bandwidth_pages_per_s: None,
        predicted: None,
        comparison: None,
        predict_error: None,
    };
    let model = match DirtyModel::fit_bounded(&out.observations, total_pages as f64) {
        Ok(m) => m,
        Err(e) => {
            out.why = Some(e.to_string());
            return out;
        }
    };
    out.fitted = true;
    out.m = Some(model.m);
    out.tau_s = Some(model.tau);
    let secs: f64 = r.rounds.iter().map(|x| x.ms).sum::<f64>() / 1e3;
    let pages: u64 = r.rounds.iter().map(|x| x.pages).sum();
    let bw = if secs > 0.0 { pages as f64 / secs } else { 0.0 };
    let params = PredictParams {
        total_pages,
        round0_pages: r.rounds.first().map(|x| x.pages).unwrap_or(0),
        bandwidth_pages_per_s: bw,
        beta: 0.0,
        policy,
    };
    let measured: Vec<RoundStats> = r
        .rounds
        .iter()
        .map(|x| RoundStats {
            round: x.round,
            pages_sent: x.pages,
            bytes_sent: x.pages * 4096,
            duration: Duration::from_secs_f64(x.ms / 1e3),
            dirty_pages: x.dirty_after,
        })
        .collect();
    match predict(&model, &params) {
        Ok(p) => {
            out.fit_source = Some(source.into());
            out.bandwidth_pages_per_s = Some(bw);
            out.comparison = Some(compare(&p, &measured));
            out.predicted = Some(p);
        }
        Err(e) => out.predict_error = Some(e.to_string()),
    }
    out
}

/// What a dry run predicts (`kumo migrate --dry-run`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DryRunReport {
    /// Always true: tells a dry run's answer from a migration's.
    pub dry_run: bool,
    pub m: f64,
    pub tau_s: f64,
    pub observations: Vec<(f64, f64)>,
    pub touched_pages: u64,
    pub bandwidth_pages_per_s: f64,
    pub predicted: Prediction,
}

/// A finished migration's report as the API gives it: the engine's measurements, the model,
/// where the VM went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendReport {
    #[serde(flatten)]
    pub report: Report,
    pub model: ModelReport,
    pub to: String,
    /// The user had paused the VM: it arrives paused.
    pub arrived_paused: bool,
}

/// What a migration request ended with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MigrationResult {
    DryRun(DryRunReport),
    Migrated(Box<SendReport>),
}

/// Where the last migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationState {
    None,
    Running,
    Completed,
    Failed,
    Cancelled,
    /// A destination: the VM is arriving (`received` says how far).
    Receiving,
    /// A destination: the VM arrived and runs here.
    Received,
}

/// Body of `GET /api/v1/vm.migration`, and of a successful `PUT /api/v1/vm.send-migration`:
/// the final status, so that a source that stops once its VM has moved still tells how the
/// migration ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub state: MigrationState,
    pub events: Vec<Event>,
    pub report: Option<MigrationResult>,
    #[serde(default)]
    pub error: Option<String>,
    /// A destination's incoming migration: pages and rounds so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received: Option<RecvStatus>,
}

/// Watches the guest dirty memory for about `window` and predicts a migration at
/// `bandwidth_pages_per_s`: the dry run behind `kumo migrate --dry-run`.
pub fn estimate(
    vm: &RunningVm,
    window: Duration,
    bandwidth_pages_per_s: f64,
    policy: StopPolicy,
) -> Result<DryRunReport, String> {
    vm.vm().start_dirty_log().map_err(|e| e.to_string())?;
    let regions = ram_regions(vm.config().memory);
    let r = (|| {
        let mut scratch = PageBitmap::for_regions(&regions);
        vm.vm().fetch_dirty(&mut scratch).map_err(|e| e.to_string())?;
        // Windows of growing length: the model's curve is only determined by several t.
        let mut obs = Vec::new();
        let mut t = (window.as_secs_f64() / 31.0).max(0.005);
        let end = Instant::now() + window;
        while Instant::now() < end {
            let mut bm = PageBitmap::for_regions(&regions);
            let t0 = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(t));
            vm.vm().fetch_dirty(&mut bm).map_err(|e| e.to_string())?;
            obs.push((t0.elapsed().as_secs_f64(), bm.count() as f64));
            t *= 2.0;
        }
        let touched = vm.vm().touched_pages().map_err(|e| e.to_string())?.count();
        let model = DirtyModel::fit(&obs)
            .map_err(|e| format!("cannot fit the dirty-page model: {e} (observations {obs:?})"))?;
        let total_pages = vm.config().memory / 4096;
        let params = PredictParams { total_pages, round0_pages: touched, bandwidth_pages_per_s, beta: 0.0, policy };
        let p = predict(&model, &params).map_err(|e| e.to_string())?;
        Ok(DryRunReport {
            dry_run: true,
            m: model.m,
            tau_s: model.tau,
            observations: obs,
            touched_pages: touched,
            bandwidth_pages_per_s,
            predicted: p,
        })
    })();
    let _ = vm.vm().stop_dirty_log();
    r
}

/// The migration a VM's API is running or last ran.
#[derive(Default)]
pub struct MigrationJob {
    state: Mutex<JobState>,
    /// Signalled at every event and when a migration ends: streams wait on it.
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct JobState {
    running: bool,
    /// The running migration's cancel handle.
    cancel: Option<CancelToken>,
    events: Vec<Event>,
    result: Option<MigrationResult>,
    error: Option<String>,
    cancelled: bool,
}

impl JobState {
    fn status(&self) -> MigrationStatus {
        let state = match (self.running, &self.result, &self.error) {
            (true, _, _) => MigrationState::Running,
            (false, Some(_), _) => MigrationState::Completed,
            (false, None, Some(_)) if self.cancelled => MigrationState::Cancelled,
            (false, None, Some(_)) => MigrationState::Failed,
            _ => MigrationState::None,
        };
        MigrationStatus {
            state,
            events: self.events.clone(),
            report: self.result.clone(),
            error: self.error.clone(),
            received: None,
        }
    }
}

impl MigrationJob {
    fn lock(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn status(&self) -> MigrationStatus {
        self.lock().status()
    }

    /// Hands `sink` every event of the running migration (or the last one) as it comes, then
    /// the final status without its events, once the migration has ended. Stops early when
    /// `sink` says so.
    pub fn stream(&self, sink: &mut dyn FnMut(&Value) -> bool) {
        let mut sent = 0;
        loop {
            let (new, ended) = {
                let mut s = self.lock();
                if s.running && s.events.len() == sent {
                    // Wakes at least every second even without news.
                    s = self.changed.wait_timeout(s, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
                }
                let new: Vec<Event> = s.events.get(sent..).unwrap_or_default().to_vec();
                let ended = (!s.running).then(|| MigrationStatus { events: Vec::new(), ..s.status() });
                (new, ended)
            };
            sent += new.len();
            for e in &new {
                if !sink(&serde_json::to_value(e).unwrap_or(Value::Null)) {
                    return;
                }
            }
            if let Some(st) = ended {
                sink(&serde_json::to_value(&st).unwrap_or(Value::Null));
                return;
            }
        }
    }

    /// Cancels the running migration: it stops between two batches and the VM runs on here.
    pub fn cancel(&self) -> Result<(), JobError> {
        let s = self.lock();
        match (&s.cancel, s.running) {
            (Some(t), true) => t.cancel().map_err(|e| JobError::TooLate(e.to_string())),
            _ => Err(JobError::NotRunning),
        }
    }

    /// Runs a migration of `vm` to completion and answers its final status. Only one at a
    /// time.
    pub fn run(&self, vm: &Arc<RunningVm>, req: &MigrateRequest) -> Result<MigrationStatus, JobError> {
        let (to, opts) = options(req).map_err(JobError::BadRequest)?;
        {
            let mut s = self.lock();
            if s.running {
                return Err(JobError::Busy);
            }
            *s = JobState { running: true, cancel: Some(opts.cancel.clone()), ..Default::default() };
        }
        let result: Result<MigrationResult, MigrateError> = if req.dry_run {
            let bw = loopback_pages_per_s();
            estimate(vm, Duration::from_millis(req.estimate_ms.unwrap_or(2000).clamp(100, 60_000)), bw, opts.policy)
                .map(MigrationResult::DryRun)
                .map_err(MigrateError::Other)
        } else if let Err(e) = vm.begin_migration() {
            let mut s = self.lock();
            s.running = false;
            s.cancel = None;
            return Err(JobError::Conflict(e.to_string()));
        } else {
            let total_pages = vm.config().memory / 4096;
            let mut opts = opts;
            // The stop phase's cost is measured only after the VM's state has gone out, so no
            // migration can hand its measurement on yet: each starts from the engine's prior.
            opts.policy.stop_phase = StopPhaseModel::with_prior(kumo_migration_engine::STOP_PHASE_PRIOR);
            let r = migrate(&**vm, &to, &opts, &mut |e| {
                if !matches!(e, Event::Progress { .. }) {
                    tracing::info!(?e, "migration");
                }
                self.lock().events.push(e);
                self.changed.notify_all();
            })
            .map(|r| {
                let model = model_report(&r, opts.policy, total_pages);
                let arrived_paused = vm.paused_by_user();
                // The VM runs at the destination now; this copy stops (before the run state
                // goes back to the user, so nothing can resume it in between).
                vm.finish_migrated(to.to_string());
                MigrationResult::Migrated(Box::new(SendReport { report: r, model, to: to.to_string(), arrived_paused }))
            });
            vm.end_migration();
            r
        };
        let mut s = self.lock();
        s.running = false;
        s.cancel = None;
        self.changed.notify_all();
        match result {
            Ok(v) => {
                s.result = Some(v);
                Ok(s.status())
            }
            Err(e) => {
                s.cancelled = matches!(e, MigrateError::Cancelled);
                s.error = Some(e.to_string());
                Err(if s.cancelled { JobError::Cancelled } else { JobError::Failed(e.to_string()) })
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("{0}")]
    BadRequest(String),
    #[error("a migration is already running")]
    Busy,
    #[error("{0}")]
    Conflict(String),
    #[error("migration failed: {0}")]
    Failed(String),
    #[error("migration cancelled; the VM runs on here")]
    Cancelled,
    #[error("no migration is running")]
    NotRunning,
    #[error("{0}")]
    TooLate(String),
}

/// This host's loopback TCP throughput in pages/s, measured by sending 64 MiB to ourselves:
/// the bandwidth a dry run assumes for a local destination.
pub fn loopback_pages_per_s() -> f64 {
    kumo_migration_engine::transport::loopback_tcp_bytes_per_s(64 << 20, 1 << 20)
        .map(|b| b / 4096.0)
        .unwrap_or(250_000.0)
}

/// A destination's incoming migration (`kumo run --incoming ADDR`): where it listens, the shape
/// it was prepared for, and how far the VM has arrived (read by the destination's API).
pub struct Incoming {
    pub addr: Address,
    /// `--memory`: only a VM of this size is taken, its memory allocated and faulted in first.
    pub memory: Option<u64>,
    /// `--cpus`: only a VM with this many vCPUs is taken.
    pub cpus: Option<u32>,
    pub since: Instant,
    progress: RecvProgress,
    arrived: Mutex<Option<RecvReport>>,
}

impl Incoming {
    pub fn new(addr: &str, memory: Option<u64>, cpus: Option<u32>) -> Result<Arc<Incoming>, String> {
        let addr: Address = addr.parse()?;
        Ok(Arc::new(Incoming {
            addr,
            memory,
            cpus,
            since: Instant::now(),
            progress: RecvProgress::default(),
            arrived: Mutex::new(None),
        }))
    }

    /// `receiving` with the pages so far, or `received` once the VM runs here.
    pub fn status(&self) -> MigrationStatus {
        let arrived = self.arrived.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        MigrationStatus {
            state: if arrived { MigrationState::Received } else { MigrationState::Receiving },
            events: Vec::new(),
            report: None,
            error: None,
            received: Some(self.progress.status()),
        }
    }

    /// Waits for one incoming migration and returns the VM, running, with what the receiver
    /// measured. With `memory` or `cpus` the destination is prepared: both are checked against
    /// this host, and guest memory of that size is allocated and faulted in before listening,
    /// so the transfer does not pay for first-touch page faults (expensive on nested hosts).
    /// `say` gets the lines an operator wants to see (prepared, listening).
    pub fn receive(&self, say: &dyn Fn(&str)) -> Result<(RunningVm, RecvReport), String> {
        let (memory, cpus) = (self.memory, self.cpus);
        let host = kumo_vm::layout::HostLimits::probe().map_err(|e| e.to_string())?;
        if let Some(n) = cpus {
            kumo_vm::layout::check_vcpus(n, host.kvm_max_vcpus).map_err(|e| e.to_string())?;
        }
        if let Some(size) = memory {
            kumo_vm::memory::check_size(size, &host.memory).map_err(|e| e.to_string())?;
        }
        let mut reserved = match memory {
            Some(size) => {
                let t = Instant::now();
                let m = kumo_vm::Memory::new(size).map_err(|e| e.to_string())?;
                for (gpa, len) in ram_regions(size) {
                    kumo_vm::memory::populate(&m.guest, gpa, len).map_err(|e| e.to_string())?;
                }
                say(&format!(
                    "prepared {} MiB of guest memory in {:.0} ms",
                    size >> 20,
                    t.elapsed().as_secs_f64() * 1e3
                ));
                Some(m.memfd)
            }
            None => None,
        };
        // Listen only once the memory is ready: a source that connected earlier would wait for
        // the handshake while memory is faulted in, and give up.
        let listener = Listener::bind(&self.addr).map_err(|e| format!("cannot listen on {}: {e}", self.addr))?;
        say(&format!("waiting for a migration on {}", listener.local_addr()));
        let (vm, rr) =
            receive_with(&listener, kumo_migration_engine::PROGRESS_TIMEOUT, &self.progress, |desc, memfd| {
                let refuse = |why: String| VmError::new(VmOp::Create, why);
                let config = config_from_description(desc).map_err(refuse)?;
                let human = kumo_vm::memory::human_size;
                if let Some(size) = memory.filter(|&m| m != config.memory) {
                    return Err(refuse(format!(
                        "this destination is prepared for {} of memory; the VM has {}",
                        human(size),
                        human(config.memory)
                    )));
                }
                if let Some(n) = cpus.filter(|&n| n != config.cpus) {
                    return Err(refuse(format!(
                        "this destination is prepared for {n} vCPUs; the VM has {}",
                        config.cpus
                    )));
                }
                // Memory shared by a local migration wins; otherwise the prepared memory, if any.
                let memfd = memfd.or_else(|| reserved.take());
                RunningVm::incoming(config, Box::new(std::io::stdout()), memfd)
                    .map_err(|e| VmError::new(VmOp::Create, e))
            })
            .map_err(|e| format!("incoming migration failed: {e}"))?;
        *self.arrived.lock().unwrap_or_else(|p| p.into_inner()) = Some(rr.clone());
        Ok((vm, rr))
    }
}
