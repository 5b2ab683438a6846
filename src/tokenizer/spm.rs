//! SentencePiece-style tokenization of one text fragment (llama.cpp's `llm_tokenizer_spm_session`).
//!
//! The fragment, with spaces escaped to U+2581 and an optional escaped space in front, starts as one
//! symbol per character. The adjacent pair whose concatenation is a token with the highest score
//! (then the leftmost) is merged, repeatedly. Each remaining symbol is its token, or when it is
//! none, its bytes as `<0xNN>` tokens. The escaped text is never built: units are the raw bytes
//! (unit 0 is the added space when there is one) and lookups escape on the fly. Working memory: 5
//! words per unit, O(n log n) time.

use super::hash::Key;
use super::heap::{Heap, NONE};
use super::unicode::{utf8_len, SPACE};
use super::{Out, TokError, Tokenizer, SCRATCH};

/// The escaped text of units `a..b` of a fragment.
struct Escaped<'t> {
    raw: &'t [u8],
    /// 1 when unit 0 is an added space, else 0.
    off: usize,
    a: usize,
    b: usize,
}

impl Escaped<'_> {
    #[inline]
    fn unit(&self, x: usize) -> u8 {
        if x < self.off {
            b' '
        } else {
            self.raw[x - self.off]
        }
    }
}

impl Key for Escaped<'_> {
    fn len(&self) -> usize {
        (self.a..self.b).map(|x| if self.unit(x) == b' ' { 3 } else { 1 }).sum()
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        (self.a..self.b).all(|x| match self.unit(x) {
            b' ' => SPACE.iter().all(|&b| f(b)),
            c => f(c),
        })
    }
}

/// Priority of a score in the min-heap: higher scores come first.
#[inline]
fn prio(score: f32) -> u32 {
    let b = score.to_bits();
    let ordered = if b >> 31 == 0 { b | 0x8000_0000 } else { !b };
    !ordered
}

/// Tokenizes `raw` (with a space in front when `prefix`) and pushes the tokens to `out`.
pub(crate) fn encode(
    tok: &Tokenizer<'_>,
    raw: &[u8],
    prefix: bool,
    scratch: &mut [u32],
    out: &mut Out<'_>,
) -> Result<(), TokError> {
    let off = usize::from(prefix);
    let n = raw.len() + off;
    if n == 0 {
        return Ok(());
    }
    if scratch.len() < 5 * n {
        return Err(SCRATCH);
    }
    let (len, rest) = scratch.split_at_mut(n);
    let (prev, rest) = rest.split_at_mut(n);
    let (heap, rest) = rest.split_at_mut(n);
    let (pos, rest) = rest.split_at_mut(n);
    let prio_slots = &mut rest[..n];
    let text = |a: usize, b: usize| Escaped { raw, off, a, b };

    // One symbol per character.
    let mut last = NONE;
    let mut x = 0;
    while x < n {
        let l = if x < off { 1 } else { utf8_len(raw[x - off]).min(n - x) };
        len[x] = l as u32;
        prev[x] = last;
        last = x as u32;
        x += l;
    }
    let mut q = Heap::new(heap, pos, prio_slots);
    // The pair (x, next) as a candidate merge, or none.
    let try_pair = |q: &mut Heap<'_>, len: &[u32], x: usize| {
        let y = x + len[x] as usize;
        if y >= n {
            q.remove(x as u32);
            return;
        }
        match tok.find(&text(x, y + len[y] as usize)) {
            Some(id) => q.set(x as u32, prio(tok.score_of(id))),
            None => q.remove(x as u32),
        }
    };
    let mut x = 0;
    while x < n {
        try_pair(&mut q, len, x);
        x += len[x] as usize;
    }
    while let Some(i) = q.pop() {
        let i = i as usize;
        let j = i + len[i] as usize;
        len[i] += len[j];
        len[j] = 0;
        q.remove(j as u32);
        let k = i + len[i] as usize;
        if k < n {
            prev[k] = i as u32;
        }
        if prev[i] != NONE {
            try_pair(&mut q, len, prev[i] as usize);
        }
        try_pair(&mut q, len, i);
    }
    let mut x = 0;
    while x < n {
        let l = len[x] as usize;
        let piece = text(x, x + l);
        match tok.find(&piece) {
            Some(id) => out.push(id),
            None => {
                let mut missing = None;
                piece.all(|b| match tok.byte_tokens[b as usize] {
                    NONE => {
                        missing = Some(b);
                        false
                    }
                    id => {
                        out.push(id);
                        true
                    }
                });
                if let Some(byte) = missing {
                    return Err(TokError::MissingByteToken { byte });
                }
            }
        }
        x += l;
    }
    Ok(())
}
