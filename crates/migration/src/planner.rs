//! Pre-copy stop rules: when to stop sending dirty pages with the VM running, pause it, and
//! send the rest ("stop-and-copy").
//!
//! Two rules, usable together (stop when either says stop):
//! - [`XenRule`], Xen 3.0.3's: at most 50 dirty pages left, 30 rounds, or 3× the VM's pages
//!   sent (SEEDS §004);
//! - a downtime target: stop when the dirty pages left can be sent within it at the
//!   measured bandwidth.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::format::PAGE_SIZE;

/// Xen's stop rule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct XenRule {
    /// Stop when at most this many pages are dirty after a round.
    pub max_dirty_pages: u64,
    /// Stop so that the migration has at most this many rounds, the final stop-and-copy
    /// round included (Xen: 29 live rounds + the final one).
    pub max_rounds: u32,
    /// Stop when more than this many times the VM's pages have been sent.
    pub max_sent_factor: f64,
}

impl Default for XenRule {
    fn default() -> Self {
        XenRule { max_dirty_pages: 50, max_rounds: 30, max_sent_factor: 3.0 }
    }
}

/// When to stop pre-copy. With both rules set, the first to fire stops.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StopPolicy {
    /// Xen's rule.
    pub xen: Option<XenRule>,
    /// Stop when the estimated stop-and-copy time (page transfer only) is at most this.
    pub downtime: Option<Duration>,
}

impl Default for StopPolicy {
    /// Xen's rule alone.
    fn default() -> Self {
        StopPolicy { xen: Some(XenRule::default()), downtime: None }
    }
}

/// What one pre-copy round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundStats {
    /// Round number, from 0.
    pub round: u32,
    /// Pages sent in the round.
    pub pages_sent: u64,
    /// Bytes sent in the round (what the bandwidth estimate divides by `duration`).
    pub bytes_sent: u64,
    /// How long the round took.
    pub duration: Duration,
    /// Pages dirty at the end of the round: what the next round has to send.
    pub dirty_pages: u64,
}

/// Which rule stopped pre-copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// Xen: few pages left dirty.
    FewDirtyPages,
    /// Xen: the round limit (or, with no Xen rule, [`HARD_MAX_ROUNDS`]).
    MaxRounds,
    /// Xen: too many pages sent in all.
    MaxSent,
    /// The dirty pages left can be sent within the downtime target.
    DowntimeMet {
        /// The estimated stop-and-copy time.
        estimated: Duration,
    },
}

/// What to do after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Run another live round.
    Continue,
    /// Pause the VM and send what is left.
    StopAndCopy(StopReason),
}

/// Weight of the newest round in the bandwidth estimate.
pub const BANDWIDTH_EWMA_ALPHA: f64 = 0.5;

/// Round limit when the policy has no Xen rule: a downtime target alone may never be met (a
/// guest dirtying faster than the link), and a migration must end.
pub const HARD_MAX_ROUNDS: u32 = 1000;

/// Applies a [`StopPolicy`] round by round and measures the bandwidth.
#[derive(Debug, Clone)]
pub struct Planner {
    policy: StopPolicy,
    total_pages: u64,
    rounds: u32,
    pages_sent: u64,
    bytes_sent: u64,
    /// Exponentially decayed bytes and seconds of the measured rounds.
    ewma: Option<(f64, f64)>,
}

impl Planner {
    /// A planner for a VM of `total_pages` pages.
    pub fn new(policy: StopPolicy, total_pages: u64) -> Self {
        Planner { policy, total_pages, rounds: 0, pages_sent: 0, bytes_sent: 0, ewma: None }
    }

    /// Accounts for a finished live round and decides whether to stop. Rounds are counted
    /// by calls, not by `stats.round`.
    ///
    /// When several rules fire, the reason reported is the first of: `FewDirtyPages`,
    /// `DowntimeMet` (converged), then `MaxSent`, `MaxRounds` (gave up).
    pub fn after_round(&mut self, stats: &RoundStats) -> Decision {
        self.rounds = self.rounds.saturating_add(1);
        self.pages_sent = self.pages_sent.saturating_add(stats.pages_sent);
        self.bytes_sent = self.bytes_sent.saturating_add(stats.bytes_sent);
        let secs = stats.duration.as_secs_f64();
        // A zero-length or empty round says nothing about the link.
        if secs > 0.0 && stats.bytes_sent > 0 {
            let (b, s) = (stats.bytes_sent as f64, secs);
            let a = BANDWIDTH_EWMA_ALPHA;
            self.ewma = Some(match self.ewma {
                None => (b, s),
                Some((eb, es)) => (a * b + (1.0 - a) * eb, a * s + (1.0 - a) * es),
            });
        }
        let decision = match self.stop_reason(stats.dirty_pages) {
            Some(r) => Decision::StopAndCopy(r),
            None => Decision::Continue,
        };
        tracing::debug!(
            round = stats.round,
            dirty = stats.dirty_pages,
            sent = self.pages_sent,
            ?decision,
            "pre-copy round"
        );
        decision
    }

