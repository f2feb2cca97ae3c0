//! The network guests' side of the contract with the host: their result lines (netecho,
//! udpping, udpsink, udpsend; see guests/src/net/) parsed, and the payload format of the
//! sequence-numbered UDP streams that udpsend/udpsink and host tools share.

use std::net::Ipv4Addr;

/// `NAME: up nic=N mac=M ip=I`: a NIC is up (DRIVER_OK, RX buffers posted) and answering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    pub program: String,
    pub nic: u32,
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
}

/// `udpping: count=N lost=L p50_us=A p99_us=B min_us=C max_us=D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdpPing {
    pub count: u64,
    pub lost: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub min_us: u64,
    pub max_us: u64,
}

/// `udpsink: received=N lost=L reordered=R dup=D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdpSink {
    pub received: u64,
    pub lost: u64,
    pub reordered: u64,
    pub dup: u64,
}

/// `netecho: echoed=N pings=P arps=A`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NetEcho {
    pub echoed: u64,
    pub pings: u64,
    pub arps: u64,
}

/// `NAME: irqs nic0=N forwarded=F [sink_irqs=S sink_frames=K]`, printed by every network
/// guest before its result line: interrupts taken for NIC 0, how many of them the VMM delivered
/// to another vCPU than NIC 0's consumer (forwarded there by IPI), and the sink NIC's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Irqs {
    pub nic0: u64,
    pub forwarded: u64,
    pub sink_irqs: Option<u64>,
    pub sink_frames: Option<u64>,
}

/// Sequence number of a stream's end marker (sent 3 times after the last datagram).
pub const STREAM_END: u64 = u64::MAX;
/// Bytes of a stream payload's header: sequence number, then total count (both LE u64).
pub const STREAM_HEADER: usize = 16;

/// A stream datagram's payload: seq and total as LE u64, then `size - 16` filler bytes.
/// `size` below 16 still holds the whole header.
pub fn stream_payload(seq: u64, total: u64, size: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(size.max(STREAM_HEADER));
    p.extend_from_slice(&seq.to_le_bytes());
    p.extend_from_slice(&total.to_le_bytes());
    p.extend((STREAM_HEADER..size).map(|i| i as u8));
    p
}

/// `(seq, total)` of a stream payload, or None if it is too short.
pub fn parse_stream_payload(p: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_le_bytes(p.get(0..8)?.try_into().ok()?);
    let total = u64::from_le_bytes(p.get(8..16)?.try_into().ok()?);
    Some((seq, total))
}

/// The value of `key=` on the last line of `output` that starts with `prefix`.
fn field<'a>(output: &'a str, prefix: &str, key: &str) -> Option<&'a str> {
    let line = output.lines().rev().find(|l| l.starts_with(prefix))?;
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn num(output: &str, prefix: &str, key: &str) -> Option<u64> {
    field(output, prefix, key)?.parse().ok()
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Every `NAME: up nic=… mac=… ip=…` line of `output`, in order.
pub fn ready_lines(output: &str) -> Vec<Ready> {
    output
        .lines()
        .filter_map(|l| {
            let (program, rest) = l.split_once(": up ")?;
            let get = |k: &str| rest.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('='));
            Some(Ready {
                program: program.to_string(),
                nic: get("nic")?.parse().ok()?,
                mac: parse_mac(get("mac")?)?,
                ip: get("ip")?.parse().ok()?,
            })
        })
        .collect()
}

/// NIC 0's ready line: `(mac, ip)` once the guest answers on it.
pub fn ready_line(output: &str) -> Option<([u8; 6], Ipv4Addr)> {
    ready_lines(output).into_iter().find(|r| r.nic == 0).map(|r| (r.mac, r.ip))
}

pub fn parse_udpping(output: &str) -> Option<UdpPing> {
    let p = "udpping: count=";
    Some(UdpPing {
        count: num(output, p, "count")?,
        lost: num(output, p, "lost")?,
        p50_us: num(output, p, "p50_us")?,
        p99_us: num(output, p, "p99_us")?,
        min_us: num(output, p, "min_us")?,
        max_us: num(output, p, "max_us")?,
    })
}

pub fn parse_udpsink(output: &str) -> Option<UdpSink> {
    let p = "udpsink: received=";
    Some(UdpSink {
        received: num(output, p, "received")?,
        lost: num(output, p, "lost")?,
        reordered: num(output, p, "reordered")?,
        dup: num(output, p, "dup")?,
    })
}

/// `udpsend: sent=N`.
pub fn parse_udpsend(output: &str) -> Option<u64> {
    num(output, "udpsend: sent=", "sent")
}

pub fn parse_irqs(output: &str) -> Option<Irqs> {
    let line = output.lines().rev().find(|l| l.contains(": irqs nic0="))?;
    let get = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse().ok());
    Some(Irqs {
        nic0: get("nic0")?,
        forwarded: get("forwarded")?,
        sink_irqs: get("sink_irqs"),
        sink_frames: get("sink_frames"),
    })
}

