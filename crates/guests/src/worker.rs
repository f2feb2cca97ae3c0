//! The `worker` guest's output (guests/src/worker.c): the workload of elastic sharing. One
//! [`Line`] per line it prints; anything else (other guests' or kumo's lines, a malformed or
//! torn line) parses as `None`.

/// A line of `worker`'s output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    /// `worker: start vcpus=N elastic=0|1 allowed=0xHEX blocks=B plugged=P block_kb=K tag=T`.
    Start { vcpus: u32, elastic: bool, allowed: u64, blocks: u32, plugged: u32, block_kb: u64, tag: u64 },
    /// `worker: vcpu=V units=U`: vCPU V has done U work units.
    Progress { vcpu: u32, units: u64 },
    /// `worker: vacated cpus=0xHEX seq=S`: request S (vacate those vCPUs) acknowledged.
    Vacated { cpus: u64, seq: u32 },
    /// `worker: started cpus=0xHEX seq=S`: every vCPU given by request S has done a unit.
    Started { cpus: u64, seq: u32 },
    /// `worker: released node=N blocks=K seq=S`: K blocks of node N given up.
    Released { node: u32, blocks: u32, seq: u32 },
    /// `worker: given blocks=K seq=S`: K blocks taken into use.
    Given { blocks: u32, seq: u32 },
    /// `worker: refused seq=S`: a memory release it could not do.
    Refused { seq: u32 },
    /// `worker: cancelled seq=S`.
    Cancelled { seq: u32 },
    /// `worker: nonzero block=B chunk=C`: a chunk of a freshly plugged block did not read zeros.
    /// Blocks from 1024 on are vCPU (B - 1024)'s private buffer.
    Nonzero { block: u32, chunk: u32 },
    /// `worker: corrupt block=B chunk=C`: a chunk did not hold what was last written there.
    Corrupt { block: u32, chunk: u32 },
    /// `worker: done units=U nonzero=Z corrupt=X` (run with `units=N`): all units over all vCPUs.
    Done { units: u64, nonzero: u64, corrupt: u64 },
}

/// The `key=value` fields of a line after its kind, exactly `keys` in that order.
fn fields<'a, const N: usize>(rest: &'a str, keys: [&str; N]) -> Option<[&'a str; N]> {
    let mut words = rest.split_whitespace();
    let mut out = [""; N];
    for (slot, key) in out.iter_mut().zip(keys) {
        *slot = words.next()?.strip_prefix(key)?.strip_prefix('=')?;
    }
    words.next().is_none().then_some(out)
}

fn dec<T: std::str::FromStr>(s: &str) -> Option<T> {
    // `parse` accepts a leading '+'; the guest never prints one.
    s.bytes().all(|b| b.is_ascii_digit()).then(|| s.parse().ok())?
}

fn hex(s: &str) -> Option<u64> {
    let h = s.strip_prefix("0x")?;
    (!h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit())).then(|| u64::from_str_radix(h, 16).ok())?
}

/// One line of output, or None if it is not a well-formed `worker` line.
pub fn parse_line(line: &str) -> Option<Line> {
    let rest = line.trim().strip_prefix("worker: ")?;
    if rest.starts_with("vcpu=") {
        // `worker: vcpu=V units=U` has no kind word.
        let [v, u] = fields(rest, ["vcpu", "units"])?;
        return Some(Line::Progress { vcpu: dec(v)?, units: dec(u)? });
    }
    let (kind, rest) = rest.split_once(' ')?;
    Some(match kind {
        "start" => {
            let [v, e, a, b, p, k, t] =
                fields(rest, ["vcpus", "elastic", "allowed", "blocks", "plugged", "block_kb", "tag"])?;
            let elastic = match e {
                "0" => false,
                "1" => true,
                _ => return None,
            };
            Line::Start {
                vcpus: dec(v)?,
                elastic,
                allowed: hex(a)?,
                blocks: dec(b)?,
                plugged: dec(p)?,
                block_kb: dec(k)?,
                tag: dec(t)?,
            }
        }
        "vacated" | "started" => {
            let [c, s] = fields(rest, ["cpus", "seq"])?;
            let (cpus, seq) = (hex(c)?, dec(s)?);
            if kind == "vacated" {
                Line::Vacated { cpus, seq }
            } else {
                Line::Started { cpus, seq }
            }
        }
        "released" => {
            let [n, b, s] = fields(rest, ["node", "blocks", "seq"])?;
            Line::Released { node: dec(n)?, blocks: dec(b)?, seq: dec(s)? }
        }
        "given" => {
            let [b, s] = fields(rest, ["blocks", "seq"])?;
            Line::Given { blocks: dec(b)?, seq: dec(s)? }
        }
        "refused" => Line::Refused { seq: dec(fields(rest, ["seq"])?[0])? },
        "cancelled" => Line::Cancelled { seq: dec(fields(rest, ["seq"])?[0])? },
        "nonzero" | "corrupt" => {
            let [b, c] = fields(rest, ["block", "chunk"])?;
            let (block, chunk) = (dec(b)?, dec(c)?);
            if kind == "nonzero" {
                Line::Nonzero { block, chunk }
            } else {
                Line::Corrupt { block, chunk }
            }
        }
        "done" => {
            let [u, z, x] = fields(rest, ["units", "nonzero", "corrupt"])?;
            Line::Done { units: dec(u)?, nonzero: dec(z)?, corrupt: dec(x)? }
        }
        _ => return None,
    })
}

