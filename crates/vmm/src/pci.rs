//! A VM's PCI: bus 0 (`kumo_devices::pci`) reached through configuration mechanism #1 (ports
//! 0xCF8..0xCFF) and ECAM, BARs placed in the 32-bit MMIO window by a `BarAllocator`, and the
//! KVM side of what the guest does to them.
//!
//! The whole BAR window is one device on the MMIO bus ([`BarWindow`]) that dispatches each access
//! to the BAR placed there now, so a BAR the guest moves changes a table here, not the buses
//! (which vCPU threads share without a lock). Doorbells registered as ioeventfds
//! ([`Pci::add_doorbells`]) follow their BAR: moved with it, and re-registered after a restore.

use std::sync::{Arc, Mutex, RwLock};

use kumo_devices::pci::{
    BarAllocator, BarKind, BarMove, BarRelocation, PciBus, PciConfigIo, PciConfigMmio, PlacedBar, ECAM_BUS0_SIZE,
};
use kumo_devices::{BusDevice, Buses, DeviceEvent, DeviceState, PersistDyn, PersistError, SharedDevice};
use kumo_vm::interrupts::{Datamatch, Interrupts, IoAddress};
use kumo_vm::layout::MemoryLayout;
use vmm_sys_util::eventfd::EventFd;

use crate::{Error, Result};
use kumo_sandbox::lock;

/// Configuration mechanism #1's ports.
pub const CONFIG_IO_PORT: u64 = 0xcf8;
/// ECAM for bus 0, at the top of the 32-bit MMIO window; BARs go below it.
pub const ECAM_SIZE: u64 = ECAM_BUS0_SIZE;

/// A device's doorbells inside one of its BARs: `(offset in the BAR, eventfd)`.
struct Doorbells {
    slot: u8,
    bar: usize,
    bells: Vec<(u64, EventFd)>,
    /// The BAR address they are registered at now.
    at: Option<u64>,
}

/// What moves when a BAR moves: the window's table and the doorbells.
struct Placement {
    window: (u64, u64),
    bars: RwLock<Vec<PlacedBar>>,
    doorbells: Mutex<Vec<Doorbells>>,
    irq: Arc<Interrupts>,
}

impl Placement {
    fn bars(&self) -> std::sync::RwLockWriteGuard<'_, Vec<PlacedBar>> {
        self.bars.write().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, d: &mut Doorbells, addr: Option<u64>) {
        if d.at == addr {
            return;
        }
        if let Some(old) = d.at.take() {
            for (off, evt) in &d.bells {
                let _ = self.irq.unregister_ioeventfd(evt, IoAddress::Mmio(old + off), Datamatch::Any);
            }
        }
        let Some(new) = addr else { return };
        for (off, evt) in &d.bells {
            if let Err(e) = self.irq.register_ioeventfd(evt, IoAddress::Mmio(new + off), Datamatch::Any) {
                // The doorbell still works through the BAR's MMIO exit, only slower.
                tracing::warn!(slot = d.slot, "doorbell at {:#x} not an ioeventfd: {e}", new + off);
            }
        }
        d.at = Some(new);
    }

    /// Re-registers every doorbell at its BAR's current address.
    fn sync_doorbells(&self) {
        let bars: Vec<(u8, usize, u64)> = self.bars().iter().map(|b| (b.slot, b.bar, b.addr)).collect();
        for d in lock(&self.doorbells).iter_mut() {
            let addr = bars.iter().find(|b| b.0 == d.slot && b.1 == d.bar).map(|b| b.2);
            self.register(d, addr);
        }
    }
}

impl BarRelocation for Placement {
    fn move_bar(&self, slot: u8, mv: BarMove, region: SharedDevice) {
        if mv.kind == BarKind::Io {
            tracing::warn!(slot, bar = mv.bar, "I/O BARs are not decoded");
            return;
        }
        {
            let mut bars = self.bars();
            bars.retain(|b| !(b.slot == slot && b.bar == mv.bar));
            let (base, len) = self.window;
            if mv.new < base || mv.new.saturating_add(mv.size) > base + len {
                tracing::warn!(slot, bar = mv.bar, "BAR moved to {:#x}, outside the PCI window: not decoded", mv.new);
            }
            bars.push(PlacedBar { slot, bar: mv.bar, kind: mv.kind, addr: mv.new, size: mv.size, region });
        }
        self.sync_doorbells();
    }
}

/// The BAR window on the MMIO bus.
struct BarWindow(Arc<Placement>);

impl BarWindow {
    fn find(&self, offset: u64) -> Option<(SharedDevice, u64)> {
        let addr = self.0.window.0 + offset;
        let bars = self.0.bars.read().unwrap_or_else(|p| p.into_inner());
        bars.iter().find(|b| addr >= b.addr && addr - b.addr < b.size).map(|b| (b.region.clone(), addr - b.addr))
    }
}

