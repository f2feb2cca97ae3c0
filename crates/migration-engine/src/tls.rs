//! Mutual TLS for `tcp:` migration: rustls with the ring provider, TLS 1.3 only (both ends are
//! kumo). Each side gives a directory holding `ca.pem` (the CA it trusts), `cert.pem` (its own
//! certificate chain, leaf first) and `key.pem` (its private key). The destination asks the
//! source for a certificate signed by that CA; the source checks the destination's certificate
//! against its CA and for the destination's name (the host of `tcp:HOST:PORT`, or an explicit
//! server name). See docs/migration.md, "Security".
//!
//! [`TlsStream`] is a TLS connection that, like a socket, can be read by one thread while
//! others write (the reply channel runs against the page stream): the rustls state sits
//! behind a mutex that is never held across a blocking socket call.

use kumo_sandbox::lock;
use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};

/// The files a TLS directory holds.
pub const CA_FILE: &str = "ca.pem";
pub const CERT_FILE: &str = "cert.pem";
pub const KEY_FILE: &str = "key.pem";

/// Plaintext encrypted per socket write: a batch goes out in a few large writes.
const SEND_CHUNK: usize = 1 << 20;
/// Ciphertext read per socket read.
const RECV_CHUNK: usize = 64 << 10;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS failure, carried inside an `io::Error` so that it survives the stream layers above
/// and can be told apart from a plain socket error.
#[derive(Debug)]
pub struct TlsError(pub String);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {}

/// The TLS failure behind an I/O error, if it is one.
pub fn tls_cause(e: &io::Error) -> Option<&TlsError> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<TlsError>())
}

/// Which end of the migration this process is: the peer is the other one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Source,
    Destination,
}

impl Side {
    fn peer(self) -> &'static str {
        match self {
            Side::Source => "the destination",
            Side::Destination => "the source",
        }
    }
}

/// One line for the operator about a rustls error, said from `side`.
fn describe(e: &rustls::Error, side: Side) -> String {
    use rustls::Error as E;
    let peer = side.peer();
    match e {
        E::InvalidCertificate(c) => format!("{peer}'s certificate is not accepted ({c:?}): check {CA_FILE} on both sides"),
        E::NoCertificatesPresented => format!("{peer} presented no certificate (it must run with a TLS directory)"),
        E::AlertReceived(a) => format!(
            "{peer} ended the TLS handshake (alert {a:?}): it does not accept this side's certificate, or does not use the same CA"
        ),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } | E::InappropriateHandshakeMessage { .. } => {
            format!("{peer} does not speak TLS (does it run without a TLS directory?): {e}")
        }
        e => format!("with {peer}: {e}"),
    }
}

fn io_tls(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, TlsError(msg))
}

/// The CA, certificate chain and key of a TLS directory.
struct Identity {
    roots: RootCertStore,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: bad PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

fn load(dir: &Path) -> Result<Identity, String> {
    if !dir.is_dir() {
        return Err(format!("TLS directory {}: not a directory", dir.display()));
    }
    let (ca, cert, key) = (dir.join(CA_FILE), dir.join(CERT_FILE), dir.join(KEY_FILE));
    let mut roots = RootCertStore::empty();
    for c in certs(&ca)? {
        roots.add(c).map_err(|e| format!("{}: not a CA certificate: {e}", ca.display()))?;
    }
    let chain = certs(&cert)?;
    let bytes = std::fs::read(&key).map_err(|e| format!("cannot read {}: {e}", key.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| format!("{}: no usable PEM private key: {e}", key.display()))?;
    Ok(Identity { roots, chain, key })
}

/// What rustls says about a certificate and key that do not go together.
fn identity_err(dir: &Path, e: rustls::Error) -> String {
    match e {
        rustls::Error::InconsistentKeys(_) => {
            format!("{}: {KEY_FILE} is not the key of {CERT_FILE}", dir.display())
        }
        e => format!("{}: {CERT_FILE}/{KEY_FILE}: {e}", dir.display()),
    }
}

/// The source's TLS: its identity, and the destination name it expects.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    /// Overrides the host part of the destination's address.
    server_name: Option<ServerName<'static>>,
    pub dir: PathBuf,
}

impl ClientTls {
    /// Loads a TLS directory; `server_name`: the name the destination's certificate must carry
    /// (default: the host of the `tcp:HOST:PORT` address).
    pub fn from_dir(dir: &Path, server_name: Option<&str>) -> Result<ClientTls, String> {
        let id = load(dir)?;
        let server_name = server_name
            .map(|n| ServerName::try_from(n.to_string()).map_err(|e| format!("server name `{n}`: {e}")))
            .transpose()?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_root_certificates(id.roots)
            .with_client_auth_cert(id.chain, id.key)
            .map_err(|e| identity_err(dir, e))?;
        // Every connection is authenticated in full.
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls { config: Arc::new(config), server_name, dir: dir.to_path_buf() })
    }

