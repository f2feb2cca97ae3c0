//! Percentiles and medians for `kumo bench net`: one place for the host tools, the parsers of
//! the guests' output and the report.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0..=100) of `v` by nearest rank; None for an empty slice.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some(percentile_sorted(&s, p))
}

/// Nearest-rank percentile of an already sorted, non-empty slice.
fn percentile_sorted(s: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0 * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// The median of `v` (the mean of the middle two for an even count); None when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 })
}

/// Latency summary of one run, in microseconds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub lost: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Latency {
    /// Summarises round-trip samples (µs); `lost` requests got no answer. None without samples.
    pub fn from_samples(samples: &[f64], lost: u64) -> Option<Latency> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        Some(Latency {
            count: s.len() as u64 + lost,
            lost,
            p50_us: percentile_sorted(&s, 50.0),
            p99_us: percentile_sorted(&s, 99.0),
            min_us: s[0],
            max_us: s[s.len() - 1],
        })
    }
}

/// Several runs of one measurement: the median of each run's p50 and p99, and the runs.
#[derive(Serialize, Clone, Debug, Default)]
pub struct Runs {
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub runs: Vec<Latency>,
    /// Runs that failed, with why.
    pub errors: Vec<String>,
}

impl Runs {
    pub fn push(&mut self, r: Result<Latency, String>) {
        match r {
            Ok(l) => self.runs.push(l),
            Err(e) => self.errors.push(e),
        }
        self.p50_us = median(&self.runs.iter().map(|l| l.p50_us).collect::<Vec<_>>());
        self.p99_us = median(&self.runs.iter().map(|l| l.p99_us).collect::<Vec<_>>());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn medians_odd_even_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn latency_summary_and_runs() {
        let l = Latency::from_samples(&[10.0, 30.0, 20.0], 2).expect("samples");
        assert_eq!(l, Latency { count: 5, lost: 2, p50_us: 20.0, p99_us: 30.0, min_us: 10.0, max_us: 30.0 });
        assert_eq!(Latency::from_samples(&[], 3), None);
        let mut r = Runs::default();
        r.push(Ok(l));
        r.push(Err("boom".into()));
        r.push(Ok(Latency { p50_us: 40.0, p99_us: 50.0, ..l }));
        assert_eq!((r.p50_us, r.p99_us), (Some(30.0), Some(40.0)));
        assert_eq!(r.errors, vec!["boom".to_string()]);
    }
}
