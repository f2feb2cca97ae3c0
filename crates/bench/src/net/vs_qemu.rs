//! kumo's virtio-net against QEMU's `virtio-net-pci` in `kumo bench net` (issue 24): the same
//! guest programs (`netecho` for round trips, `udpsend` for the guest → host stream), the same
//! single-queue tap (NIC 0's, in the run's namespace), the same host tools (the RTT client and
//! the stream sink, so both VMMs' figures are host-timestamped the same way), 1 vCPU and
//! [`MEM_MIB`] MiB in both, neither VMM's threads pinned. Runs alternate kumo, QEMU, kumo,
//! QEMU, … (round trips, then the stream, each round), medians of at least [`MIN_RUNS`].
//!
//! kumo's NIC takes `irq=direct` (its default: KVM delivers the queue's MSI where the guest
//! aimed it), as QEMU's MSI-X does through KVM's irqfd. QEMU uses its own tap backend in its
//! main loop (no vhost), as kumo's NIC thread serves the tap in user space too. A third row runs
//! kumo's NIC with `poll-us=`[`POLL_US`]: its thread keeps polling that long after each event
//! instead of sleeping (CPU spent for latency, as vhost-net's `busyloop_timeout`; QEMU's tap
//! backend has no such knob), reported next to the default, never instead of it.
//!
//! Two more rows take the scheduler's placement out of the round trips: kumo and QEMU with their
//! vCPU thread on one host CPU and every other thread of the VMM on another ([`threads::Pins`],
//! applied by the bench from outside, by thread id, the same rule for both). Unpinned, either
//! VMM's I/O thread lands on the vCPU's CPU in some runs and not in others, which moves the tail
//! more than any difference between the VMMs. A third pinned row starts kumo with its own pin
//! (`--cpus 1,pin=0@N`) and no outside help: kumo keeps its other threads off a pinned vCPU's
//! CPU itself, and the bench checks that it did before it measures. Every row also reports the
//! VMM's own CPU per round trip and per streamed frame: the time its threads other than the
//! vCPUs had, from the guest's `up` line to the end of the measurement
//! (`/proc/PID/task/*/schedstat`).

use std::time::Duration;

use serde::Serialize;

use super::stats::{median, Latency, Runs};
use super::threads::{self, Pins};
use super::tools::SinkResult;
use super::{Ctx, Nic, Stream, GUEST0, MAC0, MEM_MIB};
use crate::report::{ratio, step};
use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::sv;

/// At least this many runs per VMM, whatever the plan says.
pub const MIN_RUNS: usize = 3;
/// The vCPUs of both VMs.
pub const VCPUS: u32 = 1;
pub const PINNING: &str = "none: neither VMM's threads nor the host tools are pinned (but in the pinned rows)";
pub const KUMO_NIC: &str = "kumo virtio-net, irq=direct";
/// The poll window of the third row's NIC, µs (`--net ...,poll-us=`).
pub const POLL_US: u32 = 100;
pub const QEMU_NIC: &str = "virtio-net-pci,disable-legacy=on on -netdev tap (no vhost)";

/// A VMM of the comparison.
#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Vmm {
    Kumo,
    /// kumo with its NIC thread polling [`POLL_US`] after each event.
    KumoPoll,
    Qemu,
    /// kumo, its vCPU and its other threads pinned apart ([`Pins`]): round trips only.
    KumoPinned,
    /// QEMU pinned the same way.
    QemuPinned,
    /// kumo pinned by its own flag (`--cpus 1,pin=0@N`): its other threads keep off the
    /// vCPU's CPU by themselves.
    KumoSelfPinned,
}

impl Vmm {
    fn pinned(self) -> bool {
        matches!(self, Vmm::KumoPinned | Vmm::QemuPinned | Vmm::KumoSelfPinned)
    }
}

/// One VMM's figures.
#[derive(Serialize, Clone, Debug, Default)]
pub struct Side {
    /// Host → guest `netecho` round trips, per run.
    pub rtt: Runs,
    /// Guest `udpsend` → host sink, per run.
    pub stream: Stream,
    /// The VMM's CPU outside its vCPUs per answered round trip (µs), per run, and the median.
    pub rtt_io_cpu_us: Vec<f64>,
    pub io_cpu_us_per_rtt: Option<f64>,
    /// The same per frame the sink received.
    pub stream_io_cpu_us: Vec<f64>,
    pub io_cpu_us_per_frame: Option<f64>,
}

