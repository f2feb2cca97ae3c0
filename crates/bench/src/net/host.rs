//! Host plumbing of `kumo bench net`: network namespaces, veth pairs, taps and bridges made with
//! `ip` and removed on every exit path (drop, error, SIGINT/SIGTERM/SIGHUP; a run killed with
//! SIGKILL leaves names with its dead pid, which the next run removes), and child processes
//! (kumo, `kumo-bench net-tool`) killed when dropped.
//!
//! Everything of one run lives in namespaces named `kbn<pid><tag>`: the taps and bridges too,
//! with kumo started inside (`ip netns exec`), so the bench never touches the host's own
//! addresses or routes, nor another run's.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Prefix of every name the bench creates.
const PREFIX: &str = "kbn";

/// Undo commands of all live [`NetGuard`]s, for the signal handler.
static UNDO: Mutex<Vec<Vec<String>>> = Mutex::new(Vec::new());
/// Pids of all live [`Proc`]s, killed by the signal handler (their drops do not run then).
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Runs `ip ARGS`; the error is ip's own one line.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(format!("`ip {}` failed: {}", args.join(" "), err.lines().next().unwrap_or("").trim()))
}

fn run_quiet(cmd: &[String]) {
    let _ = Command::new("ip").args(cmd).stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// `kbn<pid><tag>`: at most 15 bytes (an interface name's limit) for tags of up to 5.
pub fn name(tag: &str) -> String {
    format!("{PREFIX}{}{tag}", std::process::id())
}

/// The pid in a name made by [`name`] (None for names not ours).
fn owner(name: &str) -> Option<u32> {
    let digits: String = name.strip_prefix(PREFIX)?.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Removes namespaces and links left by bench runs that no longer exist (killed with SIGKILL).
pub fn sweep_stale() {
    let dead = |n: &str| owner(n).is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
    if let Ok(o) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            // "3: kbn123t0@if2: <...": the name, without a peer suffix.
            let n = l.split(':').nth(1).map(|s| s.trim().split('@').next().unwrap_or("")).unwrap_or("");
            if dead(n) {
                run_quiet(&["link".into(), "del".into(), n.into()]);
            }
        }
    }
    if let Ok(o) = Command::new("ip").args(["netns", "list"]).output() {
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            let n = l.split_whitespace().next().unwrap_or("");
            if dead(n) {
                run_quiet(&["netns".into(), "del".into(), n.into()]);
            }
        }
    }
}

/// On SIGINT/SIGTERM/SIGHUP: kill the children, undo every live guard's changes, exit 130.
pub fn cleanup_on_signals() -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut s = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| format!("cannot handle signals: {e}"))?;
    std::thread::spawn(move || {
        if let Some(sig) = s.forever().next() {
            let pids: Vec<String> = CHILDREN.lock().map(|c| c.iter().map(u32::to_string).collect()).unwrap_or_default();
            if !pids.is_empty() {
                let _ = Command::new("kill").arg("-KILL").args(&pids).stderr(Stdio::null()).status();
            }
            let undo: Vec<Vec<String>> = UNDO.lock().map(|mut u| std::mem::take(&mut *u)).unwrap_or_default();
            for c in undo.iter().rev() {
                run_quiet(c);
            }
            eprintln!("kumo bench net: stopped by signal {sig}; its namespaces and links are removed");
            std::process::exit(130);
        }
    });
    Ok(())
}

/// Network changes undone in reverse order when dropped.
#[derive(Default)]
pub struct NetGuard {
    undo: Vec<Vec<String>>,
}

impl Drop for NetGuard {
    fn drop(&mut self) {
        for c in self.undo.iter().rev() {
            run_quiet(c);
        }
        if let Ok(mut u) = UNDO.lock() {
            u.retain(|c| !self.undo.contains(c));
        }
    }
}

impl NetGuard {
    fn remember(&mut self, undo: &[&str]) {
        let c: Vec<String> = undo.iter().map(|s| s.to_string()).collect();
        if let Ok(mut u) = UNDO.lock() {
            u.push(c.clone());
        }
        self.undo.push(c);
    }

    /// A new network namespace with its loopback up.
    pub fn netns(&mut self, ns: &str) -> Result<(), String> {
        ip(&["netns", "add", ns])?;
        self.remember(&["netns", "del", ns]);
        ip(&["-n", ns, "link", "set", "lo", "up"])
    }

