//! What the generation loops of `generate` and `chat` share: each piece printed as it comes (with
//! the repack cache's check and SIGINT between tokens), and the loop's errors as the CLI reports
//! them.

use pinfer::generate::{Flow, GenerateError};

use crate::runtime::CacheCheck;
use crate::signals::take_interrupt;
use crate::CliError;

/// Passes generated text to stdout between tokens: checks the repack cache's background check
/// and SIGINT, which stops after the current token.
pub(crate) fn print_piece(check: &mut CacheCheck, text: &str) -> Result<Flow, CliError> {
    if !text.is_empty() {
        out!("{text}")?;
    }
    check.status()?;
    Ok(if take_interrupt() { Flow::Stop } else { Flow::Continue })
}

/// A failure of the generation loop as the CLI reports it.
pub(crate) fn gen_error(e: GenerateError<CliError>) -> CliError {
    match e {
        GenerateError::Output(e) => e,
        GenerateError::Session(e) => CliError::new(e.to_string()),
        GenerateError::Sample(e) => CliError::new(e.to_string()),
        GenerateError::Decode(e) => CliError::new(e.to_string()),
        GenerateError::Grammar(e) => CliError::new(e.to_string()),
    }
}
