/* virtio-pci modern transport and the virtio-net driver (virtio 1.x), all in ring 3: MMIO to the
 * BARs and DMA memory are identity mapped and user-accessible. One RX/TX queue pair. */
#include "net.h"
#include "virtio_pci.h"

#define F_NET_MAC (1UL << 5)
#define F_NET_STATUS (1UL << 16)
#define F_EVENT_IDX (1UL << 29)

#define DESC_F_WRITE 2
#define AVAIL_F_NO_INTERRUPT 1
#define USED_F_NO_NOTIFY 1

static u64 cc(struct nic *n, u32 off) { return n->common + off; }

/* avail: [0] flags, [1] idx, [2..2+size) ring, [2+size] used_event.
 * used: [0] flags, [1] idx, then size 8-byte elements, then avail_event. */
static volatile u16 *used_event(struct vq *q) { return &q->avail[2 + q->size]; }
static volatile u16 *avail_event(struct vq *q) { return (volatile u16 *)((u8 *)q->used + 4 + 8 * q->size); }
static u16 used_idx(struct vq *q) { return q->used[1]; }
static volatile struct vq_used_elem *used_elem(struct vq *q, u16 i) {
    return (volatile struct vq_used_elem *)((u8 *)q->used + 4) + (i % q->size);
}

static int setup_queue(struct nic *n, struct vq *q, u16 index, u16 msix) {
    mmio_write16(cc(n, CC_Q_SELECT), index);
    u16 size = mmio_read16(cc(n, CC_Q_SIZE));
    if (!size) {
        kprintf("net: nic %d: queue %u missing\n", n->index, index);
        return -1;
    }
    if (size > NET_QSIZE_MAX) size = NET_QSIZE_MAX;
    mmio_write16(cc(n, CC_Q_SIZE), size);
    q->index = index;
    q->size = size;
    q->desc = net_alloc(16UL * size);
    q->avail = net_alloc(6UL + 2UL * size);
    q->used = net_alloc(6UL + 8UL * size);
    q->bufs = net_alloc((u64)NET_BUF * size);
    u64 d = (u64)q->desc, a = (u64)q->avail, u = (u64)q->used;
    mmio_write32(cc(n, CC_Q_DESC), (u32)d);
    mmio_write32(cc(n, CC_Q_DESC + 4), (u32)(d >> 32));
    mmio_write32(cc(n, CC_Q_DRIVER), (u32)a);
    mmio_write32(cc(n, CC_Q_DRIVER + 4), (u32)(a >> 32));
    mmio_write32(cc(n, CC_Q_DEVICE), (u32)u);
    mmio_write32(cc(n, CC_Q_DEVICE + 4), (u32)(u >> 32));
    mmio_write16(cc(n, CC_Q_MSIX), msix);
    if (mmio_read16(cc(n, CC_Q_MSIX)) != msix) {
        kprintf("net: nic %d: queue %u refused MSI-X entry %u\n", n->index, index, msix);
        return -1;
    }
    q->notify = n->notify_base + (u64)mmio_read16(cc(n, CC_Q_NOTIFY_OFF)) * n->notify_mult;
    for (u16 i = 0; i < size; i++) {
        q->desc[i].addr = (u64)(q->bufs + (u64)i * NET_BUF);
        q->desc[i].len = NET_BUF;
        q->free_ids[i] = i;
    }
    q->nfree = size;
    mmio_write16(cc(n, CC_Q_ENABLE), 1);
    return 0;
}

static void notify(struct vq *q) { mmio_write16(q->notify, q->index); }

/* After publishing avail idx new (was old): does the device want a notification? */
static int need_notify(struct nic *n, struct vq *q, u16 old, u16 new) {
    mb();
    if (n->event_idx) {
        u16 ev = *avail_event(q);
        return (u16)(new - ev - 1) < (u16)(new - old);
    }
    return !(q->used[0] & USED_F_NO_NOTIFY);
}

static void msix_entry(struct nic *n, u32 i, u32 apic_id, u8 vector) {
    u64 e = n->msix_table + 16UL * i;
    mmio_write32(e + 0, 0xfee00000u | apic_id << 12);
    mmio_write32(e + 4, 0);
    mmio_write32(e + 8, vector);
    mmio_write32(e + 12, 0); /* unmask */
}

