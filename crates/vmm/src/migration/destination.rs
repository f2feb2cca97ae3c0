//! The VM as a migration destination: `kumo run --incoming`.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kumo_migration_engine::{
    receive_with, Address, BoxError, DestVm, ListenOptions, Listener, RecvProgress, RecvReport, ServerTls, VmError,
    VmOp,
};
use kumo_vm::GuestMemory;

use crate::host_resources::HostResources;
use crate::vmm::{RunningVm, Snapshot};

use super::*;

impl DestVm for RunningVm {
    fn memory(&self) -> &GuestMemory {
        RunningVm::memory(self)
    }
    fn restore_state(&self, state: &[u8]) -> Result<(), VmError> {
        let err = |e: BoxError| VmError { op: VmOp::RestoreState, source: e };
        let s: Snapshot = serde_json::from_slice(state).map_err(|e| err(format!("bad VM state: {e}").into()))?;
        RunningVm::restore_state(self, &s).map_err(|e| err(e.into()))
    }
    fn resume(&self) -> Result<(), VmError> {
        self.resume_incoming().map_err(|e| VmError::new(VmOp::Resume, e))
    }
    fn resident(&self) -> bool {
        self.vm().memory.prefaulted
    }
}

/// How a destination listens (`--tls-dir`, `--insecure`; API `tls_dir`, `insecure`): the TLS
/// directory is loaded here, so a bad one is refused before anything is prepared.
pub fn listen_options(tls_dir: Option<&str>, insecure: bool) -> Result<ListenOptions, String> {
    let tls = tls_dir.map(|d| ServerTls::from_dir(std::path::Path::new(d))).transpose()?;
    Ok(ListenOptions { tls, insecure })
}

/// A destination's incoming migration (`kumo run --incoming ADDR`): where it listens, the shape
/// it was prepared for, and how far the VM has arrived (read by the destination's API).
pub struct Incoming {
    pub addr: Address,
    /// `--memory`: only a VM of this size is taken, its memory allocated and faulted in first.
    pub memory: Option<u64>,
    /// `--cpus`: only a VM with this many vCPUs is taken.
    pub cpus: Option<u32>,
    /// The memory prepared is private anonymous memory ([`kumo_vm::Memory::private`], the
    /// default), else a memfd (`--shared-memory`); without `memory`, the kind the arriving VM
    /// had.
    pub private_memory: bool,
    /// `--net`, `--numa`: the host resources the arriving VM gets; a VM that does not fit them
    /// is refused.
    pub resources: HostResources,
    /// TLS, or a plain listener (loopback only unless insecure).
    listen: ListenOptions,
    pub since: Instant,
    progress: RecvProgress,
    arrived: Mutex<Option<RecvReport>>,
}

impl Incoming {
    /// An incoming migration on `addr`, listening as `listen` says (checked here, before
    /// anything is prepared).
    pub fn new(
        addr: &str,
        memory: Option<u64>,
        cpus: Option<u32>,
        private_memory: bool,
        resources: HostResources,
        listen: ListenOptions,
    ) -> Result<Arc<Incoming>, String> {
        let addr: Address = addr.parse()?;
        listen.check(&addr)?;
        Ok(Arc::new(Incoming {
            addr,
            memory,
            cpus,
            private_memory,
            resources,
            listen,
            since: Instant::now(),
            progress: RecvProgress::default(),
            arrived: Mutex::new(None),
        }))
    }

    /// `receiving` with the pages so far, or `received` once the VM runs here.
    pub fn status(&self) -> MigrationStatus {
        let arrived = self.arrived.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        MigrationStatus {
            state: if arrived { MigrationState::Received } else { MigrationState::Receiving },
            events: Vec::new(),
            report: None,
            error: None,
            received: Some(self.progress.status()),
        }
    }

    /// Waits for one incoming migration and returns the VM, running, with what the receiver
    /// measured: [`Incoming::listen`], then [`Incoming::receive_on`]. `say` gets the lines an
    /// operator wants to see (prepared, listening, received); the VM's console writes to `serial`.
    pub fn receive(
        &self,
        say: &dyn Fn(&str),
        serial: Box<dyn std::io::Write + Send>,
    ) -> Result<(RunningVm, RecvReport), String> {
        let ready = self.listen(say)?;
        self.receive_on(ready, say, serial)
    }

