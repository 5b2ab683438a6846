//! Token ids back to text: pieces (llama.cpp's `token_to_piece`), whole sequences
//! (`detokenize`), and a streaming decoder that only ever emits valid UTF-8.

use super::unicode::{char_at, char_to_byte};
use super::{parse_byte_token, TokError, TokenAttr, Tokenizer, VocabKind};

impl Tokenizer<'_> {
    /// Calls `f` with each byte of token `id`'s text piece.
    fn piece_bytes(&self, id: u32, special: bool, mut f: impl FnMut(u8)) -> Result<(), TokError> {
        let a = self.attr(id)?.0;
        let text = self.text(id);
        if a & (TokenAttr::CONTROL | TokenAttr::UNKNOWN) != 0 && !special {
            return Ok(());
        }
        if a & (TokenAttr::CONTROL | TokenAttr::UNKNOWN | TokenAttr::USER_DEFINED) != 0 {
            text.iter().for_each(|&b| f(b));
        } else if a & TokenAttr::NORMAL != 0 {
            match self.kind {
                VocabKind::Spm | VocabKind::SpmBpe | VocabKind::Wpm => {
                    // U+2581 -> space
                    let mut i = 0;
                    while i < text.len() {
                        if text[i..].starts_with(&super::unicode::SPACE) {
                            f(b' ');
                            i += 3;
                        } else {
                            f(text[i]);
                            i += 1;
                        }
                    }
                }
                VocabKind::Bpe => {
                    // Byte-level characters -> bytes; a character outside the mapping stays as it is.
                    let mut i = 0;
                    while i < text.len() {
                        let (cp, l) = char_at(text, i);
                        let l = l.min(text.len() - i);
                        match char_to_byte(cp) {
                            Some(b) if l > 0 => f(b),
                            _ => text[i..i + l].iter().for_each(|&b| f(b)),
                        }
                        i += l.max(1);
                    }
                }
            }
        } else if a & TokenAttr::BYTE != 0 {
            if let Some(b) = parse_byte_token(text) {
                f(b);
            }
        }
        Ok(())
    }

    /// Writes the text of token `id` into `buf` and returns its length in bytes: byte-level BPE
    /// characters become their bytes, SentencePiece U+2581 a space, `<0xNN>` tokens their byte.
    /// Control and unknown tokens give nothing unless `special`. The piece may end inside a UTF-8
    /// character; [`StreamDecoder`] joins pieces safely.
    pub fn token_to_piece(&self, id: u32, special: bool, buf: &mut [u8]) -> Result<usize, TokError> {
        let mut n = 0;
        self.piece_bytes(id, special, |b| {
            if let Some(slot) = buf.get_mut(n) {
                *slot = b;
            }
            n += 1;
        })?;
        if n > buf.len() {
            return Err(TokError::BufferTooSmall { needed: n, got: buf.len() });
        }
        Ok(n)
    }

    /// Writes the text of `tokens` into `buf` and returns its length, as llama.cpp's `detokenize`
    /// (special tokens kept as tokens, rendered only if `special`): with
    /// [`Tokenizer::add_space_prefix`], the first token's leading space is dropped. The bytes are
    /// those of the pieces; they are valid UTF-8 when the tokens came from encoding text.
    /// WordPiece pieces are joined as llama.cpp joins them: a word's first piece has a space in
    /// front (so the text starts with one), and its `clean_up_tokenization_spaces` runs over the
    /// result (no space before `?!.,`, none around a lone `'`, none before `'s 'm 're 've`).
    /// `buf` needs the length before that clean-up.
    pub fn decode(&self, tokens: &[u32], special: bool, buf: &mut [u8]) -> Result<usize, TokError> {
        let mut n = 0;
        let mut strip = self.add_space_prefix;
        for &id in tokens {
            let mut first = true;
            self.piece_bytes(id, special, |b| {
                let skip = strip && first && b == b' ';
                first = false;
                if !skip {
                    if let Some(slot) = buf.get_mut(n) {
                        *slot = b;
                    }
                    n += 1;
                }
            })?;
            strip = false;
        }
        if n > buf.len() {
            return Err(TokError::BufferTooSmall { needed: n, got: buf.len() });
        }
        if self.kind == VocabKind::Wpm {
            n = clean_up_spaces(&mut buf[..n]);
        }
        Ok(n)
    }
}

