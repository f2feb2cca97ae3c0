/* kumo guest runtime: IDT, output, parameters, ring-3 entry. */
#include "kumo.h"
#include <stdarg.h>

__attribute__((aligned(16))) u8 kumo_kstacks[KUMO_MAX_CPUS][16384];
__attribute__((aligned(16))) static u8 kumo_ustacks[KUMO_MAX_CPUS][32768];
static struct kumo_boot_info *boot_info;

struct idt_gate { u16 off0, sel; u8 ist, type; u16 off1; u32 off2, zero; };
__attribute__((aligned(16))) static struct idt_gate idt[256];
static volatile u32 idt_ready;

struct exc_frame { u64 vec, err, rip, cs, rflags, rsp, ss; };

void kumo_set_gate(int vector, void (*handler)(void)) {
    u64 a = (u64)handler;
    idt[vector].off0 = (u16)a;
    idt[vector].sel = SEL_KCODE;
    idt[vector].ist = 0;
    idt[vector].type = 0x8e; /* present, DPL 0, 64-bit interrupt gate */
    idt[vector].off1 = (u16)(a >> 16);
    idt[vector].off2 = (u32)(a >> 32);
    idt[vector].zero = 0;
}

extern void kumo_timer_isr(void);
extern void kumo_exc0(void), kumo_exc1(void), kumo_exc2(void), kumo_exc3(void), kumo_exc4(void),
    kumo_exc5(void), kumo_exc6(void), kumo_exc7(void), kumo_exc8(void), kumo_exc9(void),
    kumo_exc10(void), kumo_exc11(void), kumo_exc12(void), kumo_exc13(void), kumo_exc14(void),
    kumo_exc15(void), kumo_exc16(void), kumo_exc17(void), kumo_exc18(void), kumo_exc19(void);
static void (*const exc_stubs[20])(void) = {
    kumo_exc0, kumo_exc1, kumo_exc2, kumo_exc3, kumo_exc4, kumo_exc5, kumo_exc6,
    kumo_exc7, kumo_exc8, kumo_exc9, kumo_exc10, kumo_exc11, kumo_exc12, kumo_exc13,
    kumo_exc14, kumo_exc15, kumo_exc16, kumo_exc17, kumo_exc18, kumo_exc19};

void kumo_start(struct kumo_boot_info *bi, u32 cpu) {
    struct { u16 limit; u64 base; } __attribute__((packed)) idtr = {sizeof(idt) - 1, (u64)idt};
    if (cpu == 0) {
        boot_info = bi;
        for (int v = 0; v < 20; v++)
            kumo_set_gate(v, exc_stubs[v]);
        kumo_set_gate(KUMO_TIMER_VECTOR, kumo_timer_isr);
        /* The elastic channel's wake-up (vector 0x31, guests/include/elastic.h): it only has to
         * end a hlt, as the timer's does; a guest that ignores the channel survives it. */
        kumo_set_gate(0x31, kumo_timer_isr);
        __atomic_store_n(&idt_ready, 1, __ATOMIC_RELEASE);
    } else {
        while (!__atomic_load_n(&idt_ready, __ATOMIC_ACQUIRE))
            cpu_relax();
    }
    __asm__ volatile("lidt %0" ::"m"(idtr));
    /* LAPIC on, timer in TSC-deadline mode: what kumo_idle_until sleeps on. */
    mmio_write32(bi->lapic_base + 0xf0, 0x1ff);
    mmio_write32(bi->lapic_base + 0x320, KUMO_TIMER_VECTOR | (2u << 17));
    /* TSS.rsp0: the stack the CPU switches to when an interrupt arrives in ring 3. */
    *(volatile u64 *)(bi->tss_base + cpu * bi->tss_stride + 4) = (u64)&kumo_kstacks[cpu + 1][0];
    if (bi->magic != KUMO_BOOT_MAGIC || bi->version != KUMO_BOOT_VERSION) {
        kputs("kumo: bad boot info\n");
        kumo_exit(0x7f);
    }
    kmain(bi, cpu);
    kumo_exit(0);
}

static const char *const exc_names[20] = {
    "#DE divide error", "#DB debug", "NMI", "#BP breakpoint", "#OF overflow", "#BR bound",
    "#UD invalid opcode", "#NM no FPU", "#DF double fault", "coprocessor overrun",
    "#TS invalid TSS", "#NP segment not present", "#SS stack fault", "#GP general protection",
    "#PF page fault", "reserved", "#MF x87 error", "#AC alignment check", "#MC machine check",
    "#XM SIMD error"};

void kumo_exception(struct exc_frame *f) {
    u64 cr2;
    __asm__ volatile("mov %%cr2, %0" : "=r"(cr2));
    kprintf("guest exception: %s (vector %lu) err=%lx rip=%lx cs=%lx rsp=%lx cr2=%lx\n",
            f->vec < 20 ? exc_names[f->vec] : "?", f->vec, f->err, f->rip, f->cs, f->rsp, cr2);
    kumo_exit(0x80 | (u32)f->vec);
}

extern void kumo_iret_to_user(u64 (*fn)(u64), u64 arg, u64 ustack);
extern void kumo_user_return(void);

