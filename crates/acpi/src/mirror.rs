//! `--numa mirror`: the guest topology of a [`MirrorPlan`] (`kumo_vm::host_topology`, which
//! cannot name this crate's types since this crate depends on it).

use kumo_vm::host_topology::MirrorPlan;
use kumo_vm::layout::MemoryLayout;

use crate::topology::{split_memory, NumaNode, NumaTopology, TopologyError};

impl NumaTopology {
    /// The topology a mirror plan describes for a VM laid out as `layout`: each plan node's
    /// vCPUs and its memory cut from guest RAM in node order ([`split_memory`]), and the
    /// plan's distances. Checked with [`NumaTopology::validate`].
    pub fn mirrored(plan: &MirrorPlan, layout: &MemoryLayout) -> Result<NumaTopology, TopologyError> {
        let ranges = split_memory(layout, &plan.memory_sizes())?;
        let nodes = plan
            .nodes
            .iter()
            .zip(ranges)
            .map(|(n, memory)| NumaNode { id: n.id, cpus: n.vcpus.clone(), memory })
            .collect();
        let topology = NumaTopology { nodes, distances: plan.distances.clone() };
        topology.validate(plan.pins.len() as u32, layout)?;
        Ok(topology)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_vm::host_topology::{mirror, HostTopology};
    use std::path::Path;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn host(name: &str) -> HostTopology {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vm/tests/fixtures").join(name);
        HostTopology::read(&root).unwrap()
    }

    #[test]
    fn a_two_node_mirror_crosses_the_mmio_gap() {
        let plan = mirror(&host("sysfs-2node"), 4, 4 * GIB).unwrap();
        let t = NumaTopology::mirrored(&plan, &MemoryLayout::new(4 * GIB)).unwrap();
        assert_eq!(t.nodes[0], NumaNode { id: 0, cpus: vec![0, 1], memory: vec![(0, 2 * GIB)] });
        assert_eq!(t.nodes[1], NumaNode { id: 1, cpus: vec![2, 3], memory: vec![(2 * GIB, GIB), (4 * GIB, GIB)] });
        assert_eq!(t.distances, [[10, 21], [21, 10]]);
    }

    #[test]
    fn a_four_node_mirror_builds_srat_and_slit() {
        let plan = mirror(&host("sysfs-4node"), 2, 512 * MIB + 4096).unwrap();
        let layout = MemoryLayout::new(512 * MIB + 4096);
        let t = NumaTopology::mirrored(&plan, &layout).unwrap();
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
        let cfg = crate::AcpiConfig {
            cpus: 2,
            layout: &layout,
            irqchip: kumo_vm::IrqchipMode::Kernel,
            pci: None,
            numa: Some(&t),
        };
        let tables = crate::build(&cfg).unwrap();
        let slit = &tables.find(b"SLIT").unwrap().1;
        // 36-byte header, 8-byte node count, then the 4x4 matrix.
        assert_eq!(u64::from_le_bytes(slit[36..44].try_into().unwrap()), 4);
        assert_eq!(slit[44..60], [10, 11, 21, 21, 11, 10, 21, 21, 21, 21, 10, 11, 21, 21, 11, 10]);
        assert!(tables.find(b"SRAT").is_some());
    }

    #[test]
    fn a_plan_for_other_memory_is_refused() {
        let plan = mirror(&host("sysfs-2node"), 2, GIB).unwrap();
        let e = NumaTopology::mirrored(&plan, &MemoryLayout::new(2 * GIB)).unwrap_err();
        assert_eq!(e.to_string(), "NUMA node memory sums to 1 GiB, not the VM's memory of 2 GiB");
    }
}
