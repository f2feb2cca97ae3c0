//! The Linux row of `kumo bench lend`: memory lent between two Linux guests through virtio-mem
//! (issue 22), next to the kumo guests' mailbox rows of the same run (the baseline). Two VMs
//! boot kumo's test kernel (`scripts/build-test-kernel.sh`) with a memory zone each (256 MiB of
//! hotplug region on node 0); A's driver plugs the lend size at boot, B's nothing. Once both
//! drivers are up (vm.info `driver_ok`) and A holds its memory, the bench lends the same amount
//! A -> B (`PUT vm.lend` on A) and returns it (`PUT vm.lend` with `return` on B) N times. Each
//! lend is timed as the lender's VMM reports it (`LendReport::total_ms`): from the command to
//! the borrower's device seeing the memory plugged, both VMs' records written (A's kernel
//! offlined and unplugged it, kumo discarded it, B's kernel plugged and onlined it).
//!
//! Ring-0 code is emulated on this host (../shared/NESTED-KVM.md), so a lend costs seconds, not
//! milliseconds: Linux's offlining is the cost. Without the test kernel the row is skipped,
//! saying so.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kumo_api::{ApiClient, LendApiRequest, LendReport};
use kumo_testkit::Kid;
use serde::Serialize;

use super::{Pct, MIB};

/// The hotplug region of each VM's zone (the size tests/linux_virtio_mem.rs checks).
const ZONE: u64 = 256 * MIB;
/// How long a guest may take to unplug or plug one lend (a hang guard: 128 MiB took 14 s on a
/// quiet host, much longer on a loaded one).
const GUEST_TIMEOUT_MS: u64 = 300_000;
/// No disk behind `root=`: the kernel idles once booted. `online_movable`: plugged memory goes
/// to ZONE_MOVABLE, so the kernel can always offline it again; `swiotlb=noforce`: no 64 MiB
/// bounce buffer for memory above 4 GiB (tests/linux_virtio_mem.rs says why).
const CMDLINE: &str = "memhp_default_state=online_movable swiotlb=noforce root=/dev/vda rootwait";

/// What the Linux row does.
pub struct Plan {
    pub bytes: u64,
    pub cycles: u64,
}

/// One lend or return between the Linux guests.
#[derive(Debug, Clone, Serialize)]
pub struct Op {
    /// linux-mem-lend (A -> B) or linux-mem-return (B -> A).
    pub kind: &'static str,
    /// When the command was given, seconds since the Linux VMs were started.
    pub t_s: f64,
    /// The lender's VMM: from the command to the borrower's confirmation (both records written).
    pub total_ms: f64,
    /// The lender's kernel unplugging (device request to its plugged size reached), and the
    /// borrower's plugging.
    pub unplug_ms: f64,
    pub plug_ms: f64,
    /// The bench's `PUT vm.lend` call, connect to answer.
    pub call_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    /// The test kernel booted, or why the row did not run (then nothing below is filled).
    pub kernel: Option<String>,
    pub skipped: Option<String>,
    pub bytes: u64,
    pub cycles: u64,
    pub argv_a: Vec<String>,
    pub argv_b: Vec<String>,
    /// From starting both VMs to both drivers up and A's memory plugged, seconds.
    pub ready_s: Option<f64>,
    pub ops: Vec<Op>,
    pub lend_ms: Pct,
    pub lend_unplug_ms: Pct,
    pub lend_plug_ms: Pct,
    pub return_ms: Pct,
    pub return_unplug_ms: Pct,
    pub return_plug_ms: Pct,
    /// Both VMs' records checked for memory held by both at once.
    pub overlaps: Option<usize>,
    pub overlap_details: Vec<String>,
    pub error: Option<String>,
}

impl Row {
    pub fn finish(&mut self) {
        let of = |kind: &str, f: fn(&Op) -> f64| -> Pct {
            Pct::of(&self.ops.iter().filter(|o| o.kind == kind).map(f).collect::<Vec<_>>())
        };
        self.lend_ms = of("linux-mem-lend", |o| o.total_ms);
        self.lend_unplug_ms = of("linux-mem-lend", |o| o.unplug_ms);
        self.lend_plug_ms = of("linux-mem-lend", |o| o.plug_ms);
        self.return_ms = of("linux-mem-return", |o| o.total_ms);
        self.return_unplug_ms = of("linux-mem-return", |o| o.unplug_ms);
        self.return_plug_ms = of("linux-mem-return", |o| o.plug_ms);
    }
}

