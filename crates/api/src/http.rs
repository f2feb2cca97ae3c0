//! Just enough HTTP/1.1 for a local control socket, shared by server and
//! client: one message head plus a Content-Length (or, in requests, chunked) body at a time, every read
//! bounded in size and by a deadline so a silent or slow peer cannot hold a
//! thread forever. Heads are parsed by the `httparse` crate; this module
//! frames them, bounds them and turns its verdicts into status codes.

use crate::fds::MAX_FDS;
use crate::{ApiError, ErrorKind};
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

/// Largest request/response head (request line + headers) accepted.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// Largest body accepted.
pub(crate) const MAX_BODY: usize = 1024 * 1024;
/// Most bytes [`Conn::linger`] throws away before giving up on a clean close.
const MAX_LINGER_BYTES: usize = 4 * MAX_BODY;

#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed; `partial` says whether it left half a message behind.
    Closed {
        partial: bool,
    },
    TimedOut {
        partial: bool,
    },
    /// Over the size limit; `line` when the start line alone is (no line end
    /// within MAX_HEAD bytes).
    TooLarge {
        line: bool,
    },
    /// A chunked body that does not follow RFC 9112 §7.1.
    Malformed(&'static str),
    Io(io::Error),
}

/// A stream plus the bytes read from it but not consumed yet (pipelined
/// requests, or a body that arrived in the same read as its head).
pub(crate) struct Conn {
    pub stream: UnixStream,
    buf: Vec<u8>,
    /// Descriptors that came with the bytes read (SCM_RIGHTS), for the request they belong to.
    fds: Vec<OwnedFd>,
    /// More than [`MAX_FDS`] came since the last [`Conn::take_fds`] (the excess is closed).
    too_many_fds: bool,
}

impl Conn {
    pub fn new(stream: UnixStream) -> Self {
        Conn { stream, buf: Vec::new(), fds: Vec::new(), too_many_fds: false }
    }

    /// The descriptors received since the last call (each request's own: a client sends them
    /// with its request and waits for the answer), or, if over [`MAX_FDS`] came, how many
    /// were kept (all of them closed now).
    pub fn take_fds(&mut self) -> Result<Vec<OwnedFd>, usize> {
        let fds = std::mem::take(&mut self.fds);
        if std::mem::take(&mut self.too_many_fds) {
            return Err(fds.len());
        }
        Ok(fds)
    }

    /// Closes descriptors left from a request that was refused before it took them, unless
    /// bytes of a next (pipelined) request are already here, which they may belong to.
    pub fn drop_stale_fds(&mut self) {
        if self.buf.is_empty() {
            self.fds.clear();
            self.too_many_fds = false;
        }
    }

