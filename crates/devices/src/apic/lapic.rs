//! One vCPU's local APIC: its registers in both views, acceptance, priorities, EOI, LVT, ICR.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ipi::{ApicAddress, DeliveryMode, DestMode, Destination, Ipi};
use super::timer::{tsc_deadline_ns, Timer, TimerMode};
use super::*;
use crate::persist::{Persist, PersistError};

/// The version register: version 0x14 (integrated APIC), 6 LVT entries (max LVT index 5: no
/// CMCI), no EOI-broadcast suppression.
pub const VERSION: u32 = 0x0005_0014;

const LVT_MASKED: u32 = 1 << 16;
const SVR_ENABLE: u32 = 1 << 8;
/// SVR: vector and enable and focus check; bit 12 (EOI-broadcast suppression) is not offered.
const SVR_WRITABLE: u32 = 0x3FF;
/// ICR low: vector, delivery mode, destination mode, level, trigger, shorthand. Delivery status
/// (bit 12) reads 0: an IPI is sent at once.
const ICR_LOW_WRITABLE: u32 = 0x000C_CFFF;
const BASE_ADDR_MASK: u64 = 0x000F_FFFF_FFFF_F000;
const BASE_RESERVED: u64 = !(BASE_ADDR_MASK | BASE_BSP | BASE_X2APIC | BASE_ENABLE);

/// The LVT entries, in register order (0x320..=0x370).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lvt {
    Timer,
    Thermal,
    Perf,
    Lint0,
    Lint1,
    Error,
}

impl Lvt {
    const ALL: [Lvt; 6] = [Lvt::Timer, Lvt::Thermal, Lvt::Perf, Lvt::Lint0, Lvt::Lint1, Lvt::Error];

    /// The bits a write keeps: vector, mask and each entry's own fields (SDM "Local Vector
    /// Table"); delivery status and remote IRR read 0.
    fn writable(self) -> u32 {
        match self {
            Lvt::Timer => 0x0007_00FF,
            Lvt::Thermal | Lvt::Perf => 0x0001_07FF,
            Lvt::Lint0 | Lvt::Lint1 => 0x0001_A7FF,
            Lvt::Error => 0x0001_00FF,
        }
    }
}

/// The APIC's mode, from IA32_APIC_BASE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApicMode {
    Disabled,
    XApic,
    X2Apic,
}

/// What a register write asks the VMM to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApicEvent {
    /// Route this IPI ([`Ipi::targets`], [`LocalApic::deliver`]).
    Ipi(Ipi),
    /// The guest ended a level-triggered interrupt of this vector: the IOAPIC clears Remote
    /// IRR on the pins with it.
    LevelEoi(u8),
    /// The timer changed: re-arm the host timer at [`LocalApic::next_deadline`] (or disarm).
    TimerChanged,
    /// IA32_APIC_BASE changed: the MMIO page moved or the mode changed.
    BaseChanged,
}

/// What reaching this APIC with an interrupt means for its vCPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In IRR now: inject through an interrupt window ([`LocalApic::ack`]).
    Accepted,
    /// Not taken (masked, illegal vector, APIC disabled, reserved mode): see the ESR and log.
    Dropped,
    /// Inject an NMI (`KVM_NMI`).
    Nmi,
    /// INIT: the APIC has reset its registers; the vCPU waits for a SIPI.
    Init,
    /// SIPI: a vCPU waiting for it starts in real mode at `vector << 12`.
    Startup(u8),
    /// LINT0 in ExtINT mode: take the vector from the PIC.
    ExtInt,
}

/// Odd guest programming the APIC logs once per kind (and per APIC): the outcome is in each
/// variant's doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oddity {
    /// xAPIC access to a reserved offset: reads 0, writes ignored, ESR bit 7.
    ReservedRegister = 0,
    /// xAPIC write to a read-only register: ignored.
    ReadOnlyWrite,
    /// ICR with delivery mode 0b011 or 0b111: the IPI is dropped.
    ReservedDeliveryMode,
    /// SMI by ICR or LVT: kumo has no SMM; dropped.
    Smi,
    /// An LVT entry with a delivery mode it does not have fired: dropped.
    BadLvt,
    /// Vector 0–15 sent or received: dropped, ESR bit 5 (send) or 6 (receive).
    IllegalVector,
    /// An MMIO access not a 32-bit access at a 16-byte boundary: a write is ignored, a read
    /// gets the register's bytes it covers (0 beyond the register's 4 bytes).
    MisalignedAccess,
    /// MMIO access while the xAPIC page is off (x2APIC mode or disabled): reads 0, writes
    /// ignored.
    MmioWhileOff,
    /// LVT timer mode 0b11 (reserved): runs as one-shot.
    ReservedTimerMode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reg {
    Id,
    Version,
    Tpr,
    Apr,
    Ppr,
    Eoi,
    Rrd,
    Ldr,
    Dfr,
    Svr,
    Isr(usize),
    Tmr(usize),
    Irr(usize),
    Esr,
    IcrLow,
    IcrHigh,
    Lvt(Lvt),
    InitialCount,
    CurrentCount,
    DivideConfig,
    SelfIpi,
}

