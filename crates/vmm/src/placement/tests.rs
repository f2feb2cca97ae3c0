use super::*;
use std::path::{Path, PathBuf};

const KB: u64 = 1024;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn read(name: &str) -> HostTopology {
    HostTopology::read(&fixture(name)).unwrap()
}

fn list(s: &str) -> Vec<u32> {
    parse_cpu_set(s).unwrap()
}

#[test]
fn cpulist_parser() {
    assert_eq!(list("0-3,8-11,16\n"), [0, 1, 2, 3, 8, 9, 10, 11, 16]);
    assert_eq!(list("5"), [5]);
    assert_eq!(list(""), Vec::<u32>::new());
    assert_eq!(list("\n"), Vec::<u32>::new());
    assert_eq!(list("7-7"), [7]);
    assert_eq!(list("8,0-2,1"), [0, 1, 2, 8]);
    for bad in ["3-1", "1,,2", "a", "-1", "1-", "0-3:2", " 1, 2", "4294967296"] {
        assert!(parse_cpu_set(bad).is_err(), "{bad:?} parsed");
    }
    assert_eq!(parse_cpu_set("3-1").unwrap_err(), r#"range "3-1" in CPU list "3-1" runs backwards"#);
    // kumo's own lists (`cpus=`, `pin=`) are joined by `:` and keep their order and repeats.
    assert_eq!(parse_cpu_list("5:0-1:5", ':').unwrap(), [5, 0, 1, 5]);
    assert_eq!(parse_cpu_list("0-1,4", ':').unwrap_err(), r#""0-1,4" in CPU list "0-1,4" is not N or N-M"#);
    assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 16, 17]), "0-3,8,16-17");
    assert_eq!(format_cpulist(&[]), "");
    assert_eq!(list(&format_cpulist(&list("0-7,16-23"))), list("0-7,16-23"));
}

#[test]
fn reads_the_two_node_fixture() {
    let t = read("sysfs-2node");
    assert_eq!(t.nodes.len(), 2);
    assert_eq!(t.nodes[0], HostNode { id: 0, cpus: list("0-7,16-23"), memory: 65649416 * KB });
    assert_eq!(t.nodes[1], HostNode { id: 1, cpus: list("8-15,24-31"), memory: 66052300 * KB });
    assert_eq!(t.distances, [[10, 21], [21, 10]]);
    assert_eq!(t.online_cpus(), list("0-31"));
    assert_eq!(t.memory(), (65649416 + 66052300) * KB);
    assert_eq!(t.cpu(0), Some(&HostCpu { id: 0, node: 0, package: 0, core: 0, siblings: vec![0, 16] }));
    assert_eq!(t.cpu(13), Some(&HostCpu { id: 13, node: 1, package: 1, core: 9, siblings: vec![13, 29] }));
    assert_eq!(t.cpu(29), Some(&HostCpu { id: 29, node: 1, package: 1, core: 9, siblings: vec![13, 29] }));
    assert_eq!(t.fill_order(&t.nodes[1]), list("8-15,24-31"));
}

#[test]
fn reads_the_four_node_fixture() {
    let t = read("sysfs-4node");
    let ids: Vec<u32> = t.nodes.iter().map(|n| n.id).collect();
    assert_eq!(ids, [0, 1, 2, 3]);
    let cpus: Vec<String> = t.nodes.iter().map(|n| format_cpulist(&n.cpus)).collect();
    assert_eq!(cpus, ["0-3,16-19", "4-7,20-23", "8-11,24-27", "12-15,28-30"]);
    let mem: Vec<u64> = t.nodes.iter().map(|n| n.memory / KB).collect();
    assert_eq!(mem, [32480212, 33025300, 33016692, 32998876]);
    assert_eq!(t.distances, [[10, 11, 21, 21], [11, 10, 21, 21], [21, 21, 10, 11], [21, 21, 11, 10]]);
    // CPU 31 is offline: not listed, and its core's other thread has no sibling.
    assert_eq!(t.online_cpus(), list("0-30"));
    assert_eq!(t.cpu(31), None);
    assert_eq!(t.cpu(15), Some(&HostCpu { id: 15, node: 3, package: 1, core: 11, siblings: vec![15] }));
    assert_eq!(t.cpu(20), Some(&HostCpu { id: 20, node: 1, package: 0, core: 8, siblings: vec![4, 20] }));
    assert_eq!(t.fill_order(&t.nodes[3]), [12, 13, 14, 15, 28, 29, 30]);
}

