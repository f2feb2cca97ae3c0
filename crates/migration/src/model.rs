//! The dirty-page model of the RDMA-migration paper (SEEDS §004, §6.3).
//!
//! A workload that updates `M` pages at random dirties `D(t) = M − M·(1/2)^(t/τ)` distinct
//! pages in `t` seconds: after τ seconds half of its pages are dirty, after 2τ three
//! quarters, and so on. While a migration takes a fraction β of the CPU from the guest, the
//! guest gets only `t·(1 − β)` seconds of work done in `t`. With the fitted `(M, τ)` the
//! paper predicts each pre-copy round (the guest dirties, during a round, what the next
//! round sends) and compares the prediction with measurements; [`fit`](DirtyModel::fit),
//! [`predict`] and [`compare`] do the same here.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::format::PAGE_SIZE;
use crate::planner::{Decision, Planner, RoundStats, StopPolicy, StopReason};

/// Errors fitting the model or predicting with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// Fewer distinct positive durations than the two parameters need.
    #[error("too few observations: {distinct} distinct positive durations, need at least {needed}")]
    TooFewObservations {
        /// Distinct durations > 0 in the input.
        distinct: usize,
        /// How many the fit needs.
        needed: usize,
    },
    /// An observation with a negative or non-finite value.
    #[error("observation {index} ({t} s, {pages} pages) is negative or not finite")]
    InvalidObservation {
        /// Its index.
        index: usize,
        /// Its duration.
        t: f64,
        /// Its page count.
        pages: f64,
    },
    /// The observations cannot determine the model.
    #[error("degenerate observations: {0}")]
    Degenerate(&'static str),
    /// Prediction parameters out of range.
    #[error("invalid prediction parameters: {0}")]
    InvalidParams(&'static str),
}

/// `D(t) = M − M·(1/2)^(t/τ)`: distinct pages dirtied in `t` seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DirtyModel {
    /// Pages the workload updates (the limit of `D`).
    pub m: f64,
    /// Seconds for half of them to be dirtied.
    pub tau: f64,
}

/// `g(t) = 1 − 2^(−t/τ)`, via `expm1` so short intervals keep their precision.
fn g(t: f64, tau: f64) -> f64 {
    -(-(t / tau) * std::f64::consts::LN_2).exp_m1()
}

/// For fixed τ, the least-squares `M` within `0..=max_m` and the sum of squared residuals.
/// The residual is a convex quadratic in `M`, so clamping the free optimum is the bounded one.
fn best_m(obs: &[(f64, f64)], tau: f64, max_m: f64) -> (f64, f64) {
    let (sy, sg) = obs.iter().fold((0.0, 0.0), |(sy, sg), &(t, y)| {
        let gi = g(t, tau);
        (sy + y * gi, sg + gi * gi)
    });
    let m = if sg > 0.0 { (sy / sg).clamp(0.0, max_m) } else { 0.0 };
    let sse = obs.iter().map(|&(t, y)| (y - m * g(t, tau)).powi(2)).sum();
    (m, sse)
}

impl DirtyModel {
    /// Distinct pages dirtied in `t` seconds (0 for `t ≤ 0`).
    pub fn dirtied(&self, t: f64) -> f64 {
        if t > 0.0 {
            self.m * g(t, self.tau)
        } else {
            0.0
        }
    }

    /// Least-squares fit to `(seconds, distinct pages dirtied in that interval)`, with no
    /// bound on `M`: [`fit_bounded`](DirtyModel::fit_bounded) with `max_m = ∞`.
    pub fn fit(obs: &[(f64, f64)]) -> Result<DirtyModel, ModelError> {
        Self::fit_bounded(obs, f64::INFINITY)
    }

