/* sync: seed 003's synchronisation benchmark. The vCPUs pass a semaphore round robin: the
 * holder of turn k hands it to vCPU (k+1) % N. A waiter spins (wait=spin), or halts until an
 * IPI wakes it (wait=hlt: the holder sends one after passing the turn if the next holder is
 * halted, as an OS skips the IPI to a CPU that is not idle), or spins up to poll_ns and then
 * halts (wait=poll: guest-side idle polling, as Linux's haltpoll). Everything but the
 * IPI and HLT path runs in ring 3 (kumo_enter_user): ring-0 code is emulated on nested KVM.
 *
 * Phase 1 (hand-off): `handoffs` bare hand-offs; the time from a pass to the next holder
 * seeing it, and on vCPU 0 the round trip from its pass to its next turn.
 * Phase 2 (work, the seed's OLTP effect): `txns` transactions, each `cs` work units under the
 * semaphore, then `par` units outside it, spread round robin; run with --cpus 1 and --cpus 2
 * to see whether two vCPUs beat one.
 * Baseline in the same run: an exit to the VMM and back (a port read from ring 3).
 *
 * apic=xapic sends IPIs with two MMIO writes from ring 3; apic=x2apic switches the LAPIC to
 * x2APIC mode and sends with WRMSR to the ICR (0x830), which ring 3 cannot execute: it faults
 * into the runtime's #GP handler, which does it (see start.S). */
#include "kumo.h"

KUMO_MANIFEST("name=sync\n"
              "summary=Round-robin semaphore hand-offs between vCPUs (spin or HLT+IPI), and synchronisation-heavy work on 1 or N vCPUs (seed 003).\n"
              "max_cpus=64\n"
              "min_cpus=1\n"
              "param=wait:spin|hlt|poll:hlt:how a waiter waits for its turn (hlt: woken by an IPI; poll: spins poll_ns, then halts)\n"
              "param=poll_ns:u64:20000:wait=poll: how long a waiter spins before it halts (guest-side idle polling)\n"
              "param=apic:xapic|x2apic:xapic:how IPIs are sent (MMIO, or WRMSR in x2APIC mode)\n"
              "param=handoffs:u64:2000:bare hand-offs to time (phase 1)\n"
              "param=txns:u64:2000:transactions of the work phase (phase 2)\n"
              "param=cs:u64:2:work units per transaction under the semaphore\n"
              "param=par:u64:20:work units per transaction outside the semaphore\n");

#define IPI_VECTOR 0x40
#define MAX_HANDOFFS 100000
#define MAX_CPUS 64

struct params { u64 handoffs, txns, cs, par; u32 hlt, x2apic, n; u64 lapic, tsc_khz, poll_tsc; };
static struct params P;

static volatile u32 params_ok, ready, done1, done2;
static volatile u32 seq1, seq2;          /* hand-offs so far in each phase: the holder is seq % n */
static volatile u64 pass_tsc;            /* when the last pass happened */
static u64 handoff[MAX_HANDOFFS];        /* [k]: pass k-1 -> vCPU k % n saw it */
static u64 rtt[MAX_HANDOFFS];            /* vCPU 0: its pass -> its next turn */
static u64 exits[256];
static volatile u64 work_sink[MAX_CPUS * 8];
static u64 work_start, work_end;
static volatile u32 halted[MAX_CPUS * 16]; /* [cpu * 16]: about to halt or halted (own cache line) */

/* IPI handlers: only end the waiter's HLT. */
extern void ipi_xapic(void), ipi_x2apic(void);
__asm__(".text\n"
        "ipi_xapic:\n"
        "  pushq %rax\n"
        "  movq P+48(%rip), %rax\n"      /* P.lapic */
        "  movl $0, 0xb0(%rax)\n"        /* EOI */
        "  popq %rax\n"
        "  iretq\n"
        "ipi_x2apic:\n"
        "  pushq %rax\n"
        "  pushq %rcx\n"
        "  pushq %rdx\n"
        "  xorl %eax, %eax\n"
        "  xorl %edx, %edx\n"
        "  movl $0x80b, %ecx\n"          /* x2APIC EOI */
        "  wrmsr\n"
        "  popq %rdx\n"
        "  popq %rcx\n"
        "  popq %rax\n"
        "  iretq\n");
_Static_assert(__builtin_offsetof(struct params, lapic) == 48, "ipi_xapic reads P.lapic at P+48");

_Static_assert(__builtin_offsetof(struct params, poll_tsc) == 64, "params layout");

