//! The control API's view of a running VM. Domain errors become typed API errors here (the
//! `From` impls at the end); the server picks the HTTP status from their kind.

use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::host_resources::HostResources;
use kumo_api::{
    ApiError, ApiHandler, ApiRequest, ApiResponse, ChVmConfig, ChVmInfo, MigrationStatus, Pong,
    ReceiveMigrationRequest, RestoreRequest, VmInfo, VmState, KUMO_VERSION,
};

use crate::lifecycle::{AfterVm, EmptyVmm, EndIntent};
use crate::migration::{Incoming, JobError, MigrationJob};
use crate::vmm::RunningVm;
use crate::Error;

/// What the API has to serve: it picks the answers.
#[derive(Clone)]
enum Mode {
    /// An empty VMM waiting for `vm.restore` or `vm.receive-migration` (its [`EmptyVmm`]).
    Empty,
    /// A destination whose VM is arriving by migration.
    Receiving(Arc<Incoming>),
    /// The VM exists (held weakly: the API never keeps a VM alive); `arrived`: the migration it
    /// came by, if it did.
    Running { vm: Weak<RunningVm>, arrived: Option<Arc<Incoming>> },
}

/// Serves API requests against a VM.
pub struct VmApi {
    mode: Mutex<Mode>,
    /// Signalled when `mode` changes or a rebuild fails: a request that came while the created
    /// VM was ending, and `vm.reboot`, wait on it instead of polling.
    settled: Condvar,
    migration: Arc<MigrationJob>,
    /// An empty VMM: the VM its API is told to restore or receive.
    empty: Option<EmptyVmm>,
    /// This API, for the thread an incoming migration started through it runs on.
    me: Weak<VmApi>,
    /// `vm.lend`'s connections to other VMs, kept open between lends.
    peers: std::sync::Mutex<std::collections::HashMap<String, kumo_api::ApiClient>>,
    /// An empty VMM told `vm.create`: CH's config as it came (`vm.info` shows it, also once
    /// booted) and kumo's, which `vm.boot` builds.
    created: Mutex<Option<(ChVmConfig, crate::config::VmConfig)>>,
    /// Why the API stopped the created VM (`vm.reboot`, `vm.delete`, `vmm.shutdown`), read by
    /// [`VmApi::vm_ended`].
    intent: Mutex<Option<EndIntent>>,
    /// The created VM ran and ended: `vm.info` says `Shutdown` until it boots again.
    ended: std::sync::atomic::AtomicBool,
    /// Rebuilds that failed, and why the last one did (a `vm.reboot` waiting sees it).
    reboot_failures: Mutex<(u64, String)>,
    /// The pseudo-terminal of CH's `Pty` mode and the config field it serves: opened at the
    /// first boot and kept, so a client keeps its path across reboots.
    pty: Mutex<Option<(&'static str, Arc<crate::pty::Pty>)>>,
}

/// How long `vm.reboot` waits for the VM to be built again (a hang guard: building takes
/// well under a second).
const REBOOT_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

impl VmApi {
    pub fn new(vm: &Arc<RunningVm>) -> Arc<Self> {
        Self::build(Mode::Running { vm: Arc::downgrade(vm), arrived: None }, None)
    }

    /// The API of a destination, up while the VM arrives: `vm.info` says `receiving` and
    /// `vm.migration` shows what has arrived; [`VmApi::attach`] hands it the VM once it runs.
    pub fn incoming(incoming: &Arc<Incoming>) -> Arc<Self> {
        Self::build(Mode::Receiving(incoming.clone()), None)
    }

    /// The API of an empty VMM (`kumo run --api-socket S` with nothing to boot): `vm.info`
    /// says `created`, `vm.restore` and `vm.receive-migration` bring a VM, which
    /// [`VmApi::wait_vm`] returns. `say` prints what an operator wants to see.
    pub fn empty(
        say: impl Fn(&str) + Send + Sync + 'static,
        console: impl Fn() -> Box<dyn std::io::Write + Send> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Self::build(Mode::Empty, Some(EmptyVmm::new(Box::new(say), Box::new(console))))
    }

