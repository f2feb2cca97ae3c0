//! An empty VMM: `kumo run --api-socket S` with nothing to boot serves its API and waits to be
//! told what to become, Cloud Hypervisor's model. `vm.restore` runs a snapshot file,
//! `vm.receive-migration` listens for a migrating VM (then it is a destination, as
//! `kumo run --incoming`). The API thread that is told builds the VM (for a migration, a thread
//! of its own once it listens); the main thread waits for it in [`EmptyVmm::wait`] and then
//! runs it as any other VM. The handler's side is in `api.rs`.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::vmm::RunningVm;

/// Prints the lines an operator wants to see (listening, received, restored).
pub type Say = Box<dyn Fn(&str) + Send + Sync>;
/// Makes the writer a new VM's serial console goes to.
pub type ConsoleFactory = Box<dyn Fn() -> Box<dyn std::io::Write + Send> + Send + Sync>;

/// What an empty VMM has become so far.
enum Stage {
    Empty,
    /// A restore or a receive-migration is under way (what it is): others are refused.
    Becoming(&'static str),
    /// The VM runs; the main thread has not taken it yet.
    Ready(Arc<RunningVm>),
    /// No VM could be brought here after all (an incoming migration failed): the VMM ends.
    Failed(String),
    /// The main thread runs the VM.
    Taken,
    /// `vmm.shutdown` before any VM: the VMM ends (cleanly).
    Exit,
}

/// What the VMM does once its VM has ended. A VM made by `vm.create` follows Cloud
/// Hypervisor's model, where the VMM outlives its VM; any other ends its VMM with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterVm {
    /// The process ends (kumo's own VMs; `vmm.shutdown`; a VM that failed).
    Exit,
    /// The VMM waits on its API again, the VM shut down (`vm.boot` starts it again,
    /// `vm.delete` forgets it, `vmm.shutdown` ends the VMM).
    Wait,
    /// The VM is built again from its config at once (`vm.reboot`, the guest's own reset).
    Reboot,
}

/// Why the API stopped a VM made by `vm.create` (the main thread reads it when the VM ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndIntent {
    Reboot,
    Delete,
    Exit,
}

/// What a VM made by `vm.create` leads to once it ended: by what the API asked for, else by
/// how it ended (a guest that resets reboots, as on hardware; one that powers off or is shut
/// down leaves the VMM waiting; an error or a panic ends the VMM).
pub fn after_created_vm(intent: Option<EndIntent>, outcome: &crate::Outcome) -> AfterVm {
    use crate::Outcome as O;
    match (intent, outcome) {
        (Some(EndIntent::Exit), _) => AfterVm::Exit,
        (Some(EndIntent::Delete), _) => AfterVm::Wait,
        (Some(EndIntent::Reboot), _) | (None, O::Reset(_)) => AfterVm::Reboot,
        (None, O::Shutdown | O::PowerOff | O::GuestExit(_)) => AfterVm::Wait,
        (None, O::Error(_) | O::TimedOut | O::Migrated(_) | O::Panicked(_)) => AfterVm::Exit,
    }
}

/// The slot an empty VMM's API fills with a VM, and the main thread waits on.
pub struct EmptyVmm {
    stage: Mutex<Stage>,
    changed: Condvar,
    /// When the VMM started (`vm.info`'s uptime before there is a VM).
    pub since: Instant,
    pub say: Say,
    /// Where the VM's serial console writes, once there is a VM.
    pub console: ConsoleFactory,
}

impl EmptyVmm {
    pub fn new(say: Say, console: ConsoleFactory) -> EmptyVmm {
        EmptyVmm { stage: Mutex::new(Stage::Empty), changed: Condvar::new(), since: Instant::now(), say, console }
    }

    fn stage(&self) -> MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the VMM for one way of getting a VM (`what`: "a restore", ...); refused while
    /// another runs or once there is a VM.
    pub fn claim(&self, what: &'static str) -> Result<(), String> {
        let mut st = self.stage();
        match &*st {
            Stage::Empty => {
                *st = Stage::Becoming(what);
                Ok(())
            }
            Stage::Becoming(other) => Err(format!("{other} is under way")),
            Stage::Failed(_) | Stage::Exit => Err("this VMM is ending".into()),
            Stage::Ready(_) | Stage::Taken => Err("this VMM has a VM already".into()),
        }
    }

    /// `vmm.shutdown` with no VM: the main thread's [`EmptyVmm::wait`] returns None and the
    /// VMM ends. Refused while a VM is being brought (it would be left half-built).
    pub fn exit(&self) -> Result<(), String> {
        let mut st = self.stage();
        match &*st {
            Stage::Empty | Stage::Failed(_) | Stage::Exit => {
                *st = Stage::Exit;
                self.changed.notify_all();
                Ok(())
            }
            Stage::Becoming(what) => Err(format!("{what} is under way")),
            Stage::Ready(_) | Stage::Taken => Err("this VMM has a VM: shut it down".into()),
        }
    }

