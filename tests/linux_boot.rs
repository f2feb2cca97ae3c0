//! End-to-end Linux boot through the `kumo` binary: a Debian cloud kernel must print its
//! "Linux version" banner on the serial console.
//!
//! The kernel comes from `scripts/fetch-linux-kernel.sh` (`<repo>/.cache/linux/vmlinuz`, or
//! `$KUMO_LINUX_KERNEL`; the PVH test uses `vmlinux` next to it, or `$KUMO_LINUX_VMLINUX`).
//! Without `/dev/kvm` the tests pass after printing why they were skipped; without a kernel they
//! skip too, except under CI (env `CI` set), where the fetch script is expected to have run.
//!
//! On this project's nested KVM, guest ring-0 code is emulated: the bzImage decompressor alone
//! takes ~90 s, so the banner takes minutes. The budget is 900 s per boot
//! (`KUMO_LINUX_BOOT_TIMEOUT` seconds to override).
//!
//! There, the kernel also hits instructions KVM cannot emulate (INT3, CLAC, POPCNT, FWAIT…)
//! that kumo carries out itself (`kumo_vm::emulate`); `pvh_vmlinux_boots_past_emulation_failures`
//! checks that the kernel gets well past the point where it used to stop.
//!
//! `bzimage_enumerates_the_nic` boots with a NIC (`--net`) until Linux's PCI core lists it,
//! which checks kumo's config mechanism #1, host bridge and the NIC's config space. The Debian
//! kernel's virtio drivers are modules, which cannot be loaded here (no initrd with them), so
//! enumeration is as far as Linux drives the NIC; kumo's own guests drive it (tests/net_e2e.rs).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BANNER: &str = "Linux version";
const CMDLINE: &str = "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 reboot=k nokaslr";
/// With the two features this host needs turned off (as in kumo's default command line): the
/// guest sees XSAVE and SSSE3 in CPUID, but this KVM cannot emulate XRSTOR nor the kernel's
/// SSSE3 code in ring 0.
const CMDLINE_HOST: &str =
    "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 reboot=k nokaslr noxsave clearcpuid=ssse3";
/// Printed by `pid_max_init` in `start_kernel`, after FPU set-up, the alternatives patching
/// (INT3 self-test and text_poke), interrupt entries (CLAC) and the first POPCNTs: the points
/// where an unassisted boot stopped on this host. ~55 s after start for the PVH vmlinux.
const PAST_ASSISTS: &str = "pid_max: default:";
const DEFAULT_TIMEOUT_SECS: u64 = 900;
/// Linux's PCI core listing kumo's virtio-net function at 00:01.0 (vendor:device, class).
const NIC_LISTED: &str = "0000:00:01.0: [1af4:1041] type 00 class 0x020000";
const TAIL_LINES: usize = 40;

/// Boots run one at a time: two emulation-bound guests on a 2-core machine would only slow
/// each other down and eat into each other's time budget.
static SERIAL: Mutex<()> = Mutex::new(());

fn repo_root() -> PathBuf {
    // This file is an integration test of crates/cli.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

fn kernel_path(env: &str, file: &str) -> PathBuf {
    match std::env::var_os(env) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo_root().join(".cache/linux").join(file),
    }
}

fn timeout() -> Duration {
    let secs =
        std::env::var("KUMO_LINUX_BOOT_TIMEOUT").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_TIMEOUT_SECS);
    Duration::from_secs(secs)
}

/// Kills and reaps the child however the test ends.
struct ChildGuard(Child);

impl ChildGuard {
    fn try_status(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().ok().flatten()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Forwards `src` line by line (lossy UTF-8, without the line end) to `tx`.
fn pump(src: impl Read + Send + 'static, prefix: &'static str, tx: mpsc::Sender<String>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf);
                    let line = line.trim_end_matches(['\n', '\r']);
                    if tx.send(format!("{prefix}{line}")).is_err() {
                        break;
                    }
                }
            }
        }
    });
}

fn tail(lines: &[String]) -> String {
    let start = lines.len().saturating_sub(TAIL_LINES);
    let mut s = format!("--- last {} of {} output lines ---\n", lines.len() - start, lines.len());
    for l in &lines[start..] {
        s.push_str(l);
        s.push('\n');
    }
    s
}

/// Boots `kernel` with `kumo run` and waits for the Linux banner.
fn boot_until_banner(kernel: &Path) {
    boot_until(kernel, CMDLINE, BANNER);
}

/// Boots `kernel` with `kumo run --cmdline cmdline` and waits for `needle` on the console.
fn boot_until(kernel: &Path, cmdline: &str, needle: &str) {
    boot_with(kernel, cmdline, &["--cpus", "1"], needle, timeout());
}

