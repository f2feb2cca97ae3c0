//! End to end: a VM's control API through `kumo --api-socket PATH info|pause|resume|shutdown`,
//! signals, logging and the CLI's refusals.

use kumo_testkit::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn info_pause_resume_shutdown_through_the_cli() {
    if !kvm_or_skip("info_pause_resume_shutdown_through_the_cli") {
        return;
    }
    let dir = TestDir::new();
    let sock = dir.path("api.sock");
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
    assert!(!text(&o).1.contains("(HTTP"), "the status is not for users: {}", text(&o).1);

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
    let dir = TestDir::new();
    let sock = dir.path("pause.sock");
    let s = sock.to_str().unwrap();
    // Writes at 10,000/s until told to stop, paused for 2 s in the middle: the guest's own
    // clock (TSC) keeps running, so a real pause shows as elapsed time ≥ the pause, and the
    // checksum still matches the writes the guest reports.
    let vm = Kid::spawn(&[
        "run",
        "--guest",
        "memtouch",
        "pages=64",
        "until_input=1",
        "rate=10000",
        "report_ms=100",
        "--api-socket",
        s,
    ]);
    // Pause only once the guest's clock runs (a progress line: its start line comes before the
    // clock starts), or the pause is not measured.
    vm.wait_stdout("memtouch: progress", PATIENCE);
    eventually(PATIENCE, || kumo(&["--api-socket", s, "pause"]).status.success().then_some(()));
    std::thread::sleep(Duration::from_secs(2));
    assert!(kumo(&["--api-socket", s, "resume"]).status.success());
    let mut vm = vm;
    vm.input(b"q");
    let (code, out, err) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    let us: u64 = field(&out, "memtouch: done", "elapsed_us").unwrap().parse().unwrap();
    assert!(us >= 2_000_000, "the guest's clock ran through the 2 s pause: {us} us");
    check_memtouch(&out, 64, 1, true);
}

#[test]
fn sigterm_and_sigint_shut_the_vm_down_and_remove_the_socket() {
    if !kvm_or_skip("sigterm_and_sigint_shut_the_vm_down_and_remove_the_socket") {
        return;
    }
    let dir = TestDir::new();
    for sig in ["TERM", "INT"] {
        let sock = dir.path(&format!("{sig}.sock"));
        let s = sock.to_str().unwrap();
        // Runs until typed at: only the signal ends it.
        let vm = Kid::spawn(&["run", "--guest", "memtouch", "pages=64", "until_input=1", "--api-socket", s]);
        vm.wait_stdout("memtouch: pages=", PATIENCE);
        eventually(PATIENCE, || kumo(&["--api-socket", s, "ping"]).status.success().then_some(()));
        vm.signal(sig);
        let (code, _, err) = vm.finish(PATIENCE);
        assert_eq!(code, Some(0), "SIG{sig}: {err}");
        assert!(err.contains(&format!("SIG{sig}: shutting the VM down")), "{err}");
        assert!(!sock.exists(), "SIG{sig}: the API socket is removed");
    }
}

#[test]
fn logs_have_no_colour_when_not_on_a_terminal() {
    let dir = TestDir::new();
    let log = dir.path("kumo.log");
    if kvm_or_skip("logs_have_no_colour_when_not_on_a_terminal (VM part)") {
        // stderr is a pipe here.
        let o = kumo(&["-vv", "run", "--guest", "hello"]);
        let (_, err) = text(&o);
        assert!(o.status.success(), "{err}");
        assert!(err.contains("INFO"), "-vv logs: {err}");
        assert!(!o.stderr.contains(&0x1b), "no ANSI escapes: {err:?}");

        let o = kumo(&["-v", "--log-file", log.to_str().unwrap(), "run", "--guest", "hello"]);
        assert!(o.status.success());
        assert!(!text(&o).1.contains("INFO"), "the log went to the file: {}", text(&o).1);
        let file = std::fs::read(&log).unwrap();
        assert!(String::from_utf8_lossy(&file).contains("INFO"), "{}", String::from_utf8_lossy(&file));
        assert!(!file.contains(&0x1b), "no ANSI escapes in the log file");
    }
    // Without KVM too: an error run with debug logging on.
    let o = kumo(&["-vv", "--api-socket", dir.arg("nobody.sock").as_str(), "ping"]);
    assert!(!o.status.success());
    assert!(!o.stderr.contains(&0x1b), "{:?}", text(&o).1);
    let o = Command::new(kumo_bin()).args(["guests"]).env("KUMO_LOG", "not a [filter").output().unwrap();
    assert!(!o.status.success(), "a bad KUMO_LOG is refused");
    assert!(text(&o).1.contains("KUMO_LOG"), "{}", text(&o).1);
}

