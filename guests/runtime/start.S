/* Entry of every vCPU: rdi = boot info, rsi = vCPU index. Sets up this vCPU's kernel stack and
 * calls kumo_start(bi, cpu). Kept tiny: each ring-0 instruction is emulated on nested KVM. */
    .section .text.start, "ax"
    .globl _start
    .code64
_start:
    cmpq $64, %rsi          /* KUMO_MAX_CPUS: vCPUs beyond the runtime's stacks stay parked */
    jae 2f
    cmpq $1, %rsi
    jae 1f
    movb $1, %al            /* marker: guest entry (BSP) */
    movw $0x502, %dx
    outb %al, %dx
1:  movq %rsi, %rax
    addq $1, %rax
    shlq $14, %rax          /* 16 KiB kernel stack per vCPU */
    leaq kumo_kstacks(%rip), %rsp
    addq %rax, %rsp
    call kumo_start
2:  hlt
    jmp 2b

/* Exception entry stubs: push a fake error code where the CPU pushes none, then the vector. */
    .text
    .macro EXC_NOERR vec
    .globl kumo_exc\vec
kumo_exc\vec:
    pushq $0
    pushq $\vec
    jmp kumo_exc_common
    .endm
    .macro EXC_ERR vec
    .globl kumo_exc\vec
kumo_exc\vec:
    pushq $\vec
    jmp kumo_exc_common
    .endm
    EXC_NOERR 0
    EXC_NOERR 1
    EXC_NOERR 2
    EXC_NOERR 3
    EXC_NOERR 4
    EXC_NOERR 5
    EXC_NOERR 6
    EXC_NOERR 7
    EXC_ERR 8
    EXC_NOERR 9
    EXC_ERR 10
    EXC_ERR 11
    EXC_ERR 12
    EXC_ERR 14
    EXC_NOERR 15
    EXC_NOERR 16
    EXC_ERR 17
    EXC_NOERR 18
    EXC_NOERR 19
/* #GP. Ring-3 code idles by executing `hlt` (which faults) with a TSC deadline in edx:eax:
 * arm the LAPIC TSC-deadline timer, halt until an interrupt, resume after the hlt. With rsi
 * non-zero (kumo_wait_change), first compare the u32 at rsi with edi and return at once if it
 * differs: interrupts are off here, so a wake-up just before the hlt is not lost. A ring-3
 * `wrmsr` to the x2APIC ICR (0x830) is done here for it (how ring 3 sends an IPI in x2APIC
 * mode). Kept to a few instructions: each one is emulated on nested KVM. Anything else is a
 * real fault. */
    .globl kumo_exc13
kumo_exc13:
    testb $3, 16(%rsp)          /* CS of the interrupted code: from ring 3? */
    jz 5f
    pushq %rcx
    movq 16(%rsp), %rcx         /* its RIP */
    cmpb $0xf4, (%rcx)          /* hlt? */
    jne 9f
    testq %rsi, %rsi            /* kumo_wait_change: rsi = word, edi = the value seen */
    jz 7f
    cmpl (%rsi), %edi           /* changed since (an interrupt came): do not halt */
    jne 8f
7:  movl $0x6e0, %ecx           /* IA32_TSC_DEADLINE <- edx:eax */
    wrmsr
    sti
    hlt
    cli
8:  popq %rcx
    addq $1, 8(%rsp)            /* resume after the hlt */
    addq $8, %rsp               /* drop the error code */
    iretq
9:  cmpw $0x300f, (%rcx)        /* wrmsr (0f 30)? */
    jne 6f
    cmpl $0x830, (%rsp)         /* to the x2APIC ICR (the caller's ecx, saved above)? */
    jne 6f
    movl $0x830, %ecx
    wrmsr
    popq %rcx
    addq $2, 8(%rsp)            /* resume after the wrmsr */
    addq $8, %rsp
    iretq
6:  popq %rcx
5:  pushq $13
    jmp kumo_exc_common

/* TSC-deadline timer interrupt: it only needs to end the hlt above. The EOI is an MMIO write,
 * or in x2APIC mode (kumo_enable_x2apic) a WRMSR to 0x80B. */
    .globl kumo_timer_isr
kumo_timer_isr:
    pushq %rax
    cmpb $0, kumo_x2apic(%rip)
    jne 1f
    movq $0xfee000b0, %rax      /* LAPIC EOI */
    movl $0, (%rax)
    popq %rax
    iretq
1:  pushq %rcx
    pushq %rdx
    xorl %eax, %eax
    xorl %edx, %edx
    movl $0x80b, %ecx           /* x2APIC EOI */
    wrmsr
    popq %rdx
    popq %rcx
    popq %rax
    iretq

kumo_exc_common:
    movq %rsp, %rdi         /* -> struct exc_frame { vec, err, rip, cs, rflags, rsp, ss } */
    andq $-16, %rsp
    call kumo_exception     /* reports and exits the VM; does not return */
3:  hlt
    jmp 3b

/* Ring 3 entry: rdi = fn, rsi = arg, rdx = user stack top. */
    .globl kumo_iret_to_user
kumo_iret_to_user:
    pushq $0x1b             /* ss */
    pushq %rdx              /* rsp */
    pushq $0x3202           /* rflags: IF, IOPL 3 (port I/O allowed in ring 3) */
    pushq $0x23             /* cs */
    pushq %rdi              /* rip */
    movq %rsi, %rdi
    movw $0x1b, %ax
    movw %ax, %ds
    movw %ax, %es
    iretq

/* Where a ring-3 function returns to (pushed on the user stack): exit with its return value. */
    .globl kumo_user_return
kumo_user_return:
    movw $0x501, %dx
    outl %eax, %dx
4:  jmp 4b
