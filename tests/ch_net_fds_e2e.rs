//! Taps passed as file descriptors (docs/ch-compat.md): as current libvirt does, the test opens
//! the tap itself (TUNSETIFF on /dev/net/tun) and sends its descriptor as SCM_RIGHTS with
//! `vm.add-net`; kumo's `netecho` guest, booted through CH's API, answers pings and UDP through
//! that tap, and again after `vm.reboot`. A snapshot of it restores only on a tap given again: `vm.restore` with `net_fds`
//! and a fresh descriptor.
//!
//! Needs /dev/kvm and the right to create taps (root); skips, saying why, where either is
//! missing. Outcomes only: every wait is a safety net far above need.

use std::fs::{File, OpenOptions};
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use kumo_api::ApiClient;
use kumo_testkit::net::{have_ping, ping, subnet, tap_or_skip, udp_echoes};
use kumo_testkit::*;
use serde_json::{json, Value};

/// Opens tap `name`'s queue as libvirt does: `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` (and
/// `IFF_MULTI_QUEUE`: testkit's taps are multi-queue).
fn open_tap(name: &str) -> File {
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    let f = OpenOptions::new().read(true).write(true).open("/dev/net/tun").expect("/dev/net/tun");
    let mut req = IfReq { name: [0; 16], flags: 0x0002 | 0x1000 | 0x4000 | 0x0100, _pad: [0; 22] };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is; the fd is ours.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
    assert_eq!(r, 0, "TUNSETIFF {name}: {}", std::io::Error::last_os_error());
    f
}

fn put(sock: &Path, route: &str, body: Value, fds: &[&File]) -> (u16, Value) {
    let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let (status, b) = ApiClient::new(sock)
        .request_with_fds("PUT", &format!("/api/v1/{route}"), Some(&body), &fds)
        .unwrap_or_else(|e| panic!("{route}: {e}"));
    (status, b.unwrap_or(Value::Null))
}

fn empty_vmm(dir: &TestDir, name: &str) -> (Kid, std::path::PathBuf) {
    let sock = dir.path(&format!("{name}.sock"));
    let vmm = Kid::spawn(&["run", "--api-socket", sock.to_str().unwrap()]).named(name);
    eventually(PATIENCE, || (sock.exists() && ApiClient::new(&sock).ping().is_ok()).then_some(()));
    (vmm, sock)
}

fn echoes(host: std::net::Ipv4Addr, guest: std::net::Ipv4Addr, vm: &Kid, when: &str) {
    if have_ping() {
        let (got, text) = ping(&guest.to_string(), 3, 60);
        assert_eq!(got, 3, "ping {guest} {when}:\n{text}\n{}", vm.stdout());
    }
    udp_echoes(SocketAddrV4::new(host, 0), SocketAddrV4::new(guest, 7), 3, PATIENCE)
        .unwrap_or_else(|e| panic!("{when}: {e}\n{}", vm.stdout()));
}

#[test]
fn a_tap_passed_as_a_descriptor_carries_the_guests_traffic_and_restores_on_a_new_one() {
    let test = "a_tap_passed_as_a_descriptor_carries_the_guests_traffic_and_restores_on_a_new_one";
    let (host, guest, _) = subnet(248);
    let Some(tap) = tap_or_skip(test, "fd", host) else { return };
    let dir = TestDir::new();
    let kernel = dir.path("netecho.elf");
    std::fs::write(&kernel, kumo_guests::find("netecho").unwrap().elf).unwrap();
    let (vmm, sock) = empty_vmm(&dir, "ch");
    let create = json!({"payload": {"kernel": kernel, "cmdline": format!("ip={guest}")}, "memory": {"size": 64 << 20}});
    assert_eq!(put(&sock, "vm.create", create, &[]).0, 204);
    // Not a tap: refused, nothing added.
    let null = File::open("/dev/null").unwrap();
    let (status, b) = put(&sock, "vm.add-net", json!({"fds": [-1]}), &[&null]);
    assert_eq!(status, 400, "{b}");
    assert!(b["error"].as_str().unwrap().contains("is not a tap's"), "{b}");
    // libvirt's shape: placeholders in `fds`, CH's queue count, the descriptor alongside.
    let fd = open_tap(&tap.name);
    let mac = "52:54:00:12:34:56";
    let (status, b) = put(&sock, "vm.add-net", json!({"fds": [-1], "mac": mac, "num_queues": 2}), &[&fd]);
    assert_eq!(status, 204, "{b}");
    drop(fd); // kumo holds its own copy, as after libvirt's send
    assert_eq!(put(&sock, "vm.boot", json!({}), &[]).0, 204);
    vmm.wait_stdout(": up nic=0", PATIENCE);
    echoes(host, guest, &vmm, "through the passed tap");
    let info = ApiClient::new(&sock).request("GET", "/api/v1/vm.info", None).unwrap().1.unwrap();
    let net = &info["config"]["net"][0];
    assert!(net["fds"].as_array().is_some_and(|f| f.len() == 1 && f[0].as_i64() > Some(2)), "{info}");
    assert_eq!(info["kumo"]["net"][0]["tap"], json!(tap.name), "{info}");
    assert_eq!(info["kumo"]["net"][0]["mac"], json!(mac), "{info}");
    // vm.reboot builds the VM again on the same descriptors (the created VM keeps them).
    assert_eq!(put(&sock, "vm.reboot", json!({}), &[]).0, 204);
    eventually(PATIENCE, || (vmm.stdout().matches(": up nic=0").count() >= 2).then_some(()));
    echoes(host, guest, &vmm, "after vm.reboot");

    // Snapshot, then restore in a new VMM: the tap came as a descriptor, so it is not reopened
    // by name; a fresh descriptor is needed.
    assert_eq!(put(&sock, "vm.pause", json!({}), &[]).0, 204);
    let snap = dir.path("snap");
    std::fs::create_dir(&snap).unwrap();
    let (status, b) = put(&sock, "vm.snapshot", json!({"destination_url": format!("file://{}", snap.display())}), &[]);
    assert_eq!(status, 200, "{b}");
    assert_eq!(put(&sock, "vmm.shutdown", json!({}), &[]).0, 204);
    let (code, out, err) = vmm.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");

    let (vmm, sock) = empty_vmm(&dir, "restored");
    let source_url = format!("file://{}", snap.display());
    let (status, b) = put(&sock, "vm.restore", json!({"source_url": source_url}), &[]);
    assert_eq!(status, 400, "{b}");
    assert!(b["error"].as_str().unwrap().contains("passed as descriptors on its source"), "{b}");
    let fd = open_tap(&tap.name);
    let body = json!({"source_url": source_url, "net_fds": [{"id": "net0", "num_fds": 1, "fds": [-1]}]});
    let (status, b) = put(&sock, "vm.restore", body, &[&fd]);
    assert_eq!(status, 200, "{b}");
    drop(fd);
    assert_eq!(put(&sock, "vm.resume", json!({}), &[]).0, 204);
    echoes(host, guest, &vmm, "after the restore, through the new descriptor");
    let info = ApiClient::new(&sock).info().unwrap();
    assert_eq!((info.net[0].tap.as_str(), info.net[0].mac.as_str()), (tap.name.as_str(), mac));
    assert_eq!(put(&sock, "vmm.shutdown", json!({}), &[]).0, 204);
    let (code, out, err) = vmm.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");
}
