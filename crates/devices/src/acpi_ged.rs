//! The ACPI Generic Event Device (GED, `ACPI0013`) kumo's DSDT describes, and the CPU hotplug
//! registers behind `\_SB.CPUS` (crates/acpi builds the AML that drives them).
//!
//! One small MMIO block at [`GED_MMIO_BASE`], [`GED_MMIO_LEN`] bytes:
//!
//! | offset | size | register |
//! |--------|------|----------|
//! | 0x00 | 4 | `GEVT`: pending events ([`EVENT_CPU_HOTPLUG`], [`EVENT_POWER_BUTTON`]); a read returns them and clears them |
//! | 0x10 | 4 | `CSEL`: the vCPU the status register below is about |
//! | 0x14 | 1 | `CSTA`: the selected vCPU's status: bit 0 enabled, bit 1 insert pending, bit 2 remove pending (reads); writing bit 1 or 2 clears that request, writing bit 3 ejects the vCPU |
//!
//! kumo raises an event by setting its bit and signalling the GED's interrupt (an edge on a
//! legacy GSI, through an irqfd); the guest's `_EVT` reads `GEVT` and, for a CPU event, runs
//! `\_SB.CPUS.CSCN`, which selects each vCPU in turn and notifies the OS of a pending insert
//! (Device Check) or remove (Eject Request). The OS offlines a CPU it is asked to remove and
//! then calls its `_EJ0`, which writes the eject bit: the write returns
//! [`DeviceEvent::CpuEjected`] so the vCPU that ran it asks kumo to park the ejected vCPU.

use std::sync::{Arc, Condvar};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::DeviceEvent;

/// Guest-physical base of the register block (in the MMIO gap between the IOAPIC and the LAPIC,
/// where nothing else sits).
pub const GED_MMIO_BASE: u64 = 0xfed0_0000;
/// Length of the register block.
pub const GED_MMIO_LEN: u64 = 0x20;
/// The legacy GSI the GED interrupts on (ISA IRQ 5: free in kumo, and routed to both the
/// IOAPIC and the PIC, so it works with and without `noapic`).
pub const GED_GSI: u32 = 5;

/// `GEVT` bit: a vCPU has an insert or remove request pending.
pub const EVENT_CPU_HOTPLUG: u32 = 1 << 0;
/// `GEVT` bit: the power button was pressed.
pub const EVENT_POWER_BUTTON: u32 = 1 << 1;

/// Register offsets.
pub const REG_EVENTS: u64 = 0x00;
pub const REG_CPU_SELECT: u64 = 0x10;
pub const REG_CPU_STATUS: u64 = 0x14;

/// `CSTA` bits.
pub const CPU_ENABLED: u8 = 1 << 0;
pub const CPU_INSERTING: u8 = 1 << 1;
pub const CPU_REMOVING: u8 = 1 << 2;
pub const CPU_EJECT: u8 = 1 << 3;

/// One possible vCPU as the guest's ACPI sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuSlot {
    /// Present and usable (`_STA` 0xF); cleared by the guest's `_EJ0`.
    pub enabled: bool,
    /// kumo asks the guest to take it (Device Check); cleared once the guest saw it.
    pub inserting: bool,
    /// kumo asks the guest to give it up (Eject Request); cleared once the guest saw it.
    pub removing: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HotplugError {
    #[error("no vCPU {0}")]
    NoCpu(u32),
    #[error("vCPU 0 is the guest's boot CPU and cannot be removed")]
    BootCpu,
    #[error("cannot raise the GED interrupt: {0}")]
    Interrupt(String),
}

/// The GED and CPU hotplug registers. Shared as a bus device; kumo's side calls the methods
/// below with the device locked and waits on [`AcpiGed::changed`] for the guest's answers.
pub struct AcpiGed {
    events: u32,
    select: u32,
    cpus: Vec<CpuSlot>,
    irq: EventFd,
    changed: Arc<Condvar>,
    /// How many times the guest ejected a vCPU.
    ejects: u64,
}

impl AcpiGed {
    /// A GED for `cpus` possible vCPUs, all enabled, interrupting through `irq`.
    pub fn new(cpus: u32, irq: EventFd) -> AcpiGed {
        let slot = CpuSlot { enabled: true, ..CpuSlot::default() };
        AcpiGed {
            events: 0,
            select: 0,
            cpus: vec![slot; cpus as usize],
            irq,
            changed: Arc::new(Condvar::new()),
            ejects: 0,
        }
    }

    /// Signalled (with the device's lock released by the waiter) whenever the guest changes a
    /// vCPU's state: clears a request or ejects.
    pub fn changed(&self) -> Arc<Condvar> {
        self.changed.clone()
    }

    pub fn cpus(&self) -> &[CpuSlot] {
        &self.cpus
    }

    pub fn ejects(&self) -> u64 {
        self.ejects
    }

    fn raise(&mut self, event: u32) -> Result<(), HotplugError> {
        self.events |= event;
        self.irq.write(1).map_err(|e| HotplugError::Interrupt(e.to_string()))
    }

