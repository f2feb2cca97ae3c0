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

use std::time::Duration;

use serde::Serialize;

use super::stats::{Latency, Runs};
use super::tools::SinkResult;
use super::{Ctx, Nic, Stream, GUEST0, MAC0, MEM_MIB};
use crate::report::{ratio, step};
use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::sv;

/// At least this many runs per VMM, whatever the plan says.
pub const MIN_RUNS: usize = 3;
/// The vCPUs of both VMs.
pub const VCPUS: u32 = 1;
pub const PINNING: &str = "none: neither VMM's threads nor the host tools are pinned";
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
}

/// One VMM's figures.
#[derive(Serialize, Clone, Debug, Default)]
pub struct Side {
    /// Host → guest `netecho` round trips, per run.
    pub rtt: Runs,
    /// Guest `udpsend` → host sink, per run.
    pub stream: Stream,
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
    /// kumo over QEMU: round-trip medians (below 1: kumo faster) and stream MB/s (above 1:
    /// kumo faster).
    pub rtt_p50_ratio_qemu: Option<f64>,
    pub rtt_p99_ratio_qemu: Option<f64>,
    pub mbps_ratio_qemu: Option<f64>,
    /// The same for kumo with `poll-us`.
    pub poll_rtt_p99_ratio_qemu: Option<f64>,
    pub poll_mbps_ratio_qemu: Option<f64>,
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
    }

    pub fn side(&self, vmm: Vmm) -> &Side {
        match vmm {
            Vmm::Kumo => &self.kumo,
            Vmm::KumoPoll => &self.kumo_poll,
            Vmm::Qemu => &self.qemu,
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
        match vmm {
            Vmm::Kumo | Vmm::KumoPoll => {
                let irq = match vmm {
                    Vmm::KumoPoll => format!("{irq},poll-us={POLL_US}"),
                    _ => irq.to_string(),
                };
                let nic = [Nic { tap: &ctx.tap0, mac: super::MAC0, irq }];
                super::kumo_vm(ctx, guest, VCPUS, &nic, args).map(AnyVm::Kumo)
            }
            Vmm::Qemu => {
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
            AnyVm::Qemu(vm) => vm.wait_serial(&format!("{guest}: up nic=0"), super::BOOT_LIMIT).map(drop),
        }
    }

    /// Waits (bounded) for the guest to end.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<(), String> {
        match self {
            AnyVm::Kumo(vm) => vm.wait_exit(limit).map(drop),
            AnyVm::Qemu(vm) => vm.wait_exit(limit).map(drop),
        }
    }
}

/// Host → guest round trips to `netecho` in `vmm` (its NIC 0 on tap 0), one run.
fn rtt_once(ctx: &Ctx, vmm: Vmm) -> Result<Latency, String> {
    let mut vm = AnyVm::boot(ctx, vmm, "irq=direct", "netecho", &sv(&[format!("ip={GUEST0}"), "wait=irq".into()]))?;
    vm.wait_up("netecho")?;
    let l = super::host_rtt_tool(&ctx.bench, &ctx.ns, GUEST0, &ctx.plan);
    drop(vm);
    l
}

fn stream_once(ctx: &Ctx, vmm: Vmm) -> Result<SinkResult, String> {
    super::guest_to_host_once(ctx, vmm, "irq=direct")
}

/// Each round's order: kumo, QEMU between kumo's two configurations.
const ORDER: [Vmm; 3] = [Vmm::Kumo, Vmm::Qemu, Vmm::KumoPoll];

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
    for run in 1..=v.runs {
        step(t0, &format!("kumo vs QEMU (virtio-net-pci), run {run} of {}: round trips, stream", v.runs));
        for vmm in ORDER {
            let r = rtt_once(ctx, vmm);
            side_mut(&mut v, vmm).rtt.push(r);
        }
        for vmm in ORDER {
            let r = stream_once(ctx, vmm);
            side_mut(&mut v, vmm).stream.push(r);
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
    let _ = writeln!(
        s,
        "   {:<12} {:>9} {:>9} {:>6} {:>9} {:>11} {:>8} {:>5}",
        "VMM", "p50_us", "p99_us", "lost", "MB/s", "packets/s", "lost", "runs"
    );
    let poll_name = format!("kumo poll {}", v.poll_us);
    for (name, vmm) in [("kumo", Vmm::Kumo), (poll_name.as_str(), Vmm::KumoPoll), ("QEMU", Vmm::Qemu)] {
        let x = v.side(vmm);
        let _ = writeln!(
            s,
            "   {:<12} {:>9} {:>9} {:>6} {:>9} {:>11} {:>8} {:>5}",
            name,
            opt(x.rtt.p50_us, 1),
            opt(x.rtt.p99_us, 1),
            x.rtt.runs.iter().map(|l| l.lost).sum::<u64>(),
            opt(x.stream.median_mb_per_s, 1),
            opt(x.stream.median_packets_per_s, 0),
            x.stream.runs.iter().map(|r| r.lost).sum::<u64>(),
            x.rtt.runs.len().min(x.stream.runs.len())
        );
        for e in x.rtt.errors.iter().chain(&x.stream.errors) {
            let _ = writeln!(s, "      FAILED ({name}): {}", e.lines().next().unwrap_or(""));
        }
    }
    let _ = writeln!(
        s,
        "   {:<12} {:>9} {:>9} {:>6} {:>9}",
        "kumo / QEMU",
        opt(v.rtt_p50_ratio_qemu, 3),
        opt(v.rtt_p99_ratio_qemu, 3),
        "",
        opt(v.mbps_ratio_qemu, 3)
    );
    let _ = writeln!(
        s,
        "   {:<12} {:>9} {:>9} {:>6} {:>9}",
        "poll / QEMU",
        "",
        opt(v.poll_rtt_p99_ratio_qemu, 3),
        "",
        opt(v.poll_mbps_ratio_qemu, 3)
    );
    let _ = writeln!(
        s,
        "   (round trips: below 1 kumo is faster; stream: above 1 kumo is faster. Both VMMs share this host's\n   CPUs with everything else running on it: read the ratios, from alternating runs, not the absolute figures.\n   `kumo poll N`: --net ...,poll-us=N, its NIC thread polls N µs after each event: CPU for latency)"
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
        v.kumo.rtt.push(Ok(lat(60.0, 100.0)));
        v.qemu.rtt.push(Ok(lat(80.0, 125.0)));
        v.kumo.stream.push(Ok(sink(300.0)));
        v.kumo_poll.rtt.push(Ok(lat(40.0, 62.5)));
        v.kumo_poll.stream.push(Ok(sink(275.0)));
        v.qemu.stream.push(Ok(sink(250.0)));
        v.settle();
        v
    }

    #[test]
    fn ratios_are_kumo_over_qemu() {
        let v = sample();
        assert_eq!((v.rtt_p50_ratio_qemu, v.rtt_p99_ratio_qemu, v.mbps_ratio_qemu), (Some(0.75), Some(0.8), Some(1.2)));
        assert_eq!((v.poll_rtt_p99_ratio_qemu, v.poll_mbps_ratio_qemu), (Some(0.5), Some(1.1)));
        let t = table(&v);
        assert!(t.contains("5. kumo vs QEMU") && t.contains("QEMU (max)") && t.contains("0.800"), "{t}");
    }

    #[test]
    fn without_qemu_the_section_says_why() {
        let v = VsQemu { skipped: Some("qemu-system-x86_64 not found on PATH".into()), ..VsQemu::new(3) };
        assert!(table(&v).contains("skipped: qemu-system-x86_64 not found"));
        assert_eq!(v.rtt_p99_ratio_qemu, None);
    }
}
