//! End to end: live migration between kumo processes, checked by the guest's own memory
//! checksum against the reference model.

mod common;
use common::*;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

/// A `kumo run --incoming` whose stderr goes to a file, so the test can wait for it to listen.
struct Dest {
    kid: Kid,
    err: std::path::PathBuf,
    out: std::path::PathBuf,
}

fn spawn_logged(args: &[&str], tag: &str) -> Dest {
    spawn_logged_in(None, args, tag)
}

/// `kumo ARGS`, inside network namespace `netns` if given, with stdout/stderr in files.
fn spawn_logged_in(netns: Option<&str>, args: &[&str], tag: &str) -> Dest {
    let out = temp_path(&format!("{tag}.out"));
    let err = temp_path(&format!("{tag}.err"));
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(kumo_bin());
            c
        }
        None => Command::new(kumo_bin()),
    };
    let child = cmd
        .args(args)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Dest {
        kid: Kid(child),
        err,
        out,
    }
}

impl Dest {
    fn incoming(addr: &str, tag: &str, api: Option<&str>) -> Dest {
        let mut args = vec!["run", "--incoming", addr, "--timeout", "120"];
        if let Some(a) = api {
            args.extend(["--api-socket", a]);
        }
        let d = spawn_logged(&args, tag);
        eventually(Duration::from_secs(20), || {
            d.stderr().contains("waiting for a migration").then_some(())
        });
        d
    }
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
    fn wait(mut self) -> (Option<i32>, String, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.kid.0.try_wait().unwrap() {
                return (st.code(), self.stdout(), self.stderr());
            }
            assert!(
                t.elapsed() < LIMIT,
                "kumo did not exit; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn checksum_of(out: &str, key: &str) -> Option<u64> {
    field(out, &format!("memtouch: {key}"), key).and_then(|v| u64::from_str_radix(&v, 16).ok())
}

fn migrate(sock: &str, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(kumo_bin())
        .args(["--api-socket", sock, "migrate"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// Starts memtouch with an API socket and waits until it runs.
fn source(tag: &str, mem: &str, guest_args: &[&str]) -> (Dest, String) {
    let sock = temp_path(&format!("{tag}.sock"))
        .to_str()
        .unwrap()
        .to_string();
    let mut args = vec![
        "run",
        "--guest",
        "memtouch",
        "--memory",
        mem,
        "--api-socket",
        &sock,
        "--timeout",
        "120",
    ];
    args.extend_from_slice(guest_args);
    let d = spawn_logged(&args, tag);
    eventually(Duration::from_secs(20), || {
        d.stdout().contains("memtouch: pages=").then_some(())
    });
    (d, sock)
}

#[test]
fn a_loaded_guest_migrates_with_every_engine() {
    if !kvm_or_skip("a_loaded_guest_migrates_with_every_engine") {
        return;
    }
    let want = kumo_guests::memtouch::expected_checksum(4000, 500_000, 9, true);
    for (engine, conns) in [
        ("serial", "1"),
        ("overlap", "1"),
        ("overlap", "2"),
        ("zerocopy", "1"),
    ] {
        let tag = format!("eng-{engine}-{conns}");
        let addr = format!("tcp:127.0.0.1:{}", free_port());
        let dest = Dest::incoming(&addr, &format!("{tag}-dst"), None);
        // ~2 s of writes at 250,000 pages/s, migrated in the middle.
        let (src, sock) = source(
            &format!("{tag}-src"),
            "64M",
            &["pages=4000", "writes=500000", "rate=250000", "seed=9"],
        );
        std::thread::sleep(Duration::from_millis(300));
        let (ok, out, err) = migrate(
            &sock,
            &["--to", &addr, "--engine", engine, "--connections", conns],
        );
        assert!(
            ok,
            "{engine}: migrate failed:\n{out}\n{err}\nsource:\n{}\ndest:\n{}",
            src.stderr(),
            dest.stderr()
        );
        assert!(
            out.contains("migrated to") && out.contains("downtime"),
            "{out}"
        );
        let (scode, _, serr) = src.wait();
        assert_eq!(scode, Some(0), "{serr}");
        assert!(serr.contains("VM migrated to"), "{serr}");
        let (dcode, dout, derr) = dest.wait();
        assert_eq!(dcode, Some(0), "{engine}: {dout}\n{derr}");
        assert_eq!(
            checksum_of(&dout, "checksum"),
            Some(want),
            "{engine} x{conns}: checksum after migration\n{dout}"
        );
    }
}

#[test]
fn local_migration_shares_memory() {
    if !kvm_or_skip("local_migration_shares_memory") {
        return;
    }
    let addr = format!("unix:{}", temp_path("local-mig.sock").display());
    let dest = Dest::incoming(&addr, "local-dst", None);
    let (src, sock) = source(
        "local-src",
        "64M",
        &["pages=4000", "writes=400000", "rate=200000", "seed=4"],
    );
    std::thread::sleep(Duration::from_millis(300));
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "local"]);
    assert!(ok, "{out}\n{err}\n{}", dest.stderr());
    assert_eq!(src.wait().0, Some(0));
    let (dcode, dout, derr) = dest.wait();
    assert_eq!(dcode, Some(0), "{derr}");
    assert!(derr.contains("memory shared, not copied"), "{derr}");
    assert_eq!(
        checksum_of(&dout, "checksum"),
        Some(kumo_guests::memtouch::expected_checksum(
            4000, 400_000, 4, true
        ))
    );
}

#[test]
fn an_idle_guest_keeps_its_memory() {
    if !kvm_or_skip("an_idle_guest_keeps_its_memory") {
        return;
    }
    let addr = format!("unix:{}", temp_path("idle-mig.sock").display());
    let dest = Dest::incoming(&addr, "idle-dst", None);
    let (src, sock) = source(
        "idle-src",
        "128M",
        &["pages=8000", "writes=30000", "seed=2", "hold_ms=4000"],
    );
    eventually(Duration::from_secs(20), || {
        src.stdout().contains("memtouch: checksum=").then_some(())
    });
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", "overlap"]);
    assert!(ok, "{out}\n{err}");
    src.wait();
    let (dcode, dout, _) = dest.wait();
    assert_eq!(dcode, Some(0));
    let want = kumo_guests::memtouch::expected_checksum(8000, 30000, 2, true);
    assert_eq!(
        checksum_of(&dout, "checksum_after_hold"),
        Some(want),
        "{dout}"
    );
}

#[test]
fn twenty_migrations_in_a_row() {
    if !kvm_or_skip("twenty_migrations_in_a_row") {
        return;
    }
    // One VM hops through 20 kumo processes while it writes; the last one finishes it.
    let (first, mut sock) = source(
        "hop-src",
        "64M",
        &[
            "pages=2000",
            "duration_ms=600000",
            "rate=100000",
            "seed=3",
            "writes=2000000",
        ],
    );
    let mut prev = first;
    for hop in 0..20 {
        let addr = format!("unix:{}", temp_path(&format!("hop{hop}.sock")).display());
        let api = temp_path(&format!("hop{hop}-api.sock"))
            .to_str()
            .unwrap()
            .to_string();
        let next = Dest::incoming(&addr, &format!("hop{hop}"), Some(&api));
        let engine = ["serial", "overlap", "zerocopy"][hop % 3];
        let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", engine]);
        assert!(
            ok,
            "hop {hop} ({engine}) failed:\n{out}\n{err}\nnext:\n{}",
            next.stderr()
        );
        let (code, _, perr) = prev.wait();
        assert_eq!(code, Some(0), "hop {hop}: previous kumo: {perr}");
        eventually(Duration::from_secs(10), || {
            std::path::Path::new(&api).exists().then_some(())
        });
        prev = next;
        sock = api;
    }
    // 2,000,000 writes at 100,000/s: the guest finishes about 20 s after it started.
    let (code, out, err) = prev.wait();
    assert_eq!(code, Some(0), "{err}");
    let want = kumo_guests::memtouch::expected_checksum(2000, 2_000_000, 3, true);
    assert_eq!(checksum_of(&out, "checksum"), Some(want), "{out}");
}

#[test]
fn the_source_runs_on_when_the_receiver_dies() {
    if !kvm_or_skip("the_source_runs_on_when_the_receiver_dies") {
        return;
    }
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let mut dest = Dest::incoming(&addr, "die-dst", None);
    // 512 MiB touched: round 0 takes long enough to kill the receiver in the middle of it.
    let (src, sock) = source(
        "die-src",
        "1G",
        &["pages=131072", "writes=1500000", "rate=500000", "seed=8"],
    );
    std::thread::sleep(Duration::from_millis(500));
    let sock2 = sock.clone();
    let mig = std::thread::spawn(move || migrate(&sock2, &["--to", &addr, "--engine", "serial"]));
    std::thread::sleep(Duration::from_millis(400));
    dest.kid.0.kill().unwrap();
    let (ok, out, err) = mig.join().unwrap();
    assert!(!ok, "migration must fail when the receiver dies:\n{out}");
    assert!(err.contains("migration failed"), "{err}");
    // The source is still running and finishes its work with intact memory.
    let (code, sout, serr) = src.wait();
    assert_eq!(code, Some(0), "{serr}");
    assert!(!serr.contains("migrated"), "{serr}");
    assert_eq!(
        checksum_of(&sout, "checksum"),
        Some(kumo_guests::memtouch::expected_checksum(
            131072, 1_500_000, 8, true
        ))
    );
}

#[test]
fn garbage_sent_to_a_destination_is_rejected() {
    if !kvm_or_skip("garbage_sent_to_a_destination_is_rejected") {
        return;
    }
    let port = free_port();
    let dest = Dest::incoming(&format!("tcp:127.0.0.1:{port}"), "garbage-dst", None);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::io::Write::write_all(&mut s, b"this is not a kumo migration stream").unwrap();
    let (code, _, err) = dest.wait();
    assert_eq!(code, Some(1));
    assert!(
        err.contains("incoming migration failed") && err.to_lowercase().contains("magic"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_dry_run_predicts_the_migration() {
    if !kvm_or_skip("a_dry_run_predicts_the_migration") {
        return;
    }
    let (src, sock) = source(
        "dry-src",
        "128M",
        &["pages=20000", "duration_ms=600000", "rate=200000"],
    );
    let (ok, out, err) = migrate(&sock, &["--dry-run", "--estimate-ms", "1500"]);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("dirty-page model: M =") && out.contains("predicted"),
        "{out}"
    );
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
    let (src, sock) = source("bad-src", "64M", &["pages=100", "duration_ms=600000"]);
    for (args, want) in [
        (&["--to", "udp:1.2.3.4:5"][..], "tcp:HOST:PORT or unix:PATH"),
        (
            &["--to", "tcp:127.0.0.1:1", "--engine", "warp"][..],
            "unknown engine `warp`",
        ),
        (&["--to", "tcp:127.0.0.1:1", "--no-xen"][..], "no stop rule"),
        (&[][..], "needs --to"),
    ] {
        let (ok, out, err) = migrate(&sock, args);
        assert!(!ok, "{args:?}: {out}");
        assert!(err.contains(want), "{args:?}: want `{want}` in {err}");
    }
    // Nothing listens there: the migration fails, the VM runs on.
    let (ok, _, err) = migrate(&sock, &["--to", &format!("tcp:127.0.0.1:{}", free_port())]);
    assert!(!ok && err.contains("cannot connect"), "{err}");
    let info = kumo(&["--api-socket", &sock, "info"]);
    assert!(String::from_utf8_lossy(&info.stdout).contains("\"running\""));
    kumo(&["--api-socket", &sock, "shutdown"]);
    assert_eq!(src.wait().0, Some(0));
}

/// Two network namespaces joined by a veth pair: two "hosts" on this machine, with addresses
/// that exist only inside them. Needs root and iproute2; skips otherwise.
struct Netns {
    a: String,
    b: String,
}

impl Netns {
    fn create() -> Result<Netns, String> {
        let id = std::process::id() % 100_000;
        let (a, b) = (format!("kumo-a{id}"), format!("kumo-b{id}"));
        let ns = Netns {
            a: a.clone(),
            b: b.clone(),
        };
        let (va, vb) = (format!("kva{id}"), format!("kvb{id}"));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns", "add", &a],
            vec!["netns", "add", &b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", &a],
            vec!["link", "set", &vb, "netns", &b],
            vec!["-n", &a, "addr", "add", "10.77.0.1/24", "dev", &va],
            vec!["-n", &b, "addr", "add", "10.77.0.2/24", "dev", &vb],
            vec!["-n", &a, "link", "set", &va, "up"],
            vec!["-n", &b, "link", "set", &vb, "up"],
            vec!["-n", &a, "link", "set", "lo", "up"],
            vec!["-n", &b, "link", "set", "lo", "up"],
        ]
        .into_iter()
        .map(|v| v.into_iter().map(String::from).collect())
        .collect();
        for step in steps {
            let o = Command::new("ip")
                .args(&step)
                .output()
                .map_err(|e| format!("ip: {e}"))?;
            if !o.status.success() {
                return Err(format!(
                    "ip {}: {}",
                    step.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespaces removes the veth pair with them.
        for n in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "delete", n]).status();
        }
    }
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
    let dest = spawn_logged_in(
        Some(&ns.b),
        &[
            "run",
            "--incoming",
            "tcp:10.77.0.2:4444",
            "--memory",
            "64M",
            "--timeout",
            "120",
        ],
        "netns-dst",
    );
    eventually(Duration::from_secs(20), || {
        dest.stderr()
            .contains("waiting for a migration")
            .then_some(())
    });
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
            "--timeout",
            "120",
            "pages=4000",
            "writes=400000",
            "rate=200000",
            "seed=6",
        ],
        "netns-src",
    );
    eventually(Duration::from_secs(20), || {
        src.stdout().contains("memtouch: pages=").then_some(())
    });
    std::thread::sleep(Duration::from_millis(300));
    // The API socket is a file, reachable from the root namespace; the stream goes A -> B.
    let (ok, o, e) = migrate(
        &sock,
        &["--to", "tcp:10.77.0.2:4444", "--engine", "overlap"],
    );
    assert!(ok, "{o}\n{e}\n{}", dest.stderr());
    assert_eq!(src.wait().0, Some(0));
    let (code, dout, derr) = dest.wait();
    assert_eq!(code, Some(0), "{derr}");
    assert_eq!(
        checksum_of(&dout, "checksum"),
        Some(kumo_guests::memtouch::expected_checksum(
            4000, 400_000, 6, true
        ))
    );
}
