//! Pre-copy stop rules: when to stop sending dirty pages with the VM running, pause it, and
//! send the rest ("stop-and-copy").
//!
//! Two rules, usable together (stop when either says stop):
//! - [`XenRule`], Xen 3.0.3's: at most 50 dirty pages left, 30 rounds, or 3× the VM's pages
//!   sent (SEEDS §004);
//! - a downtime target: stop when the whole stop phase is estimated to fit in it.
//!
//! # The stop phase's cost
//! The downtime (pause → the destination's `Resumed` reply) is estimated as
//!
//! ```text
//! overhead + harvest + rtt + ((dirty + dirtied before the pause) · bytes per page + state) / bandwidth
//! ```
//!
//! - `overhead`: what the planner cannot measure before the pause (pausing the vCPUs, saving
//!   and restoring state, the destination's resume), learned from measured stop phases by
//!   [`StopPhaseModel`], a conservative prior until then;
//! - `harvest`: the final dirty-log harvest, as long as the live rounds' harvests
//!   ([`RoundExtras::harvest`]);
//! - `rtt`: the destination's reply ([`RoundExtras::rtt`]);
//! - pages dirtied before the pause: the last round's dirty rate over the harvest plus
//!   [`PAUSE_GAP`];
//! - bandwidth and bytes per page: measured over the live rounds.
//!
//! # Non-convergence
//! With a downtime target, a live round *stalls* when the estimate is above the target and the
//! round left at least 90 % ([`MIN_PROGRESS`]) of the fewest dirty pages any earlier round
//! left: the guest dirties memory about as fast as the link sends it. After
//! [`Converge::grace_rounds`] consecutive stalls the planner says [`Decision::NotConverging`]
//! and asks for the vCPUs to be throttled, like QEMU's auto-converge: 20 % first, 10 % more
//! each further stalled round, at most 99 % ([`Converge`]). When a round stalls with the
//! throttle at its cap, pre-copy ends: with [`StopPolicy::strict`] the planner gives up
//! ([`Decision::GiveUp`]) rather than exceed the target; otherwise it stops and copies anyway
//! ([`StopReason::Unconverged`]) and [`Planner::describe_stop`] states the expected overshoot.
//! Strict also turns Xen's limits into a give-up when the estimate is above the target, and
//! gives up at once when the fixed cost alone exceeds the target. Without strict, a target
//! below the fixed cost is aimed at as `fixed cost + target` ([`StopReason::BelowFixedCost`]).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::format::PAGE_SIZE;
pub use crate::stop_phase::{StopPhaseModel, StopPhaseSample};

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

/// What to do when the guest does not converge towards the downtime target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Converge {
    /// Consecutive stalled rounds before the planner declares non-convergence.
    pub grace_rounds: u32,
    /// First throttle: percent of vCPU time taken from the guest.
    pub throttle_start_percent: u8,
    /// Added at each further stalled round (at least 1).
    pub throttle_step_percent: u8,
    /// Throttle cap; a round that stalls at the cap ends pre-copy. 0 disables throttling:
    /// pre-copy ends right after the grace rounds.
    pub throttle_max_percent: u8,
}

impl Default for Converge {
    fn default() -> Self {
        Converge { grace_rounds: 2, throttle_start_percent: 20, throttle_step_percent: 10, throttle_max_percent: 99 }
    }
}

/// When to stop pre-copy. With both rules set, the first to fire stops.
///
/// Build it as `StopPolicy { xen, downtime, ..Default::default() }` to keep the defaults of the
/// other fields.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StopPolicy {
    /// Xen's rule.
    pub xen: Option<XenRule>,
    /// Stop when the estimated downtime (the stop phase's fixed overhead included) is at most
    /// this.
    pub downtime: Option<Duration>,
    /// Fail ([`Decision::GiveUp`]) rather than stop and copy with an estimate above `downtime`.
    #[serde(default)]
    pub strict: bool,
    /// Non-convergence handling (only with a `downtime` target).
    #[serde(default)]
    pub converge: Converge,
    /// The stop phase's overhead learned by earlier migrations (or the prior).
    #[serde(default)]
    pub stop_phase: StopPhaseModel,
    /// The stop phase's pages are estimated to move this many times slower than the live
    /// rounds' measured bandwidth (1: as fast). See [`TRANSFER_MARGIN`].
    #[serde(default = "one")]
    pub transfer_margin: f64,
}

fn one() -> f64 {
    1.0
}

impl Default for StopPolicy {
    /// Xen's rule alone.
    fn default() -> Self {
        StopPolicy {
            xen: Some(XenRule::default()),
            downtime: None,
            strict: false,
            converge: Converge::default(),
            stop_phase: StopPhaseModel::default(),
            transfer_margin: 1.0,
        }
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

/// Optional measurements of a round, for the stop-phase estimate
/// ([`Planner::after_round_with`]). Missing ones are left to the learned overhead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RoundExtras {
    /// How long the round's dirty-log harvest (`fetch_dirty`) took.
    pub harvest: Option<Duration>,
    /// A round trip to the destination (e.g. from sending a batch to its `Placed` notice).
    pub rtt: Option<Duration>,
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
    /// The whole stop phase is estimated to fit the downtime target.
    DowntimeMet {
        /// The estimated downtime, fixed overhead included.
        estimated: Duration,
    },
    /// Not strict: the target is below the stop phase's fixed cost, and the pages left fit
    /// in the target on top of it.
    BelowFixedCost {
        /// The estimated downtime, fixed overhead included.
        estimated: Duration,
        /// The fixed part of it (overhead, harvest, round trip).
        fixed: Duration,
    },
    /// Not strict: the guest did not converge even with the throttle at its cap; stopping
    /// with the estimate above the target.
    Unconverged {
        /// The estimated downtime, fixed overhead included.
        estimated: Duration,
        /// The throttle in force.
        throttle_percent: u8,
    },
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::FewDirtyPages => f.write_str("few dirty pages left"),
            StopReason::MaxRounds => f.write_str("round limit"),
            StopReason::MaxSent => f.write_str("sent-pages limit"),
            StopReason::DowntimeMet { estimated } => write!(f, "downtime target met (estimated {})", Ms(*estimated)),
            StopReason::BelowFixedCost { estimated, fixed } => {
                write!(f, "target below the fixed stop cost of {} (estimated {})", Ms(*fixed), Ms(*estimated))
            }
            StopReason::Unconverged { estimated, throttle_percent } => write!(
                f,
                "not converging with vCPUs throttled {throttle_percent}%, stopping anyway (estimated {})",
                Ms(*estimated)
            ),
        }
    }
}

