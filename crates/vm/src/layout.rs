//! Guest physical memory layout used by kumo on x86_64.
//!
//! Everything the VMM writes before the first instruction lives below 1 MiB; kernels and kumo's
//! own guest programs are loaded at 1 MiB. The window [3 GiB, 4 GiB) is left for MMIO (device
//! MMIO, then the IOAPIC, LAPIC and KVM's pages); RAM beyond 3 GiB continues at 4 GiB.
//! [`MemoryLayout`] is a VM's map, built once from its RAM size; the constants are the fixed
//! addresses of boot structures. This module also owns the shape checks (vCPUs, memory).

/// Global descriptor table (shared by all vCPUs; one TSS descriptor per vCPU).
pub const GDT_START: u64 = 0x1000;
/// Size reserved for the GDT.
pub const GDT_SIZE: u64 = 0x1000;
/// First TSS descriptor index in the GDT (after null, code64, data, user data, user code64, pad).
pub const GDT_FIRST_TSS: usize = 6;
/// Boot information page for kumo's own guests (`struct kumo_boot_info`, see guests/include).
pub const KUMO_BOOT_INFO: u64 = 0x3000;
/// PVH `hvm_start_info` and its memory map.
pub const PVH_INFO_START: u64 = 0x6000;
/// Linux `boot_params` ("zero page").
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Boot page tables: PML4, one PDPT, then one PD per identity-mapped GiB.
pub const PML4_START: u64 = 0x9000;
pub const PDPT_START: u64 = 0xa000;
pub const PD_START: u64 = 0x40000;
/// How many GiB the boot page tables identity-map at most (one 4 KiB PD each).
pub const MAX_IDENTITY_GIB: u64 = 64;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
pub const CMDLINE_MAX_SIZE: usize = 0x10000;
/// Per-vCPU task state segments (kumo guests), `TSS_STRIDE` bytes each.
pub const TSS_START: u64 = 0x80000;
pub const TSS_STRIDE: u64 = 512;
/// Extended BIOS data area start: end of usable low memory.
pub const EBDA_START: u64 = 0x9fc00;
/// ACPI tables (`kumo-acpi`): the RSDP at the start, where a legacy scan of 0xE0000–0xFFFFF finds
/// it, the other tables after it. Inside the reserved `[EBDA_START, 1 MiB)` entry of the e820 map.
pub const ACPI_START: u64 = 0xe_0000;
/// End (exclusive) of the ACPI table area.
pub const ACPI_END: u64 = 0x10_0000;
const _: () = assert!(EBDA_START < ACPI_START && ACPI_END <= HIMEM_START, "ACPI tables sit in the reserved low area");
/// Where kernels and kumo guests are loaded.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the MMIO hole below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO hole (RAM resumes here).
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Local APIC MMIO base.
pub const LAPIC_START: u64 = 0xfee0_0000;
/// IOAPIC MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Identity map / TSS pages KVM needs on Intel (inside the MMIO gap, as Firecracker does).
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Most vCPUs kumo supports (bounded by GDT room for TSS descriptors and xAPIC IDs).
pub const MAX_VCPUS: u32 = 240;

/// A range of guest-physical addresses something other than RAM or free MMIO space occupies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub name: &'static str,
    pub start: u64,
    pub len: u64,
}

/// What sits inside the MMIO gap at fixed addresses: device MMIO must stay clear of these.
pub const RESERVED: [Reserved; 3] = [
    Reserved { name: "IOAPIC", start: IOAPIC_START, len: 0x1000 },
    Reserved { name: "LAPIC", start: LAPIC_START, len: 0x1000 },
    // KVM's EPT identity-map page (its default, one page below) and the three TSS pages.
    Reserved { name: "KVM identity map and TSS", start: KVM_TSS_ADDRESS - 0x1000, len: 0x4000 },
];

/// A VM's guest-physical memory map, built once from its RAM size and passed to whatever needs
/// it (guest memory, boot page tables, the Linux e820 map, kumo's boot info, migration): RAM
/// regions split around the MMIO gap, the gap, and the fixed ranges inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLayout {
    size: u64,
    ram: Vec<(u64, u64)>,
}

impl MemoryLayout {
    /// The layout of `size` bytes of RAM: one region below the MMIO gap, and the rest, if any,
    /// from 4 GiB.
    pub fn new(size: u64) -> MemoryLayout {
        let ram = if size <= MMIO_GAP_START {
            vec![(0, size)]
        } else {
            vec![(0, MMIO_GAP_START), (MMIO_GAP_END, size - MMIO_GAP_START)]
        };
        MemoryLayout { size, ram }
    }

