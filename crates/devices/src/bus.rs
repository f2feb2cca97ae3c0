//! The address buses a vCPU's exits dispatch through: one [`Bus`] type for port I/O and for
//! MMIO. A bus maps non-overlapping address ranges to devices; a device sees the offset of an
//! access inside its own range. [`Buses`] is the pair a vCPU carries.
//!
//! Unclaimed accesses behave as on a PC: reads return all ones, writes are dropped; both are
//! logged at debug level so a guest probing for hardware kumo lacks can be seen.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::DeviceEvent;

/// A device on a bus. `offset` is relative to the start of the range it was inserted at.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A write may ask the VMM to act (guest exit, timing marker).
    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent>;
}

/// A device shared between a bus and whoever else drives it (the device manager, snapshots).
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Which address space a bus decodes: only used in messages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusKind {
    Pio,
    Mmio,
}

impl std::fmt::Display for BusKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BusKind::Pio => "port I/O",
            BusKind::Mmio => "MMIO",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("{kind} range {base:#x}+{len:#x} overlaps the device at {other:#x}+{other_len:#x}")]
    Overlap { kind: BusKind, base: u64, len: u64, other: u64, other_len: u64 },
    #[error("{kind} range at {base:#x} is empty or wraps past the end of the address space (length {len:#x})")]
    BadRange { kind: BusKind, base: u64, len: u64 },
    #[error("no {kind} device at {0:#x}", kind = .1)]
    NotFound(u64, BusKind),
}

struct Entry {
    len: u64,
    dev: SharedDevice,
}

/// Address ranges → devices. Keyed by base address, so a lookup is one ordered-map search.
pub struct Bus {
    kind: BusKind,
    entries: BTreeMap<u64, Entry>,
}

fn lock(d: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    d.lock().unwrap_or_else(|p| p.into_inner())
}

impl Bus {
    pub fn new(kind: BusKind) -> Self {
        Bus { kind, entries: BTreeMap::new() }
    }

    pub fn kind(&self) -> BusKind {
        self.kind
    }

    /// Puts `dev` at `[base, base + len)`. Refuses empty, wrapping and overlapping ranges.
    pub fn insert(&mut self, base: u64, len: u64, dev: SharedDevice) -> Result<(), BusError> {
        let kind = self.kind;
        let end = base.checked_add(len).filter(|_| len > 0).ok_or(BusError::BadRange { kind, base, len })?;
        // Only the neighbours can overlap: the last range starting before `end`.
        if let Some((&other, e)) = self.entries.range(..end).next_back() {
            if other + e.len > base {
                return Err(BusError::Overlap { kind, base, len, other, other_len: e.len });
            }
        }
        self.entries.insert(base, Entry { len, dev });
        Ok(())
    }

    /// Takes the device at `base` off the bus (a PCI BAR being moved, a device unplugged).
    pub fn remove(&mut self, base: u64) -> Result<SharedDevice, BusError> {
        self.entries.remove(&base).map(|e| e.dev).ok_or(BusError::NotFound(base, self.kind))
    }

    /// The device whose range holds `addr`, with the range's base.
    pub fn lookup(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let (&base, e) = self.entries.range(..=addr).next_back()?;
        (addr - base < e.len).then_some((base, &e.dev))
    }

    /// Reads `data.len()` bytes at `addr`; an unclaimed address reads all ones. Returns whether a
    /// device answered.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.lookup(addr) {
            Some((base, dev)) => {
                lock(dev).read(addr - base, data);
                true
            }
            None => {
                tracing::debug!(bus = %self.kind, addr = format_args!("{addr:#x}"), len = data.len(), "unclaimed read");
                data.fill(0xff);
                false
            }
        }
    }

    /// Writes `data` at `addr`; a write to an unclaimed address is dropped.
    pub fn write(&self, addr: u64, data: &[u8]) -> Option<DeviceEvent> {
        let Some((base, dev)) = self.lookup(addr) else {
            tracing::debug!(bus = %self.kind, addr = format_args!("{addr:#x}"), len = data.len(), "unclaimed write");
            return None;
        };
        lock(dev).write(addr - base, data)
    }
}

/// The two buses a vCPU dispatches its I/O exits to.
pub struct Buses {
    pub pio: Bus,
    pub mmio: Bus,
}