/// [`boot_until`] with more `kumo run` arguments and its own time budget.
fn boot_with(kernel: &Path, cmdline: &str, args: &[&str], needle: &str, budget: Duration) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = env!("CARGO_BIN_EXE_kumo");
    let mut cmd = Command::new(bin);
    cmd.arg("run")
        .arg("--kernel")
        .arg(kernel)
        .args(["--cmdline", cmdline, "--memory", "512M"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    println!("running: {cmd:?}");
    let start = Instant::now();
    let mut child = ChildGuard(cmd.spawn().unwrap_or_else(|e| panic!("cannot run {bin}: {e}")));
    let (tx, rx): (mpsc::Sender<String>, Receiver<String>) = mpsc::channel();
    pump(child.0.stdout.take().unwrap(), "", tx.clone());
    pump(child.0.stderr.take().unwrap(), "[stderr] ", tx);

    let deadline = start + budget;
    let mut lines: Vec<String> = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(line) => {
                println!("[{:7.1}s] {line}", start.elapsed().as_secs_f64());
                let found = !line.starts_with("[stderr] ") && line.contains(needle);
                lines.push(line);
                if found {
                    println!("{needle:?} after {:.1} s", start.elapsed().as_secs_f64());
                    return; // the guard kills and reaps kumo
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if Instant::now() >= deadline {
                    panic!("no {needle:?} on the console within {} s\n{}", budget.as_secs(), tail(&lines));
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                // Both pipes closed: kumo exited (or closed its output). Give it a moment to be
                // reaped so the failure can show the exit status.
                let mut status = child.try_status();
                for _ in 0..50 {
                    if status.is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    status = child.try_status();
                }
                let status = status.map_or_else(|| "still running".to_string(), |s| s.to_string());
                panic!(
                    "kumo closed its output ({status}) after {:.1} s without printing {needle:?}\n{}",
                    start.elapsed().as_secs_f64(),
                    tail(&lines)
                );
            }
        }
    }
}

/// The kernel to boot, or `None` (after printing why) if the test must be skipped.
fn find_kernel(env: &str, file: &str, required_in_ci: impl FnOnce() -> bool) -> Option<PathBuf> {
    if !kumo_vm::vm::kvm_available() {
        println!("skipping: /dev/kvm not available");
        return None;
    }
    let k = kernel_path(env, file);
    if k.is_file() {
        return Some(k);
    }
    let why = format!("kernel {} not found (set {env} or run scripts/fetch-linux-kernel.sh)", k.display());
    if in_ci() && required_in_ci() {
        panic!("{why}");
    }
    println!("skipping: {why}");
    None
}

#[test]
fn bzimage_prints_linux_banner() {
    let Some(kernel) = find_kernel("KUMO_LINUX_KERNEL", "vmlinuz", || true) else {
        return;
    };
    boot_until_banner(&kernel);
}

/// The fetch script only extracts vmlinux when the kernel has CONFIG_PVH=y, so under CI it is
/// required only if the cached config says so.
fn pvh_expected() -> bool {
    std::fs::read_to_string(repo_root().join(".cache/linux/config"))
        .map(|c| c.lines().any(|l| l == "CONFIG_PVH=y"))
        .unwrap_or(false)
}

#[test]
fn pvh_vmlinux_prints_linux_banner() {
    let Some(kernel) = find_kernel("KUMO_LINUX_VMLINUX", "vmlinux", pvh_expected) else {
        return;
    };
    boot_until_banner(&kernel);
}

#[test]
fn pvh_vmlinux_boots_past_emulation_failures() {
    let Some(kernel) = find_kernel("KUMO_LINUX_VMLINUX", "vmlinux", pvh_expected) else {
        return;
    };
    boot_until(&kernel, CMDLINE_HOST, PAST_ASSISTS);
}

#[test]
fn bzimage_enumerates_the_nic() {
    let Some(kernel) = find_kernel("KUMO_LINUX_KERNEL", "vmlinuz", || true) else {
        return;
    };
    let name = format!("klx{}", std::process::id() % 100_000);
    let tap = match kumo_testkit::net::Tap::multi_queue(&name, None) {
        Ok(t) => t,
        Err(e) => return println!("skipping: cannot create a tap: {e}"),
    };
    let net = format!("tap={}", tap.name);
    // Two vCPUs: the kernel's start-up ftrace check (a long emulated loop in a kworker) then
    // runs beside the boot instead of before it. PCI enumeration comes minutes after the banner.
    let budget = timeout() * 2;
    boot_with(&kernel, CMDLINE_HOST, &["--cpus", "2", "--net", &net], NIC_LISTED, budget);
}
