//! The API server: an accept thread plus one thread per connection, each
//! decoding requests through the route table and calling the [`ApiHandler`].
//!
//! Slow or idle clients cannot starve prompt ones: a connection waiting for
//! (or receiving) a request sits in a bounded waiting set under deadlines
//! that trickled bytes do not extend, and the oldest idle or slowest one is
//! closed when a new client arrives and the set is full. A connection takes
//! one of the few serving slots only once its whole request has arrived, and
//! keeps it while the handler runs, however long (a migration takes minutes).

use crate::fds::MAX_FDS;
use crate::http::{self, Conn, ReadError, MAX_BODY, MAX_HEAD};
use crate::{net_backend, paths, ApiError, ApiRequest, ApiResponse, ErrorKind};
use kumo_sandbox::ThreadKind;
use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::Shutdown;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// How long a connection may sit without starting a request (after
/// connecting or after its previous answer).
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole request head, from its first byte.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole body, from the end of its head.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for writing a whole response.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection closed after its answer is drained, so that
/// unread request bytes do not turn the close into a reset.
const LINGER: Duration = Duration::from_secs(1);
/// Requests handled at once; one more complete request is answered 503.
const MAX_SERVING: usize = 32;
/// Connections idle or sending a request; a new one beyond this closes the
/// oldest idle, else the slowest, so thread count stays bounded.
const MAX_WAITING: usize = 128;
/// How long shutdown waits for the accept thread before leaving it behind.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// The VMM side of the API. Called from connection threads, possibly
/// concurrently, hence `Send + Sync`.
pub trait ApiHandler: Send + Sync {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError>;
}

/// One route. The request is built from the body so that routes taking JSON
/// fit the same table, e.g.
/// `Route { method: "PUT", path: "/api/v1/vm.send-migration", build: |b| Ok(ApiRequest::Migrate(json_body(b)?)) }`.
pub(crate) struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub build: fn(&[u8]) -> Result<ApiRequest, ApiError>,
}

pub(crate) const VM_ROUTES: &[Route] = &[
    Route { method: "GET", path: paths::PING, build: |_| Ok(ApiRequest::Ping) },
    Route { method: "GET", path: paths::INFO, build: |_| Ok(ApiRequest::Info) },
    Route { method: "PUT", path: paths::PAUSE, build: |_| Ok(ApiRequest::Pause) },
    Route { method: "PUT", path: paths::RESUME, build: |_| Ok(ApiRequest::Resume) },
    Route { method: "PUT", path: paths::SHUTDOWN, build: |_| Ok(ApiRequest::Shutdown) },
    Route { method: "PUT", path: paths::MIGRATE, build: |b| Ok(ApiRequest::Migrate(json_body(b)?)) },
    Route { method: "GET", path: paths::MIGRATION, build: |_| Ok(ApiRequest::MigrationStatus) },
    Route { method: "PUT", path: paths::SNAPSHOT, build: |b| Ok(ApiRequest::Snapshot(json_body(b)?)) },
    Route { method: "GET", path: paths::COUNTERS, build: |_| Ok(ApiRequest::Counters) },
    Route { method: "PUT", path: paths::CANCEL_MIGRATION, build: |_| Ok(ApiRequest::CancelMigration) },
    Route { method: "GET", path: paths::MIGRATION_EVENTS, build: |_| Ok(ApiRequest::MigrationEvents) },
    Route { method: "PUT", path: paths::RECEIVE_MIGRATION, build: |b| Ok(ApiRequest::ReceiveMigration(json_body(b)?)) },
    Route { method: "PUT", path: paths::RESTORE, build: |b| Ok(ApiRequest::Restore(json_body(b)?)) },
    Route { method: "PUT", path: paths::PIN, build: |b| Ok(ApiRequest::Pin(json_body(b)?)) },
    Route { method: "PUT", path: paths::RESIZE, build: |b| Ok(ApiRequest::Resize(json_body(b)?)) },
    Route { method: "PUT", path: paths::RELEASE, build: |b| Ok(ApiRequest::Release(json_body(b)?)) },
    Route { method: "PUT", path: paths::ACQUIRE, build: |b| Ok(ApiRequest::Acquire(json_body(b)?)) },
    Route { method: "GET", path: paths::ELASTIC, build: |_| Ok(ApiRequest::Elastic) },
    Route { method: "PUT", path: paths::LEND, build: |b| Ok(ApiRequest::Lend(json_body(b)?)) },
    Route { method: "PUT", path: paths::RESIZE_ZONE, build: |b| Ok(ApiRequest::ResizeZone(json_body(b)?)) },
    // Cloud Hypervisor's routes (docs/ch-compat.md).
    Route { method: "PUT", path: paths::CREATE, build: crate::ch::create_request },
    Route { method: "PUT", path: paths::BOOT, build: |_| Ok(ApiRequest::Boot) },
    Route { method: "PUT", path: paths::DELETE, build: |_| Ok(ApiRequest::Delete) },
    Route { method: "PUT", path: paths::REBOOT, build: |_| Ok(ApiRequest::Reboot) },
    Route { method: "PUT", path: paths::POWER_BUTTON, build: |_| Ok(ApiRequest::PowerButton) },
    Route { method: "PUT", path: paths::VMM_SHUTDOWN, build: |_| Ok(ApiRequest::VmmShutdown) },
    Route { method: "PUT", path: paths::ADD_DISK, build: crate::ch::add_disk_request },
    Route { method: "PUT", path: paths::ADD_NET, build: crate::ch::add_net_request },
    Route { method: "PUT", path: paths::REMOVE_DEVICE, build: |b| Ok(ApiRequest::RemoveDevice(json_body(b)?)) },
];

/// `kumo net-backend`'s routes (docs/net-backend.md).
pub(crate) const NET_BACKEND_ROUTES: &[Route] = &[
    Route { method: "GET", path: net_backend::paths::INFO, build: |_| Ok(ApiRequest::BackendInfo) },
    Route {
        method: "PUT",
        path: net_backend::paths::HANDOVER,
        build: |b| {
            serde_json::from_slice(b)
                .map(ApiRequest::Handover)
                .map_err(|e| ApiError::bad_request(format!("bad handover body (want {{\"to\": ID}}): {e}")))
        },
    },
];

/// Which API a server serves: its route table and the names of its threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// A VMM's API (docs/api.md).
    Vm,
    /// `kumo net-backend`'s API (docs/net-backend.md).
    NetBackend,
}

impl Service {
    fn routes(self) -> &'static [Route] {
        match self {
            Service::Vm => VM_ROUTES,
            Service::NetBackend => NET_BACKEND_ROUTES,
        }
    }

    /// Its threads' kind (their seccomp filter): a net-backend's are its process's own.
    fn thread_kind(self) -> ThreadKind {
        match self {
            Service::Vm => ThreadKind::Api,
            Service::NetBackend => ThreadKind::NetBackend,
        }
    }

    /// The accept thread's name and each connection thread's.
    fn thread_names(self) -> (&'static str, &'static str) {
        match self {
            Service::Vm => ("kumo-api", "kumo-api-conn"),
            Service::NetBackend => ("nb-api", "nb-api"),
        }
    }
}

/// Every (method, path) a VMM's server answers, in route-table order: what docs/openapi.yaml
/// must describe (checked by tests/openapi_e2e.rs).
pub fn routes() -> impl Iterator<Item = (&'static str, &'static str)> {
    VM_ROUTES.iter().map(|r| (r.method, r.path))
}

/// Decodes the JSON body of a route that takes one.
pub(crate) fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request("missing JSON body"));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// Finds the route, or the error with, for 405, the `Allow` header value.
fn resolve(routes: &'static [Route], method: &str, path: &str) -> Result<&'static Route, (ApiError, Option<String>)> {
    let on_path: Vec<&Route> = routes.iter().filter(|r| r.path == path).collect();
    if let Some(route) = on_path.iter().find(|r| r.method == method) {
        return Ok(route);
    }
    if on_path.is_empty() {
        return Err((ApiError::not_found(format!("no such route: {path}")), None));
    }
    let allow = on_path.iter().map(|r| r.method).collect::<Vec<_>>().join(", ");
    let e = ApiError::method_not_allowed(format!("{path} does not support {method} (use {allow})"));
    Err((e, Some(allow)))
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("another kumo VM is already serving its API on {}", .0.display())]
    InUse(PathBuf),
    #[error("{} exists and is not a socket; refusing to replace it", .0.display())]
    NotASocket(PathBuf),
    #[error("cannot bind API socket {}: {source}", .path.display())]
    Bind { path: PathBuf, source: io::Error },
    #[error("cannot start the API server thread: {0}")]
    Spawn(#[source] io::Error),
}

pub struct ApiServer;

impl ApiServer {
    /// Binds `path` and serves the API on it from a background thread until
    /// the returned handle is shut down or dropped.
    pub fn start(path: &Path, handler: Arc<dyn ApiHandler>) -> Result<ApiServerHandle, ServerError> {
        Self::start_allowing(path, handler, None)
    }

    /// [`ApiServer::start`], accepting only peers whose uid (`SO_PEERCRED`) is in `allow`
    /// (`--api-allow-uid`; None: whoever can open the socket, which is 0600: its owner and
    /// root). A refused peer gets 403.
    pub fn start_allowing(
        path: &Path,
        handler: Arc<dyn ApiHandler>,
        allow: Option<Vec<u32>>,
    ) -> Result<ApiServerHandle, ServerError> {
        Self::bind(path)?.serve(handler, allow)
    }

    /// Binds `path` now and serves it later ([`BoundApi::serve`]): a VMM binds its socket before
    /// the guest runs, so a client that sees the guest can connect (it waits in the backlog
    /// until the VM is there to answer).
    pub fn bind(path: &Path) -> Result<BoundApi, ServerError> {
        // The socket drives the VM: only its owner may connect (0600 from the start).
        let listener = bind(path)?;
        let id = socket_id(path);
        Ok(BoundApi {
            socket_id: id,
            wake_id: id,
            path: path.to_path_buf(),
            listener: Some(listener),
            service: Service::Vm,
        })
    }
}

impl ApiServer {
    /// Serves a socket someone else bound and passed to this process (`--api-socket fd=N`, as
    /// libvirt does; see [`kumo_sandbox::sock::inherited_listener`]). Its file belongs to them:
    /// kumo never removes it.
    pub fn adopt(listener: UnixListener) -> BoundApi {
        let path = listener.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf)).unwrap_or_default();
        BoundApi { socket_id: None, wake_id: socket_id(&path), path, listener: Some(listener), service: Service::Vm }
    }
}

