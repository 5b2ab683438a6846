//! The machine: the boot header, the memory map, the page table, the counter, and how the image
//! ends (semihosting exit with a status, PSCI power-off, or a halt).

/// The boot header's place: the page below the image (link.ld puts the image at 0x4008_0000).
const HEADER_ADDR: usize = 0x4007_f000;
/// The header's first bytes.
const MAGIC: [u8; 8] = *b"PINFBOOT";
/// The header layout this image reads.
const VERSION: u32 = 1;
/// Bytes of the header page after the fixed fields: the prompt.
const MAX_PROMPT_BYTES: usize = 4096 - core::mem::size_of::<BootHeader>();
/// QEMU's virt RAM starts here (and the device tree at its start).
const RAM_START: u64 = 0x4000_0000;

/// Header flags.
pub mod flags {
    /// End with a semihosting exit carrying the status (QEMU with `-semihosting`), and write the
    /// diagnostics to the host's stderr through semihosting.
    pub const SEMIHOSTING: u32 = 1;
    /// End with PSCI SYSTEM_OFF through `hvc` (QEMU's virt, a hypervisor's PSCI).
    pub const PSCI_HVC: u32 = 2;
    /// End with PSCI SYSTEM_OFF through `smc` (a board's trusted firmware).
    pub const PSCI_SMC: u32 = 4;
    /// Read an unmapped address before anything else: a test of the exception vectors.
    pub const FAULT_TEST: u32 = 0x100;
}

/// What the runner (scripts/baremetal.sh) writes in the page below the image, little-endian.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BootHeader {
    magic: [u8; 8],
    version: u32,
    /// [`flags`].
    pub flags: u32,
    model_addr: u64,
    model_len: u64,
    /// First address past RAM.
    ram_end: u64,
    n_predict: u32,
    n_ctx: u32,
    prompt_len: u32,
    _reserved: u32,
}

/// The boot header, if the page below the image holds one of this version.
pub fn boot_header() -> Option<BootHeader> {
    // SAFETY: the memory map reserves this page for the header; it is RAM, identity-mapped as
    // normal memory, and BootHeader is plain integers valid for any bytes.
    let header = unsafe { core::ptr::read_volatile(HEADER_ADDR as *const BootHeader) };
    (header.magic == MAGIC && header.version == VERSION).then_some(header)
}

/// The prompt text after the header's fields.
fn header_prompt(h: &BootHeader) -> Result<&'static str, &'static str> {
    let len = h.prompt_len as usize;
    if len > MAX_PROMPT_BYTES {
        return Err("the boot header's prompt is longer than its page");
    }
    // SAFETY: the header page holds `len` bytes after the fixed fields (checked above); nothing
    // writes the page while the image runs.
    let bytes = unsafe {
        core::slice::from_raw_parts((HEADER_ADDR + core::mem::size_of::<BootHeader>()) as *const u8, len)
    };
    core::str::from_utf8(bytes).map_err(|_| "the prompt is not valid UTF-8")
}

extern "C" {
    static __image_start: u8;
    static __image_end: u8;
}

fn image_range() -> (u64, u64) {
    // (Only the addresses of the linker's symbols are taken, never their bytes.)
    (core::ptr::addr_of!(__image_start) as u64, core::ptr::addr_of!(__image_end) as u64)
}

