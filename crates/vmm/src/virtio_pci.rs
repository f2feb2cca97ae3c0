//! A virtio device as a PCI function on bus 0: kumo_devices' virtio 1.x PCI transport and MSI-X
//! in one 32 KiB BAR, its interrupts on one of seed 000's paths (`kumo_vm::interrupt_paths`), its
//! doorbells as ioeventfds. The NICs (tap and vhost-user) are wired through it.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kumo_devices::pci::{BarMove, BarSpec, Msix, PciConfig, PciDevice, PciFunction, PciIds, SharedMsix};
use kumo_devices::virtio::pci_transport::{NOTIFY_LEN, NOTIFY_OFFSET};
use kumo_devices::virtio::{GuestMemory, Interrupt, VirtioDevice, VirtioPciTransport, NO_VECTOR};
use kumo_devices::{DeviceState, PersistDyn, PersistError};
use kumo_sandbox::lock;
use kumo_vm::interrupt_paths::{IrqPath, PathRouting, SharedDispatcher};
use kumo_vm::interrupts::Interrupts;
use vmm_sys_util::eventfd::EventFd;

use crate::pci::Pci;
use crate::{Error, Result};

/// The BAR: the virtio registers (0x4000), then the MSI-X table and PBA.
const BAR_SIZE: u64 = 0x8000;
const MSIX_TABLE: u32 = 0x4000;
const MSIX_PBA: u32 = 0x6000;

/// The virtio transport's interrupts, through MSI-X (no INTx: the function has no pin).
struct MsixInterrupt(SharedMsix);

impl Interrupt for MsixInterrupt {
    fn trigger(&self, vector: u16) {
        if vector != NO_VECTOR {
            lock(&self.0).fire(vector);
        }
    }
}

/// The PCI function, which also tells the device's thread when the driver did something it
/// must look at (DRIVER_OK, a doorbell written through the BAR rather than its ioeventfd).
pub(crate) struct VirtioFunction<D: VirtioDevice + 'static> {
    f: PciFunction<VirtioPciTransport<D>>,
    kick: EventFd,
}

impl<D: VirtioDevice + 'static> VirtioFunction<D> {
    pub(crate) fn transport(&mut self) -> &mut VirtioPciTransport<D> {
        self.f.device_mut()
    }
}

impl<D: VirtioDevice + 'static> PersistDyn for VirtioFunction<D> {
    fn id(&self) -> String {
        self.f.id()
    }

    fn save_dyn(&self) -> std::result::Result<DeviceState, PersistError> {
        self.f.save_dyn()
    }

    fn check_kind(&self, state: &DeviceState) -> std::result::Result<(), PersistError> {
        self.f.check_kind(state)
    }

    fn restore_dyn(&mut self, state: &DeviceState) -> std::result::Result<(), PersistError> {
        self.f.restore_dyn(state)?;
        let _ = self.kick.write(1);
        Ok(())
    }
}

impl<D: VirtioDevice + 'static> PciDevice for VirtioFunction<D> {
    fn config(&self) -> &PciConfig {
        self.f.config()
    }

    fn config_mut(&mut self) -> &mut PciConfig {
        self.f.config_mut()
    }

    fn read_config(&mut self, reg: usize) -> u32 {
        self.f.read_config(reg)
    }

    fn write_config(&mut self, reg: usize, byte: usize, data: &[u8]) -> Option<BarMove> {
        self.f.write_config(reg, byte, data)
    }

    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        self.f.read_bar(bar, offset, data)
    }

    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        let before = self.f.device().status();
        self.f.write_bar(bar, offset, data);
        let doorbell = (NOTIFY_OFFSET..NOTIFY_OFFSET + NOTIFY_LEN).contains(&offset);
        if doorbell || self.f.device().status() != before {
            let _ = self.kick.write(1);
        }
    }
}

