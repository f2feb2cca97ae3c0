/* kumo guest networking: PCI enumeration, a virtio-pci (1.x, modern) virtio-net driver with
 * MSI-X, and a minimal Ethernet/ARP/IPv4/ICMP/UDP stack, shared by netecho, udpping, udpsink
 * and udpsend (guests/src/net/). Relies only on the PCI and virtio specs, so the same driver
 * runs on kumo's NIC and on QEMU's virtio-net-pci.
 *
 * Split between rings (guest ring 0 is emulated on this nested KVM, ring 3 runs natively):
 *   ring 0 (vCPU 0, setup only): PCI config space through ports 0xCF8/0xCFC (the TSS I/O bitmap
 *     stops at port 0x600, so ring 3 cannot reach them), BARs, capabilities, MSI-X enable;
 *     interrupt handlers that only bump a wake counter, forward to the consumer vCPU by IPI if
 *     the VMM delivered elsewhere, and EOI;
 *   ring 3: virtio device setup (MMIO in the BARs), rings, buffers, the stack, the programs.
 */
#ifndef KUMO_NET_H
#define KUMO_NET_H
#include "kumo.h"

#define NET_MAX_NICS 4
#define NET_QSIZE_MAX 256
#define NET_BUF 2048 /* one frame + virtio_net_hdr: no mergeable buffers, no offloads */
#define NET_HDR 12   /* struct virtio_net_hdr with num_buffers (VERSION_1) */
#define NET_ARP_SLOTS 8

