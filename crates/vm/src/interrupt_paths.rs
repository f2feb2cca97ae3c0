//! Seed 000: the path a device's MSI-X interrupts take to a vCPU, chosen per device.
//!
//! - [`IrqPath::Direct`]: each vector is its own KVM MSI route and irqfd ([`MsixVectors`]),
//!   delivered where the guest programmed it.
//! - [`IrqPath::Dedicated`]: the same irqfd routes, but every vector's destination is rewritten to
//!   the named vCPU (physical destination mode). KVM injects straight into that vCPU; no kumo
//!   thread is on the path, and the vector (its priority class) is the one the guest's driver
//!   chose for the device, so no interrupt number is fixed by kumo: the route follows the device.
//! - [`IrqPath::Shared`]: the baseline of the seed (Xen's event channel): every shared-path
//!   vector of every device goes to one kumo dispatcher thread ([`SharedDispatcher`]), which
//!   injects them one after another, in arrival order, to vCPU 0 (`KVM_SIGNAL_MSI`).
//!
//! [`PathRouting`] is the PCI layer's `MsixRouting` for any of the three, so a device is wired
//! the same way whatever its path.
//!
//! The dedicated path is also *prioritized* on the host: the device's own I/O thread and the
//! vCPU it names run at [`DEDICATED_NICE`] ([`prioritize_this_thread`]), so a busy host (another
//! device's thread, a flooding sender) does not queue them behind its work.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kumo_devices::pci::{MsiMessage, MsixRouting};
use kvm_bindings::kvm_msi;
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::interrupts::{Interrupts, MsixVectors};

/// How a device's MSI-X vectors reach the vCPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "path", deny_unknown_fields)]
pub enum IrqPath {
    /// KVM routes, to where the guest programmed them.
    #[default]
    Direct,
    /// KVM routes, every vector to vCPU `vcpu`.
    Dedicated { vcpu: u32 },
    /// Through kumo's one dispatcher thread, to vCPU 0, in arrival order.
    Shared,
}

impl std::fmt::Display for IrqPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IrqPath::Direct => write!(f, "direct"),
            IrqPath::Dedicated { vcpu } => write!(f, "dedicated (vCPU {vcpu})"),
            IrqPath::Shared => write!(f, "shared"),
        }
    }
}

/// The nice value of a dedicated path's host threads (its device thread and vCPU).
pub const DEDICATED_NICE: i32 = -10;

/// Raises the calling thread to [`DEDICATED_NICE`] (on Linux, nice values are per thread).
/// Needs CAP_SYS_NICE; without it the path still works, unprioritized, and this says why once.
pub fn prioritize_this_thread(what: &str) {
    // SAFETY: setpriority with PRIO_PROCESS and who = 0 only changes the calling thread's nice
    // value; it takes no pointers.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, DEDICATED_NICE) };
    if r != 0 {
        static WARNED: std::sync::Once = std::sync::Once::new();
        let e = std::io::Error::last_os_error();
        WARNED.call_once(|| {
            tracing::warn!("dedicated interrupt path: {what} not prioritized (nice {DEDICATED_NICE}): {e}")
        });
    }
}

/// Bits of an MSI address (Intel SDM 10.11.1): destination APIC id, redirection hint, logical
/// destination mode.
const DEST_ID_SHIFT: u64 = 12;
const DEST_ID_MASK: u64 = 0xff << DEST_ID_SHIFT;
const REDIRECTION_HINT: u64 = 1 << 3;
const DEST_MODE_LOGICAL: u64 = 1 << 2;

/// `msg` sent to APIC id `apic` alone: physical destination mode, no lowest-priority
/// redirection; the vector and delivery mode (the data word) are the guest's.
pub fn retarget(msg: MsiMessage, apic: u32) -> MsiMessage {
    let address = (msg.address & !(DEST_ID_MASK | REDIRECTION_HINT | DEST_MODE_LOGICAL))
        | (u64::from(apic & 0xff) << DEST_ID_SHIFT);
    MsiMessage { address, data: msg.data }
}

/// Counts of what went through the shared path.
#[derive(Debug, Default)]
pub struct DispatchCounters {
    /// Interrupts injected.
    pub injected: AtomicU64,
    /// Injections KVM refused (logged once).
    pub failed: AtomicU64,
}

