//! A virtio-net NIC whose queues an external vhost-user backend serves (`--net vhost-user=PATH`):
//! kumo is a standard vhost-user-net frontend (rust-vmm `vhost`). The PCI function, MSI-X and the
//! virtio transport are the tap NIC's ([`crate::virtio_pci::wire`]); only the device behind the
//! transport differs ([`VhostUserNet`]).
//!
//! - **Connect** (when the VM is built): SET_OWNER, GET_FEATURES, GET/SET_PROTOCOL_FEATURES
//!   (MQ, REPLY_ACK, BACKEND_REQ, CONFIG, whichever the backend offers), GET_QUEUE_NUM with MQ,
//!   SET_BACKEND_REQ_FD with BACKEND_REQ, GET_CONFIG with CONFIG. A missing socket, a path that
//!   is not a socket or a refused connection fails the VM's start with one line. With REPLY_ACK
//!   every later request asks for an ack; a backend silent for 10 s fails the request instead of
//!   hanging a vCPU.
//! - **DRIVER_OK**: SET_FEATURES (the driver's ∩ the backend's, plus PROTOCOL_FEATURES),
//!   SET_MEM_TABLE (guest RAM's memfd regions), then per queue SET_VRING_NUM/ADDR/BASE,
//!   SET_VRING_CALL, SET_VRING_KICK (the queue's doorbell ioeventfd itself: guest kicks go to
//!   the backend through KVM, never through a kumo thread) and SET_VRING_ENABLE.
//! - **Interrupts**: each queue's call eventfd is read by the NIC's thread, which raises the
//!   queue's MSI-X vector through the function's MSI-X table. So a masked vector (or a masked
//!   function) pends in the PBA and is delivered on unmask, as the spec asks, and the seed-000
//!   paths (direct, dedicated, shared) apply unchanged; the cost is one hop through that thread.
//! - **Config**: MAC and link status come from GET_CONFIG (a `mac=` given to kumo overrides the
//!   backend's); on the backend's CONFIG_CHANGE_MSG kumo re-reads it and raises the config
//!   interrupt, so the driver sees link up/down. The guest reads LINK_UP while the backend is
//!   connected and (if it offers STATUS and CONFIG) its status says up.
//! - **Reset** (status 0): SET_VRING_ENABLE 0 and GET_VRING_BASE per started queue (the backend
//!   stops the rings).
//! - **Disconnect** (the backend's socket hangs up): the NIC goes link down (config interrupt),
//!   the backend's rings are forgotten, kumo runs on; DEVICE_NEEDS_RESET is not set, since a
//!   reset could not bring the backend back. There is no reconnect.
//! - **Migration** (the backend must offer LOG_SHMFD and VHOST_F_LOG_ALL): when it starts, a
//!   memfd log of one bit per guest page ([`SharedDirtyLog`]), SET_LOG_BASE and SET_FEATURES
//!   with LOG_ALL; the rings are (re)started with VHOST_VRING_F_LOG while it runs. Each dirty-log
//!   round drains the log into the migration's bitmap ([`DeviceDirtyLog`]). The stop phase stops
//!   the rings (GET_VRING_BASE) and keeps their positions in the queues, so the transport's
//!   saved state carries them; the destination's activation sends them with SET_VRING_BASE. A
//!   failed migration restarts the rings; logging ends with SET_FEATURES without LOG_ALL.
//! - **Snapshots** are refused ([`VhostUserNic::snapshot_blocker`]). A user's pause does not
//!   stop the backend (kumo's thread never touches guest memory for this NIC).

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kumo_devices::virtio::net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS};
use kumo_devices::virtio::{
    status, ActivateError, DeviceInterrupt, GuestMemory, VhostUserState, VirtioDevice, VIRTIO_F_RING_EVENT_IDX,
    VIRTIO_F_VERSION_1,
};
use kumo_vm::dirty::{DeviceDirtyLog, PageBitmap, SharedDirtyLog};
use kumo_vm::interrupt_paths::{PathRouting, SharedDispatcher};
use kumo_vm::interrupts::Interrupts;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{
    Frontend, FrontendReqHandler, VhostUserFrontend, VhostUserFrontendReqHandler, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_net as vn;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend as _, GuestMemoryRegion as _};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::NetSpec;
use crate::event_loop::{EventHandler, EventLoop, Interest};
use crate::pci::Pci;
use crate::virtio_pci::{irq_info, wire, Control, VirtioFunction, Wired};
use crate::{Error, Result};
use kumo_sandbox::lock;

