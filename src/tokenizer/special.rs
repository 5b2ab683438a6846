//! Cutting special tokens out of raw text, as llama.cpp's `tokenizer_st_partition` does.
//!
//! llama.cpp takes the special tokens longest text first; each one is found at its leftmost
//! occurrences in the text that no longer token has taken, and splits that text. Here every
//! distinct special-token length is one left-to-right pass (longest first) over the text that is
//! still free. Candidate starts are the positions whose two bytes begin some special token (one
//! table lookup per position, kept in a bitmap); a pass visits only those, checks the length's
//! last-byte mask and the pair of last bytes, and only then hashes the text. Taken bytes are kept
//! in bitmaps in the scratch (candidates, taken, token start, dropped white space): the partition
//! needs n/8 words and O(n + candidates x lengths) time.

use super::unicode::is_c_space;
use super::{TokError, TokenAttr, Tokenizer, SCRATCH, SPECIAL_WORDS};

/// A piece of the partitioned text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Text to tokenize normally: a byte range of the input.
    Text(usize, usize),
    /// A special token found in the text.
    Token(u32),
}

const SPECIAL: u16 = TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN;
/// Record flag: some token of this length is matched without `parse_special` (user-defined).
const FLAG_USER: u32 = 1;

/// Words of the two byte-pair sets (first two bytes, last two bytes of special tokens).
pub(crate) const PAIR_WORDS: usize = 2 * 65536 / 32;

/// Scratch words the partition of a text of `n` bytes takes.
pub(crate) fn marks_words(n: usize) -> usize {
    4 * n.div_ceil(32)
}

/// Fills `pairs` with the byte-pair sets and `out` with one record per distinct special-token
/// length, longest first: length, flags, first-byte mask (8 words), last-byte mask (8 words).
/// Returns the number of records.
pub(crate) fn build_lengths(tok: &Tokenizer<'_>, pairs: &mut [u32], out: &mut [u32]) -> usize {
    pairs.fill(0);
    let cap = out.len() / SPECIAL_WORDS;
    let mut n_rec = 0usize;
    // Record index + 1 of each length below 256 (most are), to avoid a search.
    let mut short = [0u16; 256];
    for id in 0..tok.n_vocab {
        let a = tok.attr_of(id);
        let text = tok.text(id);
        if a & SPECIAL == 0 || text.is_empty() || core::str::from_utf8(text).is_err() {
            continue;
        }
        let len = text.len();
        let found = if len < 256 {
            (short[len] as usize).checked_sub(1)
        } else {
            (0..n_rec).find(|&r| out[r * SPECIAL_WORDS] as usize == len)
        };
        let r = match found {
            Some(r) => r,
            None => {
                if n_rec == cap {
                    continue; // cannot happen: the plan counted every candidate length
                }
                let rec = &mut out[n_rec * SPECIAL_WORDS..(n_rec + 1) * SPECIAL_WORDS];
                rec.fill(0);
                rec[0] = len as u32;
                if len < 256 {
                    short[len] = n_rec as u16 + 1;
                }
                n_rec += 1;
                n_rec - 1
            }
        };
        let rec = &mut out[r * SPECIAL_WORDS..(r + 1) * SPECIAL_WORDS];
        if a & (TokenAttr::CONTROL | TokenAttr::UNKNOWN) == 0 {
            rec[1] |= FLAG_USER;
        }
        let (first, last) = (text[0] as usize, text[len - 1] as usize);
        rec[2 + first / 32] |= 1 << (first % 32);
        rec[10 + last / 32] |= 1 << (last % 32);
        if len >= 2 {
            set(pairs, pair(text[0], text[1]));
            set(pairs, 65536 + pair(text[len - 2], text[len - 1]));
        }
    }
    // Longest first (insertion sort of whole records; there are few).
    for i in 1..n_rec {
        let mut j = i;
        while j > 0 && out[(j - 1) * SPECIAL_WORDS] < out[j * SPECIAL_WORDS] {
            for k in 0..SPECIAL_WORDS {
                out.swap((j - 1) * SPECIAL_WORDS + k, j * SPECIAL_WORDS + k);
            }
            j -= 1;
        }
    }
    n_rec
}

