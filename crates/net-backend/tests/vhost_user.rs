//! The backend driven by in-process vhost-user frontends (the `vhost` crate's `Frontend`) over
//! its real socket, with memfd guest memory, real eventfds and a datagram socketpair in place of
//! the tap: ownership, handover, refusals, failover and exclusive access under traffic.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kumo_devices::virtio::net::NetBackend;
use kumo_net_backend::backend::FEATURES;
use kumo_net_backend::{HandoverError, Nic, Server};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const MEM_SIZE: u64 = 0x20_0000;
const QSIZE: u16 = 256;
const BUF_LEN: u32 = 2048;
const HDR: usize = 12;
const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0xaa, 0xbb, 0xcc];
const VHOST_F_LOG_ALL: u64 = 1 << 26;

/// The tap stand-in: the backend's end of a datagram socketpair (one datagram = one frame,
/// vnet header first); the test holds the host's end.
struct DgramNet(UnixDatagram);

impl NetBackend for DgramNet {
    fn pairs(&self) -> usize {
        1
    }
    fn recv(&mut self, _: usize, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match self.0.recv(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
    /// Waits while the host side's queue is full (a tap would drop the frame): the tests count
    /// every frame, and the host side always reads on its own thread.
    fn send(&mut self, _: usize, frame: &[u8]) -> io::Result<()> {
        loop {
            match self.0.send(frame) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::yield_now(),
                Err(e) => return Err(e),
            }
        }
    }
    fn fd(&self, _: usize) -> Option<RawFd> {
        Some(self.0.as_raw_fd())
    }
    fn set_offload(&mut self, _: u64) -> io::Result<()> {
        Ok(())
    }
}

struct Setup {
    nic: Arc<Nic>,
    host: UnixDatagram,
    path: PathBuf,
    dir: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(name: &str, auto_own: bool) -> Setup {
    let (host, back) = UnixDatagram::pair().unwrap();
    back.set_nonblocking(true).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    start_with(name, Box::new(DgramNet(back)), "dgram", auto_own, host)
}

fn start_with(name: &str, net: Box<dyn NetBackend>, tap: &str, auto_own: bool, host: UnixDatagram) -> Setup {
    let nic = Arc::new(Nic::new(net, tap, MAC, auto_own));
    let dir = std::env::temp_dir().join(format!("kumo-nb-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vhost.sock");
    let listener = Server::bind(&path).unwrap();
    let server = Server::new(nic.clone());
    thread::spawn(move || server.serve(listener));
    Setup { nic, host, path, dir }
}

/// Polls `f` until it holds; the deadline only turns a hang into a failure.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

fn frame(tag: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HDR];
    f.extend_from_slice(tag);
    f
}

/// One split virtqueue laid out in guest memory, driven like a driver would.
struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    data: u64,
    next_avail: u16,
    last_used: u16,
}

impl Ring {
    fn new(q: u64) -> Self {
        let base = 0x1_0000 * (q + 1);
        Ring {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            data: 0x10_0000 + q * 0x8_0000,
            next_avail: 0,
            last_used: 0,
        }
    }

    fn in_flight(&self) -> u16 {
        self.next_avail.wrapping_sub(self.last_used)
    }

    /// Makes one buffer available (writable for receive); returns its slot.
    fn post(&mut self, mem: &GuestMemoryMmap, bytes: &[u8], writable: bool) -> u16 {
        assert!(self.in_flight() < QSIZE);
        let slot = self.next_avail % QSIZE;
        let addr = self.data + u64::from(slot) * u64::from(BUF_LEN);
        let len = if writable { BUF_LEN } else { bytes.len() as u32 };
        if !writable {
            mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        }
        let d = self.desc + 16 * u64::from(slot);
        mem.write_obj(addr, GuestAddress(d)).unwrap();
        mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        mem.write_obj(if writable { 2u16 } else { 0u16 }, GuestAddress(d + 12)).unwrap();
        mem.write_obj(0u16, GuestAddress(d + 14)).unwrap();
        mem.write_obj(slot, GuestAddress(self.avail + 4 + 2 * u64::from(slot))).unwrap();
        std::sync::atomic::fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(1);
        mem.write_obj(self.next_avail, GuestAddress(self.avail + 2)).unwrap();
        slot
    }