    /// Prepares the destination and starts listening. With `memory` or `cpus` the destination
    /// is prepared: both are checked against this host, and guest memory of that size is
    /// allocated and faulted in before listening, so the transfer does not pay for first-touch
    /// page faults (expensive on nested hosts). The arriving VM takes that mapping itself, page
    /// tables and all: a new mapping of the same file would fault every page again. Nothing
    /// has been received when it returns.
    pub fn listen(&self, say: &dyn Fn(&str)) -> Result<Listening, String> {
        let (memory, cpus) = (self.memory, self.cpus);
        let host = kumo_vm::vm::HostLimits::probe().map_err(|e| e.to_string())?;
        if let Some(n) = cpus {
            kumo_vm::vm::check_vcpus(n, host.kvm_max_vcpus).map_err(|e| e.to_string())?;
        }
        if let Some(size) = memory {
            kumo_vm::memory::check_size(size, &host.memory).map_err(|e| e.to_string())?;
        }
        let reserved = match memory {
            Some(size) => {
                let t = Instant::now();
                let m = if self.private_memory { kumo_vm::Memory::private(size) } else { kumo_vm::Memory::new(size) };
                let mut m = m.map_err(|e| e.to_string())?;
                m.prefault().map_err(|e| e.to_string())?;
                // The KVM VM and its memory slots too: they take time in proportion to memory.
                let m = kumo_vm::PreparedVm::new(m).map_err(|e| e.to_string())?;
                say(&format!(
                    "prepared {} MiB of guest memory in {:.0} ms",
                    size >> 20,
                    t.elapsed().as_secs_f64() * 1e3
                ));
                Some(m)
            }
            None => None,
        };
        // Listen only once the memory is ready: a source that connected earlier would wait for
        // the handshake while memory is faulted in, and give up.
        let listener = Listener::bind_with(&self.addr, &self.listen)?;
        let tls = match &self.listen.tls {
            Some(t) => format!(" (mutual TLS, {})", t.dir.display()),
            None => String::new(),
        };
        say(&format!("waiting for a migration on {}{tls}", listener.local_addr()));
        Ok(Listening { listener, reserved })
    }

    /// Takes one incoming migration on a listening destination and returns the VM, running, its
    /// console on `serial`.
    pub fn receive_on(
        &self,
        ready: Listening,
        say: &dyn Fn(&str),
        serial: Box<dyn std::io::Write + Send>,
    ) -> Result<(RunningVm, RecvReport), String> {
        let mut serial = Some(serial);
        let (memory, cpus) = (self.memory, self.cpus);
        let Listening { listener, mut reserved } = ready;
        let (vm, rr) =
            receive_with(&listener, kumo_migration_engine::PROGRESS_TIMEOUT, &self.progress, |desc, memfd| {
                let refuse = |why: String| VmError::new(VmOp::Create, why);
                let config = config_from_description(desc, &self.resources).map_err(refuse)?;
                let human = kumo_vm::memory::human_size;
                if let Some(size) = memory.filter(|&m| m != config.memory) {
                    return Err(refuse(format!(
                        "this destination is prepared for {} of memory; the VM has {}",
                        human(size),
                        human(config.memory)
                    )));
                }
                if let Some(n) = cpus.filter(|&n| n != config.cpus) {
                    return Err(refuse(format!(
                        "this destination is prepared for {n} vCPUs; the VM has {}",
                        config.cpus
                    )));
                }
                // Memory shared by a local migration wins; otherwise the prepared memory, if any.
                let prepared = match memfd {
                    Some(f) => Some(
                        kumo_vm::Memory::from_file(f, config.memory)
                            .and_then(kumo_vm::PreparedVm::new)
                            .map_err(|e| refuse(e.to_string()))?,
                    ),
                    None => reserved.take(),
                };
                let serial = serial.take().unwrap_or_else(|| Box::new(std::io::stdout()));
                RunningVm::incoming(config, serial, prepared).map_err(|e| VmError::new(VmOp::Create, e))
            })
            .map_err(|e| format!("incoming migration failed: {e}"))?;
        *self.arrived.lock().unwrap_or_else(|p| p.into_inner()) = Some(rr.clone());
        say(&format!(
            "migration received: {} pages over {} connection(s) in {:.1} ms, receiver CPU {:.1} ms, restore {:.1} ms (connections {:.1}, build {:.1}, receive {:.1}){}",
            rr.pages,
            rr.connections,
            rr.total_ms,
            rr.receiver_cpu_ms,
            rr.restore_ms,
            rr.connections_ms,
            rr.build_ms,
            rr.receive_ms,
            if rr.shared_memory { " (memory shared, not copied)" } else { "" }
        ));
        Ok((vm, rr))
    }
}

/// A destination that listens, its prepared memory (if any) ready: [`Incoming::listen`].
pub struct Listening {
    listener: Listener,
    reserved: Option<kumo_vm::PreparedVm>,
}