/// Whether token `id` is cut out of text: special, and not control/unknown unless `parse_special`.
#[inline]
fn allowed(tok: &Tokenizer<'_>, id: u32, parse_special: bool) -> bool {
    let a = tok.attr_of(id);
    a & SPECIAL != 0 && (parse_special || a & (TokenAttr::CONTROL | TokenAttr::UNKNOWN) == 0)
}

/// The records that apply: (length, first-byte mask, last-byte mask).
fn records<'t>(
    tok: &'t Tokenizer<'_>,
    parse_special: bool,
) -> impl Iterator<Item = (usize, &'t [u32], &'t [u32])> + 't {
    tok.specials
        .chunks_exact(SPECIAL_WORDS)
        .filter(move |r| parse_special || r[1] & FLAG_USER != 0)
        .map(|r| (r[0] as usize, &r[2..10], &r[10..18]))
}

#[inline]
fn pair(a: u8, b: u8) -> usize {
    (a as usize) << 8 | b as usize
}

#[inline]
fn in_mask(mask: &[u32], b: u8) -> bool {
    mask[b as usize / 32] & (1 << (b % 32)) != 0
}

#[inline]
fn bit(m: &[u32], i: usize) -> bool {
    m[i / 32] & (1 << (i % 32)) != 0
}

#[inline]
fn set(m: &mut [u32], i: usize) {
    m[i / 32] |= 1 << (i % 32);
}

/// Whether a special token of `len` bytes that applies starts at `p` (its first two bytes already
/// known to begin some special token when `len >= 2`).
#[inline]
fn match_at(
    tok: &Tokenizer<'_>,
    t: &[u8],
    p: usize,
    len: usize,
    last: &[u32],
    parse_special: bool,
) -> Option<u32> {
    let e = p + len;
    if e > t.len() || !in_mask(last, t[e - 1]) {
        return None;
    }
    if len >= 2 && !bit(tok.special_pairs, 65536 + pair(t[e - 2], t[e - 1])) {
        return None;
    }
    tok.find(&&t[p..e]).filter(|&id| allowed(tok, id, parse_special))
}

/// Whether positions `p` and `p + 1` begin some special token.
#[inline]
fn candidate(tok: &Tokenizer<'_>, t: &[u8], p: usize) -> bool {
    p + 1 < t.len() && bit(tok.special_pairs, pair(t[p], t[p + 1]))
}

/// Whether any special token that applies occurs anywhere in `t`.
fn any_match(tok: &Tokenizer<'_>, t: &[u8], parse_special: bool) -> bool {
    let mut longer = false;
    for (len, first, last) in records(tok, parse_special) {
        if len == 1 {
            if (0..t.len())
                .any(|p| in_mask(first, t[p]) && match_at(tok, t, p, 1, last, parse_special).is_some())
            {
                return true;
            }
        } else {
            longer = true;
        }
    }
    longer
        && (0..t.len()).any(|p| {
            candidate(tok, t, p)
                && records(tok, parse_special).any(|(len, first, last)| {
                    len >= 2
                        && in_mask(first, t[p])
                        && match_at(tok, t, p, len, last, parse_special).is_some()
                })
        })
}

/// The bitmaps of the partition.
struct Marks<'m> {
    cand: &'m mut [u32],
    taken: &'m mut [u32],
    start: &'m mut [u32],
    dropped: &'m mut [u32],
}

