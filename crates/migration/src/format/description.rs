//! The VM description in the stream header: what a destination needs to build the empty VM a
//! migration (or a snapshot) fills. Typed to the last field, so both sides agree on every
//! byte; it is the stream's own wire form, kept apart from a VMM's config types (kumo's VMM
//! converts its config to and from it). Versioned with the stream: any change here is a new
//! [`VERSION`], and a reader refuses other versions before it reads the description.
//!
//! It says what the guest sees (vCPUs, memory, interrupt controller, payload, NICs, NUMA nodes,
//! paravirtual features), never what the source's host gave it: host CPU pins, host NUMA nodes
//! and halt polling stay behind. A NIC's source backend travels only to be named in messages;
//! the destination's operator gives its own.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::VERSION;
use super::{Error, Result, PAGE, PAGE_SIZE};

/// What the destination needs to build an empty VM to migrate into; the JSON in the header.
///
/// Unknown fields are rejected, here and in every type below: any change to this structure is
/// a new stream version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmDescription {
    /// Number of vCPUs.
    pub cpus: u32,
    /// Guest RAM size; the sum of the region lengths.
    pub memory_bytes: u64,
    /// Where the interrupt controllers live.
    pub irqchip: Irqchip,
    /// What the VM runs.
    pub payload: PayloadDescription,
    /// NICs, in PCI slot order (`net0` first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nets: Vec<NicDescription>,
    /// virtio-blk disks, in PCI slot order after the NICs (`disk0` first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskDescription>,
    /// Guest NUMA nodes; none: the guest sees one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<NumaDescription>,
    /// KVM paravirtual features the guest was given, so its CPUID does not change on arrival.
    #[serde(default, skip_serializing_if = "PvDescription::is_empty")]
    pub pv: PvDescription,
    /// kumo's debug exit port is on the bus (kumo's own guests end through it).
    #[serde(default)]
    pub debug_exit: bool,
    /// Page size; must be [`PAGE_SIZE`].
    pub page_size: u32,
    /// RAM regions as `(gpa, len)`, page-aligned and disjoint.
    pub regions: Vec<(u64, u64)>,
    /// Connections the stream is spread over, each starting with this header; the first
    /// carries the state. 1 when absent.
    #[serde(default = "one")]
    pub connections: u32,
    /// Guest memory is shared, not sent (a local migration): the memory file follows the
    /// header on a unix socket (SCM_RIGHTS) and no `MemBatch` records come.
    #[serde(default)]
    pub shared_memory: bool,
    /// The VM's RAM was private anonymous memory (`--private-memory`): the destination makes
    /// its own the same way. Absent in streams of VMs that had the memfd.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private_memory: bool,
}

fn one() -> u32 {
    1
}

/// Where the interrupt controllers live (kumo's `--irqchip`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Irqchip {
    /// PIC, IOAPIC, LAPICs and PIT in KVM.
    Kernel,
    /// LAPICs in KVM, the rest in the VMM.
    Split,
    /// No interrupt controller in KVM.
    User,
}

/// What the VM boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum PayloadDescription {
    /// One of kumo's own guest programs, with `key=value` arguments.
    Guest {
        /// The guest's name.
        name: String,
        /// Its arguments.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        args: Vec<String>,
    },
    /// A Linux kernel, booted on the source (a destination does not load it again).
    Kernel {
        /// The kernel's path on the source.
        path: PathBuf,
        /// The initrd's path on the source.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        initrd: Option<PathBuf>,
        /// The kernel command line.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cmdline: Option<String>,
    },
}

impl PayloadDescription {
    /// Guest program `name` without arguments.
    pub fn guest(name: &str) -> Self {
        PayloadDescription::Guest { name: name.to_string(), args: Vec::new() }
    }
}

/// One virtio-net NIC as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicDescription {
    /// `aa:bb:cc:dd:ee:ff`.
    pub mac: String,
    /// Queue pairs.
    pub queues: u16,
    /// How its interrupts reach the vCPUs.
    #[serde(default)]
    pub irq: NicIrqPath,
    /// Its backend on the source: the kind the destination must give it, and a name for
    /// messages (never used on the destination).
    pub source_backend: SourceBackend,
    /// It offers its tap's offloads (absent: it does, as before the field came).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub offload: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// One virtio-blk disk as the guest sees it. Its image is on storage both hosts see; the
/// destination's operator names it per disk id, and it must have `size` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskDescription {
    /// `disk0`, or the id the source's operator gave.
    pub id: String,
    /// The image's size in bytes.
    pub size: u64,
    /// The disk is read-only (VIRTIO_BLK_F_RO).
    pub readonly: bool,
    /// GET_ID's answer.
    #[serde(default)]
    pub serial: String,
    /// Request queues.
    pub queues: u16,
    /// Each queue's maximum size.
    pub queue_size: u16,
    /// The image opened O_DIRECT.
    #[serde(default)]
    pub direct: bool,
    /// The image's path on the source: for messages only (never opened on the destination).
    pub source_path: std::path::PathBuf,
}

/// A NIC's interrupt path (kumo's `irq=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "path", deny_unknown_fields)]
pub enum NicIrqPath {
    /// KVM routes, to where the guest programmed them.
    #[default]
    Direct,
    /// KVM routes, every vector to vCPU `vcpu`.
    Dedicated {
        /// The vCPU.
        vcpu: u32,
    },
    /// Through the VMM's dispatcher thread.
    Shared,
}

