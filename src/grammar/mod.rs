//! std layer: constrained sampling. A grammar (GBNF, JSON Schema, any JSON object, a regex or
//! llguidance's Lark) is compiled against the model's vocabulary by the grammar engine
//! (llguidance), and a [`Constraint`] gives, before each token, the mask of the tokens that keep
//! the output in the language; the core's sampler draws only among them.
//!
//! * The mask of the next token is computed on a helper thread as soon as a token is committed, so
//!   it overlaps the forward pass that computes the next logits ([`Constraint::commit`] starts it,
//!   [`Constraint::mask`] waits for it).
//! * End-of-generation tokens are allowed exactly when the text so far is a complete sentence of
//!   the grammar.
//! * [`Constraint::closing`] finds a short way to complete the grammar from where it is (forced
//!   bytes first, then closing punctuation before anything that opens more), so a caller with a
//!   token budget can steer the end of the output into a complete sentence rather than have it
//!   cut off.
//! * Limits: the engine's own budgets (grammar size, lexer states, work per mask) refuse a grammar
//!   that would blow up, with an error, never a hang.

pub mod gbnf;

use std::boxed::Box;
use std::fmt;
use std::string::{String, ToString};
use std::sync::mpsc;
use std::sync::Arc;
use std::vec::Vec;
use std::{format, vec};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::{TokenAttr, Tokenizer};
pub use gbnf::{Gbnf, GbnfError};

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarSpec {
    /// A GBNF grammar (llama.cpp's format), starting at `root`.
    Gbnf(String),
    /// A JSON Schema (its text).
    JsonSchema(String),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression the whole output must match.
    Regex(String),
    /// llguidance's Lark syntax.
    Lark(String),
}

/// A grammar that cannot be used.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarError {
    /// The GBNF text is malformed.
    Gbnf(GbnfError),
    /// The schema is not JSON.
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What the JSON parser saw.
        message: String,
    },
    /// A `<token>` of a GBNF grammar is not one token of this vocabulary.
    UnknownToken {
        /// Its text.
        text: String,
        /// Where it is.
        line: usize,
        /// Where it is.
        column: usize,
    },
    /// The engine refused the grammar (a schema feature it does not support, an invalid regex, a
    /// grammar too large for its budgets ...): its message.
    Engine(String),
    /// The engine failed while generating (a budget exhausted mid-way).
    Runtime(String),
}

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gbnf(e) => write!(f, "{e}"),
            Self::Json { line, column, message } => {
                write!(f, "the JSON schema is not valid JSON (line {line}, column {column}): {message}")
            }
            Self::UnknownToken { text, line, column } => {
                write!(f, "grammar line {line}, column {column}: `{text}` is not a token of this model's vocabulary")
            }
            Self::Engine(m) => write!(f, "the grammar cannot be used: {m}"),
            Self::Runtime(m) => write!(f, "the grammar engine failed: {m}"),
        }
    }
}

impl std::error::Error for GrammarError {}

/// The size and time budgets a grammar gets (below llguidance's defaults where a board would
/// otherwise spend seconds): a grammar that exceeds them is refused when compiled, or ends the
/// generation with an error, never hangs.
fn limits(l: &mut llguidance::api::ParserLimits) {
    l.max_grammar_size = 200_000;
    l.initial_lexer_fuel = 1_000_000;
    l.step_lexer_fuel = 200_000;
    l.step_max_items = 50_000;
    l.max_lexer_states = 100_000;
    l.verbose_errors = false;
}

/// Whitespace JSON may have between its tokens: one space, or a line break and up to 20 spaces or
/// tabs of indent (llama.cpp's rule). Unbounded whitespace lets a small model loop on it. (Schemas
/// are read leniently, as llama.cpp reads them: a keyword no grammar can enforce, `uniqueItems`
/// or an unknown `format`, is ignored rather than refused.)
const JSON_WHITESPACE: &str = r"(?:\x20|\x0A[\x20\x09]{0,20})";

