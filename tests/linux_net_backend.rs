//! Linux as the judge of the NIC as its own process (`kumo net-backend`, seed 001): the test
//! kernel's own virtio-net driver on kumo's vhost-user frontend, the backend on a host tap.
//!
//! - Handover: two Linux VMs with the same `ip=` on the backend; the host pings, one ping in
//!   flight at a time (so a kernel slow to answer on a busy host holds at most one when its NIC
//!   goes); after `handover` the second kernel answers, at most one ping lost.
//! - Migration: a Linux VM whose NIC is on the backend migrates between two kumo processes (the
//!   backend logs its writes to guest memory, the rings' positions go with the VM) and answers
//!   from the destination, at most one ping lost.
//!
//! Needs /dev/kvm, a tap (root) and the test kernel; skips, saying why, without them. One Linux
//! boot at a time; every wait is for a kernel message, a ping reply or the backend's state,
//! bounded only as a hang guard.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Mutex;

use kumo_testkit::backend::Backend;
use kumo_testkit::linux::{self, boot_limit, effect_limit, Pinger, IP_CONFIG_COMPLETE};
use kumo_testkit::net::{subnet, tap_name, tap_or_skip_with, Tap};
use kumo_testkit::*;

/// Linux boots run one at a time: they are emulation-bound on this host.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The test kernel on a NIC at the backend's socket, until "IP-Config: Complete". The root
/// device never comes (no disk): the kernel idles, answering the network. `carrier_timeout`:
/// a VM that does not own the NIC sees its link down and need not wait for it.
fn boot(kernel: &Path, backend: &Backend, guest: Ipv4Addr, host: Ipv4Addr, extra: &[&str], tag: &str) -> Kid {
    let cmdline = linux::cmdline(&format!("{} carrier_timeout=1 root=/dev/vda rootwait", linux::ip_arg(guest, host)));
    let net = format!("vhost-user={}", backend.sock);
    let k = kernel.to_str().expect("kernel path");
    let mut a = vec!["run", "--kernel", k, "--memory", "512M", "--cpus", "1", "--cmdline", &cmdline, "--net", &net];
    a.extend_from_slice(extra);
    let vm = Kid::spawn(&a).named(tag);
    vm.wait_stdout(IP_CONFIG_COMPLETE, boot_limit());
    vm
}