/// Every `worker` line of an output, in order (other lines are skipped).
pub fn parse(out: &str) -> Vec<Line> {
    out.lines().filter_map(parse_line).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_lines_parse() {
        let cases = [
            (
                "worker: start vcpus=3 elastic=1 allowed=0x3 blocks=64 plugged=32 block_kb=2048 tag=7",
                Line::Start { vcpus: 3, elastic: true, allowed: 3, blocks: 64, plugged: 32, block_kb: 2048, tag: 7 },
            ),
            (
                "worker: start vcpus=2 elastic=0 allowed=0xff blocks=0 plugged=0 block_kb=0 tag=1",
                Line::Start { vcpus: 2, elastic: false, allowed: 0xff, blocks: 0, plugged: 0, block_kb: 0, tag: 1 },
            ),
            ("worker: vcpu=1 units=20000", Line::Progress { vcpu: 1, units: 20000 }),
            ("worker: vacated cpus=0x4 seq=9", Line::Vacated { cpus: 4, seq: 9 }),
            ("worker: started cpus=0xa seq=10", Line::Started { cpus: 10, seq: 10 }),
            ("worker: released node=1 blocks=64 seq=11", Line::Released { node: 1, blocks: 64, seq: 11 }),
            ("worker: given blocks=64 seq=12", Line::Given { blocks: 64, seq: 12 }),
            ("worker: refused seq=13", Line::Refused { seq: 13 }),
            ("worker: cancelled seq=14", Line::Cancelled { seq: 14 }),
            ("worker: nonzero block=5 chunk=31", Line::Nonzero { block: 5, chunk: 31 }),
            ("worker: corrupt block=1025 chunk=0", Line::Corrupt { block: 1025, chunk: 0 }),
            ("worker: done units=4000 nonzero=0 corrupt=0", Line::Done { units: 4000, nonzero: 0, corrupt: 0 }),
        ];
        for (text, want) in cases {
            assert_eq!(parse_line(text), Some(want), "{text}");
            // A serial console may end lines with \r.
            assert_eq!(parse_line(&format!("{text}\r")), Some(want), "{text}");
        }
    }

    #[test]
    fn malformed_lines_are_none() {
        for bad in [
            "",
            "worker:",
            "worker: ",
            "hello: vcpu=1 units=5",
            "worker: vcpu=1",
            "worker: vcpu=1 units=",
            "worker: vcpu=x units=5",
            "worker: vcpu=1 units=5 extra=1",
            "worker: units=5 vcpu=1",
            "worker: vcpu=-1 units=5",
            "worker: vcpu=+1 units=5",
            "worker: start vcpus=2 elastic=2 allowed=0x3 blocks=0 plugged=0 block_kb=0 tag=1",
            "worker: start vcpus=2 elastic=0 allowed=3 blocks=0 plugged=0 block_kb=0 tag=1",
            "worker: start vcpus=2 elastic=0 allowed=0x blocks=0 plugged=0 block_kb=0 tag=1",
            "worker: start vcpus=2 elastic=0 allowed=0x3 blocks=0 plugged=0 block_kb=0",
            "worker: vacated cpus=0xg seq=1",
            "worker: vacated cpus=0x1 seq=4294967296",
            "worker: started cpus=0x1",
            "worker: released node=1 blocks=2",
            "worker: given blocks=2 seq=1 node=0",
            "worker: refused",
            "worker: refused seq=",
            "worker: cancelled seq=1 seq=2",
            "worker: nonzero block=1",
            "worker: corrupt chunk=1 block=2",
            "worker: done units=10 nonzero=0",
            "worker: bogus seq=1",
            "worker: vcpu=1 units=5worker: vcpu=2 units=5",
        ] {
            assert_eq!(parse_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_output_parses_to_its_worker_lines() {
        let out = "kumo: booting\n\
            worker: start vcpus=2 elastic=0 allowed=0x3 blocks=0 plugged=0 block_kb=0 tag=1\r\n\
            worker: vcpu=0 units=500\n\
            worker: vcpu=1 units=500\n\
            garbage\n\
            worker: done units=4000 nonzero=0 corrupt=0\n";
        let lines = parse(out);
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[1], Line::Progress { vcpu: 0, units: 500 });
        assert_eq!(lines[3], Line::Done { units: 4000, nonzero: 0, corrupt: 0 });
    }
}
