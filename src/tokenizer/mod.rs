//! Tokenizers built from GGUF metadata that give llama.cpp's token ids, and a UTF-8-safe
//! detokenizer. Nothing here allocates.
//!
//! Two vocabulary kinds (`tokenizer.ggml.model`):
//! * `gpt2`: byte-level BPE. Text is cut into words by the pre-tokenizer named by
//!   `tokenizer.ggml.pre` ([`PreTokenizer`], hand-written equivalents of llama.cpp's regexes), and
//!   each word's bytes are merged pairwise by merge rank (`tokenizer.ggml.merges`, rank = index).
//! * `llama`: SentencePiece-style BPE (Gemma 3, TinyLlama, Llama 2): spaces become U+2581, an
//!   optional space is put in front, and adjacent pieces merge by highest score
//!   (`tokenizer.ggml.scores`); what is left that is not a token falls back to `<0xNN>` byte tokens.
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
//!   changes text, e.g. `" ,"` to `","`).

mod bpe;
mod decode;
mod heap;
mod pretok;
mod special;
mod spm;
mod unicode;
mod unicode_tables;

use core::fmt;

pub use decode::StreamDecoder;
pub use pretok::PreTokenizer;
pub use unicode_tables::UNICODE_VERSION;

use crate::gguf::{name_of, Gguf, GgufError, Name, Value, ValueType};
use heap::NONE;

/// Words of stack scratch [`Tokenizer::encode`] uses (32 KiB).
pub const STACK_SCRATCH_WORDS: usize = 8192;

/// Most distinct special-token text lengths accepted.
const MAX_SPECIAL_LENGTHS: usize = 256;
/// Longest probe sequence accepted in the hash tables. Real vocabularies stay far below it (the
/// hash is good and the tables at most 2/3 full); a file crafted to make token texts collide is
/// refused instead of making every lookup slow.
const PROBE_LIMIT: u32 = 1024;
/// Largest vocabulary accepted.
pub const MAX_VOCAB: usize = 1 << 24;
/// Words per special-length record: length, flags, 256-bit first-byte mask, 256-bit last-byte mask.
const SPECIAL_WORDS: usize = 18;
/// Words per token hash slot: id + 1 (0 when empty), hash tag, text offset, text length.
const TOKEN_SLOT: usize = 4;
/// Words per merge hash slot: left id + 1 (0 when empty), right id, rank, result id.
const MERGE_SLOT: usize = 4;
/// Merges looked up together while building.
const MERGE_BATCH: usize = 64;

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
                "tokenizer.ggml.model {model:?} is not supported (supported: gpt2, llama); use a model \
                 with a BPE or SentencePiece vocabulary"
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

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

