/* The common kmain of the network programs: parameters, PCI scan and interrupt handlers in
 * ring 0 on vCPU 0, then every vCPU's role in ring 3 (NIC 0's consumer, the sink, or idle). */
#include "net.h"

struct kumo_boot_info *net_bi;
struct nic net_nics[NET_MAX_NICS];
int net_nnics;
struct net_cfg net_cfg;
const char *net_prog;
/* Per vCPU: bumped by the NIC interrupt handlers; ring 3 halts until it changes. */
volatile u32 net_wake[KUMO_MAX_CPUS];
volatile u32 net_irqs[2];      /* interrupts taken for NIC 0 / the sink NIC */
volatile u32 net_forwarded;    /* NIC 0 interrupts that arrived elsewhere and were forwarded */
/* Read by the handlers (assembly below). */
u64 net_lapic;
u32 net_isr_cpu0, net_isr_apic0, net_isr_icr0;

static u64 (*app_fn)(struct net_ctx *);
static volatile u32 setup_done;
static u64 alloc_next, alloc_end;

/* NIC 0's vector. Runs on whichever vCPU the VMM delivered to: if that is not the consumer,
 * forward with a fixed IPI of the same vector (as a guest kernel forwards an event). Every
 * instruction is emulated here (~2 us each): kept to the minimum. */
extern void net_isr0(void), net_isr1(void);
__asm__(".text\n"
        ".globl net_isr0\n"
        "net_isr0:\n"
        "  pushq %rax\n"
        "  pushq %rdx\n"
        "  movl net_isr_cpu0(%rip), %eax\n"
        "  leaq net_wake(%rip), %rdx\n"
        "  lock incl (%rdx,%rax,4)\n"
        "  lock incl net_irqs(%rip)\n"
        "  movq net_lapic(%rip), %rdx\n"
        "  movl 0x20(%rdx), %eax\n"          /* LAPIC ID */
        "  shrl $24, %eax\n"
        "  cmpl net_isr_apic0(%rip), %eax\n"
        "  je 1f\n"
        "  movl net_isr_apic0(%rip), %eax\n"
        "  shll $24, %eax\n"
        "  movl %eax, 0x310(%rdx)\n"         /* ICR high: the consumer */
        "  movl net_isr_icr0(%rip), %eax\n"
        "  movl %eax, 0x300(%rdx)\n"         /* ICR low: fixed, assert, vector */
        "  lock incl net_forwarded(%rip)\n"
        "1:\n"
        "  movl $0, 0xb0(%rdx)\n"            /* EOI */
        "  popq %rdx\n"
        "  popq %rax\n"
        "  iretq\n"
        /* The sink NIC's vector: always vCPU 0's loop. */
        ".globl net_isr1\n"
        "net_isr1:\n"
        "  pushq %rax\n"
        "  lock incl net_wake(%rip)\n"
        "  lock incl net_irqs+4(%rip)\n"
        "  movq net_lapic(%rip), %rax\n"
        "  movl $0, 0xb0(%rax)\n"
        "  popq %rax\n"
        "  iretq\n");

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

void net_fail(const char *msg) {
    kprintf("%s: %s\n", net_prog, msg);
    kumo_exit(2);
}

/* Page-aligned, zeroed memory from boot_info's free range (any vCPU). */
void *net_alloc(u64 bytes) {
    bytes = (bytes + 4095) & ~4095UL;
    u64 a = __atomic_fetch_add(&alloc_next, bytes, __ATOMIC_RELAXED);
    if (a + bytes > alloc_end) {
        kprintf("%s: out of memory for rings and buffers (free %lx..%lx)\n", net_prog, net_bi->free_start,
                net_bi->free_end);
        kumo_exit(3);
    }
    return memset((void *)a, 0, bytes);
}

u64 net_param_u64(const char *key, u64 dflt) {
    u64 v = dflt;
    if (kumo_param_u64(net_bi, key, &v) < 0) {
        kprintf("%s: bad value for %s (want a number)\n", net_prog, key);
        kumo_exit(2);
    }
    return v;
}

int net_parse_ip(const char *s, u32 *ip) {
    u32 r = 0;
    for (int part = 0; part < 4; part++) {
        u32 v = 0;
        int digits = 0;
        while (*s >= '0' && *s <= '9' && digits < 4) {
            v = v * 10 + (u32)(*s++ - '0');
            digits++;
        }
        if (!digits || v > 255 || *s != (part == 3 ? 0 : '.'))
            return -1;
        if (part < 3) s++;
        r = r << 8 | v;
    }
    *ip = r;
    return 0;
}

u32 net_param_ip(const char *key, u32 dflt) {
    char buf[32];
    u32 ip = dflt;
    if (kumo_param(net_bi, key, buf, sizeof(buf)) && net_parse_ip(buf, &ip) < 0) {
        kprintf("%s: bad value for %s (want an IPv4 address a.b.c.d)\n", net_prog, key);
        kumo_exit(2);
    }
    return ip;
}

