//! One vCPU: configuration for each entry kind, the exit handling of `KVM_RUN`, and state
//! save/restore. A `Vcpu` is `Send` and lives in its own thread.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kumo_devices::{Buses, DeviceEvent};
use kvm_bindings::{kvm_mp_state, kvm_msr_entry, Msrs, KVM_MAX_CPUID_ENTRIES, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress};

use crate::boot::{regs_for, sregs_for, Entry};
use crate::emulate::assist::{self, AssistCounts, AssistCpu};
use crate::emulate::decode as insn;
use crate::state::VcpuState;
use crate::uapic::UserApics;
use crate::{cpuid, Error, Result};

vmm_sys_util::ioctl_iow_nr!(KVM_INTERRUPT, kvm_bindings::KVMIO, 0x86, kvm_bindings::kvm_interrupt);

const MSR_IA32_TSC: u32 = 0x10;

use kumo_devices::apic::{IOAPIC_BASE, IOAPIC_MMIO_SIZE};

/// The offset of `addr` in the IOAPIC's page, if it is in it.
fn ioapic_offset(addr: u64) -> Option<u64> {
    (IOAPIC_BASE..IOAPIC_BASE + IOAPIC_MMIO_SIZE).contains(&addr).then(|| addr - IOAPIC_BASE)
}

thread_local! {
    /// This thread's vCPU `kvm_run` while it runs a user-APIC vCPU: the kick signal's handler
    /// sets its `immediate_exit` so a kick just before KVM_RUN makes that KVM_RUN return at once.
    static KICK_RUN: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// To be called from the VMM's vCPU kick signal handler (async-signal-safe: one store).
pub fn on_kick_signal() {
    let p = KICK_RUN.with(Cell::get);
    if !p.is_null() {
        // SAFETY: `p` is the kvm_run mapping of the vCPU this thread runs, set by `Vcpu::run`
        // and valid while the Vcpu lives; a volatile byte store is what KVM reads on entry.
        unsafe { std::ptr::addr_of_mut!((*p).immediate_exit).write_volatile(1) };
    }
}

const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MISC_ENABLE_FAST_STRING: u64 = 1;
const APIC_LVT_LINT0: usize = 0x350;
const APIC_LVT_LINT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7 << 8;
const APIC_MODE_NMI: u32 = 0x4 << 8;

/// What one `KVM_RUN` produced that the vCPU's thread must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuRun {
    /// Handled (I/O, MMIO); run again.
    Continue,
    /// A device asked the VMM for something (guest exit, timing marker).
    Device(DeviceEvent),
    /// KVM_RUN was interrupted by a signal (a pause or stop request); check the request.
    Interrupted,
    /// The guest executed HLT with no in-kernel LAPIC to park it.
    Halted,
    /// The guest triple-faulted or asked for a reset.
    Reset(String),
    /// The guest asked to power off (ACPI/system event).
    PowerOff,
}

/// A vCPU's exits by reason and its emulation assists, readable while it runs (the API's
/// `vm.counters`), so nothing waits for a vCPU inside KVM_RUN.
#[derive(Debug, Default)]
pub struct ExitCounters {
    pub io: AtomicU64,
    pub mmio: AtomicU64,
    pub hlt: AtomicU64,
    pub shutdown: AtomicU64,
    /// KVM_RUN interrupted by a signal (a kick: pause, stop, throttle).
    pub intr: AtomicU64,
    pub other: AtomicU64,
    /// Assists by kind, in [`assist::AssistKind::ALL`]'s order.
    pub assists: [AtomicU64; assist::AssistKind::ALL.len()],
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub struct Vcpu {
    pub id: u32,
    fd: VcpuFd,
    mem: crate::GuestMemory,
    /// MSRs to save, from KVM_GET_MSR_INDEX_LIST.
    msr_list: Arc<Vec<u32>>,
    has_lapic: bool,
    /// `--irqchip user`: the VM's APICs (this vCPU's is `uapic.lock(id)`).
    uapic: Option<Arc<UserApics>>,
    /// Emulation assists performed so far (see `crate::emulate`).
    assists: AssistCounts,
    exits: Arc<ExitCounters>,
    /// Guest memory taken out of the guest's reach: an access to it stops the VM.
    fences: Arc<crate::memory::Fences>,
}

impl Drop for Vcpu {
    fn drop(&mut self) {
        // The kvm_run mapping goes with the fd: a later kick on this thread must not reach it.
        let r: *mut kvm_bindings::kvm_run = self.fd.get_kvm_run();
        if KICK_RUN.with(Cell::get) == r {
            KICK_RUN.set(std::ptr::null_mut());
        }
    }
}

impl Vcpu {
    pub(crate) fn new(
        id: u32,
        fd: VcpuFd,
        mem: crate::GuestMemory,
        fences: Arc<crate::memory::Fences>,
        msr_list: Arc<Vec<u32>>,
        uapic: Option<Arc<UserApics>>,
    ) -> Self {
        let has_lapic = uapic.is_none();
        let (assists, exits) = (AssistCounts::default(), Default::default());
        Vcpu { id, fd, mem, msr_list, has_lapic, uapic, assists, exits, fences }
    }

