//! Output: the PL011 UART of QEMU's virt machine (the generated text), and the diagnostics
//! (timings, ids, errors) on the host's stderr through semihosting when the header asks for it,
//! else on the UART too.

use core::fmt;
use core::sync::atomic::{AtomicU32, Ordering};

use crate::platform::flags;

/// The PL011's data register; its flag register is 0x18 above, TXFF (transmit FIFO full) bit 5.
const UART_BASE: usize = 0x0900_0000;

static FLAGS: AtomicU32 = AtomicU32::new(0);
/// The semihosting handle of the host's stderr (0: not opened).
static STDERR: AtomicU32 = AtomicU32::new(0);

/// Takes the header's flags; opens the host's stderr when semihosting is on.
pub fn init(header_flags: u32) {
    FLAGS.store(header_flags, Ordering::Relaxed);
    if header_flags & flags::SEMIHOSTING != 0 {
        // SYS_OPEN of ":tt" in mode 8 ("a"): the host's stderr.
        let name = b":tt\0";
        let block = [name.as_ptr() as u64, 8, 3];
        let handle = semihosting(0x01, block.as_ptr() as u64);
        if handle as i64 > 0 {
            STDERR.store(handle as u32, Ordering::Relaxed);
        }
    }
}

/// The header's flags as [`init`] took them.
pub fn flags() -> u32 {
    FLAGS.load(Ordering::Relaxed)
}

/// The UART.
pub struct Uart;

impl fmt::Write for Uart {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &b in s.as_bytes() {
            // SAFETY: the PL011's registers at UART_BASE, mapped as device memory (platform's
            // page table); one core writes them.
            unsafe {
                while core::ptr::read_volatile((UART_BASE + 0x18) as *const u32) & (1 << 5) != 0 {}
                core::ptr::write_volatile(UART_BASE as *mut u32, b as u32);
            }
        }
        Ok(())
    }
}

/// Where diagnostics go.
pub struct Diag(u32);

/// Diagnostics: the host's stderr through semihosting, or the UART.
pub fn diag() -> Diag {
    Diag(STDERR.load(Ordering::Relaxed))
}

impl fmt::Write for Diag {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.0 == 0 {
            return Uart.write_str(s);
        }
        // SYS_WRITE: handle, address, length.
        let block = [self.0 as u64, s.as_ptr() as u64, s.len() as u64];
        semihosting(0x05, block.as_ptr() as u64);
        Ok(())
    }
}

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
fn semihosting(op: u64, param: u64) -> u64 {
    let ret: u64;
    // SAFETY: only issued when the header says the host has semihosting on (else `hlt` would
    // trap); the host reads the parameter block, which lives until the call returns.
    unsafe { core::arch::asm!("hlt #0xf000", inout("x0") op => ret, in("x1") param, options(nostack)) };
    ret
}
