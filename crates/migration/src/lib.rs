//! The pure core of kumo's live migration: no KVM and no I/O beyond
//! [`std::io::Read`]/[`std::io::Write`], so every piece is testable on its own.
//!
//! - [`format`](mod@format): the versioned, checksummed migration stream (docs/migration-format.md),
//!   with encoders for both copying and zero-copy senders.
//! - [`planner`]: pre-copy stop rules (Xen's and a downtime target) and bandwidth estimation.
//! - [`model`]: the dirty-page model `D(t) = M − M·(1/2)^(t/τ)` of the RDMA-migration paper
//!   (SEEDS §004): fitting it to measurements and predicting a whole pre-copy migration.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod format;
pub mod model;
pub mod planner;

pub use format::{
    read_header, write_header, Batch, BatchFrame, Checksum, Encoder, Error, Reader, Record, Reply, ReplyReader, Tag,
    VmDescription, Writer,
};
pub use model::{compare, predict, Comparison, DirtyModel, ModelError, PredictParams, Prediction};
pub use planner::{Decision, Planner, RoundStats, StopPolicy, StopReason, XenRule};
