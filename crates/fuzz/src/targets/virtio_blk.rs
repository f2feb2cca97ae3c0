//! virtio-blk's request chains (`kumo_devices::virtio::block` behind its virtio PCI transport,
//! on a small raw image, with either I/O backend): well-formed requests with arbitrary types,
//! sectors, segment lists and status buffers, discard / write-zeroes segments, and raw
//! descriptors, avail entries and indices, event indices and scribbles on ring memory. The used
//! rings only move forward, by what was offered, with ids and lengths in range; status bytes
//! are OK, IOERR or UNSUPP; nothing is left in flight; the image keeps its size, and a
//! read-only one its bytes.

use std::path::PathBuf;
use std::sync::Arc;

use arbitrary::Arbitrary;
use kumo_devices::virtio::block::{BackendKind, Block, BlockConfig, DiskImage};
use kumo_devices::virtio::testutil::{bring_up, kick, memory, GuestQueue, Irqs, BUF_BASE};
use kumo_devices::virtio::{GuestMemory, Interrupt, VirtioDevice, VirtioPciTransport};
use kumo_devices::Persist;
use vm_memory::{Bytes, GuestAddress};

use crate::{CaseResult, Input};

/// The image: 64 sectors.
const SECTORS: u64 = 64;
const QUEUE: u16 = 16;

#[derive(Debug, Arbitrary)]
enum Ty {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    Any(u32),
}

#[derive(Debug, Arbitrary)]
enum Sector {
    Small(u8),
    NearEnd(u8),
    Any(u64),
}

#[derive(Debug, Arbitrary)]
enum Len {
    Sectors(u8),
    Small(u16),
    Zero,
    Any(u32),
}

#[derive(Debug, Arbitrary)]
enum Status {
    Byte,
    /// The status shares the last data buffer.
    Shared,
    Missing,
    Readable,
    Empty,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Request { q: u8, ty: Ty, sector: Sector, segs: Vec<(Len, bool)>, status: Status },
    Segment { sector: Sector, sectors: u32, flags: u8 },
    Desc { q: u8, i: u8, addr: u64, len: Len, flags: u8, next: u8 },
    Publish { q: u8, head: u8 },
    WildAvailIdx { q: u8, v: u16 },
    UsedEvent { q: u8, v: u16 },
    Kick { q: u8 },
    Complete,
    Poke { at: u32, v: u64 },
}

struct Driver {
    t: VirtioPciTransport<Block>,
    mem: GuestMemory,
    qs: Vec<GuestQueue>,
    /// Status bytes of requests built whole, checked once they are used.
    statuses: Vec<u64>,
}

fn image_path() -> PathBuf {
    let t = std::thread::current().id();
    std::env::temp_dir().join(format!("kumo-fuzz-blk-{}-{t:?}.img", std::process::id()))
}

impl Driver {
    fn queue(&self, q: u8) -> usize {
        q as usize % self.qs.len()
    }

    fn sector(s: Sector) -> u64 {
        match s {
            Sector::Small(v) => v as u64 % SECTORS,
            Sector::NearEnd(v) => SECTORS - (v as u64 % 4),
            Sector::Any(v) => v,
        }
    }

    fn len(l: Len) -> u32 {
        match l {
            Len::Sectors(n) => 512 * (n as u32 % 9),
            Len::Small(v) => v as u32 % 5000,
            Len::Zero => 0,
            Len::Any(v) => v,
        }
    }

    fn request(&mut self, q: u8, ty: Ty, sector: Sector, segs: Vec<(Len, bool)>, status: Status) {
        let qi = self.queue(q);
        let ty = match ty {
            Ty::In => 0,
            Ty::Out => 1,
            Ty::Flush => 4,
            Ty::GetId => 8,
            Ty::Discard => 11,
            Ty::WriteZeroes => 13,
            Ty::Any(v) => v,
        };
        let h = BUF_BASE;
        let _ = self.mem.write_obj(ty, GuestAddress(h));
        let _ = self.mem.write_obj(Self::sector(sector), GuestAddress(h + 8));
        let mut chain = vec![(h, 16, false)];
        let mut at = BUF_BASE + 0x1000;
        for (l, write) in segs.into_iter().take(6) {
            let len = Self::len(l);
            chain.push((at, len, write));
            at += (len as u64 % 0x2_0000 + 0xfff) & !0xfff;
        }
        let s = BUF_BASE + 0x10_0000;
        match status {
            Status::Byte => chain.push((s, 1, true)),
            Status::Shared => {}
            Status::Missing => {}
            Status::Readable => chain.push((s, 1, false)),
            Status::Empty => chain.push((s, 0, true)),
        }
        let whole = matches!(status, Status::Byte) && chain.len() <= QUEUE as usize;
        if whole {
            let _ = self.mem.write_obj(0xeeu8, GuestAddress(s));
        }
        if chain.len() > QUEUE as usize {
            chain.truncate(QUEUE as usize);
        }
        self.qs[qi].add_chain(&self.mem, &chain);
        kick(&mut self.t, qi);
        if whole {
            self.statuses.push(s);
        }
    }

