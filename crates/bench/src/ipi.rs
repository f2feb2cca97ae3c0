//! `kumo bench ipi`: seed 003's synchronisation benchmark on each interrupt path. The `sync`
//! guest (guests/src/sync.c) passes a semaphore round robin between 2 vCPUs, a waiter spinning
//! or halting until an IPI wakes it, then runs synchronisation-heavy work on 2 vCPUs and on 1.
//! Paths: kumo's userspace APIC (`--irqchip user`, the baseline a hypervisor without APIC
//! virtualization has), the in-kernel LAPIC (`kernel`, `split`), and the knobs that decide
//! what a woken vCPU pays: KVM halt polling (`--halt-poll-ns`) and guest-side polling before
//! HLT (`wait=poll`); each in xAPIC (MMIO) and x2APIC (MSR) mode. A VM-exit round trip (a port
//! read) is measured in every run as the unit. Writes ipi.json and ipi.png; ends with
//! `sync_fast_us=A sync_user_us=B sync_reduction=C two_vs_one_fast=D`.

use std::path::Path;
use std::process::Command;

use kumo_guests::sync::SyncResult;
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// Fewer runs per row (7) and fewer hand-offs: under 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Runs per row (medians are reported); default 15, 7 with --quick.
    #[arg(long)]
    runs: Option<usize>,
    /// Bare hand-offs per run; default 2000, 1000 with --quick.
    #[arg(long)]
    handoffs: Option<u64>,
    /// Transactions of the work phase per run.
    #[arg(long, default_value_t = 1000)]
    txns: u64,
    /// Work units per transaction under the semaphore.
    #[arg(long, default_value_t = 2)]
    cs: u64,
    /// Work units per transaction outside the semaphore.
    #[arg(long, default_value_t = 20)]
    par: u64,
}

/// One interrupt path: how the VM is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
struct Route {
    /// `user`, `kernel` or `split`.
    irqchip: &'static str,
    /// `--halt-poll-ns`; none: the host's default.
    halt_poll_ns: Option<u32>,
    /// The sync guest's `poll_ns` with wait=poll.
    guest_poll_ns: Option<u64>,
}

impl Route {
    fn label(&self) -> String {
        let mut s = match self.irqchip {
            "user" => "user APIC".to_string(),
            k => format!("{k} LAPIC"),
        };
        if let Some(ns) = self.halt_poll_ns {
            s += &format!(", halt-poll {}us", ns / 1000);
        }
        if let Some(ns) = self.guest_poll_ns {
            s += &format!(", guest poll {}us", ns / 1000);
        }
        s
    }
    fn is_user(&self) -> bool {
        self.irqchip == "user"
    }
}

const PATHS: [Route; 6] = [
    Route { irqchip: "user", halt_poll_ns: None, guest_poll_ns: None },
    Route { irqchip: "kernel", halt_poll_ns: None, guest_poll_ns: None },
    Route { irqchip: "split", halt_poll_ns: None, guest_poll_ns: None },
    Route { irqchip: "kernel", halt_poll_ns: Some(0), guest_poll_ns: None },
    Route { irqchip: "kernel", halt_poll_ns: Some(200_000), guest_poll_ns: None },
    Route { irqchip: "kernel", halt_poll_ns: None, guest_poll_ns: Some(50_000) },
];

/// One row: a path, a wait mode and an APIC mode, on 2 vCPUs.
#[derive(Debug, Clone, Serialize)]
struct Row {
    path: Route,
    label: String,
    /// `spin`, `hlt` or `poll`.
    wait: &'static str,
    apic: &'static str,
    /// Why the row has no figures (e.g. the mode is not available here).
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
    handoff_p50_us: Option<f64>,
    handoff_p99_us: Option<f64>,
    rtt_p50_us: Option<f64>,
    rtt_p99_us: Option<f64>,
    exit_rtt_us: Option<f64>,
    /// The work phase on 2 vCPUs, and on 1 vCPU on the same path (no hand-off waits there).
    work2_ms: Option<f64>,
    work1_ms: Option<f64>,
    /// work2 / work1: below 1, two vCPUs beat one.
    two_vs_one: Option<f64>,
    runs: usize,
}

