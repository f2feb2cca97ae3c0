//! virtio-net (virtio 1.2, 5.1): RX/TX queue pairs (queue `2k` receives, `2k + 1` transmits for
//! pair `k`), a control queue after them when more than one pair is offered (MQ needs CTRL_VQ),
//! MAC and link status in config space, EVENT_IDX notification suppression. Frames travel with
//! their 12-byte `virtio_net_hdr_v1` in front, to and from a [`NetBackend`] (a TAP, or
//! [`Loopback`] in tests).
//!
//! Bad rings never panic: a chain that cannot be read or written is returned with length 0 and
//! counted as dropped; an avail index that jumps past the queue size or a used ring that cannot be
//! written sets DEVICE_NEEDS_RESET.

pub mod tap;
mod tx_ring;

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_net as vn;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::{
    ActivateError, DeviceInterrupt, GuestMemory, GuestSlice, VirtioDevice, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};

pub const VIRTIO_NET_F_CSUM: u64 = 1 << vn::VIRTIO_NET_F_CSUM;
pub const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << vn::VIRTIO_NET_F_GUEST_CSUM;
pub const VIRTIO_NET_F_MAC: u64 = 1 << vn::VIRTIO_NET_F_MAC;
pub const VIRTIO_NET_F_STATUS: u64 = 1 << vn::VIRTIO_NET_F_STATUS;
pub const VIRTIO_NET_F_CTRL_VQ: u64 = 1 << vn::VIRTIO_NET_F_CTRL_VQ;
pub const VIRTIO_NET_F_MQ: u64 = 1 << vn::VIRTIO_NET_F_MQ;
pub const VIRTIO_NET_F_MRG_RXBUF: u64 = 1 << vn::VIRTIO_NET_F_MRG_RXBUF;
pub const VIRTIO_NET_F_GUEST_TSO4: u64 = 1 << vn::VIRTIO_NET_F_GUEST_TSO4;
pub const VIRTIO_NET_F_GUEST_TSO6: u64 = 1 << vn::VIRTIO_NET_F_GUEST_TSO6;
pub const VIRTIO_NET_F_GUEST_ECN: u64 = 1 << vn::VIRTIO_NET_F_GUEST_ECN;
pub const VIRTIO_NET_F_GUEST_USO4: u64 = 1 << vn::VIRTIO_NET_F_GUEST_USO4;
pub const VIRTIO_NET_F_GUEST_USO6: u64 = 1 << vn::VIRTIO_NET_F_GUEST_USO6;
pub const VIRTIO_NET_F_HOST_TSO4: u64 = 1 << vn::VIRTIO_NET_F_HOST_TSO4;
pub const VIRTIO_NET_F_HOST_TSO6: u64 = 1 << vn::VIRTIO_NET_F_HOST_TSO6;
pub const VIRTIO_NET_F_HOST_ECN: u64 = 1 << vn::VIRTIO_NET_F_HOST_ECN;
pub const VIRTIO_NET_F_HOST_USO: u64 = 1 << vn::VIRTIO_NET_F_HOST_USO;

/// The guest-bound offloads: the backend's frames for the driver may carry partial checksums
/// and be segmentation-sized.
pub const GUEST_OFFLOADS: u64 = VIRTIO_NET_F_GUEST_CSUM
    | VIRTIO_NET_F_GUEST_TSO4
    | VIRTIO_NET_F_GUEST_TSO6
    | VIRTIO_NET_F_GUEST_ECN
    | VIRTIO_NET_F_GUEST_USO4
    | VIRTIO_NET_F_GUEST_USO6;

/// The UDP segmentation offloads, both ways (Linux's taps take them since 6.2).
pub const USO_OFFLOADS: u64 = VIRTIO_NET_F_HOST_USO | VIRTIO_NET_F_GUEST_USO4 | VIRTIO_NET_F_GUEST_USO6;

