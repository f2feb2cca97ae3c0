//! `kumo bench numa` (issue 12): a memory-bound parallel kernel (the `numabench` program: a
//! STREAM triad and a CG-like sparse pass) run as a host process with threads pinned to CPUs
//! 0..N (bare metal) and as a kumo guest with N vCPUs in VMs: vNUMA mirrored (pinned), pinned
//! without NUMA, unpinned, and pinned with PV hints off (`--pv shared`) and on (`--pv
//! dedicated`). Runs are interleaved (one of each row per round) so drift on the shared host
//! hits every row alike; each row's median run time is reported relative to bare metal's.
//! Prints a table, writes numa.json and numa.png, and ends with
//! `vm_vs_bare=X unpinned_vs_bare=Y`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kumo_guests::numabench;
use serde::Serialize;

use crate::net::stats::median;
use crate::report::{opt, ratio, step};
use kumo_testkit::Kid;

#[derive(clap::Args)]
pub struct Args {
    /// Fewer, shorter runs (about 35 s on a quiet 2-core host).
    #[arg(long)]
    quick: bool,
    /// Runs of each row (medians are reported) [default: 9, --quick 5].
    #[arg(long)]
    runs: Option<usize>,
    /// Threads / vCPUs [default: the host's online CPUs].
    #[arg(long)]
    vcpus: Option<u32>,
    /// MiB per triad array (three arrays, split across the threads).
    #[arg(long, default_value_t = 64)]
    mb: u64,
    /// MiB of sparse matrix (x and y add a quarter of it).
    #[arg(long, default_value_t = 64)]
    smb: u64,
    /// Timed sweeps of each kernel per run [default: 20, --quick 5].
    #[arg(long)]
    iters: Option<u64>,
}

/// A configuration measured: bare metal or a VM shape.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Row {
    Bare,
    Mirror,
    Pinned,
    Unpinned,
    PvShared,
    PvDedicated,
}

pub const ROWS: [Row; 6] = [Row::Bare, Row::Mirror, Row::Pinned, Row::Unpinned, Row::PvShared, Row::PvDedicated];

impl Row {
    pub fn label(self) -> &'static str {
        match self {
            Row::Bare => "bare metal (pinned threads)",
            Row::Mirror => "VM --numa mirror (pinned)",
            Row::Pinned => "VM pinned, no NUMA",
            Row::Unpinned => "VM unpinned",
            Row::PvShared => "VM pinned, --pv shared",
            Row::PvDedicated => "VM pinned, --pv dedicated",
        }
    }

    /// `kumo run` flags of the VM rows (None for bare metal).
    pub fn kumo_flags(self, vcpus: u32) -> Option<Vec<String>> {
        let pins: Vec<String> = (0..vcpus).map(|v| format!("{v}@{v}")).collect();
        let pinned = format!("{vcpus},pin={}", pins.join(":"));
        let f = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect());
        match self {
            Row::Bare => None,
            Row::Mirror => f(&["--cpus", &vcpus.to_string(), "--numa", "mirror"]),
            Row::Pinned => f(&["--cpus", &pinned]),
            Row::Unpinned => f(&["--cpus", &vcpus.to_string()]),
            Row::PvShared => f(&["--cpus", &pinned, "--pv", "shared"]),
            Row::PvDedicated => f(&["--cpus", &pinned, "--pv", "dedicated"]),
        }
    }
}

/// One row's runs and their medians.
#[derive(Serialize, Debug, Clone)]
pub struct RowResult {
    pub row: Row,
    pub label: &'static str,
    /// The command's flags (kumo run ... or the host program's).
    pub command: String,
    /// TSC cycles (triad + sparse) of each successful run.
    pub total_cycles: Vec<u64>,
    pub triad_cycles: Vec<u64>,
    pub sparse_cycles: Vec<u64>,
    /// Fastest triad sweep + fastest sparse pass of each run: the least disturbed figure.
    pub best_cycles: Vec<u64>,
    pub total_median: Option<f64>,
    pub triad_median: Option<f64>,
    pub sparse_median: Option<f64>,
    pub best_median: Option<f64>,
    /// total_median / bare metal's.
    pub vs_bare: Option<f64>,
    pub triad_vs_bare: Option<f64>,
    pub sparse_vs_bare: Option<f64>,
    pub best_vs_bare: Option<f64>,
    pub errors: Vec<String>,
}

