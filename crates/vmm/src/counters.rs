//! `vm.counters`: what a running VM has done so far, from counters its vCPUs and devices keep
//! as they go (atomics), so reading them never waits for a vCPU inside KVM_RUN.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use kumo_migration_engine::Event;
use kumo_vm::emulate::AssistKind;
use kumo_vm::ExitCounters;

use crate::migration::{MigrationResult, MigrationState, MigrationStatus};
use crate::vmm::RunningVm;

// The answer's types live in kumo-api.
pub use kumo_api::{Counters, Exits, Interrupts, MigrationBytes};

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

/// What a migration status says was moved, if a migration has run: the report's totals once
/// it ended, else the progress seen so far; and what a destination received.
pub fn migration_bytes(status: &MigrationStatus) -> Option<MigrationBytes> {
    if status.state == MigrationState::None {
        return None;
    }
    let (pages_sent, bytes_sent) = match &status.report {
        Some(MigrationResult::Migrated(r)) => (r.report.total_pages, r.report.bytes),
        _ => status
            .events
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Progress { total_pages_sent, total_bytes_sent, .. } => {
                    Some((*total_pages_sent, *total_bytes_sent))
                }
                _ => None,
            })
            .unwrap_or((0, 0)),
    };
    let (pages_received, bytes_received) = status.received.as_ref().map_or((0, 0), |r| (r.pages, r.bytes));
    Some(MigrationBytes { state: status.state, pages_sent, bytes_sent, pages_received, bytes_received })
}

/// The VM's counters; `migration` is the status of its migration job.
pub fn collect(vm: &RunningVm, migration: &MigrationStatus) -> Counters {
    let (exits, assists) = sum(vm.exit_counters());
    Counters {
        exits,
        assists,
        interrupts: Interrupts { serial: vm.serial_interrupts(), shared_path: vm.shared_path_injected() },
        net: vm.nics().into_iter().map(|n| (n.id, n.counters)).collect(),
        disks: vm.disks().into_iter().map(|d| (d.id, d.counters)).collect(),
        migration: migration_bytes(migration),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_migration_engine::{RecvPhase, RecvStatus};
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
    fn migration_bytes_come_from_the_progress_or_the_receiver() {
        let mut st =
            MigrationStatus { state: MigrationState::None, events: vec![], report: None, error: None, received: None };
        assert_eq!(migration_bytes(&st), None);
        st.state = MigrationState::Running;
        let progress = |pages: u64| Event::Progress {
            round: 0,
            round_pages: 100,
            pages_sent: pages,
            bytes_sent: pages * 4096,
            total_pages_sent: pages,
            total_bytes_sent: pages * 4096,
            mb_per_s: 1.0,
            eta_ms: None,
            estimated_downtime_ms: None,
        };
        st.events = vec![progress(3), progress(5)];
        let m = migration_bytes(&st).unwrap();
        assert_eq!((m.pages_sent, m.bytes_sent, m.pages_received), (5, 5 * 4096, 0));
        st.state = MigrationState::Received;
        st.events.clear();
        st.received =
            Some(RecvStatus { phase: RecvPhase::Restoring, pages: 7, bytes: 7 * 4096, rounds: 2, rejected: 0 });
        let m = migration_bytes(&st).unwrap();
        assert_eq!((m.pages_sent, m.pages_received, m.bytes_received), (0, 7, 7 * 4096));
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