/// A bound API socket not yet served; dropped unserved, it removes its socket file.
pub struct BoundApi {
    path: PathBuf,
    /// The socket file it bound (None: adopted, someone else's file, never removed).
    socket_id: Option<(u64, u64)>,
    /// The socket file a connection of its own reaches it by, to wake its accept at shutdown.
    wake_id: Option<(u64, u64)>,
    listener: Option<UnixListener>,
    service: Service,
}

impl BoundApi {
    /// Serves `service`'s routes (default: a VMM's).
    pub fn service(mut self, service: Service) -> Self {
        self.service = service;
        self
    }

    /// The identity (device, inode) of the socket file it bound, for removing only that one.
    pub fn socket_id(&self) -> Option<(u64, u64)> {
        self.socket_id
    }

    /// Serves the API from a background thread until the handle is shut down or dropped.
    pub fn serve(
        mut self,
        handler: Arc<dyn ApiHandler>,
        allow: Option<Vec<u32>>,
    ) -> Result<ApiServerHandle, ServerError> {
        let listener = self.listener.take().expect("a BoundApi is served once");
        let shared = Arc::new(Shared { allow, service: self.service, ..Shared::default() });
        let thread = kumo_sandbox::spawn(self.service.thread_kind(), self.service.thread_names().0, {
            let shared = shared.clone();
            move || accept_loop(listener, &shared, handler)
        })
        .map_err(|e| {
            if self.socket_id.is_some() && socket_id(&self.path) == self.socket_id {
                let _ = fs::remove_file(&self.path);
            }
            ServerError::Spawn(e)
        })?;
        info!(path = %self.path.display(), "API server listening");
        let path = std::mem::take(&mut self.path);
        Ok(ApiServerHandle { path, socket_id: self.socket_id, wake_id: self.wake_id, shared, thread: Some(thread) })
    }
}

impl Drop for BoundApi {
    fn drop(&mut self) {
        if self.listener.is_some() && self.socket_id.is_some() && socket_id(&self.path) == self.socket_id {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Binds the socket (`kumo_sandbox::sock::bind_private`: mode 0600 from the start), replacing
/// a stale socket file (left by a VM that died) but never a live one or a file that is not a
/// socket.
fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    kumo_sandbox::sock::bind_private(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => ServerError::InUse(path.into()),
        io::ErrorKind::AlreadyExists => ServerError::NotASocket(path.into()),
        _ => ServerError::Bind { path: path.to_path_buf(), source: e },
    })
}

/// Identity of the file at `path`, so shutdown only removes our own socket.
fn socket_id(path: &Path) -> Option<(u64, u64)> {
    fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Where a connection is; the order is the eviction preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Answered, and being drained before the close.
    Closing,
    /// Keep-alive, waiting for the next request.
    Idle,
    /// Connected and not yet sent a whole request.
    Reading,
    /// Its request is with the handler or its answer being written: never evicted.
    Serving,
}

struct Entry {
    /// A clone, so eviction and shutdown can wake the connection's reader.
    stream: UnixStream,
    phase: Phase,
    /// When it entered its phase (connected, for a new connection).
    since: Instant,
}

/// Live connections by id; a connection missing from it was evicted.
type Conns = HashMap<u64, Entry>;

/// How a complete request fares when it asks for a serving slot.
enum Slot {
    Granted,
    Busy,
    Evicted,
}

struct Shared {
    stop: AtomicBool,
    conns: Mutex<Conns>,
    /// The uids allowed to connect, if restricted.
    allow: Option<Vec<u32>>,
    service: Service,
}

impl Default for Shared {
    fn default() -> Self {
        Shared { stop: AtomicBool::default(), conns: Mutex::default(), allow: None, service: Service::Vm }
    }
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
    fn conns(&self) -> MutexGuard<'_, Conns> {
        // A poisoned map is still a valid map.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn evicted(&self, id: u64) -> bool {
        !self.conns().contains_key(&id)
    }

    /// A keep-alive connection began its next request: it now counts as slow
    /// from here, not as idle.
    fn request_started(&self, id: u64) {
        if let Some(e) = self.conns().get_mut(&id) {
            if e.phase == Phase::Idle {
                e.phase = Phase::Reading;
                e.since = Instant::now();
            }
        }
    }

    fn start_serving(&self, id: u64) -> Slot {
        let mut conns = self.conns();
        let serving = conns.values().filter(|e| e.phase == Phase::Serving).count();
        match conns.get_mut(&id) {
            None => Slot::Evicted,
            Some(_) if serving >= MAX_SERVING => Slot::Busy,
            Some(e) => {
                e.phase = Phase::Serving;
                e.since = Instant::now();
                Slot::Granted
            }
        }
    }

    /// Moves the connection to `phase` (Idle or Closing), making room in the
    /// waiting set if it leaves a serving slot. False if it was evicted.
    fn wait_as(&self, id: u64, phase: Phase) -> bool {
        let mut conns = self.conns();
        let Some(e) = conns.get_mut(&id) else {
            return false;
        };
        e.phase = phase;
        e.since = Instant::now();
        evict_until(&mut conns, MAX_WAITING, Some(id));
        true
    }
}

/// Closes waiting connections, Closing then Idle then Reading, oldest first,
/// until at most `max` wait. Never blocks: eviction is a shutdown(2) that
/// wakes the connection's thread, which answers 503 if it was mid-request.
fn evict_until(conns: &mut Conns, max: usize, except: Option<u64>) {
    loop {
        let waiting = conns.values().filter(|e| e.phase != Phase::Serving).count();
        if waiting <= max {
            return;
        }
        let victim = conns
            .iter()
            .filter(|(id, e)| e.phase != Phase::Serving && Some(**id) != except)
            .min_by_key(|(_, e)| (e.phase, e.since))
            .map(|(id, _)| *id);
        let Some(entry) = victim.and_then(|id| conns.remove(&id)) else {
            return;
        };
        debug!(phase = ?entry.phase, "API connection evicted");
        // Read side only: the thread can still write its 503.
        let _ = entry.stream.shutdown(Shutdown::Read);
    }
}