/// Token texts llama.cpp makes control tokens (and end-of-generation ones) whatever their type:
/// its lists of EOG texts, and of EOT/EOM/FIM texts (used only when the file names no id for them).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// (key, texts): control by text unless the file gives the key's id.
const KEYED_CONTROL_TEXTS: &[(&str, &[&str])] = &[
    (
        "tokenizer.ggml.eot_token_id",
        &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
    ),
    ("tokenizer.ggml.eom_token_id", &["<|eom_id|>"]),
    (
        "tokenizer.ggml.fim_pre_token_id",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_suf_token_id",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_mid_token_id",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    ("tokenizer.ggml.fim_pad_token_id", &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// Texts llama.cpp always renders (gpt-oss): made user-defined.
const USER_DEFINED_TEXTS: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// What `storage_words` and `new` both derive from the file before building.
struct Plan {
    kind: VocabKind,
    pre: PreTokenizer,
    ignore_merges: bool,
    add_bos_default: bool,
    n: usize,
    blob_bytes: usize,
    n_merges: usize,
    n_lengths: usize,
    tok_cap: usize,
    merge_cap: usize,
}

impl Plan {
    fn of(g: &Gguf<'_>) -> Result<Self, TokError> {
        let model = g.get_str(KEY_MODEL)?;
        let kind = match model {
            "gpt2" => VocabKind::Bpe,
            "llama" => VocabKind::Spm,
            "gemma4" => VocabKind::SpmBpe,
            other => return Err(TokError::UnsupportedModel { model: name_of(other) }),
        };
        let (pre, ignore_merges, add_bos_default) = match kind {
            VocabKind::Spm => (PreTokenizer::Default, false, true),
            // Its split is fixed (runs of newlines); llama.cpp adds BOS whatever the file says.
            VocabKind::SpmBpe => (PreTokenizer::Default, false, true),
            VocabKind::Bpe => {
                let name = g.get_str_opt(KEY_PRE)?.unwrap_or("default");
                let e = pretok::lookup_pre(name)
                    .ok_or_else(|| TokError::UnsupportedPre { pre: name_of(name) })?;
                (e.pre, e.ignore_merges, e.add_bos)
            }
        };
        let tokens = g.get_array(KEY_TOKENS, ValueType::String)?;
        let n = tokens.len();
        if n == 0 || n > MAX_VOCAB {
            return Err(bad(KEY_TOKENS, "vocabulary size out of range", n as u64));
        }
        let types = token_types(g, n)?;
        let mut blob_bytes = 0usize;
        let mut lengths: heapless::Vec<u32, MAX_SPECIAL_LENGTHS> = heapless::Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            let Value::String(text) = t else {
                return Err(bad(KEY_TOKENS, "token is not a string", i as u64));
            };
            blob_bytes += text.len();
            let ty = types.map_or(1, |ty| ty.get_fixed(i).and_then(|v| v.as_integer()).unwrap_or(1));
            let special_by_type = matches!(ty, 2..=4);
            if !text.is_empty() && (special_by_type || may_be_special_by_text(text)) {
                let len = text.len() as u32;
                if !lengths.contains(&len) && lengths.push(len).is_err() {
                    return Err(bad(
                        KEY_TOKENS,
                        "too many distinct special-token lengths",
                        MAX_SPECIAL_LENGTHS as u64,
                    ));
                }
            }
        }
        if blob_bytes > u32::MAX as usize {
            return Err(bad(KEY_TOKENS, "token texts exceed 4 GiB in total", blob_bytes as u64));
        }
        let n_merges = match kind {
            VocabKind::Bpe | VocabKind::SpmBpe => g.get_array(KEY_MERGES, ValueType::String)?.len(),
            VocabKind::Spm => 0,
        };
        // Load factors of at most 2/3 (linear probing).
        let tok_cap = (n + n / 2 + 1).next_power_of_two().max(16);
        let merge_cap =
            if n_merges == 0 { 0 } else { (n_merges + n_merges / 2 + 1).next_power_of_two().max(16) };
        Ok(Plan {
            kind,
            pre,
            ignore_merges,
            add_bos_default,
            n,
            blob_bytes,
            n_merges,
            n_lengths: lengths.len(),
            tok_cap,
            merge_cap,
        })
    }

    /// Section sizes in words, in storage order: offsets, attributes, scores, token slots, merge
    /// slots, special lengths, text blob.
    fn sections(&self) -> [usize; 7] {
        [
            self.n + 1,
            self.n.div_ceil(2),
            if self.kind == VocabKind::Spm { self.n } else { 0 },
            TOKEN_SLOT * self.tok_cap,
            MERGE_SLOT * self.merge_cap,
            if self.n_lengths > 0 { special::PAIR_WORDS + SPECIAL_WORDS * self.n_lengths } else { 0 },
            self.blob_bytes.div_ceil(4),
        ]
    }

    fn words(&self) -> usize {
        self.sections().iter().sum()
    }
}

/// Whether `text` is one llama.cpp may turn into a special token by its text alone.
fn may_be_special_by_text(text: &[u8]) -> bool {
    // All those texts are 3 to 30 bytes long and start with '<', '[', '_' or U+2581.
    if !(3..=30).contains(&text.len()) || !matches!(text[0], b'<' | b'[' | b'_' | 0xE2) {
        return false;
    }
    let any = |list: &[&str]| list.iter().any(|s| s.as_bytes() == text);
    any(EOG_TEXTS) || any(USER_DEFINED_TEXTS) || KEYED_CONTROL_TEXTS.iter().any(|(_, l)| any(l))
}

/// The token type array, if any (int32, at least `n` long).
fn token_types<'g>(g: &Gguf<'g>, n: usize) -> Result<Option<crate::gguf::ArrayView<'g>>, TokError> {
    let types = g.get_array_opt(KEY_TYPES, ValueType::I32)?;
    if let Some(t) = &types {
        if t.len() < n {
            return Err(bad(KEY_TYPES, "shorter than the token list", t.len() as u64));
        }
    }
    Ok(types)
}