/// Why a strict downtime target made the planner give up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GiveUpReason {
    /// The stop phase's fixed cost alone is above the target.
    FixedCostAboveTarget {
        /// Overhead, harvest and round trip.
        fixed: Duration,
        /// The target.
        target: Duration,
    },
    /// The guest did not converge even with the throttle at its cap.
    NotConverging {
        /// The estimated downtime.
        estimated: Duration,
        /// The target.
        target: Duration,
        /// The throttle in force.
        throttle_percent: u8,
    },
    /// A Xen limit (or [`HARD_MAX_ROUNDS`]) fired with the estimate above the target.
    Limit {
        /// The limit: [`StopReason::MaxRounds`] or [`StopReason::MaxSent`].
        rule: StopReason,
        /// The estimated downtime, `None` before any bandwidth measurement.
        estimated: Option<Duration>,
        /// The target.
        target: Duration,
    },
}

impl fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GiveUpReason::FixedCostAboveTarget { fixed, target } => write!(
                f,
                "strict downtime target {} is below the stop phase's fixed cost of {}",
                Ms(*target),
                Ms(*fixed)
            ),
            GiveUpReason::NotConverging { estimated, target, throttle_percent } => write!(
                f,
                "strict downtime target {} cannot be met: the guest dirties memory faster than it is sent \
                 (vCPUs throttled {throttle_percent}%, estimated {})",
                Ms(*target),
                Ms(*estimated)
            ),
            GiveUpReason::Limit { rule, estimated, target } => {
                write!(f, "strict downtime target {} not met at the {rule}", Ms(*target))?;
                match estimated {
                    Some(e) => write!(f, " (estimated {})", Ms(*e)),
                    None => f.write_str(" (no estimate yet)"),
                }
            }
        }
    }
}

/// Milliseconds with one decimal.
struct Ms(Duration);

impl fmt::Display for Ms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} ms", self.0.as_secs_f64() * 1e3)
    }
}

/// What to do after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Run another live round (keeping any throttle in force: [`Planner::throttle_percent`]).
    Continue,
    /// Run another live round, but the guest is not converging towards the downtime target:
    /// throttle its vCPUs by `throttle_percent` from now on (0 when throttling is disabled).
    NotConverging {
        /// The estimated downtime now.
        estimated: Duration,
        /// Percent of vCPU time to take from the guest.
        throttle_percent: u8,
    },
    /// Pause the VM and send what is left.
    StopAndCopy(StopReason),
    /// Strict target: end the migration as failed, the VM running on the source.
    GiveUp(GiveUpReason),
}

/// A margin for [`StopPolicy::transfer_margin`]. Against the live rounds' bandwidth, stop
/// phases on this project's hosts took up to ~50 % longer per page (the destination places the
/// last pages and replies, on a busy 2-core host). With 1.2, 3 of 18 migrations at 10/30/50 ms
/// targets overshot; with 1.5, 0 of 18 did (docs/migration.md).
pub const TRANSFER_MARGIN: f64 = 1.5;

/// A downtime estimate, part by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DowntimeEstimate {
    /// All of it.
    pub total: Duration,
    /// The learned fixed overhead ([`StopPhaseModel::overhead`]).
    pub overhead: Duration,
    /// The final dirty-log harvest.
    pub harvest: Duration,
    /// The destination's reply.
    pub rtt: Duration,
    /// Pages expected in the stop phase: those dirty now and those dirtied before the pause.
    pub pages: u64,
    /// Sending those pages and the state at the measured bandwidth.
    pub transfer: Duration,
}

impl DowntimeEstimate {
    /// The part that does not depend on the pages left.
    pub fn fixed(&self) -> Duration {
        self.overhead.saturating_add(self.harvest).saturating_add(self.rtt)
    }
}

/// Weight of the newest round in the bandwidth estimate.
pub const BANDWIDTH_EWMA_ALPHA: f64 = 0.5;

/// Round limit when the policy has no Xen rule: a downtime target alone may never be met (a
/// guest dirtying faster than the link), and a migration must end. It holds even for a strict
/// target, for callers that go on after [`Decision::GiveUp`].
pub const HARD_MAX_ROUNDS: u32 = 1000;

/// Time from the end of the last live harvest to the vCPUs being paused, beyond the harvest
/// itself (the decision, the pause signal): the window in which the guest dirties pages the
/// final round also sends. Errors in it end up in the learned overhead.
pub const PAUSE_GAP: Duration = Duration::from_millis(1);

