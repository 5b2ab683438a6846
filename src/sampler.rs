//! Token sampling over a logits row, with llama.cpp's semantics and default chain.
//!
//! # The chain
//!
//! [`Sampler::sample`] runs, in this order (llama.cpp's `common_params_sampling::samplers` default,
//! leaving out the stages that are off by default there: DRY, top-n-sigma, typical-p, XTC):
//!
//! 1. **repetition penalty**: every distinct token among the last `repeat_last_n` of `recent` has
//!    its logit divided by `repeat_penalty` when it is > 0 and multiplied by it otherwise (once per
//!    token, however often it repeats). `repeat_penalty == 1.0` or `repeat_last_n == 0` turn it off.
//! 2. **top-k**: keep the `top_k` largest logits (`0` = off).
//! 3. **top-p** (nucleus): softmax over what is left (at temperature 1, as in llama.cpp), then keep
//!    the shortest run of most likely tokens whose probabilities add up to at least `top_p`
//!    (`1.0` = off).
//! 4. **min-p**: keep the tokens whose probability is at least `min_p` times the largest one, i.e.
//!    `logit >= max_logit + ln(min_p)` (`0.0` = off).
//! 5. **temperature + distribution**: softmax of `logit / temperature` over the survivors, then one
//!    draw from it.
//!
//! A `temperature <= 0` is greedy decoding: the penalised logits' argmax, the lowest id winning a tie
//! (llama.cpp keeps "the first maximum" too; its order after a partial sort is unspecified). The
//! truncation stages cannot remove the argmax, so they are skipped.
//!
//! # Cost
//!
//! No allocation: the caller lends `scratch` (one [`Candidate`] per vocabulary entry). Per token it
//! costs O(n_vocab) for the copy and the penalty, then:
//! * top-k on: one linear-time selection of the k best (`select_nth_unstable`), a sort of those k,
//!   and the rest runs over k candidates;
//! * top-k off and top-p on: the most likely candidates are selected and sorted in chunks of 256,
//!   512, 1024... only until the cumulative probability reaches `top_p` (on a peaked distribution
//!   one chunk), never a full sort unless top-p needs every token;
//! * everything off: a linear softmax and draw over the whole vocabulary.
//!
//! # Randomness
//!
//! Our own generator, xoshiro256** (Blackman and Vigna) with its 256-bit state filled from the
//! 64-bit seed by splitmix64, as its authors recommend. It is integer-only, so a seed gives the same
//! stream on every platform; the draw is the top 53 bits as a `f64` in `[0, 1)`. The softmax uses
//! `libm::expf` (a software routine, not the platform's), so a seed and the same logits give the
//! same tokens on x86-64 and aarch64. (llama.cpp uses `std::mt19937` seeded from a `u32`; its
//! streams are not reproduced.)
//!
//! # Differences from llama.cpp, all on purpose
//! * `min_keep` is fixed at llama.cpp's default (0): top-p and min-p always keep at least one token.
//! * The draw takes the first candidate whose running sum is strictly above `u * sum` (llama.cpp:
//!   at or above), so a zero-probability token is never drawn, even for `u == 0`.
//! * Temperature is folded into the final softmax as `exp((logit - max) / T)` instead of dividing
//!   every logit first: the same distribution, but a tiny `T` cannot overflow to `inf - inf`.
//! * NaN or `+inf` logits are an error instead of undefined behaviour of the sort. `-inf` is
//!   accepted (a masked token: it can never be drawn) as long as one logit is finite.
//! * A penalised logit that would overflow to infinity saturates at `±f32::MAX`.
//! * The seed is a `u64` and the default is a fixed value, not "random": the core has no entropy
//!   source; a front end that wants llama.cpp's behaviour draws a seed itself.

use core::cmp::Ordering;
use core::fmt;

/// One entry of the candidate list: a token id, its (working) logit, and a probability slot.
///
/// `repr(C)` and `Pod`, so a caller can carve the scratch list out of arena bytes with
/// `bytemuck::cast_slice_mut`.
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Candidate {
    /// Token id (index into the logits row).
    pub id: u32,
    /// Logit after the stages run so far.
    pub logit: f32,
    /// Probability, where a stage has computed one.
    pub p: f32,
}

impl Candidate {
    /// Words (`u32`) one candidate takes: a list of `n` is carved out of `n * WORDS` words.
    pub const WORDS: usize = 3;

    /// `words` as a candidate list of `words.len() / WORDS` entries (memory without an
    /// allocator: bare metal's arena).
    pub fn list_in(words: &mut [u32]) -> &mut [Candidate] {
        let n = words.len() / Self::WORDS * Self::WORDS;
        // Same alignment, a whole number of candidates: the cast cannot fail.
        bytemuck::try_cast_slice_mut(&mut words[..n]).unwrap_or_default()
    }
}

/// Sampling parameters, named and defaulted as llama.cpp's CLI (`--temp`, `--top-k`, `--top-p`,
/// `--min-p`, `--repeat-penalty`, `--repeat-last-n`, `--seed`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; `<= 0` (must not be negative: use 0) is greedy. Default 0.8.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off. Default 40.
    pub top_k: u32,
    /// Nucleus threshold in `[0, 1]`; 1 = off. Default 0.95.
    pub top_p: f32,
    /// Minimum probability relative to the most likely token, in `[0, 1]`; 0 = off. Default 0.05.
    pub min_p: f32,
    /// Repetition penalty, `> 0`; 1 = off (the default). Values above 1 discourage repeats.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalties look at; 0 = off. Default 64.
    pub repeat_last_n: u32,
    /// Subtracted from the logit of every token in the window once per occurrence (OpenAI's
    /// `frequency_penalty`); 0 = off (the default).
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token in the window (OpenAI's
    /// `presence_penalty`); 0 = off (the default).
    pub presence_penalty: f32,
    /// Seed of the random generator (unused when greedy). Default [`SamplerConfig::DEFAULT_SEED`].
    pub seed: u64,
}

