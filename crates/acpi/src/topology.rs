//! The guest NUMA topology that the SRAT and SLIT describe: nodes (id = ACPI proximity domain,
//! vCPUs, guest-physical memory ranges) and the distances between them. The vNUMA work builds a
//! [`NumaTopology`] (from `--numa` flags or the host's topology), checks it with
//! [`NumaTopology::validate`] and hands it to [`crate::AcpiConfig`].

use kumo_vm::layout::MemoryLayout;
use kumo_vm::memory::human_size;
use serde::{Deserialize, Serialize};

/// ACPI distance from a node to itself.
pub const LOCAL_DISTANCE: u8 = 10;
/// Distance between two nodes when the topology gives no table (Linux's default too).
pub const REMOTE_DISTANCE: u8 = 20;

/// One guest NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    /// Node id, also its ACPI proximity domain; a topology's ids are `0..N`.
    pub id: u32,
    /// vCPU indices (kumo's vCPU index is its APIC ID).
    pub cpus: Vec<u32>,
    /// Guest-physical ranges `(start, len)` of the node's memory.
    pub memory: Vec<(u64, u64)>,
}

/// A guest NUMA topology.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NumaTopology {
    pub nodes: Vec<NumaNode>,
    /// `distances[a][b]`: distance from node id `a` to node id `b`, `N x N`. Empty: 10 to
    /// itself, 20 to every other node.
    pub distances: Vec<Vec<u8>>,
}

/// What is wrong with a topology: each message is one line naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("the NUMA topology has no nodes")]
    NoNodes,
    #[error("NUMA node ids must be 0..{n} with each id once, got {ids:?}", n = .ids.len())]
    NodeIds { ids: Vec<u32> },
    #[error("NUMA node {node}: cpu {cpu} does not exist (the VM has {ncpus} vCPUs)")]
    NoSuchCpu { node: u32, cpu: u32, ncpus: u32 },
    #[error("cpu {cpu} is in two NUMA nodes: {a} and {b}")]
    CpuInTwoNodes { cpu: u32, a: u32, b: u32 },
    #[error("cpu {cpu} is in no NUMA node")]
    CpuInNoNode { cpu: u32 },
    #[error("NUMA node {node} has neither CPUs nor memory")]
    EmptyNode { node: u32 },
    #[error("NUMA node {node}: memory range at {start:#x} is empty or not 4 KiB aligned")]
    BadRange { node: u32, start: u64 },
    #[error("NUMA node {node}: memory [{start:#x}, {end:#x}) is not guest RAM")]
    NotRam { node: u32, start: u64, end: u64 },
    #[error("NUMA nodes {a} and {b} overlap at {at:#x}")]
    Overlap { a: u32, b: u32, at: u64 },
    #[error("guest RAM [{start:#x}, {end:#x}) is in no NUMA node")]
    RamInNoNode { start: u64, end: u64 },
    #[error("NUMA node memory sums to {sum}, not the VM's memory of {total}", sum = human_size(*.sum), total = human_size(*.total))]
    MemorySum { sum: u64, total: u64 },
    #[error("the NUMA distance table must be {n}x{n} (one row and column per node)")]
    DistanceShape { n: usize },
    #[error("NUMA distance from node {node} to itself is {value}, must be 10")]
    DistanceDiagonal { node: usize, value: u8 },
    #[error("NUMA distance table is not symmetric: {a}->{b} is {ab} but {b}->{a} is {ba}")]
    DistanceAsymmetric { a: usize, b: usize, ab: u8, ba: u8 },
    #[error("NUMA distance {a}->{b} is {value}; distances between nodes must be 11..=254")]
    DistanceRange { a: usize, b: usize, value: u8 },
}

const PAGE: u64 = 4096;

impl NumaTopology {
    /// Distance from node `a` to node `b` (ids), from the table or the default.
    pub fn distance(&self, a: u32, b: u32) -> u8 {
        match self.distances.get(a as usize).and_then(|r| r.get(b as usize)) {
            Some(&d) => d,
            None if a == b => LOCAL_DISTANCE,
            None => REMOTE_DISTANCE,
        }
    }

