//! End to end: a VM's control API through `kumo --api-socket PATH info|pause|resume|shutdown`.

mod common;
use common::*;
use std::time::Duration;

#[test]
fn info_pause_resume_shutdown_through_the_cli() {
    if !kvm_or_skip("info_pause_resume_shutdown_through_the_cli") {
        return;
    }
    let sock = temp_path("api.sock");
    let s = sock.to_str().unwrap();
    // A guest that would run for 10 minutes: only shutdown ends it.
    let vm = Kid::spawn(&["run", "--guest", "memtouch", "pages=64", "until_input=1", "--cpus", "2", "--api-socket", s]);
    let info = |want: &str| {
        let o = kumo(&["--api-socket", s, "info"]);
        if !o.status.success() {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        (v["state"] == want).then_some(v)
    };
    let v = eventually(PATIENCE, || info("running"));
    assert_eq!(v["vcpus"], 2);
    assert_eq!(v["guest"], "guest:memtouch");
    assert_eq!(v["irqchip"], "kernel");

    assert!(kumo(&["--api-socket", s, "pause"]).status.success());
    assert!(info("paused").is_some());
    let o = kumo(&["--api-socket", s, "pause"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("already paused"), "{}", text(&o).1);

    assert!(kumo(&["--api-socket", s, "resume"]).status.success());
    assert!(info("running").is_some());
    assert!(kumo(&["--api-socket", s, "ping"]).status.success());

    assert!(kumo(&["--api-socket", s, "shutdown"]).status.success());
    let (code, _, err) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    assert!(!sock.exists(), "socket removed after the VM ends");
}

#[test]
fn a_paused_guest_makes_no_progress() {
    if !kvm_or_skip("a_paused_guest_makes_no_progress") {
        return;
    }
    let sock = temp_path("pause.sock");
    let s = sock.to_str().unwrap();
    // Writes at 10,000/s until told to stop, paused for 2 s in the middle: the guest's own
    // clock (TSC) keeps running, so a real pause shows as elapsed time ≥ the pause, and the
    // checksum still matches the writes the guest reports.
    let vm = Kid::spawn(&["run", "--guest", "memtouch", "pages=64", "until_input=1", "rate=10000", "--api-socket", s]);
    eventually(PATIENCE, || kumo(&["--api-socket", s, "pause"]).status.success().then_some(()));
    std::thread::sleep(Duration::from_secs(2));
    assert!(kumo(&["--api-socket", s, "resume"]).status.success());
    let mut vm = vm;
    vm.input(b"q");
    let (code, out, err) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    let writes: u64 = field(&out, "memtouch: done", "writes").unwrap().parse().unwrap();
    let us: u64 = field(&out, "memtouch: done", "elapsed_us").unwrap().parse().unwrap();
    assert!(us >= 2_000_000, "the guest's clock ran through the 2 s pause: {us} us");
    let sum = u64::from_str_radix(&field(&out, "memtouch: checksum", "checksum").unwrap(), 16).unwrap();
    assert_eq!(sum, kumo_guests::memtouch::expected_checksum(64, writes, 1, true));
}