/// One RX/TX pair: queue 0 receives, queue 1 transmits (no control queue).
const QUEUES: usize = 2;
const QUEUE_SIZE: u16 = 256;
/// The config bytes kumo asks for: `mac[6]`, `status`, `max_virtqueue_pairs`.
const CONFIG_LEN: usize = 10;
const LINK_UP: u16 = vn::VIRTIO_NET_S_LINK_UP as u16;
/// A backend that stops answering must not hang a vCPU forever (a safety net, not a timing).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Virtio-net features the backend may offer that kumo passes to the driver as they are.
const PASSED_FEATURES: u64 = VIRTIO_F_VERSION_1
    | VIRTIO_F_RING_EVENT_IDX
    | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC)
    | (1 << vn::VIRTIO_NET_F_CSUM)
    | (1 << vn::VIRTIO_NET_F_GUEST_CSUM)
    | (1 << vn::VIRTIO_NET_F_GUEST_TSO4)
    | (1 << vn::VIRTIO_NET_F_GUEST_TSO6)
    | (1 << vn::VIRTIO_NET_F_GUEST_ECN)
    | (1 << vn::VIRTIO_NET_F_GUEST_UFO)
    | (1 << vn::VIRTIO_NET_F_HOST_TSO4)
    | (1 << vn::VIRTIO_NET_F_HOST_TSO6)
    | (1 << vn::VIRTIO_NET_F_HOST_ECN)
    | (1 << vn::VIRTIO_NET_F_HOST_UFO)
    | (1 << vn::VIRTIO_NET_F_MRG_RXBUF);

/// The protocol features kumo asks for (it takes those the backend offers).
pub fn wanted_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// VHOST_F_LOG_ALL: the backend logs every write to guest memory (a migration is running).
const VHOST_F_LOG_ALL: u64 = 1 << 26;
/// VHOST_VRING_F_LOG in SET_VRING_ADDR: the ring's used-ring writes are logged too.
const VHOST_VRING_F_LOG: u32 = 1;

/// Connects to a vhost-user backend's socket, saying in one line why not: no such file, not a
/// socket, nobody listening.
pub fn connect_socket(path: &Path) -> std::result::Result<UnixStream, String> {
    let p = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("vhost-user socket {p} does not exist (is the backend running?)"),
        _ => format!("vhost-user socket {p}: {e}"),
    })?;
    if !meta.file_type().is_socket() {
        return Err(format!("{p} is not a unix socket"));
    }
    let stream = UnixStream::connect(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => {
            format!("cannot connect to vhost-user socket {p}: connection refused (is the backend running?)")
        }
        _ => format!("cannot connect to vhost-user socket {p}: {e}"),
    })?;
    stream.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(|e| format!("vhost-user socket {p}: {e}"))?;
    Ok(stream)
}

/// What the device, the NIC's thread and `vm.info` share.
struct Shared {
    connected: AtomicBool,
    /// The device's interrupts while the driver runs it.
    irq: Mutex<Option<DeviceInterrupt>>,
    /// `virtio_net_config` as the backend last said (MAC already overridden).
    config: Mutex<[u8; CONFIG_LEN]>,
    /// The backend's status field counts (STATUS offered and CONFIG negotiated).
    backend_status: bool,
    /// Set by the backend's CONFIG_CHANGE_MSG; the NIC's thread re-reads the config.
    config_changed: EventFd,
    config_changes: AtomicU64,
    /// The dirty log the backend writes into while a migration runs.
    log: Mutex<Option<Arc<SharedDirtyLog>>>,
}

impl Shared {
    fn link_up(&self) -> bool {
        if !self.connected.load(Ordering::Acquire) {
            return false;
        }
        let c = *lock(&self.config);
        !self.backend_status || u16::from_le_bytes([c[6], c[7]]) & LINK_UP != 0
    }

    fn signal_config(&self) {
        if let Some(irq) = lock(&self.irq).as_ref() {
            irq.signal_config();
        }
    }
}

/// The backend's CONFIG_CHANGE_MSG: acknowledged at once, handled by the NIC's thread (re-reading
/// the config here, on the backend's request channel, could deadlock with a request of ours the
/// backend is answering).
pub struct ConfigChange(Arc<Shared>);

impl VhostUserFrontendReqHandler for ConfigChange {
    fn handle_config_change(&self) -> vhost::vhost_user::HandlerResult<u64> {
        self.0.config_changes.fetch_add(1, Ordering::Relaxed);
        self.0.config_changed.write(1)?;
        Ok(0)
    }
}