static inline void wrmsr(u32 msr, u64 v) {
    __asm__ volatile("wrmsr" ::"c"(msr), "a"((u32)v), "d"((u32)(v >> 32)) : "memory");
}

static void send_ipi(u32 dest) {
    if (P.x2apic)
        wrmsr(0x830, ((u64)dest << 32) | 0x4000 | IPI_VECTOR); /* from ring 3: via the #GP handler */
    else {
        mmio_write32(P.lapic + 0x310, dest << 24);
        mmio_write32(P.lapic + 0x300, 0x4000 | IPI_VECTOR);
    }
}

/* One work unit: a dependent chain of integer operations (~1 us on a 2-3 GHz core). */
static void work(u32 cpu, u64 units) {
    u64 x = work_sink[cpu * 8] | 1;
    for (u64 i = 0; i < units * 600; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    work_sink[cpu * 8] = x;
}

/* Waits until the semaphore `seq` is this vCPU's (returns its value) or has reached `end`. */
static u32 wait_turn(volatile u32 *seq, u32 cpu, u64 end) {
    for (;;) {
        u32 s = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
        if (s >= end || s % P.n == cpu)
            return s;
        if (P.poll_tsc) { /* guest-side polling: spin a while before halting */
            u64 until = rdtsc() + P.poll_tsc;
            while (__atomic_load_n(seq, __ATOMIC_ACQUIRE) == s && rdtsc() < until)
                cpu_relax();
            if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) != s)
                continue;
        }
        if (!P.hlt) {
            cpu_relax();
            continue;
        }
        /* Say "halted" before the last look at seq; the passer stores seq before it looks at
         * the flag (both sequentially consistent), so one of the two sees the other. */
        __atomic_store_n(&halted[cpu * 16], 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(seq, __ATOMIC_SEQ_CST) == s)
            kumo_wait_change(seq, s, 0);
        __atomic_store_n(&halted[cpu * 16], 0, __ATOMIC_RELAXED);
    }
}

/* Hands turn s on to the next vCPU. */
static void pass(volatile u32 *seq, u32 s, u32 cpu) {
    pass_tsc = rdtsc();
    __atomic_store_n(seq, s + 1, __ATOMIC_SEQ_CST);
    u32 next = (cpu + 1) % P.n;
    if (P.hlt && next != cpu && __atomic_load_n(&halted[next * 16], __ATOMIC_SEQ_CST))
        send_ipi(next);
}

/* After a phase: wake the next vCPU, which may be halted waiting for a turn that never comes. */
static void leave(u32 cpu) {
    if (P.hlt && P.n > 1)
        send_ipi((cpu + 1) % P.n);
}

static void barrier(volatile u32 *count) {
    __atomic_fetch_add(count, 1, __ATOMIC_ACQ_REL);
    while (__atomic_load_n(count, __ATOMIC_ACQUIRE) < P.n)
        cpu_relax();
}

static void sort(u64 *a, u64 n) {
    for (u64 gap = n / 2; gap; gap /= 2)
        for (u64 i = gap; i < n; i++)
            for (u64 j = i; j >= gap && a[j - gap] > a[j]; j -= gap) {
                u64 t = a[j]; a[j] = a[j - gap]; a[j - gap] = t;
            }
}

static u64 ns(u64 cycles) { return P.tsc_khz ? cycles * 1000000 / P.tsc_khz : 0; }

static u64 report(void) {
    u64 h = P.handoffs;
    kprintf("sync: n=%u wait=%s apic=%s tsc_khz=%lu\n", P.n, !P.hlt ? "spin" : P.poll_tsc ? "poll" : "hlt",
            P.x2apic ? "x2apic" : "xapic", P.tsc_khz);
    sort(exits, 256);
    kprintf("sync: exit_rtt_ns p50=%lu\n", ns(exits[128]));
    if (P.n > 1 && h > 1) {
        /* Hand-off k (k >= 1) is the time from pass k-1 to its taker seeing it. */
        u64 m = h - 1, sum = 0;
        for (u64 k = 0; k < m; k++) sum += handoff[k + 1];
        sort(handoff + 1, m);
        kprintf("sync: handoff_ns count=%lu p50=%lu p99=%lu mean=%lu\n", m, ns(handoff[1 + m / 2]),
                ns(handoff[1 + m * 99 / 100]), ns(sum / m));
        u64 r = 0;
        for (u64 k = 0; k < h; k++)
            if (rtt[k]) rtt[r++] = rtt[k];
        if (r) {
            sort(rtt, r);
            kprintf("sync: rtt_ns count=%lu p50=%lu p99=%lu\n", r, ns(rtt[r / 2]), ns(rtt[r * 99 / 100]));
        }
    }
    u64 t = work_end - work_start;
    kprintf("sync: work txns=%lu cs=%lu par=%lu total_ns=%lu per_txn_ns=%lu\n", P.txns, P.cs, P.par, ns(t),
            P.txns ? ns(t) / P.txns : 0);
    return 0;
}

