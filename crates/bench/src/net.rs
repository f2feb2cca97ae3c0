//! `kumo bench net`: seed 000 (SEEDS.md) on kumo's virtio-net NIC — the shared interrupt path
//! (one kumo dispatcher thread injecting every device's interrupts to vCPU 0) against the
//! dedicated one (KVM delivers the queue's MSI straight to the consumer's vCPU), with a
//! baseline of two network namespaces joined by veth measured in the same run.
//!
//! 1. veth baseline: a sequence-numbered UDP stream (host tools, [`tools`]) from one namespace
//!    to the other, and round trips across it.
//! 2. host ↔ guest UDP RTT per path, unloaded and with interference (a second NIC, on its own
//!    tap and always on the shared path, flooded from the host while `netecho sink=1` drains
//!    it), with 1 vCPU and with 2 (the consumer, `netecho cpu=1`, on vCPU 1).
//! 3. VM ↔ VM ping-pong on a Linux bridge (`udpping` against `netecho`): time per iteration
//!    per path, the seed's NPB proxy.
//! 4. Throughput guest → host (`udpsend` → host sink) and VM → VM (`udpsend` → `udpsink`), as
//!    ratios of the veth baseline.
//! 5. kumo against QEMU's virtio-net-pci ([`vs_qemu`]): host ↔ guest round trips to `netecho`
//!    and the guest → host `udpsend` stream, the same guests, tap and host tools in both VMMs,
//!    runs alternating; skipped, saying why, without `qemu-system-x86_64`.
//!
//! Everything runs inside namespaces of this run ([`host`]): kumo and QEMU too, so their taps
//! and bridge never meet the host's addresses. The last line is the headline:
//! `dedicated_p99_us= dedicated_unloaded_p99_us= shared_p99_us= veth_ratio=` (with interference,
//! the headline vCPU count; the ratio is the dedicated path's guest → host stream over veth),
//! then section 5's `kumo_rtt_p50_us= kumo_rtt_p99_us= kumo_stream_mb_s= qemu_rtt_p50_us=
//! qemu_rtt_p99_us= qemu_stream_mb_s= rtt_p99_ratio_qemu= mbps_ratio_qemu= poll_rtt_p99_ratio_qemu=
//! poll_mbps_ratio_qemu= pinned_rtt_p99_ratio_qemu= self_pinned_rtt_p99_ratio_qemu=
//! io_cpu_frame_ratio_qemu=` (ratios kumo over
//! QEMU; n/a without QEMU). Without `kumo run --net` (or the network guests) the bench measures
//! veth, says so in one line and exits 1.

pub mod stats;
pub mod threads;
pub mod tools;
pub mod vs_qemu;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::report::{opt, ratio, step};
use kumo_testkit::net::{self as host, NetGuard};
use kumo_testkit::{sv, Kid};
use stats::{median, Latency, Runs};
use tools::SinkResult;
use vs_qemu::{AnyVm, Vmm, VsQemu};

#[derive(clap::Args)]
pub struct Args {
    /// A short run (fewer and shorter runs): under 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Runs per measurement (medians are reported) [default: 3 with --quick, else 5].
    #[arg(long)]
    runs: Option<usize>,
    /// The interference: datagrams per second flooded at the guest's second NIC (0: as fast as
    /// the host sends them, which on a small host also starves the vCPUs of CPU time).
    #[arg(long, default_value_t = 20_000)]
    flood_pps: u64,
    /// The interference's datagram size (bytes of UDP payload).
    #[arg(long, default_value_t = 1024)]
    flood_size: usize,
}

/// Every kumo child stops by itself after this long (s), even if the bench is killed.
const LIFETIME: &str = "600";
/// The guests this bench runs.
const GUESTS: [&str; 4] = ["netecho", "udpping", "udpsend", "udpsink"];
const BOOT_LIMIT: Duration = Duration::from_secs(60);
/// Every VM's memory (kumo's default, given explicitly: QEMU's VMs get the same).
const MEM_MIB: u64 = 256;

// Addresses inside the run's VM namespace: NIC 0's tap, NIC 1's (interference) tap, the bridge.
const HOST0: &str = "10.0.0.1";
const GUEST0: &str = "10.0.0.2";
const MAC0: &str = "52:54:00:00:00:02";
const HOST1: &str = "10.0.2.1";
const GUEST1: &str = "10.0.2.2";
const MAC1: &str = "52:54:00:00:02:02";
const BRIDGE: &str = "10.0.1.1";
const VM_A: &str = "10.0.1.2";
const MAC_A: &str = "52:54:00:00:01:02";
const VM_B: &str = "10.0.1.3";
const MAC_B: &str = "52:54:00:00:01:03";
const VETH_A: &str = "10.0.9.1";
const VETH_B: &str = "10.0.9.2";

/// The interrupt path of a NIC queue (`--net ...,irq=`).
#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum IrqPath {
    Shared,
    Dedicated,
}

pub const PATHS: [IrqPath; 2] = [IrqPath::Shared, IrqPath::Dedicated];

impl IrqPath {
    pub fn label(self) -> &'static str {
        match self {
            IrqPath::Shared => "shared",
            IrqPath::Dedicated => "dedicated",
        }
    }

    /// The `irq=` part of `--net` for a queue consumed on `vcpu`.
    fn net_irq(self, vcpu: u32) -> String {
        match self {
            IrqPath::Shared => "irq=shared".into(),
            IrqPath::Dedicated => format!("irq=dedicated,vcpu={vcpu}"),
        }
    }

    /// The `irq=` part of `--net` for the other devices (the interference NIC): on the shared
    /// path every device's interrupts go through the dispatcher (Xen's event channel); with the
    /// seed's fix no device's interrupt goes through a kumo thread, and the others are
    /// delivered by KVM where the guest aims them (vCPU 0, a lower vector class).
    fn others_irq(self) -> String {
        match self {
            IrqPath::Shared => "irq=shared".into(),
            IrqPath::Dedicated => "irq=direct".into(),
        }
    }
}

/// How much to measure.
#[derive(Serialize, Clone, Copy, Debug)]
pub struct Plan {
    pub runs: usize,
    /// Round trips per RTT run (host ↔ guest, veth, VM ↔ VM).
    pub rtt_count: u64,
    pub rtt_size: usize,
    /// Datagrams per stream run, and their size.
    pub stream_count: u64,
    pub stream_size: usize,
    /// The interference flood's datagram size and rate (0: flat out).
    pub flood_size: usize,
    pub flood_pps: u64,
}

impl Plan {
    pub fn new(quick: bool, runs: Option<usize>, flood_pps: u64) -> Plan {
        // A stream of 50,000 datagrams lasted 0.13-0.25 s here and read 204-385 MB/s for the
        // same VMM: too short to compare VMMs by.
        let (r, rtt, stream) = if quick { (3, 5000, 200_000) } else { (5, 10_000, 400_000) };
        Plan {
            runs: runs.unwrap_or(r).max(1),
            rtt_count: rtt,
            rtt_size: 64,
            stream_count: stream,
            stream_size: 1024,
            flood_size: 1024,
            flood_pps,
        }
    }
}

/// What the measurements need: the binaries, the plan, the VM namespace (taps, bridge).
pub struct Ctx {
    pub kumo: PathBuf,
    /// This executable, for `net-tool`.
    pub bench: PathBuf,
    pub plan: Plan,
    /// The namespace the VMs and their host-side tools run in.
    pub ns: String,
    pub tap0: String,
    pub tap1: String,
    pub tap_a: String,
    pub tap_b: String,
    /// API sockets; removed at the end.
    pub dir: vmm_sys_util::tempdir::TempDir,
    seq: std::sync::atomic::AtomicU32,
}

/// Which subnet a `ip/len` belongs to does not matter here: all live in the run's namespaces.
fn cidr(addr: &str) -> String {
    format!("{addr}/24")
}

/// `kumo-bench net-tool ARGS` in namespace `ns`.
fn tool(bench: &Path, ns: &str, args: &[String]) -> Result<Kid, String> {
    tool_on(bench, ns, args, None)
}

/// [`tool`] on host CPU `cpu` (`taskset`), if given.
fn tool_on(bench: &Path, ns: &str, args: &[String], cpu: Option<usize>) -> Result<Kid, String> {
    let mut argv = vec![bench.display().to_string(), "net-tool".into()];
    if let Some(c) = cpu {
        argv.splice(0..0, ["taskset".to_string(), "-c".into(), c.to_string()]);
    }
    argv.extend(args.iter().cloned());
    Kid::start_in(Some(ns), &argv)
}

