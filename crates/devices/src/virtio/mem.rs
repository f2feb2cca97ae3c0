//! virtio-mem (virtio 1.2, 5.15): a region of guest-physical memory the driver plugs and
//! unplugs block by block, to approach the size the host asks for (`requested_size`). The host
//! changes that size ([`Mem::resize`]) and raises a configuration-change interrupt; the guest's
//! driver answers with PLUG or UNPLUG requests on its one queue, which the device checks against
//! the region and its plugged bitmap and answers ACK, NACK or ERROR. Nothing a driver sends can
//! make the device panic: a request it cannot read is answered ERROR, a chain with no room for
//! the answer breaks the queue (DEVICE_NEEDS_RESET).
//!
//! The device knows nothing of host memory: making blocks reachable and taking them away (and
//! giving their pages back to the host) is the [`MemBackend`] the VMM hands it. Plugged blocks
//! stay plugged across a device reset (the spec's rule): a new driver unplugs them all first.

use serde::{Deserialize, Serialize};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::{ActivateError, DeviceInterrupt, GuestMemory, VirtioDevice, VIRTIO_F_VERSION_1};

/// The virtio device id of virtio-mem.
pub const VIRTIO_ID_MEM: u32 = 24;
/// `node_id` is an ACPI proximity domain.
pub const VIRTIO_MEM_F_ACPI_PXM: u64 = 1 << 0;
/// The driver does not read unplugged memory: kumo fences it.
pub const VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE: u64 = 1 << 1;

/// Request types.
pub const REQ_PLUG: u16 = 0;
pub const REQ_UNPLUG: u16 = 1;
pub const REQ_UNPLUG_ALL: u16 = 2;
pub const REQ_STATE: u16 = 3;
/// Response types.
pub const RESP_ACK: u16 = 0;
pub const RESP_NACK: u16 = 1;
pub const RESP_BUSY: u16 = 2;
pub const RESP_ERROR: u16 = 3;
/// STATE answers.
pub const STATE_PLUGGED: u16 = 0;
pub const STATE_UNPLUGGED: u16 = 1;
pub const STATE_MIXED: u16 = 2;

/// `struct virtio_mem_req`: type, padding, then addr (u64) and nb_blocks (u16) and padding.
pub const REQ_LEN: usize = 24;
/// `struct virtio_mem_resp`: type, padding, then the state (u16).
pub const RESP_LEN: usize = 10;
/// `struct virtio_mem_config`'s length.
pub const CONFIG_LEN: usize = 56;
/// The request queue's size: the driver has one request in flight at a time.
pub const QUEUE_SIZE: u16 = 128;
/// The smallest block size kumo offers (one huge page: discarding is cheap per block).
pub const MIN_BLOCK_SIZE: u64 = 2 << 20;

/// What the VMM does to host memory for the device. Offsets are from the region's start.
pub trait MemBackend: Send {
    /// Makes `[offset, offset + len)` reachable by the guest.
    fn plug(&mut self, offset: u64, len: u64) -> Result<(), String>;
    /// Takes `[offset, offset + len)` out of the guest's reach and gives its pages to the host.
    fn unplug(&mut self, offset: u64, len: u64) -> Result<(), String>;
}

/// The device's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemConfig {
    /// Guest-physical start of the region.
    pub addr: u64,
    pub region_size: u64,
    /// The plug granularity: a power of two, at least [`MIN_BLOCK_SIZE`], dividing the region.
    pub block_size: u64,
    /// The guest NUMA node (ACPI proximity domain) the memory belongs to.
    pub node_id: u16,
    /// The size the driver is asked to plug at first.
    pub requested_size: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemError {
    #[error("virtio-mem block size {0:#x} is not a power of two of at least 2 MiB")]
    BlockSize(u64),
    #[error("virtio-mem region {addr:#x}+{size:#x} is empty or not whole blocks of {block:#x}")]
    Region { addr: u64, size: u64, block: u64 },
    #[error(
        "virtio-mem: requested size {requested:#x} is not whole blocks of {block:#x} within the region of {region:#x}"
    )]
    Requested { requested: u64, block: u64, region: u64 },
}

