//! std layer: where speculative decoding's guesses come from. The generation loop
//! ([`Generator`](crate::generate::Generator)) evaluates the last token with the guesses after it
//! in one batch and takes them while the sampler draws them; this module only guesses: from
//! earlier in the text (prompt lookup), or with a small draft model of the same vocabulary.

use std::boxed::Box;
use std::fmt;
use std::format;
use std::vec::Vec;

use crate::session::{Session, SessionError};
use crate::tokenizer::Tokenizer;

/// The most guesses a batch carries: with the token before them, one fewer than a run of tokens
/// that takes the f32 attention tiles (`attn_tile::TILE_MIN_TOKENS`), so a batch of guesses takes
/// the kernels a single token takes and computes the same bits as the tokens alone.
pub const MOST_GUESSES: usize = crate::kernels::attn_tile::TILE_MIN_TOKENS - 2;

/// The source of guesses.
pub enum Drafter {
    /// The tokens that followed the latest earlier occurrence of the text's last tokens.
    Lookup,
    /// A small model run greedily after the text.
    Model(Box<DraftModel>),
}

impl Drafter {
    /// Appends up to `n` guesses of the tokens after `tokens` to `out`: ids below `n_vocab` (the
    /// target model's), never an end-of-generation token of `tok`.
    pub(crate) fn guess(
        &mut self,
        tokens: &[u32],
        n: usize,
        n_vocab: usize,
        tok: &Tokenizer<'_>,
        out: &mut Vec<u32>,
    ) -> Result<(), SessionError> {
        match self {
            Self::Lookup => {
                find_in_text(tokens, n, out);
                Ok(())
            }
            Self::Model(m) => m.guess(tokens, n, n_vocab, tok, out),
        }
    }
}

/// The longest n-gram (4 tokens down to 2: one token repeats too often to predict much) ending
/// `tokens` that occurred earlier, most recent occurrence first: up to `n` of the tokens that
/// followed it are appended to `out`.
pub fn find_in_text(tokens: &[u32], n: usize, out: &mut Vec<u32>) {
    for k in (2..=4usize).rev() {
        if tokens.len() <= k {
            continue;
        }
        let tail = &tokens[tokens.len() - k..];
        // Occurrences that end before the tail itself, latest first.
        for start in (0..tokens.len() - k).rev() {
            if &tokens[start..start + k] == tail {
                let from = start + k;
                let take = n.min(tokens.len() - from);
                if take > 0 {
                    out.extend_from_slice(&tokens[from..from + take]);
                    return;
                }
            }
        }
    }
}

/// How many guesses the next batch carries after one that carried `carried` (up to `max`) and
/// had `taken` of them drawn: twice as many after all were taken, half as many after none, else
/// as many as were taken (a batch of guesses costs more than one token, most of all the output
/// rows of a large vocabulary).
pub fn next_draft_len(current: usize, carried: usize, taken: usize, max: usize) -> usize {
    match taken {
        0 => (current / 2).max(1),
        t if t == carried => (current * 2).min(max),
        t => t.min(max),
    }
}

/// A draft model (`-md`): its own session, kept on the text the generation loop has, and run one
/// token at a time, greedily, while it is sure enough of its next token.
pub struct DraftModel {
    session: Session,
    /// The tokens its cache holds (a prefix of the text, then its own guesses).
    held: Vec<u32>,
    /// It stops guessing when its most likely token is less likely than this (llama.cpp's
    /// `--draft-p-min`): an unsure guess is rarely taken and costs the batch a row.
    p_min: f32,
}

impl DraftModel {
    /// Takes `session` (a model whose cache can go back: see [`check_draft`]) for guessing.
    pub fn new(session: Session, p_min: f32) -> Self {
        let held = Vec::with_capacity(session.n_ctx());
        Self { session, held, p_min }
    }

    fn guess(
        &mut self,
        tokens: &[u32],
        n: usize,
        n_vocab: usize,
        tok: &Tokenizer<'_>,
        out: &mut Vec<u32>,
    ) -> Result<(), SessionError> {
        // Past its context (after a context shift of the target) the draft model stays quiet.
        if tokens.len() + n > self.session.n_ctx() {
            return Ok(());
        }
        // Its cache keeps what it shares with the text; guesses not taken are dropped.
        let common = self.held.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        // (When it holds the whole text, the last token's logits are gone: it is evaluated again.)
        let common = common.min(tokens.len() - 1);
        let kept = self.session.truncate(common);
        self.held.truncate(kept);
        let start = self.held.len();
        let mut logits = self.session.eval(&tokens[start..])?;
        self.held.extend_from_slice(&tokens[start..]);
        for i in 0..n {
            let (best, p) = most_likely(logits);
            if p < self.p_min || best as usize >= n_vocab || tok.is_eog(best) {
                break;
            }
            out.push(best);
            if i + 1 == n {
                break;
            }
            logits = self.session.eval(&[best])?;
            self.held.push(best);
        }
        Ok(())
    }
}

