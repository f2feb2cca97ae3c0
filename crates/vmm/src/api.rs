//! The control API's view of a running VM.

use std::sync::{Arc, OnceLock, Weak};

use crate::host_resources::HostResources;
use kumo_api::{
    ApiError, ApiHandler, ApiRequest, ApiResponse, ReceiveMigrationRequest, RestoreRequest, VmInfo, VmState,
    KUMO_VERSION,
};

use crate::lifecycle::EmptyVmm;
use crate::migration::{Incoming, JobError, MigrationJob};
use crate::vmm::RunningVm;
use crate::Error;

/// Serves API requests against a VM. Holds it weakly: the API never keeps a VM alive.
pub struct VmApi {
    /// Set once the VM exists: at once, or for a destination once it has arrived.
    vm: OnceLock<Weak<RunningVm>>,
    migration: Arc<MigrationJob>,
    /// A destination's incoming migration: its progress while the VM arrives.
    incoming: OnceLock<Arc<Incoming>>,
    /// An empty VMM: the VM its API is told to restore or receive.
    empty: Option<EmptyVmm>,
    /// This API, for the thread an incoming migration started through it runs on.
    me: Weak<VmApi>,
    /// `vm.lend`'s connections to other VMs, kept open between lends.
    peers: std::sync::Mutex<std::collections::HashMap<String, kumo_api::ApiClient>>,
}

impl VmApi {
    pub fn new(vm: &Arc<RunningVm>) -> Arc<Self> {
        Self::build(OnceLock::from(Arc::downgrade(vm)), OnceLock::new(), None)
    }

    /// The API of a destination, up while the VM arrives: `vm.info` says `receiving` and
    /// `vm.migration` shows what has arrived; [`VmApi::attach`] hands it the VM once it runs.
    pub fn incoming(incoming: &Arc<Incoming>) -> Arc<Self> {
        Self::build(OnceLock::new(), OnceLock::from(incoming.clone()), None)
    }

    /// The API of an empty VMM (`kumo run --api-socket S` with nothing to boot): `vm.info`
    /// says `created`, `vm.restore` and `vm.receive-migration` bring a VM, which
    /// [`VmApi::wait_vm`] returns. `say` prints what an operator wants to see.
    pub fn empty(
        say: impl Fn(&str) + Send + Sync + 'static,
        console: impl Fn() -> Box<dyn std::io::Write + Send> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Self::build(OnceLock::new(), OnceLock::new(), Some(EmptyVmm::new(Box::new(say), Box::new(console))))
    }

    fn build(vm: OnceLock<Weak<RunningVm>>, incoming: OnceLock<Arc<Incoming>>, empty: Option<EmptyVmm>) -> Arc<Self> {
        let is_empty = empty.is_some();
        let api = Arc::new_cyclic(|me| VmApi {
            vm,
            migration: Arc::default(),
            incoming,
            empty,
            me: me.clone(),
            peers: Default::default(),
        });
        if is_empty {
            // Before it has a VM, a panic (in an API thread, the incoming migration's) ends it.
            crate::panics::register(Arc::downgrade(&api) as Weak<dyn crate::panics::OnPanic>);
        }
        api
    }

    /// A keep-alive client of the VM at `path` (shared by `vm.lend` calls to it).
    fn peer(&self, path: &str) -> kumo_api::ApiClient {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.len() > 64 {
            peers.clear();
        }
        peers.entry(path.to_string()).or_insert_with(|| kumo_api::ApiClient::new(path).keep_alive()).clone()
    }

    pub fn attach(&self, vm: &Arc<RunningVm>) {
        let _ = self.vm.set(Arc::downgrade(vm));
    }

    /// An empty VMM: blocks until its API has brought a VM, running (or paused if it was saved
    /// paused), or an incoming migration started through it failed (the VMM should end).
    pub fn wait_vm(&self) -> Result<Arc<RunningVm>, String> {
        match &self.empty {
            Some(e) => e.wait(),
            None => Err("this VMM was not started empty".into()),
        }
    }

