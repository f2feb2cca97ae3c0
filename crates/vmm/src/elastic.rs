//! The VM side of elastic sharing (seed 002, part 2; the channel's layout, the coordinator and
//! the exclusivity check are `kumo_elastic`). A VM started with `--elastic` holds some host
//! CPUs (one vCPU pinned on each) and some blocks of elastic memory per guest node; its other
//! vCPUs are spares, parked from boot, and its other blocks are unplugged (no host pages).
//!
//! - **Release** (`vm.release`): the guest is asked to vacate vCPUs / give blocks up; once it
//!   confirms, kumo parks those vCPU threads (blocked in kumo, costing no host CPU) or discards
//!   those blocks' host pages, and records the release.
//! - **Acquire** (`vm.acquire`): kumo records the acquisition, re-pins parked vCPUs onto the
//!   host CPUs it got and starts them, or plugs zeroed blocks, and waits until the guest
//!   confirms the vCPUs do work and the blocks are in use.
//!
//! A guest that does not confirm within the request's timeout gets the request withdrawn
//! (CANCEL) and the VM is left as it was. vCPU 0 is the guest's boot and housekeeping vCPU: it
//! floats and is never lent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kumo_api::{
    AcquireRequest, Acquired, ElasticEvent, ElasticEventKind as Kind, ElasticInfo, ElasticNode, ElasticVcpu,
    MemoryGrant, ReleaseRequest, Released,
};
use kumo_elastic::mailbox::{self, blocks_count, blocks_iter, blocks_set, Area, Blocks, Layout, Mailbox, Op};
use kumo_vm::interrupts::{Datamatch, IoAddress};
use kumo_vm::GuestMemory;
use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vcpu_manager::VcpuManager;
use crate::Error;

/// Default elastic block: one 2 MiB page.
pub const DEFAULT_BLOCK: u64 = 2 << 20;

/// `--elastic cpus=LIST,memory=SIZE[,plugged=SIZE][,block=SIZE]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElasticConfig {
    /// Host CPUs the VM holds at boot: vCPU 1 is pinned on the first, vCPU 2 on the second...
    /// vCPUs past them are spares, parked until the VM acquires a host CPU.
    #[serde(default)]
    pub cpus: Vec<u32>,
    /// Elastic memory of each guest node (the top of its RAM), bytes.
    #[serde(default, deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub memory: u64,
    /// How much of each node's elastic memory is plugged at boot (default: all of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugged: Option<u64>,
    /// The unit memory moves in, a multiple of 2 MiB.
    #[serde(default = "default_block", deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub block: u64,
}

fn default_block() -> u64 {
    DEFAULT_BLOCK
}

impl ElasticConfig {
    /// Parses the `--elastic` syntax (CPU lists as in `--numa`: `1-3` or `1:3`).
    pub fn parse(s: &str) -> Result<ElasticConfig, Error> {
        let bad = |m: String| Error::Config(format!("--elastic {s}: {m}"));
        let mut c = ElasticConfig { cpus: Vec::new(), memory: 0, plugged: None, block: DEFAULT_BLOCK };
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            let size = |v: &str| kumo_vm::parse_size(v).map_err(bad);
            match k {
                "cpus" if v.is_empty() => c.cpus.clear(),
                "cpus" => {
                    c.cpus = crate::placement::parse_cpu_list(v, ':').map_err(|e| bad(format!("cpus={v}: {e}")))?
                }
                "memory" => c.memory = size(v)?,
                "plugged" => c.plugged = Some(size(v)?),
                "block" => c.block = size(v)?,
                _ => return Err(bad(format!("unknown key `{k}` (cpus, memory, plugged, block)"))),
            }
        }
        Ok(c)
    }

    /// Checks what does not need the VM's memory map.
    pub fn validate(&self, ncpus: u32) -> Result<(), Error> {
        let bad = |m: String| Error::Config(format!("--elastic: {m}"));
        if ncpus > mailbox::MAX_CPUS {
            return Err(bad(format!("an elastic VM has at most {} vCPUs", mailbox::MAX_CPUS)));
        }
        if self.cpus.len() as u32 >= ncpus {
            return Err(bad(format!(
                "{} host CPUs need {} vCPUs (vCPU 0 is the guest's own and never pinned); the VM has {ncpus}",
                self.cpus.len(),
                self.cpus.len() + 1
            )));
        }
        let mut seen = self.cpus.clone();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad(format!("host CPU {} is given twice", w[0])));
        }
        if self.block == 0 || !self.block.is_multiple_of(mailbox::BLOCK_ALIGN) {
            return Err(bad(format!("block={} is not a multiple of 2 MiB", self.block)));
        }
        if !self.memory.is_multiple_of(self.block) {
            return Err(bad(format!("memory={} is not a whole number of {}-byte blocks", self.memory, self.block)));
        }
        let plugged = self.plugged.unwrap_or(self.memory);
        if plugged > self.memory || !plugged.is_multiple_of(self.block) {
            return Err(bad(format!("plugged={plugged} must be whole blocks, at most memory={}", self.memory)));
        }
        Ok(())
    }

    /// `pins[v]` for the VM's vCPUs: vCPU i+1 on `cpus[i]`, the others floating.
    pub fn pins(&self, ncpus: u32) -> Vec<Option<u32>> {
        (0..ncpus).map(|v| if v == 0 { None } else { self.cpus.get(v as usize - 1).copied() }).collect()
    }

    /// The vCPUs parked from boot (the spares).
    pub fn spares(&self, ncpus: u32) -> Vec<u32> {
        (self.cpus.len() as u32 + 1..ncpus).collect()
    }
}

