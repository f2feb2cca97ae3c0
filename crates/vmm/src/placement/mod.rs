//! Host placement (seed 002, vNUMA): where a VM's vCPUs and memory sit on this host, and what
//! follows from it. The one home of `--numa` (and `mirror`), vCPU pins, the PV defaults, halt
//! polling and real-time priority:
//! - [`host`]: the host's NUMA nodes, CPUs and distances (sysfs) and the one CPU-list parser;
//! - [`guest_numa`]: the guest's NUMA nodes (`--numa node=…`, a config file's `numa`);
//! - [`mirror`]: `--numa mirror` (a file's `numa = "mirror"`), guest nodes copying the host's;
//! - [`pins`]: vCPU pins (`--cpus N,pin=`, a node's `pin=`) and whether they are dedicated;
//! - [`place`]: all of these for a VM that boots here; [`pv_features`]: the PV features its
//!   placement implies, checked with [`pv_probe`] (a throw-away VM that tries the PV IPI);
//!   [`set_halt_polling`]; [`realtime_this_thread`] for the control threads of an elastic VM;
//!   [`io_cpus`]: the CPUs of the threads that are not vCPUs (kept off pinned vCPUs' CPUs).
//!
//! Two kinds of setting, kept apart. The **VM description** migrates with the VM (a
//! `VmConfig`'s serialized fields): vCPU count, memory, the guest nodes' vCPUs, memory and
//! distances ([`NumaConfig`]), the resolved PV features. The **host-local** settings are this
//! host's and never travel: [`HostPlacement`] (vCPU pins, halt polling), a guest node's
//! `host_node` and `pin` (an arriving VM gets its operator's, `crate::host_resources`) and the
//! real-time priority of control threads. The system calls that apply them (thread affinity,
//! `SCHED_FIFO`) are `kumo_vm::sched`; `mbind` is `kumo_vm::memory::bind_to_host_node`.

pub mod guest_numa;
pub mod host;
pub mod mirror;
pub mod pins;
pub mod pv_probe;

#[cfg(test)]
mod tests;

use kumo_vm::memory::human_size;
use kumo_vm::pv::{PvRequest, PvSet};
use kumo_vm::IrqchipMode;
use serde::Deserialize;

pub use guest_numa::{NodePin, NumaConfig, NumaDistance, NumaNodeSpec, HOST_NODE_SYSFS};
pub use host::{format_cpulist, parse_cpu_list, parse_cpu_set, HostCpu, HostNode, HostTopology};
pub use kumo_vm::sched::{realtime_this_thread, RealtimeGuard};
pub use mirror::{mirror, MirrorNode, MirrorPlan, MIRROR_UNIT};
pub use pins::{is_dedicated, parse_cpus_arg, parse_pins, pins_dedicated};

/// Every way reading the host, planning or pinning can fail; each message is one line naming
/// the problem (and, for a malformed sysfs tree, the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{path}: {what}")]
    Read { path: String, what: String },
    #[error("--numa mirror needs at least 1 vCPU")]
    NoVcpus,
    #[error("--numa mirror: {vcpus} vCPUs but this host has {host} online CPUs (mirror mode pins each vCPU to a host CPU of its own)")]
    TooManyVcpus { vcpus: u32, host: u32 },
    #[error("--numa mirror: memory {} is more than this host's {}", human_size(*.memory), human_size(*.host))]
    TooMuchMemory { memory: u64, host: u64 },
    #[error("--numa mirror: guest node {node} would get {} but host node {host_node} has only {}", human_size(*.share), human_size(*.host))]
    NodeMemory { node: u32, host_node: u32, share: u64, host: u64 },
    #[error("pin={spec}: {what}")]
    Pin { spec: String, what: String },
}

pub type Result<T> = std::result::Result<T, PlacementError>;

/// A VM's host-local settings: this host's, not part of the VM description, so never carried
/// to a migration's destination or into a snapshot (each host gives its own).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPlacement {
    /// Host CPU of each vCPU (`pins[v]`, from `--cpus N,pin=`, a node's `pin=`, `--numa mirror`
    /// or `--elastic`); `None` or past the end: not pinned, it floats.
    pub pins: Vec<Option<u32>>,
    /// KVM's halt polling for this VM in ns (`--halt-poll-ns`, KVM_CAP_HALT_POLL); none: the
    /// host's module parameter (an elastic VM's default is 0, [`set_halt_polling`]).
    pub halt_poll_ns: Option<u32>,
}

/// The guest NUMA nodes asked for: `--numa mirror` (in a config file `numa = "mirror"`), or
/// the nodes themselves (`--numa node=…`, a file's `numa` table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NumaRequest {
    Mirror,
    Nodes(NumaConfig),
}

