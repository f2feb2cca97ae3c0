//! `--irqchip user`: kumo's own local APICs (`kumo_devices::apic::LocalApic`, one per vCPU)
//! instead of KVM's. This module is the wiring around the register model: the per-vCPU state a
//! vCPU thread and other threads share (the APIC, a halted vCPU's wake-up, pending NMI/INIT/SIPI),
//! IPI routing between vCPUs, a host timer thread per vCPU for the LAPIC timer, and the kick
//! that gets a vCPU out of `KVM_RUN` when an interrupt arrives for it.
//!
//! The vCPU side (injection through interrupt windows, xAPIC MMIO and APIC MSR exits) is in
//! `vcpu`. A kick is the VMM's kick signal to the vCPU's thread; its handler calls
//! [`crate::vcpu::on_kick_signal`], which sets `kvm_run.immediate_exit`, so a kick that lands
//! just before `KVM_RUN` is not lost.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use kumo_devices::apic::{ApicEvent, Clock, Delivery, IoApic, Ipi, LocalApic, Pic};

/// The ports of the 8259 pair and its ELCR, which `--irqchip user` serves from [`UserApics`].
pub fn pic_port(port: u16) -> bool {
    matches!(port, 0x20 | 0x21 | 0xA0 | 0xA1 | 0x4D0 | 0x4D1)
}

/// The MSRs the user APIC owns (KVM_X86_SET_MSR_FILTER sends them to kumo): IA32_APIC_BASE,
/// IA32_TSC_DEADLINE and the x2APIC range.
pub const APIC_MSRS: [(u32, u32); 3] = [
    (kumo_devices::apic::APIC_BASE_MSR, 1),
    (kumo_devices::apic::TSC_DEADLINE_MSR, 1),
    (
        kumo_devices::apic::X2APIC_MSR_FIRST,
        kumo_devices::apic::X2APIC_MSR_LAST - kumo_devices::apic::X2APIC_MSR_FIRST + 1,
    ),
];

/// The longest a timer thread sleeps before it checks whether its VM is gone.
const TIMER_POLL: Duration = Duration::from_millis(100);

/// The host's time for the APICs: CLOCK_MONOTONIC and the guest's TSC (the host TSC plus the
/// offset KVM gave the guest, measured when the vCPUs are configured).
#[derive(Debug, Default)]
pub struct HostClock {
    tsc_offset: AtomicU64,
    tsc_hz: AtomicU64,
}

impl HostClock {
    /// Records the guest TSC read at host TSC `host_tsc`, and its rate.
    pub fn calibrate(&self, guest_tsc: u64, host_tsc: u64, tsc_hz: u64) {
        self.tsc_offset.store(guest_tsc.wrapping_sub(host_tsc), Ordering::Release);
        self.tsc_hz.store(tsc_hz, Ordering::Release);
    }
}