    fn fill(&mut self, deadline: Instant) -> Result<(), ReadError> {
        let partial = !self.buf.is_empty();
        let mut chunk = [0u8; 4096];
        loop {
            // Re-arm the socket timeout with what is left, so trickling bytes
            // cannot stretch a message past its deadline.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadError::TimedOut { partial });
            }
            self.stream.set_read_timeout(Some(left)).map_err(ReadError::Io)?;
            match crate::fds::recv(&self.stream, &mut chunk) {
                Ok(r) if r.n == 0 => return Err(ReadError::Closed { partial }),
                Ok(r) => {
                    self.buf.extend_from_slice(&chunk[..r.n]);
                    self.too_many_fds |= r.truncated || self.fds.len() + r.fds.len() > MAX_FDS;
                    if !self.too_many_fds {
                        self.fds.extend(r.fds);
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(ReadError::TimedOut { partial })
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// Reads one message head, up to and including its blank line, all by
    /// `deadline`.
    pub fn read_head(&mut self, deadline: Instant) -> Result<Vec<u8>, ReadError> {
        self.read_head_from(deadline, || deadline)
    }

    /// Reads one message head: waits until `idle_until` for its first byte,
    /// then calls `started`, whose answer is the deadline for the whole head
    /// (so trickling bytes cannot stretch it).
    pub fn read_head_from(
        &mut self,
        idle_until: Instant,
        mut started: impl FnMut() -> Instant,
    ) -> Result<Vec<u8>, ReadError> {
        let mut deadline = None;
        loop {
            // Stray blank lines between messages are to be ignored (RFC 9112 §2.2).
            let skip = self.buf.iter().take_while(|b| matches!(b, b'\r' | b'\n')).count();
            self.buf.drain(..skip);
            if !self.buf.is_empty() && deadline.is_none() {
                deadline = Some(started());
            }
            if let Some(end) = head_end(&self.buf) {
                if end > MAX_HEAD {
                    return Err(self.too_large());
                }
                return Ok(self.buf.drain(..end).collect());
            }
            if self.buf.len() > MAX_HEAD {
                return Err(self.too_large());
            }
            self.fill(deadline.unwrap_or(idle_until))?;
        }
    }

    fn too_large(&self) -> ReadError {
        let line = !self.buf[..MAX_HEAD.min(self.buf.len())].contains(&b'\n');
        ReadError::TooLarge { line }
    }

    /// Reads exactly `len` body bytes (callers cap `len` at MAX_BODY).
    pub fn read_body(&mut self, len: usize, deadline: Instant) -> Result<Vec<u8>, ReadError> {
        while self.buf.len() < len {
            self.fill(deadline)?;
        }
        Ok(self.buf.drain(..len).collect())
    }

    /// Reads a chunked body (RFC 9112 §7.1; libvirt's curl sends `PUT`s without a body this
    /// way): chunks up to the last, empty one, extensions and trailers skipped; at most `max`
    /// bytes of data.
    pub fn read_chunked(&mut self, max: usize, deadline: Instant) -> Result<Vec<u8>, ReadError> {
        let mut body = Vec::new();
        loop {
            let line = self.read_line(deadline)?;
            let size = line.split(|&b| b == b';').next().unwrap_or_default();
            let size = std::str::from_utf8(size).ok().map(str::trim).filter(|s| !s.is_empty() && s.len() <= 8);
            let size =
                size.and_then(|s| usize::from_str_radix(s, 16).ok()).ok_or(ReadError::Malformed("bad chunk size"))?;
            if size == 0 {
                // Trailer fields, up to the empty line.
                while !self.read_line(deadline)?.is_empty() {}
                return Ok(body);
            }
            if body.len() + size > max {
                return Err(ReadError::TooLarge { line: false });
            }
            body.extend(self.read_body(size, deadline)?);
            if !self.read_line(deadline)?.is_empty() {
                return Err(ReadError::Malformed("chunk data longer than its size"));
            }
        }
    }

    /// One line of a chunked body, without its CRLF (or LF).
    fn read_line(&mut self, deadline: Instant) -> Result<Vec<u8>, ReadError> {
        const MAX_LINE: usize = 1024;
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            if self.buf.len() > MAX_LINE {
                return Err(ReadError::Malformed("chunk line too long"));
            }
            self.fill(deadline)?;
        }
    }

    /// Reads until the peer closes, for responses without Content-Length.
    pub fn read_to_end(&mut self, deadline: Instant) -> Result<Vec<u8>, ReadError> {
        loop {
            if self.buf.len() > MAX_BODY {
                return Err(ReadError::TooLarge { line: false });
            }
            match self.fill(deadline) {
                Ok(()) => {}
                Err(ReadError::Closed { .. }) => return Ok(std::mem::take(&mut self.buf)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes all of `bytes` by `deadline` (not per write: a peer that reads
    /// slowly cannot stretch it).
    pub fn write_all_by(&mut self, bytes: &[u8], deadline: Instant) -> io::Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            self.stream.set_write_timeout(Some(left))?;
            match self.stream.write(rest) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Ends our side and reads (and drops) what the peer still sends until it
    /// closes or `deadline`: closing a unix socket with unread data makes the
    /// peer see a reset instead of the answer it was sent.
    pub fn linger(&mut self, deadline: Instant) {
        let _ = self.stream.shutdown(Shutdown::Write);
        let mut drained = 0;
        while drained <= MAX_LINGER_BYTES {
            drained += self.buf.len();
            self.buf.clear();
            if self.fill(deadline).is_err() {
                return;
            }
        }
    }
}

/// End of the head: the first empty line, accepting bare LF line endings.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.iter().enumerate().filter(|(_, &b)| b == b'\n').find_map(|(i, _)| match &buf[i + 1..] {
        [b'\n', ..] => Some(i + 2),
        [b'\r', b'\n', ..] => Some(i + 3),
        _ => None,
    })
}

#[derive(Debug, Default)]
pub(crate) struct Headers(Vec<(String, String)>);

impl Headers {
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Whether a comma-separated header (Connection, Expect...) lists `token`.
    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.get_all(name).flat_map(|v| v.split(',')).any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    /// Declared body length; a number too big for u64 saturates (it is
    /// rejected as too large either way).
    pub fn content_length(&self) -> Result<Option<u64>, &'static str> {
        let mut found = None;
        for v in self.get_all("content-length") {
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err("invalid Content-Length header");
            }
            let n = v.parse::<u64>().unwrap_or(u64::MAX);
            // Disagreeing lengths are a request-smuggling classic: refuse.
            if found.is_some_and(|f| f != n) {
                return Err("conflicting Content-Length headers");
            }
            found = Some(n);
        }
        Ok(found)
    }
}

/// Most header lines a message head may carry; more is a 431.
pub(crate) const MAX_HEADERS: usize = 64;

/// Copies httparse's borrowed headers into owned ones; values must be UTF-8 (httparse allows
/// obs-text) and lose surrounding blanks.
fn own_headers(parsed: &[httparse::Header<'_>]) -> Result<Headers, &'static str> {
    let mut headers = Vec::with_capacity(parsed.len());
    for h in parsed {
        let value = std::str::from_utf8(h.value).map_err(|_| "header value is not valid UTF-8")?;
        headers.push((h.name.to_string(), value.trim_matches([' ', '\t']).to_string()));
    }
    Ok(Headers(headers))
}

/// What an httparse error means to a client.
fn parse_error(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "malformed header name",
        httparse::Error::HeaderValue => "malformed header value",
        httparse::Error::NewLine => "malformed line ending",
        httparse::Error::Status => "malformed status code",
        httparse::Error::Token => "malformed request method or target",
        httparse::Error::TooManyHeaders => "too many header lines",
        httparse::Error::Version => "malformed HTTP version",
    }
}

#[derive(Debug)]
pub(crate) struct RequestHead {
    pub method: String,
    /// The request target without its query string.
    pub path: String,
    pub keep_alive: bool,
    pub headers: Headers,
}

/// Parses a request head (as framed by [`Conn::read_head`]) with httparse. Errors are 400,
/// except an HTTP version other than 1.0 and 1.1 (505) and too many header lines (431).
pub(crate) fn parse_request_head(head: &[u8]) -> Result<RequestHead, ApiError> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(ApiError::bad_request("incomplete request head")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ApiError::new(
                ErrorKind::HeadersTooLarge,
                format!("request has over {MAX_HEADERS} header lines"),
            ))
        }
        Err(httparse::Error::Version) => {
            return Err(match other_http_version(head) {
                Some(v) => ApiError::new(ErrorKind::HttpVersion, format!("unsupported HTTP version {v}")),
                None => ApiError::bad_request(parse_error(httparse::Error::Version)),
            })
        }
        Err(e) => return Err(ApiError::bad_request(parse_error(e))),
    }
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(ApiError::bad_request("malformed request line"));
    };
    if !target.starts_with('/') {
        return Err(ApiError::bad_request("request target must be an absolute path"));
    }
    let headers = own_headers(req.headers).map_err(ApiError::bad_request)?;
    let keep_alive = match minor {
        1 => !headers.has_token("connection", "close"),
        _ => headers.has_token("connection", "keep-alive"),
    };
    let path = target.split(['?', '#']).next().unwrap_or_default().to_string();
    Ok(RequestHead { method: method.to_string(), path, keep_alive, headers })
}

