//! kumo-vmm: builds a VM from a `VmConfig`, runs one thread per vCPU, and controls it: pause,
//! resume, save and restore state, shut down. The control API and the CLI sit on top.
//! - `vmm`: `RunningVm` and its build phases (boot, incoming); `vcpu_manager`: the vCPU threads
//!   and their run state (pause, park, kick, throttle, pins);
//! - `device_manager`: the devices, their buses and interrupt wiring; `event_loop`: the device
//!   event thread; `pci`: PCI bus 0 and BAR placement; `nic`: a virtio-net NIC on a tap;
//! - `persist`: the `Snapshot` every component saves into;
//! - `snapshot`: snapshots to and restores from files; `counters`: the VM's counters;
//!   `event_monitor`: the lifecycle event monitor;
//! - `placement`: where the VM sits on this host (seed 002): guest NUMA nodes, `--numa mirror`,
//!   vCPU pins, the PV defaults they imply, halt polling, real-time priority;
//! - `host_resources`: what an arriving VM's NICs and NUMA nodes get on this host;
//! - `config`, `api` (the control API's handler), `migration` (source and destination sides);
//! - `guest_program`: a kumo guest program as an ELF image and command line (the VMM links no
//!   guests; the `kumo` CLI resolves `--guest NAME`);
//! - `lifecycle`: an empty VMM, which its API tells to restore a snapshot or receive a VM.

pub mod acpi;
pub mod api;
pub mod ch_config;
pub mod config;
pub mod counters;
pub mod cpu_hotplug;
pub mod device_manager;
pub mod disk;
pub mod elastic;
pub mod event_loop;
pub mod event_monitor;
pub mod guest_program;
pub mod host_resources;
pub mod lifecycle;
pub mod migration;
pub mod nic;
pub mod nic_vhost_user;
pub mod panics;
pub mod pci;
pub mod persist;
pub mod placement;
pub mod pty;
pub mod snapshot;
pub mod vcpu_manager;
pub mod virtio_mem;
pub mod virtio_pci;
pub mod vmm;

pub use config::{ConfigFile, DiskSpec, NetSpec, NumaConfig, Payload, VmConfig, DEFAULT_LINUX_CMDLINE};
pub use guest_program::GuestProgram;
pub use vcpu_manager::{monotonic_ns, Outcome, Timings};
pub use vmm::{RunReport, RunningVm, Snapshot};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("config: {0}")]
    Config(String),
    /// A guest program's own check failed (`guest_program::GuestCheck`).
    #[error("{0}")]
    Guest(String),
    #[error(transparent)]
    Vm(#[from] kumo_vm::Error),
    #[error("loading guest program: {0}")]
    Load(String),
    #[error("the VM is {0}")]
    State(&'static str),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("devices: {0}")]
    Devices(String),
    #[error("state: {0}")]
    Persist(#[from] kumo_devices::PersistError),
    #[error(transparent)]
    Acpi(#[from] kumo_acpi::AcpiError),
}

pub type Result<T> = std::result::Result<T, Error>;
