//! A running VM: the KVM VM, its devices (`device_manager`) and its vCPUs (`vcpu_manager`),
//! and the one object the API, migration and snapshots act on. A VM is built in named phases,
//! as Firecracker's `build_microvm_for_boot` / `build_microvm_from_snapshot` do:
//! [`RunningVm::start`] builds one to boot (its payload loaded, the boot vCPU's entry set) and
//! [`RunningVm::incoming`] one whose memory and state arrive later (a migration or a restore);
//! both share creating the VM and its memory, the vCPUs and the devices, and launching the vCPU
//! threads.

use std::io::{Cursor, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kumo_devices::Persist;
use kumo_sandbox::lock;
use kumo_vm::boot::linux::{load_linux, LinuxBootConfig, LinuxEntry};
use kumo_vm::boot::{write_gdt, write_page_tables, Entry, KumoBootInfo};
use kumo_vm::layout::HIMEM_START;
use kumo_vm::{Vcpu, Vm};
use linux_loader_shim::load_elf;

use crate::config::{Payload, VmConfig, DEFAULT_LINUX_CMDLINE};
use crate::device_manager::DeviceManager;
use crate::elastic::{AreaPlan, ElasticError, ElasticVm};
pub use crate::persist::Snapshot;
pub use crate::vcpu_manager::{monotonic_ns, Outcome, PinError, Timings};
use crate::vcpu_manager::{VcpuManager, VcpuSetup};
use crate::{Error, Result};

#[derive(Debug)]
pub struct RunReport {
    pub outcome: Outcome,
    pub timings: Timings,
}

impl crate::panics::OnPanic for VcpuManager {
    /// A panic on any kumo thread is a bug: the VM stops, the panic its reason.
    fn panicked(&self, p: &kumo_sandbox::ThreadPanic) {
        self.finish(Outcome::Panicked(p.to_string()));
    }
}

/// The console sink: line-buffered, and notes when the first byte arrived.
struct TimedSink {
    out: Box<dyn Write + Send>,
    vcpus: Arc<VcpuManager>,
    seen: bool,
    line: Vec<u8>,
}

impl Write for TimedSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.seen && !buf.is_empty() {
            self.seen = true;
            self.vcpus.note_first_output();
        }
        self.line.extend_from_slice(buf);
        if self.line.len() >= 256 || buf.contains(&b'\n') {
            self.flush()?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.write_all(&self.line)?;
        self.line.clear();
        self.out.flush()
    }
}

pub struct RunningVm {
    vm: Vm,
    config: VmConfig,
    /// The vCPUs, their threads and run state.
    vcpus: Arc<VcpuManager>,
    devices: DeviceManager,
    started: Instant,
    /// `--elastic`: the guest channel and what the VM holds.
    elastic: Option<ElasticVm>,
    /// `--memory-zone`: the virtio-mem devices (empty without).
    zones: crate::virtio_mem::Zones,
    /// Its API socket, once served: how other VMs' records name it.
    api_name: std::sync::OnceLock<String>,
}

mod linux_loader_shim {
    //! kumo guests are plain static ELF executables; linux-loader's ELF loader places them.
    use super::*;
    use linux_loader::loader::{Elf, KernelLoader};
    use vm_memory::GuestAddress;

    /// Loads `elf` and returns (entry point, end of the loaded image).
    pub fn load_elf(mem: &kumo_vm::GuestMemory, elf: &[u8]) -> Result<(u64, u64)> {
        let r = Elf::load(mem, None, &mut Cursor::new(elf), Some(GuestAddress(HIMEM_START)))
            .map_err(|e| Error::Load(e.to_string()))?;
        let end = crate::guest_program::image_end(elf).map_err(Error::Load)?;
        Ok((r.kernel_load.0, end.max(r.kernel_end)))
    }
}

/// Build phases. `start` and `incoming` name the two ways a VM comes to be; the steps they
/// share are the functions after them.
impl RunningVm {
    /// Builds the VM, loads its payload and starts every vCPU. Console output goes to `serial`.
    pub fn start(config: VmConfig, serial: Box<dyn Write + Send>) -> Result<RunningVm> {
        Self::build_for_boot(config, serial)
    }

    /// Builds a VM of `config`'s shape for an incoming migration: memory empty, payload not
    /// loaded, every vCPU thread parked (the VM is paused) until its state is restored and it
    /// is resumed. With `memfd`, guest memory is that file (a local migration shares it).
    pub fn incoming(
        config: VmConfig,
        serial: Box<dyn Write + Send>,
        prepared: Option<kumo_vm::PreparedVm>,
    ) -> Result<RunningVm> {
        Self::build_for_incoming(config, serial, prepared)
    }

