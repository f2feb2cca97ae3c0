//! A virtio-net NIC wired into a VM: the PCI function ([`crate::virtio_pci::wire`]: the virtio
//! PCI transport and MSI-X, its interrupt path, its doorbells as ioeventfds), and its own
//! event-loop thread. Two kinds share that function:
//! [`TapNic`], whose thread moves frames between a host tap and the guest's rings, and
//! [`VhostUserNic`](crate::nic_vhost_user::VhostUserNic), whose rings an external vhost-user
//! backend serves.
//!
//! The NIC's thread only touches guest memory while the VM runs: [`Nic::pause`] (called whenever
//! the vCPUs stop: pause, snapshot, a migration's stop phase) waits for it to be out of the
//! device, and frames that arrive meanwhile wait in the tap's queue until [`Nic::resume`].

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kumo_devices::virtio::net::tap::{OpenOffloads, Tap};
use kumo_devices::virtio::net::{offload_names, Net, NetBackend, NetConfig};
use kumo_devices::virtio::{status, GuestMemory, VirtioDevice};
use kumo_vm::interrupt_paths::{IrqPath, PathRouting, SharedDispatcher};
use kumo_vm::interrupts::Interrupts;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::{NetSpec, TapFds};
use crate::event_loop::{EventHandler, EventLoop, Interest};
use crate::nic_vhost_user::VhostUserNic;
use crate::pci::Pci;
use crate::virtio_pci::{irq_info, wire, Control, VirtioFunction, Wired};
use crate::{Error, Result};
use kumo_sandbox::lock;

/// One NIC of a VM.
pub enum Nic {
    Tap(TapNic),
    VhostUser(VhostUserNic),
}

impl Nic {
    /// Makes NIC `index` (`net<index>`) as `spec` says and puts it on `pci`.
    pub fn new(
        index: usize,
        spec: &NetSpec,
        mem: &GuestMemory,
        irq: Arc<Interrupts>,
        dispatcher: Option<Arc<SharedDispatcher>>,
        pci: &mut Pci,
        incoming: bool,
    ) -> Result<Nic> {
        match &spec.vhost_user {
            Some(_) => VhostUserNic::new(index, spec, mem, irq, dispatcher, pci).map(Nic::VhostUser),
            None => TapNic::new(index, spec, mem, irq, dispatcher, pci, incoming).map(Nic::Tap),
        }
    }

    pub fn id(&self) -> &str {
        match self {
            Nic::Tap(n) => n.id(),
            Nic::VhostUser(n) => n.id(),
        }
    }

    /// Stops the NIC's thread from touching guest memory (see [`TapNic::pause`]).
    pub fn pause(&self) {
        match self {
            Nic::Tap(n) => n.pause(),
            Nic::VhostUser(n) => n.pause(),
        }
    }

    pub fn resume(&self) {
        match self {
            Nic::Tap(n) => n.resume(),
            Nic::VhostUser(n) => n.resume(),
        }
    }

    /// See [`TapNic::set_tap_attached`]; a vhost-user NIC has no tap here.
    pub fn set_tap_attached(&self, on: bool) {
        if let Nic::Tap(n) = self {
            n.set_tap_attached(on)
        }
    }

    /// Why this NIC cannot be snapshotted, if it cannot.
    pub fn snapshot_blocker(&self) -> Option<String> {
        match self {
            Nic::Tap(_) => None,
            Nic::VhostUser(n) => Some(n.snapshot_blocker()),
        }
    }

    /// The log of guest writes kept outside KVM's sight (a vhost-user backend's).
    pub fn dirty_log(&self) -> Option<&dyn kumo_vm::dirty::DeviceDirtyLog> {
        match self {
            Nic::Tap(_) => None,
            Nic::VhostUser(n) => Some(n),
        }
    }

    /// A migration's stop phase / its failure: an external backend stops / restarts its rings.
    pub fn suspend_backend(&self, on: bool) -> std::result::Result<(), String> {
        match self {
            Nic::Tap(_) => Ok(()),
            Nic::VhostUser(n) if on => n.suspend_backend(),
            Nic::VhostUser(n) => n.resume_backend(),
        }
    }

    /// The NIC as `vm.info` shows it.
    pub fn info(&self) -> kumo_api::NetInfo {
        match self {
            Nic::Tap(n) => n.info(),
            Nic::VhostUser(n) => n.info(),
        }
    }
}

