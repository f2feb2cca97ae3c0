//! Host network set-up for end-to-end tests and benchmarks: taps, bridges, network namespaces
//! and veth pairs made with `ip`, a UDP echo service, `ping`. Everything made here is removed on
//! drop; a [`NetGuard`]'s changes also on SIGINT/SIGTERM/SIGHUP ([`cleanup_on_signals`]), and
//! names made by [`name`] by the next run after a SIGKILL ([`sweep_stale`]). Creating a tap
//! needs root (or CAP_NET_ADMIN): tests skip, saying why, where it fails.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Prefix of every name the bench creates.
const PREFIX: &str = "kbn";

/// Undo commands of all live [`NetGuard`]s, for the signal handler.
static UNDO: Mutex<Vec<Vec<String>>> = Mutex::new(Vec::new());

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

/// On SIGINT/SIGTERM/SIGHUP: kill the live [`crate::Kid`]s, undo every live guard's changes,
/// say so as `who` and exit 130.
pub fn cleanup_on_signals(who: &'static str) -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut s = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| format!("cannot handle signals: {e}"))?;
    std::thread::spawn(move || {
        if let Some(sig) = s.forever().next() {
            let pids: Vec<String> = crate::kid::live_pids().iter().map(u32::to_string).collect();
            if !pids.is_empty() {
                let _ = Command::new("kill").arg("-KILL").args(&pids).stderr(Stdio::null()).status();
            }
            let undo: Vec<Vec<String>> = UNDO.lock().map(|mut u| std::mem::take(&mut *u)).unwrap_or_default();
            for c in undo.iter().rev() {
                run_quiet(c);
            }
            eprintln!("{who}: stopped by signal {sig}; its namespaces and links are removed");
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

    /// A tap in this (the root) namespace with `cidr` on the host side, up.
    pub fn host_tap(&mut self, dev: &str, cidr: &str) -> Result<(), String> {
        ip(&["tuntap", "add", "dev", dev, "mode", "tap"])?;
        self.remember(&["link", "del", dev]);
        ip(&["addr", "add", cidr, "dev", dev])?;
        ip(&["link", "set", dev, "up"])
    }

    /// A multiqueue vnet-header tap in `ns` (kumo attaches to it), with `cidr` if given, up;
    /// removed with the namespace.
    pub fn tap(&mut self, ns: &str, dev: &str, cidr: Option<&str>) -> Result<(), String> {
        self.tap_with(ns, dev, cidr, &["multi_queue", "vnet_hdr"])
    }

    /// [`NetGuard::tap`] with one queue: kumo attaches to it the same way, and QEMU's tap
    /// backend can open it too (it opens a multi-queue tap only with `queues=` > 1).
    pub fn single_queue_tap(&mut self, ns: &str, dev: &str, cidr: Option<&str>) -> Result<(), String> {
        self.tap_with(ns, dev, cidr, &["vnet_hdr"])
    }

    fn tap_with(&mut self, ns: &str, dev: &str, cidr: Option<&str>, flags: &[&str]) -> Result<(), String> {
        let mut args = vec!["-n", ns, "tuntap", "add", "dev", dev, "mode", "tap"];
        args.extend_from_slice(flags);
        ip(&args)?;
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

/// A host tap, deleted on drop.
pub struct Tap {
    pub name: String,
}

impl Tap {
    /// A plain tap with `host_cidr` on the host side.
    pub fn create(name: &str, host_cidr: &str) -> Result<Tap, String> {
        Tap::with_flags(name, Some(host_cidr), &[])
    }

    /// A multi-queue tap with vnet headers, as `kumo run --net` wants for migrations (two
    /// processes attach it at once); with `host_cidr` the host side gets that address.
    pub fn multi_queue(name: &str, host_cidr: Option<&str>) -> Result<Tap, String> {
        Tap::with_flags(name, host_cidr, &["multi_queue", "vnet_hdr"])
    }

    fn with_flags(name: &str, host_cidr: Option<&str>, flags: &[&str]) -> Result<Tap, String> {
        let _ = ip(&["link", "del", name]); // left over from a killed run
        let mut args = vec!["tuntap", "add", "dev", name, "mode", "tap"];
        args.extend_from_slice(flags);
        ip(&args)?;
        let tap = Tap { name: name.into() };
        if let Some(cidr) = host_cidr {
            ip(&["addr", "add", cidr, "dev", name])?;
        }
        ip(&["link", "set", name, "up"])?;
        Ok(tap)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.name]);
    }
}

/// A Linux bridge with taps enslaved, deleted on drop (after its taps).
pub struct Bridge {
    pub name: String,
    pub taps: Vec<Tap>,
}

impl Bridge {
    /// A bridge with `host_cidr` on it and `taps` multi-queue taps.
    pub fn create(name: &str, host_cidr: &str, taps: &[&str]) -> Result<Bridge, String> {
        let _ = ip(&["link", "del", name]);
        ip(&["link", "add", name, "type", "bridge"])?;
        let mut br = Bridge { name: name.into(), taps: Vec::new() };
        ip(&["addr", "add", host_cidr, "dev", name])?;
        ip(&["link", "set", name, "up"])?;
        for t in taps {
            let tap = Tap::multi_queue(t, None)?;
            ip(&["link", "set", t, "master", name])?;
            br.taps.push(tap);
        }
        Ok(br)
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.taps.clear();
        let _ = ip(&["link", "del", &self.name]);
    }
}

/// A UDP echo service on the host, stopped on drop.
pub struct HostEcho {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HostEcho {
    pub fn start(addr: SocketAddrV4) -> HostEcho {
        let sock = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        sock.set_read_timeout(Some(Duration::from_millis(100))).expect("read timeout");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !s.load(Ordering::Relaxed) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    let _ = sock.send_to(&buf[..n], from);
                }
            }
        });
        HostEcho { stop, thread: Some(thread) }
    }
}

