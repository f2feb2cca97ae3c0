//! ACPI tables for kumo's VMs, built with the `acpi_tables` crate and written into guest memory
//! at [`ACPI_START`]..[`ACPI_END`] (0xE0000–0xFFFFF, inside the reserved `[EBDA, 1 MiB)` entry of
//! the e820 map, so Linux never reuses it):
//!
//! | table | what it holds |
//! |-------|---------------|
//! | RSDP (v2) | at 0xE0000, where a legacy scan finds it; points at the XSDT. Linux is also told its address in `boot_params.acpi_rsdp_addr` / PVH `rsdp_paddr` |
//! | XSDT  | the addresses of FADT, MADT, MCFG, SRAT, SLIT |
//! | FADT  | hardware-reduced ACPI (kumo emulates no PM1 blocks, SCI, PM timer, FACS), SCI_INT 9 (Linux in PIC mode marks it level-triggered); IA-PC boot flags: no VGA, no CMOS RTC, no 8042; points at the DSDT through `X_DSDT`; with [`SleepRegisters`], the sleep control and status registers (byte-wide I/O ports) |
//! | DSDT  | `\_SB.PCI0` (PNP0A08, bus 0, config ports 0xCF8, I/O windows, the 32-bit BAR window) and `\_SB.MRES` (PNP0C02) reserving the ECAM area, so Linux uses MMCONFIG; with a [`Ged`], the GED (ACPI0013), the power button (PNP0C0C) and CPU hotplug (`\_SB.CPUS`, one ACPI0007 device per vCPU: `hotplug`); with [`SleepRegisters`], `\_S5` |
//! | MADT  | LAPIC address, one local APIC entry per vCPU (APIC ID = vCPU index), the IOAPIC at 0xFEC00000 with the in-kernel irqchip, an override for the timer (ISA IRQ 0 → GSI 0, kumo routes GSI n to IOAPIC pin n) and LINT1 as NMI |
//! | MCFG  | ECAM of segment 0, bus 0 (`Pci::ecam_base()`) |
//! | SRAT, SLIT | only with a [`NumaTopology`]: a processor affinity entry per vCPU, a memory affinity entry per range, the distance matrix |
//!
//! Without a NUMA topology there is no SRAT/SLIT: Linux then prints "No NUMA configuration
//! found" and fakes one node, which is what a one-node SRAT would give too.
//!
//! What Linux made of them: the Debian 6.1 cloud kernel, `kumo run --kernel vmlinuz --cpus 2
//! --memory 512M` (kumo's default command line, so `noapic`), with a 2-node topology (vCPU i
//! in node i, 256 MiB each, distance 21) passed in by hand:
//!
//! ```text
//! ACPI: RSDP 0x00000000000E0000 000024 (v02 KUMO  )
//! ACPI: XSDT 0x00000000000E03C0 00004C (v01 KUMO   KUMOXSDT 00000001 RVAT 01000000)
//! ACPI: FACP 0x00000000000E0130 000114 (v06 KUMO   KUMOFACP 00000001 RVAT 01000000)
//! ACPI: DSDT 0x00000000000E0040 0000EC (v02 KUMO   KUMODSDT 00000001 RVAT 01000000)
//! ACPI: APIC 0x00000000000E0250 000058 (v01 KUMO   KUMOAPIC 00000001 RVAT 01000000)
//! ACPI: MCFG 0x00000000000E02B0 00003C (v01 KUMO   KUMOMCFG 00000001 RVAT 01000000)
//! ACPI: SRAT 0x00000000000E02F0 0000A0 (v03 KUMO   KUMOSRAT 00000001 RVAT 01000000)
//! ACPI: SLIT 0x00000000000E0390 000030 (v01 KUMO   KUMOSLIT 00000001 RVAT 01000000)
//! SRAT: PXM 0 -> APIC 0x00 -> Node 0
//! SRAT: PXM 1 -> APIC 0x01 -> Node 1
//! ACPI: SRAT: Node 0 PXM 0 [mem 0x00000000-0x0fffffff]
//! ACPI: SRAT: Node 1 PXM 1 [mem 0x10000000-0x1fffffff]
//! Initmem setup node 1 [mem 0x0000000010000000-0x000000001fffffff]
//! ACPI: LAPIC_NMI (acpi_id[0xff] dfl dfl lint[0x1])
//! ACPI: Skipping IOAPIC probe due to 'noapic' option.
//! ACPI: Using ACPI for processor (LAPIC) configuration information
//! smpboot: Allowing 2 CPUs, 0 hotplug CPUs
//! ```
//!
//! and no "ACPI BIOS Error". With a NIC and without `noapic` (no topology), it went on to:
//!
//! ```text
//! IOAPIC[0]: apic_id 0, version 17, address 0xfec00000, GSI 0-23
//! ACPI: INT_SRC_OVR (bus 0 bus_irq 0 global_irq 0 dfl dfl)
//! ACPI: Using ACPI (MADT) for SMP configuration information
//! ACPI: Interpreter enabled
//! ACPI: PM: (supports S0)
//! ACPI: Using IOAPIC for interrupt routing
//! PCI: MMCONFIG at [mem 0xfeb00000-0xfebfffff] reserved in ACPI motherboard resources
//! ACPI: PCI Root Bridge [PCI0] (domain 0000 [bus 00])
//! pci_bus 0000:00: root bus resource [mem 0xc0000000-0xfeafffff window]
//! pci 0000:00:01.0: [1af4:1041] type 00 class 0x020000
//! PCI: Using ACPI for IRQ routing
//! ```
//!
//! Without a topology the SRAT/SLIT lines give way to "No NUMA
//! configuration found" / "Faking a node at [mem 0x0000000000000000-0x000000001fffffff]".

