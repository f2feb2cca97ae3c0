//! seccomp filters per thread kind (docs/security.md, "Sandbox").
//!
//! The process chooses a [`Mode`] once at start ([`init`]). With filters on, every thread
//! started by [`crate::spawn`] installs its kind's allow-list (with `PR_SET_NO_NEW_PRIVS`)
//! before it runs its work, and the main thread installs its own once its setup is done
//! ([`filter_this_thread`]). Filters are inherited and stack, so a filtered thread does not
//! create threads itself: it hands them to the spawner thread, whose filter is the union of
//! every kind's, and each new thread ends up held to its own kind's list alone.

mod rules;
pub mod trap;

use std::cell::Cell;
use std::collections::HashMap;
use std::io;
use std::str::FromStr;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Mutex, OnceLock};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use rules::Rules;
pub use trap::{current_kind, syscall_name, EXIT_STATUS};

use crate::ThreadKind;

/// What a call outside a thread's allow-list does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No filters (`--seccomp false`).
    Off,
    /// The call is allowed and logged by the kernel (SECCOMP_RET_LOG: the audit log or the
    /// kernel log, `dmesg`), to discover what a deployment needs (`--seccomp log`).
    Log,
    /// The call stops the process with a one-line message naming it and the thread's kind
    /// (`--seccomp true`, the default).
    Trap,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "true" => Ok(Mode::Trap),
            "false" => Ok(Mode::Off),
            "log" => Ok(Mode::Log),
            _ => Err(format!("{s:?}: expected true, false or log")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Off => "false",
            Mode::Log => "log",
            Mode::Trap => "true",
        })
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Sandbox {
    mode: Mode,
    filters: HashMap<ThreadKind, BpfProgram>,
    no_clone3: BpfProgram,
    spawner: Option<Mutex<SyncSender<Job>>>,
}

static SANDBOX: OnceLock<Sandbox> = OnceLock::new();

thread_local! {
    static FILTERED: Cell<bool> = const { Cell::new(false) };
}

/// The process's mode: [`Mode::Off`] until [`init`].
pub fn mode() -> Mode {
    SANDBOX.get().map_or(Mode::Off, |s| s.mode)
}

/// Compiles the allow-list of `kind` (or the spawner's union, `None`) for `mode`.
pub fn compile(kind: Option<ThreadKind>, mode: Mode) -> io::Result<BpfProgram> {
    let pid = std::process::id();
    let rules = match kind {
        Some(k) => rules::for_kind(k, pid),
        None => rules::spawner(pid),
    };
    let mismatch = if mode == Mode::Log { SeccompAction::Log } else { SeccompAction::Trap };
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| io::Error::other(e.to_string()))?;
    let filter =
        SeccompFilter::new(rules, mismatch, SeccompAction::Allow, arch).map_err(|e| io::Error::other(e.to_string()))?;
    filter.try_into().map_err(|e: seccompiler::BackendError| io::Error::other(e.to_string()))
}

/// A second filter every filtered thread carries: `clone3` fails with ENOSYS, so glibc falls
/// back to `clone`, whose flags the kind filters check (threads only, no new process). The
/// kind filters allow `clone3` where they allow threads; stacked, the error wins.
pub fn no_clone3() -> io::Result<BpfProgram> {
    let rules = Rules::from([(libc::SYS_clone3, Vec::new())]);
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| io::Error::other(e.to_string()))?;
    let errno = SeccompAction::Errno(libc::ENOSYS as u32);
    let filter =
        SeccompFilter::new(rules, SeccompAction::Allow, errno, arch).map_err(|e| io::Error::other(e.to_string()))?;
    filter.try_into().map_err(|e: seccompiler::BackendError| io::Error::other(e.to_string()))
}

/// Installs `kind_filter` and, for a kind that may create threads, [`no_clone3`] on the
/// calling thread (the others trap `clone3` anyway: one filter less on their every call).
fn apply(kind_filter: &BpfProgram, no_clone3: Option<&BpfProgram>) -> io::Result<()> {
    for p in no_clone3.into_iter().chain([kind_filter]) {
        seccompiler::apply_filter(p).map_err(|e| io::Error::other(e.to_string()))?;
    }
    Ok(())
}

/// Whether threads of `kind` may create threads (then they carry [`no_clone3`]).
fn creates_threads(kind: ThreadKind) -> bool {
    rules::for_kind(kind, 0).contains_key(&libc::SYS_clone3)
}

/// Sets the process's mode, once, before any thread is filtered: compiles every kind's filter,
/// installs the SIGSYS handler and starts the spawner thread (under its own filter). A second
/// call is an error.
pub fn init(mode: Mode) -> io::Result<()> {
    let mut filters = HashMap::new();
    let mut spawner = None;
    let no_clone3 = no_clone3()?;
    if mode != Mode::Off {
        for kind in ThreadKind::ALL {
            filters.insert(kind, compile(Some(kind), mode)?);
        }
        trap::install_handler()?;
        spawner = Some(Mutex::new(start_spawner(compile(None, mode)?, no_clone3.clone())?));
        filtered_panic_hook();
    }
    SANDBOX
        .set(Sandbox { mode, filters, no_clone3, spawner })
        .map_err(|_| io::Error::other("the seccomp mode is set once per process"))
}

/// Makes a panic on a filtered thread print its message with `write(2)` alone. std's own hook
/// may capture and symbolize a backtrace (`RUST_BACKTRACE`), which opens files and asks for the
/// working directory: under a filter that would end the process by SIGSYS before the panic
/// guard could stop the VM cleanly. Unfiltered threads keep std's hook.
fn filtered_panic_hook() {
    let std_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !filtered() {
            return std_hook(info);
        }
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let at = info.location().map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column())).unwrap_or_default();
        let msg = crate::kind::panic_message(info.payload());
        // One write: lines of concurrent panics do not interleave.
        let line = format!(
            "thread '{name}' panicked{at}:\n{msg}\n(no backtrace under the seccomp filter: --seccomp false for one)\n"
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    }));
}