#[test]
fn a_host_without_numa_is_one_node() {
    let t = read("sysfs-nonuma");
    assert_eq!(t.nodes, [HostNode { id: 0, cpus: vec![0, 1, 2, 3], memory: 8046460 * KB }]);
    assert_eq!(t.distances, [[10]]);
    assert_eq!(t.cpu(1).map(|c| (c.core, c.siblings.clone())), Some((0, vec![0, 1])));
    // AMD-style numbering (siblings adjacent): cores first all the same.
    assert_eq!(t.fill_order(&t.nodes[0]), [0, 2, 1, 3]);
}

#[test]
fn reads_this_host() {
    if !Path::new("/sys/devices/system/cpu/online").exists() {
        eprintln!("skipping: /sys is not readable here");
        return;
    }
    let t = HostTopology::read_live().unwrap();
    let online = parse_cpu_set(&std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap()).unwrap();
    assert_eq!(t.online_cpus(), online);
    assert!(!t.nodes.is_empty() && t.memory() > 0);
    assert_eq!(t.distances.len(), t.nodes.len());
    for (i, row) in t.distances.iter().enumerate() {
        assert_eq!(row[i], 10);
    }
    let mut all: Vec<u32> = t.nodes.iter().flat_map(|n| n.cpus.clone()).collect();
    all.sort_unstable();
    assert_eq!(all, online);
    let plan = mirror(&t, online.len() as u32, 64 * MIB).unwrap();
    let mut pins = plan.pins.clone();
    pins.sort_unstable();
    assert_eq!(pins, online);
}

