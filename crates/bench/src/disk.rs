//! `kumo bench disk` (issue 21): the `blkbench` guest on kumo's virtio-blk (`--disk
//! …,direct=on`) against QEMU 7.2's virtio-blk-pci on the same raw image in the same cache mode
//! (`cache=none`, with `aio=io_uring` and, as a second QEMU row, `aio=threads`), with the same
//! vCPU count and memory, runs alternating kumo / QEMU io_uring / QEMU threads (the order rotated
//! each round); plus the host's
//! own I/O on the same file in the same run (fio if installed, else a pread/pwrite O_DIRECT
//! loop). Every engine's figures are the guest's own lines on its serial output (each stamped
//! with the host time it arrived, kept in the JSON); the tables are medians over the runs.
//!
//! Writes disk.json (every run) and disk.png; ends with `rand4k_read_iops_ratio_qemu=X
//! rand4k_write_iops_ratio_qemu=Y seq_read_mbps_ratio_host=Z p99_read_us=W`: kumo over QEMU
//! io_uring in random 4 KiB IOPS at QD32 (X, Y), kumo's sequential 64 KiB read MB/s at QD1 over
//! the host's (Z), kumo's random 4 KiB read p99 at QD1 (W).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::net::stats::median;
use crate::report::{opt, ratio, step};
use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::Kid;

#[derive(clap::Args)]
pub struct Args {
    /// Shorter tests (200 ms each), 5 runs of each engine: under 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Runs of each engine, alternating (medians over them) [default: 5].
    #[arg(long)]
    runs: Option<u32>,
    /// Milliseconds per blkbench test (and per host test) [default: 1000, 200 with --quick].
    #[arg(long)]
    ms: Option<u64>,
    /// Size of the raw image (all of it is the region tested), MiB.
    #[arg(long, default_value_t = 256)]
    image_mib: u64,
    /// Directory of the image (created by the bench, removed at the end).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

/// The same guest shape on both VMMs (kumo_testkit's QEMU harness runs one vCPU).
const VCPUS: u32 = 1;
const MEM_MIB: u64 = 128;

/// The engines, in the order each round runs them.
pub const ENGINES: [&str; 4] = ["host", "kumo", "qemu-io_uring", "qemu-threads"];

/// One test's figures, as blkbench (or the host tool) printed them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    pub name: String,
    pub qd: u32,
    pub iops: f64,
    pub mbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// When its line arrived, seconds after the VM was started (None for the host).
    pub t_s: Option<f64>,
}

/// One run of one engine.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub engine: &'static str,
    pub round: u32,
    /// From start to exit, seconds.
    pub wall_s: f64,
    pub tests: Vec<Sample>,
    pub errors: u64,
    pub verify_failures: u64,
}

/// Medians of one test of one engine over its runs.
#[derive(Debug, Clone, Serialize)]
pub struct Median {
    pub engine: &'static str,
    pub name: String,
    pub qd: u32,
    pub iops: f64,
    pub mbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub runs: usize,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub image_mib: u64,
    pub ms: u64,
    pub runs: u32,
    pub vcpus: u32,
    pub mem_mib: u64,
    /// "fio" or "pread" (the built-in O_DIRECT loop).
    pub host_tool: &'static str,
    pub kumo_disk: String,
    pub qemu_drive: String,
    pub notes: Vec<String>,
    pub all_runs: Vec<Run>,
    pub medians: Vec<Median>,
    pub rand4k_read_iops_ratio_qemu: Option<f64>,
    pub rand4k_write_iops_ratio_qemu: Option<f64>,
    pub seq_read_mbps_ratio_host: Option<f64>,
    pub p99_read_us: Option<f64>,
}

fn num(field: &str, key: &str) -> Option<f64> {
    field.strip_prefix(key)?.strip_prefix('=')?.parse().ok()
}