/// The frontend side of one vhost-user-net connection: a [`VirtioDevice`] for the transport.
pub struct VhostUserNet {
    path: PathBuf,
    frontend: Frontend,
    /// What GET_FEATURES answered (vhost-user bits included).
    backend_features: u64,
    protocol: VhostUserProtocolFeatures,
    mac_override: Option<[u8; 6]>,
    /// Each queue's doorbell eventfd (what KVM signals on a guest kick) and call eventfd.
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
    shared: Arc<Shared>,
    queues: Option<Vec<Queue>>,
    /// Queues handed to the backend since the last activation.
    started: Vec<usize>,
    /// What the driver acked and the memory it runs in, while it runs the device.
    acked: u64,
    mem: Option<GuestMemory>,
    /// Queues stopped for a migration's stop phase (their positions are in `queues`).
    suspended: Vec<usize>,
}

/// A vhost-user error, in one line.
fn vu(what: &str, e: vhost::Error) -> String {
    format!("{what}: {e}")
}

impl VhostUserNet {
    /// Connects to `path` and negotiates what can be before the driver comes: ownership,
    /// protocol features, the backend request channel, the config. Returns the device and the
    /// handler of the backend's requests (for the NIC's thread to poll), if BACKEND_REQ was
    /// negotiated.
    pub fn connect(
        path: &Path,
        mac_override: Option<[u8; 6]>,
        default_mac: [u8; 6],
        kicks: Vec<EventFd>,
        calls: Vec<EventFd>,
    ) -> std::result::Result<(VhostUserNet, Option<FrontendReqHandler<ConfigChange>>), String> {
        let stream = connect_socket(path)?;
        let mut frontend = Frontend::from_stream(stream, QUEUES as u64);
        frontend.set_owner().map_err(|e| vu("SET_OWNER", e))?;
        let backend_features = frontend.get_features().map_err(|e| vu("GET_FEATURES", e))?;
        if backend_features & VIRTIO_F_VERSION_1 == 0 {
            return Err(format!("the backend does not offer VIRTIO_F_VERSION_1 (features {backend_features:#x})"));
        }
        let mut protocol = VhostUserProtocolFeatures::empty();
        if backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let offered = frontend.get_protocol_features().map_err(|e| vu("GET_PROTOCOL_FEATURES", e))?;
            protocol = offered & wanted_protocol_features();
            frontend.set_protocol_features(protocol).map_err(|e| vu("SET_PROTOCOL_FEATURES", e))?;
            if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if protocol.contains(VhostUserProtocolFeatures::MQ) {
                let n = frontend.get_queue_num().map_err(|e| vu("GET_QUEUE_NUM", e))?;
                if n < QUEUES as u64 {
                    return Err(format!("the backend serves {n} queues, a NIC needs {QUEUES}"));
                }
            }
        }
        let config_changed = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| format!("eventfd: {e}"))?;
        let backend_status =
            protocol.contains(VhostUserProtocolFeatures::CONFIG) && backend_features & VIRTIO_NET_F_STATUS != 0;
        let shared = Arc::new(Shared {
            connected: AtomicBool::new(true),
            irq: Mutex::new(None),
            config: Mutex::new([0; CONFIG_LEN]),
            backend_status,
            config_changed,
            config_changes: AtomicU64::new(0),
            log: Mutex::new(None),
        });
        let req = if protocol.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
            let mut h = FrontendReqHandler::new(Arc::new(ConfigChange(shared.clone())))
                .map_err(|e| format!("backend request channel: {e}"))?;
            h.set_reply_ack_flag(protocol.contains(VhostUserProtocolFeatures::REPLY_ACK));
            let fd = h.get_tx_raw_fd();
            frontend.set_backend_request_fd(&fd).map_err(|e| vu("SET_BACKEND_REQ_FD", e))?;
            Some(h)
        } else {
            None
        };
        let mut dev = VhostUserNet {
            path: path.to_path_buf(),
            frontend,
            backend_features,
            protocol,
            mac_override,
            kicks,
            calls,
            shared,
            queues: None,
            started: Vec::new(),
            acked: 0,
            mem: None,
            suspended: Vec::new(),
        };
        // The MAC when the backend has none to say: the one derived from the socket's path.
        {
            let mut c = lock(&dev.shared.config);
            c[..6].copy_from_slice(&mac_override.unwrap_or(default_mac));
            c[6..8].copy_from_slice(&LINK_UP.to_le_bytes());
            c[8..10].copy_from_slice(&1u16.to_le_bytes());
        }
        // A backend whose GET_CONFIG fails keeps kumo's own config (MAC, link up while connected).
        if let Err(e) = dev.refresh_config() {
            tracing::warn!("vhost-user {}: {e}; using kumo's own config", path.display());
        }
        Ok((dev, req))
    }

    /// Reads the backend's config (with CONFIG) into the cache; `mac=` wins over its MAC.
    fn refresh_config(&mut self) -> std::result::Result<(), String> {
        if !self.protocol.contains(VhostUserProtocolFeatures::CONFIG) {
            return Ok(());
        }
        let (_, got) = self
            .frontend
            .get_config(0, CONFIG_LEN as u32, VhostUserConfigFlags::empty(), &[0; CONFIG_LEN])
            .map_err(|e| vu("GET_CONFIG", e))?;
        let mut c = lock(&self.shared.config);
        if self.mac_override.is_none() && self.backend_features & VIRTIO_NET_F_MAC != 0 {
            c[..6].copy_from_slice(&got[..6]);
        }
        c[6..8].copy_from_slice(&got[6..8]);
        Ok(())
    }

    /// The backend hung up: link down, its rings forgotten.
    fn disconnected(&mut self) {
        if self.shared.connected.swap(false, Ordering::AcqRel) {
            tracing::warn!("vhost-user backend {} disconnected: the NIC's link is down", self.path.display());
            self.started.clear();
            self.shared.signal_config();
        }
    }

    /// The features to SET: the driver's that the backend offers, PROTOCOL_FEATURES, and
    /// LOG_ALL while a migration logs.
    fn feature_word(&self, acked: u64) -> u64 {
        let pf = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let log = if lock(&self.shared.log).is_some() { VHOST_F_LOG_ALL } else { 0 };
        (acked & self.backend_features) | pf | log
    }

    /// SET_LOG_BASE: the backend maps `log` and sets a bit for every page it writes.
    fn send_log_base(&self, log: &SharedDirtyLog) -> std::result::Result<(), String> {
        let region =
            VhostUserDirtyLogRegion { mmap_size: log.len(), mmap_offset: 0, mmap_handle: log.file().as_raw_fd() };
        self.frontend.set_log_base(0, Some(region)).map_err(|e| vu("SET_LOG_BASE", e))
    }

    fn start(&mut self, acked: u64, mem: &GuestMemory, queues: &[Queue]) -> std::result::Result<(), String> {
        let f = &self.frontend;
        let pf = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        f.set_features(self.feature_word(acked)).map_err(|e| vu("SET_FEATURES", e))?;
        let regions = mem
            .iter()
            .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).map_err(|e| vu("guest memory region", e)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        f.set_mem_table(&regions).map_err(|e| vu("SET_MEM_TABLE", e))?;
        // A new memory table drops the backend's log: a migration running now needs it again.
        let log = lock(&self.shared.log).clone();
        if let Some(l) = &log {
            self.send_log_base(l)?;
        }
        let f = &self.frontend;
        let hva = |a: u64, what: &str| {
            mem.get_host_address(GuestAddress(a))
                .map(|p| p as u64)
                .map_err(|_| format!("queue {what} at {a:#x} is outside guest memory"))
        };
        for (i, q) in queues.iter().enumerate() {
            if !q.ready() {
                continue;
            }
            f.set_vring_num(i, q.size()).map_err(|e| vu("SET_VRING_NUM", e))?;
            let addr = VringConfigData {
                queue_max_size: q.max_size(),
                queue_size: q.size(),
                // Logging: the used ring's writes are logged at its guest-physical address.
                flags: if log.is_some() { VHOST_VRING_F_LOG } else { 0 },
                desc_table_addr: hva(q.desc_table(), "descriptor table")?,
                used_ring_addr: hva(q.used_ring(), "used ring")?,
                avail_ring_addr: hva(q.avail_ring(), "available ring")?,
                log_addr: log.is_some().then(|| q.used_ring()),
            };
            f.set_vring_addr(i, &addr).map_err(|e| vu("SET_VRING_ADDR", e))?;
            f.set_vring_base(i, q.next_avail()).map_err(|e| vu("SET_VRING_BASE", e))?;
            f.set_vring_call(i, &self.calls[i]).map_err(|e| vu("SET_VRING_CALL", e))?;
            f.set_vring_kick(i, &self.kicks[i]).map_err(|e| vu("SET_VRING_KICK", e))?;
            self.started.push(i);
        }
        if pf != 0 {
            for &i in &self.started {
                self.frontend.set_vring_enable(i, true).map_err(|e| vu("SET_VRING_ENABLE", e))?;
            }
        }
        // Buffers the driver made available before DRIVER_OK were never notified.
        for &i in &self.started {
            let _ = self.kicks[i].write(1);
        }
        Ok(())
    }

    fn stop(&mut self) {
        let pf = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        for i in std::mem::take(&mut self.started) {
            if !self.shared.connected.load(Ordering::Acquire) {
                break;
            }
            if pf {
                if let Err(e) = self.frontend.set_vring_enable(i, false) {
                    tracing::warn!("vhost-user {}: SET_VRING_ENABLE 0 on queue {i}: {e}", self.path.display());
                }
            }
            if let Err(e) = self.frontend.get_vring_base(i) {
                tracing::warn!("vhost-user {}: GET_VRING_BASE on queue {i}: {e}", self.path.display());
            }
        }
    }
}

