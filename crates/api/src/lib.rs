//! kumo's control API: HTTP/1.1 with JSON bodies over a unix domain socket,
//! in the style of Firecracker and Cloud Hypervisor (`/api/v1/...`).
//!
//! The server ([`ApiServer`]) knows nothing about KVM: it parses HTTP, maps
//! routes to [`ApiRequest`]s and hands them to the VMM's [`ApiHandler`]. The
//! client ([`ApiClient`]) is what `kumo` subcommands use to talk to a VM.
//! See docs/api.md for the wire protocol.

mod answers;
pub mod ch;
mod client;
mod error;
pub mod fds;
mod http;
pub mod migration;
pub mod net_backend;
mod server;

pub use answers::{Counters, Exits, Interrupts, LendReport, MigrationBytes, RestoreReport, SnapshotReport};
pub use ch::{ChDeviceNode, ChVmConfig, ChVmInfo, ChVmState, Pong};
pub use client::{ApiClient, ClientError, DEFAULT_CLIENT_TIMEOUT};
pub use error::{ApiError, ErrorBody, ErrorKind};
pub use fds::Fds;
pub use migration::{
    DryRunReport, Event, MigrationLine, MigrationResult, MigrationState, MigrationStatus, ModelReport, PhaseTimes,
    RecvPhase, RecvStatus, Report, RoundReport, SendReport, StopPhaseTimes,
};
pub use net_backend::{BackendClient, BackendInfo, HandoverReport, HandoverRequest};
pub use server::{routes, ApiHandler, ApiServer, ApiServerHandle, BoundApi, ServerError, Service};

use serde::{Deserialize, Serialize};

/// Version reported by `vmm.ping` and `vm.info`.
pub const KUMO_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The Cloud Hypervisor release whose API and command line kumo answers as
/// (`cloud-hypervisor --version`, `vmm.ping`'s `version`); docs/ch-compat.md says why this one.
pub const CH_COMPAT_VERSION: &str = "28.0.0";

/// Route paths, shared by the server's route table and the client.
pub mod paths {
    pub const PING: &str = "/api/v1/vmm.ping";
    pub const INFO: &str = "/api/v1/vm.info";
    pub const PAUSE: &str = "/api/v1/vm.pause";
    pub const RESUME: &str = "/api/v1/vm.resume";
    pub const SHUTDOWN: &str = "/api/v1/vm.shutdown";
    /// Cloud Hypervisor's name for it (it was `vm.migrate`).
    pub const MIGRATE: &str = "/api/v1/vm.send-migration";
    pub const MIGRATION: &str = "/api/v1/vm.migration";
    pub const SNAPSHOT: &str = "/api/v1/vm.snapshot";
    pub const COUNTERS: &str = "/api/v1/vm.counters";
    pub const CANCEL_MIGRATION: &str = "/api/v1/vm.cancel-migration";
    pub const MIGRATION_EVENTS: &str = "/api/v1/vm.migration-events";
    /// Cloud Hypervisor's name: an empty VMM starts listening for a migrating VM.
    pub const RECEIVE_MIGRATION: &str = "/api/v1/vm.receive-migration";
    /// An empty VMM runs the VM saved in a snapshot file.
    pub const RESTORE: &str = "/api/v1/vm.restore";
    /// Re-pins (or unpins) one vCPU to a host CPU.
    pub const PIN: &str = "/api/v1/vm.pin";
    /// Cloud Hypervisor's name: the guest gives vCPUs up (ACPI eject) or takes them back.
    pub const RESIZE: &str = "/api/v1/vm.resize";
    /// Elastic sharing (`--elastic`): the VM gives host CPUs and memory up (its guest confirms).
    pub const RELEASE: &str = "/api/v1/vm.release";
    /// Elastic sharing: the VM takes host CPUs and memory another VM released.
    pub const ACQUIRE: &str = "/api/v1/vm.acquire";
    /// Elastic sharing: what the VM holds, its guest's progress, and its record of changes.
    pub const ELASTIC: &str = "/api/v1/vm.elastic";
    /// Elastic sharing: this VM lends to (or returns to) another VM, both steps or neither.
    pub const LEND: &str = "/api/v1/vm.lend";
    /// Cloud Hypervisor's name: ask a memory zone's virtio-mem driver for a new size.
    pub const RESIZE_ZONE: &str = "/api/v1/vm.resize-zone";
    /// Cloud Hypervisor's: an empty VMM takes a VM's config (CH's `VmConfig`).
    pub const CREATE: &str = "/api/v1/vm.create";
    /// Cloud Hypervisor's: boots the created VM.
    pub const BOOT: &str = "/api/v1/vm.boot";
    /// Cloud Hypervisor's: forgets the created VM (a running one is shut down).
    pub const DELETE: &str = "/api/v1/vm.delete";
    /// Cloud Hypervisor's: reboots the VM (kumo: not supported, 501).
    pub const REBOOT: &str = "/api/v1/vm.reboot";
    /// Cloud Hypervisor's: presses the VM's ACPI power button.
    pub const POWER_BUTTON: &str = "/api/v1/vm.power-button";
    /// Cloud Hypervisor's: the VMM process ends (its VM, if any, shut down).
    pub const VMM_SHUTDOWN: &str = "/api/v1/vmm.shutdown";
    /// Cloud Hypervisor's: a disk added to the created VM (cold plug; no hot-plug in kumo).
    pub const ADD_DISK: &str = "/api/v1/vm.add-disk";
    /// Cloud Hypervisor's: a NIC (a tap by name) added to the created VM (cold plug).
    pub const ADD_NET: &str = "/api/v1/vm.add-net";
    /// Cloud Hypervisor's: a disk or NIC removed from the created VM (cold unplug).
    pub const REMOVE_DEVICE: &str = "/api/v1/vm.remove-device";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Created,
    /// A destination (`kumo run --incoming`): the VM is arriving by migration.
    Receiving,
    Running,
    Paused,
    Shutdown,
}