/// The shared path's one dispatcher thread: injects queued MSI messages to vCPU 0 one after
/// another, in the order devices raised them. Stops (and is joined) when dropped.
pub struct SharedDispatcher {
    tx: Mutex<Option<Sender<MsiMessage>>>,
    counters: Arc<DispatchCounters>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl SharedDispatcher {
    /// Starts the thread (`irq-dispatch`).
    pub fn start(vm: Arc<VmFd>) -> std::io::Result<Arc<SharedDispatcher>> {
        Self::start_with(move |m| {
            let msi = kvm_msi {
                address_lo: m.address as u32,
                address_hi: (m.address >> 32) as u32,
                data: m.data,
                ..Default::default()
            };
            vm.signal_msi(msi).map(|_| ()).map_err(|e| format!("KVM_SIGNAL_MSI failed: {e}"))
        })
    }

    /// The same for `--irqchip user`: the messages go to kumo's APICs.
    pub fn start_user(apics: Arc<crate::uapic::UserApics>) -> std::io::Result<Arc<SharedDispatcher>> {
        Self::start_with(move |m| {
            apics.msi(m.address, m.data);
            Ok(())
        })
    }

    fn start_with(
        inject: impl Fn(MsiMessage) -> Result<(), String> + Send + 'static,
    ) -> std::io::Result<Arc<SharedDispatcher>> {
        let (tx, rx) = channel::<MsiMessage>();
        let counters = Arc::new(DispatchCounters::default());
        let c = counters.clone();
        let thread = kumo_sandbox::spawn(kumo_sandbox::ThreadKind::Device, "irq-dispatch", move || {
            let mut warned = false;
            while let Ok(m) = rx.recv() {
                match inject(retarget(m, 0)) {
                    Ok(()) => c.injected.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        if !std::mem::replace(&mut warned, true) {
                            tracing::warn!("shared interrupt path: {e}");
                        }
                        c.failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        })?;
        Ok(Arc::new(SharedDispatcher { tx: Mutex::new(Some(tx)), counters, thread: Mutex::new(Some(thread)) }))
    }

    /// Queues `msg` for injection.
    pub fn raise(&self, msg: MsiMessage) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(msg);
        }
    }

    pub fn counters(&self) -> &DispatchCounters {
        &self.counters
    }
}

impl Drop for SharedDispatcher {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// What a [`PathRouting`] delivers through.
enum Via {
    Kvm { vectors: MsixVectors, dest: Option<u32> },
    Dispatcher { dispatcher: Arc<SharedDispatcher>, messages: Mutex<BTreeMap<u16, MsiMessage>> },
}

/// One device's MSI-X routing on its [`IrqPath`] (the PCI layer's `MsixRouting`).
pub struct PathRouting {
    path: IrqPath,
    via: Via,
    raised: AtomicU64,
}

impl PathRouting {
    /// `dispatcher` is the VM's shared dispatcher, needed for [`IrqPath::Shared`].
    pub fn new(
        path: IrqPath,
        irq: Arc<Interrupts>,
        dispatcher: Option<Arc<SharedDispatcher>>,
    ) -> Result<PathRouting, String> {
        let via = match (path, dispatcher) {
            (IrqPath::Shared, Some(dispatcher)) => Via::Dispatcher { dispatcher, messages: Mutex::default() },
            (IrqPath::Shared, None) => return Err("the shared interrupt path needs the dispatcher".into()),
            (IrqPath::Direct, _) => Via::Kvm { vectors: MsixVectors::new(irq), dest: None },
            (IrqPath::Dedicated { vcpu }, _) => Via::Kvm { vectors: MsixVectors::new(irq), dest: Some(vcpu) },
        };
        Ok(PathRouting { path, via, raised: AtomicU64::new(0) })
    }

    pub fn path(&self) -> IrqPath {
        self.path
    }

    /// Interrupts this device raised (delivered or queued for the dispatcher).
    pub fn raised(&self) -> u64 {
        self.raised.load(Ordering::Relaxed)
    }

    /// The GSI of vector `vector` on a KVM-routed path.
    pub fn via_gsi(&self, vector: u16) -> Option<u32> {
        match &self.via {
            Via::Kvm { vectors, .. } => vectors.gsi(vector),
            Via::Dispatcher { .. } => None,
        }
    }

    /// The message vector `vector` is delivered with now, after the path's rewriting.
    pub fn message(&self, vector: u16) -> Option<MsiMessage> {
        match &self.via {
            Via::Kvm { vectors, .. } => vectors.message(vector),
            Via::Dispatcher { messages, .. } => {
                messages.lock().unwrap_or_else(|p| p.into_inner()).get(&vector).map(|m| retarget(*m, 0))
            }
        }
    }
}

impl MsixRouting for PathRouting {
    fn update(&self, vector: u16, msg: Option<MsiMessage>) {
        match &self.via {
            Via::Kvm { vectors, dest } => vectors.update(vector, msg.map(|m| dest.map_or(m, |d| retarget(m, d)))),
            Via::Dispatcher { messages, .. } => {
                let mut m = messages.lock().unwrap_or_else(|p| p.into_inner());
                match msg {
                    Some(msg) => m.insert(vector, msg),
                    None => m.remove(&vector),
                };
            }
        }
    }

