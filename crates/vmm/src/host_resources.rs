//! The host resources of a VM that arrives (a migration's destination, a snapshot's restore):
//! its operator, not the stream, says which tap or vhost-user socket each NIC gets and which host
//! node each guest NUMA node's memory is bound to (`--net id=net0,tap=NAME`,
//! `--numa node=0,host-node=1` beside `--incoming` or `--restore`, or the `net` and `numa` of
//! `vm.receive-migration` and `vm.restore`).
//!
//! [`resolve`] matches them by id against the VM the stream describes: every NIC of the VM
//! (`net0`, `net1`, … in PCI slot order) needs a backend of the same kind from the operator, and
//! the operator's ids must all exist in the VM. Guest NUMA nodes need a binding each once the
//! operator gives any (without `--numa` their memory is not bound). The guest-visible shape (MAC,
//! queues, interrupt path, slot order, the nodes' vCPUs and memory, distances) stays the
//! stream's; whatever the stream says about the source's host (taps, sockets, host nodes, pins)
//! is dropped. A stream that does not fit is refused with a [`ResourceError`] before anything is
//! built or attached.

use std::path::PathBuf;

pub use kumo_api::{DiskPath, NicBackend, NodeBinding};

use crate::config::TapFds;
use crate::{Error, VmConfig};

/// What the operator gave: the backend of each NIC, the host node of each guest node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostResources {
    pub net: Vec<NicBackend>,
    pub numa: Vec<NodeBinding>,
    /// The image of each disk, by id (`--disk id=disk0,path=FILE`).
    pub disks: Vec<DiskPath>,
    /// A NIC or disk given nothing here keeps its source's tap, socket or image (Cloud
    /// Hypervisor's restore, which reuses its config's backends): for a restore on the host
    /// that saved it. Not a NIC whose tap came as descriptors there: it needs a tap here.
    pub as_on_source: bool,
    /// NICs on taps whose descriptors the operator's client passed (`vm.restore`'s `net_fds`).
    pub tap_fds: Vec<PassedTap>,
}

/// A NIC's tap as descriptors passed with the request, one per queue pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassedTap {
    /// The VM's NIC: `net0`, …
    pub id: String,
    /// The tap the descriptors are of (TUNGETIFF), for messages and `vm.info`.
    pub tap: String,
    pub fds: kumo_api::Fds,
}

/// Why an arriving VM does not fit what its destination's operator gave. One line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    #[error("the VM's {id} ({source_backend} on its source) has no backend here: give --net id={id},tap=NAME (or vhost-user=PATH)")]
    MissingNic { id: String, source_backend: String },
    #[error("--net id={id}: the VM has no NIC {id} ({have})")]
    ExtraNic { id: String, have: String },
    #[error("--net id={id}: the VM's {id} is a {want} NIC; a {given} cannot take its state")]
    NicKind { id: String, want: &'static str, given: &'static str },
    #[error("--net id={id} is given twice")]
    DuplicateNic { id: String },
    #[error("--net id={id}: not a NIC id (net0, net1, …)")]
    NicId { id: String },
    #[error("--net id={id}: give exactly one of tap=NAME and vhost-user=PATH")]
    NicBackend { id: String },
    #[error("--numa node={node}: the VM has no NUMA nodes")]
    NoGuestNodes { node: u32 },
    #[error("--numa node={node}: the VM has no NUMA node {node} ({have})")]
    ExtraNode { node: u32, have: String },
    #[error("the VM's NUMA node {node} has no --numa here: give --numa node={node}[,host-node=N] for every node, or no --numa")]
    MissingNode { node: u32 },
    #[error("--numa node={node} is given twice")]
    DuplicateNode { node: u32 },
    #[error("the VM's {id}: {why}")]
    BadNic { id: String, why: String },
    #[error("the VM's {id} had tap {tap} passed as descriptors on its source, which are not here: give it a tap (vm.restore's net_fds, or net/--net id={id},tap=NAME)")]
    FdsOnSource { id: String, tap: String },
    #[error("the VM's disk {id} (image {source_path} on its source) has no image here: give --disk id={id},path=FILE")]
    MissingDisk { id: String, source_path: String },
    #[error("--disk id={id}: the VM has no disk {id} ({have})")]
    ExtraDisk { id: String, have: String },
    #[error("--disk id={id} is given twice")]
    DuplicateDisk { id: String },
}

