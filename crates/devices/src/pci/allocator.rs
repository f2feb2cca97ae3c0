//! BAR placement: each BAR at an address aligned to its size (as PCI requires), inside the
//! windows the VMM gives (the 32-bit MMIO window, optionally a 64-bit one and an I/O port
//! range), with `vm-allocator` keeping the free and used ranges.

use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use super::{BarKind, BarSpec, PciConfig, PciError};

pub struct BarAllocator {
    mmio32: AddressAllocator,
    mmio64: Option<AddressAllocator>,
    io: Option<AddressAllocator>,
}

fn window(base: u64, size: u64) -> Result<AddressAllocator, PciError> {
    AddressAllocator::new(base, size).map_err(|e| PciError::Allocator(format!("window {base:#x}+{size:#x}: {e}")))
}

impl BarAllocator {
    /// BARs in `[base, base + size)`: `kumo_vm`'s `MemoryLayout::mmio32()` (less whatever else
    /// the VMM puts there, the ECAM window).
    pub fn new(mmio32: (u64, u64)) -> Result<Self, PciError> {
        Ok(BarAllocator { mmio32: window(mmio32.0, mmio32.1)?, mmio64: None, io: None })
    }

    /// 64-bit BARs go here instead of the 32-bit window.
    pub fn with_mmio64(mut self, base: u64, size: u64) -> Result<Self, PciError> {
        self.mmio64 = Some(window(base, size)?);
        Ok(self)
    }

    /// I/O BARs go here; without it, a device with an I/O BAR cannot be placed.
    pub fn with_io(mut self, base: u64, size: u64) -> Result<Self, PciError> {
        self.io = Some(window(base, size)?);
        Ok(self)
    }

    fn window_for(&mut self, kind: BarKind) -> Option<&mut AddressAllocator> {
        match kind {
            BarKind::Io => self.io.as_mut(),
            BarKind::Mem32 => Some(&mut self.mmio32),
            BarKind::Mem64 => Some(self.mmio64.as_mut().unwrap_or(&mut self.mmio32)),
        }
    }

    fn take(&mut self, spec: BarSpec, policy: AllocPolicy) -> Result<u64, PciError> {
        let no_space = PciError::NoSpace { kind: spec.kind, size: spec.size };
        let w = self.window_for(spec.kind).ok_or(no_space.clone())?;
        let r = w.allocate(spec.size, spec.size, policy).map_err(|e| match e {
            vm_allocator::Error::ResourceNotAvailable => no_space,
            e => PciError::Allocator(format!("{:?} BAR of {:#x} bytes: {e}", spec.kind, spec.size)),
        })?;
        Ok(r.start())
    }

    /// An address for `spec`, aligned to its size.
    pub fn allocate(&mut self, spec: BarSpec) -> Result<u64, PciError> {
        self.take(spec, AllocPolicy::FirstMatch)
    }

    /// Takes exactly `addr` for `spec` (a restored VM's BARs stay where its guest put them).
    pub fn reserve(&mut self, spec: BarSpec, addr: u64) -> Result<(), PciError> {
        self.take(spec, AllocPolicy::ExactMatch(addr)).map(|_| ())
    }

    /// Takes the ranges of every placed BAR of `config`: after a restore, before placing any
    /// new device.
    pub fn reserve_placed(&mut self, config: &PciConfig) -> Result<(), PciError> {
        for (i, spec) in config.bars() {
            if let Some(addr) = config.bar_mapped(i) {
                self.reserve(spec, addr)?;
            }
        }
        Ok(())
    }

    /// Gives back a BAR's range.
    pub fn free(&mut self, spec: BarSpec, addr: u64) -> Result<(), PciError> {
        let bad = |e: vm_allocator::Error| PciError::Allocator(format!("freeing {addr:#x}+{:#x}: {e}", spec.size));
        let r = RangeInclusive::new(addr, addr.saturating_add(spec.size - 1)).map_err(bad)?;
        self.window_for(spec.kind).ok_or(PciError::NoSpace { kind: spec.kind, size: spec.size })?.free(&r).map_err(bad)
    }