    /// An access to guest-physical `gpa` that KVM could not serve from guest memory: an error
    /// naming the fenced range it hit, if it hit one.
    fn fenced(fences: &crate::memory::Fences, cpu: u32, gpa: u64) -> Result<()> {
        match fences.find(gpa) {
            Some(what) => Err(Error::FencedAccess { cpu, gpa, what }),
            None => Ok(()),
        }
    }

    /// KVM_RUN failed with EFAULT: KVM could not map guest memory the guest accessed. With
    /// `KVM_CAP_MEMORY_FAULT_INFO` KVM says where; this host's nested KVM has the capability
    /// but does not fill the exit in, so the faulting access is also found from the
    /// instruction at RIP ([`Vcpu::fenced_access`]).
    fn memory_fault(&mut self, e: vmm_sys_util::errno::Error) -> Result<VcpuRun> {
        let run = self.fd.get_kvm_run();
        if run.exit_reason == kvm_bindings::KVM_EXIT_MEMORY_FAULT {
            // SAFETY: KVM filled the `memory_fault` member of the kvm_run union: exit_reason
            // says so.
            let f = unsafe { run.__bindgen_anon_1.memory_fault };
            Self::fenced(&self.fences, self.id, f.gpa)?;
            return Err(Error::MemoryFault { cpu: self.id, gpa: f.gpa, flags: f.flags });
        }
        if self.fences.is_empty() {
            return Err(Error::Kvm("KVM_RUN", e));
        }
        if let Some(gpa) = self.fenced_access() {
            Self::fenced(&self.fences, self.id, gpa)?;
        }
        let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
        Err(Error::UnreachableMemory { cpu: self.id, rip })
    }

    /// The fenced guest-physical address the instruction at RIP accessed, if it is one kumo
    /// can tell: its fetch, or the memory operand of a common instruction.
    fn fenced_access(&self) -> Option<u64> {
        let regs = self.fd.get_regs().ok()?;
        let sregs = self.fd.get_sregs().ok()?;
        let m = VcpuMem { fd: &self.fd, mem: &self.mem, fences: &self.fences };
        let hit = |gva: u64| m.translate(gva, false).filter(|&gpa| self.fences.find(gpa).is_some());
        if let Some(gpa) = hit(regs.rip).or_else(|| hit(regs.rip.wrapping_add(14))) {
            return Some(gpa);
        }
        let mut bytes = [0u8; 15];
        let n = m.read_prefix(regs.rip, &mut bytes);
        if sregs.cs.l != 1 {
            return None;
        }
        let gpr = assist::gprs(&regs);
        match insn::memory_access(&bytes[..n])? {
            insn::Access::Operand { mem, len } => {
                hit(mem.address(&gpr, regs.rip.wrapping_add(len as u64), sregs.fs.base, sregs.gs.base))
            }
            insn::Access::Regs(rs) => rs.iter().find_map(|&r| hit(gpr[r as usize])),
        }
    }

    /// The VM's user APICs (`--irqchip user`), if it has them.
    pub fn user_apics(&self) -> Option<&Arc<UserApics>> {
        self.uapic.as_ref()
    }

    /// This vCPU's exit counters, shared with whoever reads them while it runs.
    pub fn exit_counters(&self) -> Arc<ExitCounters> {
        self.exits.clone()
    }

    /// How many instructions of each kind kumo carried out for this vCPU after KVM failed to
    /// emulate them.
    pub fn assist_counts(&self) -> AssistCounts {
        self.assists
    }

    /// Sets CPUID (with the PV features `pv`), MSRs, LAPIC LINT pins and, if `entry` is given,
    /// the boot register state. vCPUs without an entry stay in KVM's reset state (an AP waiting
    /// for INIT/SIPI).
    pub fn configure(&self, kvm: &Kvm, ncpus: u32, entry: Option<Entry>, pv: &crate::pv::PvSet) -> Result<()> {
        let mut c =
            kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(|e| Error::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
        cpuid::filter(&mut c, self.id, ncpus);
        crate::pv::apply(&mut c, pv);
        if self.uapic.is_some() {
            cpuid::user_apic(&mut c);
        }
        self.fd.set_cpuid2(&c).map_err(|e| Error::Kvm("KVM_SET_CPUID2", e))?;

        let msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: MSR_IA32_MISC_ENABLE,
            data: MISC_ENABLE_FAST_STRING,
            ..Default::default()
        }])
        .expect("one MSR");
        self.fd.set_msrs(&msrs).map_err(|e| Error::Kvm("KVM_SET_MSRS", e))?;

