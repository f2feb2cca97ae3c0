//! End to end: snapshot a VM to a file and restore it in a new kumo process (memtouch's
//! checksum against the reference model proves memory and state survived), `vm.counters`, and
//! the event monitor.
//!
//! No test depends on a duration: memtouch writes until the test types a byte on its console
//! (`until_input=1`), then reports how many writes it made, so the model's checksum is computed
//! for exactly that count. Deadlines are only safety nets against hangs.

use kumo_testkit::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// A `kumo` process whose stdout/stderr go to files (read while it runs) and whose stdin is
/// the guest's console.
type Vmp = Kid;

/// `kumo --api-socket SOCK ARGS…`: (success, stdout, stderr).
use kumo_testkit::kumo_api as api;

/// memtouch with an API socket and an event monitor, waited for until it runs.
fn memtouch(tag: &str, guest_args: &[&str]) -> (Vmp, String, PathBuf) {
    memtouch_env(tag, guest_args, &[])
}

/// [`memtouch`] with environment variables for kumo.
fn memtouch_env(tag: &str, guest_args: &[&str], env: &[(&str, &Path)]) -> (Vmp, String, PathBuf) {
    let sock = temp_path(&format!("{tag}.sock")).to_str().unwrap().to_string();
    let events = temp_path(&format!("{tag}.events"));
    let mut args = vec!["run", "--guest", "memtouch", "--cpus", "2", "--memory", "64M", "--api-socket", &sock];
    let ev = events.to_str().unwrap().to_string();
    args.extend(["--event-monitor", &ev]);
    args.extend_from_slice(guest_args);
    let mut cmd = Command::new(kumo_bin());
    cmd.args(&args).envs(env.iter().copied());
    let vm = Kid::spawn_cmd(&mut cmd);
    eventually(PATIENCE, || vm.stdout().contains("memtouch: pages=").then_some(()));
    eventually(PATIENCE, || vm_state(&sock));
    (vm, sock, events)
}

/// A restored VM (`kumo run --restore FILE`), waited for until its API answers.
fn restore(file: &Path, tag: &str) -> (Vmp, String, PathBuf) {
    let sock = temp_path(&format!("{tag}.sock")).to_str().unwrap().to_string();
    let events = temp_path(&format!("{tag}.events"));
    let mut vm = Kid::spawn(&[
        "run",
        "--restore",
        file.to_str().unwrap(),
        "--api-socket",
        &sock,
        "--event-monitor",
        events.to_str().unwrap(),
    ]);
    eventually(PATIENCE, || {
        if let Some(st) = vm.child.try_wait().unwrap() {
            panic!("the restore exited ({st}): {}", vm.stderr());
        }
        vm_state(&sock)
    });
    (vm, sock, events)
}

/// The event names in an event monitor file, each line checked for the documented fields.
fn events(path: &Path) -> Vec<(String, Value)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v["timestamp_ms"].is_u64() && v["source"] == "vm" && v["properties"].is_object(), "{l}");
            (v["event"].as_str().unwrap_or_default().to_string(), v["properties"].clone())
        })
        .collect()
}