/// Marks the special tokens of `t` in the bitmaps, longest first.
fn mark(tok: &Tokenizer<'_>, t: &[u8], parse_special: bool, m: &mut Marks<'_>) {
    let n = t.len();
    for p in 0..n {
        if candidate(tok, t, p) {
            set(m.cand, p);
        }
    }
    for (len, first, last) in records(tok, parse_special) {
        if len > n {
            continue;
        }
        let mut p = 0;
        while p + len <= n {
            // Next position to try: any byte for one-byte tokens, else the next candidate.
            if len >= 2 {
                match next_set(m.cand, p, n) {
                    Some(q) => p = q,
                    None => break,
                }
                if p + len > n {
                    break;
                }
            }
            if bit(m.taken, p) || !in_mask(first, t[p]) || (p..p + len).any(|i| bit(m.taken, i)) {
                p += 1;
                continue;
            }
            let Some(id) = match_at(tok, t, p, len, last, parse_special) else {
                p += 1;
                continue;
            };
            for i in p..p + len {
                set(m.taken, i);
            }
            set(m.start, p);
            let a = tok.attr_of(id);
            if a & TokenAttr::LSTRIP != 0 {
                let mut q = p;
                while q > 0 && !bit(m.taken, q - 1) && is_c_space(t[q - 1]) {
                    q -= 1;
                    set(m.taken, q);
                    set(m.dropped, q);
                }
            }
            let mut r = p + len;
            if a & TokenAttr::RSTRIP != 0 {
                while r < n && !bit(m.taken, r) && is_c_space(t[r]) {
                    set(m.taken, r);
                    set(m.dropped, r);
                    r += 1;
                }
            }
            p = r;
        }
    }
}

/// The first set bit at or after `p` (below `n`).
#[inline]
fn next_set(m: &[u32], p: usize, n: usize) -> Option<usize> {
    let mut w = p / 32;
    let mut bits = m[w] & (u32::MAX << (p % 32));
    loop {
        if bits != 0 {
            let q = w * 32 + bits.trailing_zeros() as usize;
            return (q < n).then_some(q);
        }
        w += 1;
        if w >= m.len() {
            return None;
        }
        bits = m[w];
    }
}

/// Callback for fragments; the second argument is the scratch left after the partition's bitmaps.
pub(crate) type FragmentSink<'f> = dyn FnMut(Fragment, &mut [u32]) -> Result<(), TokError> + 'f;

/// Calls `f` with the fragments of `text` in order.
pub(crate) fn for_each_fragment(
    tok: &Tokenizer<'_>,
    text: &str,
    parse_special: bool,
    scratch: &mut [u32],
    f: &mut FragmentSink<'_>,
) -> Result<(), TokError> {
    let t = text.as_bytes();
    let n = t.len();
    if n == 0 {
        return Ok(());
    }
    if !any_match(tok, t, parse_special) {
        return f(Fragment::Text(0, n), scratch);
    }
    let w = n.div_ceil(32);
    if scratch.len() < 4 * w {
        return Err(SCRATCH);
    }
    let (marks, rest) = scratch.split_at_mut(4 * w);
    marks.fill(0);
    let (cand, marks) = marks.split_at_mut(w);
    let (taken, marks) = marks.split_at_mut(w);
    let (start, dropped) = marks.split_at_mut(w);
    let mut m = Marks { cand, taken, start, dropped };
    mark(tok, t, parse_special, &mut m);
    let (taken, start, dropped) = (&*m.taken, &*m.start, &*m.dropped);
    let mut p = 0;
    while p < n {
        if !bit(taken, p) {
            let mut q = p + 1;
            while q < n && !bit(taken, q) {
                q += 1;
            }
            f(Fragment::Text(p, q), rest)?;
            p = q;
        } else if bit(dropped, p) || !bit(start, p) {
            p += 1;
        } else {
            let mut q = p + 1;
            while q < n && bit(taken, q) && !bit(start, q) && !bit(dropped, q) {
                q += 1;
            }
            if let Some(id) = tok.find(&&t[p..q]) {
                f(Fragment::Token(id), rest)?;
            }
            p = q;
        }
    }
    Ok(())
}