    /// Least-squares fit to `(seconds, distinct pages dirtied in that interval)` with
    /// `0 ≤ M ≤ max_m` (a VM cannot dirty more pages than it has: pass its page count).
    ///
    /// For a fixed τ the best `M` is closed-form (`M = Σ y·g / Σ g²`, `g = 1 − 2^(−t/τ)`,
    /// clamped to the bound), so only τ is searched: a log grid from 1/1000 of the shortest
    /// interval to 1000× the longest, then golden-section refinement around the best grid
    /// point. Data that never saturates (a steady rate) fits best with `M` at its bound and
    /// `M·ln2/τ` the rate. If the best τ is still the top of the range (no bound, or a rate so
    /// low that even the bound does not saturate it), the data cannot determine the model: that
    /// is an error, never a huge `M` or τ.
    pub fn fit_bounded(obs: &[(f64, f64)], max_m: f64) -> Result<DirtyModel, ModelError> {
        if max_m.is_nan() || max_m <= 0.0 {
            return Err(ModelError::InvalidParams("the bound on M must be positive"));
        }
        for (index, &(t, pages)) in obs.iter().enumerate() {
            if !(t.is_finite() && pages.is_finite() && t >= 0.0 && pages >= 0.0) {
                return Err(ModelError::InvalidObservation { index, t, pages });
            }
        }
        let mut ts: Vec<f64> = obs.iter().map(|o| o.0).filter(|&t| t > 0.0).collect();
        ts.sort_by(f64::total_cmp);
        ts.dedup();
        if ts.len() < 2 {
            return Err(ModelError::TooFewObservations { distinct: ts.len(), needed: 2 });
        }
        if obs.iter().all(|o| o.1 == 0.0) {
            return Err(ModelError::Degenerate("no pages dirtied"));
        }
        let (lo, hi) = (ts[0] / 1000.0, ts[ts.len() - 1] * 1000.0);
        const N: usize = 241;
        let step = (hi / lo).ln() / (N - 1) as f64;
        let grid: Vec<f64> = (0..N).map(|i| lo.ln() + step * i as f64).collect();
        let sse = |ln_tau: f64| best_m(obs, ln_tau.exp(), max_m).1;
        let best = (0..N).min_by(|&a, &b| sse(grid[a]).total_cmp(&sse(grid[b]))).unwrap_or(0);
        // Golden section in ln τ between the grid neighbours of the best point.
        let (mut a, mut b) = (grid[best.saturating_sub(1)], grid[(best + 1).min(N - 1)]);
        let r = (5f64.sqrt() - 1.0) / 2.0;
        let (mut c, mut d) = (b - r * (b - a), a + r * (b - a));
        let (mut fc, mut fd) = (sse(c), sse(d));
        for _ in 0..100 {
            if (b - a).abs() < 1e-12 {
                break;
            }
            if fc < fd {
                (b, d, fd) = (d, c, fc);
                c = b - r * (b - a);
                fc = sse(c);
            } else {
                (a, c, fc) = (c, d, fd);
                d = a + r * (b - a);
                fd = sse(d);
            }
        }
        if best == N - 1 {
            return Err(ModelError::Degenerate(
                "the pages dirtied never level off within the bound on M: M and τ are undetermined",
            ));
        }
        let tau = ((a + b) / 2.0).exp();
        let (m, _) = best_m(obs, tau, max_m);
        if !(m.is_finite() && m > 0.0 && tau.is_finite() && tau > 0.0) {
            return Err(ModelError::Degenerate("no finite positive M and τ fit"));
        }
        Ok(DirtyModel { m, tau })
    }

    /// Root-mean-square residual of the model over `obs`, in pages.
    pub fn rms_error(&self, obs: &[(f64, f64)]) -> f64 {
        if obs.is_empty() {
            return 0.0;
        }
        let sse: f64 = obs.iter().map(|&(t, y)| (y - self.dirtied(t)).powi(2)).sum();
        (sse / obs.len() as f64).sqrt()
    }
}

