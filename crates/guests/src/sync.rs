//! The `sync` guest's output (guests/src/sync.c) parsed: round-robin semaphore hand-offs between
//! vCPUs and the synchronisation-heavy work phase (seed 003).

/// What one run of `sync` printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncResult {
    /// vCPUs taking part.
    pub n: u32,
    /// `spin`, `hlt` or `poll`.
    pub wait: String,
    /// `xapic` or `x2apic`.
    pub apic: String,
    /// An exit to the VMM and back (a port read from ring 3), median.
    pub exit_rtt_ns: u64,
    /// Pass → the next holder sees it; `None` with one vCPU.
    pub handoff: Option<Percentiles>,
    /// vCPU 0's pass → its next turn (a round trip over every vCPU); `None` with one vCPU.
    pub rtt: Option<Percentiles>,
    pub txns: u64,
    /// The whole work phase.
    pub work_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p99: u64,
    /// 0 where the guest does not print one.
    pub mean: u64,
}

fn fields<'a>(out: &'a str, prefix: &str) -> Option<impl Iterator<Item = (&'a str, &'a str)>> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    Some(line.split_whitespace().filter_map(|w| w.split_once('=')))
}

fn num(out: &str, prefix: &str, key: &str) -> Option<u64> {
    fields(out, prefix)?.find(|(k, _)| *k == key)?.1.parse().ok()
}

fn text(out: &str, prefix: &str, key: &str) -> Option<String> {
    Some(fields(out, prefix)?.find(|(k, _)| *k == key)?.1.to_string())
}

fn percentiles(out: &str, prefix: &str) -> Option<Percentiles> {
    let _ = fields(out, prefix)?;
    Some(Percentiles {
        count: num(out, prefix, "count")?,
        p50: num(out, prefix, "p50")?,
        p99: num(out, prefix, "p99")?,
        mean: num(out, prefix, "mean").unwrap_or(0),
    })
}

/// The result, or None if a line is missing or malformed (the guest failed).
pub fn parse(out: &str) -> Option<SyncResult> {
    Some(SyncResult {
        n: num(out, "sync: n=", "n")?.try_into().ok()?,
        wait: text(out, "sync: n=", "wait")?,
        apic: text(out, "sync: n=", "apic")?,
        exit_rtt_ns: num(out, "sync: exit_rtt_ns", "p50")?,
        handoff: percentiles(out, "sync: handoff_ns"),
        rtt: percentiles(out, "sync: rtt_ns"),
        txns: num(out, "sync: work", "txns")?,
        work_ns: num(out, "sync: work", "total_ns")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "sync: n=2 wait=hlt apic=xapic tsc_khz=2445406\n\
        sync: exit_rtt_ns p50=25437\n\
        sync: handoff_ns count=1999 p50=81302 p99=3224295 mean=188856\n\
        sync: rtt_ns count=999 p50=239318 p99=3916213\n\
        sync: work txns=2000 cs=2 par=20 total_ns=305208897 per_txn_ns=152604\n";

    #[test]
    fn parses_a_two_vcpu_run() {
        let r = parse(TWO).unwrap();
        assert_eq!((r.n, r.wait.as_str(), r.apic.as_str()), (2, "hlt", "xapic"));
        assert_eq!(r.exit_rtt_ns, 25437);
        assert_eq!(r.handoff, Some(Percentiles { count: 1999, p50: 81302, p99: 3224295, mean: 188856 }));
        assert_eq!(r.rtt, Some(Percentiles { count: 999, p50: 239318, p99: 3916213, mean: 0 }));
        assert_eq!((r.txns, r.work_ns), (2000, 305208897));
    }

    #[test]
    fn one_vcpu_has_no_handoffs_and_a_broken_run_is_none() {
        let one = "sync: n=1 wait=spin apic=x2apic tsc_khz=1\nsync: exit_rtt_ns p50=9\n\
                   sync: work txns=10 cs=2 par=20 total_ns=500 per_txn_ns=50\n";
        let r = parse(one).unwrap();
        assert_eq!((r.n, r.handoff, r.rtt, r.work_ns), (1, None, None, 500));
        assert_eq!(parse("sync: x2apic is not offered (CPUID.1:ECX.x2APIC is clear)\n"), None);
        assert_eq!(parse(&TWO.replace("total_ns=305208897", "total_ns=x")), None);
    }
}