/// A NIC on a host tap.
pub struct TapNic {
    id: String,
    spec: NetSpec,
    slot: u8,
    function: Arc<Mutex<VirtioFunction<Net<Tap>>>>,
    routing: Arc<PathRouting>,
    ctl: Arc<Control>,
    _events: EventLoop,
}

impl TapNic {
    /// Attaches tap `spec.tap`, puts NIC `index` (`net<index>`) on `pci` and starts its thread.
    /// An `incoming` NIC leaves the tap's offloads as its source (which may still hold the tap)
    /// set them; its restored driver sets the same ones.
    pub fn new(
        index: usize,
        spec: &NetSpec,
        mem: &GuestMemory,
        irq: Arc<Interrupts>,
        dispatcher: Option<Arc<SharedDispatcher>>,
        pci: &mut Pci,
        incoming: bool,
    ) -> Result<TapNic> {
        let offloads = if incoming { OpenOffloads::Keep } else { OpenOffloads::Clear };
        let id = format!("net{index}");
        let dev_err = |m: String| Error::Devices(format!("{id} (tap {}): {m}", spec.tap));
        let mac = spec.mac().map_err(dev_err)?;
        let tap = match &spec.fds {
            TapFds::ByName => {
                Tap::attach(&spec.tap, usize::from(spec.queues), offloads).map_err(|e| Error::Devices(e.to_string()))?
            }
            // The client's descriptors stay with the config (for the next boot): the NIC has
            // duplicates of its own.
            TapFds::Passed(fds) => {
                let fds = fds.duplicate().map_err(|e| dev_err(format!("duplicating its tap descriptors: {e}")))?;
                Tap::from_fds(fds, offloads).map_err(|e| dev_err(e.to_string()))?
            }
            TapFds::OnSource => {
                return Err(dev_err("its tap came as descriptors on its source: give it one here".into()))
            }
        };
        let net = Net::new(NetConfig { mac, pairs: spec.queues, offload: spec.offload }, tap)
            .map_err(|e| dev_err(e.to_string()))?;
        let queues = net.queue_max_sizes().len();
        let evt = || EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(format!("eventfd: {e}")));
        // Doorbells: one eventfd per queue, registered with KVM by the PCI layer (it follows the
        // BAR), read by the NIC's thread.
        let bells: Vec<EventFd> = (0..queues).map(|_| evt()).collect::<Result<_>>()?;
        let clones = bells.iter().map(|e| e.try_clone()).collect::<std::io::Result<Vec<_>>>();
        let clones = clones.map_err(|e| dev_err(format!("eventfd: {e}")))?;
        let Wired { function, slot, routing, ctl } =
            wire(&id, net, spec.irq, clones, mem, irq, dispatcher, pci, &dev_err)?;

        let dedicated = matches!(spec.irq, IrqPath::Dedicated { .. });
        let what = format!("{id}'s thread");
        let poll = std::time::Duration::from_micros(spec.poll_us.into());
        let events = EventLoop::start_with(&id, poll, move || {
            if dedicated {
                kumo_vm::interrupt_paths::prioritize_this_thread(&what);
            }
        })
        .map_err(|e| dev_err(format!("event loop: {e}")))?;
        let tap_fds: Vec<i32> = {
            let mut f = lock(&function);
            let net = f.transport().device_mut();
            (0..usize::from(spec.queues)).filter_map(|p| net.backend().fd(p)).collect()
        };
        let mut fds = vec![(ctl.kick.as_raw_fd(), EventSet::IN)];
        // Doorbells are edge-triggered and never read on the way to the queue: each KVM write
        // is an edge, and the read would sit between the guest's kick and the frame's send.
        fds.extend(bells.iter().map(|b| (b.as_raw_fd(), EventSet::IN | EventSet::EDGE_TRIGGERED)));
        fds.extend(tap_fds.iter().map(|&fd| (fd, EventSet::IN)));
        let handler = NicHandler {
            function: function.clone(),
            ctl: ctl.clone(),
            bells,
            pairs: usize::from(spec.queues),
            tap_on: vec![true; usize::from(spec.queues)],
        };
        events.add(&fds, Box::new(handler)).map_err(|e| dev_err(format!("event loop: {e}")))?;
        Ok(TapNic { id, spec: spec.clone(), slot, function, routing, ctl, _events: events })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Stops the NIC's thread from touching guest memory; returns once it is out of the device.
    pub fn pause(&self) {
        self.ctl.paused.store(true, Ordering::Release);
        drop(lock(&self.function));
    }

    /// Lets it run again, catching up on doorbells and frames that came meanwhile.
    pub fn resume(&self) {
        self.ctl.paused.store(false, Ordering::Release);
        let _ = self.ctl.kick.write(1);
    }