/// Body of `GET /api/v1/vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    pub state: VmState,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// What the VM boots, e.g. "guest:hello" or "kernel:/path/to/bzImage".
    pub guest: String,
    /// "kernel" (in-kernel irqchip) or "split".
    pub irqchip: String,
    pub pid: u32,
    pub uptime_ms: u64,
    pub kumo_version: String,
    /// The VM's NICs, net0 first.
    #[serde(default)]
    pub net: Vec<NetInfo>,
    /// The VM's virtio-blk disks, disk0 first.
    #[serde(default)]
    pub disks: Vec<DiskInfo>,
    /// The guest's NUMA nodes (`--numa`), node 0 first; empty without them.
    #[serde(default)]
    pub numa: Vec<NumaNodeInfo>,
    /// Each vCPU's host CPU as its thread's affinity reads (`null`: it floats), vCPU 0 first.
    #[serde(default)]
    pub vcpu_pins: Vec<Option<u32>>,
    /// The vCPUs whose threads wait in kumo (ejected by the guest, or an elastic VM's spares).
    #[serde(default)]
    pub parked_vcpus: Vec<u32>,
    /// The KVM paravirtual features the guest's CPUID offers (`--pv`, resolved); absent before
    /// a VM exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv: Option<PvInfo>,
    /// The VM's memory zones (`--memory-zone`, one virtio-mem device each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_zones: Vec<MemoryZoneInfo>,
    /// Guest RAM is private anonymous memory (the default), not the shareable memfd
    /// (`--shared-memory`).
    #[serde(default)]
    pub memory_private: bool,
}

/// A memory zone in [`VmInfo`]: its virtio-mem region, and how much of it the host asks the
/// guest to plug (`requested_size`) and the guest has plugged (`plugged_size`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryZoneInfo {
    pub id: String,
    /// The guest NUMA node.
    pub node: u32,
    /// Guest-physical start and size of its hotplug region.
    pub addr: u64,
    pub region_size: u64,
    pub block_size: u64,
    pub plugged_size: u64,
    pub requested_size: u64,
    pub pci: String,
    /// Whether the guest's driver has set it up (DRIVER_OK).
    pub driver_ok: bool,
    /// Requests the driver made, refused, and the host's failures.
    pub plugs: u64,
    pub unplugs: u64,
    pub nacks: u64,
    pub errors: u64,
}

/// Body of `PUT /api/v1/vm.resize-zone` (Cloud Hypervisor's shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeZoneRequest {
    /// The zone's id (`mem0`, or its `id=`).
    pub id: String,
    /// Bytes the guest should have plugged: whole blocks, at most the zone's hotplug size.
    pub desired_size: u64,
}

