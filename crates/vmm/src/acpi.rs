//! Gives a new VM its ACPI tables (`kumo-acpi`) and tells a Linux payload where they are.

use kumo_acpi::{AcpiConfig, Ged, NumaTopology, PciHost, SleepRegisters};
use kumo_devices::acpi_ged::{GED_GSI, GED_MMIO_BASE};
use kumo_devices::{S5_SLEEP_TYPE, SLEEP_PORT};
use kumo_vm::linux::{set_acpi_rsdp, LinuxEntry};
use kumo_vm::{Entry, Vm};

use crate::device_manager::DeviceManager;
use crate::Result;

/// Writes the tables for `vm` (its vCPUs, irqchip, PCI host bridge, its GED if it has one and,
/// with `numa`, its NUMA nodes) and, when vCPU 0 enters Linux (`entry`), puts the RSDP address in its boot
/// parameters. kumo's own guests find the RSDP by the legacy scan of 0xE0000–0xFFFFF.
/// `hotplug`: the memory zones' regions, as hot-pluggable SRAT entries.
pub fn install(
    vm: &Vm,
    devices: &DeviceManager,
    entry: Option<Entry>,
    numa: Option<&NumaTopology>,
    hotplug: &[kumo_acpi::HotplugMemory],
) -> Result<()> {
    let pci = devices.pci();
    let cfg = AcpiConfig {
        cpus: vm.ncpus,
        layout: &vm.memory.layout,
        irqchip: vm.irqchip,
        pci: Some(PciHost { ecam_base: pci.ecam_base(), mmio32: pci.bar_window() }),
        numa,
        ged: devices.ged().map(|_| Ged { mmio_base: GED_MMIO_BASE, gsi: GED_GSI }),
        sleep: Some(SleepRegisters { port: SLEEP_PORT, s5_type: S5_SLEEP_TYPE }),
    };
    let rsdp = kumo_acpi::write_with_hotplug(&vm.memory.guest, &cfg, hotplug)?;
    let linux = match entry {
        Some(Entry::Linux64 { rip, boot_params }) => Some(LinuxEntry::BzImage64 { entry: rip, boot_params }),
        Some(Entry::Pvh { rip, start_info }) => Some(LinuxEntry::Pvh { entry: rip, start_info }),
        _ => None,
    };
    if let Some(l) = linux {
        set_acpi_rsdp(&vm.memory.guest, &l, rsdp).map_err(kumo_vm::Error::from)?;
    }
    Ok(())
}