/// Each gap in the ping replies, as `seq@s -> seq@s` (arrival in seconds from `t0`): where the
/// guests stopped answering, for the test's output.
fn gaps(pinger: &Pinger, t0: std::time::Instant) -> String {
    let log = pinger.log();
    let at = |t: std::time::Instant| {
        t.saturating_duration_since(t0).as_secs_f64() - t0.saturating_duration_since(t).as_secs_f64()
    };
    log.windows(2)
        .filter(|w| w[1].1 != w[0].1 + 1)
        .map(|w| format!("{}@{:.2} -> {}@{:.2}", w[0].1, at(w[0].0), w[1].1, at(w[1].0)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The guest's MAC (the backend's, the same for every VM on it) as a permanent neighbour of the
/// host: a kernel starved of CPU on this busy host cannot make the host's neighbour entry fail
/// (and drop pings behind it) while it answers late; what is measured is the NIC's move.
fn pin_neighbour(backend: &Backend, guest: Ipv4Addr, tap: &Tap) {
    let info = backend.info();
    let mac = info["mac"].as_str().expect("the backend's MAC");
    let guest = guest.to_string();
    kumo_testkit::net::ip(&["neigh", "replace", &guest, "lladdr", mac, "dev", &tap.name, "nud", "permanent"])
        .expect("a neighbour entry");
}

fn setup(test: &str, net: u8, tag: &str) -> Option<(std::path::PathBuf, Ipv4Addr, Ipv4Addr, Tap)> {
    let kernel = linux::test_kernel(test)?;
    let (host, guest, _) = subnet(net);
    let tap = tap_or_skip_with(test, || Tap::create(&tap_name(tag), &format!("{host}/24")))?;
    Some((kernel, host, guest, tap))
}

#[test]
fn the_nic_moves_between_two_linux_vms_losing_at_most_one_ping() {
    let test = "the_nic_moves_between_two_linux_vms_losing_at_most_one_ping";
    let Some((kernel, host, guest, tap)) = setup(test, 248, "lh") else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    pin_neighbour(&backend, guest, &tap);
    let a = boot(&kernel, &backend, guest, host, &[], "A");
    let id_a = backend.client_of(a.id());
    let pinger = Pinger::one_in_flight(guest);
    pinger.wait_replies(0, 5, effect_limit()).unwrap_or_else(|e| panic!("A: {e}\n{}", a.stdout()));
    let b = boot(&kernel, &backend, guest, host, &[], "B");
    let id_b = backend.client_of(b.id());
    assert_eq!(backend.owner(), Some(id_a));

    let before = pinger.replies();
    pinger.wait_replies(before, 3, effect_limit()).unwrap_or_else(|e| panic!("A while B runs: {e}"));
    let t0 = std::time::Instant::now();
    let report = backend.hand_to(id_b);
    assert_eq!(backend.owner(), Some(id_b), "{report}");
    let at = pinger.replies();
    pinger
        .wait_replies(at, 20, effect_limit())
        .unwrap_or_else(|e| panic!("B after the handover: {e}\n{}\n{}", b.stdout(), backend.info()));
    let info = backend.info();
    let b_tx = backend.client(id_b).and_then(|c| c["tx_packets"].as_u64());
    assert!(b_tx.unwrap_or(0) > 0, "B answers: {info}");
    let lost = pinger.lost();
    let gaps = gaps(&pinger, t0);
    eprintln!("{test}: handover {report}; lost pings {lost:?}; reply gaps (s from the handover) {gaps}");
    assert!(lost.len() <= 1, "pings lost across the handover: {lost:?}\n{info}\nB:\n{}", b.stdout());
    drop((a, b));
}

#[test]
fn a_linux_vm_on_the_backend_migrates_and_answers_from_the_destination() {
    let test = "a_linux_vm_on_the_backend_migrates_and_answers_from_the_destination";
    let Some((kernel, host, guest, tap)) = setup(test, 249, "lm") else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    pin_neighbour(&backend, guest, &tap);
    let api = dir.arg("src.api");
    let src = boot(&kernel, &backend, guest, host, &["--api-socket", &api], "src");
    let id_src = backend.client_of(src.id());
    let pinger = Pinger::one_in_flight(guest);
    pinger.wait_replies(0, 5, effect_limit()).unwrap_or_else(|e| panic!("source: {e}\n{}", src.stdout()));

    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let net = format!("id=net0,vhost-user={}", backend.sock);
    let dest = incoming(&addr, &["--net", &net], "dest");
    let t0 = std::time::Instant::now();
    let (ok, out, err) = migrate(&api, &["--to", &addr]);
    assert!(
        ok,
        "{out}\n{err}\nsource:\n{}\ndest:\n{}\nbackend:\n{}",
        src.stderr(),
        dest.stderr(),
        backend.kid.stderr()
    );
    let (code, _, serr) = src.wait();
    assert_eq!(code, Some(0), "{serr}");
    let id_dest = backend.client_of(dest.id());
    backend.wait_owner(id_dest);
    assert_ne!(id_dest, id_src);
    let at = pinger.replies();
    pinger
        .wait_replies(at, 20, effect_limit())
        .unwrap_or_else(|e| panic!("the destination: {e}\n{}\n{}", dest.stdout(), backend.info()));
    let lost = pinger.lost();
    let gaps = gaps(&pinger, t0);
    eprintln!(
        "{test}: {out}; lost pings {lost:?}; reply gaps (s from the migration's start) {gaps}; {}",
        backend.info()["last_handover"]
    );
    assert!(lost.len() <= 1, "pings lost across the migration: {lost:?}\ndest:\n{}", dest.stdout());
    drop(dest);
}
