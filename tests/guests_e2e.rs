//! End to end: `kumo run` with each built guest, `kumo guests`, and clear errors for bad input.

use kumo_testkit::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn hello_prints_and_exits_zero() {
    if !kvm_or_skip("hello_prints_and_exits_zero") {
        return;
    }
    let (code, out, err) = Kid::spawn(&["run", "--guest", "hello", "--timeout", "60"]).finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("Hello from kumo guest!"), "{out}");
    assert!(out.contains("hello: cpus=1 memory_mib=256"), "{out}");
}

#[test]
fn memtouch_checksum_matches_the_reference_model() {
    if !kvm_or_skip("memtouch_checksum_matches_the_reference_model") {
        return;
    }
    for (mode, random) in [("random", true), ("seq", false)] {
        let args = [
            "run",
            "--guest",
            "memtouch",
            "--memory",
            "64M",
            "pages=3000",
            "writes=20000",
            "seed=7",
            &format!("mode={mode}"),
            "--timeout",
            "60",
        ];
        let (code, out, err) = Kid::spawn(&args).finish(LIMIT);
        assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
        assert_eq!(field(&out, "memtouch: done", "writes").as_deref(), Some("20000"), "{out}");
        let sum = field(&out, "memtouch: checksum", "checksum").expect("checksum line");
        let want = kumo_guests::memtouch::expected_checksum(3000, 20000, 7, random);
        assert_eq!(u64::from_str_radix(&sum, 16).unwrap(), want, "mode {mode}: {out}");
    }
}

#[test]
fn memtouch_prefill_leaves_the_working_set_checksum_alone() {
    if !kvm_or_skip("memtouch_prefill_leaves_the_working_set_checksum_alone") {
        return;
    }
    let (code, out, err) = Kid::spawn(&[
        "run",
        "--guest",
        "memtouch",
        "--memory",
        "64M",
        "pages=1000",
        "writes=5000",
        "seed=3",
        "prefill=1",
        "--timeout",
        "60",
    ])
    .finish(LIMIT);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("memtouch: prefilled"), "{out}");
    let sum = field(&out, "memtouch: checksum", "checksum").expect("checksum line");
    assert_eq!(
        u64::from_str_radix(&sum, 16).unwrap(),
        kumo_guests::memtouch::expected_checksum(1000, 5000, 3, true),
        "{out}"
    );
}

#[test]
fn memtouch_rate_limit_and_progress() {
    if !kvm_or_skip("memtouch_rate_limit_and_progress") {
        return;
    }
    // 2,000 writes at 10,000/s: about 200 ms of guest time, with progress lines every 50 ms.
    let (code, out, err) = Kid::spawn(&[
        "run",
        "--guest",
        "memtouch",
        "pages=100",
        "writes=2000",
        "rate=10000",
        "report_ms=50",
        "--timeout",
        "60",
    ])
    .finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let us: u64 = field(&out, "memtouch: done", "elapsed_us").unwrap().parse().unwrap();
    assert!(us >= 190_000, "rate=10000 for 2000 writes must take at least ~0.2 s of guest time, took {us} us");
    assert!(out.matches("memtouch: progress").count() >= 2, "{out}");
}

#[test]
fn smp_brings_up_vcpus_and_measures_ipis() {
    if !kvm_or_skip("smp_brings_up_vcpus_and_measures_ipis") {
        return;
    }
    for cpus in ["2", "4"] {
        let (code, out, err) =
            Kid::spawn(&["run", "--guest", "smp", "--cpus", cpus, "iters=200", "--timeout", "60"]).finish(LIMIT);
        assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
        assert!(out.contains(&format!("smp: {cpus}/{cpus} vcpus online")), "{out}");
        let p50: u64 = field(&out, "smp: ipi_rtt_cycles", "p50").unwrap().parse().unwrap();
        let min: u64 = field(&out, "smp: ipi_rtt_cycles", "min").unwrap().parse().unwrap();
        assert!(min > 0 && p50 >= min, "{out}");
        assert_eq!(field(&out, "smp: ipi_rtt_cycles", "iters").as_deref(), Some("200"));
    }
}

