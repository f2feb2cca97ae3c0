//! `kumo bench lend`: elastic, exclusive sharing (issue 13, seed 002 part 2). Two VMs run the
//! `worker` guest, both built at full size on paper (3 vCPUs, 512 MiB): A holds host CPU c1 and
//! all 256 MiB of its elastic memory, B holds host CPU c0 and 128 of its 256 MiB; vCPU 2 of each
//! is a parked spare. Measured, with [`kumo_elastic::lend::lend`] (the `kumo lend` coordinator):
//! - **CPU**: N cycles of lending 1 CPU A -> B (from the command to B's new vCPU confirmed doing
//!   a work unit) and returning it; then the same through `PUT vm.lend` (the lender's VMM
//!   coordinates: one client call instead of two).
//! - **Memory**: N cycles of lending 128 MiB A -> B (to B's guest using it) and returning it.
//! - **Throughput**: a few dedicated cycles hold the CPU for a while, giving B's units/s before
//!   the lend and while it holds the lent CPU, from both VMs' work units (vm.elastic
//!   `progress`) sampled every ~20 ms around those cycles (not during the latency series, which
//!   the polling would disturb).
//! - **Baseline**: pausing and resuming B's whole vCPU set (vm.pause + vm.resume). kumo has no
//!   vCPU hot-unplug path, so there is no hot-unplug row.
//! - **Overlaps**: both VMs' records of every change (vm.elastic `events`) checked by
//!   [`kumo_elastic::record::check`]: no host CPU or memory held by both at any instant.
//! - **Linux** ([`linux`]): afterwards, memory lent between two Linux guests through virtio-mem
//!   (the test kernel's own driver), N cycles; the worker rows above are its baseline (kumo's
//!   guests, the mailbox path). Skipped, saying so, without the test kernel.
//!
//! Writes lend.json (every sample, every cycle's report) and lend.png; ends with
//! `cpu_lend_p99_ms=X cpu_lend_max_ms=M mem_lend_p99_ms=Y overlaps=Z linux_mem_lend_p50_ms=A
//! linux_mem_lend_p99_ms=B`. Every series has 100 cycles, with `--quick` too: a nearest-rank p99
//! of fewer is the slowest cycle (`max`, which the table and the last line also give).

mod linux;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_api::{ApiClient, ElasticEvent, ElasticEventKind};
use kumo_elastic::lend::{lend, LendReport, LendRequest};
use serde::Serialize;

use crate::net::stats::percentile;
use kumo_testkit::net as host;
use kumo_testkit::Kid;

#[derive(clap::Args)]
pub struct Args {
    /// Fewer held lends (3) and Linux lends (3 of 16 MiB): about 2 minutes. The series keep
    /// their 100 cycles: a p99 of fewer is the slowest cycle (it used to be 30).
    #[arg(long)]
    quick: bool,
    /// Lend/return cycles of each series (CPU, memory, pause/resume) [default: 100].
    #[arg(long)]
    cycles: Option<u64>,
    /// Cycles that hold the lent CPU for `--hold-ms`, for B's throughput [default: 5, 3 with --quick].
    #[arg(long)]
    holds: Option<u64>,
    /// How long those cycles hold the lent CPU (and wait before lending), ms.
    #[arg(long, default_value_t = 300)]
    hold_ms: u64,
    /// How long each guest has to confirm a request, ms.
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// Lend/return cycles between the two Linux guests (virtio-mem) [default: 10, 3 with --quick].
    #[arg(long)]
    linux_cycles: Option<u64>,
    /// MiB each Linux lend moves, a multiple of 4 up to 256 [default: 128, 16 with --quick].
    #[arg(long)]
    linux_mib: Option<u64>,
    /// Leave out the Linux row (it boots two Linux VMs: a minute or more here).
    #[arg(long)]
    no_linux: bool,
}

const MIB: u64 = 1 << 20;
const MEM_LEND: u64 = 128 * MIB;
const LIMIT: Duration = Duration::from_secs(120);
/// Sampling period of the progress thread.
const SAMPLE: Duration = Duration::from_millis(20);
/// Between two requests of a series: lets the guests settle and keeps the marks apart.
const GAP: Duration = Duration::from_millis(10);
/// Lend/return cycles of each kind run before measuring.
const WARMUP: u64 = 5;

/// One progress sample of one VM.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    /// "a" or "b".
    vm: &'static str,
    /// Seconds since the bench's start.
    t_s: f64,
    /// Work units per vCPU, and their sum.
    progress: Vec<u64>,
    units: u64,
}

/// One lend or return, as the coordinator reported it.
#[derive(Debug, Clone, Serialize)]
struct Op {
    /// cpu-lend, cpu-return, mem-lend, mem-return.
    kind: &'static str,
    /// When the command was given, seconds since the bench's start.
    t_s: f64,
    /// From the command to the borrower's confirmation.
    total_ms: f64,
    released_guest_ms: f64,
    released_total_ms: f64,
    acquired_guest_ms: f64,
    acquired_total_ms: f64,
    host_cpus: Vec<u32>,
    vcpus: Vec<u32>,
    bytes: u64,
    /// The vm.release and vm.acquire calls as the bench saw them (connect to answer).
    release_call_ms: f64,
    acquire_call_ms: f64,
    /// The vm.release call's start and answer, CLOCK_MONOTONIC ns (the clock of the VMs' records).
    release_start_ns: u64,
    release_end_ns: u64,
    /// From the release call's start to the lender's record of the release (parked / discarded),
    /// and from that record to the answer at the bench.
    release_recorded_ms: Option<f64>,
    release_answered_ms: Option<f64>,
}

impl Op {
    fn new(kind: &'static str, t_s: f64, r: &LendReport) -> Op {
        Op {
            kind,
            t_s,
            total_ms: r.total_ms,
            released_guest_ms: r.released.guest_ms,
            released_total_ms: r.released.total_ms,
            acquired_guest_ms: r.acquired.guest_ms,
            acquired_total_ms: r.acquired.total_ms,
            host_cpus: r.released.host_cpus.clone(),
            vcpus: r.acquired.vcpus.clone(),
            bytes: r.released.memory.map_or(0, |m| m.bytes),
            release_call_ms: 0.0,
            acquire_call_ms: 0.0,
            release_start_ns: 0,
            release_end_ns: 0,
            release_recorded_ms: None,
            release_answered_ms: None,
        }
    }
}

/// A VM's API as the coordinator's peer, timing each call from the bench's side.
struct Timed<'a> {
    api: &'a ApiClient,
    release_ms: std::cell::Cell<f64>,
    acquire_ms: std::cell::Cell<f64>,
    release_ns: std::cell::Cell<(u64, u64)>,
}

impl<'a> Timed<'a> {
    fn new(api: &'a ApiClient) -> Self {
        Timed { api, release_ms: Default::default(), acquire_ms: Default::default(), release_ns: Default::default() }
    }
}

