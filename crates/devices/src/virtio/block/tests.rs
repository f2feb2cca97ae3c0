use std::path::PathBuf;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::persist::Persist;
use crate::virtio::pci_transport::{VirtioPciTransport, DEVICE_CFG_OFFSET};
use crate::virtio::status;
use crate::virtio::testutil::*;

type Disk = VirtioPciTransport<Block>;

const T_IN: u32 = vb::VIRTIO_BLK_T_IN;
const T_OUT: u32 = vb::VIRTIO_BLK_T_OUT;
const T_FLUSH: u32 = vb::VIRTIO_BLK_T_FLUSH;
const T_GET_ID: u32 = vb::VIRTIO_BLK_T_GET_ID;
const T_DISCARD: u32 = vb::VIRTIO_BLK_T_DISCARD;
const T_WZ: u32 = vb::VIRTIO_BLK_T_WRITE_ZEROES;
/// Where a request's status byte goes when the rig adds one.
const NO_STATUS: u8 = 0xee;

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kumo-blk-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The backends this host can run: threads, and io_uring where it works.
/// Probed once: tests run in parallel and must not share (and remove) one probe directory.
fn backends() -> Vec<BackendKind> {
    static KINDS: std::sync::OnceLock<Vec<BackendKind>> = std::sync::OnceLock::new();
    KINDS
        .get_or_init(|| {
            let d = dir("probe");
            let f = d.join("p.img");
            std::fs::write(&f, vec![0u8; 4096]).unwrap();
            let file = Arc::new(std::fs::File::open(&f).unwrap());
            let mut v = vec![BackendKind::Threads];
            match backend::UringBackend::new(file, 8) {
                Ok(_) => v.push(BackendKind::IoUring),
                Err(e) => eprintln!("io_uring not tested here: {e}"),
            }
            let _ = std::fs::remove_dir_all(&d);
            v
        })
        .clone()
}

/// A disk on a fresh image behind a transport, brought up by a test driver.
struct Rig {
    t: Disk,
    mem: GuestMemory,
    irqs: Arc<Irqs>,
    qs: Vec<GuestQueue>,
    path: PathBuf,
    next_buf: u64,
    /// Leave the image's directory when dropped (a test opens the image again).
    keep: bool,
}

