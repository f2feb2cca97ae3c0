//! The I/O APIC as register logic, for `--irqchip user`: IOREGSEL/IOWIN at its MMIO page, 24
//! redirection entries, edge and level pins, Remote IRR cleared by the local APICs' EOI of a
//! level-triggered vector. An interrupt it sends is an [`Ipi`] (built as the MSI message the
//! entry describes, [`Ipi::from_msi`]), for the VMM to route like any other.

use serde::{Deserialize, Serialize};

use super::Ipi;
use crate::persist::{Persist, PersistError};

/// Where the IOAPIC's page is (the MADT says so).
pub const IOAPIC_BASE: u64 = 0xFEC0_0000;
pub const IOAPIC_MMIO_SIZE: u64 = 0x1000;
/// Redirection entries (input pins).
pub const IOAPIC_PINS: usize = 24;
/// The version register: version 0x11, maximum redirection entry 23.
pub const IOAPIC_VERSION: u32 = 0x0017_0011;

const IOREGSEL: u64 = 0x00;
const IOWIN: u64 = 0x10;

const MASKED: u64 = 1 << 16;
const LEVEL: u64 = 1 << 15;
const REMOTE_IRR: u64 = 1 << 14;
/// The bits a guest writes: vector, delivery mode, destination mode, polarity, trigger, mask,
/// destination; delivery status and Remote IRR are read-only.
const WRITABLE: u64 = 0xFF00_0000_0001_AFFF;

/// The IOAPIC. After reset every entry is masked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoApic {
    id: u32,
    ioregsel: u32,
    redir: [u64; IOAPIC_PINS],
    /// The pins' input levels (level-triggered pins re-deliver on EOI while asserted).
    asserted: u32,
}

impl Default for IoApic {
    fn default() -> Self {
        Self::new()
    }
}

impl IoApic {
    pub fn new() -> Self {
        IoApic { id: 0, ioregsel: 0, redir: [MASKED; IOAPIC_PINS], asserted: 0 }
    }

    /// Redirection entry `pin` (for tests and diagnostics).
    pub fn entry(&self, pin: usize) -> Option<u64> {
        self.redir.get(pin).copied()
    }

    /// The message entry `pin` sends, if it can send one now (unmasked, a deliverable mode).
    fn message(&self, pin: usize) -> Option<Ipi> {
        let e = self.redir[pin];
        if e & MASKED != 0 {
            return None;
        }
        let dest = (e >> 56) & 0xFF;
        let logical = (e >> 11) & 1;
        let address = super::DEFAULT_APIC_BASE | (dest << 12) | (logical << 2);
        // Vector, delivery mode and trigger keep their MSI data positions.
        let data = (e & 0x7FF) as u32 | ((e & LEVEL) as u32);
        Ipi::from_msi(address, data)
    }

    /// Entry `pin` fires: an edge pin sends its message; a level pin sends it unless its
    /// Remote IRR says the last one is not yet EOIed, and then sets Remote IRR.
    fn fire(&mut self, pin: usize) -> Option<Ipi> {
        let ipi = self.message(pin)?;
        if self.redir[pin] & LEVEL != 0 {
            if self.redir[pin] & REMOTE_IRR != 0 {
                return None;
            }
            self.redir[pin] |= REMOTE_IRR;
        }
        Some(ipi)
    }

    /// Sets pin `pin`'s input level. An edge pin fires on the rising edge, a level pin while
    /// high. Pins beyond 23 are ignored.
    pub fn set_irq(&mut self, pin: usize, high: bool) -> Option<Ipi> {
        if pin >= IOAPIC_PINS {
            return None;
        }
        let was = self.asserted & (1 << pin) != 0;
        if high {
            self.asserted |= 1 << pin;
        } else {
            self.asserted &= !(1 << pin);
        }
        let level = self.redir[pin] & LEVEL != 0;
        if high && (level || !was) {
            self.fire(pin)
        } else {
            None
        }
    }

    /// A pulse on pin `pin` (an irqfd's signal): raised and lowered at once.
    pub fn pulse(&mut self, pin: usize) -> Option<Ipi> {
        let ipi = self.set_irq(pin, true);
        self.set_irq(pin, false);
        ipi
    }

    /// A local APIC's EOI of level-triggered `vector`: Remote IRR clears on the entries with
    /// that vector; a pin still asserted fires again.
    pub fn eoi(&mut self, vector: u8) -> Vec<Ipi> {
        let mut out = Vec::new();
        for pin in 0..IOAPIC_PINS {
            let e = self.redir[pin];
            if e as u8 == vector && e & REMOTE_IRR != 0 {
                self.redir[pin] &= !REMOTE_IRR;
                if self.asserted & (1 << pin) != 0 {
                    out.extend(self.fire(pin));
                }
            }
        }
        out
    }

