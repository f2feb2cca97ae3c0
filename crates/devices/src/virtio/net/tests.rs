use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::persist::Persist;
use crate::virtio::pci_transport::VirtioPciTransport;
use crate::virtio::status;
use crate::virtio::testutil::*;

const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
const BASE: u64 = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS;
const OK: u8 = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

type Nic = VirtioPciTransport<Net<Loopback>>;

fn nic(pairs: u16, mem: &GuestMemory, irqs: &Arc<Irqs>) -> Nic {
    let net = Net::new(NetConfig { mac: MAC, pairs, offload: false }, Loopback::new(pairs as usize)).unwrap();
    VirtioPciTransport::new("net0", net, mem.clone(), shared(irqs), 2 * pairs + 2)
}

fn queues(n: usize) -> Vec<GuestQueue> {
    (0..n).map(|i| GuestQueue::new(i, 16)).collect()
}

/// Fresh rings after a reset.
fn fresh_queues(n: usize, mem: &GuestMemory) -> Vec<GuestQueue> {
    let qs = queues(n);
    qs.iter().for_each(|q| q.clear(mem));
    qs
}

/// A frame with a vnet header whose first byte is `tag`.
fn frame(tag: u8, payload: usize) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f[0] = tag;
    f.extend((0..payload).map(|i| i as u8));
    f
}

#[test]
fn config_space_has_mac_link_and_pairs() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(2, &mem, &irqs);
    let mut cfg = [0u8; 12];
    t.bar_read(crate::virtio::pci_transport::DEVICE_CFG_OFFSET, &mut cfg);
    assert_eq!(&cfg[..6], &MAC);
    assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1, "LINK_UP");
    assert_eq!(u16::from_le_bytes([cfg[8], cfg[9]]), 2, "max_virtqueue_pairs");
    assert_eq!(&cfg[10..], &[0, 0], "past the end reads zero");
    t.bar_write(crate::virtio::pci_transport::DEVICE_CFG_OFFSET, &[0xff; 6]);
    t.bar_read(crate::virtio::pci_transport::DEVICE_CFG_OFFSET, &mut cfg[..6]);
    assert_eq!(&cfg[..6], &MAC, "read-only");

    assert_eq!(bring_up(&mut t, BASE, &queues(5)), OK);
    irqs.take();
    t.device_mut().set_link(false);
    assert_eq!(irqs.take(), vec![0], "config change on the config vector");
    t.bar_read(crate::virtio::pci_transport::DEVICE_CFG_OFFSET + 6, &mut cfg[..2]);
    assert_eq!(&cfg[..2], &[0, 0]);
}

#[test]
fn features_follow_the_config() {
    let l = |p| Loopback::new(p);
    let one = Net::new(NetConfig { mac: MAC, pairs: 1, offload: false }, l(1)).unwrap();
    assert_eq!(one.features(), BASE | VIRTIO_F_RING_EVENT_IDX | VIRTIO_NET_F_MRG_RXBUF);
    assert_eq!(one.queue_max_sizes().len(), 2);
    // Offloads: what the backend can serve, only when the config asks.
    let offloading = |p, offload| {
        let mut b = l(p);
        b.can_offload = VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_HOST_TSO4 | VIRTIO_F_VERSION_1;
        Net::new(NetConfig { mac: MAC, pairs: p as u16, offload }, b).unwrap()
    };
    assert_eq!(offloading(1, false).features(), one.features());
    let mq = offloading(4, true);
    let f = mq.features();
    assert!(f & VIRTIO_NET_F_MQ != 0 && f & VIRTIO_NET_F_CTRL_VQ != 0);
    let offered = VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_HOST_TSO4;
    assert_eq!(f & OFFLOAD_FEATURES, offered, "only offloads, only the backend's");
    assert_eq!(
        Net::new(NetConfig { mac: MAC, pairs: 4, offload: true }, l(4)).unwrap().features() & OFFLOAD_FEATURES,
        0
    );
    assert_eq!(mq.queue_max_sizes().len(), 9, "4 pairs and a control queue");

    let e = Net::new(NetConfig { mac: MAC, pairs: 0, offload: false }, l(0)).err().unwrap();
    assert_eq!(e.to_string(), "bad queue pair count 0: a NIC has 1 to 16");
    assert!(matches!(Net::new(NetConfig { mac: MAC, pairs: 17, offload: false }, l(17)), Err(NetError::Pairs(17))));
    let e = Net::new(NetConfig { mac: [1, 2, 3, 4, 5, 6], pairs: 1, offload: false }, l(1)).err().unwrap();
    assert_eq!(e.to_string(), "bad MAC 01:02:03:04:05:06: multicast addresses are not allowed");
    assert!(matches!(
        Net::new(NetConfig { mac: MAC, pairs: 2, offload: false }, l(1)),
        Err(NetError::BackendPairs { backend: 1, nic: 2 })
    ));
    assert_eq!(parse_mac("52:54:00:12:34:56"), Ok(MAC));
    for bad in ["52:54:00:12:34", "52:54:00:12:34:5g", "525:4:00:12:34:56", ""] {
        assert!(parse_mac(bad).unwrap_err().starts_with("bad MAC"), "{bad}");
    }
}

