//! Threads by kind, each under a panic guard.
//!
//! A panicking thread must not wedge the VM: the guard hands the panic to the process-wide
//! handler (set once by the VMM: it records the stop reason and stops the VM) and then lets the
//! unwind continue, so `join` still sees `Err` as it would without the guard.

use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::sync::OnceLock;
use std::thread::JoinHandle;

pub use crate::kind::{panic_message, ThreadKind};

/// A panic caught by a thread's guard.
#[derive(Clone, Debug)]
pub struct ThreadPanic {
    pub kind: ThreadKind,
    /// The thread's name.
    pub thread: String,
    /// The panic's message.
    pub message: String,
}

impl std::fmt::Display for ThreadPanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} thread {} panicked: {}", self.kind, self.thread, self.message)
    }
}

type PanicHandler = Box<dyn Fn(&ThreadPanic) + Send + Sync>;

static PANIC_HANDLER: OnceLock<PanicHandler> = OnceLock::new();

/// Sets the process-wide handler the guards call on a panic (once; later calls are ignored and
/// return false). Without one, a panic is only logged.
pub fn set_panic_handler(handler: impl Fn(&ThreadPanic) + Send + Sync + 'static) -> bool {
    PANIC_HANDLER.set(Box::new(handler)).is_ok()
}

/// Reports a caught panic to the handler (and the log).
pub fn report_panic(p: &ThreadPanic) {
    tracing::error!("{p}");
    if let Some(h) = PANIC_HANDLER.get() {
        h(p);
    }
}

/// Runs `f` under the panic guard of a thread of `kind` named `name`: a panic is reported,
/// then unwinds on.
pub fn guarded<T>(kind: ThreadKind, name: &str, f: impl FnOnce() -> T) -> T {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            report_panic(&ThreadPanic { kind, thread: name.to_string(), message: panic_message(&*payload) });
            panic::resume_unwind(payload)
        }
    }
}

/// Locks `m`, taking over a lock a panicking thread poisoned: the panic is reported by that
/// thread's guard, and a second panic here would only cascade it.
pub fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a job whose panic its caller contains: `f`'s Drop guards release what the job held
/// (a migration's run state, dirty logging, the throttle), so the caller answers an error and
/// the VM runs on. The panic is logged but not handed to the process's handler, and comes back
/// as `Err`. Only for jobs whose every hold is released in `Drop`; anything else must unwind to
/// the thread's guard, which stops the VM.
pub fn contain<T>(kind: ThreadKind, what: &str, f: impl FnOnce() -> T) -> Result<T, ThreadPanic> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let p = ThreadPanic { kind, thread: what.to_string(), message: panic_message(&*payload) };
        tracing::error!("{p} (contained: the job released what it held)");
        p
    })
}

/// Runs `f` as the body of a new thread of `kind`: its seccomp filter first, then `f` under the
/// panic guard.
fn body<T>(kind: ThreadKind, name: &str, inherited: Option<ThreadKind>, f: impl FnOnce() -> T) -> T {
    let _registered = crate::cpus::register(kind, inherited.is_none());
    crate::seccomp::enter(kind, name, inherited);
    guarded(kind, name, f)
}

/// Starts a thread of `kind` named `name` running `f` under the panic guard and its kind's
/// seccomp filter. A filtered caller has the spawner create it (crate::seccomp), with the
/// caller's CPUs and scheduling policy, as a thread it created itself would have. Returns once
/// the thread runs under its name: whoever looks at the process then (libvirt finds vCPU
/// threads by name right after `vm.boot`) sees it.
pub fn spawn<F, T>(kind: ThreadKind, name: impl Into<String>, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let name = name.into();
    let thread_name = name.clone();
    let builder = std::thread::Builder::new().name(name);
    // std names a thread from inside it, as it starts: wait for that.
    let started = std::sync::Arc::new(std::sync::Barrier::new(2));
    let seen = started.clone();
    let handle = if crate::seccomp::filtered() {
        let placement = crate::seccomp::Placement::current();
        crate::seccomp::on_spawner(move || {
            // The spawner takes the caller's policy and CPUs while it creates the thread, which
            // inherits them from its first instruction: a real-time API thread's new connection
            // thread does not start at normal priority behind spinning vCPUs (0.35-0.45 ms of
            // start-up there, traced in issue 24), nor waits for the spawner at it.
            // Only where the spawner's own can be put back after.
            let swap = placement.zip(crate::seccomp::Placement::current());
            if let Some((caller, _)) = &swap {
                caller.apply();
            }
            let made = builder.spawn(move || {
                seen.wait();
                body(kind, &thread_name, None, f)
            });
            if let Some((_, own)) = swap {
                own.apply();
            }
            made
        })??
    } else {
        builder.spawn(move || {
            seen.wait();
            body(kind, &thread_name, None, f)
        })?
    };
    started.wait();
    Ok(handle)
}