impl Default for Buses {
    fn default() -> Self {
        Buses { pio: Bus::new(BusKind::Pio), mmio: Bus::new(BusKind::Mmio) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset as u8));
        }
        fn write(&mut self, _offset: u64, data: &[u8]) -> Option<DeviceEvent> {
            self.0 = data[0];
            (data[0] == 0xee).then_some(DeviceEvent::GuestExit(7))
        }
    }

    fn reg(v: u8) -> SharedDevice {
        Arc::new(Mutex::new(Reg(v)))
    }

    #[test]
    fn dispatches_by_range_and_offset() {
        let mut bus = Bus::new(BusKind::Pio);
        bus.insert(0x10, 4, reg(1)).unwrap();
        bus.insert(0x20, 1, reg(5)).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x12, &mut b));
        assert_eq!(b[0], 3);
        assert_eq!(bus.write(0x20, &[9]), None);
        assert!(bus.read(0x20, &mut b));
        assert_eq!(b[0], 9);
        assert_eq!(bus.write(0x20, &[0xee]), Some(DeviceEvent::GuestExit(7)));
    }

    #[test]
    fn lookup_finds_the_range_holding_an_address() {
        let mut bus = Bus::new(BusKind::Mmio);
        bus.insert(0xd000_0000, 0x1000, reg(0)).unwrap();
        bus.insert(0xd000_2000, 0x1000, reg(0)).unwrap();
        assert_eq!(bus.lookup(0xd000_0000).map(|x| x.0), Some(0xd000_0000));
        assert_eq!(bus.lookup(0xd000_0fff).map(|x| x.0), Some(0xd000_0000));
        assert!(bus.lookup(0xd000_1000).is_none(), "the gap between ranges");
        assert_eq!(bus.lookup(0xd000_2abc).map(|x| x.0), Some(0xd000_2000));
        assert!(bus.lookup(0xcfff_ffff).is_none());
        assert!(bus.lookup(0xd000_3000).is_none());
    }

    #[test]
    fn unclaimed_addresses_float_high() {
        for kind in [BusKind::Pio, BusKind::Mmio] {
            let bus = Bus::new(kind);
            let mut b = [0u8; 4];
            assert!(!bus.read(0x80, &mut b));
            assert_eq!(b, [0xff; 4]);
            assert_eq!(bus.write(0x80, &[1]), None);
        }
    }

    #[test]
    fn refuses_overlaps_and_bad_ranges() {
        let mut bus = Bus::new(BusKind::Pio);
        bus.insert(0x3f8, 8, reg(0)).unwrap();
        let overlap = |base, len| BusError::Overlap { kind: BusKind::Pio, base, len, other: 0x3f8, other_len: 8 };
        assert_eq!(bus.insert(0x3ff, 2, reg(0)), Err(overlap(0x3ff, 2)), "tail of the range");
        assert_eq!(bus.insert(0x3f0, 9, reg(0)), Err(overlap(0x3f0, 9)), "head of the range");
        assert_eq!(bus.insert(0x3f0, 0x20, reg(0)), Err(overlap(0x3f0, 0x20)), "covers it");
        assert_eq!(bus.insert(0x3fa, 1, reg(0)), Err(overlap(0x3fa, 1)), "inside it");
        bus.insert(0x3f0, 8, reg(0)).unwrap();
        bus.insert(0x400, 1, reg(0)).unwrap();
        assert_eq!(bus.insert(0x500, 0, reg(0)), Err(BusError::BadRange { kind: BusKind::Pio, base: 0x500, len: 0 }));
        assert!(matches!(bus.insert(u64::MAX, 2, reg(0)), Err(BusError::BadRange { .. })));
        let e = bus.insert(0x3fa, 1, reg(0)).unwrap_err().to_string();
        assert_eq!(e, "port I/O range 0x3fa+0x1 overlaps the device at 0x3f8+0x8");
    }

    #[test]
    fn removed_ranges_can_be_reused() {
        let mut bus = Bus::new(BusKind::Mmio);
        bus.insert(0x1000, 0x100, reg(0)).unwrap();
        bus.remove(0x1000).unwrap();
        assert!(bus.lookup(0x1000).is_none());
        assert!(matches!(bus.remove(0x1000), Err(BusError::NotFound(0x1000, BusKind::Mmio))));
        bus.insert(0x1080, 0x100, reg(0)).unwrap();
    }
}