impl<'de> Deserialize<'de> for NumaRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = NumaRequest;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#""mirror" or a table of nodes (and distances)"#)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> std::result::Result<NumaRequest, E> {
                match s {
                    "mirror" => Ok(NumaRequest::Mirror),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(s), &self)),
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> std::result::Result<NumaRequest, A::Error> {
                NumaConfig::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(NumaRequest::Nodes)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// The guest nodes and vCPU pins of a VM that boots here, from what its operator gave: a VM of
/// `cpus` vCPUs and `memory` bytes, `cpu_pins` from `--cpus N,pin=`, `numa` from `--numa` or a
/// config file. Mirror mode plans both from the host; a node's `pin=` gives the pins of its
/// vCPUs. Either beside `--cpus` pins is refused rather than merged: other pins would break
/// the node a vCPU sits in. `host` is read only when mirror or a node's `pin=` needs it.
pub fn place(
    cpus: u32,
    memory: u64,
    cpu_pins: Vec<Option<u32>>,
    numa: Option<NumaRequest>,
    host: impl Fn() -> Result<HostTopology>,
) -> std::result::Result<(Option<NumaConfig>, Vec<Option<u32>>), String> {
    let pinned = cpu_pins.iter().any(Option::is_some);
    match numa {
        None => Ok((None, cpu_pins)),
        Some(NumaRequest::Mirror) => {
            let host = host().map_err(|e| format!("--numa mirror: {e}"))?;
            if pinned {
                return Err("--cpus N,pin= and --numa mirror both pin vCPUs; give one of them".into());
            }
            let plan = mirror(&host, cpus, memory).map_err(|e| e.to_string())?;
            Ok((Some(NumaConfig::from_mirror(&plan)), plan.pins.iter().copied().map(Some).collect()))
        }
        Some(NumaRequest::Nodes(n)) if n.pins_vcpus() => {
            if pinned {
                return Err("--cpus N,pin= and a NUMA node's pin= both pin vCPUs; give one of them".into());
            }
            let host = host().map_err(|e| format!("a NUMA node's pin=: cannot read the host's topology: {e}"))?;
            let pins = n.pins(&host).map_err(|e| e.to_string())?;
            Ok((Some(n), pins))
        }
        Some(NumaRequest::Nodes(n)) => Ok((Some(n), cpu_pins)),
    }
}

/// The PV features a VM's vCPUs get (CPUID leaf 0x4000_0001), resolved once at boot from what
/// `--pv` asked (`request`) and, for the rest, the VM's placement: the dedicated set when every
/// one of its `cpus` vCPUs has a host CPU of its own (`pins`), else the shared set. Without
/// KVM's LAPIC (`--irqchip user`) PV unhalt and PV IPIs are off (they are KVM LAPIC deliveries
/// and would reach no one); PV IPI on is checked with a probe VM. Returns the set and whether
/// the vCPUs are dedicated.
pub fn pv_features(
    request: &PvRequest,
    pins: &[Option<u32>],
    cpus: u32,
    irqchip: IrqchipMode,
    kvm: &kvm_ioctls::Kvm,
) -> crate::Result<(PvSet, bool)> {
    let dedicated = pins_dedicated(pins, cpus);
    let pv = request
        .resolve(kumo_vm::pv::host_supported_eax(kvm)?, dedicated)
        .map_err(|e| crate::Error::Config(e.to_string()))?;
    let pv = match irqchip {
        IrqchipMode::User => PvSet { pv_unhalt: false, pv_ipi: false, ..pv },
        _ => pv,
    };
    pv_probe::check_pv_ipi(kvm, &pv).map_err(|e| crate::Error::Config(e.to_string()))?;
    Ok((pv, dedicated))
}

/// The host CPUs for a VM's threads other than its vCPUs (devices, the API, the console,
/// migrations): those the VMM may use (`all`) without the pinned vCPUs' (`pins`), so a pinned
/// vCPU's CPU is its own. All of them if no vCPU is pinned, or if the pins take every one
/// (there is then no CPU to keep the other threads on).
pub fn io_cpus(all: &[u32], pins: &[Option<u32>]) -> Vec<u32> {
    let rest: Vec<u32> = all.iter().copied().filter(|c| !pins.contains(&Some(*c))).collect();
    if rest.is_empty() {
        all.to_vec()
    } else {
        rest
    }
}

/// Sets KVM's halt polling for `vm`: `--halt-poll-ns` if given; for an `elastic` VM 0, since an
/// idle vCPU of it must cost no host CPU (KVM's polling would spin its thread, 200 us a halt by
/// default, on CPUs other VMs are using), with a warning if KVM refuses; else the host's default.
pub fn set_halt_polling(vm: &kumo_vm::Vm, host: &HostPlacement, elastic: bool) -> crate::Result<()> {
    if let Some(ns) = host.halt_poll_ns {
        vm.set_halt_poll_ns(ns)?;
    } else if elastic {
        if let Err(e) = vm.set_halt_poll_ns(0) {
            tracing::warn!("elastic VM: halt polling left on: {e}");
        }
    }
    Ok(())
}
