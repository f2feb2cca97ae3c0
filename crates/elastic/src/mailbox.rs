//! The guest channel: one 4 KiB page of guest memory (the layout of `struct kumo_elastic` in
//! guests/include/elastic.h), an interrupt that wakes the guest ([`VECTOR`]) and a doorbell
//! port the guest writes when it has answered ([`PORT`]). kumo writes the grant and one request
//! at a time; the guest confirms with `ack_seq`. docs/elastic.md describes the protocol.

use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress};

/// Where kumo puts the mailbox (free low memory between the boot info and the PVH info).
pub const MAILBOX_GPA: u64 = 0x4000;
pub const MAGIC: u64 = u64::from_le_bytes(*b"KUMOLEND");
pub const VERSION: u32 = 1;
/// The vector kumo sends a vCPU after writing a request (fixed delivery, to its APIC ID).
pub const VECTOR: u8 = 0x31;
/// The guest writes `ack_seq` here (4 bytes) once it has answered.
pub const PORT: u16 = 0x510;
pub const MAX_AREAS: usize = 8;
pub const MAX_BLOCKS: u32 = 1024;
pub const MAX_CPUS: u32 = 64;
/// Blocks are whole 2 MiB pages: the guest maps memory with 2 MiB pages and kumo backs
/// elastic memory with transparent huge pages.
pub const BLOCK_ALIGN: u64 = 2 << 20;

/// Byte offsets of `struct kumo_elastic`.
pub mod off {
    pub const MAGIC: u64 = 0;
    pub const VERSION: u64 = 8;
    pub const NCPUS: u64 = 12;
    pub const BLOCK_BYTES: u64 = 16;
    pub const NAREAS: u64 = 24;
    pub const NBLOCKS: u64 = 28;
    /// `struct kumo_elastic_area { u64 base; u32 first_block, nblocks, node, _pad; }`
    pub const AREAS: u64 = 32;
    pub const AREA_SIZE: u64 = 24;
    pub const CPUS_ALLOWED: u64 = 224;
    pub const MEM_PLUGGED: u64 = 232;
    pub const SEQ: u64 = 360;
    pub const OP: u64 = 364;
    pub const REQ_CPUS: u64 = 368;
    pub const REQ_NODE: u64 = 376;
    pub const REQ_BLOCKS: u64 = 380;
    pub const REQ_MEM: u64 = 384;
    pub const ACK_SEQ: u64 = 512;
    pub const ACK_STATUS: u64 = 516;
    pub const ACK_MEM: u64 = 520;
    pub const CPU_STATE: u64 = 648;
    pub const PROGRESS: u64 = 904;
    pub const END: u64 = 1416;
}

/// Request codes (`op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Op {
    None = 0,
    VacateCpus = 1,
    GiveCpus = 2,
    ReleaseMem = 3,
    GiveMem = 4,
    Cancel = 5,
}

pub const ACK_OK: u32 = 0;
pub const ACK_REFUSED: u32 = 1;

/// A bitmap of blocks, bit b = block b (16 words: [`MAX_BLOCKS`]).
pub type Blocks = [u64; 16];

pub fn blocks_count(b: &Blocks) -> u32 {
    b.iter().map(|w| w.count_ones()).sum()
}

pub fn blocks_iter(b: &Blocks) -> impl Iterator<Item = u32> + '_ {
    (0..MAX_BLOCKS).filter(|&i| b[i as usize / 64] & (1 << (i % 64)) != 0)
}

pub fn blocks_set(b: &mut Blocks, i: u32, on: bool) {
    let (w, m) = (i as usize / 64, 1u64 << (i % 64));
    if on {
        b[w] |= m
    } else {
        b[w] &= !m
    }
}

/// Whether `given`, the blocks the guest says it gave up (`ack_mem`) for a release of `k`
/// blocks of the area numbered `area`, is such an answer: exactly `k` blocks, each in the
/// area and plugged. The guest writes `given`; nothing in it is taken on trust.
pub fn check_given(given: &Blocks, k: u32, area: std::ops::Range<u32>, plugged: &Blocks) -> bool {
    blocks_count(given) == k
        && blocks_iter(given).all(|b| area.contains(&b) && plugged[b as usize / 64] & (1 << (b % 64)) != 0)
}

