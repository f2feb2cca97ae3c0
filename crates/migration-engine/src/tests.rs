//! Engine tests without KVM: a fake VM whose "guest" is a thread writing pages (and tracking
//! what it dirtied, as KVM's dirty log would), migrated into a fake destination; afterwards the
//! two memories must be identical, whatever the engine, connection count or timing.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kumo_migration::format::VmDescription;
use kumo_migration::planner::{StopPolicy, XenRule};
use kumo_migration::PageBitmap;
use kumo_vm::{GuestMemory, Memory};
use vm_memory::{Bytes, GuestAddress};

use kumo_migration::format::{Encoder, Reply};

use crate::destination::*;
use crate::session::*;
use crate::source::*;
use crate::transport::{Address, Conn, Listener};

const MEM: u64 = 16 << 20;
const PAGES: u64 = MEM / 4096;

struct FakeSource {
    mem: Arc<Memory>,
    dirty: Arc<Mutex<Option<PageBitmap>>>,
    running: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    writer: Mutex<Option<JoinHandle<()>>>,
    writes: Arc<AtomicU64>,
    resumed: AtomicU64,
}

fn regions() -> Vec<(u64, u64)> {
    vec![(0, MEM)]
}

impl FakeSource {
    /// Memory with a recognizable pattern in the first 1,000 pages, and a writer that keeps
    /// rewriting random pages among the first `hot` while running.
    fn new(hot: u64) -> Arc<FakeSource> {
        let mem = Arc::new(Memory::new(MEM).unwrap());
        for p in 0..1000u64 {
            mem.guest.write_obj(p * 31 + 7, GuestAddress(p * 4096 + 8)).unwrap();
        }
        let s = Arc::new(FakeSource {
            mem,
            dirty: Arc::new(Mutex::new(None)),
            running: Arc::new(AtomicBool::new(true)),
            stop: Arc::new(AtomicBool::new(false)),
            writer: Mutex::new(None),
            writes: Arc::new(AtomicU64::new(0)),
            resumed: AtomicU64::new(0),
        });
        let (mem, dirty, running, stop, writes) =
            (s.mem.clone(), s.dirty.clone(), s.running.clone(), s.stop.clone(), s.writes.clone());
        *s.writer.lock().unwrap() = Some(std::thread::spawn(move || {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            while !stop.load(Ordering::Acquire) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let page = x % hot;
                // Check `running`, write and mark dirty under one lock, as KVM's write protection
                // and a real pause (all vCPUs parked) make them atomic with respect to
                // `fetch_dirty` and `pause`: otherwise a fetch could clear the bit between mark
                // and write, or a write could land after the final fetch of a paused VM.
                {
                    let mut d = dirty.lock().unwrap();
                    if !running.load(Ordering::Acquire) {
                        drop(d);
                        std::thread::sleep(Duration::from_micros(200));
                        continue;
                    }
                    mem.guest.write_obj(x, GuestAddress(page * 4096 + (x % 512) * 8)).unwrap();
                    if let Some(d) = d.as_mut() {
                        d.set(page);
                    }
                }
                writes.fetch_add(1, Ordering::Relaxed);
                if x.is_multiple_of(64) {
                    std::thread::yield_now();
                }
            }
        }));
        s
    }

    fn stop_writer(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.writer.lock().unwrap().take() {
            h.join().unwrap();
        }
    }
}