    fn build(mode: Mode, empty: Option<EmptyVmm>) -> Arc<Self> {
        let is_empty = empty.is_some();
        let api = Arc::new_cyclic(|me| VmApi {
            mode: Mutex::new(mode),
            settled: Condvar::new(),
            migration: Arc::default(),
            empty,
            me: me.clone(),
            peers: Default::default(),
            created: Mutex::new(None),
            intent: Mutex::new(None),
            ended: Default::default(),
            reboot_failures: Mutex::new((0, String::new())),
            pty: Mutex::new(None),
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

    /// The VM exists now (restored, or arrived): the API serves it. Only the first VM counts.
    pub fn attach(&self, vm: &Arc<RunningVm>) {
        let mut mode = kumo_sandbox::lock(&self.mode);
        let arrived = match &*mode {
            Mode::Running { .. } => return,
            Mode::Receiving(inc) => Some(inc.clone()),
            Mode::Empty => None,
        };
        *mode = Mode::Running { vm: Arc::downgrade(vm), arrived };
        self.settled.notify_all();
    }

    /// The mode a request acts on. While a created VM is ending (it finished, the main thread
    /// has not yet called [`VmApi::vm_ended`]), a request that changes something waits for the
    /// VMM to be empty again: `vm.boot` right after `vm.info` said `Shutdown` must find it so.
    /// Reads answer at once. The wait is bounded: a VMM that exits instead never settles.
    fn settled_mode(&self, req: &ApiRequest) -> Mode {
        use ApiRequest as R;
        let reads = matches!(
            req,
            R::Ping | R::Info | R::MigrationStatus | R::MigrationEvents | R::Counters | R::Elastic | R::BackendInfo
        );
        let mode = kumo_sandbox::lock(&self.mode);
        if reads || self.empty.is_none() {
            return mode.clone();
        }
        let ending = |m: &mut Mode| match m {
            Mode::Running { vm, .. } => vm.upgrade().is_none_or(|vm| vm.is_finished()),
            _ => false,
        };
        let waited = self.settled.wait_timeout_while(mode, REBOOT_LIMIT, ending);
        waited.unwrap_or_else(|p| p.into_inner()).0.clone()
    }

    /// An empty VMM: blocks until its API has brought a VM, running (or paused if it was saved
    /// paused), or an incoming migration started through it failed (the VMM should end).
    /// None: `vmm.shutdown` came first; the VMM ends cleanly (exit status 0).
    pub fn wait_vm(&self) -> Result<Option<Arc<RunningVm>>, String> {
        match &self.empty {
            Some(e) => e.wait(),
            None => Err("this VMM was not started empty".into()),
        }
    }

    /// Answers for an empty VMM: only what needs no VM, and what brings one.
    fn empty_vmm(&self, e: &EmptyVmm, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        let created = || kumo_sandbox::lock(&self.created).as_ref().map(|(ch, _)| ch.clone());
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong(Pong::here())),
            ApiRequest::Info => {
                let mut kumo = empty_info(e);
                if self.ended.load(std::sync::atomic::Ordering::SeqCst) && created().is_some() {
                    kumo.state = VmState::Shutdown;
                }
                Ok(ApiResponse::Info(Box::new(ChVmInfo::new(created(), kumo))))
            }
            ApiRequest::MigrationStatus => Ok(migration_answer(self.migration.status())),
            ApiRequest::Create(c) => self.create(e, *c),
            ApiRequest::Boot => self.boot(e),
            ApiRequest::Delete => {
                *kumo_sandbox::lock(&self.created) = None;
                Ok(ApiResponse::Ok)
            }
            ApiRequest::VmmShutdown => e.exit().map(|()| ApiResponse::Ok).map_err(ApiError::conflict),
            ApiRequest::AddDisk(d) => self.cold_plug(e, "vm.add-disk", |ch, k| {
                k.disks.push(crate::ch_config::disk(k.disks.len(), &d).map_err(ApiError::bad_request)?);
                ch.disks.get_or_insert_default().push(*d);
                Ok(())
            }),
            ApiRequest::AddNet(n) => self.cold_plug(e, "vm.add-net", |ch, k| {
                k.net.push(crate::ch_config::nic(k.net.len(), &n).map_err(ApiError::bad_request)?);
                ch.net.get_or_insert_default().push(*n);
                Ok(())
            }),
            ApiRequest::RemoveDevice(r) => self.cold_plug(e, "vm.remove-device", |ch, k| remove_device(ch, k, &r.id)),
            ApiRequest::ReceiveMigration(_) | ApiRequest::Restore(_) if created().is_some() => {
                Err(ApiError::conflict("a VM was created here (vm.create): vm.delete it first"))
            }
            ApiRequest::ReceiveMigration(r) => self.receive_migration(e, &r),
            ApiRequest::Restore(r) => self.restore(e, &r),
            ApiRequest::Reboot => Err(ApiError::conflict("vm.reboot: the VM is not running (vm.boot starts it)")),
            _ => Err(ApiError::conflict(match e.busy() {
                Some(what) => format!("no VM yet: {what} is under way"),
                None if created().is_some() => "no VM yet: it was created; boot it (vm.boot)".into(),
                None => "no VM yet: this VMM waits for vm.create, vm.restore or vm.receive-migration".into(),
            })),
        }
    }

    /// `vm.create`: CH's config (its fields checked by the route) becomes kumo's, checked as
    /// `kumo run` checks it; `vm.boot` builds it. One at a time: `vm.delete` forgets it.
    fn create(&self, e: &EmptyVmm, c: ChVmConfig) -> Result<ApiResponse, ApiError> {
        if let Some(what) = e.busy() {
            return Err(ApiError::conflict(format!("vm.create: {what} is under way")));
        }
        let mut slot = kumo_sandbox::lock(&self.created);
        if slot.is_some() {
            return Err(ApiError::conflict("vm.create: a VM was created already (vm.delete it first)"));
        }
        let ignored = c.check()?;
        let config = crate::ch_config::from_ch(&c).map_err(ApiError::bad_request)?;
        config.validate().map_err(|err| ApiError::bad_request(format!("vm.create: {err}")))?;
        if !ignored.is_empty() {
            (e.say)(&format!("vm.create: ignoring {}", ignored.join(", ")));
        }
        *slot = Some((c, config));
        Ok(ApiResponse::Ok)
    }

    /// `vm.add-disk`, `vm.add-net`, `vm.remove-device` before `vm.boot` (CH's cold plug):
    /// `change` edits copies of the created config, which must then pass `kumo run`'s checks.
    fn cold_plug(
        &self,
        e: &EmptyVmm,
        route: &str,
        change: impl FnOnce(&mut ChVmConfig, &mut crate::config::VmConfig) -> Result<(), ApiError>,
    ) -> Result<ApiResponse, ApiError> {
        if let Some(what) = e.busy() {
            return Err(ApiError::conflict(format!("{route}: {what} is under way")));
        }
        let mut slot = kumo_sandbox::lock(&self.created);
        let (ch, config) = slot
            .as_mut()
            .ok_or_else(|| ApiError::not_found(format!("{route}: no VM was created (vm.create first)")))?;
        let (mut ch2, mut config2) = (ch.clone(), config.clone());
        change(&mut ch2, &mut config2)?;
        config2.validate().map_err(|err| ApiError::bad_request(format!("{route}: {err}")))?;
        (*ch, *config) = (ch2, config2);
        Ok(ApiResponse::Ok)
    }

    /// `vm.boot`: builds and runs the created VM as `kumo run` would; the main thread's
    /// [`VmApi::wait_vm`] then returns it. A VM that cannot be built leaves it created. With
    /// CH's `Pty` mode, COM1 is a pseudo-terminal whose path `vm.info` shows in that mode's
    /// `file`.
    fn boot(&self, e: &EmptyVmm) -> Result<ApiResponse, ApiError> {
        let created = kumo_sandbox::lock(&self.created).clone();
        let (ch, config) = created.ok_or_else(|| ApiError::conflict("vm.boot: no VM was created (vm.create first)"))?;
        e.claim("a boot").map_err(ApiError::conflict)?;
        let pty = match pty_field(&ch) {
            Some(field) => match self.pty(field) {
                Ok(p) => Some((field, p)),
                Err(err) => {
                    e.release();
                    return Err(ApiError::internal(format!("vm.boot: cannot open a pseudo-terminal: {err}")));
                }
            },
            None => None,
        };
        let console = match &pty {
            Some((_, p)) => p.output().map_err(|err| ApiError::internal(format!("vm.boot: pseudo-terminal: {err}"))),
            None => Ok((e.console)()),
        };
        let vm = console.and_then(|console| {
            RunningVm::start(config, console).map_err(|err| match err {
                Error::Config(m) => ApiError::bad_request(format!("vm.boot: {m}")),
                other => ApiError::from(other),
            })
        });
        let vm = Arc::new(vm.inspect_err(|_| e.release())?);
        if let Some((field, p)) = &pty {
            if let Err(err) = p
                .input()
                .map_err(|e| e.to_string())
                .and_then(|fd| vm.attach_console_input(fd).map_err(|e| e.to_string()))
            {
                tracing::warn!("the pseudo-terminal types nothing on the console: {err}");
            }
            let path = p.path.display().to_string();
            (e.say)(&format!("serial console on {path}"));
            let mut slot = kumo_sandbox::lock(&self.created);
            let console =
                slot.as_mut()
                    .and_then(|(ch, _)| if *field == "serial" { ch.serial.as_mut() } else { ch.console.as_mut() });
            if let Some(c) = console {
                c.extra.insert("file".into(), path.into());
            }
        }
        (e.say)("booted the created VM");
        self.ended.store(false, std::sync::atomic::Ordering::SeqCst);
        self.attach(&vm);
        e.fill(vm);
        Ok(ApiResponse::Ok)
    }

    /// Whether the VM's console is a pseudo-terminal (CH's `Pty` mode): it types on COM1, not
    /// the VMM's stdin.
    pub fn console_is_pty(&self) -> bool {
        kumo_sandbox::lock(&self.pty).is_some()
    }

    /// The pseudo-terminal serving config field `field`: the one opened at the first boot.
    fn pty(&self, field: &'static str) -> std::io::Result<Arc<crate::pty::Pty>> {
        let mut slot = kumo_sandbox::lock(&self.pty);
        match &*slot {
            Some((f, p)) if *f == field => Ok(p.clone()),
            _ => {
                let p = Arc::new(crate::pty::Pty::open()?);
                *slot = Some((field, p.clone()));
                Ok(p)
            }
        }
    }

    /// `vm.reboot`, `vm.delete`, `vmm.shutdown` of a running VM: it is shut down, and the main
    /// thread's [`VmApi::vm_ended`] does what was asked. A VM not made by `vm.create` ends its
    /// VMM (kumo's model) and cannot be rebooted. `vm.reboot` answers once the VM runs again.
    fn end_vm(&self, vm: Arc<RunningVm>, intent: EndIntent) -> Result<ApiResponse, ApiError> {
        let created = kumo_sandbox::lock(&self.created).is_some();
        match (&self.empty, created, intent) {
            (Some(_), true, EndIntent::Reboot) => {}
            (_, _, EndIntent::Reboot) => {
                return Err(ApiError::bad_request(
                    "vm.reboot: kumo reboots only a VM made by vm.create; this one ends with its VMM (kumo run)",
                ))
            }
            (_, _, intent) => {
                if created {
                    *kumo_sandbox::lock(&self.intent) = Some(intent);
                }
                if !vm.is_finished() {
                    vm.shutdown();
                }
                return Ok(ApiResponse::Ok);
            }
        };
        if vm.is_finished() {
            return Err(ApiError::conflict("vm.reboot: the VM is shutting down"));
        }
        let failures = kumo_sandbox::lock(&self.reboot_failures).0;
        *kumo_sandbox::lock(&self.intent) = Some(EndIntent::Reboot);
        vm.shutdown();
        // The main thread builds the VM again once the last reference to this one is gone;
        // `old` (weak) only tells the new VM from it.
        let old = Arc::downgrade(&vm);
        drop(vm);
        let rebuilt = |m: &Mode| matches!(m, Mode::Running { vm, .. } if !vm.ptr_eq(&old));
        let failed = || kumo_sandbox::lock(&self.reboot_failures).0 > failures;
        let mode = kumo_sandbox::lock(&self.mode);
        let waited = self.settled.wait_timeout_while(mode, REBOOT_LIMIT, |m| !rebuilt(m) && !failed());
        if rebuilt(&waited.unwrap_or_else(|p| p.into_inner()).0) {
            return Ok(ApiResponse::Ok);
        }
        match &*kumo_sandbox::lock(&self.reboot_failures) {
            (n, why) if *n > failures => Err(ApiError::internal(format!("vm.reboot: {why}"))),
            _ => Err(ApiError::internal("vm.reboot: the VM was not built again in time")),
        }
    }

    /// The main thread's VM has ended: what the VMM does next ([`AfterVm`]). For a VM made by
    /// `vm.create` the VMM goes on (empty again, the config kept) unless `vmm.shutdown` or a
    /// failure ended it; any other VM ends its VMM.
    pub fn vm_ended(&self, outcome: &crate::Outcome) -> AfterVm {
        let Some(e) = &self.empty else { return AfterVm::Exit };
        if kumo_sandbox::lock(&self.created).is_none() {
            return AfterVm::Exit;
        }
        let intent = kumo_sandbox::lock(&self.intent).take();
        let after = crate::lifecycle::after_created_vm(intent, outcome);
        if after != AfterVm::Exit {
            if intent == Some(EndIntent::Delete) {
                *kumo_sandbox::lock(&self.created) = None;
            }
            self.ended.store(true, std::sync::atomic::Ordering::SeqCst);
            e.reset();
            *kumo_sandbox::lock(&self.mode) = Mode::Empty;
            self.settled.notify_all();
        }
        after
    }

    /// [`AfterVm::Reboot`]: the main thread, the old VM dropped, builds the created VM again
    /// (on the same pseudo-terminal). A failure leaves it shut down, waiting on the API.
    pub fn reboot(&self) -> Result<(), String> {
        let e = self.empty.as_ref().ok_or("this VMM was not started empty")?;
        self.boot(e).map(|_| ()).map_err(|err| {
            let mut f = kumo_sandbox::lock(&self.reboot_failures);
            *f = (f.0 + 1, err.to_string());
            drop(f);
            let _mode = kumo_sandbox::lock(&self.mode);
            self.settled.notify_all();
            err.to_string()
        })
    }

    /// `vm.info` of the VM: CH's config as created, or as kumo's config reads in CH's terms.
    fn info_answer(&self, vm: &RunningVm) -> ApiResponse {
        let created = kumo_sandbox::lock(&self.created).as_ref().map(|(ch, _)| ch.clone());
        let ch = created.unwrap_or_else(|| crate::ch_config::to_ch(vm.config()));
        ApiResponse::Info(Box::new(ChVmInfo::new(Some(ch), info(vm))))
    }

    /// `vm.receive-migration`: listens (memory prepared first, if asked), answers once it
    /// listens, and receives on a thread of its own; from then on this is a destination. A
    /// migration that fails after that ends the VMM, as `kumo run --incoming` does.
    fn receive_migration(&self, e: &EmptyVmm, r: &ReceiveMigrationRequest) -> Result<ApiResponse, ApiError> {
        let me = self.me.upgrade().ok_or_else(|| ApiError::unavailable("the VMM is ending"))?;
        e.claim("an incoming migration").map_err(ApiError::conflict)?;
        // CH's body (only `receiver_url`): the VM keeps its source's taps and images, names
        // this host has too (as CH's destination).
        let ours = HostResources::given(&r.net, &r.numa, &r.disks);
        let listening = (ours.check().map_err(|e| e.to_string()))
            .and_then(|()| crate::migration::listen_options(r.tls_dir.as_deref(), r.insecure))
            .and_then(|listen| Incoming::new(&r.receiver_url, r.memory, r.cpus, !r.shared_memory, ours, listen))
            .and_then(|inc| inc.listen(&*e.say).map(|ready| (inc, ready)));
        let (inc, ready) = listening.map_err(|why| {
            e.release();
            ApiError::bad_request(format!("cannot receive a migration: {why}"))
        })?;
        *kumo_sandbox::lock(&self.mode) = Mode::Receiving(inc.clone());
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
        e.claim("a restore").map_err(ApiError::conflict)?;
        let restored = crate::lifecycle::source_path(&r.source_url).map_err(ApiError::bad_request).and_then(|path| {
            // CH's restore (neither NICs nor disks given): the VM's own backends.
            let ours = HostResources { tap_fds: passed_taps(r)?, ..HostResources::given(&r.net, &r.numa, &r.disks) };
            crate::snapshot::restore(&path, (e.console)(), &ours).map_err(ApiError::from)
        });
        let (vm, report) = restored.inspect_err(|_| e.release())?;
        (e.say)(&format!(
            "restored {} ({} pages){}",
            report.path.display(),
            report.pages,
            if report.paused { ", paused as it was saved" } else { "" }
        ));
        let vm = Arc::new(vm);
        self.attach(&vm);
        e.fill(vm);
        Ok(ApiResponse::Restore(report))
    }

    /// Answers for a destination whose VM has not arrived yet.
    fn receiving(&self, inc: &Incoming, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong(Pong::here())),
            ApiRequest::Info => Ok(ApiResponse::Info(Box::new(ChVmInfo::new(
                None,
                VmInfo {
                    vcpus: inc.cpus.unwrap_or(0),
                    memory_bytes: inc.memory.unwrap_or(0),
                    guest: format!("incoming:{}", inc.addr),
                    ..no_vm_info(VmState::Receiving, inc.since)
                },
            )))),
            ApiRequest::MigrationStatus => Ok(migration_answer(inc.status())),
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

/// `vm.restore`'s `net_fds`: each NIC's descriptors, checked to be one tap's (named by
/// TUNGETIFF); an entry with none gives nothing (CH's way).
fn passed_taps(r: &RestoreRequest) -> Result<Vec<crate::host_resources::PassedTap>, ApiError> {
    let passed = r.net_fds.iter().filter(|n| !n.tap_fds.is_empty());
    passed
        .map(|n| {
            let tap = crate::ch_config::tap_of_fds(&n.tap_fds)
                .map_err(|why| ApiError::bad_request(format!("vm.restore: net_fds {}: {why}", n.id)))?;
            Ok(crate::host_resources::PassedTap { id: n.id.clone(), tap, fds: n.tap_fds.clone() })
        })
        .collect()
}

/// Which of CH's consoles asked for a pseudo-terminal, if one did: `serial`, else `console`
/// (kumo has no virtio-console; its COM1 serves it) unless the serial port goes to stdout.
fn pty_field(ch: &ChVmConfig) -> Option<&'static str> {
    let mode = |c: &Option<kumo_api::ch::ChConsole>| c.as_ref().and_then(|c| c.mode.clone());
    match (mode(&ch.serial).as_deref(), mode(&ch.console).as_deref()) {
        (Some("Pty"), _) => Some("serial"),
        (Some("Tty"), _) => None,
        (_, Some("Pty")) => Some("console"),
        _ => None,
    }
}

/// `vm.remove-device` of a created VM: the disk or NIC with this id (kumo's `diskN`/`netN`,
/// a disk's own id, a NIC's CH `id`), from both configs.
fn remove_device(ch: &mut ChVmConfig, k: &mut crate::config::VmConfig, id: &str) -> Result<(), ApiError> {
    if let Some(i) = (0..k.disks.len()).find(|&i| k.disks[i].id_at(i) == id) {
        k.disks.remove(i);
        // CH's list maps to kumo's one for one (from_ch); checked all the same.
        let disks = ch.disks.get_or_insert_default();
        if i < disks.len() {
            disks.remove(i);
        }
        if disks.is_empty() {
            ch.disks = None;
        }
        return Ok(());
    }
    let nets = ch.net.get_or_insert_default();
    let ch_id = |i: usize| nets.get(i).and_then(|n| n.extra.get("id")).and_then(|v| v.as_str()).map(String::from);
    if let Some(i) = (0..k.net.len()).find(|&i| format!("net{i}") == id || ch_id(i).as_deref() == Some(id)) {
        k.net.remove(i);
        if i < nets.len() {
            nets.remove(i);
        }
        if nets.is_empty() {
            ch.net = None;
        }
        return Ok(());
    }
    Err(ApiError::not_found(format!("vm.remove-device: the created VM has no device {id}")))
}

/// kumo's `vm.info` of an empty VMM.
fn empty_info(e: &EmptyVmm) -> VmInfo {
    no_vm_info(VmState::Created, e.since)
}

/// kumo's `vm.info` while this VMM has no VM (empty, or a destination still receiving one):
/// `state`, its uptime since `since`, nothing else known yet.
fn no_vm_info(state: VmState, since: std::time::Instant) -> VmInfo {
    VmInfo {
        state,
        vcpus: 0,
        memory_bytes: 0,
        guest: "none".into(),
        irqchip: "unknown".into(),
        pid: std::process::id(),
        uptime_ms: since.elapsed().as_millis() as u64,
        kumo_version: KUMO_VERSION.to_string(),
        net: Vec::new(),
        disks: Vec::new(),
        numa: Vec::new(),
        vcpu_pins: Vec::new(),
        parked_vcpus: Vec::new(),
        pv: None,
        memory_zones: Vec::new(),
        memory_private: false,
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
        disks: vm.disks(),
        numa: c.numa.as_ref().map(|n| n.info(c.cpus, c.memory)).unwrap_or_default(),
        vcpu_pins: vm.vcpu_pins(),
        parked_vcpus: vm.parked_vcpus(),
        pv: pv_info(&c.pv),
        memory_zones: vm.memory_zones(),
        memory_private: c.private_memory(),
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

fn migration_answer(st: MigrationStatus) -> ApiResponse {
    ApiResponse::Migration(Box::new(st))
}

impl VmApi {
    /// The last migration from here, or for a VM that arrived here and has not migrated since,
    /// how it came.
    fn migration_status(&self, arrived: Option<&Incoming>) -> MigrationStatus {
        let st = self.migration.status();
        match (st.state, arrived) {
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
        let (vm, arrived) = match self.settled_mode(&req) {
            Mode::Running { vm, arrived } => {
                (vm.upgrade().ok_or_else(|| ApiError::unavailable("the VM has ended"))?, arrived)
            }
            Mode::Receiving(inc) => return self.receiving(&inc, req),
            Mode::Empty => match &self.empty {
                Some(e) => return self.empty_vmm(e, req),
                None => return Err(ApiError::unavailable("the VM does not exist yet")),
            },
        };
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Pong(Pong::here())),
            ApiRequest::Info => Ok(self.info_answer(&vm)),
            ApiRequest::Pause => vm.pause().map(|_| ApiResponse::Ok).map_err(ApiError::from),
            ApiRequest::Resume => vm.resume().map(|_| ApiResponse::Ok).map_err(ApiError::from),
            ApiRequest::Shutdown => {
                if vm.is_finished() {
                    return Err(ApiError::conflict("vm is already shutting down"));
                }
                vm.shutdown();
                Ok(ApiResponse::Ok)
            }
            ApiRequest::Migrate(req) => Ok(migration_answer(self.migrate(&vm, &req)?)),
            ApiRequest::MigrationStatus => Ok(migration_answer(self.migration_status(arrived.as_deref()))),
            ApiRequest::MigrationEvents => {
                let job = self.migration.clone();
                Ok(ApiResponse::Stream(kumo_api::JsonLines::new(move |sink| job.stream(sink))))
            }
            ApiRequest::CancelMigration => Ok(self.migration.cancel().map(|()| ApiResponse::Ok)?),
            ApiRequest::Snapshot(req) => {
                use crate::snapshot::{snapshot_to_file, SnapshotError as E};
                // As a migration: the snapshot's hold is released in Drop, its panic contained.
                let path = crate::lifecycle::snapshot_path(&req.path, req.destination_url.as_deref())
                    .map_err(ApiError::bad_request)?;
                let r = kumo_sandbox::contain(kumo_sandbox::ThreadKind::Migration, "snapshot job", || {
                    snapshot_to_file(&vm, &path)
                })
                .unwrap_or_else(|p| {
                    crate::panics::contained(&p);
                    Err(E::Vm(format!("{p}; the VM runs on here")))
                });
                Ok(ApiResponse::Snapshot(r?))
            }
            ApiRequest::Counters => {
                let st = self.migration_status(arrived.as_deref());
                Ok(ApiResponse::Counters(Box::new(crate::counters::collect(&vm, &st))))
            }
            ApiRequest::Pin(p) => Ok(vm.pin_vcpu(p.vcpu, p.cpu).map(|()| ApiResponse::Ok)?),
            ApiRequest::Resize(r) => vm.resize(&r).map(|()| ApiResponse::Ok).map_err(|e| {
                use crate::cpu_hotplug::ResizeError as R;
                match e {
                    R::BadRequest(m) => ApiError::bad_request(m),
                    R::Conflict(m) => ApiError::conflict(m),
                    R::Timeout(m) => ApiError::guest_timeout(m),
                }
            }),
            ApiRequest::Release(r) => Ok(ApiResponse::Released(vm.elastic_release(&r)?)),
            ApiRequest::Acquire(r) => Ok(ApiResponse::Acquired(vm.elastic_acquire(&r)?)),
            ApiRequest::Elastic => Ok(ApiResponse::Elastic(vm.elastic_info()?)),
            ApiRequest::Lend(l) => self.lend(&vm, &l),
            ApiRequest::ResizeZone(r) => vm.resize_zone(&r).map(|()| ApiResponse::Ok),
            ApiRequest::ReceiveMigration(_) | ApiRequest::Restore(_) | ApiRequest::Create(_) | ApiRequest::Boot => {
                Err(ApiError::conflict("this VMM has a VM already; start an empty one: kumo run --api-socket PATH"))
            }
            ApiRequest::Delete => self.end_vm(vm, EndIntent::Delete),
            ApiRequest::VmmShutdown => self.end_vm(vm, EndIntent::Exit),
            ApiRequest::Reboot => self.end_vm(vm, EndIntent::Reboot),
            ApiRequest::PowerButton => vm.power_button().map(|()| ApiResponse::Ok),
            ApiRequest::AddDisk(_) | ApiRequest::AddNet(_) | ApiRequest::RemoveDevice(_) => Err(ApiError::bad_request(
                "hot-plug is not supported by kumo: add or remove devices before vm.boot (or in vm.create)",
            )),
            ApiRequest::BackendInfo | ApiRequest::Handover(_) => Err(ApiError::not_found("not a net-backend's API")),
        }
    }
}

impl VmApi {
    /// `vm.lend`: this VM gives, the VM at `l.to` takes, both or neither.
    fn lend(&self, vm: &RunningVm, l: &kumo_api::LendApiRequest) -> Result<ApiResponse, ApiError> {
        use kumo_elastic::lend::{lend, LendError, LendRequest};
        let local = crate::vmm::LocalPeer(vm);
        let to = self.peer(&l.to).with_timeout(kumo_elastic::lend::client_timeout(l.timeout_ms));
        let req = LendRequest {
            cpus: l.cpus,
            memory_bytes: l.memory_bytes,
            node: l.node,
            timeout_ms: l.timeout_ms,
            returning: l.returning,
        };
        match lend(&local, &to, &req) {
            Ok(r) => Ok(ApiResponse::Lent(Box::new(r))),
            Err(e @ LendError::Empty) => Err(ApiError::bad_request(e.to_string())),
            Err(e @ LendError::Lost { .. }) => Err(ApiError::internal(e.to_string())),
            Err(e) => Err(ApiError::conflict(e.to_string())),
        }
    }
}

// Each domain error's kind, for the server to answer with its status.

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::State(what) => ApiError::conflict(format!("vm is {what}")),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::BadRequest(m) => ApiError::bad_request(m),
            JobError::Conflict(m) => ApiError::conflict(format!("cannot migrate: {m}")),
            JobError::Busy | JobError::Cancelled | JobError::NotRunning | JobError::TooLate(_) => {
                ApiError::conflict(e.to_string())
            }
            JobError::Failed(_) => ApiError::internal(e.to_string()),
        }
    }
}

