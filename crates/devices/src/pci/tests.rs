//! The pieces together, as a device embeds them and a guest drives them: a NIC-like function
//! with one 64-bit BAR holding its registers, the MSI-X table and the PBA.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::*;
use crate::bus::BusDevice;
use crate::persist::{Persist, PersistError};

const TABLE: u32 = 0x2000;
const PBA: u32 = 0x3000;
const APIC: u64 = 0xfee0_0000;
const BASE: u64 = 0xc000_0000;

#[derive(Default)]
struct Log(Mutex<Vec<(u16, Option<Option<MsiMessage>>)>>);
impl MsixRouting for Log {
    fn update(&self, vector: u16, msg: Option<MsiMessage>) {
        self.0.lock().unwrap().push((vector, Some(msg)));
    }
    fn trigger(&self, vector: u16) {
        self.0.lock().unwrap().push((vector, None));
    }
}
impl Log {
    fn take(&self) -> Vec<(u16, Option<Option<MsiMessage>>)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A virtio-net function's ids (also used by the config space's own tests).
pub(crate) fn nic_ids() -> PciIds {
    PciIds {
        vendor: 0x1af4,
        device: 0x1041,
        class: (0x02, 0x00, 0x00),
        revision: 1,
        subsystem_vendor: 0x1af4,
        subsystem: 0x1100,
    }
}

struct Nic {
    config: PciConfig,
    msix: Msix,
    regs: [u32; 4],
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NicState {
    config: PciConfigState,
    msix: MsixState,
    regs: [u32; 4],
}

impl Nic {
    fn new(routing: Arc<dyn MsixRouting>) -> Nic {
        let mut config = PciConfig::new(nic_ids());
        config.add_bar(0, BarSpec::mem64(0x4000, false)).unwrap();
        let mut msix = Msix::new(4, (0, TABLE), (0, PBA), routing).unwrap();
        msix.add_capability(&mut config).unwrap();
        Nic { config, msix, regs: [0; 4] }
    }
}

impl Persist for Nic {
    type State = NicState;
    fn id(&self) -> String {
        "net0".into()
    }
    fn save(&self) -> Result<NicState, PersistError> {
        Ok(NicState { config: self.config.state(), msix: self.msix.state(), regs: self.regs })
    }
    fn restore(&mut self, s: &NicState) -> Result<(), PersistError> {
        self.config.restore(&s.config).map_err(|e| PersistError::component("net0", e))?;
        self.msix.restore(&s.msix).map_err(|e| PersistError::component("net0", e))?;
        self.regs = s.regs;
        Ok(())
    }
}

impl PciDevice for Nic {
    fn config(&self) -> &PciConfig {
        &self.config
    }
    fn config_mut(&mut self) -> &mut PciConfig {
        &mut self.config
    }
    fn write_config(&mut self, reg: usize, byte: usize, data: &[u8]) -> Option<BarMove> {
        let mv = self.config.write(reg, byte, data);
        self.msix.config_written(&self.config);
        mv
    }
    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if self.msix.read_bar(bar, offset, data) {
            return;
        }
        data.fill(0);
        if let Some(r) = self.regs.get((offset / 4) as usize) {
            let n = data.len().min(4);
            data[..n].copy_from_slice(&r.to_le_bytes()[..n]);
        }
    }
    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if self.msix.write_bar(bar, offset, data) {
            return;
        }
        if let (Some(r), 4) = (self.regs.get_mut((offset / 4) as usize), data.len()) {
            *r = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        }
    }
}

struct Vm {
    bus: Arc<Mutex<PciBus>>,
    nic: Arc<Mutex<Nic>>,
    log: Arc<Log>,
    ecam: PciConfigMmio,
    bar0: crate::bus::SharedDevice,
}

fn vm() -> Vm {
    let log = Arc::new(Log::default());
    let nic = Arc::new(Mutex::new(Nic::new(log.clone())));
    let mut alloc = BarAllocator::new((BASE, 0x100_0000)).unwrap();
    alloc.place(&mut nic.lock().unwrap().config).unwrap();
    let mut bus = PciBus::new();
    assert_eq!(bus.add(None, nic.clone()).unwrap(), 1);
    let regions = bus.bar_regions();
    assert_eq!(regions.len(), 1);
    assert_eq!((regions[0].addr, regions[0].size), (BASE, 0x4000));
    let bar0 = regions[0].region.clone();
    let bus = Arc::new(Mutex::new(bus));
    Vm { ecam: PciConfigMmio::new(bus.clone()), bus, nic, log, bar0 }
}

