//! `kumo-bench`: kumo's benchmarks, also reachable as `kumo bench ...`. Each prints a table and
//! writes JSON (and a plot) into `--out DIR`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kumo-bench", version, about = "kumo's benchmarks: print a table, write JSON into --out DIR")]
struct Cli {
    /// Directory for the results (created if missing).
    #[arg(long, global = true, value_name = "DIR", default_value = "target/kumo-bench")]
    out: PathBuf,
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// Start-up time of the `hello` guest (process start → guest entry → first serial output)
    /// against plain process start-up, and IPI round trip of `smp` against a VM-exit round
    /// trip; writes boot.json.
    Boot(kumo_bench::boot::Args),
    /// Live migration between kumo processes: throughput against raw loopback TCP, downtime,
    /// the dirty-page model, correctness, QEMU; writes migrate.json and migrate.png.
    Migrate(kumo_bench::migrate::Args),
    /// The NIC's interrupt paths (seed 000): host<->guest UDP round trips per path, unloaded and
    /// with interference, VM<->VM ping-pong, throughput against veth; writes net.json and net.png.
    Net(kumo_bench::net::Args),
    /// Synchronisation between vCPUs on each interrupt path (seed 003): semaphore hand-offs
    /// (spin, HLT+IPI, guest polling) on the userspace APIC, the in-kernel LAPIC and with KVM
    /// halt polling, xAPIC and x2APIC, and 1-vs-2-vCPU work; writes ipi.json and ipi.png.
    Ipi(kumo_bench::ipi::Args),
    /// NIC handover between running VMs (seed 001): packets lost and the outage when
    /// `kumo net-backend` moves the NIC A -> B under a UDP stream, against unplugging it and
    /// initialising B's driver from scratch; writes handover.json and handover.png.
    Handover(kumo_bench::handover::Args),
    /// Memory-bound kernel, bare metal vs VMs (issue 12): a STREAM triad and a CG-like sparse
    /// pass as a pinned host process and in VMs (vNUMA mirror, pinned, unpinned, PV hints off/on);
    /// writes numa.json and numa.png, ends with `vm_vs_bare=X unpinned_vs_bare=Y`.
    Numa(kumo_bench::numa::Args),
    /// Elastic sharing (issue 13): lend/return cycles of 1 CPU and of 128 MiB between two
    /// `worker` VMs, B's throughput before/after, against pausing/resuming a vCPU set, and the
    /// VMs' records checked for overlaps; then memory lent between two Linux guests through
    /// virtio-mem (needs the test kernel); writes lend.json and lend.png, ends with
    /// `cpu_lend_p99_ms=X mem_lend_p99_ms=Y overlaps=Z linux_mem_lend_p50_ms=A linux_mem_lend_p99_ms=B`.
    Lend(kumo_bench::lend::Args),
    /// The disk (issue 21): `blkbench` on kumo's virtio-blk (direct=on) against QEMU's
    /// virtio-blk-pci (cache=none, aio=io_uring and aio=threads) on the same raw image, alternating,
    /// plus the host's own I/O on the file (fio); writes disk.json and disk.png, ends with
    /// `rand4k_read_iops_ratio_qemu=X rand4k_write_iops_ratio_qemu=Y seq_read_mbps_ratio_host=Z p99_read_us=W`.
    Disk(kumo_bench::disk::Args),
    /// Host-side UDP tools of `net` (run inside network namespaces).
    #[command(hide = true)]
    NetTool(kumo_bench::net::tools::ToolArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.which {
        Which::Boot(a) => kumo_bench::boot::run(a, &cli.out),
        Which::Migrate(a) => kumo_bench::migrate::run(a, &cli.out),
        Which::Net(a) => kumo_bench::net::run(a, &cli.out),
        Which::Ipi(a) => kumo_bench::ipi::run(a, &cli.out),
        Which::Handover(a) => kumo_bench::handover::run(a, &cli.out),
        Which::Numa(a) => kumo_bench::numa::run(a, &cli.out),
        Which::Lend(a) => kumo_bench::lend::run(a, &cli.out),
        Which::Disk(a) => kumo_bench::disk::run(a, &cli.out),
        Which::NetTool(a) => kumo_bench::net::tools::run(a),
    };
    match r {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("kumo-bench: error: {e}");
            ExitCode::from(1)
        }
    }
}
