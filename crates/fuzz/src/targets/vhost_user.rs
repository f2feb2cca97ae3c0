//! `kumo net-backend`'s vhost-user side (`kumo_net_backend::Server::serve_client`: the relay
//! and the `vhost-user-backend` daemon behind it): a frontend's messages, mostly a plausible
//! setup sequence with arbitrary values, over a socketpair, with eventfds and memfds attached
//! where a request takes them.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::Arbitrary;
use kumo_devices::virtio::net::Loopback;
use kumo_net_backend::{Nic, Server};
use kumo_sandbox::ThreadKind;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::{CaseResult, Input};

const VERSION: u32 = 0x1;
const NEED_REPLY: u32 = 0x8;
const REPLY: u32 = 0x4;
/// The memfd backing "guest memory": regions stay inside it (a region past a file's end
/// would fault the backend with SIGBUS: a frontend is trusted with its memory table).
const MEMFD_SIZE: u64 = 1 << 20;
/// The frontend's address of that memory.
const UADDR: u64 = 0x7f00_0000_0000;

/// Requests that take fds: memory table, log, vring kick/call/err, backend channel, inflight,
/// memory slot.
const WITH_FDS: [u32; 9] = [5, 6, 7, 12, 13, 14, 21, 32, 37];

#[derive(Debug, Arbitrary)]
enum Body {
    Empty,
    U64(u64),
    /// Vring state: index and num/base.
    State(u32, u32),
    /// Vring addresses: index, flags, descriptor, used, available, log.
    Addr(u32, u32, u64, u64, u64, u64),
    /// Memory regions: guest address, size, user address, offset (kept inside the memfd).
    Mem(Vec<(u64, u32, u64, u32)>),
    /// Config space access: offset, size, flags, payload.
    Config(u32, u32, u32, Vec<u8>),
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
struct Msg {
    request: u8,
    need_reply: bool,
    body: Body,
    /// A size field that lies now and then.
    size_delta: Option<i8>,
    fds: u8,
}

fn body_bytes(b: &Body) -> (Vec<u8>, usize) {
    let mut v = Vec::new();
    let mut regions = 0;
    match b {
        Body::Empty => {}
        Body::U64(x) => v.extend(x.to_le_bytes()),
        Body::State(i, n) => [i, n].iter().for_each(|x| v.extend(x.to_le_bytes())),
        Body::Addr(i, f, d, u, a, l) => {
            v.extend(i.to_le_bytes());
            v.extend(f.to_le_bytes());
            [d, u, a, l].iter().for_each(|x| v.extend(x.to_le_bytes()));
        }
        Body::Mem(rs) => {
            let rs = &rs[..rs.len().min(9)];
            regions = rs.len();
            v.extend((rs.len() as u32).to_le_bytes());
            v.extend(0u32.to_le_bytes());
            for &(gpa, size, uaddr, offset) in rs {
                let offset = (offset as u64 % MEMFD_SIZE) & !0xfff;
                let size = (size as u64 % (MEMFD_SIZE - offset)).max(0x1000) & !0xfff;
                [gpa & !0xfff, size, uaddr, offset].iter().for_each(|x| v.extend(x.to_le_bytes()));
            }
        }
        Body::Config(off, size, flags, payload) => {
            [off, size, flags].iter().for_each(|x| v.extend(x.to_le_bytes()));
            v.extend(payload);
        }
        Body::Raw(r) => v.extend(r),
    }
    (v, regions)
}

/// Makes one setup message's body.
type MakeBody = fn(&mut Input<'_>) -> arbitrary::Result<Body>;

/// The setup a frontend (kumo's `nic_vhost_user`) makes, with arbitrary values.
fn plausible(u: &mut Input<'_>) -> arbitrary::Result<Vec<Msg>> {
    let mut out = Vec::new();
    let steps: [(u8, MakeBody); 12] = [
        (3, |_| Ok(Body::Empty)),
        (1, |_| Ok(Body::Empty)),
        (2, |u| Ok(Body::U64(if u.ratio(3, 4)? { kumo_net_backend::backend::FEATURES } else { u.arbitrary()? }))),
        (15, |_| Ok(Body::Empty)),
        (16, |u| Ok(Body::U64(if u.ratio(3, 4)? { 0x229 } else { u.arbitrary()? }))),
        (5, |u| {
            Ok(Body::Mem(vec![(0, (MEMFD_SIZE - 1) as u32, if u.ratio(3, 4)? { UADDR } else { u.arbitrary()? }, 0)]))
        }),
        (8, |u| Ok(Body::State(u.int_in_range(0..=2)?, if u.ratio(3, 4)? { 256 } else { u.arbitrary()? }))),
        (9, |u| {
            let i = u.int_in_range(0..=2)?;
            let at = |k: u64| UADDR + 0x4000 * (i as u64 * 4 + k);
            if u.ratio(3, 4)? {
                Ok(Body::Addr(i, 0, at(1), at(3), at(2), 0))
            } else {
                Ok(Body::Addr(i, 0, u.arbitrary()?, u.arbitrary()?, u.arbitrary()?, 0))
            }
        }),
        (10, |u| Ok(Body::State(u.int_in_range(0..=2)?, if u.ratio(3, 4)? { 0 } else { u.arbitrary()? }))),
        (12, |u| Ok(Body::U64(u.int_in_range(0..=2)?))),
        (13, |u| Ok(Body::U64(u.int_in_range(0..=2)?))),
        (18, |u| Ok(Body::State(u.int_in_range(0..=2)?, u.ratio(3, 4)? as u32))),
    ];
    for (request, body) in steps {
        if u.ratio(1, 16)? {
            continue;
        }
        out.push(Msg { request, need_reply: u.arbitrary()?, body: body(u)?, size_delta: None, fds: 1 });
    }
    Ok(out)
}

fn eventfd() -> OwnedFd {
    // SAFETY: eventfd takes no pointers; a valid fd is owned once, here.
    unsafe { OwnedFd::from_raw_fd(libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)) }
}

fn memfd() -> OwnedFd {
    // SAFETY: the name is a NUL-terminated literal; the new fd is owned once, here.
    let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"kumo-fuzz".as_ptr(), libc::MFD_CLOEXEC)) };
    // SAFETY: ftruncate on the fd just created.
    unsafe { libc::ftruncate(fd.as_raw_fd(), MEMFD_SIZE as libc::off_t) };
    fd
}

