/* hello: prints a greeting over COM1 and exits with code 0. */
#include "kumo.h"

KUMO_MANIFEST("name=hello\n"
              "summary=Prints a greeting over the serial console and exits with code 0.\n"
              "max_cpus=64\n");

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu != 0)
        for (;;) sti_hlt_cli();
    kputs("Hello from kumo guest!\n");
    kprintf("hello: cpus=%u memory_mib=%lu\n", bi->ncpus, bi->mem_bytes >> 20);
    /* KVM's PV leaf as kumo set it (--pv, docs/pv-features.md). */
    u32 a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0x40000000u), "c"(0));
    if (b == 0x4b4d564b && c == 0x564b4d56 && d == 0x4d) { /* "KVMKVMKVM\0\0\0" */
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0x40000001u), "c"(0));
        kprintf("hello: kvm_pv eax=%x edx=%x\n", a, d);
    }
    kumo_exit(0);
}
