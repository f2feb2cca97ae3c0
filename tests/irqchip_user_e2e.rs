//! End to end: `kumo run --irqchip user` (kumo's own LAPICs, no irqchip in KVM) with kumo's
//! guests: xAPIC MMIO, the TSC-deadline timer (memtouch's rate limit idles on it) and IPIs
//! between vCPUs (smp).

use kumo_testkit::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

fn run_user(args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["run", "--irqchip", "user", "--timeout", "60"];
    all.extend_from_slice(args);
    Kid::spawn(&all).finish(LIMIT)
}

#[test]
fn hello_runs_on_the_user_apic() {
    if !kvm_or_skip("hello_runs_on_the_user_apic") {
        return;
    }
    let (code, out, err) = run_user(&["--guest", "hello"]);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("Hello from kumo guest!"), "{out}");
}

#[test]
fn memtouch_checksum_and_timer_idle_on_the_user_apic() {
    if !kvm_or_skip("memtouch_checksum_and_timer_idle_on_the_user_apic") {
        return;
    }
    let (code, out, err) =
        run_user(&["--guest", "memtouch", "--memory", "64M", "pages=3000", "writes=20000", "seed=7"]);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let sum = field(&out, "memtouch: checksum", "checksum").expect("checksum line");
    let want = kumo_guests::memtouch::expected_checksum(3000, 20000, 7, true);
    assert_eq!(u64::from_str_radix(&sum, 16).unwrap(), want, "{out}");
    // A rate limit idles between writes on the LAPIC TSC-deadline timer: it only finishes if
    // kumo's timer fires and its interrupt is injected.
    let (code, out, err) = run_user(&["--guest", "memtouch", "pages=100", "writes=500", "rate=5000", "report_ms=20"]);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(field(&out, "memtouch: done", "writes").as_deref(), Some("500"), "{out}");
}

#[test]
fn smp_ipis_on_the_user_apic() {
    if !kvm_or_skip("smp_ipis_on_the_user_apic") {
        return;
    }
    for cpus in ["2", "4"] {
        let (code, out, err) = run_user(&["--guest", "smp", "--cpus", cpus, "iters=100"]);
        assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
        assert!(out.contains(&format!("smp: {cpus}/{cpus} vcpus online")), "{out}");
        assert_eq!(field(&out, "smp: ipi_rtt_cycles", "iters").as_deref(), Some("100"), "{out}");
    }
}

#[test]
fn halted_guest_pauses_resumes_and_reads_input_on_the_user_apic() {
    if !kvm_or_skip("halted_guest_pauses_resumes_and_reads_input_on_the_user_apic") {
        return;
    }
    let dir = TestDir::new();
    let sock = dir.path("api.sock");
    let s = sock.to_str().unwrap();
    // After its writes memtouch idles (halted, woken by its LAPIC timer every 10 ms) until a
    // byte arrives on the console.
    let mut vm = Kid::spawn(&[
        "run",
        "--irqchip",
        "user",
        "--cpus",
        "2",
        "--guest",
        "memtouch",
        "pages=64",
        "writes=1000",
        "hold_input=1",
        "--api-socket",
        s,
    ]);
    vm.wait_stdout("memtouch: checksum=", LIMIT);
    let info = || {
        let o = kumo(&["--api-socket", s, "info"]);
        serde_json::from_slice::<serde_json::Value>(&o.stdout).ok()
    };
    let v = eventually(LIMIT, info);
    assert_eq!(v["irqchip"], "user", "{v}");
    // PV unhalt would be a KVM LAPIC delivery: off without it.
    assert_eq!(v["pv"]["pv_unhalt"], false, "{v}");
    // Halted vCPUs wait in kumo: a pause must still reach them.
    eventually(LIMIT, || kumo(&["--api-socket", s, "pause"]).status.success().then_some(()));
    assert!(kumo(&["--api-socket", s, "resume"]).status.success());
    vm.input(b"q");
    let (code, out, err) = vm.finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let sum = field(&out, "memtouch: checksum", "checksum").expect("checksum line");
    assert_eq!(field(&out, "memtouch: checksum_after_hold", "checksum_after_hold"), Some(sum), "{out}");
}

