//! A PCI function around a device that knows nothing of PCI: its register block (any
//! `BusDevice` with a persist hook, such as a virtio transport) answers one BAR, MSI-X's table
//! and PBA may share that BAR, and the function's snapshot carries the config space, MSI-X and
//! the device's own state under the device's id.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{BarMove, BarSpec, Msix, MsixState, PciConfig, PciConfigState, PciDevice, PciError, PciIds};
use crate::bus::BusDevice;
use crate::persist::{DeviceStateKind, Persist, PersistError};

/// MSI-X shared between the function (config and BAR accesses) and whoever fires vectors (a
/// device's queue thread): lock, then [`Msix::fire`].
pub type SharedMsix = Arc<Mutex<Msix>>;

fn lock(m: &SharedMsix) -> std::sync::MutexGuard<'_, Msix> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a [`PciFunction`]'s snapshot holds: `S` is its register block's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PciFunctionState<S> {
    pub config: PciConfigState,
    pub msix: Option<MsixState>,
    pub device: S,
}

/// A function whose BAR `bar` is `dev`'s register block; MSI-X accesses inside it go to MSI-X
/// first.
pub struct PciFunction<D: BusDevice + Persist> {
    config: PciConfig,
    msix: Option<SharedMsix>,
    bar: usize,
    dev: D,
}

impl<D: BusDevice + Persist> PciFunction<D> {
    /// `caps` are whole capabilities as bytes (id, next — overwritten when linked — body),
    /// added after MSI-X's.
    pub fn new(
        ids: PciIds,
        bar: usize,
        spec: BarSpec,
        dev: D,
        msix: Option<SharedMsix>,
        caps: &[Vec<u8>],
    ) -> Result<Self, PciError> {
        let mut config = PciConfig::new(ids);
        config.add_bar(bar, spec)?;
        if let Some(m) = &msix {
            let m = lock(m);
            for (at, len) in [(m.table_location(), m.table_len()), (m.pba_location(), m.pba_len())] {
                if usize::from(at.0) != bar || u64::from(at.1) + len > spec.size {
                    return Err(PciError::Msix("table or PBA outside the function's BAR"));
                }
            }
        }
        if let Some(m) = &msix {
            lock(m).add_capability(&mut config)?;
            config.set_interrupt_pin(0);
        }
        for c in caps {
            if c.len() < 2 {
                return Err(PciError::BadState("a capability needs at least its id and next bytes"));
            }
            config.add_capability(c[0], &c[2..])?;
        }
        Ok(PciFunction { config, msix, bar, dev })
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    pub fn msix(&self) -> Option<&SharedMsix> {
        self.msix.as_ref()
    }
}

impl<D: BusDevice + Persist> Persist for PciFunction<D> {
    type State = PciFunctionState<D::State>;

    fn id(&self) -> String {
        self.dev.id()
    }

    fn save(&self) -> Result<Self::State, PersistError> {
        Ok(PciFunctionState {
            config: self.config.state(),
            msix: self.msix.as_ref().map(|m| lock(m).state()),
            device: self.dev.save()?,
        })
    }

