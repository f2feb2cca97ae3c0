//! The backend's control API (see docs/net-backend.md): its routes and types are kumo-api's
//! (`kumo_api::net_backend`), served by kumo-api's server with the backend's route set
//! (`Service::NetBackend`); this is its handler.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kumo_api::{ApiError, ApiHandler, ApiRequest, ApiResponse, ApiServer, ApiServerHandle, BoundApi, Service};

pub use kumo_api::net_backend::{DEFAULT_WAIT_MS, MAX_WAIT_MS};

use crate::nic::{HandoverError, Nic};

/// Answers the backend's requests against its NIC.
pub struct BackendApi {
    nic: Arc<Nic>,
}

impl BackendApi {
    pub fn new(nic: Arc<Nic>) -> Arc<Self> {
        Arc::new(BackendApi { nic })
    }
}

impl ApiHandler for BackendApi {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        match req {
            ApiRequest::BackendInfo => {
                // Debug builds only (tests/sandbox_e2e.rs): a bug in a request ends the backend.
                if kumo_sandbox::test_hook("panic:net-backend") {
                    panic!("test hook panic:net-backend");
                }
                Ok(ApiResponse::BackendInfo(self.nic.info()))
            }
            ApiRequest::Handover(h) => {
                let wait = Duration::from_millis(h.wait_ms.unwrap_or(DEFAULT_WAIT_MS).min(MAX_WAIT_MS));
                Ok(ApiResponse::Handover(self.nic.handover(h.to, wait)?))
            }
            // Not routed to a backend (its route set has only the two above).
            _ => Err(ApiError::not_found("this is a kumo net-backend, not a VM")),
        }
    }
}

/// Every refusal (unknown, not ready, migrating) is a conflict; the owner is unchanged.
impl From<HandoverError> for ApiError {
    fn from(e: HandoverError) -> Self {
        ApiError::conflict(e.to_string())
    }
}

/// Binds the API socket (private, replacing only a stale socket), to be served by [`serve`].
pub fn bind(path: &Path) -> Result<BoundApi, String> {
    ApiServer::bind(path).map(|b| b.service(Service::NetBackend)).map_err(|e| e.to_string())
}

/// Serves the API on `bound` until the handle drops, to peers whose uid is in `allow` if
/// given (`--api-allow-uid`; a refused peer gets 403).
pub fn serve(nic: Arc<Nic>, bound: BoundApi, allow: Option<Vec<u32>>) -> Result<ApiServerHandle, String> {
    bound.serve(BackendApi::new(nic), allow).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_api::net_backend::paths;
    use kumo_api::ApiClient;
    use kumo_devices::virtio::net::Loopback;

    fn nic() -> Arc<Nic> {
        Arc::new(Nic::new(Box::new(Loopback::new(1)), "tap-test", [2, 0, 0, 0, 0, 1], true))
    }

    fn sock(dir: &Path, name: &str) -> std::path::PathBuf {
        let _ = std::fs::create_dir_all(dir);
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        path
    }

    #[test]
    fn info_lists_the_nic() {
        let r = BackendApi::new(nic()).handle(ApiRequest::BackendInfo).unwrap();
        let ApiResponse::BackendInfo(i) = r else { panic!("{r:?}") };
        assert_eq!((i.tap.as_str(), i.mac.as_str(), i.owner), ("tap-test", "02:00:00:00:00:01", None));
        assert!(i.clients.is_empty());
    }

    #[test]
    fn refusals_are_conflicts_with_one_line() {
        let req = ApiRequest::Handover(kumo_api::HandoverRequest { to: 3, wait_ms: None });
        let e = BackendApi::new(nic()).handle(req).unwrap_err();
        assert_eq!((e.status(), e.message.as_str()), (409, "no client 3"));
    }

    #[test]
    fn request_and_serve_over_a_socket() {
        let dir = std::env::temp_dir().join(format!("kumo-nb-api-{}", std::process::id()));
        let path = sock(&dir, "api.sock");
        let me = kumo_sandbox::sock::euid();
        let _server = serve(nic(), bind(&path).unwrap(), Some(vec![me])).unwrap();
        let c = ApiClient::new(&path);
        let info = c.backend_info().unwrap();
        assert_eq!(info.tap, "tap-test");
        let (status, body) = c.request("GET", paths::INFO, None).unwrap();
        assert_eq!(status, 200);
        let body = body.unwrap();
        assert_eq!((body["tap"].as_str(), body["owner"].is_null()), (Some("tap-test"), true), "{body}");
        let e = c.handover(&kumo_api::HandoverRequest { to: 1, wait_ms: None }).unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        // Bad requests, wrong methods and other routes.
        let put = |b: serde_json::Value| c.request("PUT", paths::HANDOVER, Some(&b)).unwrap().0;
        assert_eq!(put(serde_json::json!({})), 400);
        assert_eq!(put(serde_json::json!({"to": "x"})), 400);
        assert_eq!(c.request("GET", paths::HANDOVER, None).unwrap().0, 405);
        assert_eq!(c.request("GET", "/api/v1/nope", None).unwrap().0, 404);
        assert_eq!(c.request("GET", kumo_api::paths::INFO, None).unwrap().0, 404, "a VM's route");
        // A uid that is not in the list is refused.
        let other = sock(&dir, "other.sock");
        let _server = serve(nic(), bind(&other).unwrap(), Some(vec![me.wrapping_add(1)])).unwrap();
        let e = ApiClient::new(&other).backend_info().unwrap_err();
        assert_eq!(e.status(), Some(403), "{e}");
        assert!(e.to_string().contains(&format!("uid {me} ")), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