#[test]
fn tx_frame_reaches_the_backend_with_its_header() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    // Header and payload in separate descriptors, as Linux sends them.
    let f = frame(0xab, 60);
    mem.write_slice(&f[..VNET_HDR_LEN], GuestAddress(BUF_BASE)).unwrap();
    mem.write_slice(&f[VNET_HDR_LEN..], GuestAddress(BUF_BASE + 0x1000)).unwrap();
    let head = qs[1].add_chain(&mem, &[(BUF_BASE, 12, false), (BUF_BASE + 0x1000, 60, false)]);
    kick(&mut t, 1);
    assert_eq!(t.device().backend().sent[0], vec![f]);
    assert_eq!(qs[1].used_idx(&mem), 1);
    assert_eq!(qs[1].used_elem(&mem, 0), (head as u32, 0));
    assert_eq!(irqs.take(), vec![2], "TX queue 1's vector");
    let c = t.device().counters();
    assert_eq!((c.tx_frames, c.tx_bytes, c.tx_dropped), (1, 60, 0));
    // Two descriptors: copied out, not sent in place.
    assert_eq!(t.device().backend().sent_in_place, 0);
}

#[test]
fn a_frame_in_one_descriptor_is_sent_from_guest_memory_in_place() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    let f = frame(0xcd, 100);
    mem.write_slice(&f, GuestAddress(BUF_BASE)).unwrap();
    let head = qs[1].add_chain(&mem, &[(BUF_BASE, f.len() as u32, false)]);
    // Too short to hold a vnet header: dropped, whichever path.
    let short = qs[1].add_chain(&mem, &[(BUF_BASE, 4, false)]);
    kick(&mut t, 1);
    assert_eq!(t.device().backend().sent[0], vec![f]);
    assert_eq!(t.device().backend().sent_in_place, 1);
    assert_eq!(qs[1].used_idx(&mem), 2);
    assert_eq!(qs[1].used_elem(&mem, 0), (head as u32, 0));
    assert_eq!(qs[1].used_elem(&mem, 1), (short as u32, 0));
    let c = t.device().counters();
    assert_eq!((c.tx_frames, c.tx_bytes, c.tx_dropped), (1, 100, 1));
}

#[test]
fn a_pass_sends_runs_of_in_place_frames_together_in_the_drivers_order() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 128)).collect();
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    // 100 frames: #30 in two descriptors (copied out), #31 too short (dropped), the rest in one.
    let mut want = Vec::new();
    let mut heads = Vec::new();
    for i in 0..100u64 {
        let f = frame(i as u8, 64 + i as usize);
        let at = BUF_BASE + i * 0x800;
        mem.write_slice(&f, GuestAddress(at)).unwrap();
        let head = match i {
            30 => qs[1].add_chain(&mem, &[(at, 12, false), (at + 12, f.len() as u32 - 12, false)]),
            31 => qs[1].add_chain(&mem, &[(at, 4, false)]),
            _ => qs[1].add_chain(&mem, &[(at, f.len() as u32, false)]),
        };
        heads.push(head);
        if i != 31 {
            want.push(f);
        }
    }
    kick(&mut t, 1);
    let b = t.device().backend();
    assert_eq!(b.sent[0], want, "every frame but the short one, in the driver's order");
    // A pass gathers up to TX_BATCH chains; a frame that must be copied ends a run.
    assert_eq!(b.batches, vec![30, TX_BATCH - 32, 100 - TX_BATCH]);
    assert_eq!(b.sent_in_place, 98);
    assert_eq!(qs[1].used_idx(&mem), 100);
    for (k, &h) in heads.iter().enumerate() {
        assert_eq!(qs[1].used_elem(&mem, k as u16), (h as u32, 0), "used entry {k}");
    }
    assert_eq!(irqs.take(), vec![2], "one interrupt for the pass");
    let c = t.device().counters();
    assert_eq!((c.tx_frames, c.tx_dropped), (99, 1));
    assert_eq!(c.tx_bytes, (0..100u64).filter(|&i| i != 31).map(|i| 64 + i).sum::<u64>());
}

