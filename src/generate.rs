//! std layer: the one generation loop (sample → print → evaluate → stop), used by every front end
//! (`generate`, `chat`, the server, the C ABI). The core step ([`crate::engine::generate`]) samples
//! (the sampler chain with its repeat window), decodes UTF-8-safe pieces and checks
//! end-of-generation tokens; this adds stop strings held back until they can no longer match,
//! grammars, speculative decoding, context shift and the reasons a stream ends. Its buffers are
//! sized when it is made: nothing is allocated per token.

use std::fmt;
use std::string::String;
use std::vec;
use std::vec::Vec;

use crate::engine::generate::Generation;
use crate::engine::EngineError;
use crate::grammar::{Constraint, GrammarError};
use crate::sampler::{Candidate, SampleError, Sampler, SamplerConfig};
use crate::session::{Session, SessionError};
use crate::speculative::{next_draft_len, Drafter, MOST_GUESSES};
use crate::tokenizer::{StreamDecoder, TokError, Tokenizer};

/// Why a stream of generated tokens ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// An end-of-generation token.
    EndOfGeneration,
    /// The token limit.
    Limit,
    /// The context is full.
    ContextFull,
    /// A stop string appeared (it is not passed on).
    StopString,
    /// The caller's callback asked to stop (SIGINT, a client gone, ...).
    Cancelled,
    /// The output's grammar allows no token of this vocabulary here (and is not complete).
    GrammarDeadEnd,
}

/// What the callback of [`Generator::run`] wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Go on.
    Continue,
    /// Stop after this token.
    Stop,
}

/// A failure of the loop, or of the caller's callback (`E`).
#[derive(Debug)]
pub enum GenerateError<E> {
    /// Evaluating failed.
    Session(SessionError),
    /// Sampling failed (non-finite logits).
    Sample(SampleError),
    /// Decoding a token failed.
    Decode(TokError),
    /// The grammar engine failed.
    Grammar(GrammarError),
    /// The callback failed (output closed, ...).
    Output(E),
}

impl<E: fmt::Display> fmt::Display for GenerateError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Session(e) => write!(f, "{e}"),
            Self::Sample(e) => write!(f, "{e}"),
            Self::Decode(e) => write!(f, "{e}"),
            Self::Grammar(e) => write!(f, "{e}"),
            Self::Output(e) => write!(f, "{e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for GenerateError<E> {}

/// The core step and its buffers: one stream of generation at a time.
///
/// A front end either runs the whole loop ([`run`](Self::run): the CLI, which samples from the
/// session's logits in place), or drives it token by token ([`step`](Self::step) after
/// [`set_logits`](Self::set_logits), then [`finish`](Self::finish): the server, which evaluates
/// many streams in one batch).
pub struct Generator<'t> {
    tok: &'t Tokenizer<'t>,
    gen: Generation<'t, Vec<Candidate>, Vec<u8>>,
    /// The logits [`step`](Self::step) samples from ([`set_logits`](Self::set_logits)).
    logits: Vec<f32>,
    repeat_last_n: usize,
    /// Context shift ([`Session::shift_context`]) when the cache is full, keeping this many
    /// first positions; `None` ends the stream instead ([`Stop::ContextFull`]).
    pub context_shift: Option<usize>,
    stops: Vec<String>,
    /// Text decoded but held back: it may be the start of a stop string.
    held: String,
    /// Added to the logits of these tokens before sampling.
    bias: Vec<(u32, f32)>,
    /// The stop string that ended the stream (index into `stops`).
    stopped_by: Option<usize>,
    /// The grammar the output must match.
    constraint: Option<Constraint>,
    /// Tokens the stream may have ([`set_limit`](Self::set_limit)).
    limit: Option<usize>,
    /// Speculative decoding: where guesses come from, the most per batch and how many the next
    /// batch carries, the batch (last token, then guesses; its logits rows stay in the session),
    /// where its verification stands, and what it did.
    drafter: Option<Drafter>,
    max_draft: usize,
    draft_len: usize,
    batch: Vec<u32>,
    verifying: Option<Verifying>,
    draft_stats: DraftStats,
}