/// Requests by kind and answers, for `info` and `counters`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemCounters {
    pub plugs: u64,
    pub unplugs: u64,
    pub unplug_alls: u64,
    pub states: u64,
    pub nacks: u64,
    pub errors: u64,
    /// Host-side failures (the backend), answered ERROR.
    pub host_errors: u64,
    pub config_interrupts: u64,
}

/// The device-specific part of a snapshot: the region's shape and which blocks are plugged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemState {
    pub config: MemConfig,
    pub requested_size: u64,
    /// One bit per block, block 0 in bit 0 of word 0.
    pub plugged: Vec<u64>,
    pub counters: MemCounters,
}

struct Active {
    mem: GuestMemory,
    irq: DeviceInterrupt,
    queue: Queue,
    broken: bool,
}

/// A virtio-mem device.
pub struct Mem {
    name: String,
    config: MemConfig,
    requested: u64,
    /// One bit per block.
    plugged: Vec<u64>,
    plugged_blocks: u64,
    backend: Box<dyn MemBackend>,
    counters: MemCounters,
    active: Option<Active>,
}

/// A request as read from the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub kind: u16,
    pub addr: u64,
    pub nb_blocks: u16,
}

impl Request {
    pub fn from_bytes(b: &[u8; REQ_LEN]) -> Request {
        Request {
            kind: u16::from_le_bytes([b[0], b[1]]),
            addr: u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
            nb_blocks: u16::from_le_bytes([b[16], b[17]]),
        }
    }

    pub fn to_bytes(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..2].copy_from_slice(&self.kind.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..18].copy_from_slice(&self.nb_blocks.to_le_bytes());
        b
    }
}

impl Mem {
    /// A device named `name` (for logs) of shape `config`, every block unplugged.
    pub fn new(name: &str, config: MemConfig, backend: Box<dyn MemBackend>) -> Result<Mem, MemError> {
        let bs = config.block_size;
        if !bs.is_power_of_two() || bs < MIN_BLOCK_SIZE {
            return Err(MemError::BlockSize(bs));
        }
        let region_ok = config.region_size > 0
            && config.addr.is_multiple_of(bs)
            && config.region_size.is_multiple_of(bs)
            && config.addr.checked_add(config.region_size).is_some();
        if !region_ok {
            return Err(MemError::Region { addr: config.addr, size: config.region_size, block: bs });
        }
        check_requested(&config, config.requested_size)?;
        let blocks = config.region_size / bs;
        Ok(Mem {
            name: name.to_string(),
            config,
            requested: config.requested_size,
            plugged: vec![0; blocks.div_ceil(64) as usize],
            plugged_blocks: 0,
            backend,
            counters: MemCounters::default(),
            active: None,
        })
    }

    pub fn config(&self) -> &MemConfig {
        &self.config
    }

    pub fn counters(&self) -> MemCounters {
        self.counters
    }

    pub fn plugged_size(&self) -> u64 {
        self.plugged_blocks * self.config.block_size
    }

    pub fn requested_size(&self) -> u64 {
        self.requested
    }

    fn blocks(&self) -> u64 {
        self.config.region_size / self.config.block_size
    }

    /// Asks the driver to plug or unplug until `size` bytes are plugged: the configuration
    /// changes and, once the driver is up, it gets a configuration-change interrupt.
    pub fn resize(&mut self, size: u64) -> Result<(), MemError> {
        check_requested(&self.config, size)?;
        self.requested = size;
        if let Some(a) = &self.active {
            a.irq.signal_config();
            self.counters.config_interrupts += 1;
        }
        Ok(())
    }

