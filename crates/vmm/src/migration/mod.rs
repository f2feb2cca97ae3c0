//! Migration in the VMM: the VM as a migration source (`source.rs`: `SourceVm`, the API's
//! migration job, cancel, the dry run) and destination (`destination.rs`: `DestVm`, the
//! incoming migration of `kumo run --incoming`), the VM config as the stream's typed
//! description and back (`description.rs`), and the typed status and report the API
//! answers with (here).

mod description;
mod destination;
mod source;

pub use description::*;
pub use destination::*;
pub use source::*;

use kumo_migration::model::{Comparison, Prediction};
use kumo_migration_engine::{Event, RecvStatus, Report};
use serde::{Deserialize, Serialize};

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