/// The offloads a NIC offers where its backend can serve them ([`NetBackend::offloads`]): the
/// driver's frames may carry partial checksums and be segmentation-sized (CSUM, HOST_*), and
/// the backend's frames for the driver may too ([`GUEST_OFFLOADS`]). A Linux driver then sends
/// and takes 64 KiB TCP (and UDP) super-frames instead of one frame per MTU.
pub const OFFLOAD_FEATURES: u64 = VIRTIO_NET_F_CSUM
    | VIRTIO_NET_F_HOST_TSO4
    | VIRTIO_NET_F_HOST_TSO6
    | VIRTIO_NET_F_HOST_ECN
    | VIRTIO_NET_F_HOST_USO
    | GUEST_OFFLOADS;

/// The names of the offloads in `features` (virtio-net's feature names, lower case), in bit
/// order.
pub fn offload_names(features: u64) -> Vec<String> {
    const NAMES: [(u64, &str); 11] = [
        (VIRTIO_NET_F_CSUM, "csum"),
        (VIRTIO_NET_F_GUEST_CSUM, "guest_csum"),
        (VIRTIO_NET_F_GUEST_TSO4, "guest_tso4"),
        (VIRTIO_NET_F_GUEST_TSO6, "guest_tso6"),
        (VIRTIO_NET_F_GUEST_ECN, "guest_ecn"),
        (VIRTIO_NET_F_HOST_TSO4, "host_tso4"),
        (VIRTIO_NET_F_HOST_TSO6, "host_tso6"),
        (VIRTIO_NET_F_HOST_ECN, "host_ecn"),
        (VIRTIO_NET_F_GUEST_USO4, "guest_uso4"),
        (VIRTIO_NET_F_GUEST_USO6, "guest_uso6"),
        (VIRTIO_NET_F_HOST_USO, "host_uso"),
    ];
    NAMES.iter().filter(|(f, _)| features & f != 0).map(|&(_, n)| n.to_string()).collect()
}

/// The guest-bound offloads among `acked` that hold together: segmentation only with checksum
/// offload, ECN only with TCP segmentation (virtio 1.2, 5.1.3.1); a driver that acked the rest
/// alone gets none of them.
pub fn guest_offloads(acked: u64) -> u64 {
    if acked & VIRTIO_NET_F_GUEST_CSUM == 0 {
        return 0;
    }
    let mut f = acked & GUEST_OFFLOADS;
    if f & (VIRTIO_NET_F_GUEST_TSO4 | VIRTIO_NET_F_GUEST_TSO6) == 0 {
        f &= !VIRTIO_NET_F_GUEST_ECN;
    }
    f
}

/// `virtio_net_hdr_v1`: every frame starts with it (virtio 1.x always has `num_buffers`).
pub const VNET_HDR_LEN: usize = 12;
/// The largest frame with its header: a 64 KiB GSO packet, its Ethernet header and the vnet
/// header.
pub const MAX_FRAME_LEN: usize = 65536 + 14 + VNET_HDR_LEN;

/// Whether a TX frame of `n` bytes (its vnet header included) is one the device sends.
fn sendable(n: usize) -> bool {
    (VNET_HDR_LEN..=MAX_FRAME_LEN).contains(&n)
}
/// Queue size offered for every queue.
pub const QUEUE_SIZE: u16 = 256;
/// The most queue pairs a NIC may have (the spec allows 0x8000; one tap fd each here).
pub const MAX_PAIRS: u16 = 16;