/// Starts the thread that creates threads for filtered threads; returns once it runs filtered.
fn start_spawner(filter: BpfProgram, no_clone3: BpfProgram) -> io::Result<SyncSender<Job>> {
    let (jobs, queue) = sync_channel::<Job>(0);
    let (ready_tx, ready) = sync_channel(1);
    std::thread::Builder::new().name("kumo-spawner".into()).spawn(move || {
        let _registered = crate::cpus::register(ThreadKind::Vmm, true);
        let applied = apply(&filter, Some(&no_clone3));
        let ok = applied.is_ok();
        let _ = ready_tx.send(applied);
        if ok {
            trap::set_current(ThreadKind::Vmm, "kumo-spawner");
            FILTERED.with(|f| f.set(true));
            for job in queue {
                job();
            }
        }
    })?;
    ready.recv().map_err(|_| io::Error::other("the spawner thread ended"))??;
    Ok(jobs)
}

/// Whether this thread runs under a filter (then it cannot create threads itself).
pub(crate) fn filtered() -> bool {
    FILTERED.with(Cell::get)
}

/// Runs `make` (which creates a thread) on the spawner thread and returns what it returns.
pub(crate) fn on_spawner<R: Send + 'static>(make: impl FnOnce() -> R + Send + 'static) -> io::Result<R> {
    let gone = || io::Error::other("the thread spawner has ended");
    let sender = SANDBOX.get().and_then(|s| s.spawner.as_ref()).ok_or_else(gone)?;
    let (tx, rx) = sync_channel(1);
    let job: Job = Box::new(move || {
        let _ = tx.send(make());
    });
    sender.lock().unwrap_or_else(|p| p.into_inner()).send(job).map_err(|_| gone())?;
    rx.recv().map_err(|_| gone())
}

/// Puts the calling thread under `kind`'s filter (a no-op with filters off, or if it already
/// runs under it); records its kind and name for the message of a forbidden call.
pub fn filter_this_thread(kind: ThreadKind, name: &str) -> io::Result<()> {
    let already = current_filter() == Some(kind);
    trap::set_current(kind, name);
    let Some(s) = SANDBOX.get().filter(|s| s.mode != Mode::Off) else { return Ok(()) };
    if already {
        return Ok(());
    }
    apply(&s.filters[&kind], creates_threads(kind).then_some(&s.no_clone3))
        .map_err(|e| io::Error::other(format!("cannot install the {kind} seccomp filter: {e}")))?;
    FILTERED.with(|f| f.set(true));
    if crate::hooks::test_hook(&format!("seccomp-violation:{kind}")) {
        forbidden_call();
    }
    Ok(())
}

/// A call no kind allows (reads the kernel log buffer's size: harmless where it is allowed).
fn forbidden_call() {
    // SAFETY: syslog(SYSLOG_ACTION_SIZE_BUFFER) takes no buffer and changes nothing.
    unsafe {
        libc::syscall(libc::SYS_syslog, 10, std::ptr::null_mut::<libc::c_char>(), 0);
    }
}

/// The filter this thread runs under, if any (a thread it creates itself inherits it).
pub(crate) fn current_filter() -> Option<ThreadKind> {
    filtered().then(current_kind).flatten()
}

/// Called first in every thread [`crate::spawn`] starts: its filter, or the end of the process
/// if it cannot have one (no thread runs unfiltered when filters are on). `inherited` is the
/// filter its creator ran under: the same kind's is not installed twice.
pub(crate) fn enter(kind: ThreadKind, name: &str, inherited: Option<ThreadKind>) {
    if inherited == Some(kind) {
        trap::set_current(kind, name);
        FILTERED.with(|f| f.set(true));
        return;
    }
    if let Err(e) = filter_this_thread(kind, name) {
        tracing::error!("{kind} thread {name}: {e}");
        let _ =
            std::io::Write::write_all(&mut std::io::stderr(), format!("kumo: {kind} thread {name}: {e}\n").as_bytes());
        std::process::exit(1);
    }
}

/// The CPUs and scheduling policy of a thread, which a thread it creates would inherit: the
/// spawner gives them to the threads it creates on another thread's behalf.
pub(crate) struct Placement {
    policy: libc::c_int,
    param: libc::sched_param,
    cpus: libc::cpu_set_t,
}

impl Placement {
    /// The calling thread's.
    pub(crate) fn current() -> Option<Placement> {
        // SAFETY: with pid 0 these calls read the calling thread's own attributes into the
        // values given, which are valid and sized as the calls expect.
        unsafe {
            let mut p =
                Placement { policy: libc::sched_getscheduler(0), param: std::mem::zeroed(), cpus: std::mem::zeroed() };
            let ok = p.policy >= 0
                && libc::sched_getparam(0, &mut p.param) == 0
                && libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut p.cpus) == 0;
            ok.then_some(p)
        }
    }

    /// Applies them to the calling thread (what cannot be applied is logged).
    pub(crate) fn apply(&self) {
        // SAFETY: with pid 0 these calls change only the calling thread, from values read by
        // `current`.
        let (cpus, policy) = unsafe {
            (
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.cpus),
                libc::sched_setscheduler(0, self.policy, &self.param),
            )
        };
        if cpus != 0 || policy != 0 {
            tracing::debug!("a new thread did not take its creator's CPUs or policy: {}", io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