    /// Takes the used buffers: (slot, written length, contents).
    fn reap(&mut self, mem: &GuestMemoryMmap) -> Vec<(u16, u32, Vec<u8>)> {
        std::sync::atomic::fence(Ordering::SeqCst);
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        let mut out = Vec::new();
        while self.last_used != idx {
            let e = self.used + 4 + 8 * u64::from(self.last_used % QSIZE);
            let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = mem.read_obj(GuestAddress(e + 4)).unwrap();
            let mut buf = vec![0u8; len as usize];
            let addr = self.data + u64::from(id) * u64::from(BUF_LEN);
            mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
            out.push((id as u16, len, buf));
            self.last_used = self.last_used.wrapping_add(1);
        }
        out
    }
}

/// The guest side of one VM: memory, eventfds and its two rings.
struct Driver {
    mem: GuestMemoryMmap,
    kick: [EventFd; 2],
    rings: [Ring; 2],
}

impl Driver {
    fn kick(&self, q: usize) {
        self.kick[q].write(1).unwrap();
    }

    /// Keeps every receive slot posted.
    fn fill_rx(&mut self) {
        while self.rings[0].in_flight() < QSIZE {
            self.rings[0].post(&self.mem, &[], true);
        }
        self.kick(0);
    }

    /// Received frames' payloads (vnet header stripped), re-posting their buffers.
    fn received(&mut self) -> Vec<Vec<u8>> {
        let got = self.rings[0].reap(&self.mem);
        let out = got.into_iter().map(|(_, len, b)| b[HDR.min(len as usize)..].to_vec()).collect();
        self.fill_rx();
        out
    }

    fn transmit(&mut self, payload: &[u8]) {
        self.rings[1].post(&self.mem, &frame(payload), false);
        self.kick(1);
    }

    fn tx_done(&mut self) -> usize {
        self.rings[1].reap(&self.mem).len()
    }
}

struct Vm {
    fe: Frontend,
    req: UnixStream,
    acked: u64,
    driver: Arc<Mutex<Driver>>,
    _call: [EventFd; 2],
}

fn memfd(size: u64) -> File {
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"kumo-nb-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: fd is a fresh fd this function owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

/// What a frontend sends to set up a VM's memory and both queues: the memory table, then per
/// queue its size, ring addresses (as the frontend's virtual addresses, as vhost-user wants),
/// base index, call and kick eventfds, and with `enable` VRING_ENABLE.
fn set_up_queues(
    fe: &mut Frontend,
    mem: &GuestMemoryMmap,
    rings: &[Ring; 2],
    bases: [u16; 2],
    call: &[EventFd; 2],
    kick: &[EventFd; 2],
    enable: bool,
) {
    let region = VhostUserMemoryRegionInfo::from_guest_region(mem.iter().next().unwrap()).unwrap();
    fe.set_mem_table(&[region]).unwrap();
    let va = |gpa: u64| mem.get_host_address(GuestAddress(gpa)).unwrap() as u64;
    for (q, r) in rings.iter().enumerate() {
        fe.set_vring_num(q, QSIZE).unwrap();
        let cfg = VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: va(r.desc),
            used_ring_addr: va(r.used),
            avail_ring_addr: va(r.avail),
            log_addr: None,
        };
        fe.set_vring_addr(q, &cfg).unwrap();
        fe.set_vring_base(q, bases[q]).unwrap();
        fe.set_vring_call(q, &call[q]).unwrap();
        fe.set_vring_kick(q, &kick[q]).unwrap();
        if enable {
            fe.set_vring_enable(q, true).unwrap();
        }
    }
}

impl Vm {
    /// Connects only (no feature negotiation, no queues): a VM that is not ready.
    fn connect(s: &Setup) -> Frontend {
        Frontend::connect(&s.path, 2).unwrap()
    }