impl Reg {
    /// The register at xAPIC offset `off` (16-byte aligned); `None` is reserved. SELF IPI is
    /// x2APIC-only; APR, RRD, DFR and ICR high are xAPIC-only.
    fn at(off: u32, x2apic: bool) -> Option<Reg> {
        let r = match off {
            0x020 => Reg::Id,
            0x030 => Reg::Version,
            0x080 => Reg::Tpr,
            0x090 if !x2apic => Reg::Apr,
            0x0A0 => Reg::Ppr,
            0x0B0 => Reg::Eoi,
            0x0C0 if !x2apic => Reg::Rrd,
            0x0D0 => Reg::Ldr,
            0x0E0 if !x2apic => Reg::Dfr,
            0x0F0 => Reg::Svr,
            0x100..=0x170 => Reg::Isr(((off - 0x100) / 0x10) as usize),
            0x180..=0x1F0 => Reg::Tmr(((off - 0x180) / 0x10) as usize),
            0x200..=0x270 => Reg::Irr(((off - 0x200) / 0x10) as usize),
            0x280 => Reg::Esr,
            0x300 => Reg::IcrLow,
            0x310 if !x2apic => Reg::IcrHigh,
            0x320..=0x370 => Reg::Lvt(Lvt::ALL[((off - 0x320) / 0x10) as usize]),
            0x380 => Reg::InitialCount,
            0x390 => Reg::CurrentCount,
            0x3E0 => Reg::DivideConfig,
            0x3F0 if x2apic => Reg::SelfIpi,
            _ => return None,
        };
        Some(r)
    }
}

/// Why a register access was refused: #GP in x2APIC mode; in xAPIC mode the outcome in
/// [`Oddity`].
enum Refused {
    Reserved,
    ReadOnly,
    WriteOnly,
    ReservedBits,
}

impl Refused {
    fn why(&self) -> &'static str {
        match self {
            Refused::Reserved => "reserved register",
            Refused::ReadOnly => "write to a read-only register",
            Refused::WriteOnly => "read of a write-only register",
            Refused::ReservedBits => "reserved bits set",
        }
    }
}

/// One vCPU's local APIC. After reset it is in xAPIC mode at 0xFEE0_0000, software-disabled
/// (SVR 0xFF), LVT entries masked except, on the BSP, LINT0 in ExtINT mode (virtual wire, as
/// KVM does, so the PIC reaches the BSP before the guest programs its APIC).
///
/// Bad input, never a panic:
/// - x2APIC mode: a reserved MSR, a write to a read-only one (ID, LDR, version, PPR, ISR, TMR,
///   IRR, current count), a read of EOI or SELF IPI, a non-zero EOI or ESR write: `Err` (#GP),
///   state unchanged; xAPIC MSRs while not in x2APIC mode: `Err`.
/// - xAPIC mode: see [`Oddity`]; a reserved register also sets ESR bit 7 (as Intel CPUs do).
/// - Illegal vectors (0–15): not accepted; ESR bit 6 (received, or an LVT entry fired) or 5
///   (sent by ICR or SELF IPI); the LVT error entry raises its vector if unmasked.
/// - IA32_APIC_BASE: reserved bits, EN=0 with EXTD=1, x2APIC → xAPIC and disabled → x2APIC
///   are `Err` (#GP), as in KVM.
pub struct LocalApic {
    apic_id: u32,
    xapic_id: u8,
    base: u64,
    tpr: u8,
    ldr: u32,
    dfr: u32,
    svr: u32,
    irr: VectorSet,
    isr: VectorSet,
    tmr: VectorSet,
    /// The ESR as the guest reads it; errors since its last write are in `esr_pending`.
    esr: u32,
    esr_pending: u32,
    icr: u64,
    lvt: [u32; 6],
    timer: Timer,
    clock: Arc<dyn Clock>,
    logged: u32,
}

impl std::fmt::Debug for LocalApic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalApic").field("apic_id", &self.apic_id).field("base", &self.base).finish_non_exhaustive()
    }
}

