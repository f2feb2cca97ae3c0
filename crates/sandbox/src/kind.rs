//! What a thread is (its kind, which picks its seccomp filter) and what a panic says: shared by
//! `thread` (spawning, guards) and `seccomp` (filters, the filtered panic hook).

use std::any::Any;

/// What a thread does; each kind gets its own seccomp filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ThreadKind {
    /// Runs one vCPU (`KVM_RUN` and its exits).
    Vcpu,
    /// Device work outside the vCPUs: the event loop, interrupt dispatchers, APIC timers.
    Device,
    /// The control API: the listener and one thread per connection.
    Api,
    /// Migration and snapshot jobs and their transfer threads.
    Migration,
    /// Signal handling (SIGTERM/SIGINT) in the `kumo run` process.
    Signal,
    /// Console plumbing: stdin, console socket clients.
    Console,
    /// Helpers of the VMM itself (throttle, elastic coordination, probes).
    Vmm,
    /// The vhost-user-net backend process's threads.
    NetBackend,
}

impl ThreadKind {
    /// Every kind, for tests and docs.
    pub const ALL: [ThreadKind; 8] = [
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::Api,
        ThreadKind::Migration,
        ThreadKind::Signal,
        ThreadKind::Console,
        ThreadKind::Vmm,
        ThreadKind::NetBackend,
    ];

    /// The kind's name in messages ("vcpu", "device", ...).
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Device => "device",
            ThreadKind::Api => "api",
            ThreadKind::Migration => "migration",
            ThreadKind::Signal => "signal",
            ThreadKind::Console => "console",
            ThreadKind::Vmm => "vmm",
            ThreadKind::NetBackend => "net-backend",
        }
    }
}

impl std::fmt::Display for ThreadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The text of a panic payload (`&str` or `String`; anything else has none).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}
