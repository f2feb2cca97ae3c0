//! The pair of 8259A programmable interrupt controllers, as register logic, for `--irqchip
//! user`: the master at ports 0x20/0x21 (IRQ 0-7), the slave at 0xA0/0xA1 (IRQ 8-15) cascaded
//! on the master's IRQ 2, and the ELCR at 0x4D0/0x4D1. The master's INTR output reaches the
//! bootstrap processor through its LAPIC's LINT0 in ExtINT mode (the "virtual wire"): the VMM
//! asks [`Pic::intr`] whether to inject, and [`Pic::ack`] (the INTA cycle) gives the vector.
//!
//! What is modelled: the ICW1-ICW4 initialisation sequence (edge or level mode, single or
//! cascade, auto-EOI), the IMR (OCW1), non-specific and specific EOI and rotation commands
//! (OCW2; rotation is accepted and treated as fixed priority), IRR/ISR reads and special mask
//! mode (OCW3), fully nested priority with IRQ 0 highest and the slave's lines at IRQ 2's level,
//! and the spurious IRQ 7 / IRQ 15 when an INTA finds nothing. Poll mode is answered as "no
//! interrupt". A PIC that was never initialised delivers nothing. Bad programming never panics:
//! an unexpected byte is taken as the 8259A would read it.

use serde::{Deserialize, Serialize};

use crate::persist::{Persist, PersistError};

pub const MASTER_PORT: u16 = 0x20;
pub const SLAVE_PORT: u16 = 0xA0;
pub const ELCR_PORT: u16 = 0x4D0;

/// One 8259A.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chip {
    irr: u8,
    isr: u8,
    imr: u8,
    /// The input lines' levels (an edge sets IRR on a rising edge only).
    lines: u8,
    /// ICW2: vector base (its low three bits are the IRQ).
    base: u8,
    /// Which ICW comes next (0: initialised, 2..=4: in the sequence).
    init_step: u8,
    needs_icw4: bool,
    single: bool,
    auto_eoi: bool,
    /// OCW3: read ISR (else IRR) on the command port.
    read_isr: bool,
    special_mask: bool,
    /// ELCR: level-triggered lines.
    elcr: u8,
    /// ICW1 was ever written: an uninitialised PIC delivers nothing.
    initialised: bool,
}

impl Chip {
    /// The highest-priority pending line not masked and not blocked by an in-service one.
    fn pending_irq(&self) -> Option<u8> {
        if !self.initialised || self.init_step != 0 {
            return None;
        }
        let pending = self.irr & !self.imr;
        for irq in 0..8u8 {
            let bit = 1 << irq;
            // In special mask mode a masked in-service line does not block lower ones.
            if self.isr & bit != 0 && !(self.special_mask && self.imr & bit != 0) {
                return None;
            }
            if pending & bit != 0 {
                return Some(irq);
            }
        }
        None
    }

    fn set_line(&mut self, irq: u8, high: bool) {
        let bit = 1 << irq;
        let was = self.lines & bit != 0;
        if high {
            self.lines |= bit;
            // Edge mode: a rising edge; level mode: while high.
            if !was || self.elcr & bit != 0 {
                self.irr |= bit;
            }
        } else {
            self.lines &= !bit;
            if self.elcr & bit != 0 {
                self.irr &= !bit;
            }
        }
    }

    /// INTA: IRR -> ISR for `irq` (unless auto-EOI), returns its vector.
    fn ack(&mut self, irq: u8) -> u8 {
        let bit = 1 << irq;
        // A level-triggered line stays requested while high; an edge is consumed.
        if self.elcr & bit == 0 || self.lines & bit == 0 {
            self.irr &= !bit;
        }
        if !self.auto_eoi {
            self.isr |= bit;
        }
        (self.base & 0xF8) | irq
    }

    fn write_command(&mut self, v: u8) {
        if v & 0x10 != 0 {
            // ICW1: start initialisation.
            self.init_step = 2;
            self.needs_icw4 = v & 0x01 != 0;
            self.single = v & 0x02 != 0;
            self.imr = 0;
            self.isr = 0;
            self.irr = 0;
            self.auto_eoi = false;
            self.read_isr = false;
            self.special_mask = false;
            self.initialised = true;
            // ICW1's LTIM bit makes every line level-triggered (the ELCR does it per line on PCs).
            if v & 0x08 != 0 {
                self.elcr = 0xFF;
            }
        } else if v & 0x08 == 0 {
            // OCW2: EOI and rotation commands.
            match v >> 5 {
                0b001 | 0b101 => {
                    // Non-specific EOI (with or without rotation): the highest ISR bit.
                    if let Some(irq) = (0..8u8).find(|i| self.isr & (1 << i) != 0) {
                        self.isr &= !(1 << irq);
                    }
                }
                0b011 | 0b111 => self.isr &= !(1 << (v & 7)), // specific EOI
                _ => {}                                       // rotation / priority set: fixed priority kept
            }
        } else {
            // OCW3.
            if v & 0x02 != 0 {
                self.read_isr = v & 0x01 != 0;
            }
            if v & 0x40 != 0 {
                self.special_mask = v & 0x20 != 0;
            }
        }
    }

