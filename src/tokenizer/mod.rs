//! Tokenizers built from GGUF metadata that give llama.cpp's token ids, and a UTF-8-safe
//! detokenizer. Nothing here allocates (but std's [`OwnedTokenizer`], once, for its tables).
//!
//! Four vocabulary kinds (`tokenizer.ggml.model`):
//! * `gpt2`: byte-level BPE. Text is cut into words by the pre-tokenizer named by
//!   `tokenizer.ggml.pre` ([`PreTokenizer`], hand-written equivalents of llama.cpp's regexes), and
//!   each word's bytes are merged pairwise by merge rank (`tokenizer.ggml.merges`, rank = index).
//! * `llama`: SentencePiece-style BPE (Gemma 3, TinyLlama, Llama 2): spaces become U+2581, an
//!   optional space is put in front, and adjacent pieces merge by highest score
//!   (`tokenizer.ggml.scores`); what is left that is not a token falls back to `<0xNN>` byte tokens.
//! * `gemma4`: SentencePiece-style BPE ([`VocabKind::SpmBpe`]).
//! * `bert`: WordPiece (`wpm`): lower-cased and accent-stripped as the file says, cut at white
//!   space, punctuation and CJK ideographs, each word the longest pieces from its start, `[CLS] ...
//!   [SEP]` around it; [`Tokenizer::encode_pair`] gives a cross-encoder's `[CLS] a [SEP] b [SEP]`
//!   with its token types.
//!
//! Before either runs, special tokens (types CONTROL and USER_DEFINED, and UNKNOWN) are cut out of
//! the raw text the way llama.cpp's `tokenizer_st_partition` does: longest token text first, each
//! taken at its leftmost occurrences in what is left. User-defined tokens are always matched;
//! control and unknown ones only with `parse_special`.
//!
//! Memory: [`Tokenizer::storage_words`] says how many `u32` the tables need (token offsets,
//! attributes, scores, the token texts, a hash table text → id, a hash table of merges
//! (left id, right id) → (rank, result id), the special-token length index); [`Tokenizer::new`]
//! builds them there in O(n). Encoding needs working memory proportional to the text:
//! [`Tokenizer::encode`] uses a fixed 32 KiB on the stack, [`Tokenizer::encode_with_scratch`] a
//! caller slice of [`Tokenizer::scratch_words`] words; both are O(n log n) in the text length.
//!
//! Input is `&str`, so it is valid UTF-8; callers holding bytes convert them first (for example with
//! `String::from_utf8_lossy`, which is what llama.cpp's U+FFFD substitution amounts to).
//!
//! Known differences from llama.cpp, all on inputs or vocabularies real models do not have:
//! * special tokens of equal length that overlap in the text are taken leftmost first (llama.cpp's
//!   order among them is that of an unstable sort); special tokens whose text is not UTF-8 are
//!   never matched in text;
//! * of llama.cpp's EOT/EOM/FIM token texts (`<|im_end|>`, `<|fim_prefix|>`...), which it makes
//!   control tokens when the file names no id for them, every one present is made control
//!   (llama.cpp: the first its hash map yields);
//! * empty token texts are ignored (llama.cpp renames them `[EMPTY_i]`); merges whose parts are not
//!   tokens are dropped; vocabularies crafted so that texts collide in the hash tables are refused;
//! * a BPE token whose text is not byte-level decodes to its raw text (llama.cpp writes
//!   `[UNK_BYTE_0x...]`); decoding does not apply llama.cpp's `clean_up_tokenization_spaces` (it
//!   changes text, e.g. `" ,"` to `","`) but for WordPiece, where every punctuation mark is a word
//!   of its own and llama.cpp always applies it.
//! * WordPiece follows HF tokenizers (the tokenizer BERT models were trained with) where llama.cpp
//!   differs from it: words of more than 100 characters are `[UNK]` (llama.cpp matches them),
//!   accent stripping drops only nonspacing marks (llama.cpp drops Mc and Me marks too) and
//!   decomposes Hangul syllables into their jamo, U+000B, U+000C and U+0085 are dropped as control
//!   characters (llama.cpp splits words there), and lower-casing without accent stripping turns
//!   U+0130 into "i" and U+0307 (llama.cpp: "i").
//!
//! Here: the vocabulary kind, token attributes, the error type and the tokenizer with its table
//! lookups. `load`: building the tables from the file; `hash`: their hashing and lookup keys;
//! `encode` with `special` (special tokens cut out), `pretok`, `bpe`, `spm` and `wpm`; `decode`: pieces
//! and the UTF-8-safe [`StreamDecoder`]; `owned` (std): [`OwnedTokenizer`], the tables in a heap
//! buffer the tokenizer owns.