/// blkbench's result lines in `lines` (host arrival times relative to `t0`), its error counts.
/// The first `seq64k_write qd=32` line is the pass that lays the pattern down: a later line of
/// the same test replaces it.
pub fn parse_blkbench(lines: &[(Instant, String)], t0: Instant) -> Result<(Vec<Sample>, u64, u64), String> {
    let mut tests: Vec<Sample> = Vec::new();
    let mut done = None;
    for (at, line) in lines {
        let Some(rest) = line.trim().strip_prefix("blkbench: ") else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first() == Some(&"done") && f.len() == 3 {
            done = num(f[1], "errors").zip(num(f[2], "verify_failures"));
            continue;
        }
        if f.len() != 7 || !f[1].starts_with("qd=") {
            continue;
        }
        let get = |i: usize, k: &str| num(f[i], k).ok_or_else(|| format!("blkbench printed a bad line: {line}"));
        let s = Sample {
            name: f[0].to_string(),
            qd: get(1, "qd")? as u32,
            iops: get(3, "iops")?,
            mbps: get(4, "mbps")?,
            p50_us: get(5, "p50_us")?,
            p99_us: get(6, "p99_us")?,
            t_s: Some(at.saturating_duration_since(t0).as_secs_f64()),
        };
        tests.retain(|t| (t.name.as_str(), t.qd) != (s.name.as_str(), s.qd));
        tests.push(s);
    }
    let (errors, verify) = done.ok_or("blkbench did not finish (no `blkbench: done` line)")?;
    Ok((tests, errors as u64, verify as u64))
}

/// The image every engine uses: written out in full (no holes), removed on drop.
struct Image(PathBuf);

