//! `kumo`: run VMs, list guest programs, talk to a running VM's control API, benchmark.

mod bench;
mod bench_migrate;
mod migrate;
mod qemu;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kumo_api::{ApiClient, ApiServer};
use kumo_vmm::config::IrqchipMode;
use kumo_vmm::{ConfigFile, Payload, RunningVm, VmConfig};

#[derive(Parser)]
#[command(name = "kumo", version, about = "kumo: a KVM virtual machine monitor for HPC and enterprise clouds")]
struct Cli {
    /// Control API socket: served by `run`, used by info/pause/resume/shutdown/ping.
    #[arg(long, global = true, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a VM: one of kumo's guest programs or a Linux kernel. The serial console goes to
    /// stdout; the exit status is the guest's exit code.
    Run(RunArgs),
    /// List the built guest programs and their parameters.
    Guests {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show a running VM (needs --api-socket).
    Info,
    /// Pause all vCPUs of a running VM (needs --api-socket).
    Pause,
    /// Resume a paused VM (needs --api-socket).
    Resume,
    /// Shut a running VM down (needs --api-socket).
    Shutdown,
    /// Check that a VM's API answers (needs --api-socket).
    Ping,
    /// Migrate a running VM (needs --api-socket) to a `kumo run --incoming`.
    Migrate(migrate::MigrateArgs),
    /// Benchmarks: print a table and write JSON.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCmd,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Linux kernel (bzImage, or vmlinux with a PVH entry).
    #[arg(long, value_name = "PATH", conflicts_with = "guest")]
    kernel: Option<PathBuf>,
    /// Receive a migrating VM on tcp:HOST:PORT or unix:PATH instead of booting one; its shape
    /// comes from the stream. With --memory and/or --cpus only a VM of that shape is accepted
    /// (a prepared destination), and --memory is reserved and faulted in before the migration
    /// starts. The irqchip comes from the stream too.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["kernel", "guest", "config", "irqchip", "guest_args"])]
    incoming: Option<String>,
    /// Initial ramdisk for --kernel.
    #[arg(long, value_name = "PATH", requires = "kernel")]
    initrd: Option<PathBuf>,
    /// Kernel command line for --kernel.
    #[arg(long, requires = "kernel")]
    cmdline: Option<String>,
    /// A built guest program (see `kumo guests`); its key=value arguments follow.
    #[arg(long, value_name = "NAME")]
    guest: Option<String>,
    /// Number of vCPUs [default: 1].
    #[arg(long)]
    cpus: Option<u32>,
    /// Memory size, e.g. 256M, 1.5G [default: 256M]: a multiple of 4 KiB, at least 8M, at most
    /// this host's MemTotal less max(512 MiB, 5 %).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Interrupt controller placement: kernel (PIC/IOAPIC/PIT in KVM) or split.
    #[arg(long, value_parser = ["kernel", "split"])]
    irqchip: Option<String>,
    /// VM config file (JSON or TOML); flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Stop the VM after this many seconds (exit status 124).
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Write start-up timings (CLOCK_MONOTONIC ns) as JSON to this file when the VM ends.
    #[arg(long, value_name = "FILE")]
    timings_json: Option<PathBuf>,
    /// Guest arguments, key=value (with --guest).
    #[arg(value_name = "KEY=VALUE")]
    guest_args: Vec<String>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    kumo_vmm::config::parse_size(s)
}

fn build_config(a: &RunArgs) -> Result<VmConfig, String> {
    let file = match &a.config {
        Some(p) => ConfigFile::load(p).map_err(|e| e.to_string())?,
        None => ConfigFile::default(),
    };
    let payload = match (&a.kernel, &a.guest) {
        (Some(k), _) => Payload::Kernel { path: k.clone(), initrd: a.initrd.clone(), cmdline: a.cmdline.clone() },
        (None, Some(g)) => Payload::Guest { name: g.clone(), args: a.guest_args.clone() },
        (None, None) => file
            .payload
            .clone()
            .ok_or("nothing to boot: give --guest NAME, --kernel PATH or a --config file with a payload")?,
    };
    if !a.guest_args.is_empty() && !matches!(payload, Payload::Guest { .. }) {
        return Err(format!("guest arguments ({}) need --guest", a.guest_args.join(" ")));
    }
    let irqchip = match a.irqchip.as_deref() {
        Some("split") => IrqchipMode::Split,
        Some(_) => IrqchipMode::Kernel,
        None => file.irqchip.unwrap_or_default(),
    };
    Ok(VmConfig {
        cpus: a.cpus.or(file.cpus).unwrap_or(1),
        memory: a.memory.or(file.memory).unwrap_or(256 << 20),
        irqchip,
        payload,
    })
}

fn run(a: RunArgs, api_socket: Option<PathBuf>) -> Result<i32, String> {
    let (vm, _api) = match &a.incoming {
        // A destination's API is up while the VM arrives (`vm.info` says `receiving`).
        Some(addr) => {
            let inc = kumo_vmm::migration::Incoming::new(addr, a.memory, a.cpus)?;
            let api = kumo_vmm::api::VmApi::incoming(&inc);
            let server = match &api_socket {
                Some(p) => Some(ApiServer::start(p, api.clone()).map_err(|e| e.to_string())?),
                None => None,
            };
            let vm = Arc::new(migrate::incoming(&inc)?);
            api.attach(&vm);
            (vm, server)
        }
        None => {
            let config = build_config(&a)?;
            let vm = Arc::new(RunningVm::start(config, Box::new(std::io::stdout())).map_err(|e| e.to_string())?);
            let server = match &api_socket {
                Some(p) => Some(ApiServer::start(p, kumo_vmm::api::VmApi::new(&vm)).map_err(|e| {
                    vm.shutdown();
                    e.to_string()
                })?),
                None => None,
            };
            (vm, server)
        }
    };
    spawn_console_input(Arc::downgrade(&vm));
    let report = vm.wait_timeout(a.timeout.map(Duration::from_secs_f64));
    if let Some(p) = &a.timings_json {
        let j = serde_json::to_string_pretty(&report.timings).unwrap_or_default();
        std::fs::write(p, j).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    let assists = vm.assist_counts();
    if assists.total() > 0 {
        eprintln!("kumo: emulation assists: {}", assists.summary());
    }
    use kumo_vmm::Outcome::*;
    match &report.outcome {
        Reset(why) => eprintln!("kumo: guest reset: {why}"),
        Error(e) => eprintln!("kumo: error: {e}"),
        TimedOut => eprintln!("kumo: timed out after {} s; VM stopped", a.timeout.unwrap_or(0.0)),
        Migrated(to) => eprintln!("kumo: VM migrated to {to}; this copy stopped"),
        _ => {}
    }
    Ok(report.outcome.exit_code())
}

/// Feeds kumo's stdin to the guest's serial console (COM1), so a user or a test can talk to the
/// guest. An incoming VM gets it only once it runs here: its console state, pending input
/// included, arrives with the migration. Input the FIFO cannot take yet waits, never dropped.
fn spawn_console_input(vm: std::sync::Weak<RunningVm>) {
    let spawned = std::thread::Builder::new().name("console-in".into()).spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 64];
        loop {
            let n = match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return, // EOF (e.g. /dev/null): no console input
                Ok(n) => n,
            };
            let mut rest = &buf[..n];
            while !rest.is_empty() {
                let Some(vm) = vm.upgrade() else { return };
                if vm.is_finished() {
                    return;
                }
                let took = vm.serial_input(rest);
                rest = &rest[took..];
                drop(vm);
                if !rest.is_empty() {
                    // The guest has not read its FIFO yet.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("no console input: cannot start its thread: {e}");
    }
}

fn guests(json: bool) -> Result<i32, String> {
    let all = kumo_guests::all().map_err(|e| e.to_string())?;
    if json {
        let m: Vec<_> = all.iter().map(|g| &g.manifest).collect();
        println!("{}", serde_json::to_string_pretty(&m).map_err(|e| e.to_string())?);
        return Ok(0);
    }
    for g in all {
        let m = &g.manifest;
        println!("{}  ({} vCPUs: {}..={})", m.name, m.summary, m.min_cpus, m.max_cpus);
        for p in &m.params {
            println!("    {:<12} {:<10} default {:<8} {}", p.key, p.kind_str(), p.default, p.help);
        }
    }
    Ok(0)
}

fn client_cmd(cmd: &Cmd, socket: Option<PathBuf>) -> Result<i32, String> {
    let socket = socket.ok_or("this command needs --api-socket PATH of a running VM")?;
    let c = ApiClient::new(&socket);
    match cmd {
        Cmd::Info => {
            let i = c.info().map_err(|e| e.to_string())?;
            println!("{}", serde_json::to_string_pretty(&i).map_err(|e| e.to_string())?);
        }
        Cmd::Pause => c.pause().map_err(|e| e.to_string())?,
        Cmd::Resume => c.resume().map_err(|e| e.to_string())?,
        Cmd::Shutdown => c.shutdown().map_err(|e| e.to_string())?,
        Cmd::Ping => println!("kumo {}", c.ping().map_err(|e| e.to_string())?),
        _ => unreachable!("not a client command"),
    }
    Ok(0)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("KUMO_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => run(a, cli.api_socket),
        Cmd::Guests { json } => guests(json),
        Cmd::Bench { which } => bench::run(which),
        Cmd::Migrate(m) => migrate::run(m, cli.api_socket),
        ref c @ (Cmd::Info | Cmd::Pause | Cmd::Resume | Cmd::Shutdown | Cmd::Ping) => client_cmd(c, cli.api_socket),
    };
    match r {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("kumo: error: {e}");
            ExitCode::from(1)
        }
    }
}
