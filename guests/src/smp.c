/* smp: brings up every vCPU and measures IPI round trips between vCPU 0 and vCPU 1 through the
 * LAPIC (xAPIC MMIO), against a baseline in the same run: an exit to the VMM and back (a port
 * read). Waits are `sti; hlt` so no ring-0 spinning is emulated. */
#include "kumo.h"

KUMO_MANIFEST("name=smp\n"
              "summary=Brings up all vCPUs and measures IPI round-trip time between vCPU 0 and 1 (needs --cpus 2 or more).\n"
              "max_cpus=64\n"
              "min_cpus=2\n"
              "param=iters:u64:1000:IPI round trips to measure\n"
              "param=warmup:u64:50:round trips before measuring\n");

#define LAPIC_ID 0x20
#define LAPIC_EOI 0xb0
#define LAPIC_SVR 0xf0
#define LAPIC_ICR_LO 0x300
#define LAPIC_ICR_HI 0x310
#define PING_VECTOR 0x40
#define PONG_VECTOR 0x41
#define MAX_ITERS 100000

static volatile u32 online;
static volatile u32 pong;
static u64 lapic;
static u64 samples[MAX_ITERS];
static u64 exit_samples[256];

/* Minimal handlers, in assembly: every ring-0 instruction costs ~2 us here. */
extern void ping_handler(void), pong_handler(void);
__asm__(".text\n"
        "ping_handler:\n"          /* on vCPU 1: answer vCPU 0 */
        "  pushq %rax\n"
        "  movq lapic(%rip), %rax\n"
        "  movl $0, 0x310(%rax)\n"          /* ICR high: destination APIC ID 0 */
        "  movl $0x4041, 0x300(%rax)\n"     /* ICR low: fixed, assert, PONG_VECTOR */
        "  movl $0, 0xb0(%rax)\n"           /* EOI */
        "  popq %rax\n"
        "  iretq\n"
        "pong_handler:\n"          /* on vCPU 0: note the answer */
        "  pushq %rax\n"
        "  movl $1, pong(%rip)\n"
        "  movq lapic(%rip), %rax\n"
        "  movl $0, 0xb0(%rax)\n"
        "  popq %rax\n"
        "  iretq\n");

static void lapic_enable(void) { mmio_write32(lapic + LAPIC_SVR, 0x1ff); }

static u64 sort_and_report(u64 arg);

struct result { u64 iters, tsc_khz, exit_iters; };
static struct result res;

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    lapic = bi->lapic_base;
    if (cpu != 0) {
        lapic_enable();
        __atomic_fetch_add(&online, 1, __ATOMIC_RELEASE);
        for (;;) sti_hlt_cli();
    }
    u64 iters = 1000, warmup = 50;
    if (kumo_param_u64(bi, "iters", &iters) < 0 || kumo_param_u64(bi, "warmup", &warmup) < 0) {
        kputs("smp: iters and warmup must be numbers\n");
        kumo_exit(2);
    }
    if (bi->ncpus < 2) {
        kputs("smp: needs at least 2 vCPUs (--cpus 2)\n");
        kumo_exit(2);
    }
    if (iters == 0 || iters > MAX_ITERS) {
        kprintf("smp: iters must be 1..%u\n", MAX_ITERS);
        kumo_exit(2);
    }
    kumo_set_gate(PING_VECTOR, ping_handler);
    kumo_set_gate(PONG_VECTOR, pong_handler);
    lapic_enable();
    u32 want = bi->ncpus > KUMO_MAX_CPUS ? KUMO_MAX_CPUS - 1 : bi->ncpus - 1;
    u64 t0 = rdtsc(), limit = bi->tsc_khz ? bi->tsc_khz * 10000 : (1UL << 40); /* 10 s */
    while (__atomic_load_n(&online, __ATOMIC_ACQUIRE) < want) {
        if (rdtsc() - t0 > limit) {
            kprintf("smp: only %u of %u APs came online\n", online, want);
            kumo_exit(3);
        }
        cpu_relax();
    }
    kprintf("smp: %u/%u vcpus online\n", online + 1, bi->ncpus);

    /* Baseline: one exit to the VMM and back. */
    for (u32 i = 0; i < 256; i++) {
        u64 a = rdtsc();
        inb(KUMO_EXIT_PORT);
        exit_samples[i] = rdtsc() - a;
    }
    for (u64 i = 0; i < warmup + iters; i++) {
        pong = 0;
        u64 a = rdtsc();
        mmio_write32(lapic + LAPIC_ICR_HI, 1u << 24);
        mmio_write32(lapic + LAPIC_ICR_LO, 0x4000 | PING_VECTOR);
        while (!pong) sti_hlt_cli();
        if (i >= warmup) samples[i - warmup] = rdtsc() - a;
    }
    res.iters = iters;
    res.exit_iters = 256;
    res.tsc_khz = bi->tsc_khz;
    kumo_enter_user(sort_and_report, (u64)&res);
}

static void sort(u64 *a, u64 n) { /* shell sort: ring 3, native speed */
    for (u64 gap = n / 2; gap; gap /= 2)
        for (u64 i = gap; i < n; i++)
            for (u64 j = i; j >= gap && a[j - gap] > a[j]; j -= gap) {
                u64 t = a[j]; a[j] = a[j - gap]; a[j - gap] = t;
            }
}

static u64 ns(u64 cycles, u64 khz) { return khz ? cycles * 1000000 / khz : 0; }

static u64 sort_and_report(u64 arg) {
    struct result *r = (struct result *)arg;
    sort(samples, r->iters);
    sort(exit_samples, r->exit_iters);
    u64 n = r->iters, p50 = samples[n / 2], p99 = samples[n * 99 / 100], e50 = exit_samples[r->exit_iters / 2];
    kprintf("smp: ipi_rtt_cycles iters=%lu min=%lu p50=%lu p99=%lu max=%lu\n", n, samples[0], p50, p99,
            samples[n - 1]);
    kprintf("smp: ipi_rtt_ns p50=%lu p99=%lu\n", ns(p50, r->tsc_khz), ns(p99, r->tsc_khz));
    kprintf("smp: exit_rtt_cycles p50=%lu\n", e50);
    kprintf("smp: exit_rtt_ns p50=%lu\n", ns(e50, r->tsc_khz));
    kprintf("smp: tsc_khz=%lu ipi_over_exit=%lu.%lu\n", r->tsc_khz, e50 ? p50 / e50 : 0,
            e50 ? (p50 * 10 / e50) % 10 : 0);
    return 0;
}
