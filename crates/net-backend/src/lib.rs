//! `kumo net-backend`: the NIC as its own process. It owns a tap and serves VMs over
//! vhost-user-net; several VMs attach at once, exactly one owns the NIC (link up, queues
//! served), and the NIC moves between them by handover (API/CLI) or failover (the owner's
//! connection closes). See docs/net-backend.md.

pub mod api;
pub mod backend;
pub mod cli;
pub mod nic;
pub mod server;

pub use nic::{HandoverError, HandoverReport, Info, Nic};
pub use server::Server;