/// Where frames go to and come from: one channel per queue pair.
pub trait NetBackend: Send {
    /// Queue pairs it serves.
    fn pairs(&self) -> usize;
    /// Reads one waiting frame (vnet header first) of pair `pair` into `buf`; `Ok(None)` when
    /// none waits.
    fn recv(&mut self, pair: usize, buf: &mut [u8]) -> io::Result<Option<usize>>;
    /// Sends one frame (vnet header first) on pair `pair`.
    fn send(&mut self, pair: usize, frame: &[u8]) -> io::Result<()>;
    /// The same for a frame read in place from guest memory, where the backend can: `None`
    /// where it cannot (the caller copies the frame out and calls [`NetBackend::send`]).
    fn send_guest(&mut self, _pair: usize, _frame: &GuestSlice<'_>) -> Option<io::Result<()>> {
        None
    }
    /// Sends `frames` (each one whole frame read in place from guest memory) on pair `pair`, in
    /// order and in one go where the backend can (a tap's io_uring: one system call for them
    /// all), one result per frame in `results`. False where it cannot: the caller sends each.
    fn send_guest_batch(
        &mut self,
        _pair: usize,
        _frames: &[GuestSlice<'_>],
        _results: &mut Vec<io::Result<()>>,
    ) -> bool {
        false
    }
    /// The descriptor to wait on for pair `pair`'s incoming frames, if any.
    fn fd(&self, pair: usize) -> Option<RawFd>;
    /// The offloads of [`OFFLOAD_FEATURES`] this backend can serve (none by default).
    fn offloads(&self) -> u64 {
        0
    }
    /// What the backend may hand the driver from now: the guest-bound offloads the driver
    /// accepted ([`guest_offloads`] of its features: 0 for none).
    fn set_offload(&mut self, guest: u64) -> io::Result<()>;
}

/// An in-memory backend: frames queued with [`Loopback::inject`] reach the guest, frames the
/// guest sends are kept in [`Loopback::sent`] (how many of them it read in place from guest
/// memory: `sent_in_place`).
#[derive(Debug, Default)]
pub struct Loopback {
    pub incoming: Vec<VecDeque<Vec<u8>>>,
    pub sent: Vec<Vec<Vec<u8>>>,
    pub sent_in_place: usize,
    /// The size of each batch the device handed over at once ([`NetBackend::send_guest_batch`]).
    pub batches: Vec<usize>,
    /// What [`NetBackend::offloads`] answers, and the last [`NetBackend::set_offload`].
    pub can_offload: u64,
    pub offload: u64,
}

impl Loopback {
    pub fn new(pairs: usize) -> Self {
        Loopback { incoming: vec![VecDeque::new(); pairs], sent: vec![Vec::new(); pairs], ..Default::default() }
    }

    /// Queues `frame` (vnet header first) for pair `pair`'s guest side.
    pub fn inject(&mut self, pair: usize, frame: Vec<u8>) {
        if let Some(q) = self.incoming.get_mut(pair) {
            q.push_back(frame);
        }
    }
}

impl NetBackend for Loopback {
    fn pairs(&self) -> usize {
        self.incoming.len()
    }

    fn recv(&mut self, pair: usize, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let Some(f) = self.incoming.get_mut(pair).and_then(|q| q.pop_front()) else { return Ok(None) };
        let n = f.len().min(buf.len());
        buf[..n].copy_from_slice(&f[..n]);
        Ok(Some(n))
    }

    fn send(&mut self, pair: usize, frame: &[u8]) -> io::Result<()> {
        match self.sent.get_mut(pair) {
            Some(s) => {
                s.push(frame.to_vec());
                Ok(())
            }
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("no queue pair {pair}"))),
        }
    }

    fn send_guest(&mut self, pair: usize, frame: &GuestSlice<'_>) -> Option<io::Result<()>> {
        let mut v = vec![0u8; frame.len()];
        frame.copy_to(&mut v[..]);
        self.sent_in_place += 1;
        Some(self.send(pair, &v))
    }

    fn send_guest_batch(&mut self, pair: usize, frames: &[GuestSlice<'_>], results: &mut Vec<io::Result<()>>) -> bool {
        self.batches.push(frames.len());
        results.clear();
        for f in frames {
            let r = self.send_guest(pair, f).unwrap_or_else(|| Err(io::ErrorKind::Unsupported.into()));
            results.push(r);
        }
        true
    }

    fn fd(&self, _pair: usize) -> Option<RawFd> {
        None
    }

    fn offloads(&self) -> u64 {
        self.can_offload
    }

    fn set_offload(&mut self, guest: u64) -> io::Result<()> {
        self.offload = guest;
        Ok(())
    }
}