impl kumo_elastic::lend::Peer for Timed<'_> {
    fn name(&self) -> String {
        kumo_elastic::lend::Peer::name(self.api)
    }
    fn release(&self, req: &kumo_api::ReleaseRequest) -> Result<kumo_api::Released, String> {
        let (t, ns) = (Instant::now(), kumo_vmm::vmm::monotonic_ns());
        let r = kumo_elastic::lend::Peer::release(self.api, req);
        self.release_ms.set(t.elapsed().as_secs_f64() * 1e3);
        self.release_ns.set((ns, kumo_vmm::vmm::monotonic_ns()));
        r
    }
    fn acquire(&self, req: &kumo_api::AcquireRequest) -> Result<kumo_api::Acquired, String> {
        let t = Instant::now();
        let r = kumo_elastic::lend::Peer::acquire(self.api, req);
        self.acquire_ms.set(t.elapsed().as_secs_f64() * 1e3);
        r
    }
}

/// A cycle that held the lent CPU: B's units/s before the lend and while holding it.
#[derive(Debug, Clone, Serialize)]
struct Hold {
    lend_t_s: f64,
    return_t_s: f64,
    b_before_per_s: Option<f64>,
    b_holding_per_s: Option<f64>,
    a_before_per_s: Option<f64>,
    a_holding_per_s: Option<f64>,
}

/// One pause + resume of B.
#[derive(Debug, Clone, Serialize)]
struct PauseResume {
    pause_ms: f64,
    resume_ms: f64,
}

/// p50/p99 and the slowest of a series, ms (p99 is nearest-rank: below 100 values it is the
/// slowest too).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
struct Pct {
    n: usize,
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
}

