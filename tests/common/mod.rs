//! Helpers shared by kumo's end-to-end tests.
#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// True if /dev/kvm can be opened. KVM tests print why they skip and return when it cannot.
pub fn kvm_or_skip(test: &str) -> bool {
    match kumo_vm::vm::open_kvm() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            false
        }
    }
}

pub fn kumo_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kumo"))
}

pub fn kumo(args: &[&str]) -> Output {
    Command::new(kumo_bin()).args(args).output().expect("run kumo")
}

pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// A child process (kumo, or any command) that is killed if the test ends early. Its stdout
/// and stderr are collected by threads as they arrive, so a test can wait for a line while it
/// runs ([`Kid::wait_stdout`]).
pub struct Kid {
    pub child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    /// Names the child in failures.
    name: String,
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(mut from: impl Read + Send + 'static, into: Arc<Mutex<Vec<u8>>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            into.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    })
}

impl Kid {
    /// Spawns `kumo ARGS` with piped stdin (the guest's console input), stdout and stderr.
    pub fn spawn(args: &[&str]) -> Kid {
        Kid::spawn_cmd(Command::new(kumo_bin()).args(args))
    }

    /// Spawns any command the same way (another program, extra environment, ...).
    pub fn spawn_cmd(cmd: &mut Command) -> Kid {
        Kid::from_child(cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn"))
    }

    /// Wraps a child spawned elsewhere; its piped stdout and stderr (if any) are collected.
    pub fn from_child(mut child: Child) -> Kid {
        let (out, err) = (Arc::default(), Arc::default());
        let mut readers = Vec::new();
        if let Some(s) = child.stdout.take() {
            readers.push(collect(s, Arc::clone(&out)));
        }
        if let Some(s) = child.stderr.take() {
            readers.push(collect(s, Arc::clone(&err)));
        }
        Kid { child, out, err, readers, name: "the child".into() }
    }

    /// Names the child in failure messages (a test's tag: "dst", "hop2", ...).
    pub fn named(mut self, name: &str) -> Kid {
        self.name = name.to_string();
        self
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (e.g. "TERM", "INT") with kill(1).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill").arg(format!("-{sig}")).arg(self.id().to_string()).status().expect("run kill");
        assert!(st.success(), "kill -{sig} failed");
    }

    /// stdout so far.
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    /// stderr so far.
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.err.lock().unwrap()).into_owned()
    }

    /// Waits (bounded) until stdout contains `what`.
    pub fn wait_stdout(&self, what: &str, limit: Duration) {
        let t = Instant::now();
        while !self.stdout().contains(what) {
            assert!(
                t.elapsed() < limit,
                "no `{what}` on {}'s stdout within {limit:?}; stderr: {}",
                self.name,
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Types `bytes` on the guest's serial console (kumo's stdin). memtouch with `until_input=1`
    /// or `hold_input=1` stops at the first byte: tests end guests this way, never by a timer.
    pub fn input(&mut self, bytes: &[u8]) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("kumo's stdin is piped");
        stdin.write_all(bytes).and_then(|()| stdin.flush()).expect("write to kumo's stdin");
    }

    /// Tells the guest to stop (memtouch `until_input`/`hold_input`): one byte on its console.
    pub fn stop_guest(&mut self) {
        self.input(b"q");
    }

    /// Waits for exit (within [`PATIENCE`]) and returns (status code, stdout, stderr).
    pub fn wait(self) -> (Option<i32>, String, String) {
        self.finish(PATIENCE)
    }

    /// Waits for exit (bounded) and returns (status code, stdout, stderr).
    pub fn finish(mut self, limit: Duration) -> (Option<i32>, String, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return (st.code(), self.stdout(), self.stderr());
            }
            assert!(t.elapsed() < limit, "{} did not exit within {limit:?}; stderr:\n{}", self.name, self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A private temporary directory (vmm-sys-util's), removed with its contents when dropped.
pub struct TestDir(vmm_sys_util::tempdir::TempDir);

impl TestDir {
    pub fn new() -> TestDir {
        // Short: unix socket paths must stay under 108 bytes.
        let prefix = std::env::temp_dir().join("kumo-test-");
        TestDir(vmm_sys_util::tempdir::TempDir::new_with_prefix(prefix).expect("create a temp dir"))
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.as_path().join(name)
    }

    /// The same, as a string for a command line.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).to_str().expect("temp paths are UTF-8").to_string()
    }
}

/// A path in a per-process directory that is never removed: prefer [`TestDir`].
pub fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kumo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the listener is closed before it is
/// returned, so another process could take it; tests use it at once).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local address").port()
}

/// How long tests wait for something that normally takes a moment (a VM to start, a socket to
/// appear): only a safety net against hangs, far above any normal duration, so that a slow or
/// busy machine does not fail a test.
pub const PATIENCE: Duration = Duration::from_secs(300);

/// Polls `f` until it returns Some, for at most `limit`.
pub fn eventually<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < limit, "condition not met within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of `key=` in a guest output line that starts with `prefix`.
pub fn field(out: &str, prefix: &str, key: &str) -> Option<String> {
    out.lines()
        .filter(|l| l.starts_with(prefix))
        .flat_map(|l| l.split_whitespace())
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(String::from))
}
