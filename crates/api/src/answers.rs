//! Answers of the VM routes that are not migration's: counters, snapshots, restores, lends.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{Acquired, MigrationState, NetCounters, Released};

/// vCPU exits by reason, summed over the vCPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exits {
    /// Port I/O (the serial console, the exit port).
    pub io: u64,
    /// MMIO (dispatched to the MMIO bus; unclaimed reads see all ones).
    pub mmio: u64,
    /// HLT that KVM handed to kumo (only without an in-kernel LAPIC).
    pub hlt: u64,
    /// Triple faults.
    pub shutdown: u64,
    /// KVM_RUN interrupted by kumo's kick signal (pause, stop, throttle).
    pub intr: u64,
    /// Every other exit (emulation failures and assists, system events, IRQ windows, ...).
    pub other: u64,
    pub total: u64,
}

/// Interrupts kumo's devices raised.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interrupts {
    /// COM1's interrupts (signals of its irqfd).
    pub serial: u64,
    /// Interrupts the shared path's dispatcher thread injected (seed 000), if a NIC uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_path: Option<u64>,
}

/// Body of `GET /api/v1/vm.counters`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub exits: Exits,
    /// Instructions kumo carried out after KVM failed to emulate them, by kind (all kinds,
    /// zero included).
    pub assists: BTreeMap<String, u64>,
    pub interrupts: Interrupts,
    /// Each NIC's frame and interrupt counts, by id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub net: BTreeMap<String, NetCounters>,
    /// Each disk's request counts, by id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disks: BTreeMap<String, crate::DiskCounters>,
    /// Bytes of the last migration from this VM, if one ran (`vm.migration`'s report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationBytes>,
}

/// What the last migration sent from here, or brought here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationBytes {
    pub state: MigrationState,
    pub pages_sent: u64,
    pub bytes_sent: u64,
    pub pages_received: u64,
    pub bytes_received: u64,
}

/// Answer to `PUT /api/v1/vm.snapshot`: what a snapshot wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReport {
    pub path: PathBuf,
    /// Guest pages in the file.
    pub pages: u64,
    /// Size of the file.
    pub bytes: u64,
    /// Size of the serialized vCPU, irqchip and device state.
    pub state_bytes: u64,
    /// How long the VM was paused for it (ms).
    pub paused_ms: f64,
    /// The user had paused the VM: it stays paused, and a restore starts it paused.
    pub paused: bool,
}

/// Answer to `PUT /api/v1/vm.restore`: what a restore ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreReport {
    pub path: PathBuf,
    /// It was saved paused, so it waits paused for `vm.resume`.
    pub paused: bool,
    /// Guest pages read from the file.
    pub pages: u64,
}

/// Answer to `PUT /api/v1/vm.lend`: a completed lend (or return).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LendReport {
    pub released: Released,
    pub acquired: Acquired,
    /// From the command to the borrower's confirmation, milliseconds.
    pub total_ms: f64,
}
