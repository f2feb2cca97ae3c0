//! End to end: live migration between kumo processes, checked by the guest's own memory
//! checksum against the reference model.
//!
//! No test depends on a duration: guests write (or hold their memory) until the test types a
//! byte on their console (memtouch `until_input=1` / `hold_input=1`), and then report how many
//! writes they made, so the model's checksum is computed for exactly that count. Deadlines
//! below are only safety nets against hangs.

use kumo_testkit::net::Netns;
use kumo_testkit::*;

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kumo_migration::format::{self, Encoder, Reply};

/// A `kumo` process whose stdin is the guest's console; its output is collected as it runs.
type Vmp = Kid;

fn spawn_logged(args: &[&str], tag: &str) -> Vmp {
    spawn_logged_in(None, args, tag)
}

/// `kumo ARGS`, inside network namespace `netns` if given. `tag` names the process in failures.
fn spawn_logged_in(netns: Option<&str>, args: &[&str], tag: &str) -> Vmp {
    let argv = [vec![kumo_bin().display().to_string()], sv(args)].concat();
    Kid::start_in(netns, &argv).unwrap_or_else(|e| panic!("{e}")).named(tag)
}

/// A destination: `kumo run --incoming ADDR [--api-socket API]`, waited for until it listens.
fn incoming_api(addr: &str, tag: &str, api: Option<&str>) -> Vmp {
    match api {
        Some(a) => incoming(addr, &["--api-socket", a], tag),
        None => incoming(addr, &[], tag),
    }
}

/// Starts memtouch with an API socket and waits until it runs.
fn source(tag: &str, mem: &str, guest_args: &[&str]) -> (Vmp, String) {
    let sock = temp_path(&format!("{tag}.sock")).to_str().unwrap().to_string();
    let mut args = vec!["run", "--guest", "memtouch", "--memory", mem, "--api-socket", &sock];
    args.extend_from_slice(guest_args);
    let d = spawn_logged(&args, tag);
    eventually(PATIENCE, || d.stdout().contains("memtouch: pages=").then_some(()));
    (d, sock)
}

/// A source whose migration succeeded: exits 0, saying where the VM went.
fn assert_migrated_away(src: Vmp) -> String {
    let (code, out, err) = src.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("VM migrated to"), "{err}");
    out
}

#[test]
fn a_loaded_guest_migrates_with_every_engine() {
    if !kvm_or_skip("a_loaded_guest_migrates_with_every_engine") {
        return;
    }
    for (engine, conns) in [("serial", "1"), ("overlap", "1"), ("overlap", "2"), ("zerocopy", "1"), ("zerocopy", "2")] {
        let tag = format!("eng-{engine}-{conns}");
        let addr = format!("tcp:127.0.0.1:{}", free_port());
        let mut dest = incoming_api(&addr, &format!("{tag}-dst"), None);
        // Writes at 250,000 pages/s until told to stop: under load whenever it migrates.
        let (src, sock) =
            source(&format!("{tag}-src"), "64M", &["pages=4000", "rate=250000", "seed=9", "until_input=1"]);
        let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", engine, "--connections", conns]);
        assert!(ok, "{engine}: migrate failed:\n{out}\n{err}\nsource:\n{}\ndest:\n{}", src.stderr(), dest.stderr());
        assert!(out.contains("migrated to") && out.contains("downtime"), "{out}");
        // stderr is not a terminal here: progress comes as plain lines.
        assert!(err.contains("kumo: migration started") && err.contains("kumo: round 0 done"), "{err}");
        assert_migrated_away(src);
        dest.stop_guest();
        let (dcode, dout, derr) = dest.wait();
        assert_eq!(dcode, Some(0), "{engine}: {dout}\n{derr}");
        let writes = check_memtouch(&dout, 4000, 9, true);
        assert!(writes > 0, "{dout}");
    }
}

#[test]
fn local_migration_shares_memory() {
    if !kvm_or_skip("local_migration_shares_memory") {
        return;
    }
    let addr = format!("unix:{}", temp_path("local-mig.sock").display());
    let mut dest = incoming_api(&addr, "local-dst", None);
    let (src, sock) =
        source("local-src", "64M", &["--shared-memory", "pages=4000", "rate=200000", "seed=4", "until_input=1"]);
    assert!(!vm_info(&sock).memory_private);
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "local"]);
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    assert_migrated_away(src);
    dest.stop_guest();
    let (dcode, dout, derr) = dest.wait();
    assert_eq!(dcode, Some(0), "{derr}");
    assert!(derr.contains("memory shared, not copied"), "{derr}");
    check_memtouch(&dout, 4000, 4, true);
}

/// Private memory, kumo's default: guest RAM in no file. The local engine, which hands that
/// file over, is refused with the reason (and the flag that gives a file) and the VM runs on;
/// a network engine takes it, the destination's RAM is private too (its own local hop is
/// refused the same way), and the guest's memory is exactly what it wrote.
#[test]
fn private_memory_migrates_over_the_network_but_not_locally() {
    if !kvm_or_skip("private_memory_migrates_over_the_network_but_not_locally") {
        return;
    }
    let dir = TestDir::new();
    let (src, sock) =
        source("priv-src", "64M", &["pages=4000", "rate=200000", "seed=6", "report_ms=5", "until_input=1"]);
    assert!(vm_info(&sock).memory_private, "private by default");
    let nowhere = format!("unix:{}", dir.arg("nobody.sock"));
    let (ok, out, err) = migrate(&sock, &["--to", &nowhere, "--engine", "local"]);
    assert!(
        !ok && err.contains("private") && err.contains("--shared-memory"),
        "the local engine is refused:\n{out}\n{err}"
    );
    let writes = progress_writes(&src.stdout()).last().copied().unwrap_or(0);
    wait_for_writes(&src, writes + 1);

    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dsock = dir.arg("priv-dst.sock");
    let mut dest = incoming_api(&addr, "priv-dst", Some(&dsock));
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "zerocopy", "--connections", "2"]);
    assert!(ok, "{out}\n{err}\nsource:\n{}\ndest:\n{}", src.stderr(), dest.stderr());
    assert_migrated_away(src);
    eventually(PATIENCE, || (vm_state(&dsock).as_deref() == Some("running")).then_some(()));
    assert!(vm_info(&dsock).memory_private, "the destination made its memory private");
    let (ok, out, err) = migrate(&dsock, &["--to", &nowhere, "--engine", "local"]);
    assert!(!ok && err.contains("private"), "the destination's memory is private too:\n{out}\n{err}");
    dest.stop_guest();
    let (code, dout, derr) = dest.wait();
    assert_eq!(code, Some(0), "{derr}");
    check_memtouch(&dout, 4000, 6, true);
}

