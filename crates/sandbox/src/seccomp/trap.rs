//! What a forbidden system call does under `--seccomp true`: the filter traps (SIGSYS) and
//! this handler writes one line naming the call and the thread's kind, then ends the process
//! with [`EXIT_STATUS`]. Only async-signal-safe work here: thread-local reads, a fixed buffer,
//! `write(2)` and `_exit(2)`.

use std::cell::Cell;
use std::io;

use crate::ThreadKind;

/// The exit status of a process stopped by a forbidden system call (128 + SIGSYS, as a shell
/// reports a process killed by SIGSYS).
pub const EXIT_STATUS: i32 = 128 + libc::SIGSYS;

/// Longest thread name kept for the message (the kernel's comm is 15 bytes).
const NAME_LEN: usize = 16;

thread_local! {
    // Const-initialized and without destructors: reading them in a signal handler touches
    // only this thread's TLS block.
    static KIND: Cell<Option<ThreadKind>> = const { Cell::new(None) };
    static NAME: Cell<[u8; NAME_LEN]> = const { Cell::new([0; NAME_LEN]) };
}

/// Records this thread's kind and name for the handler's message.
pub(super) fn set_current(kind: ThreadKind, name: &str) {
    let mut buf = [0u8; NAME_LEN];
    let n = name.len().min(NAME_LEN);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    KIND.with(|k| k.set(Some(kind)));
    NAME.with(|b| b.set(buf));
}

/// The kind this thread was started (or filtered) as.
pub fn current_kind() -> Option<ThreadKind> {
    KIND.with(Cell::get)
}

/// Installs the SIGSYS handler (before any filter, so no trap finds the default action).
pub(super) fn install_handler() -> io::Result<()> {
    // SAFETY: a zeroed sigaction is a valid value; the handler is an `extern "C"` function
    // with the SA_SIGINFO signature, and `act` outlives the call.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigsys as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The system call number of a SIGSYS from seccomp: `si_syscall`, which the libc crate does
/// not name; on x86_64 it follows si_signo, si_errno, si_code, padding and `si_call_addr`.
fn si_syscall(info: *const libc::siginfo_t) -> i32 {
    // SAFETY: the kernel passes a full siginfo_t (128 bytes) to an SA_SIGINFO handler; for a
    // seccomp SIGSYS the int at byte 24 is `si_syscall`.
    unsafe { (info as *const u8).add(24).cast::<i32>().read_unaligned() }
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let nr = si_syscall(info);
    let mut msg = Line::default();
    msg.push(b"kumo: seccomp: the ");
    msg.push(KIND.with(Cell::get).map_or("unfiltered", ThreadKind::name).as_bytes());
    msg.push(b" thread ");
    let name = NAME.with(Cell::get);
    msg.push(&name[..name.iter().position(|&b| b == 0).unwrap_or(NAME_LEN)]);
    msg.push(b" made a forbidden system call: ");
    msg.push(syscall_name(nr).as_bytes());
    msg.push(b" (");
    msg.push_number(nr as u32);
    msg.push(b"); stopping the VM (--seccomp log reports such calls without stopping)\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is valid for its length.
    unsafe {
        libc::write(2, msg.buf.as_ptr().cast(), msg.len);
        libc::_exit(EXIT_STATUS);
    }
}

/// The name of system call `nr` on this architecture ("?" if unknown); no allocation.
pub fn syscall_name(nr: i32) -> &'static str {
    usize::try_from(nr).ok().and_then(syscalls::Sysno::new).map_or("?", |s| s.name())
}

/// A message built in place (a signal handler may not allocate).
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line { buf: [0; 256], len: 0 }
    }
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    fn push_number(&mut self, mut v: u32) {
        let mut digits = [0u8; 10];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscalls_are_named_from_the_table() {
        assert_eq!(syscall_name(libc::SYS_ioctl as i32), "ioctl");
        assert_eq!(syscall_name(libc::SYS_ptrace as i32), "ptrace");
        assert_eq!(syscall_name(-1), "?");
        assert_eq!(syscall_name(100_000), "?");
    }

    #[test]
    fn a_line_holds_text_and_numbers() {
        let mut l = Line::default();
        l.push(b"x ");
        l.push_number(0);
        l.push(b" ");
        l.push_number(4_294_967_295);
        assert_eq!(&l.buf[..l.len], b"x 0 4294967295");
    }
}