/// llama.cpp's `clean_spaces` passes over decoded text, in place; returns the new length. Each
/// pass compacts the text and reads its neighbours as they were before the pass.
fn clean_up_spaces(text: &mut [u8]) -> usize {
    // " ?", " !", " .", " ," lose their space.
    let n =
        compact(text, text.len(), |t, i| t[i - 1] == b' ' && matches!(t[i], b'?' | b'!' | b'.' | b','), 0);
    // " ' " becomes "'".
    let n =
        compact(text, n, |t, i| t[i] == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ', 1);
    // " 's", " 'm", " 're", " 've" lose their space (" 't", " 'd", " 'll" keep it).
    compact(
        text,
        n,
        |t, i| {
            t[i - 1] == b' '
                && t[i] == b'\''
                && matches!(
                    (t.get(i + 1), t.get(i + 2)),
                    (Some(b's' | b'm'), _) | (Some(b'r' | b'v'), Some(b'e'))
                )
        },
        0,
    )
}

/// One clean-up pass over `text[..n]`: where `drop_space(original, i)` holds for byte `i` (never
/// the first), the space before it goes, and `skip_after` bytes after it too. Returns the new length.
fn compact(text: &mut [u8], n: usize, drop_space: impl Fn(&[u8], usize) -> bool, skip_after: usize) -> usize {
    if n == 0 {
        return 0;
    }
    // In place: a write never lands past the byte being read, so a decision sees the bytes around
    // it as they were, but for a skipped byte, which is blanked (llama.cpp writes a NUL there).
    let mut w = 1;
    let mut i = 1;
    while i < n {
        if drop_space(&text[..n], i) {
            w -= 1;
            text[w] = text[i];
            w += 1;
            for _ in 0..skip_after {
                i += 1;
                if i < n {
                    text[i] = 0;
                }
            }
        } else {
            text[w] = text[i];
            w += 1;
        }
        i += 1;
    }
    w
}

/// Joins token pieces into text that is always valid UTF-8: the bytes of a character split over
/// several tokens (CJK, emoji, `<0xNN>` byte tokens) are held back until it is complete. A byte that
/// can never be part of a valid character, or an incomplete character followed by something that
/// cannot continue it, becomes one U+FFFD per maximal invalid part, as
/// `String::from_utf8_lossy` does; so the concatenated output equals the lossy conversion of all
/// the pieces' bytes.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: [u8; 4],
    n: u8,
    need: u8,
}

const REPLACEMENT: [u8; 3] = [0xEF, 0xBF, 0xBD];

impl StreamDecoder {
    /// A decoder with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of output buffer always enough for one [`StreamDecoder::push`] on `tok`.
    pub fn buffer_len(tok: &Tokenizer<'_>) -> usize {
        3 * (tok.max_piece_len() + 4)
    }

    /// Whether an incomplete character is held back.
    pub fn has_pending(&self) -> bool {
        self.n > 0
    }