impl Side {
    fn push_rtt(&mut self, r: Result<(Latency, f64), String>) {
        match r {
            Ok((l, cpu)) => {
                self.rtt.push(Ok(l));
                self.rtt_io_cpu_us.push(cpu);
                self.io_cpu_us_per_rtt = median(&self.rtt_io_cpu_us);
            }
            Err(e) => self.rtt.push(Err(e)),
        }
    }

    fn push_stream(&mut self, r: Result<(SinkResult, f64), String>) {
        match r {
            Ok((sink, cpu)) => {
                if sink.received > 0 {
                    self.stream_io_cpu_us.push(cpu);
                    self.io_cpu_us_per_frame = median(&self.stream_io_cpu_us);
                }
                self.stream.push(Ok(sink));
            }
            Err(e) => self.stream.push(Err(e)),
        }
    }
}

#[derive(Serialize, Clone, Debug, Default)]
pub struct VsQemu {
    /// Why there are no comparison figures (QEMU or KVM for QEMU missing), if none.
    pub skipped: Option<String>,
    /// QEMU's `-cpu` model (the first that boots here, kumo_testkit::qemu::cpu_model).
    pub qemu_cpu: Option<String>,
    pub kumo_nic: String,
    pub qemu_nic: String,
    pub vcpus: u32,
    pub mem_mib: u64,
    pub pinning: String,
    pub runs: usize,
    pub kumo: Side,
    /// kumo with `poll-us=`[`POLL_US`] on its NIC.
    pub kumo_poll: Side,
    pub poll_us: u32,
    pub qemu: Side,
    /// The pinned rows' CPUs, or why there are no pinned rows.
    pub pins: Option<Pins>,
    pub pins_skipped: Option<String>,
    pub kumo_pinned: Side,
    pub qemu_pinned: Side,
    pub kumo_self_pinned: Side,
    /// kumo over QEMU: round-trip medians (below 1: kumo faster) and stream MB/s (above 1:
    /// kumo faster).
    pub rtt_p50_ratio_qemu: Option<f64>,
    pub rtt_p99_ratio_qemu: Option<f64>,
    pub mbps_ratio_qemu: Option<f64>,
    /// The same for kumo with `poll-us`.
    pub poll_rtt_p99_ratio_qemu: Option<f64>,
    pub poll_mbps_ratio_qemu: Option<f64>,
    /// The pinned rows' round trips, kumo over QEMU.
    pub pinned_rtt_p50_ratio_qemu: Option<f64>,
    pub pinned_rtt_p99_ratio_qemu: Option<f64>,
    /// kumo pinned by its own flag over QEMU pinned from outside: round-trip p99.
    pub self_pinned_rtt_p99_ratio_qemu: Option<f64>,
    /// The VMMs' own CPU per streamed frame and per round trip, kumo over QEMU (below 1: kumo
    /// spends less).
    pub io_cpu_frame_ratio_qemu: Option<f64>,
    pub io_cpu_rtt_ratio_qemu: Option<f64>,
}

impl VsQemu {
    fn new(runs: usize) -> VsQemu {
        VsQemu {
            kumo_nic: KUMO_NIC.into(),
            qemu_nic: QEMU_NIC.into(),
            vcpus: VCPUS,
            mem_mib: MEM_MIB,
            pinning: PINNING.into(),
            poll_us: POLL_US,
            runs,
            ..Default::default()
        }
    }

    /// Fills the ratios from the medians.
    pub fn settle(&mut self) {
        let (k, q) = (&self.kumo, &self.qemu);
        self.rtt_p50_ratio_qemu = ratio(k.rtt.p50_us, q.rtt.p50_us);
        self.rtt_p99_ratio_qemu = ratio(k.rtt.p99_us, q.rtt.p99_us);
        self.mbps_ratio_qemu = ratio(k.stream.median_mb_per_s, q.stream.median_mb_per_s);
        let p = &self.kumo_poll;
        self.poll_rtt_p99_ratio_qemu = ratio(p.rtt.p99_us, q.rtt.p99_us);
        self.poll_mbps_ratio_qemu = ratio(p.stream.median_mb_per_s, q.stream.median_mb_per_s);
        let (kp, qp) = (&self.kumo_pinned, &self.qemu_pinned);
        self.pinned_rtt_p50_ratio_qemu = ratio(kp.rtt.p50_us, qp.rtt.p50_us);
        self.pinned_rtt_p99_ratio_qemu = ratio(kp.rtt.p99_us, qp.rtt.p99_us);
        self.self_pinned_rtt_p99_ratio_qemu = ratio(self.kumo_self_pinned.rtt.p99_us, qp.rtt.p99_us);
        self.io_cpu_frame_ratio_qemu = ratio(k.io_cpu_us_per_frame, q.io_cpu_us_per_frame);
        self.io_cpu_rtt_ratio_qemu = ratio(k.io_cpu_us_per_rtt, q.io_cpu_us_per_rtt);
    }