/// The most likely token of `logits` and its probability.
fn most_likely(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut max) = (0usize, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > max {
            best = i;
            max = l;
        }
    }
    if !max.is_finite() {
        return (0, 0.0);
    }
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    (best as u32, 1.0 / sum)
}

/// Why a model cannot draft for another.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftError {
    /// The vocabularies differ (what differs).
    Vocabulary(std::string::String),
    /// The draft model has recurrent layers: its state cannot go back to a guess not taken.
    Recurrent,
}

impl fmt::Display for DraftError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Vocabulary(what) => write!(f, "the draft model's vocabulary is not the model's: {what}"),
            Self::Recurrent => {
                write!(
                    f,
                    "the draft model has recurrent layers, whose state cannot go back to a guess not taken"
                )
            }
        }
    }
}

impl std::error::Error for DraftError {}

/// Token counts may differ by this much (padding of the output matrix), as llama.cpp allows.
const MAX_VOCAB_DIFFERENCE: u32 = 128;

/// Whether a model of tokenizer `draft` and session `session` can draft for a model of `target`:
/// the same kind of vocabulary, the same special tokens and the same text for every token both
/// have (ids are compared, so one token's text differing would make every guess of it wrong).
pub fn check_draft(
    target: &Tokenizer<'_>,
    draft: &Tokenizer<'_>,
    session: &Session,
) -> Result<(), DraftError> {
    if session.engine().has_recurrent_layers() {
        return Err(DraftError::Recurrent);
    }
    let mismatch = |what: std::string::String| Err(DraftError::Vocabulary(what));
    if target.kind() != draft.kind() {
        return mismatch(format!("{:?} beside {:?} tokens", draft.kind(), target.kind()));
    }
    let (nt, nd) = (target.n_vocab(), draft.n_vocab());
    if nt.abs_diff(nd) > MAX_VOCAB_DIFFERENCE {
        return mismatch(format!("{nd} tokens beside {nt}"));
    }
    if (target.bos(), target.eos(), target.add_bos()) != (draft.bos(), draft.eos(), draft.add_bos()) {
        return mismatch("other beginning or end tokens".into());
    }
    for id in 0..nt.min(nd) {
        if target.token_text(id).ok() != draft.token_text(id).ok() {
            return mismatch(format!("token {id} is {:?}, not {:?}", text(draft, id), text(target, id)));
        }
    }
    Ok(())
}

fn text(tok: &Tokenizer<'_>, id: u32) -> std::string::String {
    std::string::String::from_utf8_lossy(tok.token_text(id).unwrap_or_default()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lookup_takes_the_longest_latest_match() {
        let mut out = Vec::new();
        find_in_text(&[1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 2, &mut out);
        assert_eq!(out, [7, 8], "the latest occurrence of [2, 3]");
        out.clear();
        find_in_text(&[1, 2, 3, 9, 5, 1, 2, 3], 5, &mut out);
        assert_eq!(out, [9, 5, 1, 2, 3], "[1, 2, 3] occurred at 0");
        out.clear();
        find_in_text(&[4, 5, 6], 3, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn guesses_grow_when_taken_and_shrink_when_not() {
        assert_eq!(next_draft_len(4, 4, 4, 16), 8);
        assert_eq!(next_draft_len(12, 12, 12, 16), 16);
        assert_eq!(next_draft_len(8, 8, 0, 16), 4);
        assert_eq!(next_draft_len(1, 1, 0, 16), 1);
        assert_eq!(next_draft_len(8, 8, 3, 16), 3);
        assert_eq!(next_draft_len(8, 2, 2, 16), 16, "a short batch taken whole still doubles");
    }

    #[test]
    fn the_most_likely_token_and_its_probability() {
        let (id, p) = most_likely(&[0.0, 3.0, 0.0]);
        assert_eq!(id, 1);
        let want = 3f32.exp() / (2.0 + 3f32.exp());
        assert!((p - want).abs() < 1e-6, "{p} vs {want}");
        assert_eq!(most_likely(&[f32::NEG_INFINITY; 3]).1, 0.0);
    }
}