/// What a NIC is made with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    pub mac: [u8; 6],
    /// Queue pairs (1..=[`MAX_PAIRS`]); more than one offers MQ and a control queue.
    pub pairs: u16,
    /// Offer the backend's offloads ([`OFFLOAD_FEATURES`]: checksums and segmentation, both
    /// ways). Saved as `csum` before the segmentation offloads came.
    #[serde(alias = "csum")]
    pub offload: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NetError {
    #[error("bad queue pair count {0}: a NIC has 1 to {MAX_PAIRS}")]
    Pairs(u16),
    #[error("bad MAC {0}: multicast addresses are not allowed")]
    Multicast(String),
    #[error("the backend serves {backend} queue pairs, the NIC has {nic}")]
    BackendPairs { backend: usize, nic: u16 },
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("bad MAC {s:?}: expected six hex bytes like 52:54:00:12:34:56");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(bad());
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(mac)
}

/// Frame and error counts, for `info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
    pub interrupts: u64,
}

/// The device-specific part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub config: NetConfig,
    pub link_up: bool,
    pub active_pairs: u16,
    pub counters: NetCounters,
}

struct Active {
    features: u64,
    mem: GuestMemory,
    irq: DeviceInterrupt,
    queues: Vec<Queue>,
}

/// Frames one pass over a TX queue gathers before it sends them (together where the backend
/// can: [`NetBackend::send_guest_batch`]) and returns their buffers.
const TX_BATCH: usize = 64;

type Chain<'m> = virtio_queue::DescriptorChain<&'m GuestMemory>;

/// A TX chain's frame where it lies in one readable descriptor of a frame's size: the guest
/// memory it is sent from in place.
fn in_place<'m>(mem: &'m GuestMemory, chain: &Chain<'m>) -> Option<GuestSlice<'m>> {
    use vm_memory::GuestMemoryBackend as _;
    let mut descs = chain.clone();
    let (Some(d), None) = (descs.next(), descs.next()) else { return None };
    let n = d.len() as usize;
    (!d.is_write_only() && sendable(n)).then_some(())?;
    mem.get_slice(d.addr(), n).ok()
}

/// Counts a frame of `len` bytes (its vnet header included) as sent or, with the reason logged,
/// dropped.
fn count_tx(counters: &mut NetCounters, pair: usize, len: usize, r: &io::Result<()>) {
    match r {
        Ok(()) => {
            counters.tx_frames += 1;
            counters.tx_bytes += (len - VNET_HDR_LEN) as u64;
        }
        Err(e) => {
            tracing::debug!(pair, "virtio-net: backend write: {e}");
            counters.tx_dropped += 1;
        }
    }
}

/// The transmit side of one queue pair for one pass: the backend, the bounce buffer for frames
/// that must be copied out, the counters.
struct TxPass<'d, B: NetBackend> {
    backend: &'d mut B,
    buf: &'d mut [u8],
    counters: &'d mut NetCounters,
    pair: usize,
    results: &'d mut Vec<io::Result<()>>,
}

