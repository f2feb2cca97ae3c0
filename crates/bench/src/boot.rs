//! `kumo bench boot`: start-up and IPI round trips, each against a baseline taken in the same
//! run; prints a table and writes `boot.json`. Absolute times on a shared, nested host are
//! noise; ratios are the result.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kumo_vmm::monotonic_ns;
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// Runs per measurement (medians are reported).
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// IPI round trips per smp run.
    #[arg(long, default_value_t = 2000)]
    iters: u64,
}

#[derive(Serialize)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
    runs: usize,
}

fn stat(mut v: Vec<f64>) -> Stat {
    v.sort_by(|a, b| a.total_cmp(b));
    Stat { median: v[v.len() / 2], min: v[0], max: v[v.len() - 1], runs: v.len() }
}

#[derive(Serialize)]
struct BootResult {
    /// `kumo --version`: spawning and reaping the kumo process (the baseline).
    exec_ms: Stat,
    /// From spawn to: VM built and vCPUs started, guest entry (marker port), first serial byte, exit.
    vm_built_ms: Stat,
    guest_entry_ms: Stat,
    first_output_ms: Stat,
    exit_ms: Stat,
    /// first_output / exec (medians).
    first_output_over_exec: f64,
}

#[derive(Serialize)]
struct IpiResult {
    irqchip: String,
    ipi_rtt_ns_p50: Stat,
    exit_rtt_ns_p50: Stat,
    /// IPI round trip / VM-exit round trip (medians).
    ipi_over_exit: f64,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    host_cpus: usize,
    command: String,
    boot: BootResult,
    ipi: Vec<IpiResult>,
}

fn kumo() -> Result<PathBuf, String> {
    crate::kumo_binary()
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn exec_once() -> Result<f64, String> {
    let t0 = monotonic_ns();
    let st = Command::new(kumo()?).arg("--version").stdout(Stdio::null()).status().map_err(|e| e.to_string())?;
    if !st.success() {
        return Err("kumo --version failed".into());
    }
    Ok(ms(monotonic_ns() - t0))
}

/// One `kumo run --guest hello`: (vm built, guest entry, first output, exit) in ms from spawn.
fn hello_once(tmp: &std::path::Path) -> Result<[f64; 4], String> {
    let t0 = monotonic_ns();
    let st = Command::new(kumo()?)
        .args(["run", "--guest", "hello", "--timeout", "60", "--timings-json"])
        .arg(tmp)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    let t_exit = monotonic_ns();
    if !st.success() {
        return Err(format!("hello exited with {st}"));
    }
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let at = |k: &str| j[k].as_u64().map(|v| ms(v.saturating_sub(t0))).ok_or(format!("timings lack {k}"));
    Ok([at("vcpus_started_ns")?, at("guest_entry_ns")?, at("first_output_ns")?, ms(t_exit - t0)])
}

fn smp_once(irqchip: &str, iters: u64) -> Result<(f64, f64), String> {
    let out = Command::new(kumo()?)
        .args(["run", "--guest", "smp", "--cpus", "2", "--irqchip", irqchip, "--timeout", "300"])
        .arg(format!("iters={iters}"))
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("smp failed: {text}{}", String::from_utf8_lossy(&out.stderr)));
    }
    let get = |prefix: &str, key: &str| -> Result<f64, String> {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .flat_map(|l| l.split_whitespace())
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .ok_or(format!("no {key} in smp output: {text}"))
    };
    Ok((get("smp: ipi_rtt_ns", "p50=")?, get("smp: exit_rtt_ns", "p50=")?))
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    let Args { runs, iters } = a;
    let json = crate::out_file(out, "boot.json")?;
    if runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Each run's --timings-json; removed with the directory.
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-bench-boot-"))
        .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
    let tmp = dir.as_path().join("timings.json");
    // Interleave baseline and measurement so drifting host load hits both alike.
    let (mut exec, mut built, mut entry, mut first, mut exit) = (vec![], vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        exec.push(exec_once()?);
        let [b, e, f, x] = hello_once(&tmp)?;
        built.push(b);
        entry.push(e);
        first.push(f);
        exit.push(x);
        if tty {
            eprint!("\rboot: run {}/{runs}", i + 1);
        } else if i + 1 == runs {
            eprint!("boot: {runs} runs done");
        }
    }
    eprintln!();
    let boot = BootResult {
        first_output_over_exec: 0.0,
        exec_ms: stat(exec),
        vm_built_ms: stat(built),
        guest_entry_ms: stat(entry),
        first_output_ms: stat(first),
        exit_ms: stat(exit),
    };
    let boot = BootResult { first_output_over_exec: boot.first_output_ms.median / boot.exec_ms.median, ..boot };

    let smp_runs = runs.clamp(1, 5);
    let mut ipi = Vec::new();
    for chip in ["kernel", "split"] {
        let (mut rtt, mut exit_rtt) = (vec![], vec![]);
        for _ in 0..smp_runs {
            let (a, b) = smp_once(chip, iters)?;
            rtt.push(a);
            exit_rtt.push(b);
        }
        let (r, e) = (stat(rtt), stat(exit_rtt));
        ipi.push(IpiResult {
            irqchip: chip.into(),
            ipi_over_exit: r.median / e.median,
            ipi_rtt_ns_p50: r,
            exit_rtt_ns_p50: e,
        });
        eprintln!("ipi: irqchip={chip} done");
    }

    println!("kumo bench boot: {runs} runs, medians (min..max); baseline = `kumo --version` spawn-to-exit");
    println!("{:<44} {:>10} {:>21} {:>9}", "measurement", "median", "min..max", "x base");
    let base = boot.exec_ms.median;
    let row = |name: &str, s: &Stat, unit: &str, base: f64| {
        println!("{:<44} {:>8.2}{unit} {:>9.2}..{:<9.2} {:>9.2}", name, s.median, s.min, s.max, s.median / base)
    };
    row("baseline: process spawn → exit", &boot.exec_ms, "ms", base);
    row("hello: spawn → VM built, vCPUs started", &boot.vm_built_ms, "ms", base);
    row("hello: spawn → guest entry", &boot.guest_entry_ms, "ms", base);
    row("hello: spawn → first serial output", &boot.first_output_ms, "ms", base);
    row("hello: spawn → exit", &boot.exit_ms, "ms", base);
    println!();
    println!(
        "smp: {smp_runs} runs x {iters} IPI round trips, vCPU 0 ↔ vCPU 1; baseline = VM exit round trip (port read)"
    );
    println!("{:<44} {:>10} {:>21} {:>9}", "measurement", "median", "min..max", "x base");
    for r in &ipi {
        let eb = r.exit_rtt_ns_p50.median;
        let us = |s: &Stat| Stat { median: s.median / 1e3, min: s.min / 1e3, max: s.max / 1e3, runs: s.runs };
        row(&format!("irqchip={}: exit round trip p50", r.irqchip), &us(&r.exit_rtt_ns_p50), "us", eb / 1e3);
        row(&format!("irqchip={}: IPI round trip p50", r.irqchip), &us(&r.ipi_rtt_ns_p50), "us", eb / 1e3);
    }
    let report = Report {
        bench: "boot",
        host_cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        boot,
        ipi,
    };
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("\nJSON written to {}", json.display());
    Ok(0)
}