    /// Connects and does what a driver does up to DRIVER_OK: features, memory, both queues
    /// started and enabled, receive buffers posted.
    fn start(s: &Setup) -> Vm {
        let mut fe = Self::connect(s);
        fe.set_owner().unwrap();
        let offered = fe.get_features().unwrap();
        assert_eq!(offered, FEATURES);
        let acked = offered & !VHOST_F_LOG_ALL;
        fe.set_features(acked).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::BACKEND_REQ));
        fe.set_protocol_features(pf).unwrap();
        let (req, theirs) = UnixStream::pair().unwrap();
        req.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        fe.set_backend_request_fd(&theirs).unwrap();

        let file = memfd(MEM_SIZE);
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
            GuestAddress(0),
            MEM_SIZE as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap();
        let kick = [EventFd::new(0).unwrap(), EventFd::new(0).unwrap()];
        let call = [EventFd::new(0).unwrap(), EventFd::new(0).unwrap()];
        let rings = [Ring::new(0), Ring::new(1)];
        set_up_queues(&mut fe, &mem, &rings, [0, 0], &call, &kick, false);
        let mut driver = Driver { mem, kick, rings };
        driver.fill_rx();
        for q in 0..2 {
            fe.set_vring_enable(q, true).unwrap();
        }
        Vm { fe, req, acked, driver: Arc::new(Mutex::new(driver)), _call: call }
    }

    fn link(&mut self) -> bool {
        let (_, cfg) = self.fe.get_config(0, 10, VhostUserConfigFlags::empty(), &[0u8; 10]).unwrap();
        assert_eq!(&cfg[..6], &MAC);
        u16::from_le_bytes([cfg[6], cfg[7]]) & 1 == 1
    }

    /// Waits for one VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend-request channel.
    fn expect_config_change(&mut self) {
        let mut hdr = [0u8; 12];
        self.req.read_exact(&mut hdr).expect("a config-change message");
        assert_eq!(u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]), 2, "CONFIG_CHANGE_MSG");
        assert_eq!(u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]), 0, "no payload");
    }

    fn received(&self) -> Vec<Vec<u8>> {
        self.driver.lock().unwrap().received()
    }
}

fn ready(nic: &Nic, id: u32) -> bool {
    nic.info().clients.iter().any(|c| c.id == id && c.ready)
}

fn host_recv(s: &Setup) -> Vec<u8> {
    let mut buf = vec![0u8; 4096];
    let n = s.host.recv(&mut buf).expect("a frame on the tap side");
    buf[HDR..n].to_vec()
}

/// Waits until `vm` received one frame and returns its payload.
fn one_frame(vm: &Vm) -> Vec<u8> {
    let mut got = Vec::new();
    wait_until("the VM receives a frame", || {
        got.extend(vm.received());
        !got.is_empty()
    });
    assert_eq!(got.len(), 1, "exactly one frame");
    got.remove(0)
}