/// A model's vocabulary, as the grammar engine sees it: every token's bytes (special tokens marked
/// so no text matches them), the end-of-generation tokens, the single-byte tokens. Built once per
/// model and shared by every constraint.
pub struct Vocab {
    env: TokEnv,
    factory: ParserFactory,
    eog: Vec<u32>,
    /// The token of each byte value, where the vocabulary has one.
    byte_token: [Option<u32>; 256],
    n_vocab: usize,
}

impl fmt::Debug for Vocab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vocab").field("n_vocab", &self.n_vocab).field("eog", &self.eog).finish()
    }
}

impl Vocab {
    /// The vocabulary of `tok`, ready to compile grammars against.
    pub fn new(tok: &Tokenizer<'_>) -> Result<Arc<Self>, GrammarError> {
        let n = tok.n_vocab();
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(n as usize);
        let mut eog = Vec::new();
        let mut byte_token = [None; 256];
        let mut buf = vec![0u8; tok.max_piece_len().max(16) + 8];
        for id in 0..n {
            let attr = tok.attr(id).map_err(|e| GrammarError::Engine(e.to_string()))?;
            if tok.is_eog(id) {
                eog.push(id);
            }
            let special = tok.is_eog(id) || attr.is_control() || attr.has(TokenAttr::UNUSED);
            let len =
                tok.token_to_piece(id, false, &mut buf).map_err(|e| GrammarError::Engine(e.to_string()))?;
            let mut word = Vec::with_capacity(len + 1);
            if special || len == 0 {
                // (The engine's mark of a special token: no text can match it.)
                word.push(TokTrie::SPECIAL_TOKEN_MARKER);
                match tok.token_text(id) {
                    Ok(t) if !t.is_empty() => word.extend_from_slice(t),
                    _ => word.extend_from_slice(format!("<[{id}]>").as_bytes()),
                }
            } else {
                word.extend_from_slice(&buf[..len]);
                if len == 1 && byte_token[buf[0] as usize].is_none() {
                    byte_token[buf[0] as usize] = Some(id);
                }
            }
            words.push(word);
        }
        let Some(&first_eog) = eog.first() else {
            return Err(GrammarError::Engine(
                "this model has no end-of-generation token: a constrained output could never end".into(),
            ));
        };
        let info = TokRxInfo::new(n, first_eog);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let caps = InferenceCapabilities::default();
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory =
            ParserFactory::new(&env, caps, &slices).map_err(|e| GrammarError::Engine(e.to_string()))?;
        factory.quiet();
        limits(factory.limits_mut());
        Ok(Arc::new(Self { env, factory, eog, byte_token, n_vocab: n as usize }))
    }

    /// Tokens of the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The id of the one token whose text is `text` (a GBNF `<...>`).
    fn token_with_text(&self, text: &str) -> Option<u32> {
        let trie = self.env.tok_trie();
        let mut special = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        special.extend_from_slice(text.as_bytes());
        trie.token_id(&special).or_else(|| trie.token_id(text.as_bytes()))
    }

