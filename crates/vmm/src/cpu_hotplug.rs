//! `vm.resize`: the guest gives vCPUs up or takes them back through ACPI CPU hotplug (the GED
//! and `\_SB.CPUS`, `kumo_devices::acpi_ged`; docs/elastic.md "CPU lending for Linux guests").
//!
//! Removal: kumo marks each vCPU above the desired count "remove pending" and interrupts the
//! guest through the GED; the guest's `CSCN` sends the OS an Eject Request for it; Linux
//! offlines the CPU by itself (no userspace involved) and runs `_EJ0`, whose register write
//! makes the vCPU that ran it ask kumo to park the ejected vCPU's thread. kumo waits (bounded)
//! for the eject and for the thread to be parked.
//!
//! Addition: kumo lets the thread run again (the CPU sits where Linux left it, offline, until
//! the OS starts it with INIT/SIPI), marks it enabled with "insert pending" and interrupts; the
//! guest's `CSCN` sends a Device Check. Linux then registers the CPU but leaves it offline:
//! onlining it takes userspace (`echo 1 > /sys/devices/system/cpu/cpuN/online`, or a udev rule).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kumo_devices::acpi_ged::{self, AcpiGed, HotplugError};
use kumo_sandbox::lock;

use crate::vcpu_manager::VcpuManager;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResizeError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Timeout(String),
}

impl From<HotplugError> for ResizeError {
    fn from(e: HotplugError) -> Self {
        match e {
            HotplugError::Interrupt(_) => ResizeError::Conflict(e.to_string()),
            _ => ResizeError::BadRequest(e.to_string()),
        }
    }
}

/// Resizes the guest to `desired` vCPUs: ejects the enabled ones from `desired` up, gives the
/// ejected ones below it back; waits up to `limit` for the guest.
pub fn resize(
    vcpus: &VcpuManager,
    ged: &Arc<Mutex<AcpiGed>>,
    desired: u32,
    limit: Duration,
) -> Result<(), ResizeError> {
    let n = vcpus.count();
    if desired == 0 || desired > n {
        return Err(ResizeError::BadRequest(format!("desired_vcpus must be 1..={n} (the VM's vCPUs), not {desired}")));
    }
    vcpus.check_running().map_err(ResizeError::Conflict)?;
    let mut g = lock(ged);
    let remove: Vec<u32> = (desired..n).filter(|&v| g.cpus()[v as usize].enabled).collect();
    let add: Vec<u32> = (1..desired).filter(|&v| !g.cpus()[v as usize].enabled).collect();
    for &v in &add {
        // Runnable before the guest learns of it: the OS may send it INIT/SIPI at once.
        vcpus.unpark(v);
        g.request_insert(v)?;
    }
    for &v in &remove {
        g.request_remove(v)?;
    }
    let (g, done) = acpi_ged::wait_for(g, limit, |d| {
        let c = d.cpus();
        remove.iter().all(|&v| !c[v as usize].enabled) && add.iter().all(|&v| !c[v as usize].inserting)
    });
    if !done {
        let c = g.cpus();
        let left: Vec<u32> = remove.iter().copied().filter(|&v| c[v as usize].enabled).collect();
        let unseen: Vec<u32> = add.iter().copied().filter(|&v| c[v as usize].inserting).collect();
        return Err(ResizeError::Timeout(format!(
            "the guest did not answer within {} ms: vCPUs {left:?} not ejected, vCPUs {unseen:?} not scanned",
            limit.as_millis()
        )));
    }
    drop(g);
    for &v in &remove {
        vcpus.park(v).map_err(ResizeError::Conflict)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vcpu_manager::{for_tests, VcpuRunState};
    use kumo_devices::acpi_ged::{CPU_EJECT, CPU_INSERTING, CPU_REMOVING, REG_CPU_SELECT, REG_CPU_STATUS};
    use kumo_devices::{BusDevice, DeviceEvent};
    use vmm_sys_util::eventfd::EventFd;

    fn ged(n: u32) -> Arc<Mutex<AcpiGed>> {
        Arc::new(Mutex::new(AcpiGed::new(n, EventFd::new(libc::EFD_NONBLOCK).unwrap())))
    }

    /// What the guest's AML does for vCPU `v` once interrupted: `CSCN` acknowledges `ack`,
    /// then (for a removal) the OS runs `_EJ0`. Waits for the interrupt first.
    fn guest(g: &Arc<Mutex<AcpiGed>>, v: u32, ack: u8, eject: bool) -> Option<DeviceEvent> {
        loop {
            let mut d = lock(g);
            let mut ev = [0u8; 4];
            d.read(0, &mut ev);
            if ev != [0; 4] {
                d.write(REG_CPU_SELECT, &v.to_le_bytes());
                d.write(REG_CPU_STATUS, &[ack]);
                return if eject { d.write(REG_CPU_STATUS, &[CPU_EJECT]) } else { None };
            }
            drop(d);
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_guest_that_ejects_gets_its_vcpu_parked_and_back() {
        // Parked already: for_tests has no threads to park (the eject's request_park does it).
        let m = for_tests(2, VcpuRunState::Parked);
        let g = ged(2);
        std::thread::scope(|s| {
            let t = s.spawn(|| guest(&g, 1, CPU_REMOVING, true));
            resize(&m, &g, 1, Duration::from_secs(60)).unwrap();
            assert_eq!(t.join().unwrap(), Some(DeviceEvent::CpuEjected(1)));
        });
        assert!(!lock(&g).cpus()[1].enabled);
        std::thread::scope(|s| {
            let t = s.spawn(|| guest(&g, 1, CPU_INSERTING, false));
            resize(&m, &g, 2, Duration::from_secs(60)).unwrap();
            t.join().unwrap();
        });
        assert!(lock(&g).cpus()[1].enabled);
    }

    /// The e2e test's failure mode when the eject request never reaches the OS: no `_EJ0`.
    #[test]
    fn a_guest_that_never_ejects_times_out_and_the_request_stays() {
        let m = for_tests(2, VcpuRunState::Running);
        let g = ged(2);
        let e = resize(&m, &g, 1, Duration::from_millis(50)).unwrap_err();
        assert!(matches!(&e, ResizeError::Timeout(m) if m.contains("vCPUs [1] not ejected")), "{e}");
        assert!(lock(&g).cpus()[1].removing && lock(&g).cpus()[1].enabled);
    }

    #[test]
    fn counts_outside_the_vm_are_refused() {
        let m = for_tests(2, VcpuRunState::Running);
        let g = ged(2);
        for n in [0, 3] {
            assert!(matches!(resize(&m, &g, n, Duration::ZERO), Err(ResizeError::BadRequest(_))), "{n}");
        }
        resize(&m, &g, 2, Duration::ZERO).unwrap();
    }
}
