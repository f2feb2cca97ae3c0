/* virtio-blk driver for kumo's guests (see blk.h): PCI scan in ring 0, the device in ring 3. */
#include "blk.h"
#include "virtio_pci.h"

static inline u32 inl(u16 port) { u32 v; __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u8 mmio_read8(u64 a) { return *(volatile u8 *)a; }
static inline u16 mmio_read16(u64 a) { return *(volatile u16 *)a; }
static inline void mmio_write8(u64 a, u8 v) { *(volatile u8 *)a = v; }
static inline void mmio_write16(u64 a, u16 v) { *(volatile u16 *)a = v; }
static inline void mb(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }

static u64 alloc_next, alloc_end;

void *memcpy(void *d, const void *s, u64 n) {
    void *r = d;
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
    return r;
}

void *memset(void *d, int c, u64 n) {
    void *r = d;
    __asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
    return r;
}

void *blk_alloc(u64 bytes) {
    bytes = (bytes + 4095) & ~4095UL;
    u64 a = __atomic_fetch_add(&alloc_next, bytes, __ATOMIC_RELAXED);
    if (a + bytes > alloc_end) {
        kprintf("blk: out of memory for rings and buffers\n");
        kumo_exit(3);
    }
    return memset((void *)a, 0, bytes);
}

/* ---- ring 0: PCI configuration mechanism #1 ---- */

static u32 cfg_read(struct blk *b, u8 off) {
    outl(0xcf8, 0x80000000u | (u32)b->bus << 16 | (u32)b->slot << 11 | (u32)b->fn << 8 | (off & 0xfc));
    return inl(0xcfc);
}

static void cfg_write(struct blk *b, u8 off, u32 v) {
    outl(0xcf8, 0x80000000u | (u32)b->bus << 16 | (u32)b->slot << 11 | (u32)b->fn << 8 | (off & 0xfc));
    outl(0xcfc, v);
}

static u8 cfg_read8(struct blk *b, u8 off) { return (u8)(cfg_read(b, off) >> ((off & 3) * 8)); }

static void read_bars(struct blk *b) {
    for (int i = 0; i < 6; i++) {
        u32 v = cfg_read(b, (u8)(0x10 + 4 * i));
        b->bar[i] = v & 1 ? 0 : v & ~0xfUL;
        if (!(v & 1) && ((v >> 1) & 3) == 2 && i < 5) {
            b->bar[i] |= (u64)cfg_read(b, (u8)(0x10 + 4 * (i + 1))) << 32;
            b->bar[++i] = 0;
        }
    }
}

static const char *read_caps(struct blk *b) {
    if (!(cfg_read(b, 0x04) & (1u << 20)))
        return "no capability list";
    u8 off = cfg_read8(b, 0x34) & 0xfc;
    for (int guard = 0; off && guard < 48; guard++) {
        u32 h = cfg_read(b, off);
        if ((u8)h == 0x09) { /* vendor: a virtio structure */
            u8 type = (u8)(h >> 24), bar = cfg_read8(b, (u8)(off + 4));
            u64 a = bar < 6 && b->bar[bar] ? b->bar[bar] + cfg_read(b, (u8)(off + 8)) : 0;
            if (type == 1 && !b->common) b->common = a;
            if (type == 4 && !b->devcfg) b->devcfg = a;
            if (type == 2 && !b->notify_base) {
                b->notify_base = a;
                b->notify_mult = cfg_read(b, (u8)(off + 16));
            }
        }
        off = (u8)(h >> 8) & 0xfc;
    }
    if (!b->common || !b->notify_base || !b->devcfg)
        return "virtio capabilities missing (common, notify or device config)";
    if (b->common >> 32 || b->notify_base >> 32 || b->devcfg >> 32)
        return "a BAR lies above 4 GiB, beyond the identity map";
    return 0;
}

const char *blk_scan(struct blk *b, struct kumo_boot_info *bi) {
    alloc_next = bi->free_start;
    alloc_end = bi->free_end;
    for (u8 slot = 0; slot < 32; slot++) {
        b->bus = 0;
        b->slot = slot;
        b->fn = 0;
        if (cfg_read(b, 0) != 0x10421af4)
            continue;
        read_bars(b);
        /* Memory decoding and bus mastering. */
        cfg_write(b, 0x04, (cfg_read(b, 0x04) & 0xffff) | 0x6);
        return read_caps(b);
    }
    return "no virtio-blk device (1af4:1042) on PCI bus 0";
}

/* ---- ring 3: the device ---- */

#define F_RO (1UL << 5)
#define F_FLUSH (1UL << 9)

static u64 cc(struct blk *b, u32 off) { return b->common + off; }

static void write64(struct blk *b, u32 off, u64 v) {
    mmio_write32(cc(b, off), (u32)v);
    mmio_write32(cc(b, off + 4), (u32)(v >> 32));
}

const char *blk_up(struct blk *b) {
    mmio_write8(cc(b, CC_STATUS), 0);
    while (mmio_read8(cc(b, CC_STATUS)))
        cpu_relax();
    mmio_write8(cc(b, CC_STATUS), S_ACK);
    mmio_write8(cc(b, CC_STATUS), S_ACK | S_DRIVER);
    mmio_write32(cc(b, CC_DFSELECT), 0);
    u64 dev = mmio_read32(cc(b, CC_DF));
    mmio_write32(cc(b, CC_DFSELECT), 1);
    dev |= (u64)mmio_read32(cc(b, CC_DF)) << 32;
    if (!(dev & F_VERSION_1))
        return "the device does not offer VERSION_1";
    b->features = dev & (F_VERSION_1 | F_FLUSH | F_RO);
    b->readonly = !!(b->features & F_RO);
    mmio_write32(cc(b, CC_GFSELECT), 0);
    mmio_write32(cc(b, CC_GF), (u32)b->features);
    mmio_write32(cc(b, CC_GFSELECT), 1);
    mmio_write32(cc(b, CC_GF), (u32)(b->features >> 32));
    mmio_write8(cc(b, CC_STATUS), S_ACK | S_DRIVER | S_FEATURES_OK);
    if (!(mmio_read8(cc(b, CC_STATUS)) & S_FEATURES_OK)) {
        mmio_write8(cc(b, CC_STATUS), S_FAILED);
        return "the device refused the features";
    }
    u8 gen;
    do {
        gen = mmio_read8(cc(b, CC_GENERATION));
        b->capacity = (u64)mmio_read32(b->devcfg) | (u64)mmio_read32(b->devcfg + 4) << 32;
    } while (gen != mmio_read8(cc(b, CC_GENERATION)));
    mmio_write16(cc(b, CC_MSIX_CONFIG), NO_VECTOR);
    mmio_write16(cc(b, CC_Q_SELECT), 0);
    u16 size = mmio_read16(cc(b, CC_Q_SIZE));
    if (size < 4)
        return "request queue 0 is missing or smaller than 4";
    if (size > BLK_QSIZE_MAX) size = BLK_QSIZE_MAX;
    mmio_write16(cc(b, CC_Q_SIZE), size);
    b->qsize = size;
    b->nslots = size / 3 < BLK_SLOTS_MAX ? size / 3 : BLK_SLOTS_MAX;
    b->desc = blk_alloc(16UL * size);
    b->avail = blk_alloc(6UL + 2UL * size);
    b->used = blk_alloc(6UL + 8UL * size);
    b->hdrs = blk_alloc(32UL * BLK_SLOTS_MAX);
    write64(b, CC_Q_DESC, (u64)b->desc);
    write64(b, CC_Q_DRIVER, (u64)b->avail);
    write64(b, CC_Q_DEVICE, (u64)b->used);
    mmio_write16(cc(b, CC_Q_MSIX), NO_VECTOR);
    b->notify = b->notify_base + (u64)mmio_read16(cc(b, CC_Q_NOTIFY_OFF)) * b->notify_mult;
    /* Slot k: descriptors 3k (header), 3k+1 (data), 3k+2 (status), chained once for all. */
    for (u16 k = 0; k < b->nslots; k++) {
        struct blk_desc *d = &b->desc[3 * k];
        d[0] = (struct blk_desc){(u64)(b->hdrs + 32UL * k), 16, 1, (u16)(3 * k + 1)};
        d[1] = (struct blk_desc){0, 0, 1, (u16)(3 * k + 2)};
        d[2] = (struct blk_desc){(u64)(b->hdrs + 32UL * k + 16), 1, 2, 0};
    }
    b->avail[0] = 1; /* VIRTQ_AVAIL_F_NO_INTERRUPT: completions are polled */
    mmio_write16(cc(b, CC_Q_ENABLE), 1);
    mmio_write8(cc(b, CC_STATUS), S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
    if (mmio_read8(cc(b, CC_STATUS)) & (S_NEEDS_RESET | S_FAILED))
        return "the device needs a reset right after DRIVER_OK";
    return 0;
}

void blk_submit(struct blk *b, u16 slot, u32 type, u64 sector, void *buf, u32 len) {
    u8 *h = b->hdrs + 32UL * slot;
    *(u32 *)h = type;
    *(u32 *)(h + 4) = 0;
    *(u64 *)(h + 8) = sector;
    h[16] = 0xff;
    struct blk_desc *d = &b->desc[3 * slot];
    if (len) {
        d[0].next = (u16)(3 * slot + 1);
        d[1].addr = (u64)buf;
        d[1].len = len;
        d[1].flags = 1 | (type == BLK_T_OUT ? 0 : 2);
    } else {
        d[0].next = (u16)(3 * slot + 2); /* no data: header, then status */
    }
    b->avail[2 + b->avail_idx % b->qsize] = (u16)(3 * slot);
    b->avail_idx++;
}

void blk_kick(struct blk *b) {
    barrier();
    b->avail[1] = b->avail_idx;
    mb();
    if (!(b->used[0] & 1)) /* VIRTQ_USED_F_NO_NOTIFY */
        mmio_write16(b->notify, 0);
}

int blk_reap(struct blk *b, u8 *status) {
    if (b->used[1] == b->last_used)
        return -1;
    barrier();
    volatile u32 *e = (volatile u32 *)((u8 *)b->used + 4 + 8 * (b->last_used % b->qsize));
    u32 id = e[0];
    b->last_used++;
    if (id % 3 || id / 3 >= b->nslots)
        return -1;
    *status = b->hdrs[32UL * (id / 3) + 16];
    return (int)(id / 3);
}

int blk_needs_reset(struct blk *b) { return !!(mmio_read8(cc(b, CC_STATUS)) & S_NEEDS_RESET); }