impl SamplerConfig {
    /// The seed used when none is given. Fixed, so that runs are reproducible by default.
    pub const DEFAULT_SEED: u64 = 0x5EED_5EED_5EED_5EED;

    /// Greedy decoding (temperature 0): always the most likely token, no randomness, no penalty.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// True when [`Sampler::sample`] picks the argmax instead of drawing.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Checks every field; the error names the first bad one, its value and what is accepted.
    pub fn validate(&self) -> Result<(), SampleError> {
        let bad = |param, value, expected| Err(SampleError::InvalidConfig { param, value, expected });
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return bad("temperature", t, "a finite number >= 0 (0 = greedy)");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top_p", self.top_p, "a number in [0, 1] (1 = off)");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "a number in [0, 1] (0 = off)");
        }
        let r = self.repeat_penalty;
        if !r.is_finite() || r <= 0.0 {
            return bad("repeat_penalty", r, "a finite number > 0 (1 = off)");
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", self.frequency_penalty, "a finite number (0 = off)");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty, "a finite number (0 = off)");
        }
        Ok(())
    }
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.0 (off)
    /// over the last 64 tokens.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: Self::DEFAULT_SEED,
        }
    }
}

/// Why a configuration was refused or a token could not be sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum SampleError {
    /// A [`SamplerConfig`] field is NaN or out of range.
    InvalidConfig {
        /// The field.
        param: &'static str,
        /// The value given.
        value: f32,
        /// What is accepted.
        expected: &'static str,
    },
    /// The logits row is empty.
    EmptyLogits,
    /// More logits than token ids fit in a `u32`.
    TooManyLogits {
        /// The row length.
        n: usize,
    },
    /// `scratch` is shorter than the logits row.
    ScratchTooSmall {
        /// Candidates needed (the vocabulary size).
        needed: usize,
        /// Candidates given.
        got: usize,
    },
    /// A logit is NaN: the forward pass produced garbage.
    NanLogit {
        /// The first such token id.
        index: usize,
    },
    /// A logit is `+inf`.
    InfiniteLogit {
        /// The first such token id.
        index: usize,
    },
    /// Every logit is `-inf`: there is nothing to sample.
    NoFiniteLogit,
    /// The mask allows no token with a finite logit (a grammar that nothing can continue).
    NoAllowedToken,
    /// A token in the penalty window is not a valid id for this logits row.
    RecentTokenOutOfRange {
        /// The token.
        token: u32,
        /// The vocabulary size (logits row length).
        n_vocab: usize,
    },
}

impl fmt::Display for SampleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::InvalidConfig { param, value, expected } => {
                write!(f, "sampler: {param} = {value} is invalid; expected {expected}")
            }
            Self::EmptyLogits => write!(f, "sampler: the logits row is empty"),
            Self::TooManyLogits { n } => {
                write!(f, "sampler: {n} logits, more than token ids fit in 32 bits")
            }
            Self::ScratchTooSmall { needed, got } => write!(
                f,
                "sampler: scratch holds {got} candidates, the vocabulary needs {needed}; \
                 give it one Candidate per token"
            ),
            Self::NanLogit { index } => write!(
                f,
                "sampler: logits contain NaN (first at token {index}); the forward pass produced garbage"
            ),
            Self::InfiniteLogit { index } => write!(
                f,
                "sampler: logits contain +inf (first at token {index}); the forward pass overflowed"
            ),
            Self::NoFiniteLogit => write!(f, "sampler: every logit is -inf; no token can be sampled"),
            Self::NoAllowedToken => write!(f, "sampler: the mask allows no token; nothing can be sampled"),
            Self::RecentTokenOutOfRange { token, n_vocab } => {
                write!(f, "sampler: recent token {token} is not a token id (vocabulary size {n_vocab})")
            }
        }
    }
}

impl core::error::Error for SampleError {}