    /// Checks the topology against a VM of `ncpus` vCPUs laid out as `layout`: ids `0..N`, every
    /// vCPU in exactly one node, memory ranges page-aligned, inside RAM, disjoint and covering
    /// all of it, and a distance table that is `N x N`, 10 on the diagonal, symmetric and
    /// 11..=254 elsewhere.
    pub fn validate(&self, ncpus: u32, layout: &MemoryLayout) -> Result<(), TopologyError> {
        let n = self.nodes.len();
        if n == 0 {
            return Err(TopologyError::NoNodes);
        }
        let mut ids: Vec<u32> = self.nodes.iter().map(|x| x.id).collect();
        ids.sort_unstable();
        if ids.iter().enumerate().any(|(i, &id)| id as usize != i) {
            return Err(TopologyError::NodeIds { ids: self.nodes.iter().map(|x| x.id).collect() });
        }

        let mut owner: Vec<Option<u32>> = vec![None; ncpus as usize];
        for node in &self.nodes {
            if node.cpus.is_empty() && node.memory.is_empty() {
                return Err(TopologyError::EmptyNode { node: node.id });
            }
            for &cpu in &node.cpus {
                let slot = owner.get_mut(cpu as usize).ok_or(TopologyError::NoSuchCpu { node: node.id, cpu, ncpus })?;
                match *slot {
                    Some(a) => return Err(TopologyError::CpuInTwoNodes { cpu, a: a.min(node.id), b: a.max(node.id) }),
                    None => *slot = Some(node.id),
                }
            }
        }
        if let Some(cpu) = owner.iter().position(Option::is_none) {
            return Err(TopologyError::CpuInNoNode { cpu: cpu as u32 });
        }

        let mut ranges: Vec<(u64, u64, u32)> = Vec::new();
        for node in &self.nodes {
            for &(start, len) in &node.memory {
                if len == 0 || start % PAGE != 0 || len % PAGE != 0 {
                    return Err(TopologyError::BadRange { node: node.id, start });
                }
                let end = start.checked_add(len).ok_or(TopologyError::BadRange { node: node.id, start })?;
                if !layout.ram().iter().any(|&(s, l)| start >= s && end <= s + l) {
                    return Err(TopologyError::NotRam { node: node.id, start, end });
                }
                ranges.push((start, end, node.id));
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(TopologyError::Overlap { a: w[0].2.min(w[1].2), b: w[0].2.max(w[1].2), at: w[1].0 });
            }
        }
        for &(s, l) in layout.ram() {
            // Ranges are disjoint and inside RAM: walk this region's ranges in order for holes.
            let mut at = s;
            for &(rs, re, _) in ranges.iter().filter(|r| r.0 >= s && r.1 <= s + l) {
                if rs > at {
                    return Err(TopologyError::RamInNoNode { start: at, end: rs });
                }
                at = re;
            }
            if at < s + l {
                return Err(TopologyError::RamInNoNode { start: at, end: s + l });
            }
        }

        if !self.distances.is_empty() {
            if self.distances.len() != n || self.distances.iter().any(|r| r.len() != n) {
                return Err(TopologyError::DistanceShape { n });
            }
            for a in 0..n {
                let value = self.distances[a][a];
                if value != LOCAL_DISTANCE {
                    return Err(TopologyError::DistanceDiagonal { node: a, value });
                }
                for b in a + 1..n {
                    let (ab, ba) = (self.distances[a][b], self.distances[b][a]);
                    if ab != ba {
                        return Err(TopologyError::DistanceAsymmetric { a, b, ab, ba });
                    }
                    if !(11..=254).contains(&ab) {
                        return Err(TopologyError::DistanceRange { a, b, value: ab });
                    }
                }
            }
        }
        Ok(())
    }
}

