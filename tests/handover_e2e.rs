//! End to end: NIC handover between running VMs (seed 001). `kumo net-backend` owns a host tap
//! and serves kumo VMs over vhost-user (`kumo run --net vhost-user=PATH`); the NIC moves from
//! one running guest to another under traffic and loses nothing, fails over when its owner's
//! kumo is killed, stays with its owner when a handover is refused, and never has two VMs'
//! queues processed at once (the backend's own in-flight probe and foreign-serve counter).
//!
//! Needs /dev/kvm and the right to create taps (root); skips, saying why, where either is
//! missing. Outcomes only: guests end by their end marker or by console input from the test,
//! and every wait is a safety net far above need.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kumo_testkit::backend::Backend;
use kumo_testkit::net::{have_ping, ping, subnet, tap_name, tap_or_skip_with, udp_echoes, Tap};
use kumo_testkit::*;

/// A plain (single-queue) tap for the backend, `kh{tag}{pid}` with `host/24` on it.
fn tap_or_skip(test: &str, tag: &str, host: Ipv4Addr) -> Option<Tap> {
    tap_or_skip_with(test, || Tap::create(&tap_name(&format!("h{tag}")), &format!("{host}/24")))
}

/// `kumo run` of a network guest on the backend's NIC; returns once the guest's driver is up.
fn vm(tag: &str, backend: &Backend, guest: &str, args: &[String]) -> Kid {
    let net = format!("vhost-user={}", backend.sock);
    let mut a = vec!["run", "--timeout", "0", "--net", &net, "--guest", guest];
    a.extend(args.iter().map(String::as_str));
    let kid = Kid::spawn(&a).named(tag);
    kid.wait_stdout(": up nic=0", PATIENCE);
    kid
}

/// udpsink's `received= lost= reordered= dup=` line.
fn sink_counts(out: &str) -> (u64, u64) {
    let f = |k: &str| field(out, "udpsink: received", k).and_then(|v| v.parse().ok());
    let received = out
        .lines()
        .find_map(|l| l.strip_prefix("udpsink: received="))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no udpsink result line:\n{out}"));
    (received, f("dup").unwrap_or_else(|| panic!("no dup count:\n{out}")))
}

/// Sends datagram `seq` of `total` in udpsend's format (8-byte sequence, 8-byte total, padding).
fn send(sock: &UdpSocket, to: SocketAddrV4, seq: u64, total: u64) {
    let mut d = [0u8; 1000];
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d[8..16].copy_from_slice(&total.to_le_bytes());
    sock.send_to(&d, to).expect("send a datagram");
}