impl From<ResourceError> for Error {
    fn from(e: ResourceError) -> Error {
        Error::Config(e.to_string())
    }
}

/// `net0`, `net1`, …: no sign, no leading zero.
fn is_nic_id(id: &str) -> bool {
    id.strip_prefix("net").and_then(|n| n.parse::<u16>().ok()).is_some_and(|n| format!("net{n}") == id)
}

/// Exactly one of a tap and a vhost-user socket, neither empty.
fn one_backend(b: &NicBackend) -> bool {
    match (b.tap.as_deref(), b.vhost_user.as_deref()) {
        (Some(t), None) => !t.is_empty(),
        (None, Some(v)) => !v.is_empty(),
        _ => false,
    }
}

/// `net0, net1` or `none`, for messages.
fn listing(ids: impl Iterator<Item = String>) -> String {
    let v: Vec<String> = ids.collect();
    if v.is_empty() {
        "it has none".into()
    } else {
        format!("it has {}", v.join(", "))
    }
}

fn mac_text(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The VM the stream describes, on this host's resources: each NIC on the operator's backend
/// for its id (its MAC kept: a default MAC derives from the source's tap name), each guest node
/// bound to the operator's host node (or none), the source's pins dropped. Pure: nothing on the
/// host is looked at (see [`check_on_host`]).
pub fn resolve(mut vm: VmConfig, ours: &HostResources) -> Result<VmConfig, ResourceError> {
    ours.check()?;
    for b in ours.net.iter().map(|b| &b.id).chain(ours.tap_fds.iter().map(|p| &p.id)) {
        if !(0..vm.net.len()).any(|n| *b == format!("net{n}")) {
            let have = listing((0..vm.net.len()).map(|n| format!("net{n}")));
            return Err(ResourceError::ExtraNic { id: b.clone(), have });
        }
    }
    for (i, nic) in vm.net.iter_mut().enumerate() {
        let id = format!("net{i}");
        if let Some(p) = ours.tap_fds.iter().find(|p| p.id == id) {
            on_passed_tap(nic, &id, p)?;
            continue;
        }
        let found = ours.net.iter().find(|b| b.id == id);
        if found.is_none() && ours.as_on_source {
            if nic.fds == TapFds::OnSource {
                return Err(ResourceError::FdsOnSource { id, tap: nic.tap.clone() });
            }
            let mac = nic.mac().map_err(|why| ResourceError::BadNic { id: id.clone(), why })?;
            nic.mac = Some(mac_text(mac));
            continue;
        }
        let b =
            found.ok_or_else(|| ResourceError::MissingNic { id: id.clone(), source_backend: nic.backend_name() })?;
        let kind = |vhost: bool| if vhost { "vhost-user" } else { "tap" };
        let (want, given) = (kind(nic.vhost_user.is_some()), kind(b.vhost_user.is_some()));
        if want != given {
            return Err(ResourceError::NicKind { id, want, given });
        }
        let mac = nic.mac().map_err(|why| ResourceError::BadNic { id: id.clone(), why })?;
        nic.mac = Some(mac_text(mac));
        nic.tap = b.tap.clone().unwrap_or_default();
        nic.vhost_user = b.vhost_user.as_ref().map(PathBuf::from);
        nic.fds = TapFds::ByName;
    }
    resolve_disks(&mut vm, ours)?;
    // Pins name the source's host CPUs: the destination's own are not carried (`HostPlacement`).
    vm.host = Default::default();
    match vm.numa.as_mut() {
        None => {
            if let Some(b) = ours.numa.first() {
                return Err(ResourceError::NoGuestNodes { node: b.node });
            }
        }
        Some(numa) => {
            for b in &ours.numa {
                if !numa.nodes.iter().any(|n| n.id == b.node) {
                    let have = listing(numa.nodes.iter().map(|n| format!("node {}", n.id)));
                    return Err(ResourceError::ExtraNode { node: b.node, have });
                }
            }
            for n in &mut numa.nodes {
                n.pin = None;
                n.host_node = match ours.numa.iter().find(|b| b.node == n.id) {
                    Some(b) => b.host_node,
                    None if ours.numa.is_empty() => None,
                    None => return Err(ResourceError::MissingNode { node: n.id }),
                };
            }
        }
    }
    Ok(vm)
}

/// NIC `id` on the tap passed as descriptors: a tap NIC with as many queue pairs as came.
fn on_passed_tap(nic: &mut crate::NetSpec, id: &str, p: &PassedTap) -> Result<(), ResourceError> {
    if nic.vhost_user.is_some() {
        return Err(ResourceError::NicKind { id: id.into(), want: "vhost-user", given: "tap" });
    }
    if p.fds.len() != usize::from(nic.queues) {
        let why = format!("net_fds gives {} tap descriptors; it has {} queue pairs", p.fds.len(), nic.queues);
        return Err(ResourceError::BadNic { id: id.into(), why });
    }
    let mac = nic.mac().map_err(|why| ResourceError::BadNic { id: id.into(), why })?;
    nic.mac = Some(mac_text(mac));
    nic.tap.clone_from(&p.tap);
    nic.fds = TapFds::Passed(p.fds.clone());
    Ok(())
}

/// Each disk on the operator's image for its id; the operator's ids must all exist in the VM.
fn resolve_disks(vm: &mut VmConfig, ours: &HostResources) -> Result<(), ResourceError> {
    let ids: Vec<String> = vm.disks.iter().enumerate().map(|(i, d)| d.id_at(i)).collect();
    for (i, g) in ours.disks.iter().enumerate() {
        if ours.disks[..i].iter().any(|o| o.id == g.id) {
            return Err(ResourceError::DuplicateDisk { id: g.id.clone() });
        }
        if !ids.contains(&g.id) {
            return Err(ResourceError::ExtraDisk { id: g.id.clone(), have: listing(ids.iter().cloned()) });
        }
    }
    for (d, id) in vm.disks.iter_mut().zip(ids) {
        match ours.disks.iter().find(|g| g.id == id) {
            Some(g) => d.path = PathBuf::from(&g.path),
            None if ours.as_on_source => {}
            None => return Err(ResourceError::MissingDisk { id, source_path: d.path.display().to_string() }),
        }
        d.id = Some(id);
    }
    Ok(())
}

/// Checks the resolved VM's disk images here against the sizes `sizes` (by disk id) the VM's
/// disks had on its source: each opens and checks as at boot (unlocked: the source may still
/// hold it), with the same size.
pub fn check_disks(vm: &VmConfig, sizes: &[(String, u64)]) -> Result<(), Error> {
    for (i, d) in vm.disks.iter().enumerate() {
        let id = d.id_at(i);
        let img = kumo_devices::virtio::block::DiskImage::open_unlocked(&d.path, d.readonly, d.direct)
            .map_err(|e| Error::Config(format!("disk {id}: {e}")))?;
        if let Some((_, want)) = sizes.iter().find(|(s, _)| *s == id).filter(|(_, w)| *w != img.size()) {
            return Err(Error::Config(format!(
                "disk {id}: image {} is {} bytes; the VM's disk was {want} bytes",
                d.path.display(),
                img.size()
            )));
        }
    }
    Ok(())
}

/// Checks the resolved VM's backends on this host before anything is built: each tap exists, is
/// a tap and can take its NIC's queue pairs; each vhost-user path is a socket.
pub fn check_on_host(vm: &VmConfig) -> Result<(), Error> {
    use std::os::unix::fs::FileTypeExt;
    for (i, n) in vm.net.iter().enumerate() {
        let bad = |why: String| Error::Config(format!("net{i}: {why}"));
        match &n.vhost_user {
            // Descriptors in hand were checked when they came (`ch_config::tap_of_fds`).
            None if matches!(n.fds, TapFds::Passed(_)) => {}
            None => {
                kumo_devices::virtio::net::tap::Tap::check(&n.tap, usize::from(n.queues))
                    .map_err(|e| bad(e.to_string()))?;
            }
            Some(p) => match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_socket() => {}
                Ok(_) => return Err(bad(format!("vhost-user {} is not a socket", p.display()))),
                Err(e) => return Err(bad(format!("vhost-user {}: {e}", p.display()))),
            },
        }
    }
    Ok(())
}

