//! A running VM: vCPU threads and their control. Devices are the device manager's
//! (`device_manager`); this module builds the VM, loads its payload and runs the vCPUs.
//!
//! Each vCPU thread loops on KVM_RUN. Control requests (pause, stop) are published in an atomic
//! and a mutex-protected record; a thread parks on a condition variable when it sees one. To get
//! a thread out of KVM_RUN (e.g. a halted guest), it is sent a signal, resent until it parks:
//! a signal that lands between the request check and KVM_RUN would otherwise be lost.

use kumo_sandbox::ThreadKind;
use std::io::{Cursor, Write};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kumo_devices::Persist;
use kumo_devices::{Buses, DeviceEvent};
use kumo_vm::boot::linux::{load_linux, LinuxBootConfig, LinuxEntry};
use kumo_vm::boot::{write_gdt, write_page_tables, Entry, KumoBootInfo};
use kumo_vm::layout::HIMEM_START;
use kumo_vm::{Vcpu, VcpuRun, Vm};
use linux_loader_shim::load_elf;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::config::{Payload, VmConfig, DEFAULT_LINUX_CMDLINE};
use crate::device_manager::DeviceManager;
pub use crate::persist::Snapshot;
use crate::{Error, Result};

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes, for start-up timings.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// How a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The guest wrote this code to the exit port.
    GuestExit(u32),
    /// Shut down through the API (or `RunningVm::shutdown`).
    Shutdown,
    /// The guest powered off.
    PowerOff,
    /// The guest reset or triple-faulted.
    Reset(String),
    /// A vCPU stopped on an error (emulation failure, KVM error).
    Error(String),
    /// `wait_timeout` ran out.
    TimedOut,
    /// The VM was migrated to another kumo (named here) and this copy stopped.
    Migrated(String),
    /// A kumo thread panicked (its kind, name and message): a bug, so the VM was stopped.
    Panicked(String),
}

impl Outcome {
    /// Process exit status for `kumo run`.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::GuestExit(c) => (*c).min(255) as i32,
            Outcome::Shutdown | Outcome::PowerOff | Outcome::Migrated(_) => 0,
            Outcome::Reset(_) | Outcome::Error(_) => 1,
            Outcome::TimedOut => 124,
            // As a Rust program that panics exits.
            Outcome::Panicked(_) => 101,
        }
    }
}

/// Start-up timestamps (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Timings {
    /// When `RunningVm::start` began.
    pub start_ns: u64,
    /// When vCPUs were about to enter the guest for the first time.
    pub vcpus_started_ns: Option<u64>,
    /// When the guest signalled its entry (marker 1 on port 0x502).
    pub guest_entry_ns: Option<u64>,
    /// When the guest wrote its first serial byte.
    pub first_output_ns: Option<u64>,
}

#[derive(Debug)]
pub struct RunReport {
    pub outcome: Outcome,
    pub timings: Timings,
}

/// The vCPU throttle's period: a throttled vCPU sleeps its share of each.
const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

const RUN: u8 = 0;
const PAUSE: u8 = 1;
const STOP: u8 = 2;

struct Control {
    parked: u32,
    live: u32,
    outcome: Option<Outcome>,
    paused: bool,
    /// A migration owns the VM's run state: the user's pause and resume are refused.
    migrating: bool,
    /// The user had paused the VM when the migration began: the migration neither resumes it
    /// on failure nor lets it run at the destination.
    user_paused: bool,
    /// Restored from a snapshot of a user-paused VM: resuming after restore keeps it paused.
    stay_paused: bool,
    /// Each vCPU thread is out of KVM_RUN, waiting (paused or parked by elastic sharing).
    vcpu_parked: Vec<bool>,
}

struct Shared {
    /// vCPU throttle, percent of each [`THROTTLE_PERIOD`] the vCPUs spend asleep (0: none).
    throttle: AtomicU32,
    /// Whether the throttle thread runs.
    throttler: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    request: AtomicU8,
    ctl: Mutex<Control>,
    cv: Condvar,
    timings: Mutex<Timings>,
    /// Each vCPU thread's kernel thread id, once it has started: `vm.pin` sets its affinity.
    vcpu_tids: Mutex<Vec<Option<i32>>>,
    /// Where an unpinned vCPU runs: the VMM's affinity when the VM was built.
    float_cpus: Vec<u32>,
    /// `--irqchip user`: kumo's APICs; a halted vCPU waits on its own.
    uapic: Option<Arc<kumo_vm::uapic::UserApics>>,
    /// Elastic sharing parks single vCPUs: a parked vCPU's thread waits in kumo until unparked,
    /// whatever the VM's run state.
    parks: Vec<AtomicBool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Parks while paused, or while this vCPU is parked. Returns false when the thread should
    /// exit.
    fn wait_runnable(&self, id: usize) -> bool {
        let parked_alone = || self.parks.get(id).is_some_and(|p| p.load(Ordering::Acquire));
        if self.request.load(Ordering::Acquire) == RUN && !parked_alone() {
            return true;
        }
        let mut c = lock(&self.ctl);
        let mut parked = false;
        loop {
            let r = self.request.load(Ordering::Acquire);
            if r == PAUSE || (r == RUN && parked_alone()) {
                if !parked {
                    parked = true;
                    c.parked += 1;
                    c.vcpu_parked[id] = true;
                    self.cv.notify_all();
                }
                c = self.cv.wait(c).unwrap_or_else(|p| p.into_inner());
            } else {
                if parked {
                    c.parked -= 1;
                    c.vcpu_parked[id] = false;
                }
                return r == RUN;
            }
        }
    }