mod bpe;
mod decode;
mod encode;
mod hash;
mod heap;
mod load;
#[cfg(feature = "std")]
mod owned;
mod pretok;
mod special;
mod spm;
mod unicode;
mod unicode_tables;
mod wpm;

use core::fmt;

use crate::gguf::{GgufError, Name};

pub use decode::StreamDecoder;
#[cfg(feature = "std")]
pub use owned::OwnedTokenizer;
pub use pretok::PreTokenizer;
pub use unicode_tables::UNICODE_VERSION;
pub use wpm::MAX_WORD_CHARS;

use hash::{merge_hash, Key};
use heap::NONE;

/// Words of stack scratch [`Tokenizer::encode`] uses (32 KiB).
pub const STACK_SCRATCH_WORDS: usize = 8192;

/// Largest vocabulary accepted.
pub const MAX_VOCAB: usize = 1 << 24;
/// Words per special-length record: length, flags, 256-bit first-byte mask, 256-bit last-byte mask.
const SPECIAL_WORDS: usize = 18;
/// Words per token hash slot: id + 1 (0 when empty), hash tag, text offset, text length.
const TOKEN_SLOT: usize = 4;
/// Words per merge hash slot: left id + 1 (0 when empty), right id, rank, result id.
const MERGE_SLOT: usize = 4;

/// Which tokenizer algorithm a vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum VocabKind {
    /// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
    Bpe,
    /// SentencePiece-style (`tokenizer.ggml.model = llama`).
    Spm,
    /// SentencePiece-style BPE (`tokenizer.ggml.model = gemma4`): spaces escaped to U+2581, the
    /// text split only at runs of newlines, BPE merges over raw UTF-8 characters (not byte-level
    /// ones), `<0xNN>` tokens for bytes no token holds.
    SpmBpe,
    /// WordPiece (`tokenizer.ggml.model = bert`): BERT's normalization and word splits, greedy
    /// longest pieces per word, `[CLS]`/`[SEP]` around the text.
    Wpm,
}

/// Token attributes, as llama.cpp derives them from `tokenizer.ggml.token_type` (bit values of
/// `llama_token_attr`, plus [`TokenAttr::EOG`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenAttr(pub u16);

impl TokenAttr {
    /// Type UNKNOWN (2).
    pub const UNKNOWN: u16 = 1;
    /// Type UNUSED (5).
    pub const UNUSED: u16 = 1 << 1;
    /// Type NORMAL (1).
    pub const NORMAL: u16 = 1 << 2;
    /// Type CONTROL (3), or a token llama.cpp treats as control by its text (`<|im_end|>`...).
    pub const CONTROL: u16 = 1 << 3;
    /// Type USER_DEFINED (4).
    pub const USER_DEFINED: u16 = 1 << 4;
    /// Type BYTE (6): text `<0xNN>`, decodes to that byte.
    pub const BYTE: u16 = 1 << 5;
    /// White space left of the token is dropped when it is matched in text (llama.cpp LSTRIP).
    pub const LSTRIP: u16 = 1 << 7;
    /// White space right of the token is dropped when it is matched in text (llama.cpp RSTRIP).
    pub const RSTRIP: u16 = 1 << 8;
    /// Ends generation (EOS, EOT, `<|im_end|>`, `<end_of_turn>`...).
    pub const EOG: u16 = 1 << 15;

    /// Whether all of `bits` are set.
    pub fn has(self, bits: u16) -> bool {
        self.0 & bits == bits
    }

    /// Control or unknown: rendered only when special tokens are asked for.
    pub fn is_control(self) -> bool {
        self.0 & (Self::CONTROL | Self::UNKNOWN) != 0
    }
}