impl LocalApic {
    /// The APIC of the vCPU with this initial APIC id, after reset.
    pub fn new(apic_id: u32, bsp: bool, clock: Arc<dyn Clock>) -> Self {
        let mut a = LocalApic {
            apic_id,
            xapic_id: apic_id as u8,
            base: DEFAULT_APIC_BASE | BASE_ENABLE | if bsp { BASE_BSP } else { 0 },
            tpr: 0,
            ldr: 0,
            dfr: u32::MAX,
            svr: 0xFF,
            irr: VectorSet::default(),
            isr: VectorSet::default(),
            tmr: VectorSet::default(),
            esr: 0,
            esr_pending: 0,
            icr: 0,
            lvt: [LVT_MASKED; 6],
            timer: Timer::default(),
            clock,
            logged: 0,
        };
        a.reset_registers();
        a
    }

    /// Power-up and INIT state of every register but the ids and IA32_APIC_BASE.
    fn reset_registers(&mut self) {
        self.tpr = 0;
        self.ldr = if self.mode() == ApicMode::X2Apic { x2apic_ldr(self.apic_id) } else { 0 };
        self.dfr = u32::MAX;
        self.svr = 0xFF;
        self.irr = VectorSet::default();
        self.isr = VectorSet::default();
        self.tmr = VectorSet::default();
        self.esr = 0;
        self.esr_pending = 0;
        self.icr = 0;
        self.lvt = [LVT_MASKED; 6];
        if self.is_bsp() {
            self.lvt[Lvt::Lint0 as usize] = 0b111 << 8;
        }
        self.timer = Timer::default();
    }

    pub fn apic_id(&self) -> u32 {
        self.apic_id
    }

    pub fn is_bsp(&self) -> bool {
        self.base & BASE_BSP != 0
    }

    pub fn mode(&self) -> ApicMode {
        match (self.base & BASE_ENABLE != 0, self.base & BASE_X2APIC != 0) {
            (false, _) => ApicMode::Disabled,
            (true, false) => ApicMode::XApic,
            (true, true) => ApicMode::X2Apic,
        }
    }

    /// Where the xAPIC page is, when it is on (xAPIC mode).
    pub fn mmio_base(&self) -> Option<u64> {
        (self.mode() == ApicMode::XApic).then_some(self.base & BASE_ADDR_MASK)
    }

    /// IA32_APIC_BASE.EN and SVR's APIC software enable: the APIC takes fixed interrupts.
    pub fn is_enabled(&self) -> bool {
        self.mode() != ApicMode::Disabled && self.svr & SVR_ENABLE != 0
    }

    /// What IPI routing needs of this APIC.
    pub fn address(&self) -> ApicAddress {
        let x2apic = self.mode() == ApicMode::X2Apic;
        ApicAddress {
            apic_id: self.apic_id,
            dest_id: if x2apic { self.apic_id } else { self.xapic_id as u32 },
            ldr: self.ldr,
            dfr: self.dfr,
            x2apic,
            enabled: self.mode() != ApicMode::Disabled,
        }
    }

    /// The ESR as the guest would read it now, and the errors not yet latched into it.
    pub fn esr(&self) -> (u32, u32) {
        (self.esr, self.esr_pending)
    }

    pub fn has_logged(&self, o: Oddity) -> bool {
        self.logged & (1 << o as u32) != 0
    }

    fn log_once(&mut self, o: Oddity, detail: impl FnOnce() -> String) {
        if !self.has_logged(o) {
            self.logged |= 1 << o as u32;
            tracing::warn!(apic = self.apic_id, "local APIC: {:?}: {} (logged once)", o, detail());
        }
    }

    fn timer_mode(&self) -> TimerMode {
        match (self.lvt[Lvt::Timer as usize] >> 17) & 3 {
            0 => TimerMode::OneShot,
            1 => TimerMode::Periodic,
            2 => TimerMode::TscDeadline,
            _ => TimerMode::OneShot,
        }
    }

    // ---- priorities, acceptance, injection ----

    pub fn tpr(&self) -> u8 {
        self.tpr
    }

    /// CR8 is TPR[7:4]: the VMM syncs it with `kvm_run.cr8` around each run.
    pub fn set_cr8(&mut self, cr8: u64) {
        self.tpr = ((cr8 & 0xF) << 4) as u8;
    }

    pub fn cr8(&self) -> u64 {
        (self.tpr >> 4) as u64
    }

    /// The processor priority: the higher of TPR and the class of the highest in-service vector.
    pub fn ppr(&self) -> u8 {
        let isrv = self.isr.highest().unwrap_or(0);
        if self.tpr >> 4 >= isrv >> 4 {
            self.tpr
        } else {
            isrv & 0xF0
        }
    }

    /// The vector the CPU would take now: the highest in IRR whose priority class is above
    /// PPR's. `None` when the APIC is disabled.
    pub fn pending_vector(&self) -> Option<u8> {
        if !self.is_enabled() {
            return None;
        }
        let v = self.irr.highest()?;
        (v >> 4 > self.ppr() >> 4).then_some(v)
    }