#[test]
fn rx_frame_lands_in_guest_buffers_and_raises_the_queue_vector() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    let f = frame(0x11, 100);
    t.device_mut().backend_mut().inject(0, f.clone());
    assert!(!t.device_mut().backend_ready(0), "no buffers yet: the frame waits");
    assert_eq!(qs[0].used_idx(&mem), 0);
    assert!(irqs.take().is_empty());

    let head = qs[0].add_chain(&mem, &[(BUF_BASE, 64, true), (BUF_BASE + 0x1000, 1500, true)]);
    kick(&mut t, 0);
    assert_eq!(qs[0].used_idx(&mem), 1);
    assert_eq!(qs[0].used_elem(&mem, 0), (head as u32, f.len() as u32));
    let mut got = vec![0u8; f.len()];
    mem.read_slice(&mut got[..64], GuestAddress(BUF_BASE)).unwrap();
    mem.read_slice(&mut got[64..], GuestAddress(BUF_BASE + 0x1000)).unwrap();
    let mut want = f.clone();
    want[10] = 1; // num_buffers
    assert_eq!(got, want);
    assert_eq!(irqs.take(), vec![1]);

    // A buffer too small for the frame: returned empty, the frame counted as dropped.
    qs[0].add_chain(&mem, &[(BUF_BASE, 20, true)]);
    t.device_mut().backend_mut().inject(0, frame(0x22, 100));
    assert!(t.device_mut().backend_ready(0) || t.device().backend().incoming[0].is_empty());
    assert_eq!(qs[0].used_elem(&mem, 1).1, 0);
    assert_eq!(t.device().counters().rx_dropped, 1);
}

#[test]
fn event_idx_suppresses_interrupts_until_used_event() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE | VIRTIO_F_RING_EVENT_IDX, &qs), OK);
    // The driver wants an interrupt once the third buffer is used (used_event = 2).
    qs[0].set_used_event(&mem, 2);
    for i in 0..3u64 {
        qs[0].add_chain(&mem, &[(BUF_BASE + i * 0x1000, 2048, true)]);
    }
    kick(&mut t, 0);
    for n in 0..3 {
        t.device_mut().backend_mut().inject(0, frame(n, 40));
        t.device_mut().backend_ready(0);
        let fired = irqs.take();
        if n < 2 {
            assert!(fired.is_empty(), "frame {n}: suppressed, got {fired:?}");
        } else {
            assert_eq!(fired, vec![1], "frame {n}: used index passed used_event");
        }
    }
    assert_eq!(qs[0].used_idx(&mem), 3);

    // Without EVENT_IDX every batch interrupts.
    let irqs2 = Arc::new(Irqs::default());
    let mut t2 = nic(1, &mem, &irqs2);
    let mut qs2 = queues(2);
    assert_eq!(bring_up(&mut t2, BASE, &qs2), OK);
    qs2[0].set_used_event(&mem, 2);
    for i in 0..2u64 {
        qs2[0].add_chain(&mem, &[(BUF_BASE + i * 0x1000, 2048, true)]);
    }
    for n in 0..2 {
        t2.device_mut().backend_mut().inject(0, frame(n, 40));
        t2.device_mut().backend_ready(0);
        assert_eq!(irqs2.take(), vec![1]);
    }
}