impl Image {
    fn create(dir: &Path, mib: u64) -> Result<Image, String> {
        let path = dir.join(format!("kumo-bench-disk-{}.img", std::process::id()));
        let img = Image(path.clone());
        let mut f = std::fs::File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let chunk = vec![0u8; 1 << 20];
        for _ in 0..mib {
            f.write_all(&chunk).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        }
        f.sync_all().map_err(|e| format!("cannot sync {}: {e}", path.display()))?;
        Ok(img)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn blkbench_args(c: &Cfg) -> Vec<String> {
    vec![format!("size_mib={}", c.image_mib), format!("ms={}", c.ms), format!("seed={}", c.round + 1)]
}

/// What one run needs.
struct Cfg {
    image: PathBuf,
    image_mib: u64,
    ms: u64,
    round: u32,
}

impl Cfg {
    /// A safety net far above need: 16 timed tests, two passes over the region, the boot.
    fn limit(&self) -> Duration {
        Duration::from_millis(120_000 + 16 * self.ms + self.image_mib * 200)
    }
}

fn kumo_disk(image: &Path) -> String {
    format!("path={},direct=on", image.display())
}

fn qemu_drive(image: &Path, aio: &str) -> String {
    format!("file={},if=none,id=d0,format=raw,cache=none,aio={aio}", image.display())
}

fn finish_run(
    engine: &'static str,
    c: &Cfg,
    t0: Instant,
    code: i64,
    lines: &[(Instant, String)],
    text: &str,
) -> Result<Run, String> {
    let wall_s = t0.elapsed().as_secs_f64();
    let (tests, errors, verify_failures) = parse_blkbench(lines, t0).map_err(|e| format!("{engine}: {e}\n{text}"))?;
    if code != 0 && errors == 0 && verify_failures == 0 {
        return Err(format!("{engine}: blkbench exited with {code}\n{text}"));
    }
    Ok(Run { engine, round: c.round, wall_s, tests, errors, verify_failures })
}

fn run_kumo(c: &Cfg) -> Result<Run, String> {
    let kumo = crate::kumo_binary()?;
    let mut cmd = Command::new(kumo);
    cmd.args(["run", "--guest", "blkbench", "--cpus", &VCPUS.to_string(), "--memory", &format!("{MEM_MIB}M")])
        .args(["--disk", &kumo_disk(&c.image)])
        .args(blkbench_args(c));
    let t0 = Instant::now();
    let mut kid = Kid::start(&mut cmd)?;
    let code = kid.wait_exit(c.limit())?;
    let text = format!("{}{}", kid.stdout(), kid.stderr());
    finish_run("kumo", c, t0, code as i64, &kid.lines(), &text)
}

fn run_qemu(c: &Cfg, engine: &'static str, aio: &str) -> Result<Run, String> {
    let extra = kumo_testkit::sv(&[
        "-drive",
        &qemu_drive(&c.image, aio),
        "-device",
        "virtio-blk-pci,drive=d0,disable-legacy=on",
    ]);
    let spec = QemuSpec { extra_args: extra, ..QemuSpec::new("blkbench", MEM_MIB, &blkbench_args(c)) };
    let t0 = Instant::now();
    let mut vm = QemuVm::spawn(&spec, None)?;
    let code = vm.wait_exit(c.limit())?;
    finish_run(engine, c, t0, code as i64, &vm.lines(), &vm.serial())
}

/// The host's tests: the names of blkbench's tests they mirror, (rw, block size, queue depth).
const HOST_TESTS: [(&str, &str, u32, u32); 6] = [
    ("rand4k_read", "randread", 4096, 1),
    ("rand4k_read", "randread", 4096, 32),
    ("rand4k_write", "randwrite", 4096, 1),
    ("rand4k_write", "randwrite", 4096, 32),
    ("seq64k_read", "read", 65536, 1),
    ("seq64k_read", "read", 65536, 32),
];

/// One fio job's figures from its JSON output.
pub fn parse_fio(json: &str, name: &str, qd: u32, write: bool) -> Result<Sample, String> {
    let at = json.find('{').ok_or("fio printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(&json[at..]).map_err(|e| format!("fio's JSON: {e}"))?;
    let d = &v["jobs"][0][if write { "write" } else { "read" }];
    let f = |x: &serde_json::Value| x.as_f64().ok_or_else(|| format!("fio's JSON lacks a field: {d}"));
    let pct = &d["clat_ns"]["percentile"];
    Ok(Sample {
        name: name.into(),
        qd,
        iops: f(&d["iops"])?,
        mbps: f(&d["bw_bytes"])? / 1e6,
        p50_us: f(&pct["50.000000"])? / 1e3,
        p99_us: f(&pct["99.000000"])? / 1e3,
        t_s: None,
    })
}

fn fio_installed() -> bool {
    Command::new("sh").args(["-c", "command -v fio"]).output().map(|o| o.status.success()).unwrap_or(false)
}

fn run_fio(c: &Cfg) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (name, rw, bs, qd) in HOST_TESTS {
        let engine = if qd == 1 { "psync" } else { "io_uring" };
        let o = Command::new("fio")
            .args(["--name=kumo-bench", "--direct=1", "--time_based", "--output-format=json", "--randrepeat=0"])
            .arg(format!("--filename={}", c.image.display()))
            .arg(format!("--size={}M", c.image_mib))
            .args([
                format!("--rw={rw}"),
                format!("--bs={bs}"),
                format!("--iodepth={qd}"),
                format!("--ioengine={engine}"),
            ])
            .arg(format!("--runtime={}ms", c.ms))
            .output()
            .map_err(|e| format!("cannot run fio: {e}"))?;
        let text = String::from_utf8_lossy(&o.stdout);
        if !o.status.success() {
            return Err(format!("fio {rw} failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
        }
        out.push(parse_fio(&text, name, qd, rw.contains("write"))?);
    }
    Ok(out)
}

/// The built-in host baseline without fio: pread/pwrite with O_DIRECT at QD1.
fn run_pread(c: &Cfg) -> Result<Vec<Sample>, String> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&c.image)
        .map_err(|e| format!("cannot open {} with O_DIRECT: {e}", c.image.display()))?;
    let layout = std::alloc::Layout::from_size_align(65536, 4096).map_err(|e| e.to_string())?;
    // SAFETY: the layout has a non-zero size; the buffer is freed below and only used as bytes.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err("out of memory".into());
    }
    // SAFETY: `ptr` is a live, zeroed allocation of 64 KiB owned here until the dealloc below.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 65536) };
    let mut out = Vec::new();
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    for (name, rw, bs, qd) in HOST_TESTS.into_iter().filter(|t| t.3 == 1) {
        let blocks = (c.image_mib << 20) / bs as u64;
        let (mut lat, mut next, t0) = (Vec::new(), 0u64, Instant::now());
        while t0.elapsed() < Duration::from_millis(c.ms) {
            let block = if rw == "read" {
                next = (next + 1) % blocks;
                next
            } else {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % blocks
            };
            let (b, at, t) = (&mut buf[..bs as usize], block * bs as u64, Instant::now());
            let r = if rw == "randwrite" { f.write_at(b, at) } else { f.read_at(b, at) };
            r.map_err(|e| format!("host {rw} at {at}: {e}"))?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let el = t0.elapsed().as_secs_f64();
        let iops = lat.len() as f64 / el;
        let pct = |p| crate::net::stats::percentile(&lat, p).unwrap_or(0.0);
        out.push(Sample {
            name: name.into(),
            qd,
            iops,
            mbps: iops * bs as f64 / 1e6,
            p50_us: pct(50.0),
            p99_us: pct(99.0),
            t_s: None,
        });
    }
    // SAFETY: allocated above with the same layout; `buf` is not used after this.
    unsafe { std::alloc::dealloc(ptr, layout) };
    Ok(out)
}

fn run_host(c: &Cfg, fio: bool) -> Result<Run, String> {
    let t0 = Instant::now();
    let tests = if fio { run_fio(c)? } else { run_pread(c)? };
    Ok(Run { engine: "host", round: c.round, wall_s: t0.elapsed().as_secs_f64(), tests, errors: 0, verify_failures: 0 })
}

/// Medians per engine and test, in the order the tests first appear.
pub fn medians(runs: &[Run]) -> Vec<Median> {
    let mut out: Vec<Median> = Vec::new();
    for engine in ENGINES {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.engine == engine).collect();
        let mut keys: Vec<(String, u32)> = Vec::new();
        for s in mine.iter().flat_map(|r| &r.tests) {
            if !keys.contains(&(s.name.clone(), s.qd)) {
                keys.push((s.name.clone(), s.qd));
            }
        }
        for (name, qd) in keys {
            let ss: Vec<&Sample> =
                mine.iter().flat_map(|r| &r.tests).filter(|s| s.name == name && s.qd == qd).collect();
            let m = |f: fn(&Sample) -> f64| median(&ss.iter().map(|s| f(s)).collect::<Vec<_>>()).unwrap_or(0.0);
            out.push(Median {
                engine,
                name,
                qd,
                iops: m(|s| s.iops),
                mbps: m(|s| s.mbps),
                p50_us: m(|s| s.p50_us),
                p99_us: m(|s| s.p99_us),
                runs: ss.len(),
            });
        }
    }
    out
}

pub fn find<'a>(m: &'a [Median], engine: &str, name: &str, qd: u32) -> Option<&'a Median> {
    m.iter().find(|x| x.engine == engine && x.name == name && x.qd == qd)
}

