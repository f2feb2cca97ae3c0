//! QEMU harness: runs kumo's own guests under QEMU (7.2) and measures a QEMU→QEMU live
//! migration, so kumo's migration can be compared with QEMU's on the same guest and machine.
//!
//! Guests boot through their PVH entry (guests/runtime/pvh.S): `-kernel guest.elf` makes QEMU
//! start them in 32-bit mode via its PVH option ROM, and the runtime builds kumo's boot state
//! itself. Memory size comes from the PVH memory map; the TSC frequency from the hypervisor
//! leaf 0x40000010 if the CPU model exposes it, else from a PIT calibration in the guest.
//!
//! Command line used for every VM (the destination adds `-incoming tcp:127.0.0.1:PORT`):
//! `qemu-system-x86_64 -accel kvm -machine pc -cpu CPU -m MiB -smp 1 -nodefaults -display none
//!  -kernel ELF -append ARGS -chardev stdio,id=con,signal=off -serial chardev:con
//!  -device isa-debug-exit,iobase=0x501,iosize=1 -qmp unix:SOCK,server=on,wait=off -no-reboot`.
//! CPU is the first model of [`CPU_CANDIDATES`] that boots `hello` on this host ([`cpu_model`]):
//! QEMU 7.2 aborts with `-cpu host` and, on some instances of this nested host, `-cpu max`
//! ("failed to set MSR 0x10a"). The serial console is QEMU's stdio: a reader thread stamps
//! each line with the host time it arrived ([`QemuVm::lines`]) and stdin is the guest's console
//! input ([`QemuVm::send_input`]). isa-debug-exit makes QEMU
//! exit with status `(code << 1) | 1` when the guest writes its exit code to port 0x501; the
//! size is 1 so that the guest's start marker at 0x502 is not taken for an exit.
//!
//! With [`QemuSpec::netns`] QEMU runs under `ip netns exec NS`; [`virtio_net_args`] adds a
//! virtio-net-pci NIC on a tap.
//!
//! `kumo bench migrate`, `disk` and `net` use it for their QEMU comparisons; tests/qemu_e2e.rs
//! tests it.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::process::{ChildStdin, ChildStdout};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use vmm_sys_util::tempdir::TempDir;

/// The QEMU binary: `$KUMO_QEMU` if set, else `qemu-system-x86_64` on `PATH`. An Err means
/// QEMU is not installed (callers skip); `scripts/setup.sh` installs it.
pub fn qemu_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("KUMO_QEMU") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("KUMO_QEMU={} is not a file", p.display())) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("qemu-system-x86_64"))
        .find(|p| p.is_file())
        .ok_or_else(|| "qemu-system-x86_64 not found on PATH (scripts/setup.sh installs qemu-system-x86)".into())
}

/// Ok if QEMU can use KVM here: kumo's own check, /dev/kvm opens read-write.
/// For tests: true if QEMU and /dev/kvm are usable; otherwise prints why `test` skips.
pub fn usable_or_skip(test: &str) -> bool {
    match qemu_binary().and_then(|_| kvm_usable()) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            false
        }
    }
}

pub fn kvm_usable() -> Result<(), String> {
    kumo_vm::vm::open_kvm().map(drop).map_err(|e| e.to_string())
}

/// A private temporary directory (vmm-sys-util's), removed on drop.
fn temp_dir(tag: &str) -> Result<TempDir, String> {
    TempDir::new_with_prefix(std::env::temp_dir().join(format!("kumo-qemu-{tag}-")))
        .map_err(|e| format!("cannot create a temporary directory: {e}"))
}

/// What to run in a QEMU VM.
#[derive(Debug, Clone)]
pub struct QemuSpec {
    /// A built kumo guest (`kumo_guests::find`), e.g. "memtouch".
    pub guest: String,
    /// Its `key=value` parameters, checked against the guest's manifest.
    pub guest_args: Vec<String>,
    pub mem_mib: u64,
    /// `-cpu` value; empty (the default): the model [`cpu_model`] found working on this host.
    pub cpu: String,
    /// `-mem-prealloc`: fault in all guest memory at start (matters for a destination here:
    /// first touch of host memory is slow on this nested KVM).
    pub prealloc: bool,
    /// `-S`: the vCPU does not start (the CPU model probe).
    pub paused: bool,
    /// More QEMU arguments, appended as given (e.g. [`virtio_net_args`] for a NIC).
    pub extra_args: Vec<String>,
    /// Run QEMU in this network namespace (`ip netns exec`), e.g. where its tap is.
    pub netns: Option<String>,
}

