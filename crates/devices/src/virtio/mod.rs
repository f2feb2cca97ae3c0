//! virtio 1.x devices: the modern PCI transport's register logic ([`pci_transport`]) and the
//! devices behind it ([`net`], [`block`]).
//!
//! The transport knows nothing of PCI config space or MSI-X: it exposes one BAR's register
//! block (common config, ISR, device config, notifications) and the list of virtio capabilities
//! the PCI layer puts in config space, and raises interrupts through [`Interrupt`], which the
//! PCI/MSI-X layer implements. A device ([`VirtioDevice`]) gets its queues, the guest's memory
//! and a [`DeviceInterrupt`] when the driver sets DRIVER_OK.

pub mod block;
pub mod mem;
pub mod net;
pub mod pci_transport;
pub mod uring;

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::Arc;

use virtio_queue::Queue;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::GuestMemoryMmap;

pub use pci_transport::{VirtioPciCap, VirtioPciTransport};

use crate::persist::{DeviceState, VirtioFunctionState};

/// A virtio device's own state in snapshots ([`VirtioDevice::State`]): the [`DeviceState`]
/// variant that holds its PCI function's state. Implemented with
/// [`crate::virtio_state_kind!`], beside the variant.
pub trait VirtioState:
    serde::Serialize + serde::de::DeserializeOwned + Clone + std::fmt::Debug + Send + 'static
{
    fn into_device_state(s: VirtioFunctionState<Self>) -> DeviceState;
    /// The function's state if `s` is of this device's kind.
    fn of(s: &DeviceState) -> Option<&VirtioFunctionState<Self>>;
}

/// A vhost-user device's state: none here, it lives in the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct VhostUserState {}

/// The guest memory devices work on: the VM's own (`kumo_vm::GuestMemory`), whose per-page
/// bitmap records every write a device makes, so a live migration resends RX buffers and used
/// rings the device filled after the page was sent.
pub type GuestMemory = GuestMemoryMmap<AtomicBitmap>;

/// A range of that guest memory, as a device reads it in place.
pub type GuestSlice<'a> = vm_memory::VolatileSlice<'a, vm_memory::bitmap::BS<'a, AtomicBitmap>>;

/// `device_status` bits (virtio 1.2, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    pub const FAILED: u8 = 0x80;
}

/// Transport-independent feature bits.
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
pub const VIRTIO_F_RING_EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// "No MSI-X vector" in `msix_config` and `queue_msix_vector`.
pub const NO_VECTOR: u16 = 0xffff;

/// Raises the device's interrupts: implemented by the PCI/MSI-X layer.
pub trait Interrupt: Send + Sync {
    /// Raise MSI-X vector `vector` (an index into the device's MSI-X table), or the legacy
    /// INTx pin when `vector` is [`NO_VECTOR`] (the ISR byte says why). A masked vector is the
    /// MSI-X layer's business (it sets the pending bit).
    fn trigger(&self, vector: u16);
}

/// Why an interrupt was raised, as the ISR byte reports it.
const ISR_QUEUE: u8 = 1;
const ISR_CONFIG: u8 = 2;

/// State the transport and its active device share: vectors the driver may move at any time,
/// the ISR byte and the device's "needs reset" flag.
#[derive(Debug)]
pub(crate) struct SharedIrqState {
    pub(crate) isr: AtomicU8,
    pub(crate) config_vector: AtomicU16,
    pub(crate) queue_vectors: Vec<AtomicU16>,
    pub(crate) needs_reset: AtomicBool,
}

impl SharedIrqState {
    pub(crate) fn new(queues: usize) -> Self {
        SharedIrqState {
            isr: AtomicU8::new(0),
            config_vector: AtomicU16::new(NO_VECTOR),
            queue_vectors: (0..queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
            needs_reset: AtomicBool::new(false),
        }
    }
}

/// What an active device raises interrupts with: one per device, cheap to clone.
#[derive(Clone)]
pub struct DeviceInterrupt {
    sink: Arc<dyn Interrupt>,
    state: Arc<SharedIrqState>,
}

impl DeviceInterrupt {
    pub(crate) fn new(sink: Arc<dyn Interrupt>, state: Arc<SharedIrqState>) -> Self {
        DeviceInterrupt { sink, state }
    }

    /// The driver has new used buffers on queue `queue`.
    pub fn signal_used(&self, queue: usize) {
        let vector = self.state.queue_vectors.get(queue).map_or(NO_VECTOR, |v| v.load(Ordering::Acquire));
        self.state.isr.fetch_or(ISR_QUEUE, Ordering::AcqRel);
        self.sink.trigger(vector);
    }

    /// The device configuration changed (link status, needs reset).
    pub fn signal_config(&self) {
        self.state.isr.fetch_or(ISR_CONFIG, Ordering::AcqRel);
        self.sink.trigger(self.state.config_vector.load(Ordering::Acquire));
    }

    /// The device met something it cannot go on from (a bad ring): DEVICE_NEEDS_RESET is set and
    /// the driver told through a configuration-change interrupt.
    pub fn needs_reset(&self) {
        if !self.state.needs_reset.swap(true, Ordering::AcqRel) {
            tracing::warn!("virtio device needs reset");
            self.signal_config();
        }
    }
}

/// Why a device could not be activated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActivateError {
    #[error("queue {0}'s rings are not inside guest memory")]
    BadQueue(usize),
    #[error("{0}")]
    Backend(String),
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// Its own state in snapshots (configuration, counters), with its [`DeviceState`] variant.
    type State: VirtioState;
    /// The virtio device id (1: network).
    fn device_type(&self) -> u32;
    /// Each queue's maximum size (a power of two); the length is the number of queues.
    fn queue_max_sizes(&self) -> Vec<u16>;
    /// The features it offers, VERSION_1 included.
    fn features(&self) -> u64;
    /// Reads its configuration space at `offset`; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes its configuration space; most devices' fields are read-only.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device with the features the driver accepted and every queue (a queue the
    /// driver did not enable is not `ready`). The queues' addresses have been checked against
    /// `mem` by the transport.
    fn activate(
        &mut self,
        acked_features: u64,
        mem: GuestMemory,
        interrupt: DeviceInterrupt,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError>;
    /// The driver wrote queue `queue`'s doorbell (or its ioeventfd fired).
    fn queue_notify(&mut self, queue: usize);
    /// The active queues, for snapshots (`None` before activation).
    fn queues(&self) -> Option<&[Queue]>;
    /// Back to the state before activation; the backend is kept.
    fn reset(&mut self);
    /// Requests whose I/O has not completed: a snapshot is refused while there are any (the
    /// device must be drained first).
    fn in_flight(&self) -> usize {
        0
    }
    /// Device-specific state for snapshots.
    fn save_state(&self) -> Self::State;
    /// Puts back [`VirtioDevice::save_state`]'s state; called before a re-activation (and once
    /// before the transport's reset, to check it: a refusal then leaves everything as it was).
    fn restore_state(&mut self, state: &Self::State) -> Result<(), String>;
}

#[cfg(any(test, feature = "testutil"))]
pub mod testutil;
