//! End to end: kumo's virtio-net NIC on host taps, driven by kumo's own guests (guests/src/net):
//! the host pings `netecho` and gets UDP echoed on each interrupt path (seed 000), two VMs on a
//! Linux bridge exchange UDP, and a VM with a NIC migrates and answers on the destination (on
//! the tap the destination's operator gives it; without one the VM is refused), as a restored
//! snapshot does.
//!
//! Needs /dev/kvm and the right to create taps and bridges (root); skips, saying why, where
//! either is missing. Outcomes only: no durations are asserted, guests end by `count=` or are
//! stopped by the test, and every wait is a safety net far above need.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};

use kumo_testkit::net::{have_ping, ping, subnet, tap_name, tap_or_skip, tap_or_skip_with, udp_echoes, Bridge, Tap};
use kumo_testkit::*;

/// `kumo run` of a network guest with an API socket; returns once its NIC 0 is up.
fn boot(tag: &str, dir: &TestDir, cpus: u32, net: &str, guest: &str, args: &[String]) -> (Kid, String) {
    let sock = dir.arg(&format!("{tag}.sock"));
    let cpus = cpus.to_string();
    let mut a = vec!["run", "--timeout", "0", "--api-socket", &sock, "--cpus", &cpus, "--net", net, "--guest", guest];
    a.extend(args.iter().map(String::as_str));
    let vm = Kid::spawn(&a).named(tag);
    vm.wait_stdout(": up nic=0", PATIENCE);
    (vm, sock)
}

use kumo_testkit::vm_info as info;

fn counters(sock: &str) -> serde_json::Value {
    let c = kumo_api::ApiClient::new(sock).counters().unwrap_or_else(|e| panic!("vm.counters: {e}"));
    serde_json::to_value(c).expect("counters are JSON")
}

#[test]
fn host_pings_netecho_and_gets_udp_echoed_on_each_interrupt_path() {
    let test = "host_pings_netecho_and_gets_udp_echoed_on_each_interrupt_path";
    let (host, guest, _) = subnet(212);
    let Some(tap) = tap_or_skip(test, "p", host) else { return };
    let dir = TestDir::new();
    let g = guest.to_string();
    // (--net's irq options, vCPUs, the vCPU netecho serves NIC 0 from). The shared path hands
    // every interrupt to vCPU 0, so the guest must forward those for vCPU 1; the dedicated path
    // delivers them to vCPU 1 itself.
    let paths = [("direct", 1, 0), ("shared", 2, 1), ("dedicated,vcpu=1", 2, 1)];
    for (irq, cpus, cpu) in paths {
        let net = format!("tap={},irq={irq}", tap.name);
        // netecho stops after its sixth echo: the counters are read after the fifth, while the
        // VM still runs, and the sixth ends it.
        let args = [format!("ip={g}"), format!("cpu={cpu}"), "count=6".into()];
        let (vm, sock) = boot(irq, &dir, cpus, &net, "netecho", &args);
        if have_ping() {
            let (got, text) = ping(&g, 3, 60);
            assert_eq!(got, 3, "ping {g} on the {irq} path:\n{text}\n{}", vm.stdout());
        }
        let nic = info(&sock).net.remove(0);
        assert_eq!(nic.tap, tap.name);
        assert!(nic.driver_ok, "{nic:?}");
        assert!(nic.offloads.is_empty(), "kumo's guests take no offloads: {nic:?}");
        assert_eq!(nic.irq, irq.split(',').next().unwrap(), "{nic:?}");
        assert_eq!(nic.vcpu, (irq != "shared" && cpus > 1).then_some(1), "{nic:?}");
        udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 5, PATIENCE)
            .unwrap_or_else(|e| panic!("{irq} path: {e}\n{}", vm.stdout()));
        let counters = counters(&sock);
        let net0 = &counters["net"]["net0"];
        assert!(net0["rx_frames"].as_u64() >= Some(5) && net0["tx_frames"].as_u64() >= Some(5), "{counters}");
        assert!(net0["interrupts"].as_u64() > Some(0), "{counters}");
        let shared = counters["interrupts"]["shared_path"].as_u64();
        udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 1, PATIENCE)
            .unwrap_or_else(|e| panic!("{irq} path, the last echo: {e}\n{}", vm.stdout()));
        let (code, out, err) = vm.wait();
        assert_eq!(code, Some(0), "netecho on the {irq} path:\n{out}\n{err}");
        let e = kumo_guests::net::parse_netecho(&out).unwrap_or_else(|| panic!("no result line:\n{out}"));
        assert_eq!(e.echoed, 6, "{out}");
        let forwarded: u64 = field(&out, "netecho: irqs", "forwarded").and_then(|v| v.parse().ok()).expect(&out);
        let irqs: u64 = field(&out, "netecho: irqs", "nic0").and_then(|v| v.parse().ok()).expect(&out);
        assert!(irqs > 0, "the guest took NIC interrupts: {out}");
        match irq {
            "shared" => {
                assert!(shared > Some(0), "the dispatcher injected: {counters}");
                assert!(forwarded > 0, "vCPU 0 got them and forwarded them to vCPU 1: {out}");
            }
            _ => {
                assert_eq!(shared, None, "no dispatcher without a shared device: {counters}");
                assert_eq!(forwarded, 0, "KVM delivered every interrupt to the serving vCPU: {out}");
            }
        }
    }
}

