//! kumo-testkit: what kumo's end-to-end tests (`tests/`, compiled by kumo-cli) and its
//! benchmarks (kumo-bench) share, one copy each: the child-process harness ([`Kid`]), the
//! `kumo` binary they drive, temporary directories and ports, bounded waiting, guest output
//! checks, host network set-up ([`net`]), `kumo net-backend` ([`backend`]) and the QEMU harness that runs kumo's guests under
//! QEMU ([`qemu`]: `kumo bench migrate`'s comparison, tests/qemu_e2e.rs). It is never linked
//! into the `kumo` binary.

pub mod backend;
pub mod kid;
pub mod libvirt;
pub mod linux;
pub mod net;
pub mod pki;
pub mod qemu;

pub use kid::Kid;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long tests wait for something that normally takes a moment (a VM to start, a socket to
/// appear): only a safety net against hangs, far above any normal duration, so that a slow or
/// busy machine does not fail a test.
pub const PATIENCE: Duration = Duration::from_secs(300);

/// True if /dev/kvm can be opened. KVM tests print why they skip and return when it cannot.
pub fn kvm_or_skip(test: &str) -> bool {
    match kumo_vm::vm::open_kvm() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            false
        }
    }
}

/// The `kumo` binary: `$KUMO_BIN` (set by `kumo bench`), else `kumo` in cargo's target
/// directory beside this executable (a bench's) or one level up (a test's, in `deps/`).
pub fn kumo_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("KUMO_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let here = me.with_file_name("kumo");
    let up = me.parent().and_then(|d| d.parent()).map(|d| d.join("kumo"));
    match std::iter::once(here.clone()).chain(up).find(|p| p.is_file()) {
        Some(kumo) => Ok(kumo),
        None => Err(format!(
            "no kumo binary at {} (build it with `cargo build -p kumo-cli`, or set KUMO_BIN)",
            here.display()
        )),
    }
}

/// [`kumo_binary`], for tests.
pub fn kumo_bin() -> PathBuf {
    kumo_binary().unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `kumo ARGS` to completion.
pub fn kumo(args: &[&str]) -> Output {
    Command::new(kumo_bin()).args(args).stdin(Stdio::null()).output().expect("run kumo")
}

/// A finished command's (stdout, stderr) as text.
pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// `kumo --api-socket SOCK ARGS…`: (success, stdout, stderr).
pub fn kumo_api(sock: &str, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(kumo_bin()).args(["--api-socket", sock]).args(args).stdin(Stdio::null()).output().unwrap();
    let (out, err) = text(&o);
    (o.status.success(), out, err)
}

/// `kumo migrate ARGS` of the VM at `sock`: (success, stdout, stderr).
pub fn migrate(sock: &str, args: &[&str]) -> (bool, String, String) {
    kumo_api(sock, &[&["migrate"], args].concat())
}

/// The run state (`running`, `paused`, …) `kumo info` reports for the VM at `sock`; None while
/// its API does not answer.
pub fn vm_state(sock: &str) -> Option<String> {
    let (_, out, _) = kumo_api(sock, &["info"]);
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    v["state"].as_str().map(String::from)
}

/// `vm.info` of the VM at `sock`.
pub fn vm_info(sock: &str) -> kumo_api::VmInfo {
    kumo_api::ApiClient::new(sock).info().unwrap_or_else(|e| panic!("vm.info: {e}"))
}

/// A `kumo run --incoming ADDR EXTRA…` destination named `tag`, waited for until it listens
/// (a destination that exits instead fails the test at once, with its stderr).
pub fn incoming(addr: &str, extra: &[&str], tag: &str) -> Kid {
    let mut d = Kid::spawn(&[&["run", "--incoming", addr], extra].concat()).named(tag);
    eventually(PATIENCE, || {
        if let Ok(Some(st)) = d.child.try_wait() {
            panic!("{tag} exited ({st}) instead of listening:\n{}", d.stderr());
        }
        d.stderr().contains("waiting for a migration").then_some(())
    });
    d
}

/// A private temporary directory (vmm-sys-util's), removed with its contents when dropped.
pub struct TestDir(vmm_sys_util::tempdir::TempDir);

impl TestDir {
    #[allow(clippy::new_without_default)]
    pub fn new() -> TestDir {
        // Short: unix socket paths must stay under 108 bytes.
        let prefix = std::env::temp_dir().join("kumo-test-");
        TestDir(vmm_sys_util::tempdir::TempDir::new_with_prefix(prefix).expect("create a temp dir"))
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.as_path().join(name)
    }

    /// The same, as a string for a command line.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).to_str().expect("temp paths are UTF-8").to_string()
    }
}

/// A path in a per-process directory that is never removed: prefer [`TestDir`].
pub fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kumo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the listener is closed before it is
/// returned, so another process could take it: use it at once).
pub fn try_free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("cannot find a free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// [`try_free_port`], for tests.
pub fn free_port() -> u16 {
    try_free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// Polls `f` until it returns Some, for at most `limit`.
pub fn eventually<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < limit, "condition not met within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of `key=` in a guest output line that starts with `prefix`.
pub fn field(out: &str, prefix: &str, key: &str) -> Option<String> {
    out.lines()
        .filter(|l| l.starts_with(prefix))
        .flat_map(|l| l.split_whitespace())
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(String::from))
}

/// The hexadecimal value of `key=` on memtouch's `memtouch: KEY` line.
pub fn hex_field(out: &str, key: &str) -> Option<u64> {
    field(out, &format!("memtouch: {key}"), key).and_then(|v| u64::from_str_radix(&v, 16).ok())
}

/// The writes a stopped memtouch reports, after checking its checksum against the reference
/// model (kumo-guests' `memtouch::check_output`); panics quoting the output otherwise.
pub fn check_memtouch(out: &str, pages: u64, seed: u64, random: bool) -> u64 {
    kumo_guests::memtouch::check_output(out, pages, seed, random).unwrap_or_else(|e| panic!("{e}"))
}

/// Each thread of process `pid`: its name and the host CPUs it may run on, as the kernel lists
/// them (`Cpus_allowed_list`, e.g. "0-1"). Threads that end while they are listed are left out.
pub fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    dir.flatten()
        .filter_map(|t| {
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?.trim().to_string();
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?.trim().to_string();
            Some((name, cpus))
        })
        .collect()
}

/// `strs` as owned strings (argument lists).
pub fn sv<S: AsRef<str>>(strs: &[S]) -> Vec<String> {
    strs.iter().map(|s| s.as_ref().to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_hex_fields_are_read_from_guest_lines() {
        let out = "memtouch: pages=4 seed=3\nmemtouch: checksum checksum=ff00\n";
        assert_eq!(field(out, "memtouch: pages", "seed").as_deref(), Some("3"));
        assert_eq!(hex_field(out, "checksum"), Some(0xff00));
        assert_eq!(field(out, "memtouch: done", "writes"), None);
    }

    #[test]
    fn a_test_dir_is_removed_with_its_contents() {
        let d = TestDir::new();
        std::fs::write(d.path("f"), b"x").unwrap();
        let p = d.path("f");
        assert!(d.arg("f").ends_with("/f"));
        drop(d);
        assert!(!p.exists());
        assert_ne!(free_port(), 0);
    }
}
