//! COM1: a 16550A-compatible UART (vm-superio's) whose interrupt is an eventfd, so the VMM can
//! route it to any GSI through an irqfd and change that route later. A second eventfd, if
//! given, says when the guest has emptied the receive FIFO: whoever feeds console input waits
//! on it while the FIFO is full, instead of polling.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{SerialEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::persist::{Persist, PersistError};
use crate::DeviceEvent;

pub const COM1_PORT: u16 = 0x3f8;
pub const COM1_IRQ: u32 = 4;

/// Raises the serial interrupt by signalling an eventfd (an irqfd in KVM).
/// Also counts the interrupts it raised (the API's `vm.counters`).
pub struct EventFdTrigger(EventFd, Arc<AtomicU64>);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.write(1)
    }
}

/// Signals its eventfd when the guest has read the last byte of the receive FIFO.
pub struct InputDrained(Option<EventFd>);

impl SerialEvents for InputDrained {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        if let Some(e) = &self.0 {
            let _ = e.write(1);
        }
    }
}

impl InputDrained {
    fn try_clone(&self) -> std::io::Result<Self> {
        Ok(InputDrained(self.0.as_ref().map(EventFd::try_clone).transpose()?))
    }
}

type Uart = Serial<EventFdTrigger, InputDrained, Box<dyn Write + Send>>;

pub struct SerialConsole {
    uart: Uart,
}

/// vm-superio's FIFO size: a saved state holding more input than this is not one it made.
const FIFO_SIZE: usize = 64;

/// The UART's registers and pending input, serializable (vm-superio's `SerialState` is not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

/// vm-superio's register values (its IER, IIR, LSR and MSR bits): the only ones its UART can
/// be in, whatever the guest writes.
const IER_VALID: u8 = 0x0f;
const IIR_VALUES: [u8; 4] = [0x01, 0x02, 0x04, 0x06];
const LSR_ALWAYS: u8 = 0x60;
const LSR_DATA_READY: u8 = 0x01;
const MSR_DEFAULT: u8 = 0xb0;

impl SerialSnapshot {
    /// Refuses a state vm-superio could not have produced: a garbage snapshot must not put the
    /// UART in a state its guest driver never sees (e.g. a transmitter that never empties).
    pub fn check(&self) -> Result<(), String> {
        let bad = |what: &str, v: u8| Err(format!("serial state has an impossible {what} {v:#04x}"));
        if self.in_buffer.len() > FIFO_SIZE {
            return Err(format!("serial state holds {} input bytes, the FIFO {FIFO_SIZE}", self.in_buffer.len()));
        }
        if self.interrupt_enable & !IER_VALID != 0 {
            return bad("IER", self.interrupt_enable);
        }
        if !IIR_VALUES.contains(&self.interrupt_identification) {
            return bad("IIR", self.interrupt_identification);
        }
        let ready = if self.in_buffer.is_empty() { 0 } else { LSR_DATA_READY };
        if self.line_status != LSR_ALWAYS | ready {
            return bad("LSR", self.line_status);
        }
        if self.modem_status != MSR_DEFAULT {
            return bad("MSR", self.modem_status);
        }
        Ok(())
    }
}