impl SourceVm for FakeSource {
    fn description(&self) -> VmDescription {
        VmDescription::new(
            1,
            kumo_migration::format::Irqchip::Kernel,
            kumo_migration::format::PayloadDescription::guest("test"),
            regions(),
        )
    }
    fn memory(&self) -> &GuestMemory {
        &self.mem.guest
    }
    fn memfd(&self) -> BorrowedFd<'_> {
        self.mem.memfd.as_fd()
    }
    fn start_dirty_log(&self) -> Result<(), VmError> {
        *self.dirty.lock().unwrap() = Some(PageBitmap::for_regions(&regions()));
        Ok(())
    }
    fn stop_dirty_log(&self) {
        *self.dirty.lock().unwrap() = None;
    }
    fn first_round_pages(&self) -> Result<PageBitmap, VmError> {
        let mut b = PageBitmap::for_regions(&regions());
        for p in 0..PAGES {
            b.set(p);
        }
        Ok(b)
    }
    fn rearm_dirty(&self, _gfns: &[u64]) -> Result<(), VmError> {
        // This fake's harvest re-arms as it reads (as KVM does without manual protection).
        Ok(())
    }
    fn harvest_dirty(&self, into: &mut PageBitmap) -> Result<u64, VmError> {
        let mut d = self.dirty.lock().unwrap();
        let d = d.as_mut().ok_or_else(|| VmError::new(VmOp::FetchDirty, "dirty log not started"))?;
        let n = d.count();
        into.union(d);
        d.clear();
        Ok(n)
    }
    fn pause(&self) -> Result<(), VmError> {
        // Under the writer's lock: once this returns, no write is in flight.
        let _guard = self.dirty.lock().unwrap();
        self.running.store(false, Ordering::Release);
        Ok(())
    }
    fn resume(&self) -> Result<(), VmError> {
        self.resumed.fetch_add(1, Ordering::Relaxed);
        self.running.store(true, Ordering::Release);
        Ok(())
    }
    fn save_state(&self) -> Result<Vec<u8>, VmError> {
        Ok(b"vcpu state".to_vec())
    }
}

struct FakeDest {
    mem: Memory,
    state: Mutex<Vec<u8>>,
    running: AtomicBool,
}

impl DestVm for FakeDest {
    fn memory(&self) -> &GuestMemory {
        &self.mem.guest
    }
    fn restore_state(&self, state: &[u8]) -> Result<(), VmError> {
        *self.state.lock().unwrap() = state.to_vec();
        Ok(())
    }
    fn resume(&self) -> Result<(), VmError> {
        self.running.store(true, Ordering::Release);
        Ok(())
    }
}

fn make_dest(desc: &VmDescription, memfd: Option<File>) -> Result<FakeDest, VmError> {
    let create = |e| VmError::new(VmOp::Create, e);
    let mem = match memfd {
        Some(f) => Memory::from_file(f, desc.memory_bytes).map_err(create)?,
        None => Memory::new(desc.memory_bytes).map_err(create)?,
    };
    Ok(FakeDest { mem, state: Mutex::new(Vec::new()), running: AtomicBool::new(false) })
}

fn read_all(m: &GuestMemory) -> Vec<u8> {
    let mut v = vec![0u8; MEM as usize];
    m.read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn listen(unix: bool, tag: &str) -> (Listener, Address) {
    let addr = if unix {
        Address::Unix(std::env::temp_dir().join(format!("kumo-mig-{}-{tag}.sock", std::process::id())))
    } else {
        Address::Tcp("127.0.0.1:0".into())
    };
    let l = Listener::bind(&addr).unwrap();
    let a = l.local_addr();
    (l, a)
}

fn run(engine: MigrationEngine, connections: usize, unix: bool, tag: &str) -> (Report, RecvReport) {
    run_with(engine, connections, unix, tag, None, None)
}

/// Test certificates: a destination's listener options and a source's TLS, one CA.
fn tls_pair(tag: &str) -> (crate::ListenOptions, crate::ClientTls) {
    let pki = crate::tls::tests::TestPki::new("kumo test CA");
    let d = crate::tls::tests::temp_dir(tag);
    pki.write_dir(&d.join("dst"), &["localhost", "127.0.0.1"]);
    pki.write_dir(&d.join("src"), &["source"]);
    let server = crate::ServerTls::from_dir(&d.join("dst")).unwrap();
    let client = crate::ClientTls::from_dir(&d.join("src"), None).unwrap();
    (crate::ListenOptions { tls: Some(server), insecure: false }, client)
}

/// `run` over TLS and/or under a bandwidth cap (bytes per second).
fn run_with(
    engine: MigrationEngine,
    connections: usize,
    unix: bool,
    tag: &str,
    tls: Option<(crate::ListenOptions, crate::ClientTls)>,
    max_bandwidth: Option<u64>,
) -> (Report, RecvReport) {
    let src = FakeSource::new(2000);
    std::thread::sleep(Duration::from_millis(20));
    let (l, addr) = match &tls {
        Some((lo, _)) => {
            let l = Listener::bind_with(&Address::Tcp("127.0.0.1:0".into()), lo).unwrap();
            let a = l.local_addr();
            (l, a)
        }
        None => listen(unix, tag),
    };
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest));
    let opts = MigrateOptions { engine, connections, tls: tls.map(|t| t.1), max_bandwidth, ..Default::default() };
    let mut events = Vec::new();
    let report = migrate(&*src, &addr, &opts, &mut |e| events.push(e)).unwrap();
    let (dvm, rr) = dest.join().unwrap().unwrap();
    // The source stays paused after a successful migration; stop its writer and compare.
    src.stop_writer();
    assert!(src.writes.load(Ordering::Relaxed) > 0, "the guest wrote during migration");
    let (a, b) = (read_all(&src.mem.guest), read_all(&dvm.mem.guest));
    if let Some(off) = a.iter().zip(&b).position(|(x, y)| x != y) {
        panic!("{engine} x{connections}: memories differ first at {off:#x} (page {:#x})", off / 4096);
    }
    assert_eq!(&*dvm.state.lock().unwrap(), b"vcpu state");
    assert!(dvm.running.load(Ordering::Acquire));
    assert_eq!(src.resumed.load(Ordering::Relaxed), 0, "a successful migration leaves the source paused");
    assert!(matches!(events.first(), Some(Event::Started { .. })), "{events:?}");
    assert!(matches!(events.last(), Some(Event::Completed { .. })), "{events:?}");
    (report, rr)
}

