//! End to end: `kumo run --pv …` (docs/pv-features.md). Bad specs are one-line errors with exit
//! status 1, found before any VM is built (no /dev/kvm needed); with a good one `hello` prints
//! the leaf it sees.

use kumo_testkit::*;

#[test]
fn bad_pv_options_are_one_line_errors() {
    let cases: &[(&str, &str)] = &[
        ("turbo=on", "unknown feature `turbo`"),
        ("steal-time=yes", "`yes` for steal-time: expected on or off"),
        ("steal-time", "neither a preset"),
        ("", "neither a preset"),
    ];
    for (spec, want) in cases {
        let o = kumo(&["run", "--guest", "hello", "--pv", spec]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "--pv {spec}: {err}");
        assert!(err.contains(want), "--pv {spec}: want `{want}` in:\n{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "--pv {spec}: not one line:\n{err}");
    }
    // Nothing to boot: --pv shapes a VM, so it is refused like --numa.
    let (_, err) = text(&kumo(&["run", "--pv", "dedicated"]));
    assert!(err.contains("--pv given, but nothing to boot"), "{err}");
}

/// `hello` prints CPUID leaf 0x40000001 as the guest sees it ("hello: kvm_pv eax=… edx=…").
fn guest_leaf(spec: &str) -> (u32, u32) {
    let o = kumo(&["run", "--guest", "hello", "--pv", spec]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "--pv {spec}: {out}\n{err}");
    let line = out.lines().find_map(|l| l.strip_prefix("hello: kvm_pv ")).unwrap_or_else(|| panic!("{out}"));
    let field = |k: &str| {
        let v = line.split(' ').find_map(|f| f.strip_prefix(k)).unwrap_or_else(|| panic!("{line}"));
        u32::from_str_radix(v, 16).unwrap()
    };
    (field("eax="), field("edx="))
}

const STEAL_TIME: u32 = 1 << 5;
const PV_UNHALT: u32 = 1 << 7;
const PV_TLB_FLUSH: u32 = 1 << 9;
const PV_SEND_IPI: u32 = 1 << 11;
const POLL_CONTROL: u32 = 1 << 12;
const CONTROLLED: u32 = STEAL_TIME | PV_UNHALT | PV_TLB_FLUSH | PV_SEND_IPI | POLL_CONTROL;

#[test]
fn the_guest_sees_the_chosen_pv_leaf() {
    if !kvm_or_skip("the_guest_sees_the_chosen_pv_leaf") {
        return;
    }
    // Defaults KVM lacks are dropped; the cases below ask only for defaults.
    let kvm = kumo_vm::vm::open_kvm().unwrap();
    let Some(sup) = kumo_vm::pv::host_supported_eax(&kvm).unwrap() else {
        eprintln!("skipping the_guest_sees_the_chosen_pv_leaf: KVM has no leaf 0x40000001");
        return;
    };
    let (eax, edx) = guest_leaf("dedicated");
    assert_eq!((eax & CONTROLLED, edx), ((PV_UNHALT | POLL_CONTROL) & sup, 1), "{eax:#x}");
    let (eax, edx) = guest_leaf("shared");
    assert_eq!((eax & CONTROLLED, edx), ((STEAL_TIME | PV_UNHALT | PV_TLB_FLUSH | POLL_CONTROL) & sup, 0), "{eax:#x}");
    let (eax, edx) = guest_leaf("shared,realtime=on,steal-time=off,poll-control=off");
    assert_eq!((eax & CONTROLLED, edx), ((PV_UNHALT | PV_TLB_FLUSH) & sup, 1), "{eax:#x}");
}

/// `--pv pv-ipi=on` is checked with a probe VM first: where KVM's PV IPI hypercall hangs the
/// vCPU (this project's nested KVM) the VM is refused with one line instead of hanging; where
/// it works the guest runs and sees the bit.
#[test]
fn pv_ipi_is_probed_before_a_guest_may_use_it() {
    if !kvm_or_skip("pv_ipi_is_probed_before_a_guest_may_use_it") {
        return;
    }
    let o = kumo(&["run", "--guest", "hello", "--pv", "pv-ipi=on"]);
    let (out, err) = text(&o);
    match o.status.code() {
        Some(0) => assert!(out.contains("hello: kvm_pv"), "{out}"),
        _ => {
            assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
            assert!(err.contains("--pv pv-ipi=on: this host's KVM advertises PV IPI but"), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        }
    }
}