/// FNV-1a over bytes, with a final mix; the low bits pick a slot, the high 32 are the tag.
#[derive(Clone, Copy)]
pub(crate) struct Hasher(u64);

impl Hasher {
    #[inline]
    pub(crate) fn new() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }

    #[inline]
    pub(crate) fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }

    #[inline]
    pub(crate) fn bytes(&mut self, s: &[u8]) {
        for &b in s {
            self.byte(b);
        }
    }

    #[inline]
    pub(crate) fn finish(self) -> u64 {
        mix(self.0)
    }
}

#[inline]
fn mix(mut h: u64) -> u64 {
    h ^= h >> 32;
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^= h >> 32;
    h
}

/// A byte sequence that can be looked up in the token table without being materialized: raw
/// text, text with spaces escaped to U+2581, or bytes in GPT-2's byte-level characters.
pub(crate) trait Key {
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Calls `f` with each byte in order until it returns false; whether all returned true.
    fn all(&self, f: impl FnMut(u8) -> bool) -> bool;

    fn hash(&self) -> u64 {
        let mut h = Hasher::new();
        self.all(|b| {
            h.byte(b);
            true
        });
        h.finish()
    }

    fn equals(&self, text: &[u8]) -> bool {
        if self.len() != text.len() {
            return false;
        }
        let mut i = 0;
        self.all(|b| {
            let same = text[i] == b;
            i += 1;
            same
        })
    }
}

impl Key for &[u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.iter().all(|&b| f(b))
    }

    fn hash(&self) -> u64 {
        let mut h = Hasher::new();
        h.bytes(self);
        h.finish()
    }

    fn equals(&self, text: &[u8]) -> bool {
        *self == text
    }
}

/// Two byte strings one after the other (a merge's two halves).
struct Concat<'k>(&'k [u8], &'k [u8]);

impl Key for Concat<'_> {
    fn len(&self) -> usize {
        self.0.len() + self.1.len()
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.0.iter().chain(self.1.iter()).all(|&b| f(b))
    }
}

/// Raw bytes seen as GPT-2 byte-level characters (each byte becomes a 1- or 2-byte character).
pub(crate) struct ByteLevel<'k>(pub(crate) &'k [u8]);

impl Key for ByteLevel<'_> {
    fn len(&self) -> usize {
        self.0.iter().map(|&b| unicode::BYTE_TO_UTF8[b as usize].1 as usize).sum()
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.0.iter().all(|&b| {
            let (enc, n) = unicode::BYTE_TO_UTF8[b as usize];
            f(enc[0]) && (n == 1 || f(enc[1]))
        })
    }
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
            .finish_non_exhaustive()
    }
}

/// Takes the first `n` words off the front of `rest`.
fn take<'s>(rest: &mut &'s mut [u32], n: usize) -> &'s mut [u32] {
    let (head, tail) = core::mem::take(rest).split_at_mut(n);
    *rest = tail;
    head
}

