//! End to end: `kumo net-backend` serves QEMU's own vhost-user-net frontend (a frontend no one
//! here wrote). kumo's `netecho` guest runs in QEMU (`-netdev vhost-user`, guest RAM a shared
//! memfd as vhost-user needs) and answers the host's datagrams through the backend's tap; then
//! the NIC is handed to a kumo VM and back, each owner answering in turn.
//!
//! Needs QEMU, /dev/kvm and the right to create taps (root); skips, saying why, where one is
//! missing. Outcomes only: every wait is a safety net far above need.

use std::net::{Ipv4Addr, SocketAddrV4};

use kumo_testkit::backend::Backend;
use kumo_testkit::net::{subnet, tap_name, tap_or_skip_with, udp_echoes, Tap};
use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::*;

const MEM_MIB: u64 = 64;

/// QEMU running `netecho` on a vhost-user NIC at `sock`: guest RAM is a shared memfd (the
/// backend maps it), the NIC modern-only virtio-net-pci.
fn qemu_vm(sock: &str, guest: Ipv4Addr) -> QemuVm {
    let extra = sv(&[
        "-object",
        &format!("memory-backend-memfd,id=m,size={MEM_MIB}M,share=on"),
        "-numa",
        "node,memdev=m",
        "-chardev",
        &format!("socket,id=c,path={sock}"),
        "-netdev",
        "vhost-user,id=n,chardev=c",
        "-device",
        "virtio-net-pci,netdev=n,disable-legacy=on",
    ]);
    let spec = QemuSpec { extra_args: extra, ..QemuSpec::new("netecho", MEM_MIB, &[format!("ip={guest}")]) };
    QemuVm::spawn(&spec, None).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn qemu_frontend_is_served_and_its_nic_goes_to_a_kumo_vm_and_back() {
    let test = "qemu_frontend_is_served_and_its_nic_goes_to_a_kumo_vm_and_back";
    if !qemu::usable_or_skip(test) {
        return;
    }
    let (host, guest, _) = subnet(221);
    let Some(tap) = tap_or_skip_with(test, || Tap::create(&tap_name("hq"), &format!("{host}/24"))) else { return };
    let dir = TestDir::new();
    let backend = Backend::start(&dir, &tap.name);
    let echo = |who: &str, log: &dyn Fn() -> String| {
        udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE).unwrap_or_else(|e| {
            panic!("{who} echoes: {e}\n{}\nbackend:\n{}\n{}", log(), backend.kid.stderr(), backend.info())
        })
    };

    let mut q = qemu_vm(&backend.sock, guest);
    let out =
        q.wait_serial(": up nic=0", PATIENCE).unwrap_or_else(|e| panic!("{e}\nbackend:\n{}", backend.kid.stderr()));
    assert!(out.contains("52:54:00:12:34:56"), "the backend's MAC:\n{out}");
    let id_q = backend.ready_client(|_| true);
    backend.wait_owner(id_q);
    echo("netecho in QEMU", &|| q.serial());

    // A kumo VM joins (link down while QEMU's guest owns the NIC), takes it, and gives it back.
    let net = format!("vhost-user={}", backend.sock);
    let k = Kid::spawn(&["run", "--timeout", "0", "--net", &net, "--guest", "netecho", &format!("ip={guest}")])
        .named("kumo");
    k.wait_stdout(": up nic=0", PATIENCE);
    let id_k = backend.client_of(k.id());
    backend.hand_to(id_k);
    echo("netecho in kumo", &|| k.stdout());
    backend.hand_to(id_q);
    echo("netecho in QEMU, again", &|| q.serial());
    let info = backend.info();
    assert_eq!(info["handovers"].as_u64(), Some(2), "{info}");
    assert_eq!(info["foreign_serves"].as_u64(), Some(0), "{info}");
    drop(k);
}
