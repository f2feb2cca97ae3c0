use super::*;

#[test]
fn every_kind_and_the_spawner_compile_in_both_modes() {
    for mode in [Mode::Trap, Mode::Log] {
        for kind in ThreadKind::ALL {
            assert!(!compile(Some(kind), mode).unwrap().is_empty(), "{kind}");
        }
        assert!(!compile(None, mode).unwrap().is_empty());
    }
}

#[test]
fn modes_parse_as_the_flag_says() {
    assert_eq!("true".parse::<Mode>().unwrap(), Mode::Trap);
    assert_eq!("false".parse::<Mode>().unwrap(), Mode::Off);
    assert_eq!("log".parse::<Mode>().unwrap(), Mode::Log);
    assert!("yes".parse::<Mode>().unwrap_err().contains("true, false or log"));
}

#[test]
fn the_spawner_allows_what_every_kind_allows() {
    let all = rules::spawner(1);
    for kind in ThreadKind::ALL {
        for call in rules::for_kind(kind, 1).keys() {
            assert!(all.contains_key(call), "{kind}: {}", syscall_name(*call as i32));
        }
    }
}

#[test]
fn no_kind_may_exec_trace_or_mount() {
    for kind in ThreadKind::ALL {
        let r = rules::for_kind(kind, 1);
        for call in
            [libc::SYS_execve, libc::SYS_execveat, libc::SYS_ptrace, libc::SYS_mount, libc::SYS_fork, libc::SYS_syslog]
        {
            assert!(!r.contains_key(&call), "{kind} allows {}", syscall_name(call as i32));
        }
    }
}

/// Runs `child` in a forked process and returns its exit status and what it wrote to stderr.
pub(crate) fn in_child(child: impl FnOnce()) -> (i32, String) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-int array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child only runs `child` (filters, a syscall, write, _exit) and never returns
    // into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: dup2 on the pipe's write end and stderr, in the child only.
        unsafe { libc::dup2(fds[1], 2) };
        child();
        // SAFETY: ends the child without running the harness's exit path.
        unsafe { libc::_exit(0) };
    }
    let mut out = Vec::new();
    // SAFETY: closing our copy of the write end, then reading the child's stderr into a
    // buffer of the given length.
    unsafe {
        libc::close(fds[1]);
        let mut buf = [0u8; 512];
        loop {
            let n = libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                break;
            }
            out.extend_from_slice(&buf[..n as usize]);
        }
        libc::close(fds[0]);
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    (libc::WEXITSTATUS(status), String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn an_api_thread_that_calls_outside_its_list_stops_the_process_naming_the_call() {
    let prog = compile(Some(ThreadKind::Api), Mode::Trap).unwrap();
    let (status, err) = in_child(|| {
        trap::install_handler().unwrap();
        trap::set_current(ThreadKind::Api, "kumo-api-conn");
        seccompiler::apply_filter(&prog).unwrap();
        // Allowed calls still work...
        // SAFETY: getpid takes no arguments.
        unsafe { libc::getpid() };
        // ...and one outside the list is trapped.
        forbidden_call();
    });
    assert_eq!(status, EXIT_STATUS, "{err}");
    assert!(err.contains("the api thread kumo-api-conn made a forbidden system call: syslog (103)"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn log_mode_lets_the_call_through() {
    let prog = compile(Some(ThreadKind::Vcpu), Mode::Log).unwrap();
    let (status, err) = in_child(|| {
        trap::install_handler().unwrap();
        seccompiler::apply_filter(&prog).unwrap();
        forbidden_call();
    });
    assert_eq!((status, err.as_str()), (0, ""));
}

#[test]
fn a_control_thread_creates_threads_but_no_process() {
    let prog = compile(Some(ThreadKind::Migration), Mode::Trap).unwrap();
    let no_clone3 = no_clone3().unwrap();
    let (status, err) = in_child(|| {
        trap::install_handler().unwrap();
        trap::set_current(ThreadKind::Migration, "mig-send");
        assert!(creates_threads(ThreadKind::Migration) && !creates_threads(ThreadKind::Vcpu));
        apply(&prog, Some(&no_clone3)).unwrap();
        // A thread: clone3 fails with ENOSYS, glibc falls back to clone with CLONE_THREAD.
        std::thread::scope(|s| s.spawn(|| ()).join().unwrap());
        let _ = std::io::Write::write_all(&mut std::io::stderr(), b"thread ok\n");
        // A process: clone without CLONE_THREAD is trapped.
        // SAFETY: the child of this fork (if any) exits at once.
        if unsafe { libc::fork() } == 0 {
            // SAFETY: ends the grandchild at once.
            unsafe { libc::_exit(0) };
        }
    });
    assert_eq!(status, EXIT_STATUS, "{err}");
    assert!(err.starts_with("thread ok\n"), "{err}");
    assert!(err.contains("the migration thread mig-send made a forbidden system call: clone (56)"), "{err}");
}

#[test]
fn a_disks_io_is_allowed_where_it_runs() {
    // The pool's threads and the event loop (Device), and the control threads that make disks.
    let io = [libc::SYS_preadv, libc::SYS_pwritev, libc::SYS_pwrite64, libc::SYS_fdatasync, libc::SYS_fallocate];
    for kind in [ThreadKind::Device, ThreadKind::Vmm, ThreadKind::Api, ThreadKind::Migration] {
        let r = rules::for_kind(kind, 1);
        for call in io.iter().chain(&[libc::SYS_io_uring_enter, libc::SYS_poll]) {
            assert!(r.contains_key(call), "{kind} lacks {}", syscall_name(*call as i32));
        }
    }
    for kind in [ThreadKind::Vmm, ThreadKind::Api, ThreadKind::Migration] {
        let r = rules::for_kind(kind, 1);
        assert!(r.contains_key(&libc::SYS_io_uring_setup) && r.contains_key(&libc::SYS_io_uring_register), "{kind}");
    }
}

/// The CPUs of thread `tid` (0: the caller) as a list.
fn cpus_of(tid: libc::pid_t) -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set is valid and sized as passed.
    assert_eq!(unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
    // SAFETY: CPU_ISSET reads the set filled above.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

#[test]
fn a_filtered_callers_thread_starts_with_its_cpus_and_the_spawner_keeps_its_own() {
    let all = cpus_of(0);
    let (status, err) = in_child(|| {
        // Unfiltered: it reads the spawner's CPUs once the filtered thread has spawned.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let helper = std::thread::spawn(move || {
            wait.recv().unwrap();
            let spawner = std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|e| e.ok())
                .find(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "kumo-spawner"))
                .map(|e| e.file_name().to_string_lossy().parse::<libc::pid_t>().unwrap())
                .expect("a spawner thread");
            cpus_of(spawner)
        });
        init(Mode::Trap).unwrap();
        let first = cpus_of(0)[0];
        // SAFETY: a set holding only `first`, applied to the calling thread.
        unsafe {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(first, &mut one);
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one), 0);
        }
        filter_this_thread(ThreadKind::Vmm, "t-caller").unwrap();
        let child = crate::spawn(ThreadKind::Vmm, "t-child", || cpus_of(0)).unwrap().join().unwrap();
        go.send(()).unwrap();
        let spawner = helper.join().unwrap();
        let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{child:?} {spawner:?}\n").as_bytes());
    });
    assert_eq!(status, 0, "{err}");
    assert_eq!(err.trim(), format!("{:?} {all:?}", [all[0]]), "{err}");
}