/// One guest node's elastic memory: `nblocks` blocks from guest-physical `base`, numbered from
/// `first_block` in the bitmaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Area {
    pub base: u64,
    pub first_block: u32,
    pub nblocks: u32,
    pub node: u32,
}

/// What kumo writes once, before the guest starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub ncpus: u32,
    pub block_bytes: u64,
    pub areas: Vec<Area>,
}

impl Layout {
    pub fn nblocks(&self) -> u32 {
        // Saturating: [`Layout::check`] refuses a layout whose count does not fit.
        self.areas.iter().fold(0u32, |n, a| n.saturating_add(a.nblocks))
    }

    /// Guest-physical address of block `b`.
    pub fn block_gpa(&self, b: u32) -> Option<u64> {
        let a = self.areas.iter().find(|a| b >= a.first_block && b - a.first_block < a.nblocks)?;
        Some(a.base + (b - a.first_block) as u64 * self.block_bytes)
    }

    /// The area block `b` belongs to.
    pub fn area_of(&self, b: u32) -> Option<&Area> {
        self.areas.iter().find(|a| b >= a.first_block && b - a.first_block < a.nblocks)
    }

    /// Checks what the C side assumes: areas, blocks and vCPUs within the page's bitmaps,
    /// whole aligned blocks, areas numbered in order without gaps.
    pub fn check(&self) -> Result<(), String> {
        if self.ncpus == 0 || self.ncpus > MAX_CPUS {
            return Err(format!("an elastic VM has 1..{MAX_CPUS} vCPUs, not {}", self.ncpus));
        }
        if self.block_bytes == 0 || !self.block_bytes.is_multiple_of(BLOCK_ALIGN) {
            return Err(format!("the elastic block size must be a multiple of 2 MiB, not {} bytes", self.block_bytes));
        }
        if self.areas.len() > MAX_AREAS {
            return Err(format!("at most {MAX_AREAS} elastic areas (NUMA nodes), not {}", self.areas.len()));
        }
        if self.nblocks() > MAX_BLOCKS {
            return Err(format!("at most {MAX_BLOCKS} elastic blocks in all, not {}", self.nblocks()));
        }
        let mut next = 0;
        for a in &self.areas {
            if a.first_block != next || !a.base.is_multiple_of(BLOCK_ALIGN) {
                return Err(format!("elastic area of node {} is misnumbered or misaligned", a.node));
            }
            if (a.nblocks as u64).checked_mul(self.block_bytes).and_then(|n| a.base.checked_add(n)).is_none() {
                return Err(format!("elastic area of node {} ends beyond the address space", a.node));
            }
            next += a.nblocks;
        }
        Ok(())
    }
}

/// The guest's answer to the request in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub seq: u32,
    pub status: u32,
}

/// The mailbox at `gpa` in `mem`. Fields the guest reads while running are stored with
/// release ordering and the request's `seq` last, so the guest sees a whole request.
pub struct Mailbox<M> {
    mem: M,
    gpa: u64,
}

