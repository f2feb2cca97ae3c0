//! The ACPI sleep registers of kumo's hardware-reduced FADT: how a guest powers itself off.
//!
//! A hardware-reduced platform has no PM1 blocks; the FADT's `SLEEP_CONTROL_REG` and
//! `SLEEP_STATUS_REG` take their place. kumo puts both in one byte-wide I/O port pair at
//! [`SLEEP_PORT`] and declares `\_S5` with sleep type [`S5_SLEEP_TYPE`] in the DSDT. To enter
//! S5 (soft off) the OS writes `SLP_TYP << 2 | SLP_EN` to the control register (Linux:
//! `acpi_hw_extended_sleep`, after `poweroff`); that write returns
//! [`DeviceEvent::PowerOff`] and the VM ends as powered off. kumo offers no other sleep state,
//! so any other type is ignored (the guest's write is a no-op, as on hardware without S1–S4).
//!
//! | port | register |
//! |------|----------|
//! | `SLEEP_PORT` | `SLEEP_CONTROL_REG`: bits 2–4 `SLP_TYPx`, bit 5 `SLP_EN` (write); reads 0 |
//! | `SLEEP_PORT + 1` | `SLEEP_STATUS_REG`: bit 7 `WAK_STS`; always 0 (kumo never wakes a sleeping VM) |

use crate::bus::BusDevice;
use crate::DeviceEvent;

/// The control register's port; the status register is the next one.
pub const SLEEP_PORT: u16 = 0x600;
/// Ports the device covers.
pub const SLEEP_PORT_LEN: u64 = 2;
/// `\_S5`'s `SLP_TYPa`: the only sleep type kumo acts on.
pub const S5_SLEEP_TYPE: u8 = 5;

const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7 << SLP_TYP_SHIFT;
const SLP_EN: u8 = 1 << 5;

/// The sleep control and status registers (stateless: nothing to save or migrate).
#[derive(Debug, Default)]
pub struct AcpiSleep;

impl BusDevice for AcpiSleep {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        let (0, &[value, ..]) = (offset, data) else { return None };
        let typ = (value & SLP_TYP_MASK) >> SLP_TYP_SHIFT;
        (value & SLP_EN != 0 && typ == S5_SLEEP_TYPE).then_some(DeviceEvent::PowerOff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s5_with_slp_en_powers_off_and_nothing_else_does() {
        let mut d = AcpiSleep;
        // What Linux writes for \_S5 = 5: (5 << 2) | SLP_EN.
        assert_eq!(d.write(0, &[0x34]), Some(DeviceEvent::PowerOff));
        assert_eq!(d.write(0, &[0x34, 0]), Some(DeviceEvent::PowerOff), "a wider write");
        assert_eq!(d.write(0, &[5 << 2]), None, "SLP_TYP without SLP_EN");
        for typ in [0u8, 1, 3, 4, 7] {
            assert_eq!(d.write(0, &[(typ << 2) | SLP_EN]), None, "S{typ} is not offered");
        }
        assert_eq!(d.write(1, &[0x34]), None, "the status register");
        assert_eq!(d.write(0, &[]), None, "an empty write");
        let mut b = [0xffu8; 2];
        d.read(1, &mut b);
        assert_eq!(b, [0, 0], "never woken");
    }
}
