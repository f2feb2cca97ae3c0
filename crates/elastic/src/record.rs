//! The exclusivity check over several VMs' records (`vm.elastic` events): no host CPU held by
//! two vCPUs at once, and no more memory held per host node than the VMs held at boot. Each
//! VM records an acquisition before it can use what it took and a release after it can no
//! longer use it, so a clean check of the records is a clean check of what really happened.

use std::collections::BTreeMap;

use kumo_api::{ElasticEvent, ElasticEventKind as Kind};

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// Pairs of holdings of one host CPU that overlap in time.
    pub cpu: usize,
    /// Instants at which the VMs together held more memory on a host node than at boot.
    pub memory: usize,
    /// One line per overlap.
    pub details: Vec<String>,
}

impl Overlaps {
    pub fn total(&self) -> usize {
        self.cpu + self.memory
    }
}

struct Hold<'a> {
    vm: &'a str,
    vcpu: Option<u32>,
    from: u64,
    to: u64,
}

/// Checks the records of VMs `(name, events)`.
pub fn check(vms: &[(&str, &[ElasticEvent])]) -> Overlaps {
    let mut out = Overlaps::default();
    // Host CPUs: each acquisition up to the release of the same vCPU and CPU (or forever).
    let mut holds: BTreeMap<u32, Vec<Hold>> = BTreeMap::new();
    for &(vm, events) in vms {
        let mut open: BTreeMap<(Option<u32>, u32), u64> = BTreeMap::new();
        for e in events {
            let Some(cpu) = e.host_cpu else { continue };
            match e.kind {
                Kind::CpuAcquired => {
                    if let Some(from) = open.insert((e.vcpu, cpu), e.t_ns) {
                        holds.entry(cpu).or_default().push(Hold { vm, vcpu: e.vcpu, from, to: e.t_ns });
                    }
                }
                Kind::CpuReleased => {
                    let from = open.remove(&(e.vcpu, cpu)).unwrap_or(0);
                    holds.entry(cpu).or_default().push(Hold { vm, vcpu: e.vcpu, from, to: e.t_ns });
                }
                _ => {}
            }
        }
        for ((vcpu, cpu), from) in open {
            holds.entry(cpu).or_default().push(Hold { vm, vcpu, from, to: u64::MAX });
        }
    }
    for (cpu, hs) in &holds {
        for (i, a) in hs.iter().enumerate() {
            for b in &hs[i + 1..] {
                if a.from < b.to && b.from < a.to {
                    out.cpu += 1;
                    out.details.push(format!(
                        "host CPU {cpu}: {} vCPU {:?} [{}, {}) overlaps {} vCPU {:?} [{}, {})",
                        a.vm, a.vcpu, a.from, a.to, b.vm, b.vcpu, b.from, b.to
                    ));
                }
            }
        }
    }
    // Memory, per host node: replay every change in time order from the boot total;
    // acquisitions first among equal times (the strict reading).
    let mut pool: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    let mut changes: Vec<(u64, u8, Option<u32>, i128, &str)> = Vec::new();
    for &(vm, events) in vms {
        for e in events {
            match e.kind {
                Kind::MemAcquired if e.at_boot => *pool.entry(e.host_node).or_default() += e.bytes,
                Kind::MemAcquired => changes.push((e.t_ns, 0, e.host_node, e.bytes as i128, vm)),
                Kind::MemReleased => changes.push((e.t_ns, 1, e.host_node, -(e.bytes as i128), vm)),
                _ => {}
            }
        }
    }
    changes.sort_by_key(|c| (c.0, c.1));
    let mut held: BTreeMap<Option<u32>, i128> = pool.iter().map(|(k, v)| (*k, *v as i128)).collect();
    for (t, _, node, delta, vm) in changes {
        let h = held.entry(node).or_default();
        *h += delta;
        let cap = pool.get(&node).copied().unwrap_or(0) as i128;
        if *h > cap {
            out.memory += 1;
            out.details.push(format!(
                "host node {node:?} at {t} ns: {vm} brings the VMs to {h} bytes, above the {cap} they held at boot"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(t: u64, kind: Kind, vcpu: u32, host: u32) -> ElasticEvent {
        ElasticEvent {
            t_ns: t,
            kind,
            vcpu: Some(vcpu),
            host_cpu: Some(host),
            node: None,
            host_node: None,
            bytes: 0,
            at_boot: t == 0,
        }
    }

    fn mem(t: u64, kind: Kind, bytes: u64) -> ElasticEvent {
        ElasticEvent {
            t_ns: t,
            kind,
            vcpu: None,
            host_cpu: None,
            node: Some(0),
            host_node: None,
            bytes,
            at_boot: t == 0,
        }
    }

    #[test]
    fn a_clean_lend_and_return_has_no_overlap() {
        let a = [cpu(0, Kind::CpuAcquired, 1, 1), cpu(10, Kind::CpuReleased, 1, 1), cpu(30, Kind::CpuAcquired, 1, 1)];
        let b = [cpu(0, Kind::CpuAcquired, 1, 0), cpu(11, Kind::CpuAcquired, 2, 1), cpu(20, Kind::CpuReleased, 2, 1)];
        let o = check(&[("a", &a), ("b", &b)]);
        assert_eq!(o, Overlaps::default());
    }

    #[test]
    fn a_cpu_taken_before_it_was_released_is_an_overlap() {
        let a = [cpu(0, Kind::CpuAcquired, 1, 1), cpu(12, Kind::CpuReleased, 1, 1)];
        let b = [cpu(11, Kind::CpuAcquired, 2, 1)];
        let o = check(&[("a", &a), ("b", &b)]);
        assert_eq!(o.cpu, 1);
        assert!(o.details[0].contains("host CPU 1"), "{:?}", o.details);
        // Never released, and taken again by the same VM on another vCPU.
        let c = [cpu(0, Kind::CpuAcquired, 1, 3), cpu(5, Kind::CpuAcquired, 2, 3)];
        assert_eq!(check(&[("c", &c)]).cpu, 1);
    }

    #[test]
    fn memory_above_the_boot_pool_is_an_overlap() {
        let a = [mem(0, Kind::MemAcquired, 256), mem(10, Kind::MemReleased, 128), mem(30, Kind::MemAcquired, 128)];
        let b = [mem(0, Kind::MemAcquired, 0), mem(11, Kind::MemAcquired, 128), mem(20, Kind::MemReleased, 128)];
        assert_eq!(check(&[("a", &a), ("b", &b)]).memory, 0);
        // B takes it a moment before A has let it go: an acquisition at an equal time counts.
        let b2 = [mem(10, Kind::MemAcquired, 128), mem(20, Kind::MemReleased, 128)];
        let o = check(&[("a", &a), ("b", &b2)]);
        assert_eq!(o.memory, 1, "{:?}", o.details);
        assert_eq!(o.total(), 1);
    }
}