    /// Boot: validates `config`, writes the boot structures, loads the payload, sets each vCPU
    /// where the payload starts, installs ACPI and (`--elastic`) the elastic side, then runs.
    fn build_for_boot(mut config: VmConfig, serial: Box<dyn Write + Send>) -> Result<RunningVm> {
        let start_ns = monotonic_ns();
        config.validate()?;
        let numa = config.numa_topology()?;
        // Elastic memory is anonymous huge pages (fast to discard), the rest the memfd.
        let areas = match &config.elastic {
            Some(e) => {
                config.host.pins = e.pins(config.cpus);
                let layout = kumo_vm::layout::MemoryLayout::new(config.memory);
                crate::elastic::plan_areas(e, &layout, config.numa.as_ref().zip(numa.as_ref()))?
            }
            None => Vec::new(),
        };
        // Private memory and elastic areas do not go together (an elastic VM's is the memfd).
        // The kind is settled for the VM's life: a NIC added later cannot change it.
        let private = config.private_memory();
        config.shared_memory = Some(!private);
        let memory = if private {
            Some(kumo_vm::PreparedVm::new(kumo_vm::Memory::private(config.memory)?)?)
        } else if areas.is_empty() {
            None
        } else {
            let anon: Vec<(u64, u64)> = areas.iter().map(|a| (a.gpa, a.len)).collect();
            Some(kumo_vm::PreparedVm::new(kumo_vm::Memory::with_anonymous(config.memory, &anon)?)?)
        };
        let vm = create_vm(&config, numa.as_ref(), memory)?;
        write_gdt(&vm.memory.guest, config.cpus)?;
        write_page_tables(&vm.memory.guest, vm.memory.layout.ram_end())?;
        let (vcpus, pv) = create_vcpus(&vm, &mut config)?;
        let entries = load_payload(&vm, &config, &areas, &vcpus)?;
        for (v, e) in vcpus.iter().zip(&entries) {
            v.configure(&vm.kvm, config.cpus, *e, &pv)?;
        }
        let elastic = match &config.elastic {
            Some(e) => Some(ElasticVm::new(&vm, e, &areas, config.cpus, vcpu_host_nodes(&config, numa.as_ref()))?),
            None => None,
        };
        let parked = config.elastic.as_ref().map(|e| e.spares(config.cpus)).unwrap_or_default();
        let vcpus = manage_vcpus(vcpus, VcpuSetup { paused: false, parked, uapic: vm.uapic.clone(), start_ns });
        let mut devices = create_devices(&vm, &config, serial, &vcpus, false)?;
        let zones = crate::virtio_mem::Zones::new(&vm, &config.memory_zones, devices.pci_mut())?;
        crate::acpi::install(&vm, &devices, entries[0], numa.as_ref(), &zones.hotplug_ranges())?;
        let vm = Self::launch(vm, config, vcpus, devices, elastic, zones)?;
        crate::event_monitor::vm_event(
            "booted",
            serde_json::json!({"cpus": vm.config.cpus, "memory_bytes": vm.config.memory}),
        );
        Ok(vm)
    }

    /// Incoming (a migration's destination, a restore): the VM's shape only. Its memory comes
    /// from the source (for a local migration it *is* the source's memory, so nothing is
    /// written to it here); its vCPU and device state are restored later, and it stays paused,
    /// its taps detached, until then.
    fn build_for_incoming(
        mut config: VmConfig,
        serial: Box<dyn Write + Send>,
        prepared: Option<kumo_vm::PreparedVm>,
    ) -> Result<RunningVm> {
        let start_ns = monotonic_ns();
        let prepared = memory_for_arrival(&mut config, prepared)?;
        config.validate_arriving()?;
        let numa = config.numa_topology()?;
        if config.elastic.is_some() {
            return Err(Error::Config("an elastic VM cannot arrive by migration".into()));
        }
        if let Some(m) = prepared.as_ref().map(|p| p.memory()).filter(|m| m.size != config.memory) {
            return Err(Error::Config(format!(
                "the memory given holds {} bytes, the VM has {}",
                m.size, config.memory
            )));
        }
        let vm = create_vm(&config, numa.as_ref(), prepared)?;
        let (vcpus, pv) = create_vcpus(&vm, &mut config)?;
        // Registers arrive with the migration stream.
        for v in &vcpus {
            v.configure(&vm.kvm, config.cpus, None, &pv)?;
        }
        let setup = VcpuSetup { paused: true, parked: Vec::new(), uapic: vm.uapic.clone(), start_ns };
        let vcpus = manage_vcpus(vcpus, setup);
        let devices = create_devices(&vm, &config, serial, &vcpus, true)?;
        devices.pause();
        devices.set_taps_attached(false);
        Self::launch(vm, config, vcpus, devices, None, Default::default())
    }