#[test]
fn an_idle_guest_keeps_its_memory() {
    if !kvm_or_skip("an_idle_guest_keeps_its_memory") {
        return;
    }
    let addr = format!("unix:{}", temp_path("idle-mig.sock").display());
    let mut dest = incoming_api(&addr, "idle-dst", None);
    let (src, sock) = source("idle-src", "128M", &["pages=8000", "writes=30000", "seed=2", "hold_input=1"]);
    eventually(PATIENCE, || src.stdout().contains("memtouch: checksum=").then_some(()));
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "overlap"]);
    assert!(ok, "{out}\n{err}");
    assert_migrated_away(src);
    dest.stop_guest();
    let (dcode, dout, _) = dest.wait();
    assert_eq!(dcode, Some(0));
    let want = kumo_guests::memtouch::expected_checksum(8000, 30000, 2, true);
    assert_eq!(hex_field(&dout, "checksum_after_hold"), Some(want), "{dout}");
}

/// The pages (all, zero) a `kumo migrate` line reports: `... 131075 pages (130411 zero), ...`.
fn pages_and_zero(out: &str) -> (u64, u64) {
    let line = out.lines().find(|l| l.starts_with("migrated to")).unwrap_or_else(|| panic!("{out}"));
    let (head, tail) = line.split_once(" pages (").unwrap_or_else(|| panic!("{line}"));
    let pages = head.rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    let zero = tail.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    (pages, zero)
}

/// A prepared destination has all of guest memory faulted in, so the VM's next hop finds every
/// page present: the zeros among them go as runs of page numbers, and the guest's memory is
/// still exactly what it wrote.
#[test]
fn a_second_hop_sends_the_zero_memory_as_runs() {
    if !kvm_or_skip("a_second_hop_sends_the_zero_memory_as_runs") {
        return;
    }
    let (src, sock) = source("zero-src", "128M", &["pages=1000", "writes=3000", "seed=6", "hold_input=1"]);
    eventually(PATIENCE, || src.stdout().contains("memtouch: checksum=").then_some(()));
    let hop = |from: &str, tag: &str| {
        let addr = format!("tcp:127.0.0.1:{}", free_port());
        let api = temp_path(&format!("{tag}-api.sock")).to_str().unwrap().to_string();
        let next = incoming(&addr, &["--memory", "128M", "--api-socket", &api], tag);
        let (ok, out, err) = migrate(from, &["--to", &addr, "--engine", "zerocopy", "--connections", "2"]);
        assert!(ok, "{tag}: {out}\n{err}\n{}", next.stderr());
        eventually(PATIENCE, || std::path::Path::new(&api).exists().then_some(()));
        (next, api, pages_and_zero(&out))
    };
    let (first, api, (pages1, _)) = hop(&sock, "zero-hop1");
    assert_migrated_away(src);
    // The first hop sends the pages the guest and kumo touched, a small part of 32,768.
    assert!(pages1 < 16_384, "{pages1}");
    let (mut second, _, (pages2, zero2)) = hop(&api, "zero-hop2");
    assert_migrated_away(first);
    assert!(pages2 >= 32_768 && zero2 >= 32_768 - pages1, "{pages2} pages, {zero2} zero, first hop {pages1}");
    second.stop_guest();
    let (code, out, err) = second.wait();
    assert_eq!(code, Some(0), "{err}");
    let want = kumo_guests::memtouch::expected_checksum(1000, 3000, 6, true);
    assert_eq!(hex_field(&out, "checksum_after_hold"), Some(want), "{out}");
}

#[test]
fn twenty_migrations_in_a_row() {
    if !kvm_or_skip("twenty_migrations_in_a_row") {
        return;
    }
    // One VM hops through 20 kumo processes while it writes; the last one stops it.
    let (first, mut sock) = source("hop-src", "64M", &["pages=2000", "rate=100000", "seed=3", "until_input=1"]);
    let mut prev = first;
    for hop in 0..20 {
        let addr = format!("unix:{}", temp_path(&format!("hop{hop}.sock")).display());
        let api = temp_path(&format!("hop{hop}-api.sock")).to_str().unwrap().to_string();
        let next = incoming_api(&addr, &format!("hop{hop}"), Some(&api));
        let engine = ["serial", "overlap", "zerocopy"][hop % 3];
        let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", engine]);
        assert!(ok, "hop {hop} ({engine}) failed:\n{out}\n{err}\nnext:\n{}", next.stderr());
        assert_migrated_away(prev);
        eventually(PATIENCE, || std::path::Path::new(&api).exists().then_some(()));
        prev = next;
        sock = api;
    }
    prev.stop_guest();
    let (code, out, err) = prev.wait();
    assert_eq!(code, Some(0), "{err}");
    check_memtouch(&out, 2000, 3, true);
}

/// A fake destination on a TCP port: accepts one migration, answers the handshake, then does
/// what `after` says with the connection.
fn fake_destination(
    after: impl FnOnce(std::net::TcpStream, Encoder) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp:{}", l.local_addr().unwrap());
    let t = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        format::read_header(&mut c).unwrap();
        let mut enc = Encoder::new();
        let mut out = Vec::new();
        enc.reply(&mut out, &Reply::Accepted);
        enc.reply(&mut out, &Reply::Ready);
        c.write_all(&out).unwrap();
        after(c, enc);
    });
    (addr, t)
}

