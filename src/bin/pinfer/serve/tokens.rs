//! Text to token ids and back for the handlers, with the model's tokenizer.

use pinfer::tokenizer::Tokenizer;

use super::State;

/// Token ids of `text` with the model's BOS rule; special-token text is parsed when `special`.
pub fn encode(state: &State<'_>, text: &str, special: bool) -> Vec<u32> {
    crate::tokenize::encode(&state.ready.tok, text, special).unwrap_or_default()
}

/// Token ids of `text` without BOS/EOS (for /tokenize with add_special false, logit_bias texts).
pub fn encode_plain(tok: &Tokenizer<'_>, text: &str, special: bool) -> Vec<u32> {
    crate::tokenize::encode_with(tok, text, special, false).unwrap_or_default()
}

/// Text of `ids` (special tokens rendered when `special`); invalid UTF-8 becomes U+FFFD. The
/// pieces are joined as they are, as llama-server's /detokenize does: unlike
/// `Tokenizer::decode`, a leading space of the first piece is kept.
pub fn detokenize_text(tok: &Tokenizer<'_>, ids: &[u32], special: bool) -> String {
    let mut piece = vec![0u8; pinfer::tokenizer::StreamDecoder::buffer_len(tok)];
    let mut bytes = Vec::new();
    for &id in ids {
        if let Ok(n) = tok.token_to_piece(id, special, &mut piece) {
            bytes.extend_from_slice(&piece[..n]);
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}