    /// The last phase of both: the VM assembled, its vCPU threads started.
    fn launch(
        vm: Vm,
        config: VmConfig,
        vcpus: Arc<VcpuManager>,
        devices: DeviceManager,
        elastic: Option<ElasticVm>,
        zones: crate::virtio_mem::Zones,
    ) -> Result<RunningVm> {
        // The vCPUs a NIC's dedicated interrupt path names run prioritized (seed 000).
        let prioritized: Vec<u32> = config
            .net
            .iter()
            .filter_map(|n| match n.irq {
                kumo_vm::interrupt_paths::IrqPath::Dedicated { vcpu } => Some(vcpu),
                _ => None,
            })
            .collect();
        let started = Instant::now();
        let vm = RunningVm { vm, config, vcpus, devices, started, elastic, zones, api_name: Default::default() };
        vm.vcpus.start(vm.devices.buses(), &vm.config.host.pins, &prioritized)?;
        vm.place_io_threads(&vm.config.host.pins);
        Ok(vm)
    }
}

/// The memory an arriving VM (a migration's, a restore's) gets: what was prepared here (a
/// destination's `--memory`, a local migration's memfd), private or not, else the kind the VM
/// had. A VM with a vhost-user NIC gets the memfd, whose backend maps it: private memory
/// prepared for it is let go (kumo prepares private memory unless `--shared-memory`).
fn memory_for_arrival(
    config: &mut VmConfig,
    prepared: Option<kumo_vm::PreparedVm>,
) -> Result<Option<kumo_vm::PreparedVm>> {
    let backend = config.has_vhost_user_nic();
    if backend {
        config.shared_memory = Some(true);
    }
    match prepared {
        Some(p) if backend && p.memory().is_private() => {
            tracing::warn!(
                "the memory prepared here is private, and the arriving VM's vhost-user NIC needs memory its \
                 backend can map: it gets a memfd instead (prepare with --shared-memory)"
            );
        }
        Some(p) => {
            config.shared_memory = Some(!p.memory().is_private());
            return Ok(Some(p));
        }
        None => {}
    }
    if config.private_memory() {
        return Ok(Some(kumo_vm::PreparedVm::new(kumo_vm::Memory::private(config.memory)?)?));
    }
    Ok(None)
}

/// Creates the KVM VM and its memory (`prepared`: a VM over memory made ahead, else a new
/// memfd), sets halt polling and binds guest NUMA nodes' memory to their host nodes.
fn create_vm(
    config: &VmConfig,
    numa: Option<&kumo_acpi::NumaTopology>,
    prepared: Option<kumo_vm::PreparedVm>,
) -> Result<Vm> {
    let vm = match prepared {
        Some(p) => Vm::from_prepared(p, config.cpus, config.irqchip)?,
        None => Vm::new(config.cpus, config.memory, config.irqchip)?,
    };
    crate::placement::set_halt_polling(&vm, &config.host, config.elastic.is_some())?;
    // Before anything is written: the guest's pages are then faulted on their host node.
    if let (Some(n), Some(t)) = (&config.numa, numa) {
        for (gpa, len, node) in n.bindings(t) {
            kumo_vm::memory::bind_to_host_node(&vm.memory.guest, gpa, len, node)?;
        }
    }
    Ok(vm)
}

/// Resolves the PV features (into `config.pv`, fully set, so a migration stream carries the
/// guest's CPUID as it is here: the destination's pins do not change it) and creates the
/// vCPUs.
fn create_vcpus(vm: &Vm, config: &mut VmConfig) -> Result<(Vec<Vcpu>, kumo_vm::pv::PvSet)> {
    let (pv, dedicated) =
        crate::placement::pv_features(&config.pv, &config.host.pins, config.cpus, config.irqchip, &vm.kvm)?;
    config.pv = kumo_vm::pv::PvRequest::from_set(pv);
    tracing::info!(pv = %pv.describe(), dedicated, "paravirtual features");
    let vcpus = (0..config.cpus).map(|i| vm.create_vcpu(i)).collect::<kumo_vm::Result<_>>()?;
    Ok((vcpus, pv))
}

/// Hands the vCPUs to their manager, which any kumo thread's panic stops.
fn manage_vcpus(vcpus: Vec<Vcpu>, setup: VcpuSetup) -> Arc<VcpuManager> {
    let vcpus = Arc::new(VcpuManager::new(vcpus, setup));
    crate::panics::register(Arc::downgrade(&vcpus) as std::sync::Weak<dyn crate::panics::OnPanic>);
    vcpus
}

/// The devices, their console writing to `serial`.
fn create_devices(
    vm: &Vm,
    config: &VmConfig,
    serial: Box<dyn Write + Send>,
    vcpus: &Arc<VcpuManager>,
    incoming: bool,
) -> Result<DeviceManager> {
    let sink = TimedSink { out: serial, vcpus: vcpus.clone(), seen: false, line: Vec::new() };
    let mut devices = DeviceManager::new(vm, Box::new(sink), &config.net, config.debug_exit, incoming)?;
    devices.add_disks(vm, &config.disks, config.cpus, incoming)?;
    Ok(devices)
}

