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
    kumo_exit(0);
}
