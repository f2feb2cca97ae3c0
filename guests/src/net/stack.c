/* A minimal stack per NIC, in ring 3: Ethernet, ARP (answers; resolves with retries), IPv4
 * (no fragments, header checksum checked and set), ICMP echo reply, UDP (checksum 0 on send,
 * any accepted). */
#include "net.h"

#define ETH_HLEN 14
#define ETH_ARP 0x0806
#define ETH_IP 0x0800
#define IP_HLEN 20
#define UDP_HLEN 8
#define UDP_MAX_PAYLOAD (1500 - IP_HLEN - UDP_HLEN)

static const u8 bcast[6] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

static u16 get16(const u8 *p) { return (u16)(p[0] << 8 | p[1]); }
static u32 get32(const u8 *p) { return (u32)p[0] << 24 | (u32)p[1] << 16 | (u32)p[2] << 8 | p[3]; }
static void put16(u8 *p, u16 v) { p[0] = (u8)(v >> 8); p[1] = (u8)v; }
static void put32(u8 *p, u32 v) { p[0] = (u8)(v >> 24); p[1] = (u8)(v >> 16); p[2] = (u8)(v >> 8); p[3] = (u8)v; }
static int mac_eq(const u8 *a, const u8 *b) {
    for (int i = 0; i < 6; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

u16 net_csum(const void *data, u32 len, u32 sum) {
    const u8 *p = data;
    for (; len > 1; len -= 2, p += 2)
        sum += (u32)(p[0] << 8 | p[1]);
    if (len)
        sum += (u32)p[0] << 8;
    while (sum >> 16)
        sum = (sum & 0xffff) + (sum >> 16);
    return (u16)~sum;
}

static void arp_learn(struct nic *n, u32 ip, const u8 *mac) {
    int slot = -1;
    for (int i = 0; i < NET_ARP_SLOTS; i++) {
        if (n->arp[i].ip == ip) { slot = i; break; }
        if (slot < 0 && !n->arp[i].ip) slot = i;
    }
    if (slot < 0) slot = (int)(ip % NET_ARP_SLOTS);
    n->arp[slot].ip = ip;
    memcpy(n->arp[slot].mac, mac, 6);
}

static int arp_lookup(struct nic *n, u32 ip, u8 *mac) {
    for (int i = 0; i < NET_ARP_SLOTS; i++)
        if (n->arp[i].ip == ip) {
            memcpy(mac, n->arp[i].mac, 6);
            return 1;
        }
    return 0;
}

static u8 *eth_start(struct nic *n, u16 *id, const u8 *dst, u16 type) {
    u8 *f = vnet_tx_buf(n, id);
    memcpy(f, dst, 6);
    memcpy(f + 6, n->mac, 6);
    put16(f + 12, type);
    return f;
}

/* Frames shorter than Ethernet's minimum are padded (with zeros) to 60 bytes. */
static void eth_send(struct nic *n, u16 id, u8 *f, u32 len) {
    if (len < 60) {
        memset(f + len, 0, 60 - len);
        len = 60;
    }
    vnet_tx_send(n, id, len);
}

static void arp_send(struct nic *n, u16 op, const u8 *dst_mac, const u8 *tha, u32 tpa) {
    u16 id;
    u8 *f = eth_start(n, &id, dst_mac, ETH_ARP);
    u8 *a = f + ETH_HLEN;
    put16(a, 1);
    put16(a + 2, ETH_IP);
    a[4] = 6;
    a[5] = 4;
    put16(a + 6, op);
    memcpy(a + 8, n->mac, 6);
    put32(a + 14, n->ip);
    memcpy(a + 18, tha, 6);
    put32(a + 24, tpa);
    eth_send(n, id, f, ETH_HLEN + 28);
}

static void arp_input(struct nic *n, const u8 *a, u32 len) {
    if (len < 28 || get16(a) != 1 || get16(a + 2) != ETH_IP || a[4] != 6 || a[5] != 4)
        return;
    u16 op = get16(a + 6);
    u32 spa = get32(a + 14), tpa = get32(a + 24);
    if (spa)
        arp_learn(n, spa, a + 8);
    if (op == 1 && tpa == n->ip) {
        n->arps++;
        arp_send(n, 2, a + 8, a + 8, spa);
    }
}

static void ip_header(struct nic *n, u8 *ip, u32 dst, u8 proto, u32 payload_len) {
    static u16 ident;
    ip[0] = 0x45;
    ip[1] = 0;
    put16(ip + 2, (u16)(IP_HLEN + payload_len));
    put16(ip + 4, ident++);
    put16(ip + 6, 0x4000); /* DF */
    ip[8] = 64;
    ip[9] = proto;
    put16(ip + 10, 0);
    put32(ip + 12, n->ip);
    put32(ip + 16, dst);
    put16(ip + 10, net_csum(ip, IP_HLEN, 0));
}

static void icmp_input(struct nic *n, const u8 *eth, const u8 *ip, const u8 *icmp, u32 len) {
    if (len < 8 || icmp[0] != 8) /* echo request */
        return;
    u16 id;
    u8 *f = eth_start(n, &id, eth + 6, ETH_IP);
    u8 *rip = f + ETH_HLEN, *r = rip + IP_HLEN;
    if (len > 1500 - IP_HLEN)
        len = 1500 - IP_HLEN;
    memcpy(r, icmp, len);
    r[0] = 0;
    put16(r + 2, 0);
    put16(r + 2, net_csum(r, len, 0));
    ip_header(n, rip, get32(ip + 12), 1, len);
    n->pings++;
    eth_send(n, id, f, ETH_HLEN + IP_HLEN + len);
}

static void ip_input(struct nic *n, const u8 *eth, const u8 *ip, u32 len) {
    if (len < IP_HLEN || (ip[0] >> 4) != 4)
        return;
    u32 hl = (ip[0] & 0xf) * 4u, tot = get16(ip + 2);
    if (hl < IP_HLEN || tot < hl || tot > len || net_csum(ip, hl, 0) != 0)
        return;
    if (get16(ip + 6) & 0x3fff) /* a fragment: not handled */
        return;
    u32 dst = get32(ip + 16);
    if (dst != n->ip && dst != 0xffffffffu)
        return;
    const u8 *p = ip + hl;
    u32 plen = tot - hl;
    if (ip[9] == 1 && dst == n->ip) {
        icmp_input(n, eth, ip, p, plen);
    } else if (ip[9] == 17 && plen >= UDP_HLEN) {
        u32 ulen = get16(p + 4);
        if (ulen < UDP_HLEN || ulen > plen)
            return;
        n->rx_udp++;
        if (n->on_udp)
            n->on_udp(n, eth + 6, get32(ip + 12), get16(p), get16(p + 2), p + UDP_HLEN, ulen - UDP_HLEN);
    }
}

void net_input(struct nic *n, u8 *f, u32 len) {
    if (len < ETH_HLEN || (!mac_eq(f, n->mac) && !mac_eq(f, bcast)))
        return;
    u16 type = get16(f + 12);
    if (type == ETH_ARP)
        arp_input(n, f + ETH_HLEN, len - ETH_HLEN);
    else if (type == ETH_IP)
        ip_input(n, f, f + ETH_HLEN, len - ETH_HLEN);
}

void net_send_udp(struct nic *n, const u8 *dst_mac, u32 dst_ip, u16 sport, u16 dport,
                  const u8 *payload, u32 len) {
    if (len > UDP_MAX_PAYLOAD)
        len = UDP_MAX_PAYLOAD;
    u16 id;
    u8 *f = eth_start(n, &id, dst_mac, ETH_IP);
    u8 *ip = f + ETH_HLEN, *u = ip + IP_HLEN;
    put16(u, sport);
    put16(u + 2, dport);
    put16(u + 4, (u16)(UDP_HLEN + len));
    put16(u + 6, 0);
    memcpy(u + UDP_HLEN, payload, len);
    ip_header(n, ip, dst_ip, 17, UDP_HLEN + len);
    eth_send(n, id, f, ETH_HLEN + IP_HLEN + UDP_HLEN + len);
}

int net_poll(struct net_ctx *c) {
    int done = 0;
    for (int i = 0; i < c->n; i++)
        done += vnet_poll(c->nics[i]);
    return done;
}

static int pending(struct net_ctx *c) {
    for (int i = 0; i < c->n; i++)
        if (vnet_rx_pending(c->nics[i]))
            return 1;
    return 0;
}

/* A device that hit an error sets DEVICE_NEEDS_RESET (and raises a config interrupt): report
 * it and stop. Reading the status is an exit, so it is checked only when a wait ends without
 * a frame. */
static void check_reset(struct net_ctx *c) {
    for (int i = 0; i < c->n; i++)
        if (vnet_needs_reset(c->nics[i])) {
            kprintf("%s: nic %d: device needs reset (DEVICE_NEEDS_RESET)\n", net_prog, c->nics[i]->index);
            kumo_exit(4);
        }
}

int net_wait(struct net_ctx *c, u64 deadline) {
    if (!c->irq) {
        for (u64 spins = 1; !pending(c); spins++) {
            if (deadline && rdtsc() >= deadline) {
                check_reset(c);
                return 0;
            }
            if (!(spins & 0xfffff))
                check_reset(c);
            cpu_relax();
        }
        return 1;
    }
    for (;;) {
        u32 seen = net_wake[c->cpu];
        for (int i = 0; i < c->n; i++)
            vnet_arm(c->nics[i]);
        mb(); /* used_event written before the used index is read again */
        if (pending(c))
            return 1;
        if (deadline && rdtsc() >= deadline) {
            check_reset(c);
            return 0;
        }
        /* Halts unless an interrupt came since `seen` was read (checked with interrupts off). */
        kumo_wait_change(&net_wake[c->cpu], seen, deadline);
        if (!pending(c))
            check_reset(c); /* a timer, a config change or a stray interrupt */
    }
}

int net_resolve(struct net_ctx *c, struct nic *n, u32 ip, u8 *mac) {
    static const u8 zero[6];
    for (int attempt = 0; attempt < 10; attempt++) {
        if (arp_lookup(n, ip, mac))
            return 1;
        arp_send(n, 1, bcast, zero, ip);
        u64 deadline = rdtsc() + net_us_to_tsc(attempt < 5 ? 200000 : 1000000);
        while (rdtsc() < deadline) {
            net_wait(c, deadline);
            net_poll(c);
            if (arp_lookup(n, ip, mac))
                return 1;
        }
    }
    return 0;
}

static u64 khz(void) { return net_bi->tsc_khz ? net_bi->tsc_khz : 1000000; }
u64 net_us_to_tsc(u64 us) { return us * khz() / 1000; }
u64 net_tsc_to_us(u64 tsc) { return tsc * 1000 / khz(); }

void net_print_ip(u32 ip) { kprintf("%u.%u.%u.%u", ip >> 24, (ip >> 16) & 255, (ip >> 8) & 255, ip & 255); }

void net_report_irqs(struct net_ctx *c) {
    (void)c;
    kprintf("%s: irqs nic0=%u forwarded=%u", net_prog, net_irqs[0], net_forwarded);
    if (net_cfg.sink && net_nnics > 1)
        kprintf(" sink_irqs=%u sink_frames=%lu", net_irqs[1], net_nics[1].rx_frames);
    kputs("\n");
}

void net_print_up(struct nic *n) {
    kprintf("%s: up nic=%d mac=", net_prog, n->index);
    for (int i = 0; i < 6; i++) {
        const char *hex = "0123456789abcdef";
        kprintf("%s%c%c", i ? ":" : "", hex[n->mac[i] >> 4], hex[n->mac[i] & 15]);
    }
    kputs(" ip=");
    net_print_ip(n->ip);
    kputs("\n");
}