#[test]
fn serial_engine_moves_memory_exactly() {
    let (r, rr) = run(MigrationEngine::Serial, 1, false, "serial");
    assert!(r.rounds.len() >= 2, "a live round and the final one: {:?}", r.rounds);
    assert_eq!(r.rounds[0].pages, PAGES, "round 0 sends every touched page");
    assert_eq!(rr.pages, r.total_pages);
    // The paper's baseline acknowledges every batch of data: no zero runs.
    assert_eq!(r.zero_pages, 0);
    assert_eq!(r.bytes, r.total_pages * 4096 + b"vcpu state".len() as u64);
}

/// The fake guest writes only its first 2,000 pages: the other 2,096 of round 0 hold zeros.
fn assert_zero_pages_went_as_runs(r: &Report) {
    let zero_round0 = r.rounds[0].zero_pages;
    assert!(zero_round0 >= PAGES - 2000, "round 0's zero pages: {:?}", r.rounds[0]);
    assert_eq!(r.zero_pages, r.rounds.iter().map(|x| x.zero_pages).sum::<u64>());
    assert_eq!(r.bytes, (r.total_pages - r.zero_pages) * 4096 + b"vcpu state".len() as u64);
}

#[test]
fn the_pipelined_engines_send_zero_pages_as_runs() {
    for (engine, n) in [(MigrationEngine::Overlap, 2), (MigrationEngine::Zerocopy, 1)] {
        let (r, rr) = run(engine, n, false, &format!("zero-{engine}"));
        assert_zero_pages_went_as_runs(&r);
        assert_eq!(rr.pages, r.total_pages, "the destination counts zero pages as received");
    }
}

/// Under a bandwidth cap the collector finds the zero pages (it pays for data only) and hands
/// the answer to the senders: memory still arrives exactly (`run_with` compares it), the zeros as
/// runs; serial still sends every page with its data.
#[test]
fn a_capped_migration_sends_zero_pages_as_runs_and_memory_exactly() {
    let cap = Some(256_000_000);
    for (engine, n) in [(MigrationEngine::Overlap, 2), (MigrationEngine::Zerocopy, 2)] {
        let (r, rr) = run_with(engine, n, false, &format!("cap-{engine}"), None, cap);
        assert_zero_pages_went_as_runs(&r);
        assert_eq!(rr.pages, r.total_pages);
    }
    let (r, _) = run_with(MigrationEngine::Serial, 1, false, "cap-serial", None, cap);
    assert_eq!(r.zero_pages, 0);
}

