//! The vhost-user socket: every connection is a client with its own `VhostUserDaemon`.
//!
//! `vhost-user-backend` serves one connection per daemon and hides both the connection (we
//! want the peer's pid, and to see it close) and the backend-request channel (it has no way to
//! send CONFIG_CHANGE_MSG). So each client's messages pass through a small in-process relay:
//! frontend ⇄ relay ⇄ daemon, message by message with their fds. The relay keeps a duplicate
//! of the fd of VHOST_USER_SET_BACKEND_REQ_FD (to send config changes) and tells the NIC when
//! the frontend hangs up. Only the control messages take this path; the rings and eventfds are
//! shared with the frontend directly.

use kumo_sandbox::ThreadKind;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use vhost::vhost_user::Listener;
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::backend::ClientBackend;
use crate::nic::{Client, Nic};

const HDR_LEN: usize = 12;
const MAX_FDS: usize = 32;
const SET_BACKEND_REQ_FD: u32 = 21;
const SET_FEATURES: u32 = 2;
const SET_VRING_ENABLE: u32 = 18;
/// VHOST_USER_F_PROTOCOL_FEATURES in SET_FEATURES.
const PROTOCOL_FEATURES: u64 = 1 << 30;
/// Header flags: version 1, reply, need-reply.
const VERSION: u32 = 1;
const REPLY: u32 = 1 << 2;
const NEED_REPLY: u32 = 1 << 3;
/// Largest message body accepted (the memory table with its maximum of regions is ~1 KiB).
const MAX_BODY: usize = 1 << 20;

/// The peer process of a unix stream (SO_PEERCRED).
pub fn peer_pid(s: &UnixStream) -> Option<i32> {
    kumo_sandbox::sock::peer_cred(s).ok().map(|c| c.pid).filter(|&pid| pid > 0)
}

/// Accepts frontends on `path` until the listener fails; each gets a thread.
pub struct Server {
    nic: Arc<Nic>,
    next_id: AtomicU32,
}

impl Server {
    pub fn new(nic: Arc<Nic>) -> Arc<Self> {
        Arc::new(Server { nic, next_id: AtomicU32::new(1) })
    }

    /// Binds the vhost-user socket: private (0600 from the start), replacing only a stale
    /// socket (`kumo_sandbox::sock::bind_private`).
    pub fn bind(path: &Path) -> io::Result<UnixListener> {
        kumo_sandbox::sock::bind_private(path)
    }

    pub fn serve(self: &Arc<Self>, listener: UnixListener) -> io::Result<()> {
        loop {
            let (s, _) = listener.accept()?;
            let me = self.clone();
            kumo_sandbox::spawn(ThreadKind::NetBackend, "nb-client", move || {
                if let Err(e) = me.serve_client(s) {
                    tracing::warn!("client: {e}");
                }
            })?;
        }
    }

    /// Serves one frontend connection until it closes; returns its id.
    pub fn serve_client(&self, front: UnixStream) -> io::Result<u32> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let pid = peer_pid(&front);
        let client = Arc::new(Client::new(id, pid));
        let backend = Arc::new(ClientBackend::new(self.nic.clone(), client.clone()));
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<BitmapMmapRegion>::new());
        let mut daemon = VhostUserDaemon::new(format!("nb-client-{id}"), backend.clone(), mem)
            .map_err(|e| io::Error::other(format!("client {id}: {e}")))?;
        if let Some(h) = daemon.get_epoll_handlers().first() {
            client.set_listen(h.clone());
        }
        // The daemon accepts on a socket in a 0700 directory of its own that only the relay
        // connects to: an abstract socket could be reached first by any process in the
        // network namespace.
        let private = kumo_sandbox::sock::PrivateSocket::new(&std::env::temp_dir())?;
        let back = UnixStream::connect(private.path())?;
        let mut listener = Listener::from(private.listener.try_clone()?);
        daemon.start(&mut listener).map_err(|e| io::Error::other(format!("client {id}: {e}")))?;
        drop(listener);
        drop(private);
        self.nic.add_client(client.clone());
        tracing::info!("client {id} connected (pid {pid:?})");
        // Whatever happens next, the client leaves the NIC when this ends: one still listed
        // (or owning the NIC) after its connection failed would hold the NIC for good.
        let relayed = Self::relay_both(id, &front, &back, &client);
        let _ = front.shutdown(std::net::Shutdown::Both);
        let _ = back.shutdown(std::net::Shutdown::Both);
        if let Err(e) = daemon.wait() {
            tracing::warn!("client {id}: {e}");
        }
        drop(daemon);
        self.nic.remove_client(id);
        backend.close_exit_events();
        tracing::info!("client {id} disconnected");
        relayed.map(|()| id)
    }

    /// Relays the connection both ways until either side closes.
    fn relay_both(id: u32, front: &UnixStream, back: &UnixStream, client: &Arc<Client>) -> io::Result<()> {
        let (f2, b2) = (front.try_clone()?, back.try_clone()?);
        let c2 = client.clone();
        let up =
            kumo_sandbox::spawn(ThreadKind::NetBackend, format!("nb-relay-{id}"), move || relay(&f2, &b2, Some(&c2)))?;
        relay(back, front, None);
        let _ = up.join();
        Ok(())
    }
}

