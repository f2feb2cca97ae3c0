//! Emulation assists: what kumo does when this project's nested KVM stops a vCPU on an
//! instruction it cannot emulate in guest ring 0 (KVM_EXIT_INTERNAL_ERROR, emulation). Owns the
//! one x86 decoder (`decode`) and the assists' semantics (`assist`); `crate::vcpu` calls them
//! from its exit handling and gives them the vCPU's registers and memory.

pub mod assist;
pub mod decode;

pub use assist::{AssistCounts, AssistKind};
