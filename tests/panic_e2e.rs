//! End to end: a panic in a kumo thread stops the VM cleanly (non-zero exit, the panic in the
//! message, the API socket removed, a `panic` event), and a migration job that panics leaves the
//! VM running and migratable again. The panics come from debug builds' test hooks
//! (`KUMO_TEST_HOOK`, crates/sandbox/src/hooks.rs).
//!
//! Guests run until the test stops them (memtouch `until_input=1`); a VM that a panic should
//! have stopped but did not is caught by a bounded wait, never a hang.

use kumo_testkit::*;

use std::process::Command;
use std::time::Duration;

/// How long a VM may take to stop after its panic: generous for a busy machine, but a wedged
/// VM fails the test instead of hanging it.
const STOP_LIMIT: Duration = Duration::from_secs(120);

/// `kumo ARGS` with test hook `hook` on.
fn spawn_hooked(hook: &str, args: &[&str], tag: &str) -> Kid {
    Kid::spawn_cmd(Command::new(kumo_bin()).env("KUMO_TEST_HOOK", hook).args(args)).named(tag)
}

/// The event monitor's lines as JSON.
fn events(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("event line {l:?}: {e}")))
        .collect()
}

/// Checks that a VM stopped by a panic of thread `thread` (of `kind`) said so everywhere.
fn assert_stopped_by_panic(
    code: Option<i32>,
    err: &str,
    sock: &std::path::Path,
    ev: &[serde_json::Value],
    kind: &str,
    thread: &str,
    hook: &str,
) {
    assert_eq!(code, Some(101), "a panic exits 101; stderr:\n{err}");
    assert!(err.contains(&format!("kumo: error: {kind} thread {thread} panicked: test hook {hook}")), "{err}");
    assert!(!sock.exists(), "the API socket is removed");
    let panic = ev.iter().find(|e| e["event"] == "panic").unwrap_or_else(|| panic!("no panic event in {ev:?}"));
    assert_eq!(panic["source"], "vmm");
    assert_eq!(panic["properties"]["thread_kind"], kind);
    assert_eq!(panic["properties"]["thread"], thread);
    assert_eq!(panic["properties"]["stops_vm"], true);
    let last = ev.last().unwrap();
    assert_eq!((&last["event"], &last["properties"]["outcome"]), (&"shutdown".into(), &"panic".into()), "{ev:?}");
    assert_eq!(last["properties"]["exit_code"], 101);
}

#[test]
fn a_vcpu_that_panics_stops_the_vm() {
    if !kvm_or_skip("a_vcpu_that_panics_stops_the_vm") {
        return;
    }
    let dir = TestDir::new();
    let (sock, ev) = (dir.path("vcpu.sock"), dir.path("events"));
    // Prints a progress line every 50 ms (serial exits), so vCPU 0 reaches the hook's exit
    // count; without the hook it would run until told to stop.
    let vm = spawn_hooked(
        "panic:vcpu",
        &["run", "--guest", "memtouch", "pages=64", "until_input=1", "rate=10000", "report_ms=50", "--cpus", "2"]
            .into_iter()
            .chain(["--api-socket", &dir.arg("vcpu.sock"), "--event-monitor", &dir.arg("events")])
            .collect::<Vec<_>>(),
        "vcpu-panic",
    );
    let (code, out, err) = vm.finish(STOP_LIMIT);
    assert!(out.contains("memtouch: progress"), "the guest ran before the panic:\n{out}");
    assert_stopped_by_panic(code, &err, &sock, &events(&ev), "vcpu", "vcpu0", "panic:vcpu");
}

#[test]
fn a_device_event_loop_that_panics_stops_the_vm() {
    if !kvm_or_skip("a_device_event_loop_that_panics_stops_the_vm") {
        return;
    }
    let dir = TestDir::new();
    let (sock, ev) = (dir.path("dev.sock"), dir.path("events"));
    let mut vm = spawn_hooked(
        "panic:device",
        &[
            "run",
            "--guest",
            "memtouch",
            "pages=64",
            "until_input=1",
            "--api-socket",
            &dir.arg("dev.sock"),
            "--event-monitor",
            &dir.arg("events"),
        ],
        "device-panic",
    );
    vm.wait_stdout("memtouch: pages=", PATIENCE);
    // The byte is the event loop's first event (stdin is a pipe it watches): it panics instead
    // of feeding it to the guest, which would otherwise stop with exit 0.
    vm.input(b"q");
    let (code, _, err) = vm.finish(STOP_LIMIT);
    assert_stopped_by_panic(code, &err, &sock, &events(&ev), "device", "devices", "panic:device");
}