impl<B: NetBackend> TxPass<'_, B> {
    /// Sends `chains` in order, emptying it: runs of frames that can be read in place go to
    /// the backend together, the others are copied out one by one. Their heads go to `heads`.
    /// `run` is scratch space, empty on entry and on return.
    fn send<'m>(
        &mut self,
        mem: &'m GuestMemory,
        chains: &mut Vec<Chain<'m>>,
        run: &mut Vec<GuestSlice<'m>>,
        heads: &mut Vec<u16>,
    ) {
        for chain in chains.drain(..) {
            heads.push(chain.head_index());
            match in_place(mem, &chain) {
                Some(frame) => run.push(frame),
                None => {
                    self.send_run(run);
                    self.send_copied(mem, chain);
                }
            }
        }
        self.send_run(run);
    }

    /// Sends frames read in place, as one batch where the backend can.
    fn send_run(&mut self, run: &mut Vec<GuestSlice<'_>>) {
        if run.is_empty() {
            return;
        }
        let pair = self.pair;
        if !self.backend.send_guest_batch(pair, run, self.results) {
            self.results.clear();
            for frame in run.iter() {
                let r = match self.backend.send_guest(pair, frame) {
                    Some(r) => r,
                    None => {
                        frame.copy_to(&mut self.buf[..frame.len()]);
                        self.send_buf(frame.len())
                    }
                };
                self.results.push(r);
            }
        }
        for (frame, r) in run.iter().zip(self.results.iter()) {
            count_tx(self.counters, pair, frame.len(), r);
        }
        run.clear();
    }

    /// Sends a frame spread over several descriptors (or not in guest memory: then dropped)
    /// through the bounce buffer.
    fn send_copied(&mut self, mem: &GuestMemory, chain: Chain<'_>) {
        let n = chain.reader(mem).ok().and_then(|mut r| {
            let n = r.available_bytes();
            (sendable(n) && r.read_exact(&mut self.buf[..n]).is_ok()).then_some(n)
        });
        match n {
            Some(n) => {
                let r = self.send_buf(n);
                count_tx(self.counters, self.pair, n, &r);
            }
            None => self.counters.tx_dropped += 1,
        }
    }

    /// Sends the first `n` bytes of the bounce buffer.
    fn send_buf(&mut self, n: usize) -> io::Result<()> {
        self.backend.send(self.pair, &self.buf[..n])
    }
}

/// The next available chain of queue `qi`, or `Ok(None)` when the driver has made none
/// available. A broken ring (an avail index that cannot be read or jumps past the queue size, a
/// head outside the descriptor table) sets DEVICE_NEEDS_RESET and answers `Err`: the queue is
/// not served again until the driver resets the device.
fn next_chain<'m>(
    q: &mut Queue,
    mem: &'m GuestMemory,
    irq: &DeviceInterrupt,
    qi: usize,
    what: &str,
) -> Result<Option<virtio_queue::DescriptorChain<&'m GuestMemory>>, ()> {
    let chain = match q.iter(mem) {
        Ok(mut it) => it.next(),
        Err(e) => {
            tracing::warn!(queue = qi, "virtio-net: {what} ring: {e}");
            irq.needs_reset();
            return Err(());
        }
    };
    match chain {
        Some(c) if c.head_index() >= q.size() => {
            tracing::warn!(queue = qi, head = c.head_index(), "virtio-net: {what} ring: head outside the table");
            irq.needs_reset();
            Err(())
        }
        c => Ok(c),
    }
}

/// Interrupts the driver for queue `qi`'s used buffers unless it asked not to be (EVENT_IDX);
/// true if it was. An unreadable ring sets DEVICE_NEEDS_RESET.
fn notify_used(q: &mut Queue, mem: &GuestMemory, irq: &DeviceInterrupt, qi: usize) -> bool {
    match q.needs_notification(mem) {
        Ok(true) => {
            irq.signal_used(qi);
            true
        }
        Ok(false) => false,
        Err(_) => {
            irq.needs_reset();
            false
        }
    }
}

/// A virtio-net device over backend `B`.
pub struct Net<B: NetBackend> {
    config: NetConfig,
    backend: B,
    link_up: bool,
    active_pairs: u16,
    counters: NetCounters,
    active: Option<Active>,
    buf: Vec<u8>,
    /// A TX pass's scratch space, kept so that a pass allocates nothing: the heads it returns
    /// and the backend's result per frame.
    tx_heads: Vec<u16>,
    tx_results: Vec<io::Result<()>>,
    /// Per pair, a frame read from the backend that waits for RX buffers.
    pending: Vec<Option<Vec<u8>>>,
}