/// `-device`/`-netdev` arguments for a modern-only virtio-net-pci NIC (MSI-X) with `mac` on
/// host tap `tap` (which must exist; QEMU's own tap backend, no vhost, no scripts). A
/// multi-queue tap needs `queues=` > 1 here, so give QEMU a single-queue one.
pub fn virtio_net_args(tap: &str, mac: &str) -> Vec<String> {
    crate::sv(&[
        "-device",
        &format!("virtio-net-pci,netdev=n0,disable-legacy=on,mac={mac}"),
        "-netdev",
        &format!("tap,id=n0,ifname={tap},script=no,downscript=no"),
    ])
}

impl QemuSpec {
    pub fn new(guest: &str, mem_mib: u64, guest_args: &[String]) -> QemuSpec {
        QemuSpec {
            guest: guest.into(),
            guest_args: guest_args.to_vec(),
            mem_mib,
            cpu: String::new(),
            prealloc: false,
            paused: false,
            extra_args: Vec::new(),
            netns: None,
        }
    }
}

/// A QEMU process running a kumo guest; killed (and its files removed) on drop.
pub struct QemuVm {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Complete serial lines with the host time each arrived.
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    qmp: Option<Qmp>,
    /// Held for its `Drop`: removes the guest ELF, sockets and logs.
    _dir: TempDir,
    serial: PathBuf,
    stderr: PathBuf,
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl QemuVm {
    /// Starts `spec` in QEMU; with `incoming_port`, as a paused migration destination listening
    /// on 127.0.0.1:PORT.
    pub fn spawn(spec: &QemuSpec, incoming_port: Option<u16>) -> Result<QemuVm, String> {
        let qemu = qemu_binary()?;
        kvm_usable()?;
        let cpu = if spec.cpu.is_empty() { cpu_model()? } else { spec.cpu.clone() };
        if spec.mem_mib < 16 || spec.mem_mib > 3072 {
            return Err(format!(
                "memory {} MiB: the guests' PVH page tables map 16..=3072 MiB (RAM below the PCI hole)",
                spec.mem_mib
            ));
        }
        let guest = kumo_guests::find(&spec.guest).map_err(|e| e.to_string())?;
        let cmdline = guest.command_line(&spec.guest_args).map_err(|e| e.to_string())?;
        if cmdline.contains(',') {
            // QEMU's option parser would split -append's value there.
            return Err(format!("guest arguments must not contain ',': {cmdline}"));
        }
        let dir = temp_dir(&spec.guest)?;
        let elf = dir.as_path().join(format!("{}.elf", spec.guest));
        fs::write(&elf, guest.elf).map_err(|e| format!("cannot write {}: {e}", elf.display()))?;
        let (serial, stderr, sock) =
            (dir.as_path().join("serial.log"), dir.as_path().join("stderr.log"), dir.as_path().join("qmp.sock"));
        fs::File::create(&serial).map_err(|e| format!("cannot create {}: {e}", serial.display()))?;
        let mut cmd = match &spec.netns {
            Some(ns) => {
                // `ip netns exec` execs QEMU: the child's pid is QEMU's, so drop kills QEMU.
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&qemu);
                c
            }
            None => Command::new(&qemu),
        };
        cmd.args(["-accel", "kvm", "-machine", "pc", "-cpu", &cpu, "-smp", "1"])
            .args(["-m", &spec.mem_mib.to_string(), "-nodefaults", "-display", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&elf)
            .args(["-append", &cmdline])
            .args(["-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con"])
            .args(["-device", "isa-debug-exit,iobase=0x501,iosize=1"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()));
        if spec.prealloc {
            cmd.arg("-mem-prealloc");
        }
        if spec.paused {
            cmd.arg("-S");
        }
        cmd.args(&spec.extra_args);
        if let Some(port) = incoming_port {
            cmd.args(["-incoming", &format!("tcp:127.0.0.1:{port}")]);
        }
        let err_file = fs::File::create(&stderr).map_err(|e| format!("cannot create {}: {e}", stderr.display()))?;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err_file)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", qemu.display()))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdin = child.stdin.take();
        if let Some(out) = child.stdout.take() {
            let file = fs::OpenOptions::new()
                .append(true)
                .open(&serial)
                .map_err(|e| format!("cannot open {}: {e}", serial.display()))?;
            let lines = lines.clone();
            std::thread::spawn(move || stamp_lines(out, file, &lines));
        }
        let mut vm = QemuVm { child, stdin, lines, qmp: None, _dir: dir, serial, stderr };
        vm.qmp = Some(vm.connect_qmp(&sock, Duration::from_secs(30))?);
        Ok(vm)
    }