    fn write_data(&mut self, v: u8) {
        match self.init_step {
            2 => {
                self.base = v & 0xF8;
                self.init_step = if self.single {
                    if self.needs_icw4 {
                        4
                    } else {
                        0
                    }
                } else {
                    3
                };
            }
            3 => self.init_step = if self.needs_icw4 { 4 } else { 0 }, // ICW3: cascade wiring (fixed here)
            4 => {
                self.auto_eoi = v & 0x02 != 0;
                self.init_step = 0;
            }
            _ => self.imr = v, // OCW1
        }
    }

    fn read_command(&self) -> u8 {
        if self.read_isr {
            self.isr
        } else {
            self.irr
        }
    }
}

/// Both PICs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pic {
    master: Chip,
    slave: Chip,
}

/// The state snapshots carry (the registers as they are).
pub type PicState = Pic;

impl Pic {
    pub fn new() -> Self {
        Pic::default()
    }

    /// Sets ISA line `irq` (0..16) high or low. Lines above 15 are not the PIC's.
    pub fn set_irq(&mut self, irq: u32, high: bool) {
        match irq {
            0..=7 => self.master.set_line(irq as u8, high),
            8..=15 => self.slave.set_line(irq as u8 - 8, high),
            _ => {}
        }
        self.cascade();
    }

    /// A pulse on an edge-triggered ISA line (a device's irqfd signal).
    pub fn pulse(&mut self, irq: u32) {
        self.set_irq(irq, true);
        self.set_irq(irq, false);
    }

    /// The slave's INTR drives the master's IRQ 2.
    fn cascade(&mut self) {
        let high = self.slave.pending_irq().is_some();
        self.master.set_line(2, high);
    }

    /// Whether the master raises INTR (an interrupt is ready for an INTA).
    pub fn intr(&self) -> bool {
        self.master.pending_irq().is_some()
    }

    /// The INTA cycle: the vector to inject. With nothing pending (the request went away) the
    /// 8259A answers with its spurious IRQ 7 (or the slave's IRQ 15), as hardware does.
    pub fn ack(&mut self) -> u8 {
        let v = match self.master.pending_irq() {
            Some(2) if !self.master.single => {
                self.master.ack(2);
                match self.slave.pending_irq() {
                    Some(irq) => self.slave.ack(irq),
                    None => (self.slave.base & 0xF8) | 7,
                }
            }
            Some(irq) => self.master.ack(irq),
            None => (self.master.base & 0xF8) | 7,
        };
        self.cascade();
        v
    }

    /// A port read (0x20/0x21 master, 0xA0/0xA1 slave, 0x4D0/0x4D1 ELCR).
    pub fn read_port(&self, port: u16) -> u8 {
        match port {
            0x20 => self.master.read_command(),
            0x21 => self.master.imr,
            0xA0 => self.slave.read_command(),
            0xA1 => self.slave.imr,
            0x4D0 => self.master.elcr,
            0x4D1 => self.slave.elcr,
            _ => 0xFF,
        }
    }

    /// A port write.
    pub fn write_port(&mut self, port: u16, v: u8) {
        match port {
            0x20 => self.master.write_command(v),
            0x21 => self.master.write_data(v),
            0xA0 => self.slave.write_command(v),
            0xA1 => self.slave.write_data(v),
            // IRQ 0, 1, 2, 8 and 13 are edge-triggered on a PC (their ELCR bits are reserved).
            0x4D0 => self.master.elcr = v & 0xF8,
            0x4D1 => self.slave.elcr = v & 0xDE,
            _ => {}
        }
        self.cascade();
    }
}

