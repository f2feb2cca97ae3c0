//! End to end: kumo as a vhost-user-net frontend (`--net vhost-user=PATH`). The backend is this
//! test's own, built on rust-vmm's `vhost-user-backend` ([`LoopNet`]): it hands frames the test
//! injects to the guest's RX ring and gives the test every frame the guest transmits. kumo's
//! `netecho` guest brings the NIC up and echoes a UDP datagram through it; the backend takes the
//! link down and up again (CONFIG_CHANGE_MSG); then it hangs up and kumo must keep running with
//! the NIC's link down.
//!
//! Needs /dev/kvm; skips, saying why, where it is missing. Outcomes only: every wait is a safety
//! net far above need, nothing races a guest timer.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use kumo_testkit::*;
use vhost::vhost_user::{Backend, Listener, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};
use vmm_sys_util::eventfd::EventFd;

const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const VNET_HDR: usize = 12;
/// The epoll id of the test's "frames to inject" eventfd (0..=2 are the queues and the exit).
const INJECT: u16 = 3;

/// A loopback vhost-user-net backend: one RX/TX pair, MAC and link status in its config.
#[derive(Clone)]
struct LoopNet(Arc<Inner>);

struct Inner {
    event_idx: AtomicBool,
    link_up: AtomicBool,
    /// The backend request channel (a duplicate of the `Backend`'s socket, which is kept).
    req: Mutex<Option<(UnixStream, Backend)>>,
    mem: Mutex<Option<GuestMemoryAtomic<GuestMemoryMmap>>>,
    rx: Mutex<VecDeque<Vec<u8>>>,
    tx: Mutex<Sender<Vec<u8>>>,
    inject: EventFd,
}

impl LoopNet {
    fn new() -> (LoopNet, Receiver<Vec<u8>>) {
        let (tx, rx) = channel();
        let inner = Inner {
            event_idx: AtomicBool::new(false),
            link_up: AtomicBool::new(true),
            req: Mutex::new(None),
            mem: Mutex::new(None),
            rx: Mutex::new(VecDeque::new()),
            tx: Mutex::new(tx),
            inject: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        };
        (LoopNet(Arc::new(inner)), rx)
    }

    /// Queues `frame` (no vnet header) for the guest.
    fn inject(&self, frame: Vec<u8>) {
        self.0.rx.lock().unwrap().push_back(frame);
        self.0.inject.write(1).unwrap();
    }

    /// Sets the link status in the config and tells the frontend: VHOST_USER_BACKEND_CONFIG_CHANGE_MSG
    /// (request 2, version 1, no payload, no reply asked), written raw, since vhost's `Backend`
    /// has no call for it.
    fn set_link(&self, up: bool) {
        self.0.link_up.store(up, Ordering::Release);
        let mut req = self.0.req.lock().unwrap();
        let (sock, _) = req.as_mut().expect("the frontend gave a backend request channel");
        let msg: Vec<u8> = [2u32, 1, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        sock.write_all(&msg).expect("CONFIG_CHANGE_MSG");
    }

    /// Runs `serve` on the ring until it finds nothing more, re-arming notifications with
    /// EVENT_IDX so no kick is missed while `waiting()` (work is left that needs the guest's
    /// buffers); signals the guest if anything was used.
    fn drain(
        &self,
        vring: &VringRwLock,
        waiting: impl Fn() -> bool,
        mut serve: impl FnMut(&mut virtio_queue::Queue, &GuestMemoryMmap) -> bool,
    ) {
        let Some(mem) = self.0.mem.lock().unwrap().clone() else { return };
        let m = mem.memory();
        let event_idx = self.0.event_idx.load(Ordering::Relaxed);
        let mut used = false;
        loop {
            let mut g = vring.get_mut();
            let q = g.get_queue_mut();
            while serve(q, &m) {
                used = true;
            }
            if !event_idx || !waiting() || !q.enable_notification(&*m).unwrap_or(false) {
                break;
            }
        }
        if used {
            let notify = !event_idx || vring.get_mut().get_queue_mut().needs_notification(&*m).unwrap_or(true);
            if notify {
                let _ = vring.signal_used_queue();
            }
        }
    }

    fn rx(&self, vring: &VringRwLock) {
        self.drain(
            vring,
            || !self.0.rx.lock().unwrap().is_empty(),
            |q, m| {
                let Some(frame) = self.0.rx.lock().unwrap().front().cloned() else { return false };
                let Some(chain) = q.pop_descriptor_chain(m) else { return false };
                let head = chain.head_index();
                let mut w = chain.writer(m).expect("RX chain");
                let mut hdr = [0u8; VNET_HDR];
                hdr[10] = 1; // num_buffers
                w.write_all(&hdr).and_then(|()| w.write_all(&frame)).expect("RX buffer big enough");
                q.add_used(m, head, (VNET_HDR + frame.len()) as u32).unwrap();
                self.0.rx.lock().unwrap().pop_front();
                true
            },
        );
    }

    fn tx(&self, vring: &VringRwLock) {
        self.drain(
            vring,
            || true,
            |q, m| {
                let Some(chain) = q.pop_descriptor_chain(m) else { return false };
                let head = chain.head_index();
                let mut buf = Vec::new();
                chain.reader(m).expect("TX chain").read_to_end(&mut buf).unwrap();
                q.add_used(m, head, 0).unwrap();
                if buf.len() > VNET_HDR {
                    let _ = self.0.tx.lock().unwrap().send(buf[VNET_HDR..].to_vec());
                }
                true
            },
        );
    }
}

impl VhostUserBackend for LoopNet {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }

