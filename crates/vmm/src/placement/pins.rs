//! vCPU pins: which host CPU each vCPU's thread runs on (`pins[v]`; `None` floats), from
//! `--cpus N,pin=V@H` or a guest node's `pin=`; and whether they make the vCPUs dedicated (the
//! PV defaults follow). Mirror mode's pins are [`super::mirror`]'s. Host-local: never carried
//! to a migration's destination. The vCPU threads apply them (`kumo_vm::sched`).

use super::guest_numa::{NodePin, NumaConfig};
use super::{format_cpulist, HostTopology, PlacementError, Result};
use crate::Error;

/// Parses a pin spec, the value of `pin=`: `V@H` pairs (vCPU `V` runs on host CPU `H`)
/// separated by `:` or `,`, where a pair may also be two ranges of one length,
/// `A-B@C-D` (vCPU `A` on `C`, `A+1` on `C+1`, …). Refuses a vCPU the VM (`vcpus`) lacks, a
/// vCPU pinned twice and a host CPU not in `online`. Returns `(vcpu, host_cpu)` ascending by
/// vCPU. Two vCPUs may share a host CPU (see [`is_dedicated`]).
pub fn parse_pins(spec: &str, vcpus: u32, online: &[u32]) -> Result<Vec<(u32, u32)>> {
    let err = |what: String| PlacementError::Pin { spec: spec.to_string(), what };
    if spec.trim().is_empty() {
        return Err(err("empty; give vCPU@hostCPU pairs, e.g. pin=0@2:1@3".into()));
    }
    let range = |s: &str| -> Option<(u32, u32)> {
        let (a, b) = s.split_once('-').unwrap_or((s, s));
        let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        (a <= b).then_some((a, b))
    };
    let mut pins: Vec<(u32, u32)> = Vec::new();
    for item in spec.split([':', ',']) {
        let bad = || err(format!("{item:?} is not vCPU@hostCPU (or A-B@C-D)"));
        let (v, h) = item.split_once('@').ok_or_else(bad)?;
        let ((v0, v1), (h0, h1)) = (range(v).ok_or_else(bad)?, range(h).ok_or_else(bad)?);
        if v1 - v0 != h1 - h0 {
            return Err(err(format!("{item:?} pins {} vCPUs to {} host CPUs", v1 - v0 + 1, h1 - h0 + 1)));
        }
        for (v, h) in (v0..=v1).zip(h0..=h1) {
            if v >= vcpus {
                return Err(err(format!("vCPU {v} does not exist (the VM has {vcpus} vCPUs)")));
            }
            if pins.iter().any(|&(p, _)| p == v) {
                return Err(err(format!("vCPU {v} is pinned twice")));
            }
            if !online.contains(&h) {
                return Err(err(format!("host CPU {h} is not online (online: {})", format_cpulist(online))));
            }
            pins.push((v, h));
        }
    }
    pins.sort_unstable();
    Ok(pins)
}

/// Parses the value of `--cpus`: `N` or `N,pin=SPEC` ([`parse_pins`] reads `SPEC`, so
/// `--cpus 2,pin=0@0,1@1` and `--cpus 2,pin=0@0:1@1` both work). Returns the vCPU count and
/// `pins[v]`, the host CPU of vCPU `v` (`None`, or past the end: not pinned, it floats); no
/// `pin=`: empty. The count itself is checked where the VM is (at least 1, KVM's limit).
pub fn parse_cpus_arg(arg: &str, online: &[u32]) -> std::result::Result<(u32, Vec<Option<u32>>), String> {
    let (n, rest) = arg.split_once(',').unwrap_or((arg, ""));
    let n: u32 =
        n.trim().parse().map_err(|_| format!("--cpus {arg}: {n:?} is not a vCPU count (give N or N,pin=V@H:V@H)"))?;
    if rest.is_empty() {
        return Ok((n, Vec::new()));
    }
    let spec = rest
        .strip_prefix("pin=")
        .ok_or_else(|| format!("--cpus {arg}: {rest:?} is not pin=SPEC (give N or N,pin=V@H:V@H)"))?;
    let pairs = parse_pins(spec, n, online).map_err(|e| format!("--cpus: {e}"))?;
    // Sized by the pinned vCPUs (each below n), not by n: a huge n is refused later, not here.
    let mut pins = vec![None; pairs.last().map_or(0, |&(v, _)| v as usize + 1)];
    for (v, h) in pairs {
        pins[v as usize] = Some(h);
    }
    Ok((n, pins))
}

