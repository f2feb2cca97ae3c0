//! A virtio-blk disk wired into a VM: the device model (`kumo_devices::virtio::block`) on a raw
//! image, put on PCI by [`crate::virtio_pci::wire`] (transport, MSI-X on the direct interrupt
//! path, doorbells as ioeventfds), with its own event-loop thread (`Device` kind) that serves
//! the doorbells, the kick and the I/O backend's completions. The vCPU threads never do disk
//! I/O: a doorbell only wakes this thread.
//!
//! [`Disk::pause`] (whenever the vCPUs stop: pause, snapshot, a migration's stop phase) waits
//! for the thread to be out of the device and then completes every request in flight
//! (`Block::drain`), so a saved state never has one. A migration's source also flushes the
//! image ([`Disk::quiesce`]) and gives its lock up before its commit ([`Disk::unlock`], taken
//! back by [`Disk::relock`] if the migration fails); a destination opens the image unlocked and
//! locks it only when the state arrives ([`Disk::lock_for_restore`]).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kumo_devices::virtio::block::{Block, DiskImage};
use kumo_devices::virtio::{status, GuestMemory};
use kumo_vm::interrupt_paths::{IrqPath, PathRouting};
use kumo_vm::interrupts::Interrupts;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::DiskSpec;
use crate::event_loop::{EventHandler, EventLoop, Interest};
use crate::pci::Pci;
use crate::virtio_pci::{wire, Control, VirtioFunction, Wired};
use crate::{Error, Result};
use kumo_sandbox::lock;

/// One disk of a VM.
pub struct Disk {
    id: String,
    slot: u8,
    function: Arc<Mutex<VirtioFunction<Block>>>,
    routing: Arc<PathRouting>,
    ctl: Arc<Control>,
    _events: EventLoop,
}

impl Disk {
    /// Opens `spec`'s image (locked unless `incoming`: a destination locks it when the state
    /// arrives), makes disk `index` of a VM of `cpus` vCPUs and puts it on `pci`.
    pub fn new(
        index: usize,
        spec: &DiskSpec,
        cpus: u32,
        incoming: bool,
        mem: &GuestMemory,
        irq: Arc<Interrupts>,
        pci: &mut Pci,
    ) -> Result<Disk> {
        let id = spec.id_at(index);
        let open = if incoming { DiskImage::open_unlocked } else { DiskImage::open };
        let image = open(&spec.path, spec.readonly, spec.direct).map_err(|e| Error::Devices(e.to_string()))?;
        let dev_err = |m: String| Error::Devices(format!("disk {id} ({}): {m}", spec.path.display()));
        let block = Block::new(&id, spec.block_config(cpus), image).map_err(|e| dev_err(e.to_string()))?;
        let queues = usize::from(block.config().queues);
        let completions = block.completion_fd();
        let evt = || EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(format!("eventfd: {e}")));
        let bells: Vec<EventFd> = (0..queues).map(|_| evt()).collect::<Result<_>>()?;
        let clones = bells.iter().map(|e| e.try_clone()).collect::<std::io::Result<Vec<_>>>();
        let clones = clones.map_err(|e| dev_err(format!("eventfd: {e}")))?;
        let Wired { function, slot, routing, ctl } =
            wire(&id, block, IrqPath::Direct, clones, mem, irq, None, pci, &dev_err)?;
        let events = EventLoop::start(&id).map_err(|e| dev_err(format!("event loop: {e}")))?;
        let mut fds = vec![(ctl.kick.as_raw_fd(), EventSet::IN), (completions, EventSet::IN)];
        fds.extend(bells.iter().map(|b| (b.as_raw_fd(), EventSet::IN)));
        let handler = DiskHandler { function: function.clone(), ctl: ctl.clone(), bells };
        events.add(&fds, Box::new(handler)).map_err(|e| dev_err(format!("event loop: {e}")))?;
        Ok(Disk { id, slot, function, routing, ctl, _events: events })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Stops the disk's thread from touching guest memory and completes the requests in flight
    /// (their status and used entries written; the interrupts wait in the guest's LAPIC).
    pub fn pause(&self) {
        self.ctl.paused.store(true, Ordering::Release);
        lock(&self.function).transport().device_mut().drain();
    }