#[test]
fn a_migration_job_that_panics_leaves_the_vm_running_and_migratable() {
    if !kvm_or_skip("a_migration_job_that_panics_leaves_the_vm_running_and_migratable") {
        return;
    }
    let dir = TestDir::new();
    let s = dir.arg("src.sock");
    let (pages, seed) = (4000u64, 5u64);
    let src = spawn_hooked(
        "panic:migration",
        &[
            "run",
            "--guest",
            "memtouch",
            "--memory",
            "128M",
            &format!("pages={pages}"),
            &format!("seed={seed}"),
            "rate=20000",
            "report_ms=100",
            "until_input=1",
            "--api-socket",
            &s,
            "--event-monitor",
            &dir.arg("events"),
        ],
        "mig-src",
    );
    src.wait_stdout("memtouch: progress", PATIENCE);

    // The first migration's job panics after its first round, with dirty logging on.
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dest1 = incoming(&addr, &[], "mig-dst1");
    let (ok, out, err) = migrate(&s, &["--to", &addr]);
    assert!(!ok, "the panicking migration must fail:\n{out}");
    assert!(err.contains("migration thread migration job panicked: test hook panic:migration"), "{err}");
    assert!(err.contains("the VM runs on here"), "{err}");
    drop(dest1);

    // The VM runs on: running, and its guest makes progress.
    assert_eq!(vm_state(&s).as_deref(), Some("running"), "source stderr:\n{}", src.stderr());
    let seen = src.stdout().matches("memtouch: progress").count();
    eventually(PATIENCE, || (src.stdout().matches("memtouch: progress").count() > seen + 2).then_some(()));
    let ev = events(&dir.path("events"));
    let panic = ev.iter().find(|e| e["event"] == "panic").unwrap_or_else(|| panic!("no panic event: {ev:?}"));
    assert_eq!(panic["properties"]["stops_vm"], false, "{panic}");
    assert!(ev.iter().any(|e| e["event"] == "migration-failed"), "{ev:?}");

    // And it migrates again (the hook fires once): the run state was given back.
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let mut dest2 = incoming(&addr, &[], "mig-dst2");
    let (ok, out, err) = migrate(&s, &["--to", &addr]);
    assert!(ok, "the second migration must succeed:\n{out}\n{err}\nsource:\n{}", src.stderr());
    let (code, _, serr) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "{serr}");
    assert!(serr.contains("VM migrated to"), "{serr}");
    dest2.stop_guest();
    let (code, dout, derr) = dest2.finish(PATIENCE);
    assert_eq!(code, Some(0), "{derr}");
    check_memtouch(&dout, pages, seed, true);
}

#[test]
fn an_api_handler_that_panics_answers_500_and_stops_the_vm() {
    if !kvm_or_skip("an_api_handler_that_panics_answers_500_and_stops_the_vm") {
        return;
    }
    let dir = TestDir::new();
    let (sock, ev) = (dir.path("api.sock"), dir.path("events"));
    let s = dir.arg("api.sock");
    let args = ["run", "--guest", "memtouch", "pages=64", "until_input=1", "--api-socket", &s];
    let vm = spawn_hooked("panic:api", &[&args[..], &["--event-monitor", &dir.arg("events")]].concat(), "api-panic");
    eventually(PATIENCE, || kumo(&["--api-socket", &s, "ping"]).status.success().then_some(()));
    // A handler's panic may have left the VM half-changed: the client gets its 500, and the VM
    // stops.
    let o = kumo(&["--api-socket", &s, "counters"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("kumo is stopping"), "{}", text(&o).1);
    let (code, _, err) = vm.finish(STOP_LIMIT);
    assert_stopped_by_panic(code, &err, &sock, &events(&ev), "api", "kumo-api-conn", "panic:api");
}

#[test]
fn an_empty_vmm_ends_when_a_thread_panics() {
    if !kvm_or_skip("an_empty_vmm_ends_when_a_thread_panics") {
        return;
    }
    let dir = TestDir::new();
    let (sock, s) = (dir.path("empty.sock"), dir.arg("empty.sock"));
    let vmm = spawn_hooked("panic:api", &["run", "--api-socket", &s], "empty-panic");
    eventually(PATIENCE, || kumo(&["--api-socket", &s, "ping"]).status.success().then_some(()));
    let o = kumo(&["--api-socket", &s, "counters"]);
    assert!(text(&o).1.contains("kumo is stopping"), "{}", text(&o).1);
    let (code, _, err) = vmm.finish(STOP_LIMIT);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("api thread kumo-api-conn panicked: test hook panic:api"), "{err}");
    assert!(!sock.exists(), "the API socket is removed");
}

#[test]
fn a_destination_waiting_for_its_vm_exits_when_a_thread_panics() {
    if !kvm_or_skip("a_destination_waiting_for_its_vm_exits_when_a_thread_panics") {
        return;
    }
    let dir = TestDir::new();
    let (sock, s) = (dir.path("dst.sock"), dir.arg("dst.sock"));
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dst = spawn_hooked("panic:api", &["run", "--incoming", &addr, "--api-socket", &s], "dst-panic");
    eventually(PATIENCE, || dst.stderr().contains("waiting for a migration").then_some(()));
    // No VM to stop yet: the process ends as a signal would end it then.
    assert!(!kumo(&["--api-socket", &s, "counters"]).status.success());
    let (code, _, err) = dst.finish(STOP_LIMIT);
    assert_eq!(code, Some(101), "{err}");
    assert!(err.contains("kumo: error: api thread kumo-api-conn panicked: test hook panic:api"), "{err}");
    assert!(err.contains("; no VM yet, exiting"), "{err}");
    assert!(!sock.exists(), "the API socket is removed");
}