void kumo_enter_user(u64 (*fn)(u64), u64 arg) {
    u32 cpu = 0;
    u64 rsp;
    __asm__ volatile("mov %%rsp, %0" : "=r"(rsp));
    cpu = (u32)((rsp - (u64)&kumo_kstacks[0][0]) / sizeof(kumo_kstacks[0]));
    u64 top = (u64)&kumo_ustacks[cpu + 1][0] - 8;
    *(u64 *)top = (u64)kumo_user_return; /* fn's return address */
    kumo_iret_to_user(fn, arg, top);
    __builtin_unreachable();
}

/* Read by the timer ISR (start.S): EOI by MSR once any vCPU is in x2APIC mode (kumo's guests
 * switch all their vCPUs or none). */
volatile u8 kumo_x2apic;

int kumo_enable_x2apic(void) {
    u32 a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c & (1u << 21)))
        return -1;
    u32 lo, hi;
    __asm__ volatile("rdmsr" : "=a"(lo), "=d"(hi) : "c"(0x1b));
    lo |= (1u << 10) | (1u << 11);
    __asm__ volatile("wrmsr" ::"c"(0x1b), "a"(lo), "d"(hi));
    __asm__ volatile("wrmsr" ::"c"(0x80f), "a"(0x1ff), "d"(0));
    kumo_x2apic = 1;
    return 0;
}

void kumo_idle_until(u64 tsc) {
    while (rdtsc() < tsc)
        __asm__ volatile("hlt" ::"a"((u32)tsc), "d"((u32)(tsc >> 32)), "S"(0UL) : "memory");
}

void kumo_wait_change(const volatile u32 *word, u32 seen, u64 tsc) {
    __asm__ volatile("hlt" ::"a"((u32)tsc), "d"((u32)(tsc >> 32)), "S"(word), "D"(seen) : "memory");
}

void kumo_exit(u32 code) {
    outl(KUMO_EXIT_PORT, code);
    for (;;)
        __asm__ volatile("");
}

void kputc(char c) { outb(COM1, (u8)c); }
void kputs(const char *s) { while (*s) kputc(*s++); }

static void put_unsigned(u64 v, unsigned base) {
    char buf[24];
    int i = 0;
    do {
        u64 d = v % base;
        buf[i++] = (char)(d < 10 ? '0' + d : 'a' + d - 10);
        v /= base;
    } while (v);
    while (i)
        kputc(buf[--i]);
}
void kput_u64(u64 v) { put_unsigned(v, 10); }
void kput_hex(u64 v) { kputs("0x"); put_unsigned(v, 16); }

void kprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    for (; *fmt; fmt++) {
        if (*fmt != '%') { kputc(*fmt); continue; }
        fmt++;
        int is_long = 0;
        if (*fmt == 'l') { is_long = 1; fmt++; }
        switch (*fmt) {
        case 's': kputs(va_arg(ap, const char *)); break;
        case 'c': kputc((char)va_arg(ap, int)); break;
        case 'u': put_unsigned(is_long ? va_arg(ap, u64) : va_arg(ap, u32), 10); break;
        case 'x': put_unsigned(is_long ? va_arg(ap, u64) : va_arg(ap, u32), 16); break;
        case 'd': {
            i64 v = is_long ? va_arg(ap, i64) : va_arg(ap, int);
            if (v < 0) { kputc('-'); v = -v; }
            put_unsigned((u64)v, 10);
            break;
        }
        case '%': kputc('%'); break;
        default: kputc('%'); kputc(*fmt); break;
        }
    }
    va_end(ap);
}

int kstreq(const char *a, const char *b) {
    while (*a && *a == *b) { a++; b++; }
    return *a == *b;
}

int kumo_param(const struct kumo_boot_info *bi, const char *key, char *out, int outlen) {
    const char *p = bi->cmdline;
    while (*p) {
        while (*p == ' ') p++;
        const char *k = key;
        while (*k && *p == *k) { p++; k++; }
        if (!*k && *p == '=') {
            p++;
            int n = 0;
            while (*p && *p != ' ' && n < outlen - 1) out[n++] = *p++;
            out[n] = 0;
            return 1;
        }
        while (*p && *p != ' ') p++;
    }
    return 0;
}

int kumo_param_u64(const struct kumo_boot_info *bi, const char *key, u64 *v) {
    char buf[32];
    if (!kumo_param(bi, key, buf, sizeof(buf)))
        return 0;
    u64 r = 0, base = 10;
    char *c = buf;
    if (c[0] == '0' && (c[1] == 'x' || c[1] == 'X')) { base = 16; c += 2; }
    if (!*c) return -1;
    for (; *c; c++) {
        u64 d;
        if (*c >= '0' && *c <= '9') d = (u64)(*c - '0');
        else if (base == 16 && *c >= 'a' && *c <= 'f') d = (u64)(*c - 'a' + 10);
        else if (base == 16 && *c >= 'A' && *c <= 'F') d = (u64)(*c - 'A' + 10);
        else return -1;
        r = r * base + d;
    }
    *v = r;
    return 1;
}