#[test]
fn two_vms_on_a_bridge_exchange_udp() {
    let test = "two_vms_on_a_bridge_exchange_udp";
    if !kvm_or_skip(test) {
        return;
    }
    let (host, a, b) = subnet(213);
    let (ta, tb) = (tap_name("ba"), tap_name("bb"));
    let br = match Bridge::create(&tap_name("br"), &format!("{host}/24"), &[&ta, &tb]) {
        Ok(br) => br,
        Err(e) => return eprintln!("skipping {test}: cannot create a bridge with two taps: {e}"),
    };
    let dir = TestDir::new();
    let (echo, _) = boot("echo", &dir, 1, &format!("tap={ta}"), "netecho", &[format!("ip={a}")]);
    // B pings A over the bridge: every request answered (the timeout is a safety net).
    let args = [format!("ip={b}"), format!("peer={a}"), "count=50".into(), "timeout_ms=60000".into()];
    let (pinger, _) = boot("udpping", &dir, 1, &format!("tap={tb}"), "udpping", &args);
    let (code, out, err) = pinger.wait();
    assert_eq!(code, Some(0), "udpping:\n{out}\n{err}\n{}", echo.stdout());
    let p = kumo_guests::net::parse_udpping(&out).unwrap_or_else(|| panic!("no result line:\n{out}"));
    assert_eq!((p.count, p.lost), (50, 0), "{p:?}");
    assert!(p.min_us <= p.p50_us && p.p50_us <= p.p99_us, "{p:?}");
    drop((echo, br));
}

#[test]
fn a_vm_with_a_nic_migrates_and_answers_on_the_destination() {
    let test = "a_vm_with_a_nic_migrates_and_answers_on_the_destination";
    let (host, guest, _) = subnet(214);
    let Some(tap) = tap_or_skip(test, "m", host) else { return };
    let dir = TestDir::new();
    let g = guest.to_string();
    let (src, src_sock) = boot("src", &dir, 1, &format!("tap={}", tap.name), "netecho", &[format!("ip={g}")]);
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("before the migration: {e}\n{}", src.stdout()));

    // The host keeps pinging through the migration (its replies are not counted: the point
    // is that the NIC keeps working while traffic flows).
    let pinger = have_ping().then(|| {
        Command::new("ping")
            .args(["-i", "0.05", "-W", "1", &g])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run ping")
    });
    let addr = format!("unix:{}", dir.arg("mig.sock"));
    let dst_sock = dir.arg("dst.sock");
    // The destination's operator gives the NIC its tap (here the same one, shared on one host).
    let net0 = format!("id=net0,tap={}", tap.name);
    let dst = Kid::spawn(&["run", "--incoming", &addr, "--api-socket", &dst_sock, "--net", &net0]).named("dst");
    eventually(PATIENCE, || dst.stderr().contains("waiting for a migration").then_some(()));
    let o = Command::new(kumo_bin())
        .args(["--api-socket", &src_sock, "migrate", "--to", &addr])
        .stdin(Stdio::null())
        .output()
        .expect("run kumo migrate");
    assert!(o.status.success(), "migrate: {}\n{}", String::from_utf8_lossy(&o.stderr), dst.stderr());
    let (code, _, err) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "the source ends after handing over: {err}");
    if let Some(mut p) = pinger {
        let _ = p.kill();
        let _ = p.wait();
    }

    // The destination answers on the same tap, with the NIC's state (rings, MSI-X) as it was.
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 5, PATIENCE)
        .unwrap_or_else(|e| panic!("after the migration: {e}\n{}\n{}", dst.stdout(), dst.stderr()));
    if have_ping() {
        let (got, text) = ping(&g, 3, 60);
        assert_eq!(got, 3, "ping the migrated VM:\n{text}");
    }
    let nic = info(&dst_sock).net.remove(0);
    assert!(nic.driver_ok, "{nic:?}");
    assert_eq!(nic.tap, tap.name);
    drop(dst);
}