    /// The CPU's interrupt acknowledge: the pending vector goes from IRR to ISR and is returned
    /// for `KVM_INTERRUPT`. `None` if nothing is pending any more (the TPR rose meanwhile):
    /// nothing to inject (hardware would deliver the spurious vector, which needs no EOI and
    /// does nothing; kumo skips it).
    pub fn ack(&mut self) -> Option<u8> {
        let v = self.pending_vector()?;
        self.irr.clear(v);
        self.isr.set(v);
        Some(v)
    }

    /// A fixed interrupt arrives (an IPI, an IOAPIC or MSI message, an LVT entry). Vectors
    /// 0–15 are refused with ESR bit 6; a disabled APIC refuses all. A vector already in IRR
    /// stays one request.
    pub fn accept(&mut self, vector: u8, level_triggered: bool) -> bool {
        if vector < 16 {
            self.log_once(Oddity::IllegalVector, || format!("received vector {vector}"));
            self.error(ESR_RECEIVE_ILLEGAL_VECTOR);
            return false;
        }
        if !self.is_enabled() {
            return false;
        }
        self.irr.set(vector);
        if level_triggered {
            self.tmr.set(vector);
        } else {
            self.tmr.clear(vector);
        }
        true
    }

    /// Records an error; the LVT error entry raises its vector if unmasked (a bad vector there
    /// raises nothing more, so errors cannot loop).
    fn error(&mut self, bits: u32) {
        self.esr_pending |= bits;
        let e = self.lvt[Lvt::Error as usize];
        let v = e as u8;
        if e & LVT_MASKED == 0 && v >= 16 && self.is_enabled() {
            self.irr.set(v);
            self.tmr.clear(v);
        }
    }

    /// EOI: the highest in-service vector is done. A level-triggered one is reported for the
    /// IOAPIC. With nothing in service, nothing happens.
    pub fn eoi(&mut self) -> Option<ApicEvent> {
        let v = self.isr.highest()?;
        self.isr.clear(v);
        self.tmr.contains(v).then_some(ApicEvent::LevelEoi(v))
    }

    /// An IPI this APIC is a target of (see [`Ipi::targets`]). INIT resets the registers.
    pub fn deliver(&mut self, ipi: &Ipi) -> Delivery {
        match ipi.mode {
            DeliveryMode::Fixed | DeliveryMode::LowestPriority => {
                if self.accept(ipi.vector, ipi.level_triggered) {
                    Delivery::Accepted
                } else {
                    Delivery::Dropped
                }
            }
            DeliveryMode::Nmi => Delivery::Nmi,
            DeliveryMode::Init => {
                self.reset_registers();
                Delivery::Init
            }
            DeliveryMode::Startup => Delivery::Startup(ipi.vector),
        }
    }

    /// Whether an interrupt on the INTR pin (the 8259 PIC's output) reaches this CPU now: LINT0
    /// in ExtINT mode and unmasked, or the APIC disabled (LINT0 is then the INTR pin).
    pub fn extint_ready(&self) -> bool {
        if self.mode() == ApicMode::Disabled {
            return true;
        }
        let e = self.lvt[Lvt::Lint0 as usize];
        e & LVT_MASKED == 0 && (e >> 8) & 7 == 0b111
    }

    /// A local interrupt source fires (LINT0/LINT1 pins, thermal, performance counter; the
    /// timer goes through [`LocalApic::expire`]). With the APIC disabled LINT0 is the INTR pin
    /// (ExtINT) and LINT1 the NMI pin.
    pub fn fire_lvt(&mut self, lvt: Lvt) -> Delivery {
        if self.mode() == ApicMode::Disabled {
            return match lvt {
                Lvt::Lint0 => Delivery::ExtInt,
                Lvt::Lint1 => Delivery::Nmi,
                _ => Delivery::Dropped,
            };
        }
        let e = self.lvt[lvt as usize];
        if e & LVT_MASKED != 0 {
            return Delivery::Dropped;
        }
        let vector = e as u8;
        // LINT1 is always edge-triggered; the trigger bit applies to LINT0's fixed mode.
        let level = lvt == Lvt::Lint0 && e & (1 << 15) != 0;
        let mode = if matches!(lvt, Lvt::Timer | Lvt::Error) { 0 } else { (e >> 8) & 7 };
        let lint = matches!(lvt, Lvt::Lint0 | Lvt::Lint1);
        match mode {
            0 if self.accept(vector, level) => Delivery::Accepted,
            0 => Delivery::Dropped,
            0b010 => {
                self.log_once(Oddity::Smi, || format!("LVT {lvt:?} in SMI mode fired"));
                Delivery::Dropped
            }
            0b100 => Delivery::Nmi,
            0b101 if lint => {
                self.reset_registers();
                Delivery::Init
            }
            0b111 if lint => Delivery::ExtInt,
            m => {
                self.log_once(Oddity::BadLvt, || format!("LVT {lvt:?} with delivery mode {m:#05b} fired"));
                Delivery::Dropped
            }
        }
    }