mod hotplug;
mod topology;

use std::ops::Range;

use acpi_tables::aml::{self, AddressSpace, AddressSpaceCacheable, EISAName, Memory32Fixed, ResourceTemplate, IO};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace as GasSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::slit::SLIT;
use acpi_tables::srat::MemoryAffinity;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{Aml, AmlSink};
use kumo_vm::layout::{MemoryLayout, IOAPIC_START, LAPIC_START};
use kumo_vm::IrqchipMode;
use vm_memory::{Bytes, GuestAddress};
use zerocopy::{Immutable, IntoBytes};

pub use hotplug::Ged;
pub use kumo_vm::layout::{ACPI_END, ACPI_START};
pub use topology::{split_memory, NumaNode, NumaTopology, TopologyError, LOCAL_DISTANCE, REMOTE_DISTANCE};

/// OEM ID in every table header.
pub const OEM_ID: [u8; 6] = *b"KUMO  ";
/// ECAM bytes per bus (32 devices x 8 functions x 4 KiB).
pub const ECAM_BUS_SIZE: u64 = 1 << 20;

/// What the tables describe.
#[derive(Debug, Clone)]
pub struct AcpiConfig<'a> {
    /// vCPUs; vCPU `i` has APIC ID `i`.
    pub cpus: u32,
    pub layout: &'a MemoryLayout,
    /// With [`IrqchipMode::Kernel`] the MADT lists KVM's IOAPIC, with `User` kumo's; a split
    /// irqchip has none.
    pub irqchip: IrqchipMode,
    /// The PCI host bridge (DSDT, MCFG), if the VM has PCI.
    pub pci: Option<PciHost>,
    /// Guest NUMA nodes (SRAT, SLIT); `None`: no SRAT/SLIT.
    pub numa: Option<&'a NumaTopology>,
    /// The GED (DSDT: `\_SB.GED0`, the power button and CPU hotplug for every vCPU); `None`:
    /// neither.
    pub ged: Option<Ged>,
    /// The sleep registers (FADT) and `\_S5` (DSDT): how the OS powers off; `None`: it cannot.
    pub sleep: Option<SleepRegisters>,
}

/// A hardware-reduced platform's sleep control and status registers: byte-wide I/O ports
/// `port` and `port + 1`, and the `SLP_TYP` that enters S5 (soft off) when written there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SleepRegisters {
    pub port: u16,
    pub s5_type: u8,
}

/// PCI segment 0, bus 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciHost {
    /// ECAM base of bus 0 ([`ECAM_BUS_SIZE`] bytes).
    pub ecam_base: u64,
    /// The 32-bit window BARs are placed in.
    pub mmio32: Range<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("{0}")]
    Topology(#[from] TopologyError),
    #[error("ACPI: {cpus} vCPUs do not fit in xAPIC MADT entries (at most 255)")]
    TooManyCpus { cpus: u32 },
    #[error("ACPI: PCI windows must lie below 4 GiB (ECAM {ecam:#x}, window {mmio32:#x?})")]
    PciAbove4G { ecam: u64, mmio32: Range<u64> },
    #[error("ACPI tables need {need} bytes, more than the {have} bytes reserved for them")]
    TooLarge { need: u64, have: u64 },
    #[error("cannot write the ACPI tables to guest memory: {0}")]
    Write(vm_memory::GuestMemoryError),
}

