//! Each table parsed back from the bytes: signature, length, checksum, the fields kumo sets.

use super::*;
use kumo_vm::linux::{e820_map, E820_RESERVED};

const MIB: u64 = 1 << 20;

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}
fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
}

/// Checks the header of the table `sig` and returns its bytes.
fn table<'a>(t: &'a Tables, sig: &[u8; 4]) -> &'a [u8] {
    let (at, b) = t.find(sig).unwrap_or_else(|| panic!("no {}", String::from_utf8_lossy(sig)));
    assert_eq!(u32_at(b, 4) as usize, b.len(), "{sig:?} length");
    assert_eq!(sum(b), 0, "{sig:?} checksum");
    assert_eq!(&b[10..16], &OEM_ID);
    assert!(*at >= ACPI_START && at + b.len() as u64 <= ACPI_END && at % 8 == 0);
    b
}

fn pci() -> PciHost {
    PciHost { ecam_base: 0xfeb0_0000, mmio32: 0xc000_0000..0xfeb0_0000 }
}

fn two_nodes(layout: &MemoryLayout) -> NumaTopology {
    let m = split_memory(layout, &[layout.size() / 2, layout.size() / 2]).unwrap();
    NumaTopology {
        nodes: vec![
            NumaNode { id: 0, cpus: vec![0, 1], memory: m[0].clone() },
            NumaNode { id: 1, cpus: vec![2, 3], memory: m[1].clone() },
        ],
        distances: vec![vec![10, 21], vec![21, 10]],
    }
}

/// `cpus` vCPUs on `layout` with KVM's irqchip and nothing else: the base the tests add to.
fn bare(cpus: u32, layout: &MemoryLayout) -> AcpiConfig<'_> {
    AcpiConfig { cpus, layout, irqchip: IrqchipMode::Kernel, pci: None, numa: None, ged: None, sleep: None }
}

fn build_with(cpus: u32, layout: &MemoryLayout, irqchip: IrqchipMode, numa: Option<&NumaTopology>) -> Tables {
    build(&AcpiConfig { irqchip, pci: Some(pci()), numa, ..bare(cpus, layout) }).unwrap()
}

#[test]
fn rsdp_points_at_an_xsdt_listing_every_table() {
    let layout = MemoryLayout::new(512 * MIB);
    let numa = two_nodes(&layout);
    let t = build_with(4, &layout, IrqchipMode::Kernel, Some(&numa));
    let (at, r) = &t.blobs[0];
    assert_eq!((*at, t.rsdp, r.len()), (ACPI_START, ACPI_START, 36));
    assert_eq!(&r[..8], b"RSD PTR ");
    assert_eq!((sum(&r[..20]), sum(r), r[15], u32_at(r, 20)), (0, 0, 2, 36));
    assert_eq!(ACPI_START % 16, 0);
    let xsdt_at = u64_at(r, 24);
    let x = table(&t, b"XSDT");
    assert_eq!(t.find(b"XSDT").unwrap().0, xsdt_at);
    let listed: Vec<&[u8]> = (36..x.len())
        .step_by(8)
        .map(|o| {
            let a = u64_at(x, o);
            &t.blobs.iter().find(|(at, _)| *at == a).unwrap().1[..4]
        })
        .collect();
    assert_eq!(listed, [b"FACP", b"APIC", b"MCFG", b"SRAT", b"SLIT"]);
    // Tables do not overlap.
    let mut spans: Vec<(u64, u64)> = t.blobs.iter().map(|(a, b)| (*a, a + b.len() as u64)).collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
}

#[test]
fn fadt_is_hardware_reduced_and_points_at_the_dsdt() {
    let layout = MemoryLayout::new(512 * MIB);
    let t = build_with(2, &layout, IrqchipMode::Kernel, None);
    let f = table(&t, b"FACP");
    assert_eq!((f.len(), f[8], f[131]), (276, 6, 5)); // ACPI 6.5 FADT
    let flags = u32_at(f, 112);
    assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
    assert_eq!(u16_at(f, 109), (1 << 2) | (1 << 5), "IA-PC boot arch: no VGA, no CMOS RTC");
    assert_eq!(u16_at(f, 46), 9, "SCI_INT");
    let x_dsdt = u64_at(f, 140);
    assert_eq!(t.find(b"DSDT").unwrap().0, x_dsdt);
    table(&t, b"DSDT");
}

