//! Snapshot and migration state restore: every component's `Persist` restore fed valid states
//! with arbitrary changes (a snapshot file or a migration peer supplies them), the whole
//! `Snapshot` document, and a stream header's VM description (`config_from_description`).
//!
//! A refused state must leave the component exactly as it was (`Persist::restore`'s
//! promise); an accepted one must leave it within its register semantics and working.

use std::sync::Arc;

use kumo_devices::apic::{IoApic, LocalApic, ManualClock, Pic};
use kumo_devices::Persist;
use kumo_migration::format::{SourceBackend, VmDescription};
use serde_json::{json, Value};

use super::apic::{check_lapic, check_pic};
use super::nic::rig;
use crate::json::{mutated_or_garbage, restore_json, save_json};
use crate::{CaseResult, Input};

/// Restores a mutated copy of `c`'s own state; checks the all-or-nothing promise and returns
/// whether it was taken.
fn restore_mutated<P: Persist>(u: &mut Input<'_>, c: &mut P) -> arbitrary::Result<bool> {
    let before = save_json(c);
    let v = mutated_or_garbage(u, &before)?;
    Ok(match restore_json(c, v) {
        Ok(()) => true,
        Err(e) => {
            assert!(save_json(c) == before, "refused restore ({e}) changed {}", c.id());
            false
        }
    })
}

fn lapic(u: &mut Input<'_>) -> CaseResult {
    let clock = Arc::new(ManualClock::new(1_000_000_000));
    let mut a = LocalApic::new(1, false, clock.clone());
    // A programmed APIC: enabled, a timer, some vectors in flight.
    a.write_mmio(0xF0, &0x1FFu32.to_le_bytes());
    a.write_mmio(0x320, &0x2_0040u32.to_le_bytes());
    a.write_mmio(0x380, &1000u32.to_le_bytes());
    a.accept(0x41, true);
    a.accept(0x52, false);
    a.ack();
    clock.advance(u.arbitrary::<u16>()? as u64);
    if restore_mutated(u, &mut a)? {
        check_lapic(&a.save().expect("saves"));
        a.ack();
        a.eoi();
        clock.advance(1 << 20);
        a.expire();
        let _ = a.next_deadline();
        let mut d = [0u8; 4];
        a.read_mmio(0x390, &mut d);
    }
    Ok(())
}

fn ioapic(u: &mut Input<'_>) -> CaseResult {
    let mut io = IoApic::new();
    io.write_mmio(0, &[0x12]);
    io.write_mmio(0x10, &0xA041u32.to_le_bytes());
    io.set_irq(1, true);
    if restore_mutated(u, &mut io)? {
        let s = io.state();
        for (pin, e) in s.redir.iter().enumerate() {
            assert!(e & (1 << 14) == 0 || e & (1 << 15) != 0, "pin {pin}: Remote IRR on an edge entry {e:#x}");
        }
        for pin in 0..24 {
            io.set_irq(pin, true);
        }
        io.eoi(0x41);
    }
    Ok(())
}

fn pic(u: &mut Input<'_>) -> CaseResult {
    let mut p = Pic::new();
    for (port, v) in [(0x20, 0x11), (0x21, 0x30), (0x21, 0x04), (0x21, 0x01), (0xA0, 0x11), (0xA1, 0x38)] {
        p.write_port(port, v);
    }
    p.pulse(3);
    if restore_mutated(u, &mut p)? {
        check_pic(&p);
        p.pulse(4);
        p.ack();
        p.write_port(0x21, 0);
    }
    Ok(())
}

/// A NIC state valid in one part and of another shape (or placement) in another: the check
/// of the second must come before the first is taken.
fn nic_shaped(u: &mut Input<'_>, valid: &Value) -> arbitrary::Result<Value> {
    let mut v = valid.clone();
    v["device"]["device"]["link_up"] = (!valid["device"]["device"]["link_up"].as_bool().unwrap_or(true)).into();
    v["device"]["config_generation"] = 7.into();
    match u.int_in_range(0..=4)? {
        0 => drop(v["msix"]["entries"].as_array_mut().and_then(|a| a.pop())),
        1 => drop(v["msix"]["pba"].as_array_mut().map(|a| a.push(0.into()))),
        2 => drop(v["device"]["queues"].as_array_mut().and_then(|a| a.pop())),
        3 => v["device"]["device"]["active_pairs"] = 0.into(),
        _ => {
            let a: u64 = if u.arbitrary()? { u.int_in_range(0..=0xffff_ffff)? } else { u.arbitrary()? };
            v["config"]["mapped"][0] = a.into();
        }
    }
    Ok(v)
}

/// The NIC's PCI function: config space, MSI-X, virtio transport and virtio-net state.
fn nic(u: &mut Input<'_>) -> CaseResult {
    let mut r = rig(if u.arbitrary()? { 1 } else { 2 });
    if u.arbitrary()? {
        let mut alloc = kumo_devices::pci::BarAllocator::new((0xc000_0000, 0x100_0000)).expect("allocator");
        alloc.place(kumo_devices::pci::PciDevice::config_mut(&mut r.f)).expect("placed");
        r.bring_up();
    }
    let before = save_json(&r.f);
    let v = if u.ratio(1, 4)? { nic_shaped(u, &before)? } else { mutated_or_garbage(u, &before)? };
    if let Err(e) = restore_json(&mut r.f, v) {
        assert!(save_json(&r.f) == before, "refused restore ({e}) changed the NIC");
        return Ok(());
    }
    let s = save_json(&r.f);
    let pairs = s["device"]["device"]["active_pairs"].as_u64().expect("active_pairs");
    assert!((1..=r.pairs as u64).contains(&pairs), "{pairs} active pairs restored on a NIC with {}", r.pairs);
    if let Some(a) = s["config"]["mapped"][0].as_u64() {
        assert!(a % super::nic::BAR_SIZE == 0 && a <= u32::MAX as u64, "BAR 0 (32-bit) placed at {a:#x}");
    }
    let mac = &s["device"]["device"]["config"]["mac"];
    assert!(mac[0].as_u64().is_some_and(|b| b & 1 == 0), "a multicast MAC {mac} restored");
    // It goes on working: the driver's accesses and the backend's frames.
    let t = r.f.device_mut();
    for off in [0x14u64, 0x1c, 0x16] {
        let mut d = [0u8; 2];
        t.bar_read(off, &mut d);
    }
    t.device_mut().backend_mut().inject(0, vec![0u8; 64]);
    t.device_mut().backend_ready(0);
    r.msix.lock().unwrap_or_else(|p| p.into_inner()).fire(1);
    Ok(())
}