impl Drop for Rig {
    fn drop(&mut self) {
        if !self.keep {
            if let Some(d) = self.path.parent() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

impl Rig {
    fn new(test: &str, image: Vec<u8>, readonly: bool, config: BlockConfig) -> Rig {
        let path = dir(test).join("disk.img");
        std::fs::write(&path, image).unwrap();
        let img = DiskImage::open(&path, readonly, false).unwrap();
        let blk = Block::new(test, config.clone(), img).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("blk0", blk, mem.clone(), shared(&irqs), config.queues + 1);
        let qs: Vec<GuestQueue> = (0..config.queues as usize).map(|i| GuestQueue::new(i, 16)).collect();
        let features = t.device().features();
        let st = bring_up(&mut t, features, &qs);
        assert_eq!(st, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        Rig { t, mem, irqs, qs, path, next_buf: BUF_BASE, keep: false }
    }

    fn with(test: &str, sectors: usize, backend: BackendKind) -> Rig {
        Rig::new(test, vec![0u8; sectors * 512], false, BlockConfig { backend, ..Default::default() })
    }

    /// A 4 KiB-aligned guest buffer of `len` bytes.
    fn buf(&mut self, len: usize) -> u64 {
        let a = self.next_buf;
        self.next_buf += (len as u64).div_ceil(4096).max(1) * 4096;
        assert!(self.next_buf <= MEM_SIZE as u64, "test buffers fit in guest memory");
        a
    }

    fn header(&mut self, ty: u32, sector: u64) -> u64 {
        let h = self.buf(16);
        self.mem.write_obj(ty, GuestAddress(h)).unwrap();
        self.mem.write_obj(0u32, GuestAddress(h + 4)).unwrap();
        self.mem.write_obj(sector, GuestAddress(h + 8)).unwrap();
        h
    }

    /// Adds chain `bufs` to queue `q`, kicks it and waits for the I/O.
    fn run(&mut self, q: usize, bufs: &[(u64, u32, bool)]) {
        self.qs[q].add_chain(&self.mem, bufs);
        kick(&mut self.t, q);
        self.t.device_mut().drain();
    }

    /// A request of type `ty` at `sector` with data buffers `data`; its status byte.
    fn request(&mut self, ty: u32, sector: u64, data: &[(u64, u32, bool)]) -> u8 {
        let h = self.header(ty, sector);
        let s = self.buf(1);
        self.mem.write_obj(NO_STATUS, GuestAddress(s)).unwrap();
        let mut chain = vec![(h, 16, false)];
        chain.extend_from_slice(data);
        chain.push((s, 1, true));
        self.run(0, &chain);
        self.mem.read_obj(GuestAddress(s)).unwrap()
    }

    fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        let b = self.buf(data.len());
        self.mem.write_slice(data, GuestAddress(b)).unwrap();
        self.request(T_OUT, sector, &[(b, data.len() as u32, false)])
    }

    fn read(&mut self, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let b = self.buf(len);
        self.mem.write_slice(&vec![0xaa; len], GuestAddress(b)).unwrap();
        let st = self.request(T_IN, sector, &[(b, len as u32, true)]);
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(b)).unwrap();
        (st, out)
    }

    /// DISCARD / WRITE_ZEROES with one segment.
    fn segment(&mut self, ty: u32, sector: u64, sectors: u32, flags: u32) -> u8 {
        let b = self.buf(16);
        self.mem.write_obj(sector, GuestAddress(b)).unwrap();
        self.mem.write_obj(sectors, GuestAddress(b + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(b + 12)).unwrap();
        self.request(ty, 0, &[(b, 16, false)])
    }

    fn counters(&self) -> BlockCounters {
        self.t.device().counters()
    }

    fn needs_reset(&mut self) -> bool {
        r(&mut self.t, 0x14, 1) as u8 & status::DEVICE_NEEDS_RESET != 0
    }

    fn file(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn config_space_and_features() {
    let mut rig = Rig::new("config", vec![0u8; 1 << 20], false, BlockConfig { queues: 2, ..Default::default() });
    let mut cfg = [0u8; CONFIG_LEN + 4];
    rig.t.bar_read(DEVICE_CFG_OFFSET, &mut cfg);
    let u32_at = |o: usize| u32::from_le_bytes(cfg[o..o + 4].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), 2048, "capacity in sectors");
    assert_eq!(u32_at(8), SIZE_MAX);
    assert_eq!(u32_at(12), 254, "seg_max: queue size - 2");
    assert_eq!(u32_at(20), 512, "blk_size");
    assert_eq!(u16::from_le_bytes([cfg[34], cfg[35]]), 2, "num_queues");
    assert_eq!((u32_at(36), u32_at(40)), (MAX_DISCARD_SECTORS, 1));
    assert_eq!((u32_at(48), u32_at(52), cfg[56]), (MAX_DISCARD_SECTORS, 1, 1));
    assert_eq!(&cfg[CONFIG_LEN..], &[0; 4], "past the end reads zero");
    let f = rig.t.device().features();
    for b in
        [VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_F_SEG_MAX]
    {
        assert!(f & b != 0, "{b:#x}");
    }
    assert!(f & VIRTIO_BLK_F_RO == 0);
    assert_eq!(rig.t.device().queue_max_sizes(), vec![QUEUE_SIZE; 2]);

    let ro = Rig::new("config-ro", vec![0u8; 4096], true, BlockConfig::default());
    let f = ro.t.device().features();
    assert!(f & VIRTIO_BLK_F_RO != 0 && f & VIRTIO_BLK_F_MQ == 0 && f & VIRTIO_BLK_F_DISCARD == 0);
}

#[test]
fn bad_configs_are_refused() {
    let d = dir("badcfg");
    let p = d.join("d.img");
    std::fs::write(&p, vec![0u8; 4096]).unwrap();
    let mk = |c: BlockConfig| Block::new("d", c, DiskImage::open(&p, true, false).unwrap()).err().unwrap().to_string();
    assert_eq!(mk(BlockConfig { queues: 0, ..Default::default() }), "bad queue count 0: a disk has 1 to 64");
    assert_eq!(
        mk(BlockConfig { queue_size: 100, ..Default::default() }),
        "bad queue size 100: a power of two from 2 to 1024"
    );
    let long = "x".repeat(21);
    assert_eq!(
        mk(BlockConfig { serial: long.clone(), ..Default::default() }),
        format!("serial {long:?} is longer than 20 bytes")
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_pattern_goes_through_the_file_both_ways() {
    for b in backends() {
        let mut rig = Rig::with(&format!("pattern-{b:?}"), 64, b);
        let pat = pattern(8192, 7);
        // Two data descriptors, as a scatter list.
        let (b1, b2) = (rig.buf(4096), rig.buf(4096));
        rig.mem.write_slice(&pat[..4096], GuestAddress(b1)).unwrap();
        rig.mem.write_slice(&pat[4096..], GuestAddress(b2)).unwrap();
        assert_eq!(rig.request(T_OUT, 8, &[(b1, 4096, false), (b2, 4096, false)]), S_OK, "{b:?}");
        assert_eq!(&rig.file()[4096..12288], &pat[..], "{b:?}: the file holds the pattern");
        let (st, got) = rig.read(8, 8192);
        assert_eq!(st, S_OK);
        assert_eq!(got, pat, "{b:?}: read back");
        // IN's used length: the data and the status byte.
        let used = rig.qs[0].used_elem(&rig.mem, rig.qs[0].used_idx(&rig.mem) - 1);
        assert_eq!(used.1, 8193);
        // The file's own bytes come through too.
        let mut img = rig.file();
        img[512..1024].copy_from_slice(&pattern(512, 99));
        std::fs::write(&rig.path, &img).unwrap();
        assert_eq!(rig.read(1, 512).1, pattern(512, 99));
        let c = rig.counters();
        assert_eq!((c.requests, c.write_bytes, c.read_bytes, c.errors), (3, 8192, 8704, 0), "{b:?}");
        assert_eq!(rig.t.device().backend_name(), if b == BackendKind::Threads { "threads" } else { "io_uring" });
        assert!(!rig.irqs.take().is_empty(), "interrupts raised");
    }
}

#[test]
fn a_read_only_disk_refuses_writes_and_keeps_its_file() {
    let img = pattern(8192, 3);
    let mut rig = Rig::new("readonly", img.clone(), true, BlockConfig::default());
    assert_eq!(rig.write(0, &[0x55; 512]), S_IOERR);
    assert_eq!(rig.file(), img, "unchanged");
    let (st, got) = rig.read(0, 1024);
    assert_eq!((st, &got[..]), (S_OK, &img[..1024]));
    // DISCARD / WRITE_ZEROES are not offered on a read-only disk.
    assert_eq!(rig.segment(T_DISCARD, 0, 1, 0), S_UNSUPP);
    assert_eq!(rig.segment(T_WZ, 0, 1, 0), S_UNSUPP);
    assert_eq!(rig.file(), img);
    assert_eq!(rig.request(T_FLUSH, 0, &[]), S_OK);
    let c = rig.counters();
    assert_eq!((c.errors, c.unsupported, c.write_bytes), (1, 2, 0));
}

#[test]
fn bad_requests_get_ioerr_or_unsupp() {
    let mut rig = Rig::with("bad", 16, BackendKind::Threads);
    let b = rig.buf(4096);
    // Past the end, straddling the end, and a sector that overflows as bytes.
    assert_eq!(rig.request(T_IN, 16, &[(b, 512, true)]), S_IOERR);
    assert_eq!(rig.request(T_OUT, 15, &[(b, 1024, false)]), S_IOERR);
    assert_eq!(rig.request(T_IN, u64::MAX / 256, &[(b, 512, true)]), S_IOERR);
    assert_eq!(rig.request(T_IN, u64::MAX, &[(b, 512, true)]), S_IOERR);
    // A length that is not whole sectors.
    assert_eq!(rig.request(T_IN, 0, &[(b, 100, true)]), S_IOERR);
    // Data in the wrong direction.
    assert_eq!(rig.request(T_IN, 0, &[(b, 512, false)]), S_IOERR);
    assert_eq!(rig.request(T_OUT, 0, &[(b, 512, true)]), S_IOERR);
    // Unknown types.
    assert_eq!(rig.request(vb::VIRTIO_BLK_T_SECURE_ERASE, 0, &[]), S_UNSUPP);
    assert_eq!(rig.request(0x7777, 0, &[]), S_UNSUPP);
    // A data buffer outside guest memory.
    assert_eq!(rig.request(T_IN, 0, &[(MEM_SIZE as u64 - 256, 512, true)]), S_IOERR);
    // A short header.
    let h = rig.header(T_IN, 0);
    let s = rig.buf(1);
    rig.run(0, &[(h, 8, false), (s, 1, true)]);
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(), S_IOERR);
    // A readable buffer after a writable one.
    let h = rig.header(T_IN, 0);
    rig.run(0, &[(h, 16, false), (b, 512, true), (b, 512, false), (s, 1, true)]);
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(), S_IOERR);
    // A header split over two descriptors, the status sharing the data's last buffer: fine.
    let h = rig.header(T_IN, 0);
    rig.mem.write_obj(0xeeu8, GuestAddress(b + 512)).unwrap();
    rig.run(0, &[(h, 4, false), (h + 4, 12, false), (b, 513, true)]);
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(b + 512)).unwrap(), S_OK);
    let c = rig.counters();
    assert_eq!((c.errors, c.unsupported, c.read_bytes, c.write_bytes), (10, 2, 512, 0));
    assert!(!rig.needs_reset());
    assert_eq!(rig.file(), vec![0u8; 16 * 512]);
}

#[test]
fn too_many_segments_are_refused() {
    let config = BlockConfig { queue_size: 8, backend: BackendKind::Threads, ..Default::default() };
    let mut rig = Rig::new("segs", vec![0u8; 64 * 512], false, config);
    let mut cfg = [0u8; 4];
    rig.t.bar_read(DEVICE_CFG_OFFSET + 12, &mut cfg);
    assert_eq!(u32::from_le_bytes(cfg), 6, "seg_max");
    // An indirect table: header, `n` data descriptors, status.
    let indirect = |rig: &mut Rig, n: u16| -> u8 {
        let h = rig.header(T_IN, 0);
        let data = rig.buf(512 * n as usize);
        let s = rig.buf(1);
        let table = rig.buf(16 * (n as usize + 2));
        let t = GuestQueue { desc: table, avail: 0, used: 0, size: n + 2, next_desc: 0, avail_idx: 0 };
        t.write_desc(&rig.mem, 0, h, 16, 1, 1);
        for i in 0..n {
            t.write_desc(&rig.mem, i + 1, data + 512 * i as u64, 512, 1 | 2, i + 2);
        }
        t.write_desc(&rig.mem, n + 1, s, 1, 2, 0);
        let q = &mut rig.qs[0];
        let head = q.next_desc;
        q.write_desc(&rig.mem, head, table, 16 * (n as u32 + 2), 4, 0);
        q.next_desc = (head + 1) % q.size;
        q.publish(&rig.mem, head);
        kick(&mut rig.t, 0);
        rig.t.device_mut().drain();
        rig.mem.read_obj(GuestAddress(s)).unwrap()
    };
    assert_eq!(indirect(&mut rig, 6), S_OK);
    assert_eq!(indirect(&mut rig, 7), S_IOERR);
    assert_eq!(indirect(&mut rig, 30), S_IOERR);
    assert_eq!(rig.counters().read_bytes, 6 * 512);
}

#[test]
fn a_chain_without_a_status_byte_needs_a_reset() {
    for writable in [false, true] {
        let mut rig = Rig::with(&format!("nostatus-{writable}"), 16, BackendKind::Threads);
        let h = rig.header(T_IN, 0);
        let b = rig.buf(512);
        rig.irqs.take();
        // The last descriptor is device-readable, or writable with no byte.
        let last = if writable { (b, 0, true) } else { (b, 512, false) };
        rig.run(0, &[(h, 16, false), last]);
        assert!(rig.needs_reset(), "DEVICE_NEEDS_RESET");
        assert_eq!(rig.irqs.take(), vec![0], "a config interrupt");
        assert_eq!(rig.qs[0].used_elem(&rig.mem, 0), (0, 0), "given back, nothing written");
        // The queue is not served until the reset.
        let s = rig.buf(1);
        rig.run(0, &[(h, 16, false), (b, 512, true), (s, 1, true)]);
        assert_eq!(rig.qs[0].used_idx(&rig.mem), 1);
        // A reset and a new bring-up serve it again.
        w(&mut rig.t, 0x14, 0, 1);
        let qs: Vec<GuestQueue> = (0..1).map(|i| GuestQueue::new(i, 16)).collect();
        qs[0].clear(&rig.mem);
        let f = rig.t.device().features();
        bring_up(&mut rig.t, f, &qs);
        rig.qs = qs;
        assert!(!rig.needs_reset());
        assert_eq!(rig.read(0, 512).0, S_OK);
    }
}

#[test]
fn a_ring_past_its_size_needs_a_reset() {
    let mut rig = Rig::with("avail", 16, BackendKind::Threads);
    // The driver claims 40 new heads in a 16-entry ring.
    rig.mem.write_obj(40u16, GuestAddress(rig.qs[0].avail + 2)).unwrap();
    kick(&mut rig.t, 0);
    assert!(rig.needs_reset());
}

#[test]
fn discard_and_write_zeroes() {
    for b in backends() {
        let mut rig = Rig::with(&format!("discard-{b:?}"), 64, b);
        let pat = pattern(64 * 512, 1);
        assert_eq!(rig.write(0, &pat), S_OK);
        // Zeroes, without and with unmap, and a discard: each reads back as zeroes.
        assert_eq!(rig.segment(T_WZ, 8, 8, 0), S_OK, "{b:?}");
        assert_eq!(rig.segment(T_WZ, 16, 8, vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP), S_OK);
        assert_eq!(rig.segment(T_DISCARD, 32, 8, 0), S_OK);
        let f = rig.file();
        assert_eq!(f.len(), 64 * 512, "size kept");
        assert!(f[8 * 512..24 * 512].iter().all(|&x| x == 0));
        assert!(f[32 * 512..40 * 512].iter().all(|&x| x == 0));
        assert_eq!(&f[..8 * 512], &pat[..8 * 512]);
        assert_eq!(&f[24 * 512..32 * 512], &pat[24 * 512..32 * 512]);
        assert_eq!(&f[40 * 512..], &pat[40 * 512..]);
        // Zero sectors is a no-op.
        assert_eq!(rig.segment(T_DISCARD, 0, 0, 0), S_OK);
        // A discard with unmap and unknown flags: UNSUPP.
        assert_eq!(rig.segment(T_DISCARD, 0, 1, vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP), S_UNSUPP);
        assert_eq!(rig.segment(T_WZ, 0, 1, 2), S_UNSUPP);
        // Past the end, overflowing, too large.
        assert_eq!(rig.segment(T_WZ, 60, 8, 0), S_IOERR);
        assert_eq!(rig.segment(T_DISCARD, u64::MAX / 2, 8, 0), S_IOERR);
        assert_eq!(rig.segment(T_WZ, 0, MAX_DISCARD_SECTORS + 1, 0), S_IOERR);
        // Two segments (max_*_seg is 1), half a segment.
        let seg = rig.buf(32);
        assert_eq!(rig.request(T_DISCARD, 0, &[(seg, 32, false)]), S_IOERR);
        assert_eq!(rig.request(T_WZ, 0, &[(seg, 8, false)]), S_IOERR);
        let c = rig.counters();
        assert_eq!((c.discards, c.write_zeroes, c.errors, c.unsupported), (1, 2, 5, 2), "{b:?}");
        assert_eq!(&rig.file()[..8 * 512], &pat[..8 * 512], "refused requests changed nothing");
    }
}

#[test]
fn get_id_answers_the_serial() {
    let config = BlockConfig { serial: "kumo-disk-7".into(), ..Default::default() };
    let mut rig = Rig::new("getid", vec![0u8; 4096], true, config);
    let b = rig.buf(20);
    rig.mem.write_slice(&[0xff; 20], GuestAddress(b)).unwrap();
    assert_eq!(rig.request(T_GET_ID, 0, &[(b, 20, true)]), S_OK);
    let mut id = [0u8; 20];
    rig.mem.read_slice(&mut id, GuestAddress(b)).unwrap();
    assert_eq!(&id[..11], b"kumo-disk-7");
    assert_eq!(&id[11..], &[0; 9], "padded with NULs");
    let used = rig.qs[0].used_elem(&rig.mem, 0);
    assert_eq!(used.1, 21);
    // A shorter buffer gets what fits; a readable one is refused.
    assert_eq!(rig.request(T_GET_ID, 0, &[(b, 4, true)]), S_OK);
    assert_eq!(rig.request(T_GET_ID, 0, &[(b, 20, false)]), S_IOERR);
}

#[test]
fn flush_syncs_the_image() {
    for b in backends() {
        let mut rig = Rig::with(&format!("flush-{b:?}"), 16, b);
        assert_eq!(rig.write(0, &[1; 512]), S_OK);
        assert_eq!(rig.request(T_FLUSH, 0, &[]), S_OK, "{b:?}");
        assert_eq!(rig.counters().flushes, 1);
        rig.t.device_mut().quiesce().unwrap();
    }
    // Without the FLUSH feature: FLUSH is UNSUPP, and writes go through to stable storage
    // (RWF_DSYNC, or fdatasync after the write).
    for b in backends() {
        let path = dir(&format!("noflush-{b:?}")).join("d.img");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let img = DiskImage::open(&path, false, false).unwrap();
        let blk = Block::new("noflush", BlockConfig { backend: b, ..Default::default() }, img).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("blk0", blk, mem.clone(), shared(&irqs), 2);
        let qs = vec![GuestQueue::new(0, 16)];
        bring_up(&mut t, VIRTIO_F_VERSION_1, &qs);
        let mut rig = Rig { t, mem, irqs, qs, path, next_buf: BUF_BASE, keep: false };
        assert_eq!(rig.request(T_FLUSH, 0, &[]), S_UNSUPP);
        assert_eq!(rig.write(1, &[3; 512]), S_OK, "{b:?}");
        assert_eq!(&rig.file()[512..1024], &[3; 512]);
        assert_eq!(rig.counters().write_bytes, 512);
    }
}

#[test]
fn a_host_error_reaches_the_guest_as_ioerr() {
    for b in backends() {
        let mut rig = Rig::with(&format!("hosterr-{b:?}"), 16, b);
        // The image shrinks under the disk: the last sectors cannot be read.
        std::fs::OpenOptions::new().write(true).open(&rig.path).unwrap().set_len(4096).unwrap();
        assert_eq!(rig.read(8, 4096).0, S_IOERR, "{b:?}");
        assert_eq!(rig.read(0, 4096).0, S_OK);
        let c = rig.counters();
        assert_eq!((c.errors, c.host_errors), (1, 1), "{b:?}");
    }
}

#[test]
fn event_idx_holds_interrupts_back() {
    let mut rig = Rig::with("eventidx", 16, BackendKind::Threads);
    rig.irqs.take();
    rig.qs[0].set_used_event(&rig.mem, 0);
    assert_eq!(rig.read(0, 512).0, S_OK);
    assert_eq!(rig.irqs.take(), vec![1], "used index passed 0: interrupt on queue 0's vector");
    // Interrupt me only after the 10th.
    rig.qs[0].set_used_event(&rig.mem, 9);
    assert_eq!(rig.read(0, 512).0, S_OK);
    assert!(rig.irqs.take().is_empty(), "held back");
}

#[test]
fn each_queue_is_served_with_its_own_vector() {
    let config = BlockConfig { queues: 3, backend: BackendKind::Threads, ..Default::default() };
    let mut rig = Rig::new("mq", vec![0u8; 16 * 512], false, config);
    rig.irqs.take();
    let h = rig.header(T_OUT, 2);
    let b = rig.buf(512);
    rig.mem.write_slice(&[9; 512], GuestAddress(b)).unwrap();
    let s = rig.buf(1);
    rig.run(2, &[(h, 16, false), (b, 512, false), (s, 1, true)]);
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(), S_OK);
    assert_eq!(rig.irqs.take(), vec![3], "queue 2 raises vector 3");
    assert_eq!(rig.qs[2].used_idx(&rig.mem), 1);
    assert_eq!(&rig.file()[1024..1536], &[9; 512]);
}

#[test]
fn snapshots_wait_for_requests_in_flight_and_check_the_image() {
    let mut rig = Rig::with("persist", 16, BackendKind::Threads);
    assert_eq!(rig.write(0, &[1; 512]), S_OK);
    // A request started but not finished: the transport refuses to save.
    let h = rig.header(T_IN, 0);
    let (b, s) = (rig.buf(512), rig.buf(1));
    rig.qs[0].add_chain(&rig.mem, &[(h, 16, false), (b, 512, true), (s, 1, true)]);
    kick(&mut rig.t, 0);
    assert_eq!(rig.t.device().in_flight(), 1);
    let e = rig.t.save().unwrap_err().to_string();
    assert_eq!(e, "blk0: 1 requests in flight: the device must be drained before it is saved");
    rig.t.device_mut().quiesce().unwrap();
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(), S_OK);
    let state = rig.t.save().unwrap();
    assert_eq!(state.queues[0].next_avail, 2);
    assert_eq!(state.queues[0].next_used, 2);
    let saved = &state.device;
    assert_eq!((saved.size, saved.counters.requests), (16 * 512, 2));