    /// The file the guest's serial output goes to.
    pub fn serial_path(&self) -> PathBuf {
        self.serial.clone()
    }

    /// The complete serial lines so far, each with the host time it arrived.
    pub fn lines(&self) -> Vec<(Instant, String)> {
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Types `bytes` on the guest's serial console.
    pub fn send_input(&mut self, bytes: &[u8]) -> Result<(), String> {
        let r = match self.stdin.as_mut() {
            Some(s) => s.write_all(bytes).and_then(|_| s.flush()).map_err(|e| e.to_string()),
            None => Err("no console input".into()),
        };
        r.map_err(|e| self.why(&format!("console input: {e}")))
    }

    fn connect_qmp(&mut self, sock: &Path, limit: Duration) -> Result<Qmp, String> {
        let t = Instant::now();
        loop {
            if let Ok(s) = UnixStream::connect(sock) {
                return Qmp::handshake(s).map_err(|e| self.why(&format!("QMP: {e}")));
            }
            self.check_running()?;
            if t.elapsed() > limit {
                return Err(self.why("QMP socket did not appear"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Everything the guest wrote to its serial port so far.
    pub fn serial(&self) -> String {
        fs::read(&self.serial).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// `reason`, with QEMU's stderr and the guest's serial output appended.
    fn why(&self, reason: &str) -> String {
        let err = fs::read_to_string(&self.stderr).unwrap_or_default();
        format!("QEMU: {reason}\n--- stderr ---\n{}\n--- serial ---\n{}", err.trim_end(), self.serial().trim_end())
    }

    fn check_running(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(self.why(&format!("exited early ({st})"))),
            Err(e) => Err(self.why(&format!("cannot wait: {e}"))),
        }
    }

    /// Waits until a complete serial line contains `needle`; returns the serial output so far.
    pub fn wait_serial(&mut self, needle: &str, limit: Duration) -> Result<String, String> {
        let t = Instant::now();
        loop {
            let out = self.serial();
            if out.lines().zip(out.split_inclusive('\n')).any(|(l, full)| full.ends_with('\n') && l.contains(needle)) {
                return Ok(out);
            }
            self.check_running()?;
            if t.elapsed() > limit {
                return Err(self.why(&format!("no serial line with `{needle}` within {limit:?}")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for QEMU to exit and returns the guest's exit code (isa-debug-exit status
    /// `(code << 1) | 1`), or an Err if QEMU exited otherwise or not within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<u32, String> {
        let t = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    return match st.code() {
                        Some(c) if c & 1 == 1 => Ok((c >> 1) as u32),
                        _ => Err(self.why(&format!("exited without a guest exit code ({st})"))),
                    }
                }
                Ok(None) if t.elapsed() > limit => return Err(self.why(&format!("still running after {limit:?}"))),
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(self.why(&format!("cannot wait: {e}"))),
            }
        }
    }

    /// QEMU's process id (its threads are `/proc/PID/task/*`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The host thread ids of the vCPUs, in vCPU order (QMP `query-cpus-fast`).
    pub fn vcpu_tids(&mut self) -> Result<Vec<i32>, String> {
        let cpus = self.qmp("query-cpus-fast", Value::Null)?;
        let list = cpus.as_array().ok_or("query-cpus-fast: not a list")?;
        list.iter()
            .map(|c| {
                c["thread-id"].as_i64().map(|t| t as i32).ok_or_else(|| format!("query-cpus-fast: no thread-id in {c}"))
            })
            .collect()
    }

    /// Runs QMP command `execute` with `arguments` (Value::Null: none); returns its "return".
    pub fn qmp(&mut self, execute: &str, arguments: Value) -> Result<Value, String> {
        let r = match self.qmp.as_mut() {
            Some(q) => q.command(execute, arguments),
            None => Err("no QMP connection".into()),
        };
        r.map_err(|e| self.why(&format!("QMP {execute}: {e}")))
    }
}

/// Copies QEMU's stdout (the guest's serial console) to `file` and stamps each complete line
/// with the host time it arrived: guest time stops while a VM is paused, host time does not.
fn stamp_lines(out: ChildStdout, mut file: fs::File, lines: &Mutex<Vec<(Instant, String)>>) {
    let mut r = BufReader::new(out);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let at = Instant::now();
        let _ = file.write_all(&buf);
        if buf.ends_with(b"\n") {
            if let Ok(mut l) = lines.lock() {
                l.push((at, String::from_utf8_lossy(&buf).trim_end().to_string()));
            }
        }
    }
}

/// `-cpu` models to try, best first: `host` and `max` abort on some instances of this nested
/// host (MSR 0x10a, IA32_ARCH_CAPABILITIES); `qemu64` lacks what the guests' timer wants on
/// some hosts but boots.
pub const CPU_CANDIDATES: [&str; 4] = ["host", "max", "max,-arch-capabilities", "qemu64"];

/// The first of [`CPU_CANDIDATES`] QEMU starts a VM with here ([`probe_cpu`]), found once per
/// process; an Err lists why each failed.
pub fn cpu_model() -> Result<String, String> {
    static MODEL: OnceLock<Result<String, String>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let mut why = Vec::new();
            for cpu in CPU_CANDIDATES {
                match probe_cpu(cpu) {
                    Ok(()) => return Ok(cpu.to_string()),
                    Err(e) => why.push(format!("-cpu {cpu}: {}", first_error_line(&e))),
                }
            }
            Err(format!("QEMU boots kumo's hello guest with none of the CPU models tried ({})", why.join("; ")))
        })
        .clone()
}

/// Starts QEMU with `-cpu cpu` and `-S` (the guest `hello` loaded, its vCPU not started):
/// a model this host's KVM rejects aborts QEMU while it sets the vCPU's registers at reset,
/// before QMP answers (`failed to set MSR 0x10a`). Then asks QMP for the status and quits.
pub fn probe_cpu(cpu: &str) -> Result<(), String> {
    let spec = QemuSpec { cpu: cpu.into(), paused: true, ..QemuSpec::new("hello", 64, &[]) };
    let mut vm = QemuVm::spawn(&spec, None)?;
    let status = vm.qmp("query-status", Value::Null)?;
    if status["status"].as_str() != Some("prelaunch") {
        return Err(format!("unexpected status {status}"));
    }
    vm.check_running()?;
    let _ = vm.qmp("quit", Value::Null);
    Ok(())
}

/// The first line of QEMU's stderr quoted in a [`QemuVm`] error that says something, else the
/// error's first line.
fn first_error_line(e: &str) -> String {
    let stderr = e.split("--- stderr ---").nth(1).and_then(|r| r.split("--- serial ---").next()).unwrap_or("");
    stderr.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_else(|| e.lines().next().unwrap_or("")).to_string()
}

/// A minimal QMP client: one JSON object per line; asynchronous events are skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    fn handshake(s: UnixStream) -> Result<Qmp, String> {
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        let writer = s.try_clone().map_err(|e| e.to_string())?;
        let mut q = Qmp { reader: BufReader::new(s), writer };
        let greeting = q.read()?;
        if greeting.get("QMP").is_none() {
            return Err(format!("unexpected greeting {greeting}"));
        }
        q.command("qmp_capabilities", Value::Null)?;
        Ok(q)
    }

    fn read(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err("connection closed".into()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("bad reply {line:?}: {e}")),
            Err(e) => Err(format!("read: {e}")),
        }
    }

    fn command(&mut self, execute: &str, arguments: Value) -> Result<Value, String> {
        let mut msg = json!({ "execute": execute });
        if !arguments.is_null() {
            msg["arguments"] = arguments;
        }
        writeln!(self.writer, "{msg}").map_err(|e| format!("write: {e}"))?;
        loop {
            let v = self.read()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(format!(
                    "{}: {}",
                    e["class"].as_str().unwrap_or("error"),
                    e["desc"].as_str().unwrap_or("")
                ));
            }
            // {"event": ...}: not a reply.
        }
    }
}

