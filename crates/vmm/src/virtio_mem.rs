//! Memory zones (`--memory-zone node=N,hotplug=SIZE[,block=2M][,plugged=SIZE][,id=ID]`): one
//! virtio-mem device (`kumo_devices::virtio::mem`) per zone, for guests with a virtio-mem driver
//! (Linux). Each zone's hotplug region lies in guest-physical space above RAM (from 4 GiB or the
//! top of RAM, 128 MiB aligned: Linux's memory block size), is not RAM in the boot memory map,
//! has a hot-pluggable SRAT entry on its node, and is backed by its own anonymous host mapping
//! registered as a KVM memory slot. Unplugged blocks are fenced (`kumo_vm::memory::Fences`:
//! PROT_NONE, a guest access stops the VM with a clear error) and their pages dropped
//! (MADV_DONTNEED), so they cost the host nothing; the device's [`ZoneBackend`] does that before
//! it acknowledges an UNPLUG, and unfences blocks before it acknowledges a PLUG.
//!
//! The region is not part of the VM's `GuestMemory`: no other device can reach it (a guest that
//! gives a NIC or disk a buffer there gets an error from that device, never kumo a SIGSEGV on a
//! fenced block), and migration and snapshots, which such a VM refuses, never see it.
//!
//! [`Zones`] also serves the elastic routes for such a VM (docs/elastic.md): `vm.release`
//! lowers a zone's requested size and waits until the guest has unplugged (its driver offlines
//! the memory by itself), `vm.acquire` records the memory as held and raises the size, waiting
//! until the guest has plugged it. The record feeds `kumo_elastic::record::check`.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kumo_api::{
    AcquireRequest, Acquired, ElasticEvent, ElasticEventKind, ElasticInfo, ElasticNode, MemoryGrant, MemoryZoneInfo,
    ReleaseRequest, Released,
};
use kumo_devices::virtio::mem::{Mem, MemBackend, MemConfig};
use kumo_devices::virtio::status;
use kumo_sandbox::lock;
use kumo_vm::interrupt_paths::IrqPath;
use kumo_vm::memory::{human_size, parse_size, Fences, GuestMemory};
use kumo_vm::Vm;
use serde::{Deserialize, Serialize};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::elastic::ElasticError;
use crate::event_loop::{EventHandler, EventLoop, Interest};
use crate::pci::Pci;
use crate::virtio_pci::{wire, Control, VirtioFunction, Wired};
use crate::{Error, Result};

/// Linux's memory block size on x86-64 (below 64 GiB of RAM): a region is aligned to it and a
/// multiple of it, so the kernel can add it in whole blocks.
pub const REGION_ALIGN: u64 = 128 << 20;
/// The default plug granularity.
pub const DEFAULT_BLOCK: u64 = 2 << 20;
/// The first KVM memory slot of the zones (RAM's slots are numbered from 0).
const FIRST_SLOT: u32 = 64;

/// One `--memory-zone`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZoneSpec {
    /// `mem<i>` when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The guest NUMA node (0 without `--numa`).
    #[serde(default)]
    pub node: u32,
    /// Bytes of hotplug region: a multiple of 128 MiB.
    #[serde(deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub hotplug: u64,
    /// The plug granularity: a power of two of at least 2 MiB.
    #[serde(default = "default_block", deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub block: u64,
    /// What the guest is asked to plug at boot.
    #[serde(default, deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub plugged: u64,
}

fn default_block() -> u64 {
    DEFAULT_BLOCK
}