    /// Presses the ACPI power button: the guest's `_EVT` notifies `\_SB.PWRB` (0x80).
    pub fn press_power_button(&mut self) -> Result<(), HotplugError> {
        self.raise(EVENT_POWER_BUTTON)
    }

    /// Asks the guest to give vCPU `v` up (Eject Request). A vCPU already ejected stays so.
    pub fn request_remove(&mut self, v: u32) -> Result<(), HotplugError> {
        if v == 0 {
            return Err(HotplugError::BootCpu);
        }
        let slot = self.cpus.get_mut(v as usize).ok_or(HotplugError::NoCpu(v))?;
        if !slot.enabled {
            return Ok(());
        }
        slot.inserting = false;
        slot.removing = true;
        self.raise(EVENT_CPU_HOTPLUG)
    }

    /// Gives vCPU `v` (back) to the guest: enabled, with a Device Check pending. The caller must
    /// let the vCPU's thread run first.
    pub fn request_insert(&mut self, v: u32) -> Result<(), HotplugError> {
        let slot = self.cpus.get_mut(v as usize).ok_or(HotplugError::NoCpu(v))?;
        if slot.enabled && !slot.removing {
            return Ok(());
        }
        *slot = CpuSlot { enabled: true, inserting: true, removing: false };
        self.raise(EVENT_CPU_HOTPLUG)
    }

    fn status(&self) -> u8 {
        let Some(s) = self.cpus.get(self.select as usize) else { return 0 };
        ((s.enabled as u8) * CPU_ENABLED) | ((s.inserting as u8) * CPU_INSERTING) | ((s.removing as u8) * CPU_REMOVING)
    }

    fn write_status(&mut self, value: u8) -> Option<DeviceEvent> {
        let v = self.select;
        let slot = self.cpus.get_mut(v as usize)?;
        if value & CPU_INSERTING != 0 {
            slot.inserting = false;
        }
        if value & CPU_REMOVING != 0 {
            slot.removing = false;
        }
        let eject = value & CPU_EJECT != 0 && slot.enabled && v != 0;
        if eject {
            *slot = CpuSlot::default();
            self.ejects += 1;
        }
        self.changed.notify_all();
        eject.then_some(DeviceEvent::CpuEjected(v))
    }
}

/// Reads `len` little-endian bytes of `value` from byte `at` (accesses of any size and offset
/// inside a register see its bytes).
fn read_bytes(value: u32, at: u64, data: &mut [u8]) {
    let b = value.to_le_bytes();
    for (i, d) in data.iter_mut().enumerate() {
        *d = b.get(at as usize + i).copied().unwrap_or(0);
    }
}

impl BusDevice for AcpiGed {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            REG_EVENTS..=0x03 => {
                read_bytes(self.events, offset - REG_EVENTS, data);
                self.events = 0;
            }
            REG_CPU_SELECT..=0x13 => read_bytes(self.select, offset - REG_CPU_SELECT, data),
            REG_CPU_STATUS => read_bytes(self.status().into(), 0, data),
            _ => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        match offset {
            REG_CPU_SELECT..=0x13 => {
                let mut b = self.select.to_le_bytes();
                for (i, d) in data.iter().enumerate() {
                    if let Some(x) = b.get_mut((offset - REG_CPU_SELECT) as usize + i) {
                        *x = *d;
                    }
                }
                self.select = u32::from_le_bytes(b);
                None
            }
            REG_CPU_STATUS => self.write_status(data.first().copied().unwrap_or(0)),
            _ => None,
        }
    }
}

