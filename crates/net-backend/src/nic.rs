//! The NIC all clients share: who owns it, the data path, handover and failover.
//!
//! One mutex (`Nic::state`) guards the tap, the owner and every queue-processing section, so
//! at no instant are two clients' queues processed; the in-flight probe counts it anyway so a
//! test catches a change that breaks it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};
use std::os::unix::io::RawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kumo_devices::virtio::net::NetBackend;
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

/// Queue 0 receives (tap → guest), queue 1 transmits.
pub const RX: usize = 0;
pub const TX: usize = 1;
pub const NUM_QUEUES: usize = 2;
/// The epoll id of the tap fd in the owner's vring worker (ids up to NUM_QUEUES are taken).
pub const TAP_EVENT: u16 = NUM_QUEUES as u16 + 1;
const MAX_FRAME: usize = kumo_devices::virtio::net::MAX_FRAME_LEN;

pub type Mem = GuestMemoryAtomic<GuestMemoryMmap<BitmapMmapRegion>>;
pub type Vring = VringRwLock<Mem>;

/// Where the owner's worker waits: the tap fd is added to / removed from it on ownership changes.
pub trait Listen: Send + Sync {
    fn add(&self, fd: RawFd) -> io::Result<()>;
    fn del(&self, fd: RawFd) -> io::Result<()>;
}

#[derive(Debug, Default)]
pub struct Counters {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_dropped: AtomicU64,
}

/// One connected frontend (VM).
pub struct Client {
    pub id: u32,
    pub pid: Option<i32>,
    vrings: Mutex<Option<Vec<Vring>>>,
    mem: Mutex<Option<Mem>>,
    listen: Mutex<Option<Arc<dyn Listen>>>,
    /// The backend-request channel (VHOST_USER_SET_BACKEND_REQ_FD), for config-change messages.
    req: Mutex<Option<UnixStream>>,
    features: AtomicU64,
    log_all: AtomicBool,
    pub counters: Counters,
}

/// VHOST_F_LOG_ALL: the frontend logs dirty pages, i.e. it is migrating.
pub const VHOST_F_LOG_ALL: u64 = 1 << 26;

impl Client {
    pub fn new(id: u32, pid: Option<i32>) -> Self {
        Client {
            id,
            pid,
            vrings: Mutex::new(None),
            mem: Mutex::new(None),
            listen: Mutex::new(None),
            req: Mutex::new(None),
            features: AtomicU64::new(0),
            log_all: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    pub fn set_vrings(&self, vrings: &[Vring]) {
        let mut v = lock(&self.vrings);
        if v.is_none() {
            *v = Some(vrings.to_vec());
        }
    }

    pub fn set_mem(&self, mem: Mem) {
        *lock(&self.mem) = Some(mem);
    }

    pub fn set_listen(&self, l: Arc<dyn Listen>) {
        *lock(&self.listen) = Some(l);
    }

    /// Nonblocking: a frontend that does not read its channel (stopped, hung) must not hold
    /// up a handover; its config change is dropped then.
    pub fn set_req(&self, s: UnixStream) {
        if let Err(e) = s.set_nonblocking(true) {
            tracing::warn!("client {}: backend-request channel: {e}", self.id);
        }
        *lock(&self.req) = Some(s);
    }

    pub fn set_features(&self, f: u64) {
        self.features.store(f, Ordering::SeqCst);
        self.log_all.store(f & VHOST_F_LOG_ALL != 0, Ordering::SeqCst);
    }

    pub fn features(&self) -> u64 {
        self.features.load(Ordering::SeqCst)
    }

    pub fn migrating(&self) -> bool {
        self.log_all.load(Ordering::SeqCst)
    }

    /// Ok when the driver has started and enabled both queues (the DRIVER_OK of vhost-user) and
    /// the frontend is not migrating; otherwise why not.
    pub fn check_ready(&self) -> Result<(), String> {
        if self.migrating() {
            return Err(format!("client {} is migrating (dirty logging is on)", self.id));
        }
        self.check_rings()
    }

    /// Ok when the memory table is set and both queues are started and enabled.
    fn check_rings(&self) -> Result<(), String> {
        if lock(&self.mem).is_none() {
            return Err(format!("client {} is not ready: no memory table yet", self.id));
        }
        let v = lock(&self.vrings);
        let Some(vrings) = v.as_ref() else {
            return Err(format!("client {} is not ready: its driver has not started its queues", self.id));
        };
        for (i, vr) in vrings.iter().enumerate() {
            let s = vr.get_ref();
            if !s.get_queue().ready() || !s.is_enabled() {
                return Err(format!("client {} is not ready: queue {i} is not started and enabled", self.id));
            }
        }
        Ok(())
    }

    pub fn ready(&self) -> bool {
        self.check_ready().is_ok()
    }

    /// Sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG (no payload, no reply asked) so the frontend
    /// re-reads the config space (the link bit). Returns false when there is no channel.
    pub fn send_config_change(&self) -> bool {
        let mut r = lock(&self.req);
        let Some(s) = r.as_mut() else { return false };
        // request = 2 (CONFIG_CHANGE_MSG), flags = version 1, size = 0.
        let mut msg = [0u8; 12];
        msg[0..4].copy_from_slice(&2u32.to_le_bytes());
        msg[4..8].copy_from_slice(&1u32.to_le_bytes());
        match s.write_all(&msg) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("client {}: config change not sent: {e}", self.id);
                false
            }
        }
    }