    // ---- timer ----

    /// When the host timer should fire next (clock ns), if the timer runs. A masked timer still
    /// counts, so it still has a deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        self.timer.next_deadline(self.timer_mode())
    }

    /// The host timer fired: if the deadline is reached, the LVT timer vector is raised (if
    /// unmasked) and a periodic timer goes on with its next period. Returns whether a vector
    /// was raised (kick the vCPU). Early calls do nothing.
    pub fn expire(&mut self) -> bool {
        let now = self.clock.now_ns();
        if !self.timer.expire(self.timer_mode(), now) {
            return false;
        }
        self.fire_lvt(Lvt::Timer) == Delivery::Accepted
    }

    // ---- register access ----

    fn read_reg(&mut self, reg: Reg, x2apic: bool) -> Result<u64, Refused> {
        let v = match reg {
            Reg::Id if x2apic => self.apic_id,
            Reg::Id => (self.xapic_id as u32) << 24,
            Reg::Version => VERSION,
            Reg::Tpr => self.tpr as u32,
            Reg::Apr | Reg::Rrd => 0,
            Reg::Ppr => self.ppr() as u32,
            Reg::Eoi | Reg::SelfIpi if x2apic => return Err(Refused::WriteOnly),
            Reg::Eoi | Reg::SelfIpi => 0,
            Reg::Ldr => self.ldr,
            Reg::Dfr => self.dfr,
            Reg::Svr => self.svr,
            Reg::Isr(i) => self.isr.word(i),
            Reg::Tmr(i) => self.tmr.word(i),
            Reg::Irr(i) => self.irr.word(i),
            Reg::Esr => self.esr,
            Reg::IcrLow if x2apic => return Ok(self.icr),
            Reg::IcrLow => self.icr as u32,
            Reg::IcrHigh => (self.icr >> 32) as u32,
            Reg::Lvt(l) => self.lvt[l as usize],
            Reg::InitialCount => self.timer.initial,
            Reg::CurrentCount => self.timer.current_count(self.timer_mode(), self.clock.now_ns()),
            Reg::DivideConfig => self.timer.divide,
        };
        Ok(v as u64)
    }

    fn write_reg(&mut self, reg: Reg, value: u64, x2apic: bool) -> Result<Option<ApicEvent>, Refused> {
        let v = value as u32;
        match reg {
            Reg::Version
            | Reg::Apr
            | Reg::Ppr
            | Reg::Rrd
            | Reg::Isr(_)
            | Reg::Tmr(_)
            | Reg::Irr(_)
            | Reg::CurrentCount => return Err(Refused::ReadOnly),
            Reg::Id | Reg::Ldr if x2apic => return Err(Refused::ReadOnly),
            Reg::Id => self.xapic_id = (v >> 24) as u8,
            Reg::Ldr => self.ldr = v & 0xFF00_0000,
            Reg::Dfr => self.dfr = v | 0x0FFF_FFFF,
            Reg::Tpr => self.tpr = v as u8,
            Reg::Eoi if x2apic && value != 0 => return Err(Refused::ReservedBits),
            Reg::Eoi => return Ok(self.eoi()),
            Reg::Svr => {
                self.svr = v & SVR_WRITABLE;
                if self.svr & SVR_ENABLE == 0 {
                    for e in &mut self.lvt {
                        *e |= LVT_MASKED;
                    }
                }
            }
            Reg::Esr if x2apic && value != 0 => return Err(Refused::ReservedBits),
            Reg::Esr => {
                self.esr = self.esr_pending;
                self.esr_pending = 0;
            }
            Reg::IcrLow => {
                self.icr = if x2apic {
                    value & (0xFFFF_FFFF_0000_0000 | ICR_LOW_WRITABLE as u64)
                } else {
                    (self.icr & 0xFFFF_FFFF_0000_0000) | (v & ICR_LOW_WRITABLE) as u64
                };
                return Ok(self.send_ipi(x2apic));
            }
            Reg::IcrHigh => self.icr = (self.icr & 0xFFFF_FFFF) | (((v & 0xFF00_0000) as u64) << 32),
            Reg::Lvt(l) => return Ok(self.write_lvt(l, v)),
            Reg::InitialCount => {
                self.timer.write_initial(self.timer_mode(), v, self.clock.now_ns());
                return Ok(Some(ApicEvent::TimerChanged));
            }
            Reg::DivideConfig => {
                self.timer.write_divide(self.timer_mode(), v, self.clock.now_ns());
                return Ok(Some(ApicEvent::TimerChanged));
            }
            Reg::SelfIpi => {
                let vector = v as u8;
                if vector < 16 {
                    self.log_once(Oddity::IllegalVector, || format!("SELF IPI with vector {vector}"));
                    self.error(ESR_SEND_ILLEGAL_VECTOR);
                } else {
                    self.accept(vector, false);
                }
            }
        }
        Ok(None)
    }

    fn write_lvt(&mut self, l: Lvt, v: u32) -> Option<ApicEvent> {
        let mut new = v & l.writable();
        if self.svr & SVR_ENABLE == 0 {
            new |= LVT_MASKED;
        }
        let old = std::mem::replace(&mut self.lvt[l as usize], new);
        if l != Lvt::Timer {
            return None;
        }
        if (new >> 17) & 3 == 3 {
            self.log_once(Oddity::ReservedTimerMode, || format!("LVT timer {new:#x}"));
        }
        if (old ^ new) & (3 << 17) != 0 {
            // A mode change stops the timer (as KVM does): the guest loads it again.
            self.timer.stop();
        }
        Some(ApicEvent::TimerChanged)
    }

    /// Turns the ICR just written into an IPI to route, or drops it (logged once).
    fn send_ipi(&mut self, x2apic: bool) -> Option<ApicEvent> {
        let icr = self.icr;
        let low = icr as u32;
        let vector = low as u8;
        let level_triggered = low & (1 << 15) != 0;
        let assert = low & (1 << 14) != 0;
        let mode = match (low >> 8) & 7 {
            0b000 => DeliveryMode::Fixed,
            0b001 => DeliveryMode::LowestPriority,
            0b100 => DeliveryMode::Nmi,
            0b101 if level_triggered && !assert => return None, // INIT level de-assert: a no-op since the P4
            0b101 => DeliveryMode::Init,
            0b110 => DeliveryMode::Startup,
            0b010 => {
                self.log_once(Oddity::Smi, || format!("ICR {icr:#x} sends an SMI"));
                return None;
            }
            m => {
                self.log_once(Oddity::ReservedDeliveryMode, || format!("ICR {icr:#x}: delivery mode {m:#05b}"));
                return None;
            }
        };
        if matches!(mode, DeliveryMode::Fixed | DeliveryMode::LowestPriority) && vector < 16 {
            self.log_once(Oddity::IllegalVector, || format!("ICR {icr:#x} sends vector {vector}"));
            self.error(ESR_SEND_ILLEGAL_VECTOR);
            return None;
        }
        let dest_mode = if low & (1 << 11) != 0 { DestMode::Logical } else { DestMode::Physical };
        let field = if x2apic { (icr >> 32) as u32 } else { (icr >> 56) as u32 };
        let dest = match (low >> 18) & 3 {
            0 => Destination::Field(field, dest_mode),
            1 => Destination::SelfOnly,
            2 => Destination::AllIncludingSelf,
            _ => Destination::AllExcludingSelf,
        };
        Some(ApicEvent::Ipi(Ipi { mode, vector, level_triggered, dest, source: self.apic_id }))
    }

    /// A read of the xAPIC page at `offset` (`data` up to 8 bytes).
    pub fn read_mmio(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if self.mode() != ApicMode::XApic {
            self.log_once(Oddity::MmioWhileOff, || format!("read at {offset:#x}"));
            return;
        }
        let within = (offset & 0xF) as usize;
        if within != 0 || data.len() != 4 {
            self.log_once(Oddity::MisalignedAccess, || format!("{}-byte read at {offset:#x}", data.len()));
        }
        let off = (offset & 0xFF0) as u32;
        let v = match Reg::at(off, false) {
            Some(r) => self.read_reg(r, false).unwrap_or(0) as u32,
            None => {
                self.reserved_mmio(offset);
                0
            }
        };
        let bytes = v.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes.get(within + i).copied().unwrap_or(0);
        }
    }

    /// A write to the xAPIC page at `offset`.
    pub fn write_mmio(&mut self, offset: u64, data: &[u8]) -> Option<ApicEvent> {
        if self.mode() != ApicMode::XApic {
            self.log_once(Oddity::MmioWhileOff, || format!("write at {offset:#x}"));
            return None;
        }
        let off = (offset & 0xFF0) as u32;
        let Some(reg) = Reg::at(off, false) else {
            self.reserved_mmio(offset);
            return None;
        };
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            self.log_once(Oddity::MisalignedAccess, || format!("{}-byte write at {offset:#x}", data.len()));
            return None;
        };
        if offset & 0xF != 0 {
            self.log_once(Oddity::MisalignedAccess, || format!("write at {offset:#x}"));
            return None;
        }
        match self.write_reg(reg, u32::from_le_bytes(bytes) as u64, false) {
            Ok(e) => e,
            Err(r) => {
                self.log_once(Oddity::ReadOnlyWrite, || format!("{} at {offset:#x}", r.why()));
                None
            }
        }
    }

    fn reserved_mmio(&mut self, offset: u64) {
        self.log_once(Oddity::ReservedRegister, || format!("access at {offset:#x}"));
        self.error(ESR_ILLEGAL_REGISTER);
    }

    /// RDMSR of IA32_APIC_BASE, IA32_TSC_DEADLINE or an x2APIC register. `Err`: inject #GP.
    pub fn read_msr(&mut self, msr: u32) -> Result<u64, ApicError> {
        match msr {
            APIC_BASE_MSR => Ok(self.base),
            TSC_DEADLINE_MSR => {
                Ok(if self.timer_mode() == TimerMode::TscDeadline { self.timer.tsc_deadline } else { 0 })
            }
            X2APIC_MSR_FIRST..=X2APIC_MSR_LAST => {
                let reg = self.x2apic_reg(msr)?;
                self.read_reg(reg, true).map_err(|r| ApicError { msr, why: r.why() })
            }
            _ => Err(ApicError { msr, why: "not an APIC MSR" }),
        }
    }

    /// WRMSR of IA32_APIC_BASE, IA32_TSC_DEADLINE or an x2APIC register. `Err`: inject #GP
    /// (nothing changed).
    pub fn write_msr(&mut self, msr: u32, value: u64) -> Result<Option<ApicEvent>, ApicError> {
        match msr {
            APIC_BASE_MSR => self.write_base(value).map_err(|why| ApicError { msr, why }),
            TSC_DEADLINE_MSR => {
                // Ignored outside TSC-deadline mode (SDM).
                if self.timer_mode() != TimerMode::TscDeadline {
                    return Ok(None);
                }
                let c = &self.clock;
                self.timer.write_tsc_deadline(value, c.now_ns(), c.tsc(), c.tsc_hz());
                Ok(Some(ApicEvent::TimerChanged))
            }
            X2APIC_MSR_FIRST..=X2APIC_MSR_LAST => {
                let reg = self.x2apic_reg(msr)?;
                // Bits 63:32 are reserved in every x2APIC register but the ICR.
                if reg != Reg::IcrLow && value >> 32 != 0 {
                    return Err(ApicError { msr, why: Refused::ReservedBits.why() });
                }
                self.write_reg(reg, value, true).map_err(|r| ApicError { msr, why: r.why() })
            }
            _ => Err(ApicError { msr, why: "not an APIC MSR" }),
        }
    }

    fn x2apic_reg(&self, msr: u32) -> Result<Reg, ApicError> {
        if self.mode() != ApicMode::X2Apic {
            return Err(ApicError { msr, why: "x2APIC register while the APIC is not in x2APIC mode" });
        }
        Reg::at((msr - X2APIC_MSR_FIRST) << 4, true).ok_or(ApicError { msr, why: Refused::Reserved.why() })
    }

    fn write_base(&mut self, value: u64) -> Result<Option<ApicEvent>, &'static str> {
        if value & BASE_RESERVED != 0 {
            return Err("reserved bits set");
        }
        let old = self.mode();
        let new = match (value & BASE_ENABLE != 0, value & BASE_X2APIC != 0) {
            (false, true) => return Err("x2APIC enable without APIC enable"),
            (false, false) => ApicMode::Disabled,
            (true, false) => ApicMode::XApic,
            (true, true) => ApicMode::X2Apic,
        };
        match (old, new) {
            (ApicMode::X2Apic, ApicMode::XApic) => return Err("x2APIC to xAPIC without disabling first"),
            (ApicMode::Disabled, ApicMode::X2Apic) => return Err("disabled to x2APIC without xAPIC first"),
            _ => {}
        }
        if value == self.base {
            return Ok(None);
        }
        self.base = value;
        if new == ApicMode::Disabled && old != ApicMode::Disabled {
            // Disabling loses the APIC's state: it comes back as after reset.
            self.reset_registers();
        }
        if new == ApicMode::X2Apic && old != ApicMode::X2Apic {
            self.ldr = x2apic_ldr(self.apic_id);
        }
        Ok(Some(ApicEvent::BaseChanged))
    }
}