#[test]
fn multiqueue_pairs_use_their_own_queues_and_backend_channels() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(2, &mem, &irqs);
    let mut qs = queues(5);
    assert_eq!(bring_up(&mut t, BASE | VIRTIO_NET_F_MQ | VIRTIO_NET_F_CTRL_VQ, &qs), OK);

    // Control queue: VQ_PAIRS_SET 2 is acknowledged, 3 refused.
    for (n, want) in [(2u16, vn::VIRTIO_NET_OK as u8), (3, vn::VIRTIO_NET_ERR as u8)] {
        let cmd = [vn::VIRTIO_NET_CTRL_MQ as u8, vn::VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8];
        mem.write_slice(&cmd, GuestAddress(BUF_BASE)).unwrap();
        mem.write_slice(&n.to_le_bytes(), GuestAddress(BUF_BASE + 0x100)).unwrap();
        mem.write_obj(0xeeu8, GuestAddress(BUF_BASE + 0x200)).unwrap();
        qs[4].add_chain(&mem, &[(BUF_BASE, 2, false), (BUF_BASE + 0x100, 2, false), (BUF_BASE + 0x200, 1, true)]);
        kick(&mut t, 4);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(BUF_BASE + 0x200)).unwrap(), want, "pairs {n}");
    }
    assert_eq!(qs[4].used_idx(&mem), 2);
    assert_eq!(t.save().unwrap().device.active_pairs, 2);
    irqs.take();

    // TX on pair 1 (queue 3) reaches backend channel 1 only.
    let f = frame(7, 30);
    mem.write_slice(&f, GuestAddress(BUF_BASE + 0x3000)).unwrap();
    qs[3].add_chain(&mem, &[(BUF_BASE + 0x3000, f.len() as u32, false)]);
    kick(&mut t, 3);
    assert!(t.device().backend().sent[0].is_empty());
    assert_eq!(t.device().backend().sent[1], vec![f]);
    assert_eq!(irqs.take(), vec![4]);

    // RX for pair 1 lands in queue 2, not queue 0.
    qs[0].add_chain(&mem, &[(BUF_BASE + 0x4000, 2048, true)]);
    qs[2].add_chain(&mem, &[(BUF_BASE + 0x5000, 2048, true)]);
    t.device_mut().backend_mut().inject(1, frame(9, 50));
    t.device_mut().backend_ready(1);
    assert_eq!(qs[2].used_idx(&mem), 1);
    assert_eq!(qs[0].used_idx(&mem), 0);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(BUF_BASE + 0x5000)).unwrap(), 9);
    assert_eq!(irqs.take(), vec![3]);
}

fn needs_reset(t: &mut Nic) -> bool {
    r(t, 0x14, 1) as u8 & status::DEVICE_NEEDS_RESET != 0
}

#[test]
fn bad_chains_are_dropped_without_a_panic() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    let tx = &mut qs[1];
    // A descriptor loop: 0 → 1 → 0.
    tx.write_desc(&mem, 0, BUF_BASE, 64, 1, 1);
    tx.write_desc(&mem, 1, BUF_BASE, 64, 1, 0);
    tx.publish(&mem, 0);
    // A chain running past the table (next index out of range).
    tx.write_desc(&mem, 2, BUF_BASE, 64, 1, 200);
    tx.publish(&mem, 2);
    // Zero length, a buffer outside guest memory, an oversized one, a header-only-too-short one.
    tx.write_desc(&mem, 3, BUF_BASE, 0, 0, 0);
    tx.publish(&mem, 3);
    tx.write_desc(&mem, 4, 1 << 40, 64, 0, 0);
    tx.publish(&mem, 4);
    tx.write_desc(&mem, 5, BUF_BASE, (MAX_FRAME_LEN + 1) as u32, 0, 0);
    tx.publish(&mem, 5);
    tx.write_desc(&mem, 6, BUF_BASE, 4, 0, 0);
    tx.publish(&mem, 6);
    kick(&mut t, 1);
    assert!(!needs_reset(&mut t));
    assert_eq!(qs[1].used_idx(&mem), 6, "each readable chain returned, the bad head skipped");
    // The loop and the overrun chain hold 128 and 64 bytes: they are sent, as the guest made them.
    let c = t.device().counters();
    assert_eq!(c.tx_frames + c.tx_dropped, 6);
    assert_eq!(c.tx_dropped, 4);

    // A head index past the queue, and an avail index that jumps past the queue size:
    // DEVICE_NEEDS_RESET, with a config interrupt.
    irqs.take();
    qs[1].publish(&mem, 999);
    kick(&mut t, 1);
    assert!(needs_reset(&mut t));
    assert_eq!(irqs.take(), vec![0]);
    let qs = fresh_queues(2, &mem);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    mem.write_obj(qs[1].avail_idx.wrapping_add(17), GuestAddress(qs[1].avail + 2)).unwrap();
    kick(&mut t, 1);
    assert!(needs_reset(&mut t));
    assert_eq!(irqs.take(), vec![0]);
    // The driver resets and starts over; the device works again.
    let mut qs = fresh_queues(2, &mem);
    assert_eq!(bring_up(&mut t, BASE, &qs), OK);
    let f = frame(1, 20);
    mem.write_slice(&f, GuestAddress(BUF_BASE)).unwrap();
    qs[1].add_chain(&mem, &[(BUF_BASE, f.len() as u32, false)]);
    kick(&mut t, 1);
    assert_eq!(t.device().backend().sent[0].last(), Some(&f));
}