impl VhostUserNet {
    /// A migration starts: a log for all of guest RAM (below `ram_end`), SET_LOG_BASE and
    /// SET_FEATURES with LOG_ALL if the driver runs the device (else when it starts it).
    fn start_log(&mut self, ram_end: u64) -> std::result::Result<(), String> {
        let offers = self.protocol.contains(VhostUserProtocolFeatures::LOG_SHMFD)
            && self.backend_features & VHOST_F_LOG_ALL != 0;
        if !offers {
            return Err("the backend cannot log its writes to guest memory (no LOG_SHMFD or VHOST_F_LOG_ALL): hand its NIC to another VM before migrating this one".into());
        }
        let log = Arc::new(SharedDirtyLog::new(ram_end).map_err(|e| format!("dirty log memfd: {e}"))?);
        *lock(&self.shared.log) = Some(log.clone());
        if self.shared.connected.load(Ordering::Acquire) && self.mem.is_some() {
            let r = self.send_log_base(&log).and_then(|()| {
                self.frontend.set_features(self.feature_word(self.acked)).map_err(|e| vu("SET_FEATURES", e))
            });
            if let Err(e) = r {
                *lock(&self.shared.log) = None;
                return Err(e);
            }
        }
        Ok(())
    }

    /// The migration ended or failed: SET_FEATURES without LOG_ALL.
    fn stop_log(&mut self) {
        if lock(&self.shared.log).take().is_none() {
            return;
        }
        if self.shared.connected.load(Ordering::Acquire) && self.mem.is_some() {
            if let Err(e) = self.frontend.set_features(self.feature_word(self.acked)) {
                tracing::warn!("vhost-user {}: SET_FEATURES (logging off): {e}", self.path.display());
            }
        }
    }

