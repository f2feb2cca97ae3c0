//! Bus 0: the host bridge and the functions on it, by device number, and the two ways a guest
//! reaches their configuration spaces: configuration mechanism #1 (an address latch at 0xCF8,
//! data at 0xCFC..0xCFF) and ECAM (one MMIO window, 4 KiB per function).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{
    lock_dev, BarKind, BarMove, PciConfig, PciConfigState, PciDevice, PciError, PciIds, SharedPciDevice, MAX_DEVICES,
};
use crate::bus::{BusDevice, SharedDevice};
use crate::persist::{Persist, PersistError};
use crate::DeviceEvent;

/// ECAM's window for bus 0: 32 devices × 8 functions × 4 KiB.
pub const ECAM_BUS0_SIZE: u64 = 1 << 20;
/// Mechanism #1's address register: enable, bus, device, function, register (dword aligned).
const CF8_MASK: u32 = 0x80ff_fffc;

/// Told when the guest moves a BAR. Called on the vCPU thread that made the config write,
/// after the PCI bus and the device are unlocked, but from inside that vCPU's bus dispatch
/// (the port bus for mechanism #1, the MMIO bus for ECAM): an implementation that needs that
/// bus's lock must queue the move instead.
pub trait BarRelocation: Send + Sync {
    /// Take `region` off `mv.old` (if it was mapped) and put it at `mv.new` on the MMIO bus
    /// (port bus for [`BarKind::Io`]).
    fn move_bar(&self, slot: u8, mv: BarMove, region: SharedDevice);
}

/// A BAR where it decodes, with the `BusDevice` to put there.
pub struct PlacedBar {
    pub slot: u8,
    pub bar: usize,
    pub kind: BarKind,
    pub addr: u64,
    pub size: u64,
    pub region: SharedDevice,
}

/// One BAR of a device as a `BusDevice`: what the VMM puts on the MMIO or port bus at the BAR's
/// address.
pub struct PciBarRegion {
    dev: SharedPciDevice,
    bar: usize,
}

impl PciBarRegion {
    pub fn shared(dev: SharedPciDevice, bar: usize) -> SharedDevice {
        Arc::new(Mutex::new(PciBarRegion { dev, bar }))
    }
}

impl BusDevice for PciBarRegion {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        lock_dev(&self.dev).read_bar(self.bar, offset, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        lock_dev(&self.dev).write_bar(self.bar, offset, data);
        None
    }
}

/// The host bridge at 00:00.0: an identity, no BARs.
pub struct PciRoot {
    config: PciConfig,
}

impl PciRoot {
    pub const VENDOR: u16 = 0x8086;
    pub const DEVICE: u16 = 0x0d57;

    pub fn new() -> Self {
        let ids = PciIds {
            vendor: Self::VENDOR,
            device: Self::DEVICE,
            class: (0x06, 0x00, 0x00),
            revision: 0,
            subsystem_vendor: 0,
            subsystem: 0,
        };
        let mut config = PciConfig::new(ids);
        // A bridge raises no interrupt.
        config.set_reg(15, 0);
        config.set_writable(15, 0);
        PciRoot { config }
    }
}

impl Default for PciRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl Persist for PciRoot {
    type State = PciConfigState;
    fn id(&self) -> String {
        "pci-root".into()
    }
    fn save(&self) -> Result<PciConfigState, PersistError> {
        Ok(self.config.state())
    }
    fn restore(&mut self, s: &PciConfigState) -> Result<(), PersistError> {
        self.config.restore(s).map_err(|e| PersistError::component("pci-root", e))
    }
}

