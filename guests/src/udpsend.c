/* udpsend: a sequence-numbered UDP stream to a peer. Payload: bytes 0..8 the sequence number
 * (LE u64, from 0), 8..16 the total count (LE u64), then filler; the end marker has sequence
 * number u64::MAX and is sent 3 times. */
#include "net.h"

KUMO_MANIFEST("name=udpsend\n"
              "summary=Sends a sequence-numbered UDP stream (then an end marker 3 times) to a peer.\n"
              "max_cpus=64\n"
              "param=ip:ipv4:10.0.0.2:NIC 0's address\n"
              "param=peer:ipv4:10.0.0.1:receiver's address\n"
              "param=port:u64:9:receiver's UDP port\n"
              "param=count:u64:1000:datagrams to send (before the end marker)\n"
              "param=size:u64:1024:payload bytes (16..1472)\n"
              "param=gap_us:u64:0:pause between datagrams (0: as fast as possible)\n"
              NET_COMMON_PARAMS);

#define LOCAL_PORT 40009

static u64 peer, port, count, size, gap_us;
static u8 payload[1500];

static u64 run(struct net_ctx *c) {
    struct nic *n = c->nics[0];
    u8 mac[6];
    if (!net_resolve(c, n, (u32)peer, mac)) {
        kputs("udpsend: no ARP answer from the peer\n");
        return 3;
    }
    for (u64 i = 16; i < size; i++)
        payload[i] = (u8)i;
    memcpy(payload + 8, &count, 8);
    u64 gap = net_us_to_tsc(gap_us), next = rdtsc();
    for (u64 seq = 0; seq < count; seq++) {
        memcpy(payload, &seq, 8);
        if (gap) {
            while (rdtsc() < next)
                cpu_relax();
            next += gap;
        }
        net_send_udp(n, mac, (u32)peer, LOCAL_PORT, (u16)port, payload, (u32)size);
        if ((seq & 63) == 0)
            net_poll(c); /* ARP requests from the peer */
    }
    u64 end = ~0UL;
    memcpy(payload, &end, 8);
    for (int i = 0; i < 3; i++)
        net_send_udp(n, mac, (u32)peer, LOCAL_PORT, (u16)port, payload, (u32)size);
    vnet_tx_drain(n, rdtsc() + net_us_to_tsc(2000000));
    net_report_irqs(c);
    kprintf("udpsend: sent=%lu\n", count);
    return 0;
}

void kmain(struct kumo_boot_info *bi, u32 cpu) {
    if (cpu == 0) {
        net_bi = bi;
        net_prog = "udpsend";
        peer = net_param_ip("peer", 0x0a000001);
        port = net_param_u64("port", 9);
        count = net_param_u64("count", 1000);
        size = net_param_u64("size", 1024);
        gap_us = net_param_u64("gap_us", 0);
        if (!port || port > 65535) net_fail("port must be 1..65535");
        if (size < 16 || size > 1472) net_fail("size must be 16..1472");
    }
    net_kmain(bi, cpu, "udpsend", 0x0a000002, run);
}
