/* netecho: answers ARP and ping, echoes UDP payloads back to the sender (guests/src/net/). */
#include "net.h"

KUMO_MANIFEST("name=netecho\n"
              "summary=Answers ARP and ping on virtio-net NIC 0 and echoes UDP datagrams back to their sender.\n"
              "max_cpus=64\n"
              "param=ip:ipv4:10.0.0.2:NIC 0's address\n"
              "param=port:u64:0:UDP port to echo (0: any)\n"
              "param=count:u64:0:exit after echoing this many UDP datagrams (0: never)\n"
              NET_COMMON_PARAMS);

static u64 port, count, echoed;

static void on_udp(struct nic *n, const u8 *src_mac, u32 src_ip, u16 sport, u16 dport, const u8 *p, u32 len) {
    if (port && dport != port)
        return;
    net_send_udp(n, src_mac, src_ip, dport, sport, p, len);
    echoed++;
}

static u64 run(struct net_ctx *c) {
    struct nic *n = c->nics[0];
    n->on_udp = on_udp;
    while (!count || echoed < count) {
        if (!net_poll(c))
            net_wait(c, 0);
    }
    vnet_tx_drain(n, rdtsc() + net_us_to_tsc(1000000));
    net_report_irqs(c);
    kprintf("netecho: echoed=%lu pings=%lu arps=%lu\n", echoed, n->pings, n->arps);
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu == 0) {
        net_bi = bi;
        net_prog = "netecho";
        port = net_param_u64("port", 0);
        count = net_param_u64("count", 0);
        if (port > 65535) net_fail("port must be 0..65535");
    }
    net_kmain(bi, cpu, "netecho", 0x0a000002, run);
}
