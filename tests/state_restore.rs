//! Pause → save → (clobber) → restore → resume, in process: the guest must carry on exactly
//! where it was, which memtouch's checksum (against the reference model) proves.

/// The CLI tests' helpers need the kumo binary; this in-process test only needs KVM.
fn kvm_or_skip(test: &str) -> bool {
    let ok = kumo_vm::vm::kvm_available();
    if !ok {
        eprintln!("skipping {test}: /dev/kvm not available");
    }
    ok
}

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_vmm::{Outcome, Payload, RunningVm, Snapshot, VmConfig};

#[derive(Clone, Default)]
struct Console(Arc<Mutex<Vec<u8>>>);
impl Write for Console {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
impl Console {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Waits (bounded only as a safety net) until the console shows `needle` `n` times.
fn wait_for(console: &Console, needle: &str, n: usize) {
    let t = Instant::now();
    while console.text().matches(needle).count() < n {
        assert!(t.elapsed() < Duration::from_secs(300), "no `{needle}` x{n} from the guest: {}", console.text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The writes a stopped memtouch reports, after checking its checksum against the model.
fn check_memtouch(out: &str, pages: u64, seed: u64) -> u64 {
    kumo_guests::memtouch::check_output(out, pages, seed, true).unwrap_or_else(|e| panic!("{e}"))
}

fn memtouch(cpus: u32, args: &[&str]) -> VmConfig {
    VmConfig {
        cpus,
        memory: 128 << 20,
        irqchip: Default::default(),
        payload: Payload::Guest { name: "memtouch".into(), args: args.iter().map(|s| s.to_string()).collect() },
        net: vec![],
        numa: None,
        pv: Default::default(),
        host: Default::default(),
        elastic: None,
    }
}

#[test]
fn pause_save_restore_resume_keeps_the_guest_going() {
    if !kvm_or_skip("pause_save_restore_resume_keeps_the_guest_going") {
        return;
    }
    // Writes at 20,000/s until a byte arrives on its console.
    let console = Console::default();
    let vm = RunningVm::start(
        memtouch(2, &["pages=4000", "until_input=1", "rate=20000", "seed=3"]),
        Box::new(console.clone()),
    )
    .unwrap();
    wait_for(&console, "memtouch: pages=", 1);

    assert!(matches!(vm.save_state(), Err(kumo_vmm::Error::State(_))), "save needs a paused VM");
    vm.pause().unwrap();
    assert!(vm.is_paused());
    let snap = vm.save_state().unwrap();
    assert_eq!(snap.vcpus.len(), 2);
    assert!(!snap.vcpus[0].msrs.is_empty(), "MSRs saved");
    assert_eq!(snap.vm.irqchips.len(), 3, "PIC master, slave, IOAPIC");
    assert!(snap.vm.pit.is_some());
    // Through serde and back: the form migration will send.
    let snap: Snapshot = serde_json::from_slice(&serde_json::to_vec(&snap).unwrap()).unwrap();

    // Wreck the vCPUs: if restore did nothing, the guest would run off into unmapped memory.
    for id in 0..2 {
        vm.with_vcpu(id, |v| {
            let mut r = v.regs().unwrap();
            r.rip = 0xdead_0000;
            r.rsp = 0;
            v.set_regs(&r).unwrap();
        })
        .unwrap();
    }
    vm.restore_state(&snap).unwrap();
    let rip = vm.with_vcpu(0, |v| v.regs().unwrap().rip).unwrap();
    assert_eq!(rip, snap.vcpus[0].regs.rip);
    vm.resume().unwrap();
    vm.serial_input(b"q");

    let report = vm.wait_timeout(Some(Duration::from_secs(600)));
    let out = console.text();
    assert_eq!(report.outcome, Outcome::GuestExit(0), "{out}");
    assert_eq!(out.matches("memtouch: pages=").count(), 1, "the guest must not restart: {out}");
    check_memtouch(&out, 4000, 3);
}

#[test]
fn restore_rejects_a_snapshot_of_another_shape() {
    if !kvm_or_skip("restore_rejects_a_snapshot_of_another_shape") {
        return;
    }
    let a = RunningVm::start(memtouch(1, &["pages=10", "duration_ms=600000"]), Box::new(std::io::sink())).unwrap();
    let b = RunningVm::start(memtouch(2, &["pages=10", "duration_ms=600000"]), Box::new(std::io::sink())).unwrap();
    a.pause().unwrap();
    b.pause().unwrap();
    let snap = a.save_state().unwrap();
    let e = b.restore_state(&snap).unwrap_err().to_string();
    assert!(e.contains("snapshot has 1 vCPUs, VM has 2"), "{e}");
    assert!(a.resume().is_ok());
    assert!(a.resume().unwrap_err().to_string().contains("not paused"));
    a.shutdown();
    assert_eq!(a.wait().outcome, Outcome::Shutdown);
    assert!(a.pause().is_err(), "no pause after shutdown");
}

#[test]
fn a_throttled_guest_runs_on_and_keeps_its_memory() {
    if !kvm_or_skip("a_throttled_guest_runs_on_and_keeps_its_memory") {
        return;
    }
    let console = Console::default();
    let vm = RunningVm::start(
        memtouch(2, &["pages=2000", "until_input=1", "report_ms=5", "seed=5"]),
        Box::new(console.clone()),
    )
    .unwrap();
    wait_for(&console, "memtouch: progress", 1);
    vm.set_throttle(90);
    assert_eq!(vm.throttle(), 90);
    // Throttled, the guest still makes progress: more progress lines arrive.
    let seen = console.text().matches("memtouch: progress").count();
    wait_for(&console, "memtouch: progress", seen + 3);
    // Pause and resume work while throttled.
    vm.pause().unwrap();
    vm.resume().unwrap();
    vm.set_throttle(0);
    assert_eq!(vm.throttle(), 0);
    vm.serial_input(b"q");
    let report = vm.wait_timeout(Some(Duration::from_secs(600)));
    let out = console.text();
    assert_eq!(report.outcome, Outcome::GuestExit(0), "{out}");
    check_memtouch(&out, 2000, 5);
}