/// The x2APIC logical id: cluster (id[19:4]) in bits 31:16, one bit of 16 (id[3:0]).
fn x2apic_ldr(id: u32) -> u32 {
    ((id >> 4) << 16) | (1 << (id & 0xF))
}

/// The timer as saved: times relative to the save, so it goes on where the clock differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerState {
    pub initial_count: u32,
    pub divide: u32,
    pub armed: bool,
    /// Time since the count was loaded (one-shot) or the current period began (periodic).
    /// Restoring needs a clock at least this far from its origin (a monotonic clock is).
    pub elapsed_ns: u64,
    /// The guest TSC deadline (the guest TSC migrates with the vCPU).
    pub tsc_deadline: u64,
}

/// A local APIC as snapshots carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LapicState {
    pub apic_id: u32,
    pub xapic_id: u8,
    pub base: u64,
    pub tpr: u8,
    pub ldr: u32,
    pub dfr: u32,
    pub svr: u32,
    pub irr: VectorSet,
    pub isr: VectorSet,
    pub tmr: VectorSet,
    pub esr: u32,
    pub esr_pending: u32,
    pub icr: u64,
    pub lvt: [u32; 6],
    pub timer: TimerState,
}

impl LapicState {
    /// Refuses register values no guest write can produce (the bits each register keeps, no
    /// vector 0–15 requested or in service): a restored APIC stays within what its guest and
    /// the rest of this model expect.
    fn check(&self) -> Result<(), String> {
        if self.svr & !SVR_WRITABLE != 0 {
            return Err(format!("impossible SVR {:#x}", self.svr));
        }
        if let Some((l, v)) = Lvt::ALL.iter().zip(self.lvt).find(|(l, v)| v & !l.writable() != 0) {
            return Err(format!("impossible LVT {l:?} {v:#x}"));
        }
        for (name, set) in [("IRR", &self.irr), ("ISR", &self.isr), ("TMR", &self.tmr)] {
            if set.word(0) & 0xFFFF != 0 {
                return Err(format!("{name} holds a vector below 16"));
            }
        }
        if self.dfr | 0x0FFF_FFFF != self.dfr || self.timer.divide & !0b1011 != 0 {
            return Err(format!("impossible DFR {:#x} or divide configuration {:#x}", self.dfr, self.timer.divide));
        }
        Ok(())
    }
}

