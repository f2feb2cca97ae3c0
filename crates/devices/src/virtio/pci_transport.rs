//! The virtio 1.x modern PCI transport's register logic (virtio 1.2, 4.1), all in one BAR:
//!
//! | BAR offset | region |
//! |---|---|
//! | [`COMMON_CFG_OFFSET`] | `virtio_pci_common_cfg` |
//! | [`ISR_OFFSET`] | the ISR byte (read clears it) |
//! | [`DEVICE_CFG_OFFSET`] | the device's configuration space |
//! | [`NOTIFY_OFFSET`] | queue doorbells, queue `i` at `i * NOTIFY_OFF_MULTIPLIER` |
//!
//! The BAR is [`VIRTIO_BAR_SIZE`] bytes; the PCI layer may put the MSI-X table and PBA past it.
//! [`VirtioPciTransport::capabilities`] lists the vendor capabilities config space must carry.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use super::{
    status, DeviceInterrupt, GuestMemory, Interrupt, SharedIrqState, VirtioDevice, NO_VECTOR, VIRTIO_F_RING_EVENT_IDX,
    VIRTIO_F_VERSION_1,
};
use crate::persist::{Persist, PersistError};

pub const COMMON_CFG_OFFSET: u64 = 0x0000;
pub const COMMON_CFG_LEN: u64 = 0x38;
pub const ISR_OFFSET: u64 = 0x1000;
pub const ISR_LEN: u64 = 4;
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
pub const DEVICE_CFG_LEN: u64 = 0x1000;
pub const NOTIFY_OFFSET: u64 = 0x3000;
pub const NOTIFY_LEN: u64 = 0x1000;
/// Bytes between two queues' doorbells: each is its own 4-byte register, so each can be its own
/// ioeventfd.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
pub const VIRTIO_BAR_SIZE: u64 = 0x4000;

/// PCI ids of a modern virtio device.
pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
pub const VIRTIO_PCI_DEVICE_ID_BASE: u16 = 0x1040;
pub const VIRTIO_PCI_REVISION: u8 = 1;
pub const VIRTIO_PCI_SUBSYSTEM_ID: u16 = 0x1100;

/// `cfg_type` of a virtio PCI capability.
pub const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
pub const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
pub const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
pub const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;
/// The vendor-specific capability id.
pub const PCI_CAP_ID_VNDR: u8 = 0x09;

/// One virtio vendor capability (`struct virtio_pci_cap`, with the notify multiplier for
/// `VIRTIO_PCI_CAP_NOTIFY_CFG`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioPciCap {
    pub cfg_type: u8,
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
    pub notify_off_multiplier: Option<u32>,
}

impl VirtioPciCap {
    /// The capability's bytes as config space holds them, `cap_next` (byte 1) left zero for the
    /// PCI layer to link.
    pub fn to_bytes(&self) -> Vec<u8> {
        let len: u8 = if self.notify_off_multiplier.is_some() { 20 } else { 16 };
        let mut b = vec![PCI_CAP_ID_VNDR, 0, len, self.cfg_type, self.bar, 0, 0, 0];
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.length.to_le_bytes());
        if let Some(m) = self.notify_off_multiplier {
            b.extend_from_slice(&m.to_le_bytes());
        }
        b
    }
}

/// A queue's registers as the driver programs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRegs {
    pub max_size: u16,
    pub size: u16,
    pub enabled: bool,
    pub msix_vector: u16,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
}

impl QueueRegs {
    fn new(max_size: u16) -> Self {
        QueueRegs { max_size, size: max_size, enabled: false, msix_vector: NO_VECTOR, desc: 0, driver: 0, device: 0 }
    }
}

/// A queue in a snapshot: its registers and, once the device runs, its ring positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub regs: QueueRegs,
    pub next_avail: u16,
    pub next_used: u16,
}

/// A virtio PCI device's state in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransportState<S> {
    pub device_type: u32,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub driver_features: u64,
    pub status: u8,
    pub needs_reset: bool,
    pub config_generation: u8,
    pub msix_config: u16,
    pub queue_select: u16,
    pub queues: Vec<QueueSnapshot>,
    /// The device's own state.
    pub device: S,
}