/// Cuts `layout`'s RAM into consecutive pieces of `sizes` bytes (node 0 first, from address 0;
/// a piece crossing the MMIO gap gets two ranges): the `memory` of each node for `--numa
/// node=…,memory=SIZE`. The sizes must be 4 KiB multiples and add up to the VM's memory.
pub fn split_memory(layout: &MemoryLayout, sizes: &[u64]) -> Result<Vec<Vec<(u64, u64)>>, TopologyError> {
    let sum = sizes.iter().try_fold(0u64, |a, &s| a.checked_add(s)).unwrap_or(u64::MAX);
    if sum != layout.size() {
        return Err(TopologyError::MemorySum { sum, total: layout.size() });
    }
    if let Some(node) = sizes.iter().position(|s| s % PAGE != 0) {
        return Err(TopologyError::BadRange { node: node as u32, start: 0 });
    }
    let mut regions = layout.ram().iter().copied();
    let mut cur = regions.next();
    let mut out = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let mut want = size;
        let mut ranges = Vec::new();
        while want > 0 {
            let Some((start, len)) = cur else { break };
            let take = want.min(len);
            ranges.push((start, take));
            want -= take;
            cur = if take == len { regions.next() } else { Some((start + take, len - take)) };
        }
        out.push(ranges);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn two_nodes(mem: u64) -> NumaTopology {
        let layout = MemoryLayout::new(mem);
        let m = split_memory(&layout, &[mem / 2, mem / 2]).unwrap();
        NumaTopology {
            nodes: vec![
                NumaNode { id: 0, cpus: vec![0], memory: m[0].clone() },
                NumaNode { id: 1, cpus: vec![1], memory: m[1].clone() },
            ],
            distances: vec![vec![10, 21], vec![21, 10]],
        }
    }

    #[test]
    fn split_memory_crosses_the_mmio_gap() {
        let l = MemoryLayout::new(4 * GIB);
        let m = split_memory(&l, &[2 * GIB, 2 * GIB]).unwrap();
        assert_eq!(m[0], vec![(0, 2 * GIB)]);
        assert_eq!(m[1], vec![(2 * GIB, GIB), (4 * GIB, GIB)]);
        let e = split_memory(&l, &[GIB, GIB]).unwrap_err().to_string();
        assert_eq!(e, "NUMA node memory sums to 2 GiB, not the VM's memory of 4 GiB");
    }

    #[test]
    fn a_good_topology_passes() {
        two_nodes(512 * MIB).validate(2, &MemoryLayout::new(512 * MIB)).unwrap();
        let t = NumaTopology { distances: vec![], ..two_nodes(6 * GIB) };
        t.validate(2, &MemoryLayout::new(6 * GIB)).unwrap();
        assert_eq!((t.distance(0, 0), t.distance(0, 1)), (10, 20));
        assert_eq!(two_nodes(512 * MIB).distance(1, 0), 21);
    }

    #[test]
    fn bad_topologies_are_one_line_errors_naming_the_problem() {
        let layout = MemoryLayout::new(512 * MIB);
        let half = 256 * MIB;
        type Edit = fn(&mut NumaTopology);
        let cases: &[(Edit, &str)] = &[
            (|t| t.nodes.clear(), "has no nodes"),
            (|t| t.nodes[1].id = 2, "ids must be 0..2"),
            (|t| t.nodes[1].cpus = vec![1, 5], "cpu 5 does not exist (the VM has 2 vCPUs)"),
            (|t| t.nodes[1].cpus = vec![0, 1], "cpu 0 is in two NUMA nodes: 0 and 1"),
            (|t| t.nodes[1].cpus = vec![], "cpu 1 is in no NUMA node"),
            (|t| t.nodes[1].memory = vec![(128 * MIB, 384 * MIB)], "NUMA nodes 0 and 1 overlap at 0x8000000"),
            (
                |t| t.nodes[1].memory = vec![(256 * MIB, 128 * MIB)],
                "guest RAM [0x18000000, 0x20000000) is in no NUMA node",
            ),
            (|t| t.nodes[1].memory = vec![(256 * MIB, 512 * MIB)], "memory [0x10000000, 0x30000000) is not guest RAM"),
            (|t| t.nodes[1].memory[0].1 += 1, "not 4 KiB aligned"),
            (|t| t.distances[1].pop().map(drop).unwrap_or(()), "must be 2x2"),
            (|t| t.distances[1][1] = 11, "from node 1 to itself is 11, must be 10"),
            (|t| t.distances[0][1] = 30, "not symmetric: 0->1 is 30 but 1->0 is 21"),
            (
                |t| t.distances = vec![vec![10, 10], vec![10, 10]],
                "distance 0->1 is 10; distances between nodes must be 11..=254",
            ),
            (|t| t.nodes[1] = NumaNode { id: 1, cpus: vec![], memory: vec![] }, "node 1 has neither CPUs nor memory"),
        ];
        for (edit, want) in cases {
            let mut t = two_nodes(512 * MIB);
            edit(&mut t);
            let e = t.validate(2, &layout).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "want {want:?}, got {e:?}");
        }
        // A memory-only node is fine.
        let t = NumaTopology {
            nodes: vec![
                NumaNode { id: 0, cpus: vec![0, 1], memory: vec![(0, half)] },
                NumaNode { id: 1, cpus: vec![], memory: vec![(half, half)] },
            ],
            distances: vec![],
        };
        t.validate(2, &layout).unwrap();
    }
}
