//! The API client: one connection per request, which keeps it simple and
//! stateless (a CLI makes a handful of calls).

use crate::http::{self, Conn, ReadError, MAX_BODY};
use crate::{paths, MigrationStatus, VmInfo};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Generous: pausing or shutting down a VM may wait for its vCPUs.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing (or no longer anything) listens on the socket.
    #[error("no kumo VM is listening on {}: {}", .path.display(), os_message(.source))]
    Connect { path: PathBuf, source: io::Error },
    /// The server answered with an error status; `message` is its `error` (the status is
    /// for programs, [`ClientError::status`]; users get the message alone).
    #[error("{message}")]
    Http { status: u16, message: String },
    /// No complete answer within the client's timeout.
    #[error("kumo VM on {} did not answer within {}s", .path.display(), .timeout.as_secs_f64())]
    Timeout { path: PathBuf, timeout: Duration },
    /// Something answered, but not with the HTTP/JSON we expect.
    #[error("bad response from {}: {reason}", .path.display())]
    BadResponse { path: PathBuf, reason: String },
    #[error("talking to {}: {}", .path.display(), os_message(.source))]
    Io { path: PathBuf, source: io::Error },
}

impl ClientError {
    /// The HTTP status, for errors the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// "No such file or directory", without std's " (os error 2)" suffix.
fn os_message(e: &io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_string(),
        _ => s,
    }
}

/// One request's outcome on a connection: the answer and whether the connection stays open,
/// or the error and whether the server closed it before answering anything.
type Exchanged = Result<((u16, Option<Value>), bool), (ClientError, bool)>;

/// A request: method, path, JSON body.
type Req<'a> = (&'a str, &'a str, Option<&'a Value>);

#[derive(Debug, Clone)]
pub struct ApiClient {
    path: PathBuf,
    timeout: Duration,
    /// With [`ApiClient::keep_alive`]: one connection reused by every request (clones share it,
    /// one request at a time).
    kept: Option<std::sync::Arc<std::sync::Mutex<Option<Conn>>>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

impl ApiClient {
    pub fn new(path: impl AsRef<Path>) -> Self {
        ApiClient { path: path.as_ref().to_path_buf(), timeout: DEFAULT_CLIENT_TIMEOUT, kept: None }
    }

    /// Reuses one connection for every request instead of one each (HTTP keep-alive): no
    /// connect and no new server thread per request, which is most of a request's cost when
    /// every host CPU is busy. A connection the server closed while idle is reopened.
    pub fn keep_alive(mut self) -> Self {
        self.kept = Some(Default::default());
        self
    }

    /// Bounds each request (sending it and reading the whole answer).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        // A zero socket timeout is an error in std.
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `GET /api/v1/vmm.ping`; returns the VM's kumo version.
    pub fn ping(&self) -> Result<String, ClientError> {
        self.get::<crate::Pong>(paths::PING).map(|p| p.kumo_version)
    }

    /// `GET /api/v1/vm.info`.
    pub fn info(&self) -> Result<VmInfo, ClientError> {
        self.get::<crate::ChVmInfo>(paths::INFO).map(|i| i.kumo)
    }

    /// `GET /api/v1/vm.info` as it comes: CH's shape, kumo's own under `kumo`.
    pub fn ch_info(&self) -> Result<crate::ChVmInfo, ClientError> {
        self.get(paths::INFO)
    }

    /// `PUT /api/v1/vm.pause`.
    pub fn pause(&self) -> Result<(), ClientError> {
        self.call("PUT", paths::PAUSE, None).map(drop)
    }

    /// `PUT /api/v1/vm.resume`.
    pub fn resume(&self) -> Result<(), ClientError> {
        self.call("PUT", paths::RESUME, None).map(drop)
    }

    /// `PUT /api/v1/vm.shutdown`.
    pub fn shutdown(&self) -> Result<(), ClientError> {
        self.call("PUT", paths::SHUTDOWN, None).map(drop)
    }

    /// `PUT /api/v1/vm.send-migration`: runs a migration (blocks until it ends: give the
    /// client a long timeout) and returns its final status.
    pub fn send_migration(&self, req: &crate::MigrateRequest) -> Result<MigrationStatus, ClientError> {
        self.put(paths::MIGRATE, req)
    }

    /// `GET /api/v1/vm.migration`: progress events and result of the current or last
    /// migration.
    pub fn migration_status(&self) -> Result<MigrationStatus, ClientError> {
        self.get(paths::MIGRATION)
    }

    /// `PUT /api/v1/vm.cancel-migration`: the running migration stops and the VM runs on
    /// here; 409 if none runs or it is too late.
    pub fn cancel_migration(&self) -> Result<(), ClientError> {
        self.call("PUT", paths::CANCEL_MIGRATION, None).map(drop)
    }

