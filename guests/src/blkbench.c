/* blkbench: sequential and random 4 KiB / 64 KiB reads and writes at queue depth 1 and 32 on
 * the first virtio-blk disk, with p50/p99 latency on the TSC. Every write carries a pattern
 * derived from its sector, every read checks it, and a last pass checks the whole region. */
#include "blk.h"

KUMO_MANIFEST("name=blkbench\n"
              "summary=Disk benchmark on the first virtio-blk disk: sequential and random 4 KiB / 64 KiB reads and writes at QD 1 and 32, verifying a pattern it wrote.\n"
              "max_cpus=64\n"
              "param=size_mib:u64:64:the region tested, from sector 0 (at most the disk)\n"
              "param=ms:u64:1000:milliseconds per test\n"
              "param=seed:u64:1:the pattern's seed\n"
              "param=readonly:u64:0:1 = only read, checking the pattern a run with the same seed wrote\n"
              "param=write_ro:u64:0:1 = on a read-only disk, write once anyway and expect IOERR\n");

#define MAX_LAT (1 << 16)
#define BUF_MAX (64 << 10)

static struct blk disk;
static struct kumo_boot_info *bi;
static const char *scan_err;
static u64 seed, region_sectors, tsc_khz, rng = 0x2545f4914f6cdd1dUL;
static u64 verify_failures, io_errors;
static u8 *bufs;
static u64 *lat;
static u64 sub_tsc[BLK_SLOTS_MAX];
static u64 slot_sector[BLK_SLOTS_MAX];
static u32 slot_len[BLK_SLOTS_MAX];

static u64 next_rand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static u64 word(u64 sector, u64 i) { return ((sector << 6 | i) * 0x9e3779b97f4a7c15UL) ^ seed; }

static void fill(u64 *p, u64 sector, u32 len) {
    for (u64 s = 0; s < len / 512; s++)
        for (u64 i = 0; i < 64; i++)
            p[s * 64 + i] = word(sector + s, i);
}

static int check(const u64 *p, u64 sector, u32 len) {
    for (u64 s = 0; s < len / 512; s++)
        for (u64 i = 0; i < 64; i++)
            if (p[s * 64 + i] != word(sector + s, i)) {
                if (verify_failures++ < 4)
                    kprintf("blkbench: sector %lu word %lu: %lx, expected %lx\n", sector + s, i, p[s * 64 + i],
                            word(sector + s, i));
                return -1;
            }
    return 0;
}

static void sort(u64 *a, u64 n) { /* heap sort: no recursion, no allocation */
    for (u64 k = n / 2; k-- > 0;)
        for (u64 r = k, c; (c = 2 * r + 1) < n; r = c) {
            if (c + 1 < n && a[c + 1] > a[c]) c++;
            if (a[r] >= a[c]) break;
            u64 t = a[r]; a[r] = a[c]; a[c] = t;
        }
    for (u64 end = n; end-- > 1;) {
        u64 t = a[0]; a[0] = a[end]; a[end] = t;
        for (u64 r = 0, c; (c = 2 * r + 1) < end; r = c) {
            if (c + 1 < end && a[c + 1] > a[c]) c++;
            if (a[r] >= a[c]) break;
            t = a[r]; a[r] = a[c]; a[c] = t;
        }
    }
}

static u64 us(u64 cycles) { return tsc_khz ? cycles * 1000 / tsc_khz : 0; }

/* One test: `qd` requests in flight for `ms` (or one pass over the region if `pass`). */
static void run_test(const char *name, int write, int random, u32 len, u32 qd, u64 ms, int pass) {
    u64 per = len / 512, blocks = region_sectors / per, next_seq = 0, ops = 0, nlat = 0;
    u64 start = rdtsc(), end = start + ms * tsc_khz;
    u32 inflight = 0;
    int stop = 0;
    for (;;) {
        while (!stop && inflight < qd) {
            /* Slots are numbered by what is in flight: the first free one. */
            u16 k = 0;
            while (slot_len[k]) k++;
            u64 sector = (random ? next_rand() % blocks : next_seq++ % blocks) * per;
            u8 *buf = bufs + (u64)k * BUF_MAX;
            if (write)
                fill((u64 *)buf, sector, len);
            slot_sector[k] = sector;
            slot_len[k] = len;
            sub_tsc[k] = rdtsc();
            blk_submit(&disk, k, write ? BLK_T_OUT : BLK_T_IN, sector, buf, len);
            inflight++;
            if (pass && next_seq >= blocks) stop = 1;
        }
        blk_kick(&disk);
        u8 st;
        int k;
        while ((k = blk_reap(&disk, &st)) < 0) {
            if (blk_needs_reset(&disk)) {
                kprintf("blkbench: the device needs a reset (%s)\n", name);
                kumo_exit(3);
            }
            cpu_relax();
        }
        do {
            u64 now = rdtsc();
            if (nlat < MAX_LAT) lat[nlat++] = now - sub_tsc[k];
            if (st != BLK_S_OK) {
                if (io_errors++ < 4)
                    kprintf("blkbench: %s at sector %lu: status %u\n", name, slot_sector[k], st);
            } else if (!write) {
                check((u64 *)(bufs + (u64)k * BUF_MAX), slot_sector[k], slot_len[k]);
            }
            slot_len[k] = 0;
            inflight--;
            ops++;
        } while ((k = blk_reap(&disk, &st)) >= 0);
        if (!pass && !stop && rdtsc() >= end) stop = 1;
        if (stop && !inflight) break;
    }
    u64 el = rdtsc() - start;
    if (!name) return;
    sort(lat, nlat);
    u64 iops = el ? ops * tsc_khz * 1000 / el : 0;
    kprintf("blkbench: %s qd=%u ops=%lu iops=%lu mbps=%lu p50_us=%lu p99_us=%lu\n", name, qd, ops, iops,
            iops * len / 1000000, us(lat[nlat / 2]), us(lat[nlat * 99 / 100]));
}

