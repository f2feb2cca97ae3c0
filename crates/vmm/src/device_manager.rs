//! The device manager: creates a VM's devices, puts them on the port I/O and MMIO buses, wires
//! their interrupts through `kumo_vm::interrupts` (never KVM directly), and registers their
//! descriptors with the device event loop (`event_loop`). It also lists the devices whose state
//! snapshots carry (`persist`). A new device (virtio-net over PCI, a userspace APIC) is added
//! here and in nothing else in `RunningVm`.
//!
//! Today's devices: COM1 (8250 UART on port 0x3f8, IRQ 4 through an irqfd), the debug exit
//! port if the VM asks for it (guest exit and timing markers, ports 0x501–0x502: kumo's guests
//! need it, a Linux kernel does without), PCI bus 0 with its host bridge
//! (`pci`), virtio-net NICs on host taps (`nic`), each on its seed-000 interrupt path, and
//! virtio-blk disks on image files (`disk`), after the NICs; and the ACPI GED (CPU hotplug and
//! the power button, `kumo_devices::acpi_ged`) on MMIO with its interrupt on GSI 5, where the
//! VM has an IOAPIC.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kumo_devices::acpi_ged::{AcpiGed, GED_GSI, GED_MMIO_BASE, GED_MMIO_LEN};
use kumo_devices::persist::check_ids;
use kumo_devices::{
    AcpiSleep, Buses, DebugPort, DeviceStates, PersistDyn, PersistError, SerialConsole, COM1_IRQ, COM1_PORT, EXIT_PORT,
    SLEEP_PORT, SLEEP_PORT_LEN,
};
use kumo_vm::interrupt_paths::{IrqPath, SharedDispatcher};
use kumo_vm::Vm;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::{DiskSpec, NetSpec};
use crate::disk::Disk;
use crate::event_loop::{EventHandler, EventLoop, Interest};
use crate::nic::Nic;
use crate::pci::Pci;
use crate::{Error, Result};
use kumo_sandbox::lock;

fn dev_err(what: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::Devices(format!("{what}: {e}"))
}

/// A VM's devices, their buses and their event loop.
pub struct DeviceManager {
    buses: Arc<Buses>,
    serial: Arc<Mutex<SerialConsole>>,
    /// Signalled when the guest empties COM1's receive FIFO (see `ConsoleInput`).
    serial_drained: EventFd,
    console_attached: AtomicBool,
    /// The devices whose state snapshots carry (the debug port has none).
    persist: Vec<Arc<Mutex<dyn PersistDyn>>>,
    events: EventLoop,
    nics: Vec<Nic>,
    disks: Vec<Disk>,
    pci: Pci,
    /// The shared interrupt path's thread, if a device uses it.
    dispatcher: Option<Arc<SharedDispatcher>>,
    /// The ACPI GED (CPU hotplug, power button); none where its GSI has no route (split irqchip).
    ged: Option<Arc<Mutex<AcpiGed>>>,
}

