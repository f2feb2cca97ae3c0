//! The control API's view of a running VM.

use std::sync::{Arc, Weak};

use kumo_api::{ApiError, ApiHandler, ApiRequest, ApiResponse, VmInfo, VmState, KUMO_VERSION};

use crate::migration::{JobError, MigrationJob};
use crate::vmm::RunningVm;
use crate::Error;

/// Serves API requests against a VM. Holds it weakly: the API never keeps a VM alive.
pub struct VmApi {
    vm: Weak<RunningVm>,
    migration: MigrationJob,
}

impl VmApi {
    pub fn new(vm: &Arc<RunningVm>) -> Arc<Self> {
        Arc::new(VmApi { vm: Arc::downgrade(vm), migration: MigrationJob::default() })
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

impl ApiHandler for VmApi {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        let vm = self.vm.upgrade().ok_or_else(|| ApiError::unavailable("the VM has ended"))?;
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
            ApiRequest::Migrate(req) => match self.migration.run(&vm, &req) {
                Ok(st) => Ok(ApiResponse::Json(to_json(&st)?)),
                Err(JobError::BadRequest(e)) => Err(ApiError::bad_request(e)),
                Err(JobError::Conflict(e)) => Err(ApiError::conflict(format!("cannot migrate: {e}"))),
                Err(e @ (JobError::Busy | JobError::Cancelled)) => Err(ApiError::conflict(e.to_string())),
                Err(e) => Err(ApiError::internal(e.to_string())),
            },
            ApiRequest::MigrationStatus => Ok(ApiResponse::Json(to_json(&self.migration.status())?)),
            ApiRequest::CancelMigration => {
                self.migration.cancel().map(|()| ApiResponse::Ok).map_err(|e| ApiError::conflict(e.to_string()))
            }
        }
    }
}
