//! pinfer without an operating system. The image boots on QEMU's `virt` machine (or a board's
//! DRAM through U-Boot), reads the boot header the runner placed below it (model address and
//! length, prompt, token count), and runs the model on the no_std engine on one core: greedy
//! generation, the text on the UART, the timings and the token ids after it (on the host's stderr
//! through semihosting when the header asks, else on the UART too); errors on the UART.
//!
//! Memory (docs/baremetal.md): the image at 0x4008_0000, the boot header in the page below it, the
//! arena from the image's end up to the model, which the loader put at the top of RAM. With the
//! `embed-model` feature the model is inside the image and the header is optional.
#![no_std]
#![no_main]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
// The error travels once, on the way to the halt: its size does not matter (as in the core).
#![allow(clippy::result_large_err)]

mod console;
mod platform;
mod semihosting;
mod uart;

use core::fmt::{self, Write};

use pinfer::engine::generate::{End, GenerateError, Generation, Next};
use pinfer::engine::{
    graph_slots, Engine, EngineConfig, EngineError, Entry, GraphSlot, Model, OnCaller, Planned,
};
use pinfer::sampler::{Candidate, SampleError, Sampler, SamplerConfig};
use pinfer::tokenizer::{TokError, Tokenizer};

use console::diag;
use platform::{BootHeader, Exit, Region};
use uart::Uart;

core::arch::global_asm!(include_str!("boot.s"));

/// The engine's graph slots: a static array, as the engine's docs suggest for bare metal.
static mut GRAPH_SLOTS: [GraphSlot; pinfer::engine::GRAPH_SLOTS] =
    [const { GraphSlot::new() }; pinfer::engine::GRAPH_SLOTS];

/// Longest prompt in tokens.
const MAX_PROMPT_TOKENS: usize = 512;

