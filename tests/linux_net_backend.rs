//! Linux as the judge of the NIC as its own process (`kumo net-backend`, seed 001): the test
//! kernel's own virtio-net driver on kumo's vhost-user frontend, the backend on a host tap.
//!
//! - Handover: two Linux VMs with the same `ip=` on the backend; the host pings every 50 ms;
//!   after `handover` the second kernel answers, at most one ping lost.
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

use kumo_testkit::linux::{self, Pinger, BOOT_LIMIT, IP_CONFIG_COMPLETE};
use kumo_testkit::net::{subnet, tap_name, tap_or_skip_with, Tap};
use kumo_testkit::*;
use serde_json::{json, Value};

/// Linux boots run one at a time: they are emulation-bound on this host.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Backend {
    kid: Kid,
    sock: String,
    api: kumo_api::ApiClient,
}

impl Backend {
    fn start(dir: &TestDir, tap: &str) -> Backend {
        let (sock, api) = (dir.arg("nic.sock"), dir.arg("backend.sock"));
        let kid = Kid::spawn(&["--api-socket", &api, "net-backend", "--tap", tap, "--socket", &sock]).named("backend");
        eventually(PATIENCE, || {
            (std::path::Path::new(&sock).exists() && std::path::Path::new(&api).exists()).then_some(())
        });
        Backend { kid, sock, api: kumo_api::ApiClient::new(&api) }
    }

    fn info(&self) -> Value {
        let (status, body) = self.api.request("GET", "/api/v1/backend.info", None).expect("backend.info");
        assert_eq!(status, 200, "{body:?}");
        body.expect("a body")
    }

    fn client_of(&self, pid: u32) -> u64 {
        eventually(BOOT_LIMIT, || {
            let info = self.info();
            info["clients"]
                .as_array()?
                .iter()
                .find(|c| c["pid"].as_u64() == Some(pid.into()) && c["ready"] == true)
                .and_then(|c| c["id"].as_u64())
        })
    }
}

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
    vm.wait_stdout(IP_CONFIG_COMPLETE, BOOT_LIMIT);
    vm
}

/// Diagnostics: each gap in the replies, as (last seq, s since t0) -> (next seq, s since t0).
fn gaps(pinger: &Pinger, t0: std::time::Instant) -> String {
    let log = pinger.log();
    let at = |t: std::time::Instant| t.saturating_duration_since(t0).as_secs_f64() - t0.saturating_duration_since(t).as_secs_f64();
    log.windows(2)
        .filter(|w| w[1].1 != w[0].1 + 1)
        .map(|w| format!("{}@{:.2} -> {}@{:.2}", w[0].1, at(w[0].0), w[1].1, at(w[1].0)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn setup(test: &str, net: u8, tag: &str) -> Option<(std::path::PathBuf, Ipv4Addr, Ipv4Addr, Tap)> {
    let kernel = linux::test_kernel(test)?;
    let (host, guest, _) = subnet(net);
    let tap = tap_or_skip_with(test, || Tap::create(&tap_name(tag), &format!("{host}/24")))?;
    Some((kernel, host, guest, tap))
}

#[test]
#[ignore = "not yet seen passing: on this loaded host the test kernel stalled after `vgaarb: loaded` (with a tap NIC too); run with --ignored"]
fn the_nic_moves_between_two_linux_vms_losing_at_most_one_ping() {
    let test = "the_nic_moves_between_two_linux_vms_losing_at_most_one_ping";
    let Some((kernel, host, guest, tap)) = setup(test, 248, "lh") else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let a = boot(&kernel, &backend, guest, host, &[], "A");
    let id_a = backend.client_of(a.id());
    let pinger = Pinger::start(guest);
    pinger.wait_replies(0, 5, BOOT_LIMIT).unwrap_or_else(|e| panic!("A: {e}\n{}", a.stdout()));
    let b = boot(&kernel, &backend, guest, host, &[], "B");
    let id_b = backend.client_of(b.id());
    assert_eq!(backend.info()["owner"].as_u64(), Some(id_a));

    let t_b = std::time::Instant::now();
    let before = pinger.replies();
    pinger.wait_replies(before, 3, BOOT_LIMIT).unwrap_or_else(|e| panic!("A while B runs: {e}"));
    let rtt = std::process::Command::new("ping").args(["-n", "-q", "-c", "10", "-i", "0.05"]).arg(guest.to_string()).output().unwrap();
    eprintln!("A's rtt: {}", String::from_utf8_lossy(&rtt.stdout));
    let t0 = std::time::Instant::now();
    eprintln!("B up at {:.2} s before the handover", (t0 - t_b).as_secs_f64());
    let (status, report) =
        backend.api.request("PUT", "/api/v1/backend.handover", Some(&json!({ "to": id_b }))).expect("handover");
    assert_eq!(status, 200, "{report:?}");
    let at = pinger.replies();
    pinger
        .wait_replies(at, 20, BOOT_LIMIT)
        .unwrap_or_else(|e| panic!("B after the handover: {e}\n{}\n{}", b.stdout(), backend.info()));
    let info = backend.info();
    let b_tx = info["clients"].as_array().unwrap().iter().find(|c| c["id"].as_u64() == Some(id_b)).unwrap()
        ["tx_packets"]
        .as_u64();
    assert!(b_tx.unwrap_or(0) > 0, "B answers: {info}");
    let lost = pinger.lost();
    eprintln!("{test}: handover {report:?}; lost pings {lost:?}");
    eprintln!("gaps: {}\nB:\n{}", gaps(&pinger, t0), b.stdout());
    assert!(lost.len() <= 1, "pings lost across the handover: {lost:?}\n{info}");
    drop((a, b));
}

#[test]
#[ignore = "not yet seen passing: on this loaded host the test kernel stalled after `vgaarb: loaded` (with a tap NIC too); run with --ignored"]
fn a_linux_vm_on_the_backend_migrates_and_answers_from_the_destination() {
    let test = "a_linux_vm_on_the_backend_migrates_and_answers_from_the_destination";
    let Some((kernel, host, guest, tap)) = setup(test, 249, "lm") else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let api = dir.arg("src.api");
    let src = boot(&kernel, &backend, guest, host, &["--api-socket", &api], "src");
    let id_src = backend.client_of(src.id());
    let pinger = Pinger::start(guest);
    pinger.wait_replies(0, 5, BOOT_LIMIT).unwrap_or_else(|e| panic!("source: {e}\n{}", src.stdout()));

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
    eventually(PATIENCE, || (backend.info()["owner"].as_u64() == Some(id_dest)).then_some(()));
    assert_ne!(id_dest, id_src);
    let at = pinger.replies();
    pinger
        .wait_replies(at, 20, BOOT_LIMIT)
        .unwrap_or_else(|e| panic!("the destination: {e}\n{}\n{}", dest.stdout(), backend.info()));
    let lost = pinger.lost();
    eprintln!("{test}: {out}; lost pings {lost:?}; {}", backend.info()["last_handover"]);
    eprintln!("gaps: {}\ndest:\n{}", gaps(&pinger, t0), dest.stdout());
    assert!(lost.len() <= 1, "pings lost across the migration: {lost:?}");
    drop(dest);
}