/// The model bytes, prompt, tokens to generate, context and arena of this run.
pub type Inputs = (&'static [u8], &'static str, usize, usize, &'static mut [u8]);

/// The run's inputs from the header (or the embedded model and the defaults built in), with the
/// arena: the RAM from the image's end (2 MiB-aligned) up to the model, or to the end of RAM when
/// the model is inside the image. Every range is checked against the memory map.
pub fn inputs(header: Option<&BootHeader>) -> Result<Inputs, &'static str> {
    let (image_start, image_end) = image_range();
    let arena_start = image_end.next_multiple_of(2 << 20);
    let (prompt, n_predict, n_ctx, ram_end) = match header {
        Some(h) => (header_prompt(h)?, h.n_predict as usize, h.n_ctx as usize, h.ram_end),
        None => (embedded::PROMPT, embedded::N_PREDICT, 0, RAM_START + (1 << 30)),
    };
    let (model, arena_end): (&'static [u8], u64) = match (header, embedded::model()) {
        (Some(h), _) if h.model_len > 0 => {
            let end = h.model_addr.checked_add(h.model_len).ok_or("the model's range overflows")?;
            if h.model_addr < arena_start || end > ram_end || ram_end <= RAM_START {
                return Err("the boot header puts the model outside the RAM above the image");
            }
            // SAFETY: the range is RAM above the image (checked above) where the loader placed
            // the model; the arena ends below it, so nothing writes it while it is borrowed.
            let bytes =
                unsafe { core::slice::from_raw_parts(h.model_addr as *const u8, h.model_len as usize) };
            (bytes, h.model_addr)
        }
        (_, Some(bytes)) => (bytes, ram_end),
        _ => return Err("no model: the boot header names none and none is embedded in the image"),
    };
    if image_start < RAM_START || arena_end <= arena_start {
        return Err("no RAM is left for the arena between the image and the model");
    }
    // SAFETY: [arena_start, arena_end) is RAM past the image's last section and below the model
    // (or the end of RAM); nothing else refers to it, and this is its only borrow.
    let arena = unsafe {
        core::slice::from_raw_parts_mut(arena_start as *mut u8, (arena_end - arena_start) as usize)
    };
    Ok((model, prompt, n_predict, n_ctx, arena))
}

/// The model inside the image (`embed-model` feature) and the defaults built with it.
mod embedded {
    /// PINFER_EMBED_PROMPT at build time.
    pub const PROMPT: &str = match option_env!("PINFER_EMBED_PROMPT") {
        Some(p) => p,
        None => "The capital of France is",
    };
    /// Tokens generated without a header.
    pub const N_PREDICT: usize = 32;

    #[cfg(feature = "embed-model")]
    pub fn model() -> Option<&'static [u8]> {
        /// The file's bytes at the alignment its tensors need.
        #[repr(C, align(64))]
        struct Aligned<T: ?Sized>(T);
        static MODEL: &Aligned<[u8]> = &Aligned(*include_bytes!(env!("PINFER_EMBEDDED_MODEL_PATH")));
        Some(&MODEL.0)
    }

    #[cfg(not(feature = "embed-model"))]
    pub fn model() -> Option<&'static [u8]> {
        None
    }
}

/// Reads an address past the identity map: the CPU takes a translation fault to the vectors.
pub fn fault() -> ! {
    // SAFETY: not sound to complete, and it does not: the access faults (no mapping above
    // 16 GiB) and the exception handler halts the image.
    let v = unsafe { core::ptr::read_volatile(0x40_0000_0000 as *const u64) };
    panic!("read {v:#x} from an unmapped address")
}

/// A bump allocator over the arena: each part taken once, for the rest of the run.
pub struct Region(&'static mut [u8]);

impl Region {
    pub fn new(bytes: &'static mut [u8]) -> Self {
        Self(bytes)
    }

    pub fn remaining(&self) -> usize {
        self.0.len()
    }

    /// `n` bytes at an address that is a multiple of `align` (a power of two).
    pub fn take(&mut self, n: usize, align: usize) -> Option<&'static mut [u8]> {
        let skip = (self.0.as_ptr() as usize).next_multiple_of(align) - self.0.as_ptr() as usize;
        if skip.checked_add(n)? > self.0.len() {
            return None;
        }
        let rest = core::mem::take(&mut self.0);
        let (part, rest) = rest[skip..].split_at_mut(n);
        self.0 = rest;
        Some(part)
    }

    /// `n` words, zeroed.
    pub fn take_words(&mut self, n: usize) -> Option<&'static mut [u32]> {
        let bytes = self.take(n.checked_mul(4)?, 4)?;
        bytes.fill(0);
        Some(bytemuck_words(bytes))
    }
}