impl<'t> Generator<'t> {
    /// A generator for a model of `n_vocab` tokens; `config` is checked here.
    pub fn new(tok: &'t Tokenizer<'t>, n_vocab: usize, config: SamplerConfig) -> Result<Self, SampleError> {
        let candidates = vec![Candidate::default(); n_vocab.max(tok.n_vocab() as usize)];
        let piece = vec![0u8; StreamDecoder::buffer_len(tok)];
        let gen = Generation::new(tok, Sampler::new(config)?, candidates, piece)
            .map_err(|_| SampleError::ScratchTooSmall { needed: tok.n_vocab() as usize, got: n_vocab })?;
        Ok(Self {
            tok,
            gen,
            logits: vec![0f32; n_vocab],
            repeat_last_n: config.repeat_last_n as usize,
            context_shift: None,
            stops: Vec::new(),
            held: String::new(),
            bias: Vec::new(),
            stopped_by: None,
            constraint: None,
            limit: None,
            drafter: None,
            max_draft: 0,
            draft_len: 0,
            batch: Vec::new(),
            verifying: None,
            draft_stats: DraftStats::default(),
        })
    }

    /// Keep generating past end-of-generation tokens (benchmarks).
    pub fn set_ignore_eos(&mut self, on: bool) {
        self.gen.ignore_eos = on;
    }

    /// The grammar the next stream's output must match (compiled for its start), or none.
    pub fn set_constraint(&mut self, constraint: Option<Constraint>) {
        self.constraint = constraint;
    }

    /// The stream's grammar, if it has one (its mask statistics).
    pub fn constraint_mut(&mut self) -> Option<&mut Constraint> {
        self.constraint.as_mut()
    }

    /// The most tokens a stream may have (`-n`, `max_tokens`). With a grammar, the end of the
    /// stream is steered so the output completes the grammar within it: when the tokens left come
    /// close to the shortest completion, a token that would leave no room for one is replaced by
    /// the completion's next token.
    pub fn set_limit(&mut self, limit: Option<usize>) {
        self.limit = limit;
    }

    /// Strings that end generation when they appear in the text (they are not passed on).
    pub fn set_stop_strings(&mut self, stops: &[&str]) {
        self.stops = stops.iter().filter(|s| !s.is_empty()).map(|s| String::from(*s)).collect();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        self.held = String::with_capacity(longest + StreamDecoder::buffer_len(self.tok));
    }

    /// Values added to the logits of tokens before sampling (OpenAI's `logit_bias`; `-inf` bans a
    /// token). Ids outside the vocabulary are ignored.
    pub fn set_logit_bias(&mut self, bias: &[(u32, f32)]) {
        let n_vocab = self.logits.len();
        self.bias = bias.iter().copied().filter(|&(id, _)| (id as usize) < n_vocab).collect();
    }

    /// Takes the logits [`step`](Self::step) samples the next token from (the logit biases added).
    pub fn set_logits(&mut self, logits: &[f32]) {
        self.logits.copy_from_slice(logits);
        for &(id, b) in &self.bias {
            self.logits[id as usize] += b;
        }
    }

    /// The logits of the last [`set_logits`](Self::set_logits), biases included.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Evaluates `tokens` after what `session` holds: [`run`](Self::run) samples its first token
    /// from the last one's logits, where the session keeps them.
    pub fn feed(&mut self, session: &mut Session, tokens: &[u32]) -> Result<(), SessionError> {
        session.eval(tokens)?;
        Ok(())
    }

    /// Starts a new stream of text (nothing pending or held back).
    pub fn begin(&mut self) {
        self.gen.begin();
        self.held.clear();
        self.stopped_by = None;
    }

    /// The stop string that ended the last stream ([`Stop::StopString`]), until the next begins.
    pub fn stop_string(&self) -> Option<&str> {
        self.stopped_by.and_then(|i| self.stops.get(i)).map(String::as_str)
    }