/// The host TSC.
pub fn host_tsc() -> u64 {
    // SAFETY: RDTSC has no side effects and every x86-64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

impl Clock for HostClock {
    fn now_ns(&self) -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes into the timespec we pass.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    fn tsc(&self) -> u64 {
        host_tsc().wrapping_add(self.tsc_offset.load(Ordering::Acquire))
    }

    fn tsc_hz(&self) -> u64 {
        self.tsc_hz.load(Ordering::Acquire).max(1)
    }
}

/// One vCPU's APIC and what other threads leave for its thread.
pub struct CpuState {
    pub lapic: LocalApic,
    /// An NMI to inject (`KVM_NMI`) before the next entry.
    pub nmi: bool,
    /// The vCPU waits for a SIPI (after INIT, or a Linux AP before its first start).
    pub wait_sipi: bool,
    /// A SIPI's vector for a vCPU in wait-for-SIPI.
    pub sipi: Option<u8>,
    /// The vCPU's thread is inside (or about to enter) KVM_RUN: a kick must signal it.
    pub running: bool,
    /// The vCPU's thread (pthread_t), once it has run.
    pub thread: Option<libc::pthread_t>,
}

impl CpuState {
    /// Whether a halted (or SIPI-waiting) vCPU has a reason to run again.
    fn has_work(&self) -> bool {
        if self.wait_sipi {
            return self.sipi.is_some();
        }
        self.nmi || self.lapic.pending_vector().is_some()
    }
}

pub struct CpuApic {
    state: Mutex<CpuState>,
    /// A halted vCPU waits here.
    wake: Condvar,
    /// The timer thread waits here; notified when the guest reprograms the timer.
    timer: Condvar,
}

/// The VM's user APICs.
pub struct UserApics {
    cpus: Vec<CpuApic>,
    /// The IOAPIC: legacy device pins (COM1's IRQ 4) reach the LAPICs through it.
    ioapic: Mutex<IoApic>,
    /// The 8259 pair: the same ISA lines, to the BSP's LINT0 (ExtINT) if the guest uses it.
    /// Lock order: the PIC before any vCPU's state.
    pic: Mutex<Pic>,
    /// The PIC's INTR output, readable without its lock (the BSP's injection and halt look).
    pic_intr: AtomicBool,
    clock: Arc<HostClock>,
    kick_signal: libc::c_int,
    timers_started: AtomicBool,
}

fn lock(m: &Mutex<CpuState>) -> MutexGuard<'_, CpuState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl UserApics {
    /// APICs for `ncpus` vCPUs (APIC id = vCPU index, vCPU 0 the BSP). `kick_signal` is the
    /// signal whose handler calls [`crate::vcpu::on_kick_signal`].
    pub fn new(ncpus: u32, kick_signal: libc::c_int) -> Arc<Self> {
        let clock = Arc::new(HostClock::default());
        let cpus = (0..ncpus)
            .map(|i| CpuApic {
                state: Mutex::new(CpuState {
                    lapic: LocalApic::new(i, i == 0, clock.clone()),
                    nmi: false,
                    wait_sipi: false,
                    sipi: None,
                    running: false,
                    thread: None,
                }),
                wake: Condvar::new(),
                timer: Condvar::new(),
            })
            .collect();
        Arc::new(UserApics {
            cpus,
            ioapic: Mutex::new(IoApic::new()),
            pic: Mutex::new(Pic::new()),
            pic_intr: AtomicBool::new(false),
            clock,
            kick_signal,
            timers_started: AtomicBool::new(false),
        })
    }

    fn ioapic(&self) -> MutexGuard<'_, IoApic> {
        self.ioapic.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A read of the IOAPIC's page (offset within it).
    pub fn ioapic_read(&self, offset: u64, data: &mut [u8]) {
        self.ioapic().read_mmio(offset, data);
    }

    /// A write to the IOAPIC's page; an interrupt it sends is delivered.
    pub fn ioapic_write(&self, offset: u64, data: &[u8]) {
        let ipi = self.ioapic().write_mmio(offset, data);
        if let Some(ipi) = ipi {
            self.send_ipi(&ipi);
        }
    }

    /// An edge on IOAPIC pin `pin` (a legacy device's irqfd signal); ISA lines (0..16) also
    /// reach the PIC, as on a PC.
    pub fn pulse_pin(&self, pin: u32) {
        let ipi = self.ioapic().pulse(pin as usize);
        if let Some(ipi) = ipi {
            self.send_ipi(&ipi);
        }
        if pin < 16 {
            let mut pic = self.pic();
            pic.pulse(pin);
            self.pic_changed(&pic);
        }
    }

    fn pic(&self) -> MutexGuard<'_, Pic> {
        self.pic.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After any change to the PIC (its lock held): publishes INTR and, if it is up, gets the
    /// BSP to look (its LINT0 decides whether it takes it).
    fn pic_changed(&self, pic: &Pic) {
        let intr = pic.intr();
        self.pic_intr.store(intr, Ordering::Release);
        if intr {
            if let Some(c) = self.cpus.first() {
                let s = lock(&c.state);
                if s.lapic.extint_ready() {
                    self.kick_locked(0, &s);
                }
            }
        }
    }

    /// A read of a PIC or ELCR port (see [`pic_port`]).
    pub fn pic_read(&self, port: u16, data: &mut [u8]) {
        let v = self.pic().read_port(port);
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = v;
        }
    }

    /// A write to a PIC or ELCR port.
    pub fn pic_write(&self, port: u16, data: &[u8]) {
        let mut pic = self.pic();
        pic.write_port(port, data.first().copied().unwrap_or(0));
        self.pic_changed(&pic);
    }

    /// Whether the PIC has an interrupt for the BSP whose APIC (`s`, locked) takes ExtINT now.
    pub fn pic_pending_for(&self, cpu: u32, s: &CpuState) -> bool {
        cpu == 0 && self.pic_intr.load(Ordering::Acquire) && s.lapic.extint_ready()
    }

    /// The INTA cycle for the BSP: the PIC's vector (its spurious vector if the request went
    /// away meanwhile).
    pub fn pic_ack(&self) -> u8 {
        let mut pic = self.pic();
        let v = pic.ack();
        self.pic_intr.store(pic.intr(), Ordering::Release);
        v
    }

    pub fn pic_state(&self) -> kumo_devices::apic::PicState {
        self.pic().clone()
    }

    /// Puts back a saved 8259 state through its own checks (a state the 8259A cannot be in is
    /// refused and changes nothing).
    pub fn set_pic_state(&self, s: &kumo_devices::apic::PicState) -> Result<(), kumo_devices::PersistError> {
        let mut pic = self.pic();
        kumo_devices::Persist::restore(&mut *pic, s)?;
        self.pic_intr.store(pic.intr(), Ordering::Release);
        Ok(())
    }

    /// An MSI message (a device's MSI-X vector), delivered like the IPI it describes.
    pub fn msi(&self, address: u64, data: u32) {
        match Ipi::from_msi(address, data) {
            Some(ipi) => self.send_ipi(&ipi),
            None => tracing::debug!(address, data, "MSI with a mode kumo does not deliver: dropped"),
        }
    }

    /// The IOAPIC's state (snapshots).
    pub fn ioapic_state(&self) -> kumo_devices::apic::IoApicState {
        self.ioapic().state()
    }

    pub fn set_ioapic_state(&self, s: &kumo_devices::apic::IoApicState) -> Result<(), String> {
        self.ioapic().set_state(s)
    }

    pub fn clock(&self) -> &HostClock {
        &self.clock
    }

    pub fn len(&self) -> usize {
        self.cpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cpus.is_empty()
    }

    /// vCPU `cpu`'s state, locked. Panics on an index that is not a vCPU (kumo's own bug).
    pub fn lock(&self, cpu: u32) -> MutexGuard<'_, CpuState> {
        lock(&self.cpus[cpu as usize].state)
    }

    /// Starts one host timer thread per vCPU (once). They end when the `UserApics` is dropped.
    pub fn start_timers(self: &Arc<Self>) -> std::io::Result<()> {
        if self.timers_started.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        for cpu in 0..self.cpus.len() as u32 {
            let weak = Arc::downgrade(self);
            kumo_sandbox::spawn(kumo_sandbox::ThreadKind::Device, format!("lapic-timer{cpu}"), move || {
                timer_thread(weak, cpu)
            })?;
        }
        Ok(())
    }

    /// Gets vCPU `cpu` to look at its APIC: wakes it if halted, and gets it out of KVM_RUN if it
    /// is inside. Call with its state locked (`s`).
    fn kick_locked(&self, cpu: u32, s: &CpuState) {
        self.cpus[cpu as usize].wake.notify_all();
        if let (true, Some(t)) = (s.running, s.thread) {
            // SAFETY: `t` is the pthread_t of a vCPU thread that is running (it clears
            // `running` under this lock before it exits), and the signal has a handler.
            unsafe { libc::pthread_kill(t, self.kick_signal) };
        }
    }

    /// Wakes every halted vCPU (a pause or stop request: the caller's `stop` says which).
    pub fn wake_all(&self) {
        for c in &self.cpus {
            let _g = lock(&c.state);
            c.wake.notify_all();
        }
    }

    /// A fixed interrupt for vCPU `cpu`'s APIC (a device's, through the IOAPIC or an MSI).
    pub fn raise(&self, cpu: u32, vector: u8, level: bool) {
        let Some(c) = self.cpus.get(cpu as usize) else { return };
        let mut s = lock(&c.state);
        if s.lapic.accept(vector, level) {
            self.kick_locked(cpu, &s);
        }
    }

    /// Delivers an IPI (from an ICR write or an MSI) to every APIC it names.
    pub fn send_ipi(&self, ipi: &Ipi) {
        let addrs: Vec<_> = self.cpus.iter().map(|c| lock(&c.state).lapic.address()).collect();
        for t in ipi.targets(&addrs) {
            let cpu = t as u32;
            let mut s = lock(&self.cpus[t].state);
            match s.lapic.deliver(ipi) {
                Delivery::Accepted => self.kick_locked(cpu, &s),
                Delivery::Nmi => {
                    s.nmi = true;
                    self.kick_locked(cpu, &s);
                }
                Delivery::Init => {
                    s.wait_sipi = true;
                    s.sipi = None;
                    self.kick_locked(cpu, &s);
                    self.cpus[t].timer.notify_all();
                }
                Delivery::Startup(v) if s.wait_sipi => {
                    s.sipi = Some(v);
                    self.kick_locked(cpu, &s);
                }
                Delivery::Startup(_) | Delivery::Dropped | Delivery::ExtInt => {}
            }
        }
    }

    /// Acts on what a register write of vCPU `cpu` returned. Call without its state locked.
    pub fn handle_event(&self, cpu: u32, ev: ApicEvent) {
        match ev {
            ApicEvent::Ipi(ipi) => self.send_ipi(&ipi),
            ApicEvent::TimerChanged => {
                let _g = lock(&self.cpus[cpu as usize].state);
                self.cpus[cpu as usize].timer.notify_all();
            }
            ApicEvent::LevelEoi(v) => {
                let again = self.ioapic().eoi(v);
                for ipi in again {
                    self.send_ipi(&ipi);
                }
            }
            // The page's address is read at each access: a moved base needs nothing here.
            ApicEvent::BaseChanged => {}
        }
    }

    /// A halted vCPU waits until its APIC has something for it or `stop()` says to return
    /// (a pause or stop request; [`UserApics::wake_all`] wakes it to look).
    pub fn halt(&self, cpu: u32, stop: impl Fn() -> bool) {
        let c = &self.cpus[cpu as usize];
        let mut s = lock(&c.state);
        while !s.has_work() && !self.pic_pending_for(cpu, &s) && !stop() {
            s = c.wake.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// vCPU `cpu`'s LAPIC timer on the host: sleeps until the APIC's next deadline, then expires it
/// and kicks the vCPU if that raised its vector.
fn timer_thread(apics: Weak<UserApics>, cpu: u32) {
    loop {
        let Some(a) = apics.upgrade() else { return };
        let c = &a.cpus[cpu as usize];
        let mut s = lock(&c.state);
        let now = a.clock.now_ns();
        let wait = match s.lapic.next_deadline() {
            Some(d) if d <= now => {
                if s.lapic.expire() {
                    a.kick_locked(cpu, &s);
                }
                if s.lapic.next_deadline() == Some(d) {
                    // The model did not move the deadline (it would have expired): do not spin.
                    TIMER_POLL
                } else {
                    continue;
                }
            }
            Some(d) => Duration::from_nanos(d - now).min(TIMER_POLL),
            None => TIMER_POLL,
        };
        drop(c.timer.wait_timeout(s, wait).unwrap_or_else(|p| p.into_inner()));
    }
}

pub use kumo_devices::apic::UserLapicState;

/// vCPU `cpu`'s APIC as a persistable component.
pub struct LapicPersist {
    apics: Arc<UserApics>,
    cpu: u32,
}

/// The IOAPIC as a persistable component (`ioapic`).
pub struct IoApicPersist(Arc<UserApics>);

/// The 8259 pair as a persistable component (`pic`).
pub struct PicPersist(Arc<UserApics>);

impl UserApics {
    /// Every component to save and restore with the VM: each LAPIC, the IOAPIC and the PIC.
    pub fn persist_list(self: &Arc<Self>) -> Vec<Arc<Mutex<dyn kumo_devices::PersistDyn>>> {
        let mut v: Vec<Arc<Mutex<dyn kumo_devices::PersistDyn>>> = (0..self.cpus.len() as u32)
            .map(|cpu| Arc::new(Mutex::new(LapicPersist { apics: self.clone(), cpu })) as _)
            .collect();
        v.push(Arc::new(Mutex::new(IoApicPersist(self.clone()))));
        v.push(Arc::new(Mutex::new(PicPersist(self.clone()))));
        v
    }
}

impl kumo_devices::Persist for LapicPersist {
    type State = UserLapicState;
    fn id(&self) -> String {
        format!("lapic{}", self.cpu)
    }
    fn save(&self) -> Result<UserLapicState, kumo_devices::PersistError> {
        let mut s = self.apics.lock(self.cpu);
        // A timer that is due but not yet raised would be lost: raise it now, into IRR.
        s.lapic.expire();
        Ok(UserLapicState { lapic: s.lapic.save()?, wait_sipi: s.wait_sipi, nmi: s.nmi })
    }
    fn restore(&mut self, st: &UserLapicState) -> Result<(), kumo_devices::PersistError> {
        let c = &self.apics.cpus[self.cpu as usize];
        let mut s = lock(&c.state);
        s.lapic.restore(&st.lapic)?;
        s.wait_sipi = st.wait_sipi;
        s.sipi = None;
        s.nmi = st.nmi;
        c.timer.notify_all();
        c.wake.notify_all();
        Ok(())
    }
}

impl kumo_devices::Persist for IoApicPersist {
    type State = kumo_devices::apic::IoApicState;
    fn id(&self) -> String {
        "ioapic".into()
    }
    fn save(&self) -> Result<Self::State, kumo_devices::PersistError> {
        Ok(self.0.ioapic_state())
    }
    fn restore(&mut self, s: &Self::State) -> Result<(), kumo_devices::PersistError> {
        self.0.set_ioapic_state(s).map_err(|e| kumo_devices::PersistError::component("ioapic", e))
    }
}

impl kumo_devices::Persist for PicPersist {
    type State = kumo_devices::apic::PicState;
    fn id(&self) -> String {
        "pic".into()
    }
    fn save(&self) -> Result<Self::State, kumo_devices::PersistError> {
        Ok(self.0.pic_state())
    }
    fn restore(&mut self, s: &Self::State) -> Result<(), kumo_devices::PersistError> {
        self.0.set_pic_state(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enable(a: &UserApics, cpu: u32) {
        a.lock(cpu).lapic.write_mmio(0xF0, &0x1FFu32.to_le_bytes());
    }

    /// vCPU `from` writes the ICR (high word first); the event is routed as the vCPU thread does.
    fn icr(a: &UserApics, from: u32, dest: u8, low: u32) {
        let ev = {
            let mut s = a.lock(from);
            s.lapic.write_mmio(0x310, &((dest as u32) << 24).to_le_bytes());
            s.lapic.write_mmio(0x300, &low.to_le_bytes())
        };
        a.handle_event(from, ev.expect("an ICR write sends an IPI"));
    }

    #[test]
    fn icr_ipis_reach_the_target_and_wake_it() {
        let a = UserApics::new(2, 0);
        enable(&a, 0);
        enable(&a, 1);
        icr(&a, 0, 1, 0x40); // fixed, vector 0x40, physical APIC 1
        assert_eq!(a.lock(1).lapic.pending_vector(), Some(0x40));
        assert_eq!(a.lock(0).lapic.pending_vector(), None);
        a.halt(1, || false); // has work: returns at once
        icr(&a, 1, 0, 0x400); // NMI to APIC 0
        assert!(a.lock(0).nmi);
        icr(&a, 0, 9, 0x41); // nobody has APIC id 9: dropped, no panic
        assert_eq!(a.lock(1).lapic.pending_vector(), Some(0x40));
    }

    #[test]
    fn init_then_sipi_starts_a_waiting_vcpu_once() {
        let a = UserApics::new(2, 0);
        enable(&a, 0);
        icr(&a, 0, 1, 0x4500); // INIT, level assert
        assert!(a.lock(1).wait_sipi);
        icr(&a, 0, 1, 0x4609); // SIPI, vector 9: start at 0x9000
        assert_eq!(a.lock(1).sipi, Some(9));
        a.halt(1, || false);
        // A SIPI to a vCPU not waiting for one is ignored.
        icr(&a, 1, 0, 0x4608);
        assert_eq!(a.lock(0).sipi, None);
    }

    #[test]
    fn ioapic_pin_and_msi_reach_the_named_apic_and_level_eoi_re_sends() {
        let a = UserApics::new(2, 0);
        enable(&a, 0);
        enable(&a, 1);
        // Pin 9: vector 0x39, level, to APIC 1; held high.
        a.ioapic_write(0, &0x22u32.to_le_bytes());
        a.ioapic_write(0x10, &(0x39u32 | 1 << 15).to_le_bytes());
        a.ioapic_write(0, &0x23u32.to_le_bytes());
        a.ioapic_write(0x10, &(1u32 << 24).to_le_bytes());
        let ipi = a.ioapic().set_irq(9, true).expect("sent");
        a.send_ipi(&ipi);
        let v = a.lock(1).lapic.ack();
        assert_eq!(v, Some(0x39));
        // The guest's EOI of the level vector: the pin is still high, so it comes again.
        let ev = a.lock(1).lapic.eoi().expect("level EOI");
        a.handle_event(1, ev);
        assert_eq!(a.lock(1).lapic.pending_vector(), Some(0x39));
        a.msi(0xFEE0_0000, 0x51); // to APIC 0
        assert_eq!(a.lock(0).lapic.pending_vector(), Some(0x51));
        a.msi(0xFEE0_0000, 0x0200); // SMI: dropped
    }

    #[test]
    fn isa_lines_reach_the_bsp_through_the_pic_and_lint0() {
        let a = UserApics::new(2, 0);
        // An uninitialised PIC delivers nothing.
        a.pulse_pin(4);
        assert!(!a.pic_pending_for(0, &a.lock(0)));
        // Linux's init: vectors 0x30/0x38, cascade on IRQ 2, 8086 mode; everything unmasked.
        for (port, v) in [(0x20u16, 0x11u8), (0x21, 0x30), (0x21, 0x04), (0x21, 0x01), (0x21, 0x00)] {
            a.pic_write(port, &[v]);
        }
        for (port, v) in [(0xA0u16, 0x11u8), (0xA1, 0x38), (0xA1, 0x02), (0xA1, 0x01), (0xA1, 0x00)] {
            a.pic_write(port, &[v]);
        }
        a.pulse_pin(4);
        // The BSP's LINT0 is ExtINT after reset (virtual wire); an AP never takes the PIC's.
        assert!(a.pic_pending_for(0, &a.lock(0)));
        assert!(!a.pic_pending_for(1, &a.lock(1)));
        assert_eq!(a.pic_ack(), 0x34);
        assert!(!a.pic_pending_for(0, &a.lock(0)));
        let mut isr = [0u8];
        a.pic_write(0x20, &[0x0B]);
        a.pic_read(0x20, &mut isr);
        assert_eq!(isr[0], 1 << 4, "IRQ 4 in service until the EOI");
        a.pic_write(0x20, &[0x20]);
        // A masked LINT0 keeps the PIC's interrupt away from the BSP (LVT writes need the APIC
        // software-enabled to unmask).
        enable(&a, 0);
        a.lock(0).lapic.write_mmio(0x350, &0x1_0700u32.to_le_bytes());
        a.pulse_pin(4);
        assert!(!a.pic_pending_for(0, &a.lock(0)));
        a.lock(0).lapic.write_mmio(0x350, &0x700u32.to_le_bytes());
        assert!(a.pic_pending_for(0, &a.lock(0)));
        // The PIC is in the component list and its state round-trips.
        let list = a.persist_list();
        assert!(list.iter().any(|c| c.lock().unwrap().id() == "pic"));
        let st = a.pic_state();
        let b = UserApics::new(2, 0);
        b.set_pic_state(&st).unwrap();
        assert!(b.pic_pending_for(0, &b.lock(0)));
        // The VM's restore goes through the 8259's own checks (found by kumo-fuzz `restore`:
        // this path assigned the state as it came).
        let mut bad = serde_json::to_value(&st).unwrap();
        bad["master"]["init_step"] = 9.into();
        let bad: kumo_devices::apic::PicState = serde_json::from_value(bad).unwrap();
        let c = UserApics::new(2, 0);
        assert!(c.set_pic_state(&bad).unwrap_err().to_string().contains("impossible master state"));
        assert_eq!(c.pic_state(), kumo_devices::apic::Pic::new());
    }
}
