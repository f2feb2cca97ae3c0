//! The local APIC's register semantics, without KVM and without real time: the clock is a
//! [`ManualClock`] the tests move.

use std::sync::Arc;

use super::*;
use crate::persist::Persist;

const GHZ: u64 = 1_000_000_000;
/// Tests start the clock here, not at 0, so elapsed times can be subtracted.
const T0: u64 = 1_000_000_000;

const ID: u64 = 0x20;
const TPR: u64 = 0x80;
const PPR: u64 = 0xA0;
const EOI: u64 = 0xB0;
const LDR: u64 = 0xD0;
const DFR: u64 = 0xE0;
const SVR: u64 = 0xF0;
const ISR0: u64 = 0x100;
const TMR0: u64 = 0x180;
const IRR0: u64 = 0x200;
const ESR: u64 = 0x280;
const ICR_LOW: u64 = 0x300;
const ICR_HIGH: u64 = 0x310;
const LVT_TIMER: u64 = 0x320;
const LVT_LINT0: u64 = 0x350;
const LVT_LINT1: u64 = 0x360;
const LVT_ERROR: u64 = 0x370;
const INITIAL: u64 = 0x380;
const CURRENT: u64 = 0x390;
const DIVIDE: u64 = 0x3E0;

const ONE_SHOT: u32 = 0;
const PERIODIC: u32 = 1 << 17;
const TSC_DEADLINE: u32 = 2 << 17;
const MASKED: u32 = 1 << 16;
/// Divide configuration for divide by 1.
const DIV1: u32 = 0b1011;

fn clock(tsc_hz: u64) -> Arc<ManualClock> {
    let c = Arc::new(ManualClock::new(tsc_hz));
    c.set(T0);
    c
}

/// A software-enabled xAPIC with id `id` (vCPU 0 is the BSP) and its clock (1 GHz TSC).
fn apic(id: u32) -> (LocalApic, Arc<ManualClock>) {
    let c = clock(GHZ);
    let mut a = LocalApic::new(id, id == 0, c.clone());
    w(&mut a, SVR, 0x1FF);
    (a, c)
}

fn x2apic(id: u32) -> (LocalApic, Arc<ManualClock>) {
    let (mut a, c) = apic(id);
    let base = a.read_msr(APIC_BASE_MSR).unwrap();
    assert_eq!(a.write_msr(APIC_BASE_MSR, base | BASE_X2APIC), Ok(Some(ApicEvent::BaseChanged)));
    (a, c)
}

fn w(a: &mut LocalApic, off: u64, v: u32) -> Option<ApicEvent> {
    a.write_mmio(off, &v.to_le_bytes())
}

fn r(a: &mut LocalApic, off: u64) -> u32 {
    let mut b = [0u8; 4];
    a.read_mmio(off, &mut b);
    u32::from_le_bytes(b)
}

fn msr(off: u64) -> u32 {
    X2APIC_MSR_FIRST + (off as u32 >> 4)
}

/// Sends `icr_low` to xAPIC destination `dest` and returns the IPI.
fn send(a: &mut LocalApic, dest: u8, icr_low: u32) -> Option<Ipi> {
    w(a, ICR_HIGH, (dest as u32) << 24);
    match w(a, ICR_LOW, icr_low) {
        Some(ApicEvent::Ipi(i)) => Some(i),
        None => None,
        other => panic!("ICR write gave {other:?}"),
    }
}

#[test]
fn vector_sets_order_by_vector_and_map_to_registers() {
    let mut s = VectorSet::default();
    assert_eq!(s.highest(), None);
    for v in [0x21, 0xFF, 0x40, 0x7F] {
        s.set(v);
    }
    assert_eq!(s.highest(), Some(0xFF));
    s.clear(0xFF);
    assert_eq!(s.highest(), Some(0x7F));
    assert_eq!(s.word(1), 1 << 1);
    assert_eq!(s.word(2), 1);
    assert_eq!(s.word(3), 1 << 31);
    assert!(s.contains(0x40) && !s.contains(0x41));
}

#[test]
fn reset_state() {
    let c = clock(GHZ);
    let mut bsp = LocalApic::new(0, true, c.clone());
    let mut ap = LocalApic::new(3, false, c);
    assert_eq!(bsp.read_msr(APIC_BASE_MSR).unwrap(), 0xFEE0_0000 | BASE_ENABLE | BASE_BSP);
    assert_eq!(ap.read_msr(APIC_BASE_MSR).unwrap(), 0xFEE0_0000 | BASE_ENABLE);
    assert_eq!(ap.mmio_base(), Some(DEFAULT_APIC_BASE));
    assert_eq!(r(&mut ap, ID), 3 << 24);
    assert_eq!(r(&mut ap, 0x30), 0x0005_0014);
    assert_eq!(r(&mut ap, SVR), 0xFF);
    assert_eq!(r(&mut ap, DFR), u32::MAX);
    for off in [LVT_TIMER, 0x330, 0x340, LVT_LINT0, LVT_LINT1, LVT_ERROR] {
        assert_eq!(r(&mut ap, off), MASKED, "{off:#x}");
    }
    // Virtual wire on the BSP: the PIC reaches it before the guest programs the APIC.
    assert_eq!(r(&mut bsp, LVT_LINT0), 0x700);
    assert_eq!(bsp.fire_lvt(Lvt::Lint0), Delivery::ExtInt);
    // Software-disabled: fixed interrupts are refused.
    assert!(!ap.accept(0x30, false));
    assert_eq!(ap.pending_vector(), None);
}

