//! Linux as the judge: what the `tests/linux_*.rs` suites share.
//!
//! - [`test_kernel`]: kumo's test kernel (`scripts/build-test-kernel.sh`: Linux 6.1 with virtio
//!   built in, cached outside the work tree). Without it the tests skip, except under CI.
//! - [`cmdline`]: the kernel command line this host needs, plus the test's own arguments.
//! - [`RootFs`]: an ext4 image made with `mkfs.ext4 -d` whose `/init` is a static program that
//!   never makes a system call (NESTED-KVM.md: SYSCALL from ring 3 is broken here).
//! - [`Pinger`]: the host pinging a guest every 50 ms, every reply timestamped on the host.
//!
//! Every wait is for a kernel message or a host-side effect; the limits only end a hung test.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Printed when the kernel has configured `ip=` (the NIC's driver probed, the link is up).
pub const IP_CONFIG_COMPLETE: &str = "IP-Config: Complete";
/// Printed when the kernel read `/init` from its root filesystem and is about to run it.
pub const RUN_INIT: &str = "Run /init as init process";
/// The command line arguments that boot from a [`RootFs`] on the VM's first disk, read-write,
/// and run its `/init` (without `init=` the kernel looks for /sbin/init and panics).
pub const ROOT_ARGS: &str = "root=/dev/vda rw rootwait init=/init";
/// How long a Linux boot may take here before a test gives up (ring-0 code runs emulated: the
/// test kernel reaches `IP-Config` in about a minute on an idle 2-core host).
pub const BOOT_LIMIT: Duration = Duration::from_secs(900);

/// [`BOOT_LIMIT`], or `$KUMO_LINUX_BOOT_TIMEOUT` seconds: the hang guard of every wait in the
/// Linux tests (a shorter one ends a test whose mechanism is broken on purpose sooner).
pub fn boot_limit() -> Duration {
    std::env::var("KUMO_LINUX_BOOT_TIMEOUT").ok().and_then(|s| s.parse().ok()).map_or(BOOT_LIMIT, Duration::from_secs)
}