/// Starts a scoped thread of `kind` named `name` running `f` under the panic guard. It is
/// created by the caller, so it inherits the caller's filter: meant for helpers of the caller's
/// own kind (a different kind's filter would stack on the caller's, allowing only what both
/// allow).
pub fn spawn_scoped<'scope, 'env, F, T>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    kind: ThreadKind,
    name: impl Into<String>,
    f: F,
) -> io::Result<std::thread::ScopedJoinHandle<'scope, T>>
where
    F: FnOnce() -> T + Send + 'scope,
    T: Send + 'scope,
{
    let name = name.into();
    let thread_name = name.clone();
    let inherited = crate::seccomp::current_filter();
    std::thread::Builder::new().name(name).spawn_scoped(scope, move || body(kind, &thread_name, inherited, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_spawned_thread_is_named_when_spawn_returns() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = spawn(ThreadKind::Vmm, "t-named-now", move || rx.recv()).unwrap();
        let names: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect();
        assert!(names.iter().any(|n| n == "t-named-now"), "{names:?}");
        drop(tx);
        t.join().unwrap().unwrap_err();
    }

    #[test]
    fn a_thread_runs_and_returns_its_value() {
        let t = spawn(ThreadKind::Vmm, "t-ok", || 41 + 1).unwrap();
        assert_eq!(t.join().unwrap(), 42);
    }

    #[test]
    fn a_panic_is_reported_then_unwinds_to_join() {
        static SEEN: AtomicUsize = AtomicUsize::new(0);
        // The handler is process-wide; this is the only test that sets it.
        set_panic_handler(|p| {
            if p.thread == "t-panics" && p.kind == ThreadKind::Device && p.message == "boom 7" {
                SEEN.fetch_add(1, Ordering::SeqCst);
            }
        });
        let t = spawn(ThreadKind::Device, "t-panics", || -> u32 { panic!("boom {}", 7) }).unwrap();
        let err = t.join().unwrap_err();
        assert_eq!(panic_message(&*err), "boom 7");
        assert_eq!(SEEN.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_scoped_thread_borrows_and_returns() {
        let v = [1, 2, 3];
        let sum = std::thread::scope(|s| {
            spawn_scoped(s, ThreadKind::Migration, "t-scoped", || v.iter().sum::<i32>()).unwrap().join().unwrap()
        });
        assert_eq!(sum, 6);
    }

    #[test]
    fn a_contained_panic_comes_back_as_an_error_after_the_guards_ran() {
        struct Release<'a>(&'a AtomicUsize);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let released = AtomicUsize::new(0);
        let r = contain(ThreadKind::Migration, "job", || {
            let _hold = Release(&released);
            panic!("mid-way")
        });
        let p: ThreadPanic = r.unwrap_err();
        assert_eq!((p.kind, p.thread.as_str(), p.message.as_str()), (ThreadKind::Migration, "job", "mid-way"));
        assert_eq!(released.load(Ordering::SeqCst), 1);
        assert_eq!(contain(ThreadKind::Vmm, "ok", || 5).unwrap(), 5);
    }

    #[test]
    fn kinds_have_distinct_names() {
        let mut names: Vec<_> = ThreadKind::ALL.iter().map(|k| k.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ThreadKind::ALL.len());
    }
}
