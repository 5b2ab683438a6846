//! Byte-level BPE on one pre-tokenized word (llama.cpp's `llm_tokenizer_bpe_session`).
//!
//! Every byte of the word starts as a symbol holding the token of its byte-level character. The
//! adjacent pair with the lowest merge rank (then the leftmost) is merged, repeatedly, until no
//! pair has a merge. Merges are looked up by token ids, `(left, right) -> (rank, result)`, so no
//! text is hashed while merging. Symbols live at the byte offset where they start; the next symbol
//! is at `i + len[i]`. Working memory: 6 words per byte of the word, O(n log n) time.

use super::heap::{Heap, NONE};
use super::unicode::BYTE_TO_UTF8;
use super::{ByteLevel, Out, TokError, Tokenizer};

/// Internal marker: the scratch is too small (the caller reports the real sizes).
pub(crate) const SCRATCH: TokError = TokError::ScratchTooSmall { needed: 0, got: 0 };

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
    if scratch.len() < scratch_for(n) {
        return Err(SCRATCH);
    }
    let (len, rest) = scratch.split_at_mut(n);
    let (prev, rest) = rest.split_at_mut(n);
    let (id, rest) = rest.split_at_mut(n);
    let (heap, rest) = rest.split_at_mut(n);
    let (pos, rest) = rest.split_at_mut(n);
    let prio = &mut rest[..n];
    for i in 0..n {
        len[i] = 1;
        prev[i] = if i == 0 { NONE } else { i as u32 - 1 };
        id[i] = tok.byte_tokens[word[i] as usize];
    }
    let mut q = Heap::new(heap, pos, prio);
    for i in 0..n - 1 {
        if let Some((rank, _)) = tok.merge(id[i], id[i + 1]) {
            q.set(i as u32, rank);
        }
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
        emit(tok, &word[i..i + l], id[i], out);
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
