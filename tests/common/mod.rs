//! Helpers shared by kumo's end-to-end tests.
#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
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

/// A kumo child process that is killed if the test ends early.
pub struct Kid(pub Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Kid {
    /// Spawns `kumo ARGS` with piped stdin (the guest's console input), stdout and stderr.
    pub fn spawn(args: &[&str]) -> Kid {
        Kid(Command::new(kumo_bin())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kumo"))
    }

    /// Types `bytes` on the guest's serial console (kumo's stdin). memtouch with `until_input=1`
    /// or `hold_input=1` stops at the first byte: tests end guests this way, never by a timer.
    pub fn input(&mut self, bytes: &[u8]) {
        use std::io::Write;
        let stdin = self.0.stdin.as_mut().expect("kumo's stdin is piped");
        stdin.write_all(bytes).and_then(|()| stdin.flush()).expect("write to kumo's stdin");
    }

    /// Waits for exit (bounded) and returns (status code, stdout, stderr).
    pub fn finish(mut self, limit: Duration) -> (Option<i32>, String, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.0.try_wait().unwrap() {
                let mut out = String::new();
                let mut err = String::new();
                self.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
                self.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
                return (st.code(), out, err);
            }
            assert!(t.elapsed() < limit, "kumo did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kumo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
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