impl Drop for HostEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether `ping` is installed.
pub fn have_ping() -> bool {
    Command::new("ping").arg("-V").output().map(|o| o.status.success()).unwrap_or(false)
}

/// `ping -c count` to `addr`, each reply waited for up to `wait_s`; returns how many replies came
/// and ping's output.
pub fn ping(addr: &str, count: u32, wait_s: u32) -> (u32, String) {
    let o = Command::new("ping")
        .args(["-c", &count.to_string(), "-i", "0.2", "-W", &wait_s.to_string(), addr])
        .output()
        .expect("run ping");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let got = text
        .lines()
        .find_map(|l| l.split(", ").find_map(|p| p.strip_suffix(" received")).and_then(|n| n.parse().ok()))
        .unwrap_or(0);
    (got, text)
}

/// Sends `n` datagrams to `to` from a socket bound on `from` and checks each comes back
/// unchanged from `to` (waiting up to `limit` for each).
pub fn udp_echoes(from: SocketAddrV4, to: SocketAddrV4, n: u8, limit: Duration) -> Result<(), String> {
    let sock = UdpSocket::bind(from).map_err(|e| format!("bind {from}: {e}"))?;
    sock.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    for i in 0..n {
        let msg = [i; 100];
        sock.send_to(&msg, to).map_err(|e| format!("send to {to}: {e}"))?;
        let mut buf = [0u8; 2048];
        let (len, who) = sock.recv_from(&mut buf).map_err(|e| format!("no echo of datagram {i} from {to}: {e}"))?;
        if buf[..len] != msg[..] || who != to.into() {
            return Err(format!("datagram {i}: a different answer ({len} bytes from {who})"));
        }
    }
    Ok(())
}

/// A per-process subnet `10.A.B.0/24` (B from the pid), so parallel runs do not collide: its
/// first three addresses (the host's, a guest's, another guest's).
pub fn subnet(a: u8) -> (Ipv4Addr, Ipv4Addr, Ipv4Addr) {
    let b = (std::process::id() % 250) as u8;
    (Ipv4Addr::new(10, a, b, 1), Ipv4Addr::new(10, a, b, 2), Ipv4Addr::new(10, a, b, 3))
}

/// A tap name for `tag` that is this process's (`kTAGPID`, within an interface name's 15 bytes
/// for tags of up to 4).
pub fn tap_name(tag: &str) -> String {
    format!("k{tag}{}", std::process::id() % 100_000)
}

/// A multi-queue tap `tap_name(tag)` (as `kumo run --net` wants it) with `host/24` on the host
/// side; None (after saying why) where KVM or a tap is not available.
pub fn tap_or_skip(test: &str, tag: &str, host: Ipv4Addr) -> Option<Tap> {
    tap_or_skip_with(test, || Tap::multi_queue(&tap_name(tag), Some(&format!("{host}/24"))))
}

/// The tap `make` creates; None (after saying why) where KVM or a tap is not available.
pub fn tap_or_skip_with(test: &str, make: impl FnOnce() -> Result<Tap, String>) -> Option<Tap> {
    if !crate::kvm_or_skip(test) {
        return None;
    }
    match make() {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("skipping {test}: cannot create a tap: {e}");
            None
        }
    }
}

/// Two network namespaces joined by a veth pair (`10.77.0.1/24` in `a`, `.2` in `b`): two
/// "hosts" on this machine, with addresses that exist only inside them. Needs root.
pub struct Netns {
    pub a: String,
    pub b: String,
    _guard: NetGuard,
}

impl Netns {
    pub fn create() -> Result<Netns, String> {
        let id = std::process::id() % 100_000;
        let (a, b) = (format!("kumo-a{id}"), format!("kumo-b{id}"));
        let mut g = NetGuard::default();
        g.netns(&a)?;
        g.netns(&b)?;
        g.veth((&format!("kva{id}"), &a, "10.77.0.1/24"), (&format!("kvb{id}"), &b, "10.77.0.2/24"))?;
        Ok(Netns { a, b, _guard: g })
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
        assert!(tap_name("h2a").len() <= 15);
    }
}
