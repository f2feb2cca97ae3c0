//! The destination's door: every connection to a migration listener is vetted (its TLS
//! handshake, if the listener asks for TLS, and a valid kumo stream header) before it counts.
//! One that is not a kumo source (a port scan, a health check, junk, a wrong version, a
//! certificate from another CA) is answered where possible and dropped, and the destination
//! keeps waiting for the real source, within bounds: after [`MAX_BAD_CONNECTIONS`] such
//! connections, or past an optional deadline, it gives up with an error.

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kumo_migration::format::{self, Encoder, Reply, VmDescription};

use crate::session::MigrateError;
use crate::transport::{Conn, Listener};

/// Connections that are not a kumo source a destination drops before it gives up.
pub const MAX_BAD_CONNECTIONS: u32 = 16;

/// How long a new connection has to complete its TLS handshake and send its stream header.
/// A kumo source does both at once; a silent peer holds the door this long.
pub const VET_TIMEOUT: Duration = Duration::from_secs(5);

/// Bounds on waiting for a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptLimits {
    /// Give up after this many connections that were not a kumo source.
    pub max_bad: u32,
    /// Give up when no source has arrived by then (`None`: wait as long as it takes).
    pub deadline: Option<Duration>,
    /// See [`VET_TIMEOUT`].
    pub vet_timeout: Duration,
}

impl Default for AcceptLimits {
    fn default() -> Self {
        AcceptLimits { max_bad: MAX_BAD_CONNECTIONS, deadline: None, vet_timeout: VET_TIMEOUT }
    }
}

/// Waits for a connection until `until` (for ever if `None`).
fn accept_until(listener: &Listener, until: Option<Instant>) -> Result<Conn, MigrateError> {
    if let Some(until) = until {
        let fd = match listener {
            Listener::Tcp(l, _) => l.as_raw_fd(),
            Listener::Unix(l, ..) => l.as_raw_fd(),
        };
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MigrateError::Io(io::Error::new(io::ErrorKind::TimedOut, "no connection in time")));
            }
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: poll on one valid pollfd that lives across the call.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r > 0 {
                break;
            }
            if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return Err(io::Error::last_os_error().into());
            }
        }
    }
    Ok(listener.accept()?)
}

/// Checks one connection: TLS handshake (if the listener asks for it), then the stream
/// header. On failure says why, after answering what can be answered.
fn vet(listener: &Listener, conn: Conn, timeout: Duration) -> Result<(Conn, VmDescription), String> {
    if let Conn::Unix(s) = &conn {
        // The peer gets this VM's memory (or hands it one): this user or root only.
        kumo_sandbox::sock::check_peer(s, Some(&[kumo_sandbox::sock::euid(), 0]), "unix migration")
            .map_err(|e| e.to_string())?;
    }
    conn.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    conn.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let conn = match (conn, listener.tls()) {
        (Conn::Tcp(s), Some(tls)) => Conn::Tls(tls.accept(s, timeout).map_err(|e| e.to_string())?),
        (c, _) => c,
    };
    // Read unbuffered: a local migration's memory fd follows the header on the socket.
    let mut raw = conn.try_clone().map_err(|e| e.to_string())?;
    match format::read_header(&mut raw) {
        Ok(desc) => Ok((conn, desc)),
        Err(e) => {
            let why = match &e {
                format::Error::Truncated { .. } => "it closed before sending a whole stream header".to_string(),
                format::Error::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof => {
                    "it closed before sending a whole stream header".to_string()
                }
                format::Error::Io(io) if crate::session::is_timeout(io) => {
                    format!("no stream header within {} s", timeout.as_secs_f64())
                }
                e @ format::Error::BadMagic { .. } => e.to_string(),
                e => format!("not a kumo migration stream: {e}"),
            };
            let mut out = Vec::new();
            Encoder::new().reply(&mut out, &Reply::Failed(why.clone()));
            let mut c = conn;
            let _ = c.write_all(&out);
            match &c {
                Conn::Tcp(s) => crate::linger::linger_close(s),
                Conn::Tls(s) => {
                    s.shutdown(std::net::Shutdown::Write);
                    crate::linger::linger_close(s.socket());
                }
                Conn::Unix(_) => {}
            }
            Err(why)
        }
    }
}

