//! virtio-blk (virtio 1.2, 5.2) on a raw image file ([`DiskImage`]): IN, OUT, FLUSH, GET_ID,
//! DISCARD and WRITE_ZEROES on one or more request queues (MQ), EVENT_IDX notification
//! suppression, a read-only mode.
//!
//! Requests are read and checked on the thread that serves the doorbells ([`request`]); their
//! I/O runs in an [`IoBackend`] (io_uring, or a pool of `Device` threads), whose completions the
//! same thread finishes with [`Block::process_completions`] when the backend's eventfd
//! ([`Block::completion_fd`]) fires: status byte, used ring, interrupt. A bad request is answered
//! IOERR or UNSUPP; a chain with no room for a status byte, or a ring that cannot be read, sets
//! DEVICE_NEEDS_RESET and stops the queue. A host I/O error reaches the guest as IOERR.

pub mod backend;
pub mod image;
pub mod request;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk as vb;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::{ActivateError, DeviceInterrupt, GuestMemory, VirtioDevice, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1};
pub use backend::{BackendKind, IoBackend, Op};
pub use image::{DiskImage, ImageError};
use request::{Bad, Kind, Limits, Request, S_IOERR, S_OK, S_UNSUPP};

pub const SECTOR_SIZE: u64 = 512;

const fn bit(b: u32) -> u64 {
    1 << b
}
pub const VIRTIO_BLK_F_SIZE_MAX: u64 = bit(vb::VIRTIO_BLK_F_SIZE_MAX);
pub const VIRTIO_BLK_F_SEG_MAX: u64 = bit(vb::VIRTIO_BLK_F_SEG_MAX);
pub const VIRTIO_BLK_F_RO: u64 = bit(vb::VIRTIO_BLK_F_RO);
pub const VIRTIO_BLK_F_BLK_SIZE: u64 = bit(vb::VIRTIO_BLK_F_BLK_SIZE);
pub const VIRTIO_BLK_F_FLUSH: u64 = bit(vb::VIRTIO_BLK_F_FLUSH);
pub const VIRTIO_BLK_F_MQ: u64 = bit(vb::VIRTIO_BLK_F_MQ);
pub const VIRTIO_BLK_F_DISCARD: u64 = bit(vb::VIRTIO_BLK_F_DISCARD);
pub const VIRTIO_BLK_F_WRITE_ZEROES: u64 = bit(vb::VIRTIO_BLK_F_WRITE_ZEROES);
/// Indirect descriptor tables (virtio-queue follows them): a request's segments take one slot
/// of the ring.
pub const VIRTIO_F_INDIRECT_DESC: u64 = bit(virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC);

/// Default queue size, and the largest a disk takes.
pub const QUEUE_SIZE: u16 = 256;
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// The most request queues a disk may have.
pub const MAX_QUEUES: u16 = 64;
/// Bytes per data descriptor (size_max).
pub const SIZE_MAX: u32 = 1 << 20;
/// Sectors per discard / write-zeroes segment: 1 GiB.
pub const MAX_DISCARD_SECTORS: u32 = (1 << 30) / SECTOR_SIZE as u32;
/// Length of `struct virtio_blk_config` up to `write_zeroes_may_unmap` and its padding.
pub const CONFIG_LEN: usize = 60;
/// The pool backend's threads per disk.
pub const POOL_WORKERS: usize = 4;

/// What a disk is made with (besides its image).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockConfig {
    /// GET_ID's answer (at most 20 bytes; shorter ones are padded with NULs).
    pub serial: String,
    /// Request queues (1..=[`MAX_QUEUES`]); more than one offers MQ.
    pub queues: u16,
    /// Each queue's maximum size (a power of two, 2..=[`MAX_QUEUE_SIZE`]).
    pub queue_size: u16,
    pub backend: BackendKind,
}

