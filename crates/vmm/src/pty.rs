//! A pseudo-terminal for the serial console in Cloud Hypervisor's `Pty` mode (`vm.create`'s
//! `serial` or `console`): COM1's output goes to its master and what arrives there is typed
//! on COM1; `vm.info` reports the slave (`/dev/pts/N`) as CH does, in the mode's `file`.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;

/// An open pseudo-terminal in raw mode.
pub struct Pty {
    master: File,
    /// Kept open, so the master never reads a hang-up while no client has the slave open.
    slave: Arc<File>,
    /// The slave's path, for a client (`virsh console`, `screen`) to open.
    pub path: PathBuf,
}

impl Pty {
    pub fn open() -> io::Result<Pty> {
        let flags = libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC;
        let master = OpenOptions::new().read(true).write(true).custom_flags(flags).open("/dev/ptmx")?;
        let fd = master.as_raw_fd();
        let unlock: libc::c_int = 0;
        // SAFETY: TIOCSPTLCK reads one c_int through the pointer, which outlives the call.
        if unsafe { libc::ioctl(fd, libc::TIOCSPTLCK, &unlock) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut n: libc::c_uint = 0;
        // SAFETY: TIOCGPTN writes one c_uint through the pointer, which outlives the call.
        if unsafe { libc::ioctl(fd, libc::TIOCGPTN, &mut n) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/pts/{n}"));
        let slave =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC).open(&path)?;
        raw(&slave)?;
        Ok(Pty { master, slave: Arc::new(slave), path })
    }

    /// COM1's output: bytes no one reads are dropped once the terminal's buffer is full (the
    /// guest never waits for a reader).
    pub fn output(&self) -> io::Result<Box<dyn Write + Send>> {
        Ok(Box::new(PtyOut { master: self.master.try_clone()?, _slave: self.slave.clone() }))
    }

    /// What a client types, for COM1's input.
    pub fn input(&self) -> io::Result<OwnedFd> {
        Ok(self.master.try_clone()?.into())
    }
}

/// Raw mode (no echo, no line editing, no output processing): the guest's bytes as they are.
fn raw(f: &File) -> io::Result<()> {
    let fd = f.as_raw_fd();
    // SAFETY: termios is plain data, all-zero valid; tcgetattr fills it.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid termios that outlives the calls.
    unsafe {
        if libc::tcgetattr(fd, &mut t) < 0 {
            return Err(io::Error::last_os_error());
        }
        libc::cfmakeraw(&mut t);
        if libc::tcsetattr(fd, libc::TCSANOW, &t) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

struct PtyOut {
    master: File,
    _slave: Arc<File>,
}

impl Write for PtyOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.master.write(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(buf.len()),
            r => r,
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn what_the_guest_writes_reads_from_the_slave_and_typing_reaches_the_master() {
        let pty = Pty::open().unwrap();
        let mut out = pty.output().unwrap();
        out.write_all(b"hello\n").unwrap();
        let mut client = OpenOptions::new().read(true).write(true).open(&pty.path).unwrap();
        let mut got = [0u8; 6];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello\n", "raw: no CR added");
        client.write_all(b"x").unwrap();
        let mut input = File::from(pty.input().unwrap());
        let mut b = [0u8; 1];
        // Non-blocking: the byte is there once written (raw mode: no line buffering).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match input.read(&mut b) {
                Ok(1) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && std::time::Instant::now() < deadline => {
                    std::thread::yield_now()
                }
                r => panic!("{r:?}"),
            }
        }
        assert_eq!(&b, b"x");
        // Nobody reading: output is dropped rather than blocking the guest.
        for _ in 0..10_000 {
            out.write_all(&[b'.'; 64]).unwrap();
        }
    }
}