/// One guest node's elastic area, where it lies and which host node backs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AreaPlan {
    pub node: u32,
    pub host_node: Option<u32>,
    pub gpa: u64,
    pub len: u64,
}

/// The elastic area of each guest node: the top `memory` bytes of its RAM (of the only node
/// without `--numa`). Each node keeps some RAM of its own below it.
pub fn plan_areas(
    cfg: &ElasticConfig,
    layout: &kumo_vm::layout::MemoryLayout,
    numa: Option<(&crate::placement::NumaConfig, &kumo_acpi::NumaTopology)>,
) -> Result<Vec<AreaPlan>, Error> {
    if cfg.memory == 0 {
        return Ok(Vec::new());
    }
    let nodes: Vec<(u32, Option<u32>, (u64, u64))> = match numa {
        None => vec![(0, None, *layout.ram().last().ok_or_else(|| Error::Config("the VM has no RAM".into()))?)],
        Some((n, topo)) => topo
            .nodes
            .iter()
            .map(|t| {
                let host = n.nodes.iter().find(|s| s.id == t.id).and_then(|s| s.host_node);
                let last = t.memory.last().copied().unwrap_or((0, 0));
                (t.id, host, last)
            })
            .collect(),
    };
    let mut out = Vec::new();
    for (node, host_node, (start, len)) in nodes {
        let keep = 16 << 20;
        if len < cfg.memory + keep {
            return Err(Error::Config(format!(
                "--elastic memory={}: guest node {node}'s top RAM range is {}; it must hold the elastic memory and 16 MiB more",
                kumo_vm::memory::human_size(cfg.memory),
                kumo_vm::memory::human_size(len)
            )));
        }
        let gpa = (start + len - cfg.memory) & !(mailbox::BLOCK_ALIGN - 1);
        out.push(AreaPlan { node, host_node, gpa, len: cfg.memory });
    }
    let blocks: u64 = out.iter().map(|a| a.len / cfg.block).sum();
    if blocks > mailbox::MAX_BLOCKS as u64 {
        return Err(Error::Config(format!(
            "--elastic: {blocks} blocks in all; at most {} (use a larger block=)",
            mailbox::MAX_BLOCKS
        )));
    }
    Ok(out)
}

/// Why an elastic request failed: one line (its API error kind: `From` in api.rs).
#[derive(Debug, thiserror::Error)]
pub enum ElasticError {
    /// A request that cannot be met as asked.
    #[error("{0}")]
    Bad(String),
    /// Not now: not enough to give, no spare vCPU, the VM is paused.
    #[error("{0}")]
    Conflict(String),
    /// The guest did not confirm in time or refused; nothing changed.
    #[error("{0}")]
    Guest(String),
    #[error("{0}")]
    Failed(String),
}

type R<T> = Result<T, ElasticError>;

#[derive(Debug, Clone)]
struct Hold {
    host_cpu: Option<u32>,
    parked: bool,
    lender: Option<String>,
    /// The host CPU it held at boot: a CPU coming back goes to its old vCPU.
    home: Option<u32>,
}

struct State {
    vcpus: Vec<Hold>,
    plugged: Blocks,
    /// Per area: bytes borrowed, by lender.
    borrowed: Vec<BTreeMap<String, u64>>,
    events: Vec<ElasticEvent>,
}

/// A VM's elastic side: its mailbox, doorbell and what it holds.
pub struct ElasticVm {
    layout: Layout,
    host_nodes: Vec<Option<u32>>,
    /// The host node each vCPU's guest node is bound to (`--numa …,host-node=`), if any.
    vcpu_host_node: Vec<Option<u32>>,
    /// The host node of each host CPU, read at boot.
    cpu_node: BTreeMap<u32, u32>,
    mailbox: Mailbox<GuestMemory>,
    mem: GuestMemory,
    /// Where blocks the guest does not hold are fenced off (kumo_vm::memory::Fences).
    fences: Arc<kumo_vm::memory::Fences>,
    /// The channel's vector goes through the VM's interrupt layer, to KVM's LAPICs or kumo's.
    irq: Arc<kumo_vm::interrupts::Interrupts>,
    doorbell: EventFd,
    epoll: Epoll,
    /// One request at a time: the channel has one request slot.
    state: Mutex<State>,
}

/// Most events kept (a VM lending every second for a day stays far below it).
const MAX_EVENTS: usize = 1 << 20;

