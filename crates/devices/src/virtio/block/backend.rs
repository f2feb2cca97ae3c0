//! Where a disk's I/O runs, off the vCPU threads: io_uring ([`UringBackend`], the `io-uring`
//! crate) where the host has it, else a bounded pool of `Device` threads ([`PoolBackend`]) doing
//! `preadv`/`pwritev`/`fdatasync`/`fallocate`. Both take operations tagged with a token, and
//! report completions through an eventfd the device's event loop waits on.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kumo_sandbox::{lock, ThreadKind};
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest buffers of one request, as host iovecs.
#[derive(Debug, Clone, Default)]
pub struct IoVecs(pub Vec<libc::iovec>);

// SAFETY: the pointers are into guest memory, which outlives every operation (the device drains
// its backend before it lets go of the memory); the pool's threads only pass them to preadv /
// pwritev.
unsafe impl Send for IoVecs {}

impl IoVecs {
    pub fn len(&self) -> u64 {
        self.0.iter().map(|v| v.iov_len as u64).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One operation on the image.
#[derive(Debug, Clone)]
pub enum Op {
    Read {
        offset: u64,
        iov: IoVecs,
    },
    /// `dsync`: on stable storage when it completes (a driver without FLUSH gets
    /// write-through).
    Write {
        offset: u64,
        iov: IoVecs,
        dsync: bool,
    },
    Flush,
    /// `fallocate` with `mode` on `[offset, offset + len)`.
    Fallocate {
        offset: u64,
        len: u64,
        mode: i32,
    },
}

/// Which backend a disk uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// io_uring if the host has it (and lets this process use it), else threads.
    #[default]
    Auto,
    IoUring,
    Threads,
}

/// A completion: the operation's token and its result (bytes moved).
pub type Completion = (u64, io::Result<u64>);

/// What runs a disk's operations.
pub trait IoBackend: Send {
    /// `io_uring` or `threads`.
    fn name(&self) -> &'static str;
    /// Queues `op` under `token`; [`IoBackend::commit`] starts what was queued.
    ///
    /// # Safety
    /// `op`'s iovecs must stay valid, and unused by anything else, until its completion has
    /// been returned by [`IoBackend::reap`]; the iovec array itself must not move or be freed
    /// before then either (io_uring reads it when the operation starts).
    unsafe fn queue(&mut self, token: u64, op: &Op) -> io::Result<()>;
    /// Starts the queued operations.
    fn commit(&mut self) -> io::Result<()>;
    /// Moves finished operations into `out` without waiting.
    fn reap(&mut self, out: &mut Vec<Completion>);
    /// Readable when completions wait (an eventfd; reap() clears it).
    fn notifier(&self) -> RawFd;
}

/// `fdatasync` / `fallocate` / `preadv` / `pwritev` to the end, as the pool runs them.
fn run_op(fd: RawFd, op: &Op) -> io::Result<u64> {
    let cvt = |r: isize| if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as u64) };
    match op {
        Op::Flush => {
            // SAFETY: fdatasync on an fd the image keeps open.
            cvt(unsafe { libc::fdatasync(fd) } as isize).map(|_| 0)
        }
        Op::Fallocate { offset, len, mode } => {
            // SAFETY: fallocate on an fd the image keeps open; no memory is passed.
            cvt(unsafe { libc::fallocate(fd, *mode, *offset as i64, *len as i64) } as isize).map(|_| 0)
        }
        Op::Read { offset, iov } | Op::Write { offset, iov, .. } => {
            let write = matches!(op, Op::Write { .. });
            let mut v = iov.0.clone();
            let (mut start, mut done, total) = (0usize, 0u64, iov.len());
            while done < total {
                let off = (offset + done) as i64;
                let rest = &v[start..];
                let cnt = rest.len().min(libc::UIO_MAXIOV as usize) as i32;
                // SAFETY: the iovecs point into guest memory valid for the operation (the
                // caller of `queue` promised it); the kernel checks their bounds.
                let r = unsafe {
                    if write {
                        libc::pwritev(fd, rest.as_ptr(), cnt, off)
                    } else {
                        libc::preadv(fd, rest.as_ptr(), cnt, off)
                    }
                };
                let n = cvt(r)?;
                if n == 0 {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short transfer at the image's end"));
                }
                done += n;
                // Skip what went, trimming a partly moved buffer.
                let mut left = n as usize;
                while left > 0 && start < v.len() {
                    let l = v[start].iov_len;
                    if left >= l {
                        left -= l;
                        start += 1;
                    } else {
                        // SAFETY: advancing within the same buffer by less than its length.
                        v[start].iov_base = unsafe { (v[start].iov_base as *mut u8).add(left) } as *mut libc::c_void;
                        v[start].iov_len -= left;
                        left = 0;
                    }
                }
            }
            if let Op::Write { dsync: true, .. } = op {
                run_op(fd, &Op::Flush)?;
            }
            Ok(done)
        }
    }
}