    /// A veth pair, end `a` (address `a_cidr`) in namespace `ns_a`, `b` in `ns_b`, both up.
    pub fn veth(
        &mut self,
        (a, ns_a, a_cidr): (&str, &str, &str),
        (b, ns_b, b_cidr): (&str, &str, &str),
    ) -> Result<(), String> {
        ip(&["link", "add", a, "type", "veth", "peer", "name", b])?;
        // Deleting either end removes both; gone with its namespace anyway once moved.
        self.remember(&["link", "del", a]);
        for (dev, ns, cidr) in [(a, ns_a, a_cidr), (b, ns_b, b_cidr)] {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", cidr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// A multiqueue vnet-header tap in `ns` (kumo attaches to it), with `cidr` if given, up;
    /// removed with the namespace.
    /// A tap in this (the root) namespace with `cidr` on the host side, up.
    pub fn host_tap(&mut self, dev: &str, cidr: &str) -> Result<(), String> {
        ip(&["tuntap", "add", "dev", dev, "mode", "tap"])?;
        self.remember(&["link", "del", dev]);
        ip(&["addr", "add", cidr, "dev", dev])?;
        ip(&["link", "set", dev, "up"])
    }

    pub fn tap(&mut self, ns: &str, dev: &str, cidr: Option<&str>) -> Result<(), String> {
        ip(&["-n", ns, "tuntap", "add", "dev", dev, "mode", "tap", "multi_queue", "vnet_hdr"])?;
        if let Some(c) = cidr {
            ip(&["-n", ns, "addr", "add", c, "dev", dev])?;
        }
        ip(&["-n", ns, "link", "set", dev, "up"])
    }

    /// A bridge in `ns` joining `ports`, all up.
    pub fn bridge(&mut self, ns: &str, br: &str, ports: &[&str]) -> Result<(), String> {
        ip(&["-n", ns, "link", "add", br, "type", "bridge"])?;
        for p in ports {
            ip(&["-n", ns, "link", "set", p, "master", br])?;
        }
        ip(&["-n", ns, "link", "set", br, "up"])
    }

    /// A permanent neighbour entry: no ARP on the measured path.
    pub fn neigh(&mut self, ns: &str, addr: &str, mac: &str, dev: &str) -> Result<(), String> {
        ip(&["-n", ns, "neigh", "replace", addr, "lladdr", mac, "dev", dev, "nud", "permanent"])
    }
}

/// Output lines of a child, each with the host time it arrived.
type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

/// A child process whose stdout and stderr are collected by threads; killed when dropped.
pub struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Lines,
    err: Lines,
    readers: Vec<std::thread::JoinHandle<()>>,
    pub started: Instant,
    what: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let pid = self.child.id();
        if let Ok(mut c) = CHILDREN.lock() {
            c.retain(|p| *p != pid);
        }
    }
}

fn collect<R: std::io::Read + Send + 'static>(r: R, lines: Lines) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
            let at = Instant::now();
            if let Ok(mut l) = lines.lock() {
                l.push((at, String::from_utf8_lossy(&buf).trim_end().to_string()));
            }
            buf.clear();
        }
    })
}