/// Why a run stopped early; printed on the UART before the image halts.
enum Error {
    Engine(EngineError),
    Tokenizer(TokError),
    Generate(GenerateError),
    Arena { needed: usize, available: usize },
    Setup(&'static str),
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Self {
        Self::Engine(e)
    }
}

impl From<TokError> for Error {
    fn from(e: TokError) -> Self {
        Self::Tokenizer(e)
    }
}

impl From<GenerateError> for Error {
    fn from(e: GenerateError) -> Self {
        Self::Generate(e)
    }
}

impl From<SampleError> for Error {
    fn from(e: SampleError) -> Self {
        Self::Generate(e.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Engine(e) => write!(f, "{e}"),
            Self::Tokenizer(e) => write!(f, "tokenizer: {e}"),
            Self::Generate(e) => write!(f, "{e}"),
            Self::Arena { needed, available } => write!(
                f,
                "the arena is too small: the model needs {needed} bytes ({} MiB), the RAM between the image \
                 and the model has {available} ({} MiB); give QEMU more memory (-m) or a smaller context",
                needed >> 20,
                available >> 20
            ),
            Self::Setup(msg) => f.write_str(msg),
        }
    }
}

/// Entered from boot.s at EL1 with the MMU, caches and FP/SIMD on and BSS cleared;
/// `started_at` is the exception level the image was entered at (2 when a boot loader left it at EL2).
#[no_mangle]
extern "C" fn pinfer_main(started_at: u64) -> ! {
    let boot = platform::counter();
    let header = platform::boot_header();
    console::init(header.as_ref().map_or(0, |h| h.flags));
    let exit = Exit::from_flags(header.as_ref().map_or(0, |h| h.flags));
    if console::flags() & platform::flags::FAULT_TEST != 0 {
        platform::fault();
    }
    let _ = writeln!(diag(), "pinfer: bare metal, started at EL{started_at}, running at EL1");
    match run(header.as_ref(), boot) {
        Ok(()) => exit.finish(0),
        Err(e) => {
            // On the board's console: it is where someone looks when the image stops.
            let _ = writeln!(Uart, "pinfer: error: {e}");
            exit.finish(1)
        }
    }
}

fn run(header: Option<&BootHeader>, boot: u64) -> Result<(), Error> {
    let (model_bytes, prompt, n_predict, n_ctx, arena) = platform::inputs(header).map_err(Error::Setup)?;
    let model = Model::open(model_bytes)?;
    let tokenizer_words = Tokenizer::storage_words(model.gguf())?;
    let mut arena = Region::new(arena);
    let storage = arena
        .take_words(tokenizer_words)
        .ok_or(Error::Arena { needed: tokenizer_words * 4, available: arena.remaining() })?;
    let tokenizer = Tokenizer::new(model.gguf(), storage)?;

    let mut ids = [0u32; MAX_PROMPT_TOKENS];
    let n_prompt = tokenizer.encode(prompt, true, true, &mut ids)?;
    if n_prompt == 0 {
        return Err(Error::Setup("the prompt has no tokens"));
    }
    let n_ctx = if n_ctx == 0 { 512 } else { n_ctx };
    if n_prompt + n_predict > n_ctx {
        return Err(Error::Setup("the prompt and the tokens to generate do not fit the context (n_ctx)"));
    }

    let config = EngineConfig { n_ctx, ..EngineConfig::default() };
    // SAFETY: pinfer_main runs once, on one core, and nothing else names GRAPH_SLOTS.
    let slots = unsafe { &mut *core::ptr::addr_of_mut!(GRAPH_SLOTS) };
    let planned = Planned::new(model, &config, &mut slots[..graph_slots(&config)])?;
    let needed = planned.layout().bytes_needed();
    let available = arena.remaining();
    let memory = arena.take(needed, 64).ok_or(Error::Arena { needed, available })?;
    let mut engine: Engine<'_, &mut [GraphSlot], &mut [u8]> = planned.bind(memory)?;
    let _ = writeln!(
        diag(),
        "pinfer: {} kernels, context {n_ctx}, {} MiB of arena used, prompt {n_prompt} tokens",
        config.kernels.name(),
        (tokenizer_words * 4 + needed) >> 20
    );
    engine.repack(&OnCaller, &|_| {})?;

    // Greedy (as llama.cpp's goldens) through the core generation step.
    let n_vocab = tokenizer.n_vocab() as usize;
    let words = n_vocab * Candidate::WORDS;
    let available = arena.remaining();
    let candidates = arena.take_words(words).ok_or(Error::Arena { needed: words * 4, available })?;
    let mut piece = [0u8; 1024];
    let sampler = Sampler::new(SamplerConfig::greedy())?;
    let mut gen = Generation::new(&tokenizer, sampler, Candidate::list_in(candidates), &mut piece[..])?;
    let mut batch = [Entry { seq: 0, pos: 0, token: 0, logits: false }; 64];
    gen.feed(&mut engine, 0, &ids[..n_prompt], &mut batch, &OnCaller, None)?;

    let mut generated = [0u32; 4096];
    gen.limit = Some(n_predict.min(generated.len()));
    let mut n_gen = 0;
    let (mut first_token, mut last) = (0u64, 0u64);
    let mut uart = Uart;
    loop {
        let next = gen.next(&mut engine, &OnCaller, None, &generated[..n_gen])?;
        if n_gen == 0 {
            first_token = platform::counter();
        }
        let id = match next {
            Next::Token { id, text } => {
                let _ = uart.write_str(text);
                last = platform::counter();
                id
            }
            // The end-of-generation token is listed with the ids (it is not text).
            Next::End(End::EndOfGeneration(id)) => {
                generated[n_gen] = id;
                n_gen += 1;
                break;
            }
            Next::End(End::Limit | End::ContextFull) => break,
        };
        generated[n_gen] = id;
        n_gen += 1;
    }
    let _ = uart.write_str(gen.finish());
    let _ = uart.write_str("\n");

    let ms = |ticks: u64| ticks as f64 * 1000.0 / platform::counter_hz() as f64;
    let mut d = diag();
    let _ = writeln!(d, "pinfer: boot to first token {:.0} ms", ms(first_token - boot));
    if n_gen > 1 && last > first_token {
        let per = ms(last - first_token) / (n_gen - 1) as f64;
        let _ =
            writeln!(d, "pinfer: {} tokens, {:.1} ms per token ({:.2} tokens/s)", n_gen, per, 1000.0 / per);
    }
    let _ = write!(d, "pinfer: ids");
    for id in &generated[..n_gen] {
        let _ = write!(d, " {id}");
    }
    let _ = writeln!(d);
    Ok(())
}

/// A fault: what the CPU says about it, then a halt.
#[no_mangle]
extern "C" fn pinfer_exception(kind: u64, esr: u64, elr: u64, far: u64) -> ! {
    const KINDS: [&str; 4] = ["synchronous", "IRQ", "FIQ", "SError"];
    let _ = writeln!(
        Uart,
        "\npinfer: exception: {} from vector {kind} (ESR_EL1 {esr:#x}, class {:#x}; ELR_EL1 {elr:#x}; FAR_EL1 {far:#x})",
        KINDS[(kind % 4) as usize],
        esr >> 26
    );
    Exit::from_flags(console::flags()).finish(3)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let _ = writeln!(Uart, "\npinfer: panic: {info}");
    Exit::from_flags(console::flags()).finish(2)
}
