//! The pure core of kumo's live migration: no KVM and no I/O beyond
//! [`std::io::Read`]/[`std::io::Write`], so every piece is testable on its own.
//!
//! - [`bitmap`]: [`PageBitmap`], the set of guest pages pre-copy rounds send.
//! - [`engine`]: [`MigrationEngine`], how pages travel (one enum for the API, CLI and engines).
//! - [`format`](mod@format): the versioned, checksummed migration stream (docs/migration-format.md),
//!   with encoders for both copying and zero-copy senders.
//! - [`planner`]: pre-copy stop rules (Xen's and a downtime target), bandwidth estimation, the
//!   stop phase's cost model and the non-convergence policy (throttling, strict targets).
//! - [`stop_phase`]: the stop phase's fixed overhead, learned from measured stop phases.
//! - [`model`]: the dirty-page model `D(t) = M − M·(1/2)^(t/τ)` of the RDMA-migration paper
//!   (SEEDS §004): fitting it to measurements and predicting a whole pre-copy migration.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bitmap;
pub mod engine;
pub mod format;
pub mod model;
pub mod planner;
pub mod stop_phase;

/// xorshift64*: a deterministic random source for the tests, with no crate.
#[cfg(test)]
pub(crate) struct TestRng(pub u64);

#[cfg(test)]
impl TestRng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

pub use bitmap::PageBitmap;
pub use engine::MigrationEngine;
pub use format::{
    read_header, write_header, Batch, BatchFrame, Checksum, Encoder, Error, Reader, Record, Reply, ReplyReader, Tag,
    VmDescription, Writer,
};
pub use model::{compare, predict, Comparison, DirtyModel, ModelError, PredictParams, Prediction};
pub use planner::{
    Converge, Decision, DowntimeEstimate, GiveUpReason, Planner, RoundExtras, RoundStats, StopPolicy, StopReason,
    XenRule,
};
pub use stop_phase::{StopPhaseModel, StopPhaseSample};