    /// Attaches or detaches its tap queues (see `Tap::set_attached`): a migration moves which
    /// process's queues the kernel hands frames to.
    pub fn set_tap_attached(&self, on: bool) {
        if let Err(e) = lock(&self.function).transport().device_mut().backend_mut().set_attached(on) {
            tracing::warn!(
                "{}: cannot {} tap {}'s queues: {e}",
                self.id,
                if on { "attach" } else { "detach" },
                self.spec.tap
            );
        }
    }

    /// The NIC as `vm.info` shows it.
    pub fn info(&self) -> kumo_api::NetInfo {
        let mut f = lock(&self.function);
        let driver_ok = f.transport().status() & status::DRIVER_OK != 0;
        let acked = if driver_ok { f.transport().driver_features() } else { 0 };
        let net = f.transport().device();
        let (cfg, c) = (net.config(), net.counters());
        let (irq, vcpu) = irq_info(&self.routing);
        kumo_api::NetInfo {
            id: self.id.clone(),
            tap: self.spec.tap.clone(),
            mac: cfg.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
            queues: cfg.pairs,
            irq: irq.into(),
            vcpu,
            pci: format!("0000:00:{:02x}.0", self.slot),
            driver_ok,
            offloads: offload_names(acked),
            counters: kumo_api::NetCounters {
                rx_frames: c.rx_frames,
                rx_bytes: c.rx_bytes,
                rx_dropped: c.rx_dropped,
                tx_frames: c.tx_frames,
                tx_bytes: c.tx_bytes,
                tx_dropped: c.tx_dropped,
                interrupts: self.routing.raised(),
            },
            vhost_user: None,
        }
    }
}

/// The NIC's event handler. Sources: 0 the kick, then one doorbell per queue, then one tap fd
/// per queue pair.
struct NicHandler {
    function: Arc<Mutex<VirtioFunction<Net<Tap>>>>,
    ctl: Arc<Control>,
    bells: Vec<EventFd>,
    pairs: usize,
    /// Whether each pair's tap fd is watched: not while the guest has no RX buffers for it.
    tap_on: Vec<bool>,
}

impl NicHandler {
    fn tap_source(&self, pair: usize) -> usize {
        1 + self.bells.len() + pair
    }

    fn watch_tap(&mut self, pair: usize, on: bool, interest: &mut Interest) {
        if self.tap_on[pair] != on {
            self.tap_on[pair] = on;
            interest.set(self.tap_source(pair), if on { EventSet::IN } else { EventSet::empty() });
        }
    }

    /// Moves what the tap holds for `pair` into the guest; stops watching the fd if the guest
    /// has no room (its RX doorbell or the kick starts it again).
    fn rx(&mut self, f: &mut VirtioFunction<Net<Tap>>, pair: usize, interest: &mut Interest) {
        let running = f.transport().status() & status::DRIVER_OK != 0;
        let moved = running && f.transport().device_mut().backend_ready(pair);
        self.watch_tap(pair, moved, interest);
    }
}

impl EventHandler for NicHandler {
    fn handle(&mut self, source: usize, _events: EventSet, interest: &mut Interest) {
        let function = self.function.clone();
        let mut f = lock(&function);
        if self.ctl.paused.load(Ordering::Acquire) {
            // Leave doorbells and frames where they are; the kick on resume catches up.
            match source {
                0 => drop(self.ctl.kick.read()),
                s if s <= self.bells.len() => drop(self.bells[s - 1].read()),
                _ => {}
            }
            for p in 0..self.pairs {
                self.watch_tap(p, false, interest);
            }
            return;
        }
        match source {
            0 => {
                let _ = self.ctl.kick.read();
                // Resumed, restored, DRIVER_OK, or a doorbell that came through the BAR: look
                // at every queue.
                for q in 0..self.bells.len() {
                    f.transport().queue_notify(q);
                }
                for p in 0..self.pairs {
                    self.rx(&mut f, p, interest);
                }
            }
            s if s <= self.bells.len() => {
                let q = s - 1;
                f.transport().queue_notify(q);
                // An RX doorbell means new buffers: frames the tap holds can go in.
                if q % 2 == 0 && q / 2 < self.pairs {
                    self.rx(&mut f, q / 2, interest);
                }
            }
            s => {
                let pair = s - 1 - self.bells.len();
                if pair < self.pairs {
                    self.rx(&mut f, pair, interest);
                }
            }
        }
    }
}
