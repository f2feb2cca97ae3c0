/* memtouch: the dirtying workload. Writes a working set of pages at a set rate, sequentially or
 * at random, then reports its throughput and a checksum of the working set. The sequence of
 * writes is a pure function of the parameters, so two runs with the same parameters end with the
 * same checksum whatever happened to the VM in between (pause, save/restore, migration). */
#include "kumo.h"

KUMO_MANIFEST("name=memtouch\n"
              "summary=Writes a working set of pages (random or sequential, rate-limited) and reports throughput and a checksum.\n"
              "max_cpus=64\n"
              "param=pages:u64:1024:pages (4 KiB) in the working set\n"
              "param=mode:random|seq:random:order in which pages are written\n"
              "param=writes:u64:0:page writes before reporting (0: 4 x pages, unless duration_ms is set)\n"
              "param=duration_ms:u64:0:stop after this long instead (0: no time limit)\n"
              "param=rate:u64:0:page writes per second (0: as fast as possible)\n"
              "param=seed:u64:1:seed of the write sequence\n"
              "param=report_ms:u64:0:print a progress line this often (0: never)\n"
              "param=prefill:u64:0:1 = first write every free page once (a VM whose whole memory is in use)\n"
              "param=hold_ms:u64:0:after reporting, keep the memory this long without writing, then checksum it again\n"
              "param=until_input:u64:0:1 = write until a byte arrives on the serial console (writes and duration_ms, if given, still end it sooner)\n"
              "param=hold_input:u64:0:1 = after reporting, keep the memory (halted) until a byte arrives on the serial console, then checksum it again\n");

#define PAGE 4096UL

struct job {
    u64 base, pages, writes, duration_ms, rate, seed, report_ms, tsc_khz, random, hold_ms;
    u64 until_input, hold_input;
    u64 prefill_start, prefill_end;
};
static struct job job;

static u64 mix64(u64 x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9UL;
    x ^= x >> 27; x *= 0x94d049bb133111ebUL;
    return x ^ (x >> 31);
}

static u64 ms_to_tsc(u64 ms) { return ms * job.tsc_khz; }

/* True once a byte has arrived on COM1 (consumed). A port read exits to the VMM, so callers
 * poll it every few thousand writes or after a halt, not per write. */
static int console_input(void) {
    if (!(inb(COM1 + 5) & 1)) /* LSR: data ready */
        return 0;
    (void)inb(COM1);
    return 1;
}

static u64 checksum(const struct job *j) {
    u64 sum = 0xcbf29ce484222325UL;
    for (u64 p = 0; p < j->pages; p++) {
        const u64 *w = (const u64 *)(j->base + p * PAGE);
        for (int i = 0; i < 512; i++) sum = (sum ^ w[i]) * 0x100000001b3UL;
    }
    return sum;
}