#[test]
fn a_zero_page_clears_what_an_earlier_round_placed() {
    use kumo_migration::format::{ReplyReader, Writer};
    let (l, addr) = listen(false, "zero-clear");
    let t = std::thread::spawn(move || receive(&l, Duration::from_secs(10), make_dest));
    let mut c = Conn::connect(&addr, Duration::from_secs(5)).unwrap();
    let desc = FakeSource::new(1);
    desc.stop_writer();
    kumo_migration::format::write_header(&mut c, &desc.description()).unwrap();
    let mut replies = ReplyReader::new(c.try_clone().unwrap());
    assert_eq!(replies.next_reply().unwrap(), Reply::Accepted);
    assert_eq!(replies.next_reply().unwrap(), Reply::Ready);
    let page = |b: u8| vec![b; 4096];
    let mut w = Writer::new(c);
    // Round 0: data in pages 5 and 6, zeros in 7..10. Round 1: page 5 is zero now, 7 has data.
    w.mem_batch(0, &[5, 6], &[page(0xa5), page(0xa6)].concat()).unwrap();
    w.zero_pages(0, &[(7, 3)]).unwrap();
    w.round_end(0, 5).unwrap();
    w.zero_pages(1, &[(5, 1)]).unwrap();
    w.mem_batch(1, &[7], &page(0xa7)).unwrap();
    w.round_end(1, 2).unwrap();
    w.state(b"vcpu state").unwrap();
    w.complete(7).unwrap();
    assert_eq!(replies.next_reply().unwrap(), Reply::Resumed);
    let (dvm, rr) = t.join().unwrap().unwrap();
    assert_eq!(rr.pages, 7);
    let m = read_all(&dvm.mem.guest);
    let at = |gfn: usize| &m[gfn * 4096..(gfn + 1) * 4096];
    assert_eq!(at(5), &page(0)[..], "round 1's zero page cleared round 0's data");
    assert_eq!((at(6), at(7), at(8)), (&page(0xa6)[..], &page(0xa7)[..], &page(0)[..]));
}

#[test]
fn overlap_engine_with_one_and_three_connections() {
    run(MigrationEngine::Overlap, 1, false, "ov1");
    let (r, rr) = run(MigrationEngine::Overlap, 3, false, "ov3");
    assert_eq!((r.connections, rr.connections), (3, 3));
}

#[test]
fn tls_migrations_with_the_stream_engines() {
    for (engine, n) in [(MigrationEngine::Serial, 1), (MigrationEngine::Overlap, 1), (MigrationEngine::Overlap, 2)] {
        let (r, rr) = run_with(
            engine,
            n,
            false,
            &format!("tls-{engine}-{n}"),
            Some(tls_pair(&format!("eng-{engine}-{n}"))),
            None,
        );
        assert_eq!(rr.pages, r.total_pages);
    }
}

#[test]
fn zerocopy_and_local_are_refused_under_tls() {
    let src = FakeSource::new(1);
    let (_, client) = tls_pair("refused");
    let opts = MigrateOptions { engine: MigrationEngine::Zerocopy, tls: Some(client.clone()), ..Default::default() };
    let e = migrate(&*src, &Address::Tcp("127.0.0.1:9".into()), &opts, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("zerocopy engine") && e.contains("cannot run over TLS"), "{e}");
    let opts = MigrateOptions { engine: MigrationEngine::Local, tls: Some(client), ..Default::default() };
    let e = migrate(&*src, &Address::Unix("/nowhere.sock".into()), &opts, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("TLS is for tcp:"), "{e}");
    src.stop_writer();
}

#[test]
fn zerocopy_engine_with_one_and_two_connections() {
    run(MigrationEngine::Zerocopy, 1, false, "zc1");
    let (r, _) = run(MigrationEngine::Zerocopy, 2, false, "zc2");
    assert_zero_pages_went_as_runs(&r);
}

#[test]
fn engines_work_over_unix_sockets_too() {
    run(MigrationEngine::Overlap, 2, true, "unix-ov");
    // Spliced pages; no MSG_ZEROCOPY completions to wait for.
    run(MigrationEngine::Zerocopy, 2, true, "unix-zc");
}

#[test]
fn local_engine_shares_memory_instead_of_sending_it() {
    let (r, rr) = run(MigrationEngine::Local, 1, true, "local");
    assert_eq!(r.total_pages, 0);
    assert!(rr.shared_memory);
}

#[test]
fn local_engine_needs_a_unix_socket() {
    let src = FakeSource::new(10);
    let (l, addr) = listen(false, "local-tcp");
    let _dest = std::thread::spawn(move || receive(&l, Duration::from_secs(5), make_dest));
    let e =
        migrate(&*src, &addr, &MigrateOptions { engine: MigrationEngine::Local, ..Default::default() }, &mut |_| {})
            .unwrap_err();
    assert!(e.to_string().contains("unix socket"), "{e}");
    src.stop_writer();
}

