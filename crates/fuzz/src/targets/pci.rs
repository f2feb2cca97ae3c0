//! PCI as a guest reaches it (`kumo_devices::pci`): configuration mechanism #1 (0xCF8/0xCFC),
//! ECAM, the NIC function's BAR (virtio registers, MSI-X table and PBA) and MSI-X vectors
//! firing, with accesses of every width at any offset. The function keeps its identity and
//! MSI-X only ever routes APIC messages (checked by the routing as each route changes).

use std::sync::{Arc, Mutex};

use arbitrary::Arbitrary;
use kumo_devices::pci::{BarAllocator, PciBus, PciConfigIo, PciConfigMmio, PciDevice, ECAM_BUS0_SIZE};
use kumo_devices::BusDevice;

use super::nic::{rig, BAR_SIZE, MSIX_TABLE};
use crate::{CaseResult, Input};

#[derive(Debug, Arbitrary)]
enum Op {
    Ecam {
        off: u32,
        len: u8,
        v: u64,
        write: bool,
    },
    Io {
        off: u8,
        len: u8,
        v: u64,
        write: bool,
    },
    Bar {
        off: u16,
        len: u8,
        v: u64,
        write: bool,
    },
    /// A write into the MSI-X table or PBA (the interesting part of the BAR).
    Table {
        entry: u8,
        word: u8,
        v: u32,
    },
    Fire {
        vector: u16,
    },
}

const LENS: [usize; 6] = [1, 2, 3, 4, 8, 16];

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let r = rig(if u.arbitrary()? { 1 } else { 2 });
    let msix = r.msix.clone();
    let f = Arc::new(Mutex::new(r.f));
    let mut alloc = BarAllocator::new((0xc000_0000, 0x100_0000)).expect("allocator");
    alloc.place(f.lock().unwrap_or_else(|p| p.into_inner()).config_mut()).expect("placed");
    let mut bus = PciBus::new();
    let slot = bus.add(None, f.clone()).expect("slot");
    let bar = bus.bar_regions().first().expect("a BAR").region.clone();
    let bus = Arc::new(Mutex::new(bus));
    let mut ecam = PciConfigMmio::new(bus.clone());
    let mut io = PciConfigIo::new(bus.clone());
    let identity = bus.lock().unwrap_or_else(|p| p.into_inner()).read_config(0, slot, 0, 0);
    while !u.is_empty() {
        match u.arbitrary::<Op>()? {
            Op::Ecam { off, len, v, write } => {
                let off = off as u64 % (2 * ECAM_BUS0_SIZE);
                access(&mut ecam, off, len, v, write);
            }
            Op::Io { off, len, v, write } => access(&mut io, off as u64 % 8, len, v, write),
            Op::Bar { off, len, v, write } => {
                let mut b = bar.lock().unwrap_or_else(|p| p.into_inner());
                access(&mut *b, off as u64 % (BAR_SIZE + 0x100), len, v, write);
            }
            Op::Table { entry, word, v } => {
                let off = MSIX_TABLE as u64 + 16 * (entry as u64 % 8) + 4 * (word as u64 % 4);
                bar.lock().unwrap_or_else(|p| p.into_inner()).write(off, &v.to_le_bytes());
            }
            Op::Fire { vector } => {
                msix.lock().unwrap_or_else(|p| p.into_inner()).fire(vector % 8);
            }
        }
        let id = bus.lock().unwrap_or_else(|p| p.into_inner()).read_config(0, slot, 0, 0);
        assert_eq!(id, identity, "the function's vendor and device ids changed");
    }
    Ok(())
}

fn access(d: &mut dyn BusDevice, off: u64, len: u8, v: u64, write: bool) {
    let len = LENS[len as usize % LENS.len()];
    let bytes = v.to_le_bytes().repeat(2);
    if write {
        d.write(off, &bytes[..len]);
    } else {
        let mut out = vec![0u8; len];
        d.read(off, &mut out);
    }
}