/// One QEMU live migration, as QEMU's `query-migrate` reports it when completed (plus the
/// harness's own wall-clock measurement).
#[derive(Debug, Clone, Default, Serialize)]
pub struct QemuMigration {
    /// From `migrate` to completion (QEMU's total-time).
    pub total_ms: u64,
    /// Guest stopped: last dirty pages, device state, switch-over (QEMU's downtime).
    pub downtime_ms: u64,
    pub setup_ms: u64,
    /// From issuing `migrate` until `query-migrate` said completed, on the host clock.
    pub wall_ms: u64,
    pub transferred_bytes: u64,
    /// Guest RAM size as QEMU counts it (all RAM blocks, ROMs included).
    pub ram_total_bytes: u64,
    /// Pages sent with their contents.
    pub normal_pages: u64,
    /// Zero pages, sent as a marker only.
    pub duplicate_pages: u64,
    /// QEMU's own throughput figure (Mbit/s, of the last iteration).
    pub qemu_mbps: f64,
    /// transferred_bytes / total_ms, in MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// Dirty-bitmap syncs: the number of copy rounds.
    pub dirty_sync_count: u64,
    /// Guest RAM the destination QEMU was given, MiB.
    pub mem_mib: u64,
    pub downtime_limit_ms: Option<u64>,
}