#[test]
fn the_source_runs_on_when_the_receiver_dies() {
    if !kvm_or_skip("the_source_runs_on_when_the_receiver_dies") {
        return;
    }
    // The receiver takes the first bytes of the stream, whatever they are (round 0 may be a
    // single batch smaller than any fixed amount), then its process "dies": the connection
    // drops with data unread.
    let (addr, fake) = fake_destination(|mut c, _| {
        let mut buf = vec![0u8; 64 << 10];
        assert!(c.read(&mut buf).unwrap() > 0, "the source sent nothing after Ready");
    });
    let (mut src, sock) =
        source("die-src", "256M", &["pages=20000", "rate=500000", "seed=8", "report_ms=50", "until_input=1"]);
    // A guest that dirties its pages: the migration must be in its rounds, not committing.
    wait_for_writes(&src, 100_000);
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "serial"]);
    fake.join().unwrap();
    assert!(!ok, "migration must fail when the receiver dies:\n{out}");
    assert!(err.contains("migration failed"), "{err}");
    // The source is still running and finishes its work with intact memory.
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    src.stop_guest();
    let (code, sout, serr) = src.wait();
    assert_eq!(code, Some(0), "{serr}");
    assert!(!serr.contains("migrated"), "{serr}");
    check_memtouch(&sout, 20000, 8, true);
}

#[test]
fn a_destination_that_stops_taking_data_fails_the_migration_and_the_source_runs_on() {
    if !kvm_or_skip("a_destination_that_stops_taking_data_fails_the_migration_and_the_source_runs_on") {
        return;
    }
    let (mut src, sock) =
        source("stall-src", "256M", &["pages=20000", "rate=500000", "seed=5", "report_ms=50", "until_input=1"]);
    // A guest that dirties its pages: the migration must be in its rounds, not committing.
    wait_for_writes(&src, 100_000);
    for engine in ["overlap", "zerocopy"] {
        // Says Ready, then reads nothing more (a stopped process), until the test is done.
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let (addr, fake) = fake_destination(move |c, _| {
            let _ = done_rx.recv();
            drop(c);
        });
        let (ok, _, err) = migrate(&sock, &["--to", &addr, "--engine", engine, "--progress-timeout-ms", "1000"]);
        done_tx.send(()).unwrap();
        fake.join().unwrap();
        assert!(!ok, "{engine}");
        assert!(err.contains("took no data") || err.contains("no reply"), "{engine}: {err}");
        assert_eq!(vm_state(&sock).as_deref(), Some("running"), "{engine}");
    }
    src.stop_guest();
    let (code, sout, serr) = src.wait();
    assert_eq!(code, Some(0), "{serr}");
    check_memtouch(&sout, 20000, 5, true);
}

#[test]
fn a_stopped_or_foreign_peer_is_rejected_at_the_handshake() {
    if !kvm_or_skip("a_stopped_or_foreign_peer_is_rejected_at_the_handshake") {
        return;
    }
    let (mut src, sock) = source("peer-src", "64M", &["pages=1000", "rate=100000", "until_input=1"]);
    // A kumo destination that is stopped (SIGSTOP): the kernel still accepts the connection.
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dest = incoming_api(&addr, "peer-stopped", None);
    let pid = dest.id() as libc::pid_t;
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let (ok, _, err) = migrate(&sock, &["--to", &addr]);
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(!ok);
    assert!(err.contains("not a kumo migration destination") && err.contains("no answer"), "{err}");
    drop(dest);
    // Not kumo at all: a server that answers in HTTP.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http = format!("tcp:{}", l.local_addr().unwrap());
    let t = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let _ = c.read(&mut [0u8; 256]);
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        // Hold the connection: the source must not wait for it to close.
        std::thread::sleep(Duration::from_secs(1));
    });
    let (ok, _, err) = migrate(&sock, &["--to", &http]);
    t.join().unwrap();
    assert!(!ok);
    assert!(err.contains("not a kumo migration destination"), "{err}");
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    src.stop_guest();
    let (code, sout, _) = src.wait();
    assert_eq!(code, Some(0));
    check_memtouch(&sout, 1000, 1, true);
}

/// Waits until the guest reported `n` writes: a migration that must still be running when an
/// event arrives needs a guest that dirties its pages, however slowly it booted (5 random
/// writes per page touch nearly all of them).
fn wait_for_writes(src: &Vmp, n: u64) {
    eventually(PATIENCE, || (progress_writes(&src.stdout()).into_iter().max() >= Some(n)).then_some(()));
}

/// The `writes=` of memtouch's progress lines in `out`.
fn progress_writes(out: &str) -> Vec<u64> {
    // Complete lines only: the console arrives a byte at a time (`writes=12` of `writes=1234`).
    let complete = &out[..out.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .filter(|l| l.starts_with("memtouch: progress"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("writes=")).and_then(|v| v.parse().ok()))
        .collect()
}

#[test]
fn pause_resume_and_a_second_migration_are_refused_while_migrating() {
    if !kvm_or_skip("pause_resume_and_a_second_migration_are_refused_while_migrating") {
        return;
    }
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let mut dest = incoming_api(&addr, "hammer-dst", None);
    let (src, sock) = source(
        "hammer-src",
        "512M",
        &["pages=60000", "mode=seq", "seed=987654321", "rate=50000", "report_ms=2", "until_input=1"],
    );
    // A client hammering the API from the moment it sees the migration running until it ends.
    let done = Arc::new(AtomicBool::new(false));
    let hammer = {
        let (done, sock) = (done.clone(), sock.clone());
        std::thread::spawn(move || {
            let c = kumo_api::ApiClient::new(&sock).with_timeout(Duration::from_secs(30));
            let body = serde_json::json!({"to": "tcp:127.0.0.1:1"});
            let mut answers: Vec<(String, u16)> = Vec::new();
            let running = || matches!(c.migration_status().map(|s| serde_json::to_value(s).unwrap()), Ok(v) if v["state"] == "running");
            while !done.load(Ordering::Acquire) && !running() {}
            while !done.load(Ordering::Acquire) {
                for (path, b) in [
                    ("/api/v1/vm.resume", None),
                    ("/api/v1/vm.pause", None),
                    ("/api/v1/vm.send-migration", Some(&body)),
                ] {
                    match c.request("PUT", path, b) {
                        Ok((status, _)) => answers.push((path.to_string(), status)),
                        Err(_) => return answers, // the source has ended
                    }
                }
            }
            answers
        })
    };
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "overlap"]);
    done.store(true, Ordering::Release);
    let answers = hammer.join().unwrap();
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    eprintln!("hammer: {} answers during the migration", answers.len());
    // During the migration, and after it (the VM has moved), nothing may pause, resume or
    // migrate this copy.
    for (path, status) in &answers {
        assert!(*status >= 400, "{path} answered {status} during a migration");
    }
    let sout = assert_migrated_away(src);
    dest.stop_guest();
    let (dcode, dout, derr) = dest.wait();
    assert_eq!(dcode, Some(0), "{derr}");
    check_memtouch(&dout, 60000, 987654321, false);
    // The guest never ran in two places: the source's last progress is no later than where
    // the destination's starts.
    let (s, d) = (progress_writes(&sout), progress_writes(&dout));
    if let (Some(smax), Some(dmin)) = (s.iter().max(), d.iter().min()) {
        assert!(smax <= dmin, "source reached writes={smax}, destination started at writes={dmin}");
    }
}