#[test]
fn dsdt_describes_the_pci_host_bridge_and_reserves_ecam() {
    let layout = MemoryLayout::new(512 * MIB);
    let t = build_with(1, &layout, IrqchipMode::Kernel, None);
    let d = table(&t, b"DSDT");
    let has = |needle: &[u8]| d.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"_SB_") && has(b"PCI0") && has(b"MRES") && has(b"_CRS") && has(b"_BBN"));
    // EISAID("PNP0A08") = 0x080AD041, "PNP0C02" = 0x020CD041, little endian after DWordPrefix.
    assert!(has(&[0x0c, 0x41, 0xd0, 0x0a, 0x08]) && has(&[0x0c, 0x41, 0xd0, 0x0c, 0x02]));
    // Memory32Fixed(ReadOnly, ECAM, 1 MiB) and DWordMemory(0xc0000000..=0xfeafffff).
    assert!(has(&[0x86, 9, 0, 0, 0x00, 0x00, 0xb0, 0xfe, 0x00, 0x00, 0x10, 0x00]));
    let mut window = 0xc000_0000u32.to_le_bytes().to_vec();
    window.extend_from_slice(&0xfeaf_ffffu32.to_le_bytes());
    assert!(has(&window));
    // Without PCI: an empty DSDT.
    let t = build(&bare(1, &layout)).unwrap();
    assert_eq!(table(&t, b"DSDT").len(), 36);
    assert!(t.find(b"MCFG").is_none());
}

/// MADT entries `(type, bytes)` after the 44-byte header.
fn madt_entries(m: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut o = 44;
    while o < m.len() {
        let len = m[o + 1] as usize;
        out.push((m[o], &m[o..o + len]));
        o += len;
    }
    assert_eq!(o, m.len());
    out
}

#[test]
fn madt_has_a_local_apic_per_vcpu_the_ioapic_and_the_timer_override() {
    let layout = MemoryLayout::new(512 * MIB);
    for (cpus, irqchip) in
        [(1, IrqchipMode::Kernel), (4, IrqchipMode::Kernel), (240, IrqchipMode::Split), (2, IrqchipMode::User)]
    {
        let t = build_with(cpus, &layout, irqchip, None);
        let m = table(&t, b"APIC");
        assert_eq!(u32_at(m, 36), LAPIC_START as u32);
        let e = madt_entries(m);
        let lapics: Vec<(u8, u8, u32)> =
            e.iter().filter(|x| x.0 == 0).map(|x| (x.1[2], x.1[3], u32_at(x.1, 4))).collect();
        assert_eq!(lapics, (0..cpus).map(|i| (i as u8, i as u8, 1)).collect::<Vec<_>>());
        let ioapics: Vec<&[u8]> = e.iter().filter(|x| x.0 == 1).map(|x| x.1).collect();
        let isos: Vec<&[u8]> = e.iter().filter(|x| x.0 == 2).map(|x| x.1).collect();
        if irqchip != IrqchipMode::Split {
            assert_eq!(ioapics.len(), 1);
            assert_eq!((u32_at(ioapics[0], 4), u32_at(ioapics[0], 8)), (IOAPIC_START as u32, 0));
            assert_eq!(isos, [[2u8, 10, 0, 0, 0, 0, 0, 0, 0, 0].as_slice()]);
        } else {
            assert!(ioapics.is_empty() && isos.is_empty());
        }
        assert_eq!(
            e.iter().filter(|x| x.0 == 4).map(|x| x.1).collect::<Vec<_>>(),
            [[4u8, 6, 0xff, 0, 0, 1].as_slice()]
        );
    }
}

#[test]
fn mcfg_has_ecam_for_bus_0() {
    let layout = MemoryLayout::new(512 * MIB);
    let t = build_with(2, &layout, IrqchipMode::Kernel, None);
    let m = table(&t, b"MCFG");
    assert_eq!(m.len(), 44 + 16);
    assert_eq!((u64_at(m, 44), u16_at(m, 52), m[54], m[55]), (0xfeb0_0000, 0, 0, 0));
}