/// Fills the medians and the headline figures from the runs.
pub fn finish(r: &mut Report) {
    r.medians = medians(&r.all_runs);
    let m = &r.medians;
    let get = |e: &str, n: &str, qd: u32, f: fn(&Median) -> f64| find(m, e, n, qd).map(f);
    let iops = |e: &str, n: &str| get(e, n, 32, |x| x.iops);
    r.rand4k_read_iops_ratio_qemu = ratio(iops("kumo", "rand4k_read"), iops("qemu-io_uring", "rand4k_read"));
    r.rand4k_write_iops_ratio_qemu = ratio(iops("kumo", "rand4k_write"), iops("qemu-io_uring", "rand4k_write"));
    let seq = |e: &str| get(e, "seq64k_read", 1, |x| x.mbps);
    r.seq_read_mbps_ratio_host = ratio(seq("kumo"), seq("host"));
    r.p99_read_us = get("kumo", "rand4k_read", 1, |x| x.p99_us);
}

pub fn headline(r: &Report) -> String {
    format!(
        "rand4k_read_iops_ratio_qemu={} rand4k_write_iops_ratio_qemu={} seq_read_mbps_ratio_host={} p99_read_us={}",
        opt(r.rand4k_read_iops_ratio_qemu, 2),
        opt(r.rand4k_write_iops_ratio_qemu, 2),
        opt(r.seq_read_mbps_ratio_host, 2),
        opt(r.p99_read_us, 0)
    )
}