fn wait_ready(p: &mut Kid) -> Result<(), String> {
    p.wait_line(Duration::from_secs(30), "ready", |l| (l == "ready").then_some(())).map(|_| ())
}

// ---------------------------------------------------------------------------------------------
// 1. veth baseline

#[derive(Serialize, Clone, Debug, Default)]
pub struct Stream {
    pub runs: Vec<SinkResult>,
    pub errors: Vec<String>,
    pub median_mb_per_s: Option<f64>,
    pub median_packets_per_s: Option<f64>,
}

impl Stream {
    fn push(&mut self, r: Result<SinkResult, String>) {
        match r {
            Ok(s) if s.received > 0 => self.runs.push(s),
            Ok(_) => self.errors.push("the sink received nothing".into()),
            Err(e) => self.errors.push(e),
        }
        self.median_mb_per_s = median(&self.runs.iter().map(|s| s.mb_per_s).collect::<Vec<_>>());
        self.median_packets_per_s = median(&self.runs.iter().map(|s| s.packets_per_s).collect::<Vec<_>>());
    }
}

#[derive(Serialize, Clone, Debug, Default)]
pub struct Veth {
    pub stream: Stream,
    pub rtt: Runs,
}

/// Two namespaces joined by a veth pair: a stream from A to B and round trips A → B, `runs`
/// times each. Fails (the caller skips the baseline) when the namespaces cannot be made.
pub fn veth_baseline(bench: &Path, plan: &Plan) -> Result<Veth, String> {
    let mut g = NetGuard::default();
    let (na, nb) = (host::name("va"), host::name("vb"));
    g.netns(&na)?;
    g.netns(&nb)?;
    g.veth((&host::name("a"), &na, &cidr(VETH_A)), (&host::name("b"), &nb, &cidr(VETH_B)))?;
    let mut v = Veth::default();
    for _ in 0..plan.runs {
        v.stream.push(veth_stream_once(bench, plan, &na, &nb));
        v.rtt.push(veth_rtt_once(bench, plan, &na, &nb));
    }
    Ok(v)
}

fn veth_stream_once(bench: &Path, plan: &Plan, na: &str, nb: &str) -> Result<SinkResult, String> {
    let mut sink = tool(bench, nb, &sv(&["sink", "--bind", &format!("{VETH_B}:9"), "--first-ms", "20000"]))?;
    wait_ready(&mut sink)?;
    let args = [
        "send".to_string(),
        "--to".into(),
        format!("{VETH_B}:9"),
        "--count".into(),
        plan.stream_count.to_string(),
        "--size".into(),
        plan.stream_size.to_string(),
    ];
    let mut send = tool(bench, na, &args)?;
    let _: tools::SendResult = send.json_result(Duration::from_secs(120))?;
    sink.json_result(Duration::from_secs(60))
}

fn veth_rtt_once(bench: &Path, plan: &Plan, na: &str, nb: &str) -> Result<Latency, String> {
    let mut echo = tool(bench, nb, &sv(&["echo", "--bind", &format!("{VETH_B}:7")]))?;
    wait_ready(&mut echo)?;
    host_rtt_tool(bench, na, VETH_B, plan)
}

/// The host RTT client (in `ns`) against `addr:7`.
/// Host CPUs for the round-trip measurements when there are at least two: the measured path
/// (the consumer vCPU, NIC 0's thread, the host client) on one, the interference (the flooder,
/// NIC 1's thread, the other vCPU, the shared path's dispatcher) on the other, the same for
/// every path. On a 2-core host the interference would otherwise take the CPU time the path
/// under test needs, and the comparison would measure the host's scheduler, not the path.
#[derive(Debug, Clone, Copy)]
struct Placement {
    measured: usize,
    interference: usize,
}

fn placement() -> Option<Placement> {
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (n >= 2).then_some(Placement { measured: 1, interference: 0 })
}

/// Pins kumo `pid`'s threads by name (`vcpuN`, `net0`, `net1`, `irq-dispatch`) per `p`.
fn pin_kumo_threads(pid: u32, consumer: u32, p: Placement) -> Result<(), String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| format!("kumo's threads: {e}"))?;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let cpu = match comm.trim() {
            "net0" => p.measured,
            c if c == format!("vcpu{consumer}") => p.measured,
            "net1" | "irq-dispatch" => p.interference,
            c if c.starts_with("vcpu") => p.interference,
            _ => continue,
        };
        let tid = t.file_name().to_string_lossy().to_string();
        let o = std::process::Command::new("taskset")
            .args(["-pc", &cpu.to_string(), &tid])
            .output()
            .map_err(|e| format!("taskset: {e}"))?;
        if !o.status.success() {
            return Err(format!("taskset -pc {cpu} {tid}: {}", String::from_utf8_lossy(&o.stderr).trim()));
        }
    }
    Ok(())
}

fn host_rtt_tool(bench: &Path, ns: &str, addr: &str, plan: &Plan) -> Result<Latency, String> {
    host_rtt_tool_on(bench, ns, addr, plan, None)
}

fn host_rtt_tool_on(bench: &Path, ns: &str, addr: &str, plan: &Plan, cpu: Option<usize>) -> Result<Latency, String> {
    let args = [
        "rtt".to_string(),
        "--to".into(),
        format!("{addr}:7"),
        "--count".into(),
        plan.rtt_count.to_string(),
        "--size".into(),
        plan.rtt_size.to_string(),
    ];
    tool_on(bench, ns, &args, cpu)?.json_result(Duration::from_secs(600))
}

// ---------------------------------------------------------------------------------------------
// The VMs