#[test]
fn irr_isr_priority_order_and_nested_interrupts() {
    let (mut a, _) = apic(1);
    for v in [0x30, 0x50, 0x41] {
        assert!(a.accept(v, false));
    }
    assert_eq!(a.pending_vector(), Some(0x50));
    assert_eq!(a.ack(), Some(0x50));
    assert_eq!(r(&mut a, ISR0 + 0x20), 1 << 16);
    assert_eq!(r(&mut a, IRR0 + 0x20), 1 << 1);
    assert_eq!(r(&mut a, PPR), 0x50);
    // 0x41 is in a lower class than 0x50 in service: it waits.
    assert_eq!(a.pending_vector(), None);
    assert_eq!(a.ack(), None);
    // A higher class nests.
    a.accept(0x61, false);
    assert_eq!(a.ack(), Some(0x61));
    assert_eq!(r(&mut a, PPR), 0x60);
    // The same class as one in service does not nest.
    a.accept(0x6F, false);
    assert_eq!(a.pending_vector(), None);
    // EOI ends the highest in service, 0x61: 0x6F may come.
    assert_eq!(w(&mut a, EOI, 0), None);
    assert_eq!(a.ack(), Some(0x6F));
    w(&mut a, EOI, 0);
    assert_eq!(r(&mut a, PPR), 0x50);
    w(&mut a, EOI, 0);
    assert_eq!(r(&mut a, PPR), 0);
    assert_eq!(a.ack(), Some(0x41));
    w(&mut a, EOI, 0);
    assert_eq!(a.ack(), Some(0x30));
    w(&mut a, EOI, 0);
    assert_eq!(a.pending_vector(), None);
    // An EOI with nothing in service does nothing.
    assert_eq!(w(&mut a, EOI, 0), None);
    assert_eq!(r(&mut a, ISR0 + 0x30), 0);
}

#[test]
fn tpr_masks_by_priority_class() {
    let (mut a, _) = apic(1);
    w(&mut a, TPR, 0x45);
    a.accept(0x4F, false);
    assert_eq!(a.pending_vector(), None, "same class as TPR");
    assert_eq!(r(&mut a, PPR), 0x45);
    a.accept(0x50, false);
    assert_eq!(a.pending_vector(), Some(0x50));
    a.ack();
    // PPR is the in-service class when above TPR, TPR otherwise.
    assert_eq!(r(&mut a, PPR), 0x50);
    w(&mut a, TPR, 0x80);
    assert_eq!(r(&mut a, PPR), 0x80);
    // CR8 is TPR[7:4].
    assert_eq!(a.cr8(), 8);
    a.set_cr8(3);
    assert_eq!(r(&mut a, TPR), 0x30);
    w(&mut a, EOI, 0);
    assert_eq!(a.ack(), Some(0x4F));
}

#[test]
fn eoi_reports_level_triggered_vectors_for_the_ioapic() {
    let (mut a, _) = apic(1);
    a.accept(0x38, true);
    a.accept(0x39, false);
    assert_eq!(r(&mut a, TMR0 + 0x10), 1 << 24);
    assert_eq!(a.ack(), Some(0x39));
    assert_eq!(a.eoi(), None, "edge");
    assert_eq!(a.ack(), Some(0x38));
    assert_eq!(w(&mut a, EOI, 0), Some(ApicEvent::LevelEoi(0x38)));
    // The same vector edge-triggered later clears its TMR bit.
    a.accept(0x38, false);
    assert_eq!(r(&mut a, TMR0 + 0x10), 0);

    let (mut x, _) = x2apic(2);
    x.accept(0x90, true);
    x.ack();
    assert_eq!(x.write_msr(msr(EOI), 0), Ok(Some(ApicEvent::LevelEoi(0x90))));
}

#[test]
fn software_disable_masks_the_lvt() {
    let (mut a, _) = apic(1);
    w(&mut a, LVT_LINT1, 0x400);
    assert_eq!(a.fire_lvt(Lvt::Lint1), Delivery::Nmi);
    w(&mut a, SVR, 0xFF);
    assert_eq!(r(&mut a, LVT_LINT1), 0x400 | MASKED);
    w(&mut a, LVT_LINT1, 0x400);
    assert_eq!(r(&mut a, LVT_LINT1), 0x400 | MASKED, "stays masked while disabled");
    assert_eq!(a.fire_lvt(Lvt::Lint1), Delivery::Dropped);
    assert!(!a.accept(0x40, false));
    w(&mut a, SVR, 0x1FF);
    w(&mut a, LVT_LINT1, 0x400);
    assert_eq!(r(&mut a, LVT_LINT1), 0x400);
    // Spurious vector register keeps vector, enable and focus bits only.
    w(&mut a, SVR, 0xFFFF_FFFF);
    assert_eq!(r(&mut a, SVR), 0x3FF);
}

