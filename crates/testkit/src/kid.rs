//! The child-process harness: a [`Kid`] is a process (kumo, a tool, a shell) whose stdout and
//! stderr are collected by threads as they arrive, each complete line stamped with the host time
//! it arrived (a guest's own clock stops while it is paused), killed when dropped on every path.
//! Tests use the panicking methods (`wait_stdout`, `input`, `finish`); benchmarks the ones that
//! return a one-line error naming the process and quoting its stderr (`wait_line`, `send`,
//! `wait_exit`).

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_sandbox::lock;

use crate::{kumo_bin, PATIENCE};

/// Pids of all live [`Kid`]s, for a signal handler that must kill them (drops do not run then).
static LIVE: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// The pids of the [`Kid`]s alive now.
pub fn live_pids() -> Vec<u32> {
    lock(&LIVE).clone()
}

/// What a child printed on one stream: every byte, and its complete lines with arrival times.
#[derive(Default)]
pub struct Output {
    bytes: Vec<u8>,
    lines: Vec<(Instant, String)>,
    /// Where the line under way starts in `bytes`.
    line_start: usize,
}

impl Output {
    fn push(&mut self, chunk: &[u8]) {
        let at = Instant::now();
        self.bytes.extend_from_slice(chunk);
        while let Some(nl) = self.bytes[self.line_start..].iter().position(|&b| b == b'\n') {
            let end = self.line_start + nl;
            let line = String::from_utf8_lossy(&self.bytes[self.line_start..end]).trim_end().to_string();
            self.lines.push((at, line));
            self.line_start = end + 1;
        }
    }

    /// At the end of the stream: an unterminated last line is a line too.
    fn close(&mut self) {
        if self.line_start < self.bytes.len() {
            let line = String::from_utf8_lossy(&self.bytes[self.line_start..]).trim_end().to_string();
            self.lines.push((Instant::now(), line));
            self.line_start = self.bytes.len();
        }
    }

    /// Everything so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// The complete lines so far, each with the host time it arrived.
    pub fn lines(&self) -> Vec<(Instant, String)> {
        self.lines.clone()
    }
}

/// A shared handle on one stream's [`Output`]: still readable after its [`Kid`] is gone.
pub type SharedOutput = Arc<Mutex<Output>>;

/// Text of a shared output.
pub fn text_of(out: &SharedOutput) -> String {
    lock(out).text()
}

/// Lines of a shared output.
pub fn lines_of(out: &SharedOutput) -> Vec<(Instant, String)> {
    lock(out).lines()
}

fn collect(mut from: impl Read + Send + 'static, into: SharedOutput) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            lock(&into).push(&buf[..n]);
        }
        lock(&into).close();
    })
}

/// A child process, killed if it is dropped while it runs.
pub struct Kid {
    pub child: Child,
    stdin: Option<ChildStdin>,
    out: SharedOutput,
    err: SharedOutput,
    readers: Vec<std::thread::JoinHandle<()>>,
    /// When it was started.
    pub started: Instant,
    /// Names the child in failures.
    name: String,
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let pid = self.child.id();
        lock(&LIVE).retain(|p| *p != pid);
    }
}

impl Kid {
    /// Spawns `kumo ARGS` with piped stdin (the guest's console input), stdout and stderr.
    pub fn spawn(args: &[&str]) -> Kid {
        Kid::spawn_cmd(Command::new(kumo_bin()).args(args))
    }

    /// Spawns any command the same way (another program, extra environment, ...).
    pub fn spawn_cmd(cmd: &mut Command) -> Kid {
        Kid::start(cmd).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Spawns `argv` with piped stdin, stdout and stderr, inside network namespace `ns` if given
    /// (through `ip netns exec`, which execs it: the pid is the command's).
    pub fn start_in(ns: Option<&str>, argv: &[String]) -> Result<Kid, String> {
        let (program, args) = argv.split_first().ok_or("no command to start")?;
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        };
        cmd.args(args);
        let name = format!("`{}`", argv.iter().take(6).cloned().collect::<Vec<_>>().join(" "));
        Ok(Kid::start(&mut cmd)?.named(&name))
    }

