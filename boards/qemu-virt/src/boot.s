// Start-up of the image: from EL2 (U-Boot on RK3588 boards) or EL1 (QEMU's virt) to EL1 with
// FP/SIMD enabled, exception vectors installed, an identity map with caches on, BSS cleared and
// a stack, then pinfer_main. Nothing here touches memory before the MMU is on except the page
// table walks (the table is in .data, written at build time).

.section .text.boot, "ax"
.global _start
_start:
    mrs     x0, CurrentEL
    lsr     x0, x0, #2
    and     x20, x0, #3             // the exception level the image started at, for pinfer_main
    cmp     x20, #2
    b.ne    1f
    // EL2: run EL1 in AArch64, leave its timers and FP/SIMD untrapped, enter it with DAIF masked.
    mov     x0, #(1 << 31)
    msr     hcr_el2, x0
    mov     x0, #3
    msr     cnthctl_el2, x0
    msr     cntvoff_el2, xzr
    mov     x0, #0x33ff
    msr     cptr_el2, x0
    mov     x0, #0x3c5
    msr     spsr_el2, x0
    adr     x0, 1f
    msr     elr_el2, x0
    eret
1:
    ldr     x0, =__stack_top
    mov     sp, x0
    // FP/SIMD at EL1 and EL0 without traps (CPACR_EL1.FPEN = 0b11).
    mov     x0, #(3 << 20)
    msr     cpacr_el1, x0
    isb
    ldr     x0, =exception_vectors
    msr     vbar_el1, x0
    // Identity map: MAIR attribute 0 = Device-nGnRnE, 1 = Normal write-back; 39-bit VAs from
    // TTBR0 (level-1 table of 1 GiB blocks), inner-shareable write-back walks, 40-bit PAs.
    ldr     x0, =PINFER_PAGE_TABLE
    msr     ttbr0_el1, x0
    ldr     x0, =0xff00
    msr     mair_el1, x0
    ldr     x0, =0x200803519
    msr     tcr_el1, x0
    isb
    tlbi    vmalle1
    dsb     ish
    isb
    mrs     x0, sctlr_el1
    orr     x0, x0, #1              // M: MMU on
    orr     x0, x0, #4              // C: data cache
    orr     x0, x0, #0x1000         // I: instruction cache
    bic     x0, x0, #2              // A: unaligned accesses allowed (normal memory)
    bic     x0, x0, #(1 << 19)      // WXN off
    msr     sctlr_el1, x0
    isb
    ldr     x0, =__bss_start
    ldr     x1, =__bss_end
2:  cmp     x0, x1
    b.hs    3f
    stp     xzr, xzr, [x0], #16
    b       2b
3:  mov     x0, x20
    bl      pinfer_main
4:  wfe
    b       4b

// Sixteen entries of 0x80 bytes: each passes its number to pinfer_exception on a stack of its
// own (the fault may be a stack overflow), with the syndrome, return address and fault address.
.section .text.vectors, "ax"
.balign 0x800
.global exception_vectors
exception_vectors:
.irp n, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
.balign 0x80
    mov     x0, #\n
    b       exception_entry
.endr
exception_entry:
    ldr     x1, =__exception_stack_top
    mov     sp, x1
    mrs     x1, esr_el1
    mrs     x2, elr_el1
    mrs     x3, far_el1
    bl      pinfer_exception
5:  wfe
    b       5b