/// Whether `pins` gives each of `vcpus` vCPUs a host CPU of its own: the dedicated case where
/// the PV hints for an overcommitted host (PV halt, steal time) should be off.
pub fn is_dedicated(pins: &[(u32, u32)], vcpus: u32) -> bool {
    let mut hosts: Vec<u32> = pins.iter().map(|&(_, h)| h).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let mut v: Vec<u32> = pins.iter().map(|&(v, _)| v).filter(|&v| v < vcpus).collect();
    v.sort_unstable();
    v.dedup();
    hosts.len() == pins.len() && v.len() == vcpus as usize
}

/// Whether `pins` (host CPU of each vCPU, `pins[v]`; `None` floats) gives each of `ncpus` vCPUs
/// a host CPU of its own: then the PV defaults are those for dedicated vCPUs.
pub fn pins_dedicated(pins: &[Option<u32>], ncpus: u32) -> bool {
    let pairs: Vec<(u32, u32)> = pins.iter().enumerate().filter_map(|(v, h)| h.map(|h| (v as u32, h))).collect();
    !pairs.is_empty() && is_dedicated(&pairs, ncpus)
}

impl NumaConfig {
    /// Whether any node says where its vCPUs run (`pin=`).
    pub fn pins_vcpus(&self) -> bool {
        self.nodes.iter().any(|n| n.pin.is_some())
    }

    /// `pins[v]`, the host CPU of vCPU `v`, from the nodes' `pin=` (the form `--cpus N,pin=`
    /// gives): a node's vCPUs in ascending order onto its host CPUs in order. Refuses a list
    /// whose length is not the node's vCPU count, a CPU `host` does not have online, and
    /// `pin=host-node` without a `host-node` or on a host node with fewer CPUs than vCPUs.
    pub fn pins(&self, host: &HostTopology) -> std::result::Result<Vec<Option<u32>>, Error> {
        let mut pins: Vec<Option<u32>> = Vec::new();
        let online = host.online_cpus();
        for n in &self.nodes {
            let Some(pin) = &n.pin else { continue };
            let bad = |m: String| Error::Config(format!("NUMA node {}: pin={}: {m}", n.id, String::from(pin.clone())));
            let mut vcpus = n.cpus.clone();
            vcpus.sort_unstable();
            let hosts = match pin {
                NodePin::Cpus(list) => {
                    if list.len() != vcpus.len() {
                        return Err(bad(format!("{} host CPUs for the node's {} vCPUs", list.len(), vcpus.len())));
                    }
                    if let Some(c) = list.iter().find(|c| !online.contains(c)) {
                        let online = format_cpulist(&online);
                        return Err(bad(format!("host CPU {c} is not online (online: {online})")));
                    }
                    list.clone()
                }
                NodePin::HostNode => {
                    let h = n.host_node.ok_or_else(|| bad("needs host-node=N".into()))?;
                    let node = host
                        .nodes
                        .iter()
                        .find(|x| x.id == h)
                        .ok_or_else(|| bad(format!("host node {h} does not exist")))?;
                    let order = host.fill_order(node);
                    if order.len() < vcpus.len() {
                        return Err(bad(format!(
                            "host node {h} has {} CPUs for the node's {} vCPUs",
                            order.len(),
                            vcpus.len()
                        )));
                    }
                    order[..vcpus.len()].to_vec()
                }
            };
            for (v, h) in vcpus.into_iter().zip(hosts) {
                if pins.len() <= v as usize {
                    pins.resize(v as usize + 1, None);
                }
                pins[v as usize] = Some(h);
            }
        }
        Ok(pins)
    }
}
