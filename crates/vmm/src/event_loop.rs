//! The device event loop: one thread per VM that waits (epoll, through vmm-sys-util) on the
//! file descriptors devices care about outside the vCPU threads — console input, and later a
//! tap device's queues, virtqueue ioeventfds and timers — and runs their handlers.
//!
//! A handler owns its descriptors and is registered with all of them at once; each readiness
//! report names which of them fired (`source`, its index in the registration), so one handler
//! can pace itself, e.g. stop reading input while the device cannot take more, through
//! [`Interest`]. Handlers run on the loop's thread only, one at a time.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kumo_sandbox::lock;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Something the loop runs when one of its descriptors is ready.
pub trait EventHandler: Send {
    /// `source` is the index, in the registration's list, of the descriptor that is ready.
    fn handle(&mut self, source: usize, events: EventSet, interest: &mut Interest);
}

/// What a handler asks of the loop about its own descriptors, from inside `handle`.
#[derive(Debug, Default)]
pub struct Interest {
    changes: Vec<(usize, EventSet)>,
    remove: bool,
}

impl Interest {
    /// Watches descriptor `source` for `events` from now on. Empty takes it out of the epoll set
    /// until set again, so not even a hang-up on it wakes the loop meanwhile.
    pub fn set(&mut self, source: usize, events: EventSet) {
        self.changes.push((source, events));
    }

    /// Drops the handler and stops watching all its descriptors.
    pub fn remove(&mut self) {
        self.remove = true;
    }
}

struct Slot {
    fds: Vec<RawFd>,
    /// Whether each descriptor is in the epoll set now.
    watched: Vec<bool>,
    handler: Box<dyn EventHandler>,
}

/// Tokens carry (handler id, source index): `id << 8 | source`.
const SOURCES_PER_HANDLER: u64 = 256;
/// The stop eventfd's token (no handler has this id).
const STOP: u64 = u64::MAX;

struct State {
    epoll: Epoll,
    slots: Mutex<HashMap<u64, Slot>>,
    next_id: Mutex<u64>,
}