#[test]
fn handover_moves_traffic_and_link() {
    let s = start("handover", true);
    let mut a = Vm::start(&s);
    wait_until("A owns the NIC", || s.nic.owner() == Some(1));
    a.expect_config_change();
    assert!(a.link());
    let mut b = Vm::start(&s);
    wait_until("B is ready", || ready(&s.nic, 2));
    assert!(!b.link(), "B sees link down");
    assert_eq!(s.nic.owner(), Some(1));

    // Traffic goes to and from A only.
    s.host.send(&frame(b"to-a")).unwrap();
    assert_eq!(one_frame(&a), b"to-a");
    a.driver.lock().unwrap().transmit(b"from-a");
    assert_eq!(host_recv(&s), b"from-a");
    wait_until("A's transmit completes", || a.driver.lock().unwrap().tx_done() == 1);
    assert!(b.received().is_empty());

    let r = s.nic.handover(2, Duration::ZERO).unwrap();
    assert_eq!((r.from, r.to), (Some(1), 2));
    b.expect_config_change();
    a.expect_config_change();
    assert!(b.link() && !a.link());
    s.host.send(&frame(b"to-b")).unwrap();
    assert_eq!(one_frame(&b), b"to-b");
    assert!(a.received().is_empty());
    b.driver.lock().unwrap().transmit(b"from-b");
    assert_eq!(host_recv(&s), b"from-b");
    let last = s.nic.info().last_handover.unwrap();
    assert!(last.outage_us.is_some(), "the first buffer served to B closes the outage");

    // A's kicks are ignored now: its transmit waits in its ring.
    a.driver.lock().unwrap().transmit(b"a-while-down");
    s.host.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let _ = s.host.recv(&mut buf).map(|n| assert_ne!(&buf[HDR..n], b"a-while-down"));
    s.host.set_nonblocking(false).unwrap();

    // Refusals leave B the owner: an unknown client, one that is not ready, one migrating.
    let _c = Vm::connect(&s);
    wait_until("C is known", || s.nic.info().clients.iter().any(|c| c.id == 3));
    assert_eq!(s.nic.handover(7, Duration::ZERO), Err(HandoverError::Unknown(7)));
    assert!(matches!(s.nic.handover(3, Duration::ZERO), Err(HandoverError::NotReady(_))));
    a.fe.set_features(a.acked | VHOST_F_LOG_ALL).unwrap();
    wait_until("A shows as migrating", || s.nic.info().clients.iter().any(|c| c.id == 1 && c.migrating));
    assert!(matches!(s.nic.handover(1, Duration::ZERO), Err(HandoverError::Migrating(_))));
    assert_eq!(s.nic.owner(), Some(2));
    s.host.send(&frame(b"still-b")).unwrap();
    assert_eq!(one_frame(&b), b"still-b");

    // Once A stops migrating it can take the NIC back, and its held transmit goes out then.
    a.fe.set_features(a.acked).unwrap();
    wait_until("A is ready again", || ready(&s.nic, 1));
    s.nic.handover(1, Duration::ZERO).unwrap();
    assert_eq!(host_recv(&s), b"a-while-down");
    assert_eq!(s.nic.max_in_flight(), 1);
    assert_eq!(s.nic.foreign_serves(), 0);
}

/// Dirty logging (LOG_SHMFD, SET_LOG_BASE, LOG_ALL): every page the backend writes while the
/// log is on has its bit set — the receive buffer and both used rings — and no page it only
/// reads; GET_VRING_BASE answers where the ring stopped, and a new connection (the migrated
/// VM) starting there with SET_VRING_BASE takes the NIC and goes on from that point.
#[test]
fn the_backend_logs_its_writes_and_its_nic_follows_a_migrated_vm() {
    let s = start("dirty-log", true);
    let a = Vm::start(&s);
    wait_until("A owns the NIC", || s.nic.owner() == Some(1));
    // Traffic before logging: nothing is logged.
    s.host.send(&frame(b"before")).unwrap();
    assert_eq!(one_frame(&a), b"before");

    let log = memfd(MEM_SIZE / 4096 / 8);
    let region =
        VhostUserDirtyLogRegion { mmap_size: MEM_SIZE / 4096 / 8, mmap_offset: 0, mmap_handle: log.as_raw_fd() };
    a.fe.set_log_base(0, Some(region)).unwrap();
    a.fe.set_features(a.acked | VHOST_F_LOG_ALL).unwrap();
    let bits = || {
        let mut b = vec![0u8; (MEM_SIZE / 4096 / 8) as usize];
        std::os::unix::fs::FileExt::read_exact_at(&log, &mut b, 0).unwrap();
        (0..MEM_SIZE / 4096).filter(|&p| b[(p / 8) as usize] & (1 << (p % 8)) != 0).collect::<BTreeSet<u64>>()
    };
    assert!(bits().is_empty(), "{:x?}", bits());
    s.host.send(&frame(b"logged")).unwrap();
    assert_eq!(one_frame(&a), b"logged");
    a.driver.lock().unwrap().transmit(b"out");
    assert_eq!(host_recv(&s), b"out");
    wait_until("A's transmit completes", || a.driver.lock().unwrap().tx_done() == 1);
    let (rx, tx) = (Ring::new(0), Ring::new(1));
    // The second receive buffer (slot 1) took the frame.
    let want: BTreeSet<u64> = [rx.used / 4096, tx.used / 4096, (rx.data + u64::from(BUF_LEN)) / 4096].into();
    assert_eq!(bits(), want, "logged pages (page numbers)");

    // The stop phase: A stops its rings where they are.
    let base_rx = a.fe.get_vring_base(0).unwrap();
    let base_tx = a.fe.get_vring_base(1).unwrap();
    assert_eq!((base_rx, base_tx), (2, 1));
    // Stopped: a frame now waits in the backend for the migrated VM.
    s.host.send(&frame(b"waits")).unwrap();
    // The migrated VM: a new connection on the same memory, rings started at those indices.
    let mut fe = Vm::connect(&s);
    fe.set_owner().unwrap();
    fe.get_features().unwrap();
    fe.set_features(a.acked).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(pf).unwrap();
    let d = a.driver.lock().unwrap();
    let call = [EventFd::new(0).unwrap(), EventFd::new(0).unwrap()];
    set_up_queues(&mut fe, &d.mem, &d.rings, [base_rx as u16, base_tx as u16], &call, &d.kick, true);
    d.kick(0);
    drop(d);
    wait_until("the migrated VM owns the NIC", || s.nic.owner() == Some(2));
    assert_eq!(one_frame(&a), b"waits", "the frame went on where the rings stopped");
    let last = s.nic.info().last_handover.unwrap();
    assert_eq!((last.from, last.to), (Some(1), 2));
    drop(fe);
}

