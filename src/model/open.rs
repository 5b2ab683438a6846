//! Opening a model: every front end (session, repack cache, `info`, `verify`, the NPU plan) checks
//! a model file through [`check`] and sizes its context through [`context_size`], so "a model
//! pinfer runs" and "the default context" mean one thing everywhere.

use super::{validate_tensors, validate_vocab, HParams, ModelError, Vocab};
use crate::gguf::Gguf;

/// Context size when none is asked for: at most this many tokens (and the model's maximum).
pub const DEFAULT_CTX: usize = 4096;

/// A model file checked whole: hyper-parameters in range, a consistent vocabulary, and every
/// tensor the architecture needs with the shape and type the graph builders expect.
#[derive(Debug, Clone)]
pub struct Checked<'a> {
    /// The hyper-parameters.
    pub hparams: HParams,
    /// The vocabulary summary.
    pub vocab: Vocab<'a>,
}

/// Checks that `gguf` holds a model pinfer runs (see [`Checked`]).
pub fn check<'a>(gguf: &Gguf<'a>) -> Result<Checked<'a>, ModelError> {
    let hparams = HParams::from_gguf(gguf)?;
    let vocab = validate_vocab(gguf)?;
    validate_tensors(gguf, &hparams, vocab.n_vocab)?;
    Ok(Checked { hparams, vocab })
}

/// The context a request of `requested` tokens gets: 0 asks for min([`DEFAULT_CTX`], the
/// model's training context); `None` when it exceeds the training context.
pub fn context_size(hp: &HParams, requested: usize) -> Option<usize> {
    let max = hp.n_ctx_train as usize;
    match requested {
        0 => Some(DEFAULT_CTX.min(max)),
        n if n > max => None,
        n => Some(n),
    }
}