/// Waits, with `dev` locked through `guard`, until `done` holds or `limit` passes; returns
/// whether it holds. For kumo's side of a hotplug request.
pub fn wait_for<'a>(
    mut guard: std::sync::MutexGuard<'a, AcpiGed>,
    limit: Duration,
    mut done: impl FnMut(&AcpiGed) -> bool,
) -> (std::sync::MutexGuard<'a, AcpiGed>, bool) {
    let cv = guard.changed();
    let start = Instant::now();
    loop {
        if done(&guard) {
            return (guard, true);
        }
        let Some(left) = limit.checked_sub(start.elapsed()) else { return (guard, false) };
        guard = cv.wait_timeout(guard, left).unwrap_or_else(|p| p.into_inner()).0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ged(cpus: u32) -> AcpiGed {
        AcpiGed::new(cpus, EventFd::new(libc::EFD_NONBLOCK).unwrap())
    }

    fn read32(g: &mut AcpiGed, at: u64) -> u32 {
        let mut b = [0u8; 4];
        g.read(at, &mut b);
        u32::from_le_bytes(b)
    }

    fn status(g: &mut AcpiGed, v: u32) -> u8 {
        g.write(REG_CPU_SELECT, &v.to_le_bytes());
        let mut b = [0u8; 1];
        g.read(REG_CPU_STATUS, &mut b);
        b[0]
    }

    #[test]
    fn power_button_sets_its_event_bit_and_interrupts_once_read_it_clears() {
        let mut g = ged(1);
        g.press_power_button().unwrap();
        assert_eq!(g.irq.read().unwrap(), 1, "one interrupt");
        assert_eq!(read32(&mut g, REG_EVENTS), EVENT_POWER_BUTTON);
        assert_eq!(read32(&mut g, REG_EVENTS), 0, "reading cleared it");
    }

    #[test]
    fn all_cpus_start_enabled_and_unknown_ones_read_absent() {
        let mut g = ged(2);
        assert_eq!(status(&mut g, 0), CPU_ENABLED);
        assert_eq!(status(&mut g, 1), CPU_ENABLED);
        assert_eq!(status(&mut g, 7), 0);
        assert_eq!(read32(&mut g, REG_CPU_SELECT), 7);
    }

    #[test]
    fn remove_request_then_guest_acknowledges_and_ejects() {
        let mut g = ged(3);
        g.request_remove(2).unwrap();
        assert_eq!(read32(&mut g, REG_EVENTS), EVENT_CPU_HOTPLUG);
        assert_eq!(g.irq.read().unwrap(), 1);
        // CSCN: vCPU 1 has nothing pending, vCPU 2 a remove.
        assert_eq!(status(&mut g, 1), CPU_ENABLED);
        assert_eq!(status(&mut g, 2), CPU_ENABLED | CPU_REMOVING);
        assert_eq!(g.write(REG_CPU_STATUS, &[CPU_REMOVING]), None);
        assert_eq!(status(&mut g, 2), CPU_ENABLED);
        // The OS offlined it and runs _EJ0.
        assert_eq!(g.write(REG_CPU_STATUS, &[CPU_EJECT]), Some(DeviceEvent::CpuEjected(2)));
        assert_eq!(status(&mut g, 2), 0, "_STA reads absent after the eject");
        assert_eq!(g.ejects(), 1);
        // A second eject of a vCPU already gone does nothing.
        assert_eq!(g.write(REG_CPU_STATUS, &[CPU_EJECT]), None);
    }

    #[test]
    fn the_boot_cpu_and_unknown_cpus_cannot_be_removed() {
        let mut g = ged(2);
        assert_eq!(g.request_remove(0), Err(HotplugError::BootCpu));
        assert_eq!(g.request_remove(2), Err(HotplugError::NoCpu(2)));
        g.write(REG_CPU_SELECT, &0u32.to_le_bytes());
        assert_eq!(g.write(REG_CPU_STATUS, &[CPU_EJECT]), None, "a guest cannot eject vCPU 0");
        assert_eq!(status(&mut g, 0), CPU_ENABLED);
    }

    #[test]
    fn insert_after_eject_enables_with_a_device_check_pending() {
        let mut g = ged(2);
        g.request_remove(1).unwrap();
        g.write(REG_CPU_SELECT, &1u32.to_le_bytes());
        g.write(REG_CPU_STATUS, &[CPU_EJECT]);
        g.request_insert(1).unwrap();
        assert_eq!(status(&mut g, 1), CPU_ENABLED | CPU_INSERTING);
        g.write(REG_CPU_STATUS, &[CPU_INSERTING]);
        assert_eq!(status(&mut g, 1), CPU_ENABLED);
        assert_eq!(g.cpus()[1], CpuSlot { enabled: true, inserting: false, removing: false });
        // Inserting an enabled vCPU raises nothing.
        let _ = g.irq.read();
        g.request_insert(1).unwrap();
        assert!(g.irq.read().is_err(), "no interrupt");
    }

    #[test]
    fn byte_wide_select_writes_and_reads_see_each_byte() {
        let mut g = ged(1);
        g.write(REG_CPU_SELECT + 1, &[1]);
        assert_eq!(read32(&mut g, REG_CPU_SELECT), 0x100);
        let mut b = [0u8; 2];
        g.read(REG_CPU_SELECT + 1, &mut b);
        assert_eq!(b, [1, 0]);
    }

    #[test]
    fn a_waiter_sees_the_guests_eject() {
        let g = Arc::new(std::sync::Mutex::new(ged(2)));
        g.lock().unwrap().request_remove(1).unwrap();
        let g2 = g.clone();
        let t = std::thread::spawn(move || {
            let mut d = g2.lock().unwrap();
            d.write(REG_CPU_SELECT, &1u32.to_le_bytes());
            d.write(REG_CPU_STATUS, &[CPU_EJECT]);
        });
        let (d, ok) = wait_for(g.lock().unwrap(), Duration::from_secs(30), |d| !d.cpus()[1].enabled);
        assert!(ok);
        drop(d);
        t.join().unwrap();
        let (_guard, ok) = wait_for(g.lock().unwrap(), Duration::ZERO, |d| d.cpus()[1].enabled);
        assert!(!ok, "a condition that never holds times out");
    }
}
