//! COM1 (`kumo_devices::SerialConsole`, vm-superio's 16550A): arbitrary port accesses of any
//! width, console input, and restores of saved states (valid, or mutated: a snapshot file or
//! a migration peer supplies them).

use std::io::Write;
use std::sync::{Arc, Mutex};

use arbitrary::Arbitrary;
use kumo_devices::{BusDevice, SerialConsole, SerialSnapshot};
use vmm_sys_util::eventfd::EventFd;

use crate::{CaseResult, Input};

#[derive(Debug, Arbitrary)]
enum Op {
    Read { off: u8, len: u8 },
    Write { off: u8, v: u8, len: u8 },
    Input(Vec<u8>),
    SaveRestore,
    RestoreMutated,
}

/// Console output, kept to check that the guest's bytes reach it.
#[derive(Clone, Default)]
struct Out(Arc<Mutex<Vec<u8>>>);

impl Write for Out {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What vm-superio's UART can be in, whatever the guest and the console did.
pub fn check_state(s: &SerialSnapshot) {
    assert_eq!(s.interrupt_enable & !0x0F, 0, "IER {:#x}", s.interrupt_enable);
    assert!([1, 2, 4, 6].contains(&s.interrupt_identification), "IIR {:#x}", s.interrupt_identification);
    assert_eq!(s.line_status & !0x61, 0, "LSR {:#x}", s.line_status);
    assert_eq!(s.line_status & 0x60, 0x60, "LSR {:#x}: the transmitter is always ready", s.line_status);
    assert_eq!(
        s.line_status & 1 != 0,
        !s.in_buffer.is_empty(),
        "LSR data ready {:#x} with {} bytes",
        s.line_status,
        s.in_buffer.len()
    );
    assert_eq!(s.modem_status, 0xB0, "MSR {:#x}", s.modem_status);
    assert!(s.in_buffer.len() <= 64, "{} bytes in the FIFO", s.in_buffer.len());
}

fn console(out: &Out) -> SerialConsole {
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    SerialConsole::new(irq, Box::new(out.clone()))
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let out = Out::default();
    let mut com1 = console(&out);
    while !u.is_empty() {
        match u.arbitrary::<Op>()? {
            Op::Read { off, len } => {
                let mut d = vec![0u8; 1 + len as usize % 4];
                com1.read(off as u64 % 10, &mut d);
                if d.len() != 1 || off % 10 >= 8 {
                    assert!(d.iter().all(|&b| b == 0xff), "a wide or outside read gave {d:02x?}");
                }
            }
            Op::Write { off, v, len } => {
                let d = vec![v; 1 + len as usize % 4];
                let sent = out.0.lock().unwrap().len();
                let s = com1.state();
                com1.write(off as u64 % 10, &d);
                // A byte to THR (DLAB off, no loopback) reaches the console.
                if off % 10 == 0 && d.len() == 1 && s.line_control & 0x80 == 0 && s.modem_control & 0x10 == 0 {
                    assert_eq!(out.0.lock().unwrap().len(), sent + 1, "a byte the guest sent was lost");
                }
            }
            Op::Input(bytes) => {
                let before = com1.state().in_buffer.len();
                let n = com1.enqueue_input(&bytes);
                assert!(
                    n <= bytes.len() && before + n <= 64,
                    "{n} of {} bytes taken with {before} queued",
                    bytes.len()
                );
            }
            Op::SaveRestore => {
                let s = com1.state();
                let mut other = console(&out);
                other.restore(&s).expect("a saved state restores");
                assert_eq!(other.state(), s);
                com1 = other;
            }
            Op::RestoreMutated => {
                let before = com1.state();
                let valid = serde_json::to_value(&before).expect("serializes");
                let v = crate::json::mutated_or_garbage(u, &valid)?;
                if crate::json::restore_json(&mut com1, v).is_err() {
                    assert_eq!(com1.state(), before, "a refused restore changed the UART");
                }
            }
        }
        check_state(&com1.state());
    }
    Ok(())
}
