//! `kumo net-backend` for end-to-end tests: the backend on a host tap with its vhost-user
//! socket (the NIC VMs attach to) and its API socket (`backend.info`, `backend.handover`).
//! Every wait is bounded only as a hang guard ([`PATIENCE`]).

use serde_json::{json, Value};

use crate::{eventually, Kid, TestDir, PATIENCE};

/// A running `kumo net-backend` on a tap: its process, its vhost-user socket and its API.
pub struct Backend {
    pub kid: Kid,
    /// The vhost-user socket (`--net vhost-user=SOCK`).
    pub sock: String,
    /// The API socket's path (for `kumo --api-socket` or a second client).
    pub api_sock: String,
    pub api: kumo_api::ApiClient,
}

impl Backend {
    /// Starts the backend on `tap` with `nic.sock` and `backend.sock` in `dir`; returns once
    /// both sockets exist.
    pub fn start(dir: &TestDir, tap: &str) -> Backend {
        let (sock, api_sock) = (dir.arg("nic.sock"), dir.arg("backend.sock"));
        let kid =
            Kid::spawn(&["--api-socket", &api_sock, "net-backend", "--tap", tap, "--socket", &sock]).named("backend");
        eventually(PATIENCE, || {
            (std::path::Path::new(&sock).exists() && std::path::Path::new(&api_sock).exists()).then_some(())
        });
        let api = kumo_api::ApiClient::new(&api_sock);
        Backend { kid, sock, api_sock, api }
    }

    /// `backend.info`.
    pub fn info(&self) -> Value {
        let (status, body) = self.api.request("GET", "/api/v1/backend.info", None).expect("backend.info");
        assert_eq!(status, 200, "{body:?}");
        body.expect("a body")
    }

    /// The client that owns the NIC, if any.
    pub fn owner(&self) -> Option<u64> {
        self.info()["owner"].as_u64()
    }

    /// Waits until client `id` owns the NIC.
    pub fn wait_owner(&self, id: u64) {
        eventually(PATIENCE, || (self.owner() == Some(id)).then_some(()));
    }

    /// Client `id`'s entry in `backend.info`, if connected.
    pub fn client(&self, id: u64) -> Option<Value> {
        self.info()["clients"].as_array()?.iter().find(|c| c["id"].as_u64() == Some(id)).cloned()
    }

    /// The id of the first ready client (queues set up) that `pick` selects.
    pub fn ready_client(&self, pick: impl Fn(&Value) -> bool) -> u64 {
        eventually(PATIENCE, || {
            let info = self.info();
            info["clients"].as_array()?.iter().find(|c| c["ready"] == true && pick(c)).and_then(|c| c["id"].as_u64())
        })
    }

    /// The client id of the VM whose frontend process has `pid`, once it is ready.
    pub fn client_of(&self, pid: u32) -> u64 {
        self.ready_client(|c| c["pid"].as_u64() == Some(pid.into()))
    }

    /// `backend.handover` to client `to`: the status and the body (the report, or the error).
    pub fn handover(&self, to: u64) -> (u16, Value) {
        let (status, body) =
            self.api.request("PUT", "/api/v1/backend.handover", Some(&json!({ "to": to }))).expect("backend.handover");
        (status, body.unwrap_or(Value::Null))
    }

    /// [`Backend::handover`] that must succeed: returns the handover report.
    pub fn hand_to(&self, to: u64) -> Value {
        let (status, body) = self.handover(to);
        assert_eq!(status, 200, "handover to {to}: {body}\nbackend:\n{}", self.kid.stderr());
        body
    }
}