static void parse_common(u32 default_ip) {
    char buf[16];
    net_cfg.ip = net_param_ip("ip", default_ip);
    net_cfg.ip1 = net_param_ip("ip1", 0x0a000202);
    net_cfg.irq = 1;
    if (kumo_param(net_bi, "wait", buf, sizeof(buf))) {
        if (kstreq(buf, "poll")) net_cfg.irq = 0;
        else if (!kstreq(buf, "irq")) net_fail("wait is irq or poll");
    }
    u64 cpu = net_param_u64("cpu", 0), vector = net_param_u64("vector", 0xe0);
    net_cfg.sink = net_param_u64("sink", 0) != 0;
    net_cfg.init_on_input = net_param_u64("init_on_input", 0) != 0;
    net_cfg.stay = net_param_u64("stay", 0) != 0;
    if (cpu >= net_bi->ncpus || cpu >= KUMO_MAX_CPUS) {
        kprintf("%s: cpu=%lu but the VM has %u vCPUs\n", net_prog, cpu, net_bi->ncpus);
        kumo_exit(2);
    }
    if (vector < 0x40 || vector > 0xfe)
        net_fail("vector must be 0x40..0xfe");
    net_cfg.cpu = (u32)cpu;
    net_cfg.vector = (u8)vector;
    /* The sink's vectors: a lower priority class than NIC 0's. */
    net_cfg.vector1 = 0x50;
}

static void bring_up(struct net_ctx *c, struct nic *n, int irq, u8 vector, u32 apic) {
    if (vnet_up(n, irq, vector, apic) < 0) {
        kprintf("%s: nic %d did not come up\n", net_prog, n->index);
        kumo_exit(3);
    }
    c->nics[c->n++] = n;
    net_print_up(n);
}

static u32 apic_ids[KUMO_MAX_CPUS];
static volatile u32 sink_up;

/* Ring 3, every vCPU. */
static u64 role(u64 cpu) {
    while (!__atomic_load_n(&setup_done, __ATOMIC_ACQUIRE))
        cpu_relax();
    struct net_ctx c = {.cpu = (u32)cpu, .irq = net_cfg.irq};
    int sink = net_cfg.sink && net_nnics > 1;
    if (sink)
        net_nics[1].ip = net_cfg.ip1;
    if (cpu == net_cfg.cpu) {
        /* The sink on vCPU 0 comes up first: after that only this vCPU prints (lines from two
         * vCPUs would interleave character by character). */
        while (sink && cpu != 0 && !__atomic_load_n(&sink_up, __ATOMIC_ACQUIRE))
            cpu_relax();
        u32 id = apic_ids[cpu];
        net_isr_apic0 = id;
        net_nics[0].ip = net_cfg.ip;
        if (net_cfg.init_on_input) {
            /* The baseline of a handover: the driver starts from scratch (reset, features,
             * queues, DRIVER_OK) only now. Spins in ring 3 on the UART's data-ready bit. */
            kprintf("%s: nic 0 waits for console input\n", net_prog);
            while (!(inb(COM1 + 5) & 1))
                cpu_relax();
            (void)inb(COM1);
        }
        bring_up(&c, &net_nics[0], net_cfg.irq, net_cfg.vector, id);
        if (sink && cpu == 0)
            bring_up(&c, &net_nics[1], 1, net_cfg.vector1, id);
        u64 rc = app_fn(&c);
        if (!net_cfg.stay)
            return rc;
        /* The VM's end would take the VMM's I/O threads (and their CPU time) with it. */
        kprintf("%s: finished rc=%lu, staying up\n", net_prog, rc);
        for (;;)
            kumo_wait_change(0, 0, 0);
    }
    if (cpu == 0 && sink) {
        c.irq = 1;
        bring_up(&c, &net_nics[1], 1, net_cfg.vector1, apic_ids[0]);
        __atomic_store_n(&sink_up, 1, __ATOMIC_RELEASE);
        for (;;) {
            net_poll(&c);
            net_wait(&c, 0);
        }
    }
    /* Idle (vCPU 0 still forwards NIC 0's interrupts from here if the VMM delivers them). */
    for (;;)
        kumo_wait_change(0, 0, 0);
}

void net_kmain(struct kumo_boot_info *bi, u32 cpu, const char *prog, u32 default_ip,
               u64 (*app)(struct net_ctx *)) {
    if (cpu == 0) {
        net_bi = bi;
        net_prog = prog;
        app_fn = app;
        net_lapic = bi->lapic_base;
        alloc_next = bi->free_start;
        alloc_end = bi->free_end;
        parse_common(default_ip);
        net_nnics = pci_scan_virtio_net(net_nics, NET_MAX_NICS);
        if (!net_nnics)
            net_fail("no virtio-net device (1af4:1041) on PCI bus 0");
        net_isr_cpu0 = net_cfg.cpu;
        net_isr_icr0 = 0x4000u | net_cfg.vector;
        kumo_set_gate(net_cfg.vector, net_isr0);
        if (net_cfg.sink)
            kumo_set_gate(net_cfg.vector1, net_isr1);
        __atomic_store_n(&setup_done, 1, __ATOMIC_RELEASE);
    }
    apic_ids[cpu] = mmio_read32(bi->lapic_base + 0x20) >> 24;
    kumo_enter_user(role, cpu);
}
