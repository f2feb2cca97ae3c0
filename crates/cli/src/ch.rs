//! kumo started the way Cloud Hypervisor is: as `cloud-hypervisor` (a symlink; argv[0]) or as
//! `kumo vmm`, with CH's command line. libvirt's `ch` driver probes `--version`, binds the API
//! socket itself and starts `<emulator> --api-socket fd=N [--event-monitor path=P|fd=N]`, then
//! shapes the VM through the API (`vm.create`, `vm.boot`). docs/ch-compat.md.

use std::ffi::OsString;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use clap::Parser;

/// Whether this process was started as Cloud Hypervisor: the arguments after the program name
/// (and after `vmm`) if so.
pub fn invoked_as_ch(args: &[OsString]) -> Option<Vec<OsString>> {
    let name = args.first().map(std::path::Path::new).and_then(|p| p.file_name());
    if name.is_some_and(|n| n == "cloud-hypervisor") {
        return Some(args[1..].to_vec());
    }
    (args.get(1).is_some_and(|a| a == "vmm")).then(|| args[2..].to_vec())
}

/// The version line `--version` prints: CH's form (libvirt parses `cloud-hypervisor vX.Y.Z`),
/// then kumo's own version.
pub fn version_line() -> String {
    format!("cloud-hypervisor v{} (kumo {})", kumo_api::CH_COMPAT_VERSION, kumo_api::KUMO_VERSION)
}

const AFTER_HELP: &str = "\
kumo as a Cloud Hypervisor drop-in: with no VM arguments it runs as an empty VMM that waits on
its API (vm.create and vm.boot, vm.restore, vm.receive-migration). CH's VM flags (--kernel,
--cpus, --memory, --disk, --net, ...) are not taken here: give the VM through the API, or run
`kumo run` with kumo's own flags. docs/ch-compat.md lists what is supported.";

#[derive(Parser, Debug)]
#[command(name = "cloud-hypervisor", disable_version_flag = true, after_help = AFTER_HELP)]
struct ChArgs {
    /// The API socket: fd=N (a listening unix socket this process inherited), path=PATH or PATH.
    #[arg(long, value_name = "fd=N|path=PATH")]
    api_socket: Option<String>,
    /// Lifecycle events as JSON lines: path=PATH or fd=N (an inherited descriptor).
    #[arg(long, value_name = "path=PATH|fd=N")]
    event_monitor: Option<String>,
    /// Per-thread seccomp filters: true, log or false.
    #[arg(long, value_name = "true|false|log", default_value = "true")]
    seccomp: String,
    /// More log output: -v info, -vv debug.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Append the log to this file instead of stderr.
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
    /// kumo's own: serve the API only to these uids (SO_PEERCRED).
    #[arg(long, value_name = "UID[,UID...]")]
    api_allow_uid: Option<String>,
    /// Print the version (CH's form, then kumo's) and exit.
    #[arg(short = 'V', long)]
    version: bool,
}

/// Where the API is served.
#[derive(Debug, PartialEq, Eq)]
enum ApiSocket {
    /// A listening socket the parent bound and passed.
    Fd(i32),
    Path(PathBuf),
}

/// `--api-socket`: `fd=N`, `path=PATH` or a bare path (one of them).
fn parse_api_socket(s: &str) -> Result<ApiSocket, String> {
    if !s.contains('=') {
        return Ok(ApiSocket::Path(PathBuf::from(s)));
    }
    let mut got = None;
    for part in s.split(',') {
        let v = match part.split_once('=') {
            Some(("fd", n)) => {
                ApiSocket::Fd(n.parse().map_err(|_| format!("--api-socket {s}: fd= needs a descriptor number"))?)
            }
            Some(("path", p)) if !p.is_empty() => ApiSocket::Path(PathBuf::from(p)),
            _ => return Err(format!("--api-socket {s}: expected fd=N or path=PATH, not `{part}`")),
        };
        if got.replace(v).is_some() {
            return Err(format!("--api-socket {s}: give fd=N or path=PATH, not both"));
        }
    }
    got.ok_or_else(|| format!("--api-socket {s}: expected fd=N or path=PATH"))
}

/// `--event-monitor`: CH's `path=PATH` / `fd=N` as kumo's `PATH` / `fd:N`.
fn event_monitor_target(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some(("path", p)) if !p.is_empty() => Ok(p.to_string()),
        Some(("fd", n)) if n.parse::<u32>().is_ok() => Ok(format!("fd:{n}")),
        Some(_) => Err(format!("--event-monitor {s}: expected path=PATH or fd=N")),
        None => Ok(s.to_string()),
    }
}