    /// Compiles `spec` into a constraint at the start of the output.
    pub fn compile(self: &Arc<Self>, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let grammar = match spec {
            GrammarSpec::Gbnf(src) => {
                let g = Gbnf::parse(src).map_err(GrammarError::Gbnf)?;
                let mut ids = Vec::new();
                for (t, at) in g.tokens() {
                    let id = match t {
                        gbnf::TokenRef::Id(id) if (*id as usize) < self.n_vocab => *id,
                        gbnf::TokenRef::Id(id) => {
                            return Err(token_error(src, at, &format!("<[{id}]>")));
                        }
                        gbnf::TokenRef::Text(text) => {
                            self.token_with_text(text).ok_or_else(|| token_error(src, at, text))?
                        }
                    };
                    ids.push((t.clone(), id));
                }
                let lookup = |t: &gbnf::TokenRef| ids.iter().find(|(r, _)| r == t).map_or(0, |&(_, id)| id);
                TopLevelGrammar::from_lark(g.to_lark(&lookup))
            }
            GrammarSpec::JsonSchema(text) => {
                let mut schema: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                    GrammarError::Json { line: e.line(), column: e.column(), message: e.to_string() }
                })?;
                close_objects(&mut schema);
                if let Some(obj) = schema.as_object_mut() {
                    if !obj.contains_key("x-guidance") {
                        obj.insert(
                            "x-guidance".into(),
                            serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE, "lenient": true }),
                        );
                    }
                } else if !schema.is_boolean() {
                    return Err(GrammarError::Engine("a JSON schema is an object (or true/false)".into()));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({
                "type": "object",
                "x-guidance": { "whitespace_pattern": JSON_WHITESPACE, "lenient": true }
            })),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Engine(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Engine(e));
        }
        let mut state = Box::new(State { matcher, mask: Vec::new(), compute_us: Vec::new() });
        state.compute_mask(self)?;
        Ok(Constraint {
            vocab: Arc::clone(self),
            state: Some(state),
            worker: None,
            pending: false,
            plan: None,
            planned_after: None,
            waited_us: 0,
            closing_estimate: None,
            search_again_in: 0,
            failed_searches: 0,
        })
    }
}

/// Sets `additionalProperties: false` on every object schema that lists `properties` and says
/// nothing of others, as llama.cpp's schema converter reads such a schema (JSON Schema itself
/// would allow any other property: a small model then invents some). Only schema positions are
/// visited, never `const`, `enum` or `default` data.
fn close_objects(schema: &mut serde_json::Value) {
    let Some(obj) = schema.as_object_mut() else { return };
    if obj.contains_key("properties") && !obj.contains_key("additionalProperties") {
        obj.insert("additionalProperties".into(), serde_json::Value::Bool(false));
    }
    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Some(map) = value.as_object_mut() {
                    map.values_mut().for_each(close_objects);
                }
            }
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Some(list) = value.as_array_mut() {
                    list.iter_mut().for_each(close_objects);
                }
            }
            "items"
            | "additionalProperties"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames"
            | "unevaluatedProperties"
            | "unevaluatedItems" => close_objects(value),
            _ => {}
        }
    }
}

fn token_error(src: &str, at: usize, text: &str) -> GrammarError {
    let (line, column) = gbnf::line_column(src, at);
    GrammarError::UnknownToken { text: text.to_string(), line, column }
}

/// The engine's state and the mask computed for it.
struct State {
    matcher: Matcher,
    /// Bit `i` of word `i / 32`: token `i` is allowed.
    mask: Vec<u32>,
    /// Microseconds each mask took to compute.
    compute_us: Vec<u32>,
}

impl State {
    fn compute_mask(&mut self, vocab: &Vocab) -> Result<(), GrammarError> {
        let t0 = std::time::Instant::now();
        let r = self.compute_mask_untimed(vocab);
        self.compute_us.push(u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX));
        r
    }

    fn compute_mask_untimed(&mut self, vocab: &Vocab) -> Result<(), GrammarError> {
        let m = if self.matcher.is_stopped() {
            // Complete, and nothing may follow: only the end of generation.
            let mut m = vec![0u32; vocab.n_vocab.div_ceil(32)];
            for &t in &vocab.eog {
                m[t as usize / 32] |= 1 << (t % 32);
            }
            m
        } else {
            let v = self.matcher.compute_mask().map_err(runtime)?;
            let mut m = v.as_slice().to_vec();
            m.resize(vocab.n_vocab.div_ceil(32), 0);
            // Every end-of-generation token, or none (the engine marks them as one set).
            let accepting = vocab.eog.iter().any(|&t| v.is_allowed(t));
            for &t in &vocab.eog {
                if accepting {
                    m[t as usize / 32] |= 1 << (t % 32);
                } else {
                    m[t as usize / 32] &= !(1 << (t % 32));
                }
            }
            m
        };
        self.mask = m;
        Ok(())
    }
}

