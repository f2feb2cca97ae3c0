use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::persist::Persist;
use crate::virtio::pci_transport::{VirtioPciTransport, DEVICE_CFG_OFFSET};
use crate::virtio::status;
use crate::virtio::testutil::*;

const BS: u64 = 2 << 20;
const BASE: u64 = 4 << 30;
const REGION: u64 = 256 << 20;
const REQ_AT: u64 = BUF_BASE;
const RESP_AT: u64 = BUF_BASE + 0x100;

/// Host-side calls, and whether the next one fails.
#[derive(Default)]
struct Host {
    calls: Vec<(&'static str, u64, u64)>,
    fail: bool,
}

struct FakeBackend(Arc<Mutex<Host>>);

impl MemBackend for FakeBackend {
    fn plug(&mut self, offset: u64, len: u64) -> Result<(), String> {
        let mut h = self.0.lock().unwrap();
        if h.fail {
            return Err("no".into());
        }
        h.calls.push(("plug", offset, len));
        Ok(())
    }
    fn unplug(&mut self, offset: u64, len: u64) -> Result<(), String> {
        let mut h = self.0.lock().unwrap();
        if h.fail {
            return Err("no".into());
        }
        h.calls.push(("unplug", offset, len));
        Ok(())
    }
}

struct Rig {
    t: VirtioPciTransport<Mem>,
    mem: GuestMemory,
    irqs: Arc<Irqs>,
    q: GuestQueue,
    host: Arc<Mutex<Host>>,
}

fn cfg(requested: u64) -> MemConfig {
    MemConfig { addr: BASE, region_size: REGION, block_size: BS, node_id: 1, requested_size: requested }
}

impl Rig {
    fn new(requested: u64) -> Rig {
        let host = Arc::new(Mutex::new(Host::default()));
        let dev = Mem::new("mem0", cfg(requested), Box::new(FakeBackend(host.clone()))).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("mem0", dev, mem.clone(), shared(&irqs), 2);
        let q = GuestQueue::new(0, 16);
        q.clear(&mem);
        let features = t.device().features();
        let st = bring_up(&mut t, features, &[q]);
        assert_eq!(st, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        Rig { t, mem, irqs, q, host }
    }

    /// Sends `req` as the driver does (request readable, response writable) and reads the
    /// answer: (type, state).
    fn send(&mut self, req: Request) -> (u16, u16) {
        self.mem.write_slice(&req.to_bytes(), GuestAddress(REQ_AT)).unwrap();
        self.mem.write_slice(&[0xee; RESP_LEN], GuestAddress(RESP_AT)).unwrap();
        let before = self.q.used_idx(&self.mem);
        self.q.add_chain(&self.mem, &[(REQ_AT, REQ_LEN as u32, false), (RESP_AT, RESP_LEN as u32, true)]);
        kick(&mut self.t, 0);
        assert_eq!(self.q.used_idx(&self.mem), before.wrapping_add(1), "request not answered");
        let mut b = [0u8; RESP_LEN];
        self.mem.read_slice(&mut b, GuestAddress(RESP_AT)).unwrap();
        (u16::from_le_bytes([b[0], b[1]]), u16::from_le_bytes([b[8], b[9]]))
    }

    fn cfg_u64(&mut self, off: u64) -> u64 {
        r(&mut self.t, DEVICE_CFG_OFFSET + off, 8)
    }
}

fn req(kind: u16, addr: u64, nb_blocks: u16) -> Request {
    Request { kind, addr, nb_blocks }
}

#[test]
fn config_space_describes_the_region() {
    let mut rig = Rig::new(64 << 20);
    assert_eq!(rig.cfg_u64(0), BS);
    assert_eq!(r(&mut rig.t, DEVICE_CFG_OFFSET + 8, 2), 1);
    assert_eq!((rig.cfg_u64(16), rig.cfg_u64(24), rig.cfg_u64(32)), (BASE, REGION, REGION));
    assert_eq!((rig.cfg_u64(40), rig.cfg_u64(48)), (0, 64 << 20));
    assert_eq!(r(&mut rig.t, DEVICE_CFG_OFFSET + 56, 8), 0, "past the end reads zero");
    let f = rig.t.device().features();
    assert!(f & VIRTIO_MEM_F_ACPI_PXM != 0 && f & VIRTIO_F_VERSION_1 != 0);
}

#[test]
fn plug_within_the_request_then_nack_beyond_it() {
    let mut rig = Rig::new(8 << 20);
    assert_eq!(rig.send(req(REQ_PLUG, BASE, 2)), (RESP_ACK, 0));
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 2 * BS, 2)), (RESP_ACK, 0));
    assert_eq!(rig.t.device().plugged_size(), 8 << 20);
    assert_eq!(rig.cfg_u64(40), 8 << 20);
    // A fifth block is beyond requested_size.
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 4 * BS, 1)), (RESP_NACK, 0));
    assert_eq!(rig.host.lock().unwrap().calls, [("plug", 0, 2 * BS), ("plug", 2 * BS, 2 * BS)]);
    // Every answer raised the queue's vector (1).
    assert!(rig.irqs.take().iter().all(|&v| v == 1));
}