    fn apply(&mut self, op: Op) {
        let mem = self.mem.clone();
        match op {
            Op::Request { q, ty, sector, segs, status } => self.request(q, ty, sector, segs, status),
            Op::Segment { sector, sectors, flags } => {
                let b = BUF_BASE + 0x1000;
                let _ = mem.write_obj(Self::sector(sector), GuestAddress(b));
                let _ = mem.write_obj(sectors % 80, GuestAddress(b + 8));
                let _ = mem.write_obj(flags as u32 % 4, GuestAddress(b + 12));
            }
            Op::Desc { q, i, addr, len, flags, next } => {
                let q = &self.qs[self.queue(q)];
                let addr = if addr & 1 == 0 { BUF_BASE + addr % 0x10_0000 } else { addr };
                q.write_desc(
                    &mem,
                    i as u16 % q.size,
                    addr,
                    Self::len(len),
                    flags as u16 % 8,
                    next as u16 % (q.size + 4),
                );
            }
            Op::Publish { q, head } => {
                let i = self.queue(q);
                let size = self.qs[i].size;
                self.qs[i].publish(&mem, head as u16 % (size + 2));
            }
            Op::WildAvailIdx { q, v } => {
                let i = self.queue(q);
                let _ = mem.write_obj(v, GuestAddress(self.qs[i].avail + 2));
                self.qs[i].avail_idx = v;
            }
            Op::UsedEvent { q, v } => {
                let i = self.queue(q);
                self.qs[i].set_used_event(&mem, v);
            }
            Op::Kick { q } => {
                let q = self.queue(q);
                kick(&mut self.t, q);
            }
            Op::Complete => self.t.device_mut().process_completions(),
            Op::Poke { at, v } => {
                let _ = mem.write_obj(v, GuestAddress((0x1_0000 + at as u64 % 0x3_0000) & !7));
            }
        }
    }

    fn bring_up(&mut self) {
        let n = self.t.device().queue_max_sizes().len();
        self.t.device_mut().drain();
        self.qs = (0..n).map(|i| GuestQueue::new(i, QUEUE)).collect();
        for q in &self.qs {
            q.clear(&self.mem);
        }
        let f = self.t.device().features();
        bring_up(&mut self.t, f, &self.qs);
        self.statuses.clear();
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let path = image_path();
    let initial: Vec<u8> = (0..SECTORS * 512).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &initial).expect("image");
    let readonly: bool = u.arbitrary()?;
    let backend = if u.arbitrary()? { BackendKind::Threads } else { BackendKind::Auto };
    let queues = 1 + u.arbitrary::<u8>()? as u16 % 2;
    let img = DiskImage::open(&path, readonly, false).expect("image opens");
    let config = BlockConfig { serial: "fuzz".into(), queues, queue_size: QUEUE, backend };
    let blk = Block::new("fuzz", config, img).expect("disk");
    let mem = memory();
    let irqs: Arc<dyn Interrupt> = Arc::new(Irqs::default());
    let t = VirtioPciTransport::new("blk0", blk, mem.clone(), irqs, queues + 1);
    let mut d = Driver { t, mem, qs: Vec::new(), statuses: Vec::new() };
    d.bring_up();
    let result = drive(u, &mut d);
    d.t.device_mut().drain();
    assert_eq!(d.t.device().in_flight(), 0);
    assert!(d.t.save().is_ok(), "a drained disk saves");
    drop(d);
    let after = std::fs::read(&path).expect("image");
    assert_eq!(after.len(), initial.len(), "the image keeps its size");
    if readonly {
        assert!(after == initial, "a read-only image is unchanged");
    }
    let _ = std::fs::remove_file(&path);
    result
}

fn drive(u: &mut Input<'_>, d: &mut Driver) -> CaseResult {
    while !u.is_empty() {
        let op: Op = u.arbitrary()?;
        let before: Vec<u16> = d.qs.iter().map(|q| q.used_idx(&d.mem)).collect();
        let poke = matches!(op, Op::Poke { .. });
        d.apply(op);
        d.t.device_mut().drain();
        if d.t.save().map(|s| s.needs_reset).unwrap_or(false) || poke {
            d.bring_up();
            continue;
        }
        for (q, b) in d.qs.iter().zip(before) {
            let after = q.used_idx(&d.mem);
            let moved = after.wrapping_sub(b);
            assert!(moved <= q.size, "used index jumped by {moved}");
            for k in 0..moved {
                let (id, _len) = q.used_elem(&d.mem, b.wrapping_add(k));
                assert!(id < q.size as u32, "used id {id}");
            }
        }
        for &s in &d.statuses {
            let v: u8 = d.mem.read_obj(GuestAddress(s)).expect("status");
            assert!(matches!(v, 0..=2 | 0xee), "status byte {v}");
        }
    }
    Ok(())
}
