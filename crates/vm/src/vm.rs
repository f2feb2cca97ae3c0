//! A KVM VM: its file descriptor, guest memory, irqchip and VM-wide state.

use std::fs::OpenOptions;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::Arc;

use kumo_devices::{Persist, PersistError};
use kvm_bindings::{
    kvm_enable_cap, kvm_irqchip, kvm_pit_config, kvm_userspace_memory_region, KVM_CAP_SPLIT_IRQCHIP,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::interrupts::Interrupts;
use crate::layout::KVM_TSS_ADDRESS;
use crate::memory::Memory;
use crate::state::VmState;
use crate::uapic::UserApics;
use crate::vcpu::Vcpu;
use crate::{Error, Result};

/// Where the interrupt controllers live (defined beside the routing it shapes).
pub use crate::interrupts::IrqchipMode;

pub struct Vm {
    pub kvm: Kvm,
    pub fd: Arc<VmFd>,
    pub memory: Memory,
    pub irqchip: IrqchipMode,
    /// GSI routing, irqfds and ioeventfds: the only way devices' interrupts reach KVM.
    pub interrupts: Arc<Interrupts>,
    pub ncpus: u32,
    /// `--irqchip user`: kumo's APICs, one per vCPU.
    pub uapic: Option<Arc<UserApics>>,
    msr_list: Arc<Vec<u32>>,
    /// Whether KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 is enabled (see `dirty`).
    pub(crate) dirty_manual: std::sync::atomic::AtomicBool,
    /// Whether it is enabled with KVM_DIRTY_LOG_INITIALLY_SET (see `dirty`).
    pub(crate) dirty_initially_set: std::sync::atomic::AtomicBool,
    /// Round 0's sample pages with INITIALLY_SET: armed from its start (see `dirty`).
    pub(crate) dirty_sample: std::sync::Mutex<Option<Sample>>,
}

/// Round 0's sample pages under INITIALLY_SET (`dirty`): the first page of every 64 that
/// round 0 sends, armed at its start and not re-armed by its batches, so that their dirty bits
/// measure the pages dirtied since round 0 began. A sample page written before its batch goes
/// is sent again in round 1: at most 1/64 of the pages.
pub struct Sample {
    pub(crate) pages: kumo_migration::PageBitmap,
    /// Pages round 0 sends per sample page.
    pub(crate) scale: f64,
}

/// The part of a VM that depends only on its memory: the KVM VM with guest memory in its
/// slots. Registering the slots costs time in proportion to the memory (~4-5 ms for 512 MiB
/// on this project's nested hosts), so a migration destination prepared in advance makes this
/// before the migration arrives; [`Vm::from_prepared`] finishes it once the stream says which
/// irqchip and how many vCPUs.
pub struct PreparedVm {
    kvm: Kvm,
    fd: VmFd,
    memory: Memory,
}

impl PreparedVm {
    pub fn new(memory: Memory) -> Result<Self> {
        Self::on(open_kvm()?, memory)
    }

    fn on(kvm: Kvm, memory: Memory) -> Result<Self> {
        let fd = kvm.create_vm().map_err(|e| Error::Kvm("KVM_CREATE_VM", e))?;
        for (slot, region) in memory.guest.iter().enumerate() {
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the region is a live mapping owned by `memory`, which the VM keeps for as
            // long as the VM fd exists (this value, then the Vm), and regions do not overlap.
            unsafe { fd.set_user_memory_region(r) }.map_err(|e| Error::Kvm("KVM_SET_USER_MEMORY_REGION", e))?;
        }
        Ok(PreparedVm { kvm, fd, memory })
    }

    pub fn memory(&self) -> &Memory {
        &self.memory
    }
}

/// Opens /dev/kvm with a clear error when it is absent or not accessible.
pub fn open_kvm() -> Result<Kvm> {
    let f = OpenOptions::new().read(true).write(true).open("/dev/kvm").map_err(Error::NoKvm)?;
    // SAFETY: the descriptor was just opened on /dev/kvm and ownership moves into Kvm.
    Ok(unsafe { Kvm::from_raw_fd(f.into_raw_fd()) })
}

/// KVM_CAP_MAX_VCPUS of this host, or `None` if /dev/kvm cannot be opened.
pub fn kvm_max_vcpus() -> Option<u32> {
    open_kvm().ok().map(|k| u32::try_from(k.get_max_vcpus()).unwrap_or(u32::MAX))
}

/// True if /dev/kvm can be opened: tests that need KVM skip when it cannot.
pub fn kvm_available() -> bool {
    open_kvm().is_ok()
}

/// What this host allows a VM: the memory it can back and KVM's vCPU limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLimits {
    pub memory: crate::memory::HostMemory,
    /// KVM_CAP_MAX_VCPUS; `None` where /dev/kvm cannot be opened (building the VM then fails
    /// with that error).
    pub kvm_max_vcpus: Option<u32>,
}