static u64 run(u64 arg) {
    u32 cpu = (u32)arg;
    barrier(&ready);
    if (cpu == 0)
        for (u32 i = 0; i < 256; i++) {
            u64 a = rdtsc();
            inb(KUMO_EXIT_PORT);
            exits[i] = rdtsc() - a;
        }

    /* Phase 1: bare hand-offs. */
    u64 my_pass = 0;
    for (;;) {
        u32 s = wait_turn(&seq1, cpu, P.handoffs);
        if (s >= P.handoffs)
            break;
        u64 now = rdtsc();
        if (s > 0)
            handoff[s] = now - pass_tsc;
        if (cpu == 0 && my_pass)
            rtt[s] = now - my_pass;
        my_pass = rdtsc();
        pass(&seq1, s, cpu);
    }
    leave(cpu);
    barrier(&done1);

    /* Phase 2: transactions. */
    if (cpu == 0)
        work_start = rdtsc();
    for (;;) {
        u32 s = wait_turn(&seq2, cpu, P.txns);
        if (s >= P.txns)
            break;
        work(cpu, P.cs);
        pass(&seq2, s, cpu);
        work(cpu, P.par);
    }
    leave(cpu);
    __atomic_fetch_add(&done2, 1, __ATOMIC_ACQ_REL);
    if (cpu != 0)
        for (;;) kumo_wait_change(&done2, done2, 0); /* halt for good */
    while (__atomic_load_n(&done2, __ATOMIC_ACQUIRE) < P.n)
        cpu_relax();
    work_end = rdtsc();
    return report();
}

static void bad(const char *what) {
    kprintf("sync: %s\n", what);
    kumo_exit(2);
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu == 0) {
        char v[16];
        P.handoffs = 2000, P.txns = 2000, P.cs = 2, P.par = 20;
        if (kumo_param_u64(bi, "handoffs", &P.handoffs) < 0 || kumo_param_u64(bi, "txns", &P.txns) < 0 ||
            kumo_param_u64(bi, "cs", &P.cs) < 0 || kumo_param_u64(bi, "par", &P.par) < 0)
            bad("handoffs, txns, cs and par must be numbers");
        if (P.handoffs > MAX_HANDOFFS || P.txns > 0xffffffffUL)
            bad("handoffs must be at most 100000 and txns below 2^32");
        P.hlt = !(kumo_param(bi, "wait", v, sizeof v) > 0 && kstreq(v, "spin"));
        if (P.hlt && kumo_param(bi, "wait", v, sizeof v) > 0 && kstreq(v, "poll")) {
            u64 poll_ns = 20000;
            if (kumo_param_u64(bi, "poll_ns", &poll_ns) < 0)
                bad("poll_ns must be a number");
            P.poll_tsc = poll_ns * (bi->tsc_khz ? bi->tsc_khz : 1000000) / 1000000;
            if (!P.poll_tsc)
                P.poll_tsc = 1;
        }
        P.x2apic = kumo_param(bi, "apic", v, sizeof v) > 0 && kstreq(v, "x2apic");
        P.n = bi->ncpus > MAX_CPUS ? MAX_CPUS : bi->ncpus;
        P.lapic = bi->lapic_base;
        P.tsc_khz = bi->tsc_khz;
        kumo_set_gate(IPI_VECTOR, P.x2apic ? ipi_x2apic : ipi_xapic);
        __atomic_store_n(&params_ok, 1, __ATOMIC_RELEASE);
    } else {
        if (cpu >= MAX_CPUS)
            for (;;) sti_hlt_cli();
        while (!__atomic_load_n(&params_ok, __ATOMIC_ACQUIRE))
            cpu_relax();
    }
    if (P.x2apic && kumo_enable_x2apic() < 0) {
        kputs("sync: x2apic is not offered (CPUID.1:ECX.x2APIC is clear)\n");
        kumo_exit(4);
    }
    kumo_enter_user(run, cpu);
}