/// A migration to run: `spec` on a source, the same on a destination.
#[derive(Debug, Clone)]
#[allow(dead_code)] // used by tests/qemu_e2e.rs; the bench chains migrate_to itself
pub struct MigrationSpec {
    pub vm: QemuSpec,
    /// Start migrating once the source's serial has a line containing this.
    pub ready_line: String,
    /// After migrating, wait for the destination's serial to have a line containing this.
    pub final_line: String,
    /// QMP `downtime-limit`; QEMU's default is 300 ms.
    pub downtime_limit_ms: Option<u64>,
    /// Bound on each phase (boot to ready line, migration, destination to final line).
    pub timeout: Duration,
    /// Start the destination with `-mem-prealloc`, as kumo's prepared destination
    /// (`--incoming … --memory`) has its memory faulted in before the migration.
    pub prepared_destination: bool,
}

/// QEMU's own default `downtime-limit` (ms).
pub const DEFAULT_DOWNTIME_LIMIT_MS: u64 = 300;

/// max-bandwidth for the migration: QEMU 7.2 throttles to 32 MiB/s by default; 100 GB/s is
/// far above what this machine's loopback carries.
const UNLIMITED_BANDWIDTH: u64 = 100_000_000_000;

/// Runs `m.vm` in a source QEMU until `m.ready_line`, live-migrates it over loopback TCP to a
/// destination QEMU, and waits for the destination to print `m.final_line`. Returns QEMU's
/// figures and the destination's serial output (what the guest printed after the switch-over).
#[allow(dead_code)] // used by tests/qemu_e2e.rs; the bench chains migrate_to itself
pub fn migrate(m: &MigrationSpec) -> Result<(QemuMigration, String), String> {
    let port = free_port()?;
    let mut src = QemuVm::spawn(&m.vm, None)?;
    // Started before the source is ready, so its start-up is not part of the measurement.
    let dst_spec = QemuSpec { prealloc: m.vm.prealloc || m.prepared_destination, ..m.vm.clone() };
    let mut dst = QemuVm::spawn(&dst_spec, Some(port))?;
    src.wait_serial(&m.ready_line, m.timeout)?;

    let mut r = migrate_to(&mut src, &dst, port, m.downtime_limit_ms, m.timeout)?;
    r.mem_mib = m.vm.mem_mib;
    let out = dst.wait_serial(&m.final_line, m.timeout)?;
    Ok((r, out))
}

