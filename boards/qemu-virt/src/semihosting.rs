//! Arm semihosting: calls the host (QEMU with `-semihosting`) serves, for the diagnostics on its
//! stderr and the exit status.

/// Ends QEMU with `status` (SYS_EXIT, ADP_Stopped_ApplicationExit with a subcode).
pub fn semihosting_exit(status: u32) -> ! {
    let block = [0x20026u64, status as u64];
    semihosting(0x18, block.as_ptr() as u64);
    loop {
        // SAFETY: waits for an event; nothing to be sound about.
        unsafe { core::arch::asm!("wfe", options(nomem, nostack)) };
    }
}

/// A semihosting call: operation `op`, parameter block at `param`.
pub fn semihosting(op: u64, param: u64) -> u64 {
    let ret: u64;
    // SAFETY: only issued when the header says the host has semihosting on (else `hlt` would
    // trap); the host reads the parameter block, which lives until the call returns.
    unsafe { core::arch::asm!("hlt #0xf000", inout("x0") op => ret, in("x1") param, options(nostack)) };
    ret
}