    /// The stop phase: each started ring is stopped (GET_VRING_BASE) and its position kept in
    /// the queue, so the device's saved state carries it to the destination.
    fn suspend(&mut self) -> std::result::Result<(), String> {
        let pf = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        // A migration without pre-copy (memory shared) logs nothing; LOG_ALL still tells the
        // backend these rings stop for a migration, so its NIC follows the VM.
        let connected = self.shared.connected.load(Ordering::Acquire);
        if connected && !self.started.is_empty() && self.backend_features & VHOST_F_LOG_ALL != 0 {
            let f = self.feature_word(self.acked) | VHOST_F_LOG_ALL;
            self.frontend.set_features(f).map_err(|e| vu("SET_FEATURES", e))?;
        }
        for i in std::mem::take(&mut self.started) {
            self.suspended.push(i);
            if !self.shared.connected.load(Ordering::Acquire) {
                continue;
            }
            if pf {
                self.frontend.set_vring_enable(i, false).map_err(|e| vu("SET_VRING_ENABLE 0", e))?;
            }
            let base = self.frontend.get_vring_base(i).map_err(|e| vu("GET_VRING_BASE", e))?;
            if let Some(q) = self.queues.as_mut().and_then(|qs| qs.get_mut(i)) {
                // The backend completes every buffer it takes: used and available meet.
                q.set_next_avail(base as u16);
                q.set_next_used(base as u16);
            }
        }
        Ok(())
    }

    /// A failed migration: the rings start again where they stopped.
    fn unsuspend(&mut self) -> std::result::Result<(), String> {
        if std::mem::take(&mut self.suspended).is_empty() || !self.shared.connected.load(Ordering::Acquire) {
            return Ok(());
        }
        let (Some(mem), Some(queues)) = (self.mem.clone(), self.queues.take()) else { return Ok(()) };
        let r = self.start(self.acked, &mem, &queues);
        self.queues = Some(queues);
        r
    }
}

impl VirtioDevice for VhostUserNet {
    type State = VhostUserState;

