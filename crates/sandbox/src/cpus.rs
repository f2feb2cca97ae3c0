//! Which host CPUs kumo's threads run on: the calls (by thread id) and the rule for every
//! thread that is not a vCPU ("I/O threads": devices, the API and its connections, the console,
//! migrations). A VM whose vCPUs are pinned keeps those threads off the pinned CPUs, so a pinned
//! vCPU's CPU is its own (`kumo_vmm::placement::io_cpus` says which CPUs; this module applies
//! them). Every thread [`crate::spawn`] starts is registered while it lives: a new rule reaches
//! the threads running, and a thread that starts later takes it before its seccomp filter (which
//! may not allow the call).

use std::io;
use std::sync::{Mutex, OnceLock};

use crate::kind::ThreadKind;
use crate::thread::lock;

/// Sets the CPUs thread `tid` (a kernel thread id; 0: the calling thread) may run on: how a
/// vCPU is re-pinned (or, with every online CPU, unpinned) from the API thread without waking it.
pub fn set_affinity(tid: i32, cpus: &[u32]) -> io::Result<()> {
    if let Some(&c) = cpus.iter().find(|&&c| c as usize >= libc::CPU_SETSIZE as usize) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("host CPU {c} is beyond CPU_SETSIZE")));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (every cpu checked
    // below CPU_SETSIZE above) and sched_setaffinity reads exactly size_of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c as usize, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The host CPUs thread `tid` (0: the calling thread) may run on, ascending.
pub fn affinity_of(tid: i32) -> io::Result<Vec<u32>> {
    // SAFETY: sched_getaffinity writes at most size_of cpu_set_t into a set we own;
    // CPU_ISSET reads it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as u32).filter(|&c| libc::CPU_ISSET(c as usize, &set)).collect())
    }
}

/// The calling thread's kernel thread id.
pub fn this_tid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

struct Registry {
    /// The threads `spawn` started that still run: kernel thread id and kind.
    threads: Vec<(i32, ThreadKind)>,
    /// The CPUs of the threads that are not vCPUs, once a rule is set.
    io_cpus: Option<Vec<u32>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { threads: Vec::new(), io_cpus: None });

/// A running thread's entry in the registry, removed when it is dropped (as the thread ends).
pub struct Registered(i32);

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&REGISTRY).threads.retain(|&(t, _)| t != self.0);
    }
}

/// Registers the calling thread, of `kind`. A thread that is not a vCPU takes the I/O CPUs if
/// a rule is set and `apply` (not a scoped helper: it inherits its creator's CPUs, and the
/// creator's filter, which may refuse the call).
pub(crate) fn register(kind: ThreadKind, apply: bool) -> Registered {
    let tid = this_tid();
    let mut r = lock(&REGISTRY);
    r.threads.push((tid, kind));
    if let (true, Some(cpus)) = (apply && kind != ThreadKind::Vcpu, &r.io_cpus) {
        if let Err(e) = set_affinity(0, cpus) {
            tracing::warn!("a {kind} thread did not take the I/O CPUs {cpus:?}: {e}");
        }
    }
    Registered(tid)
}

/// Registers the calling thread, one `spawn` did not start (the main thread), of `kind`, for
/// as long as the guard lives.
pub fn register_this_thread(kind: ThreadKind) -> Registered {
    register(kind, true)
}

static PROCESS_CPUS: OnceLock<Vec<u32>> = OnceLock::new();

/// The host CPUs the process may use: the calling thread's at the first call, which comes before
/// any rule (a VM's vCPU manager asks as it is made, [`set_io_cpus`] before it sets one), so a
/// later VM of the same process (a reboot, `vm.create` again) does not take the I/O threads'
/// CPUs for its own. Empty if they cannot be read.
pub fn process_cpus() -> Vec<u32> {
    PROCESS_CPUS.get_or_init(|| affinity_of(0).unwrap_or_default()).clone()
}

/// Puts every thread but the vCPUs on `cpus`, those running and those started later. A thread
/// that ended meanwhile is skipped; the first other failure is returned (after trying them all).
pub fn set_io_cpus(cpus: &[u32]) -> io::Result<()> {
    process_cpus();
    let mut r = lock(&REGISTRY);
    r.io_cpus = Some(cpus.to_vec());
    let mut first = Ok(());
    for &(tid, kind) in &r.threads {
        if kind == ThreadKind::Vcpu {
            continue;
        }
        match set_affinity(tid, cpus) {
            Err(e) if e.raw_os_error() != Some(libc::ESRCH) && first.is_ok() => first = Err(e),
            _ => {}
        }
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn affinity(tid: i32) -> Vec<u32> {
        affinity_of(tid).unwrap()
    }

    /// In a child process: the rule is process-wide, and would reach other tests' threads.
    #[test]
    fn the_io_rule_reaches_running_and_later_threads_but_not_vcpus() {
        let all = affinity(0);
        if all.len() < 2 {
            return eprintln!("skipping: needs two CPUs this process may use");
        }
        let io = vec![all[0]];
        let want = format!("Device {io:?}\nVcpu {all:?}\nApi {io:?}\nleft 0\nprocess {all:?}\n");
        let (status, out) = crate::seccomp::tests::in_child(|| {
            let (tx, rx) = mpsc::channel();
            // A thread of `kind` that reports its CPUs when told to.
            let start = |kind: ThreadKind| {
                let (go_tx, go_rx) = mpsc::channel::<()>();
                let tx = tx.clone();
                let h = crate::spawn(kind, format!("cpus-{kind}"), move || {
                    go_rx.recv().unwrap();
                    tx.send(format!("{kind:?} {:?}\n", affinity(0))).unwrap();
                    this_tid()
                })
                .unwrap();
                (h, go_tx)
            };
            let running = start(ThreadKind::Device);
            let vcpu = start(ThreadKind::Vcpu);
            set_io_cpus(&io).unwrap();
            let later = start(ThreadKind::Api);
            let (mut report, mut tids) = (String::new(), Vec::new());
            for (h, go) in [running, vcpu, later] {
                go.send(()).unwrap();
                report += &rx.recv().unwrap();
                tids.push(h.join().unwrap());
            }
            // Ended threads leave the registry.
            let left = lock(&REGISTRY).threads.iter().filter(|(t, _)| tids.contains(t)).count();
            report += &format!("left {left}\n");
            // Asked from a thread under the rule, the process's CPUs are still all of them.
            let asked = crate::spawn(ThreadKind::Api, "cpus-ask", process_cpus).unwrap().join().unwrap();
            report += &format!("process {asked:?}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), report.as_bytes());
        });
        assert_eq!((status, out), (0, want));
    }
}