/// What the frontend keeps of a session: its guest memory and the kick eventfds it sent.
struct Frontend {
    mem: OwnedFd,
    kicks: Vec<OwnedFd>,
}

fn send(s: &UnixStream, m: &Msg, fe: &mut Frontend) -> std::io::Result<()> {
    let (body, regions) = body_bytes(&m.body);
    let size = (body.len() as i64 + m.size_delta.unwrap_or(0) as i64).max(0) as u32;
    let flags = VERSION | if m.need_reply { NEED_REPLY } else { 0 };
    let mut msg = Vec::with_capacity(12 + body.len());
    [m.request as u32, flags, size].iter().for_each(|x| msg.extend(x.to_le_bytes()));
    msg.extend(&body);
    let request = m.request as u32;
    let fds: Vec<OwnedFd> = if !WITH_FDS.contains(&request) {
        Vec::new()
    } else if request == 5 || request == 37 {
        (0..regions.max(1)).map(|_| fe.mem.try_clone()).collect::<std::io::Result<_>>()?
    } else {
        (0..m.fds % 3).map(|_| if request == 21 { socket_end() } else { eventfd() }).collect()
    };
    if request == 12 {
        fds.iter().try_for_each(|f| f.try_clone().map(|k| fe.kicks.push(k)))?;
    }
    if fds.is_empty() {
        return (&mut &*s).write_all(&msg);
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let sent = s.send_with_fds(&[&msg[..]], &raw).map_err(std::io::Error::other)?;
    (&mut &*s).write_all(&msg[sent..])
}

/// Guest memory with arbitrary rings where the plausible setup puts them (and frames).
fn fill(mem: &OwnedFd, u: &mut Input<'_>) -> arbitrary::Result<()> {
    for _ in 0..u.int_in_range(0..=24)? {
        let at = u.int_in_range(0..=(3 * 4 + 3) as u64)? * 0x4000 + u.int_in_range(0..=0x40)? * 16;
        let bytes: Vec<u8> = u.arbitrary()?;
        // SAFETY: pwrite reads `bytes`, which lives across the call, into the memfd.
        unsafe { libc::pwrite(mem.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), at as libc::off_t) };
    }
    Ok(())
}

