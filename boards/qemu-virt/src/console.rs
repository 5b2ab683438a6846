//! Output: the generated text on the UART, and the diagnostics (timings, ids, errors) on the
//! host's stderr through semihosting when the header asks for it, else on the UART too.

use core::fmt;
use core::sync::atomic::{AtomicU32, Ordering};

use crate::platform::flags;
use crate::semihosting::semihosting;
use crate::uart::Uart;

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