static u64 run(u64 cpu) {
    (void)cpu;
    const char *e = blk_up(&disk);
    if (e) {
        kprintf("blkbench: %s\n", e);
        return 3;
    }
    u64 size_mib = 64, ms = 1000, ro = 0;
    seed = 1;
    if (kumo_param_u64(bi, "size_mib", &size_mib) < 0 || kumo_param_u64(bi, "ms", &ms) < 0 ||
        kumo_param_u64(bi, "seed", &seed) < 0 || kumo_param_u64(bi, "readonly", &ro) < 0) {
        kprintf("blkbench: bad parameter (numbers only)\n");
        return 2;
    }
    tsc_khz = bi->tsc_khz ? bi->tsc_khz : 1000000;
    region_sectors = size_mib << 11;
    if (region_sectors > disk.capacity) region_sectors = disk.capacity & ~127UL;
    if (region_sectors < 128) {
        kprintf("blkbench: the disk has %lu sectors; 128 at least\n", disk.capacity);
        return 2;
    }
    u64 write_ro = 0;
    if (kumo_param_u64(bi, "write_ro", &write_ro) < 0) {
        kprintf("blkbench: bad parameter (numbers only)\n");
        return 2;
    }
    if (disk.readonly && write_ro) {
        /* The device must refuse it: IOERR, and nothing reaches the image. */
        u8 *buf = blk_alloc(4096), st;
        fill((u64 *)buf, 0, 4096);
        blk_submit(&disk, 0, BLK_T_OUT, 0, buf, 4096);
        blk_kick(&disk);
        while (blk_reap(&disk, &st) < 0)
            cpu_relax();
        kprintf("blkbench: write on a read-only disk: status %u\n", st);
        return st == BLK_S_IOERR ? 0 : 1;
    }
    if (disk.readonly && !ro) {
        kprintf("blkbench: the disk is read-only: readonly=1 checks a pattern written before\n");
        return 2;
    }
    u32 qd32 = disk.nslots < 32 ? disk.nslots : 32;
    bufs = blk_alloc((u64)BUF_MAX * disk.nslots);
    lat = blk_alloc(8UL * MAX_LAT);
    kprintf("blkbench: disk of %lu sectors, queue of %u, region %lu MiB, %lu ms per test\n", disk.capacity,
            disk.qsize, region_sectors >> 11, ms);
    if (!ro)
        run_test("seq64k_write", 1, 0, 64 << 10, qd32, 0, 1); /* lays the pattern down */
    static const struct { const char *name; int write, random; u32 len; } tests[] = {
        {"seq4k_read", 0, 0, 4096}, {"seq64k_read", 0, 0, 65536}, {"rand4k_read", 0, 1, 4096},
        {"rand64k_read", 0, 1, 65536}, {"seq4k_write", 1, 0, 4096}, {"seq64k_write", 1, 0, 65536},
        {"rand4k_write", 1, 1, 4096}, {"rand64k_write", 1, 1, 65536},
    };
    for (u64 t = 0; t < sizeof(tests) / sizeof(tests[0]); t++) {
        if (ro && tests[t].write) continue;
        run_test(tests[t].name, tests[t].write, tests[t].random, tests[t].len, 1, ms, 0);
        run_test(tests[t].name, tests[t].write, tests[t].random, tests[t].len, qd32, ms, 0);
    }
    if (!ro && (disk.features & (1UL << 9))) {
        blk_submit(&disk, 0, BLK_T_FLUSH, 0, 0, 0);
        blk_kick(&disk);
        u8 st;
        while (blk_reap(&disk, &st) < 0)
            cpu_relax();
        if (st != BLK_S_OK) io_errors++;
    }
    run_test(0, 0, 0, 64 << 10, qd32, 0, 1); /* the whole region checked */
    kprintf("blkbench: done errors=%lu verify_failures=%lu\n", io_errors, verify_failures);
    return io_errors || verify_failures ? 1 : 0;
}

static u64 idle(u64 cpu) {
    (void)cpu;
    for (;;)
        kumo_wait_change(0, 0, 0);
    return 0;
}

void kmain(struct kumo_boot_info *b, u32 cpu) {
    if (cpu != 0)
        kumo_enter_user(idle, cpu);
    bi = b;
    scan_err = blk_scan(&disk, b);
    if (scan_err) {
        kprintf("blkbench: %s\n", scan_err);
        kumo_exit(3);
    }
    kumo_enter_user(run, 0);
}
