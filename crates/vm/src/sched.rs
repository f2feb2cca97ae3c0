//! The calling thread's (or a vCPU thread's) host scheduling, as system calls: which host CPUs
//! it may run on (`sched_setaffinity`) and real-time priority (`sched_setscheduler`). Only the
//! mechanism, kept here with kumo's other `unsafe`; what a VM's threads get (pins, mirror
//! mode, when a thread is prioritized) is decided in `kumo_vmm::placement`.

/// The calling thread at real-time priority (`SCHED_FIFO` 1) until dropped, when its old policy
/// comes back. For control threads that must not wait behind vCPU threads spinning on every
/// host CPU (elastic sharing's lend path): they block in between, so they cannot starve the
/// vCPUs. Without CAP_SYS_NICE it is an error and the caller runs on unprioritized.
pub struct RealtimeGuard {
    policy: libc::c_int,
    param: libc::sched_param,
}

pub fn realtime_this_thread() -> std::io::Result<RealtimeGuard> {
    // SAFETY: sched_getscheduler/sched_getparam/sched_setscheduler with pid 0 act on the calling
    // thread only; `param` is a valid sched_param the calls read or fill.
    unsafe {
        let policy = libc::sched_getscheduler(0);
        let mut param: libc::sched_param = std::mem::zeroed();
        if policy < 0 || libc::sched_getparam(0, &mut param) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rt = libc::sched_param { sched_priority: 1 };
        if libc::sched_setscheduler(0, libc::SCHED_FIFO, &rt) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RealtimeGuard { policy, param })
    }
}

impl Drop for RealtimeGuard {
    fn drop(&mut self) {
        // SAFETY: as above: the calling thread's own policy, from values it had before.
        unsafe {
            libc::sched_setscheduler(0, self.policy, &self.param);
        }
    }
}

/// Pins the calling thread to host CPU `cpu` (`sched_setaffinity`); a vCPU thread calls it
/// before its first `KVM_RUN`, and again when re-pinned.
pub fn pin_thread(cpu: u32) -> std::io::Result<()> {
    if cpu as usize >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("host CPU {cpu} is beyond CPU_SETSIZE"),
        ));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (cpu < CPU_SETSIZE
    // checked above) and sched_setaffinity(0 = this thread) reads exactly size_of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub use kumo_sandbox::cpus::{affinity_of, set_affinity, this_tid};

/// The host CPUs the calling thread may run on (`sched_getaffinity`), ascending.
pub fn thread_affinity() -> std::io::Result<Vec<u32>> {
    affinity_of(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_this_thread_to_cpu_0() {
        std::thread::spawn(|| {
            if !thread_affinity().unwrap().contains(&0) {
                eprintln!("skipping: CPU 0 is not in this process's affinity mask");
                return;
            }
            pin_thread(0).unwrap();
            assert_eq!(thread_affinity().unwrap(), [0]);
        })
        .join()
        .unwrap();
        assert!(pin_thread(100_000).is_err());
    }

    #[test]
    fn affinity_of_this_thread_reads_back() {
        let before = affinity_of(0).unwrap();
        assert_eq!(before, thread_affinity().unwrap());
        assert!(!before.is_empty());
        let tid = this_tid();
        set_affinity(tid, &before[..1]).unwrap();
        assert_eq!(affinity_of(tid).unwrap(), &before[..1]);
        set_affinity(tid, &before).unwrap();
        assert_eq!(affinity_of(0).unwrap(), before);
        assert!(set_affinity(tid, &[u32::MAX]).is_err());
    }
}