#[test]
fn srat_and_slit_describe_the_topology() {
    let layout = MemoryLayout::new(6 << 30);
    let numa = two_nodes(&layout);
    let t = build_with(4, &layout, IrqchipMode::Kernel, Some(&numa));
    let s = table(&t, b"SRAT");
    assert_eq!(u32_at(s, 36), 1);
    let mut cpus = Vec::new();
    let mut mem = Vec::new();
    let mut o = 48;
    while o < s.len() {
        let e = &s[o..o + s[o + 1] as usize];
        match e[0] {
            0 => {
                assert_eq!(e.len(), 16);
                let pxm = u32::from_le_bytes([e[2], e[9], e[10], e[11]]);
                assert_eq!(u32_at(e, 4), 1, "enabled");
                cpus.push((e[3], pxm));
            }
            1 => {
                assert_eq!(e.len(), 40);
                assert_eq!(u32_at(e, 28), 1, "enabled");
                mem.push((u32_at(e, 2), u64_at(e, 8), u64_at(e, 16)));
            }
            k => panic!("unexpected SRAT entry type {k}"),
        }
        o += e.len();
    }
    assert_eq!(o, s.len());
    assert_eq!(cpus, [(0, 0), (1, 0), (2, 1), (3, 1)]);
    // 6 GiB: node 0 = [0, 3 GiB); node 1 = the rest, past the MMIO gap.
    assert_eq!(mem, [(0, 0, 3 << 30), (1, 4 << 30, 3 << 30)]);

    let l = table(&t, b"SLIT");
    assert_eq!(u64_at(l, 36), 2);
    assert_eq!(&l[44..], &[10, 21, 21, 10]);

    // The default distances, with three nodes.
    let layout = MemoryLayout::new(768 * MIB);
    let m = split_memory(&layout, &[256 * MIB; 3]).unwrap();
    let numa = NumaTopology {
        nodes: (0..3).map(|i| NumaNode { id: i, cpus: vec![i], memory: m[i as usize].clone() }).collect(),
        distances: vec![],
    };
    let t = build_with(3, &layout, IrqchipMode::Kernel, Some(&numa));
    assert_eq!(&table(&t, b"SLIT")[44..], &[10, 20, 20, 20, 10, 20, 20, 20, 10]);
}

#[test]
fn no_topology_means_no_srat_or_slit_and_a_bad_one_is_refused() {
    let layout = MemoryLayout::new(512 * MIB);
    let t = build_with(2, &layout, IrqchipMode::Kernel, None);
    assert!(t.find(b"SRAT").is_none() && t.find(b"SLIT").is_none());
    let mut numa = two_nodes(&layout);
    numa.nodes[1].cpus = vec![1, 2, 3];
    let e = build(&AcpiConfig { numa: Some(&numa), ..bare(4, &layout) }).unwrap_err();
    assert_eq!(e.to_string(), "cpu 1 is in two NUMA nodes: 0 and 1");
    let e = build(&bare(256, &layout));
    assert!(e.unwrap_err().to_string().contains("at most 255"));
}

#[test]
fn the_largest_vm_fits_and_the_area_is_reserved_in_e820() {
    let layout = MemoryLayout::new(8 << 30);
    let n = 8u32;
    let per = kumo_vm::layout::MAX_VCPUS / n;
    let m = split_memory(&layout, &vec![1 << 30; n as usize]).unwrap();
    let numa = NumaTopology {
        nodes: (0..n)
            .map(|i| NumaNode { id: i, cpus: (i * per..(i + 1) * per).collect(), memory: m[i as usize].clone() })
            .collect(),
        distances: vec![],
    };
    let t = build_with(kumo_vm::layout::MAX_VCPUS, &layout, IrqchipMode::Kernel, Some(&numa));
    assert!(t.end() <= ACPI_END);
    for sig in [b"XSDT", b"FACP", b"DSDT", b"APIC", b"MCFG", b"SRAT", b"SLIT"] {
        table(&t, sig);
    }
    for mem in [8 * MIB, 512 * MIB, 8 << 30] {
        let map = e820_map(&MemoryLayout::new(mem));
        assert!(map.iter().any(|e| e.kind == E820_RESERVED && e.addr <= ACPI_START && ACPI_END <= e.addr + e.size));
    }
}