#[test]
fn downtime_rule_stops_when_the_rest_fits_the_target() {
    let src = FakeSource::new(20);
    let (l, addr) = listen(false, "downtime");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest));
    let policy = StopPolicy { xen: None, downtime: Some(Duration::from_millis(50)), ..Default::default() };
    let r = migrate(&*src, &addr, &MigrateOptions { policy, ..Default::default() }, &mut |_| {}).unwrap();
    assert!(r.stop_reason.contains("downtime target met"), "{}", r.stop_reason);
    dest.join().unwrap().unwrap();
    src.stop_writer();
}

#[test]
fn a_destination_that_refuses_leaves_the_source_running() {
    let src = FakeSource::new(100);
    let (l, addr) = listen(false, "refuse");
    let dest = std::thread::spawn(move || {
        receive(&l, Duration::from_secs(5), |_, _| Err::<FakeDest, _>(VmError::new(VmOp::Create, "no room here")))
    });
    let e = migrate(&*src, &addr, &MigrateOptions::default(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("no room here"), "{e}");
    assert!(dest.join().unwrap().is_err());
    assert!(src.running.load(Ordering::Acquire));
    assert!(src.dirty.lock().unwrap().is_none(), "dirty logging stopped");
    src.stop_writer();
}

/// A hand-driven receiver: accepts, reads the header, says Accepted and Ready; returns the
/// connection and the encoder its further replies must use.
fn accept_and_say_ready(l: &Listener) -> (Conn, VmDescription, Encoder) {
    let mut c = l.accept().unwrap();
    let desc = kumo_migration::format::read_header(&mut c).unwrap();
    let mut out = Vec::new();
    let mut enc = Encoder::new();
    enc.reply(&mut out, &Reply::Accepted);
    enc.reply(&mut out, &Reply::Ready);
    std::io::Write::write_all(&mut c, &out).unwrap();
    (c, desc, enc)
}

#[test]
fn a_receiver_dying_mid_stream_leaves_the_source_running() {
    let src = FakeSource::new(1000);
    let (l, addr) = listen(false, "die");
    // A "receiver" that accepts, says Ready, reads a little, then drops the connection.
    let t = std::thread::spawn(move || {
        let (mut c, desc, _) = accept_and_say_ready(&l);
        let mut buf = vec![0u8; 1 << 20];
        std::io::Read::read_exact(&mut c, &mut buf).unwrap();
        drop(c);
        desc
    });
    let e =
        migrate(&*src, &addr, &MigrateOptions { engine: MigrationEngine::Serial, ..Default::default() }, &mut |_| {})
            .unwrap_err();
    t.join().unwrap();
    assert!(matches!(e, MigrateError::Io(_) | MigrateError::Stream(_)), "{e}");
    assert!(src.running.load(Ordering::Acquire), "source runs on");
    src.stop_writer();
}

#[test]
fn a_source_that_vanishes_fails_the_receiver_cleanly() {
    let (l, addr) = listen(false, "vanish");
    let t = std::thread::spawn(move || receive(&l, Duration::from_secs(5), make_dest).map(|_| ()));
    let mut c = Conn::connect(&addr, Duration::from_secs(5)).unwrap();
    let desc = VmDescription::new(
        1,
        kumo_migration::format::Irqchip::Kernel,
        kumo_migration::format::PayloadDescription::guest("test"),
        regions(),
    );
    kumo_migration::format::write_header(&mut c, &desc).unwrap();
    drop(c);
    let e = t.join().unwrap().unwrap_err();
    // A truncated stream, or a reset: the source's close is a RST when the destination's reply
    // was still unread in its socket.
    let why = e.to_string().to_lowercase();
    assert!(why.contains("truncated") || why.contains("connection"), "{e}");
}

#[test]
fn garbage_is_answered_and_dropped_while_the_destination_waits() {
    let (l, addr) = listen(false, "garbage");
    let limits = crate::AcceptLimits { max_bad: 2, ..Default::default() };
    let t = std::thread::spawn(move || {
        crate::receive_limited(&l, Duration::from_secs(5), &limits, &RecvProgress::default(), make_dest).map(|_| ())
    });
    for _ in 0..2 {
        let mut c = Conn::connect(&addr, Duration::from_secs(5)).unwrap();
        std::io::Write::write_all(&mut c, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        // The peer is told why, in a reply it can read.
        match kumo_migration::format::ReplyReader::new(c).next_reply().unwrap() {
            Reply::Failed(why) => assert!(why.to_lowercase().contains("magic"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    // Only the bound on bad connections ends the wait.
    let e = t.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("gave up after 2 connections") && e.to_lowercase().contains("magic"), "{e}");
}

#[test]
fn xen_rule_reaches_few_dirty_pages_for_an_idle_guest() {
    let src = FakeSource::new(1);
    src.pause().unwrap(); // an idle guest: nothing dirties memory
    let (l, addr) = listen(false, "idle");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest));
    let policy = StopPolicy { xen: Some(XenRule::default()), downtime: None, ..Default::default() };
    let r = migrate(&*src, &addr, &MigrateOptions { policy, ..Default::default() }, &mut |_| {}).unwrap();
    assert_eq!(r.rounds.len(), 2, "round 0, then a final round: {:?}", r.rounds);
    assert_eq!(r.rounds[1].pages, 0);
    dest.join().unwrap().unwrap();
    src.stop_writer();
}

#[test]
fn serial_waits_for_each_batch_to_be_placed() {
    let src = FakeSource::new(1000);
    let (l, addr) = listen(false, "noplaced");
    // A receiver that reads the first batch completely but never says Placed.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let (mut c, desc, _) = accept_and_say_ready(&l);
        let mut r = kumo_migration::format::Reader::new(c.try_clone().unwrap(), &desc);
        let Some(kumo_migration::format::Record::MemBatch(b)) = r.next_record().unwrap() else { panic!("no batch") };
        let (ack, pages) = (b.ack, b.gfns.len());
        // Nothing more may come until the batch is acknowledged.
        c.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let more = std::io::Read::read(&mut c, &mut [0u8; 1]);
        // Keep the connection open until the sender has given up.
        let _ = done_rx.recv();
        (ack, pages, more.is_err())
    });
    let opts = MigrateOptions {
        engine: MigrationEngine::Serial,
        progress_timeout: Duration::from_millis(800),
        ..Default::default()
    };
    let e = migrate(&*src, &addr, &opts, &mut |_| {}).unwrap_err();
    done_tx.send(()).unwrap();
    let (ack, pages, silent) = t.join().unwrap();
    assert!(ack, "serial batches ask for Placed");
    assert_eq!(pages, 1024);
    assert!(silent, "the sender sent more before its batch was placed");
    assert!(matches!(e, MigrateError::ReplyTimeout(_)), "{e}");
    assert!(src.running.load(Ordering::Acquire), "source runs on");
    src.stop_writer();
}

#[test]
fn a_peer_that_never_answers_the_header_is_not_kumo() {
    let src = FakeSource::new(10);
    let (l, addr) = listen(false, "silent-peer");
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    // Accepts and reads, but never answers (a stopped process, or another protocol).
    let t = std::thread::spawn(move || {
        let c = l.accept().unwrap();
        let _ = done_rx.recv();
        drop(c);
    });
    let opts = MigrateOptions { handshake_timeout: Duration::from_millis(200), ..Default::default() };
    let e = migrate(&*src, &addr, &opts, &mut |_| {}).unwrap_err();
    done_tx.send(()).unwrap();
    t.join().unwrap();
    assert!(matches!(e, MigrateError::NotKumo { .. }), "{e}");
    assert!(e.to_string().contains("not a kumo migration destination"), "{e}");
    assert!(src.running.load(Ordering::Acquire), "source runs on");
    src.stop_writer();
}

#[test]
fn a_peer_speaking_another_protocol_is_not_kumo() {
    let src = FakeSource::new(10);
    let (l, addr) = listen(false, "http-peer");
    let t = std::thread::spawn(move || {
        let mut c = l.accept().unwrap();
        let _ = std::io::Read::read(&mut c, &mut [0u8; 64]);
        std::io::Write::write_all(&mut c, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").unwrap();
        c
    });
    let e = migrate(&*src, &addr, &MigrateOptions::default(), &mut |_| {}).unwrap_err();
    drop(t.join().unwrap());
    assert!(matches!(e, MigrateError::NotKumo { .. }), "{e}");
    src.stop_writer();
}

#[test]
fn a_destination_that_stops_reading_fails_the_migration_and_the_source_runs_on() {
    for engine in [MigrationEngine::Serial, MigrationEngine::Overlap, MigrationEngine::Zerocopy] {
        let src = FakeSource::new(1000);
        let (l, addr) = listen(false, &format!("stalled-{engine}"));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        // Says Ready, then reads nothing: a SIGSTOPped destination.
        let t = std::thread::spawn(move || {
            let (c, _, _) = accept_and_say_ready(&l);
            let _ = done_rx.recv();
            drop(c);
        });
        let opts = MigrateOptions { engine, progress_timeout: Duration::from_millis(500), ..Default::default() };
        let e = migrate(&*src, &addr, &opts, &mut |_| {}).unwrap_err();
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(matches!(e, MigrateError::NoProgress { .. } | MigrateError::ReplyTimeout(_)), "{engine}: {e}");
        assert!(src.running.load(Ordering::Acquire), "{engine}: source runs on");
        src.stop_writer();
    }
}

#[test]
fn serial_with_several_connections_is_refused_up_front() {
    let src = FakeSource::new(10);
    // Nothing listens there: the refusal must come before any connection is tried.
    let addr = Address::Unix(std::env::temp_dir().join(format!("kumo-nobody-{}.sock", std::process::id())));
    let opts = MigrateOptions { engine: MigrationEngine::Serial, connections: 2, ..Default::default() };
    let e = migrate(&*src, &addr, &opts, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("--connections 1"), "{e}");
    src.stop_writer();
}

/// A receiver that takes the whole stream, state included, and then answers `last` (or
/// nothing, closing the connection).
fn receiver_that_answers(l: Listener, last: Option<Reply>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let (c, desc, mut enc) = accept_and_say_ready(&l);
        let mut r = kumo_migration::format::Reader::new(c.try_clone().unwrap(), &desc);
        while let Some(rec) = r.next_record().unwrap() {
            if matches!(rec, kumo_migration::format::Record::Complete { .. }) {
                break;
            }
        }
        if let Some(reply) = last {
            let mut out = Vec::new();
            enc.reply(&mut out, &reply);
            let mut c = c;
            std::io::Write::write_all(&mut c, &out).unwrap();
        }
    })
}

