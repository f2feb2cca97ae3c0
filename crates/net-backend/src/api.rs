//! The backend's control API: HTTP/1.1 with JSON bodies on a unix socket, one request per
//! connection (see docs/net-backend.md).

use kumo_sandbox::ThreadKind;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::nic::Nic;

const MAX_REQUEST: usize = 64 * 1024;
/// How long a handover waits for the new owner's first buffer before it reports without it.
pub const DEFAULT_WAIT_MS: u64 = 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandoverBody {
    to: u32,
    #[serde(default)]
    wait_ms: Option<u64>,
}

pub struct Response {
    pub status: u16,
    pub body: String,
}

fn json(status: u16, v: &impl serde::Serialize) -> Response {
    Response { status, body: serde_json::to_string(v).unwrap_or_else(|_| "{}".into()) }
}

fn error(status: u16, msg: &str) -> Response {
    json(status, &serde_json::json!({ "error": msg }))
}

/// Routes one request.
pub fn route(nic: &Nic, method: &str, path: &str, body: &[u8]) -> Response {
    match (method, path) {
        ("GET", "/api/v1/backend.info") => {
            // Debug builds only (tests/sandbox_e2e.rs): a bug in a request ends the backend.
            if kumo_sandbox::test_hook("panic:net-backend") {
                panic!("test hook panic:net-backend");
            }
            json(200, &nic.info())
        }
        ("PUT", "/api/v1/backend.handover") => {
            let b: HandoverBody = match serde_json::from_slice(body) {
                Ok(b) => b,
                Err(e) => return error(400, &format!("bad handover body (want {{\"to\": ID}}): {e}")),
            };
            let wait = Duration::from_millis(b.wait_ms.unwrap_or(DEFAULT_WAIT_MS).min(60_000));
            match nic.handover(b.to, wait) {
                Ok(r) => json(200, &r),
                // Every refusal (unknown, not ready, migrating) is a 409; the owner is unchanged.
                Err(e) => error(409, &e.to_string()),
            }
        }
        (_, "/api/v1/backend.info" | "/api/v1/backend.handover") => {
            error(405, &format!("{method} not allowed on {path}"))
        }
        _ => error(404, &format!("no route {path}")),
    }
}

/// Serves the API on `listener`, to peers whose uid is in `allow` if given (`--api-allow-uid`;
/// a refused peer gets 403).
pub fn serve(nic: Arc<Nic>, listener: UnixListener, allow: Option<Vec<u32>>) -> io::Result<()> {
    loop {
        let (s, _) = listener.accept()?;
        // A peer that is not allowed gets its request read and a 403.
        let refused = kumo_sandbox::sock::check_peer(&s, allow.as_deref(), "net-backend API").err();
        if let Some(e) = &refused {
            tracing::warn!("{e}");
        }
        let nic = nic.clone();
        kumo_sandbox::spawn(ThreadKind::NetBackend, "nb-api", move || {
            if let Err(e) = handle(&nic, s, refused) {
                tracing::debug!("api: {e}");
            }
        })?;
    }
}

fn handle(nic: &Nic, mut s: UnixStream, refused: Option<io::Error>) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let (head, mut body) = read_head(&mut s)?;
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let resp = match req.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {
            let len = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if len > MAX_REQUEST {
                error(413, "body too large")
            } else {
                while body.len() < len {
                    let mut chunk = vec![0u8; len - body.len()];
                    let n = s.read(&mut chunk)?;
                    if n == 0 {
                        break;
                    }
                    body.extend_from_slice(&chunk[..n]);
                }
                body.truncate(len);
                match &refused {
                    Some(e) => error(403, &e.to_string()),
                    None => route(nic, req.method.unwrap_or(""), req.path.unwrap_or(""), &body),
                }
            }
        }
        _ => error(400, "bad HTTP request"),
    };
    write_response(&mut s, &resp)
}

fn write_response(s: &mut UnixStream, resp: &Response) -> io::Result<()> {
    let reason = match resp.status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        _ => "Error",
    };
    write!(
        s,
        "HTTP/1.1 {} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        resp.status,
        resp.body.len(),
        resp.body
    )?;
    s.flush()
}

/// Reads up to the blank line; returns the head and whatever body bytes came with it.
fn read_head(s: &mut UnixStream) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let body = buf.split_off(i + 4);
            return Ok((buf, body));
        }
        if buf.len() > MAX_REQUEST {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "request head too large"));
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "request cut short"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Sends one request to a backend's API socket; returns (status, body).
pub fn request(socket: &Path, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    let mut s = UnixStream::connect(socket).map_err(|e| format!("cannot reach {}: {e}", socket.display()))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("{}: {e}", socket.display()))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| format!("{}: {e}", socket.display()))?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed reply")?;
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse::<u16>().ok()).ok_or("malformed status line")?;
    Ok((status, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_devices::virtio::net::Loopback;

    fn nic() -> Nic {
        Nic::new(Box::new(Loopback::new(1)), "tap-test", [2, 0, 0, 0, 0, 1], true)
    }

    #[test]
    fn info_lists_the_nic() {
        let r = route(&nic(), "GET", "/api/v1/backend.info", b"");
        assert_eq!(r.status, 200);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["tap"], "tap-test");
        assert_eq!(v["mac"], "02:00:00:00:00:01");
        assert!(v["owner"].is_null());
        assert_eq!(v["clients"].as_array().map(Vec::len), Some(0));
    }

    #[test]
    fn refusals_are_409_with_one_line() {
        let r = route(&nic(), "PUT", "/api/v1/backend.handover", br#"{"to": 3}"#);
        assert_eq!(r.status, 409);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"], "no client 3");
    }

    #[test]
    fn bad_requests() {
        let n = nic();
        assert_eq!(route(&n, "PUT", "/api/v1/backend.handover", b"{}").status, 400);
        assert_eq!(route(&n, "PUT", "/api/v1/backend.handover", br#"{"to": "x"}"#).status, 400);
        assert_eq!(route(&n, "GET", "/api/v1/backend.handover", b"").status, 405);
        assert_eq!(route(&n, "GET", "/api/v1/nope", b"").status, 404);
    }

    #[test]
    fn request_and_serve_over_a_socket() {
        let dir = std::env::temp_dir().join(format!("kumo-nb-api-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("api.sock");
        let _ = std::fs::remove_file(&path);
        let l = kumo_sandbox::sock::bind_private(&path).unwrap();
        let n = Arc::new(nic());
        let me = kumo_sandbox::sock::euid();
        std::thread::spawn(move || serve(n, l, Some(vec![me])));
        let (status, body) = request(&path, "GET", "/api/v1/backend.info", None).unwrap();
        assert_eq!(status, 200, "{body}");
        let (status, _) = request(&path, "PUT", "/api/v1/backend.handover", Some(r#"{"to": 1}"#)).unwrap();
        assert_eq!(status, 409);
        // A uid that is not in the list is refused.
        let other = dir.join("other.sock");
        let l = kumo_sandbox::sock::bind_private(&other).unwrap();
        let n = Arc::new(nic());
        std::thread::spawn(move || serve(n, l, Some(vec![me.wrapping_add(1)])));
        let (status, body) = request(&other, "GET", "/api/v1/backend.info", None).unwrap();
        assert_eq!(status, 403, "{body}");
        assert!(body.contains(&format!("uid {me} ")), "{body}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
