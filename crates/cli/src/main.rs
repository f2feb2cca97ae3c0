//! `kumo`: run VMs, list guest programs, talk to a running VM's control API; `kumo bench` runs
//! the separate `kumo-bench` binary (crates/bench), so no benchmark code is linked in here.

/// `eprintln!` that never panics: stderr may be closed (a parent that went away), and a message
/// must not take the VM (or the signal thread that shuts it down) with it.
macro_rules! note {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod ch;
mod console;
mod guest;
mod lend;
mod migrate;

use kumo_sandbox::ThreadKind;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kumo_api::{ApiClient, ApiServer};
use kumo_vmm::config::IrqchipMode;
use kumo_vmm::{ConfigFile, DiskSpec, NetSpec, Payload, RunningVm, VmConfig};

const LOG_HELP: &str = "\
Logging: warnings and errors go to stderr. -v adds info, -vv debug; without -v the KUMO_LOG
environment variable sets the filter (tracing's syntax, e.g. KUMO_LOG=debug or
KUMO_LOG=kumo_vmm=debug,warn). --log-file PATH appends the log to PATH instead of stderr.
Colour only when the log goes to a terminal (and NO_COLOR is unset).";

#[derive(Parser)]
#[command(
    name = "kumo",
    version,
    about = "kumo: a KVM virtual machine monitor for HPC and enterprise clouds",
    after_help = LOG_HELP
)]
struct Cli {
    /// Control API socket: served by `run` (alone: an empty VMM that waits for `restore` or
    /// `receive-migration`), used by info/pause/resume/shutdown/ping/migrate/snapshot/....
    #[arg(long, global = true, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// Serve the API (of `run` or `net-backend`) only to these uids (SO_PEERCRED), besides the
    /// socket's 0600 mode; a refused client gets 403.
    #[arg(long, global = true, value_name = "UID[,UID...]", value_parser = parse_allow_uids)]
    api_allow_uid: Option<AllowUids>,
    /// More log output: -v info, -vv debug (overrides KUMO_LOG).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Append the log to this file instead of stderr.
    #[arg(long, global = true, value_name = "PATH")]
    log_file: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// `--api-allow-uid UID[,UID...]`.
#[derive(Debug, Clone)]
struct AllowUids(Vec<u32>);

fn parse_allow_uids(s: &str) -> Result<AllowUids, String> {
    kumo_sandbox::sock::parse_uids(s).map(AllowUids)
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a VM: one of kumo's guest programs or a Linux kernel. The serial console goes to
    /// stdout; the exit status is the guest's exit code.
    Run(Box<RunArgs>),
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
    /// Write a running VM to a file (needs --api-socket); `kumo run --restore FILE` runs it
    /// again. The VM pauses while it is written, then runs on (a paused VM stays paused).
    Snapshot {
        /// The snapshot file (replaced if it exists).
        #[arg(long, value_name = "FILE")]
        to: PathBuf,
    },
    /// Tell an empty VMM (`kumo run --api-socket S`, nothing to boot) to receive a migrating VM:
    /// it listens on ADDR (this returns once it listens; start the migration then) and runs the
    /// VM once it has arrived.
    ReceiveMigration {
        /// Where to listen: tcp:HOST:PORT or unix:PATH.
        #[arg(long, value_name = "ADDR")]
        from: String,
        /// Only take a VM of this memory size, e.g. 2G; it is reserved and faulted in first.
        #[arg(long, value_parser = parse_size)]
        memory: Option<u64>,
        /// Prepare --memory as a memfd instead of private memory (a VM that will move on
        /// with the local engine needs it).
        #[arg(long, requires = "memory")]
        shared_memory: bool,
        /// Only take a VM with this many vCPUs.
        #[arg(long)]
        cpus: Option<u32>,
        /// The host side of the VM's NICs, as `kumo run --incoming --net`: [id=netN,]tap=NAME
        /// or [id=netN,]vhost-user=PATH (repeatable; every NIC needs one).
        #[arg(long, value_name = "SPEC")]
        net: Vec<String>,
        /// The host node of each of the VM's NUMA nodes: node=ID[,host-node=N] (repeatable).
        #[arg(long, value_name = "SPEC")]
        numa: Vec<String>,
        /// The image of each of the VM's disks, as `kumo run --incoming --disk`:
        /// [id=diskN,]path=FILE (repeatable; every disk needs one).
        #[arg(long, value_name = "SPEC")]
        disk: Vec<String>,
        /// Mutual TLS (tcp: only): DIR holds ca.pem, cert.pem and key.pem; the source must
        /// present a certificate signed by ca.pem.
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
        /// Without --tls-dir: listen in plain TCP on a non-loopback address (a trusted
        /// network). Without it a plain listener is taken on loopback only.
        #[arg(long)]
        insecure: bool,
    },
    /// Tell an empty VMM (`kumo run --api-socket S`, nothing to boot) to run the VM saved in a
    /// snapshot file (`kumo snapshot`); it starts paused if it was saved paused.
    Restore {
        /// The snapshot file.
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// The host side of the VM's NICs, as `kumo run --restore --net` (repeatable).
        #[arg(long, value_name = "SPEC")]
        net: Vec<String>,
        /// The host node of each of the VM's NUMA nodes: node=ID[,host-node=N] (repeatable).
        #[arg(long, value_name = "SPEC")]
        numa: Vec<String>,
        /// The image of each of the VM's disks, as `kumo run --restore --disk` (repeatable).
        #[arg(long, value_name = "SPEC")]
        disk: Vec<String>,
    },
    /// Pin a running or paused VM's vCPU to a host CPU, or unpin it (needs --api-socket).
    Pin {
        /// The vCPU.
        #[arg(long)]
        vcpu: u32,
        /// The host CPU, or `none` to unpin (the vCPU floats).
        #[arg(long, value_name = "CPU|none")]
        cpu: String,
    },
    /// Show a running VM's counters as JSON: vCPU exits by reason, emulation assists,
    /// interrupts, migration bytes (needs --api-socket).
    Counters,
    /// Benchmarks (boot, migrate, net): runs the `kumo-bench` binary next to kumo with these
    /// arguments; `kumo bench --help` lists them. Results go to --out DIR [default:
    /// target/kumo-bench].
    #[command(disable_help_flag = true)]
    Bench {
        /// Arguments for kumo-bench, e.g. `boot --runs 10` or `migrate --quick --out DIR`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
        args: Vec<std::ffi::OsString>,
    },
    /// Lend host CPUs and/or memory from one running elastic VM to another (`--elastic`): the
    /// lender's guest gives them up, the borrower's takes them; it completes on both or
    /// changes nothing.
    Lend(lend::LendArgs),
    /// Give back what `--from` borrowed from `--to` (the reverse of `kumo lend`).
    Return(lend::LendArgs),
    /// The NIC as its own process: own a tap and serve VMs over vhost-user-net (one VM owns the
    /// NIC at a time); or, with a subcommand, talk to a running one (needs --api-socket).
    NetBackend(kumo_net_backend::cli::Args),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Linux kernel (bzImage, or vmlinux with a PVH entry).
    #[arg(long, value_name = "PATH", conflicts_with = "guest")]
    kernel: Option<PathBuf>,
    /// Receive a migrating VM on tcp:HOST:PORT or unix:PATH instead of booting one; its shape
    /// comes from the stream. With --memory and/or --cpus only a VM of that shape is accepted
    /// (a prepared destination), and --memory is reserved and faulted in before the migration
    /// starts. The irqchip comes from the stream too. Its host resources come from here:
    /// --net for each of its NICs (required), --numa for its nodes' host nodes.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["kernel", "guest", "config", "irqchip", "guest_args"])]
    incoming: Option<String>,
    /// With --incoming tcp:…: mutual TLS; DIR holds ca.pem, cert.pem and key.pem, and the
    /// source must present a certificate signed by ca.pem (docs/migration.md, "Security").
    #[arg(long, value_name = "DIR", requires = "incoming")]
    tls_dir: Option<PathBuf>,
    /// With --incoming tcp:… and no --tls-dir: listen in plain TCP on a non-loopback address
    /// (a trusted network). Without it a plain listener is taken on loopback only.
    #[arg(long, requires = "incoming")]
    insecure: bool,
    /// Run the VM saved in a snapshot file (`kumo snapshot`) instead of booting one: its shape,
    /// memory and state come from the file; it starts paused if it was paused. Its host
    /// resources come from here, as with --incoming: --net for each NIC, --numa.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kernel", "guest", "config", "irqchip", "guest_args", "incoming", "cpus", "memory"])]
    restore: Option<PathBuf>,
    /// Write VM lifecycle events (booted, paused, resumed, snapshot, restored, migration-…,
    /// shutdown) as JSON lines to this file, or to an inherited descriptor with fd:N.
    #[arg(long, value_name = "PATH")]
    event_monitor: Option<String>,
    /// Initial ramdisk for a Linux kernel (--kernel, or a config file's kernel payload).
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line for a Linux kernel (--kernel, or a config file's kernel payload).
    #[arg(long)]
    cmdline: Option<String>,
    /// A built guest program (see `kumo guests`); its key=value arguments follow.
    #[arg(long, value_name = "NAME")]
    guest: Option<String>,
    /// Number of vCPUs [default: 1], optionally pinned: N,pin=V@H:V@H (or V@H,V@H; ranges
    /// A-B@C-D); vCPUs not named float. Not with --numa mirror (it pins every vCPU itself).
    #[arg(long, value_name = "N[,pin=SPEC]")]
    cpus: Option<String>,
    /// Memory size, e.g. 256M, 1.5G [default: 256M]: a multiple of 4 KiB, at least 8M, at most
    /// this host's MemTotal less max(512 MiB, 5 %).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Interrupt controller placement: kernel (PIC/IOAPIC/PIT in KVM), split (LAPICs in KVM)
    /// or user (no irqchip in KVM: kumo emulates the LAPICs).
    #[arg(long, value_parser = ["kernel", "split", "user"])]
    irqchip: Option<String>,
    /// VM config file (JSON or TOML); flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Stop the VM after this many seconds (exit status 124); 0 means no timeout.
    #[arg(long, value_name = "SECS", value_parser = parse_timeout)]
    timeout: Option<Duration>,
    /// Write start-up timings (CLOCK_MONOTONIC ns) as JSON to this file when the VM ends.
    #[arg(long, value_name = "FILE")]
    timings_json: Option<PathBuf>,
    /// Also serve the guest's serial console on this unix socket (mode 0600): every client gets
    /// the console output from when it connects, and what it writes is typed on the console,
    /// as stdin is. E.g. `socat - UNIX-CONNECT:PATH`.
    #[arg(long, value_name = "PATH")]
    console_socket: Option<PathBuf>,
    /// A virtio-net NIC on an existing host tap (repeatable; net0 first):
    /// tap=NAME[,mac=52:54:00:..][,queues=N][,irq=direct|shared|dedicated][,vcpu=N],
    /// or served by a vhost-user-net backend listening on a unix socket:
    /// vhost-user=PATH[,mac=..][,irq=..][,vcpu=N] (one queue pair).
    /// irq picks its interrupt path: direct (KVM delivers where the guest's driver aims),
    /// dedicated,vcpu=N (KVM delivers to vCPU N alone) or shared (one kumo dispatcher thread,
    /// to vCPU 0). Given, it replaces a config file's NICs.
    /// With --incoming or --restore: the host side of the arriving VM's NICs, by id:
    /// [id=netN,]tap=NAME or [id=netN,]vhost-user=PATH (the i-th --net is net{i} without id=).
    /// Every NIC of the VM needs one, or the VM is refused; MAC, queues and irq are the VM's.
    #[arg(long, value_name = "SPEC")]
    net: Vec<String>,
    /// A virtio-blk disk on a raw image file (repeatable; disk0 first, on PCI after the NICs):
    /// path=FILE[,id=ID][,readonly=on][,serial=STR][,queues=N][,queue_size=N][,direct=on].
    /// queues defaults to one per vCPU; direct=on opens the image O_DIRECT. The image is
    /// locked (shared when read-only, exclusive otherwise): a second writer is refused.
    /// Given, it replaces a config file's disks.
    /// With --incoming or --restore: the arriving VM's image of each disk, by id:
    /// id=diskN,path=FILE (every disk of the VM needs one; its size must be the source's).
    #[arg(long, value_name = "SPEC")]
    disk: Vec<String>,
    /// A guest NUMA node (repeatable): node=ID,cpus=LIST,memory=SIZE[,host-node=N]
    /// [,pin=host-node|LIST]. LIST is CPU ranges or single CPUs joined by `:` (0-3, 0:2,
    /// 0-1:4-5); every vCPU in one node, the sizes adding up to --memory, laid out in node order
    /// from address 0. host-node=N binds the node's memory to host node N (mbind). pin= pins
    /// the node's vCPUs in order to those host CPUs, or to host node N's CPUs (one per core
    /// first). `--numa mirror` (a config file: numa = "mirror") reproduces the host's nodes and
    /// pins every vCPU. Given, it replaces a config file's nodes.
    /// With --incoming or --restore: node=ID[,host-node=N], the host node of each of the
    /// arriving VM's nodes (give every node, or none: then no node's memory is bound).
    #[arg(long, value_name = "SPEC")]
    numa: Vec<String>,
    /// Distance between two guest NUMA nodes (repeatable), SRC:DST=VALUE, e.g. 0:1=21: also
    /// sets DST:SRC unless that is given too (then both must agree). Default 10 to itself, 20
    /// otherwise. Given, it replaces a config file's distances.
    #[arg(long, value_name = "SRC:DST=VALUE", conflicts_with_all = ["incoming", "restore"])]
    numa_distance: Vec<String>,
    /// KVM paravirtual features (docs/pv-features.md): `dedicated` or `shared` (presets) and/or
    /// FEATURE=on|off, comma-separated, later items overriding; features: steal-time,
    /// pv-unhalt, tlb-flush, poll-control, pv-ipi, realtime (the KVM_HINTS_REALTIME hint).
    /// Unset ones: `dedicated` when every vCPU has a host CPU of its own (--numa mirror), else
    /// `shared`. Given, it replaces a config file's pv.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["incoming", "restore"])]
    pv: Option<String>,
    /// How long KVM polls a halted vCPU for a wake-up before it sleeps, in ns (0: never;
    /// KVM_CAP_HALT_POLL); default: the host's kvm.halt_poll_ns.
    #[arg(long, value_name = "NS", conflicts_with_all = ["incoming", "restore"])]
    halt_poll_ns: Option<u32>,
    /// Give the VM the debug exit port (0x501: the guest ends the VM with an exit code).
    /// Always on with --guest (kumo's guests need it); off by default for --kernel.
    #[arg(long, conflicts_with_all = ["incoming", "restore"])]
    debug_exit: bool,
    /// Elastic sharing with other VMs (docs/elastic.md): cpus=LIST,memory=SIZE[,plugged=SIZE]
    /// [,block=SIZE]. cpus= are the host CPUs the VM holds at boot (vCPU 1 pinned on the first,
    /// vCPU 2 on the next...; vCPU 0 floats and is never lent; the other vCPUs are spares,
    /// parked until the VM acquires a CPU). memory= is each guest node's elastic memory (the top
    /// of its RAM), plugged= how much of it the guest may use at boot (default all). Needs a
    /// guest that speaks the channel (worker). `kumo lend` / `kumo return` move them.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["incoming", "restore"])]
    elastic: Option<String>,
    /// A memory zone (repeatable; docs/elastic.md): node=N,hotplug=SIZE[,block=2M]
    /// [,plugged=SIZE][,id=ID]: a virtio-mem device whose hotplug region (a multiple of
    /// 128 MiB, above RAM) the guest's driver plugs block by block; plugged= is what it is asked
    /// to plug at boot (default 0). vm.resize-zone and `kumo lend --memory` change it. Given,
    /// it replaces a config file's memory_zones.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["incoming", "restore"])]
    memory_zone: Vec<String>,
    /// Guest RAM as private anonymous memory with transparent huge pages (as QEMU's and Cloud
    /// Hypervisor's default RAM). It is kumo's default already, except for a VM that needs the
    /// memfd (a vhost-user NIC, --elastic) or whose size is not whole 2 MiB pages: with this
    /// flag those are refused. Such a VM has no local migration.
    #[arg(long, conflicts_with_all = ["restore", "shared_memory"])]
    private_memory: bool,
    /// Guest RAM as a shareable memfd instead of private memory: what the local migration
    /// engine hands over (and a vhost-user backend maps, which gets one anyway). It has 2 MiB
    /// pages only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (`never` on
    /// many hosts: 4 KiB pages, a slower guest). With --incoming --memory, the memory prepared
    /// is a memfd (else private).
    #[arg(long, conflicts_with = "restore")]
    shared_memory: bool,
    /// seccomp filters, one per kind of thread (docs/security.md): true stops the VM at a
    /// system call outside the thread's list with a message naming it; log lets the call
    /// through and has the kernel log it (dmesg or the audit log), to find what is missing;
    /// false runs unfiltered.
    #[arg(long, value_name = "true|false|log", default_value = "true")]
    seccomp: kumo_sandbox::seccomp::Mode,
    /// Restrict the files kumo may open (Landlock, where the host kernel has it) to those it
    /// is given at start (kernel, initrd, config, snapshot, sockets' directories), /dev/kvm,
    /// /dev/net/tun, /sys, /proc and the --landlock-path additions.
    #[arg(long)]
    landlock: bool,
    /// With --landlock: also allow PATH (a file, or a directory and all beneath it), read-only
    /// (:ro, the default) or read-write (:rw); e.g. where `kumo snapshot --to` writes or
    /// `kumo restore` reads later. Repeatable.
    #[arg(long, value_name = "PATH[:ro|:rw]", requires = "landlock")]
    landlock_path: Vec<kumo_sandbox::landlock::PathRule>,
    /// Guest arguments, key=value (with --guest).
    #[arg(value_name = "KEY=VALUE")]
    guest_args: Vec<String>,
}

/// Contains the process before it creates any thread (docs/security.md): Landlock first (every
/// thread inherits it), then the seccomp mode, which each thread's filter follows.
fn sandbox(a: &RunArgs, api_socket: Option<&std::path::Path>) -> Result<(), String> {
    use kumo_sandbox::landlock::{self, parent_dir, PathAccess, PathRule};
    if a.landlock {
        let mut rules = landlock::system_rules();
        let read = [&a.kernel, &a.initrd, &a.config, &a.restore];
        rules.extend(read.into_iter().flatten().map(|p| PathRule::new(p, PathAccess::Read)));
        let unix = a.incoming.as_deref().and_then(|i| i.strip_prefix("unix:")).map(PathBuf::from);
        let written = [api_socket.map(PathBuf::from), a.console_socket.clone(), a.timings_json.clone(), unix];
        rules.extend(written.iter().flatten().map(|p| PathRule::new(parent_dir(p), PathAccess::ReadWrite)));
        rules.extend(a.landlock_path.iter().cloned());
        match landlock::restrict(&rules)? {
            landlock::Enforced::Not => tracing::debug!("landlock: not in this kernel; paths are not restricted"),
            e => tracing::debug!("landlock: {e:?} enforced"),
        }
    }
    kumo_sandbox::seccomp::init(a.seccomp).map_err(|e| format!("seccomp: {e}"))
}

fn parse_size(s: &str) -> Result<u64, String> {
    kumo_vmm::config::parse_size(s)
}

/// Seconds, fractions allowed; 0 is no timeout (None).
fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{s}` is not a usable number of seconds"))
}

/// The VM to boot, or None when there is nothing to boot (no --guest, --kernel or config
/// payload): then only an empty VMM can start, and flags that shape a VM do not apply.
fn build_config(a: &RunArgs) -> Result<Option<VmConfig>, String> {
    let file = match &a.config {
        Some(p) => ConfigFile::load(p).map_err(|e| e.to_string())?,
        None => ConfigFile::default(),
    };
    let mut payload = match (&a.kernel, &a.guest, &file.payload) {
        (Some(k), ..) => Payload::Kernel { path: k.clone(), initrd: a.initrd.clone(), cmdline: a.cmdline.clone() },
        (None, Some(g), _) => Payload::Guest { name: g.clone(), args: a.guest_args.clone(), program: None },
        (None, None, Some(p)) => p.clone(),
        (None, None, None) => {
            let given = [
                ("--cpus", a.cpus.is_some()),
                ("--memory", a.memory.is_some()),
                ("--irqchip", a.irqchip.is_some()),
                ("--initrd", a.initrd.is_some()),
                ("--cmdline", a.cmdline.is_some()),
                ("--net", !a.net.is_empty()),
                ("--disk", !a.disk.is_empty()),
                ("--numa", !a.numa.is_empty()),
                ("--numa-distance", !a.numa_distance.is_empty()),
                ("--pv", a.pv.is_some()),
                ("--halt-poll-ns", a.halt_poll_ns.is_some()),
                ("--debug-exit", a.debug_exit),
                ("guest arguments", !a.guest_args.is_empty()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                return Err(format!("{flag} given, but nothing to boot: give --guest NAME, --kernel PATH or a --config file with a payload"));
            }
            return Ok(None);
        }
    };
    // --initrd and --cmdline apply to a kernel only (and override a config file's).
    match &mut payload {
        Payload::Kernel { initrd, cmdline, .. } => {
            if a.initrd.is_some() {
                initrd.clone_from(&a.initrd);
            }
            if a.cmdline.is_some() {
                cmdline.clone_from(&a.cmdline);
            }
        }
        Payload::Guest { name, .. } => {
            for (flag, given) in [("--initrd", a.initrd.is_some()), ("--cmdline", a.cmdline.is_some())] {
                if given {
                    return Err(format!("{flag} applies to a Linux kernel (--kernel), not to guest program {name}"));
                }
            }
        }
    }
    if !a.guest_args.is_empty() && !matches!(payload, Payload::Guest { .. }) {
        return Err(format!("guest arguments ({}) need --guest", a.guest_args.join(" ")));
    }
    let irqchip = match a.irqchip.as_deref() {
        Some("split") => IrqchipMode::Split,
        Some("user") => IrqchipMode::User,
        Some(_) => IrqchipMode::Kernel,
        None => file.irqchip.unwrap_or_default(),
    };
    let err = |e: kumo_vmm::Error| e.to_string();
    let live = kumo_vmm::placement::HostTopology::read_live;
    let (cpus, pins) = match &a.cpus {
        Some(arg) => {
            let online =
                live().map(|t| t.online_cpus()).map_err(|e| format!("--cpus: cannot read the host's CPUs: {e}"))?;
            kumo_vmm::placement::parse_cpus_arg(arg, &online)?
        }
        None => (file.cpus.unwrap_or(1), Vec::new()),
    };
    let memory = a.memory.or(file.memory).unwrap_or(256 << 20);
    use kumo_vmm::placement::NumaRequest;
    let numa = match a.numa.as_slice() {
        [] => file.numa,
        [m] if m.trim() == "mirror" => Some(NumaRequest::Mirror),
        specs => Some(NumaRequest::Nodes(kumo_vmm::NumaConfig {
            nodes: specs
                .iter()
                .map(|s| kumo_vmm::config::NumaNodeSpec::parse(s))
                .collect::<Result<_, _>>()
                .map_err(err)?,
            distances: Vec::new(),
        })),
    };
    // Mirror mode (full vNUMA) and nodes' pin= say where vCPUs run (docs/numa.md).
    let (mut numa, pins) = kumo_vmm::placement::place(cpus, memory, pins, numa, live)?;
    if !a.numa_distance.is_empty() {
        let n = numa.as_mut().ok_or("--numa-distance given, but no NUMA nodes (--numa or a config file's numa)")?;
        n.distances = a
            .numa_distance
            .iter()
            .map(|s| kumo_vmm::config::NumaDistance::parse(s))
            .collect::<Result<_, _>>()
            .map_err(err)?;
    }
    let debug_exit = a.debug_exit || file.debug_exit.unwrap_or(false) || matches!(payload, Payload::Guest { .. });
    let mut config = VmConfig {
        cpus,
        memory,
        irqchip,
        payload,
        net: if a.net.is_empty() {
            file.net
        } else {
            a.net.iter().map(|s| NetSpec::parse(s)).collect::<Result<_, _>>().map_err(|e| e.to_string())?
        },
        disks: if a.disk.is_empty() {
            file.disks
        } else {
            a.disk.iter().map(|s| DiskSpec::parse(s)).collect::<Result<_, _>>().map_err(|e| e.to_string())?
        },
        numa,
        pv: match &a.pv {
            Some(s) => kumo_vm::pv::PvRequest::parse(s).map_err(|e| e.to_string())?,
            None => file.pv.unwrap_or_default(),
        },
        host: kumo_vmm::placement::HostPlacement { pins, halt_poll_ns: a.halt_poll_ns },
        elastic: match &a.elastic {
            Some(s) => Some(kumo_vmm::elastic::ElasticConfig::parse(s).map_err(|e| e.to_string())?),
            None => file.elastic,
        },
        debug_exit,
        memory_zones: if a.memory_zone.is_empty() {
            file.memory_zones
        } else {
            a.memory_zone
                .iter()
                .map(|s| kumo_vmm::virtio_mem::ZoneSpec::parse(s))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?
        },
        shared_memory: memory_kind(
            a.shared_memory || file.shared_memory == Some(true),
            a.private_memory || file.private_memory == Some(true),
        )?,
    };
    guest::resolve(&mut config)?;
    Ok(Some(config))
}

/// `shared_memory` of a VM from its flags and config file: shared (`--shared-memory`), private
/// (`--private-memory`), or kumo's choice (neither).
fn memory_kind(shared: bool, private: bool) -> Result<Option<bool>, String> {
    match (shared, private) {
        (true, true) => Err("shared and private memory both asked for (flags or config file): pick one".into()),
        (true, false) => Ok(Some(true)),
        (false, true) => Ok(Some(false)),
        (false, false) => Ok(None),
    }
}

/// `--net` and `--numa` of `--incoming` or `--restore`: the arriving VM's host resources.
fn host_resources(a: &RunArgs) -> Result<kumo_vmm::host_resources::HostResources, String> {
    kumo_vmm::host_resources::HostResources::parse(&a.net, &a.numa)
        .and_then(|r| r.with_disks(&a.disk))
        .map_err(|e| e.to_string())
}

/// `kumo run`: boots, restores or receives a VM, or waits empty on its API. `inherited`: the
/// API's listening socket when the parent bound it (`cloud-hypervisor --api-socket fd=N`);
/// `api_socket` is then only its name.
fn run(
    a: RunArgs,
    api_socket: Option<PathBuf>,
    allow: Option<Vec<u32>>,
    inherited: Option<std::os::unix::net::UnixListener>,
) -> Result<i32, String> {
    if let Some(m) = &a.event_monitor {
        kumo_vmm::event_monitor::init(m)?;
    }
    sandbox(&a, api_socket.as_deref())?;
    // Sockets kumo bound, removed if a signal ends it before a VM exists (not an inherited one).
    let ours = if inherited.is_some() { &None } else { &api_socket };
    let sockets: Vec<PathBuf> = [ours, &a.console_socket].into_iter().flatten().cloned().collect();
    // A panic before there is a VM to stop (a destination waiting for its migration) ends the
    // process as a signal would then; once there is one, the panic is its stop reason.
    let leave = sockets.clone();
    kumo_vmm::panics::set_fallback(move |p| {
        note!("kumo: error: {p}; no VM yet, exiting");
        for s in &leave {
            let _ = std::fs::remove_file(s);
        }
        std::process::exit(101);
    });
    let signals = shutdown_on_signals(sockets)?;
    let console = a.console_socket.as_deref().map(console::ConsoleSocket::bind).transpose()?;
    let console_out = console.as_ref().map_or_else(console::stdout_only, console::ConsoleSocket::output);
    let serial = move || -> Box<dyn std::io::Write + Send> { Box::new(console_out.clone()) };
    // The API of a VM built here starts once it exists; a shutdown on failure stops it again.
    // A booted or restored VM's socket is bound before its guest runs, and served once the VM
    // exists: a client that sees the guest's output can connect.
    let inherited = std::cell::Cell::new(inherited);
    let bind = || match inherited.take() {
        Some(l) => Ok(Some(ApiServer::adopt(l))),
        None => api_socket.as_deref().map(ApiServer::bind).transpose().map_err(|e| e.to_string()),
    };
    let serve = |vm: &Arc<RunningVm>, bound: Option<kumo_api::BoundApi>| {
        signals.watch(vm);
        // An elastic VM's API threads (they inherit the server's policy) run at real-time
        // priority: a lend must not wait behind vCPUs that spin on every host CPU
        // (docs/elastic.md). They block in between; migration, the one long API job, is refused.
        let _rt = vm.config().elastic.as_ref().and_then(|_| {
            kumo_vmm::placement::realtime_this_thread()
                .map_err(|e| tracing::warn!("elastic VM's API not prioritized (SCHED_FIFO): {e}"))
                .ok()
        });
        match (bound, &api_socket) {
            (Some(b), Some(p)) => b
                .serve(kumo_vmm::api::VmApi::new(vm), allow.clone())
                .map(|s| {
                    vm.set_api_name(p);
                    Some(s)
                })
                .map_err(|e| {
                    vm.shutdown();
                    e.to_string()
                }),
            _ => Ok(None),
        }
    };
    let (vm, server, empty) = match (&a.incoming, &a.restore) {
        // A destination's API is up while the VM arrives (`vm.info` says `receiving`).
        (Some(addr), _) => {
            let cpus = a
                .cpus
                .as_deref()
                .map(|c| c.trim().parse::<u32>().map_err(|_| format!("--cpus {c}: with --incoming give a plain vCPU count (pin= is not carried)")))
                .transpose()?;
            if (a.private_memory || a.shared_memory) && a.memory.is_none() {
                return Err("--private-memory or --shared-memory with --incoming is the memory it prepares: give --memory too (without it the VM arrives with the kind of memory it had)".into());
            }
            let tls_dir = a.tls_dir.as_deref().map(migrate::path_arg).transpose()?;
            let listen = kumo_vmm::migration::listen_options(tls_dir.as_deref(), a.insecure)?;
            let inc = kumo_vmm::migration::Incoming::new(addr, a.memory, cpus, !a.shared_memory, host_resources(&a)?, listen)?;
            let api = kumo_vmm::api::VmApi::incoming(&inc);
            let server = match bind()? {
                Some(b) => Some(b.serve(api.clone(), allow.clone()).map_err(|e| e.to_string())?),
                None => None,
            };
            let vm = Arc::new(migrate::incoming(&inc, serial())?);
            signals.watch(&vm);
            api.attach(&vm);
            (vm, server, None)
        }
        (None, Some(file)) => {
            let bound = bind()?;
            let vm = kumo_vmm::snapshot::restore_from_file(file, serial(), &host_resources(&a)?);
            let vm = Arc::new(vm.map_err(|e| e.to_string())?);
            let server = serve(&vm, bound)?;
            (vm, server, None)
        }
        (None, None) => match (build_config(&a)?, &api_socket) {
            (Some(config), _) => {
                let bound = bind()?;
                let vm = Arc::new(RunningVm::start(config, serial()).map_err(|e| e.to_string())?);
                let server = serve(&vm, bound)?;
                (vm, server, None)
            }
            // An empty VMM: its API says what it becomes (vm.restore, vm.receive-migration).
            (None, Some(p)) => {
                let api = kumo_vmm::api::VmApi::empty(|line| note!("kumo: {line}"), serial.clone());
                let bound = bind()?.ok_or("an empty VMM needs its API socket")?;
                let server = bound.serve(api.clone(), allow.clone()).map_err(|e| e.to_string())?;
                note!("kumo: no VM yet: waiting for vm.create, vm.restore or vm.receive-migration on {}", p.display());
                let Some(vm) = api.wait_vm()? else {
                    note!("kumo: vmm.shutdown: exiting");
                    return Ok(0);
                };
                signals.watch(&vm);
                (vm, Some(server), Some(api))
            }
            (None, None) => {
                return Err("nothing to boot: give --guest NAME, --kernel PATH or a --config file with a payload \
                            (or only --api-socket PATH: an empty VMM that waits for vm.restore or vm.receive-migration)"
                    .into())
            }
        },
    };
    let (code, last) = run_vms(&a, vm, empty, console.as_ref(), &signals)?;
    // The API's last answers go out before the VM's memory is unmapped: unmapping it holds the
    // address space's lock for tens of ms (512 MiB: ~35 ms here), and an API thread that maps
    // memory while it answers waited that long. A finished migration's answer came up to
    // ~130 ms after the migration had ended.
    drop(server);
    drop(last);
    Ok(code)
}

/// Runs the VM until it ends; a VM made by vm.create outlives its run (Cloud Hypervisor's
/// model): it reboots, or waits shut down for vm.boot, until vmm.shutdown or a signal ends the
/// VMM. The exit status, and the last VM (for the caller to drop after the API server).
fn run_vms(
    a: &RunArgs,
    mut vm: Arc<RunningVm>,
    empty: Option<Arc<kumo_vmm::api::VmApi>>,
    console: Option<&console::ConsoleSocket>,
    signals: &SignalGuard,
) -> Result<(i32, Option<Arc<RunningVm>>), String> {
    let mut filtered = false;
    loop {
        let stdin_console = !empty.as_ref().is_some_and(|api| api.console_is_pty());
        let report = run_vm(a, &vm, console, stdin_console, &mut filtered)?;
        if kumo_sandbox::test_hook("slow:vm-ended") {
            // Widens the window in which vm.info says Shutdown before the VMM is empty again.
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let after = match &empty {
            Some(api) if !signals.signalled() => api.vm_ended(&report.outcome),
            _ => kumo_vmm::lifecycle::AfterVm::Exit,
        };
        let Some(api) = empty.as_ref().filter(|_| after != kumo_vmm::lifecycle::AfterVm::Exit) else {
            return Ok((report.outcome.exit_code(), Some(vm)));
        };
        // The old VM goes first: its disks' locks and its taps are released before a new one
        // opens them.
        drop(vm);
        if after == kumo_vmm::lifecycle::AfterVm::Reboot {
            note!("kumo: rebooting the VM");
            if let Err(e) = api.reboot() {
                note!("kumo: the VM could not be built again: {e}");
            }
        } else {
            note!("kumo: the VM is shut down; waiting for vm.boot, vm.delete or vmm.shutdown");
        }
        match api.wait_vm()? {
            Some(v) => {
                signals.watch(&v);
                if signals.signalled() {
                    // A signal came while no VM ran: this one ends too, and the VMM with it.
                    v.shutdown();
                }
                vm = v;
            }
            None => {
                note!("kumo: vmm.shutdown: exiting");
                return Ok((0, None));
            }
        }
    }
}

/// Runs one VM until it ends: its console, stdin, then the wait and what ended it. The main
/// thread takes the VMM thread's filter at its first VM (`filtered`).
fn run_vm(
    a: &RunArgs,
    vm: &Arc<RunningVm>,
    console: Option<&console::ConsoleSocket>,
    stdin_console: bool,
    filtered: &mut bool,
) -> Result<kumo_vmm::RunReport, String> {
    tracing::info!(vcpus = vm.config().cpus, memory = vm.config().memory, "VM running");
    if let Some(c) = console {
        c.attach(vm);
    }
    // stdin goes to COM1 through the VM's device event loop; what epoll cannot watch (a file)
    // is read by a thread instead. Not /dev/null (libvirt's children have it): a thread that
    // ends at once would only race whoever lists this process's threads, and not when the
    // console is a pseudo-terminal, which types on COM1 itself.
    if stdin_console && !stdin_is_dev_null() {
        let stdin = std::os::fd::AsFd::as_fd(&std::io::stdin()).try_clone_to_owned();
        if !stdin.is_ok_and(|fd| vm.attach_console_input(fd).is_ok()) {
            spawn_console_input(Arc::downgrade(vm));
        }
    }
    // The main thread's setup ends here: from now on it waits for the VM's end, reports it
    // and takes the VM down, under the VMM thread's filter.
    if !*filtered {
        if let Err(e) = kumo_sandbox::seccomp::filter_this_thread(ThreadKind::Vmm, "main") {
            vm.shutdown();
            return Err(e.to_string());
        }
        *filtered = true;
    }
    // Like every other thread but the vCPUs, kept off pinned vCPUs' CPUs.
    let _io = kumo_sandbox::cpus::register_this_thread(ThreadKind::Vmm);
    let report = vm.wait_timeout(a.timeout.filter(|t| !t.is_zero()));
    if let Some(p) = &a.timings_json {
        let j = serde_json::to_string_pretty(&report.timings).unwrap_or_default();
        std::fs::write(p, j).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    let assists = vm.assist_counts();
    if assists.total() > 0 {
        note!("kumo: emulation assists: {}", assists.summary());
    }
    use kumo_vmm::Outcome::*;
    match &report.outcome {
        Reset(why) => note!("kumo: guest reset: {why}"),
        Error(e) => note!("kumo: error: {e}"),
        TimedOut => note!("kumo: timed out after {} s; VM stopped", a.timeout.unwrap_or_default().as_secs_f64()),
        Migrated(to) => note!("kumo: VM migrated to {to}; this copy stopped"),
        Panicked(p) => note!("kumo: error: {p}; the VM was stopped"),
        _ => {}
    }
    Ok(report)
}

/// SIGTERM and SIGINT (Ctrl-C) shut the VM down as `kumo shutdown` would: `run` then returns,
/// and dropping the API server removes its socket. Before there is a VM (a destination waiting
/// for its migration, an empty VMM) a signal removes the API and console sockets (`sockets`)
/// and exits. A second signal exits at once.
/// Installed before the API server starts, so no signal finds the default handling once the API
/// answers; dropping the guard restores it.
fn shutdown_on_signals(sockets: Vec<PathBuf>) -> Result<SignalGuard, String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).map_err(|e| format!("cannot handle signals: {e}"))?;
    let handle = signals.handle();
    let vm: Arc<std::sync::Mutex<Option<std::sync::Weak<RunningVm>>>> = Arc::default();
    let signalled: Arc<std::sync::atomic::AtomicBool> = Arc::default();
    let (watched, seen_by_run) = (vm.clone(), signalled.clone());
    let spawned = kumo_sandbox::spawn(ThreadKind::Signal, "signals", move || {
        let mut seen = false;
        for sig in signals.forever() {
            if seen {
                std::process::exit(128 + sig);
            }
            seen = true;
            seen_by_run.store(true, std::sync::atomic::Ordering::SeqCst);
            let name = if sig == SIGTERM { "SIGTERM" } else { "SIGINT" };
            let vm = kumo_sandbox::lock(&watched).clone();
            match vm.as_ref().map(std::sync::Weak::upgrade) {
                Some(Some(vm)) => {
                    note!("kumo: {name}: shutting the VM down");
                    vm.shutdown();
                }
                // The VM has ended: `run` is returning (it sees the signal: no VM comes next).
                Some(None) => return,
                None => {
                    note!("kumo: {name}: no VM yet; exiting");
                    // Only sockets: whatever else is at a path was never ours.
                    for p in &sockets {
                        kumo_sandbox::sock::remove_socket(p, kumo_sandbox::sock::socket_id(p));
                    }
                    std::process::exit(128 + sig);
                }
            }
        }
    });
    spawned.map_err(|e| format!("cannot start the signal thread: {e}"))?;
    Ok(SignalGuard { handle, vm, signalled })
}

struct SignalGuard {
    handle: signal_hook::iterator::Handle,
    vm: Arc<std::sync::Mutex<Option<std::sync::Weak<RunningVm>>>>,
    signalled: Arc<std::sync::atomic::AtomicBool>,
}

impl SignalGuard {
    /// From now on a signal shuts `vm` down (a VMM that outlives its VM watches each in turn).
    fn watch(&self, vm: &Arc<RunningVm>) {
        *kumo_sandbox::lock(&self.vm) = Some(Arc::downgrade(vm));
    }

    /// Whether a signal came: the VMM ends with its VM, whatever made the VM.
    fn signalled(&self) -> bool {
        self.signalled.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        self.handle.close();
    }
}

/// Whether stdin is /dev/null (the character device 1:3).
fn stdin_is_dev_null() -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    std::fs::metadata("/proc/self/fd/0")
        .is_ok_and(|m| m.file_type().is_char_device() && (m.rdev() >> 8, m.rdev() & 0xff) == (1, 3))
}

/// Feeds kumo's stdin to the guest's serial console (COM1), so a user or a test can talk to the
/// guest, from a thread: for stdin that epoll cannot watch (a file, /dev/null).
fn spawn_console_input(vm: std::sync::Weak<RunningVm>) {
    let spawned = kumo_sandbox::spawn(ThreadKind::Console, "console-in", move || {
        console::feed(std::io::stdin().lock(), || vm.upgrade().map_or(console::Target::Gone, console::Target::Vm))
    });
    if let Err(e) = spawned {
        tracing::warn!("no console input: cannot start its thread: {e}");
    }
}

/// Replaces this process with `kumo-bench ARGS`, found next to this executable, telling it
/// which kumo to measure.
fn bench(args: Vec<std::ffi::OsString>) -> Result<i32, String> {
    use std::os::unix::process::CommandExt;
    let me = std::env::current_exe().map_err(|e| format!("cannot find the kumo binary: {e}"))?;
    let bench = me.with_file_name("kumo-bench");
    if !bench.is_file() {
        return Err(format!(
            "kumo bench needs the kumo-bench binary at {} (build it: cargo build --release -p kumo-bench)",
            bench.display()
        ));
    }
    let e = std::process::Command::new(&bench).args(args).env("KUMO_BIN", &me).exec();
    Err(format!("cannot run {}: {e}", bench.display()))
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
        Cmd::Snapshot { to } => {
            // The VM's process resolves the path: make it absolute here.
            let to = std::path::absolute(to).map_err(|e| format!("snapshot path {}: {e}", to.display()))?;
            let to = to.to_str().ok_or_else(|| format!("snapshot path {} is not UTF-8", to.display()))?;
            let r = c.clone().with_timeout(Duration::from_secs(24 * 3600)).snapshot(to).map_err(|e| e.to_string())?;
            println!("{}", serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?);
        }
        Cmd::ReceiveMigration { from, memory, shared_memory, cpus, net, numa, disk, tls_dir, insecure } => {
            let ours = kumo_vmm::host_resources::HostResources::parse(net, numa)
                .and_then(|r| r.with_disks(disk))
                .map_err(|e| e.to_string())?;
            let req = kumo_api::ReceiveMigrationRequest {
                receiver_url: from.clone(),
                memory: *memory,
                shared_memory: *shared_memory,
                cpus: *cpus,
                net: ours.net,
                numa: ours.numa,
                disks: ours.disks,
                // The VMM's process reads the directory: make it absolute here.
                tls_dir: tls_dir.as_deref().map(migrate::path_arg).transpose()?,
                insecure: *insecure,
            };
            // Preparing --memory may take a while before it listens.
            c.clone().with_timeout(Duration::from_secs(3600)).receive_migration(&req).map_err(|e| e.to_string())?;
        }
        Cmd::Restore { from, net, numa, disk } => {
            let ours = kumo_vmm::host_resources::HostResources::parse(net, numa)
                .and_then(|r| r.with_disks(disk))
                .map_err(|e| e.to_string())?;
            // The VMM's process resolves the path: make it absolute here.
            let from = std::path::absolute(from).map_err(|e| format!("snapshot path {}: {e}", from.display()))?;
            let source_url = from.to_str().ok_or_else(|| format!("snapshot path {} is not UTF-8", from.display()))?;
            let req = kumo_api::RestoreRequest {
                source_url: source_url.to_string(),
                net: ours.net,
                numa: ours.numa,
                disks: ours.disks,
                net_fds: Vec::new(),
            };
            let r = c.clone().with_timeout(Duration::from_secs(24 * 3600)).restore(&req).map_err(|e| e.to_string())?;
            println!("{}", serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?);
        }
        Cmd::Pin { vcpu, cpu } => {
            let cpu = match cpu.trim() {
                "none" => None,
                h => Some(h.parse::<u32>().map_err(|_| format!("--cpu {h}: not a host CPU number or none"))?),
            };
            c.pin(*vcpu, cpu).map_err(|e| e.to_string())?;
        }
        Cmd::Counters => {
            let v = c.counters().map_err(|e| e.to_string())?;
            println!("{}", serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?);
        }
        _ => unreachable!("not a client command"),
    }
    Ok(0)
}

/// Sets up tracing: the level from -v, else KUMO_LOG, else warn; to --log-file or stderr, in
/// colour only on a terminal.
fn init_logging(verbose: u8, log_file: Option<&std::path::Path>) -> Result<(), String> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = match (verbose, std::env::var("KUMO_LOG")) {
        (0, Ok(v)) if !v.trim().is_empty() => EnvFilter::try_new(&v).map_err(|e| format!("KUMO_LOG={v}: {e}"))?,
        (0, _) => EnvFilter::new("warn"),
        (1, _) => EnvFilter::new("info"),
        _ => EnvFilter::new("debug"),
    };
    let colour_ok = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match log_file {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("cannot open log file {}: {e}", p.display()))?;
            let ansi = colour_ok && f.is_terminal();
            builder.with_ansi(ansi).with_writer(std::sync::Mutex::new(f)).init();
        }
        None => {
            let ansi = colour_ok && std::io::stderr().is_terminal();
            builder.with_ansi(ansi).with_writer(std::io::stderr).init();
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // The VMM knows no guest programs: it checks an arriving VM's guest through kumo-guests.
    kumo_vmm::guest_program::set_guest_check(guest::check);
    if let Some(args) = ch::invoked_as_ch(&std::env::args_os().collect::<Vec<_>>()) {
        return exit(ch::main(args));
    }
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.verbose, cli.log_file.as_deref()) {
        note!("kumo: error: {e}");
        return ExitCode::from(1);
    }
    let not_applying = match cli.cmd {
        Cmd::Guests { .. } if cli.api_socket.is_some() => Some(("--api-socket", "guests")),
        Cmd::Lend(_) if cli.api_socket.is_some() => Some(("--api-socket", "lend (use --from and --to)")),
        Cmd::Return(_) if cli.api_socket.is_some() => Some(("--api-socket", "return (use --from and --to)")),
        Cmd::Bench { .. } if cli.api_socket.is_some() => Some(("--api-socket", "bench")),
        Cmd::Bench { .. } if cli.verbose > 0 => Some(("-v", "bench")),
        Cmd::Bench { .. } if cli.log_file.is_some() => Some(("--log-file", "bench")),
        Cmd::Run(_) | Cmd::NetBackend(_) => None,
        _ if cli.api_allow_uid.is_some() => {
            Some(("--api-allow-uid", "a client command (it applies to run and net-backend)"))
        }
        _ => None,
    };
    if let Some((flag, cmd)) = not_applying {
        note!("kumo: error: {flag} does not apply to `kumo {cmd}`");
        return ExitCode::from(2);
    }
    let allow = cli.api_allow_uid.map(|a| a.0);
    let r = match cli.cmd {
        Cmd::Run(a) => run(*a, cli.api_socket, allow, None),
        Cmd::Guests { json } => guests(json),
        Cmd::Bench { args } => bench(args),
        Cmd::Migrate(m) => migrate::run(m, cli.api_socket),
        Cmd::Lend(l) => lend::run(l, false),
        Cmd::Return(l) => lend::run(l, true),
        Cmd::NetBackend(a) => kumo_net_backend::cli::run(a, cli.api_socket, allow),
        ref c @ (Cmd::Info
        | Cmd::Pause
        | Cmd::Resume
        | Cmd::Shutdown
        | Cmd::Ping
        | Cmd::Snapshot { .. }
        | Cmd::ReceiveMigration { .. }
        | Cmd::Restore { .. }
        | Cmd::Pin { .. }
        | Cmd::Counters) => client_cmd(c, cli.api_socket),
    };
    exit(r)
}

fn exit(r: Result<i32, String>) -> ExitCode {
    match r {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            note!("kumo: error: {e}");
            ExitCode::from(1)
        }
    }
}
