//! Guest NUMA nodes from the command line (`--numa`, `--numa-distance`) or a config file's
//! `numa` section, turned into the `kumo_acpi::NumaTopology` the SRAT/SLIT describe, and the
//! host nodes each node's memory is bound to. The nodes' ids, vCPUs, memory and distances are
//! the VM's and migrate; a node's `host_node` and `pin` are this host's (an arriving VM gets
//! its operator's, `crate::host_resources`; its vCPU pins are [`super::pins`]').
//!
//! Syntax: `--numa node=ID,cpus=LIST,memory=SIZE[,host-node=N][,pin=host-node|LIST]`, where
//! LIST is ranges `A-B` or single CPUs joined by `:` (`0-3`, `0:2`, `0-1:4-5`), since `,`
//! separates the keys; and `--numa-distance SRC:DST=VAL`. `pin=` pins the node's vCPUs, in
//! order, to the given host CPUs or to its host node's CPUs (one per core first, as mirror does). A distance given one way also sets the other way; both ways
//! given must agree. Node memory is laid out in node-id order from guest address 0.

use std::path::Path;

use kumo_acpi::{NumaNode, NumaTopology, LOCAL_DISTANCE, REMOTE_DISTANCE};
use kumo_vm::layout::MemoryLayout;
use serde::{Deserialize, Serialize};

use super::parse_cpu_list;
use crate::Error;

/// Where the host's NUMA nodes are listed (`nodeN` directories).
pub const HOST_NODE_SYSFS: &str = "/sys/devices/system/node";

/// A VM's guest NUMA nodes and the distances between them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaConfig {
    pub nodes: Vec<NumaNodeSpec>,
    /// Given distances; the rest default to 10 (a node to itself) and 20.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub distances: Vec<NumaDistance>,
}

/// One guest node: `node=ID,cpus=LIST,memory=SIZE[,host-node=N][,pin=host-node|LIST]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaNodeSpec {
    pub id: u32,
    /// vCPU indices.
    pub cpus: Vec<u32>,
    /// Bytes; in files also a string such as "256M".
    #[serde(deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub memory: u64,
    /// The host node its memory is bound to (`mbind(MPOL_BIND)`); none: the host's policy.
    /// Host-local: read from flags and files, never written into the VM description a
    /// migration stream or snapshot carries (an arriving VM gets its operator's).
    #[serde(default, skip_serializing)]
    pub host_node: Option<u32>,
    /// Where the node's vCPUs run; none: as `--cpus` says (floating unless pinned there).
    /// Host-local like `host_node`: its pins end up in `HostPlacement::pins`.
    #[serde(default, skip_serializing)]
    pub pin: Option<NodePin>,
}

/// `pin=` of a guest node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum NodePin {
    /// `pin=host-node`: onto the CPUs of the node's `host-node`, one vCPU per host CPU.
    HostNode,
    /// `pin=LIST`: the node's i-th vCPU onto the list's i-th host CPU.
    Cpus(Vec<u32>),
}

impl TryFrom<String> for NodePin {
    type Error = String;
    fn try_from(s: String) -> Result<NodePin, String> {
        match s.trim() {
            "host-node" => Ok(NodePin::HostNode),
            list => Ok(NodePin::Cpus(parse_cpu_list(list, ':').map_err(|e| format!("pin={list}: {e}"))?)),
        }
    }
}

impl From<NodePin> for String {
    fn from(p: NodePin) -> String {
        match p {
            NodePin::HostNode => "host-node".into(),
            NodePin::Cpus(c) => c.iter().map(u32::to_string).collect::<Vec<_>>().join(":"),
        }
    }
}

/// `SRC:DST=VAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaDistance {
    pub src: u32,
    pub dst: u32,
    pub value: u8,
}