    /// Places every declared BAR of `config`, largest first (fewer gaps). On an error the BARs
    /// placed so far are given back.
    pub fn place(&mut self, config: &mut PciConfig) -> Result<(), PciError> {
        let mut bars: Vec<_> = config.bars().collect();
        bars.sort_by_key(|(i, b)| (std::cmp::Reverse(b.size), *i));
        let mut done = Vec::new();
        for (i, spec) in bars {
            let placed = self.allocate(spec).and_then(|addr| config.set_bar_address(i, addr).map(|_| addr));
            match placed {
                Ok(addr) => done.push((spec, addr)),
                Err(e) => {
                    for (s, a) in done {
                        let _ = self.free(s, a);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::PciIds;

    const BASE: u64 = 0xc000_0000;

    #[test]
    fn bars_are_naturally_aligned() {
        let mut a = BarAllocator::new((BASE + 0x1000, 0x10_0000)).unwrap();
        let x = a.allocate(BarSpec::mem32(0x1000)).unwrap();
        let y = a.allocate(BarSpec::mem32(0x4000)).unwrap();
        let z = a.allocate(BarSpec::mem64(0x1_0000, true)).unwrap();
        assert_eq!(x, BASE + 0x1000);
        assert_eq!(y, BASE + 0x4000);
        assert_eq!(z, BASE + 0x1_0000);
        for (addr, size) in [(x, 0x1000), (y, 0x4000), (z, 0x1_0000)] {
            assert_eq!(addr % size, 0);
        }
        // The gap at 0x2000 still takes a small BAR.
        assert_eq!(a.allocate(BarSpec::mem32(0x2000)).unwrap(), BASE + 0x2000);
    }

    #[test]
    fn exhaustion_and_reuse() {
        let mut a = BarAllocator::new((BASE, 0x8000)).unwrap();
        let x = a.allocate(BarSpec::mem32(0x4000)).unwrap();
        a.allocate(BarSpec::mem32(0x4000)).unwrap();
        assert_eq!(a.allocate(BarSpec::mem32(0x1000)), Err(PciError::NoSpace { kind: BarKind::Mem32, size: 0x1000 }));
        assert_eq!(
            a.allocate(BarSpec::io(4)).unwrap_err().to_string(),
            "no room for a 0x4-byte Io BAR in its window",
            "no I/O window"
        );
        a.free(BarSpec::mem32(0x4000), x).unwrap();
        assert_eq!(a.allocate(BarSpec::mem32(0x1000)).unwrap(), BASE);
        assert!(a.free(BarSpec::mem32(0x4000), x).is_err(), "not the allocated range");
        assert!(BarAllocator::new((BASE, 0)).is_err());
    }

    #[test]
    fn windows_by_kind_and_exact_reservations() {
        let mut a = BarAllocator::new((BASE, 0x10_0000)).unwrap().with_mmio64(1 << 40, 1 << 30).unwrap();
        a = a.with_io(0x1000, 0x1000).unwrap();
        assert_eq!(a.allocate(BarSpec::mem64(0x4000, false)).unwrap(), 1 << 40);
        assert_eq!(a.allocate(BarSpec::io(0x20)).unwrap(), 0x1000);
        a.reserve(BarSpec::mem32(0x1000), BASE + 0x5000).unwrap();
        assert!(a.reserve(BarSpec::mem32(0x1000), BASE + 0x5000).is_err(), "taken");
        assert!(a.reserve(BarSpec::mem32(0x1000), BASE + 0x5800).is_err(), "unaligned");
        assert_eq!(a.allocate(BarSpec::mem32(0x1000)).unwrap(), BASE);
    }

    #[test]
    fn place_sets_every_bar_of_a_device() {
        let ids = PciIds { vendor: 1, device: 2, class: (2, 0, 0), revision: 0, subsystem_vendor: 0, subsystem: 0 };
        let mut c = PciConfig::new(ids);
        c.add_bar(0, BarSpec::mem32(0x1000)).unwrap();
        c.add_bar(2, BarSpec::mem64(0x4000, true)).unwrap();
        let mut a = BarAllocator::new((BASE, 0x10_0000)).unwrap();
        a.place(&mut c).unwrap();
        assert_eq!(c.bar_mapped(2), Some(BASE), "largest first");
        assert_eq!(c.bar_mapped(0), Some(BASE + 0x4000));
        assert_eq!(c.read(0x10, 4), (BASE + 0x4000) as u32);
        assert_eq!(c.read(0x18, 4), BASE as u32 | 0xc);
        // The same placement, taken again after a restore.
        let mut again = BarAllocator::new((BASE, 0x10_0000)).unwrap();
        again.reserve_placed(&c).unwrap();
        assert_eq!(again.allocate(BarSpec::mem32(0x1000)).unwrap(), BASE + 0x5000);
        assert!(again.reserve_placed(&c).is_err(), "already taken");
        // A device that does not fit takes nothing.
        let mut small = BarAllocator::new((BASE, 0x4000)).unwrap();
        assert!(small.place(&mut c).is_err());
        assert_eq!(small.allocate(BarSpec::mem32(0x4000)).unwrap(), BASE);
    }
}
