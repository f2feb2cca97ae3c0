//! The allow-lists: which system calls each kind of thread may make, with argument checks
//! where they pay (`ioctl` by request, `tgkill` within this process, `prctl` and `clone` by
//! operation). Derived from the code and from the suites run under `--seccomp log`
//! (docs/security.md says how to find a missing call).

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompRule};

use crate::ThreadKind;

/// A filter's rules: per system call, the argument rules of which one must match (none: any
/// arguments).
pub type Rules = BTreeMap<i64, Vec<SeccompRule>>;

use libc::*;

/// What every thread does: allocate, synchronize, tell the time, log to stderr or a log file,
/// handle the vCPU kick and its own end.
const BASE: &[c_long] = &[
    SYS_brk,
    SYS_mmap,
    SYS_munmap,
    SYS_mprotect,
    SYS_madvise,
    SYS_mremap,
    SYS_futex,
    SYS_sched_yield,
    SYS_set_robust_list,
    SYS_rseq,
    SYS_clock_gettime,
    SYS_clock_getres,
    SYS_gettimeofday,
    SYS_nanosleep,
    SYS_clock_nanosleep,
    SYS_getpid,
    SYS_gettid,
    SYS_getrandom,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sigaltstack,
    SYS_restart_syscall,
    SYS_sched_getaffinity,
    SYS_sched_getscheduler,
    SYS_sched_getparam,
    SYS_write,
    SYS_writev,
    SYS_close,
    SYS_exit,
    SYS_exit_group,
];

/// Reading and waiting on descriptors (eventfds, sockets, pipes, taps).
const IO: &[c_long] = &[
    SYS_read,
    SYS_readv,
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_poll,
    SYS_ppoll,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    SYS_eventfd2,
    SYS_fcntl,
    SYS_dup,
    SYS_dup3,
    SYS_lseek,
    SYS_fstat,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_timerfd_gettime,
];

/// A virtio-blk disk's I/O (`kumo_devices::virtio::block`): its pool's threads move data with
/// preadv/pwritev (in [`IO`]), flush and punch or zero ranges; its event loop starts io_uring
/// operations.
const DISK_IO: &[c_long] = &[SYS_fdatasync, SYS_fallocate, SYS_io_uring_enter];

/// Connected sockets: streams, vhost-user messages with descriptors.
const SOCKET_IO: &[c_long] = &[
    SYS_recvfrom,
    SYS_sendto,
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_shutdown,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_getsockname,
    SYS_getpeername,
];

/// Making sockets: listening, accepting, connecting (the API, migration, console, backend).
const SOCKET_SETUP: &[c_long] =
    &[SYS_socket, SYS_socketpair, SYS_bind, SYS_listen, SYS_accept, SYS_accept4, SYS_connect];

/// Files by path: snapshots, restores, sockets' removal, sysfs/procfs reads.
const FILES: &[c_long] = &[
    SYS_openat,
    SYS_open,
    SYS_newfstatat,
    SYS_statx,
    SYS_stat,
    SYS_lstat,
    SYS_access,
    SYS_faccessat,
    SYS_faccessat2,
    SYS_readlink,
    SYS_readlinkat,
    SYS_getdents64,
    SYS_getcwd,
    SYS_unlink,
    SYS_unlinkat,
    SYS_rename,
    SYS_renameat,
    SYS_renameat2,
    SYS_mkdir,
    SYS_mkdirat,
    SYS_rmdir,
    SYS_fsync,
    SYS_fdatasync,
    SYS_ftruncate,
    SYS_fallocate,
    SYS_fchmod,
    SYS_fchmodat,
    SYS_chmod,
    SYS_umask,
    SYS_pipe2,
    SYS_memfd_create,
    SYS_fstatfs,
    SYS_statfs,
    SYS_uname,
    SYS_sysinfo,
    SYS_prlimit64,
    SYS_getrusage,
    SYS_getuid,
    SYS_geteuid,
    SYS_getgid,
    SYS_getegid,
];

/// Guest memory placement and host CPU placement (NUMA, pinning, elastic lending).
const PLACEMENT: &[c_long] = &[
    SYS_mbind,
    SYS_set_mempolicy,
    SYS_get_mempolicy,
    SYS_move_pages,
    SYS_mlock,
    SYS_munlock,
    SYS_sched_setaffinity,
    SYS_sched_getscheduler,
    SYS_sched_setscheduler,
    SYS_sched_getparam,
    SYS_sched_setparam,
    SYS_getcpu,
];