fn now_ns() -> u64 {
    crate::vcpu_manager::monotonic_ns()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

impl ElasticVm {
    /// Writes the mailbox, registers the doorbell and records what the VM holds at boot.
    pub(crate) fn new(
        vm: &kumo_vm::Vm,
        cfg: &ElasticConfig,
        areas: &[AreaPlan],
        ncpus: u32,
        vcpu_host_node: Vec<Option<u32>>,
    ) -> Result<ElasticVm, Error> {
        let mut first = 0;
        let layout = Layout {
            ncpus,
            block_bytes: cfg.block,
            areas: areas
                .iter()
                .map(|a| {
                    let n = (a.len / cfg.block) as u32;
                    let area = Area { base: a.gpa, first_block: first, nblocks: n, node: a.node };
                    first += n;
                    area
                })
                .collect(),
        };
        let fail = |e: String| Error::Config(format!("--elastic: {e}"));
        layout.check().map_err(fail)?;
        let per_node = cfg.plugged.unwrap_or(cfg.memory) / cfg.block;
        let mut plugged = [0u64; 16];
        for a in &layout.areas {
            for b in a.first_block..a.first_block + per_node as u32 {
                blocks_set(&mut plugged, b, true);
            }
        }
        let allowed = mask_of(0..=cfg.cpus.len() as u32);
        let mem = vm.memory.guest.clone();
        let mailbox = Mailbox::new(mem.clone(), mailbox::MAILBOX_GPA);
        mailbox.init(&layout, allowed, &plugged).map_err(fail)?;
        let doorbell = EventFd::new(EFD_NONBLOCK).map_err(|e| fail(format!("doorbell eventfd: {e}")))?;
        vm.interrupts
            .register_ioeventfd(&doorbell, IoAddress::Pio(mailbox::PORT), Datamatch::Any)
            .map_err(|e| fail(format!("doorbell: {e}")))?;
        let epoll = Epoll::new().map_err(|e| fail(format!("epoll: {e}")))?;
        epoll
            .ctl(ControlOperation::Add, doorbell_fd(&doorbell), EpollEvent::new(EventSet::IN, 0))
            .map_err(|e| fail(format!("epoll: {e}")))?;
        let t = now_ns();
        let mut events = Vec::new();
        let mut vcpus = Vec::new();
        for v in 0..ncpus {
            let host_cpu = if v == 0 { None } else { cfg.cpus.get(v as usize - 1).copied() };
            if let Some(c) = host_cpu {
                events.push(ElasticEvent {
                    t_ns: t,
                    kind: Kind::CpuAcquired,
                    vcpu: Some(v),
                    host_cpu: Some(c),
                    node: None,
                    host_node: None,
                    bytes: 0,
                    at_boot: true,
                });
            }
            vcpus.push(Hold { host_cpu, parked: v != 0 && host_cpu.is_none(), lender: None, home: host_cpu });
        }
        for (a, p) in layout.areas.iter().zip(areas) {
            events.push(ElasticEvent {
                t_ns: t,
                kind: Kind::MemAcquired,
                vcpu: None,
                host_cpu: None,
                node: Some(a.node),
                host_node: p.host_node,
                bytes: per_node * cfg.block,
                at_boot: true,
            });
        }
        let cpu_node = crate::placement::HostTopology::read_live()
            .map(|t| t.cpus.iter().map(|c| (c.id, c.node)).collect())
            .unwrap_or_default();
        let evm = ElasticVm {
            host_nodes: areas.iter().map(|a| a.host_node).collect(),
            vcpu_host_node,
            cpu_node,
            layout,
            mailbox,
            mem,
            fences: vm.memory.fences.clone(),
            irq: vm.interrupts.clone(),
            doorbell,
            epoll,
            state: Mutex::new(State { vcpus, plugged, borrowed: vec![BTreeMap::new(); areas.len()], events }),
        };
        // The blocks not plugged at boot are out of the guest's reach from the start.
        let mut unplugged = [0u64; 16];
        for b in 0..evm.layout.areas.iter().map(|a| a.first_block + a.nblocks).max().unwrap_or(0) {
            blocks_set(&mut unplugged, b, plugged[b as usize / 64] & (1 << (b % 64)) == 0);
        }
        evm.unplug(&unplugged, "the guest was not given").map_err(|e| fail(e.to_string()))?;
        Ok(evm)
    }
}

impl ElasticVm {
    fn lock(&self) -> MutexGuard<'_, State> {
        kumo_sandbox::lock(&self.state)
    }

    fn channel<T>(&self, r: Result<T, String>) -> R<T> {
        r.map_err(ElasticError::Failed)
    }

    /// Sends the channel's vector to vCPU `v` (its APIC ID is its index): wakes it if halted.
    fn notify(&self, v: u32) -> R<()> {
        let msg = kumo_vm::interrupts::MsiMessage {
            address: 0xfee0_0000 | (u64::from(v) << 12),
            data: mailbox::VECTOR.into(),
        };
        self.irq.send_msi(msg).map_err(|e| ElasticError::Failed(format!("the channel's MSI to vCPU {v}: {e}")))
    }

    fn notify_all(&self, mask: u64) -> R<()> {
        (0..64).filter(|v| mask & (1 << v) != 0).try_for_each(|v| self.notify(v))
    }

    /// Posts a request and wakes vCPU 0 and the vCPUs in `wake`.
    fn post(&self, op: Op, cpus: u64, node: u32, nblocks: u32, mem: &Blocks, wake: u64) -> R<u32> {
        // Stale doorbells from an earlier request must not end this wait early.
        let _ = self.doorbell.read();
        let seq = self.channel(self.mailbox.post(op, cpus, node, nblocks, mem))?;
        // seq is stored before any cpu_state is read, as the guest stores cpu_state (idle)
        // before it reads seq to halt: one side sees the other's write (Dekker), so a vCPU
        // read as working will see this request at its next work unit, without an interrupt.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let working = |v: u32| self.mailbox.cpu_state(v) == Ok(1);
        let busy: u64 = (0..64).filter(|&v| cpus & (1 << v) != 0 && working(v)).fold(0, |m, v| m | 1 << v);
        // A vacate reaches a working vCPU between its work units: an interrupt would cost it
        // ring-0 code (emulated on nested hosts, where it held vacates up to 3 ms), and vCPU 0,
        // woken, would only be a floating vCPU thread in the way of the ones that answer.
        let (wake, vcpu0) = match op {
            Op::VacateCpus => (wake & !busy, cpus == 0 || busy & !1 != cpus & !1),
            _ => (wake, true),
        };
        self.notify_all(wake | u64::from(vcpu0))?;
        Ok(seq)
    }

    /// Waits for the guest's answer to request `seq`: Ok if it confirmed, a `Guest` error if it
    /// refused or did not answer within `timeout`.
    fn wait_ack(&self, seq: u32, timeout: Duration, what: &str) -> R<()> {
        let deadline = Instant::now() + timeout;
        let mut events = [EpollEvent::default(); 1];
        loop {
            let ack = self.channel(self.mailbox.ack())?;
            if ack.seq == seq {
                return match ack.status {
                    mailbox::ACK_OK => Ok(()),
                    s => Err(ElasticError::Guest(format!("the guest refused to {what} (status {s}); nothing changed"))),
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ElasticError::Guest(format!(
                    "the guest did not confirm it would {what} within {} ms; nothing changed",
                    timeout.as_millis()
                )));
            }
            let wait_ms = left.as_millis().clamp(1, 1000) as i32;
            match self.epoll.wait(wait_ms, &mut events) {
                Ok(_) => {
                    let _ = self.doorbell.read();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ElasticError::Failed(format!("waiting for the guest: {e}"))),
            }
        }
    }

    /// Changes the vCPUs the guest may work on (the grant; no request is posted).
    fn update_allowed(&self, f: impl FnOnce(u64) -> u64) -> R<()> {
        let allowed = self.channel(self.mailbox.cpus_allowed())?;
        self.channel(self.mailbox.set_cpus_allowed(f(allowed)))
    }

    /// Books vCPU `v`, whose thread is parked now, as holding no host CPU, and records it.
    fn mark_parked(ctl: &VcpuManager, st: &mut State, v: u32) {
        let h = &mut st.vcpus[v as usize];
        let c = h.host_cpu.take().unwrap_or(0);
        h.parked = true;
        h.lender = None;
        Self::record(st, Self::cpu_event(Kind::CpuReleased, v, c));
        // Parked, it runs nowhere; unpinned, a later pin does not race a stale one.
        let _ = ctl.set_pin(v, None);
    }

    fn record(st: &mut State, e: ElasticEvent) {
        if st.events.len() < MAX_EVENTS {
            st.events.push(e);
        }
    }

    fn cpu_event(kind: Kind, v: u32, c: u32) -> ElasticEvent {
        ElasticEvent {
            t_ns: now_ns(),
            kind,
            vcpu: Some(v),
            host_cpu: Some(c),
            node: None,
            host_node: None,
            bytes: 0,
            at_boot: false,
        }
    }

    fn mem_event(&self, kind: Kind, area: usize, bytes: u64) -> ElasticEvent {
        ElasticEvent {
            t_ns: now_ns(),
            kind,
            vcpu: None,
            host_cpu: None,
            node: Some(self.layout.areas[area].node),
            host_node: self.host_nodes[area],
            bytes,
            at_boot: false,
        }
    }

    fn area_blocks(&self, area: usize) -> std::ops::Range<u32> {
        let a = &self.layout.areas[area];
        a.first_block..a.first_block + a.nblocks
    }

    fn plugged_in(&self, st: &State, area: usize) -> u64 {
        self.area_blocks(area).filter(|&b| st.plugged[b as usize / 64] & (1 << (b % 64)) != 0).count() as u64
            * self.layout.block_bytes
    }

    /// Bytes of `area` the VM may give up: borrowed from `to` (a return), or its own.
    fn releasable(&self, st: &State, area: usize, to: &Option<String>) -> u64 {
        match to {
            Some(l) => st.borrowed[area].get(l).copied().unwrap_or(0),
            None => self.plugged_in(st, area).saturating_sub(st.borrowed[area].values().sum()),
        }
    }

    /// Takes `blocks` out of the guest's reach and drops their host pages: a guest touching
    /// one afterwards stops with an error naming it and saying the block is one `why`.
    fn unplug(&self, blocks: &Blocks, why: &str) -> R<()> {
        let failed = |e: kumo_vm::Error| ElasticError::Failed(e.to_string());
        for b in blocks_iter(blocks) {
            let gpa = self.layout.block_gpa(b).ok_or_else(|| ElasticError::Failed(format!("no block {b}")))?;
            let node = self.layout.areas.iter().find(|a| (a.first_block..a.first_block + a.nblocks).contains(&b));
            let what = format!("elastic block {b} of guest node {}, which {why}", node.map_or(0, |a| a.node));
            self.fences.fence(&self.mem, gpa, self.layout.block_bytes, &what).map_err(failed)?;
            kumo_vm::memory::discard(&self.mem, gpa, self.layout.block_bytes, true).map_err(failed)?;
        }
        Ok(())
    }

    /// Gives `blocks` back to the guest's reach, reading zeros.
    fn plug(&self, blocks: &Blocks) -> R<()> {
        let failed = |e: kumo_vm::Error| ElasticError::Failed(e.to_string());
        for b in blocks_iter(blocks) {
            let gpa = self.layout.block_gpa(b).ok_or_else(|| ElasticError::Failed(format!("no block {b}")))?;
            // Zero for certain before the guest can see it again.
            kumo_vm::memory::discard(&self.mem, gpa, self.layout.block_bytes, true).map_err(failed)?;
            self.fences.unfence(&self.mem, gpa, self.layout.block_bytes).map_err(failed)?;
        }
        Ok(())
    }

    /// `vm.release`.
    pub(crate) fn release(&self, ctl: &VcpuManager, req: &ReleaseRequest) -> R<Released> {
        let t0 = Instant::now();
        let timeout = Duration::from_millis(req.timeout_ms.max(1));
        ctl.check_running().map_err(ElasticError::Conflict)?;
        let mut st = self.lock();
        // Which vCPUs: those on the named host CPUs, or the last `cpus` the VM holds as asked.
        let held: Vec<u32> = (1..st.vcpus.len() as u32)
            .filter(|&v| {
                let h = &st.vcpus[v as usize];
                !h.parked && h.host_cpu.is_some() && h.lender == req.to
            })
            .collect();
        let whose = || match &req.to {
            Some(l) => format!("borrowed from {l}"),
            None => "of its own".to_string(),
        };
        let vcpus: Vec<u32> = if req.host_cpus.is_empty() {
            if held.len() < req.cpus as usize {
                return Err(ElasticError::Conflict(format!(
                    "the VM holds {} host CPUs {}; cannot release {}",
                    held.len(),
                    whose(),
                    req.cpus
                )));
            }
            held[held.len() - req.cpus as usize..].to_vec()
        } else {
            req.host_cpus
                .iter()
                .map(|&c| {
                    held.iter()
                        .copied()
                        .find(|&v| st.vcpus[v as usize].host_cpu == Some(c))
                        .ok_or_else(|| ElasticError::Conflict(format!("the VM holds no host CPU {c} {}", whose())))
                })
                .collect::<R<_>>()?
        };
        // Which memory: whole blocks of one node.
        let bs = self.layout.block_bytes;
        let mut area = None;
        if req.memory_bytes > 0 {
            if !req.memory_bytes.is_multiple_of(bs) {
                return Err(ElasticError::Bad(format!(
                    "memory_bytes={} is not a whole number of {bs}-byte blocks",
                    req.memory_bytes
                )));
            }
            let candidates: Vec<usize> = match req.node {
                Some(n) => (0..self.layout.areas.len()).filter(|&i| self.layout.areas[i].node == n).collect(),
                None => (0..self.layout.areas.len()).collect(),
            };
            let best = candidates.into_iter().max_by_key(|&i| self.releasable(&st, i, &req.to));
            match best {
                Some(i) if self.releasable(&st, i, &req.to) >= req.memory_bytes => area = Some(i),
                Some(i) => {
                    return Err(ElasticError::Conflict(format!(
                        "guest node {} has {} bytes of elastic memory {}; cannot release {}",
                        self.layout.areas[i].node,
                        self.releasable(&st, i, &req.to),
                        whose(),
                        req.memory_bytes
                    )))
                }
                None => return Err(ElasticError::Bad("the VM has no elastic memory on that node".into())),
            }
        }
        if vcpus.is_empty() && area.is_none() {
            return Err(ElasticError::Bad("nothing to release: give cpus, host_cpus or memory_bytes".into()));
        }
        let mut guest_ms = 0.0;
        let host_cpus: Vec<u32> = vcpus.iter().map(|&v| st.vcpus[v as usize].host_cpu.unwrap_or(0)).collect();
        if !vcpus.is_empty() {
            let mask = mask_of(vcpus.iter().copied());
            let t = Instant::now();
            let seq = self.post(Op::VacateCpus, mask, 0, 0, &[0; 16], mask)?;
            if let Err(e) = self.wait_ack(seq, timeout, "vacate its vCPUs") {
                self.post(Op::Cancel, mask, 0, 0, &[0; 16], mask)?;
                return Err(e);
            }
            guest_ms += ms(t);
            self.update_allowed(|a| a & !mask)?;
            // Kicked, not waited for. The kick's signal sets `immediate_exit`, so the thread
            // cannot enter the guest again, and one in the guest leaves at once (its CPU is
            // running: the kick lands in microseconds). A guest that has vacated halts its vCPU,
            // though, and waiting meant waking that thread on the CPU it had just left idle: the
            // release's part after the guest's answer took 0.123 ms at p50 with the wait and
            // 0.043 without on this host, and milliseconds where an idle CPU wakes slowly
            // (docs/elastic.md). It parks as it next runs.
            for &v in &vcpus {
                ctl.request_park(v);
                Self::mark_parked(ctl, &mut st, v);
            }
        }
        let mut grant = None;
        if let Some(a) = area {
            let k = (req.memory_bytes / bs) as u32;
            let node = self.layout.areas[a].node;
            let t = Instant::now();
            let step = self.post(Op::ReleaseMem, 0, node, k, &[0; 16], 0).and_then(|seq| {
                self.wait_ack(seq, timeout, "give memory up")?;
                let given = self.channel(self.mailbox.ack_mem())?;
                if mailbox::check_given(&given, k, self.area_blocks(a), &st.plugged) {
                    Ok(given)
                } else {
                    Err(ElasticError::Guest(format!(
                        "the guest gave up the wrong blocks ({} of {k} asked for, on node {node}); nothing changed",
                        blocks_count(&given)
                    )))
                }
            });
            let given = match step {
                Ok(g) => g,
                Err(e) => {
                    let _ = self.post(Op::Cancel, 0, 0, 0, &[0; 16], 0);
                    // Give the vCPUs vacated above back: the release changes nothing.
                    if !vcpus.is_empty() {
                        if let Err(back) = self.give_cpus(ctl, &mut st, &host_cpus, req.to.clone(), timeout) {
                            return Err(ElasticError::Failed(format!(
                                "{e}; and its vCPUs could not be given back: {back}"
                            )));
                        }
                    }
                    return Err(e);
                }
            };
            guest_ms += ms(t);
            for b in blocks_iter(&given) {
                blocks_set(&mut st.plugged, b, false);
            }
            self.channel(self.mailbox.set_plugged(&st.plugged))?;
            // Out of the guest's reach before the release is recorded.
            self.unplug(&given, "the guest released")?;
            if let Some(l) = &req.to {
                let left = st.borrowed[a].get(l).copied().unwrap_or(0).saturating_sub(req.memory_bytes);
                if left == 0 {
                    st.borrowed[a].remove(l);
                } else {
                    st.borrowed[a].insert(l.clone(), left);
                }
            }
            let ev = self.mem_event(Kind::MemReleased, a, req.memory_bytes);
            Self::record(&mut st, ev);
            grant = Some(MemoryGrant { bytes: req.memory_bytes, node, host_node: self.host_nodes[a] });
        }
        Ok(Released { host_cpus, memory: grant, lender: req.to.clone(), guest_ms, total_ms: ms(t0) })
    }

    /// Runs parked vCPUs on `host_cpus` and waits until the guest has them working. On failure
    /// they are parked again (the guest had not confirmed; its use of them ends there).
    fn give_cpus(
        &self,
        ctl: &VcpuManager,
        st: &mut State,
        host_cpus: &[u32],
        lender: Option<String>,
        timeout: Duration,
    ) -> R<Vec<u32>> {
        let mut chosen: Vec<u32> = Vec::new();
        for &c in host_cpus {
            if st.vcpus.iter().any(|h| h.host_cpu == Some(c)) {
                return Err(ElasticError::Conflict(format!("the VM already holds host CPU {c}")));
            }
            let pick = pick_spare(&st.vcpus, &chosen, c, self.cpu_node.get(&c).copied(), &self.vcpu_host_node);
            match pick {
                Some(v) => chosen.push(v),
                None => {
                    return Err(ElasticError::Conflict(format!(
                        "no parked vCPU left to run on host CPU {c} (the VM has {} vCPUs; give it more spares)",
                        st.vcpus.len()
                    )))
                }
            }
        }
        let mask = mask_of(chosen.iter().copied());
        for (&v, &c) in chosen.iter().zip(host_cpus) {
            ctl.set_pin(v, Some(c)).map_err(ElasticError::Failed)?;
        }
        for (&v, &c) in chosen.iter().zip(host_cpus) {
            // Recorded before the vCPU can run there.
            Self::record(st, Self::cpu_event(Kind::CpuAcquired, v, c));
            let h = &mut st.vcpus[v as usize];
            h.host_cpu = Some(c);
            h.parked = false;
            h.lender = lender.clone();
        }
        self.update_allowed(|a| a | mask)?;
        let _ = self.doorbell.read();
        let seq = self.channel(self.mailbox.post(Op::GiveCpus, mask, 0, 0, &[0; 16]))?;
        for &v in &chosen {
            ctl.unpark(v);
        }
        self.notify_all(mask)?;
        if let Err(e) = self.wait_ack(seq, timeout, "run its new vCPUs") {
            self.update_allowed(|a| a & !mask)?;
            let _ = self.post(Op::Cancel, mask, 0, 0, &[0; 16], mask);
            // A vCPU parked in the middle of a work unit would keep what it holds (a chunk):
            // give a slow guest the timeout again to stop, then park regardless.
            self.wait_idle(&chosen, timeout);
            for &v in &chosen {
                ctl.park(v).map_err(ElasticError::Failed)?;
                Self::mark_parked(ctl, st, v);
            }
            return Err(e);
        }
        Ok(chosen)
    }

    /// Waits (at most `timeout`, polling: a failure path only) until the guest reports the
    /// vCPUs idle.
    fn wait_idle(&self, vcpus: &[u32], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && !vcpus.iter().all(|&v| self.mailbox.cpu_state(v) == Ok(0)) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// `vm.acquire`.
    pub(crate) fn acquire(&self, ctl: &VcpuManager, req: &AcquireRequest) -> R<Acquired> {
        let t0 = Instant::now();
        let timeout = Duration::from_millis(req.timeout_ms.max(1));
        ctl.check_running().map_err(ElasticError::Conflict)?;
        let mut st = self.lock();
        let bs = self.layout.block_bytes;
        // Where memory goes: the node on the same host node, else the same node id, else 0.
        let mut target = None;
        if let Some(g) = req.memory.filter(|g| g.bytes > 0) {
            if !g.bytes.is_multiple_of(bs) {
                return Err(ElasticError::Bad(format!("{} bytes is not a whole number of {bs}-byte blocks", g.bytes)));
            }
            let n = self.layout.areas.len();
            let a = (0..n)
                .find(|&i| g.host_node.is_some() && self.host_nodes[i] == g.host_node)
                .or_else(|| (0..n).find(|&i| self.layout.areas[i].node == g.node))
                .or((n > 0).then_some(0))
                .ok_or_else(|| ElasticError::Conflict("the VM has no elastic memory".into()))?;
            let free: Vec<u32> =
                self.area_blocks(a).filter(|&b| st.plugged[b as usize / 64] & (1 << (b % 64)) == 0).collect();
            let k = (g.bytes / bs) as usize;
            if free.len() < k {
                return Err(ElasticError::Conflict(format!(
                    "guest node {} has room for {} more bytes of elastic memory, not {}",
                    self.layout.areas[a].node,
                    free.len() as u64 * bs,
                    g.bytes
                )));
            }
            let mut blocks = [0u64; 16];
            free[..k].iter().for_each(|&b| blocks_set(&mut blocks, b, true));
            target = Some((a, blocks, g.bytes));
        }
        if req.host_cpus.is_empty() && target.is_none() {
            return Err(ElasticError::Bad("nothing to acquire: give host_cpus or memory".into()));
        }
        let mut guest_ms = 0.0;
        let t = Instant::now();
        let vcpus = if req.host_cpus.is_empty() {
            Vec::new()
        } else {
            self.give_cpus(ctl, &mut st, &req.host_cpus, req.from.clone(), timeout)?
        };
        guest_ms += ms(t);
        let mut node = None;
        if let Some((a, blocks, bytes)) = target {
            // Recorded before the guest can reach the blocks; zeroed as they come back.
            let ev = self.mem_event(Kind::MemAcquired, a, bytes);
            Self::record(&mut st, ev);
            self.plug(&blocks)?;
            for b in blocks_iter(&blocks) {
                blocks_set(&mut st.plugged, b, true);
            }
            self.channel(self.mailbox.set_plugged(&st.plugged))?;
            let t = Instant::now();
            let step = self
                .post(Op::GiveMem, 0, 0, 0, &blocks, 0)
                .and_then(|seq| self.wait_ack(seq, timeout, "use its new memory"));
            if let Err(e) = step {
                for b in blocks_iter(&blocks) {
                    blocks_set(&mut st.plugged, b, false);
                }
                self.channel(self.mailbox.set_plugged(&st.plugged))?;
                // The guest stops touching the blocks once it has seen the cancel: only then
                // are their pages dropped for good (bounded: a deaf guest gets the timeout).
                if let Ok(seq) = self.post(Op::Cancel, 0, 0, 0, &[0; 16], 0) {
                    let _ = self.wait_ack(seq, timeout, "drop the memory");
                }
                self.unplug(&blocks, "the guest did not take in time")?;
                let ev = self.mem_event(Kind::MemReleased, a, bytes);
                Self::record(&mut st, ev);
                // The vCPUs this request ran go back to parked: it changes nothing.
                for &v in &vcpus {
                    let _ = ctl.park(v);
                    Self::mark_parked(ctl, &mut st, v);
                }
                if !vcpus.is_empty() {
                    let mask = mask_of(vcpus.iter().copied());
                    self.update_allowed(|a| a & !mask)?;
                }
                return Err(e);
            }
            guest_ms += ms(t);
            if let Some(l) = &req.from {
                *st.borrowed[a].entry(l.clone()).or_default() += bytes;
            }
            node = Some(self.layout.areas[a].node);
        }
        Ok(Acquired { vcpus, node, guest_ms, total_ms: ms(t0) })
    }

    /// `vm.elastic`.
    pub(crate) fn info(&self) -> ElasticInfo {
        let st = self.lock();
        ElasticInfo {
            block_bytes: self.layout.block_bytes,
            vcpus: st
                .vcpus
                .iter()
                .enumerate()
                .map(|(v, h)| ElasticVcpu {
                    vcpu: v as u32,
                    host_cpu: h.host_cpu,
                    parked: h.parked,
                    lender: h.lender.clone(),
                })
                .collect(),
            nodes: self
                .layout
                .areas
                .iter()
                .enumerate()
                .map(|(i, a)| ElasticNode {
                    node: a.node,
                    host_node: self.host_nodes[i],
                    base: a.base,
                    area_bytes: a.nblocks as u64 * self.layout.block_bytes,
                    plugged_bytes: self.plugged_in(&st, i),
                    borrowed: st.borrowed[i].clone(),
                })
                .collect(),
            progress: self.mailbox.progress(st.vcpus.len() as u32).unwrap_or_default(),
            events: st.events.clone(),
        }
    }
}

/// The bitmap of vCPUs `vcpus` (bit v = vCPU v), as the channel carries them.
fn mask_of(vcpus: impl IntoIterator<Item = u32>) -> u64 {
    vcpus.into_iter().fold(0, |m, v| m | 1 << v)
}

/// The parked vCPU to run on host CPU `c` (on host node `c_node`): the one that held `c`
/// before, else one whose guest node lives on `c`'s host node (vNUMA stays true), else the
/// first parked one. vCPU 0 and those already `chosen` are never picked.
fn pick_spare(vcpus: &[Hold], chosen: &[u32], c: u32, c_node: Option<u32>, vcpu_node: &[Option<u32>]) -> Option<u32> {
    let free: Vec<u32> = (1..vcpus.len() as u32).filter(|v| vcpus[*v as usize].parked && !chosen.contains(v)).collect();
    free.iter()
        .copied()
        .find(|&v| vcpus[v as usize].home == Some(c))
        .or_else(|| {
            free.iter().copied().find(|&v| c_node.is_some() && vcpu_node.get(v as usize).copied().flatten() == c_node)
        })
        .or_else(|| free.first().copied())
}

fn doorbell_fd(e: &EventFd) -> std::os::fd::RawFd {
    use std::os::fd::AsRawFd;
    e.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kumo_vm::layout::MemoryLayout;

    #[test]
    fn parses_and_checks_the_flag() {
        let c = ElasticConfig::parse("cpus=1:3,memory=256M,plugged=128M,block=4M").unwrap();
        assert_eq!((c.cpus.clone(), c.memory, c.plugged, c.block), (vec![1, 3], 256 << 20, Some(128 << 20), 4 << 20));
        assert!(c.validate(3).is_ok());
        assert_eq!(c.pins(4), [None, Some(1), Some(3), None]);
        assert_eq!(c.spares(4), [3]);
        let none = ElasticConfig::parse("cpus=,memory=64M").unwrap();
        assert!(none.cpus.is_empty());
        assert_eq!(none.spares(2), [1]);
        for (spec, cpus, want) in [
            ("cpus=1,memory=64M", 1, "need 2 vCPUs"),
            ("cpus=1:1,memory=64M", 3, "given twice"),
            ("cpus=1,memory=3M", 2, "whole number"),
            ("cpus=1,memory=64M,block=1M", 2, "multiple of 2 MiB"),
            ("cpus=1,memory=64M,plugged=128M", 2, "at most memory"),
            ("cpus=1,memory=64M", 65, "at most 64"),
        ] {
            let e = ElasticConfig::parse(spec).unwrap().validate(cpus).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
        for (spec, want) in [
            ("cpus=x", r#"cpus=x: "x" in CPU list "x" is not N or N-M"#),
            ("memory=lots", "not a size"),
            ("nope=1", "unknown key"),
            ("cpus", "key=value"),
        ] {
            let e = ElasticConfig::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn a_cpu_goes_to_its_old_vcpu_then_to_one_on_its_node() {
        let h = |parked, home| Hold { host_cpu: None, parked, lender: None, home };
        let vcpus = [h(false, None), h(true, Some(4)), h(true, None), h(true, None), h(false, Some(1))];
        let nodes = [None, Some(0), Some(0), Some(1), Some(1)];
        assert_eq!(pick_spare(&vcpus, &[], 4, Some(1), &nodes), Some(1), "its old vCPU");
        assert_eq!(pick_spare(&vcpus, &[], 7, Some(1), &nodes), Some(3), "a parked vCPU on node 1");
        assert_eq!(pick_spare(&vcpus, &[3], 7, Some(1), &nodes), Some(1), "else the first parked one");
        assert_eq!(pick_spare(&vcpus, &[1, 2, 3], 7, None, &nodes), None);
    }

    #[test]
    fn areas_are_the_top_of_each_node() {
        let c = ElasticConfig::parse("cpus=1,memory=64M").unwrap();
        let a = plan_areas(&c, &MemoryLayout::new(256 << 20), None).unwrap();
        assert_eq!(a, [AreaPlan { node: 0, host_node: None, gpa: 192 << 20, len: 64 << 20 }]);
        // Too little RAM left below it.
        let e = plan_areas(&c, &MemoryLayout::new(72 << 20), None).unwrap_err().to_string();
        assert!(e.contains("16 MiB more"), "{e}");
        // Above the MMIO gap: the top of the RAM past 4 GiB.
        let a = plan_areas(&c, &MemoryLayout::new(4 << 30), None).unwrap();
        assert_eq!(a[0].gpa, (5 << 30) - (64 << 20));
        let none = ElasticConfig::parse("cpus=1").unwrap();
        assert!(plan_areas(&none, &MemoryLayout::new(256 << 20), None).unwrap().is_empty());
        let many = ElasticConfig::parse("memory=4G").unwrap();
        assert!(plan_areas(&many, &MemoryLayout::new(8 << 30), None).unwrap_err().to_string().contains("at most 1024"));
    }

    #[test]
    fn areas_follow_the_numa_nodes() {
        let numa = crate::placement::NumaConfig {
            nodes: vec![
                crate::placement::NumaNodeSpec::parse("node=0,cpus=0-1,memory=128M,host-node=0").unwrap(),
                crate::placement::NumaNodeSpec::parse("node=1,cpus=2,memory=128M").unwrap(),
            ],
            distances: vec![],
        };
        let topo = numa.topology(3, 256 << 20).unwrap();
        let c = ElasticConfig::parse("cpus=1,memory=32M").unwrap();
        let a = plan_areas(&c, &MemoryLayout::new(256 << 20), Some((&numa, &topo))).unwrap();
        assert_eq!(
            a,
            [
                AreaPlan { node: 0, host_node: Some(0), gpa: 96 << 20, len: 32 << 20 },
                AreaPlan { node: 1, host_node: None, gpa: 224 << 20, len: 32 << 20 }
            ]
        );
    }
}