    fn trigger(&self, vector: u16) {
        self.raised.fetch_add(1, Ordering::Relaxed);
        match &self.via {
            Via::Kvm { vectors, .. } => vectors.trigger(vector),
            Via::Dispatcher { dispatcher, messages } => {
                let m = messages.lock().unwrap_or_else(|p| p.into_inner()).get(&vector).copied();
                if let Some(m) = m {
                    dispatcher.raise(m);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interrupts::Route;
    use crate::vm::{kvm_available, IrqchipMode, Vm};

    #[test]
    fn retargeting_keeps_the_vector_and_forces_physical_mode() {
        // Logical mode, redirection hint, destination 0x03, vector 0x51.
        let m = MsiMessage { address: 0xfee0_300c, data: 0x4051 };
        let r = retarget(m, 1);
        assert_eq!(r.address, 0xfee0_1000);
        assert_eq!(r.data, 0x4051, "vector and delivery mode are the guest's");
        assert_eq!(r.data & 0xff, 0x51);
        assert_eq!(retarget(m, 0x1ff).address, 0xfeef_f000, "APIC ids above 255 do not spill");
    }

    #[test]
    fn paths_print_and_parse_as_json() {
        assert_eq!(IrqPath::default(), IrqPath::Direct);
        assert_eq!(IrqPath::Dedicated { vcpu: 1 }.to_string(), "dedicated (vCPU 1)");
        let j = serde_json::to_value(IrqPath::Dedicated { vcpu: 1 }).unwrap();
        assert_eq!(j, serde_json::json!({"path": "dedicated", "vcpu": 1}));
        assert_eq!(serde_json::from_value::<IrqPath>(serde_json::json!({"path": "shared"})).unwrap(), IrqPath::Shared);
    }

    #[test]
    fn each_path_routes_vectors_as_it_says() {
        if !kvm_available() {
            eprintln!("skipping each_path_routes_vectors_as_it_says: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(2, 16 << 20, IrqchipMode::Kernel).unwrap();
        let guest = MsiMessage { address: 0xfee0_0000, data: 0xe0 }; // vCPU 0, vector 0xe0

        // Dedicated to vCPU 1: the KVM route goes to APIC 1 with the guest's vector.
        let d = PathRouting::new(IrqPath::Dedicated { vcpu: 1 }, vm.interrupts.clone(), None).unwrap();
        d.update(0, Some(guest));
        let want = MsiMessage { address: 0xfee0_1000, data: 0xe0 };
        assert_eq!(d.message(0), Some(want));
        let gsi = d.via_gsi(0).unwrap();
        assert_eq!(vm.interrupts.routes(gsi), vec![Route::Msi(want)]);
        d.trigger(0);
        assert_eq!(d.raised(), 1);

        // Direct: as programmed.
        let direct = PathRouting::new(IrqPath::Direct, vm.interrupts.clone(), None).unwrap();
        direct.update(0, Some(MsiMessage { address: 0xfee0_1000, data: 0x41 }));
        assert_eq!(direct.message(0), Some(MsiMessage { address: 0xfee0_1000, data: 0x41 }));

        // Shared: no KVM route; the dispatcher injects to vCPU 0, in order, and counts.
        assert!(PathRouting::new(IrqPath::Shared, vm.interrupts.clone(), None).is_err());
        let disp = SharedDispatcher::start(vm.fd.clone()).unwrap();
        let s = PathRouting::new(IrqPath::Shared, vm.interrupts.clone(), Some(disp.clone())).unwrap();
        s.update(3, Some(MsiMessage { address: 0xfee0_1000, data: 0x42 }));
        assert_eq!(s.message(3), Some(MsiMessage { address: 0xfee0_0000, data: 0x42 }));
        s.trigger(3);
        s.trigger(3);
        s.trigger(7); // no message: not raised to KVM
        drop(s);
        let counters = Arc::clone(&disp.counters);
        drop(disp); // joins the thread after it drained the queue
        assert_eq!(counters.injected.load(Ordering::Relaxed) + counters.failed.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn shared_path_injects_into_kumos_apic_with_a_user_irqchip() {
        let apics = crate::uapic::UserApics::new(2, 0);
        for cpu in 0..2 {
            apics.lock(cpu).lapic.write_mmio(0xF0, &0x1FFu32.to_le_bytes());
        }
        let disp = SharedDispatcher::start_user(apics.clone()).unwrap();
        disp.raise(MsiMessage { address: 0xfee0_1000, data: 0x42 }); // to APIC 1: retargeted to 0
        let counters = Arc::clone(&disp.counters);
        drop(disp); // joins the thread after it drained the queue
        assert_eq!(counters.injected.load(Ordering::Relaxed), 1);
        assert_eq!(apics.lock(0).lapic.pending_vector(), Some(0x42));
        assert_eq!(apics.lock(1).lapic.pending_vector(), None);
    }
}