/// Inputs of a [`predict`]ion besides the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PredictParams {
    /// Pages of the VM.
    pub total_pages: u64,
    /// Pages round 0 sends (all of memory, or just the touched pages).
    pub round0_pages: u64,
    /// Transfer rate.
    pub bandwidth_pages_per_s: f64,
    /// Fraction of the CPU the migration takes from the guest (0 ≤ β ≤ 1).
    pub beta: f64,
    /// When to stop pre-copy.
    pub policy: StopPolicy,
}

/// One predicted round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RoundPrediction {
    /// Round number; the last one is the stop-and-copy round.
    pub round: u32,
    /// Pages it sends.
    pub pages: u64,
    /// Seconds it takes.
    pub secs: f64,
}

/// A predicted migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Every round, the final stop-and-copy round last.
    pub rounds: Vec<RoundPrediction>,
    /// Pages sent in all rounds.
    pub total_pages: u64,
    /// Seconds of all rounds.
    pub total_secs: f64,
    /// Seconds of the final round, with the VM paused.
    pub downtime_secs: f64,
    /// The rule that ended pre-copy.
    pub stop: StopReason,
}

impl Prediction {
    /// Pages sent again after round 0 (the paper's "re-sent pages").
    pub fn resent_pages(&self) -> u64 {
        self.total_pages - self.rounds.first().map_or(0, |r| r.pages)
    }
}

fn secs_to_duration(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// Predicts a pre-copy migration: round 0 sends `round0_pages`; a round of `t` seconds lets
/// the guest dirty `model.dirtied(t·(1 − β))` pages (at most `M`, and at most the VM's pages),
/// which the next round sends at the given bandwidth; the same [`Planner`] rules as a real
/// migration decide when to stop; the final round sends what is left with the VM paused.
pub fn predict(model: &DirtyModel, params: &PredictParams) -> Result<Prediction, ModelError> {
    let bw = params.bandwidth_pages_per_s;
    if !(bw.is_finite() && bw > 0.0) {
        return Err(ModelError::InvalidParams("bandwidth must be positive and finite"));
    }
    if !(0.0..=1.0).contains(&params.beta) {
        return Err(ModelError::InvalidParams("beta must be within 0..=1"));
    }
    if !(model.m.is_finite() && model.m >= 0.0 && model.tau.is_finite() && model.tau > 0.0) {
        return Err(ModelError::InvalidParams("the model needs M ≥ 0 and τ > 0, both finite"));
    }
    let mut planner = Planner::new(params.policy, params.total_pages);
    let mut rounds = Vec::new();
    let mut pages = params.round0_pages;
    let stop = loop {
        let round = rounds.len() as u32;
        let secs = pages as f64 / bw;
        let dirty = model.dirtied(secs * (1.0 - params.beta)).min(params.total_pages as f64).round() as u64;
        rounds.push(RoundPrediction { round, pages, secs });
        let stats = RoundStats {
            round,
            pages_sent: pages,
            bytes_sent: pages.saturating_mul(PAGE_SIZE as u64),
            duration: secs_to_duration(secs),
            dirty_pages: dirty,
        };
        pages = dirty;
        if let Decision::StopAndCopy(reason) = planner.after_round(&stats) {
            break reason;
        }
    };
    let downtime_secs = pages as f64 / bw;
    rounds.push(RoundPrediction { round: rounds.len() as u32, pages, secs: downtime_secs });
    Ok(Prediction {
        total_pages: rounds.iter().map(|r| r.pages).sum(),
        total_secs: rounds.iter().map(|r| r.secs).sum(),
        downtime_secs,
        rounds,
        stop,
    })
}

/// One round of a [`Comparison`]; `None` where one side has no such round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RoundComparison {
    /// Round number.
    pub round: u32,
    /// Predicted pages.
    pub predicted_pages: Option<u64>,
    /// Measured pages.
    pub measured_pages: Option<u64>,
    /// `(predicted − measured) / measured` pages.
    pub pages_rel_err: Option<f64>,
    /// Predicted seconds.
    pub predicted_secs: Option<f64>,
    /// Measured seconds.
    pub measured_secs: Option<f64>,
    /// `(predicted − measured) / measured` seconds.
    pub secs_rel_err: Option<f64>,
}