impl<'a> Tokenizer<'a> {
    /// How many `u32` words of storage [`Tokenizer::new`] needs for this file's vocabulary.
    pub fn storage_words(g: &Gguf<'_>) -> Result<usize, TokError> {
        Ok(Plan::of(g)?.words())
    }

    /// Builds the tokenizer of `g`'s vocabulary in `storage` (at least
    /// [`Tokenizer::storage_words`] words), in time linear in the vocabulary and merges.
    pub fn new(g: &Gguf<'_>, storage: &'a mut [u32]) -> Result<Self, TokError> {
        let plan = Plan::of(g)?;
        let needed = plan.words();
        if storage.len() < needed {
            return Err(TokError::StorageTooSmall { needed, got: storage.len() });
        }
        let n = plan.n;
        let [s_off, s_attr, s_score, s_slot, s_merge, s_spec, s_blob] = plan.sections();
        let mut rest: &'a mut [u32] = storage;
        let offsets = take(&mut rest, s_off);
        let attrs: &'a mut [u16] = &mut bytemuck::cast_slice_mut(take(&mut rest, s_attr))[..n];
        let scores: &'a mut [f32] = bytemuck::cast_slice_mut(take(&mut rest, s_score));
        let slots = take(&mut rest, s_slot);
        let merges = take(&mut rest, s_merge);
        let specials = take(&mut rest, s_spec);
        let blob: &'a mut [u8] = &mut bytemuck::cast_slice_mut(take(&mut rest, s_blob))[..plan.blob_bytes];

        // Texts, attributes and scores.
        let tokens = g.get_array(KEY_TOKENS, ValueType::String)?;
        let types = token_types(g, n)?;
        let score_view = match g.get(KEY_SCORES) {
            None => None,
            Some(Value::Array(a)) if matches!(a.elem_type(), ValueType::F32 | ValueType::I32) => {
                if a.len() < n {
                    return Err(bad(KEY_SCORES, "shorter than the token list", a.len() as u64));
                }
                Some(a)
            }
            Some(_) => return Err(bad(KEY_SCORES, "must be an array of float32 or int32", 0)),
        };
        let mut pos = 0usize;
        let mut max_token_len = 0;
        for (i, t) in tokens.iter().enumerate().take(n) {
            let Value::String(text) = t else {
                return Err(bad(KEY_TOKENS, "token is not a string", i as u64));
            };
            offsets[i] = pos as u32;
            blob[pos..pos + text.len()].copy_from_slice(text);
            pos += text.len();
            max_token_len = max_token_len.max(text.len());
            let ty = types.map_or(1, |ty| ty.get_fixed(i).and_then(|v| v.as_integer()).unwrap_or(1));
            attrs[i] = match ty {
                1 => TokenAttr::NORMAL,
                2 => TokenAttr::UNKNOWN,
                3 => TokenAttr::CONTROL,
                4 => TokenAttr::USER_DEFINED,
                5 => TokenAttr::UNUSED,
                6 => {
                    if parse_byte_token(text).is_none() {
                        return Err(bad(
                            KEY_TOKENS,
                            "byte token is not of the form <0xHH> at index",
                            i as u64,
                        ));
                    }
                    TokenAttr::BYTE
                }
                _ => 0,
            };
            if let Some(sv) = &score_view {
                let s = match sv.get_fixed(i) {
                    Some(Value::F32(v)) => v,
                    Some(Value::I32(v)) => v as f32,
                    _ => 0.0,
                };
                if let Some(slot) = scores.get_mut(i) {
                    *slot = s;
                }
            }
        }
        offsets[n] = pos as u32;

        let mut tok = Tokenizer {
            kind: plan.kind,
            pre: plan.pre,
            n_vocab: n as u32,
            offsets,
            attrs: &[],
            scores,
            slots: &[],
            merges: &[],
            specials: &[],
            special_pairs: &[],
            blob,
            byte_tokens: [NONE; 256],
            single_byte: [NONE; 256],
            bos: NONE,
            eos: NONE,
            add_bos: false,
            add_eos: false,
            add_space_prefix: plan.kind == VocabKind::Spm,
            ignore_merges: plan.ignore_merges,
            max_token_len,
            tok_probes: 0,
            merge_probes: 0,
        };

        // Token table; duplicate texts are refused, as llama.cpp does.
        let mask = plan.tok_cap - 1;
        slots.fill(0);
        for id in 0..n {
            let (off, end) = (tok.offsets[id], tok.offsets[id + 1]);
            let text = &tok.blob[off as usize..end as usize];
            if text.is_empty() {
                continue;
            }
            let h = text.hash();
            let tag = (h >> 32) as u32;
            let mut s = h as usize & mask;
            for probe in 0.. {
                let slot = &mut slots[TOKEN_SLOT * s..TOKEN_SLOT * (s + 1)];
                if slot[0] == 0 {
                    slot.copy_from_slice(&[id as u32 + 1, tag, off, end - off]);
                    tok.tok_probes = tok.tok_probes.max(probe);
                    break;
                }
                if slot[1] == tag && tok.blob[slot[2] as usize..(slot[2] + slot[3]) as usize] == *text {
                    return Err(bad(KEY_TOKENS, "token text appears twice, second at index", id as u64));
                }
                if probe == PROBE_LIMIT {
                    return Err(bad(
                        KEY_TOKENS,
                        "token texts crafted to collide in the hash table, at index",
                        id as u64,
                    ));
                }
                s = (s + 1) & mask;
            }
        }
        tok.slots = slots;

        // Attributes llama.cpp derives from token texts and the model name.
        tok.apply_text_rules(g, attrs)?;
        tok.attrs = attrs;

        // Byte tables.
        for b in 0..=255u8 {
            tok.byte_tokens[b as usize] = match plan.kind {
                VocabKind::Bpe => {
                    let (enc, len) = unicode::BYTE_TO_UTF8[b as usize];
                    tok.find(&&enc[..len as usize]).unwrap_or(NONE)
                }
                VocabKind::Spm => {
                    tok.find(&&byte_token_text(b)[..]).or_else(|| tok.find(&&[b][..])).unwrap_or(NONE)
                }
                VocabKind::SpmBpe => tok.find(&&byte_token_text(b)[..]).unwrap_or(NONE),
            };
            tok.single_byte[b as usize] = tok.find(&&[b][..]).unwrap_or(NONE);
        }

        let mut merge_probes = 0;
        // Merges: "left right" (split at the first space after the first byte) -> (rank, result).
        if matches!(plan.kind, VocabKind::Bpe | VocabKind::SpmBpe) {
            merges.fill(0);
            let list = g.get_array(KEY_MERGES, ValueType::String)?;
            let mut items = list.iter().enumerate().take(plan.n_merges);
            // In batches, so that the table lookups of many merges are in flight at once: the
            // tables are far larger than the caches and each lookup is a chain of misses.
            let mut batch: heapless::Vec<(u32, &[u8], usize), MERGE_BATCH> = heapless::Vec::new();
            loop {
                batch.clear();
                for (rank, m) in items.by_ref() {
                    let Value::String(m) = m else {
                        return Err(bad(KEY_MERGES, "merge is not a string", rank as u64));
                    };
                    let Some(sp) = m.iter().skip(1).position(|&c| c == b' ').map(|p| p + 1) else { continue };
                    if batch.push((rank as u32, m, sp)).is_err() || batch.is_full() {
                        break;
                    }
                }
                if batch.is_empty() {
                    break;
                }
                merge_probes = merge_probes.max(tok.insert_merges(&batch, merges)?);
            }
        }
        tok.merges = merges;
        tok.merge_probes = merge_probes;

        // Special-token lengths, longest first, with byte masks for a quick scan.
        if !specials.is_empty() {
            let (pairs, records) = specials.split_at_mut(special::PAIR_WORDS);
            let n_lengths = special::build_lengths(&tok, pairs, records);
            tok.special_pairs = pairs;
            tok.specials = &records[..n_lengths * SPECIAL_WORDS];
        }

        tok.read_special_ids(g, plan.add_bos_default)?;
        Ok(tok)
    }

