//! End to end: a migration destination you can expose on a network. Mutual TLS between two
//! kumo processes (certificates made here with rcgen), refusals of a certificate from another
//! CA on both sides, a destination that drops connections that are not a kumo source and keeps
//! waiting, and plain listeners kept on loopback unless `--insecure`.
//!
//! As in migration_e2e.rs, guests run until the test types a byte on their console; deadlines
//! are only safety nets against hangs.

use kumo_testkit::pki::Pki;
use kumo_testkit::*;

use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Stdio};

/// memtouch with an API socket, running.
fn source(dir: &TestDir, tag: &str, seed: &str) -> (Kid, String) {
    let sock = dir.arg(&format!("{tag}.sock"));
    let seed = format!("seed={seed}");
    let d = Kid::spawn(&[
        "run",
        "--guest",
        "memtouch",
        "--memory",
        "64M",
        "--api-socket",
        &sock,
        "pages=3000",
        "rate=100000",
        &seed,
        "until_input=1",
    ])
    .named(tag);
    eventually(PATIENCE, || d.stdout().contains("memtouch: pages=").then_some(()));
    (d, sock)
}

fn migrate(sock: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new(kumo_bin())
        .args(["--api-socket", sock, "migrate"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (out, err) = text(&o);
    (o.status.success(), format!("{out}\n{err}"))
}

/// The source exits 0 having migrated; the destination runs the guest on: stop it and check
/// its memory against the model.
fn check_arrived(src: Kid, mut dest: Kid, seed: u64) {
    let (code, _, err) = src.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("VM migrated to"), "{err}");
    dest.stop_guest();
    let (code, out, err) = dest.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");
    check_memtouch(&out, 3000, seed, true);
}

/// Waits until `d` has dropped `n` connections, failing at once if it exits instead (as a
/// destination that takes the first connection does): its API's count, and the line that
/// says why for each (logged just after the count moves, so the count alone can come first).
fn wait_rejected(d: &mut Kid, api: &str, n: u64) {
    eventually(PATIENCE, || {
        if let Ok(Some(st)) = d.child.try_wait() {
            panic!("the destination exited ({st}) instead of waiting:\n{}", d.stderr());
        }
        let logged = d.stderr().matches("dropped a connection from").count() as u64;
        (rejected(api) == Some(n) && logged >= n).then_some(())
    });
}

/// `kumo ARGS` that must exit at once: its exit code and stderr. Fails at once if it listens.
fn exits_without_listening(args: &[&str]) -> (Option<i32>, String) {
    let mut k = Kid::spawn(args);
    eventually(PATIENCE, || {
        assert!(!k.stderr().contains("waiting for a migration"), "it listens: {}", k.stderr());
        k.child.try_wait().unwrap().map(|_| ())
    });
    let (code, _, err) = k.finish(PATIENCE);
    (code, err)
}

/// How many connections the destination has dropped (its `vm.migration`'s `received`).
fn rejected(api: &str) -> Option<u64> {
    let c = kumo_api::ApiClient::new(api);
    Some(c.migration_status().ok()?.received?.rejected)
}

#[test]
fn stray_peers_leave_the_destination_waiting_for_the_real_source() {
    if !kvm_or_skip("stray_peers_leave_the_destination_waiting_for_the_real_source") {
        return;
    }
    let dir = TestDir::new();
    let addr = format!("127.0.0.1:{}", free_port());
    let api = dir.arg("dst.sock");
    let mut dest = incoming(&format!("tcp:{addr}"), &["--api-socket", &api], "stray-dst");
    // A peer that writes junk and closes, one that connects and closes (a port scan).
    let mut junk = TcpStream::connect(&addr).unwrap();
    junk.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    drop(junk);
    drop(TcpStream::connect(&addr).unwrap());
    wait_rejected(&mut dest, &api, 2);
    let err = dest.stderr();
    assert!(err.contains("dropped a connection from") && err.contains("not a kumo migration stream"), "{err}");
    assert!(err.contains("closed before sending a whole stream header"), "{err}");
    let (src, sock) = source(&dir, "stray-src", "21");
    let (ok, out) = migrate(&sock, &["--to", &format!("tcp:{addr}")]);
    assert!(ok, "{out}\ndest:\n{}", dest.stderr());
    check_arrived(src, dest, 21);
}

#[test]
fn tls_migration_between_two_kumo_processes() {
    if !kvm_or_skip("tls_migration_between_two_kumo_processes") {
        return;
    }
    let dir = TestDir::new();
    let pki = Pki::new("kumo migration CA");
    let dst_tls = pki.dir(&dir.path("dst-tls"), &["localhost", "127.0.0.1"]);
    let src_tls = pki.dir(&dir.path("src-tls"), &["source.example"]);
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dest = incoming(&addr, &["--tls-dir", &dst_tls], "tls-dst");
    assert!(dest.stderr().contains("(mutual TLS,"), "{}", dest.stderr());
    let (src, sock) = source(&dir, "tls-src", "22");
    // zerocopy hands pages to the kernel unencrypted: refused, and the VM runs on.
    let (ok, out) = migrate(&sock, &["--to", &addr, "--tls-dir", &src_tls, "--engine", "zerocopy"]);
    assert!(!ok && out.contains("cannot run over TLS"), "{out}");
    // A name the destination's certificate does not carry: refused by the source.
    let (ok, out) = migrate(&sock, &["--to", &addr, "--tls-dir", &src_tls, "--tls-server-name", "other.example"]);
    assert!(!ok && out.contains("NotValidForName"), "{out}");
    let (ok, out) =
        migrate(&sock, &["--to", &addr, "--tls-dir", &src_tls, "--tls-server-name", "localhost", "--connections", "2"]);
    assert!(ok, "{out}\ndest:\n{}", dest.stderr());
    check_arrived(src, dest, 22);
}

#[test]
fn a_certificate_from_another_ca_is_refused_by_both_sides() {
    if !kvm_or_skip("a_certificate_from_another_ca_is_refused_by_both_sides") {
        return;
    }
    let dir = TestDir::new();
    let (good, other) = (Pki::new("kumo migration CA"), Pki::new("someone else's CA"));
    let dst_tls = good.dir(&dir.path("dst-tls"), &["127.0.0.1"]);
    let src_tls = good.dir(&dir.path("src-tls"), &["source.example"]);
    let stranger = other.dir(&dir.path("stranger"), &["source.example"]);
    // Trusts the destination, but its own certificate is another CA's.
    let impostor = other.dir(&dir.path("impostor"), &["source.example"]);
    std::fs::copy(dir.path("dst-tls/ca.pem"), dir.path("impostor/ca.pem")).unwrap();

    // A destination made empty first, told to receive over TLS through its API.
    let api = dir.arg("dst.sock");
    let mut dest = Kid::spawn(&["run", "--api-socket", &api]).named("ca-dst");
    eventually(PATIENCE, || dest.stderr().contains("no VM yet").then_some(()));
    let port = free_port();
    let addr = format!("tcp:127.0.0.1:{port}");
    let o = kumo(&["--api-socket", &api, "receive-migration", "--from", &addr, "--tls-dir", &dst_tls]);
    assert!(o.status.success(), "{:?}", text(&o));
    let (src, sock) = source(&dir, "ca-src", "23");

    // The source does not trust the destination's certificate: it says so, and the
    // destination sees the handshake ended.
    let (ok, out) = migrate(&sock, &["--to", &addr, "--tls-dir", &stranger]);
    assert!(
        !ok && out.contains("the destination's certificate is not accepted") && out.contains("UnknownIssuer"),
        "{out}"
    );
    wait_rejected(&mut dest, &api, 1);
    assert!(dest.stderr().contains("the source ended the TLS handshake"), "{}", dest.stderr());

    // The destination does not trust the source's certificate: it says so, and the source
    // learns that the destination ended the handshake.
    let (ok, out) = migrate(&sock, &["--to", &addr, "--tls-dir", &impostor]);
    assert!(!ok && out.contains("the destination ended the TLS handshake"), "{out}");
    wait_rejected(&mut dest, &api, 2);
    let err = dest.stderr();
    assert!(err.contains("the source's certificate is not accepted") && err.contains("UnknownIssuer"), "{err}");

    // A plain source to a TLS destination: refused too.
    let (ok, out) = migrate(&sock, &["--to", &addr]);
    assert!(!ok && out.contains("not a kumo migration destination") && out.contains("TLS directory"), "{out}");
    wait_rejected(&mut dest, &api, 3);
    assert!(dest.stderr().contains("does not speak TLS"), "{}", dest.stderr());

    // The VM ran on at the source through all of it, and the right source gets through.
    let (ok, out) = migrate(&sock, &["--to", &addr, "--tls-dir", &src_tls]);
    assert!(ok, "{out}\ndest:\n{}", dest.stderr());
    check_arrived(src, dest, 23);
}

#[test]
fn a_plain_listener_off_loopback_needs_insecure() {
    let port = free_port().to_string();
    let addr = format!("tcp:0.0.0.0:{port}");
    let (code, err) = exits_without_listening(&["run", "--incoming", &addr]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("refusing a plain-TCP migration listener") && err.contains("--insecure"), "{err}");
    assert!(err.contains("--tls-dir"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    if !kvm_or_skip("a_plain_listener_off_loopback_needs_insecure (the API's and --insecure's part)") {
        return;
    }
    // The same through the API of an empty VMM: a 400 naming the fix.
    let dir = TestDir::new();
    let api = dir.arg("e.sock");
    let empty = Kid::spawn(&["run", "--api-socket", &api]).named("empty");
    eventually(PATIENCE, || empty.stderr().contains("no VM yet").then_some(()));
    let (code, err) = exits_without_listening(&["--api-socket", &api, "receive-migration", "--from", &addr]);
    assert!(code != Some(0) && err.contains("--insecure"), "{err}");
    assert!(empty.stderr().contains("no VM yet") && !empty.stderr().contains("waiting for a migration"));
    // With --insecure the operator takes the risk: it listens.
    let d = incoming(&addr, &["--insecure"], "insecure-dst");
    drop(d);
}
