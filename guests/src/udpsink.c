/* udpsink: receives a sequence-numbered UDP stream (udpsend's format) and reports received,
 * lost, reordered and duplicate datagrams. */
#include "net.h"

KUMO_MANIFEST("name=udpsink\n"
              "summary=Receives a sequence-numbered UDP stream and reports received, lost, reordered and duplicate datagrams.\n"
              "max_cpus=64\n"
              "param=ip:ipv4:10.0.0.2:NIC 0's address\n"
              "param=port:u64:9:UDP port to listen on\n"
              "param=count:u64:0:stop after this many datagrams (0: at the end marker only)\n"
              "param=until_input:u64:0:1 = also stop when a byte arrives on the serial console (looked at every 10 ms)\n"
              NET_COMMON_PARAMS);

#define MAX_SEQ (1UL << 24) /* sequence numbers tracked for duplicates: a 2 MiB bitmap */

static u64 port, count, until_input;
static u64 received, reordered, dup, total, highest, done, seen_bits;
static int any;
static u8 *seen;

static void on_udp(struct nic *n, const u8 *src_mac, u32 src_ip, u16 sport, u16 dport, const u8 *p, u32 len) {
    (void)n; (void)src_mac; (void)src_ip; (void)sport;
    u64 seq, tot;
    if (dport != port || len < 16 || done)
        return;
    memcpy(&seq, p, 8);
    memcpy(&tot, p + 8, 8);
    if (seq == ~0UL) {
        if (tot > total) total = tot;
        done = 1;
        return;
    }
    if (!seen) {
        seen_bits = tot > count ? tot : count;
        if (seen_bits > MAX_SEQ) seen_bits = MAX_SEQ;
        seen = net_alloc(seen_bits / 8 + 1);
    }
    if (tot > total) total = tot;
    if (seq < seen_bits) {
        if (seen[seq / 8] & (1u << (seq % 8))) {
            dup++;
            return;
        }
        seen[seq / 8] |= (u8)(1u << (seq % 8));
    }
    received++;
    if (any && seq < highest)
        reordered++;
    if (!any || seq > highest)
        highest = seq;
    any = 1;
    if (count && received >= count)
        done = 1;
}

static u64 run(struct net_ctx *c) {
    struct nic *n = c->nics[0];
    n->on_udp = on_udp;
    u64 tick = net_bi->tsc_khz ? net_bi->tsc_khz * 10 : 10000000; /* 10 ms */
    while (!done) {
        if (!net_poll(c))
            net_wait(c, until_input ? rdtsc() + tick : 0);
        if (until_input && (inb(COM1 + 5) & 1)) { /* LSR: data ready */
            (void)inb(COM1);
            done = 1;
        }
    }
    u64 expect = total > received ? total : received;
    net_report_irqs(c);
    kprintf("udpsink: received=%lu lost=%lu reordered=%lu dup=%lu\n", received, expect - received, reordered, dup);
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu == 0) {
        net_bi = bi;
        net_prog = "udpsink";
        port = net_param_u64("port", 9);
        count = net_param_u64("count", 0);
        until_input = net_param_u64("until_input", 0);
        if (!port || port > 65535) net_fail("port must be 1..65535");
    }
    net_kmain(bi, cpu, "udpsink", 0x0a000002, run);
}
