//! The vCPU manager: a VM's vCPUs, their threads and their run state, in one place. Each vCPU
//! is in one [`VcpuRunState`] (created, running, paused, parked, stopped); the manager owns the
//! VM-wide requests (run, pause, stop), the park elastic sharing puts on single vCPUs, the kick
//! that gets a thread out of KVM_RUN, the migration throttle and the vCPUs' host CPU pins.
//! `RunningVm` (`crate::vmm`) holds one and adds the devices and lifecycle events around it;
//! `crate::elastic` parks, unparks and pins vCPUs through it.
//!
//! Each vCPU thread loops on KVM_RUN. A request (pause, stop) is published in an atomic and the
//! mutex-protected control record; a thread waits on a condition variable when it sees one. To
//! get a thread out of KVM_RUN (e.g. a halted guest), it is sent a signal, resent until it
//! waits: a signal that lands between the request check and KVM_RUN would otherwise be lost.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kumo_devices::{Buses, DeviceEvent, Persist};
use kumo_sandbox::{lock, ThreadKind};
use kumo_vm::{Vcpu, VcpuRun};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

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

/// Where one vCPU is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VcpuRunState {
    /// Created in KVM; its thread has not entered its run loop yet.
    Created,
    /// In or around KVM_RUN.
    Running,
    /// Out of KVM_RUN, waiting in kumo while the VM is paused.
    Paused,
    /// Out of KVM_RUN, waiting in kumo alone (elastic sharing), whatever the VM's run state.
    Parked,
    /// Its thread has ended (returned or unwound), or will never start.
    Stopped,
}

impl VcpuRunState {
    /// Out of KVM_RUN and waiting in kumo.
    fn waiting(self) -> bool {
        matches!(self, VcpuRunState::Paused | VcpuRunState::Parked)
    }

    /// Its thread runs (or is about to): a stop waits for it.
    fn live(self) -> bool {
        matches!(self, VcpuRunState::Running | VcpuRunState::Paused | VcpuRunState::Parked)
    }
}

/// Why `vm.pin` failed.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// No such vCPU or host CPU.
    #[error("{0}")]
    Bad(String),
    /// The vCPU's thread is not running.
    #[error("{0}")]
    NoThread(String),
    #[error("{0}")]
    Failed(String),
}

/// The vCPU throttle's period: a throttled vCPU sleeps its share of each.
const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

/// How long parking a vCPU may take (it leaves KVM_RUN at the next kick).
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a kick is resent while a thread has not answered it.
const KICK_RESEND: Duration = Duration::from_millis(2);

/// The test hook `panic:vcpu`: vCPU 0 panics on this exit, once the guest has run a while
/// (booted and printed).
const PANIC_HOOK_EXITS: u64 = 2000;

const RUN: u8 = 0;
const PAUSE: u8 = 1;
const STOP: u8 = 2;

/// The run state behind the manager's mutex.
struct Control {
    /// Each vCPU's state.
    vcpus: Vec<VcpuRunState>,
    /// How the VM ended, once it has (the first report wins).
    outcome: Option<Outcome>,
    paused: bool,
    /// A migration owns the VM's run state: the user's pause and resume are refused.
    migrating: bool,
    /// The user had paused the VM when the migration began: the migration neither resumes it
    /// on failure nor lets it run at the destination.
    user_paused: bool,
    /// Restored from a snapshot of a user-paused VM: resuming after restore keeps it paused.
    stay_paused: bool,
}

/// How a VM's vCPUs start.
pub struct VcpuSetup {
    /// Paused from the start (an incoming VM: its state is restored, then it is resumed).
    pub paused: bool,
    /// vCPUs parked from the start (an elastic VM's spares).
    pub parked: Vec<u32>,
    /// `--irqchip user`: kumo's APICs; a halted vCPU waits on its own.
    pub uapic: Option<Arc<kumo_vm::uapic::UserApics>>,
    /// When the VM's build began (CLOCK_MONOTONIC ns).
    pub start_ns: u64,
}