    /// Control/user-defined/EOG attributes by text, llama.cpp's workarounds, and phi-3's RSTRIP.
    fn apply_text_rules(&self, g: &Gguf<'_>, attrs: &mut [u16]) -> Result<(), TokError> {
        let find = |s: &str| self.find(&s.as_bytes());
        for &(key, texts) in KEYED_CONTROL_TEXTS {
            if g.get(key).is_none() {
                for id in texts.iter().filter_map(|t| find(t)) {
                    attrs[id as usize] |= TokenAttr::CONTROL;
                }
            }
        }
        for id in EOG_TEXTS.iter().filter_map(|t| find(t)) {
            attrs[id as usize] |= TokenAttr::CONTROL | TokenAttr::EOG;
        }
        // Ids the file names as ending generation.
        for key in [
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        ] {
            if let Ok(Some(id)) = g.get_int::<u32>(key) {
                if let Some(a) = attrs.get_mut(id as usize) {
                    *a |= TokenAttr::EOG;
                }
            }
        }
        for id in USER_DEFINED_TEXTS.iter().filter_map(|t| find(t)) {
            attrs[id as usize] = TokenAttr::USER_DEFINED;
        }
        // gpt-oss and solar-open: <|end|> is not end-of-generation there, and is rendered.
        let has = |s: &str| find(s).is_some();
        if (has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")) {
            if let Some(id) = find("<|end|>") {
                attrs[id as usize] = TokenAttr::USER_DEFINED;
            }
        }
        // gemma4 and paddleocr: </s> is an ordinary token when <|tool_response> exists.
        if has("<|tool_response>") {
            if let Some(id) = find("</s>") {
                attrs[id as usize] = TokenAttr::NORMAL;
            }
        }
        // Phi-3: white space after special tokens is dropped, except after <unk>, <s>, <|endoftext|>.
        let name = g.get_str_opt("general.name")?.unwrap_or("");
        if contains_ascii_ci(name, "phi-3") || contains_ascii_ci(name, "phi3") {
            let special = TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN;
            for a in attrs.iter_mut().filter(|a| **a & special != 0) {
                *a |= TokenAttr::RSTRIP;
            }
            if let Some(id) = find("</s>") {
                attrs[id as usize] |= TokenAttr::RSTRIP;
            }
            for id in ["<unk>", "<s>", "<|endoftext|>"].iter().filter_map(|t| find(t)) {
                attrs[id as usize] &= !TokenAttr::RSTRIP;
            }
        }
        Ok(())
    }

