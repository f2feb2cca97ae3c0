//! Sections 5–7 of `kumo bench migrate`: kumo and QEMU 7.2 migrating the same guests.
//!
//! For every guest (idle and halted, idle memory with a busy vCPU, flat out over 100,000 pages,
//! the paper's 52,500 writes/s, and an empty one: halted, memory never written but for 1,000
//! pages) and every size, one guest boots under each VMM and both stay up;
//! then they migrate **hop by hop in turn**, kumo first on even steps and QEMU first on odd ones,
//! so that neither VMM gets the quieter moments. While one migrates, the other's guest is paused
//! (kumo `pause`, QEMU `stop`): nothing else runs on the host. Each step has a rule:
//! - *defaults*: each VMM as it comes (kumo: no flags, i.e. zerocopy over four connections, Xen's
//!   rule beside a 50 ms downtime target; QEMU: its 300 ms downtime limit);
//! - *a target*: kumo `--downtime-ms T`, QEMU `downtime-limit T` (30 ms in the tables; 10, 30
//!   and 50 ms in section 6's downtime distributions).
//!
//! Guest RAM is private anonymous memory advised huge in both, each VMM's default (kumo's
//! memfd, `--shared-memory`, would get 4 KiB pages where the host's shmem policy says `never`,
//! which is not the VMM's speed but the host's setting).
//! Both destinations are prepared (kumo `--incoming … --memory`, QEMU `-mem-prealloc`), QEMU's
//! bandwidth is uncapped, both run over loopback TCP. Times are taken on the host, the same way
//! for both: from the command that starts the migration to the moment the host learns it is
//! complete (`kumo migrate` exits; QEMU's `query-migrate`, polled every 5 ms, says completed).
//! The guest's writes/s come from its progress lines, stamped with the host time they arrived:
//! [`WINDOW`] before, during and after each measured hop.

use std::collections::VecDeque;

use serde::Serialize;
use serde_json::Value;

use super::*;
use crate::qemu::{self, QemuSpec, QemuVm};

/// A guest of the comparison. Every one but `empty` is prefilled (all memory in use), and every
/// one runs until it is typed at (`until_input`/`hold_input`), so no duration has to be guessed.
#[derive(Clone, Copy)]
pub(super) struct Workload {
    pub key: &'static str,
    pub label: &'static str,
    pub pages: u64,
    /// Page writes/s; 0: flat out.
    pub rate: u64,
    /// Writes 1000 pages, then halts until typed at (no progress to measure).
    pub halted: bool,
    /// Writes every free page first (`prefill=1`). Without it the rest of memory stays zeros:
    /// never touched at the first hop, faulted in by the prepared destinations after it.
    pub prefill: bool,
}

pub(super) const WORKLOADS: [Workload; 5] = [
    Workload { key: "idle", label: "idle, halted", pages: 1000, rate: 0, halted: true, prefill: true },
    Workload { key: "busy", label: "idle memory, busy vCPU (1 page)", pages: 1, rate: 0, halted: false, prefill: true },
    Workload {
        key: "flat",
        label: "flat out, 100,000 pages",
        pages: LOADED_PAGES,
        rate: 0,
        halted: false,
        prefill: true,
    },
    Workload {
        key: "paper",
        label: "paper: 52,500/s over 100,000",
        pages: LOADED_PAGES,
        rate: LOADED_RATE,
        halted: false,
        prefill: true,
    },
    Workload { key: "empty", label: "empty, halted (zero pages)", pages: 1000, rate: 0, halted: true, prefill: false },
];
const SEED: u64 = 5;
/// Downtime targets of section 6 (kumo `--downtime-ms`, QEMU `downtime-limit`).
pub(super) const TARGETS: [u64; 3] = [10, 30, 50];
/// The target of the tables and the headline.
pub(super) const HEADLINE_TARGET: u64 = 30;
/// A QEMU migration still copying after this long is cancelled: it did not converge.
const CONVERGE: Duration = Duration::from_secs(15);

impl Workload {
    fn args(&self) -> Vec<String> {
        let mut a = sv(&[&format!("pages={}", self.pages), "mode=random", &format!("seed={SEED}")]);
        if self.prefill {
            a.push("prefill=1".into());
        }
        if self.halted {
            a.extend(sv(&["writes=1000", "hold_input=1"]));
        } else {
            a.extend(sv(&["until_input=1", "report_ms=100"]));
            if self.rate > 0 {
                a.push(format!("rate={}", self.rate));
            }
        }
        a
    }

    fn ready(&self) -> &'static str {
        if self.halted {
            "memtouch: checksum="
        } else {
            "memtouch: progress"
        }
    }

    /// The guest's memory against the model, once it printed its last checksum (None before).
    fn check(&self, out: &str) -> Option<Check> {
        let (got, want) = if self.halted {
            (checksum(out, "checksum_after_hold")?, expected_checksum(self.pages, 1000, SEED, true))
        } else {
            let got = checksum(out, "checksum")?;
            let writes = complete(out)
                .lines()
                .find_map(|l| l.strip_prefix("memtouch: done writes="))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            (got, expected_checksum(self.pages, writes, SEED, true))
        };
        Some(if got == want {
            Check { ok: true, detail: "matches the model".into() }
        } else {
            Check { ok: false, detail: format!("checksum {got:x}, the model says {want:x}") }
        })
    }
}