    fn restore(&mut self, s: &Self::State) -> Result<(), PersistError> {
        let id = self.id();
        if s.msix.is_some() != self.msix.is_some() {
            return Err(PersistError::component(id, "saved MSI-X state does not match the device's"));
        }
        // MSI-X is restored last: its shape is checked before the device takes its state.
        if let (Some(m), Some(ms)) = (&self.msix, &s.msix) {
            lock(m).check_state(ms).map_err(|e| PersistError::component(&id, e))?;
        }
        let before = self.config.state();
        self.config.restore(&s.config).map_err(|e| PersistError::component(&id, e))?;
        let rest = self.dev.restore(&s.device).and_then(|()| match (&self.msix, &s.msix) {
            (Some(m), Some(ms)) => lock(m).restore(ms).map_err(|e| PersistError::component(&id, e)),
            _ => Ok(()),
        });
        if rest.is_err() {
            // Put the config space back: a refused state leaves the function as it was.
            let _ = self.config.restore(&before);
        }
        rest
    }
}

impl<D: BusDevice + Persist + Send> PciDevice for PciFunction<D>
where
    PciFunctionState<D::State>: DeviceStateKind,
{
    fn config(&self) -> &PciConfig {
        &self.config
    }

    fn config_mut(&mut self) -> &mut PciConfig {
        &mut self.config
    }

    fn write_config(&mut self, reg: usize, byte: usize, data: &[u8]) -> Option<BarMove> {
        let mv = self.config.write(reg, byte, data);
        if let Some(m) = &self.msix {
            lock(m).config_written(&self.config);
        }
        mv
    }

    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if self.msix.as_ref().is_some_and(|m| lock(m).read_bar(bar, offset, data)) {
            return;
        }
        if bar == self.bar {
            self.dev.read(offset, data);
        } else {
            data.fill(0xff);
        }
    }

    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if self.msix.as_ref().is_some_and(|m| lock(m).write_bar(bar, offset, data)) {
            return;
        }
        if bar == self.bar {
            // A device event from a PCI register block has no one to go to: none defines one.
            let _ = self.dev.write(offset, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::SharedDevice;
    use crate::pci::{BarAllocator, MsiMessage, MsixRouting, PciBus, PciConfigMmio, MSIX_CAP_ID};
    use crate::persist::{DeviceState, Persist, PersistDyn};
    use crate::DeviceEvent;

    #[derive(Default)]
    struct Block([u8; 16]);
    impl BusDevice for Block {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = self.0.get(offset as usize + i).copied().unwrap_or(0);
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
            for (i, b) in data.iter().enumerate() {
                if let Some(x) = self.0.get_mut(offset as usize + i) {
                    *x = *b;
                }
            }
            None
        }
    }
    impl Persist for Block {
        type State = Vec<u8>;
        fn id(&self) -> String {
            "blk0".into()
        }
        fn save(&self) -> Result<Vec<u8>, PersistError> {
            Ok(self.0.to_vec())
        }
        fn restore(&mut self, s: &Vec<u8>) -> Result<(), PersistError> {
            self.0 = s.as_slice().try_into().map_err(|_| PersistError::component("blk0", "16 bytes"))?;
            Ok(())
        }
    }

    #[derive(Default)]
    struct Routes(Mutex<Vec<(u16, Option<MsiMessage>)>>);
    impl MsixRouting for Routes {
        fn update(&self, vector: u16, msg: Option<MsiMessage>) {
            self.0.lock().unwrap().push((vector, msg));
        }
        fn trigger(&self, _vector: u16) {}
    }

    fn ids() -> PciIds {
        PciIds { vendor: 0x1af4, device: 0x1042, class: (1, 0, 0), revision: 1, subsystem_vendor: 0, subsystem: 0 }
    }

    fn function(routes: Arc<Routes>) -> PciFunction<Block> {
        let msix = Arc::new(Mutex::new(Msix::new(2, (0, 0x4000), (0, 0x5000), routes).unwrap()));
        let vendor_cap = vec![0x09, 0, 4, 0xaa];
        PciFunction::new(ids(), 0, BarSpec::mem64(0x8000, false), Block::default(), Some(msix), &[vendor_cap]).unwrap()
    }

    #[test]
    fn a_register_block_and_msix_share_one_bar() {
        let f = Arc::new(Mutex::new(function(Arc::new(Routes::default()))));
        {
            let c = f.lock().unwrap();
            assert_eq!(c.config.read(0x40, 1), u32::from(MSIX_CAP_ID));
            assert_eq!(c.config.read(0x41, 1), 0x4c, "the vendor capability follows");
            assert_eq!(c.config.read(0x4c, 4), 0xaa04_0009);
            assert_eq!(c.config.read(0x3d, 1), 0, "no INTx");
        }
        let mut bus = PciBus::new();
        BarAllocator::new((0xc000_0000, 0x10_0000)).unwrap().place(f.lock().unwrap().config_mut()).unwrap();
        bus.add(Some(3), f.clone()).unwrap();
        let region: SharedDevice = bus.bar_regions().remove(0).region;
        region.lock().unwrap().write(2, &[7, 8]);
        region.lock().unwrap().write(0x4000, &0xfee0_0000u32.to_le_bytes());
        let mut b = [0u8; 4];
        region.lock().unwrap().read(0, &mut b);
        assert_eq!(b, [0, 0, 7, 8]);
        region.lock().unwrap().read(0x4000, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0xfee0_0000);
        region.lock().unwrap().read(0x4100, &mut b);
        assert_eq!(b, [0; 4], "past the table: the register block");
        // Enable MSI-X through ECAM; the function passes it on.
        let mut ecam = PciConfigMmio::new(Arc::new(Mutex::new(bus)));
        ecam.write(3 << 15 | 0x42, &0x8000u16.to_le_bytes());
        assert!(f.lock().unwrap().msix().unwrap().lock().unwrap().enabled());
    }

    #[test]
    fn the_snapshot_carries_config_msix_and_the_device() {
        let mut f = function(Arc::new(Routes::default()));
        BarAllocator::new((0xc000_0000, 0x10_0000)).unwrap().place(&mut f.config).unwrap();
        f.write_config(16, 2, &0x8000u16.to_le_bytes());
        f.write_bar(0, 0x4000, &0xfee0_0000u64.to_le_bytes());
        f.write_bar(0, 0x400c, &0u32.to_le_bytes());
        f.write_bar(0, 5, &[9]);
        let saved = serde_json::to_string(&f.save_dyn().unwrap()).unwrap();
        let saved: DeviceState = serde_json::from_str(&saved).unwrap();

        let routes = Arc::new(Routes::default());
        let mut g = function(routes.clone());
        assert_eq!(PersistDyn::id(&g), "blk0");
        g.restore_dyn(&saved).unwrap();
        assert_eq!(g.config.bar_mapped(0), Some(0xc000_0000));
        assert_eq!(g.dev.0[5], 9);
        assert!(g.msix().unwrap().lock().unwrap().enabled());
        let got = routes.0.lock().unwrap().clone();
        assert_eq!(got, vec![(0, Some(MsiMessage { address: 0xfee0_0000, data: 0 })), (1, None)]);

        let mut no_msix = PciFunction::new(ids(), 0, BarSpec::mem32(0x1000), Block::default(), None, &[]).unwrap();
        let e = no_msix.restore_dyn(&saved).unwrap_err().to_string();
        assert_eq!(e, "blk0: saved MSI-X state does not match the device's");
        let e = g.restore_dyn(&DeviceState::TestCounter(1)).unwrap_err().to_string();
        assert_eq!(e, "blk0: saved state is a test state, not this component's");
    }

    /// Found while fuzzing restores (kumo-fuzz `restore`): an MSI-X table of another size was
    /// refused after the device's own state had been taken.
    #[test]
    fn a_refused_msix_state_leaves_the_device_as_it_was() {
        let mut f = function(Arc::new(Routes::default()));
        let before = f.save().unwrap();
        let mut bad = before.clone();
        bad.device[5] = 9;
        bad.msix.as_mut().unwrap().entries.pop();
        let e = f.restore(&bad).unwrap_err().to_string();
        assert!(e.contains("MSI-X table of another size"), "{e}");
        assert!(f.save().unwrap() == before, "a refused state changes nothing");
    }

    #[test]
    fn msix_must_fit_in_the_bar() {
        let msix = Arc::new(Mutex::new(Msix::new(2, (0, 0x4000), (0, 0x5000), Arc::new(Routes::default())).unwrap()));
        let r = PciFunction::new(ids(), 0, BarSpec::mem32(0x4000), Block::default(), Some(msix.clone()), &[]);
        assert!(r.is_err());
        let r = PciFunction::new(ids(), 2, BarSpec::mem32(0x8000), Block::default(), Some(msix), &[]);
        assert!(r.is_err(), "another BAR");
        let r = PciFunction::new(ids(), 0, BarSpec::mem32(0x1000), Block::default(), None, &[vec![9]]);
        assert!(r.is_err(), "a one-byte capability");
    }
}