    /// Adds a batch of merges (rank, "left right", position of the space) to the merge table. The
    /// first probe of every lookup is read before any lookup runs, so the cache misses overlap.
    fn insert_merges(&self, batch: &[(u32, &[u8], usize)], merges: &mut [u32]) -> Result<u32, TokError> {
        let mut longest = 0;
        let tok_mask = self.slots.len() / TOKEN_SLOT - 1;
        let mut hashes = [[0u64; 3]; MERGE_BATCH];
        let mut warm = 0u32;
        for (k, &(_, m, sp)) in batch.iter().enumerate() {
            let (left, right) = (&m[..sp], &m[sp + 1..]);
            hashes[k] = [left.hash(), right.hash(), Concat(left, right).hash()];
            for h in hashes[k] {
                warm ^= self.slots[TOKEN_SLOT * (h as usize & tok_mask) + 2];
            }
        }
        for h in hashes.iter().take(batch.len()).flatten() {
            let off = self.slots[TOKEN_SLOT * (*h as usize & tok_mask) + 2] as usize;
            warm ^= u32::from(self.blob.get(off).copied().unwrap_or(0));
        }
        let mut found = [(NONE, NONE, NONE); MERGE_BATCH];
        let mask = merges.len() / MERGE_SLOT - 1;
        for (k, &(_, m, sp)) in batch.iter().enumerate() {
            let (left, right) = (&m[..sp], &m[sp + 1..]);
            let [hl, hr, hc] = hashes[k];
            let (Some(l), Some(r)) = (self.find_hashed(&left, hl), self.find_hashed(&right, hr)) else {
                continue;
            };
            found[k] = (l, r, self.find_hashed(&Concat(left, right), hc).unwrap_or(NONE));
        }
        for &(l, r, _) in found.iter().take(batch.len()).filter(|f| f.0 != NONE) {
            warm ^= merges[MERGE_SLOT * (merge_hash(l, r) as usize & mask)];
        }
        core::hint::black_box(warm);
        for (k, &(rank, _, _)) in batch.iter().enumerate() {
            let (l, r, result) = found[k];
            if l == NONE {
                continue;
            }
            let mut s = merge_hash(l, r) as usize & mask;
            for probe in 0.. {
                let slot = &mut merges[MERGE_SLOT * s..MERGE_SLOT * (s + 1)];
                if slot[0] == 0 {
                    slot.copy_from_slice(&[l + 1, r, rank, result]);
                    longest = longest.max(probe);
                    break;
                }
                if slot[0] == l + 1 && slot[1] == r {
                    break; // llama.cpp keeps the first rank of a repeated pair
                }
                if probe == PROBE_LIMIT {
                    return Err(bad(
                        KEY_MERGES,
                        "merges crafted to collide in the hash table, at index",
                        u64::from(rank),
                    ));
                }
                s = (s + 1) & mask;
            }
        }
        Ok(longest)
    }

