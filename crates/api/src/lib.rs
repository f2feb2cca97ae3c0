//! kumo's control API: HTTP/1.1 with JSON bodies over a unix domain socket,
//! in the style of Firecracker and Cloud Hypervisor (`/api/v1/...`).
//!
//! The server ([`ApiServer`]) knows nothing about KVM: it parses HTTP, maps
//! routes to [`ApiRequest`]s and hands them to the VMM's [`ApiHandler`]. The
//! client ([`ApiClient`]) is what `kumo` subcommands use to talk to a VM.
//! See docs/api.md for the wire protocol.

mod client;
mod http;
mod server;

pub use client::{ApiClient, ClientError, DEFAULT_CLIENT_TIMEOUT};
pub use server::{routes, ApiHandler, ApiServer, ApiServerHandle, ServerError};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Version reported by `vmm.ping` and `vm.info`.
pub const KUMO_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Route paths, shared by the server's route table and the client.
pub mod paths {
    pub const PING: &str = "/api/v1/vmm.ping";
    pub const INFO: &str = "/api/v1/vm.info";
    pub const PAUSE: &str = "/api/v1/vm.pause";
    pub const RESUME: &str = "/api/v1/vm.resume";
    pub const SHUTDOWN: &str = "/api/v1/vm.shutdown";
    /// Cloud Hypervisor's name for it (it was `vm.migrate`).
    pub const MIGRATE: &str = "/api/v1/vm.send-migration";
    pub const MIGRATION: &str = "/api/v1/vm.migration";
    pub const SNAPSHOT: &str = "/api/v1/vm.snapshot";
    pub const COUNTERS: &str = "/api/v1/vm.counters";
    pub const CANCEL_MIGRATION: &str = "/api/v1/vm.cancel-migration";
    pub const MIGRATION_EVENTS: &str = "/api/v1/vm.migration-events";
    /// Cloud Hypervisor's name: an empty VMM starts listening for a migrating VM.
    pub const RECEIVE_MIGRATION: &str = "/api/v1/vm.receive-migration";
    /// An empty VMM runs the VM saved in a snapshot file.
    pub const RESTORE: &str = "/api/v1/vm.restore";
    /// Re-pins (or unpins) one vCPU to a host CPU.
    pub const PIN: &str = "/api/v1/vm.pin";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Created,
    /// A destination (`kumo run --incoming`): the VM is arriving by migration.
    Receiving,
    Running,
    Paused,
    Shutdown,
}

/// Body of `GET /api/v1/vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    pub state: VmState,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// What the VM boots, e.g. "guest:hello" or "kernel:/path/to/bzImage".
    pub guest: String,
    /// "kernel" (in-kernel irqchip) or "split".
    pub irqchip: String,
    pub pid: u32,
    pub uptime_ms: u64,
    pub kumo_version: String,
    /// The VM's NICs, net0 first.
    #[serde(default)]
    pub net: Vec<NetInfo>,
    /// The guest's NUMA nodes (`--numa`), node 0 first; empty without them.
    #[serde(default)]
    pub numa: Vec<NumaNodeInfo>,
    /// Each vCPU's host CPU as its thread's affinity reads (`null`: it floats), vCPU 0 first.
    #[serde(default)]
    pub vcpu_pins: Vec<Option<u32>>,
    /// The KVM paravirtual features the guest's CPUID offers (`--pv`, resolved); absent before
    /// a VM exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv: Option<PvInfo>,
}

/// The paravirtual features in [`VmInfo`]: each on or off as the guest's CPUID leaf
/// 0x40000001 has it (docs/pv-features.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PvInfo {
    pub steal_time: bool,
    pub pv_unhalt: bool,
    pub tlb_flush: bool,
    pub poll_control: bool,
    pub pv_ipi: bool,
    /// `KVM_HINTS_REALTIME`: the vCPUs are dedicated.
    pub realtime: bool,
}

/// A guest NUMA node in [`VmInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNodeInfo {
    /// Node id, its ACPI proximity domain.
    pub id: u32,
    /// Its vCPUs.
    pub cpus: Vec<u32>,
    pub memory_bytes: u64,
    /// The host node its memory is bound to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    /// Its distance to each node, node 0 first (its SLIT row).
    pub distances: Vec<u8>,
}