    /// Writes the VM to the file `path` (absolute) and returns what was written.
    pub fn snapshot(&self, path: &str) -> Result<crate::SnapshotReport, ClientError> {
        self.put(paths::SNAPSHOT, &crate::SnapshotRequest { path: path.to_string(), destination_url: None })
    }

    /// `PUT /api/v1/vm.receive-migration`: an empty VMM listens for a migrating VM; answers
    /// once it listens (a source may start then). Preparing `memory` may take a while.
    pub fn receive_migration(&self, req: &crate::ReceiveMigrationRequest) -> Result<(), ClientError> {
        let body = serde_json::to_value(req).map_err(|e| self.bad(format!("cannot encode request: {e}")))?;
        self.call("PUT", paths::RECEIVE_MIGRATION, Some(&body)).map(drop)
    }

    /// `PUT /api/v1/vm.restore`: an empty VMM runs the VM of a snapshot file; returns what was
    /// restored.
    pub fn restore(&self, req: &crate::RestoreRequest) -> Result<crate::RestoreReport, ClientError> {
        self.put(paths::RESTORE, req)
    }

    /// `PUT /api/v1/vm.pin`: pins vCPU `vcpu` to host CPU `cpu` (`None`: unpins it).
    pub fn pin(&self, vcpu: u32, cpu: Option<u32>) -> Result<(), ClientError> {
        let body = serde_json::to_value(crate::PinRequest { vcpu, cpu })
            .map_err(|e| self.bad(format!("cannot encode request: {e}")))?;
        self.call("PUT", paths::PIN, Some(&body)).map(drop)
    }

    /// `PUT /api/v1/vm.resize`: the guest keeps `desired_vcpus` vCPUs (ACPI CPU hotplug); returns
    /// once it has ejected (or scanned in) the others, or fails after `timeout_ms`.
    pub fn resize(&self, desired_vcpus: u32, timeout_ms: u64) -> Result<(), ClientError> {
        let body = serde_json::to_value(crate::ResizeRequest { desired_vcpus, timeout_ms })
            .map_err(|e| self.bad(format!("cannot encode request: {e}")))?;
        self.call("PUT", paths::RESIZE, Some(&body)).map(drop)
    }

    /// `PUT /api/v1/vm.release`: the VM gives host CPUs and memory up (its guest confirms).
    pub fn release(&self, req: &crate::ReleaseRequest) -> Result<crate::Released, ClientError> {
        self.put(paths::RELEASE, req)
    }

    /// `PUT /api/v1/vm.acquire`: the VM takes host CPUs and memory another VM released.
    pub fn acquire(&self, req: &crate::AcquireRequest) -> Result<crate::Acquired, ClientError> {
        self.put(paths::ACQUIRE, req)
    }

    /// `PUT /api/v1/vm.resize-zone`: asks a memory zone's guest driver for a new size.
    pub fn resize_zone(&self, req: &crate::ResizeZoneRequest) -> Result<(), ClientError> {
        let body = serde_json::to_value(req).map_err(|e| self.bad(format!("cannot encode request: {e}")))?;
        self.call("PUT", paths::RESIZE_ZONE, Some(&body)).map(|_| ())
    }

    /// `PUT /api/v1/vm.lend`: this VM lends to (or returns to) another, both steps or neither.
    pub fn lend(&self, req: &crate::LendApiRequest) -> Result<crate::LendReport, ClientError> {
        self.put(paths::LEND, req)
    }

    /// `GET /api/v1/vm.elastic`.
    pub fn elastic(&self) -> Result<crate::ElasticInfo, ClientError> {
        self.get(paths::ELASTIC)
    }

    /// The VM's counters (vCPU exits by reason, assists, interrupts, migration bytes).
    pub fn counters(&self) -> Result<crate::Counters, ClientError> {
        self.get(paths::COUNTERS)
    }

    /// `kumo net-backend`'s `GET /api/v1/backend.info`.
    pub fn backend_info(&self) -> Result<crate::BackendInfo, ClientError> {
        self.get(crate::net_backend::paths::INFO)
    }

    /// `kumo net-backend`'s `PUT /api/v1/backend.handover`.
    pub fn handover(&self, req: &crate::HandoverRequest) -> Result<crate::HandoverReport, ClientError> {
        self.put(crate::net_backend::paths::HANDOVER, req)
    }

    /// A GET route's answer, decoded.
    fn get<A: DeserializeOwned>(&self, path: &str) -> Result<A, ClientError> {
        let answer = self.call("GET", path, None)?.ok_or_else(|| self.bad(format!("empty answer from {path}")))?;
        serde_json::from_value(answer).map_err(|e| self.bad(format!("invalid answer from {path}: {e}")))
    }