impl<B: NetBackend> Net<B> {
    pub fn new(config: NetConfig, backend: B) -> Result<Self, NetError> {
        if config.pairs == 0 || config.pairs > MAX_PAIRS {
            return Err(NetError::Pairs(config.pairs));
        }
        if config.mac[0] & 1 != 0 {
            let m = config.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
            return Err(NetError::Multicast(m));
        }
        if backend.pairs() != config.pairs as usize {
            return Err(NetError::BackendPairs { backend: backend.pairs(), nic: config.pairs });
        }
        Ok(Net {
            config,
            backend,
            link_up: true,
            active_pairs: 1,
            counters: NetCounters::default(),
            active: None,
            buf: vec![0; MAX_FRAME_LEN],
            tx_heads: Vec::with_capacity(TX_BATCH),
            tx_results: Vec::with_capacity(TX_BATCH),
            pending: vec![None; config.pairs as usize],
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    pub fn config(&self) -> NetConfig {
        self.config
    }

    fn has_ctrl(&self) -> bool {
        self.config.pairs > 1
    }

    fn ctrl_queue(&self) -> Option<usize> {
        self.has_ctrl().then_some(2 * self.config.pairs as usize)
    }

    /// Changes the link status the guest sees, with a config-change interrupt.
    pub fn set_link(&mut self, up: bool) {
        if self.link_up != up {
            self.link_up = up;
            if let Some(a) = &self.active {
                a.irq.signal_config();
            }
        }
    }

    /// The backend has frames for pair `pair` (its fd became readable): move them into the
    /// guest's RX buffers. Returns false when frames may be left waiting (the guest gave no
    /// buffers, or the device or its RX queue is not running); the caller then stops polling the
    /// fd until the RX queue's doorbell or the device's activation (which moves waiting frames
    /// itself).
    pub fn backend_ready(&mut self, pair: usize) -> bool {
        self.process_rx(pair)
    }

    fn process_rx(&mut self, pair: usize) -> bool {
        let Some(a) = self.active.as_mut() else { return false };
        let qi = 2 * pair;
        let Some(q) = a.queues.get_mut(qi).filter(|q| q.ready()) else { return false };
        let mem = &a.mem;
        let mrg = a.features & VIRTIO_NET_F_MRG_RXBUF != 0;
        // With EVENT_IDX the driver says when it wants an interrupt, so the first frame's can go
        // before the backend is read again (that read, usually EAGAIN, is a round trip's
        // latency otherwise); without it every check would interrupt, so one goes at the end.
        let mut early = a.features & VIRTIO_F_RING_EVENT_IDX != 0;
        let mut used = false;
        let mut drained = true;
        'frames: loop {
            // The frame: one left waiting for buffers, or the backend's next.
            let n = match self.pending.get_mut(pair).and_then(Option::take) {
                Some(f) => {
                    self.buf[..f.len()].copy_from_slice(&f);
                    f.len()
                }
                None => match self.backend.recv(pair, &mut self.buf) {
                    Ok(Some(n)) => n,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(pair, "virtio-net: backend read: {e}");
                        break;
                    }
                },
            };
            // Buffers for it: one chain, or with MRG_RXBUF as many as it takes.
            let max_chains = if mrg { q.size() as usize } else { 1 };
            let mut chains = Vec::new();
            let mut room = 0usize;
            while room < n && chains.len() < max_chains {
                let Ok(chain) = next_chain(q, mem, &a.irq, qi, "RX") else { break 'frames };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                match chain.writer(mem) {
                    Ok(w) => {
                        room += w.available_bytes();
                        chains.push((head, Some(w)));
                    }
                    Err(_) => chains.push((head, None)),
                }
            }
            if room < n && chains.len() < max_chains {
                let taken = chains.len();
                // Out of buffers: ask for a doorbell once the driver adds past the chains seen
                // (avail_event is taken from next_avail, so before giving those back), keep the
                // frame, give the chains back, and look again if buffers came meanwhile.
                let more = q.enable_notification(mem);
                drop(chains);
                for _ in 0..taken {
                    q.go_to_previous_position();
                }
                if let Some(p) = self.pending.get_mut(pair) {
                    *p = Some(self.buf[..n].to_vec());
                }
                match more {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(_) => a.irq.needs_reset(),
                }
                drained = false;
                break;
            }
            let fits = n >= VNET_HDR_LEN && room >= n;
            if fits {
                // num_buffers: the chains this frame spans.
                self.buf[10..12].copy_from_slice(&(chains.len() as u16).to_le_bytes());
                self.counters.rx_frames += 1;
                self.counters.rx_bytes += (n - VNET_HDR_LEN) as u64;
            } else {
                self.counters.rx_dropped += 1;
            }
            let mut off = 0;
            for (head, w) in chains {
                let mut len = 0;
                if let (true, Some(mut w)) = (fits, w) {
                    let k = w.available_bytes().min(n - off);
                    if w.write_all(&self.buf[off..off + k]).is_ok() {
                        len = k;
                    }
                    off += k;
                }
                if q.add_used(mem, head, len as u32).is_err() {
                    a.irq.needs_reset();
                    break 'frames;
                }
                used = true;
            }
            if used && early {
                early = false;
                if notify_used(q, mem, &a.irq, qi) {
                    self.counters.interrupts += 1;
                }
            }
        }
        if used && notify_used(q, mem, &a.irq, qi) {
            self.counters.interrupts += 1;
        }
        drained
    }

    fn process_tx(&mut self, pair: usize) {
        let Some(a) = self.active.as_mut() else { return };
        let qi = 2 * pair + 1;
        let Some(q) = a.queues.get_mut(qi).filter(|q| q.ready()) else { return };
        let mem = &a.mem;
        let mut tx = TxPass {
            backend: &mut self.backend,
            buf: &mut self.buf,
            counters: &mut self.counters,
            pair,
            results: &mut self.tx_results,
        };
        let heads = &mut self.tx_heads;
        // Chains and frames borrow this pass's guest memory, so they cannot be kept in `self`.
        let (mut chains, mut run) = (Vec::with_capacity(TX_BATCH), Vec::with_capacity(TX_BATCH));
        let mut used = false;
        'outer: loop {
            if q.disable_notification(mem).is_err() {
                a.irq.needs_reset();
                break;
            }
            loop {
                // Gather what the driver has made available (up to a batch), send it, return it.
                let mut broken = false;
                while chains.len() < TX_BATCH {
                    match next_chain(q, mem, &a.irq, qi, "TX") {
                        Ok(Some(c)) => chains.push(c),
                        Ok(None) => break,
                        Err(()) => {
                            broken = true;
                            break;
                        }
                    }
                }
                let full = chains.len() == TX_BATCH;
                tx.send(mem, &mut chains, &mut run, heads);
                for head in heads.drain(..) {
                    if q.add_used(mem, head, 0).is_err() {
                        a.irq.needs_reset();
                        break 'outer;
                    }
                    used = true;
                }
                if broken {
                    break 'outer;
                }
                if !full {
                    break;
                }
            }
            match q.enable_notification(mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(_) => {
                    a.irq.needs_reset();
                    break;
                }
            }
        }
        if used && notify_used(q, mem, &a.irq, qi) {
            self.counters.interrupts += 1;
        }
    }