/// A NIC's backend on the source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceBackend {
    /// A host tap, by name.
    Tap(String),
    /// A host tap whose descriptors the source's client passed (CH's `fds`), named for
    /// messages: there is nothing to open by that name elsewhere, so a restore or destination
    /// needs a tap from its operator.
    TapFds(String),
    /// A vhost-user-net backend, by socket path.
    VhostUser(PathBuf),
}

/// The guest NUMA nodes and the distances between them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaDescription {
    /// The nodes.
    pub nodes: Vec<NumaNodeDescription>,
    /// Given distances; the rest are 10 (a node to itself) and 20.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub distances: Vec<NumaDistanceDescription>,
}

/// One guest NUMA node: its vCPUs and memory (where the source's host put them stays behind).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaNodeDescription {
    /// Node id.
    pub id: u32,
    /// vCPU indices.
    pub cpus: Vec<u32>,
    /// Bytes.
    pub memory: u64,
}

/// The distance from node `src` to node `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaDistanceDescription {
    /// From.
    pub src: u32,
    /// To.
    pub dst: u32,
    /// ACPI SLIT distance.
    pub value: u8,
}

/// KVM paravirtual features: each on, off, or unset (the default for the VM's vCPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // KVM's feature names (docs/pv-features.md)
pub struct PvDescription {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal_time: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv_unhalt: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tlb_flush: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_control: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv_ipi: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub realtime: Option<bool>,
}

impl PvDescription {
    /// No feature set.
    pub fn is_empty(&self) -> bool {
        *self == PvDescription::default()
    }
}

/// Most connections a stream may be spread over.
pub const MAX_CONNECTIONS: u32 = 16;
/// Most vCPUs a description may have (above any KVM's limit; the receiver checks its own).
pub const MAX_CPUS: u32 = 4096;
/// Most RAM regions a description may have.
pub const MAX_REGIONS: usize = 64;
/// Guest physical addresses end below 2^52 (x86-64's widest physical address space): no
/// region, and so no memory size, may reach past it.
pub const MAX_GPA: u64 = 1 << 52;

impl VmDescription {
    /// A description of a VM without NICs, NUMA nodes or PV features set, with the page size
    /// set to [`PAGE_SIZE`] and `memory_bytes` to the sum of the region lengths.
    pub fn new(cpus: u32, irqchip: Irqchip, payload: PayloadDescription, regions: Vec<(u64, u64)>) -> Self {
        let memory_bytes = regions.iter().fold(0u64, |s, r| s.saturating_add(r.1));
        VmDescription {
            cpus,
            memory_bytes,
            irqchip,
            payload,
            nets: Vec::new(),
            disks: Vec::new(),
            numa: None,
            pv: PvDescription::default(),
            debug_exit: false,
            page_size: PAGE_SIZE,
            regions,
            connections: 1,
            shared_memory: false,
            private_memory: false,
        }
    }

    /// Checks what a receiver relies on: page size, alignment, disjoint regions below
    /// [`MAX_GPA`] that add up to `memory_bytes`, and vCPUs and regions within bounds. Whether
    /// this host can hold the VM, and whether its NICs and NUMA nodes make sense, are the
    /// receiver's own checks, made before it allocates.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::BadDescription(m));
        if self.cpus == 0 {
            return bad("no vCPUs".into());
        }
        if self.cpus > MAX_CPUS {
            return bad(format!("{} vCPUs (at most {MAX_CPUS})", self.cpus));
        }
        if self.regions.len() > MAX_REGIONS {
            return bad(format!("{} memory regions (at most {MAX_REGIONS})", self.regions.len()));
        }
        if self.page_size != PAGE_SIZE {
            return bad(format!("page size {} (only {PAGE_SIZE} is supported)", self.page_size));
        }
        if self.regions.is_empty() {
            return bad("no memory regions".into());
        }
        if self.connections == 0 || self.connections > MAX_CONNECTIONS {
            return bad(format!("{} connections (1 to {MAX_CONNECTIONS})", self.connections));
        }
        let mut sorted = self.regions.clone();
        sorted.sort_unstable();
        let mut sum = 0u64;
        let mut prev_end = 0u64;
        for (i, &(gpa, len)) in sorted.iter().enumerate() {
            if len == 0 || gpa % PAGE as u64 != 0 || len % PAGE as u64 != 0 {
                return bad(format!("region {gpa:#x}+{len:#x} is empty or not page-aligned"));
            }
            let Some(end) = gpa.checked_add(len) else {
                return bad(format!("region {gpa:#x}+{len:#x} wraps around"));
            };
            if end > MAX_GPA {
                return bad(format!("region {gpa:#x}+{len:#x} ends beyond the 52-bit physical address space"));
            }
            if i > 0 && gpa < prev_end {
                return bad(format!("region {gpa:#x}+{len:#x} overlaps the one before"));
            }
            prev_end = end;
            sum = sum.saturating_add(len);
        }
        if sum != self.memory_bytes {
            return bad(format!("regions cover {sum} bytes but memory_bytes is {}", self.memory_bytes));
        }
        Ok(())
    }

    /// Number of guest pages.
    pub fn total_pages(&self) -> u64 {
        self.memory_bytes / PAGE as u64
    }

    /// Whether guest page frame `gfn` lies in a region.
    pub fn contains_gfn(&self, gfn: u64) -> bool {
        let page = PAGE as u64;
        self.regions.iter().any(|&(gpa, len)| gfn >= gpa / page && gfn - gpa / page < len / page)
    }
}