impl Pct {
    fn of(v: &[f64]) -> Pct {
        Pct { n: v.len(), p50: percentile(v, 50.0), p99: percentile(v, 99.0), max: v.iter().copied().reduce(f64::max) }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
struct Summary {
    cpu_lend_ms: Pct,
    cpu_return_ms: Pct,
    /// The same through `PUT vm.lend` on the lender (its VMM coordinates; one client call).
    vmm_cpu_lend_ms: Pct,
    vmm_cpu_return_ms: Pct,
    /// The borrower's part of a CPU lend: vm.acquire until its guest confirmed work.
    cpu_lend_guest_ms: Pct,
    cpu_release_guest_ms: Pct,
    mem_lend_ms: Pct,
    mem_return_ms: Pct,
    pause_ms: Pct,
    resume_ms: Pct,
    pause_resume_ms: Pct,
    /// Diagnostics: an API round trip (`GET vmm.ping` to B) from the lending thread, and the
    /// part of a CPU lend outside both VMMs' handlers (total - release - acquire): transport.
    api_ping_ms: Pct,
    cpu_lend_outside_ms: Pct,
    /// The vm.release (on A) and vm.acquire (on B) calls of a CPU lend beyond their handlers.
    cpu_release_call_extra_ms: Pct,
    cpu_acquire_call_extra_ms: Pct,
    /// A CPU lend's vm.release on A: from the call to A's record of the CPU released, and from
    /// that record to the answer at the bench.
    cpu_release_recorded_ms: Pct,
    cpu_release_answered_ms: Pct,
    /// B's units/s before a lend and while it holds the lent CPU (means over the held cycles).
    b_before_per_s: Option<f64>,
    b_holding_per_s: Option<f64>,
    b_ratio: Option<f64>,
    overlaps_cpu: usize,
    overlaps_memory: usize,
    overlaps: Option<usize>,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    command: String,
    /// The host CPUs A and B hold at boot.
    host_cpu_a: u32,
    host_cpu_b: u32,
    argv_a: Vec<String>,
    argv_b: Vec<String>,
    cycles: u64,
    /// The bench's lending thread ran at SCHED_FIFO priority, as `kumo lend` does.
    coordinator_realtime: bool,
    summary: Summary,
    cpu: Vec<Op>,
    mem: Vec<Op>,
    /// CPU lends and returns through `PUT vm.lend` (the lender's VMM coordinates).
    vmm_cpu: Vec<Op>,
    holds: Vec<Hold>,
    pause_resume: Vec<PauseResume>,
    api_ping_ms: Vec<f64>,
    overlap_details: Vec<String>,
    /// Both VMs' records (vm.elastic `events`) at the end.
    events_a: Vec<ElasticEvent>,
    events_b: Vec<ElasticEvent>,
    samples: Vec<Sample>,
    errors: Vec<String>,
    /// Two Linux guests lending memory through virtio-mem (after the rows above).
    linux: linux::Row,
}

/// A running elastic VM: its kumo process (killed when dropped) and API.
struct Vm {
    name: &'static str,
    proc: Kid,
    api: ApiClient,
    argv: Vec<String>,
}

impl Vm {
    fn start(dir: &Path, name: &'static str, elastic: &str, tag: u32) -> Result<Vm, String> {
        let sock = dir.join(format!("{name}.sock"));
        let argv: Vec<String> = [
            crate::kumo_binary()?.display().to_string(),
            "--api-socket".into(),
            sock.display().to_string(),
            "run".into(),
            "--timeout".into(),
            "0".into(),
            "--cpus".into(),
            "3".into(),
            "--memory".into(),
            "512M".into(),
            "--elastic".into(),
            elastic.into(),
            "--guest".into(),
            "worker".into(),
            "bsp_work=0".into(),
            "report=0".into(),
            "quiet=1".into(),
            format!("tag={tag}"),
        ]
        .into();
        let mut proc = Kid::start_in(None, &argv)?;
        // One connection for the whole run (as a control plane would keep): no connect and no
        // new server thread per request.
        let api = ApiClient::new(&sock).keep_alive();
        let t = Instant::now();
        while api.ping().is_err() {
            if t.elapsed() > LIMIT {
                return Err(proc.why("did not answer on its API socket"));
            }
            if let Ok(Some(code)) = proc.try_exit() {
                return Err(proc.why(&format!("exited ({code}) before its API came up")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Vm { name, proc, api, argv })
    }

    fn units(&self) -> Result<u64, String> {
        let i = self.api.elastic().map_err(|e| format!("{}: vm.elastic: {e}", self.name))?;
        Ok(i.progress.iter().sum())
    }

    /// Waits until the guest has done `more` units past what it has done now.
    fn wait_units(&self, more: u64) -> Result<(), String> {
        let t = Instant::now();
        let first = self.units()?;
        while self.units()? < first + more {
            if t.elapsed() > LIMIT {
                return Err(self.proc.why(&format!("{}'s guest did not do {more} units", self.name)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The console (stdout) and kumo's stderr, for a failure report.
    fn output(&self) -> String {
        let out: Vec<String> = self.proc.lines().into_iter().map(|(_, l)| l).collect();
        format!(
            "--- {} console ---\n{}\n--- {} stderr ---\n{}\n",
            self.name,
            out.join("\n"),
            self.name,
            self.proc.stderr()
        )
    }
}

/// The first two online host CPUs (B holds the first, A the second), from
/// /sys/devices/system/cpu/online ("0-3,6").
fn two_cpus(online: &str) -> Option<(u32, u32)> {
    let cpus = kumo_vmm::placement::parse_cpu_set(online).ok()?;
    (cpus.len() >= 2).then(|| (cpus[0], cpus[1]))
}

/// Units per second of one VM between `from` and `to` (seconds): the growth between the first
/// sample at or after `from` and the last one at or before `to`; None with fewer than two
/// samples in the window.
fn rate(samples: &[Sample], vm: &str, from: f64, to: f64) -> Option<f64> {
    let mut w = samples.iter().filter(|s| s.vm == vm && s.t_s >= from && s.t_s <= to);
    let first = w.next()?;
    let last = w.next_back()?;
    let dt = last.t_s - first.t_s;
    (dt > 0.0).then(|| last.units.saturating_sub(first.units) as f64 / dt)
}

/// Throughput over time of one VM: units/s between consecutive samples, at their midpoint.
fn series(samples: &[Sample], vm: &str) -> Vec<(f64, f64)> {
    let mine: Vec<&Sample> = samples.iter().filter(|s| s.vm == vm).collect();
    mine.windows(2)
        .filter(|w| w[1].t_s > w[0].t_s)
        .map(|w| ((w[0].t_s + w[1].t_s) / 2.0, w[1].units.saturating_sub(w[0].units) as f64 / (w[1].t_s - w[0].t_s)))
        .collect()
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = v.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Fills the per-hold throughputs from the samples and computes the summary.
/// Places each op's release in the lender's record: the first cpu-released (mem-released)
/// event of the lender within the release call.
fn place_releases(ops: &mut [Op], events_a: &[ElasticEvent], events_b: &[ElasticEvent]) {
    for o in ops {
        let (events, kind) = match o.kind {
            "cpu-lend" => (events_a, ElasticEventKind::CpuReleased),
            "cpu-return" => (events_b, ElasticEventKind::CpuReleased),
            "mem-lend" => (events_a, ElasticEventKind::MemReleased),
            _ => (events_b, ElasticEventKind::MemReleased),
        };
        let at = events.iter().find(|e| e.kind == kind && (o.release_start_ns..=o.release_end_ns).contains(&e.t_ns));
        if let Some(e) = at {
            o.release_recorded_ms = Some((e.t_ns - o.release_start_ns) as f64 / 1e6);
            o.release_answered_ms = Some((o.release_end_ns - e.t_ns) as f64 / 1e6);
        }
    }
}

fn finish(r: &mut Report, hold_s: f64) {
    place_releases(&mut r.cpu, &r.events_a, &r.events_b);
    place_releases(&mut r.mem, &r.events_a, &r.events_b);
    place_releases(&mut r.vmm_cpu, &r.events_a, &r.events_b);
    // Windows: the hold_s before the lend; while holding, from 50 ms after the lend was
    // confirmed (the new vCPU is up) to the return's command.
    for h in &mut r.holds {
        let lent = r.cpu.iter().find(|o| o.kind == "cpu-lend" && (o.t_s - h.lend_t_s).abs() < 1e-9);
        let from = h.lend_t_s + lent.map_or(0.0, |o| o.total_ms / 1e3) + 0.05;
        h.b_before_per_s = rate(&r.samples, "b", h.lend_t_s - hold_s, h.lend_t_s);
        h.a_before_per_s = rate(&r.samples, "a", h.lend_t_s - hold_s, h.lend_t_s);
        h.b_holding_per_s = rate(&r.samples, "b", from, h.return_t_s);
        h.a_holding_per_s = rate(&r.samples, "a", from, h.return_t_s);
    }
    let ms = |ops: &[Op], kind: &str, f: fn(&Op) -> f64| -> Vec<f64> {
        ops.iter().filter(|o| o.kind == kind).map(f).collect()
    };
    let s = &mut r.summary;
    s.cpu_lend_ms = Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.total_ms));
    s.cpu_return_ms = Pct::of(&ms(&r.cpu, "cpu-return", |o| o.total_ms));
    s.cpu_lend_guest_ms = Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.acquired_guest_ms));
    s.cpu_release_guest_ms = Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.released_guest_ms));
    s.vmm_cpu_lend_ms = Pct::of(&ms(&r.vmm_cpu, "cpu-lend", |o| o.total_ms));
    s.vmm_cpu_return_ms = Pct::of(&ms(&r.vmm_cpu, "cpu-return", |o| o.total_ms));
    s.mem_lend_ms = Pct::of(&ms(&r.mem, "mem-lend", |o| o.total_ms));
    s.mem_return_ms = Pct::of(&ms(&r.mem, "mem-return", |o| o.total_ms));
    s.pause_ms = Pct::of(&r.pause_resume.iter().map(|p| p.pause_ms).collect::<Vec<_>>());
    s.resume_ms = Pct::of(&r.pause_resume.iter().map(|p| p.resume_ms).collect::<Vec<_>>());
    s.api_ping_ms = Pct::of(&r.api_ping_ms);
    s.cpu_lend_outside_ms =
        Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.total_ms - o.released_total_ms - o.acquired_total_ms));
    s.cpu_release_call_extra_ms = Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.release_call_ms - o.released_total_ms));
    s.cpu_acquire_call_extra_ms = Pct::of(&ms(&r.cpu, "cpu-lend", |o| o.acquire_call_ms - o.acquired_total_ms));
    let some = |ops: &[Op], f: fn(&Op) -> Option<f64>| -> Vec<f64> {
        ops.iter().filter(|o| o.kind == "cpu-lend").filter_map(f).collect()
    };
    s.cpu_release_recorded_ms = Pct::of(&some(&r.cpu, |o| o.release_recorded_ms));
    s.cpu_release_answered_ms = Pct::of(&some(&r.cpu, |o| o.release_answered_ms));
    s.pause_resume_ms = Pct::of(&r.pause_resume.iter().map(|p| p.pause_ms + p.resume_ms).collect::<Vec<_>>());
    // Means over the cycles where both windows had samples.
    let both: Vec<(f64, f64)> = r.holds.iter().filter_map(|h| Some((h.b_before_per_s?, h.b_holding_per_s?))).collect();
    s.b_before_per_s = mean(both.iter().map(|p| p.0));
    s.b_holding_per_s = mean(both.iter().map(|p| p.1));
    s.b_ratio = match (s.b_before_per_s, s.b_holding_per_s) {
        (Some(b), Some(h)) if b > 0.0 => Some(h / b),
        _ => None,
    };
}

fn headline(r: &Report) -> String {
    let f = |v: Option<f64>| v.map_or("na".to_string(), |v| format!("{v:.3}"));
    format!(
        "cpu_lend_p99_ms={} cpu_lend_max_ms={} mem_lend_p99_ms={} overlaps={} linux_mem_lend_p50_ms={} linux_mem_lend_p99_ms={}",
        f(r.summary.cpu_lend_ms.p99),
        f(r.summary.cpu_lend_ms.max),
        f(r.summary.mem_lend_ms.p99),
        r.summary.overlaps.map_or("na".to_string(), |o| o.to_string()),
        f(r.linux.lend_ms.p50),
        f(r.linux.lend_ms.p99),
    )
}

fn table(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let m = &r.summary;
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let _ = writeln!(
        s,
        "\nkumo bench lend: two worker VMs (3 vCPUs, 512 MiB each); A holds host CPU {}, B host CPU {}",
        r.host_cpu_a, r.host_cpu_b
    );
    let _ = writeln!(s, "{:<58} {:>6} {:>10} {:>10} {:>10}", "", "n", "p50 ms", "p99 ms", "max ms");
    let _ = writeln!(s, "kumo's worker guests, the mailbox path (the baseline for the Linux rows below):");
    let rows: [(&str, Pct); 11] = [
        ("CPU lend A->B (command -> B's new vCPU did work)", m.cpu_lend_ms),
        ("  of which A's guest vacating", m.cpu_release_guest_ms),
        ("  of which B's guest confirming work", m.cpu_lend_guest_ms),
        ("CPU return B->A", m.cpu_return_ms),
        ("CPU lend A->B through PUT vm.lend (A's VMM coordinates)", m.vmm_cpu_lend_ms),
        ("CPU return B->A through PUT vm.lend on B", m.vmm_cpu_return_ms),
        ("128 MiB lend A->B (command -> B's guest uses it)", m.mem_lend_ms),
        ("128 MiB return B->A", m.mem_return_ms),
        ("baseline: vm.pause of B's whole vCPU set", m.pause_ms),
        ("baseline: vm.resume of B's whole vCPU set", m.resume_ms),
        ("baseline: pause + resume", m.pause_resume_ms),
    ];
    for (name, p) in rows {
        let _ = writeln!(s, "{name:<58} {:>6} {:>10} {:>10} {:>10}", p.n, f(p.p50), f(p.p99), f(p.max));
    }
    let _ = writeln!(s, "{:<58} {:>6} {:>10} {:>10} {:>10}", "baseline: vCPU hot-unplug", "-", "n/a", "n/a", "n/a");
    let _ = writeln!(s, "  (kumo has no vCPU hot-unplug path; pause/resume of all vCPUs is the baseline)");
    let diagnostics = [
        ("diagnostic: CPU lend outside both VMMs' handlers", m.cpu_lend_outside_ms),
        ("  vm.release call on A beyond its handler", m.cpu_release_call_extra_ms),
        ("  vm.release: call -> A's record of the CPU released", m.cpu_release_recorded_ms),
        ("  vm.release: A's record -> its answer at the bench", m.cpu_release_answered_ms),
        ("  vm.acquire call on B beyond its handler", m.cpu_acquire_call_extra_ms),
        ("diagnostic: one API round trip (GET vmm.ping to B)", m.api_ping_ms),
    ];
    for (name, p) in diagnostics {
        let _ = writeln!(s, "{name:<58} {:>6} {:>10} {:>10} {:>10}", p.n, f(p.p50), f(p.p99), f(p.max));
    }
    let g = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(
        s,
        "B's throughput over {} held lends: {} units/s before, {} units/s holding the lent CPU, ratio {}",
        r.holds.len(),
        g(m.b_before_per_s),
        g(m.b_holding_per_s),
        m.b_ratio.map_or("-".to_string(), |v| format!("{v:.2}"))
    );
    let _ = writeln!(
        s,
        "overlaps (a host CPU or memory held by both VMs at once, from their records; worker and Linux pairs): {} (workers: cpu {}, memory {})",
        m.overlaps.map_or("not checked".to_string(), |o| o.to_string()),
        m.overlaps_cpu,
        m.overlaps_memory
    );
    for d in &r.overlap_details {
        let _ = writeln!(s, "  overlap: {d}");
    }
    linux_rows(&mut s, &r.linux);
    for e in &r.errors {
        let _ = writeln!(s, "FAILED: {e}");
    }
    s
}

/// The Linux guests' rows of [`table`].
fn linux_rows(s: &mut String, l: &linux::Row) {
    use std::fmt::Write;
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(s, "Linux guests (test kernel, 1 vCPU, 512 MiB + a 256 MiB zone each), virtio-mem:");
    if let Some(why) = &l.skipped {
        let _ = writeln!(s, "  skipped: {why}");
        return;
    }
    let mib = l.bytes / MIB;
    let rows = [
        (format!("{mib} MiB lend A->B (command -> B's kernel plugged it)"), l.lend_ms),
        ("  of which A's kernel unplugging".to_string(), l.lend_unplug_ms),
        ("  of which B's kernel plugging".to_string(), l.lend_plug_ms),
        (format!("{mib} MiB return B->A"), l.return_ms),
        ("  of which B's kernel unplugging".to_string(), l.return_unplug_ms),
        ("  of which A's kernel plugging".to_string(), l.return_plug_ms),
    ];
    for (name, p) in rows {
        let _ = writeln!(s, "{name:<58} {:>6} {:>10} {:>10} {:>10}", p.n, f(p.p50), f(p.p99), f(p.max));
    }
    let _ = writeln!(
        s,
        "  (p99 is nearest-rank: with fewer than 100 cycles it is the slowest one; both drivers were up {} s after the VMs started)",
        l.ready_s.map_or("-".to_string(), |t| format!("{t:.0}"))
    );
    let _ = writeln!(
        s,
        "  overlaps in the Linux VMs' records: {}",
        l.overlaps.map_or("not checked".to_string(), |o| o.to_string())
    );
    for d in &l.overlap_details {
        let _ = writeln!(s, "  overlap: {d}");
    }
    if let Some(e) = &l.error {
        let _ = writeln!(s, "FAILED (Linux): {e}");
    }
}

fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let root = BitMapBackend::new(path, (1600, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let (top, bottom) = root.split_vertically(700);
    plot_lends(&bottom, r)?;
    let (a, b) = (series(&r.samples, "a"), series(&r.samples, "b"));
    let xmax = a.iter().chain(&b).map(|p| p.0).fold(1.0, f64::max);
    let ymax = a.iter().chain(&b).map(|p| p.1).fold(1.0, f64::max) * 1.15;
    let mut c = ChartBuilder::on(&top)
        .caption("worker throughput of VM A and VM B; lends and returns marked", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(e)?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("work units / s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    let marks: [(&str, RGBColor); 4] = [
        ("cpu-lend", RGBColor(220, 40, 40)),
        ("cpu-return", RGBColor(240, 160, 30)),
        ("mem-lend", RGBColor(40, 160, 60)),
        ("mem-return", RGBColor(140, 200, 140)),
    ];
    for (kind, col) in marks {
        let ts: Vec<f64> =
            r.cpu.iter().chain(&r.mem).chain(&r.vmm_cpu).filter(|o| o.kind == kind).map(|o| o.t_s).collect();
        for (i, t) in ts.iter().enumerate() {
            let s =
                c.draw_series(LineSeries::new([(*t, 0.0), (*t, ymax)], col.mix(0.35).stroke_width(1))).map_err(e)?;
            if i == 0 {
                s.label(kind).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], col.stroke_width(2)));
            }
        }
    }
    c.draw_series(LineSeries::new(a, BLUE.stroke_width(2)))
        .map_err(e)?
        .label("A")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    c.draw_series(LineSeries::new(b, BLACK.stroke_width(2)))
        .map_err(e)?
        .label("B")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// Every memory lend's time by cycle, log scale: the worker guests' mailbox path against the
/// Linux guests' virtio-mem.
fn plot_lends<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    r: &Report,
) -> Result<(), String> {
    use crate::plot_err as e;
    use plotters::prelude::*;
    let pts =
        |ops: Vec<f64>| -> Vec<(f64, f64)> { ops.into_iter().enumerate().map(|(i, v)| (i as f64 + 1.0, v)).collect() };
    let kinds = |k: &str| r.mem.iter().filter(|o| o.kind == k).map(|o| o.total_ms).collect::<Vec<_>>();
    let linux = |k: &str| r.linux.ops.iter().filter(|o| o.kind == k).map(|o| o.total_ms).collect::<Vec<_>>();
    let mib = r.linux.bytes / MIB;
    let lines = [
        ("worker (mailbox): 128 MiB lend".to_string(), pts(kinds("mem-lend")), RGBColor(40, 160, 60)),
        ("worker (mailbox): 128 MiB return".to_string(), pts(kinds("mem-return")), RGBColor(140, 200, 140)),
        (format!("Linux (virtio-mem): {mib} MiB lend"), pts(linux("linux-mem-lend")), RGBColor(200, 30, 30)),
        (format!("Linux (virtio-mem): {mib} MiB return"), pts(linux("linux-mem-return")), RGBColor(240, 150, 40)),
    ];
    let all = || lines.iter().flat_map(|l| l.1.iter());
    let xmax = all().map(|p| p.0).fold(2.0, f64::max);
    let ymin = all().map(|p| p.1).fold(f64::INFINITY, f64::min).clamp(0.01, 1.0) / 2.0;
    let ymax = all().map(|p| p.1).fold(10.0, f64::max) * 2.0;
    let mut c = ChartBuilder::on(area)
        .caption("memory lend time per cycle (command -> the borrower uses it), ms, log scale", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.5..xmax + 0.5, (ymin..ymax).log_scale())
        .map_err(e)?;
    c.configure_mesh()
        .x_desc("cycle")
        .y_desc("ms")
        .y_label_formatter(&|v| format!("{v}"))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    for (name, p, col) in lines {
        if p.is_empty() {
            continue;
        }
        c.draw_series(LineSeries::new(p.clone(), col.stroke_width(2))).map_err(e)?;
        c.draw_series(p.into_iter().map(|q| Circle::new(q, 3, col.filled())))
            .map_err(e)?
            .label(name)
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, col.filled()));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(e)
}

