//! Host-side UDP tools of `kumo bench net`, speaking the guests' wire formats: an RTT client and
//! an echo server (like `udpping`/`netecho`), a sequence-numbered stream sender and sink (like
//! `udpsend`/`udpsink`: bytes 0..8 the sequence number from 0, 8..16 the total count, both LE
//! u64; the end marker is sequence u64::MAX, sent 3 times) and a flooder for interference.
//! `kumo-bench net-tool ...` (hidden) runs each alone, e.g. inside a network namespace; it prints
//! `ready` once bound and one JSON line with its result.

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::stats::Latency;

/// Sequence number of the stream's end marker.
pub const SEQ_END: u64 = u64::MAX;
/// Packets sent before the RTT samples (ARP, caches); not counted.
pub const WARMUP: u64 = 10;
/// The RTT client gives up after this many requests in a row without any echo.
pub const GIVE_UP: u64 = 20;

fn io(what: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

pub fn bind(addr: SocketAddr) -> Result<UdpSocket, String> {
    UdpSocket::bind(addr).map_err(|e| format!("cannot bind UDP {addr}: {e}"))
}

fn put(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(buf: &[u8], at: usize) -> Option<u64> {
    buf.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
}

// ---------------------------------------------------------------------------------------------
// Round trips

/// Sends `count` requests of `size` bytes (at least 16: sequence number, send time) to `peer`,
/// one at a time, each waiting up to `timeout` for its echo; late echoes of earlier requests are
/// skipped. Returns the round trips (µs) and the number of requests lost.
pub fn rtt_client(
    sock: &UdpSocket,
    peer: SocketAddr,
    count: u64,
    size: usize,
    timeout: Duration,
) -> Result<(Vec<f64>, u64), String> {
    let size = size.max(16);
    sock.connect(peer).map_err(io("cannot connect the RTT socket"))?;
    let (mut out, mut buf) = (vec![0u8; size], vec![0u8; size.max(2048)]);
    let t0 = Instant::now();
    let (mut samples, mut lost) = (Vec::with_capacity(count as usize), 0u64);
    for seq in 0..count + WARMUP {
        put(&mut out, 0, seq);
        let sent = Instant::now();
        put(&mut out, 8, (sent - t0).as_nanos() as u64);
        // A refused send (ICMP unreachable for an earlier one) is a lost request, not an error.
        if sock.send(&out).is_err() {
            lost += u64::from(seq >= WARMUP);
            continue;
        }
        let deadline = sent + timeout;
        let got = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            sock.set_read_timeout(Some(left)).map_err(io("cannot set a read timeout"))?;
            match sock.recv(&mut buf) {
                Ok(n) if n >= 8 && get(&buf, 0) == Some(seq) => break Some(Instant::now()),
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    break None
                }
                // ECONNREFUSED from an earlier request's ICMP error: keep waiting for this one.
                Err(_) => continue,
            }
        };
        if seq < WARMUP {
            continue;
        }
        match got {
            Some(at) => samples.push((at - sent).as_nanos() as f64 / 1e3),
            None => lost += 1,
        }
        // Nobody answers: stop rather than wait out every timeout.
        if samples.is_empty() && lost >= GIVE_UP {
            lost = count;
            break;
        }
    }
    Ok((samples, lost))
}

