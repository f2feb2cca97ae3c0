//! `kumo bench net` against a stand-in `kumo` (a shell script that logs its arguments and plays
//! the guests with the bench's own host tools): checks the `--net` command lines the bench
//! gives kumo, the report's shape, the headline line, the "no --net" exit, and that every
//! namespace and link of the run is gone afterwards. Needs root (network namespaces) and
//! /dev/kvm; skips with a message where either is absent.

use std::path::Path;
use std::process::Command;

const FAKE: &str = r#"#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in
 "run --help") [ -n "$FAKE_NO_NET" ] || echo "  --net <SPEC>"; exit 0;;
 "guests --json") echo '[{"name":"netecho"},{"name":"udpping"},{"name":"udpsend"},{"name":"udpsink"}]'; exit 0;;
 *" counters") printf '{\n "nics": []\n}\n'; exit 0;;
esac
case "$*" in
 *"--guest netecho"*"ip=10.0.0.2"*) echo "netecho: up nic=0 mac=x ip=y"; echo "netecho: up nic=1 mac=x ip=y"
    ip addr add 10.0.0.2/32 dev lo 2>/dev/null; exec "$BENCH" net-tool echo --bind 10.0.0.2:7 >/dev/null;;
 *"--guest netecho"*) echo "netecho: up nic=0 mac=x ip=y"; exec sleep 600;;
 *"--guest udpping"*) echo "udpping: count=100 lost=0 p50_us=50 p99_us=90 min_us=40 max_us=200"; exit 0;;
 *"--guest udpsink"*) echo "udpsink: up nic=0"; sleep 0.2; echo "udpsink: received=100 lost=0 reordered=0 dup=0"; exit 0;;
 *"--guest udpsend"*"peer=10.0.0.1"*) echo "udpsend: up"; exec "$BENCH" net-tool send --to 10.0.0.1:9 --count 100;;
 *"--guest udpsend"*) echo "udpsend: up"; echo "udpsend: sent=100"; exit 0;;
esac
echo "fake kumo: unexpected $*" >&2; exit 2
"#;

/// Why this host cannot run the dry run, if it cannot.
fn unavailable() -> Option<String> {
    if !Path::new("/dev/kvm").exists() {
        return Some("no /dev/kvm".into());
    }
    let ns = format!("kbntest{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &ns]).output() {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
            None
        }
        Ok(o) => Some(format!("cannot make a network namespace: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(format!("no ip command: {e}")),
    }
}

struct Run {
    code: i32,
    stdout: String,
    log: String,
    leftovers: Vec<String>,
    dir: vmm_sys_util::tempdir::TempDir,
}

fn run(no_net: bool) -> Run {
    let dir =
        vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-net-dry-")).expect("tempdir");
    let fake = dir.as_path().join("kumo");
    std::fs::write(&fake, FAKE).expect("fake kumo");
    Command::new("chmod").arg("755").arg(&fake).status().expect("chmod");
    let log = dir.as_path().join("log");
    let bench = env!("CARGO_BIN_EXE_kumo-bench");
    let mut cmd = Command::new(bench);
    cmd.arg("--out").arg(dir.as_path().join("out")).args(["net", "--quick", "--runs", "1"]);
    // No QEMU: the stand-in plays kumo's guests only (the QEMU section says why it is skipped).
    cmd.env("KUMO_BIN", &fake).env("FAKE_LOG", &log).env("BENCH", bench).env("KUMO_QEMU", "/nonexistent/qemu");
    if no_net {
        cmd.env("FAKE_NO_NET", "1");
    }
    let child = cmd.stdout(std::process::Stdio::piped()).spawn().expect("kumo-bench");
    let mine = format!("kbn{}", child.id());
    let out = child.wait_with_output().expect("kumo-bench output");
    let listed = |args: &[&str]| {
        let o = Command::new("ip").args(args).output().expect("ip");
        String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.contains(&mine)).map(String::from).collect::<Vec<_>>()
    };
    let mut leftovers = listed(&["netns", "list"]);
    leftovers.extend(listed(&["-o", "link", "show"]));
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        log: std::fs::read_to_string(&log).unwrap_or_default(),
        leftovers,
        dir,
    }
}

