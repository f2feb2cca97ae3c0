//! `kumo bench handover`: seed 001's experiment. `kumo net-backend` owns a host tap and serves
//! two kumo VMs over vhost-user; the host sends sequence-numbered 1 KB UDP datagrams to the
//! NIC's address, and the NIC moves between the running guests.
//! - **Loss**: both guests run `udpsink`; N datagrams at 1 ms, at 100 µs, and self-clocked (as
//!   fast as the path delivers them); after N/2 the NIC is handed A → B. Lost = N minus what
//!   A and B counted.
//! - **Outage**: both run `netecho`; datagrams every 1 ms while the NIC goes back and forth
//!   (`--cycles` handovers). Per handover: the pause inside the backend (no one served) and the
//!   end-to-end outage, the largest extra round trip a datagram sent around the handover saw
//!   (its echo's delay beyond the median).
//! - **Baseline**: the NIC is unplugged from A (A's kumo is killed) and B's driver initialises
//!   it from scratch (`init_on_input=1`: reset, features, queues, DRIVER_OK once the bench
//!   types to B); the outage is the gap in echoes seen by the host.
//!
//! Writes handover.json and handover.png; ends with
//! `lost_1ms=N lost_100us=N outage_p99_us=X baseline_outage_ms=Y` (X: the backend's pause p99).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::net::stats::{median, percentile};
use kumo_testkit::net::{self as host, NetGuard};
use kumo_testkit::Kid;

#[derive(clap::Args)]
pub struct Args {
    /// Fewer datagrams (3,000 per loss run) and handovers (20): under 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Datagrams per loss run [default: 10000, 3000 with --quick].
    #[arg(long)]
    packets: Option<u64>,
    /// Handovers back and forth in the outage series [default: 100, 20 with --quick].
    #[arg(long)]
    cycles: Option<u64>,
}