#[test]
fn help_documents_logging() {
    let (out, _) = text(&kumo(&["--help"]));
    for want in ["KUMO_LOG", "-v", "--log-file"] {
        assert!(out.contains(want), "--help lacks {want}: {out}");
    }
}

#[test]
fn flags_that_do_not_apply_are_refused() {
    for (args, want) in [
        (&["--api-socket", "/tmp/x.sock", "guests"][..], "--api-socket does not apply to `kumo guests`"),
        (&["--api-socket", "/tmp/x.sock", "bench", "boot"][..], "--api-socket does not apply to `kumo bench`"),
        (&["-v", "bench", "boot"][..], "-v does not apply to `kumo bench`"),
        (&["run", "--guest", "hello", "--initrd", "/tmp/initrd"][..], "--initrd applies to a Linux kernel"),
        (&["run", "--guest", "hello", "--cmdline", "quiet"][..], "--cmdline applies to a Linux kernel"),
        (&["run", "--guest", "hello", "--timeout=-1"][..], "not a usable number of seconds"),
        (&["run", "--guest", "hello", "--timeout", "soon"][..], "not a number of seconds"),
        (&["run", "--debug-exit"][..], "--debug-exit given, but nothing to boot"),
        (&["run", "--incoming", "unix:/tmp/x", "--debug-exit"][..], "cannot be used with"),
    ] {
        let o = kumo(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} must fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn timeout_zero_means_no_timeout() {
    if !kvm_or_skip("timeout_zero_means_no_timeout") {
        return;
    }
    let o = kumo(&["run", "--guest", "hello", "--timeout", "0"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
    assert!(text(&o).0.contains("Hello"), "{}", text(&o).0);
}

#[test]
fn sizes_take_decimals_and_errors_use_human_units() {
    if !kvm_or_skip("sizes_take_decimals_and_errors_use_human_units") {
        return;
    }
    let o = kumo(&["run", "--guest", "hello", "--memory", "1.5G"]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(text(&o).0.contains("memory_mib=1536"), "{}", text(&o).0);
    let o = kumo(&["run", "--guest", "hello", "--memory", "9999T"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("PiB") && err.contains("GiB"), "{err}");
}

#[test]
fn kumo_bench_without_its_binary_says_what_is_missing() {
    // A kumo alone in a directory: no kumo-bench next to it.
    let dir = TestDir::new();
    let lone = dir.path("kumo");
    std::fs::copy(kumo_bin(), &lone).unwrap();
    let o = Command::new(&lone).args(["bench", "boot"]).output().unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("needs the kumo-bench binary") && err.contains("cargo build"), "{err}");
}

#[test]
fn kumo_bench_runs_kumo_bench() {
    if !kumo_bin().with_file_name("kumo-bench").is_file() {
        eprintln!("skipping kumo_bench_runs_kumo_bench: kumo-bench not built (cargo build -p kumo-bench)");
        return;
    }
    let o = kumo(&["bench", "boot", "--help"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("--runs") && out.contains("--out"), "{out}");
}

#[test]
fn the_console_socket_shows_the_output_and_types_on_the_console() {
    if !kvm_or_skip("the_console_socket_shows_the_output_and_types_on_the_console") {
        return;
    }
    use std::io::{Read, Write};
    let dir = TestDir::new();
    let cons = dir.path("console.sock");
    // Writes until a byte arrives on its console, printing progress all along: the client sees
    // output whenever it connects, and its byte is the only input (stdin stays silent).
    let vm = Kid::spawn(&[
        "run",
        "--guest",
        "memtouch",
        "pages=64",
        "until_input=1",
        "report_ms=50",
        "--console-socket",
        cons.to_str().unwrap(),
    ]);
    let mut client = eventually(PATIENCE, || std::os::unix::net::UnixStream::connect(&cons).ok());
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("memtouch: progress") {
        let n = client.read(&mut buf).expect("console output");
        assert!(n > 0, "the console closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    client.write_all(b"q").unwrap();
    // The rest of the output, to the end (the VM has stopped when the socket closes).
    client.read_to_end(&mut seen).expect("console output");
    let (code, out, err) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains("memtouch: done"), "the client saw the guest finish: {seen}");
    check_memtouch(&out, 64, 1, true);
    assert!(!cons.exists(), "the console socket is removed when the VM ends");
}

/// `kumo run --api-socket S` with nothing to boot is an empty VMM: it answers ping and info
/// (`created`), refuses what needs a VM with 409 "no VM yet", and a signal ends it, removing
/// its socket. Without --api-socket, nothing to boot is still an error.
#[test]
fn an_empty_vmm_waits_refuses_what_needs_a_vm_and_ends_on_a_signal() {
    let dir = TestDir::new();
    let o = kumo(&["run"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("nothing to boot"), "{}", text(&o).1);
    let o = kumo(&["run", "--memory", "1G", "--api-socket", dir.arg("shaped.sock").as_str()]);
    assert!(!o.status.success() && text(&o).1.contains("--memory given, but nothing to boot"), "{}", text(&o).1);
    for sig in ["TERM", "INT"] {
        let sock = dir.path(&format!("empty-{sig}.sock"));
        let s = sock.to_str().unwrap();
        let vm = Kid::spawn(&["run", "--api-socket", s]);
        let c = kumo_api::ApiClient::new(&sock);
        let info = eventually(PATIENCE, || c.info().ok());
        assert_eq!(info.state, kumo_api::VmState::Created);
        assert_eq!((info.vcpus, info.memory_bytes), (0, 0));
        assert!(kumo(&["--api-socket", s, "ping"]).status.success());
        for (method, path) in [
            ("PUT", "/api/v1/vm.pause"),
            ("PUT", "/api/v1/vm.resume"),
            ("PUT", "/api/v1/vm.shutdown"),
            ("PUT", "/api/v1/vm.cancel-migration"),
            ("GET", "/api/v1/vm.counters"),
        ] {
            let e = c.call(method, path, None).unwrap_err();
            assert_eq!(e.status(), Some(409), "{method} {path}: {e}");
            assert!(e.to_string().starts_with("no VM yet: "), "{method} {path}: {e}");
        }
        let o = kumo(&["--api-socket", s, "snapshot", "--to", dir.arg("x.snap").as_str()]);
        assert!(text(&o).1.contains("no VM yet"), "{}", text(&o).1);
        vm.signal(sig);
        let (_, _, err) = vm.finish(PATIENCE);
        assert!(err.contains(&format!("SIG{sig}: no VM yet; exiting")), "{err}");
        assert!(!sock.exists(), "SIG{sig}: the API socket is removed");
    }
}

/// A parent that went away closes kumo's stdout and stderr: a signal still shuts the VM down
/// (no message it fails to print may stop it).
#[test]
fn a_signal_shuts_down_a_vm_whose_output_readers_are_gone() {
    if !kvm_or_skip("a_signal_shuts_down_a_vm_whose_output_readers_are_gone") {
        return;
    }
    let dir = TestDir::new();
    let sock = dir.path("orphan.sock");
    let s = sock.to_str().unwrap();
    let mut child = std::process::Command::new(kumo_bin())
        .args(["run", "--guest", "memtouch", "pages=64", "until_input=1", "report_ms=20", "--api-socket", s])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(PATIENCE, || kumo(&["--api-socket", s, "ping"]).status.success().then_some(()));
    drop(child.stdout.take());
    drop(child.stderr.take());
    let vm = Kid::from_child(child);
    vm.signal("TERM");
    let (code, _, _) = vm.finish(PATIENCE);
    assert_eq!(code, Some(0));
    assert!(!sock.exists(), "the API socket is removed");
}

/// `--api-allow-uid`: a client whose uid is not listed is refused with 403 (the test allows
/// only a uid that is not its own), a listed one is served; the socket is 0600 either way.
#[test]
fn api_allow_uid_refuses_other_uids() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TestDir::new();
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let o = kumo(&["--api-allow-uid", "bob", "run", "--api-socket", dir.arg("x.sock").as_str()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(text(&o).1.contains("not a list of uids"), "{}", text(&o).1);
    let o = kumo(&["--api-allow-uid", "0", "--api-socket", dir.arg("x.sock").as_str(), "ping"]);
    assert!(!o.status.success() && text(&o).1.contains("--api-allow-uid does not apply"), "{}", text(&o).1);
    for (allow, served) in [(me.wrapping_add(1), false), (me, true)] {
        let sock = dir.path(&format!("allow-{allow}.sock"));
        let s = sock.to_str().unwrap();
        let vm =
            Kid::spawn(&["--api-allow-uid", &format!("{allow},{}", allow.wrapping_add(7)), "run", "--api-socket", s]);
        eventually(PATIENCE, || sock.exists().then_some(()));
        assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o600);
        let o = kumo(&["--api-socket", s, "ping"]);
        if served {
            assert!(o.status.success(), "{}", text(&o).1);
        } else {
            let err = text(&o).1;
            assert!(!o.status.success() && err.contains(&format!("uid {me} ")) && err.contains("not allowed"), "{err}");
        }
        vm.signal("TERM");
        vm.finish(PATIENCE);
    }
}
