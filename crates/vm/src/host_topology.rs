//! The host's NUMA and CPU topology, read from sysfs, and what kumo builds on it: the
//! `--numa mirror` planner (guest nodes that copy the host's, each vCPU pinned to its own host
//! CPU), the vCPU pin-spec parser (`pin=0@2:1@3`) and pinning a thread to a host CPU.
//!
//! Everything but [`pin_thread`] and [`thread_affinity`] is pure: the reader takes the root of
//! a tree (`/` on a live host, a recorded tree in tests: `crates/vm/tests/fixtures/sysfs-*`).

use std::fmt::Write as _;
use std::path::Path;

use crate::memory::human_size;

/// Guest node memory is cut in units of this size (a huge page), so each node can be backed by
/// huge pages and bound to its host node on its own.
pub const MIRROR_UNIT: u64 = 2 << 20;

/// Every way reading, planning or pinning can fail; each message is one line naming the
/// problem (and, for a malformed tree, the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostTopologyError {
    #[error("{path}: {what}")]
    Read { path: String, what: String },
    #[error("--numa mirror needs at least 1 vCPU")]
    NoVcpus,
    #[error("--numa mirror: {vcpus} vCPUs but this host has {host} online CPUs (mirror mode pins each vCPU to a host CPU of its own)")]
    TooManyVcpus { vcpus: u32, host: u32 },
    #[error("--numa mirror: memory {} is more than this host's {}", human_size(*.memory), human_size(*.host))]
    TooMuchMemory { memory: u64, host: u64 },
    #[error("--numa mirror: guest node {node} would get {} but host node {host_node} has only {}", human_size(*.share), human_size(*.host))]
    NodeMemory { node: u32, host_node: u32, share: u64, host: u64 },
    #[error("pin={spec}: {what}")]
    Pin { spec: String, what: String },
}

type Result<T> = std::result::Result<T, HostTopologyError>;

/// One host NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNode {
    /// The kernel's node id (`nodeN`); ids may have holes.
    pub id: u32,
    /// Its online CPUs, ascending.
    pub cpus: Vec<u32>,
    /// Its memory in bytes (`MemTotal`).
    pub memory: u64,
}

/// One online host CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCpu {
    pub id: u32,
    /// The id of the node holding it.
    pub node: u32,
    /// `topology/physical_package_id`: the socket.
    pub package: u32,
    /// `topology/core_id`: unique within a package only.
    pub core: u32,
    /// `topology/thread_siblings_list`: the CPUs sharing its core, itself included, ascending.
    pub siblings: Vec<u32>,
}

/// A host's topology as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTopology {
    /// Ascending by id.
    pub nodes: Vec<HostNode>,
    /// `distances[i][j]`: from `nodes[i]` to `nodes[j]` (by position, as the kernel's
    /// `nodeN/distance` lists one value per online node).
    pub distances: Vec<Vec<u8>>,
    /// The online CPUs, ascending by id.
    pub cpus: Vec<HostCpu>,
}

impl HostTopology {
    /// Reads the topology of the host whose filesystem root is `root` (`/` for this host):
    /// `sys/devices/system/cpu/online`, each online CPU's `topology/` files and, per
    /// `sys/devices/system/node/nodeN`, `cpulist`, `meminfo` (MemTotal) and `distance`.
    /// Without `sys/devices/system/node` (a kernel without NUMA) the host is one node 0 holding
    /// every online CPU and `proc/meminfo`'s MemTotal.
    pub fn read(root: &Path) -> Result<HostTopology> {
        let system = root.join("sys/devices/system");
        let online_path = system.join("cpu/online");
        let online = parse_cpulist(&read_text(&online_path)?).map_err(|what| read_err(&online_path, what))?;
        if online.is_empty() {
            return Err(read_err(&online_path, "no online CPUs".into()));
        }

        let node_dir = system.join("node");
        let (nodes, distances) = if node_dir.is_dir() {
            read_nodes(&node_dir, &online)?
        } else {
            let path = root.join("proc/meminfo");
            let memory = mem_total(&read_text(&path)?).ok_or_else(|| read_err(&path, "no MemTotal line".into()))?;
            (vec![HostNode { id: 0, cpus: online.clone(), memory }], vec![vec![10]])
        };

        let mut cpus = Vec::with_capacity(online.len());
        for &id in &online {
            let dir = system.join(format!("cpu/cpu{id}/topology"));
            let package = read_number(&dir.join("physical_package_id"))?;
            let core = read_number(&dir.join("core_id"))?;
            let path = dir.join("thread_siblings_list");
            let siblings = parse_cpulist(&read_text(&path)?).map_err(|what| read_err(&path, what))?;
            if !siblings.contains(&id) {
                return Err(read_err(&path, format!("does not list cpu {id} itself")));
            }
            let Some(node) = nodes.iter().find(|n| n.cpus.contains(&id)) else {
                return Err(read_err(&node_dir, format!("online cpu {id} is in no node's cpulist")));
            };
            cpus.push(HostCpu { id, node: node.id, package, core, siblings });
        }
        Ok(HostTopology { nodes, distances, cpus })
    }