/// The paravirtual features in [`VmInfo`]: each on or off as the guest's CPUID leaf
/// 0x40000001 has it (docs/pv-features.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PvInfo {
    pub steal_time: bool,
    pub pv_unhalt: bool,
    pub tlb_flush: bool,
    pub poll_control: bool,
    pub pv_ipi: bool,
    /// `KVM_HINTS_REALTIME`: the vCPUs are dedicated.
    pub realtime: bool,
}

/// A guest NUMA node in [`VmInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNodeInfo {
    /// Node id, its ACPI proximity domain.
    pub id: u32,
    /// Its vCPUs.
    pub cpus: Vec<u32>,
    pub memory_bytes: u64,
    /// The host node its memory is bound to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    /// Its distance to each node, node 0 first (its SLIT row).
    pub distances: Vec<u8>,
}

/// A NIC in [`VmInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetInfo {
    /// `net0`, `net1`, ...: its name in snapshots.
    pub id: String,
    /// The host tap it is attached to; empty for a NIC a vhost-user backend serves.
    pub tap: String,
    pub mac: String,
    /// Queue pairs.
    pub queues: u16,
    /// Its interrupt path: `direct`, `dedicated` (to `vcpu`) or `shared`.
    pub irq: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu: Option<u32>,
    /// Its PCI address, e.g. `0000:00:01.0`.
    pub pci: String,
    /// The guest's driver has it running (virtio DRIVER_OK).
    pub driver_ok: bool,
    /// The offloads the driver accepted (`csum`, `host_tso4`, `guest_uso4`, ...: virtio-net's
    /// feature names, lower case), none before DRIVER_OK.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub offloads: Vec<String>,
    /// Frames are counted only by a NIC kumo serves itself (a tap); a vhost-user NIC counts
    /// its interrupts alone.
    pub counters: NetCounters,
    /// Set for a NIC whose queues a vhost-user backend serves (`--net vhost-user=PATH`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_user: Option<VhostUserInfo>,
}

/// A vhost-user NIC's connection to its backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostUserInfo {
    /// The backend's unix socket.
    pub socket: String,
    /// The backend is connected (false once it hung up; kumo does not reconnect).
    pub connected: bool,
    /// The link status the guest reads: connected and, if the backend reports a status, up.
    pub link_up: bool,
    /// Virtio features the backend offered (GET_FEATURES).
    pub features: u64,
    /// vhost-user protocol features negotiated.
    pub protocol_features: u64,
    /// Config changes the backend announced (CONFIG_CHANGE_MSG).
    pub config_changes: u64,
}

/// A NIC's frame counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Frames the guest gave no (or too small) buffers for, or a bad chain.
    pub rx_dropped: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
    /// Interrupts it raised.
    pub interrupts: u64,
}

/// A virtio-blk disk in [`VmInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskInfo {
    pub id: String,
    /// The raw image file.
    pub path: String,
    /// Bytes.
    pub size: u64,
    pub readonly: bool,
    /// O_DIRECT (`direct=on`).
    pub direct: bool,
    pub serial: String,
    /// Request queues and each one's size.
    pub queues: u16,
    pub queue_size: u16,
    /// "io_uring" or "threads".
    pub backend: String,
    /// Its PCI address, e.g. 0000:00:03.0, and its slot (device number) on bus 0.
    pub pci: String,
    pub slot: u8,
    /// Whether the guest's driver has set it up (DRIVER_OK).
    pub driver_ok: bool,
    pub counters: DiskCounters,
}

/// A disk's request counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCounters {
    /// Requests the guest made (every kind).
    pub requests: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    /// Requests answered IOERR: bad requests and the host's I/O errors.
    pub errors: u64,
    /// Of those, the host's I/O errors.
    pub host_errors: u64,
    /// Requests answered UNSUPP.
    pub unsupported: u64,
    /// Interrupts it raised.
    pub interrupts: u64,
}

