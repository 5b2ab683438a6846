//! The PL011 UART of QEMU's virt machine: the generated text, and the diagnostics when the host
//! has no semihosting.

use core::fmt;

/// The PL011's data register; its flag register is 0x18 above, TXFF (transmit FIFO full) bit 5.
const UART_BASE: usize = 0x0900_0000;

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
