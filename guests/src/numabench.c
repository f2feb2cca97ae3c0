/* numabench: the memory-bound parallel kernel of `kumo bench numa`. A STREAM triad
 * (a[i] = b[i] + s*c[i], integers) over arrays far larger than the caches, then a CG-like sparse
 * pass (y = A*x, A in CSR with an irregular column index), split across threads, each working on
 * its own part between spin barriers, timed with rdtsc by thread 0.
 *
 * One source, built twice with the same code-generation flags (integer only, no vector code):
 *  - as a kumo guest (every vCPU is a thread; the kernel runs in ring 3, natively), and
 *  - hosted (-DNUMABENCH_HOSTED: a Linux program, thread t pinned to the t-th CPU it may use), the
 *    bare-metal baseline. Both take the same key=value arguments and print the same lines:
 *      numabench: threads=T mb=M smb=S iters=I
 *      numabench: result threads=T triad_cycles=C sparse_cycles=C total_cycles=C best_triad=C
 *                 best_sparse=C tsc_khz=K check=X   (on one line; best_*: the fastest single sweep)
 * Each thread first writes its own part (memory backed and mapped) and runs one untimed sweep
 * of each kernel before the timed ones. The work is fixed: no timer is needed to end. */
#ifdef NUMABENCH_HOSTED
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long u64;
static inline u64 rdtsc(void) {
    u32 lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((u64)hi << 32) | lo;
}
static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }
#define OUT(...) printf(__VA_ARGS__)
#define MAX_THREADS 64
#else
#include "kumo.h"
KUMO_MANIFEST("name=numabench\n"
              "summary=Memory-bound parallel kernel of `kumo bench numa`: a STREAM triad and a CG-like sparse pass on every vCPU (ring 3), timed with rdtsc.\n"
              "max_cpus=64\n"
              "param=mb:u64:64:MiB per triad array (three arrays, split across vCPUs)\n"
              "param=smb:u64:64:MiB of sparse matrix (CSR, 8 nonzeros a row; x and y add 1/4 of it)\n"
              "param=iters:u64:10:timed sweeps of each kernel\n");
#define OUT(...) kprintf(__VA_ARGS__)
#define MAX_THREADS KUMO_MAX_CPUS
#endif

#define NNZ_ROW 8
#define BAND 4096   /* rows: near-diagonal entries fall within +-BAND */
#define FAR 65536   /* rows: one entry a row falls within +-FAR (a bandwidth-reduced matrix) */
#define SCALAR 3

static u64 mb = 64, smb = 64, iters = 10, nthreads = 1;
static u64 tsc_khz;

/* Thread t's part: its triad slices and rows. */
struct part {
    u64 *a, *b, *c, n;             /* triad */
    u32 *col, *val;                 /* CSR rows row0..row0+rows-1, NNZ_ROW each */
    u64 *y, row0, rows;
};
static struct part parts[MAX_THREADS];
static u64 *xvec, xrows;            /* the vector x, shared (each thread writes its rows' part) */
static u64 triad_cycles, sparse_cycles, check_sum[MAX_THREADS];
static u64 best_triad, best_sparse; /* the fastest sweep of each: the least disturbed */

/* Sense-reversing spin barrier (threads never block: each has a CPU of its own). */
static volatile u32 bar_count, bar_sense;
static void barrier(void) {
    u32 sense = !bar_sense;
    if (__atomic_add_fetch(&bar_count, 1, __ATOMIC_ACQ_REL) == nthreads) {
        bar_count = 0;
        __atomic_store_n(&bar_sense, sense, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&bar_sense, __ATOMIC_ACQUIRE) != sense) cpu_relax();
    }
}

static u64 mix(u64 x) { /* splitmix64 finalizer: deterministic "random" numbers */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9UL;
    x ^= x >> 27; x *= 0x94d049bb133111ebUL;
    return x ^ (x >> 31);
}

/* Writes the thread's part: backs and maps every page it will touch, from its own CPU. */
static void init_part(struct part *p) {
    for (u64 i = 0; i < p->n; i++) { p->a[i] = 0; p->b[i] = i; p->c[i] = i ^ 0x55; }
    for (u64 r = 0; r < p->rows; r++) {
        u64 row = p->row0 + r;
        xvec[row] = mix(row) & 0xffff;
        p->y[r] = 0;
        for (u64 k = 0; k < NNZ_ROW; k++) {
            u64 h = mix(row * NNZ_ROW + k), c;
            if (k < NNZ_ROW - 1) /* near the diagonal, as a mesh's matrix */
                c = (row + xrows + (h % (2 * BAND)) - BAND) % xrows;
            else                 /* and one far one */
                c = (row + 64 * xrows + (h % (2 * FAR)) - FAR) % xrows;
            p->col[r * NNZ_ROW + k] = (u32)c;
            p->val[r * NNZ_ROW + k] = (u32)(h >> 40) & 0xff;
        }
    }
}

