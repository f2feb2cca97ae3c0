//! Interrupt routing at the KVM edge: the one place that allocates GSIs, keeps the GSI routing
//! table (irqchip pins and MSI messages), and registers irqfds and ioeventfds with KVM.
//!
//! Devices never talk to KVM: they signal an eventfd (an irqfd) to raise an interrupt and see
//! guest doorbell writes as a readable eventfd (an ioeventfd). Which GSI an irqfd raises, and
//! where that GSI goes (an IOAPIC pin, or an MSI address/data pair a guest programmed into an
//! MSI-X table), is decided here. `KVM_SET_GSI_ROUTING` replaces KVM's whole table, so the table
//! is kept in full on this side ([`RouteTable`]) and re-sent on each change: re-targeting one MSI
//! vector leaves every other route as it was.
//!
//! GSIs `0..24` are the IOAPIC's (and, below 16, the PIC's) pins, routed as KVM routes them by
//! default; MSI GSIs are allocated from 24 up ([`GsiAllocator`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use kumo_devices::pci::MsixRouting;

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_MAX_IRQ_ROUTES,
};
use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::uapic::UserApics;

/// Where the interrupt controllers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IrqchipMode {
    /// PIC, IOAPIC, LAPICs and PIT all in KVM.
    #[default]
    Kernel,
    /// LAPICs in KVM; PIC/IOAPIC/PIT left to userspace (interrupts arrive as MSIs).
    Split,
    /// No interrupt controller in KVM: kumo emulates the LAPICs (`crate::uapic`).
    User,
}

impl std::fmt::Display for IrqchipMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IrqchipMode::Kernel => "kernel",
            IrqchipMode::Split => "split",
            IrqchipMode::User => "user",
        })
    }
}

/// IOAPIC input pins; also the first GSI handed out for MSIs.
pub const IOAPIC_PINS: u32 = 24;
/// Legacy PIC pins (two cascaded 8259s).
pub const PIC_PINS: u32 = 16;
/// Routes KVM takes in one table (4096 on x86).
const MAX_ROUTES: u32 = KVM_MAX_IRQ_ROUTES as u32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IrqError {
    #[error("no free GSI for an MSI route (all {0} are in use)")]
    GsiExhausted(u32),
    #[error("GSI {0} is not an allocated MSI GSI")]
    NotAllocated(u32),
    #[error("{op} failed: {errno}")]
    Kvm { op: &'static str, errno: vmm_sys_util::errno::Error },
}

pub type Result<T> = std::result::Result<T, IrqError>;

fn kvm(op: &'static str) -> impl FnOnce(vmm_sys_util::errno::Error) -> IrqError {
    move |errno| IrqError::Kvm { op, errno }
}

/// An MSI message as a guest writes it into an MSI-X table entry: the PCI layer's type, so a
/// vector's message reaches a route unchanged.
pub use kumo_devices::pci::MsiMessage;

/// Where one GSI goes. A GSI may have several (legacy GSIs below 16 go to the PIC and the IOAPIC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Irqchip { chip: u32, pin: u32 },
    Msi(MsiMessage),
}

/// Hands out MSI GSIs: `IOAPIC_PINS..end`, lowest free first, reusing released ones.
#[derive(Debug)]
pub struct GsiAllocator {
    next: u32,
    end: u32,
    free: BTreeSet<u32>,
    used: BTreeSet<u32>,
}

impl GsiAllocator {
    /// MSI GSIs below `end` (KVM allows `KVM_MAX_IRQ_ROUTES` routes in all).
    pub fn new(end: u32) -> Self {
        GsiAllocator { next: IOAPIC_PINS, end, free: BTreeSet::new(), used: BTreeSet::new() }
    }

    pub fn allocate(&mut self) -> Result<u32> {
        let gsi = match self.free.pop_first() {
            Some(g) => g,
            None if self.next < self.end => {
                self.next += 1;
                self.next - 1
            }
            None => return Err(IrqError::GsiExhausted(self.end - IOAPIC_PINS)),
        };
        self.used.insert(gsi);
        Ok(gsi)
    }

