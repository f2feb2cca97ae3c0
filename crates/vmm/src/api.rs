//! The control API's view of a running VM.

use std::sync::{Arc, OnceLock, Weak};

use kumo_api::{ApiError, ApiHandler, ApiRequest, ApiResponse, VmInfo, VmState, KUMO_VERSION};

use crate::migration::{Incoming, JobError, MigrationJob};
use crate::vmm::RunningVm;
use crate::Error;

/// Serves API requests against a VM. Holds it weakly: the API never keeps a VM alive.
pub struct VmApi {
    /// Set once the VM exists: at once, or for a destination once it has arrived.
    vm: OnceLock<Weak<RunningVm>>,
    migration: Arc<MigrationJob>,
    /// A destination's incoming migration: its progress while the VM arrives.
    incoming: Option<Arc<Incoming>>,
}

impl VmApi {
    pub fn new(vm: &Arc<RunningVm>) -> Arc<Self> {
        Arc::new(VmApi { vm: OnceLock::from(Arc::downgrade(vm)), migration: Arc::default(), incoming: None })
    }

    /// The API of a destination, up while the VM arrives: `vm.info` says `receiving` and
    /// `vm.migration` shows what has arrived; [`VmApi::attach`] hands it the VM once it runs.
    pub fn incoming(incoming: &Arc<Incoming>) -> Arc<Self> {
        Arc::new(VmApi { vm: OnceLock::new(), migration: Arc::default(), incoming: Some(incoming.clone()) })
    }

    pub fn attach(&self, vm: &Arc<RunningVm>) {
        let _ = self.vm.set(Arc::downgrade(vm));
    }

    /// Answers for a destination whose VM has not arrived yet.
    fn receiving(&self, inc: &Incoming, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong { kumo_version: KUMO_VERSION.to_string() }),
            ApiRequest::Info => Ok(ApiResponse::Info(VmInfo {
                state: VmState::Receiving,
                vcpus: inc.cpus.unwrap_or(0),
                memory_bytes: inc.memory.unwrap_or(0),
                guest: format!("incoming:{}", inc.addr),
                irqchip: "unknown".into(),
                pid: std::process::id(),
                uptime_ms: inc.since.elapsed().as_millis() as u64,
                kumo_version: KUMO_VERSION.to_string(),
            })),
            ApiRequest::MigrationStatus => Ok(ApiResponse::Json(to_json(&inc.status())?)),
            _ => Err(ApiError::conflict("the VM is still arriving by migration")),
        }
    }
}

pub fn info(vm: &RunningVm) -> VmInfo {
    let c = vm.config();
    VmInfo {
        state: if vm.is_finished() {
            VmState::Shutdown
        } else if vm.is_paused() {
            VmState::Paused
        } else {
            VmState::Running
        },
        vcpus: c.cpus,
        memory_bytes: c.memory,
        guest: c.payload_name(),
        irqchip: c.irqchip.to_string(),
        pid: std::process::id(),
        uptime_ms: vm.uptime().as_millis() as u64,
        kumo_version: KUMO_VERSION.to_string(),
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<serde_json::Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(format!("cannot encode the answer: {e}")))
}

fn to_api(e: Error) -> ApiError {
    match e {
        Error::State(what) => ApiError::conflict(format!("vm is {what}")),
        other => ApiError::internal(other.to_string()),
    }
}

impl VmApi {
    /// The last migration from here, or for a VM that arrived here and has not migrated since,
    /// how it came.
    fn migration_status(&self) -> crate::migration::MigrationStatus {
        let st = self.migration.status();
        match (st.state, &self.incoming) {
            (crate::migration::MigrationState::None, Some(inc)) => inc.status(),
            _ => st,
        }
    }

    /// Runs a migration job, with its start and end on the event monitor.
    fn migrate(
        &self,
        vm: &Arc<RunningVm>,
        req: &kumo_api::MigrateRequest,
    ) -> Result<crate::migration::MigrationStatus, JobError> {
        use crate::event_monitor::emit;
        use serde_json::json;
        let kind = if req.dry_run { "migration-estimate" } else { "migration" };
        emit("vm", &format!("{kind}-started"), json!({"to": req.to}));
        let r = self.migration.run(vm, req);
        match &r {
            Ok(_) => emit("vm", &format!("{kind}-completed"), json!({"to": req.to})),
            Err(e) => emit("vm", &format!("{kind}-failed"), json!({"to": req.to, "error": e.to_string()})),
        }
        r
    }
}

impl ApiHandler for VmApi {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        let vm = match (self.vm.get(), &self.incoming) {
            (Some(vm), _) => vm.upgrade().ok_or_else(|| ApiError::unavailable("the VM has ended"))?,
            (None, Some(inc)) => return self.receiving(inc, req),
            (None, None) => return Err(ApiError::unavailable("the VM does not exist yet")),
        };
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong { kumo_version: KUMO_VERSION.to_string() }),
            ApiRequest::Info => Ok(ApiResponse::Info(info(&vm))),
            ApiRequest::Pause => vm.pause().map(|_| ApiResponse::Ok).map_err(to_api),
            ApiRequest::Resume => vm.resume().map(|_| ApiResponse::Ok).map_err(to_api),
            ApiRequest::Shutdown => {
                if vm.is_finished() {
                    return Err(ApiError::conflict("vm is already shutting down"));
                }
                vm.shutdown();
                Ok(ApiResponse::Ok)
            }
            ApiRequest::Migrate(req) => match self.migrate(&vm, &req) {
                Ok(st) => Ok(ApiResponse::Json(to_json(&st)?)),
                Err(JobError::BadRequest(e)) => Err(ApiError::bad_request(e)),
                Err(JobError::Conflict(e)) => Err(ApiError::conflict(format!("cannot migrate: {e}"))),
                Err(e @ (JobError::Busy | JobError::Cancelled)) => Err(ApiError::conflict(e.to_string())),
                Err(e) => Err(ApiError::internal(e.to_string())),
            },
            ApiRequest::MigrationStatus => Ok(ApiResponse::Json(to_json(&self.migration_status())?)),
            ApiRequest::MigrationEvents => {
                let job = self.migration.clone();
                Ok(ApiResponse::Stream(kumo_api::JsonLines::new(move |sink| job.stream(sink))))
            }
            ApiRequest::CancelMigration => {
                self.migration.cancel().map(|()| ApiResponse::Ok).map_err(|e| ApiError::conflict(e.to_string()))
            }
            ApiRequest::Snapshot(req) => {
                use crate::snapshot::{snapshot_to_file, SnapshotError as E};
                match snapshot_to_file(&vm, std::path::Path::new(&req.path)) {
                    Ok(r) => Ok(ApiResponse::Json(to_json(&r)?)),
                    Err(e @ E::BadRequest(_)) => Err(ApiError::bad_request(e.to_string())),
                    Err(e @ E::Conflict(_)) => Err(ApiError::conflict(e.to_string())),
                    Err(e) => Err(ApiError::internal(e.to_string())),
                }
            }
            ApiRequest::Counters => {
                Ok(ApiResponse::Json(to_json(&crate::counters::collect(&vm, &self.migration_status()))?))
            }
        }
    }
}
