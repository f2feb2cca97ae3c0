//! File descriptors that travel with a request: a client (libvirt, another CH client) opens a
//! tap itself and sends its descriptor as SCM_RIGHTS ancillary data on the same unix-socket
//! write as the HTTP request (`vm.add-net`, `vm.create`, `vm.restore`; docs/ch-compat.md).
//!
//! The server takes every descriptor as an [`OwnedFd`] the moment it arrives (close-on-exec
//! from the kernel: `MSG_CMSG_CLOEXEC`), at most [`MAX_FDS`] per request; the request that
//! arrived with them carries them as [`Fds`] in its typed body, and whatever no one takes is
//! closed when dropped.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// Most descriptors one request may carry; more is a 400.
pub const MAX_FDS: usize = 64;

/// Descriptors passed with a request, shared: clones of a config that holds them (the created
/// VM kept for `vm.reboot`, `vm.info`'s copy) refer to the same descriptors, closed when the
/// last clone goes. They never come from JSON: a body's numbers are CH's placeholders.
#[derive(Clone, Default)]
pub struct Fds(Arc<Vec<OwnedFd>>);

impl Fds {
    pub fn new(fds: Vec<OwnedFd>) -> Fds {
        Fds(Arc::new(fds))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.0.iter().map(AsFd::as_fd)
    }

    /// Their numbers in this process (what `vm.info` shows, as CH does).
    pub fn raw(&self) -> Vec<RawFd> {
        self.0.iter().map(AsRawFd::as_raw_fd).collect()
    }

    /// A descriptor of one's own for each (close-on-exec duplicates), e.g. for a device that
    /// closes its copy when it goes while the config keeps these for the next boot.
    pub fn duplicate(&self) -> io::Result<Vec<OwnedFd>> {
        self.0.iter().map(OwnedFd::try_clone).collect()
    }

    /// Splits off the first `n` (fewer if there are not so many): for spreading one request's
    /// descriptors over the devices that asked for them. Only before the set is shared.
    pub(crate) fn split_first(v: &mut Vec<OwnedFd>, n: usize) -> Fds {
        let rest = v.split_off(n.min(v.len()));
        Fds::new(std::mem::replace(v, rest))
    }
}

impl PartialEq for Fds {
    /// The same descriptors (by number: two live `OwnedFd`s never share one).
    fn eq(&self, other: &Fds) -> bool {
        self.raw() == other.raw()
    }
}

impl Eq for Fds {}

impl fmt::Debug for Fds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fds({:?})", self.raw())
    }
}

/// What one receive brought: bytes read, descriptors that came with them, and whether the
/// kernel had more than fit (`MSG_CTRUNC`: it closed the rest).
pub(crate) struct Received {
    pub n: usize,
    pub fds: Vec<OwnedFd>,
    pub truncated: bool,
}

/// Room for this many descriptors in one receive's control buffer: one over the limit, so a
/// request with too many is told apart from one with exactly [`MAX_FDS`].
const CMSG_FDS: usize = MAX_FDS + 1;

/// Reads into `buf` with `recvmsg`, taking any descriptors sent with the bytes (close-on-exec).
/// Honours the socket's read timeout as `read` does.
pub(crate) fn recv(stream: &UnixStream, buf: &mut [u8]) -> io::Result<Received> {
    // u64s keep the control buffer aligned for `cmsghdr`.
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((CMSG_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid (no name, no iovecs, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both alive and as long as
    // declared, for the duration of the call.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg`'s control part; CMSG_FIRSTHDR/NXTHDR walk it within
    // msg_controllen, and each SCM_RIGHTS header's data holds (len - CMSG_LEN(0)) / 4 fds that
    // are now this process's, each taken into an OwnedFd exactly once.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received { n: n as usize, fds, truncated: msg.msg_flags & libc::MSG_CTRUNC != 0 })
}

/// Writes all of `bytes`, the first write carrying `fds` as SCM_RIGHTS (as libvirt sends a
/// tap with `vm.add-net`). Honours the socket's write timeout.
pub(crate) fn send(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    use std::io::Write;
    if fds.is_empty() || bytes.is_empty() {
        return (&*stream).write_all(bytes);
    }
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let n = stream.send_with_fds(&[bytes], &raw).map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    (&*stream).write_all(&bytes[n..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn files(n: usize) -> Vec<std::fs::File> {
        (0..n).map(|_| std::fs::File::open("/dev/null").unwrap()).collect()
    }

    fn borrowed(f: &[std::fs::File]) -> Vec<BorrowedFd<'_>> {
        f.iter().map(AsFd::as_fd).collect()
    }

    fn cloexec(fd: &OwnedFd) -> bool {
        // SAFETY: F_GETFD on a descriptor this test owns reads its flags.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        flags & libc::FD_CLOEXEC != 0
    }

    #[test]
    fn descriptors_arrive_with_their_bytes_close_on_exec() {
        let (a, b) = UnixStream::pair().unwrap();
        let sent = files(3);
        send(&a, b"hello", &borrowed(&sent)).unwrap();
        let mut buf = [0u8; 64];
        let r = recv(&b, &mut buf).unwrap();
        assert_eq!(&buf[..r.n], b"hello");
        assert_eq!(r.fds.len(), 3);
        assert!(!r.truncated);
        assert!(r.fds.iter().all(cloexec));
        // They are the same open files as sent (same inode as /dev/null).
        let st = |fd: RawFd| {
            // SAFETY: an all-zero stat is valid.
            let mut s: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstat fills `s` for a live descriptor.
            assert_eq!(unsafe { libc::fstat(fd, &mut s) }, 0);
            (s.st_dev, s.st_ino)
        };
        assert_eq!(st(r.fds[0].as_raw_fd()), st(sent[0].as_raw_fd()));
        // Bytes without descriptors read as before.
        (&a).write_all(b"more").unwrap();
        let r = recv(&b, &mut buf).unwrap();
        assert_eq!((&buf[..r.n], r.fds.len()), (&b"more"[..], 0));
    }

    #[test]
    fn too_many_descriptors_are_flagged_and_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let sent = files(CMSG_FDS + 3);
        send(&a, b"x", &borrowed(&sent)).unwrap();
        let mut buf = [0u8; 8];
        let r = recv(&b, &mut buf).unwrap();
        assert!(r.truncated, "the kernel had more than fit");
        assert!(r.fds.len() > MAX_FDS && r.fds.len() < sent.len(), "{}", r.fds.len());
        let raw: Vec<RawFd> = r.fds.iter().map(AsRawFd::as_raw_fd).collect();
        drop(r);
        for fd in raw {
            // SAFETY: F_GETFD on a number: EBADF once it is closed.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1, "fd {fd} still open");
        }
    }

    #[test]
    fn shared_fds_compare_by_number_and_duplicate() {
        let f: Vec<OwnedFd> = files(2).into_iter().map(OwnedFd::from).collect();
        let mut v = f;
        let first = Fds::split_first(&mut v, 1);
        assert_eq!((first.len(), v.len()), (1, 1));
        let again = first.clone();
        assert_eq!(first, again);
        let dup = first.duplicate().unwrap();
        assert_ne!(dup[0].as_raw_fd(), first.raw()[0]);
        assert!(cloexec(&dup[0]));
        assert_ne!(first, Fds::new(v));
    }
}
