//! The model's tokenizer for the commands (its tables freed with it), encoding with the CLI's
//! errors, and `pinfer tokenize`.

use std::path::Path;

use pinfer::gguf::Gguf;
use pinfer::loader::ModelFile;
use pinfer::tokenizer::{OwnedTokenizer, StreamDecoder, Tokenizer};

use crate::CliError;

/// The tokenizer of the model at `path`, an error naming the file if its vocabulary is refused.
pub fn tokenizer(path: &Path, gguf: &Gguf<'_>) -> Result<OwnedTokenizer, CliError> {
    OwnedTokenizer::new(gguf).map_err(|e| CliError::new(format!("{}: {e}", path.display())))
}

/// Token ids of `text` (BOS/EOS as the model says).
pub fn encode(tok: &Tokenizer<'_>, text: &str, parse_special: bool) -> Result<Vec<u32>, CliError> {
    encode_with(tok, text, parse_special, true)
}

/// Token ids of `text`, with BOS/EOS as the model says when `add_special`.
pub fn encode_with(
    tok: &Tokenizer<'_>,
    text: &str,
    parse_special: bool,
    add_special: bool,
) -> Result<Vec<u32>, CliError> {
    tok.encode_to_vec(text, parse_special, add_special)
        .map_err(|e| CliError::new(format!("tokenizing the prompt: {e}")))
}

/// `pinfer tokenize`: ids of a text; works on vocabulary-only files (no tensors are touched).
pub fn tokenize(path: &Path, text: &str, ids_only: bool, parse_special: bool) -> Result<(), CliError> {
    let model = ModelFile::open_static(path)?;
    let gguf = model.parse()?;
    pinfer::model::validate_vocab(&gguf).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let tok = tokenizer(path, &gguf)?;
    let ids = encode(&tok, text, parse_special)?;
    if ids_only {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        outln!("{}", list.join(" "))?;
        return Ok(());
    }
    let mut piece = vec![0u8; StreamDecoder::buffer_len(&tok)];
    for id in ids {
        let n = tok.token_to_piece(id, true, &mut piece).map_err(|e| CliError::new(e.to_string()))?;
        outln!("{id:6} -> '{}'", String::from_utf8_lossy(&piece[..n]))?;
    }
    Ok(())
}
