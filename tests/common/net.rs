//! Host-side network set-up for end-to-end tests: taps, a bridge, a UDP echo service, `ping`.
//! Everything made here is removed on drop. Creating a tap needs root (or CAP_NET_ADMIN):
//! tests skip, saying why, where it fails.
#![allow(dead_code)]

use std::net::{SocketAddrV4, UdpSocket};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip`: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}`: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
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