impl HostLimits {
    /// Reads /proc/meminfo and asks KVM: cheap, nothing is allocated.
    pub fn probe() -> Result<HostLimits> {
        Ok(HostLimits { memory: crate::memory::HostMemory::read()?, kvm_max_vcpus: kvm_max_vcpus() })
    }
}

/// vCPUs: at least 1, at most [`MAX_VCPUS`](crate::layout::MAX_VCPUS) and KVM's limit (if known).
pub fn check_vcpus(cpus: u32, kvm_max: Option<u32>) -> Result<()> {
    if cpus == 0 {
        return Err(Error::NoVcpus);
    }
    if cpus > crate::layout::MAX_VCPUS {
        return Err(Error::AboveKumoVcpuLimit(cpus));
    }
    match kvm_max {
        Some(max) if cpus > max => Err(Error::AboveKvmVcpuLimit(cpus, max)),
        _ => Ok(()),
    }
}

/// The one check of a VM's shape against kumo's and this host's limits, made on every path
/// (flags, config files, migration headers, prepared destinations) before anything is
/// allocated: vCPUs ([`check_vcpus`]), then memory ([`crate::memory::check_size`]).
pub fn check_shape(cpus: u32, memory: u64, host: &HostLimits) -> Result<()> {
    check_vcpus(cpus, host.kvm_max_vcpus)?;
    crate::memory::check_size(memory, &host.memory)
}

impl Vm {
    pub fn new(ncpus: u32, mem_bytes: u64, irqchip: IrqchipMode) -> Result<Self> {
        // KVM is checked before memory is allocated: a bad request fails cheaply.
        let kvm = Self::check_kvm_caps(open_kvm()?, ncpus, irqchip)?;
        Self::from_prepared(PreparedVm::on(kvm, Memory::new(mem_bytes)?)?, ncpus, irqchip)
    }