impl BusDevice for BarWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.find(offset) {
            Some((dev, off)) => lock(&dev).read(off, data),
            None => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        let (dev, off) = self.find(offset)?;
        let r = lock(&dev).write(off, data);
        r
    }
}

/// A PCI function's state saved through the bus's handle on it.
struct PciPersist(kumo_devices::pci::SharedPciDevice);

impl PersistDyn for PciPersist {
    fn id(&self) -> String {
        lock(&self.0).id()
    }

    fn save_dyn(&self) -> std::result::Result<DeviceState, PersistError> {
        lock(&self.0).save_dyn()
    }

    fn check_kind(&self, state: &DeviceState) -> std::result::Result<(), PersistError> {
        lock(&self.0).check_kind(state)
    }

    fn restore_dyn(&mut self, state: &DeviceState) -> std::result::Result<(), PersistError> {
        lock(&self.0).restore_dyn(state)
    }
}

/// A VM's PCI bus and what places its BARs.
pub struct Pci {
    bus: Arc<Mutex<PciBus>>,
    alloc: BarAllocator,
    placement: Arc<Placement>,
    ecam_base: u64,
}

impl Pci {
    /// Puts mechanism #1 on the port bus, ECAM at the top of `layout`'s 32-bit MMIO window and
    /// the BAR window below it on the MMIO bus.
    pub fn new(layout: &MemoryLayout, irq: Arc<Interrupts>, buses: &mut Buses) -> Result<Pci> {
        let w = layout.mmio32();
        let ecam_base = (w.end - ECAM_SIZE) & !(ECAM_SIZE - 1);
        let window = (w.start, ecam_base - w.start);
        let err = |e: kumo_devices::pci::PciError| Error::Devices(format!("PCI: {e}"));
        let alloc = BarAllocator::new(window).map_err(err)?;
        let placement = Arc::new(Placement { window, bars: RwLock::default(), doorbells: Mutex::default(), irq });
        let mut bus = PciBus::new();
        bus.set_relocation(placement.clone());
        let bus = Arc::new(Mutex::new(bus));
        let bus_err = |e: kumo_devices::BusError| Error::Devices(format!("PCI: {e}"));
        buses.pio.insert(CONFIG_IO_PORT, 8, Arc::new(Mutex::new(PciConfigIo::new(bus.clone())))).map_err(bus_err)?;
        buses
            .mmio
            .insert(ecam_base, ECAM_SIZE, Arc::new(Mutex::new(PciConfigMmio::new(bus.clone()))))
            .map_err(bus_err)?;
        buses.mmio.insert(window.0, window.1, Arc::new(Mutex::new(BarWindow(placement.clone())))).map_err(bus_err)?;
        Ok(Pci { bus, alloc, placement, ecam_base })
    }

    /// ECAM's base address (for an ACPI MCFG table).
    pub fn ecam_base(&self) -> u64 {
        self.ecam_base
    }

    /// The 32-bit window BARs are placed in (below the ECAM).
    pub fn bar_window(&self) -> std::ops::Range<u64> {
        let (start, len) = self.placement.window;
        start..start + len
    }

    /// Places `dev`'s BARs and puts it on the bus at the lowest free device number.
    pub fn add(&mut self, dev: Arc<Mutex<dyn kumo_devices::pci::PciDevice>>) -> Result<u8> {
        let err = |e: kumo_devices::pci::PciError| Error::Devices(format!("PCI: {e}"));
        self.alloc.place(lock(&dev).config_mut()).map_err(err)?;
        let slot = lock(&self.bus).add(None, dev).map_err(err)?;
        self.refresh();
        Ok(slot)
    }

    /// Registers doorbells `(offset, eventfd)` inside BAR `bar` of device `slot` as ioeventfds,
    /// now and wherever the BAR goes.
    pub fn add_doorbells(&self, slot: u8, bar: usize, bells: Vec<(u64, EventFd)>) {
        lock(&self.placement.doorbells).push(Doorbells { slot, bar, bells, at: None });
        self.placement.sync_doorbells();
    }

    /// Reads every BAR's placement from the config spaces again: after a restore, whose BARs
    /// are where the guest had them.
    pub fn refresh(&self) {
        let placed = lock(&self.bus).bar_regions();
        *self.placement.bars() = placed.into_iter().filter(|b| b.kind != BarKind::Io).collect();
        self.placement.sync_doorbells();
    }

    /// Every function's state handle (the host bridge `pci-root` first), for the persist list.
    pub fn persist_list(&self) -> Vec<Arc<Mutex<dyn PersistDyn>>> {
        lock(&self.bus)
            .devices()
            .map(|(_, d)| Arc::new(Mutex::new(PciPersist(d.clone()))) as Arc<Mutex<dyn PersistDyn>>)
            .collect()
    }
}

impl Drop for Pci {
    fn drop(&mut self) {
        for d in lock(&self.placement.doorbells).iter_mut() {
            self.placement.register(d, None);
        }
    }
}