/// A VM's vCPUs, their threads and their run state.
pub struct VcpuManager {
    vcpus: Vec<Arc<Mutex<Vcpu>>>,
    /// Each vCPU's exit counters, read without waiting for the vCPU (`crate::counters`).
    exits: Vec<Arc<kumo_vm::ExitCounters>>,
    /// RUN, PAUSE or STOP: read by each thread before every KVM_RUN.
    request: AtomicU8,
    ctl: Mutex<Control>,
    /// What waits on `ctl`, each woken only by what concerns it: a change wakes no thread
    /// that would only look and sleep again (on a host whose CPUs run spinning vCPUs, each such
    /// wake-up waited a scheduler slice, and one that held `ctl` when preempted held up the
    /// real-time thread waiting for it). `run_cv[v]`: vCPU `v`'s thread, waiting to run;
    /// `state_cv`: threads waiting for vCPUs' states (pause, park, stop); `end_cv`: the wait
    /// for the VM's end.
    run_cv: Vec<Condvar>,
    state_cv: Condvar,
    end_cv: Condvar,
    /// The vCPU threads, in vCPU order.
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Each vCPU thread's kernel thread id, while it runs: pins set its affinity by tid.
    tids: Mutex<Vec<Option<i32>>>,
    /// Where an unpinned vCPU runs: the VMM process's CPUs (`kumo_sandbox::cpus::process_cpus`),
    /// not the building thread's, which may be an I/O thread kept off an earlier VM's pins.
    float_cpus: Vec<u32>,
    uapic: Option<Arc<kumo_vm::uapic::UserApics>>,
    /// Park requests: a vCPU asked to park waits in kumo until unparked.
    parks: Vec<AtomicBool>,
    /// vCPU throttle, percent of each [`THROTTLE_PERIOD`] the vCPUs spend asleep (0: none).
    throttle: AtomicU32,
    /// Whether the throttle thread runs.
    throttler: AtomicBool,
    timings: Mutex<Timings>,
}

/// Held by a vCPU thread while it runs: whether it returns or unwinds, its vCPU is stopped
/// (pause and stop wait on it) and its thread id cleared.
struct VcpuAlive<'a> {
    vcpus: &'a VcpuManager,
    id: u32,
}

impl Drop for VcpuAlive<'_> {
    fn drop(&mut self) {
        self.vcpus.set_tid(self.id, None);
        let mut c = lock(&self.vcpus.ctl);
        if let Some(s) = c.vcpus.get_mut(self.id as usize) {
            *s = VcpuRunState::Stopped;
        }
        self.vcpus.state_cv.notify_all();
    }
}

impl VcpuManager {
    /// Takes over `vcpus` (created and configured, in id order); no thread runs yet.
    pub fn new(vcpus: Vec<Vcpu>, setup: VcpuSetup) -> VcpuManager {
        let exits = vcpus.iter().map(|v| v.exit_counters()).collect();
        let n = vcpus.len();
        let vcpus = vcpus.into_iter().map(|v| Arc::new(Mutex::new(v))).collect();
        Self::with(n, vcpus, exits, setup)
    }

    fn with(
        n: usize,
        vcpus: Vec<Arc<Mutex<Vcpu>>>,
        exits: Vec<Arc<kumo_vm::ExitCounters>>,
        setup: VcpuSetup,
    ) -> VcpuManager {
        VcpuManager {
            vcpus,
            exits,
            request: AtomicU8::new(if setup.paused { PAUSE } else { RUN }),
            ctl: Mutex::new(Control {
                vcpus: vec![VcpuRunState::Created; n],
                outcome: None,
                paused: setup.paused,
                migrating: false,
                user_paused: false,
                stay_paused: false,
            }),
            run_cv: (0..n).map(|_| Condvar::new()).collect(),
            state_cv: Condvar::new(),
            end_cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            tids: Mutex::new(vec![None; n]),
            float_cpus: kumo_sandbox::cpus::process_cpus(),
            uapic: setup.uapic,
            parks: (0..n as u32).map(|v| AtomicBool::new(setup.parked.contains(&v))).collect(),
            throttle: AtomicU32::new(0),
            throttler: AtomicBool::new(false),
            timings: Mutex::new(Timings { start_ns: setup.start_ns, ..Default::default() }),
        }
    }

