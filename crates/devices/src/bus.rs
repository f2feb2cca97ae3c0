//! Port I/O bus: maps port ranges to devices.

use std::sync::{Arc, Mutex};

use crate::DeviceEvent;

/// A device on the port I/O bus. `offset` is relative to the start of its range.
pub trait PioDevice: Send {
    fn read(&mut self, offset: u16, data: &mut [u8]);
    fn write(&mut self, offset: u16, data: &[u8]) -> Option<DeviceEvent>;
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("port range {base:#x}+{len} overlaps an existing device")]
    Overlap { base: u16, len: u16 },
    #[error("empty port range at {0:#x}")]
    Empty(u16),
}

struct Entry {
    base: u16,
    len: u16,
    dev: Arc<Mutex<dyn PioDevice>>,
}

/// Ranges are few (a handful of devices), so a sorted vector beats a tree here.
#[derive(Default)]
pub struct PioBus {
    entries: Vec<Entry>,
}

impl PioBus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, base: u16, len: u16, dev: Arc<Mutex<dyn PioDevice>>) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base as u32 + len as u32;
        if self.entries.iter().any(|e| (base as u32) < e.base as u32 + e.len as u32 && (e.base as u32) < end) {
            return Err(BusError::Overlap { base, len });
        }
        self.entries.push(Entry { base, len, dev });
        self.entries.sort_by_key(|e| e.base);
        Ok(())
    }

    fn find(&self, port: u16) -> Option<&Entry> {
        self.entries.iter().find(|e| port >= e.base && (port as u32) < e.base as u32 + e.len as u32)
    }

    /// Reads from an unclaimed port return all ones, as on real hardware.
    pub fn read(&self, port: u16, data: &mut [u8]) -> bool {
        match self.find(port) {
            Some(e) => {
                e.dev.lock().unwrap_or_else(|p| p.into_inner()).read(port - e.base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Writes to an unclaimed port are dropped.
    pub fn write(&self, port: u16, data: &[u8]) -> Option<DeviceEvent> {
        let e = self.find(port)?;
        e.dev.lock().unwrap_or_else(|p| p.into_inner()).write(port - e.base, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl PioDevice for Reg {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset as u8));
        }
        fn write(&mut self, _offset: u16, data: &[u8]) -> Option<DeviceEvent> {
            self.0 = data[0];
            (data[0] == 0xee).then_some(DeviceEvent::GuestExit(7))
        }
    }

    #[test]
    fn dispatches_by_range_and_offset() {
        let mut bus = PioBus::new();
        bus.insert(0x10, 4, Arc::new(Mutex::new(Reg(1)))).unwrap();
        bus.insert(0x20, 1, Arc::new(Mutex::new(Reg(5)))).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x12, &mut b));
        assert_eq!(b[0], 3);
        assert_eq!(bus.write(0x20, &[9]), None);
        assert!(bus.read(0x20, &mut b));
        assert_eq!(b[0], 9);
        assert_eq!(bus.write(0x20, &[0xee]), Some(DeviceEvent::GuestExit(7)));
    }

    #[test]
    fn unclaimed_ports_float_high() {
        let bus = PioBus::new();
        let mut b = [0u8; 2];
        assert!(!bus.read(0x80, &mut b));
        assert_eq!(b, [0xff, 0xff]);
        assert_eq!(bus.write(0x80, &[1]), None);
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = PioBus::new();
        bus.insert(0x3f8, 8, Arc::new(Mutex::new(Reg(0)))).unwrap();
        assert_eq!(bus.insert(0x3ff, 2, Arc::new(Mutex::new(Reg(0)))), Err(BusError::Overlap { base: 0x3ff, len: 2 }));
        assert_eq!(bus.insert(0x400, 0, Arc::new(Mutex::new(Reg(0)))), Err(BusError::Empty(0x400)));
        bus.insert(0xfff0, 0x10, Arc::new(Mutex::new(Reg(0)))).unwrap();
    }
}