    fn stop_reason(&self, dirty: u64) -> Option<StopReason> {
        let xen = self.policy.xen;
        if xen.is_some_and(|x| dirty <= x.max_dirty_pages) {
            return Some(StopReason::FewDirtyPages);
        }
        if let Some(target) = self.policy.downtime {
            if let Some(estimated) = self.estimated_downtime(dirty).filter(|e| *e <= target) {
                return Some(StopReason::DowntimeMet { estimated });
            }
        }
        // The final round counts towards the limit: stop when it would be the last allowed.
        let max_rounds = xen.map_or(HARD_MAX_ROUNDS, |x| x.max_rounds.min(HARD_MAX_ROUNDS));
        if let Some(x) = xen {
            if self.pages_sent as f64 > x.max_sent_factor * self.total_pages as f64 {
                return Some(StopReason::MaxSent);
            }
        }
        if self.rounds.saturating_add(1) >= max_rounds {
            return Some(StopReason::MaxRounds);
        }
        None
    }

    /// Measured bandwidth in bytes/s, once a round with bytes and time has been seen.
    ///
    /// It is a byte-weighted EWMA (α = [`BANDWIDTH_EWMA_ALPHA`]): decayed bytes over decayed
    /// seconds. The last round alone is noisy when it is short (a few pages, dominated by
    /// fixed costs); the whole-migration average is stale (round 0 runs with cold caches
    /// and a different share of the link). Weighting by bytes lets big rounds dominate
    /// while the estimate still follows a change within a couple of rounds.
    pub fn bandwidth(&self) -> Option<f64> {
        self.ewma.map(|(b, s)| b / s)
    }

    /// Estimated time to send `dirty_pages` at the measured bandwidth and the measured bytes
    /// per page (framing included). Covers page transfer only, not pausing, `State` or
    /// resuming. `Some(0)` for no pages; `None` before any measurement.
    pub fn estimated_downtime(&self, dirty_pages: u64) -> Option<Duration> {
        if dirty_pages == 0 {
            return Some(Duration::ZERO);
        }
        let bw = self.bandwidth()?;
        let per_page = if self.pages_sent > 0 && self.bytes_sent > 0 {
            self.bytes_sent as f64 / self.pages_sent as f64
        } else {
            PAGE_SIZE as f64
        };
        Duration::try_from_secs_f64(dirty_pages as f64 * per_page / bw).ok()
    }

    /// Live rounds accounted so far.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// Pages sent in the live rounds so far.
    pub fn pages_sent(&self) -> u64 {
        self.pages_sent
    }

