//! Saved VM state: everything KVM holds for a VM besides memory, serializable for snapshots and
//! migration. The vCPUs and the VM-wide state (`vm::VmPersist`) save and restore it through the
//! persist pattern of `kumo_devices::persist`, as devices do.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u32,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// FPU, SSE and extended state (KVM_GET_XSAVE: on this host KVM_SET_FPU does not restore MXCSR).
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub lapic: Option<kvm_lapic_state>,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debugregs: kvm_debugregs,
}

/// VM-wide KVM state: the in-kernel PIC/IOAPIC and PIT (absent with a split irqchip) and the
/// KVM clock.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    pub irqchips: Vec<kvm_irqchip>,
    pub pit: Option<kvm_pit_state2>,
    pub clock: kvm_clock_data,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("id", &self.id)
            .field("rip", &format_args!("{:#x}", self.regs.rip))
            .field("msrs", &self.msrs.len())
            .field("mp_state", &self.mp_state.mp_state)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmState")
            .field("irqchips", &self.irqchips.len())
            .field("pit", &self.pit.is_some())
            .field("clock_ns", &self.clock.clock)
            .finish()
    }
}

/// A vCPU's id in snapshots: `vcpu0`, `vcpu1`, …
pub fn vcpu_id(id: u32) -> String {
    format!("vcpu{id}")
}
