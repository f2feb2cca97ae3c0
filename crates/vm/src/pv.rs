//! KVM paravirtual features shown to the guest: CPUID leaf 0x4000_0001 (EAX feature bits, EDX
//! hints), chosen per VM (docs/pv-features.md).
//!
//! Defaults: for shared vCPUs KVM's usual set (less PV IPI, which hangs the vCPU on this host's
//! nested KVM, shared/NESTED-KVM.md); for dedicated vCPUs (each pinned to a host CPU of its
//! own) `KVM_HINTS_REALTIME` and none of the features built for overcommit (seed 002). Which
//! of the two a VM gets, and the PV IPI probe, are `kumo_vmm::placement`'s.

use kvm_bindings::CpuId;
use serde::{Deserialize, Serialize};

/// Bit numbers of the kernel's arch/x86/include/uapi/asm/kvm_para.h (kvm-bindings has none).
pub mod bits {
    /// EAX bit 5, KVM_FEATURE_STEAL_TIME.
    pub const STEAL_TIME: u32 = 1 << 5;
    /// EAX bit 7, KVM_FEATURE_PV_UNHALT.
    pub const PV_UNHALT: u32 = 1 << 7;
    /// EAX bit 9, KVM_FEATURE_PV_TLB_FLUSH.
    pub const PV_TLB_FLUSH: u32 = 1 << 9;
    /// EAX bit 11, KVM_FEATURE_PV_SEND_IPI.
    pub const PV_SEND_IPI: u32 = 1 << 11;
    /// EAX bit 12, KVM_FEATURE_POLL_CONTROL.
    pub const POLL_CONTROL: u32 = 1 << 12;
    /// EDX bit 0, KVM_HINTS_REALTIME.
    pub const HINTS_REALTIME: u32 = 1 << 0;
}

pub const SIGNATURE_LEAF: u32 = 0x4000_0000;
pub const FEATURES_LEAF: u32 = 0x4000_0001;

/// A concrete choice of the controlled features.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PvSet {
    pub steal_time: bool,
    pub pv_unhalt: bool,
    pub tlb_flush: bool,
    pub poll_control: bool,
    pub pv_ipi: bool,
    pub realtime: bool,
}

/// The features as `--pv` names them, with their EAX bit (0 for the EDX hint).
pub const FEATURES: [(&str, u32); 6] = [
    ("steal-time", bits::STEAL_TIME),
    ("pv-unhalt", bits::PV_UNHALT),
    ("tlb-flush", bits::PV_TLB_FLUSH),
    ("poll-control", bits::POLL_CONTROL),
    ("pv-ipi", bits::PV_SEND_IPI),
    ("realtime", 0),
];

const CONTROLLED_EAX: u32 =
    bits::STEAL_TIME | bits::PV_UNHALT | bits::PV_TLB_FLUSH | bits::POLL_CONTROL | bits::PV_SEND_IPI;

impl PvSet {
    /// Dedicated vCPUs: the realtime hint (Linux then uses native qspinlocks instead of the PV
    /// halt-and-kick path, skips PV TLB flush and PV sched-yield, and loads cpuidle-haltpoll),
    /// poll control so the guest's haltpoll can turn KVM's host-side polling off, no steal
    /// time. PV unhalt stays advertised: older Linux checks it before the hint and, without
    /// it, keeps the test-and-set `virt_spin_lock` instead of native qspinlocks.
    pub const DEDICATED: PvSet = PvSet {
        steal_time: false,
        pv_unhalt: true,
        tlb_flush: false,
        poll_control: true,
        pv_ipi: false,
        realtime: true,
    };
    /// Shared vCPUs: KVM's usual set, except PV IPI (hangs the vCPU on this host).
    pub const SHARED: PvSet = PvSet {
        steal_time: true,
        pv_unhalt: true,
        tlb_flush: true,
        poll_control: true,
        pv_ipi: false,
        realtime: false,
    };

    fn get(&self, name: &str) -> bool {
        match name {
            "steal-time" => self.steal_time,
            "pv-unhalt" => self.pv_unhalt,
            "tlb-flush" => self.tlb_flush,
            "poll-control" => self.poll_control,
            "pv-ipi" => self.pv_ipi,
            _ => self.realtime,
        }
    }