impl<M: Bytes<GuestAddress>> Mailbox<M>
where
    M::E: std::fmt::Display,
{
    pub fn new(mem: M, gpa: u64) -> Self {
        Mailbox { mem, gpa }
    }

    fn at(&self, off: u64) -> GuestAddress {
        GuestAddress(self.gpa + off)
    }

    fn w32(&self, off: u64, v: u32) -> Result<(), String> {
        self.mem.store(v, self.at(off), Ordering::Release).map_err(|e| format!("elastic mailbox: {e}"))
    }

    fn w64(&self, off: u64, v: u64) -> Result<(), String> {
        self.mem.store(v, self.at(off), Ordering::Release).map_err(|e| format!("elastic mailbox: {e}"))
    }

    fn r32(&self, off: u64) -> Result<u32, String> {
        self.mem.load(self.at(off), Ordering::Acquire).map_err(|e| format!("elastic mailbox: {e}"))
    }

    fn r64(&self, off: u64) -> Result<u64, String> {
        self.mem.load(self.at(off), Ordering::Acquire).map_err(|e| format!("elastic mailbox: {e}"))
    }

    /// Writes the header, the initial grant and a zero request state (before the guest runs).
    pub fn init(&self, layout: &Layout, cpus_allowed: u64, plugged: &Blocks) -> Result<(), String> {
        layout.check()?;
        self.mem.write_slice(&[0u8; off::END as usize], self.at(0)).map_err(|e| format!("elastic mailbox: {e}"))?;
        self.w64(off::MAGIC, MAGIC)?;
        self.w32(off::VERSION, VERSION)?;
        self.w32(off::NCPUS, layout.ncpus)?;
        self.w64(off::BLOCK_BYTES, layout.block_bytes)?;
        self.w32(off::NAREAS, layout.areas.len() as u32)?;
        self.w32(off::NBLOCKS, layout.nblocks())?;
        for (i, a) in layout.areas.iter().enumerate() {
            let o = off::AREAS + i as u64 * off::AREA_SIZE;
            self.w64(o, a.base)?;
            self.w32(o + 8, a.first_block)?;
            self.w32(o + 12, a.nblocks)?;
            self.w32(o + 16, a.node)?;
        }
        self.set_cpus_allowed(cpus_allowed)?;
        self.set_plugged(plugged)
    }

    pub fn set_cpus_allowed(&self, mask: u64) -> Result<(), String> {
        self.w64(off::CPUS_ALLOWED, mask)
    }

    pub fn cpus_allowed(&self) -> Result<u64, String> {
        self.r64(off::CPUS_ALLOWED)
    }

    pub fn set_plugged(&self, b: &Blocks) -> Result<(), String> {
        b.iter().enumerate().try_for_each(|(i, &w)| self.w64(off::MEM_PLUGGED + 8 * i as u64, w))
    }

    pub fn plugged(&self) -> Result<Blocks, String> {
        let mut b = [0; 16];
        for (i, w) in b.iter_mut().enumerate() {
            *w = self.r64(off::MEM_PLUGGED + 8 * i as u64)?;
        }
        Ok(b)
    }

    pub fn seq(&self) -> Result<u32, String> {
        self.r32(off::SEQ)
    }

    /// Posts request `op` with its arguments; returns its sequence number. `seq` is written
    /// last: the guest acts on a request once it sees its number.
    pub fn post(&self, op: Op, cpus: u64, node: u32, nblocks: u32, mem: &Blocks) -> Result<u32, String> {
        self.w32(off::OP, op as u32)?;
        self.w64(off::REQ_CPUS, cpus)?;
        self.w32(off::REQ_NODE, node)?;
        self.w32(off::REQ_BLOCKS, nblocks)?;
        for (i, &w) in mem.iter().enumerate() {
            self.w64(off::REQ_MEM + 8 * i as u64, w)?;
        }
        let seq = self.seq()?.wrapping_add(1).max(1);
        self.w32(off::SEQ, seq)?;
        Ok(seq)
    }

    pub fn ack(&self) -> Result<Ack, String> {
        // ack_seq first: the guest writes its status (and blocks) before it.
        let seq = self.r32(off::ACK_SEQ)?;
        Ok(Ack { seq, status: self.r32(off::ACK_STATUS)? })
    }

    pub fn ack_mem(&self) -> Result<Blocks, String> {
        let mut b = [0; 16];
        for (i, w) in b.iter_mut().enumerate() {
            *w = self.r64(off::ACK_MEM + 8 * i as u64)?;
        }
        Ok(b)
    }

    /// Work units the guest reports for each of `ncpus` vCPUs.
    pub fn progress(&self, ncpus: u32) -> Result<Vec<u64>, String> {
        (0..ncpus.min(MAX_CPUS)).map(|v| self.r64(off::PROGRESS + 8 * v as u64)).collect()
    }

    /// Whether the guest says vCPU `v` is working (1) or idle (0).
    pub fn cpu_state(&self, v: u32) -> Result<u32, String> {
        self.r32(off::CPU_STATE + 4 * v as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    fn layout() -> Layout {
        Layout {
            ncpus: 3,
            block_bytes: 2 << 20,
            areas: vec![
                Area { base: 64 << 20, first_block: 0, nblocks: 4, node: 0 },
                Area { base: 192 << 20, first_block: 4, nblocks: 2, node: 1 },
            ],
        }
    }

    #[test]
    fn layout_addresses_and_checks() {
        let l = layout();
        assert_eq!(l.nblocks(), 6);
        assert_eq!(l.block_gpa(1), Some((64 << 20) + (2 << 20)));
        assert_eq!(l.block_gpa(5), Some((192 << 20) + (2 << 20)));
        assert_eq!(l.block_gpa(6), None);
        assert_eq!(l.area_of(4).unwrap().node, 1);
        assert!(l.check().is_ok());
        let bad = Layout { block_bytes: 4096, ..l.clone() };
        assert!(bad.check().unwrap_err().contains("2 MiB"));
        let mut gap = l.clone();
        gap.areas[1].first_block = 5;
        assert!(gap.check().unwrap_err().contains("misnumbered"));
        let big = Layout { ncpus: 65, ..l.clone() };
        assert!(big.check().is_err());
        // Found by kumo-fuzz (target `mailbox`): block counts that overflow their sum, and an
        // area past the end of the address space, panicked instead of being refused.
        let mut many = l.clone();
        many.areas[1].nblocks = u32::MAX;
        assert!(many.check().unwrap_err().contains("at most 1024"));
        let mut high = l;
        high.areas[1].base = !(BLOCK_ALIGN - 1);
        assert!(high.check().unwrap_err().contains("beyond the address space"));
    }

    #[test]
    fn header_and_requests_land_at_the_c_offsets() {
        let m = mem();
        let mb = Mailbox::new(m.clone(), MAILBOX_GPA);
        let mut plugged = [0u64; 16];
        blocks_set(&mut plugged, 0, true);
        blocks_set(&mut plugged, 5, true);
        mb.init(&layout(), 0b110, &plugged).unwrap();
        let r64 = |o: u64| m.read_obj::<u64>(GuestAddress(MAILBOX_GPA + o)).unwrap();
        let r32 = |o: u64| m.read_obj::<u32>(GuestAddress(MAILBOX_GPA + o)).unwrap();
        assert_eq!(r64(0), MAGIC);
        assert_eq!((r32(8), r32(12), r64(16), r32(24), r32(28)), (1, 3, 2 << 20, 2, 6));
        assert_eq!((r64(32 + 24), r32(32 + 24 + 8), r32(32 + 24 + 12), r32(32 + 24 + 16)), (192 << 20, 4, 2, 1));
        assert_eq!((r64(224), r64(232)), (0b110, 0b100001));
        let seq = mb.post(Op::ReleaseMem, 0, 1, 2, &[0; 16]).unwrap();
        assert_eq!((seq, r32(360), r32(364), r32(376), r32(380)), (1, 1, 3, 1, 2));
        assert_eq!(mb.post(Op::Cancel, 0b10, 0, 0, &plugged).unwrap(), 2);
        assert_eq!((r32(364), r64(368), r64(384)), (5, 0b10, 0b100001));
        // The guest's side.
        m.write_obj(2u32, GuestAddress(MAILBOX_GPA + 512)).unwrap();
        m.write_obj(ACK_REFUSED, GuestAddress(MAILBOX_GPA + 516)).unwrap();
        m.write_obj(0b11u64, GuestAddress(MAILBOX_GPA + 520)).unwrap();
        m.write_obj(77u64, GuestAddress(MAILBOX_GPA + 904 + 16)).unwrap();
        m.write_obj(1u32, GuestAddress(MAILBOX_GPA + 648 + 8)).unwrap();
        assert_eq!(mb.ack().unwrap(), Ack { seq: 2, status: ACK_REFUSED });
        assert_eq!(blocks_iter(&mb.ack_mem().unwrap()).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(mb.progress(3).unwrap(), [0, 0, 77]);
        assert_eq!(mb.cpu_state(2).unwrap(), 1);
        assert_eq!(blocks_count(&mb.plugged().unwrap()), 2);
    }
}