#[derive(Debug, Serialize)]
struct Headline {
    /// Hand-off p50 of the best wait=hlt row (IPI + wake-up, the path under test) on a fast path
    /// and on the user APIC. Spinning and guest polling avoid the IPI and are reported as
    /// knobs in the rows, not here.
    sync_fast_us: Option<f64>,
    sync_fast_row: Option<String>,
    sync_user_us: Option<f64>,
    sync_user_row: Option<String>,
    /// 1 - fast / user.
    sync_reduction: Option<f64>,
    /// work on 2 vCPUs / on 1 vCPU, on the best fast row.
    two_vs_one_fast: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    command: String,
    host_cpus: usize,
    params: String,
    /// The PV IPI hypercall on this host (`kumo_vmm::placement::pv_probe`): a fast path only where
    /// it works.
    pv_ipi_probe: String,
    rows: Vec<Row>,
    headline: Headline,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// One `kumo run --guest sync`; Err(message) if the VM fails, with exit status 4 meaning the
/// APIC mode is not offered.
fn sync_once(path: &Route, wait: &str, apic: &str, cpus: u32, guest: &[String]) -> Result<SyncResult, String> {
    let mut cmd = Command::new(crate::kumo_binary()?);
    cmd.args(["run", "--timeout", "600", "--cpus", &cpus.to_string(), "--irqchip", path.irqchip]);
    if let Some(ns) = path.halt_poll_ns {
        cmd.args(["--halt-poll-ns", &ns.to_string()]);
    }
    cmd.args(["--guest", "sync", &format!("wait={wait}"), &format!("apic={apic}")]).args(guest);
    if let Some(ns) = path.guest_poll_ns {
        cmd.arg(format!("poll_ns={ns}"));
    }
    let o = cmd.output().map_err(|e| format!("cannot run kumo: {e}"))?;
    let out = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let why = out.lines().chain(err.lines()).rfind(|l| !l.trim().is_empty()).unwrap_or("no output");
        return Err(format!("exit {}: {}", o.status.code().unwrap_or(-1), why.trim()));
    }
    kumo_guests::sync::parse(&out).ok_or_else(|| format!("no result lines in: {out}"))
}