/// The version of a request line that is well formed but for its version, which names another
/// HTTP (`GET / HTTP/2.0`, `GET / HTTP/3`): that is a 505, not a 400.
fn other_http_version(head: &[u8]) -> Option<&str> {
    let line = head.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line.strip_suffix(b"\r").unwrap_or(line)).ok()?;
    let [_, _, v] = line.split(' ').collect::<Vec<_>>()[..] else { return None };
    let number = v.strip_prefix("HTTP/")?;
    (!number.is_empty() && number.bytes().all(|b| b.is_ascii_digit() || b == b'.')).then_some(v)
}

pub(crate) fn parse_response_head(head: &[u8]) -> Result<(u16, Headers), &'static str> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    match resp.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("incomplete response head"),
        Err(httparse::Error::Version | httparse::Error::Status) => return Err("malformed status line"),
        Err(e) => return Err(parse_error(e)),
    }
    let status = resp.code.ok_or("malformed status line")?;
    Ok((status, own_headers(resp.headers)?))
}

pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Serializes a complete response.
pub(crate) fn response_bytes(status: u16, body: Option<&str>, extra_headers: &[(&str, &str)], close: bool) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in extra_headers {
        out += &format!("{name}: {value}\r\n");
    }
    if close {
        out += "Connection: close\r\n";
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() {
        out += "Content-Type: application/json\r\n";
    }
    // 204 must not carry Content-Length (RFC 9110 §8.6).
    if status != 204 {
        out += &format!("Content-Length: {}\r\n", body.len());
    }
    out += "\r\n";
    out += body;
    out.into_bytes()
}