#[test]
fn a_paused_vm_migrates_and_arrives_paused() {
    if !kvm_or_skip("a_paused_vm_migrates_and_arrives_paused") {
        return;
    }
    let addr = format!("unix:{}", temp_path("paused-mig.sock").display());
    let api = temp_path("paused-dst-api.sock").to_str().unwrap().to_string();
    let mut dest = incoming_api(&addr, "paused-dst", Some(&api));
    let (src, sock) = source("paused-src", "64M", &["pages=3000", "rate=100000", "seed=11", "until_input=1"]);
    assert!(kumo(&["--api-socket", &sock, "pause"]).status.success());
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "zerocopy"]);
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    assert_migrated_away(src);
    eventually(PATIENCE, || vm_state(&api));
    assert_eq!(vm_state(&api).as_deref(), Some("paused"), "it left paused, so it arrives paused");
    assert!(kumo(&["--api-socket", &api, "resume"]).status.success());
    assert_eq!(vm_state(&api).as_deref(), Some("running"));
    dest.stop_guest();
    let (code, dout, derr) = dest.wait();
    assert_eq!(code, Some(0), "{derr}");
    check_memtouch(&dout, 3000, 11, true);
}

#[test]
fn garbage_sent_to_a_destination_is_answered_and_dropped() {
    if !kvm_or_skip("garbage_sent_to_a_destination_is_answered_and_dropped") {
        return;
    }
    let port = free_port();
    let dest = incoming_api(&format!("tcp:127.0.0.1:{port}"), "garbage-dst", None);
    // Each garbage sender is told why; the destination keeps waiting, up to its bound.
    for _ in 0..kumo_migration_engine::MAX_BAD_CONNECTIONS {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"this is not a kumo migration stream").unwrap();
        match format::ReplyReader::new(s).next_reply().unwrap() {
            Reply::Failed(why) => assert!(why.to_lowercase().contains("magic"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    let (code, _, err) = dest.wait();
    assert_eq!(code, Some(1));
    assert!(err.contains("incoming migration failed: gave up after 16 connections"), "{err}");
    assert!(err.to_lowercase().contains("magic") && !err.contains("panicked"), "{err}");
}

#[test]
fn a_dry_run_predicts_the_migration() {
    if !kvm_or_skip("a_dry_run_predicts_the_migration") {
        return;
    }
    // The model needs the dirty-page curve to bend within the window: its time constant is
    // pages / rate = 0.2 s here, and stays well inside 3 s even when a busy host slows the
    // guest several times over (a 20,000-page set at 200,000 writes/s did not level off
    // within 1.5 s on a fully loaded 2-core host).
    let (src, sock) = source("dry-src", "128M", &["pages=4000", "rate=20000", "until_input=1"]);
    let (ok, out, err) = migrate(&sock, &["--dry-run", "--estimate-ms", "3000"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("dirty-page model: M =") && out.contains("predicted"), "{out}");
    // Without --measure-link nothing is measured: the prediction is at the assumed 1 GB/s.
    assert!(out.contains("predicted at 244141 pages/s"), "{out}");
    // With it, at this host's loopback TCP bandwidth.
    let (ok, out, err) = migrate(&sock, &["--dry-run", "--estimate-ms", "3000", "--measure-link"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("predicted at") && !out.contains("predicted at 244141 pages/s"), "{out}");
    // The source was not moved and still answers.
    assert!(kumo(&["--api-socket", &sock, "info"]).status.success());
    assert!(kumo(&["--api-socket", &sock, "shutdown"]).status.success());
    assert_eq!(src.wait().0, Some(0));
}

#[test]
fn bad_migrate_requests_are_refused() {
    if !kvm_or_skip("bad_migrate_requests_are_refused") {
        return;
    }
    let (src, sock) = source("bad-src", "64M", &["pages=100", "until_input=1"]);
    for (args, want) in [
        (&["--to", "udp:1.2.3.4:5"][..], "tcp:HOST:PORT or unix:PATH"),
        (&["--to", "tcp:127.0.0.1:1", "--engine", "warp"][..], "invalid value 'warp'"),
        (&["--to", "tcp:127.0.0.1:1", "--max-bandwidth", "64K"][..], "at least 1000000 bytes/s"),
        (&["--to", "tcp:127.0.0.1:1", "--connections", "0"][..], "connections must be 1..="),
        (&["--to", "tcp:127.0.0.1:1", "--engine", "serial", "--connections", "2"][..], "one connection"),
        (&[][..], "needs --to"),
        (&["--to", "tcp:127.0.0.1:1", "--measure-link"][..], "--dry-run"),
    ] {
        let (ok, out, err) = migrate(&sock, args);
        assert!(!ok, "{args:?}: {out}");
        assert!(err.contains(want), "{args:?}: want `{want}` in {err}");
    }
    // Nothing listens there: the migration fails, the VM runs on.
    let (ok, _, err) = migrate(&sock, &["--to", &format!("tcp:127.0.0.1:{}", free_port())]);
    assert!(!ok && err.contains("cannot connect"), "{err}");
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    kumo(&["--api-socket", &sock, "shutdown"]);
    assert_eq!(src.wait().0, Some(0));
}

#[test]
fn migration_between_two_network_namespaces() {
    if !kvm_or_skip("migration_between_two_network_namespaces") {
        return;
    }
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("cannot create the test namespaces in CI: {e}")
        }
        Err(e) => {
            eprintln!("skipping migration_between_two_network_namespaces: {e}");
            return;
        }
    };
    // Destination "host" B listens on its own address; source "host" A runs the VM.
    let mut dest = spawn_logged_in(
        Some(&ns.b),
        &["run", "--incoming", "tcp:10.77.0.2:4444", "--insecure", "--memory", "64M"],
        "netns-dst",
    );
    eventually(PATIENCE, || dest.stderr().contains("waiting for a migration").then_some(()));
    let sock = temp_path("netns-src.sock").to_str().unwrap().to_string();
    let src = spawn_logged_in(
        Some(&ns.a),
        &[
            "run",
            "--guest",
            "memtouch",
            "--memory",
            "64M",
            "--api-socket",
            &sock,
            "pages=4000",
            "rate=200000",
            "seed=6",
            "until_input=1",
        ],
        "netns-src",
    );
    eventually(PATIENCE, || src.stdout().contains("memtouch: pages=").then_some(()));
    // The API socket is a file, reachable from the root namespace; the stream goes A -> B.
    let (ok, o, e) = migrate(&sock, &["--to", "tcp:10.77.0.2:4444", "--engine", "overlap"]);
    assert!(ok, "{o}\n{e}\n{}", dest.stderr());
    assert_eq!(src.wait().0, Some(0));
    dest.stop_guest();
    let (code, dout, derr) = dest.wait();
    assert_eq!(code, Some(0), "{derr}");
    check_memtouch(&dout, 4000, 6, true);
}

/// `kumo migrate ARGS` in the background, stdout and stderr in files.
fn spawn_migrate(sock: &str, args: &[&str], tag: &str) -> Vmp {
    let mut all = vec!["--api-socket", sock, "migrate"];
    all.extend_from_slice(args);
    spawn_logged(&all, tag)
}

/// The JSON lines `kumo migrate --json` printed so far (a line still being written is skipped).
fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Whether a JSON line is a progress event sent before its round's end.
fn is_mid_round(e: &serde_json::Value) -> bool {
    e["event"] == "progress" && e["pages_sent"].as_u64() < e["round_pages"].as_u64()
}

/// Whether a JSON line is a progress event of round 0 sent before the round's end.
fn is_round0_progress(e: &serde_json::Value) -> bool {
    is_mid_round(e) && e["round"] == 0
}

#[test]
fn the_event_stream_shows_progress_within_round_0() {
    if !kvm_or_skip("the_event_stream_shows_progress_within_round_0") {
        return;
    }
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dsock = temp_path("events-dst.sock").to_str().unwrap().to_string();
    let mut dest = incoming_api(&addr, "events-dst", Some(&dsock));
    // An idle guest (it holds its memory) of ~16 MiB sent at 8 MiB/s: the cap makes round 0
    // last seconds whatever the machine, so progress events must come within it.
    let (src, sock) = source("events-src", "64M", &["pages=4000", "writes=20000", "seed=5", "hold_input=1"]);
    eventually(PATIENCE, || src.stdout().contains("memtouch: checksum=").then_some(()));
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--max-bandwidth", "8M", "--json"]);
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    // Every line is JSON: the events, the report last.
    let lines: Vec<serde_json::Value> =
        out.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    let events: Vec<&str> = lines.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(events.first(), Some(&"started"), "{out}");
    let round0_end = lines.iter().position(|e| e["event"] == "round" && e["round"] == 0).expect("round 0 ends");
    let within = lines[..round0_end].iter().filter(|e| is_round0_progress(e)).count();
    assert!(within > 0, "no progress event within round 0:\n{out}");
    for e in lines.iter().filter(|e| e["event"] == "progress") {
        assert_eq!(e["bytes_sent"].as_u64(), e["pages_sent"].as_u64().map(|p| p * 4096), "{e}");
        assert!(e["mb_per_s"].as_f64().is_some(), "{e}");
    }
    assert!(events.contains(&"completed"), "{out}");
    let report = lines.last().unwrap();
    assert!(report["event"].is_null() && report["downtime_ms"].as_f64().is_some(), "report last: {report}");
    assert_eq!(report["to"], addr.as_str());
    assert_migrated_away(src);
    // The destination's API says how the VM came.
    let st = serde_json::to_value(kumo_api::ApiClient::new(&dsock).migration_status().unwrap()).unwrap();
    assert_eq!(st["state"], "received", "{st}");
    assert!(st["received"]["pages"].as_u64() > Some(0), "{st}");
    dest.stop_guest();
    let (dcode, dout, _) = dest.wait();
    assert_eq!(dcode, Some(0));
    let want = kumo_guests::memtouch::expected_checksum(4000, 20000, 5, true);
    assert_eq!(hex_field(&dout, "checksum_after_hold"), Some(want), "{dout}");
}

/// Ctrl-C in `kumo migrate` cancels the migration: the source runs on (its guest keeps
/// writing and its checksum still checks), the destination exits non-zero with a clear
/// message, and the source's vm.migration says "cancelled".
#[test]
fn ctrl_c_cancels_a_migration_and_the_source_runs_on() {
    if !kvm_or_skip("ctrl_c_cancels_a_migration_and_the_source_runs_on") {
        return;
    }
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dest = incoming_api(&addr, "cancel-dst", None);
    let (mut src, sock) =
        source("cancel-src", "64M", &["pages=4000", "rate=50000", "seed=6", "report_ms=20", "until_input=1"]);
    wait_for_writes(&src, 20_000);
    // 1 MiB/s: a round of the guest's 4,000 hot pages takes many seconds, so the migration is
    // surely still running when the first progress event within a round has been printed.
    let mig = spawn_migrate(&sock, &["--to", &addr, "--max-bandwidth", "1M", "--json"], "cancel-mig");
    eventually(PATIENCE, || json_lines(&mig.stdout()).iter().any(is_mid_round).then_some(()));
    mig.signal("INT");
    let (code, out, err) = mig.wait();
    assert_ne!(code, Some(0), "{out}\n{err}");
    assert!(err.contains("migration cancelled; the VM runs on at the source"), "{err}");
    assert!(json_lines(&out).iter().any(|e| e["event"] == "cancelled"), "{out}");
    // The destination was told and exits cleanly, non-zero, with no VM left.
    let (dcode, _, derr) = dest.wait();
    assert_eq!(dcode, Some(1), "{derr}");
    assert!(derr.contains("incoming migration failed") && derr.contains("cancelled"), "{derr}");
    // The source reports it and runs on.
    let c = kumo_api::ApiClient::new(&sock);
    let st = serde_json::to_value(c.migration_status().unwrap()).unwrap();
    assert_eq!(st["state"], "cancelled", "{st}");
    assert_eq!(c.cancel_migration().unwrap_err().status(), Some(409), "nothing left to cancel");
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    let now = progress_writes(&src.stdout()).into_iter().max().unwrap_or(0);
    eventually(PATIENCE, || (progress_writes(&src.stdout()).into_iter().max() > Some(now)).then_some(()));
    src.stop_guest();
    let (code, sout, serr) = src.wait();
    assert_eq!(code, Some(0), "{serr}");
    check_memtouch(&sout, 4000, 6, true);
}

/// The cancel route does the same for an API client; a second cancel is harmless.
#[test]
fn the_cancel_route_stops_a_migration() {
    if !kvm_or_skip("the_cancel_route_stops_a_migration") {
        return;
    }
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dsock = temp_path("cancel-api-dst.sock").to_str().unwrap().to_string();
    let dest = incoming_api(&addr, "cancel-api-dst", Some(&dsock));
    // The destination's API is up before any VM exists.
    assert_eq!(vm_state(&dsock).as_deref(), Some("receiving"));
    let (mut src, sock) =
        source("cancel-api-src", "64M", &["pages=4000", "rate=50000", "seed=7", "until_input=1", "report_ms=50"]);
    // Round 0 must span several batches at the cap: the guest's 4,000 pages, touched.
    wait_for_writes(&src, 20_000);
    let c = kumo_api::ApiClient::new(&sock).with_timeout(Duration::from_secs(600));
    let req = kumo_api::MigrateRequest { max_bandwidth: Some(1 << 20), ..kumo_api::MigrateRequest::to(&addr) };
    let call = {
        let c = c.clone();
        std::thread::spawn(move || c.send_migration(&req))
    };
    eventually(PATIENCE, || {
        let st = serde_json::to_value(c.migration_status().ok()?).ok()?;
        assert!(!call.is_finished(), "the migration ended: {st}");
        st["events"].as_array()?.iter().any(is_mid_round).then_some(())
    });
    // The event stream: JSON lines from the start of the migration until it ends.
    let stream = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            c.write_all(b"GET /api/v1/vm.migration-events HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut got = String::new();
            c.read_to_string(&mut got).unwrap();
            got
        })
    };
    // Meanwhile the destination shows what has arrived.
    let d = kumo_api::ApiClient::new(&dsock);
    let got: serde_json::Value = eventually(PATIENCE, || {
        let got = serde_json::to_value(d.migration_status().ok()?).ok()?;
        (got["received"]["pages"].as_u64() > Some(0)).then_some(got)
    });
    assert_eq!(got["state"], "receiving", "{got}");
    assert_eq!(got["received"]["phase"], "receiving", "{got}");
    assert_eq!(vm_state(&dsock).as_deref(), Some("receiving"));
    assert_eq!(d.pause().unwrap_err().status(), Some(409));
    c.cancel_migration().unwrap();
    let _ = c.cancel_migration(); // 204 again, or 409 once it has ended: either way harmless
    let e = call.join().unwrap().unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("cancelled"), "{e}");
    let st = serde_json::to_value(c.migration_status().unwrap()).unwrap();
    assert_eq!(st["state"], "cancelled");
    let got = stream.join().unwrap();
    let (head, body) = got.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let lines = json_lines(body);
    assert_eq!(lines.first().map(|e| &e["event"]), Some(&serde_json::json!("started")), "{body}");
    assert!(lines.iter().any(is_mid_round), "{body}");
    assert!(lines.iter().any(|e| e["event"] == "cancelled"), "{body}");
    assert_eq!(lines.last().unwrap()["state"], "cancelled", "final status last: {body}");
    let (dcode, _, derr) = dest.wait();
    assert_eq!(dcode, Some(1), "{derr}");
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));
    src.stop_guest();
    let (code, sout, _) = src.wait();
    assert_eq!(code, Some(0));
    check_memtouch(&sout, 4000, 7, true);
}