impl HostResources {
    /// What an API request gave; given neither NICs nor disks (Cloud Hypervisor's bodies for
    /// `vm.restore` and `vm.receive-migration`), the VM keeps its source's backends.
    pub fn given(net: &[NicBackend], numa: &[NodeBinding], disks: &[DiskPath]) -> HostResources {
        HostResources {
            net: net.to_vec(),
            numa: numa.to_vec(),
            disks: disks.to_vec(),
            as_on_source: net.is_empty() && disks.is_empty(),
            tap_fds: Vec::new(),
        }
    }

    /// Checks what can be checked before a VM arrives (an API request's `net` and `numa`): NIC
    /// ids `netN`, each given once with exactly one backend; each node given once.
    pub fn check(&self) -> Result<(), ResourceError> {
        for (i, b) in self.net.iter().enumerate() {
            if !is_nic_id(&b.id) {
                return Err(ResourceError::NicId { id: b.id.clone() });
            }
            if self.net[..i].iter().any(|o| o.id == b.id) {
                return Err(ResourceError::DuplicateNic { id: b.id.clone() });
            }
            if !one_backend(b) {
                return Err(ResourceError::NicBackend { id: b.id.clone() });
            }
        }
        for (i, p) in self.tap_fds.iter().enumerate() {
            if !is_nic_id(&p.id) {
                return Err(ResourceError::NicId { id: p.id.clone() });
            }
            if self.net.iter().any(|o| o.id == p.id) || self.tap_fds[..i].iter().any(|o| o.id == p.id) {
                return Err(ResourceError::DuplicateNic { id: p.id.clone() });
            }
        }
        for (i, b) in self.numa.iter().enumerate() {
            if self.numa[..i].iter().any(|o| o.node == b.node) {
                return Err(ResourceError::DuplicateNode { node: b.node });
            }
        }
        Ok(())
    }