impl NumaNodeSpec {
    /// Parses the `--numa` syntax.
    pub fn parse(s: &str) -> Result<NumaNodeSpec, Error> {
        let bad = |m: String| Error::Config(format!("--numa {s}: {m}"));
        if s.trim() == "mirror" {
            return Err(Error::Config("--numa mirror is given alone, not among --numa node=… specs".into()));
        }
        let (mut id, mut cpus, mut memory, mut host_node, mut pin) = (None, None, None, None, None);
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            let n = |v: &str| v.parse::<u32>().map_err(|_| bad(format!("{k} `{v}` is not a number")));
            match k {
                "node" => id = Some(n(v)?),
                "cpus" => cpus = Some(parse_cpu_list(v, ':').map_err(|e| bad(format!("cpus={v}: {e}")))?),
                "memory" => memory = Some(kumo_vm::parse_size(v).map_err(bad)?),
                "host-node" => host_node = Some(n(v)?),
                "pin" => pin = Some(NodePin::try_from(v.to_string()).map_err(bad)?),
                _ => return Err(bad(format!("unknown key `{k}` (node, cpus, memory, host-node, pin)"))),
            }
        }
        Ok(NumaNodeSpec {
            id: id.ok_or_else(|| bad("node=ID is required".into()))?,
            cpus: cpus.unwrap_or_default(),
            memory: memory.ok_or_else(|| bad("memory=SIZE is required".into()))?,
            host_node,
            pin,
        })
    }
}

impl NumaDistance {
    /// Parses the `--numa-distance` syntax.
    pub fn parse(s: &str) -> Result<NumaDistance, Error> {
        let bad = |m: &str| Error::Config(format!("--numa-distance {s}: {m}"));
        let (pair, value) = s.split_once('=').ok_or_else(|| bad("expected SRC:DST=VALUE, e.g. 0:1=20"))?;
        let (src, dst) = pair.split_once(':').ok_or_else(|| bad("expected SRC:DST=VALUE, e.g. 0:1=20"))?;
        let node = |t: &str| t.trim().parse::<u32>().map_err(|_| bad("nodes must be numbers"));
        let value = value.trim().parse::<u8>().map_err(|_| bad("the distance must be 10..=254"))?;
        Ok(NumaDistance { src: node(src)?, dst: node(dst)?, value })
    }
}

impl NumaConfig {
    /// The `N x N` distance table: empty (defaults) when no distance is given, else 10 on the
    /// diagonal and 20 elsewhere, overwritten by the given ones, each also setting its reverse
    /// unless that is given too.
    fn distance_table(&self, n: usize) -> Result<Vec<Vec<u8>>, Error> {
        if self.distances.is_empty() {
            return Ok(Vec::new());
        }
        let mut t: Vec<Vec<u8>> =
            (0..n).map(|a| (0..n).map(|b| if a == b { LOCAL_DISTANCE } else { REMOTE_DISTANCE }).collect()).collect();
        for (i, d) in self.distances.iter().enumerate() {
            for node in [d.src, d.dst] {
                if node as usize >= n {
                    return Err(Error::Config(format!(
                        "NUMA distance {}:{}: there is no node {node} (nodes are 0..{n})",
                        d.src, d.dst
                    )));
                }
            }
            if let Some(e) = self.distances[..i].iter().find(|e| e.src == d.src && e.dst == d.dst && e.value != d.value)
            {
                return Err(Error::Config(format!(
                    "NUMA distance {}:{} is given twice: {} and {}",
                    d.src, d.dst, e.value, d.value
                )));
            }
            t[d.src as usize][d.dst as usize] = d.value;
            if !self.distances.iter().any(|e| e.src == d.dst && e.dst == d.src) {
                t[d.dst as usize][d.src as usize] = d.value;
            }
        }
        Ok(t)
    }