/// An empty VMM (`kumo run --api-socket S`, nothing to boot) told by `vm.receive-migration`
/// (`kumo receive-migration`) is a destination: it answers once it listens, says `receiving`,
/// then runs the VM that arrived, on the memfd it was asked to prepare; the guest's checksum
/// checks. A second receive is refused.
#[test]
fn an_empty_vmm_told_to_receive_takes_a_migrating_vm() {
    if !kvm_or_skip("an_empty_vmm_told_to_receive_takes_a_migrating_vm") {
        return;
    }
    let dir = TestDir::new();
    let dsock = dir.arg("empty-dst.sock");
    let mut dest = spawn_logged(&["run", "--api-socket", &dsock], "empty-dst");
    eventually(PATIENCE, || vm_state(&dsock));
    assert_eq!(vm_state(&dsock).as_deref(), Some("created"));
    let addr = format!("unix:{}", dir.arg("empty-mig.sock"));
    let o = kumo(&["--api-socket", &dsock, "receive-migration", "--from", &addr, "--memory", "64M", "--shared-memory"]);
    assert!(o.status.success(), "{}\n{}", text(&o).1, dest.stderr());
    // It listens now (the answer came after that), and says so.
    eventually(PATIENCE, || dest.stderr().contains("waiting for a migration").then_some(()));
    assert_eq!(vm_state(&dsock).as_deref(), Some("receiving"));
    let d = kumo_api::ApiClient::new(&dsock);
    let st = serde_json::to_value(d.migration_status().unwrap()).unwrap();
    assert_eq!((&st["state"], &st["received"]["phase"]), (&"receiving".into(), &"listening".into()), "{st}");
    let again = kumo_api::ReceiveMigrationRequest {
        receiver_url: addr.clone(),
        memory: None,
        shared_memory: false,
        cpus: None,
        net: vec![],
        numa: vec![],
        disks: vec![],
        tls_dir: None,
        insecure: false,
    };
    assert_eq!(d.receive_migration(&again).unwrap_err().status(), Some(409));

    let (src, sock) = source("empty-src", "64M", &["pages=3000", "rate=100000", "seed=12", "until_input=1"]);
    let (ok, out, err) = migrate(&sock, &["--to", &addr]);
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    assert_migrated_away(src);
    eventually(PATIENCE, || (vm_state(&dsock).as_deref() == Some("running")).then_some(()));
    let st = serde_json::to_value(d.migration_status().unwrap()).unwrap();
    assert_eq!(st["state"], "received", "{st}");
    assert!(!vm_info(&dsock).memory_private, "it prepared a memfd, as asked");
    assert_eq!(d.receive_migration(&again).unwrap_err().status(), Some(409), "it has a VM now");
    dest.stop_guest();
    let (code, dout, derr) = dest.wait();
    assert_eq!(code, Some(0), "{derr}");
    assert!(derr.contains("migration received"), "{derr}");
    check_memtouch(&dout, 3000, 12, true);
    assert!(!std::path::Path::new(&dsock).exists(), "the API socket is removed");
}