#[test]
fn rings_outside_guest_memory_need_a_reset() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    qs[1].used = MEM_SIZE as u64 - 8;
    let s = bring_up(&mut t, BASE, &qs);
    assert_eq!(s, OK | status::DEVICE_NEEDS_RESET);
    assert_eq!(irqs.take(), vec![0]);
    kick(&mut t, 1); // not running: nothing happens
    w(&mut t, 0x14, 0, 1);
    assert_eq!(r(&mut t, 0x14, 1), 0, "a reset clears it");
}

/// xorshift64*: a fixed seed makes a failure reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn fuzz_random_descriptor_tables_and_avail_rings() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut rng = Rng(0x6b75_6d6f_7669_7274);
    let mut qs = queues(2);
    let size = qs[0].size;
    // Half the time with mergeable RX buffers.
    let features = |rng: &mut Rng| BASE | VIRTIO_F_RING_EVENT_IDX | (rng.below(2) * VIRTIO_NET_F_MRG_RXBUF);
    let f = features(&mut rng);
    assert_eq!(bring_up(&mut t, f, &qs), OK);
    let mut resets = 0;
    for round in 0..50_000u32 {
        let qi = (round % 2) as usize;
        let q = &mut qs[qi];
        // Random descriptors: mostly plausible addresses, some wild ones, random flags
        // (NEXT, WRITE, INDIRECT) and next indices.
        for _ in 0..rng.below(6) {
            let i = rng.below(size as u64 + 2) as u16;
            let addr = match rng.below(8) {
                0 => rng.next(),
                1 => MEM_SIZE as u64 - rng.below(64),
                _ => BUF_BASE + rng.below(0x10_0000),
            };
            let len = match rng.below(8) {
                0 => rng.next() as u32,
                1 => 0,
                _ => rng.below(4096) as u32,
            };
            let flags = rng.below(8) as u16;
            let next = rng.below(size as u64 + 4) as u16;
            q.write_desc(&mem, i.min(size - 1), addr, len, flags, next);
        }
        let before = q.used_idx(&mem);
        let published = rng.below(4) as u16;
        for _ in 0..published {
            let head = if rng.below(16) == 0 { rng.next() as u16 } else { rng.below(size as u64) as u16 };
            q.publish(&mem, head);
        }
        if rng.below(64) == 0 {
            // A wild avail index.
            let v = rng.next() as u16;
            mem.write_obj(v, GuestAddress(q.avail + 2)).unwrap();
            q.avail_idx = v;
        }
        if rng.below(4) == 0 {
            q.set_used_event(&mem, rng.next() as u16);
        }
        if qi == 0 {
            for _ in 0..rng.below(3) {
                let n = rng.below(3000) as usize;
                t.device_mut().backend_mut().inject(0, frame(round as u8, n.saturating_sub(VNET_HDR_LEN)));
            }
            t.device_mut().backend_ready(0);
        } else {
            kick(&mut t, 1);
        }
        if needs_reset(&mut t) {
            resets += 1;
            qs = fresh_queues(2, &mem);
            t.device_mut().backend_mut().incoming[0].clear();
            let f = features(&mut rng);
            assert_eq!(bring_up(&mut t, f, &qs), OK);
            continue;
        }
        // The used ring only moves forward, by at most what was offered, with ids in range.
        let q = &qs[qi];
        let after = q.used_idx(&mem);
        let moved = after.wrapping_sub(before);
        assert!(moved <= size, "round {round}: used index jumped by {moved}");
        for k in 0..moved {
            let (id, len) = q.used_elem(&mem, before.wrapping_add(k));
            assert!(id < size as u32, "round {round}: used id {id}");
            assert!(len as usize <= MAX_FRAME_LEN, "round {round}: used len {len}");
        }
    }
    let c = t.device().counters();
    assert!(c.tx_frames + c.tx_dropped > 0 && c.rx_frames + c.rx_dropped > 0, "{c:?}");
    eprintln!("fuzz: {resets} resets, {c:?}");
    assert!(resets > 0, "the wild avail indices were noticed");
    t.device().backend().sent[0].iter().for_each(|f| assert!(f.len() >= VNET_HDR_LEN && f.len() <= MAX_FRAME_LEN));
}