impl Default for BlockConfig {
    fn default() -> Self {
        BlockConfig { serial: String::new(), queues: 1, queue_size: QUEUE_SIZE, backend: BackendKind::Auto }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("bad queue count {0}: a disk has 1 to {MAX_QUEUES}")]
    Queues(u16),
    #[error("bad queue size {0}: a power of two from 2 to {MAX_QUEUE_SIZE}")]
    QueueSize(u16),
    #[error("serial {0:?} is longer than 20 bytes")]
    Serial(String),
    #[error("{0}")]
    Image(#[from] ImageError),
    #[error("disk {0}: starting its I/O backend: {1}")]
    Backend(String, String),
}

/// Request, byte and error counts, for `info` and `counters`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCounters {
    pub requests: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    /// Requests answered IOERR (bad requests and host errors).
    pub errors: u64,
    /// Of those, the host's I/O errors.
    pub host_errors: u64,
    /// Requests answered UNSUPP.
    pub unsupported: u64,
    pub interrupts: u64,
}

/// The device-specific part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// The image's size in bytes: a restore onto another size is refused.
    pub size: u64,
    pub readonly: bool,
    pub serial: String,
    pub queues: u16,
    pub queue_size: u16,
    pub counters: BlockCounters,
}

/// What a queue holds next.
enum Next {
    Chain(u16, Vec<Descriptor>),
    Empty,
    /// As many requests in flight as the queue has entries.
    Full,
}

/// A request whose I/O runs in the backend.
struct Pending {
    queue: u16,
    head: u16,
    status: GuestAddress,
    kind: Kind,
    data: Vec<(GuestAddress, u32)>,
    /// Kept here so io_uring may read the iovec array until the completion.
    op: Op,
}

struct Active {
    features: u64,
    mem: GuestMemory,
    irq: DeviceInterrupt,
    queues: Vec<Queue>,
    /// Queues stopped by a broken chain or ring until the driver resets the device.
    broken: Vec<bool>,
    /// Per queue, requests in flight: at most the queue's size. A driver that offers one head
    /// again before it was used could otherwise keep adding work without bound; such a queue
    /// waits (`full`) until completions make room.
    busy: Vec<u16>,
    full: Vec<bool>,
}

/// A virtio-blk device.
pub struct Block {
    name: String,
    config: BlockConfig,
    image: DiskImage,
    backend: Box<dyn IoBackend>,
    counters: BlockCounters,
    active: Option<Active>,
    /// In-flight requests by token (their index); `free` lists the empty slots.
    pending: Vec<Option<Pending>>,
    free: Vec<usize>,
    in_flight: usize,
    done: Vec<backend::Completion>,
}

impl Block {
    /// A disk named `name` (for logs and thread names) on `image`.
    pub fn new(name: &str, config: BlockConfig, image: DiskImage) -> Result<Self, BlockError> {
        if config.queues == 0 || config.queues > MAX_QUEUES {
            return Err(BlockError::Queues(config.queues));
        }
        if !config.queue_size.is_power_of_two() || !(2..=MAX_QUEUE_SIZE).contains(&config.queue_size) {
            return Err(BlockError::QueueSize(config.queue_size));
        }
        if config.serial.len() > request::ID_BYTES {
            return Err(BlockError::Serial(config.serial.clone()));
        }
        let entries = config.queues as u32 * config.queue_size as u32;
        let backend = backend::make_backend(config.backend, image.file(), entries, POOL_WORKERS, name)
            .map_err(|e| BlockError::Backend(name.to_string(), e.to_string()))?;
        Ok(Block {
            name: name.to_string(),
            config,
            image,
            backend,
            counters: BlockCounters::default(),
            active: None,
            pending: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            done: Vec::new(),
        })
    }

    pub fn config(&self) -> &BlockConfig {
        &self.config
    }

    pub fn image(&self) -> &DiskImage {
        &self.image
    }

    /// For the lock hand-off of a migration ([`DiskImage::unlock`], [`DiskImage::relock`]).
    pub fn image_mut(&mut self) -> &mut DiskImage {
        &mut self.image
    }

    pub fn counters(&self) -> BlockCounters {
        self.counters
    }

    /// `io_uring` or `threads`.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Requests whose I/O has not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The descriptor to wait on: readable when [`Block::process_completions`] has work.
    pub fn completion_fd(&self) -> std::os::fd::RawFd {
        self.backend.notifier()
    }

