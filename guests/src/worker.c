/* worker: the workload of elastic sharing (issue 13). Every vCPU it may use does work units:
 * `compute` iterations of an integer mix, then one memory chunk of `chunk_kb`, taken in turn
 * from all elastic blocks it may use (or from the vCPU's own base buffer when it has none). A
 * chunk never written since its block was plugged must read all zeros (memory lent from another
 * VM must not show that VM's data); one written before must still hold the pattern written last.
 *
 * Without an elastic channel (boot_info->elastic == 0) every vCPU works on its base buffer.
 * With one, it follows the mailbox (guests/include/elastic.h): a vCPU works iff it is in
 * cpus_allowed and not being vacated; requests are answered as the contract says (vacate and
 * give by the vCPUs concerned, memory requests and cancel by vCPU 0). Everything runs in ring 3
 * (ring-0 code is emulated on nested KVM): working vCPUs poll `seq` between units, idle ones
 * halt in kumo_wait_change until kumo's interrupt.
 *
 * Output lines (parsed by crates/guests/src/worker.rs):
 *   worker: start vcpus=N elastic=0|1 allowed=0xHEX blocks=B plugged=P block_kb=K tag=T
 *   worker: vcpu=V units=U                     (every `report` units of vCPU V)
 *   worker: vacated cpus=0xHEX seq=S / started cpus=0xHEX seq=S
 *   worker: released node=N blocks=K seq=S / given blocks=K seq=S / refused seq=S / cancelled seq=S
 *   worker: nonzero block=B chunk=C / corrupt block=B chunk=C   (once per block; B >= 1024: the
 *           base buffer of vCPU B - 1024)
 *   worker: done units=U nonzero=Z corrupt=X   (with units=N; exit 0, or 3 on any violation)
 *   worker: touching released block=B gpa=0xG  (touch_released=1: then it writes that block until
 *           kumo stops the VM)
 * A request's line is printed after its ack (acks first), and a vacated vCPU's by another vCPU
 * (kumo parks it right after the ack: it must not hold the print lock then). quiet=1 drops
 * request lines: each character is a port exit (~40 us here), so a line delays a request that
 * follows at once by ~1 ms; kumo can read progress from the mailbox instead. */
#include "kumo.h"
#include "elastic.h"

KUMO_MANIFEST("name=worker\n"
              "summary=Elastic-sharing workload: integer compute and checked memory chunks on the vCPUs and elastic memory blocks it is allowed, following kumo's elastic mailbox; per-vCPU progress lines.\n"
              "max_cpus=64\n"
              "min_cpus=1\n"
              "param=bsp_work:u64:0:1 = vCPU 0 works too (0 = it only serves the elastic channel)\n"
              "param=compute:u64:20000:iterations of an integer mix per work unit\n"
              "param=chunk_kb:u64:64:KiB of memory checked and rewritten per work unit (divides 2048)\n"
              "param=report:u64:20000:a progress line per vCPU every this many units (0 = none)\n"
              "param=units:u64:0:0 = run forever; N = each working vCPU stops after N units, then exit\n"
              "param=ignore:u64:0:1 = never acknowledge a request (rollback tests)\n"
              "param=base_kb:u64:256:KiB of private buffer per vCPU, used while no elastic block is plugged\n"
              "param=tag:u64:1:written into the memory patterns (give two VMs different tags)\n"
              "param=quiet:u64:0:1 = no line per request (each character printed costs ~40 us here and delays the next request)\n"
              "param=touch_released:u64:0:1 = after acking a memory release, keep writing the first released block (kumo must stop the VM)\n");

#define MAXC KUMO_ELASTIC_MAX_CPUS
#define MAXB KUMO_ELASTIC_MAX_BLOCKS
#define NONE 0xffffffffu
#define GEN_UNKNOWN 0xffffffffu /* chunk contents unknown: do not check, just rewrite */
#define PAD 16                   /* u32s per vCPU slot: one cache line each */
#define GOLDEN 0x9e3779b97f4a7c15UL