/// Loads the payload into guest memory; returns each vCPU's entry (`None`: it waits for
/// INIT/SIPI).
fn load_payload(vm: &Vm, config: &VmConfig, areas: &[AreaPlan], vcpus: &[Vcpu]) -> Result<Vec<Option<Entry>>> {
    let n = config.cpus as usize;
    match &config.payload {
        Payload::Guest { name, program, .. } => {
            let program =
                program.as_ref().ok_or_else(|| Error::Config(format!("guest {name}: no program image given")))?;
            let rip = load_kumo_guest(vm, config, areas, vcpus, name, program)?;
            Ok(vec![Some(Entry::KumoGuest { rip }); n])
        }
        Payload::Kernel { path, initrd, cmdline } => {
            let cfg = LinuxBootConfig {
                kernel: path,
                initrd: initrd.as_deref(),
                cmdline: cmdline.as_deref().unwrap_or(DEFAULT_LINUX_CMDLINE),
                layout: &vm.memory.layout,
            };
            let entry = match load_linux(&vm.memory.guest, &cfg).map_err(kumo_vm::Error::from)? {
                LinuxEntry::BzImage64 { entry, boot_params } => Entry::Linux64 { rip: entry, boot_params },
                LinuxEntry::Pvh { entry, start_info } => Entry::Pvh { rip: entry, start_info },
            };
            // APs wait for the kernel's INIT/SIPI.
            Ok(std::iter::once(Some(entry)).chain(std::iter::repeat(None)).take(n).collect())
        }
    }
}

/// Loads kumo guest `name` and writes its boot info; returns its entry point.
fn load_kumo_guest(
    vm: &Vm,
    config: &VmConfig,
    areas: &[AreaPlan],
    vcpus: &[Vcpu],
    name: &str,
    program: &crate::guest_program::GuestProgram,
) -> Result<u64> {
    let mem = &vm.memory.guest;
    let cmdline = program.cmdline.clone();
    let (rip, end) = load_elf(mem, &program.elf)?;
    // Elastic memory is not the guest's to allocate from until it is plugged.
    let free_end = areas.iter().map(|a| a.gpa).fold(vm.memory.layout.low_ram_end(), u64::min);
    let info = KumoBootInfo {
        ncpus: config.cpus,
        mem_bytes: config.memory,
        tsc_khz: vcpus[0].tsc_khz().unwrap_or(0),
        free_start: end.next_multiple_of(4096),
        free_end,
        elastic: if config.elastic.is_some() { kumo_elastic::mailbox::MAILBOX_GPA } else { 0 },
        cmdline,
    };
    if info.free_start >= free_end {
        return Err(Error::Load(format!(
            "guest {name} does not fit in {} of memory",
            kumo_vm::memory::human_size(config.memory)
        )));
    }
    info.write(mem)?;
    Ok(rip)
}

/// The host node each vCPU's guest node is bound to (`--numa …,host-node=`), if any.
fn vcpu_host_nodes(config: &VmConfig, numa: Option<&kumo_acpi::NumaTopology>) -> Vec<Option<u32>> {
    let node_of = |v: u32| {
        let (n, t) = (config.numa.as_ref()?, numa?);
        let id = t.nodes.iter().find(|node| node.cpus.contains(&v))?.id;
        n.nodes.iter().find(|s| s.id == id)?.host_node
    };
    (0..config.cpus).map(node_of).collect()
}

impl RunningVm {
    /// The vCPU manager: the vCPUs' threads, run state, pins and throttle.
    pub fn vcpus(&self) -> &Arc<VcpuManager> {
        &self.vcpus
    }

    /// Pins vCPU `vcpu` to host CPU `cpu` (`None`: unpins it); see [`VcpuManager::pin_vcpu`].
    /// The VM's other threads follow ([`RunningVm::place_io_threads`]).
    pub fn pin_vcpu(&self, vcpu: u32, cpu: Option<u32>) -> std::result::Result<(), PinError> {
        self.vcpus.pin_vcpu(vcpu, cpu)?;
        self.place_io_threads(&self.vcpus.vcpu_pins());
        Ok(())
    }

    /// Keeps the VM's threads that are not vCPUs off the CPUs of pinned vCPUs (`pins`), where
    /// a CPU is left for them (`placement::io_cpus`). Not for an elastic VM, whose pins follow
    /// its lends (a lend's path makes no more system calls than it must): its threads get all
    /// the VMM's CPUs, whatever an earlier VM of this process had.
    fn place_io_threads(&self, pins: &[Option<u32>]) {
        let all = self.vcpus.float_cpus();
        let cpus = match self.elastic {
            Some(_) => all.to_vec(),
            None => crate::placement::io_cpus(all, pins),
        };
        if cpus.is_empty() {
            return; // the VMM's CPUs could not be read: leave every thread where it is
        }
        if let Err(e) = kumo_sandbox::cpus::set_io_cpus(&cpus) {
            tracing::warn!("the VM's I/O threads are not all on host CPUs {cpus:?}: {e}");
        }
    }