    /// The name checked in the destination's certificate for `host_port` (`HOST:PORT`).
    pub fn name_for(&self, host_port: &str) -> Result<ServerName<'static>, String> {
        if let Some(n) = &self.server_name {
            return Ok(n.clone());
        }
        let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(host.to_string())
            .map_err(|e| format!("`{host}` cannot be checked against a certificate ({e}): give a server name"))
    }

    /// Runs the client handshake on a connected socket, within `timeout`.
    pub fn connect(&self, sock: TcpStream, host_port: &str, timeout: Duration) -> io::Result<TlsStream> {
        let name = self.name_for(host_port).map_err(io_tls)?;
        let conn = ClientConnection::new(self.config.clone(), name).map_err(|e| io_tls(e.to_string()))?;
        TlsStream::handshake(sock, conn.into(), timeout, Side::Source)
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientTls({})", self.dir.display())
    }
}

impl PartialEq for ClientTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.config, &other.config) && self.server_name == other.server_name
    }
}

/// The destination's TLS: its identity, and the CA a source's certificate must be signed by.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    pub dir: PathBuf,
}

impl ServerTls {
    pub fn from_dir(dir: &Path) -> Result<ServerTls, String> {
        let id = load(dir)?;
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(id.roots), provider())
            .build()
            .map_err(|e| format!("{}: {e}", dir.join(CA_FILE).display()))?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(id.chain, id.key)
            .map_err(|e| identity_err(dir, e))?;
        config.send_tls13_tickets = 0; // no resumption: nothing to hand out
        Ok(ServerTls { config: Arc::new(config), dir: dir.to_path_buf() })
    }

    /// Runs the server handshake on an accepted socket, within `timeout`.
    pub fn accept(&self, sock: TcpStream, timeout: Duration) -> io::Result<TlsStream> {
        let conn = ServerConnection::new(self.config.clone()).map_err(|e| io_tls(e.to_string()))?;
        TlsStream::handshake(sock, conn.into(), timeout, Side::Destination)
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerTls({})", self.dir.display())
    }
}

/// Ciphertext read from the socket and not yet handed to rustls.
struct Rx {
    buf: Vec<u8>,
    lo: usize,
    hi: usize,
}

/// What the clones of one TLS connection share. Lock order: `rx`, then `tx`, then `conn`;
/// `conn` is never held across a socket call.
struct Shared {
    conn: Mutex<Connection>,
    /// Held by the one reader at a time, with the ciphertext it has read ahead.
    rx: Mutex<Rx>,
    /// Held while a writer encrypts and sends: records go out in the order they were sealed.
    tx: Mutex<Vec<u8>>,
    side: Side,
}

/// A TLS connection over TCP, cloneable like the socket it runs on.
pub struct TlsStream {
    sock: TcpStream,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsStream({:?})", self.sock)
    }
}