/* Guest-side state of an elastic block. */
enum { B_OFF = 0, B_ON = 1, B_LEAVING = 2, B_GONE = 3 };

struct chunk { u32 gen, busy; }; /* gen 0: never written since plugged (must read zeros) */

static struct {
    u64 bsp_work, compute, chunk_bytes, report, units, ignore, base_bytes, tag, quiet, touch_released;
    u32 n;                 /* vCPUs (at most MAXC) */
    u64 tsc_khz;
} P;

static struct kumo_elastic *mb;       /* 0: no elastic channel */
static volatile u32 ready;            /* set by vCPU 0 once everything below is set up */
static u32 nblocks, cpb;              /* elastic blocks, chunks per block */
static u64 total_chunks;
static u64 block_base[MAXB];          /* GPA of each block (0: in no area) */
static u32 block_node[MAXB];
static volatile u8 bstate[MAXB];      /* B_* */
static struct chunk *chunks;          /* [block * cpb + chunk] */
static u64 *base_buf[MAXC];           /* each vCPU's private buffer */
static u32 *base_gen;                 /* [vcpu * nbase + chunk] */
static u32 nbase;                     /* chunks per base buffer */
static volatile u64 cursor;           /* next chunk over all blocks */
static volatile u32 cur_block[MAXC * PAD];  /* the block vCPU v is touching, or NONE */
static volatile u32 give_done[MAXC * PAD];  /* the GIVE_CPUS seq vCPU v has done a unit for */
static volatile u32 finished[MAXC * PAD];   /* units=N reached */
static u64 prog[MAXC * 8];            /* units done per vCPU */
static u64 next_base[MAXC * 8];       /* next base chunk per vCPU */
static volatile u64 sink[MAXC * 8];   /* keeps the compute alive */
static volatile u64 nonzero, corrupt;
static volatile u8 said_nonzero[MAXB + MAXC], said_corrupt[MAXB + MAXC];
static volatile u32 acked;            /* the last seq acknowledged (claimed by one vCPU) */
static volatile u32 exiting;
static u32 handled0;                  /* vCPU 0: the last seq it looked at */

/* ---- output: one line at a time from any vCPU ---- */
static volatile u32 print_lock;
static void lock(void) {
    while (__atomic_exchange_n(&print_lock, 1, __ATOMIC_ACQUIRE))
        while (__atomic_load_n(&print_lock, __ATOMIC_RELAXED)) cpu_relax();
}
static void unlock(void) { __atomic_store_n(&print_lock, 0, __ATOMIC_RELEASE); }
#define say(...) do { lock(); kprintf(__VA_ARGS__); unlock(); } while (0)
/* A request's line: printed after its ack, unless quiet. */
#define note(...) do { if (!P.quiet) say(__VA_ARGS__); } while (0)

/* "vacated" lines: the acker is about to be parked by kumo, which must not happen while it
 * holds the print lock, so it queues the line and a vCPU that stays running prints it. */