/// The PIC pair in snapshots, id `pic`.
impl Persist for Pic {
    type State = PicState;
    fn id(&self) -> String {
        "pic".into()
    }
    fn save(&self) -> Result<PicState, PersistError> {
        Ok(self.clone())
    }
    fn restore(&mut self, s: &PicState) -> Result<(), PersistError> {
        for (name, c) in [("master", &s.master), ("slave", &s.slave)] {
            // ICW2 keeps the vector base's high five bits; ICW1 starts the sequence at step 2.
            if !matches!(c.init_step, 0 | 2 | 3 | 4) || c.base & 7 != 0 {
                let why = format!("impossible {name} state: init step {}, vector base {:#x}", c.init_step, c.base);
                return Err(PersistError::component("pic", why));
            }
        }
        *self = s.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux's init sequence: ICW1 0x11 (edge, cascade, ICW4), vectors 0x30/0x38, ICW3, ICW4 8086.
    fn linux_init(p: &mut Pic) {
        for (port, v) in [(0x20, 0x11), (0x21, 0x30), (0x21, 0x04), (0x21, 0x01)] {
            p.write_port(port, v);
        }
        for (port, v) in [(0xA0, 0x11), (0xA1, 0x38), (0xA1, 0x02), (0xA1, 0x01)] {
            p.write_port(port, v);
        }
        p.write_port(0x21, 0x00);
        p.write_port(0xA1, 0x00);
    }

    #[test]
    fn an_uninitialised_pic_delivers_nothing() {
        let mut p = Pic::new();
        p.pulse(4);
        assert!(!p.intr());
    }

    #[test]
    fn an_edge_is_acked_then_eoi_lets_lower_priority_through() {
        let mut p = Pic::new();
        linux_init(&mut p);
        p.pulse(4);
        p.pulse(3);
        assert!(p.intr());
        assert_eq!(p.ack(), 0x33, "IRQ 3 outranks IRQ 4");
        // IRQ 3 in service blocks IRQ 4 (lower priority) until its EOI.
        assert!(!p.intr());
        p.write_port(0x20, 0x0B); // OCW3: read ISR
        assert_eq!(p.read_port(0x20), 1 << 3);
        p.write_port(0x20, 0x20); // non-specific EOI
        assert_eq!(p.read_port(0x20), 0);
        assert!(p.intr());
        assert_eq!(p.ack(), 0x34);
        p.write_port(0x20, 0x64); // specific EOI for IRQ 4
        assert!(!p.intr());
        // The edge was consumed: no second interrupt without a new pulse.
        assert_eq!(p.ack(), 0x37, "nothing pending: the spurious IRQ 7");
    }

    #[test]
    fn masking_and_the_slave_cascade() {
        let mut p = Pic::new();
        linux_init(&mut p);
        p.write_port(0xA1, 0xFF); // mask every slave line
        p.pulse(12);
        assert!(!p.intr());
        p.write_port(0xA1, 0x00);
        assert!(p.intr(), "unmasking delivers the pending request");
        assert_eq!(p.ack(), 0x3C);
        // Master IRQ 2 and slave IRQ 4 are in service: both EOIs needed.
        p.write_port(0xA0, 0x20);
        p.write_port(0x20, 0x20);
        p.write_port(0x21, 1 << 4);
        p.pulse(4);
        assert!(!p.intr(), "IMR bit 4 masks COM1's line");
        assert_eq!(p.read_port(0x21), 1 << 4);
    }

    #[test]
    fn level_lines_auto_eoi_and_state_round_trip() {
        let mut p = Pic::new();
        linux_init(&mut p);
        p.write_port(0x4D1, 0x08); // IRQ 11 level-triggered
        p.set_irq(11, true);
        assert_eq!(p.ack(), 0x3B);
        p.write_port(0xA0, 0x20);
        p.write_port(0x20, 0x20);
        assert!(p.intr(), "a level line still high requests again after EOI");
        p.set_irq(11, false);
        // The master latched the cascade's edge; the slave's request is gone by the INTA, so
        // the slave answers with its spurious IRQ 15, as the hardware does.
        assert_eq!(p.ack(), 0x3F);
        p.write_port(0x20, 0x20);
        assert!(!p.intr());
        // Auto-EOI (ICW4 bit 1): nothing stays in service.
        for (port, v) in [(0x20, 0x11), (0x21, 0x30), (0x21, 0x04), (0x21, 0x03)] {
            p.write_port(port, v);
        }
        p.pulse(1);
        assert_eq!(p.ack(), 0x31);
        p.write_port(0x20, 0x0B);
        assert_eq!(p.read_port(0x20), 0);
        let saved = p.save().unwrap();
        let mut q = Pic::new();
        q.restore(&saved).unwrap();
        assert_eq!(q, p);
        assert_eq!(q.id(), "pic");
        // Odd bytes never panic.
        for v in 0..=255u8 {
            q.write_port(0x20, v);
            q.write_port(0x21, v);
            q.write_port(0xA0, v);
            q.write_port(0xA1, v);
            let _ = q.ack();
        }
    }

    /// Found by kumo-fuzz (target `restore`): a restore took an initialisation step the 8259A
    /// has not (its next data byte then went nowhere) and a vector base with IRQ bits.
    #[test]
    fn impossible_states_are_refused_by_restore() {
        let mut p = Pic::new();
        linux_init(&mut p);
        let good = p.save().unwrap();
        for bad in [
            Pic { master: Chip { init_step: 49, ..good.master.clone() }, ..good.clone() },
            Pic { slave: Chip { init_step: 1, ..good.slave.clone() }, ..good.clone() },
            Pic { slave: Chip { base: 0x3a, ..good.slave.clone() }, ..good.clone() },
        ] {
            let mut q = Pic::new();
            let e = q.restore(&bad).unwrap_err().to_string();
            assert!(e.starts_with("pic: impossible"), "{e}");
            assert_eq!(q, Pic::new(), "a refused state changes nothing");
        }
    }
}
