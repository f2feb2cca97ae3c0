//! Host-side micro-benchmark of the virtio-blk device model's two I/O backends: random 4 KiB
//! reads and writes at queue depth 1 and 32 on a 256 MiB image, driven through the virtio PCI
//! transport by a test driver (no guest, no KVM), next to the host's own pread/pwrite at QD 1.
//!
//! cargo run --release -p kumo-devices --features testutil --example blk_bench -- [DIR] [SECONDS]
//!
//! DIR holds the image (default: the temp dir); O_DIRECT is used where its file system has it.

use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kumo_devices::virtio::block::{BackendKind, Block, BlockConfig, DiskImage};
use kumo_devices::virtio::testutil::{bring_up, kick, memory, shared, GuestQueue, Irqs, BUF_BASE};
use kumo_devices::virtio::{GuestMemory, VirtioDevice, VirtioPciTransport};
use vm_memory::{Bytes, GuestAddress};

const IMAGE: u64 = 256 << 20;
const BS: u32 = 4096;
const QSIZE: u16 = 128;
const ROUNDS: usize = 3;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A random 4 KiB-aligned sector.
    fn sector(&mut self) -> u64 {
        (self.next() % (IMAGE / BS as u64)) * (BS as u64 / 512)
    }
}

/// Slot `k`'s buffers: header, data, status.
fn slot(k: u16) -> (u64, u64, u64) {
    let base = BUF_BASE + k as u64 * 0x2000;
    (base, base + 0x1000, base + 16)
}

fn run_device(path: &Path, direct: bool, backend: BackendKind, write: bool, qd: u16, secs: f64) -> (f64, String) {
    let img = DiskImage::open(path, false, direct).expect("image");
    let blk = Block::new("bench", BlockConfig { queue_size: QSIZE, backend, ..Default::default() }, img).expect("disk");
    let name = blk.backend_name().to_string();
    let mem: GuestMemory = memory();
    let irqs = Arc::new(Irqs::default());
    let mut t = VirtioPciTransport::new("blk0", blk, mem.clone(), shared(&irqs), 2);
    let mut q = GuestQueue::new(0, QSIZE);
    q.clear(&mem);
    let features = t.device().features();
    bring_up(&mut t, features, &[q]);
    let ty: u32 = if write { 1 } else { 0 };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let submit = |q: &mut GuestQueue, rng: &mut Rng, k: u16| {
        let (h, d, s) = slot(k);
        mem.write_obj(ty, GuestAddress(h)).unwrap();
        mem.write_obj(rng.sector(), GuestAddress(h + 8)).unwrap();
        q.publish(&mem, 3 * k);
        let _ = (d, s);
    };
    for k in 0..qd {
        let (h, d, s) = slot(k);
        q.write_desc(&mem, 3 * k, h, 16, 1, 3 * k + 1);
        q.write_desc(&mem, 3 * k + 1, d, BS, 1 | if write { 0 } else { 2 }, 3 * k + 2);
        q.write_desc(&mem, 3 * k + 2, s, 1, 2, 0);
        mem.write_slice(&[0x5a; BS as usize], GuestAddress(d)).unwrap();
        submit(&mut q, &mut rng, k);
    }
    kick(&mut t, 0);
    let (start, mut done, mut seen) = (Instant::now(), 0u64, 0u16);
    let end = start + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        let fd = t.device().completion_fd();
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, 1000) };
        t.device_mut().process_completions();
        let used = q.used_idx(&mem);
        while seen != used {
            let (id, _) = q.used_elem(&mem, seen);
            let status: u8 = mem.read_obj(GuestAddress(slot(id as u16 / 3).2)).unwrap();
            assert_eq!(status, 0, "request failed");
            seen = seen.wrapping_add(1);
            done += 1;
            submit(&mut q, &mut rng, id as u16 / 3);
        }
        kick(&mut t, 0);
    }
    let el = start.elapsed().as_secs_f64();
    t.device_mut().drain();
    (done as f64 / el, name)
}

fn run_host(path: &Path, direct: bool, write: bool, secs: f64) -> f64 {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(path)
        .unwrap();
    #[repr(C, align(4096))]
    struct Buf([u8; BS as usize]);
    let mut b = Box::new(Buf([0x5a; BS as usize]));
    let mut rng = Rng(0x1234_5678);
    let (start, mut n) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        let off = rng.sector() * 512;
        if write {
            f.write_all_at(&b.0, off).unwrap();
        } else {
            f.read_exact_at(&mut b.0, off).unwrap();
        }
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let secs: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let path = dir.join(format!("kumo-blk-bench-{}.img", std::process::id()));
    {
        let f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0xa5u8; 1 << 20];
        for i in 0..IMAGE / (1 << 20) {
            f.write_all_at(&chunk, i << 20).unwrap();
        }
        f.sync_all().unwrap();
    }
    let direct = DiskImage::open(&path, true, true).is_ok();
    println!("image {} (256 MiB), O_DIRECT {}, {secs} s per run", path.display(), if direct { "on" } else { "off" });
    println!("{:<10} {:<6} {:>3} {:>10}  (median of {ROUNDS} runs: each run)", "backend", "op", "qd", "IOPS");
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" "))
    };
    for write in [false, true] {
        let op = if write { "write" } else { "read" };
        let (m, all) = median((0..ROUNDS).map(|_| run_host(&path, direct, write, secs)).collect());
        println!("{:<10} {:<6} {:>3} {:>10.0}  ({all})", "host", op, 1, m);
        for backend in [BackendKind::Threads, BackendKind::IoUring] {
            for qd in [1, 32] {
                // Rounds interleave nothing else: each configuration's runs follow each other.
                let runs: Vec<(f64, String)> =
                    (0..ROUNDS).map(|_| run_device(&path, direct, backend, write, qd, secs)).collect();
                let name = runs[0].1.clone();
                let (m, all) = median(runs.into_iter().map(|r| r.0).collect());
                println!("{:<10} {:<6} {:>3} {:>10.0}  ({all})", name, op, qd, m);
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}