#[test]
fn after_the_final_state_only_an_explicit_failure_gives_the_vm_back() {
    // No confirmation: the destination may run the VM, so the source must stay paused.
    let src = FakeSource::new(100);
    let (l, addr) = listen(false, "unconfirmed");
    let t = receiver_that_answers(l, None);
    let e = migrate(&*src, &addr, &MigrateOptions::default(), &mut |_| {}).unwrap_err();
    t.join().unwrap();
    assert!(matches!(e, MigrateError::Unconfirmed(_)), "{e}");
    assert!(e.to_string().contains("stays paused"), "{e}");
    assert!(!src.running.load(Ordering::Acquire), "the source must not run the guest again");
    assert_eq!(src.resumed.load(Ordering::Acquire), 0);
    src.stop_writer();

    // An explicit Failed: the destination will not run it, so the source takes it back.
    let src = FakeSource::new(100);
    let (l, addr) = listen(false, "dest-failed");
    let t = receiver_that_answers(l, Some(Reply::Failed("restore failed".into())));
    let e = migrate(&*src, &addr, &MigrateOptions::default(), &mut |_| {}).unwrap_err();
    t.join().unwrap();
    assert!(matches!(e, MigrateError::Dest(_)), "{e}");
    assert!(src.running.load(Ordering::Acquire), "source runs on");
    src.stop_writer();
}