    /// This host's topology (sysfs at `/`).
    pub fn read_live() -> Result<HostTopology> {
        HostTopology::read(Path::new("/"))
    }

    /// The online CPUs' ids, ascending.
    pub fn online_cpus(&self) -> Vec<u32> {
        self.cpus.iter().map(|c| c.id).collect()
    }

    /// All nodes' memory in bytes.
    pub fn memory(&self) -> u64 {
        self.nodes.iter().map(|n| n.memory).sum()
    }

    pub fn cpu(&self, id: u32) -> Option<&HostCpu> {
        self.cpus.iter().find(|c| c.id == id)
    }

    /// The order mirror mode hands out a node's CPUs: one thread of every physical core first,
    /// then the cores' second threads, and so on (each round ascending by CPU id), so a guest
    /// with fewer vCPUs than the node has threads never puts two of them on one core.
    pub fn fill_order(&self, node: &HostNode) -> Vec<u32> {
        let rank = |id: u32| {
            let sib = self.cpu(id).map(|c| c.siblings.as_slice()).unwrap_or(&[]);
            sib.iter().position(|&s| s == id).unwrap_or(0)
        };
        let mut order = node.cpus.clone();
        order.sort_by_key(|&id| (rank(id), id));
        order
    }
}

fn read_nodes(dir: &Path, online: &[u32]) -> Result<(Vec<HostNode>, Vec<Vec<u8>>)> {
    let entries = std::fs::read_dir(dir).map_err(|e| read_err(dir, e.to_string()))?;
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| read_err(dir, e.to_string()))?;
        let name = entry.file_name();
        if let Some(id) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok()) {
            ids.push(id);
        }
    }
    if ids.is_empty() {
        return Err(read_err(dir, "no nodeN directories".into()));
    }
    ids.sort_unstable();

    let mut nodes: Vec<HostNode> = Vec::with_capacity(ids.len());
    let mut distances = Vec::with_capacity(ids.len());
    for &id in &ids {
        let node = dir.join(format!("node{id}"));
        let path = node.join("cpulist");
        let mut cpus = parse_cpulist(&read_text(&path)?).map_err(|what| read_err(&path, what))?;
        cpus.retain(|c| online.contains(c));
        if let Some(&cpu) = cpus.iter().find(|c| nodes.iter().any(|n| n.cpus.contains(c))) {
            return Err(read_err(&path, format!("cpu {cpu} is also in another node")));
        }
        let path = node.join("meminfo");
        let memory = mem_total(&read_text(&path)?).ok_or_else(|| read_err(&path, "no MemTotal line".into()))?;
        let path = node.join("distance");
        let row: Vec<u8> = read_text(&path)?
            .split_whitespace()
            .map(|v| v.parse::<u8>().map_err(|_| read_err(&path, format!("distance {v:?} is not a number 0..=255"))))
            .collect::<Result<_>>()?;
        if row.len() != ids.len() {
            let what = format!("{} distances for {} nodes", row.len(), ids.len());
            return Err(read_err(&path, what));
        }
        nodes.push(HostNode { id, cpus, memory });
        distances.push(row);
    }
    Ok((nodes, distances))
}

fn read_err(path: &Path, what: String) -> HostTopologyError {
    HostTopologyError::Read { path: path.display().to_string(), what }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| read_err(path, e.to_string()))
}

fn read_number(path: &Path) -> Result<u32> {
    let text = read_text(path)?;
    text.trim().parse().map_err(|_| read_err(path, format!("{:?} is not a number", text.trim())))
}

/// MemTotal in bytes from `/proc/meminfo` or a node's `meminfo` ("Node 0 MemTotal: 123 kB").
fn mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find_map(|l| l.split_once("MemTotal:").map(|(_, v)| v))?;
    let kb: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kb.checked_mul(1024)
}