#[test]
fn write_puts_the_tables_in_guest_memory() {
    let mem = kumo_vm::Memory::new(64 * MIB).unwrap();
    let layout = MemoryLayout::new(64 * MIB);
    let cfg = AcpiConfig { pci: Some(pci()), ..bare(2, &layout) };
    let rsdp = write(&mem.guest, &cfg).unwrap();
    assert_eq!(rsdp, ACPI_START);
    let mut sig = [0u8; 8];
    mem.guest.read_slice(&mut sig, GuestAddress(rsdp)).unwrap();
    assert_eq!(&sig, b"RSD PTR ");
    let t = build(&cfg).unwrap();
    for (at, b) in &t.blobs {
        let mut got = vec![0u8; b.len()];
        mem.guest.read_slice(&mut got, GuestAddress(*at)).unwrap();
        assert_eq!(&got, b);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What kumo's VMs have: the GED and the sleep registers at 0x600 with S5 = 5.
fn with_ged(cpus: u32, layout: &MemoryLayout) -> Tables {
    let ged = Ged { mmio_base: 0xfed0_0000, gsi: 5 };
    let sleep = Some(SleepRegisters { port: 0x600, s5_type: 5 });
    build(&AcpiConfig { pci: Some(pci()), ged: Some(ged), sleep, ..bare(cpus, layout) }).unwrap()
}

#[test]
fn the_sleep_registers_and_s5_tell_the_os_how_to_power_off() {
    let layout = MemoryLayout::new(64 * MIB);
    let t = with_ged(1, &layout);
    let f = table(&t, b"FACP");
    // SLEEP_CONTROL_REG (offset 244) and SLEEP_STATUS_REG (256): byte-wide system I/O ports.
    let gas = |at: usize| (f[at], f[at + 1], f[at + 2], f[at + 3], u64_at(f, at + 4));
    assert_eq!(gas(244), (1, 8, 0, 1, 0x600));
    assert_eq!(gas(256), (1, 8, 0, 1, 0x601));
    // \_S5 = Package {5, 0}: NameOp, "_S5_", PackageOp, length 4, 2 elements, BytePrefix 5, Zero.
    let d = table(&t, b"DSDT");
    assert!(find(d, &[0x08, b'_', b'S', b'5', b'_', 0x12, 0x05, 0x02, 0x0a, 0x05, 0x00]).is_some(), "{d:x?}");
    // Without them (the default of a table set built for kumo's own guests), neither.
    let plain = build_with(1, &layout, IrqchipMode::Kernel, None);
    assert_eq!(gas_at(table(&plain, b"FACP"), 244), 0);
    assert!(find(table(&plain, b"DSDT"), b"_S5_").is_none());
}

/// The address of the GAS at `at` of a table.
fn gas_at(f: &[u8], at: usize) -> u64 {
    u64_at(f, at + 4)
}

#[test]
fn the_ged_power_button_and_every_vcpu_are_in_the_dsdt() {
    let layout = MemoryLayout::new(64 * MIB);
    let t = with_ged(3, &layout);
    let d = table(&t, b"DSDT");
    for name in [&b"GED0"[..], b"_EVT", b"GEVT", b"PWRB", b"CPUS", b"CSCN", b"CSTS", b"CEJ0", b"C000", b"C001", b"C002"]
    {
        assert!(find(d, name).is_some(), "{} missing", String::from_utf8_lossy(name));
    }
    assert!(find(d, b"C003").is_none());
    // The GED's interrupt: an Extended IRQ descriptor, consumer, edge, active high, GSI 5.
    assert!(find(d, &[0x89, 6, 0, 0b0011, 1, 5, 0, 0, 0]).is_some());
    // Its registers: OperationRegion (GREG, SystemMemory, 0xFED00000, 4).
    assert!(find(d, &[0x5b, 0x80, b'G', b'R', b'E', b'G', 0, 0x0c, 0, 0, 0xd0, 0xfe, 0x0a, 4]).is_some());
    // The CPU block 0x10 further: (CREG, SystemMemory, 0xFED00010, 8).
    assert!(find(d, &[0x5b, 0x80, b'C', b'R', b'E', b'G', 0, 0x0c, 0x10, 0, 0xd0, 0xfe, 0x0a, 8]).is_some());
    // vCPU 2's _MAT: its MADT entry (type 0, length 8, UID 2, APIC ID 2, enabled).
    assert!(find(d, &[0, 8, 2, 2, 1, 0, 0, 0]).is_some());
    // Processors are hot-pluggable devices (ACPI0007), the power button is PNP0C0C.
    assert!(find(d, b"ACPI0007\0").is_some() && find(d, b"ACPI0013\0").is_some());
    assert!(find(d, &[0x41, 0xd0, 0x0c, 0x0c]).is_some(), "EISA id PNP0C0C");
    // The MADT keeps listing every possible vCPU, enabled.
    let madt = table(&t, b"APIC");
    for cpu in 0..3u8 {
        assert!(find(madt, &[0, 8, cpu, cpu, 1, 0, 0, 0]).is_some());
    }
}

#[test]
fn without_a_ged_the_dsdt_has_no_hotplug_objects() {
    let layout = MemoryLayout::new(64 * MIB);
    let t = build_with(2, &layout, IrqchipMode::Kernel, None);
    let d = table(&t, b"DSDT");
    assert!(find(d, b"GED0").is_none() && find(d, b"CPUS").is_none());
}

#[test]
fn the_most_vcpus_kumo_supports_fit_with_hotplug() {
    let layout = MemoryLayout::new(64 * MIB);
    let t = with_ged(kumo_vm::layout::MAX_VCPUS, &layout);
    let d = table(&t, b"DSDT");
    assert!(find(d, b"C0EF").is_some());
}

/// ACPICA's disassembler (`iasl -d`, package acpica-tools) reads the DSDT with the GED and
/// CPU hotplug objects back, where it is installed; the listing is kept for a reader.
#[test]
fn iasl_disassembles_the_hotplug_dsdt() {
    let Ok(out) = std::process::Command::new("iasl").arg("-v").output() else {
        println!("skipping: no iasl (apt-get install acpica-tools)");
        return;
    };
    assert!(out.status.success());
    let layout = MemoryLayout::new(64 * MIB);
    let t = with_ged(2, &layout);
    let dir = std::env::temp_dir().join(format!("kumo-acpi-dsdt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let aml = dir.join("dsdt.aml");
    std::fs::write(&aml, &t.find(b"DSDT").unwrap().1).unwrap();
    let out = std::process::Command::new("iasl").arg("-d").arg(&aml).output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "iasl -d failed: {log}");
    let dsl = std::fs::read_to_string(dir.join("dsdt.dsl")).unwrap();
    if std::env::var_os("KUMO_SHOW_DSDT").is_some() {
        println!("{dsl}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    for want in [
        "Device (GED0)",
        "Method (_EVT, 1, Serialized)",
        "Notify (\\_SB.PWRB, 0x80)",
        "Method (CSCN, 0, Serialized)",
        "Notify (C001, 0x03)",
        "Device (C001)",
        "Method (_EJ0, 1",
        "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, )",
        "Name (_S5, Package (0x02)",
    ] {
        assert!(dsl.contains(want), "no {want:?} in:\n{dsl}");
    }
}

#[test]
fn hotplug_memory_gets_a_hotpluggable_srat_entry_even_without_numa() {
    let layout = MemoryLayout::new(512 * MIB);
    let hp = [HotplugMemory { node: 0, start: 4 << 30, len: 256 * MIB }];
    let cfg = bare(2, &layout);
    let t = build_with_hotplug(&cfg, &hp).unwrap();
    let s = table(&t, b"SRAT");
    let mut mem = Vec::new();
    let mut o = 48;
    while o < s.len() {
        let e = &s[o..o + s[o + 1] as usize];
        if e[0] == 1 {
            mem.push((u32_at(e, 2), u64_at(e, 8), u64_at(e, 16), u32_at(e, 28)));
        }
        o += e.len();
    }
    // RAM enabled; the hotplug range enabled and hot-pluggable (bit 1).
    assert_eq!(mem, [(0, 0, 512 * MIB, 1), (0, 4 << 30, 256 * MIB, 3)]);
    assert!(build(&cfg).unwrap().find(b"SRAT").is_none(), "no SRAT without NUMA or hotplug");
}