/// What a client asked for, decoded from method + path (+ JSON body).
/// Routes with a body add a variant carrying its deserialized type, e.g.
/// `Migrate(MigrateConfig)`, plus one line in the server's route table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiRequest {
    Ping,
    Info,
    Pause,
    Resume,
    Shutdown,
    /// Migrate the VM (or, with `dry_run`, only estimate the migration).
    Migrate(MigrateRequest),
    /// Progress events and result of the current or last migration.
    MigrationStatus,
    /// Cancel the running migration; the VM runs on here.
    CancelMigration,
    /// The migration's events as JSON lines, streamed until it ends.
    MigrationEvents,
    /// Write the VM to a file (paused meanwhile).
    Snapshot(SnapshotRequest),
    /// vCPU exits, assists, interrupts and migration bytes so far.
    Counters,
    /// An empty VMM: listen for a migrating VM and run it once it has arrived.
    ReceiveMigration(ReceiveMigrationRequest),
    /// An empty VMM: run the VM saved in a snapshot file.
    Restore(RestoreRequest),
    /// Pin one vCPU to a host CPU, or unpin it.
    Pin(PinRequest),
    /// Change how many vCPUs the guest has (ACPI CPU hotplug).
    Resize(ResizeRequest),
    /// Give host CPUs and memory up (elastic sharing).
    Release(ReleaseRequest),
    /// Take host CPUs and memory another VM gave up (elastic sharing).
    Acquire(AcquireRequest),
    /// What an elastic VM holds, and its record of changes.
    Elastic,
    /// Lend to another VM (or return to it), with rollback.
    Lend(LendApiRequest),
    /// Set a memory zone's requested size (virtio-mem).
    ResizeZone(ResizeZoneRequest),
    /// An empty VMM: take this config (CH's `vm.create`), checked by the route.
    Create(Box<ChVmConfig>),
    /// Boot the created VM.
    Boot,
    /// Forget the created VM, or shut the running one down.
    Delete,
    /// Reboot the VM.
    Reboot,
    /// Press the ACPI power button.
    PowerButton,
    /// End the VMM process.
    VmmShutdown,
    /// Add a disk to the created VM (checked by the route).
    AddDisk(Box<ch::ChDisk>),
    /// Add a NIC to the created VM (checked by the route).
    AddNet(Box<ch::ChNet>),
    /// Remove a device from the created VM.
    RemoveDevice(ch::ChRemoveDevice),
    /// `kumo net-backend`: its tap, owner, clients and counters.
    BackendInfo,
    /// `kumo net-backend`: hand the NIC to another client.
    Handover(HandoverRequest),
}

/// Body of `PUT /api/v1/vm.lend`: `kumo lend` run by this VM's VMM, this VM giving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LendApiRequest {
    /// The API socket of the VM that takes.
    pub to: String,
    #[serde(default)]
    pub cpus: u32,
    #[serde(default)]
    pub memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// A return: give back only what this VM borrowed from `to`.
    #[serde(default, rename = "return")]
    pub returning: bool,
    #[serde(default = "elastic_timeout")]
    pub timeout_ms: u64,
}

/// How long a VM waits for its guest to confirm an elastic request, by default.
pub const ELASTIC_TIMEOUT_MS: u64 = 1000;

fn elastic_timeout() -> u64 {
    ELASTIC_TIMEOUT_MS
}

/// Body of `PUT /api/v1/vm.release`: what the VM gives up. Its guest is asked first and must
/// confirm within `timeout_ms`; otherwise nothing changes (the request fails with 504).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// How many host CPUs (kumo picks them), unless `host_cpus` names them.
    #[serde(default)]
    pub cpus: u32,
    /// Exactly these host CPUs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_cpus: Vec<u32>,
    /// Bytes of elastic memory (whole blocks), from guest node `node` (default: the node
    /// holding the most).
    #[serde(default)]
    pub memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// A return: only what this VM borrowed from `to`. Without it, only the VM's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default = "elastic_timeout")]
    pub timeout_ms: u64,
}

/// Memory one VM released, for another to acquire: `bytes` of guest node `node` of the
/// releasing VM, whose memory lived on host node `host_node` (if bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryGrant {
    pub bytes: u64,
    pub node: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
}

/// Answer to `vm.release`: what is now free (held by no VM).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Released {
    pub host_cpus: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryGrant>,
    /// Whom the released resources had been borrowed from (a return), if anyone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lender: Option<String>,
    /// Milliseconds until the guest confirmed, and in all (parking, discarding pages).
    pub guest_ms: f64,
    pub total_ms: f64,
}