static struct { u64 cpus; u32 seq; } vq[8];
static volatile u32 vq_head, vq_tail;
static void vq_push(u64 cpus, u32 seq) {
    u32 h = __atomic_load_n(&vq_head, __ATOMIC_RELAXED);
    vq[h % 8].cpus = cpus;
    vq[h % 8].seq = seq;
    __atomic_store_n(&vq_head, h + 1, __ATOMIC_RELEASE);
}
static void vq_flush(void) {
    for (;;) {
        u32 t = __atomic_load_n(&vq_tail, __ATOMIC_ACQUIRE);
        if (t == __atomic_load_n(&vq_head, __ATOMIC_ACQUIRE)) return;
        u64 cpus = vq[t % 8].cpus;
        u32 seq = vq[t % 8].seq;
        if (__atomic_compare_exchange_n(&vq_tail, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            say("worker: vacated cpus=0x%lx seq=%u\n", cpus, seq);
    }
}

static u64 mix(u64 x) { /* splitmix64 finalizer */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9UL;
    x ^= x >> 27; x *= 0x94d049bb133111ebUL;
    return x ^ (x >> 31);
}

static int bit(const u64 *map, u32 b) { return (int)((__atomic_load_n(&map[b / 64], __ATOMIC_RELAXED) >> (b % 64)) & 1); }
static u64 tsc_ms(u64 ms) { return ms * (P.tsc_khz ? P.tsc_khz : 2000000); }

/* ---- one work unit ---- */

/* The pattern of a chunk written as generation `gen`: word i = seed + i * GOLDEN. */
static u64 seed(u32 block, u32 chunk, u32 gen) {
    return mix(mix(mix(P.tag ^ 0x6b756d6f) ^ block) ^ ((u64)chunk << 32 | gen));
}
static u32 next_gen(u32 g) { return (g + 1 == GEN_UNKNOWN || g + 1 == 0) ? 1 : g + 1; }

/* Checks the chunk against its generation and rewrites it as the next one. Returns 1 if it held
 * something else than expected. */
static int rewrite(u64 *p, u64 words, u32 block, u32 chunk, u32 *gen) {
    u32 g = *gen, ng = next_gen(g);
    u64 w = seed(block, chunk, ng), bad = 0;
    if (g == 0) {
        for (u64 i = 0; i < words; i++, w += GOLDEN) { bad |= p[i]; p[i] = w; }
    } else if (g == GEN_UNKNOWN) {
        for (u64 i = 0; i < words; i++, w += GOLDEN) p[i] = w;
    } else {
        u64 o = seed(block, chunk, g);
        for (u64 i = 0; i < words; i++, w += GOLDEN, o += GOLDEN) { bad |= p[i] ^ o; p[i] = w; }
    }
    *gen = ng;
    return bad != 0;
}

static void violation(u32 block, u32 chunk, u32 gen_before) {
    if (gen_before == 0) {
        __atomic_fetch_add(&nonzero, 1, __ATOMIC_RELAXED);
        if (!__atomic_exchange_n(&said_nonzero[block], 1, __ATOMIC_RELAXED))
            say("worker: nonzero block=%u chunk=%u\n", block, chunk);
    } else {
        __atomic_fetch_add(&corrupt, 1, __ATOMIC_RELAXED);
        if (!__atomic_exchange_n(&said_corrupt[block], 1, __ATOMIC_RELAXED))
            say("worker: corrupt block=%u chunk=%u\n", block, chunk);
    }
}

/* Takes a chunk of a usable block (its busy flag set), or returns 0. */
static int pick_chunk(u32 *block, u32 *chunk) {
    if (!total_chunks) return 0;
    for (int tries = 0; tries < 4; tries++) {
        u64 c = __atomic_fetch_add(&cursor, 1, __ATOMIC_RELAXED) % total_chunks;
        u32 b = (u32)(c / cpb), k = (u32)(c % cpb), i = 0;
        while (i < nblocks && __atomic_load_n(&bstate[(b + i) % nblocks], __ATOMIC_RELAXED) != B_ON) i++;
        if (i == nblocks) return 0;
        b = (b + i) % nblocks;
        u32 free = 0;
        if (__atomic_compare_exchange_n(&chunks[(u64)b * cpb + k].busy, &free, 1, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED)) {
            *block = b;
            *chunk = k;
            return 1;
        }
    }
    return 0;
}

static void do_unit(u32 v) {
    u64 x = sink[v * 8] + v, acc = 0;
    for (u64 i = 0; i < P.compute; i++) {
        x += GOLDEN;
        acc += mix(x);
    }
    sink[v * 8] = acc;

    u64 words = P.chunk_bytes / 8;
    u32 b, k;
    while (pick_chunk(&b, &k)) {
        struct chunk *c = &chunks[(u64)b * cpb + k];
        /* Publish the block, then look at its state; vCPU 0 marks a block leaving, then looks
         * at every cur_block (both sequentially consistent): one of the two sees the other. */
        __atomic_store_n(&cur_block[v * PAD], b, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&bstate[b], __ATOMIC_SEQ_CST) == B_ON) {
            u32 before = c->gen;
            int bad = rewrite((u64 *)(block_base[b] + (u64)k * P.chunk_bytes), words, b, k, &c->gen);
            __atomic_store_n(&cur_block[v * PAD], NONE, __ATOMIC_RELEASE);
            __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
            if (bad) violation(b, k, before);
            return;
        }
        __atomic_store_n(&cur_block[v * PAD], NONE, __ATOMIC_RELEASE);
        __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
    }
    /* No elastic block to use: the vCPU's own buffer. */
    u32 kb = (u32)(next_base[v * 8]++ % nbase), *gen = &base_gen[v * nbase + kb], before = *gen;
    if (rewrite(base_buf[v] + kb * words, words, MAXB + v, kb, gen)) violation(MAXB + v, kb, before);
}

/* ---- the channel ---- */

struct snap { u32 seq, op; u64 req_cpus; u32 req_node, req_blocks; u64 req_mem[16]; };

/* A consistent copy of request `seq` (kumo writes the fields, then bumps seq). */
static void snapshot(struct snap *s) {
    for (;;) {
        u32 a = __atomic_load_n(&mb->seq, __ATOMIC_ACQUIRE);
        s->op = __atomic_load_n(&mb->op, __ATOMIC_RELAXED);
        s->req_cpus = __atomic_load_n(&mb->req_cpus, __ATOMIC_RELAXED);
        s->req_node = __atomic_load_n(&mb->req_node, __ATOMIC_RELAXED);
        s->req_blocks = __atomic_load_n(&mb->req_blocks, __ATOMIC_RELAXED);
        for (int i = 0; i < 16; i++) s->req_mem[i] = __atomic_load_n(&mb->req_mem[i], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&mb->seq, __ATOMIC_RELAXED) == a) {
            s->seq = a;
            return;
        }
    }
}

