//! `vm.counters`: what a running VM has done so far, from counters its vCPUs and devices keep
//! as they go (atomics), so reading them never waits for a vCPU inside KVM_RUN.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use kumo_vm::emulate::AssistKind;
use kumo_vm::ExitCounters;
use serde::Serialize;
use serde_json::Value;

use crate::vmm::RunningVm;

/// vCPU exits by reason, summed over the vCPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Exits {
    /// Port I/O (the serial console, the exit port).
    pub io: u64,
    /// MMIO (no device answers MMIO yet: reads see 0xff).
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Interrupts {
    /// COM1's interrupts (signals of its irqfd).
    pub serial: u64,
}

/// Body of `GET /api/v1/vm.counters`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counters {
    pub exits: Exits,
    /// Instructions kumo carried out after KVM failed to emulate them, by kind (all kinds,
    /// zero included).
    pub assists: BTreeMap<String, u64>,
    pub interrupts: Interrupts,
    /// Bytes of the last migration from this VM, if one ran (`vm.migration`'s report).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationBytes>,
}

/// What the last outgoing migration sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MigrationBytes {
    pub state: String,
    pub pages_sent: u64,
    pub bytes_sent: u64,
}

/// Sums the vCPUs' counters.
pub fn sum(vcpus: &[impl AsRef<ExitCounters>]) -> (Exits, BTreeMap<String, u64>) {
    let mut e = Exits::default();
    let mut assists: BTreeMap<String, u64> = AssistKind::ALL.iter().map(|k| (k.name().to_string(), 0)).collect();
    for c in vcpus {
        let c = c.as_ref();
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        e.io += get(&c.io);
        e.mmio += get(&c.mmio);
        e.hlt += get(&c.hlt);
        e.shutdown += get(&c.shutdown);
        e.intr += get(&c.intr);
        e.other += get(&c.other);
        for (k, n) in AssistKind::ALL.iter().zip(&c.assists) {
            *assists.entry(k.name().to_string()).or_default() += get(n);
        }
    }
    e.total = e.io + e.mmio + e.hlt + e.shutdown + e.intr + e.other;
    (e, assists)
}

/// What a migration status (`MigrationJob::status`) says was sent, if a migration has run:
/// the report's totals once it ended, else the pages of the rounds seen so far.
pub fn migration_bytes(status: &Value) -> Option<MigrationBytes> {
    let state = status["state"].as_str().filter(|s| *s != "none")?.to_string();
    let report = &status["report"];
    if let Some(pages) = report["total_pages"].as_u64() {
        let bytes = report["bytes"].as_u64().unwrap_or(pages * 4096);
        return Some(MigrationBytes { state, pages_sent: pages, bytes_sent: bytes });
    }
    let pages: u64 = status["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["event"] == "round")
        .filter_map(|e| e["pages_sent"].as_u64())
        .sum();
    Some(MigrationBytes { state, pages_sent: pages, bytes_sent: pages * 4096 })
}

/// The VM's counters; `migration` is the status of its migration job.
pub fn collect(vm: &RunningVm, migration: Option<&Value>) -> Counters {
    let (exits, assists) = sum(vm.exit_counters());
    Counters {
        exits,
        assists,
        interrupts: Interrupts { serial: vm.serial_interrupts() },
        migration: migration.and_then(migration_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    #[test]
    fn exits_and_assists_are_summed_over_vcpus() {
        let a = Arc::new(ExitCounters::default());
        let b = Arc::new(ExitCounters::default());
        a.io.store(3, Ordering::Relaxed);
        b.io.store(4, Ordering::Relaxed);
        b.hlt.store(1, Ordering::Relaxed);
        a.intr.store(2, Ordering::Relaxed);
        b.assists[0].store(5, Ordering::Relaxed);
        let (e, assists) = sum(&[a, b]);
        assert_eq!(e, Exits { io: 7, hlt: 1, intr: 2, total: 10, ..Default::default() });
        assert_eq!(assists[AssistKind::ALL[0].name()], 5);
        assert_eq!(assists.len(), AssistKind::ALL.len(), "every kind is listed");
    }

    #[test]
    fn migration_bytes_come_from_the_report_or_the_rounds() {
        assert_eq!(migration_bytes(&json!({"state": "none", "events": []})), None);
        let done = json!({"state": "completed", "events": [], "report": {"total_pages": 10, "bytes": 50000}});
        assert_eq!(
            migration_bytes(&done),
            Some(MigrationBytes { state: "completed".into(), pages_sent: 10, bytes_sent: 50000 })
        );
        let running = json!({"state": "running", "report": null,
            "events": [{"event": "started"}, {"event": "round", "pages_sent": 3}, {"event": "round", "pages_sent": 2}]});
        assert_eq!(migration_bytes(&running).map(|m| m.pages_sent), Some(5));
    }

    #[test]
    fn the_json_has_the_documented_fields() {
        let v = serde_json::to_value(Counters::default()).unwrap();
        for k in ["io", "mmio", "hlt", "shutdown", "intr", "other", "total"] {
            assert!(v["exits"][k].is_u64(), "{k}");
        }
        assert!(v["interrupts"]["serial"].is_u64());
        assert!(v.get("migration").is_none(), "left out when no migration ran");
    }
}
