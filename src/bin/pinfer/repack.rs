//! `pinfer repack IN OUT`: write a repacked-weight cache of a model (see `pinfer::repack_cache`):
//! a GGUF whose weight matrices are already in pinfer's packed layout for this CPU, so loading it
//! only maps it.

use std::path::PathBuf;

use clap::Args;
use pinfer::kernels::packed::LAYOUT_VERSION;
use pinfer::repack_cache::{write_cache, ARCH};

use crate::CliError;

/// Options of `pinfer repack`.
#[derive(Args, Debug)]
pub struct RepackArgs {
    /// Input GGUF (the original model).
    pub input: PathBuf,
    /// Output GGUF (the cache; written to OUT.tmp, then renamed).
    pub output: PathBuf,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Writes the cache and says what it did.
pub fn run(args: RepackArgs) -> Result<(), CliError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let r = write_cache(&args.input, &args.output, threads)?;
    let tied = if r.tied_output { " (the tied embedding's packed copy stored as output.weight)" } else { "" };
    println!(
        "repacked {} -> {}: {} weight matrices in pinfer's layout {LAYOUT_VERSION} for {ARCH} ({:.1} MiB){tied}; \
         {:.1} MiB -> {:.1} MiB in {:.1} s",
        args.input.display(),
        args.output.display(),
        r.tensors,
        mib(r.packed_bytes as u64),
        mib(r.in_bytes),
        mib(r.out_bytes),
        r.seconds
    );
    println!(
        "load it like any model (pinfer generate -m {}); it runs only on {ARCH} with this layout, and other \
         GGUF tools cannot read its weights",
        args.output.display()
    );
    Ok(())
}
