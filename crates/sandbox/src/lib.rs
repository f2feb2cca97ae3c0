//! How kumo contains itself (docs/security.md).
//!
//! Every kumo thread is started through [`thread::spawn`] with its [`ThreadKind`]: the thread
//! runs under a panic guard that reports the panic to the process (the VMM turns it into the
//! VM's stop reason) and, once the process has chosen its [`seccomp::Mode`], under its kind's
//! seccomp filter. [`landlock`] limits the paths the process may open after its setup.
//! [`cpus`] keeps the registry of those threads and the host CPUs of the ones that are not vCPUs.

pub mod cpus;
pub mod fs;
pub mod hooks;
mod kind;
pub mod landlock;
pub mod seccomp;
pub mod sock;
pub mod thread;

pub use hooks::{test_hook, test_hook_once};
pub use kind::ThreadKind;
pub use thread::{contain, lock, spawn, spawn_scoped, ThreadPanic};
