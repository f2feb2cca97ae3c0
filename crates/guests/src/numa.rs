//! The `numa` guest's output (guests/src/numa.c) parsed: the topology it read from kumo's ACPI
//! SRAT/SLIT, and its latency and bandwidth figures per vCPU and node.

/// One node as the guest saw it: `numa: node=ID cpus=A:B mem=S-E:S-E`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub id: u32,
    pub cpus: Vec<u32>,
    /// Guest-physical `[start, end)` ranges.
    pub memory: Vec<(u64, u64)>,
}

/// The whole topology: nodes in id order and the distance matrix.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    pub nodes: Vec<Node>,
    pub distances: Vec<Vec<u8>>,
}

/// `numa: vcpu=V node=N latency_ns=L bandwidth_mbs=B`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Access {
    pub vcpu: u32,
    pub node: u32,
    pub latency_ns: f64,
    pub bandwidth_mbs: u64,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The topology the guest printed, or None if its lines are missing or malformed.
pub fn parse_topology(out: &str) -> Option<Topology> {
    let n: usize = out.lines().find_map(|l| l.strip_prefix("numa: nodes="))?.trim().parse().ok()?;
    let mut t = Topology::default();
    for line in out.lines().filter(|l| l.starts_with("numa: node=")) {
        let id = field(line, "node")?.parse().ok()?;
        let cpus = match field(line, "cpus")? {
            "none" => Vec::new(),
            c => c.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?,
        };
        let memory = field(line, "mem")?
            .split(':')
            .map(|r| {
                let (s, e) = r.split_once('-')?;
                Some((u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?))
            })
            .collect::<Option<_>>()?;
        t.nodes.push(Node { id, cpus, memory });
    }
    for line in out.lines().filter(|l| l.starts_with("numa: distance ")) {
        t.distances.push(field(line, "to")?.split(',').map(|x| x.parse().ok()).collect::<Option<_>>()?);
    }
    (t.nodes.len() == n && t.distances.len() == n).then_some(t)
}

/// Every latency and bandwidth line.
pub fn parse_accesses(out: &str) -> Vec<Access> {
    out.lines()
        .filter(|l| l.starts_with("numa: vcpu="))
        .filter_map(|l| {
            Some(Access {
                vcpu: field(l, "vcpu")?.parse().ok()?,
                node: field(l, "node")?.parse().ok()?,
                latency_ns: field(l, "latency_ns")?.parse().ok()?,
                bandwidth_mbs: field(l, "bandwidth_mbs")?.parse().ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "numa: acpi rsdp=e0000 xsdt=e03c0 srat=1 slit=1\nnuma: nodes=2\n\
        numa: node=0 cpus=0 mem=0-8000000\nnuma: node=1 cpus=1:2 mem=8000000-10000000:100000000-140000000\n\
        numa: distance from=0 to=10,21\nnuma: distance from=1 to=21,10\n\
        numa: vcpu=0 node=1 latency_ns=843.1 bandwidth_mbs=8783\nnuma: done\n";

    #[test]
    fn topology_and_accesses_parse() {
        let t = parse_topology(OUT).unwrap();
        assert_eq!(t.nodes[0], Node { id: 0, cpus: vec![0], memory: vec![(0, 0x800_0000)] });
        assert_eq!(t.nodes[1].cpus, [1, 2]);
        assert_eq!(t.nodes[1].memory, [(0x800_0000, 0x1000_0000), (0x1_0000_0000, 0x1_4000_0000)]);
        assert_eq!(t.distances, [[10, 21], [21, 10]]);
        let a = parse_accesses(OUT);
        assert_eq!(a, [Access { vcpu: 0, node: 1, latency_ns: 843.1, bandwidth_mbs: 8783 }]);
        assert_eq!(parse_topology("numa: nodes=2\nnuma: node=0 cpus=0 mem=0-1\n"), None, "a node missing");
        assert_eq!(parse_topology("numa: nodes=1\nnuma: node=0 cpus=x mem=0-1\nnuma: distance from=0 to=10\n"), None);
    }
}