/// Whether this kumo can run a VM on `path` at all (e.g. `--irqchip user` exists here).
fn path_usable(path: &Route) -> Result<(), String> {
    let mut cmd = Command::new(crate::kumo_binary()?);
    cmd.args(["run", "--timeout", "120", "--irqchip", path.irqchip]);
    if let Some(ns) = path.halt_poll_ns {
        cmd.args(["--halt-poll-ns", &ns.to_string()]);
    }
    let o = cmd.args(["--guest", "hello"]).output().map_err(|e| format!("cannot run kumo: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&o.stderr);
        let mut lines = err.lines().map(str::trim).filter(|l| !l.is_empty());
        Err(lines.clone().find(|l| l.contains("error")).or_else(|| lines.next()).unwrap_or("it fails").to_string())
    }
}

fn progress(t0: std::time::Instant, msg: &str) {
    eprintln!("[{:>5.1} s] {msg}", t0.elapsed().as_secs_f64());
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    let t0 = std::time::Instant::now();
    let runs = a.runs.unwrap_or(if a.quick { 7 } else { 15 }).max(1);
    let handoffs = a.handoffs.unwrap_or(if a.quick { 1000 } else { 2000 });
    let guest = vec![
        format!("handoffs={handoffs}"),
        format!("txns={}", a.txns),
        format!("cs={}", a.cs),
        format!("par={}", a.par),
    ];
    if !kumo_vm::vm::kvm_available() {
        return Err("needs /dev/kvm".into());
    }
    // The rows, then `runs` rounds each running every row once (and each irqchip's 1-vCPU work
    // once), so a drift of this shared host touches every row alike.
    let mut rows = Vec::new();
    let mut one_vcpu: Vec<(Route, Vec<f64>)> = Vec::new();
    for path in PATHS {
        let usable = path_usable(&path);
        if let Err(e) = &usable {
            progress(t0, &format!("{}: not available here: {e}", path.label()));
        }
        // The 1-vCPU work time of an irqchip: no hand-off ever waits there, so one per irqchip.
        if usable.is_ok() && path.guest_poll_ns.is_none() && path.halt_poll_ns.is_none() {
            one_vcpu.push((path, Vec::new()));
        }
        let waits: &[&'static str] = if path.guest_poll_ns.is_some() {
            &["poll"]
        } else if path.halt_poll_ns.is_some() {
            &["hlt"]
        } else {
            &["spin", "hlt"]
        };
        for &wait in waits {
            for apic in ["xapic", "x2apic"] {
                rows.push((
                    Row {
                        path,
                        label: path.label(),
                        wait,
                        apic,
                        skipped: usable.as_ref().err().cloned(),
                        handoff_p50_us: None,
                        handoff_p99_us: None,
                        rtt_p50_us: None,
                        rtt_p99_us: None,
                        exit_rtt_us: None,
                        work2_ms: None,
                        work1_ms: None,
                        two_vs_one: None,
                        runs: 0,
                    },
                    Samples::default(),
                ));
            }
        }
    }
    for round in 0..runs {
        for (path, v) in &mut one_vcpu {
            if let Ok(r) = sync_once(path, "hlt", "xapic", 1, &guest) {
                v.push(r.work_ns as f64 / 1e6);
            }
        }
        for (row, samples) in rows.iter_mut().filter(|(r, _)| r.skipped.is_none()) {
            match sync_once(&row.path, row.wait, row.apic, 2, &guest) {
                Ok(r) => {
                    samples.push(&r);
                    row.runs += 1;
                }
                Err(e) => row.skipped = Some(e),
            }
        }
        progress(t0, &format!("round {} of {runs} done", round + 1));
    }
    let rows: Vec<Row> = rows
        .into_iter()
        .map(|(mut row, s)| {
            s.fill(&mut row);
            let w1 = one_vcpu.iter().find(|(p, _)| p.irqchip == row.path.irqchip).and_then(|(_, v)| median(v.clone()));
            row.work1_ms = w1;
            row.two_vs_one = row.work2_ms.zip(w1).map(|(two, one)| two / one);
            row
        })
        .collect();
    let headline = headline(&rows);
    let pv_ipi_probe = match kumo_vm::vm::open_kvm() {
        Ok(kvm) => {
            use kumo_vmm::placement::pv_probe::{probe_pv_ipi, PvIpiProbe, PV_IPI_PROBE_LIMIT};
            match probe_pv_ipi(&kvm, PV_IPI_PROBE_LIMIT) {
                PvIpiProbe::Works(_) => "works (not yet a sync path: the guest sends by APIC)".into(),
                PvIpiProbe::Hangs => {
                    format!("hangs the vCPU (no return in {} s): refused", PV_IPI_PROBE_LIMIT.as_secs())
                }
                other => format!("unusable: {other:?}"),
            }
        }
        Err(e) => format!("not probed: {e}"),
    };
    progress(t0, &format!("PV IPI hypercall: {pv_ipi_probe}"));
    let report = Report {
        bench: "ipi",
        command: std::env::args().collect::<Vec<_>>().join(" "),
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        params: guest.join(" "),
        pv_ipi_probe,
        rows,
        headline,
    };
    print!("{}", table(&report));
    let json = crate::out_file(out, "ipi.json")?;
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("\nJSON written to {}", json.display());
    let png = out.join("ipi.png");
    match plot(&png, &report) {
        Ok(()) => println!("plot written to {}", png.display()),
        Err(e) => eprintln!("kumo bench ipi: no plot: {e}"),
    }
    println!("{}", headline_line(&report.headline));
    Ok(0)
}

/// One row's samples over the rounds; medians at the end.
#[derive(Default)]
struct Samples {
    h50: Vec<f64>,
    h99: Vec<f64>,
    r50: Vec<f64>,
    r99: Vec<f64>,
    exit: Vec<f64>,
    work2: Vec<f64>,
}

impl Samples {
    fn push(&mut self, r: &SyncResult) {
        if let Some(h) = r.handoff {
            self.h50.push(us(h.p50));
            self.h99.push(us(h.p99));
        }
        if let Some(t) = r.rtt {
            self.r50.push(us(t.p50));
            self.r99.push(us(t.p99));
        }
        self.exit.push(us(r.exit_rtt_ns));
        self.work2.push(r.work_ns as f64 / 1e6);
    }

    fn fill(self, row: &mut Row) {
        if row.skipped.is_some() {
            return;
        }
        row.handoff_p50_us = median(self.h50);
        row.handoff_p99_us = median(self.h99);
        row.rtt_p50_us = median(self.r50);
        row.rtt_p99_us = median(self.r99);
        row.exit_rtt_us = median(self.exit);
        row.work2_ms = median(self.work2);
    }
}

fn headline(rows: &[Row]) -> Headline {
    let best = |user: bool| {
        rows.iter()
            .filter(|r| r.path.is_user() == user && r.wait == "hlt")
            .filter_map(|r| Some((r.handoff_p50_us?, r)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    let (fast, user) = (best(false), best(true));
    let name = |r: &Row| format!("{} wait={} {}", r.label, r.wait, r.apic);
    Headline {
        sync_fast_us: fast.map(|f| f.0),
        sync_fast_row: fast.map(|f| name(f.1)),
        sync_user_us: user.map(|u| u.0),
        sync_user_row: user.map(|u| name(u.1)),
        sync_reduction: fast.zip(user).map(|(f, u)| 1.0 - f.0 / u.0),
        two_vs_one_fast: fast.and_then(|f| f.1.two_vs_one),
    }
}

fn headline_line(h: &Headline) -> String {
    let f = |v: Option<f64>, digits: usize| v.map_or("na".to_string(), |v| format!("{v:.digits$}"));
    format!(
        "sync_fast_us={} sync_user_us={} sync_reduction={} two_vs_one_fast={}",
        f(h.sync_fast_us, 1),
        f(h.sync_user_us, 1),
        f(h.sync_reduction, 3),
        f(h.two_vs_one_fast, 3)
    )
}

fn table(r: &Report) -> String {
    use std::fmt::Write;
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nkumo bench ipi: 2 vCPUs pass a semaphore round robin ({}); medians of {} runs",
        r.params,
        r.rows.iter().map(|x| x.runs).max().unwrap_or(0)
    );
    let _ = writeln!(
        s,
        "{:<34} {:<5} {:<6} {:>10} {:>10} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7}",
        "path", "wait", "apic", "handoff50", "handoff99", "rtt50", "rtt99", "exit", "work2 ms", "work1 ms", "2v/1v"
    );
    for x in &r.rows {
        if let Some(why) = &x.skipped {
            let _ = writeln!(s, "{:<34} {:<5} {:<6} skipped: {why}", x.label, x.wait, x.apic);
            continue;
        }
        let _ = writeln!(
            s,
            "{:<34} {:<5} {:<6} {:>10} {:>10} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7}{}",
            x.label,
            x.wait,
            x.apic,
            f(x.handoff_p50_us),
            f(x.handoff_p99_us),
            f(x.rtt_p50_us),
            f(x.rtt_p99_us),
            f(x.exit_rtt_us),
            f(x.work2_ms),
            f(x.work1_ms),
            x.two_vs_one.map_or("-".into(), |v| format!("{v:.2}")),
            match x.two_vs_one {
                Some(v) if v >= 1.0 => "  (2 vCPUs do not beat 1)",
                _ => "",
            }
        );
    }
    let _ = writeln!(s, "times in microseconds unless marked; exit = a VM-exit round trip (port read), the unit");
    let _ = writeln!(s, "KVM PV IPI hypercall: {}", r.pv_ipi_probe);
    let h = &r.headline;
    let _ = writeln!(
        s,
        "best fast path: {} ; user APIC: {}",
        h.sync_fast_row.as_deref().unwrap_or("n/a"),
        h.sync_user_row.as_deref().unwrap_or("n/a (no --irqchip user here)")
    );
    s
}

fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let rows: Vec<&Row> = r.rows.iter().filter(|x| x.handoff_p50_us.is_some()).collect();
    let root = BitMapBackend::new(path, (2700, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let (left, right) = root.split_horizontally(1400);
    let n = rows.len().max(1) as f64;
    // Short labels (the table has the long ones): path, wait, APIC mode.
    let short = |x: &Row| {
        let p = match (x.path.irqchip, x.path.halt_poll_ns, x.path.guest_poll_ns) {
            ("user", ..) => "user".to_string(),
            (k, Some(ns), _) => format!("{k} hp{}", ns / 1000),
            (k, _, Some(ns)) => format!("{k} gp{}", ns / 1000),
            (k, ..) => k.to_string(),
        };
        format!("{p} {} {}", x.wait, if x.apic == "x2apic" { "x2" } else { "x" })
    };
    let names: Vec<String> = rows.iter().map(|x| short(x)).collect();
    let label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 0.01 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let top = rows.iter().filter_map(|x| x.handoff_p99_us).fold(1.0, f64::max) * 1.5;
    let mut c = ChartBuilder::on(&left)
        .caption("semaphore hand-off between 2 vCPUs, p50 / p99 (us, log)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(65)
        .build_cartesian_2d(-0.5f64..n - 0.5, (0.05f64..top).log_scale())
        .map_err(e)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1))
        .x_label_formatter(&label)
        .x_label_style(("sans-serif", 10))
        .y_desc("microseconds")
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    for (k, col) in [BLUE, RED].into_iter().enumerate() {
        let bars = rows.iter().enumerate().filter_map(|(i, x)| {
            let v = if k == 0 { x.handoff_p50_us } else { x.handoff_p99_us }?;
            let x0 = i as f64 - 0.38 + k as f64 * 0.38;
            Some(Rectangle::new([(x0, 0.05), (x0 + 0.36, v.max(0.06))], col.mix(0.8).filled()))
        });
        c.draw_series(bars)
            .map_err(e)?
            .label(if k == 0 { "p50" } else { "p99" })
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.mix(0.8).filled()));
    }
    c.configure_series_labels().label_font(("sans-serif", 14)).border_style(BLACK).draw().map_err(e)?;

    let top = rows.iter().filter_map(|x| x.two_vs_one).fold(1.2, f64::max) * 1.1;
    let mut c = ChartBuilder::on(&right)
        .caption("work on 2 vCPUs / on 1 (below 1: 2 win)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..top)
        .map_err(e)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1))
        .x_label_formatter(&label)
        .x_label_style(("sans-serif", 10))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    c.draw_series(rows.iter().enumerate().filter_map(|(i, x)| {
        let v = x.two_vs_one?;
        let col = if v < 1.0 { GREEN } else { RED };
        Some(Rectangle::new([(i as f64 - 0.3, 0.0), (i as f64 + 0.3, v)], col.mix(0.7).filled()))
    }))
    .map_err(e)?;
    c.draw_series(LineSeries::new([(-0.5, 1.0), (n - 0.5, 1.0)], BLACK.stroke_width(1))).map_err(e)?;
    root.present().map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: Route, wait: &'static str, h50: Option<f64>, ratio: Option<f64>) -> Row {
        Row {
            path,
            label: path.label(),
            wait,
            apic: "xapic",
            skipped: None,
            handoff_p50_us: h50,
            handoff_p99_us: h50.map(|v| v * 3.0),
            rtt_p50_us: h50.map(|v| v * 2.0),
            rtt_p99_us: None,
            exit_rtt_us: Some(25.0),
            work2_ms: ratio.map(|r| r * 100.0),
            work1_ms: ratio.map(|_| 100.0),
            two_vs_one: ratio,
            runs: 3,
        }
    }

    fn sample() -> Vec<Row> {
        vec![
            row(PATHS[0], "hlt", Some(300.0), Some(1.4)),
            row(PATHS[0], "spin", Some(1.0), Some(0.6)),
            row(PATHS[1], "hlt", Some(90.0), Some(1.1)),
            row(PATHS[1], "spin", Some(0.5), Some(0.55)),
            row(PATHS[5], "poll", Some(60.0), Some(0.8)),
            row(PATHS[2], "hlt", None, None),
        ]
    }

    #[test]
    fn the_headline_compares_ipi_wakeups_best_against_best() {
        let h = headline(&sample());
        assert_eq!(h.sync_fast_us, Some(90.0));
        assert_eq!(h.sync_fast_row.as_deref(), Some("kernel LAPIC wait=hlt xapic"));
        assert_eq!(h.sync_user_us, Some(300.0));
        assert!((h.sync_reduction.unwrap() - 0.7).abs() < 1e-9);
        assert_eq!(h.two_vs_one_fast, Some(1.1));
        assert_eq!(
            headline_line(&h),
            "sync_fast_us=90.0 sync_user_us=300.0 sync_reduction=0.700 two_vs_one_fast=1.100"
        );
        // Without a user APIC row the comparison is n/a, not invented.
        let h = headline(&sample()[2..]);
        assert_eq!(headline_line(&h), "sync_fast_us=90.0 sync_user_us=na sync_reduction=na two_vs_one_fast=1.100");
    }

    #[test]
    fn the_table_marks_skipped_rows_and_where_two_vcpus_lose() {
        let mut rows = sample();
        rows[5].skipped = Some("exit 1: no such mode".into());
        let r = Report {
            bench: "ipi",
            command: "kumo-bench ipi".into(),
            host_cpus: 2,
            params: "handoffs=10".into(),
            pv_ipi_probe: "hangs".into(),
            headline: headline(&rows),
            rows,
        };
        let t = table(&r);
        assert!(t.contains("skipped: exit 1: no such mode"), "{t}");
        assert_eq!(t.matches("(2 vCPUs do not beat 1)").count(), 2, "{t}");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn plot_draws_a_png() {
        let rows = sample();
        let r = Report {
            bench: "ipi",
            command: String::new(),
            host_cpus: 2,
            params: String::new(),
            pv_ipi_probe: String::new(),
            headline: headline(&rows),
            rows,
        };
        crate::check_plot("ipi", |p| plot(p, &r));
    }
}
