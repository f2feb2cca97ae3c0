//! A VMM process's threads as the host sees them, for the kumo-vs-QEMU section: the CPU its
//! threads other than the vCPUs spend (the VMM's own cost of moving frames: kumo's NIC thread,
//! QEMU's main loop), and pinning those threads and the vCPUs to CPUs of their own. The same
//! rule for both VMMs: the bench does it from outside, by thread id.

use std::path::Path;

/// Every thread of `pid` (`/proc/PID/task`).
fn tids(pid: u32) -> Result<Vec<i32>, String> {
    let dir = format!("/proc/{pid}/task");
    let rd = std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))?;
    Ok(rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
}

/// The CPU time a thread has had, ns (`schedstat`'s first field); None once it is gone.
fn cpu_ns(pid: u32, tid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(Path::new(&format!("/proc/{pid}/task/{tid}/schedstat"))).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// The CPU time, ns, that `pid`'s threads other than `vcpus` have had. A thread that ended
/// meanwhile takes its time with it: these VMMs' I/O threads live as long as the VM.
pub fn cpu_ns_outside(pid: u32, vcpus: &[i32]) -> Result<u64, String> {
    Ok(tids(pid)?.into_iter().filter(|t| !vcpus.contains(t)).filter_map(|t| cpu_ns(pid, t)).sum())
}

/// kumo's vCPU threads: named `vcpuN`.
pub fn kumo_vcpu_tids(pid: u32) -> Result<Vec<i32>, String> {
    let named = |t: &i32| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{t}/comm")).is_ok_and(|c| c.trim_end().starts_with("vcpu"))
    };
    let v: Vec<i32> = tids(pid)?.into_iter().filter(named).collect();
    if v.is_empty() {
        return Err(format!("kumo pid {pid} has no vcpu thread"));
    }
    Ok(v)
}

/// The CPUs of a pinned run: the vCPUs on one, every other thread of the VMM on another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Pins {
    pub io_cpu: u32,
    pub vcpu_cpu: u32,
}

impl Pins {
    /// The last two CPUs this process may use (the vCPUs on the last), or why there are not two.
    pub fn of_this_host() -> Result<Pins, String> {
        let mine = kumo_vm::sched::thread_affinity().map_err(|e| format!("cannot read this thread's CPUs: {e}"))?;
        match mine[..] {
            [.., io_cpu, vcpu_cpu] => Ok(Pins { io_cpu, vcpu_cpu }),
            _ => Err(format!("pinned rows need two host CPUs; this process may use {mine:?}")),
        }
    }

    /// Checks that `pid` keeps its threads apart by itself: `vcpus` on `vcpu_cpu` alone, no
    /// other thread on it (KVM's own workers in the process aside).
    pub fn check_kept_apart(&self, pid: u32, vcpus: &[i32]) -> Result<(), String> {
        for t in tids(pid)? {
            let name = std::fs::read_to_string(format!("/proc/{pid}/task/{t}/comm")).unwrap_or_default();
            let Ok(cpus) = kumo_vm::sched::affinity_of(t) else { continue }; // gone since listed
            let apart = if vcpus.contains(&t) { cpus == [self.vcpu_cpu] } else { !cpus.contains(&self.vcpu_cpu) };
            if !apart && !name.starts_with("kvm-") {
                return Err(format!(
                    "thread {t} ({}) of pid {pid} may run on CPUs {cpus:?} (vCPU CPU {})",
                    name.trim(),
                    self.vcpu_cpu
                ));
            }
        }
        Ok(())
    }

    /// Pins `pid`'s threads: `vcpus` to `vcpu_cpu`, the rest to `io_cpu`.
    pub fn apply(&self, pid: u32, vcpus: &[i32]) -> Result<(), String> {
        for t in tids(pid)? {
            let cpu = if vcpus.contains(&t) { self.vcpu_cpu } else { self.io_cpu };
            match kumo_vm::sched::set_affinity(t, &[cpu]) {
                Ok(()) => {}
                // Gone since it was listed (a short-lived helper thread).
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(format!("cannot pin thread {t} of pid {pid} to CPU {cpu}: {e}")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_threads_and_their_cpu_time() {
        let me = std::process::id();
        let all = tids(me).unwrap();
        assert!(all.contains(&(me as i32)));
        // Burn some CPU on this thread so its time is not zero.
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let tid = kumo_vm::sched::this_tid();
        let with = cpu_ns_outside(me, &[]).unwrap();
        let without = cpu_ns_outside(me, &[tid]).unwrap();
        assert!(with > without, "{with} vs {without}");
        assert!(kumo_vcpu_tids(me).is_err(), "a test process has no vcpu threads");
    }
}
