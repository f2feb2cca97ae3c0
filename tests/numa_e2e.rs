//! End to end: `kumo run --numa …` refuses bad guest NUMA topologies with one-line errors
//! (exit status 1) before any VM is built, so these cases need no /dev/kvm.

mod common;

use common::*;

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
        (&["--numa", "mirror"], "--numa mirror: not yet implemented"),
        (&["--numa-distance", "0:1=20"], "--numa-distance given, but no NUMA nodes"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["run", "--cpus", "2", "--memory", "256M"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--guest", "hello"]);
        let o = kumo(&args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{flags:?}: want `{want}` in `{err}`");
    }
}