/// An incoming migration started through the API that fails ends the VMM as `--incoming`
/// does: status 1 and the reason.
#[test]
fn a_failed_receive_through_the_api_ends_the_vmm() {
    if !kvm_or_skip("a_failed_receive_through_the_api_ends_the_vmm") {
        return;
    }
    let dir = TestDir::new();
    let dsock = dir.arg("fail-dst.sock");
    let dest = spawn_logged(&["run", "--api-socket", &dsock], "fail-dst");
    eventually(PATIENCE, || vm_state(&dsock));
    // A bad address is the request's fault: 400, and the VMM stays empty.
    let o = kumo(&["--api-socket", &dsock, "receive-migration", "--from", "udp:1.2.3.4:5"]);
    assert!(!o.status.success() && text(&o).1.contains("tcp:HOST:PORT or unix:PATH"), "{}", text(&o).1);
    assert_eq!(vm_state(&dsock).as_deref(), Some("created"));
    let port = free_port();
    let o = kumo(&["--api-socket", &dsock, "receive-migration", "--from", &format!("tcp:127.0.0.1:{port}")]);
    assert!(o.status.success(), "{}", text(&o).1);
    // A kumo stream whose VM this destination cannot build (junk is only dropped).
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let guest = format::PayloadDescription::guest("no-such-guest");
    let desc = format::VmDescription::new(1, format::Irqchip::Kernel, guest, kumo_vm::layout::ram_regions(64 << 20));
    format::write_header(&mut s, &desc).unwrap();
    let (code, _, err) = dest.wait();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("incoming migration failed") && err.contains("unknown guest"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!std::path::Path::new(&dsock).exists(), "the API socket is removed");
}