int vnet_up(struct nic *n, int irq, u8 vector, u32 apic_id) {
    n->irq = irq;
    n->vector = vector;
    n->apic_id = apic_id;
    mmio_write8(cc(n, CC_STATUS), 0);
    while (mmio_read8(cc(n, CC_STATUS)))
        cpu_relax();
    mmio_write8(cc(n, CC_STATUS), S_ACK);
    mmio_write8(cc(n, CC_STATUS), S_ACK | S_DRIVER);
    mmio_write32(cc(n, CC_DFSELECT), 0);
    u64 dev = mmio_read32(cc(n, CC_DF));
    mmio_write32(cc(n, CC_DFSELECT), 1);
    dev |= (u64)mmio_read32(cc(n, CC_DF)) << 32;
    if (!(dev & F_VERSION_1)) {
        kprintf("net: nic %d: device does not offer VERSION_1\n", n->index);
        return -1;
    }
    /* EVENT_IDX only with interrupts: in poll mode the ring flags turn interrupts off. */
    u64 want = F_VERSION_1 | F_NET_MAC | F_NET_STATUS | (irq ? F_EVENT_IDX : 0);
    n->features = dev & want;
    n->event_idx = !!(n->features & F_EVENT_IDX);
    mmio_write32(cc(n, CC_GFSELECT), 0);
    mmio_write32(cc(n, CC_GF), (u32)n->features);
    mmio_write32(cc(n, CC_GFSELECT), 1);
    mmio_write32(cc(n, CC_GF), (u32)(n->features >> 32));
    mmio_write8(cc(n, CC_STATUS), S_ACK | S_DRIVER | S_FEATURES_OK);
    if (!(mmio_read8(cc(n, CC_STATUS)) & S_FEATURES_OK)) {
        kprintf("net: nic %d: device refused features %lx\n", n->index, n->features);
        mmio_write8(cc(n, CC_STATUS), S_FAILED);
        return -1;
    }
    if (n->features & F_NET_MAC) {
        u8 gen;
        do {
            gen = mmio_read8(cc(n, CC_GENERATION));
            for (int i = 0; i < 6; i++)
                n->mac[i] = mmio_read8(n->devcfg + (u64)i);
        } while (gen != mmio_read8(cc(n, CC_GENERATION)));
    } else {
        const u8 dflt[6] = {0x52, 0x54, 0x00, 0x12, 0x34, (u8)(0x56 + n->index)};
        memcpy(n->mac, dflt, 6);
    }
    /* MSI-X: entry 0 config changes, 1 RX, 2 TX (all on one vector; fewer entries: share 0). */
    u16 vcfg = NO_VECTOR, vrx = NO_VECTOR, vtx = NO_VECTOR;
    if (irq) {
        if (!n->msix_table) {
            kprintf("net: nic %d: no MSI-X capability (wait=poll works without)\n", n->index);
            return -1;
        }
        u32 entries = n->msix_size < 3 ? 1 : 3;
        for (u32 i = 0; i < entries; i++)
            msix_entry(n, i, apic_id, vector);
        vcfg = 0;
        vrx = entries == 3 ? 1 : 0;
        vtx = entries == 3 ? 2 : 0;
    }
    mmio_write16(cc(n, CC_MSIX_CONFIG), vcfg);
    if (mmio_read16(cc(n, CC_MSIX_CONFIG)) != vcfg) {
        kprintf("net: nic %d: device refused MSI-X entry %u for config changes\n", n->index, vcfg);
        return -1;
    }
    if (setup_queue(n, &n->rx, 0, vrx) || setup_queue(n, &n->tx, 1, vtx))
        return -1;
    /* RX: every buffer posted, device-writable. TX: never interrupt on completions (reclaimed
     * when buffers run short); RX interrupts are armed just before waiting (vnet_arm). */
    struct vq *rx = &n->rx;
    for (u16 i = 0; i < rx->size; i++) {
        rx->desc[i].flags = DESC_F_WRITE;
        rx->avail[2 + i] = i;
    }
    rx->nfree = 0;
    rx->avail_idx = rx->size;
    if (n->event_idx) {
        *used_event(&n->tx) = 0xffff;
        *used_event(rx) = 0xffff; /* armed by vnet_arm */
    } else {
        n->tx.avail[0] = AVAIL_F_NO_INTERRUPT;
        rx->avail[0] = irq ? 0 : AVAIL_F_NO_INTERRUPT;
    }
    barrier();
    rx->avail[1] = rx->avail_idx;
    mmio_write8(cc(n, CC_STATUS), S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
    if (mmio_read8(cc(n, CC_STATUS)) & (S_NEEDS_RESET | S_FAILED)) {
        kprintf("net: nic %d: device needs reset right after DRIVER_OK\n", n->index);
        return -1;
    }
    notify(rx);
    return 0;
}

int vnet_needs_reset(struct nic *n) { return !!(mmio_read8(cc(n, CC_STATUS)) & S_NEEDS_RESET); }

int vnet_rx_pending(struct nic *n) { return used_idx(&n->rx) != n->rx.last_used; }

void vnet_arm(struct nic *n) {
    if (n->event_idx)
        *used_event(&n->rx) = n->rx.last_used;
}

int vnet_poll(struct nic *n) {
    struct vq *q = &n->rx;
    u16 end = used_idx(q), old = q->avail_idx;
    int done = 0;
    barrier();
    while (q->last_used != end) {
        volatile struct vq_used_elem *e = used_elem(q, q->last_used);
        u32 id = e->id, len = e->len;
        if (id < q->size && len > NET_HDR && len <= NET_BUF) {
            n->rx_frames++;
            net_input(n, q->bufs + (u64)id * NET_BUF + NET_HDR, len - NET_HDR);
        } else {
            n->drops++;
        }
        if (id < q->size) {
            q->avail[2 + q->avail_idx % q->size] = (u16)id;
            q->avail_idx++;
        }
        q->last_used++;
        done++;
        if (q->last_used == end)
            end = used_idx(q);
    }
    if (done) {
        barrier();
        q->avail[1] = q->avail_idx;
        if (need_notify(n, q, old, q->avail_idx))
            notify(q);
    }
    return done;
}

void vnet_tx_reclaim(struct nic *n) {
    struct vq *q = &n->tx;
    u16 end = used_idx(q);
    barrier();
    while (q->last_used != end) {
        u32 id = used_elem(q, q->last_used)->id;
        if (id < q->size && q->nfree < q->size)
            q->free_ids[q->nfree++] = (u16)id;
        q->last_used++;
    }
    if (n->event_idx)
        *used_event(q) = (u16)(q->last_used - 1); /* keep TX completions silent */
}

u8 *vnet_tx_buf(struct nic *n, u16 *id) {
    struct vq *q = &n->tx;
    if (!q->nfree)
        vnet_tx_reclaim(n);
    while (!q->nfree) {
        cpu_relax();
        vnet_tx_reclaim(n);
    }
    *id = q->free_ids[--q->nfree];
    u8 *b = q->bufs + (u64)*id * NET_BUF;
    memset(b, 0, NET_HDR); /* no checksum offload, no GSO */
    return b + NET_HDR;
}

void vnet_tx_send(struct nic *n, u16 id, u32 frame_len) {
    struct vq *q = &n->tx;
    q->desc[id].len = NET_HDR + frame_len;
    q->desc[id].flags = 0;
    u16 old = q->avail_idx;
    q->avail[2 + q->avail_idx % q->size] = id;
    q->avail_idx++;
    barrier();
    q->avail[1] = q->avail_idx;
    n->tx_frames++;
    if (need_notify(n, q, old, q->avail_idx))
        notify(q);
}

void vnet_tx_drain(struct nic *n, u64 deadline) {
    vnet_tx_reclaim(n);
    while (n->tx.nfree < n->tx.size && (!deadline || rdtsc() < deadline)) {
        cpu_relax();
        vnet_tx_reclaim(n);
    }
}
