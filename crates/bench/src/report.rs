//! What several benches print the same way: progress lines, optional figures, ratios.

use std::time::Instant;

/// A progress line on stderr, stamped with the seconds since `t0`.
pub fn step(t0: Instant, msg: &str) {
    eprintln!("[{:>5.1} s] {msg}", t0.elapsed().as_secs_f64());
}

/// A figure with `prec` decimals, or `n/a` when it was not measured.
pub fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.prec$}"))
}

/// `a / b`, when both were measured and `b` is positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? / b.filter(|b| *b > 0.0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_and_missing_figures() {
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(2.0)), None);
        assert_eq!(opt(Some(1.234), 2), "1.23");
        assert_eq!(opt(None, 2), "n/a");
    }
}