/// Why a tokenizer could not be built, or an encode/decode call could not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokError {
    /// A tokenizer key is missing or has the wrong type.
    Metadata(GgufError),
    /// `tokenizer.ggml.model` is not a tokenizer pinfer implements.
    UnsupportedModel {
        /// The value in the file.
        model: Name,
    },
    /// `tokenizer.ggml.pre` is not a pre-tokenizer pinfer implements.
    UnsupportedPre {
        /// The value in the file.
        pre: Name,
    },
    /// The vocabulary metadata is inconsistent.
    BadVocab {
        /// The key concerned.
        key: &'static str,
        /// What is wrong.
        problem: &'static str,
        /// The index or value that shows it.
        index: u64,
    },
    /// The storage given to [`Tokenizer::new`] is smaller than [`Tokenizer::storage_words`].
    StorageTooSmall {
        /// Words needed.
        needed: usize,
        /// Words given.
        got: usize,
    },
    /// The working memory of an encode call is too small for this text.
    ScratchTooSmall {
        /// Words that are always enough for this text ([`Tokenizer::scratch_words`]).
        needed: usize,
        /// Words given.
        got: usize,
    },
    /// The token output slice is too small; nothing past `got` was written.
    OutputTooSmall {
        /// Tokens the text needs.
        needed: usize,
        /// Room given.
        got: usize,
    },
    /// A byte buffer for decoded text is too small.
    BufferTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// A token id outside the vocabulary.
    InvalidToken {
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_vocab: u32,
    },
    /// SentencePiece byte fallback met a byte for which the vocabulary has no `<0xNN>` token.
    MissingByteToken {
        /// The byte.
        byte: u8,
    },
}

/// Internal marker: the scratch is too small (the caller reports the real sizes).
pub(crate) const SCRATCH: TokError = TokError::ScratchTooSmall { needed: 0, got: 0 };

impl From<GgufError> for TokError {
    fn from(e: GgufError) -> Self {
        TokError::Metadata(e)
    }
}

impl fmt::Display for TokError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Metadata(e) => write!(f, "tokenizer metadata: {e}"),
            Self::UnsupportedModel { model } => write!(
                f,
                "tokenizer.ggml.model {model:?} is not supported (supported: gpt2, llama, gemma4, \
                 bert); use a model with a BPE, SentencePiece or WordPiece vocabulary"
            ),
            Self::UnsupportedPre { pre } => {
                write!(f, "tokenizer.ggml.pre {pre:?} is not supported (supported: ")?;
                for (i, p) in pretok::PRE_TABLE.iter().enumerate() {
                    write!(f, "{}{}", if i > 0 { ", " } else { "" }, p.name)?;
                }
                write!(f, "); the model needs a pre-tokenizer pinfer does not implement")
            }
            Self::BadVocab { key, problem, index } => {
                write!(f, "vocabulary {key}: {problem} ({index}); the file is damaged or badly converted")
            }
            Self::StorageTooSmall { needed, got } => write!(
                f,
                "tokenizer storage has {got} words but needs {needed}; size it with Tokenizer::storage_words"
            ),
            Self::ScratchTooSmall { needed, got } => write!(
                f,
                "tokenizer scratch has {got} words but this text may need {needed}; use \
                 Tokenizer::encode_with_scratch with Tokenizer::scratch_words(text.len()) words"
            ),
            Self::OutputTooSmall { needed, got } => {
                write!(f, "token output has room for {got} tokens but the text needs {needed}")
            }
            Self::BufferTooSmall { needed, got } => {
                write!(f, "text buffer has {got} bytes but needs {needed}")
            }
            Self::InvalidToken { id, n_vocab } => {
                write!(f, "token id {id} is outside the vocabulary (0..{n_vocab})")
            }
            Self::MissingByteToken { byte } => write!(
                f,
                "the vocabulary has no byte token <0x{byte:02X}> for SentencePiece byte fallback; the \
                 file is damaged or badly converted"
            ),
        }
    }
}

impl core::error::Error for TokError {}

fn bad(key: &'static str, problem: &'static str, index: u64) -> TokError {
    TokError::BadVocab { key, problem, index }
}

/// A writer of token ids that counts past the end of its slice, so a too-small output can report
/// the size it needed.
pub(crate) struct Out<'o> {
    buf: &'o mut [u32],
    n: usize,
}

impl Out<'_> {
    #[inline]
    pub(crate) fn push(&mut self, id: u32) {
        if let Some(slot) = self.buf.get_mut(self.n) {
            *slot = id;
        }
        self.n += 1;
    }
}