/// A copy of a fixture with `edit` applied, in a fresh temporary directory.
fn broken(name: &str, edit: impl FnOnce(&Path)) -> (PlacementError, String) {
    let dir = std::env::temp_dir().join(format!("kumo-hosttopo-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&fixture("sysfs-2node"), &dir);
    edit(&dir);
    let e = HostTopology::read(&dir).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    let root = dir.display().to_string();
    let msg = e.to_string().replace(&root, "ROOT");
    (e, msg)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn a_malformed_tree_is_a_one_line_error_naming_the_file() {
    let node = "sys/devices/system/node";
    let write = |rel: &'static str, text: &'static str| move |d: &Path| std::fs::write(d.join(rel), text).unwrap();
    type Edit = Box<dyn FnOnce(&Path)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "online",
            Box::new(write("sys/devices/system/cpu/online", "0-x\n")),
            r#"ROOT/sys/devices/system/cpu/online: "0-x" in CPU list "0-x" is not N or N-M"#,
        ),
        (
            "distance",
            Box::new(write("sys/devices/system/node/node1/distance", "21 10 20\n")),
            "ROOT/sys/devices/system/node/node1/distance: 3 distances for 2 nodes",
        ),
        (
            "distance-value",
            Box::new(write("sys/devices/system/node/node0/distance", "10 300\n")),
            r#"ROOT/sys/devices/system/node/node0/distance: distance "300" is not a number 0..=255"#,
        ),
        (
            "meminfo",
            Box::new(write("sys/devices/system/node/node0/meminfo", "Node 0 MemFree: 5 kB\n")),
            "ROOT/sys/devices/system/node/node0/meminfo: no MemTotal line",
        ),
        (
            "twice",
            Box::new(write("sys/devices/system/node/node1/cpulist", "7-15,24-31\n")),
            "ROOT/sys/devices/system/node/node1/cpulist: cpu 7 is also in another node",
        ),
        (
            "core",
            Box::new(write("sys/devices/system/cpu/cpu3/topology/core_id", "three\n")),
            r#"ROOT/sys/devices/system/cpu/cpu3/topology/core_id: "three" is not a number"#,
        ),
        (
            "siblings",
            Box::new(write("sys/devices/system/cpu/cpu3/topology/thread_siblings_list", "4,20\n")),
            "ROOT/sys/devices/system/cpu/cpu3/topology/thread_siblings_list: does not list cpu 3 itself",
        ),
        (
            "nonode",
            Box::new(write("sys/devices/system/node/node1/cpulist", "8-15,24-30\n")),
            "ROOT/sys/devices/system/node: online cpu 31 is in no node's cpulist",
        ),
        (
            "missing",
            Box::new(move |d: &Path| std::fs::remove_file(d.join(node).join("node1/meminfo")).unwrap()),
            "ROOT/sys/devices/system/node/node1/meminfo: No such file or directory (os error 2)",
        ),
    ];
    for (name, edit, want) in cases {
        let (e, msg) = broken(name, edit);
        assert!(matches!(e, PlacementError::Read { .. }));
        assert_eq!(msg, want);
        assert!(!msg.contains('\n'));
    }
}

fn node(id: u32, host_node: u32, vcpus: std::ops::Range<u32>, memory: u64) -> MirrorNode {
    MirrorNode { id, host_node, vcpus: vcpus.collect(), memory }
}

#[test]
fn mirrors_the_two_node_fixture() {
    let t = read("sysfs-2node");
    let p = mirror(&t, 4, 4 * GIB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..2, 2 * GIB), node(1, 1, 2..4, 2 * GIB)]);
    assert_eq!(p.distances, [[10, 21], [21, 10]]);
    assert_eq!(p.pins, [0, 1, 8, 9]);
    assert_eq!(p.memory_sizes(), [2 * GIB, 2 * GIB]);

    // Odd counts: the lower node takes the extra vCPU and the extra 2 MiB; the last node
    // takes the remainder below 2 MiB.
    let p = mirror(&t, 3, GIB + 2 * MIB + 4 * KB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..2, 514 * MIB), node(1, 1, 2..3, 512 * MIB + 4 * KB)]);
    assert_eq!(p.pins, [0, 1, 8]);
    assert_eq!(p.memory_sizes().iter().sum::<u64>(), GIB + 2 * MIB + 4 * KB);

    // Past the physical cores: the SMT siblings come after all 8 cores of the node.
    let p = mirror(&t, 20, 6 * GIB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..10, 3 * GIB), node(1, 1, 10..20, 3 * GIB)]);
    assert_eq!(p.pins, [0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25]);

    // Every host CPU once.
    let p = mirror(&t, 32, 120 * GIB).unwrap();
    let mut want = list("0-7,16-23");
    want.extend(list("8-15,24-31"));
    assert_eq!(p.pins, want);
    assert_eq!(p.memory_sizes(), [60 * GIB, 60 * GIB]);

    // One vCPU: node 1 keeps its memory and has no CPU.
    let p = mirror(&t, 1, 512 * MIB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..1, 256 * MIB), node(1, 1, 1..1, 256 * MIB)]);
    assert_eq!(p.pins, [0]);
}