    fn vrings(&self) -> Option<Vec<Vring>> {
        lock(&self.vrings).clone()
    }

    fn listen(&self) -> Option<Arc<dyn Listen>> {
        lock(&self.listen).clone()
    }

    /// Breaks the client ↔ worker reference cycle once it is gone.
    fn detach(&self) {
        *lock(&self.listen) = None;
        *lock(&self.vrings) = None;
        *lock(&self.req) = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// What the API answers: kumo-api's types.
pub use kumo_api::net_backend::{BackendClient as ClientInfo, BackendInfo as Info, HandoverReport};

#[derive(Debug, Clone)]
struct HandoverRecord {
    from: Option<u32>,
    to: u32,
    last_a: Option<Instant>,
    switch: Instant,
    first_b: Option<Instant>,
    drained: u64,
    pause: Duration,
}

impl HandoverRecord {
    fn report(&self) -> HandoverReport {
        let start = self.last_a.unwrap_or(self.switch);
        HandoverReport {
            from: self.from,
            to: self.to,
            outage_us: self.first_b.map(|b| b.saturating_duration_since(start).as_micros() as u64),
            switch_us: self.switch.saturating_duration_since(start).as_micros() as u64,
            first_serve_after_switch_us: self
                .first_b
                .map(|b| b.saturating_duration_since(self.switch).as_micros() as u64),
            drained_at_switch: self.drained,
            pause_us: self.pause.as_micros() as u64,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandoverError {
    #[error("no client {0}")]
    Unknown(u32),
    #[error("{0}")]
    NotReady(String),
    #[error("{0}")]
    Migrating(String),
}

/// The owner stopped its rings while migrating (its stop phase): the NIC follows the VM to the
/// first client that becomes ready afterwards (its destination), not to a standby.
#[derive(Debug, Clone)]
struct Migration {
    from: u32,
    /// Clients that were ready when `from` stopped: standbys, never the destination.
    standbys: BTreeSet<u32>,
}

struct State {
    net: Box<dyn NetBackend>,
    owner: Option<u32>,
    migration: Option<Migration>,
    clients: BTreeMap<u32, Arc<Client>>,
    /// A frame read from the tap that found no receive buffer yet; it goes out first.
    pending: Option<Vec<u8>>,
    buf: Vec<u8>,
    last_served: Option<(u32, Instant)>,
    handover: Option<HandoverRecord>,
    handovers: u64,
    /// Buffers processed for a client that did not own the NIC (must stay 0).
    foreign_serves: u64,
}

pub struct Nic {
    state: Mutex<State>,
    served: Condvar,
    pub tap: String,
    pub mac: [u8; 6],
    /// The NIC goes by itself to the first client that becomes ready while it has no owner
    /// (at start and after the owner disconnects); off: only handovers assign it.
    pub auto_own: bool,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// Counts processing sections in progress; the maximum ever seen must be 1.
struct Probe<'a>(&'a Nic);

impl<'a> Probe<'a> {
    fn enter(nic: &'a Nic) -> Self {
        let n = nic.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        nic.max_in_flight.fetch_max(n, Ordering::SeqCst);
        Probe(nic)
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("bad MAC {s:?} (want xx:xx:xx:xx:xx:xx)");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut m = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        m[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(m)
}

impl Nic {
    pub fn new(net: Box<dyn NetBackend>, tap: &str, mac: [u8; 6], auto_own: bool) -> Self {
        Nic {
            state: Mutex::new(State {
                net,
                owner: None,
                migration: None,
                clients: BTreeMap::new(),
                pending: None,
                buf: vec![0; MAX_FRAME],
                last_served: None,
                handover: None,
                handovers: 0,
                foreign_serves: 0,
            }),
            served: Condvar::new(),
            tap: tap.to_string(),
            mac,
            auto_own,
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        }
    }

    pub fn owner(&self) -> Option<u32> {
        lock(&self.state).owner
    }

    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn foreign_serves(&self) -> u64 {
        lock(&self.state).foreign_serves
    }

    pub fn link_up(&self, id: u32) -> bool {
        self.owner() == Some(id)
    }

    /// The virtio-net config space of client `id`: mac, status (LINK_UP only for the owner),
    /// max_virtqueue_pairs = 1.
    pub fn config_space(&self, id: u32) -> [u8; 10] {
        let mut c = [0u8; 10];
        c[..6].copy_from_slice(&self.mac);
        let status: u16 = if self.link_up(id) { 1 } else { 0 };
        c[6..8].copy_from_slice(&status.to_le_bytes());
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c
    }

    pub fn add_client(&self, c: Arc<Client>) {
        lock(&self.state).clients.insert(c.id, c);
    }

    pub fn client(&self, id: u32) -> Option<Arc<Client>> {
        lock(&self.state).clients.get(&id).cloned()
    }

    /// Moves the tap fd from the old owner's worker to the new one's and records the owner.
    fn set_owner(st: &mut State, new: Option<u32>) {
        let fd = st.net.fd(0);
        if let (Some(old), Some(fd)) = (st.owner.and_then(|o| st.clients.get(&o)), fd) {
            if let Some(l) = old.listen() {
                let _ = l.del(fd);
            }
        }
        st.owner = new;
        if let (Some(c), Some(fd)) = (new.and_then(|n| st.clients.get(&n)), fd) {
            if let Some(l) = c.listen() {
                if let Err(e) = l.add(fd) {
                    tracing::warn!("client {}: cannot watch the tap: {e}", c.id);
                }
            }
        }
    }

    /// The owner's worker saw `event` (a kick of queue RX/TX, or TAP_EVENT). Others' kicks are
    /// ignored; an unowned NIC goes to the first ready client when `auto_own` is on.
    pub fn on_event(&self, c: &Arc<Client>, event: u16) -> io::Result<()> {
        let mut notify = Vec::new();
        {
            let mut st = lock(&self.state);
            if self.follow_migration(&mut st, c, event) {
                notify.push(c.clone());
            } else if st.owner.is_none()
                && st.migration.is_none()
                && self.auto_own
                && c.ready()
                && st.clients.contains_key(&c.id)
            {
                tracing::info!("client {} takes the unowned NIC", c.id);
                Self::set_owner(&mut st, Some(c.id));
                notify.push(c.clone());
            }
            if st.owner == Some(c.id) {
                match event as usize {
                    TX => {
                        self.serve_tx(&mut st, c)?;
                    }
                    _ => {
                        // RX kick (new buffers) or the tap: fill what we can.
                        self.serve_rx(&mut st, c)?;
                    }
                }
                if !notify.is_empty() {
                    // It just took the NIC: frames that waited, and its pending transmits.
                    self.serve_rx(&mut st, c)?;
                    self.serve_tx(&mut st, c)?;
                }
            }
        }
        for n in notify {
            n.send_config_change();
        }
        Ok(())
    }

    /// The owner's GET_VRING_BASE: called with no section of `c` in progress (the lock). A
    /// migrating owner stopping its rings is in its stop phase: the NIC will follow its VM.
    pub fn ring_stopped(&self, c: &Client) {
        let mut st = lock(&self.state);
        if st.owner == Some(c.id) && c.migrating() && st.migration.is_none() {
            let standbys = st.clients.values().filter(|x| x.id != c.id && x.ready()).map(|x| x.id).collect();
            tracing::info!("client {} stopped its rings while migrating: the NIC follows its VM", c.id);
            st.migration = Some(Migration { from: c.id, standbys });
        }
    }

    /// With a migration in its stop phase: the source restarting its rings (a failed migration)
    /// keeps the NIC; the first other ready client that was no standby (the destination) takes
    /// it. Returns true when `c` took the NIC.
    fn follow_migration(&self, st: &mut State, c: &Arc<Client>, event: u16) -> bool {
        let Some(m) = st.migration.clone() else { return false };
        if c.id == m.from {
            if (event as usize) < NUM_QUEUES && c.check_rings().is_ok() {
                tracing::info!("client {} runs its rings again: its migration failed, it keeps the NIC", c.id);
                st.migration = None;
            }
            return false;
        }
        if m.standbys.contains(&c.id) || !c.ready() || !st.clients.contains_key(&c.id) {
            return false;
        }
        tracing::info!("client {} is client {}'s migrated VM: it takes the NIC", c.id, m.from);
        st.migration = None;
        let last_a = match st.last_served {
            Some((id, t)) if id == m.from => Some(t),
            _ => None,
        };
        Self::set_owner(st, Some(c.id));
        let switch = Instant::now();
        st.handovers += 1;
        st.handover = Some(HandoverRecord {
            from: Some(m.from),
            to: c.id,
            last_a,
            switch,
            first_b: None,
            drained: 0,
            pause: Duration::ZERO,
        });
        true
    }

    /// Completes every transmit buffer `c` made available; returns how many.
    fn serve_tx(&self, st: &mut State, c: &Client) -> io::Result<u64> {
        let _p = Probe::enter(self);
        let (Some(vrings), Some(mem)) = (c.vrings(), lock(&c.mem).clone()) else { return Ok(0) };
        if st.owner != Some(c.id) {
            st.foreign_serves += 1;
        }
        let mem = mem.memory();
        let vring = &vrings[TX];
        let mut n = 0u64;
        loop {
            let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let mut frame = Vec::new();
            match chain.reader(&mem) {
                Ok(mut r) => {
                    frame.resize(r.available_bytes().min(MAX_FRAME), 0);
                    let len = r.read(&mut frame)?;
                    frame.truncate(len);
                }
                Err(e) => tracing::debug!("client {}: bad tx chain: {e}", c.id),
            }
            if frame.len() > kumo_devices::virtio::net::VNET_HDR_LEN {
                if let Err(e) = st.net.send(0, &frame) {
                    tracing::debug!("tap write: {e}");
                }
                c.counters.tx_packets.fetch_add(1, Ordering::Relaxed);
                c.counters.tx_bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
            }
            vring.add_used(head, 0).map_err(|e| io::Error::other(format!("tx used ring: {e}")))?;
            n += 1;
        }
        if n > 0 {
            self.mark_served(st, c.id);
            vring.signal_used_queue()?;
        }
        Ok(n)
    }

    /// Moves frames from the tap into `c`'s receive buffers until one side runs out; a frame
    /// without a buffer waits in `pending`. Returns how many went in.
    fn serve_rx(&self, st: &mut State, c: &Client) -> io::Result<u64> {
        let _p = Probe::enter(self);
        let (Some(vrings), Some(mem)) = (c.vrings(), lock(&c.mem).clone()) else { return Ok(0) };
        if st.owner != Some(c.id) {
            st.foreign_serves += 1;
        }
        let mem = mem.memory();
        let vring = &vrings[RX];
        let mut n = 0u64;
        loop {
            if st.pending.is_none() {
                let State { net, buf, .. } = &mut *st;
                match net.recv(0, buf)? {
                    Some(len) => {
                        let mut f = buf[..len].to_vec();
                        // VERSION_1 without MRG_RXBUF: the device sets num_buffers to 1 (the tap
                        // leaves those two header bytes alone).
                        if let Some(nb) = f.get_mut(10..12) {
                            nb.copy_from_slice(&1u16.to_le_bytes());
                        }
                        st.pending = Some(f);
                    }
                    None => break,
                }
            }
            let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let frame = st.pending.take().unwrap_or_default();
            let written = match chain.writer(&mem) {
                Ok(mut w) if w.available_bytes() >= frame.len() => {
                    w.write_all(&frame)?;
                    c.counters.rx_packets.fetch_add(1, Ordering::Relaxed);
                    c.counters.rx_bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
                    frame.len()
                }
                _ => {
                    c.counters.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    0
                }
            };
            vring.add_used(head, written as u32).map_err(|e| io::Error::other(format!("rx used ring: {e}")))?;
            n += 1;
        }
        if n > 0 {
            self.mark_served(st, c.id);
            vring.signal_used_queue()?;
        }
        Ok(n)
    }

    fn mark_served(&self, st: &mut State, id: u32) {
        let now = Instant::now();
        st.last_served = Some((id, now));
        if let Some(h) = st.handover.as_mut() {
            if h.to == id && h.first_b.is_none() {
                h.first_b = Some(now);
                self.served.notify_all();
            }
        }
    }

    /// Hands the NIC to client `to`: the current owner's pending transmit buffers are completed
    /// to it, the tap moves to `to`'s worker, frames waiting in the tap go to `to`'s buffers,
    /// then `to` hears link up and the old owner link down. Refused (owner unchanged) when `to`
    /// is unknown, not ready or migrating. Waits up to `wait` for the first buffer served to
    /// `to` so the report carries the outage.
    pub fn handover(&self, to: u32, wait: Duration) -> Result<HandoverReport, HandoverError> {
        let (old, new) = {
            let mut st = lock(&self.state);
            let taken = Instant::now();
            let Some(b) = st.clients.get(&to).cloned() else { return Err(HandoverError::Unknown(to)) };
            if b.migrating() {
                return Err(HandoverError::Migrating(format!("client {to} is migrating (dirty logging is on)")));
            }
            b.check_ready().map_err(HandoverError::NotReady)?;
            let from = st.owner;
            // An explicit handover ends a migration's hold on the NIC.
            st.migration = None;
            if from == Some(to) {
                let rec = HandoverRecord {
                    from,
                    to,
                    last_a: None,
                    switch: Instant::now(),
                    first_b: Some(Instant::now()),
                    drained: 0,
                    pause: Duration::ZERO,
                };
                return Ok(rec.report());
            }
            // Finish A's in-flight transmits and complete them to A.
            let a = from.and_then(|f| st.clients.get(&f).cloned());
            if let Some(a) = &a {
                if let Err(e) = self.serve_tx(&mut st, a) {
                    tracing::warn!("client {}: final tx: {e}", a.id);
                }
            }
            let last_a = match (st.last_served, from) {
                (Some((id, t)), Some(f)) if id == f => Some(t),
                _ => None,
            };
            Self::set_owner(&mut st, Some(to));
            let switch = Instant::now();
            st.handovers += 1;
            st.handover =
                Some(HandoverRecord { from, to, last_a, switch, first_b: None, drained: 0, pause: switch - taken });
            // B's rings are used as they stand; serve what waits.
            let drained = self.serve_rx(&mut st, &b).unwrap_or(0);
            if let Some(h) = st.handover.as_mut() {
                h.drained = drained;
            }
            let _ = self.serve_tx(&mut st, &b);
            (a, b)
        };
        new.send_config_change();
        if let Some(a) = old {
            a.send_config_change();
        }
        let deadline = Instant::now() + wait;
        let mut st = lock(&self.state);
        while let Some(h) = st.handover.as_ref() {
            if h.to != to || h.first_b.is_some() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self.served.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(st.handover.as_ref().map(|h| h.report()).unwrap_or(HandoverReport {
            from: None,
            to,
            outage_us: None,
            switch_us: 0,
            first_serve_after_switch_us: None,
            drained_at_switch: 0,
            pause_us: 0,
        }))
    }

    /// Client `id` is gone (its connection closed). If it owned the NIC, the NIC is unowned at
    /// once and, with `auto_own`, goes to the lowest-id ready client.
    pub fn remove_client(&self, id: u32) -> Option<u32> {
        let mut notify = None;
        let new_owner = {
            let mut st = lock(&self.state);
            let was_owner = st.owner == Some(id);
            if was_owner {
                Self::set_owner(&mut st, None);
                tracing::info!("owner {id} is gone: the NIC is unowned");
            }
            if let Some(c) = st.clients.remove(&id) {
                c.detach();
            }
            // A migrated VM's source leaving: the NIC waits for the destination.
            let migrated = st.migration.as_ref().is_some_and(|m| m.from == id);
            if was_owner && self.auto_own && !migrated {
                let next = st.clients.values().find(|c| c.ready()).cloned();
                if let Some(n) = next {
                    tracing::info!("failover: client {} takes the NIC", n.id);
                    Self::set_owner(&mut st, Some(n.id));
                    st.handovers += 1;
                    st.handover = Some(HandoverRecord {
                        from: Some(id),
                        to: n.id,
                        last_a: None,
                        switch: Instant::now(),
                        first_b: None,
                        drained: 0,
                        pause: Duration::ZERO,
                    });
                    let _ = self.serve_rx(&mut st, &n);
                    let _ = self.serve_tx(&mut st, &n);
                    notify = Some(n);
                }
            }
            st.owner
        };
        if let Some(n) = notify {
            n.send_config_change();
        }
        new_owner
    }

    pub fn info(&self) -> Info {
        let st = lock(&self.state);
        let clients = st
            .clients
            .values()
            .map(|c| ClientInfo {
                id: c.id,
                pid: c.pid,
                ready: c.ready(),
                migrating: c.migrating(),
                link: st.owner == Some(c.id),
                features: c.features(),
                rx_packets: c.counters.rx_packets.load(Ordering::Relaxed),
                rx_bytes: c.counters.rx_bytes.load(Ordering::Relaxed),
                tx_packets: c.counters.tx_packets.load(Ordering::Relaxed),
                tx_bytes: c.counters.tx_bytes.load(Ordering::Relaxed),
                rx_dropped: c.counters.rx_dropped.load(Ordering::Relaxed),
            })
            .collect();
        Info {
            tap: self.tap.clone(),
            mac: format_mac(&self.mac),
            owner: st.owner,
            auto_own: self.auto_own,
            clients,
            handovers: st.handovers,
            last_handover: st.handover.as_ref().map(|h| h.report()),
            max_in_flight: self.max_in_flight(),
            foreign_serves: st.foreign_serves,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicI32;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    /// A tap stand-in with an fd number (never polled: the listeners are fakes).
    struct FakeNet;

    impl NetBackend for FakeNet {
        fn pairs(&self) -> usize {
            1
        }
        fn recv(&mut self, _: usize, _: &mut [u8]) -> io::Result<Option<usize>> {
            Ok(None)
        }
        fn send(&mut self, _: usize, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
        fn fd(&self, _: usize) -> Option<RawFd> {
            Some(1000)
        }
        fn set_offload(&mut self, _: u64) -> io::Result<()> {
            Ok(())
        }
    }

    /// Records which fd a worker watches (-1: none).
    struct FakeListen(AtomicI32);

    impl Listen for FakeListen {
        fn add(&self, fd: RawFd) -> io::Result<()> {
            self.0.store(fd, Ordering::SeqCst);
            Ok(())
        }
        fn del(&self, fd: RawFd) -> io::Result<()> {
            assert_eq!(self.0.swap(-1, Ordering::SeqCst), fd, "removed a tap it did not watch");
            Ok(())
        }
    }

    fn mem() -> Mem {
        GuestMemoryAtomic::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap())
    }

    /// A client whose driver has started both queues (rings laid out in its own memory).
    fn client(id: u32, started: bool) -> (Arc<Client>, Arc<FakeListen>) {
        let c = Arc::new(Client::new(id, None));
        let m = mem();
        let vrings: Vec<Vring> = (0..NUM_QUEUES as u64)
            .map(|q| {
                let v = Vring::new(m.clone(), 256).unwrap();
                let base = 0x1_0000 * (q + 1);
                v.set_queue_size(256);
                v.set_queue_info(base, base + 0x1000, base + 0x2000).unwrap();
                v.set_queue_ready(started);
                v.set_enabled(started);
                v
            })
            .collect();
        c.set_vrings(&vrings);
        c.set_mem(m);
        let l = Arc::new(FakeListen(AtomicI32::new(-1)));
        c.set_listen(l.clone());
        (c, l)
    }

    fn nic(auto: bool) -> Nic {
        Nic::new(Box::new(FakeNet), "tap-test", [2, 0, 0, 0, 0, 1], auto)
    }

    fn link(n: &Nic, id: u32) -> bool {
        let c = n.config_space(id);
        u16::from_le_bytes([c[6], c[7]]) & 1 == 1
    }

    #[test]
    fn first_ready_client_owns_the_nic_and_only_it_sees_link_up() {
        let n = nic(true);
        let (a, la) = client(1, true);
        let (b, lb) = client(2, true);
        let (c, _) = client(3, false);
        for x in [&a, &b, &c] {
            n.add_client(x.clone());
        }
        assert_eq!(n.owner(), None);
        n.on_event(&c, RX as u16).unwrap(); // not ready: does not take it
        assert_eq!(n.owner(), None);
        n.on_event(&b, RX as u16).unwrap();
        assert_eq!(n.owner(), Some(2));
        n.on_event(&a, TX as u16).unwrap(); // a kick of a non-owner is ignored
        assert_eq!(n.owner(), Some(2));
        assert!(link(&n, 2) && !link(&n, 1) && !link(&n, 3));
        assert_eq!(&n.config_space(1)[..6], &[2, 0, 0, 0, 0, 1]);
        assert_eq!(lb.0.load(Ordering::SeqCst), 1000, "the owner's worker watches the tap");
        assert_eq!(la.0.load(Ordering::SeqCst), -1);
    }

    #[test]
    fn manual_mode_waits_for_a_handover() {
        let n = nic(false);
        let (a, _) = client(1, true);
        n.add_client(a.clone());
        n.on_event(&a, RX as u16).unwrap();
        assert_eq!(n.owner(), None);
        n.handover(1, Duration::ZERO).unwrap();
        assert_eq!(n.owner(), Some(1));
    }

    #[test]
    fn handover_moves_the_tap_and_the_link() {
        let n = nic(false);
        let (a, la) = client(1, true);
        let (b, lb) = client(2, true);
        n.add_client(a);
        n.add_client(b);
        n.handover(1, Duration::ZERO).unwrap();
        let r = n.handover(2, Duration::ZERO).unwrap();
        assert_eq!((r.from, r.to), (Some(1), 2));
        assert_eq!(n.owner(), Some(2));
        assert!(link(&n, 2) && !link(&n, 1));
        assert_eq!((la.0.load(Ordering::SeqCst), lb.0.load(Ordering::SeqCst)), (-1, 1000));
        assert_eq!(n.info().handovers, 2);
        assert_eq!(n.max_in_flight(), 1);
        assert_eq!(n.foreign_serves(), 0);
    }

    #[test]
    fn refused_handovers_leave_the_owner() {
        let n = nic(false);
        let (a, _) = client(1, true);
        let (b, _) = client(2, false);
        let (c, _) = client(3, true);
        c.set_features(VHOST_F_LOG_ALL);
        for x in [&a, &b, &c] {
            n.add_client(x.clone());
        }
        n.handover(1, Duration::ZERO).unwrap();
        assert_eq!(n.handover(9, Duration::ZERO), Err(HandoverError::Unknown(9)));
        assert!(matches!(n.handover(2, Duration::ZERO), Err(HandoverError::NotReady(_))));
        assert!(matches!(n.handover(3, Duration::ZERO), Err(HandoverError::Migrating(_))));
        assert_eq!(n.owner(), Some(1));
        assert!(link(&n, 1));
        // A client without rings at all is not ready either.
        let d = Arc::new(Client::new(4, None));
        n.add_client(d);
        assert!(matches!(n.handover(4, Duration::ZERO), Err(HandoverError::NotReady(_))));
        assert_eq!(n.owner(), Some(1));
    }

    #[test]
    fn owner_disconnect_frees_the_nic_at_once() {
        let n = nic(false);
        let (a, la) = client(1, true);
        let (b, _) = client(2, true);
        n.add_client(a);
        n.add_client(b);
        n.handover(1, Duration::ZERO).unwrap();
        assert_eq!(n.remove_client(1), None);
        assert_eq!(n.owner(), None);
        assert_eq!(la.0.load(Ordering::SeqCst), -1, "the dead owner's worker no longer watches the tap");
        n.handover(2, Duration::ZERO).unwrap();
        assert_eq!(n.owner(), Some(2));
    }

    #[test]
    fn auto_failover_goes_to_the_next_ready_client() {
        let n = nic(true);
        let (a, _) = client(1, true);
        let (b, _) = client(2, false);
        let (c, lc) = client(3, true);
        for x in [&a, &b, &c] {
            n.add_client(x.clone());
        }
        n.on_event(&a, RX as u16).unwrap();
        assert_eq!(n.owner(), Some(1));
        assert_eq!(n.remove_client(1), Some(3), "2 is not ready, 3 is");
        assert!(link(&n, 3));
        assert_eq!(lc.0.load(Ordering::SeqCst), 1000);
        // A non-owner leaving changes nothing.
        assert_eq!(n.remove_client(2), Some(3));
    }

    #[test]
    fn a_migrating_owners_nic_follows_its_vm_not_a_standby() {
        let n = nic(true);
        let (a, _) = client(1, true);
        let (b, lb) = client(2, true);
        n.add_client(a.clone());
        n.add_client(b.clone());
        n.on_event(&a, RX as u16).unwrap();
        assert_eq!(n.owner(), Some(1));
        // A's destination connects while A migrates (not ready yet: no rings).
        let (d, ld) = client(3, false);
        n.add_client(d.clone());
        a.set_features(VHOST_F_LOG_ALL);
        n.ring_stopped(&a);
        // The source leaves: no failover to the standby B, the NIC waits for the destination.
        assert_eq!(n.remove_client(1), None);
        n.on_event(&b, RX as u16).unwrap();
        assert_eq!(n.owner(), None, "the standby does not take a migrating VM's NIC");
        assert_eq!(lb.0.load(Ordering::SeqCst), -1);
        // The destination starts its rings: it takes the NIC.
        let (d2, _) = client(3, true);
        *lock(&d.vrings) = d2.vrings();
        n.on_event(&d, TX as u16).unwrap();
        assert_eq!(n.owner(), Some(3));
        assert!(link(&n, 3) && !link(&n, 2));
        assert_eq!(ld.0.load(Ordering::SeqCst), 1000, "the destination's worker watches the tap");
        assert_eq!(n.info().last_handover.map(|h| (h.from, h.to)), Some((Some(1), 3)));
    }

    #[test]
    fn a_failed_migration_leaves_the_nic_with_its_source() {
        let n = nic(false);
        let (a, _) = client(1, true);
        let (b, _) = client(2, true);
        n.add_client(a.clone());
        n.add_client(b.clone());
        n.handover(1, Duration::ZERO).unwrap();
        a.set_features(VHOST_F_LOG_ALL);
        n.ring_stopped(&a);
        // A non-owner or a non-migrating owner stopping its rings starts nothing.
        n.ring_stopped(&b);
        // The source's rings run again (its kick): the migration is over, it keeps the NIC.
        a.set_features(0);
        n.on_event(&a, TX as u16).unwrap();
        let (c, _) = client(3, true);
        n.add_client(c.clone());
        n.on_event(&c, RX as u16).unwrap();
        assert_eq!(n.owner(), Some(1), "a newcomer does not take the NIC of a VM that stayed");
        // A handover to a standby works as ever.
        n.handover(2, Duration::ZERO).unwrap();
        assert_eq!(n.owner(), Some(2));
    }

    #[test]
    fn mac_parses_and_prints() {
        let m = parse_mac("52:54:00:ab:CD:0f").unwrap();
        assert_eq!(format_mac(&m), "52:54:00:ab:cd:0f");
        assert!(parse_mac("52:54:00").is_err());
        assert!(parse_mac("zz:54:00:ab:cd:0f").is_err());
    }
}