    /// Records how the VM ended (the first report wins) and asks every vCPU to stop.
    fn finish(&self, outcome: Outcome) {
        let mut c = lock(&self.ctl);
        c.outcome.get_or_insert(outcome);
        self.request.store(STOP, Ordering::Release);
        self.cv.notify_all();
    }

    /// Sends the kick signal to every vCPU thread still running.
    fn kick_all(&self) {
        let sig = kick_signal();
        for t in lock(&self.threads).iter().filter(|t| !t.is_finished()) {
            let _ = t.kill(sig);
        }
        if let Some(u) = &self.uapic {
            u.wake_all();
        }
    }

    fn mark(&self, marker: u8) {
        if marker == 1 {
            lock(&self.timings).guest_entry_ns.get_or_insert_with(monotonic_ns);
        }
    }
}

impl crate::panics::OnPanic for Shared {
    fn panicked(&self, p: &kumo_sandbox::ThreadPanic) {
        self.finish(Outcome::Panicked(p.to_string()));
    }
}

/// Held by a vCPU thread while it runs: whether it returns or unwinds, it leaves the live
/// count (pause and stop wait on it) and clears its thread id and parked mark.
struct VcpuAlive<'a> {
    shared: &'a Shared,
    id: u32,
}

impl Drop for VcpuAlive<'_> {
    fn drop(&mut self) {
        set_tid(self.shared, self.id, None);
        let mut c = lock(&self.shared.ctl);
        c.live = c.live.saturating_sub(1);
        if let Some(parked) = c.vcpu_parked.get_mut(self.id as usize) {
            if std::mem::take(parked) {
                c.parked = c.parked.saturating_sub(1);
            }
        }
        self.shared.cv.notify_all();
    }
}

/// The console sink: line-buffered, and notes when the first byte arrived.
struct TimedSink {
    out: Box<dyn Write + Send>,
    shared: Arc<Shared>,
    seen: bool,
    line: Vec<u8>,
}

impl Write for TimedSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.seen && !buf.is_empty() {
            self.seen = true;
            lock(&self.shared.timings).first_output_ns.get_or_insert_with(monotonic_ns);
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

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // With kumo's APIC, a kick just before KVM_RUN must still end it.
    kumo_vm::vcpu::on_kick_signal();
}

/// The signal that kicks a vCPU out of KVM_RUN (its handler is installed by
/// [`install_kick_signal`] before any vCPU thread starts).
fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the kick signal's handler, once per process; a failure fails the VM's start.
fn install_kick_signal() -> Result<()> {
    static INIT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    // The handler's only purpose is to make KVM_RUN return EINTR (and, with kumo's APIC, to end
    // a KVM_RUN that a kick just missed).
    let r = INIT.get_or_init(|| register_signal_handler(SIGRTMIN(), kick_handler).map_err(|e| e.to_string()));
    r.clone().map_err(|e| Error::Thread(std::io::Error::other(format!("cannot install the vCPU kick signal: {e}"))))
}

pub struct RunningVm {
    vm: Vm,
    config: VmConfig,
    vcpus: Vec<Arc<Mutex<Vcpu>>>,
    shared: Arc<Shared>,
    devices: DeviceManager,
    started: Instant,
    /// Each vCPU's exit counters, read without waiting for the vCPU (`crate::counters`).
    exits: Vec<Arc<kumo_vm::ExitCounters>>,
    /// `--elastic`: the guest channel and what the VM holds.
    elastic: Option<crate::elastic::ElasticVm>,
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
        let end = kumo_guests::image_end(elf).map_err(Error::Load)?;
        Ok((r.kernel_load.0, end.max(r.kernel_end)))
    }
}

impl RunningVm {
    /// Builds the VM, loads its payload and starts every vCPU. Console output goes to `serial`.
    pub fn start(config: VmConfig, serial: Box<dyn Write + Send>) -> Result<RunningVm> {
        Self::build(config, serial, false, None)
    }

    /// Builds a VM of `config`'s shape for an incoming migration: memory empty, payload not
    /// loaded, every vCPU thread parked (the VM is paused) until its state is restored and it
    /// is resumed. With `memfd`, guest memory is that file (a local migration shares it).
    pub fn incoming(
        config: VmConfig,
        serial: Box<dyn Write + Send>,
        memfd: Option<std::fs::File>,
    ) -> Result<RunningVm> {
        Self::build(config, serial, true, memfd)
    }