/// Body of `PUT /api/v1/vm.acquire`: host CPUs and memory another VM released.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_cpus: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryGrant>,
    /// Who lends them (recorded, so that `vm.release` with `to` can give them back); none:
    /// they are the VM's own again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default = "elastic_timeout")]
    pub timeout_ms: u64,
}

impl Default for ReleaseRequest {
    fn default() -> Self {
        ReleaseRequest {
            cpus: 0,
            host_cpus: Vec::new(),
            memory_bytes: 0,
            node: None,
            to: None,
            timeout_ms: ELASTIC_TIMEOUT_MS,
        }
    }
}

impl Default for AcquireRequest {
    fn default() -> Self {
        AcquireRequest { host_cpus: Vec::new(), memory: None, from: None, timeout_ms: ELASTIC_TIMEOUT_MS }
    }
}

/// Answer to `vm.acquire`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Acquired {
    /// The vCPUs now running on the acquired host CPUs, in the same order.
    pub vcpus: Vec<u32>,
    /// The guest node that got the memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// Milliseconds until the guest confirmed (its new vCPUs did work, its new memory is in
    /// use), and in all.
    pub guest_ms: f64,
    pub total_ms: f64,
}

/// Body of `GET /api/v1/vm.elastic`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ElasticInfo {
    pub block_bytes: u64,
    pub vcpus: Vec<ElasticVcpu>,
    pub nodes: Vec<ElasticNode>,
    /// Work units the guest reports per vCPU (its `worker` counts them), vCPU 0 first.
    pub progress: Vec<u64>,
    /// Every change of what the VM holds, oldest first (the first ones: what it held at boot).
    pub events: Vec<ElasticEvent>,
}

/// A vCPU in [`ElasticInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElasticVcpu {
    pub vcpu: u32,
    /// The host CPU it holds; none while parked (or for vCPU 0, which floats and is never lent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<u32>,
    pub parked: bool,
    /// Whom its host CPU is borrowed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lender: Option<String>,
}

/// A guest node's elastic memory in [`ElasticInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElasticNode {
    pub node: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    /// Its elastic area: guest-physical start and size.
    pub base: u64,
    pub area_bytes: u64,
    /// How much of it the guest may use now, and how much of that is borrowed (by lender).
    pub plugged_bytes: u64,
    #[serde(default)]
    pub borrowed: std::collections::BTreeMap<String, u64>,
}

/// One change in [`ElasticInfo::events`]. Times are CLOCK_MONOTONIC nanoseconds, comparable
/// between VMs on one host. An acquisition is recorded before the VM can use what it took,
/// a release after it can no longer use it: two VMs' records overlap only if they really did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElasticEvent {
    pub t_ns: u64,
    pub kind: ElasticEventKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    #[serde(default)]
    pub bytes: u64,
    /// What the VM held from the start (its share of the pool the VMs lend among themselves).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub at_boot: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ElasticEventKind {
    CpuAcquired,
    CpuReleased,
    MemAcquired,
    MemReleased,
}

/// Body of `PUT /api/v1/vm.pin`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinRequest {
    pub vcpu: u32,
    /// The host CPU it may run on from now; `null`: unpinned, it floats.
    pub cpu: Option<u32>,
}

/// Body of `PUT /api/v1/vm.resize` (Cloud Hypervisor's shape; kumo resizes vCPUs only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// vCPUs the guest keeps (vCPU 0 up to this count, exclusive): the higher ones are ejected
    /// through ACPI and their threads parked in kumo; ejected ones below it are given back.
    pub desired_vcpus: u32,
    /// How long to wait for the guest's answer (its `_EJ0` for a removal, its scan of the
    /// hotplug registers for an addition).
    #[serde(default = "resize_timeout")]
    pub timeout_ms: u64,
}

/// How long `vm.resize` waits for the guest, by default: Linux offlines a CPU before it ejects
/// it, which takes seconds where ring-0 code is emulated.
pub const RESIZE_TIMEOUT_MS: u64 = 60_000;

fn resize_timeout() -> u64 {
    RESIZE_TIMEOUT_MS
}

