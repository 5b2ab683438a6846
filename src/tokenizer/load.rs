//! Building a tokenizer from GGUF metadata: the plan of its tables, the tables in caller storage
//! (token texts, attributes, scores, the token and merge hash tables, the special-token index),
//! and llama.cpp's rules for which tokens are special or end generation.

use super::hash::{merge_hash, Concat, Key};
use super::heap::NONE;
use super::{
    bad, byte_token_text, parse_byte_token, pretok, special, unicode, PreTokenizer, TokError, TokenAttr,
    Tokenizer, VocabKind, MAX_VOCAB, MERGE_SLOT, SPECIAL_WORDS, TOKEN_SLOT,
};
use crate::gguf::{name_of, Gguf, Value, ValueType};

/// Most distinct special-token text lengths accepted.
const MAX_SPECIAL_LENGTHS: usize = 256;
/// Longest probe sequence accepted in the hash tables. Real vocabularies stay far below it (the
/// hash is good and the tables at most 2/3 full); a file crafted to make token texts collide is
/// refused instead of making every lookup slow.
const PROBE_LIMIT: u32 = 1024;
/// Merges looked up together while building.
const MERGE_BATCH: usize = 64;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_CLS: &str = "tokenizer.ggml.cls_token_id";
const KEY_SEP: &str = "tokenizer.ggml.seperator_token_id"; // sic, llama.cpp's spelling
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";

/// llama.cpp's default WordPiece ids (BERT's vocabulary): [CLS], [SEP], [UNK].
const WPM_CLS: u32 = 101;
const WPM_SEP: u32 = 102;
const WPM_UNK: u32 = 100;

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
            "bert" => VocabKind::Wpm,
            other => return Err(TokError::UnsupportedModel { model: name_of(other) }),
        };
        let (pre, ignore_merges, add_bos_default) = match kind {
            VocabKind::Spm => (PreTokenizer::Default, false, true),
            // Its split is fixed (runs of newlines); llama.cpp adds BOS whatever the file says.
            VocabKind::SpmBpe => (PreTokenizer::Default, false, true),
            // BERT's split is fixed too (`tokenizer.ggml.pre` only names the model); so are [CLS]
            // and [SEP] around the text.
            VocabKind::Wpm => (PreTokenizer::Default, false, true),
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
            VocabKind::Spm | VocabKind::Wpm => 0,
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
            sep: NONE,
            unk: NONE,
            lowercase: false,
            strip_accents: false,
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
                VocabKind::Wpm => NONE, // no byte fallback: what cannot be spelled is [UNK]
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
            VocabKind::Wpm => (WPM_CLS, NONE),
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
        if self.kind == VocabKind::Wpm {
            self.read_wpm_ids(g, &id)?;
        }
        if self.add_bos && self.bos == NONE {
            return Err(bad("tokenizer.ggml.add_bos_token", "is true but there is no BOS token id", 0));
        }
        if self.add_eos && self.eos == NONE {
            return Err(bad("tokenizer.ggml.add_eos_token", "is true but there is no EOS token id", 0));
        }
        Ok(())
    }

    /// WordPiece: [CLS] (the BOS id, else `cls_token_id`), [SEP] and [UNK] with llama.cpp's
    /// defaults, all required; the normalizer's switches. [CLS] and [SEP] always go around the text
    /// (llama.cpp's WPM ignores the add_* flags), so add_bos is set and add_eos cleared.
    fn read_wpm_ids(
        &mut self,
        g: &Gguf<'_>,
        id: &impl Fn(&str, u32) -> Result<u32, TokError>,
    ) -> Result<(), TokError> {
        if g.get("tokenizer.ggml.bos_token_id").is_none() {
            self.bos = id(KEY_CLS, WPM_CLS)?;
        }
        self.sep = id(KEY_SEP, WPM_SEP)?;
        self.unk = id(KEY_UNK, WPM_UNK)?;
        for (key, v, default) in
            [(KEY_CLS, self.bos, WPM_CLS), (KEY_SEP, self.sep, WPM_SEP), (KEY_UNK, self.unk, WPM_UNK)]
        {
            if v == NONE {
                return Err(bad(
                    key,
                    "a WordPiece vocabulary needs this token; the file names none in range and the \
                     default id is outside the vocabulary",
                    u64::from(default),
                ));
            }
        }
        self.add_bos = true;
        self.add_eos = false;
        self.lowercase = g.get_bool_opt("tokenizer.ggml.normalizer.lowercase")?.unwrap_or(true);
        self.strip_accents =
            g.get_bool_opt("tokenizer.ggml.normalizer.strip_accents")?.unwrap_or(self.lowercase);
        Ok(())
    }
}

fn contains_ascii_ci(hay: &str, needle: &str) -> bool {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
}