/// Samples both VMs' progress every [`SAMPLE`] while `on`, until `stop`.
fn sampler(
    socks: [(&'static str, ApiClient); 2],
    t0: Instant,
    (on, stop): (&AtomicBool, &AtomicBool),
    out: &Mutex<Vec<Sample>>,
) {
    let mut next = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let polled: &[_] = if on.load(Ordering::SeqCst) { &socks } else { &[] };
        for (vm, api) in polled {
            if let Ok(i) = api.elastic() {
                let s = Sample {
                    vm,
                    t_s: t0.elapsed().as_secs_f64(),
                    units: i.progress.iter().sum(),
                    progress: i.progress,
                };
                if let Ok(mut o) = out.lock() {
                    o.push(s);
                }
            }
        }
        next += SAMPLE;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
}

/// Waits until both workers have gone over all the memory they hold twice (64 KiB a unit): its
/// pages are in. A block given back to a guest is fresh host memory: its first touch allocates
/// and zeroes a 2 MiB page (~1.2 ms each here, nested), and a vacate that lands on such a unit
/// waits for it (ftrace: the CPU-lend tail after the warm-up's memory lends, issue 24).
fn swept(a: &Vm, b: &Vm) -> Result<(), String> {
    a.wait_units(2 * (256 << 20) / (64 << 10))?;
    b.wait_units(2 * (128 << 20) / (64 << 10))
}

/// The measured series, in order; stops at the first failure (which it returns).
struct Run<'a> {
    a: &'a Vm,
    b: &'a Vm,
    t0: Instant,
    timeout_ms: u64,
    cpu: Vec<Op>,
    mem: Vec<Op>,
    holds: Vec<Hold>,
    pause_resume: Vec<PauseResume>,
    api_ping_ms: Vec<f64>,
    vmm_cpu: Vec<Op>,
    /// Whether the sampler polls (during the held lends).
    sampling: &'a AtomicBool,
}

impl Run<'_> {
    /// A CPU lend or return coordinated by the lender's own VMM (`PUT vm.lend`); total_ms is
    /// the bench's call, from the command to the answer.
    fn vmm_step(&mut self, kind: &'static str) -> Result<(), String> {
        let returning = kind.ends_with("return");
        let (from, to) = if returning { (self.b, self.a) } else { (self.a, self.b) };
        let req = kumo_api::LendApiRequest {
            to: to.api.path().display().to_string(),
            cpus: 1,
            memory_bytes: 0,
            node: None,
            returning,
            timeout_ms: self.timeout_ms,
        };
        let t = self.t0.elapsed().as_secs_f64();
        let (start, ns) = (Instant::now(), kumo_vmm::vmm::monotonic_ns());
        let v = from.api.lend(&req).map_err(|e| format!("vm.lend {kind} {} -> {}: {e}", from.name, to.name))?;
        let total_ms = start.elapsed().as_secs_f64() * 1e3;
        let end = kumo_vmm::vmm::monotonic_ns();
        let mut op = Op::new(kind, t, &LendReport { total_ms, ..v });
        (op.release_start_ns, op.release_end_ns) = (ns, end);
        self.vmm_cpu.push(op);
        std::thread::sleep(GAP);
        Ok(())
    }

    fn step(&mut self, kind: &'static str, cpus: u32, bytes: u64) -> Result<f64, String> {
        let returning = kind.ends_with("return");
        let (from, to) = if returning { (self.b, self.a) } else { (self.a, self.b) };
        let req = LendRequest { cpus, memory_bytes: bytes, node: None, timeout_ms: self.timeout_ms, returning };
        let t = self.t0.elapsed().as_secs_f64();
        let (tf, tt) = (Timed::new(&from.api), Timed::new(&to.api));
        let r = lend(&tf, &tt, &req).map_err(|e| format!("{kind} {} -> {}: {e}", from.name, to.name))?;
        let mut op = Op::new(kind, t, &r);
        (op.release_call_ms, op.acquire_call_ms) = (tf.release_ms.get(), tt.acquire_ms.get());
        (op.release_start_ns, op.release_end_ns) = tf.release_ns.get();
        if kind.starts_with("cpu") {
            self.cpu.push(op);
        } else {
            self.mem.push(op);
        }
        std::thread::sleep(GAP);
        Ok(t)
    }

    fn all(&mut self, cycles: u64, holds: u64, hold: Duration, say: &dyn Fn(&str)) -> Result<(), String> {
        // Warm-up, not measured: the first lends fault in kumo's and the guests' code paths and
        // the vCPU threads' first runs on their new CPUs (they were 1.5-2.7 ms, then 0.1-0.2).
        for _ in 0..WARMUP {
            self.step("cpu-lend", 1, 0)?;
            self.step("cpu-return", 1, 0)?;
            self.step("mem-lend", 0, MEM_LEND)?;
            self.step("mem-return", 0, MEM_LEND)?;
        }
        self.cpu.clear();
        self.mem.clear();
        // The CPU series measures CPU lends alone: the warm-up's memory is touched first.
        swept(self.a, self.b)?;
        say(&format!("{WARMUP} warm-up cycles (not measured)"));
        for _ in 0..cycles {
            self.step("cpu-lend", 1, 0)?;
            self.step("cpu-return", 1, 0)?;
        }
        say(&format!("{cycles} CPU lend/return cycles"));
        self.sampling.store(true, Ordering::SeqCst);
        for _ in 0..holds {
            std::thread::sleep(hold);
            let lend_t_s = self.step("cpu-lend", 1, 0)?;
            std::thread::sleep(hold);
            let return_t_s = self.step("cpu-return", 1, 0)?;
            self.holds.push(Hold {
                lend_t_s,
                return_t_s,
                b_before_per_s: None,
                b_holding_per_s: None,
                a_before_per_s: None,
                a_holding_per_s: None,
            });
        }
        std::thread::sleep(SAMPLE * 2);
        self.sampling.store(false, Ordering::SeqCst);
        say(&format!("{holds} held CPU lends"));
        // Not measured: each VMM's first vm.lend opens its connection to the other (kept after).
        self.vmm_step("cpu-lend")?;
        self.vmm_step("cpu-return")?;
        self.vmm_cpu.clear();
        for _ in 0..cycles {
            self.vmm_step("cpu-lend")?;
            self.vmm_step("cpu-return")?;
        }
        say(&format!("{cycles} CPU lend/return cycles through PUT vm.lend"));
        std::thread::sleep(hold);
        for _ in 0..cycles {
            self.step("mem-lend", 0, MEM_LEND)?;
            self.step("mem-return", 0, MEM_LEND)?;
        }
        say(&format!("{cycles} memory lend/return cycles"));
        std::thread::sleep(hold);
        for _ in 0..cycles {
            let t = Instant::now();
            self.b.api.pause().map_err(|e| format!("b: vm.pause: {e}"))?;
            let pause_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            self.b.api.resume().map_err(|e| format!("b: vm.resume: {e}"))?;
            let resume_ms = t.elapsed().as_secs_f64() * 1e3;
            self.pause_resume.push(PauseResume { pause_ms, resume_ms });
            std::thread::sleep(GAP);
        }
        say(&format!("{cycles} pause/resume cycles of B"));
        for _ in 0..cycles {
            let t = Instant::now();
            self.b.api.ping().map_err(|e| format!("b: vmm.ping: {e}"))?;
            self.api_ping_ms.push(t.elapsed().as_secs_f64() * 1e3);
            std::thread::sleep(GAP);
        }
        std::thread::sleep(hold);
        Ok(())
    }
}