#[test]
fn snapshot_round_trip_keeps_rings_and_config() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE | VIRTIO_F_RING_EVENT_IDX, &qs), OK);
    for i in 0..3u64 {
        qs[0].add_chain(&mem, &[(BUF_BASE + i * 0x1000, 2048, true)]);
    }
    t.device_mut().backend_mut().inject(0, frame(1, 40));
    t.device_mut().backend_ready(0);
    t.device_mut().set_link(false);
    let state = t.save().unwrap();
    assert_eq!(state.status, OK);
    assert_eq!(state.queues[0].next_avail, 1);
    assert_eq!(state.queues[0].next_used, 1);
    assert_eq!(state.queues[1].regs.msix_vector, 2);
    let json = serde_json::to_string(&state).unwrap();

    // The destination: same memory contents, a fresh device.
    let irqs2 = Arc::new(Irqs::default());
    let mut t2 = nic(1, &mem, &irqs2);
    t2.restore(&serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(t2.save().unwrap(), state);
    assert_eq!(r(&mut t2, 0x14, 1) as u8, OK);
    let mut cfg = [0u8; 2];
    t2.bar_read(crate::virtio::pci_transport::DEVICE_CFG_OFFSET + 6, &mut cfg);
    assert_eq!(cfg, [0, 0], "link down survives");
    // It goes on from where the source stopped: the next frame uses the second buffer.
    t2.device_mut().backend_mut().inject(0, frame(2, 40));
    t2.device_mut().backend_ready(0);
    assert_eq!(qs[0].used_idx(&mem), 2);
    assert_eq!(qs[0].used_elem(&mem, 1).0, 1);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(BUF_BASE + 0x1000)).unwrap(), 2);

    // A state of another shape is refused and leaves the device as it was.
    let mut bad = state.clone();
    bad.queues.pop();
    let e = t2.restore(&bad).unwrap_err().to_string();
    assert_eq!(e, "net0: 1 queues saved, this device has 2");
    let mut bad = state.clone();
    bad.driver_features |= 1 << 60;
    assert!(t2.restore(&bad).unwrap_err().to_string().starts_with("net0: features"));
    assert_eq!(r(&mut t2, 0x14, 1) as u8, OK);
}

/// Found by kumo-fuzz (target `restore`): a refused virtio-net state left the transport reset
/// (the reset came before the device's state was read), and active pair counts or MACs the
/// NIC cannot have were taken.
#[test]
fn a_refused_device_state_leaves_a_running_nic_as_it_was() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(2, &mem, &irqs);
    assert_eq!(bring_up(&mut t, BASE, &queues(5)), OK);
    let state = t.save().unwrap();
    let with = |f: &dyn Fn(&mut NetState)| {
        let mut s = state.clone();
        f(&mut s.device);
        s
    };
    for (bad, want) in [
        (with(&|d| d.config.pairs = 1), "1 queue pairs saved"),
        (with(&|d| d.active_pairs = 0), "0 active queue pairs saved"),
        (with(&|d| d.active_pairs = 3), "3 active queue pairs saved"),
        (with(&|d| d.config.mac[0] = 1), "multicast"),
    ] {
        let e = t.restore(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "want `{want}` in `{e}`");
        assert_eq!(t.save().unwrap(), state, "a refused state changes nothing");
        assert_eq!(r(&mut t, 0x14, 1) as u8, OK);
    }
}