impl RowResult {
    pub fn new(row: Row, command: String) -> Self {
        RowResult {
            row,
            label: row.label(),
            command,
            total_cycles: vec![],
            triad_cycles: vec![],
            sparse_cycles: vec![],
            best_cycles: vec![],
            total_median: None,
            triad_median: None,
            sparse_median: None,
            best_median: None,
            vs_bare: None,
            triad_vs_bare: None,
            sparse_vs_bare: None,
            best_vs_bare: None,
            errors: vec![],
        }
    }

    pub fn push(&mut self, r: &numabench::Result) {
        self.total_cycles.push(r.total_cycles);
        self.triad_cycles.push(r.triad_cycles);
        self.sparse_cycles.push(r.sparse_cycles);
        self.best_cycles.push(r.best_triad + r.best_sparse);
    }
}

#[derive(Serialize, Debug)]
pub struct Report {
    pub bench: &'static str,
    pub host_cpus: usize,
    pub vcpus: u32,
    pub mb: u64,
    pub smb: u64,
    pub iters: u64,
    pub runs: usize,
    pub memory_mib: u64,
    /// TSC frequency (kHz) the guest was told; cycles convert to ms with it.
    pub tsc_khz: u64,
    /// Share of the host's CPU time (0..1) other processes used in the second before the run:
    /// on a shared host the rows are comparable with each other, not with a quiet machine.
    pub host_busy_before: Option<f64>,
    pub rows: Vec<RowResult>,
    /// Mirrored + pinned VM / bare metal, and unpinned VM / bare metal (median totals).
    pub vm_vs_bare: Option<f64>,
    pub unpinned_vs_bare: Option<f64>,
}

fn med(v: &[u64]) -> Option<f64> {
    median(&v.iter().map(|&c| c as f64).collect::<Vec<_>>())
}

/// Fills in every row's medians and its ratios to the bare-metal row, and the headline.
pub fn finish(r: &mut Report) {
    for x in &mut r.rows {
        x.total_median = med(&x.total_cycles);
        x.triad_median = med(&x.triad_cycles);
        x.sparse_median = med(&x.sparse_cycles);
        x.best_median = med(&x.best_cycles);
    }
    let bare = r
        .rows
        .iter()
        .find(|x| x.row == Row::Bare)
        .map(|b| (b.total_median, b.triad_median, b.sparse_median, b.best_median));
    let (bt, btr, bsp, bb) = bare.unwrap_or((None, None, None, None));
    for x in &mut r.rows {
        x.vs_bare = ratio(x.total_median, bt);
        x.triad_vs_bare = ratio(x.triad_median, btr);
        x.sparse_vs_bare = ratio(x.sparse_median, bsp);
        x.best_vs_bare = ratio(x.best_median, bb);
    }
    let of = |row: Row| r.rows.iter().find(|x| x.row == row).and_then(|x| x.vs_bare);
    r.vm_vs_bare = of(Row::Mirror);
    r.unpinned_vs_bare = of(Row::Unpinned);
}

/// (busy, total) jiffies of the `cpu` line of /proc/stat.
pub fn cpu_jiffies(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).unwrap_or(&0);
    Some((total - idle, total))
}

/// The share of host CPU time in use over `period` (None where /proc/stat is unreadable).
fn host_busy(period: Duration) -> Option<f64> {
    let read = || cpu_jiffies(&std::fs::read_to_string("/proc/stat").ok()?);
    let (b0, t0) = read()?;
    std::thread::sleep(period);
    let (b1, t1) = read()?;
    (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64)
}

