//! Does this host's KVM handle the PV IPI hypercall (KVM_HC_SEND_IPI)? KVM may advertise
//! KVM_FEATURE_PV_SEND_IPI and still hang the vCPU on the hypercall (this project's nested KVM
//! does: shared/NESTED-KVM.md). A guest told the feature exists sends every IPI that way, so
//! `--pv pv-ipi=on` is refused unless a throw-away VM gets through one hypercall. The probe VM
//! is built here, over `kumo_vm`, not inside it: `kumo_vm::pv` stays a leaf its vCPUs use.

use kumo_sandbox::ThreadKind;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use kumo_devices::bus::Buses;
use kumo_devices::debug_port::{DebugPort, EXIT_PORT};
use kumo_devices::DeviceEvent;
use kvm_ioctls::Kvm;
use vm_memory::{Bytes, GuestAddress};

use kumo_vm::boot::{write_gdt, write_page_tables, Entry};
use kumo_vm::pv::{PvError, PvSet};
use kumo_vm::vcpu::VcpuRun;
use kumo_vm::vm::Vm;
use kumo_vm::IrqchipMode;

/// What the probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PvIpiProbe {
    /// The hypercall returned (with KVM's return value: the number of IPIs delivered).
    Works(i64),
    /// The hypercall returned an error (e.g. -KVM_ENOSYS: not handled).
    Refused(i64),
    /// The vCPU did not come back within the limit.
    Hangs,
    /// The probe VM could not be built or run.
    Failed(String),
}

const PROBE_RAM: u64 = 16 << 20;
const CODE_GPA: u64 = 8 << 20;

/// 64-bit code: KVM_HC_SEND_IPI (10) to APIC 0 (itself: the bitmap in rbx, min id in rdx),
/// fixed vector 0x40 (rsi), then the hypercall's result to kumo's exit port. The hypercall
/// instruction is the vendor's own (KVM patches the other one, at the cost of an emulation).
fn code(amd: bool) -> Vec<u8> {
    let mut c = vec![
        0xb8, 10, 0, 0, 0, // mov eax, KVM_HC_SEND_IPI
        0xbb, 1, 0, 0, 0, // mov ebx, 1 (APIC 0)
        0x31, 0xc9, // xor ecx, ecx
        0x31, 0xd2, // xor edx, edx (min APIC id 0)
        0xbe, 0x40, 0, 0, 0, // mov esi, 0x40 (fixed, vector 0x40)
    ];
    c.extend_from_slice(if amd { &[0x0f, 0x01, 0xd9] } else { &[0x0f, 0x01, 0xc1] }); // vmmcall / vmcall
    c.extend_from_slice(&[0xba, 0x01, 0x05, 0, 0, 0xef, 0xf4]); // mov edx, 0x501; out dx, eax; hlt
    c
}

fn is_amd() -> bool {
    // CPUID leaf 0's vendor string: "AuthenticAMD" has ebx = "Auth".
    let r = std::arch::x86_64::__cpuid(0);
    r.ebx == u32::from_le_bytes(*b"Auth")
}