        if self.has_lapic {
            let mut lapic = self.fd.get_lapic().map_err(|e| Error::Kvm("KVM_GET_LAPIC", e))?;
            set_lapic_reg(&mut lapic.regs, APIC_LVT_LINT0, APIC_MODE_EXTINT);
            set_lapic_reg(&mut lapic.regs, APIC_LVT_LINT1, APIC_MODE_NMI);
            self.fd.set_lapic(&lapic).map_err(|e| Error::Kvm("KVM_SET_LAPIC", e))?;
        }

        if let Some(u) = &self.uapic {
            self.calibrate_tsc()?;
            // Without KVM's LAPIC every vCPU is runnable from reset: one without an entry (a
            // Linux AP) waits in kumo for the kernel's INIT/SIPI.
            u.lock(self.id).wait_sipi = entry.is_none();
        }

        if let Some(entry) = entry {
            let sregs = self.fd.get_sregs().map_err(|e| Error::Kvm("KVM_GET_SREGS", e))?;
            self.fd.set_sregs(&sregs_for(entry, self.id, ncpus, sregs)).map_err(|e| Error::Kvm("KVM_SET_SREGS", e))?;
            self.fd.set_regs(&regs_for(entry, self.id)).map_err(|e| Error::Kvm("KVM_SET_REGS", e))?;
            let fpu = kvm_bindings::kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
            self.fd.set_fpu(&fpu).map_err(|e| Error::Kvm("KVM_SET_FPU", e))?;
            if self.id != 0 && self.has_lapic {
                // An AP with an in-kernel LAPIC waits for INIT/SIPI; kumo guests start all vCPUs
                // at the entry point instead (documented in guests/include/kumo.h).
                self.fd
                    .set_mp_state(kvm_mp_state { mp_state: KVM_MP_STATE_RUNNABLE })
                    .map_err(|e| Error::Kvm("KVM_SET_MP_STATE", e))?;
            }
        }
        Ok(())
    }

    /// `--irqchip user`: the APIC timer's TSC deadlines are guest TSC values, so the APIC clock
    /// learns the guest's TSC offset (again after a restore moved the guest's TSC).
    fn calibrate_tsc(&self) -> Result<()> {
        let Some(u) = &self.uapic else { return Ok(()) };
        let mut m =
            Msrs::from_entries(&[kvm_msr_entry { index: MSR_IA32_TSC, ..Default::default() }]).expect("one MSR");
        self.fd.get_msrs(&mut m).map_err(|e| Error::Kvm("KVM_GET_MSRS", e))?;
        let host = crate::uapic::host_tsc();
        let khz = self.tsc_khz().unwrap_or(1_000_000);
        u.clock().calibrate(m.as_slice()[0].data, host, khz * 1000);
        Ok(())
    }

    /// The CPUID KVM holds for this vCPU (KVM_GET_CPUID2).
    pub fn cpuid(&self) -> Result<kvm_bindings::CpuId> {
        self.fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(|e| Error::Kvm("KVM_GET_CPUID2", e))
    }

    pub fn regs(&self) -> Result<kvm_bindings::kvm_regs> {
        self.fd.get_regs().map_err(|e| Error::Kvm("KVM_GET_REGS", e))
    }

    pub fn set_regs(&self, regs: &kvm_bindings::kvm_regs) -> Result<()> {
        self.fd.set_regs(regs).map_err(|e| Error::Kvm("KVM_SET_REGS", e))
    }

    /// TSC frequency of this vCPU in kHz, if KVM reports one.
    pub fn tsc_khz(&self) -> Option<u64> {
        self.fd.get_tsc_khz().ok().map(|k| k as u64).filter(|k| *k > 0)
    }

    /// Asks the next `KVM_RUN` to return at once (or clears the request).
    pub fn set_immediate_exit(&mut self, on: bool) {
        self.fd.set_kvm_immediate_exit(on as u8);
    }

    /// Runs the vCPU until its next exit and handles it: port I/O and MMIO go to `buses`.
    pub fn run(&mut self, buses: &Buses) -> Result<VcpuRun> {
        match self.uapic.clone() {
            Some(u) => self.run_user(&u, buses),
            None => self.run_once(buses, None),
        }
    }

    /// One `KVM_RUN` with kumo's APIC: NMI, SIPI and a pending vector are injected first
    /// (`KVM_INTERRUPT` if the guest can take it now, else an interrupt window is requested),
    /// and CR8 follows the APIC's TPR both ways.
    fn run_user(&mut self, u: &UserApics, buses: &Buses) -> Result<VcpuRun> {
        let id = self.id;
        let (ready, if_flag) = {
            let r = self.fd.get_kvm_run();
            // Before `running` is set below: a kick from then on must find this kvm_run.
            KICK_RUN.set(r as *mut _);
            (r.ready_for_interrupt_injection != 0, r.if_flag != 0)
        };
        let mut s = u.lock(id);
        if s.wait_sipi {
            let Some(v) = s.sipi.take() else {
                return Ok(VcpuRun::Halted);
            };
            s.wait_sipi = false;
            drop(s);
            self.start_at(v)?;
            return Ok(VcpuRun::Continue);
        }
        if std::mem::take(&mut s.nmi) {
            self.fd.nmi().map_err(|e| Error::Kvm("KVM_NMI", e))?;
        }
        let mut window = false;
        // The PIC's INTR (BSP, LINT0 in ExtINT mode) outside the APIC's priority scheme, one
        // KVM_INTERRUPT per entry; the INTA takes the PIC's lock, so this vCPU's is let go.
        let mut injected = false;
        if u.pic_pending_for(id, &s) {
            if ready && if_flag {
                drop(s);
                let v = u.pic_ack();
                self.interrupt(v)?;
                injected = true;
                s = u.lock(id);
            }
            // Another PIC interrupt, or this one when the guest could not take it yet.
            window = !injected || u.pic_pending_for(id, &s);
        }
        if s.lapic.pending_vector().is_some() && injected {
            window = true;
        } else if s.lapic.pending_vector().is_some() {
            if ready && if_flag {
                if let Some(v) = s.lapic.ack() {
                    self.interrupt(v)?;
                }
                window |= s.lapic.pending_vector().is_some();
            } else {
                window = true;
            }
        }
        let cr8 = s.lapic.cr8();
        s.running = true;
        // SAFETY: pthread_self has no preconditions.
        s.thread = Some(unsafe { libc::pthread_self() });
        drop(s);
        let r = self.fd.get_kvm_run();
        r.cr8 = cr8;
        r.request_interrupt_window = window as u8;

        let out = self.run_once(buses, Some(u));

        let r = self.fd.get_kvm_run();
        // A kick after this point is seen by the checks above before the next entry.
        r.immediate_exit = 0;
        let cr8 = r.cr8;
        let mut s = u.lock(id);
        s.running = false;
        s.lapic.set_cr8(cr8);
        out
    }

    /// Injects external interrupt `vector` (KVM_INTERRUPT): the guest takes it at this entry.
    fn interrupt(&self, vector: u8) -> Result<()> {
        let irq = kvm_bindings::kvm_interrupt { irq: vector as u32 };
        // SAFETY: KVM_INTERRUPT reads one kvm_interrupt, which lives across the call.
        let r = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_INTERRUPT(), &irq) };
        if r < 0 {
            return Err(Error::Kvm("KVM_INTERRUPT", vmm_sys_util::errno::Error::last()));
        }
        Ok(())
    }

    /// A SIPI started this vCPU: real mode at `vector << 12`.
    fn start_at(&self, vector: u8) -> Result<()> {
        let mut sregs = self.fd.get_sregs().map_err(|e| Error::Kvm("KVM_GET_SREGS", e))?;
        sregs.cs.selector = (vector as u16) << 8;
        sregs.cs.base = (vector as u64) << 12;
        self.fd.set_sregs(&sregs).map_err(|e| Error::Kvm("KVM_SET_SREGS", e))?;
        let mut regs = self.fd.get_regs().map_err(|e| Error::Kvm("KVM_GET_REGS", e))?;
        regs.rip = 0;
        self.fd.set_regs(&regs).map_err(|e| Error::Kvm("KVM_SET_REGS", e))
    }

    /// The xAPIC page of `u`'s APIC for this vCPU, if `addr` is in it: (APIC, offset).
    fn apic_page<'a>(
        u: Option<&'a UserApics>,
        id: u32,
        addr: u64,
    ) -> Option<(std::sync::MutexGuard<'a, crate::uapic::CpuState>, u64)> {
        let s = u?.lock(id);
        let base = s.lapic.mmio_base()?;
        let off = addr.checked_sub(base).filter(|o| *o < kumo_devices::apic::APIC_MMIO_SIZE)?;
        Some((s, off))
    }

    fn run_once(&mut self, buses: &Buses, uapic: Option<&UserApics>) -> Result<VcpuRun> {
        let id = self.id;
        let run = self.fd.run();
        let e = &self.exits;
        bump(match &run {
            Ok(VcpuExit::IoOut(..) | VcpuExit::IoIn(..)) => &e.io,
            Ok(VcpuExit::MmioRead(..) | VcpuExit::MmioWrite(..)) => &e.mmio,
            Ok(VcpuExit::Hlt) => &e.hlt,
            Ok(VcpuExit::Shutdown) => &e.shutdown,
            Ok(VcpuExit::Intr) => &e.intr,
            Err(err) if err.errno() == libc::EINTR => &e.intr,
            _ => &e.other,
        });
        match run {
            // The 8259 pair's ports are the user irqchip's (KVM serves them with its own).
            Ok(VcpuExit::IoOut(port, data)) => match uapic {
                Some(u) if crate::uapic::pic_port(port) => {
                    u.pic_write(port, data);
                    Ok(VcpuRun::Continue)
                }
                _ => Ok(buses.pio.write(port.into(), data).map_or(VcpuRun::Continue, VcpuRun::Device)),
            },
            Ok(VcpuExit::IoIn(port, data)) => {
                match uapic {
                    Some(u) if crate::uapic::pic_port(port) => u.pic_read(port, data),
                    _ => {
                        buses.pio.read(port.into(), data);
                    }
                }
                Ok(VcpuRun::Continue)
            }
            // An access KVM emulated (guest ring 0 here) reaches a fenced range as MMIO.
            Ok(VcpuExit::MmioRead(addr, _) | VcpuExit::MmioWrite(addr, _)) if self.fences.find(addr).is_some() => {
                Self::fenced(&self.fences, id, addr).map(|_| VcpuRun::Continue)
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                match (Self::apic_page(uapic, id, addr), uapic) {
                    (Some((mut s, off)), _) => s.lapic.read_mmio(off, data),
                    (None, Some(u)) if ioapic_offset(addr).is_some() => u.ioapic_read(addr - IOAPIC_BASE, data),
                    _ => {
                        buses.mmio.read(addr, data);
                    }
                }
                Ok(VcpuRun::Continue)
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => match Self::apic_page(uapic, id, addr) {
                Some((mut s, off)) => {
                    let ev = s.lapic.write_mmio(off, data);
                    drop(s);
                    if let (Some(ev), Some(u)) = (ev, uapic) {
                        u.handle_event(id, ev);
                    }
                    Ok(VcpuRun::Continue)
                }
                None => match (uapic, ioapic_offset(addr)) {
                    (Some(u), Some(off)) => {
                        u.ioapic_write(off, data);
                        Ok(VcpuRun::Continue)
                    }
                    _ => Ok(buses.mmio.write(addr, data).map_or(VcpuRun::Continue, VcpuRun::Device)),
                },
            },
            // The APIC MSRs (KVM's MSR filter sends only those here): an `Err` is #GP.
            Ok(VcpuExit::X86Rdmsr(e)) => {
                match uapic.map(|u| u.lock(id).lapic.read_msr(e.index)) {
                    Some(Ok(v)) => *e.data = v,
                    _ => *e.error = 1,
                }
                Ok(VcpuRun::Continue)
            }
            Ok(VcpuExit::X86Wrmsr(e)) => {
                let (index, data) = (e.index, e.data);
                match uapic.map(|u| u.lock(id).lapic.write_msr(index, data)) {
                    Some(Ok(ev)) => {
                        if let (Some(ev), Some(u)) = (ev, uapic) {
                            u.handle_event(id, ev);
                        }
                    }
                    _ => *e.error = 1,
                }
                Ok(VcpuRun::Continue)
            }
            // CR8 is synced after each run.
            Ok(VcpuExit::SetTpr) => Ok(VcpuRun::Continue),
            Ok(VcpuExit::Hlt) => Ok(VcpuRun::Halted),
            Ok(VcpuExit::Shutdown) => Ok(VcpuRun::Reset(format!("vCPU {id} triple-faulted (shutdown exit)"))),
            Ok(VcpuExit::SystemEvent(t, _)) => match t {
                kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => Ok(VcpuRun::PowerOff),
                _ => Ok(VcpuRun::Reset(format!("vCPU {id} requested a system reset (event {t})"))),
            },
            Ok(VcpuExit::InternalError) => self.internal_error(),
            Ok(VcpuExit::FailEntry(reason, _)) => Err(Error::FailEntry { cpu: id, reason }),
            Ok(VcpuExit::Intr) => Ok(VcpuRun::Interrupted),
            Ok(VcpuExit::IrqWindowOpen) => Ok(VcpuRun::Continue),
            Ok(other) => Err(Error::UnexpectedExit { cpu: id, exit: format!("{other:?}") }),
            Err(e) if e.errno() == libc::EINTR => Ok(VcpuRun::Interrupted),
            // An AP whose INIT/SIPI has not completed yet (seen on nested KVM): just retry.
            Err(e) if e.errno() == libc::EAGAIN => Ok(VcpuRun::Continue),
            Err(e) if e.errno() == libc::EFAULT => self.memory_fault(e),
            Err(e) => Err(Error::Kvm("KVM_RUN", e)),
        }
    }

    /// Handles KVM_EXIT_INTERNAL_ERROR: an emulation failure on an instruction kumo can carry
    /// out itself is assisted and the vCPU continues; anything else is an error naming the RIP,
    /// the bytes and, where known, the instruction.
    fn internal_error(&mut self) -> Result<VcpuRun> {
        // SAFETY: reading the `internal` member of the kvm_run union is valid right after
        // KVM_RUN returned KVM_EXIT_INTERNAL_ERROR, which is the only caller.
        let suberror = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal.suberror };
        let mut regs = self.fd.get_regs().map_err(|e| Error::Kvm("KVM_GET_REGS", e))?;
        let rip = regs.rip;
        if suberror != kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
            return Err(Error::InternalError { cpu: self.id, suberror, rip });
        }
        let mut bytes = [0u8; 15];
        let n = VcpuMem { fd: &self.fd, mem: &self.mem, fences: &self.fences }.read_prefix(rip, &mut bytes);
        let bytes = &bytes[..n];
        if let Some(kind) = self.assist(bytes, &mut regs)? {
            self.assists.add(kind);
            if let Some(i) = assist::AssistKind::ALL.iter().position(|k| *k == kind) {
                bump(&self.exits.assists[i]);
            }
            tracing::debug!(
                cpu = self.id,
                rip = format_args!("{rip:#x}"),
                insn = kind.name(),
                total = self.assists.get(kind),
                "emulation assist"
            );
            return Ok(VcpuRun::Continue);
        }
        let (bytes, what) = if n > 0 {
            (insn::hex(&bytes[..n.min(8)]), insn::describe(bytes).map(|n| format!(": {n}")).unwrap_or_default())
        } else {
            ("unreadable".to_string(), String::new())
        };
        Err(Error::EmulationFailure { cpu: self.id, rip, bytes, what })
    }

    /// Carries out the instruction in `bytes` (at `regs.rip`) if kumo knows how; `None` if not.
    fn assist(&mut self, bytes: &[u8], regs: &mut kvm_bindings::kvm_regs) -> Result<Option<assist::AssistKind>> {
        let sregs = self.fd.get_sregs().map_err(|e| Error::Kvm("KVM_GET_SREGS", e))?;
        let Some((insn, len)) = assist::decode(bytes, sregs.cs.l == 1) else {
            return Ok(None);
        };
        let mut cpu = VcpuMem { fd: &self.fd, mem: &self.mem, fences: &self.fences };
        let Some(done) = assist::execute(&mut cpu, insn, len, regs, &sregs)? else {
            return Ok(None);
        };
        // Registers first: KVM_SET_REGS drops a pending exception.
        self.fd.set_regs(regs).map_err(|e| Error::Kvm("KVM_SET_REGS", e))?;
        if let Some(ex) = done.exception {
            let mut ev = self.fd.get_vcpu_events().map_err(|e| Error::Kvm("KVM_GET_VCPU_EVENTS", e))?;
            ev.exception.injected = 1;
            ev.exception.pending = 0;
            ev.exception.nr = ex.vector;
            ev.exception.has_error_code = ex.error_code.is_some() as u8;
            ev.exception.error_code = ex.error_code.unwrap_or(0);
            ev.exception_has_payload = 0;
            ev.exception_payload = 0;
            self.fd.set_vcpu_events(&ev).map_err(|e| Error::Kvm("KVM_SET_VCPU_EVENTS", e))?;
        }
        Ok(Some(done.kind))
    }

    /// Reads this vCPU's state. The vCPU must not be running.
    pub fn save_state(&self) -> Result<VcpuState> {
        let fd = &self.fd;
        // MP state first: KVM_GET_MP_STATE may flush pending events into the state read next.
        let mp_state = fd.get_mp_state().map_err(|e| Error::Kvm("KVM_GET_MP_STATE", e))?;
        Ok(VcpuState {
            id: self.id,
            mp_state,
            regs: fd.get_regs().map_err(|e| Error::Kvm("KVM_GET_REGS", e))?,
            sregs: fd.get_sregs().map_err(|e| Error::Kvm("KVM_GET_SREGS", e))?,
            xsave: fd.get_xsave().map_err(|e| Error::Kvm("KVM_GET_XSAVE", e))?,
            xcrs: fd.get_xcrs().map_err(|e| Error::Kvm("KVM_GET_XCRS", e))?,
            lapic: if self.has_lapic {
                Some(fd.get_lapic().map_err(|e| Error::Kvm("KVM_GET_LAPIC", e))?)
            } else {
                None
            },
            msrs: self.read_msrs()?,
            events: fd.get_vcpu_events().map_err(|e| Error::Kvm("KVM_GET_VCPU_EVENTS", e))?,
            debugregs: fd.get_debug_regs().map_err(|e| Error::Kvm("KVM_GET_DEBUGREGS", e))?,
        })
    }

    /// Reads every MSR of the index list that KVM lets this vCPU read; KVM stops a batch at the
    /// first MSR it refuses, so refused ones are skipped and the rest read on.
    fn read_msrs(&self) -> Result<Vec<kvm_msr_entry>> {
        let mut out = Vec::with_capacity(self.msr_list.len());
        let mut rest: &[u32] = &self.msr_list;
        while !rest.is_empty() {
            let entries: Vec<_> = rest.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
            let mut msrs = Msrs::from_entries(&entries).map_err(|e| Error::Restore(format!("MSR list: {e:?}")))?;
            let n = self.fd.get_msrs(&mut msrs).map_err(|e| Error::Kvm("KVM_GET_MSRS", e))?;
            out.extend_from_slice(&msrs.as_slice()[..n]);
            rest = &rest[(n + 1).min(rest.len())..];
        }
        Ok(out)
    }

    /// Writes back a state from `save_state`. Order follows what KVM needs: special registers
    /// (APIC base) before the LAPIC, MSRs after, pending events last.
    pub fn restore_state(&self, s: &VcpuState) -> Result<()> {
        if s.id != self.id {
            return Err(Error::Restore(format!("state of vCPU {} given to vCPU {}", s.id, self.id)));
        }
        // The shape is checked before anything is written (KVM's own refusals come later).
        if s.lapic.is_some() != self.has_lapic {
            return Err(Error::Restore("LAPIC state does not match the irqchip mode".into()));
        }
        if s.msrs.len() > kvm_bindings::KVM_MAX_MSR_ENTRIES {
            return Err(Error::Restore(format!(
                "MSRs: {} saved, at most {}",
                s.msrs.len(),
                kvm_bindings::KVM_MAX_MSR_ENTRIES
            )));
        }
        let fd = &self.fd;
        fd.set_mp_state(s.mp_state).map_err(|e| Error::Kvm("KVM_SET_MP_STATE", e))?;
        fd.set_sregs(&s.sregs).map_err(|e| Error::Kvm("KVM_SET_SREGS", e))?;
        fd.set_regs(&s.regs).map_err(|e| Error::Kvm("KVM_SET_REGS", e))?;
        // SAFETY: `s.xsave` is a whole kvm_xsave read by KVM_GET_XSAVE on a vCPU of the same
        // kind; KVM validates its contents.
        unsafe { fd.set_xsave(&s.xsave) }.map_err(|e| Error::Kvm("KVM_SET_XSAVE", e))?;
        fd.set_xcrs(&s.xcrs).map_err(|e| Error::Kvm("KVM_SET_XCRS", e))?;
        if let Some(l) = &s.lapic {
            fd.set_lapic(l).map_err(|e| Error::Kvm("KVM_SET_LAPIC", e))?;
        }
        let mut rest: &[kvm_msr_entry] = &s.msrs;
        while !rest.is_empty() {
            let msrs = Msrs::from_entries(rest).map_err(|e| Error::Restore(format!("MSRs: {e:?}")))?;
            let n = fd.set_msrs(&msrs).map_err(|e| Error::Kvm("KVM_SET_MSRS", e))?;
            if n < rest.len() {
                tracing::debug!(
                    cpu = self.id,
                    msr = format_args!("{:#x}", rest[n].index),
                    "MSR not restorable, skipped"
                );
            }
            rest = &rest[(n + 1).min(rest.len())..];
        }
        fd.set_debug_regs(&s.debugregs).map_err(|e| Error::Kvm("KVM_SET_DEBUGREGS", e))?;
        fd.set_vcpu_events(&s.events).map_err(|e| Error::Kvm("KVM_SET_VCPU_EVENTS", e))?;
        self.calibrate_tsc()
    }
}

