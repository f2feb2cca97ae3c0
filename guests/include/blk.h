/* kumo guest disk I/O: a virtio-blk driver (virtio 1.x over modern PCI) for kumo's guests
 * (guests/src/blk/). Relies only on the PCI and virtio specs, so the same driver runs on kumo's
 * disk and on QEMU's virtio-blk-pci.
 *
 * Split between rings as the network driver's (net.h): PCI configuration space (ports
 * 0xCF8/0xCFC) in ring 0 on vCPU 0 by blk_scan; everything else (device setup through the BAR,
 * rings, requests) in ring 3, which runs natively on this nested KVM. Completions are polled on
 * the used ring: no interrupts.
 */
#ifndef KUMO_BLK_H
#define KUMO_BLK_H
#include "kumo.h"

#define BLK_QSIZE_MAX 256
/* Requests in flight at once: three descriptors each (header, data, status). */
#define BLK_SLOTS_MAX 64
#define BLK_T_IN 0
#define BLK_T_OUT 1
#define BLK_T_FLUSH 4
#define BLK_T_GET_ID 8
#define BLK_S_OK 0
#define BLK_S_IOERR 1

struct blk_desc { u64 addr; u32 len; u16 flags, next; };

struct blk {
    /* From the PCI scan (ring 0). */
    u8 bus, slot, fn;
    u64 bar[6];
    u64 common, notify_base, devcfg;
    u32 notify_mult;
    /* Driver state (ring 3). */
    u64 features, capacity; /* capacity in 512-byte sectors */
    int readonly;
    u16 qsize, nslots;
    struct blk_desc *desc;
    volatile u16 *avail; /* flags, idx, ring[size], used_event */
    volatile u16 *used;  /* flags, idx, {u32 id, u32 len}[size], avail_event */
    u16 avail_idx, last_used;
    u64 notify;
    u8 *hdrs;            /* per slot: 16-byte header at slot * 32, status byte at slot * 32 + 16 */
};

void *blk_alloc(u64 bytes);         /* page-aligned, zeroed, from boot_info's free range */
void *memcpy(void *d, const void *s, u64 n);
void *memset(void *d, int c, u64 n);

/* Ring 0: finds the first virtio-blk (1af4:1042) on bus 0; 0, or a message. */
const char *blk_scan(struct blk *b, struct kumo_boot_info *bi);
/* Ring 3: reset, features, one queue, DRIVER_OK. 0, or a message. */
const char *blk_up(struct blk *b);
/* Starts request `type` on slot `slot` (< nslots) for `len` bytes at `buf` from `sector`; the
 * device is told once blk_kick is called. */
void blk_submit(struct blk *b, u16 slot, u32 type, u64 sector, void *buf, u32 len);
void blk_kick(struct blk *b);
/* A finished request's slot and status, or -1 if none has finished. */
int blk_reap(struct blk *b, u8 *status);
int blk_needs_reset(struct blk *b);

#endif