#[test]
fn handovers_under_traffic_lose_nothing_and_the_new_owner_answers() {
    let test = "handovers_under_traffic_lose_nothing_and_the_new_owner_answers";
    let (host, guest, _) = subnet(216);
    let Some(tap) = tap_or_skip(test, "t", host) else { return };
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let args = [format!("ip={guest}"), "until_input=1".into()];
    let mut a = vm("A", &backend, "udpsink", &args);
    let id_a = backend.client_of(a.id());
    let b = vm("B", &backend, "udpsink", &args);
    let id_b = backend.client_of(b.id());
    assert_eq!(backend.owner(), Some(id_a), "the first ready VM owns the NIC");
    // The guest's MAC (the backend's) as a permanent neighbour: no ARP resolution for the host
    // to queue datagrams behind, and drop them beyond its queue, while a busy guest answers.
    kumo_testkit::net::ip(&[
        "neigh",
        "replace",
        &guest.to_string(),
        "lladdr",
        "52:54:00:12:34:56",
        "dev",
        &tap.name,
        "nud",
        "permanent",
    ])
    .expect("a neighbour entry");

    // The host streams N datagrams; the NIC moves A -> B -> A ... while they flow, ending on B.
    const N: u64 = 4000;
    const HANDOVERS: u64 = 9;
    let sent = Arc::new(AtomicU64::new(0));
    let to = SocketAddrV4::new(guest, 9);
    let sender = {
        let sent = sent.clone();
        let sock = UdpSocket::bind(SocketAddrV4::new(host, 0)).expect("bind");
        let api = kumo_api::ApiClient::new(&backend.api_sock);
        std::thread::spawn(move || {
            for seq in 0..N {
                // Flow control, so a slow guest on a busy host cannot overflow the tap's queue:
                // at most WINDOW datagrams not yet delivered into a VM's receive ring.
                const WINDOW: u64 = 200;
                if seq % 50 == 0 {
                    eventually(PATIENCE, || {
                        let (_, info) = api.request("GET", "/api/v1/backend.info", None).ok()?;
                        let delivered: u64 =
                            info?["clients"].as_array()?.iter().filter_map(|c| c["rx_packets"].as_u64()).sum();
                        (seq <= delivered + WINDOW).then_some(())
                    });
                }
                send(&sock, to, seq, N);
                sent.store(seq + 1, Ordering::SeqCst);
            }
            sock
        })
    };
    for k in 0..HANDOVERS {
        let target = if k % 2 == 0 { id_b } else { id_a };
        let at = N * (k + 1) / (HANDOVERS + 2);
        eventually(PATIENCE, || (sent.load(Ordering::SeqCst) >= at).then_some(()));
        let (status, report) = backend.handover(target);
        assert_eq!(status, 200, "handover {k} to {target}: {report}");
        assert_eq!(report["to"].as_u64(), Some(target), "{report}");
    }
    let sock = sender.join().expect("sender");
    let info = backend.info();
    assert_eq!(info["owner"].as_u64(), Some(id_b), "{info}");
    assert_eq!(info["handovers"].as_u64(), Some(HANDOVERS), "{info}");

    // The new owner answers pings; then the end marker ends B's count, console input A's.
    if have_ping() {
        let (got, text) = ping(&guest.to_string(), 3, 60);
        assert_eq!(got, 3, "ping B after the handovers:\n{text}");
    }
    send(&sock, to, u64::MAX, N);
    let (code, out_b, err) = b.finish(PATIENCE);
    assert_eq!(code, Some(0), "B:\n{out_b}\n{err}");
    a.input(b"q");
    let (code, out_a, err) = a.finish(PATIENCE);
    assert_eq!(code, Some(0), "A:\n{out_a}\n{err}");
    let ((ra, da), (rb, db)) = (sink_counts(&out_a), sink_counts(&out_b));
    assert_eq!((da, db), (0, 0), "no datagram twice:\n{out_a}\n{out_b}");
    assert!(ra > 0 && rb > 0, "both VMs had the NIC:\n{out_a}\n{out_b}");
    assert_eq!(ra + rb, N, "every datagram reached one VM:\n{out_a}\n{out_b}\n{info}");

    // Exclusive access: never two clients' queues in processing at once, nothing served for a
    // VM that did not own the NIC.
    let info = backend.info();
    assert_eq!(info["max_in_flight"].as_u64(), Some(1), "{info}");
    assert_eq!(info["foreign_serves"].as_u64(), Some(0), "{info}");
}

#[test]
fn the_nic_fails_over_when_its_owner_is_killed() {
    let test = "the_nic_fails_over_when_its_owner_is_killed";
    let (host, guest, _) = subnet(217);
    let Some(tap) = tap_or_skip(test, "f", host) else { return };
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let args = [format!("ip={guest}")];
    let a = vm("A", &backend, "netecho", &args);
    let id_a = backend.client_of(a.id());
    let b = vm("B", &backend, "netecho", &args);
    let id_b = backend.client_of(b.id());
    assert_eq!(backend.owner(), Some(id_a));
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("A echoes: {e}\n{}", a.stdout()));

    a.signal("KILL");
    drop(a);
    // The backend sees A's connection close and gives the NIC to the ready B at once.
    backend.wait_owner(id_b);
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("B echoes after A was killed: {e}\n{}", b.stdout()));
    let info = backend.info();
    assert!(info["clients"].as_array().unwrap().iter().all(|c| c["id"].as_u64() != Some(id_a)), "{info}");
    drop(b);
}