    /// RAM bytes in all.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// RAM regions `(start, len)`, in address order.
    pub fn ram(&self) -> &[(u64, u64)] {
        &self.ram
    }

    /// End (exclusive) of the highest RAM region: what boot page tables must map.
    pub fn ram_end(&self) -> u64 {
        self.ram.last().map_or(0, |&(s, l)| s + l)
    }

    /// End (exclusive) of the RAM below the MMIO gap, where boot data and initrds must fit.
    pub fn low_ram_end(&self) -> u64 {
        self.size.min(MMIO_GAP_START)
    }

    /// The MMIO gap below 4 GiB.
    pub fn mmio_gap(&self) -> std::ops::Range<u64> {
        MMIO_GAP_START..MMIO_GAP_END
    }

    /// Where device MMIO (PCI BARs) can go below 4 GiB: the gap up to the first reserved range.
    pub fn mmio32(&self) -> std::ops::Range<u64> {
        MMIO_GAP_START..RESERVED.iter().map(|r| r.start).min().unwrap_or(MMIO_GAP_END)
    }

    /// The fixed ranges inside the MMIO gap.
    pub fn reserved(&self) -> &'static [Reserved] {
        &RESERVED
    }

    /// Whether `gpa` is guest RAM.
    pub fn is_ram(&self, gpa: u64) -> bool {
        self.ram.iter().any(|&(s, l)| gpa >= s && gpa - s < l)
    }
}

/// RAM regions `(start, len)` for a VM with `mem_bytes` of memory: [`MemoryLayout::ram`] for
/// callers that only have a size (a migration stream's description).
pub fn ram_regions(mem_bytes: u64) -> Vec<(u64, u64)> {
    MemoryLayout::new(mem_bytes).ram().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_vm_is_one_region() {
        assert_eq!(ram_regions(256 << 20), vec![(0, 256 << 20)]);
    }

    #[test]
    fn large_vm_skips_the_mmio_hole() {
        let r = ram_regions(4 << 30);
        assert_eq!(r, vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), 4 << 30);
    }

    #[test]
    fn layout_of_a_large_vm() {
        let l = MemoryLayout::new(5 << 30);
        assert_eq!(l.ram(), [(0, 3 << 30), (4 << 30, 2 << 30)]);
        assert_eq!((l.size(), l.ram_end(), l.low_ram_end()), (5 << 30, 6 << 30, 3 << 30));
        assert!(l.is_ram(0) && l.is_ram((3 << 30) - 1) && !l.is_ram(3 << 30) && l.is_ram(4 << 30));
        assert!(!l.is_ram(6 << 30));
        let small = MemoryLayout::new(256 << 20);
        assert_eq!((small.ram_end(), small.low_ram_end()), (256 << 20, 256 << 20));
    }

    #[test]
    fn reserved_ranges_lie_in_the_gap_above_device_mmio() {
        let l = MemoryLayout::new(1 << 30);
        let (gap, mmio) = (l.mmio_gap(), l.mmio32());
        assert_eq!(mmio, MMIO_GAP_START..IOAPIC_START);
        let mut r = l.reserved().to_vec();
        r.sort_by_key(|r| r.start);
        for w in r.windows(2) {
            assert!(w[0].start + w[0].len <= w[1].start, "{w:x?}");
        }
        for x in &r {
            assert!(gap.start <= x.start && x.start + x.len <= gap.end && x.start >= mmio.end, "{x:x?}");
        }
    }

    #[test]
    fn fixed_areas_do_not_overlap() {
        let mut areas = [
            (GDT_START, GDT_SIZE),
            (KUMO_BOOT_INFO, 0x1000),
            (PVH_INFO_START, 0x1000),
            (ZERO_PAGE_START, 0x1000),
            (PML4_START, 0x1000),
            (PDPT_START, 0x1000),
            (CMDLINE_START, CMDLINE_MAX_SIZE as u64),
            (PD_START, MAX_IDENTITY_GIB * 0x1000),
            (TSS_START, MAX_VCPUS as u64 * TSS_STRIDE),
        ];
        areas.sort();
        for w in areas.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{:x?} overlaps {:x?}", w[0], w[1]);
        }
        assert!(TSS_START + MAX_VCPUS as u64 * TSS_STRIDE <= EBDA_START);
        assert!((GDT_FIRST_TSS as u64 + 2 * MAX_VCPUS as u64) * 8 <= GDT_SIZE);
    }
}