fn names(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

/// Snapshots the VM on `sock` to `file`; returns the report.
fn snapshot(sock: &str, file: &Path) -> Value {
    let (ok, out, err) = api(sock, &["snapshot", "--to", file.to_str().unwrap()]);
    assert!(ok, "{out}\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Shuts the first process down: the guest never finished there.
fn shut_down(vm: Vmp, sock: &str) {
    assert!(api(sock, &["shutdown"]).0);
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("memtouch: done"), "the guest must not have finished in the first process:\n{out}");
}

#[test]
fn a_snapshot_runs_on_in_a_new_process() {
    if !kvm_or_skip("a_snapshot_runs_on_in_a_new_process") {
        return;
    }
    let (src, sock, src_events) =
        memtouch("snap-src", &["pages=3000", "rate=20000", "seed=7", "until_input=1", "report_ms=5"]);
    // A progress line means the guest has written: those writes exist only in its memory, so
    // the checksum after the restore needs them from the file.
    let before: u64 = eventually(PATIENCE, || {
        field(&src.stdout(), "memtouch: progress", "writes").and_then(|w| w.parse().ok()).filter(|&w| w > 0)
    });
    let file = temp_path("running.snap");
    let rep = snapshot(&sock, &file);
    // Only touched pages are written: the guest image, boot structures and what memtouch wrote.
    assert!(rep["pages"].as_u64().unwrap() > 0, "{rep}");
    assert!(rep["pages"].as_u64().unwrap() < (64 << 20) / 4096, "never-touched pages are left out: {rep}");
    assert_eq!(rep["bytes"].as_u64(), Some(std::fs::metadata(&file).unwrap().len()));
    assert_eq!(rep["paused"], false);
    assert_eq!(vm_state(&sock).as_deref(), Some("running"), "the VM runs on after its snapshot");
    shut_down(src, &sock);
    let ev = events(&src_events);
    assert!(names(&ev).contains(&"snapshot"), "{ev:?}");

    let (mut dst, dsock, dst_events) = restore(&file, "snap-dst");
    assert_eq!(vm_state(&dsock).as_deref(), Some("running"));
    dst.input(b"q");
    let (code, out, err) = dst.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("memtouch: pages="), "the guest must carry on, not restart:\n{out}");
    let writes = check_memtouch(&out, 3000, 7, true);
    assert!(writes >= before, "{writes} writes in all, {before} before the snapshot");
    let ev = events(&dst_events);
    assert_eq!(names(&ev), ["restored", "resumed", "shutdown"], "{ev:?}");

    // The same file, cut short or not kumo's: refused with the file's name and the offset.
    let full = std::fs::read(&file).unwrap();
    let cut = temp_path("cut.snap");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let o = kumo(&["run", "--restore", cut.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cut.snap is not a valid kumo snapshot") && err.contains("truncated"), "{err}");
    assert!(err.contains(" at byte "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_paused_vm_is_snapshotted_and_restored_paused() {
    if !kvm_or_skip("a_paused_vm_is_snapshotted_and_restored_paused") {
        return;
    }
    let (src, sock, _) = memtouch("psnap-src", &["pages=2000", "rate=20000", "seed=9", "until_input=1"]);
    assert!(api(&sock, &["pause"]).0);
    let file = temp_path("paused.snap");
    let rep = snapshot(&sock, &file);
    assert_eq!(rep["paused"], true, "{rep}");
    assert_eq!(vm_state(&sock).as_deref(), Some("paused"), "a user-paused VM stays paused");
    shut_down(src, &sock);

    let (mut dst, dsock, _) = restore(&file, "psnap-dst");
    assert_eq!(vm_state(&dsock).as_deref(), Some("paused"), "it was saved paused, so it is restored paused");
    assert!(api(&dsock, &["resume"]).0);
    assert_eq!(vm_state(&dsock).as_deref(), Some("running"));
    dst.input(b"q");
    let (code, out, err) = dst.wait();
    assert_eq!(code, Some(0), "{err}");
    check_memtouch(&out, 2000, 9, true);
}

#[test]
fn counters_and_the_event_monitor_follow_a_running_vm() {
    if !kvm_or_skip("counters_and_the_event_monitor_follow_a_running_vm") {
        return;
    }
    let (mut vm, sock, ev_path) = memtouch("counters", &["pages=500", "rate=20000", "seed=1", "until_input=1"]);
    // The guest has printed its first line: port I/O exits have happened.
    let (ok, out, err) = api(&sock, &["counters"]);
    assert!(ok, "{err}");
    let c: Value = serde_json::from_str(&out).unwrap();
    let exits = &c["exits"];
    assert!(exits["io"].as_u64().unwrap() > 0, "{c}");
    assert!(exits["total"].as_u64().unwrap() >= exits["io"].as_u64().unwrap(), "{c}");
    assert!(c["interrupts"]["serial"].is_u64() && c["assists"]["INT3"].is_u64(), "{c}");
    assert!(c.get("migration").is_none(), "no migration ran: {c}");

    assert!(api(&sock, &["pause"]).0);
    assert!(api(&sock, &["resume"]).0);
    vm.input(b"q");
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
    check_memtouch(&out, 500, 1, true);
    let ev = events(&ev_path);
    assert_eq!(names(&ev), ["booted", "paused", "resumed", "shutdown"], "{ev:?}");
    assert_eq!(ev[1].1["by"], "user");
    assert_eq!((&ev[3].1["outcome"], &ev[3].1["exit_code"]), (&"guest-exit".into(), &0.into()));
}

#[test]
fn bad_snapshot_requests_and_files_are_refused() {
    // No KVM needed: these fail before any VM is built.
    let junk = temp_path("junk.snap");
    std::fs::write(&junk, b"#!/bin/sh\necho not a VM\n").unwrap();
    let o = kumo(&["run", "--restore", junk.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("junk.snap is not a valid kumo snapshot: header at byte 0"), "{err}");
    let o = kumo(&["run", "--restore", "/nonexistent/vm.snap"]);
    let (_, err) = text(&o);
    assert!(err.contains("cannot open snapshot /nonexistent/vm.snap"), "{err}");
    let o = kumo(&["run", "--restore", junk.to_str().unwrap(), "--guest", "hello"]);
    assert_eq!(o.status.code(), Some(2), "--restore and --guest conflict");
    let o = kumo(&["snapshot", "--to", "x.snap"]);
    assert!(text(&o).1.contains("needs --api-socket"));
}

#[test]
fn a_snapshot_owns_the_run_state_until_it_ends_and_a_failed_one_leaves_the_vm_running() {
    if !kvm_or_skip("a_snapshot_owns_the_run_state_until_it_ends_and_a_failed_one_leaves_the_vm_running") {
        return;
    }
    // The snapshot's stream goes into a FIFO (a debug-build hook: kumo never opens an existing
    // file as a snapshot's): the snapshot blocks in it until the test reads, so the test
    // controls when it ends without any timing. fsync of a FIFO fails (EINVAL), so the snapshot
    // then fails: the failure path, with the whole stream read from the FIFO.
    let file = temp_path("own.snap");
    let fifo = temp_path("own.fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let (mut vm, sock, _) = memtouch_env(
        "own",
        &["pages=500", "rate=20000", "seed=4", "until_input=1"],
        &[("KUMO_TEST_SNAPSHOT_SINK", &fifo)],
    );
    let snap = {
        let (sock, file) = (sock.clone(), file.clone());
        std::thread::spawn(move || api(&sock, &["snapshot", "--to", file.to_str().unwrap()]))
    };
    // Nothing else pauses this VM: "paused" means the snapshot holds it.
    eventually(PATIENCE, || (vm_state(&sock).as_deref() == Some("paused")).then_some(()));
    let (ok, _, err) = api(&sock, &["resume"]);
    assert!(!ok && err.contains("pause and resume wait until it ends"), "{err}");
    let (ok, _, err) = api(&sock, &["pause"]);
    assert!(!ok, "{err}");
    let (ok, _, err) = api(&sock, &["snapshot", "--to", file.to_str().unwrap()]);
    assert!(!ok && err.contains("cannot snapshot"), "one at a time: {err}");
    let mut stream = Vec::new();
    std::io::Read::read_to_end(&mut std::fs::File::open(&fifo).unwrap(), &mut stream).unwrap();
    assert!(stream.starts_with(b"KUMOMIG\0"), "a migration stream went into the FIFO");
    let (ok, out, err) = snap.join().unwrap();
    assert!(!ok && err.contains("cannot write snapshot"), "{out}\n{err}");
    assert!(!file.exists(), "a failed snapshot leaves no file behind");
    let dir = file.parent().unwrap();
    let tmp = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with(".own.snap."));
    assert!(tmp.is_none(), "a failed snapshot leaves no temporary file behind: {tmp:?}");
    let _ = std::fs::remove_file(&fifo);

    // The VM runs on, and its run state is the user's again.
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    assert!(api(&sock, &["pause"]).0);
    assert!(api(&sock, &["resume"]).0);
    vm.input(b"q");
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
    check_memtouch(&out, 500, 4, true);
}

/// An empty VMM (`kumo run --api-socket S`, nothing to boot), waited for until its API answers.
fn empty_vmm(tag: &str) -> (Vmp, String) {
    let sock = temp_path(&format!("{tag}.sock")).to_str().unwrap().to_string();
    let vm = Kid::spawn(&["run", "--api-socket", &sock]);
    eventually(PATIENCE, || vm_state(&sock));
    (vm, sock)
}

/// `vm.restore` (`kumo restore`) on an empty VMM runs a snapshot to the model's checksum. A
/// file that is missing, not kumo's or cut short is a 400 and leaves the VMM empty and usable:
/// it restores a good file afterwards; then a second restore is refused (409).
#[test]
fn an_empty_vmm_told_to_restore_runs_the_snapshot() {
    if !kvm_or_skip("an_empty_vmm_told_to_restore_runs_the_snapshot") {
        return;
    }
    let (src, sock, _) = memtouch("esnap-src", &["pages=2000", "rate=20000", "seed=5", "until_input=1", "report_ms=5"]);
    eventually(PATIENCE, || {
        field(&src.stdout(), "memtouch: progress", "writes").and_then(|w| w.parse::<u64>().ok()).filter(|&w| w > 0)
    });
    let file = temp_path("empty.snap");
    snapshot(&sock, &file);
    shut_down(src, &sock);

    let (mut dst, dsock) = empty_vmm("esnap-dst");
    assert_eq!(vm_state(&dsock).as_deref(), Some("created"));
    let c = kumo_api::ApiClient::new(&dsock);
    let junk = temp_path("empty-junk.snap");
    std::fs::write(&junk, b"not a VM").unwrap();
    let full = std::fs::read(&file).unwrap();
    let cut = temp_path("empty-cut.snap");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    for (url, want) in [
        ("/nonexistent/vm.snap".to_string(), "cannot open snapshot /nonexistent/vm.snap"),
        (format!("file://{}", junk.display()), "is not a valid kumo snapshot"),
        (cut.display().to_string(), "truncated"),
        ("relative.snap".to_string(), "absolute"),
    ] {
        let req = kumo_api::RestoreRequest {
            source_url: url.clone(),
            net: vec![],
            numa: vec![],
            disks: vec![],
            net_fds: vec![],
        };
        let e = c.restore(&req).unwrap_err();
        assert_eq!(e.status(), Some(400), "{url}: {e}");
        assert!(e.to_string().contains(want), "{url}: {e}");
        assert_eq!(vm_state(&dsock).as_deref(), Some("created"), "{url}: the VMM stays empty");
    }
    // Host resources the VM does not have are refused before it is built; the VMM stays empty.
    let nic = kumo_api::NicBackend { id: "net0".into(), tap: Some("h2none".into()), vhost_user: None };
    let node = kumo_api::NodeBinding { node: 0, host_node: Some(0) };
    let eth = kumo_api::NicBackend { id: "eth0".into(), ..nic.clone() };
    for (net, numa, want) in [
        (vec![nic], vec![], "--net id=net0: the VM has no NIC net0 (it has none)"),
        (vec![eth], vec![], "--net id=eth0: not a NIC id (net0, net1, …)"),
        (vec![], vec![node], "--numa node=0: the VM has no NUMA nodes"),
    ] {
        let req = kumo_api::RestoreRequest {
            source_url: file.to_str().unwrap().into(),
            net,
            numa,
            disks: vec![],
            net_fds: vec![],
        };
        let e = c.restore(&req).unwrap_err();
        assert_eq!(e.status(), Some(400), "{e}");
        assert!(e.to_string().contains(want), "want `{want}` in `{e}`");
        assert_eq!(vm_state(&dsock).as_deref(), Some("created"), "the VMM stays empty");
    }
    let (ok, out, err) = api(&dsock, &["restore", "--from", file.to_str().unwrap()]);
    assert!(ok, "{out}\n{err}\n{}", dst.stderr());
    let rep: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(rep["path"], file.to_str().unwrap());
    assert_eq!(rep["paused"], false);
    assert!(rep["pages"].as_u64().unwrap() > 0, "{rep}");
    assert_eq!(vm_state(&dsock).as_deref(), Some("running"));
    let again = kumo_api::RestoreRequest {
        source_url: file.to_str().unwrap().into(),
        net: vec![],
        numa: vec![],
        disks: vec![],
        net_fds: vec![],
    };
    assert_eq!(c.restore(&again).unwrap_err().status(), Some(409), "it has a VM now");
    dst.input(b"q");
    let (code, out, err) = dst.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("memtouch: pages="), "the guest must carry on, not restart:\n{out}");
    check_memtouch(&out, 2000, 5, true);
}

#[test]
fn a_snapshot_to_a_symlink_is_refused_and_its_target_untouched() {
    if !kvm_or_skip("a_snapshot_to_a_symlink_is_refused_and_its_target_untouched") {
        return;
    }
    let (mut vm, sock, _) = memtouch("link", &["pages=100", "rate=20000", "seed=5", "until_input=1"]);
    let victim = temp_path("link.victim");
    std::fs::write(&victim, b"precious").unwrap();
    let link = temp_path("link.snap");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let (ok, out, err) = api(&sock, &["snapshot", "--to", link.to_str().unwrap()]);
    assert!(!ok && err.contains("link.snap is a symbolic link"), "{out}\n{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the link's target is untouched");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link is still there");
    // Refused before the VM was paused: it runs on.
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    vm.input(b"q");
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
    check_memtouch(&out, 100, 5, true);
    let _ = std::fs::remove_file(&link);
    let _ = std::fs::remove_file(&victim);
}