#[test]
fn lvt_entries_deliver_by_their_mode() {
    let (mut a, _) = apic(1);
    w(&mut a, LVT_LINT0, 0x8000 | 0x33); // fixed, level
    assert_eq!(a.fire_lvt(Lvt::Lint0), Delivery::Accepted);
    assert_eq!(r(&mut a, TMR0 + 0x10), 1 << 19);
    w(&mut a, LVT_LINT0, 0x700);
    assert_eq!(a.fire_lvt(Lvt::Lint0), Delivery::ExtInt);
    w(&mut a, LVT_LINT0, 0x700 | MASKED);
    assert_eq!(a.fire_lvt(Lvt::Lint0), Delivery::Dropped);
    // Read-only bits (delivery status, remote IRR) read 0.
    w(&mut a, LVT_LINT1, 0xFFFF_FFFF);
    assert_eq!(r(&mut a, LVT_LINT1), 0x0001_A7FF);
    // A hardware-disabled APIC passes LINT0 and LINT1 through as INTR and NMI.
    let (mut d, _) = apic(2);
    d.write_msr(APIC_BASE_MSR, DEFAULT_APIC_BASE).unwrap();
    assert_eq!(d.fire_lvt(Lvt::Lint0), Delivery::ExtInt);
    assert_eq!(d.fire_lvt(Lvt::Lint1), Delivery::Nmi);
}

#[test]
fn icr_semantics_per_delivery_mode_and_shorthand() {
    let (mut a, _) = apic(1);
    let ipi = |mode, vector, level_triggered, dest| Ipi { mode, vector, level_triggered, dest, source: 1 };
    use DeliveryMode::*;
    use DestMode::*;
    let cases: &[(u8, u32, Option<Ipi>)] = &[
        (2, 0x0000_0031, Some(ipi(Fixed, 0x31, false, Destination::Field(2, Physical)))),
        (0x0C, 0x0000_0831, Some(ipi(Fixed, 0x31, false, Destination::Field(0x0C, Logical)))),
        (3, 0x0000_0141, Some(ipi(LowestPriority, 0x41, false, Destination::Field(3, Physical)))),
        (3, 0x0000_0400, Some(ipi(Nmi, 0, false, Destination::Field(3, Physical)))),
        (3, 0x0000_C500, Some(ipi(Init, 0, true, Destination::Field(3, Physical)))),
        // INIT level de-assert: nothing on current CPUs.
        (3, 0x0000_8500, None),
        (3, 0x0000_069A, Some(ipi(Startup, 0x9A, false, Destination::Field(3, Physical)))),
        (9, 0x0004_0051, Some(ipi(Fixed, 0x51, false, Destination::SelfOnly))),
        (9, 0x0008_0052, Some(ipi(Fixed, 0x52, false, Destination::AllIncludingSelf))),
        (9, 0x000C_4500, Some(ipi(Init, 0, false, Destination::AllExcludingSelf))),
        (9, 0x000C_0600, Some(ipi(Startup, 0, false, Destination::AllExcludingSelf))),
    ];
    for (dest, low, want) in cases {
        assert_eq!(send(&mut a, *dest, *low), *want, "ICR {dest:#x}:{low:#x}");
    }
    // The ICR reads back what was written, delivery status 0 (sent at once).
    send(&mut a, 7, 0xFFFF_FFFF);
    assert_eq!(r(&mut a, ICR_LOW), 0x000C_CFFF);
    assert_eq!(r(&mut a, ICR_HIGH), 7 << 24);

    // x2APIC: one 64-bit write, a 32-bit destination.
    let (mut x, _) = x2apic(1);
    let e = x.write_msr(0x830, (0x1_0002u64 << 32) | 0x0831).unwrap();
    assert_eq!(e, Some(ApicEvent::Ipi(ipi(Fixed, 0x31, false, Destination::Field(0x1_0002, Logical)))));
    assert_eq!(x.read_msr(0x830), Ok((0x1_0002u64 << 32) | 0x0831));
}

#[test]
fn ipis_reach_their_targets() {
    let c = clock(GHZ);
    let mut apics: Vec<LocalApic> = (0..4).map(|i| LocalApic::new(i, i == 0, c.clone())).collect();
    for a in &mut apics {
        w(a, SVR, 0x1FF);
    }
    let addrs: Vec<ApicAddress> = apics.iter().map(|a| a.address()).collect();
    let ipi = |mode, vector, dest| Ipi { mode, vector, level_triggered: false, dest, source: 1 };
    let fixed = |dest| ipi(DeliveryMode::Fixed, 0x40, dest);
    assert_eq!(fixed(Destination::SelfOnly).targets(&addrs), vec![1]);
    assert_eq!(fixed(Destination::AllIncludingSelf).targets(&addrs), vec![0, 1, 2, 3]);
    assert_eq!(fixed(Destination::AllExcludingSelf).targets(&addrs), vec![0, 2, 3]);
    assert_eq!(fixed(Destination::Field(2, DestMode::Physical)).targets(&addrs), vec![2]);
    assert_eq!(fixed(Destination::Field(0xFF, DestMode::Physical)).targets(&addrs), vec![0, 1, 2, 3]);
    // A destination no APIC has reaches no one.
    assert!(fixed(Destination::Field(9, DestMode::Physical)).targets(&addrs).is_empty());
    assert!(fixed(Destination::Field(0, DestMode::Logical)).targets(&addrs).is_empty());
    // Lowest priority: the lowest-numbered match only.
    let lp = ipi(DeliveryMode::LowestPriority, 0x40, Destination::Field(0xFF, DestMode::Physical));
    assert_eq!(lp.targets(&addrs), vec![0]);

    // What delivery does on the target.
    let t = &mut apics[2];
    assert_eq!(t.deliver(&fixed(Destination::SelfOnly)), Delivery::Accepted);
    assert_eq!(t.pending_vector(), Some(0x40));
    assert_eq!(t.deliver(&ipi(DeliveryMode::Nmi, 0, Destination::SelfOnly)), Delivery::Nmi);
    assert_eq!(t.deliver(&ipi(DeliveryMode::Startup, 0x9A, Destination::SelfOnly)), Delivery::Startup(0x9A));
    assert_eq!(t.deliver(&ipi(DeliveryMode::Init, 0, Destination::SelfOnly)), Delivery::Init);
    // INIT resets the registers (the APIC is software-disabled again, IRR empty), not the id.
    assert_eq!(t.pending_vector(), None);
    assert_eq!(r(t, SVR), 0xFF);
    assert_eq!(r(t, ID), 2 << 24);
}

