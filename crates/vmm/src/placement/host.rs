//! The host's NUMA and CPU topology as sysfs describes it, and the one CPU-list parser (the
//! kernel's `0-3,8-11` and kumo's `cpus=0-1:4`). Pure: the reader takes the root of a tree (`/`
//! on a live host, a recorded tree in tests: `crates/vmm/tests/fixtures/sysfs-*`).

use std::fmt::Write as _;
use std::path::Path;

use super::{PlacementError, Result};

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
        let online = parse_cpu_set(&read_text(&online_path)?).map_err(|what| read_err(&online_path, what))?;
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
            let siblings = parse_cpu_set(&read_text(&path)?).map_err(|what| read_err(&path, what))?;
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
        let mut cpus = parse_cpu_set(&read_text(&path)?).map_err(|what| read_err(&path, what))?;
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

fn read_err(path: &Path, what: String) -> PlacementError {
    PlacementError::Read { path: path.display().to_string(), what }
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

/// The one CPU-list parser: ranges `A-B` and single CPUs joined by `sep`: `,` in the kernel's
/// files (`0-3,8-11,16`), `:` inside kumo's comma-separated `key=value` specs (`cpus=0-1:4`,
/// `pin=3:5`, `--elastic cpus=1:3`). The written order and repeats are kept (a `pin=` list is
/// positional); whitespace around the whole list is ignored, and "" (or "\n") is no CPU.
pub fn parse_cpu_list(text: &str, sep: char) -> std::result::Result<Vec<u32>, String> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Ok(cpus);
    }
    for part in text.split(sep) {
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
    Ok(cpus)
}

/// A kernel CPU list file's CPUs ([`parse_cpu_list`] with `,`), ascending and distinct.
pub fn parse_cpu_set(text: &str) -> std::result::Result<Vec<u32>, String> {
    let mut cpus = parse_cpu_list(text, ',')?;
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