#[test]
fn a_snapshot_of_a_user_apic_vm_runs_on_in_a_new_process() {
    if !kvm_or_skip("a_snapshot_of_a_user_apic_vm_runs_on_in_a_new_process") {
        return;
    }
    let dir = TestDir::new();
    let (sock, sock2, file) = (dir.arg("src.sock"), dir.arg("dst.sock"), dir.path("user.snap"));
    // Rate-limited: memtouch idles on its LAPIC timer between writes, before and after.
    let src = Kid::spawn(&[
        "run",
        "--irqchip",
        "user",
        "--guest",
        "memtouch",
        "--cpus",
        "2",
        "--memory",
        "64M",
        "pages=3000",
        "rate=20000",
        "seed=7",
        "until_input=1",
        "report_ms=5",
        "--api-socket",
        &sock,
    ]);
    src.wait_stdout("memtouch: progress", LIMIT);
    let o = kumo(&["--api-socket", &sock, "snapshot", "--to", file.to_str().unwrap()]);
    assert!(o.status.success(), "{:?}", text(&o));
    let snap = std::fs::read(&file).unwrap();
    let has = |w: &str| snap.windows(w.len()).any(|x| x == w.as_bytes());
    assert!(has("\"lapic0\"") && has("\"lapic1\"") && has("\"ioapic\""), "the APICs are in the snapshot");
    assert!(kumo(&["--api-socket", &sock, "shutdown"]).status.success());
    let (code, _, err) = src.wait();
    assert_eq!(code, Some(0), "{err}");

    let mut dst = Kid::spawn(&["run", "--restore", file.to_str().unwrap(), "--api-socket", &sock2]);
    let v = eventually(LIMIT, || {
        let o = kumo(&["--api-socket", &sock2, "info"]);
        serde_json::from_slice::<serde_json::Value>(&o.stdout).ok()
    });
    assert_eq!(v["irqchip"], "user", "{v}");
    dst.input(b"q");
    let (code, out, err) = dst.finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(!out.contains("memtouch: pages="), "the guest must carry on, not restart:\n{out}");
    check_memtouch(&out, 3000, 7, true);
}

/// A Linux kernel for the banner test: `KUMO_LINUX_VMLINUX`, else the fetch script's cache.
fn vmlinux() -> Option<std::path::PathBuf> {
    let p = std::env::var_os("KUMO_LINUX_VMLINUX")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/linux/vmlinux"));
    p.is_file().then_some(p)
}

/// Linux's early boot on kumo's APICs: the banner, then its x2APIC, kumo's IOAPIC from the MADT
/// and the second vCPU started by INIT/SIPI.
#[test]
fn linux_boots_its_second_cpu_on_the_user_apic() {
    if !kvm_or_skip("linux_boots_its_second_cpu_on_the_user_apic") {
        return;
    }
    let Some(kernel) = vmlinux() else {
        eprintln!("skipping linux_boots_its_second_cpu_on_the_user_apic: no kernel (set KUMO_LINUX_VMLINUX or run scripts/fetch-linux-kernel.sh)");
        return;
    };
    let vm = Kid::spawn(&[
        "run",
        "--irqchip",
        "user",
        "--kernel",
        kernel.to_str().unwrap(),
        "--cmdline",
        "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 reboot=k nokaslr noxsave clearcpuid=ssse3",
        "--memory",
        "512M",
        "--cpus",
        "2",
    ]);
    // Booting is emulation-bound on nested KVM: minutes. The deadlines are safety nets only.
    let patience = Duration::from_secs(900);
    vm.wait_stdout("Linux version", patience);
    vm.wait_stdout("IOAPIC[0]: apic_id 0, version 17, address 0xfec00000, GSI 0-23", patience);
    vm.wait_stdout("x2apic enabled", patience);
    vm.wait_stdout("smp: Brought up 1 node, 2 CPUs", patience);
}

#[test]
fn a_user_apic_vm_migrates_live() {
    if !kvm_or_skip("a_user_apic_vm_migrates_live") {
        return;
    }
    let dir = TestDir::new();
    let (sock, dsock) = (dir.arg("src.sock"), dir.arg("dst.sock"));
    let addr = format!("tcp:127.0.0.1:{}", free_port());
    let dest = Kid::spawn(&["run", "--incoming", &addr, "--api-socket", &dsock]);
    eventually(LIMIT, || dest.stderr().contains("waiting for a migration").then_some(()));
    // Rate-limited: the guest idles on its LAPIC timer through the migration.
    let src = Kid::spawn(&[
        "run",
        "--irqchip",
        "user",
        "--cpus",
        "2",
        "--guest",
        "memtouch",
        "--memory",
        "64M",
        "pages=2000",
        "rate=50000",
        "seed=5",
        "until_input=1",
        "--api-socket",
        &sock,
    ]);
    src.wait_stdout("memtouch: pages=", LIMIT);
    let o = kumo(&["--api-socket", &sock, "migrate", "--to", &addr]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "migrate failed:\n{out}\n{err}\nsource:\n{}\ndest:\n{}", src.stderr(), dest.stderr());
    let (code, _, serr) = src.finish(LIMIT);
    assert_eq!(code, Some(0), "{serr}");
    let v = eventually(LIMIT, || {
        let o = kumo(&["--api-socket", &dsock, "info"]);
        serde_json::from_slice::<serde_json::Value>(&o.stdout).ok().filter(|v| v["state"] == "running")
    });
    assert_eq!(v["irqchip"], "user", "{v}");
    let mut dest = dest;
    dest.input(b"q");
    let (code, dout, derr) = dest.finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{dout}\nstderr:\n{derr}");
    check_memtouch(&dout, 2000, 5, true);
}