#[test]
fn destination_matching_table() {
    let xa =
        |id: u32, ldr: u32, dfr: u32| ApicAddress { apic_id: id, dest_id: id, ldr, dfr, x2apic: false, enabled: true };
    let flat = xa(1, 0x0400_0000, u32::MAX); // logical id bit 2
    let cluster = xa(2, 0x3200_0000, 0x0FFF_FFFF); // cluster 3, member bit 1
    let x2 = ApicAddress { apic_id: 0x23, dest_id: 0x23, ldr: 0x0002_0008, dfr: 0, x2apic: true, enabled: true };
    use DestMode::*;
    let table: &[(&ApicAddress, u32, DestMode, bool)] = &[
        (&flat, 1, Physical, true),
        (&flat, 2, Physical, false),
        (&flat, 0x101, Physical, true), // xAPIC destinations are 8 bits
        (&flat, 0xFF, Physical, true),
        (&flat, 0x04, Logical, true),
        (&flat, 0x0C, Logical, true),
        (&flat, 0x03, Logical, false),
        (&flat, 0xFF, Logical, true),
        (&cluster, 0x32, Logical, true),
        (&cluster, 0x3F, Logical, true),
        (&cluster, 0x31, Logical, false),
        (&cluster, 0x22, Logical, false),
        (&cluster, 0xFF, Logical, true),
        (&x2, 0x23, Physical, true),
        (&x2, 0x24, Physical, false),
        (&x2, 0xFF, Physical, false), // 0xFF is an id in x2APIC mode
        (&x2, u32::MAX, Physical, true),
        (&x2, 0x0002_0008, Logical, true),
        (&x2, 0x0002_000F, Logical, true),
        (&x2, 0x0002_0007, Logical, false),
        (&x2, 0x0001_0008, Logical, false),
        (&x2, u32::MAX, Logical, true),
    ];
    for (a, dest, mode, want) in table {
        assert_eq!(matches(a, *dest, *mode), *want, "{a:?} {dest:#x} {mode:?}");
    }
    let off = ApicAddress { enabled: false, ..flat };
    assert!(!matches(&off, 0xFF, Physical));

    // The APIC's own view: LDR and DFR as the guest wrote them; x2APIC derives its LDR.
    let (mut a, _) = apic(1);
    w(&mut a, LDR, 0x0412_3456);
    w(&mut a, DFR, 0x0000_0000);
    assert_eq!(r(&mut a, LDR), 0x0400_0000);
    assert_eq!(r(&mut a, DFR), 0x0FFF_FFFF);
    assert!(matches(&a.address(), 0x04, Logical));
    let (x, _) = x2apic(0x23);
    assert_eq!(x.address().ldr, 0x0002_0008);
}

#[test]
fn one_shot_timer_with_each_divisor() {
    let want =
        [(0b0000, 2), (0b0001, 4), (0b0010, 8), (0b0011, 16), (0b1000, 32), (0b1001, 64), (0b1010, 128), (0b1011, 1)];
    for (reg, div) in want {
        assert_eq!(divisor(reg), div);
        let (mut a, c) = apic(1);
        w(&mut a, DIVIDE, reg);
        assert_eq!(r(&mut a, DIVIDE), reg);
        assert_eq!(w(&mut a, LVT_TIMER, ONE_SHOT | 0x40), Some(ApicEvent::TimerChanged));
        assert_eq!(a.next_deadline(), None);
        assert_eq!(w(&mut a, INITIAL, 1000), Some(ApicEvent::TimerChanged));
        assert_eq!(a.next_deadline(), Some(T0 + 1000 * div));
        c.advance(250 * div);
        assert_eq!(r(&mut a, CURRENT), 750, "divide {reg:#b}");
        assert!(!a.expire(), "early");
        c.set(T0 + 1000 * div);
        assert!(a.expire());
        assert_eq!(a.ack(), Some(0x40));
        assert_eq!(r(&mut a, CURRENT), 0);
        assert_eq!(a.next_deadline(), None, "one-shot stops");
        assert!(!a.expire());
        assert_eq!(r(&mut a, INITIAL), 1000);
    }
}