#[test]
fn mirrors_the_four_node_fixture() {
    let t = read("sysfs-4node");
    let p = mirror(&t, 6, 8 * GIB).unwrap();
    assert_eq!(
        p.nodes,
        [node(0, 0, 0..2, 2 * GIB), node(1, 1, 2..4, 2 * GIB), node(2, 2, 4..5, 2 * GIB), node(3, 3, 5..6, 2 * GIB)]
    );
    assert_eq!(p.pins, [0, 1, 4, 5, 8, 12]);
    assert_eq!(p.distances, t.distances);

    // All 31 online CPUs: node 3 has only 7 (CPU 31 is offline).
    let p = mirror(&t, 31, 10 * GIB + 6 * MIB).unwrap();
    let counts: Vec<usize> = p.nodes.iter().map(|n| n.vcpus.len()).collect();
    assert_eq!(counts, [8, 8, 8, 7]);
    let sizes: Vec<u64> = p.memory_sizes().iter().map(|s| s / MIB).collect();
    assert_eq!(sizes, [2562, 2562, 2562, 2560]);
    assert_eq!(&p.pins[24..], [12, 13, 14, 15, 28, 29, 30]);
    assert_eq!(&p.pins[..8], [0, 1, 2, 3, 16, 17, 18, 19]);

    // Two vCPUs on four nodes: nodes 2 and 3 hold memory only.
    let p = mirror(&t, 2, 4 * GIB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..1, GIB), node(1, 1, 1..2, GIB), node(2, 2, 2..2, GIB), node(3, 3, 2..2, GIB)]);
    assert_eq!(p.pins, [0, 4]);
}

#[test]
fn mirror_skips_empty_host_nodes_and_keeps_host_ids() {
    let mut t = read("sysfs-2node");
    // A CPU-less, memory-less node 2 (as a CXL or hot-plug slot may show) and a memory-only node 5.
    t.nodes.push(HostNode { id: 2, cpus: vec![], memory: 0 });
    t.nodes.push(HostNode { id: 5, cpus: vec![], memory: 16 * GIB });
    t.distances = vec![vec![10, 21, 30, 40], vec![21, 10, 31, 41], vec![30, 31, 10, 50], vec![40, 41, 50, 10]];
    let p = mirror(&t, 2, 3 * GIB).unwrap();
    assert_eq!(p.nodes, [node(0, 0, 0..1, GIB), node(1, 1, 1..2, GIB), node(2, 5, 2..2, GIB)]);
    assert_eq!(p.distances, [[10, 21, 40], [21, 10, 41], [40, 41, 10]]);
}

#[test]
fn mirror_refuses_what_it_cannot_mirror() {
    let t = read("sysfs-4node");
    let cases = [
        (mirror(&t, 0, GIB), "--numa mirror needs at least 1 vCPU"),
        (
            mirror(&t, 32, GIB),
            "--numa mirror: 32 vCPUs but this host has 31 online CPUs (mirror mode pins each vCPU to a host CPU of its own)",
        ),
        (mirror(&t, 4, 200 * GIB), "--numa mirror: memory 200 GiB is more than this host's 125.4 GiB"),
        (mirror(&t, 4, 125 * GIB), "--numa mirror: guest node 0 would get 31.2 GiB but host node 0 has only 31 GiB"),
    ];
    for (got, want) in cases {
        assert_eq!(got.unwrap_err().to_string(), want);
    }
}