    /// One token: samples from the held logits (the penalties reading `tokens`, the stream's
    /// history), appends it to `tokens` (whose capacity must hold it: a full `tokens` ends the
    /// stream as a full context does) and passes its text on to `each` (exactly once, possibly
    /// with ""). `Some(reason)` ends the stream (an end-of-generation token is not appended);
    /// then call [`finish`](Self::finish).
    pub fn step<E>(
        &mut self,
        tokens: &mut Vec<u32>,
        each: &mut impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<Option<Stop>, GenerateError<E>> {
        self.step_from(None, tokens, each)
    }

    /// [`step`](Self::step) from `row` (a session's logits, read in place, the biases added as
    /// they are sampled), or from the held logits.
    fn step_from<E>(
        &mut self,
        row: Option<&[f32]>,
        tokens: &mut Vec<u32>,
        each: &mut impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<Option<Stop>, GenerateError<E>> {
        let window = tokens.len().saturating_sub(self.repeat_last_n);
        let mask = match &mut self.constraint {
            Some(c) => {
                let mask = c.mask().map_err(GenerateError::Grammar)?;
                if mask.iter().all(|&w| w == 0) {
                    return Ok(Some(Stop::GrammarDeadEnd));
                }
                Some(mask)
            }
            None => None,
        };
        let (logits, bias) = match row {
            Some(row) => (row, &self.bias[..]),
            None => (&self.logits[..], &[][..]),
        };
        let mut id = self.gen.sample(logits, bias, &tokens[window..], mask).map_err(GenerateError::Sample)?;
        if let (Some(c), Some(limit)) = (&mut self.constraint, self.limit) {
            id = c.steer(id, limit.saturating_sub(self.gen.generated())).map_err(GenerateError::Grammar)?;
        }
        if self.gen.ends(id) {
            return Ok(Some(Stop::EndOfGeneration));
        }
        // (With context shift the history outgrows the context: it grows instead.)
        if tokens.len() == tokens.capacity() && self.context_shift.is_none() {
            return Ok(Some(Stop::ContextFull));
        }
        let finished = match &mut self.constraint {
            Some(c) => c.commit(id).map_err(GenerateError::Grammar)?,
            None => false,
        };
        tokens.push(id);
        let text = self.gen.take(id).map_err(GenerateError::Decode)?;
        let (flow, found) = pass_on(&self.stops, &mut self.held, text, each)?;
        Ok(if found.is_some() {
            self.stopped_by = found;
            Some(Stop::StopString)
        } else if flow == Flow::Stop {
            Some(Stop::Cancelled)
        } else if finished {
            // The grammar is complete and nothing may follow: the end-of-generation token it
            // would force next is not worth a forward pass.
            Some(Stop::EndOfGeneration)
        } else {
            None
        })
    }

    /// Ends a stream that stopped for `stop`: passes on the text held back (an incomplete
    /// character as U+FFFD), unless a stop string ended it.
    pub fn finish<E>(
        &mut self,
        stop: Stop,
        each: &mut impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<(), GenerateError<E>> {
        let rest = self.gen.finish();
        if stop != Stop::StopString {
            self.held.push_str(rest);
            if !self.held.is_empty() {
                each(&self.held).map_err(GenerateError::Output)?;
            }
        }
        self.held.clear();
        Ok(())
    }

    /// Samples, passes on and evaluates tokens after the last [`feed`](Self::feed) (or the last
    /// generated token), appending them to `tokens`, whose capacity must hold them (the caller
    /// sizes it once: a full `tokens` ends the stream as a full context does), until a [`Stop`]
    /// reason. `each` is called once per token with its text (possibly empty) and says whether to
    /// go on.
    pub fn run<E>(
        &mut self,
        session: &mut Session,
        tokens: &mut Vec<u32>,
        limit: Option<usize>,
        mut each: impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<Stop, GenerateError<E>> {
        self.begin();
        self.limit = limit;
        self.verifying = None;
        let result = self.run_tokens(session, tokens, limit, &mut each);
        // The cache keeps only what was verified, however the stream ended.
        if let Some(v) = self.verifying.take() {
            self.keep_verified(session, v.n_past + v.row + 1).map_err(GenerateError::Session)?;
        }
        let stop = result?;
        self.finish(stop, &mut each)?;
        Ok(stop)
    }

    /// The loop of [`run`](Self::run).
    fn run_tokens<E>(
        &mut self,
        session: &mut Session,
        tokens: &mut Vec<u32>,
        limit: Option<usize>,
        each: &mut impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<Stop, GenerateError<E>> {
        let mut each = each;
        let mut n = 0usize;
        let stop = loop {
            if limit.is_some_and(|l| n >= l) {
                break Stop::Limit;
            }
            if let Some(stop) = self.step_in(session, tokens, &mut each)? {
                break stop;
            }
            n += 1;
            if limit.is_some_and(|l| n >= l) {
                break Stop::Limit;
            }
            let left = limit.map_or(usize::MAX, |l| l - n);
            if let Some(stop) = self.advance(session, tokens, left).map_err(GenerateError::Session)? {
                break stop;
            }
        };
        Ok(stop)
    }

    /// [`step`](Self::step) from the session's logits (read in place): the last evaluated
    /// token's, or a verified guess's. After it, [`advance`](Self::advance) evaluates the token.
    pub fn step_in<E>(
        &mut self,
        session: &Session,
        tokens: &mut Vec<u32>,
        each: &mut impl FnMut(&str) -> Result<Flow, E>,
    ) -> Result<Option<Stop>, GenerateError<E>> {
        let row = self.verifying.map_or(0, |v| v.row);
        let logits = session
            .logits(row)
            .ok_or(GenerateError::Session(SessionError::Engine(EngineError::NonFiniteLogits)))?;
        self.step_from(Some(logits), tokens, each)
    }

    /// Moves `session` on past the last token of `tokens` (the one [`step_in`](Self::step_in)
    /// took): nothing when a verified guess already holds it, else shifts the context when it is
    /// full and context shift is on, and evaluates the token with guesses after it (at most
    /// `left - 1`: the tokens the limit leaves). `Some(Stop::ContextFull)` when it does not fit.
    pub fn advance(
        &mut self,
        session: &mut Session,
        tokens: &[u32],
        left: usize,
    ) -> Result<Option<Stop>, SessionError> {
        if self.take_verified(session, tokens)? {
            return Ok(None);
        }
        // llama.cpp shifts when the next token would leave no free position.
        if let Some(keep) = self.context_shift {
            if session.n_past() + 1 >= session.n_ctx() {
                session.shift_context(0, keep)?;
            }
        }
        match self.eval_next(session, tokens, left) {
            Ok(()) => Ok(None),
            Err(SessionError::Engine(EngineError::ContextFull { .. })) => Ok(Some(Stop::ContextFull)),
            Err(e) => Err(e),
        }
    }

    /// Speculative decoding: before each evaluation, up to `n_draft` tokens are guessed (by
    /// `drafter`), evaluated in the same batch, and taken while the sampler draws them (`None`:
    /// off). The sampler draws every token from the logits plain decoding would give it, in the
    /// same order, so greedy output is the same, and sampled output follows the same distribution
    /// (the same tokens for a seed, up to the arithmetic of a batch). The session needs
    /// `logits_all`, and a model without recurrent layers (its cache must go back to any position).
    /// (At most [`MOST_GUESSES`] guesses per batch: more would take a prompt's kernels.)
    pub fn set_speculative(&mut self, speculative: Option<(Drafter, usize)>) {
        let (drafter, n) = match speculative {
            Some((d, n)) if n > 0 => (Some(d), n.min(MOST_GUESSES)),
            _ => (None, 0),
        };
        self.drafter = drafter;
        self.max_draft = n;
        self.draft_len = n;
        let rows = if n > 0 { n + 1 } else { 0 };
        self.batch = Vec::with_capacity(rows);
    }

    /// Tokens guessed and taken by speculative decoding so far, and the batches that carried guesses.
    pub fn draft_stats(&self) -> DraftStats {
        self.draft_stats
    }

    /// After a token was sampled from row `row` of a verified batch: if it is the guess the batch
    /// carried next, the cache already holds it and the next row's logits are the next token's
    /// (true); otherwise the cache is cut back to what was verified (false).
    fn take_verified(&mut self, session: &mut Session, tokens: &[u32]) -> Result<bool, SessionError> {
        let Some(mut v) = self.verifying.take() else { return Ok(false) };
        let t = tokens[tokens.len() - 1];
        let guesses = self.batch.len() - 1;
        if v.row + 1 < self.batch.len() && self.batch[v.row + 1] == t {
            self.draft_stats.accepted += 1;
            v.row += 1;
            self.verifying = Some(v);
            return Ok(true);
        }
        self.draft_len = next_draft_len(self.draft_len, guesses, v.row, self.max_draft);
        self.keep_verified(session, v.n_past + v.row + 1)?;
        Ok(false)
    }

    /// Cuts the cache back to its first `n` positions (the rest held guesses not taken).
    fn keep_verified(&mut self, session: &mut Session, n: usize) -> Result<(), SessionError> {
        if session.truncate(n) != n {
            return Err(SessionError::Option(
                "speculative decoding needs a model whose cache can go back (no recurrent layers)",
            ));
        }
        Ok(())
    }

    /// Evaluates the last token of `tokens`, with guesses after it when the drafter has some (at
    /// most `left - 1`: the tokens the limit leaves), and takes its logits.
    fn eval_next(&mut self, session: &mut Session, tokens: &[u32], left: usize) -> Result<(), SessionError> {
        let last = tokens[tokens.len() - 1];
        let room =
            session.n_ctx().saturating_sub(session.n_past() + 1).min(session.n_outputs().saturating_sub(1));
        let n_draft = self.draft_len.min(room).min(left.saturating_sub(1));
        self.batch.clear();
        self.batch.push(last);
        if let (Some(d), true) = (&mut self.drafter, n_draft > 0) {
            d.guess(tokens, n_draft, self.logits.len(), self.tok, &mut self.batch)?;
        }
        if self.batch.len() == 1 {
            session.eval(&self.batch[..1])?;
        } else {
            // One step (the batch is at most `n_outputs`, at most a step's tokens): its rows stay
            // in the session, read one by one as the guesses are verified.
            let n_past = session.n_past();
            session.eval_all(&self.batch, |_, _| {})?;
            self.draft_stats.drafted += self.batch.len() - 1;
            self.draft_stats.batches += 1;
            self.verifying = Some(Verifying { n_past, row: 0 });
        }
        Ok(())
    }
}

/// Where speculative decoding stands in a batch of guesses: the cache position of the batch's first
/// token, and the row whose logits the last token was drawn from.
#[derive(Debug, Clone, Copy)]
struct Verifying {
    n_past: usize,
    row: usize,
}

/// Guesses of speculative decoding ([`Generator::set_speculative`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Tokens guessed.
    pub drafted: usize,
    /// Guesses the sampler drew (each one a forward pass saved).
    pub accepted: usize,
    /// Batches that carried guesses.
    pub batches: usize,
}

/// Adds `text` to the held-back text and passes on what can no longer be part of a stop string
/// (calling `each` exactly once per token, with "" when nothing can be passed on yet, so the
/// caller can stop on every token); the index of the stop string that appeared first, if one did
/// (the text before it is passed on, the rest dropped).
fn pass_on<E>(
    stops: &[String],
    held: &mut String,
    text: &str,
    each: &mut impl FnMut(&str) -> Result<Flow, E>,
) -> Result<(Flow, Option<usize>), GenerateError<E>> {
    if stops.is_empty() {
        return Ok((each(text).map_err(GenerateError::Output)?, None));
    }
    held.push_str(text);
    if let Some((at, i)) =
        stops.iter().enumerate().filter_map(|(i, s)| Some((held.find(s.as_str())?, i))).min()
    {
        each(&held[..at]).map_err(GenerateError::Output)?;
        held.clear();
        return Ok((Flow::Stop, Some(i)));
    }
    // Keep the longest tail of `held` that is a prefix of some stop string.
    let keep = stops
        .iter()
        .flat_map(|s| {
            (1..s.len().min(held.len() + 1))
                .rev()
                .find(|&k| held.is_char_boundary(held.len() - k) && s.starts_with(&held[held.len() - k..]))
        })
        .max()
        .unwrap_or(0);
    let cut = held.len() - keep;
    let flow = each(&held[..cut]).map_err(GenerateError::Output)?;
    held.drain(..cut);
    Ok((flow, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `pieces` through [`pass_on`] with `stops`; the text passed on and whether one stopped.
    fn feed(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| String::from(*s)).collect();
        let (mut held, mut out) = (String::new(), String::new());
        for p in pieces {
            let (_, found) = pass_on::<()>(&stops, &mut held, p, &mut |t| {
                out.push_str(t);
                Ok(Flow::Continue)
            })
            .unwrap();
            if found.is_some() {
                return (out, true);
            }
        }
        out.push_str(&held);
        (out, false)
    }

    #[test]
    fn stop_strings_are_held_back_until_they_cannot_match() {
        assert_eq!(feed(&["</s>"], &["Hello", " wor", "ld"]), ("Hello world".into(), false));
        assert_eq!(feed(&["</s>"], &["Hi <", "/", "s>", "more"]), ("Hi ".into(), true));
        assert_eq!(feed(&["User:"], &["a", "Us", "e", "fu", "l"]), ("aUseful".into(), false));
        assert_eq!(feed(&["\n\n", "###"], &["x\n", "\n"]), ("x".into(), true));
        assert_eq!(feed(&["\n\n", "###"], &["x\n", "#", "\n"]), ("x\n#\n".into(), false));
        assert_eq!(feed(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(feed(&[], &["a", "b"]), ("ab".into(), false));
    }
}
