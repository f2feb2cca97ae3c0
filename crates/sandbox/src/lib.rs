//! How kumo contains itself (docs/security.md).
//!
//! Every kumo thread is started through [`thread::spawn`] with its [`ThreadKind`]: the thread
//! runs under a panic guard that reports the panic to the process (the VMM turns it into the
//! VM's stop reason) and, once the sandbox is configured, under its kind's seccomp filter.

pub mod fs;
pub mod hooks;
pub mod sock;
pub mod thread;

pub use hooks::{test_hook, test_hook_once};
pub use thread::{contain, spawn, spawn_scoped, ThreadKind, ThreadPanic};
