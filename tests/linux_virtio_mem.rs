//! virtio-mem with Linux's own driver as the judge (seed 002): two Linux VMs, each with a memory
//! zone (`--memory-zone`); A asks its driver to plug 128 MiB at boot, B nothing. `kumo lend
//! --memory 128M` from A to B has A's kernel unplug (its virtio-mem driver offlines the memory
//! and sends UNPLUG requests by itself), kumo fence and discard the blocks, then B's kernel plug
//! and online them; `kumo return` moves them back. The kernels' virtio-mem probe messages, their
//! requests as the devices saw them (`vm.info`'s plugged sizes) and both VMs' elastic records
//! must agree, and the records pass the exclusivity check.
//!
//! Ring-0 code is emulated here, so the kernels boot and offline memory slowly: every wait is
//! for a kernel message or a device-side size, bounded only as a hang guard.

use std::time::{Duration, Instant};

use kumo_testkit::kid::Kid;
use kumo_testkit::linux::{cmdline, test_kernel, BOOT_LIMIT};
use kumo_testkit::{kumo, text, vm_info, TestDir};

const MIB: u64 = 1 << 20;
/// Printed by the driver's probe: the last of its configuration lines.
const PROBED: &str = "requested size: 0x";
/// No disk behind `root=`: the kernel idles once booted. `online_movable` (the last
/// `memhp_default_state=` wins over the testkit's `online`): plugged memory goes to
/// ZONE_MOVABLE, so the kernel can always offline it again (in ZONE_NORMAL an unmovable
/// allocation pins a subblock: 4 MiB of 128 MiB stayed plugged when tried). `swiotlb=noforce`: with memory possible
/// above 4 GiB (the zone) Linux would otherwise set up a 64 MiB bounce buffer, which costs RAM
/// and, emulated here, minutes of boot; no device of these VMs needs it.
const CMDLINE: &str = "memhp_default_state=online_movable swiotlb=noforce root=/dev/vda rootwait";
/// How long a guest may take to plug or unplug 128 MiB here (a hang guard;
/// `KUMO_VMEM_GUEST_LIMIT_MS` overrides it, e.g. to see a broken device fail sooner).
fn guest_limit_ms() -> u64 {
    std::env::var("KUMO_VMEM_GUEST_LIMIT_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(600_000)
}

struct Vm {
    kid: Kid,
    sock: String,
}

fn start(dir: &TestDir, kernel: &std::path::Path, name: &str, plugged: &str) -> Vm {
    let sock = dir.path(&format!("{name}.sock")).display().to_string();
    let zone = format!("node=0,hotplug=256M,plugged={plugged}");
    let kernel = kernel.display().to_string();
    let args = [
        "run",
        "--kernel",
        &kernel,
        "--cpus",
        "1",
        "--memory",
        "512M",
        "--cmdline",
        &cmdline(CMDLINE),
        "--memory-zone",
        &zone,
        "--api-socket",
        &sock,
    ];
    Vm { kid: Kid::spawn(&args).named(name), sock }
}

/// (plugged, requested) of the VM's zone, as its device sees them.
fn sizes(vm: &Vm) -> (u64, u64) {
    let z = &vm_info(&vm.sock).memory_zones[0];
    (z.plugged_size, z.requested_size)
}

/// Waits until the VM's zone has `want` plugged (the guest's driver works at its own pace).
fn wait_plugged(vm: &mut Vm, want: u64) {
    let t = Instant::now();
    while sizes(vm).0 != want {
        assert!(vm.kid.try_exit().unwrap().is_none(), "{}", vm.kid.why("exited"));
        assert!(t.elapsed() < Duration::from_millis(guest_limit_ms()), "plugged {:?}, want {want}", sizes(vm));
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn lend(verb: &str, from: &Vm, to: &Vm) -> String {
    let limit = guest_limit_ms().to_string();
    let o = kumo(&[verb, "--from", &from.sock, "--to", &to.sock, "--memory", "128M", "--timeout-ms", &limit]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "kumo {verb} failed: {err}");
    out
}

fn records_overlap(a: &Vm, b: &Vm) -> kumo_elastic::record::Overlaps {
    let ea = kumo_api::ApiClient::new(&a.sock).elastic().unwrap().events;
    let eb = kumo_api::ApiClient::new(&b.sock).elastic().unwrap().events;
    kumo_elastic::record::check(&[("a", &ea), ("b", &eb)])
}

/// The driver's configuration line `what: 0x…` of a VM's console (complete lines only).
fn probe_value(vm: &Vm, what: &str) -> Option<u64> {
    let lines = vm.kid.lines();
    let line = lines.iter().map(|(_, l)| l).find(|l| l.contains("virtio_mem") && l.contains(what))?;
    let hex = line.split(what).nth(1)?.trim().trim_start_matches("0x");
    u64::from_str_radix(hex.split_whitespace().next()?, 16).ok()
}

#[test]
fn linux_lends_128m_through_virtio_mem_and_back() {
    let Some(kernel) = test_kernel("linux_lends_128m_through_virtio_mem_and_back") else { return };
    let dir = TestDir::new();
    let mut a = start(&dir, &kernel, "a", "128M");
    let mut b = start(&dir, &kernel, "b", "0");
    for vm in [&mut a, &mut b] {
        // Two kernels boot at once: twice one boot's hang guard.
        let limit = 2 * BOOT_LIMIT;
        // A complete line: the console arrives a byte at a time, and a match on the prefix alone
        // read `0x80` of `0x8000000` once.
        vm.kid.wait_line(limit, "the virtio-mem driver's probe", |l| l.contains(PROBED).then_some(())).unwrap();
    }
    // Both kernels read the region kumo placed above RAM (4 GiB), 2 MiB blocks.
    for vm in [&a, &b] {
        assert_eq!(probe_value(vm, "start address: "), Some(4 << 30), "{}", vm.kid.stdout());
        assert_eq!(probe_value(vm, "region size: "), Some(256 * MIB));
        assert_eq!(probe_value(vm, "device block size: "), Some(2 * MIB));
    }
    assert_eq!(probe_value(&a, PROBED.trim_end_matches("0x")), Some(128 * MIB));
    assert_eq!(probe_value(&b, PROBED.trim_end_matches("0x")), Some(0));
    // A's kernel plugs what it was asked for at boot.
    wait_plugged(&mut a, 128 * MIB);
    assert_eq!(sizes(&b), (0, 0));

    let out = lend("lend", &a, &b);
    println!("{out}");
    assert_eq!((sizes(&a), sizes(&b)), ((0, 0), (128 * MIB, 128 * MIB)));
    let out = lend("return", &b, &a);
    println!("{out}");
    assert_eq!((sizes(&a), sizes(&b)), ((128 * MIB, 128 * MIB), (0, 0)));

    let o = records_overlap(&a, &b);
    assert_eq!(o.total(), 0, "{:?}", o.details);
    // The records say what happened: A released and re-acquired, B acquired and released.
    let kinds = |vm: &Vm| -> Vec<(kumo_api::ElasticEventKind, u64)> {
        let e = kumo_api::ApiClient::new(&vm.sock).elastic().unwrap().events;
        e.iter().filter(|e| !e.at_boot).map(|e| (e.kind, e.bytes)).collect()
    };
    use kumo_api::ElasticEventKind::{MemAcquired, MemReleased};
    assert_eq!(kinds(&a), [(MemReleased, 128 * MIB), (MemAcquired, 128 * MIB)]);
    assert_eq!(kinds(&b), [(MemAcquired, 128 * MIB), (MemReleased, 128 * MIB)]);
    // Neither kernel complained, no request was refused, and both still run.
    for vm in [&mut a, &mut b] {
        let z = &vm_info(&vm.sock).memory_zones[0];
        assert_eq!((z.errors, z.driver_ok), (0, true), "{z:?}");
        let out = vm.kid.stdout();
        let bad = out.lines().filter(|l| l.contains("virtio_mem") && (l.contains("rror") || l.contains("ail")));
        assert_eq!(bad.count(), 0, "{out}");
        assert!(vm.kid.try_exit().unwrap().is_none(), "{}", vm.kid.why("exited"));
    }
}