impl PciDevice for PciRoot {
    fn config(&self) -> &PciConfig {
        &self.config
    }
    fn config_mut(&mut self) -> &mut PciConfig {
        &mut self.config
    }
    fn read_bar(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn write_bar(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

/// Bus 0: single-function devices by device number, the host bridge at 0.
pub struct PciBus {
    devices: BTreeMap<u8, SharedPciDevice>,
    relocation: Option<Arc<dyn BarRelocation>>,
}

impl PciBus {
    /// A bus holding only the host bridge.
    pub fn new() -> Self {
        let root: SharedPciDevice = Arc::new(Mutex::new(PciRoot::new()));
        PciBus { devices: BTreeMap::from([(0, root)]), relocation: None }
    }

    /// Who is told about BARs the guest moves.
    pub fn set_relocation(&mut self, r: Arc<dyn BarRelocation>) {
        self.relocation = Some(r);
    }

    /// Puts `dev` at device number `slot`, or the lowest free one. Returns the number.
    pub fn add(&mut self, slot: Option<u8>, dev: SharedPciDevice) -> Result<u8, PciError> {
        let slot = match slot {
            Some(s) if s >= MAX_DEVICES || self.devices.contains_key(&s) => return Err(PciError::SlotTaken(s)),
            Some(s) => s,
            None => (0..MAX_DEVICES).find(|s| !self.devices.contains_key(s)).ok_or(PciError::BusFull)?,
        };
        self.devices.insert(slot, dev);
        Ok(slot)
    }

    pub fn device(&self, slot: u8) -> Option<&SharedPciDevice> {
        self.devices.get(&slot)
    }

    /// Every function, by device number.
    pub fn devices(&self) -> impl Iterator<Item = (u8, &SharedPciDevice)> {
        self.devices.iter().map(|(s, d)| (*s, d))
    }

    /// Every placed BAR. The VMM puts each region on the MMIO (or port) bus at boot and after
    /// a restore.
    pub fn bar_regions(&self) -> Vec<PlacedBar> {
        let mut out = Vec::new();
        for (&slot, dev) in &self.devices {
            let bars: Vec<_> = {
                let d = lock_dev(dev);
                d.config().bars().filter_map(|(i, b)| Some((i, b, d.config().bar_mapped(i)?))).collect()
            };
            for (i, b, addr) in bars {
                out.push(PlacedBar {
                    slot,
                    bar: i,
                    kind: b.kind,
                    addr,
                    size: b.size,
                    region: PciBarRegion::shared(dev.clone(), i),
                });
            }
        }
        out
    }

    fn function(&self, bus: u8, dev: u8, func: u8) -> Option<&SharedPciDevice> {
        if bus != 0 || func != 0 {
            return None;
        }
        self.devices.get(&dev)
    }

    /// Dword `reg` of 00:dev.func (bus 0 only); absent functions read all ones.
    pub fn read_config(&self, bus: u8, dev: u8, func: u8, reg: usize) -> u32 {
        self.function(bus, dev, func).map_or(u32::MAX, |d| lock_dev(d).read_config(reg))
    }

    /// A write to a function's configuration space; a BAR it moved is reported through the
    /// relocation hook once everything is unlocked. Writes to absent functions are dropped.
    fn write_config(bus: &Mutex<PciBus>, addr: (u8, u8, u8), reg: usize, byte: usize, data: &[u8]) {
        let (mv, dev, relocation) = {
            let b = bus.lock().unwrap_or_else(|p| p.into_inner());
            let Some(dev) = b.function(addr.0, addr.1, addr.2) else { return };
            let mv = lock_dev(dev).write_config(reg, byte, data);
            (mv, dev.clone(), b.relocation.clone())
        };
        let Some(mv) = mv else { return };
        tracing::debug!(slot = addr.1, ?mv, "guest moved a BAR");
        match relocation {
            Some(r) => r.move_bar(addr.1, mv, PciBarRegion::shared(dev, mv.bar)),
            None => tracing::warn!(slot = addr.1, bar = mv.bar, "BAR moved with no one to move its range"),
        }
    }
}

impl Default for PciBus {
    fn default() -> Self {
        Self::new()
    }
}

fn read_bytes(dword: u32, byte: usize, data: &mut [u8]) {
    let bytes = dword.to_le_bytes();
    data.copy_from_slice(&bytes[byte..byte + data.len()]);
}

fn sized(byte: usize, len: usize) -> bool {
    matches!(len, 1 | 2 | 4) && byte + len <= 4
}

/// Configuration mechanism #1, to be placed at port 0xCF8 with length 8.
pub struct PciConfigIo {
    bus: Arc<Mutex<PciBus>>,
    address: u32,
}

impl PciConfigIo {
    pub const PORT: u64 = 0xcf8;
    pub const LEN: u64 = 8;

    pub fn new(bus: Arc<Mutex<PciBus>>) -> Self {
        PciConfigIo { bus, address: 0 }
    }

    /// (bus, device, function, dword) the latch selects, if enabled.
    fn target(&self) -> Option<((u8, u8, u8), usize)> {
        let a = self.address;
        let func = ((a >> 16) as u8, ((a >> 11) & 0x1f) as u8, ((a >> 8) & 7) as u8);
        (a & 0x8000_0000 != 0).then_some((func, ((a >> 2) & 0x3f) as usize))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        match offset {
            // Only dword accesses reach the address latch (0xCF9 and friends are other registers).
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 if sized(offset as usize - 4, data.len()) => {
                if let Some(((b, d, f), reg)) = self.target() {
                    let v = self.bus.lock().unwrap_or_else(|p| p.into_inner()).read_config(b, d, f, reg);
                    read_bytes(v, offset as usize - 4, data);
                }
            }
            _ => {}
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        match offset {
            0 if data.len() == 4 => {
                self.address = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & CF8_MASK;
            }
            4..=7 if sized(offset as usize - 4, data.len()) => {
                if let Some((addr, reg)) = self.target() {
                    PciBus::write_config(&self.bus, addr, reg, offset as usize - 4, data);
                }
            }
            _ => tracing::debug!(offset, len = data.len(), "ignored PCI mechanism #1 write"),
        }
        None
    }
}

/// ECAM for bus 0, to be placed on the MMIO bus with length [`ECAM_BUS0_SIZE`] (a larger
/// window reads all ones beyond bus 0).
pub struct PciConfigMmio {
    bus: Arc<Mutex<PciBus>>,
}

impl PciConfigMmio {
    pub fn new(bus: Arc<Mutex<PciBus>>) -> Self {
        PciConfigMmio { bus }
    }

    /// (bus, device, function), dword, byte inside it.
    fn decode(offset: u64) -> Option<((u8, u8, u8), usize, usize)> {
        let bus = u8::try_from(offset >> 20).ok()?;
        let addr = (bus, ((offset >> 15) & 0x1f) as u8, ((offset >> 12) & 7) as u8);
        Some((addr, ((offset & 0xfff) >> 2) as usize, (offset & 3) as usize))
    }
}

impl BusDevice for PciConfigMmio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        if let Some(((b, d, f), reg, byte)) = Self::decode(offset).filter(|x| sized(x.2, data.len())) {
            let v = self.bus.lock().unwrap_or_else(|p| p.into_inner()).read_config(b, d, f, reg);
            read_bytes(v, byte, data);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
        match Self::decode(offset).filter(|x| sized(x.2, data.len())) {
            Some((addr, reg, byte)) => PciBus::write_config(&self.bus, addr, reg, byte, data),
            None => tracing::debug!(offset, len = data.len(), "ignored ECAM write"),
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::BarSpec;

    /// A device with a 64-bit memory BAR 0 (16 KiB), a 32-bit BAR 2 (4 KiB) and an I/O BAR 3.
    pub(crate) struct TestDev {
        pub config: PciConfig,
        pub last_bar_write: Option<(usize, u64, Vec<u8>)>,
    }

    impl TestDev {
        pub fn shared() -> Arc<Mutex<TestDev>> {
            let ids = PciIds {
                vendor: 0x1af4,
                device: 0x1041,
                class: (0x02, 0, 0),
                revision: 1,
                subsystem_vendor: 0x1af4,
                subsystem: 1,
            };
            let mut config = PciConfig::new(ids);
            config.add_bar(0, BarSpec::mem64(0x4000, true)).unwrap();
            config.add_bar(2, BarSpec::mem32(0x1000)).unwrap();
            config.add_bar(3, BarSpec::io(0x20)).unwrap();
            Arc::new(Mutex::new(TestDev { config, last_bar_write: None }))
        }
    }

    impl Persist for TestDev {
        type State = PciConfigState;
        fn id(&self) -> String {
            "test".into()
        }
        fn save(&self) -> Result<PciConfigState, PersistError> {
            Ok(self.config.state())
        }
        fn restore(&mut self, s: &PciConfigState) -> Result<(), PersistError> {
            self.config.restore(s).map_err(|e| PersistError::component("test", e))
        }
    }

    impl PciDevice for TestDev {
        fn config(&self) -> &PciConfig {
            &self.config
        }
        fn config_mut(&mut self) -> &mut PciConfig {
            &mut self.config
        }
        fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
            data.fill(bar as u8 + offset as u8);
        }
        fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
            self.last_bar_write = Some((bar, offset, data.to_vec()));
        }
    }

    #[derive(Default)]
    struct Moves(Mutex<Vec<(u8, BarMove)>>);
    impl BarRelocation for Moves {
        fn move_bar(&self, slot: u8, mv: BarMove, _region: SharedDevice) {
            self.0.lock().unwrap().push((slot, mv));
        }
    }

    type Setup = (Arc<Mutex<PciBus>>, Arc<Mutex<TestDev>>, Arc<Moves>, PciConfigIo, PciConfigMmio);

    fn setup() -> Setup {
        let mut bus = PciBus::new();
        let dev = TestDev::shared();
        assert_eq!(bus.add(None, dev.clone()).unwrap(), 1);
        let moves = Arc::new(Moves::default());
        bus.set_relocation(moves.clone());
        let bus = Arc::new(Mutex::new(bus));
        (bus.clone(), dev, moves, PciConfigIo::new(bus.clone()), PciConfigMmio::new(bus))
    }

    fn cf8(dev: u8, func: u8, reg: u8) -> [u8; 4] {
        (0x8000_0000u32 | u32::from(dev) << 11 | u32::from(func) << 8 | u32::from(reg)).to_le_bytes()
    }

    fn io_read(io: &mut PciConfigIo, off: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        io.read(off, &mut b[..len]);
        u32::from_le_bytes(b)
    }

    fn ecam(dev: u64, func: u64, reg: u64) -> u64 {
        dev << 15 | func << 12 | reg
    }

    fn ecam_read(m: &mut PciConfigMmio, off: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        m.read(off, &mut b[..len]);
        u32::from_le_bytes(b)
    }

    #[test]
    fn mechanism_1_latches_and_reads_by_byte_word_dword() {
        let (_, _, _, mut io, _) = setup();
        io.write(0, &cf8(0, 0, 0));
        assert_eq!(io_read(&mut io, 0, 4), 0x8000_0000, "the latch reads back (Linux's type 1 probe)");
        assert_eq!(io_read(&mut io, 4, 4), 0x0d57_8086, "host bridge");
        io.write(0, &cf8(1, 0, 8));
        assert_eq!(io_read(&mut io, 4, 4), 0x0200_0001, "class and revision");
        assert_eq!(io_read(&mut io, 7, 1), 0x02);
        assert_eq!(io_read(&mut io, 6, 2), 0x0200);
        assert_eq!(io_read(&mut io, 6, 4), u32::MAX, "crosses the data port");
        // Byte writes to 0xCF8/0xCFB (Linux's probe) do not touch the latch.
        io.write(3, &[1]);
        io.write(0, &[0]);
        assert_eq!(io_read(&mut io, 0, 4), 0x8000_0808);
        // Reserved and low bits are dropped from the latch.
        io.write(0, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(io_read(&mut io, 0, 4), 0x80ff_fffc);
        // Disabled: all ones, writes dropped.
        io.write(0, &0x0000_0800u32.to_le_bytes());
        assert_eq!(io_read(&mut io, 4, 4), u32::MAX);
    }

    #[test]
    fn mechanism_1_writes_reach_the_config_space() {
        let (_, dev, _, mut io, _) = setup();
        io.write(0, &cf8(1, 0, 0x3c));
        io.write(4, &[0x0a]);
        io.write(0, &cf8(1, 0, 4));
        io.write(4, &[0x06, 0x00]);
        let d = dev.lock().unwrap();
        assert_eq!(d.config.read(0x3c, 1), 0x0a);
        assert_eq!(d.config.read(0x04, 2), 0x0006);
    }

    #[test]
    fn absent_functions_read_all_ones() {
        let (_, _, _, mut io, mut m) = setup();
        for (d, f) in [(2, 0), (31, 0), (1, 1), (0, 7)] {
            io.write(0, &cf8(d, f, 0));
            assert_eq!(io_read(&mut io, 4, 4), u32::MAX, "{d}.{f}");
            assert_eq!(io_read(&mut io, 4, 2), 0xffff, "{d}.{f}");
            assert_eq!(ecam_read(&mut m, ecam(d.into(), f.into(), 0), 4), u32::MAX, "{d}.{f}");
            io.write(4, &[0; 4]);
        }
        io.write(0, &(0x8001_0000u32).to_le_bytes());
        assert_eq!(io_read(&mut io, 4, 4), u32::MAX, "bus 1");
        assert_eq!(ecam_read(&mut m, 1 << 20, 4), u32::MAX, "bus 1 in ECAM");
    }

    #[test]
    fn ecam_decodes_device_function_register() {
        let (_, dev, _, _, mut m) = setup();
        assert_eq!(ecam_read(&mut m, 0, 4), 0x0d57_8086);
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 0), 4), 0x1041_1af4);
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 2), 2), 0x1041);
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 0xb), 1), 0x02);
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 0x3c), 4) >> 8 & 0xff, 1, "INTA#");
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 0x103), 2), 0xffff, "crosses a dword");
        assert_eq!(ecam_read(&mut m, ecam(1, 0, 0x200), 4), 0, "extended space exists, empty");
        m.write(ecam(1, 0, 0x3c), &[0x33]);
        m.write(ecam(1, 0, 0x3c), &[1, 2, 3, 4, 5, 6, 7, 8]);
        m.write(ecam(1, 0, 0x3f), &[1, 2]);
        assert_eq!(dev.lock().unwrap().config.read(0x3c, 2), 0x0133);
        let mut big = [0u8; 8];
        m.read(ecam(1, 0, 0), &mut big);
        assert_eq!(big, [0xff; 8], "an 8-byte read");
    }

    #[test]
    fn bar_sizing_reads_back_the_size_mask_and_moves_nothing() {
        let (_, dev, moves, _, mut m) = setup();
        dev.lock().unwrap().config.set_bar_address(2, 0xc000_1000).unwrap();
        dev.lock().unwrap().config.set_bar_address(0, 0xc000_4000).unwrap();
        let bar = |i: u64| ecam(1, 0, 0x10 + 4 * i);
        // 32-bit memory BAR 2, 4 KiB.
        m.write(bar(2), &[0xff; 4]);
        assert_eq!(ecam_read(&mut m, bar(2), 4), 0xffff_f000);
        m.write(bar(2), &0xc000_1000u32.to_le_bytes());
        assert_eq!(ecam_read(&mut m, bar(2), 4), 0xc000_1000);
        // 64-bit prefetchable BAR 0, 16 KiB.
        m.write(bar(0), &[0xff; 4]);
        m.write(bar(1), &[0xff; 4]);
        assert_eq!(ecam_read(&mut m, bar(0), 4), 0xffff_c00c);
        assert_eq!(ecam_read(&mut m, bar(1), 4), 0xffff_ffff);
        m.write(bar(0), &0xc000_4000u32.to_le_bytes());
        m.write(bar(1), &[0; 4]);
        assert_eq!(ecam_read(&mut m, bar(0), 4), 0xc000_400c);
        // I/O BAR 3, 32 ports.
        m.write(bar(3), &[0xff; 4]);
        assert_eq!(ecam_read(&mut m, bar(3), 4), 0xffff_ffe1);
        // Unimplemented BARs read zero and stay zero.
        m.write(bar(4), &[0xff; 4]);
        assert_eq!(ecam_read(&mut m, bar(4), 4), 0);
        assert_eq!(moves.0.lock().unwrap().len(), 0, "{:?}", moves.0.lock().unwrap());
    }

    #[test]
    fn a_reprogrammed_bar_is_reported_as_a_move() {
        let (bus, dev, moves, mut io, _) = setup();
        dev.lock().unwrap().config.set_bar_address(2, 0xc000_1000).unwrap();
        io.write(0, &cf8(1, 0, 0x18));
        // Reserved low bits in the written value are ignored.
        io.write(4, &0xd000_000fu32.to_le_bytes());
        let got = moves.0.lock().unwrap().clone();
        let mv = BarMove { bar: 2, kind: BarKind::Mem32, size: 0x1000, old: Some(0xc000_1000), new: 0xd000_0000 };
        assert_eq!(got, vec![(1, mv)]);
        assert_eq!(io_read(&mut io, 4, 4), 0xd000_0000);
        let regions = bus.lock().unwrap().bar_regions();
        assert_eq!(regions.len(), 1);
        let p = &regions[0];
        assert_eq!((p.slot, p.bar, p.kind, p.addr, p.size), (1, 2, BarKind::Mem32, 0xd000_0000, 0x1000));
        // The region forwards accesses to the device's BAR.
        let r = p.region.clone();
        let mut b = [0u8; 2];
        r.lock().unwrap().read(3, &mut b);
        assert_eq!(b, [5, 5]);
        r.lock().unwrap().write(8, &[9]);
        assert_eq!(dev.lock().unwrap().last_bar_write, Some((2, 8, vec![9])));
        // Moving a 64-bit BAR above 4 GiB: low half, then high half.
        io.write(0, &cf8(1, 0, 0x10));
        io.write(4, &0x0000_8000u32.to_le_bytes());
        io.write(0, &cf8(1, 0, 0x14));
        io.write(4, &1u32.to_le_bytes());
        let got = moves.0.lock().unwrap().clone();
        assert_eq!(got.len(), 3);
        assert_eq!((got[1].1.old, got[1].1.new), (None, 0x8000));
        assert_eq!((got[2].1.old, got[2].1.new), (Some(0x8000), 0x1_0000_8000));
        assert_eq!(dev.lock().unwrap().config.bar_address(0), Some(0x1_0000_8000));
    }

    #[test]
    fn slots_are_checked() {
        let mut bus = PciBus::new();
        assert_eq!(bus.add(Some(0), TestDev::shared()), Err(PciError::SlotTaken(0)));
        assert_eq!(bus.add(Some(32), TestDev::shared()), Err(PciError::SlotTaken(32)));
        assert_eq!(bus.add(Some(5), TestDev::shared()), Ok(5));
        for s in (1..32).filter(|s| *s != 5) {
            assert_eq!(bus.add(None, TestDev::shared()), Ok(s));
        }
        assert_eq!(bus.add(None, TestDev::shared()), Err(PciError::BusFull));
        assert_eq!(bus.devices().count(), 32);
    }
}
