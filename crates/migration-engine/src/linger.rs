//! Closing a connection we refuse without a reset: the peer still gets the answer we wrote.

use std::io::Read;
use std::time::{Duration, Instant};

/// How long a refused peer's leftovers are read before the close.
const LINGER: Duration = Duration::from_secs(1);

/// Reads what a dropped peer still sends (at most 64 KiB, for at most [`LINGER`]) after
/// closing our side for writing: closing with unread data would reset the connection and the
/// peer might lose our answer.
pub(crate) fn linger_close(sock: &std::net::TcpStream) {
    let _ = sock.shutdown(std::net::Shutdown::Write);
    let _ = sock.set_read_timeout(Some(LINGER));
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    let mut n = 0;
    while n < (64 << 10) && t.elapsed() < LINGER {
        match (&*sock).read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
}
