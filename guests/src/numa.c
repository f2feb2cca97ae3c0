/* numa: finds kumo's ACPI tables (RSDP in 0xE0000-0xFFFFF, XSDT, SRAT, SLIT), prints the NUMA
 * topology it sees (nodes, their vCPUs and memory ranges, distances), then measures memory
 * latency (a dependent pointer chase) and read bandwidth from every vCPU to every node's memory.
 * Everything but bring-up runs in ring 3: table parsing and the measurements are native there.
 * Without an SRAT it reports one node holding every vCPU and all RAM, as Linux would. */
#include "kumo.h"

KUMO_MANIFEST("name=numa\n"
              "summary=Prints the NUMA topology from the ACPI SRAT/SLIT and measures memory latency and bandwidth from every vCPU to every node.\n"
              "max_cpus=64\n"
              "param=mib:u64:8:buffer per node, MiB (latency and bandwidth are measured over it)\n"
              "param=measure:u64:1:0 = print the topology only\n");

#define MAX_NODES 16
#define MAX_RANGES 32
#define LINE 64

struct range { u64 start, end; u32 node; };
static struct range ranges[MAX_RANGES];
static u32 nranges;
static u32 cpu_node[KUMO_MAX_CPUS];
static u8 dist[MAX_NODES][MAX_NODES];
static u32 nnodes;
static int have_srat, have_slit;

static struct kumo_boot_info *boot;
static u64 mib = 8, measure = 1;
static u64 buf[MAX_NODES];      /* each node's buffer */
static volatile u32 turn;       /* the vCPU whose turn it is to measure (+1; 0 = none yet) */
static volatile u32 done_count;
static u64 lat_ps[KUMO_MAX_CPUS][MAX_NODES], bw_mbs[KUMO_MAX_CPUS][MAX_NODES];

static u32 rd32(u64 a) { return *(volatile u32 *)a; }
static u64 rd64(u64 a) { return *(volatile u64 *)a; }
static int sig(u64 a, const char *s, int n) {
    for (int i = 0; i < n; i++)
        if (((volatile char *)a)[i] != s[i]) return 0;
    return 1;
}
static int checksum_ok(u64 a, u32 len) {
    u8 sum = 0;
    for (u32 i = 0; i < len; i++) sum += ((volatile u8 *)a)[i];
    return sum == 0;
}

static void parse_srat(u64 t) {
    u32 len = rd32(t + 4);
    for (u64 p = t + 48; p + 2 <= t + len;) {
        u8 type = *(volatile u8 *)p, l = *(volatile u8 *)(p + 1);
        if (l < 2) break;
        if (type == 0 && l >= 16) { /* processor local APIC affinity */
            u32 pxm = *(volatile u8 *)(p + 2) | (u32)*(volatile u8 *)(p + 9) << 8 |
                      (u32)*(volatile u8 *)(p + 10) << 16 | (u32)*(volatile u8 *)(p + 11) << 24;
            u32 apic = *(volatile u8 *)(p + 3);
            if ((rd32(p + 4) & 1) && apic < KUMO_MAX_CPUS && pxm < MAX_NODES) cpu_node[apic] = pxm;
            if (pxm + 1 > nnodes && pxm < MAX_NODES) nnodes = pxm + 1;
        } else if (type == 2 && l >= 24) { /* x2APIC affinity */
            u32 pxm = rd32(p + 4), apic = rd32(p + 8);
            if ((rd32(p + 12) & 1) && apic < KUMO_MAX_CPUS && pxm < MAX_NODES) cpu_node[apic] = pxm;
            if (pxm + 1 > nnodes && pxm < MAX_NODES) nnodes = pxm + 1;
        } else if (type == 1 && l >= 40) { /* memory affinity */
            u32 pxm = rd32(p + 2);
            u64 base = rd64(p + 8), size = rd64(p + 16);
            if ((rd32(p + 28) & 1) && size && nranges < MAX_RANGES && pxm < MAX_NODES) {
                ranges[nranges++] = (struct range){base, base + size, pxm};
                if (pxm + 1 > nnodes) nnodes = pxm + 1;
            }
        }
        p += l;
    }
    have_srat = 1;
}

static void parse_slit(u64 t) {
    u64 n = rd64(t + 36);
    for (u64 i = 0; i < n && i < MAX_NODES; i++)
        for (u64 j = 0; j < n && j < MAX_NODES; j++) dist[i][j] = *(volatile u8 *)(t + 44 + i * n + j);
    have_slit = 1;
}

static void find_tables(void) {
    for (u64 a = 0xe0000; a < 0x100000; a += 16) {
        if (!sig(a, "RSD PTR ", 8) || !checksum_ok(a, 20)) continue;
        u64 xsdt = rd64(a + 24);
        if (!xsdt || !sig(xsdt, "XSDT", 4) || !checksum_ok(xsdt, rd32(xsdt + 4))) continue;
        u32 n = (rd32(xsdt + 4) - 36) / 8;
        for (u32 i = 0; i < n; i++) {
            u64 t = rd64(xsdt + 36 + 8 * i);
            if (!checksum_ok(t, rd32(t + 4))) continue;
            if (sig(t, "SRAT", 4)) parse_srat(t);
            if (sig(t, "SLIT", 4)) parse_slit(t);
        }
        kprintf("numa: acpi rsdp=%lx xsdt=%lx srat=%u slit=%u\n", a, xsdt, have_srat, have_slit);
        return;
    }
    kputs("numa: acpi none\n");
}

