//! kumo-migration-engine: moves a running VM to another kumo. The stream format, stop rules
//! and dirty-page model are in `kumo-migration` (pure); this crate adds the I/O: transports
//! (TCP, mutual TLS, unix sockets with fd passing, MSG_ZEROCOPY), the destination's vetting of
//! connections (`accept`) and the pre-copy sessions and engines:
//! `session` (what both sides share), `source` (pre-copy, engines' senders), `destination`
//! (the receiver), `control` (cancel, bandwidth cap), `transport`.
//! The VM is reached through the `SourceVm`/`DestVm` traits, so this crate does not depend on
//! how a VMM runs vCPUs.

pub mod accept;
pub mod control;
pub mod destination;
mod linger;
pub mod session;
pub mod source;
pub mod tls;
pub mod transport;

#[cfg(test)]
mod tests;

pub use accept::{AcceptLimits, MAX_BAD_CONNECTIONS};
pub use control::{CancelError, CancelToken};
pub use destination::{receive, receive_limited, receive_with, RecvPhase, RecvProgress, RecvReport, RecvStatus};
pub use session::{
    BoxError, DestVm, Event, MigrateError, MigrateOptions, MigrationEngine, PhaseTimes, Report, RoundReport, SourceVm,
    StopPhaseTimes, VmError, VmOp, HANDSHAKE_TIMEOUT, PROGRESS_INTERVAL, PROGRESS_TIMEOUT, STOP_PHASE_PRIOR,
};
pub use source::migrate;
pub use tls::{ClientTls, ServerTls};
pub use transport::{Address, Conn, ListenOptions, Listener};
