/* kumo guest runtime: the contract between kumo and its own freestanding guest programs.
 *
 * Entry: every vCPU starts at the ELF entry point in 64-bit mode, CPL 0, interrupts off, with
 *   rdi = &struct kumo_boot_info (guest physical == virtual), rsi = vCPU index (0 = BSP).
 * The VMM has set up: identity-mapped page tables (2 MiB pages, user-accessible) over all RAM and
 * the LAPIC window, a GDT (selectors below), and TR = the vCPU's own TSS.
 * Results: text lines on COM1 (0x3f8) and an exit code written to port 0x501.
 * Workloads run in ring 3 (kumo_enter_user): nested KVM emulates guest ring-0 code.
 */
#ifndef KUMO_H
#define KUMO_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;
typedef long i64;

#define KUMO_BOOT_MAGIC 0x544f4f424f4d554bUL /* "KUMOBOOT" */
#define KUMO_BOOT_VERSION 1

struct kumo_boot_info {
    u64 magic;
    u32 version;
    u32 ncpus;
    u64 mem_bytes;     /* RAM size */
    u64 tsc_khz;       /* TSC frequency, 0 if unknown */
    u64 free_start;    /* first free page after the loaded image */
    u64 free_end;      /* end of usable RAM below the MMIO gap */
    u64 tss_base;      /* TSS of vCPU i at tss_base + i * tss_stride */
    u64 tss_stride;
    u64 lapic_base;
    u64 elastic;       /* GPA of the elastic channel's mailbox (elastic.h), 0 if none */
    u64 reserved[5];
    char cmdline[3840]; /* "key=value key=value", NUL terminated */
};

#define SEL_KCODE 0x08
#define SEL_KDATA 0x10
#define SEL_UDATA 0x1b
#define SEL_UCODE 0x23

#define COM1 0x3f8
#define KUMO_EXIT_PORT 0x501
#define KUMO_MARKER_PORT 0x502
#define KUMO_MARKER_ENTRY 1

/* Manifest: name, summary and parameters, read by `kumo guests` from the ELF. Lines:
 *   name=NAME / summary=TEXT / param=KEY:TYPE:DEFAULT:HELP  (TYPE: u64, or a|b|c for a choice) */
#define KUMO_MANIFEST(text) \
    __attribute__((section(".kumo_manifest"), used)) static const char kumo_manifest[] = text

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u64 rdtsc(void) {
    u32 lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((u64)hi << 32) | lo;
}
static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }
static inline void mmio_write32(u64 addr, u32 v) { *(volatile u32 *)addr = v; }
static inline u32 mmio_read32(u64 addr) { return *(volatile u32 *)addr; }

/* Output (usable from ring 0 and ring 3: user code runs with IOPL 3). */
void kputc(char c);
void kputs(const char *s);
void kput_u64(u64 v);
void kput_hex(u64 v);
/* printf subset: %s %c %u %d %x %lu %ld %lx %% */
void kprintf(const char *fmt, ...);
__attribute__((noreturn)) void kumo_exit(u32 code);

/* Command line parameters. */
int kumo_param(const struct kumo_boot_info *bi, const char *key, char *out, int outlen);
/* Returns 1 and sets *v if key is present and numeric (decimal, or hex with 0x), 0 if absent,
 * -1 if malformed. */
int kumo_param_u64(const struct kumo_boot_info *bi, const char *key, u64 *v);
int kstreq(const char *a, const char *b);

/* Interrupts. */
void kumo_set_gate(int vector, void (*handler)(void));
static inline void sti(void) { __asm__ volatile("sti" ::: "memory"); }
static inline void cli(void) { __asm__ volatile("cli" ::: "memory"); }
/* Wait for an interrupt with interrupts enabled only while halted, then disable them again. */
static inline void sti_hlt_cli(void) { __asm__ volatile("sti; hlt; cli" ::: "memory"); }

/* Run fn(arg) in ring 3 on this vCPU's user stack; when fn returns, its value is the VM's exit
 * code. Never returns. */
__attribute__((noreturn)) void kumo_enter_user(u64 (*fn)(u64), u64 arg);

/* From ring 3: sleep (the vCPU halts, using no host CPU) until the TSC reaches `tsc`. Works by
 * a `hlt` that faults into the runtime, which arms the LAPIC TSC-deadline timer and halts. */
#define KUMO_TIMER_VECTOR 0x30
void kumo_idle_until(u64 tsc);
/* From ring 3: halt once until any interrupt arrives or the TSC reaches `tsc` (0: no deadline),
 * unless *word != seen already (word may be 0). The comparison is made with interrupts off, so
 * an interrupt handler that bumps *word between the caller's check and the halt is not missed. */
void kumo_wait_change(const volatile u32 *word, u32 seen, u64 tsc);

/* Ring 0, on each vCPU that wants it: switches this vCPU's LAPIC to x2APIC mode and software-
 * enables it; the runtime's timer interrupt then EOIs by MSR. Returns 0, or -1 if CPUID does not
 * offer x2APIC. */
int kumo_enable_x2apic(void);

/* Per-vCPU stacks, defined by the runtime. */
#define KUMO_MAX_CPUS 64

/* Each guest defines this; it runs on every vCPU in ring 0. */
void kmain(struct kumo_boot_info *bi, u32 cpu);

#endif