impl Proc {
    /// The process id (`ip netns exec` execs its command, so it is the command's).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `argv` (in namespace `ns` if given, through `ip netns exec`).
    pub fn spawn(ns: Option<&str>, argv: &[String]) -> Result<Proc, String> {
        let mut full: Vec<String> = match ns {
            Some(ns) => ["ip", "netns", "exec", ns].iter().map(|s| s.to_string()).collect(),
            None => vec![],
        };
        full.extend(argv.iter().cloned());
        let what = format!("`{}`", argv.iter().take(6).cloned().collect::<Vec<_>>().join(" "));
        let mut child = Command::new(&full[0])
            .args(&full[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        if let Ok(mut c) = CHILDREN.lock() {
            c.push(child.id());
        }
        let (out, err): (Lines, Lines) = (Arc::default(), Arc::default());
        let mut readers = vec![];
        if let Some(o) = child.stdout.take() {
            readers.push(collect(o, out.clone()));
        }
        if let Some(e) = child.stderr.take() {
            readers.push(collect(e, err.clone()));
        }
        Ok(Proc { stdin: child.stdin.take(), child, out, err, readers, started: Instant::now(), what })
    }

    pub fn stdout(&self) -> Vec<(Instant, String)> {
        self.out.lock().map(|l| l.clone()).unwrap_or_default()
    }

    pub fn stderr_text(&self) -> String {
        self.err.lock().map(|l| l.iter().map(|(_, s)| s.as_str()).collect::<Vec<_>>().join("\n")).unwrap_or_default()
    }

    /// `msg`, naming the process and quoting its last stderr line.
    pub fn why(&self, msg: &str) -> String {
        let err = self.stderr_text();
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        format!("{} {msg}{}", self.what, if last.is_empty() { String::new() } else { format!(": {last}") })
    }

    /// Writes `bytes` to the child's stdin (a kumo VM's console).
    pub fn input(&mut self, bytes: &[u8]) -> Result<(), String> {
        let s = self.stdin.as_mut().ok_or_else(|| format!("{}: stdin is closed", self.what))?;
        s.write_all(bytes).and_then(|_| s.flush()).map_err(|e| format!("{}: stdin: {e}", self.what))
    }

    /// Closes the child's stdin (the flooder stops on EOF).
    pub fn close_stdin(&mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = s.flush();
        }
    }

    fn drain(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    /// Waits for a stdout line that `f` accepts, returning its arrival time and value; fails
    /// when the process exits first or after `limit`.
    pub fn wait_line<T>(
        &mut self,
        limit: Duration,
        what: &str,
        f: impl Fn(&str) -> Option<T>,
    ) -> Result<(Instant, T), String> {
        let t = Instant::now();
        loop {
            let exited = self.child.try_wait().ok().flatten();
            if exited.is_some() {
                self.drain();
            }
            if let Some(v) = self.stdout().into_iter().find_map(|(at, l)| f(&l).map(|v| (at, v))) {
                return Ok(v);
            }
            if let Some(st) = exited {
                return Err(self.why(&format!("exited ({st}) before {what}")));
            }
            if t.elapsed() > limit {
                return Err(self.why(&format!("gave no {what} within {} s", limit.as_secs())));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The exit code if the process has exited (without waiting).
    pub fn try_exit(&mut self) -> Result<Option<i32>, String> {
        match self.child.try_wait() {
            Ok(st) => Ok(st.map(|s| s.code().unwrap_or(-1))),
            Err(e) => Err(self.why(&format!("cannot be waited for: {e}"))),
        }
    }

    /// Waits for the exit (bounded); its status code.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<i32, String> {
        let t = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    self.drain();
                    return Ok(st.code().unwrap_or(-1));
                }
                Err(e) => return Err(self.why(&format!("cannot be waited for: {e}"))),
                Ok(None) if t.elapsed() > limit => {
                    return Err(self.why(&format!("did not exit within {} s", limit.as_secs())))
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Waits for a successful exit and returns the last stdout line parsed as JSON `T`.
    pub fn json_result<T: serde::de::DeserializeOwned>(&mut self, limit: Duration) -> Result<T, String> {
        let code = self.wait_exit(limit)?;
        if code != 0 {
            return Err(self.why(&format!("exited with {code}")));
        }
        let last = self.stdout().last().map(|(_, l)| l.clone()).unwrap_or_default();
        serde_json::from_str(&last).map_err(|e| self.why(&format!("printed no result ({e}): {last}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_an_interface_and_carry_the_pid() {
        let n = name("br0");
        assert!(n.len() <= 15, "{n}");
        assert_eq!(owner(&n), Some(std::process::id()));
        assert_eq!(owner("eth0"), None);
        assert_eq!(owner("kbnx"), None);
    }

    #[test]
    fn proc_collects_output_and_json() {
        let argv: Vec<String> = ["sh", "-c", "echo ready; echo '{\"sent\":3,\"failed\":0,\"secs\":0.5}'"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut p = Proc::spawn(None, &argv).expect("sh");
        let (_, l) = p.wait_line(Duration::from_secs(30), "ready", |l| (l == "ready").then_some(1)).expect("ready");
        assert_eq!(l, 1);
        let r: crate::net::tools::SendResult = p.json_result(Duration::from_secs(30)).expect("json");
        assert_eq!(r.sent, 3);
    }

    #[test]
    fn proc_reports_an_early_exit() {
        let argv: Vec<String> = ["sh", "-c", "echo oops >&2; exit 3"].iter().map(|s| s.to_string()).collect();
        let mut p = Proc::spawn(None, &argv).expect("sh");
        let e = p.wait_line(Duration::from_secs(30), "ready", |_| Some(())).err();
        // The line test never matches an empty stdout; the exit is reported with stderr.
        assert!(e.is_some_and(|e| e.contains("before ready") && e.contains("oops")));
    }
}