    fn device_type(&self) -> u32 {
        1
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; QUEUES]
    }

    fn features(&self) -> u64 {
        // kumo answers MAC and STATUS itself when the backend does not.
        (self.backend_features & PASSED_FEATURES) | VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut c = *lock(&self.shared.config);
        let status = if self.shared.link_up() { LINK_UP } else { 0 };
        c[6..8].copy_from_slice(&status.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset).ok().and_then(|o| c.get(o + i)).copied().unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(offset, "vhost-user-net: config write ignored");
    }

    fn activate(
        &mut self,
        acked_features: u64,
        mem: GuestMemory,
        interrupt: DeviceInterrupt,
        queues: Vec<Queue>,
    ) -> std::result::Result<(), ActivateError> {
        *lock(&self.shared.irq) = Some(interrupt);
        self.acked = acked_features;
        self.mem = Some(mem.clone());
        self.suspended.clear();
        let r = if self.shared.connected.load(Ordering::Acquire) {
            self.start(acked_features, &mem, &queues)
        } else {
            // No backend: the driver runs a NIC whose link is down.
            Ok(())
        };
        self.queues = Some(queues);
        r.map_err(|e| ActivateError::Backend(format!("vhost-user backend {}: {e}", self.path.display())))
    }

    fn queue_notify(&mut self, queue: usize) {
        // A doorbell that came through the BAR (not its ioeventfd): pass it on.
        if let Some(k) = self.kicks.get(queue) {
            let _ = k.write(1);
        }
    }

    fn queues(&self) -> Option<&[Queue]> {
        self.queues.as_deref()
    }

    fn reset(&mut self) {
        self.stop();
        *lock(&self.shared.irq) = None;
        self.queues = None;
        self.mem = None;
        self.suspended.clear();
    }

    fn save_state(&self) -> VhostUserState {
        VhostUserState {}
    }

    /// Nothing of its own: the rings' positions come with the transport's queues, and
    /// activation hands them to the backend (SET_VRING_BASE).
    fn restore_state(&mut self, _state: &VhostUserState) -> std::result::Result<(), String> {
        Ok(())
    }
}

/// A NIC served by a vhost-user backend.
pub struct VhostUserNic {
    id: String,
    path: PathBuf,
    slot: u8,
    function: Arc<Mutex<VirtioFunction<VhostUserNet>>>,
    shared: Arc<Shared>,
    routing: Arc<PathRouting>,
    features: (u64, u64),
    /// The end of guest RAM: the dirty log covers pages below it.
    ram_end: u64,
    _ctl: Arc<Control>,
    _events: EventLoop,
}

impl VhostUserNic {
    /// Connects to `spec.vhost_user`, puts NIC `index` (`net<index>`) on `pci` and starts the
    /// thread that relays its interrupts and the backend's requests.
    pub fn new(
        index: usize,
        spec: &NetSpec,
        mem: &GuestMemory,
        irq: Arc<Interrupts>,
        dispatcher: Option<Arc<SharedDispatcher>>,
        pci: &mut Pci,
    ) -> Result<VhostUserNic> {
        let id = format!("net{index}");
        let path = spec.vhost_user.clone().unwrap_or_default();
        let dev_err = |m: String| Error::Devices(format!("{id} (vhost-user {}): {m}", path.display()));
        let default_mac = spec.mac().map_err(dev_err)?;
        let mac_override = spec.mac.as_ref().map(|_| default_mac);
        let evt = || EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(format!("eventfd: {e}")));
        let bells: Vec<EventFd> = (0..QUEUES).map(|_| evt()).collect::<Result<_>>()?;
        let calls: Vec<EventFd> = (0..QUEUES).map(|_| evt()).collect::<Result<_>>()?;
        let dup = |v: &[EventFd]| {
            v.iter().map(|e| e.try_clone()).collect::<std::io::Result<Vec<_>>>().map_err(|e| dev_err(e.to_string()))
        };
        let (kicks, call_fds) = (dup(&bells)?, dup(&calls)?);
        let (dev, req) = VhostUserNet::connect(&path, mac_override, default_mac, kicks, call_fds).map_err(dev_err)?;
        let shared = dev.shared.clone();
        let features = (dev.backend_features, dev.protocol.bits());
        let main_fd = dev.frontend.as_raw_fd();
        let ram_end = mem.iter().map(|r| r.start_addr().0 + r.len()).max().unwrap_or(0);
        let Wired { function, slot, routing, ctl } =
            wire(&id, dev, spec.irq, bells, mem, irq, dispatcher, pci, &dev_err)?;