pub fn parse_netecho(output: &str) -> Option<NetEcho> {
    let p = "netecho: echoed=";
    Some(NetEcho { echoed: num(output, p, "echoed")?, pings: num(output, p, "pings")?, arps: num(output, p, "arps")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOT: &str = "kumo-pvh: memory_mib=128 free=40f000..7fe0000 tsc_khz=2446940 (PIT calibration)\n";

    #[test]
    fn ready_lines_give_nic_mac_and_ip() {
        let out = format!(
            "{BOOT}netecho: up nic=0 mac=52:54:00:12:34:56 ip=10.0.0.2\nnetecho: up nic=1 mac=52:54:00:ab:cd:ef ip=10.0.2.2\n"
        );
        assert_eq!(ready_line(&out), Some(([0x52, 0x54, 0, 0x12, 0x34, 0x56], Ipv4Addr::new(10, 0, 0, 2))));
        let all = ready_lines(&out);
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].nic, 1);
        assert_eq!(all[1].program, "netecho");
        assert_eq!(all[1].ip, Ipv4Addr::new(10, 0, 2, 2));
        assert_eq!(ready_line(BOOT), None);
        assert_eq!(ready_line("x: up nic=0 mac=52:54:00:12:34 ip=10.0.0.2"), None);
        assert_eq!(ready_line("x: up nic=0 mac=52:54:00:12:34:5g ip=10.0.0.2"), None);
        assert_eq!(ready_line("x: up nic=0 mac=52:54:00:12:34:56 ip=10.0.0"), None);
        // Only NIC 1 up: no NIC 0 line.
        assert_eq!(ready_line("x: up nic=1 mac=52:54:00:12:34:56 ip=10.0.0.2"), None);
    }

    #[test]
    fn udpping_line() {
        let out = format!(
            "{BOOT}udpping: up nic=0 mac=52:54:00:12:34:56 ip=10.0.0.2\nudpping: count=1000 lost=2 p50_us=173 p99_us=222 min_us=82 max_us=262\n"
        );
        let p = parse_udpping(&out).unwrap();
        assert_eq!(p, UdpPing { count: 1000, lost: 2, p50_us: 173, p99_us: 222, min_us: 82, max_us: 262 });
        assert_eq!(parse_udpping(BOOT), None);
        assert_eq!(parse_udpping("udpping: count=10 lost=x p50_us=1 p99_us=1 min_us=1 max_us=1"), None);
        // The ready line starts with "udpping:" too but is not the result.
        assert_eq!(parse_udpping("udpping: up nic=0 mac=52:54:00:12:34:56 ip=10.0.0.2"), None);
    }

    #[test]
    fn udpsink_udpsend_and_netecho_lines() {
        assert_eq!(
            parse_udpsink("udpsink: received=4950 lost=50 reordered=3 dup=1\n"),
            Some(UdpSink { received: 4950, lost: 50, reordered: 3, dup: 1 })
        );
        assert_eq!(parse_udpsink("udpsink: received=1 lost=0"), None);
        assert_eq!(
            parse_udpsend("udpsend: up nic=0 mac=52:54:00:12:34:56 ip=10.0.0.2\nudpsend: sent=5000\n"),
            Some(5000)
        );
        assert_eq!(parse_udpsend("udpsend: sent="), None);
        assert_eq!(
            parse_netecho("netecho: echoed=3 pings=10 arps=2\n"),
            Some(NetEcho { echoed: 3, pings: 10, arps: 2 })
        );
    }

    #[test]
    fn irqs_line() {
        let out =
            "netecho: irqs nic0=911 forwarded=3 sink_irqs=6846 sink_frames=252827\nnetecho: echoed=1 pings=0 arps=1\n";
        assert_eq!(
            parse_irqs(out),
            Some(Irqs { nic0: 911, forwarded: 3, sink_irqs: Some(6846), sink_frames: Some(252827) })
        );
        assert_eq!(
            parse_irqs("udpping: irqs nic0=984 forwarded=0\n"),
            Some(Irqs { nic0: 984, forwarded: 0, sink_irqs: None, sink_frames: None })
        );
        assert_eq!(parse_irqs("udpping: irqs nic0=x forwarded=0"), None);
        assert_eq!(parse_irqs(BOOT), None);
    }

    #[test]
    fn stream_payload_round_trips() {
        let p = stream_payload(7, 1000, 64);
        assert_eq!(p.len(), 64);
        assert_eq!(parse_stream_payload(&p), Some((7, 1000)));
        assert_eq!(&p[..8], &7u64.to_le_bytes());
        assert_eq!(parse_stream_payload(&stream_payload(STREAM_END, 5, 0)), Some((STREAM_END, 5)));
        assert_eq!(stream_payload(1, 1, 3).len(), STREAM_HEADER);
        assert_eq!(parse_stream_payload(&[0u8; 15]), None);
    }
}