/// The hang guard of the waits after the kernel is up (ping replies, writes reaching the image:
/// seconds when the mechanism works): [`boot_limit`], or `$KUMO_LINUX_EFFECT_TIMEOUT` seconds.
pub fn effect_limit() -> Duration {
    std::env::var("KUMO_LINUX_EFFECT_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or_else(boot_limit, Duration::from_secs)
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// The test kernel (`$KUMO_TEST_KERNEL`, else where `scripts/build-test-kernel.sh` caches it),
/// or `None` after saying why the test skips. Under CI a missing kernel fails the test: `.ci/run`
/// builds it first.
pub fn test_kernel(test: &str) -> Option<PathBuf> {
    if !crate::kvm_or_skip(test) {
        return None;
    }
    let path = test_kernel_path().unwrap_or_else(|e| panic!("{test}: {e}"));
    cached_or_skip(test, "test kernel", "build-test-kernel.sh", path, Path::is_file)
}

/// Where the test kernel is, or will be once built: `$KUMO_TEST_KERNEL`, else the cache
/// `scripts/build-test-kernel.sh --path` names.
pub fn test_kernel_path() -> Result<PathBuf, String> {
    match std::env::var_os("KUMO_TEST_KERNEL") {
        Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
        _ => cached_build_path("build-test-kernel.sh"),
    }
}

/// Where `scripts/SCRIPT --path` says its cached build is (or will be).
pub fn cached_build_path(script: &str) -> Result<PathBuf, String> {
    let path = repo_root().join("scripts").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .arg("--path")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", path.display()))?;
    if !out.status.success() {
        return Err(format!("{} --path failed", path.display()));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `path` if `ready` says the build `scripts/SCRIPT` caches (`what`) is there; else `None` after
/// saying why `test` skips. Under CI a missing build fails the test: `scripts/test.sh` builds it.
pub fn cached_or_skip(
    test: &str,
    what: &str,
    script: &str,
    path: PathBuf,
    ready: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    if ready(&path) {
        return Some(path);
    }
    assert!(!in_ci(), "{test}: no {what} at {} under CI: run scripts/{script}", path.display());
    println!("skipping {test}: no {what} at {} (build it with scripts/{script})", path.display());
    None
}

/// The command line for the test kernel: kumo's defaults for this host (no XSAVE, no SSSE3,
/// no crypto self-tests), plugged memory online by itself (virtio-mem), then `extra`.
///
/// `lapic=notscdeadline`: with the TSC-deadline timer the kernel's 250 Hz periodic tick runs
/// on a one-shot clockevent, whose handler (`tick_handle_periodic`) runs the tick again while
/// its next expiry is already past. Here every ring-0 instruction is emulated, and on a loaded
/// host one tick costs more than 4 ms: the vCPU then runs ticks forever (seen stuck in
/// `timekeeping_advance`/`scheduler_tick` at the first clocksource switch). The LAPIC's own
/// periodic mode drops late ticks instead.
pub fn cmdline(extra: &str) -> String {
    format!(
        "console=ttyS0 reboot=k panic=-1 nokaslr noxsave clearcpuid=ssse3 cryptomgr.notests \
         lapic=notscdeadline memhp_default_state=online {extra}"
    )
}

/// `ip=` for a guest at `guest` on a /24 whose host side is `host`, configured on eth0 without
/// DHCP.
pub fn ip_arg(guest: std::net::Ipv4Addr, host: std::net::Ipv4Addr) -> String {
    format!("ip={guest}::{host}:255.255.255.0::eth0:off")
}

/// The static `/init`: `pause` in a loop in ring 3, no system call ever. Built with the host gcc.
pub fn build_init(dir: &Path) -> PathBuf {
    let src = dir.join("init.S");
    std::fs::write(&src, ".globl _start\n_start:\n\tpause\n\tjmp _start\n").expect("write init.S");
    let out = dir.join("init");
    let st = Command::new("gcc").args(["-nostdlib", "-static", "-o"]).arg(&out).arg(&src).status().expect("run gcc");
    assert!(st.success(), "gcc could not build the static /init");
    out
}

/// An ext4 root filesystem image.
pub struct RootFs {
    pub image: PathBuf,
}

impl RootFs {
    /// `mkfs.ext4 -d` of a tree holding `/init` (see [`build_init`]), `/dev` and `/proc`, of
    /// `size_mib` MiB, with multi-mount protection: the kernel's kmmpd thread then rewrites the
    /// MMP block every second while the filesystem is mounted, a kernel write the host can watch
    /// without any userspace in the guest ([`RootFs::mmp_seq`]).
    pub fn create(dir: &Path, size_mib: u32) -> RootFs {
        let tree = dir.join("rootfs");
        for d in ["dev", "proc", "sys"] {
            std::fs::create_dir_all(tree.join(d)).expect("mkdir rootfs");
        }
        let init = build_init(dir);
        std::fs::copy(&init, tree.join("init")).expect("copy init");
        let image = dir.join("root.ext4");
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-O", "mmp", "-E", "mmp_update_interval=1", "-d"])
            .arg(&tree)
            .arg(&image)
            .arg(format!("{size_mib}M"))
            .output()
            .expect("run mkfs.ext4");
        assert!(out.status.success(), "mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr));
        RootFs { image }
    }

    /// `dumpe2fs -h` of the image.
    pub fn header(&self) -> String {
        let out = Command::new("dumpe2fs").arg("-h").arg(&self.image).output().expect("run dumpe2fs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The superblock's "Mount count".
    pub fn mount_count(&self) -> u32 {
        header_field(&self.header(), "Mount count").and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// The MMP block's sequence number, read from the image file (the kernel's kmmpd raises it
    /// every `mmp_update_interval` while the filesystem is mounted).
    pub fn mmp_seq(&self) -> Option<u32> {
        let h = self.header();
        let block: u64 = header_field(&h, "MMP block number")?.parse().ok()?;
        let bsize: u64 = header_field(&h, "Block size")?.parse().ok()?;
        let bytes = std::fs::read(&self.image).ok()?;
        let at = usize::try_from(block * bsize).ok()?;
        // struct mmp_struct: mmp_magic (le32), mmp_seq (le32), ...
        let magic = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?);
        (magic == 0x004d_4d50).then(|| u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()))
    }

    /// Replays the journal on a copy, then `e2fsck -fn` of it: `Ok` if the filesystem is clean.
    pub fn check_copy(&self, dir: &Path) -> Result<String, String> {
        let copy = dir.join("check.ext4");
        std::fs::copy(&self.image, &copy).map_err(|e| e.to_string())?;
        // The kernel left the MMP block "in use" (it never unmounted): clear it on the copy.
        let _ = Command::new("tune2fs").args(["-f", "-E", "clear_mmp"]).arg(&copy).output();
        let _ = Command::new("e2fsck").args(["-f", "-y", "-E", "journal_only"]).arg(&copy).output();
        let out = Command::new("e2fsck").args(["-f", "-n"]).arg(&copy).output().map_err(|e| e.to_string())?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            Ok(text)
        } else {
            Err(text)
        }
    }
}

/// Linux VM tests run one at a time in a test binary: two emulation-bound kernels on a 2-core
/// host only slow each other down (hold the guard from [`one_at_a_time`] for the whole test).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The guard that keeps this binary's Linux VMs sequential (a failed test does not poison it).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// `kumo run --kernel KERNEL --memory 512M --cmdline CMDLINE ARGS…`: a Linux VM whose serial
/// console is the [`Kid`]'s stdout (1 vCPU unless `args` says otherwise).
pub fn spawn(kernel: &Path, cmdline: &str, args: &[&str], tag: &str) -> crate::Kid {
    let k = kernel.to_str().expect("kernel path is UTF-8");
    let mut a = vec!["run", "--kernel", k, "--memory", "512M", "--cmdline", cmdline];
    if !args.contains(&"--cpus") {
        a.extend(["--cpus", "1"]);
    }
    a.extend_from_slice(args);
    println!("{tag}: kumo {}", a.join(" "));
    crate::Kid::spawn(&a).named(tag)
}

/// Waits (within [`boot_limit`]) for a console line containing `what`: its host arrival time
/// and the line. The error names the VM and quotes the console's last lines.
pub fn wait_console(vm: &mut crate::Kid, what: &str) -> Result<(Instant, String), String> {
    vm.wait_line(boot_limit(), &format!("`{what}` on the console"), |l| l.contains(what).then(|| l.to_string()))
        .map_err(|e| format!("{e}\n{}", console_tail(vm, 40)))
}

/// [`wait_console`], panicking with the console's last lines.
pub fn expect_console(vm: &mut crate::Kid, what: &str) -> (Instant, String) {
    wait_console(vm, what).unwrap_or_else(|e| panic!("{e}"))
}

/// The console's last `n` lines and kumo's stderr, for failure messages.
pub fn console_tail(vm: &crate::Kid, n: usize) -> String {
    let lines = vm.lines();
    let from = lines.len().saturating_sub(n);
    let mut s = format!("--- console, last {} of {} lines ---\n", lines.len() - from, lines.len());
    for (_, l) in &lines[from..] {
        s.push_str(l);
        s.push('\n');
    }
    s + "--- kumo stderr ---\n" + &vm.stderr()
}

/// The kernel's own timestamp (`[   12.345678] …`) of a console line, in seconds.
pub fn kernel_time(line: &str) -> Option<f64> {
    let rest = line.trim_start().strip_prefix('[')?;
    rest.split_once(']')?.0.trim().parse().ok()
}

/// Boot milestones the docs record (docs/linux-boot.md): the first console line containing
/// each of these.
pub const MILESTONES: [&str; 5] =
    ["Linux version", "virtio_blk virtio", "virtio_net virtio", IP_CONFIG_COMPLETE, RUN_INIT];

/// Prints, for each milestone the console has shown, the kernel's timestamp and the host's
/// seconds since the VM was started (what docs/linux-boot.md records).
pub fn print_milestones(vm: &crate::Kid) {
    let lines = vm.lines();
    for m in MILESTONES {
        if let Some((at, l)) = lines.iter().find(|(_, l)| l.contains(m)) {
            let host = at.saturating_duration_since(vm.started).as_secs_f64();
            let kt = kernel_time(l).map_or("?".into(), |t| format!("{t:.1}"));
            println!("milestone `{m}`: kernel {kt} s, host {host:.1} s");
        }
    }
}

/// Waits (bounded by `limit`) until `f` holds, checking every 250 ms; the error says `what`.
pub fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let t = Instant::now();
    while !f() {
        if t.elapsed() > limit {
            return Err(format!("{what}: not within {} s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

impl RootFs {
    /// Waits (bounded) until the MMP sequence in the image differs from `from` twice over (two
    /// kmmpd writes, each a kernel write through kumo's disk that reached the image file).
    pub fn wait_mmp_writes(&self, from: Option<u32>, limit: Duration) -> Result<u32, String> {
        let mut seen = vec![from];
        wait_until(limit, "the kernel's MMP writes reaching the image", || {
            let now = self.mmp_seq();
            if now.is_some() && !seen.contains(&now) {
                seen.push(now);
            }
            seen.len() >= 3
        })
        .map_err(|e| format!("{e} (sequences seen: {seen:?})"))?;
        Ok(seen.last().copied().flatten().unwrap_or(0))
    }
}

/// The value after `name:` in `dumpe2fs -h` output.
pub fn header_field(header: &str, name: &str) -> Option<String> {
    header.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().to_string())
    })
}

/// The host pinging a guest every 50 ms, each reply's sequence number kept with its host
/// arrival time. Two kinds: [`Pinger::start`] streams (`ping -i 0.05`: as many pings in flight
/// as the guest is slow), [`Pinger::one_in_flight`] sends the next ping only after the last one's
/// reply (or its hang guard), so a test that counts lost pings counts the same on a slow host.
pub struct Pinger {
    feed: Feed,
    replies: Arc<Mutex<Vec<(Instant, u32)>>>,
}

/// Where a [`Pinger`]'s replies come from, and how it is stopped.
enum Feed {
    /// The streaming `ping`, killed on drop.
    Stream(Child),
    /// The thread running one `ping -c 1` after another, told to stop on drop.
    OneInFlight(Arc<AtomicBool>),
}

/// How long a ping of [`Pinger::one_in_flight`] waits for its reply before it counts as lost: a
/// hang guard (a kernel that is slow to answer is not losing pings); every reply comes well
/// within it.
const ONE_PING_WAIT_S: &str = "10";

impl Pinger {
    pub fn start(addr: std::net::Ipv4Addr) -> Pinger {
        Pinger::start_in(None, addr)
    }

    /// `ping` run on this host or inside network namespace `ns`.
    fn ping_command(ns: Option<&str>) -> Command {
        match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "ping"]);
                c
            }
            None => Command::new("ping"),
        }
    }

    /// At most one ping in flight, one every 50 ms while replies are quick: a guest that loses
    /// its NIC (a handover) can have left at most one ping unanswered, however slowly it runs.
    /// Each ping is a `ping -c 1` of its own; the sequence numbers are this pinger's.
    pub fn one_in_flight(addr: std::net::Ipv4Addr) -> Pinger {
        let replies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (replies.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seq = 1u32;
            while !s.load(Ordering::Relaxed) {
                let sent = Instant::now();
                let answered = Pinger::ping_command(None)
                    .args(["-n", "-q", "-c", "1", "-W", ONE_PING_WAIT_S])
                    .arg(addr.to_string())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|st| st.success());
                if answered {
                    r.lock().unwrap().push((Instant::now(), seq));
                }
                seq += 1;
                if let Some(rest) = Duration::from_millis(50).checked_sub(sent.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
        });
        Pinger { feed: Feed::OneInFlight(stop), replies }
    }

    /// [`Pinger::start`] from inside network namespace `ns` (another "host").
    pub fn start_in(ns: Option<&str>, addr: std::net::Ipv4Addr) -> Pinger {
        let mut child = Pinger::ping_command(ns)
            .args(["-n", "-i", "0.05", "-W", "1"])
            .arg(addr.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run ping");
        let replies = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("ping stdout");
        let r = replies.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let seq = line.split_whitespace().find_map(|w| w.strip_prefix("icmp_seq=")?.parse().ok());
                if let (true, Some(seq)) = (line.contains("bytes from"), seq) {
                    r.lock().unwrap().push((Instant::now(), seq));
                }
            }
        });
        Pinger { feed: Feed::Stream(child), replies }
    }

    /// How many replies have arrived.
    pub fn replies(&self) -> usize {
        self.replies.lock().unwrap().len()
    }

    /// Waits until `n` more replies than `after` have arrived (bounded by `limit`).
    pub fn wait_replies(&self, after: usize, n: usize, limit: Duration) -> Result<(), String> {
        let t = Instant::now();
        while self.replies() < after + n {
            if t.elapsed() > limit {
                return Err(format!(
                    "{} ping replies after {} s, wanted {}",
                    self.replies(),
                    limit.as_secs(),
                    after + n
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The sequence numbers lost between the first and the last reply so far.
    pub fn lost(&self) -> Vec<u32> {
        let got: BTreeSet<u32> = self.replies.lock().unwrap().iter().map(|&(_, s)| s).collect();
        match (got.first(), got.last()) {
            (Some(&a), Some(&b)) => (a..=b).filter(|s| !got.contains(s)).collect(),
            _ => Vec::new(),
        }
    }

    /// The replies so far: (host arrival time, icmp_seq).
    pub fn log(&self) -> Vec<(Instant, u32)> {
        self.replies.lock().unwrap().clone()
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        match &mut self.feed {
            Feed::Stream(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            // The thread ends after its current ping (not waited for).
            Feed::OneInFlight(stop) => stop.store(true, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_fields_are_read_by_name() {
        let h = "Mount count:              3\nMMP block number:         1049\nBlock size:               1024\n";
        assert_eq!(header_field(h, "Mount count").as_deref(), Some("3"));
        assert_eq!(header_field(h, "MMP block number").as_deref(), Some("1049"));
        assert_eq!(header_field(h, "Maximum mount count"), None);
    }

    #[test]
    fn the_command_line_keeps_this_hosts_workarounds() {
        let c = cmdline("root=/dev/vda");
        assert!(c.contains("noxsave") && c.contains("clearcpuid=ssse3") && c.ends_with("root=/dev/vda"));
        assert!(c.contains("lapic=notscdeadline"), "the periodic tick must not run on a one-shot timer: {c}");
        assert_eq!(ip_arg([10, 1, 2, 2].into(), [10, 1, 2, 1].into()), "ip=10.1.2.2::10.1.2.1:255.255.255.0::eth0:off");
    }
}
