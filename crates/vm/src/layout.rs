//! Guest physical memory layout used by kumo on x86_64.
//!
//! Everything the VMM writes before the first instruction lives below 1 MiB; kernels and kumo's
//! own guest programs are loaded at 1 MiB. The window [3 GiB, 4 GiB) is left for MMIO (LAPIC,
//! IOAPIC); RAM beyond 3 GiB continues at 4 GiB.

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

/// What this host allows a VM: the memory it can back and KVM's vCPU limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLimits {
    pub memory: crate::memory::HostMemory,
    /// KVM_CAP_MAX_VCPUS; `None` where /dev/kvm cannot be opened (building the VM then fails
    /// with that error).
    pub kvm_max_vcpus: Option<u32>,
}

impl HostLimits {
    /// Reads /proc/meminfo and asks KVM: cheap, nothing is allocated.
    pub fn probe() -> crate::Result<HostLimits> {
        Ok(HostLimits { memory: crate::memory::HostMemory::read()?, kvm_max_vcpus: crate::vm::kvm_max_vcpus() })
    }
}

/// vCPUs: at least 1, at most [`MAX_VCPUS`] and KVM's limit (if known).
pub fn check_vcpus(cpus: u32, kvm_max: Option<u32>) -> crate::Result<()> {
    if cpus == 0 {
        return Err(crate::Error::NoVcpus);
    }
    if cpus > MAX_VCPUS {
        return Err(crate::Error::AboveKumoVcpuLimit(cpus));
    }
    match kvm_max {
        Some(max) if cpus > max => Err(crate::Error::AboveKvmVcpuLimit(cpus, max)),
        _ => Ok(()),
    }
}

/// The one check of a VM's shape against kumo's and this host's limits, made on every path
/// (flags, config files, migration headers, prepared destinations) before anything is
/// allocated: vCPUs ([`check_vcpus`]), then memory ([`crate::memory::check_size`]).
pub fn check_shape(cpus: u32, memory: u64, host: &HostLimits) -> crate::Result<()> {
    check_vcpus(cpus, host.kvm_max_vcpus)?;
    crate::memory::check_size(memory, &host.memory)
}

/// RAM regions `(start, len)` for a VM with `mem_bytes` of memory, splitting around the MMIO hole.
pub fn ram_regions(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, mem_bytes - MMIO_GAP_START)]
    }
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
    fn shapes() {
        let host = HostLimits { memory: crate::memory::HostMemory { total: 24 << 30 }, kvm_max_vcpus: Some(64) };
        for (cpus, mem) in [(1, 8 << 20), (1, 256 << 20), (64, 1 << 30), (2, host.memory.usable())] {
            check_shape(cpus, mem, &host).unwrap();
        }
        let bad: &[(u32, u64, &str)] = &[
            (0, 256 << 20, "cpus must be at least 1"),
            (65, 256 << 20, "cpus 65 exceeds this host's KVM limit of 64 vCPUs"),
            (241, 256 << 20, "cpus 241 exceeds kumo's limit of 240"),
            (u32::MAX, 256 << 20, "kumo's limit"),
            (1, 0, "at least 8 MiB"),
            (1, 4 << 20, "at least 8 MiB"),
            (1, (256 << 20) + 512, "multiple of 4 KiB"),
            (1, 1 << 40, "memory 1 TiB is more than this host can back (22.8 GiB usable of 24 GiB)"),
            (1, 1 << 50, "memory 1 PiB is more than this host can back"),
            (1, u64::MAX, "multiple of 4 KiB"),
        ];
        for &(cpus, mem, want) in bad {
            let e = check_shape(cpus, mem, &host).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{cpus} cpus, {mem} bytes: {e}");
        }
        // KVM's limit unknown: kumo's own still applies.
        let unknown = HostLimits { kvm_max_vcpus: None, ..host };
        check_shape(200, 1 << 30, &unknown).unwrap();
        assert!(check_shape(241, 1 << 30, &unknown).is_err());
        assert!(HostLimits::probe().unwrap().memory.total > 0);
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