const PORT: u16 = 9;
const ECHO_PORT: u16 = 7;
const SIZE: usize = 1024;
const LIMIT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Serialize)]
struct LossRun {
    /// Datagram spacing in µs; 0: self-clocked.
    gap_us: u64,
    sent: u64,
    received_a: u64,
    received_b: u64,
    duplicates: u64,
    lost: u64,
    /// What the backend measured for the handover.
    backend_pause_us: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Cycles {
    handovers: u64,
    sent: u64,
    echoed: u64,
    lost: u64,
    /// Requests the old owner took in just before a handover and answered only when it owned
    /// the NIC again (or never): its transmit queue is not served while another VM owns the NIC.
    stranded: u64,
    backend_pause_us: Vec<u64>,
    e2e_outage_us: Vec<f64>,
    /// The backend's report of each handover (pause, first serve after the switch, ...).
    reports: Vec<serde_json::Value>,
    backend_pause_p50_us: Option<f64>,
    backend_pause_p99_us: Option<f64>,
    e2e_outage_p50_us: Option<f64>,
    e2e_outage_p99_us: Option<f64>,
    median_rtt_us: Option<f64>,
    /// (seconds since the start, round trip in µs) of every echo, and the handover instants.
    series: Vec<(f64, f64)>,
    marks: Vec<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Baseline {
    sent: u64,
    echoed: u64,
    lost: u64,
    /// Host side: the longest gap between two echoes.
    outage_ms: f64,
    #[serde(skip)]
    series: Vec<(f64, f64)>,
    #[serde(skip)]
    unplug_at: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    command: String,
    loss: Vec<LossRun>,
    cycles: Option<Cycles>,
    baseline: Option<Baseline>,
    errors: Vec<String>,
}

/// The backend process and its API.
struct Backend {
    _proc: Kid,
    sock: String,
    api: kumo_api::ApiClient,
}

impl Backend {
    fn start(dir: &Path, tap: &str) -> Result<Backend, String> {
        let (sock, api) = (dir.join("nic.sock"), dir.join("backend.sock"));
        let kumo = crate::kumo_binary()?;
        let argv: Vec<String> = [
            kumo.display().to_string(),
            "--api-socket".into(),
            api.display().to_string(),
            "net-backend".into(),
            "--tap".into(),
            tap.into(),
            "--socket".into(),
            sock.display().to_string(),
        ]
        .into();
        let p = Kid::start_in(None, &argv)?;
        let t = Instant::now();
        while !(sock.exists() && api.exists()) {
            if t.elapsed() > LIMIT {
                return Err(p.why("did not create its sockets"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Backend { _proc: p, sock: sock.display().to_string(), api: kumo_api::ApiClient::new(api) })
    }

    fn info(&self) -> Result<serde_json::Value, String> {
        match self.api.request("GET", "/api/v1/backend.info", None) {
            Ok((200, Some(v))) => Ok(v),
            Ok((s, b)) => Err(format!("backend.info: {s} {b:?}")),
            Err(e) => Err(format!("backend.info: {e}")),
        }
    }

    /// The client id of the VM whose kumo is `pid`, once its queues are set up.
    fn ready_client(&self, pid: u32) -> Result<u64, String> {
        let t = Instant::now();
        loop {
            let info = self.info()?;
            let found = info["clients"].as_array().and_then(|cs| {
                cs.iter().find(|c| c["pid"].as_u64() == Some(pid.into()) && c["ready"] == true)?["id"].as_u64()
            });
            if let Some(id) = found {
                return Ok(id);
            }
            if t.elapsed() > LIMIT {
                return Err(format!("the VM (pid {pid}) never became a ready client: {info}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Hands the NIC to `to`; the backend's report.
    fn handover(&self, to: u64) -> Result<serde_json::Value, String> {
        let body = serde_json::json!({ "to": to });
        match self.api.request("PUT", "/api/v1/backend.handover", Some(&body)) {
            Ok((200, Some(v))) => Ok(v),
            Ok((s, b)) => Err(format!("handover to {to}: {s} {b:?}")),
            Err(e) => Err(format!("handover to {to}: {e}")),
        }
    }

    /// Frames the backend put into any VM's receive ring so far.
    fn delivered(&self) -> Result<u64, String> {
        let info = self.info()?;
        Ok(info["clients"].as_array().map_or(0, |cs| cs.iter().filter_map(|c| c["rx_packets"].as_u64()).sum()))
    }
}

fn pause_of(report: &serde_json::Value) -> Option<u64> {
    report["pause_us"].as_u64()
}

/// A kumo VM running `guest` on the backend's NIC, once its driver is up (or waits for input).
fn vm(b: &Backend, guest: &str, args: &[String], wait_for: &str) -> Result<Kid, String> {
    let kumo = crate::kumo_binary()?;
    let mut argv: Vec<String> = vec![
        kumo.display().to_string(),
        "run".into(),
        "--timeout".into(),
        "0".into(),
        "--net".into(),
        format!("vhost-user={}", b.sock),
        "--guest".into(),
        guest.into(),
    ];
    argv.extend(args.iter().cloned());
    let mut p = Kid::start_in(None, &argv)?;
    p.wait_line(LIMIT, wait_for, |l| l.contains(wait_for).then_some(()))?;
    Ok(p)
}

fn datagram(seq: u64, total: u64) -> [u8; SIZE] {
    let mut d = [0u8; SIZE];
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d[8..16].copy_from_slice(&total.to_le_bytes());
    d
}

/// Waits until `at` (sleeping while far, spinning the last 50 µs: the VMs need the cores).
fn until(at: Instant) {
    loop {
        let now = Instant::now();
        if now >= at {
            return;
        }
        let left = at - now;
        if left > Duration::from_micros(120) {
            std::thread::sleep(left - Duration::from_micros(70));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Sends `n` datagrams `gap` apart (zero: self-clocked, at most 200 not yet delivered by the
/// backend), publishing progress in `sent`; returns the send instants.
fn send_stream(
    sock: &UdpSocket,
    to: SocketAddrV4,
    n: u64,
    gap: Duration,
    sent: &AtomicU64,
    b: &Backend,
) -> Vec<Instant> {
    let mut at = Vec::with_capacity(n as usize);
    let t0 = Instant::now();
    for seq in 0..n {
        if gap.is_zero() {
            if seq % 50 == 0 {
                let t = Instant::now();
                while b.delivered().map_or(true, |d| seq > d + 200) && t.elapsed() < LIMIT {
                    std::thread::yield_now();
                }
            }
        } else {
            until(t0 + gap * seq as u32);
        }
        let now = Instant::now();
        let _ = sock.send_to(&datagram(seq, n), to);
        at.push(now);
        sent.store(seq + 1, Ordering::SeqCst);
    }
    at
}

fn sink_counts(p: &Kid) -> Option<(u64, u64)> {
    let line = p.lines().into_iter().find_map(|(_, l)| l.strip_prefix("udpsink: received=").map(str::to_string))?;
    let received = line.split_whitespace().next()?.parse().ok()?;
    let dup = line.split_whitespace().find_map(|w| w.strip_prefix("dup="))?.parse().ok()?;
    Some((received, dup))
}

/// One loss run: udpsink on A and B, `n` datagrams, A → B after n/2.
fn loss_run(b: &Backend, net: &Net, n: u64, gap: Duration) -> Result<LossRun, String> {
    let args = vec![format!("ip={}", net.guest), "until_input=1".into()];
    let mut a = vm(b, "udpsink", &args, "up nic=0")?;
    let id_a = b.ready_client(a.id())?;
    let mut bb = vm(b, "udpsink", &args, "up nic=0")?;
    let id_b = b.ready_client(bb.id())?;
    if b.info()?["owner"].as_u64() != Some(id_a) {
        b.handover(id_a)?;
    }
    let sock = net.socket()?;
    let sent = Arc::new(AtomicU64::new(0));
    let to = SocketAddrV4::new(net.guest, PORT);
    let report = std::thread::scope(|s| -> Result<serde_json::Value, String> {
        let sender = s.spawn(|| send_stream(&sock, to, n, gap, &sent, b));
        let t = Instant::now();
        while sent.load(Ordering::SeqCst) < n / 2 && t.elapsed() < LIMIT {
            std::thread::sleep(Duration::from_micros(50));
        }
        let r = b.handover(id_b);
        sender.join().map_err(|_| "the sender panicked".to_string())?;
        r
    })?;
    // B counts until the end marker; A (no longer served) stops on console input.
    for _ in 0..3 {
        let _ = sock.send_to(&datagram(u64::MAX, n), to);
    }
    bb.wait_exit(LIMIT)?;
    a.send(b"q")?;
    a.wait_exit(LIMIT)?;
    let (ra, da) = sink_counts(&a).ok_or_else(|| a.why("printed no counts"))?;
    let (rb, db) = sink_counts(&bb).ok_or_else(|| bb.why("printed no counts"))?;
    Ok(LossRun {
        gap_us: gap.as_micros() as u64,
        sent: n,
        received_a: ra,
        received_b: rb,
        duplicates: da + db,
        lost: n.saturating_sub(ra + rb),
        backend_pause_us: pause_of(&report),
    })
}

/// The host side of the test network.
struct Net {
    host: Ipv4Addr,
    guest: Ipv4Addr,
}

impl Net {
    fn socket(&self) -> Result<UdpSocket, String> {
        UdpSocket::bind(SocketAddrV4::new(self.host, 0)).map_err(|e| format!("bind {}: {e}", self.host))
    }
}

/// Echo receiver: (sequence, arrival) of every echo until `stop`.
fn receive_echoes(sock: UdpSocket, stop: Arc<AtomicU64>) -> Vec<(u64, Instant)> {
    let _ = sock.set_read_timeout(Some(Duration::from_millis(20)));
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    while stop.load(Ordering::SeqCst) == 0 {
        if let Ok((len, _)) = sock.recv_from(&mut buf) {
            if len >= 8 {
                got.push((u64::from_le_bytes(buf[..8].try_into().unwrap_or_default()), Instant::now()));
            }
        }
    }
    got
}

/// Round trips (µs) by sequence number, and the echoed count (duplicates once).
fn rtts(sends: &[Instant], echoes: &[(u64, Instant)]) -> (Vec<Option<f64>>, u64) {
    let mut rtt = vec![None; sends.len()];
    for &(seq, at) in echoes {
        if let Some(slot) = rtt.get_mut(seq as usize) {
            if slot.is_none() {
                *slot = Some(at.saturating_duration_since(sends[seq as usize]).as_secs_f64() * 1e6);
            }
        }
    }
    let echoed = rtt.iter().filter(|r| r.is_some()).count() as u64;
    (rtt, echoed)
}

/// The end-to-end outage of a handover at `at`: the largest extra round trip (beyond `base`)
/// of a datagram sent in the 5 ms after it; a lost one counts as the time until the next echo
/// arrived. Datagrams sent before the switch are not in it: one that the old owner took in
/// just before the switch is answered only when that VM owns the NIC again (see `stranded`).
fn e2e_outage(sends: &[Instant], rtt: &[Option<f64>], at: Instant, base: f64) -> f64 {
    let hi = at + Duration::from_millis(5);
    let mut worst: f64 = 0.0;
    for (i, s) in sends.iter().enumerate() {
        if *s < at || *s > hi {
            continue;
        }
        let extra = match rtt[i] {
            Some(r) => r - base,
            None => {
                // Lost: until the next datagram's echo came back.
                let next = rtt[i + 1..].iter().zip(&sends[i + 1..]).find_map(|(r, t)| r.map(|r| (*t, r)));
                next.map_or(0.0, |(t, r)| t.saturating_duration_since(*s).as_secs_f64() * 1e6 + r - base)
            }
        };
        worst = worst.max(extra);
    }
    worst
}

/// Datagrams sent in the 2 ms before a handover at `at` whose echo came only after `until` (the
/// next handover: the old owner got the NIC back and sent it then) or never: requests the old
/// owner had taken in when its NIC went away.
fn stranded(sends: &[Instant], rtt: &[Option<f64>], at: Instant, until: Option<Instant>) -> u64 {
    let lo = at - Duration::from_millis(2);
    let late = |i: usize| match (rtt[i], until) {
        (None, _) => true,
        (Some(r), Some(u)) => sends[i] + Duration::from_secs_f64(r / 1e6) > u,
        (Some(_), None) => false,
    };
    (0..sends.len()).filter(|&i| sends[i] >= lo && sends[i] < at && late(i)).count() as u64
}

fn cycles_run(b: &Backend, net: &Net, handovers: u64) -> Result<Cycles, String> {
    let args = vec![format!("ip={}", net.guest)];
    let a = vm(b, "netecho", &args, "up nic=0")?;
    let id_a = b.ready_client(a.id())?;
    let bb = vm(b, "netecho", &args, "up nic=0")?;
    let id_b = b.ready_client(bb.id())?;
    if b.info()?["owner"].as_u64() != Some(id_a) {
        b.handover(id_a)?;
    }
    const EVERY: u64 = 50;
    let n = (handovers + 2) * EVERY;
    let sock = net.socket()?;
    let rx = sock.try_clone().map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let to = SocketAddrV4::new(net.guest, ECHO_PORT);
    let t0 = Instant::now();
    let (sends, echoes, marks, pauses, reports) = std::thread::scope(|s| -> Result<_, String> {
        let receiver = {
            let stop = stop.clone();
            s.spawn(move || receive_echoes(rx, stop))
        };
        let sender = s.spawn(|| send_stream(&sock, to, n, Duration::from_millis(1), &sent, b));
        let (mut marks, mut pauses, mut reports) = (Vec::new(), Vec::new(), Vec::new());
        for k in 0..handovers {
            let at = (k + 1) * EVERY;
            while sent.load(Ordering::SeqCst) < at {
                std::thread::sleep(Duration::from_micros(100));
            }
            marks.push(Instant::now());
            let r = b.handover(if k % 2 == 0 { id_b } else { id_a })?;
            pauses.extend(pause_of(&r));
            reports.push(r);
        }
        let sends = sender.join().map_err(|_| "the sender panicked".to_string())?;
        std::thread::sleep(Duration::from_millis(200)); // the last echoes
        stop.store(1, Ordering::SeqCst);
        let echoes = receiver.join().map_err(|_| "the receiver panicked".to_string())?;
        Ok((sends, echoes, marks, pauses, reports))
    })?;
    drop((a, bb));
    let (rtt, echoed) = rtts(&sends, &echoes);
    let all: Vec<f64> = rtt.iter().flatten().copied().collect();
    let base = median(&all).unwrap_or(0.0);
    let outages: Vec<f64> = marks.iter().map(|&m| e2e_outage(&sends, &rtt, m, base)).collect();
    let stranded: u64 =
        marks.iter().enumerate().map(|(k, &m)| stranded(&sends, &rtt, m, marks.get(k + 1).copied())).sum();
    let pauses_f: Vec<f64> = pauses.iter().map(|&p| p as f64).collect();
    Ok(Cycles {
        handovers,
        sent: n,
        echoed,
        lost: n - echoed,
        stranded,
        backend_pause_p50_us: percentile(&pauses_f, 50.0),
        backend_pause_p99_us: percentile(&pauses_f, 99.0),
        e2e_outage_p50_us: percentile(&outages, 50.0),
        e2e_outage_p99_us: percentile(&outages, 99.0),
        median_rtt_us: median(&all),
        backend_pause_us: pauses,
        e2e_outage_us: outages,
        reports,
        series: sends
            .iter()
            .zip(&rtt)
            .filter_map(|(s, r)| r.map(|r| (s.duration_since(t0).as_secs_f64(), r)))
            .collect(),
        marks: marks.iter().map(|m| m.duration_since(t0).as_secs_f64()).collect(),
    })
}

fn baseline_run(b: &Backend, net: &Net) -> Result<Baseline, String> {
    let a = vm(b, "netecho", &[format!("ip={}", net.guest)], "up nic=0")?;
    b.ready_client(a.id())?;
    let mut bb = vm(b, "netecho", &[format!("ip={}", net.guest), "init_on_input=1".into()], "waits for console input")?;
    let n = 4000;
    let sock = net.socket()?;
    let rx = sock.try_clone().map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let to = SocketAddrV4::new(net.guest, ECHO_PORT);
    let t0 = Instant::now();
    let mut a = Some(a);
    let (sends, echoes, unplug) = std::thread::scope(|s| -> Result<_, String> {
        let receiver = {
            let stop = stop.clone();
            s.spawn(move || receive_echoes(rx, stop))
        };
        let sender = s.spawn(|| send_stream(&sock, to, n, Duration::from_millis(1), &sent, b));
        while sent.load(Ordering::SeqCst) < 1000 {
            std::thread::sleep(Duration::from_micros(100));
        }
        // Unplug from A (its VMM goes away with its NIC), plug into B: its driver starts now.
        let unplug = Instant::now();
        drop(a.take());
        bb.send(b"go")?;
        let sends = sender.join().map_err(|_| "the sender panicked".to_string())?;
        std::thread::sleep(Duration::from_millis(200));
        stop.store(1, Ordering::SeqCst);
        let echoes = receiver.join().map_err(|_| "the receiver panicked".to_string())?;
        Ok((sends, echoes, unplug))
    })?;
    let (rtt, echoed) = rtts(&sends, &echoes);
    let mut arrivals: Vec<Instant> = echoes.iter().map(|e| e.1).collect();
    arrivals.sort();
    let gap = arrivals.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    Ok(Baseline {
        sent: n,
        echoed,
        lost: n - echoed,
        outage_ms: gap.as_secs_f64() * 1e3,
        series: sends
            .iter()
            .zip(&rtt)
            .filter_map(|(s, r)| r.map(|r| (s.duration_since(t0).as_secs_f64(), r)))
            .collect(),
        unplug_at: unplug.duration_since(t0).as_secs_f64(),
    })
}

pub fn run(a: Args, out: &Path) -> Result<i32, String> {
    if !kumo_vm::vm::kvm_available() {
        return Err("needs /dev/kvm".into());
    }
    let n = a.packets.unwrap_or(if a.quick { 3000 } else { 10_000 });
    let handovers = a.cycles.unwrap_or(if a.quick { 20 } else { 100 });
    host::sweep_stale();
    host::cleanup_on_signals("kumo bench handover")?;
    let mut guard = NetGuard::default();
    let tap = host::name("h");
    let b3 = (std::process::id() % 250) as u8;
    let net = Net { host: Ipv4Addr::new(10, 219, b3, 1), guest: Ipv4Addr::new(10, 219, b3, 2) };
    guard.host_tap(&tap, &format!("{}/24", net.host)).map_err(|e| format!("needs root to create a tap: {e}"))?;
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join("kumo-handover-"))
        .map_err(|e| e.to_string())?;
    let backend = Backend::start(dir.as_path(), &tap)?;
    // The NIC's MAC (the backend's default) as a permanent neighbour: no ARP for the host to
    // queue datagrams behind (and drop beyond its queue) while a guest answers.
    host::ip(&[
        "neigh",
        "replace",
        &net.guest.to_string(),
        "lladdr",
        "52:54:00:12:34:56",
        "dev",
        &tap,
        "nud",
        "permanent",
    ])?;
    let t0 = Instant::now();
    let say = |m: &str| eprintln!("[{:>5.1} s] {m}", t0.elapsed().as_secs_f64());

    let mut errors = Vec::new();
    let mut loss = Vec::new();
    for gap in [Duration::from_millis(1), Duration::from_micros(100), Duration::ZERO] {
        let packets = if gap.is_zero() { n * 3 } else { n };
        match loss_run(&backend, &net, packets, gap) {
            Ok(r) => {
                say(&format!("loss, {} µs apart: {} of {} lost", r.gap_us, r.lost, r.sent));
                loss.push(r);
            }
            Err(e) => {
                say(&format!("loss run at {gap:?} failed: {e}"));
                errors.push(e);
            }
        }
    }
    let cycles = cycles_run(&backend, &net, handovers)
        .inspect(|c| say(&format!("{} handovers: backend pause p99 {:?} µs", c.handovers, c.backend_pause_p99_us)))
        .map_err(|e| errors.push(e))
        .ok();
    let baseline = baseline_run(&backend, &net)
        .inspect(|r| say(&format!("baseline: outage {:.1} ms, {} lost", r.outage_ms, r.lost)))
        .map_err(|e| errors.push(e))
        .ok();
    let report = Report {
        bench: "handover",
        command: std::env::args().collect::<Vec<_>>().join(" "),
        loss,
        cycles,
        baseline,
        errors,
    };
    print!("{}", table(&report));
    let json = crate::out_file(out, "handover.json")?;
    std::fs::write(&json, serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?)
        .map_err(|e| format!("cannot write {}: {e}", json.display()))?;
    println!("\nJSON written to {}", json.display());
    let png = out.join("handover.png");
    match plot(&png, &report) {
        Ok(()) => println!("plot written to {}", png.display()),
        Err(e) => eprintln!("kumo bench handover: no plot: {e}"),
    }
    println!("{}", headline(&report));
    Ok(if report.errors.is_empty() { 0 } else { 1 })
}

fn headline(r: &Report) -> String {
    let lost = |gap: u64| r.loss.iter().find(|l| l.gap_us == gap).map_or("na".into(), |l| l.lost.to_string());
    let f = |v: Option<f64>, d: usize| v.map_or("na".to_string(), |v| format!("{v:.d$}"));
    format!(
        "lost_1ms={} lost_100us={} outage_p99_us={} baseline_outage_ms={}",
        lost(1000),
        lost(100),
        f(r.cycles.as_ref().and_then(|c| c.backend_pause_p99_us), 1),
        f(r.baseline.as_ref().map(|b| b.outage_ms), 1)
    )
}

fn table(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "\nkumo bench handover: the NIC moves A -> B under a UDP stream (1 KB datagrams)");
    let _ = writeln!(
        s,
        "{:<16} {:>8} {:>10} {:>10} {:>6} {:>6} {:>16}",
        "spacing", "sent", "A got", "B got", "dup", "lost", "backend pause us"
    );
    for l in &r.loss {
        let spacing = if l.gap_us == 0 { "self-clocked".to_string() } else { format!("{} us", l.gap_us) };
        let _ = writeln!(
            s,
            "{spacing:<16} {:>8} {:>10} {:>10} {:>6} {:>6} {:>16}",
            l.sent,
            l.received_a,
            l.received_b,
            l.duplicates,
            l.lost,
            l.backend_pause_us.map_or("-".into(), |v| v.to_string())
        );
    }
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    if let Some(c) = &r.cycles {
        let _ = writeln!(
            s,
            "\n{} handovers back and forth, 1 ms apart streams: backend pause p50 {} / p99 {} us; end to end outage p50 {} / p99 {} us (median RTT {} us); {} of {} echoes lost; {} requests stranded in the old owner",
            c.handovers,
            f(c.backend_pause_p50_us),
            f(c.backend_pause_p99_us),
            f(c.e2e_outage_p50_us),
            f(c.e2e_outage_p99_us),
            f(c.median_rtt_us),
            c.lost,
            c.sent,
            c.stranded
        );
    }
    if let Some(b) = &r.baseline {
        let _ = writeln!(
            s,
            "baseline (unplug from A, B's driver initialises the NIC from scratch): outage {:.1} ms, {} of {} echoes lost",
            b.outage_ms, b.lost, b.sent
        );
    }
    for e in &r.errors {
        let _ = writeln!(s, "FAILED: {e}");
    }
    s
}

fn plot(path: &Path, r: &Report) -> Result<(), String> {
    use plotters::prelude::*;
    crate::register_plot_font()?;
    use crate::plot_err as e;
    let root = BitMapBackend::new(path, (1600, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let (left, right) = root.split_horizontally(800);
    type Panel<'a, 'b> =
        (&'a DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>, &'a str, Vec<(f64, f64)>, Vec<f64>);
    let panels: [Panel; 2] = [
        (
            &left,
            "handovers under a 1 ms stream: echo round trip (us)",
            r.cycles.as_ref().map(|c| c.series.clone()).unwrap_or_default(),
            r.cycles.as_ref().map(|c| c.marks.clone()).unwrap_or_default(),
        ),
        (
            &right,
            "baseline: unplug + driver init from scratch (us)",
            r.baseline.as_ref().map(|b| b.series.clone()).unwrap_or_default(),
            r.baseline.as_ref().map(|b| vec![b.unplug_at]).unwrap_or_default(),
        ),
    ];
    for (area, title, series, marks) in panels {
        let xmax = series.iter().map(|p| p.0).fold(1.0, f64::max);
        let ymax = series.iter().map(|p| p.1).fold(10.0, f64::max) * 1.2;
        let mut c = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..xmax, (1.0..ymax).log_scale())
            .map_err(e)?;
        c.configure_mesh()
            .x_desc("seconds (send time)")
            .y_desc("round trip, us")
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(e)?;
        c.draw_series(series.iter().map(|&(x, y)| Circle::new((x, y.max(1.0)), 1, BLUE.filled()))).map_err(e)?;
        for m in marks {
            c.draw_series(LineSeries::new([(m, 1.0), (m, ymax)], RED.mix(0.5).stroke_width(1))).map_err(e)?;
        }
    }
    root.present().map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_the_outage_around_a_handover() {
        let t0 = Instant::now();
        let ms = |k: u64| t0 + Duration::from_millis(k);
        let sends: Vec<Instant> = (0..10).map(ms).collect();
        // Echoes 100 us after each send, except #5 (lost) and #6 (900 us late).
        let mut echoes: Vec<(u64, Instant)> =
            (0..10).filter(|&k| k != 5 && k != 6).map(|k| (k, ms(k) + Duration::from_micros(100))).collect();
        echoes.push((6, ms(6) + Duration::from_micros(1000)));
        echoes.push((3, ms(3) + Duration::from_micros(500))); // a duplicate counts once
        let (rtt, echoed) = rtts(&sends, &echoes);
        assert_eq!(echoed, 9);
        assert_eq!(rtt[6].map(|v| v.round()), Some(1000.0));
        // The handover at 5 ms: #5 was lost, the next echo (#6's) came 2 ms after #5 was sent.
        let o = e2e_outage(&sends, &rtt, ms(5), 100.0);
        assert!((o - 1900.0).abs() < 1.0, "{o}");
        // Far from it: nothing.
        assert_eq!(e2e_outage(&sends[..3], &rtt[..3], ms(100), 100.0), 0.0);
        // A handover at 6.5 ms: #5 (lost) and #6 (answered 1 ms late, after a next handover at
        // 6.9 ms) were stranded in the old owner; with no next handover only the lost one is.
        let at = t0 + Duration::from_micros(6500);
        assert_eq!(stranded(&sends, &rtt, at, Some(t0 + Duration::from_micros(6900))), 2);
        assert_eq!(stranded(&sends, &rtt, at, None), 1);
    }

    #[test]
    fn the_headline_says_na_for_what_did_not_run() {
        let r = Report {
            bench: "handover",
            command: String::new(),
            loss: vec![LossRun {
                gap_us: 1000,
                sent: 10,
                received_a: 5,
                received_b: 5,
                duplicates: 0,
                lost: 0,
                backend_pause_us: Some(30),
            }],
            cycles: None,
            baseline: None,
            errors: vec!["x".into()],
        };
        assert_eq!(headline(&r), "lost_1ms=0 lost_100us=na outage_p99_us=na baseline_outage_ms=na");
        assert!(table(&r).contains("FAILED: x"));
    }

    #[test]
    fn plot_draws_a_png() {
        let series: Vec<(f64, f64)> = (0..200).map(|k| (k as f64 / 1000.0, 150.0 + (k % 7) as f64 * 10.0)).collect();
        let r = Report {
            bench: "handover",
            command: String::new(),
            loss: vec![],
            cycles: Some(Cycles { series: series.clone(), marks: vec![0.05, 0.1], ..Default::default() }),
            baseline: Some(Baseline { series, unplug_at: 0.1, outage_ms: 25.0, ..Default::default() }),
            errors: vec![],
        };
        crate::check_plot("handover", |p| plot(p, &r));
    }
}