/// Guest-virtual memory and MXCSR of one vCPU, for `assist::execute`.
struct VcpuMem<'a> {
    fd: &'a VcpuFd,
    mem: &'a crate::GuestMemory,
    /// Never read or written: fenced memory is mapped PROT_NONE in kumo too.
    fences: &'a crate::memory::Fences,
}

impl VcpuMem<'_> {
    /// Guest-physical address of `gva` through the vCPU's page tables (KVM_TRANSLATE).
    fn translate(&self, gva: u64, write: bool) -> Option<u64> {
        let t = self.fd.translate_gva(gva).ok()?;
        (t.valid != 0 && (!write || t.writeable != 0)).then_some(t.physical_address)
    }

    /// Calls `f(gpa, range)` for each page-contiguous piece of `[gva, gva + len)`; stops at the
    /// first piece that does not translate or that `f` refuses. Returns the bytes covered.
    fn pieces(
        &self,
        gva: u64,
        len: usize,
        write: bool,
        mut f: impl FnMut(u64, std::ops::Range<usize>) -> bool,
    ) -> usize {
        let mut done = 0;
        while done < len {
            let va = gva.wrapping_add(done as u64);
            let n = ((0x1000 - (va & 0xfff)) as usize).min(len - done);
            match self.translate(va, write) {
                Some(gpa) if self.fences.find(gpa).is_none() && f(gpa, done..done + n) => done += n,
                _ => break,
            }
        }
        done
    }

    /// Reads as much of `buf` from `gva` as is mapped RAM (an instruction fetch near the end of
    /// a mapping); returns the count.
    fn read_prefix(&self, gva: u64, buf: &mut [u8]) -> usize {
        let len = buf.len();
        self.pieces(gva, len, false, |gpa, r| self.mem.read_slice(&mut buf[r], GuestAddress(gpa)).is_ok())
    }
}