/// One end of a socketpair whose other end closes: a backend channel nobody reads.
fn socket_end() -> OwnedFd {
    let (a, _b) = UnixStream::pair().expect("socketpair");
    OwnedFd::from(a)
}

/// Reads replies until the `barriers`-th reply to GET_FEATURES (it is answered after every
/// message before it) or the backend hangs up; checks each is well-formed, flagged a reply, with
/// its whole body.
fn read_replies(front: &UnixStream, barriers: usize) -> usize {
    let mut seen = 0;
    let mut n = 0;
    loop {
        let mut hdr = [0u8; 12];
        match (&mut &*front).read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the backend answered nothing for 60 s with the connection open")
            }
            Err(_) => return n,
        }
        let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().expect("4 bytes"));
        let (request, flags, size) = (word(0), word(4), word(8) as usize);
        assert_eq!(flags & (VERSION | REPLY), VERSION | REPLY, "reply to {request} with flags {flags:#x}");
        assert!(size <= 4096, "a reply to {request} of {size} bytes");
        let mut body = vec![0u8; size];
        if (&mut &*front).read_exact(&mut body).is_err() {
            return n;
        }
        n += 1;
        if request == 1 {
            seen += 1;
            if seen == barriers {
                return n;
            }
        }
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let mut msgs = if u.ratio(3, 4)? { plausible(u)? } else { Vec::new() };
    let mut fe = Frontend { mem: memfd(), kicks: Vec::new() };
    fill(&fe.mem, u)?;
    while !u.is_empty() && msgs.len() < 40 {
        let mut m: Msg = u.arbitrary()?;
        m.request %= 48;
        if !u.ratio(1, 16)? {
            m.size_delta = None;
        }
        msgs.push(m);
    }
    let nic = Arc::new(Nic::new(Box::new(Loopback::new(1)), "tap-fuzz", [2, 0, 0, 0, 0, 1], u.arbitrary()?));
    let server = Server::new(nic.clone());
    let (front, back) = UnixStream::pair().expect("socketpair");
    let (done_tx, done_rx) = mpsc::channel();
    let t = kumo_sandbox::spawn(ThreadKind::NetBackend, "fuzz-client", move || {
        let r = server.serve_client(back);
        let _ = done_tx.send(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        r
    })
    .expect("spawn");
    // In step, the backend answers GET_FEATURES last: every message before it was handled.
    // A lying size field desynchronizes the stream: then only the hang-up is waited for.
    let framed = msgs.iter().all(|m| m.size_delta.is_none());
    if framed {
        msgs.push(Msg { request: 1, need_reply: false, body: Body::Empty, size_delta: None, fds: 0 });
    }
    let barriers = msgs.iter().filter(|m| m.request == 1).count();
    // A bound against a hang, not a timing: a live backend answers at once.
    front.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    for m in &msgs {
        if send(&front, m, &mut fe).is_err() {
            break; // the backend hung up on a message it refused
        }
    }
    let replies = if framed { read_replies(&front, barriers) } else { 0 };
    // The driver kicks: the backend walks the rings (its vring thread, not in step with this).
    for k in &fe.kicks {
        // SAFETY: writes 8 bytes from a local to an eventfd this session owns.
        unsafe { libc::write(k.as_raw_fd(), 1u64.to_ne_bytes().as_ptr().cast(), 8) };
    }
    let _ = front.shutdown(std::net::Shutdown::Write);
    read_replies(&front, usize::MAX);
    let Ok(served) = done_rx.recv_timeout(Duration::from_secs(60)) else {
        panic!("the backend did not end the connection after the frontend closed it");
    };
    let _ = t.join();
    if std::env::var_os("KUMO_FUZZ_DEBUG").is_some() {
        let codes: Vec<u8> = msgs.iter().map(|m| m.request).collect();
        let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
        eprintln!("{codes:?}: {replies} replies before the barrier; {served:?}; {fds} fds open");
    }
    let info = nic.info();
    assert_eq!(info.owner, None, "a client that left still owns the NIC");
    assert!(info.clients.is_empty(), "a client that left is still listed");
    Ok(())
}
