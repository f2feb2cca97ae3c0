//! CPUID for kumo's vCPUs: what KVM supports, less what this host's KVM cannot actually run.
//!
//! On nested KVM (shared/NESTED-KVM.md) guest ring-0 code is emulated and the emulator stops on
//! XRSTOR/XSAVE, CLAC/STAC, RDTSCP, POPCNT, CMPXCHG16B. A guest decides to use those from CPUID,
//! so they are hidden; so is KVM's PV IPI hypercall, which hangs the vCPU here.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

pub mod bits {
    // Leaf 1 ECX.
    pub const CX16: u32 = 1 << 13;
    pub const POPCNT: u32 = 1 << 23;
    pub const XSAVE: u32 = 1 << 26;
    pub const OSXSAVE: u32 = 1 << 27;
    pub const AVX: u32 = 1 << 28;
    pub const HYPERVISOR: u32 = 1 << 31;
    // Leaf 7.0 EBX.
    pub const AVX2: u32 = 1 << 5;
    pub const SMAP: u32 = 1 << 20;
    pub const AVX512F: u32 = 1 << 16;
    // Leaf 0x8000_0001 EDX.
    pub const RDTSCP: u32 = 1 << 27;
    // Leaf 0x4000_0001 EAX (KVM features).
    pub const KVM_PV_SEND_IPI: u32 = 1 << 11;
    pub const KVM_PV_EOI: u32 = 1 << 6;
    pub const KVM_PV_UNHALT: u32 = 1 << 7;
    pub const KVM_ASYNC_PF_INT: u32 = 1 << 14;
    // Leaf 1 ECX / EDX: the APIC's features.
    pub const X2APIC: u32 = 1 << 21;
    pub const TSC_DEADLINE: u32 = 1 << 24;
    pub const APIC: u32 = 1 << 9;
}

/// `--irqchip user`: kumo's APIC has the xAPIC, x2APIC and the TSC-deadline timer (its MSRs come
/// to kumo); KVM's PV features that need KVM's LAPIC (PV EOI, PV unhalt, PV IPIs, async PF by
/// interrupt) are hidden. Apply after the PV features.
pub fn user_apic(cpuid: &mut CpuId) {
    use bits::*;
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            1 => {
                e.ecx |= X2APIC | TSC_DEADLINE;
                e.edx |= APIC;
            }
            0x4000_0001 => e.eax &= !(KVM_PV_EOI | KVM_PV_UNHALT | KVM_PV_SEND_IPI | KVM_ASYNC_PF_INT),
            _ => {}
        }
    }
}

/// Adjusts `cpuid` for vCPU `id` of `ncpus`.
pub fn filter(cpuid: &mut CpuId, id: u32, ncpus: u32) {
    let mut entries: Vec<kvm_cpuid_entry2> = cpuid.as_slice().to_vec();
    entries.retain(|e| e.function != 0xd); // XSAVE state enumeration: meaningless without XSAVE
    for e in entries.iter_mut() {
        filter_entry(e, id, ncpus);
    }
    *cpuid = CpuId::from_entries(&entries).expect("fewer entries than KVM gave");
}

fn filter_entry(e: &mut kvm_cpuid_entry2, id: u32, ncpus: u32) {
    use bits::*;
    match (e.function, e.index) {
        (1, _) => {
            e.ecx &= !(CX16 | POPCNT | XSAVE | OSXSAVE | AVX);
            e.ecx |= HYPERVISOR;
            // Initial APIC ID and logical processor count.
            e.ebx = (e.ebx & 0x0000_ffff) | (id << 24) | (ncpus.min(255) << 16);
        }
        (7, 0) => e.ebx &= !(SMAP | AVX2 | AVX512F),
        (0xb, _) | (0x1f, _) => e.edx = id, // x2APIC ID
        (0x8000_0001, _) => e.edx &= !RDTSCP,
        (0x4000_0001, _) => e.eax &= !KVM_PV_SEND_IPI,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, eax, ebx, ecx, edx, ..Default::default() }
    }

    #[test]
    fn masks_what_nested_kvm_cannot_emulate() {
        let mut c = CpuId::from_entries(&[
            entry(1, 0, 0, 0xffff_ffff, 0xffff_ffff, 0),
            entry(7, 0, 0, 0xffff_ffff, 0, 0),
            entry(0xd, 0, 7, 0, 0, 0),
            entry(0x8000_0001, 0, 0, 0, 0, 0xffff_ffff),
            entry(0x4000_0001, 0, 0xffff_ffff, 0, 0, 0),
            entry(0xb, 1, 0, 0, 0, 0),
        ])
        .unwrap();
        filter(&mut c, 3, 4);
        let e = c.as_slice();
        assert_eq!(e.len(), 5, "leaf 0xd dropped");
        assert_eq!(e[0].ecx & (bits::XSAVE | bits::POPCNT | bits::CX16 | bits::AVX), 0);
        assert_ne!(e[0].ecx & bits::HYPERVISOR, 0);
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_eq!(e[1].ebx & bits::SMAP, 0);
        assert_eq!(e[2].edx & bits::RDTSCP, 0);
        assert_eq!(e[3].eax & bits::KVM_PV_SEND_IPI, 0);
        assert_eq!(e[4].edx, 3);
    }
}