    pub fn side(&self, vmm: Vmm) -> &Side {
        match vmm {
            Vmm::Kumo => &self.kumo,
            Vmm::KumoPoll => &self.kumo_poll,
            Vmm::Qemu => &self.qemu,
            Vmm::KumoPinned => &self.kumo_pinned,
            Vmm::QemuPinned => &self.qemu_pinned,
            Vmm::KumoSelfPinned => &self.kumo_self_pinned,
        }
    }
}

/// Whether QEMU can run here; the error says why not (the comparison is then skipped).
pub fn qemu_support() -> Result<String, String> {
    qemu::qemu_binary()?;
    qemu::kvm_usable()?;
    qemu::cpu_model()
}

/// A guest on NIC 0 (the context's tap 0, MAC0) in either VMM, killed on drop.
pub enum AnyVm {
    Kumo(super::KumoVm),
    Qemu(QemuVm),
}

impl AnyVm {
    /// Boots `guest` with `args` in `vmm`; kumo's NIC takes `irq` (`irq=...`).
    pub fn boot(ctx: &Ctx, vmm: Vmm, irq: &str, guest: &str, args: &[String]) -> Result<AnyVm, String> {
        Self::boot_pinned(ctx, vmm, irq, guest, args, None)
    }

    /// [`AnyVm::boot`]; with `own_pin` kumo pins its vCPU to that host CPU itself.
    fn boot_pinned(
        ctx: &Ctx,
        vmm: Vmm,
        irq: &str,
        guest: &str,
        args: &[String],
        own_pin: Option<u32>,
    ) -> Result<AnyVm, String> {
        match vmm {
            Vmm::Kumo | Vmm::KumoPoll | Vmm::KumoPinned | Vmm::KumoSelfPinned => {
                let irq = match vmm {
                    Vmm::KumoPoll => format!("{irq},poll-us={POLL_US}"),
                    _ => irq.to_string(),
                };
                let nic = [Nic { tap: &ctx.tap0, mac: super::MAC0, irq }];
                let cpus = match own_pin {
                    Some(c) => format!("{VCPUS},pin=0@{c}"),
                    None => VCPUS.to_string(),
                };
                super::kumo_vm(ctx, guest, &cpus, &nic, args).map(AnyVm::Kumo)
            }
            Vmm::Qemu | Vmm::QemuPinned => {
                let spec = QemuSpec {
                    extra_args: qemu::virtio_net_args(&ctx.tap0, MAC0),
                    netns: Some(ctx.ns.clone()),
                    ..QemuSpec::new(guest, MEM_MIB, args)
                };
                QemuVm::spawn(&spec, None).map(AnyVm::Qemu)
            }
        }
    }

    /// Waits for `<guest>: up nic=0`.
    pub fn wait_up(&mut self, guest: &str) -> Result<(), String> {
        match self {
            AnyVm::Kumo(vm) => super::wait_up(vm, guest, 0).map(drop),
            AnyVm::Qemu(_) => self.wait_serial(&format!("{guest}: up nic=0"), super::BOOT_LIMIT),
        }
    }

    /// Waits for a console line containing `needle`.
    pub fn wait_serial(&mut self, needle: &str, limit: Duration) -> Result<(), String> {
        match self {
            AnyVm::Kumo(vm) => vm.wait_line(limit, needle, |l| l.contains(needle).then_some(())).map(drop),
            AnyVm::Qemu(vm) => vm.wait_serial(needle, limit).map(drop),
        }
    }

    fn pid(&self) -> u32 {
        match self {
            AnyVm::Kumo(vm) => vm.child.id(),
            AnyVm::Qemu(vm) => vm.pid(),
        }
    }

    /// The host thread ids of the VM's vCPUs.
    fn vcpu_tids(&mut self) -> Result<Vec<i32>, String> {
        match self {
            AnyVm::Kumo(vm) => threads::kumo_vcpu_tids(vm.child.id()),
            AnyVm::Qemu(vm) => vm.vcpu_tids(),
        }
    }