/// Installing signal handlers (the vCPU kick is registered with the first vCPU, which a
/// restore or an incoming migration creates on a control thread).
const SIGNALS: &[c_long] = &[SYS_rt_sigaction];

const KVM_IOCTL_TYPE: u64 = 0xAE;
/// The TUN ioctls kumo uses (linux/if_tun.h).
const TUN_IOCTLS: &[u64] = &[
    0x4004_54ca, // TUNSETIFF
    0x8004_54d2, // TUNGETIFF
    0x4004_54d0, // TUNSETOFFLOAD
    0x4004_54d8, // TUNSETVNETHDRSZ
    0x4004_54d9, // TUNSETQUEUE
    0x8004_54cf, // TUNGETFEATURES
];
/// Opening a pseudo-terminal for a serial console (`vm.create`'s `Pty` mode): unlock and name
/// its slave, set raw mode.
const PTY_IOCTLS: &[u64] = &[TIOCSPTLCK, TIOCGPTN, TCSETS];
/// Terminal and descriptor ioctls std and the log make (isatty, non-blocking, queue sizes).
const FD_IOCTLS: &[u64] = &[TCGETS, FIONBIO, FIOCLEX, FIONCLEX, TIOCOUTQ, FIONREAD];

fn cond(arg: u8, op: Op, v: u64) -> Cond {
    Cond::new(arg, Len::Dword, op, v).expect("argument index below 6")
}

fn rule(conds: Vec<Cond>) -> SeccompRule {
    SeccompRule::new(conds).expect("a rule with conditions")
}

fn allow(r: &mut Rules, calls: &[c_long]) {
    for &c in calls {
        r.insert(c, Vec::new());
    }
}

/// Adds conditional rules for `call`, unless it is already allowed with any arguments.
fn allow_if(r: &mut Rules, call: c_long, rules: Vec<SeccompRule>) {
    match r.get_mut(&call) {
        Some(e) if e.is_empty() => {}
        Some(e) => e.extend(rules),
        None => {
            r.insert(call, rules);
        }
    }
}

/// ioctl: every KVM request (type 0xAE: vCPU, VM and system fds), plus `extra` requests.
fn ioctls(r: &mut Rules, extra: &[u64]) {
    let mut rules = vec![rule(vec![cond(1, Op::MaskedEq(0xff00), KVM_IOCTL_TYPE << 8)])];
    rules.extend(FD_IOCTLS.iter().chain(extra).map(|&req| rule(vec![cond(1, Op::Eq, req)])));
    allow_if(r, SYS_ioctl, rules);
}