    pub fn release(&mut self, gsi: u32) -> Result<()> {
        if !self.used.remove(&gsi) {
            return Err(IrqError::NotAllocated(gsi));
        }
        self.free.insert(gsi);
        Ok(())
    }

    pub fn is_allocated(&self, gsi: u32) -> bool {
        self.used.contains(&gsi)
    }
}

impl Default for GsiAllocator {
    fn default() -> Self {
        GsiAllocator::new(MAX_ROUTES)
    }
}

/// The whole GSI routing table, as `KVM_SET_GSI_ROUTING` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    routes: BTreeMap<u32, Vec<Route>>,
}

impl RouteTable {
    /// KVM's own default table for this irqchip mode (`kvm_setup_default_irq_routing`): GSIs
    /// below 16 to the PIC pin and the IOAPIC pin of the same number, 16..24 to the IOAPIC. A
    /// split irqchip has neither in the kernel, so its table starts empty.
    pub fn new(mode: IrqchipMode) -> Self {
        let mut routes = BTreeMap::new();
        if mode == IrqchipMode::Kernel {
            for gsi in 0..IOAPIC_PINS {
                let mut r = Vec::with_capacity(2);
                if gsi < PIC_PINS {
                    let (chip, pin) =
                        if gsi < 8 { (KVM_IRQCHIP_PIC_MASTER, gsi) } else { (KVM_IRQCHIP_PIC_SLAVE, gsi - 8) };
                    r.push(Route::Irqchip { chip, pin });
                }
                r.push(Route::Irqchip { chip: KVM_IRQCHIP_IOAPIC, pin: gsi });
                routes.insert(gsi, r);
            }
        }
        RouteTable { routes }
    }

    /// Sends `gsi` to `msg`, replacing whatever it routed to before.
    pub fn set_msi(&mut self, gsi: u32, msg: MsiMessage) {
        self.routes.insert(gsi, vec![Route::Msi(msg)]);
    }

    pub fn remove(&mut self, gsi: u32) -> Option<Vec<Route>> {
        self.routes.remove(&gsi)
    }

    pub fn get(&self, gsi: u32) -> Option<&[Route]> {
        self.routes.get(&gsi).map(Vec::as_slice)
    }

    /// The table as KVM's routing entries.
    pub fn entries(&self) -> Vec<kvm_irq_routing_entry> {
        let mut out = Vec::new();
        for (&gsi, routes) in &self.routes {
            for r in routes {
                let mut e = kvm_irq_routing_entry { gsi, ..Default::default() };
                match *r {
                    Route::Irqchip { chip, pin } => {
                        e.type_ = KVM_IRQ_ROUTING_IRQCHIP;
                        e.u.irqchip.irqchip = chip;
                        e.u.irqchip.pin = pin;
                    }
                    Route::Msi(m) => {
                        e.type_ = KVM_IRQ_ROUTING_MSI;
                        e.u.msi.address_lo = m.address as u32;
                        e.u.msi.address_hi = (m.address >> 32) as u32;
                        e.u.msi.data = m.data;
                    }
                }
                out.push(e);
            }
        }
        out
    }
}

/// What an ioeventfd fires on: any write to its address, or only a write of this value and width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datamatch {
    /// Any write to the address (KVM then ignores the access length).
    Any,
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
}

/// Where an ioeventfd listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoAddress {
    Pio(u16),
    Mmio(u64),
}

impl From<IoAddress> for IoEventAddress {
    fn from(a: IoAddress) -> Self {
        match a {
            IoAddress::Pio(p) => IoEventAddress::Pio(p.into()),
            IoAddress::Mmio(m) => IoEventAddress::Mmio(m),
        }
    }
}