#[test]
fn mergeable_rx_buffers_carry_a_frame_across_chains() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, BASE | VIRTIO_NET_F_MRG_RXBUF, &qs), OK);
    let f = frame(0x33, 2500 - VNET_HDR_LEN);
    // Two 1 KiB buffers are not enough: the frame waits, the buffers stay the driver's.
    qs[0].add_chain(&mem, &[(BUF_BASE, 1024, true)]);
    qs[0].add_chain(&mem, &[(BUF_BASE + 0x1000, 1024, true)]);
    t.device_mut().backend_mut().inject(0, f.clone());
    assert!(!t.device_mut().backend_ready(0));
    assert_eq!(qs[0].used_idx(&mem), 0);
    // A third one: the frame spans all three, num_buffers says so.
    qs[0].add_chain(&mem, &[(BUF_BASE + 0x2000, 1024, true)]);
    kick(&mut t, 0);
    assert_eq!(qs[0].used_idx(&mem), 3);
    let lens: Vec<u32> = (0..3).map(|i| qs[0].used_elem(&mem, i).1).collect();
    assert_eq!(lens, [1024, 1024, 452]);
    let mut got = vec![0u8; 2500];
    for i in 0..3 {
        let n = lens[i] as usize;
        mem.read_slice(&mut got[i * 1024..i * 1024 + n], GuestAddress(BUF_BASE + 0x1000 * i as u64)).unwrap();
    }
    let mut want = f;
    want[10] = 3;
    assert_eq!(got, want);
    assert_eq!(irqs.take(), vec![1], "one interrupt for the frame");

    // A frame that all of the queue's buffers cannot hold is dropped, the buffers returned empty.
    for i in 0..16u64 {
        qs[0].add_chain(&mem, &[(BUF_BASE + 0x1000 * i, 16, true)]);
    }
    t.device_mut().backend_mut().inject(0, frame(1, 1000));
    t.device_mut().backend_ready(0);
    assert_eq!(qs[0].used_idx(&mem), 3 + 16);
    assert!((3..19).all(|i| qs[0].used_elem(&mem, i).1 == 0));
    assert_eq!(t.device().counters().rx_dropped, 1);
}

#[test]
fn snapshots_taken_mid_setup_or_after_a_failure_restore_as_they_were() {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = nic(1, &mem, &irqs);
    // Mid-setup: features accepted, one queue programmed, not running.
    w(&mut t, 0x14, 1, 1);
    w(&mut t, 0x14, 3, 1);
    w(&mut t, 0x08, 1, 4);
    w(&mut t, 0x0c, 1, 4);
    w(&mut t, 0x14, 11, 1);
    w(&mut t, 0x16, 1, 2);
    w(&mut t, 0x18, 32, 2);
    w(&mut t, 0x20, 0x7000, 8);
    let state = t.save().unwrap();
    let mut t2 = nic(1, &mem, &irqs);
    t2.restore(&state).unwrap();
    assert_eq!(t2.save().unwrap(), state);
    assert!(t2.device().queues().is_none(), "not running");
    assert_eq!((r(&mut t2, 0x16, 2), r(&mut t2, 0x18, 2), r(&mut t2, 0x20, 8)), (1, 32, 0x7000));

    // After a failure: DEVICE_NEEDS_RESET survives, the device stays stopped.
    let mut qs = queues(2);
    qs[0].used = MEM_SIZE as u64 - 8;
    assert_eq!(bring_up(&mut t, BASE, &qs), OK | status::DEVICE_NEEDS_RESET);
    let state = t.save().unwrap();
    assert!(state.needs_reset);
    let mut t3 = nic(1, &mem, &irqs);
    t3.restore(&state).unwrap();
    assert_eq!(r(&mut t3, 0x14, 1) as u8, OK | status::DEVICE_NEEDS_RESET);
    assert!(t3.device().queues().is_none());
}

