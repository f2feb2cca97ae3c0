//! A running VM as a migration source or destination, and migration jobs for the API.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_api::MigrateRequest;
use kumo_migration::format::VmDescription;
use kumo_migration::model::{compare, predict, DirtyModel, PredictParams};
use kumo_migration::planner::{RoundStats, StopPolicy, XenRule};
use kumo_migration::StopPhaseModel;
use kumo_migration_engine::{migrate, Address, DestVm, EngineKind, Event, MigrateOptions, Report, SourceVm};
use kumo_vm::dirty::PageBitmap;
use kumo_vm::layout::ram_regions;
use kumo_vm::GuestMemory;
use serde_json::{json, Value};

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
    fn start_dirty_log(&self) -> Result<(), String> {
        self.vm().start_dirty_log().map(drop).map_err(|e| e.to_string())
    }
    fn stop_dirty_log(&self) {
        if let Err(e) = self.vm().stop_dirty_log() {
            tracing::warn!("cannot stop dirty logging: {e}");
        }
    }
    fn touched_pages(&self) -> Result<PageBitmap, String> {
        self.vm().touched_pages().map_err(|e| e.to_string())
    }
    fn fetch_dirty(&self, into: &mut PageBitmap) -> Result<u64, String> {
        self.vm().fetch_dirty(into).map_err(|e| e.to_string())
    }
    fn pause(&self) -> Result<(), String> {
        self.migration_pause().map_err(|e| e.to_string())
    }
    fn resume(&self) -> Result<(), String> {
        self.migration_resume().map_err(|e| e.to_string())
    }
    fn save_state(&self) -> Result<Vec<u8>, String> {
        let s = RunningVm::save_state(self).map_err(|e| e.to_string())?;
        serde_json::to_vec(&s).map_err(|e| e.to_string())
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
    fn restore_state(&self, state: &[u8]) -> Result<(), String> {
        let s: Snapshot = serde_json::from_slice(state).map_err(|e| format!("bad VM state: {e}"))?;
        RunningVm::restore_state(self, &s).map_err(|e| e.to_string())
    }
    fn resume(&self) -> Result<(), String> {
        self.resume_incoming().map_err(|e| e.to_string())
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

/// Turns an API request into migration options.
pub fn options(req: &MigrateRequest) -> Result<(Address, MigrateOptions), String> {
    let to: Address = req.to.parse()?;
    let engine: EngineKind = req.engine.as_deref().unwrap_or("overlap").parse()?;
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
    let mut opts = MigrateOptions { engine, connections, ..Default::default() };
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

/// Fits the dirty-page model to the live rounds' observations (round length, pages dirtied
/// during it) and predicts the whole migration from them, to compare with what happened.
pub fn model_report(r: &Report, policy: StopPolicy, total_pages: u64) -> Value {
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
    let model = match DirtyModel::fit_bounded(&obs, total_pages as f64) {
        Ok(m) => m,
        Err(e) => return json!({"fitted": false, "why": e.to_string(), "observations": obs}),
    };
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
            let cmp = compare(&p, &measured);
            json!({"fitted": true, "fit_source": source, "m": model.m, "tau_s": model.tau, "observations": obs,
                   "bandwidth_pages_per_s": bw, "predicted": p, "comparison": cmp})
        }
        Err(e) => {
            json!({"fitted": true, "m": model.m, "tau_s": model.tau, "predict_error": e.to_string()})
        }
    }
}

/// Watches the guest dirty memory for about `window` and predicts a migration at
/// `bandwidth_pages_per_s`: the dry run behind `kumo migrate --dry-run`.
pub fn estimate(
    vm: &RunningVm,
    window: Duration,
    bandwidth_pages_per_s: f64,
    policy: StopPolicy,
) -> Result<Value, String> {
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
        Ok(json!({"dry_run": true, "m": model.m, "tau_s": model.tau, "observations": obs, "touched_pages": touched,
                  "bandwidth_pages_per_s": bandwidth_pages_per_s, "predicted": p}))
    })();
    let _ = vm.vm().stop_dirty_log();
    r
}

/// The migration a VM's API is running or last ran.
#[derive(Default)]
pub struct MigrationJob {
    state: Mutex<JobState>,
}

#[derive(Default)]
struct JobState {
    running: bool,
    events: Vec<Event>,
    report: Option<Value>,
    error: Option<String>,
}

impl MigrationJob {
    pub fn status(&self) -> Value {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = match (s.running, &s.report, &s.error) {
            (true, _, _) => "running",
            (false, Some(_), _) => "completed",
            (false, None, Some(_)) => "failed",
            _ => "none",
        };
        json!({"state": state, "events": s.events, "report": s.report, "error": s.error})
    }

    /// Runs a migration of `vm` to completion. Only one at a time.
    pub fn run(&self, vm: &Arc<RunningVm>, req: &MigrateRequest) -> Result<Value, JobError> {
        let (to, opts) = options(req).map_err(JobError::BadRequest)?;
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if s.running {
                return Err(JobError::Busy);
            }
            *s = JobState { running: true, ..Default::default() };
        }
        let result = if req.dry_run {
            let bw = loopback_pages_per_s();
            estimate(vm, Duration::from_millis(req.estimate_ms.unwrap_or(2000).clamp(100, 60_000)), bw, opts.policy)
        } else if let Err(e) = vm.begin_migration() {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.running = false;
            return Err(JobError::Conflict(e.to_string()));
        } else {
            let total_pages = vm.config().memory / 4096;
            let mut opts = opts;
            // The stop phase's cost is measured only after the VM's state has gone out, so no
            // migration can hand its measurement on yet: each starts from the engine's prior.
            opts.policy.stop_phase = StopPhaseModel::with_prior(kumo_migration_engine::STOP_PHASE_PRIOR);
            let r = migrate(&**vm, &to, &opts, &mut |e| {
                tracing::info!(?e, "migration");
                self.state.lock().unwrap_or_else(|p| p.into_inner()).events.push(e);
            })
            .map(|r| {
                let mut v = serde_json::to_value(&r).unwrap_or(Value::Null);
                v["model"] = model_report(&r, opts.policy, total_pages);
                v["to"] = json!(to.to_string());
                v["arrived_paused"] = json!(vm.paused_by_user());
                // The VM runs at the destination now; this copy stops (before the run state
                // goes back to the user, so nothing can resume it in between).
                vm.finish_migrated(to.to_string());
                v
            })
            .map_err(|e| e.to_string());
            vm.end_migration();
            r
        };
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.running = false;
        match result {
            Ok(v) => {
                s.report = Some(v.clone());
                Ok(v)
            }
            Err(e) => {
                s.error = Some(e.clone());
                Err(JobError::Failed(e))
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
}

/// This host's loopback TCP throughput in pages/s, measured by sending 64 MiB to ourselves:
/// the bandwidth a dry run assumes for a local destination.
pub fn loopback_pages_per_s() -> f64 {
    kumo_migration_engine::transport::loopback_tcp_bytes_per_s(64 << 20, 1 << 20)
        .map(|b| b / 4096.0)
        .unwrap_or(250_000.0)
}