    /// BOS/EOS ids and the add_* flags, with llama.cpp's defaults.
    fn read_special_ids(&mut self, g: &Gguf<'_>, add_bos_default: bool) -> Result<(), TokError> {
        let n = self.n_vocab;
        let (bos_default, eos_default) = match self.kind {
            VocabKind::Spm => (1, 2),
            VocabKind::Bpe => (11, 11),
            VocabKind::SpmBpe => (NONE, NONE),
        };
        let id = |key: &str, default: u32| -> Result<u32, TokError> {
            let default = if default < n { default } else { NONE };
            Ok(match g.get_int::<i64>(key) {
                Ok(Some(v)) if (0..i64::from(n)).contains(&v) => v as u32,
                Ok(_) => default,
                Err(e) => return Err(e.into()),
            })
        };
        self.bos = id("tokenizer.ggml.bos_token_id", bos_default)?;
        self.eos = id("tokenizer.ggml.eos_token_id", eos_default)?;
        self.add_bos = g.get_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        // llama.cpp overrides a false add_bos_token for gemma4 (its models need the BOS).
        self.add_bos |= self.kind == VocabKind::SpmBpe;
        self.add_eos = g.get_bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if let Some(p) = g.get_bool_opt("tokenizer.ggml.add_space_prefix")? {
            self.add_space_prefix = p;
        }
        if self.add_bos && self.bos == NONE {
            return Err(bad("tokenizer.ggml.add_bos_token", "is true but there is no BOS token id", 0));
        }
        if self.add_eos && self.eos == NONE {
            return Err(bad("tokenizer.ggml.add_eos_token", "is true but there is no EOS token id", 0));
        }
        Ok(())
    }

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

    /// Whether encoding with `add_special` puts BOS first (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether encoding with `add_special` puts EOS last (`tokenizer.ggml.add_eos_token`).
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