/// A valid VM description as a stream header carries it.
fn description_seed(u: &mut Input<'_>) -> arbitrary::Result<Value> {
    let regions = |memory: u64| json!(kumo_vm::layout::ram_regions(memory));
    Ok(match u.int_in_range(0..=3)? {
        0 => json!({"cpus": 2, "memory_bytes": 67108864, "irqchip": "kernel", "page_size": 4096,
                    "regions": regions(67108864),
                    "payload": {"guest": {"name": "memtouch", "args": ["mb=4"]}}}),
        1 => json!({"cpus": 2, "memory_bytes": 536870912, "irqchip": "split", "page_size": 4096,
                    "regions": regions(536870912),
                    "payload": {"guest": {"name": "worker"}},
                    "numa": {"nodes": [{"id": 0, "cpus": [0], "memory": 268435456},
                                       {"id": 1, "cpus": [1], "memory": 268435456}],
                             "distances": [{"src": 0, "dst": 1, "value": 21}]}}),
        2 => json!({"cpus": 1, "memory_bytes": 134217728, "irqchip": "user", "page_size": 4096,
                    "regions": regions(134217728),
                    "payload": {"kernel": {"path": "/boot/vmlinuz", "cmdline": "console=ttyS0"}},
                    "nets": [{"mac": "52:54:00:12:34:56", "queues": 1, "source_backend": {"tap": "tap0"}},
                             {"mac": "52:54:00:12:34:57", "queues": 1, "irq": {"path": "dedicated", "vcpu": 0},
                              "source_backend": {"vhost_user": "/tmp/nb.sock"}}]}),
        _ => json!({"cpus": 4, "memory_bytes": 268435456, "irqchip": "kernel", "page_size": 4096,
                    "regions": regions(268435456),
                    "payload": {"guest": {"name": "smp"}}, "pv": {"steal_time": true}}),
    })
}

/// A stream header's description as the destination reads it: parsed and checked
/// (`read_header`), then turned into the VM it builds (`config_from_description`).
fn config(u: &mut Input<'_>) -> CaseResult {
    let seed = description_seed(u)?;
    let v = mutated_or_garbage(u, &seed)?;
    let Ok(d) = serde_json::from_value::<VmDescription>(v) else { return Ok(()) };
    if d.validate().is_err() {
        return Ok(());
    }
    // The destination's operator names a backend of the right kind for each NIC, so the NIC
    // checks behind the matching run too.
    let net = d
        .nets
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let (tap, vhost_user) = match &n.source_backend {
                SourceBackend::Tap(t) | SourceBackend::TapFds(t) => (Some(t.clone()), None),
                SourceBackend::VhostUser(p) => (None, Some(p.to_string_lossy().into_owned())),
            };
            kumo_api::NicBackend { id: format!("net{i}"), tap, vhost_user }
        })
        .collect();
    let ours = kumo_vmm::host_resources::HostResources { net, ..Default::default() };
    if let Ok(c) = kumo_vmm::migration::config_from_description(&d, &ours) {
        assert_eq!((c.cpus, c.memory), (d.cpus, d.memory_bytes));
        c.validate_shape().expect("an accepted config has a valid shape");
        // What the destination builds from it next must not panic either.
        let _ = c.validate_net();
        let _ = c.validate_numa();
        let _ = c.validate_elastic();
        let _ = c.numa_topology();
    }
    Ok(())
}

/// The whole VM state document of a snapshot file (its `State` record).
fn snapshot(u: &mut Input<'_>) -> CaseResult {
    let seed = json!({
        "vm": {"irqchips": [], "pit": null, "clock": {"clock": 5, "flags": 0, "pad0": 0, "realtime": 0,
                "host_tsc": 0, "pad": [0, 0, 0, 0]}},
        "vcpus": [],
        "devices": {"com1": {"serial": {"baud_divisor_low": 12, "baud_divisor_high": 0, "interrupt_enable": 0,
                    "interrupt_identification": 1, "line_control": 3, "line_status": 96, "modem_control": 8,
                    "modem_status": 176, "scratch": 0, "in_buffer": []}}},
        "paused": false
    });
    let v = mutated_or_garbage(u, &seed)?;
    let _ = serde_json::from_value::<kumo_vmm::Snapshot>(v);
    let bytes: Vec<u8> = u.arbitrary()?;
    let _ = serde_json::from_slice::<kumo_vmm::Snapshot>(&bytes);
    Ok(())
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    match u.int_in_range(0..=6)? {
        0 => lapic(u),
        1 => ioapic(u),
        2 => pic(u),
        3 => nic(u),
        4 => config(u),
        5 => {
            let mut root = kumo_devices::pci::PciRoot::new();
            restore_mutated(u, &mut root).map(|_| ())
        }
        _ => snapshot(u),
    }
}