/// Echoes every datagram back to its sender until `stop`; returns the number echoed.
pub fn echo_server(sock: &UdpSocket, stop: &AtomicBool) -> Result<u64, String> {
    sock.set_read_timeout(Some(Duration::from_millis(50))).map_err(io("cannot set a read timeout"))?;
    let (mut buf, mut n) = (vec![0u8; 65536], 0u64);
    while !stop.load(Ordering::Relaxed) {
        if let Ok((len, from)) = sock.recv_from(&mut buf) {
            if sock.send_to(&buf[..len], from).is_ok() {
                n += 1;
            }
        }
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------------
// Streams

/// What the stream sender did.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
pub struct SendResult {
    /// Datagrams handed to the kernel (not counting the end markers).
    pub sent: u64,
    /// Sends the kernel refused (e.g. ENOBUFS); those sequence numbers are never sent.
    pub failed: u64,
    pub secs: f64,
}

/// Sends `count` datagrams of `size` bytes (at least 16) with sequence numbers 0.. to `peer`,
/// `gap` apart (0: as fast as the socket takes them), then the end marker 3 times.
pub fn stream_send(
    sock: &UdpSocket,
    peer: SocketAddr,
    count: u64,
    size: usize,
    gap: Duration,
) -> Result<SendResult, String> {
    let mut buf = vec![0u8; size.max(16)];
    put(&mut buf, 8, count);
    let t0 = Instant::now();
    let mut r = SendResult::default();
    for seq in 0..count {
        if !gap.is_zero() {
            // Paced from the start, so one late packet does not delay all later ones.
            let due = t0 + Duration::from_nanos((gap.as_nanos() as u64).saturating_mul(seq));
            while Instant::now() < due {
                let left = due - Instant::now();
                if left > Duration::from_micros(200) {
                    std::thread::sleep(left - Duration::from_micros(100));
                }
            }
        }
        put(&mut buf, 0, seq);
        match sock.send_to(&buf, peer) {
            Ok(_) => r.sent += 1,
            Err(_) => r.failed += 1,
        }
    }
    r.secs = t0.elapsed().as_secs_f64();
    put(&mut buf, 0, SEQ_END);
    for _ in 0..3 {
        let _ = sock.send_to(&buf, peer);
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(r)
}

/// Counts a sequence-numbered stream: duplicates, packets arriving after a higher one
/// (reordered), and those never seen (lost) out of the total the packets announce.
#[derive(Default, Debug)]
pub struct SeqTracker {
    seen: Vec<u64>,
    total: u64,
    received: u64,
    dup: u64,
    reordered: u64,
    next: u64,
}

impl SeqTracker {
    /// Records one data packet; the end marker and sequence numbers beyond the announced total
    /// are not data (the latter count as nothing, so a stray packet cannot allocate memory).
    pub fn record(&mut self, seq: u64, total: u64) {
        if seq == SEQ_END {
            return;
        }
        self.total = self.total.max(total.min(1 << 32));
        if seq >= self.total {
            return;
        }
        let (w, b) = ((seq / 64) as usize, seq % 64);
        if self.seen.len() <= w {
            self.seen.resize(w + 1, 0);
        }
        if self.seen[w] & (1 << b) != 0 {
            self.dup += 1;
            return;
        }
        self.seen[w] |= 1 << b;
        self.received += 1;
        if seq < self.next {
            self.reordered += 1;
        }
        self.next = self.next.max(seq + 1);
    }

    pub fn received(&self) -> u64 {
        self.received
    }

    /// Packets of the announced total never received.
    pub fn lost(&self) -> u64 {
        self.total.saturating_sub(self.received)
    }
}

/// The sink's receive buffer, asked for (the kernel caps it at net.core.rmem_max).
const SINK_BUFFER: usize = 16 << 20;

/// What the stream sink counted.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
pub struct SinkResult {
    pub total: u64,
    pub received: u64,
    pub lost: u64,
    pub reordered: u64,
    pub dup: u64,
    /// Payload bytes of the data packets received.
    pub bytes: u64,
    /// First to last data packet.
    pub secs: f64,
    /// Payload MB/s (10^6 B/s) and packets/s over `secs`.
    pub mb_per_s: f64,
    pub packets_per_s: f64,
    /// The end marker arrived (else the sink stopped after `idle` without packets).
    pub ended: bool,
}

/// Receives one stream on `sock`: waits up to `first` for its first packet, then until the end
/// marker or `idle` without a packet.
pub fn stream_sink(sock: &UdpSocket, first: Duration, idle: Duration) -> Result<SinkResult, String> {
    // A stream comes faster than one datagram per system call can always keep up with: a
    // deep queue absorbs the bursts (the host's rmem_max bounds it).
    let _ = socket2::SockRef::from(sock).set_recv_buffer_size(SINK_BUFFER);
    let mut buf = vec![0u8; 65536];
    let mut t = SeqTracker::default();
    let (mut bytes, mut start, mut last) = (0u64, None::<Instant>, Instant::now());
    let mut ended = false;
    let begun = Instant::now();
    // The read timeout in force: set when it changes, not once per datagram.
    let mut timeout = None;
    loop {
        let wait = match start {
            None => first.saturating_sub(begun.elapsed()),
            Some(_) => idle,
        };
        if wait.is_zero() {
            break;
        }
        if timeout != Some(wait) {
            sock.set_read_timeout(Some(wait)).map_err(io("cannot set a read timeout"))?;
            timeout = Some(wait);
        }
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if start.is_some() {
                    break;
                }
                continue;
            }
            Err(e) => return Err(format!("sink receive failed: {e}")),
        };
        let (Some(seq), Some(total)) = (get(&buf[..n], 0), get(&buf[..n], 8)) else { continue };
        if seq == SEQ_END {
            if start.is_some() {
                ended = true;
                break;
            }
            continue;
        }
        let now = Instant::now();
        start.get_or_insert(now);
        last = now;
        let before = t.received();
        t.record(seq, total);
        if t.received() > before {
            bytes += n as u64;
        }
    }
    let secs = start.map_or(0.0, |s| (last - s).as_secs_f64());
    let per_s = |v: f64| if secs > 0.0 { v / secs } else { 0.0 };
    Ok(SinkResult {
        total: t.total,
        received: t.received,
        lost: t.lost(),
        reordered: t.reordered,
        dup: t.dup,
        bytes,
        secs,
        mb_per_s: per_s(bytes as f64) / 1e6,
        packets_per_s: per_s(t.received as f64),
        ended,
    })
}

/// Sends `size`-byte datagrams to `peer` until `stop`, `pps` per second (0: as fast as the
/// socket takes them); returns how many were sent. Refused sends are skipped.
pub fn flood(sock: &UdpSocket, peer: SocketAddr, size: usize, pps: u64, stop: &AtomicBool) -> u64 {
    let buf = vec![0xa5u8; size.max(16)];
    let (mut n, mut tried, t0) = (0u64, 0u64, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        if pps > 0 {
            // Paced from the start in batches of 16, sleeping while ahead.
            let due = t0 + Duration::from_secs_f64(tried as f64 / pps as f64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep((due - now).min(Duration::from_millis(10)));
                continue;
            }
        }
        for _ in 0..16 {
            tried += 1;
            if sock.send_to(&buf, peer).is_ok() {
                n += 1;
            }
        }
    }
    n
}

// ---------------------------------------------------------------------------------------------
// `kumo-bench net-tool`

#[derive(clap::Args)]
pub struct ToolArgs {
    #[command(subcommand)]
    tool: Tool,
}

#[derive(clap::Subcommand)]
enum Tool {
    /// Echo UDP on ADDR until stdin closes.
    Echo {
        #[arg(long)]
        bind: SocketAddr,
    },
    /// Receive one stream on ADDR; prints a SinkResult.
    Sink {
        #[arg(long)]
        bind: SocketAddr,
        #[arg(long, default_value_t = 30000)]
        first_ms: u64,
        #[arg(long, default_value_t = 1000)]
        idle_ms: u64,
    },
    /// Send one stream to ADDR; prints a SendResult.
    Send {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        count: u64,
        #[arg(long, default_value_t = 1024)]
        size: usize,
        #[arg(long, default_value_t = 0)]
        gap_us: u64,
    },
    /// Flood ADDR with datagrams until stdin closes; prints {"sent":N,"secs":S}.
    Flood {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1024)]
        size: usize,
        /// Datagrams per second; 0: as fast as possible.
        #[arg(long, default_value_t = 0)]
        pps: u64,
    },
    /// Round trips to an echo at ADDR; prints a Latency.
    Rtt {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        count: u64,
        #[arg(long, default_value_t = 64)]
        size: usize,
        #[arg(long, default_value_t = 200)]
        timeout_ms: u64,
    },
}