    fn build(
        mut config: VmConfig,
        serial: Box<dyn Write + Send>,
        incoming: bool,
        memfd: Option<std::fs::File>,
    ) -> Result<RunningVm> {
        let start_ns = monotonic_ns();
        if incoming {
            config.validate_arriving()?;
        } else {
            config.validate()?;
        }
        let numa = config.numa_topology()?;
        // Elastic memory is anonymous huge pages (fast to discard), the rest the memfd.
        let areas = match &config.elastic {
            Some(_) if incoming => return Err(Error::Config("an elastic VM cannot arrive by migration".into())),
            Some(e) => {
                config.host.pins = e.pins(config.cpus);
                let layout = kumo_vm::layout::MemoryLayout::new(config.memory);
                crate::elastic::plan_areas(e, &layout, config.numa.as_ref().zip(numa.as_ref()))?
            }
            None => Vec::new(),
        };
        let vm = match memfd {
            Some(f) => Vm::with_memory(config.cpus, kumo_vm::Memory::from_file(f, config.memory)?, config.irqchip)?,
            None if !areas.is_empty() => {
                let anon: Vec<(u64, u64)> = areas.iter().map(|a| (a.gpa, a.len)).collect();
                Vm::with_memory(config.cpus, kumo_vm::Memory::with_anonymous(config.memory, &anon)?, config.irqchip)?
            }
            None => Vm::new(config.cpus, config.memory, config.irqchip)?,
        };
        crate::placement::set_halt_polling(&vm, &config.host, config.elastic.is_some())?;
        let mem = &vm.memory.guest;
        let layout = &vm.memory.layout;
        // Before anything is written: the guest's pages are then faulted on their host node.
        if let (Some(n), Some(t)) = (&config.numa, &numa) {
            for (gpa, len, node) in n.bindings(t) {
                kumo_vm::memory::bind_to_host_node(mem, gpa, len, node)?;
            }
        }
        // An incoming VM's memory comes from the source (for a local migration it *is* the
        // source's memory): writing boot structures would clobber the guest.
        if !incoming {
            write_gdt(mem, config.cpus)?;
            write_page_tables(mem, layout.ram_end())?;
        }

        let shared = Arc::new(Shared {
            throttle: AtomicU32::new(0),
            throttler: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            request: AtomicU8::new(if incoming { PAUSE } else { RUN }),
            ctl: Mutex::new(Control {
                parked: 0,
                live: 0,
                outcome: None,
                paused: incoming,
                migrating: false,
                user_paused: false,
                stay_paused: false,
                vcpu_parked: vec![false; config.cpus as usize],
            }),
            cv: Condvar::new(),
            timings: Mutex::new(Timings { start_ns, ..Default::default() }),
            vcpu_tids: Mutex::new(vec![None; config.cpus as usize]),
            float_cpus: kumo_vm::sched::thread_affinity().unwrap_or_default(),
            uapic: vm.uapic.clone(),
            parks: (0..config.cpus)
                .map(|v| AtomicBool::new(config.elastic.as_ref().is_some_and(|e| e.spares(config.cpus).contains(&v))))
                .collect(),
        });

        crate::panics::register(Arc::downgrade(&shared) as std::sync::Weak<dyn crate::panics::OnPanic>);

        // PV features: resolved once and stored fully set, so a migration stream carries the
        // guest's CPUID as it is here (the destination's pins do not change it).
        let (pv, dedicated) =
            crate::placement::pv_features(&config.pv, &config.host.pins, config.cpus, config.irqchip, &vm.kvm)?;
        config.pv = kumo_vm::pv::PvRequest::from_set(pv);
        tracing::info!(pv = %pv.describe(), dedicated, "paravirtual features");
        let vcpus: Vec<Vcpu> = (0..config.cpus).map(|i| vm.create_vcpu(i)).collect::<kumo_vm::Result<_>>()?;
        let entries: Vec<Option<Entry>> = match &config.payload {
            // Memory and registers arrive with the migration stream.
            _ if incoming => vec![None; config.cpus as usize],
            Payload::Guest { name, args } => {
                let guest = kumo_guests::find(name)?;
                let cmdline = guest.command_line(args)?;
                let (rip, end) = load_elf(mem, guest.elf)?;
                // Elastic memory is not the guest's to allocate from until it is plugged.
                let free_end = areas.iter().map(|a| a.gpa).fold(layout.low_ram_end(), u64::min);
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
                vec![Some(Entry::KumoGuest { rip }); config.cpus as usize]
            }
            Payload::Kernel { path, initrd, cmdline } => {
                let cfg = LinuxBootConfig {
                    kernel: path,
                    initrd: initrd.as_deref(),
                    cmdline: cmdline.as_deref().unwrap_or(DEFAULT_LINUX_CMDLINE),
                    layout,
                };
                let entry = match load_linux(mem, &cfg).map_err(kumo_vm::Error::from)? {
                    LinuxEntry::BzImage64 { entry, boot_params } => Entry::Linux64 { rip: entry, boot_params },
                    LinuxEntry::Pvh { entry, start_info } => Entry::Pvh { rip: entry, start_info },
                };
                // APs wait for the kernel's INIT/SIPI.
                std::iter::once(Some(entry)).chain(std::iter::repeat(None)).take(config.cpus as usize).collect()
            }
        };
        for (v, e) in vcpus.iter().zip(&entries) {
            v.configure(&vm.kvm, config.cpus, *e, &pv)?;
        }

        let elastic = match &config.elastic {
            Some(e) => {
                let node_of = |v: u32| {
                    let (n, t) = (config.numa.as_ref()?, numa.as_ref()?);
                    let id = t.nodes.iter().find(|node| node.cpus.contains(&v))?.id;
                    n.nodes.iter().find(|s| s.id == id)?.host_node
                };
                let vcpu_host_node = (0..config.cpus).map(node_of).collect();
                Some(crate::elastic::ElasticVm::new(&vm, e, &areas, config.cpus, vcpu_host_node)?)
            }
            None => None,
        };
        let sink = TimedSink { out: serial, shared: shared.clone(), seen: false, line: Vec::new() };
        let devices = DeviceManager::new(&vm, Box::new(sink), &config.net)?;
        if !incoming {
            crate::acpi::install(&vm, &devices, entries[0], numa.as_ref())?;
        }
        if incoming {
            devices.pause();
            devices.set_taps_attached(false);
        }

        let exits = vcpus.iter().map(|v| v.exit_counters()).collect();
        let vcpus: Vec<_> = vcpus.into_iter().map(|v| Arc::new(Mutex::new(v))).collect();
        let vm = RunningVm {
            vm,
            config,
            vcpus,
            shared,
            devices,
            started: Instant::now(),
            exits,
            elastic,
            api_name: Default::default(),
        };
        install_kick_signal()?; // before any vCPU thread can be kicked
        lock(&vm.shared.timings).vcpus_started_ns = Some(monotonic_ns());
        // The vCPUs a NIC's dedicated interrupt path names run prioritized (seed 000).
        let dedicated: Vec<u32> = vm
            .config
            .net
            .iter()
            .filter_map(|n| match n.irq {
                kumo_vm::interrupt_paths::IrqPath::Dedicated { vcpu } => Some(vcpu),
                _ => None,
            })
            .collect();
        for v in &vm.vcpus {
            let (v, bus, sh) = (v.clone(), vm.devices.buses().clone(), vm.shared.clone());
            let id = lock(&v).id;
            let prioritized = dedicated.contains(&id);
            let pin = vm.config.host.pins.get(id as usize).copied().flatten();
            lock(&vm.shared.ctl).live += 1;
            let t = kumo_sandbox::spawn(ThreadKind::Vcpu, format!("vcpu{id}"), move || {
                if let Some(cpu) = pin {
                    if let Err(e) = kumo_vm::sched::pin_thread(cpu) {
                        tracing::warn!("vCPU {id} not pinned to host CPU {cpu}: {e}");
                    }
                }
                if prioritized {
                    kumo_vm::interrupt_paths::prioritize_this_thread(&format!("vCPU {id}"));
                }
                // After the start pin, so a vm.pin that finds the tid wins over it; cleared
                // at exit (by `VcpuAlive`) so a reused tid is never re-pinned.
                set_tid(&sh, id, Some(kumo_vm::sched::this_tid()));
                // A panic stops this VM itself (whatever the process's handler does), with the
                // message the thread's guard reports too.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vcpu_thread(v, bus, &sh)));
                if let Err(payload) = run {
                    let message = kumo_sandbox::thread::panic_message(&*payload);
                    let p = kumo_sandbox::ThreadPanic { kind: ThreadKind::Vcpu, thread: format!("vcpu{id}"), message };
                    sh.finish(Outcome::Panicked(p.to_string()));
                    std::panic::resume_unwind(payload);
                }
            })
            .map_err(Error::Thread);
            match t {
                Ok(t) => lock(&vm.shared.threads).push(t),
                Err(e) => {
                    lock(&vm.shared.ctl).live -= 1;
                    vm.shared.finish(Outcome::Error(e.to_string()));
                    vm.stop_threads();
                    return Err(e);
                }
            }
        }
        if !incoming {
            crate::event_monitor::vm_event(
                "booted",
                serde_json::json!({"cpus": vm.config.cpus, "memory_bytes": vm.config.memory}),
            );
        }
        Ok(vm)
    }