/// Parses a kernel CPU list ("0-3,8-11,16", trailing newline allowed; "" or "\n" is no CPU)
/// into ascending, distinct ids.
pub fn parse_cpulist(text: &str) -> std::result::Result<Vec<u32>, String> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Ok(cpus);
    }
    for part in text.split(',') {
        let num = |s: &str| s.parse::<u32>().map_err(|_| format!("{part:?} in CPU list {text:?} is not N or N-M"));
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b {
            return Err(format!("range {part:?} in CPU list {text:?} runs backwards"));
        }
        if b - a >= 1 << 16 {
            return Err(format!("range {part:?} in CPU list {text:?} is too large"));
        }
        cpus.extend(a..=b);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Formats ascending CPU ids the kernel's way: `[0,1,2,3,8,16]` → "0-3,8,16".
pub fn format_cpulist(cpus: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        let sep = if out.is_empty() { "" } else { "," };
        let _ = match j > i {
            true => write!(out, "{sep}{}-{}", cpus[i], cpus[j]),
            false => write!(out, "{sep}{}", cpus[i]),
        };
        i = j + 1;
    }
    out
}

/// One guest node of a mirror plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorNode {
    /// Guest node id (`0..N`), also its ACPI proximity domain.
    pub id: u32,
    /// The host node it copies: bind its memory there (`mbind`).
    pub host_node: u32,
    /// Its vCPUs, ascending and consecutive across nodes (node 0 has vCPUs `0..k`).
    pub vcpus: Vec<u32>,
    /// Its memory in bytes.
    pub memory: u64,
}

/// What `--numa mirror` builds: guest nodes copying the host's, the distances between them
/// and where each vCPU runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorPlan {
    pub nodes: Vec<MirrorNode>,
    /// `distances[a][b]` between guest nodes, copied from the host's table.
    pub distances: Vec<Vec<u8>>,
    /// `pins[v]`: the host CPU vCPU `v` is pinned to; no two vCPUs share one.
    pub pins: Vec<u32>,
}

impl MirrorPlan {
    /// Each guest node's memory in node order: what `kumo_acpi::split_memory` takes.
    pub fn memory_sizes(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.memory).collect()
    }
}

/// Plans a guest of `vcpus` vCPUs and `memory` bytes that mirrors `host`:
/// - guest node `i` copies the `i`-th host node (host nodes with neither CPUs nor memory, and
///   CPU-only host nodes left without a vCPU, are skipped), and the host's distances between
///   the kept nodes are copied;
/// - vCPUs are spread evenly over the nodes with CPUs (one per node in turn, lowest node first;
///   a node that runs out of CPUs drops out) and pinned one-to-one to host CPUs of their node,
///   physical cores before SMT siblings ([`HostTopology::fill_order`]); no overcommit;
/// - memory is split evenly over the nodes with memory, in [`MIRROR_UNIT`] (2 MiB) pieces,
///   the lowest nodes taking the leftover pieces and the last node any remainder below 2 MiB,
///   so the sizes sum exactly to `memory`. Even rather than in proportion to host memory:
///   nodes of one machine differ only by what firmware and kernel reserved, and an even split
///   is what a user of a symmetric machine expects. A share larger than its host node is
///   refused.
pub fn mirror(host: &HostTopology, vcpus: u32, memory: u64) -> Result<MirrorPlan> {
    if vcpus == 0 {
        return Err(HostTopologyError::NoVcpus);
    }
    let online = host.nodes.iter().map(|n| n.cpus.len() as u32).sum::<u32>();
    if vcpus > online {
        return Err(HostTopologyError::TooManyVcpus { vcpus, host: online });
    }
    if memory > host.memory() {
        return Err(HostTopologyError::TooMuchMemory { memory, host: host.memory() });
    }

    let orders: Vec<Vec<u32>> = host.nodes.iter().map(|n| host.fill_order(n)).collect();
    let mut counts = vec![0usize; host.nodes.len()];
    let mut left = vcpus as usize;
    while left > 0 {
        for (count, order) in counts.iter_mut().zip(&orders) {
            if left > 0 && *count < order.len() {
                *count += 1;
                left -= 1;
            }
        }
    }

    let with_memory: Vec<usize> = (0..host.nodes.len()).filter(|&i| host.nodes[i].memory > 0).collect();
    let mut shares = vec![0u64; host.nodes.len()];
    if let Some(&last) = with_memory.last() {
        let units = memory / MIRROR_UNIT;
        let m = with_memory.len() as u64;
        for (k, &i) in with_memory.iter().enumerate() {
            shares[i] = (units / m + u64::from((k as u64) < units % m)) * MIRROR_UNIT;
        }
        shares[last] += memory % MIRROR_UNIT;
    }

    let kept: Vec<usize> = (0..host.nodes.len()).filter(|&i| counts[i] > 0 || shares[i] > 0).collect();
    let mut plan = MirrorPlan { nodes: Vec::new(), distances: Vec::new(), pins: Vec::new() };
    for (g, &i) in kept.iter().enumerate() {
        let hn = &host.nodes[i];
        if shares[i] > hn.memory {
            return Err(HostTopologyError::NodeMemory {
                node: g as u32,
                host_node: hn.id,
                share: shares[i],
                host: hn.memory,
            });
        }
        let first = plan.pins.len() as u32;
        plan.pins.extend_from_slice(&orders[i][..counts[i]]);
        let vcpus = (first..plan.pins.len() as u32).collect();
        plan.nodes.push(MirrorNode { id: g as u32, host_node: hn.id, vcpus, memory: shares[i] });
        // A hand-built HostTopology may lack rows: fall back to Linux's defaults, never panic.
        let distance =
            |j: usize| host.distances.get(i).and_then(|r| r.get(j)).copied().unwrap_or(if i == j { 10 } else { 20 });
        plan.distances.push(kept.iter().map(|&j| distance(j)).collect());
    }
    Ok(plan)
}