/// The Linux row's size and cycles from the arguments; None with `--no-linux`.
fn linux_plan(args: &Args) -> Result<Option<linux::Plan>, String> {
    if args.no_linux {
        return Ok(None);
    }
    let mib = args.linux_mib.unwrap_or(if args.quick { 16 } else { 128 });
    // Linux's driver unplugs in 4 MiB subblocks; the zone is 256 MiB.
    if mib == 0 || !mib.is_multiple_of(4) || mib > 256 {
        return Err(format!("--linux-mib {mib}: give a multiple of 4 from 4 to 256"));
    }
    // A 16 MiB cycle takes 10-40 s here and the two kernels a minute or more to boot.
    let cycles = args.linux_cycles.unwrap_or(if args.quick { 3 } else { 10 });
    Ok(Some(linux::Plan { bytes: mib * MIB, cycles }))
}

pub fn run(args: Args, out: &Path) -> Result<i32, String> {
    if !kumo_vm::vm::kvm_available() {
        return Err("needs /dev/kvm".into());
    }
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    let (cpu_b, cpu_a) = two_cpus(&online)
        .ok_or_else(|| format!("needs 2 online host CPUs (one held by each VM), this host has {:?}", online.trim()))?;
    let cycles = args.cycles.unwrap_or(100);
    let holds = args.holds.unwrap_or(if args.quick { 3 } else { 5 });
    let hold = Duration::from_millis(args.hold_ms);
    let linux_plan = linux_plan(&args)?;
    host::cleanup_on_signals("kumo bench lend")?;
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-lend-"))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let say = |m: &str| eprintln!("[{:>5.1} s] {m}", t0.elapsed().as_secs_f64());

    // Dropping a Vm kills its kumo: every return below (`?` too) cleans up.
    let a = Vm::start(dir.as_path(), "a", &format!("cpus={cpu_a},memory=256M"), 1)?;
    let b = Vm::start(dir.as_path(), "b", &format!("cpus={cpu_b},memory=256M,plugged=128M"), 2)?;
    swept(&a, &b)?;
    say("both guests work");

    let stop = AtomicBool::new(false);
    // Progress is sampled around the held lends only: a vm.elastic answer carries the VM's
    // whole record (hundreds of events by then), and serving and parsing it took 0.3-1 ms of a
    // host CPU every 20 ms, which a vacate landing on it waited for (ftrace, issue 24).
    let sampling = AtomicBool::new(false);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let mut run = Run {
        a: &a,
        b: &b,
        t0,
        timeout_ms: args.timeout_ms,
        cpu: vec![],
        mem: vec![],
        holds: vec![],
        pause_resume: vec![],
        api_ping_ms: vec![],
        vmm_cpu: vec![],
        sampling: &sampling,
    };
    let mut coordinator_realtime = false;
    let realtime = &mut coordinator_realtime;
    let result = std::thread::scope(|s| {
        // The sampler keeps its connections too: a new one costs the VMM a thread start (~0.4 ms
        // of a host CPU here, before it takes the API's priority), which landed on the vCPU
        // being vacated and was the whole CPU-lend tail (issue 24: ftrace of the slow cycles).
        let apis = [("a", ApiClient::new(a.api.path()).keep_alive()), ("b", ApiClient::new(b.api.path()).keep_alive())];
        let (stop, sampling, samples) = (&stop, &sampling, &samples);
        s.spawn(move || sampler(apis, t0, (sampling, stop), samples));
        // As `kumo lend` does: the coordinator must not wait a scheduler slice behind the
        // vCPUs spinning on both host CPUs between its steps (it blocks in between).
        let rt = kumo_vmm::placement::realtime_this_thread();
        if let Err(e) = &rt {
            say(&format!("the lends run unprioritized (SCHED_FIFO: {e})"));
        }
        *realtime = rt.is_ok();
        std::thread::sleep(hold);
        let r = run.all(cycles, holds, hold, &say);
        drop(rt);
        stop.store(true, Ordering::SeqCst);
        r
    });
    let mut errors = Vec::new();
    if let Err(e) = result {
        say(&format!("FAILED: {e}"));
        // The VMs' side of it, for whoever looks into it.
        for vm in [&a, &b] {
            let f = out.join(format!("lend-{}.console", vm.name));
            let _ = crate::out_file(out, "").and_then(|_| std::fs::write(&f, vm.output()).map_err(|e| e.to_string()));
            eprintln!(
                "{}",
                vm.output().lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
            );
            eprintln!("(all of {}'s output in {})", vm.name, f.display());
        }
        errors.push(e);
    }

    let mut summary = Summary::default();
    let mut overlap_details = Vec::new();
    let (mut events_a, mut events_b) = (Vec::new(), Vec::new());
    match (a.api.elastic(), b.api.elastic()) {
        (Ok(ia), Ok(ib)) => {
            let o = kumo_elastic::record::check(&[("a", &ia.events), ("b", &ib.events)]);
            summary.overlaps_cpu = o.cpu;
            summary.overlaps_memory = o.memory;
            summary.overlaps = Some(o.total());
            overlap_details = o.details;
            (events_a, events_b) = (ia.events, ib.events);
        }
        (ra, rb) => {
            for (vm, r) in [("a", ra), ("b", rb)] {
                if let Err(e) = r {
                    errors.push(format!("{vm}: vm.elastic (for the overlap check): {e}"));
                }
            }
        }
    }
    let Run { cpu, mem, holds: held, pause_resume, api_ping_ms, vmm_cpu, .. } = run;
    let samples = std::mem::take(&mut *samples.lock().map_err(|_| "the sampler panicked".to_string())?);
    let mut report = Report {
        bench: "lend",
        command: std::env::args().collect::<Vec<_>>().join(" "),
        host_cpu_a: cpu_a,
        host_cpu_b: cpu_b,
        argv_a: a.argv.clone(),
        argv_b: b.argv.clone(),
        cycles,
        coordinator_realtime,
        summary,
        cpu,
        mem,
        vmm_cpu,
        holds: held,
        pause_resume,
        api_ping_ms,
        overlap_details,
        events_a,
        events_b,
        samples,
        errors,
        linux: linux::Row::default(),
    };
    drop((a, b));
    report.linux = match &linux_plan {
        Some(plan) => linux::run(plan, &say),
        None => linux::Row { skipped: Some("left out (--no-linux)".into()), ..linux::Row::default() },
    };
    // One figure for both pairs of VMs.
    if let (Some(o), Some(l)) = (report.summary.overlaps, report.linux.overlaps) {
        report.summary.overlaps = Some(o + l);
    }
    finish(&mut report, hold.as_secs_f64());
    print!("{}", table(&report));
    let json = crate::out_file(out, "lend.json")?;
    std::fs::write(&json, serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?)
        .map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("\nJSON written to {}", json.display());
    let png = out.join("lend.png");
    match plot(&png, &report) {
        Ok(()) => println!("plot written to {}", png.display()),
        Err(e) => eprintln!("kumo bench lend: no plot: {e}"),
    }
    println!("{}", headline(&report));
    let clean = report.errors.is_empty() && report.linux.error.is_none() && report.summary.overlaps == Some(0);
    Ok(if clean { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(vm: &'static str, t_s: f64, units: u64) -> Sample {
        Sample { vm, t_s, progress: vec![0, units, 0], units }
    }

    fn op(kind: &'static str, t_s: f64, total_ms: f64) -> Op {
        Op {
            kind,
            t_s,
            total_ms,
            released_guest_ms: 0.1,
            released_total_ms: 0.2,
            acquired_guest_ms: 0.3,
            acquired_total_ms: 0.4,
            host_cpus: vec![1],
            vcpus: vec![2],
            bytes: 0,
            release_call_ms: 0.3,
            acquire_call_ms: 0.5,
            release_start_ns: 0,
            release_end_ns: 0,
            release_recorded_ms: None,
            release_answered_ms: None,
        }
    }

    fn report() -> Report {
        // B does 1,000 units/s until 1.0 s, 2,000 units/s from 1.0 s to 1.5 s, 1,000 after; A
        // 1,000 units/s, nothing while it has lent its CPU.
        let mut samples = Vec::new();
        let (mut ua, mut ub) = (0u64, 0u64);
        for k in 0..=100 {
            let t = k as f64 * 0.02;
            samples.push(sample("a", t, ua));
            samples.push(sample("b", t, ub));
            let lent = (1.0..1.5).contains(&t);
            ua += if lent { 0 } else { 20 };
            ub += if lent { 40 } else { 20 };
        }
        Report {
            bench: "lend",
            command: String::new(),
            host_cpu_a: 1,
            host_cpu_b: 0,
            argv_a: vec![],
            argv_b: vec![],
            cycles: 2,
            coordinator_realtime: true,
            summary: Summary::default(),
            cpu: vec![
                op("cpu-lend", 0.2, 1.0),
                op("cpu-return", 0.21, 2.0),
                op("cpu-lend", 1.0, 3.0),
                op("cpu-return", 1.5, 4.0),
            ],
            mem: vec![op("mem-lend", 1.7, 5.0), op("mem-return", 1.8, 6.0)],
            vmm_cpu: vec![op("cpu-lend", 1.9, 0.9), op("cpu-return", 1.95, 0.8)],
            holds: vec![Hold {
                lend_t_s: 1.0,
                return_t_s: 1.5,
                b_before_per_s: None,
                b_holding_per_s: None,
                a_before_per_s: None,
                a_holding_per_s: None,
            }],
            pause_resume: vec![
                PauseResume { pause_ms: 1.0, resume_ms: 2.0 },
                PauseResume { pause_ms: 3.0, resume_ms: 4.0 },
            ],
            api_ping_ms: vec![0.5, 0.25],
            overlap_details: vec![],
            events_a: vec![],
            events_b: vec![],
            samples,
            errors: vec![],
            linux: linux::Row::default(),
        }
    }

    #[test]
    fn two_online_cpus_are_picked_from_the_kernel_list() {
        assert_eq!(two_cpus("0-1\n"), Some((0, 1)));
        assert_eq!(two_cpus("0,2-5"), Some((0, 2)));
        assert_eq!(two_cpus("3"), None);
        assert_eq!(two_cpus(""), None);
        assert_eq!(two_cpus("x-1"), None);
    }

    #[test]
    fn throughput_windows_see_the_lent_cpu() {
        let r = report();
        let b = rate(&r.samples, "b", 0.5, 1.0).expect("before");
        assert!((b - 1000.0).abs() < 1.0, "{b}");
        let h = rate(&r.samples, "b", 1.1, 1.5).expect("holding");
        assert!((h - 2000.0).abs() < 1.0, "{h}");
        assert_eq!(rate(&r.samples, "a", 1.1, 1.5), Some(0.0));
        // One sample or none in the window: no rate.
        assert_eq!(rate(&r.samples, "b", 0.5, 0.51), None);
        assert_eq!(rate(&r.samples, "c", 0.0, 2.0), None);
        let s = series(&r.samples, "b");
        assert_eq!(s.len(), 100);
        assert!((s[0].1 - 1000.0).abs() < 1.0 && s.iter().any(|p| (p.1 - 2000.0).abs() < 1.0));
    }

    #[test]
    fn the_summary_has_percentiles_the_ratio_and_the_headline() {
        let mut r = report();
        r.summary.overlaps = Some(0);
        finish(&mut r, 0.5);
        let m = &r.summary;
        assert_eq!((m.cpu_lend_ms.n, m.cpu_lend_ms.p50, m.cpu_lend_ms.p99), (2, Some(1.0), Some(3.0)));
        assert_eq!(m.cpu_return_ms.p99, Some(4.0));
        assert_eq!((m.vmm_cpu_lend_ms.p99, m.vmm_cpu_return_ms.p99), (Some(0.9), Some(0.8)));
        assert_eq!((m.mem_lend_ms.p99, m.mem_return_ms.p50), (Some(5.0), Some(6.0)));
        assert_eq!((m.pause_resume_ms.p50, m.pause_resume_ms.p99), (Some(3.0), Some(7.0)));
        assert_eq!((m.api_ping_ms.p50, m.api_ping_ms.p99), (Some(0.25), Some(0.5)));
        assert_eq!(m.cpu_lend_outside_ms.p50, Some(1.0 - 0.6));
        let ratio = m.b_ratio.expect("ratio");
        assert!((ratio - 2.0).abs() < 0.01, "{ratio}");
        assert_eq!(r.holds[0].a_holding_per_s, Some(0.0));
        assert_eq!(
            headline(&r),
            "cpu_lend_p99_ms=3.000 cpu_lend_max_ms=3.000 mem_lend_p99_ms=5.000 overlaps=0 linux_mem_lend_p50_ms=na linux_mem_lend_p99_ms=na"
        );
        assert!(table(&r).contains("hot-unplug"));
    }

    #[test]
    fn the_headline_says_na_for_what_did_not_run() {
        let mut r = report();
        r.cpu.clear();
        r.mem.clear();
        r.errors.push("cpu-lend a -> b: x".into());
        finish(&mut r, 0.5);
        r.linux.skipped = Some("no test kernel at /x".into());
        assert_eq!(
            headline(&r),
            "cpu_lend_p99_ms=na cpu_lend_max_ms=na mem_lend_p99_ms=na overlaps=na linux_mem_lend_p50_ms=na linux_mem_lend_p99_ms=na"
        );
        assert!(table(&r).contains("skipped: no test kernel at /x"));
        assert!(table(&r).contains("FAILED: cpu-lend a -> b: x"));
    }

    #[test]
    fn a_release_is_placed_in_the_lenders_record() {
        let ev = |t_ns, kind| ElasticEvent {
            t_ns,
            kind,
            vcpu: Some(1),
            host_cpu: Some(1),
            node: None,
            host_node: None,
            bytes: 0,
            at_boot: false,
        };
        let events_a = vec![ev(500, ElasticEventKind::CpuReleased), ev(3_000_000, ElasticEventKind::CpuReleased)];
        let events_b = vec![ev(2_000_000, ElasticEventKind::CpuReleased)];
        let mut ops = vec![op("cpu-lend", 0.0, 5.0), op("cpu-return", 0.0, 5.0), op("mem-lend", 0.0, 5.0)];
        for o in &mut ops {
            (o.release_start_ns, o.release_end_ns) = (1_000_000, 4_000_000);
        }
        place_releases(&mut ops, &events_a, &events_b);
        assert_eq!((ops[0].release_recorded_ms, ops[0].release_answered_ms), (Some(2.0), Some(1.0)));
        assert_eq!((ops[1].release_recorded_ms, ops[1].release_answered_ms), (Some(1.0), Some(2.0)));
        // No mem-released event in A: not placed.
        assert_eq!(ops[2].release_recorded_ms, None);
    }

    #[test]
    fn the_linux_row_reaches_the_table_the_headline_and_the_plot() {
        let mut r = report();
        r.summary.overlaps = Some(0);
        let lop = |kind, total_ms| linux::Op { kind, t_s: 0.0, total_ms, unplug_ms: 1.0, plug_ms: 2.0, call_ms: 3.0 };
        r.linux = linux::Row {
            bytes: 16 * MIB,
            cycles: 2,
            ops: vec![
                lop("linux-mem-lend", 1500.0),
                lop("linux-mem-return", 2500.0),
                lop("linux-mem-lend", 1700.0),
                lop("linux-mem-return", 2600.0),
            ],
            overlaps: Some(0),
            ..linux::Row::default()
        };
        r.linux.finish();
        finish(&mut r, 0.5);
        assert!(
            headline(&r).ends_with("linux_mem_lend_p50_ms=1500.000 linux_mem_lend_p99_ms=1700.000"),
            "{}",
            headline(&r)
        );
        let t = table(&r);
        assert!(t.contains("16 MiB lend A->B") && t.contains("the baseline for the Linux rows"), "{t}");
        crate::check_plot("lend-linux", |p| plot(p, &r));
    }

    #[test]
    fn plot_draws_a_png() {
        let r = report();
        crate::check_plot("lend", |p| plot(p, &r));
    }
}