impl AssistCpu for VcpuMem<'_> {
    fn read_virt(&mut self, gva: u64, buf: &mut [u8]) -> bool {
        self.read_prefix(gva, buf) == buf.len()
    }

    fn write_virt(&mut self, gva: u64, buf: &[u8]) -> bool {
        // Translate every page before writing any, so a fault writes nothing.
        if self.pieces(gva, buf.len(), true, |_, _| true) != buf.len() {
            return false;
        }
        self.pieces(gva, buf.len(), true, |gpa, r| self.mem.write_slice(&buf[r], GuestAddress(gpa)).is_ok())
            == buf.len()
    }

    fn mxcsr(&mut self) -> Result<(u32, u32)> {
        let x = self.fd.get_xsave().map_err(|e| Error::Kvm("KVM_GET_XSAVE", e))?;
        Ok((assist::xsave_mxcsr(&x.region), assist::xsave_mxcsr_mask(&x.region)))
    }

    fn rdmsr(&mut self, index: u32) -> Result<Option<u64>> {
        let mut msrs = Msrs::from_entries(&[kvm_msr_entry { index, ..Default::default() }]).expect("one MSR");
        let n = self.fd.get_msrs(&mut msrs).map_err(|e| Error::Kvm("KVM_GET_MSRS", e))?;
        Ok((n == 1).then(|| msrs.as_slice()[0].data))
    }

    fn set_mxcsr(&mut self, mxcsr: u32) -> Result<()> {
        // KVM_SET_FPU does not change MXCSR on this host; KVM_SET_XSAVE does.
        let mut x = self.fd.get_xsave().map_err(|e| Error::Kvm("KVM_GET_XSAVE", e))?;
        assist::set_xsave_mxcsr(&mut x.region, mxcsr);
        // SAFETY: `x` is the whole kvm_xsave KVM_GET_XSAVE just returned for this vCPU, with only
        // the MXCSR word changed; KVM validates the contents.
        unsafe { self.fd.set_xsave(&x) }.map_err(|e| Error::Kvm("KVM_SET_XSAVE", e))
    }
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], offset: usize, mode: u32) {
    let mut v = [0u8; 4];
    for (i, b) in v.iter_mut().enumerate() {
        *b = regs[offset + i] as u8;
    }
    let val = (u32::from_le_bytes(v) & !0x700) | mode;
    for (i, b) in val.to_le_bytes().iter().enumerate() {
        regs[offset + i] = *b as std::os::raw::c_char;
    }
}