struct PoolShared {
    jobs: Mutex<(VecDeque<(u64, Op)>, bool)>,
    more: Condvar,
    done: Mutex<Vec<Completion>>,
    notify: EventFd,
}

/// A bounded pool of `Device` threads.
pub struct PoolBackend {
    shared: Arc<PoolShared>,
    staged: Vec<(u64, Op)>,
    threads: Vec<JoinHandle<()>>,
}

impl PoolBackend {
    /// `workers` threads (at least one) on `file`, named after `name`.
    pub fn new(file: Arc<File>, workers: usize, name: &str) -> io::Result<Self> {
        let shared = Arc::new(PoolShared {
            jobs: Mutex::new((VecDeque::new(), false)),
            more: Condvar::new(),
            done: Mutex::new(Vec::new()),
            notify: EventFd::new(EFD_NONBLOCK)?,
        });
        let mut pool = PoolBackend { shared, staged: Vec::new(), threads: Vec::new() };
        for i in 0..workers.max(1) {
            let (s, f) = (pool.shared.clone(), file.clone());
            let t = kumo_sandbox::spawn(ThreadKind::Device, format!("{name}-io{i}"), move || worker(&s, &f))?;
            pool.threads.push(t);
        }
        Ok(pool)
    }
}

fn worker(s: &PoolShared, file: &File) {
    loop {
        let (token, op) = {
            let mut q = lock(&s.jobs);
            loop {
                if let Some(j) = q.0.pop_front() {
                    break j;
                }
                if q.1 {
                    return;
                }
                q = s.more.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let r = run_op(file.as_raw_fd(), &op);
        lock(&s.done).push((token, r));
        let _ = s.notify.write(1);
    }
}

impl IoBackend for PoolBackend {
    fn name(&self) -> &'static str {
        "threads"
    }

    unsafe fn queue(&mut self, token: u64, op: &Op) -> io::Result<()> {
        self.staged.push((token, op.clone()));
        Ok(())
    }

    fn commit(&mut self) -> io::Result<()> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let n = self.staged.len();
        lock(&self.shared.jobs).0.extend(self.staged.drain(..));
        if n == 1 {
            self.shared.more.notify_one();
        } else {
            self.shared.more.notify_all();
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let _ = self.shared.notify.read();
        out.append(&mut lock(&self.shared.done));
    }

    fn notifier(&self) -> RawFd {
        self.shared.notify.as_raw_fd()
    }
}

impl Drop for PoolBackend {
    fn drop(&mut self) {
        lock(&self.shared.jobs).1 = true;
        self.shared.more.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// io_uring: one ring per disk, its completions signalled on an eventfd.
pub struct UringBackend {
    ring: io_uring::IoUring,
    fd: RawFd,
    _file: Arc<File>,
    notify: EventFd,
}

impl UringBackend {
    /// A ring for `entries` operations in flight at once (rounded up to a power of two), if
    /// the host has io_uring with the operations a disk needs. The ring is restricted to those
    /// operations (IORING_REGISTER_RESTRICTIONS, before it is enabled): io_uring's work is not
    /// seen by seccomp, so a thread that can enter the ring can do no more than a disk does.
    pub fn new(file: Arc<File>, entries: u32) -> io::Result<Self> {
        use io_uring::opcode;
        let ops = [opcode::Readv::CODE, opcode::Writev::CODE, opcode::Fsync::CODE, opcode::Fallocate::CODE];
        let notify = EventFd::new(EFD_NONBLOCK)?;
        let entries = entries.clamp(8, 4096).next_power_of_two();
        let ring = crate::virtio::uring::restricted_ring(entries, &ops, false, |r| {
            r.submitter().register_eventfd(notify.as_raw_fd())
        })?;
        Ok(UringBackend { ring, fd: file.as_raw_fd(), _file: file, notify })
    }
}

impl IoBackend for UringBackend {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn queue(&mut self, token: u64, op: &Op) -> io::Result<()> {
        use io_uring::{opcode, types};
        let fd = types::Fd(self.fd);
        let sqe = match op {
            Op::Read { offset, iov } => {
                opcode::Readv::new(fd, iov.0.as_ptr(), iov.0.len() as u32).offset(*offset).build()
            }
            Op::Write { offset, iov, dsync } => opcode::Writev::new(fd, iov.0.as_ptr(), iov.0.len() as u32)
                .offset(*offset)
                .rw_flags(if *dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            Op::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
            Op::Fallocate { offset, len, mode } => opcode::Fallocate::new(fd, *len).offset(*offset).mode(*mode).build(),
        }
        .user_data(token);
        loop {
            // SAFETY: the caller keeps the iovecs and their array valid until the completion.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            // Full: start what is queued to make room.
            self.ring.submit()?;
        }
    }

    fn commit(&mut self) -> io::Result<()> {
        if !self.ring.submission().is_empty() {
            self.ring.submit()?;
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let _ = self.notify.read();
        for cqe in self.ring.completion() {
            let r = cqe.result();
            out.push((cqe.user_data(), if r < 0 { Err(io::Error::from_raw_os_error(-r)) } else { Ok(r as u64) }));
        }
    }

    fn notifier(&self) -> RawFd {
        self.notify.as_raw_fd()
    }
}

/// The backend of `kind` for `file`, sized for `entries` requests in flight; `Auto` takes
/// io_uring when it can be set up and says why not otherwise.
pub fn make_backend(
    kind: BackendKind,
    file: &Arc<File>,
    entries: u32,
    workers: usize,
    name: &str,
) -> io::Result<Box<dyn IoBackend>> {
    match kind {
        BackendKind::Threads => Ok(Box::new(PoolBackend::new(file.clone(), workers, name)?)),
        BackendKind::IoUring => Ok(Box::new(UringBackend::new(file.clone(), entries)?)),
        BackendKind::Auto => match UringBackend::new(file.clone(), entries) {
            Ok(u) => Ok(Box::new(u)),
            Err(e) => {
                tracing::info!("{name}: io_uring unavailable ({e}); using a pool of {workers} threads");
                Ok(Box::new(PoolBackend::new(file.clone(), workers, name)?))
            }
        },
    }
}

/// Waits until `fd` is readable or `ms` milliseconds pass.
pub(crate) fn wait_readable(fd: RawFd, ms: i32) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_runs_only_a_disks_operations() {
        let path = std::env::temp_dir().join(format!("kumo-blk-ring-{}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let file = Arc::new(File::open(&path).unwrap());
        let _ = std::fs::remove_file(&path);
        let mut u = match UringBackend::new(file, 8) {
            Ok(u) => u,
            Err(e) => return eprintln!("no io_uring here: {e}"),
        };
        let nop = io_uring::opcode::Nop::new().build().user_data(7);
        // SAFETY: a NOP names no memory.
        unsafe { u.ring.submission().push(&nop) }.unwrap();
        u.commit().unwrap();
        let mut out = Vec::new();
        while out.is_empty() {
            wait_readable(u.notifier(), 1000);
            u.reap(&mut out);
        }
        assert_eq!(out[0].0, 7);
        assert_eq!(out[0].1.as_ref().unwrap_err().raw_os_error(), Some(libc::EACCES), "refused by the restrictions");
        // A flush, which a disk does, runs.
        // SAFETY: FSYNC names no memory.
        unsafe { u.queue(8, &Op::Flush) }.unwrap();
        u.commit().unwrap();
        out.clear();
        while out.is_empty() {
            wait_readable(u.notifier(), 1000);
            u.reap(&mut out);
        }
        assert_eq!(out[0].0, 8);
        assert!(out[0].1.is_ok(), "{:?}", out[0].1);
    }
}