/// The filter's rules for threads of `kind` (with `pid`, this process, for `tgkill`).
pub fn for_kind(kind: ThreadKind, pid: u32) -> Rules {
    let mut r = Rules::new();
    allow(&mut r, BASE);
    // Kicks and the panic path signal threads of this process only.
    allow_if(&mut r, SYS_tgkill, vec![rule(vec![cond(0, Op::Eq, pid.into())])]);
    match kind {
        ThreadKind::Vcpu => {
            // KVM_RUN and its exits: port and MMIO writes reach eventfds, the serial's output,
            // the console socket's queues; guest PCI programming maps BARs and routes MSIs; a
            // virtio-net driver's setup sets the tap's offloads or talks vhost-user.
            allow(&mut r, IO);
            allow(&mut r, SOCKET_IO);
            allow(&mut r, &[SYS_sched_setaffinity, SYS_sched_setscheduler]);
            own_priority(&mut r);
            ioctls(&mut r, TUN_IOCTLS);
        }
        ThreadKind::Device => {
            // Event loops: epoll, eventfds, taps, vhost-user messages, interrupt injection.
            allow(&mut r, IO);
            allow(&mut r, SOCKET_IO);
            allow(&mut r, DISK_IO);
            allow(&mut r, &[SYS_sched_setaffinity, SYS_sched_setscheduler]);
            own_priority(&mut r);
            ioctls(&mut r, TUN_IOCTLS);
        }
        ThreadKind::Console => {
            allow(&mut r, IO);
            allow(&mut r, SOCKET_IO);
            allow(&mut r, &[SYS_accept, SYS_accept4]);
            ioctls(&mut r, &[]);
        }
        ThreadKind::Signal => {
            // Waits on signal-hook's socket pair, shuts the VM down (pausing vCPUs, joining
            // threads), or removes the sockets and exits.
            allow(&mut r, IO);
            allow(&mut r, &[SYS_recvfrom, SYS_recvmsg]);
            // A socket is removed only if it is still the one kumo bound (its device and inode:
            // `kumo_sandbox::sock::remove_socket`), hence the stat calls.
            allow(&mut r, &[SYS_unlink, SYS_unlinkat, SYS_rt_sigaction]);
            allow(&mut r, &[SYS_newfstatat, SYS_statx, SYS_stat, SYS_lstat, SYS_fstat]);
            ioctls(&mut r, &[]);
        }
        ThreadKind::Api | ThreadKind::Migration | ThreadKind::Vmm => {
            // The control threads do the VMM's work: a restore or an incoming migration builds
            // a VM (KVM, guest memory, devices, taps), a snapshot writes a file (finding the
            // memory's holes with mincore and lseek), a migration connects to its peer and runs
            // scoped transfer threads, a lend moves CPUs and memory. One list for the three: an
            // API connection runs a snapshot's migration threads, whose filter stacks on its own.
            allow(&mut r, IO);
            allow(&mut r, SOCKET_IO);
            allow(&mut r, SOCKET_SETUP);
            allow(&mut r, FILES);
            allow(&mut r, PLACEMENT);
            allow(&mut r, SIGNALS);
            allow(&mut r, &[SYS_mincore]);
            // A migration to this host splices guest pages into its sockets.
            allow(&mut r, &[SYS_vmsplice, SYS_splice]);
            // A disk made here sets up its io_uring (or starts its pool).
            allow(&mut r, DISK_IO);
            allow(&mut r, &[SYS_io_uring_setup, SYS_io_uring_register]);
            ioctls(&mut r, &[TUN_IOCTLS, PTY_IOCTLS].concat());
            thread_creation(&mut r);
        }
        ThreadKind::NetBackend => {
            // The vhost-user-net backend: its sockets, the tap, the VM's memory fds, its API.
            allow(&mut r, IO);
            allow(&mut r, SOCKET_IO);
            allow(&mut r, SOCKET_SETUP);
            allow(
                &mut r,
                &[SYS_openat, SYS_unlink, SYS_unlinkat, SYS_newfstatat, SYS_statx, SYS_umask, SYS_fchmod, SYS_chmod],
            );
            // Each frontend's relay channel is a private socket in a fresh 0700 directory
            // (`kumo_sandbox::sock::PrivateSocket`), made and removed per connection.
            allow(&mut r, &[SYS_mkdir, SYS_mkdirat, SYS_rmdir]);
            allow(&mut r, SIGNALS);
            ioctls(&mut r, TUN_IOCTLS);
            // The vhost-user daemon library starts its own threads (they inherit this filter).
            thread_creation(&mut r);
        }
    }
    r
}

/// setpriority on the calling thread only (a dedicated interrupt path lowers its nice value).
fn own_priority(r: &mut Rules) {
    allow_if(r, SYS_setpriority, vec![rule(vec![cond(0, Op::Eq, PRIO_PROCESS as u64), cond(1, Op::Eq, 0)])]);
}

/// Creating threads: `clone` only with CLONE_THREAD (no new process), `clone3` (whose flags
/// live in memory a filter cannot read), naming the new thread, and a new thread's
/// installation of its own filter.
pub fn thread_creation(r: &mut Rules) {
    allow_if(r, SYS_clone, vec![rule(vec![cond(0, Op::MaskedEq(CLONE_THREAD as u64), CLONE_THREAD as u64)])]);
    allow(r, &[SYS_clone3, SYS_seccomp]);
    allow_if(
        r,
        SYS_prctl,
        vec![rule(vec![cond(0, Op::Eq, PR_SET_NAME as u64)]), rule(vec![cond(0, Op::Eq, PR_SET_NO_NEW_PRIVS as u64)])],
    );
}

/// The union of every kind's rules and thread creation: the filter of the thread that starts
/// threads for filtered threads, so that each new thread ends up with exactly its own kind's
/// filter (filters stack: a thread is held to every filter it inherited).
pub fn spawner(pid: u32) -> Rules {
    let mut all = Rules::new();
    for kind in ThreadKind::ALL {
        for (call, rules) in for_kind(kind, pid) {
            if rules.is_empty() {
                all.insert(call, Vec::new());
            } else {
                allow_if(&mut all, call, rules);
            }
        }
    }
    thread_creation(&mut all);
    // A new thread takes its creator's scheduling policy and CPUs (see `spawner`).
    allow(&mut all, &[SYS_sched_setaffinity, SYS_sched_setscheduler, SYS_sched_getscheduler, SYS_sched_getparam]);
    all
}