/* Runs in ring 3. */
static u64 workload(u64 arg) {
    struct job *j = (struct job *)arg;
    if (j->prefill_end) {
        /* One word per page. Working-set pages get 0 (already their content: the checksum
         * is unaffected, but they are faulted in like the rest); pages beyond get their
         * address. */
        u64 ws_end = j->base + j->pages * PAGE;
        for (u64 a = j->prefill_start; a < j->prefill_end; a += PAGE)
            *(volatile u64 *)a = a < ws_end ? 0 : a;
        kprintf("memtouch: prefilled %lu pages\n", (j->prefill_end - j->prefill_start) / PAGE);
    }
    u64 rng = mix64(j->seed) | 1, start = rdtsc(), next_report = start + ms_to_tsc(j->report_ms);
    u64 deadline = j->duration_ms ? start + ms_to_tsc(j->duration_ms) : 0;
    u64 n = 0;
    /* The rate's schedule: write n is due at sched + (n - sched_n) / rate. */
    u64 sched = start, sched_n = 0;
    for (;; n++) {
        if (j->writes && n >= j->writes) break;
        u64 now = (n & 63) == 0 || j->rate || j->report_ms ? rdtsc() : 0;
        if (deadline && now && now >= deadline) break;
        if (j->until_input && (n & 16383) == 0 && console_input()) break;
        u64 page;
        if (j->random) {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            page = rng % j->pages;
        } else {
            page = n % j->pages;
        }
        volatile u64 *w = (volatile u64 *)(j->base + page * PAGE) + (n & 511);
        *w = mix64(n ^ (j->seed << 40));
        if (j->report_ms && now >= next_report) {
            u64 ms = (now - start) / (j->tsc_khz ? j->tsc_khz : 1);
            kprintf("memtouch: progress t_ms=%lu writes=%lu\n", ms, n + 1);
            /* From the end of this line, not from the missed deadline: printing a line costs
             * about a millisecond here (every byte exits to the VMM), and catching up would
             * print back to back. */
            next_report = rdtsc() + ms_to_tsc(j->report_ms);
        }
        if (j->rate && j->tsc_khz) {
            /* Write in bursts up to 1 ms ahead of schedule, then halt until due: the dirty
             * rate is kept while the vCPU stays mostly idle (a wake-up costs tens of µs here,
             * too much to halt between single writes). More than 10 ms behind (the VM was
             * paused: a migration's stop phase, a throttle), the schedule starts again from
             * now: the writes it could not make are lost, not made up in a burst at full
             * speed, which would be another workload. */
            u64 t = rdtsc(), due = sched + (n + 1 - sched_n) * j->tsc_khz * 1000 / j->rate;
            if (t > due + ms_to_tsc(10)) {
                sched = t;
                sched_n = n + 1;
            } else if (due > t + ms_to_tsc(1)) {
                kumo_idle_until(due);
                if (j->until_input && console_input()) { n++; break; }
            }
        }
    }
    u64 elapsed = rdtsc() - start;
    u64 us = j->tsc_khz ? elapsed * 1000 / j->tsc_khz : 0;
    kprintf("memtouch: done writes=%lu elapsed_us=%lu pages_per_sec=%lu\n", n, us,
            us ? n * 1000000 / us : 0);
    kprintf("memtouch: checksum=%lx\n", checksum(j));
    if (j->hold_input) {
        /* An idle guest until told to stop: halted, waking every 10 ms to look for input. */
        while (!console_input())
            kumo_idle_until(rdtsc() + ms_to_tsc(10));
        kprintf("memtouch: checksum_after_hold=%lx\n", checksum(j));
    } else if (j->hold_ms) {
        /* An idle guest: memory stays as it is (halted). */
        kumo_idle_until(rdtsc() + ms_to_tsc(j->hold_ms));
        kprintf("memtouch: checksum_after_hold=%lx\n", checksum(j));
    }
    return 0;
}

static u64 param_or(struct kumo_boot_info *bi, const char *key, u64 dflt) {
    u64 v = dflt;
    if (kumo_param_u64(bi, key, &v) < 0) {
        kprintf("memtouch: bad value for %s (want a number)\n", key);
        kumo_exit(2);
    }
    return v;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu != 0)
        for (;;) sti_hlt_cli();
    char mode[16] = "random";
    kumo_param(bi, "mode", mode, sizeof(mode));
    if (!kstreq(mode, "random") && !kstreq(mode, "seq")) {
        kprintf("memtouch: mode must be random or seq, not %s\n", mode);
        kumo_exit(2);
    }
    job.random = kstreq(mode, "random");
    job.pages = param_or(bi, "pages", 1024);
    job.duration_ms = param_or(bi, "duration_ms", 0);
    job.until_input = param_or(bi, "until_input", 0);
    job.hold_input = param_or(bi, "hold_input", 0);
    job.writes = param_or(bi, "writes", job.duration_ms || job.until_input ? 0 : 4 * job.pages);
    job.rate = param_or(bi, "rate", 0);
    job.seed = param_or(bi, "seed", 1);
    job.report_ms = param_or(bi, "report_ms", 0);
    job.hold_ms = param_or(bi, "hold_ms", 0);

    job.tsc_khz = bi->tsc_khz;
    job.base = (bi->free_start + PAGE - 1) & ~(PAGE - 1);
    if (param_or(bi, "prefill", 0)) {
        job.prefill_start = job.base;
        job.prefill_end = bi->free_end & ~(PAGE - 1);
    }
    u64 avail = (bi->free_end - job.base) / PAGE;
    if (job.pages == 0 || job.pages > avail) {
        kprintf("memtouch: pages=%lu does not fit: 1..%lu pages are free\n", job.pages, avail);
        kumo_exit(2);
    }
    if ((job.rate || job.duration_ms || job.report_ms || job.hold_ms || job.hold_input) && !job.tsc_khz) {
        kputs("memtouch: rate/duration_ms/report_ms/hold_ms/hold_input need the TSC frequency, which kumo did not give\n");
        kumo_exit(2);
    }
    kprintf("memtouch: pages=%lu mode=%s writes=%lu duration_ms=%lu rate=%lu seed=%lu base=%lx\n",
            job.pages, mode, job.writes, job.duration_ms, job.rate, job.seed, job.base);
    kumo_enter_user(workload, (u64)&job);
}