    fn capacity(&self) -> u64 {
        self.image.size() / SECTOR_SIZE
    }

    fn seg_max(&self) -> u32 {
        self.config.queue_size as u32 - 2
    }

    fn limits(&self, features: u64) -> Limits {
        Limits {
            capacity: self.capacity(),
            seg_max: self.seg_max(),
            size_max: SIZE_MAX,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            readonly: self.image.readonly(),
            features,
        }
    }

    /// Serves queue `qi`: reads its new requests, answers bad ones and starts the others.
    fn process_queue(&mut self, qi: usize) {
        let Some(a) = self.active.as_ref() else { return };
        if a.broken.get(qi).copied().unwrap_or(true) || !a.queues[qi].ready() {
            return;
        }
        let lim = self.limits(a.features);
        let mut answered = false;
        if let Err(why) = self.serve(qi, &lim, &mut answered) {
            self.break_queue(qi, why);
        }
        if let Err(e) = self.backend.commit() {
            tracing::warn!(disk = %self.name, "virtio-blk: starting I/O: {e}");
        }
        if answered {
            self.notify(qi);
        }
    }

    /// [`Block::process_queue`]'s loop, with EVENT_IDX's re-check; `Err` says why the queue
    /// must stop.
    fn serve(&mut self, qi: usize, lim: &Limits, answered: &mut bool) -> Result<(), &'static str> {
        const USED: &str = "cannot write its used ring";
        loop {
            let Some(a) = self.active.as_mut() else { return Ok(()) };
            a.queues[qi].disable_notification(&a.mem).map_err(|_| USED)?;
            loop {
                let (head, descs) = match self.next_chain(qi)? {
                    Next::Chain(head, descs) => (head, descs),
                    Next::Empty => break,
                    Next::Full => return Ok(()),
                };
                self.counters.requests += 1;
                let Some(a) = self.active.as_ref() else { return Ok(()) };
                match request::parse(&descs, &a.mem, lim) {
                    Ok(req) => {
                        if let Some((status, code, len)) = self.start(qi, head, req) {
                            *answered |= self.answer(qi, head, status, code, len);
                        }
                    }
                    Err(Bad::Status { status, code, why }) => {
                        tracing::debug!(disk = %self.name, queue = qi, "virtio-blk: {why}");
                        let code = self.error(code);
                        *answered |= self.answer(qi, head, status, code, 1);
                    }
                    Err(Bad::Broken(why)) => {
                        if let Some(a) = self.active.as_mut() {
                            let _ = a.queues[qi].add_used(&a.mem, head, 0);
                        }
                        return Err(why);
                    }
                }
            }
            let Some(a) = self.active.as_mut() else { return Ok(()) };
            if !a.queues[qi].enable_notification(&a.mem).map_err(|_| USED)? {
                return Ok(());
            }
        }
    }

    /// Queue `qi`'s next chain: its head and descriptors.
    fn next_chain(&mut self, qi: usize) -> Result<Next, &'static str> {
        let Some(a) = self.active.as_mut() else { return Ok(Next::Empty) };
        if a.busy[qi] >= a.queues[qi].size() {
            a.full[qi] = true;
            return Ok(Next::Full);
        }
        let q = &mut a.queues[qi];
        let chain = q.iter(&a.mem).map_err(|_| "a bad avail ring")?.next();
        let Some(chain) = chain else { return Ok(Next::Empty) };
        if chain.head_index() >= q.size() {
            return Err("a head outside the descriptor table");
        }
        // A chain yields at most queue-size descriptors (or an indirect table's).
        Ok(Next::Chain(chain.head_index(), chain.collect()))
    }

    /// Starts `req`'s I/O, or answers it at once: `Some((status address, code, used length))`.
    fn start(&mut self, qi: usize, head: u16, req: Request) -> Option<(GuestAddress, u8, u32)> {
        let a = self.active.as_ref()?;
        let now = |code| Some((req.status, code, 1));
        let op = match req.kind {
            Kind::GetId => {
                let mut id = [0u8; request::ID_BYTES];
                id[..self.config.serial.len()].copy_from_slice(self.config.serial.as_bytes());
                let mut off = 0;
                for &(addr, l) in &req.data {
                    if a.mem.write_slice(&id[off..off + l as usize], addr).is_err() {
                        return now(self.error(S_IOERR));
                    }
                    off += l as usize;
                }
                return Some((req.status, S_OK, req.len as u32 + 1));
            }
            Kind::In | Kind::Out if req.len == 0 => return now(S_OK),
            Kind::In | Kind::Out => {
                let Some(iov) = request::iovecs(&a.mem, &req.data) else { return now(self.error(S_IOERR)) };
                let offset = req.sector * SECTOR_SIZE;
                if req.kind == Kind::In {
                    Op::Read { offset, iov }
                } else {
                    // Without FLUSH the driver cannot ask for stable storage: write-through.
                    Op::Write { offset, iov, dsync: a.features & VIRTIO_BLK_F_FLUSH == 0 }
                }
            }
            Kind::Flush => {
                self.counters.flushes += 1;
                Op::Flush
            }
            Kind::Discard | Kind::WriteZeroes { .. } => {
                let Some((offset, len)) = req.range else { return now(S_OK) };
                let mode = match req.kind {
                    Kind::WriteZeroes { unmap: false } => libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    _ => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                };
                Op::Fallocate { offset, len, mode }
            }
        };
        let slot = self.free.pop().unwrap_or_else(|| {
            self.pending.push(None);
            self.pending.len() - 1
        });
        let p = self.pending[slot].insert(Pending {
            queue: qi as u16,
            head,
            status: req.status,
            kind: req.kind,
            data: req.data,
            op,
        });
        // SAFETY: the iovecs point into guest memory, which this device holds until every
        // request has completed (reset and drop drain first); the iovec array is the heap
        // buffer of the Vec kept in `pending[slot]` (which does not move when `pending` grows)
        // until the completion is reaped.
        match unsafe { self.backend.queue(slot as u64, &p.op) } {
            Ok(()) => {
                self.in_flight += 1;
                if let Some(b) = self.active.as_mut().and_then(|a| a.busy.get_mut(qi)) {
                    *b += 1;
                }
                None
            }
            Err(e) => {
                tracing::warn!(disk = %self.name, "virtio-blk: queueing I/O: {e}");
                self.pending[slot] = None;
                self.free.push(slot);
                self.counters.host_errors += 1;
                Some((req.status, self.error(S_IOERR), 1))
            }
        }
    }

    /// Counts an error answer and gives its code back.
    fn error(&mut self, code: u8) -> u8 {
        match code {
            S_UNSUPP => self.counters.unsupported += 1,
            _ => self.counters.errors += 1,
        }
        code
    }

    /// Writes status `code` and gives chain `head` back with `len` bytes used; true if done.
    fn answer(&mut self, qi: usize, head: u16, status: GuestAddress, code: u8, len: u32) -> bool {
        let Some(a) = self.active.as_mut() else { return false };
        let ok = a.mem.write_obj(code, status).is_ok() && a.queues[qi].add_used(&a.mem, head, len).is_ok();
        if !ok {
            self.break_queue(qi, "cannot write the status or the used ring");
        }
        ok
    }

    /// Stops queue `qi` until the driver resets the device: DEVICE_NEEDS_RESET.
    fn break_queue(&mut self, qi: usize, why: &str) {
        tracing::warn!(disk = %self.name, queue = qi, "virtio-blk: {why}; the device needs a reset");
        if let Some(a) = self.active.as_mut() {
            if let Some(b) = a.broken.get_mut(qi) {
                *b = true;
            }
            a.irq.needs_reset();
        }
    }

    /// Interrupts the driver for queue `qi` unless EVENT_IDX says it need not be.
    fn notify(&mut self, qi: usize) {
        let Some(a) = self.active.as_mut() else { return };
        match a.queues[qi].needs_notification(&a.mem) {
            Ok(true) => {
                a.irq.signal_used(qi);
                self.counters.interrupts += 1;
            }
            Ok(false) => {}
            Err(_) => self.break_queue(qi, "cannot read its avail ring"),
        }
    }

    /// Finishes the requests whose I/O completed: status, used ring, interrupts. Called when
    /// [`Block::completion_fd`] is readable.
    pub fn process_completions(&mut self) {
        let mut done = std::mem::take(&mut self.done);
        self.backend.reap(&mut done);
        let mut touched = vec![false; self.config.queues as usize];
        for (token, result) in done.drain(..) {
            let Some(p) = self.pending.get_mut(token as usize).and_then(Option::take) else { continue };
            self.free.push(token as usize);
            self.in_flight -= 1;
            if let Some(b) = self.active.as_mut().and_then(|a| a.busy.get_mut(p.queue as usize)) {
                *b = b.saturating_sub(1);
            }
            let code = self.finish(&p, result);
            let len = if p.kind == Kind::In && code == S_OK { p.op_len() as u32 + 1 } else { 1 };
            if self.answer(p.queue as usize, p.head, p.status, code, len) {
                touched[p.queue as usize] = true;
            }
        }
        self.done = done;
        for (qi, t) in touched.into_iter().enumerate() {
            if t {
                self.notify(qi);
            }
            // A queue that waited for room goes on.
            let resume = self.active.as_mut().is_some_and(|a| std::mem::take(&mut a.full[qi]));
            if resume {
                self.process_queue(qi);
            }
        }
    }

    /// The status of a completed request, with its counters.
    fn finish(&mut self, p: &Pending, result: std::io::Result<u64>) -> u8 {
        let result = match (result, &p.op) {
            // Not every file system zeroes ranges: write the zeroes.
            (Err(e), Op::Fallocate { offset, len, .. }) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                if p.kind == Kind::Discard {
                    Ok(0) // A discard is a hint.
                } else {
                    zero_fill(&self.image, *offset, *len).map(|_| 0)
                }
            }
            // A short transfer: the image shrank under the disk.
            (Ok(n), Op::Read { iov, .. } | Op::Write { iov, .. }) if n != iov.len() => {
                Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("{n} of {} bytes moved", iov.len())))
            }
            (r, _) => r,
        };
        match result {
            Ok(n) => {
                match p.kind {
                    Kind::In => {
                        if let Some(a) = &self.active {
                            request::mark_dirty(&a.mem, &p.data);
                        }
                        self.counters.read_bytes += n;
                    }
                    Kind::Out => self.counters.write_bytes += n,
                    Kind::Discard => self.counters.discards += 1,
                    Kind::WriteZeroes { .. } => self.counters.write_zeroes += 1,
                    Kind::Flush | Kind::GetId => {}
                }
                S_OK
            }
            Err(e) => {
                tracing::warn!(disk = %self.name, "virtio-blk: {:?} failed: {e}", p.kind);
                self.counters.host_errors += 1;
                self.error(S_IOERR)
            }
        }
    }

    /// Waits until every request in flight has completed and finishes them (used ring,
    /// interrupts): before a reset, a snapshot or a migration's stop.
    pub fn drain(&mut self) {
        while self.in_flight > 0 {
            backend::wait_readable(self.backend.notifier(), 1000);
            self.process_completions();
        }
    }

    /// [`Block::drain`], then the image flushed to stable storage (fdatasync): what a
    /// migration's stop phase ends with.
    pub fn quiesce(&mut self) -> std::io::Result<()> {
        self.drain();
        if self.image.readonly() {
            return Ok(());
        }
        self.image.file().sync_data()
    }
}