/// One output's constraint: where the grammar is, and the mask of the next token.
pub struct Constraint {
    vocab: Arc<Vocab>,
    /// The state, while no mask is being computed (boxed: the engine's state is large, and it
    /// moves to the mask thread and back at every token).
    state: Option<Box<State>>,
    /// The thread computing masks (started by the first commit), and whether it holds the state.
    worker: Option<MaskWorker>,
    pending: bool,
    /// A completion from where the grammar is ([`Constraint::closing`]), kept while it is followed.
    plan: Option<Vec<u32>>,
    /// The completion after the token [`Constraint::steer`] let through, for when it is committed.
    planned_after: Option<(u32, Vec<u32>)>,
    /// Microseconds callers waited for a mask still being computed.
    waited_us: u64,
    /// The length of the last completion found, and the tokens since.
    closing_estimate: Option<(usize, usize)>,
    /// Tokens until the next search, after one that found no completion, and how many in a row
    /// found none.
    search_again_in: usize,
    failed_searches: u32,
}

/// The thread that computes a constraint's masks: it takes the state after a commit and gives it
/// back with the next mask. (One thread for the constraint's life: starting one per token cost
/// more than many masks take.) It ends when the constraint is dropped.
struct MaskWorker {
    todo: mpsc::Sender<Box<State>>,
    done: mpsc::Receiver<Result<Box<State>, GrammarError>>,
}