    /// The topology of a VM of `cpus` vCPUs and `memory` bytes, checked
    /// (`NumaTopology::validate`): each node's memory cut from guest RAM in id order.
    pub fn topology(&self, cpus: u32, memory: u64) -> Result<NumaTopology, Error> {
        let cfg = |e: kumo_acpi::TopologyError| Error::Config(e.to_string());
        let mut nodes: Vec<&NumaNodeSpec> = self.nodes.iter().collect();
        nodes.sort_by_key(|n| n.id);
        if let Some(w) = nodes.windows(2).find(|w| w[0].id == w[1].id) {
            return Err(Error::Config(format!("NUMA node {} is given twice", w[0].id)));
        }
        let layout = MemoryLayout::new(memory);
        let sizes: Vec<u64> = nodes.iter().map(|n| n.memory).collect();
        let ranges = kumo_acpi::split_memory(&layout, &sizes).map_err(cfg)?;
        let topo = NumaTopology {
            nodes: nodes
                .iter()
                .zip(ranges)
                .map(|(n, memory)| NumaNode { id: n.id, cpus: n.cpus.clone(), memory })
                .collect(),
            distances: self.distance_table(nodes.len())?,
        };
        topo.validate(cpus, &layout).map_err(cfg)?;
        Ok(topo)
    }

