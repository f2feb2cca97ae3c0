/* PCI enumeration on bus 0 through configuration mechanism #1 (ring 0 only: ports 0xCF8/0xCFC
 * lie beyond the TSS I/O bitmap). Finds virtio-net modern devices, reads the BARs the firmware
 * or VMM placed, walks the capabilities for the virtio structures and MSI-X. */
#include "net.h"

#define PCI_ADDR 0xcf8
#define PCI_DATA 0xcfc
#define CAP_VENDOR 0x09
#define CAP_MSIX 0x11
#define VIRTIO_CAP_COMMON 1
#define VIRTIO_CAP_NOTIFY 2
#define VIRTIO_CAP_ISR 3
#define VIRTIO_CAP_DEVICE 4

static u32 addr(u8 bus, u8 slot, u8 fn, u8 off) {
    return 0x80000000u | (u32)bus << 16 | (u32)slot << 11 | (u32)fn << 8 | (off & 0xfc);
}

u32 pci_read32(u8 bus, u8 slot, u8 fn, u8 off) {
    outl(PCI_ADDR, addr(bus, slot, fn, off));
    return inl(PCI_DATA);
}

void pci_write32(u8 bus, u8 slot, u8 fn, u8 off, u32 v) {
    outl(PCI_ADDR, addr(bus, slot, fn, off));
    outl(PCI_DATA, v);
}

static u8 read8(u8 bus, u8 slot, u8 fn, u8 off) {
    return (u8)(pci_read32(bus, slot, fn, off) >> ((off & 3) * 8));
}

/* BARs: 64-bit memory BARs take two registers (the upper one is left 0 here). */
static void read_bars(struct nic *n) {
    for (int i = 0; i < 6; i++) {
        u32 v = pci_read32(n->bus, n->slot, n->fn, (u8)(0x10 + 4 * i));
        if (v & 1) { /* I/O space */
            n->bar[i] = 0;
            continue;
        }
        u64 base = v & ~0xfUL;
        if (((v >> 1) & 3) == 2 && i < 5) {
            base |= (u64)pci_read32(n->bus, n->slot, n->fn, (u8)(0x10 + 4 * (i + 1))) << 32;
            n->bar[i] = base;
            n->bar[++i] = 0;
            continue;
        }
        n->bar[i] = base;
    }
}

/* Returns 0, or a message saying what is missing. */
static const char *read_caps(struct nic *n) {
    u8 b = n->bus, s = n->slot, f = n->fn;
    if (!(pci_read32(b, s, f, 0x04) & (1u << 20)))
        return "no capability list";
    u8 off = read8(b, s, f, 0x34) & 0xfc;
    for (int guard = 0; off && guard < 48; guard++) {
        u32 h = pci_read32(b, s, f, off);
        u8 id = (u8)h, next = (u8)(h >> 8) & 0xfc;
        if (id == CAP_VENDOR) {
            u8 type = (u8)(h >> 24);
            u8 bar = read8(b, s, f, (u8)(off + 4));
            u32 o = pci_read32(b, s, f, (u8)(off + 8));
            u64 a = bar < 6 && n->bar[bar] ? n->bar[bar] + o : 0;
            if (type == VIRTIO_CAP_COMMON && !n->common) n->common = a;
            if (type == VIRTIO_CAP_ISR && !n->isr) n->isr = a;
            if (type == VIRTIO_CAP_DEVICE && !n->devcfg) n->devcfg = a;
            if (type == VIRTIO_CAP_NOTIFY && !n->notify_base) {
                n->notify_base = a;
                n->notify_mult = pci_read32(b, s, f, (u8)(off + 16));
            }
        } else if (id == CAP_MSIX && !n->msix_table) {
            u32 ctrl = h >> 16, t = pci_read32(b, s, f, (u8)(off + 4));
            u8 bir = t & 7;
            if (bir < 6 && n->bar[bir]) {
                n->msix_table = n->bar[bir] + (t & ~7u);
                n->msix_size = (ctrl & 0x7ff) + 1;
                /* Enable, function mask off; the entries stay masked until programmed. */
                pci_write32(b, s, f, off, (h & 0xffff) | ((ctrl | 0x8000u) & ~0x4000u) << 16);
            }
        }
        off = next;
    }
    if (!n->common || !n->notify_base || !n->devcfg)
        return "virtio capabilities missing (common, notify or device config)";
    if (n->common >> 32 || n->notify_base >> 32 || n->devcfg >> 32 || n->msix_table >> 32)
        return "a BAR lies above 4 GiB, beyond the identity map";
    return 0;
}

int pci_scan_virtio_net(struct nic *nics, int max) {
    int found = 0;
    for (u8 slot = 0; slot < 32 && found < max; slot++) {
        for (u8 fn = 0; fn < 8 && found < max; fn++) {
            u32 id = pci_read32(0, slot, fn, 0);
            if ((id & 0xffff) == 0xffff) {
                if (fn == 0) break;
                continue;
            }
            if (id == 0x10411af4) {
                struct nic *n = &nics[found];
                n->index = found;
                n->bus = 0;
                n->slot = slot;
                n->fn = fn;
                read_bars(n);
                /* Memory decoding and bus mastering (DMA); status bits written as 0 are kept. */
                u32 cmd = pci_read32(0, slot, fn, 0x04) & 0xffff;
                pci_write32(0, slot, fn, 0x04, cmd | 0x6);
                const char *why = read_caps(n);
                if (why) {
                    kprintf("net: virtio-net at 00:%x.%u: %s\n", slot, fn, why);
                    kumo_exit(3);
                }
                found++;
            }
            /* Other functions only on multi-function devices. */
            if (fn == 0 && !((pci_read32(0, slot, 0, 0x0c) >> 16) & 0x80))
                break;
        }
    }
    return found;
}