        // The thread is on the interrupt path: a dedicated path prioritizes it like the tap NIC's.
        let dedicated = matches!(spec.irq, kumo_vm::interrupt_paths::IrqPath::Dedicated { .. });
        let what = format!("{id}'s thread");
        let events = EventLoop::start_with(&id, std::time::Duration::ZERO, move || {
            if dedicated {
                kumo_vm::interrupt_paths::prioritize_this_thread(&what);
            }
        })
        .map_err(|e| dev_err(format!("event loop: {e}")))?;
        // Sources: the calls, the main socket (hang-ups only), the config-change event, the
        // backend's request channel.
        let mut fds: Vec<_> = calls.iter().map(|c| (c.as_raw_fd(), EventSet::IN)).collect();
        fds.push((main_fd, EventSet::READ_HANG_UP));
        fds.push((shared.config_changed.as_raw_fd(), EventSet::IN));
        if let Some(r) = &req {
            fds.push((r.as_raw_fd(), EventSet::IN));
        }
        let handler = Relay { function: function.clone(), shared: shared.clone(), calls, req };
        events.add(&fds, Box::new(handler)).map_err(|e| dev_err(format!("event loop: {e}")))?;
        Ok(VhostUserNic { id, path, slot, function, shared, routing, features, ram_end, _ctl: ctl, _events: events })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Nothing to do: kumo's thread never touches guest memory for this NIC, and the backend
    /// keeps serving while the vCPUs are stopped (frames meet a guest that is not running).
    pub fn pause(&self) {}

    pub fn resume(&self) {}

    pub fn snapshot_blocker(&self) -> String {
        format!(
            "{} is served by vhost-user backend {}: snapshots of such a NIC are not supported (its rings live in the backend; migrate the VM instead)",
            self.id,
            self.path.display()
        )
    }

    /// A migration's stop phase: the backend stops the rings (GET_VRING_BASE) and writes
    /// guest memory no more; their positions go with the device's state.
    pub fn suspend_backend(&self) -> std::result::Result<(), String> {
        let mut f = lock(&self.function);
        f.transport().device_mut().suspend().map_err(|e| format!("{}: stopping the backend's rings: {e}", self.id))
    }

    /// After a failed migration: the rings run again where they stopped.
    pub fn resume_backend(&self) -> std::result::Result<(), String> {
        let mut f = lock(&self.function);
        f.transport().device_mut().unsuspend().map_err(|e| format!("{}: restarting the backend's rings: {e}", self.id))
    }

    /// The NIC as `vm.info` shows it.
    pub fn info(&self) -> kumo_api::NetInfo {
        let (driver_ok, acked) = {
            let mut f = lock(&self.function);
            let ok = f.transport().status() & status::DRIVER_OK != 0;
            (ok, if ok { f.transport().driver_features() } else { 0 })
        };
        let offloads = kumo_devices::virtio::net::offload_names(acked);
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&lock(&self.shared.config)[..6]);
        let (irq, vcpu) = irq_info(&self.routing);
        kumo_api::NetInfo {
            id: self.id.clone(),
            tap: String::new(),
            mac: mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
            queues: 1,
            irq: irq.into(),
            vcpu,
            pci: format!("0000:00:{:02x}.0", self.slot),
            driver_ok,
            offloads,
            counters: kumo_api::NetCounters { interrupts: self.routing.raised(), ..Default::default() },
            vhost_user: Some(kumo_api::VhostUserInfo {
                socket: self.path.display().to_string(),
                connected: self.shared.connected.load(Ordering::Acquire),
                link_up: self.shared.link_up(),
                features: self.features.0,
                protocol_features: self.features.1,
                config_changes: self.shared.config_changes.load(Ordering::Relaxed),
            }),
        }
    }
}

impl DeviceDirtyLog for VhostUserNic {
    fn name(&self) -> String {
        format!("{} (vhost-user {})", self.id, self.path.display())
    }

    fn start_log(&self) -> std::result::Result<(), String> {
        lock(&self.function)
            .transport()
            .device_mut()
            .start_log(self.ram_end)
            .map_err(|e| format!("{}: {e}", self.name()))
    }

    fn fetch_log(&self, into: &mut PageBitmap) -> std::result::Result<u64, String> {
        let log = lock(&self.shared.log).clone();
        Ok(log.map_or(0, |l| l.drain(into)))
    }

    fn stop_log(&self) {
        lock(&self.function).transport().device_mut().stop_log();
    }
}

/// The NIC's thread: relays the backend's calls to MSI-X, handles its requests and notices it
/// hang up.
struct Relay {
    function: Arc<Mutex<VirtioFunction<VhostUserNet>>>,
    shared: Arc<Shared>,
    calls: Vec<EventFd>,
    req: Option<FrontendReqHandler<ConfigChange>>,
}