#[test]
fn bad_ranges_are_errors() {
    let mut rig = Rig::new(REGION);
    let blocks = (REGION / BS) as u16;
    for bad in [
        req(REQ_PLUG, BASE + 4096, 1),            // not block aligned
        req(REQ_PLUG, BASE - BS, 1),              // below the region
        req(REQ_PLUG, BASE, 0),                   // no blocks
        req(REQ_PLUG, BASE, blocks + 1),          // past the end
        req(REQ_PLUG, BASE + REGION, 1),          // just past the end
        req(REQ_PLUG, u64::MAX - 4095, u16::MAX), // overflows
        req(REQ_STATE, BASE + REGION, 1),
        req(REQ_UNPLUG, BASE, 1), // not plugged
        req(9, BASE, 1),          // unknown type
    ] {
        assert_eq!(rig.send(bad).0, RESP_ERROR, "{bad:?}");
    }
    assert!(rig.host.lock().unwrap().calls.is_empty());
    assert_eq!(rig.send(req(REQ_PLUG, BASE, blocks)), (RESP_ACK, 0));
    // Plugging a plugged block again is an error.
    assert_eq!(rig.send(req(REQ_PLUG, BASE, 1)).0, RESP_ERROR);
    assert_eq!(rig.t.device().counters().errors, 10);
}

#[test]
fn state_unplug_and_unplug_all() {
    let mut rig = Rig::new(16 << 20);
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 2 * BS, 2)).0, RESP_ACK);
    assert_eq!(rig.send(req(REQ_STATE, BASE + 2 * BS, 2)), (RESP_ACK, STATE_PLUGGED));
    assert_eq!(rig.send(req(REQ_STATE, BASE, 2)), (RESP_ACK, STATE_UNPLUGGED));
    assert_eq!(rig.send(req(REQ_STATE, BASE + BS, 2)), (RESP_ACK, STATE_MIXED));
    // Unplugging a range with an unplugged block in it is an error.
    assert_eq!(rig.send(req(REQ_UNPLUG, BASE + BS, 2)).0, RESP_ERROR);
    assert_eq!(rig.send(req(REQ_UNPLUG, BASE + 3 * BS, 1)).0, RESP_ACK);
    assert_eq!(rig.t.device().plugged_size(), BS);
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 8 * BS, 1)).0, RESP_ACK);
    assert_eq!(rig.send(req(REQ_UNPLUG_ALL, 0, 0)).0, RESP_ACK);
    assert_eq!(rig.t.device().plugged_size(), 0);
    let calls = rig.host.lock().unwrap().calls.clone();
    assert_eq!(
        calls[1..],
        [("unplug", 3 * BS, BS), ("plug", 8 * BS, BS), ("unplug", 2 * BS, BS), ("unplug", 8 * BS, BS)]
    );
}

#[test]
fn a_host_failure_is_an_error_and_changes_nothing() {
    let mut rig = Rig::new(16 << 20);
    rig.host.lock().unwrap().fail = true;
    assert_eq!(rig.send(req(REQ_PLUG, BASE, 1)).0, RESP_ERROR);
    assert_eq!(rig.t.device().plugged_size(), 0);
    rig.host.lock().unwrap().fail = false;
    assert_eq!(rig.send(req(REQ_PLUG, BASE, 1)).0, RESP_ACK);
    rig.host.lock().unwrap().fail = true;
    assert_eq!(rig.send(req(REQ_UNPLUG, BASE, 1)).0, RESP_ERROR);
    assert_eq!(rig.send(req(REQ_UNPLUG_ALL, 0, 0)).0, RESP_ERROR);
    assert_eq!(rig.t.device().plugged_size(), BS);
    assert_eq!(rig.t.device().counters().host_errors, 3);
}