/// The test kernel: `$KUMO_TEST_KERNEL`, else where `scripts/build-test-kernel.sh --path` says
/// it is cached; Err says why there is none.
fn test_kernel() -> Result<PathBuf, String> {
    kumo_testkit::linux::test_kernel_path().and_then(existing)
}

fn existing(path: PathBuf) -> Result<PathBuf, String> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("no test kernel at {} (build it with scripts/build-test-kernel.sh)", path.display()))
    }
}

/// A Linux VM with a memory zone: its kumo (killed when dropped) and API.
struct Vm {
    name: &'static str,
    proc: Kid,
    sock: PathBuf,
    argv: Vec<String>,
}

impl Vm {
    fn start(dir: &Path, kernel: &Path, name: &'static str, plugged: u64) -> Result<Vm, String> {
        let sock = dir.join(format!("linux-{name}.sock"));
        let argv: Vec<String> = vec![
            crate::kumo_binary()?.display().to_string(),
            "--api-socket".into(),
            sock.display().to_string(),
            "run".into(),
            "--kernel".into(),
            kernel.display().to_string(),
            "--cpus".into(),
            "1".into(),
            "--memory".into(),
            "512M".into(),
            "--cmdline".into(),
            kumo_testkit::linux::cmdline(CMDLINE),
            "--memory-zone".into(),
            format!("node=0,hotplug={}M,plugged={}M", ZONE / MIB, plugged / MIB),
        ];
        let proc = Kid::start_in(None, &argv)?;
        Ok(Vm { name, proc, sock, argv })
    }

    fn api(&self) -> ApiClient {
        ApiClient::new(&self.sock)
    }

    /// (driver_ok, plugged) of the VM's zone, None until its API answers.
    fn zone(&self) -> Option<(bool, u64)> {
        let i = self.api().info().ok()?;
        i.memory_zones.first().map(|z| (z.driver_ok, z.plugged_size))
    }

    fn exited(&mut self) -> Result<(), String> {
        match self.proc.try_exit() {
            Ok(Some(code)) => Err(self.proc.why(&format!("exited ({code})"))),
            _ => Ok(()),
        }
    }

    /// The console's last lines and kumo's stderr, for a failure report.
    fn tail(&self) -> String {
        format!("--- Linux VM {} ---\n{}", self.name, kumo_testkit::linux::console_tail(&self.proc, 30))
    }
}

