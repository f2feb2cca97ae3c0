//! End to end: `kumo run --pv …` (docs/pv-features.md). Bad specs are one-line errors with exit
//! status 1, found before any VM is built (no /dev/kvm needed); a good one boots `hello`.

mod common;

use common::*;

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

#[test]
fn hello_boots_with_a_chosen_pv_set() {
    if !kvm_or_skip("hello_boots_with_a_chosen_pv_set") {
        return;
    }
    for spec in ["dedicated", "shared,pv-ipi=off,realtime=on", "steal-time=off,tlb-flush=off"] {
        let o = kumo(&["run", "--guest", "hello", "--pv", spec]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "--pv {spec}: {out}\n{err}");
    }
}
