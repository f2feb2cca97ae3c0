//! The one way a device makes an io_uring: disabled at creation, probed for the operations the
//! device needs, restricted to those operations (and to no submission flags) with
//! `IORING_REGISTER_RESTRICTIONS`, then enabled. io_uring's work is not seen by seccomp, so a
//! thread that can enter a device's ring can do no more through it than the device does.

use std::io;

use io_uring::{register::Restriction, IoUring};

/// A restricted ring of `entries` for the opcodes `ops`. `coop_taskrun`: completions are reaped
/// by the thread that submits (so the kernel need not interrupt it for them; 5.19, quietly left
/// out where refused). `prepare` runs on the ring before it is restricted and enabled (an
/// eventfd registration is refused once the ring is restricted).
pub fn restricted_ring(
    entries: u32,
    ops: &[u8],
    coop_taskrun: bool,
    prepare: impl FnOnce(&IoUring) -> io::Result<()>,
) -> io::Result<IoUring> {
    let coop = coop_taskrun.then(|| IoUring::builder().setup_r_disabled().setup_coop_taskrun().build(entries).ok());
    let ring = match coop.flatten() {
        Some(r) => r,
        None => IoUring::builder().setup_r_disabled().build(entries)?,
    };
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    if let Some(code) = ops.iter().find(|&&c| !probe.is_supported(c)) {
        return Err(io::Error::new(io::ErrorKind::Unsupported, format!("io_uring lacks opcode {code}")));
    }
    prepare(&ring)?;
    let mut allowed: Vec<Restriction> = ops.iter().map(|&op| Restriction::sqe_op(op)).collect();
    allowed.push(Restriction::sqe_flags_allowed(0));
    ring.submitter().register_restrictions(&mut allowed)?;
    ring.submitter().register_enable_rings()?;
    Ok(ring)
}

#[cfg(test)]
mod tests {
    use super::*;
    use io_uring::{opcode, types};
    use std::os::fd::AsRawFd;

    /// An opcode outside the list is refused by the kernel, not run.
    #[test]
    fn a_ring_runs_only_its_opcodes() {
        let mut ring = match restricted_ring(8, &[opcode::Nop::CODE], true, |_| Ok(())) {
            Ok(r) => r,
            Err(e) => return eprintln!("io_uring not tested here: {e}"),
        };
        let (_r, w) = std::os::unix::net::UnixStream::pair().unwrap();
        let buf = [7u8; 4];
        let nop = opcode::Nop::new().build().user_data(1);
        let write = opcode::Write::new(types::Fd(w.as_raw_fd()), buf.as_ptr(), 4).build().user_data(2);
        let linked = opcode::Nop::new().build().flags(io_uring::squeue::Flags::IO_LINK).user_data(3);
        // One at a time: the kernel stops taking a batch at its first refused entry.
        let mut got = Vec::new();
        for sqe in [nop, write, linked] {
            // SAFETY: `buf` outlives the wait for this entry's completion just below.
            unsafe { ring.submission().push(&sqe) }.unwrap();
            ring.submit_and_wait(1).unwrap();
            got.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        }
        assert_eq!(got, vec![(1, 0), (2, -libc::EACCES), (3, -libc::EACCES)]);
    }
}