    fn read_reg(&self) -> u32 {
        match self.ioregsel {
            0 => self.id << 24,
            1 => IOAPIC_VERSION,
            2 => self.id << 24, // arbitration id
            r @ 0x10..=0x3F => {
                let e = self.redir[(r as usize - 0x10) / 2];
                if r % 2 == 0 {
                    e as u32
                } else {
                    (e >> 32) as u32
                }
            }
            _ => 0,
        }
    }

    /// A write to the selected register; unmasking an asserted level pin fires it.
    fn write_reg(&mut self, v: u32) -> Option<Ipi> {
        match self.ioregsel {
            0 => self.id = (v >> 24) & 0xF,
            r @ 0x10..=0x3F => {
                let pin = (r as usize - 0x10) / 2;
                let old = self.redir[pin];
                let new =
                    if r % 2 == 0 { (old & !0xFFFF_FFFF) | v as u64 } else { (old & 0xFFFF_FFFF) | ((v as u64) << 32) };
                self.redir[pin] = (old & !WRITABLE) | (new & WRITABLE);
                if self.redir[pin] & LEVEL == 0 {
                    self.redir[pin] &= !REMOTE_IRR;
                }
                let level_high = self.redir[pin] & LEVEL != 0 && self.asserted & (1 << pin) != 0;
                if level_high && old & MASKED != 0 && self.redir[pin] & MASKED == 0 {
                    return self.fire(pin);
                }
            }
            _ => {} // version and arbitration are read-only
        }
        None
    }

    /// A read of the MMIO page: IOREGSEL at 0x00, IOWIN at 0x10; anything else reads 0.
    pub fn read_mmio(&mut self, offset: u64, data: &mut [u8]) {
        let v = match offset {
            IOREGSEL => self.ioregsel,
            IOWIN => self.read_reg(),
            _ => 0,
        };
        let b = v.to_le_bytes();
        for (i, d) in data.iter_mut().enumerate() {
            *d = b.get(i).copied().unwrap_or(0);
        }
    }

    /// A write to the MMIO page; may send an interrupt (a level pin unmasked while asserted).
    pub fn write_mmio(&mut self, offset: u64, data: &[u8]) -> Option<Ipi> {
        let mut b = [0u8; 4];
        let n = data.len().min(4);
        b[..n].copy_from_slice(&data[..n]);
        let v = u32::from_le_bytes(b);
        match offset {
            IOREGSEL => {
                self.ioregsel = v & 0xFF;
                None
            }
            IOWIN => self.write_reg(v),
            _ => None,
        }
    }
}

/// The IOAPIC's saved state (`ioapic` in snapshots).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoApicState {
    pub id: u32,
    pub ioregsel: u32,
    pub redir: Vec<u64>,
    pub asserted: u32,
}

impl IoApic {
    pub fn state(&self) -> IoApicState {
        IoApicState { id: self.id, ioregsel: self.ioregsel, redir: self.redir.to_vec(), asserted: self.asserted }
    }

    pub fn set_state(&mut self, s: &IoApicState) -> Result<(), String> {
        if s.redir.len() != IOAPIC_PINS {
            return Err(format!("IOAPIC state has {} entries, not {IOAPIC_PINS}", s.redir.len()));
        }
        self.id = s.id & 0xF;
        self.ioregsel = s.ioregsel & 0xFF;
        for (d, v) in self.redir.iter_mut().zip(&s.redir) {
            *d = v & (WRITABLE | REMOTE_IRR);
            // Remote IRR exists only on level entries (a write of an edge entry clears it).
            if *d & LEVEL == 0 {
                *d &= !REMOTE_IRR;
            }
        }
        self.asserted = s.asserted & ((1 << IOAPIC_PINS) - 1);
        Ok(())
    }
}