/// Runs kumo as Cloud Hypervisor: an empty VMM on the API socket. Returns the exit code.
pub fn main(args: Vec<OsString>) -> Result<i32, String> {
    let a = match ChArgs::try_parse_from(std::iter::once(OsString::from("cloud-hypervisor")).chain(args)) {
        Ok(a) => a,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            if e.kind() == clap::error::ErrorKind::UnknownArgument {
                eprintln!("\nkumo takes the VM through the API here (vm.create); see --help.");
            }
            return Ok(2);
        }
        Err(e) => {
            let _ = e.print();
            return Ok(0);
        }
    };
    if a.version {
        println!("{}", version_line());
        return Ok(0);
    }
    crate::init_logging(a.verbose, a.log_file.as_deref())?;
    let socket = a.api_socket.as_deref().ok_or("--api-socket is needed: the VM is given through the API")?;
    let (path, inherited) = match parse_api_socket(socket)? {
        ApiSocket::Path(p) => (p, None),
        ApiSocket::Fd(fd) => {
            let l = kumo_sandbox::sock::inherited_listener(fd).map_err(|e| format!("--api-socket {socket}: {e}"))?;
            (listener_path(&l), Some(l))
        }
    };
    let mut run_args = vec!["kumo".to_string(), "run".into(), "--seccomp".into(), a.seccomp.clone()];
    if let Some(m) = &a.event_monitor {
        run_args.extend(["--event-monitor".into(), event_monitor_target(m)?]);
    }
    let cli = crate::Cli::try_parse_from(&run_args).map_err(|e| e.to_string().trim().to_string())?;
    let crate::Cmd::Run(run) = cli.cmd else { unreachable!("the arguments name `run`") };
    let allow = a.api_allow_uid.as_deref().map(kumo_sandbox::sock::parse_uids).transpose()?;
    crate::run(*run, Some(path), allow, inherited)
}

/// The path an inherited listener is bound at (for messages and `vm.info`), or a placeholder.
fn listener_path(l: &UnixListener) -> PathBuf {
    l.local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("<inherited socket>"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_program_name_or_vmm_selects_the_ch_command_line() {
        let ch = invoked_as_ch(&os(&["/usr/local/bin/cloud-hypervisor", "--api-socket", "fd=3"]));
        assert_eq!(ch, Some(os(&["--api-socket", "fd=3"])));
        assert_eq!(invoked_as_ch(&os(&["kumo", "vmm", "-V"])), Some(os(&["-V"])));
        assert_eq!(invoked_as_ch(&os(&["kumo", "run", "--guest", "hello"])), None);
        assert_eq!(invoked_as_ch(&os(&["/opt/cloud-hypervisor-x/kumo", "vmm-x"])), None);
    }

    #[test]
    fn the_version_line_is_the_form_libvirt_parses() {
        let v = version_line();
        let rest = v.strip_prefix("cloud-hypervisor v").expect("libvirt skips `cloud-hypervisor v`");
        let major: u32 = rest.split('.').next().unwrap().parse().unwrap();
        assert!(major >= 15, "libvirt 9.0 needs at least v15: {v}");
        assert!(v.ends_with(&format!("(kumo {})", kumo_api::KUMO_VERSION)), "{v}");
    }

    #[test]
    fn api_socket_forms() {
        assert_eq!(parse_api_socket("fd=3"), Ok(ApiSocket::Fd(3)));
        assert_eq!(parse_api_socket("path=/run/x.sock"), Ok(ApiSocket::Path("/run/x.sock".into())));
        assert_eq!(parse_api_socket("/run/x.sock"), Ok(ApiSocket::Path("/run/x.sock".into())));
        assert!(parse_api_socket("fd=x").unwrap_err().contains("descriptor number"));
        assert!(parse_api_socket("fd=3,path=/p").unwrap_err().contains("not both"));
        assert!(parse_api_socket("sock=/p").unwrap_err().contains("expected fd=N or path=PATH"));
    }

    #[test]
    fn event_monitor_forms() {
        assert_eq!(event_monitor_target("path=/tmp/ev").unwrap(), "/tmp/ev");
        assert_eq!(event_monitor_target("fd=7").unwrap(), "fd:7");
        assert_eq!(event_monitor_target("/tmp/ev").unwrap(), "/tmp/ev");
        assert!(event_monitor_target("fd=x").is_err());
    }

    #[test]
    fn vm_flags_are_refused_by_name() {
        let e = ChArgs::try_parse_from(["cloud-hypervisor", "--api-socket", "fd=3", "--kernel", "/k"]).unwrap_err();
        assert!(e.to_string().contains("--kernel"), "{e}");
        let a =
            ChArgs::try_parse_from(["cloud-hypervisor", "--api-socket", "fd=3", "--seccomp", "log", "-vv"]).unwrap();
        assert_eq!((a.seccomp.as_str(), a.verbose), ("log", 2));
    }
}