impl From<SerialState> for SerialSnapshot {
    fn from(s: SerialState) -> Self {
        SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialSnapshot> for SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl SerialConsole {
    /// `irq` is signalled when the UART raises its interrupt line.
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self { uart: Serial::with_events(EventFdTrigger(irq, Arc::default()), InputDrained(None), out) }
    }

    /// Like [`SerialConsole::new`], and signals `drained` each time the guest empties the
    /// receive FIFO.
    pub fn with_input_drained(irq: EventFd, drained: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self { uart: Serial::with_events(EventFdTrigger(irq, Arc::default()), InputDrained(Some(drained)), out) }
    }

    /// Register state and pending input, for saving a VM.
    pub fn state(&self) -> SerialSnapshot {
        self.uart.state().into()
    }

    /// Puts back a state from [`SerialConsole::state`], keeping this console's interrupt and
    /// output sink. A state vm-superio could not have produced is refused and changes nothing.
    pub fn restore(&mut self, s: &SerialSnapshot) -> Result<(), String> {
        s.check()?;
        let irq = self.uart.interrupt_evt().0.try_clone().map_err(|e| format!("serial interrupt: {e}"))?;
        let raised = self.uart.interrupt_evt().1.clone();
        let events = self.uart.events().try_clone().map_err(|e| format!("serial input event: {e}"))?;
        let placeholder = Serial::with_events(
            EventFdTrigger(irq.try_clone().map_err(|e| format!("serial interrupt: {e}"))?, raised.clone()),
            InputDrained(None),
            Box::new(std::io::sink()) as Box<dyn Write + Send>,
        );
        let out = std::mem::replace(&mut self.uart, placeholder).into_writer();
        // Cannot fail: the only check, the FIFO size, was made above. A pending interrupt is
        // raised again on the (new) irqfd, which is what the guest expects after a restore.
        self.uart = Serial::from_state(&SerialState::from(s), EventFdTrigger(irq, raised), events, out)
            .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(())
    }

    /// Interrupts raised so far (signals of its irqfd).
    pub fn interrupts_raised(&self) -> u64 {
        self.uart.interrupt_evt().1.load(Ordering::Relaxed)
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

/// COM1's id in snapshots.
pub const COM1_ID: &str = "com1";

impl Persist for SerialConsole {
    type State = SerialSnapshot;
    fn id(&self) -> String {
        COM1_ID.into()
    }
    fn save(&self) -> Result<SerialSnapshot, PersistError> {
        Ok(self.state())
    }
    fn restore(&mut self, state: &SerialSnapshot) -> Result<(), PersistError> {
        SerialConsole::restore(self, state).map_err(|e| PersistError::component(COM1_ID, e))
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.uart.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Option<DeviceEvent> {
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
    fn state_round_trips_through_json_and_restore() {
        let sink = Sink::default();
        let mut a = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(sink.clone()));
        a.write(3, &[0x80]); // DLAB on: set the baud divisor
        a.write(0, &[0x0c]);
        a.write(3, &[0x03]); // 8N1, DLAB off
        a.write(1, &[0x01]); // receive interrupt on
        a.write(7, &[0x5a]); // scratch
        a.enqueue_input(b"ok");
        let saved = a.state();
        let json = serde_json::to_string(&saved).unwrap();
        let back: SerialSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, saved);

        let sink_b = Sink::default();
        let mut b = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(sink_b.clone()));
        b.restore(&back).unwrap();
        assert_eq!(b.state(), saved);
        let mut r = [0u8];
        b.read(7, &mut r);
        assert_eq!(r[0], 0x5a);
        b.read(0, &mut r);
        assert_eq!(r[0], b'o', "pending input survives");
        // Output still goes to b's own sink.
        b.write(0, b"z");
        assert_eq!(&*sink_b.0.lock().unwrap(), b"z");

        let mut bad = saved.clone();
        bad.in_buffer = vec![0; 65];
        assert!(b.restore(&bad).is_err());
        assert_eq!(b.state().scratch, 0x5a, "a refused state changes nothing");
    }

    /// Found by kumo-fuzz (target `serial`): a restore took any register values, e.g. an LSR
    /// without THR-empty (the guest's driver then waits forever to send) or an IIR that
    /// names no interrupt; vm-superio's UART can be in none of them.
    #[test]
    fn states_the_uart_cannot_be_in_are_refused() {
        let mut a = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(Sink::default()));
        a.write(7, &[0x5a]);
        let good = a.state();
        let with_input = SerialSnapshot { in_buffer: vec![1], line_status: 0x61, ..good.clone() };
        let mut b = SerialConsole::new(EventFd::new(0).unwrap(), Box::new(Sink::default()));
        b.restore(&with_input).unwrap();
        for bad in [
            SerialSnapshot { line_status: 0, ..good.clone() },
            SerialSnapshot { line_status: 0x61, ..good.clone() },
            SerialSnapshot { in_buffer: vec![1], ..good.clone() },
            SerialSnapshot { interrupt_identification: 0, ..good.clone() },
            SerialSnapshot { interrupt_identification: 0xc1, ..good.clone() },
            SerialSnapshot { interrupt_enable: 0x10, ..good.clone() },
            SerialSnapshot { modem_status: 0, scratch: 1, ..good.clone() },
        ] {
            let e = a.restore(&bad).unwrap_err();
            assert!(e.starts_with("serial state has an impossible"), "{e}");
            assert_eq!(a.state(), good, "a refused state changes nothing");
        }
    }

    #[test]
    fn emptying_the_fifo_signals_input_drained() {
        let drained = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut s = SerialConsole::with_input_drained(
            EventFd::new(0).unwrap(),
            drained.try_clone().unwrap(),
            Box::new(std::io::sink()),
        );
        assert_eq!(s.enqueue_input(&[b'a'; 100]), FIFO_SIZE, "the FIFO takes 64");
        assert_eq!(s.enqueue_input(b"b"), 0, "full");
        let mut b = [0u8];
        for _ in 0..FIFO_SIZE - 1 {
            s.read(0, &mut b);
        }
        assert!(drained.read().is_err(), "not empty yet");
        s.read(0, &mut b);
        assert_eq!(drained.read().unwrap(), 1);
        // It survives a restore.
        s.restore(&s.state()).unwrap();
        s.enqueue_input(b"c");
        s.read(0, &mut b);
        assert_eq!(drained.read().unwrap(), 1);
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