impl Persist for LocalApic {
    type State = LapicState;

    fn id(&self) -> String {
        format!("lapic{}", self.apic_id)
    }

    fn save(&self) -> Result<LapicState, PersistError> {
        let now = self.clock.now_ns();
        Ok(LapicState {
            apic_id: self.apic_id,
            xapic_id: self.xapic_id,
            base: self.base,
            tpr: self.tpr,
            ldr: self.ldr,
            dfr: self.dfr,
            svr: self.svr,
            irr: self.irr,
            isr: self.isr,
            tmr: self.tmr,
            esr: self.esr,
            esr_pending: self.esr_pending,
            icr: self.icr,
            lvt: self.lvt,
            timer: TimerState {
                initial_count: self.timer.initial,
                divide: self.timer.divide,
                armed: self.timer.armed,
                elapsed_ns: self.timer.phase_ns(self.timer_mode(), now),
                tsc_deadline: self.timer.tsc_deadline,
            },
        })
    }

    fn restore(&mut self, s: &LapicState) -> Result<(), PersistError> {
        let id = Persist::id(self);
        if s.apic_id != self.apic_id {
            return Err(PersistError::component(id, format!("saved state is of APIC {}", s.apic_id)));
        }
        if s.base & BASE_RESERVED != 0 || s.base & (BASE_ENABLE | BASE_X2APIC) == BASE_X2APIC {
            return Err(PersistError::component(id, format!("invalid IA32_APIC_BASE {:#x}", s.base)));
        }
        s.check().map_err(|e| PersistError::component(id, e))?;
        self.xapic_id = s.xapic_id;
        self.base = s.base;
        self.tpr = s.tpr;
        self.ldr = s.ldr;
        self.dfr = s.dfr;
        self.svr = s.svr;
        self.irr = s.irr;
        self.isr = s.isr;
        self.tmr = s.tmr;
        self.esr = s.esr;
        self.esr_pending = s.esr_pending;
        self.icr = s.icr;
        self.lvt = s.lvt;
        let (now, tsc, hz) = (self.clock.now_ns(), self.clock.tsc(), self.clock.tsc_hz());
        self.timer = Timer {
            initial: s.timer.initial_count,
            divide: s.timer.divide & 0b1011,
            start_ns: now.saturating_sub(s.timer.elapsed_ns),
            armed: s.timer.armed,
            tsc_deadline: s.timer.tsc_deadline,
            deadline_ns: tsc_deadline_ns(s.timer.tsc_deadline, now, tsc, hz),
        };
        Ok(())
    }
}