impl TlsStream {
    fn handshake(mut sock: TcpStream, mut conn: Connection, timeout: Duration, side: Side) -> io::Result<TlsStream> {
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        while conn.is_handshaking() {
            if let Err(e) = conn.complete_io(&mut sock) {
                if side == Side::Destination {
                    crate::linger::linger_close(&sock);
                }
                let rustls_err = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
                return Err(match rustls_err {
                    Some(r) => io_tls(describe(r, side)),
                    None if e.kind() == io::ErrorKind::UnexpectedEof => {
                        io_tls(format!("{} closed the connection during the TLS handshake", side.peer()))
                    }
                    None if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                        io_tls(format!("no TLS handshake from {} within {} s", side.peer(), timeout.as_secs_f64()))
                    }
                    None => e,
                });
            }
        }
        conn.set_buffer_limit(Some(SEND_CHUNK + (64 << 10)));
        let rx = Rx { buf: vec![0; RECV_CHUNK], lo: 0, hi: 0 };
        let shared = Shared { conn: Mutex::new(conn), rx: Mutex::new(rx), tx: Mutex::new(Vec::new()), side };
        Ok(TlsStream { sock, shared: Arc::new(shared) })
    }

    pub fn try_clone(&self) -> io::Result<TlsStream> {
        Ok(TlsStream { sock: self.sock.try_clone()?, shared: self.shared.clone() })
    }

    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Ends the stream cleanly (`close_notify`, then the socket's `how`), best effort.
    pub fn shutdown(&self, how: std::net::Shutdown) {
        let _ = self.send(|c| {
            c.send_close_notify();
            Ok(0)
        });
        let _ = self.sock.shutdown(how);
    }

    fn tls_err(&self, e: rustls::Error) -> io::Error {
        io_tls(describe(&e, self.shared.side))
    }

    /// Sends what rustls has queued (an alert, a key update's answer).
    fn flush_queued(&self) -> io::Result<()> {
        let mut out = lock(&self.shared.tx);
        out.clear();
        {
            let mut c = lock(&self.shared.conn);
            while c.wants_write() {
                c.write_tls(&mut *out)?;
            }
        }
        (&self.sock).write_all(&out)
    }

    /// Encrypts what `put` hands rustls and sends it, in order with other writers.
    fn send(&self, put: impl FnOnce(&mut Connection) -> io::Result<usize>) -> io::Result<usize> {
        let mut out = lock(&self.shared.tx);
        out.clear();
        let n = {
            let mut c = lock(&self.shared.conn);
            let n = put(&mut c)?;
            while c.wants_write() {
                c.write_tls(&mut *out)?;
            }
            n
        };
        (&self.sock).write_all(&out)?;
        Ok(n)
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut rx = lock(&self.shared.rx);
        loop {
            let (mut fed, mut flush) = (false, false);
            {
                let mut c = lock(&self.shared.conn);
                match c.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    r => return r,
                }
                if rx.lo < rx.hi {
                    let Rx { buf: raw, lo, hi } = &mut *rx;
                    let mut pending = &raw[*lo..*hi];
                    let n = c.read_tls(&mut pending)?;
                    *lo += n;
                    fed = true;
                    if let Err(e) = c.process_new_packets() {
                        drop(c);
                        let _ = self.flush_queued(); // the alert that says why
                        return Err(self.tls_err(e));
                    }
                    flush = c.wants_write();
                    if n == 0 && !flush {
                        return Err(io_tls("the TLS state accepts no more input".into()));
                    }
                }
            }
            if flush {
                self.flush_queued()?;
            }
            if fed {
                continue; // what was fed may have made plaintext
            }
            let n = (&self.sock).read(&mut rx.buf)?;
            (rx.lo, rx.hi) = (0, n);
            if n == 0 {
                // The socket's end: rustls tells a close_notify (a clean end) from a cut.
                let mut c = lock(&self.shared.conn);
                c.read_tls(&mut io::empty())?;
                c.process_new_packets().map_err(|e| self.tls_err(e))?;
                return match c.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    r => r,
                };
            }
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let buf = &buf[..buf.len().min(SEND_CHUNK)];
        self.send(|c| c.writer().write(buf))
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        // At most SEND_CHUNK bytes of plaintext per call: the caller loops.
        let mut left = SEND_CHUNK;
        let mut take = Vec::with_capacity(bufs.len());
        for b in bufs {
            if left == 0 {
                break;
            }
            let n = b.len().min(left);
            take.push(IoSlice::new(&b[..n]));
            left -= n;
        }
        self.send(|c| c.writer().write_vectored(&take))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A CA and certificates it signs, written as TLS directories.
    pub struct TestPki {
        ca: rcgen::Certificate,
        ca_key: rcgen::KeyPair,
    }

    impl TestPki {
        pub fn new(name: &str) -> TestPki {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            p.distinguished_name.push(rcgen::DnType::CommonName, name);
            let ca_key = rcgen::KeyPair::generate().unwrap();
            let ca = p.self_signed(&ca_key).unwrap();
            TestPki { ca, ca_key }
        }

        /// Writes ca.pem, cert.pem (for `names`) and key.pem into `dir`.
        pub fn write_dir(&self, dir: &Path, names: &[&str]) {
            std::fs::create_dir_all(dir).unwrap();
            let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
            let p = rcgen::CertificateParams::new(names).unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &self.ca, &self.ca_key).unwrap();
            std::fs::write(dir.join(CA_FILE), self.ca.pem()).unwrap();
            std::fs::write(dir.join(CERT_FILE), cert.pem()).unwrap();
            std::fs::write(dir.join(KEY_FILE), key.serialize_pem()).unwrap();
        }
    }

    pub fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kumo-tls-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn loading_reports_missing_files_bad_pem_and_a_key_of_another_certificate() {
        let pki = TestPki::new("ca");
        let d = temp_dir("load");
        let e = ServerTls::from_dir(&d.join("nope")).unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
        let e = ClientTls::from_dir(&d, None).unwrap_err();
        assert!(e.contains("cannot read") && e.contains(CA_FILE), "{e}");
        pki.write_dir(&d, &["localhost"]);
        assert!(ServerTls::from_dir(&d).is_ok());
        assert!(ClientTls::from_dir(&d, None).is_ok());
        std::fs::write(d.join(CERT_FILE), "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
            .unwrap();
        let e = ServerTls::from_dir(&d).unwrap_err();
        assert!(e.contains("bad PEM") && e.contains(CERT_FILE), "{e}");
        std::fs::write(d.join(CERT_FILE), "hello").unwrap();
        let e = ServerTls::from_dir(&d).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
        std::fs::write(d.join(KEY_FILE), "no key here").unwrap();
        pki.write_dir(&d.join("other"), &["localhost"]);
        std::fs::copy(d.join("other").join(CERT_FILE), d.join(CERT_FILE)).unwrap();
        let e = ClientTls::from_dir(&d, None).unwrap_err();
        assert!(e.contains("no usable PEM private key"), "{e}");
        // A key that is not the certificate's.
        pki.write_dir(&d, &["localhost"]);
        std::fs::copy(d.join("other").join(KEY_FILE), d.join(KEY_FILE)).unwrap();
        for e in [ServerTls::from_dir(&d).unwrap_err(), ClientTls::from_dir(&d, None).unwrap_err()] {
            assert!(e.contains("is not the key of"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn server_names_come_from_the_address_unless_given() {
        let pki = TestPki::new("ca");
        let d = temp_dir("names");
        pki.write_dir(&d, &["localhost"]);
        let c = ClientTls::from_dir(&d, None).unwrap();
        assert_eq!(c.name_for("127.0.0.1:4444").unwrap(), ServerName::try_from("127.0.0.1").unwrap());
        assert_eq!(c.name_for("[::1]:4444").unwrap(), ServerName::try_from("::1").unwrap());
        assert_eq!(c.name_for("dst.example:1").unwrap(), ServerName::try_from("dst.example").unwrap());
        let c = ClientTls::from_dir(&d, Some("dst.example")).unwrap();
        assert_eq!(c.name_for("10.0.0.1:1").unwrap(), ServerName::try_from("dst.example").unwrap());
        assert!(ClientTls::from_dir(&d, Some("not a name!")).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A server and a client handshake over loopback with the given directories; the
    /// server's and the client's results.
    fn pair(server: &Path, client: &Path, name: Option<&str>) -> (io::Result<TlsStream>, io::Result<TlsStream>) {
        let s = ServerTls::from_dir(server).unwrap();
        let c = ClientTls::from_dir(client, name).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            s.accept(l.accept().unwrap().0, Duration::from_secs(10)).and_then(|mut s| {
                let mut b = [0u8; 4];
                s.read_exact(&mut b)?;
                s.write_all(b"pong").map(|_| s)
            })
        });
        let cr = c.connect(TcpStream::connect(&addr).unwrap(), &addr, Duration::from_secs(10));
        // A client whose certificate is refused learns it on its first read.
        let cr = cr.and_then(|mut s| {
            s.write_all(b"ping")?;
            let mut b = [0u8; 4];
            s.read_exact(&mut b).map(|_| s)
        });
        (t.join().unwrap(), cr)
    }

    #[test]
    fn mutual_tls_round_trip_and_refusals() {
        let (a, b) = (TestPki::new("ca-a"), TestPki::new("ca-b"));
        let d = temp_dir("pair");
        a.write_dir(&d.join("dst"), &["localhost", "127.0.0.1"]);
        a.write_dir(&d.join("src"), &["source"]);
        b.write_dir(&d.join("stranger"), &["localhost", "127.0.0.1"]);
        let (s, c) = pair(&d.join("dst"), &d.join("src"), None);
        assert!(s.is_ok() && c.is_ok(), "{s:?} {c:?}");
        // The destination's certificate does not name the host asked for.
        let (_, c) = pair(&d.join("dst"), &d.join("src"), Some("elsewhere.example"));
        let e = c.unwrap_err().to_string();
        assert!(e.contains("the destination's certificate is not accepted") && e.contains("NotValidForName"), "{e}");
        // A source from another CA: each side refuses the other.
        let (s, c) = pair(&d.join("dst"), &d.join("stranger"), None);
        let (se, ce) = (s.unwrap_err().to_string(), c.unwrap_err().to_string());
        assert!(ce.contains("the destination's certificate is not accepted") && ce.contains("UnknownIssuer"), "{ce}");
        assert!(se.contains("the source ended the TLS handshake"), "{se}");
        // A source that trusts the destination but whose own certificate is another CA's.
        std::fs::copy(d.join("dst").join(CA_FILE), d.join("stranger").join(CA_FILE)).unwrap();
        let (s, c) = pair(&d.join("dst"), &d.join("stranger"), None);
        let (se, ce) = (s.unwrap_err().to_string(), c.unwrap_err().to_string());
        assert!(se.contains("the source's certificate is not accepted") && se.contains("UnknownIssuer"), "{se}");
        assert!(ce.contains("the destination ended the TLS handshake"), "{ce}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_clone_reads_while_another_writes_large_buffers() {
        let a = TestPki::new("ca");
        let d = temp_dir("clone");
        a.write_dir(&d, &["127.0.0.1"]);
        let s = ServerTls::from_dir(&d).unwrap();
        let c = ClientTls::from_dir(&d, None).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let data: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
        let want = data.clone();
        let t = std::thread::spawn(move || {
            let mut s = s.accept(l.accept().unwrap().0, Duration::from_secs(10)).unwrap();
            let mut w = s.try_clone().unwrap();
            // Replies go out while the stream is read.
            let replier = std::thread::spawn(move || {
                for _ in 0..100 {
                    w.write_all(b"r").unwrap();
                }
            });
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            replier.join().unwrap();
            got
        });
        let mut cs = c.connect(TcpStream::connect(&addr).unwrap(), &addr, Duration::from_secs(10)).unwrap();
        let mut r = cs.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut b = [0u8; 100];
            r.read_exact(&mut b).unwrap();
        });
        crate::transport::write_all_vectored(
            &mut cs,
            &mut [IoSlice::new(&data[..3_000_000]), IoSlice::new(&data[3_000_000..])],
        )
        .unwrap();
        reader.join().unwrap();
        cs.shutdown(std::net::Shutdown::Write);
        assert!(t.join().unwrap() == want);
        let _ = std::fs::remove_dir_all(&d);
    }
}
