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