/// Whether this kumo can run the VM measurements: `kumo run --net` and the network guests.
/// The error is the one line the bench prints before it exits 1.
pub fn vm_support(kumo: &Path) -> Result<(), String> {
    let help = std::process::Command::new(kumo)
        .args(["run", "--help"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", kumo.display()))?;
    if !String::from_utf8_lossy(&help.stdout).contains("--net") {
        return Err(format!(
            "{} has no `kumo run --net` (the VMM's NIC is not in this build): no VM measurements",
            kumo.display()
        ));
    }
    let out = std::process::Command::new(kumo)
        .args(["guests", "--json"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", kumo.display()))?;
    let list: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("`kumo guests --json`: {e}"))?;
    let have: Vec<&str> = list.as_array().into_iter().flatten().filter_map(|g| g["name"].as_str()).collect();
    let missing: Vec<&str> = GUESTS.iter().copied().filter(|g| !have.contains(g)).collect();
    if !missing.is_empty() {
        return Err(format!("this kumo lacks the guest program(s) {}: no VM measurements", missing.join(", ")));
    }
    Ok(())
}

/// One NIC of a VM: its tap, MAC and `irq=` part.
struct Nic<'a> {
    tap: &'a str,
    mac: &'a str,
    irq: String,
}

/// A kumo VM process and its API socket.
pub struct KumoVm {
    pub proc: Kid,
    kumo: PathBuf,
    api: PathBuf,
}

impl std::ops::Deref for KumoVm {
    type Target = Kid;
    fn deref(&self) -> &Kid {
        &self.proc
    }
}

impl std::ops::DerefMut for KumoVm {
    fn deref_mut(&mut self) -> &mut Kid {
        &mut self.proc
    }
}

impl KumoVm {
    /// `kumo counters` (at most 10 s); None if unreadable.
    pub fn counters(&self) -> Option<serde_json::Value> {
        let argv = sv(&[&self.kumo.display().to_string(), "--api-socket", &self.api.display().to_string(), "counters"]);
        let mut p = Kid::start_in(None, &argv).ok()?;
        if p.wait_exit(Duration::from_secs(10)).ok()? != 0 {
            return None;
        }
        let text: Vec<String> = p.lines().into_iter().map(|(_, l)| l).collect();
        serde_json::from_str(&text.join("\n")).ok()
    }
}

/// `kumo run` of `guest` with `cpus` vCPUs and `nics`, in the VM namespace.
fn kumo_vm(ctx: &Ctx, guest: &str, cpus: &str, nics: &[Nic], guest_args: &[String]) -> Result<KumoVm, String> {
    let api =
        ctx.dir.as_path().join(format!("api-{}.sock", ctx.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let mut argv = sv(&[&ctx.kumo.display().to_string(), "--api-socket", &api.display().to_string()]);
    argv.extend(sv(&["run", "--memory", &format!("{MEM_MIB}M")]));
    argv.extend(sv(&["--guest", guest, "--cpus", cpus, "--timeout", LIFETIME]));
    for n in nics {
        argv.push("--net".into());
        argv.push(format!("tap={},mac={},{}", n.tap, n.mac, n.irq));
    }
    argv.push("--".into());
    argv.extend(guest_args.iter().cloned());
    Ok(KumoVm { proc: Kid::start_in(Some(&ctx.ns), &argv)?, kumo: ctx.kumo.clone(), api })
}

/// Waits for `<guest>: up nic=N` of a guest program.
fn wait_up(vm: &mut KumoVm, guest: &str, nic: u32) -> Result<Instant, String> {
    let want = format!("{guest}: up nic={nic}");
    vm.wait_line(BOOT_LIMIT, &want, |l| l.contains(&want).then_some(())).map(|(at, _)| at)
}

/// `key=value` of a line, parsed.
fn field<T: std::str::FromStr>(line: &str, key: &str) -> Option<T> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// `udpping: count=N lost=L p50_us=A p99_us=B min_us=C max_us=D`.
pub fn parse_udpping(line: &str) -> Option<Latency> {
    let rest = line.split("udpping: ").nth(1)?;
    if !rest.starts_with("count=") {
        return None;
    }
    Some(Latency {
        count: field(rest, "count")?,
        lost: field(rest, "lost")?,
        p50_us: field(rest, "p50_us")?,
        p99_us: field(rest, "p99_us")?,
        min_us: field(rest, "min_us")?,
        max_us: field(rest, "max_us")?,
    })
}

/// `udpsink: received=N lost=L reordered=R dup=D`.
pub fn parse_udpsink(line: &str) -> Option<(u64, u64, u64, u64)> {
    let rest = line.split("udpsink: ").nth(1)?;
    Some((field(rest, "received")?, field(rest, "lost")?, field(rest, "reordered")?, field(rest, "dup")?))
}

/// Load on the host ↔ guest round trips.
#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Load {
    Unloaded,
    Interference,
}

#[derive(Serialize, Clone, Debug)]
pub struct RttRow {
    pub path: IrqPath,
    pub cpus: u32,
    pub load: Load,
    #[serde(flatten)]
    pub rtt: Runs,
    /// The flooder's send rate on NIC 1 (median over the runs), with interference.
    pub flood_pps: Option<f64>,
    /// `kumo counters` of the VM after all its runs (in the interference row; its NICs'
    /// interrupts per path), None if they could not be read.
    pub counters: Option<serde_json::Value>,
}

/// Host ↔ guest round trips on `path` with `cpus` vCPUs (the consumer on the last): one VM
/// with NIC 0 on `path` and NIC 1 (shared) for the flood; each run measures unloaded, then with
/// the flood on NIC 1. Returns the (unloaded, interference) rows; a failure fills their errors.
pub fn host_rtt(ctx: &Ctx, path: IrqPath, cpus: u32) -> [RttRow; 2] {
    let row = |load| RttRow { path, cpus, load, rtt: Runs::default(), flood_pps: None, counters: None };
    let (mut quiet, mut loud) = (row(Load::Unloaded), row(Load::Interference));
    if let Err(e) = host_rtt_into(ctx, path, cpus, &mut quiet, &mut loud) {
        quiet.rtt.errors.push(e.clone());
        loud.rtt.errors.push(e);
    }
    [quiet, loud]
}

fn host_rtt_into(ctx: &Ctx, path: IrqPath, cpus: u32, quiet: &mut RttRow, loud: &mut RttRow) -> Result<(), String> {
    let consumer = cpus.saturating_sub(1);
    let nics = [
        Nic { tap: &ctx.tap0, mac: MAC0, irq: path.net_irq(consumer) },
        Nic { tap: &ctx.tap1, mac: MAC1, irq: path.others_irq() },
    ];
    let mut args = sv(&[
        format!("ip={GUEST0}"),
        "wait=irq".into(),
        format!("cpu={consumer}"),
        "sink=1".into(),
        format!("ip1={GUEST1}"),
    ]);
    if path == IrqPath::Dedicated {
        // The seed's higher-priority vector class for the dedicated queue.
        args.push("vector=0xe0".into());
    }
    let mut vm = kumo_vm(ctx, "netecho", &cpus.to_string(), &nics, &args)?;
    wait_up(&mut vm, "netecho", 0)?;
    wait_up(&mut vm, "netecho", 1)?;
    let place = placement();
    if let Some(p) = place {
        pin_kumo_threads(vm.proc.id(), consumer, p)?;
    }
    let (measured, interference) = (place.map(|p| p.measured), place.map(|p| p.interference));
    let mut pps = vec![];
    for _ in 0..ctx.plan.runs {
        quiet.rtt.push(host_rtt_tool_on(&ctx.bench, &ctx.ns, GUEST0, &ctx.plan, measured));
        let flood_args = sv(&[
            "flood",
            "--to",
            &format!("{GUEST1}:9"),
            "--size",
            &ctx.plan.flood_size.to_string(),
            "--pps",
            &ctx.plan.flood_pps.to_string(),
        ]);
        let mut flood = tool_on(&ctx.bench, &ctx.ns, &flood_args, interference)?;
        wait_ready(&mut flood)?;
        loud.rtt.push(host_rtt_tool_on(&ctx.bench, &ctx.ns, GUEST0, &ctx.plan, measured));
        flood.close_stdin();
        let f: serde_json::Value = flood.json_result(Duration::from_secs(30))?;
        if let (Some(n), Some(s)) = (f["sent"].as_f64(), f["secs"].as_f64()) {
            pps.push(n / s.max(1e-9));
        }
    }
    loud.flood_pps = median(&pps);
    loud.counters = vm.counters();
    Ok(())
}

#[derive(Serialize, Clone, Debug)]
pub struct PingPong {
    pub path: IrqPath,
    /// `kumo counters` of the `netecho` VM after all runs.
    pub counters: Option<serde_json::Value>,
    /// Time per ping-pong iteration (one UDP round trip VM ↔ VM), per `udpping` run.
    #[serde(flatten)]
    pub rtt: Runs,
}

/// Two VMs on a bridge, both NICs on `path`: `netecho` in VM A, `udpping` runs in VM B.
pub fn vm_pingpong(ctx: &Ctx, path: IrqPath) -> PingPong {
    let mut p = PingPong { path, rtt: Runs::default(), counters: None };
    let r = (|| -> Result<(), String> {
        let nic = [Nic { tap: &ctx.tap_a, mac: MAC_A, irq: path.net_irq(0) }];
        let mut a = kumo_vm(ctx, "netecho", "1", &nic, &sv(&[format!("ip={VM_A}"), "wait=irq".into()]))?;
        wait_up(&mut a, "netecho", 0)?;
        for _ in 0..ctx.plan.runs {
            p.rtt.push(udpping_once(ctx, path));
        }
        p.counters = a.counters();
        Ok(())
    })();
    if let Err(e) = r {
        p.rtt.errors.push(e);
    }
    p
}

fn udpping_once(ctx: &Ctx, path: IrqPath) -> Result<Latency, String> {
    let nic = [Nic { tap: &ctx.tap_b, mac: MAC_B, irq: path.net_irq(0) }];
    let args = sv(&[
        format!("ip={VM_B}"),
        format!("peer={VM_A}"),
        "port=7".into(),
        format!("count={}", ctx.plan.rtt_count),
        format!("size={}", ctx.plan.rtt_size),
    ]);
    let mut b = kumo_vm(ctx, "udpping", "1", &nic, &args)?;
    let limit = BOOT_LIMIT + Duration::from_millis(ctx.plan.rtt_count * 10);
    let (_, l) = b.wait_line(limit, "udpping's result", parse_udpping)?;
    b.wait_exit(Duration::from_secs(30))?;
    Ok(l)
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Direction {
    #[serde(rename = "guest->host")]
    GuestToHost,
    #[serde(rename = "vm->vm")]
    VmToVm,
}

#[derive(Serialize, Clone, Debug)]
pub struct Throughput {
    pub path: IrqPath,
    pub direction: Direction,
    #[serde(flatten)]
    pub stream: Stream,
    /// Median MB/s over the veth baseline's median.
    pub veth_ratio: Option<f64>,
}

fn udpsend_args(ctx: &Ctx, ip: &str, peer: &str) -> Vec<String> {
    sv(&[
        format!("ip={ip}"),
        format!("peer={peer}"),
        "port=9".into(),
        format!("count={}", ctx.plan.stream_count),
        format!("size={}", ctx.plan.stream_size),
        "gap_us=0".into(),
    ])
}

/// Guest → host: `udpsend` in the guest (NIC 0 on `path`) to the host stream sink.
pub fn guest_to_host(ctx: &Ctx, path: IrqPath, veth_mb_per_s: Option<f64>) -> Throughput {
    let mut stream = Stream::default();
    for _ in 0..ctx.plan.runs {
        stream.push(guest_to_host_once(ctx, Vmm::Kumo, &path.net_irq(0), false).map(|(sink, _)| sink));
    }
    let veth_ratio = ratio(stream.median_mb_per_s, veth_mb_per_s);
    Throughput { path, direction: Direction::GuestToHost, stream, veth_ratio }
}

/// One run of `udpsend` (1 vCPU) in `vmm` to the host sink; kumo's NIC takes `irq`. With
/// `cpu`, also the VMM's CPU outside its vCPUs per frame the sink received, µs (from the
/// guest's `up` line, after which it sends at once: the first frames' cost can be missed, the
/// same way for every VMM). Such a guest stays up after its result (`stay=1`) and the VMM's
/// threads are read then: a VMM that ends takes its threads' CPU time with it, and reading
/// them while it ends lost the NIC thread (kumo read 0 µs per frame in two runs of three).
fn guest_to_host_once(ctx: &Ctx, vmm: Vmm, irq: &str, cpu: bool) -> Result<(SinkResult, Option<f64>), String> {
    let mut sink = tool(&ctx.bench, &ctx.ns, &sv(&["sink", "--bind", &format!("{HOST0}:9"), "--first-ms", "60000"]))?;
    wait_ready(&mut sink)?;
    let mut args = udpsend_args(ctx, GUEST0, HOST0);
    if cpu {
        args.push("stay=1".into());
    }
    let mut vm = AnyVm::boot(ctx, vmm, irq, "udpsend", &args)?;
    let clock = if cpu {
        vm.wait_up("udpsend")?;
        Some(vm.io_cpu()?)
    } else {
        None
    };
    let r = sink.json_result::<SinkResult>(BOOT_LIMIT + Duration::from_secs(120));
    let Some(clock) = clock else {
        vm.wait_exit(Duration::from_secs(30))?;
        return Ok((r?, None));
    };
    let r = r?;
    vm.wait_serial("udpsend: finished rc=0, staying up", Duration::from_secs(30))?;
    let per = clock.per(r.received)?;
    Ok((r, Some(per)))
}

/// VM → VM on the bridge: `udpsend` in VM B to `udpsink` in VM A, both on `path`. The sink
/// prints only counts, so the rate is host-timed: from `udpsend`'s first output line (its NIC
/// is up) to `udpsink`'s result line (`udpsend`'s last line if the host had to resend the end
/// marker: `ended` false) — a lower bound.
pub fn vm_to_vm(ctx: &Ctx, path: IrqPath, veth_mb_per_s: Option<f64>) -> Throughput {
    let mut stream = Stream::default();
    for _ in 0..ctx.plan.runs {
        stream.push(vm_to_vm_once(ctx, path));
    }
    let veth_ratio = ratio(stream.median_mb_per_s, veth_mb_per_s);
    Throughput { path, direction: Direction::VmToVm, stream, veth_ratio }
}

fn vm_to_vm_once(ctx: &Ctx, path: IrqPath) -> Result<SinkResult, String> {
    let plan = &ctx.plan;
    let nic_a = [Nic { tap: &ctx.tap_a, mac: MAC_A, irq: path.net_irq(0) }];
    let sink_args = sv(&[format!("ip={VM_A}"), "port=9".into(), format!("count={}", plan.stream_count)]);
    let mut a = kumo_vm(ctx, "udpsink", "1", &nic_a, &sink_args)?;
    a.wait_line(BOOT_LIMIT, "udpsink: up", |l| (l.contains("udpsink:") && l.contains(" up")).then_some(()))?;
    let nic_b = [Nic { tap: &ctx.tap_b, mac: MAC_B, irq: path.net_irq(0) }];
    let mut b = kumo_vm(ctx, "udpsend", "1", &nic_b, &udpsend_args(ctx, VM_B, VM_A))?;
    let limit = BOOT_LIMIT + Duration::from_secs(120);
    let (sent_at, _) = b.wait_line(limit, "udpsend's result", |l| l.contains("udpsend: sent=").then_some(()))?;
    let start = b.lines().first().map_or(b.started, |(at, _)| *at);
    b.wait_exit(Duration::from_secs(30))?;
    // The sink stops at its count or the end marker. If the stream's 3 end markers were all
    // dropped, the host sends them again across the bridge, and the stream ends at udpsend's
    // last line instead.
    let (ended, (end, (received, lost, reordered, dup))) =
        match a.wait_line(Duration::from_secs(3), "udpsink's result", parse_udpsink) {
            Ok(r) => (true, r),
            Err(_) => {
                let mut e = tool(&ctx.bench, &ctx.ns, &sv(&["send", "--to", &format!("{VM_A}:9"), "--count", "0"]))?;
                let _: tools::SendResult = e.json_result(Duration::from_secs(30))?;
                let what = "udpsink's result (after the host resent the end marker)";
                let (_, r) = a.wait_line(Duration::from_secs(30), what, parse_udpsink)?;
                (false, (sent_at, r))
            }
        };
    let secs = end.saturating_duration_since(start).as_secs_f64();
    let bytes = received * plan.stream_size as u64;
    let per_s = |v: f64| if secs > 0.0 { v / secs } else { 0.0 };
    Ok(SinkResult {
        total: received + lost,
        received,
        lost,
        reordered,
        dup,
        bytes,
        secs,
        mb_per_s: per_s(bytes as f64) / 1e6,
        packets_per_s: per_s(received as f64),
        ended,
    })
}

// ---------------------------------------------------------------------------------------------
// Report

#[derive(Serialize, Clone, Debug, Default, PartialEq)]
pub struct Headline {
    /// The vCPU count the headline's round trips come from.
    pub cpus: Option<u32>,
    pub dedicated_p99_us: Option<f64>,
    pub dedicated_unloaded_p99_us: Option<f64>,
    pub shared_p99_us: Option<f64>,
    pub veth_ratio: Option<f64>,
    /// Section 5, kumo against QEMU (1 vCPU, unloaded, unpinned): each VMM's round-trip
    /// medians and guest -> host stream, and kumo over QEMU.
    pub kumo_rtt_p50_us: Option<f64>,
    pub kumo_rtt_p99_us: Option<f64>,
    pub kumo_stream_mb_s: Option<f64>,
    pub qemu_rtt_p50_us: Option<f64>,
    pub qemu_rtt_p99_us: Option<f64>,
    pub qemu_stream_mb_s: Option<f64>,
    pub rtt_p99_ratio_qemu: Option<f64>,
    /// kumo with `poll-us` on its NIC over QEMU.
    pub poll_rtt_p99_ratio_qemu: Option<f64>,
    pub poll_mbps_ratio_qemu: Option<f64>,
    pub mbps_ratio_qemu: Option<f64>,
    /// Both VMMs with their vCPU and their other threads pinned apart: round-trip p99, kumo over
    /// QEMU.
    pub pinned_rtt_p99_ratio_qemu: Option<f64>,
    /// kumo pinned by its own `--cpus 1,pin=` over QEMU pinned from outside: round-trip p99.
    pub self_pinned_rtt_p99_ratio_qemu: Option<f64>,
    /// CPU of the VMM's threads other than the vCPUs per streamed frame, kumo over QEMU.
    pub io_cpu_frame_ratio_qemu: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Goal {
    pub name: String,
    pub value: String,
    pub goal: String,
    pub met: Option<bool>,
}

#[derive(Serialize, Default)]
pub struct Report {
    pub bench: &'static str,
    pub quick: bool,
    pub host_cpus: usize,
    pub command: String,
    pub elapsed_s: f64,
    pub plan: Option<Plan>,
    /// None when the namespaces could not be made (why in `veth_skipped`).
    pub veth: Option<Veth>,
    pub veth_skipped: Option<String>,
    /// Why there are no VM measurements, if there are none.
    pub vm_skipped: Option<String>,
    pub rtt: Vec<RttRow>,
    pub pingpong: Vec<PingPong>,
    pub throughput: Vec<Throughput>,
    /// kumo against QEMU's virtio-net-pci (section 5); None when the VM part did not run.
    pub qemu: Option<VsQemu>,
    pub headline: Headline,
    pub goals: Vec<Goal>,
    pub png: Option<String>,
}

fn find_rtt(rows: &[RttRow], path: IrqPath, cpus: u32, load: Load) -> Option<&RttRow> {
    rows.iter().find(|r| r.path == path && r.cpus == cpus && r.load == load)
}

/// The headline: round trips with 2 vCPUs where both paths measured there, else 1; the
/// dedicated path's guest → host stream over veth; the kumo-vs-QEMU figures.
pub fn headline(r: &Report) -> Headline {
    let mut h = paths_headline(r);
    if let Some(q) = &r.qemu {
        (h.kumo_rtt_p50_us, h.kumo_rtt_p99_us, h.kumo_stream_mb_s) =
            (q.kumo.rtt.p50_us, q.kumo.rtt.p99_us, q.kumo.stream.median_mb_per_s);
        (h.qemu_rtt_p50_us, h.qemu_rtt_p99_us, h.qemu_stream_mb_s) =
            (q.qemu.rtt.p50_us, q.qemu.rtt.p99_us, q.qemu.stream.median_mb_per_s);
        (h.rtt_p99_ratio_qemu, h.mbps_ratio_qemu) = (q.rtt_p99_ratio_qemu, q.mbps_ratio_qemu);
        (h.poll_rtt_p99_ratio_qemu, h.poll_mbps_ratio_qemu) = (q.poll_rtt_p99_ratio_qemu, q.poll_mbps_ratio_qemu);
        (h.pinned_rtt_p99_ratio_qemu, h.io_cpu_frame_ratio_qemu) =
            (q.pinned_rtt_p99_ratio_qemu, q.io_cpu_frame_ratio_qemu);
        h.self_pinned_rtt_p99_ratio_qemu = q.self_pinned_rtt_p99_ratio_qemu;
    }
    h
}

fn paths_headline(r: &Report) -> Headline {
    let p99 = |path, cpus, load| find_rtt(&r.rtt, path, cpus, load).and_then(|x| x.rtt.p99_us);
    let cpus = [2, 1].into_iter().find(|&c| {
        p99(IrqPath::Dedicated, c, Load::Interference).is_some()
            && p99(IrqPath::Shared, c, Load::Interference).is_some()
    });
    let veth_ratio = r
        .throughput
        .iter()
        .find(|t| t.path == IrqPath::Dedicated && t.direction == Direction::GuestToHost)
        .and_then(|t| t.veth_ratio);
    let Some(c) = cpus else { return Headline { veth_ratio, ..Default::default() } };
    Headline {
        cpus: Some(c),
        dedicated_p99_us: p99(IrqPath::Dedicated, c, Load::Interference),
        dedicated_unloaded_p99_us: p99(IrqPath::Dedicated, c, Load::Unloaded),
        shared_p99_us: p99(IrqPath::Shared, c, Load::Interference),
        veth_ratio,
        ..Default::default()
    }
}

/// The issue's goals, checked against the headline and the ping-pong rows.
pub fn goals(r: &Report) -> Vec<Goal> {
    let h = &r.headline;
    let mut g = vec![];
    let check = |name: &str, value: Option<(f64, f64)>, goal: &str, ok: fn(f64, f64) -> bool| Goal {
        name: name.into(),
        value: value.map_or("n/a".into(), |(a, b)| format!("{a:.1} vs {b:.1}")),
        goal: goal.into(),
        met: value.map(|(a, b)| ok(a, b)),
    };
    let pair = |a: Option<f64>, b: Option<f64>| Some((a?, b?));
    g.push(check(
        "dedicated p99 with interference vs its unloaded p99 (us)",
        pair(h.dedicated_p99_us, h.dedicated_unloaded_p99_us),
        "<= 1.5x",
        |a, b| a <= 1.5 * b,
    ));
    g.push(check(
        "dedicated p99 vs shared p99, with interference (us)",
        pair(h.dedicated_p99_us, h.shared_p99_us),
        ">= 30 % below",
        |a, b| a <= 0.7 * b,
    ));
    let pp = |path| r.pingpong.iter().find(|p| p.path == path).and_then(|p| p.rtt.p50_us);
    g.push(check(
        "VM-VM ping-pong p50, dedicated vs shared (us)",
        pair(pp(IrqPath::Dedicated), pp(IrqPath::Shared)),
        "dedicated faster",
        |a, b| a < b,
    ));
    g.push(Goal {
        name: "guest->host throughput over veth (dedicated)".into(),
        value: h.veth_ratio.map_or("n/a".into(), |v| format!("{v:.3}")),
        goal: "stated".into(),
        met: h.veth_ratio.map(|_| true),
    });
    if r.qemu.as_ref().is_some_and(|q| q.skipped.is_none()) {
        let vs = |name: &str, v: Option<f64>, goal: &str, ok: fn(f64) -> bool| Goal {
            name: name.into(),
            value: v.map_or("n/a".into(), |v| format!("{v:.3}")),
            goal: goal.into(),
            met: v.map(ok),
        };
        g.push(vs("round-trip p99, kumo / QEMU (issue 24)", h.rtt_p99_ratio_qemu, "<= 0.9", |v| v <= 0.9));
        g.push(vs("guest->host stream, kumo / QEMU (issue 24)", h.mbps_ratio_qemu, ">= 1.2", |v| v >= 1.2));
        g.push(vs("round-trip p99, kumo poll-us / QEMU", h.poll_rtt_p99_ratio_qemu, "<= 0.9", |v| v <= 0.9));
        g.push(vs("round-trip p99, both pinned, kumo / QEMU", h.pinned_rtt_p99_ratio_qemu, "<= 0.9", |v| v <= 0.9));
        let own = "round-trip p99, kumo pinned by its own flag / QEMU pinned";
        g.push(vs(own, h.self_pinned_rtt_p99_ratio_qemu, "<= 0.9", |v| v <= 0.9));
    }
    g
}

/// The final line.
pub fn headline_line(h: &Headline) -> String {
    format!(
        "dedicated_p99_us={} dedicated_unloaded_p99_us={} shared_p99_us={} veth_ratio={} kumo_rtt_p50_us={} \
         kumo_rtt_p99_us={} kumo_stream_mb_s={} qemu_rtt_p50_us={} qemu_rtt_p99_us={} qemu_stream_mb_s={} \
         rtt_p99_ratio_qemu={} mbps_ratio_qemu={} poll_rtt_p99_ratio_qemu={} poll_mbps_ratio_qemu={} \
         pinned_rtt_p99_ratio_qemu={} self_pinned_rtt_p99_ratio_qemu={} io_cpu_frame_ratio_qemu={}",
        opt(h.dedicated_p99_us, 1),
        opt(h.dedicated_unloaded_p99_us, 1),
        opt(h.shared_p99_us, 1),
        opt(h.veth_ratio, 3),
        opt(h.kumo_rtt_p50_us, 1),
        opt(h.kumo_rtt_p99_us, 1),
        opt(h.kumo_stream_mb_s, 1),
        opt(h.qemu_rtt_p50_us, 1),
        opt(h.qemu_rtt_p99_us, 1),
        opt(h.qemu_stream_mb_s, 1),
        opt(h.rtt_p99_ratio_qemu, 3),
        opt(h.mbps_ratio_qemu, 3),
        opt(h.poll_rtt_p99_ratio_qemu, 3),
        opt(h.poll_mbps_ratio_qemu, 3),
        opt(h.pinned_rtt_p99_ratio_qemu, 3),
        opt(h.self_pinned_rtt_p99_ratio_qemu, 3),
        opt(h.io_cpu_frame_ratio_qemu, 3)
    )
}

/// The tables, as printed.
pub fn tables(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let p = r.plan;
    let _ = writeln!(
        s,
        "kumo bench net{}: interrupt paths of kumo's NIC against veth and QEMU on this host ({} CPUs), {:.0} s",
        if r.quick { " --quick" } else { "" },
        r.host_cpus,
        r.elapsed_s
    );
    if let Some(p) = p {
        let _ = writeln!(
            s,
            "   {} runs per row, medians; round trips {} x {} B; streams {} x {} B, no gap",
            p.runs, p.rtt_count, p.rtt_size, p.stream_count, p.stream_size
        );
    }
    let _ = writeln!(s, "\n1. veth baseline: two network namespaces joined by veth");
    match (&r.veth, &r.veth_skipped) {
        (Some(v), _) => {
            let _ = writeln!(
                s,
                "   {:<28} {:>10} {:>12} {:>8} {:>10}",
                "measurement", "MB/s", "packets/s", "lost", "reordered"
            );
            for (i, x) in v.stream.runs.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "   {:<28} {:>10.1} {:>12.0} {:>8} {:>10}",
                    format!("stream A->B, run {}", i + 1),
                    x.mb_per_s,
                    x.packets_per_s,
                    x.lost,
                    x.reordered
                );
            }
            let _ = writeln!(
                s,
                "   {:<28} {:>10} {:>12}",
                "stream A->B, median",
                opt(v.stream.median_mb_per_s, 1),
                opt(v.stream.median_packets_per_s, 0)
            );
            let _ = writeln!(
                s,
                "   {:<28} p50 {} us, p99 {} us",
                "UDP round trip A->B->A",
                opt(v.rtt.p50_us, 1),
                opt(v.rtt.p99_us, 1)
            );
            for e in v.stream.errors.iter().chain(&v.rtt.errors) {
                let _ = writeln!(s, "   FAILED: {e}");
            }
        }
        (None, why) => {
            let _ = writeln!(s, "   skipped: {}", why.as_deref().unwrap_or("not run"));
        }
    }
    if let Some(why) = &r.vm_skipped {
        let _ = writeln!(s, "\nVM measurements skipped: {why}");
        return s;
    }
    s.push_str(&vm_tables(r));
    match &r.qemu {
        Some(q) => s.push_str(&vs_qemu::table(q)),
        None => s.push_str(&vs_qemu::table(&VsQemu { skipped: Some("not run".into()), ..Default::default() })),
    }
    let _ = writeln!(s, "\n6. goals (headline: {} vCPU(s))", r.headline.cpus.map_or("n/a".into(), |c| c.to_string()));
    for g in &r.goals {
        let met = match g.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "n/a",
        };
        let _ = writeln!(s, "   {:<58} {:>16}  goal {:<18} {met}", g.name, g.value, g.goal);
    }
    s
}

/// Sections 2 to 4 of the tables: kumo's interrupt paths.
fn vm_tables(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n2. host <-> guest UDP round trip (netecho; interference: NIC 1 flooded from the host, on the shared path\n   in the shared rows and delivered by KVM to vCPU 0 in the dedicated rows; with 2+ host CPUs the\n   path under test and the interference are pinned to different host CPUs, the same for every row;"
    );
    let _ = writeln!(s, "   nic1_irqs: NIC 1's interrupts over all runs of the VM, from kumo counters)");
    let _ = writeln!(
        s,
        "   {:<10} {:>5} {:<13} {:>9} {:>9} {:>6} {:>5} {:>11} {:>10}",
        "path", "vCPUs", "load", "p50_us", "p99_us", "lost", "runs", "flood_pps", "nic1_irqs"
    );
    for x in &r.rtt {
        let lost: u64 = x.rtt.runs.iter().map(|l| l.lost).sum();
        let _ = writeln!(
            s,
            "   {:<10} {:>5} {:<13} {:>9} {:>9} {:>6} {:>5} {:>11} {:>10}",
            x.path.label(),
            x.cpus,
            if x.load == Load::Unloaded { "unloaded" } else { "interference" },
            opt(x.rtt.p50_us, 1),
            opt(x.rtt.p99_us, 1),
            lost,
            x.rtt.runs.len(),
            opt(x.flood_pps, 0),
            x.counters
                .as_ref()
                .and_then(|c| c["net"]["net1"]["interrupts"].as_u64())
                .map_or("n/a".into(), |n| n.to_string())
        );
        for e in &x.rtt.errors {
            let _ = writeln!(s, "      FAILED: {e}");
        }
    }
    let _ = writeln!(s, "\n3. VM <-> VM ping-pong on a bridge (udpping -> netecho): time per iteration");
    let _ = writeln!(s, "   {:<10} {:>9} {:>9} {:>6} {:>5}", "path", "p50_us", "p99_us", "lost", "runs");
    for x in &r.pingpong {
        let lost: u64 = x.rtt.runs.iter().map(|l| l.lost).sum();
        let _ = writeln!(
            s,
            "   {:<10} {:>9} {:>9} {:>6} {:>5}",
            x.path.label(),
            opt(x.rtt.p50_us, 1),
            opt(x.rtt.p99_us, 1),
            lost,
            x.rtt.runs.len()
        );
        for e in &x.rtt.errors {
            let _ = writeln!(s, "      FAILED: {e}");
        }
    }
    let _ = writeln!(s, "\n4. throughput (udpsend, no gap), against veth");
    let _ = writeln!(
        s,
        "   {:<10} {:<12} {:>9} {:>11} {:>8} {:>10} {:>5}",
        "path", "direction", "MB/s", "packets/s", "x veth", "lost", "runs"
    );
    for x in &r.throughput {
        let lost: u64 = x.stream.runs.iter().map(|l| l.lost).sum();
        let _ = writeln!(
            s,
            "   {:<10} {:<12} {:>9} {:>11} {:>8} {:>10} {:>5}",
            x.path.label(),
            if x.direction == Direction::GuestToHost { "guest->host" } else { "vm->vm" },
            opt(x.stream.median_mb_per_s, 1),
            opt(x.stream.median_packets_per_s, 0),
            opt(x.veth_ratio, 3),
            lost,
            x.stream.runs.len()
        );
        for e in &x.stream.errors {
            let _ = writeln!(s, "      FAILED: {e}");
        }
    }
    let _ =
        writeln!(s, "   (vm->vm is timed on the host from udpsend's first line to udpsink's result: a lower bound)");
    s
}

// ---------------------------------------------------------------------------------------------
// Plot

fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let root = BitMapBackend::new(path, (1800, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let (left, right) = root.split_horizontally(1150);

    // Round trips: grouped bars p50 / p99 per (path, vCPUs, load), then the ping-pong rows.
    let mut groups: Vec<(String, Option<f64>, Option<f64>)> = r
        .rtt
        .iter()
        .map(|x| {
            let load = if x.load == Load::Unloaded { "idle" } else { "intf" };
            (format!("{} {}c {load}", x.path.label(), x.cpus), x.rtt.p50_us, x.rtt.p99_us)
        })
        .collect();
    groups.extend(r.pingpong.iter().map(|x| (format!("{} VM-VM", x.path.label()), x.rtt.p50_us, x.rtt.p99_us)));
    groups.extend(qemu_bars(r, |s| (s.rtt.p50_us, s.rtt.p99_us)));
    let top = groups.iter().filter_map(|g| g.2.or(g.1)).fold(1.0, f64::max) * 1.15;
    let n = groups.len().max(1) as f64;
    let mut c = ChartBuilder::on(&left)
        .caption("UDP round trip: host<->guest, VM<->VM ping-pong, kumo vs QEMU; p50 / p99", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..top)
        .map_err(e)?;
    let names: Vec<String> = groups.iter().map(|g| g.0.clone()).collect();
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len().max(1))
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 0.01 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("microseconds")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    for (k, (label, col)) in [("p50", BLUE), ("p99", RED)].into_iter().enumerate() {
        let bars: Vec<_> = groups
            .iter()
            .enumerate()
            .filter_map(|(i, g)| {
                let v = if k == 0 { g.1 } else { g.2 }?;
                let x0 = i as f64 - 0.38 + k as f64 * 0.38;
                Some(Rectangle::new([(x0, 0.0), (x0 + 0.36, v)], col.mix(0.8).filled()))
            })
            .collect();
        c.draw_series(bars)
            .map_err(e)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.mix(0.8).filled()));
    }
    c.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(e)?;

    // Throughput as a ratio of veth.
    let veth_mb = r.veth.as_ref().and_then(|v| v.stream.median_mb_per_s);
    let rows: Vec<(String, f64)> = r
        .throughput
        .iter()
        .filter_map(|t| {
            let d = if t.direction == Direction::GuestToHost { "guest->host" } else { "VM->VM" };
            Some((format!("{} {d}", t.path.label()), t.veth_ratio?))
        })
        .chain(
            qemu_bars(r, |s| (ratio(s.stream.median_mb_per_s, veth_mb), None))
                .into_iter()
                .filter_map(|(l, v, _)| Some((l, v?))),
        )
        .collect();
    let top = rows.iter().map(|x| x.1).fold(1.0, f64::max) * 1.15;
    let n = rows.len().max(1) as f64;
    let mut c = ChartBuilder::on(&right)
        .caption("UDP stream throughput / veth", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..top)
        .map_err(e)?;
    let names: Vec<String> = rows.iter().map(|x| x.0.clone()).collect();
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1))
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 0.01 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("MB/s over veth's")
        .y_label_formatter(&|v| format!("{v:.2}"))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(e)?;
    c.draw_series(LineSeries::new([(-0.5, 1.0), (n - 0.5, 1.0)], BLACK.stroke_width(2)))
        .map_err(e)?
        .label(format!("veth ({} MB/s)", opt(r.veth.as_ref().and_then(|v| v.stream.median_mb_per_s), 0)))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    c.draw_series(
        rows.iter()
            .enumerate()
            .map(|(i, x)| Rectangle::new([(i as f64 - 0.3, 0.0), (i as f64 + 0.3, x.1)], GREEN.mix(0.7).filled())),
    )
    .map_err(e)?;
    c.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// The kumo-vs-QEMU section's bars for the plot: (label, value, value) per VMM, from `f`.
