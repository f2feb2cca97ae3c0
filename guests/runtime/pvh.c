/* PVH boot (QEMU -kernel): fills the kumo_boot_info that kumo would have written, from the
 * hvm_start_info QEMU's PVH option ROM passes. Called once by pvh.S in long mode, ring 0, before
 * _start; never used when kumo itself starts the guest. */
#include "kumo.h"

#define HVM_START_MAGIC 0x336ec578u
#define E820_RAM 1

struct hvm_start_info {
    u32 magic, version, flags, nr_modules;
    u64 modlist_paddr, cmdline_paddr, rsdp_paddr;
    u64 memmap_paddr; /* version >= 1 */
    u32 memmap_entries, reserved;
};
struct hvm_memmap_entry { u64 addr, size; u32 type, reserved; };

extern char kumo_image_end[]; /* kumo.ld: end of the loaded image, .bss included */
static struct kumo_boot_info pvh_boot_info;

static void cpuid(u32 leaf, u32 *a, u32 *b, u32 *c, u32 *d) {
    __asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}

/* TSC frequency. 1: the hypervisor's timing leaf 0x40000010 (QEMU fills it for KVM guests with
 * `-cpu ...,+invtsc,vmware-cpuid-freq=on`, and then also raises the hypervisor's max leaf);
 * 2: CPUID 0x15 (TSC/crystal ratio with a known crystal); 3: measured against PIT channel 2
 * for 25 ms (each poll is a port exit of tens of µs: ~0.2% error). */
static u64 tsc_khz(const char **source) {
    u32 a, b, c, d;
    cpuid(0x40000000, &a, &b, &c, &d);
    if (a >= 0x40000010 && a < 0x40000100) {
        cpuid(0x40000010, &a, &b, &c, &d);
        if (a) {
            *source = "cpuid 0x40000010";
            return a;
        }
    }
    cpuid(0, &a, &b, &c, &d);
    if (a >= 0x15) {
        cpuid(0x15, &a, &b, &c, &d);
        if (a && b && c) {
            *source = "cpuid 0x15";
            return (u64)c * b / a / 1000;
        }
    }
    *source = "PIT calibration";
    const u64 ms = 25, latch = 1193182 * ms / 1000;
    outb(0x61, (u8)((inb(0x61) & ~0x02) | 0x01)); /* channel 2 gate on, speaker off */
    outb(0x43, 0xb0);                             /* channel 2, lo/hi byte, mode 0 */
    outb(0x42, (u8)latch);
    outb(0x42, (u8)(latch >> 8));
    u64 t0 = rdtsc();
    while (!(inb(0x61) & 0x20)) /* OUT2 rises at terminal count */
        ;
    return (rdtsc() - t0) / ms;
}

struct kumo_boot_info *kumo_pvh_boot_info(u32 start_info, u64 tss) {
    const struct hvm_start_info *si = (const struct hvm_start_info *)(u64)start_info;
    struct kumo_boot_info *bi = &pvh_boot_info;
    bi->magic = KUMO_BOOT_MAGIC;
    bi->version = KUMO_BOOT_VERSION;
    bi->ncpus = 1; /* only the BSP runs: APs are never started */
    bi->tss_base = tss;
    bi->tss_stride = 512;
    bi->lapic_base = 0xfee00000;
    bi->free_start = ((u64)kumo_image_end + 4095) & ~4095UL;
    if (si->magic != HVM_START_MAGIC) {
        kputs("kumo-pvh: bad hvm_start_info magic\n");
        kumo_exit(0x7e);
    }
    if (si->cmdline_paddr) {
        const char *s = (const char *)si->cmdline_paddr;
        for (u32 i = 0; i < sizeof(bi->cmdline) - 1 && s[i]; i++)
            bi->cmdline[i] = s[i];
    }
    /* Memory: the RAM entries of the memory map, summed and rounded up to whole MiB (the
     * BIOS's holes below 1 MiB are not RAM the VM was given less of); free memory is the RAM
     * entry holding the image.
     * Without a map (version 0), the RAM size QEMU stores in CMOS (64 KiB units above 16 MiB,
     * registers 0x34/0x35; above 4 GiB, 0x5b..0x5d) gives the low RAM end. */
    if (si->version >= 1 && si->memmap_paddr && si->memmap_entries) {
        const struct hvm_memmap_entry *m = (const struct hvm_memmap_entry *)si->memmap_paddr;
        for (u32 i = 0; i < si->memmap_entries; i++) {
            if (m[i].type != E820_RAM)
                continue;
            u64 end = m[i].addr + m[i].size;
            bi->mem_bytes += m[i].size;
            if (m[i].addr <= bi->free_start && bi->free_start < end)
                bi->free_end = end;
        }
        bi->mem_bytes = (bi->mem_bytes + 0xfffff) & ~0xfffffUL;
    } else {
        outb(0x70, 0x34);
        u64 lo = inb(0x71);
        outb(0x70, 0x35);
        lo |= (u64)inb(0x71) << 8;
        u64 hi = 0;
        for (int r = 0x5d; r >= 0x5b; r--) {
            outb(0x70, (u8)r);
            hi = (hi << 8) | inb(0x71);
        }
        bi->free_end = (16UL << 20) + (lo << 16);
        bi->mem_bytes = bi->free_end + (hi << 16);
    }
    const char *src = "";
    bi->tsc_khz = tsc_khz(&src);
    kprintf("kumo-pvh: memory_mib=%lu free=%lx..%lx tsc_khz=%lu (%s)\n", bi->mem_bytes >> 20,
            bi->free_start, bi->free_end, bi->tsc_khz, src);
    return bi;
}