/// Built tables and where each goes.
#[derive(Debug, Clone)]
pub struct Tables {
    /// Guest-physical address of the RSDP.
    pub rsdp: u64,
    /// `(address, bytes)`: the RSDP first, then the tables in address order.
    pub blobs: Vec<(u64, Vec<u8>)>,
}

impl Tables {
    /// The table with `signature` (`b"APIC"`, `b"SRAT"`, …; the RSDP is `b"RSD "`).
    pub fn find(&self, signature: &[u8; 4]) -> Option<&(u64, Vec<u8>)> {
        self.blobs.iter().find(|(_, b)| b.get(..4) == Some(signature.as_slice()))
    }

    /// End (exclusive) of the last table.
    pub fn end(&self) -> u64 {
        self.blobs.iter().map(|(a, b)| a + b.len() as u64).max().unwrap_or(self.rsdp)
    }
}

fn table_id(sig: &[u8; 4]) -> [u8; 8] {
    let mut id = *b"KUMO    ";
    id[4..].copy_from_slice(sig);
    id
}

fn bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

/// MADT Interrupt Source Override (type 2), which `acpi_tables` 0.2 does not have.
#[repr(C, packed)]
#[derive(Clone, Copy, IntoBytes, Immutable)]
struct InterruptSourceOverride {
    kind: u8,
    length: u8,
    bus: u8,
    source: u8,
    gsi: [u8; 4],
    flags: [u8; 2],
}

/// MADT Local APIC NMI (type 4).
#[repr(C, packed)]
#[derive(Clone, Copy, IntoBytes, Immutable)]
struct LocalApicNmi {
    kind: u8,
    length: u8,
    processor_uid: u8,
    flags: [u8; 2],
    lint: u8,
}

impl Aml for InterruptSourceOverride {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(self.as_bytes());
    }
}

impl Aml for LocalApicNmi {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(self.as_bytes());
    }
}

/// SRAT Processor Local APIC Affinity (type 0, 16 bytes), which `acpi_tables` 0.2 does not have.
fn srat_cpu(apic_id: u8, pxm: u32) -> [u8; 16] {
    let mut e = [0u8; 16];
    let p = pxm.to_le_bytes();
    e[0] = 0;
    e[1] = 16;
    e[2] = p[0];
    e[3] = apic_id;
    e[4..8].copy_from_slice(&1u32.to_le_bytes()); // enabled
    e[9..12].copy_from_slice(&p[1..4]);
    e
}

fn dsdt(cfg: &AcpiConfig) -> Result<Vec<u8>, AcpiError> {
    let mut t = Sdt::new(*b"DSDT", 36, 2, OEM_ID, table_id(b"DSDT"), 1);
    let mut sb = match &cfg.pci {
        Some(pci) => pci_devices(pci)?,
        None => Vec::new(),
    };
    if let Some(ged) = &cfg.ged {
        sb.extend(hotplug::devices(cfg.cpus, ged));
    }
    if !sb.is_empty() {
        t.append_slice(&bytes(&aml::Scope::new("\\_SB_".into(), vec![&hotplug::raw(sb)])));
    }
    if let Some(r) = &cfg.sleep {
        // \_S5: SLP_TYPa (what the OS writes to the sleep control register), SLP_TYPb (unused
        // on a hardware-reduced platform).
        let (a, b) = (r.s5_type, 0u8);
        t.append_slice(&bytes(&aml::Name::new("_S5_".into(), &aml::Package::new(vec![&a, &b]))));
    }
    Ok(t.as_slice().to_vec())
}