    /// Pins vCPU `vcpu` to host CPU `cpu` (`None`: unpins it, it floats over the CPUs the VMM
    /// had at start), running or paused: its thread's affinity is set by tid, so the vCPU need
    /// not be woken. Errors are one line, for a 400 (bad vCPU or CPU) or 409 (no thread).
    pub fn pin_vcpu(&self, vcpu: u32, cpu: Option<u32>) -> std::result::Result<(), PinError> {
        use crate::placement::{format_cpulist, HostTopology};
        if vcpu >= self.config.cpus {
            return Err(PinError::Bad(format!("vCPU {vcpu} does not exist (the VM has {} vCPUs)", self.config.cpus)));
        }
        let cpus = match cpu {
            Some(h) => {
                let online = HostTopology::read_live()
                    .map(|t| t.online_cpus())
                    .map_err(|e| PinError::Failed(format!("cannot read the host's CPUs: {e}")))?;
                if !online.contains(&h) {
                    return Err(PinError::Bad(format!(
                        "host CPU {h} is not online (online: {})",
                        format_cpulist(&online)
                    )));
                }
                vec![h]
            }
            None => self.shared.float_cpus.clone(),
        };
        self.set_vcpu_affinity(vcpu, &cpus)
    }

    /// Sets vCPU `vcpu`'s thread's affinity to `cpus`, by its thread id.
    fn set_vcpu_affinity(&self, vcpu: u32, cpus: &[u32]) -> std::result::Result<(), PinError> {
        // Held while the affinity is set: an exiting thread clears its tid first, so a reused
        // tid is never re-pinned.
        let tids = lock(&self.shared.vcpu_tids);
        let tid = tids
            .get(vcpu as usize)
            .copied()
            .flatten()
            .ok_or_else(|| PinError::NoThread(format!("vCPU {vcpu} has no running thread")))?;
        kumo_vm::sched::set_affinity(tid, cpus).map_err(|e| PinError::Failed(format!("cannot pin vCPU {vcpu}: {e}")))
    }

