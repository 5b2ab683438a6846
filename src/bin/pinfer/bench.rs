//! `pinfer bench`: llama-bench-style prompt-processing and generation speed.

use std::path::PathBuf;

use clap::Args;

use crate::CliError;

/// Options of `pinfer bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
}

/// Runs the benchmark.
pub fn run(args: BenchArgs) -> Result<(), CliError> {
    let _ = args;
    Err(CliError("`pinfer bench` is not yet implemented in this build".into()))
}
