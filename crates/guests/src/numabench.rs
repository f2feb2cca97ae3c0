//! The `numabench` guest's output (guests/src/numabench.c), printed alike by its kumo guest build
//! and its hosted Linux build ([`crate::host_program`]): the result line of one run.

/// `numabench: result threads=T triad_cycles=C sparse_cycles=C total_cycles=C best_triad=C
/// best_sparse=C tsc_khz=K check=X`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Result {
    pub threads: u32,
    /// TSC cycles of the timed triad sweeps, of the sparse passes, and both.
    pub triad_cycles: u64,
    pub sparse_cycles: u64,
    pub total_cycles: u64,
    /// Cycles of the fastest single triad sweep and sparse pass (the least disturbed by other
    /// work on a shared host).
    pub best_triad: u64,
    pub best_sparse: u64,
    /// The TSC frequency the program knew (0: unknown).
    pub tsc_khz: u64,
    /// A checksum of the results (hex): equal for equal arguments, wherever it ran.
    pub check: u64,
}

impl Result {
    /// Milliseconds of `cycles`, if the TSC frequency is known.
    pub fn ms(&self, cycles: u64) -> Option<f64> {
        (self.tsc_khz > 0).then(|| cycles as f64 / self.tsc_khz as f64)
    }
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The result line of a run's output, or None if it is missing or malformed.
pub fn parse(out: &str) -> Option<Result> {
    let line = out.lines().find_map(|l| l.trim().strip_prefix("numabench: result "))?;
    let num = |k: &str| field(line, k)?.parse::<u64>().ok();
    let r = Result {
        threads: field(line, "threads")?.parse().ok()?,
        triad_cycles: num("triad_cycles")?,
        sparse_cycles: num("sparse_cycles")?,
        total_cycles: num("total_cycles")?,
        best_triad: num("best_triad")?,
        best_sparse: num("best_sparse")?,
        tsc_khz: num("tsc_khz")?,
        check: u64::from_str_radix(field(line, "check")?, 16).ok()?,
    };
    (r.triad_cycles + r.sparse_cycles == r.total_cycles && r.total_cycles > 0).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "numabench: threads=2 mb=64 smb=64 iters=10\n\
        numabench: result threads=2 triad_cycles=1200 sparse_cycles=800 total_cycles=2000 best_triad=110 best_sparse=70 \
        tsc_khz=2000000 check=1f\n";

    #[test]
    fn result_line_parses() {
        let r = parse(OUT).unwrap();
        assert_eq!(
            r,
            Result {
                threads: 2,
                triad_cycles: 1200,
                sparse_cycles: 800,
                total_cycles: 2000,
                best_triad: 110,
                best_sparse: 70,
                tsc_khz: 2_000_000,
                check: 0x1f
            }
        );
        assert_eq!(r.ms(2_000_000), Some(1.0));
        assert_eq!(Result { tsc_khz: 0, ..r }.ms(5), None);
        // A serial console may end lines with \r.
        assert_eq!(parse(&OUT.replace('\n', "\r\n")), Some(r));
    }

    #[test]
    fn missing_or_inconsistent_results_are_none() {
        assert_eq!(parse("numabench: threads=2 mb=64 smb=64 iters=10\n"), None);
        assert_eq!(parse(&OUT.replace("total_cycles=2000", "total_cycles=2001")), None, "parts must add up");
        assert_eq!(parse(&OUT.replace("check=1f", "check=zz")), None);
        assert_eq!(parse(&OUT.replace("tsc_khz=2000000 ", "")), None);
        assert_eq!(parse(&OUT.replace("best_sparse=70 ", "")), None);
        assert_eq!(parse(&OUT.replace("=1200", "=0").replace("=800", "=0").replace("=2000 ", "=0 ")), None);
    }
}