/// xoshiro256** seeded through splitmix64 (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn from_seed(seed: u64) -> Self {
        let mut state = seed;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        // splitmix64 is a bijection of its counter, so four consecutive outputs are never all zero
        // (the one state xoshiro must avoid).
        Self { s: [next(), next(), next(), next()] }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, 1)`, exactly representable (53 random bits).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Descending logit, then ascending id: a total order once NaN is excluded, so every selection and
/// sort below is deterministic.
fn by_logit_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.partial_cmp(&a.logit).unwrap_or(Ordering::Equal).then(a.id.cmp(&b.id))
}

/// The sampler: a validated configuration and the random generator's state.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `config` (validated), its generator seeded with `config.seed`.
    pub fn new(config: SamplerConfig) -> Result<Self, SampleError> {
        config.validate()?;
        Ok(Self { config, rng: Rng::from_seed(config.seed) })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Restarts the random stream from `seed` (the configuration keeps it too).
    pub fn reseed(&mut self, seed: u64) {
        self.config.seed = seed;
        self.rng = Rng::from_seed(seed);
    }

    /// Picks the next token from `logits` (one per vocabulary entry).
    ///
    /// `recent` is the token history, oldest first (prompt included, as llama.cpp feeds its
    /// penalty); only its last `repeat_last_n` entries are read, and only when the penalty is on.
    /// `scratch` needs at least `logits.len()` entries; its content on return is unspecified.
    /// Allocates nothing. A greedy sampler draws no random number; any other draws exactly one.
    pub fn sample(
        &mut self,
        logits: &[f32],
        recent: &[u32],
        scratch: &mut [Candidate],
    ) -> Result<u32, SampleError> {
        self.sample_masked(logits, recent, scratch, None)
    }

    /// [`sample`](Self::sample) among the tokens `allowed` sets (bit `i % 32` of word `i / 32`
    /// for token `i`; ids past its end are not allowed): the others are `-inf` before every stage
    /// (as llama.cpp applies a grammar first), so penalties, truncation and the draw see only
    /// allowed tokens. `None` allows every token.
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        recent: &[u32],
        scratch: &mut [Candidate],
        allowed: Option<&[u32]>,
    ) -> Result<u32, SampleError> {
        self.sample_biased(logits, &[], recent, scratch, allowed)
    }

    /// [`sample_masked`](Self::sample_masked) with `bias` added to the logits of its tokens first
    /// (OpenAI's `logit_bias`; ids outside the row are ignored): the sum is made in the scratch
    /// list, so the caller's row is read in place, never copied.
    pub fn sample_biased(
        &mut self,
        logits: &[f32],
        bias: &[(u32, f32)],
        recent: &[u32],
        scratch: &mut [Candidate],
        allowed: Option<&[u32]>,
    ) -> Result<u32, SampleError> {
        let n = logits.len();
        if n == 0 {
            return Err(SampleError::EmptyLogits);
        }
        if u32::try_from(n - 1).is_err() {
            return Err(SampleError::TooManyLogits { n });
        }
        let got = scratch.len();
        let cands = scratch.get_mut(..n).ok_or(SampleError::ScratchTooSmall { needed: n, got })?;
        load(cands, logits, bias)?;
        if let Some(mask) = allowed {
            apply_mask(cands, mask)?;
        }
        apply_penalties(cands, recent, &self.config)?;

        let c = self.config;
        if c.is_greedy() {
            return Ok(argmax(cands).id);
        }
        let mut len = n;
        let mut sorted = false;
        if c.top_k > 0 && (c.top_k as usize) < len {
            len = top_k(cands, c.top_k as usize);
            sorted = true;
        }
        if c.top_p < 1.0 {
            len = top_p(&mut cands[..len], sorted, c.top_p);
            sorted = true;
        }
        if c.min_p > 0.0 {
            len = min_p(&mut cands[..len], sorted, c.min_p);
        }
        let u = self.rng.next_f64();
        Ok(draw(&mut cands[..len], sorted, c.temperature, u).id)
    }
}

/// Copies the logits in (`id = index`, `p = 0`, the penalty's "not yet seen" mark), `bias` added
/// to its tokens', and rejects NaN, `+inf` and an all-`-inf` row. `-0.0` becomes `+0.0`, so ties
/// compare as ties.
fn load(cands: &mut [Candidate], logits: &[f32], bias: &[(u32, f32)]) -> Result<(), SampleError> {
    let biased = !bias.is_empty();
    if biased {
        for (c, &l) in cands.iter_mut().zip(logits) {
            c.logit = l;
        }
        for &(id, b) in bias {
            if let Some(c) = cands.get_mut(id as usize) {
                c.logit += b;
            }
        }
    }
    let mut any_finite = false;
    for (i, (c, &raw)) in cands.iter_mut().zip(logits).enumerate() {
        let l = if biased { c.logit } else { raw };
        if l.is_nan() {
            return Err(SampleError::NanLogit { index: i });
        }
        if l == f32::INFINITY {
            return Err(SampleError::InfiniteLogit { index: i });
        }
        any_finite |= l != f32::NEG_INFINITY;
        // `i` fits in u32: the caller checked the row length.
        *c = Candidate { id: i as u32, logit: l + 0.0, p: 0.0 };
    }
    if any_finite {
        Ok(())
    } else {
        Err(SampleError::NoFiniteLogit)
    }
}

/// Sets the logit of every token `mask` does not allow to `-inf` (`cands` identity-ordered, as
/// `load` left it); refuses a mask that leaves no finite logit.
fn apply_mask(cands: &mut [Candidate], mask: &[u32]) -> Result<(), SampleError> {
    let mut any = false;
    for (i, c) in cands.iter_mut().enumerate() {
        let ok = mask.get(i / 32).is_some_and(|w| w & (1 << (i % 32)) != 0);
        if !ok {
            c.logit = f32::NEG_INFINITY;
        }
        any |= ok && c.logit != f32::NEG_INFINITY;
    }
    if any {
        Ok(())
    } else {
        Err(SampleError::NoAllowedToken)
    }
}

/// llama.cpp's penalties on the identity-ordered candidate list `cands` (as `load` left it), over
/// the last `repeat_last_n` tokens of `recent`: per distinct token the repetition penalty, then
/// `count * frequency_penalty + presence_penalty` subtracted (`p` counts the occurrences first).
fn apply_penalties(cands: &mut [Candidate], recent: &[u32], c: &SamplerConfig) -> Result<(), SampleError> {
    let (repeat, freq, presence) = (c.repeat_penalty, c.frequency_penalty, c.presence_penalty);
    if c.repeat_last_n == 0 || (repeat == 1.0 && freq == 0.0 && presence == 0.0) {
        return Ok(());
    }
    let window = &recent[recent.len().saturating_sub(c.repeat_last_n as usize)..];
    let n_vocab = cands.len();
    for &token in window {
        let c = cands.get_mut(token as usize).ok_or(SampleError::RecentTokenOutOfRange { token, n_vocab })?;
        c.p += 1.0;
    }
    for &token in window {
        // (Checked above.)
        let c = &mut cands[token as usize];
        if c.p == 0.0 {
            continue; // already penalised: once per distinct token
        }
        let (l, count) = (c.logit, c.p);
        c.p = 0.0;
        let mut penalised = if l <= 0.0 { l * repeat } else { l / repeat };
        penalised -= count * freq + presence;
        c.logit = if l.is_finite() { penalised.clamp(-f32::MAX, f32::MAX) } else { penalised };
    }
    Ok(())
}

/// The largest logit, the lowest id among equals.
fn argmax(cands: &[Candidate]) -> Candidate {
    let mut best = cands[0];
    for c in &cands[1..] {
        if c.logit > best.logit {
            best = *c;
        }
    }
    best
}

/// Moves the `k` best candidates (0 < k < len) to the front, sorted; returns `k`.
fn top_k(cands: &mut [Candidate], k: usize) -> usize {
    cands.select_nth_unstable_by(k - 1, by_logit_desc);
    cands[..k].sort_unstable_by(by_logit_desc);
    k
}

/// Softmax at temperature 1 into `p` (f32 as llama.cpp), normalised.
fn softmax(cands: &mut [Candidate], sorted: bool) {
    let max =
        if sorted { cands[0].logit } else { cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit)) };
    let mut sum = 0.0f32;
    for c in cands.iter_mut() {
        c.p = libm::expf(c.logit - max);
        sum += c.p;
    }
    for c in cands.iter_mut() {
        c.p /= sum;
    }
}

/// Chunk of candidates sorted at a time by top-p over an unsorted list (doubles each round).
const TOP_P_FIRST_CHUNK: usize = 256;

/// Keeps the shortest prefix (in descending order) whose probability sum reaches `p`; returns its
/// length and leaves that prefix sorted. Keeps everything when rounding stops the sum short of `p`.
fn top_p(cands: &mut [Candidate], sorted: bool, p: f32) -> usize {
    let len = cands.len();
    softmax(cands, sorted);
    let mut cum = 0.0f32;
    let mut done = 0;
    let mut chunk = TOP_P_FIRST_CHUNK;
    while done < len {
        let end = if sorted { len } else { len.min(done + chunk) };
        if !sorted {
            let rest = &mut cands[done..];
            if end < len {
                rest.select_nth_unstable_by(end - done - 1, by_logit_desc);
            }
            rest[..end - done].sort_unstable_by(by_logit_desc);
        }
        for (i, c) in cands[done..end].iter().enumerate() {
            cum += c.p;
            if cum >= p {
                return done + i + 1;
            }
        }
        done = end;
        chunk = chunk.saturating_mul(2);
    }
    len
}

/// Keeps the candidates with `logit >= max + ln(p)`; returns how many (at least 1). A sorted list
/// stays a sorted prefix; an unsorted one is compacted in place, order kept.
fn min_p(cands: &mut [Candidate], sorted: bool, p: f32) -> usize {
    let ln_p = libm::logf(p);
    if sorted {
        let min_logit = cands[0].logit + ln_p;
        return 1 + cands[1..].iter().take_while(|c| c.logit >= min_logit).count();
    }
    let max = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
    let min_logit = max + ln_p;
    let mut kept = 0;
    for i in 0..cands.len() {
        if cands[i].logit >= min_logit {
            cands[kept] = cands[i];
            kept += 1;
        }
    }
    kept
}

/// Softmax of `logit / temperature` (`temperature > 0`) and the candidate where the running sum
/// first exceeds `u * sum` (`u` in `[0, 1)`). Leaves the normalised probabilities in `p`.
fn draw(cands: &mut [Candidate], sorted: bool, temperature: f32, u: f64) -> Candidate {
    let max =
        if sorted { cands[0].logit } else { cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit)) };
    let mut sum = 0.0f64;
    for c in cands.iter_mut() {
        c.p = libm::expf((c.logit - max) / temperature);
        sum += f64::from(c.p);
    }
    // sum >= 1 (the maximum contributes exp(0)), so the target is below it and the scan stops at a
    // candidate with p > 0; the fallback only guards against the impossible.
    let target = u * sum;
    let mut run = 0.0f64;
    let mut chosen = None;
    for (i, c) in cands.iter().enumerate() {
        run += f64::from(c.p);
        if run > target {
            chosen = Some(i);
            break;
        }
    }
    let chosen = chosen.or_else(|| cands.iter().rposition(|c| c.p > 0.0)).unwrap_or(0);
    let pick = cands[chosen];
    for c in cands.iter_mut() {
        c.p = (f64::from(c.p) / sum) as f32;
    }
    pick
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: usize = 8;

    fn cfg(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> SamplerConfig {
        SamplerConfig { temperature, top_k, top_p, min_p, ..SamplerConfig::default() }
    }

    fn sampler(c: SamplerConfig) -> Sampler {
        Sampler::new(c).unwrap()
    }

    fn message(e: SampleError) -> heapless::String<200> {
        let mut s = heapless::String::new();
        fmt::write(&mut s, format_args!("{e}")).unwrap();
        s
    }

    /// Deterministic pseudo-random logits in [-8, 8).
    fn logits<const N: usize>(seed: u64) -> [f32; N] {
        let mut r = Rng::from_seed(seed);
        core::array::from_fn(|_| (r.next_f64() * 16.0 - 8.0) as f32)
    }

    fn ln(probs: &[f32]) -> [f32; V] {
        let mut out = [f32::NEG_INFINITY; V];
        for (o, p) in out.iter_mut().zip(probs) {
            *o = libm::logf(*p);
        }
        out
    }

    #[test]
    fn a_mask_limits_every_stage_to_allowed_tokens() {
        let l: [f32; 40] = logits(7);
        let mut scratch = [Candidate::default(); 40];
        // Tokens 3, 17 and 33 (33 lives in the second mask word).
        let mask = [(1u32 << 3) | (1 << 17), 1 << 1];
        let best =
            [3usize, 17, 33].into_iter().max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap();
        let mut g = sampler(SamplerConfig::greedy());
        assert_eq!(g.sample_masked(&l, &[], &mut scratch, Some(&mask)).unwrap() as usize, best);
        // Sampled, with top-k 1 after the mask: still the best allowed token, never another.
        let mut s = sampler(cfg(1.0, 1, 1.0, 0.0));
        assert_eq!(s.sample_masked(&l, &[], &mut scratch, Some(&mask)).unwrap() as usize, best);
        let mut s = sampler(cfg(5.0, 0, 1.0, 0.0));
        for _ in 0..500 {
            let t = s.sample_masked(&l, &[], &mut scratch, Some(&mask)).unwrap();
            assert!([3, 17, 33].contains(&t), "{t}");
        }
        // A mask shorter than the vocabulary allows nothing past its end.
        let mut s = sampler(cfg(5.0, 0, 1.0, 0.0));
        for _ in 0..200 {
            assert!(s.sample_masked(&l, &[], &mut scratch, Some(&mask[..1])).unwrap() < 32);
        }
    }

    #[test]
    fn a_mask_that_allows_nothing_is_an_error() {
        let mut l: [f32; V] = logits(3);
        let mut scratch = [Candidate::default(); V];
        let mut s = sampler(SamplerConfig::greedy());
        assert_eq!(s.sample_masked(&l, &[], &mut scratch, Some(&[0])), Err(SampleError::NoAllowedToken));
        // Allowed, but -inf: nothing either.
        l[2] = f32::NEG_INFINITY;
        assert_eq!(s.sample_masked(&l, &[], &mut scratch, Some(&[1 << 2])), Err(SampleError::NoAllowedToken));
        assert!(message(SampleError::NoAllowedToken).contains("mask"));
        // Without a mask nothing changes.
        assert_eq!(s.sample_masked(&l, &[], &mut scratch, None), s.sample(&l, &[], &mut scratch));
    }

    /// Which tokens `s` ever returns in `draws` draws.
    fn support(s: &mut Sampler, l: &[f32], draws: usize) -> [bool; V] {
        let mut seen = [false; V];
        let mut scratch = [Candidate::default(); V];
        for _ in 0..draws {
            seen[s.sample(l, &[], &mut scratch).unwrap() as usize] = true;
        }
        seen
    }

    fn set(ids: &[usize]) -> [bool; V] {
        let mut s = [false; V];
        for &i in ids {
            s[i] = true;
        }
        s
    }

    #[test]
    fn xoshiro_and_splitmix_known_answers() {
        // Reference outputs of xoshiro256** from the state [1, 2, 3, 4] (as in Vigna's reference
        // code and rand_xoshiro's tests), and splitmix64's first output for seed 0.
        let mut r = Rng { s: [1, 2, 3, 4] };
        let got: [u64; 6] = core::array::from_fn(|_| r.next_u64());
        assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240, 1216172134540287360, 607988272756665600]);
        assert_eq!(Rng::from_seed(0).s[0], 0xE220_A839_7B1D_CDAF);
        let mut r = Rng::from_seed(7);
        for _ in 0..1000 {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn defaults_are_llama_cpp_cli_defaults() {
        let d = SamplerConfig::default();
        assert_eq!((d.temperature, d.top_k, d.top_p, d.min_p), (0.8, 40, 0.95, 0.05));
        assert_eq!((d.repeat_penalty, d.repeat_last_n), (1.0, 64));
        assert!(SamplerConfig::greedy().is_greedy() && !d.is_greedy());
        d.validate().unwrap();
    }

    #[test]
    fn a_bias_in_the_scratch_list_samples_as_one_added_to_the_row() {
        let l = [1.0, 2.5, -0.5, 0.25, 2.0];
        let bias = [(2, 4.0), (1, f32::NEG_INFINITY), (9, 1.0)];
        let mut added = l;
        added[2] += 4.0;
        added[1] += f32::NEG_INFINITY;
        let mut scratch = [Candidate::default(); 5];
        for t in [0.0, 0.8] {
            let cfg = SamplerConfig { temperature: t, ..SamplerConfig::default() };
            let (mut a, mut b) = (Sampler::new(cfg).unwrap(), Sampler::new(cfg).unwrap());
            for _ in 0..8 {
                let x = a.sample_biased(&l, &bias, &[], &mut scratch, None).unwrap();
                assert_eq!(x, b.sample(&added, &[], &mut scratch).unwrap());
            }
        }
        let inf = [(0, f32::INFINITY)];
        let e =
            Sampler::new(SamplerConfig::greedy()).unwrap().sample_biased(&l, &inf, &[], &mut scratch, None);
        assert_eq!(e, Err(SampleError::InfiniteLogit { index: 0 }));
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let mut s = sampler(SamplerConfig::greedy());
        let mut scratch = [Candidate::default(); 64];
        for seed in 0..50 {
            let l: [f32; 64] = logits(seed);
            let best = (0..64).fold(0, |b, i| if l[i] > l[b] { i } else { b });
            assert_eq!(s.sample(&l, &[], &mut scratch).unwrap() as usize, best);
        }
    }

    #[test]
    fn ties_go_to_the_lowest_id() {
        let l = [1.0, 3.0, -2.0, 3.0, 3.0, 0.5, 0.0, -0.0];
        let mut scratch = [Candidate::default(); V];
        assert_eq!(sampler(SamplerConfig::greedy()).sample(&l, &[], &mut scratch), Ok(1));
        // top-k = 1 keeps the same one, whatever the temperature.
        for t in [0.01, 1.0, 100.0] {
            assert_eq!(sampler(cfg(t, 1, 1.0, 0.0)).sample(&l, &[], &mut scratch), Ok(1));
        }
        // -0.0 and +0.0 are a tie too.
        let z = [-1.0, -0.0, 0.0, -3.0];
        assert_eq!(sampler(SamplerConfig::greedy()).sample(&z, &[], &mut scratch), Ok(1));
        assert_eq!(sampler(cfg(1.0, 1, 1.0, 0.0)).sample(&z, &[], &mut scratch), Ok(1));
    }

    #[test]
    fn top_k_1_is_greedy_at_any_temperature() {
        let mut scratch = [Candidate::default(); 300];
        for (i, t) in [0.05f32, 0.7, 1.0, 3.0, 1000.0].into_iter().enumerate() {
            let mut g = sampler(SamplerConfig::greedy());
            let mut k1 = sampler(SamplerConfig { seed: i as u64, ..cfg(t, 1, 0.95, 0.05) });
            for seed in 0..20 {
                let l: [f32; 300] = logits(100 + seed);
                let greedy = g.sample(&l, &[], &mut scratch).unwrap();
                assert_eq!(k1.sample(&l, &[], &mut scratch).unwrap(), greedy, "temperature {t}");
            }
        }
    }

    #[test]
    fn top_k_keeps_the_k_best_sorted() {
        let l: [f32; 1000] = logits(3);
        let mut c = [Candidate::default(); 1000];
        load(&mut c, &l, &[]).unwrap();
        let mut reference = c;
        reference.sort_unstable_by(by_logit_desc);
        assert_eq!(top_k(&mut c, 37), 37);
        assert_eq!(c[..37], reference[..37]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (ids shuffled so order is not the id order).
        let probs = [0.15, 0.5, 0.05, 0.3];
        let l = ln(&probs);
        for (p, want) in
            [(0.0, &[1][..]), (0.4, &[1]), (0.7, &[1, 3]), (0.9, &[1, 3, 0]), (0.97, &[1, 3, 0, 2])]
        {
            for sorted in [false, true] {
                let mut c = [Candidate::default(); 4];
                load(&mut c, &l[..4], &[]).unwrap();
                if sorted {
                    c.sort_unstable_by(by_logit_desc);
                }
                let n = top_p(&mut c, sorted, p);
                let ids: heapless::Vec<usize, 4> = c[..n].iter().map(|c| c.id as usize).collect();
                assert_eq!(&ids[..], want, "top_p {p}, sorted {sorted}");
            }
            // Through the sampler (top-k off, no min-p): exactly that support.
            let mut s = sampler(cfg(1.0, 0, p, 0.0));
            assert_eq!(support(&mut s, &l[..4], 2000)[..4], set(want)[..4], "top_p {p}");
        }
    }

    #[test]
    fn top_p_over_an_unsorted_vocabulary_sorts_only_what_it_needs_and_matches_a_full_sort() {
        const N: usize = 5000;
        for (seed, scale) in [(1, 0.01f64), (2, 1.0), (3, 6.0)] {
            // scale 0.01: nearly flat, so top-p needs most of the vocabulary (several chunks).
            let mut r = Rng::from_seed(seed);
            let l: [f32; N] = core::array::from_fn(|_| (r.next_f64() * scale) as f32);
            let mut c = [Candidate::default(); N];
            load(&mut c, &l, &[]).unwrap();
            let mut full = c;
            softmax(&mut full, false);
            full.sort_unstable_by(by_logit_desc);
            let mut cum = 0.0f32;
            let want = full.iter().position(|x| {
                cum += x.p;
                cum >= 0.9
            });
            let n = top_p(&mut c, false, 0.9);
            assert_eq!(n, want.map_or(N, |i| i + 1), "scale {scale}");
            assert_eq!(c[..n], full[..n]);
        }
    }

    #[test]
    fn min_p_keeps_tokens_within_the_ratio_of_the_best() {
        let probs = [0.15, 0.5, 0.05, 0.3];
        let l = ln(&probs);
        // min_p 0.2 -> p >= 0.1; 0.5 -> p >= 0.25; 1.0 -> only the best.
        for (p, want) in [(0.2, &[1, 3, 0][..]), (0.5, &[1, 3]), (1.0, &[1])] {
            let mut c = [Candidate::default(); 4];
            load(&mut c, &l[..4], &[]).unwrap();
            let n = min_p(&mut c, false, p);
            let mut ids: heapless::Vec<usize, 4> = c[..n].iter().map(|c| c.id as usize).collect();
            ids.sort_unstable();
            let mut want_sorted: heapless::Vec<usize, 4> = want.iter().copied().collect();
            want_sorted.sort_unstable();
            assert_eq!(ids, want_sorted, "unsorted min_p {p}");

            let mut c = [Candidate::default(); 4];
            load(&mut c, &l[..4], &[]).unwrap();
            c.sort_unstable_by(by_logit_desc);
            let n = min_p(&mut c, true, p);
            let ids: heapless::Vec<usize, 4> = c[..n].iter().map(|c| c.id as usize).collect();
            assert_eq!(&ids[..], want, "sorted min_p {p}");

            // Through the sampler, both with top-k (sorted path) and without (unsorted path).
            for k in [0, 3] {
                let mut s = sampler(cfg(1.0, k, 1.0, p));
                let mut expect = set(want);
                if k == 3 {
                    expect[2] = false; // top-k 3 drops the 0.05 token first
                }
                assert_eq!(support(&mut s, &l[..4], 2000)[..4], expect[..4], "min_p {p}, top_k {k}");
            }
        }
    }

    #[test]
    fn the_default_chain_truncates_before_temperature() {
        // Probabilities 0.6, 0.37, 0.02, 0.01 at temperature 1. top-p 0.95 keeps two tokens; a
        // high temperature flattens the survivors but cannot bring the others back (llama.cpp order).
        let l = ln(&[0.6, 0.37, 0.02, 0.01]);
        let mut s = sampler(SamplerConfig { temperature: 50.0, ..SamplerConfig::default() });
        assert_eq!(support(&mut s, &l[..4], 3000)[..4], set(&[0, 1])[..4]);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let l: [f32; 256] = logits(9);
        let mut scratch = [Candidate::default(); 256];
        let c = cfg(1.5, 0, 1.0, 0.0);
        let run = |seed: u64, scratch: &mut [Candidate]| -> [u32; 64] {
            let mut s = sampler(SamplerConfig { seed, ..c });
            core::array::from_fn(|_| s.sample(&l, &[], scratch).unwrap())
        };
        let a = run(1, &mut scratch);
        assert_eq!(a, run(1, &mut scratch));
        assert_ne!(a, run(2, &mut scratch));
        // reseed restarts the stream.
        let mut s = sampler(SamplerConfig { seed: 1, ..c });
        s.sample(&l, &[], &mut scratch).unwrap();
        s.reseed(1);
        assert_eq!(s.sample(&l, &[], &mut scratch).unwrap(), a[0]);
        assert_eq!(s.config().seed, 1);
    }

    #[test]
    fn draws_follow_the_softmax() {
        let l = [1.0f32, 0.0, 2.0, -1.0, 0.5, 1.5, -3.0, 0.25];
        let max = 2.0f32;
        let mut expected = [0.0f64; V];
        let sum: f64 = l.iter().map(|&x| libm::exp(f64::from(x - max))).sum();
        for (e, &x) in expected.iter_mut().zip(&l) {
            *e = libm::exp(f64::from(x - max)) / sum;
        }
        let mut s = sampler(cfg(1.0, 0, 1.0, 0.0));
        let mut counts = [0usize; V];
        let mut scratch = [Candidate::default(); V];
        const DRAWS: usize = 20_000;
        for _ in 0..DRAWS {
            counts[s.sample(&l, &[], &mut scratch).unwrap() as usize] += 1;
        }
        for i in 0..V {
            let got = counts[i] as f64 / DRAWS as f64;
            assert!((got - expected[i]).abs() < 0.02, "token {i}: {got} vs {}", expected[i]);
        }
        // Temperature 2 is the softmax of l / 2.
        let mut s = sampler(cfg(2.0, 0, 1.0, 0.0));
        let mut counts = [0usize; V];
        for _ in 0..DRAWS {
            counts[s.sample(&l, &[], &mut scratch).unwrap() as usize] += 1;
        }
        let sum: f64 = l.iter().map(|&x| libm::exp(f64::from(x - max) / 2.0)).sum();
        for i in 0..V {
            let want = libm::exp(f64::from(l[i] - max) / 2.0) / sum;
            let got = counts[i] as f64 / DRAWS as f64;
            assert!((got - want).abs() < 0.02, "T=2 token {i}: {got} vs {want}");
        }
    }

    #[test]
    fn penalty_divides_positive_and_multiplies_negative_logits_once_per_token() {
        let mut c = [Candidate::default(); 5];
        load(&mut c, &[2.0, -1.0, 0.5, 0.0, 3.0], &[]).unwrap();
        // Token 0 twice in the window: penalised once. Token 4 is outside the last 4.
        let pen = SamplerConfig { repeat_penalty: 2.0, repeat_last_n: 4, ..SamplerConfig::greedy() };
        apply_penalties(&mut c, &[4, 0, 1, 0, 3], &pen).unwrap();
        let got: [f32; 5] = core::array::from_fn(|i| c[i].logit);
        assert_eq!(got, [1.0, -2.0, 0.5, 0.0, 3.0]);
        // Frequency: per occurrence; presence: once per distinct token (OpenAI's, as llama.cpp).
        load(&mut c, &[2.0, -1.0, 0.5, 0.0, 3.0], &[]).unwrap();
        let fp = SamplerConfig { frequency_penalty: 0.5, presence_penalty: 0.25, repeat_last_n: 4, ..pen };
        apply_penalties(&mut c, &[4, 0, 1, 0, 3], &SamplerConfig { repeat_penalty: 1.0, ..fp }).unwrap();
        let got: [f32; 5] = core::array::from_fn(|i| c[i].logit);
        assert_eq!(got, [2.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5, -0.75, 3.0]);
        assert!(c.iter().all(|c| c.p == 0.0));

        let mut scratch = [Candidate::default(); 4];
        let pen = SamplerConfig { repeat_penalty: 2.0, ..SamplerConfig::greedy() };
        // Positive: 2.0 / 2 = 1.0 < 1.5.
        assert_eq!(sampler(pen).sample(&[2.0, 1.5], &[0], &mut scratch), Ok(1));
        // Negative: -1.0 * 2 = -2.0 < -1.5.
        assert_eq!(sampler(pen).sample(&[-1.0, -1.5], &[0], &mut scratch), Ok(1));
        // A penalty below 1 favours repeats: -1.0 * 0.5 = -0.5 > -0.75.
        let favour = SamplerConfig { repeat_penalty: 0.5, ..pen };
        assert_eq!(sampler(favour).sample(&[-0.75, -1.0], &[1], &mut scratch), Ok(1));
        // Off when repeat_last_n is 0 or the penalty 1; the window is the LAST n tokens.
        let off = SamplerConfig { repeat_last_n: 0, ..pen };
        assert_eq!(sampler(off).sample(&[2.0, 1.5], &[0], &mut scratch), Ok(0));
        let last1 = SamplerConfig { repeat_last_n: 1, ..pen };
        assert_eq!(sampler(last1).sample(&[2.0, 1.5], &[0, 1], &mut scratch), Ok(0));
        // A huge logit with a tiny penalty saturates instead of becoming +inf.
        let tiny = SamplerConfig { repeat_penalty: 1e-30, ..pen };
        assert_eq!(sampler(tiny).sample(&[1e30, 1.0], &[0], &mut scratch), Ok(0));
    }

    #[test]
    fn bad_logits_are_errors_that_say_what_is_wrong() {
        let mut scratch = [Candidate::default(); 4];
        for c in [SamplerConfig::greedy(), SamplerConfig::default()] {
            let mut s = sampler(c);
            let e = s.sample(&[0.0, f32::NAN, 1.0], &[], &mut scratch).unwrap_err();
            assert_eq!(e, SampleError::NanLogit { index: 1 });
            assert!(message(e).contains("logits contain NaN"), "{}", message(e));
            let e = s.sample(&[f32::INFINITY, 1.0], &[], &mut scratch).unwrap_err();
            assert!(message(e).contains("logits contain +inf"));
            let e = s.sample(&[f32::NEG_INFINITY; 3], &[], &mut scratch).unwrap_err();
            assert_eq!(e, SampleError::NoFiniteLogit);
            assert_eq!(s.sample(&[], &[], &mut scratch), Err(SampleError::EmptyLogits));
            let e = s.sample(&[0.0; 5], &[], &mut scratch).unwrap_err();
            assert_eq!(e, SampleError::ScratchTooSmall { needed: 5, got: 4 });
        }
        // -inf is a masked token: never drawn.
        let l = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        let mut s = sampler(cfg(1.0, 0, 1.0, 0.0));
        assert_eq!(support(&mut s, &l, 500)[..4], [false, true, false, true]);
        // A token id outside the vocabulary in the penalty window.
        let pen = SamplerConfig { repeat_penalty: 1.1, ..SamplerConfig::default() };
        let e = sampler(pen).sample(&[0.0; 4], &[1, 9], &mut scratch).unwrap_err();
        assert_eq!(e, SampleError::RecentTokenOutOfRange { token: 9, n_vocab: 4 });
    }

    #[test]
    fn invalid_configs_are_refused_with_the_field_named() {
        let d = SamplerConfig::default();
        let cases = [
            (SamplerConfig { temperature: f32::NAN, ..d }, "temperature"),
            (SamplerConfig { temperature: -0.5, ..d }, "temperature"),
            (SamplerConfig { temperature: f32::INFINITY, ..d }, "temperature"),
            (SamplerConfig { top_p: 1.5, ..d }, "top_p"),
            (SamplerConfig { top_p: f32::NAN, ..d }, "top_p"),
            (SamplerConfig { min_p: -0.1, ..d }, "min_p"),
            (SamplerConfig { repeat_penalty: 0.0, ..d }, "repeat_penalty"),
            (SamplerConfig { repeat_penalty: f32::NAN, ..d }, "repeat_penalty"),
        ];
        for (c, field) in cases {
            let e = Sampler::new(c).unwrap_err();
            assert!(matches!(e, SampleError::InvalidConfig { param, .. } if param == field));
            let m = message(e);
            assert!(m.contains(field) && m.contains("expected"), "{m}");
        }
        // Edges that are allowed.
        for c in [
            SamplerConfig { temperature: 0.0, top_p: 0.0, min_p: 1.0, ..d },
            SamplerConfig { top_p: 1.0, min_p: 0.0, top_k: 0, repeat_penalty: 0.5, ..d },
        ] {
            Sampler::new(c).unwrap();
        }
    }
}
