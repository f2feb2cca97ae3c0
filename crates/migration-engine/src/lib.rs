//! kumo-migration-engine: moves a running VM to another kumo. The stream format, stop rules
//! and dirty-page model are in `kumo-migration` (pure); this crate adds the I/O: transports
//! (TCP, unix sockets with fd passing, MSG_ZEROCOPY) and the pre-copy sessions and engines.
//! The VM is reached through the `SourceVm`/`DestVm` traits, so this crate does not depend on
//! how a VMM runs vCPUs.

pub mod control;
pub mod session;
pub mod transport;

#[cfg(test)]
mod tests;

pub use control::{CancelError, CancelToken};
pub use session::{
    migrate, receive, receive_with, BoxError, DestVm, EngineKind, Event, MigrateError, MigrateOptions, RecvPhase,
    RecvProgress, RecvReport, RecvStatus, Report, RoundReport, SourceVm, StopPhaseTimes, VmError, VmOp,
    HANDSHAKE_TIMEOUT, PROGRESS_INTERVAL, PROGRESS_TIMEOUT, STOP_PHASE_PRIOR,
};
pub use transport::{Address, Conn, Listener};