    /// The vCPUs whose threads are parked now.
    pub fn parked_vcpus(&self) -> Vec<u32> {
        self.vcpus.parked()
    }

    /// `vm.resize`: the guest keeps `req.desired_vcpus` vCPUs (ACPI CPU hotplug, `cpu_hotplug`).
    pub fn resize(&self, req: &kumo_api::ResizeRequest) -> std::result::Result<(), crate::cpu_hotplug::ResizeError> {
        use crate::cpu_hotplug::ResizeError;
        if self.elastic.is_some() {
            return Err(ResizeError::Conflict("an elastic VM's vCPUs move with vm.release/vm.acquire".into()));
        }
        let ged = self.devices.ged().ok_or_else(|| {
            ResizeError::Conflict(
                "this VM has no ACPI GED (its interrupt needs an IOAPIC: not with --irqchip split)".into(),
            )
        })?;
        let limit = std::time::Duration::from_millis(req.timeout_ms);
        crate::cpu_hotplug::resize(&self.vcpus, ged, req.desired_vcpus, limit)
    }

    /// `vm.power-button`: presses the ACPI power button (the GED's event); the guest decides
    /// what it does (Linux: its userspace, whose power-off enters S5 through the sleep control
    /// register and ends the VM as powered off).
    pub fn power_button(&self) -> std::result::Result<(), kumo_api::ApiError> {
        use kumo_api::ApiError;
        let ged = self.devices.ged().ok_or_else(|| {
            ApiError::conflict("this VM has no ACPI GED (its interrupt needs an IOAPIC: not with --irqchip split)")
        })?;
        lock(ged).press_power_button().map_err(|e| ApiError::internal(e.to_string()))
    }