/// Live-migrates `src` to `dst`, a QEMU started with `-incoming` on 127.0.0.1:`port`, and
/// waits until QEMU reports the migration completed (polled every 5 ms). `src` stays behind,
/// stopped; `dst` runs the guest.
pub fn migrate_to(
    src: &mut QemuVm,
    dst: &QemuVm,
    port: u16,
    downtime_limit_ms: Option<u64>,
    timeout: Duration,
) -> Result<QemuMigration, String> {
    // Always set: a source that failed an earlier migration keeps its parameters.
    let limit = downtime_limit_ms.unwrap_or(DEFAULT_DOWNTIME_LIMIT_MS);
    let params = json!({ "max-bandwidth": UNLIMITED_BANDWIDTH, "downtime-limit": limit });
    src.qmp("migrate-set-parameters", params)?;
    let t0 = Instant::now();
    src.qmp("migrate", json!({ "uri": format!("tcp:127.0.0.1:{port}") }))?;
    let info = loop {
        let info = src.qmp("query-migrate", Value::Null)?;
        match info["status"].as_str().unwrap_or("") {
            "completed" => break info,
            "failed" | "cancelled" => {
                let why = info["error-desc"].as_str().unwrap_or("no reason given").to_string();
                return Err(format!(
                    "{}\n(destination) {}",
                    src.why(&format!("migration {}: {why}", info["status"])),
                    dst.why("")
                ));
            }
            _ if t0.elapsed() > timeout => {
                let _ = src.qmp("migrate_cancel", Value::Null);
                return Err(src.why(&format!("migration not done within {timeout:?}: {info}")));
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let wall_ms = t0.elapsed().as_millis() as u64;
    let mut r = parse_migration(&info)?;
    r.wall_ms = wall_ms;
    r.downtime_limit_ms = downtime_limit_ms;
    Ok(r)
}

/// [`migrate`] for the memtouch guest: `mem_mib` of RAM, `guest_args` for memtouch, migrate
/// when the source prints `ready_line`, done when the destination prints its checksum
/// (`memtouch: checksum=`; with `hold_ms`, `memtouch: checksum_after_hold=`).
#[allow(dead_code)] // used by tests/qemu_e2e.rs; the bench chains migrate_to itself
pub fn migrate_memtouch(
    mem_mib: u64,
    guest_args: &[String],
    ready_line: &str,
    downtime_limit_ms: Option<u64>,
    prepared_destination: bool,
    timeout: Duration,
) -> Result<(QemuMigration, String), String> {
    let holds = guest_args.iter().any(|a| a.starts_with("hold_ms=") && a != "hold_ms=0");
    let final_line = if holds { "memtouch: checksum_after_hold=" } else { "memtouch: checksum=" };
    migrate(&MigrationSpec {
        vm: QemuSpec::new("memtouch", mem_mib, guest_args),
        ready_line: ready_line.into(),
        final_line: final_line.into(),
        downtime_limit_ms,
        timeout,
        prepared_destination,
    })
}

/// QEMU's `query-migrate` reply for a completed migration → [`QemuMigration`].
fn parse_migration(info: &Value) -> Result<QemuMigration, String> {
    let num = |v: &Value, key: &str| v[key].as_u64().ok_or_else(|| format!("query-migrate has no `{key}`: {info}"));
    let ram = &info["ram"];
    let total_ms = num(info, "total-time")?;
    let transferred = num(ram, "transferred")?;
    Ok(QemuMigration {
        total_ms,
        downtime_ms: num(info, "downtime")?,
        setup_ms: num(info, "setup-time").unwrap_or(0),
        transferred_bytes: transferred,
        ram_total_bytes: num(ram, "total")?,
        normal_pages: num(ram, "normal")?,
        duplicate_pages: num(ram, "duplicate")?,
        qemu_mbps: ram["mbps"].as_f64().unwrap_or(0.0),
        mb_per_s: if total_ms > 0 { transferred as f64 / 1000.0 / total_ms as f64 } else { 0.0 },
        dirty_sync_count: num(ram, "dirty-sync-count")?,
        ..Default::default()
    })
}

pub use crate::try_free_port as free_port;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_completed_query_migrate() {
        let info = json!({"status": "completed", "total-time": 2000, "downtime": 30, "setup-time": 2,
            "ram": {"transferred": 1_000_000_000u64, "total": 2_148_000_000u64, "normal": 240000, "duplicate": 280000,
                    "mbps": 4000.5, "dirty-sync-count": 3}});
        let m = parse_migration(&info).unwrap();
        assert_eq!(
            (m.total_ms, m.downtime_ms, m.setup_ms, m.normal_pages, m.duplicate_pages, m.dirty_sync_count),
            (2000, 30, 2, 240000, 280000, 3)
        );
        assert_eq!(m.mb_per_s, 500.0);
        assert!(parse_migration(&json!({"status": "completed"})).unwrap_err().contains("total-time"));
    }

    #[test]
    fn bad_specs_are_errors_not_panics() {
        if qemu_binary().is_err() || kvm_usable().is_err() {
            return; // spawn reports those first
        }
        assert!(QemuVm::spawn(&QemuSpec::new("nope", 64, &[]), None).err().unwrap().contains("unknown guest"));
        assert!(QemuVm::spawn(&QemuSpec::new("hello", 8, &[]), None).err().unwrap().contains("MiB"));
        let bad = QemuSpec::new("memtouch", 64, &["pages=x,y".to_string()]);
        assert!(QemuVm::spawn(&bad, None).is_err());
    }
}