    /// The EAX feature bits this set turns on.
    pub fn eax(&self) -> u32 {
        FEATURES.iter().filter(|(n, b)| *b != 0 && self.get(n)).fold(0, |a, (_, b)| a | b)
    }

    /// The EDX hints.
    pub fn edx(&self) -> u32 {
        if self.realtime {
            bits::HINTS_REALTIME
        } else {
            0
        }
    }

    /// `steal-time=on,...` for messages and `info`.
    pub fn describe(&self) -> String {
        FEATURES
            .iter()
            .map(|(n, _)| format!("{n}={}", if self.get(n) { "on" } else { "off" }))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What a VM asks for (`--pv`): a preset and per-feature overrides; unset fields take the
/// default for the VM's vCPUs (dedicated or shared). A migration stream carries the resolved
/// set (every field set), so the guest's CPUID does not change on the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PvRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal_time: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv_unhalt: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tlb_flush: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_control: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv_ipi: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub realtime: Option<bool>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PvError {
    #[error("--pv {0}: {1}")]
    Syntax(String, String),
    #[error("--pv {0}=on: this host's KVM does not support it (KVM_GET_SUPPORTED_CPUID leaf 0x40000001)")]
    Unsupported(&'static str),
    #[error("--pv pv-ipi=on: this host's KVM advertises PV IPI but {0}; leave pv-ipi off")]
    PvIpiBroken(String),
}

impl PvRequest {
    pub fn is_default(&self) -> bool {
        *self == PvRequest::default()
    }

    fn slot(&mut self, name: &str) -> Option<&mut Option<bool>> {
        Some(match name {
            "steal-time" => &mut self.steal_time,
            "pv-unhalt" => &mut self.pv_unhalt,
            "tlb-flush" => &mut self.tlb_flush,
            "poll-control" => &mut self.poll_control,
            "pv-ipi" => &mut self.pv_ipi,
            "realtime" => &mut self.realtime,
            _ => return None,
        })
    }

    /// A request with every field set to `set`.
    pub fn from_set(set: PvSet) -> PvRequest {
        let mut r = PvRequest::default();
        for (n, _) in FEATURES {
            if let Some(s) = r.slot(n) {
                *s = Some(set.get(n));
            }
        }
        r
    }

    /// Parses `--pv`: comma-separated `dedicated`, `shared` (presets, setting every feature)
    /// and `FEATURE=on|off`; later items override earlier ones.
    pub fn parse(s: &str) -> Result<PvRequest, PvError> {
        let bad = |m: String| PvError::Syntax(s.to_string(), m);
        let mut r = PvRequest::default();
        for part in s.split(',') {
            match part.split_once('=') {
                None if part == "dedicated" => r = PvRequest::from_set(PvSet::DEDICATED),
                None if part == "shared" => r = PvRequest::from_set(PvSet::SHARED),
                None => {
                    return Err(bad(format!("`{part}` is neither a preset (dedicated, shared) nor FEATURE=on|off")))
                }
                Some((k, v)) => {
                    let on = match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad(format!("`{v}` for {k}: expected on or off"))),
                    };
                    let names = FEATURES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
                    *r.slot(k).ok_or_else(|| bad(format!("unknown feature `{k}` (known: {names})")))? = Some(on);
                }
            }
        }
        Ok(r)
    }

    /// The concrete set for a VM whose vCPUs are `dedicated` or not, given KVM's supported EAX
    /// feature bits of leaf 0x4000_0001 (`None`: KVM has no PV leaf). A feature asked for
    /// explicitly that KVM lacks is an error; one that is only a default is dropped.
    pub fn resolve(&self, supported_eax: Option<u32>, dedicated: bool) -> Result<PvSet, PvError> {
        let base = if dedicated { PvSet::DEDICATED } else { PvSet::SHARED };
        let mut me = *self;
        let mut out = PvSet::default();
        for (name, bit) in FEATURES {
            let asked = me.slot(name).and_then(|s| *s);
            // The realtime hint is the VMM's statement, KVM implements nothing for it; it only
            // needs the PV leaf to exist.
            let supported = supported_eax.is_some_and(|eax| bit == 0 || eax & bit != 0);
            let on = match asked {
                Some(true) if !supported => return Err(PvError::Unsupported(name)),
                Some(v) => v,
                None => base.get(name) && supported,
            };
            set_by_name(&mut out, name, on);
        }
        Ok(out)
    }
}