#[test]
fn failover_when_the_owner_hangs_up() {
    // Manual: the NIC stays unowned until a handover.
    let s = start("failover-manual", false);
    let a = Vm::start(&s);
    let mut b = Vm::start(&s);
    wait_until("A and B are ready", || ready(&s.nic, 1) && ready(&s.nic, 2));
    assert_eq!(s.nic.owner(), None);
    s.nic.handover(1, Duration::ZERO).unwrap();
    drop(a);
    wait_until("A is gone", || s.nic.info().clients.len() == 1);
    assert_eq!(s.nic.owner(), None, "the NIC is unowned once its owner hangs up");
    s.nic.handover(2, Duration::ZERO).unwrap();
    b.expect_config_change();
    assert!(b.link());
    s.host.send(&frame(b"to-b")).unwrap();
    assert_eq!(one_frame(&b), b"to-b");

    // Automatic: the next ready client takes it at once.
    let s = start("failover-auto", true);
    let mut a = Vm::start(&s);
    wait_until("A owns the NIC", || s.nic.owner() == Some(1));
    a.expect_config_change();
    let mut b = Vm::start(&s);
    wait_until("B is ready", || ready(&s.nic, 2));
    drop(a);
    wait_until("B owns the NIC", || s.nic.owner() == Some(2));
    b.expect_config_change();
    assert!(b.link());
    s.host.send(&frame(b"after-failover")).unwrap();
    assert_eq!(one_frame(&b), b"after-failover");
}