/// A stream whose VM names host resources its destination's operator did not give (a tap for
/// a NIC with no `--net`, a NIC or node the operator did not map, more queues than the given tap
/// takes, a field kumo does not know) is refused before anything is built: the source gets
/// Accepted, then a Failed reply naming why, never Ready; the destination exits 1 with the same
/// reason. No KVM needed (nothing is built); as root, the taps involved exist and none is
/// attached.
#[test]
fn a_stream_naming_resources_the_operator_did_not_give_is_refused() {
    use kumo_migration::format::{write_header, ReplyReader, VmDescription};
    let pid = std::process::id() % 100_000;
    let (victim, own, single) = (format!("h2v{pid}"), format!("h2w{pid}"), format!("h2x{pid}"));
    // As root: the stream's tap exists (single-queue, so an attached one would show its carrier).
    let taps = [&victim, &own].map(|t| kumo_testkit::net::Tap::create(t, "10.234.0.1/32"));
    let single_tap = kumo_testkit::net::Tap::create(&single, "10.234.0.2/32");
    let rooted = taps.iter().all(Result::is_ok) && single_tap.is_ok();
    if !rooted {
        eprintln!(
            "a_stream_naming_resources_the_operator_did_not_give_is_refused: no taps (not root): host checks skipped"
        );
    }
    // NICs on the source's taps, each with its queue pairs.
    let header = |taps: &[(&str, u16)]| {
        let guest = format::PayloadDescription::guest("netecho");
        let mut d = VmDescription::new(1, format::Irqchip::Kernel, guest, kumo_vm::layout::ram_regions(64 << 20));
        d.nets = taps
            .iter()
            .enumerate()
            .map(|(i, &(tap, queues))| format::NicDescription {
                mac: format!("52:54:00:00:00:{i:02x}"),
                queues,
                irq: format::NicIrqPath::Direct,
                source_backend: format::SourceBackend::Tap(tap.into()),
                offload: true,
            })
            .collect();
        d
    };
    let dir = TestDir::new();
    // What the guest sees is the stream's: such flags are one-line errors, before listening.
    let addr = format!("unix:{}", dir.arg("flags.mig"));
    for (flag, spec, want) in [
        ("--net", "tap=a,queues=2", "--net tap=a,queues=2: queues= comes from the arriving VM"),
        ("--net", "id=eth0,tap=a", "id `eth0` is not a NIC id"),
        ("--numa", "node=0,cpus=0,memory=64M", "cpus= comes from the arriving VM"),
        ("--numa", "mirror", "the arriving VM's nodes are its own"),
    ] {
        for mode in [["--incoming", addr.as_str()], ["--restore", "/nonexistent/h2.snap"]] {
            let o = kumo(&["run", mode[0], mode[1], flag, spec]);
            let (_, err) = text(&o);
            assert_eq!(o.status.code(), Some(1), "{mode:?} {flag} {spec}: {err}");
            assert!(err.contains(want) && err.trim().lines().count() == 1, "{mode:?} {flag} {spec}: {err}");
        }
    }
    let net_own = format!("id=net0,tap={own}");
    let net_single = format!("tap={single}");
    let mut cases: Vec<(&str, Vec<&str>, VmDescription, String)> = vec![
        (
            "no-net",
            vec![],
            header(&[(victim.as_str(), 1)]),
            format!("the VM's net0 (tap {victim} on its source) has no backend here: give --net id=net0,tap=NAME"),
        ),
        (
            "unmapped-net1",
            vec!["--net", &net_own],
            header(&[(own.as_str(), 1), (victim.as_str(), 1)]),
            format!("the VM's net1 (tap {victim} on its source) has no backend here"),
        ),
        (
            "extra-net",
            vec!["--net", &net_own, "--net", "tap=h2other"],
            header(&[(victim.as_str(), 1)]),
            "--net id=net1: the VM has no NIC net1 (it has net0)".into(),
        ),
        (
            "numa",
            vec!["--net", &net_own, "--numa", "node=0,host-node=0"],
            header(&[(victim.as_str(), 1)]),
            "--numa node=0: the VM has no NUMA nodes".into(),
        ),
    ];
    if rooted {
        cases.push((
            "queues",
            vec!["--net", &net_single],
            header(&[(victim.as_str(), 2)]),
            format!("net0: tap {single} cannot take 2 queue pairs: it was made without multi_queue"),
        ));
    }
    for (tag, extra, desc, want) in cases {
        let path = dir.arg(&format!("{tag}.mig"));
        let addr = format!("unix:{path}");
        let mut args = vec!["run", "--incoming", &addr];
        args.extend_from_slice(&extra);
        let dst = Kid::spawn(&args).named(tag);
        eventually(PATIENCE, || dst.stderr().contains("waiting for a migration").then_some(()));
        let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        write_header(&mut s, &desc).unwrap();
        let mut replies = ReplyReader::new(&mut s);
        assert!(matches!(replies.next_reply(), Ok(Reply::Accepted)), "{tag}: a valid header is accepted");
        match replies.next_reply() {
            Ok(Reply::Failed(why)) => assert!(why.contains(&want), "{tag}: want `{want}` in `{why}`"),
            other => panic!("{tag}: expected a Failed reply before anything is built, got {other:?}"),
        }
        if rooted {
            for t in [&victim, &own, &single] {
                let state = std::fs::read_to_string(format!("/sys/class/net/{t}/operstate")).unwrap_or_default();
                assert_ne!(state.trim(), "up", "{tag}: tap {t} was attached");
            }
        }
        // Its whole stderr, read to the end once it exited.
        let (code, _, err) = dst.wait();
        assert_eq!(code, Some(1), "{tag}: {err}");
        assert!(err.contains("incoming migration failed") && err.contains(&want), "{tag}: {err}");
        assert!(!err.contains("panicked"), "{tag}: {err}");
    }
}