    fn process_ctrl(&mut self) {
        let pairs = self.config.pairs;
        let Some(qi) = self.ctrl_queue() else { return };
        let Some(a) = self.active.as_mut() else { return };
        let Some(q) = a.queues.get_mut(qi).filter(|q| q.ready()) else { return };
        let mem = &a.mem;
        loop {
            let Ok(chain) = next_chain(q, mem, &a.irq, qi, "control") else { return };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let mut cmd = [0u8; 4];
            let got = chain.clone().reader(mem).ok().and_then(|mut r| {
                let n = r.available_bytes().min(4);
                r.read_exact(&mut cmd[..n]).ok().map(|_| n)
            });
            let ok = match got {
                Some(4)
                    if cmd[0] as u32 == vn::VIRTIO_NET_CTRL_MQ
                        && cmd[1] as u32 == vn::VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET =>
                {
                    let n = u16::from_le_bytes([cmd[2], cmd[3]]);
                    let fits = (1..=pairs).contains(&n);
                    if fits {
                        self.active_pairs = n;
                    }
                    fits
                }
                _ => false,
            };
            let ack = if ok { vn::VIRTIO_NET_OK } else { vn::VIRTIO_NET_ERR } as u8;
            let len = match chain.writer(mem) {
                Ok(mut w) if w.available_bytes() >= 1 => w.write_all(&[ack]).map(|_| 1).unwrap_or(0),
                _ => 0,
            };
            if q.add_used(mem, head, len).is_err() {
                a.irq.needs_reset();
                return;
            }
        }
        notify_used(q, mem, &a.irq, qi);
    }
}