pub fn table(r: &Report) -> String {
    let mut s = format!(
        "kumo bench disk: blkbench, {} vCPU, {} MiB, {} MiB raw image, {} ms per test, medians of {} runs (host: {})\n",
        r.vcpus, r.mem_mib, r.image_mib, r.ms, r.runs, r.host_tool
    );
    s += &format!(
        "{:<14} {:>3} | {:>9} {:>9} {:>9} {:>9} | {:>6} | {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6}\n",
        "test",
        "qd",
        "kumo",
        "q-uring",
        "q-thread",
        "host",
        "k/q-u",
        "kumo",
        "q-uring",
        "host",
        "kumo",
        "q-uring",
        "host"
    );
    s += &format!("{:<18} | {:^39} | {:^6} | {:^23} | {:^20}\n", "", "IOPS", "ratio", "MB/s", "p99 us");
    let keys: Vec<(String, u32)> =
        r.medians.iter().filter(|m| m.engine == "kumo").map(|m| (m.name.clone(), m.qd)).collect();
    for (name, qd) in keys {
        let f = |e: &str, g: fn(&Median) -> f64| find(&r.medians, e, &name, qd).map(g);
        let iops = |e: &str| opt(f(e, |m| m.iops), 0);
        s += &format!(
            "{:<14} {:>3} | {:>9} {:>9} {:>9} {:>9} | {:>6} | {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6}\n",
            name,
            qd,
            iops("kumo"),
            iops("qemu-io_uring"),
            iops("qemu-threads"),
            iops("host"),
            opt(ratio(f("kumo", |m| m.iops), f("qemu-io_uring", |m| m.iops)), 2),
            opt(f("kumo", |m| m.mbps), 0),
            opt(f("qemu-io_uring", |m| m.mbps), 0),
            opt(f("host", |m| m.mbps), 0),
            opt(f("kumo", |m| m.p99_us), 0),
            opt(f("qemu-io_uring", |m| m.p99_us), 0),
            opt(f("host", |m| m.p99_us), 0),
        );
    }
    for n in &r.notes {
        s += &format!("note: {n}\n");
    }
    s
}