#[test]
fn resize_changes_the_request_and_raises_the_config_vector() {
    let mut rig = Rig::new(0);
    rig.irqs.take();
    rig.t.device_mut().resize(32 << 20).unwrap();
    assert_eq!(rig.cfg_u64(48), 32 << 20);
    assert_eq!(rig.irqs.take(), [0], "config changes raise vector 0");
    assert!(rig.t.device_mut().resize(BS + 1).is_err());
    assert!(rig.t.device_mut().resize(REGION + BS).is_err());
    assert_eq!(rig.t.device().requested_size(), 32 << 20);
    // Shrinking below what is plugged: the driver unplugs on its own.
    assert_eq!(rig.send(req(REQ_PLUG, BASE, 4)).0, RESP_ACK);
    rig.t.device_mut().resize(0).unwrap();
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 4 * BS, 1)).0, RESP_NACK);
    assert_eq!(rig.send(req(REQ_UNPLUG, BASE, 4)).0, RESP_ACK);
}

#[test]
fn malformed_chains_get_an_error_or_break_the_queue() {
    let mut rig = Rig::new(REGION);
    // A short request (8 readable bytes): answered ERROR.
    rig.mem.write_slice(&[0u8; 8], GuestAddress(REQ_AT)).unwrap();
    rig.q.add_chain(&rig.mem, &[(REQ_AT, 8, false), (RESP_AT, RESP_LEN as u32, true)]);
    kick(&mut rig.t, 0);
    let code: u16 = rig.mem.read_obj(GuestAddress(RESP_AT)).unwrap();
    assert_eq!(code, RESP_ERROR);
    // A request in memory that does not exist: ERROR too.
    rig.q.add_chain(&rig.mem, &[(1 << 40, REQ_LEN as u32, false), (RESP_AT, RESP_LEN as u32, true)]);
    kick(&mut rig.t, 0);
    assert_eq!(rig.q.used_idx(&rig.mem), 2);
    // No room for the response: the device needs a reset, and does not answer again.
    rig.q.add_chain(&rig.mem, &[(REQ_AT, REQ_LEN as u32, false), (RESP_AT, 4, true)]);
    kick(&mut rig.t, 0);
    assert_ne!(r(&mut rig.t, 0x14, 1) as u8 & status::DEVICE_NEEDS_RESET, 0);
    rig.q.add_chain(&rig.mem, &[(REQ_AT, REQ_LEN as u32, false), (RESP_AT, RESP_LEN as u32, true)]);
    kick(&mut rig.t, 0);
    assert_eq!(rig.q.used_idx(&rig.mem), 3);
}

#[test]
fn bad_shapes_are_refused() {
    let b = || Box::new(FakeBackend(Arc::default())) as Box<dyn MemBackend>;
    assert_eq!(Mem::new("m", MemConfig { block_size: 4096, ..cfg(0) }, b()).err(), Some(MemError::BlockSize(4096)));
    assert!(Mem::new("m", MemConfig { block_size: 3 << 20, ..cfg(0) }, b()).is_err());
    assert!(Mem::new("m", MemConfig { region_size: 0, ..cfg(0) }, b()).is_err());
    assert!(Mem::new("m", MemConfig { addr: BASE + 4096, ..cfg(0) }, b()).is_err());
    assert!(Mem::new("m", MemConfig { addr: u64::MAX - BS + 1, ..cfg(0) }, b()).is_err());
    assert!(Mem::new("m", cfg(REGION + BS), b()).is_err());
}

#[test]
fn the_plugged_bitmap_survives_a_reset_and_a_snapshot() {
    let mut rig = Rig::new(REGION);
    assert_eq!(rig.send(req(REQ_PLUG, BASE + 70 * BS, 3)).0, RESP_ACK);
    // A driver reset keeps the blocks plugged.
    w(&mut rig.t, 0x14, 0, 1);
    assert_eq!(rig.t.device().plugged_size(), 3 * BS);
    let saved = rig.t.save().unwrap();
    let host = Arc::new(Mutex::new(Host::default()));
    let dev = Mem::new("mem0", cfg(0), Box::new(FakeBackend(host.clone()))).unwrap();
    let mut t2 = VirtioPciTransport::new("mem0", dev, rig.mem.clone(), shared(&rig.irqs), 2);
    t2.restore(&saved).unwrap();
    assert_eq!((t2.device().plugged_size(), t2.device().requested_size()), (3 * BS, REGION));
    let plugs: Vec<_> = host.lock().unwrap().calls.iter().filter(|c| c.0 == "plug").cloned().collect();
    assert_eq!(plugs, [("plug", 70 * BS, BS), ("plug", 71 * BS, BS), ("plug", 72 * BS, BS)]);
    // Another region's state is refused.
    let other = Mem::new("mem0", MemConfig { addr: BASE * 2, ..cfg(0) }, Box::new(FakeBackend(Arc::default())));
    let mut t3 = VirtioPciTransport::new("mem0", other.unwrap(), rig.mem.clone(), shared(&rig.irqs), 2);
    assert!(t3.restore(&saved).is_err());
}