    // Restored onto the same image (another open of it: the first lets go).
    rig.keep = true;
    let path = rig.path.clone();
    let mem = rig.mem.clone();
    drop(rig);
    let blk = Block::new("r", BlockConfig::default(), DiskImage::open(&path, false, false).unwrap()).unwrap();
    let irqs = Arc::new(Irqs::default());
    let mut t = VirtioPciTransport::new("blk0", blk, mem.clone(), shared(&irqs), 2);
    t.restore(&state).unwrap();
    assert_eq!(t.device().counters().requests, 2);
    // The restored rings go on where they were.
    let mut q = GuestQueue::new(0, 16);
    q.next_desc = 6;
    q.avail_idx = 2;
    let mut rig = Rig { t, mem, irqs, qs: vec![q], path: path.clone(), next_buf: BUF_BASE + 0x10_0000, keep: true };
    assert_eq!(rig.read(0, 512), (S_OK, vec![1; 512]));
    drop(rig);

    // An image of another size is refused.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(32 * 512).unwrap();
    let blk = Block::new("r", BlockConfig::default(), DiskImage::open(&path, false, false).unwrap()).unwrap();
    let mut t = VirtioPciTransport::new("blk0", blk, memory(), shared(&Arc::new(Irqs::default())), 2);
    let e = t.restore(&state).unwrap_err().to_string();
    assert_eq!(e, format!("blk0: disk r: the snapshot's image was 8192 bytes, {} is 16384 bytes", path.display()));
    drop(t);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_reset_completes_requests_in_flight_first() {
    for b in backends() {
        let mut rig = Rig::with(&format!("reset-{b:?}"), 16, b);
        let h = rig.header(T_OUT, 0);
        let (d, s) = (rig.buf(512), rig.buf(1));
        rig.mem.write_slice(&[4; 512], GuestAddress(d)).unwrap();
        rig.qs[0].add_chain(&rig.mem, &[(h, 16, false), (d, 512, false), (s, 1, true)]);
        kick(&mut rig.t, 0);
        w(&mut rig.t, 0x14, 0, 1);
        assert_eq!(rig.t.device().in_flight(), 0);
        assert_eq!(&rig.file()[..512], &[4; 512], "{b:?}");
    }
}

#[test]
fn a_head_offered_again_does_not_pile_up_work() {
    let mut rig = Rig::with("pileup", 16, BackendKind::Threads);
    let h = rig.header(T_IN, 0);
    let (d, s) = (rig.buf(512), rig.buf(1));
    let head = rig.qs[0].add_chain(&rig.mem, &[(h, 16, false), (d, 512, true), (s, 1, true)]);
    // The driver offers the same chain again and again, without waiting for it to be used.
    for round in 0..3 {
        let n = if round == 0 { 15 } else { 16 };
        for _ in 0..n {
            rig.qs[0].publish(&rig.mem, head);
        }
        kick(&mut rig.t, 0);
        assert!(rig.t.device().in_flight() <= 16, "{} in flight", rig.t.device().in_flight());
        // Completions make room, and the queue goes on by itself.
        while rig.t.device().in_flight() == 16 {
            backend::wait_readable(rig.t.device().completion_fd(), 1000);
            rig.t.device_mut().process_completions();
        }
    }
    rig.t.device_mut().drain();
    assert_eq!(rig.qs[0].used_idx(&rig.mem), 48, "every offer answered");
    assert_eq!(rig.counters().read_bytes, 48 * 512);
}

#[test]
fn reads_mark_the_guest_pages_they_fill_dirty() {
    use vm_memory::bitmap::Bitmap;
    use vm_memory::{GuestMemoryBackend as _, GuestMemoryRegion};
    for b in backends() {
        let mut rig = Rig::with(&format!("dirty-{b:?}"), 64, b);
        let data = rig.buf(8192);
        let spare = rig.buf(4096);
        let region = rig.mem.find_region(GuestAddress(data)).unwrap();
        assert!(!region.bitmap().dirty_at(data as usize), "fresh memory starts clean");
        let h = rig.header(T_IN, 0);
        let s = rig.buf(1);
        rig.run(0, &[(h, 16, false), (data, 8192, true), (s, 1, true)]);
        assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(), S_OK);
        let region = rig.mem.find_region(GuestAddress(data)).unwrap();
        for page in [data, data + 4096] {
            assert!(region.bitmap().dirty_at(page as usize), "{b:?}: page {page:#x} written through iovecs is dirty");
        }
        assert!(!region.bitmap().dirty_at(spare as usize), "the page after is not");
    }
}