/// A NIC in [`VmInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetInfo {
    /// `net0`, `net1`, ...: its name in snapshots.
    pub id: String,
    /// The host tap it is attached to; empty for a NIC a vhost-user backend serves.
    pub tap: String,
    pub mac: String,
    /// Queue pairs.
    pub queues: u16,
    /// Its interrupt path: `direct`, `dedicated` (to `vcpu`) or `shared`.
    pub irq: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu: Option<u32>,
    /// Its PCI address, e.g. `0000:00:01.0`.
    pub pci: String,
    /// The guest's driver has it running (virtio DRIVER_OK).
    pub driver_ok: bool,
    /// Frames are counted only by a NIC kumo serves itself (a tap); a vhost-user NIC counts
    /// its interrupts alone.
    pub counters: NetCounters,
    /// Set for a NIC whose queues a vhost-user backend serves (`--net vhost-user=PATH`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_user: Option<VhostUserInfo>,
}

/// A vhost-user NIC's connection to its backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostUserInfo {
    /// The backend's unix socket.
    pub socket: String,
    /// The backend is connected (false once it hung up; kumo does not reconnect).
    pub connected: bool,
    /// The link status the guest reads: connected and, if the backend reports a status, up.
    pub link_up: bool,
    /// Virtio features the backend offered (GET_FEATURES).
    pub features: u64,
    /// vhost-user protocol features negotiated.
    pub protocol_features: u64,
    /// Config changes the backend announced (CONFIG_CHANGE_MSG).
    pub config_changes: u64,
}

/// A NIC's frame counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Frames the guest gave no (or too small) buffers for, or a bad chain.
    pub rx_dropped: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
    /// Interrupts it raised.
    pub interrupts: u64,
}

/// What a client asked for, decoded from method + path (+ JSON body).
/// Routes with a body add a variant carrying its deserialized type, e.g.
/// `Migrate(MigrateConfig)`, plus one line in the server's route table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiRequest {
    Ping,
    Info,
    Pause,
    Resume,
    Shutdown,
    /// Migrate the VM (or, with `dry_run`, only estimate the migration).
    Migrate(MigrateRequest),
    /// Progress events and result of the current or last migration.
    MigrationStatus,
    /// Cancel the running migration; the VM runs on here.
    CancelMigration,
    /// The migration's events as JSON lines, streamed until it ends.
    MigrationEvents,
    /// Write the VM to a file (paused meanwhile).
    Snapshot(SnapshotRequest),
    /// vCPU exits, assists, interrupts and migration bytes so far.
    Counters,
    /// An empty VMM: listen for a migrating VM and run it once it has arrived.
    ReceiveMigration(ReceiveMigrationRequest),
    /// An empty VMM: run the VM saved in a snapshot file.
    Restore(RestoreRequest),
    /// Pin one vCPU to a host CPU, or unpin it.
    Pin(PinRequest),
}

/// Body of `PUT /api/v1/vm.pin`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinRequest {
    pub vcpu: u32,
    /// The host CPU it may run on from now; `null`: unpinned, it floats.
    pub cpu: Option<u32>,
}

/// Body of `PUT /api/v1/vm.receive-migration` (Cloud Hypervisor's field name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveMigrationRequest {
    /// Where to listen: `tcp:HOST:PORT` or `unix:PATH`.
    pub receiver_url: String,
    /// Only a VM of this many bytes of memory is taken; it is allocated and faulted in before
    /// listening (`kumo run --incoming --memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Only a VM with this many vCPUs is taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
}

/// Body of `PUT /api/v1/vm.restore` (Cloud Hypervisor's field name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// The snapshot file: `file:///abs/path` or `/abs/path`.
    pub source_url: String,
}

/// Body of `PUT /api/v1/vm.snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// Absolute path of the file to write (replaced if it exists).
    pub path: String,
}

/// How a migration moves pages (see docs/migration.md, "Engines").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationEngine {
    Serial,
    Overlap,
    Zerocopy,
    /// Same host, `unix:PATH` only: guest memory is shared, not copied.
    Local,
}