#[test]
fn a_silent_source_fails_the_receiver_within_its_deadline() {
    let (l, addr) = listen(false, "silent-src");
    let t = std::thread::spawn(move || receive(&l, Duration::from_millis(300), make_dest).map(|_| ()));
    let mut c = Conn::connect(&addr, Duration::from_secs(5)).unwrap();
    let desc = VmDescription::new(
        1,
        kumo_migration::format::Irqchip::Kernel,
        kumo_migration::format::PayloadDescription::guest("test"),
        regions(),
    );
    kumo_migration::format::write_header(&mut c, &desc).unwrap();
    // The handshake, then nothing: a stopped source. The connection stays open.
    let mut replies = kumo_migration::format::ReplyReader::new(c.try_clone().unwrap());
    assert_eq!(replies.next_reply().unwrap(), Reply::Accepted);
    assert_eq!(replies.next_reply().unwrap(), Reply::Ready);
    let e = t.join().unwrap().unwrap_err();
    assert!(matches!(e, MigrateError::NoProgress { .. }), "{e}");
    assert!(e.to_string().contains("no data from the source"), "{e}");
    // The source is told why.
    assert!(matches!(replies.next_reply().unwrap(), Reply::Failed(why) if why.contains("no data from the source")));
}

/// Gives every page of the fake guest data: the bandwidth cap charges data pages only, and
/// the capped tests need a round 0 the cap makes long (16 MiB at 8 MB/s: seconds). With only
/// the first 1,000 pages written, round 0's data fits the bucket's burst and goes at once.
fn fill_every_page(src: &FakeSource) {
    for p in 1000..PAGES {
        src.mem.guest.write_obj(p * 31 + 7, GuestAddress(p * 4096 + 8)).unwrap();
    }
}