/// Body of `PUT /api/v1/vm.receive-migration` (Cloud Hypervisor's field name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveMigrationRequest {
    /// Where to listen: `tcp:HOST:PORT` or `unix:PATH`.
    pub receiver_url: String,
    /// Only a VM of this many bytes of memory is taken; it is allocated and faulted in before
    /// listening (`kumo run --incoming --memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Prepare `memory` as a memfd (`--shared-memory`) instead of private memory, kumo's
    /// default: a VM that will move on with the `local` engine needs it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_memory: bool,
    /// Only a VM with this many vCPUs is taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    /// The host backend of each NIC of the arriving VM, by id (`kumo run --incoming --net`).
    /// Every NIC the VM has needs one; a VM with others is refused. Neither `net` nor `disks`
    /// given (Cloud Hypervisor's body): the VM keeps its source's taps and images by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<NicBackend>,
    /// The host node of each guest NUMA node of the arriving VM (`--numa`); none given: the
    /// nodes' memory is not bound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NodeBinding>,
    /// The image of each disk of the arriving VM, by id (`--disk id=disk0,path=FILE`). Every
    /// disk the VM has needs one, of the size the VM's disk had.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskPath>,
    /// Mutual TLS (`tcp:` only): a directory on the VMM's host holding `ca.pem`, `cert.pem`
    /// and `key.pem`; a source must present a certificate signed by `ca.pem`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<String>,
    /// Listen in plain TCP on a non-loopback address (a trusted network): without it or
    /// `tls_dir`, only loopback addresses are taken.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

/// Body of `PUT /api/v1/vm.restore` (Cloud Hypervisor's field name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// The snapshot file: `file:///abs/path` or `/abs/path`.
    pub source_url: String,
    /// As in [`ReceiveMigrationRequest`]: the host backend of each of the VM's NICs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<NicBackend>,
    /// As in [`ReceiveMigrationRequest`]: the host node of each guest NUMA node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NodeBinding>,
    /// As in [`ReceiveMigrationRequest`]: the image of each disk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskPath>,
    /// CH's `net_fds`: NICs restored on taps whose descriptors came with the request
    /// (SCM_RIGHTS), shared out in this order, `num_fds` each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_fds: Vec<RestoredNetFds>,
}

/// One entry of `vm.restore`'s `net_fds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoredNetFds {
    /// The VM's NIC: `net0`, `net1`, …
    pub id: String,
    /// How many of the request's descriptors are this NIC's (one per queue pair).
    #[serde(default)]
    pub num_fds: usize,
    /// CH's placeholders (ignored); the descriptors' numbers here once taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fds: Option<Vec<i32>>,
    /// The descriptors themselves.
    #[serde(skip)]
    pub tap_fds: Fds,
}

impl RestoreRequest {
    /// Shares the request's descriptors out over `net_fds`: as many in all as they ask for.
    fn take_fds(&mut self, mut fds: Vec<std::os::fd::OwnedFd>) -> Result<(), ApiError> {
        let wanted: usize = self.net_fds.iter().map(|n| n.num_fds).sum();
        if fds.len() != wanted {
            return Err(ApiError::bad_request(format!(
                "vm.restore: `net_fds` asks for {wanted} file descriptors in all but {} came with the request",
                fds.len()
            )));
        }
        for n in &mut self.net_fds {
            n.tap_fds = Fds::split_first(&mut fds, n.num_fds);
            n.fds = Some(n.tap_fds.raw());
        }
        Ok(())
    }
}

impl ApiRequest {
    /// Hands the descriptors that came with the request (SCM_RIGHTS) to its body; a route that
    /// takes none refuses them (they are closed).
    pub(crate) fn with_fds(mut self, fds: Vec<std::os::fd::OwnedFd>) -> Result<ApiRequest, ApiError> {
        match &mut self {
            ApiRequest::AddNet(n) => ch::add_net_fds(n, fds)?,
            ApiRequest::Create(c) => ch::create_fds(c, fds)?,
            ApiRequest::Restore(r) => r.take_fds(fds)?,
            _ if fds.is_empty() => {}
            _ => {
                return Err(ApiError::bad_request(format!(
                    "this route takes no file descriptors ({} came with the request; closed)",
                    fds.len()
                )))
            }
        }
        Ok(self)
    }
}