    /// Fails early, before memory is allocated, if KVM cannot host this VM.
    fn check_kvm_caps(kvm: Kvm, ncpus: u32, irqchip: IrqchipMode) -> Result<Kvm> {
        for (cap, name) in [
            (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
            (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
            (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
            (Cap::Xsave, "KVM_CAP_XSAVE"),
            (Cap::Xcrs, "KVM_CAP_XCRS"),
            (Cap::Irqfd, "KVM_CAP_IRQFD"),
            (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(Error::MissingCap(name));
            }
        }
        if irqchip == IrqchipMode::Split && !kvm.check_extension(Cap::SplitIrqchip) {
            return Err(Error::MissingCap("KVM_CAP_SPLIT_IRQCHIP"));
        }
        if irqchip == IrqchipMode::User {
            // The APIC MSRs (x2APIC, TSC deadline, APIC base) must exit to kumo.
            for (cap, name) in [
                (Cap::X86UserSpaceMsr, "KVM_CAP_X86_USER_SPACE_MSR (needed by --irqchip user)"),
                (Cap::X86MsrFilter, "KVM_CAP_X86_MSR_FILTER (needed by --irqchip user)"),
            ] {
                if !kvm.check_extension(cap) {
                    return Err(Error::MissingCap(name));
                }
            }
        }
        check_vcpus(ncpus, Some(u32::try_from(kvm.get_max_vcpus()).unwrap_or(u32::MAX)))?;
        Ok(kvm)
    }

    /// Finishes a VM made ahead of its configuration ([`PreparedVm`]) for `ncpus` vCPUs and
    /// `irqchip`: nothing here depends on the memory's size.
    pub fn from_prepared(p: PreparedVm, ncpus: u32, irqchip: IrqchipMode) -> Result<Self> {
        let PreparedVm { kvm, fd, memory } = p;
        let kvm = Self::check_kvm_caps(kvm, ncpus, irqchip)?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize).map_err(|e| Error::Kvm("KVM_SET_TSS_ADDR", e))?;
        match irqchip {
            IrqchipMode::Kernel => {
                fd.create_irq_chip().map_err(|e| Error::Kvm("KVM_CREATE_IRQCHIP", e))?;
                let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
                fd.create_pit2(pit).map_err(|e| Error::Kvm("KVM_CREATE_PIT2", e))?;
            }
            IrqchipMode::Split => {
                let mut cap = kvm_enable_cap { cap: KVM_CAP_SPLIT_IRQCHIP, ..Default::default() };
                cap.args[0] = 24; // IOAPIC pins routed by userspace
                fd.enable_cap(&cap).map_err(|e| Error::Kvm("KVM_ENABLE_CAP(SPLIT_IRQCHIP)", e))?;
            }
            IrqchipMode::User => {
                let mut cap = kvm_enable_cap { cap: kvm_bindings::KVM_CAP_X86_USER_SPACE_MSR, ..Default::default() };
                // KVM never filters the x2APIC range: without its LAPIC it fails those accesses,
                // and INVAL sends the failures to kumo too (others get the same #GP from kumo).
                cap.args[0] =
                    (kvm_bindings::KVM_MSR_EXIT_REASON_FILTER | kvm_bindings::KVM_MSR_EXIT_REASON_INVAL) as u64;
                fd.enable_cap(&cap).map_err(|e| Error::Kvm("KVM_ENABLE_CAP(X86_USER_SPACE_MSR)", e))?;
                // Denied by the filter = sent to kumo: every APIC MSR.
                let deny = [0u8; 32];
                let ranges: Vec<_> = crate::uapic::APIC_MSRS
                    .iter()
                    .map(|&(base, msr_count)| kvm_ioctls::MsrFilterRange {
                        flags: kvm_ioctls::MsrFilterRangeFlags::READ | kvm_ioctls::MsrFilterRangeFlags::WRITE,
                        base,
                        msr_count,
                        bitmap: &deny,
                    })
                    .collect();
                fd.set_msr_filter(kvm_ioctls::MsrFilterDefaultAction::ALLOW, &ranges)
                    .map_err(|e| Error::Kvm("KVM_X86_SET_MSR_FILTER", e))?;
            }
        }
        let msr_list = kvm.get_msr_index_list().map_err(|e| Error::Kvm("KVM_GET_MSR_INDEX_LIST", e))?;
        let fd = Arc::new(fd);
        let uapic = (irqchip == IrqchipMode::User).then(|| UserApics::new(ncpus, vmm_sys_util::signal::SIGRTMIN()));
        if let Some(u) = &uapic {
            u.start_timers().map_err(|e| Error::Boot(format!("LAPIC timer threads: {e}")))?;
        }
        Ok(Vm {
            kvm,
            interrupts: Arc::new(match &uapic {
                Some(u) => Interrupts::new_user(fd.clone(), u.clone())
                    .map_err(|e| Error::Boot(format!("user irqchip interrupt thread: {e}")))?,
                None => Interrupts::new(fd.clone(), irqchip),
            }),
            fd,
            memory,
            irqchip,
            ncpus,
            uapic,
            msr_list: Arc::new(msr_list.as_slice().to_vec()),
            dirty_manual: Default::default(),
            dirty_initially_set: Default::default(),
            dirty_sample: Default::default(),
        })
    }

    /// Sets how long KVM polls a halted vCPU of this VM for a wake-up before it sleeps
    /// (`KVM_CAP_HALT_POLL`, overriding the host's `halt_poll_ns`; 0: never poll): what a vCPU
    /// woken by an IPI pays (seed 003).
    pub fn set_halt_poll_ns(&self, ns: u32) -> Result<()> {
        let cap = kvm_bindings::KVM_CAP_HALT_POLL;
        if self.fd.check_extension_raw(cap.into()) <= 0 {
            return Err(Error::MissingCap("KVM_CAP_HALT_POLL"));
        }
        let mut c = kvm_enable_cap { cap, ..Default::default() };
        c.args[0] = ns.into();
        self.fd.enable_cap(&c).map_err(|e| Error::Kvm("KVM_ENABLE_CAP(HALT_POLL)", e))
    }

    pub fn create_vcpu(&self, id: u32) -> Result<Vcpu> {
        let fd = self.fd.create_vcpu(id as u64).map_err(|e| Error::Kvm("KVM_CREATE_VCPU", e))?;
        let fences = self.memory.fences.clone();
        Ok(Vcpu::new(id, fd, self.memory.guest.clone(), fences, self.msr_list.clone(), self.uapic.clone()))
    }

    /// VM-wide state. vCPUs must be paused.
    pub fn save_state(&self) -> Result<VmState> {
        self.persist().read()
    }

    pub fn restore_state(&self, s: &VmState) -> Result<()> {
        self.persist().write(s)
    }

    /// The VM-wide KVM state (irqchips, PIT, clock) as a persistable component.
    pub fn persist(&self) -> VmPersist {
        VmPersist { fd: self.fd.clone(), irqchip: self.irqchip }
    }
}

/// The VM-wide KVM state as a component of the persist pattern (`kumo_devices::persist`): the
/// in-kernel PIC, IOAPIC and PIT (absent with a split irqchip) and the KVM clock.
pub struct VmPersist {
    fd: Arc<VmFd>,
    irqchip: IrqchipMode,
}

/// The VM-wide state's id in snapshots.
pub const VM_ID: &str = "vm";

impl VmPersist {
    fn read(&self) -> Result<VmState> {
        let mut irqchips = Vec::new();
        let mut pit = None;
        if self.irqchip == IrqchipMode::Kernel {
            for chip_id in [KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQCHIP_IOAPIC] {
                let mut c = kvm_irqchip { chip_id, ..Default::default() };
                self.fd.get_irqchip(&mut c).map_err(|e| Error::Kvm("KVM_GET_IRQCHIP", e))?;
                irqchips.push(c);
            }
            pit = Some(self.fd.get_pit2().map_err(|e| Error::Kvm("KVM_GET_PIT2", e))?);
        }
        let clock = self.fd.get_clock().map_err(|e| Error::Kvm("KVM_GET_CLOCK", e))?;
        Ok(VmState { irqchips, pit, clock })
    }

    fn write(&self, s: &VmState) -> Result<()> {
        let kernel = self.irqchip == IrqchipMode::Kernel;
        if kernel != (s.irqchips.len() == 3 && s.pit.is_some()) {
            return Err(Error::Restore(format!("saved irqchip state does not fit a {} irqchip", self.irqchip)));
        }
        for c in &s.irqchips {
            self.fd.set_irqchip(c).map_err(|e| Error::Kvm("KVM_SET_IRQCHIP", e))?;
        }
        if let Some(p) = &s.pit {
            self.fd.set_pit2(p).map_err(|e| Error::Kvm("KVM_SET_PIT2", e))?;
        }
        // Only the clock value is restored; KVM rejects flags it set itself on GET.
        let clock = kvm_bindings::kvm_clock_data { clock: s.clock.clock, ..Default::default() };
        self.fd.set_clock(&clock).map_err(|e| Error::Kvm("KVM_SET_CLOCK", e))?;
        Ok(())
    }
}

impl Persist for VmPersist {
    type State = VmState;
    fn id(&self) -> String {
        VM_ID.into()
    }
    fn save(&self) -> std::result::Result<VmState, PersistError> {
        self.read().map_err(|e| PersistError::component(VM_ID, e))
    }
    fn restore(&mut self, s: &VmState) -> std::result::Result<(), PersistError> {
        self.write(s).map_err(|e| PersistError::component(VM_ID, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vcpu::VcpuRun;
    use kumo_devices::DeviceEvent;

    #[test]
    fn shapes() {
        let host = HostLimits { memory: crate::memory::HostMemory { total: 24 << 30 }, kvm_max_vcpus: Some(64) };
        for (cpus, mem) in [(1, 8 << 20), (1, 256 << 20), (64, 1 << 30), (2, host.memory.usable())] {
            check_shape(cpus, mem, &host).unwrap();
        }
        let bad: &[(u32, u64, &str)] = &[
            (0, 256 << 20, "cpus must be at least 1"),
            (65, 256 << 20, "cpus 65 exceeds this host's KVM limit of 64 vCPUs"),
            (241, 256 << 20, "cpus 241 exceeds kumo's limit of 240"),
            (u32::MAX, 256 << 20, "kumo's limit"),
            (1, 0, "at least 8 MiB"),
            (1, 4 << 20, "at least 8 MiB"),
            (1, (256 << 20) + 512, "multiple of 4 KiB"),
            (1, 1 << 40, "memory 1 TiB is more than this host can back (22.8 GiB usable of 24 GiB)"),
            (1, 1 << 50, "memory 1 PiB is more than this host can back"),
            (1, u64::MAX, "multiple of 4 KiB"),
        ];
        for &(cpus, mem, want) in bad {
            let e = check_shape(cpus, mem, &host).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{cpus} cpus, {mem} bytes: {e}");
        }
        // KVM's limit unknown: kumo's own still applies.
        let unknown = HostLimits { kvm_max_vcpus: None, ..host };
        check_shape(200, 1 << 30, &unknown).unwrap();
        assert!(check_shape(241, 1 << 30, &unknown).is_err());
        assert!(HostLimits::probe().unwrap().memory.total > 0);
    }

    /// Runs raw ring-0 code at 1 MiB on a 1-vCPU VM until it exits or fails.
    fn run_code(code: &[u8]) -> Option<Result<VcpuRun>> {
        crate::testing::RawGuest::new(code, &[]).map(|mut g| g.run())
    }

    #[test]
    fn exit_port_ends_the_guest_with_its_code() {
        // mov $0x501, %dx; mov $42, %eax; out %eax, (%dx)
        let Some(r) = run_code(&[0x66, 0xba, 0x01, 0x05, 0xb8, 42, 0, 0, 0, 0xef]) else {
            return;
        };
        assert_eq!(r.unwrap(), VcpuRun::Device(DeviceEvent::GuestExit(42)));
    }

    #[test]
    fn mmio_reaches_the_device_on_the_mmio_bus() {
        struct Latch(u32);
        impl kumo_devices::BusDevice for Latch {
            fn read(&mut self, offset: u64, data: &mut [u8]) {
                let v = if offset == 4 { self.0 + 1 } else { 0 };
                data.copy_from_slice(&v.to_le_bytes()[..data.len()]);
            }
            fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
                if offset == 0 && data.len() == 4 {
                    self.0 = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
                }
                None
            }
        }
        // mov $0xd0000000, %eax; movl $42, (%rax); mov 4(%rax), %ebx; mov $0x501, %dx;
        // mov %ebx, %eax; out %eax, (%dx)
        let code =
            [0xb8, 0, 0, 0, 0xd0, 0xc7, 0x00, 42, 0, 0, 0, 0x8b, 0x58, 0x04, 0x66, 0xba, 0x01, 0x05, 0x89, 0xd8, 0xef];
        // With kumo's APIC too: an address below its page is the bus's.
        for mode in [IrqchipMode::Kernel, IrqchipMode::User] {
            let Some(mut g) = crate::testing::RawGuest::with_irqchip(mode, &code, &[]) else {
                return;
            };
            g.buses.mmio.insert(0xd000_0000, 0x1000, std::sync::Arc::new(std::sync::Mutex::new(Latch(0)))).unwrap();
            assert_eq!(g.run().unwrap(), VcpuRun::Device(DeviceEvent::GuestExit(43)), "{mode}");
        }
    }

    #[test]
    fn user_irqchip_serves_the_apic_msrs_and_page() {
        // rdmsr 0x1B; or $0xC00 (x2APIC on); wrmsr; rdmsr 0x803 (x2APIC version); out to exit.
        let x2apic = [
            0xb9, 0x1b, 0, 0, 0, 0x0f, 0x32, 0x0d, 0x00, 0x0c, 0, 0, 0x0f, 0x30, 0xb9, 0x03, 0x08, 0, 0, 0x0f, 0x32,
            0x66, 0xba, 0x01, 0x05, 0xef,
        ];
        let Some(mut g) = crate::testing::RawGuest::with_irqchip(IrqchipMode::User, &x2apic, &[]) else {
            return;
        };
        assert_eq!(g.run().unwrap(), VcpuRun::Device(DeviceEvent::GuestExit(kumo_devices::apic::APIC_VERSION)));
        assert_eq!(g.vm.uapic.as_ref().unwrap().lock(0).lapic.mode(), kumo_devices::apic::ApicMode::X2Apic);
        // mov $0xfee00030, %eax; mov (%rax), %ebx (xAPIC version); mov %ebx, %eax; out to exit.
        let xapic = [0xb8, 0x30, 0, 0xe0, 0xfe, 0x8b, 0x18, 0x89, 0xd8, 0x66, 0xba, 0x01, 0x05, 0xef];
        let mut g = crate::testing::RawGuest::with_irqchip(IrqchipMode::User, &xapic, &[]).unwrap();
        assert_eq!(g.run().unwrap(), VcpuRun::Device(DeviceEvent::GuestExit(kumo_devices::apic::APIC_VERSION)));
    }

    #[test]
    fn unemulatable_instruction_is_reported_with_rip_and_bytes() {
        // nop; stac — KVM on this project's nested hosts cannot emulate STAC in ring 0. Where a
        // host runs it natively instead, it raises #UD (SMAP is masked), and with no IDT the
        // guest triple-faults: the report must then say so.
        let Some(r) = run_code(&[0x90, 0x0f, 0x01, 0xcb, 0xf4]) else {
            return;
        };
        match r {
            Err(Error::EmulationFailure { cpu, rip, bytes, what }) => {
                assert_eq!((cpu, rip), (0, 0x100001));
                assert!(bytes.starts_with("0f 01 cb"), "{bytes}");
                assert_eq!(what, ": STAC");
                let msg = Error::EmulationFailure { cpu, rip, bytes, what }.to_string();
                assert!(msg.contains("RIP 0x100001") && msg.contains("STAC"), "{msg}");
                eprintln!("reported: {msg}");
            }
            Ok(VcpuRun::Reset(why)) => assert!(why.contains("triple"), "{why}"),
            other => panic!("unexpected result {other:?}"),
        }
    }
}