impl DeviceManager {
    /// Creates the devices of `vm`, with COM1's output going to `console`, its NICs, and the
    /// debug exit port if `debug_exit`. Disks are added by [`DeviceManager::add_disks`].
    pub fn new(
        vm: &Vm,
        console: Box<dyn Write + Send>,
        nets: &[NetSpec],
        debug_exit: bool,
        incoming: bool,
    ) -> Result<DeviceManager> {
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("serial interrupt"))?;
        // With a split irqchip there is no in-kernel IOAPIC pin: the serial then runs polled.
        vm.interrupts.register_irqfd(&irq, COM1_IRQ).map_err(kumo_vm::Error::from)?;
        let drained = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("serial input event"))?;
        let serial = SerialConsole::with_input_drained(irq, drained.try_clone().map_err(dev_err("eventfd"))?, console);
        let serial = Arc::new(Mutex::new(serial));

        let mut buses = Buses::default();
        let bus_err = |e: kumo_devices::BusError| Error::Devices(e.to_string());
        buses.pio.insert(COM1_PORT.into(), 8, serial.clone()).map_err(bus_err)?;
        if debug_exit {
            buses.pio.insert(EXIT_PORT.into(), 2, Arc::new(Mutex::new(DebugPort))).map_err(bus_err)?;
        }
        // The FADT's sleep registers: a guest powers off through them (ACPI S5).
        buses.pio.insert(SLEEP_PORT.into(), SLEEP_PORT_LEN, Arc::new(Mutex::new(AcpiSleep))).map_err(bus_err)?;

        let ged = Self::add_ged(vm, &mut buses)?;
        let mut pci = Pci::new(&vm.memory.layout, vm.interrupts.clone(), &mut buses)?;
        let dispatcher = if nets.iter().any(|n| n.irq == IrqPath::Shared) {
            Some(
                match &vm.uapic {
                    Some(u) => SharedDispatcher::start_user(u.clone()),
                    None => SharedDispatcher::start(vm.fd.clone()),
                }
                .map_err(dev_err("interrupt dispatcher"))?,
            )
        } else {
            None
        };
        let nics = nets
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                Nic::new(i, spec, &vm.memory.guest, vm.interrupts.clone(), dispatcher.clone(), &mut pci, incoming)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut persist: Vec<Arc<Mutex<dyn PersistDyn>>> = vec![serial.clone()];
        persist.extend(pci.persist_list());
        // `--irqchip user`: kumo's LAPICs (lapic<N>) and IOAPIC are state like a device's.
        if let Some(u) = &vm.uapic {
            persist.extend(u.persist_list());
        }

        let events = EventLoop::start("devices").map_err(dev_err("device event loop"))?;
        Ok(DeviceManager {
            buses: Arc::new(buses),
            persist,
            serial,
            serial_drained: drained,
            console_attached: AtomicBool::new(false),
            events,
            nics,
            disks: Vec::new(),
            pci,
            dispatcher,
            ged,
        })
    }

    /// The GED on the MMIO bus, interrupting on [`GED_GSI`] through an irqfd.
    fn add_ged(vm: &Vm, buses: &mut Buses) -> Result<Option<Arc<Mutex<AcpiGed>>>> {
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("GED interrupt"))?;
        if !vm.interrupts.register_irqfd(&irq, GED_GSI).map_err(kumo_vm::Error::from)? {
            return Ok(None);
        }
        let ged = Arc::new(Mutex::new(AcpiGed::new(vm.ncpus, irq)));
        buses.mmio.insert(GED_MMIO_BASE, GED_MMIO_LEN, ged.clone()).map_err(|e| Error::Devices(e.to_string()))?;
        Ok(Some(ged))
    }

    /// The ACPI GED, if the VM has one.
    pub fn ged(&self) -> Option<&Arc<Mutex<AcpiGed>>> {
        self.ged.as_ref()
    }

    /// Puts `specs`' disks on PCI after the NICs, on a VM of `cpus` vCPUs; an `incoming` VM's
    /// images are opened unlocked (see [`DeviceManager::lock_disks`]). Called once, before any
    /// vCPU runs.
    pub fn add_disks(&mut self, vm: &Vm, specs: &[DiskSpec], cpus: u32, incoming: bool) -> Result<()> {
        for (i, spec) in specs.iter().enumerate() {
            let d = Disk::new(i, spec, cpus, incoming, &vm.memory.guest, vm.interrupts.clone(), &mut self.pci)?;
            self.disks.push(d);
        }
        let known: Vec<String> = self.persist.iter().map(|d| lock(d).id()).collect();
        self.persist.extend(self.pci.persist_list().into_iter().filter(|d| !known.contains(&lock(d).id())));
        Ok(())
    }

    /// Completes the disks' requests and flushes their images: before a migration's or a
    /// snapshot's final state is taken (the VM paused).
    pub fn quiesce_disks(&self) -> Result<()> {
        self.disks.iter().try_for_each(Disk::quiesce)
    }

    /// Gives the disks' image locks up (a migration's source, before its commit) or takes them
    /// back (`on`: a failed migration's source; a destination when the state arrives).
    pub fn lock_disks(&self, on: bool) -> Result<()> {
        self.disks.iter().try_for_each(|d| if on { d.relock() } else { d.unlock() })
    }

    /// The disks as `vm.info` shows them.
    pub fn disks(&self) -> Vec<kumo_api::DiskInfo> {
        self.disks.iter().map(Disk::info).collect()
    }

    /// Each disk's id, image path and size.
    pub fn disk_images(&self) -> Vec<(String, std::path::PathBuf, u64)> {
        self.disks
            .iter()
            .map(|d| {
                let (p, s) = d.image();
                (d.id().to_string(), p, s)
            })
            .collect()
    }

    /// Stops devices that work outside the vCPU threads (the NICs) from touching guest memory;
    /// returns once they are out of it. Called whenever the vCPUs have stopped.
    pub fn pause(&self) {
        for n in &self.nics {
            n.pause();
        }
        for d in &self.disks {
            d.pause();
        }
    }

    /// Lets them run again.
    pub fn resume(&self) {
        for n in &self.nics {
            n.resume();
        }
        for d in &self.disks {
            d.resume();
        }
    }

    /// Whether the host hands frames to this process's tap queues (multi-queue taps): off on a
    /// migration's destination until it runs, and on its source once it stopped for good.
    pub fn set_taps_attached(&self, on: bool) {
        for n in &self.nics {
            n.set_tap_attached(on);
        }
    }

    /// Why the VM cannot be snapshotted, if a device forbids it (a vhost-user NIC).
    pub fn snapshot_blocker(&self) -> Option<String> {
        self.nics.iter().find_map(Nic::snapshot_blocker)
    }

    /// The devices' own dirty logs (vhost-user backends), to merge with KVM's.
    pub fn dirty_logs(&self) -> Vec<&dyn kumo_vm::dirty::DeviceDirtyLog> {
        self.nics.iter().filter_map(Nic::dirty_log).collect()
    }

    /// Stops (`on`) or restarts external backends' rings: a migration's stop phase, its failure.
    pub fn suspend_backends(&self, on: bool) -> std::result::Result<(), String> {
        self.nics.iter().try_for_each(|n| n.suspend_backend(on))
    }

    /// The NICs as `vm.info` shows them.
    pub fn nics(&self) -> Vec<kumo_api::NetInfo> {
        self.nics.iter().map(Nic::info).collect()
    }

    /// Interrupts the shared path's dispatcher injected, if there is one.
    pub fn shared_path_injected(&self) -> Option<u64> {
        self.dispatcher.as_ref().map(|d| d.counters().injected.load(Ordering::Relaxed))
    }

    /// The PCI bus (BAR placement, ECAM base).
    pub fn pci(&self) -> &Pci {
        &self.pci
    }

    /// The PCI bus, to put more functions on it while the VM is built (memory zones).
    pub fn pci_mut(&mut self) -> &mut Pci {
        &mut self.pci
    }

    /// The buses the vCPU threads dispatch to.
    pub fn buses(&self) -> &Arc<Buses> {
        &self.buses
    }

    pub fn serial(&self) -> &Arc<Mutex<SerialConsole>> {
        &self.serial
    }

    /// Feeds bytes to COM1 now; returns how many its receive FIFO took.
    pub fn serial_input(&self, bytes: &[u8]) -> usize {
        lock(&self.serial).enqueue_input(bytes)
    }

    /// Pushes buffered console output out.
    pub fn flush_console(&self) {
        let _ = lock(&self.serial).flush_output();
    }

    /// Every device's state, by component id. The VM must be paused.
    pub fn save_states(&self) -> std::result::Result<DeviceStates, PersistError> {
        self.persist
            .iter()
            .map(|d| {
                let d = lock(d);
                Ok((d.id(), d.save_dyn()?))
            })
            .collect()
    }

    /// Checks that `states` has a state for each device, of its kind, and none for a device this
    /// VM lacks.
    pub fn check_states(&self, states: &DeviceStates) -> std::result::Result<(), PersistError> {
        check_ids(states, self.persist.iter().map(|d| lock(d).id()))?;
        self.persist.iter().try_for_each(|d| {
            let d = lock(d);
            let id = d.id();
            states.get(&id).map_or(Err(PersistError::Missing(id)), |s| d.check_kind(s))
        })
    }

    /// Restores every device from `states` (checked first, see [`DeviceManager::check_states`]).
    pub fn restore_states(&self, states: &DeviceStates) -> std::result::Result<(), PersistError> {
        self.check_states(states)?;
        for d in &self.persist {
            let mut d = lock(d);
            let id = d.id();
            d.restore_dyn(states.get(&id).ok_or(PersistError::Missing(id))?)?;
        }
        // BARs are where the guest had them: the window and doorbells follow.
        self.pci.refresh();
        Ok(())
    }

    /// Makes the event loop feed what arrives on `input` (a terminal, pipe or socket) to COM1,
    /// holding back what the FIFO cannot take until the guest has read it: nothing is dropped.
    /// Refused for a descriptor epoll cannot watch (a regular file, /dev/null) and for a second
    /// input.
    pub fn attach_console_input(&self, input: OwnedFd) -> Result<()> {
        if self.console_attached.swap(true, Ordering::AcqRel) {
            return Err(Error::Devices("COM1 already has a console input".into()));
        }
        let drained = self.serial_drained.try_clone().map_err(dev_err("eventfd"))?;
        let fds = [(input.as_raw_fd(), EventSet::IN), (drained.as_raw_fd(), EventSet::IN)];
        let handler = ConsoleInput {
            input: std::fs::File::from(input),
            drained,
            serial: self.serial.clone(),
            pending: Vec::new(),
            eof: false,
        };
        self.events.add(&fds, Box::new(handler)).map_err(|e| {
            self.console_attached.store(false, Ordering::Release);
            Error::Devices(format!("console input cannot be watched: {e}"))
        })
    }
}