    fn is_plugged(&self, block: u64) -> bool {
        self.plugged[(block / 64) as usize] & (1 << (block % 64)) != 0
    }

    fn set_plugged(&mut self, block: u64, on: bool) {
        let (w, bit) = ((block / 64) as usize, 1u64 << (block % 64));
        if on && self.plugged[w] & bit == 0 {
            self.plugged[w] |= bit;
            self.plugged_blocks += 1;
        } else if !on && self.plugged[w] & bit != 0 {
            self.plugged[w] &= !bit;
            self.plugged_blocks -= 1;
        }
    }

    /// The first block and the count of a request's range, if it lies block-aligned inside the
    /// usable region (the whole region here).
    fn range(&self, addr: u64, nb_blocks: u16) -> Option<(u64, u64)> {
        let c = &self.config;
        let n = u64::from(nb_blocks);
        if n == 0 || addr < c.addr || !(addr - c.addr).is_multiple_of(c.block_size) {
            return None;
        }
        let first = (addr - c.addr) / c.block_size;
        (first.checked_add(n)? <= self.blocks()).then_some((first, n))
    }

    /// Plugged blocks among `[first, first + n)`.
    fn count_plugged(&self, first: u64, n: u64) -> u64 {
        (first..first + n).filter(|&b| self.is_plugged(b)).count() as u64
    }

    /// Answers one request: `(response type, state)`.
    pub fn handle(&mut self, r: Request) -> (u16, u16) {
        let (code, state) = match r.kind {
            REQ_PLUG => {
                self.counters.plugs += 1;
                (self.plug(r.addr, r.nb_blocks), 0)
            }
            REQ_UNPLUG => {
                self.counters.unplugs += 1;
                (self.unplug(r.addr, r.nb_blocks), 0)
            }
            REQ_UNPLUG_ALL => {
                self.counters.unplug_alls += 1;
                (self.unplug_all(), 0)
            }
            REQ_STATE => {
                self.counters.states += 1;
                match self.range(r.addr, r.nb_blocks) {
                    Some((first, n)) => {
                        let p = self.count_plugged(first, n);
                        let s = if p == n {
                            STATE_PLUGGED
                        } else if p == 0 {
                            STATE_UNPLUGGED
                        } else {
                            STATE_MIXED
                        };
                        (RESP_ACK, s)
                    }
                    None => (RESP_ERROR, 0),
                }
            }
            _ => (RESP_ERROR, 0),
        };
        match code {
            RESP_NACK => self.counters.nacks += 1,
            RESP_ERROR => self.counters.errors += 1,
            _ => {}
        }
        if code != RESP_ACK {
            tracing::debug!(mem = %self.name, ?r, code, "virtio-mem: request refused");
        }
        (code, state)
    }

    fn plug(&mut self, addr: u64, nb: u16) -> u16 {
        let Some((first, n)) = self.range(addr, nb) else { return RESP_ERROR };
        if self.count_plugged(first, n) != 0 {
            return RESP_ERROR;
        }
        if self.plugged_blocks + n > self.requested / self.config.block_size {
            return RESP_NACK;
        }
        let bs = self.config.block_size;
        if let Err(e) = self.backend.plug(first * bs, n * bs) {
            tracing::warn!(mem = %self.name, "virtio-mem: plugging {addr:#x}+{:#x}: {e}", n * bs);
            self.counters.host_errors += 1;
            return RESP_ERROR;
        }
        (first..first + n).for_each(|b| self.set_plugged(b, true));
        RESP_ACK
    }

    fn unplug(&mut self, addr: u64, nb: u16) -> u16 {
        let Some((first, n)) = self.range(addr, nb) else { return RESP_ERROR };
        if self.count_plugged(first, n) != n {
            return RESP_ERROR;
        }
        let bs = self.config.block_size;
        if let Err(e) = self.backend.unplug(first * bs, n * bs) {
            tracing::warn!(mem = %self.name, "virtio-mem: unplugging {addr:#x}+{:#x}: {e}", n * bs);
            self.counters.host_errors += 1;
            return RESP_ERROR;
        }
        (first..first + n).for_each(|b| self.set_plugged(b, false));
        RESP_ACK
    }