fn ecam_read(m: &mut PciConfigMmio, off: u64, len: usize) -> u32 {
    let mut b = [0u8; 4];
    m.read(off, &mut b[..len]);
    u32::from_le_bytes(b)
}

/// The guest's side: find the MSI-X capability by walking the list, enable MSI-X, program
/// vector 1 and unmask it.
fn guest_sets_up_msix(v: &mut Vm) {
    let dev = 1u64 << 15;
    assert_ne!(ecam_read(&mut v.ecam, dev + 6, 2) & 0x10, 0, "capability list");
    let mut cap = u64::from(ecam_read(&mut v.ecam, dev + 0x34, 1));
    while ecam_read(&mut v.ecam, dev + cap, 1) != u32::from(MSIX_CAP_ID) {
        cap = u64::from(ecam_read(&mut v.ecam, dev + cap + 1, 1));
        assert_ne!(cap, 0);
    }
    assert_eq!(ecam_read(&mut v.ecam, dev + cap + 2, 2) & 0x7ff, 3, "4 vectors");
    assert_eq!(ecam_read(&mut v.ecam, dev + cap + 4, 4), TABLE);
    v.ecam.write(dev + 4, &[0x06, 0]);
    v.ecam.write(dev + cap + 2, &0xc000u16.to_le_bytes());
    let mut r = v.bar0.lock().unwrap();
    r.write(u64::from(TABLE) + 16, &(APIC | 1 << 12).to_le_bytes());
    r.write(u64::from(TABLE) + 24, &0x31u32.to_le_bytes());
    r.write(u64::from(TABLE) + 28, &0u32.to_le_bytes());
    drop(r);
    v.ecam.write(dev + cap + 2, &0x8000u16.to_le_bytes());
}

#[test]
fn a_guest_enables_msix_and_the_device_interrupts() {
    let mut v = vm();
    guest_sets_up_msix(&mut v);
    let msg = MsiMessage { address: APIC | 1 << 12, data: 0x31 };
    assert_eq!(v.log.take(), vec![(1, Some(Some(msg)))], "one route, given when the function mask lifted");
    assert!(v.nic.lock().unwrap().msix.fire(1));
    assert!(!v.nic.lock().unwrap().msix.fire(0), "vector 0 is still masked");
    assert_eq!(v.log.take(), vec![(1, None)]);
    // The PBA, through the BAR.
    let mut pba = [0u8; 8];
    v.bar0.lock().unwrap().read(u64::from(PBA), &mut pba);
    assert_eq!(u64::from_le_bytes(pba), 1);
    // The device's own registers, beside the table.
    v.bar0.lock().unwrap().write(4, &7u32.to_le_bytes());
    assert_eq!(v.nic.lock().unwrap().regs[1], 7);
}

#[test]
fn a_device_with_msix_migrates() {
    let mut v = vm();
    guest_sets_up_msix(&mut v);
    v.nic.lock().unwrap().msix.fire(2);
    v.bar0.lock().unwrap().write(0, &0x1234u32.to_le_bytes());
    let saved = {
        let n = v.nic.lock().unwrap();
        serde_json::to_string(&PersistDyn::save_dyn(&*n).unwrap()).unwrap()
    };
    let saved: crate::persist::DeviceState = serde_json::from_str(&saved).unwrap();

    // The destination builds the same device; the BAR ends up where the guest had it.
    let log = Arc::new(Log::default());
    let mut dest = Nic::new(log.clone());
    dest.restore_dyn(&saved).unwrap();
    assert_eq!(dest.config.bar_mapped(0), Some(BASE));
    assert_eq!(dest.config.read_reg(4), v.nic.lock().unwrap().config.read_reg(4));
    assert_eq!(dest.config.read(4, 2), 0x0006, "command");
    assert!(dest.msix.enabled() && !dest.msix.function_masked());
    assert!(dest.msix.is_pending(2));
    assert_eq!(dest.regs[0], 0x1234);
    let got = log.take();
    assert_eq!(got.len(), 4, "every vector's route, once: {got:?}");
    assert_eq!(got[1], (1, Some(Some(MsiMessage { address: APIC | 1 << 12, data: 0x31 }))));
    let mut alloc = BarAllocator::new((BASE, 0x100_0000)).unwrap();
    alloc.reserve(dest.config.bar(0).unwrap(), BASE).unwrap();

    // A state of another kind is refused with the device's id.
    let e = dest.restore_dyn(&crate::persist::DeviceState::TestCounter(1)).unwrap_err().to_string();
    assert_eq!(e, "net0: saved state is a test state, not this component's");
}