    /// A PUT route's answer to `req`, decoded.
    fn put<Q: serde::Serialize, A: DeserializeOwned>(&self, path: &str, req: &Q) -> Result<A, ClientError> {
        let body = serde_json::to_value(req).map_err(|e| self.bad(format!("cannot encode request: {e}")))?;
        let answer =
            self.call("PUT", path, Some(&body))?.ok_or_else(|| self.bad(format!("empty answer from {path}")))?;
        serde_json::from_value(answer).map_err(|e| self.bad(format!("invalid answer from {path}: {e}")))
    }

    /// Like [`request`](Self::request), but a non-2xx status is an error
    /// ([`ClientError::Http`], carrying the server's message). Raw JSON, for tests and tools
    /// that speak to routes by hand; the typed methods above are for programs.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Option<Value>, ClientError> {
        let (status, body) = self.request(method, path, body)?;
        if (200..300).contains(&status) {
            return Ok(body);
        }
        let message = match &body {
            Some(Value::Object(o)) => o.get("error").and_then(Value::as_str).map(str::to_string),
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        let message = message.unwrap_or_else(|| format!("{} {}", status, http::reason(status)));
        Err(ClientError::Http { status, message })
    }

    /// Sends one request and returns the status and JSON body (if any),
    /// whatever the status. `path` is the full path, e.g. `/api/v1/vm.info`.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Option<Value>), ClientError> {
        let Some(kept) = &self.kept else {
            let mut conn = self.connect()?;
            return self.exchange(&mut conn, (method, path, body), false, &[]).map(|(a, _)| a).map_err(|(e, _)| e);
        };
        let mut slot = kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut conn) = slot.take() {
            match self.exchange(&mut conn, (method, path, body), true, &[]) {
                Ok((a, open)) => {
                    if open {
                        *slot = Some(conn);
                    }
                    return Ok(a);
                }
                // Closed by the server while idle, before it read this request: send it again
                // on a new connection. Anything else may have been served: report it.
                Err((_, true)) => {}
                Err((e, false)) => return Err(e),
            }
        }
        let mut conn = self.connect()?;
        let (a, open) = self.exchange(&mut conn, (method, path, body), true, &[]).map_err(|(e, _)| e)?;
        if open {
            *slot = Some(conn);
        }
        Ok(a)
    }

    /// [`request`](Self::request), with `fds` sent alongside: SCM_RIGHTS on the request's
    /// first write, as libvirt sends a tap it opened with `vm.add-net`; on a connection of its
    /// own.
    pub fn request_with_fds(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(u16, Option<Value>), ClientError> {
        let mut conn = self.connect()?;
        self.exchange(&mut conn, (method, path, body), false, fds).map(|(a, _)| a).map_err(|(e, _)| e)
    }

    /// With [`ApiClient::keep_alive`]: whether a connection is open for the next request.
    pub fn kept_open(&self) -> bool {
        self.kept.as_ref().is_some_and(|k| k.lock().unwrap_or_else(|p| p.into_inner()).is_some())
    }

    fn connect(&self) -> Result<Conn, ClientError> {
        let stream = UnixStream::connect(&self.path)
            .map_err(|source| ClientError::Connect { path: self.path.clone(), source })?;
        stream.set_write_timeout(Some(self.timeout)).map_err(|e| self.io(e))?;
        Ok(Conn::new(stream))
    }

    /// One request on `conn`. Ok: the answer and whether the connection stays open. Err: the
    /// error and whether the server had closed the connection before answering anything (so
    /// the request can be sent again).
    fn exchange(&self, conn: &mut Conn, req: Req<'_>, keep: bool, fds: &[BorrowedFd<'_>]) -> Exchanged {
        let (method, path, body) = req;
        let deadline = Instant::now() + self.timeout;
        let body = body.map(Value::to_string).unwrap_or_default();
        let connection = if keep { "keep-alive" } else { "close" };
        let mut msg = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\nConnection: {connection}\r\n"
        );
        if !body.is_empty() {
            msg += "Content-Type: application/json\r\n";
        }
        if !body.is_empty() || !matches!(method, "GET" | "HEAD") {
            msg += &format!("Content-Length: {}\r\n", body.len());
        }
        msg += "\r\n";
        msg += &body;

        let written = crate::fds::send(&conn.stream, msg.as_bytes(), fds);
        // A server may answer and close before taking the whole request (413):
        // its answer says more than our write error.
        match self.read_response(conn, method, deadline) {
            Ok((answer, open)) => Ok((answer, open && keep)),
            Err((e, unanswered)) => Err((written.err().map_or(e, |w| self.io(w)), unanswered)),
        }
    }

    /// The answer, and whether the connection may carry another request; or the error, and
    /// whether the peer closed before sending a single byte of an answer.
    fn read_response(&self, conn: &mut Conn, method: &str, deadline: Instant) -> Exchanged {
        let plain = |e: ClientError| (e, false);
        let mut first = true;
        let (status, headers) = loop {
            let head = match conn.read_head(deadline) {
                Ok(h) => h,
                Err(ReadError::Closed { partial: false }) if first => {
                    return Err((self.bad("connection closed before a complete answer"), true))
                }
                Err(e) => return Err(plain(self.read_error(e))),
            };
            first = false;
            let (status, headers) = http::parse_response_head(&head).map_err(|r| plain(self.bad(r)))?;
            // Interim answers (100 Continue) precede the real one.
            if !(100..200).contains(&status) {
                break (status, headers);
            }
        };
        let mut open = !headers.has_token("connection", "close");
        let body = if matches!(status, 204 | 304) || method == "HEAD" {
            Vec::new()
        } else {
            match headers.content_length().map_err(|r| plain(self.bad(r)))? {
                Some(n) if n > MAX_BODY as u64 => return Err(plain(self.bad("response body too large"))),
                Some(n) => conn.read_body(n as usize, deadline),
                None => {
                    open = false;
                    conn.read_to_end(deadline)
                }
            }
            .map_err(|e| plain(self.read_error(e)))?
        };
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(((status, None), open));
        }
        match serde_json::from_slice(&body) {
            Ok(v) => Ok(((status, Some(v)), open)),
            // Keep a non-JSON error text as the message rather than lose it.
            Err(_) if status >= 400 => {
                Ok(((status, Some(Value::String(String::from_utf8_lossy(&body).trim().to_string()))), open))
            }
            Err(e) => Err(plain(self.bad(format!("invalid JSON body: {e}")))),
        }
    }

    fn read_error(&self, e: ReadError) -> ClientError {
        match e {
            ReadError::TimedOut { .. } => ClientError::Timeout { path: self.path.clone(), timeout: self.timeout },
            ReadError::Closed { .. } => self.bad("connection closed before a complete answer"),
            ReadError::TooLarge { .. } => self.bad("answer too large"),
            ReadError::Malformed(m) => self.bad(m),
            ReadError::Io(e) => self.io(e),
        }
    }

    fn bad(&self, reason: impl Into<String>) -> ClientError {
        ClientError::BadResponse { path: self.path.clone(), reason: reason.into() }
    }

    fn io(&self, source: io::Error) -> ClientError {
        ClientError::Io { path: self.path.clone(), source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixListener;
    use std::thread;

    fn temp_sock(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("kumo-api-client-{}-{tag}.sock", std::process::id()))
    }

    /// Serves one connection with a canned answer, after reading the request head.
    fn canned(tag: &str, answer: &'static [u8]) -> (PathBuf, thread::JoinHandle<()>) {
        let path = temp_sock(tag);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let t = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut conn = Conn::new(stream);
            conn.read_head(Instant::now() + Duration::from_secs(30)).unwrap();
            conn.stream.write_all(answer).unwrap();
        });
        (path, t)
    }

    #[test]
    fn missing_socket_names_the_path() {
        let path = temp_sock("missing");
        let e = ApiClient::new(&path).info().unwrap_err();
        assert!(matches!(e, ClientError::Connect { .. }));
        assert_eq!(e.to_string(), format!("no kumo VM is listening on {}: No such file or directory", path.display()));
    }

    #[test]
    fn non_http_answer_is_bad_response() {
        let (path, t) = canned("garbage", b"SSH-2.0-OpenSSH_9.6\r\n\r\n");
        let e = ApiClient::new(&path).ping().unwrap_err();
        assert!(matches!(e, ClientError::BadResponse { .. }), "{e:?}");
        t.join().unwrap();
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn plain_text_error_and_body_until_close() {
        let (path, t) = canned("text", b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\n\r\nupstream broke\n");
        let e = ApiClient::new(&path).call("GET", "/x", None).unwrap_err();
        assert!(matches!(&e, ClientError::Http { status: 502, message } if message == "upstream broke"), "{e:?}");
        t.join().unwrap();
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn silent_server_times_out() {
        let path = temp_sock("silent");
        let _ = std::fs::remove_file(&path);
        let _listener = UnixListener::bind(&path).unwrap(); // never accepts: connect still succeeds
        let e = ApiClient::new(&path).with_timeout(Duration::from_millis(50)).ping().unwrap_err();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e:?}");
        std::fs::remove_file(&path).unwrap();
    }
}