#[test]
fn periodic_timer_over_several_periods() {
    let (mut a, c) = apic(1);
    w(&mut a, DIVIDE, DIV1);
    w(&mut a, LVT_TIMER, PERIODIC | 0x41);
    let p = 1_000_000; // 1 ms at divide by 1
    w(&mut a, INITIAL, p as u32);
    for k in 1..=5 {
        assert_eq!(a.next_deadline(), Some(T0 + k * p));
        c.set(T0 + k * p - 1);
        assert!(!a.expire());
        c.set(T0 + k * p + 10);
        assert!(a.expire(), "period {k}");
        assert_eq!(a.ack(), Some(0x41));
        a.eoi();
        assert_eq!(r(&mut a, CURRENT), (p - 10) as u32);
    }
    // The host was late by 2.5 periods: one interrupt, and the timer keeps its phase.
    c.set(T0 + 8 * p + p / 2);
    assert!(a.expire());
    assert_eq!(a.next_deadline(), Some(T0 + 9 * p));
    assert_eq!(r(&mut a, CURRENT), (p / 2) as u32);
    // Writing 0 stops it.
    w(&mut a, INITIAL, 0);
    assert_eq!(a.next_deadline(), None);
}

#[test]
fn periodic_timer_has_a_minimum_period() {
    let (mut a, _) = apic(1);
    w(&mut a, DIVIDE, DIV1);
    w(&mut a, LVT_TIMER, PERIODIC | 0x41);
    w(&mut a, INITIAL, 10);
    assert_eq!(a.next_deadline(), Some(T0 + MIN_PERIOD_NS));
}

#[test]
fn masked_timer_counts_without_raising() {
    let (mut a, c) = apic(1);
    w(&mut a, LVT_TIMER, ONE_SHOT | MASKED | 0x40);
    w(&mut a, DIVIDE, DIV1);
    w(&mut a, INITIAL, 100);
    c.advance(100);
    assert!(!a.expire());
    assert_eq!(a.pending_vector(), None);
    assert_eq!(a.next_deadline(), None, "expired while masked");
    // An illegal timer vector is refused with ESR bit 6.
    w(&mut a, LVT_TIMER, ONE_SHOT | 0x05);
    w(&mut a, INITIAL, 100);
    c.advance(100);
    assert!(!a.expire());
    w(&mut a, ESR, 0);
    assert_eq!(r(&mut a, ESR), ESR_RECEIVE_ILLEGAL_VECTOR);
}

#[test]
fn divide_change_mid_count_keeps_the_count() {
    let (mut a, c) = apic(1);
    w(&mut a, LVT_TIMER, ONE_SHOT | 0x40);
    w(&mut a, DIVIDE, DIV1);
    w(&mut a, INITIAL, 1000);
    c.advance(400);
    w(&mut a, DIVIDE, 0b0000); // by 2
    assert_eq!(r(&mut a, CURRENT), 600);
    c.advance(200);
    assert_eq!(r(&mut a, CURRENT), 500);
    assert_eq!(a.next_deadline(), Some(c.now_ns() + 1000));
}

#[test]
fn tsc_deadline_timer() {
    // A 2 GHz TSC: 2 ticks a ns.
    let c = clock(2 * GHZ);
    let mut a = LocalApic::new(1, false, c.clone());
    w(&mut a, SVR, 0x1FF);
    // Outside TSC-deadline mode the MSR is ignored.
    assert_eq!(a.write_msr(TSC_DEADLINE_MSR, 5), Ok(None));
    assert_eq!(a.read_msr(TSC_DEADLINE_MSR), Ok(0));
    w(&mut a, LVT_TIMER, TSC_DEADLINE | 0x42);
    w(&mut a, INITIAL, 1000);
    assert_eq!(r(&mut a, INITIAL), 0, "the initial count is ignored");
    assert_eq!(a.next_deadline(), None);
    let tsc = c.tsc();
    assert_eq!(a.write_msr(TSC_DEADLINE_MSR, tsc + 2000), Ok(Some(ApicEvent::TimerChanged)));
    assert_eq!(a.read_msr(TSC_DEADLINE_MSR), Ok(tsc + 2000));
    assert_eq!(a.next_deadline(), Some(T0 + 1000));
    assert_eq!(r(&mut a, CURRENT), 0);
    c.advance(999);
    assert!(!a.expire());
    c.advance(1);
    assert!(a.expire());
    assert_eq!(a.ack(), Some(0x42));
    assert_eq!(a.read_msr(TSC_DEADLINE_MSR), Ok(0), "disarmed once fired");
    assert_eq!(a.next_deadline(), None);
    // A deadline already past fires at once; 0 disarms.
    a.write_msr(TSC_DEADLINE_MSR, 1).unwrap();
    assert_eq!(a.next_deadline(), Some(c.now_ns()));
    a.write_msr(TSC_DEADLINE_MSR, 0).unwrap();
    assert_eq!(a.next_deadline(), None);
    // Leaving the mode stops the timer.
    a.write_msr(TSC_DEADLINE_MSR, c.tsc() + 10).unwrap();
    w(&mut a, LVT_TIMER, ONE_SHOT | 0x42);
    assert_eq!(a.next_deadline(), None);
}

