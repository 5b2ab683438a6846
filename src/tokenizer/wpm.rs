//! WordPiece (BERT, `tokenizer.ggml.model = bert`): one text fragment normalized and cut into words,
//! each word the longest vocabulary pieces from its start (llama.cpp's `llm_tokenizer_wpm_session`,
//! normalized as HF tokenizers' `BertNormalizer` and `BertPreTokenizer` do it).
//!
//! Per character: NUL, U+FFFD and control, format and private use characters (Cc Cf Co, but tab,
//! newline and carriage return) are dropped;
//! white space ends a word; with accent stripping a character becomes its NFD without nonspacing
//! marks, then with lower-casing its lowercase. Each resulting character that is punctuation, an
//! ASCII symbol or a CJK ideograph is a word of its own; any other joins the current word.
//!
//! The vocabulary is llama.cpp's conversion of BERT's: a word's first piece has U+2581 in front
//! (`▁hello`), a continuation piece is stored without its `##` (`lo`), special tokens keep their
//! brackets. A word that some position of cannot be matched, or of more than [`MAX_WORD_CHARS`]
//! characters, is one unknown token. No working memory but one word on the stack.

use super::hash::Concat;
use super::unicode::{flags, lowercase_full, strip_accents, Mapped, SPACE};
use super::{Out, Tokenizer};

/// Longest word in characters (after normalization) that is matched against the vocabulary; a
/// longer one is the unknown token (HF's `max_input_chars_per_word`, 100 in every BERT tokenizer).
pub const MAX_WORD_CHARS: usize = 100;

/// The word being built: its UTF-8 bytes (while it fits) and its length in characters.
struct Word {
    bytes: [u8; 4 * MAX_WORD_CHARS],
    len: usize,
    chars: usize,
}

impl Word {
    fn push(&mut self, cp: u32) {
        self.chars += 1;
        if self.chars > MAX_WORD_CHARS {
            return;
        }
        // Valid code points only reach here: they come from a `&str` or from the tables.
        let c = char::from_u32(cp).unwrap_or('\u{FFFD}');
        self.len += c.encode_utf8(&mut self.bytes[self.len..]).len();
    }

    /// Ends the word: its tokens (or the unknown token) go to `out`.
    fn finish(&mut self, tok: &Tokenizer<'_>, out: &mut Out<'_>) {
        if self.chars > MAX_WORD_CHARS {
            out.push(tok.unk);
        } else if self.chars > 0 {
            match_word(tok, &self.bytes[..self.len], out);
        }
        self.len = 0;
        self.chars = 0;
    }
}

/// Whether `cp` becomes a word of its own: punctuation (`\p{P}`), an ASCII symbol (`$+<=>^`|~`),
/// or a CJK ideograph (BERT's ranges, with HF's start of Extension C+D+E at U+2B920).
fn stands_alone(cp: u32) -> bool {
    flags(cp).is_punctuation()
        || (cp < 0x80 && (cp as u8).is_ascii_punctuation())
        || matches!(
            cp,
            0x4E00..=0x9FFF
                | 0x3400..=0x4DBF
                | 0x20000..=0x2A6DF
                | 0x2A700..=0x2B73F
                | 0x2B740..=0x2B81F
                | 0x2B920..=0x2CEAF
                | 0xF900..=0xFAFF
                | 0x2F800..=0x2FA1F
        )
}

/// Tokenizes one fragment of text (no special tokens in it) and pushes the tokens to `out`.
pub(crate) fn encode(tok: &Tokenizer<'_>, text: &str, out: &mut Out<'_>) {
    let mut word = Word { bytes: [0; 4 * MAX_WORD_CHARS], len: 0, chars: 0 };
    for c in text.chars() {
        let cp = c as u32;
        let f = flags(cp);
        if cp == 0 || cp == 0xFFFD || (f.is_control() && !matches!(c, '\t' | '\n' | '\r')) {
            continue;
        }
        if f.is_whitespace() {
            word.finish(tok, out);
            continue;
        }
        // HF's order: accents stripped, then lower-cased.
        let stripped = if tok.strip_accents { strip_accents(cp) } else { Mapped::one(cp) };
        for &s in stripped.as_slice() {
            let lowered = if tok.lowercase { lowercase_full(s) } else { Mapped::one(s) };
            for &l in lowered.as_slice() {
                if stands_alone(l) {
                    word.finish(tok, out);
                    word.push(l);
                    word.finish(tok, out);
                } else {
                    word.push(l);
                }
            }
        }
    }
    word.finish(tok, out);
}

/// Greedy longest match of a normalized word: from each position the longest vocabulary piece
/// (`▁` in front at the start); the unknown token for the whole word if a position has none.
fn match_word(tok: &Tokenizer<'_>, w: &[u8], out: &mut Out<'_>) {
    let first = out.n;
    let mut i = 0;
    while i < w.len() {
        let prefix: &[u8] = if i == 0 { &SPACE } else { &[] };
        let longest = (i + tok.max_token_len).min(w.len());
        let piece = (i + 1..=longest)
            .rev()
            .filter(|&j| j == w.len() || w[j] & 0xC0 != 0x80)
            .find_map(|j| tok.find(&Concat(prefix, &w[i..j])).map(|id| (id, j)));
        match piece {
            Some((id, j)) => {
                out.push(id);
                i = j;
            }
            None => {
                out.n = first;
                out.push(tok.unk);
                return;
            }
        }
    }
}
