/* udpping: UDP request/response round trips to a peer (the host, or a VM running netecho),
 * timed on the TSC; reports p50/p99. */
#include "net.h"

KUMO_MANIFEST("name=udpping\n"
              "summary=Sends UDP requests to a peer's echo service and reports round-trip times (p50, p99) from the TSC.\n"
              "max_cpus=64\n"
              "param=ip:ipv4:10.0.0.2:NIC 0's address\n"
              "param=peer:ipv4:10.0.0.1:address of the echo service\n"
              "param=port:u64:7:its UDP port\n"
              "param=count:u64:1000:round trips\n"
              "param=size:u64:64:payload bytes (8..1472)\n"
              "param=timeout_ms:u64:1000:a reply later than this counts as lost\n"
              NET_COMMON_PARAMS);

#define MAX_COUNT 1000000
#define LOCAL_PORT 40007

static u64 peer, port, count, size, timeout_ms;
static u64 seq;
static volatile int got;
static u8 payload[1500];

static void on_udp(struct nic *n, const u8 *src_mac, u32 src_ip, u16 sport, u16 dport, const u8 *p, u32 len) {
    (void)n; (void)src_mac;
    u64 s;
    if (src_ip != peer || sport != port || dport != LOCAL_PORT || len != size)
        return;
    memcpy(&s, p, 8);
    if (s == seq)
        got = 1;
}

static void sort(u64 *a, u64 n) {
    for (u64 gap = n / 2; gap; gap /= 2)
        for (u64 i = gap; i < n; i++)
            for (u64 j = i; j >= gap && a[j - gap] > a[j]; j -= gap) {
                u64 t = a[j]; a[j] = a[j - gap]; a[j - gap] = t;
            }
}

static u64 run(struct net_ctx *c) {
    struct nic *n = c->nics[0];
    n->on_udp = on_udp;
    u8 mac[6];
    if (!net_resolve(c, n, (u32)peer, mac)) {
        kputs("udpping: no ARP answer from the peer\n");
        return 3;
    }
    u64 *rtt = net_alloc(count * 8), ok = 0, timeout = net_us_to_tsc(timeout_ms * 1000);
    for (u64 i = 0; i < size; i++)
        payload[i] = (u8)i;
    for (seq = 0; seq < count; seq++) {
        memcpy(payload, &seq, 8);
        got = 0;
        u64 t0 = rdtsc(), deadline = t0 + timeout;
        net_send_udp(n, mac, (u32)peer, LOCAL_PORT, (u16)port, payload, (u32)size);
        while (!got) {
            if (!net_poll(c) && !got && !net_wait(c, deadline))
                break;
        }
        if (got)
            rtt[ok++] = rdtsc() - t0;
        vnet_tx_reclaim(n);
    }
    u64 lost = count - ok;
    sort(rtt, ok);
    u64 p50 = ok ? net_tsc_to_us(rtt[ok / 2]) : 0, p99 = ok ? net_tsc_to_us(rtt[ok * 99 / 100]) : 0;
    u64 mn = ok ? net_tsc_to_us(rtt[0]) : 0, mx = ok ? net_tsc_to_us(rtt[ok - 1]) : 0;
    net_report_irqs(c);
    kprintf("udpping: count=%lu lost=%lu p50_us=%lu p99_us=%lu min_us=%lu max_us=%lu\n", count, lost, p50, p99, mn, mx);
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu == 0) {
        net_bi = bi;
        net_prog = "udpping";
        peer = net_param_ip("peer", 0x0a000001);
        port = net_param_u64("port", 7);
        count = net_param_u64("count", 1000);
        size = net_param_u64("size", 64);
        timeout_ms = net_param_u64("timeout_ms", 1000);
        if (!port || port > 65535) net_fail("port must be 1..65535");
        if (!count || count > MAX_COUNT) net_fail("count must be 1..1000000");
        if (size < 8 || size > 1472) net_fail("size must be 8..1472");
        if (!timeout_ms) net_fail("timeout_ms must be at least 1");
    }
    net_kmain(bi, cpu, "udpping", 0x0a000002, run);
}
