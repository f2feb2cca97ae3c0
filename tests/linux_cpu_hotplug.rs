//! CPU lending for Linux, the part the kernel does alone (docs/elastic.md, "CPU lending for
//! Linux guests"): kumo's test kernel on 2 vCPUs, `root=/dev/vda rootwait` without a disk so it
//! idles once booted. `vm.resize` to 1 vCPU sends an ACPI Eject Request for vCPU 1 through the
//! GED; the kernel offlines CPU 1 by itself ("smpboot: CPU 1 is now offline") and runs `_EJ0`,
//! and kumo parks the vCPU's thread (`vm.info` `parked_vcpus`). `vm.resize` back to 2 gives
//! it back with a Device Check: the kernel registers the CPU again ("CPU1 has been hot-added")
//! but leaves it offline (onlining it is userspace's job).
//!
//! Every wait is for a kernel message or a host-side effect; the limits only end a hung test.

use std::time::Duration;

use kumo_testkit::*;

/// The kernel's ACPI and device initcalls are done, and it waits for a root disk that never
/// comes: an idle kernel.
const IDLE: &str = "Waiting for root device /dev/vda";
const OFFLINE: &str = "CPU 1 is now offline";
const HOT_ADDED: &str = "CPU1 has been hot-added";
/// How long `vm.resize` waits for the guest (offlining a CPU is ring-0 work, emulated here).
const GUEST_LIMIT: Duration = Duration::from_secs(300);

#[test]
fn linux_ejects_a_vcpu_and_kumo_parks_it() {
    let Some(kernel) = linux::test_kernel("linux_ejects_a_vcpu_and_kumo_parks_it") else { return };
    let dir = TestDir::new();
    let sock = dir.path("api.sock");
    let s = sock.to_str().unwrap();
    let cmdline = linux::cmdline("root=/dev/vda rootwait");
    let mut vm = Kid::spawn(&[
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--cmdline",
        &cmdline,
        "--cpus",
        "2",
        "--memory",
        "512M",
        "--api-socket",
        s,
    ])
    .named("linux");
    vm.wait_for(linux::BOOT_LIMIT, IDLE, |out, _| out.contains(IDLE).then_some(())).unwrap_or_else(|e| panic!("{e}"));
    let api = kumo_api::ApiClient::new(s);
    assert_eq!(api.info().unwrap().parked_vcpus, Vec::<u32>::new());

    // Give vCPU 1 up: the kernel offlines it and ejects it, kumo parks it.
    api.resize(1, GUEST_LIMIT.as_millis() as u64).unwrap_or_else(|e| panic!("vm.resize to 1: {e}\n{}", vm.stdout()));
    vm.wait_for(GUEST_LIMIT, OFFLINE, |out, _| out.contains(OFFLINE).then_some(())).unwrap_or_else(|e| panic!("{e}"));
    assert!(!vm.stdout().contains("Eject incomplete"), "the kernel saw vCPU 1 still present after _EJ0");
    assert_eq!(api.info().unwrap().parked_vcpus, [1], "kumo parked the ejected vCPU");

    // Take it back: the kernel registers the CPU again (offline: onlining needs userspace).
    api.resize(2, GUEST_LIMIT.as_millis() as u64).unwrap_or_else(|e| panic!("vm.resize to 2: {e}\n{}", vm.stdout()));
    vm.wait_for(GUEST_LIMIT, HOT_ADDED, |out, _| out.contains(HOT_ADDED).then_some(()))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(api.info().unwrap().parked_vcpus, Vec::<u32>::new(), "vCPU 1 runs again");
    let out = vm.stdout();
    assert!(!out.contains("ACPI Error") && !out.contains("ACPI BIOS Error"), "AML errors:\n{out}");
}