/// A tokenizer over tables in caller storage. Build it with [`Tokenizer::new`].
pub struct Tokenizer<'a> {
    kind: VocabKind,
    pre: PreTokenizer,
    n_vocab: u32,
    /// `n + 1` offsets into `blob`: token `i` is `blob[offsets[i]..offsets[i + 1]]`.
    offsets: &'a [u32],
    attrs: &'a [u16],
    scores: &'a [f32],
    /// Token hash table, [`TOKEN_SLOT`] words a slot.
    slots: &'a [u32],
    /// Merge hash table, 4 words a slot: left id + 1 (0 when empty), right id, rank, result id.
    merges: &'a [u32],
    /// Special-token lengths, longest first, [`SPECIAL_WORDS`] words each.
    specials: &'a [u32],
    /// Bit sets of the first two and the last two bytes of special tokens (65536 bits each).
    special_pairs: &'a [u32],
    blob: &'a [u8],
    /// BPE: the token of each byte's byte-level character. SPM: `<0xNN>` (or the byte itself).
    byte_tokens: [u32; 256],
    /// BPE: the token whose text is exactly this one byte (llama.cpp's last-resort fallback).
    single_byte: [u32; 256],
    bos: u32,
    eos: u32,
    /// WordPiece: the separator (`[SEP]`) and unknown (`[UNK]`) tokens; NONE for the other kinds.
    sep: u32,
    unk: u32,
    /// WordPiece normalization (`tokenizer.ggml.normalizer.*`).
    lowercase: bool,
    strip_accents: bool,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    ignore_merges: bool,
    max_token_len: usize,
    /// Longest probe sequence of an entry in the token table and in the merge table.
    tok_probes: u32,
    merge_probes: u32,
}

impl fmt::Debug for Tokenizer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("n_vocab", &self.n_vocab)
            .field("n_merges", &(self.merges.len() / MERGE_SLOT))
            .field("bos", &self.bos())
            .field("eos", &self.eos())
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .field("sep", &self.sep())
            .field("unk", &self.unk())
            .finish_non_exhaustive()
    }
}