/// The transport of one virtio device: the common config registers, feature negotiation, the
/// status state machine and the device's activation.
pub struct VirtioPciTransport<D: VirtioDevice> {
    id: String,
    device: D,
    mem: GuestMemory,
    sink: Arc<dyn Interrupt>,
    irq: Arc<SharedIrqState>,
    msix_vectors: u16,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_generation: u8,
    queue_select: u16,
    queues: Vec<QueueRegs>,
}

impl<D: VirtioDevice> VirtioPciTransport<D> {
    /// `id` names the device in snapshots (`net0`); `msix_vectors` is its MSI-X table's size
    /// (vectors at or past it are refused, as the spec asks).
    pub fn new(
        id: impl Into<String>,
        device: D,
        mem: GuestMemory,
        sink: Arc<dyn Interrupt>,
        msix_vectors: u16,
    ) -> Self {
        let queues: Vec<QueueRegs> = device.queue_max_sizes().into_iter().map(QueueRegs::new).collect();
        VirtioPciTransport {
            id: id.into(),
            irq: Arc::new(SharedIrqState::new(queues.len())),
            device,
            mem,
            sink,
            msix_vectors,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            queue_select: 0,
            queues,
        }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// PCI device id (0x1040 + virtio device type).
    pub fn pci_device_id(&self) -> u16 {
        VIRTIO_PCI_DEVICE_ID_BASE + self.device.device_type() as u16
    }

    /// The virtio capabilities the PCI layer exposes, all pointing into BAR `bar`.
    pub fn capabilities(&self, bar: u8) -> Vec<VirtioPciCap> {
        let cap = |cfg_type, offset: u64, length: u64| VirtioPciCap {
            cfg_type,
            bar,
            offset: offset as u32,
            length: length as u32,
            notify_off_multiplier: None,
        };
        let notify_len = (self.queues.len() as u64 * NOTIFY_OFF_MULTIPLIER as u64).max(4);
        vec![
            cap(VIRTIO_PCI_CAP_COMMON_CFG, COMMON_CFG_OFFSET, COMMON_CFG_LEN),
            cap(VIRTIO_PCI_CAP_ISR_CFG, ISR_OFFSET, ISR_LEN),
            cap(VIRTIO_PCI_CAP_DEVICE_CFG, DEVICE_CFG_OFFSET, DEVICE_CFG_LEN),
            VirtioPciCap {
                notify_off_multiplier: Some(NOTIFY_OFF_MULTIPLIER),
                ..cap(VIRTIO_PCI_CAP_NOTIFY_CFG, NOTIFY_OFFSET, notify_len)
            },
        ]
    }

    /// The BAR offset of each queue's doorbell, in queue order: one ioeventfd each.
    pub fn notify_offsets(&self) -> Vec<u64> {
        (0..self.queues.len() as u64).map(|i| NOTIFY_OFFSET + i * NOTIFY_OFF_MULTIPLIER as u64).collect()
    }

    /// `device_status` as the driver reads it.
    pub fn status(&self) -> u8 {
        let nr = if self.irq.needs_reset.load(Ordering::Acquire) { status::DEVICE_NEEDS_RESET } else { 0 };
        self.status | nr
    }

    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// A doorbell (a notify write or its ioeventfd): passed to a running device.
    pub fn queue_notify(&mut self, queue: usize) {
        if self.status & status::DRIVER_OK != 0 && queue < self.queues.len() {
            self.device.queue_notify(queue);
        }
    }

    /// A read of `data.len()` bytes at `offset` in the BAR.
    pub fn bar_read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        match offset {
            o if o < COMMON_CFG_OFFSET + COMMON_CFG_LEN => self.common_read(o - COMMON_CFG_OFFSET, data),
            ISR_OFFSET => {
                // Reading the ISR acknowledges it.
                if let Some(b) = data.first_mut() {
                    *b = self.irq.isr.swap(0, Ordering::AcqRel);
                }
            }
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_LEN).contains(&o) => {
                self.device.read_config(o - DEVICE_CFG_OFFSET, data)
            }
            _ => {}
        }
    }

    /// A write of `data` at `offset` in the BAR.
    pub fn bar_write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            o if o < COMMON_CFG_OFFSET + COMMON_CFG_LEN => self.common_write(o - COMMON_CFG_OFFSET, data),
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_LEN).contains(&o) => {
                self.device.write_config(o - DEVICE_CFG_OFFSET, data)
            }
            o if (NOTIFY_OFFSET..NOTIFY_OFFSET + NOTIFY_LEN).contains(&o) => {
                let q = ((o - NOTIFY_OFFSET) / NOTIFY_OFF_MULTIPLIER as u64) as usize;
                self.queue_notify(q);
            }
            _ => tracing::debug!(offset, "virtio: write to a read-only or unused BAR offset"),
        }
    }

    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(self.queue_select as usize)
    }

    fn common_read(&mut self, offset: u64, data: &mut [u8]) {
        let q = self.selected().copied();
        let value: u64 = match (offset, data.len()) {
            (0x00, 4) => self.device_feature_select as u64,
            (0x04, 4) => match self.device_feature_select {
                0 => self.device.features() & 0xffff_ffff,
                1 => self.device.features() >> 32,
                _ => 0,
            },
            (0x08, 4) => self.driver_feature_select as u64,
            (0x0c, 4) => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            (0x10, 2) => self.irq.config_vector.load(Ordering::Acquire) as u64,
            (0x12, 2) => self.queues.len() as u64,
            (0x14, 1) => self.status() as u64,
            (0x15, 1) => self.config_generation as u64,
            (0x16, 2) => self.queue_select as u64,
            (0x18, 2) => q.map_or(0, |q| q.size as u64),
            (0x1a, 2) => q.map_or(NO_VECTOR as u64, |q| q.msix_vector as u64),
            (0x1c, 2) => q.map_or(0, |q| q.enabled as u64),
            // queue_notify_off: the doorbell index is the queue's index.
            (0x1e, 2) => q.map_or(0, |_| self.queue_select as u64),
            (0x20 | 0x28 | 0x30, 8) => q.map_or(0, |q| queue_addr(&q, offset)),
            (0x20 | 0x28 | 0x30, 4) => q.map_or(0, |q| queue_addr(&q, offset) & 0xffff_ffff),
            (0x24 | 0x2c | 0x34, 4) => q.map_or(0, |q| queue_addr(&q, offset - 4) >> 32),
            _ => {
                tracing::debug!(offset, len = data.len(), "virtio: odd common config read");
                0
            }
        };
        let n = data.len().min(8);
        data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
    }

    fn common_write(&mut self, offset: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        let n = data.len().min(8);
        b[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(b);
        let running = self.status & status::DRIVER_OK != 0;
        match (offset, data.len()) {
            (0x00, 4) => self.device_feature_select = v as u32,
            (0x08, 4) => self.driver_feature_select = v as u32,
            (0x0c, 4) => {
                // Features are fixed once FEATURES_OK is set.
                if self.status & status::FEATURES_OK == 0 {
                    match self.driver_feature_select {
                        0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                        1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32),
                        _ => {}
                    }
                }
            }
            (0x10, 2) => {
                let vec = self.checked_vector(v as u16);
                self.irq.config_vector.store(vec, Ordering::Release);
            }
            (0x14, 1) => self.write_status(v as u8),
            (0x16, 2) => self.queue_select = v as u16,
            (0x1a, 2) => {
                let vec = self.checked_vector(v as u16);
                let sel = self.queue_select as usize;
                if let Some(q) = self.queues.get_mut(sel) {
                    q.msix_vector = vec;
                    self.irq.queue_vectors[sel].store(vec, Ordering::Release);
                }
            }
            // The rest configures a queue, which only a driver that has not started may do.
            _ if running => tracing::debug!(offset, "virtio: queue register write after DRIVER_OK ignored"),
            (0x18, 2) => {
                if let Some(q) = self.queues.get_mut(self.queue_select as usize) {
                    let s = v as u16;
                    if s.is_power_of_two() && s <= q.max_size {
                        q.size = s;
                    } else {
                        tracing::debug!(size = s, "virtio: invalid queue size ignored");
                    }
                }
            }
            (0x1c, 2) => {
                if let Some(q) = self.queues.get_mut(self.queue_select as usize) {
                    // Writing 0 is not allowed to the driver; a reset disables queues.
                    if v == 1 {
                        q.enabled = true;
                    }
                }
            }
            (0x20 | 0x28 | 0x30, 8) => self.set_queue_addr(offset, |_| v),
            (0x20 | 0x28 | 0x30, 4) => self.set_queue_addr(offset, |a| (a & !0xffff_ffff) | v),
            (0x24 | 0x2c | 0x34, 4) => self.set_queue_addr(offset - 4, |a| (a & 0xffff_ffff) | (v << 32)),
            _ => tracing::debug!(offset, len = data.len(), "virtio: odd common config write"),
        }
    }

    fn set_queue_addr(&mut self, offset: u64, f: impl FnOnce(u64) -> u64) {
        if let Some(q) = self.queues.get_mut(self.queue_select as usize) {
            let a = match offset {
                0x20 => &mut q.desc,
                0x28 => &mut q.driver,
                _ => &mut q.device,
            };
            *a = f(*a);
        }
    }

    fn checked_vector(&self, v: u16) -> u16 {
        if v < self.msix_vectors {
            v
        } else {
            NO_VECTOR
        }
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if v & old != old {
            tracing::debug!(old, new = v, "virtio: status bits cannot be cleared but by a reset");
            return;
        }
        let added = v & !old;
        let mut new = old | (added & (status::ACKNOWLEDGE | status::FAILED));
        let has = |s: u8, bit: u8| s & bit != 0;
        if has(added, status::DRIVER) && has(new, status::ACKNOWLEDGE) {
            new |= status::DRIVER;
        }
        if has(added, status::FEATURES_OK) && has(new, status::DRIVER) {
            let offered = self.device.features();
            let acked = self.driver_features;
            if acked & !offered == 0 && acked & VIRTIO_F_VERSION_1 != 0 {
                new |= status::FEATURES_OK;
            } else {
                // Left clear: the driver reads it back and gives up on these features.
                tracing::debug!(offered, acked, "virtio: features refused");
            }
        }
        self.status = new;
        if has(added, status::DRIVER_OK) && has(new, status::FEATURES_OK) {
            self.status |= status::DRIVER_OK;
            self.activate();
        }
    }

    fn queue_objects(&self, positions: Option<&[(u16, u16)]>) -> Result<Vec<Queue>, usize> {
        let event_idx = self.driver_features & VIRTIO_F_RING_EVENT_IDX != 0;
        let mut out = Vec::with_capacity(self.queues.len());
        for (i, r) in self.queues.iter().enumerate() {
            let mut q = Queue::new(r.max_size).map_err(|_| i)?;
            q.set_event_idx(event_idx);
            if r.enabled {
                q.try_set_size(r.size).map_err(|_| i)?;
                q.try_set_desc_table_address(GuestAddress(r.desc)).map_err(|_| i)?;
                q.try_set_avail_ring_address(GuestAddress(r.driver)).map_err(|_| i)?;
                q.try_set_used_ring_address(GuestAddress(r.device)).map_err(|_| i)?;
                q.set_ready(true);
                if !q.is_valid(&self.mem) {
                    return Err(i);
                }
                if let Some(&(avail, used)) = positions.and_then(|p| p.get(i)) {
                    q.set_next_avail(avail);
                    q.set_next_used(used);
                }
            }
            out.push(q);
        }
        Ok(out)
    }

    fn activate(&mut self) {
        self.activate_with(None);
    }

    fn activate_with(&mut self, positions: Option<&[(u16, u16)]>) {
        let irq = DeviceInterrupt::new(self.sink.clone(), self.irq.clone());
        let result = match self.queue_objects(positions) {
            Ok(queues) => self.device.activate(self.driver_features, self.mem.clone(), irq.clone(), queues),
            Err(i) => Err(super::ActivateError::BadQueue(i)),
        };
        if let Err(e) = result {
            tracing::warn!(id = %self.id, "virtio: activation failed: {e}");
            irq.needs_reset();
        }
    }

    /// A device reset (status 0): everything the driver set is forgotten.
    pub fn reset(&mut self) {
        if self.status & status::DRIVER_OK != 0 {
            self.device.reset();
        }
        self.status = 0;
        self.driver_features = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.queue_select = 0;
        for q in &mut self.queues {
            *q = QueueRegs::new(q.max_size);
        }
        self.irq.needs_reset.store(false, Ordering::Release);
        self.irq.isr.store(0, Ordering::Release);
        self.irq.config_vector.store(NO_VECTOR, Ordering::Release);
        for v in &self.irq.queue_vectors {
            v.store(NO_VECTOR, Ordering::Release);
        }
    }
}