    /// Spawns `cmd` with piped stdin, stdout and stderr.
    pub fn start(cmd: &mut Command) -> Result<Kid, String> {
        let what = format!("{:?}", cmd.get_program());
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // A binary a test has just written (a copy of kumo for another user) can be "busy" for
        // a moment: another test thread's fork inherits the writer's descriptor until that
        // child execs. That window is short; only this error is retried.
        let mut busy = 0;
        let child = loop {
            match cmd.spawn() {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && busy < 100 => {
                    busy += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                r => break r.map_err(|e| format!("cannot start {what}: {e}"))?,
            }
        };
        Ok(Kid::from_child(child).named(&what))
    }

    /// Wraps a child spawned elsewhere; its piped stdin, stdout and stderr (if any) are taken.
    pub fn from_child(mut child: Child) -> Kid {
        let (out, err): (SharedOutput, SharedOutput) = (Arc::default(), Arc::default());
        let mut readers = Vec::new();
        if let Some(s) = child.stdout.take() {
            readers.push(collect(s, Arc::clone(&out)));
        }
        if let Some(s) = child.stderr.take() {
            readers.push(collect(s, Arc::clone(&err)));
        }
        lock(&LIVE).push(child.id());
        Kid { stdin: child.stdin.take(), child, out, err, readers, started: Instant::now(), name: "the child".into() }
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
        text_of(&self.out)
    }

    /// stderr so far.
    pub fn stderr(&self) -> String {
        text_of(&self.err)
    }

    /// stdout's complete lines so far, each with the host time it arrived.
    pub fn lines(&self) -> Vec<(Instant, String)> {
        lines_of(&self.out)
    }

    /// A handle on stdout that outlives this process.
    pub fn stdout_handle(&self) -> SharedOutput {
        Arc::clone(&self.out)
    }

    /// `msg`, naming the process and quoting its last stderr line.
    pub fn why(&self, msg: &str) -> String {
        let err = self.stderr();
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        format!("{} {msg}{}", self.name, if last.is_empty() { String::new() } else { format!(": {last}") })
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

    /// Writes `bytes` to the child's stdin (a kumo VM's serial console).
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        let r = match self.stdin.as_mut() {
            Some(s) => s.write_all(bytes).and_then(|()| s.flush()).map_err(|e| e.to_string()),
            None => Err("stdin is closed".into()),
        };
        r.map_err(|e| self.why(&format!("console input failed: {e}")))
    }

    /// Types `bytes` on the guest's serial console (kumo's stdin). memtouch with `until_input=1`
    /// or `hold_input=1` stops at the first byte: tests end guests this way, never by a timer.
    pub fn input(&mut self, bytes: &[u8]) {
        self.send(bytes).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Tells the guest to stop (memtouch `until_input`/`hold_input`): one byte on its console.
    pub fn stop_guest(&mut self) {
        self.input(b"q");
    }

    /// Closes the child's stdin (a tool that stops on EOF).
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Joins the output readers once the process has exited: its output is then all there.
    fn drain(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    /// Polls `f` over (stdout, stderr) until it finds something; fails when the process exits
    /// first or after `limit`.
    pub fn wait_for<T>(
        &mut self,
        limit: Duration,
        what: &str,
        f: impl Fn(&str, &str) -> Option<T>,
    ) -> Result<T, String> {
        self.poll(limit, what, |k| f(&k.stdout(), &k.stderr()))
    }

    /// Waits for a stdout line that `f` accepts, returning its arrival time and value; fails
    /// when the process exits first or after `limit`.
    pub fn wait_line<T>(
        &mut self,
        limit: Duration,
        what: &str,
        f: impl Fn(&str) -> Option<T>,
    ) -> Result<(Instant, T), String> {
        self.poll(limit, what, |k| lock(&k.out).lines.iter().find_map(|(at, l)| f(l).map(|v| (*at, v))))
    }

    fn poll<T>(&mut self, limit: Duration, what: &str, f: impl Fn(&Kid) -> Option<T>) -> Result<T, String> {
        let t = Instant::now();
        loop {
            let exited = self.child.try_wait().ok().flatten();
            if exited.is_some() {
                self.drain();
            }
            // Looked at after try_wait: output written just before an exit is still seen.
            if let Some(v) = f(self) {
                return Ok(v);
            }
            if let Some(st) = exited {
                return Err(self.why(&format!("exited ({st}) before {what}")));
            }
            if t.elapsed() > limit {
                return Err(self.why(&format!("gave no {what} within {} s", limit.as_secs())));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The exit code if the process has exited (without waiting).
    pub fn try_exit(&mut self) -> Result<Option<i32>, String> {
        match self.child.try_wait() {
            Ok(st) => Ok(st.map(|s| s.code().unwrap_or(-1))),
            Err(e) => Err(self.why(&format!("cannot be waited for: {e}"))),
        }
    }

    /// Waits for the exit (bounded); its status code (-1 for a signal).
    pub fn wait_exit(&mut self, limit: Duration) -> Result<i32, String> {
        let t = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    self.drain();
                    return Ok(st.code().unwrap_or(-1));
                }
                Err(e) => return Err(self.why(&format!("cannot be waited for: {e}"))),
                Ok(None) if t.elapsed() > limit => {
                    return Err(self.why(&format!("did not exit within {} s", limit.as_secs())))
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Waits for a successful exit and returns the last stdout line parsed as JSON `T`.
    pub fn json_result<T: serde::de::DeserializeOwned>(&mut self, limit: Duration) -> Result<T, String> {
        let code = self.wait_exit(limit)?;
        if code != 0 {
            return Err(self.why(&format!("exited with {code}")));
        }
        let last = self.lines().last().map(|(_, l)| l.clone()).unwrap_or_default();
        serde_json::from_str(&last).map_err(|e| self.why(&format!("printed no result ({e}): {last}")))
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
                self.drain();
                return (st.code(), self.stdout(), self.stderr());
            }
            assert!(t.elapsed() < limit, "{} did not exit within {limit:?}; stderr:\n{}", self.name, self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Kid {
        Kid::start_in(None, &["sh".into(), "-c".into(), script.into()]).expect("sh")
    }

    #[test]
    fn output_is_collected_as_text_and_stamped_lines() {
        // A line written in two pieces is one line.
        let mut p = sh("echo ready; printf 'a\\nb'; printf 'c\\n'; echo '{\"n\":3}'; printf oops >&2");
        let (_, l) = p.wait_line(PATIENCE, "ready", |l| (l == "ready").then_some(1)).expect("ready");
        assert_eq!(l, 1);
        #[derive(serde::Deserialize)]
        struct R {
            n: u32,
        }
        let r: R = p.json_result(PATIENCE).expect("json");
        assert_eq!(r.n, 3);
        let lines: Vec<String> = p.lines().into_iter().map(|(_, l)| l).collect();
        assert_eq!(lines, ["ready", "a", "bc", "{\"n\":3}"]);
        assert_eq!(p.stdout(), "ready\na\nbc\n{\"n\":3}\n");
        assert_eq!(p.stderr(), "oops");
        assert_eq!(lines_of(&p.err).last().map(|l| l.1.as_str()), Some("oops"), "an unterminated last line");
    }

    #[test]
    fn an_early_exit_is_reported_with_stderr() {
        let mut p = sh("echo oops >&2; exit 3");
        let e = p.wait_line(PATIENCE, "ready", |_| Some(())).unwrap_err();
        assert!(e.contains("before ready") && e.contains("oops"), "{e}");
        assert_eq!(p.wait_exit(PATIENCE).unwrap(), 3);
    }

    #[test]
    fn a_dropped_kid_is_killed_and_forgotten() {
        let mut p = sh("read x; echo got $x");
        let pid = p.id();
        assert!(live_pids().contains(&pid));
        p.input(b"it\n");
        let (code, out, _) = p.finish(PATIENCE);
        assert_eq!((code, out.as_str()), (Some(0), "got it\n"));
        assert!(!live_pids().contains(&pid));
        let q = sh("sleep 600");
        let pid = q.id();
        drop(q);
        assert!(!live_pids().contains(&pid));
    }
}