/// Body of `PUT /api/v1/vm.send-migration`. `MigrateRequest::to(addr)` has every option at
/// its default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// Destination: `tcp:HOST:PORT` or `unix:PATH` of a `kumo run --incoming`.
    pub to: String,
    /// Default `overlap`.
    #[serde(default)]
    pub engine: Option<MigrationEngine>,
    /// Stop pre-copy once the rest fits this downtime (ms).
    #[serde(default)]
    pub downtime_ms: Option<u64>,
    /// Apply Xen's stop rule (≤ 50 dirty pages, 30 rounds, 3x pages): default true unless only
    /// `downtime_ms` is given.
    #[serde(default)]
    pub xen: Option<bool>,
    /// Parallel connections (overlap, zerocopy).
    #[serde(default)]
    pub connections: Option<usize>,
    /// Only observe the guest's dirtying for `estimate_ms` and predict the migration.
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default)]
    pub estimate_ms: Option<u64>,
    /// Give up when the destination takes no data or does not answer for this long (ms);
    /// the source then runs on. Default 15,000.
    #[serde(default)]
    pub progress_timeout_ms: Option<u64>,
    /// Make `downtime_ms` a promise: fail the migration (the VM runs on here) rather than
    /// exceed it. Without it, a guest that does not converge is throttled and then stopped
    /// anyway, with the overshoot reported.
    #[serde(default)]
    pub strict: Option<bool>,
    /// Cap on the page data sent, bytes per second.
    #[serde(default)]
    pub max_bandwidth: Option<u64>,
}

impl MigrateRequest {
    /// A migration to `addr` with every option at its default.
    pub fn to(addr: impl Into<String>) -> MigrateRequest {
        MigrateRequest { to: addr.into(), ..MigrateRequest::default() }
    }
}

/// What the handler answers on success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiResponse {
    /// 204 No Content.
    Ok,
    /// 200 `{"kumo_version": ...}`.
    Pong { kumo_version: String },
    /// 200 with the [`VmInfo`] as body.
    Info(VmInfo),
    /// 200 with any JSON body (migration reports, progress).
    Json(Value),
    /// 200 with JSON lines written as they come, until the producer ends; the connection
    /// closes after it (the body ends there).
    Stream(JsonLines),
}

/// The producer of a streamed answer: called once with a sink that writes one line and says
/// whether to go on (false: the client left or the server stops).
#[derive(Clone)]
pub struct JsonLines(std::sync::Arc<LineProducer>);

/// Writes lines through the sink it is given until it is done or the sink says stop.
pub type LineProducer = dyn Fn(&mut dyn FnMut(&Value) -> bool) + Send + Sync;

impl JsonLines {
    pub fn new(f: impl Fn(&mut dyn FnMut(&Value) -> bool) + Send + Sync + 'static) -> Self {
        JsonLines(std::sync::Arc::new(f))
    }

    pub fn run(&self, sink: &mut dyn FnMut(&Value) -> bool) {
        (self.0)(sink)
    }
}

impl std::fmt::Debug for JsonLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JsonLines")
    }
}

// A producer is equal only to itself.
impl PartialEq for JsonLines {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for JsonLines {}

impl ApiResponse {
    /// Status and JSON body on the wire.
    pub fn into_http(self) -> Result<(u16, Option<Value>), ApiError> {
        Ok(match self {
            ApiResponse::Ok => (204, None),
            ApiResponse::Pong { kumo_version } => (200, Some(json!({ "kumo_version": kumo_version }))),
            ApiResponse::Info(info) => (200, Some(to_json(&info)?)),
            ApiResponse::Json(v) => (200, Some(v)),
            ApiResponse::Stream(_) => return Err(ApiError::internal("a streamed answer has no single body")),
        })
    }
}

fn to_json<T: Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(format!("cannot encode response: {e}")))
}

/// An error answered to the client as `status` with body `{"error": message}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into() }
    }
    /// 400: the request is malformed or its body invalid.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }
    /// 404: no such route.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, message)
    }
    /// 405: the route exists but not with this method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, message)
    }
    /// 409: not possible in the VM's current state (e.g. already paused).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, message)
    }
    /// 413: body over the size limit.
    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self::new(413, message)
    }
    /// 500: the VMM failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }
    /// 503: the VMM cannot serve this right now (e.g. still booting).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, message)
    }

    /// The error body, `{"error": message}`.
    pub fn body(&self) -> Value {
        json!({ "error": self.message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_serializes_lowercase() {
        assert_eq!(serde_json::to_string(&VmState::Paused).unwrap(), "\"paused\"");
        assert_eq!(serde_json::from_str::<VmState>("\"shutdown\"").unwrap(), VmState::Shutdown);
    }

    #[test]
    fn responses_on_the_wire() {
        assert_eq!(ApiResponse::Ok.into_http(), Ok((204, None)));
        let pong = ApiResponse::Pong { kumo_version: "1.2.3".into() }.into_http().unwrap();
        assert_eq!(pong, (200, Some(json!({"kumo_version": "1.2.3"}))));
        assert_eq!(ApiError::conflict("x").body(), json!({"error": "x"}));
    }
}