/// Random 4 KiB IOPS per engine at QD1 and QD32, grouped bars.
fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let groups = [("rand4k_read", 1), ("rand4k_read", 32), ("rand4k_write", 1), ("rand4k_write", 32)];
    let names: Vec<String> = groups.iter().map(|(n, q)| format!("{n} qd{q}")).collect();
    let top = r.medians.iter().filter(|m| m.name.starts_with("rand4k_")).map(|m| m.iops).fold(1.0, f64::max) * 1.2;
    let root = BitMapBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let mut c = ChartBuilder::on(&root)
        .caption(format!("random 4 KiB IOPS, median of {} runs ({} ms per test)", r.runs, r.ms), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..groups.len() as f64 - 0.5, 0.0..top)
        .map_err(e)?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len())
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 0.01 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("IOPS")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    let colours = [RGBColor(120, 120, 120), BLUE, RED, RGBColor(230, 140, 0)];
    for (k, (engine, col)) in ENGINES.iter().zip(colours).enumerate() {
        let bars: Vec<_> = groups
            .iter()
            .enumerate()
            .filter_map(|(i, (n, q))| {
                let x0 = i as f64 - 0.4 + k as f64 * 0.2;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + 0.18, find(&r.medians, engine, n, *q)?.iops)],
                    col.mix(0.8).filled(),
                ))
            })
            .collect();
        c.draw_series(bars)
            .map_err(e)?
            .label(*engine)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.mix(0.8).filled()));
    }
    c.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// The VM engines of round `r` in the order they run: rotated each round, so that none always
/// follows the host's tests or another VM's writes.
pub fn vm_order(r: u32, with_qemu: bool) -> Vec<&'static str> {
    let mut v = if with_qemu { ENGINES[1..].to_vec() } else { vec!["kumo"] };
    let n = v.len();
    v.rotate_left(r as usize % n);
    v
}