#[test]
fn bad_nic_options_are_one_line_errors() {
    if !kvm_or_skip("bad_nic_options_are_one_line_errors") {
        return;
    }
    for (net, want) in [
        ("tap=kumo-nosuch", "no network interface named kumo-nosuch"),
        ("tap=a/b", "bad tap name"),
        ("tap=x,mac=01:00:5e:00:00:01", "a multicast address"),
        ("tap=x,mac=zz", "bad MAC"),
        ("tap=x,queues=17", "queues=17 is not 1..=16"),
        ("tap=x,irq=dedicated", "irq=dedicated needs vcpu=N"),
        ("tap=x,irq=dedicated,vcpu=4", "the VM has 1 vCPUs"),
        ("tap=x,irq=fast", "unknown irq path `fast`"),
        ("mac=52:54:00:00:00:01", "tap=NAME is required"),
    ] {
        let o = kumo(&["run", "--net", net, "--guest", "hello"]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "--net {net}: {err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "--net {net}: want `{want}` in `{err}`");
    }
    // A single-queue tap another VM holds.
    let (host, _, _) = subnet(215);
    let Ok(tap) = Tap::create(&tap_name("busy"), &format!("{host}/24")) else {
        return eprintln!("bad_nic_options_are_one_line_errors: cannot create a tap: the busy-tap case is skipped");
    };
    let net = format!("tap={}", tap.name);
    let dir = TestDir::new();
    let (holder, _) = boot("holder", &dir, 1, &net, "netecho", &[]);
    let o = kumo(&["run", "--net", &net, "--guest", "hello"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("tap {} is busy", tap.name)) && err.trim().lines().count() == 1, "{err}");
    drop(holder);
}

/// A tap named `h2{tag}{pid}` (migration tests of the destination's own resources), multi-queue,
/// with `host` on it if given; None (after saying why) where KVM or taps are not available.
fn h2_tap(test: &str, tag: &str, host: Option<Ipv4Addr>) -> Option<Tap> {
    let name = format!("h2{tag}{}", std::process::id() % 100_000);
    tap_or_skip_with(test, || Tap::multi_queue(&name, host.map(|h| format!("{h}/24")).as_deref()))
}

/// `kumo run --incoming unix:…` with `extra` flags, once it listens.
fn destination(dir: &TestDir, tag: &str, extra: &[&str]) -> (Kid, String, String) {
    let addr = format!("unix:{}", dir.arg(&format!("{tag}.mig")));
    let sock = dir.arg(&format!("{tag}.sock"));
    let mut args = vec!["run", "--incoming", &addr, "--api-socket", &sock];
    args.extend_from_slice(extra);
    let dst = Kid::spawn(&args).named(tag);
    eventually(PATIENCE, || dst.stderr().contains("waiting for a migration").then_some(()));
    (dst, addr, sock)
}

/// `kumo migrate --to ADDR` of the VM at `sock`: (success, stderr).
fn migrate(sock: &str, to: &str) -> (bool, String) {
    let o = Command::new(kumo_bin())
        .args(["--api-socket", sock, "migrate", "--to", to])
        .stdin(Stdio::null())
        .output()
        .expect("run kumo migrate");
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The destination's operator maps the source's net0 to a tap of its own: the VM arrives on
/// it, with the MAC, queues and interrupt path it had, and answers there.
#[test]
fn the_destination_gives_net0_its_own_tap_and_the_guest_answers_there() {
    let test = "the_destination_gives_net0_its_own_tap_and_the_guest_answers_there";
    let (host, guest, _) = subnet(231);
    // The source's tap has no host address: the host reaches the guest only through the
    // destination's tap, after the migration.
    let Some(theirs) = h2_tap(test, "s", None) else { return };
    let Some(ours) = h2_tap(test, "d", Some(host)) else { return };
    let dir = TestDir::new();
    let g = guest.to_string();
    let net = format!("tap={}", theirs.name);
    let (src, src_sock) = boot("src", &dir, 1, &net, "netecho", &[format!("ip={g}")]);
    let before = info(&src_sock).net.remove(0);
    let net0 = format!("id=net0,tap={}", ours.name);
    let (dst, addr, dst_sock) = destination(&dir, "dst", &["--net", &net0]);
    let (ok, err) = migrate(&src_sock, &addr);
    assert!(ok, "migrate: {err}\n{}", dst.stderr());
    let (code, _, err) = src.finish(PATIENCE);
    assert_eq!(code, Some(0), "the source ends after handing over: {err}");
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 5, PATIENCE)
        .unwrap_or_else(|e| panic!("after the migration, on {}: {e}\n{}\n{}", ours.name, dst.stdout(), dst.stderr()));
    let after = info(&dst_sock).net.remove(0);
    assert_eq!(after.tap, ours.name);
    assert!(after.driver_ok, "{after:?}");
    let shape = |n: &kumo_api::NetInfo| (n.mac.clone(), n.queues, n.irq.clone(), n.pci.clone());
    assert_eq!(shape(&after), shape(&before), "the guest sees the NIC it had");
    drop(dst);
}

/// A destination whose operator gave no backend for the VM's NIC refuses it before building
/// anything: the source is told why (a Failed reply), runs on and still answers on its tap, and
/// the destination exits with the same reason.
#[test]
fn a_destination_without_a_backend_for_net0_refuses_the_vm_and_the_source_runs_on() {
    let test = "a_destination_without_a_backend_for_net0_refuses_the_vm_and_the_source_runs_on";
    let (host, guest, _) = subnet(232);
    let Some(tap) = h2_tap(test, "r", Some(host)) else { return };
    let Some(other) = h2_tap(test, "o", None) else { return };
    let dir = TestDir::new();
    let g = guest.to_string();
    let (src, src_sock) = boot("src", &dir, 1, &format!("tap={}", tap.name), "netecho", &[format!("ip={g}")]);
    let why =
        format!("the VM's net0 (tap {} on its source) has no backend here: give --net id=net0,tap=NAME", tap.name);
    // No --net at all, and a --net for a NIC the VM lacks.
    let net1 = format!("id=net1,tap={}", other.name);
    for (tag, extra, want) in [
        ("none", &[][..], why.as_str()),
        (
            "extra",
            &["--net", &net0_of(&other), "--net", &net1][..],
            "--net id=net1: the VM has no NIC net1 (it has net0)",
        ),
    ] {
        let (dst, addr, _) = destination(&dir, tag, extra);
        let (ok, err) = migrate(&src_sock, &addr);
        assert!(!ok, "{tag}: the migration must be refused");
        assert!(
            err.contains(&format!("destination refused: destination VM: creating it: {want}")),
            "{tag}: want `{want}` in the source's `{err}`"
        );
        // Its whole stderr, read to the end once it exited.
        let (code, _, derr) = dst.wait();
        assert_eq!(code, Some(1), "{tag}: {derr}");
        assert!(derr.contains("incoming migration failed") && derr.contains(want), "{tag}: {derr}");
        // The source runs on, on its tap.
        udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 2, PATIENCE)
            .unwrap_or_else(|e| panic!("{tag}: the source after the refusal: {e}\n{}", src.stdout()));
        assert_eq!(info(&src_sock).state, kumo_api::VmState::Running);
    }
    drop(src);
}