/// Both VMs transmit and receive nonstop while the NIC goes back and forth between them: no
/// two clients' queues are ever processed at once, no frame is lost or duplicated, and every
/// frame a VM transmits leaves through the tap exactly once.
#[test]
fn exclusive_access_under_concurrent_handovers() {
    const FRAMES: u32 = 3000;
    const TX_EACH: u32 = 400;
    const HANDOVERS: u32 = 100;
    let s = start("exclusive", false);
    let vms = [Vm::start(&s), Vm::start(&s)];
    wait_until("both ready", || ready(&s.nic, 1) && ready(&s.nic, 2));
    s.nic.handover(1, Duration::ZERO).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let got: Arc<Mutex<Vec<u32>>> = Arc::default();
    let completed = Arc::new(AtomicUsize::new(0));
    let mut drivers = Vec::new();
    for (i, vm) in vms.iter().enumerate() {
        let (d, stop, got, completed) = (vm.driver.clone(), stop.clone(), got.clone(), completed.clone());
        drivers.push(thread::spawn(move || {
            let mut sent = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let mut d = d.lock().unwrap();
                for p in d.received() {
                    got.lock().unwrap().push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
                }
                completed.fetch_add(d.tx_done(), Ordering::SeqCst);
                if sent < TX_EACH && d.rings[1].in_flight() < QSIZE {
                    let mut p = vec![i as u8];
                    p.extend_from_slice(&sent.to_le_bytes());
                    d.transmit(&p);
                    sent += 1;
                }
                drop(d);
                thread::yield_now();
            }
        }));
    }
    // One file description for both ends' users: nonblocking, so the collector below can keep
    // the NIC moving while nothing arrives.
    s.host.set_nonblocking(true).unwrap();
    let host = s.host.try_clone().unwrap();
    let sender = thread::spawn(move || {
        for seq in 0..FRAMES {
            let mut p = seq.to_le_bytes().to_vec();
            p.resize(1024, 0xab);
            let f = frame(&p);
            loop {
                match host.send(&f) {
                    Ok(_) => break,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::yield_now(),
                    Err(e) => panic!("host send: {e}"),
                }
            }
        }
    });
    let nic = s.nic.clone();
    let switcher = thread::spawn(move || {
        for k in 0..HANDOVERS {
            nic.handover(if k % 2 == 0 { 2 } else { 1 }, Duration::ZERO).unwrap();
            thread::yield_now();
        }
    });
    // The tap side collects what the VMs transmit (its own thread: a full socket would drop
    // frames, as a full tap does, so it never waits on anything else).
    let out: Arc<Mutex<BTreeSet<(u8, u32)>>> = Arc::default();
    let collector = {
        let (host, out, stop) = (s.host.try_clone().unwrap(), out.clone(), stop.clone());
        thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while !stop.load(Ordering::SeqCst) {
                match host.recv(&mut buf) {
                    Ok(n) => {
                        let p = &buf[HDR..n];
                        let new = out.lock().unwrap().insert((p[0], u32::from_le_bytes([p[1], p[2], p[3], p[4]])));
                        assert!(new, "a frame went out twice");
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::yield_now(),
                    Err(e) => panic!("host recv: {e}"),
                }
            }
        })
    };
    // A non-owner's transmits wait for its turn, so once the switcher is done the NIC keeps
    // moving until everything is out.
    switcher.join().unwrap();
    let mut k = 0u64;
    wait_until("every transmit reaches the tap", || {
        k += 1;
        if k == 50 {
            k = 0;
            let next = if s.nic.owner() == Some(1) { 2 } else { 1 };
            s.nic.handover(next, Duration::ZERO).unwrap();
        }
        out.lock().unwrap().len() == 2 * TX_EACH as usize
    });
    wait_until("the sender is done", || sender.is_finished());
    sender.join().unwrap();
    wait_until("every frame reached a VM", || got.lock().unwrap().len() >= FRAMES as usize);
    wait_until("every transmit completes to its VM", || completed.load(Ordering::SeqCst) >= 2 * TX_EACH as usize);
    stop.store(true, Ordering::SeqCst);
    for d in drivers {
        d.join().unwrap();
    }
    collector.join().unwrap();
    assert_eq!(completed.load(Ordering::SeqCst), 2 * TX_EACH as usize);

    let mut seqs = got.lock().unwrap().clone();
    seqs.sort_unstable();
    assert_eq!(seqs, (0..FRAMES).collect::<Vec<_>>(), "each frame reaches exactly one VM once");
    assert_eq!(s.nic.max_in_flight(), 1, "two queue-processing sections overlapped");
    assert_eq!(s.nic.foreign_serves(), 0, "a non-owner's queues were processed");
    let info = s.nic.info();
    assert!(info.handovers > u64::from(HANDOVERS));
    let rx: u64 = info.clients.iter().map(|c| c.rx_packets).sum();
    assert_eq!(rx, u64::from(FRAMES));
}

/// A raw packet socket on the tap's host side, for one EtherType.
struct HostLink {
    fd: std::os::fd::OwnedFd,
    ifindex: i32,
}

const ETHERTYPE: u16 = 0x88b5; // IEEE local experimental

