//! A virtio-net NIC as a PCI function, wired as `kumo_vmm::nic` wires it (the virtio PCI
//! transport and MSI-X in one 32 KiB BAR), on an in-memory backend: what the `virtio-net`,
//! `pci` and `restore` targets drive.

use std::sync::{Arc, Mutex};

use kumo_devices::pci::{BarSpec, MsiMessage, Msix, MsixRouting, PciFunction, PciIds, SharedMsix};
use kumo_devices::virtio::net::{Loopback, Net, NetConfig};
use kumo_devices::virtio::testutil::{bring_up, memory, GuestQueue};
use kumo_devices::virtio::{GuestMemory, Interrupt, VirtioDevice, VirtioPciTransport, NO_VECTOR};

pub const BAR_SIZE: u64 = 0x8000;
pub const MSIX_TABLE: u32 = 0x4000;
pub const MSIX_PBA: u32 = 0x6000;
pub const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

pub type Transport = VirtioPciTransport<Net<Loopback>>;
pub type NicFunction = PciFunction<Transport>;

/// Where MSI-X messages go: checked to be APIC messages (the invariant the VMM's routing
/// relies on).
#[derive(Default)]
pub struct Routes(pub Mutex<Vec<(u16, Option<MsiMessage>)>>);

impl MsixRouting for Routes {
    fn update(&self, vector: u16, msg: Option<MsiMessage>) {
        if let Some(m) = msg {
            assert_eq!(m.address & 0xfff0_0000, 0xfee0_0000, "vector {vector} routed to {m:?}");
        }
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push((vector, msg));
    }
    fn trigger(&self, _vector: u16) {}
}

struct MsixInterrupt(SharedMsix);

impl Interrupt for MsixInterrupt {
    fn trigger(&self, vector: u16) {
        if vector != NO_VECTOR {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).fire(vector);
        }
    }
}

pub struct Rig {
    pub mem: GuestMemory,
    pub f: NicFunction,
    pub msix: SharedMsix,
    pub pairs: u16,
}

/// A NIC with `pairs` queue pairs (and a control queue if more than one).
pub fn rig(pairs: u16) -> Rig {
    let mem = memory();
    let net = Net::new(NetConfig { mac: MAC, pairs, offload: pairs > 1 }, Loopback::new(pairs as usize)).expect("net");
    let queues = net.queue_max_sizes().len() as u16;
    let vectors = queues + 1;
    let routing: Arc<dyn MsixRouting> = Arc::new(Routes::default());
    let msix = Msix::new(vectors, (0, MSIX_TABLE), (0, MSIX_PBA), routing).expect("msix");
    let msix: SharedMsix = Arc::new(Mutex::new(msix));
    let t = VirtioPciTransport::new("net0", net, mem.clone(), Arc::new(MsixInterrupt(msix.clone())), vectors);
    let caps: Vec<Vec<u8>> = t.capabilities(0).iter().map(|c| c.to_bytes()).collect();
    let ids = PciIds {
        vendor: 0x1af4,
        device: t.pci_device_id(),
        class: (0x02, 0x00, 0x00),
        revision: 1,
        subsystem_vendor: 0x1af4,
        subsystem: 0x0001,
    };
    let f = PciFunction::new(ids, 0, BarSpec::mem32(BAR_SIZE), t, Some(msix.clone()), &caps).expect("function");
    Rig { mem, f, msix, pairs }
}

impl Rig {
    /// Queues of 16 entries, brought up with every feature offered: a running NIC.
    pub fn bring_up(&mut self) -> Vec<GuestQueue> {
        let t = self.f.device_mut();
        let n = t.device().queue_max_sizes().len();
        let qs: Vec<GuestQueue> = (0..n).map(|i| GuestQueue::new(i, 16)).collect();
        qs.iter().for_each(|q| q.clear(&self.mem));
        let features = t.device().features();
        bring_up(t, features, &qs);
        qs
    }
}