/// A capped migration (16 MiB at 8 MB/s: the bucket makes round 0 last seconds) reports its
/// progress within round 0, before the round ends.
#[test]
fn progress_is_reported_within_a_round() {
    let src = FakeSource::new(100);
    fill_every_page(&src);
    let (l, addr) = listen(false, "progress");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest));
    let opts = MigrateOptions { max_bandwidth: Some(8_000_000), ..Default::default() };
    let mut events = Vec::new();
    migrate(&*src, &addr, &opts, &mut |e| events.push(e)).unwrap();
    dest.join().unwrap().unwrap();
    src.stop_writer();
    let round0_end = events.iter().position(|e| matches!(e, Event::Round { round: 0, .. })).unwrap();
    let within: Vec<_> = events[..round0_end]
        .iter()
        .filter_map(|e| match e {
            Event::Progress { round: 0, pages_sent, round_pages, bytes_sent, .. } => {
                Some((*pages_sent, *round_pages, *bytes_sent))
            }
            _ => None,
        })
        .collect();
    assert!(!within.is_empty(), "no progress within round 0: {events:?}");
    assert!(within.iter().any(|&(sent, total, _)| sent < total), "{within:?}");
    assert!(within.windows(2).all(|w| w[0].0 <= w[1].0), "{within:?}");
    assert!(within.iter().all(|&(sent, total, bytes)| sent <= total && bytes == sent * 4096), "{within:?}");
}

/// Cancelled mid-round (from the first progress event, so no timing is involved): the
/// migration ends `Cancelled`, the source runs on with dirty logging off, and the destination
/// is told and fails cleanly.
#[test]
fn a_cancelled_migration_leaves_the_source_running_and_the_destination_failed() {
    let src = FakeSource::new(100);
    fill_every_page(&src);
    let (l, addr) = listen(false, "cancel");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest).map(drop));
    let opts = MigrateOptions { max_bandwidth: Some(8_000_000), ..Default::default() };
    let token = opts.cancel.clone();
    let mut events = Vec::new();
    let e = migrate(&*src, &addr, &opts, &mut |e| {
        if matches!(e, Event::Progress { .. }) {
            token.cancel().unwrap();
        }
        events.push(e);
    })
    .unwrap_err();
    assert!(matches!(e, MigrateError::Cancelled), "{e}");
    assert!(matches!(events.last(), Some(Event::Cancelled)), "{events:?}");
    assert!(!events.iter().any(|e| matches!(e, Event::StopAndCopy { .. })), "{events:?}");
    assert!(src.running.load(Ordering::Acquire), "the source runs on");
    assert!(src.dirty.lock().unwrap().is_none(), "dirty logging stopped");
    let de = dest.join().unwrap().unwrap_err();
    assert!(de.to_string().contains("cancelled"), "{de}");
    src.stop_writer();
}

/// A cancel before the migration starts stops it before anything is sent; one after it has
/// completed is refused.
#[test]
fn cancel_before_start_and_after_completion() {
    let src = FakeSource::new(100);
    let (l, addr) = listen(false, "cancel-early");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest).map(drop));
    let opts = MigrateOptions::default();
    opts.cancel.cancel().unwrap();
    let e = migrate(&*src, &addr, &opts, &mut |_| {}).unwrap_err();
    assert!(matches!(e, MigrateError::Cancelled), "{e}");
    assert!(dest.join().unwrap().is_err());
    assert!(src.running.load(Ordering::Acquire));

    let (l, addr) = listen(false, "cancel-late");
    let dest = std::thread::spawn(move || receive(&l, Duration::from_secs(30), make_dest).map(drop));
    let opts = MigrateOptions::default();
    migrate(&*src, &addr, &opts, &mut |_| {}).unwrap();
    dest.join().unwrap().unwrap();
    assert_eq!(opts.cancel.cancel(), Err(crate::CancelError::Committed));
    src.stop_writer();
}