/* A buffer of `mib` MiB inside node n's memory, clear of the loaded image and boot data. */
static u64 node_buffer(u32 n) {
    u64 need = mib << 20;
    for (u32 i = 0; i < nranges; i++) {
        if (ranges[i].node != n) continue;
        u64 s = ranges[i].start < boot->free_start ? boot->free_start : ranges[i].start;
        u64 e = ranges[i].end > boot->free_end ? boot->free_end : ranges[i].end;
        s = (s + 0xfffff) & ~0xfffffUL;
        if (e > s && e - s >= need) return s;
    }
    return 0;
}

/* A random cyclic pointer chain over the buffer's cache lines (Sattolo's shuffle). */
static void build_chain(u64 b) {
    u64 lines = (mib << 20) / LINE, x = 0x9e3779b97f4a7c15UL ^ b;
    u64 *idx = (u64 *)b; /* temporary: line i's first word holds its successor's index */
    for (u64 i = 0; i < lines; i++) idx[i * (LINE / 8)] = i;
    for (u64 i = lines - 1; i > 0; i--) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        u64 j = x % i, a = idx[i * (LINE / 8)];
        idx[i * (LINE / 8)] = idx[j * (LINE / 8)];
        idx[j * (LINE / 8)] = a;
    }
    for (u64 i = 0; i < lines; i++) idx[i * (LINE / 8)] = b + idx[i * (LINE / 8)] * LINE;
}

static void measure_node(u32 cpu, u32 n) {
    u64 b = buf[n], lines = (mib << 20) / LINE, khz = boot->tsc_khz ? boot->tsc_khz : 1000000;
    u64 p = b, sum = 0, words = (mib << 20) / 8;
    /* Warm up: the first touch of each page from this vCPU pays for (nested) paging, not memory. */
    for (u64 i = 0; i < lines; i++) p = *(volatile u64 *)p;
    for (u64 i = 0; i < words; i += 512) sum += ((const volatile u64 *)b)[i];
    u64 t = rdtsc();
    for (u64 i = 0; i < lines; i++) p = *(volatile u64 *)p;
    u64 cyc = rdtsc() - t;
    lat_ps[cpu][n] = cyc * 1000000000UL / khz / lines + (p == 1); /* p keeps the chase live */
    t = rdtsc();
    for (u64 i = 0; i < words; i += 4) {
        const volatile u64 *w = (const volatile u64 *)(b + i * 8);
        sum += w[0] + w[1] + w[2] + w[3];
    }
    cyc = rdtsc() - t;
    u64 us = cyc * 1000 / khz;
    bw_mbs[cpu][n] = (us ? (mib << 20) / us : 0) + (sum == 1);
}

static void measure_all(u32 cpu) {
    for (u32 n = 0; n < nnodes; n++)
        if (buf[n]) measure_node(cpu, n);
}

static u64 ap_main(u64 cpu) {
    while (turn != cpu + 1) cpu_relax();
    measure_all((u32)cpu);
    __atomic_fetch_add(&done_count, 1, __ATOMIC_RELEASE);
    for (;;) cpu_relax(); /* the BSP ends the VM */
    return 0;
}

static u64 bsp_main(u64 unused) {
    (void)unused;
    find_tables();
    if (!have_srat) {
        nnodes = 1;
        ranges[0] = (struct range){0, boot->mem_bytes, 0};
        nranges = 1;
    }
    if (!have_slit)
        for (u32 i = 0; i < nnodes; i++)
            for (u32 j = 0; j < nnodes; j++) dist[i][j] = i == j ? 10 : 20;
    kprintf("numa: nodes=%u\n", nnodes);
    for (u32 n = 0; n < nnodes; n++) {
        kprintf("numa: node=%u cpus=", n);
        int first = 1;
        for (u32 c = 0; c < boot->ncpus && c < KUMO_MAX_CPUS; c++)
            if (cpu_node[c] == n) { kprintf(first ? "%u" : ":%u", c); first = 0; }
        if (first) kputs("none");
        kputs(" mem=");
        first = 1;
        for (u32 i = 0; i < nranges; i++)
            if (ranges[i].node == n) {
                kprintf(first ? "%lx-%lx" : ":%lx-%lx", ranges[i].start, ranges[i].end);
                first = 0;
            }
        kputs("\n");
    }
    for (u32 i = 0; i < nnodes; i++) {
        kprintf("numa: distance from=%u to=", i);
        for (u32 j = 0; j < nnodes; j++) kprintf(j ? ",%u" : "%u", dist[i][j]);
        kputs("\n");
    }
    if (measure) {
        for (u32 n = 0; n < nnodes; n++) {
            buf[n] = node_buffer(n);
            if (buf[n]) build_chain(buf[n]);
            else kprintf("numa: node=%u has no room for a %lu MiB buffer: not measured\n", n, mib);
        }
        measure_all(0);
        u32 aps = boot->ncpus > KUMO_MAX_CPUS ? KUMO_MAX_CPUS : boot->ncpus;
        for (u32 c = 1; c < aps; c++) {
            turn = c + 1;
            while (done_count < c) cpu_relax();
        }
        for (u32 c = 0; c < aps; c++)
            for (u32 n = 0; n < nnodes; n++)
                if (buf[n])
                    kprintf("numa: vcpu=%u node=%u latency_ns=%lu.%lu bandwidth_mbs=%lu\n", c, n, lat_ps[c][n] / 1000,
                            lat_ps[c][n] % 1000 / 100, bw_mbs[c][n]);
    }
    kputs("numa: done\n");
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    boot = bi;
    if (cpu != 0) kumo_enter_user(ap_main, cpu);
    if (kumo_param_u64(bi, "mib", &mib) < 0 || kumo_param_u64(bi, "measure", &measure) < 0 || mib == 0 || mib > 1024) {
        kputs("numa: mib must be 1..1024 and measure 0 or 1\n");
        kumo_exit(2);
    }
    kumo_enter_user(bsp_main, 0);
}