/// The BAR on a bus: the PCI layer may insert the transport at the BAR's address directly.
impl<D: VirtioDevice> crate::bus::BusDevice for VirtioPciTransport<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.bar_read(offset, data)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<crate::DeviceEvent> {
        self.bar_write(offset, data);
        None
    }
}

fn queue_addr(q: &QueueRegs, offset: u64) -> u64 {
    match offset {
        0x20 => q.desc,
        0x28 => q.driver,
        _ => q.device,
    }
}

impl<D: VirtioDevice> Persist for VirtioPciTransport<D> {
    type State = TransportState<D::State>;

    fn id(&self) -> String {
        self.id.clone()
    }

    fn save(&self) -> Result<Self::State, PersistError> {
        let busy = self.device.in_flight();
        if busy > 0 {
            let m = format!("{busy} requests in flight: the device must be drained before it is saved");
            return Err(PersistError::component(self.id.clone(), m));
        }
        let running = self.device.queues();
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let q = running.and_then(|qs| qs.get(i));
                QueueSnapshot {
                    regs: *r,
                    next_avail: q.map_or(0, |q| q.next_avail()),
                    next_used: q.map_or(0, |q| q.next_used()),
                }
            })
            .collect();
        Ok(TransportState {
            device_type: self.device.device_type(),
            device_feature_select: self.device_feature_select,
            driver_feature_select: self.driver_feature_select,
            driver_features: self.driver_features,
            status: self.status,
            needs_reset: self.irq.needs_reset.load(Ordering::Acquire),
            config_generation: self.config_generation,
            msix_config: self.irq.config_vector.load(Ordering::Acquire),
            queue_select: self.queue_select,
            queues,
            device: self.device.save_state(),
        })
    }

    fn restore(&mut self, s: &Self::State) -> Result<(), PersistError> {
        let id = self.id.clone();
        let err = move |m: String| PersistError::component(id.clone(), m);
        if s.device_type != self.device.device_type() {
            return Err(err(format!(
                "device type {} saved, this device is {}",
                s.device_type,
                self.device.device_type()
            )));
        }
        if s.queues.len() != self.queues.len() {
            return Err(err(format!("{} queues saved, this device has {}", s.queues.len(), self.queues.len())));
        }
        for (i, (q, mine)) in s.queues.iter().zip(&self.queues).enumerate() {
            if q.regs.max_size != mine.max_size || !q.regs.size.is_power_of_two() || q.regs.size > q.regs.max_size {
                return Err(err(format!(
                    "queue {i}: size {} of at most {} does not fit",
                    q.regs.size, q.regs.max_size
                )));
            }
        }
        if s.driver_features & !self.device.features() != 0 {
            return Err(err(format!(
                "features {:#x} saved, this device offers {:#x}",
                s.driver_features,
                self.device.features()
            )));
        }
        // The device's own state is checked (and taken) before the reset, so a refused one
        // leaves the transport as it was; after the reset (which may reset the device) it is
        // put back, and cannot be refused then.
        self.device.restore_state(&s.device).map_err(&err)?;
        self.reset();
        self.device.restore_state(&s.device).map_err(err)?;
        self.device_feature_select = s.device_feature_select;
        self.driver_feature_select = s.driver_feature_select;
        self.driver_features = s.driver_features;
        self.status = s.status;
        self.config_generation = s.config_generation;
        self.queue_select = s.queue_select;
        self.irq.config_vector.store(self.checked_vector(s.msix_config), Ordering::Release);
        for (i, q) in s.queues.iter().enumerate() {
            let vec = self.checked_vector(q.regs.msix_vector);
            self.queues[i] = QueueRegs { msix_vector: vec, ..q.regs };
            self.irq.queue_vectors[i].store(vec, Ordering::Release);
        }
        if s.needs_reset {
            self.irq.needs_reset.store(true, Ordering::Release);
        } else if s.status & status::DRIVER_OK != 0 {
            let positions: Vec<(u16, u16)> = s.queues.iter().map(|q| (q.next_avail, q.next_used)).collect();
            self.activate_with(Some(&positions));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::net::{Loopback, Net, NetConfig, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ};
    use crate::virtio::testutil::*;

    type T = VirtioPciTransport<Net<Loopback>>;

    fn transport(pairs: u16, irqs: &Arc<Irqs>) -> T {
        let net = Net::new(NetConfig { mac: [2, 0, 0, 0, 0, 1], pairs, offload: false }, Loopback::new(pairs as usize));
        VirtioPciTransport::new("net0", net.unwrap(), memory(), shared(irqs), 4)
    }

    const A: u64 = status::ACKNOWLEDGE as u64;
    const D: u64 = status::DRIVER as u64;
    const F: u64 = status::FEATURES_OK as u64;
    const OK: u64 = status::DRIVER_OK as u64;

    fn accept(t: &mut T, features: u64) -> u64 {
        w(t, 0x14, 0, 1);
        w(t, 0x14, A, 1);
        w(t, 0x14, A | D, 1);
        w(t, 0x08, 0, 4);
        w(t, 0x0c, features & 0xffff_ffff, 4);
        w(t, 0x08, 1, 4);
        w(t, 0x0c, features >> 32, 4);
        w(t, 0x14, A | D | F, 1);
        r(t, 0x14, 1)
    }

    #[test]
    fn feature_windows_and_negotiation() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(2, &irqs);
        let offered = t.device().features();
        w(&mut t, 0x00, 0, 4);
        assert_eq!(r(&mut t, 0x04, 4), offered & 0xffff_ffff);
        w(&mut t, 0x00, 1, 4);
        assert_eq!(r(&mut t, 0x04, 4), offered >> 32);
        assert_eq!(r(&mut t, 0x04, 4) & 1, 1, "VERSION_1");
        w(&mut t, 0x00, 2, 4);
        assert_eq!(r(&mut t, 0x04, 4), 0);

        assert_eq!(accept(&mut t, VIRTIO_NET_F_MAC), A | D, "no VERSION_1: FEATURES_OK stays clear");
        assert_eq!(accept(&mut t, VIRTIO_F_VERSION_1 | 1 << 50), A | D, "a feature not offered");
        assert_eq!(accept(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MQ), A | D | F);
        assert_eq!(t.driver_features(), VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MQ);
        // Frozen once FEATURES_OK is set.
        w(&mut t, 0x08, 0, 4);
        w(&mut t, 0x0c, 0, 4);
        assert_eq!(t.driver_features(), VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MQ);
        assert_eq!(r(&mut t, 0x0c, 4), VIRTIO_NET_F_MQ);
    }

    #[test]
    fn status_rules() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(1, &irqs);
        w(&mut t, 0x14, D, 1);
        assert_eq!(r(&mut t, 0x14, 1), 0, "DRIVER before ACKNOWLEDGE");
        w(&mut t, 0x14, A | F, 1);
        assert_eq!(r(&mut t, 0x14, 1), A, "FEATURES_OK before DRIVER");
        w(&mut t, 0x14, A | D | OK, 1);
        assert_eq!(r(&mut t, 0x14, 1), A | D, "DRIVER_OK before FEATURES_OK");
        w(&mut t, 0x14, A, 1);
        assert_eq!(r(&mut t, 0x14, 1), A | D, "bits are only cleared by a reset");
        w(&mut t, 0x14, A | D | 0x40, 1);
        assert_eq!(r(&mut t, 0x14, 1), A | D, "DEVICE_NEEDS_RESET is the device's to set");
        w(&mut t, 0x14, A | D | status::FAILED as u64, 1);
        assert_eq!(r(&mut t, 0x14, 1), A | D | 0x80);
        w(&mut t, 0x14, 0, 1);
        assert_eq!(r(&mut t, 0x14, 1), 0);
        assert_eq!(accept(&mut t, VIRTIO_F_VERSION_1), A | D | F);
        w(&mut t, 0x14, A | D | F | OK, 1);
        assert_eq!(r(&mut t, 0x14, 1), A | D | F | OK);
        assert!(t.device().queues().is_some(), "activated");
        w(&mut t, 0x14, 0, 1);
        assert!(t.device().queues().is_none(), "reset");
        assert_eq!(t.driver_features(), 0);
    }

    #[test]
    fn queue_registers_per_queue() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(1, &irqs);
        assert_eq!(r(&mut t, 0x12, 2), 2, "num_queues");
        for q in 0..2u64 {
            w(&mut t, 0x16, q, 2);
            assert_eq!(r(&mut t, 0x16, 2), q);
            assert_eq!(r(&mut t, 0x18, 2), 256, "max size by default");
            assert_eq!(r(&mut t, 0x1a, 2), NO_VECTOR as u64);
            assert_eq!(r(&mut t, 0x1e, 2), q, "queue_notify_off");
            w(&mut t, 0x18, 64 >> q, 2);
            w(&mut t, 0x18, 100, 2); // not a power of two: ignored
            w(&mut t, 0x18, 512, 2); // past the maximum: ignored
            w(&mut t, 0x1a, q + 1, 2);
            w(&mut t, 0x20, 0x1000 * (q + 1), 4);
            w(&mut t, 0x24, q + 7, 4);
            w(&mut t, 0x28, 0xabc0_0000 + q, 8);
            w(&mut t, 0x30, 0x5000, 4);
            w(&mut t, 0x34, 0x1, 4);
        }
        for q in 0..2u64 {
            w(&mut t, 0x16, q, 2);
            assert_eq!(r(&mut t, 0x18, 2), 64 >> q);
            assert_eq!(r(&mut t, 0x1a, 2), q + 1);
            assert_eq!(r(&mut t, 0x20, 8), ((q + 7) << 32) | (0x1000 * (q + 1)));
            assert_eq!(r(&mut t, 0x24, 4), q + 7);
            assert_eq!(r(&mut t, 0x28, 4), 0xabc0_0000 + q);
            assert_eq!(r(&mut t, 0x2c, 4), 0);
            assert_eq!(r(&mut t, 0x30, 8), 0x1_0000_5000);
            assert_eq!(r(&mut t, 0x1c, 2), 0);
            w(&mut t, 0x1c, 1, 2);
            assert_eq!(r(&mut t, 0x1c, 2), 1);
            w(&mut t, 0x1c, 0, 2);
            assert_eq!(r(&mut t, 0x1c, 2), 1, "only a reset disables a queue");
        }
        // A vector past the MSI-X table reads back as NO_VECTOR.
        w(&mut t, 0x1a, 4, 2);
        assert_eq!(r(&mut t, 0x1a, 2), NO_VECTOR as u64);
        w(&mut t, 0x10, 3, 2);
        assert_eq!(r(&mut t, 0x10, 2), 3);
        w(&mut t, 0x10, 9, 2);
        assert_eq!(r(&mut t, 0x10, 2), NO_VECTOR as u64);
        // No such queue: reads zero, writes go nowhere.
        w(&mut t, 0x16, 5, 2);
        assert_eq!(r(&mut t, 0x18, 2), 0);
        w(&mut t, 0x18, 16, 2);
        assert_eq!(r(&mut t, 0x20, 8), 0);
        // A reset forgets the queues' setup.
        w(&mut t, 0x14, 0, 1);
        w(&mut t, 0x16, 1, 2);
        assert_eq!((r(&mut t, 0x18, 2), r(&mut t, 0x1c, 2), r(&mut t, 0x20, 8)), (256, 0, 0));
        assert_eq!(r(&mut t, 0x1a, 2), NO_VECTOR as u64);
    }

    #[test]
    fn queue_setup_is_fixed_once_running() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(1, &irqs);
        let qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 16)).collect();
        let s = bring_up(&mut t, VIRTIO_F_VERSION_1, &qs);
        assert_eq!(s as u64, A | D | F | OK);
        w(&mut t, 0x16, 0, 2);
        w(&mut t, 0x18, 32, 2);
        w(&mut t, 0x20, 0x9000, 8);
        assert_eq!((r(&mut t, 0x18, 2), r(&mut t, 0x20, 8)), (16, qs[0].desc));
        // Vectors may move while running (a guest re-targeting an interrupt).
        w(&mut t, 0x1a, 3, 2);
        assert_eq!(r(&mut t, 0x1a, 2), 3);
    }

    #[test]
    fn isr_reads_clear_it() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(1, &irqs);
        let qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 16)).collect();
        bring_up(&mut t, VIRTIO_F_VERSION_1, &qs);
        t.device_mut().set_link(false);
        assert_eq!(r(&mut t, ISR_OFFSET, 1), 2, "config change");
        assert_eq!(r(&mut t, ISR_OFFSET, 1), 0);
    }

    #[test]
    fn capabilities_and_doorbells() {
        let irqs = Arc::new(Irqs::default());
        let t = transport(2, &irqs);
        assert_eq!(t.pci_device_id(), 0x1041);
        let caps = t.capabilities(4);
        let types: Vec<u8> = caps.iter().map(|c| c.cfg_type).collect();
        assert_eq!(types, [1, 3, 4, 2]);
        assert!(caps.iter().all(|c| c.bar == 4 && c.offset as u64 + c.length as u64 <= VIRTIO_BAR_SIZE));
        let notify = caps[3];
        assert_eq!(notify.length, 5 * 4);
        assert_eq!(
            notify.to_bytes(),
            [9, 0, 20, 2, 4, 0, 0, 0, 0x00, 0x30, 0, 0, 20, 0, 0, 0, 4, 0, 0, 0],
            "struct virtio_pci_notify_cap"
        );
        assert_eq!(caps[0].to_bytes().len(), 16);
        assert_eq!(t.notify_offsets(), [0x3000, 0x3004, 0x3008, 0x300c, 0x3010]);
    }

    #[test]
    fn sits_on_an_mmio_bus_at_its_bar() {
        use crate::bus::{Bus, BusKind};
        let irqs = Arc::new(Irqs::default());
        let t = Arc::new(std::sync::Mutex::new(transport(1, &irqs)));
        let mut bus = Bus::new(BusKind::Mmio);
        bus.insert(0xe000_0000, VIRTIO_BAR_SIZE, t.clone()).unwrap();
        let mut b = [0u8; 2];
        assert!(bus.read(0xe000_0012, &mut b));
        assert_eq!(u16::from_le_bytes(b), 2, "num_queues");
        assert_eq!(bus.write(0xe000_0014, &[1]), None);
        assert_eq!(r(&mut t.lock().unwrap(), 0x14, 1), A);
    }

    #[test]
    fn odd_accesses_are_harmless() {
        let irqs = Arc::new(Irqs::default());
        let mut t = transport(1, &irqs);
        for off in [0x01, 0x03, 0x13, 0x37, 0x38, 0x1001, 0x2fff, 0x3ffc, 0x4000, u64::MAX - 3] {
            for len in [1usize, 2, 3, 4, 8] {
                let mut b = [0u8; 8];
                t.bar_read(off, &mut b[..len]);
                t.bar_write(off, &b[..len]);
            }
        }
        t.bar_read(0, &mut []);
        t.bar_read(ISR_OFFSET, &mut []);
        t.bar_write(0x14, &[]);
        assert_eq!(r(&mut t, 0x14, 1), 0);
    }
}