/// `\_SB.PCI0` and `\_SB.MRES`, encoded.
fn pci_devices(pci: &PciHost) -> Result<Vec<u8>, AcpiError> {
    let (ecam, w) = (pci.ecam_base, &pci.mmio32);
    let to32 = |v: u64| u32::try_from(v).map_err(|_| AcpiError::PciAbove4G { ecam, mmio32: w.clone() });
    let (ecam32, w_start, w_last) = (to32(ecam + ECAM_BUS_SIZE - 1)?, to32(w.start)?, to32(w.end - 1)?);
    let ecam32 = ecam32 - (ECAM_BUS_SIZE as u32 - 1);

    let bus = AddressSpace::new_bus_number(0u16, 0u16);
    let cfg_ports = IO::new(0xcf8, 0xcf8, 1, 8);
    let io_low = AddressSpace::new_io(0u16, 0xcf7u16, None);
    let io_high = AddressSpace::new_io(0xd00u16, 0xffffu16, None);
    let mmio = AddressSpace::new_memory(AddressSpaceCacheable::NotCacheable, true, w_start, w_last, None);
    let crs = ResourceTemplate::new(vec![&bus, &cfg_ports, &io_low, &io_high, &mmio]);
    let (hid, cid) = (EISAName::new("PNP0A08"), EISAName::new("PNP0A03"));
    let zero = aml::ZERO;
    let names = [
        aml::Name::new("_HID".into(), &hid),
        aml::Name::new("_CID".into(), &cid),
        aml::Name::new("_ADR".into(), &zero),
        aml::Name::new("_SEG".into(), &zero),
        aml::Name::new("_UID".into(), &zero),
        aml::Name::new("_BBN".into(), &zero),
        aml::Name::new("_CRS".into(), &crs),
    ];
    let pci0 = aml::Device::new("PCI0".into(), names.iter().map(|n| n as &dyn Aml).collect());

    let ecam_res = Memory32Fixed::new(false, ecam32, ECAM_BUS_SIZE as u32);
    let mres_crs = ResourceTemplate::new(vec![&ecam_res]);
    let mres_hid = EISAName::new("PNP0C02");
    let mres_names = [
        aml::Name::new("_HID".into(), &mres_hid),
        aml::Name::new("_UID".into(), &zero),
        aml::Name::new("_CRS".into(), &mres_crs),
    ];
    let mres = aml::Device::new("MRES".into(), mres_names.iter().map(|n| n as &dyn Aml).collect());

    let mut v = bytes(&pci0);
    v.extend(bytes(&mres));
    Ok(v)
}

fn fadt(dsdt: u64, sleep: Option<SleepRegisters>) -> Vec<u8> {
    let mut b = FADTBuilder::new(OEM_ID, table_id(b"FACP"), 1)
        .dsdt_64(dsdt)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    // IA-PC boot architecture: no VGA (bit 2), no CMOS RTC (bit 5); 8042 (bit 1) and legacy
    // devices (bit 0) clear because kumo has neither; MSI allowed (bit 3 clear).
    b.iapc_boot_arch = ((1u16 << 2) | (1 << 5)).into();
    // Hardware-reduced ACPI has no SCI, but Linux in PIC mode (`noapic`, kumo's default command
    // line) still marks the FADT's SCI level-triggered in the ELCR: left at 0, that would be the
    // timer's IRQ. 9 is the PC's SCI and unused in kumo.
    b.sci_int = 9u16.into();
    if let Some(r) = sleep {
        let port = |p: u16| GAS::new(GasSpace::SystemIo, 8, 0, AccessSize::ByteAccess, p.into());
        b.sleep_control_reg = port(r.port);
        b.sleep_status_reg = port(r.port + 1);
    }
    bytes(&b.finalize())
}

fn madt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut t = MADT::new(OEM_ID, table_id(b"APIC"), 1, LocalInterruptController::Address(LAPIC_START as u32));
    for cpu in 0..cfg.cpus {
        t.add_structure(ProcessorLocalApic::new(cpu as u8, cpu as u8, EnabledStatus::Enabled));
    }
    // KVM's IOAPIC, or kumo's with `--irqchip user`.
    if cfg.irqchip != IrqchipMode::Split {
        t.add_structure(IoApic::new(0, IOAPIC_START as u32, 0));
        // The PIT raises GSI 0 and kumo routes legacy GSI n to IOAPIC pin n (not pin 2 as on
        // PC hardware and QEMU): say so, edge-triggered, active high (flags 0 = bus default).
        t.add_structure(InterruptSourceOverride {
            kind: 2,
            length: 10,
            bus: 0,
            source: 0,
            gsi: 0u32.to_le_bytes(),
            flags: [0, 0],
        });
    }
    // LINT1 of every processor is the NMI input, as on PCs.
    t.add_structure(LocalApicNmi { kind: 4, length: 6, processor_uid: 0xff, flags: [0, 0], lint: 1 });
    bytes(&t)
}

fn mcfg(ecam_base: u64) -> Vec<u8> {
    let mut t = MCFG::new(OEM_ID, table_id(b"MCFG"), 1);
    t.add_ecam(ecam_base, 0, 0, 0);
    bytes(&t)
}

/// A hot-pluggable memory range (a virtio-mem region) on guest node `node`: an SRAT memory
/// affinity entry marked hot-pluggable, so Linux accepts memory added there later. It is not RAM
/// at boot (not in the e820 map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotplugMemory {
    pub node: u32,
    pub start: u64,
    pub len: u64,
}