/// The final line: `vm_vs_bare=X unpinned_vs_bare=Y` (n/a for a row without runs).
pub fn headline(r: &Report) -> String {
    format!("vm_vs_bare={} unpinned_vs_bare={}", opt(r.vm_vs_bare, 3), opt(r.unpinned_vs_bare, 3))
}

pub fn table(r: &Report) -> String {
    let ms = |c: Option<f64>| opt(c.filter(|_| r.tsc_khz > 0).map(|c| c / r.tsc_khz as f64), 1);
    let mut s = format!(
        "numabench: {} threads, triad 3 x {} MiB, sparse {} MiB (+{} MiB x, y), {} timed sweeps; median of {} runs\n",
        r.vcpus,
        r.mb,
        r.smb,
        r.smb / 4,
        r.iters,
        r.runs
    );
    if let Some(b) = r.host_busy_before.filter(|b| *b > 0.1) {
        s += &format!("note: other processes used {:.0} % of the host's CPUs before the run\n", b * 100.0);
    }
    s += "(x: median over bare metal's median; best: fastest sweep of each kernel per run)\n";
    s += &format!(
        "{:<28} {:>4} {:>9} {:>9} {:>9} {:>7} {:>8} {:>7} {:>7}  {}\n",
        "row",
        "runs",
        "triad ms",
        "sparse ms",
        "total ms",
        "triad x",
        "sparse x",
        "best x",
        "vs bare",
        "spread (total ms)"
    );
    for x in &r.rows {
        let (lo, hi) = (x.total_cycles.iter().min(), x.total_cycles.iter().max());
        let spread = match (lo, hi) {
            (Some(&lo), Some(&hi)) => format!("{}..{}", ms(Some(lo as f64)), ms(Some(hi as f64))),
            _ => "-".into(),
        };
        s += &format!(
            "{:<28} {:>4} {:>9} {:>9} {:>9} {:>7} {:>8} {:>7} {:>7}  {}\n",
            x.label,
            x.total_cycles.len(),
            ms(x.triad_median),
            ms(x.sparse_median),
            ms(x.total_median),
            opt(x.triad_vs_bare, 3),
            opt(x.sparse_vs_bare, 3),
            opt(x.best_vs_bare, 3),
            opt(x.vs_bare, 3),
            spread
        );
        for e in x.errors.iter().take(2) {
            s += &format!("    error: {e}\n");
        }
    }
    s
}

fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let root = BitMapBackend::new(path, (1200, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let names: Vec<&str> = r.rows.iter().map(|x| x.label).collect();
    let top =
        r.rows.iter().flat_map(|x| [x.vs_bare, x.triad_vs_bare, x.sparse_vs_bare]).flatten().fold(1.2, f64::max) * 1.3;
    let n = r.rows.len().max(1) as f64;
    let mut c = ChartBuilder::on(&root)
        .caption(
            format!("numabench run time relative to bare metal ({} threads/vCPUs, median of {})", r.vcpus, r.runs),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..top)
        .map_err(e)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(r.rows.len().max(1))
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 0.01 && i >= 0.0 {
                names.get(i as usize).map(|s| s.to_string()).unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("time / bare metal's")
        .y_label_formatter(&|v| format!("{v:.2}"))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(e)?;
    c.draw_series(LineSeries::new([(-0.5, 1.0), (n - 0.5, 1.0)], BLACK.stroke_width(2)))
        .map_err(e)?
        .label("bare metal")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    type Get = fn(&RowResult) -> Option<f64>;
    let series: [(&str, RGBColor, Get); 3] =
        [("triad", BLUE, |x| x.triad_vs_bare), ("sparse", RED, |x| x.sparse_vs_bare), ("total", GREEN, |x| x.vs_bare)];
    for (k, (label, col, get)) in series.into_iter().enumerate() {
        let bars: Vec<_> = r
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, x)| {
                let x0 = i as f64 - 0.39 + k as f64 * 0.26;
                Some(Rectangle::new([(x0, 0.0), (x0 + 0.24, get(x)?)], col.mix(0.75).filled()))
            })
            .collect();
        c.draw_series(bars)
            .map_err(e)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.mix(0.75).filled()));
    }
    c.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// Guest memory for the arrays: 3 triad arrays, the matrix, x and y, plus the image, 2 MiB