    /// Checks that every `host-node` exists under `sysfs` (`HOST_NODE_SYSFS` on a real host).
    pub fn check_host_nodes(&self, sysfs: &Path) -> Result<(), Error> {
        for n in &self.nodes {
            if let Some(h) = n.host_node {
                let dir = sysfs.join(format!("node{h}"));
                if !dir.is_dir() {
                    return Err(Error::Config(format!(
                        "NUMA node {}: host node {h} does not exist (no {})",
                        n.id,
                        dir.display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// `(guest-physical start, length, host node)` of every range bound to a host node.
    pub fn bindings(&self, topo: &NumaTopology) -> Vec<(u64, u64, u32)> {
        let mut out = Vec::new();
        for node in &topo.nodes {
            let host = self.nodes.iter().find(|n| n.id == node.id).and_then(|n| n.host_node);
            if let Some(h) = host {
                out.extend(node.memory.iter().map(|&(s, l)| (s, l, h)));
            }
        }
        out
    }

    /// The nodes as `vm.info` shows them (empty if the topology does not check, which a running
    /// VM's cannot).
    pub fn info(&self, cpus: u32, memory: u64) -> Vec<kumo_api::NumaNodeInfo> {
        let Ok(topo) = self.topology(cpus, memory) else { return Vec::new() };
        let ids: Vec<u32> = topo.nodes.iter().map(|n| n.id).collect();
        topo.nodes
            .iter()
            .map(|n| kumo_api::NumaNodeInfo {
                id: n.id,
                cpus: n.cpus.clone(),
                memory_bytes: n.memory.iter().map(|r| r.1).sum(),
                host_node: self.nodes.iter().find(|s| s.id == n.id).and_then(|s| s.host_node),
                distances: ids.iter().map(|&b| topo.distance(n.id, b)).collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn cfg(nodes: &[&str], distances: &[&str]) -> Result<NumaConfig, Error> {
        Ok(NumaConfig {
            nodes: nodes.iter().map(|s| NumaNodeSpec::parse(s)).collect::<Result<_, _>>()?,
            distances: distances.iter().map(|s| NumaDistance::parse(s)).collect::<Result<_, _>>()?,
        })
    }

    #[test]
    fn parses_nodes_and_distances() {
        let n = NumaNodeSpec::parse("node=1,cpus=0-1:4:6-7,memory=256M,host-node=0").unwrap();
        assert_eq!(
            n,
            NumaNodeSpec { id: 1, cpus: vec![0, 1, 4, 6, 7], memory: 256 * MIB, host_node: Some(0), pin: None }
        );
        assert_eq!(NumaDistance::parse("0:1=21").unwrap(), NumaDistance { src: 0, dst: 1, value: 21 });
        let t = cfg(&["node=1,cpus=1,memory=256M", "node=0,cpus=0,memory=256M"], &["1:0=30"])
            .unwrap()
            .topology(2, 512 * MIB)
            .unwrap();
        // Id order, not flag order, lays memory out; one distance sets both ways.
        assert_eq!(t.nodes[0].memory, vec![(0, 256 * MIB)]);
        assert_eq!(t.nodes[1].memory, vec![(256 * MIB, 256 * MIB)]);
        assert_eq!(t.distances, vec![vec![10, 30], vec![30, 10]]);
        let t = cfg(&["node=0,cpus=0-1,memory=512M"], &[]).unwrap().topology(2, 512 * MIB).unwrap();
        assert!(t.distances.is_empty());
    }

    #[test]
    fn bad_input_is_one_line_naming_the_problem() {
        let two = |a: &str, b: &str| vec![a.to_string(), b.to_string()];
        let n0 = "node=0,cpus=0,memory=256M";
        let n1 = "node=1,cpus=1,memory=256M";
        let cases: Vec<(Vec<String>, Vec<&str>, &str)> = vec![
            (two(n0, "node=0,cpus=1,memory=256M"), vec![], "NUMA node 0 is given twice"),
            (two(n0, "node=1,cpus=0-1,memory=256M"), vec![], "cpu 0 is in two NUMA nodes: 0 and 1"),
            (two(n0, "node=1,memory=256M"), vec![], "cpu 1 is in no NUMA node"),
            (two(n0, "node=1,cpus=1-2,memory=256M"), vec![], "cpu 2 does not exist (the VM has 2 vCPUs)"),
            (
                two(n0, "node=1,cpus=1,memory=128M"),
                vec![],
                "NUMA node memory sums to 384 MiB, not the VM's memory of 512 MiB",
            ),
            (two(n0, "node=2,cpus=1,memory=256M"), vec![], "ids must be 0..2"),
            (two(n0, n1), vec!["0:1=20", "1:0=30"], "not symmetric: 0->1 is 20 but 1->0 is 30"),
            (two(n0, n1), vec!["1:1=11"], "from node 1 to itself is 11, must be 10"),
            (two(n0, n1), vec!["0:1=5"], "distance 0->1 is 5; distances between nodes must be 11..=254"),
            (two(n0, n1), vec!["0:2=20"], "NUMA distance 0:2: there is no node 2"),
            (two(n0, n1), vec!["0:1=20", "0:1=30"], "NUMA distance 0:1 is given twice"),
        ];
        for (nodes, dist, want) in cases {
            let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
            let e = cfg(&nodes, &dist).and_then(|c| c.topology(2, 512 * MIB)).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "want {want:?}, got {e:?}");
        }
        for (spec, want) in [
            ("node=0,cpus=0", "memory=SIZE is required"),
            ("cpus=0,memory=1G", "node=ID is required"),
            ("node=0,cpus=3-1,memory=1G", r#"cpus=3-1: range "3-1" in CPU list "3-1" runs backwards"#),
            ("node=0,cpus=0,1,memory=1G", "`1` is not key=value"),
            ("node=x,cpus=0,memory=1G", "node `x` is not a number"),
            ("node=0,cpu=0,memory=1G", "unknown key `cpu`"),
            ("node=0,cpus=0,memory=lots", "not a size"),
            ("mirror", "--numa mirror is given alone"),
        ] {
            let e = NumaNodeSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "want {want:?}, got {e:?}");
        }
        for (spec, want) in [("0-1=20", "expected SRC:DST=VALUE"), ("0:1=300", "10..=254"), ("a:1=20", "numbers")] {
            let e = NumaDistance::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want), "want {want:?}, got {e:?}");
        }
    }

    #[test]
    fn nodes_pin_their_vcpus_to_host_cpus_or_their_host_node() {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs-2node");
        let host = crate::placement::HostTopology::read(&fixture).unwrap();
        let specs = [
            "node=0,cpus=0:2,memory=256M,host-node=0,pin=3:5",
            "node=1,cpus=1:3,memory=256M,host-node=1,pin=host-node",
        ];
        let c = cfg(&specs, &[]).unwrap();
        assert!(c.pins_vcpus());
        assert_eq!(c.nodes[0].pin, Some(NodePin::Cpus(vec![3, 5])));
        // Node 1's two vCPUs go to host node 1's first two cores (8 and 9), not to siblings.
        assert_eq!(c.pins(&host).unwrap(), [Some(3), Some(8), Some(5), Some(9)]);
        let partial = cfg(&["node=0,cpus=0,memory=256M", "node=1,cpus=1,memory=256M,pin=4"], &[]).unwrap();
        assert_eq!(partial.pins(&host).unwrap(), [None, Some(4)]);
        assert!(!cfg(&["node=0,cpus=0,memory=256M"], &[]).unwrap().pins_vcpus());
        // A file says the same as the flag.
        let json = r#"{"nodes":[{"id":0,"cpus":[0,1],"memory":"256M","host_node":1,"pin":"host-node"},
                                 {"id":1,"cpus":[2],"memory":"256M","pin":"7"}]}"#;
        let f: NumaConfig = serde_json::from_str(json).unwrap();
        assert_eq!(f.pins(&host).unwrap(), [Some(8), Some(9), Some(7)]);
        assert_eq!(String::from(f.nodes[1].pin.clone().unwrap()), "7");
        // Host-local: a node's host node and pins are not part of the description that travels.
        let v = serde_json::to_value(&f).unwrap();
        assert!(v["nodes"][0].get("host_node").is_none() && v["nodes"][0].get("pin").is_none(), "{v}");
        for (spec, want) in [
            ("node=0,cpus=0-1,memory=256M,pin=3", "NUMA node 0: pin=3: 1 host CPUs for the node's 2 vCPUs"),
            ("node=0,cpus=0,memory=256M,pin=99", "NUMA node 0: pin=99: host CPU 99 is not online (online: 0-31)"),
            ("node=0,cpus=0,memory=256M,pin=host-node", "NUMA node 0: pin=host-node: needs host-node=N"),
            (
                "node=0,cpus=0,memory=256M,host-node=5,pin=host-node",
                "NUMA node 0: pin=host-node: host node 5 does not exist",
            ),
        ] {
            let e = cfg(&[spec], &[]).unwrap().pins(&host).unwrap_err().to_string();
            assert_eq!(e, format!("config: {want}"), "{spec}");
        }
        let big = cfg(&["node=0,cpus=0-16,memory=256M,host-node=0,pin=host-node"], &[]).unwrap();
        let e = big.pins(&host).unwrap_err().to_string();
        assert_eq!(e, "config: NUMA node 0: pin=host-node: host node 0 has 16 CPUs for the node's 17 vCPUs");
        let e = NumaNodeSpec::parse("node=0,cpus=0,memory=256M,pin=x").unwrap_err().to_string();
        assert!(
            e.contains(r#"--numa node=0,cpus=0,memory=256M,pin=x: pin=x: "x" in CPU list "x" is not N or N-M"#),
            "{e}"
        );
    }

    #[test]
    fn host_nodes_are_checked_in_sysfs() {
        let root = std::env::temp_dir().join(format!("kumo-numa-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(root.join("node0")).unwrap();
        let c = cfg(&["node=0,cpus=0,memory=256M,host-node=0", "node=1,cpus=1,memory=256M,host-node=0"], &[]).unwrap();
        c.check_host_nodes(&root).unwrap();
        let t = c.topology(2, 512 * MIB).unwrap();
        assert_eq!(c.bindings(&t), vec![(0, 256 * MIB, 0), (256 * MIB, 256 * MIB, 0)]);
        let info = c.info(2, 512 * MIB);
        assert_eq!((info[1].id, &info[1].cpus, info[1].memory_bytes), (1, &vec![1], 256 * MIB));
        assert_eq!((info[1].host_node, &info[1].distances), (Some(0), &vec![20, 10]));
        let c = cfg(&["node=0,cpus=0,memory=256M,host-node=0", "node=1,cpus=1,memory=256M,host-node=1"], &[]).unwrap();
        let e = c.check_host_nodes(&root).unwrap_err().to_string();
        assert!(e.contains("NUMA node 1: host node 1 does not exist (no ") && e.contains("node1)"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
