//! kumo-devices: the emulated devices of a kumo VM and the buses (port I/O, MMIO) that dispatch
//! vCPU exits to them.
//!
//! Devices know nothing of KVM or migration: they see bus reads and writes, raise interrupts
//! through eventfds, report events (a guest asking to exit, a timing marker) to whoever runs the
//! vCPU, and save their state through the one persist pattern (`persist`), which the vCPUs and
//! the VM-wide state in `kumo-vm` use as well.

pub mod acpi_ged;
pub mod acpi_sleep;
pub mod apic;
pub mod bus;
pub mod debug_port;
pub mod pci;
pub mod persist;
pub mod serial;
pub mod virtio;

pub use acpi_ged::AcpiGed;
pub use acpi_sleep::{AcpiSleep, S5_SLEEP_TYPE, SLEEP_PORT, SLEEP_PORT_LEN};
pub use bus::{Bus, BusDevice, BusError, BusKind, Buses, SharedDevice};
pub use debug_port::{DebugPort, EXIT_PORT, MARKER_PORT};
pub use persist::{DeviceState, DeviceStateKind, DeviceStates, Persist, PersistDyn, PersistError, VirtioFunctionState};
pub use serial::{SerialConsole, SerialSnapshot, COM1_IRQ, COM1_PORT};

/// Something a device write asks the VMM to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The guest finished and asks the VM to stop with this exit code.
    GuestExit(u32),
    /// The guest reached a point it wants timed (see `debug_port`).
    Marker(u8),
    /// The guest's ACPI `_EJ0` ejected this vCPU (see `acpi_ged`): kumo parks its thread.
    CpuEjected(u32),
    /// The guest entered ACPI S5 through the sleep control register (see `acpi_sleep`).
    PowerOff,
}
