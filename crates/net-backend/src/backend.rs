//! One client's vhost-user-net device, as the `vhost-user-backend` crate sees it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::io::RawFd;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::{VhostUserBackend, VringEpollHandler};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::nic::{Client, Listen, Mem, Nic, Vring, NUM_QUEUES, TAP_EVENT, VHOST_F_LOG_ALL};

pub const QUEUE_SIZE: usize = 256;

/// Device features offered: VERSION_1, MAC, STATUS, VHOST_F_LOG_ALL (so a migrating frontend
/// shows itself), VHOST_USER_F_PROTOCOL_FEATURES.
pub const FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_NET_F_MAC)
    | (1 << VIRTIO_NET_F_STATUS)
    | VHOST_F_LOG_ALL
    | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// Protocol features offered: CONFIG, BACKEND_REQ, REPLY_ACK, MQ, LOG_SHMFD (dirty logging
/// into the frontend's log memfd: every write to guest memory sets its page's bit).
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::MQ
}

pub struct ClientBackend {
    pub nic: Arc<Nic>,
    pub client: Arc<Client>,
    /// The exit-event consumers handed to `vhost-user-backend`: its `VringEpollHandler::new`
    /// registers each with `into_raw_fd` and never closes it (0.24), one eventfd leaked per
    /// connection. [`ClientBackend::close_exit_events`] closes them once the daemon is gone.
    exit_fds: Mutex<Vec<RawFd>>,
}

impl ClientBackend {
    pub fn new(nic: Arc<Nic>, client: Arc<Client>) -> Self {
        ClientBackend { nic, client, exit_fds: Mutex::new(Vec::new()) }
    }

    /// Closes the exit-event consumers the daemon's worker kept. Call only after the daemon
    /// (and with it its epoll handlers) has been dropped: nothing uses them then.
    pub fn close_exit_events(&self) {
        for fd in std::mem::take(&mut *self.exit_fds.lock().unwrap_or_else(|p| p.into_inner())) {
            // SAFETY: `fd` is a consumer this backend created and handed out; the library turned
            // it into a raw fd it never closes, so it is still open and owned by no one else.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

impl VhostUserBackend for ClientBackend {
    /// Guest memory whose writes set bits in the frontend's dirty log once SET_LOG_BASE
    /// installed one (vhost-user-backend replaces each region's bitmap then): RX buffers and
    /// used rings alike, at their guest-physical page.
    type Bitmap = BitmapMmapRegion;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        FEATURES
    }

    fn acked_features(&self, features: u64) {
        self.client.set_features(features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        protocol_features()
    }

    // No EVENT_IDX is offered: the device signals after every batch.
    fn set_event_idx(&self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let cfg = self.nic.config_space(self.client.id);
        let start = (offset as usize).min(cfg.len());
        let end = (offset as usize).saturating_add(size as usize).min(cfg.len());
        let mut v = cfg[start..end].to_vec();
        v.resize(size as usize, 0);
        v
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<vm_memory::GuestMemoryMmap<BitmapMmapRegion>>) -> io::Result<()> {
        self.client.set_mem(mem as Mem);
        Ok(())
    }

    /// GET_VRING_BASE (stop): no processing section of this client is in progress when the
    /// library reads the ring's index, so no buffer is completed after it answered.
    fn stop_vring(&self, _queue: u32) -> io::Result<()> {
        self.nic.ring_stopped(&self.client);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        vec![(1 << NUM_QUEUES) - 1]
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        self.exit_fds.lock().unwrap_or_else(|p| p.into_inner()).push(consumer.as_raw_fd());
        Some((consumer, notifier))
    }

    fn handle_event(&self, device_event: u16, _evset: EventSet, vrings: &[Vring], _thread_id: usize) -> io::Result<()> {
        self.client.set_vrings(vrings);
        if device_event as usize >= NUM_QUEUES && device_event != TAP_EVENT {
            return Ok(());
        }
        self.nic.on_event(&self.client, device_event)
    }
}

/// The owner's worker watches the tap edge-triggered: it reads until the tap or the buffers
/// run out, and a kick of the receive queue resumes it.
impl Listen for VringEpollHandler<Arc<ClientBackend>> {
    fn add(&self, fd: RawFd) -> io::Result<()> {
        self.register_listener(fd, EventSet::IN | EventSet::EDGE_TRIGGERED, u64::from(TAP_EVENT))
    }

    fn del(&self, fd: RawFd) -> io::Result<()> {
        self.unregister_listener(fd, EventSet::IN | EventSet::EDGE_TRIGGERED, u64::from(TAP_EVENT))
    }
}