impl Tokenizer<'_> {
    /// Number of tokens.
    pub fn n_vocab(&self) -> u32 {
        self.n_vocab
    }

    /// The vocabulary kind.
    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    /// The pre-tokenizer (BPE; [`PreTokenizer::Default`] for SentencePiece, which has none).
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        (self.bos != NONE).then_some(self.bos)
    }

    /// The end-of-sequence token, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        (self.eos != NONE).then_some(self.eos)
    }

    /// WordPiece: the token that ends each part (`[SEP]`), which encoding with `add_special` puts
    /// last; none for the other kinds. Its first token (`[CLS]`) is [`Tokenizer::bos`].
    pub fn sep(&self) -> Option<u32> {
        (self.sep != NONE).then_some(self.sep)
    }

    /// WordPiece: the token of words the vocabulary cannot spell (`[UNK]`); none for the other kinds.
    pub fn unk(&self) -> Option<u32> {
        (self.unk != NONE).then_some(self.unk)
    }

    /// Whether encoding with `add_special` puts BOS first (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether encoding with `add_special` puts EOS last (`tokenizer.ggml.add_eos_token`; never for
    /// WordPiece, which ends with [`Tokenizer::sep`] instead, as llama.cpp does whatever the file says).
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether SentencePiece text gets a space in front (`tokenizer.ggml.add_space_prefix`); decoding
    /// then drops the first piece's leading space.
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Whether `id` ends generation (EOS, EOT and the texts llama.cpp treats so).
    pub fn is_eog(&self, id: u32) -> bool {
        (self.eos != NONE && id == self.eos) || self.attr(id).is_ok_and(|a| a.has(TokenAttr::EOG))
    }

    /// The attributes of token `id`.
    pub fn attr(&self, id: u32) -> Result<TokenAttr, TokError> {
        self.check(id)?;
        Ok(TokenAttr(self.attrs[id as usize]))
    }

    /// The text of token `id` as stored in the vocabulary (byte-level or with U+2581).
    pub fn token_text(&self, id: u32) -> Result<&[u8], TokError> {
        self.check(id)?;
        Ok(self.text(id))
    }

    /// The score of token `id` (SentencePiece; 0 for BPE).
    pub fn score(&self, id: u32) -> Result<f32, TokError> {
        self.check(id)?;
        Ok(self.scores.get(id as usize).copied().unwrap_or(0.0))
    }

    /// The longest token text in bytes; no decoded piece is longer.
    pub fn max_piece_len(&self) -> usize {
        self.max_token_len
    }

    /// The token whose vocabulary text is `text`, if any.
    pub fn token_id(&self, text: &[u8]) -> Option<u32> {
        self.find(&text)
    }

    /// Words of scratch that are always enough to encode a text of `text_len` bytes with
    /// [`Tokenizer::encode_with_scratch`] (about 6.1 words a byte; most texts need far less).
    pub fn scratch_words(&self, text_len: usize) -> usize {
        special::marks_words(text_len) + 6 * (text_len + 1) + 16
    }

    #[inline]
    fn check(&self, id: u32) -> Result<(), TokError> {
        if id < self.n_vocab {
            Ok(())
        } else {
            Err(TokError::InvalidToken { id, n_vocab: self.n_vocab })
        }
    }

    /// Text of a valid id.
    #[inline]
    pub(crate) fn text(&self, id: u32) -> &[u8] {
        let i = id as usize;
        &self.blob[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    #[inline]
    pub(crate) fn attr_of(&self, id: u32) -> u16 {
        self.attrs[id as usize]
    }

    #[inline]
    pub(crate) fn score_of(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// The token whose text equals `key`.
    #[inline]
    pub(crate) fn find(&self, key: &impl Key) -> Option<u32> {
        self.find_hashed(key, key.hash())
    }

    /// [`Tokenizer::find`] with the key's hash already known.
    #[inline]
    fn find_hashed(&self, key: &impl Key, h: u64) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let tag = (h >> 32) as u32;
        let mask = self.slots.len() / TOKEN_SLOT - 1;
        let mut s = h as usize & mask;
        for _ in 0..=self.tok_probes {
            let slot = &self.slots[TOKEN_SLOT * s..TOKEN_SLOT * (s + 1)];
            if slot[0] == 0 {
                return None;
            }
            if slot[1] == tag && key.equals(&self.blob[slot[2] as usize..(slot[2] + slot[3]) as usize]) {
                return Some(slot[0] - 1);
            }
            s = (s + 1) & mask;
        }
        None
    }

    /// Rank and result of merging tokens `l` and `r`, if there is such a merge.
    #[inline]
    pub(crate) fn merge(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        if self.merges.is_empty() || l == NONE || r == NONE {
            return None;
        }
        let mask = self.merges.len() / MERGE_SLOT - 1;
        let mut s = merge_hash(l, r) as usize & mask;
        for _ in 0..=self.merge_probes {
            let slot = &self.merges[MERGE_SLOT * s..MERGE_SLOT * (s + 1)];
            if slot[0] == 0 {
                return None;
            }
            if slot[0] == l + 1 && slot[1] == r {
                return Some((slot[2], slot[3]));
            }
            s = (s + 1) & mask;
        }
        None
    }
}

/// The text of byte `b`'s `<0xHH>` token.
pub(crate) fn byte_token_text(b: u8) -> [u8; 6] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    [b'<', b'0', b'x', HEX[(b >> 4) as usize], HEX[(b & 15) as usize], b'>']
}

/// The byte of a `<0xHH>` token text.
pub(crate) fn parse_byte_token(text: &[u8]) -> Option<u8> {
    let hex = |c: u8| (c as char).to_digit(16);
    match text {
        [b'<', b'0', b'x', h, l, b'>'] => Some((hex(*h)? * 16 + hex(*l)?) as u8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token(b"<0x0A>"), Some(10));
        assert_eq!(parse_byte_token(b"<0xff>"), Some(255));
        assert_eq!(parse_byte_token(b"<0x-1>"), None);
        assert_eq!(parse_byte_token(b"<0x0A"), None);
        assert_eq!(parse_byte_token(b"<0xG0>"), None);
    }

    #[test]
    fn errors_name_the_fix() {
        extern crate std;
        use crate::gguf::name_of;
        use std::string::ToString;
        let e = TokError::UnsupportedPre { pre: name_of("falcon") };
        let s = e.to_string();
        assert!(s.contains("\"falcon\"") && s.contains("smollm") && s.contains("llama-bpe"), "{s}");
        let s = TokError::ScratchTooSmall { needed: 10, got: 5 }.to_string();
        assert!(s.contains("encode_with_scratch"), "{s}");
        let s = TokError::InvalidToken { id: 7, n_vocab: 5 }.to_string();
        assert!(s.contains('7') && s.contains("0..5"), "{s}");
    }
}