/// Stops the server on [`shutdown`](Self::shutdown) or drop.
pub struct ApiServerHandle {
    path: PathBuf,
    socket_id: Option<(u64, u64)>,
    wake_id: Option<(u64, u64)>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServerHandle {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, closes idle connections (requests in flight still
    /// get their answer) and removes the socket file. Idempotent.
    pub fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // Only touch the path if it is still our socket: it may have been
        // removed, or replaced by another VM's.
        let ours = self.socket_id.is_some() && socket_id(&self.path) == self.socket_id;
        if self.wake_id.is_some() && socket_id(&self.path) == self.wake_id {
            // accept() has no timeout: wake it with a connection of our own.
            let _ = UnixStream::connect(&self.path);
        }
        let until = Instant::now() + STOP_WAIT;
        while !thread.is_finished() && Instant::now() < until {
            thread::sleep(Duration::from_millis(5));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            warn!(path = %self.path.display(), "API accept thread did not stop; leaving it behind");
        }
        // Readers see EOF and exit; writers can still send their response. Wait (bounded)
        // for them: a handler that ends the VM (shutdown, a finished migration) must get its
        // answer out before the process exits.
        for conn in self.shared.conns().values() {
            let _ = conn.stream.shutdown(Shutdown::Read);
        }
        let until = Instant::now() + STOP_WAIT;
        while !self.shared.conns().is_empty() && Instant::now() < until {
            thread::sleep(Duration::from_millis(2));
        }
        if ours {
            let _ = fs::remove_file(&self.path);
        }
        info!(path = %self.path.display(), "API server stopped");
    }
}

impl Drop for ApiServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: UnixListener, shared: &Arc<Shared>, handler: Arc<dyn ApiHandler>) {
    for (id, stream) in (0u64..).zip(listener.incoming()) {
        if shared.stopping() {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                warn!("API accept failed: {e}");
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let clone = match stream.try_clone() {
            Ok(clone) => clone,
            Err(e) => {
                warn!("API connection dropped: {e}");
                continue;
            }
        };
        {
            let mut conns = shared.conns();
            evict_until(&mut conns, MAX_WAITING - 1, None);
            let entry = Entry { stream: clone, phase: Phase::Reading, since: Instant::now() };
            conns.insert(id, entry);
        }
        let (shared2, handler) = (shared.clone(), handler.clone());
        let spawned = kumo_sandbox::spawn(shared.service.thread_kind(), shared.service.thread_names().1, move || {
            // Deregisters even if serving unwinds.
            struct Deregister(Arc<Shared>, u64);
            impl Drop for Deregister {
                fn drop(&mut self) {
                    self.0.conns().remove(&self.1);
                }
            }
            let guard = Deregister(shared2, id);
            serve_connection(stream, &*handler, &guard.0, id);
        });
        if let Err(e) = spawned {
            warn!("cannot spawn API connection thread: {e}");
            shared.conns().remove(&id);
        }
    }
}

/// What to send back for one request.
struct Reply {
    status: u16,
    /// JSON text.
    body: Option<String>,
    allow: Option<String>,
    close: bool,
}

impl Reply {
    fn error(e: ApiError, close: bool) -> Self {
        let body = crate::to_json(&e.body()).unwrap_or_else(|_| r#"{"error":"unprintable error"}"#.into());
        Reply { status: e.status(), body: Some(body), allow: None, close }
    }
}

/// What reading a request came to.
enum Next {
    /// Close without answering (the peer left, or was idle too long).
    Close,
    /// Answer without calling the handler.
    Reply(Reply),
    /// A whole, valid request for the handler.
    Call { req: ApiRequest, keep_alive: bool },
}

fn serve_connection(stream: UnixStream, handler: &dyn ApiHandler, shared: &Shared, id: u64) {
    // A peer whose uid is not allowed (--api-allow-uid) gets its request read and a 403.
    let refused = kumo_sandbox::sock::check_peer(&stream, shared.allow.as_deref(), "API").err();
    if let Some(e) = &refused {
        warn!("API connection refused: {e}");
    }
    let mut conn = Conn::new(stream);
    while !shared.stopping() {
        let reply = match next_request(&mut conn, shared, id) {
            Next::Close => break,
            Next::Reply(reply) => reply,
            Next::Call { .. } if refused.is_some() => {
                let why = refused.as_ref().map(ToString::to_string).unwrap_or_default();
                Reply::error(ApiError::new(ErrorKind::Forbidden, why), true)
            }
            Next::Call { req, keep_alive } => match shared.start_serving(id) {
                Slot::Granted => match call(handler, shared.service, req) {
                    // A stream's body ends when the connection closes.
                    Ok(ApiResponse::Stream(lines)) => {
                        stream_lines(&mut conn, shared, &lines);
                        shared.wait_as(id, Phase::Closing);
                        break;
                    }
                    r => match r.and_then(ApiResponse::into_http) {
                        Ok((status, body)) => Reply { status, body, allow: None, close: !keep_alive },
                        Err(e) => Reply::error(e, !keep_alive),
                    },
                },
                Slot::Busy => Reply::error(
                    ApiError::unavailable(format!("too many API requests in progress (at most {MAX_SERVING})")),
                    true,
                ),
                Slot::Evicted => Reply::error(evicted(), true),
            },
        };
        let close = reply.close || shared.stopping();
        let allow: Vec<(&str, &str)> = reply.allow.iter().map(|a| ("Allow", a.as_str())).collect();
        if reply.status >= 400 {
            debug!(status = reply.status, body = ?reply.body, "API error reply");
        }
        let bytes = http::response_bytes(reply.status, reply.body.as_deref(), &allow, close);
        if conn.write_all_by(&bytes, Instant::now() + WRITE_TIMEOUT).is_err() {
            break;
        }
        if close {
            shared.wait_as(id, Phase::Closing);
            conn.linger(Instant::now() + LINGER);
            break;
        }
        if !shared.wait_as(id, Phase::Idle) {
            break;
        }
    }
}

/// Writes a streamed answer: a head without Content-Length, then one JSON value per line as
/// the producer hands them over, each write within the write deadline.
fn stream_lines(conn: &mut Conn, shared: &Shared, lines: &crate::JsonLines) {
    let head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n";
    if conn.write_all_by(head, Instant::now() + WRITE_TIMEOUT).is_err() {
        return;
    }
    lines.run(&mut |v| {
        let mut line = crate::to_json(v).unwrap_or_else(|e| crate::to_json(&e.body()).unwrap_or_default());
        line.push('\n');
        !shared.stopping() && conn.write_all_by(line.as_bytes(), Instant::now() + WRITE_TIMEOUT).is_ok()
    });
}

fn evicted() -> ApiError {
    ApiError::unavailable("too many API connections; this slow or idle one was closed")
}

/// Reads one request, under the idle, head and body deadlines.
fn next_request(conn: &mut Conn, shared: &Shared, id: u64) -> Next {
    conn.drop_stale_fds();
    let idle_until = Instant::now() + IDLE_TIMEOUT;
    let head = conn.read_head_from(idle_until, || {
        shared.request_started(id);
        Instant::now() + HEAD_TIMEOUT
    });
    let head = match head {
        Ok(head) => head,
        Err(e) => return read_failure(e, false, shared.evicted(id)),
    };
    // From here on, any error that leaves the byte stream out of sync (bad
    // head, unread body) must close the connection.
    let req = match http::parse_request_head(&head) {
        Ok(req) => req,
        Err(e) => return Next::Reply(Reply::error(e, true)),
    };
    let chunked = match req.headers.get("transfer-encoding") {
        None => false,
        // Only `chunked` alone, and not with Content-Length (RFC 9112 §6.3: a smuggling risk).
        Some(te) if te.trim().eq_ignore_ascii_case("chunked") && req.headers.get("content-length").is_none() => true,
        Some(_) => {
            let e = ApiError::new(ErrorKind::NotImplemented, "Transfer-Encoding other than chunked is not supported");
            return Next::Reply(Reply::error(e, true));
        }
    };
    let declared = match req.headers.content_length() {
        Ok(len) => len,
        Err(msg) => return Next::Reply(Reply::error(ApiError::bad_request(msg), true)),
    };
    let len = declared.unwrap_or(0);
    if len > MAX_BODY as u64 {
        let e = ApiError::payload_too_large(format!("request body is over {MAX_BODY} bytes"));
        return Next::Reply(Reply::error(e, true));
    }
    let len = len as usize;
    let route = match resolve(shared.service.routes(), &req.method, &req.path) {
        Ok(route) => route,
        Err((e, allow)) => {
            return Next::Reply(Reply { allow, ..Reply::error(e, !req.keep_alive || len > 0) });
        }
    };
    if declared.is_none() && !chunked && (route.build)(&[]).is_err() {
        // The route needs a body, and without a length any bytes sent would be taken for the
        // next request.
        let e = ApiError::new(
            ErrorKind::LengthRequired,
            format!("{} {} needs a JSON body with Content-Length", req.method, req.path),
        );
        return Next::Reply(Reply::error(e, true));
    }
    let deadline = Instant::now() + BODY_TIMEOUT;
    if (len > 0 || chunked) && req.headers.has_token("expect", "100-continue") {
        // curl waits for this (up to a second) before sending a body.
        if conn.write_all_by(b"HTTP/1.1 100 Continue\r\n\r\n", deadline).is_err() {
            return Next::Close;
        }
    }
    let body = if chunked { conn.read_chunked(MAX_BODY, deadline) } else { conn.read_body(len, deadline) };
    let body = match body {
        Ok(body) => body,
        Err(e) => return read_failure(e, true, shared.evicted(id)),
    };
    // Descriptors sent with the request (SCM_RIGHTS) go into its typed body, or refuse it.
    let fds = conn.take_fds().map_err(|kept| {
        ApiError::bad_request(format!(
            "{} {}: more than {MAX_FDS} file descriptors came with the request ({kept} kept, all closed)",
            req.method, req.path
        ))
    });
    match fds.and_then(|fds| (route.build)(&body)?.with_fds(fds)) {
        Ok(req2) => Next::Call { req: req2, keep_alive: req.keep_alive },
        Err(e) => Next::Reply(Reply::error(e, !req.keep_alive)),
    }
}

fn read_failure(e: ReadError, mid_request: bool, evicted: bool) -> Next {
    let e = match e {
        ReadError::Closed { partial } | ReadError::TimedOut { partial } if !partial && !mid_request => {
            return Next::Close; // idle connection closed, timed out or evicted between requests
        }
        _ if evicted => self::evicted(),
        ReadError::Io(_) => return Next::Close,
        ReadError::Malformed(m) => ApiError::bad_request(format!("bad chunked body: {m}")),
        ReadError::Closed { .. } => ApiError::bad_request("incomplete request"),
        ReadError::TimedOut { .. } => ApiError::new(ErrorKind::RequestTimeout, "request not received in time"),
        ReadError::TooLarge { line: true } => {
            ApiError::new(ErrorKind::UriTooLong, format!("request line is over {MAX_HEAD} bytes"))
        }
        ReadError::TooLarge { line: false } => {
            ApiError::new(ErrorKind::HeadersTooLarge, format!("request head is over {MAX_HEAD} bytes"))
        }
    };
    Next::Reply(Reply::error(e, true))
}

fn call(handler: &dyn ApiHandler, service: Service, req: ApiRequest) -> Result<ApiResponse, ApiError> {
    debug!(?req, "API request");
    // A panic that reaches here is a bug in a handler that may have left the VM half-changed
    // (a pause half-taken, a lend half-done): it is reported as the thread's panic, which stops
    // the VM, and the client still gets a 500 rather than a dropped connection. Jobs whose
    // holds are all released in Drop (migration, snapshot) contain their own panics and never
    // get here (docs/security.md, "Panics").
    panic::catch_unwind(AssertUnwindSafe(|| handler.handle(req))).unwrap_or_else(|payload| {
        let p = kumo_sandbox::ThreadPanic {
            kind: service.thread_kind(),
            thread: thread::current().name().unwrap_or(service.thread_names().1).to_string(),
            message: kumo_sandbox::thread::panic_message(&*payload),
        };
        kumo_sandbox::thread::report_panic(&p);
        Err(ApiError::internal(format!("internal error while handling the request ({p}); kumo is stopping")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{parse_response_head, Headers};
    use crate::{ApiClient, ClientError, VmInfo, VmState, KUMO_VERSION};
    use serde_json::json;
    use std::io::Write;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::AtomicUsize;

    fn temp_sock() -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        std::env::temp_dir().join(format!("kumo-api-{}-{n}.sock", std::process::id()))
    }

    /// A VM stand-in: a running/paused/shutdown state machine that records calls.
    struct FakeVm {
        state: Mutex<VmState>,
        calls: Mutex<Vec<ApiRequest>>,
    }

    impl FakeVm {
        fn info(state: VmState) -> VmInfo {
            VmInfo {
                state,
                vcpus: 2,
                memory_bytes: 256 << 20,
                guest: "guest:hello".into(),
                irqchip: "split".into(),
                pid: 4242,
                uptime_ms: 1234,
                kumo_version: KUMO_VERSION.into(),
                net: Vec::new(),
                disks: Vec::new(),
                numa: Vec::new(),
                vcpu_pins: vec![Some(0), None],
                parked_vcpus: Vec::new(),
                pv: None,
                memory_zones: Vec::new(),
                memory_private: false,
            }
        }
        fn calls(&self) -> Vec<ApiRequest> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl ApiHandler for FakeVm {
        fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
            self.calls.lock().unwrap().push(req.clone());
            let mut state = self.state.lock().unwrap();
            let mut go = |from: VmState, to: VmState, err: &str| {
                if *state != from {
                    return Err(ApiError::conflict(err));
                }
                *state = to;
                Ok(ApiResponse::Ok)
            };
            match req {
                ApiRequest::Ping => Ok(ApiResponse::Pong(crate::Pong::here())),
                ApiRequest::Info => Ok(ApiResponse::Info(Box::new(crate::ChVmInfo::new(None, Self::info(*state))))),
                ApiRequest::Pause => go(VmState::Running, VmState::Paused, "vm is already paused"),
                ApiRequest::Resume => go(VmState::Paused, VmState::Running, "vm is not paused"),
                ApiRequest::Shutdown if *state == VmState::Shutdown => {
                    Err(ApiError::conflict("vm is already shut down"))
                }
                ApiRequest::Shutdown => {
                    *state = VmState::Shutdown;
                    Ok(ApiResponse::Ok)
                }
                ApiRequest::Migrate(m) if m.to.is_empty() => Err(ApiError::bad_request("no destination")),
                ApiRequest::Migrate(m) => Ok(ApiResponse::Migration(Box::new(fake_status(
                    crate::MigrationState::Completed,
                    Some(m.to),
                    m.engine,
                )))),
                ApiRequest::MigrationStatus => {
                    Ok(ApiResponse::Migration(Box::new(fake_status(crate::MigrationState::None, None, None))))
                }
                ApiRequest::Snapshot(s) => Ok(ApiResponse::Snapshot(crate::SnapshotReport {
                    path: s.path.into(),
                    pages: 1,
                    bytes: 4096,
                    state_bytes: 0,
                    paused_ms: 0.0,
                    paused: false,
                })),
                ApiRequest::Counters => Ok(ApiResponse::Counters(Box::default())),
                ApiRequest::CancelMigration => Err(ApiError::conflict("no migration is running")),
                ApiRequest::ReceiveMigration(_) => Ok(ApiResponse::Ok),
                ApiRequest::Restore(r) => Ok(ApiResponse::Restore(crate::RestoreReport {
                    path: r.source_url.into(),
                    paused: false,
                    pages: 1,
                })),
                ApiRequest::Pin(p) if p.vcpu >= 2 => Err(ApiError::bad_request("vCPU does not exist")),
                ApiRequest::Pin(_) => Ok(ApiResponse::Ok),
                ApiRequest::Resize(r) if r.desired_vcpus == 0 => {
                    Err(ApiError::bad_request("desired_vcpus must be 1..=2"))
                }
                ApiRequest::Resize(_) => Ok(ApiResponse::Ok),
                ApiRequest::Release(r) if r.cpus > 1 => Err(ApiError::guest_timeout("the guest did not confirm")),
                ApiRequest::Release(r) => Ok(ApiResponse::Released(crate::Released {
                    host_cpus: vec![3; r.cpus as usize],
                    ..Default::default()
                })),
                ApiRequest::Acquire(r) => Ok(ApiResponse::Acquired(crate::Acquired {
                    vcpus: vec![2; r.host_cpus.len()],
                    ..Default::default()
                })),
                ApiRequest::Elastic => Ok(ApiResponse::Elastic(crate::ElasticInfo::default())),
                ApiRequest::Lend(l) => Ok(ApiResponse::Lent(Box::new(crate::LendReport {
                    released: crate::Released { lender: Some(l.to), ..Default::default() },
                    acquired: crate::Acquired::default(),
                    total_ms: if l.returning { 2.0 } else { 1.0 },
                }))),
                ApiRequest::MigrationEvents => Ok(ApiResponse::Stream(crate::JsonLines::new(|sink| {
                    for round in 0..3 {
                        let e = crate::Event::StopAndCopy { reason: format!("r{round}"), pages: 0 };
                        if !sink(&crate::MigrationLine::Event(e)) {
                            return;
                        }
                    }
                }))),
                ApiRequest::ResizeZone(r) if r.id != "mem0" => Err(ApiError::not_found("no such zone")),
                ApiRequest::ResizeZone(_) => Ok(ApiResponse::Ok),
                ApiRequest::BackendInfo | ApiRequest::Handover(_) => Err(ApiError::not_found("not a net-backend")),
                ApiRequest::Create(_)
                | ApiRequest::Boot
                | ApiRequest::Delete
                | ApiRequest::PowerButton
                | ApiRequest::VmmShutdown
                | ApiRequest::AddDisk(_)
                | ApiRequest::AddNet(_)
                | ApiRequest::RemoveDevice(_) => Ok(ApiResponse::Ok),
                ApiRequest::Reboot => Err(ApiError::new(ErrorKind::NotImplemented, "no reboot")),
            }
        }
    }

    /// A migration status naming its destination (as `error`) and engine (a `started` event).
    fn fake_status(
        state: crate::MigrationState,
        to: Option<String>,
        engine: Option<crate::MigrationEngine>,
    ) -> crate::MigrationStatus {
        let started = |engine| crate::Event::Started { engine, connections: 1, total_pages: 0, touched_pages: 0 };
        crate::MigrationStatus {
            state,
            events: engine.map(started).into_iter().collect(),
            report: None,
            error: to,
            received: None,
        }
    }

    #[test]
    fn migrate_routes_carry_their_json_body() {
        let f = start();
        let req = crate::MigrateRequest {
            to: "tcp:127.0.0.1:1".into(),
            engine: Some(crate::MigrationEngine::Serial),
            ..migrate_req()
        };
        let st = f.client.send_migration(&req).unwrap();
        assert_eq!(st.error.as_deref(), Some("tcp:127.0.0.1:1"));
        assert!(matches!(st.events[..], [crate::Event::Started { engine: crate::MigrationEngine::Serial, .. }]));
        assert_eq!(f.client.migration_status().unwrap().state, crate::MigrationState::None);
        assert_eq!(f.client.cancel_migration().unwrap_err().status(), Some(409));
        // A stream: JSON lines until the connection closes.
        let mut c = std::os::unix::net::UnixStream::connect(f.server.path()).unwrap();
        std::io::Write::write_all(&mut c, b"GET /api/v1/vm.migration-events HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut got = String::new();
        std::io::Read::read_to_string(&mut c, &mut got).unwrap();
        let (head, body) = got.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200") && head.contains("application/x-ndjson"), "{head}");
        let lines: Vec<crate::MigrationLine> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3, "{body}");
        assert!(body.starts_with("{\"event\":\"stop_and_copy\",\"reason\":\"r0\""), "{body}");
        // A body that is not a MigrateRequest is a 400 with the reason.
        let (status, body) =
            f.client.request("PUT", paths::MIGRATE, Some(&serde_json::json!({"to": "x", "bogus": 1}))).unwrap();
        assert_eq!(status, 400);
        assert!(body.unwrap()["error"].as_str().unwrap().contains("bogus"));
        let (status, _) = f.client.request("PUT", paths::MIGRATE, None).unwrap();
        assert_eq!(status, 400);
    }

    #[test]
    fn empty_vmm_routes_carry_their_json_body() {
        let f = start();
        let req = crate::ReceiveMigrationRequest {
            receiver_url: "tcp:0.0.0.0:4444".into(),
            memory: Some(1 << 30),
            shared_memory: true,
            cpus: None,
            net: vec![crate::NicBackend { id: "net0".into(), tap: Some("tap7".into()), vhost_user: None }],
            numa: vec![crate::NodeBinding { node: 0, host_node: Some(1) }],
            disks: vec![crate::DiskPath { id: "disk0".into(), path: "/img/root.img".into() }],
            tls_dir: None,
            insecure: true,
        };
        f.client.receive_migration(&req).unwrap();
        let restore = crate::RestoreRequest {
            source_url: "file:///tmp/vm.snap".into(),
            net: Vec::new(),
            numa: Vec::new(),
            disks: Vec::new(),
            net_fds: Vec::new(),
        };
        let r = f.client.restore(&restore).unwrap();
        assert_eq!(r.path, std::path::Path::new("file:///tmp/vm.snap"));
        assert_eq!(f.vm.calls(), [ApiRequest::ReceiveMigration(req), ApiRequest::Restore(restore)]);
        // Cloud Hypervisor's field names; anything else is a 400 naming the field.
        for (path, body, want) in [
            (paths::RECEIVE_MIGRATION, serde_json::json!({"to": "tcp:x:1"}), "to"),
            (paths::RESTORE, serde_json::json!({"path": "/x"}), "path"),
            (paths::RECEIVE_MIGRATION, serde_json::json!({"receiver_url": "tcp:x:1", "memory": "1G"}), "invalid type"),
            (paths::RESTORE, serde_json::json!({"source_url": "/x", "net": [{"id": "net0", "tapp": "t"}]}), "tapp"),
        ] {
            let (status, b) = f.client.request("PUT", path, Some(&body)).unwrap();
            assert_eq!(status, 400, "{path} {body}");
            assert!(b.unwrap()["error"].as_str().unwrap().contains(want), "{path} {body}");
        }
        assert_eq!(f.client.request("PUT", paths::RESTORE, None).unwrap().0, 400);
    }

    #[test]
    fn pin_route_carries_vcpu_and_cpu_or_null() {
        let f = start();
        f.client.pin(1, Some(0)).unwrap();
        f.client.pin(0, None).unwrap();
        assert_eq!(
            f.vm.calls(),
            [
                ApiRequest::Pin(crate::PinRequest { vcpu: 1, cpu: Some(0) }),
                ApiRequest::Pin(crate::PinRequest { vcpu: 0, cpu: None })
            ]
        );
        assert!(f.client.pin(5, Some(0)).is_err());
        for body in [serde_json::json!({"cpu": 0}), serde_json::json!({"vcpu": 0, "cpu": 0, "x": 1})] {
            assert_eq!(f.client.request("PUT", paths::PIN, Some(&body)).unwrap().0, 400, "{body}");
        }
        assert_eq!(f.client.info().unwrap().vcpu_pins, [Some(0), None]);
    }

    #[test]
    fn resize_route_takes_cloud_hypervisors_body() {
        let f = start();
        f.client.resize(1, 5000).unwrap();
        let body = serde_json::json!({"desired_vcpus": 2});
        assert_eq!(f.client.request("PUT", paths::RESIZE, Some(&body)).unwrap().0, 204);
        assert_eq!(
            f.vm.calls(),
            [
                ApiRequest::Resize(crate::ResizeRequest { desired_vcpus: 1, timeout_ms: 5000 }),
                ApiRequest::Resize(crate::ResizeRequest { desired_vcpus: 2, timeout_ms: crate::RESIZE_TIMEOUT_MS })
            ]
        );
        assert!(f.client.resize(0, 1).is_err());
        for body in [serde_json::json!({}), serde_json::json!({"desired_vcpus": 1, "desired_ram": 1})] {
            assert_eq!(f.client.request("PUT", paths::RESIZE, Some(&body)).unwrap().0, 400, "{body}");
        }
    }

    #[test]
    fn a_keep_alive_client_sends_many_requests_on_one_connection() {
        let f = start();
        let c = f.client.clone().keep_alive();
        for _ in 0..3 {
            assert_eq!(c.ping().unwrap(), KUMO_VERSION);
        }
        assert!(c.release(&crate::ReleaseRequest { cpus: 2, ..Default::default() }).is_err());
        assert_eq!(c.release(&crate::ReleaseRequest { cpus: 1, ..Default::default() }).unwrap().host_cpus, [3]);
        // One connection served them all: the server saw one client connection.
        assert_eq!(f.vm.calls().len(), 5);
        assert!(c.kept_open(), "the connection stays open between requests");
    }

    #[test]
    fn elastic_routes_carry_their_bodies_and_statuses() {
        let f = start();
        let r = f.client.release(&crate::ReleaseRequest { cpus: 1, ..Default::default() }).unwrap();
        assert_eq!(r.host_cpus, [3]);
        let a = f
            .client
            .acquire(&crate::AcquireRequest { host_cpus: vec![3], from: Some("a".into()), ..Default::default() })
            .unwrap();
        assert_eq!(a.vcpus, [2]);
        assert_eq!(f.client.elastic().unwrap(), crate::ElasticInfo::default());
        let e = f.client.release(&crate::ReleaseRequest { cpus: 2, ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("did not confirm"), "{e}");
        let calls = f.vm.calls();
        assert_eq!(
            calls[0],
            ApiRequest::Release(crate::ReleaseRequest { cpus: 1, timeout_ms: 1000, ..Default::default() })
        );
        assert!(matches!(&calls[1], ApiRequest::Acquire(a) if a.from.as_deref() == Some("a") && a.timeout_ms == 1000));
        let body = serde_json::json!({"cpus": 1, "bogus": 2});
        assert_eq!(f.client.request("PUT", paths::RELEASE, Some(&body)).unwrap().0, 400);
        let lend = serde_json::json!({"to": "/run/b.sock", "cpus": 1, "return": true});
        let (s, b) = f.client.request("PUT", paths::LEND, Some(&lend)).unwrap();
        assert_eq!((s, b.unwrap()["total_ms"].as_f64()), (200, Some(2.0)));
        assert_eq!(f.client.request("PUT", paths::LEND, Some(&serde_json::json!({"cpus": 1}))).unwrap().0, 400);
        // Cloud Hypervisor's vm.resize-zone body.
        let z = crate::ResizeZoneRequest { id: "mem0".into(), desired_size: 128 << 20 };
        f.client.resize_zone(&z).unwrap();
        assert_eq!(f.vm.calls().last(), Some(&ApiRequest::ResizeZone(z)));
        let e = f.client.resize_zone(&crate::ResizeZoneRequest { id: "x".into(), desired_size: 0 }).unwrap_err();
        assert!(e.to_string().contains("no such zone"), "{e}");
        let body = serde_json::json!({"id": "mem0", "size": 1});
        assert_eq!(f.client.request("PUT", paths::RESIZE_ZONE, Some(&body)).unwrap().0, 400);
    }

    #[test]
    fn a_net_backend_serves_its_routes_alone() {
        let path = temp_sock();
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Running), calls: Mutex::default() });
        let _server = ApiServer::bind(&path).unwrap().service(Service::NetBackend).serve(vm.clone(), None).unwrap();
        let c = ApiClient::new(&path);
        // The VM's routes are not there; the backend's are, with their own 400 text.
        assert_eq!(c.ping().unwrap_err().status(), Some(404));
        assert_eq!(c.backend_info().unwrap_err().status(), Some(404), "the fake VM refuses it");
        let (status, body) = c.request("PUT", net_backend::paths::HANDOVER, Some(&serde_json::json!({}))).unwrap();
        assert_eq!(status, 400);
        assert!(body.unwrap()["error"].as_str().unwrap().starts_with("bad handover body"));
        assert_eq!(c.request("GET", net_backend::paths::HANDOVER, None).unwrap().0, 405);
        let _ = c.handover(&crate::HandoverRequest { to: 3, wait_ms: Some(5) });
        assert_eq!(
            vm.calls(),
            [ApiRequest::BackendInfo, ApiRequest::Handover(crate::HandoverRequest { to: 3, wait_ms: Some(5) })]
        );
    }

    #[test]
    fn an_adopted_socket_is_served_and_left_in_place() {
        // As libvirt does: the parent binds the socket and the VMM serves it.
        let path = temp_sock();
        let listener = UnixListener::bind(&path).unwrap();
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Running), calls: Mutex::default() });
        let mut server = ApiServer::adopt(listener).serve(vm.clone(), None).unwrap();
        assert_eq!(server.path(), path, "named by the address it was bound at");
        ApiClient::new(&path).pause().unwrap();
        assert_eq!(vm.calls(), [ApiRequest::Pause]);
        server.shutdown();
        assert!(path.exists(), "the parent's socket file is the parent's to remove");
        assert!(UnixStream::connect(&path).is_err(), "nobody serves it any more");
        fs::remove_file(&path).unwrap();
    }

