//! virtio-net's rings (`kumo_devices::virtio::net` behind its PCI function): a driver that
//! writes arbitrary descriptors (addresses, lengths, NEXT/WRITE/INDIRECT flags, next indices),
//! avail entries and indices, event indices and control commands, while the backend delivers
//! frames. The used rings only move forward, by what was offered, with ids and lengths in
//! range; frames sent are whole.

use arbitrary::Arbitrary;
use kumo_devices::virtio::net::{MAX_FRAME_LEN, VNET_HDR_LEN};
use kumo_devices::virtio::testutil::{kick, GuestQueue, BUF_BASE, MEM_SIZE};
use kumo_devices::virtio::VirtioDevice;
use kumo_devices::Persist;
use vm_memory::{Bytes, GuestAddress};

use super::nic::{rig, Rig};
use crate::{CaseResult, Input};

#[derive(Debug, Arbitrary)]
enum Op {
    Desc {
        q: u8,
        i: u8,
        addr: Addr,
        len: Len,
        flags: u8,
        next: u8,
    },
    Publish {
        q: u8,
        head: u8,
    },
    WildAvailIdx {
        q: u8,
        v: u16,
    },
    UsedEvent {
        q: u8,
        v: u16,
    },
    Frame {
        pair: bool,
        len: u16,
    },
    Kick {
        q: u8,
    },
    /// A control command: MQ VQ_PAIRS_SET with any count, or anything.
    Ctrl {
        cmd: [u8; 4],
    },
    /// The driver writes anywhere in ring memory.
    Poke {
        at: u32,
        v: u64,
    },
}

#[derive(Debug, Arbitrary)]
enum Addr {
    Buf(u32),
    End(u8),
    Any(u64),
}

#[derive(Debug, Arbitrary)]
enum Len {
    Small(u16),
    Zero,
    Any(u32),
}

struct Driver {
    r: Rig,
    qs: Vec<GuestQueue>,
}

impl Driver {
    fn queue(&self, q: u8) -> usize {
        q as usize % self.qs.len()
    }

    fn apply(&mut self, op: Op) {
        let mem = self.r.mem.clone();
        match op {
            Op::Desc { q, i, addr, len, flags, next } => {
                let qi = self.queue(q);
                let q = &self.qs[qi];
                let addr = match addr {
                    Addr::Buf(a) => BUF_BASE + a as u64 % 0x10_0000,
                    Addr::End(a) => MEM_SIZE as u64 - a as u64,
                    Addr::Any(a) => a,
                };
                let len = match len {
                    Len::Small(l) => l as u32 % 4096,
                    Len::Zero => 0,
                    Len::Any(l) => l,
                };
                q.write_desc(&mem, i as u16 % q.size, addr, len, flags as u16 % 8, next as u16 % (q.size + 4));
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
            Op::Frame { pair, len } => {
                let pair = pair as usize % self.r.pairs as usize;
                let t = self.r.f.device_mut();
                t.device_mut().backend_mut().inject(pair, vec![0x5a; len as usize % 3000]);
                t.device_mut().backend_ready(pair);
            }
            Op::Kick { q } => {
                let q = self.queue(q);
                kick(self.r.f.device_mut(), q);
            }
            Op::Ctrl { cmd } => {
                let c = self.qs.len() - 1;
                if self.r.pairs > 1 {
                    let _ = mem.write_slice(&cmd, GuestAddress(BUF_BASE));
                    self.qs[c].add_chain(&mem, &[(BUF_BASE, 4, false), (BUF_BASE + 8, 1, true)]);
                    kick(self.r.f.device_mut(), c);
                }
            }
            Op::Poke { at, v } => {
                let _ = mem.write_obj(v, GuestAddress((0x1_0000 + at as u64 % 0x5_0000) & !7));
            }
        }
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let mut r = rig(if u.arbitrary()? { 1 } else { 2 });
    let qs = r.bring_up();
    let mut d = Driver { r, qs };
    while !u.is_empty() {
        let op: Op = u.arbitrary()?;
        let before: Vec<u16> = d.qs.iter().map(|q| q.used_idx(&d.r.mem)).collect();
        let poke = matches!(op, Op::Poke { .. });
        d.apply(op);
        let t = d.r.f.device_mut();
        if t.save().map(|s| s.needs_reset).unwrap_or(false) || poke {
            // The device gave up on a broken ring (or the driver scribbled on the used ring):
            // the driver resets and starts over.
            d.qs = d.r.bring_up();
            continue;
        }
        for (q, b) in d.qs.iter().zip(before) {
            let after = q.used_idx(&d.r.mem);
            let moved = after.wrapping_sub(b);
            assert!(moved <= q.size, "used index jumped by {moved}");
            for k in 0..moved {
                let (id, len) = q.used_elem(&d.r.mem, b.wrapping_add(k));
                assert!(id < q.size as u32, "used id {id}");
                assert!(len as usize <= MAX_FRAME_LEN, "used len {len}");
            }
        }
    }
    let t = d.r.f.device_mut();
    for sent in &t.device().backend().sent {
        for f in sent {
            assert!(f.len() >= VNET_HDR_LEN && f.len() <= MAX_FRAME_LEN, "a {}-byte frame sent", f.len());
        }
    }
    let _ = t.device().features();
    Ok(())
}
