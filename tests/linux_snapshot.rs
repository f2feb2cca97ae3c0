//! Linux as the judge of snapshot and restore: the test kernel, its root filesystem mounted from
//! a kumo disk and its NIC configured by `ip=`, is paused and written to a snapshot file; its
//! process ends; a new kumo process restores it (paused, as it was saved) on the same disk and
//! tap and resumes it: the kernel answers the host's pings again and its disk keeps working (the
//! MMP block its kmmpd thread rewrites every second changes in the image after the restore).
//!
//! Pausing before the snapshot keeps the image exactly as the saved kernel left it: a kernel
//! that ran on after its snapshot would have written blocks the restored one knows nothing of.
//!
//! Needs /dev/kvm, a tap (root) and the test kernel; skips, saying why, without them. Every
//! wait is for a kernel message, a ping reply or a change in the image, bounded by
//! `linux::boot_limit()` and `linux::effect_limit()` only as hang guards.

use kumo_testkit::linux::{self, Pinger, RootFs, IP_CONFIG_COMPLETE, RUN_INIT};
use kumo_testkit::net::{subnet, tap_or_skip};
use kumo_testkit::{eventually, kumo_api, vm_state, Kid, TestDir, PATIENCE};

#[test]
fn linux_restored_from_a_snapshot_answers_pings_and_writes_its_disk() {
    let test = "linux_restored_from_a_snapshot_answers_pings_and_writes_its_disk";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(245);
    let Some(tap) = tap_or_skip(test, "ls", host) else { return };
    let _one = linux::one_at_a_time();
    let dir = TestDir::new();
    let root = RootFs::create(dir.path("").as_path(), 32);
    let img = root.image.display().to_string();
    let sock = dir.arg("src.sock");
    let cmdline = linux::cmdline(&format!("{} {}", linux::ip_arg(guest, host), linux::ROOT_ARGS));
    let (net, disk) = (format!("tap={}", tap.name), format!("path={img}"));
    let mut src = linux::spawn(&kernel, &cmdline, &["--net", &net, "--disk", &disk, "--api-socket", &sock], "src");
    linux::expect_console(&mut src, IP_CONFIG_COMPLETE);
    linux::expect_console(&mut src, RUN_INIT);
    let pinger = Pinger::start(guest);
    pinger
        .wait_replies(0, 5, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{e}\n{}", linux::console_tail(&src, 30)));
    drop(pinger);

    let file = dir.arg("linux.snap");
    let (ok, _, err) = kumo_api(&sock, &["pause"]);
    assert!(ok, "pause: {err}");
    let (ok, out, err) = kumo_api(&sock, &["snapshot", "--to", &file]);
    assert!(ok, "snapshot: {out}\n{err}");
    drop(src);

    let rsock = dir.arg("restored.sock");
    let (rnet, rdisk) = (format!("id=net0,tap={}", tap.name), format!("id=disk0,path={img}"));
    let mut vm = Kid::spawn(&["run", "--restore", &file, "--net", &rnet, "--disk", &rdisk, "--api-socket", &rsock])
        .named("restored");
    eventually(PATIENCE, || {
        if let Ok(Some(st)) = vm.child.try_wait() {
            panic!("the restore exited ({st}): {}", vm.stderr());
        }
        (vm_state(&rsock).as_deref() == Some("paused")).then_some(())
    });
    let seq = root.mmp_seq();
    let (ok, _, err) = kumo_api(&rsock, &["resume"]);
    assert!(ok, "resume: {err}");
    let pinger = Pinger::start(guest);
    pinger
        .wait_replies(0, 5, linux::effect_limit())
        .unwrap_or_else(|e| panic!("the restored kernel: {e}\n{}", vm.stderr()));
    root.wait_mmp_writes(seq, linux::effect_limit())
        .unwrap_or_else(|e| panic!("the restored kernel's disk: {e}\n{}", vm.stderr()));
    assert_eq!(vm.try_exit(), Ok(None), "the restored VM runs on: {}", vm.stderr());
    let console = vm.stdout();
    assert!(!console.contains("EXT4-fs error") && !console.contains("I/O error"), "{console}");
}