    /// Gives a claim back: it failed before any VM existed, so the VMM is empty and usable.
    pub fn release(&self) {
        let mut st = self.stage();
        if matches!(*st, Stage::Becoming(_)) {
            *st = Stage::Empty;
        }
    }

    /// What is under way, if a claim is.
    pub fn busy(&self) -> Option<&'static str> {
        match *self.stage() {
            Stage::Becoming(what) => Some(what),
            _ => None,
        }
    }

    /// The claim brought a running VM: the main thread takes it.
    pub fn fill(&self, vm: Arc<RunningVm>) {
        *self.stage() = Stage::Ready(vm);
        self.changed.notify_all();
    }

    /// The VM the main thread took has ended and the VMM goes on ([`AfterVm::Wait`],
    /// [`AfterVm::Reboot`]): it is empty again.
    pub fn reset(&self) {
        let mut st = self.stage();
        if matches!(*st, Stage::Taken) {
            *st = Stage::Empty;
        }
    }

    /// The claim cannot be given back and brought no VM (an incoming migration failed after
    /// listening): the main thread ends the VMM with `why`.
    pub fn fail(&self, why: String) {
        *self.stage() = Stage::Failed(why);
        self.changed.notify_all();
    }

    /// A thread panicked before the main thread took a VM: the VMM ends with `why` (a VM
    /// already brought is stopped by its own registration and ends as any VM does).
    pub fn fail_waiting(&self, why: String) {
        let mut st = self.stage();
        if matches!(*st, Stage::Empty | Stage::Becoming(_)) {
            *st = Stage::Failed(why);
            self.changed.notify_all();
        }
    }

    /// Blocks until the API has brought a VM (it runs, or waits paused) or failed to; None:
    /// `vmm.shutdown` came first (the VMM ends cleanly).
    pub fn wait(&self) -> Result<Option<Arc<RunningVm>>, String> {
        let mut st = self.stage();
        loop {
            match std::mem::replace(&mut *st, Stage::Taken) {
                Stage::Ready(vm) => return Ok(Some(vm)),
                Stage::Exit => {
                    *st = Stage::Exit;
                    return Ok(None);
                }
                Stage::Failed(why) => {
                    *st = Stage::Failed(why.clone());
                    return Err(why);
                }
                Stage::Taken => return Err("the VM was taken already".into()),
                other => {
                    *st = other;
                    st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}

/// The file kumo writes in (and restores from) a Cloud Hypervisor snapshot directory.
pub const SNAPSHOT_FILE: &str = "kumo-snapshot";

/// The snapshot file a `vm.restore` names: `file:///abs/path` or `/abs/path` (as is: no
/// percent-decoding); a directory (CH's snapshots are directories) means its
/// [`SNAPSHOT_FILE`]. The VMM resolves it, so it must be absolute.
pub fn source_path(url: &str) -> Result<PathBuf, String> {
    let path = url_path("source_url", url)?;
    Ok(if path.is_dir() { path.join(SNAPSHOT_FILE) } else { path })
}

/// The file a `vm.snapshot` writes: kumo's `path`, or CH's `destination_url` (`file:///DIR`,
/// an existing directory: DIR/[`SNAPSHOT_FILE`]).
pub fn snapshot_path(path: &str, destination_url: Option<&str>) -> Result<PathBuf, String> {
    match (path.is_empty(), destination_url) {
        (false, None) => Ok(PathBuf::from(path)),
        (true, Some(url)) => {
            let dir = url_path("destination_url", url)?;
            if !dir.is_dir() {
                return Err(format!("destination_url {url}: not a directory (kumo writes {SNAPSHOT_FILE} in it)"));
            }
            Ok(dir.join(SNAPSHOT_FILE))
        }
        (false, Some(_)) => Err("vm.snapshot: give path or destination_url, not both".into()),
        (true, None) => Err("vm.snapshot: give path (a file) or destination_url (file:///DIR)".into()),
    }
}

/// `file:///abs/path` or `/abs/path` of request field `field`, absolute.
fn url_path(field: &str, url: &str) -> Result<PathBuf, String> {
    let path = match url.split_once("://") {
        Some(("file", rest)) => rest,
        Some((scheme, _)) => return Err(format!("{field} {url}: only file:// URLs or absolute paths ({scheme}://)")),
        None => url,
    };
    let path = PathBuf::from(path);
    if !path.is_absolute() {
        return Err(format!("{field} {url}: give an absolute path (file:///abs/path or /abs/path)"));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_urls() {
        assert_eq!(source_path("file:///var/vm.snap").unwrap(), PathBuf::from("/var/vm.snap"));
        assert_eq!(source_path("/var/vm.snap").unwrap(), PathBuf::from("/var/vm.snap"));
        assert!(source_path("vm.snap").unwrap_err().contains("absolute"));
        assert!(source_path("file://vm.snap").unwrap_err().contains("absolute"));
        assert!(source_path("http://host/vm.snap").unwrap_err().contains("only file://"));
        // A directory is CH's form: its kumo-snapshot file.
        let dir = std::env::temp_dir();
        assert_eq!(source_path(&format!("file://{}", dir.display())).unwrap(), dir.join(SNAPSHOT_FILE));
        let url = format!("file://{}", dir.display());
        assert_eq!(snapshot_path("", Some(&url)).unwrap(), dir.join(SNAPSHOT_FILE));
        assert_eq!(snapshot_path("/a/b", None).unwrap(), PathBuf::from("/a/b"));
        assert!(snapshot_path("", Some("file:///nonexistent/dir")).unwrap_err().contains("not a directory"));
        assert!(snapshot_path("/a", Some(&url)).unwrap_err().contains("not both"));
        assert!(snapshot_path("", None).unwrap_err().contains("give path"));
    }

    #[test]
    fn one_claim_at_a_time_and_a_released_one_leaves_the_vmm_usable() {
        let e = EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink())));
        assert_eq!(e.busy(), None);
        e.claim("a restore").unwrap();
        assert_eq!(e.busy(), Some("a restore"));
        assert_eq!(e.claim("an incoming migration").unwrap_err(), "a restore is under way");
        e.release();
        e.claim("an incoming migration").unwrap();
        e.fail("incoming migration failed: the source aborted".into());
        assert_eq!(e.claim("a restore").unwrap_err(), "this VMM is ending");
        assert_eq!(e.wait().err().as_deref(), Some("incoming migration failed: the source aborted"));
    }

    #[test]
    fn the_main_thread_waits_for_the_outcome() {
        let e = Arc::new(EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink()))));
        e.claim("an incoming migration").unwrap();
        let waiter = {
            let e = e.clone();
            std::thread::spawn(move || e.wait())
        };
        e.fail("no".into());
        assert_eq!(waiter.join().unwrap().err().as_deref(), Some("no"));
    }

    #[test]
    fn a_created_vm_reboots_on_reset_waits_after_power_off_and_ends_on_errors() {
        use crate::Outcome as O;
        assert_eq!(after_created_vm(None, &O::Reset("triple fault".into())), AfterVm::Reboot);
        assert_eq!(after_created_vm(Some(EndIntent::Reboot), &O::Shutdown), AfterVm::Reboot);
        for o in [O::Shutdown, O::PowerOff, O::GuestExit(0)] {
            assert_eq!(after_created_vm(None, &o), AfterVm::Wait, "{o:?}");
        }
        assert_eq!(after_created_vm(Some(EndIntent::Delete), &O::Shutdown), AfterVm::Wait);
        assert_eq!(after_created_vm(Some(EndIntent::Exit), &O::Reset(String::new())), AfterVm::Exit);
        for o in [O::Error("e".into()), O::Panicked("p".into()), O::Migrated("m".into()), O::TimedOut] {
            assert_eq!(after_created_vm(None, &o), AfterVm::Exit, "{o:?}");
        }
    }

    #[test]
    fn an_ended_vm_leaves_the_vmm_empty_again() {
        let e = EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink())));
        e.claim("a boot").unwrap();
        *e.stage() = Stage::Taken; // as after fill() and wait()
        assert!(e.claim("a boot").is_err(), "it has a VM");
        e.reset();
        e.claim("a boot").expect("empty again: it can be booted");
    }

    #[test]
    fn vmm_shutdown_ends_an_empty_vmm_but_not_one_becoming_a_vm() {
        let e = EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink())));
        e.claim("a boot").unwrap();
        assert_eq!(e.exit().unwrap_err(), "a boot is under way");
        e.release();
        e.exit().unwrap();
        assert_eq!(e.claim("a restore").unwrap_err(), "this VMM is ending");
        assert!(matches!(e.wait(), Ok(None)));
    }

    #[test]
    fn a_panic_ends_a_waiting_vmm_but_not_one_that_failed_already() {
        let e = EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink())));
        e.fail_waiting("api thread panicked".into());
        assert_eq!(e.claim("a restore").unwrap_err(), "this VMM is ending");
        assert_eq!(e.wait().err().as_deref(), Some("api thread panicked"));
        let e = EmptyVmm::new(Box::new(|_| {}), Box::new(|| Box::new(std::io::sink())));
        e.fail("first".into());
        e.fail_waiting("later".into());
        assert_eq!(e.wait().err().as_deref(), Some("first"));
    }
}
