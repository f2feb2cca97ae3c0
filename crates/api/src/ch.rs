//! Cloud Hypervisor's API shapes (docs/ch-compat.md): `vm.create`'s `VmConfig` in both the
//! current form (`payload`) and the older one libvirt 9.0 sends (`kernel`, `cmdline`,
//! `initramfs`), `vmm.ping`'s and `vm.info`'s answers.
//!
//! CH clients add fields every release, so nothing here denies unknown fields: each struct
//! keeps what it does not type in `extra`, and [`ChVmConfig::check`] sorts every field kumo
//! sees into supported (typed and mapped by the VMM), ignored (listed, harmless) or refused
//! (a 400 naming it). A null or default value of a field kumo lacks is taken as absent.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use crate::ApiError;

/// Fields a struct does not type, by name.
pub type Extra = BTreeMap<String, Value>;

/// CH's `VmConfig` (the body of `vm.create`, and `config` in `vm.info`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChVmConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<ChCpus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<ChMemory>,
    /// The current form of what to boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<ChPayload>,
    /// The older form (before CH v28, libvirt 9.0): `kernel{path}`, `cmdline{args}`,
    /// `initramfs{path}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<ChPath>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<ChCmdline>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<ChPath>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Vec<ChDisk>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<Vec<ChNet>>,
    /// The legacy serial port (kumo's COM1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<ChConsole>,
    /// CH's virtio-console (kumo has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console: Option<ChConsole>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChCpus {
    #[serde(default = "one")]
    pub boot_vcpus: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_vcpus: Option<u32>,
    #[serde(flatten)]
    pub extra: Extra,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChMemory {
    /// Bytes.
    pub size: u64,
    /// The shareable memfd (kumo's `--shared-memory`) instead of private memory; false is
    /// kumo's choice (private, unless a vhost-user NIC needs the memfd).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChPayload {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `{"path": ...}` (the older `kernel` and `initramfs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChPath {
    pub path: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `{"args": ...}` (the older `cmdline`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChCmdline {
    pub args: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChDisk {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub direct: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChNet {
    /// An existing host tap, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Queues (CH counts both directions: 2 is one pair).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u16>,
    #[serde(default)]
    pub vhost_user: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vhost_socket: Option<String>,
    /// CH's `fds`: one entry per descriptor of the tap, which the client opened and sent with
    /// the request (SCM_RIGHTS). A body's numbers are placeholders (libvirt sends -1), never
    /// used; `vm.info` shows the descriptors' numbers in kumo, as CH shows its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fds: Option<Vec<i32>>,
    /// The descriptors themselves, from the request's ancillary data.
    #[serde(skip)]
    pub tap_fds: crate::Fds,
    /// CH's checksum and TCP segmentation offloads (default on): kumo turns a tap NIC's
    /// offloads on or off as a whole, off if either is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_tso: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_csum: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// "N descriptor(s)".
fn count(n: usize) -> String {
    format!("{n} file descriptor{}", if n == 1 { "" } else { "s" })
}

impl ChNet {
    /// How many descriptors its body's `fds` lists.
    fn listed_fds(&self) -> usize {
        self.fds.as_ref().map_or(0, Vec::len)
    }

    /// Takes `fds` as its tap's descriptors.
    fn take_fds(&mut self, fds: crate::Fds) {
        self.fds = (!fds.is_empty()).then(|| fds.raw());
        self.tap_fds = fds;
    }
}

fn no_fds_came(route: &str, at: &str, listed: usize) -> ApiError {
    ApiError::bad_request(format!(
        "{route}: `{at}fds` lists {} but none came with the request: send the tap's descriptors with it (SCM_RIGHTS)",
        count(listed)
    ))
}

/// `vm.add-net`: every descriptor that came with the request is the NIC's (CH's rule), in
/// order, one per queue pair.
pub(crate) fn add_net_fds(n: &mut ChNet, fds: Vec<std::os::fd::OwnedFd>) -> Result<(), ApiError> {
    if fds.is_empty() && n.listed_fds() > 0 {
        return Err(no_fds_came("vm.add-net", "", n.listed_fds()));
    }
    n.take_fds(crate::Fds::new(fds));
    Ok(())
}

/// `vm.create` (kumo's rule; CH takes none here): the descriptors go, in order, to the `net[]`
/// entries whose `fds` lists some, each taking as many as its list has entries.
pub(crate) fn create_fds(c: &mut ChVmConfig, mut fds: Vec<std::os::fd::OwnedFd>) -> Result<(), ApiError> {
    let listed: usize = c.net.iter().flatten().map(ChNet::listed_fds).sum();
    if fds.len() != listed {
        return Err(ApiError::bad_request(format!(
            "vm.create: `net[].fds` list {} in all but {} came with the request",
            count(listed),
            fds.len()
        )));
    }
    for n in c.net.iter_mut().flatten().filter(|n| n.listed_fds() > 0) {
        let take = n.listed_fds();
        n.take_fds(crate::Fds::split_first(&mut fds, take));
    }
    Ok(())
}

/// `serial` and `console`: `{mode: Off|Null|Tty|Pty|File|Socket, file, socket}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChConsole {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// What kumo does with a field it does not map.
enum Verdict {
    /// Harmless to ignore (listed in docs/ch-compat.md and in the answer's `ignored`).
    Ignore,
    /// Refused with the reason, unless the value is null or the field's default.
    Refuse(&'static str),
}

use Verdict::{Ignore, Refuse};

/// Top-level fields kumo does not map.
fn top_field(name: &str) -> Verdict {
    match name {
        "rng" => Ignore,                  // kumo has no virtio-rng: the guest seeds from RDRAND/its own pool
        "watchdog" | "pvpanic" => Ignore, // no such device: the guest runs without it
        "platform" | "rtc" | "landlock_enable" | "landlock_rules" | "debug_console" => Ignore,
        "rate_limit_groups" => Refuse("kumo has no I/O rate limiting"),
        "balloon" => Refuse("kumo has no virtio-balloon (memory zones use virtio-mem)"),
        "fs" => Refuse("kumo has no virtio-fs"),
        "pmem" => Refuse("kumo has no virtio-pmem"),
        "devices" | "user_devices" => Refuse("kumo has no device pass-through (VFIO)"),
        "vdpa" => Refuse("kumo has no vDPA"),
        "vsock" => Refuse("kumo has no virtio-vsock"),
        "generic_vhost_user" => Refuse("kumo's vhost-user is for NICs only"),
        "numa" => Refuse("CH's NUMA nodes (built from memory zones) are not mapped to kumo's yet"),
        "iommu" => Refuse("kumo has no virtual IOMMU"),
        "sgx_epc" | "tpm" | "tdx" | "sev_snp" => Refuse("kumo has no such device or confidential-VM support"),
        "pci_segments" => Refuse("kumo has one PCI segment"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn cpus_field(name: &str) -> Verdict {
    match name {
        "topology" | "max_phys_bits" | "nested" | "features" | "core_scheduling" => Ignore,
        "kvm_hyperv" => Refuse("kumo offers KVM's paravirtual interface, not Hyper-V's"),
        "affinity" => Refuse("not mapped yet: pin vCPUs with vm.pin once booted"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn memory_field(name: &str) -> Verdict {
    match name {
        // Merging, THP and prefaulting are host policy (kumo's private memory is advised huge).
        "mergeable" | "thp" | "prefault" | "reserve" | "hotplug_method" | "hugepage_size" => Ignore,
        "hugepages" => Refuse("kumo backs guest memory with normal and transparent huge pages, not hugetlbfs"),
        "hotplug_size" | "hotplugged_size" => Refuse("memory hotplug is through kumo's memory zones (virtio-mem)"),
        "zones" => Refuse("CH's memory zones are not mapped to kumo's (virtio-mem) yet"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn payload_field(name: &str) -> Verdict {
    match name {
        "firmware" => Refuse("kumo boots a kernel directly (no firmware)"),
        "igvm" | "host_data" => Refuse("kumo has no confidential-VM support"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn disk_field(name: &str) -> Verdict {
    match name {
        "sparse" | "lock_granularity" | "pci_segment" => Ignore,
        "iommu" => Refuse("kumo has no virtual IOMMU"),
        "vhost_user" | "vhost_socket" => Refuse("kumo's disks are served by kumo (no vhost-user-blk)"),
        "rate_limiter_config" | "rate_limit_group" => Refuse("kumo has no I/O rate limiting"),
        "pci_device_id" => Refuse("kumo places devices on PCI itself"),
        "queue_affinity" => Refuse("kumo does not pin disk queues"),
        "backing_files" => Refuse("kumo's disks are raw images"),
        "image_type" => Refuse("kumo's disks are raw images"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn net_field(name: &str) -> Verdict {
    match name {
        // kumo opens an existing tap: its address and MTU are the host's business.
        "ip" | "mask" | "host_mac" | "mtu" | "id" | "queue_size" | "pci_segment" => Ignore,
        // kumo offers no UDP fragmentation offload (UFO is gone from Linux's taps).
        "offload_ufo" => Ignore,
        "iommu" => Refuse("kumo has no virtual IOMMU"),
        "vhost_mode" => Refuse("kumo connects to a vhost-user backend as its client only"),
        "rate_limiter_config" => Refuse("kumo has no I/O rate limiting"),
        "pci_device_id" => Refuse("kumo places devices on PCI itself"),
        _ => Refuse("kumo does not know this field"),
    }
}

fn console_field(name: &str) -> Verdict {
    match name {
        "iommu" | "id" | "pci_segment" | "pci_device_id" | "iobase" => Ignore,
        "file" | "socket" => Refuse("kumo's serial console goes to its stdout (and --console-socket)"),
        _ => Refuse("kumo does not know this field"),
    }
}

/// A value that says "not used": null, false, 0, "", [] or {} (a field's default).
fn unused(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_u64() == Some(0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// CH's defaults for fields kumo refuses otherwise: taken as unused.
fn default_value(field: &str, v: &Value) -> bool {
    match field {
        "image_type" => v == "Raw" || v == "Unknown",
        "vhost_mode" => v == "Client",
        "nested" | "thp" | "sparse" => true,
        _ => unused(v),
    }
}

/// Where the checks collect what was ignored, and stop at the first refusal.
struct Sorter {
    /// The route, for the refusal's message.
    route: &'static str,
    ignored: Vec<String>,
}

impl Sorter {
    fn sort(&mut self, at: &str, extra: &Extra, rule: fn(&str) -> Verdict) -> Result<(), ApiError> {
        for (name, v) in extra {
            let path = if at.is_empty() { name.clone() } else { format!("{at}.{name}") };
            match rule(name) {
                Ignore => self.ignored.push(path),
                Refuse(_) if default_value(name, v) => {}
                Refuse(why) => {
                    let route = self.route;
                    return Err(ApiError::bad_request(format!(
                        "{route}: field `{path}` is not supported by kumo: {why}"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl ChVmConfig {
    /// Sorts every field: Ok with the ignored ones (dotted paths, e.g. `net[0].ip`), or a 400
    /// naming the first refused one. What the VMM maps needs no more than this: a payload.
    pub fn check(&self) -> Result<Vec<String>, ApiError> {
        let mut s = Sorter { route: "vm.create", ignored: Vec::new() };
        s.sort("", &self.extra, top_field)?;
        if let Some(c) = &self.cpus {
            s.sort("cpus", &c.extra, cpus_field)?;
        }
        if let Some(m) = &self.memory {
            s.sort("memory", &m.extra, memory_field)?;
        }
        if let Some(p) = &self.payload {
            s.sort("payload", &p.extra, payload_field)?;
        }
        let paths = [("kernel", &self.kernel), ("initramfs", &self.initramfs)];
        for (at, p) in paths.into_iter().filter_map(|(at, p)| p.as_ref().map(|p| (at, p))) {
            s.sort(at, &p.extra, |_| Refuse("kumo does not know this field"))?;
        }
        for (i, d) in self.disks.iter().flatten().enumerate() {
            s.sort(&format!("disks[{i}]"), &d.extra, disk_field)?;
        }
        for (i, n) in self.net.iter().flatten().enumerate() {
            s.sort(&format!("net[{i}]"), &n.extra, net_field)?;
        }
        if let Some(c) = &self.serial {
            s.sort("serial", &c.extra, console_field)?;
            check_console_mode("serial", c.mode.as_deref())?;
        }
        if let Some(c) = &self.console {
            // No virtio-console in kumo: all of it is ignored (the guest's console is ttyS0).
            s.sort("console", &c.extra, |_| Ignore)?;
            check_console_mode("console", c.mode.as_deref())?;
        }
        if self.payload.as_ref().and_then(|p| p.kernel.as_ref()).or(self.kernel.as_ref().map(|k| &k.path)).is_none() {
            return Err(ApiError::bad_request("vm.create: no kernel: give payload.kernel (or kernel.path)"));
        }
        Ok(s.ignored)
    }
}

/// Console modes: kumo's serial port always writes to kumo's stdout (and its console socket),
/// so Off/Null/Tty/Pty are taken (no PTY is opened); File and Socket are refused. CH's
/// virtio-console does not exist in kumo: any mode is taken and ignored (the guest's console
/// is ttyS0).
fn check_console_mode(at: &str, mode: Option<&str>) -> Result<(), ApiError> {
    match (at, mode) {
        (_, None | Some("Off" | "Null" | "Tty" | "Pty")) => Ok(()),
        ("console", Some("File" | "Socket")) => Ok(()),
        (_, Some(m)) => Err(ApiError::bad_request(format!(
            "vm.create: field `{at}.mode` is not supported by kumo: mode {m} (kumo's serial console goes to its stdout; \
             use Tty, Pty, Null or Off)"
        ))),
    }
}

impl ChDisk {
    /// As [`ChVmConfig::check`], for `vm.add-disk`'s body.
    pub fn check(&self) -> Result<Vec<String>, ApiError> {
        let mut s = Sorter { route: "vm.add-disk", ignored: Vec::new() };
        s.sort("", &self.extra, disk_field)?;
        Ok(s.ignored)
    }
}

impl ChNet {
    /// As [`ChVmConfig::check`], for `vm.add-net`'s body.
    pub fn check(&self) -> Result<Vec<String>, ApiError> {
        let mut s = Sorter { route: "vm.add-net", ignored: Vec::new() };
        s.sort("", &self.extra, net_field)?;
        Ok(s.ignored)
    }
}

/// The body of `vm.remove-device`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChRemoveDevice {
    /// A disk's id (`disk0`, … or its own) or a NIC's (`net0`, … or CH's `id`).
    pub id: String,
    #[serde(flatten)]
    pub extra: Extra,
}

pub(crate) fn add_disk_request(body: &[u8]) -> Result<crate::ApiRequest, ApiError> {
    let d: ChDisk = crate::server::json_body(body)?;
    d.check()?;
    Ok(crate::ApiRequest::AddDisk(Box::new(d)))
}

pub(crate) fn add_net_request(body: &[u8]) -> Result<crate::ApiRequest, ApiError> {
    let n: ChNet = crate::server::json_body(body)?;
    n.check()?;
    Ok(crate::ApiRequest::AddNet(Box::new(n)))
}

/// `vm.create`'s route: the body parsed and checked (a refused field is a 400 naming it).
pub(crate) fn create_request(body: &[u8]) -> Result<crate::ApiRequest, ApiError> {
    let c: ChVmConfig = crate::server::json_body(body)?;
    c.check()?;
    Ok(crate::ApiRequest::Create(Box::new(c)))
}

/// A VM's state in CH's words (`vm.info`'s `state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChVmState {
    Created,
    Running,
    Paused,
    Shutdown,
}

/// The body of `vm.info`: CH's shape, with kumo's own [`crate::VmInfo`] under `kumo`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChVmInfo {
    /// The VM's config as CH's `VmConfig`; absent in an empty VMM nothing was created in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ChVmConfig>,
    pub state: ChVmState,
    /// Bytes of guest memory, plugged memory-zone blocks included.
    pub memory_actual_size: u64,
    /// CH's device tree, where it means something for kumo: each virtio device on PCI by its
    /// kumo id (`net0`, `disk0`, ...) with its address.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub device_tree: BTreeMap<String, ChDeviceNode>,
    pub kumo: crate::VmInfo,
}

/// One device of CH's `device_tree`. kumo's devices have no children and report no resources
/// (CH lists BARs and interrupts there; kumo shows them in its own `vm.info`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChDeviceNode {
    pub id: String,
    #[serde(default)]
    pub resources: Vec<Value>,
    #[serde(default)]
    pub children: Vec<String>,
    /// The PCI address, `SSSS:BB:DD.F`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bdf: Option<String>,
}

impl ChVmInfo {
    /// CH's words for kumo's state (an arriving VM is `Created` to CH).
    pub fn state_of(s: crate::VmState) -> ChVmState {
        use crate::VmState as K;
        match s {
            K::Created | K::Receiving => ChVmState::Created,
            K::Running => ChVmState::Running,
            K::Paused => ChVmState::Paused,
            K::Shutdown => ChVmState::Shutdown,
        }
    }

    /// The answer for `kumo` with `config`, its memory counted from kumo's view.
    pub fn new(config: Option<ChVmConfig>, kumo: crate::VmInfo) -> ChVmInfo {
        let zones: u64 = kumo.memory_zones.iter().map(|z| z.plugged_size).sum();
        let pci = (kumo.net.iter().map(|n| (&n.id, &n.pci)))
            .chain(kumo.disks.iter().map(|d| (&d.id, &d.pci)))
            .chain(kumo.memory_zones.iter().map(|z| (&z.id, &z.pci)));
        let device_tree = pci
            .filter(|(_, bdf)| !bdf.is_empty())
            .map(|(id, bdf)| {
                let node = ChDeviceNode {
                    id: id.clone(),
                    resources: Vec::new(),
                    children: Vec::new(),
                    pci_bdf: Some(bdf.clone()),
                };
                (id.clone(), node)
            })
            .collect();
        ChVmInfo {
            config,
            state: Self::state_of(kumo.state),
            memory_actual_size: kumo.memory_bytes + zones,
            device_tree,
            kumo,
        }
    }
}

/// The body of `vmm.ping`: CH's fields plus kumo's version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// The CH release whose API kumo answers as ([`crate::CH_COMPAT_VERSION`]).
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub build_version: String,
    #[serde(default)]
    pub pid: u32,
    #[serde(default)]
    pub features: Vec<String>,
    pub kumo_version: String,
}

impl Pong {
    /// This process's answer.
    pub fn here() -> Pong {
        Pong {
            version: crate::CH_COMPAT_VERSION.to_string(),
            build_version: format!("kumo-{}", crate::KUMO_VERSION),
            pid: std::process::id(),
            // CH's build features (kvm, tdx, ...): kumo runs on KVM alone.
            features: vec!["kvm".to_string()],
            kumo_version: crate::KUMO_VERSION.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(j: &str) -> ChVmConfig {
        serde_json::from_str(j).unwrap()
    }

    #[test]
    fn the_current_form_with_payload_parses_and_echoes() {
        let j = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":536870912,"shared":false},
            "payload":{"kernel":"/k","cmdline":"console=ttyS0","initramfs":"/i"},
            "disks":[{"path":"/d.img","readonly":true}],"net":[{"tap":"tap0","mac":"52:54:00:00:00:01","num_queues":2}],
            "serial":{"mode":"Tty"},"console":{"mode":"Off"},"rng":{"src":"/dev/urandom"},"iommu":false,"watchdog":false}"#;
        let c = parse(j);
        assert_eq!(c.cpus.as_ref().unwrap().boot_vcpus, 2);
        assert_eq!(c.payload.as_ref().unwrap().kernel.as_deref(), Some("/k"));
        assert!(c.disks.as_ref().unwrap()[0].readonly);
        let ignored = c.check().unwrap();
        assert!(!c.memory.as_ref().unwrap().shared);
        for f in ["rng", "watchdog"] {
            assert!(ignored.contains(&f.to_string()), "{ignored:?}");
        }
        assert!(!ignored.contains(&"iommu".to_string()), "false is the default: {ignored:?}");
        // What kumo holds reads back as it came.
        let back: ChVmConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn the_older_form_libvirt_9_sends_parses() {
        let j = r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":268435456},
            "kernel":{"path":"/vmlinux"},"cmdline":{"args":"console=ttyS0"},"initramfs":{"path":"/initrd"},
            "console":{"mode":"Pty"},"serial":{"mode":"Pty"},
            "disks":[{"path":"/d.img","readonly":false}],
            "net":[{"tap":"vnet0","mac":"52:54:00:aa:bb:cc","ip":"192.168.1.1","mask":"255.255.255.0",
                    "num_queues":2,"queue_size":256,"vhost_user":false,"vhost_socket":null}]}"#;
        let c = parse(j);
        assert_eq!(c.kernel.as_ref().unwrap().path, "/vmlinux");
        assert_eq!(c.cmdline.as_ref().unwrap().args, "console=ttyS0");
        assert_eq!(c.initramfs.as_ref().unwrap().path, "/initrd");
        let ignored = c.check().unwrap();
        assert!(ignored.contains(&"net[0].ip".to_string()) && ignored.contains(&"net[0].queue_size".to_string()));
    }

    #[test]
    fn a_refused_field_is_named_and_defaults_pass() {
        let base = r#""payload":{"kernel":"/k"}"#;
        for (extra, field) in [
            (r#""devices":[{"path":"/sys/bus/pci/devices/0000:01:00.0"}]"#, "`devices`"),
            (r#""fs":[{"tag":"x","socket":"/s"}]"#, "`fs`"),
            (r#""memory":{"size":1,"hugepages":true}"#, "`memory.hugepages`"),
            (r#""disks":[{"path":"/d","vhost_user":true}]"#, "`disks[0].vhost_user`"),
            (r#""serial":{"mode":"File","file":"/log"}"#, "`serial.file`"),
            (r#""serial":{"mode":"Socket"}"#, "`serial.mode`"),
            (r#""payload2":1"#, "`payload2`"),
        ] {
            let c = parse(&format!("{{{base},{extra}}}"));
            let e = c.check().unwrap_err();
            assert_eq!(e.kind, crate::ErrorKind::BadRequest);
            assert!(e.message.contains(field) && e.message.contains("not supported by kumo"), "{e}");
        }
        // Null, false and empty values of unsupported fields are taken as absent.
        let c = parse(&format!(r#"{{{base},"devices":null,"fs":[],"iommu":false,"balloon":null}}"#));
        assert_eq!(c.check().unwrap(), Vec::<String>::new());
        let e = parse(r#"{"cpus":{"boot_vcpus":1}}"#).check().unwrap_err();
        assert!(e.message.contains("no kernel"), "{e}");
    }

    #[test]
    fn ping_and_info_shapes() {
        let p = serde_json::to_value(Pong::here()).unwrap();
        for k in ["version", "build_version", "pid", "features", "kumo_version"] {
            assert!(!p[k].is_null(), "{k}: {p}");
        }
        // kumo's older answers (kumo_version alone) still read.
        let old: Pong = serde_json::from_str(r#"{"kumo_version":"0.1"}"#).unwrap();
        assert_eq!(old.kumo_version, "0.1");
        assert_eq!(serde_json::to_value(ChVmState::Paused).unwrap(), "Paused");
        assert_eq!(ChVmInfo::state_of(crate::VmState::Receiving), ChVmState::Created);
    }
}