fn srat(numa: &NumaTopology, hotplug: &[HotplugMemory]) -> Vec<u8> {
    let mut t = Sdt::new(*b"SRAT", 48, 3, OEM_ID, table_id(b"SRAT"), 1);
    t.write_u32(36, 1); // reserved, 1 for compatibility
    let mut nodes: Vec<&NumaNode> = numa.nodes.iter().collect();
    nodes.sort_by_key(|n| n.id);
    for n in &nodes {
        for &cpu in &n.cpus {
            t.append_slice(&srat_cpu(cpu as u8, n.id));
        }
    }
    for n in &nodes {
        for &(start, len) in &n.memory {
            t.append_slice(&bytes(&MemoryAffinity::new(n.id, start, len).enabled()));
        }
    }
    for h in hotplug {
        t.append_slice(&bytes(&MemoryAffinity::new(h.node, h.start, h.len).enabled().hotpluggable()));
    }
    t.as_slice().to_vec()
}

fn slit(numa: &NumaTopology) -> Vec<u8> {
    let n = numa.nodes.len();
    let mut t = SLIT::new(OEM_ID, table_id(b"SLIT"), 1, n as u32);
    for a in 0..n {
        for b in a + 1..n {
            t.set_distance(a, b, numa.distance(a as u32, b as u32));
        }
    }
    bytes(&t)
}

/// Builds every table for `cfg` and places them from [`ACPI_START`]: the RSDP first (16-byte
/// aligned, for the legacy scan), then DSDT, FADT, MADT, MCFG, SRAT, SLIT and the XSDT.
pub fn build(cfg: &AcpiConfig) -> Result<Tables, AcpiError> {
    build_with_hotplug(cfg, &[])
}

/// [`build`] with hot-pluggable memory ranges in the SRAT. Without a NUMA topology, the SRAT
/// then describes one node 0 holding every vCPU and all RAM.
pub fn build_with_hotplug(cfg: &AcpiConfig, hotplug: &[HotplugMemory]) -> Result<Tables, AcpiError> {
    let one_node;
    let numa = match (cfg.numa, hotplug.is_empty()) {
        (None, false) => {
            let node = NumaNode { id: 0, cpus: (0..cfg.cpus).collect(), memory: cfg.layout.ram().to_vec() };
            one_node = NumaTopology { nodes: vec![node], distances: Vec::new() };
            Some(&one_node)
        }
        (n, _) => n,
    };
    if cfg.cpus > 255 {
        return Err(AcpiError::TooManyCpus { cpus: cfg.cpus });
    }
    if let Some(numa) = numa {
        numa.validate(cfg.cpus, cfg.layout)?;
    }
    let mut blobs: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut next = ACPI_START + 0x40; // after the 36-byte RSDP
    let mut place = |b: Vec<u8>| {
        let at = next;
        next = (at + b.len() as u64).next_multiple_of(16);
        blobs.push((at, b));
        at
    };
    let dsdt_at = place(dsdt(cfg)?);
    let mut xsdt_entries = vec![place(fadt(dsdt_at, cfg.sleep)), place(madt(cfg))];
    if let Some(pci) = &cfg.pci {
        xsdt_entries.push(place(mcfg(pci.ecam_base)));
    }
    if let Some(numa) = numa {
        xsdt_entries.push(place(srat(numa, hotplug)));
        xsdt_entries.push(place(slit(numa)));
    }
    let mut xsdt = XSDT::new(OEM_ID, table_id(b"XSDT"), 1);
    for e in xsdt_entries {
        xsdt.add_entry(e);
    }
    let xsdt_at = place(bytes(&xsdt));
    blobs.insert(0, (ACPI_START, bytes(&Rsdp::new(OEM_ID, xsdt_at))));
    let tables = Tables { rsdp: ACPI_START, blobs };
    if tables.end() > ACPI_END {
        return Err(AcpiError::TooLarge { need: tables.end() - ACPI_START, have: ACPI_END - ACPI_START });
    }
    Ok(tables)
}

/// Builds the tables for `cfg` and writes them into `mem`. Returns the RSDP's address, for
/// `kumo_vm::boot::linux::set_acpi_rsdp`.
pub fn write(mem: &kumo_vm::GuestMemory, cfg: &AcpiConfig) -> Result<u64, AcpiError> {
    write_with_hotplug(mem, cfg, &[])
}

/// [`write`] with hot-pluggable memory ranges ([`build_with_hotplug`]).
pub fn write_with_hotplug(
    mem: &kumo_vm::GuestMemory,
    cfg: &AcpiConfig,
    hotplug: &[HotplugMemory],
) -> Result<u64, AcpiError> {
    let tables = build_with_hotplug(cfg, hotplug)?;
    for (at, b) in &tables.blobs {
        mem.write_slice(b, GuestAddress(*at)).map_err(AcpiError::Write)?;
    }
    Ok(tables.rsdp)
}

#[cfg(test)]
mod tests;