/// A round makes progress when it leaves fewer than this share of the fewest dirty pages any
/// earlier round left.
pub const MIN_PROGRESS: f64 = 0.9;

/// Smoothed and last value of a measured duration, in seconds.
#[derive(Debug, Clone, Copy)]
struct Smoothed {
    ewma: f64,
    last: f64,
}

impl Smoothed {
    fn update(this: &mut Option<Smoothed>, d: Duration) {
        let x = d.as_secs_f64();
        *this = Some(match *this {
            None => Smoothed { ewma: x, last: x },
            Some(s) => Smoothed { ewma: 0.5 * x + 0.5 * s.ewma, last: x },
        });
    }

    /// The larger of the two: a cost that just grew is believed at once.
    fn value(this: Option<Smoothed>) -> Duration {
        this.and_then(|s| Duration::try_from_secs_f64(s.ewma.max(s.last)).ok()).unwrap_or(Duration::ZERO)
    }
}

/// Applies a [`StopPolicy`] round by round, measures the bandwidth and estimates the downtime.
#[derive(Debug, Clone)]
pub struct Planner {
    policy: StopPolicy,
    total_pages: u64,
    rounds: u32,
    pages_sent: u64,
    bytes_sent: u64,
    /// Exponentially decayed bytes and seconds of the measured rounds.
    ewma: Option<(f64, f64)>,
    model: StopPhaseModel,
    harvest: Option<Smoothed>,
    rtt: Option<Smoothed>,
    /// Pages per second the guest dirtied in the last timed round.
    dirty_rate: f64,
    /// Fewest dirty pages any round left.
    min_dirty: Option<u64>,
    /// Consecutive stalled rounds.
    stalled: u32,
    throttle: u8,
    converging: bool,
    last_estimate: Option<Duration>,
}

impl Planner {
    /// A planner for a VM of `total_pages` pages, starting from `policy.stop_phase`.
    pub fn new(policy: StopPolicy, total_pages: u64) -> Self {
        Planner {
            policy,
            total_pages,
            rounds: 0,
            pages_sent: 0,
            bytes_sent: 0,
            ewma: None,
            model: policy.stop_phase,
            harvest: None,
            rtt: None,
            dirty_rate: 0.0,
            min_dirty: None,
            stalled: 0,
            throttle: 0,
            converging: true,
            last_estimate: None,
        }
    }

    /// [`after_round_with`](Self::after_round_with) without extra measurements.
    pub fn after_round(&mut self, stats: &RoundStats) -> Decision {
        self.after_round_with(stats, &RoundExtras::default())
    }

    /// Accounts for a finished live round and decides what to do next. Rounds are counted
    /// by calls, not by `stats.round`.
    ///
    /// When several rules fire, the reason reported is the first of: `FewDirtyPages`,
    /// `DowntimeMet`/`BelowFixedCost` (converged), `Unconverged`, then `MaxSent`, `MaxRounds`
    /// (gave up). With a strict target, a stop whose estimate is above the target becomes
    /// [`Decision::GiveUp`] instead (below [`HARD_MAX_ROUNDS`]).
    pub fn after_round_with(&mut self, stats: &RoundStats, extras: &RoundExtras) -> Decision {
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
        if secs > 0.0 {
            self.dirty_rate = stats.dirty_pages as f64 / secs;
        }
        if let Some(h) = extras.harvest {
            Smoothed::update(&mut self.harvest, h);
        }
        if let Some(r) = extras.rtt {
            Smoothed::update(&mut self.rtt, r);
        }
        let estimate = self.estimate(stats.dirty_pages);
        self.last_estimate = estimate.map(|e| e.total);
        let decision = self.decide(stats.dirty_pages, estimate);
        self.min_dirty = Some(self.min_dirty.map_or(stats.dirty_pages, |m| m.min(stats.dirty_pages)));
        tracing::debug!(
            round = stats.round,
            dirty = stats.dirty_pages,
            sent = self.pages_sent,
            estimated_ms = self.last_estimate.map(|e| e.as_secs_f64() * 1e3),
            throttle = self.throttle,
            ?decision,
            "pre-copy round"
        );
        decision
    }

