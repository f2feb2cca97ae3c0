//! Linux as the judge of a live migration: the test kernel, its root filesystem mounted from a
//! kumo disk and its NIC configured by `ip=`, migrates between two kumo processes while the host
//! pings it (one ping in flight, one every 50 ms while replies are quick), with the zero-copy and the local engine. It answers from the
//! destination with at most one ping lost, and its disk still works there: the MMP block its
//! kmmpd thread rewrites every second changes in the image after the migration completed.
//!
//! Needs /dev/kvm, a tap (root) and the test kernel; skips, saying why, without them. Every
//! wait is for a kernel message, a ping reply or a change in the image, bounded by
//! `linux::boot_limit()` and `linux::effect_limit()` only as hang guards.

use kumo_testkit::linux::{self, Pinger, RootFs, IP_CONFIG_COMPLETE, RUN_INIT};
use kumo_testkit::net::{subnet, tap_or_skip};
use kumo_testkit::{free_port, incoming, migrate, vm_info, TestDir};

fn linux_migrates_answering_pings(test: &str, engine: &str) {
    let Some(kernel) = linux::test_kernel(test) else { return };
    let (host, guest, _) = subnet(if engine == "local" { 243 } else { 244 });
    let Some(tap) = tap_or_skip(test, &engine[..2], host) else { return };
    let _one = linux::one_at_a_time();
    let dir = TestDir::new();
    let root = RootFs::create(dir.path("").as_path(), 32);
    let img = root.image.display().to_string();
    let sock = dir.arg("src.sock");
    let cmdline = linux::cmdline(&format!("{} {}", linux::ip_arg(guest, host), linux::ROOT_ARGS));
    let net = format!("tap={}", tap.name);
    let disk = format!("path={img}");
    // The local engine hands over guest memory's file: the source's RAM must be one.
    let memory = if engine == "local" { "--shared-memory" } else { "--private-memory" };
    let args = ["--net", &net, "--disk", &disk, "--api-socket", &sock, memory];
    let mut src = linux::spawn(&kernel, &cmdline, &args, "src");
    linux::expect_console(&mut src, IP_CONFIG_COMPLETE);
    linux::expect_console(&mut src, RUN_INIT);
    let pinger = Pinger::one_in_flight(guest);
    pinger
        .wait_replies(0, 10, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{e}\n{}", linux::console_tail(&src, 30)));

    let addr = match engine {
        "local" => format!("unix:{}", dir.arg("mig.sock")),
        _ => format!("tcp:127.0.0.1:{}", free_port()),
    };
    let dsock = dir.arg("dst.sock");
    let (dnet, ddisk) = (format!("id=net0,tap={}", tap.name), format!("id=disk0,path={img}"));
    let dst = incoming(&addr, &["--net", &dnet, "--disk", &ddisk, "--api-socket", &dsock], "dst");
    let (ok, out, err) = migrate(&sock, &["--to", &addr, "--engine", engine]);
    assert!(ok, "{engine}: migrate failed:\n{out}\n{err}\nsource:\n{}\ndest:\n{}", src.stderr(), dst.stderr());
    let (code, _, err) = src.finish(linux::boot_limit());
    assert_eq!(code, Some(0), "{engine}: the source ends after handing over: {err}");
    println!("{engine}: {out}");

    // The source is gone: every reply from now on comes from the destination.
    let after = pinger.replies();
    let seq = root.mmp_seq();
    pinger
        .wait_replies(after, 20, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{engine}: from the destination: {e}\n{}", dst.stderr()));
    root.wait_mmp_writes(seq, linux::effect_limit())
        .unwrap_or_else(|e| panic!("{engine}: the destination's disk: {e}\n{}\n{}", dst.stdout(), dst.stderr()));
    let lost = pinger.lost();
    assert!(lost.len() <= 1, "{engine}: pings lost around the migration: {lost:?}");
    println!("{engine}: {} replies, lost {lost:?}", pinger.replies());
    let info = vm_info(&dsock);
    assert!(info.net[0].driver_ok, "{info:?}");
    let console = dst.stdout();
    assert!(!console.contains("EXT4-fs error") && !console.contains("I/O error"), "{engine}: {console}");
}

#[test]
fn linux_migrates_with_zerocopy_answering_pings_with_its_disk() {
    linux_migrates_answering_pings("linux_migrates_with_zerocopy_answering_pings_with_its_disk", "zerocopy");
}

#[test]
fn linux_migrates_locally_answering_pings_with_its_disk() {
    linux_migrates_answering_pings("linux_migrates_locally_answering_pings_with_its_disk", "local");
}