/// rounding per thread and room to spare, rounded up to 64 MiB.
pub fn memory_mib(mb: u64, smb: u64, vcpus: u32) -> u64 {
    let need = 3 * mb + smb + smb / 4 + 4 * vcpus as u64 + 64;
    need.div_ceil(64) * 64
}

/// Runs `argv` to its end and parses its result line; the checksum must match `want`.
fn run_once(argv: &[String], limit: Duration, want: Option<u64>) -> Result<numabench::Result, String> {
    let mut p = Kid::start_in(None, argv)?;
    let code = p.wait_exit(limit)?;
    let out: Vec<String> = p.lines().into_iter().map(|(_, l)| l).collect();
    let out = out.join("\n");
    if code != 0 {
        let last = out.lines().last().unwrap_or("");
        return Err(p.why(&format!("exited with {code} ({last})")));
    }
    let r = numabench::parse(&out).ok_or_else(|| p.why(&format!("printed no result line: {out}")))?;
    match want {
        Some(w) if w != r.check => Err(format!("checksum {:x} differs from bare metal's {w:x}", r.check)),
        _ => Ok(r),
    }
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    let t0 = Instant::now();
    let json = crate::out_file(out, "numa.json")?;
    let png = out.join("numa.png");
    let host_cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let vcpus = a.vcpus.unwrap_or(host_cpus as u32);
    if vcpus == 0 || vcpus > 64 {
        return Err(format!("--vcpus {vcpus}: must be 1..64"));
    }
    if a.mb == 0 || a.smb == 0 {
        return Err("--mb and --smb must be at least 1".into());
    }
    let runs = a.runs.unwrap_or(if a.quick { 5 } else { 9 });
    let iters = a.iters.unwrap_or(if a.quick { 5 } else { 20 });
    if runs == 0 || iters == 0 {
        return Err("--runs and --iters must be at least 1".into());
    }
    let host: PathBuf = kumo_guests::host_program("numabench").map_err(|e| e.to_string())?;
    let kumo = crate::kumo_binary()?;
    let memory_mib = memory_mib(a.mb, a.smb, vcpus);
    let params = [format!("mb={}", a.mb), format!("smb={}", a.smb), format!("iters={iters}")];
    let limit = Duration::from_secs(300);

    let argv_of = |row: Row| -> Vec<String> {
        match row.kumo_flags(vcpus) {
            None => {
                let mut v = vec![host.display().to_string(), format!("threads={vcpus}")];
                v.extend(params.iter().cloned());
                v
            }
            Some(flags) => {
                let mut v = vec![kumo.display().to_string(), "run".into(), "--guest".into(), "numabench".into()];
                v.extend(flags);
                v.extend(["--memory".into(), format!("{memory_mib}M"), "--timeout".into(), "300".into(), "--".into()]);
                v.extend(params.iter().cloned());
                v
            }
        }
    };
    let host_busy_before = host_busy(Duration::from_secs(1));
    let mut rows: Vec<RowResult> = ROWS.iter().map(|&r| RowResult::new(r, argv_of(r)[1..].join(" "))).collect();
    let mut want: Option<u64> = None;
    let mut tsc_khz = 0;
    step(t0, &format!("{runs} rounds of {} rows, {vcpus} threads/vCPUs, {iters} sweeps a run", rows.len()));
    for round in 0..runs {
        // Rows in a rotating order, bare metal first in the first round (its checksum checks
        // the VMs'), so no row always follows the same one. A pause between runs lets the
        // previous VM's memory be freed before the next run starts.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.rotate_left(round % rows.len());
        for i in order {
            std::thread::sleep(Duration::from_millis(300));
            match run_once(&argv_of(rows[i].row), limit, want) {
                Ok(r) => {
                    if rows[i].row == Row::Bare {
                        want.get_or_insert(r.check);
                    } else if tsc_khz == 0 {
                        tsc_khz = r.tsc_khz;
                    }
                    rows[i].push(&r);
                }
                Err(e) => rows[i].errors.push(e),
            }
        }
        step(t0, &format!("round {}/{runs} done", round + 1));
    }
    let mut report = Report {
        bench: "numa",
        host_cpus,
        vcpus,
        mb: a.mb,
        smb: a.smb,
        iters,
        runs,
        memory_mib,
        tsc_khz,
        host_busy_before,
        rows,
        vm_vs_bare: None,
        unpinned_vs_bare: None,
    };
    finish(&mut report);
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    if let Err(e) = plot(&png, &report) {
        eprintln!("kumo-bench: numa.png not drawn: {e}");
    }
    print!("{}", table(&report));
    println!("wrote {} and {}", json.display(), png.display());
    println!("{}", headline(&report));
    Ok(if report.rows[0].total_cycles.is_empty() { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_testkit::sv;

    fn res(total: u64) -> numabench::Result {
        numabench::Result {
            threads: 2,
            triad_cycles: total / 4,
            sparse_cycles: total - total / 4,
            total_cycles: total,
            best_triad: total / 40,
            best_sparse: total / 20,
            tsc_khz: 1_000_000,
            check: 7,
        }
    }

    fn report(per_row: &[&[u64]]) -> Report {
        let rows = ROWS
            .iter()
            .zip(per_row)
            .map(|(&row, totals)| {
                let mut x = RowResult::new(row, String::new());
                totals.iter().for_each(|&t| x.push(&res(t)));
                x
            })
            .collect();
        let mut r = Report {
            bench: "numa",
            host_cpus: 2,
            vcpus: 2,
            mb: 64,
            smb: 64,
            iters: 8,
            runs: 3,
            memory_mib: 320,
            tsc_khz: 1_000_000,
            host_busy_before: Some(0.5),
            rows,
            vm_vs_bare: None,
            unpinned_vs_bare: None,
        };
        finish(&mut r);
        r
    }

    #[test]
    fn ratios_are_medians_over_bare_metals_median() {
        let r = report(&[&[1000, 4000, 10_000], &[1100, 1050, 9000, 1000], &[1200], &[2000, 3000, 1000], &[], &[1000]]);
        assert_eq!(r.rows[0].total_median, Some(4000.0));
        assert_eq!(r.rows[1].total_median, Some(1075.0), "even count: mean of the middle two");
        assert_eq!(r.vm_vs_bare, Some(1075.0 / 4000.0));
        assert_eq!(r.unpinned_vs_bare, Some(0.5));
        assert_eq!(r.rows[3].triad_vs_bare, Some(500.0 / 1000.0));
        assert_eq!(r.rows[3].best_vs_bare, Some(150.0 / 300.0));
        assert_eq!(r.rows[4].vs_bare, None, "no runs: no ratio");
        assert_eq!(headline(&r), "vm_vs_bare=0.269 unpinned_vs_bare=0.500");
    }

    #[test]
    fn without_bare_metal_there_are_no_ratios() {
        let r = report(&[&[], &[1000], &[1000], &[1000], &[1000], &[1000]]);
        assert!(r.rows.iter().all(|x| x.vs_bare.is_none()));
        assert_eq!(headline(&r), "vm_vs_bare=n/a unpinned_vs_bare=n/a");
    }

    #[test]
    fn table_names_every_row_in_ms_and_errors() {
        let mut r = report(&[&[2_000_000], &[2_100_000], &[2_000_000], &[3_000_000], &[], &[2_000_000]]);
        r.rows[4].errors.push("kumo exited with 1".into());
        let t = table(&r);
        for row in ROWS {
            assert!(t.contains(row.label()), "{t}");
        }
        assert!(t.contains(" 2.1 ") && t.contains("1.050") && t.contains("1.500"), "{t}");
        assert!(t.contains("error: kumo exited with 1"), "{t}");
        assert!(t.contains("other processes used 50 %"), "{t}");
        assert_eq!(t.lines().filter(|l| l.contains("n/a")).count(), 1, "{t}");
    }

    #[test]
    fn vm_rows_pin_as_asked() {
        assert_eq!(Row::Bare.kumo_flags(2), None);
        assert_eq!(Row::Pinned.kumo_flags(2).unwrap(), ["--cpus", "2,pin=0@0:1@1"]);
        assert_eq!(Row::Mirror.kumo_flags(2).unwrap(), ["--cpus", "2", "--numa", "mirror"]);
        assert_eq!(Row::Unpinned.kumo_flags(1).unwrap(), ["--cpus", "1"]);
        assert_eq!(Row::PvDedicated.kumo_flags(1).unwrap(), ["--cpus", "1,pin=0@0", "--pv", "dedicated"]);
        assert_eq!(Row::PvShared.kumo_flags(2).unwrap()[3], "shared");
        assert_eq!(memory_mib(64, 64, 2), 384);
        assert_eq!(memory_mib(1, 1, 1), 128);
    }

    #[test]
    fn proc_stat_cpu_line() {
        let stat = "cpu  100 5 50 800 20 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(cpu_jiffies(stat), Some((160, 980)));
        assert_eq!(cpu_jiffies("cpu0 1 2 3\n"), None);
        assert_eq!(cpu_jiffies("cpu  1 x 3 4\n"), None);
    }

    /// The guest and hosted builds compute the same thing (equal checksums) on a tiny input.
    #[test]
    fn guest_and_host_builds_agree() {
        let host = kumo_guests::host_program("numabench").unwrap().display().to_string();
        let args = ["mb=1", "smb=1", "iters=2"];
        let mut argv = sv(&[&host, "threads=2"]);
        argv.extend(sv(&args));
        let bare = run_once(&argv, Duration::from_secs(120), None).unwrap();
        assert_eq!((bare.threads, bare.total_cycles > 0), (2, true));
        assert!(bare.best_triad <= bare.triad_cycles && bare.best_sparse <= bare.sparse_cycles);
        if !Path::new("/dev/kvm").exists() {
            println!("skipping the VM half: no /dev/kvm");
            return;
        }
        let Ok(kumo) = crate::kumo_binary() else {
            println!("skipping the VM half: no kumo binary (cargo build -p kumo-cli)");
            return;
        };
        let mut argv = sv(&[&kumo.display().to_string(), "run", "--guest", "numabench", "--cpus", "2"]);
        argv.extend(sv(&["--memory", "128M", "--timeout", "120", "--"]));
        argv.extend(sv(&args));
        let vm = run_once(&argv, Duration::from_secs(150), Some(bare.check)).unwrap();
        assert_eq!(vm.threads, 2);
    }

    #[test]
    fn json_and_plot() {
        let r = report(&[&[1000], &[1040], &[1000], &[1500], &[1000], &[990]]);
        let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["rows"][1]["row"], "mirror");
        assert_eq!(v["vm_vs_bare"], 1.04);
        let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("numa-plot-")).unwrap();
        let png = dir.as_path().join("numa.png");
        match plot(&png, &r) {
            Ok(()) => assert!(std::fs::metadata(&png).unwrap().len() > 1000),
            Err(e) => println!("skipping the plot check: {e}"),
        }
    }
}
