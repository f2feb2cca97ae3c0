//! A host TAP as a [`NetBackend`]: one `/dev/net/tun` queue per queue pair
//! (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, plus `IFF_MULTI_QUEUE` for more than one), every frame
//! with its 12-byte vnet header. The fds are non-blocking: an empty queue reads as `None`.
//!
//! The tap is attached by name: an existing one (made with `ip tuntap add … multi_queue` for
//! several queues) or, with CAP_NET_ADMIN, a new one that goes away when kumo closes it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::tx_ring::TxRing;
use super::{NetBackend, VNET_HDR_LEN};
use crate::virtio::GuestSlice;

const TUN_PATH: &str = "/dev/net/tun";
// <linux/if_tun.h>
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const TUNSETQUEUE: libc::c_ulong = 0x4004_54d9;
const IFF_ATTACH_QUEUE: libc::c_short = 0x0200;
const IFF_DETACH_QUEUE: libc::c_short = 0x0400;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_TSO_ECN: libc::c_uint = 0x08;
const TUN_F_USO4: libc::c_uint = 0x20;
const TUN_F_USO6: libc::c_uint = 0x40;

/// A tap's offload flags for the guest-bound offloads `guest` (of [`net::guest_offloads`]).
/// Linux takes UDP segmentation for IPv4 and IPv6 together only: a driver that accepted one of
/// them gets UDP datagrams already cut.
fn tun_flags(guest: u64) -> libc::c_uint {
    use super::{
        VIRTIO_NET_F_GUEST_CSUM as CSUM, VIRTIO_NET_F_GUEST_ECN as ECN, VIRTIO_NET_F_GUEST_TSO4 as TSO4,
        VIRTIO_NET_F_GUEST_TSO6 as TSO6, VIRTIO_NET_F_GUEST_USO4 as USO4, VIRTIO_NET_F_GUEST_USO6 as USO6,
    };
    let pairs = [
        (CSUM, TUN_F_CSUM),
        (TSO4, TUN_F_TSO4),
        (TSO6, TUN_F_TSO6),
        (ECN, TUN_F_TSO_ECN),
        (USO4, TUN_F_USO4),
        (USO6, TUN_F_USO6),
    ];
    let mut flags = pairs.iter().filter(|(f, _)| guest & f != 0).fold(0, |acc, (_, t)| acc | t);
    if guest & USO4 == 0 || guest & USO6 == 0 {
        flags &= !(TUN_F_USO4 | TUN_F_USO6);
    }
    flags
}

/// The offloads this host's taps take: checksums and TCP segmentation (every kernel kumo runs
/// on) and UDP segmentation since Linux 6.2. Read from the kernel's release rather than tried
/// on the tap: a tap may be shared (a local migration's destination attaches its source's), and
/// setting flags to try them would let the tap hand the other holder's guest frames it never
/// accepted. A kernel that backports USO gets the checksum and TCP ones only.
fn host_offloads() -> u64 {
    use super::{OFFLOAD_FEATURES, USO_OFFLOADS};
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    if (major, minor) >= (6, 2) {
        OFFLOAD_FEATURES
    } else {
        OFFLOAD_FEATURES & !USO_OFFLOADS
    }
}

/// `struct ifreq` with the flags member of its union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("bad tap name {0:?}: 1 to 15 characters, no '/', spaces or ':'")]
    Name(String),
    #[error("cannot open {TUN_PATH}: {0}")]
    Open(io::Error),
    #[error("no permission to attach tap {0} (needs CAP_NET_ADMIN, or a tap owned by this user)")]
    Permission(String),
    #[error("tap {0} is busy: another process has it, or it was made without multi_queue and more queues were asked")]
    Busy(String),
    #[error("tap {name} cannot take {queues} queue pairs: it was made without multi_queue")]
    SingleQueue { name: String, queues: usize },
    #[error("no network interface named {0} (create it with `ip tuntap add {0} mode tap`)")]
    Unknown(String),
    #[error("{0} is a network interface but not a tap")]
    NotTap(String),
    #[error(
        "tap {name} refused its flags ({queues} queues): it exists with other ones (multi_queue or not, vnet_hdr)"
    )]
    Mismatch { name: String, queues: usize },
    #[error("tap {name} refused its flags ({queues} queues): {err}")]
    Flags { name: String, queues: usize, err: io::Error },
    #[error("tap {name}: {what}: {err}")]
    Ioctl { name: String, what: &'static str, err: io::Error },
    #[error("file descriptor {fd} is not a tap's: {why}")]
    NotTapFd { fd: RawFd, why: String },
    #[error("the file descriptors are of different taps ({0} and {1}): give one tap's queues")]
    MixedFds(String, String),
}

/// What a tap queue's descriptor says of its tap ([`Tap::inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapFdInfo {
    pub name: String,
    pub multi_queue: bool,
}

/// What opening a tap does to its offload flags, which are the tap's, not a queue's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenOffloads {
    /// None until the driver accepts some: frames a previous owner's flags let the kernel
    /// build must not reach a driver that never accepted them.
    Clear,
    /// Left as they are: a migration's destination, whose source still holds the tap and whose
    /// guest keeps the flags it accepted; the restored driver sets the same ones here.
    Keep,
}