    /// Encodes `text` into `out` and returns the number of tokens, with llama.cpp's rules:
    /// `parse_special` lets control tokens written in the text (`<|im_start|>`) become those tokens
    /// (user-defined tokens always do); `add_special` adds BOS and EOS where the vocabulary says so
    /// ([`Tokenizer::add_bos`], [`Tokenizer::add_eos`]).
    ///
    /// Working memory is [`STACK_SCRATCH_WORDS`] words on the stack: enough for words (BPE) or
    /// texts (SentencePiece) of about 1300 bytes. Longer input gives
    /// [`TokError::ScratchTooSmall`]; use [`Tokenizer::encode_with_scratch`] for it.
    pub fn encode(
        &self,
        text: &str,
        parse_special: bool,
        add_special: bool,
        out: &mut [u32],
    ) -> Result<usize, TokError> {
        let mut scratch = [0u32; STACK_SCRATCH_WORDS];
        self.encode_with_scratch(text, parse_special, add_special, out, &mut scratch)
    }

    /// [`Tokenizer::encode`] with caller working memory: [`Tokenizer::scratch_words`]`(text.len())`
    /// words are always enough, for any text.
    pub fn encode_with_scratch(
        &self,
        text: &str,
        parse_special: bool,
        add_special: bool,
        out: &mut [u32],
        scratch: &mut [u32],
    ) -> Result<usize, TokError> {
        let got = out.len();
        let mut sink = Out { buf: out, n: 0 };
        let too_small =
            TokError::ScratchTooSmall { needed: self.scratch_words(text.len()), got: scratch.len() };
        if add_special && self.add_bos {
            sink.push(self.bos);
        }
        let mut prev_special = true; // SentencePiece: a space goes in front of text that follows a special token
        special::for_each_fragment(self, text, parse_special, scratch, &mut |frag, scratch| {
            match frag {
                special::Fragment::Token(id) => {
                    sink.push(id);
                    prev_special = true;
                }
                special::Fragment::Text(a, b) => {
                    let piece = text.get(a..b).unwrap_or("");
                    match self.kind {
                        VocabKind::Spm => {
                            spm::encode(
                                self,
                                piece.as_bytes(),
                                self.add_space_prefix && prev_special,
                                scratch,
                                &mut sink,
                            )
                            .map_err(|e| {
                                if e == SCRATCH {
                                    too_small.clone()
                                } else {
                                    e
                                }
                            })?;
                        }
                        VocabKind::Bpe => {
                            pretok::split(self.pre, piece, &mut |c, d| {
                                bpe::encode_word(self, &piece.as_bytes()[c..d], scratch, &mut sink)
                                    .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })
                            })?;
                        }
                        VocabKind::SpmBpe => {
                            pretok::split_newline_runs(piece, &mut |c, d| {
                                bpe::encode_word_spm(self, &piece.as_bytes()[c..d], scratch, &mut sink)
                                    .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })
                            })?;
                        }
                    }
                    prev_special = false;
                }
            }
            Ok(())
        })
        .map_err(|e| if e == SCRATCH { too_small.clone() } else { e })?;
        if add_special && self.add_eos {
            sink.push(self.eos);
        }
        if sink.n > got {
            return Err(TokError::OutputTooSmall { needed: sink.n, got });
        }
        Ok(sink.n)
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

#[inline]
fn merge_hash(l: u32, r: u32) -> u64 {
    mix((u64::from(l) << 32 | u64::from(r)).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn contains_ascii_ci(hay: &str, needle: &str) -> bool {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
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
    fn keys_hash_like_their_bytes() {
        let text = "a bé".as_bytes();
        let enc = "aĠbÃ©".as_bytes();
        assert_eq!(ByteLevel(text).len(), enc.len());
        assert_eq!(ByteLevel(text).hash(), (&enc).hash());
        assert!(ByteLevel(text).equals(enc));
        assert!(!ByteLevel(text).equals("aĠbÃ¨".as_bytes()));
        assert_eq!(Concat(b"ab", b"c").hash(), (&&b"abc"[..]).hash());
        assert!(Concat(b"ab", b"c").equals(b"abc"));
    }

    #[test]
    fn errors_name_the_fix() {
        extern crate std;
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