    /// How many vCPUs the VM has.
    pub fn count(&self) -> u32 {
        self.parks.len() as u32
    }

    /// Each vCPU's state now.
    pub fn states(&self) -> Vec<VcpuRunState> {
        lock(&self.ctl).vcpus.clone()
    }

    /// Starts one thread per vCPU on `bus`: pinned to `pins[v]` if set, real-time prioritized
    /// if in `prioritized`. If a thread cannot start, the VM is stopped and the error returned.
    pub fn start(self: &Arc<Self>, bus: &Arc<Buses>, pins: &[Option<u32>], prioritized: &[u32]) -> Result<()> {
        install_kick_signal()?; // before any vCPU thread can be kicked
        lock(&self.timings).vcpus_started_ns = Some(monotonic_ns());
        for v in &self.vcpus {
            let (v, bus, me) = (v.clone(), bus.clone(), self.clone());
            let id = lock(&v).id;
            let pin = pins.get(id as usize).copied().flatten();
            let prioritized = prioritized.contains(&id);
            let t = kumo_sandbox::spawn(ThreadKind::Vcpu, format!("vcpu{id}"), move || {
                me.thread_main(id, v, &bus, pin, prioritized)
            })
            .map_err(Error::Thread);
            match t {
                Ok(t) => lock(&self.threads).push(t),
                Err(e) => {
                    // This vCPU and those after it never run.
                    lock(&self.ctl).vcpus[id as usize..].fill(VcpuRunState::Stopped);
                    self.finish(Outcome::Error(e.to_string()));
                    self.stop_threads();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// A vCPU thread: its start-up placement, then its run loop, under a panic guard.
    fn thread_main(&self, id: u32, vcpu: Arc<Mutex<Vcpu>>, bus: &Buses, pin: Option<u32>, prioritized: bool) {
        let placed = match pin {
            Some(cpu) => kumo_vm::sched::pin_thread(cpu),
            // Its creator's CPUs may be the I/O threads' (a vCPU hot-added through the API).
            None if self.float_cpus.is_empty() => Ok(()),
            None => kumo_vm::sched::set_affinity(0, &self.float_cpus),
        };
        if let Err(e) = placed {
            tracing::warn!(
                "vCPU {id} not placed on host CPU(s) {:?}: {e}",
                pin.map_or(self.float_cpus.clone(), |c| vec![c])
            );
        }
        if prioritized {
            kumo_vm::interrupt_paths::prioritize_this_thread(&format!("vCPU {id}"));
        }
        // After the start pin, so a vm.pin that finds the tid wins over it; cleared at exit
        // (by `VcpuAlive`) so a reused tid is never re-pinned.
        self.set_tid(id, Some(kumo_vm::sched::this_tid()));
        // A panic stops this VM itself (whatever the process's handler does), with the message
        // the thread's guard reports too.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_loop(id, &vcpu, bus)));
        if let Err(payload) = run {
            let message = kumo_sandbox::thread::panic_message(&*payload);
            let p = kumo_sandbox::ThreadPanic { kind: ThreadKind::Vcpu, thread: format!("vcpu{id}"), message };
            self.finish(Outcome::Panicked(p.to_string()));
            std::panic::resume_unwind(payload);
        }
    }

    fn run_loop(&self, id: u32, vcpu: &Mutex<Vcpu>, bus: &Buses) {
        let _alive = VcpuAlive { vcpus: self, id };
        self.set_state(id as usize, VcpuRunState::Running);
        let mut panic_at = (id == 0 && kumo_sandbox::test_hook("panic:vcpu")).then_some(PANIC_HOOK_EXITS);
        while self.wait_runnable(id as usize) {
            let r = lock(vcpu).run(bus);
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
                    let p = self.throttle.load(Ordering::Acquire);
                    if p > 0 && self.request.load(Ordering::Acquire) == RUN {
                        std::thread::sleep(THROTTLE_PERIOD * p / 100);
                    }
                }
                Ok(VcpuRun::Device(DeviceEvent::GuestExit(code))) => self.finish(Outcome::GuestExit(code)),
                Ok(VcpuRun::Device(DeviceEvent::Marker(m))) => self.mark(m),
                // The guest's _EJ0 (run by another vCPU: an offline CPU runs nothing).
                Ok(VcpuRun::Device(DeviceEvent::CpuEjected(v))) => self.request_park(v),
                // With KVM's LAPIC, HLT only exits here if KVM chose not to park the vCPU itself.
                Ok(VcpuRun::Halted) => match &self.uapic {
                    // kumo's APIC: wait for an interrupt (or a pause/stop request, or a park).
                    Some(u) => u.halt(id, || {
                        self.request.load(Ordering::Acquire) != RUN || self.parks[id as usize].load(Ordering::Acquire)
                    }),
                    None => std::thread::sleep(Duration::from_micros(100)),
                },
                Ok(VcpuRun::Reset(why)) => self.finish(Outcome::Reset(why)),
                // KVM's shutdown event, or the guest's ACPI S5 (kumo's sleep control register).
                Ok(VcpuRun::PowerOff | VcpuRun::Device(DeviceEvent::PowerOff)) => self.finish(Outcome::PowerOff),
                Err(e) => self.finish(Outcome::Error(e.to_string())),
            }
        }
    }

    fn set_state(&self, id: usize, s: VcpuRunState) {
        if let Some(state) = lock(&self.ctl).vcpus.get_mut(id) {
            *state = s;
        }
    }

    /// Waits while the VM is paused or this vCPU is parked. Returns false when the thread
    /// should exit.
    fn wait_runnable(&self, id: usize) -> bool {
        let parked_alone = || self.parks.get(id).is_some_and(|p| p.load(Ordering::Acquire));
        if self.request.load(Ordering::Acquire) == RUN && !parked_alone() {
            return true;
        }
        let mut c = lock(&self.ctl);
        loop {
            let r = self.request.load(Ordering::Acquire);
            let waiting = match r {
                PAUSE => VcpuRunState::Paused,
                RUN if parked_alone() => VcpuRunState::Parked,
                _ => {
                    c.vcpus[id] = VcpuRunState::Running;
                    return r == RUN;
                }
            };
            if c.vcpus[id] != waiting {
                c.vcpus[id] = waiting;
                self.state_cv.notify_all();
            }
            c = self.run_cv[id].wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Kicks every vCPU thread (or only vCPU `only`'s) out of KVM_RUN and waits, resending the
    /// kick every [`KICK_RESEND`], until `done` answers.
    fn kick_until<T>(&self, only: Option<u32>, mut done: impl FnMut(&mut Control) -> Option<T>) -> T {
        let mut c = lock(&self.ctl);
        loop {
            if let Some(r) = done(&mut c) {
                return r;
            }
            match only {
                Some(v) => self.kick_one(v),
                None => self.kick_all(),
            }
            c = self.state_cv.wait_timeout(c, KICK_RESEND).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Wakes every vCPU thread waiting to run (the request changed). Under `ctl`.
    fn wake_vcpus(&self) {
        for cv in &self.run_cv {
            cv.notify_all();
        }
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

    fn kick_one(&self, v: u32) {
        if let Some(t) = lock(&self.threads).get(v as usize).filter(|t| !t.is_finished()) {
            let _ = t.kill(kick_signal());
        }
        // With kumo's APIC a halted vCPU waits outside KVM_RUN, where no signal reaches it.
        if let Some(u) = &self.uapic {
            u.wake_all();
        }
    }

    /// Records how the VM ended (the first report wins) and asks every vCPU to stop.
    pub fn finish(&self, outcome: Outcome) {
        let mut c = lock(&self.ctl);
        c.outcome.get_or_insert(outcome);
        self.request.store(STOP, Ordering::Release);
        self.wake_vcpus();
        self.state_cv.notify_all();
        self.end_cv.notify_all();
    }

    /// True once the VM has stopped or been asked to (guest exit, error, shutdown).
    pub fn is_finished(&self) -> bool {
        lock(&self.ctl).outcome.is_some()
    }

    /// Waits until the VM ends (or `timeout` passes: then it ends as timed out), stops every
    /// vCPU thread and says how it ended.
    pub fn wait(&self, timeout: Option<Duration>) -> Outcome {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut c = lock(&self.ctl);
        while c.outcome.is_none() {
            let step =
                deadline.map(|d| d.saturating_duration_since(Instant::now())).unwrap_or(Duration::from_secs(3600));
            if step.is_zero() {
                c.outcome = Some(Outcome::TimedOut);
                break;
            }
            c = self.end_cv.wait_timeout(c, step).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(c);
        self.stop_threads();
        lock(&self.ctl).outcome.clone().unwrap_or(Outcome::Shutdown)
    }

    /// Stops every vCPU thread and joins it.
    pub fn stop_threads(&self) {
        {
            // Under the lock: a thread between its request check and its wait sees STOP.
            let _c = lock(&self.ctl);
            self.request.store(STOP, Ordering::Release);
            self.wake_vcpus();
        }
        self.kick_until(None, |c| (!c.vcpus.iter().any(|s| s.live())).then_some(()));
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }

    pub fn is_paused(&self) -> bool {
        lock(&self.ctl).paused
    }

    /// Stops every vCPU out of KVM_RUN; returns once none runs. `migration`: the pause is a
    /// migration's (the user's is refused while a migration holds the run state).
    pub fn pause(&self, migration: bool) -> Result<()> {
        {
            let c = lock(&self.ctl);
            if c.outcome.is_some() {
                return Err(Error::State("shutting down"));
            }
            if c.migrating && !migration {
                return Err(Error::State("migrating (pause and resume wait until it ends)"));
            }
            if c.paused {
                return Err(Error::State("already paused"));
            }
            self.request.store(PAUSE, Ordering::Release);
        }
        self.kick_until(None, |c| {
            if c.outcome.is_some() {
                return Some(Err(Error::State("shutting down")));
            }
            if c.vcpus.iter().all(|s| s.waiting() || *s == VcpuRunState::Stopped) {
                c.paused = true;
                return Some(Ok(()));
            }
            None
        })
    }

    /// Lets the paused vCPUs run again; `before` runs first, under the run state's lock (the
    /// devices resume before any vCPU can reach them). Ok(false): it stays paused (restored
    /// from a user-paused VM, the migration's resume is not the user's).
    pub fn resume(&self, migration: bool, before: impl FnOnce()) -> Result<bool> {
        let mut c = lock(&self.ctl);
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
                return Ok(false);
            }
        }
        if !c.paused {
            return Err(Error::State("not paused"));
        }
        c.paused = false;
        before();
        self.request.store(RUN, Ordering::Release);
        self.wake_vcpus();
        Ok(true)
    }

    /// Errs unless the VM is paused.
    pub fn require_paused(&self) -> Result<()> {
        if lock(&self.ctl).paused {
            Ok(())
        } else {
            Err(Error::State("not paused (pause it first)"))
        }
    }

    /// Hands the run state to a migration until [`VcpuManager::end_migration`].
    pub fn begin_migration(&self) -> Result<()> {
        let mut c = lock(&self.ctl);
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

    /// Gives the run state back to the user.
    pub fn end_migration(&self) {
        let mut c = lock(&self.ctl);
        c.migrating = false;
        c.user_paused = false;
    }

    /// Whether the user had paused the VM before the running migration began.
    pub fn paused_by_user(&self) -> bool {
        lock(&self.ctl).user_paused
    }

    /// Restored from a snapshot of a user-paused VM: the migration's resume leaves it paused.
    pub fn set_stay_paused(&self, on: bool) {
        lock(&self.ctl).stay_paused = on;
    }

    /// Parks vCPU `v` (elastic sharing): its thread leaves KVM_RUN and waits in kumo until
    /// unparked; returns once it does.
    pub fn park(&self, v: u32) -> std::result::Result<(), String> {
        let id = v as usize;
        let flag = self.parks.get(id).ok_or_else(|| format!("no vCPU {v}"))?;
        flag.store(true, Ordering::Release);
        let deadline = Instant::now() + PARK_TIMEOUT;
        self.kick_until(Some(v), |c| {
            if c.vcpus[id].waiting() {
                Some(Ok(()))
            } else if c.outcome.is_some() {
                Some(Err("the VM is stopping".into()))
            } else if Instant::now() > deadline {
                Some(Err(format!("vCPU {v} did not leave KVM_RUN within {} s", PARK_TIMEOUT.as_secs())))
            } else {
                None
            }
        })
    }

    /// Asks vCPU `v` to park without waiting for it (a vCPU thread asks for another's: the
    /// guest ejected it; a release, whose guest has vacated the vCPU). Its thread does not enter
    /// the guest again before it parks. [`VcpuManager::park`] waits for it.
    pub fn request_park(&self, v: u32) {
        if let Some(p) = self.parks.get(v as usize) {
            p.store(true, Ordering::Release);
            self.kick_one(v);
        }
    }

    /// The vCPUs whose threads are parked now.
    pub fn parked(&self) -> Vec<u32> {
        let c = lock(&self.ctl);
        (0..c.vcpus.len() as u32).filter(|&v| c.vcpus[v as usize] == VcpuRunState::Parked).collect()
    }

    /// Lets a parked vCPU run again.
    pub fn unpark(&self, v: u32) {
        if let Some(p) = self.parks.get(v as usize) {
            p.store(false, Ordering::Release);
            let _c = lock(&self.ctl);
            self.run_cv[v as usize].notify_all();
        }
    }

    /// Whether the VM runs (not paused, not stopping): its guest can only answer then.
    pub fn check_running(&self) -> std::result::Result<(), String> {
        let c = lock(&self.ctl);
        if c.outcome.is_some() {
            Err("the VM is stopping".into())
        } else if c.paused {
            Err("the VM is paused (its guest cannot answer)".into())
        } else {
            Ok(())
        }
    }

    /// Pins vCPU `vcpu` to host CPU `cpu` (`None`: unpins it, it floats over the CPUs the VMM
    /// had at start), running or paused: its thread's affinity is set by tid, so the vCPU need
    /// not be woken. Errors are one line: a bad vCPU or CPU, no thread, or a failure.
    pub fn pin_vcpu(&self, vcpu: u32, cpu: Option<u32>) -> std::result::Result<(), PinError> {
        use crate::placement::{format_cpulist, HostTopology};
        if vcpu >= self.count() {
            return Err(PinError::Bad(format!("vCPU {vcpu} does not exist (the VM has {} vCPUs)", self.count())));
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
            None => self.float_cpus.clone(),
        };
        self.set_affinity(vcpu, &cpus)
    }

    /// [`VcpuManager::pin_vcpu`] without its sysfs walk (elastic sharing: on a lend's critical
    /// path, and sched_setaffinity refuses a CPU that is not online anyway).
    pub fn set_pin(&self, v: u32, cpu: Option<u32>) -> std::result::Result<(), String> {
        let cpus = match cpu {
            Some(c) => vec![c],
            None => self.float_cpus.clone(),
        };
        self.set_affinity(v, &cpus).map_err(|e| e.to_string())
    }

    /// Sets vCPU `vcpu`'s thread's affinity to `cpus`, by its thread id.
    fn set_affinity(&self, vcpu: u32, cpus: &[u32]) -> std::result::Result<(), PinError> {
        // Held while the affinity is set: an exiting thread clears its tid first, so a reused
        // tid is never re-pinned.
        let tids = lock(&self.tids);
        let tid = tids
            .get(vcpu as usize)
            .copied()
            .flatten()
            .ok_or_else(|| PinError::NoThread(format!("vCPU {vcpu} has no running thread")))?;
        kumo_vm::sched::set_affinity(tid, cpus).map_err(|e| PinError::Failed(format!("cannot pin vCPU {vcpu}: {e}")))
    }

    /// The host CPUs an unpinned vCPU floats over: the VMM's when the VM was made.
    pub fn float_cpus(&self) -> &[u32] {
        &self.float_cpus
    }

    /// Each vCPU's host CPU as its thread's affinity reads now: `Some(cpu)` when it may run on
    /// one CPU only, `None` when it floats (or has no thread).
    pub fn vcpu_pins(&self) -> Vec<Option<u32>> {
        lock(&self.tids)
            .iter()
            .map(|t| match t.map(kumo_vm::sched::affinity_of) {
                Some(Ok(c)) if c.len() == 1 => Some(c[0]),
                _ => None,
            })
            .collect()
    }

    fn set_tid(&self, id: u32, tid: Option<i32>) {
        if let Some(t) = lock(&self.tids).get_mut(id as usize) {
            *t = tid;
        }
    }

    /// Throttles the vCPUs to `percent` of each 10 ms period asleep (0 ends it), as QEMU's
    /// auto-converge does: a guest that dirties memory faster than a migration can send it is
    /// slowed until the migration converges. A thread kicks the vCPUs out of KVM_RUN every
    /// period; each kicked vCPU sleeps its share before it re-enters.
    pub fn set_throttle(self: &Arc<Self>, percent: u32) {
        let percent = percent.min(99);
        self.throttle.store(percent, Ordering::Release);
        if percent == 0 || self.throttler.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        let spawned = kumo_sandbox::spawn(ThreadKind::Vmm, "cpu-throttle", move || loop {
            let p = me.throttle.load(Ordering::Acquire);
            if p == 0 || me.request.load(Ordering::Acquire) == STOP {
                me.throttler.store(false, Ordering::Release);
                // A throttle set again just now must not be left without its thread.
                if me.throttle.load(Ordering::Acquire) == 0 || me.throttler.swap(true, Ordering::AcqRel) {
                    return;
                }
                continue;
            }
            std::thread::sleep(THROTTLE_PERIOD * (100 - p) / 100);
            me.kick_all();
        });
        if let Err(e) = spawned {
            self.throttler.store(false, Ordering::Release);
            tracing::warn!("cannot throttle the vCPUs: {e}");
        }
    }

    /// The current vCPU throttle, percent.
    pub fn throttle(&self) -> u32 {
        self.throttle.load(Ordering::Acquire)
    }

    /// Reads every vCPU's state. The VM must be paused (the caller checks).
    pub fn save_states(&self) -> Result<Vec<kumo_vm::VcpuState>> {
        Ok(self.vcpus.iter().map(|v| lock(v).save()).collect::<std::result::Result<Vec<_>, _>>()?)
    }

    /// Puts back every vCPU's state, in vCPU order. The VM must be paused (the caller checks).
    pub fn restore_states(&self, states: &[kumo_vm::VcpuState]) -> Result<()> {
        for (v, st) in self.vcpus.iter().zip(states) {
            lock(v).restore(st)?;
        }
        Ok(())
    }

    /// Runs `f` on vCPU `id` (the caller makes sure it is paused).
    pub fn with_vcpu<R>(&self, id: usize, f: impl FnOnce(&Vcpu) -> R) -> Result<R> {
        let v = self.vcpus.get(id).ok_or(Error::State("without that vCPU"))?;
        Ok(f(&lock(v)))
    }

    /// Emulation assists summed over the vCPUs (waits for vCPUs inside KVM_RUN).
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

    pub fn timings(&self) -> Timings {
        lock(&self.timings).clone()
    }

    /// The guest wrote its first console byte.
    pub fn note_first_output(&self) {
        lock(&self.timings).first_output_ns.get_or_insert_with(monotonic_ns);
    }

    fn mark(&self, marker: u8) {
        if marker == 1 {
            lock(&self.timings).guest_entry_ns.get_or_insert_with(monotonic_ns);
        }
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

/// A manager of `n` vCPUs without KVM ones, for tests of the run-state bookkeeping.
#[cfg(test)]
pub(crate) fn for_tests(n: usize, states: VcpuRunState) -> VcpuManager {
    let setup = VcpuSetup { paused: false, parked: Vec::new(), uapic: None, start_ns: 0 };
    let m = VcpuManager::with(n, Vec::new(), Vec::new(), setup);
    lock(&m.ctl).vcpus.fill(states);
    lock(&m.tids).fill(Some(1));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vcpu_thread_that_unwinds_is_stopped_and_forgets_its_tid() {
        let m = for_tests(2, VcpuRunState::Running);
        lock(&m.ctl).vcpus[1] = VcpuRunState::Parked;
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let _alive = VcpuAlive { vcpus: &m, id: 1 };
                panic!("vCPU bug (expected by the test)");
            });
            assert!(t.join().is_err());
        });
        assert_eq!(m.states(), [VcpuRunState::Running, VcpuRunState::Stopped]);
        assert_eq!(lock(&m.tids)[1], None, "its tid is cleared, so vm.pin cannot reach a reused one");
        assert!(matches!(m.set_pin(1, None), Err(e) if e.contains("no running thread")));
        // The other one returns normally: a stop has no thread left to wait for.
        drop(VcpuAlive { vcpus: &m, id: 0 });
        assert!(!m.states().iter().any(|s| s.live()));
    }

    #[test]
    fn a_pause_ends_once_every_vcpu_waits() {
        let m = for_tests(3, VcpuRunState::Paused);
        lock(&m.ctl).vcpus[1] = VcpuRunState::Parked;
        lock(&m.ctl).vcpus[2] = VcpuRunState::Stopped;
        m.pause(false).unwrap();
        assert!(m.is_paused());
        assert_eq!(m.pause(false).unwrap_err().to_string(), "the VM is already paused");
        m.begin_migration().unwrap();
        assert!(m.paused_by_user());
        assert!(m.resume(false, || {}).unwrap_err().to_string().contains("migrating"));
        m.end_migration();
        let mut devices_first = false;
        assert!(m.resume(false, || devices_first = true).unwrap());
        assert!(devices_first && !m.is_paused());
    }

    #[test]
    fn a_restored_user_paused_vm_stays_paused_through_the_migrations_resume() {
        let m = for_tests(1, VcpuRunState::Paused);
        m.pause(true).unwrap();
        m.set_stay_paused(true);
        assert!(!m.resume(true, || panic!("nothing resumes")).unwrap());
        assert!(m.is_paused());
        assert!(m.resume(false, || {}).unwrap(), "the user's resume does");
    }

    #[test]
    fn a_finished_vm_refuses_pause_and_park_and_keeps_its_first_outcome() {
        let m = for_tests(2, VcpuRunState::Running);
        m.finish(Outcome::GuestExit(3));
        m.finish(Outcome::Shutdown);
        assert!(m.is_finished());
        assert_eq!(m.pause(false).unwrap_err().to_string(), "the VM is shutting down");
        assert_eq!(m.park(1).unwrap_err(), "the VM is stopping");
        assert_eq!(m.check_running().unwrap_err(), "the VM is stopping");
        assert_eq!(m.park(7).unwrap_err(), "no vCPU 7");
        lock(&m.ctl).vcpus.fill(VcpuRunState::Stopped);
        assert_eq!(m.wait(None), Outcome::GuestExit(3));
    }

    #[test]
    fn pins_name_an_existing_vcpu() {
        let m = for_tests(2, VcpuRunState::Running);
        let e = m.pin_vcpu(2, Some(0)).unwrap_err();
        assert!(matches!(&e, PinError::Bad(m) if m.contains("does not exist (the VM has 2 vCPUs)")), "{e}");
    }
}