fn set_by_name(s: &mut PvSet, name: &str, on: bool) {
    match name {
        "steal-time" => s.steal_time = on,
        "pv-unhalt" => s.pv_unhalt = on,
        "tlb-flush" => s.tlb_flush = on,
        "poll-control" => s.poll_control = on,
        "pv-ipi" => s.pv_ipi = on,
        _ => s.realtime = on,
    }
}

/// KVM's supported EAX of leaf 0x4000_0001 in `cpuid`, if the leaf is there.
pub fn supported_eax(cpuid: &CpuId) -> Option<u32> {
    cpuid.as_slice().iter().find(|e| e.function == FEATURES_LEAF).map(|e| e.eax)
}

/// This host's KVM_GET_SUPPORTED_CPUID EAX of leaf 0x4000_0001 (see `supported_eax`).
pub fn host_supported_eax(kvm: &kvm_ioctls::Kvm) -> crate::Result<Option<u32>> {
    let c = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| crate::Error::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
    Ok(supported_eax(&c))
}

/// Writes `set` into leaf 0x4000_0001 of `cpuid`; bits outside the controlled ones (clock
/// source, async PF, PV EOI, ...) stay as KVM reported them.
pub fn apply(cpuid: &mut CpuId, set: &PvSet) {
    for e in cpuid.as_mut_slice().iter_mut().filter(|e| e.function == FEATURES_LEAF) {
        e.eax = (e.eax & !CONTROLLED_EAX) | set.eax();
        e.edx = (e.edx & !bits::HINTS_REALTIME) | set.edx();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    const ALL: u32 = 0x0100_3eff; // clock sources, steal time, PV EOI, unhalt, TLB flush, IPI, poll, ...

    fn cpuid(eax: u32) -> CpuId {
        let e = |function, eax| kvm_cpuid_entry2 { function, eax, ..Default::default() };
        CpuId::from_entries(&[e(SIGNATURE_LEAF, FEATURES_LEAF), e(FEATURES_LEAF, eax)]).unwrap()
    }

    fn leaf(c: &CpuId) -> (u32, u32) {
        let e = c.as_slice().iter().find(|e| e.function == FEATURES_LEAF).unwrap();
        (e.eax, e.edx)
    }

    #[test]
    fn each_feature_on_and_off() {
        for (name, bit) in FEATURES {
            for on in [true, false] {
                let r = PvRequest::parse(&format!("{name}={}", if on { "on" } else { "off" })).unwrap();
                let set = r.resolve(Some(ALL), false).unwrap();
                let mut c = cpuid(ALL);
                apply(&mut c, &set);
                let (eax, edx) = leaf(&c);
                if bit == 0 {
                    assert_eq!(edx & bits::HINTS_REALTIME != 0, on, "{name}");
                } else {
                    assert_eq!(eax & bit != 0, on, "{name}");
                }
                // Uncontrolled bits (clock sources, PV EOI) are untouched.
                assert_eq!(eax & !CONTROLLED_EAX, ALL & !CONTROLLED_EAX);
            }
        }
    }

    #[test]
    fn shared_default_is_kvms_set_without_pv_ipi() {
        let set = PvRequest::default().resolve(Some(ALL), false).unwrap();
        assert_eq!(set, PvSet::SHARED);
        assert_eq!(set.eax(), bits::STEAL_TIME | bits::PV_UNHALT | bits::PV_TLB_FLUSH | bits::POLL_CONTROL);
        assert_eq!(set.edx(), 0);
    }

    #[test]
    fn dedicated_default_sets_the_realtime_hint() {
        let set = PvRequest::default().resolve(Some(ALL), true).unwrap();
        assert_eq!(set, PvSet::DEDICATED);
        let mut c = cpuid(ALL);
        apply(&mut c, &set);
        let (eax, edx) = leaf(&c);
        assert_eq!(edx, bits::HINTS_REALTIME);
        assert_eq!(eax & (bits::STEAL_TIME | bits::PV_TLB_FLUSH | bits::PV_SEND_IPI), 0);
        assert_eq!(eax & (bits::POLL_CONTROL | bits::PV_UNHALT), bits::POLL_CONTROL | bits::PV_UNHALT);
    }

    #[test]
    fn presets_and_overrides() {
        let r = PvRequest::parse("dedicated,steal-time=on").unwrap();
        let set = r.resolve(Some(ALL), false).unwrap();
        assert_eq!(set, PvSet { steal_time: true, ..PvSet::DEDICATED });
        let r = PvRequest::parse("realtime=on").unwrap();
        assert_eq!(r.resolve(Some(ALL), false).unwrap(), PvSet { realtime: true, ..PvSet::SHARED });
    }

    #[test]
    fn unsupported_request_is_refused_default_dropped() {
        let no_poll = ALL & !bits::POLL_CONTROL;
        let e = PvRequest::parse("poll-control=on").unwrap().resolve(Some(no_poll), false).unwrap_err();
        assert_eq!(e, PvError::Unsupported("poll-control"));
        assert!(e.to_string().contains("poll-control"));
        let set = PvRequest::default().resolve(Some(no_poll), true).unwrap();
        assert!(!set.poll_control);
        // No PV leaf at all: nothing can be asked for, not even the hint.
        let e = PvRequest::parse("realtime=on").unwrap().resolve(None, true).unwrap_err();
        assert_eq!(e, PvError::Unsupported("realtime"));
        assert_eq!(PvRequest::default().resolve(None, true).unwrap(), PvSet::default());
    }

    #[test]
    fn bad_syntax_is_one_line() {
        for s in ["fast=on", "steal-time=yes", "steal-time", "turbo"] {
            let e = PvRequest::parse(s).unwrap_err().to_string();
            assert!(!e.contains('\n') && e.starts_with("--pv "), "{e}");
        }
    }

    #[test]
    fn resolved_request_round_trips() {
        let r = PvRequest::from_set(PvSet::DEDICATED);
        // Resolved on a destination whose vCPUs are not pinned, it stays the same.
        assert_eq!(r.resolve(Some(ALL), false).unwrap(), PvSet::DEDICATED);
        assert_eq!(PvRequest::parse(&PvSet::DEDICATED.describe()).unwrap(), r);
    }

    /// What this host's KVM offers in leaf 0x4000_0001, and a vCPU built with a chosen set
    /// reads it back through KVM_GET_CPUID2.
    #[test]
    fn kvm_vcpu_carries_the_chosen_leaf() {
        use crate::vm::{kvm_available, IrqchipMode, Vm};
        if !kvm_available() {
            eprintln!("skipping: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(1, 32 << 20, IrqchipMode::Kernel).unwrap();
        let supported = vm.kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES).unwrap();
        let Some(eax) = supported_eax(&supported) else {
            eprintln!("skipping: KVM offers no leaf 0x40000001");
            return;
        };
        let edx = supported.as_slice().iter().find(|e| e.function == FEATURES_LEAF).map_or(0, |e| e.edx);
        eprintln!("KVM_GET_SUPPORTED_CPUID 0x40000001: eax={eax:#x} edx={edx:#x}");
        let vcpu = vm.create_vcpu(0).unwrap();
        // Everything KVM supports of the controlled bits but the hanging PV IPI, plus the hint.
        let want = PvRequest { pv_ipi: Some(false), realtime: Some(true), ..Default::default() };
        let set = want.resolve(Some(eax), false).unwrap();
        let set = PvSet { steal_time: false, ..set };
        vcpu.configure(&vm.kvm, 1, None, &set).unwrap();
        let back = vcpu.cpuid().unwrap();
        let (got_eax, got_edx) = leaf(&back);
        assert_eq!(got_eax & CONTROLLED_EAX, set.eax());
        assert_eq!(got_eax & !CONTROLLED_EAX, eax & !CONTROLLED_EAX);
        assert_eq!(got_edx & bits::HINTS_REALTIME, bits::HINTS_REALTIME);
        assert_eq!(got_eax & (bits::STEAL_TIME | bits::PV_SEND_IPI), 0);
    }
}