/// Runs the probe, waiting at most `limit` for the vCPU. A hung vCPU's thread is left behind
/// (it cannot be stopped from here): the caller refuses the feature, the process goes on.
pub fn probe_pv_ipi(kvm: &Kvm, limit: Duration) -> PvIpiProbe {
    let setup = || -> kumo_vm::Result<(Vm, kumo_vm::Vcpu)> {
        let vm = Vm::new(1, PROBE_RAM, IrqchipMode::Kernel)?;
        let mem = &vm.memory.guest;
        write_gdt(mem, 1)?;
        write_page_tables(mem, vm.memory.layout.ram_end())?;
        mem.write_slice(&code(is_amd()), GuestAddress(CODE_GPA))
            .map_err(|e| kumo_vm::Error::Memory(format!("probe code: {e}")))?;
        let vcpu = vm.create_vcpu(0)?;
        let pv = PvSet { pv_ipi: true, ..PvSet::SHARED };
        vcpu.configure(kvm, 1, Some(Entry::KumoGuest { rip: CODE_GPA }), &pv)?;
        Ok((vm, vcpu))
    };
    let (vm, mut vcpu) = match setup() {
        Ok(v) => v,
        Err(e) => return PvIpiProbe::Failed(e.to_string()),
    };
    let mut buses = Buses::default();
    if let Err(e) = buses.pio.insert(EXIT_PORT.into(), 2, Arc::new(Mutex::new(DebugPort))) {
        return PvIpiProbe::Failed(format!("{e:?}"));
    }
    let (tx, rx) = mpsc::channel();
    let spawned = kumo_sandbox::spawn(ThreadKind::Vcpu, "pv-ipi-probe", move || {
        let _vm = vm; // the VM lives as long as its vCPU runs
        let outcome = loop {
            match vcpu.run(&buses) {
                Ok(VcpuRun::Device(DeviceEvent::GuestExit(v))) => {
                    let rc = v as i32 as i64;
                    break if rc < 0 { PvIpiProbe::Refused(rc) } else { PvIpiProbe::Works(rc) };
                }
                Ok(VcpuRun::Continue | VcpuRun::Interrupted | VcpuRun::Device(_)) => continue,
                Ok(other) => break PvIpiProbe::Failed(format!("the probe vCPU stopped: {other:?}")),
                Err(e) => break PvIpiProbe::Failed(e.to_string()),
            }
        };
        let _ = tx.send(outcome);
    });
    if let Err(e) = spawned {
        return PvIpiProbe::Failed(format!("cannot start the probe thread: {e}"));
    }
    rx.recv_timeout(limit).unwrap_or(PvIpiProbe::Hangs)
}

/// How long the PV IPI probe waits for its vCPU before calling the hypercall hung.
pub const PV_IPI_PROBE_LIMIT: Duration = Duration::from_secs(5);

/// Checks, with a probe VM, that the PV IPI hypercall works on this host, for a `set` that
/// turns it on (a guest would send every IPI through it). Nothing to check otherwise.
pub fn check_pv_ipi(kvm: &Kvm, set: &PvSet) -> Result<(), PvError> {
    if !set.pv_ipi {
        return Ok(());
    }
    match probe_pv_ipi(kvm, PV_IPI_PROBE_LIMIT) {
        PvIpiProbe::Works(_) => Ok(()),
        PvIpiProbe::Hangs => Err(PvError::PvIpiBroken(format!(
            "KVM_HC_SEND_IPI hung a probe vCPU (no return within {} s)",
            PV_IPI_PROBE_LIMIT.as_secs()
        ))),
        PvIpiProbe::Refused(rc) => Err(PvError::PvIpiBroken(format!("KVM_HC_SEND_IPI returned {rc} in a probe VM"))),
        PvIpiProbe::Failed(e) => Err(PvError::PvIpiBroken(format!("its probe VM failed: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_code_is_the_hypercall_then_the_port_write() {
        let c = code(true);
        assert_eq!(&c[c.len() - 10..], &[0x0f, 0x01, 0xd9, 0xba, 0x01, 0x05, 0, 0, 0xef, 0xf4]);
        assert_eq!(&code(false)[c.len() - 10..c.len() - 7], &[0x0f, 0x01, 0xc1]);
    }

    /// Needs /dev/kvm; reports what this host does (on the project machine the hypercall
    /// hangs; elsewhere it works). Either way the probe answers instead of hanging the caller.
    #[test]
    fn the_probe_answers() {
        let Ok(kvm) = kumo_vm::vm::open_kvm() else {
            eprintln!("skipping the_probe_answers: no /dev/kvm");
            return;
        };
        let p = probe_pv_ipi(&kvm, Duration::from_secs(5));
        eprintln!("PV IPI probe on this host: {p:?}");
        assert!(!matches!(p, PvIpiProbe::Failed(_)), "{p:?}");
    }
}