/// The `sync` guest (seed 003) hands its semaphore round robin in every wait and APIC mode,
/// with and without KVM halt polling: every hand-off and transaction happens, none is lost
/// (a lost IPI would leave a waiter halted and the run would never end).
#[test]
fn sync_hands_the_semaphore_on_in_every_wait_and_apic_mode() {
    if !kvm_or_skip("sync_hands_the_semaphore_on_in_every_wait_and_apic_mode") {
        return;
    }
    let cases: &[(&str, &str, &str, &[&str])] = &[
        ("2", "spin", "xapic", &[]),
        ("2", "hlt", "xapic", &[]),
        ("2", "hlt", "x2apic", &[]),
        ("2", "poll", "xapic", &[]),
        ("2", "hlt", "xapic", &["--halt-poll-ns", "0"]),
        ("2", "hlt", "x2apic", &["--irqchip", "split"]),
        ("2", "hlt", "xapic", &["--irqchip", "user"]),
        ("2", "hlt", "x2apic", &["--irqchip", "user"]),
        ("1", "hlt", "xapic", &[]),
    ];
    for &(cpus, wait, apic, extra) in cases {
        let (w, a) = (format!("wait={wait}"), format!("apic={apic}"));
        let mut args = vec!["run", "--timeout", "600", "--cpus", cpus];
        args.extend_from_slice(extra);
        args.extend(["--guest", "sync", &w, &a, "handoffs=300", "txns=200", "par=2"]);
        let (code, out, err) = Kid::spawn(&args).finish(LIMIT);
        let case = format!("{cpus} vCPUs {wait} {apic} {extra:?}");
        if code == Some(4) && out.contains("x2apic is not offered") {
            eprintln!("{case}: skipped, the vCPU has no x2APIC here");
            continue;
        }
        assert_eq!(code, Some(0), "{case}\nstdout:\n{out}\nstderr:\n{err}");
        let r = kumo_guests::sync::parse(&out).unwrap_or_else(|| panic!("{case}: no result:\n{out}"));
        assert_eq!((r.n.to_string().as_str(), r.wait.as_str(), r.apic.as_str()), (cpus, wait, apic), "{out}");
        assert_eq!(r.txns, 200, "{out}");
        if cpus == "2" {
            assert_eq!(r.handoff.map(|h| h.count), Some(299), "{case}: {out}");
            assert_eq!(r.rtt.map(|h| h.count), Some(149), "{case}: {out}");
        } else {
            assert_eq!((r.handoff, r.rtt), (None, None), "{out}");
        }
    }
    let (_, err) = text(&kumo(&["run", "--halt-poll-ns", "5s", "--guest", "hello"]));
    assert!(err.contains("invalid value '5s' for '--halt-poll-ns"), "{err}");
}

#[test]
fn split_irqchip_runs_guests_too() {
    if !kvm_or_skip("split_irqchip_runs_guests_too") {
        return;
    }
    let (code, out, err) =
        Kid::spawn(&["run", "--guest", "smp", "--cpus", "2", "--irqchip", "split", "iters=50", "--timeout", "60"])
            .finish(LIMIT);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("smp: 2/2 vcpus online"), "{out}");
}

#[test]
fn guest_exit_code_is_the_process_status() {
    if !kvm_or_skip("guest_exit_code_is_the_process_status") {
        return;
    }
    // memtouch exits 2 when its working set does not fit.
    let (code, out, _) =
        Kid::spawn(&["run", "--guest", "memtouch", "--memory", "16M", "pages=999999", "--timeout", "60"]).finish(LIMIT);
    assert_eq!(code, Some(2));
    assert!(out.contains("does not fit"), "{out}");
}

#[test]
fn timeout_stops_the_vm() {
    if !kvm_or_skip("timeout_stops_the_vm") {
        return;
    }
    let (code, _, err) =
        Kid::spawn(&["run", "--guest", "memtouch", "pages=10", "duration_ms=600000", "--timeout", "0.5"]).finish(LIMIT);
    assert_eq!(code, Some(124));
    assert!(err.contains("timed out"), "{err}");
}

#[test]
fn config_file_supplies_the_vm() {
    if !kvm_or_skip("config_file_supplies_the_vm") {
        return;
    }
    let p = temp_path("vm.toml");
    std::fs::write(&p, "cpus = 2\nmemory = \"128M\"\n[payload.guest]\nname = \"hello\"\n").unwrap();
    let (code, out, err) = Kid::spawn(&["run", "--config", p.to_str().unwrap(), "--timeout", "60"]).finish(LIMIT);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("hello: cpus=2 memory_mib=128"), "{out}");
    // Flags override the file.
    let (code, out, _) =
        Kid::spawn(&["run", "--config", p.to_str().unwrap(), "--memory", "64M", "--timeout", "60"]).finish(LIMIT);
    assert_eq!(code, Some(0));
    assert!(out.contains("memory_mib=64"), "{out}");
    // A file's memfd and a flag's private memory are one too many.
    std::fs::write(
        &p,
        "shared_memory = true
[payload.guest]
name = \"hello\"\n",
    )
    .unwrap();
    let (code, _, err) = Kid::spawn(&["run", "--config", p.to_str().unwrap(), "--private-memory"]).finish(LIMIT);
    assert!(code != Some(0) && err.contains("shared and private memory both asked for"), "{err}");
}