fn any_port(peer: SocketAddr) -> SocketAddr {
    match peer {
        SocketAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        SocketAddr::V6(_) => SocketAddr::from(([0u16; 8], 0)),
    }
}

fn print_json<T: Serialize>(v: &T) -> Result<i32, String> {
    println!("{}", serde_json::to_string(v).map_err(|e| e.to_string())?);
    Ok(0)
}

/// Returns once the parent closes stdin or goes away: the echo and the flood stop then.
fn until_stdin_closes() {
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
}

/// Runs one tool (the hidden `net-tool` subcommand).
pub fn run(a: ToolArgs) -> Result<i32, String> {
    use std::io::Write;
    let ready = || {
        println!("ready");
        let _ = std::io::stdout().flush();
    };
    match a.tool {
        Tool::Echo { bind: addr } => {
            let sock = bind(addr)?;
            let stop = AtomicBool::new(false);
            let n = std::thread::scope(|s| {
                let h = s.spawn(|| echo_server(&sock, &stop));
                ready();
                until_stdin_closes();
                stop.store(true, Ordering::Relaxed);
                h.join().map_err(|_| "the echo thread panicked".to_string())
            })??;
            println!("{{\"echoed\":{n}}}");
            Ok(0)
        }
        Tool::Sink { bind: addr, first_ms, idle_ms } => {
            let sock = bind(addr)?;
            ready();
            print_json(&stream_sink(&sock, Duration::from_millis(first_ms), Duration::from_millis(idle_ms))?)
        }
        Tool::Send { to, count, size, gap_us } => {
            let sock = bind(any_port(to))?;
            print_json(&stream_send(&sock, to, count, size, Duration::from_micros(gap_us))?)
        }
        Tool::Flood { to, size, pps } => {
            let sock = bind(any_port(to))?;
            let stop = AtomicBool::new(false);
            let t0 = Instant::now();
            let sent = std::thread::scope(|s| {
                let h = s.spawn(|| flood(&sock, to, size, pps, &stop));
                ready();
                until_stdin_closes();
                stop.store(true, Ordering::Relaxed);
                h.join().map_err(|_| "the flood thread panicked".to_string())
            })?;
            println!("{{\"sent\":{sent},\"secs\":{:.3}}}", t0.elapsed().as_secs_f64());
            Ok(0)
        }
        Tool::Rtt { to, count, size, timeout_ms } => {
            let sock = bind(any_port(to))?;
            let (samples, lost) = rtt_client(&sock, to, count, size, Duration::from_millis(timeout_ms))?;
            let l = Latency::from_samples(&samples, lost).ok_or(format!("no echo from {to} ({lost} requests lost)"))?;
            print_json(&l)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lo() -> UdpSocket {
        bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("loopback socket")
    }

    #[test]
    fn tracker_counts_lost_reordered_dup() {
        let mut t = SeqTracker::default();
        for s in [0, 1, 3, 2, 2, 5, SEQ_END, 99] {
            t.record(s, 6);
        }
        assert_eq!((t.received(), t.lost(), t.reordered, t.dup), (5, 1, 1, 1));
    }

    #[test]
    fn rtt_against_echo_on_loopback() {
        let (server, client) = (lo(), lo());
        let addr = server.local_addr().expect("addr");
        let stop = AtomicBool::new(false);
        let (samples, lost) = std::thread::scope(|s| {
            let echo = s.spawn(|| echo_server(&server, &stop));
            let r = rtt_client(&client, addr, 200, 64, Duration::from_secs(5));
            stop.store(true, Ordering::Relaxed);
            assert_eq!(echo.join().expect("echo thread").expect("echo"), 200 + WARMUP);
            r
        })
        .expect("rtt");
        assert_eq!((samples.len(), lost), (200, 0));
        let l = Latency::from_samples(&samples, lost).expect("latency");
        assert!(l.min_us <= l.p50_us && l.p50_us <= l.p99_us && l.p99_us <= l.max_us);
    }

    #[test]
    fn rtt_without_echo_counts_everything_lost() {
        // A bound socket that never answers.
        let (mute, client) = (lo(), lo());
        let (samples, lost) =
            rtt_client(&client, mute.local_addr().expect("addr"), 3, 16, Duration::from_millis(1)).expect("rtt");
        assert_eq!((samples.len(), lost), (0, 3));
    }

    #[test]
    fn stream_arrives_complete_on_loopback() {
        // 100 small datagrams and the end markers fit in the sink's receive buffer even if its
        // thread never runs before the sender is done: nothing can be dropped.
        let (sink, sender) = (lo(), lo());
        let addr = sink.local_addr().expect("addr");
        let r = std::thread::scope(|s| {
            let h = s.spawn(|| stream_sink(&sink, Duration::from_secs(30), Duration::from_secs(30)));
            let sent = stream_send(&sender, addr, 100, 100, Duration::from_micros(10)).expect("send");
            assert_eq!((sent.sent, sent.failed), (100, 0));
            h.join().expect("sink thread").expect("sink")
        });
        assert!(r.ended);
        assert_eq!((r.total, r.received, r.lost, r.dup, r.reordered, r.bytes), (100, 100, 0, 0, 0, 100 * 100));
        assert!(r.mb_per_s > 0.0 && r.packets_per_s > 0.0);
    }

    #[test]
    fn sink_counts_a_disordered_stream() {
        let (sink, sender) = (lo(), lo());
        let addr = sink.local_addr().expect("addr");
        let mut buf = [0u8; 32];
        put(&mut buf, 8, 5);
        for seq in [1, 0, 0, 4, SEQ_END] {
            put(&mut buf, 0, seq);
            sender.send_to(&buf, addr).expect("send");
        }
        let r = stream_sink(&sink, Duration::from_secs(30), Duration::from_secs(30)).expect("sink");
        assert!(r.ended);
        assert_eq!((r.total, r.received, r.lost, r.dup, r.reordered, r.bytes), (5, 3, 2, 1, 1, 3 * 32));
    }

    #[test]
    fn sink_with_no_stream_reports_nothing() {
        let r = stream_sink(&lo(), Duration::from_millis(1), Duration::from_millis(1)).expect("sink");
        assert_eq!(r, SinkResult::default());
    }

    #[test]
    fn paced_flooder_sends_until_stopped() {
        let (target, f) = (lo(), lo());
        let addr = target.local_addr().expect("addr");
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let h = s.spawn(|| flood(&f, addr, 32, 1000, &stop));
            let mut buf = [0u8; 64];
            assert_eq!(target.recv(&mut buf).expect("a flooded datagram"), 32);
            stop.store(true, Ordering::Relaxed);
            assert!(h.join().expect("flood thread") >= 1);
        });
    }

    #[test]
    fn flooder_sends_until_stopped() {
        let (target, f) = (lo(), lo());
        let addr = target.local_addr().expect("addr");
        let stop = AtomicBool::new(false);
        let n = std::thread::scope(|s| {
            let h = s.spawn(|| flood(&f, addr, 64, 0, &stop));
            let mut buf = [0u8; 128];
            let got = target.recv(&mut buf).expect("a flooded datagram");
            stop.store(true, Ordering::Relaxed);
            assert_eq!(got, 64);
            h.join().expect("flood thread")
        });
        assert!(n >= 1);
    }
}