    /// Parses the operator's `--net` and `--numa` given with `--incoming` or `--restore`.
    pub fn parse(net: &[String], numa: &[String]) -> Result<HostResources, Error> {
        Ok(HostResources {
            net: net.iter().enumerate().map(|(i, s)| parse_nic(s, i)).collect::<Result<_, _>>()?,
            numa: numa.iter().map(|s| parse_node(s)).collect::<Result<_, _>>()?,
            disks: Vec::new(),
            as_on_source: false,
            tap_fds: Vec::new(),
        })
    }

    /// Adds the operator's `--disk [id=ID,]path=FILE` (the i-th is `disk{i}` without id=).
    pub fn with_disks(mut self, disks: &[String]) -> Result<HostResources, Error> {
        self.disks = disks.iter().enumerate().map(|(i, s)| parse_disk(s, i)).collect::<Result<_, _>>()?;
        Ok(self)
    }
}

/// `[id=netN,]tap=NAME` or `[id=netN,]vhost-user=PATH`; without `id=`, the `index`-th `--net`
/// is `net{index}`. What the guest sees is the VM's, so no other key is taken.
fn parse_nic(s: &str, index: usize) -> Result<NicBackend, Error> {
    let bad = |m: String| Error::Config(format!("--net {s}: {m}"));
    let mut b = NicBackend { id: format!("net{index}"), tap: None, vhost_user: None };
    for part in s.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
        match k {
            "id" => b.id = v.to_string(),
            "tap" => b.tap = Some(v.to_string()),
            "vhost-user" | "vhost_user" => b.vhost_user = Some(v.to_string()),
            "mac" | "queues" | "irq" | "vcpu" => {
                return Err(bad(format!(
                    "{k}= comes from the arriving VM; with --incoming or --restore give id=, tap= or vhost-user="
                )))
            }
            _ => return Err(bad(format!("unknown key `{k}` (id, tap, vhost-user)"))),
        }
    }
    if !is_nic_id(&b.id) {
        return Err(bad(format!("id `{}` is not a NIC id (net0, net1, …)", b.id)));
    }
    if !one_backend(&b) {
        return Err(bad("give exactly one of tap=NAME and vhost-user=PATH".into()));
    }
    Ok(b)
}