    /// The VMM's CPU outside the vCPUs so far, ns, and a clock to read it again.
    pub(super) fn io_cpu(&mut self) -> Result<IoCpu, String> {
        let vcpus = self.vcpu_tids()?;
        let pid = self.pid();
        Ok(IoCpu { pid, start: threads::cpu_ns_outside(pid, &vcpus)?, vcpus })
    }

    /// Waits (bounded) for the guest to end.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<(), String> {
        match self {
            AnyVm::Kumo(vm) => vm.wait_exit(limit).map(drop),
            AnyVm::Qemu(vm) => vm.wait_exit(limit).map(drop),
        }
    }
}

/// A VMM's CPU time outside its vCPUs since a point.
pub(super) struct IoCpu {
    pid: u32,
    vcpus: Vec<i32>,
    start: u64,
}

impl IoCpu {
    /// µs per unit of work since the start (`units` > 0).
    pub(super) fn per(&self, units: u64) -> Result<f64, String> {
        let now = threads::cpu_ns_outside(self.pid, &self.vcpus)?;
        Ok(now.saturating_sub(self.start) as f64 / 1e3 / units.max(1) as f64)
    }
}

/// Host → guest round trips to `netecho` in `vmm` (its NIC 0 on tap 0), one run, and the VMM's
/// CPU per answered round trip. A pinned row pins the VMM's threads once the guest is up.
fn rtt_once(ctx: &Ctx, vmm: Vmm, pins: Option<Pins>) -> Result<(Latency, f64), String> {
    let pins = pins.filter(|_| vmm.pinned());
    let own_pin = pins.filter(|_| vmm == Vmm::KumoSelfPinned).map(|p| p.vcpu_cpu);
    let args = sv(&[format!("ip={GUEST0}"), "wait=irq".into()]);
    let mut vm = AnyVm::boot_pinned(ctx, vmm, "irq=direct", "netecho", &args, own_pin)?;
    vm.wait_up("netecho")?;
    if let Some(p) = pins {
        let vcpus = vm.vcpu_tids()?;
        match own_pin {
            Some(_) => p.check_kept_apart(vm.pid(), &vcpus)?,
            None => p.apply(vm.pid(), &vcpus)?,
        }
    }
    let cpu = vm.io_cpu()?;
    let l = super::host_rtt_tool(&ctx.bench, &ctx.ns, GUEST0, &ctx.plan)?;
    let per = cpu.per(l.count - l.lost)?;
    drop(vm);
    Ok((l, per))
}

/// The guest → host stream, one run, and the VMM's CPU per frame the sink received.
fn stream_once(ctx: &Ctx, vmm: Vmm) -> Result<(SinkResult, f64), String> {
    let (sink, per) = super::guest_to_host_once(ctx, vmm, "irq=direct", true)?;
    Ok((sink, per.ok_or("no CPU figure")?))
}

/// Each round's order: kumo, QEMU between kumo's two configurations, then the pinned pair.
const ORDER: [Vmm; 3] = [Vmm::Kumo, Vmm::Qemu, Vmm::KumoPoll];
const PINNED: [Vmm; 3] = [Vmm::KumoPinned, Vmm::QemuPinned, Vmm::KumoSelfPinned];

/// The comparison: kumo and QEMU alternating, round trips then the stream each round.
pub fn measure(ctx: &Ctx, t0: std::time::Instant) -> VsQemu {
    let mut v = VsQemu::new(ctx.plan.runs.max(MIN_RUNS));
    match qemu_support() {
        Ok(cpu) => v.qemu_cpu = Some(cpu),
        Err(e) => {
            v.skipped = Some(e);
            return v;
        }
    }
    match Pins::of_this_host() {
        Ok(p) => v.pins = Some(p),
        Err(e) => v.pins_skipped = Some(e),
    }
    let pinned: &[Vmm] = if v.pins.is_some() { &PINNED } else { &[] };
    for run in 1..=v.runs {
        step(t0, &format!("kumo vs QEMU (virtio-net-pci), run {run} of {}: round trips, stream", v.runs));
        for &vmm in ORDER.iter().chain(pinned) {
            let r = rtt_once(ctx, vmm, v.pins);
            side_mut(&mut v, vmm).push_rtt(r);
        }
        for vmm in ORDER {
            let r = stream_once(ctx, vmm);
            side_mut(&mut v, vmm).push_stream(r);
        }
    }
    v.settle();
    v
}

