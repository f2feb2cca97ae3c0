//! End to end: elastic, exclusive sharing of host CPUs and memory between two running VMs
//! (seed 002, part 2). Two `worker` guests, each started with `--elastic`: A holds host CPU 1
//! and its elastic memory, B holds host CPU 0 and a parked spare vCPU. `kumo lend` moves a CPU
//! and memory from A to B, `kumo return` moves them back; both guests' work is checked (each
//! verifies every chunk it owns: never-written memory must read zeros, written memory its own
//! pattern); a guest that never confirms, and a borrower that died, roll the lend back; and the
//! VMs' own records show no host CPU and no memory held by both at once.
//!
//! Needs /dev/kvm and two online host CPUs; skips, saying why, where either is missing.
//! Outcomes only: the guests run until the test stops them, and every wait is a safety net
//! far above need.

use kumo_api::{ApiClient, ElasticInfo};
use kumo_testkit::*;

fn two_cpus_or_skip(test: &str) -> bool {
    if !kvm_or_skip(test) {
        return false;
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if n < 2 {
        eprintln!("skipping {test}: needs 2 host CPUs, this process may use {n}");
        return false;
    }
    true
}

/// A running elastic VM and its API.
struct Vm {
    kid: Kid,
    sock: String,
    api: ApiClient,
}

impl Vm {
    fn start(dir: &TestDir, name: &str, elastic: &str, args: &[&str]) -> Vm {
        Vm::start_with(dir, name, elastic, &[], args)
    }

    /// [`Vm::start`] with more `kumo run` flags (`flags`) before the guest and its `args`.
    fn start_with(dir: &TestDir, name: &str, elastic: &str, flags: &[&str], args: &[&str]) -> Vm {
        let sock = dir.arg(&format!("{name}.sock"));
        let mut cmd = vec!["--api-socket", &sock, "run", "--cpus", "3", "--memory", "256M", "--elastic", elastic];
        cmd.extend_from_slice(flags);
        cmd.extend_from_slice(&["--guest", "worker"]);
        cmd.extend_from_slice(args);
        let kid = Kid::spawn(&cmd).named(name);
        let api = ApiClient::new(&sock);
        eventually(PATIENCE, || api.ping().ok());
        Vm { kid, sock, api }
    }

    fn info(&self) -> ElasticInfo {
        self.api.elastic().expect("vm.elastic")
    }

    /// Waits until vCPU `v` has done `more` work units past what it had done now.
    fn works_on(&self, v: usize, more: u64) {
        let start = self.info().progress[v];
        eventually(PATIENCE, || (self.info().progress[v] >= start + more).then_some(()));
    }

    fn total(&self) -> u64 {
        self.info().progress.iter().sum()
    }

    /// Output lines that say the guest found foreign or lost data.
    fn damage(&self) -> Vec<String> {
        self.kid
            .stdout()
            .lines()
            .filter(|l| l.starts_with("worker: nonzero") || l.starts_with("worker: corrupt"))
            .map(str::to_string)
            .collect()
    }
}

fn lend(args: &[&str]) -> (bool, String, String) {
    let o = kumo(args);
    let (out, err) = text(&o);
    (o.status.success(), out, err)
}

fn overlaps(a: &Vm, b: &Vm) -> kumo_elastic::record::Overlaps {
    let (ea, eb) = (a.info().events, b.info().events);
    kumo_elastic::record::check(&[("a", &ea), ("b", &eb)])
}

#[test]
fn a_cpu_and_memory_move_to_b_and_back_and_both_guests_keep_their_data() {
    if !two_cpus_or_skip("a_cpu_and_memory_move_to_b_and_back_and_both_guests_keep_their_data") {
        return;
    }
    let dir = TestDir::new();
    let a = Vm::start(&dir, "a", "cpus=1,memory=64M", &["tag=1"]);
    let b = Vm::start(&dir, "b", "cpus=0,memory=64M,plugged=0", &["tag=2"]);
    // A has written all of its 64 MiB (1,024 chunks of 64 KiB) at least once.
    a.works_on(1, 2048);
    b.works_on(1, 1);
    let ia = a.info();
    assert_eq!((ia.vcpus[1].host_cpu, ia.vcpus[2].parked), (Some(1), true), "{ia:?}");
    assert_eq!(ia.nodes[0].plugged_bytes, 64 << 20);
    assert_eq!(b.info().nodes[0].plugged_bytes, 0);

    let (ok, out, err) =
        lend(&["lend", "--from", &a.sock, "--to", &b.sock, "--cpus", "1", "--memory", "32M", "--timeout-ms", "20000"]);
    assert!(ok, "lend failed: {err}");
    assert!(out.contains("lent host CPUs [1]"), "{out}");
    let (ia, ib) = (a.info(), b.info());
    assert!(ia.vcpus[1].parked && ia.vcpus[1].host_cpu.is_none(), "{ia:?}");
    assert_eq!((ib.vcpus[2].host_cpu, ib.vcpus[2].parked), (Some(1), false), "{ib:?}");
    assert!(ib.vcpus[2].lender.as_deref().is_some_and(|l| l.ends_with("a.sock")), "{ib:?}");
    // The release kicked A's vacated vCPU without waiting for it: its thread parks all the same.
    eventually(PATIENCE, || a.api.info().ok().filter(|i| i.parked_vcpus.contains(&1)).map(|_| ()));
    assert_eq!((ia.nodes[0].plugged_bytes, ib.nodes[0].plugged_bytes), (32 << 20, 32 << 20));
    // B works on its new vCPU, while A's vacated vCPU does nothing at all.
    let parked_a = a.info().progress[1];
    b.works_on(2, 100);
    // B has gone over each of its 512 new chunks at least once: each read zeros first.
    let t = b.total();
    eventually(PATIENCE, || (b.total() >= t + 2048).then_some(()));
    assert_eq!(a.info().progress[1], parked_a, "a parked vCPU did work");
    assert!(b.kid.stdout().contains("worker: given blocks=16"), "{}", b.kid.stdout());

    let (ok, out, err) = lend(&[
        "return",
        "--from",
        &b.sock,
        "--to",
        &a.sock,
        "--cpus",
        "1",
        "--memory",
        "32M",
        "--timeout-ms",
        "20000",
    ]);
    assert!(ok, "return failed: {err}");
    assert!(out.contains("returned host CPUs [1]"), "{out}");
    let (ia, ib) = (a.info(), b.info());
    assert_eq!((ia.vcpus[1].host_cpu, ia.vcpus[1].parked), (Some(1), false), "{ia:?}");
    assert!(ib.vcpus[2].parked, "{ib:?}");
    assert_eq!((ia.nodes[0].plugged_bytes, ib.nodes[0].plugged_bytes), (64 << 20, 0));
    assert!(ib.nodes[0].borrowed.is_empty(), "{ib:?}");
    a.works_on(1, 2048);
    // Nothing more was borrowed: a second return is refused and changes nothing.
    let (ok, _, err) = lend(&["return", "--from", &b.sock, "--to", &a.sock, "--cpus", "1"]);
    assert!(!ok && err.contains("nothing changed"), "{err}");

    // The same through A's and B's own APIs: A's VMM coordinates.
    let (s, r) = a
        .api
        .request("PUT", "/api/v1/vm.lend", Some(&serde_json::json!({"to": b.sock, "cpus": 1, "timeout_ms": 20000})))
        .unwrap();
    assert_eq!(s, 200, "{r:?}");
    assert_eq!(b.info().vcpus[2].host_cpu, Some(1));
    b.works_on(2, 100);
    let back = serde_json::json!({"to": a.sock, "cpus": 1, "return": true, "timeout_ms": 20000});
    let (s, r) = b.api.request("PUT", "/api/v1/vm.lend", Some(&back)).unwrap();
    assert_eq!(s, 200, "{r:?}");
    assert_eq!(a.info().vcpus[1].host_cpu, Some(1));
    a.works_on(1, 100);

    assert_eq!(a.damage(), Vec::<String>::new(), "A lost data");
    assert_eq!(b.damage(), Vec::<String>::new(), "B read memory it did not write");
    let o = overlaps(&a, &b);
    assert_eq!(o.total(), 0, "{:?}", o.details);
    assert_eq!(a.info().events.len(), 2 + 4 + 2, "boot (CPU, memory), release and acquire of each, then a CPU again");
}

#[test]
fn a_guest_that_never_confirms_or_a_dead_borrower_changes_nothing() {
    if !two_cpus_or_skip("a_guest_that_never_confirms_or_a_dead_borrower_changes_nothing") {
        return;
    }
    let dir = TestDir::new();
    let a = Vm::start(&dir, "a", "cpus=1,memory=32M", &["tag=1"]);
    let deaf = Vm::start(&dir, "deaf", "cpus=0,memory=32M,plugged=0", &["tag=2", "ignore=1"]);
    a.works_on(1, 100);
    deaf.works_on(1, 100);
    let before_a = a.info();

    // The borrower's guest never confirms: A gets everything back.
    let (ok, _, err) =
        lend(&["lend", "--from", &a.sock, "--to", &deaf.sock, "--cpus", "1", "--memory", "16M", "--timeout-ms", "300"]);
    assert!(!ok, "a lend to a deaf guest succeeded");
    assert!(err.contains("did not confirm") && err.contains("has it back"), "{err}");
    let ia = a.info();
    assert_eq!((ia.vcpus[1].host_cpu, ia.vcpus[1].parked), (Some(1), false), "{ia:?}");
    assert_eq!(ia.nodes[0].plugged_bytes, 32 << 20);
    let id = deaf.info();
    assert!(id.vcpus[2].parked && id.vcpus[2].host_cpu.is_none(), "{id:?}");
    assert_eq!(id.nodes[0].plugged_bytes, 0);
    a.works_on(1, 100);

    // The lender's guest never confirms: nothing moves, nothing is recorded on either side.
    let (ok, _, err) = lend(&["lend", "--from", &deaf.sock, "--to", &a.sock, "--cpus", "1", "--timeout-ms", "300"]);
    assert!(!ok && err.contains("did not confirm") && err.contains("nothing changed"), "{err}");
    let id = deaf.info();
    assert_eq!((id.vcpus[1].host_cpu, id.vcpus[1].parked), (Some(0), false), "{id:?}");
    deaf.works_on(1, 100);

    // A borrower that died: the lend rolls back.
    let dead_sock = deaf.sock.clone();
    let events_deaf = deaf.info().events;
    drop(deaf);
    let (ok, _, err) = lend(&["lend", "--from", &a.sock, "--to", &dead_sock, "--cpus", "1", "--timeout-ms", "5000"]);
    assert!(!ok && err.contains("has it back"), "{err}");
    a.works_on(1, 100);
    let ia = a.info();
    assert_eq!((ia.vcpus[1].host_cpu, ia.vcpus[1].parked), (Some(1), false), "{ia:?}");
    assert_eq!(ia.nodes[0].plugged_bytes, before_a.nodes[0].plugged_bytes);
    let o = kumo_elastic::record::check(&[("a", &ia.events), ("deaf", &events_deaf)]);
    assert_eq!(o.total(), 0, "{:?}", o.details);
    assert_eq!(a.damage(), Vec::<String>::new());
}

/// The channel's interrupt goes through `kumo_vm::interrupts`: with `--irqchip user` kumo's own
/// LAPICs take it, a halted vCPU parks from kumo's halt wait, and a lend and its return work as
/// with KVM's LAPIC.
#[test]
fn a_lend_and_its_return_work_with_the_userspace_irqchip() {
    if !two_cpus_or_skip("a_lend_and_its_return_work_with_the_userspace_irqchip") {
        return;
    }
    let dir = TestDir::new();
    let user = ["--irqchip", "user"];
    let a = Vm::start_with(&dir, "a", "cpus=1,memory=32M", &user, &["tag=1"]);
    let b = Vm::start_with(&dir, "b", "cpus=0,memory=32M,plugged=0", &user, &["tag=2"]);
    a.works_on(1, 100);
    b.works_on(1, 1);
    let (ok, out, err) =
        lend(&["lend", "--from", &a.sock, "--to", &b.sock, "--cpus", "1", "--memory", "16M", "--timeout-ms", "20000"]);
    assert!(ok, "lend failed: {err}");
    assert!(out.contains("lent host CPUs [1]"), "{out}");
    let (ia, ib) = (a.info(), b.info());
    assert!(ia.vcpus[1].parked && ia.vcpus[1].host_cpu.is_none(), "{ia:?}");
    assert_eq!((ib.vcpus[2].host_cpu, ib.vcpus[2].parked), (Some(1), false), "{ib:?}");
    assert_eq!(ib.nodes[0].plugged_bytes, 16 << 20);
    b.works_on(2, 100);
    let back =
        ["return", "--from", &b.sock, "--to", &a.sock, "--cpus", "1", "--memory", "16M", "--timeout-ms", "20000"];
    let (ok, out, err) = lend(&back);
    assert!(ok, "return failed: {err}");
    assert!(out.contains("returned host CPUs [1]"), "{out}");
    assert_eq!(a.info().vcpus[1].host_cpu, Some(1));
    assert!(b.info().vcpus[2].parked);
    a.works_on(1, 100);
    assert_eq!(a.damage(), Vec::<String>::new(), "A lost data");
    assert_eq!(b.damage(), Vec::<String>::new(), "B read memory it did not write");
    let o = overlaps(&a, &b);
    assert_eq!(o.total(), 0, "{:?}", o.details);
}

#[test]
fn bad_elastic_requests_are_refused_with_clear_errors() {
    if !two_cpus_or_skip("bad_elastic_requests_are_refused_with_clear_errors") {
        return;
    }
    let dir = TestDir::new();
    let a = Vm::start(&dir, "a", "cpus=1,memory=32M", &["tag=1"]);
    a.works_on(1, 10);
    for (body, status, want) in [
        (serde_json::json!({"cpus": 2}), 409, "holds 1 host CPUs"),
        (serde_json::json!({"memory_bytes": 3 << 20}), 400, "whole number"),
        (serde_json::json!({"memory_bytes": 64 << 20}), 409, "cannot release"),
        (serde_json::json!({"host_cpus": [0]}), 409, "no host CPU 0"),
        (serde_json::json!({}), 400, "nothing to release"),
        (serde_json::json!({"cpus": 1, "to": "nobody"}), 409, "borrowed from nobody"),
    ] {
        let (s, b) = a.api.request("PUT", "/api/v1/vm.release", Some(&body)).unwrap();
        let msg = b.map(|b| b["error"].to_string()).unwrap_or_default();
        assert_eq!(s, status, "{body}: {msg}");
        assert!(msg.contains(want), "{body}: {msg}");
    }
    let (s, b) = a.api.request("PUT", "/api/v1/vm.acquire", Some(&serde_json::json!({"host_cpus": [1]}))).unwrap();
    assert_eq!(s, 409, "{b:?}");
    // Elastic VMs are not migrated or snapshotted.
    let (s, b) = a.api.request("PUT", "/api/v1/vm.snapshot", Some(&serde_json::json!({"path": dir.arg("s")}))).unwrap();
    assert_eq!(s, 409, "{b:?}");
    assert!(b.unwrap()["error"].as_str().unwrap().contains("elastic"));
    let o = kumo(&[
        "--api-socket",
        &dir.arg("none.sock"),
        "run",
        "--guest",
        "hello",
        "--elastic",
        "cpus=1",
        "--timeout",
        "30",
    ]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("need 2 vCPUs"), "{err}");
    // A released block is fenced off; a NIC could be told to write into one.
    let o = kumo(&[
        "run",
        "--guest",
        "worker",
        "--cpus",
        "2",
        "--elastic",
        "cpus=1",
        "--net",
        "tap=kumo-none0",
        "--timeout",
        "30",
    ]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("has no NICs"), "{err}");
    let (s, _) = ApiClient::new(&a.sock).request("GET", "/api/v1/vm.elastic", None).unwrap();
    assert_eq!(s, 200);
}

#[test]
fn a_guest_touching_a_released_block_is_stopped_and_named() {
    if !two_cpus_or_skip("a_guest_touching_a_released_block_is_stopped_and_named") {
        return;
    }
    let dir = TestDir::new();
    // After acking the release, vCPU 0 keeps writing the first block it gave up.
    let a = Vm::start(&dir, "a", "cpus=1,memory=32M", &["tag=1", "touch_released=1"]);
    a.works_on(1, 100);
    let body = serde_json::json!({"memory_bytes": 2 << 20, "timeout_ms": 20000});
    let (s, r) = a.api.request("PUT", "/api/v1/vm.release", Some(&body)).unwrap();
    assert_eq!(s, 200, "{r:?}");
    let Vm { kid, .. } = a;
    let (code, out, err) = kid.wait();
    let gpa = field(&out, "worker: touching released block=", "gpa").expect("the guest said which block it touches");
    assert_ne!(code, Some(0), "kumo exited 0 after a guest touched released memory; stderr:\n{err}");
    assert!(
        err.contains(&format!("vCPU 0 touched guest-physical address {gpa}"))
            && err.contains("which the guest released"),
        "{err}"
    );
}
