//! The local APIC as register logic, for `--irqchip user` (issue 11): the guest's xAPIC MMIO
//! page and x2APIC MSRs, interrupt acceptance and delivery (IRR/ISR/TMR, TPR/PPR, EOI), the
//! ICR's inter-processor interrupts and destination matching, the LAPIC timer, and the state
//! snapshots carry. Like [`crate::pci`], nothing here touches KVM: the VMM hands it the vCPU's
//! APIC exits and acts on what it returns.
//!
//! - [`LocalApic`]: one per vCPU. `read_mmio`/`write_mmio` (the 4 KiB page at
//!   [`LocalApic::mmio_base`]), `read_msr`/`write_msr` (APIC base 0x1B, TSC deadline 0x6E0,
//!   x2APIC 0x800..=0x8FF; an `Err` means the guest gets #GP). A write may return an
//!   [`ApicEvent`]: an IPI to route, a level-triggered EOI for the IOAPIC, a timer to re-arm.
//! - Injection: [`LocalApic::pending_vector`] says whether to ask for an interrupt window;
//!   when it opens, [`LocalApic::ack`] moves the vector from IRR to ISR and returns it for
//!   `KVM_INTERRUPT`.
//! - IPIs: [`Ipi::targets`] picks the receivers among the VM's [`ApicAddress`]es (via
//!   [`matches`]); [`LocalApic::deliver`] hands the IPI to each, saying what the vCPU must do
//!   ([`Delivery`]: nothing more, NMI, INIT, SIPI).
//! - Timer: time comes from a [`Clock`] (tests use [`ManualClock`]; no sleeps);
//!   [`LocalApic::next_deadline`] is when to arm a host timer, [`LocalApic::expire`] is called
//!   when it fires.
//!
//! Bad guest input never panics: see the docs of [`LocalApic`] for each case's outcome.

pub mod ioapic;
mod ipi;
mod lapic;
pub mod pic;
#[cfg(test)]
mod tests;
mod timer;

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub use ioapic::{IoApic, IoApicState, IOAPIC_BASE, IOAPIC_MMIO_SIZE};
pub use ipi::{matches, ApicAddress, DeliveryMode, DestMode, Destination, Ipi};
pub use lapic::{
    ApicEvent, ApicMode, Delivery, LapicState, LocalApic, Lvt, Oddity, TimerState, VERSION as APIC_VERSION,
};
pub use pic::{Pic, PicState};
pub use timer::{divisor, TimerMode, MIN_PERIOD_NS};

/// IA32_APIC_BASE.
pub const APIC_BASE_MSR: u32 = 0x1B;
/// IA32_TSC_DEADLINE.
pub const TSC_DEADLINE_MSR: u32 = 0x6E0;
/// The x2APIC MSR range: MSR 0x800 + xAPIC offset / 16.
pub const X2APIC_MSR_FIRST: u32 = 0x800;
pub const X2APIC_MSR_LAST: u32 = 0x8FF;
/// The xAPIC page's address after reset.
pub const DEFAULT_APIC_BASE: u64 = 0xFEE0_0000;
pub const APIC_MMIO_SIZE: u64 = 0x1000;

/// IA32_APIC_BASE bits.
pub const BASE_BSP: u64 = 1 << 8;
pub const BASE_X2APIC: u64 = 1 << 10;
pub const BASE_ENABLE: u64 = 1 << 11;

/// ESR bits kumo sets (SDM vol. 3 "Error Handling"); the checksum and accept errors of the
/// old APIC bus never happen here.
pub const ESR_SEND_ILLEGAL_VECTOR: u32 = 1 << 5;
pub const ESR_RECEIVE_ILLEGAL_VECTOR: u32 = 1 << 6;
pub const ESR_ILLEGAL_REGISTER: u32 = 1 << 7;

/// What the guest did wrong, refused with #GP on an x2APIC MSR access.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("APIC MSR {msr:#x}: {why}")]
pub struct ApicError {
    pub msr: u32,
    pub why: &'static str,
}

/// Where the APIC takes time from: the VMM's monotonic clock and the guest's TSC at the same
/// instant. Tests use [`ManualClock`].
pub trait Clock: Send + Sync {
    fn now_ns(&self) -> u64;
    /// The guest's TSC now (TSC-deadline mode compares against it).
    fn tsc(&self) -> u64;
    fn tsc_hz(&self) -> u64;
}

/// A clock that moves only when told to; its TSC runs at `tsc_hz` from 0 at 0 ns.
#[derive(Debug)]
pub struct ManualClock {
    ns: AtomicU64,
    tsc_hz: u64,
}

impl ManualClock {
    pub fn new(tsc_hz: u64) -> Self {
        ManualClock { ns: AtomicU64::new(0), tsc_hz: tsc_hz.max(1) }
    }

    pub fn set(&self, ns: u64) {
        self.ns.store(ns, Ordering::SeqCst);
    }

    pub fn advance(&self, ns: u64) {
        self.ns.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::SeqCst)
    }

    fn tsc(&self) -> u64 {
        (self.now_ns() as u128 * self.tsc_hz as u128 / 1_000_000_000) as u64
    }

    fn tsc_hz(&self) -> u64 {
        self.tsc_hz
    }
}

/// 256 vectors as a bit set: IRR, ISR, TMR. Register `i` of the xAPIC view (offset base +
/// 0x10 * i) holds vectors 32 i .. 32 i + 31.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VectorSet([u64; 4]);

impl VectorSet {
    pub fn set(&mut self, v: u8) {
        self.0[v as usize / 64] |= 1 << (v % 64);
    }

    pub fn clear(&mut self, v: u8) {
        self.0[v as usize / 64] &= !(1 << (v % 64));
    }

    pub fn contains(&self, v: u8) -> bool {
        self.0[v as usize / 64] & (1 << (v % 64)) != 0
    }

    /// The highest vector in the set: the highest priority.
    pub fn highest(&self) -> Option<u8> {
        (0..4).rev().find(|&i| self.0[i] != 0).map(|i| (i * 64 + 63 - self.0[i].leading_zeros() as usize) as u8)
    }

    pub fn is_empty(&self) -> bool {
        self.0 == [0; 4]
    }

    /// The 32-bit register `i` (0..8) of the xAPIC view.
    pub fn word(&self, i: usize) -> u32 {
        let i = i % 8;
        (self.0[i / 2] >> (32 * (i % 2))) as u32
    }
}

/// One vCPU's user APIC in snapshots (component `lapic<N>`, kept by `kumo-vm`): the register
/// model's state and whether the vCPU waits for a SIPI (a Linux AP not started yet).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct UserLapicState {
    pub lapic: LapicState,
    pub wait_sipi: bool,
    pub nmi: bool,
}
