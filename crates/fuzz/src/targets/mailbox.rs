//! The elastic mailbox as the VMM reads it (`kumo_elastic::mailbox`): a guest page whose
//! answer fields (ack, the blocks it gave up, vCPU states, progress) the guest writes at will,
//! and the check the VMM makes of a release answer (`check_given`).

use arbitrary::Arbitrary;
use kumo_elastic::mailbox::{
    blocks_count, blocks_iter, check_given, off, Area, Blocks, Layout, Mailbox, Op, BLOCK_ALIGN, MAX_CPUS,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::{CaseResult, Input};

const MEM: u64 = 0x6000;

#[derive(Debug, Arbitrary)]
enum Step {
    /// The guest writes anywhere in its page.
    GuestWrite {
        at: u16,
        bytes: Vec<u8>,
    },
    GuestWord {
        field: u8,
        v: u64,
    },
    Ack,
    AckMem,
    Progress {
        ncpus: u32,
    },
    CpuState {
        v: u8,
    },
    Allowed,
    Post {
        op: u8,
        cpus: u64,
        node: u32,
        nblocks: u32,
        mem: [u64; 16],
    },
    Given {
        k: u16,
        area: u8,
        plugged: [u64; 16],
    },
}

/// The guest-written fields, where a guest pokes most.
const FIELDS: [u64; 8] =
    [off::ACK_SEQ, off::ACK_STATUS, off::ACK_MEM, off::CPU_STATE, off::PROGRESS, off::CPUS_ALLOWED, off::SEQ, off::OP];

fn layout(u: &mut Input<'_>) -> arbitrary::Result<Layout> {
    let block_bytes = if u.ratio(3, 4)? { BLOCK_ALIGN * u.int_in_range(1..=4)? } else { u.arbitrary()? };
    let mut areas = Vec::new();
    let mut first = 0u32;
    for node in 0..u.int_in_range(0..=9)? {
        let nblocks = if u.ratio(7, 8)? { u.int_in_range(0..=200)? } else { u.arbitrary()? };
        let base =
            if u.ratio(7, 8)? { (64u64 << 20) * (node as u64 + 1) } else { u.arbitrary::<u64>()? & !(BLOCK_ALIGN - 1) };
        let first_block = if u.ratio(15, 16)? { first } else { u.arbitrary()? };
        areas.push(Area { base, first_block, nblocks, node });
        first = first.wrapping_add(nblocks);
    }
    Ok(Layout { ncpus: u.int_in_range(0..=70)?, block_bytes, areas })
}

/// What a checked layout promises: every block has one address, inside its area, block-aligned.
fn check_layout(l: &Layout) {
    for b in 0..l.nblocks() {
        let a = l.area_of(b).expect("every block has an area");
        let gpa = l.block_gpa(b).expect("every block has an address");
        assert!(gpa >= a.base && gpa % BLOCK_ALIGN == 0, "block {b} at {gpa:#x} of {a:?}");
    }
    assert_eq!(l.block_gpa(l.nblocks()), None);
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).expect("memory");
    // Mostly where kumo puts it; sometimes cut short by the end of memory.
    let gpa = if u.ratio(7, 8)? {
        kumo_elastic::mailbox::MAILBOX_GPA
    } else {
        (MEM - u.int_in_range(0..=off::END + 8)?) & !7
    };
    let fits = gpa + off::END <= MEM;
    let mb = Mailbox::new(mem.clone(), gpa);
    let l = layout(u)?;
    let checked = l.check().is_ok();
    if checked {
        check_layout(&l);
    }
    let init = mb.init(&l, u.arbitrary()?, &u.arbitrary()?);
    assert!(init.is_ok() == (checked && fits), "init of {l:?} at {gpa:#x}: {init:?}");
    while !u.is_empty() {
        let ok = |r: Result<(), String>| assert!(r.is_ok() || !fits, "a read of a whole mailbox failed: {r:?}");
        match u.arbitrary::<Step>()? {
            Step::GuestWrite { at, bytes } => {
                let _ = mem.write_slice(&bytes, GuestAddress(gpa + at as u64 % 0x1000));
            }
            Step::GuestWord { field, v } => {
                let _ = mem.write_obj(v, GuestAddress(gpa + FIELDS[field as usize % FIELDS.len()]));
            }
            Step::Ack => ok(mb.ack().map(|_| ())),
            Step::AckMem => ok(mb.ack_mem().map(|_| ())),
            Step::Progress { ncpus } => {
                let p = mb.progress(ncpus);
                if let Ok(p) = &p {
                    assert_eq!(p.len(), ncpus.min(MAX_CPUS) as usize);
                }
                ok(p.map(|_| ()));
            }
            Step::CpuState { v } => ok(mb.cpu_state(v as u32 % MAX_CPUS).map(|_| ())),
            Step::Allowed => ok(mb.cpus_allowed().map(|_| ())),
            Step::Post { op, cpus, node, nblocks, mem: m } => {
                let ops = [Op::None, Op::VacateCpus, Op::GiveCpus, Op::ReleaseMem, Op::GiveMem, Op::Cancel];
                match mb.post(ops[op as usize % ops.len()], cpus, node, nblocks, &m) {
                    Ok(seq) => assert!(seq != 0 && mb.seq() == Ok(seq), "posted {seq}, seq reads {:?}", mb.seq()),
                    Err(e) => assert!(!fits, "post to a whole mailbox failed: {e}"),
                }
            }
            Step::Given { k, area, plugged } => given(&mb, &l, k as u32, area, &plugged),
        }
    }
    Ok(())
}

/// The VMM's check of a release answer, on whatever the guest wrote.
fn given(mb: &Mailbox<GuestMemoryMmap<()>>, l: &Layout, k: u32, area: u8, plugged: &Blocks) {
    let Ok(g) = mb.ack_mem() else { return };
    let Some(a) = l.areas.get(area as usize % l.areas.len().max(1)) else { return };
    let range = a.first_block..a.first_block.saturating_add(a.nblocks);
    if check_given(&g, k, range.clone(), plugged) {
        assert_eq!(blocks_count(&g), k);
        for b in blocks_iter(&g) {
            assert!(range.contains(&b) && plugged[b as usize / 64] & (1 << (b % 64)) != 0, "block {b} taken");
        }
    }
}