struct Inner {
    gsis: GsiAllocator,
    table: RouteTable,
}

/// `--irqchip user`: KVM has no irqchip to take irqfds, so kumo delivers them. One thread
/// waits on every registered eventfd; a signal on a legacy GSI pulses that IOAPIC pin, on an
/// MSI GSI it sends the route's message to kumo's LAPICs.
pub struct UserIrqs {
    apics: Arc<UserApics>,
    epoll: Epoll,
    /// Registered eventfds by the raw fd of kumo's own copy: (GSI, the copy, the caller's fd).
    fds: Mutex<HashMap<i32, (u32, EventFd, i32)>>,
    table: Mutex<RouteTable>,
}

impl UserIrqs {
    fn new(apics: Arc<UserApics>) -> std::io::Result<Arc<Self>> {
        let u = Arc::new(UserIrqs {
            apics,
            epoll: Epoll::new()?,
            fds: Mutex::default(),
            table: Mutex::new(RouteTable::new(IrqchipMode::User)),
        });
        let weak = Arc::downgrade(&u);
        kumo_sandbox::spawn(kumo_sandbox::ThreadKind::Device, "user-irqs", move || user_irq_thread(weak))?;
        Ok(u)
    }

    fn raise(&self, gsi: u32) {
        if gsi < IOAPIC_PINS {
            self.apics.pulse_pin(gsi);
            return;
        }
        let routes = self.table.lock().unwrap_or_else(|p| p.into_inner()).get(gsi).map(<[Route]>::to_vec);
        for r in routes.unwrap_or_default() {
            if let Route::Msi(m) = r {
                self.apics.msi(m.address, m.data);
            }
        }
    }

    fn register(&self, evt: &EventFd, gsi: u32) -> Result<()> {
        let copy = evt.try_clone().map_err(|e| IrqError::Kvm { op: "eventfd", errno: e.into() })?;
        let fd = copy.as_raw_fd();
        let mut fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, fd as u64))
            .map_err(|e| IrqError::Kvm { op: "epoll_ctl", errno: e.into() })?;
        fds.insert(fd, (gsi, copy, evt.as_raw_fd()));
        Ok(())
    }

    fn unregister(&self, evt: &EventFd, gsi: u32) {
        let mut fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        let key = fds.iter().find(|(_, (g, _, caller))| *g == gsi && *caller == evt.as_raw_fd()).map(|(k, _)| *k);
        if let Some(k) = key {
            let _ = self.epoll.ctl(ControlOperation::Delete, k, EpollEvent::default());
            fds.remove(&k);
        }
    }
}

