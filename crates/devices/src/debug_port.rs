//! The guest → VMM result channel of kumo's own guests.
//!
//! - `EXIT_PORT` (0x501): a write of 1, 2 or 4 bytes ends the VM; the value is the exit code
//!   `kumo run` returns (little endian; 8-bit writes give 0..=255).
//! - `MARKER_PORT` (0x502): a byte write records a timing marker (1 = guest entry) for benchmarks.
//!
//! Reads return a signature so a guest can tell it runs under kumo: `'k'` from 0x501.

use crate::bus::BusDevice;
use crate::DeviceEvent;

pub const EXIT_PORT: u16 = 0x501;
pub const MARKER_PORT: u16 = 0x502;

/// Covers `EXIT_PORT..=MARKER_PORT`; insert it at `EXIT_PORT` with length 2.
#[derive(Default)]
pub struct DebugPort;

impl BusDevice for DebugPort {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset == 0 {
            data[0] = b'k';
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        let mut v = [0u8; 4];
        let n = data.len().min(4);
        v[..n].copy_from_slice(&data[..n]);
        let value = u32::from_le_bytes(v);
        match offset {
            0 => Some(DeviceEvent::GuestExit(value)),
            1 => Some(DeviceEvent::Marker(value as u8)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_of_each_width() {
        let mut d = DebugPort;
        assert_eq!(d.write(0, &[3]), Some(DeviceEvent::GuestExit(3)));
        assert_eq!(d.write(0, &[0x34, 0x12]), Some(DeviceEvent::GuestExit(0x1234)));
        assert_eq!(d.write(0, &1000u32.to_le_bytes()), Some(DeviceEvent::GuestExit(1000)));
        assert_eq!(d.write(1, &[1]), Some(DeviceEvent::Marker(1)));
        let mut b = [0u8; 1];
        d.read(0, &mut b);
        assert_eq!(b[0], b'k');
    }
}