fn side_mut(v: &mut VsQemu, vmm: Vmm) -> &mut Side {
    match vmm {
        Vmm::Kumo => &mut v.kumo,
        Vmm::KumoPoll => &mut v.kumo_poll,
        Vmm::Qemu => &mut v.qemu,
        Vmm::KumoPinned => &mut v.kumo_pinned,
        Vmm::QemuPinned => &mut v.qemu_pinned,
        Vmm::KumoSelfPinned => &mut v.kumo_self_pinned,
    }
}

/// Section 5 of the tables.
pub fn table(v: &VsQemu) -> String {
    use crate::report::opt;
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "\n5. kumo vs QEMU: the same guests (netecho, udpsend), tap, host tools and measurement");
    if let Some(why) = &v.skipped {
        let _ = writeln!(s, "   skipped: {why}");
        return s;
    }
    let _ = writeln!(
        s,
        "   {} vCPU, {} MiB each; runs alternate kumo, QEMU ({} each, medians); pinning: {}\n   kumo: {}; QEMU ({}): {}",
        v.vcpus,
        v.mem_mib,
        v.runs,
        v.pinning,
        v.kumo_nic,
        v.qemu_cpu.as_deref().unwrap_or("?"),
        v.qemu_nic
    );
    let row = |s: &mut String, cells: [String; 10]| {
        let [a, b, c, d, e, f, g, h, i, j] = cells;
        let _ = writeln!(s, "   {a:<14} {b:>8} {c:>8} {d:>5} {e:>8} {f:>8} {g:>10} {h:>6} {i:>9} {j:>4}");
    };
    let head = ["VMM", "p50_us", "p99_us", "lost", "cpu/rt", "MB/s", "packets/s", "lost", "cpu/frame", "runs"];
    row(&mut s, head.map(String::from));
    let poll_name = format!("kumo poll {}", v.poll_us);
    let rows = [
        ("kumo", Vmm::Kumo),
        (poll_name.as_str(), Vmm::KumoPoll),
        ("QEMU", Vmm::Qemu),
        ("kumo pinned", Vmm::KumoPinned),
        ("QEMU pinned", Vmm::QemuPinned),
        ("kumo own pin", Vmm::KumoSelfPinned),
    ];
    for (name, vmm) in rows {
        let x = v.side(vmm);
        if vmm.pinned() && v.pins.is_none() {
            continue;
        }
        let streamed = !vmm.pinned();
        let or_blank = |v: String| if streamed { v } else { String::new() };
        row(
            &mut s,
            [
                name.to_string(),
                opt(x.rtt.p50_us, 1),
                opt(x.rtt.p99_us, 1),
                x.rtt.runs.iter().map(|l| l.lost).sum::<u64>().to_string(),
                opt(x.io_cpu_us_per_rtt, 1),
                or_blank(opt(x.stream.median_mb_per_s, 1)),
                or_blank(opt(x.stream.median_packets_per_s, 0)),
                or_blank(x.stream.runs.iter().map(|r| r.lost).sum::<u64>().to_string()),
                or_blank(opt(x.io_cpu_us_per_frame, 2)),
                if streamed { x.rtt.runs.len().min(x.stream.runs.len()) } else { x.rtt.runs.len() }.to_string(),
            ],
        );
        for e in x.rtt.errors.iter().chain(&x.stream.errors) {
            let _ = writeln!(s, "      FAILED ({name}): {}", e.lines().next().unwrap_or(""));
        }
    }
    // Name, then kumo over QEMU: p50, p99, CPU per round trip, MB/s, CPU per frame.
    let ratios = [
        (
            "kumo / QEMU",
            v.rtt_p50_ratio_qemu,
            v.rtt_p99_ratio_qemu,
            v.io_cpu_rtt_ratio_qemu,
            v.mbps_ratio_qemu,
            v.io_cpu_frame_ratio_qemu,
        ),
        ("poll / QEMU", None, v.poll_rtt_p99_ratio_qemu, None, v.poll_mbps_ratio_qemu, None),
        ("pinned k / Q", v.pinned_rtt_p50_ratio_qemu, v.pinned_rtt_p99_ratio_qemu, None, None, None),
        ("own pin / Q", None, v.self_pinned_rtt_p99_ratio_qemu, None, None, None),
    ];
    let o = |x: Option<f64>| x.map_or(String::new(), |x| format!("{x:.3}"));
    for (name, p50, p99, cpu, mbps, cpu_frame) in ratios {
        let blank = String::new;
        row(&mut s, [name.into(), o(p50), o(p99), blank(), o(cpu), o(mbps), blank(), blank(), o(cpu_frame), blank()]);
    }
    match (&v.pins, &v.pins_skipped) {
        (Some(p), _) => {
            let _ = writeln!(
                s,
                "   pinned rows (round trips only): each VMM's vCPU thread on host CPU {}, its other threads on CPU {}\n   (kumo own pin: `--cpus {VCPUS},pin=0@{}`, kumo keeps its other threads off CPU {} itself; checked, not applied)",
                p.vcpu_cpu, p.io_cpu, p.vcpu_cpu, p.vcpu_cpu
            );
        }
        (None, Some(why)) => {
            let _ = writeln!(s, "   no pinned rows: {why}");
        }
        (None, None) => {}
    }
    let _ = writeln!(
        s,
        "   (round trips: below 1 kumo is faster; stream: above 1 kumo is faster. cpu/rt and cpu/frame: µs of CPU\n   the VMM's threads other than the vCPUs had per round trip and per frame received, below 1 kumo spends less.\n   Both VMMs share this host's CPUs with everything else running on it: read the ratios, from alternating runs,\n   not the absolute figures. `kumo poll N`: --net ...,poll-us=N, its NIC thread polls N µs after each event)"
    );
    s
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub fn sample() -> VsQemu {
        let mut v = VsQemu::new(3);
        v.qemu_cpu = Some("max".into());
        let lat =
            |p50: f64, p99: f64| Latency { count: 10, lost: 0, p50_us: p50, p99_us: p99, min_us: 1.0, max_us: 200.0 };
        let sink = |mb: f64| SinkResult { received: 10, mb_per_s: mb, packets_per_s: mb * 1e3, ..Default::default() };
        v.kumo_poll.rtt.push(Ok(lat(40.0, 62.5)));
        v.kumo_poll.stream.push(Ok(sink(275.0)));
        v.kumo.push_stream(Ok((sink(300.0), 1.5)));
        v.qemu.push_stream(Ok((sink(250.0), 3.0)));
        v.kumo.push_rtt(Ok((lat(60.0, 100.0), 20.0)));
        v.qemu.push_rtt(Ok((lat(80.0, 125.0), 40.0)));
        v.pins = Some(Pins { io_cpu: 0, vcpu_cpu: 1 });
        v.kumo_pinned.push_rtt(Ok((lat(50.0, 80.0), 18.0)));
        v.qemu_pinned.push_rtt(Ok((lat(60.0, 100.0), 30.0)));
        v.kumo_self_pinned.push_rtt(Ok((lat(50.0, 85.0), 18.0)));
        v.settle();
        v
    }

    #[test]
    fn ratios_are_kumo_over_qemu() {
        let v = sample();
        assert_eq!((v.rtt_p50_ratio_qemu, v.rtt_p99_ratio_qemu, v.mbps_ratio_qemu), (Some(0.75), Some(0.8), Some(1.2)));
        assert_eq!(v.self_pinned_rtt_p99_ratio_qemu, Some(0.85));
        assert_eq!((v.poll_rtt_p99_ratio_qemu, v.poll_mbps_ratio_qemu), (Some(0.5), Some(1.1)));
        assert_eq!((v.io_cpu_frame_ratio_qemu, v.io_cpu_rtt_ratio_qemu), (Some(0.5), Some(0.5)));
        assert_eq!((v.pinned_rtt_p50_ratio_qemu, v.pinned_rtt_p99_ratio_qemu), (Some(50.0 / 60.0), Some(0.8)));
        let t = table(&v);
        assert!(t.contains("5. kumo vs QEMU") && t.contains("QEMU (max)") && t.contains("0.800"), "{t}");
        assert!(t.contains("QEMU pinned") && t.contains("vCPU thread on host CPU 1"), "{t}");
        // A failed run counts in no median, its CPU figure included.
        let mut k = Side::default();
        k.push_rtt(Err("boot failed".into()));
        k.push_stream(Ok((SinkResult::default(), 9.0)));
        assert_eq!((k.io_cpu_us_per_rtt, k.io_cpu_us_per_frame, k.rtt.errors.len()), (None, None, 1));
    }

    #[test]
    fn without_qemu_the_section_says_why() {
        let v = VsQemu { skipped: Some("qemu-system-x86_64 not found on PATH".into()), ..VsQemu::new(3) };
        assert!(table(&v).contains("skipped: qemu-system-x86_64 not found"));
        assert_eq!(v.rtt_p99_ratio_qemu, None);
    }
}