/// A running event loop; dropping it stops and joins the thread.
pub struct EventLoop {
    state: Arc<State>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl EventLoop {
    /// Starts the loop's thread (named `name`).
    pub fn start(name: &str) -> std::io::Result<EventLoop> {
        Self::start_with(name, Duration::ZERO, || {})
    }

    /// [`EventLoop::start`], running `setup` on the new thread first (e.g. to set its priority).
    /// With a `poll` window the thread keeps looking for events (without sleeping) for that long
    /// after each one: the next frame of a round trip finds it awake (a NIC's `poll-us`).
    pub fn start_with(name: &str, poll: Duration, setup: impl FnOnce() + Send + 'static) -> std::io::Result<EventLoop> {
        let state = Arc::new(State { epoll: Epoll::new()?, slots: Mutex::new(HashMap::new()), next_id: Mutex::new(0) });
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        state.epoll.ctl(ControlOperation::Add, stop.as_raw_fd(), EpollEvent::new(EventSet::IN, STOP))?;
        let st = state.clone();
        let thread = kumo_sandbox::spawn(kumo_sandbox::ThreadKind::Device, name, move || {
            setup();
            run(&st, poll)
        })?;
        Ok(EventLoop { state, stop, thread: Some(thread) })
    }

    /// Registers `handler` for `fds` (descriptor, events to watch; at most 256). The handler must
    /// keep the descriptors open for as long as it is registered. Not to be called from inside a
    /// handler (the loop holds its handler table while one runs).
    pub fn add(&self, fds: &[(RawFd, EventSet)], handler: Box<dyn EventHandler>) -> std::io::Result<()> {
        if fds.is_empty() || fds.len() as u64 > SOURCES_PER_HANDLER {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a handler watches 1 to 256 descriptors",
            ));
        }
        let id = {
            let mut n = lock(&self.state.next_id);
            *n += 1;
            *n
        };
        // The slot goes in first: an event may arrive as soon as the first descriptor is added.
        let mut slots = lock(&self.state.slots);
        for (i, &(fd, ev)) in fds.iter().enumerate() {
            let token = id * SOURCES_PER_HANDLER + i as u64;
            if let Err(e) = self.state.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(ev, token)) {
                for &(added, _) in &fds[..i] {
                    let _ = self.state.epoll.ctl(ControlOperation::Delete, added, EpollEvent::default());
                }
                return Err(e);
            }
        }
        slots.insert(id, Slot { fds: fds.iter().map(|f| f.0).collect(), watched: vec![true; fds.len()], handler });
        Ok(())
    }

    /// How many handlers are registered.
    pub fn handlers(&self) -> usize {
        lock(&self.state.slots).len()
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(state: &State, poll: Duration) {
    let mut events = vec![EpollEvent::default(); 32];
    let mut last = Instant::now().checked_sub(poll).unwrap_or_else(Instant::now);
    loop {
        // Within the poll window a wait returns at once; past it, the thread sleeps.
        let polling = !poll.is_zero() && last.elapsed() < poll;
        let n = match state.epoll.wait(if polling { 0 } else { -1 }, &mut events) {
            Ok(0) if polling => {
                std::hint::spin_loop();
                continue;
            }
            Ok(n) => {
                if !poll.is_zero() {
                    last = Instant::now();
                }
                n
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("device event loop stops: epoll_wait: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == STOP {
                return;
            }
            if kumo_sandbox::test_hook_once("panic:device") {
                panic!("test hook panic:device: the device event loop panics on purpose");
            }
            let (id, source) = (ev.data() / SOURCES_PER_HANDLER, (ev.data() % SOURCES_PER_HANDLER) as usize);
            let mut slots = lock(&state.slots);
            // A handler removed earlier in this batch has nothing left to run.
            let Some(slot) = slots.get_mut(&id) else { continue };
            let mut interest = Interest::default();
            slot.handler.handle(source, ev.event_set(), &mut interest);
            for (i, set) in interest.changes {
                let Some(&fd) = slot.fds.get(i) else { continue };
                let token = id * SOURCES_PER_HANDLER + i as u64;
                let op = match (slot.watched[i], set.is_empty()) {
                    (true, true) => ControlOperation::Delete,
                    (true, false) => ControlOperation::Modify,
                    (false, false) => ControlOperation::Add,
                    (false, true) => continue,
                };
                match state.epoll.ctl(op, fd, EpollEvent::new(set, token)) {
                    Ok(()) => slot.watched[i] = !set.is_empty(),
                    Err(e) => tracing::warn!("event loop: cannot change interest in fd {fd}: {e}"),
                }
            }
            if interest.remove {
                if let Some(slot) = slots.remove(&id) {
                    for (fd, _) in slot.fds.into_iter().zip(slot.watched).filter(|x| x.1) {
                        let _ = state.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Counts signals on its first eventfd; a signal on the second removes it.
    struct Counter {
        evts: [EventFd; 2],
        seen: mpsc::Sender<(usize, u64)>,
    }

    impl EventHandler for Counter {
        fn handle(&mut self, source: usize, _events: EventSet, interest: &mut Interest) {
            let n = self.evts[source].read().unwrap_or(0);
            let _ = self.seen.send((source, n));
            if source == 1 {
                interest.remove();
            }
        }
    }

    #[test]
    fn runs_the_handler_of_the_ready_descriptor_and_removes_it_on_request() {
        check_runs_and_removes(EventLoop::start("test-events").unwrap());
    }

    /// A polling loop (a NIC's `poll-us`) handles events, and stops, as a sleeping one does:
    /// events come during a window and after it ran out.
    #[test]
    fn a_polling_loop_handles_events_and_stops_the_same() {
        check_runs_and_removes(EventLoop::start_with("test-poll", Duration::from_micros(200), || {}).unwrap());
    }

    fn check_runs_and_removes(el: EventLoop) {
        let (tx, rx) = mpsc::channel();
        let evts = [EventFd::new(libc::EFD_NONBLOCK).unwrap(), EventFd::new(libc::EFD_NONBLOCK).unwrap()];
        let (a, b) = (evts[0].try_clone().unwrap(), evts[1].try_clone().unwrap());
        let fds = [(evts[0].as_raw_fd(), EventSet::IN), (evts[1].as_raw_fd(), EventSet::IN)];
        el.add(&fds, Box::new(Counter { evts, seen: tx })).unwrap();
        assert_eq!(el.handlers(), 1);
        a.write(3).unwrap();
        assert_eq!(rx.recv().unwrap(), (0, 3));
        b.write(1).unwrap();
        assert_eq!(rx.recv().unwrap(), (1, 1));
        // Removed: the handler (and its sender) is dropped, so the channel closes.
        assert!(rx.recv().is_err());
        assert_eq!(el.handlers(), 0);
        drop(el); // stops and joins the thread
    }

    #[test]
    fn refuses_a_descriptor_epoll_cannot_watch() {
        let el = EventLoop::start("test-events").unwrap();
        let file = vmm_sys_util::tempfile::TempFile::new().unwrap();
        let (tx, _rx) = mpsc::channel();
        let evts = [EventFd::new(0).unwrap(), EventFd::new(0).unwrap()];
        let fds = [(evts[0].as_raw_fd(), EventSet::IN), (file.as_file().as_raw_fd(), EventSet::IN)];
        assert!(el.add(&fds, Box::new(Counter { evts, seen: tx })).is_err(), "a regular file cannot be polled");
        assert_eq!(el.handlers(), 0);
    }
}