/// A prediction against a measured migration. Relative errors are
/// `(predicted − measured) / measured`: positive means the model over-predicts; `None` when
/// the measured value is 0 and the prediction is not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Round by round, as many as the longer side has.
    pub rounds: Vec<RoundComparison>,
    /// Rounds predicted (final round included).
    pub predicted_rounds: usize,
    /// Rounds measured.
    pub measured_rounds: usize,
    /// Total pages.
    pub total_pages_rel_err: Option<f64>,
    /// Total seconds.
    pub total_secs_rel_err: Option<f64>,
    /// Downtime: the last round of each side.
    pub downtime_rel_err: Option<f64>,
}

fn rel_err(predicted: f64, measured: f64) -> Option<f64> {
    if measured != 0.0 {
        Some((predicted - measured) / measured)
    } else if predicted == 0.0 {
        Some(0.0)
    } else {
        None
    }
}

/// Compares a prediction with measured rounds (final stop-and-copy round last), matching
/// rounds by position.
pub fn compare(predicted: &Prediction, measured: &[RoundStats]) -> Comparison {
    let n = predicted.rounds.len().max(measured.len());
    let rounds = (0..n)
        .map(|i| {
            let p = predicted.rounds.get(i);
            let m = measured.get(i);
            let both = |f: fn(f64, f64) -> Option<f64>, pv: Option<f64>, mv: Option<f64>| {
                pv.zip(mv).and_then(|(a, b)| f(a, b))
            };
            let (pp, mp) = (p.map(|r| r.pages), m.map(|r| r.pages_sent));
            let (ps, ms) = (p.map(|r| r.secs), m.map(|r| r.duration.as_secs_f64()));
            RoundComparison {
                round: i as u32,
                predicted_pages: pp,
                measured_pages: mp,
                pages_rel_err: both(rel_err, pp.map(|v| v as f64), mp.map(|v| v as f64)),
                predicted_secs: ps,
                measured_secs: ms,
                secs_rel_err: both(rel_err, ps, ms),
            }
        })
        .collect();
    let m_pages: u64 = measured.iter().map(|r| r.pages_sent).sum();
    let m_secs: f64 = measured.iter().map(|r| r.duration.as_secs_f64()).sum();
    Comparison {
        rounds,
        predicted_rounds: predicted.rounds.len(),
        measured_rounds: measured.len(),
        total_pages_rel_err: rel_err(predicted.total_pages as f64, m_pages as f64),
        total_secs_rel_err: rel_err(predicted.total_secs, m_secs),
        downtime_rel_err: measured.last().and_then(|l| rel_err(predicted.downtime_secs, l.duration.as_secs_f64())),
    }
}

impl fmt::Display for Comparison {
    /// A plain-text table for reports.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let num = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        let secs = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:+.1}%", v * 100.0));
        writeln!(
            f,
            "{:>5} {:>12} {:>12} {:>8} {:>9} {:>9} {:>8}",
            "round", "pred pages", "meas pages", "err", "pred s", "meas s", "err"
        )?;
        for r in &self.rounds {
            writeln!(
                f,
                "{:>5} {:>12} {:>12} {:>8} {:>9} {:>9} {:>8}",
                r.round,
                num(r.predicted_pages),
                num(r.measured_pages),
                pct(r.pages_rel_err),
                secs(r.predicted_secs),
                secs(r.measured_secs),
                pct(r.secs_rel_err)
            )?;
        }
        writeln!(
            f,
            "rounds {} predicted / {} measured; total pages {}, total time {}, downtime {}",
            self.predicted_rounds,
            self.measured_rounds,
            pct(self.total_pages_rel_err),
            pct(self.total_secs_rel_err),
            pct(self.downtime_rel_err)
        )
    }
}

#[cfg(test)]
mod tests;
