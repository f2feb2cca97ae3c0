//! The migration answers of the API: the engines' events and report, a destination's
//! progress, and the status and reports the VMM composes from them (`vm.migration`,
//! `vm.send-migration`, `vm.migration-events`). The migration engine and the VMM produce these
//! types (they re-export them); a client reads them from here.

use kumo_migration::model::{Comparison, Prediction};
use kumo_migration::StopPhaseModel;
use serde::{Deserialize, Serialize};

use crate::MigrationEngine;

/// Progress of a migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Started {
        engine: MigrationEngine,
        connections: usize,
        total_pages: u64,
        touched_pages: u64,
    },
    Round {
        round: u32,
        pages_sent: u64,
        ms: f64,
        dirty_pages: u64,
        mb_per_s: f64,
        estimated_downtime_ms: Option<f64>,
        /// vCPU throttle in force, percent (0: none).
        #[serde(default)]
        throttle_percent: u8,
    },
    /// The guest dirties memory faster than the migration sends it: the downtime target is not
    /// in reach, and the vCPUs are throttled by `throttle_percent` from now on.
    NotConverging {
        round: u32,
        estimated_downtime_ms: f64,
        target_ms: Option<f64>,
        throttle_percent: u8,
    },
    /// Within a round, at most every 100 ms: how far the round has got.
    Progress {
        round: u32,
        /// Pages this round sends in all, and those handed to the wire so far.
        round_pages: u64,
        pages_sent: u64,
        /// Page data of this round so far.
        bytes_sent: u64,
        /// Pages and page data of the whole migration so far.
        total_pages_sent: u64,
        total_bytes_sent: u64,
        /// This round's rate so far.
        mb_per_s: f64,
        /// When this round will end at that rate.
        eta_ms: Option<f64>,
        /// The planner's latest estimate of the downtime (none before a round has ended).
        estimated_downtime_ms: Option<f64>,
    },
    StopAndCopy {
        reason: String,
        pages: u64,
    },
    Completed {
        total_ms: f64,
        downtime_ms: f64,
    },
    Failed {
        error: String,
    },
    /// The operator cancelled the migration; the VM runs on at the source.
    Cancelled,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: u32,
    pub pages: u64,
    pub ms: f64,
    /// Pages dirty when the round ended (distinct pages dirtied during it).
    pub dirty_after: u64,
    /// Where the round's `ms` went: handing its pages to the senders (copying them, for the
    /// copying engines), waiting for the wire to deliver them, reading the dirty log.
    #[serde(default)]
    pub send_ms: f64,
    #[serde(default)]
    pub drain_ms: f64,
    #[serde(default)]
    pub harvest_ms: f64,
    /// The vCPU throttle in force after the round, percent.
    #[serde(default)]
    pub throttle_percent: u8,
    /// Of `pages`: those that held only zeros (sent as runs of page numbers, no data).
    #[serde(default)]
    pub zero_pages: u64,
}

/// Where a migration's time went on the source, phase by phase, in ms. The phases follow
/// each other, so they add up to `total_ms` but for the odd µs between them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseTimes {
    /// The stream's description of the VM, the engine's plan.
    pub setup_ms: f64,
    /// The first connection: TCP, and TLS's handshake when the migration is authenticated.
    pub connect_ms: f64,
    /// The stream header out, the destination's `Accepted` back.
    pub accepted_ms: f64,
    /// The other connections, each with its header.
    pub more_connections_ms: f64,
    /// Dirty logging switched on for every memory slot.
    pub dirty_log_start_ms: f64,
    /// Finding the pages round 0 sends (those the guest ever touched).
    pub touched_ms: f64,
    /// The sender threads started.
    pub pipeline_start_ms: f64,
    /// Then waiting for `Ready`: the destination building the VM (the three phases before
    /// run while it builds).
    pub ready_ms: f64,
    /// The live rounds, summed (see each round's report): pages handed to the senders, the
    /// wire draining, the dirty log read, and the planner's decision with its throttle.
    pub send_ms: f64,
    pub drain_ms: f64,
    pub harvest_ms: f64,
    pub plan_ms: f64,
    /// Of `send_ms`: re-arming each batch's pages in the dirty log before they are read.
    #[serde(default)]
    pub rearm_ms: f64,
    /// Of `send_ms`: waiting for the bandwidth cap (`max_bandwidth`).
    #[serde(default)]
    pub cap_wait_ms: f64,
    /// The stop phase: the downtime (its parts in `stop_phase`).
    pub stop_ms: f64,
}

