//! CPU lending for Linux, the part the kernel does alone (docs/elastic.md, "CPU lending for
//! Linux guests"): kumo's test kernel with 2 vCPUs, `root=/dev/vda rootwait` without a disk so
//! it idles once booted. `vm.resize` to 1 vCPU sends an ACPI Eject Request for vCPU 1 through
//! the GED; the kernel takes CPU 1 offline by itself if it is online, runs `_EJ0`, and kumo
//! parks the vCPU's thread (`vm.info` `parked_vcpus`). `vm.resize` back to 2 gives it back
//! with a Device Check: the kernel registers the CPU again ("CPU1 has been hot-added") but
//! leaves it offline (onlining it is userspace's job).
//!
//! Every wait is for a kernel message or a host-side effect; the limits only end a hung test.
//!
//! Both tests are ignored until seen passing: on the overloaded host they were written on, no
//! boot reached the idle point within `BOOT_LIMIT` (the furthest probed kumo's power button
//! from the DSDT). Run them with `--ignored`.

use std::time::Duration;

use kumo_testkit::*;

/// The kernel's ACPI and device initcalls are done, and it waits for a root disk that never
/// comes: an idle kernel.
const IDLE: &str = "Waiting for root device /dev/vda";
const OFFLINE: &str = "CPU 1 is now offline";
const HOT_ADDED: &str = "CPU1 has been hot-added";
/// How long `vm.resize` waits for the guest (offlining a CPU is ring-0 work, emulated here).
const GUEST_LIMIT: Duration = Duration::from_secs(300);
const TAIL: usize = 40;

fn tail(vm: &Kid) -> String {
    let out = vm.stdout();
    let lines: Vec<&str> = out.lines().collect();
    lines[lines.len().saturating_sub(TAIL)..].join("\n")
}

fn wait_kernel(vm: &mut Kid, limit: Duration, what: &str) {
    if let Err(e) = vm.wait_for(limit, what, |out, _| out.contains(what).then_some(())) {
        panic!("{e}\n--- kernel log (tail) ---\n{}", tail(vm));
    }
}

/// Boots the test kernel on 2 vCPUs with `extra` on its command line until it idles; `None`
/// (after saying why) where there is no KVM or kernel.
fn boot(test: &str, dir: &TestDir, extra: &str) -> Option<(Kid, kumo_api::ApiClient)> {
    let kernel = linux::test_kernel(test)?;
    let sock = dir.path("api.sock");
    let s = sock.to_str().unwrap();
    // The TSC-deadline timer: without it a boot with 2 possible CPUs here sometimes stops
    // after "vgaarb: loaded" (the clocksource switch), with or without the GED.
    let cmdline = linux::cmdline(&format!("root=/dev/vda rootwait lapic=notscdeadline {extra}"));
    let args = ["run", "--kernel", kernel.to_str().unwrap(), "--cmdline", &cmdline, "--cpus", "2"];
    let mut vm = Kid::spawn(&[&args[..], &["--memory", "512M", "--api-socket", s]].concat()).named("linux");
    wait_kernel(&mut vm, linux::BOOT_LIMIT, IDLE);
    let api = kumo_api::ApiClient::new(s);
    assert_eq!(api.info().unwrap().parked_vcpus, Vec::<u32>::new());
    Some((vm, api))
}

fn resize(vm: &Kid, api: &kumo_api::ApiClient, n: u32) {
    if let Err(e) = api.resize(n, GUEST_LIMIT.as_millis() as u64) {
        panic!("vm.resize to {n}: {e}\n--- kernel log (tail) ---\n{}", tail(vm));
    }
}

/// Gives vCPU 1 back and checks the kernel took it (registered, offline).
fn give_back(vm: &mut Kid, api: &kumo_api::ApiClient) {
    resize(vm, api, 2);
    wait_kernel(vm, GUEST_LIMIT, HOT_ADDED);
    assert_eq!(api.info().unwrap().parked_vcpus, Vec::<u32>::new(), "vCPU 1 runs again");
    let out = vm.stdout();
    assert!(!out.contains("ACPI Error") && !out.contains("ACPI BIOS Error"), "AML errors:\n{out}");
}

/// CPU 1 present but never started (`maxcpus=1`): the kernel ejects it when asked and kumo
/// parks it; given back, the kernel registers it again.
#[test]
#[ignore = "not yet seen passing: boots here did not reach the idle point in time (see the module doc)"]
fn linux_ejects_an_offline_vcpu_and_takes_it_back() {
    let dir = TestDir::new();
    let Some((mut vm, api)) = boot("linux_ejects_an_offline_vcpu_and_takes_it_back", &dir, "maxcpus=1") else {
        return;
    };
    resize(&vm, &api, 1);
    assert_eq!(api.info().unwrap().parked_vcpus, [1], "kumo parked the ejected vCPU");
    assert!(!vm.stdout().contains("Eject incomplete"), "the kernel saw vCPU 1 still present after _EJ0");
    give_back(&mut vm, &api);
}

/// Both CPUs online: the kernel offlines CPU 1 itself before it ejects it.
#[test]
#[ignore = "not yet seen passing: boots here did not reach the idle point in time (see the module doc)"]
fn linux_offlines_and_ejects_an_online_vcpu() {
    let dir = TestDir::new();
    let Some((mut vm, api)) = boot("linux_offlines_and_ejects_an_online_vcpu", &dir, "") else { return };
    resize(&vm, &api, 1);
    wait_kernel(&mut vm, GUEST_LIMIT, OFFLINE);
    assert_eq!(api.info().unwrap().parked_vcpus, [1], "kumo parked the ejected vCPU");
    assert!(!vm.stdout().contains("Eject incomplete"), "the kernel saw vCPU 1 still present after _EJ0");
    give_back(&mut vm, &api);
}