#[test]
fn pin_specs() {
    let online = list("0-7");
    assert_eq!(parse_pins("0@2:1@3", 2, &online).unwrap(), [(0, 2), (1, 3)]);
    assert_eq!(parse_pins("1@3,0@2", 2, &online).unwrap(), [(0, 2), (1, 3)]);
    assert_eq!(parse_pins("0-3@4-7", 4, &online).unwrap(), [(0, 4), (1, 5), (2, 6), (3, 7)]);
    assert_eq!(parse_pins("0@1:1@1", 2, &online).unwrap(), [(0, 1), (1, 1)]);

    let err = |spec: &str, vcpus: u32| parse_pins(spec, vcpus, &online).unwrap_err().to_string();
    assert_eq!(err("", 2), "pin=: empty; give vCPU@hostCPU pairs, e.g. pin=0@2:1@3");
    assert_eq!(err("0@2:0@3", 2), "pin=0@2:0@3: vCPU 0 is pinned twice");
    assert_eq!(err("0@9", 2), "pin=0@9: host CPU 9 is not online (online: 0-7)");
    assert_eq!(err("4@1", 4), "pin=4@1: vCPU 4 does not exist (the VM has 4 vCPUs)");
    assert_eq!(err("0=1", 2), r#"pin=0=1: "0=1" is not vCPU@hostCPU (or A-B@C-D)"#);
    assert_eq!(err("0@1::1@2", 2), r#"pin=0@1::1@2: "" is not vCPU@hostCPU (or A-B@C-D)"#);
    assert_eq!(err("0-1@3-5", 2), r#"pin=0-1@3-5: "0-1@3-5" pins 2 vCPUs to 3 host CPUs"#);
    assert_eq!(err("1-0@3-2", 2), r#"pin=1-0@3-2: "1-0@3-2" is not vCPU@hostCPU (or A-B@C-D)"#);
}

#[test]
fn dedicated_means_every_vcpu_on_a_cpu_of_its_own() {
    assert!(is_dedicated(&[(0, 2), (1, 3)], 2));
    assert!(!is_dedicated(&[(0, 2), (1, 2)], 2));
    assert!(!is_dedicated(&[(0, 2)], 2));
    let plan = mirror(&read("sysfs-2node"), 5, GIB).unwrap();
    let pins: Vec<(u32, u32)> = plan.pins.iter().enumerate().map(|(v, &h)| (v as u32, h)).collect();
    assert!(is_dedicated(&pins, 5));
}

#[test]
fn cpus_arg() {
    let online = [0, 1, 2, 3];
    assert_eq!(parse_cpus_arg("2", &online).unwrap(), (2, vec![]));
    // The count's own limits are the VM's to check, with their own messages.
    assert_eq!(parse_cpus_arg("0", &online).unwrap(), (0, vec![]));
    assert_eq!(parse_cpus_arg("4294967295", &online).unwrap(), (u32::MAX, vec![]));
    assert_eq!(parse_cpus_arg("2,pin=0@2,1@3", &online).unwrap(), (2, vec![Some(2), Some(3)]));
    assert_eq!(parse_cpus_arg("2,pin=0@0:1@1", &online).unwrap(), (2, vec![Some(0), Some(1)]));
    // Only some vCPUs pinned: the others float.
    assert_eq!(parse_cpus_arg("3,pin=1@3", &online).unwrap(), (3, vec![None, Some(3)]));
    let bad = |arg: &str, want: &str| {
        let e = parse_cpus_arg(arg, &online).unwrap_err();
        assert!(e.contains(want), "{arg:?}: {e}");
        assert!(!e.contains('\n'), "{arg:?}: not one line: {e}");
    };
    bad("2,pin=0@1,0@2", "vCPU 0 is pinned twice");
    bad("2,pin=0@1,1@9", "host CPU 9 is not online");
    bad("2,pin=0@1,2@2", "vCPU 2 does not exist");
    bad("2,pin=zz", "is not vCPU@hostCPU");
    bad("2,pin=", "empty");
    bad("2,affinity=0@1", "is not pin=SPEC");
    bad("two", "is not a vCPU count");
    bad("-1", "is not a vCPU count");
    bad("", "is not a vCPU count");
}

#[test]
fn dedicated_needs_a_host_cpu_per_vcpu() {
    assert!(pins_dedicated(&[Some(2), Some(3)], 2));
    assert!(!pins_dedicated(&[Some(2), Some(2)], 2));
    assert!(!pins_dedicated(&[Some(2)], 2));
    assert!(!pins_dedicated(&[Some(2), None], 2), "a floating vCPU is not dedicated");
    assert!(!pins_dedicated(&[], 2));
}

/// A mirror plan's guest nodes, as the VM's `NumaConfig` gives them to the ACPI tables: each
/// node's memory cut from guest RAM in node order (across the MMIO gap), the host's distances.
#[test]
fn a_two_node_mirror_crosses_the_mmio_gap() {
    use kumo_acpi::NumaNode;
    let plan = mirror(&read("sysfs-2node"), 4, 4 * GIB).unwrap();
    let t = NumaConfig::from_mirror(&plan).topology(4, 4 * GIB).unwrap();
    assert_eq!(t.nodes[0], NumaNode { id: 0, cpus: vec![0, 1], memory: vec![(0, 2 * GIB)] });
    assert_eq!(t.nodes[1], NumaNode { id: 1, cpus: vec![2, 3], memory: vec![(2 * GIB, GIB), (4 * GIB, GIB)] });
    assert_eq!(t.distances, [[10, 21], [21, 10]]);
}

#[test]
fn a_four_node_mirror_builds_srat_and_slit() {
    use kumo_vm::layout::MemoryLayout;
    let plan = mirror(&read("sysfs-4node"), 2, 512 * MIB + 4096).unwrap();
    let layout = MemoryLayout::new(512 * MIB + 4096);
    let t = NumaConfig::from_mirror(&plan).topology(2, 512 * MIB + 4096).unwrap();
    let mem: Vec<Vec<(u64, u64)>> = t.nodes.iter().map(|n| n.memory.clone()).collect();
    assert_eq!(
        mem,
        [
            vec![(0, 128 * MIB)],
            vec![(128 * MIB, 128 * MIB)],
            vec![(256 * MIB, 128 * MIB)],
            vec![(384 * MIB, 128 * MIB + 4096)]
        ]
    );
    let cpus: Vec<Vec<u32>> = t.nodes.iter().map(|n| n.cpus.clone()).collect();
    assert_eq!(cpus, [vec![0], vec![1], vec![], vec![]]);
    assert_eq!(t.distance(0, 1), 11);
    assert_eq!(t.distance(1, 3), 21);
    let cfg = kumo_acpi::AcpiConfig {
        cpus: 2,
        layout: &layout,
        irqchip: kumo_vm::IrqchipMode::Kernel,
        pci: None,
        numa: Some(&t),
        ged: None,
        sleep: None,
    };
    let tables = kumo_acpi::build(&cfg).unwrap();
    let slit = &tables.find(b"SLIT").unwrap().1;
    // 36-byte header, 8-byte node count, then the 4x4 matrix.
    assert_eq!(u64::from_le_bytes(slit[36..44].try_into().unwrap()), 4);
    assert_eq!(slit[44..60], [10, 11, 21, 21, 11, 10, 21, 21, 21, 21, 10, 11, 21, 21, 11, 10]);
    assert!(tables.find(b"SRAT").is_some());
    // A plan for other memory does not fit the VM.
    let plan = mirror(&read("sysfs-2node"), 2, GIB).unwrap();
    let e = NumaConfig::from_mirror(&plan).topology(2, 2 * GIB).unwrap_err();
    assert_eq!(e.to_string(), "config: NUMA node memory sums to 1 GiB, not the VM's memory of 2 GiB");
}

/// `place` for a booting VM: mirror (from the flag or a config file) plans nodes and pins from
/// the host, a node's pin= gives pins, --cpus pins pass through, and two sources of pins are
/// refused; the host is read only when needed.
#[test]
fn place_plans_nodes_and_pins_from_what_was_asked() {
    let host = || Ok(read("sysfs-2node"));
    let (numa, pins) = place(4, 4 * GIB, vec![], Some(NumaRequest::Mirror), host).unwrap();
    let plan = mirror(&read("sysfs-2node"), 4, 4 * GIB).unwrap();
    assert_eq!(numa, Some(NumaConfig::from_mirror(&plan)));
    assert_eq!(pins, [Some(0), Some(1), Some(8), Some(9)]);
    let no_host = || -> Result<HostTopology> { panic!("the host is not read without mirror or a node pin=") };
    assert_eq!(place(2, GIB, vec![None, Some(3)], None, no_host).unwrap(), (None, vec![None, Some(3)]));
    let nodes = NumaConfig {
        nodes: vec![NumaNodeSpec::parse("node=0,cpus=0-1,memory=1G,host-node=1,pin=host-node").unwrap()],
        distances: vec![],
    };
    let (numa, pins) = place(2, GIB, vec![], Some(NumaRequest::Nodes(nodes.clone())), host).unwrap();
    assert_eq!((numa, pins), (Some(nodes.clone()), vec![Some(8), Some(9)]));
    let plain =
        NumaConfig { nodes: vec![NumaNodeSpec::parse("node=0,cpus=0-1,memory=1G").unwrap()], distances: vec![] };
    let (numa, pins) = place(2, GIB, vec![Some(5)], Some(NumaRequest::Nodes(plain.clone())), no_host).unwrap();
    assert_eq!((numa, pins), (Some(plain), vec![Some(5)]));
    for (numa, want) in [
        (NumaRequest::Mirror, "--cpus N,pin= and --numa mirror both pin vCPUs; give one of them"),
        (NumaRequest::Nodes(nodes), "--cpus N,pin= and a NUMA node's pin= both pin vCPUs; give one of them"),
    ] {
        assert_eq!(place(2, GIB, vec![Some(1)], Some(numa), host).unwrap_err(), want);
    }
    let e = place(64, GIB, vec![], Some(NumaRequest::Mirror), host).unwrap_err();
    assert!(e.starts_with("--numa mirror: 64 vCPUs but this host has 32 online CPUs"), "{e}");
    let broken = || Err(PlacementError::Read { path: "/sys".into(), what: "gone".into() });
    assert_eq!(place(1, GIB, vec![], Some(NumaRequest::Mirror), broken).unwrap_err(), "--numa mirror: /sys: gone");
}

/// A config file says `mirror` as the flag does: `numa = "mirror"` (TOML) or `"numa": "mirror"`
/// (JSON); a table is nodes as before; any other word is a one-line error.
#[test]
fn numa_requests_read_from_files() {
    let m: NumaRequest = serde_json::from_str(r#""mirror""#).unwrap();
    assert_eq!(m, NumaRequest::Mirror);
    let n: NumaRequest = serde_json::from_str(r#"{"nodes": [{"id": 0, "cpus": [0], "memory": "1G"}]}"#).unwrap();
    let NumaRequest::Nodes(n) = n else { panic!("not nodes") };
    assert_eq!(n.nodes[0], NumaNodeSpec { id: 0, cpus: vec![0], memory: GIB, host_node: None, pin: None });
    let e = serde_json::from_str::<NumaRequest>(r#""mirrored""#).unwrap_err().to_string();
    assert!(e.contains(r#"invalid value: string "mirrored", expected "mirror" or a table of nodes"#), "{e}");
    let e = serde_json::from_str::<NumaRequest>(r#"{"nodes": [], "x": 1}"#).unwrap_err().to_string();
    assert!(e.contains("unknown field `x`"), "{e}");
}

#[test]
fn io_threads_keep_off_pinned_vcpus_cpus_while_a_cpu_is_left() {
    let all = [0, 1, 2, 3];
    assert_eq!(io_cpus(&all, &[]), all, "nothing pinned");
    assert_eq!(io_cpus(&all, &[None, None]), all);
    assert_eq!(io_cpus(&all, &[Some(3)]), [0, 1, 2]);
    assert_eq!(io_cpus(&all, &[Some(1), None, Some(2), Some(1)]), [0, 3], "two vCPUs on one CPU, one floating");
    assert_eq!(io_cpus(&all, &[Some(0), Some(1), Some(2), Some(3)]), all, "every CPU pinned: none to keep off");
    assert_eq!(io_cpus(&[2, 3], &[Some(0), Some(3)]), [2], "a pin outside the VMM's CPUs takes none of them");
}