    /// Each vCPU's host CPU as its thread's affinity reads now: `Some(cpu)` when it may run on
    /// one CPU only, `None` when it floats (or has no thread).
    pub fn vcpu_pins(&self) -> Vec<Option<u32>> {
        lock(&self.shared.vcpu_tids)
            .iter()
            .map(|t| match t.map(kumo_vm::sched::affinity_of) {
                Some(Ok(c)) if c.len() == 1 => Some(c[0]),
                _ => None,
            })
            .collect()
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
        self.shared.finish(Outcome::Migrated(to));
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn is_paused(&self) -> bool {
        lock(&self.shared.ctl).paused
    }

    /// True once the VM has stopped or been asked to (guest exit, error, shutdown).
    pub fn is_finished(&self) -> bool {
        lock(&self.shared.ctl).outcome.is_some()
    }

    pub fn timings(&self) -> Timings {
        lock(&self.shared.timings).clone()
    }

    fn kick_all(&self) {
        self.shared.kick_all();
    }

    /// Throttles the vCPUs to `percent` of each 10 ms period asleep (0 ends it), as QEMU's
    /// auto-converge does: a guest that dirties memory faster than a migration can send it is
    /// slowed until the migration converges. A thread kicks the vCPUs out of KVM_RUN every
    /// period; each kicked vCPU sleeps its share before it re-enters.
    pub fn set_throttle(&self, percent: u32) {
        let percent = percent.min(99);
        self.shared.throttle.store(percent, Ordering::Release);
        if percent == 0 || self.shared.throttler.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = self.shared.clone();
        let spawned = kumo_sandbox::spawn(ThreadKind::Vmm, "vcpu-throttle", move || {
            loop {
                let p = shared.throttle.load(Ordering::Acquire);
                if p == 0 || shared.request.load(Ordering::Acquire) == STOP {
                    shared.throttler.store(false, Ordering::Release);
                    // A throttle set again just now must not be left without its thread.
                    if shared.throttle.load(Ordering::Acquire) == 0 || shared.throttler.swap(true, Ordering::AcqRel) {
                        return;
                    }
                    continue;
                }
                std::thread::sleep(THROTTLE_PERIOD * (100 - p) / 100);
                shared.kick_all();
            }
        });
        if let Err(e) = spawned {
            self.shared.throttler.store(false, Ordering::Release);
            tracing::warn!("cannot throttle the vCPUs: {e}");
        }
    }

    /// The current vCPU throttle, percent.
    pub fn throttle(&self) -> u32 {
        self.shared.throttle.load(Ordering::Acquire)
    }

    /// Stops every vCPU; returns once they are all parked. Refused while a migration runs:
    /// the migration owns the VM's run state then.
    pub fn pause(&self) -> Result<()> {
        self.pause_as(false)
    }

    fn pause_as(&self, migration: bool) -> Result<()> {
        {
            let c = lock(&self.shared.ctl);
            if c.outcome.is_some() {
                return Err(Error::State("shutting down"));
            }
            if c.migrating && !migration {
                return Err(Error::State("migrating (pause and resume wait until it ends)"));
            }
            if c.paused {
                return Err(Error::State("already paused"));
            }
            self.shared.request.store(PAUSE, Ordering::Release);
        }
        loop {
            self.kick_all();
            let c = lock(&self.shared.ctl);
            let (mut c, _) =
                self.shared.cv.wait_timeout(c, Duration::from_millis(2)).unwrap_or_else(|p| p.into_inner());
            if c.outcome.is_some() {
                return Err(Error::State("shutting down"));
            }
            if c.parked == c.live {
                c.paused = true;
                drop(c);
                // With the vCPUs stopped, devices stop writing guest memory too.
                self.devices.pause();
                crate::event_monitor::vm_event(
                    "paused",
                    serde_json::json!({"by": if migration { "vmm" } else { "user" }}),
                );
                return Ok(());
            }
        }
    }

    /// Lets a paused VM run again. Refused while a migration runs.
    pub fn resume(&self) -> Result<()> {
        self.resume_as(false)
    }

    fn resume_as(&self, migration: bool) -> Result<()> {
        let mut c = lock(&self.shared.ctl);
        if c.outcome.is_some() {
            return Err(Error::State("shutting down"));
        }
        if c.migrating && !migration {
            return Err(Error::State("migrating (pause and resume wait until it ends)"));
        }
        if c.stay_paused {
            // Restored from a user-paused VM: the first resume (the migration's) is not the
            // user's; it stays paused until the user resumes it.
            c.stay_paused = false;
            if migration {
                return Ok(());
            }
        }
        if !c.paused {
            return Err(Error::State("not paused"));
        }
        c.paused = false;
        self.devices.resume();
        self.shared.request.store(RUN, Ordering::Release);
        self.shared.cv.notify_all();
        drop(c);
        crate::event_monitor::vm_event("resumed", serde_json::json!({"by": if migration { "vmm" } else { "user" }}));
        Ok(())
    }

    /// Hands the VM's run state to a migration until [`RunningVm::end_migration`]: the user's
    /// pause and resume are refused meanwhile, and a second migration too.
    pub fn begin_migration(&self) -> Result<()> {
        if let Some(why) = self.devices.migration_blocker() {
            return Err(Error::Devices(why));
        }
        if self.elastic.is_some() {
            return Err(Error::Config(
                "an elastic VM (--elastic) cannot be migrated or snapshotted: its CPUs and memory are shared with other VMs on this host".into(),
            ));
        }
        let mut c = lock(&self.shared.ctl);
        if c.outcome.is_some() {
            return Err(Error::State("shutting down"));
        }
        if c.migrating {
            return Err(Error::State("already migrating"));
        }
        c.migrating = true;
        c.user_paused = c.paused;
        Ok(())
    }

    /// [`RunningVm::begin_migration`] as a lease that gives the run state back when dropped,
    /// however the job ends (returned, failed early, panicked).
    pub fn lease_run_state(&self) -> Result<RunStateLease<'_>> {
        self.begin_migration()?;
        Ok(RunStateLease { vm: self, settled: false, committed: Box::new(|| false) })
    }