/// What a finished migration measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub engine: MigrationEngine,
    pub connections: usize,
    pub total_ms: f64,
    /// VM paused on the source until the destination said it runs it.
    pub downtime_ms: f64,
    pub rounds: Vec<RoundReport>,
    pub stop_reason: String,
    pub total_pages: u64,
    /// Of `total_pages`: those that held only zeros, sent as runs of page numbers.
    #[serde(default)]
    pub zero_pages: u64,
    /// Page data and state on the wire (zero pages count nothing), and its rate over `total_ms`.
    pub bytes: u64,
    pub mb_per_s: f64,
    /// CPU time of the migration's own threads on the source (user + system).
    pub sender_cpu_ms: f64,
    /// Zero-copy sends the kernel completed, and how many of those it copied anyway.
    pub zerocopy_completions: u64,
    pub zerocopy_copied: u64,
    /// (seconds into round 0, distinct pages dirtied so far): the dirty-page curve D(t),
    /// sampled every 50 ms while round 0 ran (empty if the VM cannot be sampled).
    #[serde(default)]
    pub round0_dirty_samples: Vec<(f64, u64)>,
    /// Where the downtime went.
    #[serde(default)]
    pub stop_phase: StopPhaseTimes,
    /// Where the whole migration's time went.
    #[serde(default)]
    pub phases: PhaseTimes,
    /// The planner's downtime estimate when it stopped pre-copy (none for `local`, or when no
    /// bandwidth had been measured).
    #[serde(default)]
    pub estimated_downtime_ms: Option<f64>,
    /// The highest vCPU throttle the migration applied, percent.
    #[serde(default)]
    pub max_throttle_percent: u8,
    /// The stop phase's cost as learned from this migration's measurements (each migration
    /// starts from the engine's prior).
    #[serde(default)]
    pub stop_phase_model: StopPhaseModel,
}

/// The stop phase measured on the source, from the pause request to the destination's
/// `Resumed`: the parts add up to the downtime.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StopPhaseTimes {
    /// Pausing the vCPUs (kick, park).
    pub pause_ms: f64,
    /// The last dirty-log harvest.
    pub harvest_ms: f64,
    /// Pages sent while paused.
    pub pages: u64,
    /// Sending them (the senders drained).
    pub pages_ms: f64,
    /// vCPU and device state: saving, encoding, sending.
    pub state_bytes: u64,
    pub state_ms: f64,
    /// From the state sent to `Resumed`: the destination's placement, restore and resume, and
    /// the reply's way back.
    pub reply_ms: f64,
}

/// How far a destination's incoming migration has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvStatus {
    /// `listening` (no source yet), `receiving` or `restoring`.
    pub phase: RecvPhase,
    pub pages: u64,
    pub bytes: u64,
    pub rounds: u64,
    /// Connections dropped because they were not a kumo source (junk, a port scan, a failed
    /// TLS handshake).
    #[serde(default)]
    pub rejected: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecvPhase {
    Listening,
    Receiving,
    Restoring,
}

/// The dirty-page model fitted to a migration, and its prediction next to the measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    pub fitted: bool,
    /// Why the model could not be fitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// What the fit used: round 0's samples of D(t), or the rounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fit_source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub m: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tau_s: Option<f64>,
    #[serde(default)]
    pub observations: Vec<(f64, f64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_pages_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Prediction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Comparison>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predict_error: Option<String>,
}

/// What a dry run predicts (`kumo migrate --dry-run`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DryRunReport {
    /// Always true: tells a dry run's answer from a migration's.
    pub dry_run: bool,
    pub m: f64,
    pub tau_s: f64,
    pub observations: Vec<(f64, f64)>,
    pub touched_pages: u64,
    pub bandwidth_pages_per_s: f64,
    pub predicted: Prediction,
}

/// A finished migration's report as the API gives it: the engine's measurements, the model,
/// where the VM went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendReport {
    #[serde(flatten)]
    pub report: Report,
    pub model: ModelReport,
    pub to: String,
    /// The user had paused the VM: it arrives paused.
    pub arrived_paused: bool,
}

/// What a migration request ended with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MigrationResult {
    DryRun(DryRunReport),
    Migrated(Box<SendReport>),
}

/// Where the last migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationState {
    None,
    Running,
    Completed,
    Failed,
    Cancelled,
    /// A destination: the VM is arriving (`received` says how far).
    Receiving,
    /// A destination: the VM arrived and runs here.
    Received,
}

/// Body of `GET /api/v1/vm.migration`, and of a successful `PUT /api/v1/vm.send-migration`:
/// the final status, so that a source that stops once its VM has moved still tells how the
/// migration ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub state: MigrationState,
    pub events: Vec<Event>,
    pub report: Option<MigrationResult>,
    #[serde(default)]
    pub error: Option<String>,
    /// A destination's incoming migration: pages and rounds so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received: Option<RecvStatus>,
}

/// One line of `GET /api/v1/vm.migration-events`: the migration's events as they come, then
/// its final status (without the events) as the last line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MigrationLine {
    Event(Event),
    End(MigrationStatus),
}
