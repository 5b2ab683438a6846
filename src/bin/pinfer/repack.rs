//! `pinfer repack IN OUT`: write a repacked-weight cache of a model (see `pinfer::repack_cache`):
//! a GGUF whose weight matrices are already in pinfer's packed layout for this CPU, so loading it
//! only maps it.

use std::path::{Path, PathBuf};

use clap::Args;
use pinfer::kernels::packed::LAYOUT_VERSION;
use pinfer::loader::ModelFile;
use pinfer::repack_cache::{check_cache, verify_data, write_cache, ARCH};

use crate::CliError;

/// Options of `pinfer repack`.
#[derive(Args, Debug)]
pub struct RepackArgs {
    /// Input GGUF (the original model).
    pub input: PathBuf,
    /// Output GGUF (the cache; written to a new temporary file beside it, then renamed over it).
    pub output: PathBuf,
    /// Threads for the conversion (default: every core this process may use).
    #[arg(short = 't', long = "threads", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Writes the cache and says what it did.
pub fn run(args: RepackArgs) -> Result<(), CliError> {
    let threads = crate::worker_threads(args.threads);
    let _polled = crate::signals::Polled::start();
    let r = match write_cache(&args.input, &args.output, threads, &crate::signals::INTERRUPTED) {
        Err(pinfer::repack_cache::CacheError::Interrupted) => return Err(CliError::Interrupted),
        other => other?,
    };
    let tied = if r.tied_output { " (the tied embedding's packed copy stored as output.weight)" } else { "" };
    outln!(
        "repacked {} -> {}: {} weight matrices in pinfer's layout {LAYOUT_VERSION} for {ARCH} ({:.1} MiB){tied}; \
         {:.1} MiB -> {:.1} MiB in {:.1} s",
        args.input.display(),
        args.output.display(),
        r.tensors,
        mib(r.packed_bytes as u64),
        mib(r.in_bytes),
        mib(r.out_bytes),
        r.seconds
    )?;
    outln!(
        "load it like any model (pinfer generate -m {}); it runs only on {ARCH} with this layout, and other \
         GGUF tools cannot read its weights",
        args.output.display()
    )?;
    Ok(())
}

/// `pinfer verify FILE`: checks a repack cache's header and every tensor against its checksums
/// (a plain GGUF has none: its structure and model metadata are checked).
pub fn verify(path: &Path) -> Result<(), CliError> {
    let started = std::time::Instant::now();
    let model = ModelFile::open(path)?;
    let gguf = model.parse()?;
    if !check_cache(&gguf, path).map_err(CliError::new)? {
        pinfer::model::check(&gguf).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
        outln!(
            "{}: a valid GGUF model ({} tensors); plain GGUF files carry no checksums of their data",
            path.display(),
            gguf.tensor_count()
        )?;
        return Ok(());
    }
    let checked = verify_data(&gguf, path).map_err(CliError::new)?;
    outln!(
        "{}: ok: header and {} tensors ({:.1} MiB) match their checksums ({:.2} s)",
        path.display(),
        gguf.tensor_count(),
        mib(checked as u64),
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}
