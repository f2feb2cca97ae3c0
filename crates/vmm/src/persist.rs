//! What a snapshot of a running VM holds, and the one way it is made: every component (the
//! VM-wide KVM state, each vCPU, each device) saves and restores itself through
//! `kumo_devices::Persist`. The vCPUs and the VM-wide state have typed fields; devices are kept
//! by component id ([`DeviceStates`]), so a new device adds its state without a new field here.
//!
//! A snapshot is JSON on the migration wire (the `State` record, docs/migration-format.md):
//! changing its shape is a new stream version.

use kumo_devices::DeviceStates;
use kumo_vm::{VcpuState, VmState};

/// Everything needed to put a paused VM back where it was (memory stays in place).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The in-kernel irqchips, PIT and KVM clock (component `vm`).
    pub vm: VmState,
    /// Each vCPU's state, in vCPU order (components `vcpu0`, `vcpu1`, …).
    pub vcpus: Vec<VcpuState>,
    /// Every device's state, by component id (`com1`, …).
    pub devices: DeviceStates,
    /// The user had paused the VM: a migrated VM arrives paused, as it left.
    pub paused: bool,
}