    /// Appends token `id`'s piece (special tokens rendered if `special`) and returns the text that is
    /// now complete, written at the start of `out`, which must have at least
    /// [`StreamDecoder::buffer_len`] bytes (else [`TokError::BufferTooSmall`], with nothing consumed).
    pub fn push<'o>(
        &mut self,
        tok: &Tokenizer<'_>,
        id: u32,
        special: bool,
        out: &'o mut [u8],
    ) -> Result<&'o str, TokError> {
        tok.check(id)?;
        let needed = 3 * (tok.text(id).len() + 4);
        if out.len() < needed {
            return Err(TokError::BufferTooSmall { needed, got: out.len() });
        }
        let mut w = 0;
        tok.piece_bytes(id, special, |b| self.feed(b, out, &mut w))?;
        Ok(as_str(&out[..w]))
    }

    /// Ends the stream: an incomplete character still held back becomes U+FFFD. `out` needs 3 bytes.
    pub fn finish<'o>(&mut self, out: &'o mut [u8]) -> &'o str {
        let mut w = 0;
        if self.n > 0 && out.len() >= 3 {
            put(out, &mut w, &REPLACEMENT);
            self.n = 0;
        }
        as_str(&out[..w])
    }

    fn feed(&mut self, b: u8, out: &mut [u8], w: &mut usize) {
        if self.n > 0 {
            let lead = self.pending[0];
            let ok = match (self.n, lead) {
                (1, 0xE0) => (0xA0..=0xBF).contains(&b),
                (1, 0xED) => (0x80..=0x9F).contains(&b),
                (1, 0xF0) => (0x90..=0xBF).contains(&b),
                (1, 0xF4) => (0x80..=0x8F).contains(&b),
                _ => (0x80..=0xBF).contains(&b),
            };
            if ok {
                self.pending[self.n as usize] = b;
                self.n += 1;
                if self.n == self.need {
                    let done = self.pending;
                    put(out, w, &done[..self.n as usize]);
                    self.n = 0;
                }
                return;
            }
            put(out, w, &REPLACEMENT);
            self.n = 0;
        }
        match b {
            0x00..=0x7F => put(out, w, &[b]),
            0xC2..=0xDF => self.start(b, 2),
            0xE0..=0xEF => self.start(b, 3),
            0xF0..=0xF4 => self.start(b, 4),
            _ => put(out, w, &REPLACEMENT),
        }
    }

    fn start(&mut self, b: u8, need: u8) {
        self.pending[0] = b;
        self.n = 1;
        self.need = need;
    }
}

#[inline]
fn put(out: &mut [u8], w: &mut usize, bytes: &[u8]) {
    out[*w..*w + bytes.len()].copy_from_slice(bytes);
    *w += bytes.len();
}

/// The decoder writes only complete, valid characters.
fn as_str(bytes: &[u8]) -> &str {
    debug_assert!(core::str::from_utf8(bytes).is_ok());
    core::str::from_utf8(bytes).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::string::String;
    use std::vec::Vec;

    /// Feeds bytes in chunks and compares with `String::from_utf8_lossy`.
    fn lossy_in_chunks(bytes: &[u8], chunk: usize) -> String {
        let mut d = StreamDecoder::new();
        let mut s = String::new();
        let mut out = [0u8; 64];
        for c in bytes.chunks(chunk) {
            let mut w = 0;
            for &b in c {
                d.feed(b, &mut out, &mut w);
            }
            s.push_str(core::str::from_utf8(&out[..w]).unwrap());
        }
        s.push_str(d.finish(&mut out));
        s
    }

    #[test]
    fn matches_from_utf8_lossy_on_all_short_sequences() {
        let interesting = [
            0x00u8, 0x41, 0x7F, 0x80, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x90,
            0xA0, 0x9F,
        ];
        let mut seq = Vec::new();
        for &a in &interesting {
            for &b in &interesting {
                for &c in &interesting {
                    for &d in &[0x80u8, 0x41, 0xBF] {
                        seq.clear();
                        seq.extend_from_slice(&[a, b, c, d]);
                        let want = String::from_utf8_lossy(&seq);
                        for chunk in 1..=4 {
                            assert_eq!(lossy_in_chunks(&seq, chunk), want, "{seq:02X?} chunk {chunk}");
                        }
                    }
                }
            }
        }
        let text = "日本語 😀👍🏽 é".as_bytes();
        assert_eq!(lossy_in_chunks(text, 1), "日本語 😀👍🏽 é");
    }
}