/* Whether vCPU v should work now. */
static int works(u32 v, const struct snap *s) {
    if (v >= P.n || (v == 0 && !P.bsp_work) || __atomic_load_n(&finished[v * PAD], __ATOMIC_RELAXED)) return 0;
    if (!mb) return 1;
    if (!((__atomic_load_n(&mb->cpus_allowed, __ATOMIC_RELAXED) >> v) & 1)) return 0;
    return P.ignore || !(s->op == KUMO_OP_VACATE_CPUS && ((s->req_cpus >> v) & 1));
}

/* One vCPU gets to acknowledge request `seq` (seqs only grow, modulo 2^32). */
static int claim(u32 seq) {
    u32 cur = __atomic_load_n(&acked, __ATOMIC_RELAXED);
    while ((int)(seq - cur) > 0)
        if (__atomic_compare_exchange_n(&acked, &cur, seq, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return 1;
    return 0;
}

/* Ack: the fields, then ack_seq, then the doorbell. */
static void ack(u32 seq, u32 status, const u64 *mem) {
    if (mem)
        for (int i = 0; i < 16; i++) __atomic_store_n(&mb->ack_mem[i], mem[i], __ATOMIC_RELAXED);
    __atomic_store_n(&mb->ack_status, status, __ATOMIC_RELAXED);
    __atomic_store_n(&mb->ack_seq, seq, __ATOMIC_SEQ_CST);
    outl(KUMO_ELASTIC_PORT, seq);
}

/* VACATE_CPUS: acked once every vCPU of the set is idle (by the last of them, or vCPU 0). */
static void try_ack_vacate(const struct snap *s) {
    for (u32 u = 0; u < MAXC; u++)
        if (((s->req_cpus >> u) & 1) && __atomic_load_n(&mb->cpu_state[u], __ATOMIC_SEQ_CST) != 0) return;
    if (__atomic_load_n(&mb->seq, __ATOMIC_SEQ_CST) != s->seq || !claim(s->seq)) return;
    ack(s->seq, KUMO_ACK_OK, 0);
    if (!P.quiet) vq_push(s->req_cpus, s->seq);
}

/* GIVE_CPUS: acked once every vCPU of the set has done a unit since this seq. */
static void try_ack_give(const struct snap *s, u32 v) {
    __atomic_store_n(&give_done[v * PAD], s->seq, __ATOMIC_SEQ_CST);
    for (u32 u = 0; u < MAXC; u++)
        if (((s->req_cpus >> u) & 1) && __atomic_load_n(&give_done[u * PAD], __ATOMIC_SEQ_CST) != s->seq) return;
    if (__atomic_load_n(&mb->seq, __ATOMIC_SEQ_CST) != s->seq || !claim(s->seq)) return;
    ack(s->seq, KUMO_ACK_OK, 0);
    note("worker: started cpus=0x%lx seq=%u\n", s->req_cpus, s->seq);
}

/* Waits until no vCPU is touching a block of `set`; 0 if one still is after `ms`. */
static int wait_out(const u64 *set, u64 ms) {
    u64 start = rdtsc(), end = start + tsc_ms(ms), spin = tsc_ms(1) / 50; /* 20 us */
    for (u32 u = 0; u < P.n; u++)
        for (;;) {
            u32 b = __atomic_load_n(&cur_block[u * PAD], __ATOMIC_SEQ_CST);
            if (b == NONE || !bit(set, b)) break;
            u64 now = rdtsc();
            if (now > end) return 0;
            /* Past a short spin, halt 50 us at a time: this vCPU floats and may share a host
             * CPU with the very vCPU it waits for, which a spin would keep off it. */
            if (now - start > spin) kumo_wait_change(0, 0, now + spin * 5 / 2);
            else cpu_relax();
        }
    return 1;
}

/* Makes block b usable with its chunks at generation `gen` (0: all zeros, freshly plugged). */
static void plug(u32 b, u32 gen) {
    for (u32 k = 0; k < cpb; k++) chunks[(u64)b * cpb + k].gen = gen;
    __atomic_store_n(&bstate[b], B_ON, __ATOMIC_SEQ_CST);
}

static void release_mem(const struct snap *s) {
    u64 set[16] = {0};
    u32 want = s->req_blocks, got = 0;
    for (u32 b = nblocks; b-- > 0 && got < want;)
        if (block_base[b] && block_node[b] == s->req_node && bstate[b] == B_ON) {
            set[b / 64] |= 1UL << (b % 64);
            got++;
        }
    if (got < want) {
        u64 none[16] = {0};
        ack(s->seq, KUMO_ACK_REFUSED, none);
        note("worker: refused seq=%u\n", s->seq);
        return;
    }
    for (u32 b = 0; b < nblocks; b++)
        if (bit(set, b)) __atomic_store_n(&bstate[b], B_LEAVING, __ATOMIC_SEQ_CST);
    if (!wait_out(set, 50)) { /* a vCPU stuck in one (stopped by the host?): change nothing */
        for (u32 b = 0; b < nblocks; b++)
            if (bit(set, b)) __atomic_store_n(&bstate[b], B_ON, __ATOMIC_SEQ_CST);
        u64 none[16] = {0};
        ack(s->seq, KUMO_ACK_REFUSED, none);
        note("worker: refused seq=%u\n", s->seq);
        return;
    }
    for (u32 b = 0; b < nblocks; b++)
        if (bit(set, b)) __atomic_store_n(&bstate[b], B_GONE, __ATOMIC_SEQ_CST);
    ack(s->seq, KUMO_ACK_OK, set);
    note("worker: released node=%u blocks=%u seq=%u\n", s->req_node, got, s->seq);
    if (P.touch_released) { /* a guest breaking its word: kumo must stop it, not serve it memory */
        u32 b = 0;
        while (!bit(set, b)) b++;
        say("worker: touching released block=%u gpa=0x%lx\n", b, block_base[b]);
        for (u64 i = 0;; i++) {
            *(volatile u64 *)block_base[b] = i;
            cpu_relax();
        }
    }
}

static void give_mem(const struct snap *s) {
    u32 n = 0;
    for (u32 b = 0; b < nblocks; b++)
        if (bit(s->req_mem, b) && block_base[b]) {
            if (bstate[b] != B_ON) plug(b, 0); /* given blocks are all zeros */
            n++;
        }
    ack(s->seq, KUMO_ACK_OK, 0);
    note("worker: given blocks=%u seq=%u\n", n, s->seq);
}

/* CANCEL: back to what cpus_allowed and mem_plugged say. (vCPUs follow cpus_allowed by
 * themselves; the blocks are vCPU 0's.) */
static void cancel(const struct snap *s) {
    u64 drop[16] = {0};
    int any = 0;
    for (u32 b = 0; b < nblocks; b++) {
        if (!block_base[b]) continue;
        u8 st = bstate[b];
        if (bit(mb->mem_plugged, b)) {
            if (st == B_LEAVING) __atomic_store_n(&bstate[b], B_ON, __ATOMIC_SEQ_CST); /* never given up */
            else if (st == B_OFF) plug(b, 0);            /* given, never acked: zeros */
            /* B_GONE stays gone: once acked, a block is never touched again (if kumo kept it,
             * only a GIVE_MEM brings it back). */
        } else if (st == B_ON || st == B_LEAVING) {      /* taken back without our ack */
            __atomic_store_n(&bstate[b], B_LEAVING, __ATOMIC_SEQ_CST);
            drop[b / 64] |= 1UL << (b % 64);
            any = 1;
        } else if (st == B_GONE) {
            bstate[b] = B_OFF;
        }
    }
    if (any) {
        wait_out(drop, 1000);
        for (u32 b = 0; b < nblocks; b++)
            if (bit(drop, b)) __atomic_store_n(&bstate[b], B_OFF, __ATOMIC_SEQ_CST);
    }
    ack(s->seq, KUMO_ACK_OK, 0);
    note("worker: cancelled seq=%u\n", s->seq);
}

/* vCPU 0, on a request it has not looked at yet. */
static void handle0(const struct snap *s) {
    /* Already acked: its fields may already be the next request's, being written. */
    if (__atomic_load_n(&mb->ack_seq, __ATOMIC_ACQUIRE) == s->seq) return;
    switch (s->op) {
    case KUMO_OP_VACATE_CPUS: try_ack_vacate(s); break;
    case KUMO_OP_RELEASE_MEM: if (claim(s->seq)) release_mem(s); break;
    case KUMO_OP_GIVE_MEM: if (claim(s->seq)) give_mem(s); break;
    case KUMO_OP_CANCEL: if (claim(s->seq)) cancel(s); break;
    default: break;
    }
}

/* ---- units=N: the end ---- */
static void check_all_done(const struct snap *s) {
    for (u32 u = 0; u < P.n; u++)
        if (works(u, s)) return;
    if (__atomic_exchange_n(&exiting, 1, __ATOMIC_ACQ_REL)) return;
    u64 total = 0;
    for (u32 u = 0; u < P.n; u++) total += __atomic_load_n(&prog[u * 8], __ATOMIC_RELAXED);
    u64 z = nonzero, x = corrupt;
    say("worker: done units=%lu nonzero=%lu corrupt=%lu\n", total, z, x);
    kumo_exit(z || x ? 3 : 0);
}

/* ---- setup, by vCPU 0 in ring 3 ---- */
static void fail(const char *what) {
    say("worker: %s\n", what);
    kumo_exit(2);
}

static void setup(struct kumo_boot_info *bi) {
    u64 chunk_kb = 64, base_kb = 256;
    P.compute = 20000, P.report = 20000, P.tag = 1;
    if (kumo_param_u64(bi, "bsp_work", &P.bsp_work) < 0 || kumo_param_u64(bi, "compute", &P.compute) < 0 ||
        kumo_param_u64(bi, "chunk_kb", &chunk_kb) < 0 || kumo_param_u64(bi, "report", &P.report) < 0 ||
        kumo_param_u64(bi, "units", &P.units) < 0 || kumo_param_u64(bi, "ignore", &P.ignore) < 0 ||
        kumo_param_u64(bi, "base_kb", &base_kb) < 0 || kumo_param_u64(bi, "tag", &P.tag) < 0 ||
        kumo_param_u64(bi, "quiet", &P.quiet) < 0 || kumo_param_u64(bi, "touch_released", &P.touch_released) < 0)
        fail("parameters must be numbers");
    if (chunk_kb == 0 || 2048 % chunk_kb)
        fail("chunk_kb must divide 2048 (1, 2, 4, ... 2048)");
    if (base_kb < chunk_kb || base_kb % chunk_kb || base_kb > (1UL << 30))
        fail("base_kb must be a multiple of chunk_kb (and at most 2^30)");
    P.chunk_bytes = chunk_kb << 10;
    P.base_bytes = base_kb << 10;
    P.n = bi->ncpus > MAXC ? MAXC : bi->ncpus;
    P.tsc_khz = bi->tsc_khz;
    nbase = (u32)(base_kb / chunk_kb);
    for (u32 v = 0; v < MAXC; v++) cur_block[v * PAD] = NONE;

    u64 allowed = P.n == 64 ? ~0UL : (1UL << P.n) - 1, block_kb = 0;
    u32 plugged = 0;
    if (bi->elastic) {
        mb = (struct kumo_elastic *)bi->elastic;
        if (mb->magic != KUMO_ELASTIC_MAGIC || mb->version != KUMO_ELASTIC_VERSION)
            fail("bad elastic mailbox (magic or version)");
        nblocks = mb->nblocks;
        if (nblocks > MAXB || mb->nareas > KUMO_ELASTIC_MAX_AREAS || (nblocks && (!mb->block_bytes ||
            mb->block_bytes % (2UL << 20) || mb->block_bytes > (1UL << 40))))
            fail("bad elastic mailbox (nblocks, nareas or block_bytes)");
        for (u32 a = 0; a < mb->nareas; a++) {
            struct kumo_elastic_area *ar = &mb->areas[a];
            if (ar->base % (2UL << 20) || (u64)ar->first_block + ar->nblocks > nblocks)
                fail("bad elastic mailbox (an area)");
            for (u32 i = 0; i < ar->nblocks; i++) {
                block_base[ar->first_block + i] = ar->base + i * mb->block_bytes;
                block_node[ar->first_block + i] = ar->node;
            }
        }
        cpb = (u32)(mb->block_bytes / P.chunk_bytes);
        total_chunks = (u64)nblocks * cpb;
        allowed = mb->cpus_allowed;
        block_kb = mb->block_bytes >> 10;
    }

    /* The free heap: base buffers, then chunk state. */
    u64 heap = (bi->free_start + 4095) & ~4095UL, start = heap;
    for (u32 v = 0; v < P.n; v++, heap += P.base_bytes) base_buf[v] = (u64 *)heap;
    base_gen = (u32 *)heap;
    heap += (u64)P.n * nbase * sizeof(u32);
    heap = (heap + 63) & ~63UL;
    chunks = (struct chunk *)heap;
    heap += total_chunks * sizeof(struct chunk);
    if (heap > bi->free_end) fail("not enough free memory for base_kb and the chunk table");
    for (u32 b = 0; b < nblocks; b++)
        if (block_base[b] && block_base[b] < heap && block_base[b] + mb->block_bytes > start)
            fail("an elastic block overlaps the free heap");
    for (u64 i = 0; i < (u64)P.n * nbase; i++) base_gen[i] = GEN_UNKNOWN; /* not checked for zeros */
    for (u64 i = 0; i < total_chunks; i++) chunks[i] = (struct chunk){0, 0};
    for (u32 b = 0; b < nblocks; b++)
        if (block_base[b] && bit(mb->mem_plugged, b)) {
            bstate[b] = B_ON;
            plugged++;
        }

    /* kumo's request interrupt only has to end a halt: the runtime's timer ISR just EOIs. */
    extern void kumo_timer_isr(void);
    kumo_set_gate(KUMO_ELASTIC_VECTOR, kumo_timer_isr);
    say("worker: start vcpus=%u elastic=%u allowed=0x%lx blocks=%u plugged=%u block_kb=%lu tag=%lu\n", bi->ncpus,
        mb ? 1 : 0, allowed, nblocks, plugged, block_kb, P.tag);
}

/* ---- every vCPU, ring 3 ---- */
static u64 run(u64 arg) {
    struct kumo_boot_info *bi = (struct kumo_boot_info *)(arg >> 8);
    u32 v = (u32)(arg & 0xff);
    if (v == 0) {
        setup(bi);
        __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
    } else {
        while (!__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) cpu_relax();
    }
    struct snap s = {0};
    if (v == 0 && P.units) check_all_done(&s); /* nobody to work */
    for (;;) {
        if (mb) snapshot(&s);
        if (mb && !P.ignore && v == 0 && s.seq != handled0) {
            handled0 = s.seq;
            handle0(&s);
        }
        int in_set = mb && ((s.req_cpus >> v) & 1);
        if (works(v, &s)) {
            if (mb && __atomic_load_n(&mb->cpu_state[v], __ATOMIC_RELAXED) != 1) {
                /* Working again: say so before the last look at seq, so that vCPU 0 cannot ack
                 * a vacate of this vCPU on its old idle state while it starts a unit. */
                __atomic_store_n(&mb->cpu_state[v], 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&mb->seq, __ATOMIC_SEQ_CST) != s.seq) continue;
            }
            vq_flush();
            do_unit(v);
            u64 p = ++prog[v * 8];
            if (mb) __atomic_store_n(&mb->progress[v], p, __ATOMIC_RELAXED);
            if (P.report && p % P.report == 0) say("worker: vcpu=%u units=%lu\n", v, p);
            if (mb && !P.ignore && s.op == KUMO_OP_GIVE_CPUS && in_set && give_done[v * PAD] != s.seq)
                try_ack_give(&s, v);
            if (P.units && p >= P.units) {
                __atomic_store_n(&finished[v * PAD], 1, __ATOMIC_SEQ_CST);
                check_all_done(&s);
            }
            continue;
        }
        /* Idle: say so, answer what concerns this vCPU, halt until the next request. */
        if (!mb) {
            for (;;) kumo_wait_change(0, 0, 0);
        }
        __atomic_store_n(&mb->cpu_state[v], 0, __ATOMIC_SEQ_CST);
        if (!P.ignore) {
            if (s.op == KUMO_OP_VACATE_CPUS && in_set) try_ack_vacate(&s);
            /* A vCPU of the set that does no work (vCPU 0 without bsp_work, or done): nothing to wait for. */
            if (s.op == KUMO_OP_GIVE_CPUS && in_set && give_done[v * PAD] != s.seq) try_ack_give(&s, v);
        }
        if (v == 0 && !(s.op == KUMO_OP_VACATE_CPUS && in_set)) vq_flush();
        kumo_wait_change(&mb->seq, s.seq, 0);
    }
    return 0; /* not reached: the VM ends by kumo_exit */
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    kumo_enter_user(run, (u64)bi << 8 | cpu);
}