/// Console input → COM1, on the event loop. While the FIFO is full the input is not watched
/// (so it backs up in the pipe or socket, not in kumo); the FIFO's drained event resumes it.
struct ConsoleInput {
    input: std::fs::File,
    drained: EventFd,
    serial: Arc<Mutex<SerialConsole>>,
    pending: Vec<u8>,
    eof: bool,
}

const INPUT: usize = 0;
const DRAINED: usize = 1;

impl ConsoleInput {
    fn feed(&mut self, interest: &mut Interest) {
        if !self.pending.is_empty() {
            let took = lock(&self.serial).enqueue_input(&self.pending);
            self.pending.drain(..took);
        }
        match (self.pending.is_empty(), self.eof) {
            (true, true) => interest.remove(),
            (true, false) => interest.set(INPUT, EventSet::IN),
            (false, _) => interest.set(INPUT, EventSet::empty()),
        }
    }
}

impl EventHandler for ConsoleInput {
    fn handle(&mut self, source: usize, _events: EventSet, interest: &mut Interest) {
        if source == DRAINED {
            let _ = self.drained.read();
            return self.feed(interest);
        }
        let mut buf = [0u8; 256];
        match self.input.read(&mut buf) {
            Ok(0) => self.eof = true,
            Ok(n) => self.pending.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock) => return,
            Err(e) => {
                tracing::warn!("console input stops: {e}");
                self.eof = true;
            }
        }
        self.feed(interest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    /// Reads COM1's receive buffer as a guest would, until `n` bytes came (bounded only as a
    /// safety net).
    fn guest_reads(buses: &Buses, n: usize) -> Vec<u8> {
        let port = u64::from(COM1_PORT);
        let mut got = Vec::new();
        let t = Instant::now();
        while got.len() < n {
            let mut lsr = [0u8];
            buses.pio.read(port + 5, &mut lsr);
            if lsr[0] & 1 != 0 {
                let mut b = [0u8];
                buses.pio.read(port, &mut b);
                got.push(b[0]);
            } else {
                assert!(t.elapsed() < Duration::from_secs(60), "input stalled after {} bytes", got.len());
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        got
    }

    #[test]
    fn console_input_reaches_com1_in_order_past_a_full_fifo() {
        if !kumo_vm::vm::kvm_available() {
            eprintln!("skipping console_input_reaches_com1_in_order_past_a_full_fifo: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(1, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let dm = DeviceManager::new(&vm, Box::new(std::io::sink()), &[], true, false).unwrap();
        let (mut user, end) = UnixStream::pair().unwrap();
        dm.attach_console_input(end.into()).unwrap();
        let (other, _keep) = UnixStream::pair().unwrap();
        assert!(dm.attach_console_input(other.into()).is_err(), "one console input");

        // 300 bytes: more than the 64-byte FIFO takes at once.
        let sent: Vec<u8> = (0..300u32).map(|i| b'a' + (i % 26) as u8).collect();
        user.write_all(&sent).unwrap();
        assert_eq!(guest_reads(dm.buses(), sent.len()), sent);
        drop(user);
    }

    #[test]
    fn device_states_are_saved_by_id_and_restored_into_another_vm() {
        if !kumo_vm::vm::kvm_available() {
            eprintln!("skipping device_states_are_saved_by_id_and_restored_into_another_vm: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(1, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let a = DeviceManager::new(&vm, Box::new(std::io::sink()), &[], true, false).unwrap();
        a.buses().pio.write(u64::from(COM1_PORT) + 7, &[0x5a]); // scratch register
        a.serial_input(b"hi");
        let states: DeviceStates =
            serde_json::from_str(&serde_json::to_string(&a.save_states().unwrap()).unwrap()).unwrap();
        assert_eq!(states.keys().collect::<Vec<_>>(), ["com1", "pci-root"]);

        let vm_b = Vm::new(1, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let b = DeviceManager::new(&vm_b, Box::new(std::io::sink()), &[], true, false).unwrap();
        let mut extra = states.clone();
        extra.insert("net0".into(), states["com1"].clone());
        let e = b.restore_states(&extra).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has state for net0, which this VM lacks");
        let e = b.restore_states(&DeviceStates::new()).unwrap_err().to_string();
        assert_eq!(e, "the snapshot has no state for com1");
        // A state of another kind is refused before any device changes (com1 comes first).
        let mut swapped = states.clone();
        swapped.insert("pci-root".into(), states["com1"].clone());
        let e = b.restore_states(&swapped).unwrap_err().to_string();
        assert_eq!(e, "pci-root: saved state is a serial state, not this component's");
        let mut r = [0u8];
        b.buses().pio.read(u64::from(COM1_PORT) + 7, &mut r);
        assert_eq!(r[0], 0, "com1 untouched");
        b.restore_states(&states).unwrap();
        let mut r = [0u8];
        b.buses().pio.read(u64::from(COM1_PORT) + 7, &mut r);
        assert_eq!(r[0], 0x5a);
        assert_eq!(guest_reads(b.buses(), 2), b"hi", "pending input moves with the state");
    }

    /// The lock hand-off of a migration on one host: the source gives the image up, the
    /// destination (which opened it unlocked) takes it, and the source cannot take it back
    /// while the destination holds it.
    #[test]
    fn disks_hand_their_image_lock_over() {
        if !kumo_vm::vm::kvm_available() {
            eprintln!("skipping disks_hand_their_image_lock_over: /dev/kvm not available");
            return;
        }
        let dir = std::env::temp_dir().join(format!("kumo-dm-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("d.img");
        std::fs::File::create(&img).unwrap().set_len(1 << 20).unwrap();
        let spec = crate::config::DiskSpec::new(&img);
        let vm = Vm::new(2, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let mut src = DeviceManager::new(&vm, Box::new(std::io::sink()), &[], true, false).unwrap();
        src.add_disks(&vm, std::slice::from_ref(&spec), 2, false).unwrap();
        let info = src.disks();
        assert_eq!((info[0].id.as_str(), info[0].queues, info[0].size, info[0].readonly), ("disk0", 2, 1 << 20, false));
        assert!(src.save_states().unwrap().contains_key("disk0"), "its state travels by id");

        let vm_b = Vm::new(2, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let mut dst = DeviceManager::new(&vm_b, Box::new(std::io::sink()), &[], true, false).unwrap();
        let mut third = DeviceManager::new(&vm_b, Box::new(std::io::sink()), &[], true, false).unwrap();
        let e = third.add_disks(&vm_b, std::slice::from_ref(&spec), 2, false).unwrap_err().to_string();
        assert!(e.contains("in use by another process (locked for writing)"), "{e}");
        dst.add_disks(&vm_b, std::slice::from_ref(&spec), 2, true).unwrap();
        src.pause();
        src.quiesce_disks().unwrap();
        src.lock_disks(false).unwrap();
        dst.lock_disks(true).unwrap();
        let e = src.lock_disks(true).unwrap_err().to_string();
        assert!(e.contains("in use by another process"), "{e}");
        drop(dst);
        src.lock_disks(true).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_debug_exit_port_is_there_only_when_asked_for_and_the_sleep_port_always() {
        if !kumo_vm::vm::kvm_available() {
            eprintln!(
                "skipping the_debug_exit_port_is_there_only_when_asked_for_and_the_sleep_port_always: no /dev/kvm"
            );
            return;
        }
        for on in [true, false] {
            let vm = Vm::new(1, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
            let dm = DeviceManager::new(&vm, Box::new(std::io::sink()), &[], on, false).unwrap();
            assert_eq!(dm.buses().pio.lookup(EXIT_PORT.into()).is_some(), on);
            assert_eq!(dm.buses().pio.write(EXIT_PORT.into(), &[3]).is_some(), on, "an exit with code 3");
            // The sleep control register is always there: the OS's S5 write powers off.
            let s5 = (kumo_devices::S5_SLEEP_TYPE << 2) | 0x20;
            assert_eq!(dm.buses().pio.write(SLEEP_PORT.into(), &[s5]), Some(kumo_devices::DeviceEvent::PowerOff));
        }
    }

    #[test]
    fn a_regular_file_is_refused_as_console_input() {
        if !kumo_vm::vm::kvm_available() {
            eprintln!("skipping a_regular_file_is_refused_as_console_input: /dev/kvm not available");
            return;
        }
        let vm = Vm::new(1, 16 << 20, kumo_vm::IrqchipMode::Kernel).unwrap();
        let dm = DeviceManager::new(&vm, Box::new(std::io::sink()), &[], true, false).unwrap();
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap();
        let fd: OwnedFd = f.into_file().into();
        let e = dm.attach_console_input(fd).unwrap_err().to_string();
        assert!(e.contains("cannot be watched"), "{e}");
        // Refused, so another input may still be attached.
        let (_user, end) = UnixStream::pair().unwrap();
        dm.attach_console_input(end.into()).unwrap();
    }
}