/// A TAP interface with one fd per queue pair.
#[derive(Debug)]
pub struct Tap {
    name: String,
    /// Per queue, its io_uring for batches of frames (None where the host has none: then each
    /// frame is one write). Before `queues`: the rings go first when the tap is dropped.
    tx_rings: Vec<Option<TxRing>>,
    queues: Vec<File>,
    multi_queue: bool,
    attached: bool,
    /// The offloads this host's tap driver takes ([`host_offloads`]).
    offloads: u64,
    /// The flags this process last gave the tap (None: never), set again when its queues are
    /// attached again: another process on the tap may have changed them meanwhile.
    applied: Option<libc::c_uint>,
}

/// Gives a tap queue kumo's vnet header size.
fn set_vnet_hdr_size(f: &impl AsRawFd, name: &str) -> Result<(), TapError> {
    let hdr: libc::c_int = VNET_HDR_LEN as libc::c_int;
    // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer, which points at `hdr`.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETVNETHDRSZ as _, &hdr as *const libc::c_int) };
    if r < 0 {
        let err = io::Error::last_os_error();
        return Err(TapError::Ioctl { name: name.to_string(), what: "setting the vnet header size", err });
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), TapError> {
    let ok = !name.is_empty()
        && name.len() < libc::IFNAMSIZ
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
    if ok {
        Ok(())
    } else {
        Err(TapError::Name(name.to_string()))
    }
}

impl Tap {
    /// Sets the tap's offload flags (they are the tap's, not a queue's).
    fn tun_offload(&mut self, flags: libc::c_uint) -> io::Result<()> {
        let Some(f) = self.queues.first() else { return Ok(()) };
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is one of this tap's.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETOFFLOAD as _, flags as libc::c_ulong) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        self.applied = Some(flags);
        Ok(())
    }

    /// Attaches `queues` queues of tap `name` (created if it does not exist; multi-queue when
    /// `queues` > 1).
    pub fn open(name: &str, queues: usize) -> Result<Self, TapError> {
        Self::open_with(name, queues, queues > 1, OpenOffloads::Clear)
    }

    fn open_with(name: &str, queues: usize, multi_queue: bool, offloads: OpenOffloads) -> Result<Self, TapError> {
        check_name(name)?;
        let queues = queues.max(1);
        let mut files = Vec::with_capacity(queues);
        for _ in 0..queues {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(TUN_PATH)
                .map_err(TapError::Open)?;
            let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, _pad: [0; 22] };
            if multi_queue {
                req.flags |= IFF_MULTI_QUEUE;
            }
            req.name[..name.len()].copy_from_slice(name.as_bytes());
            // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is (repr(C),
            // 40 bytes); the fd is a tun fd this function owns.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
            if r < 0 {
                let err = io::Error::last_os_error();
                return Err(match err.raw_os_error() {
                    Some(libc::EPERM) | Some(libc::EACCES) => TapError::Permission(name.to_string()),
                    Some(libc::EBUSY) => TapError::Busy(name.to_string()),
                    Some(libc::EINVAL) => TapError::Mismatch { name: name.to_string(), queues },
                    _ => TapError::Flags { name: name.to_string(), queues, err },
                });
            }
            set_vnet_hdr_size(&f, name)?;
            files.push(f);
        }
        Self::with_queues(name.to_string(), files, multi_queue, offloads)
    }

    /// The tap on its prepared queues, its offloads cleared or kept.
    fn with_queues(
        name: String,
        queues: Vec<File>,
        multi_queue: bool,
        offloads: OpenOffloads,
    ) -> Result<Self, TapError> {
        let tx_rings = queues
            .iter()
            .map(|f| {
                TxRing::new(f.as_raw_fd())
                    .inspect_err(|e| tracing::debug!(tap = %name, "no io_uring for TX batches: {e}"))
                    .ok()
            })
            .collect();
        let mut tap =
            Tap { name, tx_rings, queues, multi_queue, attached: true, offloads: host_offloads(), applied: None };
        if offloads == OpenOffloads::Clear {
            tap.set_offload(0).map_err(|err| TapError::Ioctl {
                name: tap.name.clone(),
                what: "clearing offloads",
                err,
            })?;
        }
        Ok(tap)
    }

    /// Attaches `queues` queues of tap `name`, which must exist already (a tap the host set up,
    /// rather than a new one nobody configured). A tap made `multi_queue` is attached that way
    /// even for one queue: then two processes may hold it at once, which a migration between two
    /// kumo processes on one host needs.
    pub fn attach(name: &str, queues: usize, offloads: OpenOffloads) -> Result<Self, TapError> {
        let multi = Self::check(name, queues)?;
        Self::open_with(name, queues, multi, offloads)
    }

    /// Checks, without opening it, that tap `name` exists and can take `queues` queues;
    /// returns whether it is multi-queue. A migration's destination checks its taps so before
    /// it builds anything.
    pub fn check(name: &str, queues: usize) -> Result<bool, TapError> {
        check_name(name)?;
        let dir = std::path::Path::new("/sys/class/net").join(name);
        if !dir.exists() {
            return Err(TapError::Unknown(name.to_string()));
        }
        let flags = std::fs::read_to_string(dir.join("tun_flags")).map_err(|_| TapError::NotTap(name.to_string()))?;
        let flags = i64::from_str_radix(flags.trim().trim_start_matches("0x"), 16).unwrap_or(0);
        let multi = flags & i64::from(IFF_MULTI_QUEUE) != 0;
        if queues > 1 && !multi {
            return Err(TapError::SingleQueue { name: name.to_string(), queues });
        }
        Ok(multi)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What TUNGETIFF says of `fd`, a tap queue someone else opened (a CH client's `fds`):
    /// its tap's name and whether it is multi-queue. Refused unless kumo can drive it: a tap
    /// (not a tun) without packet information and with vnet headers (`IFF_TAP | IFF_NO_PI |
    /// IFF_VNET_HDR`, as libvirt opens them).
    pub fn inspect(fd: BorrowedFd<'_>) -> Result<TapFdInfo, TapError> {
        let raw = fd.as_raw_fd();
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        // SAFETY: TUNGETIFF writes one `struct ifreq`, which `req` is (repr(C), 40 bytes); any
        // other kind of descriptor refuses the ioctl.
        let r = unsafe { libc::ioctl(raw, TUNGETIFF as _, &mut req as *mut IfReq) };
        if r < 0 {
            let err = io::Error::last_os_error();
            let why = match err.raw_os_error() {
                Some(libc::EBADFD) => "a tun/tap descriptor attached to no interface".to_string(),
                Some(libc::ENOTTY | libc::EINVAL) => "TUNGETIFF refused it (not /dev/net/tun)".to_string(),
                _ => format!("TUNGETIFF: {err}"),
            };
            return Err(TapError::NotTapFd { fd: raw, why });
        }
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(libc::IFNAMSIZ);
        let name = String::from_utf8_lossy(&req.name[..len]).into_owned();
        let bad = |why: &str| Err(TapError::NotTapFd { fd: raw, why: format!("{name}: {why}") });
        if req.flags & IFF_TAP == 0 {
            return bad("a tun, not a tap (kumo's NICs carry Ethernet frames)");
        }
        if req.flags & IFF_NO_PI == 0 {
            return bad("opened without IFF_NO_PI (its frames carry packet information kumo does not read)");
        }
        if req.flags & IFF_VNET_HDR == 0 {
            return bad("opened without IFF_VNET_HDR (kumo's frames carry virtio-net headers)");
        }
        Ok(TapFdInfo { name, multi_queue: req.flags & IFF_MULTI_QUEUE != 0 })
    }

    /// A tap on descriptors someone else opened and passed (a CH client's `fds`), one per
    /// queue pair, all of one tap ([`Tap::inspect`] each); made non-blocking, with kumo's
    /// vnet header size, as [`Tap::attach`] leaves its own.
    pub fn from_fds(fds: Vec<OwnedFd>, offloads: OpenOffloads) -> Result<Self, TapError> {
        let info = Self::inspect_all(fds.iter().map(AsFd::as_fd))?;
        let name = info.name;
        for fd in &fds {
            let raw = fd.as_raw_fd();
            // SAFETY: F_GETFL/F_SETFL read and set a live descriptor's status flags.
            let r = unsafe {
                let flags = libc::fcntl(raw, libc::F_GETFL);
                if flags < 0 {
                    flags
                } else {
                    libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK)
                }
            };
            if r < 0 {
                let err = io::Error::last_os_error();
                return Err(TapError::Ioctl { name, what: "making it non-blocking", err });
            }
            set_vnet_hdr_size(fd, &name)?;
        }
        Self::with_queues(name, fds.into_iter().map(File::from).collect(), info.multi_queue, offloads)
    }

    /// [`Tap::inspect`] of each of `fds`, which must be queues of one tap (multi-queue if more
    /// than one): that tap.
    pub fn inspect_all<'a>(fds: impl IntoIterator<Item = BorrowedFd<'a>>) -> Result<TapFdInfo, TapError> {
        let (mut info, mut n): (Option<TapFdInfo>, usize) = (None, 0);
        for fd in fds {
            let i = Self::inspect(fd)?;
            n += 1;
            match &info {
                Some(first) if first.name != i.name => return Err(TapError::MixedFds(first.name.clone(), i.name)),
                _ => info = Some(i),
            }
        }
        let info = info.ok_or_else(|| TapError::NotTapFd { fd: -1, why: "none given".into() })?;
        if n > 1 && !info.multi_queue {
            return Err(TapError::SingleQueue { name: info.name, queues: n });
        }
        Ok(info)
    }

    /// Attaches or detaches this process's queues of a multi-queue tap: the kernel hands frames
    /// only to attached queues, so a migration's destination keeps its queues detached until it
    /// runs, and its source detaches them when it stops for good. Attached again, the queues
    /// get this process's offload flags again (a destination that failed may have changed
    /// them). A single-queue tap always stays attached (Ok, nothing done).
    pub fn set_attached(&mut self, on: bool) -> io::Result<()> {
        if !self.multi_queue || self.attached == on {
            return Ok(());
        }
        for f in &self.queues {
            let flags = if on { IFF_ATTACH_QUEUE } else { IFF_DETACH_QUEUE };
            let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags, _pad: [0; 22] };
            // SAFETY: TUNSETQUEUE reads one `struct ifreq` (only its flags), which `req` is; the
            // fd is one of this tap's.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETQUEUE as _, &mut req as *mut IfReq) };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        self.attached = on;
        match self.applied {
            Some(flags) if on => self.tun_offload(flags),
            _ => Ok(()),
        }
    }
}