#[test]
fn a_refused_handover_leaves_the_owner_working() {
    let test = "a_refused_handover_leaves_the_owner_working";
    let (host, guest, _) = subnet(218);
    let Some(tap) = tap_or_skip(test, "r", host) else { return };
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let a = vm("A", &backend, "netecho", &[format!("ip={guest}")]);
    let id_a = backend.client_of(a.id());
    // A VM whose guest never drives the NIC (hello has no driver): connected, never ready.
    let net = format!("vhost-user={}", backend.sock);
    let idle =
        Kid::spawn(&["run", "--timeout", "0", "--net", &net, "--guest", "memtouch", "until_input=1"]).named("idle");
    idle.wait_stdout("memtouch: pages=", PATIENCE);
    let id_idle = eventually(PATIENCE, || {
        let info = backend.info();
        info["clients"].as_array()?.iter().find(|c| c["pid"].as_u64() == Some(idle.id().into()))?["id"].as_u64()
    });

    for (to, want) in [(id_idle, "not ready"), (999, "no client 999")] {
        let (status, body) = backend.handover(to);
        assert_eq!(status, 409, "handover to {to}: {body}");
        let msg = body["error"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "handover to {to}: want `{want}` in {body}");
    }
    let o = kumo(&["--api-socket", &backend.api_sock, "net-backend", "handover", "--to", "999"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no client 999") && err.trim().lines().count() == 1, "{err}");

    assert_eq!(backend.owner(), Some(id_a));
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("A still echoes: {e}\n{}", a.stdout()));
    drop((a, idle));
}

/// The NIC on `kumo net-backend` migrates with its VM: the source kumo turns dirty logging on
/// in the backend (SET_LOG_BASE, LOG_ALL), stops its rings in the stop phase, and the
/// destination kumo, on the same socket, starts them where they stopped; the backend gives
/// the NIC to the destination (not to the standby VM that was ready all along). Twice: over
/// TCP with pre-copy rounds (the backend's writes reach the rounds through its log) while the
/// host sends datagrams, then with the local engine.
#[test]
fn a_vm_with_a_handover_nic_migrates_and_answers_from_the_destination() {
    let test = "a_vm_with_a_handover_nic_migrates_and_answers_from_the_destination";
    let (host, guest, _) = subnet(219);
    let Some(tap) = tap_or_skip(test, "m", host) else { return };
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let echo = |who: &str, out: &dyn Fn() -> String| {
        udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
            .unwrap_or_else(|e| panic!("{who} echoes: {e}\n{}\n{}", out(), backend.info()))
    };
    let api_a = dir.arg("a.api");
    let a = vm("A", &backend, "netecho", &[format!("ip={guest}"), "--api-socket".into(), api_a.clone()]);
    let id_a = backend.client_of(a.id());
    let standby = vm("B", &backend, "netecho", &[format!("ip={guest}")]);
    let id_b = backend.client_of(standby.id());
    assert_eq!(backend.owner(), Some(id_a));
    echo("A", &|| a.stdout());

    let mut src = (a, api_a);
    let hops = [("tcp", format!("tcp:127.0.0.1:{}", free_port()), "overlap"), ("local", String::new(), "local")];
    for (i, (kind, addr, engine)) in hops.into_iter().enumerate() {
        let addr = if kind == "local" { format!("unix:{}", dir.arg("mig.sock")) } else { addr };
        let api_d = dir.arg(&format!("d{i}.api"));
        // The destination names the NIC's backend on its host: the same socket here.
        let net = format!("id=net0,vhost-user={}", backend.sock);
        let dest = incoming(&addr, &["--api-socket", &api_d, "--net", &net], &format!("D{i}"));
        // Datagrams while it migrates: the backend writes receive buffers and used rings.
        let stop = Arc::new(AtomicU64::new(0));
        let traffic = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let sock = UdpSocket::bind(SocketAddrV4::new(host, 0)).expect("bind");
                let mut n = 0u64;
                while stop.load(Ordering::SeqCst) == 0 {
                    let _ = sock.send_to(&[0u8; 200], SocketAddrV4::new(guest, 7));
                    n += 1;
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                n
            })
        };
        let (ok, out, err) = migrate(&src.1, &["--to", &addr, "--engine", engine]);
        stop.store(1, Ordering::SeqCst);
        let sent = traffic.join().expect("traffic");
        assert!(ok, "hop {i} ({engine}): {out}\n{err}\nsource:\n{}\ndest:\n{}", src.0.stderr(), dest.stderr());
        let (code, _, serr) = src.0.wait();
        assert_eq!(code, Some(0), "{serr}");
        assert!(serr.contains("VM migrated to"), "{serr}");
        // The destination's connection took the NIC; the standby did not.
        let id_d = backend.client_of(dest.id());
        let info = eventually(PATIENCE, || {
            let info = backend.info();
            (info["owner"].as_u64() == Some(id_d)).then_some(info)
        });
        assert_ne!(id_d, id_b, "{info}");
        eprintln!("{test}: hop {i} ({engine}) done, {sent} datagrams sent meanwhile; {info}");
        echo(&format!("the destination of hop {i}"), &|| dest.stdout());
        src = (dest, api_d);
    }
    let info = backend.info();
    assert_eq!(info["max_in_flight"].as_u64(), Some(1), "{info}");
    assert_eq!(info["foreign_serves"].as_u64(), Some(0), "{info}");
    drop((src, standby));
}