    fn max_queue_size(&self) -> usize {
        256
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_NET_F_MAC
            | 1 << VIRTIO_NET_F_STATUS
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.0.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        let fd = backend_req_fd().expect("the backend request channel's descriptor");
        // SAFETY: dup of an open descriptor; the duplicate is owned by the stream alone.
        let dup = unsafe { libc::dup(fd) };
        assert!(dup >= 0, "dup: {}", std::io::Error::last_os_error());
        // SAFETY: `dup` was just created and nothing else owns it.
        let sock = unsafe { UnixStream::from_raw_fd(dup) };
        *self.0.req.lock().unwrap() = Some((sock, backend));
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let mut c = MAC.to_vec();
        let status = if self.0.link_up.load(Ordering::Acquire) { VIRTIO_NET_S_LINK_UP as u16 } else { 0 };
        c.extend_from_slice(&status.to_le_bytes());
        c.extend_from_slice(&1u16.to_le_bytes());
        let mut out: Vec<u8> = c.into_iter().skip(offset as usize).take(size as usize).collect();
        out.resize(size as usize, 0);
        out
    }

    /// Lets the daemon stop its ring thread when it is dropped.
    fn exit_event(&self, _thread: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> std::io::Result<()> {
        *self.0.mem.lock().unwrap() = Some(mem);
        Ok(())
    }

    fn handle_event(&self, event: u16, _: EventSet, vrings: &[VringRwLock], _: usize) -> std::io::Result<()> {
        match event {
            0 => self.rx(&vrings[0]),
            1 => self.tx(&vrings[1]),
            INJECT => {
                let _ = self.0.inject.read();
                self.rx(&vrings[0]);
            }
            _ => {}
        }
        Ok(())
    }
}

/// The descriptor of the backend request channel vhost received a moment ago: vhost's `Backend`
/// does not show it. It is this process's only unix socket with no address whose peer is another
/// process (the connection from kumo has the listener's path; the test's own sockets are named).
fn backend_req_fd() -> Option<RawFd> {
    let me = std::process::id() as i32;
    let mut found = None;
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) else { continue };
        // SAFETY: plain getsockname/getsockopt into local buffers of the sizes given.
        let (named, peer) = unsafe {
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if libc::getsockname(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut len) != 0
                || i32::from(addr.sun_family) != libc::AF_UNIX
            {
                continue;
            }
            let mut cred: libc::ucred = std::mem::zeroed();
            let mut clen = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
            let r = libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut cred as *mut _ as *mut libc::c_void,
                &mut clen,
            );
            (len as usize > std::mem::size_of::<libc::sa_family_t>(), if r == 0 { cred.pid } else { 0 })
        };
        if !named && peer != 0 && peer != me {
            found = Some(found.map_or(fd, |f: RawFd| f.max(fd)));
        }
    }
    found
}