    fn decide(&mut self, dirty: u64, estimate: Option<DowntimeEstimate>) -> Decision {
        let xen = self.policy.xen;
        let est = estimate.map(|e| e.total);
        let fixed = self.fixed_cost();
        let max_rounds = xen.map_or(HARD_MAX_ROUNDS, |x| x.max_rounds.min(HARD_MAX_ROUNDS));
        // The final round counts towards the limit: stop when it would be the last allowed.
        let last_round = self.rounds.saturating_add(1) >= max_rounds;
        let hard_stop = self.rounds.saturating_add(1) >= HARD_MAX_ROUNDS;
        let target = self.policy.downtime;
        // Strict only where there is a target to keep, and not past the hard limit.
        let strict = target.filter(|_| self.policy.strict && !hard_stop);
        let above = |t: Duration| est.is_none_or(|e| e > t);

        if let Some(t) = strict.filter(|t| fixed > *t) {
            return Decision::GiveUp(GiveUpReason::FixedCostAboveTarget { fixed, target: t });
        }
        if xen.is_some_and(|x| dirty <= x.max_dirty_pages) && !strict.is_some_and(above) {
            return Decision::StopAndCopy(StopReason::FewDirtyPages);
        }
        let mut not_converging = None;
        if let Some(t) = target {
            // Not strict and unreachable: aim at the target on top of the fixed cost.
            let goal = if fixed > t { fixed.saturating_add(t) } else { t };
            if let Some(e) = est.filter(|e| *e <= goal) {
                return Decision::StopAndCopy(if e <= t {
                    StopReason::DowntimeMet { estimated: e }
                } else {
                    StopReason::BelowFixedCost { estimated: e, fixed }
                });
            }
            if let Some(e) = est {
                match self.judge_convergence(dirty) {
                    Some(Ok(throttle_percent)) => {
                        not_converging = Some(Decision::NotConverging { estimated: e, throttle_percent })
                    }
                    Some(Err(throttle_percent)) => {
                        return match strict {
                            Some(t) => Decision::GiveUp(GiveUpReason::NotConverging {
                                estimated: e,
                                target: t,
                                throttle_percent,
                            }),
                            None => Decision::StopAndCopy(StopReason::Unconverged { estimated: e, throttle_percent }),
                        };
                    }
                    None => {}
                }
            }
        }
        let limit = if xen.is_some_and(|x| self.pages_sent as f64 > x.max_sent_factor * self.total_pages as f64) {
            Some(StopReason::MaxSent)
        } else if last_round {
            Some(StopReason::MaxRounds)
        } else {
            None
        };
        if let Some(rule) = limit {
            return match strict.filter(|t| above(*t)) {
                Some(t) => Decision::GiveUp(GiveUpReason::Limit { rule, estimated: est, target: t }),
                None => Decision::StopAndCopy(rule),
            };
        }
        not_converging.unwrap_or(Decision::Continue)
    }

    /// Updates the stall count and throttle for a round whose estimate `e` is above the goal.
    /// `None`: carry on; `Some(Ok(p))`: not converging, throttle `p`; `Some(Err(p))`: not
    /// converging with the throttle at its cap `p`, pre-copy should end.
    fn judge_convergence(&mut self, dirty: u64) -> Option<Result<u8, u8>> {
        let c = self.policy.converge;
        let progress = self.min_dirty.is_none_or(|m| (dirty as f64) < MIN_PROGRESS * m as f64);
        if progress {
            self.stalled = 0;
            self.converging = true;
            return None;
        }
        self.stalled = self.stalled.saturating_add(1);
        if self.throttle == 0 && self.stalled < c.grace_rounds {
            return None;
        }
        self.converging = false;
        if self.throttle >= c.throttle_max_percent {
            return Some(Err(self.throttle));
        }
        self.throttle = if self.throttle == 0 {
            c.throttle_start_percent.max(1)
        } else {
            self.throttle.saturating_add(c.throttle_step_percent.max(1))
        }
        .min(c.throttle_max_percent);
        Some(Ok(self.throttle))
    }

    /// Learns from a measured stop phase: its residual (measured downtime minus the harvest,
    /// round trip and transfer this planner estimates) goes into the overhead model. Call it
    /// after the destination's reply; then carry [`stop_phase_model`](Self::stop_phase_model)
    /// to the next migration. Returns the residual.
    pub fn observe_stop_phase(&mut self, sample: &StopPhaseSample) -> Duration {
        let harvest = sample.harvest.unwrap_or(Smoothed::value(self.harvest));
        let known = harvest
            .saturating_add(Smoothed::value(self.rtt))
            .saturating_add(self.transfer_time(sample.pages, sample.state_bytes).unwrap_or(Duration::ZERO));
        let residual = sample.measured_downtime.saturating_sub(known);
        self.model.state_bytes = sample.state_bytes;
        self.model.observe_residual(residual);
        residual
    }