/// Waits for a kumo source on `listener` and returns its connection (its deadlines as set
/// for vetting: the caller sets its own) and stream header. Connections that are not a kumo
/// source are dropped, counted in `rejected` and logged; after `limits.max_bad` of them, or
/// past `limits.deadline`, it gives up.
pub(crate) fn accept_source(
    listener: &Listener,
    limits: &AcceptLimits,
    rejected: &AtomicU64,
) -> Result<(Conn, VmDescription), MigrateError> {
    let until = limits.deadline.map(|d| Instant::now() + d);
    let mut bad = 0u32;
    loop {
        let conn = match accept_until(listener, until) {
            Ok(c) => c,
            Err(MigrateError::Io(e)) if e.kind() == io::ErrorKind::TimedOut => {
                let after = limits.deadline.unwrap_or_default().as_secs_f64();
                let dropped = if bad > 0 { format!(" ({bad} other connection(s) dropped)") } else { String::new() };
                return Err(MigrateError::Other(format!("no migration source arrived within {after} s{dropped}")));
            }
            Err(e) => return Err(e),
        };
        let peer = conn.peer();
        match vet(listener, conn, limits.vet_timeout) {
            Ok(ok) => return Ok(ok),
            Err(why) => {
                bad += 1;
                rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "migration listener: dropped a connection from {peer} ({bad} of at most {}): {why}",
                    limits.max_bad
                );
                if bad >= limits.max_bad {
                    return Err(MigrateError::Other(format!(
                        "gave up after {bad} connections that were not a kumo migration source (the last, from {peer}: {why})"
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::tests::{temp_dir, TestPki};
    use crate::tls::{ClientTls, ServerTls};
    use crate::transport::{Address, ListenOptions};
    use std::io::Read;
    use std::net::TcpStream;

    fn header() -> Vec<u8> {
        let desc = VmDescription::new(
            1,
            kumo_migration::format::Irqchip::Kernel,
            kumo_migration::format::PayloadDescription::guest("test"),
            vec![(0, 1 << 20)],
        );
        let mut v = Vec::new();
        format::write_header(&mut v, &desc).unwrap();
        v
    }

    fn limits(max_bad: u32) -> AcceptLimits {
        AcceptLimits { max_bad, deadline: Some(Duration::from_secs(60)), vet_timeout: Duration::from_secs(5) }
    }

    #[test]
    fn junk_and_silent_peers_are_dropped_and_the_source_is_taken() {
        let l = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
        let Address::Tcp(addr) = l.local_addr() else { unreachable!() };
        // Queued in order before the accept loop runs: connect-and-close, junk, a wrong
        // version, then a real header.
        drop(TcpStream::connect(&addr).unwrap());
        let mut junk = TcpStream::connect(&addr).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut wrong = TcpStream::connect(&addr).unwrap();
        let mut h = header();
        h[8] ^= 0xff; // the version after the magic
        wrong.write_all(&h).unwrap();
        let mut good = TcpStream::connect(&addr).unwrap();
        good.write_all(&header()).unwrap();
        let rejected = AtomicU64::new(0);
        let (_, desc) = accept_source(&l, &limits(16), &rejected).unwrap();
        assert_eq!(desc.cpus, 1);
        assert_eq!(rejected.load(Ordering::Relaxed), 3);
        // The junk sender got an answer saying why.
        let mut r = format::ReplyReader::new(junk);
        match r.next_reply().unwrap() {
            Reply::Failed(why) => assert!(why.contains("not a kumo migration stream"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn it_gives_up_after_too_many_bad_connections_or_at_the_deadline() {
        let l = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
        let Address::Tcp(addr) = l.local_addr() else { unreachable!() };
        for _ in 0..3 {
            drop(TcpStream::connect(&addr).unwrap());
        }
        let e = accept_source(&l, &limits(3), &AtomicU64::new(0)).unwrap_err().to_string();
        assert!(e.contains("gave up after 3 connections") && e.contains("closed before"), "{e}");
        let short = AcceptLimits { deadline: Some(Duration::from_millis(50)), ..limits(3) };
        let e = accept_source(&l, &short, &AtomicU64::new(0)).unwrap_err().to_string();
        assert!(e.contains("no migration source arrived"), "{e}");
    }

    #[test]
    fn unix_listeners_drop_bad_peers_too() {
        let p = temp_dir("unix-accept").join("m.sock");
        let l = Listener::bind(&Address::Unix(p.clone())).unwrap();
        drop(std::os::unix::net::UnixStream::connect(&p).unwrap());
        let mut junk = std::os::unix::net::UnixStream::connect(&p).unwrap();
        junk.write_all(&[0u8; 64]).unwrap();
        let mut good = std::os::unix::net::UnixStream::connect(&p).unwrap();
        good.write_all(&header()).unwrap();
        let rejected = AtomicU64::new(0);
        accept_source(&l, &limits(16), &rejected).unwrap();
        assert_eq!(rejected.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_tls_listener_drops_plain_peers_and_foreign_certificates() {
        let (a, b) = (TestPki::new("a"), TestPki::new("b"));
        let d = temp_dir("accept-tls");
        a.write_dir(&d.join("dst"), &["127.0.0.1"]);
        a.write_dir(&d.join("src"), &["src"]);
        b.write_dir(&d.join("other"), &["src"]);
        std::fs::copy(d.join("dst/ca.pem"), d.join("other/ca.pem")).unwrap();
        let opts = ListenOptions { tls: Some(ServerTls::from_dir(&d.join("dst")).unwrap()), insecure: false };
        let l = Listener::bind_with(&Address::Tcp("127.0.0.1:0".into()), &opts).unwrap();
        let Address::Tcp(addr) = l.local_addr() else { unreachable!() };
        let rejected = AtomicU64::new(0);
        std::thread::scope(|s| {
            let dst = s.spawn(|| accept_source(&l, &limits(16), &rejected));
            // A plain kumo header, then a source whose certificate is another CA's: both are
            // refused, and the good one after them is taken.
            let mut plain = TcpStream::connect(&addr).unwrap();
            plain.write_all(&header()).unwrap();
            let mut buf = Vec::new();
            let _ = plain.read_to_end(&mut buf); // the TLS alert, then the close
            let other = ClientTls::from_dir(&d.join("other"), None).unwrap();
            let c = Conn::connect_with(&Address::Tcp(addr.clone()), Duration::from_secs(10), Some(&other));
            if let Ok(mut c) = c {
                let _ = c.write_all(&header());
                let mut b = [0u8; 1];
                let e = c.read(&mut b).unwrap_err().to_string();
                assert!(e.contains("the destination ended the TLS handshake"), "{e}");
            }
            let good = ClientTls::from_dir(&d.join("src"), None).unwrap();
            let mut c = Conn::connect_with(&Address::Tcp(addr.clone()), Duration::from_secs(10), Some(&good)).unwrap();
            c.write_all(&header()).unwrap();
            let (conn, desc) = dst.join().unwrap().unwrap();
            assert!(conn.is_tls());
            assert_eq!(desc.cpus, 1);
        });
        assert_eq!(rejected.load(Ordering::Relaxed), 2);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn plain_listeners_stay_on_loopback_unless_insecure() {
        let plain = ListenOptions::default();
        for ok in ["127.0.0.1:0", "[::1]:0", "localhost:0"] {
            assert!(plain.check(&Address::Tcp(ok.into())).is_ok(), "{ok}");
        }
        let e = plain.check(&Address::Tcp("0.0.0.0:4444".into())).unwrap_err();
        assert!(e.contains("refusing a plain-TCP migration listener") && e.contains("--insecure"), "{e}");
        assert!(Listener::bind_with(&Address::Tcp("0.0.0.0:0".into()), &plain).is_err());
        let insecure = ListenOptions { insecure: true, ..Default::default() };
        assert!(insecure.check(&Address::Tcp("0.0.0.0:4444".into())).is_ok());
        let pki = TestPki::new("ca");
        let d = temp_dir("loopback");
        pki.write_dir(&d, &["x"]);
        let tls = ListenOptions { tls: Some(ServerTls::from_dir(&d).unwrap()), insecure: false };
        assert!(tls.check(&Address::Tcp("0.0.0.0:4444".into())).is_ok());
        let e = tls.check(&Address::Unix("/tmp/x.sock".into())).unwrap_err();
        assert!(e.contains("TLS is for tcp:"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