static void triad(struct part *p) {
    u64 *a = p->a; const u64 *b = p->b, *c = p->c;
    for (u64 i = 0; i < p->n; i++) a[i] = b[i] + SCALAR * c[i];
}

static void sparse(struct part *p) {
    const u32 *col = p->col, *val = p->val;
    const u64 *x = xvec;
    for (u64 r = 0; r < p->rows; r++) {
        u64 s = 0;
        for (u64 k = r * NNZ_ROW; k < (r + 1) * NNZ_ROW; k++) s += (u64)val[k] * x[col[k]];
        p->y[r] = s;
    }
}

/* The whole run on thread t (every thread calls it; thread 0 times and reports). */
static void work(u32 t) {
    struct part *p = &parts[t];
    init_part(p);
    barrier();
    triad(p);  /* untimed sweeps */
    sparse(p);
    for (u64 it = 0; it < iters; it++) {
        barrier();
        u64 t0 = rdtsc();
        triad(p);
        barrier();
        u64 t1 = rdtsc();
        sparse(p);
        barrier();
        if (t == 0) {
            u64 t2 = rdtsc();
            triad_cycles += t1 - t0;
            sparse_cycles += t2 - t1;
            if (!best_triad || t1 - t0 < best_triad) best_triad = t1 - t0;
            if (!best_sparse || t2 - t1 < best_sparse) best_sparse = t2 - t1;
        }
    }
    u64 s = 0;
    for (u64 i = 0; i < p->n; i += 64) s += p->a[i];
    for (u64 r = 0; r < p->rows; r++) s += p->y[r];
    check_sum[t] = s;
    barrier();
    if (t == 0) {
        u64 check = 0;
        for (u64 i = 0; i < nthreads; i++) check += check_sum[i];
        OUT("numabench: result threads=%lu triad_cycles=%lu sparse_cycles=%lu total_cycles=%lu best_triad=%lu "
            "best_sparse=%lu tsc_khz=%lu check=%lx\n",
            nthreads, triad_cycles, sparse_cycles, triad_cycles + sparse_cycles, best_triad, best_sparse, tsc_khz, check);
    }
}

/* Sizes of thread t's part: elements of each triad array and rows of the matrix. */
static u64 triad_elems(void) { return (mb << 20) / 8; }
static u64 sparse_rows(void) { return (smb << 20) / (NNZ_ROW * 8); }
static u64 share(u64 total, u64 t) { return total * (t + 1) / nthreads - total * t / nthreads; }
static u64 first(u64 total, u64 t) { return total * t / nthreads; }
/* Bytes of thread t's own block: a, b, c, col, val, y. */
static u64 part_bytes(u64 t) {
    return 3 * 8 * share(triad_elems(), t) + share(sparse_rows(), t) * (NNZ_ROW * 8 + 8);
}
static u64 round_up(u64 v) { return (v + 0x1fffff) & ~0x1fffffUL; }

/* Lays thread t's part out in the block at `base`. */
static void place_part(u64 t, u64 base) {
    struct part *p = &parts[t];
    p->n = share(triad_elems(), t);
    p->a = (u64 *)base;
    p->b = p->a + p->n;
    p->c = p->b + p->n;
    p->rows = share(sparse_rows(), t);
    p->row0 = first(sparse_rows(), t);
    p->col = (u32 *)(p->c + p->n);
    p->val = p->col + p->rows * NNZ_ROW;
    p->y = (u64 *)(p->val + p->rows * NNZ_ROW);
}

static const char *check_sizes(void) {
    if (mb == 0 || mb > 16384 || smb == 0 || smb > 16384) return "mb and smb must be 1..16384";
    if (iters == 0 || iters > 1000000) return "iters must be 1..1000000";
    if (nthreads == 0 || nthreads > MAX_THREADS) return "threads must be 1..64";
    if (sparse_rows() >= (1UL << 32)) return "smb too large for 32-bit column indexes";
    return 0;
}

#ifdef NUMABENCH_HOSTED

static cpu_set_t allowed; /* the CPUs this process may use; thread t runs on the t-th of them */

