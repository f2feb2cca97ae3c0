//! `kumo net-backend …`: serve a tap, or talk to a running backend.

use kumo_sandbox::ThreadKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kumo_devices::virtio::net::tap::{OpenOffloads, Tap};

use crate::api;
use crate::nic::{parse_mac, Nic};
use crate::server::Server;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The tap to own (created if missing).
    #[arg(long, value_name = "NAME")]
    pub tap: Option<String>,
    /// The vhost-user socket VMs connect to (`kumo run --net vhost-user=PATH`).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The MAC in the device's config space [default: 52:54:00:12:34:56].
    #[arg(long, value_name = "MAC")]
    pub mac: Option<String>,
    /// Assign the NIC only by handover: no automatic ownership by the first ready VM, and no
    /// automatic failover when the owner disconnects.
    #[arg(long)]
    pub manual: bool,
    /// seccomp filters on the backend's threads (docs/security.md): true, log or false, as for
    /// `kumo run`.
    #[arg(long, value_name = "true|false|log", default_value = "true")]
    pub seccomp: kumo_sandbox::seccomp::Mode,
    #[command(subcommand)]
    pub cmd: Option<Cmd>,
}

#[derive(clap::Subcommand, Debug)]
pub enum Cmd {
    /// Hand the NIC to client ID of a running backend (needs --api-socket); prints the outage
    /// measured inside the backend as JSON.
    Handover {
        #[arg(long, value_name = "ID")]
        to: u32,
        /// How long to wait for the new owner's first buffer (ms).
        #[arg(long, value_name = "MS", default_value_t = api::DEFAULT_WAIT_MS)]
        wait_ms: u64,
    },
    /// Show a running backend (needs --api-socket): tap, MAC, owner, clients and counters.
    Info,
}

pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

/// Runs `kumo net-backend`; `api_socket` is kumo's global --api-socket.
/// `allow`: `--api-allow-uid`, the uids the API serves.
pub fn run(a: Args, api_socket: Option<PathBuf>, allow: Option<Vec<u32>>) -> Result<i32, String> {
    match a.cmd {
        Some(Cmd::Handover { to, wait_ms }) => {
            let sock = api_socket.ok_or("handover needs --api-socket PATH (the backend's API socket)")?;
            let req = kumo_api::HandoverRequest { to, wait_ms: Some(wait_ms) };
            print_json(&client(&sock).handover(&req).map_err(|e| e.to_string())?)
        }
        Some(Cmd::Info) => {
            let sock = api_socket.ok_or("info needs --api-socket PATH (the backend's API socket)")?;
            print_json(&client(&sock).backend_info().map_err(|e| e.to_string())?)
        }
        None => serve(a, api_socket, allow),
    }
}

/// A handover waits up to a minute for the new owner's first buffer.
fn client(sock: &Path) -> kumo_api::ApiClient {
    kumo_api::ApiClient::new(sock).with_timeout(std::time::Duration::from_secs(120))
}

fn print_json(v: &impl serde::Serialize) -> Result<i32, String> {
    println!("{}", serde_json::to_string(v).map_err(|e| e.to_string())?);
    Ok(0)
}

fn serve(a: Args, api_socket: Option<PathBuf>, allow: Option<Vec<u32>>) -> Result<i32, String> {
    let tap_name = a.tap.ok_or("net-backend needs --tap NAME")?;
    let socket = a.socket.ok_or("net-backend needs --socket PATH")?;
    kumo_sandbox::seccomp::init(a.seccomp).map_err(|e| format!("seccomp: {e}"))?;
    let mac = match &a.mac {
        Some(m) => parse_mac(m)?,
        None => DEFAULT_MAC,
    };
    // An existing tap is attached as it was made (multi-queue or not), a missing one created.
    let exists = std::path::Path::new("/sys/class/net").join(&tap_name).exists();
    let tap = if exists { Tap::attach(&tap_name, 1, OpenOffloads::Clear) } else { Tap::open(&tap_name, 1) }
        .map_err(|e| e.to_string())?;
    let nic = Arc::new(Nic::new(Box::new(tap), &tap_name, mac, !a.manual));
    let listener = Server::bind(&socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    let ours = |p: &PathBuf| (p.clone(), kumo_sandbox::sock::socket_id(p));
    let mut cleanup = vec![ours(&socket)];
    let api_bound = match &api_socket {
        Some(p) => {
            let b = api::bind(p)?;
            cleanup.push((p.clone(), b.socket_id()));
            Some(b)
        }
        None => None,
    };
    // A panic in any of the backend's threads ends the backend, as one in a VMM's ends its VM:
    // the ownership it tracks may be half-changed, and its VMs see the hang-up (link down) and
    // run on. Its sockets go with it.
    let on_panic = cleanup.clone();
    kumo_sandbox::thread::set_panic_handler(move |p| {
        eprintln!("kumo net-backend: error: {p}; exiting");
        for (path, id) in &on_panic {
            kumo_sandbox::sock::remove_socket(path, *id);
        }
        std::process::exit(101);
    });
    let api = match api_bound {
        Some(b) => Some(api::serve(nic.clone(), b, allow)?),
        None => None,
    };
    let server = Server::new(nic);
    kumo_sandbox::spawn(ThreadKind::NetBackend, "nb-accept", move || {
        if let Err(e) = server.serve(listener) {
            tracing::error!("vhost-user socket: {e}");
        }
    })
    .map_err(|e| e.to_string())?;
    eprintln!(
        "kumo net-backend: tap {tap_name}, vhost-user socket {}{}",
        socket.display(),
        api_socket.as_ref().map(|p| format!(", api {}", p.display())).unwrap_or_default()
    );
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .map_err(|e| format!("signals: {e}"))?;
    // Setup is done: the main thread only waits for a signal and removes the sockets.
    kumo_sandbox::seccomp::filter_this_thread(ThreadKind::NetBackend, "main").map_err(|e| e.to_string())?;
    let _ = signals.forever().next();
    // Stops the API (its accept thread is woken through the socket, which it then removes).
    drop(api);
    // Only our own sockets: one replaced by someone else meanwhile stays.
    for (p, id) in cleanup {
        kumo_sandbox::sock::remove_socket(&p, id);
    }
    Ok(0)
}
