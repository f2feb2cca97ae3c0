//! kumo-vm: the KVM edge of kumo. Almost all of kumo's `unsafe` lives here, at the KVM and
//! memory boundary. By concern:
//! - the VM and its vCPUs: `vm` (VM fd, irqchip, VM-wide state, the host's limits on a VM's
//!   shape), `vcpu` (exit handling, which dispatches port I/O and MMIO to
//!   `kumo_devices::Buses`), `cpuid`, `state` (saved state, through the persist pattern of
//!   `kumo_devices::persist`);
//! - interrupts: `interrupts` (the irqchip mode, GSI allocation, GSI routes with MSI, irqfd,
//!   ioeventfd, an MSI sent by the VMM);
//! - memory: `memory` (memfd-backed guest RAM), `layout` (the `MemoryLayout` and fixed boot
//!   addresses), `dirty` (dirty logging for migration);
//! - boot: `boot` (GDT, TSS, page tables, entry registers) and its Linux loader `boot::linux`;
//! - host scheduling: `sched` (a thread's host CPUs and real-time priority, as system calls);
//!   where a VM's threads run is decided in `kumo_vmm::placement`;
//! - paravirtual features: `pv` (the guest's KVM PV CPUID leaf, `--pv` requests);
//! - emulation assists: `emulate` (the one x86 decoder and what kumo carries out when nested KVM
//!   cannot).

pub mod boot;
pub mod cpuid;
pub mod dirty;
pub mod emulate;
pub mod interrupt_paths;
pub mod interrupts;
pub mod layout;
pub mod memory;
pub mod pv;
pub mod sched;
pub mod state;
pub mod uapic;
pub mod vcpu;
pub mod vm;
pub mod x86;

#[cfg(test)]
mod testing;

pub use boot::{linux, Entry, KumoBootInfo};
pub use memory::{parse_size, GuestMemory, Memory};
pub use state::{VcpuState, VmState};
pub use vcpu::{ExitCounters, Vcpu, VcpuRun};
pub use vm::{IrqchipMode, PreparedVm, Vm};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open /dev/kvm: {0} (is KVM available and are you allowed to use it?)")]
    NoKvm(std::io::Error),
    #[error("KVM lacks a capability kumo needs: {0}")]
    MissingCap(&'static str),
    #[error("{0}: {1}")]
    Kvm(&'static str, vmm_sys_util::errno::Error),
    #[error("memory {} is not supported: give a multiple of 4 KiB, at least 8 MiB", memory::human_size_exact(*.0))]
    BadMemorySize(u64),
    #[error("memory {} is more than this host can back ({} usable of {})", memory::human_size(*size), memory::human_size(*usable), memory::human_size(*total))]
    MemoryTooLarge { size: u64, usable: u64, total: u64 },
    #[error("{0} vCPUs requested; this host supports 1 to {1}")]
    BadVcpuCount(u32, u32),
    #[error("cpus must be at least 1")]
    NoVcpus,
    #[error("cpus {0} exceeds kumo's limit of {max}", max = layout::MAX_VCPUS)]
    AboveKumoVcpuLimit(u32),
    #[error("cpus {0} exceeds this host's KVM limit of {1} vCPUs (KVM_CAP_MAX_VCPUS)")]
    AboveKvmVcpuLimit(u32, u32),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("boot setup: {0}")]
    Boot(String),
    #[error("vCPU {cpu}: KVM could not emulate the instruction at RIP {rip:#x} (bytes: {bytes}{what}); this host's nested KVM cannot run it in guest ring 0")]
    EmulationFailure { cpu: u32, rip: u64, bytes: String, what: String },
    #[error("vCPU {cpu}: KVM internal error (suberror {suberror}) at RIP {rip:#x}")]
    InternalError { cpu: u32, suberror: u32, rip: u64 },
    #[error("vCPU {cpu}: KVM failed to enter the guest (hardware reason {reason:#x})")]
    FailEntry { cpu: u32, reason: u64 },
    #[error("vCPU {cpu} touched guest-physical address {gpa:#x} in {what}: the guest used memory it no longer has")]
    FencedAccess { cpu: u32, gpa: u64, what: String },
    #[error(
        "vCPU {cpu}: KVM could not fault in guest-physical address {gpa:#x} (KVM_EXIT_MEMORY_FAULT, flags {flags:#x})"
    )]
    MemoryFault { cpu: u32, gpa: u64, flags: u64 },
    #[error("vCPU {cpu}: KVM could not reach the guest memory the instruction at RIP {rip:#x} accessed (EFAULT); the guest may have touched memory it no longer has (a released elastic block)")]
    UnreachableMemory { cpu: u32, rip: u64 },
    #[error("vCPU {cpu}: unexpected exit {exit}")]
    UnexpectedExit { cpu: u32, exit: String },
    #[error("state restore: {0}")]
    Restore(String),
    #[error(transparent)]
    Linux(#[from] linux::LinuxError),
    #[error("interrupts: {0}")]
    Irq(#[from] interrupts::IrqError),
}

pub type Result<T> = std::result::Result<T, Error>;