/// Parses a pin spec, the value of `pin=`: `V@H` pairs (vCPU `V` runs on host CPU `H`)
/// separated by `:` or `,`, where a pair may also be two ranges of one length,
/// `A-B@C-D` (vCPU `A` on `C`, `A+1` on `C+1`, …). Refuses a vCPU the VM (`vcpus`) lacks, a
/// vCPU pinned twice and a host CPU not in `online`. Returns `(vcpu, host_cpu)` ascending by
/// vCPU. Two vCPUs may share a host CPU (see [`is_dedicated`]).
pub fn parse_pins(spec: &str, vcpus: u32, online: &[u32]) -> Result<Vec<(u32, u32)>> {
    let err = |what: String| HostTopologyError::Pin { spec: spec.to_string(), what };
    if spec.trim().is_empty() {
        return Err(err("empty; give vCPU@hostCPU pairs, e.g. pin=0@2:1@3".into()));
    }
    let range = |s: &str| -> Option<(u32, u32)> {
        let (a, b) = s.split_once('-').unwrap_or((s, s));
        let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        (a <= b).then_some((a, b))
    };
    let mut pins: Vec<(u32, u32)> = Vec::new();
    for item in spec.split([':', ',']) {
        let bad = || err(format!("{item:?} is not vCPU@hostCPU (or A-B@C-D)"));
        let (v, h) = item.split_once('@').ok_or_else(bad)?;
        let ((v0, v1), (h0, h1)) = (range(v).ok_or_else(bad)?, range(h).ok_or_else(bad)?);
        if v1 - v0 != h1 - h0 {
            return Err(err(format!("{item:?} pins {} vCPUs to {} host CPUs", v1 - v0 + 1, h1 - h0 + 1)));
        }
        for (v, h) in (v0..=v1).zip(h0..=h1) {
            if v >= vcpus {
                return Err(err(format!("vCPU {v} does not exist (the VM has {vcpus} vCPUs)")));
            }
            if pins.iter().any(|&(p, _)| p == v) {
                return Err(err(format!("vCPU {v} is pinned twice")));
            }
            if !online.contains(&h) {
                return Err(err(format!("host CPU {h} is not online (online: {})", format_cpulist(online))));
            }
            pins.push((v, h));
        }
    }
    pins.sort_unstable();
    Ok(pins)
}

/// Parses the value of `--cpus`: `N` or `N,pin=SPEC` ([`parse_pins`] reads `SPEC`, so
/// `--cpus 2,pin=0@0,1@1` and `--cpus 2,pin=0@0:1@1` both work). Returns the vCPU count and
/// `pins[v]`, the host CPU of vCPU `v` (`None`, or past the end: not pinned, it floats); no
/// `pin=`: empty. The count itself is checked where the VM is (at least 1, KVM's limit).
pub fn parse_cpus_arg(arg: &str, online: &[u32]) -> std::result::Result<(u32, Vec<Option<u32>>), String> {
    let (n, rest) = arg.split_once(',').unwrap_or((arg, ""));
    let n: u32 =
        n.trim().parse().map_err(|_| format!("--cpus {arg}: {n:?} is not a vCPU count (give N or N,pin=V@H:V@H)"))?;
    if rest.is_empty() {
        return Ok((n, Vec::new()));
    }
    let spec = rest
        .strip_prefix("pin=")
        .ok_or_else(|| format!("--cpus {arg}: {rest:?} is not pin=SPEC (give N or N,pin=V@H:V@H)"))?;
    let pairs = parse_pins(spec, n, online).map_err(|e| format!("--cpus: {e}"))?;
    // Sized by the pinned vCPUs (each below n), not by n: a huge n is refused later, not here.
    let mut pins = vec![None; pairs.last().map_or(0, |&(v, _)| v as usize + 1)];
    for (v, h) in pairs {
        pins[v as usize] = Some(h);
    }
    Ok((n, pins))
}