    /// Gives the run state back to the user.
    pub fn end_migration(&self) {
        let mut c = lock(&self.shared.ctl);
        c.migrating = false;
        c.user_paused = false;
    }

    /// The migration's pause: a VM the user had paused already is left as it is.
    pub fn migration_pause(&self) -> Result<()> {
        if lock(&self.shared.ctl).user_paused {
            return Ok(());
        }
        self.pause_as(true)
    }

    /// The migration's resume after a failure: a VM the user had paused stays paused.
    pub fn migration_resume(&self) -> Result<()> {
        if lock(&self.shared.ctl).user_paused {
            return Ok(());
        }
        self.resume_as(true)
    }

    /// Whether the user had paused the VM before the running migration began.
    pub fn paused_by_user(&self) -> bool {
        lock(&self.shared.ctl).user_paused
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

    fn require_paused(&self) -> Result<()> {
        if lock(&self.shared.ctl).paused {
            Ok(())
        } else {
            Err(Error::State("not paused (pause it first)"))
        }
    }

    /// Reads the state of every component: the VM-wide KVM state, each vCPU, each device. The
    /// VM must be paused.
    pub fn save_state(&self) -> Result<Snapshot> {
        self.require_paused()?;
        let vcpus = self.vcpus.iter().map(|v| lock(v).save()).collect::<std::result::Result<Vec<_>, _>>()?;
        let paused = lock(&self.shared.ctl).user_paused;
        Ok(Snapshot { vm: self.vm.persist().save()?, vcpus, devices: self.devices.save_states()?, paused })
    }

    /// Puts back a state from `save_state`. The VM must be paused. A snapshot of another shape
    /// (vCPU count, devices) is refused before anything changes.
    pub fn restore_state(&self, s: &Snapshot) -> Result<()> {
        self.require_paused()?;
        if s.vcpus.len() != self.vcpus.len() {
            return Err(kumo_vm::Error::Restore(format!(
                "snapshot has {} vCPUs, VM has {}",
                s.vcpus.len(),
                self.vcpus.len()
            ))
            .into());
        }
        self.devices.check_states(&s.devices)?;
        self.devices.restore_states(&s.devices)?;
        self.vm.persist().restore(&s.vm)?;
        for (v, st) in self.vcpus.iter().zip(&s.vcpus) {
            lock(v).restore(st)?;
        }
        lock(&self.shared.ctl).stay_paused = s.paused;
        Ok(())
    }

    /// Runs `f` on a paused vCPU (for debugging and tests).
    pub fn with_vcpu<R>(&self, id: usize, f: impl FnOnce(&Vcpu) -> R) -> Result<R> {
        self.require_paused()?;
        let v = self.vcpus.get(id).ok_or(Error::State("without that vCPU"))?;
        Ok(f(&lock(v)))
    }

    /// Emulation assists (instructions KVM could not emulate that kumo carried out), summed over
    /// the vCPUs. Waits for vCPUs inside KVM_RUN, so call it on a paused or finished VM.
    pub fn assist_counts(&self) -> kumo_vm::emulate::AssistCounts {
        let mut c = kumo_vm::emulate::AssistCounts::default();
        for v in &self.vcpus {
            c.merge(&lock(v).assist_counts());
        }
        c
    }

    /// Each vCPU's exit counters (readable while the vCPUs run).
    pub fn exit_counters(&self) -> &[Arc<kumo_vm::ExitCounters>] {
        &self.exits
    }

    /// Interrupts COM1 raised so far.
    /// The NICs, as `vm.info` shows them.
    pub fn nics(&self) -> Vec<kumo_api::NetInfo> {
        self.devices.nics()
    }

    /// Interrupts the shared interrupt path's dispatcher injected (None: no device uses it).
    pub fn shared_path_injected(&self) -> Option<u64> {
        self.devices.shared_path_injected()
    }

    pub fn serial_interrupts(&self) -> u64 {
        lock(self.devices.serial()).interrupts_raised()
    }

    /// Asks the VM to stop; `wait` then returns `Outcome::Shutdown`.
    pub fn shutdown(&self) {
        self.shared.finish(Outcome::Shutdown);
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
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut c = lock(&self.shared.ctl);
        while c.outcome.is_none() {
            let step =
                deadline.map(|d| d.saturating_duration_since(Instant::now())).unwrap_or(Duration::from_secs(3600));
            if step.is_zero() {
                c.outcome = Some(Outcome::TimedOut);
                break;
            }
            c = self.shared.cv.wait_timeout(c, step).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(c);
        self.stop_threads();
        self.devices.flush_console();
        let outcome = lock(&self.shared.ctl).outcome.clone().unwrap_or(Outcome::Shutdown);
        crate::event_monitor::vm_event("shutdown", crate::event_monitor::outcome(&outcome));
        RunReport { outcome, timings: self.timings() }
    }

    pub fn wait(&self) -> RunReport {
        self.wait_timeout(None)
    }

    fn stop_threads(&self) {
        self.shared.request.store(STOP, Ordering::Release);
        self.shared.cv.notify_all();
        loop {
            self.kick_all();
            let c = lock(&self.shared.ctl);
            if c.live == 0 {
                break;
            }
            drop(self.shared.cv.wait_timeout(c, Duration::from_millis(2)));
        }
        let threads: Vec<_> = lock(&self.shared.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
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

/// How long parking a vCPU may take (it leaves KVM_RUN at the next kick, resent every 2 ms).
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

impl RunningVm {
    /// `vm.release` (elastic sharing).
    pub fn elastic_release(
        &self,
        req: &kumo_api::ReleaseRequest,
    ) -> std::result::Result<kumo_api::Released, crate::elastic::ElasticError> {
        self.elastic_side()?.release(self, req)
    }

    /// `vm.acquire` (elastic sharing).
    pub fn elastic_acquire(
        &self,
        req: &kumo_api::AcquireRequest,
    ) -> std::result::Result<kumo_api::Acquired, crate::elastic::ElasticError> {
        self.elastic_side()?.acquire(self, req)
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
    pub fn elastic_info(&self) -> std::result::Result<kumo_api::ElasticInfo, crate::elastic::ElasticError> {
        Ok(self.elastic_side()?.info())
    }

    fn elastic_side(&self) -> std::result::Result<&crate::elastic::ElasticVm, crate::elastic::ElasticError> {
        self.elastic
            .as_ref()
            .ok_or_else(|| crate::elastic::ElasticError::Conflict("the VM was started without --elastic".into()))
    }
}

impl crate::elastic::VcpuControl for RunningVm {
    fn park(&self, v: u32) -> std::result::Result<(), String> {
        let id = v as usize;
        let flag = self.shared.parks.get(id).ok_or_else(|| format!("no vCPU {v}"))?;
        flag.store(true, Ordering::Release);
        let deadline = Instant::now() + PARK_TIMEOUT;
        loop {
            {
                let c = lock(&self.shared.ctl);
                if c.vcpu_parked[id] {
                    return Ok(());
                }
                if c.outcome.is_some() {
                    return Err("the VM is stopping".into());
                }
            }
            if let Some(t) = lock(&self.shared.threads).get(id).filter(|t| !t.is_finished()) {
                let _ = t.kill(kick_signal());
            }
            // With kumo's APIC a halted vCPU waits outside KVM_RUN, where no signal reaches it.
            if let Some(u) = &self.shared.uapic {
                u.wake_all();
            }
            let c = lock(&self.shared.ctl);
            if !c.vcpu_parked[id] {
                drop(self.shared.cv.wait_timeout(c, Duration::from_millis(2)));
            }
            if Instant::now() > deadline {
                return Err(format!("vCPU {v} did not leave KVM_RUN within {} s", PARK_TIMEOUT.as_secs()));
            }
        }
    }

    fn unpark(&self, v: u32) {
        if let Some(p) = self.shared.parks.get(v as usize) {
            p.store(false, Ordering::Release);
            let _c = lock(&self.shared.ctl);
            self.shared.cv.notify_all();
        }
    }

    fn pin(&self, v: u32, cpu: Option<u32>) -> std::result::Result<(), String> {
        // No sysfs walk here (vm.pin's online check): this is on a lend's critical path, and
        // sched_setaffinity refuses a CPU that is not online anyway.
        let cpus = match cpu {
            Some(c) => vec![c],
            None => self.shared.float_cpus.clone(),
        };
        self.set_vcpu_affinity(v, &cpus).map_err(|e| e.to_string())
    }

    fn running(&self) -> std::result::Result<(), String> {
        let c = lock(&self.shared.ctl);
        if c.outcome.is_some() {
            Err("the VM is stopping".into())
        } else if c.paused {
            Err("the VM is paused (its guest cannot answer)".into())
        } else {
            Ok(())
        }
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        self.shared.finish(Outcome::Shutdown);
        self.stop_threads();
    }
}

fn set_tid(shared: &Shared, id: u32, tid: Option<i32>) {
    if let Some(t) = lock(&shared.vcpu_tids).get_mut(id as usize) {
        *t = tid;
    }
}

/// Why `vm.pin` failed.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// No such vCPU or host CPU (400).
    #[error("{0}")]
    Bad(String),
    /// The vCPU's thread is not running (409).
    #[error("{0}")]
    NoThread(String),
    #[error("{0}")]
    Failed(String),
}

/// The test hook `panic:vcpu`: vCPU 0 panics on this exit, once the guest has run a while
/// (booted and printed).
const PANIC_HOOK_EXITS: u64 = 2000;

fn vcpu_thread(vcpu: Arc<Mutex<Vcpu>>, bus: Arc<Buses>, shared: &Shared) {
    let id = lock(&vcpu).id;
    let _alive = VcpuAlive { shared, id };
    let mut panic_at = (id == 0 && kumo_sandbox::test_hook("panic:vcpu")).then_some(PANIC_HOOK_EXITS);
    while shared.wait_runnable(id as usize) {
        let r = lock(&vcpu).run(&bus);
        if let Some(n) = panic_at.as_mut() {
            *n -= 1;
            if *n == 0 {
                panic!("test hook panic:vcpu: vCPU {id} panics on purpose");
            }
        }
        match r {
            Ok(VcpuRun::Continue) => {}
            Ok(VcpuRun::Interrupted) => {
                // Kicked by the throttle (or a pause/stop request, which wait_runnable sees).
                let p = shared.throttle.load(Ordering::Acquire);
                if p > 0 && shared.request.load(Ordering::Acquire) == RUN {
                    std::thread::sleep(THROTTLE_PERIOD * p / 100);
                }
            }
            Ok(VcpuRun::Device(DeviceEvent::GuestExit(code))) => shared.finish(Outcome::GuestExit(code)),
            Ok(VcpuRun::Device(DeviceEvent::Marker(m))) => shared.mark(m),
            // With KVM's LAPIC, HLT only exits here if KVM chose not to park the vCPU itself.
            Ok(VcpuRun::Halted) => match &shared.uapic {
                // kumo's APIC: wait for an interrupt (or a pause/stop request, or a park).
                Some(u) => u.halt(id, || {
                    shared.request.load(Ordering::Acquire) != RUN || shared.parks[id as usize].load(Ordering::Acquire)
                }),
                None => std::thread::sleep(Duration::from_micros(100)),
            },
            Ok(VcpuRun::Reset(why)) => shared.finish(Outcome::Reset(why)),
            Ok(VcpuRun::PowerOff) => shared.finish(Outcome::PowerOff),
            Err(e) => shared.finish(Outcome::Error(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::panics::OnPanic;

    fn shared(cpus: usize) -> Shared {
        Shared {
            throttle: AtomicU32::new(0),
            throttler: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            request: AtomicU8::new(RUN),
            ctl: Mutex::new(Control {
                parked: 0,
                live: cpus as u32,
                outcome: None,
                paused: false,
                migrating: false,
                user_paused: false,
                stay_paused: false,
                vcpu_parked: vec![false; cpus],
            }),
            cv: Condvar::new(),
            timings: Mutex::new(Timings::default()),
            vcpu_tids: Mutex::new(vec![Some(1); cpus]),
            float_cpus: Vec::new(),
            uapic: None,
            parks: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    #[test]
    fn a_vcpu_thread_that_unwinds_leaves_the_live_count_and_its_park() {
        let sh = shared(2);
        {
            let mut c = lock(&sh.ctl);
            c.parked = 1;
            c.vcpu_parked[1] = true;
        }
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let _alive = VcpuAlive { shared: &sh, id: 1 };
                panic!("vCPU bug (expected by the test)");
            });
            assert!(t.join().is_err());
        });
        let c = lock(&sh.ctl);
        assert_eq!((c.live, c.parked, c.vcpu_parked[1]), (1, 0, false));
        assert_eq!(lock(&sh.vcpu_tids)[1], None, "its tid is cleared, so vm.pin cannot reach a reused one");
        drop(c);
        // The other one returns normally.
        drop(VcpuAlive { shared: &sh, id: 0 });
        assert_eq!(lock(&sh.ctl).live, 0, "stop_threads' wait ends");
    }

    #[test]
    fn a_panic_is_the_stop_reason_unless_the_vm_had_ended_already() {
        let sh = shared(1);
        let p = kumo_sandbox::ThreadPanic {
            kind: kumo_sandbox::ThreadKind::Device,
            thread: "devices".into(),
            message: "boom".into(),
        };
        sh.panicked(&p);
        assert_eq!(sh.request.load(Ordering::Acquire), STOP);
        let o = lock(&sh.ctl).outcome.clone().unwrap();
        assert_eq!(o, Outcome::Panicked("device thread devices panicked: boom".into()));
        assert_eq!(o.exit_code(), 101);
        let sh = shared(1);
        sh.finish(Outcome::GuestExit(0));
        sh.panicked(&p);
        assert_eq!(lock(&sh.ctl).outcome, Some(Outcome::GuestExit(0)), "the first outcome wins");
    }
}
