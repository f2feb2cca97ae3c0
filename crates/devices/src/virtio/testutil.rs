//! A test driver: programs the transport through its BAR and lays out split rings in guest
//! memory the way a guest's driver does.

use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};

use super::pci_transport::{VirtioPciTransport, NOTIFY_OFFSET};
use super::{status, GuestMemory, Interrupt, VirtioDevice};

pub const MEM_SIZE: usize = 4 << 20;
/// Frame buffers live from here up.
pub const BUF_BASE: u64 = 0x20_0000;

pub fn memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// Records every vector raised.
#[derive(Default)]
pub struct Irqs(pub Mutex<Vec<u16>>);

impl Interrupt for Irqs {
    fn trigger(&self, vector: u16) {
        self.0.lock().unwrap().push(vector);
    }
}

impl Irqs {
    pub fn take(&self) -> Vec<u16> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

pub fn w<D: VirtioDevice>(t: &mut VirtioPciTransport<D>, off: u64, v: u64, len: usize) {
    t.bar_write(off, &v.to_le_bytes()[..len]);
}

pub fn r<D: VirtioDevice>(t: &mut VirtioPciTransport<D>, off: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    t.bar_read(off, &mut b[..len]);
    u64::from_le_bytes(b)
}

/// A split virtqueue from the driver's side.
#[derive(Debug, Clone, Copy)]
pub struct GuestQueue {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
    pub next_desc: u16,
    pub avail_idx: u16,
}

impl GuestQueue {
    /// Queue `i`'s rings, each in its own page below [`BUF_BASE`].
    pub fn new(i: usize, size: u16) -> Self {
        let base = 0x1_0000 * (i as u64 + 1);
        GuestQueue { desc: base, avail: base + 0x1000, used: base + 0x2000, size, next_desc: 0, avail_idx: 0 }
    }

    /// Zeroes the rings, as a driver does with fresh ring memory.
    pub fn clear(&self, mem: &GuestMemory) {
        mem.write_slice(&[0u8; 0x3000], GuestAddress(self.desc)).unwrap();
    }

    pub fn write_desc(&self, mem: &GuestMemory, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * i as u64;
        mem.write_obj(addr, GuestAddress(d)).unwrap();
        mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
        mem.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    /// Puts head `head` in the avail ring and publishes it.
    pub fn publish(&mut self, mem: &GuestMemory, head: u16) {
        let slot = self.avail + 4 + 2 * (self.avail_idx % self.size) as u64;
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2)).unwrap();
    }

    /// Adds a chain of buffers `(addr, len, device-writable)` and publishes it; returns its head.
    pub fn add_chain(&mut self, mem: &GuestMemory, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (k, &(addr, len, write)) in bufs.iter().enumerate() {
            let i = (head + k as u16) % self.size;
            let mut flags = if write { 2 } else { 0 };
            if k + 1 < bufs.len() {
                flags |= 1;
            }
            self.write_desc(mem, i, addr, len, flags, (i + 1) % self.size);
        }
        self.next_desc = (head + bufs.len() as u16) % self.size;
        self.publish(mem, head);
        head
    }

    pub fn used_idx(&self, mem: &GuestMemory) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// The used ring's element `i`: (descriptor id, length).
    pub fn used_elem(&self, mem: &GuestMemory, i: u16) -> (u32, u32) {
        let e = self.used + 4 + 8 * (i % self.size) as u64;
        (mem.read_obj(GuestAddress(e)).unwrap(), mem.read_obj(GuestAddress(e + 4)).unwrap())
    }

    /// EVENT_IDX: interrupt me when the used index passes `v`.
    pub fn set_used_event(&self, mem: &GuestMemory, v: u16) {
        mem.write_obj(v, GuestAddress(self.avail + 4 + 2 * self.size as u64)).unwrap();
    }
}

/// Drives a transport through reset → DRIVER_OK with `features`, programming `queues` (queue i
/// raises vector i + 1; config changes vector 0). Returns the final status.
pub fn bring_up<D: VirtioDevice>(t: &mut VirtioPciTransport<D>, features: u64, queues: &[GuestQueue]) -> u8 {
    w(t, 0x14, 0, 1);
    w(t, 0x14, status::ACKNOWLEDGE as u64, 1);
    w(t, 0x14, (status::ACKNOWLEDGE | status::DRIVER) as u64, 1);
    for sel in 0..2u64 {
        w(t, 0x08, sel, 4);
        w(t, 0x0c, (features >> (32 * sel)) & 0xffff_ffff, 4);
    }
    w(t, 0x14, (status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK) as u64, 1);
    w(t, 0x10, 0, 2);
    for (i, q) in queues.iter().enumerate() {
        w(t, 0x16, i as u64, 2);
        w(t, 0x18, q.size as u64, 2);
        w(t, 0x1a, i as u64 + 1, 2);
        w(t, 0x20, q.desc, 8);
        w(t, 0x28, q.avail & 0xffff_ffff, 4);
        w(t, 0x2c, q.avail >> 32, 4);
        w(t, 0x30, q.used, 8);
        w(t, 0x1c, 1, 2);
    }
    w(t, 0x14, (status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK) as u64, 1);
    r(t, 0x14, 1) as u8
}

/// Rings queue `q`'s doorbell through the notify area.
pub fn kick<D: VirtioDevice>(t: &mut VirtioPciTransport<D>, q: usize) {
    let off = t.notify_offsets()[q];
    assert!(off >= NOTIFY_OFFSET);
    w(t, off, q as u64, 2);
}

pub fn shared(irqs: &Arc<Irqs>) -> Arc<dyn Interrupt> {
    irqs.clone()
}
