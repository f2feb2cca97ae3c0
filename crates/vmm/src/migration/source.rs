//! The VM as a migration source, and the API's migration job.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_api::{MigrateRequest, MigrationEngine, MigrationLine};
use kumo_migration::format::VmDescription;
use kumo_migration::model::{compare, predict, DirtyModel, PredictParams};
use kumo_migration::planner::{RoundStats, StopPolicy, XenRule};
use kumo_migration::PageBitmap;
use kumo_migration::StopPhaseModel;
use kumo_migration_engine::{
    migrate, Address, BoxError, CancelToken, Event, MigrateError, MigrateOptions, Report, SourceVm, VmError, VmOp,
};
use kumo_vm::GuestMemory;

use crate::vmm::RunningVm;

use super::*;

impl SourceVm for RunningVm {
    fn description(&self) -> VmDescription {
        let mut d = describe(self.config(), self.vm().memory.layout.ram().to_vec());
        for (k, (_, _, size)) in d.disks.iter_mut().zip(self.disk_images()) {
            k.size = size;
        }
        d
    }
    fn memory(&self) -> &GuestMemory {
        RunningVm::memory(self)
    }
    fn memfd(&self) -> BorrowedFd<'_> {
        RunningVm::memfd(self).as_fd()
    }
    fn start_dirty_log(&self) -> Result<(), VmError> {
        RunningVm::start_dirty_log(self).map_err(|e| VmError::new(VmOp::StartDirtyLog, e))
    }
    fn stop_dirty_log(&self) {
        RunningVm::stop_dirty_log(self)
    }
    fn first_round_pages(&self) -> Result<PageBitmap, VmError> {
        self.vm().first_round_pages().map_err(|e| VmError::new(VmOp::TouchedPages, e))
    }
    fn harvest_dirty(&self, into: &mut PageBitmap) -> Result<u64, VmError> {
        RunningVm::harvest_dirty(self, into).map_err(|e| VmError::new(VmOp::FetchDirty, e))
    }
    fn rearm_dirty(&self, gfns: &[u64]) -> Result<(), VmError> {
        self.vm().rearm_dirty(gfns).map_err(|e| VmError::new(VmOp::RearmDirty, e))
    }
    fn pause(&self) -> Result<(), VmError> {
        self.migration_pause().map_err(|e| VmError::new(VmOp::Pause, e))?;
        // Every request the guest made is on the images, and on stable storage, before the
        // stop phase ends; external backends stop their rings (their positions are state).
        if let Err(e) = self.quiesce_disks().and_then(|()| self.suspend_backends(true)) {
            let _ = self.suspend_backends(false);
            let _ = self.migration_resume();
            return Err(VmError::new(VmOp::Pause, e));
        }
        // From here frames go to the destination's tap queues, which wait until it runs.
        self.set_taps_attached(false);
        Ok(())
    }
    fn resume(&self) -> Result<(), VmError> {
        // A failed migration: the images are ours again before the guest runs (if the
        // destination still holds one, the VM stays paused).
        self.lock_disks(true).map_err(|e| VmError::new(VmOp::Resume, e))?;
        self.suspend_backends(false).map_err(|e| VmError::new(VmOp::Resume, e))?;
        self.set_taps_attached(true);
        self.migration_resume().map_err(|e| VmError::new(VmOp::Resume, e))
    }
    fn save_state(&self) -> Result<Vec<u8>, VmError> {
        let err = |e: BoxError| VmError { op: VmOp::SaveState, source: e };
        let s = RunningVm::save_state(self).map_err(|e| err(e.into()))?;
        let s = serde_json::to_vec(&s).map_err(|e| err(e.into()))?;
        // The commit follows: the destination locks the images when it restores this state.
        self.lock_disks(false).map_err(|e| err(e.into()))?;
        Ok(s)
    }
    fn set_throttle(&self, percent: u32) {
        RunningVm::set_throttle(self, percent)
    }
    fn peek_dirty_count(&self) -> Option<u64> {
        self.vm().peek_dirty_count().ok().flatten()
    }
}

/// The lowest bandwidth cap taken, bytes/s: below it a 4 MiB batch takes seconds and the
/// progress deadline of a slow destination would be hard to tell from the cap.
pub const MIN_BANDWIDTH: u64 = 1_000_000;

/// The downtime target of a migration that names none (beside Xen's rule, first to fire
/// wins): a pause a guest's users hardly notice, where QEMU's default allows 300 ms.
pub const DEFAULT_DOWNTIME_MS: u64 = 50;