/// `[id=ID,]path=FILE`: what the guest sees of the disk is the VM's.
fn parse_disk(s: &str, index: usize) -> Result<DiskPath, Error> {
    let bad = |m: String| Error::Config(format!("--disk {s}: {m}"));
    let (mut id, mut path) = (format!("disk{index}"), None);
    for part in s.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
        match k {
            "id" => id = v.to_string(),
            "path" if !v.is_empty() => path = Some(v.to_string()),
            "readonly" | "serial" | "queues" | "queue_size" | "direct" => {
                return Err(bad(format!(
                    "{k}= comes from the arriving VM; with --incoming or --restore give id= and path="
                )))
            }
            _ => return Err(bad(format!("unknown key `{k}` (id, path)"))),
        }
    }
    Ok(DiskPath { id, path: path.ok_or_else(|| bad("path=FILE is required".into()))? })
}

/// `node=ID[,host-node=N]`: the guest node's shape is the VM's.
fn parse_node(s: &str) -> Result<NodeBinding, Error> {
    let bad = |m: String| Error::Config(format!("--numa {s}: {m}"));
    if s.trim() == "mirror" {
        return Err(bad("the arriving VM's nodes are its own; give node=ID[,host-node=N] for each".into()));
    }
    let (mut node, mut host_node) = (None, None);
    for part in s.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
        let n = |v: &str| v.parse::<u32>().map_err(|_| bad(format!("{k} `{v}` is not a number")));
        match k {
            "node" => node = Some(n(v)?),
            "host-node" => host_node = Some(n(v)?),
            "cpus" | "memory" | "pin" => {
                return Err(bad(format!(
                    "{k}= comes from the arriving VM; with --incoming or --restore give node= and host-node="
                )))
            }
            _ => return Err(bad(format!("unknown key `{k}` (node, host-node)"))),
        }
    }
    Ok(NodeBinding { node: node.ok_or_else(|| bad("node=ID is required".into()))?, host_node })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{NumaConfig, NumaNodeSpec};
    use crate::{NetSpec, Payload};

    fn vm(nets: &[&str]) -> VmConfig {
        VmConfig {
            cpus: 2,
            memory: 64 << 20,
            net: nets.iter().map(|s| NetSpec::parse(s).unwrap()).collect(),
            host: crate::placement::HostPlacement { pins: vec![Some(3), Some(4)], halt_poll_ns: Some(0) },
            ..VmConfig::new(Payload::guest("netecho", &[]))
        }
    }

    fn ours(net: &[&str], numa: &[&str]) -> HostResources {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        HostResources::parse(&s(net), &s(numa)).unwrap()
    }

    #[test]
    fn nics_get_the_operators_backends_and_keep_their_shape() {
        let src = vm(&["tap=victim,queues=2,irq=dedicated,vcpu=1", "tap=other,mac=52:54:00:00:00:07"]);
        let mac0 = src.net[0].mac().unwrap();
        // By position, and by id in any order.
        for given in [&["tap=mine0", "tap=mine1"][..], &["id=net1,tap=mine1", "id=net0,tap=mine0"]] {
            let r = resolve(src.clone(), &ours(given, &[])).unwrap();
            assert_eq!((r.net[0].tap.as_str(), r.net[1].tap.as_str()), ("mine0", "mine1"));
            assert_eq!(r.net[0].mac().unwrap(), mac0, "the default MAC derived from the source's tap stays");
            assert_eq!(r.net[1].mac.as_deref(), Some("52:54:00:00:00:07"));
            assert_eq!(r.net[0].queues, 2);
            assert_eq!(r.net[0].irq, kumo_vm::interrupt_paths::IrqPath::Dedicated { vcpu: 1 });
            assert_eq!(r.host, Default::default(), "the source's pins and halt polling are not carried");
            r.validate_net().unwrap();
        }
        let v = resolve(vm(&["vhost-user=/their.sock"]), &ours(&["vhost-user=/run/mine.sock"], &[])).unwrap();
        assert_eq!(v.net[0].vhost_user.as_deref(), Some(std::path::Path::new("/run/mine.sock")));
        // No NICs, nothing given: nothing to match.
        assert!(resolve(vm(&[]), &HostResources::default()).unwrap().net.is_empty());
    }

    #[test]
    fn a_stream_that_does_not_fit_is_refused() {
        let two = vm(&["tap=victim", "tap=b"]);
        let cases: Vec<(VmConfig, HostResources, &str)> = vec![
            (
                two.clone(),
                HostResources::default(),
                "the VM's net0 (tap victim on its source) has no backend here: give --net id=net0,tap=NAME",
            ),
            (two.clone(), ours(&["tap=a"], &[]), "the VM's net1 (tap b on its source) has no backend here"),
            (
                two.clone(),
                ours(&["tap=a", "tap=b", "tap=c"], &[]),
                "--net id=net2: the VM has no NIC net2 (it has net0, net1)",
            ),
            (vm(&[]), ours(&["tap=a"], &[]), "--net id=net0: the VM has no NIC net0 (it has none)"),
            (two.clone(), ours(&["tap=a", "id=net0,tap=b"], &[]), "--net id=net0 is given twice"),
            (vm(&["tap=t"]), ours(&["vhost-user=/s"], &[]), "the VM's net0 is a tap NIC; a vhost-user cannot"),
            (vm(&["vhost-user=/s"]), ours(&["tap=t"], &[]), "the VM's net0 is a vhost-user NIC; a tap cannot"),
            (vm(&[]), ours(&[], &["node=0,host-node=0"]), "--numa node=0: the VM has no NUMA nodes"),
        ];
        for (v, o, want) in cases {
            let e = resolve(v, &o).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "want `{want}` in `{e}`");
        }
        // Through the API, a backend may name both kinds or none.
        let both = HostResources {
            net: vec![NicBackend { id: "net0".into(), tap: Some("t".into()), vhost_user: Some("/s".into()) }],
            ..Default::default()
        };
        assert_eq!(resolve(vm(&["tap=t"]), &both), Err(ResourceError::NicBackend { id: "net0".into() }));
        // Cloud Hypervisor's restore: what is not given keeps the source's backend.
        let same = HostResources { as_on_source: true, ..Default::default() };
        let r = resolve(vm(&["tap=t"]), &same).expect("the source's tap");
        assert_eq!(r.net[0].tap, "t");
        let eth = HostResources {
            net: vec![NicBackend { id: "eth0".into(), tap: Some("t".into()), vhost_user: None }],
            ..Default::default()
        };
        assert_eq!(eth.check(), Err(ResourceError::NicId { id: "eth0".into() }));
    }

    #[test]
    fn guest_nodes_get_the_operators_host_nodes() {
        let node = |id, cpus: Vec<u32>, host_node| NumaNodeSpec { id, cpus, memory: 32 << 20, host_node, pin: None };
        let src = VmConfig {
            numa: Some(NumaConfig {
                nodes: vec![node(0, vec![0], Some(5)), node(1, vec![1], Some(6))],
                distances: vec![crate::config::NumaDistance { src: 0, dst: 1, value: 31 }],
            }),
            ..vm(&[])
        };
        // Without --numa: the shape stays, the source's host nodes do not.
        let r = resolve(src.clone(), &HostResources::default()).unwrap();
        let n = r.numa.as_ref().unwrap();
        assert_eq!(n.nodes.iter().map(|n| n.host_node).collect::<Vec<_>>(), [None, None]);
        assert_eq!(n.distances, src.numa.as_ref().unwrap().distances);
        assert_eq!(r.numa_topology().unwrap(), src.numa_topology().unwrap());
        let r = resolve(src.clone(), &ours(&[], &["node=1,host-node=0", "node=0"])).unwrap();
        assert_eq!(r.numa.unwrap().nodes.iter().map(|n| n.host_node).collect::<Vec<_>>(), [None, Some(0)]);
        for (given, want) in [
            (&["node=0,host-node=0"][..], "the VM's NUMA node 1 has no --numa here"),
            (&["node=0", "node=1", "node=2"], "--numa node=2: the VM has no NUMA node 2 (it has node 0, node 1)"),
            (&["node=0", "node=0,host-node=1"], "--numa node=0 is given twice"),
        ] {
            let e = resolve(src.clone(), &ours(&[], given)).unwrap_err().to_string();
            assert!(e.contains(want), "{given:?}: want `{want}` in `{e}`");
        }
    }

    #[test]
    fn the_operators_flags_parse_and_bad_ones_are_one_line() {
        let r = ours(&["tap=a", "id=net3,vhost-user=/s"], &["node=1,host-node=2"]);
        assert_eq!(r.net[0], NicBackend { id: "net0".into(), tap: Some("a".into()), vhost_user: None });
        assert_eq!(r.net[1], NicBackend { id: "net3".into(), tap: None, vhost_user: Some("/s".into()) });
        assert_eq!(r.numa, [NodeBinding { node: 1, host_node: Some(2) }]);
        let s = |v: &str| vec![v.to_string()];
        for (net, numa, want) in [
            (s("tap=a,queues=2"), vec![], "queues= comes from the arriving VM"),
            (s("tap=a,mac=52:54:00:00:00:01"), vec![], "mac= comes from the arriving VM"),
            (s("id=eth0,tap=a"), vec![], "id `eth0` is not a NIC id"),
            (s("id=net01,tap=a"), vec![], "id `net01` is not a NIC id"),
            (s("id=net0"), vec![], "give exactly one of tap=NAME and vhost-user=PATH"),
            (s("tap=a,vhost-user=/s"), vec![], "give exactly one"),
            (s("tap="), vec![], "give exactly one"),
            (s("tap=a,sock=/t"), vec![], "unknown key `sock`"),
            (vec![], s("mirror"), "the arriving VM's nodes are its own"),
            (vec![], s("node=0,memory=1G"), "memory= comes from the arriving VM"),
            (vec![], s("host-node=1"), "node=ID is required"),
            (vec![], s("node=x"), "node `x` is not a number"),
        ] {
            let e = HostResources::parse(&net, &numa).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{net:?} {numa:?}: want `{want}` in `{e}`");
        }
    }

    #[test]
    fn a_nic_whose_tap_came_as_descriptors_needs_one_here() {
        let mut src = vm(&["tap=vnet7", "tap=byname"]);
        src.net[0].fds = TapFds::OnSource;
        // CH's restore keeps what is not given, but not a tap that was only descriptors there.
        let same = HostResources { as_on_source: true, ..Default::default() };
        let e = resolve(src.clone(), &same).unwrap_err();
        assert_eq!(e, ResourceError::FdsOnSource { id: "net0".into(), tap: "vnet7".into() });
        // Descriptors given for it: a tap NIC on them, one per queue pair.
        let null = || std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let fds = kumo_api::Fds::new(vec![null()]);
        let passed = PassedTap { id: "net0".into(), tap: "vnet9".into(), fds: fds.clone() };
        let given = HostResources { as_on_source: true, tap_fds: vec![passed.clone()], ..Default::default() };
        let r = resolve(src.clone(), &given).unwrap();
        assert_eq!((r.net[0].tap.as_str(), &r.net[0].fds), ("vnet9", &TapFds::Passed(fds.clone())));
        assert_eq!((r.net[1].tap.as_str(), &r.net[1].fds), ("byname", &TapFds::ByName));
        assert_eq!(r.net[0].mac, Some(mac_text(src.net[0].mac().unwrap())), "the source's MAC stays");
        // Or a tap by name.
        let r = resolve(src.clone(), &HostResources { as_on_source: true, ..ours(&["tap=mine"], &[]) }).unwrap();
        assert_eq!((r.net[0].tap.as_str(), &r.net[0].fds), ("mine", &TapFds::ByName));
        // Wrong count, unknown NIC, twice.
        let two = HostResources {
            tap_fds: vec![PassedTap { fds: kumo_api::Fds::new(vec![null(), null()]), ..passed.clone() }],
            ..Default::default()
        };
        assert!(resolve(src.clone(), &HostResources { as_on_source: true, ..two })
            .unwrap_err()
            .to_string()
            .contains("2 tap descriptors; it has 1 queue pairs"));
        let extra =
            HostResources { tap_fds: vec![PassedTap { id: "net5".into(), ..passed.clone() }], ..Default::default() };
        assert!(matches!(resolve(src.clone(), &extra), Err(ResourceError::ExtraNic { .. })));
        let twice = HostResources { tap_fds: vec![passed], ..ours(&["tap=a"], &[]) };
        assert_eq!(resolve(src, &twice), Err(ResourceError::DuplicateNic { id: "net0".into() }));
    }
}