/// Seeded request mutation for the parser's randomized tests (here and in server.rs).
#[cfg(test)]
pub(crate) mod fuzz {
    /// splitmix64: deterministic, so a failing case reproduces from its index.
    pub struct Rng(pub u64);

    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        pub fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Valid requests of every shape the server sees.
    const SEEDS: &[&[u8]] = &[
        b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"GET /api/v1/vm.info HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        b"PUT /api/v1/vm.send-migration HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{\"destination\":\"x\"}",
        b"PUT /api/v1/vm.resume?x=1 HTTP/1.1\nExpect: 100-continue\nContent-Length: 2\n\n{}",
        b"DELETE /api/v1/vm.info HTTP/1.1\r\nConnection: close\r\n\r\n",
    ];

    /// Pieces that parsers trip on.
    const NASTY: &[&[u8]] = &[
        b"\r\n",
        b"\n",
        b"\r",
        b" ",
        b"\t",
        b":",
        b"\0",
        b"\xff",
        b"\xc3\x28",
        b"HTTP/1.1",
        b"HTTP/9.9",
        b"Content-Length: ",
        b"Content-Length: 99999999999999999999\r\n",
        b"Content-Length: -1\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Connection: close\r\n",
        b"Expect: 100-continue\r\n",
        b"\r\n\r\n",
        b"?",
        b"#",
        b"%00",
        b"/",
        b"..",
    ];

    /// A seed request with one to four mutations.
    pub fn mutated_request(rng: &mut Rng) -> Vec<u8> {
        let mut v = SEEDS[rng.below(SEEDS.len())].to_vec();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(v.len() + 1);
            match rng.below(8) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] ^= 1 << rng.below(8);
                }
                1 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] = rng.next() as u8;
                }
                2 => {
                    let end = (at + 1 + rng.below(16)).min(v.len());
                    v.drain(at.min(end)..end);
                }
                3 => {
                    let piece = NASTY[rng.below(NASTY.len())];
                    v.splice(at..at, piece.iter().copied());
                }
                4 => v.truncate(at),
                5 => {
                    // Repeat a slice: duplicated headers, long lines.
                    let start = rng.below(v.len() + 1);
                    let end = (start + rng.below(64)).min(v.len());
                    let piece = v[start..end].repeat(1 + rng.below(300));
                    v.splice(at..at, piece);
                }
                6 => {
                    let n = rng.below(32);
                    let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                    v.splice(at..at, junk);
                }
                _ => {
                    let extra = format!("X-{}: {}\r\n", rng.below(1000), "v".repeat(rng.below(100)));
                    let line_end = v.iter().position(|&b| b == b'\n').map_or(v.len(), |p| p + 1);
                    v.splice(line_end..line_end, extra.into_bytes());
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many thousands of mutated heads through the parser: no panic, and every verdict is a
    /// request the server can route or a status it is meant to send.
    #[test]
    fn mutated_heads_parse_or_get_a_valid_status() {
        let mut rng = fuzz::Rng(8);
        let (mut ok, mut refused) = (0, 0);
        for i in 0..50_000 {
            let bytes = fuzz::mutated_request(&mut rng);
            // Frame as the server does: only up to the end of the head.
            let Some(end) = head_end(&bytes) else { continue };
            match parse_request_head(&bytes[..end]) {
                Ok(h) => {
                    assert!(h.path.starts_with('/'), "case {i}: {:?}", h.path);
                    assert!(!h.method.is_empty(), "case {i}");
                    let _ = h.headers.content_length();
                    ok += 1;
                }
                Err(e) => {
                    assert!([400, 431, 505].contains(&e.status()), "case {i}: {} {}", e.status(), e.message);
                    assert!(!e.message.is_empty());
                    refused += 1;
                }
            }
            let _ = parse_response_head(&bytes[..end]);
        }
        // The mutations must exercise both sides, or this test tests nothing.
        assert!(ok > 1000 && refused > 1000, "ok={ok} refused={refused}");
    }

    #[test]
    fn too_many_headers_is_431() {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            head.extend_from_slice(format!("X-{i}: a\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        assert_eq!(parse_request_head(&head).unwrap_err().status(), 431);
    }

    #[test]
    fn head_end_handles_crlf_and_lf() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nrest"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\nA: b\n\nrest"), Some(21));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
        assert_eq!(head_end(b""), None);
    }

    #[test]
    fn parses_request_head() {
        let h = parse_request_head(
            b"PUT /api/v1/vm.pause?x=1 HTTP/1.1\r\nHost: x\r\nConnection: Keep-Alive, Close\r\nContent-Length:  12 \r\n\r\n",
        )
        .unwrap();
        assert_eq!(h.method, "PUT");
        assert_eq!(h.path, "/api/v1/vm.pause");
        assert!(!h.keep_alive);
        assert_eq!(h.headers.get("HOST"), Some("x"));
        assert_eq!(h.headers.content_length(), Ok(Some(12)));

        let h = parse_request_head(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(!h.keep_alive);
        let h = parse_request_head(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(h.keep_alive);
    }

    #[test]
    fn rejects_malformed_heads() {
        for bad in [
            &b"garbage\r\n\r\n"[..],
            b"GET /\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 extra\r\n\r\n",
            b"GET nopath HTTP/1.1\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET / FTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET / HTTP/1.1\r\n folded: x\r\n\r\n",
            b"GET / HTTP/1.1\r\n: empty\r\n\r\n",
            b"GET / HTTP/1.1\r\nX: \xff\r\n\r\n",
        ] {
            let e = parse_request_head(bad).unwrap_err();
            assert_eq!(e.status(), 400, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse_request_head(b"GET / HTTP/2.0\r\n\r\n").unwrap_err().status(), 505);
    }

    #[test]
    fn content_length_validation() {
        let cl = |head: &[u8]| parse_request_head(head).unwrap().headers.content_length();
        assert_eq!(cl(b"GET / HTTP/1.1\r\n\r\n"), Ok(None));
        assert_eq!(cl(b"GET / HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n"), Ok(Some(5)));
        assert!(cl(b"GET / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n").is_err());
        assert!(cl(b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n").is_err());
        assert!(cl(b"GET / HTTP/1.1\r\nContent-Length: +1\r\n\r\n").is_err());
        assert!(cl(b"GET / HTTP/1.1\r\nContent-Length:\r\n\r\n").is_err());
        assert_eq!(cl(b"GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"), Ok(Some(u64::MAX)));
    }

    #[test]
    fn parses_response_head() {
        let (status, h) = parse_response_head(b"HTTP/1.1 409 Conflict\r\nContent-Length: 3\r\n\r\n").unwrap();
        assert_eq!(status, 409);
        assert_eq!(h.content_length(), Ok(Some(3)));
        assert_eq!(parse_response_head(b"HTTP/1.1 204\r\n\r\n").unwrap().0, 204);
        assert!(parse_response_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(parse_response_head(b"HTTP/1.1 2000 OK\r\n\r\n").is_err());
    }

    #[test]
    fn serializes_responses() {
        let r = String::from_utf8(response_bytes(204, None, &[], false)).unwrap();
        assert_eq!(r, "HTTP/1.1 204 No Content\r\n\r\n");
        let body = serde_json::json!({"error": "nope"}).to_string();
        let r = String::from_utf8(response_bytes(405, Some(&body), &[("Allow", "GET")], true)).unwrap();
        assert_eq!(
            r,
            "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: 16\r\n\r\n{\"error\":\"nope\"}"
        );
    }

    fn pair() -> (Conn, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Conn::new(a), b)
    }

    #[test]
    fn trickled_head_still_times_out() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        let (mut conn, mut peer) = pair();
        let stop = Arc::new(AtomicBool::new(false));
        let trickle = {
            let stop = stop.clone();
            // A byte every 5 ms, each well inside the head deadline: only a
            // deadline for the whole head ends this (bounded for safety).
            std::thread::spawn(move || {
                peer.write_all(b"GET / HTTP/1.1\r\nX: ").unwrap();
                for _ in 0..10_000 {
                    if stop.load(Ordering::SeqCst) || peer.write_all(b"a").is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        let far = Instant::now() + Duration::from_secs(60);
        let r = conn.read_head_from(far, || Instant::now() + Duration::from_millis(100));
        stop.store(true, Ordering::SeqCst);
        assert!(matches!(r, Err(ReadError::TimedOut { partial: true })), "{r:?}");
        trickle.join().unwrap();
    }

    #[test]
    fn silence_is_an_idle_timeout() {
        let (mut conn, _peer) = pair();
        let mut started = false;
        let r = conn.read_head_from(Instant::now(), || {
            started = true;
            Instant::now()
        });
        assert!(matches!(r, Err(ReadError::TimedOut { partial: false })), "{r:?}");
        assert!(!started);
    }

    #[test]
    fn oversized_line_and_head_are_told_apart() {
        let far = || Instant::now() + std::time::Duration::from_secs(30);
        let (mut conn, mut peer) = pair();
        peer.write_all(&vec![b'a'; MAX_HEAD + 10]).unwrap();
        let r = conn.read_head(far());
        assert!(matches!(r, Err(ReadError::TooLarge { line: true })), "{r:?}");

        let (mut conn, mut peer) = pair();
        let mut head = b"GET / HTTP/1.1\r\nX: ".to_vec();
        head.resize(MAX_HEAD + 10, b'a');
        peer.write_all(&head).unwrap();
        let r = conn.read_head(far());
        assert!(matches!(r, Err(ReadError::TooLarge { line: false })), "{r:?}");
    }
}