fn qemu_bars(
    r: &Report,
    f: impl Fn(&vs_qemu::Side) -> (Option<f64>, Option<f64>),
) -> Vec<(String, Option<f64>, Option<f64>)> {
    let Some(q) = r.qemu.as_ref().filter(|q| q.skipped.is_none()) else { return vec![] };
    [("kumo 1c vs QEMU", Vmm::Kumo), ("kumo poll-us 1c", Vmm::KumoPoll), ("QEMU 1c", Vmm::Qemu)]
        .into_iter()
        .map(|(label, vmm)| {
            let (a, b) = f(q.side(vmm));
            (label.to_string(), a, b)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

fn write_json(json: &Path, r: &Report) -> Result<(), String> {
    let text = serde_json::to_string_pretty(r).map_err(|e| e.to_string())?;
    std::fs::write(json, text).map_err(|e| format!("cannot write {}: {e}", json.display()))
}

/// Makes the VM namespace with its taps and bridge; undone when the guard drops.
pub fn vm_net(g: &mut NetGuard, kumo: PathBuf, bench: PathBuf, plan: Plan) -> Result<Ctx, String> {
    let ns = host::name("vm");
    g.netns(&ns)?;
    let ctx = Ctx {
        kumo,
        bench,
        plan,
        tap0: host::name("t0"),
        tap1: host::name("t1"),
        tap_a: host::name("ta"),
        tap_b: host::name("tb"),
        ns,
        dir: vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-bench-net-"))
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?,
        seq: Default::default(),
    };
    // Single-queue: QEMU's tap backend attaches it too (section 5).
    g.single_queue_tap(&ctx.ns, &ctx.tap0, Some(&cidr(HOST0)))?;
    g.tap(&ctx.ns, &ctx.tap1, Some(&cidr(HOST1)))?;
    g.tap(&ctx.ns, &ctx.tap_a, None)?;
    g.tap(&ctx.ns, &ctx.tap_b, None)?;
    let br = host::name("br");
    g.bridge(&ctx.ns, &br, &[&ctx.tap_a, &ctx.tap_b])?;
    // The host on the bridge, to resend a VM -> VM stream's end marker if all were dropped.
    host::ip(&["-n", &ctx.ns, "addr", "add", &cidr(BRIDGE), "dev", &br])?;
    g.neigh(&ctx.ns, VM_A, MAC_A, &br)?;
    // The host knows the guests' MACs: no ARP on the measured paths, and the flood needs none.
    g.neigh(&ctx.ns, GUEST0, MAC0, &ctx.tap0)?;
    g.neigh(&ctx.ns, GUEST1, MAC1, &ctx.tap1)?;
    Ok(ctx)
}

/// Runs every VM measurement into `r` (the integrator's entry point once `--net` exists).
pub fn vm_measurements(ctx: &Ctx, r: &mut Report, t0: Instant) {
    for cpus in [1, 2] {
        for path in PATHS {
            step(t0, &format!("host <-> guest round trips: {} path, {cpus} vCPU(s)", path.label()));
            r.rtt.extend(host_rtt(ctx, path, cpus));
        }
    }
    for path in PATHS {
        step(t0, &format!("VM <-> VM ping-pong: {} path", path.label()));
        r.pingpong.push(vm_pingpong(ctx, path));
    }
    let veth = r.veth.as_ref().and_then(|v| v.stream.median_mb_per_s);
    for path in PATHS {
        step(t0, &format!("guest -> host stream: {} path", path.label()));
        r.throughput.push(guest_to_host(ctx, path, veth));
        step(t0, &format!("VM -> VM stream: {} path", path.label()));
        r.throughput.push(vm_to_vm(ctx, path, veth));
    }
    r.qemu = Some(vs_qemu::measure(ctx, t0));
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    let t0 = Instant::now();
    let (json, png) = (crate::out_file(out, "net.json")?, out.join("net.png"));
    let bench = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let plan = Plan { flood_size: a.flood_size, ..Plan::new(a.quick, a.runs, a.flood_pps) };
    host::cleanup_on_signals("kumo bench net")?;
    host::sweep_stale();
    let mut r = Report {
        bench: "net",
        quick: a.quick,
        host_cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        plan: Some(plan),
        ..Default::default()
    };

    step(t0, "veth baseline");
    match veth_baseline(&bench, &plan) {
        Ok(v) => r.veth = Some(v),
        Err(e) => {
            eprintln!("kumo bench net: no veth baseline (network namespaces unavailable?): {e}");
            r.veth_skipped = Some(e);
        }
    }

    // The VM part needs /dev/kvm, `kumo run --net` and the network guests.
    let support = crate::kumo_binary()
        .and_then(|k| {
            kumo_vm::vm::open_kvm().map_err(|e| format!("no /dev/kvm ({e}): no VM measurements"))?;
            vm_support(&k).map(|_| k)
        })
        .and_then(|k| if r.veth.is_some() { Ok(k) } else { Err("no network namespaces: no VM measurements".into()) });
    let kumo = match support {
        Ok(k) => k,
        Err(why) => {
            r.vm_skipped = Some(why.clone());
            r.elapsed_s = t0.elapsed().as_secs_f64();
            print!("{}", tables(&r));
            write_json(&json, &r)?;
            println!("\nJSON written to {}", json.display());
            println!("kumo bench net: {why}");
            return Ok(1);
        }
    };
    {
        let mut g = NetGuard::default();
        let ctx = vm_net(&mut g, kumo, bench, plan)?;
        vm_measurements(&ctx, &mut r, t0);
    }
    r.headline = headline(&r);
    r.goals = goals(&r);
    step(t0, "drawing the plot");
    match plot(&png, &r) {
        Ok(()) => r.png = Some(png.display().to_string()),
        Err(e) => eprintln!("kumo bench net: no plot: {e}"),
    }
    r.elapsed_s = t0.elapsed().as_secs_f64();
    print!("{}", tables(&r));
    write_json(&json, &r)?;
    println!(
        "\nJSON written to {}{}",
        json.display(),
        r.png.as_ref().map_or(String::new(), |p| format!("; plot written to {p}"))
    );
    let h = &r.headline;
    let qemu_skipped = r.qemu.as_ref().and_then(|q| q.skipped.as_deref());
    let complete = h.dedicated_p99_us.is_some()
        && h.dedicated_unloaded_p99_us.is_some()
        && h.shared_p99_us.is_some()
        && h.veth_ratio.is_some()
        && (qemu_skipped.is_some() || (h.rtt_p99_ratio_qemu.is_some() && h.mbps_ratio_qemu.is_some()));
    if let Some(why) = qemu_skipped {
        println!("kumo bench net: no QEMU rows: {why}");
    }
    println!("{}", headline_line(h));
    if !complete {
        eprintln!("kumo bench net: some headline figures are missing (n/a): see FAILED in the tables above");
        return Ok(1);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lat(p50: f64, p99: f64) -> Latency {
        Latency { count: 100, lost: 0, p50_us: p50, p99_us: p99, min_us: p50 / 2.0, max_us: p99 * 2.0 }
    }

    fn runs(p50: f64, p99: f64) -> Runs {
        let mut r = Runs::default();
        r.push(Ok(lat(p50, p99)));
        r
    }

    fn sample_report() -> Report {
        let mut r = Report { bench: "net", plan: Some(Plan::new(true, None, 20_000)), ..Default::default() };
        let mut v = Veth::default();
        v.stream.push(Ok(SinkResult {
            received: 10,
            total: 10,
            mb_per_s: 100.0,
            packets_per_s: 1e5,
            ..Default::default()
        }));
        v.rtt.push(Ok(lat(20.0, 40.0)));
        r.veth = Some(v);
        for (path, cpus, load, p99) in [
            (IrqPath::Shared, 2, Load::Unloaded, 100.0),
            (IrqPath::Shared, 2, Load::Interference, 400.0),
            (IrqPath::Dedicated, 2, Load::Unloaded, 90.0),
            (IrqPath::Dedicated, 2, Load::Interference, 120.0),
            (IrqPath::Dedicated, 1, Load::Interference, 999.0),
        ] {
            r.rtt.push(RttRow { path, cpus, load, rtt: runs(p99 / 2.0, p99), flood_pps: None, counters: None });
        }
        r.pingpong.push(PingPong { path: IrqPath::Shared, rtt: runs(80.0, 160.0), counters: None });
        r.pingpong.push(PingPong { path: IrqPath::Dedicated, rtt: runs(60.0, 120.0), counters: None });
        let mut s = Stream::default();
        s.push(Ok(SinkResult { received: 10, mb_per_s: 25.0, ..Default::default() }));
        r.throughput.push(Throughput {
            path: IrqPath::Dedicated,
            direction: Direction::GuestToHost,
            stream: s,
            veth_ratio: Some(0.25),
        });
        r.headline = headline(&r);
        r.goals = goals(&r);
        r
    }

    #[test]
    fn headline_takes_two_vcpus_and_the_dedicated_stream() {
        let r = sample_report();
        assert_eq!(
            r.headline,
            Headline {
                cpus: Some(2),
                dedicated_p99_us: Some(120.0),
                dedicated_unloaded_p99_us: Some(90.0),
                shared_p99_us: Some(400.0),
                veth_ratio: Some(0.25),
                ..Default::default()
            }
        );
        assert_eq!(
            headline_line(&r.headline),
            "dedicated_p99_us=120.0 dedicated_unloaded_p99_us=90.0 shared_p99_us=400.0 veth_ratio=0.250 \
             kumo_rtt_p50_us=n/a kumo_rtt_p99_us=n/a kumo_stream_mb_s=n/a qemu_rtt_p50_us=n/a qemu_rtt_p99_us=n/a \
             qemu_stream_mb_s=n/a rtt_p99_ratio_qemu=n/a mbps_ratio_qemu=n/a poll_rtt_p99_ratio_qemu=n/a \
             poll_mbps_ratio_qemu=n/a pinned_rtt_p99_ratio_qemu=n/a self_pinned_rtt_p99_ratio_qemu=n/a io_cpu_frame_ratio_qemu=n/a"
        );
        assert_eq!(r.goals.iter().map(|g| g.met).collect::<Vec<_>>(), vec![Some(true); 4]);
    }

    #[test]
    fn headline_ends_with_the_qemu_figures_and_ratios() {
        let mut r = sample_report();
        r.qemu = Some(vs_qemu::tests::sample());
        r.headline = headline(&r);
        r.goals = goals(&r);
        let line = headline_line(&r.headline);
        assert!(
            line.ends_with(
                "kumo_rtt_p50_us=60.0 kumo_rtt_p99_us=100.0 kumo_stream_mb_s=300.0 qemu_rtt_p50_us=80.0 \
                 qemu_rtt_p99_us=125.0 qemu_stream_mb_s=250.0 rtt_p99_ratio_qemu=0.800 mbps_ratio_qemu=1.200 \
                 poll_rtt_p99_ratio_qemu=0.500 poll_mbps_ratio_qemu=1.100 pinned_rtt_p99_ratio_qemu=0.800 \
                 self_pinned_rtt_p99_ratio_qemu=0.850 io_cpu_frame_ratio_qemu=0.500"
            ),
            "{line}"
        );
        assert_eq!(r.goals.len(), 9);
        assert_eq!(r.goals[4..].iter().map(|g| g.met).collect::<Vec<_>>(), vec![Some(true); 5]);
        let t = tables(&r);
        assert!(t.contains("5. kumo vs QEMU") && t.contains("kumo / QEMU"), "{t}");
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["qemu"]["qemu"]["stream"]["median_mb_per_s"].as_f64(), Some(250.0));
        assert_eq!(v["qemu"]["mbps_ratio_qemu"].as_f64(), Some(1.2));
        assert_eq!(v["headline"]["rtt_p99_ratio_qemu"].as_f64(), Some(0.8));
        crate::check_plot("net-qemu", |p| plot(p, &r));
    }

    #[test]
    fn missing_figures_are_na_not_invented() {
        let r = Report::default();
        let h = headline(&r);
        assert_eq!(h, Headline::default());
        assert_eq!(
            headline_line(&h),
            "dedicated_p99_us=n/a dedicated_unloaded_p99_us=n/a shared_p99_us=n/a veth_ratio=n/a kumo_rtt_p50_us=n/a \
             kumo_rtt_p99_us=n/a kumo_stream_mb_s=n/a qemu_rtt_p50_us=n/a qemu_rtt_p99_us=n/a qemu_stream_mb_s=n/a \
             rtt_p99_ratio_qemu=n/a mbps_ratio_qemu=n/a poll_rtt_p99_ratio_qemu=n/a poll_mbps_ratio_qemu=n/a \
             pinned_rtt_p99_ratio_qemu=n/a self_pinned_rtt_p99_ratio_qemu=n/a io_cpu_frame_ratio_qemu=n/a"
        );
        assert!(goals(&r).iter().all(|g| g.met.is_none()));
    }

    #[test]
    fn json_shape() {
        let v = serde_json::to_value(sample_report()).expect("json");
        for k in ["bench", "plan", "veth", "rtt", "pingpong", "throughput", "headline", "goals"] {
            assert!(v.get(k).is_some(), "no {k}");
        }
        let row = &v["rtt"][1];
        assert_eq!(
            (row["path"].as_str(), row["load"].as_str(), row["cpus"].as_u64()),
            (Some("shared"), Some("interference"), Some(2))
        );
        assert_eq!(row["p99_us"].as_f64(), Some(400.0));
        assert_eq!(v["throughput"][0]["direction"].as_str(), Some("guest->host"));
        assert_eq!(v["veth"]["stream"]["median_mb_per_s"].as_f64(), Some(100.0));
    }

    #[test]
    fn tables_name_every_section_and_row() {
        let t = tables(&sample_report());
        for s in [
            "1. veth baseline",
            "2. host <-> guest",
            "3. VM <-> VM",
            "4. throughput",
            "5. kumo vs QEMU",
            "6. goals",
            "interference",
        ] {
            assert!(t.contains(s), "no {s} in\n{t}");
        }
        let skipped = Report { vm_skipped: Some("no --net".into()), ..Default::default() };
        let t = tables(&skipped);
        assert!(t.contains("VM measurements skipped: no --net") && !t.contains("2. host"));
    }

    #[test]
    fn guest_result_lines_parse() {
        let l =
            parse_udpping("udpping: count=1000 lost=2 p50_us=41.5 p99_us=90 min_us=30 max_us=200").expect("udpping");
        assert_eq!(l, Latency { count: 1000, lost: 2, p50_us: 41.5, p99_us: 90.0, min_us: 30.0, max_us: 200.0 });
        assert_eq!(parse_udpping("udpping: up nic=0 mac=52:54:00:00:01:03 ip=10.0.1.3"), None);
        assert_eq!(parse_udpsink("udpsink: received=9 lost=1 reordered=0 dup=0"), Some((9, 1, 0, 0)));
        assert_eq!(parse_udpsink("udpsink: up nic=0"), None);
    }

    #[test]
    fn net_args_per_path() {
        assert_eq!(IrqPath::Shared.net_irq(1), "irq=shared");
        assert_eq!(IrqPath::Dedicated.net_irq(1), "irq=dedicated,vcpu=1");
    }

    #[test]
    fn plot_draws_a_png() {
        crate::check_plot("net", |p| plot(p, &sample_report()));
    }
}