impl Pending {
    fn op_len(&self) -> u64 {
        match &self.op {
            Op::Read { iov, .. } | Op::Write { iov, .. } => iov.len(),
            _ => 0,
        }
    }
}

/// Writes zeroes over `[offset, offset + len)` (write-zeroes where fallocate cannot).
fn zero_fill(image: &DiskImage, mut offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    #[repr(C, align(4096))]
    struct Zeroes([u8; 65536]);
    let z = Box::new(Zeroes([0; 65536]));
    let end = offset + len;
    while offset < end {
        let n = (end - offset).min(z.0.len() as u64) as usize;
        image.file().write_all_at(&z.0[..n], offset)?;
        offset += n as u64;
    }
    Ok(())
}

impl VirtioDevice for Block {
    type State = BlockState;

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![self.config.queue_size; self.config.queues as usize]
    }

    fn features(&self) -> u64 {
        let mut f = VIRTIO_F_VERSION_1
            | VIRTIO_F_RING_EVENT_IDX
            | VIRTIO_F_INDIRECT_DESC
            | VIRTIO_BLK_F_SIZE_MAX
            | VIRTIO_BLK_F_SEG_MAX
            | VIRTIO_BLK_F_BLK_SIZE
            | VIRTIO_BLK_F_FLUSH;
        if self.image.readonly() {
            f |= VIRTIO_BLK_F_RO;
        } else {
            f |= VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES;
        }
        if self.config.queues > 1 {
            f |= VIRTIO_BLK_F_MQ;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; CONFIG_LEN];
        let mut put = |at: usize, b: &[u8]| cfg[at..at + b.len()].copy_from_slice(b);
        put(0, &self.capacity().to_le_bytes());
        put(8, &SIZE_MAX.to_le_bytes());
        put(12, &self.seg_max().to_le_bytes());
        put(20, &(SECTOR_SIZE as u32).to_le_bytes());
        put(34, &self.config.queues.to_le_bytes());
        put(36, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(40, &1u32.to_le_bytes()); // max_discard_seg
        put(44, &1u32.to_le_bytes()); // discard_sector_alignment
        put(48, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(52, &1u32.to_le_bytes()); // max_write_zeroes_seg
        put(56, &[1]); // write_zeroes_may_unmap
        for (i, d) in data.iter_mut().enumerate() {
            *d = offset.checked_add(i as u64).and_then(|o| cfg.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(offset, "virtio-blk: config space is read-only");
    }

    fn activate(
        &mut self,
        acked_features: u64,
        mem: GuestMemory,
        interrupt: DeviceInterrupt,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        let n = queues.len();
        let (broken, busy, full) = (vec![false; n], vec![0; n], vec![false; n]);
        self.active = Some(Active { features: acked_features, mem, irq: interrupt, queues, broken, busy, full });
        Ok(())
    }

    fn queue_notify(&mut self, queue: usize) {
        if queue < self.config.queues as usize {
            self.process_queue(queue);
        }
    }

    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| a.queues.as_slice())
    }

    fn reset(&mut self) {
        // A reset comes from a vCPU's register write: finish what is in flight, but start
        // nothing new (a queue waiting for room stays put), so no disk I/O runs on a vCPU.
        if let Some(a) = self.active.as_mut() {
            a.full.iter_mut().for_each(|f| *f = false);
        }
        self.drain();
        self.active = None;
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn save_state(&self) -> BlockState {
        BlockState {
            size: self.image.size(),
            readonly: self.image.readonly(),
            serial: self.config.serial.clone(),
            queues: self.config.queues,
            queue_size: self.config.queue_size,
            counters: self.counters,
        }
    }

    fn restore_state(&mut self, s: &BlockState) -> Result<(), String> {
        if s.size != self.image.size() {
            return Err(format!(
                "disk {}: the snapshot's image was {} bytes, {} is {} bytes",
                self.name,
                s.size,
                self.image.path().display(),
                self.image.size()
            ));
        }
        if s.readonly != self.image.readonly() {
            return Err(format!(
                "disk {}: saved read-only={}, this disk's is {}",
                self.name,
                s.readonly,
                self.image.readonly()
            ));
        }
        if s.queues != self.config.queues || s.queue_size != self.config.queue_size {
            return Err(format!(
                "disk {}: {} queues of {} saved, this disk has {} of {}",
                self.name, s.queues, s.queue_size, self.config.queues, self.config.queue_size
            ));
        }
        if s.serial.len() > request::ID_BYTES {
            return Err(BlockError::Serial(s.serial.clone()).to_string());
        }
        self.config.serial = s.serial.clone();
        self.counters = s.counters;
        Ok(())
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // The backend may still write guest memory: let it finish first.
        self.drain();
    }
}

#[cfg(test)]
mod tests;
