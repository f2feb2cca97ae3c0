//! Linux as the judge of kumo's interrupt controllers and guest NUMA: the test kernel answers
//! the host's pings with `--irqchip user` (its NIC's MSI-X interrupts delivered by kumo's own
//! userspace LAPIC, its timer too), and with two guest NUMA nodes (the second one memory alone) it finds both in kumo's ACPI
//! SRAT (its boot log sets up node 0 and node 1) and answers pings.
//!
//! Needs /dev/kvm, a tap (root) and the test kernel; skips, saying why, without them. Every
//! wait is for a kernel message or a ping reply, bounded by `linux::boot_limit()` and
//! `linux::effect_limit()` only as hang guards.

use std::net::Ipv4Addr;

use kumo_testkit::linux::{self, Pinger, IP_CONFIG_COMPLETE};
use kumo_testkit::net::{subnet, tap_or_skip};
use kumo_testkit::{Kid, TestDir};

/// Boots the test kernel with a NIC on `tap` and `args`, until it answers 5 pings.
fn boot_and_ping(kernel: &std::path::Path, tap: &str, args: &[&str], guest: Ipv4Addr, host: Ipv4Addr) -> Kid {
    let cmdline = linux::cmdline(&format!("{} root=/dev/vda rootwait", linux::ip_arg(guest, host)));
    let net = format!("tap={tap}");
    let mut a = vec!["--net", net.as_str()];
    a.extend_from_slice(args);
    let mut vm = linux::spawn(kernel, &cmdline, &a, &args.join(" "));
    linux::expect_console(&mut vm, IP_CONFIG_COMPLETE);
    let pinger = Pinger::start(guest);
    pinger
        .wait_replies(0, 5, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{e}\n{}", linux::console_tail(&vm, 30)));
    linux::print_milestones(&vm);
    vm
}

#[test]
fn linux_answers_pings_through_kumos_userspace_apic() {
    let test = "linux_answers_pings_through_kumos_userspace_apic";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(246);
    let Some(tap) = tap_or_skip(test, "la", host) else { return };
    let _one = linux::one_at_a_time();
    let dir = TestDir::new();
    let sock = dir.arg("api.sock");
    let vm = boot_and_ping(&kernel, &tap.name, &["--irqchip", "user", "--api-socket", &sock], guest, host);
    let info = kumo_testkit::vm_info(&sock);
    let v = serde_json::to_value(&info).expect("vm.info is JSON");
    assert_eq!(v["irqchip"], "user", "{v}");
    drop(vm);
}

#[test]
fn linux_finds_two_numa_nodes_and_answers_pings() {
    let test = "linux_finds_two_numa_nodes_and_answers_pings";
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(247);
    let Some(tap) = tap_or_skip(test, "lm", host) else { return };
    let _one = linux::one_at_a_time();
    // One vCPU (node 0's); node 1 has memory alone.
    let numa = ["--numa", "node=0,cpus=0,memory=256M", "--numa", "node=1,memory=256M"];
    let vm = boot_and_ping(&kernel, &tap.name, &numa, guest, host);
    let console = vm.stdout();
    for want in [
        "SRAT: PXM 0 -> APIC 0x00 -> Node 0",
        "PXM 0 [mem",
        "PXM 1 [mem",
        "Initmem setup node 0",
        "Initmem setup node 1",
    ] {
        assert!(console.contains(want), "no `{want}` in the boot log:\n{console}");
    }
    assert!(!console.contains("No NUMA configuration found"), "{console}");
}
