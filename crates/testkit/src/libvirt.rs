//! libvirt's own `ch` driver driving kumo: the libvirt build `scripts/build-libvirt-ch.sh`
//! caches (Debian 12's libvirt 9.0 source, only the daemon, the remote and the ch driver), a
//! `libvirtd` whose PATH finds kumo as `cloud-hypervisor`, and `virsh` against it.
//!
//! The build's state and socket directories are fixed at build time, so one daemon runs at a
//! time on a machine: [`Libvirtd::start`] holds a file lock for its whole life.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::linux;

/// The URI of the ch driver's system instance.
pub const URI: &str = "ch:///system";

/// The libvirt install (`scripts/build-libvirt-ch.sh --path`), or `None` after saying why the
/// test skips. Under CI a missing build fails the test: `scripts/test.sh` builds it first.
pub fn installed(test: &str) -> Option<PathBuf> {
    let script = "build-libvirt-ch.sh";
    let prefix = linux::cached_build_path(script).unwrap_or_else(|e| panic!("{test}: {e}"));
    linux::cached_or_skip(test, "libvirt build", script, prefix, |p| {
        p.join("BUILD").is_file() && p.join("sbin/libvirtd").is_file()
    })
}

/// A running `libvirtd` of the cached build, finding kumo as `cloud-hypervisor` first in its
/// PATH; killed (and its lock released) on drop.
pub struct Libvirtd {
    prefix: PathBuf,
    child: Child,
    log: PathBuf,
    /// The emulator libvirt runs: a `cloud-hypervisor` symlink to kumo.
    pub emulator: PathBuf,
    _lock: std::fs::File,
}

impl Libvirtd {
    /// Starts the daemon (after ending one a crashed test left behind) and waits until `virsh`
    /// reaches the ch driver. `dir` holds the emulator symlink and the daemon's log.
    pub fn start(prefix: &Path, dir: &Path) -> Libvirtd {
        let lock = std::fs::File::create(prefix.join("kumo-test.lock")).expect("create the libvirt test lock");
        lock.lock().expect("lock the libvirt build");
        end_stale_daemon(prefix);
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).expect("mkdir bin");
        let emulator = bin.join("cloud-hypervisor");
        std::os::unix::fs::symlink(crate::kumo_bin(), &emulator).expect("symlink cloud-hypervisor to kumo");
        let log = dir.join("libvirtd.log");
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let child = Command::new(prefix.join("sbin/libvirtd"))
            .env("PATH", path)
            .env("LIBVIRT_LOG_OUTPUTS", format!("3:file:{}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start libvirtd");
        let d = Libvirtd { prefix: prefix.to_path_buf(), child, log, emulator, _lock: lock };
        let until = Instant::now() + crate::PATIENCE;
        loop {
            let out = d.virsh(&["version"]);
            if out.status.success() {
                let v = String::from_utf8_lossy(&out.stdout).into_owned();
                println!("libvirt: {}", v.lines().collect::<Vec<_>>().join("; "));
                break d;
            }
            assert!(Instant::now() < until, "libvirtd did not answer: {}\n{}", stderr(&out), d.log_tail(30));
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The install prefix (its state is under `var/run/libvirt`, definitions under `etc/libvirt`).
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// `virsh -c ch:///system ARGS`.
    pub fn virsh(&self, args: &[&str]) -> Output {
        Command::new(self.prefix.join("bin/virsh"))
            .arg("-c")
            .arg(URI)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run virsh")
    }

    /// [`Libvirtd::virsh`], panicking with virsh's error and the daemon's log unless it
    /// succeeds; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.virsh(args);
        assert!(out.status.success(), "virsh {}: {}\n{}", args.join(" "), stderr(&out), self.log_tail(40));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The last `n` lines of the daemon's log that are warnings or errors.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("error") || l.contains("warning")).collect();
        format!("libvirtd log ({}):\n{}", self.log.display(), lines[lines.len().saturating_sub(n)..].join("\n"))
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_string()
}

/// Ends a daemon of this build that a crashed test left running (its pid file names it, and
/// its executable is this build's libvirtd).
fn end_stale_daemon(prefix: &Path) {
    let Ok(pid) = std::fs::read_to_string(prefix.join("var/run/libvirtd.pid")) else { return };
    let Ok(pid) = pid.trim().parse::<i32>() else { return };
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    if exe == prefix.join("sbin/libvirtd") {
        let _ = Command::new("kill").arg(pid.to_string()).status();
        let until = Instant::now() + crate::PATIENCE;
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A domain's `virsh dominfo` field (`State`, `CPU(s)`, …).
pub fn dominfo_field(dominfo: &str, field: &str) -> Option<String> {
    dominfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == field).then(|| v.trim().to_string())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn dominfo_fields_are_read_by_name() {
        let d = "Id:             1\nName:           k\nState:          running\nCPU(s):         1\n";
        assert_eq!(super::dominfo_field(d, "State").as_deref(), Some("running"));
        assert_eq!(super::dominfo_field(d, "CPU(s)").as_deref(), Some("1"));
        assert_eq!(super::dominfo_field(d, "Max memory"), None);
    }
}
