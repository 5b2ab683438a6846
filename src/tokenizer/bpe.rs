//! BPE on one pre-tokenized word (llama.cpp's `llm_tokenizer_bpe_session`), byte-level or over
//! raw UTF-8 characters (SentencePiece-style BPE, [`encode_word_spm`]).
//!
//! Every byte of the word starts as a symbol holding the token of its byte-level character. The
//! adjacent pair with the lowest merge rank (then the leftmost) is merged, repeatedly, until no
//! pair has a merge. Merges are looked up by token ids, `(left, right) -> (rank, result)`, so no
//! text is hashed while merging. Symbols live at the byte offset where they start; the next symbol
//! is at `i + len[i]`. Working memory: 6 words per byte of the word, O(n log n) time.

use super::hash::ByteLevel;
use super::heap::{Heap, NONE};
use super::unicode::char_at;
use super::unicode::{BYTE_TO_UTF8, SPACE};
use super::{Out, TokError, Tokenizer, SCRATCH};

/// Words of scratch a word of `n` bytes needs.
pub(crate) fn scratch_for(n: usize) -> usize {
    6 * n
}

/// Tokenizes one word (its raw bytes) and pushes the tokens to `out`.
pub(crate) fn encode_word(
    tok: &Tokenizer<'_>,
    word: &[u8],
    scratch: &mut [u32],
    out: &mut Out<'_>,
) -> Result<(), TokError> {
    let n = word.len();
    if n == 0 {
        return Ok(());
    }
    if tok.ignore_merges {
        if let Some(id) = tok.find(&ByteLevel(word)) {
            out.push(id);
            return Ok(());
        }
    }
    if n == 1 {
        emit(tok, word, tok.byte_tokens[word[0] as usize], out);
        return Ok(());
    }
    merge(tok, word, scratch, |i| (1, tok.byte_tokens[word[i] as usize]), |raw, id| emit(tok, raw, id, out))
}

/// Tokenizes one word of SentencePiece-style BPE (`VocabKind::SpmBpe`, llama.cpp's gemma4 path)
/// and pushes the tokens to `out`: the word is raw text whose spaces stand for U+2581; every
/// UTF-8 character starts as a symbol holding the token of its text, then merges as above. A
/// word of newlines only that is a token is taken whole. A symbol that is not a token gives the
/// `<0xNN>` tokens of its (escaped) bytes.
pub(crate) fn encode_word_spm(
    tok: &Tokenizer<'_>,
    word: &[u8],
    scratch: &mut [u32],
    out: &mut Out<'_>,
) -> Result<(), TokError> {
    if word.is_empty() {
        return Ok(());
    }
    if word.iter().all(|&b| b == b'\n') {
        if let Some(id) = tok.find(&word) {
            out.push(id);
            return Ok(());
        }
    }
    let space = tok.find(&SPACE.as_slice()).unwrap_or(NONE);
    let symbol = |i: usize| {
        let len = char_at(word, i).1.min(word.len() - i);
        let id = if word[i] == b' ' { space } else { tok.find(&&word[i..i + len]).unwrap_or(NONE) };
        (len, id)
    };
    let emit = |raw: &[u8], id: u32, out: &mut Out<'_>| {
        if id != NONE {
            out.push(id);
            return;
        }
        for &b in raw {
            let escaped: &[u8] = if b == b' ' { &SPACE } else { core::slice::from_ref(&b) };
            for &e in escaped {
                let t = tok.byte_tokens[e as usize];
                if t != NONE {
                    out.push(t);
                }
            }
        }
    };
    let (first_len, first_id) = symbol(0);
    if first_len == word.len() {
        emit(word, first_id, out);
        return Ok(());
    }
    merge(tok, word, scratch, symbol, |raw, id| emit(raw, id, out))
}

/// The merge loop over a word of `n > 1` bytes whose symbols start where `symbol(i)` says: the
/// symbol at byte `i` is `(len, id)`, the next one starts at `i + len`. Pushes each final
/// symbol's bytes and id to `emit`.
fn merge(
    tok: &Tokenizer<'_>,
    word: &[u8],
    scratch: &mut [u32],
    symbol: impl Fn(usize) -> (usize, u32),
    mut emit: impl FnMut(&[u8], u32),
) -> Result<(), TokError> {
    let n = word.len();
    if scratch.len() < scratch_for(n) {
        return Err(SCRATCH);
    }
    let (len, rest) = scratch.split_at_mut(n);
    let (prev, rest) = rest.split_at_mut(n);
    let (id, rest) = rest.split_at_mut(n);
    let (heap, rest) = rest.split_at_mut(n);
    let (pos, rest) = rest.split_at_mut(n);
    let prio = &mut rest[..n];
    let mut i = 0;
    let mut last = NONE;
    while i < n {
        let (l, t) = symbol(i);
        let l = l.clamp(1, n - i);
        (len[i], prev[i], id[i]) = (l as u32, last, t);
        last = i as u32;
        i += l;
    }
    let mut q = Heap::new(heap, pos, prio);
    let mut i = 0;
    while i < n {
        let k = i + len[i] as usize;
        if k < n {
            if let Some((rank, _)) = tok.merge(id[i], id[k]) {
                q.set(i as u32, rank);
            }
        }
        i = k;
    }
    while let Some(i) = q.pop() {
        let i = i as usize;
        let j = i + len[i] as usize;
        let Some((_, result)) = tok.merge(id[i], id[j]) else { continue };
        id[i] = result;
        len[i] += len[j];
        len[j] = 0;
        q.remove(j as u32);
        let k = i + len[i] as usize;
        if k < n {
            prev[k] = i as u32;
            if let Some((rank, _)) = tok.merge(id[i], id[k]) {
                q.set(i as u32, rank);
            }
        }
        let p = prev[i];
        if p != NONE {
            match tok.merge(id[p as usize], id[i]) {
                Some((rank, _)) => q.set(p, rank),
                None => q.remove(p),
            }
        }
    }
    let mut i = 0;
    while i < n {
        let l = len[i] as usize;
        emit(&word[i..i + l], id[i]);
        i += l;
    }
    Ok(())
}

/// Pushes symbol `id`, or when it is not a token, llama.cpp's fallback: the tokens whose text is a
/// single byte of the symbol's byte-level text, skipping bytes without one.
#[inline]
fn emit(tok: &Tokenizer<'_>, raw: &[u8], id: u32, out: &mut Out<'_>) {
    if id != NONE {
        out.push(id);
        return;
    }
    for &b in raw {
        let (enc, k) = BYTE_TO_UTF8[b as usize];
        for &u in &enc[..k as usize] {
            let t = tok.single_byte[u as usize];
            if t != NONE {
                out.push(t);
            }
        }
    }
}