/// Pause state shared by the device's thread and the VMM.
pub(crate) struct Control {
    pub(crate) paused: AtomicBool,
    pub(crate) kick: EventFd,
}

/// A virtio PCI function on the bus: what [`wire`] made.
pub(crate) struct Wired<D: VirtioDevice + 'static> {
    pub(crate) function: Arc<Mutex<VirtioFunction<D>>>,
    pub(crate) slot: u8,
    pub(crate) routing: Arc<PathRouting>,
    pub(crate) ctl: Arc<Control>,
}

/// Puts `device` on `pci` as virtio function `id`: its transport, MSI-X on interrupt path
/// `path`, and `bells` (one eventfd per queue, in queue order) registered as its doorbells'
/// ioeventfds. Every virtio device kumo puts on PCI goes through it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wire<D: VirtioDevice + 'static>(
    id: &str,
    device: D,
    path: IrqPath,
    bells: Vec<EventFd>,
    mem: &GuestMemory,
    irq: Arc<Interrupts>,
    dispatcher: Option<Arc<SharedDispatcher>>,
    pci: &mut Pci,
    dev_err: &dyn Fn(String) -> Error,
) -> Result<Wired<D>> {
    let queues = device.queue_max_sizes().len();
    let device_type = device.device_type();
    let vectors = queues as u16 + 1;
    let routing = Arc::new(PathRouting::new(path, irq, dispatcher).map_err(dev_err)?);
    let msix =
        Msix::new(vectors, (0, MSIX_TABLE), (0, MSIX_PBA), routing.clone()).map_err(|e| dev_err(e.to_string()))?;
    let msix: SharedMsix = Arc::new(Mutex::new(msix));
    let transport =
        VirtioPciTransport::new(id.to_string(), device, mem.clone(), Arc::new(MsixInterrupt(msix.clone())), vectors);
    let caps: Vec<Vec<u8>> = transport.capabilities(0).iter().map(|c| c.to_bytes()).collect();
    let doorbells = transport.notify_offsets();
    let kind = device_type;
    let ids = PciIds {
        vendor: 0x1af4,
        device: transport.pci_device_id(),
        class: pci_class(kind),
        revision: 1,
        subsystem_vendor: 0x1af4,
        // Legacy drivers match the subsystem id to the virtio device type.
        subsystem: kind as u16,
    };
    let f = PciFunction::new(ids, 0, BarSpec::mem32(BAR_SIZE), transport, Some(msix), &caps)
        .map_err(|e| dev_err(e.to_string()))?;
    let evt = || EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(format!("eventfd: {e}")));
    let ctl = Arc::new(Control { paused: AtomicBool::new(false), kick: evt()? });
    let kick = ctl.kick.try_clone().map_err(|e| dev_err(format!("eventfd: {e}")))?;
    let function = Arc::new(Mutex::new(VirtioFunction { f, kick }));
    let slot = pci.add(function.clone())?;
    // The PCI layer registers the doorbells with KVM and moves them with the BAR.
    pci.add_doorbells(slot, 0, doorbells.into_iter().zip(bells).collect());
    Ok(Wired { function, slot, routing, ctl })
}

/// The interrupt path as `vm.info` names it, and its vCPU.
pub(crate) fn irq_info(routing: &PathRouting) -> (&'static str, Option<u32>) {
    match routing.path() {
        IrqPath::Direct => ("direct", None),
        IrqPath::Dedicated { vcpu } => ("dedicated", Some(vcpu)),
        IrqPath::Shared => ("shared", None),
    }
}

/// The PCI class of a virtio device type (virtio 1.x, 4.1.2.1: the class matters to firmware
/// and to tools listing devices, not to virtio drivers).
fn pci_class(device_type: u32) -> (u8, u8, u8) {
    match device_type {
        1 => (0x02, 0x00, 0x00), // network controller
        2 => (0x01, 0x80, 0x00), // mass storage controller, other
        _ => (0xff, 0x00, 0x00),
    }
}
