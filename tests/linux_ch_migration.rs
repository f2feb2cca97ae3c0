//! A migration as a Cloud Hypervisor client runs it between two hosts (docs/ch-compat.md): two
//! network namespaces joined by a veth are the hosts, each with its own tap `kt0` for the guest
//! (same name, same address and MAC on the host side, as two hosts of one cloud network give a
//! guest). kumo runs in each as `cloud-hypervisor --api-socket path=...`; the source is given
//! the test kernel by `vm.create` (a disk and a NIC by tap name) and `vm.boot`; the destination
//! `vm.receive-migration` with CH's body (only `receiver_url`, plus kumo's `tls_dir`) and the
//! source `vm.send-migration` with `destination_url`, over mutual TLS on the veth. Linux answers
//! pings from host A before and from host B after, and its disk works on B: the MMP block its
//! kmmpd rewrites every second changes in the image after the migration.
//!
//! Needs /dev/kvm, root (namespaces, taps) and the test kernel; skips, saying why, without them
//! (in CI the namespaces must work). Waits are for kernel lines, ping replies and the image,
//! bounded only as hang guards.

use kumo_api::ApiClient;
use kumo_testkit::linux::{self, Pinger, RootFs, IP_CONFIG_COMPLETE, RUN_INIT};
use kumo_testkit::net::{subnet, NetGuard, Netns};
use kumo_testkit::pki::Pki;
use kumo_testkit::{eventually, free_port, kumo_bin, Kid, TestDir, PATIENCE};
use serde_json::{json, Value};
use std::path::Path;

fn ch(sock: &Path, method: &str, route: &str, body: Option<Value>) -> (u16, Value) {
    let (status, body) = ApiClient::new(sock)
        .request(method, &format!("/api/v1/{route}"), body.as_ref())
        .unwrap_or_else(|e| panic!("{method} {route}: {e}"));
    (status, body.unwrap_or(Value::Null))
}

/// A CH `PUT` that succeeds: 204, or 200 with kumo's report (vm.send-migration); CH's clients
/// take any 2xx as success.
fn put(sock: &Path, route: &str, body: Option<Value>) {
    let (status, b) = ch(sock, "PUT", route, body);
    assert!(status == 204 || status == 200, "{route}: {status} {b}");
}

/// `cloud-hypervisor --api-socket path=SOCK` (kumo under CH's name) inside namespace `ns`,
/// once its API answers.
fn ch_vmm(ns: &str, ch_bin: &Path, sock: &Path, tag: &str) -> Kid {
    let argv = [ch_bin.display().to_string(), "--api-socket".into(), format!("path={}", sock.display())];
    let vmm = Kid::start_in(Some(ns), &argv).unwrap_or_else(|e| panic!("{e}")).named(tag);
    eventually(PATIENCE, || (sock.exists() && ApiClient::new(sock).ping().is_ok()).then_some(()));
    vmm
}