/// Waits (bounded by the Linux boot limit) until both drivers are up and A holds `bytes`.
fn wait_ready(a: &mut Vm, b: &mut Vm, bytes: u64) -> Result<(), String> {
    let limit = kumo_testkit::linux::boot_limit();
    let t = Instant::now();
    loop {
        a.exited()?;
        b.exited()?;
        let (za, zb) = (a.zone(), b.zone());
        if matches!((za, zb), (Some((true, pa)), Some((true, 0))) if pa == bytes) {
            return Ok(());
        }
        if t.elapsed() > limit {
            return Err(format!(
                "the virtio-mem drivers were not ready within {} s (A: {za:?}, B: {zb:?}; (driver_ok, plugged))",
                limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One `PUT vm.lend` on `from`, timed.
fn step(kind: &'static str, from: &Vm, to: &Vm, bytes: u64, t0: Instant) -> Result<Op, String> {
    let returning = kind.ends_with("return");
    let req = LendApiRequest {
        to: to.sock.display().to_string(),
        cpus: 0,
        memory_bytes: bytes,
        node: None,
        returning,
        timeout_ms: GUEST_TIMEOUT_MS,
    };
    // The lender waits for its guest, then for the borrower's call: twice one side's wait.
    let api = from.api().with_timeout(2 * kumo_elastic::lend::client_timeout(GUEST_TIMEOUT_MS));
    let t_s = t0.elapsed().as_secs_f64();
    let t = Instant::now();
    let r: LendReport = api.lend(&req).map_err(|e| format!("{kind} {} -> {}: {e}", from.name, to.name))?;
    Ok(Op {
        kind,
        t_s,
        total_ms: r.total_ms,
        unplug_ms: r.released.guest_ms,
        plug_ms: r.acquired.guest_ms,
        call_ms: t.elapsed().as_secs_f64() * 1e3,
    })
}

/// Boots the two VMs, lends and returns `plan.bytes` `plan.cycles` times, checks the records.
fn measure(row: &mut Row, kernel: &Path, plan: &Plan, say: &dyn Fn(&str)) -> Result<(), String> {
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-lend-linux-"))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut a = Vm::start(dir.as_path(), kernel, "a", plan.bytes)?;
    let mut b = Vm::start(dir.as_path(), kernel, "b", 0)?;
    (row.argv_a, row.argv_b) = (a.argv.clone(), b.argv.clone());
    let r = (|| {
        wait_ready(&mut a, &mut b, plan.bytes)?;
        row.ready_s = Some(t0.elapsed().as_secs_f64());
        say(&format!("Linux: both virtio-mem drivers up, A holds {} MiB", plan.bytes / MIB));
        for i in 1..=plan.cycles {
            let lend = step("linux-mem-lend", &a, &b, plan.bytes, t0)?;
            let back = step("linux-mem-return", &b, &a, plan.bytes, t0)?;
            say(&format!(
                "Linux: cycle {i}/{}: lend {:.0} ms (A unplugging {:.0}, B plugging {:.0}), return {:.0} ms",
                plan.cycles, lend.total_ms, lend.unplug_ms, lend.plug_ms, back.total_ms
            ));
            row.ops.extend([lend, back]);
        }
        let (ea, eb) = (a.api().elastic(), b.api().elastic());
        let (ea, eb) = (ea.map_err(|e| format!("a: vm.elastic: {e}"))?, eb.map_err(|e| format!("b: vm.elastic: {e}"))?);
        let o = kumo_elastic::record::check(&[("a", &ea.events), ("b", &eb.events)]);
        row.overlaps = Some(o.total());
        row.overlap_details = o.details;
        Ok(())
    })();
    if r.is_err() {
        for vm in [&a, &b] {
            eprintln!("{}", vm.tail());
        }
    }
    r
}

/// The Linux row: skipped (saying why) without KVM's test kernel, else measured.
pub fn run(plan: &Plan, say: &dyn Fn(&str)) -> Row {
    let mut row = Row { bytes: plan.bytes, cycles: plan.cycles, ..Row::default() };
    let kernel = match test_kernel() {
        Ok(k) => k,
        Err(why) => {
            say(&format!("Linux row skipped: {why}"));
            row.skipped = Some(why);
            return row;
        }
    };
    row.kernel = Some(kernel.display().to_string());
    say(&format!(
        "Linux: booting two test-kernel VMs ({} MiB lends, {} cycles; ring 0 is emulated here: minutes)",
        plan.bytes / MIB,
        plan.cycles
    ));
    if let Err(e) = measure(&mut row, &kernel, plan, say) {
        say(&format!("Linux: FAILED: {e}"));
        row.error = Some(e);
    }
    row.finish();
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: &'static str, total_ms: f64) -> Op {
        Op { kind, t_s: 0.0, total_ms, unplug_ms: total_ms - 2.0, plug_ms: 1.0, call_ms: total_ms + 1.0 }
    }

    #[test]
    fn the_row_takes_lends_and_returns_apart() {
        let mut r = Row {
            ops: vec![
                op("linux-mem-lend", 1000.0),
                op("linux-mem-return", 3000.0),
                op("linux-mem-lend", 2000.0),
                op("linux-mem-return", 4000.0),
            ],
            ..Row::default()
        };
        r.finish();
        assert_eq!((r.lend_ms.n, r.lend_ms.p50, r.lend_ms.p99), (2, Some(1000.0), Some(2000.0)));
        assert_eq!((r.return_ms.p50, r.return_ms.p99), (Some(3000.0), Some(4000.0)));
        assert_eq!((r.lend_unplug_ms.p99, r.lend_plug_ms.p50), (Some(1998.0), Some(1.0)));
    }

    #[test]
    fn a_missing_kernel_is_named() {
        let e = existing("/nonexistent/vmlinux".into()).unwrap_err();
        assert!(e.contains("/nonexistent/vmlinux"), "{e}");
    }
}