    /// Unplugs every plugged run; blocks the backend could not unplug stay plugged.
    fn unplug_all(&mut self) -> u16 {
        let bs = self.config.block_size;
        let mut ok = true;
        for (first, n) in self.runs(true) {
            match self.backend.unplug(first * bs, n * bs) {
                Ok(()) => (first..first + n).for_each(|b| self.set_plugged(b, false)),
                Err(e) => {
                    tracing::warn!(mem = %self.name, "virtio-mem: unplugging block {first}+{n}: {e}");
                    self.counters.host_errors += 1;
                    ok = false;
                }
            }
        }
        if ok {
            RESP_ACK
        } else {
            RESP_ERROR
        }
    }

    /// Runs `(first block, count)` of blocks whose plugged state is `plugged`.
    fn runs(&self, plugged: bool) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in 0..self.blocks() {
            if self.is_plugged(b) != plugged {
                continue;
            }
            match out.last_mut() {
                Some((f, n)) if *f + *n == b => *n += 1,
                _ => out.push((b, 1)),
            }
        }
        out
    }

    /// Serves the request queue.
    fn process_queue(&mut self) {
        let mut answered = false;
        loop {
            let Some(a) = self.active.as_mut() else { return };
            if a.broken || !a.queue.ready() {
                return;
            }
            let chain = match a.queue.iter(&a.mem) {
                Ok(mut it) => it.next().map(|c| (c.head_index(), c.collect::<Vec<Descriptor>>())),
                Err(_) => return self.break_queue("a bad avail ring"),
            };
            let Some((head, descs)) = chain else { break };
            let (resp_at, req) = match read_request(&a.mem, &descs) {
                Ok(x) => x,
                Err(why) => {
                    let _ = a.queue.add_used(&a.mem, head, 0);
                    return self.break_queue(why);
                }
            };
            let (code, state) = match req {
                Some(r) => self.handle(r),
                None => {
                    self.counters.errors += 1;
                    (RESP_ERROR, 0)
                }
            };
            let mut resp = [0u8; RESP_LEN];
            resp[0..2].copy_from_slice(&code.to_le_bytes());
            resp[8..10].copy_from_slice(&state.to_le_bytes());
            let Some(a) = self.active.as_mut() else { return };
            if a.mem.write_slice(&resp, resp_at).is_err() || a.queue.add_used(&a.mem, head, RESP_LEN as u32).is_err() {
                return self.break_queue("cannot write the response or the used ring");
            }
            answered = true;
        }
        if let (true, Some(a)) = (answered, self.active.as_mut()) {
            match a.queue.needs_notification(&a.mem) {
                Ok(true) => a.irq.signal_used(0),
                Ok(false) => {}
                Err(_) => self.break_queue("cannot read its avail ring"),
            }
        }
    }

    fn break_queue(&mut self, why: &str) {
        tracing::warn!(mem = %self.name, "virtio-mem: {why}; the device needs a reset");
        if let Some(a) = self.active.as_mut() {
            a.broken = true;
            a.irq.needs_reset();
        }
    }
}

fn check_requested(c: &MemConfig, size: u64) -> Result<(), MemError> {
    if size > c.region_size || !size.is_multiple_of(c.block_size) {
        return Err(MemError::Requested { requested: size, block: c.block_size, region: c.region_size });
    }
    Ok(())
}