#[test]
fn restored_config_keeps_the_devices_identity() {
    let v = vm();
    let mut state = v.nic.lock().unwrap().config.state();
    state.regs[0] = 0xdead_beef;
    state.regs[15] = 0x0000_0105;
    let mut fresh = Nic::new(Arc::new(Log::default()));
    fresh.config.restore(&state).unwrap();
    assert_eq!(fresh.config.read_reg(0), 0x1041_1af4);
    assert_eq!(fresh.config.read(0x3c, 2), 0x0105, "interrupt line from the state, pin from the device");
    state.regs.pop();
    assert!(fresh.config.restore(&state).is_err());
    let mut state = v.nic.lock().unwrap().config.state();
    state.mapped[3] = Some(BASE);
    assert_eq!(fresh.config.restore(&state), Err(PciError::BadState("a placed BAR this device does not declare")));
}

#[test]
fn linux_finds_configuration_type_1() {
    // arch/x86/pci/direct.c, pci_check_type1 and pci_sanity_check.
    let v = vm();
    let mut io = PciConfigIo::new(v.bus.clone());
    io.write(3, &[0x01]);
    let mut tmp = [0u8; 4];
    io.read(0, &mut tmp);
    io.write(0, &0x8000_0000u32.to_le_bytes());
    let mut b = [0u8; 4];
    io.read(0, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x8000_0000);
    let found = (0..=255u32).any(|devfn| {
        io.write(0, &(0x8000_0000 | devfn << 8 | 0x08).to_le_bytes());
        let mut class = [0u8; 2];
        io.read(4 + 2, &mut class);
        u16::from_le_bytes(class) == 0x0600
    });
    assert!(found, "a host bridge on bus 0");
    io.write(0, &tmp);
}

#[test]
fn linux_sizes_64_bit_bars_half_by_half_without_moving_them() {
    let mut v = vm();
    let dev = 1u64 << 15;
    for reg in [0x10, 0x14] {
        let orig = ecam_read(&mut v.ecam, dev + reg, 4);
        v.ecam.write(dev + reg, &[0xff; 4]);
        let size = ecam_read(&mut v.ecam, dev + reg, 4);
        v.ecam.write(dev + reg, &orig.to_le_bytes());
        assert_eq!(size, if reg == 0x10 { 0xffff_c004 } else { u32::MAX });
    }
    assert_eq!(v.nic.lock().unwrap().config.bar_mapped(0), Some(BASE));
    // No relocation hook is set: a move would only be logged, and none happened.
    assert_eq!(v.bus.lock().unwrap().bar_regions()[0].addr, BASE);
}

/// A small deterministic generator (xorshift): garbage without a new dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn garbage_from_the_guest_never_panics() {
    let mut v = vm();
    let mut io = PciConfigIo::new(v.bus.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        let r = rng.next();
        let len = [1usize, 2, 3, 4, 8, 16][(r % 6) as usize];
        let bytes = rng.next().to_le_bytes().repeat(2);
        let data = &bytes[..len];
        let mut out = vec![0u8; len];
        match (r >> 8) % 4 {
            0 => {
                let off = rng.next() % (2 * ECAM_BUS0_SIZE);
                v.ecam.write(off, data);
                v.ecam.read(off, &mut out);
            }
            1 => {
                let off = rng.next() % 8;
                io.write(off, data);
                io.read(off, &mut out);
            }
            _ => {
                let off = rng.next() % 0x5000;
                v.bar0.lock().unwrap().write(off, data);
                v.bar0.lock().unwrap().read(off, &mut out);
            }
        }
        let mut n = v.nic.lock().unwrap();
        n.msix.fire((r >> 32) as u16 % 8);
    }
    let n = v.nic.lock().unwrap();
    assert_eq!(n.config.read_reg(0), 0x1041_1af4, "the identity survives");
    for vector in 0..4 {
        if let Some(m) = n.msix.message(vector) {
            assert_eq!(m.address & 0xfff0_0000, APIC, "only APIC addresses are ever routed");
        }
    }
}