#[test]
fn the_backend_gets_the_guest_bound_offloads_the_driver_accepted() {
    assert_eq!(offload_names(OFFLOAD_FEATURES).len(), 11, "every offload has a name");
    assert_eq!(offload_names(VIRTIO_NET_F_HOST_USO | VIRTIO_NET_F_CSUM | VIRTIO_NET_F_MAC), ["csum", "host_uso"]);
    // Segmentation and ECN without what they need are not passed on (virtio 1.2, 5.1.3.1).
    assert_eq!(guest_offloads(VIRTIO_NET_F_GUEST_TSO4 | VIRTIO_NET_F_GUEST_USO4), 0);
    assert_eq!(
        guest_offloads(VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_GUEST_ECN | VIRTIO_NET_F_HOST_TSO4 | VIRTIO_NET_F_MAC),
        VIRTIO_NET_F_GUEST_CSUM
    );
    let all = OFFLOAD_FEATURES | VIRTIO_NET_F_MAC;
    let guest = VIRTIO_NET_F_GUEST_CSUM
        | VIRTIO_NET_F_GUEST_TSO4
        | VIRTIO_NET_F_GUEST_TSO6
        | VIRTIO_NET_F_GUEST_ECN
        | VIRTIO_NET_F_GUEST_USO4
        | VIRTIO_NET_F_GUEST_USO6;
    assert_eq!(guest_offloads(all), guest);

    // Through a driver's negotiation: activation sets them, a driver that takes none clears them.
    let mut b = Loopback::new(1);
    b.can_offload = OFFLOAD_FEATURES;
    let net = Net::new(NetConfig { mac: MAC, pairs: 1, offload: true }, b).unwrap();
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = VirtioPciTransport::new("net0", net, mem.clone(), shared(&irqs), 3);
    let qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 16)).collect();
    bring_up(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_GUEST_TSO4 | VIRTIO_NET_F_CSUM, &qs);
    assert_eq!(t.device().backend().offload, VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_GUEST_TSO4);
    // bring_up resets the device first.
    bring_up(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_NET_F_HOST_TSO4 | VIRTIO_NET_F_CSUM, &fresh_queues(2, &mem));
    assert_eq!(t.device().backend().offload, 0);
}

/// A backend that notes, at each read, how many interrupts the device has raised so far.
struct Probe {
    inner: Loopback,
    irqs: Arc<Irqs>,
    raised_at_read: Vec<usize>,
}

impl NetBackend for Probe {
    fn pairs(&self) -> usize {
        self.inner.pairs()
    }
    fn recv(&mut self, pair: usize, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.raised_at_read.push(self.irqs.0.lock().unwrap().len());
        self.inner.recv(pair, buf)
    }
    fn send(&mut self, pair: usize, frame: &[u8]) -> io::Result<()> {
        self.inner.send(pair, frame)
    }
    fn fd(&self, pair: usize) -> Option<RawFd> {
        self.inner.fd(pair)
    }
    fn set_offload(&mut self, guest: u64) -> io::Result<()> {
        self.inner.set_offload(guest)
    }
}

/// Brings up a one-pair NIC over a [`Probe`] with `features`, two frames waiting and four RX
/// buffers posted (used_event 0: the driver wants the first); returns the interrupts raised
/// before each backend read and in all.
fn rx_pass_with(features: u64) -> (Vec<usize>, usize) {
    let mem = memory();
    let irqs = Arc::new(Irqs::default());
    let probe = Probe { inner: Loopback::new(1), irqs: irqs.clone(), raised_at_read: Vec::new() };
    let net = Net::new(NetConfig { mac: MAC, pairs: 1, offload: false }, probe).unwrap();
    let mut t = VirtioPciTransport::new("net0", net, mem.clone(), shared(&irqs), 4);
    let mut qs = queues(2);
    assert_eq!(bring_up(&mut t, features, &qs), OK);
    qs[0].set_used_event(&mem, 0);
    for i in 0..4u64 {
        qs[0].add_chain(&mem, &[(BUF_BASE + i * 0x1000, 2048, true)]);
    }
    irqs.take();
    t.device_mut().backend_mut().raised_at_read.clear();
    for n in 0..2 {
        t.device_mut().backend_mut().inner.inject(0, frame(n, 40));
    }
    t.device_mut().backend_ready(0);
    assert_eq!(qs[0].used_idx(&mem), 2, "both frames placed");
    let raised = irqs.take().len();
    (t.device_mut().backend_mut().raised_at_read.clone(), raised)
}

#[test]
fn with_event_idx_the_first_frame_interrupts_before_the_backend_is_read_again() {
    // Reads: frame 0, frame 1, then the empty read that ends the pass.
    let (at_read, raised) = rx_pass_with(BASE | VIRTIO_F_RING_EVENT_IDX);
    assert_eq!(at_read, vec![0, 1, 1], "the interrupt went out right after frame 0");
    assert_eq!(raised, 1, "used_event 0 asked for one: frame 1 stays silent");
    // Without EVENT_IDX each check would interrupt: one at the end of the pass.
    let (at_read, raised) = rx_pass_with(BASE);
    assert_eq!(at_read, vec![0, 0, 0]);
    assert_eq!(raised, 1);
}
