//! The sandbox end to end (docs/security.md, "Sandbox"): every thread of a running VM is under
//! its seccomp filter, a forbidden system call stops the VM with a message naming it and the
//! thread's kind, and kumo runs as an ordinary user with access to /dev/kvm.

use kumo_testkit::*;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;

/// Each thread of process `pid`: its name (comm) and the `Seccomp:` and `NoNewPrivs:` fields
/// of its status.
fn threads(pid: u32) -> Vec<(String, String, String)> {
    let mut v = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return v };
    for t in tasks.flatten() {
        // A task that cannot be read any more ended after the listing (a connection's thread):
        // it runs nothing, filtered or not.
        let read = |f: &str| std::fs::read_to_string(t.path().join(f));
        let (Ok(comm), Ok(status)) = (read("comm"), read("status")) else { continue };
        let field =
            |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(|s| s.trim().to_string()).unwrap_or_default();
        v.push((comm.trim().to_string(), field("Seccomp:"), field("NoNewPrivs:")));
    }
    v
}

#[test]
fn every_thread_of_a_running_vm_is_filtered() {
    let test = "every_thread_of_a_running_vm_is_filtered";
    if !kvm_or_skip(test) {
        return;
    }
    let dir = TestDir::new();
    let (api, console) = (dir.arg("api.sock"), dir.arg("console.sock"));
    let args = ["run", "--guest", "memtouch", "pages=64", "until_input=1", "--cpus", "2", "--api-socket", &api];
    let mut vm = Kid::spawn(&[&args[..], &["--console-socket", &console]].concat()).named("kumo");
    // An API connection and a console client keep their threads alive while we look.
    let _api_conn = eventually(PATIENCE, || UnixStream::connect(&api).ok());
    let _console_conn = eventually(PATIENCE, || UnixStream::connect(&console).ok());
    let want = ["kumo", "kumo-spawner", "signals", "vcpu0", "vcpu1", "kumo-api", "kumo-api-conn", "console-client"];
    let seen = eventually(PATIENCE, || {
        let t = threads(vm.id());
        // The main thread takes its filter after its setup, which may still be under way.
        let main_filtered = t.iter().any(|(c, sc, _)| c == "kumo" && sc == "2");
        (main_filtered && want.iter().all(|w| t.iter().any(|(c, ..)| c == w))).then_some(t)
    });
    let unfiltered: Vec<_> = seen.iter().filter(|(_, sc, nnp)| sc != "2" || nnp != "1").collect();
    assert!(unfiltered.is_empty(), "threads not under a filter (name, Seccomp, NoNewPrivs): {unfiltered:?}");
    eprintln!("{test}: {} threads, all filtered: {:?}", seen.len(), seen.iter().map(|t| &t.0).collect::<Vec<_>>());
    vm.stop_guest();
    let (code, _, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_forbidden_call_stops_the_vm_naming_the_call_and_the_kind() {
    let test = "a_forbidden_call_stops_the_vm_naming_the_call_and_the_kind";
    if !kvm_or_skip(test) {
        return;
    }
    if !cfg!(debug_assertions) {
        eprintln!("skipping {test}: test hooks exist in debug builds only");
        return;
    }
    let dir = TestDir::new();
    let api = dir.arg("api.sock");
    for (hook, kind) in [("seccomp-violation:vcpu", "vcpu"), ("seccomp-violation:api", "api")] {
        let o = Command::new(kumo_bin())
            .args(["run", "--guest", "memtouch", "pages=64", "until_input=1", "--api-socket", &api])
            .env("KUMO_TEST_HOOK", hook)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run kumo");
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(159), "{hook}: {err}");
        let line = err.lines().find(|l| l.contains("forbidden system call")).unwrap_or_else(|| panic!("{hook}: {err}"));
        assert!(line.contains(&format!("the {kind} thread ")) && line.contains(": syslog (103)"), "{line}");
        let _ = std::fs::remove_file(&api);
    }
    // Under --seccomp log the same call is let through (the kernel logs it).
    let o = Command::new(kumo_bin())
        .args(["run", "--guest", "hello", "--seccomp", "log"])
        .env("KUMO_TEST_HOOK", "seccomp-violation:vcpu")
        .output()
        .expect("run kumo");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
}

/// A user made for the test, with an ACL entry on /dev/kvm; on drop the user is removed and
/// /dev/kvm's ACL set back to what it was.
struct TempUser {
    name: String,
    uid: u32,
    gid: u32,
    /// /dev/kvm's ACL before (`getfacl -c`), once it has been changed.
    kvm_acl: Option<String>,
}

impl TempUser {
    /// Creates the user and lets it open /dev/kvm, or says why it cannot.
    fn new() -> Result<TempUser, String> {
        let name = format!("kumot{}", std::process::id());
        let run = |cmd: &str, args: &[&str]| -> Result<String, String> {
            let o = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
            let (out, err) = text(&o);
            o.status.success().then_some(out).ok_or_else(|| format!("{cmd} {args:?}: {err}"))
        };
        run("useradd", &["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", &name])?;
        let id =
            |flag: &str| run("id", &[flag, &name]).and_then(|s| s.trim().parse::<u32>().map_err(|e| e.to_string()));
        let mut user = TempUser { uid: id("-u")?, gid: id("-g")?, name, kvm_acl: None };
        // Dropped on failure from here: the user is removed again.
        let before = run("getfacl", &["-c", "/dev/kvm"])?;
        run("setfacl", &["-m", &format!("u:{}:rw", user.name), "/dev/kvm"])?;
        user.kvm_acl = Some(before);
        Ok(user)
    }
}

impl Drop for TempUser {
    fn drop(&mut self) {
        if let Some(acl) = &self.kvm_acl {
            use std::io::Write;
            let restore =
                Command::new("setfacl").args(["--set-file=-", "/dev/kvm"]).stdin(std::process::Stdio::piped()).spawn();
            if let Ok(mut c) = restore {
                let _ = c.stdin.take().map(|mut i| i.write_all(acl.as_bytes()));
                let _ = c.wait();
            }
        }
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

#[test]
fn kumo_runs_as_an_ordinary_user_with_kvm_access() {
    let test = "kumo_runs_as_an_ordinary_user_with_kvm_access";
    if !kvm_or_skip(test) {
        return;
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let dir = TestDir::new();
    let (user, bin) = if euid == 0 {
        let user = match TempUser::new() {
            Ok(u) => u,
            Err(e) => {
                eprintln!("skipping {test}: cannot make an unprivileged user: {e}");
                return;
            }
        };
        // The user must reach the binary and the socket's directory: a private copy in a
        // directory it owns.
        let bin = dir.path("kumo");
        std::fs::copy(kumo_bin(), &bin).expect("copy kumo");
        chown(dir.path(".").as_path(), user.uid, user.gid);
        (Some(user), bin)
    } else {
        // Already unprivileged: this user can run kumo if it can open /dev/kvm (checked above).
        (None, kumo_bin())
    };
    let api = dir.arg("api.sock");
    let mut cmd = Command::new(&bin);
    cmd.args(["run", "--guest", "memtouch", "pages=64", "until_input=1", "--api-socket", &api])
        .current_dir(dir.path("."));
    if let Some(u) = &user {
        std::os::unix::process::CommandExt::uid(&mut cmd, u.uid);
        std::os::unix::process::CommandExt::gid(&mut cmd, u.gid);
    }
    let mut vm = Kid::spawn_cmd(&mut cmd).named("kumo (unprivileged)");
    let info = eventually(PATIENCE, || {
        let o = kumo(&["--api-socket", &api, "info"]);
        o.status.success().then(|| text(&o).0)
    });
    assert!(info.contains("\"running\"") || info.contains("running"), "{info}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.id())).unwrap_or_default();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap_or_default().split_whitespace().next();
    assert_eq!(uid, Some(user.as_ref().map_or(euid, |u| u.uid).to_string().as_str()), "{status}");
    vm.stop_guest();
    let (code, _, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
    eprintln!("{test}: kumo ran as uid {uid:?}, booted memtouch and answered vm.info");
}

fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).expect("chown the test directory");
}

#[test]
fn landlock_confines_snapshots_to_the_paths_given() {
    let test = "landlock_confines_snapshots_to_the_paths_given";
    if !kvm_or_skip(test) {
        return;
    }
    let dir = TestDir::new();
    for d in ["api", "snaps", "other"] {
        std::fs::create_dir(dir.path(d)).expect("mkdir");
    }
    let api = dir.path("api").join("api.sock").to_str().unwrap().to_string();
    let snaps = format!("{}:rw", dir.arg("snaps"));
    let args = ["run", "--guest", "memtouch", "pages=64", "until_input=1", "--api-socket", &api];
    let mut vm = Kid::spawn(&[&args[..], &["--landlock", "--landlock-path", &snaps]].concat()).named("kumo");
    eventually(PATIENCE, || kumo(&["--api-socket", &api, "ping"]).status.success().then_some(()));
    let inside = dir.path("snaps").join("vm.snap");
    let o = kumo(&["--api-socket", &api, "snapshot", "--to", inside.to_str().unwrap()]);
    assert!(o.status.success(), "snapshot where --landlock-path allows: {:?}", text(&o));
    assert!(inside.exists());
    let outside = dir.path("other").join("vm.snap");
    let o = kumo(&["--api-socket", &api, "snapshot", "--to", outside.to_str().unwrap()]);
    let (_, err) = text(&o);
    let enforced = !o.status.success();
    if enforced {
        assert!(err.to_lowercase().contains("permission denied"), "{err}");
        assert!(!outside.exists() && std::fs::read_dir(dir.path("other")).unwrap().next().is_none());
    } else {
        eprintln!("{test}: the kernel has no Landlock: the snapshot outside the rules was written");
    }
    vm.stop_guest();
    let (code, _, err) = vm.wait();
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn every_thread_of_a_net_backend_is_filtered() {
    let test = "every_thread_of_a_net_backend_is_filtered";
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/net/tun").exists() {
        eprintln!("skipping {test}: creating a tap needs root and /dev/net/tun");
        return;
    }
    let dir = TestDir::new();
    let (sock, api) = (dir.arg("nic.sock"), dir.arg("backend.sock"));
    // The backend creates the tap (not persistent: it goes with the backend).
    let tap = format!("ksb{}", std::process::id() % 100_000);
    let kid = Kid::spawn(&["--api-socket", &api, "net-backend", "--tap", &tap, "--socket", &sock]).named("backend");
    eventually(PATIENCE, || kumo(&["--api-socket", &api, "net-backend", "info"]).status.success().then_some(()));
    let want = ["kumo", "kumo-spawner", "nb-accept", "nb-api"];
    let seen = eventually(PATIENCE, || {
        let t = threads(kid.id());
        // The main thread takes its filter after its setup, which may still be under way.
        let main_filtered = t.iter().any(|(c, sc, _)| c == "kumo" && sc == "2");
        (main_filtered && want.iter().all(|w| t.iter().any(|(c, ..)| c == w))).then_some(t)
    });
    let unfiltered: Vec<_> = seen.iter().filter(|(_, sc, nnp)| sc != "2" || nnp != "1").collect();
    assert!(unfiltered.is_empty(), "threads not under a filter (name, Seccomp, NoNewPrivs): {unfiltered:?}");
    kid.signal("TERM");
    let (code, _, err) = kid.wait();
    assert_eq!(code, Some(0), "{err}");
}

/// A panic in one of the backend's threads ends the backend cleanly: one line naming the thread
/// and the panic, exit status 101, its sockets removed (its VMs see the hang-up: link down).
#[test]
fn a_net_backend_thread_that_panics_ends_the_backend_and_removes_its_sockets() {
    let test = "a_net_backend_thread_that_panics_ends_the_backend_and_removes_its_sockets";
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/net/tun").exists() {
        eprintln!("skipping {test}: creating a tap needs root and /dev/net/tun");
        return;
    }
    let dir = TestDir::new();
    let (sock, api) = (dir.arg("nic.sock"), dir.arg("backend.sock"));
    let tap = format!("ksp{}", std::process::id() % 100_000);
    let kid = Kid::spawn_cmd(
        Command::new(kumo_bin())
            .args(["--api-socket", &api, "net-backend", "--tap", &tap, "--socket", &sock])
            .env("KUMO_TEST_HOOK", "panic:net-backend"),
    )
    .named("backend");
    eventually(PATIENCE, || kid.stderr().contains("vhost-user socket").then_some(()));
    // The API thread panics on this request.
    let o = kumo(&["--api-socket", &api, "net-backend", "info"]);
    assert!(!o.status.success(), "the request is not answered: {:?}", text(&o));
    let (code, _, err) = kid.wait();
    assert_eq!(code, Some(101), "{err}");
    assert!(err.contains("nb-api panicked: test hook panic:net-backend") && err.contains("exiting"), "{err}");
    assert!(!Path::new(&sock).exists() && !Path::new(&api).exists(), "the backend's sockets are removed");
}