#[test]
fn xapic_and_x2apic_views_of_the_same_registers() {
    let (mut a, _) = apic(5);
    w(&mut a, TPR, 0x20);
    w(&mut a, LVT_LINT0, 0x10033);
    a.accept(0xE1, false);
    a.ack();
    a.accept(0x70, true);
    let base = a.read_msr(APIC_BASE_MSR).unwrap();
    // x2APIC MSRs are refused in xAPIC mode.
    assert!(a.read_msr(msr(TPR)).is_err());
    a.write_msr(APIC_BASE_MSR, base | BASE_X2APIC).unwrap();
    assert_eq!(a.mode(), ApicMode::X2Apic);
    assert_eq!(a.mmio_base(), None);
    assert_eq!(a.read_msr(0x808), Ok(0x20));
    assert_eq!(a.read_msr(0x835), Ok(0x10033));
    assert_eq!(a.read_msr(0x817), Ok(1 << 1), "ISR word 7 holds 0xE1");
    assert_eq!(a.read_msr(0x823), Ok(1 << 16), "IRR word 3 holds 0x70");
    assert_eq!(a.read_msr(0x81B), Ok(1 << 16), "TMR word 3");
    assert_eq!(a.read_msr(0x802), Ok(5), "x2APIC id: 32 bits, not shifted");
    assert_eq!(a.read_msr(0x80D), Ok(0x20), "LDR: cluster 0, bit 5");
    assert_eq!(a.read_msr(0x803), Ok(0x0005_0014));
    assert_eq!(a.read_msr(0x80A), Ok(0xE0), "PPR");
    a.write_msr(0x808, 0xF0).unwrap();
    assert_eq!(a.read_msr(0x80A), Ok(0xF0));
    // SELF IPI (x2APIC only) lands in this APIC's IRR.
    a.write_msr(0x808, 0).unwrap();
    a.write_msr(0x80B, 0).unwrap();
    assert_eq!(a.write_msr(0x83F, 0x99), Ok(None));
    assert_eq!(a.ack(), Some(0x99));
    // The xAPIC page is off in x2APIC mode: reads 0, writes ignored.
    assert_eq!(r(&mut a, TPR), 0);
    assert_eq!(w(&mut a, TPR, 0x70), None);
    assert_eq!(a.read_msr(0x808), Ok(0));
    assert!(a.has_logged(Oddity::MmioWhileOff));
}

#[test]
fn apic_base_transitions() {
    let (mut a, _) = apic(1);
    let b = DEFAULT_APIC_BASE;
    assert_eq!(a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE), Ok(None));
    // Relocating the page.
    assert_eq!(a.write_msr(APIC_BASE_MSR, 0xFED0_0000 | BASE_ENABLE), Ok(Some(ApicEvent::BaseChanged)));
    assert_eq!(a.mmio_base(), Some(0xFED0_0000));
    a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE).unwrap();
    a.accept(0x40, false);
    // Refused, nothing changed: reserved bits, EXTD without EN, disabled → x2APIC, x2APIC → xAPIC.
    for bad in [b | BASE_ENABLE | 1, b | BASE_ENABLE | (1 << 9), b | BASE_X2APIC, b | BASE_ENABLE | (1 << 63)] {
        assert!(a.write_msr(APIC_BASE_MSR, bad).is_err(), "{bad:#x}");
    }
    a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE | BASE_X2APIC).unwrap();
    assert!(a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE).is_err());
    assert_eq!(a.mode(), ApicMode::X2Apic);
    assert_eq!(a.pending_vector(), Some(0x40));
    // Disabling loses the state; then xAPIC again, not x2APIC.
    a.write_msr(APIC_BASE_MSR, b).unwrap();
    assert_eq!(a.mode(), ApicMode::Disabled);
    assert!(a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE | BASE_X2APIC).is_err());
    a.write_msr(APIC_BASE_MSR, b | BASE_ENABLE).unwrap();
    assert_eq!(r(&mut a, SVR), 0xFF);
    assert_eq!(r(&mut a, IRR0 + 0x20), 0);
    assert!(a.read_msr(0x10).is_err(), "not an APIC MSR");
}

#[test]
fn bad_input_reserved_delivery_modes_and_illegal_vectors() {
    let (mut a, _) = apic(1);
    // Reserved delivery modes and SMI: dropped, logged once.
    assert_eq!(send(&mut a, 2, 0x0000_0331), None);
    assert_eq!(send(&mut a, 2, 0x0000_0731), None);
    assert!(a.has_logged(Oddity::ReservedDeliveryMode));
    assert_eq!(send(&mut a, 2, 0x0000_0231), None);
    assert!(a.has_logged(Oddity::Smi));
    // A fixed IPI with vector 0–15: not sent, ESR "send illegal vector" once the ESR is
    // written (errors latch on the write, as hardware does), and the LVT error vector raised.
    w(&mut a, LVT_ERROR, 0xEE);
    assert_eq!(send(&mut a, 2, 0x0000_0005), None);
    assert_eq!(r(&mut a, ESR), 0);
    w(&mut a, ESR, 0);
    assert_eq!(r(&mut a, ESR), ESR_SEND_ILLEGAL_VECTOR);
    assert_eq!(a.ack(), Some(0xEE));
    // NMI, INIT, SIPI have no vector to check.
    assert!(send(&mut a, 2, 0x0000_0400).is_some());
    // Received illegal vector.
    assert!(!a.accept(3, false));
    w(&mut a, ESR, 0);
    assert_eq!(r(&mut a, ESR), ESR_RECEIVE_ILLEGAL_VECTOR);
    w(&mut a, ESR, 0);
    assert_eq!(r(&mut a, ESR), 0, "cleared by the next write");
    // A bad LVT: a mode the entry does not have (NMI is fine; ExtINT on the timer's… thermal
    // entry is not) is dropped and logged once.
    w(&mut a, 0x330, 0x700 | 0x40);
    assert_eq!(a.fire_lvt(Lvt::Thermal), Delivery::Dropped);
    assert!(a.has_logged(Oddity::BadLvt));
    w(&mut a, LVT_TIMER, (3 << 17) | 0x40);
    assert!(a.has_logged(Oddity::ReservedTimerMode));
    // x2APIC SELF IPI with an illegal vector.
    let (mut x, _) = x2apic(2);
    assert_eq!(x.write_msr(0x83F, 7), Ok(None));
    x.write_msr(msr(ESR), 0).unwrap();
    assert_eq!(x.read_msr(msr(ESR)), Ok(ESR_SEND_ILLEGAL_VECTOR as u64));
}