/// One step of a pair: both VMMs migrate their guest once under `rule` (None: each VMM's
/// defaults; Some(T): a T ms downtime target), measuring the guest's rates if `measure`.
#[derive(Clone, Copy)]
pub(super) struct Step {
    pub rule: Option<u64>,
    pub measure: bool,
}

/// One migration.
#[derive(Serialize, Clone, Default)]
pub(super) struct Hop {
    /// None: the VMM's defaults.
    pub target_ms: Option<u64>,
    /// 0 if this VMM went first in its step, 1 if second.
    pub order: u8,
    pub error: Option<String>,
    /// QEMU went on copying past [`CONVERGE`] and was cancelled (no stop-and-copy).
    pub not_converged: bool,
    /// Host-timed: from the command to the host learning the migration completed (for a QEMU
    /// run that did not converge, until it was cancelled: a lower bound).
    pub host_ms: f64,
    /// The VMM's own figure (kumo's report, QEMU's total-time).
    pub total_ms: f64,
    pub downtime_ms: f64,
    /// Pages sent with their contents (QEMU: its "normal" pages; it sends zero pages as a flag).
    pub pages: u64,
    /// The guest's writes/s (host-timed progress lines) before, during and after.
    pub before: Option<f64>,
    pub during: Option<f64>,
    pub after: Option<f64>,
    /// during / before.
    pub kept: Option<f64>,
    /// The guest's work the migration cost, in ms at its rate before: (1 - kept) × the time
    /// it took. A faster migration keeps less of the rate for a shorter time, so `kept` alone
    /// reads against it; this is what the guest lost in all.
    pub lost_ms: Option<f64>,
    /// kumo's report of where the time went (`phases`, and `rounds` with each round's parts).
    pub phases: Option<Value>,
    pub rounds: Option<Value>,
}

/// One guest migrating again and again, under one VMM.
#[derive(Serialize)]
pub(super) struct Chain {
    pub vmm: &'static str,
    pub workload: &'static str,
    pub memory_mib: u64,
    pub guest: String,
    /// Why the guest did not start or the chain broke.
    pub error: Option<String>,
    pub hops: Vec<Hop>,
    /// The guest's memory after the last hop, against the model.
    pub memory: Option<Check>,
}

impl Chain {
    fn new(vmm: &'static str, w: Workload, mem: u64) -> Chain {
        Chain {
            vmm,
            workload: w.key,
            memory_mib: mem,
            guest: w.args().join(" "),
            error: None,
            hops: vec![],
            memory: None,
        }
    }

    /// Hops under `rule` that completed.
    fn done(&self, rule: Option<u64>) -> impl Iterator<Item = &Hop> {
        self.hops.iter().filter(move |h| h.target_ms == rule && h.error.is_none())
    }

    /// Failures that fail the bench (a QEMU that did not converge in time is a measurement).
    pub fn failures(&self) -> Vec<String> {
        let name = format!("{} {} {} MiB", self.vmm, self.workload, self.memory_mib);
        let mut f: Vec<String> = self.error.iter().map(|e| format!("{name}: {}", first_line(e))).collect();
        f.extend(
            self.hops
                .iter()
                .filter(|h| !h.not_converged)
                .filter_map(|h| h.error.as_ref())
                .map(|e| format!("{name}, migration: {}", first_line(e))),
        );
        if let Some(c) = self.memory.as_ref().filter(|c| !c.ok) {
            f.push(format!("{name}: memory {}", c.detail));
        }
        f
    }
}

pub(super) fn first_line(s: &str) -> &str {
    s.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
}

/// memtouch's progress lines as (host ms since `base`, writes).
fn host_progress(lines: &[(Instant, String)], base: Instant) -> Vec<(f64, f64)> {
    lines
        .iter()
        .filter(|(_, l)| l.starts_with("memtouch: progress"))
        .filter_map(|(at, l)| {
            let w = l.split_whitespace().find_map(|w| w.strip_prefix("writes="))?.parse::<f64>().ok()?;
            Some((at.saturating_duration_since(base).as_secs_f64() * 1e3, w))
        })
        .collect()
}

