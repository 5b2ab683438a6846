//! `pinfer quantize IN OUT TYPE`: requantize a model's weight matrices into a new GGUF file.

use std::path::PathBuf;

use clap::Args;

use crate::CliError;

/// Options of `pinfer quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Input GGUF.
    pub input: PathBuf,
    /// Output GGUF.
    pub output: PathBuf,
    /// Target type: Q4_0, Q4_1, Q8_0, Q4_K or Q6_K.
    pub ty: String,
}

/// Runs the conversion.
pub fn run(args: QuantizeArgs) -> Result<(), CliError> {
    let _ = args;
    Err(CliError("`pinfer quantize` is not yet implemented in this build".into()))
}
