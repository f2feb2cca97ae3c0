//! COM1: a 16550A-compatible UART (vm-superio's) whose interrupt is an eventfd, so the VMM can
//! route it to any GSI through an irqfd and change that route later.

use std::io::Write;

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::PioDevice;
use crate::DeviceEvent;

pub const COM1_PORT: u16 = 0x3f8;
pub const COM1_IRQ: u32 = 4;

/// Raises the serial interrupt by signalling an eventfd (an irqfd in KVM).
pub struct EventFdTrigger(EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub struct SerialConsole {
    uart: Serial<EventFdTrigger, NoEvents, Box<dyn Write + Send>>,
}

impl SerialConsole {
    /// `irq` is signalled when the UART raises its interrupt line.
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self { uart: Serial::new(EventFdTrigger(irq), out) }
    }

    /// Register state, for saving a VM.
    pub fn state(&self) -> SerialState {
        self.uart.state()
    }

    /// Pushes buffered console output to the sink.
    pub fn flush_output(&mut self) -> std::io::Result<()> {
        self.uart.writer_mut().flush()
    }

    /// Feeds console input to the guest.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.uart.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl PioDevice for SerialConsole {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.uart.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> Option<DeviceEvent> {
        if data.len() == 1 && offset < 8 {
            // A failed write to the console sink or the irqfd must not stop the guest.
            let _ = self.uart.write(offset as u8, data[0]);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn bytes_written_to_thr_reach_the_sink() {
        let sink = Sink::default();
        let mut s = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(sink.clone()));
        for b in b"hi\n" {
            s.write(0, &[*b]);
        }
        assert_eq!(&*sink.0.lock().unwrap(), b"hi\n");
        // Line status register: transmitter empty, so guests polling LSR never block.
        let mut lsr = [0u8];
        s.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);
    }

    #[test]
    fn input_is_readable_from_rbr() {
        let mut s = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(std::io::sink()));
        assert_eq!(s.enqueue_input(b"x"), 1);
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b[0], b'x');
    }
}