/// The user-irq thread: ends once its `UserIrqs` is gone (it looks every 100 ms).
fn user_irq_thread(u: std::sync::Weak<UserIrqs>) {
    let mut events = [EpollEvent::default(); 16];
    loop {
        let Some(u) = u.upgrade() else { return };
        let n = match u.epoll.wait(100, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => {
                tracing::error!("user irqchip: epoll_wait failed, device interrupts stop: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            let fd = ev.data() as i32;
            let gsi = {
                let fds = u.fds.lock().unwrap_or_else(|p| p.into_inner());
                // Reading resets the eventfd; several signals since are one interrupt (an edge).
                fds.get(&fd).and_then(|(gsi, e, _)| e.read().ok().map(|_| *gsi))
            };
            if let Some(gsi) = gsi {
                u.raise(gsi);
            }
        }
    }
}

/// A VM's interrupt routing and its irqfds and ioeventfds.
pub struct Interrupts {
    fd: Arc<VmFd>,
    mode: IrqchipMode,
    inner: Mutex<Inner>,
    /// `--irqchip user`: kumo delivers the irqfds.
    user: Option<Arc<UserIrqs>>,
}

impl Interrupts {
    pub fn new(fd: Arc<VmFd>, mode: IrqchipMode) -> Self {
        let inner = Inner { gsis: GsiAllocator::default(), table: RouteTable::new(mode) };
        Interrupts { fd, mode, inner: Mutex::new(inner), user: None }
    }

    /// Routing for `--irqchip user`: irqfds reach `apics` through kumo's own thread.
    pub fn new_user(fd: Arc<VmFd>, apics: Arc<UserApics>) -> std::io::Result<Self> {
        let mut i = Self::new(fd, IrqchipMode::User);
        i.user = Some(UserIrqs::new(apics)?);
        Ok(i)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn commit(&self, table: &RouteTable) -> Result<()> {
        if let Some(u) = &self.user {
            *u.table.lock().unwrap_or_else(|p| p.into_inner()) = table.clone();
            return Ok(());
        }
        let entries = table.entries();
        let routing =
            KvmIrqRouting::from_entries(&entries).map_err(|_| IrqError::GsiExhausted(MAX_ROUTES - IOAPIC_PINS))?;
        self.fd.set_gsi_routing(&routing).map_err(kvm("KVM_SET_GSI_ROUTING"))
    }

    /// A new GSI routed to `msg`, for an MSI or MSI-X vector.
    pub fn allocate_msi(&self, msg: MsiMessage) -> Result<u32> {
        let mut i = self.lock();
        let gsi = i.gsis.allocate()?;
        let mut table = i.table.clone();
        table.set_msi(gsi, msg);
        if let Err(e) = self.commit(&table) {
            let _ = i.gsis.release(gsi);
            return Err(e);
        }
        i.table = table;
        Ok(gsi)
    }

    /// Re-targets one MSI GSI (the guest rewrote its vector); other routes are unchanged.
    pub fn update_msi(&self, gsi: u32, msg: MsiMessage) -> Result<()> {
        let mut i = self.lock();
        if !i.gsis.is_allocated(gsi) {
            return Err(IrqError::NotAllocated(gsi));
        }
        let mut table = i.table.clone();
        table.set_msi(gsi, msg);
        self.commit(&table)?;
        i.table = table;
        Ok(())
    }

    /// Drops an MSI GSI's route and frees the GSI. Unregister its irqfd first.
    pub fn release_msi(&self, gsi: u32) -> Result<()> {
        let mut i = self.lock();
        if !i.gsis.is_allocated(gsi) {
            return Err(IrqError::NotAllocated(gsi));
        }
        let mut table = i.table.clone();
        table.remove(gsi);
        self.commit(&table)?;
        i.table = table;
        i.gsis.release(gsi)
    }

    /// Sends one MSI now, with no GSI or irqfd: a VMM-side notification (the elastic channel's
    /// vector). KVM's LAPICs take it through `KVM_SIGNAL_MSI`; with `--irqchip user` kumo's own
    /// LAPICs do, as a device's routed MSI reaches them.
    pub fn send_msi(&self, msg: MsiMessage) -> Result<()> {
        if let Some(u) = &self.user {
            u.apics.msi(msg.address, msg.data);
            return Ok(());
        }
        let msi = kvm_bindings::kvm_msi {
            address_lo: msg.address as u32,
            address_hi: (msg.address >> 32) as u32,
            data: msg.data,
            ..Default::default()
        };
        self.fd.signal_msi(msi).map(drop).map_err(kvm("KVM_SIGNAL_MSI"))
    }

    /// Whether `gsi` has somewhere to go: legacy pins only exist with the in-kernel irqchip.
    fn routable(&self, gsi: u32) -> bool {
        gsi >= IOAPIC_PINS || matches!(self.mode, IrqchipMode::Kernel | IrqchipMode::User)
    }

    /// Makes a signal on `evt` raise `gsi`. Returns false (and registers nothing) for a legacy
    /// pin with a split irqchip, which has no in-kernel IOAPIC: that device then runs polled.
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<bool> {
        if !self.routable(gsi) {
            return Ok(false);
        }
        if let Some(u) = &self.user {
            u.register(evt, gsi)?;
            return Ok(true);
        }
        self.fd.register_irqfd(evt, gsi).map_err(kvm("KVM_IRQFD"))?;
        Ok(true)
    }

    pub fn unregister_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<()> {
        if !self.routable(gsi) {
            return Ok(());
        }
        if let Some(u) = &self.user {
            u.unregister(evt, gsi);
            return Ok(());
        }
        self.fd.unregister_irqfd(evt, gsi).map_err(kvm("KVM_IRQFD(DEASSIGN)"))
    }

    /// Makes a guest write to `addr` (matching `datamatch`) signal `evt` inside KVM, without an
    /// exit to the VMM: a virtqueue's doorbell.
    pub fn register_ioeventfd(&self, evt: &EventFd, addr: IoAddress, datamatch: Datamatch) -> Result<()> {
        let a = addr.into();
        let r = match datamatch {
            Datamatch::Any => self.fd.register_ioevent(evt, &a, NoDatamatch),
            Datamatch::U8(v) => self.fd.register_ioevent(evt, &a, v),
            Datamatch::U16(v) => self.fd.register_ioevent(evt, &a, v),
            Datamatch::U32(v) => self.fd.register_ioevent(evt, &a, v),
            Datamatch::U64(v) => self.fd.register_ioevent(evt, &a, v),
        };
        r.map_err(kvm("KVM_IOEVENTFD"))
    }

    pub fn unregister_ioeventfd(&self, evt: &EventFd, addr: IoAddress, datamatch: Datamatch) -> Result<()> {
        let a = addr.into();
        let r = match datamatch {
            Datamatch::Any => self.fd.unregister_ioevent(evt, &a, NoDatamatch),
            Datamatch::U8(v) => self.fd.unregister_ioevent(evt, &a, v),
            Datamatch::U16(v) => self.fd.unregister_ioevent(evt, &a, v),
            Datamatch::U32(v) => self.fd.unregister_ioevent(evt, &a, v),
            Datamatch::U64(v) => self.fd.unregister_ioevent(evt, &a, v),
        };
        r.map_err(kvm("KVM_IOEVENTFD(DEASSIGN)"))
    }

    /// The current routes of `gsi` (for tests and diagnostics).
    pub fn routes(&self, gsi: u32) -> Vec<Route> {
        self.lock().table.get(gsi).map(<[Route]>::to_vec).unwrap_or_default()
    }
}

/// One PCI function's MSI-X vectors delivered by KVM (the PCI layer's [`MsixRouting`]): a
/// vector that has a message gets its own GSI, MSI route and irqfd; a new message rewrites that
/// route alone, so re-targeting one queue's vector to another vCPU leaves the others' routes
/// and irqfds untouched; a vector that must not be delivered (masked, disabled) loses its route
/// and GSI. Delivery is a write to the vector's irqfd: KVM injects it, with no hop through a
/// VMM thread.
pub struct MsixVectors {
    irq: Arc<Interrupts>,
    vectors: Mutex<BTreeMap<u16, (u32, EventFd, MsiMessage)>>,
}

impl MsixVectors {
    pub fn new(irq: Arc<Interrupts>) -> MsixVectors {
        MsixVectors { irq, vectors: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u16, (u32, EventFd, MsiMessage)>> {
        self.vectors.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The GSI vector `vector` is routed through, if it has a message.
    pub fn gsi(&self, vector: u16) -> Option<u32> {
        self.lock().get(&vector).map(|(gsi, _, _)| *gsi)
    }

    /// The message vector `vector` is routed to, if it has one.
    pub fn message(&self, vector: u16) -> Option<MsiMessage> {
        self.lock().get(&vector).map(|(_, _, m)| *m)
    }

    fn route(&self, vector: u16, msg: Option<MsiMessage>) -> Result<()> {
        let mut v = self.lock();
        match (v.get(&vector).map(|(gsi, _, _)| *gsi), msg) {
            (Some(gsi), Some(m)) => {
                self.irq.update_msi(gsi, m)?;
                if let Some(e) = v.get_mut(&vector) {
                    e.2 = m;
                }
                Ok(())
            }
            (None, Some(m)) => {
                let gsi = self.irq.allocate_msi(m)?;
                let evt = match EventFd::new(libc::EFD_NONBLOCK) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = self.irq.release_msi(gsi);
                        return Err(IrqError::Kvm { op: "eventfd", errno: e.into() });
                    }
                };
                if let Err(e) = self.irq.register_irqfd(&evt, gsi) {
                    let _ = self.irq.release_msi(gsi);
                    return Err(e);
                }
                v.insert(vector, (gsi, evt, m));
                Ok(())
            }
            (Some(gsi), None) => {
                if let Some((_, evt, _)) = v.remove(&vector) {
                    self.irq.unregister_irqfd(&evt, gsi)?;
                }
                self.irq.release_msi(gsi)
            }
            (None, None) => Ok(()),
        }
    }
}

impl MsixRouting for MsixVectors {
    fn update(&self, vector: u16, msg: Option<MsiMessage>) {
        // The guest's write cannot fail; a route KVM refuses leaves that vector undelivered.
        if let Err(e) = self.route(vector, msg) {
            tracing::warn!(vector, "MSI-X vector not routed: {e}");
        }
    }

    fn trigger(&self, vector: u16) {
        if let Some((_, evt, _)) = self.lock().get(&vector) {
            let _ = evt.write(1);
        }
    }
}

impl Drop for MsixVectors {
    fn drop(&mut self) {
        let vectors = std::mem::take(&mut *self.lock());
        for (gsi, evt, _) in vectors.into_values() {
            let _ = self.irq.unregister_irqfd(&evt, gsi);
            let _ = self.irq.release_msi(gsi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{kvm_available, Vm};

    #[test]
    fn allocator_hands_out_msi_gsis_above_the_ioapic_and_reuses_released_ones() {
        let mut a = GsiAllocator::new(IOAPIC_PINS + 3);
        assert_eq!(a.allocate(), Ok(24));
        assert_eq!(a.allocate(), Ok(25));
        assert_eq!(a.allocate(), Ok(26));
        assert_eq!(a.allocate(), Err(IrqError::GsiExhausted(3)));
        a.release(25).unwrap();
        assert_eq!(a.release(25), Err(IrqError::NotAllocated(25)), "released twice");
        assert_eq!(a.release(4), Err(IrqError::NotAllocated(4)), "a legacy pin is not the allocator's");
        assert_eq!(a.allocate(), Ok(25));
        assert!(a.is_allocated(24) && !a.is_allocated(27));
    }

    #[test]
    fn kernel_table_matches_kvms_defaults() {
        let t = RouteTable::new(IrqchipMode::Kernel);
        let e = t.entries();
        assert_eq!(e.len(), 16 * 2 + 8, "PIC + IOAPIC below 16, IOAPIC only above");
        assert_eq!(
            t.get(4).unwrap(),
            [
                Route::Irqchip { chip: KVM_IRQCHIP_PIC_MASTER, pin: 4 },
                Route::Irqchip { chip: KVM_IRQCHIP_IOAPIC, pin: 4 }
            ]
        );
        assert_eq!(t.get(10).unwrap()[0], Route::Irqchip { chip: KVM_IRQCHIP_PIC_SLAVE, pin: 2 });
        assert_eq!(t.get(20).unwrap(), [Route::Irqchip { chip: KVM_IRQCHIP_IOAPIC, pin: 20 }]);
        assert!(RouteTable::new(IrqchipMode::Split).entries().is_empty());
    }

    #[test]
    fn msi_routes_are_set_retargeted_and_removed_without_touching_others() {
        let mut t = RouteTable::new(IrqchipMode::Kernel);
        let before = t.clone();
        let m = MsiMessage { address: 0x1_fee0_0000, data: 0x41 };
        t.set_msi(30, m);
        let e = t.entries().into_iter().find(|e| e.gsi == 30).unwrap();
        assert_eq!(e.type_, KVM_IRQ_ROUTING_MSI);
        // SAFETY: an MSI entry's union holds `msi`.
        let msi = unsafe { e.u.msi };
        assert_eq!((msi.address_lo, msi.address_hi, msi.data), (0xfee0_0000, 1, 0x41));
        t.set_msi(30, MsiMessage { data: 0x42, ..m });
        assert_eq!(t.get(30).unwrap(), [Route::Msi(MsiMessage { address: 0x1_fee0_0000, data: 0x42 })]);
        t.remove(30);
        assert_eq!(t, before);
    }

    #[test]
    fn msi_route_and_irqfd_register_with_kvm() {
        if !kvm_available() {
            eprintln!("skipping msi_route_and_irqfd_register_with_kvm: /dev/kvm not available");
            return;
        }
        for mode in [IrqchipMode::Kernel, IrqchipMode::Split] {
            let vm = Vm::new(1, 16 << 20, mode).unwrap();
            let irq = &vm.interrupts;
            let gsi = irq.allocate_msi(MsiMessage { address: 0xfee0_0000, data: 0x30 }).unwrap();
            assert_eq!(gsi, IOAPIC_PINS);
            let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
            assert!(irq.register_irqfd(&evt, gsi).unwrap());
            irq.update_msi(gsi, MsiMessage { address: 0xfee0_0000, data: 0x31 }).unwrap();
            evt.write(1).unwrap();
            irq.unregister_irqfd(&evt, gsi).unwrap();
            irq.release_msi(gsi).unwrap();
            assert!(irq.routes(gsi).is_empty());
            // The legacy pin: routed with the in-kernel IOAPIC, polled with a split irqchip.
            let legacy = EventFd::new(libc::EFD_NONBLOCK).unwrap();
            assert_eq!(irq.register_irqfd(&legacy, 4).unwrap(), mode == IrqchipMode::Kernel, "{mode}");

            let door = EventFd::new(libc::EFD_NONBLOCK).unwrap();
            irq.register_ioeventfd(&door, IoAddress::Mmio(0xd000_0000), Datamatch::U16(3)).unwrap();
            irq.register_ioeventfd(&door, IoAddress::Pio(0x600), Datamatch::Any).unwrap();
            irq.unregister_ioeventfd(&door, IoAddress::Mmio(0xd000_0000), Datamatch::U16(3)).unwrap();
        }
    }

    #[test]
    fn user_irqchip_delivers_legacy_pins_through_the_ioapic_and_msis_to_the_lapic() {
        if !kvm_available() {
            eprintln!("skipping user_irqchip_delivers_legacy_pins_through_the_ioapic_and_msis_to_the_lapic: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(2, 16 << 20, IrqchipMode::User).unwrap();
        let apics = vm.uapic.clone().unwrap();
        for cpu in 0..2 {
            apics.lock(cpu).lapic.write_mmio(0xF0, &0x1FFu32.to_le_bytes()); // software enable
        }
        // IOAPIC pin 4: vector 0x34, edge, to APIC 1.
        apics.ioapic_write(0, &0x18u32.to_le_bytes());
        apics.ioapic_write(0x10, &0x34u32.to_le_bytes());
        apics.ioapic_write(0, &0x19u32.to_le_bytes());
        apics.ioapic_write(0x10, &(1u32 << 24).to_le_bytes());
        let irq = &vm.interrupts;
        let com1 = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        assert!(irq.register_irqfd(&com1, 4).unwrap());
        let gsi = irq.allocate_msi(MsiMessage { address: 0xfee0_0000, data: 0x41 }).unwrap();
        let msi = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        assert!(irq.register_irqfd(&msi, gsi).unwrap());
        com1.write(1).unwrap();
        msi.write(1).unwrap();
        // The delivery thread runs on its own: wait for its outcome, however long it takes.
        let pending = |cpu| apics.lock(cpu).lapic.pending_vector();
        while pending(1) != Some(0x34) || pending(0) != Some(0x41) {
            std::thread::yield_now();
        }
        irq.unregister_irqfd(&msi, gsi).unwrap();
        irq.release_msi(gsi).unwrap();
        irq.unregister_irqfd(&com1, 4).unwrap();
    }

    /// A VMM-side MSI (the elastic channel's) with no GSI: KVM takes it where it has the
    /// LAPICs, kumo's LAPIC (here APIC 1's) with `--irqchip user`.
    #[test]
    fn send_msi_reaches_kvms_or_kumos_lapic() {
        if !kvm_available() {
            eprintln!("skipping send_msi_reaches_kvms_or_kumos_lapic: /dev/kvm not available");
            return;
        }
        let to_apic1 = MsiMessage { address: 0xfee0_0000 | (1 << 12), data: 0x31 };
        for mode in [IrqchipMode::Kernel, IrqchipMode::Split] {
            let vm = Vm::new(2, 16 << 20, mode).unwrap();
            vm.create_vcpu(0).unwrap();
            vm.interrupts.send_msi(to_apic1).unwrap_or_else(|e| panic!("{mode}: {e}"));
        }
        let vm = Vm::new(2, 16 << 20, IrqchipMode::User).unwrap();
        let apics = vm.uapic.clone().unwrap();
        apics.lock(1).lapic.write_mmio(0xF0, &0x1FFu32.to_le_bytes()); // software enable
        vm.interrupts.send_msi(to_apic1).unwrap();
        assert_eq!(apics.lock(1).lapic.pending_vector(), Some(0x31));
        assert_eq!(apics.lock(0).lapic.pending_vector(), None);
    }

    #[test]
    fn msix_vectors_get_their_own_routes_and_move_alone() {
        if !kvm_available() {
            eprintln!("skipping msix_vectors_get_their_own_routes_and_move_alone: /dev/kvm not available");
            return;
        }
        for mode in [IrqchipMode::Kernel, IrqchipMode::Split, IrqchipMode::User] {
            let vm = Vm::new(2, 16 << 20, mode).unwrap();
            let v = MsixVectors::new(vm.interrupts.clone());
            let to = |apic: u64, vector: u32| MsiMessage { address: 0xfee0_0000 | (apic << 12), data: vector };
            v.update(0, Some(to(0, 0x40)));
            v.update(1, Some(to(0, 0x41)));
            let (g0, g1) = (v.gsi(0).unwrap(), v.gsi(1).unwrap());
            assert_ne!(g0, g1);
            // Vector 0 moves to vCPU 1: its GSI keeps, its route changes, vector 1's does not.
            v.update(0, Some(to(1, 0x40)));
            assert_eq!(v.gsi(0), Some(g0));
            assert_eq!(vm.interrupts.routes(g0), [Route::Msi(to(1, 0x40))]);
            assert_eq!(vm.interrupts.routes(g1), [Route::Msi(to(0, 0x41))]);
            v.trigger(0);
            v.trigger(7); // no message: nothing to deliver, nothing happens
                          // Masked: the route and its GSI go; unmasked again: a route comes back.
            v.update(1, None);
            assert_eq!(v.gsi(1), None);
            assert!(vm.interrupts.routes(g1).is_empty());
            v.update(1, Some(to(0, 0x42)));
            let g1 = v.gsi(1).unwrap();
            assert_eq!(vm.interrupts.routes(g1), [Route::Msi(to(0, 0x42))]);
            drop(v);
            assert!(vm.interrupts.routes(g0).is_empty() && vm.interrupts.routes(g1).is_empty(), "{mode}");
        }
    }
}
