//! End to end: `kumo run --numa …` and `--cpus N,pin=…` refuse bad topologies and pins with
//! one-line errors (exit status 1) before any VM is built, so these cases need no /dev/kvm;
//! `--numa mirror` and `--cpus N,pin=` pin vCPU threads, `vm.pin` re-pins them, and the VMM's
//! other threads keep off pinned vCPUs' CPUs (KVM).

use kumo_testkit::*;

#[test]
fn bad_numa_options_are_one_line_errors() {
    let n0 = "node=0,cpus=0,memory=128M";
    let n1 = "node=1,cpus=1,memory=128M";
    let cases: &[(&[&str], &str)] = &[
        (&["--numa", n0, "--numa", "node=0,cpus=1,memory=128M"], "NUMA node 0 is given twice"),
        (&["--numa", n0, "--numa", "node=1,cpus=0-1,memory=128M"], "cpu 0 is in two NUMA nodes: 0 and 1"),
        (&["--numa", n0, "--numa", "node=1,memory=128M"], "cpu 1 is in no NUMA node"),
        (&["--numa", n0, "--numa", "node=1,cpus=1:5,memory=128M"], "cpu 5 does not exist (the VM has 2 vCPUs)"),
        (
            &["--numa", n0, "--numa", "node=1,cpus=1,memory=64M"],
            "NUMA node memory sums to 192 MiB, not the VM's memory of 256 MiB",
        ),
        (
            &["--numa", n0, "--numa", "node=1,cpus=1,memory=128M,host-node=4095"],
            "NUMA node 1: host node 4095 does not exist",
        ),
        (
            &["--numa", n0, "--numa", n1, "--numa-distance", "0:1=20", "--numa-distance", "1:0=30"],
            "not symmetric: 0->1 is 20 but 1->0 is 30",
        ),
        (&["--numa", n0, "--numa", n1, "--numa-distance", "0:0=12"], "from node 0 to itself is 12, must be 10"),
        (&["--numa", n0, "--numa", n1, "--numa-distance", "0:1=255"], "distances between nodes must be 11..=254"),
        (&["--numa", "node=0,cpus=0,1,memory=256M"], "`1` is not key=value"),
        (&["--numa", "mirror", "--numa", n1], "--numa mirror is given alone"),
        (&["--numa", "mirror", "--cpus", "4096"], "4096 vCPUs but this host has"),
        (&["--numa-distance", "0:1=20"], "--numa-distance given, but no NUMA nodes"),
        (&["--cpus", "2,pin=0@0,0@1"], "vCPU 0 is pinned twice"),
        (&["--cpus", "2,pin=0@4095"], "host CPU 4095 is not online"),
        (&["--cpus", "2,pin=2@0"], "vCPU 2 does not exist (the VM has 2 vCPUs)"),
        (&["--cpus", "2,pin=zero@one"], "is not vCPU@hostCPU"),
        (&["--cpus", "2,pinned=0@0"], "is not pin=SPEC"),
        (&["--cpus", "two"], "is not a vCPU count"),
        (&["--numa", "mirror", "--cpus", "1,pin=0@0"], "--cpus N,pin= and --numa mirror both pin vCPUs"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["run", "--memory", "256M"];
        if !flags.contains(&"--cpus") {
            args.extend_from_slice(&["--cpus", "2"]);
        }
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--guest", "hello"]);
        let o = kumo(&args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{flags:?}: want `{want}` in `{err}`");
    }
}

/// `--numa mirror` (or a config file's `numa = "mirror"`) reproduces this host's nodes and pins
/// each vCPU to a host CPU of its own.
#[test]
fn numa_mirror_pins_each_vcpu_and_mirrors_the_host_nodes() {
    if !kvm_or_skip("numa_mirror_pins_each_vcpu_and_mirrors_the_host_nodes") {
        return;
    }
    let host = match kumo_vmm::placement::HostTopology::read_live() {
        Ok(h) => h,
        Err(e) => return eprintln!("skipping: cannot read this host's topology: {e}"),
    };
    let dir = TestDir::new();
    let file = dir.path("mirror.toml");
    std::fs::write(&file, "cpus = 1\nnuma = \"mirror\"\n").unwrap();
    let file = file.display().to_string();
    for (i, how) in [&["--cpus", "1", "--numa", "mirror"][..], &["--config", &file]].into_iter().enumerate() {
        let sock = dir.arg(&format!("api{i}.sock"));
        let mut args = vec!["run", "--api-socket", &sock];
        args.extend_from_slice(how);
        args.extend_from_slice(&["--guest", "memtouch", "until_input=1"]);
        let mut vm = Kid::spawn(&args);
        vm.wait_stdout("memtouch: pages=", PATIENCE);
        let info = eventually(PATIENCE, || kumo_api::ApiClient::new(&sock).info().ok());
        let nodes = info.numa;
        assert!(!nodes.is_empty() && nodes.len() <= host.nodes.len(), "{how:?}: {nodes:?}");
        assert_eq!(nodes.iter().map(|n| n.memory_bytes).sum::<u64>(), 256 << 20, "{nodes:?}");
        // vCPU 0's thread is pinned to one host CPU, the one the plan chose.
        let plan = kumo_vmm::placement::mirror(&host, 1, 256 << 20).unwrap();
        let task = std::fs::read_dir(format!("/proc/{}/task", vm.id()))
            .unwrap()
            .flatten()
            .find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "vcpu0"))
            .expect("a vcpu0 thread");
        let status = std::fs::read_to_string(task.path().join("status")).unwrap();
        let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string();
        assert_eq!(allowed, plan.pins[0].to_string(), "{how:?}: {status}");
        vm.stop_guest();
        let (code, out, err) = vm.wait();
        assert_eq!(code, Some(0), "{how:?}: {out}\n{err}");
    }
}