    /// Each vCPU's host CPU now (`None`: it floats); see [`VcpuManager::vcpu_pins`].
    pub fn vcpu_pins(&self) -> Vec<Option<u32>> {
        self.vcpus.vcpu_pins()
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    pub fn memory(&self) -> &kumo_vm::GuestMemory {
        &self.vm.memory.guest
    }

    /// The KVM VM (dirty logging, memory), for migration.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The file behind guest memory.
    pub fn memfd(&self) -> &std::fs::File {
        &self.vm.memory.memfd
    }

    /// Records that the VM now runs elsewhere and stops this copy; `wait` returns
    /// `Outcome::Migrated`.
    pub fn finish_migrated(&self, to: String) {
        self.vcpus.finish(Outcome::Migrated(to));
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn is_paused(&self) -> bool {
        self.vcpus.is_paused()
    }

    /// True once the VM has stopped or been asked to (guest exit, error, shutdown).
    pub fn is_finished(&self) -> bool {
        self.vcpus.is_finished()
    }

    pub fn timings(&self) -> Timings {
        self.vcpus.timings()
    }

    /// Throttles the vCPUs (a migration's auto-converge); see [`VcpuManager::set_throttle`].
    pub fn set_throttle(&self, percent: u32) {
        self.vcpus.set_throttle(percent)
    }

    /// The current vCPU throttle, percent.
    pub fn throttle(&self) -> u32 {
        self.vcpus.throttle()
    }

    /// Stops every vCPU; returns once they are all parked. Refused while a migration runs:
    /// the migration owns the VM's run state then.
    pub fn pause(&self) -> Result<()> {
        self.pause_as(false)
    }

    fn pause_as(&self, migration: bool) -> Result<()> {
        self.vcpus.pause(migration)?;
        // With the vCPUs stopped, devices stop writing guest memory too.
        self.devices.pause();
        crate::event_monitor::vm_event("paused", serde_json::json!({"by": if migration { "vmm" } else { "user" }}));
        Ok(())
    }

    /// Lets a paused VM run again. Refused while a migration runs.
    pub fn resume(&self) -> Result<()> {
        self.resume_as(false)
    }

    fn resume_as(&self, migration: bool) -> Result<()> {
        if self.vcpus.resume(migration, || self.devices.resume())? {
            crate::event_monitor::vm_event(
                "resumed",
                serde_json::json!({"by": if migration { "vmm" } else { "user" }}),
            );
        }
        Ok(())
    }

    /// Hands the VM's run state to a migration until [`RunningVm::end_migration`]: the user's
    /// pause and resume are refused meanwhile, and a second migration too.
    pub fn begin_migration(&self) -> Result<()> {
        if self.elastic.is_some() {
            return Err(Error::Config(
                "an elastic VM (--elastic) cannot be migrated or snapshotted: its CPUs and memory are shared with other VMs on this host".into(),
            ));
        }
        if !self.zones.is_empty() {
            return Err(Error::Config(
                "a VM with memory zones (--memory-zone) cannot be migrated or snapshotted: its virtio-mem regions are not carried".into(),
            ));
        }
        self.vcpus.begin_migration()
    }

    /// Why the VM cannot be snapshotted, if a device forbids it (a vhost-user NIC).
    pub fn snapshot_blocker(&self) -> Option<String> {
        self.devices.snapshot_blocker()
    }

    /// Starts dirty logging: KVM's, and the devices' own logs (vhost-user backends).
    pub fn start_dirty_log(&self) -> Result<()> {
        self.vm.start_dirty_log()?;
        for d in self.devices.dirty_logs() {
            if let Err(e) = d.start_log() {
                self.stop_dirty_log();
                return Err(Error::Devices(e));
            }
        }
        Ok(())
    }

    /// Merges the pages written since they were last armed, KVM's and the devices', into
    /// `into` (see `Vm::harvest_dirty`: KVM's stay writable until re-armed).
    pub fn harvest_dirty(&self, into: &mut kumo_vm::dirty::PageBitmap) -> Result<u64> {
        let mut n = self.vm.harvest_dirty(into)?;
        for d in self.devices.dirty_logs() {
            n += d.fetch_log(into).map_err(Error::Devices)?;
        }
        Ok(n)
    }

    pub fn stop_dirty_log(&self) {
        for d in self.devices.dirty_logs() {
            d.stop_log();
        }
        if let Err(e) = self.vm.stop_dirty_log() {
            tracing::warn!("cannot stop dirty logging: {e}");
        }
    }

    /// A migration's stop phase (`on`) or its failure: external backends stop or restart
    /// their rings (see `DeviceManager::suspend_backends`).
    pub fn suspend_backends(&self, on: bool) -> Result<()> {
        self.devices.suspend_backends(on).map_err(Error::Devices)
    }

    /// [`RunningVm::begin_migration`] as a lease that gives the run state back when dropped,
    /// however the job ends (returned, failed early, panicked).
    pub fn lease_run_state(&self) -> Result<RunStateLease<'_>> {
        self.begin_migration()?;
        Ok(RunStateLease { vm: self, settled: false, committed: Box::new(|| false) })
    }

    /// Gives the run state back to the user.
    pub fn end_migration(&self) {
        self.vcpus.end_migration();
    }

    /// The migration's pause: a VM the user had paused already is left as it is.
    pub fn migration_pause(&self) -> Result<()> {
        if self.vcpus.paused_by_user() {
            return Ok(());
        }
        self.pause_as(true)
    }

    /// The migration's resume after a failure: a VM the user had paused stays paused.
    pub fn migration_resume(&self) -> Result<()> {
        if self.vcpus.paused_by_user() {
            return Ok(());
        }
        self.resume_as(true)
    }

    /// Whether the user had paused the VM before the running migration began.
    pub fn paused_by_user(&self) -> bool {
        self.vcpus.paused_by_user()
    }

    /// Resumes an incoming VM once its state is restored, unless it left its source paused.
    pub fn resume_incoming(&self) -> Result<()> {
        self.devices.set_taps_attached(true);
        self.resume_as(true)
    }

    /// Lets or stops frames reaching this process's tap queues (a migration's source stopping
    /// for good hands them to its destination; see `DeviceManager::set_taps_attached`).
    pub fn set_taps_attached(&self, on: bool) {
        self.devices.set_taps_attached(on);
    }

    /// Reads the state of every component: the VM-wide KVM state, each vCPU, each device. The
    /// VM must be paused.
    pub fn save_state(&self) -> Result<Snapshot> {
        self.vcpus.require_paused()?;
        let vcpus = self.vcpus.save_states()?;
        let paused = self.vcpus.paused_by_user();
        Ok(Snapshot { vm: self.vm.persist().save()?, vcpus, devices: self.devices.save_states()?, paused })
    }

    /// Puts back a state from `save_state`. The VM must be paused. A snapshot of another shape
    /// (vCPU count, devices) is refused before anything changes.
    pub fn restore_state(&self, s: &Snapshot) -> Result<()> {
        self.vcpus.require_paused()?;
        if s.vcpus.len() != self.vcpus.count() as usize {
            return Err(kumo_vm::Error::Restore(format!(
                "snapshot has {} vCPUs, VM has {}",
                s.vcpus.len(),
                self.vcpus.count()
            ))
            .into());
        }
        self.devices.check_states(&s.devices)?;
        // An arriving VM's images are locked only now: its source has let them go.
        self.devices.lock_disks(true)?;
        self.devices.restore_states(&s.devices)?;
        self.vm.persist().restore(&s.vm)?;
        self.vcpus.restore_states(&s.vcpus)?;
        self.vcpus.set_stay_paused(s.paused);
        Ok(())
    }

    /// Runs `f` on a paused vCPU (for debugging and tests).
    pub fn with_vcpu<R>(&self, id: usize, f: impl FnOnce(&Vcpu) -> R) -> Result<R> {
        self.vcpus.require_paused()?;
        self.vcpus.with_vcpu(id, f)
    }

    /// Emulation assists (instructions KVM could not emulate that kumo carried out), summed over
    /// the vCPUs. Waits for vCPUs inside KVM_RUN, so call it on a paused or finished VM.
    pub fn assist_counts(&self) -> kumo_vm::emulate::AssistCounts {
        self.vcpus.assist_counts()
    }

    /// Each vCPU's exit counters (readable while the vCPUs run).
    pub fn exit_counters(&self) -> &[Arc<kumo_vm::ExitCounters>] {
        self.vcpus.exit_counters()
    }

    /// The NICs, as `vm.info` shows them.
    pub fn nics(&self) -> Vec<kumo_api::NetInfo> {
        self.devices.nics()
    }

    /// The disks, as `vm.info` shows them.
    pub fn disks(&self) -> Vec<kumo_api::DiskInfo> {
        self.devices.disks()
    }

    /// Completes the disks' requests and flushes their images (the VM paused): a migration's
    /// stop phase, a snapshot.
    pub fn quiesce_disks(&self) -> Result<()> {
        self.devices.quiesce_disks()
    }

    /// Gives the disks' image locks up (`false`: a migration's source before its commit) or
    /// takes them (back).
    pub fn lock_disks(&self, on: bool) -> Result<()> {
        self.devices.lock_disks(on)
    }

    /// Each disk's id, image path and size.
    pub fn disk_images(&self) -> Vec<(String, std::path::PathBuf, u64)> {
        self.devices.disk_images()
    }

    /// Interrupts the shared interrupt path's dispatcher injected (None: no device uses it).
    pub fn shared_path_injected(&self) -> Option<u64> {
        self.devices.shared_path_injected()
    }

    /// Interrupts COM1 raised so far.
    pub fn serial_interrupts(&self) -> u64 {
        lock(self.devices.serial()).interrupts_raised()
    }

    /// Asks the VM to stop; `wait` then returns `Outcome::Shutdown`.
    pub fn shutdown(&self) {
        self.vcpus.finish(Outcome::Shutdown);
    }

    /// Feeds bytes to the guest's serial console; returns how many its receive FIFO took.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        self.devices.serial_input(bytes)
    }

