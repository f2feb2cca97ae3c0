//! PCI as register logic: configuration spaces ([`PciConfig`]), a bus of functions behind a host
//! bridge ([`PciBus`], [`PciRoot`]) reached through configuration mechanism #1
//! ([`PciConfigIo`], ports 0xCF8..0xCFF) and ECAM ([`PciConfigMmio`]), BAR placement
//! ([`BarAllocator`]) and MSI-X ([`Msix`]). [`PciFunction`] makes a PCI function of any
//! register block (`BusDevice` + persist) with MSI-X in the same BAR.
//!
//! Nothing here touches KVM. What the guest does that the VMM must act on is reported through
//! traits the VMM implements: a BAR the guest moved ([`BarRelocation`]: move the device's range
//! on the MMIO or port bus) and an MSI-X vector whose message changed ([`MsixRouting`]: update
//! its GSI's MSI route). A BAR's accesses reach its device through a [`PciBarRegion`] placed
//! on the MMIO (or port) bus like any other `BusDevice`.

mod allocator;
mod bus;
mod config;
mod function;
mod msix;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::{Arc, Mutex};

pub use allocator::BarAllocator;
pub use bus::{BarRelocation, PciBarRegion, PciBus, PciConfigIo, PciConfigMmio, PciRoot, PlacedBar, ECAM_BUS0_SIZE};
pub use config::{PciConfig, PciConfigState, PciIds, CONFIG_DWORDS, FIRST_CAP};
pub use function::{PciFunction, PciFunctionState, SharedMsix};
pub use msix::{MsiMessage, Msix, MsixEntry, MsixRouting, MsixState, MSIX_CAP_ID, MSIX_ENTRY_SIZE};

use crate::persist::PersistDyn;

/// BARs in a type 0 header.
pub const NUM_BARS: usize = 6;
/// Device numbers on a bus.
pub const MAX_DEVICES: u8 = 32;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PciError {
    #[error("BAR {index}: {msg}")]
    BadBar { index: usize, msg: &'static str },
    #[error("no room left for capabilities in the 256-byte configuration space")]
    CapabilitySpace,
    #[error("PCI device number {0} is taken or above 31")]
    SlotTaken(u8),
    #[error("no free PCI device number on bus 0")]
    BusFull,
    #[error("no room for a {size:#x}-byte {kind:?} BAR in its window")]
    NoSpace { kind: BarKind, size: u64 },
    #[error("{0}")]
    Allocator(String),
    #[error("saved PCI state does not fit: {0}")]
    BadState(&'static str),
    #[error("MSI-X: {0}")]
    Msix(&'static str),
}

/// What a BAR decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BarKind {
    Io,
    Mem32,
    /// Takes two BAR registers (the next holds the high half).
    Mem64,
}

/// A BAR a device declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarSpec {
    /// A power of two.
    pub size: u64,
    pub kind: BarKind,
    pub prefetchable: bool,
}

impl BarSpec {
    pub fn mem32(size: u64) -> Self {
        BarSpec { size, kind: BarKind::Mem32, prefetchable: false }
    }

    pub fn mem64(size: u64, prefetchable: bool) -> Self {
        BarSpec { size, kind: BarKind::Mem64, prefetchable }
    }

    pub fn io(size: u64) -> Self {
        BarSpec { size, kind: BarKind::Io, prefetchable: false }
    }

    /// The read-only low bits of the BAR register.
    fn flags(&self) -> u32 {
        match self.kind {
            BarKind::Io => 1,
            BarKind::Mem32 => u32::from(self.prefetchable) << 3,
            BarKind::Mem64 => 0b100 | u32::from(self.prefetchable) << 3,
        }
    }

    /// How many low bits hold flags rather than address.
    fn flag_bits(&self) -> u32 {
        if self.kind == BarKind::Io {
            0b11
        } else {
            0b1111
        }
    }
}

/// A guest moved a BAR: its range must leave `old` (if it was mapped) and be decoded at `new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarMove {
    pub bar: usize,
    pub kind: BarKind,
    pub size: u64,
    pub old: Option<u64>,
    pub new: u64,
}

/// A PCI function as the bus sees it. The configuration space logic sits in [`PciConfig`]; a
/// device overrides the config hooks only where a write means more than storage (MSI-X
/// control, a virtio common config in a capability). The persist hook is [`PersistDyn`]: a
/// device's state (its config space, MSI-X table, device registers) is saved under its id.
pub trait PciDevice: PersistDyn {
    fn config(&self) -> &PciConfig;
    fn config_mut(&mut self) -> &mut PciConfig;

    /// Dword `reg` (0..1024) of the configuration space.
    fn read_config(&mut self, reg: usize) -> u32 {
        self.config().read_reg(reg)
    }

    /// A write of `data` (1, 2 or 4 bytes) at byte `byte` of dword `reg`. Returns the BAR the
    /// write moved, which the bus reports through [`BarRelocation`].
    fn write_config(&mut self, reg: usize, byte: usize, data: &[u8]) -> Option<BarMove> {
        self.config_mut().write(reg, byte, data)
    }

    /// An access at `offset` inside BAR `bar`.
    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]);
}

/// A PCI function shared between its bus, its BAR regions and the device manager.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

fn lock_dev(d: &SharedPciDevice) -> std::sync::MutexGuard<'_, dyn PciDevice + 'static> {
    d.lock().unwrap_or_else(|p| p.into_inner())
}