#[test]
fn guests_are_listed_with_parameters() {
    let o = kumo(&["guests"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    for name in ["hello", "memtouch", "smp"] {
        assert!(out.lines().any(|l| l.starts_with(name)), "{out}");
    }
    assert!(out.contains("pages") && out.contains("random|seq") && out.contains("iters"), "{out}");
    let o = kumo(&["guests", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), kumo_guests::all().unwrap().len());
    assert_eq!(v[1]["name"], "memtouch");
}

/// Bad input: a message, a non-zero status, never a panic. These need no KVM: they fail before.
#[test]
fn bad_input_gives_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["run", "--guest", "hello", "--memory", "12X"], "unknown unit"),
        (&["run", "--guest", "nope"], "unknown guest `nope`"),
        (&["run", "--guest", "memtouch", "pagez=1"], "unknown parameter `pagez`"),
        (&["run", "--guest", "memtouch", "pages=many"], "wants a number"),
        (&["run", "--guest", "smp", "--cpus", "1"], "runs on 2..=64 vCPUs"),
        (&["run", "--guest", "hello", "--cpus", "100000"], "exceeds kumo's limit"),
        (&["run", "--guest", "hello", "--memory", "1M"], "at least 8 MiB"),
        (&["run", "--kernel", "/nonexistent/bzImage"], "/nonexistent/bzImage does not exist"),
        (&["run"], "nothing to boot"),
        (&["run", "--config", "/nonexistent.toml"], "cannot read /nonexistent.toml"),
        (&["--api-socket", "/nonexistent/kumo.sock", "info"], "no kumo VM is listening on /nonexistent/kumo.sock"),
        (&["pause"], "needs --api-socket"),
        (&["run", "--guest", "hello", "--shared-memory", "--private-memory"], "cannot be used with"),
    ];
    for (args, want) in cases {
        let o = kumo(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: want `{want}` in:\n{err}");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    }
}

#[test]
fn too_many_vcpus_for_kvm_is_an_error() {
    if !kvm_or_skip("too_many_vcpus_for_kvm_is_an_error") {
        return;
    }
    // Within kumo's own limit (240) but the guest runtime supports 64: the guest check says so.
    let o = kumo(&["run", "--guest", "hello", "--cpus", "200"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("vCPUs"), "{err}");
}

/// Sizes no host can back, and sizes that do not parse: one line on stderr, status 1 (clap's
/// own usage errors: 2), never an abort or a backtrace. No VM is started, so no KVM is needed.
#[test]
fn absurd_sizes_are_refused_before_anything_is_allocated() {
    let huge = temp_path("huge.toml");
    std::fs::write(&huge, "memory = \"1000T\"\n[payload.guest]\nname = \"hello\"\n").unwrap();
    let overflow = temp_path("overflow.json");
    std::fs::write(&overflow, r#"{"memory": "99999999999T", "payload": {"guest": {"name": "hello"}}}"#).unwrap();
    let cases: &[(&[&str], i32, &str)] = &[
        (&["run", "--guest", "hello", "--memory", "1000T"], 1, "memory 1000 TiB is more than this host can back"),
        (&["run", "--guest", "hello", "--memory", "1P"], 1, "memory 1 PiB is more than this host can back"),
        (
            &["run", "--incoming", "tcp:127.0.0.1:0", "--memory", "1000T"],
            1,
            "memory 1000 TiB is more than this host can back",
        ),
        (&["run", "--incoming", "tcp:127.0.0.1:0", "--memory", "1M"], 1, "at least 8 MiB"),
        (&["run", "--incoming", "tcp:127.0.0.1:0", "--cpus", "0"], 1, "cpus must be at least 1"),
        (&["run", "--incoming", "tcp:127.0.0.1:0", "--cpus", "1000"], 1, "exceeds kumo's limit of 240"),
        (&["run", "--config", huge.to_str().unwrap()], 1, "memory 1000 TiB is more than this host can back"),
        (&["run", "--config", overflow.to_str().unwrap()], 1, "is too large"),
        (&["run", "--guest", "hello", "--memory", "99999999999T"], 2, "is too large"),
        (&["run", "--guest", "hello", "--memory", "1.3B"], 2, "not a whole number of bytes"),
    ];
    for (args, status, want) in cases {
        let o = kumo(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(*status), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: want `{want}` in:\n{err}");
        assert!(
            !err.contains("panicked") && !err.contains("backtrace") && !err.contains("memory allocation"),
            "{args:?}:\n{err}"
        );
        if *status == 1 {
            assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line, got:\n{err}");
        }
    }
    // 1 TiB exceeds this host unless it is a very large one.
    if kumo_vm::memory::HostMemory::read().unwrap().usable() < 1 << 40 {
        let o = kumo(&["run", "--incoming", "tcp:127.0.0.1:0", "--memory", "1T"]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains("memory 1 TiB is more than this host can back") && err.trim_end().lines().count() == 1,
            "{err}"
        );
    }
}

#[test]
fn decimal_memory_sizes_parse() {
    if !kvm_or_skip("decimal_memory_sizes_parse") {
        return;
    }
    let (code, out, err) =
        Kid::spawn(&["run", "--guest", "hello", "--memory", "1.5G", "--timeout", "60"]).finish(LIMIT);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("memory_mib=1536"), "{out}");
}

/// A `kumo run --incoming` destination, stderr in a file, listening on a free port.
fn destination(tag: &str, extra: &[&str]) -> (Kid, std::path::PathBuf, u16) {
    let port = free_port();
    let err = temp_path(&format!("{tag}.err"));
    let addr = format!("tcp:127.0.0.1:{port}");
    let kid = Kid::from_child(
        std::process::Command::new(kumo_bin())
            .args(["run", "--incoming", &addr, "--timeout", "60"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually(Duration::from_secs(20), || {
        std::fs::read_to_string(&err).unwrap_or_default().contains("waiting for a migration").then_some(())
    });
    (kid, err, port)
}

/// Stream headers describing VMs this destination cannot or will not hold get a Failed reply
/// naming why, and the destination exits 1 without allocating (no abort, no backtrace). These
/// fail before any VM is built, so they need no KVM.
#[test]
fn crafted_headers_get_a_failed_reply() {
    use kumo_migration::format::{write_header, Irqchip, PayloadDescription, Reply, ReplyReader, VmDescription};
    let header = |cpus: u32, memory: u64| {
        let guest = PayloadDescription::guest("memtouch");
        VmDescription::new(cpus, Irqchip::Kernel, guest, kumo_vm::layout::ram_regions(memory))
    };
    let mut cases: Vec<(&str, &[&str], VmDescription, &str)> = vec![
        ("pib", &[], header(1, 1 << 50), "memory 1 PiB is more than this host can back"),
        ("cpus65", &[], header(65, 64 << 20), "runs on 1..=64 vCPUs, not 65"),
        ("cpus200", &[], header(200, 64 << 20), "vCPUs"),
        ("want-cpus", &["--cpus", "2"], header(1, 64 << 20), "prepared for 2 vCPUs; the VM has 1"),
        ("want-mem", &["--memory", "64M"], header(1, 128 << 20), "prepared for 64 MiB of memory; the VM has 128 MiB"),
    ];
    if kumo_vm::memory::HostMemory::read().unwrap().usable() < 1 << 40 {
        cases.push(("tib", &[], header(1, 1 << 40), "memory 1 TiB is more than this host can back"));
    }
    for (tag, extra, desc, want) in cases {
        let (mut kid, err_path, port) = destination(&format!("hdr-{tag}"), extra);
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write_header(&mut s, &desc).unwrap();
        let mut replies = ReplyReader::new(&mut s);
        // A valid header is Accepted at once; the VM it describes is refused after.
        let mut reply = replies.next_reply();
        if matches!(reply, Ok(Reply::Accepted)) {
            reply = replies.next_reply();
        }
        match reply {
            Ok(Reply::Failed(why)) => assert!(why.contains(want), "{tag}: want `{want}` in `{why}`"),
            other => panic!("{tag}: expected a Failed reply, got {other:?}"),
        }
        let status = eventually(LIMIT, || kid.child.try_wait().unwrap());
        let err = std::fs::read_to_string(&err_path).unwrap_or_default();
        assert_eq!(status.code(), Some(1), "{tag}: {err}");
        assert!(err.contains("incoming migration failed") && err.contains(want), "{tag}: {err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{tag}: {err}");
    }
}