    /// Feeds everything that arrives on `input` (a terminal, pipe or socket) to the guest's
    /// serial console from the device event loop, waiting while its FIFO is full. Refused for a
    /// descriptor epoll cannot watch (a regular file, /dev/null): read those yourself and call
    /// [`RunningVm::serial_input`].
    pub fn attach_console_input(&self, input: std::os::fd::OwnedFd) -> Result<()> {
        self.devices.attach_console_input(input)
    }

    /// Waits until the VM ends (or `timeout` passes), stops all vCPU threads and reports.
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> RunReport {
        let outcome = self.vcpus.wait(timeout);
        self.devices.flush_console();
        crate::event_monitor::vm_event("shutdown", crate::event_monitor::outcome(&outcome));
        RunReport { outcome, timings: self.timings() }
    }

    pub fn wait(&self) -> RunReport {
        self.wait_timeout(None)
    }
}

/// A migration's or snapshot's hold on the VM's run state ([`RunningVm::lease_run_state`]).
/// Dropping it gives the run state back to the user. A job that ends on its own terms calls
/// [`RunStateLease::settle`] first (it has put the VM where it should be); a lease dropped
/// unsettled (the job panicked or returned early) also undoes what the job may have left: the
/// throttle, dirty logging, and a pause the job made (a VM the user had paused stays paused),
/// except once [`RunStateLease::committed_when`] says the VM's final state may be running at a
/// destination: then it stays paused for the user to decide, as after an unconfirmed migration.
pub struct RunStateLease<'a> {
    vm: &'a RunningVm,
    settled: bool,
    committed: Box<dyn Fn() -> bool + 'a>,
}

impl RunStateLease<'_> {
    /// The job has left the VM as it should be: dropping only gives the run state back.
    pub fn settle(&mut self) {
        self.settled = true;
    }
}

impl<'a> RunStateLease<'a> {
    /// How to tell that the VM's state has gone to a destination (a migration's commit).
    pub fn committed_when(&mut self, f: impl Fn() -> bool + 'a) {
        self.committed = Box::new(f);
    }
}