static inline void outw(u16 port, u16 v) { __asm__ volatile("outw %0, %1" ::"a"(v), "Nd"(port)); }
static inline u32 inl(u16 port) { u32 v; __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline void mb(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }
static inline u8 mmio_read8(u64 a) { return *(volatile u8 *)a; }
static inline u16 mmio_read16(u64 a) { return *(volatile u16 *)a; }
static inline void mmio_write8(u64 a, u8 v) { *(volatile u8 *)a = v; }
static inline void mmio_write16(u64 a, u16 v) { *(volatile u16 *)a = v; }

void *memcpy(void *d, const void *s, u64 n);
void *memset(void *d, int c, u64 n);

struct vq_desc { u64 addr; u32 len; u16 flags, next; };
struct vq_used_elem { u32 id, len; };

struct vq {
    u16 index, size;
    struct vq_desc *desc;
    volatile u16 *avail; /* flags, idx, ring[size], used_event */
    volatile u16 *used;  /* flags, idx, {u32 id, u32 len}[size], avail_event */
    u16 avail_idx, last_used;
    u64 notify;          /* address of this queue's notify register */
    u8 *bufs;            /* size * NET_BUF bytes, buffer i belongs to descriptor i */
    u16 nfree;
    u16 free_ids[NET_QSIZE_MAX];
};

struct arp_slot { u32 ip; u8 mac[6]; };

struct nic;
/* A UDP datagram for the program: payload points into the RX buffer (valid during the call). */
typedef void (*udp_handler)(struct nic *n, const u8 *src_mac, u32 src_ip, u16 sport, u16 dport,
                            const u8 *payload, u32 len);

struct nic {
    /* From the PCI scan (ring 0). */
    int index;
    u8 bus, slot, fn;
    u64 bar[6];
    u64 common, notify_base, isr, devcfg;
    u32 notify_mult;
    u64 msix_table;
    u32 msix_size;
    /* Driver state (ring 3). */
    u64 features;
    int event_idx, irq;
    u8 vector;
    u32 apic_id;
    u8 mac[6];
    u32 ip; /* host order */
    struct vq rx, tx;
    struct arp_slot arp[NET_ARP_SLOTS];
    udp_handler on_udp;
    u64 rx_frames, tx_frames, rx_udp, arps, pings, drops;
};

/* What the vCPU's ring-3 loop drives. */
struct net_ctx {
    u32 cpu;
    int irq;      /* wait for interrupts (else spin on the used rings) */
    int n;
    struct nic *nics[2];
};

/* Parameters every network program takes (see NET_COMMON_PARAMS). */
struct net_cfg {
    u32 ip, ip1;
    int irq;
    u32 cpu;
    u8 vector, vector1;
    int sink;
    int init_on_input;
    int stay;
};

#define NET_COMMON_PARAMS                                                                          \
    "param=wait:irq|poll:irq:irq = halt until the NIC's MSI-X interrupt, poll = spin on the used ring in ring 3\n" \
    "param=cpu:u64:0:vCPU whose ring-3 loop drives NIC 0 (its MSI-X entries target it)\n"         \
    "param=vector:u64:0xe0:interrupt vector of NIC 0's queues (a high priority class)\n"          \
    "param=sink:u64:0:1 = also drive NIC 1 as an interference sink on vCPU 0 (count and drop, answer ARP)\n" \
    "param=ip1:ipv4:10.0.2.2:NIC 1's address (with sink=1)\n"                                    \
    "param=init_on_input:u64:0:1 = initialise NIC 0's driver only when a byte arrives on the console (a NIC plugged in later)\n" \
    "param=stay:u64:0:1 = after the program's result stay up, idle, instead of ending the VM (a host reads the VMM's threads first)\n"

extern struct kumo_boot_info *net_bi;
extern struct nic net_nics[NET_MAX_NICS];
extern int net_nnics;
extern volatile u32 net_wake[KUMO_MAX_CPUS];
extern volatile u32 net_irqs[2];
extern volatile u32 net_forwarded;

/* boot.c: the common kmain. Parses the common parameters (ip from `ip`, default default_ip),
 * scans PCI, installs the handlers and runs app(ctx) in ring 3 on vCPU `cpu` with NIC 0 up;
 * app's return value is the exit code. vCPU 0 drives the sink NIC if asked. */
__attribute__((noreturn)) void net_kmain(struct kumo_boot_info *bi, u32 cpu, const char *prog,
                                         u32 default_ip, u64 (*app)(struct net_ctx *));
extern struct net_cfg net_cfg;
extern const char *net_prog;
/* Parameter helpers (exit 2 with a message on a malformed value). */
u64 net_param_u64(const char *key, u64 dflt);
u32 net_param_ip(const char *key, u32 dflt);
int net_parse_ip(const char *s, u32 *ip);
__attribute__((noreturn)) void net_fail(const char *msg);
/* Page-aligned, zeroed memory from boot_info's free range (exits if it runs out). */
void *net_alloc(u64 bytes);

/* pci.c (ring 0). */
u32 pci_read32(u8 bus, u8 slot, u8 fn, u8 off);
void pci_write32(u8 bus, u8 slot, u8 fn, u8 off, u32 v);
/* Finds virtio-net (1af4:1041) on bus 0 in slot order; enables memory, bus mastering, MSI-X. */
int pci_scan_virtio_net(struct nic *nics, int max);

/* virtio.c (ring 3). */
int vnet_up(struct nic *n, int irq, u8 vector, u32 apic_id);
int vnet_rx_pending(struct nic *n);
/* Processes every received frame (stack.c: net_input), reposts the buffers; returns how many. */
int vnet_poll(struct nic *n);
/* A TX buffer for a frame (after the virtio_net_hdr), reclaiming completed ones; spins if full. */
u8 *vnet_tx_buf(struct nic *n, u16 *id);
void vnet_tx_send(struct nic *n, u16 id, u32 frame_len);
void vnet_tx_reclaim(struct nic *n);
/* Waits until every sent frame has been used by the device (or the deadline passes). */
void vnet_tx_drain(struct nic *n, u64 deadline);
/* Re-enables used-buffer interrupts for RX (irq mode) before halting. */
void vnet_arm(struct nic *n);
int vnet_needs_reset(struct nic *n);

/* stack.c (ring 3). */
void net_input(struct nic *n, u8 *frame, u32 len);
void net_send_udp(struct nic *n, const u8 *dst_mac, u32 dst_ip, u16 sport, u16 dport,
                  const u8 *payload, u32 len);
/* MAC of ip on n's link: ARP with retries (5 x 200 ms, then 5 x 1 s). 0 if nobody answered. */
int net_resolve(struct net_ctx *c, struct nic *n, u32 ip, u8 *mac);
/* Processes every NIC of the context; returns the number of frames handled. */
int net_poll(struct net_ctx *c);
/* Waits until a frame is pending on one of the context's NICs or the TSC reaches deadline
 * (0: no deadline). Returns 1 if something is pending. */
int net_wait(struct net_ctx *c, u64 deadline);
u64 net_us_to_tsc(u64 us);
u64 net_tsc_to_us(u64 tsc);
void net_print_ip(u32 ip);
void net_print_up(struct nic *n);
/* `NAME: irqs nic0=N forwarded=F [sink_irqs=S sink_frames=K]`: interrupts taken for NIC 0, how
 * many of them arrived on another vCPU than NIC 0's consumer and were forwarded by IPI, and the
 * sink's figures. */
void net_report_irqs(struct net_ctx *c);
u16 net_csum(const void *data, u32 len, u32 sum);

#endif