impl Persist for IoApic {
    type State = IoApicState;
    fn id(&self) -> String {
        "ioapic".into()
    }
    fn save(&self) -> Result<IoApicState, PersistError> {
        Ok(self.state())
    }
    fn restore(&mut self, s: &IoApicState) -> Result<(), PersistError> {
        self.set_state(s).map_err(|e| PersistError::component("ioapic", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apic::{DeliveryMode, DestMode, Destination};

    fn write(io: &mut IoApic, reg: u32, v: u32) -> Option<Ipi> {
        io.write_mmio(IOREGSEL, &reg.to_le_bytes());
        io.write_mmio(IOWIN, &v.to_le_bytes())
    }

    fn read(io: &mut IoApic, reg: u32) -> u32 {
        io.write_mmio(IOREGSEL, &reg.to_le_bytes());
        let mut b = [0u8; 4];
        io.read_mmio(IOWIN, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn registers_through_ioregsel_and_iowin() {
        let mut io = IoApic::new();
        assert_eq!(read(&mut io, 1), IOAPIC_VERSION);
        assert_eq!(read(&mut io, 0x10), MASKED as u32, "masked after reset");
        write(&mut io, 0x10 + 2 * 4, 0x0000_0031 | (1 << 14) | (1 << 12));
        write(&mut io, 0x11 + 2 * 4, 0x0100_0000);
        assert_eq!(read(&mut io, 0x18), 0x31, "Remote IRR and delivery status are read-only");
        assert_eq!(read(&mut io, 0x19), 0x0100_0000);
        write(&mut io, 1, 0); // read-only
        assert_eq!(read(&mut io, 1), IOAPIC_VERSION);
        write(&mut io, 0, 0x0500_0000);
        assert_eq!(read(&mut io, 0), 0x0500_0000);
        assert_eq!(read(&mut io, 0x40), 0, "beyond the table");
    }

    #[test]
    fn edge_pin_sends_its_message_on_each_pulse_and_never_while_masked() {
        let mut io = IoApic::new();
        assert_eq!(io.pulse(4), None, "masked");
        write(&mut io, 0x18, 0x24); // pin 4: vector 0x24, fixed, physical, edge, unmasked
        write(&mut io, 0x19, 1 << 24); // to APIC 1
        let ipi = io.pulse(4).expect("sent");
        assert_eq!(ipi.vector, 0x24);
        assert_eq!(ipi.mode, DeliveryMode::Fixed);
        assert!(!ipi.level_triggered);
        assert_eq!(ipi.dest, Destination::Field(1, DestMode::Physical));
        assert!(io.pulse(4).is_some(), "edge: every pulse");
        // Held high: one edge, one message.
        assert!(io.set_irq(4, true).is_some());
        assert!(io.set_irq(4, true).is_none());
        assert_eq!(io.pulse(99), None, "no such pin");
    }

    #[test]
    fn level_pin_waits_for_eoi_through_remote_irr() {
        let mut io = IoApic::new();
        write(&mut io, 0x10 + 2 * 9, 0x39 | (1 << 15) | (1 << 11)); // level, logical
        write(&mut io, 0x11 + 2 * 9, 0x01 << 24);
        let ipi = io.set_irq(9, true).expect("sent");
        assert!(ipi.level_triggered);
        assert_eq!(ipi.dest, Destination::Field(1, DestMode::Logical));
        assert_ne!(io.entry(9).unwrap() & REMOTE_IRR, 0);
        assert!(io.set_irq(9, true).is_none(), "Remote IRR holds it");
        assert!(io.eoi(0x40).is_empty(), "another vector");
        // EOI while still asserted: delivered again.
        assert_eq!(io.eoi(0x39).len(), 1);
        io.set_irq(9, false);
        assert!(io.eoi(0x39).is_empty(), "lowered: nothing more");
        assert_eq!(io.entry(9).unwrap() & REMOTE_IRR, 0);
    }

    #[test]
    fn unmasking_an_asserted_level_pin_fires_and_reserved_modes_send_nothing() {
        let mut io = IoApic::new();
        io.set_irq(3, true);
        assert!(write(&mut io, 0x16, 0x33 | (1 << 15) | MASKED as u32).is_none());
        assert!(write(&mut io, 0x16, 0x33 | (1 << 15)).is_some(), "unmasked while high");
        write(&mut io, 0x18, 0x44 | (0b011 << 8)); // reserved delivery mode
        assert!(io.pulse(4).is_none());
        write(&mut io, 0x18, 0x05); // vector below 16
        assert!(io.pulse(4).is_none());
    }

    #[test]
    fn state_round_trips() {
        let mut io = IoApic::new();
        write(&mut io, 0x10 + 2 * 2, 0x50 | (1 << 15));
        io.set_irq(2, true);
        let s = io.save().unwrap();
        let mut b = IoApic::new();
        b.restore(&s).unwrap();
        assert_eq!(b, io);
        let bad = IoApicState { redir: vec![0; 3], ..s };
        assert!(b.restore(&bad).is_err());
    }

    /// Found by kumo-fuzz (target `restore`): a restored edge entry kept Remote IRR, which
    /// only level entries have.
    #[test]
    fn restore_drops_remote_irr_of_edge_entries() {
        let mut s = IoApic::new().state();
        s.redir[2] = 0x59 | REMOTE_IRR;
        s.redir[3] = 0x5a | REMOTE_IRR | LEVEL;
        let mut io = IoApic::new();
        io.restore(&s).unwrap();
        assert_eq!(io.entry(2), Some(0x59));
        assert_eq!(io.entry(3), Some(0x5a | REMOTE_IRR | LEVEL));
    }
}
