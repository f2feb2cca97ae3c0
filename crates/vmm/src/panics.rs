//! A panic in any kumo thread stops the VM (docs/design.md "Threads and control", docs/security.md
//! "Panics"). Every thread runs under `kumo_sandbox`'s guard, which hands a panic to the one
//! process-wide handler installed here: it writes the event monitor's `panic` event and makes
//! the panic the stop reason of every VM registered in this process (a kumo process runs one),
//! whose main thread then stops the other threads, reports and exits non-zero; its API socket
//! goes with the server. An empty VMM still waiting for its VM ends the same way.
//!
//! A panic is a bug, and the state the thread was changing may be half-changed: stopping is the
//! only outcome that cannot make it worse. The exceptions are jobs whose every hold on the VM is
//! released in `Drop` (migration and snapshot: see `RunningVm::lease_run_state`): they are run
//! under `kumo_sandbox::contain`, answer an error and leave the VM running.

use std::sync::{Arc, Mutex, Once, OnceLock, Weak};

use kumo_sandbox::ThreadPanic;
use serde_json::json;

/// Something a panic stops: a VM, or an empty VMM waiting for one.
pub(crate) trait OnPanic: Send + Sync {
    fn panicked(&self, p: &ThreadPanic);
}

static TARGETS: Mutex<Vec<Weak<dyn OnPanic>>> = Mutex::new(Vec::new());

type Fallback = Box<dyn Fn(&ThreadPanic) + Send + Sync>;

/// What a panic does while there is nothing to stop (a destination still waiting for its VM).
static FALLBACK: OnceLock<Fallback> = OnceLock::new();

/// Sets the process's panic handler, once.
fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        if !kumo_sandbox::thread::set_panic_handler(handle) {
            tracing::warn!("a panic handler was set before the VMM's: thread panics will not stop the VM");
        }
    });
}

/// What a panic does while no VM or empty VMM is registered (`kumo run` sets it: remove its
/// sockets and exit). Only the first call takes effect.
pub fn set_fallback(f: impl Fn(&ThreadPanic) + Send + Sync + 'static) {
    install();
    let _ = FALLBACK.set(Box::new(f));
}

/// Sets the process's panic handler (once) and adds `target` to what a panic stops. Targets
/// that have gone are dropped here.
pub(crate) fn register(target: Weak<dyn OnPanic>) {
    install();
    let mut t = TARGETS.lock().unwrap_or_else(|p| p.into_inner());
    t.retain(|w| w.strong_count() > 0);
    t.push(target);
}

/// The handler: the panic's event, then every live target stops.
fn handle(p: &ThreadPanic) {
    crate::event_monitor::emit("vmm", "panic", panic_properties(p, true));
    let targets: Vec<Arc<dyn OnPanic>> =
        TARGETS.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(Weak::upgrade).collect();
    if targets.is_empty() {
        if let Some(f) = FALLBACK.get() {
            f(p);
        }
    }
    for t in targets {
        t.panicked(p);
    }
}

/// The `panic` event's properties. `stops_vm` is false for a contained job's panic.
pub fn panic_properties(p: &ThreadPanic, stops_vm: bool) -> serde_json::Value {
    json!({"thread_kind": p.kind.name(), "thread": p.thread, "message": p.message, "stops_vm": stops_vm})
}

/// Reports a job's contained panic on the event monitor (the VM runs on).
pub fn contained(p: &ThreadPanic) {
    crate::event_monitor::emit("vmm", "panic", panic_properties(p, false));
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_sandbox::ThreadKind;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counter(AtomicUsize);
    impl OnPanic for Counter {
        fn panicked(&self, p: &ThreadPanic) {
            if p.message == "panics-test" {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn a_thread_panic_reaches_every_live_target_and_no_dropped_one() {
        let live = Arc::new(Counter(AtomicUsize::new(0)));
        let gone = Arc::new(Counter(AtomicUsize::new(0)));
        register(Arc::downgrade(&live) as Weak<dyn OnPanic>);
        register(Arc::downgrade(&gone) as Weak<dyn OnPanic>);
        let gone_weak = Arc::downgrade(&gone);
        drop(gone);
        let t = kumo_sandbox::spawn(ThreadKind::Device, "panics-test", || panic!("panics-test")).unwrap();
        assert!(t.join().is_err());
        assert_eq!(live.0.load(Ordering::SeqCst), 1);
        assert!(gone_weak.upgrade().is_none());
        let v = panic_properties(
            &ThreadPanic { kind: ThreadKind::Vcpu, thread: "vcpu0".into(), message: "m".into() },
            true,
        );
        assert_eq!(v, json!({"thread_kind": "vcpu", "thread": "vcpu0", "message": "m", "stops_vm": true}));
    }
}
