//! KVM state restore (`Persist::restore` of a vCPU and of the VM-wide state): a configured
//! vCPU's saved state with arbitrary changes, as a snapshot file or a migration peer may send
//! it, restored into a real vCPU (no KVM_RUN). Skipped without /dev/kvm.
//!
//! What is checked before anything is written must refuse without changing the vCPU; what KVM
//! itself refuses may leave part of the state written, but the vCPU must take its saved state
//! back afterwards.

use std::sync::{Mutex, OnceLock};

use kumo_devices::Persist;
use kumo_vm::vm::VmPersist;
use kumo_vm::{IrqchipMode, Vcpu, Vm};

use crate::json::{mutated_or_garbage, restore_json, save_json};
use crate::{CaseResult, Input};

struct Kvm {
    _vm: Vm,
    vcpu: Vcpu,
    vm_state: serde_json::Value,
    vm_persist: VmPersist,
    saved: serde_json::Value,
}

/// One VM for the process (creating VMs is slow); `None` without /dev/kvm.
fn kvm() -> Option<&'static Mutex<Kvm>> {
    static K: OnceLock<Option<Mutex<Kvm>>> = OnceLock::new();
    K.get_or_init(|| {
        if !kumo_vm::vm::kvm_available() {
            eprintln!("vcpu-restore: skipped, /dev/kvm not available");
            return None;
        }
        let vm = Vm::new(1, 16 << 20, IrqchipMode::Kernel).ok()?;
        let vcpu = vm.create_vcpu(0).ok()?;
        let entry = kumo_vm::Entry::KumoGuest { rip: 0x10_0000 };
        vcpu.configure(&vm.kvm, 1, Some(entry), &kumo_vm::pv::PvSet::SHARED).ok()?;
        let saved = serde_json::to_value(vcpu.save().ok()?).ok()?;
        let vm_persist = vm.persist();
        let vm_state = serde_json::to_value(vm_persist.save().ok()?).ok()?;
        Some(Mutex::new(Kvm { _vm: vm, vcpu, vm_state, vm_persist, saved }))
    })
    .as_ref()
}

/// The parts of a vCPU's state that stay put while it does not run (MSRs such as the TSC and
/// the LAPIC's timer count move on their own).
fn stable(v: &serde_json::Value) -> serde_json::Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("msrs");
        m.remove("lapic");
    }
    v
}

/// Errors of checks made before any KVM_SET_*: these promise an unchanged vCPU.
fn refused_up_front(msg: &str) -> bool {
    !msg.contains("KVM_SET_") && !msg.contains("KVM_GET_")
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let Some(k) = kvm() else { return Ok(()) };
    let mut k = k.lock().unwrap_or_else(|p| p.into_inner());
    if u.ratio(1, 4)? {
        let v = mutated_or_garbage(u, &k.vm_state.clone())?;
        let before = save_json(&k.vm_persist);
        if let Err(e) = restore_json(&mut k.vm_persist, v) {
            let msg = e.to_string();
            if refused_up_front(&msg) {
                let after = save_json(&k.vm_persist);
                // The clock moves on its own: compare the irqchips and PIT only.
                assert!(
                    after["irqchips"] == before["irqchips"] && after["pit"] == before["pit"],
                    "refused ({msg}) but changed"
                );
            }
        }
        let s = k.vm_state.clone();
        restore_json(&mut k.vm_persist, s).expect("the VM takes its saved state back");
        return Ok(());
    }
    let mut v = k.saved.clone();
    if u.ratio(3, 4)? {
        v = mutated_or_garbage(u, &v)?;
    } else {
        // A state of another shape with its registers changed: the shape check must come
        // before the registers are written.
        // kvm-bindings serializes kvm_regs as its bytes; RIP is at byte 128.
        if let Some(b) = v["regs"].get_mut(128) {
            *b = (b.as_u64().unwrap_or(0) ^ 0x10).into();
        }
        match u.int_in_range(0..=2)? {
            0 => v["lapic"] = serde_json::Value::Null,
            1 => v["id"] = 1.into(),
            _ => {
                let m = k.saved["msrs"][0].clone();
                v["msrs"] = vec![m; u.int_in_range(200..=300)?].into();
            }
        }
    }
    let before = save_json(&k.vcpu);
    if let Err(e) = restore_json(&mut k.vcpu, v) {
        let msg = e.to_string();
        if refused_up_front(&msg) {
            let after = save_json(&k.vcpu);
            if stable(&after) != stable(&before) {
                let diff: Vec<_> = after
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(f, v)| before[f.as_str()] != **v)
                    .map(|(f, _)| f.clone())
                    .collect();
                panic!("refused ({msg}) but the vCPU changed: {diff:?}");
            }
        }
    }
    let s = k.saved.clone();
    restore_json(&mut k.vcpu, s).expect("the vCPU takes its saved state back");
    Ok(())
}