#[test]
fn net_bench_drives_kumo_net_and_cleans_up() {
    if let Some(why) = unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let r = run(false);
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert!(r.leftovers.is_empty(), "left behind: {:?}", r.leftovers);
    // The seed's dedicated path with 2 vCPUs: NIC 0 to vCPU 1, NIC 1 (the flood) delivered by KVM
    // (no device goes through kumo's dispatcher then); on the shared path both NICs are shared.
    assert!(r.log.contains(",mac=52:54:00:00:00:02,irq=dedicated,vcpu=1 --net tap="), "{}", r.log);
    assert!(r.log.contains("--guest netecho --cpus 2 --timeout 600 --net tap=kbn"), "{}", r.log);
    assert!(r.log.contains("irq=direct -- ip=10.0.0.2 wait=irq cpu=1 sink=1 ip1=10.0.2.2 vector=0xe0"), "{}", r.log);
    assert!(r.log.contains("irq=shared --net tap=kbn"), "{}", r.log);
    assert!(r.log.contains("--guest udpping --cpus 1 --timeout 600 --net tap=kbn"), "{}", r.log);
    let last = r.stdout.lines().last().unwrap_or("");
    let keys: Vec<&str> = last.split_whitespace().filter_map(|kv| kv.split_once('=').map(|(k, _)| k)).collect();
    let qemu_keys = [
        "kumo_rtt_p50_us",
        "kumo_rtt_p99_us",
        "kumo_stream_mb_s",
        "qemu_rtt_p50_us",
        "qemu_rtt_p99_us",
        "qemu_stream_mb_s",
        "rtt_p99_ratio_qemu",
        "mbps_ratio_qemu",
        "poll_rtt_p99_ratio_qemu",
        "poll_mbps_ratio_qemu",
        "pinned_rtt_p99_ratio_qemu",
        "self_pinned_rtt_p99_ratio_qemu",
        "io_cpu_frame_ratio_qemu",
    ];
    assert_eq!(keys[..4], ["dedicated_p99_us", "dedicated_unloaded_p99_us", "shared_p99_us", "veth_ratio"], "{last}");
    assert_eq!(keys[4..], qemu_keys, "{last}");
    let values: Vec<&str> = last.split_whitespace().filter_map(|kv| kv.split_once('=').map(|(_, v)| v)).collect();
    assert!(values[..4].iter().all(|v| v.parse::<f64>().is_ok()), "{last}");
    // Without QEMU its figures are n/a, and the bench says why.
    assert!(values[4..].iter().all(|v| *v == "n/a"), "{last}");
    assert!(
        r.stdout.contains("kumo bench net: no QEMU rows: KUMO_QEMU=/nonexistent/qemu is not a file"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("5. kumo vs QEMU") && r.stdout.contains("   skipped: KUMO_QEMU="), "{}", r.stdout);
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(r.dir.as_path().join("out/net.json")).expect("net.json")).expect("json");
    let len = |k: &str| j[k].as_array().map_or(0, Vec::len);
    assert_eq!((len("rtt"), len("pingpong"), len("throughput")), (8, 2, 4));
    assert!(r.dir.as_path().join("out/net.png").exists());
}

#[test]
fn net_bench_without_kumo_net_says_so_and_fails() {
    if let Some(why) = unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let r = run(true);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.leftovers.is_empty(), "left behind: {:?}", r.leftovers);
    let last = r.stdout.lines().last().unwrap_or("");
    assert!(last.starts_with("kumo bench net: ") && last.contains("no `kumo run --net`"), "{last}");
    assert!(!r.stdout.contains("dedicated_p99_us="), "{}", r.stdout);
    assert!(!r.log.contains("--guest"), "a VM was started: {}", r.log);
}
