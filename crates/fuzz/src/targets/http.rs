//! The control API's HTTP server (`kumo_api::ApiServer`): requests built from the route table
//! (method, path, headers, JSON bodies) with arbitrary changes, sent to a live server; every
//! answer is a well-formed response with a status of the server's set, and the server keeps
//! serving.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kumo_api::{ApiError, ApiHandler, ApiRequest, ApiResponse, ApiServer, ApiServerHandle};

use crate::{CaseResult, Input};

struct Handler;

impl ApiHandler for Handler {
    fn handle(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        match req {
            ApiRequest::Ping => Ok(ApiResponse::Ok),
            ApiRequest::Counters => Ok(ApiResponse::Counters(Box::default())),
            ApiRequest::Elastic => Ok(ApiResponse::Elastic(Default::default())),
            _ => Err(ApiError::conflict("fuzz")),
        }
    }
}

/// One server for the whole process: cases connect to it in turn.
fn server() -> &'static (ApiServerHandle, PathBuf) {
    static S: OnceLock<(ApiServerHandle, PathBuf)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kumo-fuzz-http-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("api.sock");
        let h = ApiServer::start(&path, Arc::new(Handler)).expect("API server starts");
        (h, path)
    })
}

const HEADERS: &[&str] = &[
    "Host: localhost",
    "Connection: close",
    "Connection: keep-alive",
    "Content-Type: application/json",
    "Expect: 100-continue",
    "Transfer-Encoding: chunked",
    "Content-Length: 0",
    "Content-Length: 99999999999999999999",
    "Content-Length: -1",
];

const BODIES: &[&str] = &[
    r#"{"destination":"unix:/tmp/x.sock"}"#,
    r#"{"path":"/tmp/snap"}"#,
    r#"{"cpus":1,"memory_bytes":2097152,"timeout_ms":10}"#,
    r#"{"host_cpus":[1],"memory":{"bytes":2097152,"node":0}}"#,
    r#"{"vcpu":1,"host_cpu":2}"#,
    r#"{"to":"vm2","cpus":1}"#,
    r#"{"address":"tcp:127.0.0.1:4444"}"#,
];

fn request(u: &mut Input<'_>) -> arbitrary::Result<Vec<u8>> {
    let routes: Vec<(&str, &str)> = kumo_api::routes().collect();
    let (mut method, mut path) = routes[u.choose_index(routes.len())?];
    if u.ratio(1, 8)? {
        method = ["GET", "PUT", "POST", "DELETE", "", "G\0T"][u.choose_index(6)?];
    }
    let owned_path;
    if u.ratio(1, 8)? {
        owned_path = format!("{path}{}", u.arbitrary::<&str>()?);
        path = &owned_path;
    }
    let version =
        if u.ratio(15, 16)? { "HTTP/1.1" } else { ["HTTP/1.0", "HTTP/2", "HTTP/1.1 x"][u.choose_index(3)?] };
    let body = if u.arbitrary()? {
        let valid: serde_json::Value = serde_json::from_str(BODIES[u.choose_index(BODIES.len())?]).expect("json");
        crate::json::mutated_or_garbage(u, &valid)?.to_string().into_bytes()
    } else {
        Vec::new()
    };
    let mut head = format!("{method} {path} {version}\r\n");
    for _ in 0..u.int_in_range(0..=3)? {
        head += HEADERS[u.choose_index(HEADERS.len())?];
        head += "\r\n";
    }
    if u.ratio(7, 8)? {
        head += &format!("Content-Length: {}\r\n", body.len());
    }
    head += "\r\n";
    let mut v = head.into_bytes();
    v.extend(body);
    // A few raw byte changes: the parser's own edge cases.
    for _ in 0..u.int_in_range(0..=2)? {
        let at = u.int_in_range(0..=v.len())?;
        match u.int_in_range(0..=2)? {
            0 => v.insert(at, u.arbitrary()?),
            1 => v.truncate(at),
            _ => {
                if at < v.len() {
                    v[at] = u.arbitrary()?;
                }
            }
        }
    }
    Ok(v)
}

const STATUSES: [u16; 14] = [100, 200, 204, 400, 404, 405, 409, 411, 413, 414, 431, 501, 503, 505];

/// Every response in `bytes`: a status line of the server's set, a head, a body of the length
/// it announced.
fn check_responses(bytes: &[u8], req: &[u8]) {
    let mut rest = bytes;
    while !rest.is_empty() {
        let end = rest.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head ends") + 4;
        let head = std::str::from_utf8(&rest[..end]).expect("a response head is text");
        let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).expect("a status");
        assert!(head.starts_with("HTTP/1.1 "), "{head:?}");
        assert!(STATUSES.contains(&status), "status {status} for {:?}", String::from_utf8_lossy(req));
        let len = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().to_string()))
            .map(|v| v.parse::<usize>().expect("a numeric Content-Length"))
            .unwrap_or(0);
        assert!(rest.len() >= end + len, "a body cut short");
        rest = &rest[end + len..];
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let (_, path) = server();
    let req = request(u)?;
    let mut s = UnixStream::connect(path).expect("the server still accepts");
    // A bound against a hang, not a timing.
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let _ = s.write_all(&req);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    if let Err(e) = s.read_to_end(&mut out) {
        assert!(e.kind() != std::io::ErrorKind::WouldBlock, "no answer within 60 s");
    }
    check_responses(&out, &req);
    Ok(())
}