/// Copies vhost-user messages (header, body, fds) from `from` to `to` until either side closes,
/// then shuts both down. With `client`, this is the frontend → backend direction, where the
/// backend-request channel is picked up.
fn relay(from: &UnixStream, to: &UnixStream, client: Option<&Arc<Client>>) {
    if let Err(e) = relay_loop(from, to, client) {
        tracing::debug!("relay: {e}");
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

fn relay_loop(from: &UnixStream, to: &UnixStream, client: Option<&Arc<Client>>) -> io::Result<()> {
    let mut hdr = [0u8; HDR_LEN];
    let mut body = Vec::new();
    let mut protocol_acked = false;
    // SET_VRING_ENABLE states that came before SET_FEATURES: (ring, enable), applied after it.
    let mut early_enables: Vec<[u8; 8]> = Vec::new();
    loop {
        let fds = recv_header(from, &mut hdr)?;
        let request = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let flags = u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
        let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
        if size > MAX_BODY {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("message body of {size} bytes")));
        }
        body.resize(size, 0);
        (&mut &*from).read_exact(&mut body)?;
        if let Some(c) = client {
            tracing::trace!("client {}: request {request} flags {flags:#x} size {size} fds {}", c.id, fds.len());
        }
        let mut replay = Vec::new();
        if client.is_some() && request == SET_FEATURES && size >= 8 {
            let f = u64::from_le_bytes(body[..8].try_into().unwrap_or_default());
            protocol_acked = f & PROTOCOL_FEATURES != 0;
            if protocol_acked {
                replay = std::mem::take(&mut early_enables);
            }
        }
        // QEMU enables and disables the rings (SET_VRING_ENABLE) before SET_FEATURES, where
        // vhost-user-backend refuses the message (PROTOCOL_FEATURES not yet acked) and drops
        // the connection: answered here, and the states passed on right after SET_FEATURES.
        if client.is_some() && request == SET_VRING_ENABLE && !protocol_acked {
            if let Ok(state) = <[u8; 8]>::try_from(&body[..]) {
                early_enables.retain(|e| e[..4] != state[..4]);
                early_enables.push(state);
            }
            tracing::debug!("SET_VRING_ENABLE before SET_FEATURES: applied after it");
            if flags & NEED_REPLY != 0 {
                let mut ack = Vec::with_capacity(HDR_LEN + 8);
                ack.extend_from_slice(&request.to_le_bytes());
                ack.extend_from_slice(&(VERSION | REPLY).to_le_bytes());
                ack.extend_from_slice(&8u32.to_le_bytes());
                ack.extend_from_slice(&0u64.to_le_bytes());
                (&mut &*from).write_all(&ack)?;
            }
            continue;
        }
        if let (Some(c), SET_BACKEND_REQ_FD, Some(fd)) = (client, request, fds.first()) {
            let dup = fd.try_clone()?;
            c.set_req(UnixStream::from(dup));
        }
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut msg = Vec::with_capacity(HDR_LEN + size);
        msg.extend_from_slice(&hdr);
        msg.extend_from_slice(&body);
        let sent = if raw.is_empty() { 0 } else { to.send_with_fds(&[&msg[..]], &raw).map_err(io::Error::other)? };
        (&mut &*to).write_all(&msg[sent..])?;
        // No reply asked (no NEED_REPLY), none sent.
        for state in replay {
            let mut m = Vec::with_capacity(HDR_LEN + 8);
            m.extend_from_slice(&SET_VRING_ENABLE.to_le_bytes());
            m.extend_from_slice(&VERSION.to_le_bytes());
            m.extend_from_slice(&8u32.to_le_bytes());
            m.extend_from_slice(&state);
            (&mut &*to).write_all(&m)?;
        }
    }
}

/// Reads one 12-byte header and the fds that came with it; EOF is an error.
fn recv_header(s: &UnixStream, hdr: &mut [u8; HDR_LEN]) -> io::Result<Vec<OwnedFd>> {
    let mut raw = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec { iov_base: hdr.as_mut_ptr() as *mut libc::c_void, iov_len: HDR_LEN }];
    // SAFETY: the iovec points at `hdr`, which lives across the call and may take any bytes.
    let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }.map_err(io::Error::other)?;
    let fds: Vec<OwnedFd> = raw[..nfds]
        .iter()
        // SAFETY: recv_with_fds handed us these fds; each is owned once, here.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed"));
    }
    if n < HDR_LEN {
        (&mut &*s).read_exact(&mut hdr[n..])?;
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eventfds() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.flatten()
                    .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("eventfd")))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Found by kumo-fuzz (target `vhost-user`): every connection left an eventfd open (the
    /// worker's exit event, which vhost-user-backend 0.24 never closes), so a long-lived
    /// backend ran out of descriptors after ~20 000 connections and then kept a client
    /// whose connection had failed listed. Connections now leave nothing behind.
    #[test]
    fn connections_leave_no_descriptor_behind() {
        let server = Server::new(Arc::new(Nic::new(
            Box::new(kumo_devices::virtio::net::Loopback::new(1)),
            "tap-test",
            [2, 0, 0, 0, 0, 1],
            true,
        )));
        let serve_one = || {
            let (front, back) = UnixStream::pair().unwrap();
            // GET_FEATURES, then hang up once it is answered.
            let mut msg = 1u32.to_le_bytes().to_vec();
            msg.extend(1u32.to_le_bytes());
            msg.extend(0u32.to_le_bytes());
            (&front).write_all(&msg).unwrap();
            let s = std::thread::scope(|sc| {
                let t = sc.spawn(|| server.serve_client(back));
                let mut reply = [0u8; 20];
                (&front).read_exact(&mut reply).unwrap();
                front.shutdown(std::net::Shutdown::Both).unwrap();
                t.join().unwrap()
            });
            assert!(s.is_ok(), "{s:?}");
        };
        serve_one();
        let before = eventfds();
        for _ in 0..40 {
            serve_one();
        }
        // Other tests may hold a few eventfds meanwhile; one per connection is the leak.
        assert!(eventfds() < before + 20, "{} eventfds after 40 connections, {before} before", eventfds());
        assert!(server.nic.info().clients.is_empty());
    }
}