impl ZoneSpec {
    /// Parses the `--memory-zone` syntax.
    pub fn parse(s: &str) -> Result<ZoneSpec> {
        let bad = |m: String| Error::Config(format!("--memory-zone {s}: {m}"));
        let mut z = ZoneSpec { id: None, node: 0, hotplug: 0, block: DEFAULT_BLOCK, plugged: 0 };
        let size = |k: &str, v: &str| parse_size(v).map_err(|e| bad(format!("{k}={v}: {e}")));
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            match k {
                "id" => z.id = Some(v.to_string()),
                "node" => z.node = v.parse().map_err(|_| bad(format!("node `{v}` is not a number")))?,
                "hotplug" | "hotplug_size" => z.hotplug = size(k, v)?,
                "block" | "block_size" => z.block = size(k, v)?,
                "plugged" | "hotplugged_size" => z.plugged = size(k, v)?,
                _ => return Err(bad(format!("unknown key `{k}` (node, hotplug, block, plugged, id)"))),
            }
        }
        Ok(z)
    }

    /// The zone's id: its own, else `mem<index>`.
    pub fn id_at(&self, index: usize) -> String {
        self.id.clone().unwrap_or_else(|| format!("mem{index}"))
    }

    /// Checks the zone's sizes, and its node against the VM's `nodes` guest nodes.
    pub fn validate(&self, index: usize, nodes: u32) -> Result<()> {
        let id = self.id_at(index);
        let bad = |m: String| Err(Error::Config(format!("memory zone {id}: {m}")));
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return bad(format!("id `{id}`: letters, digits, - and _ only"));
        }
        if self.hotplug == 0 || !self.hotplug.is_multiple_of(REGION_ALIGN) {
            return bad(format!("hotplug={} must be a non-zero multiple of 128 MiB", human_size(self.hotplug)));
        }
        if !self.block.is_power_of_two() || self.block < DEFAULT_BLOCK || self.block > REGION_ALIGN {
            return bad(format!("block={} must be a power of two from 2 MiB to 128 MiB", human_size(self.block)));
        }
        if self.plugged > self.hotplug || !self.plugged.is_multiple_of(self.block) {
            return bad(format!("plugged={} must be whole blocks, at most hotplug", human_size(self.plugged)));
        }
        if self.node >= nodes.max(1) {
            return bad(format!("node {} does not exist (the VM has {} guest nodes)", self.node, nodes.max(1)));
        }
        Ok(())
    }
}

/// Where each zone's region starts: from 4 GiB or the top of RAM, whichever is higher, 128 MiB
/// aligned, one after the other.
pub fn plan(ram_end: u64, specs: &[ZoneSpec]) -> Vec<u64> {
    let mut at = ram_end.max(kumo_vm::layout::MMIO_GAP_END).next_multiple_of(REGION_ALIGN);
    specs
        .iter()
        .map(|z| {
            let gpa = at;
            at += z.hotplug;
            gpa
        })
        .collect()
}

/// The host side of one zone's device: its region's mapping and the VM's fences.
struct ZoneBackend {
    id: String,
    /// The region alone, as guest memory (so `Fences` and `discard` find its host pages).
    mem: GuestMemory,
    fences: Arc<Fences>,
    gpa: u64,
    block: u64,
}

impl ZoneBackend {
    fn each_block(
        &self,
        offset: u64,
        len: u64,
        f: impl Fn(u64) -> kumo_vm::Result<()>,
    ) -> std::result::Result<(), String> {
        (0..len / self.block).try_for_each(|i| f(self.gpa + offset + i * self.block)).map_err(|e| e.to_string())
    }
}

impl MemBackend for ZoneBackend {
    fn plug(&mut self, offset: u64, len: u64) -> std::result::Result<(), String> {
        self.each_block(offset, len, |gpa| self.fences.unfence(&self.mem, gpa, self.block))
    }

    fn unplug(&mut self, offset: u64, len: u64) -> std::result::Result<(), String> {
        let what = format!("unplugged virtio-mem block of zone {}", self.id);
        self.each_block(offset, len, |gpa| {
            self.fences.fence(&self.mem, gpa, self.block, &what)?;
            kumo_vm::memory::discard(&self.mem, gpa, self.block, true)
        })
    }
}

/// One zone of a running VM.
struct Zone {
    id: String,
    node: u32,
    gpa: u64,
    size: u64,
    block: u64,
    slot: u8,
    function: Arc<Mutex<VirtioFunction<Mem>>>,
    _ctl: Arc<Control>,
    _events: EventLoop,
}

