//! One generation step over the engine, in caller memory: the prompt evaluated in steps of at most
//! the planned batch ([`Engine::feed`]), a token sampled from the engine's logits row (read in
//! place: the sampler's candidate list is its only copy), end-of-generation and stop tokens, and
//! the token's text as UTF-8-safe pieces.
//!
//! A front end drives it whole ([`Generation::next`]: the bare-metal image), or takes its parts
//! (the std `generate::Generator` samples through [`Generation::sample`], decodes through
//! [`Generation::take`] and adds stop strings, grammars and speculation between them).

use core::fmt;

use super::{Engine, EngineError, Entry, GraphSlot, Runner};
use crate::exec::MatmulOffload;
use crate::sampler::{Candidate, SampleError, Sampler};
use crate::tokenizer::{StreamDecoder, TokError, Tokenizer};

/// Most stop tokens a [`Generation`] checks beside the model's end-of-generation tokens.
pub const MAX_STOP_TOKENS: usize = 16;

/// Why a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// An end-of-generation or stop token (this one; it is not passed on).
    EndOfGeneration(u32),
    /// The token limit.
    Limit,
    /// The context is full.
    ContextFull,
}

/// What [`Generation::next`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next<'a> {
    /// A token and the text it completes.
    Token {
        /// The token.
        id: u32,
        /// Its text: what is complete now (possibly empty: part of a character).
        text: &'a str,
    },
    /// The stream ended.
    End(End),
}

/// A failure of a generation step.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateError {
    /// The engine failed (or produced no logits row).
    Engine(EngineError),
    /// Sampling failed (non-finite logits).
    Sample(SampleError),
    /// Decoding a token failed.
    Decode(TokError),
    /// A caller buffer is too short.
    Buffer {
        /// Which buffer.
        what: &'static str,
        /// Entries it needs.
        needed: usize,
        /// Entries it has.
        got: usize,
    },
}

impl fmt::Display for GenerateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Engine(e) => write!(f, "{e}"),
            Self::Sample(e) => write!(f, "{e}"),
            Self::Decode(e) => write!(f, "{e}"),
            Self::Buffer { what, needed, got } => {
                write!(f, "the {what} buffer holds {got} entries, generation needs {needed}")
            }
        }
    }
}

impl core::error::Error for GenerateError {}

impl From<EngineError> for GenerateError {
    fn from(e: EngineError) -> Self {
        Self::Engine(e)
    }
}

impl From<SampleError> for GenerateError {
    fn from(e: SampleError) -> Self {
        Self::Sample(e)
    }
}

impl From<TokError> for GenerateError {
    fn from(e: TokError) -> Self {
        Self::Decode(e)
    }
}

/// One stream of generation: the sampler and its candidate list (`C`: one [`Candidate`] per
/// vocabulary entry), the stream decoder and its piece buffer (`P`: at least
/// [`StreamDecoder::buffer_len`] bytes), the stop tokens and the token limit.
pub struct Generation<'t, C, P> {
    tok: &'t Tokenizer<'t>,
    sampler: Sampler,
    candidates: C,
    piece: P,
    decoder: StreamDecoder,
    stop_tokens: heapless::Vec<u32, MAX_STOP_TOKENS>,
    /// Keep generating past end-of-generation tokens (benchmarks); stop tokens still end.
    pub ignore_eos: bool,
    /// The most tokens a stream may have ([`next`](Self::next) ends with [`End::Limit`]).
    pub limit: Option<usize>,
    generated: usize,
    /// The sequence [`next`](Self::next) runs in, and the last token it gave, not yet evaluated.
    seq: usize,
    pending: Option<u32>,
}

impl<'t, C: AsMut<[Candidate]>, P: AsMut<[u8]>> Generation<'t, C, P> {
    /// A generation over `tok`'s vocabulary with `sampler`; the buffers' lengths are checked here.
    pub fn new(
        tok: &'t Tokenizer<'t>,
        sampler: Sampler,
        mut candidates: C,
        mut piece: P,
    ) -> Result<Self, GenerateError> {
        let n_vocab = tok.n_vocab() as usize;
        let got = candidates.as_mut().len();
        if got < n_vocab {
            return Err(GenerateError::Buffer { what: "candidate", needed: n_vocab, got });
        }
        let (needed, got) = (StreamDecoder::buffer_len(tok), piece.as_mut().len());
        if got < needed {
            return Err(GenerateError::Buffer { what: "piece", needed, got });
        }
        Ok(Self {
            tok,
            sampler,
            candidates,
            piece,
            decoder: StreamDecoder::new(),
            stop_tokens: heapless::Vec::new(),
            ignore_eos: false,
            limit: None,
            generated: 0,
            seq: 0,
            pending: None,
        })
    }

    /// Tokens that end a stream as end-of-generation tokens do (at most [`MAX_STOP_TOKENS`]).
    pub fn set_stop_tokens(&mut self, tokens: &[u32]) -> Result<(), GenerateError> {
        self.stop_tokens = heapless::Vec::from_slice(tokens).map_err(|_| GenerateError::Buffer {
            what: "stop token",
            needed: tokens.len(),
            got: MAX_STOP_TOKENS,
        })?;
        Ok(())
    }