/// One round: the host, then kumo, QEMU io_uring and QEMU threads (the QEMU rows only with
/// QEMU) in [`vm_order`].
fn round(c: &Cfg, fio: bool, with_qemu: bool, t0: Instant) -> Result<Vec<Run>, String> {
    let mut runs = Vec::new();
    step(t0, &format!("round {}: host", c.round + 1));
    runs.push(run_host(c, fio)?);
    for engine in vm_order(c.round, with_qemu) {
        step(t0, &format!("round {}: {engine}", c.round + 1));
        runs.push(match engine {
            "kumo" => run_kumo(c)?,
            "qemu-io_uring" => run_qemu(c, engine, "io_uring")?,
            _ => run_qemu(c, engine, "threads")?,
        });
    }
    Ok(runs)
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    let t0 = Instant::now();
    let runs = a.runs.unwrap_or(5).max(1);
    let ms = a.ms.unwrap_or(if a.quick { 200 } else { 1000 }).max(1);
    if a.image_mib < 1 {
        return Err("--image-mib must be at least 1".into());
    }
    let json = crate::out_file(out, "disk.json")?;
    let png = out.join("disk.png");
    let fio = fio_installed();
    let mut notes = Vec::new();
    let with_qemu = match qemu::qemu_binary().and_then(|_| qemu::kvm_usable()) {
        Ok(()) => true,
        Err(e) => {
            notes.push(format!("no QEMU rows: {e}"));
            false
        }
    };
    if !fio {
        notes.push("fio is not installed: the host rows are a pread/pwrite O_DIRECT loop at QD1".into());
    }
    step(t0, &format!("creating a {} MiB image in {}", a.image_mib, a.dir.display()));
    let image = Image::create(&a.dir, a.image_mib)?;
    let mut report = Report {
        image_mib: a.image_mib,
        ms,
        runs,
        vcpus: VCPUS,
        mem_mib: MEM_MIB,
        host_tool: if fio { "fio" } else { "pread" },
        kumo_disk: kumo_disk(&image.0),
        qemu_drive: qemu_drive(&image.0, "io_uring|threads"),
        notes,
        all_runs: Vec::new(),
        medians: Vec::new(),
        rand4k_read_iops_ratio_qemu: None,
        rand4k_write_iops_ratio_qemu: None,
        seq_read_mbps_ratio_host: None,
        p99_read_us: None,
    };
    for r in 0..runs {
        let c = Cfg { image: image.0.clone(), image_mib: a.image_mib, ms, round: r };
        report.all_runs.extend(round(&c, fio, with_qemu, t0)?);
    }
    drop(image);
    finish(&mut report);
    let bad: u64 = report.all_runs.iter().map(|r| r.errors + r.verify_failures).sum();
    if bad > 0 {
        report.notes.push(format!("{bad} I/O errors or verify failures in the guests (see disk.json)"));
    }
    print!("{}", table(&report));
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    if let Err(e) = plot(&png, &report) {
        eprintln!("kumo-bench: disk.png not drawn: {e}");
    }
    println!("wrote {} and {} in {:.0} s", json.display(), png.display(), t0.elapsed().as_secs_f64());
    println!("{}", headline(&report));
    Ok(if bad > 0 { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<(Instant, String)> {
        let t = Instant::now();
        text.lines().map(|l| (t, l.to_string())).collect()
    }

    const OUT: &str = "kumo: starting\n\
        blkbench: disk of 65536 sectors, queue of 256, region 32 MiB, 50 ms per test\n\
        blkbench: seq64k_write qd=32 ops=512 iops=9000 mbps=589 p50_us=3000 p99_us=5000\n\
        blkbench: rand4k_read qd=1 ops=100 iops=2000 mbps=8 p50_us=400 p99_us=900\n\
        blkbench: rand4k_read qd=32 ops=900 iops=18000 mbps=73 p50_us=1700 p99_us=2500\n\
        blkbench: seq64k_write qd=32 ops=400 iops=8000 mbps=524 p50_us=3500 p99_us=6000\n\
        blkbench: done errors=0 verify_failures=0\n";

    #[test]
    fn blkbench_lines_parse_and_the_lay_down_pass_is_replaced() {
        let l = lines(OUT);
        let (t, errors, verify) = parse_blkbench(&l, l[0].0).unwrap();
        assert_eq!((errors, verify), (0, 0));
        assert_eq!(t.len(), 3);
        let w = t.iter().find(|s| s.name == "seq64k_write").unwrap();
        assert_eq!((w.qd, w.iops, w.p99_us), (32, 8000.0, 6000.0));
        assert_eq!(t[0].name, "rand4k_read");
        assert_eq!((t[1].qd, t[1].mbps, t[1].p50_us), (32, 73.0, 1700.0));
    }

    #[test]
    fn an_unfinished_or_garbled_run_is_an_error() {
        let l = lines("blkbench: rand4k_read qd=1 ops=1 iops=2 mbps=0 p50_us=1 p99_us=1\n");
        assert!(parse_blkbench(&l, l[0].0).unwrap_err().contains("did not finish"));
        let l = lines("blkbench: rand4k_read qd=1 ops=1 iops=x mbps=0 p50_us=1 p99_us=1\n");
        assert!(parse_blkbench(&l, l[0].0).unwrap_err().contains("bad line"));
    }

    #[test]
    fn fio_json_parses() {
        let j = r#"note: a warning first
        {"jobs":[{"read":{"iops":1000.5,"bw_bytes":4098048,"clat_ns":{"percentile":{"50.000000":40000,"99.000000":90000}}},
                  "write":{"iops":0,"bw_bytes":0,"clat_ns":{}}}]}"#;
        let s = parse_fio(j, "rand4k_read", 1, false).unwrap();
        assert_eq!((s.iops, s.mbps, s.p50_us, s.p99_us), (1000.5, 4.098048, 40.0, 90.0));
        assert!(parse_fio(j, "rand4k_write", 1, true).is_err());
        assert!(parse_fio("nothing", "x", 1, false).is_err());
    }

    fn sample(name: &str, qd: u32, iops: f64) -> Sample {
        Sample { name: name.into(), qd, iops, mbps: iops / 10.0, p50_us: 10.0, p99_us: iops / 100.0, t_s: None }
    }

    fn report(runs: Vec<Run>) -> Report {
        let mut r = Report {
            image_mib: 16,
            ms: 10,
            runs: 3,
            vcpus: 1,
            mem_mib: 128,
            host_tool: "fio",
            kumo_disk: String::new(),
            qemu_drive: String::new(),
            notes: vec![],
            all_runs: runs,
            medians: vec![],
            rand4k_read_iops_ratio_qemu: None,
            rand4k_write_iops_ratio_qemu: None,
            seq_read_mbps_ratio_host: None,
            p99_read_us: None,
        };
        finish(&mut r);
        r
    }

    fn runs() -> Vec<Run> {
        let mut v = Vec::new();
        for (round, k) in [(0u32, 1.0), (1, 3.0), (2, 2.0)] {
            let tests = |f: f64| {
                vec![
                    sample("rand4k_read", 1, 100.0 * f),
                    sample("rand4k_read", 32, 1000.0 * f),
                    sample("rand4k_write", 32, 500.0 * f),
                    sample("seq64k_read", 1, 50.0 * f),
                ]
            };
            for (engine, f) in [("kumo", k), ("qemu-io_uring", 2.0 * k), ("host", 4.0)] {
                v.push(Run { engine, round, wall_s: 1.0, tests: tests(f), errors: 0, verify_failures: 0 });
            }
        }
        v
    }

    #[test]
    fn headline_is_ratios_of_medians() {
        let r = report(runs());
        // kumo's medians are 2x the base, QEMU's 4x, the host's 4x.
        assert_eq!(r.rand4k_read_iops_ratio_qemu, Some(0.5));
        assert_eq!(r.rand4k_write_iops_ratio_qemu, Some(0.5));
        assert_eq!(r.seq_read_mbps_ratio_host, Some(0.5));
        assert_eq!(r.p99_read_us, Some(2.0));
        assert_eq!(
            headline(&r),
            "rand4k_read_iops_ratio_qemu=0.50 rand4k_write_iops_ratio_qemu=0.50 seq_read_mbps_ratio_host=0.50 p99_read_us=2"
        );
        let m = find(&r.medians, "kumo", "rand4k_read", 32).unwrap();
        assert_eq!((m.iops, m.runs), (2000.0, 3));
        let t = table(&r);
        assert!(t.contains("rand4k_write") && t.contains("n/a"), "{t}");
    }

    #[test]
    fn without_qemu_the_ratios_are_not_available() {
        let r = report(runs().into_iter().filter(|r| r.engine != "qemu-io_uring").collect());
        assert!(headline(&r).starts_with("rand4k_read_iops_ratio_qemu=n/a rand4k_write_iops_ratio_qemu=n/a"));
    }

    #[test]
    fn each_round_rotates_the_vms() {
        assert_eq!(vm_order(0, true), ["kumo", "qemu-io_uring", "qemu-threads"]);
        assert_eq!(vm_order(1, true), ["qemu-io_uring", "qemu-threads", "kumo"]);
        assert_eq!(vm_order(5, true), ["qemu-threads", "kumo", "qemu-io_uring"]);
        assert_eq!(vm_order(3, false), ["kumo"]);
    }

    #[test]
    fn json_and_plot() {
        let r = report(runs());
        let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["all_runs"].as_array().unwrap().len(), 9);
        assert_eq!(v["rand4k_read_iops_ratio_qemu"], 0.5);
        crate::check_plot("disk", |p| plot(p, &r));
    }

    #[test]
    fn the_host_loop_reads_and_writes_an_image() {
        let dir = std::env::temp_dir();
        let img = Image::create(&dir, 1).unwrap();
        let c = Cfg { image: img.0.clone(), image_mib: 1, ms: 20, round: 0 };
        match run_pread(&c) {
            Ok(s) => {
                assert_eq!(s.len(), 3);
                assert!(s.iter().all(|s| s.iops > 0.0 && s.qd == 1), "{s:?}");
            }
            // tmpfs has no O_DIRECT.
            Err(e) => assert!(e.contains("O_DIRECT"), "{e}"),
        }
        drop(img);
        assert!(!c.image.exists());
    }
}