/// Whether `pins` gives each of `vcpus` vCPUs a host CPU of its own: the dedicated case where
/// the PV hints for an overcommitted host (PV halt, steal time) should be off.
pub fn is_dedicated(pins: &[(u32, u32)], vcpus: u32) -> bool {
    let mut hosts: Vec<u32> = pins.iter().map(|&(_, h)| h).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let mut v: Vec<u32> = pins.iter().map(|&(v, _)| v).filter(|&v| v < vcpus).collect();
    v.sort_unstable();
    v.dedup();
    hosts.len() == pins.len() && v.len() == vcpus as usize
}

/// The calling thread at real-time priority (`SCHED_FIFO` 1) until dropped, when its old policy
/// comes back. For control threads that must not wait behind vCPU threads spinning on every
/// host CPU (elastic sharing's lend path): they block in between, so they cannot starve the
/// vCPUs. Without CAP_SYS_NICE it is an error and the caller runs on unprioritized.
pub struct RealtimeGuard {
    policy: libc::c_int,
    param: libc::sched_param,
}

pub fn realtime_this_thread() -> std::io::Result<RealtimeGuard> {
    // SAFETY: sched_getscheduler/sched_getparam/sched_setscheduler with pid 0 act on the calling
    // thread only; `param` is a valid sched_param the calls read or fill.
    unsafe {
        let policy = libc::sched_getscheduler(0);
        let mut param: libc::sched_param = std::mem::zeroed();
        if policy < 0 || libc::sched_getparam(0, &mut param) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rt = libc::sched_param { sched_priority: 1 };
        if libc::sched_setscheduler(0, libc::SCHED_FIFO, &rt) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RealtimeGuard { policy, param })
    }
}

impl Drop for RealtimeGuard {
    fn drop(&mut self) {
        // SAFETY: as above: the calling thread's own policy, from values it had before.
        unsafe {
            libc::sched_setscheduler(0, self.policy, &self.param);
        }
    }
}

/// Pins the calling thread to host CPU `cpu` (`sched_setaffinity`); a vCPU thread calls it
/// before its first `KVM_RUN`, and again when re-pinned.
pub fn pin_thread(cpu: u32) -> std::io::Result<()> {
    if cpu as usize >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("host CPU {cpu} is beyond CPU_SETSIZE"),
        ));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (cpu < CPU_SETSIZE
    // checked above) and sched_setaffinity(0 = this thread) reads exactly size_of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the CPUs thread `tid` (a kernel thread id; 0: the calling thread) may run on: how a
/// vCPU is re-pinned (or, with every online CPU, unpinned) from the API thread without waking it.
pub fn set_affinity(tid: i32, cpus: &[u32]) -> std::io::Result<()> {
    if let Some(&c) = cpus.iter().find(|&&c| c as usize >= libc::CPU_SETSIZE as usize) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("host CPU {c} is beyond CPU_SETSIZE"),
        ));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (every cpu checked
    // below CPU_SETSIZE above) and sched_setaffinity reads exactly size_of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c as usize, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The host CPUs thread `tid` (0: the calling thread) may run on, ascending.
pub fn affinity_of(tid: i32) -> std::io::Result<Vec<u32>> {
    // SAFETY: sched_getaffinity writes at most size_of cpu_set_t into a set we own;
    // CPU_ISSET reads it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as u32).filter(|&c| libc::CPU_ISSET(c as usize, &set)).collect())
    }
}

/// The calling thread's kernel thread id.
pub fn this_tid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The host CPUs the calling thread may run on (`sched_getaffinity`), ascending.
pub fn thread_affinity() -> std::io::Result<Vec<u32>> {
    // SAFETY: sched_getaffinity(0 = this thread) writes at most size_of cpu_set_t into a set we
    // own; CPU_ISSET reads it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as u32).filter(|&c| libc::CPU_ISSET(c as usize, &set)).collect())
    }
}

#[cfg(test)]
mod tests;