#[test]
fn bad_input_register_accesses() {
    let (mut a, _) = apic(1);
    // Writes to read-only registers are ignored (logged once).
    for off in [0x30, PPR, ISR0, TMR0 + 0x70, IRR0 + 0x10, CURRENT] {
        let before = r(&mut a, off);
        assert_eq!(w(&mut a, off, 0xFFFF_FFFF), None);
        assert_eq!(r(&mut a, off), before, "{off:#x}");
    }
    assert!(a.has_logged(Oddity::ReadOnlyWrite));
    assert_eq!(a.esr(), (0, 0));
    // Reserved offsets: reads 0, writes ignored, ESR "illegal register address".
    assert_eq!(r(&mut a, 0x40), 0);
    assert_eq!(w(&mut a, 0x3F0, 0x55), None, "SELF IPI is x2APIC-only");
    assert_eq!(a.esr().1, ESR_ILLEGAL_REGISTER);
    assert!(a.has_logged(Oddity::ReservedRegister));
    // Misaligned and narrow accesses: a write is ignored, a read gets the bytes it covers.
    w(&mut a, TPR, 0x5A);
    assert_eq!(a.write_mmio(TPR, &[0x10]), None);
    assert_eq!(a.write_mmio(TPR + 4, &[0x10, 0, 0, 0]), None);
    assert_eq!(r(&mut a, TPR), 0x5A);
    let mut b = [0u8; 1];
    a.read_mmio(TPR, &mut b);
    assert_eq!(b, [0x5A]);
    a.read_mmio(TPR + 8, &mut b);
    assert_eq!(b, [0]);
    assert!(a.has_logged(Oddity::MisalignedAccess));
    // Every offset and size, every x2APIC MSR: no panic.
    for off in (0..0x1000).step_by(4) {
        w(&mut a, off, 0xFFFF_FFFF);
        r(&mut a, off);
        let mut q = [0u8; 8];
        a.read_mmio(off, &mut q);
    }

    let (mut x, _) = x2apic(1);
    // Read-only, write-only and reserved x2APIC registers: #GP, nothing changed.
    for (m, why) in [
        (0x802, "write to a read-only register"),
        (0x80D, "write to a read-only register"),
        (0x80A, "write to a read-only register"),
        (0x839, "write to a read-only register"),
        (0x809, "reserved register"),
        (0x80E, "reserved register"),
        (0x831, "reserved register"),
        (0x82F, "reserved register"),
        (0x8FF, "reserved register"),
    ] {
        assert_eq!(x.write_msr(m, 1), Err(ApicError { msr: m, why }), "{m:#x}");
    }
    assert_eq!(x.read_msr(0x802), Ok(1));
    assert_eq!(x.read_msr(0x80B).unwrap_err().why, "read of a write-only register");
    assert_eq!(x.read_msr(0x83F).unwrap_err().why, "read of a write-only register");
    assert_eq!(x.write_msr(0x80B, 1).unwrap_err().why, "reserved bits set");
    assert_eq!(x.write_msr(0x828, 1).unwrap_err().why, "reserved bits set");
    assert_eq!(x.read_msr(0x809).unwrap_err().to_string(), "APIC MSR 0x809: reserved register");
    // Bits 63:32 are reserved but in the ICR.
    assert_eq!(x.write_msr(0x808, 1 << 32).unwrap_err().why, "reserved bits set");
    assert_eq!(x.read_msr(0x808), Ok(0));
    for m in X2APIC_MSR_FIRST..=X2APIC_MSR_LAST {
        let _ = x.read_msr(m);
        let _ = x.write_msr(m, u64::MAX);
    }
}

