//! Migration in the VMM: the VM as a migration source (`source.rs`: `SourceVm`, the API's
//! migration job, cancel, the dry run) and destination (`destination.rs`: `DestVm`, the
//! incoming migration of `kumo run --incoming`), the VM config as the stream's typed
//! description and back (`description.rs`); the status and reports the API answers with are
//! kumo-api's types.

mod description;
mod destination;
mod source;

pub use description::*;
pub use destination::*;
pub use source::*;

// The status and reports are API answers: their types live in kumo-api.
pub use kumo_api::{DryRunReport, MigrationResult, MigrationState, MigrationStatus, ModelReport, SendReport};