/// What a destination (or a restore) gives one disk of the arriving VM: its image here. What
/// the guest sees of the disk (size, read-only, serial, queues) comes from the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskPath {
    /// The VM's disk: `disk0`, … or the id its operator gave.
    pub id: String,
    /// The raw image file on this host.
    pub path: String,
}

/// What a destination (or a restore) gives one NIC of the arriving VM: the host side only.
/// The guest-visible NIC (MAC, queues, interrupt path, PCI slot) comes from the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicBackend {
    /// The VM's NIC: `net0`, `net1`, … in PCI slot order.
    pub id: String,
    /// An existing host tap (a tap NIC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
    /// The socket of a vhost-user-net backend (a vhost-user NIC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_user: Option<String>,
}

/// What a destination (or a restore) gives one guest NUMA node of the arriving VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeBinding {
    /// The guest node's id.
    pub node: u32,
    /// The host node its memory is bound to; none: not bound (the host's policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
}

/// Body of `PUT /api/v1/vm.snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// Absolute path of the file to write (replaced if it exists).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path: String,
    /// Cloud Hypervisor's form instead of `path`: `file:///DIR`, an existing directory; kumo
    /// writes the file `DIR/kumo-snapshot` in it (which `vm.restore` of the directory reads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_url: Option<String>,
}

/// How a migration moves pages (see docs/migration.md, "Engines"): one enum, defined in the
/// pure migration crate.
pub use kumo_migration::MigrationEngine;

/// Body of `PUT /api/v1/vm.send-migration`. `MigrateRequest::to(addr)` has every option at
/// its default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// Destination: `tcp:HOST:PORT` or `unix:PATH` of a `kumo run --incoming`. Cloud
    /// Hypervisor's name for it, `destination_url`, is taken too.
    #[serde(alias = "destination_url")]
    pub to: String,
    /// Default `zerocopy`, or `overlap` with `tls_dir`.
    #[serde(default)]
    pub engine: Option<MigrationEngine>,
    /// Stop pre-copy once the rest fits this downtime (ms). A request that names no stop rule
    /// (neither this nor `xen`) gets Xen's rule beside a 50 ms target.
    #[serde(default)]
    pub downtime_ms: Option<u64>,
    /// Apply Xen's stop rule (≤ 50 dirty pages, 30 rounds, 3x pages): default true unless
    /// `downtime_ms` is given. `true` without `downtime_ms`: Xen's rule alone.
    #[serde(default)]
    pub xen: Option<bool>,
    /// Parallel connections: default 4 for overlap and zerocopy, 1 for serial and local.
    #[serde(default)]
    pub connections: Option<usize>,
    /// Only observe the guest's dirtying for `estimate_ms` and predict the migration.
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default)]
    pub estimate_ms: Option<u64>,
    /// Dry run only: measure this host's loopback TCP (64 MiB sent to itself) and predict at
    /// that bandwidth. Without it the prediction assumes 1 GB/s and nothing is sent.
    #[serde(default)]
    pub measure_link: bool,
    /// Give up when the destination takes no data or does not answer for this long (ms);
    /// the source then runs on. Default 15,000.
    #[serde(default)]
    pub progress_timeout_ms: Option<u64>,
    /// Make `downtime_ms` a promise: fail the migration (the VM runs on here) rather than
    /// exceed it. Without it, a guest that does not converge is throttled and then stopped
    /// anyway, with the overshoot reported.
    #[serde(default)]
    pub strict: Option<bool>,
    /// Cap on the page data sent, bytes per second.
    #[serde(default)]
    pub max_bandwidth: Option<u64>,
    /// Mutual TLS (`tcp:` only; not with the zerocopy engine): a directory on the VMM's host
    /// holding `ca.pem`, `cert.pem` and `key.pem`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<String>,
    /// The name the destination's certificate must carry; default: the host of `to`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
}

impl MigrateRequest {
    /// A migration to `addr` with every option at its default.
    pub fn to(addr: impl Into<String>) -> MigrateRequest {
        MigrateRequest { to: addr.into(), ..MigrateRequest::default() }
    }
}

