//! A tap queue's transmit ring: the frames one pass over a TX queue finds are written to the tap
//! with one `io_uring_enter` instead of one `write(2)` each. On a 2-core host the NIC thread
//! shares a CPU with whoever receives the frames, and each write's system call (and the
//! reschedule at its return, once the receiver is woken) is time that CPU does not spend
//! moving frames.
//!
//! The ring can do nothing but write: it is restricted (before it is enabled) to
//! `IORING_OP_WRITE`, since io_uring's work is not seen by seccomp (the NIC thread may `write(2)`
//! anyway). The tap queue is not a registered file: a ring holds its registered files until the
//! kernel tears it down, after the process is gone, and a single-queue tap stays busy until then
//! (the next VM on it would be refused). Each write is
//! `RWF_NOWAIT`: the kernel issues a batch's writes in order as it takes them and a write that
//! would wait fails at once (`EAGAIN`, the frame dropped, as a `write(2)` to the non-blocking
//! queue would) instead of being retried later, so frames reach the tap in the driver's order.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

use crate::virtio::GuestSlice;

/// Writes in flight at once (a TX pass sends at most this many frames per system call).
pub const ENTRIES: usize = 64;

/// An io_uring that writes frames to one tap queue.
pub struct TxRing {
    ring: IoUring,
    /// The tap queue's descriptor, owned by the tap, which drops its rings with its queues.
    fd: RawFd,
}

impl std::fmt::Debug for TxRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxRing").field("entries", &ENTRIES).finish()
    }
}

impl TxRing {
    /// A ring that writes to `fd` and can do nothing else, or why the host cannot give one (no
    /// io_uring, no write opcode, restrictions unsupported). COOP_TASKRUN: this thread reaps
    /// the completions when it enters the ring anyway.
    pub fn new(fd: RawFd) -> io::Result<TxRing> {
        let ring = crate::virtio::uring::restricted_ring(ENTRIES as u32, &[opcode::Write::CODE], true, |_| Ok(()))?;
        Ok(TxRing { ring, fd })
    }

    /// Writes `frames` in order, [`ENTRIES`] per system call, and waits for every write: one
    /// result per frame in `results`. Err: the ring itself failed (the frames from the failing
    /// batch on read as that error); the caller stops using it.
    pub fn write_all(&mut self, frames: &[GuestSlice<'_>], results: &mut Vec<io::Result<()>>) -> io::Result<()> {
        results.clear();
        for batch in frames.chunks(ENTRIES) {
            let first = results.len();
            results.extend(batch.iter().map(|_| Err(io::Error::other("no completion"))));
            if let Err(e) = self.write_batch(batch, &mut results[first..]) {
                let code = e.raw_os_error().unwrap_or(libc::EIO);
                results.truncate(first);
                results.extend(frames[first..].iter().map(|_| Err(io::Error::from_raw_os_error(code))));
                return Err(e);
            }
        }
        Ok(())
    }

    fn write_batch(&mut self, batch: &[GuestSlice<'_>], results: &mut [io::Result<()>]) -> io::Result<()> {
        {
            let mut sq = self.ring.submission();
            for (i, frame) in batch.iter().enumerate() {
                let sqe = opcode::Write::new(types::Fd(self.fd), frame.ptr_guard().as_ptr(), frame.len() as u32)
                    .rw_flags(libc::RWF_NOWAIT)
                    .build()
                    .user_data(i as u64);
                // SAFETY: the write reads `frame`, guest memory that stays mapped while the VM
                // (and so this device) lives; this function waits below for every write it
                // queues before it returns, so none outlives the borrow of `frames`.
                unsafe { sq.push(&sqe) }.map_err(|_| io::Error::other("TX ring full"))?;
            }
        }
        let mut done = 0;
        while done < batch.len() {
            match self.ring.submit_and_wait(batch.len() - done) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => return Err(e),
            }
            for cqe in self.ring.completion() {
                let (i, r) = (cqe.user_data() as usize, cqe.result());
                let Some((slot, frame)) = results.get_mut(i).zip(batch.get(i)) else { continue };
                *slot = match r {
                    r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
                    r if r as usize == frame.len() => Ok(()),
                    r => Err(io::Error::new(io::ErrorKind::WriteZero, format!("{r} of {} bytes written", frame.len()))),
                };
                done += 1;
            }
        }
        Ok(())
    }
}
