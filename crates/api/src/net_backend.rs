//! `kumo net-backend`'s API (docs/net-backend.md): its own routes, served by the same server
//! ([`crate::Service::NetBackend`]), and its answers.

use serde::{Deserialize, Serialize};

/// Route paths of a net-backend's API socket.
pub mod paths {
    pub const INFO: &str = "/api/v1/backend.info";
    pub const HANDOVER: &str = "/api/v1/backend.handover";
}

/// How long a handover waits for the new owner's first buffer before it reports without it.
pub const DEFAULT_WAIT_MS: u64 = 1000;
/// The longest wait a handover may ask for.
pub const MAX_WAIT_MS: u64 = 60_000;

/// Body of `PUT /api/v1/backend.handover`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandoverRequest {
    /// The client that gets the NIC.
    pub to: u32,
    /// How long to wait for its first buffer (ms); default [`DEFAULT_WAIT_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

/// One handover as measured inside the backend.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HandoverReport {
    pub from: Option<u32>,
    pub to: u32,
    /// µs from the last buffer served for `from` to the first served for `to` (null until B
    /// is served, e.g. no traffic).
    pub outage_us: Option<u64>,
    /// µs from the last buffer served for `from` (or from the switch when there was none) to
    /// the switch itself.
    pub switch_us: u64,
    /// µs from the switch to the first buffer served for `to`.
    pub first_serve_after_switch_us: Option<u64>,
    /// Frames that waited in the tap (or the backend's one-frame slot) and went to `to` at the switch.
    pub drained_at_switch: u64,
    /// µs the NIC was served by no one inside the backend: from the handover taking the data
    /// path (A's last in-flight transmits are completed in it) to `to`'s queues being live.
    pub pause_us: u64,
}

/// A connected frontend (VM) in [`BackendInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendClient {
    pub id: u32,
    pub pid: Option<i32>,
    pub ready: bool,
    pub migrating: bool,
    pub link: bool,
    pub features: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_dropped: u64,
}

/// Body of `GET /api/v1/backend.info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendInfo {
    pub tap: String,
    pub mac: String,
    pub owner: Option<u32>,
    pub auto_own: bool,
    pub clients: Vec<BackendClient>,
    pub handovers: u64,
    pub last_handover: Option<HandoverReport>,
    pub max_in_flight: usize,
    pub foreign_serves: u64,
}