    /// Lets it run again, catching up on doorbells that came meanwhile.
    pub fn resume(&self) {
        self.ctl.paused.store(false, Ordering::Release);
        let _ = self.ctl.kick.write(1);
    }

    /// Drains and flushes the image to stable storage: a migration's stop phase, a snapshot.
    pub fn quiesce(&self) -> Result<()> {
        let mut f = lock(&self.function);
        let b = f.transport().device_mut();
        b.quiesce()
            .map_err(|e| Error::Devices(format!("disk {}: flushing {}: {e}", self.id, b.image().path().display())))
    }

    /// Gives the image's lock up, so a migration's destination can take it.
    pub fn unlock(&self) -> Result<()> {
        lock(&self.function).transport().device_mut().image_mut().unlock().map_err(|e| Error::Devices(e.to_string()))
    }

    /// Takes the image's lock (again): a failed migration's source, a destination's restore.
    pub fn relock(&self) -> Result<()> {
        let mut f = lock(&self.function);
        let img = f.transport().device_mut().image_mut();
        if img.locked() {
            return Ok(());
        }
        img.relock().map_err(|e| Error::Devices(e.to_string()))
    }

    /// The image's path and size in bytes.
    pub fn image(&self) -> (std::path::PathBuf, u64) {
        let mut f = lock(&self.function);
        let img = f.transport().device().image();
        (img.path().to_path_buf(), img.size())
    }

    /// The disk as `vm.info` shows it.
    pub fn info(&self) -> kumo_api::DiskInfo {
        let mut f = lock(&self.function);
        let driver_ok = f.transport().status() & status::DRIVER_OK != 0;
        let b = f.transport().device();
        let (img, cfg, c) = (b.image(), b.config(), b.counters());
        kumo_api::DiskInfo {
            id: self.id.clone(),
            path: img.path().display().to_string(),
            size: img.size(),
            readonly: img.readonly(),
            direct: img.direct(),
            serial: cfg.serial.clone(),
            queues: cfg.queues,
            queue_size: cfg.queue_size,
            backend: b.backend_name().into(),
            pci: format!("0000:00:{:02x}.0", self.slot),
            slot: self.slot,
            driver_ok,
            counters: kumo_api::DiskCounters {
                requests: c.requests,
                read_bytes: c.read_bytes,
                write_bytes: c.write_bytes,
                flushes: c.flushes,
                discards: c.discards,
                write_zeroes: c.write_zeroes,
                errors: c.errors,
                host_errors: c.host_errors,
                unsupported: c.unsupported,
                interrupts: self.routing.raised(),
            },
        }
    }
}

/// The disk's event handler. Sources: 0 the kick, 1 the backend's completions, then one
/// doorbell per queue.
struct DiskHandler {
    function: Arc<Mutex<VirtioFunction<Block>>>,
    ctl: Arc<Control>,
    bells: Vec<EventFd>,
}

const KICK: usize = 0;
const COMPLETIONS: usize = 1;

impl EventHandler for DiskHandler {
    fn handle(&mut self, source: usize, _events: EventSet, _interest: &mut Interest) {
        let function = self.function.clone();
        let mut f = lock(&function);
        let paused = self.ctl.paused.load(Ordering::Acquire);
        match source {
            KICK => {
                let _ = self.ctl.kick.read();
                if !paused {
                    // Resumed, restored, DRIVER_OK, or a doorbell through the BAR: every queue.
                    for q in 0..self.bells.len() {
                        f.transport().queue_notify(q);
                    }
                }
            }
            // Completions are finished even while paused: `Disk::pause` drains under the same
            // lock, so none is left then, and a late eventfd read only clears it.
            COMPLETIONS => f.transport().device_mut().process_completions(),
            s => {
                let q = s - 2;
                let _ = self.bells[q].read();
                if !paused {
                    f.transport().queue_notify(q);
                }
            }
        }
    }
}