impl HostLink {
    fn open(ifname: &str) -> io::Result<Self> {
        let name = std::ffi::CString::new(ifname).map_err(io::Error::other)?;
        // SAFETY: if_nametoindex reads a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        if ifindex == 0 {
            return Err(io::Error::last_os_error());
        }
        let proto = ETHERTYPE.to_be();
        // SAFETY: socket() with constant arguments; returns a new fd or -1.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh fd we own.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex;
        // SAFETY: bind reads one sockaddr_ll of the size given.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let tv = libc::timeval { tv_sec: 10, tv_usec: 0 };
        // SAFETY: SO_RCVTIMEO reads one timeval.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        Ok(HostLink { fd, ifindex })
    }

    /// Sends an Ethernet frame to the guest's MAC with `payload`.
    fn send(&self, payload: &[u8]) {
        let mut f = MAC.to_vec();
        f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
        f.extend_from_slice(&ETHERTYPE.to_be_bytes());
        f.extend_from_slice(payload);
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&MAC);
        // SAFETY: sendto reads `f` and one sockaddr_ll of the sizes given.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                f.as_ptr() as *const libc::c_void,
                f.len(),
                0,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, f.len() as isize, "packet send: {}", io::Error::last_os_error());
    }

    /// The payload of the next frame of our EtherType the interface received.
    fn recv(&self) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: recv writes at most buf.len() bytes into buf.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        assert!(n >= 14, "packet recv: {}", io::Error::last_os_error());
        buf[14..n as usize].to_vec()
    }
}

/// A guest frame (vnet header stripped) of our EtherType, or None for other traffic (the
/// kernel's own IPv6 chatter on a fresh interface).
fn ours(f: &[u8]) -> Option<Vec<u8>> {
    (f.len() >= 14 && f[12..14] == ETHERTYPE.to_be_bytes()).then(|| f[14..].to_vec())
}

fn eth(payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 0x99];
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn wait_ours(vm: &Vm, want: &[u8]) {
    wait_until("the VM receives our frame", || {
        vm.received().iter().filter_map(|f| ours(f)).any(|p| p.starts_with(want))
    });
}

/// The same over a real tap (root): frames from the host side reach the owner only, and the
/// owner's frames reach the host, before and after a handover.
#[test]
fn real_tap_handover() {
    let name = format!("kumonb{}", std::process::id() % 100_000);
    let tap = match kumo_devices::virtio::net::tap::Tap::open(&name, 1) {
        Ok(t) => t,
        Err(e) => {
            println!("skipping real_tap_handover: no tap ({e})");
            return;
        }
    };
    let up = std::process::Command::new("ip").args(["link", "set", "dev", &name, "up"]).status();
    if !matches!(up, Ok(s) if s.success()) {
        println!("skipping real_tap_handover: cannot bring {name} up");
        return;
    }
    let link = match HostLink::open(&name) {
        Ok(l) => l,
        Err(e) => {
            println!("skipping real_tap_handover: no packet socket ({e})");
            return;
        }
    };
    let (unused, _) = UnixDatagram::pair().unwrap();
    let s = start_with("tap", Box::new(tap), &name, true, unused);
    let mut a = Vm::start(&s);
    wait_until("A owns the NIC", || s.nic.owner() == Some(1));
    a.expect_config_change();
    let mut b = Vm::start(&s);
    wait_until("B is ready", || ready(&s.nic, 2));

    link.send(b"to-a");
    wait_ours(&a, b"to-a");
    a.driver.lock().unwrap().transmit(&eth(b"from-a"));
    assert!(link.recv().starts_with(b"from-a"));

    s.nic.handover(2, Duration::ZERO).unwrap();
    b.expect_config_change();
    assert!(b.link() && !a.link());
    link.send(b"to-b");
    wait_ours(&b, b"to-b");
    b.driver.lock().unwrap().transmit(&eth(b"from-b"));
    assert!(link.recv().starts_with(b"from-b"));
    assert!(a.received().iter().filter_map(|f| ours(f)).all(|p| !p.starts_with(b"to-b")));
}