impl MaskWorker {
    fn start(vocab: Arc<Vocab>) -> Result<Self, GrammarError> {
        let (todo, todo_rx) = mpsc::channel::<Box<State>>();
        let (done_tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("pinfer-grammar".into())
            .spawn(move || {
                for mut state in todo_rx {
                    let r = state.compute_mask(&vocab).map(|()| state);
                    if done_tx.send(r).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| GrammarError::Runtime(format!("cannot start the mask thread: {e}")))?;
        Ok(Self { todo, done })
    }
}

/// How long masks took ([`Constraint::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskStats {
    /// Masks computed.
    pub masks: usize,
    /// Median and 99th percentile of their computation, in microseconds.
    pub p50_us: u32,
    /// See `p50_us`.
    pub p99_us: u32,
    /// The slowest.
    pub max_us: u32,
    /// Time the generation waited for a mask (what the overlap with the forward pass did not hide).
    pub waited_us: u64,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

/// Bytes tried, in this order, by the long search for a way to complete the grammar: what closes
/// strings, objects, arrays and groups first, separators next, then digits and letters (short
/// numbers and words), openers late (they start more to close), white space last (it never
/// completes anything by itself).
const CLOSING_ORDER: &[u8] =
    b"\"}])>',.:;=0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-+_!?/\\*#@$%&|^~`<([{ \n\t";
/// The short search's order: every punctuation mark before digits and letters (a completion of a
/// few bytes is mostly punctuation: `"}`, `(){}`, `=0`), one digit and one letter standing for
/// the rest; it tries the first [`SHORT_SEARCH_BRANCHES`] bytes a state allows.
const SHORT_ORDER: &[u8] = b"\"}])>',.:;=([{<-+*/_!?#@$%&|^~`\\0a \n\t";
const SHORT_SEARCH_BRANCHES: usize = 12;

/// The most bytes a completion found by [`Constraint::closing`] may have.
const CLOSING_MAX_BYTES: usize = 256;
/// Steps (bytes tried) of the short search for a completion: every completion of up to a few
/// bytes, whatever the order finds first.
const SHORT_SEARCH_STEPS: usize = 12_000;
/// Steps of each round of the long search, which follows [`CLOSING_ORDER`] depth first.
const LONG_SEARCH_STEPS: usize = 4_000;

/// How close to the token limit a constrained output starts to check that it can still complete
/// its grammar in the tokens left.
pub const STEER_WINDOW: usize = 64;
/// Tokens of slack kept beyond the completion before each token is checked.
const STEER_SLACK: usize = 16;
/// Tokens [`Constraint::steer`] lets pass after a search that found no completion (twice as many
/// after each further one, up to 8 times as many).
const STEER_RETRY_AFTER: usize = 3;
/// What one token is assumed to add at most to the completion's length (in tokens): the
/// completion is searched again only when that growth could have used up the room left.
const GROWTH_PER_TOKEN: usize = 2;

impl Constraint {
    fn state(&mut self) -> Result<&mut State, GrammarError> {
        if std::mem::take(&mut self.pending) {
            let t0 = std::time::Instant::now();
            let worker =
                self.worker.as_ref().ok_or_else(|| GrammarError::Runtime("no mask thread".into()))?;
            let s = worker
                .done
                .recv()
                .map_err(|_| GrammarError::Runtime("the mask thread panicked".into()))??;
            self.waited_us += t0.elapsed().as_micros() as u64;
            self.state = Some(s);
        }
        self.state.as_deref_mut().ok_or_else(|| GrammarError::Runtime("an earlier grammar error".into()))
    }

    /// The mask of the next token (bit `i` of word `i / 32`: token `i` is allowed), waiting for
    /// its computation if it is still running.
    pub fn mask(&mut self) -> Result<&[u32], GrammarError> {
        Ok(&self.state()?.mask)
    }

    /// Whether end of generation is allowed now (the text so far is complete).
    pub fn is_accepting(&mut self) -> Result<bool, GrammarError> {
        let eog = self.vocab.eog.first().copied();
        let mask = self.mask()?;
        Ok(eog.is_some_and(|t| mask[t as usize / 32] & (1 << (t % 32)) != 0))
    }

    /// Whether no token at all is allowed (the grammar cannot go on and is not complete).
    pub fn is_dead_end(&mut self) -> Result<bool, GrammarError> {
        Ok(self.mask()?.iter().all(|&w| w == 0))
    }

    /// Takes `token` (it must be allowed by the mask) and starts computing the next mask on a
    /// helper thread; [`mask`](Self::mask) waits for it. Returns whether the grammar is now
    /// complete with nothing allowed to follow.
    pub fn commit(&mut self, token: u32) -> Result<bool, GrammarError> {
        // The completion planned from here stays valid when it is what was taken.
        self.plan = match (self.plan.take(), self.planned_after.take()) {
            (_, Some((t, after))) if t == token => Some(after),
            (Some(mut plan), _) if plan.first() == Some(&token) => {
                plan.remove(0);
                Some(plan)
            }
            _ => None,
        };
        let vocab = Arc::clone(&self.vocab);
        let state = self.state()?;
        if !state.matcher.is_stopped() {
            state.matcher.consume_token(token).map_err(runtime)?;
        }
        if state.matcher.is_stopped() {
            state.compute_mask(&vocab)?; // (only the end of generation: no engine work)
            return Ok(true);
        }
        if self.worker.is_none() {
            self.worker = Some(MaskWorker::start(vocab)?);
        }
        let (Some(state), Some(worker)) = (self.state.take(), &self.worker) else {
            return Err(GrammarError::Runtime("an earlier grammar error".into()));
        };
        worker.todo.send(state).map_err(|_| GrammarError::Runtime("the mask thread ended".into()))?;
        self.pending = true;
        Ok(false)
    }

    /// How long the masks so far took to compute, and how long generation waited for them.
    pub fn stats(&mut self) -> Result<MaskStats, GrammarError> {
        let mut us = self.state()?.compute_us.clone();
        us.sort_unstable();
        let at = |q: f64| us.get(((us.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0);
        Ok(MaskStats {
            masks: us.len(),
            p50_us: at(0.5),
            p99_us: at(0.99),
            max_us: at(1.0),
            waited_us: self.waited_us,
        })
    }

    /// The token that ends generation when the grammar is complete.
    pub fn end_token(&self) -> Option<u32> {
        self.vocab.eog.first().copied()
    }

    /// Whether `token` would keep the output in the grammar (it is in the mask).
    pub fn allows(&mut self, token: u32) -> Result<bool, GrammarError> {
        let mask = self.mask()?;
        Ok(mask.get(token as usize / 32).is_some_and(|w| w & (1 << (token % 32)) != 0))
    }

    /// Tokens that complete the grammar from where it is, tokenized greedily from the bytes a
    /// bounded search finds: first every completion of a few bytes in turn (iterative deepening),
    /// then depth first in [`CLOSING_ORDER`] with forced bytes taken at once. Empty if it is
    /// complete already, `None` if the searches found nothing within their bounds.
    pub fn closing(&mut self) -> Result<Option<Vec<u32>>, GrammarError> {
        if let Some(plan) = &self.plan {
            return Ok(Some(plan.clone()));
        }
        let found = self.closing_after(None)?;
        self.plan = found.clone();
        Ok(found)
    }

    /// [`closing`](Self::closing) as it would be after `token`.
    pub fn closing_after(&mut self, token: Option<u32>) -> Result<Option<Vec<u32>>, GrammarError> {
        let vocab = Arc::clone(&self.vocab);
        let state = self.state()?;
        let mut m = state.matcher.deep_clone();
        if let Some(t) = token {
            if m.try_consume_tokens(&[t]).map_err(runtime)? != 1 {
                return Ok(None);
            }
        }
        let mut path = Vec::new();
        let mut found = false;
        let mut steps = 0usize;
        let short = Search {
            order: SHORT_ORDER,
            branches: SHORT_SEARCH_BRANCHES,
            forced: false,
            merge_siblings: true,
            budget: SHORT_SEARCH_STEPS,
        };
        for depth in 0..=8 {
            if search_closing(&vocab, &mut m, &mut path, &mut steps, &short, depth)? {
                found = true;
                break;
            }
            if steps >= SHORT_SEARCH_STEPS {
                break;
            }
        }
        if !found {
            // Depth first along the order, the depth bound doubling: a completion that the order
            // leads to is found at about its length, not at the bound.
            let long = Search {
                order: CLOSING_ORDER,
                branches: usize::MAX,
                forced: true,
                merge_siblings: false,
                budget: LONG_SEARCH_STEPS,
            };
            let mut depth = 8;
            while !found && depth <= CLOSING_MAX_BYTES {
                steps = 0;
                found = search_closing(&vocab, &mut m, &mut path, &mut steps, &long, depth)?;
                depth *= 2;
            }
        }
        Ok(found.then(|| vocab.env.tok_trie().greedy_tokenize(&path)))
    }

    /// The token to emit instead of `id` (sampled under the mask) when `left` tokens remain: `id`
    /// itself unless taking it would leave too few tokens to complete the grammar, then the next
    /// token of the completion found (end of generation if the text is complete already). Checks
    /// start [`STEER_WINDOW`] tokens before the limit, each token once the completion comes
    /// within [`STEER_SLACK`] of what is left.
    pub fn steer(&mut self, id: u32, left: usize) -> Result<u32, GrammarError> {
        if left > STEER_WINDOW || self.vocab.eog.contains(&id) {
            return Ok(id);
        }
        // Far enough from the limit, the completion's length found a few tokens ago still says
        // there is room: a token changes it by a little (a search costs far more than a token's
        // mask).
        if let Some((len, age)) = self.closing_estimate {
            if len + GROWTH_PER_TOKEN * (age + 1) + STEER_SLACK < left {
                self.closing_estimate = Some((len, age + 1));
                return Ok(id);
            }
        }
        // A search that found nothing is not repeated at once: one token rarely brings a
        // completion within the searches' bounds, and each costs milliseconds (the wait doubles
        // with every search in a row that finds none).
        // (Not in the last tokens: there each one must leave the text completable.)
        if self.search_again_in > 0 && left > STEER_SLACK {
            self.search_again_in -= 1;
            return Ok(id);
        }
        let Some(closing) = self.closing()? else {
            self.closing_estimate = None;
            self.search_again_in = STEER_RETRY_AFTER << self.failed_searches.min(3);
            self.failed_searches += 1;
            return Ok(id); // no completion found within the searches' bounds: nothing to steer by
        };
        self.failed_searches = 0;
        self.closing_estimate = Some((closing.len(), 0));
        if closing.len() + STEER_SLACK < left {
            return Ok(id);
        }
        if closing.first() == Some(&id) {
            return Ok(id);
        }
        match self.closing_after(Some(id))? {
            Some(after) if after.len() < left => {
                self.planned_after = Some((id, after));
                Ok(id)
            }
            _ => Ok(match closing.first() {
                Some(&t) => t,
                // Complete already: end here rather than start what cannot be finished.
                None => self.end_token().unwrap_or(id),
            }),
        }
    }
}

/// How [`search_closing`] searches.
struct Search {
    /// Bytes tried, in this order.
    order: &'static [u8],
    /// The most bytes tried from one state (those it allows, in order).
    branches: usize,
    /// Take the engine's forced bytes alone where there are some.
    forced: bool,
    /// Search only the first of sibling bytes whose states allow the same bytes next.
    merge_siblings: bool,
    /// The most bytes tried in all.
    budget: usize,
}

/// Searches for bytes that bring `m` to an accepting state, appending them to `path` (restored,
/// with `m`, when nothing is found). `max_depth` bounds the bytes; `steps` counts bytes tried.
fn search_closing(
    vocab: &Vocab,
    m: &mut Matcher,
    path: &mut Vec<u8>,
    steps: &mut usize,
    how: &Search,
    max_depth: usize,
) -> Result<bool, GrammarError> {
    if m.is_accepting().map_err(runtime)? {
        return Ok(true);
    }
    if max_depth == 0 || *steps >= how.budget || m.is_stopped() {
        return Ok(false);
    }
    let ff = if how.forced { m.compute_ff_bytes() } else { Vec::new() };
    let order: &[u8] = match ff.first() {
        Some(b) => core::slice::from_ref(b),
        None => how.order,
    };
    // The bytes this state allows, in order (at most `branches` of them).
    let mut allowed: Vec<(u8, u32)> = Vec::new();
    // Inside a multi-byte character no byte of the orders fits, only continuation bytes; where
    // only other characters than ASCII fit, their lead bytes (UTF-8's 0x80..=0xF4).
    const NON_ASCII: [u8; 0xF5 - 0x80] = {
        let mut c = [0u8; 0xF5 - 0x80];
        let mut i = 0;
        while i < c.len() {
            c[i] = 0x80 + i as u8;
            i += 1;
        }
        c
    };
    for order in [order, &NON_ASCII[..]] {
        for &b in order {
            let Some(t) = vocab.byte_token[b as usize] else { continue };
            *steps += 1;
            if *steps >= how.budget {
                return Ok(false);
            }
            if m.validate_tokens(&[t]).map_err(runtime)? == 1 {
                allowed.push((b, t));
                if allowed.len() >= how.branches {
                    break;
                }
            }
        }
        if !allowed.is_empty() || !ff.is_empty() {
            break;
        }
    }
    // Siblings that lead to states allowing the same of these bytes (a letter and a digit inside
    // a string, `+` and `-` between terms) are taken as one: only the first is searched.
    let mut seen: Vec<(u64, bool)> = Vec::new();
    for &(b, t) in &allowed {
        if m.try_consume_tokens(&[t]).map_err(runtime)? != 1 {
            continue;
        }
        if how.merge_siblings {
            let mut sig = 0u64;
            for (i, &(_, u)) in allowed.iter().enumerate().take(64) {
                *steps += 1;
                if m.validate_tokens(&[u]).map_err(runtime)? == 1 {
                    sig |= 1 << i;
                }
            }
            let key = (sig, m.is_accepting().map_err(runtime)?);
            if seen.contains(&key) {
                m.rollback(1).map_err(runtime)?;
                continue;
            }
            seen.push(key);
        }
        path.push(b);
        let found = search_closing(vocab, m, path, steps, how, max_depth - 1)?;
        m.rollback(1).map_err(runtime)?;
        if found {
            return Ok(true);
        }
        path.pop();
        if *steps >= how.budget {
            return Ok(false);
        }
    }
    Ok(false)
}

/// An engine error met while generating.
fn runtime<E: fmt::Display>(e: E) -> GrammarError {
    GrammarError::Runtime(e.to_string())
}