    /// The overhead model, with what [`observe_stop_phase`](Self::observe_stop_phase) learned.
    pub fn stop_phase_model(&self) -> StopPhaseModel {
        self.model
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

    fn bytes_per_page(&self) -> f64 {
        if self.pages_sent > 0 && self.bytes_sent > 0 {
            self.bytes_sent as f64 / self.pages_sent as f64
        } else {
            PAGE_SIZE as f64
        }
    }

    fn transfer_time(&self, pages: u64, state_bytes: u64) -> Option<Duration> {
        let bw = self.bandwidth()?;
        Duration::try_from_secs_f64((pages as f64 * self.bytes_per_page() + state_bytes as f64) / bw).ok()
    }

    /// The transfer margin in force: at least 1, whatever a deserialized policy says.
    fn margin(&self) -> f64 {
        let m = self.policy.transfer_margin;
        if m.is_finite() {
            m.clamp(1.0, 10.0)
        } else {
            1.0
        }
    }

    /// The part of the downtime that does not depend on the pages left: learned overhead,
    /// harvest and round trip.
    pub fn fixed_cost(&self) -> Duration {
        self.model.overhead().saturating_add(Smoothed::value(self.harvest)).saturating_add(Smoothed::value(self.rtt))
    }

    /// The estimated downtime if the VM were paused with `dirty_pages` dirty, part by part
    /// (see the module's documentation). `None` before any bandwidth measurement, except for
    /// no pages (the fixed part alone).
    pub fn estimate(&self, dirty_pages: u64) -> Option<DowntimeEstimate> {
        let overhead = self.model.overhead();
        let harvest = Smoothed::value(self.harvest);
        let rtt = Smoothed::value(self.rtt);
        let fixed = overhead.saturating_add(harvest).saturating_add(rtt);
        let (pages, transfer) = if self.bandwidth().is_none() {
            if dirty_pages > 0 {
                return None;
            }
            (0, Duration::ZERO)
        } else {
            let window = harvest.saturating_add(PAUSE_GAP).as_secs_f64();
            let before_pause = (self.dirty_rate * window).ceil();
            let room = self.total_pages.saturating_sub(dirty_pages) as f64;
            // Float to integer casts saturate; a NaN rate counts as none.
            let pages = dirty_pages.saturating_add(before_pause.min(room) as u64);
            (pages, self.transfer_time(pages, self.model.state_bytes)?.mul_f64(self.margin()))
        };
        Some(DowntimeEstimate { total: fixed.saturating_add(transfer), overhead, harvest, rtt, pages, transfer })
    }

    /// The estimated downtime with `dirty_pages` dirty: [`estimate`](Self::estimate)'s total,
    /// never zero (the fixed overhead is at least [`crate::stop_phase::MIN_OVERHEAD`]).
    pub fn estimated_downtime(&self, dirty_pages: u64) -> Option<Duration> {
        self.estimate(dirty_pages).map(|e| e.total)
    }

    /// The estimate behind the last decision.
    pub fn last_estimate(&self) -> Option<Duration> {
        self.last_estimate
    }

    /// How far the last estimate is above the downtime target, if it is.
    pub fn expected_overshoot(&self) -> Option<Duration> {
        let (e, t) = (self.last_estimate?, self.policy.downtime?);
        (e > t).then(|| e - t)
    }

    /// A one-line account of a stop: the reason, the estimate and, when the target will be
    /// exceeded, by how much. For the engine's `StopAndCopy` event and report.
    pub fn describe_stop(&self, reason: &StopReason) -> String {
        let mut s = match reason {
            StopReason::MaxSent => match self.policy.xen {
                Some(x) => format!("sent {}x the VM's pages", x.max_sent_factor),
                None => reason.to_string(),
            },
            r => r.to_string(),
        };
        let has_estimate = matches!(
            reason,
            StopReason::DowntimeMet { .. } | StopReason::BelowFixedCost { .. } | StopReason::Unconverged { .. }
        );
        match (self.last_estimate, self.policy.downtime) {
            (Some(e), Some(t)) if e > t => s.push_str(&format!(
                "; downtime target {} will be exceeded: estimated {} (+{})",
                Ms(t),
                Ms(e),
                Ms(e - t)
            )),
            (Some(e), _) if !has_estimate => s.push_str(&format!(" (estimated {})", Ms(e))),
            _ => {}
        }
        s
    }

    /// The throttle in force, percent of vCPU time taken from the guest (0: none). It only
    /// grows during a migration; the engine applies it before each round and lifts it at the
    /// end.
    pub fn throttle_percent(&self) -> u8 {
        self.throttle
    }

    /// [`throttle_percent`](Self::throttle_percent) as a fraction in `0..1`.
    pub fn throttle(&self) -> f64 {
        f64::from(self.throttle) / 100.0
    }

    /// Whether the last round was judged converging (true until judged otherwise).
    pub fn is_converging(&self) -> bool {
        self.converging
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

    /// A round at 100,000 pages/s.
    fn at_100k(p: &mut Planner, round: u32, pages: u64, dirty: u64) -> Decision {
        p.after_round(&stats(round, pages, pages as f64 / 100_000.0, dirty))
    }

    /// Runs rounds where each sends the previous round's dirty pages, until a stop.
    fn run(p: &mut Planner, first: u64, dirty: impl Fn(u32) -> u64) -> (u32, StopReason) {
        let mut pages = first;
        for r in 0.. {
            let d = dirty(r);
            match at_100k(p, r, pages, d) {
                Decision::StopAndCopy(reason) => return (r, reason),
                Decision::GiveUp(g) => panic!("gave up: {g}"),
                Decision::Continue | Decision::NotConverging { .. } => {}
            }
            pages = d;
        }
        unreachable!()
    }

    /// Like `run`, but returns every decision.
    fn decisions(p: &mut Planner, first: u64, dirty: impl Fn(u32) -> u64) -> Vec<Decision> {
        let mut pages = first;
        let mut out = Vec::new();
        for r in 0..HARD_MAX_ROUNDS + 5 {
            let d = dirty(r);
            let decision = at_100k(p, r, pages, d);
            out.push(decision);
            if matches!(decision, Decision::StopAndCopy(_) | Decision::GiveUp(_)) {
                return out;
            }
            pages = d;
        }
        panic!("no end: {:?}", &out[..10])
    }

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    fn close(a: Duration, b: Duration) -> bool {
        (a.as_secs_f64() - b.as_secs_f64()).abs() < 1e-9
    }

    fn target(t: Duration) -> StopPolicy {
        StopPolicy { xen: None, downtime: Some(t), ..Default::default() }
    }

    const PRIOR: Duration = crate::stop_phase::DEFAULT_PRIOR;

    #[test]
    fn xen_defaults() {
        assert_eq!(XenRule::default(), XenRule { max_dirty_pages: 50, max_rounds: 30, max_sent_factor: 3.0 });
        assert_eq!(StopPolicy::default().downtime, None);
        assert!(!StopPolicy::default().strict);
        assert_eq!(
            Converge::default(),
            Converge {
                grace_rounds: 2,
                throttle_start_percent: 20,
                throttle_step_percent: 10,
                throttle_max_percent: 99
            }
        );
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
    fn xen_alone_never_throttles() {
        // A flat-out guest under Xen's rule alone: the same decisions as before the
        // non-convergence policy, which needs a downtime target.
        let mut p = Planner::new(StopPolicy::default(), 1_000_000);
        let ds = decisions(&mut p, 1_000_000, |_| 20_000);
        assert_eq!(ds.len(), 29);
        assert!(ds[..28].iter().all(|d| *d == Decision::Continue));
        assert_eq!(ds[28], Decision::StopAndCopy(StopReason::MaxRounds));
        assert_eq!(p.throttle_percent(), 0);
        assert!(p.is_converging());
    }

    // Updated: the estimates used to be page transfer alone (50 ms for 5,000 pages, 9 ms for
    // 900); they now include the stop phase's fixed overhead and the pages dirtied before the
    // pause, so the target is 40 ms instead of 10.
    #[test]
    fn downtime_rule() {
        let mut p = Planner::new(target(Duration::from_millis(40)), 100_000);
        // 100,000 pages in 1 s: 100,000 pages/s.
        assert_eq!(p.after_round(&stats(0, 100_000, 1.0, 5000)), Decision::Continue);
        assert_eq!(p.bandwidth(), Some(100_000.0 * 4096.0));
        // 5,000 dirty + 5 dirtied in the 1 ms before the pause (at 5,000 pages/s), plus 25 ms.
        let e = p.estimate(5000).unwrap();
        assert_eq!((e.pages, e.overhead, e.harvest, e.rtt), (5005, PRIOR, Duration::ZERO, Duration::ZERO));
        assert!(close(e.total, ms(25.0 + 50.05)), "{e:?}");
        assert_eq!(p.estimated_downtime(5000), Some(e.total));
        match p.after_round(&stats(1, 5000, 0.05, 900)) {
            // 900 + 18 (18,000 pages/s for 1 ms) pages: 9.18 ms, plus 25 ms.
            Decision::StopAndCopy(StopReason::DowntimeMet { estimated }) => assert!(close(estimated, ms(34.18))),
            d => panic!("{d:?}"),
        }
    }

    // Updated: a 1 µs target used to run to HARD_MAX_ROUNDS; it is now below the fixed cost,
    // aimed at as fixed cost + 1 µs, and a guest redirtying everything is declared not
    // converging, throttled, and stopped with the throttle at its cap.
    #[test]
    fn downtime_alone_still_terminates() {
        let mut p = Planner::new(target(Duration::from_micros(1)), 1000);
        let (last, reason) = run(&mut p, 1000, |_| 1000);
        assert!(matches!(reason, StopReason::Unconverged { throttle_percent: 99, .. }), "{reason:?}");
        assert_eq!(last, 11);
        // A caller that ignores a strict give-up still ends at the hard round limit.
        let mut p = Planner::new(StopPolicy { strict: true, ..target(Duration::from_micros(1)) }, 1000);
        let mut n = 0;
        let last = loop {
            match at_100k(&mut p, n, 1000, 1000) {
                Decision::GiveUp(_) => n += 1,
                d => break d,
            }
        };
        assert_eq!((n, last), (HARD_MAX_ROUNDS - 2, Decision::StopAndCopy(StopReason::MaxRounds)));
    }

    // Updated: target 40 ms (was 10) for the fixed overhead, as in `downtime_rule`.
    #[test]
    fn both_rules_either_stops() {
        let policy = StopPolicy {
            xen: Some(XenRule::default()),
            downtime: Some(Duration::from_millis(40)),
            ..Default::default()
        };
        // Downtime fires first (900 pages fit in 40 ms with the overhead, far above 50).
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

    // Updated: the estimate for no pages was zero; it is now the fixed overhead.
    #[test]
    fn bandwidth_is_a_byte_weighted_ewma() {
        let mut p = Planner::new(StopPolicy::default(), 1 << 20);
        assert_eq!(p.bandwidth(), None);
        assert_eq!(p.estimated_downtime(10), None);
        assert_eq!(p.estimated_downtime(0), Some(PRIOR));
        p.after_round(&stats(0, 100_000, 1.0, 100_000));
        // A zero-time round is not a measurement.
        p.after_round(&stats(1, 10, 0.0, 100_000));
        assert_eq!(p.bandwidth(), Some(100_000.0 * 4096.0));
        // 10,000 pages at half the speed: decayed (50,000+5,000) pages over (0.5+0.1) s.
        p.after_round(&stats(2, 10_000, 0.2, 100_000));
        let expect = 55_000.0 * 4096.0 / 0.6;
        assert!((p.bandwidth().unwrap() - expect).abs() < 1e-6 * expect);
    }

    #[test]
    fn estimate_has_every_part_and_is_never_zero() {
        let mut p = Planner::new(target(Duration::from_millis(100)), 1_000_000);
        let extras = RoundExtras { harvest: Some(ms(2.0)), rtt: Some(ms(0.5)) };
        // 100,000 pages/s; 10,000 pages dirtied in 1 s.
        p.after_round_with(&stats(0, 100_000, 1.0, 10_000), &extras);
        let e = p.estimate(0).unwrap();
        // Dirtied before the pause: 10,000 pages/s over harvest + gap (3 ms) = 30 pages.
        assert_eq!(e.pages, 30);
        assert!(close(e.fixed(), PRIOR + ms(2.5)));
        assert!(close(e.total, PRIOR + ms(2.5) + ms(0.3)), "{e:?}");
        assert_eq!(p.fixed_cost(), e.fixed());
        // A harvest that grew is believed at once.
        p.after_round_with(&stats(1, 10_000, 0.1, 9_000), &RoundExtras { harvest: Some(ms(6.0)), rtt: None });
        assert!(close(p.estimate(0).unwrap().harvest, ms(6.0)));
        // Even with nothing learned to be cheap, the estimate is never 0.
        let mut p = Planner::new(target(Duration::from_millis(1)), 1000);
        p.after_round(&stats(0, 1000, 0.01, 0));
        assert!(p.estimated_downtime(0).unwrap() >= PRIOR);
    }

    #[test]
    fn the_transfer_margin_scales_only_the_transfer() {
        let with = |margin: f64| {
            let mut p =
                Planner::new(StopPolicy { transfer_margin: margin, ..target(Duration::from_millis(100)) }, 1_000_000);
            p.after_round(&stats(0, 100_000, 1.0, 0));
            p.estimate(10_000).unwrap()
        };
        let (plain, wide) = (with(1.0), with(1.2));
        assert_eq!(plain.fixed(), wide.fixed());
        assert!(close(wide.transfer, plain.transfer.mul_f64(1.2)), "{plain:?} {wide:?}");
        // Nonsense from a deserialized policy is not believed.
        assert_eq!(with(f64::NAN).transfer, plain.transfer);
        assert_eq!(with(0.5).transfer, plain.transfer);
    }

    #[test]
    fn converging_guest_stops_as_soon_as_the_full_estimate_fits() {
        let mut p = Planner::new(target(Duration::from_millis(40)), 1_000_000);
        let dirty = [20_000, 8_000, 3_000, 1_000, 300];
        let ds = decisions(&mut p, 100_000, |r| dirty[r as usize]);
        // 3,000 pages take 30 ms, which fit 40 ms alone, but not with 25 ms of overhead: the
        // planner goes on to 1,000 (10.34 ms of transfer + 25 ms).
        assert_eq!(ds.len(), 4);
        assert!(ds[..3].iter().all(|d| *d == Decision::Continue), "{ds:?}");
        match ds[3] {
            Decision::StopAndCopy(StopReason::DowntimeMet { estimated }) => assert!(close(estimated, ms(35.34))),
            d => panic!("{d:?}"),
        }
        assert_eq!(p.throttle_percent(), 0);
        let text = p.describe_stop(&StopReason::DowntimeMet { estimated: ms(35.34) });
        assert_eq!(text, "downtime target met (estimated 35.3 ms)");
    }

    #[test]
    fn flat_out_guest_is_throttled_then_stops_anyway() {
        let mut p = Planner::new(target(Duration::from_millis(30)), 1_000_000);
        let ds = decisions(&mut p, 1_000_000, |_| 20_000);
        // Rounds 0 and 1: no judgement yet, one stall; then throttles of 20, 30, …, 90, 99 %.
        assert_eq!(&ds[..2], &[Decision::Continue, Decision::Continue]);
        let throttles: Vec<u8> = ds[2..ds.len() - 1]
            .iter()
            .map(|d| match d {
                Decision::NotConverging { throttle_percent, estimated } => {
                    assert!(*estimated > Duration::from_millis(30));
                    *throttle_percent
                }
                d => panic!("{d:?}"),
            })
            .collect();
        assert_eq!(throttles, [20, 30, 40, 50, 60, 70, 80, 90, 99]);
        let Some(Decision::StopAndCopy(reason @ StopReason::Unconverged { estimated, throttle_percent: 99 })) =
            ds.last().copied()
        else {
            panic!("{ds:?}")
        };
        assert!(!p.is_converging());
        assert_eq!(p.throttle_percent(), 99);
        assert!(close(p.expected_overshoot().unwrap(), estimated - Duration::from_millis(30)));
        let text = p.describe_stop(&reason);
        assert!(text.contains("throttled 99%") && text.contains("downtime target 30.0 ms will be exceeded"), "{text}");
    }

    #[test]
    fn flat_out_guest_with_a_strict_target_gives_up() {
        let policy = StopPolicy { strict: true, ..target(Duration::from_millis(30)) };
        let mut p = Planner::new(policy, 1_000_000);
        let ds = decisions(&mut p, 1_000_000, |_| 20_000);
        assert_eq!(ds.len(), 12);
        let Some(Decision::GiveUp(g @ GiveUpReason::NotConverging { throttle_percent: 99, .. })) = ds.last().copied()
        else {
            panic!("{ds:?}")
        };
        assert!(g.to_string().starts_with("strict downtime target 30.0 ms cannot be met"), "{g}");
        // With Xen's rule too, a limit that fires above the target is a give-up as well.
        let policy = StopPolicy { xen: Some(XenRule::default()), ..policy };
        let mut p = Planner::new(policy, 1000);
        let ds = decisions(&mut p, 1000, |_| 1000);
        assert!(
            matches!(ds.last(), Some(Decision::GiveUp(GiveUpReason::Limit { rule: StopReason::MaxSent, .. }))),
            "{ds:?}"
        );
    }

    #[test]
    fn progress_resets_the_grace_but_not_the_throttle() {
        let mut p = Planner::new(target(Duration::from_millis(30)), 1_000_000);
        // Stalls at 20,000 until throttled twice, then shrinks by halves.
        let dirty = [20_000, 20_000, 20_000, 20_000, 10_000, 5_000, 2_000, 400];
        let ds = decisions(&mut p, 1_000_000, |r| dirty[r as usize]);
        assert_eq!(ds[2], Decision::NotConverging { estimated: p_est(&ds[2]), throttle_percent: 20 });
        assert!(matches!(ds[3], Decision::NotConverging { throttle_percent: 30, .. }));
        assert!(ds[4..ds.len() - 1].iter().all(|d| *d == Decision::Continue), "{ds:?}");
        assert!(matches!(ds.last(), Some(Decision::StopAndCopy(StopReason::DowntimeMet { .. }))), "{ds:?}");
        assert!(p.is_converging());
        assert_eq!(p.throttle_percent(), 30);
        assert!((p.throttle() - 0.3).abs() < 1e-12);
    }

    fn p_est(d: &Decision) -> Duration {
        match d {
            Decision::NotConverging { estimated, .. } => *estimated,
            _ => Duration::ZERO,
        }
    }

    #[test]
    fn throttling_disabled_stops_after_the_grace_rounds() {
        let policy = StopPolicy {
            converge: Converge { throttle_max_percent: 0, ..Converge::default() },
            ..target(Duration::from_millis(30))
        };
        let mut p = Planner::new(policy, 1_000_000);
        let ds = decisions(&mut p, 1_000_000, |_| 20_000);
        assert_eq!(ds.len(), 3);
        assert!(matches!(ds[2], Decision::StopAndCopy(StopReason::Unconverged { throttle_percent: 0, .. })));
    }

    #[test]
    fn target_below_the_fixed_cost() {
        // The user's case: 1 ms asked, about 20 ms of fixed cost. Not strict: stop when the
        // pages fit 1 ms on top of the fixed cost, and say so with the real estimate.
        let mut p = Planner::new(target(Duration::from_millis(1)), 1_000_000);
        let ds = decisions(&mut p, 100_000, |r| [5_000, 500, 40][r as usize]);
        let Some(Decision::StopAndCopy(reason @ StopReason::BelowFixedCost { estimated, fixed })) = ds.last().copied()
        else {
            panic!("{ds:?}")
        };
        assert_eq!(ds.len(), 3);
        assert_eq!(fixed, PRIOR);
        assert!(estimated > PRIOR && estimated <= PRIOR + Duration::from_millis(1));
        let text = p.describe_stop(&reason);
        assert!(text.contains("downtime target 1.0 ms will be exceeded: estimated 25."), "{text}");
        // Strict: give up at once.
        let mut p = Planner::new(StopPolicy { strict: true, ..target(Duration::from_millis(1)) }, 1_000_000);
        assert_eq!(
            at_100k(&mut p, 0, 100_000, 5_000),
            Decision::GiveUp(GiveUpReason::FixedCostAboveTarget { fixed: PRIOR, target: Duration::from_millis(1) })
        );
    }

    #[test]
    fn limits_report_the_overshoot() {
        let policy = StopPolicy { xen: Some(XenRule::default()), ..target(Duration::from_millis(30)) };
        let mut p = Planner::new(policy, 1000);
        let (_, reason) = run(&mut p, 1000, |_| 1000);
        assert_eq!(reason, StopReason::MaxSent);
        let text = p.describe_stop(&reason);
        assert!(text.starts_with("sent 3x the VM's pages; downtime target 30.0 ms will be exceeded"), "{text}");
        // Without a target: just the estimate.
        let mut p = Planner::new(StopPolicy::default(), 1000);
        let (_, reason) = run(&mut p, 1000, |_| 1000);
        assert!(p.describe_stop(&reason).starts_with("sent 3x the VM's pages (estimated "));
    }

    #[test]
    fn learning_from_stop_phases() {
        let policy = target(Duration::from_millis(40));
        let mut p = Planner::new(policy, 1_000_000);
        at_100k(&mut p, 0, 100_000, 10_000);
        // 1,000 pages and 40,960 bytes of state at 409.6 MB/s: 10.1 ms; measured 60 ms.
        let sample = StopPhaseSample {
            pages: 1000,
            state_bytes: 40_960,
            measured_downtime: Duration::from_millis(60),
            harvest: Some(ms(2.0)),
        };
        let residual = p.observe_stop_phase(&sample);
        assert!(close(residual, ms(60.0 - 2.0 - 10.1)), "{residual:?}");
        let learned = p.stop_phase_model();
        assert_eq!((learned.samples, learned.state_bytes), (1, 40_960));
        // The overshoot raised the overhead above the prior and above the residual.
        assert!(learned.overhead() > PRIOR && learned.overhead() >= residual);
        // The next migration starts from it.
        let next = Planner::new(StopPolicy { stop_phase: learned, ..policy }, 1_000_000);
        assert_eq!(next.estimated_downtime(0), Some(learned.overhead()));
        // Bounded: a stop phase that took ages does not make the overhead unbounded.
        let mut p = Planner::new(policy, 1_000_000);
        p.observe_stop_phase(&StopPhaseSample { measured_downtime: Duration::MAX, ..sample });
        assert_eq!(p.stop_phase_model().overhead(), crate::stop_phase::MAX_OVERHEAD);
    }

    #[test]
    fn policy_serde() {
        // A policy serialized before the new fields gets their defaults.
        let old = r#"{"xen":null,"downtime":{"secs":0,"nanos":30000000}}"#;
        let p: StopPolicy = serde_json::from_str(old).unwrap();
        assert_eq!(p, target(Duration::from_millis(30)));
        let mut model = StopPhaseModel::default();
        model.observe_residual(ms(12.0));
        let p = StopPolicy { strict: true, stop_phase: model, ..p };
        let back: StopPolicy = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        // The model's floats may come back one ulp off (serde_json's default parsing).
        assert_eq!(StopPolicy { stop_phase: p.stop_phase, ..back }, p);
        assert!(back.stop_phase.overhead().abs_diff(p.stop_phase.overhead()) < Duration::from_nanos(10));
        let extras: RoundExtras = serde_json::from_str("{}").unwrap();
        assert_eq!(extras, RoundExtras::default());
    }
}