fn net0_of(t: &Tap) -> String {
    format!("id=net0,tap={}", t.name)
}

/// A snapshot of a VM with a NIC restores on the tap its restorer gives (the same rule as a
/// migration's destination): without `--net` it is refused, naming the flag.
#[test]
fn a_snapshot_with_a_nic_restores_on_the_tap_given() {
    let test = "a_snapshot_with_a_nic_restores_on_the_tap_given";
    let (host, guest, _) = subnet(233);
    let Some(theirs) = h2_tap(test, "p", None) else { return };
    let Some(ours) = h2_tap(test, "q", Some(host)) else { return };
    let dir = TestDir::new();
    let g = guest.to_string();
    let (src, src_sock) = boot("src", &dir, 1, &format!("tap={}", theirs.name), "netecho", &[format!("ip={g}")]);
    let file = dir.arg("vm.snap");
    let o = kumo(&["--api-socket", &src_sock, "snapshot", "--to", &file]);
    assert!(o.status.success(), "snapshot: {}", text(&o).1);
    drop(src);
    let o = kumo(&["run", "--restore", &file]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("give --net id=net0,tap=NAME") && err.trim().lines().count() == 1, "{err}");
    let sock = dir.arg("restored.sock");
    let vm = Kid::spawn(&["run", "--restore", &file, "--api-socket", &sock, "--net", &format!("tap={}", ours.name)])
        .named("restored");
    eventually(PATIENCE, || {
        let st = kumo_api::ApiClient::new(&sock).info().ok().map(|i| i.state);
        (st == Some(kumo_api::VmState::Running)).then_some(())
    });
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("the restored VM on {}: {e}\n{}\n{}", ours.name, vm.stdout(), vm.stderr()));
    assert_eq!(info(&sock).net.remove(0).tap, ours.name);
    drop(vm);
}