    /// The sampler (its configuration, its random stream).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Starts a new stream: nothing pending, no token generated yet.
    pub fn begin(&mut self) {
        self.decoder = StreamDecoder::new();
        self.generated = 0;
        self.pending = None;
    }

    /// Tokens taken since the stream began.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Samples a token from `logits` (`bias` added to its tokens', only tokens `allowed` sets, the
    /// penalties reading `recent`) into the candidate list: the row is not copied elsewhere.
    pub fn sample(
        &mut self,
        logits: &[f32],
        bias: &[(u32, f32)],
        recent: &[u32],
        allowed: Option<&[u32]>,
    ) -> Result<u32, SampleError> {
        self.sampler.sample_biased(logits, bias, recent, self.candidates.as_mut(), allowed)
    }

    /// Whether `id` ends the stream: an end-of-generation token (unless `ignore_eos`) or a stop token.
    pub fn ends(&self, id: u32) -> bool {
        (self.tok.is_eog(id) && !self.ignore_eos) || self.stop_tokens.contains(&id)
    }

    /// Takes `id` into the stream and returns the text it completes.
    pub fn take(&mut self, id: u32) -> Result<&str, TokError> {
        let text = self.decoder.push(self.tok, id, false, self.piece.as_mut())?;
        self.generated += 1;
        Ok(text)
    }

    /// Ends the stream's text: an incomplete character still held back becomes U+FFFD.
    pub fn finish(&mut self) -> &str {
        let text = self.decoder.finish(self.piece.as_mut());
        self.decoder = StreamDecoder::new();
        text
    }

    /// Evaluates the prompt `tokens` in sequence `seq` of `engine` ([`Engine::feed`]) and starts a
    /// stream after it, its first token sampled from the last prompt token's logits.
    pub fn feed<G, B>(
        &mut self,
        engine: &mut Engine<'_, G, B>,
        seq: usize,
        tokens: &[u32],
        batch: &mut [Entry],
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError>
    where
        G: AsMut<[GraphSlot]> + AsRef<[GraphSlot]>,
        B: core::ops::DerefMut<Target = [u8]>,
    {
        self.begin();
        self.seq = seq;
        engine.feed(seq, tokens, batch, runner, offload)
    }

    /// One token after [`feed`](Self::feed): the last token given is evaluated (unless the limit
    /// is reached: the last token is never evaluated), the next sampled from its logits (the
    /// penalties reading `recent`, the stream's history, oldest first) and its text decoded.
    pub fn next<G, B>(
        &mut self,
        engine: &mut Engine<'_, G, B>,
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
        recent: &[u32],
    ) -> Result<Next<'_>, GenerateError>
    where
        G: AsMut<[GraphSlot]> + AsRef<[GraphSlot]>,
        B: core::ops::DerefMut<Target = [u8]>,
    {
        if self.limit.is_some_and(|l| self.generated >= l) {
            return Ok(Next::End(End::Limit));
        }
        if let Some(token) = self.pending.take() {
            let entry = Entry { seq: self.seq, pos: engine.seq_len(self.seq), token, logits: true };
            match engine.step(&[entry], runner, offload) {
                Err(EngineError::ContextFull { .. }) => return Ok(Next::End(End::ContextFull)),
                r => r?,
            }
        }
        let logits = engine.logits(0).ok_or(EngineError::NonFiniteLogits)?;
        let id = self.sampler.sample_biased(logits, &[], recent, self.candidates.as_mut(), None)?;
        if self.ends(id) {
            return Ok(Next::End(End::EndOfGeneration(id)));
        }
        self.pending = Some(id);
        Ok(Next::Token { id, text: self.take(id)? })
    }
}

impl<G: AsMut<[GraphSlot]> + AsRef<[GraphSlot]>, B: core::ops::DerefMut<Target = [u8]>> Engine<'_, G, B> {
    /// Evaluates `tokens` after what sequence `seq` holds, in steps of at most the planned batch
    /// (`batch` holds the entries of one: at least that many, or as many as `tokens` has), the
    /// last token's logits wanted: read them with [`logits`](Self::logits)`(0)`.
    pub fn feed(
        &mut self,
        seq: usize,
        tokens: &[u32],
        batch: &mut [Entry],
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError> {
        let n_batch = self.planned.config.n_batch;
        if batch.len() < n_batch.min(tokens.len()) {
            return Err(EngineError::Config("the batch buffer is shorter than the planned batch"));
        }
        for chunk in tokens.chunks(n_batch) {
            let start = self.seq_len(seq);
            let entries = &mut batch[..chunk.len()];
            for (i, (e, &token)) in entries.iter_mut().zip(chunk).enumerate() {
                *e = Entry { seq, pos: start + i, token, logits: i + 1 == chunk.len() };
            }
            self.step(entries, runner, offload)?;
        }
        Ok(())
    }
}