#[test]
fn direct_io_goes_to_the_file_and_refuses_misaligned_buffers() {
    for b in backends() {
        let d = dir(&format!("direct-{b:?}"));
        let path = d.join("disk.img");
        std::fs::write(&path, vec![0u8; 64 * 512]).unwrap();
        let img = match DiskImage::open(&path, false, true) {
            Ok(i) => i,
            Err(e) => return eprintln!("no O_DIRECT here: {e}"),
        };
        let blk = Block::new("direct", BlockConfig { backend: b, ..Default::default() }, img).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("blk0", blk, mem.clone(), shared(&irqs), 2);
        let qs = vec![GuestQueue::new(0, 16)];
        let f = t.device().features();
        bring_up(&mut t, f, &qs);
        let mut rig = Rig { t, mem, irqs, qs, path, next_buf: BUF_BASE, keep: false };
        let pat = pattern(4096, 5);
        assert_eq!(rig.write(8, &pat), S_OK, "{b:?}");
        assert_eq!(&rig.file()[4096..8192], &pat[..]);
        assert_eq!(rig.read(8, 4096), (S_OK, pat.clone()));
        // A buffer O_DIRECT cannot take (not on a 512-byte boundary): the host refuses, IOERR.
        let odd = rig.buf(8192) + 100;
        assert_eq!(rig.request(T_IN, 8, &[(odd, 4096, true)]), S_IOERR, "{b:?}");
        assert_eq!(rig.counters().host_errors, 1);
    }
}