impl Drop for RunStateLease<'_> {
    fn drop(&mut self) {
        let vm = self.vm;
        if !self.settled {
            tracing::warn!("a migration or snapshot ended without settling: giving the VM back as it was");
            vm.set_throttle(0);
            if let Err(e) = vm.vm.stop_dirty_log() {
                tracing::warn!("cannot stop dirty logging: {e}");
            }
            if (self.committed)() {
                tracing::error!("the VM stays paused: its final state went out and may run at the destination");
            } else if vm.is_paused() && !vm.paused_by_user() && !vm.is_finished() {
                vm.set_taps_attached(true);
                if let Err(e) = vm.migration_resume() {
                    tracing::error!("cannot resume the VM: {e}");
                }
            }
        }
        vm.end_migration();
    }
}

impl RunningVm {
    /// `vm.release` (elastic sharing).
    pub fn elastic_release(
        &self,
        req: &kumo_api::ReleaseRequest,
    ) -> std::result::Result<kumo_api::Released, ElasticError> {
        if self.elastic.is_none() && !self.zones.is_empty() {
            return self.zones.release(req);
        }
        self.elastic_side()?.release(&self.vcpus, req)
    }

    /// `vm.acquire` (elastic sharing).
    pub fn elastic_acquire(
        &self,
        req: &kumo_api::AcquireRequest,
    ) -> std::result::Result<kumo_api::Acquired, ElasticError> {
        if self.elastic.is_none() && !self.zones.is_empty() {
            return self.zones.acquire(req);
        }
        self.elastic_side()?.acquire(&self.vcpus, req)
    }

    /// Names this VM by its API socket (canonical path), as `kumo lend` names it to other VMs.
    pub fn set_api_name(&self, socket: &std::path::Path) {
        let name = std::fs::canonicalize(socket).unwrap_or_else(|_| socket.to_path_buf());
        let _ = self.api_name.set(name.display().to_string());
    }

    pub fn api_name(&self) -> Option<String> {
        self.api_name.get().cloned()
    }

    /// `vm.elastic`.
    pub fn elastic_info(&self) -> std::result::Result<kumo_api::ElasticInfo, ElasticError> {
        if self.elastic.is_none() && !self.zones.is_empty() {
            return Ok(self.zones.elastic_info());
        }
        Ok(self.elastic_side()?.info())
    }

    /// `vm.resize-zone`: a memory zone's new requested size.
    pub fn resize_zone(&self, r: &kumo_api::ResizeZoneRequest) -> std::result::Result<(), kumo_api::ApiError> {
        self.zones.resize(&r.id, r.desired_size)
    }

    /// The memory zones, as `vm.info` shows them.
    pub fn memory_zones(&self) -> Vec<kumo_api::MemoryZoneInfo> {
        self.zones.info()
    }

    fn elastic_side(&self) -> std::result::Result<&ElasticVm, ElasticError> {
        self.elastic
            .as_ref()
            .ok_or_else(|| ElasticError::Conflict("the VM was started without --elastic or --memory-zone".into()))
    }
}

/// This VM as one side of a lend run by its own VMM (`vm.lend`), named by its API socket as
/// the other VM's record names it.
pub struct LocalPeer<'a>(pub &'a RunningVm);

impl kumo_elastic::lend::Peer for LocalPeer<'_> {
    fn name(&self) -> String {
        self.0.api_name().unwrap_or_else(|| format!("kumo pid {}", std::process::id()))
    }
    fn release(&self, req: &kumo_api::ReleaseRequest) -> std::result::Result<kumo_api::Released, String> {
        self.0.elastic_release(req).map_err(|e| e.to_string())
    }
    fn acquire(&self, req: &kumo_api::AcquireRequest) -> std::result::Result<kumo_api::Acquired, String> {
        self.0.elastic_acquire(req).map_err(|e| e.to_string())
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        self.vcpus.finish(Outcome::Shutdown);
        self.vcpus.stop_threads();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::panics::OnPanic;
    use crate::vcpu_manager::{for_tests, VcpuRunState};

    #[test]
    fn a_panic_is_the_stop_reason_unless_the_vm_had_ended_already() {
        let p = kumo_sandbox::ThreadPanic {
            kind: kumo_sandbox::ThreadKind::Device,
            thread: "devices".into(),
            message: "boom".into(),
        };
        let m = for_tests(1, VcpuRunState::Stopped);
        m.panicked(&p);
        assert!(m.is_finished());
        let o = m.wait(None);
        assert_eq!(o, Outcome::Panicked("device thread devices panicked: boom".into()));
        assert_eq!(o.exit_code(), 101);
        let m = for_tests(1, VcpuRunState::Stopped);
        m.finish(Outcome::GuestExit(0));
        m.panicked(&p);
        assert_eq!(m.wait(None), Outcome::GuestExit(0), "the first outcome wins");
    }
}
