//! End to end under QEMU: kumo's guest network driver and stack (guests/src/net/) on QEMU's
//! virtio-net-pci (modern only, MSI-X) over a host tap. The host pings `netecho` and gets UDP
//! datagrams echoed; `udpping` measures round trips to a UDP echo service on the host;
//! `udpsend`'s stream reaches a host socket. The guest driver uses only the PCI and virtio
//! specs, so the same programs run on kumo's own NIC.
//!
//! Needs QEMU, /dev/kvm and the right to create a tap (root, `ip`); skips, saying why, when one
//! is missing. The host's `ping` part is skipped (with a message) where `ping` is not installed.
//! Outcomes only: no durations are asserted, and every wait is a safety net far above need.

use kumo_guests::net;
use kumo_testkit::net::{have_ping, HostEcho, Tap};
use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::sv;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::process::Command;
use std::time::Duration;

/// A safety net against hangs only: far above what anything takes, even on a busy machine.
const LIMIT: Duration = Duration::from_secs(300);
const GUEST_MAC: &str = "52:54:00:12:34:56";

/// Boots `guest` with `args` and NIC 0 on `tap`; returns once the guest says NIC 0 is up.
fn boot(guest: &str, args: &[String], tap: &str, guest_ip: Ipv4Addr) -> QemuVm {
    let spec = QemuSpec { extra_args: qemu::virtio_net_args(tap, GUEST_MAC), ..QemuSpec::new(guest, 64, args) };
    let mut vm = QemuVm::spawn(&spec, None).unwrap_or_else(|e| panic!("{e}"));
    let out = vm.wait_serial(": up nic=0", LIMIT).unwrap_or_else(|e| panic!("{e}"));
    let (mac, ip) = net::ready_line(&out).unwrap_or_else(|| panic!("no ready line:\n{out}"));
    assert_eq!(mac, [0x52, 0x54, 0, 0x12, 0x34, 0x56], "{out}");
    assert_eq!(ip, guest_ip, "{out}");
    vm
}

#[test]
fn guests_talk_udp_and_icmp_over_qemu_virtio_net() {
    let test = "guests_talk_udp_and_icmp_over_qemu_virtio_net";
    if !qemu::usable_or_skip(test) {
        return;
    }
    // A subnet and tap of this process's own, so parallel runs do not collide.
    let id = std::process::id();
    let (net3, tap_name) = ((id % 250) as u8, format!("kgn{}", id % 100_000));
    let host = Ipv4Addr::new(10, 211, net3, 1);
    let guest = Ipv4Addr::new(10, 211, net3, 2);
    let tap = match Tap::create(&tap_name, &format!("{host}/24")) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipping {test}: cannot create a tap: {e}");
            return;
        }
    };
    let g = guest.to_string();

    // netecho: the host pings it and gets UDP datagrams echoed; it exits after 4 echoes.
    let mut vm = boot("netecho", &sv(&[&format!("ip={g}"), "count=4"]), &tap.name, guest);
    let pinged = have_ping();
    if pinged {
        let o = Command::new("ping").args(["-c", "3", "-i", "0.2", "-W", "30", &g]).output().expect("run ping");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && text.contains("3 received"), "ping {g}:\n{text}\n{}", vm.serial());
    } else {
        eprintln!("{test}: `ping` is not installed: the ICMP part is skipped");
    }
    let sock = UdpSocket::bind(SocketAddrV4::new(host, 0)).expect("bind a host UDP socket");
    sock.set_read_timeout(Some(LIMIT)).expect("read timeout");
    for i in 0..4u8 {
        let msg = [i; 100];
        sock.send_to(&msg, SocketAddrV4::new(guest, 7)).expect("send to netecho");
        let mut buf = [0u8; 2048];
        let (n, from) = sock.recv_from(&mut buf).unwrap_or_else(|e| panic!("no echo: {e}\n{}", vm.serial()));
        assert_eq!(&buf[..n], &msg[..]);
        assert_eq!(from, SocketAddrV4::new(guest, 7).into());
    }
    assert_eq!(vm.wait_exit(LIMIT), Ok(0));
    let e = net::parse_netecho(&vm.serial()).unwrap_or_else(|| panic!("no result line:\n{}", vm.serial()));
    assert_eq!(e.echoed, 4);
    // Interrupt mode: NIC 0's MSI-X interrupts arrived, on the consumer vCPU itself.
    let irqs = net::parse_irqs(&vm.serial()).unwrap_or_else(|| panic!("no irqs line:\n{}", vm.serial()));
    assert!(irqs.nic0 > 0 && irqs.forwarded == 0, "{irqs:?}");
    if pinged {
        assert!(e.pings >= 3, "{e:?}");
    }
    drop(vm);

    // udpping to an echo service on the host, polling (netecho and udpsend wait for interrupts):
    // every request answered (the timeout is a safety net: a slow host cannot turn into losses).
    let echo = HostEcho::start(SocketAddrV4::new(host, 7));
    let args = sv(&[&format!("ip={g}"), &format!("peer={host}"), "count=20", "timeout_ms=60000", "wait=poll"]);
    let mut vm = boot("udpping", &args, &tap.name, guest);
    assert_eq!(vm.wait_exit(LIMIT), Ok(0), "{}", vm.serial());
    let p = net::parse_udpping(&vm.serial()).unwrap_or_else(|| panic!("no result line:\n{}", vm.serial()));
    assert_eq!((p.count, p.lost), (20, 0), "{p:?}");
    assert!(p.min_us <= p.p50_us && p.p50_us <= p.p99_us && p.p99_us <= p.max_us, "{p:?}");
    assert_eq!(net::parse_irqs(&vm.serial()).map(|i| i.nic0), Some(0), "polling takes no interrupts");
    drop((vm, echo));

    // udpsend's stream reaches a host socket: its datagrams and the end marker, in its format.
    let sink = UdpSocket::bind(SocketAddrV4::new(host, 9)).expect("bind the host sink");
    sink.set_read_timeout(Some(LIMIT)).expect("read timeout");
    let args = sv(&[&format!("ip={g}"), &format!("peer={host}"), "count=50", "size=200", "gap_us=100"]);
    let mut vm = boot("udpsend", &args, &tap.name, guest);
    let (mut got, mut buf) = (Vec::new(), [0u8; 2048]);
    loop {
        let (n, _) = sink.recv_from(&mut buf).unwrap_or_else(|e| panic!("stream stopped: {e}\n{}", vm.serial()));
        assert_eq!(n, 200);
        let (seq, total) = net::parse_stream_payload(&buf[..n]).expect("a stream header");
        assert_eq!(total, 50);
        if seq == net::STREAM_END {
            break;
        }
        got.push(seq);
    }
    assert_eq!(vm.wait_exit(LIMIT), Ok(0));
    assert_eq!(net::parse_udpsend(&vm.serial()), Some(50));
    assert!(!got.is_empty() && got.iter().all(|&s| s < 50), "{got:?}");
    assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order or duplicated: {got:?}");
}