    struct Fixture {
        vm: Arc<FakeVm>,
        server: ApiServerHandle,
        client: ApiClient,
    }

    fn start() -> Fixture {
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Running), calls: Mutex::default() });
        let path = temp_sock();
        let server = ApiServer::start(&path, vm.clone()).unwrap();
        Fixture { vm, server, client: ApiClient::new(&path) }
    }

    fn connect(path: &Path) -> Conn {
        Conn::new(UnixStream::connect(path).unwrap())
    }

    fn deadline() -> Instant {
        // Only guards against a hung test; nothing is measured.
        Instant::now() + Duration::from_secs(30)
    }

    /// Reads one response: status, headers, JSON body.
    fn read_one(conn: &mut Conn) -> (u16, Headers, Option<serde_json::Value>) {
        let head = conn.read_head(deadline()).unwrap();
        let (status, headers) = parse_response_head(&head).unwrap();
        let len = headers.content_length().unwrap().unwrap_or(0) as usize;
        let body = conn.read_body(len, deadline()).unwrap();
        let body = (!body.is_empty()).then(|| serde_json::from_slice(&body).unwrap());
        (status, headers, body)
    }

    /// Sends raw bytes on a new connection and reads one response.
    fn raw(path: &Path, bytes: &[u8]) -> (u16, Headers, Option<serde_json::Value>, Conn) {
        let mut conn = connect(path);
        conn.stream.write_all(bytes).unwrap();
        let (status, headers, body) = read_one(&mut conn);
        (status, headers, body, conn)
    }

    fn assert_closed(conn: &mut Conn) {
        assert!(matches!(conn.read_head(deadline()), Err(ReadError::Closed { partial: false })));
    }

    fn error_of(body: Option<serde_json::Value>) -> String {
        body.unwrap()["error"].as_str().unwrap().to_string()
    }

    #[test]
    fn ch_create_is_checked_by_its_route() {
        let f = start();
        let refused = serde_json::json!({"payload": {"kernel": "/k"}, "vfio": [{"path": "/x"}]});
        let (status, body) = f.client.request("PUT", paths::CREATE, Some(&refused)).unwrap();
        assert_eq!(status, 400);
        assert!(error_of(body).contains("field `vfio` is not supported by kumo"));
        let good = serde_json::json!({"kernel": {"path": "/k"}, "cmdline": {"args": "x"}, "rng": {}});
        assert_eq!(f.client.request("PUT", paths::CREATE, Some(&good)).unwrap().0, 204);
        let calls = f.vm.calls();
        assert!(matches!(calls.as_slice(), [ApiRequest::Create(c)] if c.kernel.is_some()), "{calls:?}");
        assert_eq!(f.client.request("PUT", paths::REBOOT, None).unwrap().0, 501);
    }

    #[test]
    fn ping_and_info_round_trip() {
        let f = start();
        assert_eq!(f.client.ping().unwrap(), KUMO_VERSION);
        assert_eq!(f.client.info().unwrap(), FakeVm::info(VmState::Running));
        let (status, body) = f.client.request("GET", paths::INFO, None).unwrap();
        assert_eq!(status, 200);
        assert_eq!(body.unwrap()["state"], "Running");
        assert_eq!(f.vm.calls(), [ApiRequest::Ping, ApiRequest::Info, ApiRequest::Info]);
    }

    #[test]
    fn pause_resume_shutdown_state_machine() {
        let f = start();
        f.client.pause().unwrap();
        assert_eq!(f.client.info().unwrap().state, VmState::Paused);

        let e = f.client.pause().unwrap_err();
        assert!(matches!(&e, ClientError::Http { status: 409, message } if message == "vm is already paused"), "{e:?}");
        assert_eq!(e.status(), Some(409));
        assert_eq!(
            f.client.request("PUT", paths::PAUSE, None).unwrap(),
            (409, Some(json!({"error": "vm is already paused"})))
        );

        f.client.resume().unwrap();
        assert_eq!(f.client.info().unwrap().state, VmState::Running);
        assert_eq!(f.client.resume().unwrap_err().status(), Some(409));

        assert_eq!(f.client.request("PUT", paths::SHUTDOWN, None).unwrap(), (204, None));
        assert_eq!(f.client.info().unwrap().state, VmState::Shutdown);
        assert_eq!(f.client.shutdown().unwrap_err().status(), Some(409));

        use ApiRequest::*;
        assert_eq!(f.vm.calls(), [Pause, Info, Pause, Pause, Resume, Info, Resume, Shutdown, Info, Shutdown]);
    }

    #[test]
    fn unknown_path_is_404() {
        let f = start();
        let (status, _, body, _) = raw(f.server.path(), b"GET /api/v1/vm.nope HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 404);
        assert!(error_of(body).contains("/api/v1/vm.nope"));
        let e = f.client.call("GET", "/", None).unwrap_err();
        assert_eq!(e.status(), Some(404));
        assert!(f.vm.calls().is_empty());
    }

    #[test]
    fn wrong_method_is_405_with_allow() {
        let f = start();
        let (status, headers, body, _) = raw(f.server.path(), b"GET /api/v1/vm.pause HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 405);
        assert_eq!(headers.get("allow"), Some("PUT"));
        assert!(error_of(body).contains("PUT"));
        let (status, headers, _, _) = raw(f.server.path(), b"DELETE /api/v1/vm.info HTTP/1.1\r\n\r\n");
        assert_eq!((status, headers.get("Allow")), (405, Some("GET")));
        assert!(f.vm.calls().is_empty());
    }

    #[test]
    fn garbage_is_400_and_closes() {
        let f = start();
        for bad in [
            &b"this is not http\r\n\r\n"[..],
            b"GET /api/v1/vmm.ping HTTP/1.1\r\nContent-Length: nope\r\n\r\n",
            b"GET /api/v1/vmm.ping HTTP/1.1\r\nbroken header\r\n\r\n",
            b"\x00\x01\x02\xff\xfe\n\n",
        ] {
            let (status, headers, body, mut conn) = raw(f.server.path(), bad);
            assert_eq!(status, 400, "{:?}", String::from_utf8_lossy(bad));
            assert_eq!(headers.get("connection"), Some("close"));
            assert!(!error_of(body).is_empty());
            assert_closed(&mut conn);
        }
        // Half a request, then the client stops sending.
        let mut conn = connect(f.server.path());
        conn.stream.write_all(b"GET /api/v1/vm").unwrap();
        conn.stream.shutdown(Shutdown::Write).unwrap();
        assert_eq!(read_one(&mut conn).0, 400);
        assert!(f.vm.calls().is_empty());
    }

    #[test]
    fn oversized_requests_are_rejected() {
        let f = start();
        let (status, _, body, mut conn) =
            raw(f.server.path(), b"PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n");
        assert_eq!(status, 413);
        assert!(error_of(body).contains("bytes"));
        assert_closed(&mut conn);

        let big = format!("GET /api/v1/vmm.ping HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        let (status, _, _, mut conn) = raw(f.server.path(), big.as_bytes());
        assert_eq!(status, 431);
        assert_closed(&mut conn);

        // Through the client, which sends the whole body anyway.
        let huge = json!("x".repeat(MAX_BODY + 1));
        assert_eq!(f.client.request("PUT", paths::PAUSE, Some(&huge)).unwrap().0, 413);
        assert!(f.vm.calls().is_empty());
    }

    #[test]
    fn a_body_route_without_content_length_is_411() {
        let f = start();
        let (status, headers, body, mut conn) = raw(f.server.path(), b"PUT /api/v1/vm.send-migration HTTP/1.1\r\n\r\n");
        assert_eq!(status, 411);
        assert_eq!(headers.get("connection"), Some("close"));
        assert!(error_of(body).contains("Content-Length"));
        assert_closed(&mut conn);
        // Routes without a body need no length.
        let (status, ..) = raw(f.server.path(), b"PUT /api/v1/vm.pause HTTP/1.1\r\n\r\n");
        assert_eq!(status, 204);
    }

    /// Mutated requests sent to a live server: every one gets a well-formed response with a
    /// status from the server's set, or a clean close, and the server keeps serving.
    #[test]
    fn fuzzed_requests_get_a_valid_status() {
        let f = start();
        let mut rng = crate::http::fuzz::Rng(0x6b75_6d6f);
        let allowed = [200, 204, 400, 404, 405, 409, 411, 413, 414, 431, 501, 505];
        for i in 0..2_000 {
            let bytes = crate::http::fuzz::mutated_request(&mut rng);
            let mut conn = connect(f.server.path());
            // The server may close before reading everything (a bad head); that is fine.
            let _ = conn.stream.write_all(&bytes);
            let _ = conn.stream.shutdown(Shutdown::Write);
            let mut head = conn.read_head(deadline());
            if head.as_ref().is_ok_and(|h| h.starts_with(b"HTTP/1.1 100 ")) {
                head = conn.read_head(deadline()); // after 100 Continue, the real answer
            }
            match head {
                Ok(head) => {
                    let (status, headers) = parse_response_head(&head).unwrap_or_else(|e| {
                        panic!("case {i}: bad response head {e}: {:?}", String::from_utf8_lossy(&head))
                    });
                    assert!(
                        allowed.contains(&status),
                        "case {i}: status {status} for {:?}",
                        String::from_utf8_lossy(&bytes)
                    );
                    assert!(headers.content_length().is_ok(), "case {i}");
                }
                Err(ReadError::Closed { partial: false }) => {}
                Err(e) => panic!("case {i}: {e:?} for {:?}", String::from_utf8_lossy(&bytes)),
            }
        }
        assert!(f.client.ping().is_ok(), "the server still answers");
    }

    #[test]
    fn unsupported_framing_is_rejected() {
        let f = start();
        let (status, ..) =
            raw(f.server.path(), b"PUT /api/v1/vm.pause HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n");
        assert_eq!(status, 501);
        // Chunked with Content-Length too: refused (a request smuggling risk).
        let (status, ..) = raw(
            f.server.path(),
            b"PUT /api/v1/vm.pause HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        );
        assert_eq!(status, 501);
        let (status, ..) = raw(f.server.path(), b"GET /api/v1/vmm.ping HTTP/3\r\n\r\n");
        assert_eq!(status, 505);
    }

    #[test]
    fn chunked_bodies_are_read() {
        let f = start();
        // libvirt's curl: a PUT with no body, chunked (after 100 Continue), then one with JSON
        // split across chunks (an extension and a trailer too), on one connection.
        let mut conn = connect(f.server.path());
        conn.stream
            .write_all(b"PUT /api/v1/vm.pause HTTP/1.1\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
            .unwrap();
        assert_eq!(read_one(&mut conn).0, 100);
        conn.stream.write_all(b"0\r\n\r\n").unwrap();
        assert_eq!(read_one(&mut conn).0, 204);
        let body = b"PUT /api/v1/vm.pin HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n\
                     5;x=y\r\n{\"vcp\r\n13\r\nu\": 0, \"cpu\": null}\r\n0\r\nX-T: 1\r\n\r\n";
        conn.stream.write_all(body).unwrap();
        assert_eq!(read_one(&mut conn).0, 204);
        assert_eq!(f.vm.calls()[1], ApiRequest::Pin(crate::PinRequest { vcpu: 0, cpu: None }));
        for bad in [&b"zz\r\n"[..], b"-1\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", b"123456789\r\n"] {
            let mut req = b"PUT /api/v1/vm.pause HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            req.extend_from_slice(bad);
            let (status, ..) = raw(f.server.path(), &req);
            assert_eq!(status, 400, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn keep_alive_serves_several_requests() {
        let f = start();
        let mut conn = connect(f.server.path());
        // One after the other, including an error that keeps the connection.
        for req in [&b"GET /api/v1/vmm.ping HTTP/1.1\r\n\r\n"[..], b"GET /nope HTTP/1.1\r\n\r\n"] {
            conn.stream.write_all(req).unwrap();
            read_one(&mut conn);
        }
        // Pipelined, the body of the first in the same write.
        conn.stream
            .write_all(
                b"PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}\
                  GET /api/v1/vm.info HTTP/1.1\r\n\r\n",
            )
            .unwrap();
        assert_eq!(read_one(&mut conn).0, 204);
        let (status, _, body) = read_one(&mut conn);
        assert_eq!((status, body.unwrap()["state"].as_str()), (200, Some("Paused")));
        // Connection: close ends it after the response.
        conn.stream.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
        let (status, headers, _) = read_one(&mut conn);
        assert_eq!((status, headers.get("connection")), (200, Some("close")));
        assert_closed(&mut conn);
        assert_eq!(f.vm.calls(), [ApiRequest::Ping, ApiRequest::Pause, ApiRequest::Info, ApiRequest::Ping]);

        // HTTP/1.0 closes unless asked otherwise.
        let (status, _, _, mut conn) = raw(f.server.path(), b"GET /api/v1/vmm.ping HTTP/1.0\r\n\r\n");
        assert_eq!(status, 200);
        assert_closed(&mut conn);
    }

    #[test]
    fn expect_continue_gets_100_first() {
        let f = start();
        let mut conn = connect(f.server.path());
        conn.stream
            .write_all(b"PUT /api/v1/vm.pause HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
            .unwrap();
        assert_eq!(read_one(&mut conn).0, 100);
        conn.stream.write_all(b"{}").unwrap();
        assert_eq!(read_one(&mut conn).0, 204);
    }

    #[test]
    fn silent_clients_do_not_block_others() {
        let f = start();
        let _silent = connect(f.server.path());
        let mut partial = connect(f.server.path());
        partial.stream.write_all(b"GET /api/v1/vm.info HTTP/1.1\r\nHost:").unwrap();
        assert_eq!(f.client.ping().unwrap(), KUMO_VERSION);
        assert_eq!(f.client.info().unwrap().state, VmState::Running);
    }

    #[test]
    fn shutdown_removes_socket_and_closes_idle_connections() {
        let mut f = start();
        let path = f.server.path().to_path_buf();
        let mut idle = connect(&path);
        idle.stream.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\n\r\n").unwrap();
        read_one(&mut idle);
        assert!(path.exists());

        f.server.shutdown();
        assert!(!path.exists());
        assert_closed(&mut idle);
        f.server.shutdown(); // idempotent
        let e = f.client.ping().unwrap_err();
        assert!(matches!(e, ClientError::Connect { .. }), "{e:?}");
    }

    #[test]
    fn drop_stops_the_server() {
        let f = start();
        let path = f.server.path().to_path_buf();
        drop(f.server);
        assert!(!path.exists());
        assert!(UnixStream::connect(&path).is_err());
    }

    #[test]
    fn second_server_on_live_socket_fails() {
        let f = start();
        let e = ApiServer::start(f.server.path(), f.vm.clone()).err().unwrap();
        assert!(matches!(&e, ServerError::InUse(p) if p == f.server.path()), "{e:?}");
        assert!(e.to_string().contains("already serving"), "{e}");
        // The first one is unharmed.
        assert_eq!(f.client.ping().unwrap(), KUMO_VERSION);
    }

    #[test]
    fn stale_socket_is_replaced() {
        let path = temp_sock();
        drop(UnixListener::bind(&path).unwrap()); // leaves the file, nobody listening
        assert!(path.exists());
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Paused), calls: Mutex::default() });
        let _server = ApiServer::start(&path, vm).unwrap();
        assert_eq!(ApiClient::new(&path).info().unwrap().state, VmState::Paused);
    }

    #[test]
    fn refuses_to_replace_a_regular_file() {
        let path = temp_sock();
        fs::write(&path, "precious").unwrap();
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Running), calls: Mutex::default() });
        let e = ApiServer::start(&path, vm).err().unwrap();
        assert!(matches!(e, ServerError::NotASocket(_)), "{e:?}");
        assert_eq!(fs::read_to_string(&path).unwrap(), "precious");
        fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_peer_whose_uid_is_not_allowed_is_refused() {
        let me = kumo_sandbox::sock::euid();
        let path = temp_sock();
        let vm = Arc::new(FakeVm { state: Mutex::new(VmState::Running), calls: Mutex::default() });
        let server = ApiServer::start_allowing(&path, vm.clone(), Some(vec![me.wrapping_add(1)])).unwrap();
        let e = ApiClient::new(&path).info().unwrap_err();
        assert!(
            matches!(&e, ClientError::Http { status: 403, message } if message.contains(&format!("uid {me} "))),
            "{e:?}"
        );
        drop(server);
        let _server = ApiServer::start_allowing(&path, vm, Some(vec![me])).unwrap();
        assert_eq!(ApiClient::new(&path).info().unwrap().state, VmState::Running);
    }

    #[test]
    fn socket_is_private() {
        let f = start();
        let mode = fs::metadata(f.server.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    struct Misbehaving;
    impl ApiHandler for Misbehaving {
        fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
            match req {
                ApiRequest::Pause => panic!("handler bug (expected by the test)"),
                ApiRequest::Resume => Err(ApiError::internal("an internal error")),
                _ => Err(ApiError::unavailable("vm is still booting")),
            }
        }
    }

    #[test]
    fn handler_failures_become_error_statuses() {
        let path = temp_sock();
        let _server = ApiServer::start(&path, Arc::new(Misbehaving)).unwrap();
        let client = ApiClient::new(&path);
        assert_eq!(client.pause().unwrap_err().status(), Some(500));
        assert_eq!(client.resume().unwrap_err().status(), Some(500));
        let e = client.info().unwrap_err();
        assert!(matches!(&e, ClientError::Http { status: 503, message } if message == "vm is still booting"));
        // The server survived the panic.
        assert_eq!(client.shutdown().unwrap_err().status(), Some(503));
    }

    #[test]
    fn json_body_decodes_or_400s() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Target {
            dest: String,
        }
        assert_eq!(json_body::<Target>(br#"{"dest":"x"}"#), Ok(Target { dest: "x".into() }));
        assert_eq!(json_body::<Target>(b"").unwrap_err().kind, ErrorKind::BadRequest);
        assert_eq!(json_body::<Target>(b"{").unwrap_err().kind, ErrorKind::BadRequest);
        assert_eq!(json_body::<Target>(b"{}").unwrap_err().kind, ErrorKind::BadRequest);
    }

    #[test]
    fn every_route_is_documented() {
        let md = include_str!("../../../docs/api.md");
        let yaml = include_str!("../../../docs/openapi.yaml");
        for r in VM_ROUTES {
            let short = r.path.trim_start_matches("/api/v1");
            assert!(md.contains(&format!("{} {}", r.method, r.path)), "api.md lacks {} {}", r.method, r.path);
            assert!(yaml.contains(&format!("  {short}:")), "openapi.yaml lacks {short}");
        }
        let nb = include_str!("../../../docs/net-backend.md");
        for r in NET_BACKEND_ROUTES {
            assert!(nb.contains(&format!("{} {}", r.method, r.path)), "net-backend.md lacks {} {}", r.method, r.path);
        }
    }

    /// Pings answer at once; migrations block until the test opens the gate.
    #[derive(Default)]
    struct Gate {
        entered: AtomicUsize,
        open: Mutex<bool>,
        opened: std::sync::Condvar,
    }

    impl Gate {
        fn open(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
        /// Polls the state (no timing assumption) until `n` calls block.
        fn wait_entered(&self, n: usize) {
            while self.entered.load(Ordering::SeqCst) < n {
                thread::sleep(Duration::from_millis(1));
            }
        }
    }

    impl ApiHandler for Gate {
        fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
            match req {
                ApiRequest::Ping => Ok(ApiResponse::Pong(crate::Pong::here())),
                ApiRequest::Migrate(_) => {
                    self.entered.fetch_add(1, Ordering::SeqCst);
                    let mut open = self.open.lock().unwrap();
                    while !*open {
                        open = self.opened.wait(open).unwrap();
                    }
                    Ok(ApiResponse::Migration(Box::new(fake_status(crate::MigrationState::Completed, None, None))))
                }
                _ => Err(ApiError::conflict("not in this test")),
            }
        }
    }

    fn migrate_req() -> crate::MigrateRequest {
        crate::MigrateRequest::to("unix:/nowhere")
    }

    /// `n` migrations that block in the handler until the gate opens.
    fn blocked_calls(path: &Path, gate: &Arc<Gate>, n: usize) -> Vec<JoinHandle<()>> {
        let calls = (0..n)
            .map(|_| {
                let client = ApiClient::new(path);
                thread::spawn(move || {
                    assert_eq!(client.send_migration(&migrate_req()).unwrap().state, crate::MigrationState::Completed);
                })
            })
            .collect();
        gate.wait_entered(n);
        calls
    }

    #[test]
    fn long_calls_do_not_stop_pings() {
        let path = temp_sock();
        let gate = Arc::new(Gate::default());
        let _server = ApiServer::start(&path, gate.clone()).unwrap();
        let calls = blocked_calls(&path, &gate, 3);
        let client = ApiClient::new(&path);
        for _ in 0..20 {
            assert_eq!(client.ping().unwrap(), KUMO_VERSION);
        }
        gate.open();
        for c in calls {
            c.join().unwrap();
        }
    }

    #[test]
    fn all_slots_busy_answers_503_not_reset() {
        let path = temp_sock();
        let gate = Arc::new(Gate::default());
        let _server = ApiServer::start(&path, gate.clone()).unwrap();
        let calls = blocked_calls(&path, &gate, MAX_SERVING);
        // A raw client that writes its whole request before reading: the
        // server must have read it (no reset) and answer a JSON 503.
        let (status, headers, body, mut conn) = raw(&path, b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!((status, headers.get("connection")), (503, Some("close")));
        assert!(error_of(body).contains("in progress"));
        assert_closed(&mut conn);
        let e = ApiClient::new(&path).ping().unwrap_err();
        assert_eq!(e.status(), Some(503), "{e:?}");
        gate.open();
        for c in calls {
            c.join().unwrap();
        }
        assert_eq!(ApiClient::new(&path).ping().unwrap(), KUMO_VERSION);
    }

    #[test]
    fn slow_clients_do_not_starve_pings() {
        const SLOW: usize = 40;
        let f = start();
        let path = f.server.path().to_path_buf();
        let stop = Arc::new(AtomicBool::new(false));
        let slow: Vec<_> = (0..SLOW)
            .map(|_| {
                let (path, stop) = (path.clone(), stop.clone());
                thread::spawn(move || {
                    let head = b"GET /api/v1/vmm.ping HTTP/1.1\r\nX-Slow: ";
                    // Bounded: each connection lives at most HEAD_TIMEOUT, reconnects are counted.
                    for _ in 0..50 {
                        let Ok(mut s) = UnixStream::connect(&path) else {
                            return;
                        };
                        for &b in head.iter().chain(std::iter::repeat_n(&b'a', 1000)) {
                            if stop.load(Ordering::SeqCst) {
                                return;
                            }
                            if s.write_all(&[b]).is_err() {
                                break; // dropped by the server: come back
                            }
                            thread::sleep(Duration::from_millis(100));
                        }
                    }
                })
            })
            .collect();
        // Start pinging once the slow connections hold their places.
        while f.server.shared.conns().len() < SLOW {
            thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..50 {
            assert_eq!(f.client.ping().unwrap(), KUMO_VERSION);
        }
        stop.store(true, Ordering::SeqCst);
        for t in slow {
            t.join().unwrap();
        }
    }

    #[test]
    fn many_idle_connections_never_cause_a_reset() {
        let f = start();
        let idle: Vec<Conn> = (0..500).map(|_| connect(f.server.path())).collect();
        // A new client that writes its request first: the write must not
        // fail and it gets an answer, served (an idle one made room) or 503.
        let mut conn = connect(f.server.path());
        conn.stream.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
        let (status, _, body) = read_one(&mut conn);
        assert!(status == 200 || status == 503, "{status} {body:?}");
        assert_eq!(f.client.ping().unwrap(), KUMO_VERSION);
        // The oldest idle connection was closed cleanly, without an answer.
        let mut oldest = idle.into_iter().next().unwrap();
        assert_closed(&mut oldest);
    }

    #[test]
    fn huge_request_line_is_414_not_reset() {
        let f = start();
        let mut conn = connect(f.server.path());
        let mut writer = conn.stream.try_clone().unwrap();
        // The client writes all of it before reading; the server drains it.
        let w = thread::spawn(move || {
            let mut line = b"GET /".to_vec();
            line.resize(1 << 20, b'a');
            line.extend_from_slice(b" HTTP/1.1\r\n\r\n");
            let _ = writer.write_all(&line);
        });
        let (status, headers, body) = read_one(&mut conn);
        assert_eq!((status, headers.get("connection")), (414, Some("close")));
        assert!(error_of(body).contains("request line"));
        w.join().unwrap();
        assert!(f.vm.calls().is_empty());
    }

    #[test]
    fn idle_connections_are_evicted_oldest_first() {
        let mut conns = Conns::new();
        let t0 = Instant::now();
        let mut peers = Vec::new();
        for (id, phase, age) in [
            (0, Phase::Reading, 9),
            (1, Phase::Serving, 10),
            (2, Phase::Idle, 1),
            (3, Phase::Idle, 5),
            (4, Phase::Closing, 0),
        ] {
            let (a, b) = UnixStream::pair().unwrap();
            peers.push(b);
            let since = t0.checked_sub(Duration::from_secs(age)).unwrap_or(t0);
            conns.insert(id, Entry { stream: a, phase, since });
        }
        let left = |c: &Conns| {
            let mut ids: Vec<u64> = c.keys().copied().collect();
            ids.sort();
            ids
        };
        evict_until(&mut conns, 3, None);
        assert_eq!(left(&conns), [0, 1, 2, 3]);
        evict_until(&mut conns, 2, None);
        assert_eq!(left(&conns), [0, 1, 2]);
        evict_until(&mut conns, 1, Some(2));
        assert_eq!(left(&conns), [1, 2]);
        // Serving connections are never evicted.
        evict_until(&mut conns, 0, Some(2));
        assert_eq!(left(&conns), [1, 2]);
    }

    /// A pipe whose write end goes to the server: once every copy of it is closed, its read
    /// end reads end-of-file instead of "nothing yet".
    fn pipe() -> (std::fs::File, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors this test then owns.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
        // SAFETY: both are new and owned once each here.
        unsafe { (std::fs::File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn all_closed(r: &mut std::fs::File) -> bool {
        matches!(std::io::Read::read(r, &mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn descriptors_sent_with_add_net_ride_in_its_body() {
        let f = start();
        let (mut r, w) = pipe();
        let (_r2, w2) = pipe();
        let body = json!({"fds": [-1, -1], "mac": "52:54:00:00:00:01", "num_queues": 4});
        let (status, _) =
            f.client.request_with_fds("PUT", paths::ADD_NET, Some(&body), &[w.as_fd(), w2.as_fd()]).unwrap();
        assert_eq!(status, 204);
        let calls = f.vm.calls();
        let [ApiRequest::AddNet(n)] = &calls[..] else { panic!("{calls:?}") };
        assert_eq!(n.tap_fds.len(), 2);
        assert_eq!(n.fds.as_deref(), Some(&n.tap_fds.raw()[..]), "vm.info shows the numbers here");
        assert!(n.tap_fds.raw().iter().all(|&fd| fd >= 0));
        drop(w);
        assert!(!all_closed(&mut r), "the request holds the server's copy");
        drop(calls);
        f.vm.calls.lock().unwrap().clear();
        assert!(all_closed(&mut r), "dropped with the request");
    }

    #[test]
    fn descriptors_a_route_does_not_take_are_refused_and_closed() {
        let f = start();
        let (mut r, w) = pipe();
        let (status, body) = f.client.request_with_fds("PUT", paths::PAUSE, None, &[w.as_fd()]).unwrap();
        assert_eq!(status, 400);
        assert!(body.unwrap()["error"].as_str().unwrap().contains("takes no file descriptors"));
        drop(w);
        assert!(all_closed(&mut r));
        assert!(f.vm.calls().is_empty());
        // vm.create's net[] takes as many as its `fds` lists, in order; a count that does not
        // match is a 400.
        let (mut r, w) = pipe();
        let create = json!({"payload": {"kernel": "/k"}, "net": [{"tap": "a"}, {"fds": [-1]}]});
        let fds = [w.as_fd(), w.as_fd()];
        let (status, body) = f.client.request_with_fds("PUT", paths::CREATE, Some(&create), &fds).unwrap();
        assert_eq!(status, 400, "{body:?}");
        assert!(body.unwrap()["error"].as_str().unwrap().contains("list 1 file descriptor in all but 2 came"));
        let (status, _) = f.client.request_with_fds("PUT", paths::CREATE, Some(&create), &fds[..1]).unwrap();
        assert_eq!(status, 204);
        let calls = f.vm.calls();
        let [ApiRequest::Create(c)] = &calls[..] else { panic!("{calls:?}") };
        let net = c.net.as_ref().unwrap();
        assert_eq!((net[0].tap_fds.len(), net[1].tap_fds.len()), (0, 1));
        // A body that lists descriptors none came with is a 400.
        let (status, body) = f.client.request("PUT", paths::ADD_NET, Some(&json!({"fds": [-1]}))).unwrap();
        assert_eq!(status, 400);
        assert!(body.unwrap()["error"].as_str().unwrap().contains("none came with the request"));
        drop((w, calls));
        f.vm.calls.lock().unwrap().clear();
        assert!(all_closed(&mut r));
    }

    #[test]
    fn too_many_descriptors_are_a_400_and_closed() {
        let f = start();
        let (mut r, w) = pipe();
        let many = vec![w.as_fd(); MAX_FDS + 1];
        let (status, body) =
            f.client.request_with_fds("PUT", paths::ADD_NET, Some(&json!({"num_queues": 2})), &many).unwrap();
        assert_eq!(status, 400);
        assert!(body.unwrap()["error"].as_str().unwrap().contains("more than 64 file descriptors"));
        drop(w);
        assert!(all_closed(&mut r));
        assert!(f.vm.calls().is_empty());
        // vm.restore shares its descriptors out by `net_fds`.
        let (_r, w) = pipe();
        let body = json!({"source_url": "file:///s", "net_fds": [{"id": "net1", "num_fds": 1, "fds": [-1]}, {"id": "net0", "num_fds": 2}]});
        let (status, _) =
            f.client.request_with_fds("PUT", paths::RESTORE, Some(&body), &[w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        assert_eq!(status, 200);
        let calls = f.vm.calls();
        let [ApiRequest::Restore(rq)] = &calls[..] else { panic!("{calls:?}") };
        assert_eq!((rq.net_fds[0].tap_fds.len(), rq.net_fds[1].tap_fds.len()), (1, 2));
        let (status, _) = f.client.request_with_fds("PUT", paths::RESTORE, Some(&body), &[w.as_fd()]).unwrap();
        assert_eq!(status, 400);
    }
}