/// A vCPU saves and restores through the persist pattern, as devices do (`crate::state`).
impl kumo_devices::Persist for Vcpu {
    type State = VcpuState;
    fn id(&self) -> String {
        crate::state::vcpu_id(self.id)
    }
    fn save(&self) -> std::result::Result<VcpuState, kumo_devices::PersistError> {
        self.save_state().map_err(|e| kumo_devices::PersistError::component(crate::state::vcpu_id(self.id), e))
    }
    fn restore(&mut self, s: &VcpuState) -> std::result::Result<(), kumo_devices::PersistError> {
        self.restore_state(s).map_err(|e| kumo_devices::PersistError::component(crate::state::vcpu_id(self.id), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapic_lint_mode_bits() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        regs[APIC_LVT_LINT0] = 0x10; // vector bits stay
        regs[APIC_LVT_LINT0 + 1] = 0x01; // a stale delivery mode is replaced
        set_lapic_reg(&mut regs, APIC_LVT_LINT0, APIC_MODE_EXTINT);
        assert_eq!(regs[APIC_LVT_LINT0] as u8, 0x10);
        assert_eq!(regs[APIC_LVT_LINT0 + 1] as u8, 0x07);
    }

    /// Found by kumo-fuzz (target `vcpu-restore`): a state refused for its shape (a LAPIC the
    /// irqchip mode does not have, too many MSRs) had its registers written before the check.
    #[test]
    fn a_state_of_the_wrong_shape_is_refused_before_anything_is_written() {
        let Some(g) = crate::testing::RawGuest::new(&[0xf4], &[]) else { return };
        let good = g.vcpu.save_state().unwrap();
        let regs = |v: &Vcpu| v.save_state().unwrap().regs;
        let before = regs(&g.vcpu);
        let mut no_lapic = crate::state::VcpuState { lapic: None, ..g.vcpu.save_state().unwrap() };
        no_lapic.regs.rip += 0x1000;
        let e = g.vcpu.restore_state(&no_lapic).unwrap_err().to_string();
        assert!(e.contains("LAPIC state does not match"), "{e}");
        let mut many = g.vcpu.save_state().unwrap();
        many.regs.rip += 0x2000;
        many.msrs = vec![kvm_msr_entry { index: 0x10, ..Default::default() }; kvm_bindings::KVM_MAX_MSR_ENTRIES + 1];
        let e = g.vcpu.restore_state(&many).unwrap_err().to_string();
        assert!(e.contains("MSRs"), "{e}");
        assert_eq!(format!("{:?}", regs(&g.vcpu)), format!("{before:?}"), "a refused state changes nothing");
        g.vcpu.restore_state(&good).unwrap();
    }
}