impl Relay {
    fn gone(&mut self, interest: &mut Interest) {
        lock(&self.function).transport().device_mut().disconnected();
        for s in QUEUES..QUEUES + 3 {
            interest.set(s, EventSet::empty());
        }
    }
}

impl EventHandler for Relay {
    fn handle(&mut self, source: usize, events: EventSet, interest: &mut Interest) {
        match source {
            q if q < QUEUES => {
                let _ = self.calls[q].read();
                if let Some(irq) = lock(&self.shared.irq).as_ref() {
                    irq.signal_used(q);
                }
            }
            s if s == QUEUES => {
                if events.intersects(EventSet::READ_HANG_UP | EventSet::HANG_UP | EventSet::ERROR) {
                    self.gone(interest);
                }
            }
            s if s == QUEUES + 1 => {
                let _ = self.shared.config_changed.read();
                let mut f = lock(&self.function);
                let dev = f.transport().device_mut();
                if let Err(e) = dev.refresh_config() {
                    tracing::warn!("vhost-user {}: {e}", dev.path.display());
                }
                drop(f);
                self.shared.signal_config();
            }
            _ => {
                let r = self.req.as_mut().map(|r| r.handle_request());
                use vhost::vhost_user::Error as E;
                match r {
                    // A request kumo does not serve: answered (if asked) and consumed.
                    Some(Err(E::ReqHandlerError(e))) => {
                        tracing::debug!("vhost-user backend request refused: {e}");
                    }
                    Some(Err(e)) => {
                        // Hung up, or a message kumo cannot make sense of: the channel is not
                        // watched any more (a level-triggered fd in error would spin the thread).
                        if !matches!(e, E::Disconnected | E::PartialMessage) {
                            tracing::warn!("vhost-user backend request channel: {e}; no longer read");
                        }
                        interest.set(QUEUES + 2, EventSet::empty());
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-vu-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn connect_says_in_one_line_why_not() {
        let d = dir();
        let missing = d.join("missing.sock");
        let e = connect_socket(&missing).unwrap_err();
        assert!(e.contains("does not exist") && !e.contains('\n'), "{e}");

        let file = d.join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = connect_socket(&file).unwrap_err();
        assert!(e.contains("is not a unix socket") && !e.contains('\n'), "{e}");

        // A socket nobody listens on any more: bound, then its listener closed.
        let stale = d.join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        let e = connect_socket(&stale).unwrap_err();
        assert!(e.contains("connection refused") && !e.contains('\n'), "{e}");

        let live = d.join("live.sock");
        let _l = UnixListener::bind(&live).unwrap();
        assert!(connect_socket(&live).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_backend_that_closes_at_once_is_a_one_line_error() {
        let d = dir();
        let sock = d.join("b.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || drop(l.accept()));
        let e = VhostUserNet::connect(&sock, None, [0x52, 0x54, 0, 1, 2, 3], vec![], vec![]).err().unwrap();
        assert!(!e.contains('\n'), "{e}");
        t.join().unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn config_change_message_is_acknowledged_and_flagged() {
        let shared = Arc::new(Shared {
            connected: AtomicBool::new(true),
            irq: Mutex::new(None),
            config: Mutex::new([0; CONFIG_LEN]),
            backend_status: true,
            config_changed: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            config_changes: AtomicU64::new(0),
            log: Mutex::new(None),
        });
        let mut h = FrontendReqHandler::new(Arc::new(ConfigChange(shared.clone()))).unwrap();
        // The backend's end of the channel, as SET_BACKEND_REQ_FD would hand it over.
        // SAFETY: dup of a descriptor the handler keeps open; the duplicate is owned here.
        let fd = unsafe { libc::dup(h.get_tx_raw_fd()) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just duplicated and is owned by nothing else.
        let mut backend = unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // VHOST_USER_BACKEND_CONFIG_CHANGE_MSG: request 2, flags version 1, no payload.
        let mut msg = Vec::new();
        for v in [2u32, 1, 0] {
            msg.extend_from_slice(&v.to_le_bytes());
        }
        std::io::Write::write_all(&mut backend, &msg).unwrap();
        h.handle_request().unwrap();
        assert_eq!(shared.config_changes.load(Ordering::Relaxed), 1);
        assert_eq!(shared.config_changed.read().unwrap(), 1);
        // Link status follows the cached config and the connection.
        lock(&shared.config)[6] = LINK_UP as u8;
        assert!(shared.link_up());
        lock(&shared.config)[6] = 0;
        assert!(!shared.link_up());
        lock(&shared.config)[6] = LINK_UP as u8;
        shared.connected.store(false, Ordering::Release);
        assert!(!shared.link_up());
    }
}
