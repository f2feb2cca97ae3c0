//! Linux as the judge of kumo's virtio-net NIC: the test kernel's own virtio-net driver (built
//! in) brings the NIC up, configures `ip=` on it ("IP-Config: Complete") and answers the host's
//! pings through a tap, on each interrupt path (`irq=direct`, `dedicated`, `shared`) and with two
//! queue pairs (Linux turns the second one on through the control queue).
//!
//! One boot per path: `ip=` configures eth0 alone, so one VM with several NICs would not test
//! the others. Needs /dev/kvm, a tap (root) and the test kernel; skips, saying why, without
//! them. Every wait is for a kernel message or a ping reply, bounded by `linux::boot_limit()` and
//! `linux::effect_limit()` only as hang guards.

use std::net::Ipv4Addr;

use kumo_testkit::linux::{self, Pinger, IP_CONFIG_COMPLETE};
use kumo_testkit::net::{subnet, tap_or_skip};
use kumo_testkit::{vm_info, TestDir};

/// Boots the test kernel with `--net NET` (plus `args`), waits for its IP configuration and
/// its answers to the host's pings; returns the NIC's interrupt count and the VM's count of
/// interrupts through the shared path.
fn boots_and_answers(
    kernel: &std::path::Path,
    net: &str,
    args: &[&str],
    guest: Ipv4Addr,
    host: Ipv4Addr,
) -> (u64, u64) {
    let dir = TestDir::new();
    let sock = dir.arg("api.sock");
    // No disk: `rootwait` leaves the kernel idle, serving the network.
    let cmdline = linux::cmdline(&format!("{} root=/dev/vda rootwait", linux::ip_arg(guest, host)));
    let mut a = vec!["--net", net, "--api-socket", &sock];
    a.extend_from_slice(args);
    let mut vm = linux::spawn(kernel, &cmdline, &a, net);
    linux::expect_console(&mut vm, IP_CONFIG_COMPLETE);
    let pinger = Pinger::start(guest);
    pinger
        .wait_replies(0, 5, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{net}: {e}\n{}", linux::console_tail(&vm, 30)));
    linux::print_milestones(&vm);
    let nic = vm_info(&sock).net.remove(0);
    assert!(nic.driver_ok, "{net}: {nic:?}");
    // Linux's driver takes the tap's checksum and TCP segmentation offloads both ways, unless
    // the NIC offers none.
    let wanted = ["csum", "guest_csum", "guest_tso4", "host_tso4"];
    if net.contains("offload=off") {
        assert!(nic.offloads.is_empty(), "{net}: {nic:?}");
    } else {
        assert!(wanted.iter().all(|w| nic.offloads.iter().any(|o| o == w)), "{net}: {nic:?}");
    }
    let c = kumo_api::ApiClient::new(&sock).counters().unwrap_or_else(|e| panic!("vm.counters: {e}"));
    let c = serde_json::to_value(c).expect("counters are JSON");
    let irqs = c["net"]["net0"]["interrupts"].as_u64().unwrap_or(0);
    let shared = c["interrupts"]["shared_path"].as_u64().unwrap_or(0);
    assert!(c["net"]["net0"]["rx_frames"].as_u64() >= Some(5), "{net}: {c}");
    (irqs, shared)
}

#[test]
fn linux_configures_ip_and_answers_pings_on_each_interrupt_path() {
    let test = "linux_configures_ip_and_answers_pings_on_each_interrupt_path";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(241);
    let Some(tap) = tap_or_skip(test, "ln", host) else { return };
    let _one = linux::one_at_a_time();
    for irq in ["direct", "dedicated,vcpu=0", "shared"] {
        // The shared path's run also turns the offloads off.
        let off = if irq == "shared" { ",offload=off" } else { "" };
        let net = format!("tap={},irq={irq}{off}", tap.name);
        let (irqs, shared) = boots_and_answers(&kernel, &net, &[], guest, host);
        assert!(irqs > 0, "{irq}: the NIC raised interrupts");
        match irq {
            "shared" => assert!(shared > 0, "the shared path's dispatcher injected them"),
            _ => assert_eq!(shared, 0, "{irq}: nothing went through the shared path"),
        }
    }
}

#[test]
fn linux_answers_pings_with_two_queue_pairs() {
    let test = "linux_answers_pings_with_two_queue_pairs";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(242);
    let Some(tap) = tap_or_skip(test, "lq", host) else { return };
    let _one = linux::one_at_a_time();
    let net = format!("tap={},queues=2", tap.name);
    let (irqs, _) = boots_and_answers(&kernel, &net, &["--cpus", "2"], guest, host);
    assert!(irqs > 0, "the NIC raised interrupts");
}