impl NetBackend for Tap {
    fn pairs(&self) -> usize {
        self.queues.len()
    }

    fn recv(&mut self, pair: usize, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let f = self.queues.get_mut(pair).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        match f.read(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn send(&mut self, pair: usize, frame: &[u8]) -> io::Result<()> {
        let f = self.queues.get_mut(pair).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // A tap write takes one whole frame or fails (a full queue drops it).
        f.write(frame).map(|_| ())
    }

    fn send_guest(&mut self, pair: usize, frame: &GuestSlice<'_>) -> Option<io::Result<()>> {
        use vm_memory::WriteVolatile;
        let f = match self.queues.get_mut(pair) {
            Some(f) => f,
            None => return Some(Err(io::Error::from(io::ErrorKind::InvalidInput))),
        };
        // The kernel copies the frame out of guest memory as it builds the packet (a driver
        // that changes it meanwhile changes only its own packet): no copy here first.
        Some(f.write_volatile(frame).map(|_| ()).map_err(io::Error::other))
    }

    fn send_guest_batch(&mut self, pair: usize, frames: &[GuestSlice<'_>], results: &mut Vec<io::Result<()>>) -> bool {
        // One frame is one write(2) either way, and write(2) is the shorter path for it (a
        // round trip's reply is such a pass).
        if frames.len() < 2 {
            return false;
        }
        let Some(ring) = self.tx_rings.get_mut(pair).and_then(Option::as_mut) else { return false };
        if let Err(e) = ring.write_all(frames, results) {
            tracing::warn!(tap = %self.name, pair, "TX io_uring failed, writing frames one by one from now: {e}");
            self.tx_rings[pair] = None;
        }
        true
    }

    fn fd(&self, pair: usize) -> Option<RawFd> {
        self.queues.get(pair).map(|f| f.as_raw_fd())
    }

    fn offloads(&self) -> u64 {
        self.offloads
    }

    fn set_offload(&mut self, guest: u64) -> io::Result<()> {
        self.tun_offload(tun_flags(guest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_first() {
        for bad in ["", "a/b", "sixteen-chars-xx", "with space", "a:1"] {
            let e = Tap::open(bad, 1).unwrap_err();
            assert!(matches!(e, TapError::Name(_)), "{bad:?}: {e}");
        }
    }

    /// Opens a fresh tap; skips (None) where tun or TUNSETIFF is not available.
    fn try_open(name: &str, queues: usize) -> Option<Tap> {
        match Tap::open(name, queues) {
            Ok(t) => Some(t),
            Err(e @ (TapError::Open(_) | TapError::Permission(_))) => {
                eprintln!("skipping: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_dropped_tap_is_free_for_the_next_owner_at_once() {
        // Its transmit ring must not keep the queue open past the drop (a single-queue tap
        // would be busy for the next VM until the kernel had torn the ring down).
        let name = format!("kd{}", std::process::id());
        // A child spawned meanwhile holds a copy of the queue until it execs: no `ip` now.
        let _no_spawn = no_spawn();
        for _ in 0..20 {
            let Some(tap) = try_open(&name, 1) else { return };
            drop(tap);
        }
    }

    #[test]
    fn attaches_a_multiqueue_tap_and_refuses_a_busy_one() {
        let name = format!("kt{}", std::process::id());
        let Some(mut tap) = try_open(&name, 2) else { return };
        assert_eq!(tap.pairs(), 2);
        assert!(tap.fd(0).is_some() && tap.fd(1).is_some() && tap.fd(2).is_none());
        let mut buf = [0u8; 64];
        assert_eq!(tap.recv(0, &mut buf).unwrap(), None, "nothing waits on a fresh tap");
        // This host's tap takes checksum and TCP segmentation offloads (and UDP's since 6.2).
        let can = tap.offloads();
        assert_ne!(can & crate::virtio::net::VIRTIO_NET_F_GUEST_TSO4, 0, "{can:#x}");
        tap.set_offload(crate::virtio::net::guest_offloads(can)).unwrap();
        tap.set_offload(0).unwrap();
        {
            use crate::virtio::net::*;
            let (csum, uso4, uso6) = (VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_USO4, VIRTIO_NET_F_GUEST_USO6);
            // Linux takes UDP segmentation for both IP versions or neither.
            assert_eq!(tun_flags(csum | uso4), TUN_F_CSUM);
            assert_eq!(tun_flags(csum | uso4 | uso6), TUN_F_CSUM | TUN_F_USO4 | TUN_F_USO6);
            tap.set_offload(csum | uso4).unwrap();
            tap.set_offload(0).unwrap();
        }
        // The same tap single-queue: its flags differ from the multi-queue one's.
        let e = Tap::open(&name, 1).unwrap_err();
        assert!(matches!(e, TapError::Mismatch { queues: 1, .. }), "{e}");
        // attach: only taps that exist; a multi-queue tap is attached as one even for 1 queue.
        assert_eq!(Tap::attach(&name, 2, OpenOffloads::Clear).unwrap().pairs(), 2);
        let mut one = Tap::attach(&name, 1, OpenOffloads::Clear).unwrap();
        assert_eq!(one.pairs(), 1);
        one.set_attached(false).unwrap();
        one.set_attached(false).unwrap();
        one.set_attached(true).unwrap();
        let e = Tap::attach("kumo-no-such", 1, OpenOffloads::Clear).unwrap_err().to_string();
        assert_eq!(e, "no network interface named kumo-no-such (create it with `ip tuntap add kumo-no-such mode tap`)");
        let e = Tap::attach("lo", 1, OpenOffloads::Clear).unwrap_err().to_string();
        assert_eq!(e, "lo is a network interface but not a tap");

        let single = format!("ks{}", std::process::id());
        let Some(_a) = try_open(&single, 1) else { return };
        let e = Tap::open(&single, 1).unwrap_err();
        assert!(matches!(e, TapError::Busy(_)), "{e}");
        let e = Tap::attach(&single, 2, OpenOffloads::Clear).unwrap_err();
        assert!(matches!(e, TapError::SingleQueue { queues: 2, .. }), "more queues than a single-queue tap has: {e}");
        assert_eq!(e.to_string(), format!("tap {single} cannot take 2 queue pairs: it was made without multi_queue"));
        assert!(!Tap::check(&single, 1).unwrap() && Tap::check(&name, 2).unwrap());
    }

    /// Whether the kernel segments TCP for tap `name` (ETHTOOL_GTSO): on only while the tap's
    /// flags take TSO, so it shows what TUNSETOFFLOAD last set.
    fn tso_on(name: &str) -> bool {
        #[repr(C)]
        struct Value {
            cmd: u32,
            data: u32,
        }
        #[repr(C)]
        struct Req {
            name: [u8; libc::IFNAMSIZ],
            data: *mut Value,
            _pad: [u8; 16],
        }
        const SIOCETHTOOL: libc::c_ulong = 0x8946;
        const ETHTOOL_GTSO: u32 = 0x1e;
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut v = Value { cmd: ETHTOOL_GTSO, data: 0 };
        let mut req = Req { name: [0; libc::IFNAMSIZ], data: &mut v, _pad: [0; 16] };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: SIOCETHTOOL reads one ifreq whose data points at one ethtool_value, both
        // alive for the call.
        let r = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCETHTOOL as _, &mut req as *mut Req) };
        assert_eq!(r, 0, "ETHTOOL_GTSO on {name}: {}", io::Error::last_os_error());
        v.data != 0
    }

    #[test]
    fn a_migrations_destination_leaves_the_sources_offloads_as_they_are() {
        use crate::virtio::net::{VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4};
        let name = format!("ko{}", std::process::id());
        let Some(mut source) = try_open(&name, 2) else { return };
        assert!(!tso_on(&name), "a tap kumo opens has no offloads");
        source.set_offload(VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_GUEST_TSO4).unwrap();
        assert!(tso_on(&name));
        // A destination attaches the tap while its source runs: the source's guest keeps them.
        let mut dest = Tap::attach(&name, 2, OpenOffloads::Keep).unwrap();
        dest.set_attached(false).unwrap();
        assert!(tso_on(&name), "the destination changed the running source's offloads");
        // A VM that is not arriving starts with none.
        drop(Tap::attach(&name, 2, OpenOffloads::Clear).unwrap());
        assert!(!tso_on(&name));
        // A source that gets its queues back (a failed migration) gets its flags back too.
        source.set_attached(false).unwrap();
        source.set_attached(true).unwrap();
        assert!(tso_on(&name), "the source's offloads were not set again when it took its queues back");
    }

    /// A tap queue opened as a CH client opens one (TUNSETIFF with `flags`); None without tun.
    fn client_fd(name: &str, flags: libc::c_short) -> Option<OwnedFd> {
        let f = OpenOptions::new().read(true).write(true).open(TUN_PATH).ok()?;
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags, _pad: [0; 22] };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF on a tun fd this test owns, with one `struct ifreq`.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
        (r == 0).then(|| f.into())
    }

    #[test]
    fn a_tap_from_descriptors_is_checked_with_tungetiff() {
        let null = File::open("/dev/null").unwrap();
        let e = Tap::inspect(null.as_fd()).unwrap_err().to_string();
        assert!(e.contains("is not a tap's") && e.contains("TUNGETIFF"), "{e}");
        let name = format!("kf{}", std::process::id());
        let Some(good) = client_fd(&name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR) else {
            eprintln!("skipping: cannot open a tap (no /dev/net/tun or CAP_NET_ADMIN)");
            return;
        };
        assert_eq!(Tap::inspect(good.as_fd()).unwrap(), TapFdInfo { name: name.clone(), multi_queue: false });
        let tap = Tap::from_fds(vec![good], OpenOffloads::Clear).unwrap();
        assert_eq!((tap.name(), tap.pairs()), (name.as_str(), 1));
        let plain = format!("kp{}", std::process::id());
        let Some(no_hdr) = client_fd(&plain, IFF_TAP | IFF_NO_PI) else { return };
        let e = Tap::from_fds(vec![no_hdr], OpenOffloads::Clear).unwrap_err().to_string();
        assert!(e.contains("without IFF_VNET_HDR"), "{e}");
    }

    /// Held while a test spawns a process or needs none spawned: between fork and exec a child
    /// holds a copy of every descriptor, so a tap dropped then is busy until the child execs.
    fn no_spawn() -> std::sync::MutexGuard<'static, ()> {
        static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        SPAWN.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ip(args: &[&str]) -> bool {
        let _spawning = no_spawn();
        std::process::Command::new("ip").args(args).output().map(|o| o.status.success()).unwrap_or(false)
    }

    /// Waits (bounded) for `fd` to become readable.
    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, 10_000) > 0 }
    }

    /// An AF_PACKET socket that sees frames of the local experimental ethertype arriving on
    /// interface `name` (None where it cannot be made).
    fn packet_socket(name: &str) -> Option<OwnedFd> {
        use std::os::fd::FromRawFd;
        let proto = 0x88b5u16.to_be();
        // SAFETY: socket(2) with constant arguments; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto.into()) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is a fresh socket this function owns from here on.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let index = std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex")).ok()?.trim().parse().ok()?;
        // SAFETY: sockaddr_ll is plain old data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = index;
        let len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: binds the socket to one sockaddr_ll of the size given.
        let r = unsafe { libc::bind(fd, (&addr as *const libc::sockaddr_ll).cast(), len) };
        (r == 0).then_some(sock)
    }

    #[test]
    fn frames_cross_between_guest_memory_and_the_host() {
        use std::sync::Arc;
        use vm_memory::{Bytes, GuestAddress};

        use crate::virtio::net::{Net, NetConfig};
        use crate::virtio::pci_transport::VirtioPciTransport;
        use crate::virtio::testutil::*;
        use crate::virtio::VIRTIO_F_VERSION_1;

        let pid = std::process::id();
        let name = format!("kn{pid}");
        let Some(tap) = try_open(&name, 1) else { return };
        let subnet = format!("10.197.{}", pid % 250);
        if !ip(&["link", "set", &name, "up"]) || !ip(&["addr", "add", &format!("{subnet}.1/24"), "dev", &name]) {
            eprintln!("skipping: cannot configure {name} with `ip`");
            return;
        }
        let mac = [0x52, 0x54, 0, 0xaa, 0xbb, 0xcc];
        let net = Net::new(NetConfig { mac, pairs: 1, offload: false }, tap).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("net0", net, mem.clone(), shared(&irqs), 4);
        let mut qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 16)).collect();
        bring_up(&mut t, VIRTIO_F_VERSION_1, &qs);

        // TX: a broadcast frame from the guest is received by the host's interface.
        let stat = format!("/sys/class/net/{name}/statistics/rx_packets");
        let count = || std::fs::read_to_string(&stat).unwrap().trim().parse::<u64>().unwrap();
        let before = count();
        let mut f = vec![0u8; VNET_HDR_LEN];
        f.extend([0xff; 6]);
        f.extend(mac);
        f.extend([0x88, 0xb5]); // the local experimental ethertype
        f.extend([0x5a; 46]);
        mem.write_slice(&f, GuestAddress(BUF_BASE)).unwrap();
        qs[1].add_chain(&mem, &[(BUF_BASE, f.len() as u32, false)]);
        kick(&mut t, 1);
        assert_eq!(t.device().counters().tx_frames, 1);
        assert_eq!(count(), before + 1);

        // A pass of 12 frames goes to the tap as one batch (its io_uring where the host has
        // one): the host receives them all, in the driver's order.
        if t.device().backend().tx_rings[0].is_none() {
            eprintln!("no io_uring here: the frames are written one by one");
        }
        let raw = packet_socket(&name);
        for i in 0..12u64 {
            let mut g = f.clone();
            g[VNET_HDR_LEN + 14] = i as u8;
            let at = BUF_BASE + 0x800 * (i + 1);
            mem.write_slice(&g, GuestAddress(at)).unwrap();
            qs[1].add_chain(&mem, &[(at, g.len() as u32, false)]);
        }
        kick(&mut t, 1);
        assert_eq!((t.device().counters().tx_frames, t.device().counters().tx_dropped), (13, 0));
        assert_eq!(count(), before + 13);
        if let Some(raw) = raw {
            let mut seen = Vec::new();
            let mut buf = [0u8; 128];
            while seen.len() < 12 && readable(raw.as_raw_fd()) {
                // SAFETY: reads at most buf.len() bytes into buf from a socket this test owns.
                let n = unsafe { libc::recv(raw.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                assert!(n > 14, "a frame from the packet socket");
                seen.push(buf[14]);
            }
            assert_eq!(seen, (0..12).collect::<Vec<u8>>(), "the frames in the driver's order");
        }

        // RX: the host ARPs for a neighbour on the tap's subnet; the request lands in a guest
        // buffer with its vnet header (IPv6 chatter from the link coming up may come first).
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        sock.send_to(b"x", format!("{subnet}.2:9")).unwrap();
        let target: Vec<u8> = subnet.split('.').map(|b| b.parse::<u8>().unwrap()).chain([2]).collect();
        let fd = t.device().backend().fd(0).unwrap();
        let mut found = false;
        for i in 0..32u64 {
            let buf = BUF_BASE + 0x1_0000 + i * 0x1000;
            qs[0].add_chain(&mem, &[(buf, 2048, true)]);
            kick(&mut t, 0);
            while qs[0].used_idx(&mem) == i as u16 {
                if !readable(fd) {
                    panic!("no frame from {name} within the poll bound");
                }
                t.device_mut().backend_ready(0);
            }
            let (_, len) = qs[0].used_elem(&mem, i as u16);
            let mut got = vec![0u8; len as usize];
            mem.read_slice(&mut got, GuestAddress(buf)).unwrap();
            let eth = &got[VNET_HDR_LEN..];
            // ARP: ethertype 0x0806, target protocol address at 24..28 of the ARP body.
            if eth.len() >= 42 && eth[12..14] == [0x08, 0x06] && eth[14 + 24..14 + 28] == target[..] {
                assert_eq!(eth[..6], [0xff; 6], "an ARP request is broadcast");
                found = true;
                break;
            }
        }
        assert!(found, "the host's ARP request reached the guest");
        assert!(!irqs.take().is_empty());
    }

    /// The one's-complement sum of `data` as 16-bit big-endian words, folded.
    fn fold(mut sum: u32, data: &[u8]) -> u16 {
        for c in data.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u16
    }

    /// A vnet header and an Ethernet frame holding one UDP/IPv4 datagram of `payload` from
    /// `src` to `dst`, to be cut into `seg`-byte datagrams by the host (GSO UDP_L4, checksum
    /// left for the host to fill: the UDP field holds the pseudo-header's sum).
    fn udp_super_frame(macs: ([u8; 6], [u8; 6]), src: [u8; 4], dst: [u8; 4], payload: &[u8], seg: u16) -> Vec<u8> {
        let udp_len = 8 + payload.len();
        let mut f = vec![0u8; VNET_HDR_LEN];
        f[0] = 1; // VIRTIO_NET_HDR_F_NEEDS_CSUM
        f[1] = 5; // VIRTIO_NET_HDR_GSO_UDP_L4
        f[2..4].copy_from_slice(&42u16.to_le_bytes()); // hdr_len: Ethernet, IPv4, UDP
        f[4..6].copy_from_slice(&seg.to_le_bytes());
        f[6..8].copy_from_slice(&34u16.to_le_bytes()); // csum_start: the UDP header
        f[8..10].copy_from_slice(&6u16.to_le_bytes()); // csum_offset: its checksum field
        f.extend(macs.0);
        f.extend(macs.1);
        f.extend([0x08, 0x00]);
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
        ip[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
        ip.extend(src);
        ip.extend(dst);
        let c = !fold(0, &ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend(ip);
        let pseudo = fold(17 + udp_len as u32, &[src, dst].concat());
        f.extend(4000u16.to_be_bytes());
        f.extend(9000u16.to_be_bytes());
        f.extend((udp_len as u16).to_be_bytes());
        f.extend(pseudo.to_be_bytes());
        f.extend(payload);
        f
    }

    /// A UDP socket's next datagram, or None once nothing came within the poll bound.
    fn next_datagram(sock: &std::net::UdpSocket, buf: &mut [u8]) -> Option<usize> {
        readable(sock.as_raw_fd()).then(|| sock.recv(buf).ok()).flatten()
    }

    #[test]
    fn udp_segmentation_offload_crosses_the_tap_both_ways() {
        use std::sync::Arc;
        use vm_memory::{Bytes, GuestAddress};

        use crate::virtio::net::*;
        use crate::virtio::pci_transport::VirtioPciTransport;
        use crate::virtio::testutil::*;

        let pid = std::process::id();
        let name = format!("ku{pid}");
        let Some(tap) = try_open(&name, 1) else { return };
        if tap.offloads() & VIRTIO_NET_F_HOST_USO == 0 {
            eprintln!("skipping: this host's taps take no UDP segmentation offload (Linux < 6.2)");
            return;
        }
        let sub = [10, 199, (pid % 250) as u8];
        let (host, guest) = ([sub[0], sub[1], sub[2], 1], [sub[0], sub[1], sub[2], 2]);
        let dotted = |a: [u8; 4]| format!("{}.{}.{}.{}", a[0], a[1], a[2], a[3]);
        let guest_mac = [0x52, 0x54, 0, 0xaa, 0xbb, 0xcd];
        let mac_text = guest_mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
        let configured = ip(&["link", "set", &name, "up"])
            && ip(&["addr", "add", &format!("{}/24", dotted(host)), "dev", &name])
            && ip(&["neigh", "replace", &dotted(guest), "lladdr", &mac_text, "dev", &name]);
        if !configured {
            eprintln!("skipping: cannot configure {name} with `ip`");
            return;
        }
        let tap_mac: Vec<u8> = std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
            .unwrap()
            .trim()
            .split(':')
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect();
        let net = Net::new(NetConfig { mac: guest_mac, pairs: 1, offload: true }, tap).unwrap();
        let mem = memory();
        let irqs = Arc::new(Irqs::default());
        let mut t = VirtioPciTransport::new("net0", net, mem.clone(), shared(&irqs), 4);
        let mut qs: Vec<GuestQueue> = (0..2).map(|i| GuestQueue::new(i, 16)).collect();
        let features = VIRTIO_F_VERSION_1
            | VIRTIO_NET_F_MRG_RXBUF
            | VIRTIO_NET_F_CSUM
            | VIRTIO_NET_F_HOST_USO
            | VIRTIO_NET_F_GUEST_CSUM
            | VIRTIO_NET_F_GUEST_USO4
            | VIRTIO_NET_F_GUEST_USO6;
        assert_eq!(t.device().features() & features, features, "{:#x}", t.device().features());
        let st = bring_up(&mut t, features, &qs);
        assert_ne!(st & crate::virtio::status::DRIVER_OK, 0, "status {st:#x}");

        // Guest -> host: one 4,000-byte datagram leaves as forty 100-byte ones, checksummed.
        let sink = std::net::UdpSocket::bind((dotted(host), 9000)).unwrap();
        let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
        let f = udp_super_frame((tap_mac.clone().try_into().unwrap(), guest_mac), guest, host, &payload, 100);
        mem.write_slice(&f, GuestAddress(BUF_BASE)).unwrap();
        qs[1].add_chain(&mem, &[(BUF_BASE, f.len() as u32, false)]);
        kick(&mut t, 1);
        assert_eq!((t.device().counters().tx_frames, t.device().counters().tx_dropped), (1, 0));
        let (mut got, mut buf) = (Vec::<u8>::new(), [0u8; 2048]);
        while got.len() < payload.len() {
            let n = next_datagram(&sink, &mut buf).expect("the host received every segment");
            assert_eq!(n, 100, "segments of gso_size");
            got.extend(&buf[..n]);
        }
        assert_eq!(got, payload);

        // Host -> guest: a 3,000-byte UDP_SEGMENT send reaches the guest as one frame that says
        // how to cut it (gso_type UDP_L4, gso_size 100), over as many buffers as it needs.
        let src = std::net::UdpSocket::bind((dotted(host), 0)).unwrap();
        let seg: libc::c_int = 100;
        // SAFETY: setsockopt(SOL_UDP, UDP_SEGMENT) reads one int from the pointer given.
        let r =
            unsafe { libc::setsockopt(src.as_raw_fd(), libc::SOL_UDP, 103, (&seg as *const libc::c_int).cast(), 4) };
        assert_eq!(r, 0, "UDP_SEGMENT: {}", io::Error::last_os_error());
        src.send_to(&payload[..3000], (dotted(guest), 9000)).unwrap();
        for i in 0..4u64 {
            let at = BUF_BASE + 0x1_0000 + i * 0x1000;
            qs[0].add_chain(&mem, &[(at, 4096, true)]);
        }
        kick(&mut t, 0);
        let fd = t.device().backend().fd(0).unwrap();
        while qs[0].used_idx(&mem) == 0 {
            assert!(readable(fd), "no frame from {name} within the poll bound");
            t.device_mut().backend_ready(0);
        }
        let (_, len) = qs[0].used_elem(&mem, 0);
        let mut hdr = [0u8; VNET_HDR_LEN];
        mem.read_slice(&mut hdr, GuestAddress(BUF_BASE + 0x1_0000)).unwrap();
        let (gso_type, gso_size, buffers) = (hdr[1], u16::from_le_bytes([hdr[4], hdr[5]]), hdr[10]);
        assert_eq!((gso_type, gso_size), (5, 100), "one UDP super-frame: {hdr:?}");
        assert_eq!(buffers, 1, "3,054 bytes fit the first 4 KiB buffer");
        assert_eq!(len as usize, VNET_HDR_LEN + 14 + 20 + 8 + 3000);
    }
}