impl<B: NetBackend> VirtioDevice for Net<B> {
    type State = NetState;

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; 2 * self.config.pairs as usize + self.has_ctrl() as usize]
    }

    fn features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1
            | VIRTIO_F_RING_EVENT_IDX
            | VIRTIO_NET_F_MAC
            | VIRTIO_NET_F_STATUS
            | VIRTIO_NET_F_MRG_RXBUF;
        if self.has_ctrl() {
            f |= VIRTIO_NET_F_CTRL_VQ | VIRTIO_NET_F_MQ;
        }
        if self.config.offload {
            f |= self.backend.offloads() & OFFLOAD_FEATURES;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config: mac[6], status, max_virtqueue_pairs.
        let mut cfg = [0u8; 10];
        cfg[..6].copy_from_slice(&self.config.mac);
        let status = if self.link_up { vn::VIRTIO_NET_S_LINK_UP as u16 } else { 0 };
        cfg[6..8].copy_from_slice(&status.to_le_bytes());
        cfg[8..10].copy_from_slice(&self.config.pairs.to_le_bytes());
        for (i, d) in data.iter_mut().enumerate() {
            *d = offset.checked_add(i as u64).and_then(|o| cfg.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(offset, "virtio-net: config space is read-only");
    }

    fn activate(
        &mut self,
        acked_features: u64,
        mem: GuestMemory,
        interrupt: DeviceInterrupt,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        self.backend
            .set_offload(guest_offloads(acked_features))
            .map_err(|e| ActivateError::Backend(format!("setting the backend's offloads: {e}")))?;
        self.active = Some(Active { features: acked_features, mem, irq: interrupt, queues });
        // Frames may already wait in the backend.
        for p in 0..self.config.pairs as usize {
            self.process_rx(p);
        }
        Ok(())
    }

    fn queue_notify(&mut self, queue: usize) {
        if Some(queue) == self.ctrl_queue() {
            self.process_ctrl();
        } else if queue & 1 == 0 {
            self.process_rx(queue / 2);
        } else {
            self.process_tx(queue / 2);
        }
    }

    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| a.queues.as_slice())
    }

    fn reset(&mut self) {
        self.active = None;
        self.active_pairs = 1;
        self.pending.iter_mut().for_each(|p| *p = None);
    }

    fn save_state(&self) -> NetState {
        NetState {
            config: self.config,
            link_up: self.link_up,
            active_pairs: self.active_pairs,
            counters: self.counters,
        }
    }

    fn restore_state(&mut self, s: &NetState) -> Result<(), String> {
        if s.config.pairs != self.config.pairs {
            return Err(format!("{} queue pairs saved, this NIC has {}", s.config.pairs, self.config.pairs));
        }
        // What the driver can set (VQ_PAIRS_SET) and what `Net::new` takes.
        if !(1..=self.config.pairs).contains(&s.active_pairs) {
            return Err(format!("{} active queue pairs saved, this NIC has {}", s.active_pairs, self.config.pairs));
        }
        if s.config.mac[0] & 1 != 0 {
            let m = s.config.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
            return Err(NetError::Multicast(m).to_string());
        }
        self.config.mac = s.config.mac;
        self.link_up = s.link_up;
        self.active_pairs = s.active_pairs;
        self.counters = s.counters;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
