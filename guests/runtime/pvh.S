/* PVH entry: lets QEMU (`-kernel guest.elf`) boot a kumo guest. QEMU finds the Xen
 * PHYS32_ENTRY note below and enters kumo_pvh_entry in 32-bit protected mode, paging off,
 * ebx = &struct hvm_start_info. This stub builds what kumo itself builds before a guest's first
 * instruction (identity page tables, GDT with kumo's selectors, a TSS with an I/O bitmap), enters
 * long mode, lets kumo_pvh_boot_info (runtime.c) fill a kumo_boot_info, and jumps to _start as
 * kumo would for vCPU 0. kumo ignores the note: it loads the ELF itself and enters at _start.
 * Every instruction here is emulated on nested KVM: kept short (the page-table loop is ~10k). */

#define PG_P_RW_US 0x7
#define PG_PS 0x80
#define PG_PWT_PCD 0x18
#define TSS_LIMIT (104 + 0x600 / 8)     /* header + I/O bitmap for ports 0..0x600, then 0xff */

    .section .note.Xen, "a", @note
    .balign 4
    .long 4                 /* namesz: "Xen\0" */
    .long 8                 /* descsz: QEMU reads a 64-bit address from a 64-bit ELF */
    .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .balign 4
    .quad kumo_pvh_entry

    .text
    .code32
    .globl kumo_pvh_entry
kumo_pvh_entry:
    cli
    cld
    movl %ebx, %esi                 /* hvm_start_info, kept for kumo_pvh_boot_info */
    /* Mask the 8259s: the BIOS left its timer on vectors the runtime uses for exceptions. */
    movb $0xff, %al
    outb %al, $0x21
    outb %al, $0xa1

    /* Identity map [0, 4 GiB): PML4[0] -> PDPT, PDPT[0..3] -> 4 PDs of 2 MiB pages. */
    movl $kumo_pvh_pdpt + PG_P_RW_US, kumo_pvh_pml4
    movl $kumo_pvh_pd + PG_P_RW_US, %eax
    xorl %ecx, %ecx
1:  movl %eax, kumo_pvh_pdpt(,%ecx,8)
    addl $0x1000, %eax
    addl $1, %ecx
    cmpl $4, %ecx
    jb 1b
    movl $PG_P_RW_US + PG_PS, %eax
    xorl %ecx, %ecx
2:  movl %eax, kumo_pvh_pd(,%ecx,8)
    addl $0x200000, %eax
    addl $1, %ecx
    cmpl $1536, %ecx                /* entries from 3 GiB on (MMIO: LAPIC, IOAPIC) uncached */
    jne 3f
    orl $PG_PWT_PCD, %eax
3:  cmpl $2048, %ecx
    jb 2b

    /* TSS descriptor (GDT entry 6, selector 0x30): base = kumo_pvh_tss, type 0x89 (available). */
    movl $kumo_pvh_tss, %eax
    movl %eax, %edx
    shll $16, %eax
    orl $TSS_LIMIT, %eax
    movl %eax, kumo_pvh_gdt + 0x30
    movl %edx, %eax
    andl $0xff000000, %eax
    shrl $16, %edx
    andl $0xff, %edx
    orl %edx, %eax
    orl $0x8900, %eax
    movl %eax, kumo_pvh_gdt + 0x34

    /* Long mode with kumo's control registers: CR4 PAE|OSFXSR|OSXMMEXCPT, EFER.LME,
     * CR0 PE|MP|ET|NE|WP|PG. */
    movl $kumo_pvh_pml4, %eax
    movl %eax, %cr3
    movl $0x620, %eax
    movl %eax, %cr4
    movl $0xc0000080, %ecx
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl $0x80010033, %eax
    movl %eax, %cr0
    lgdt kumo_pvh_gdtr
    ljmp $0x08, $4f

    .code64
4:  movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    movw $0x30, %ax
    ltr %ax
    leaq kumo_kstacks + 16384(%rip), %rsp   /* vCPU 0's stack, as _start will use */
    movl %esi, %edi                 /* hvm_start_info (below 4 GiB) */
    leaq kumo_pvh_tss(%rip), %rsi
    call kumo_pvh_boot_info         /* -> &kumo_boot_info */
    movq %rax, %rdi
    xorl %esi, %esi                 /* vCPU 0 */
    jmp _start

    .data
    .balign 16
kumo_pvh_gdt:
    .quad 0
    .quad 0x00af9b000000ffff        /* 0x08 kernel code, 64-bit */
    .quad 0x00cf93000000ffff        /* 0x10 kernel data */
    .quad 0x00cff3000000ffff        /* 0x18 user data (0x1b) */
    .quad 0x00affb000000ffff        /* 0x20 user code, 64-bit (0x23) */
    .quad 0x00cf9b000000ffff        /* 0x28 code, 32-bit (as kumo) */
    .quad 0, 0                      /* 0x30 TSS, filled in above */
kumo_pvh_gdt_end:
kumo_pvh_gdtr:
    .word kumo_pvh_gdt_end - kumo_pvh_gdt - 1
    .quad kumo_pvh_gdt

    /* The TSS: rsp0 is set by kumo_start; the I/O bitmap (all zero: every port allowed) covers
     * ports 0..0x600 and ends with the 0xff byte the CPU requires. */
    .balign 16
    .globl kumo_pvh_tss
kumo_pvh_tss:
    .fill 102, 1, 0
    .word 104                       /* I/O map base */
    .fill 0x600 / 8, 1, 0
    .byte 0xff

    .bss
    .balign 4096
kumo_pvh_pml4: .skip 4096
kumo_pvh_pdpt: .skip 4096
kumo_pvh_pd:   .skip 4 * 4096
