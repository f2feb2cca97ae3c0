//! Architectural bits of x86 control registers, EFER and RFLAGS that kumo sets or checks.

pub const CR0_PE: u64 = 1;
pub const CR0_MP: u64 = 1 << 1;
pub const CR0_EM: u64 = 1 << 2;
pub const CR0_TS: u64 = 1 << 3;
pub const CR0_ET: u64 = 1 << 4;
pub const CR0_NE: u64 = 1 << 5;
pub const CR0_WP: u64 = 1 << 16;
pub const CR0_PG: u64 = 1 << 31;

pub const CR4_TSD: u64 = 1 << 2;
pub const CR4_PAE: u64 = 1 << 5;
pub const CR4_OSFXSR: u64 = 1 << 9;
pub const CR4_OSXMMEXCPT: u64 = 1 << 10;
pub const CR4_SMAP: u64 = 1 << 21;

pub const EFER_LME: u64 = 1 << 8;
pub const EFER_LMA: u64 = 1 << 10;

pub const RFLAGS_ZF: u64 = 1 << 6;
pub const RFLAGS_AC: u64 = 1 << 18;
/// OF, SF, ZF, AF, PF, CF.
pub const RFLAGS_ARITH: u64 = (1 << 11) | (1 << 7) | RFLAGS_ZF | (1 << 4) | (1 << 2) | 1;