/// The guest's tap on a host: `kt0` in `ns` with `host`/24 and one MAC on every host (the
/// guest's neighbour entry for its gateway stays right after it moves).
fn guest_tap(g: &mut NetGuard, ns: &str, host: std::net::Ipv4Addr) {
    g.tap(ns, "kt0", Some(&format!("{host}/24"))).unwrap_or_else(|e| panic!("tap in {ns}: {e}"));
    let o = std::process::Command::new("ip")
        .args(["-n", ns, "link", "set", "kt0", "address", "02:6b:75:6d:6f:01"])
        .output()
        .expect("run ip");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn linux_migrates_between_two_hosts_driven_by_chs_routes_over_tls() {
    let test = "linux_migrates_between_two_hosts_driven_by_chs_routes_over_tls";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let hosts = match Netns::create() {
        Ok(n) => n,
        Err(e) if std::env::var_os("CI").is_some() => panic!("cannot create the test namespaces in CI: {e}"),
        Err(e) => return eprintln!("skipping {test}: {e}"),
    };
    let _one = linux::one_at_a_time();
    let (host, guest, _) = subnet(245);
    let mut taps = NetGuard::default();
    guest_tap(&mut taps, &hosts.a, host);
    guest_tap(&mut taps, &hosts.b, host);
    let dir = TestDir::new();
    let ch_bin = dir.path("cloud-hypervisor");
    std::os::unix::fs::symlink(kumo_bin(), &ch_bin).unwrap();
    // The image is on storage both hosts see (one file here), as a migration needs.
    let root = RootFs::create(dir.path("").as_path(), 32);
    let (src_sock, dst_sock) = (dir.path("src.sock"), dir.path("dst.sock"));
    let mut src = ch_vmm(&hosts.a, &ch_bin, &src_sock, "host-a");
    put(
        &src_sock,
        "vm.create",
        Some(json!({
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": 512u64 << 20},
            "payload": {
                "kernel": kernel.to_str().unwrap(),
                "cmdline": linux::cmdline(&format!("{} {}", linux::ip_arg(guest, host), linux::ROOT_ARGS))
            },
            "disks": [{"path": root.image.to_str().unwrap()}],
            "net": [{"tap": "kt0", "mac": "52:54:00:6b:75:01"}],
            "serial": {"mode": "Tty"}, "console": {"mode": "Off"}
        })),
    );
    put(&src_sock, "vm.boot", None);
    linux::expect_console(&mut src, IP_CONFIG_COMPLETE);
    linux::expect_console(&mut src, RUN_INIT);
    let on_a = Pinger::start_in(Some(&hosts.a), guest);
    on_a.wait_replies(0, 10, linux::effect_limit())
        .unwrap_or_else(|e| panic!("from host A: {e}\n{}", linux::console_tail(&src, 30)));

    // Each side proves itself with a certificate of one CA; B's names its veth address.
    let pki = Pki::new("kumo test cloud");
    let dst_tls = pki.dir(&dir.path("b-tls"), &["10.77.0.2"]);
    let src_tls = pki.dir(&dir.path("a-tls"), &["host-a.example"]);
    let dst = ch_vmm(&hosts.b, &ch_bin, &dst_sock, "host-b");
    let url = format!("tcp:10.77.0.2:{}", free_port());
    put(&dst_sock, "vm.receive-migration", Some(json!({"receiver_url": url, "tls_dir": dst_tls})));
    put(&src_sock, "vm.send-migration", Some(json!({"destination_url": url, "tls_dir": src_tls})));
    let (code, _, err) = src.finish(linux::boot_limit());
    assert_eq!(code, Some(0), "the source ends after handing the VM over: {err}");
    drop(on_a);

    // Host B reaches the guest on its own tap; the kernel writes its disk there.
    let seq = root.mmp_seq();
    let on_b = Pinger::start_in(Some(&hosts.b), guest);
    on_b.wait_replies(0, 10, linux::effect_limit())
        .unwrap_or_else(|e| panic!("from host B: {e}\n{}\n{}", dst.stdout(), dst.stderr()));
    root.wait_mmp_writes(seq, linux::effect_limit())
        .unwrap_or_else(|e| panic!("the disk on host B: {e}\n{}", dst.stderr()));
    let (_, info) = ch(&dst_sock, "GET", "vm.info", None);
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!((&info["config"]["net"][0]["tap"], &info["kumo"]["net"][0]["driver_ok"]), (&json!("kt0"), &json!(true)));
    assert_eq!(info["config"]["disks"][0]["path"], json!(root.image.to_str().unwrap()), "{info}");
    assert!(dst.stderr().contains("(mutual TLS, "), "B listened with TLS only: {}", dst.stderr());
    put(&dst_sock, "vmm.shutdown", None);
    let (code, out, err) = dst.finish(PATIENCE);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("EXT4-fs error") && !out.contains("I/O error"), "{out}");
}