#[test]
fn save_restore_round_trip() {
    let (mut a, c) = apic(1);
    w(&mut a, TPR, 0x20);
    w(&mut a, LDR, 0x0200_0000);
    a.accept(0x61, true);
    a.ack();
    a.accept(0x41, false);
    a.accept(0x3, false);
    send(&mut a, 4, 0x0000_0831);
    w(&mut a, DIVIDE, DIV1);
    w(&mut a, LVT_TIMER, PERIODIC | 0x50);
    w(&mut a, INITIAL, 1_000_000);
    // Three periods the host did not raise, and 0.3 of the fourth.
    c.advance(3_300_000);

    let state = a.save().unwrap();
    let json = serde_json::to_string(&a.save().unwrap()).unwrap();
    assert_eq!(Persist::id(&a), "lapic1");

    // The destination's clock is elsewhere: the timer goes on with the same phase.
    let c2 = clock(GHZ);
    c2.set(50 * T0);
    let mut b = LocalApic::new(1, false, c2.clone());
    b.restore(&serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(b.save().unwrap(), state);
    for off in
        [TPR, PPR, LDR, SVR, ISR0 + 0x30, IRR0 + 0x20, TMR0 + 0x30, ICR_LOW, ICR_HIGH, LVT_TIMER, INITIAL, CURRENT]
    {
        assert_eq!(r(&mut b, off), r(&mut a, off), "{off:#x}");
    }
    assert_eq!(b.esr(), a.esr());
    assert_eq!(b.next_deadline(), Some(50 * T0 + 700_000));
    assert_eq!(b.eoi(), Some(ApicEvent::LevelEoi(0x61)));
    assert_eq!(b.ack(), Some(0x41));

    // Another APIC's state, or a broken one, is refused and changes nothing.
    let mut other = LocalApic::new(2, false, c2);
    let before = other.save().unwrap();
    assert_eq!(other.restore(&state).unwrap_err().to_string(), "lapic2: saved state is of APIC 1");
    let bad = LapicState { apic_id: 2, base: DEFAULT_APIC_BASE | BASE_X2APIC, ..state.clone() };
    assert!(other.restore(&bad).unwrap_err().to_string().contains("invalid IA32_APIC_BASE"));
    assert_eq!(other.save().unwrap(), before);
}

/// Found by kumo-fuzz (target `restore`): a restore took register values no guest write can
/// produce, e.g. vector 3 requested in IRR or LVT bits the entry does not have.
#[test]
fn impossible_register_values_are_refused_by_restore() {
    let (mut a, _) = apic(1);
    a.accept(0x41, false);
    let good = a.save().unwrap();
    let mut irr = VectorSet::default();
    irr.set(3);
    let mut lvt = good.lvt;
    lvt[0] |= 1 << 12;
    let timer = TimerState { divide: 0xF0, ..good.timer };
    for (bad, want) in [
        (LapicState { irr, ..good.clone() }, "IRR holds a vector below 16"),
        (LapicState { isr: irr, ..good.clone() }, "ISR holds a vector below 16"),
        (LapicState { svr: 0x1000, ..good.clone() }, "impossible SVR"),
        (LapicState { lvt, ..good.clone() }, "impossible LVT Timer"),
        (LapicState { dfr: 0, ..good.clone() }, "impossible DFR"),
        (LapicState { timer, ..good.clone() }, "divide configuration"),
    ] {
        let (mut b, _) = apic(1);
        let before = b.save().unwrap();
        let e = b.restore(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "want `{want}` in `{e}`");
        assert_eq!(b.save().unwrap(), before, "a refused state changes nothing");
    }
    let (mut b, _) = apic(1);
    b.restore(&good).unwrap();
}

#[test]
fn tsc_deadline_survives_save_restore() {
    let (mut a, c) = apic(1);
    w(&mut a, LVT_TIMER, TSC_DEADLINE | 0x42);
    a.write_msr(TSC_DEADLINE_MSR, c.tsc() + 5000).unwrap();
    let s = a.save().unwrap();
    // The guest TSC migrates with the vCPU: the deadline is the same TSC value.
    let c2 = clock(GHZ);
    c2.set(T0 + 1000);
    let mut b = LocalApic::new(1, false, c2);
    b.restore(&s).unwrap();
    assert_eq!(b.read_msr(TSC_DEADLINE_MSR), Ok(T0 + 5000));
    assert_eq!(b.next_deadline(), Some(T0 + 5000));
}

#[test]
fn msi_messages_become_interrupts() {
    let fixed = Ipi::from_msi(0xFEE0_3000, 0x0000_0041).unwrap();
    assert_eq!(fixed.mode, DeliveryMode::Fixed);
    assert_eq!(fixed.vector, 0x41);
    assert_eq!(fixed.dest, Destination::Field(3, DestMode::Physical));
    let level = Ipi::from_msi(0xFEE0_C004, 0x0000_8151).unwrap();
    assert_eq!((level.mode, level.level_triggered), (DeliveryMode::LowestPriority, true));
    assert_eq!(level.dest, Destination::Field(0x0C, DestMode::Logical));
    // Extended destination id: x2APIC id 0x1_0005.
    let ext = Ipi::from_msi((0x1_0000u64 << 32) | 0xFEE0_5000, 0x41).unwrap();
    assert_eq!(ext.dest, Destination::Field(0x1_0005, DestMode::Physical));
    assert_eq!(Ipi::from_msi(0xFEE0_0000, 0x400).unwrap().mode, DeliveryMode::Nmi);
    // SMI, reserved modes, ExtINT, an illegal vector: not delivered.
    for data in [0x241, 0x341, 0x641, 0x741, 0x05] {
        assert_eq!(Ipi::from_msi(0xFEE0_0000, data), None, "{data:#x}");
    }
    // An MSI is no APIC's own: the shorthands never apply, and it reaches its destination.
    let c = clock(GHZ);
    let addrs: Vec<ApicAddress> = (0..4).map(|i| LocalApic::new(i, i == 0, c.clone()).address()).collect();
    assert_eq!(fixed.targets(&addrs), vec![3]);
}