/// `bytes` (4-aligned, a multiple of 4 long) as words.
fn bytemuck_words(bytes: &'static mut [u8]) -> &'static mut [u32] {
    let n = bytes.len() / 4;
    // SAFETY: Region::take_words asks for 4-byte alignment and 4n bytes; u32 is valid for any
    // bytes; the slice is moved in, so the words are its only borrow.
    unsafe { core::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<u32>(), n) }
}

/// The generic timer's virtual count.
pub fn counter() -> u64 {
    let t: u64;
    // SAFETY: reads CNTVCT_EL0, accessible at EL1 (and from EL0 under EL2's CNTHCTL setting).
    unsafe { core::arch::asm!("isb", "mrs {}, cntvct_el0", out(reg) t, options(nomem, nostack)) };
    t
}

/// Ticks per second of [`counter`].
pub fn counter_hz() -> u64 {
    let f: u64;
    // SAFETY: reads CNTFRQ_EL0, set by the firmware (QEMU sets it).
    unsafe { core::arch::asm!("mrs {}, cntfrq_el0", out(reg) f, options(nomem, nostack)) };
    f.max(1)
}

/// The level-1 translation table: 1 GiB blocks, the first (the virt machine's devices: UART,
/// GIC) as Device-nGnRnE and never executed, the next 15 (RAM) as normal write-back memory.
#[repr(C, align(4096))]
pub struct PageTable([u64; 512]);

const fn identity_map() -> PageTable {
    const BLOCK: u64 = 0b01;
    const ACCESSED: u64 = 1 << 10;
    const INNER_SHAREABLE: u64 = 3 << 8;
    const NORMAL: u64 = 1 << 2; // MAIR attribute 1
    const NEVER_EXECUTE: u64 = (1 << 54) | (1 << 53);
    let mut t = [0u64; 512];
    t[0] = BLOCK | ACCESSED | NEVER_EXECUTE;
    let mut i = 1;
    while i < 16 {
        t[i] = ((i as u64) << 30) | BLOCK | ACCESSED | INNER_SHAREABLE | NORMAL;
        i += 1;
    }
    PageTable(t)
}

/// Read by boot.s before the MMU is on (it is in .data: no code writes it).
#[no_mangle]
static PINFER_PAGE_TABLE: PageTable = identity_map();

/// How the image ends.
pub struct Exit(u32);

impl Exit {
    pub fn from_flags(flags: u32) -> Self {
        Self(flags)
    }

    /// Ends with `status` (0 = success): a semihosting exit, PSCI power-off, or a halt.
    pub fn finish(self, status: u32) -> ! {
        if self.0 & flags::SEMIHOSTING != 0 {
            crate::semihosting::semihosting_exit(status);
        }
        if self.0 & (flags::PSCI_HVC | flags::PSCI_SMC) != 0 {
            const SYSTEM_OFF: u64 = 0x8400_0008;
            if self.0 & flags::PSCI_HVC != 0 {
                // SAFETY: PSCI SYSTEM_OFF does not return when the hypervisor implements it.
                unsafe { core::arch::asm!("hvc #0", in("x0") SYSTEM_OFF, options(nostack)) };
            } else {
                // SAFETY: PSCI SYSTEM_OFF does not return when the firmware implements it.
                unsafe { core::arch::asm!("smc #0", in("x0") SYSTEM_OFF, options(nostack)) };
            }
        }
        let _ = core::fmt::Write::write_str(&mut crate::uart::Uart, "pinfer: halted\n");
        loop {
            // SAFETY: waits for an event; nothing to be sound about.
            unsafe { core::arch::asm!("wfe", options(nomem, nostack)) };
        }
    }
}