/// The destination's operator binds the arriving VM's NUMA nodes to its own host nodes: the
/// nodes' vCPUs, memory and distances are the source's, their host nodes this host's (`--numa
/// node=ID[,host-node=N]`); a destination that leaves a node out refuses the VM.
#[test]
fn the_destination_binds_the_guest_nodes_to_its_own_host_nodes() {
    if !kvm_or_skip("the_destination_binds_the_guest_nodes_to_its_own_host_nodes") {
        return;
    }
    let dir = TestDir::new();
    let numa = [
        "--cpus",
        "2",
        "--numa",
        "node=0,cpus=0,memory=32M,host-node=0",
        "--numa",
        "node=1,cpus=1,memory=32M",
        "--numa-distance",
        "0:1=31",
        "until_input=1",
    ];
    let (src, sock) = source("numa-src", "64M", &numa);
    let before = kumo_api::ApiClient::new(&sock).info().unwrap().numa;
    // Node 1 unmapped: refused, the source runs on.
    let addr = format!("unix:{}", dir.arg("numa-bad.mig"));
    let bad = spawn_logged(&["run", "--incoming", &addr, "--numa", "node=0,host-node=0"], "numa-bad");
    eventually(PATIENCE, || bad.stderr().contains("waiting for a migration").then_some(()));
    let (ok, _, err) = migrate(&sock, &["--to", &addr]);
    let want = "the VM's NUMA node 1 has no --numa here";
    assert!(!ok && err.contains(want), "{err}");
    let (code, _, derr) = bad.finish(PATIENCE);
    assert_eq!(code, Some(1), "{derr}");
    assert!(derr.contains(want), "{derr}");
    assert_eq!(vm_state(&sock).as_deref(), Some("running"));

    let addr = format!("unix:{}", dir.arg("numa.mig"));
    let dsock = dir.arg("numa-dst.sock");
    let args = ["run", "--incoming", &addr, "--api-socket", &dsock, "--numa", "node=1,host-node=0", "--numa", "node=0"];
    let mut dst = spawn_logged(&args, "numa-dst");
    eventually(PATIENCE, || dst.stderr().contains("waiting for a migration").then_some(()));
    let (ok, out, err) = migrate(&sock, &["--to", &addr]);
    assert!(ok, "{out}\n{err}\n{}", dst.stderr());
    assert_migrated_away(src);
    let after = kumo_api::ApiClient::new(&dsock).info().unwrap().numa;
    let shape = |n: &[kumo_api::NumaNodeInfo]| {
        n.iter().map(|n| (n.id, n.cpus.clone(), n.memory_bytes, n.distances.clone())).collect::<Vec<_>>()
    };
    assert_eq!(shape(&after), shape(&before), "the guest's nodes are the source's");
    assert_eq!(before.iter().map(|n| n.host_node).collect::<Vec<_>>(), [Some(0), None]);
    assert_eq!(after.iter().map(|n| n.host_node).collect::<Vec<_>>(), [None, Some(0)], "this host's bindings");
    dst.stop_guest();
    let (code, _, derr) = dst.wait();
    assert_eq!(code, Some(0), "{derr}");
}
