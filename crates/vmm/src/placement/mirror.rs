//! `--numa mirror` (or a config file's `numa = "mirror"`): guest nodes that copy the host's,
//! each vCPU pinned to a host CPU of its own, each node's memory bound to its host node.

use super::guest_numa::{NumaConfig, NumaDistance, NumaNodeSpec};
use super::{HostTopology, PlacementError, Result};

/// Guest node memory is cut in units of this size (a huge page), so each node can be backed by
/// huge pages and bound to its host node on its own.
pub const MIRROR_UNIT: u64 = 2 << 20;

/// One guest node of a mirror plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorNode {
    /// Guest node id (`0..N`), also its ACPI proximity domain.
    pub id: u32,
    /// The host node it copies: bind its memory there (`mbind`).
    pub host_node: u32,
    /// Its vCPUs, ascending and consecutive across nodes (node 0 has vCPUs `0..k`).
    pub vcpus: Vec<u32>,
    /// Its memory in bytes.
    pub memory: u64,
}

/// What `--numa mirror` builds: guest nodes copying the host's, the distances between them
/// and where each vCPU runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorPlan {
    pub nodes: Vec<MirrorNode>,
    /// `distances[a][b]` between guest nodes, copied from the host's table.
    pub distances: Vec<Vec<u8>>,
    /// `pins[v]`: the host CPU vCPU `v` is pinned to; no two vCPUs share one.
    pub pins: Vec<u32>,
}

impl MirrorPlan {
    /// Each guest node's memory in node order: what `kumo_acpi::split_memory` takes.
    pub fn memory_sizes(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.memory).collect()
    }
}

/// Plans a guest of `vcpus` vCPUs and `memory` bytes that mirrors `host`:
/// - guest node `i` copies the `i`-th host node (host nodes with neither CPUs nor memory, and
///   CPU-only host nodes left without a vCPU, are skipped), and the host's distances between
///   the kept nodes are copied;
/// - vCPUs are spread evenly over the nodes with CPUs (one per node in turn, lowest node first;
///   a node that runs out of CPUs drops out) and pinned one-to-one to host CPUs of their node,
///   physical cores before SMT siblings ([`HostTopology::fill_order`]); no overcommit;
/// - memory is split evenly over the nodes with memory, in [`MIRROR_UNIT`] (2 MiB) pieces,
///   the lowest nodes taking the leftover pieces and the last node any remainder below 2 MiB,
///   so the sizes sum exactly to `memory`. Even rather than in proportion to host memory:
///   nodes of one machine differ only by what firmware and kernel reserved, and an even split
///   is what a user of a symmetric machine expects. A share larger than its host node is
///   refused.
pub fn mirror(host: &HostTopology, vcpus: u32, memory: u64) -> Result<MirrorPlan> {
    if vcpus == 0 {
        return Err(PlacementError::NoVcpus);
    }
    let online = host.nodes.iter().map(|n| n.cpus.len() as u32).sum::<u32>();
    if vcpus > online {
        return Err(PlacementError::TooManyVcpus { vcpus, host: online });
    }
    if memory > host.memory() {
        return Err(PlacementError::TooMuchMemory { memory, host: host.memory() });
    }

    let orders: Vec<Vec<u32>> = host.nodes.iter().map(|n| host.fill_order(n)).collect();
    let mut counts = vec![0usize; host.nodes.len()];
    let mut left = vcpus as usize;
    while left > 0 {
        for (count, order) in counts.iter_mut().zip(&orders) {
            if left > 0 && *count < order.len() {
                *count += 1;
                left -= 1;
            }
        }
    }

    let with_memory: Vec<usize> = (0..host.nodes.len()).filter(|&i| host.nodes[i].memory > 0).collect();
    let mut shares = vec![0u64; host.nodes.len()];
    if let Some(&last) = with_memory.last() {
        let units = memory / MIRROR_UNIT;
        let m = with_memory.len() as u64;
        for (k, &i) in with_memory.iter().enumerate() {
            shares[i] = (units / m + u64::from((k as u64) < units % m)) * MIRROR_UNIT;
        }
        shares[last] += memory % MIRROR_UNIT;
    }

    let kept: Vec<usize> = (0..host.nodes.len()).filter(|&i| counts[i] > 0 || shares[i] > 0).collect();
    let mut plan = MirrorPlan { nodes: Vec::new(), distances: Vec::new(), pins: Vec::new() };
    for (g, &i) in kept.iter().enumerate() {
        let hn = &host.nodes[i];
        if shares[i] > hn.memory {
            return Err(PlacementError::NodeMemory {
                node: g as u32,
                host_node: hn.id,
                share: shares[i],
                host: hn.memory,
            });
        }
        let first = plan.pins.len() as u32;
        plan.pins.extend_from_slice(&orders[i][..counts[i]]);
        let vcpus = (first..plan.pins.len() as u32).collect();
        plan.nodes.push(MirrorNode { id: g as u32, host_node: hn.id, vcpus, memory: shares[i] });
        // A hand-built HostTopology may lack rows: fall back to Linux's defaults, never panic.
        let distance =
            |j: usize| host.distances.get(i).and_then(|r| r.get(j)).copied().unwrap_or(if i == j { 10 } else { 20 });
        plan.distances.push(kept.iter().map(|&j| distance(j)).collect());
    }
    Ok(plan)
}

impl NumaConfig {
    /// The guest topology of a `--numa mirror` plan: guest node i is host node i (memory bound
    /// to it), with the host's distances.
    pub fn from_mirror(plan: &MirrorPlan) -> NumaConfig {
        let nodes = plan
            .nodes
            .iter()
            .map(|n| NumaNodeSpec {
                id: n.id,
                cpus: n.vcpus.clone(),
                memory: n.memory,
                host_node: Some(n.host_node),
                pin: None,
            })
            .collect();
        let mut distances = Vec::new();
        for (i, row) in plan.distances.iter().enumerate() {
            for (j, &value) in row.iter().enumerate() {
                if i != j {
                    distances.push(NumaDistance { src: i as u32, dst: j as u32, value });
                }
            }
        }
        NumaConfig { nodes, distances }
    }
}