/// The stop rules a request asks for: kumo's default (Xen's rule beside a
/// [`DEFAULT_DOWNTIME_MS`] target) when it names none, exactly those it names otherwise (`xen:
/// false` alone keeps the default target, so that some rule remains).
fn stop_rules(xen: Option<bool>, downtime_ms: Option<u64>) -> (bool, Option<Duration>) {
    let default = Some(Duration::from_millis(DEFAULT_DOWNTIME_MS));
    match (xen, downtime_ms) {
        (None, None) => (true, default),
        (Some(x), None) => (x, if x { None } else { default }),
        (x, Some(ms)) => (x.unwrap_or(false), Some(Duration::from_millis(ms))),
    }
}

/// Turns an API request into migration options.
pub fn options(req: &MigrateRequest) -> Result<(Address, MigrateOptions), String> {
    let to: Address = req.to.parse()?;
    let engine = req.engine.unwrap_or(MigrationEngine::default_for(req.tls_dir.is_some()));
    let (xen, downtime) = stop_rules(req.xen, req.downtime_ms);
    let connections = req.connections.unwrap_or(engine.default_connections());
    let max = kumo_migration::format::MAX_CONNECTIONS as usize;
    if !(1..=max).contains(&connections) {
        return Err(format!("connections must be 1..={max}, not {connections}"));
    }
    if engine == MigrationEngine::Serial && connections > 1 {
        return Err("the serial engine sends one batch at a time on one connection: use connections 1".into());
    }
    if let Some(b) = req.max_bandwidth.filter(|&b| b < MIN_BANDWIDTH) {
        return Err(format!("max_bandwidth must be at least {MIN_BANDWIDTH} bytes/s (1M), not {b}"));
    }
    let tls = match (&req.tls_dir, &req.tls_server_name) {
        (Some(dir), name) => {
            Some(kumo_migration_engine::ClientTls::from_dir(std::path::Path::new(dir), name.as_deref())?)
        }
        (None, Some(_)) => return Err("tls_server_name needs tls_dir".into()),
        (None, None) => None,
    };
    if tls.is_some() {
        if engine == MigrationEngine::Zerocopy {
            return Err(kumo_migration_engine::source::ZEROCOPY_TLS.into());
        }
        if let Address::Unix(_) = to {
            return Err(kumo_migration_engine::transport::TLS_UNIX.into());
        }
    }
    let mut opts = MigrateOptions { engine, connections, max_bandwidth: req.max_bandwidth, tls, ..Default::default() };
    if let Some(ms) = req.progress_timeout_ms {
        if !(100..=3_600_000).contains(&ms) {
            return Err(format!("progress_timeout_ms must be 100..=3600000, not {ms}"));
        }
        opts.progress_timeout = Duration::from_millis(ms);
    }
    let strict = req.strict.unwrap_or(false);
    if strict && req.downtime_ms.is_none() {
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

/// Watches the guest dirty memory for about `window` and predicts a migration at
/// `bandwidth_pages_per_s`: the dry run behind `kumo migrate --dry-run`.
pub fn estimate(
    vm: &RunningVm,
    window: Duration,
    bandwidth_pages_per_s: f64,
    policy: StopPolicy,
) -> Result<DryRunReport, String> {
    vm.vm().start_dirty_log().map_err(|e| e.to_string())?;
    // Off again however the dry run ends (a panic included).
    struct DirtyLogOff<'a>(&'a RunningVm);
    impl Drop for DirtyLogOff<'_> {
        fn drop(&mut self) {
            let _ = self.0.vm().stop_dirty_log();
        }
    }
    let _off = DirtyLogOff(vm);
    let regions = vm.vm().memory.layout.ram().to_vec();
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
    pub fn stream(&self, sink: &mut dyn FnMut(&MigrationLine) -> bool) {
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
            for e in new {
                if !sink(&MigrationLine::Event(e)) {
                    return;
                }
            }
            if let Some(st) = ended {
                sink(&MigrationLine::End(st));
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
    /// time. A job that panics leaves the VM as it was and this job ready for the next
    /// (`RunStateLease`, `Running`); its caller contains the panic.
    pub fn run(&self, vm: &Arc<RunningVm>, req: &MigrateRequest) -> Result<MigrationStatus, JobError> {
        let (to, opts) = options(req).map_err(JobError::BadRequest)?;
        {
            let mut s = self.lock();
            if s.running {
                return Err(JobError::Busy);
            }
            *s = JobState { running: true, cancel: Some(opts.cancel.clone()), ..Default::default() };
        }
        // Marks the job ended even if it unwinds, so the next migration is not refused as busy.
        let running = Running { job: self, armed: true };
        let result = self.run_job(vm, req, &to, opts);
        running.disarm();
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                let mut s = self.lock();
                s.running = false;
                s.cancel = None;
                self.changed.notify_all();
                return Err(e);
            }
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

    /// The migration itself; `Err` only when it could not take the VM's run state.
    fn run_job(
        &self,
        vm: &Arc<RunningVm>,
        req: &MigrateRequest,
        to: &Address,
        opts: MigrateOptions,
    ) -> Result<Result<MigrationResult, MigrateError>, JobError> {
        if req.dry_run {
            let bw = if req.measure_link { loopback_pages_per_s() } else { ASSUMED_LINK_PAGES_PER_S };
            let window = Duration::from_millis(req.estimate_ms.unwrap_or(2000).clamp(100, 60_000));
            return Ok(estimate(vm, window, bw, opts.policy).map(MigrationResult::DryRun).map_err(MigrateError::Other));
        }
        // Given back however the job ends; unless settled (the engine returned: it has put the
        // VM where it belongs), dropping it also resumes a VM the job paused, until the VM's
        // state has been committed to the destination.
        let mut lease = vm.lease_run_state().map_err(|e| JobError::Conflict(e.to_string()))?;
        let token = opts.cancel.clone();
        lease.committed_when(move || token.is_committed());
        let total_pages = vm.config().memory / 4096;
        let mut opts = opts;
        // The stop phase's cost is measured only after the VM's state has gone out, so no
        // migration can hand its measurement on yet: each starts from the engine's prior.
        opts.policy.stop_phase = StopPhaseModel::with_prior(kumo_migration_engine::STOP_PHASE_PRIOR);
        let r = migrate(&**vm, to, &opts, &mut |e| {
            if !matches!(e, Event::Progress { .. }) {
                tracing::info!(?e, "migration");
            }
            let round = matches!(e, Event::Round { .. });
            self.lock().events.push(e);
            self.changed.notify_all();
            // After the first round dirty logging is on and the destination holds part of
            // the guest: a job that panics here must leave the VM running and migratable.
            if round && kumo_sandbox::test_hook_once("panic:migration") {
                panic!("test hook panic:migration: the migration job panics on purpose");
            }
        })
        .map(|r| {
            let model = model_report(&r, opts.policy, total_pages);
            let arrived_paused = vm.paused_by_user();
            // The VM runs at the destination now; this copy stops (before the run state goes
            // back to the user, so nothing can resume it in between).
            vm.finish_migrated(to.to_string());
            MigrationResult::Migrated(Box::new(SendReport { report: r, model, to: to.to_string(), arrived_paused }))
        });
        lease.settle();
        Ok(r)
    }
}

/// A migration job in progress: if it unwinds, the job is marked failed and not running.
struct Running<'a> {
    job: &'a MigrationJob,
    armed: bool,
}

impl Running<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut s = self.job.lock();
        s.running = false;
        s.cancel = None;
        s.error = Some("the migration job panicked (a bug); the VM runs on here".into());
        self.job.changed.notify_all();
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

/// The link a dry run assumes unless asked to measure one (`measure_link`): 1 GB/s in pages/s.
pub const ASSUMED_LINK_PAGES_PER_S: f64 = 1e9 / 4096.0;

/// This host's loopback TCP throughput in pages/s, measured by sending 64 MiB to ourselves:
/// the bandwidth a dry run with `measure_link` predicts at (opt-in: it loads the host).
pub fn loopback_pages_per_s() -> f64 {
    kumo_migration_engine::transport::loopback_tcp_bytes_per_s(64 << 20, 1 << 20)
        .map(|b| b / 4096.0)
        .unwrap_or(ASSUMED_LINK_PAGES_PER_S)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_stop_rules_apply_only_when_none_is_named() {
        let ms = |v| Some(Duration::from_millis(v));
        assert_eq!(stop_rules(None, None), (true, ms(DEFAULT_DOWNTIME_MS)));
        assert_eq!(stop_rules(Some(true), None), (true, None), "Xen's rule alone");
        assert_eq!(stop_rules(Some(false), None), (false, ms(DEFAULT_DOWNTIME_MS)));
        assert_eq!(stop_rules(None, Some(30)), (false, ms(30)));
        assert_eq!(stop_rules(Some(true), Some(30)), (true, ms(30)));
    }

    #[test]
    fn engine_and_connections_default_by_transport_and_engine() {
        let (_, o) = options(&MigrateRequest::to("tcp:127.0.0.1:4444")).unwrap();
        assert_eq!((o.engine, o.connections), (MigrationEngine::Zerocopy, 4));
        let req = MigrateRequest { engine: Some(MigrationEngine::Serial), ..MigrateRequest::to("unix:/x.sock") };
        assert_eq!(options(&req).unwrap().1.connections, 1);
        let e = options(&MigrateRequest { strict: Some(true), ..MigrateRequest::to("tcp:127.0.0.1:1") }).unwrap_err();
        assert!(e.contains("strict needs downtime_ms"), "{e}");
    }
}