impl Zone {
    fn new(index: usize, spec: &ZoneSpec, gpa: u64, vm: &Vm, pci: &mut Pci) -> Result<Zone> {
        let id = spec.id_at(index);
        let dev_err = |m: String| Error::Devices(format!("memory zone {id}: {m}"));
        let mem = map_region(vm, index, gpa, spec.hotplug).map_err(dev_err)?;
        let fences = vm.memory.fences.clone();
        // Every block starts unplugged: out of the guest's reach, costing no host memory.
        let what = format!("unplugged virtio-mem block of zone {id}");
        for b in 0..spec.hotplug / spec.block {
            fences.fence(&mem, gpa + b * spec.block, spec.block, &what).map_err(|e| dev_err(e.to_string()))?;
        }
        let backend = ZoneBackend { id: id.clone(), mem, fences, gpa, block: spec.block };
        let cfg = MemConfig {
            addr: gpa,
            region_size: spec.hotplug,
            block_size: spec.block,
            node_id: spec.node as u16,
            requested_size: spec.plugged,
        };
        let dev = Mem::new(&id, cfg, Box::new(backend)).map_err(|e| dev_err(e.to_string()))?;
        let bell = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| dev_err(format!("eventfd: {e}")))?;
        let clone = bell.try_clone().map_err(|e| dev_err(format!("eventfd: {e}")))?;
        let Wired { function, slot, ctl, .. } =
            wire(&id, dev, IrqPath::Direct, vec![clone], &vm.memory.guest, vm.interrupts.clone(), None, pci, &dev_err)?;
        let events = EventLoop::start(&id).map_err(|e| dev_err(format!("event loop: {e}")))?;
        let fds = [(ctl.kick.as_raw_fd(), EventSet::IN), (bell.as_raw_fd(), EventSet::IN)];
        let handler = MemHandler { function: function.clone(), ctl: ctl.clone(), bell };
        events.add(&fds, Box::new(handler)).map_err(|e| dev_err(format!("event loop: {e}")))?;
        Ok(Zone {
            id,
            node: spec.node,
            gpa,
            size: spec.hotplug,
            block: spec.block,
            slot,
            function,
            _ctl: ctl,
            _events: events,
        })
    }

    /// (plugged, requested) bytes.
    fn sizes(&self) -> (u64, u64) {
        let mut f = lock(&self.function);
        let d = f.transport().device();
        (d.plugged_size(), d.requested_size())
    }

    fn resize(&self, size: u64) -> std::result::Result<(), ElasticError> {
        let mut f = lock(&self.function);
        f.transport().device_mut().resize(size).map_err(|e| ElasticError::Bad(format!("zone {}: {e}", self.id)))
    }

    fn info(&self) -> MemoryZoneInfo {
        let mut f = lock(&self.function);
        let driver_ok = f.transport().status() & status::DRIVER_OK != 0;
        let d = f.transport().device();
        let c = d.counters();
        MemoryZoneInfo {
            id: self.id.clone(),
            node: self.node,
            addr: self.gpa,
            region_size: self.size,
            block_size: self.block,
            plugged_size: d.plugged_size(),
            requested_size: d.requested_size(),
            pci: format!("0000:00:{:02x}.0", self.slot),
            driver_ok,
            plugs: c.plugs,
            unplugs: c.unplugs + c.unplug_alls,
            nacks: c.nacks,
            errors: c.errors,
        }
    }

    /// Waits until `done(plugged)` holds, up to `timeout`: the guest's driver works at its own
    /// pace (a host-side effect is waited for, bounded only as a hang guard).
    fn wait(&self, timeout: Duration, done: impl Fn(u64) -> bool) -> bool {
        let end = Instant::now() + timeout;
        loop {
            if done(self.sizes().0) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Maps `len` bytes of anonymous memory for zone `index` and registers it with KVM at `gpa`.
fn map_region(vm: &Vm, index: usize, gpa: u64, len: u64) -> std::result::Result<GuestMemory, String> {
    let n = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit this host"))?;
    let mmap = MmapRegion::<AtomicBitmap>::new(n).map_err(|e| format!("mmap: {e}"))?;
    // SAFETY: the range is the mapping just made, which `mmap` owns; MADV_HUGEPAGE only changes
    // how its pages are backed (2 MiB blocks are then dropped as whole huge pages).
    unsafe { libc::madvise(mmap.as_ptr() as *mut libc::c_void, n, libc::MADV_HUGEPAGE) };
    let host = mmap.as_ptr() as u64;
    let region = GuestRegionMmap::new(mmap, GuestAddress(gpa)).ok_or("region overflow")?;
    let mem = GuestMemoryMmap::from_regions(vec![region]).map_err(|e| e.to_string())?;
    let r = kvm_bindings::kvm_userspace_memory_region {
        slot: FIRST_SLOT + index as u32,
        flags: 0,
        guest_phys_addr: gpa,
        memory_size: len,
        userspace_addr: host,
    };
    // SAFETY: the mapping is owned by `mem`, which the zone's device keeps for as long as the
    // VM runs (the vCPUs stop before the devices are dropped); the slot lies above every RAM
    // region and every other zone, so it overlaps none.
    unsafe { vm.fd.set_user_memory_region(r) }.map_err(|e| format!("KVM_SET_USER_MEMORY_REGION: {e}"))?;
    Ok(mem)
}

/// The device's event handler. Sources: 0 the kick, 1 the doorbell.
struct MemHandler {
    function: Arc<Mutex<VirtioFunction<Mem>>>,
    ctl: Arc<Control>,
    bell: EventFd,
}

impl EventHandler for MemHandler {
    fn handle(&mut self, source: usize, _events: EventSet, _interest: &mut Interest) {
        let _ = if source == 0 { self.ctl.kick.read() } else { self.bell.read() };
        if !self.ctl.paused.load(Ordering::Acquire) {
            lock(&self.function).transport().queue_notify(0);
        }
    }
}

/// What the zones hold for the elastic record.
#[derive(Default)]
struct Record {
    /// Bytes borrowed, by lender.
    borrowed: BTreeMap<String, u64>,
    events: Vec<ElasticEvent>,
}

/// A VM's memory zones.
#[derive(Default)]
pub struct Zones {
    zones: Vec<Zone>,
    /// Held for a whole release or acquisition: one elastic change at a time.
    record: Mutex<Record>,
}

fn now_ns() -> u64 {
    crate::vcpu_manager::monotonic_ns()
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn mem_event(kind: ElasticEventKind, node: u32, bytes: u64, at_boot: bool) -> ElasticEvent {
    ElasticEvent { t_ns: now_ns(), kind, vcpu: None, host_cpu: None, node: Some(node), host_node: None, bytes, at_boot }
}

impl Zones {
    /// Makes `specs`' zones on `vm` and puts their devices on `pci`. What each asks the guest to
    /// plug at boot is recorded as held from the start.
    pub fn new(vm: &Vm, specs: &[ZoneSpec], pci: &mut Pci) -> Result<Zones> {
        let gpas = plan(vm.memory.layout.ram_end(), specs);
        let mut zones = Vec::new();
        let mut events = Vec::new();
        for (i, (spec, gpa)) in specs.iter().zip(gpas).enumerate() {
            zones.push(Zone::new(i, spec, gpa, vm, pci)?);
            events.push(mem_event(ElasticEventKind::MemAcquired, spec.node, spec.plugged, true));
        }
        Ok(Zones { zones, record: Mutex::new(Record { borrowed: BTreeMap::new(), events }) })
    }

    pub fn is_empty(&self) -> bool {
        self.zones.is_empty()
    }

    /// The SRAT's hot-pluggable ranges.
    pub fn hotplug_ranges(&self) -> Vec<kumo_acpi::HotplugMemory> {
        self.zones.iter().map(|z| kumo_acpi::HotplugMemory { node: z.node, start: z.gpa, len: z.size }).collect()
    }

    /// The zones as `vm.info` shows them.
    pub fn info(&self) -> Vec<MemoryZoneInfo> {
        self.zones.iter().map(Zone::info).collect()
    }

    /// `vm.resize-zone`: sets zone `id`'s requested size (the guest follows on its own).
    pub fn resize(&self, id: &str, size: u64) -> std::result::Result<(), kumo_api::ApiError> {
        let z = self
            .zones
            .iter()
            .find(|z| z.id == id)
            .ok_or_else(|| kumo_api::ApiError::not_found(format!("no memory zone `{id}`")))?;
        z.resize(size).map_err(|e| kumo_api::ApiError::bad_request(e.to_string()))
    }

    fn zone_for(&self, node: Option<u32>, fits: impl Fn(&Zone) -> bool) -> Option<&Zone> {
        self.zones.iter().filter(|z| node.is_none_or(|n| z.node == n)).find(|z| fits(z))
    }

    /// `vm.release` for a VM with zones: the guest unplugs `memory_bytes` from one zone.
    pub fn release(&self, req: &ReleaseRequest) -> std::result::Result<Released, ElasticError> {
        let t0 = Instant::now();
        if req.cpus > 0 || !req.host_cpus.is_empty() {
            return Err(ElasticError::Conflict(
                "a VM with memory zones lends memory only (virtio-mem): its CPUs are not elastic".into(),
            ));
        }
        let bytes = req.memory_bytes;
        if bytes == 0 {
            return Err(ElasticError::Bad("nothing to release: give memory_bytes".into()));
        }
        let mut rec = lock(&self.record);
        if let Some(to) = &req.to {
            let have = rec.borrowed.get(to).copied().unwrap_or(0);
            if have < bytes {
                return Err(ElasticError::Conflict(format!(
                    "only {} is borrowed from {to}, not {}",
                    human_size(have),
                    human_size(bytes)
                )));
            }
        }
        let z = self
            .zone_for(req.node, |z| {
                let (plugged, requested) = z.sizes();
                bytes.is_multiple_of(z.block) && requested >= bytes && plugged >= bytes
            })
            .ok_or_else(|| {
                ElasticError::Conflict(format!("no memory zone has {} plugged, in whole blocks", human_size(bytes)))
            })?;
        let old = z.sizes().1;
        let target = old - bytes;
        z.resize(target)?;
        let t_guest = Instant::now();
        if !z.wait(Duration::from_millis(req.timeout_ms), |p| p <= target) {
            let _ = z.resize(old);
            return Err(ElasticError::Guest(format!(
                "zone {}: the guest had {} plugged after {} ms, not {}; it is asked to plug it back",
                z.id,
                human_size(z.sizes().0),
                req.timeout_ms,
                human_size(target)
            )));
        }
        let guest_ms = ms(t_guest);
        // The device fenced and discarded each block before acknowledging its unplug.
        rec.events.push(mem_event(ElasticEventKind::MemReleased, z.node, bytes, false));
        if let Some(to) = &req.to {
            let left = rec.borrowed.get(to).copied().unwrap_or(0) - bytes;
            if left == 0 {
                rec.borrowed.remove(to);
            } else {
                rec.borrowed.insert(to.clone(), left);
            }
        }
        Ok(Released {
            host_cpus: Vec::new(),
            memory: Some(MemoryGrant { bytes, node: z.node, host_node: None }),
            lender: req.to.clone(),
            guest_ms,
            total_ms: ms(t0),
        })
    }

    /// `vm.acquire` for a VM with zones: the memory is recorded as held, then the guest plugs it.
    pub fn acquire(&self, req: &AcquireRequest) -> std::result::Result<Acquired, ElasticError> {
        let t0 = Instant::now();
        if !req.host_cpus.is_empty() {
            return Err(ElasticError::Conflict(
                "a VM with memory zones takes memory only (virtio-mem): its CPUs are not elastic".into(),
            ));
        }
        let Some(grant) = req.memory else { return Err(ElasticError::Bad("nothing to acquire".into())) };
        let bytes = grant.bytes;
        let mut rec = lock(&self.record);
        let fits = |z: &Zone| bytes.is_multiple_of(z.block) && z.sizes().1 + bytes <= z.size;
        let z = self
            .zone_for(Some(grant.node), fits)
            .or_else(|| self.zone_for(None, fits))
            .ok_or_else(|| ElasticError::Conflict(format!("no memory zone has room for {} more", human_size(bytes))))?;
        let old = z.sizes().1;
        let target = old + bytes;
        // Held from before the guest can use it.
        rec.events.push(mem_event(ElasticEventKind::MemAcquired, z.node, bytes, false));
        z.resize(target)?;
        let t_guest = Instant::now();
        let timeout = Duration::from_millis(req.timeout_ms);
        if !z.wait(timeout, |p| p >= target) {
            let _ = z.resize(old);
            let back = z.wait(timeout, |p| p <= old);
            if back {
                rec.events.push(mem_event(ElasticEventKind::MemReleased, z.node, bytes, false));
            }
            return Err(ElasticError::Guest(format!(
                "zone {}: the guest had not plugged {} after {} ms ({})",
                z.id,
                human_size(target),
                req.timeout_ms,
                if back { "it gave back what it took" } else { "it still holds part of it" }
            )));
        }
        let guest_ms = ms(t_guest);
        if let Some(from) = &req.from {
            *rec.borrowed.entry(from.clone()).or_default() += bytes;
        }
        Ok(Acquired { vcpus: Vec::new(), node: Some(z.node), guest_ms, total_ms: ms(t0) })
    }

    /// `vm.elastic` for a VM with zones: each zone as a node's elastic area, and the record.
    pub fn elastic_info(&self) -> ElasticInfo {
        let rec = lock(&self.record);
        let nodes = self
            .zones
            .iter()
            .map(|z| ElasticNode {
                node: z.node,
                host_node: None,
                base: z.gpa,
                area_bytes: z.size,
                plugged_bytes: z.sizes().0,
                borrowed: rec.borrowed.clone(),
            })
            .collect();
        ElasticInfo {
            block_bytes: self.zones.first().map_or(0, |z| z.block),
            vcpus: Vec::new(),
            nodes,
            progress: Vec::new(),
            events: rec.events.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_parse_and_check() {
        let z = ZoneSpec::parse("node=1,hotplug=256M,block=4M,plugged=128M,id=big").unwrap();
        assert_eq!(
            z,
            ZoneSpec { id: Some("big".into()), node: 1, hotplug: 256 << 20, block: 4 << 20, plugged: 128 << 20 }
        );
        z.validate(0, 2).unwrap();
        assert!(z.validate(0, 1).unwrap_err().to_string().contains("node 1 does not exist"));
        let plain = ZoneSpec::parse("hotplug=128M").unwrap();
        assert_eq!((plain.id_at(3), plain.block, plain.plugged), ("mem3".into(), DEFAULT_BLOCK, 0));
        for bad in ["hotplug=100M", "hotplug=128M,block=3M", "hotplug=128M,plugged=256M", "hotplug=128M,plugged=1M"] {
            assert!(ZoneSpec::parse(bad).unwrap().validate(0, 1).is_err(), "{bad}");
        }
        assert!(ZoneSpec::parse("hotplug=128M,colour=red").is_err());
        assert!(ZoneSpec::parse("hotplug").is_err());
        // Config files: sizes as strings or numbers, block and plugged optional.
        let f: ZoneSpec = serde_json::from_str(r#"{"node": 0, "hotplug": "256M", "plugged": 134217728}"#).unwrap();
        assert_eq!((f.hotplug, f.block, f.plugged), (256 << 20, DEFAULT_BLOCK, 128 << 20));
        assert!(serde_json::from_str::<ZoneSpec>(r#"{"hotplug": "256M", "size": 1}"#).is_err());
    }

    #[test]
    fn regions_lie_above_ram_and_4_gib_aligned_to_memory_blocks() {
        let z = |mib: u64| ZoneSpec { id: None, node: 0, hotplug: mib << 20, block: DEFAULT_BLOCK, plugged: 0 };
        assert_eq!(plan(512 << 20, &[z(256), z(128)]), [4 << 30, (4 << 30) + (256 << 20)]);
        // RAM past 4 GiB ending off a memory block boundary.
        assert_eq!(plan((5 << 30) + (1 << 20), &[z(128)]), [(5 << 30) + (128 << 20)]);
    }
}