    /// Answers for an empty VMM: only what needs no VM, and what brings one.
    fn empty_vmm(&self, e: &EmptyVmm, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong { kumo_version: KUMO_VERSION.to_string() }),
            ApiRequest::Info => Ok(ApiResponse::Info(VmInfo {
                state: VmState::Created,
                vcpus: 0,
                memory_bytes: 0,
                guest: "none".into(),
                irqchip: "unknown".into(),
                pid: std::process::id(),
                uptime_ms: e.since.elapsed().as_millis() as u64,
                kumo_version: KUMO_VERSION.to_string(),
                net: Vec::new(),
                numa: Vec::new(),
                vcpu_pins: Vec::new(),
                pv: None,
            })),
            ApiRequest::MigrationStatus => Ok(ApiResponse::Json(to_json(&self.migration.status())?)),
            ApiRequest::ReceiveMigration(r) => self.receive_migration(e, &r),
            ApiRequest::Restore(r) => self.restore(e, &r),
            _ => Err(ApiError::conflict(match e.busy() {
                Some(what) => format!("no VM yet: {what} is under way"),
                None => "no VM yet: this VMM waits for vm.restore or vm.receive-migration".into(),
            })),
        }
    }

    /// `vm.receive-migration`: listens (memory prepared first, if asked), answers once it
    /// listens, and receives on a thread of its own; from then on this is a destination. A
    /// migration that fails after that ends the VMM, as `kumo run --incoming` does.
    fn receive_migration(&self, e: &EmptyVmm, r: &ReceiveMigrationRequest) -> Result<ApiResponse, ApiError> {
        let me = self.me.upgrade().ok_or_else(|| ApiError::unavailable("the VMM is ending"))?;
        e.claim("an incoming migration").map_err(ApiError::conflict)?;
        let ours = HostResources { net: r.net.clone(), numa: r.numa.clone() };
        let listening = (ours.check().map_err(|e| e.to_string()))
            .and_then(|()| crate::migration::listen_options(r.tls_dir.as_deref(), r.insecure))
            .and_then(|listen| Incoming::new(&r.receiver_url, r.memory, r.cpus, ours, listen))
            .and_then(|inc| inc.listen(&*e.say).map(|ready| (inc, ready)));
        let (inc, ready) = listening.map_err(|why| {
            e.release();
            ApiError::bad_request(format!("cannot receive a migration: {why}"))
        })?;
        let _ = self.incoming.set(inc.clone());
        let spawned = kumo_sandbox::spawn(kumo_sandbox::ThreadKind::Migration, "incoming", move || {
            let Some(e) = me.empty.as_ref() else { return };
            match inc.receive_on(ready, &*e.say, (e.console)()) {
                Ok((vm, _)) => {
                    let vm = Arc::new(vm);
                    me.attach(&vm);
                    e.fill(vm);
                }
                Err(why) => e.fail(why),
            }
        });
        if let Err(err) = spawned {
            // It listens already: this VMM cannot become empty again.
            let why = format!("cannot start the incoming migration's thread: {err}");
            e.fail(why.clone());
            return Err(ApiError::internal(why));
        }
        Ok(ApiResponse::Ok)
    }

    /// `vm.restore`: builds the VM from the snapshot file and runs it (paused if it was saved
    /// paused). A file that cannot be restored leaves the VMM empty and usable.
    fn restore(&self, e: &EmptyVmm, r: &RestoreRequest) -> Result<ApiResponse, ApiError> {
        use crate::snapshot::SnapshotError as E;
        e.claim("a restore").map_err(ApiError::conflict)?;
        let restored = crate::lifecycle::source_path(&r.source_url).map_err(ApiError::bad_request).and_then(|path| {
            let ours = HostResources { net: r.net.clone(), numa: r.numa.clone() };
            crate::snapshot::restore(&path, (e.console)(), &ours).map_err(|err| match err {
                E::BadRequest(m) | E::Read(m) => ApiError::bad_request(m),
                E::Conflict(m) => ApiError::conflict(m),
                E::Write(m) | E::Vm(m) => ApiError::internal(m),
            })
        });
        let (vm, report) = restored.inspect_err(|_| e.release())?;
        let answer = to_json(&report);
        (e.say)(&format!(
            "restored {} ({} pages){}",
            report.path.display(),
            report.pages,
            if report.paused { ", paused as it was saved" } else { "" }
        ));
        let vm = Arc::new(vm);
        self.attach(&vm);
        e.fill(vm);
        Ok(ApiResponse::Json(answer?))
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
                net: Vec::new(),
                numa: Vec::new(),
                vcpu_pins: Vec::new(),
                pv: None,
            })),
            ApiRequest::MigrationStatus => Ok(ApiResponse::Json(to_json(&inc.status())?)),
            _ => Err(ApiError::conflict("the VM is still arriving by migration")),
        }
    }
}

