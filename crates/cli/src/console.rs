//! The guest's serial console for `kumo run`: its output goes to stdout and to every client of
//! the console socket (`--console-socket PATH`); input typed on stdin or by any socket client
//! reaches the guest's COM1 in the order it is read, never dropped (it waits while the receive
//! FIFO is full).
//!
//! Each client's output is written by its own thread from a bounded queue: a client that does
//! not keep up (its queue full) is disconnected rather than slowing the guest down; stdout is
//! never skipped.

use kumo_sandbox::ThreadKind;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kumo_vmm::RunningVm;

/// Clients of the console socket that receive the guest's output: their writers' queues.
type Clients = Arc<Mutex<Vec<SyncSender<Vec<u8>>>>>;

/// Output chunks a client may lag behind by before it is disconnected.
const CLIENT_QUEUE: usize = 1024;

/// The console's output side: stdout plus the socket's clients.
#[derive(Clone)]
pub struct ConsoleOut {
    clients: Clients,
}

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // A closed stdout (its reader gone) must not stop the guest or the socket's clients.
        let _ = io::stdout().write_all(buf);
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        // A client whose queue is full (or whose writer has ended) is dropped.
        clients.retain(|c| c.try_send(buf.to_vec()).is_ok());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stdout().flush()
    }
}

/// The console socket: listening until dropped, then its file is removed.
pub struct ConsoleSocket {
    path: PathBuf,
    /// The socket we bound there (device, inode).
    id: Option<(u64, u64)>,
    clients: Clients,
    vm: Arc<Mutex<Option<Weak<RunningVm>>>>,
}

impl ConsoleSocket {
    /// Binds `path` (replacing a stale socket, never a live one or another kind of file) and
    /// accepts clients from a background thread. Their input waits until [`attach`] names the VM.
    ///
    /// [`attach`]: ConsoleSocket::attach
    pub fn bind(path: &Path) -> Result<ConsoleSocket, String> {
        let fail = |e: io::Error| format!("cannot serve the console on {}: {e}", path.display());
        // The console drives the guest: only its owner may connect (0600 from the start).
        let listener = kumo_sandbox::sock::bind_private(path).map_err(|e| match e.kind() {
            io::ErrorKind::AddrInUse => format!("{} is in use by another console", path.display()),
            io::ErrorKind::AlreadyExists => e.to_string(),
            _ => fail(e),
        })?;
        let id = kumo_sandbox::sock::socket_id(path);
        let socket = ConsoleSocket { path: path.to_path_buf(), id, clients: Clients::default(), vm: Arc::default() };
        let (clients, vm) = (socket.clients.clone(), socket.vm.clone());
        kumo_sandbox::spawn(ThreadKind::Console, "console-accept", move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let Ok(mut out) = conn.try_clone() else { continue };
                let (tx, rx) = sync_channel::<Vec<u8>>(CLIENT_QUEUE);
                let writer = kumo_sandbox::spawn(ThreadKind::Console, "console-out", move || {
                    for chunk in rx {
                        if out.write_all(&chunk).is_err() {
                            // Gone: reading ends too, and the queue's sender is dropped.
                            let _ = out.shutdown(std::net::Shutdown::Both);
                            return;
                        }
                    }
                });
                if writer.is_err() {
                    continue;
                }
                clients.lock().unwrap_or_else(|p| p.into_inner()).push(tx);
                let vm = vm.clone();
                let _ = kumo_sandbox::spawn(ThreadKind::Console, "console-client", move || {
                    feed(conn, || match &*vm.lock().unwrap_or_else(|p| p.into_inner()) {
                        None => Target::NotYet,
                        Some(w) => w.upgrade().map_or(Target::Gone, Target::Vm),
                    })
                });
            }
        })
        .map_err(fail)?;
        Ok(socket)
    }

    /// The console's output: give it to the VM as its serial writer.
    pub fn output(&self) -> ConsoleOut {
        ConsoleOut { clients: self.clients.clone() }
    }

    /// From now on clients' input goes to `vm`.
    pub fn attach(&self, vm: &Arc<RunningVm>) {
        *self.vm.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::downgrade(vm));
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        // Only our own socket: one that replaced it meanwhile stays.
        kumo_sandbox::sock::remove_socket(&self.path, self.id);
    }
}

/// The console's output without a socket: stdout only.
pub fn stdout_only() -> ConsoleOut {
    ConsoleOut { clients: Clients::default() }
}

/// Where console input goes.
pub enum Target {
    /// No VM yet (a destination still receiving it): input waits.
    NotYet,
    Vm(Arc<RunningVm>),
    /// The VM has ended: input stops.
    Gone,
}

/// Copies `input` to the guest's COM1 until it ends or the VM does. `vm` is asked again for
/// each chunk, so input that arrives before the VM waits for it.
pub fn feed(mut input: impl Read, vm: impl Fn() -> Target) {
    let mut buf = [0u8; 64];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let vm = match vm() {
                Target::Vm(vm) => vm,
                Target::Gone => return,
                Target::NotYet => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            if vm.is_finished() {
                return;
            }
            let took = vm.serial_input(rest);
            rest = &rest[took..];
            drop(vm);
            if !rest.is_empty() {
                // The guest has not read its FIFO yet.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}