/// The `numa` guest prints exactly the configured topology, read from kumo's SRAT and SLIT, and
/// measures every vCPU against every node.
#[test]
fn the_numa_guest_sees_the_configured_topology() {
    if !kvm_or_skip("the_numa_guest_sees_the_configured_topology") {
        return;
    }
    use kumo_guests::numa::{parse_accesses, parse_topology, Node};
    let o = kumo(&[
        "run",
        "--cpus",
        "3",
        "--memory",
        "256M",
        "--numa",
        "node=0,cpus=0,memory=64M",
        "--numa",
        "node=1,cpus=1-2,memory=192M",
        "--numa-distance",
        "0:1=21",
        "--guest",
        "numa",
        "mib=2",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    let t = parse_topology(&out).unwrap_or_else(|| panic!("no topology:\n{out}"));
    assert_eq!(
        t.nodes,
        [
            Node { id: 0, cpus: vec![0], memory: vec![(0, 64 << 20)] },
            Node { id: 1, cpus: vec![1, 2], memory: vec![(64 << 20, 256 << 20)] },
        ],
        "{out}"
    );
    assert_eq!(t.distances, [[10, 21], [21, 10]]);
    let mut seen: Vec<(u32, u32)> = parse_accesses(&out).iter().map(|a| (a.vcpu, a.node)).collect();
    seen.sort();
    assert_eq!(seen, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], "{out}");

    // Without --numa: one node with every vCPU and all RAM, as Linux would fake it.
    let o = kumo(&["run", "--cpus", "2", "--memory", "128M", "--guest", "numa", "measure=0"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    let t = parse_topology(&out).unwrap_or_else(|| panic!("no topology:\n{out}"));
    assert_eq!(t.nodes, [Node { id: 0, cpus: vec![0, 1], memory: vec![(0, 128 << 20)] }], "{out}");
}

/// `kumo run --cpus CPUS` of a memtouch guest that runs until its console input, with an API
/// socket, once the guest is up: its directory (kept for the VM's life), socket and process.
fn memtouch_vm(cpus: &str) -> (TestDir, String, Kid) {
    let dir = TestDir::new();
    let sock = dir.arg("api.sock");
    let vm = Kid::spawn(&["run", "--api-socket", &sock, "--cpus", cpus, "--guest", "memtouch", "until_input=1"]);
    vm.wait_stdout("memtouch: pages=", PATIENCE);
    (dir, sock, vm)
}

/// The `Cpus_allowed_list` of each `vcpuN` thread of process `pid`, vCPU 0 first.
fn vcpu_affinities(pid: u32, vcpus: u32) -> Vec<String> {
    let threads = thread_cpus(pid);
    (0..vcpus)
        .map(|v| {
            let name = format!("vcpu{v}");
            threads.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no {name} thread")).1.clone()
        })
        .collect()
}

/// Each thread of `pid` but its vCPUs and KVM's workers (`kvm-nx-lpage-recovery` is a kernel
/// worker in the VMM's thread group, not kumo's): name and `Cpus_allowed_list`.
fn other_threads(pid: u32) -> Vec<(String, String)> {
    thread_cpus(pid).into_iter().filter(|(n, _)| !n.starts_with("vcpu") && !n.starts_with("kvm-")).collect()
}

/// `--cpus 1,pin=0@1` gives vCPU 0 host CPU 1 to itself: every other thread of the VMM
/// (devices, the API and its connections, the console, the main thread) runs on the VMM's other
/// CPUs, and follows `vm.pin`: with the vCPU unpinned they float over all of them again.
#[test]
fn io_threads_keep_off_a_pinned_vcpus_cpu() {
    if !kvm_or_skip("io_threads_keep_off_a_pinned_vcpus_cpu") {
        return;
    }
    let all = kumo_vm::sched::thread_affinity().unwrap();
    if !(all.contains(&0) && all.contains(&1)) {
        return eprintln!("skipping: needs host CPUs 0 and 1 allowed");
    }
    let but =
        |c: u32| kumo_vmm::placement::format_cpulist(&all.iter().copied().filter(|&x| x != c).collect::<Vec<_>>());
    let (_dir, sock, mut vm) = memtouch_vm("1,pin=0@1");
    let c = kumo_api::ApiClient::new(&sock);
    eventually(PATIENCE, || c.info().ok());
    let check = |want: &str, vcpu: &str| {
        let others = other_threads(vm.id());
        assert!(others.len() >= 3, "{others:?}");
        assert!(others.iter().all(|(_, cpus)| cpus == want), "want every thread on {want}: {others:?}");
        assert_eq!(vcpu_affinities(vm.id(), 1), [vcpu]);
    };
    check(&but(1), "1");
    c.pin(0, None).unwrap();
    let every = kumo_vmm::placement::format_cpulist(&all);
    check(&every, &every);
    c.pin(0, Some(0)).unwrap();
    check(&but(0), "0");
    vm.stop_guest();
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");
}

/// `--cpus 2,pin=0@0,1@1` pins each vCPU thread at start; `vm.pin` re-pins vCPU 1 and unpins
/// it, running and paused, and `vm.info` reads each pin back.
#[test]
fn cpus_pin_pins_vcpu_threads_and_vm_pin_repins_them() {
    if !kvm_or_skip("cpus_pin_pins_vcpu_threads_and_vm_pin_repins_them") {
        return;
    }
    let online = match kumo_vmm::placement::HostTopology::read_live() {
        Ok(h) => h.online_cpus(),
        Err(e) => return eprintln!("skipping: cannot read this host's topology: {e}"),
    };
    if !(online.contains(&0) && online.contains(&1)) || kumo_vm::sched::thread_affinity().unwrap().len() < 2 {
        return eprintln!("skipping: needs host CPUs 0 and 1 online and allowed");
    }
    let (_dir, sock, mut vm) = memtouch_vm("2,pin=0@0,1@1");
    let c = kumo_api::ApiClient::new(&sock);
    let info = eventually(PATIENCE, || c.info().ok());
    assert_eq!(info.vcpu_pins, [Some(0), Some(1)]);
    assert_eq!(vcpu_affinities(vm.id(), 2), ["0", "1"]);
    // Each vCPU has a host CPU of its own: the dedicated PV defaults (realtime hint on).
    let pv = info.pv.expect("vm.info has the PV features");
    assert!(pv.realtime && !pv.steal_time, "{pv:?}");

    // Re-pinned through the API, then through `kumo pin` while paused.
    c.pin(1, Some(0)).unwrap();
    assert_eq!(vcpu_affinities(vm.id(), 2), ["0", "0"]);
    assert_eq!(c.info().unwrap().vcpu_pins, [Some(0), Some(0)]);
    c.pause().unwrap();
    let o = kumo(&["--api-socket", &sock, "pin", "--vcpu", "1", "--cpu", "none"]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(c.info().unwrap().vcpu_pins, [Some(0), None]);
    assert_ne!(vcpu_affinities(vm.id(), 2)[1], "0");
    c.resume().unwrap();

    // Bad requests are 400s with a message naming the problem; the pins stay.
    for (vcpu, cpu, want) in [(2, Some(0), "vCPU 2 does not exist"), (0, Some(4095), "host CPU 4095 is not online")] {
        let body = serde_json::json!({"vcpu": vcpu, "cpu": cpu});
        let (status, b) = c.request("PUT", "/api/v1/vm.pin", Some(&body)).unwrap();
        assert_eq!(status, 400, "{body}");
        assert!(b.unwrap()["error"].as_str().unwrap().contains(want), "{body}");
    }
    let o = kumo(&["--api-socket", &sock, "pin", "--vcpu", "5", "--cpu", "0"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("vCPU 5 does not exist") && err.trim().lines().count() == 1, "{err}");
    assert_eq!(c.info().unwrap().vcpu_pins, [Some(0), None]);

    vm.stop_guest();
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");
}

/// A node's `pin=`: node 0's vCPU onto its host node's CPUs, node 1's onto a listed CPU; a
/// node pin beside `--cpus N,pin=` is a one-line error.
#[test]
fn numa_nodes_pin_their_vcpus() {
    if !kvm_or_skip("numa_nodes_pin_their_vcpus") {
        return;
    }
    let host = match kumo_vmm::placement::HostTopology::read_live() {
        Ok(h) => h,
        Err(e) => return eprintln!("skipping: cannot read this host's topology: {e}"),
    };
    let Some(node0) = host.nodes.first() else { return eprintln!("skipping: no host node") };
    let first = host.fill_order(node0)[0];
    let other = *host.online_cpus().last().unwrap();
    if kumo_vm::sched::thread_affinity().unwrap().len() < host.online_cpus().len() {
        return eprintln!("skipping: this process may not run on every online CPU");
    }
    let dir = TestDir::new();
    let sock = dir.arg("api.sock");
    let n0 = format!("node=0,cpus=0,memory=128M,host-node={},pin=host-node", node0.id);
    let n1 = format!("node=1,cpus=1,memory=128M,pin={other}");
    let args = ["run", "--api-socket", &sock, "--cpus", "2", "--memory", "256M", "--numa", &n0, "--numa", &n1];
    let mut vm = Kid::spawn(&[&args[..], &["--guest", "memtouch", "until_input=1"]].concat());
    vm.wait_stdout("memtouch: pages=", PATIENCE);
    let info = eventually(PATIENCE, || kumo_api::ApiClient::new(&sock).info().ok());
    assert_eq!(info.vcpu_pins, [Some(first), Some(other)]);
    assert_eq!(vcpu_affinities(vm.id(), 2), [first.to_string(), other.to_string()]);
    vm.stop_guest();
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "{out}\n{err}");

    let o = kumo(&["run", "--cpus", "2,pin=0@0", "--memory", "256M", "--numa", &n0, "--numa", &n1, "--guest", "hello"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("a NUMA node's pin= both pin vCPUs") && err.trim().lines().count() == 1, "{err}");
}