impl crate::panics::OnPanic for VmApi {
    fn panicked(&self, p: &kumo_sandbox::ThreadPanic) {
        if let Some(e) = &self.empty {
            e.fail_waiting(format!("{p}; the VMM stops"));
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
        net: vm.nics(),
        numa: c.numa.as_ref().map(|n| n.info(c.cpus, c.memory)).unwrap_or_default(),
        vcpu_pins: vm.vcpu_pins(),
        pv: pv_info(&c.pv),
    }
}

/// The resolved features as `vm.info` shows them (`None` unless every field is set, as it is
/// once the VM is built).
fn pv_info(r: &kumo_vm::pv::PvRequest) -> Option<kumo_api::PvInfo> {
    Some(kumo_api::PvInfo {
        steal_time: r.steal_time?,
        pv_unhalt: r.pv_unhalt?,
        tlb_flush: r.tlb_flush?,
        poll_control: r.poll_control?,
        pv_ipi: r.pv_ipi?,
        realtime: r.realtime?,
    })
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
        match (st.state, self.incoming.get()) {
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
        // The job's holds on the VM are released in Drop (`RunStateLease`), so its panic is
        // contained: an error answer, and the VM runs on, migratable again.
        let r =
            kumo_sandbox::contain(kumo_sandbox::ThreadKind::Migration, "migration job", || self.migration.run(vm, req))
                .unwrap_or_else(|p| {
                    crate::panics::contained(&p);
                    Err(JobError::Failed(format!("{p}; the VM runs on here")))
                });
        match &r {
            Ok(_) => emit("vm", &format!("{kind}-completed"), json!({"to": req.to})),
            Err(e) => emit("vm", &format!("{kind}-failed"), json!({"to": req.to, "error": e.to_string()})),
        }
        r
    }
}

impl ApiHandler for VmApi {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        if matches!(req, ApiRequest::Counters) && kumo_sandbox::test_hook("panic:api") {
            panic!("test hook panic:api: the API handler panics on purpose");
        }
        let vm = match (self.vm.get(), self.incoming.get(), &self.empty) {
            (Some(vm), _, _) => vm.upgrade().ok_or_else(|| ApiError::unavailable("the VM has ended"))?,
            (None, Some(inc), _) => return self.receiving(inc, req),
            (None, None, Some(e)) => return self.empty_vmm(e, req),
            (None, None, None) => return Err(ApiError::unavailable("the VM does not exist yet")),
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
                // As a migration: the snapshot's hold is released in Drop, its panic contained.
                let path = std::path::Path::new(&req.path);
                let r = kumo_sandbox::contain(kumo_sandbox::ThreadKind::Migration, "snapshot job", || {
                    snapshot_to_file(&vm, path)
                })
                .unwrap_or_else(|p| {
                    crate::panics::contained(&p);
                    Err(E::Vm(format!("{p}; the VM runs on here")))
                });
                match r {
                    Ok(r) => Ok(ApiResponse::Json(to_json(&r)?)),
                    Err(e @ E::BadRequest(_)) => Err(ApiError::bad_request(e.to_string())),
                    Err(e @ E::Conflict(_)) => Err(ApiError::conflict(e.to_string())),
                    Err(e) => Err(ApiError::internal(e.to_string())),
                }
            }
            ApiRequest::Counters => {
                Ok(ApiResponse::Json(to_json(&crate::counters::collect(&vm, &self.migration_status()))?))
            }
            ApiRequest::Pin(p) => {
                use crate::vmm::PinError;
                match vm.pin_vcpu(p.vcpu, p.cpu) {
                    Ok(()) => Ok(ApiResponse::Ok),
                    Err(e @ PinError::Bad(_)) => Err(ApiError::bad_request(e.to_string())),
                    Err(e @ PinError::NoThread(_)) => Err(ApiError::conflict(e.to_string())),
                    Err(e) => Err(ApiError::internal(e.to_string())),
                }
            }
            ApiRequest::Release(r) => elastic_answer(vm.elastic_release(&r)),
            ApiRequest::Acquire(r) => elastic_answer(vm.elastic_acquire(&r)),
            ApiRequest::Elastic => elastic_answer(vm.elastic_info()),
            ApiRequest::Lend(l) => {
                use kumo_elastic::lend::{lend, LendError, LendRequest};
                let local = crate::vmm::LocalPeer(&vm);
                let to = self.peer(&l.to).with_timeout(kumo_elastic::lend::client_timeout(l.timeout_ms));
                let req = LendRequest {
                    cpus: l.cpus,
                    memory_bytes: l.memory_bytes,
                    node: l.node,
                    timeout_ms: l.timeout_ms,
                    returning: l.returning,
                };
                match lend(&local, &to, &req) {
                    Ok(r) => Ok(ApiResponse::Json(serde_json::json!({
                        "released": to_json(&r.released)?,
                        "acquired": to_json(&r.acquired)?,
                        "total_ms": r.total_ms,
                    }))),
                    Err(e @ LendError::Empty) => Err(ApiError::bad_request(e.to_string())),
                    Err(e @ LendError::Lost { .. }) => Err(ApiError::internal(e.to_string())),
                    Err(e) => Err(ApiError::conflict(e.to_string())),
                }
            }
            ApiRequest::ReceiveMigration(_) | ApiRequest::Restore(_) => {
                Err(ApiError::conflict("this VMM has a VM already; start an empty one: kumo run --api-socket PATH"))
            }
        }
    }
}

/// An elastic request's answer as JSON, or its error with the status it maps to.
fn elastic_answer<T: serde::Serialize>(r: Result<T, crate::elastic::ElasticError>) -> Result<ApiResponse, ApiError> {
    let a = r.map_err(|e| ApiError::new(e.status(), e.to_string()))?;
    Ok(ApiResponse::Json(to_json(&a)?))
}