/// Reads a chain: where the response goes (the first device-writable buffer with room for
/// it) and the request (`None`: fewer than [`REQ_LEN`] readable bytes, answered ERROR).
/// `Err`: no room for a response.
fn read_request(mem: &GuestMemory, descs: &[Descriptor]) -> Result<(GuestAddress, Option<Request>), &'static str> {
    let resp = descs
        .iter()
        .find(|d| d.is_write_only() && d.len() as usize >= RESP_LEN)
        .ok_or("a request with no room for its response")?
        .addr();
    let mut buf = [0u8; REQ_LEN];
    let mut got = 0;
    for d in descs.iter().take_while(|d| !d.is_write_only()) {
        let n = (d.len() as usize).min(REQ_LEN - got);
        if n == 0 {
            break;
        }
        if mem.read_slice(&mut buf[got..got + n], d.addr()).is_err() {
            return Ok((resp, None));
        }
        got += n;
    }
    Ok((resp, (got == REQ_LEN).then(|| Request::from_bytes(&buf))))
}

impl VirtioDevice for Mem {
    type State = MemState;

    fn device_type(&self) -> u32 {
        VIRTIO_ID_MEM
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_MEM_F_ACPI_PXM | VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = &self.config;
        let mut cfg = [0u8; CONFIG_LEN];
        let mut put = |at: usize, b: &[u8]| cfg[at..at + b.len()].copy_from_slice(b);
        put(0, &c.block_size.to_le_bytes());
        put(8, &c.node_id.to_le_bytes());
        put(16, &c.addr.to_le_bytes());
        put(24, &c.region_size.to_le_bytes());
        put(32, &c.region_size.to_le_bytes()); // usable_region_size: all of it
        put(40, &self.plugged_size().to_le_bytes());
        put(48, &self.requested.to_le_bytes());
        for (i, d) in data.iter_mut().enumerate() {
            *d = offset.checked_add(i as u64).and_then(|o| cfg.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(offset, "virtio-mem: config space is read-only");
    }

    fn activate(
        &mut self,
        _acked_features: u64,
        mem: GuestMemory,
        interrupt: DeviceInterrupt,
        mut queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 1 {
            return Err(ActivateError::BadQueue(queues.len()));
        }
        let queue = queues.remove(0);
        self.active = Some(Active { mem, irq: interrupt, queue, broken: false });
        Ok(())
    }

    fn queue_notify(&mut self, queue: usize) {
        if queue == 0 {
            self.process_queue();
        }
    }

    fn queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| std::slice::from_ref(&a.queue))
    }

    fn reset(&mut self) {
        // Plugged blocks stay plugged (virtio 1.2, 5.15.5): the next driver unplugs them.
        self.active = None;
    }

    fn save_state(&self) -> MemState {
        MemState {
            config: self.config,
            requested_size: self.requested,
            plugged: self.plugged.clone(),
            counters: self.counters,
        }
    }

    fn restore_state(&mut self, s: &MemState) -> Result<(), String> {
        let (a, b) = (&s.config, &self.config);
        if (a.addr, a.region_size, a.block_size, a.node_id) != (b.addr, b.region_size, b.block_size, b.node_id) {
            return Err(format!("{}: the saved virtio-mem region {a:?} is not this one {b:?}", self.name));
        }
        if s.plugged.len() != self.plugged.len() {
            return Err(format!("{}: the saved plugged bitmap has the wrong length", self.name));
        }
        check_requested(b, s.requested_size).map_err(|e| e.to_string())?;
        // The host mapping follows the saved bitmap where it differs from the device's (the
        // VMM's mapping matches the device's bitmap at all times).
        let bs = self.config.block_size;
        for blk in 0..self.blocks() {
            let want = s.plugged[(blk / 64) as usize] & (1 << (blk % 64)) != 0;
            if want == self.is_plugged(blk) {
                continue;
            }
            let r = if want { self.backend.plug(blk * bs, bs) } else { self.backend.unplug(blk * bs, bs) };
            r.map_err(|e| format!("{}: restoring block {blk}: {e}", self.name))?;
            self.set_plugged(blk, want);
        }
        self.requested = s.requested_size;
        self.counters = s.counters;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
