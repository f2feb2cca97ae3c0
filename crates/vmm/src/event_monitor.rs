//! The event monitor (`kumo run --event-monitor PATH`): one JSON line per VM lifecycle event,
//! in the manner of Cloud Hypervisor's `--event-monitor`:
//!
//! ```json
//! {"timestamp_ms":1763895000123,"source":"vm","event":"paused","properties":{"by":"user"}}
//! ```
//!
//! One process-wide emitter, set once by [`init`]; any layer calls [`emit`], which does nothing
//! while no monitor is set. Each line is written whole and flushed, so a reader sees complete
//! lines in the order the events happened.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Value};

static MONITOR: OnceLock<Mutex<File>> = OnceLock::new();

/// Opens the monitor's output: a file (created or truncated) or `fd:N`, a descriptor this
/// process inherited (e.g. a pipe), opened through /proc/self/fd.
pub fn open(target: &str) -> Result<File, String> {
    if let Some(n) = target.strip_prefix("fd:") {
        let fd: u32 = n.parse().map_err(|_| format!("event monitor {target}: fd:N needs a descriptor number"))?;
        return OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .map_err(|e| format!("event monitor {target}: descriptor {fd} is not open for writing: {e}"));
    }
    File::create(target).map_err(|e| format!("event monitor: cannot create {target}: {e}"))
}

/// Sets the process's monitor to `target` (see [`open`]). Only the first call takes effect.
pub fn init(target: &str) -> Result<(), String> {
    let f = open(target)?;
    MONITOR.set(Mutex::new(f)).map_err(|_| "the event monitor is already set".to_string())
}

/// Whether a monitor is set.
pub fn enabled() -> bool {
    MONITOR.get().is_some()
}

/// A line's fields, in the order they are written.
#[derive(Serialize)]
struct Line<'a> {
    timestamp_ms: u64,
    source: &'a str,
    event: &'a str,
    properties: Value,
}

/// One event as its JSON line (without the newline).
pub fn line(timestamp_ms: u64, source: &str, event: &str, properties: Value) -> String {
    let properties = if properties.is_null() { json!({}) } else { properties };
    let l = Line { timestamp_ms, source, event, properties };
    serde_json::to_string(&l).unwrap_or_else(|e| format!("{{\"event\":\"{event}\",\"error\":\"{e}\"}}"))
}

/// The `shutdown` event's properties: how the VM ended, in words, and kumo's exit status.
pub fn outcome(o: &crate::Outcome) -> Value {
    use crate::Outcome::*;
    let (what, detail) = match o {
        GuestExit(c) => ("guest-exit", Some(c.to_string())),
        Shutdown => ("shutdown", None),
        PowerOff => ("power-off", None),
        Reset(why) => ("reset", Some(why.clone())),
        Error(e) => ("error", Some(e.clone())),
        TimedOut => ("timed-out", None),
        Migrated(to) => ("migrated", Some(to.clone())),
        Panicked(p) => ("panic", Some(p.clone())),
    };
    let mut v = json!({"outcome": what, "exit_code": o.exit_code()});
    if let Some(d) = detail {
        v["detail"] = json!(d);
    }
    v
}

/// Writes an event from `source` ("vm", "vmm", "migration", …). A failed write is logged,
/// never an error: the monitor must not stop the VM.
pub fn emit(source: &str, event: &str, properties: Value) {
    let Some(m) = MONITOR.get() else { return };
    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let mut l = line(ts, source, event, properties);
    l.push('\n');
    let mut f = m.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = f.write_all(l.as_bytes()).and_then(|()| f.flush()) {
        tracing::warn!("event monitor: cannot write the {event} event: {e}");
    }
}

/// [`emit`] from the VM itself.
pub fn vm_event(event: &str, properties: Value) {
    emit("vm", event, properties)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_one_json_object_with_the_four_fields() {
        let l = line(42, "vm", "paused", json!({"by": "user"}));
        assert!(!l.contains('\n'));
        let v: Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v, json!({"timestamp_ms": 42, "source": "vm", "event": "paused", "properties": {"by": "user"}}));
        let v: Value = serde_json::from_str(&line(1, "vm", "booted", Value::Null)).unwrap();
        assert_eq!(v["properties"], json!({}), "no properties is an empty object");
        assert!(l.starts_with(r#"{"timestamp_ms":42,"source":"vm","event":"paused","#), "{l}");
        let o = outcome(&crate::Outcome::GuestExit(3));
        assert_eq!(o, json!({"outcome": "guest-exit", "exit_code": 3, "detail": "3"}));
        assert_eq!(outcome(&crate::Outcome::Shutdown), json!({"outcome": "shutdown", "exit_code": 0}));
    }

    #[test]
    fn targets_are_checked() {
        assert!(open("fd:x").unwrap_err().contains("descriptor number"));
        assert!(open("fd:987654").unwrap_err().contains("not open"));
        assert!(open("/nonexistent-dir/events").unwrap_err().contains("cannot create /nonexistent-dir/events"));
        let dir = std::env::temp_dir().join(format!("kumo-evmon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("events");
        let mut f = open(p.to_str().unwrap()).unwrap();
        f.write_all(b"x").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"x");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn emitting_without_a_monitor_does_nothing() {
        // Tests in this binary never set the monitor.
        assert!(!enabled());
        emit("vm", "booted", json!({}));
    }
}