/// What the handler answers on success: one typed answer per route, serialized only by the
/// server.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiResponse {
    /// 204 No Content.
    Ok,
    /// 200 with CH's ping body plus `kumo_version`.
    Pong(Pong),
    /// 200 with CH's `vm.info` (kumo's [`VmInfo`] under `kumo`).
    Info(Box<ChVmInfo>),
    /// `vm.migration`, and `vm.send-migration` once the migration ended.
    Migration(Box<MigrationStatus>),
    Snapshot(SnapshotReport),
    Restore(RestoreReport),
    Counters(Box<Counters>),
    Released(Released),
    Acquired(Acquired),
    Elastic(ElasticInfo),
    Lent(Box<LendReport>),
    /// `kumo net-backend`'s `backend.info`.
    BackendInfo(BackendInfo),
    Handover(HandoverReport),
    /// 200 with JSON lines written as they come, until the producer ends; the connection
    /// closes after it (the body ends there).
    Stream(JsonLines),
}

/// The producer of a streamed answer (`vm.migration-events`): called once with a sink that
/// writes one line and says whether to go on (false: the client left or the server stops).
#[derive(Clone)]
pub struct JsonLines(std::sync::Arc<LineProducer>);

/// Writes lines through the sink it is given until it is done or the sink says stop.
pub type LineProducer = dyn Fn(&mut dyn FnMut(&MigrationLine) -> bool) + Send + Sync;

impl JsonLines {
    pub fn new(f: impl Fn(&mut dyn FnMut(&MigrationLine) -> bool) + Send + Sync + 'static) -> Self {
        JsonLines(std::sync::Arc::new(f))
    }

    pub fn run(&self, sink: &mut dyn FnMut(&MigrationLine) -> bool) {
        (self.0)(sink)
    }
}

impl std::fmt::Debug for JsonLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JsonLines")
    }
}

// A producer is equal only to itself.
impl PartialEq for JsonLines {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl ApiResponse {
    /// Status and JSON body on the wire: the one place answers are serialized.
    pub(crate) fn into_http(self) -> Result<(u16, Option<String>), ApiError> {
        let body = match self {
            ApiResponse::Ok => return Ok((204, None)),
            ApiResponse::Stream(_) => return Err(ApiError::internal("a streamed answer has no single body")),
            ApiResponse::Pong(a) => to_json(&a),
            ApiResponse::Info(a) => to_json(&a),
            ApiResponse::Migration(a) => to_json(&a),
            ApiResponse::Snapshot(a) => to_json(&a),
            ApiResponse::Restore(a) => to_json(&a),
            ApiResponse::Counters(a) => to_json(&a),
            ApiResponse::Released(a) => to_json(&a),
            ApiResponse::Acquired(a) => to_json(&a),
            ApiResponse::Elastic(a) => to_json(&a),
            ApiResponse::Lent(a) => to_json(&a),
            ApiResponse::BackendInfo(a) => to_json(&a),
            ApiResponse::Handover(a) => to_json(&a),
        };
        Ok((200, Some(body?)))
    }
}

pub(crate) fn to_json<T: Serialize + ?Sized>(v: &T) -> Result<String, ApiError> {
    serde_json::to_string(v).map_err(|e| ApiError::internal(format!("cannot encode response: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_serializes_lowercase() {
        assert_eq!(serde_json::to_string(&VmState::Paused).unwrap(), "\"paused\"");
        assert_eq!(serde_json::from_str::<VmState>("\"shutdown\"").unwrap(), VmState::Shutdown);
    }

    #[test]
    fn responses_on_the_wire() {
        assert_eq!(ApiResponse::Ok.into_http(), Ok((204, None)));
        let (status, body) = ApiResponse::Pong(Pong::here()).into_http().unwrap();
        let v: serde_json::Value = serde_json::from_str(&body.unwrap()).unwrap();
        assert_eq!((status, &v["kumo_version"], &v["version"]), (200, &KUMO_VERSION.into(), &CH_COMPAT_VERSION.into()));
    }

    #[test]
    fn migration_lines_read_back_as_events_then_the_end() {
        let ev = MigrationLine::Event(Event::Cancelled);
        let end = MigrationLine::End(MigrationStatus {
            state: MigrationState::Cancelled,
            events: Vec::new(),
            report: None,
            error: None,
            received: None,
        });
        for line in [ev, end] {
            let text = serde_json::to_string(&line).unwrap();
            assert_eq!(serde_json::from_str::<MigrationLine>(&text).unwrap(), line, "{text}");
        }
    }
}