impl From<crate::snapshot::SnapshotError> for ApiError {
    fn from(e: crate::snapshot::SnapshotError) -> Self {
        use crate::snapshot::SnapshotError as E;
        match e {
            // A file that cannot be read back is the request's fault (it names the file).
            E::BadRequest(m) | E::Read(m) => ApiError::bad_request(m),
            E::Conflict(m) => ApiError::conflict(m),
            E::Write(m) | E::Vm(m) => ApiError::internal(m),
        }
    }
}

impl From<crate::vmm::PinError> for ApiError {
    fn from(e: crate::vmm::PinError) -> Self {
        use crate::vmm::PinError as E;
        match e {
            E::Bad(m) => ApiError::bad_request(m),
            E::NoThread(m) => ApiError::conflict(m),
            E::Failed(m) => ApiError::internal(m),
        }
    }
}

impl From<crate::elastic::ElasticError> for ApiError {
    fn from(e: crate::elastic::ElasticError) -> Self {
        use crate::elastic::ElasticError as E;
        match e {
            E::Bad(m) => ApiError::bad_request(m),
            E::Conflict(m) => ApiError::conflict(m),
            E::Guest(m) => ApiError::guest_timeout(m),
            E::Failed(m) => ApiError::internal(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_api::ErrorKind;

    #[test]
    fn an_empty_vmm_answers_what_needs_no_vm() {
        let api = VmApi::empty(|_| {}, || Box::new(std::io::sink()));
        let ApiResponse::Info(i) = api.handle(ApiRequest::Info).unwrap() else { panic!("not an info") };
        assert_eq!((i.kumo.state, i.kumo.vcpus, i.state), (VmState::Created, 0, kumo_api::ChVmState::Created));
        let ApiResponse::Migration(st) = api.handle(ApiRequest::MigrationStatus).unwrap() else { panic!() };
        assert_eq!(st.state, crate::migration::MigrationState::None);
        let e = api.handle(ApiRequest::Pause).unwrap_err();
        assert_eq!((e.kind, e.message.contains("no VM yet")), (ErrorKind::Conflict, true), "{e}");
    }

    #[test]
    fn cold_plug_changes_the_created_vm_and_vmm_shutdown_ends_it() {
        let kernel = std::env::temp_dir().join(format!("kumo-api-test-{}.bin", std::process::id()));
        std::fs::write(&kernel, b"not booted").unwrap();
        let api = VmApi::empty(|_| {}, || Box::new(std::io::sink()));
        fn ch<T: serde::de::DeserializeOwned>(j: serde_json::Value) -> T {
            serde_json::from_value(j).unwrap()
        }
        let e = api.handle(ApiRequest::AddNet(Box::new(ch(serde_json::json!({"tap": "t0"}))))).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound, "nothing created: {e}");
        let config: ChVmConfig = ch(serde_json::json!({"payload": {"kernel": kernel}, "memory": {"size": 64 << 20}}));
        api.handle(ApiRequest::Create(Box::new(config))).unwrap();
        api.handle(ApiRequest::AddNet(Box::new(ch(serde_json::json!({"tap": "t0", "id": "mine"}))))).unwrap();
        api.handle(ApiRequest::AddNet(Box::new(ch(serde_json::json!({"tap": "t1"}))))).unwrap();
        let remove = |id: &str| api.handle(ApiRequest::RemoveDevice(ch(serde_json::json!({ "id": id }))));
        remove("mine").unwrap();
        let created = kumo_sandbox::lock(&api.created).clone().unwrap();
        assert_eq!((created.1.net.len(), created.1.net[0].tap.as_str()), (1, "t1"));
        assert_eq!(created.0.net.as_ref().unwrap()[0].tap.as_deref(), Some("t1"));
        assert_eq!(remove("disk0").unwrap_err().kind, ErrorKind::NotFound);
        api.handle(ApiRequest::VmmShutdown).unwrap();
        assert!(matches!(api.wait_vm(), Ok(None)));
        let _ = std::fs::remove_file(&kernel);
    }

    #[test]
    fn a_pty_serves_the_serial_port_or_else_chs_console() {
        let with = |serial: Option<&str>, console: Option<&str>| {
            let mode =
                |m: Option<&str>| m.map(|m| kumo_api::ch::ChConsole { mode: Some(m.into()), ..Default::default() });
            pty_field(&ChVmConfig { serial: mode(serial), console: mode(console), ..Default::default() })
        };
        assert_eq!(with(Some("Pty"), Some("Pty")), Some("serial"));
        assert_eq!(with(Some("Null"), Some("Pty")), Some("console"));
        assert_eq!(with(None, Some("Pty")), Some("console"));
        assert_eq!(with(Some("Tty"), Some("Pty")), None, "the serial port goes to stdout");
        assert_eq!(with(Some("Tty"), None), None);
    }

    #[test]
    fn domain_errors_have_their_kinds() {
        use crate::elastic::ElasticError;
        let kind = |e: ApiError| e.kind;
        assert_eq!(kind(ElasticError::Guest("late".into()).into()), ErrorKind::GuestTimeout);
        assert_eq!(kind(ElasticError::Bad("x".into()).into()), ErrorKind::BadRequest);
        assert_eq!(kind(JobError::Busy.into()), ErrorKind::Conflict);
        assert_eq!(kind(JobError::Failed("x".into()).into()), ErrorKind::Internal);
        let e: ApiError = JobError::Conflict("paused".into()).into();
        assert_eq!(e.message, "cannot migrate: paused");
        assert_eq!(kind(crate::vmm::PinError::NoThread("x".into()).into()), ErrorKind::Conflict);
        assert_eq!(kind(crate::snapshot::SnapshotError::Read("x".into()).into()), ErrorKind::BadRequest);
        assert_eq!(kind(Error::State("paused").into()), ErrorKind::Conflict);
    }
}