    /// The policy.
    pub fn policy(&self) -> &StopPolicy {
        &self.policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(round: u32, pages: u64, secs: f64, dirty: u64) -> RoundStats {
        RoundStats {
            round,
            pages_sent: pages,
            bytes_sent: pages * PAGE_SIZE as u64,
            duration: Duration::from_secs_f64(secs),
            dirty_pages: dirty,
        }
    }

    /// Runs rounds where each sends the previous round's dirty pages, until a stop.
    fn run(p: &mut Planner, first: u64, dirty: impl Fn(u32) -> u64) -> (u32, StopReason) {
        let mut pages = first;
        for r in 0.. {
            let d = dirty(r);
            if let Decision::StopAndCopy(reason) = p.after_round(&stats(r, pages, pages as f64 / 100_000.0, d)) {
                return (r, reason);
            }
            pages = d;
        }
        unreachable!()
    }

    #[test]
    fn xen_defaults() {
        assert_eq!(XenRule::default(), XenRule { max_dirty_pages: 50, max_rounds: 30, max_sent_factor: 3.0 });
        assert_eq!(StopPolicy::default().downtime, None);
    }

    #[test]
    fn few_dirty_pages_stops_at_50_inclusive() {
        let mut p = Planner::new(StopPolicy::default(), 10_000);
        assert_eq!(p.after_round(&stats(0, 10_000, 0.1, 51)), Decision::Continue);
        assert_eq!(p.after_round(&stats(1, 51, 0.001, 50)), Decision::StopAndCopy(StopReason::FewDirtyPages));
        let mut p = Planner::new(StopPolicy::default(), 10_000);
        assert_eq!(run(&mut p, 10_000, |r| [5000, 800, 120, 40][r as usize]), (3, StopReason::FewDirtyPages));
    }

    #[test]
    fn max_rounds_counts_the_final_round() {
        // A steady 1,000 dirty pages per round in a big VM: only the round limit fires.
        let mut p = Planner::new(StopPolicy::default(), 1_000_000);
        let (last_live, reason) = run(&mut p, 1_000_000, |_| 1000);
        assert_eq!(reason, StopReason::MaxRounds);
        // Live rounds 0..=28, then the stop-and-copy round is the 30th.
        assert_eq!(last_live, 28);
        assert_eq!(p.rounds(), 29);
    }

    #[test]
    fn max_sent_fires_when_strictly_exceeded() {
        // 1,000-page VM that redirties everything: 3,000 pages sent is not yet "more than 3×".
        let mut p = Planner::new(StopPolicy::default(), 1000);
        let (last_live, reason) = run(&mut p, 1000, |_| 1000);
        assert_eq!(reason, StopReason::MaxSent);
        assert_eq!(last_live, 3);
        assert_eq!(p.pages_sent(), 4000);
    }

    #[test]
    fn downtime_rule() {
        let policy = StopPolicy { xen: None, downtime: Some(Duration::from_millis(10)) };
        let mut p = Planner::new(policy, 100_000);
        // 100,000 pages in 1 s: 100,000 pages/s, so 10 ms is 1,000 pages.
        assert_eq!(p.after_round(&stats(0, 100_000, 1.0, 5000)), Decision::Continue);
        assert_eq!(p.bandwidth(), Some(100_000.0 * 4096.0));
        assert_eq!(p.estimated_downtime(5000), Some(Duration::from_millis(50)));
        match p.after_round(&stats(1, 5000, 0.05, 900)) {
            Decision::StopAndCopy(StopReason::DowntimeMet { estimated }) => {
                assert!((estimated.as_secs_f64() - 0.009).abs() < 1e-9)
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn downtime_alone_still_terminates() {
        let policy = StopPolicy { xen: None, downtime: Some(Duration::from_micros(1)) };
        let mut p = Planner::new(policy, 1000);
        assert_eq!(run(&mut p, 1000, |_| 1000), (HARD_MAX_ROUNDS - 2, StopReason::MaxRounds));
    }

    #[test]
    fn both_rules_either_stops() {
        let policy = StopPolicy { xen: Some(XenRule::default()), downtime: Some(Duration::from_millis(10)) };
        // Downtime fires first (900 pages fit in 10 ms, far above 50).
        let mut p = Planner::new(policy, 100_000);
        assert_eq!(p.after_round(&stats(0, 100_000, 1.0, 5000)), Decision::Continue);
        assert!(matches!(
            p.after_round(&stats(1, 5000, 0.05, 900)),
            Decision::StopAndCopy(StopReason::DowntimeMet { .. })
        ));
        // Xen fires first (a slow link: 40 pages take 40 ms, but 40 ≤ 50).
        let mut p = Planner::new(policy, 100_000);
        assert_eq!(p.after_round(&stats(0, 1000, 1.0, 40)), Decision::StopAndCopy(StopReason::FewDirtyPages));
    }

    #[test]
    fn bandwidth_is_a_byte_weighted_ewma() {
        let mut p = Planner::new(StopPolicy::default(), 1 << 20);
        assert_eq!(p.bandwidth(), None);
        assert_eq!(p.estimated_downtime(10), None);
        assert_eq!(p.estimated_downtime(0), Some(Duration::ZERO));
        p.after_round(&stats(0, 100_000, 1.0, 100_000));
        // A zero-time round is not a measurement.
        p.after_round(&stats(1, 10, 0.0, 100_000));
        assert_eq!(p.bandwidth(), Some(100_000.0 * 4096.0));
        // 10,000 pages at half the speed: decayed (50,000+5,000) pages over (0.5+0.1) s.
        p.after_round(&stats(2, 10_000, 0.2, 100_000));
        let expect = 55_000.0 * 4096.0 / 0.6;
        assert!((p.bandwidth().unwrap() - expect).abs() < 1e-6 * expect);
    }
}