fn csum(b: &[u8]) -> u16 {
    let mut s: u32 = b.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// An Ethernet/IPv4/UDP frame from the "host" 10.0.0.1:5555 to the guest's 10.0.0.2:7.
fn udp_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&HOST_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    let tot = (20 + 8 + payload.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
    ip[2..4].copy_from_slice(&tot.to_be_bytes());
    let c = csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&5555u16.to_be_bytes());
    f.extend_from_slice(&7u16.to_be_bytes());
    f.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

use kumo_testkit::vm_info as info;

#[test]
fn netecho_answers_through_a_vhost_user_backend_and_survives_its_hangup() {
    let test = "netecho_answers_through_a_vhost_user_backend_and_survives_its_hangup";
    if !kvm_or_skip(test) {
        return;
    }
    let dir = TestDir::new();
    let vu_sock = dir.arg("net.sock");
    let api = dir.arg("api.sock");
    let (backend, frames) = LoopNet::new();
    let mut daemon =
        VhostUserDaemon::new("loopnet".into(), backend.clone(), GuestMemoryAtomic::new(GuestMemoryMmap::new()))
            .expect("vhost-user daemon");
    for h in daemon.get_epoll_handlers() {
        h.register_listener(backend.0.inject.as_raw_fd(), EventSet::IN, u64::from(INJECT)).expect("listener");
    }
    let mut listener = Listener::new(&vu_sock, true).expect("listen");
    let accept = std::thread::spawn(move || {
        daemon.start(&mut listener).expect("accept kumo");
        daemon
    });

    let net = format!("vhost-user={vu_sock}");
    let vm = Kid::spawn(&[
        "run",
        "--timeout",
        "0",
        "--api-socket",
        &api,
        "--net",
        &net,
        "--guest",
        "netecho",
        "ip=10.0.0.2",
    ])
    .named("kumo");
    vm.wait_stdout(": up nic=0", PATIENCE);
    let daemon = accept.join().expect("backend thread");
    eprintln!("{test}: NIC up");

    // vm.info: the NIC is the backend's, with its MAC, connected and up.
    let n = info(&api).net.remove(0);
    let vu = n.vhost_user.as_ref().expect("a vhost_user entry");
    assert_eq!(n.tap, "");
    assert_eq!(n.mac, "52:54:00:12:34:56", "the backend's MAC");
    assert!(n.driver_ok && vu.connected && vu.link_up, "{n:?}");
    assert_eq!(vu.socket, vu_sock);
    assert!(vu.protocol_features & VhostUserProtocolFeatures::CONFIG.bits() != 0, "{vu:?}");

    // A datagram through the backend's RX ring comes back on its TX ring.
    let payload = b"kumo vhost-user echo";
    backend.inject(udp_frame(payload));
    eprintln!("{test}: datagram injected");
    let mut vm = vm;
    let t = std::time::Instant::now();
    let echo = loop {
        let f = match frames.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(f) => f,
            Err(_) => {
                if let Some(st) = vm.child.try_wait().unwrap() {
                    panic!("kumo ended ({st}) before the echo:\n{}\n{}", vm.stdout(), vm.stderr());
                }
                assert!(t.elapsed() < PATIENCE, "no echo from the guest; stdout:\n{}", vm.stdout());
                continue;
            }
        };
        // Ethernet to the sender, IPv4/UDP, ports swapped, our payload.
        if f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[23] == 17 {
            break f;
        }
    };
    assert_eq!(echo[..6], HOST_MAC);
    assert_eq!(echo[6..12], MAC);
    assert_eq!(echo[26..30], [10, 0, 0, 2]);
    assert_eq!(echo[30..34], [10, 0, 0, 1]);
    assert_eq!(u16::from_be_bytes([echo[34], echo[35]]), 7);
    assert_eq!(u16::from_be_bytes([echo[36], echo[37]]), 5555);
    assert_eq!(&echo[42..], payload);
    // The relay thread counts a call as it forwards it, which may be after the guest (which
    // also polls its rings) already echoed: wait for the count rather than race it.
    eventually(PATIENCE, || (info(&api).net[0].counters.interrupts > 0).then_some(()));

    // The backend says link down, then up (CONFIG_CHANGE_MSG): kumo re-reads its config.
    backend.set_link(false);
    let vu = eventually(PATIENCE, || {
        let vu = info(&api).net.remove(0).vhost_user.expect("vhost_user");
        (vu.config_changes == 1 && !vu.link_up).then_some(vu)
    });
    assert!(vu.connected, "{vu:?}");
    backend.set_link(true);
    eventually(PATIENCE, || {
        let vu = info(&api).net.remove(0).vhost_user.expect("vhost_user");
        (vu.config_changes == 2 && vu.link_up).then_some(())
    });

    // Migration and snapshots are refused in one line; the VM goes on.
    let e = kumo_api::ApiClient::new(&api).snapshot(&dir.arg("snap")).unwrap_err().to_string();
    assert!(e.contains("vhost-user") && !e.contains('\n'), "{e}");

    // The backend hangs up: kumo keeps running, the NIC's link is down.
    daemon.request_shutdown();
    let vu = eventually(PATIENCE, || {
        let n = info(&api).net.remove(0);
        let vu = n.vhost_user.expect("vhost_user");
        (!vu.connected).then_some(vu)
    });
    assert!(!vu.link_up, "{vu:?}");
    assert!(kumo_api::ApiClient::new(&api).ping().is_ok(), "kumo still answers");

    kumo_api::ApiClient::new(&api).shutdown().expect("shutdown");
    let (code, out, err) = vm.wait();
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    drop(daemon);
}

#[test]
fn a_missing_or_refusing_backend_is_a_one_line_error() {
    let dir = TestDir::new();
    let missing = dir.arg("none.sock");
    let o = kumo(&["run", "--net", &format!("vhost-user={missing}"), "--guest", "hello"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    if !kvm_or_skip("a_missing_or_refusing_backend_is_a_one_line_error") {
        return;
    }
    assert!(err.contains("does not exist"), "{err}");
    let file = dir.path("plain");
    std::fs::write(&file, b"").unwrap();
    let o = kumo(&["run", "--net", &format!("vhost-user={}", file.display()), "--guest", "hello"]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("is not a unix socket"), "{err}");
    let stale = dir.path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let o = kumo(&["run", "--net", &format!("vhost-user={}", stale.display()), "--guest", "hello"]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("connection refused"), "{err}");
}