static void *thread_main(void *arg) {
    u64 t = (u64)arg, k = t % (u64)CPU_COUNT(&allowed);
    int cpu = 0;
    for (; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed) && k-- == 0) break;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
        perror("numabench: sched_setaffinity");
        exit(3);
    }
    /* Allocated and written by the pinned thread: its pages come from its CPU's node. */
    u64 len = round_up(part_bytes(t));
    void *m = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        perror("numabench: mmap");
        exit(3);
    }
    place_part(t, (u64)m);
    work((u32)t);
    return 0;
}

/* tsc_khz from the TSC against CLOCK_MONOTONIC over 50 ms (for display only). */
static u64 calibrate_tsc(void) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    u64 t0 = rdtsc();
    do clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 50000000L);
    u64 ns = (u64)((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec));
    return (rdtsc() - t0) * 1000000 / ns;
}

int main(int argc, char **argv) {
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) == 0) {
        perror("numabench: sched_getaffinity");
        return 3;
    }
    nthreads = (u64)CPU_COUNT(&allowed);
    for (int i = 1; i < argc; i++) {
        char *v = strchr(argv[i], '='), *end;
        if (!v) { fprintf(stderr, "numabench: argument `%s` is not key=value\n", argv[i]); return 2; }
        *v++ = 0;
        u64 n = strtoul(v, &end, 0);
        if (!*v || *end) { fprintf(stderr, "numabench: `%s` wants a number, got `%s`\n", argv[i], v); return 2; }
        if (!strcmp(argv[i], "mb")) mb = n;
        else if (!strcmp(argv[i], "smb")) smb = n;
        else if (!strcmp(argv[i], "iters")) iters = n;
        else if (!strcmp(argv[i], "threads")) nthreads = n;
        else { fprintf(stderr, "numabench: unknown parameter `%s`; it takes: mb, smb, iters, threads\n", argv[i]); return 2; }
    }
    const char *bad = check_sizes();
    if (bad) { fprintf(stderr, "numabench: %s\n", bad); return 2; }
    xrows = sparse_rows();
    xvec = mmap(0, round_up(xrows * 8), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (xvec == MAP_FAILED) { perror("numabench: mmap"); return 3; }
    tsc_khz = calibrate_tsc();
    printf("numabench: threads=%lu mb=%lu smb=%lu iters=%lu\n", nthreads, mb, smb, iters);
    pthread_t th[MAX_THREADS];
    for (u64 t = 1; t < nthreads; t++)
        if (pthread_create(&th[t], 0, thread_main, (void *)t) != 0) { fprintf(stderr, "numabench: pthread_create failed\n"); return 3; }
    thread_main(0);
    for (u64 t = 1; t < nthreads; t++) pthread_join(th[t], 0);
    return 0;
}

#else

static struct kumo_boot_info *boot;
static volatile u32 go;

static u64 ap_main(u64 cpu) {
    while (!go) cpu_relax();
    if (cpu < nthreads) work((u32)cpu);
    for (;;) cpu_relax(); /* vCPU 0 ends the VM */
    return 0;
}

static u64 bsp_main(u64 unused) {
    (void)unused;
    const char *bad = check_sizes();
    if (bad) {
        OUT("numabench: %s\n", bad);
        return 2;
    }
    /* Blocks from the first free 2 MiB boundary: x, then each thread's part. */
    u64 at = round_up(boot->free_start), need = round_up(sparse_rows() * 8);
    for (u64 t = 0; t < nthreads; t++) need += round_up(part_bytes(t));
    if (at + need > boot->free_end) {
        OUT("numabench: needs %lu MiB of free guest memory, has %lu (raise --memory)\n", need >> 20,
            (boot->free_end - at) >> 20);
        return 3;
    }
    xrows = sparse_rows();
    xvec = (u64 *)at;
    at += round_up(xrows * 8);
    for (u64 t = 0; t < nthreads; t++) {
        place_part(t, at);
        at += round_up(part_bytes(t));
    }
    OUT("numabench: threads=%lu mb=%lu smb=%lu iters=%lu\n", nthreads, mb, smb, iters);
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    work(0);
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu != 0) kumo_enter_user(ap_main, cpu);
    boot = bi;
    tsc_khz = bi->tsc_khz;
    nthreads = bi->ncpus > KUMO_MAX_CPUS ? KUMO_MAX_CPUS : bi->ncpus;
    if (kumo_param_u64(bi, "mb", &mb) < 0 || kumo_param_u64(bi, "smb", &smb) < 0 ||
        kumo_param_u64(bi, "iters", &iters) < 0) {
        kputs("numabench: mb, smb and iters must be numbers\n");
        kumo_exit(2);
    }
    kumo_enter_user(bsp_main, 0);
}

#endif