/// Fills the hop's writes/s before (`win` up to `t0`), during (`t0..t1`) and after (`t1` on
/// for `win`), waiting until the guest has reported past the last window.
fn measure_rates(
    h: &mut Hop,
    lines: &dyn Fn() -> Vec<(Instant, String)>,
    (t0, t1): (Instant, Instant),
    win: Duration,
    base: Instant,
) -> Result<(), String> {
    let until = t1 + win;
    let limit = Instant::now() + win + Duration::from_secs(30);
    while !lines().iter().any(|(at, l)| *at >= until && l.starts_with("memtouch: progress")) {
        if Instant::now() > limit {
            return Err("the guest reported no progress after the migration".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let p = host_progress(&lines(), base);
    let ms = |t: Instant| t.saturating_duration_since(base).as_secs_f64() * 1e3;
    let w = win.as_secs_f64() * 1e3;
    h.before = rate(&p, ms(t0) - w, ms(t0));
    h.during = rate(&p, ms(t0), ms(t1));
    h.after = rate(&p, ms(t1), ms(t1) + w);
    h.kept = h.during.zip(h.before).filter(|(_, b)| *b > 0.0).map(|(d, b)| d / b);
    h.lost_ms = h.kept.map(|k| (1.0 - k) * (ms(t1) - ms(t0)));
    Ok(())
}

/// Types at the guest and waits for its last checksum (and for it to exit).
fn finish_guest(w: Workload, send: &mut dyn FnMut() -> Result<(), String>, out: &dyn Fn() -> String) -> Check {
    if let Err(e) = send() {
        return Check { ok: false, detail: e };
    }
    let t = Instant::now();
    loop {
        if let Some(c) = w.check(&out()) {
            return c;
        }
        if t.elapsed() > Duration::from_secs(30) {
            return Check { ok: false, detail: "no final checksum within 30 s of typing at the guest".into() };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(super) fn rule_label(t: Option<u64>) -> String {
    t.map_or("defaults".into(), |t| format!("{t} ms"))
}

// ---------------------------------------------------------------------------------------------
// The two sides of a pair

/// One VMM's guest, its prepared destinations and what the guest printed on every host.
trait Side {
    /// Prepares `n` destinations (both guests are paused meanwhile).
    fn prepare(&mut self, ctx: &Ctx, n: usize);
    fn resume(&mut self, ctx: &Ctx) -> Result<(), String>;
    fn pause(&mut self, ctx: &Ctx) -> Result<(), String>;
    /// Migrates to the next prepared destination under `h.target_ms`, filling `h`'s times;
    /// returns when it started and ended on the host.
    fn hop(&mut self, ctx: &Ctx, h: &mut Hop) -> Result<(Instant, Instant), String>;
    /// Every line the guest printed, on every host it ran on, with the host time it arrived.
    fn lines(&self) -> Vec<(Instant, String)>;
    /// Types at the guest and checks its memory.
    fn finish(&mut self, w: Workload) -> Check;
}

struct KumoSide {
    vm: Vm,
    mem: u64,
    history: Vec<Lines>,
    ready: VecDeque<Result<Dest, String>>,
}

impl Side for KumoSide {
    fn prepare(&mut self, ctx: &Ctx, n: usize) {
        self.ready.extend(prepare_all(ctx, &vec![DEFAULTS; n], self.mem));
    }

    fn resume(&mut self, ctx: &Ctx) -> Result<(), String> {
        ctx.kumo_ok(&sv(&["--api-socket", &self.vm.api.display().to_string(), "resume"]), Duration::from_secs(30))
            .map(drop)
    }

    fn pause(&mut self, ctx: &Ctx) -> Result<(), String> {
        ctx.kumo_ok(&sv(&["--api-socket", &self.vm.api.display().to_string(), "pause"]), Duration::from_secs(30))
            .map(drop)
    }

    fn hop(&mut self, ctx: &Ctx, h: &mut Hop) -> Result<(Instant, Instant), String> {
        let dst = self.ready.pop_front().unwrap_or_else(|| Err("no destination".into()))?;
        let m = hop_to(ctx, &mut self.vm, dst, self.mem, h.target_ms, 1.0)?;
        self.history.push(self.vm.proc.stdout_handle());
        let (t0, t1) = m.window.ok_or("no migration window")?;
        h.host_ms = (t1 - t0).as_secs_f64() * 1e3;
        h.total_ms = m.total_ms;
        h.downtime_ms = m.downtime_ms;
        // Zero pages go as runs of page numbers, as QEMU's go as flags: not "with contents".
        h.pages = m.total_pages.saturating_sub(m.report["zero_pages"].as_u64().unwrap_or(0));
        h.phases = Some(m.report["phases"].clone());
        h.rounds = Some(m.report["rounds"].clone());
        Ok((t0, t1))
    }

    fn lines(&self) -> Vec<(Instant, String)> {
        self.history.iter().flat_map(lines_of).collect()
    }

    fn finish(&mut self, w: Workload) -> Check {
        let out = self.vm.proc.stdout_handle();
        let proc = &mut self.vm.proc;
        let check = finish_guest(w, &mut || proc.send(b"q"), &|| text_of(&out));
        let _ = self.vm.proc.wait_exit(Duration::from_secs(30));
        check
    }
}

struct QemuSide {
    src: QemuVm,
    /// The destinations' spec: the source's, with `-mem-prealloc`.
    dst: QemuSpec,
    history: Vec<(Instant, String)>,
    ready: VecDeque<Result<(QemuVm, u16), String>>,
}

impl Side for QemuSide {
    fn prepare(&mut self, _: &Ctx, n: usize) {
        let spec = &self.dst;
        let ports: Vec<Result<u16, String>> = (0..n).map(|_| qemu::free_port()).collect();
        self.ready.extend(std::thread::scope(|s| {
            let hs: Vec<_> = ports
                .into_iter()
                .map(|p| s.spawn(move || p.and_then(|port| QemuVm::spawn(spec, Some(port)).map(|vm| (vm, port)))))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("starting a QEMU destination panicked".into())))
                .collect::<Vec<_>>()
        }));
    }

    fn resume(&mut self, _: &Ctx) -> Result<(), String> {
        self.src.qmp("cont", Value::Null).map(drop)
    }

    fn pause(&mut self, _: &Ctx) -> Result<(), String> {
        self.src.qmp("stop", Value::Null).map(drop)
    }

    fn hop(&mut self, _: &Ctx, h: &mut Hop) -> Result<(Instant, Instant), String> {
        let (dst, port) = self.ready.pop_front().unwrap_or_else(|| Err("no destination".into()))?;
        let t0 = Instant::now();
        let r = qemu::migrate_to(&mut self.src, &dst, port, h.target_ms, CONVERGE);
        let t1 = Instant::now();
        h.host_ms = (t1 - t0).as_secs_f64() * 1e3;
        let m = r.inspect_err(|e| h.not_converged = e.contains("migration not done within"))?;
        h.total_ms = m.total_ms as f64;
        h.downtime_ms = m.downtime_ms as f64;
        h.pages = m.normal_pages;
        self.history.extend(self.src.lines());
        self.src = dst;
        Ok((t0, t1))
    }

    fn lines(&self) -> Vec<(Instant, String)> {
        self.history.iter().cloned().chain(self.src.lines()).collect()
    }

    fn finish(&mut self, w: Workload) -> Check {
        // The serial log, read without borrowing `src` (typed at meanwhile).
        let serial = self.src.serial_path();
        let src = &mut self.src;
        let check = finish_guest(w, &mut || src.send_input(b"q"), &|| {
            std::fs::read(&serial).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
        });
        let _ = self.src.wait_exit(Duration::from_secs(30));
        check
    }
}

/// kumo's migrations in the comparison: `kumo migrate` without flags but the rule's.
const DEFAULTS: Engine = Engine { label: "defaults", engine: "", connections: 0 };

/// Boots the workload under both VMMs at once (nothing is measured yet) and leaves both
/// guests paused.
fn boot_pair(ctx: &Ctx, mem: u64, w: Workload) -> (Result<KumoSide, String>, Result<QemuSide, String>) {
    ctx.step(format!("{} {mem} MiB: starting the guest under kumo and QEMU", w.key));
    let spec = QemuSpec::new("memtouch", mem, &w.args());
    let boot = Duration::from_secs(60) + Duration::from_micros(mem * 256 * 200);
    let (k, q) = std::thread::scope(|s| {
        let q = s.spawn(|| {
            let mut vm = QemuVm::spawn(&spec, None)?;
            vm.wait_serial(w.ready(), boot)?;
            vm.qmp("stop", Value::Null)?;
            Ok::<_, String>(vm)
        });
        let k = source(ctx, mem, &w.args(), w.ready());
        (k, q.join().unwrap_or_else(|_| Err("booting QEMU panicked".into())))
    });
    let k = k.and_then(|vm| {
        let mut side = KumoSide { history: vec![vm.proc.stdout_handle()], vm, mem, ready: VecDeque::new() };
        side.pause(ctx)?;
        Ok(side)
    });
    let q = q.map(|src| QemuSide {
        src,
        dst: QemuSpec { prealloc: true, ..spec.clone() },
        history: Vec::new(),
        ready: VecDeque::new(),
    });
    (k, q)
}

/// One step for one side: resume its guest, migrate it (measuring the guest's rates around
/// the migration if asked), pause it again.
fn run_step(ctx: &Ctx, side: &mut dyn Side, w: Workload, step: Step, order: u8, win: Duration) -> (Hop, bool) {
    let mut h = Hop { target_ms: step.rule, order, ..Default::default() };
    if let Err(e) = side.resume(ctx) {
        h.error = Some(format!("cannot resume the guest: {e}"));
        return (h, false);
    }
    if step.measure {
        std::thread::sleep(win);
    }
    let r = side.hop(ctx, &mut h).and_then(|window| {
        if step.measure && !w.halted {
            measure_rates(&mut h, &|| side.lines(), window, win, ctx.t0)?;
        }
        Ok(())
    });
    h.error = r.err();
    // Paused again wherever the guest runs now (the source, after a failed migration).
    let alive = match side.pause(ctx) {
        Ok(()) => true,
        Err(e) => {
            h.error.get_or_insert(format!("cannot pause the guest: {e}"));
            false
        }
    };
    (h, alive)
}

/// Both VMMs migrate the workload's guest through `steps`, in turn.
fn pair(ctx: &Ctx, mem: u64, w: Workload, steps: &[Step], win: Duration) -> [Chain; 2] {
    let mut chains = [Chain::new("kumo", w, mem), Chain::new("qemu", w, mem)];
    let (k, q) = boot_pair(ctx, mem, w);
    let (mut k, mut q) = match (k, q) {
        (Ok(k), Ok(q)) => (k, q),
        (k, q) => {
            chains[0].error = k.err();
            chains[1].error = q.err();
            return chains;
        }
    };
    let mut sides: [&mut dyn Side; 2] = [&mut k, &mut q];
    // Destinations for a few steps at a time, made while both guests are paused: at 2 GiB,
    // two each (two guests and four destinations of 2 GiB fit this host's memory).
    let batch = if mem > 1024 { 2 } else { BATCH };
    let mut alive = [true, true];
    for (i, &step) in steps.iter().enumerate() {
        if i % batch == 0 {
            ctx.step(format!("{} {mem} MiB: preparing destinations", w.key));
            for s in sides.iter_mut() {
                s.prepare(ctx, batch.min(steps.len() - i));
            }
        }
        for (pos, j) in if i % 2 == 0 { [0, 1] } else { [1, 0] }.into_iter().enumerate() {
            if !alive[j] {
                continue;
            }
            ctx.step(format!(
                "{} {mem} MiB: step {}/{} ({}), {}",
                w.key,
                i + 1,
                steps.len(),
                rule_label(step.rule),
                chains[j].vmm
            ));
            let (h, ok) = run_step(ctx, &mut *sides[j], w, step, pos as u8, win);
            if !ok {
                chains[j].error = Some(format!("the chain stopped: {}", h.error.clone().unwrap_or_default()));
                alive[j] = false;
            }
            chains[j].hops.push(h);
        }
    }
    ctx.step(format!("{} {mem} MiB: stopping the guests, checking their memory", w.key));
    for (j, s) in sides.iter_mut().enumerate() {
        chains[j].memory = Some(match s.resume(ctx) {
            Ok(()) => s.finish(w),
            Err(e) => Check { ok: false, detail: format!("cannot resume the guest to check it: {e}") },
        });
    }
    chains
}

// ---------------------------------------------------------------------------------------------
// The grid and its summaries

/// Medians of one VMM's completed hops under one rule (a row of section 5).
#[derive(Serialize, Default, Clone)]
pub(super) struct Row {
    pub runs: usize,
    pub host_ms: Option<f64>,
    pub total_ms: Option<f64>,
    pub downtime_ms: Option<f64>,
    pub pages: Option<f64>,
    pub before: Option<f64>,
    pub during: Option<f64>,
    pub after: Option<f64>,
    pub kept: Option<f64>,
    pub lost_ms: Option<f64>,
}

fn row(c: &Chain, rule: Option<u64>) -> Row {
    let col = |f: fn(&Hop) -> Option<f64>| median(c.done(rule).filter_map(f).collect());
    Row {
        runs: c.done(rule).count(),
        host_ms: col(|h| Some(h.host_ms)),
        total_ms: col(|h| Some(h.total_ms)),
        downtime_ms: col(|h| Some(h.downtime_ms)),
        pages: col(|h| Some(h.pages as f64)),
        before: col(|h| h.before),
        during: col(|h| h.during),
        after: col(|h| h.after),
        kept: col(|h| h.kept),
        lost_ms: col(|h| h.lost_ms),
    }
}

/// kumo against QEMU on one guest, one size, one rule.
#[derive(Serialize)]
pub(super) struct SideBySide {
    pub workload: &'static str,
    pub label: &'static str,
    pub memory_mib: u64,
    /// None: each VMM's defaults.
    pub target_ms: Option<u64>,
    pub kumo: Row,
    pub qemu: Row,
    /// kumo's median host-timed total over QEMU's. QEMU runs that did not converge count with
    /// the time until they were cancelled (a lower bound: the ratio flatters QEMU).
    pub time_ratio: Option<f64>,
}

/// kumo's chain `k` against QEMU's `q` under `rule`.
fn versus(w: Workload, k: &Chain, q: &Chain, rule: Option<u64>) -> SideBySide {
    let (kr, qr) = (row(k, rule), row(q, rule));
    // QEMU's unfinished runs count, as lower bounds of its time.
    let q_time = median(
        q.hops
            .iter()
            .filter(|h| h.target_ms == rule && (h.error.is_none() || h.not_converged))
            .map(|h| h.host_ms)
            .collect(),
    );
    let time_ratio = kr.host_ms.zip(q_time).filter(|(_, q)| *q > 0.0).map(|(k, q)| k / q);
    SideBySide {
        workload: w.key,
        label: w.label,
        memory_mib: k.memory_mib,
        target_ms: rule,
        kumo: kr,
        qemu: qr,
        time_ratio,
    }
}

/// Measured downtimes at one target (section 6).
#[derive(Serialize)]
pub(super) struct Dist {
    pub vmm: &'static str,
    pub workload: &'static str,
    pub memory_mib: u64,
    pub target_ms: u64,
    pub runs: usize,
    /// Migrations that completed, their downtimes in run order.
    pub downtimes_ms: Vec<f64>,
    /// QEMU migrations cancelled after [`CONVERGE`] without reaching their stop-and-copy.
    pub not_converged: usize,
    pub failed: usize,
    pub min: Option<f64>,
    pub median: Option<f64>,
    pub p95: Option<f64>,
    pub max: Option<f64>,
    /// Completed runs with downtime ≤ target.
    pub within: usize,
    /// Median host-timed total of the completed runs.
    pub median_host_ms: Option<f64>,
}

fn dist(c: &Chain, target: u64) -> Dist {
    let hops: Vec<&Hop> = c.hops.iter().filter(|h| h.target_ms == Some(target)).collect();
    let d: Vec<f64> = hops.iter().filter(|h| h.error.is_none()).map(|h| h.downtime_ms).collect();
    let mut s = d.clone();
    s.sort_by(f64::total_cmp);
    let p95 = (!s.is_empty()).then(|| s[((s.len() as f64 * 0.95).ceil() as usize).clamp(1, s.len()) - 1]);
    Dist {
        vmm: c.vmm,
        workload: c.workload,
        memory_mib: c.memory_mib,
        target_ms: target,
        runs: hops.len(),
        not_converged: hops.iter().filter(|h| h.not_converged).count(),
        failed: hops.iter().filter(|h| h.error.is_some() && !h.not_converged).count(),
        min: s.first().copied(),
        median: median(d.clone()),
        p95,
        max: s.last().copied(),
        within: d.iter().filter(|&&x| x <= target as f64).count(),
        downtimes_ms: d,
        median_host_ms: median(hops.iter().filter(|h| h.error.is_none()).map(|h| h.host_ms).collect()),
    }
}

/// One phase of kumo's migrations (its report's `phases`): the median ms over the flat-out
/// guest's completed hops at one size under one rule.
#[derive(Serialize)]
pub(super) struct PhaseRow {
    pub memory_mib: u64,
    pub target_ms: Option<u64>,
    pub phase: String,
    pub median_ms: Option<f64>,
}

/// The phases in the order they run (kumo-api's `PhaseTimes`); `rearm` is part of `send`.
const PHASES: [&str; 15] = [
    "setup_ms",
    "connect_ms",
    "accepted_ms",
    "more_connections_ms",
    "dirty_log_start_ms",
    "touched_ms",
    "pipeline_start_ms",
    "ready_ms",
    "send_ms",
    "rearm_ms",
    "drain_ms",
    "harvest_ms",
    "plan_ms",
    "stop_ms",
    "total_ms",
];

fn breakdown(c: &Chain, rule: Option<u64>) -> Vec<PhaseRow> {
    PHASES
        .iter()
        .map(|&p| {
            let x = c.done(rule).filter_map(|h| {
                if p == "total_ms" {
                    Some(h.total_ms)
                } else {
                    h.phases.as_ref()?[p].as_f64()
                }
            });
            PhaseRow {
                memory_mib: c.memory_mib,
                target_ms: rule,
                phase: p.trim_end_matches("_ms").into(),
                median_ms: median(x.collect()),
            }
        })
        .collect()
}

#[derive(Serialize)]
pub(super) struct Compare {
    /// The `-cpu` model QEMU ran with (the first that booted here).
    pub qemu_cpu: String,
    /// Measured migrations per VMM, guest and rule: the flat-out guest, the others.
    pub runs: usize,
    pub other_runs: usize,
    /// Migrations per VMM at each of [`TARGETS`], flat-out and paper guests, at `dist_mib`.
    pub runs_per_target: usize,
    pub dist_mib: u64,
    /// Seconds of guest progress measured before and after each migration.
    pub window_s: f64,
    pub chains: Vec<Chain>,
    pub side_by_side: Vec<SideBySide>,
    pub downtime: Vec<Dist>,
    /// Where kumo's time went on the flat-out guest, per size and rule.
    pub breakdown: Vec<PhaseRow>,
}

/// The rules of the tables: each VMM's defaults, and the headline target.
const RULES: [Option<u64>; 2] = [None, Some(HEADLINE_TARGET)];

/// The steps of one guest's pair: `rows` measured migrations under each rule, the rules
/// alternating, then (`dist`) `n` more at each of [`TARGETS`], interleaved.
fn steps(rows: usize, dist: bool, n: usize) -> Vec<Step> {
    let mut v: Vec<Step> = (0..rows).flat_map(|_| RULES.map(|rule| Step { rule, measure: true })).collect();
    if dist {
        v.extend((0..n).flat_map(|_| TARGETS.map(|t| Step { rule: Some(t), measure: false })));
    }
    v
}

/// Sections 5–7: every workload at every size, `runs` measured migrations per rule for the
/// flat-out guest and `other_runs` for the others; at `dist_mib` the flat-out and paper guests
/// then migrate `n` times per target of [`TARGETS`].
pub(super) fn compare(
    ctx: &Ctx,
    sizes: &[u64],
    dist_mib: u64,
    (runs, other_runs, n): (usize, usize, usize),
    win: Duration,
    qemu_cpu: String,
) -> Compare {
    let mut chains = Vec::new();
    for &mem in sizes {
        for w in WORKLOADS {
            let rows = if w.key == "flat" { runs } else { other_runs };
            let s = steps(rows, mem == dist_mib && matches!(w.key, "flat" | "paper"), n);
            chains.extend(pair(ctx, mem, w, &s, win));
            ctx.bar.inc(2);
        }
    }
    let mut side_by_side = Vec::new();
    let mut breakdown_rows = Vec::new();
    for pair in chains.chunks(2) {
        let (k, q) = (&pair[0], &pair[1]);
        let w = WORKLOADS.iter().find(|w| w.key == k.workload).copied().unwrap_or(WORKLOADS[0]);
        for rule in RULES {
            side_by_side.push(versus(w, k, q, rule));
            if w.key == "flat" {
                breakdown_rows.extend(breakdown(k, rule));
            }
        }
    }
    let downtime = chains
        .iter()
        .filter(|c| c.memory_mib == dist_mib && matches!(c.workload, "flat" | "paper"))
        .flat_map(|c| TARGETS.iter().map(move |&t| dist(c, t)))
        .filter(|d| d.runs > 0)
        .collect();
    Compare {
        qemu_cpu,
        runs,
        other_runs,
        runs_per_target: n,
        dist_mib,
        window_s: win.as_secs_f64(),
        chains,
        side_by_side,
        downtime,
        breakdown: breakdown_rows,
    }
}

impl Compare {
    fn find(&self, workload: &str, mib: u64, rule: Option<u64>) -> Option<&SideBySide> {
        self.side_by_side.iter().find(|s| s.workload == workload && s.memory_mib == mib && s.target_ms == rule)
    }

    /// kumo's host-timed total over QEMU's, flat-out guest, `mib`, `rule`.
    pub fn time_ratio(&self, mib: u64, rule: Option<u64>) -> Option<f64> {
        self.find("flat", mib, rule)?.time_ratio
    }

    /// The flat-out guest's kept rate (during / before) at `mib` under the headline target:
    /// (kumo, QEMU).
    pub fn kept(&self, mib: u64) -> (Option<f64>, Option<f64>) {
        self.find("flat", mib, Some(HEADLINE_TARGET)).map_or((None, None), |s| (s.kumo.kept, s.qemu.kept))
    }

    /// The sizes compared.
    pub fn sizes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.side_by_side.iter().map(|s| s.memory_mib).collect();
        v.dedup();
        v
    }
}

// ---------------------------------------------------------------------------------------------
// Printing

fn print_rows(c: &Compare) {
    println!(
        "\n5. kumo and QEMU 7.2 on the same guests (memtouch, prefilled; QEMU boots it through its PVH entry, -cpu {})",
        c.qemu_cpu
    );
    println!("   the two guests stay up and migrate in turn, hop by hop (kumo first on even steps, QEMU on odd), the other paused;");
    println!("   rules: defaults = each VMM as it comes (kumo: zerocopy x4, Xen's rule + 50 ms target; QEMU: downtime limit 300 ms),");
    println!("   {HEADLINE_TARGET} ms = kumo --downtime-ms {HEADLINE_TARGET}, QEMU downtime-limit {HEADLINE_TARGET}; both to a prepared destination over loopback TCP, QEMU uncapped.");
    println!(
        "   {} migrations per row for the flat-out guest, {} for the others; medians. host ms: from the command to the host seeing it",
        c.runs, c.other_runs
    );
    println!("   complete (the ratio's basis); own ms: the VMM's own total. writes/s from the guest's host-stamped progress lines,");
    println!(
        "   {:.1} s before, during, {:.1} s after; kept = during / before; lost ms = (1 - kept) x the migration's time, the
   guest's work it cost at its rate before. pages: sent with contents.",
        c.window_s, c.window_s
    );
    println!(
        "{:<40} {:<8} {:<5} {:>7} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>6} {:>7} {:>6}",
        "guest",
        "rule",
        "vmm",
        "host ms",
        "own ms",
        "down ms",
        "pages",
        "before/s",
        "during/s",
        "after/s",
        "kept",
        "lost ms",
        "ratio"
    );
    let f = |v: Option<f64>, p: usize| opt(v, p);
    for s in &c.side_by_side {
        for (i, (vmm, r)) in [("kumo", &s.kumo), ("QEMU", &s.qemu)].into_iter().enumerate() {
            let (name, rule, ratio) = if i == 0 {
                (format!("{} MiB {}", s.memory_mib, s.label), rule_label(s.target_ms), f(s.time_ratio, 2))
            } else {
                (String::new(), String::new(), String::new())
            };
            println!(
                "{name:<40} {rule:<8} {vmm:<5} {:>7} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>6} {:>7} {ratio:>6}",
                f(r.host_ms, 0),
                f(r.total_ms, 0),
                f(r.downtime_ms, 1),
                f(r.pages, 0),
                f(r.before, 0),
                f(r.during, 0),
                f(r.after, 0),
                f(r.kept, 3),
                f(r.lost_ms, 0)
            );
        }
    }
    for ch in &c.chains {
        for h in ch.hops.iter().filter(|h| h.error.is_some()) {
            let what = if h.not_converged { "did not converge in time" } else { "FAILED" };
            let rule = rule_label(h.target_ms);
            let e = first_line(h.error.as_deref().unwrap_or(""));
            println!("   {} {} {} MiB, {rule}: {what}: {e}", ch.vmm, ch.workload, ch.memory_mib);
        }
        if let Some(e) = &ch.error {
            println!("   {} {} {} MiB: FAILED: {}", ch.vmm, ch.workload, ch.memory_mib, first_line(e));
        }
    }
    let bad: Vec<String> = c
        .chains
        .iter()
        .filter_map(|ch| {
            ch.memory.as_ref().filter(|m| !m.ok).map(|m| format!("{} {}: {}", ch.vmm, ch.workload, m.detail))
        })
        .collect();
    let checked = c.chains.iter().filter(|ch| ch.memory.is_some()).count();
    println!(
        "   memory after each guest's last hop against the model: {}/{checked} match{}",
        checked - bad.len(),
        if bad.is_empty() { String::new() } else { format!(" ({})", bad.join("; ")) }
    );
}

fn print_downtime(c: &Compare) {
    if c.downtime.is_empty() {
        return;
    }
    println!(
        "\n6. Downtime by target, {} MiB, {} migrations per target and VMM besides section 5's (steps interleaved), measured downtime in ms",
        c.dist_mib, c.runs_per_target
    );
    println!(
        "{:<6} {:<7} {:>6} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8}  within target",
        "vmm", "guest", "target", "runs", "min", "median", "p95", "max", "host ms"
    );
    for d in &c.downtime {
        let extra = match (d.not_converged, d.failed) {
            (0, 0) => String::new(),
            (n, f) => format!(" ({n} did not converge, {f} failed)"),
        };
        println!(
            "{:<6} {:<7} {:>6} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8}  {}/{} <= {} ms{extra}",
            d.vmm,
            d.workload,
            d.target_ms,
            d.runs,
            opt(d.min, 1),
            opt(d.median, 1),
            opt(d.p95, 1),
            opt(d.max, 1),
            opt(d.median_host_ms, 0),
            d.within,
            d.runs,
            d.target_ms
        );
    }
}

fn print_totals(c: &Compare) {
    println!(
        "\n7. Total time, kumo's median over QEMU's (host-timed; QEMU runs cancelled unfinished count as lower bounds)"
    );
    println!(
        "{:>5}  {:<32} {:>10} {:>10} {:>10} {:>10}",
        "MiB",
        "guest",
        "defaults",
        "",
        &format!("{HEADLINE_TARGET} ms"),
        ""
    );
    println!("{:>5}  {:<32} {:>10} {:>10} {:>10} {:>10}", "", "", "kumo/QEMU", "ms", "kumo/QEMU", "ms");
    for mib in c.sizes() {
        for w in WORKLOADS {
            let cell = |rule| {
                c.find(w.key, mib, rule).map_or(("-".to_string(), "-".to_string()), |s| {
                    (opt(s.time_ratio, 2), format!("{}/{}", opt(s.kumo.host_ms, 0), opt(s.qemu.host_ms, 0)))
                })
            };
            let ((a, b), (x, y)) = (cell(None), cell(Some(HEADLINE_TARGET)));
            println!("{mib:>5}  {:<32} {a:>10} {b:>10} {x:>10} {y:>10}", w.label);
        }
    }
    println!("   where kumo's time went, flat-out guest (median ms of each phase; send includes rearm; they add up to about the total):");
    for mib in c.sizes() {
        for rule in RULES {
            let parts: Vec<String> = c
                .breakdown
                .iter()
                .filter(|p| p.memory_mib == mib && p.target_ms == rule)
                .filter(|p| p.phase == "total" || p.median_ms.is_some_and(|v| v >= 0.05))
                .map(|p| format!("{} {}", p.phase, opt(p.median_ms, 1)))
                .collect();
            println!("   {mib} MiB, {}: {}", rule_label(rule), parts.join(", "));
        }
    }
}

/// Sections 5, 6 and 7.
pub(super) fn print(c: &Compare) {
    print_rows(c);
    print_downtime(c);
    print_totals(c);
}

/// Section 6 as a chart: median measured downtime (max as a cross) per target, kumo and QEMU,
/// paper and flat-out guests, against the line downtime = target.
pub(super) fn plot_downtime<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    c: &Compare,
) -> Result<(), plotters::prelude::DrawingAreaErrorKind<DB::ErrorType>> {
    use plotters::prelude::*;
    let d = &c.downtime;
    let top = d.iter().filter_map(|x| x.max).fold(TARGETS[TARGETS.len() - 1] as f64, f64::max) * 1.15;
    let xmax = TARGETS[TARGETS.len() - 1] as f64 + 5.0;
    let mut ch = ChartBuilder::on(area)
        .caption("Downtime by target (section 6)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0.0..xmax, 0.0..top)?;
    ch.configure_mesh()
        .x_desc("downtime target (ms)")
        .y_desc("measured downtime (ms): median, x = max")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 14))
        .draw()?;
    ch.draw_series(LineSeries::new([(0.0, 0.0), (xmax, xmax)], BLACK.stroke_width(1)))?
        .label("downtime = target")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(1)));
    let series = [("kumo", "paper", RED), ("kumo", "flat", MAGENTA), ("qemu", "paper", BLUE), ("qemu", "flat", CYAN)];
    for (vmm, workload, col) in series {
        let rows: Vec<&Dist> = d.iter().filter(|x| x.vmm == vmm && x.workload == workload).collect();
        let med: Vec<(f64, f64)> = rows.iter().filter_map(|x| Some((x.target_ms as f64, x.median?))).collect();
        if med.is_empty() {
            continue;
        }
        ch.draw_series(LineSeries::new(med.clone(), col.stroke_width(2)))?
            .label(format!("{vmm}, {workload}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], col.stroke_width(2)));
        ch.draw_series(med.iter().map(|&p| Circle::new(p, 4, col.filled())))?;
        ch.draw_series(rows.iter().filter_map(|x| Some(Cross::new((x.target_ms as f64, x.max?), 5, col))))?;
    }
    ch.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_alternate_the_rules_then_interleave_the_targets() {
        let s = steps(2, true, 1);
        let rules: Vec<Option<u64>> = s.iter().map(|s| s.rule).collect();
        assert_eq!(rules, [None, Some(30), None, Some(30), Some(10), Some(30), Some(50)]);
        assert_eq!(s.iter().filter(|s| s.measure).count(), 4);
        assert_eq!(steps(1, false, 5).len(), 2);
    }

    #[test]
    fn rows_take_medians_of_completed_hops_and_ratios_count_unfinished_qemu_runs() {
        let hop = |t: Option<u64>, host: f64, err: bool, nc: bool| Hop {
            target_ms: t,
            host_ms: host,
            error: err.then(|| "x".to_string()),
            not_converged: nc,
            kept: Some(host / 1000.0),
            lost_ms: Some(host - host * host / 1000.0),
            ..Default::default()
        };
        let mut k = Chain::new("kumo", WORKLOADS[2], 512);
        k.hops = vec![hop(None, 300.0, false, false), hop(None, 500.0, false, false), hop(None, 400.0, false, false)];
        let r = row(&k, None);
        assert_eq!((r.runs, r.host_ms, r.kept), (3, Some(400.0), Some(0.4)));
        assert_eq!(r.lost_ms, Some(240.0), "the median hop's (400 ms, kept 0.4)");
        assert_eq!(row(&k, Some(30)).runs, 0);
        let mut q = Chain::new("qemu", WORKLOADS[2], 512);
        q.hops = vec![hop(None, 200.0, false, false), hop(None, 15000.0, true, true), hop(None, 900.0, true, false)];
        let d = dist(&q, 30);
        assert_eq!(d.runs, 0);
        q.hops.push(hop(Some(30), 100.0, false, false));
        let d = dist(&q, 30);
        assert_eq!((d.runs, d.within), (1, 1));
        // The failed run is out, the unfinished one counts: median of 200 and 15,000.
        let v = versus(WORKLOADS[2], &k, &q, None);
        assert_eq!(v.time_ratio, Some(400.0 / 7600.0));
        assert_eq!((v.qemu.runs, v.qemu.host_ms), (1, Some(200.0)));
        assert_eq!(versus(WORKLOADS[2], &k, &q, Some(30)).time_ratio, None, "kumo has no 30 ms hop");
    }
}
