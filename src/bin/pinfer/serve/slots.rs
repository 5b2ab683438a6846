//! The server's engine thread: one [`Session`] whose KV cache holds one sequence per slot, and a
//! scheduler that runs every active slot in one batch per step.
//!
//! Per step the batch takes the next token of every slot that is generating (one pass over the
//! weights serves them all: decode is bound by memory bandwidth), then prompt tokens of slots
//! still reading their prompt, up to the batch size, and `--lookup` guesses share the rest. So a
//! long prompt is read in chunks between decode steps and never stalls the other streams for more
//! than one chunk. A prompt is cut only into chunks that take the f32 attention tiles
//! ([`prompt_piece`]), so its tokens compute the same bits however the batch is shared (given a
//! batch of at least 128 rows beside the other slots' next tokens: `-b` of 128 + `-np` - 1).
//!
//! Each slot keeps the tokens its KV sequence holds after a request ends: a request whose prompt
//! starts with them (a chat's next turn) only evaluates the rest, and a new request goes to the
//! idle slot whose cache shares the longest prefix with its prompt.
//!
//! Events go to the request's handler through an unbounded channel, so a slow client never blocks
//! the engine; a closed channel (the client left) cancels the request at the next step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use pinfer::engine::Entry;
use pinfer::generate::{Flow, GenerateError, Generator, Stop};
use pinfer::grammar::{Constraint, GrammarSpec};
use pinfer::kernels::attn_tile::TILE_MIN_TOKENS;
use pinfer::media::Part;
use pinfer::sampler::SamplerConfig;
use pinfer::session::Session;
use pinfer::speculative::next_draft_len;
use pinfer::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

/// What a request asks the engine to generate.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    /// Most tokens to generate (`None`: until end of generation or a full context).
    pub n_predict: Option<usize>,
    pub stops: Vec<String>,
    pub ignore_eos: bool,
    pub logit_bias: Vec<(u32, f32)>,
    /// Probabilities of the `n_probs` most likely tokens with every generated token (0: none).
    pub n_probs: usize,
    /// Reuse the slot's cached prefix (default on).
    pub cache_prompt: bool,
    /// The slot to run in (`None`: the best idle one).
    pub id_slot: Option<usize>,
    /// Context shift when the slot's cache is full (`serve --context-shift`), keeping the first
    /// `n_keep` prompt tokens (-1: the whole prompt) and BOS; `None`: the request ends there.
    pub n_keep: Option<i64>,
    /// The grammar the output must match (`response_format`, `grammar`, `json_schema`, `format`).
    pub grammar: Option<GrammarSpec>,
    /// A prompt with images: its text (with a media marker per image) and the images, decoded.
    pub media: Option<Media>,
}

/// A prompt with images, as a handler received it: the engine thread encodes the images and
/// feeds the text around them.
#[derive(Debug, Clone)]
pub struct Media {
    pub text: String,
    pub images: Vec<pinfer::media::DecodedImage>,
}

/// One request for the engine thread.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// `params.grammar`, compiled (by the handler: a bad grammar is its 400).
    pub constraint: Option<Constraint>,
    pub events: UnboundedSender<Event>,
}

/// What the engine thread is asked to do.
pub enum Request {
    Generate(Box<Job>),
    /// Save, restore or erase an idle slot's cache; the reply is what was done or an error
    /// message (a 400). The file is written or read by the handler, off this thread: a slow disk
    /// never stalls the other slots' streams.
    Slot {
        slot: usize,
        action: SlotAction,
        reply: tokio::sync::oneshot::Sender<Result<SlotDone, String>>,
    },
    /// Inputs to embed (an encoder's server runs them: `embeddings::Engine`).
    Embed(Box<EmbedJob>),
}

/// Inputs to embed, with the handler waiting for their vectors.
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    /// Each input's token types (a reranker's pairs on a model with two or more), or empty.
    pub types: Vec<Vec<u32>>,
    pub opts: pinfer::embed::EmbedOptions,
    pub reply: tokio::sync::oneshot::Sender<Result<pinfer::embed::Embeddings, pinfer::embed::EmbedError>>,
}

impl EmbedJob {
    /// The answer of a generating model's engine.
    pub fn refuse(self) {
        let _ = self.reply.send(Err(pinfer::embed::EmbedError::NotAnEncoder));
    }
}

pub enum SlotAction {
    /// Copy out the cache.
    Save,
    /// Load these tokens and their cache rows (from a validated slot file).
    Restore {
        tokens: Vec<u32>,
        rows: Vec<u8>,
    },
    Erase,
}

pub enum SlotDone {
    Saved { tokens: Vec<u32>, rows: Vec<u8> },
    Restored { n_tokens: usize },
    Erased { n_tokens: usize },
}

/// A token's probability and the most likely alternatives (natural-log probabilities).
#[derive(Debug, Clone)]
pub struct TokenProbs {
    pub id: u32,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(u32, Vec<u8>, f32)>,
}

/// What a request's handler receives.
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it completes (possibly empty: held back for a stop string
    /// or an incomplete character).
    Token { text: String, probs: Option<TokenProbs> },
    /// The stream ended.
    Done(Summary),
    /// It failed (the message says why); nothing more follows.
    Failed(String),
}

/// How a stream ended, and its counts and times.
#[derive(Debug, Clone)]
pub struct Summary {
    pub stop: Stop,
    /// The stop string that ended it.
    pub stop_word: Option<String>,
    pub slot: usize,
    pub n_prompt: usize,
    /// Prompt tokens taken from the slot's cache (not evaluated).
    pub n_cached: usize,
    pub n_generated: usize,
    pub prompt_ms: f64,
    pub generate_ms: f64,
    /// Lookup decoding: tokens guessed, and guesses taken (llama-server's `draft_n`,
    /// `draft_n_accepted`).
    pub n_drafted: usize,
    pub n_accepted: usize,
    /// The prompt and generated tokens (Ollama's `context`).
    pub tokens: Vec<u32>,
}

/// Counters the `/metrics`, `/slots` and `/props` endpoints read.
#[derive(Default)]
pub struct Stats {
    pub prompt_tokens: AtomicU64,
    pub prompt_us: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub generate_us: AtomicU64,
    pub requests_processing: AtomicUsize,
    pub requests_deferred: AtomicUsize,
    /// Positions held by all slots' caches.
    pub kv_tokens: AtomicUsize,
    pub steps: AtomicU64,
    /// Per slot: whether it is running a request.
    pub busy: Vec<AtomicBool>,
    /// Per slot: positions its cache holds.
    pub cached: Vec<AtomicUsize>,
}

impl Stats {
    pub fn new(slots: usize) -> Self {
        Self {
            busy: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            cached: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
            ..Self::default()
        }
    }
}

enum Phase {
    Idle,
    /// Reading the prompt: `tokens[..done]` is in the cache.
    Prompt {
        done: usize,
    },
    Generating,
}

/// A request running in a slot.
struct Running<'t> {
    job: Job,
    generator: Generator<'t>,
    /// Prompt and generated tokens (capacity: the slot's context, so a full one ends the stream).
    tokens: Vec<u32>,
    n_prompt: usize,
    n_cached: usize,
    n_generated: usize,
    started: Instant,
    prompt_done: Option<Instant>,
    stop_word: Option<String>,
    /// Lookup decoding: the guesses the step carries after the last token, how many of them
    /// were taken, how many the next step may carry, and the counts.
    guesses: Vec<u32>,
    taken: usize,
    draft_len: usize,
    n_drafted: usize,
    n_accepted: usize,
    /// The position of the prompt's first image (its cache is kept only up to there: the
    /// positions of an image hold no token a later prompt could match).
    first_image: Option<usize>,
}

struct Slot<'t> {
    phase: Phase,
    /// Tokens the slot's KV sequence holds (valid in any phase: the cache after the last step).
    cache: Vec<u32>,
    run: Option<Running<'t>>,
    last_used: u64,
}

/// A logits row of a step: its slot, the position of its token, and the guess that follows that
/// token in the batch (lookup decoding), whose row is the next one.
#[derive(Debug, Clone, Copy)]
struct Row {
    slot: usize,
    pos: usize,
    guess_after: Option<u32>,
}

/// The scheduler over a loaded session, with the tokenizer the handlers share.
pub struct Engine<'t> {
    session: Session,
    tok: &'t Tokenizer<'t>,
    slots: Vec<Slot<'t>>,
    queue: VecDeque<Job>,
    entries: Vec<Entry>,
    /// The logits rows of the last step.
    rows: Vec<Row>,
    /// The prompt chunks of the step being built: (slot, tokens).
    pieces: Vec<(usize, usize)>,
    /// Lookup decoding: the most guesses a generating slot carries per step (0: off).
    lookup: usize,
    stats: Arc<Stats>,
    clock: u64,
    piece: Vec<u8>,
    /// The vision projector (`--mmproj`): requests' images are encoded here.
    projector: Option<Box<pinfer::media::Projector>>,
}

impl<'t> Engine<'t> {
    /// `lookup`: guesses per generating slot and step (0: none; the session must keep every
    /// token's logits and go back to any position).
    pub fn new(
        session: Session,
        tok: &'t Tokenizer<'t>,
        stats: Arc<Stats>,
        lookup: usize,
        projector: Option<Box<pinfer::media::Projector>>,
    ) -> Self {
        let n_ctx = session.n_ctx();
        let slots = (0..session.n_seq())
            .map(|_| Slot {
                phase: Phase::Idle,
                cache: Vec::with_capacity(n_ctx + 1),
                run: None,
                last_used: 0,
            })
            .collect();
        let n_batch = session.n_batch();
        Self {
            piece: vec![0u8; pinfer::tokenizer::StreamDecoder::buffer_len(tok)],
            session,
            tok,
            slots,
            queue: VecDeque::new(),
            entries: Vec::with_capacity(n_batch),
            rows: Vec::with_capacity(n_batch),
            pieces: Vec::new(),
            lookup,
            stats,
            clock: 0,
            projector,
        }
    }

    /// Runs until `jobs` is closed and every request has ended (or `stop` asks to cancel them).
    pub fn serve(mut self, jobs: mpsc::Receiver<Request>, stop: &AtomicBool) {
        let mut open = true;
        loop {
            let idle = self.slots.iter().all(|s| s.run.is_none()) && self.queue.is_empty();
            if idle {
                if !open {
                    return;
                }
                match jobs.recv() {
                    Ok(r) => self.take(r),
                    Err(_) => return,
                }
            }
            while open {
                match jobs.try_recv() {
                    Ok(r) => self.take(r),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if stop.load(Ordering::Relaxed) {
                self.cancel_all();
            }
            self.assign();
            self.step();
        }
    }

    fn take(&mut self, r: Request) {
        match r {
            Request::Generate(job) => self.queue.push_back(*job),
            Request::Slot { slot, action, reply } => {
                let _ = reply.send(self.slot_action(slot, action));
            }
            // (The handlers send none to a generating model's server.)
            Request::Embed(job) => job.refuse(),
        }
    }

    /// Copies out, restores or erases slot `i`'s cache (it must be idle).
    fn slot_action(&mut self, i: usize, action: SlotAction) -> Result<SlotDone, String> {
        let n_slots = self.slots.len();
        let slot =
            self.slots.get(i).ok_or_else(|| format!("slot {i} does not exist (the server has {n_slots})"))?;
        if slot.run.is_some() {
            return Err(format!("slot {i} is busy"));
        }
        match action {
            SlotAction::Erase => {
                let n_tokens = slot.cache.len();
                self.reset(i);
                Ok(SlotDone::Erased { n_tokens })
            }
            SlotAction::Save => {
                let tokens = slot.cache.clone();
                let rows = self.session.save_sequence(i, tokens.len()).map_err(|e| e.to_string())?;
                Ok(SlotDone::Saved { tokens, rows })
            }
            SlotAction::Restore { tokens, rows } => {
                if tokens.len() > self.session.n_ctx() {
                    return Err(format!(
                        "{} tokens do not fit a slot of {}",
                        tokens.len(),
                        self.session.n_ctx()
                    ));
                }
                if tokens.iter().any(|&t| t as usize >= self.session.n_vocab()) {
                    return Err("a token is outside the vocabulary".into());
                }
                self.session.restore_sequence(i, tokens.len(), &rows).map_err(|e| e.to_string())?;
                let slot = &mut self.slots[i];
                slot.cache.clear();
                slot.cache.extend_from_slice(&tokens);
                self.stats.cached[i].store(tokens.len(), Ordering::Relaxed);
                Ok(SlotDone::Restored { n_tokens: tokens.len() })
            }
        }
    }

    /// Ends every queued and running request (shutdown).
    fn cancel_all(&mut self) {
        for job in self.queue.drain(..) {
            let _ = job.events.send(Event::Failed("the server is shutting down".into()));
        }
        for i in 0..self.slots.len() {
            if self.slots[i].run.is_some() {
                self.end(i, Stop::Cancelled);
            }
        }
        self.stats.requests_deferred.store(0, Ordering::Relaxed);
    }

    /// Moves queued jobs into idle slots: the one asked for, else the idle slot whose cache shares
    /// the longest prefix with the prompt (least recently used among equals).
    fn assign(&mut self) {
        let mut waiting = VecDeque::new();
        while let Some(job) = self.queue.pop_front() {
            if job.events.is_closed() {
                continue;
            }
            let idle = |s: &Slot| s.run.is_none();
            // A cache sharing at least half of the prompt (a chat's next turn) wins; else an empty
            // slot, else the least recently used one (every prompt shares a template's first
            // tokens with every cache: that alone is no reason to evict a conversation).
            let score = |s: &Slot| {
                let shared = common_prefix(&s.cache, &job.prompt);
                let reuse = 2 * shared >= job.prompt.len() && shared > 0;
                (reuse, reuse.then_some(shared), s.cache.is_empty(), std::cmp::Reverse(s.last_used))
            };
            let pick = match job.params.id_slot {
                Some(i) if i < self.slots.len() => Some(i).filter(|&i| idle(&self.slots[i])),
                _ => (0..self.slots.len())
                    .filter(|&i| idle(&self.slots[i]))
                    .max_by_key(|&i| score(&self.slots[i])),
            };
            match pick {
                Some(i) => self.start(i, job),
                None => waiting.push_back(job),
            }
        }
        self.queue = waiting;
        self.stats.requests_deferred.store(self.queue.len(), Ordering::Relaxed);
    }

    /// Encodes a prompt's images and evaluates slot `i`'s sequence from position 0 through the
    /// prompt but its last token (text as tokens, images as embeddings), which the next step
    /// evaluates as any prompt's. Returns the prompt's positions as tokens (an image's positions
    /// hold a placeholder, BOS) and where the first image starts. (The images are encoded on this
    /// thread, as llama-server encodes them: the other slots wait for it.)
    fn prefill_media(&mut self, i: usize, media: &Media) -> Result<(Vec<u32>, usize), String> {
        let Some(projector) = self.projector.as_mut() else {
            return Err("this server has no vision projector (--mmproj)".into());
        };
        let mut images = Vec::with_capacity(media.images.len());
        for image in &media.images {
            images.push(projector.encode_decoded(image, self.session.runner()).map_err(|e| e.to_string())?);
        }
        let params = *projector.params();
        let parts = pinfer::media::parts(self.tok, params.traits().wrap, &media.text, &images, true)
            .map_err(|e| e.to_string())?;
        let width = params.n_embd_out as usize;
        let placeholder = self.tok.bos().unwrap_or(0);
        let mut tokens = Vec::new();
        let mut first_image = None;
        for part in &parts {
            match part {
                Part::Text(ids) => tokens.extend_from_slice(ids),
                Part::Image { image, input } => {
                    first_image.get_or_insert(tokens.len());
                    tokens.extend(std::iter::repeat_n(
                        placeholder,
                        images[*image].inputs[*input].len() / width,
                    ));
                }
            }
        }
        if !matches!(parts.last(), Some(Part::Text(_))) {
            return Err("a prompt must end with text after its last image".into());
        }
        if tokens.len() >= self.session.n_ctx() {
            return Err(format!(
                "the prompt and its images take {} positions, over the slot's context of {}",
                tokens.len(),
                self.session.n_ctx()
            ));
        }
        let _ = self.session.truncate_seq(i, 0);
        let causal = !params.traits().bidirectional_image;
        let last = parts.len() - 1;
        for (k, part) in parts.iter().enumerate() {
            match part {
                Part::Text(ids) => {
                    // (The prompt's last token is left to the step: its logits give the first token.)
                    let ids = if k == last { &ids[..ids.len() - 1] } else { &ids[..] };
                    for piece in ids.chunks(self.session.n_batch()) {
                        let start = self.session.seq_len(i);
                        let batch: Vec<Entry> = piece
                            .iter()
                            .enumerate()
                            .map(|(j, &token)| Entry { seq: i, pos: start + j, token, logits: false })
                            .collect();
                        self.session.decode(&batch).map_err(|e| e.to_string())?;
                    }
                }
                Part::Image { image, input } => {
                    let image = &images[*image];
                    let grid = image.token_grids.get(*input).copied();
                    self.session
                        .decode_embeddings(i, &image.inputs[*input], causal, grid)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok((tokens, first_image.unwrap_or(0)))
    }

    fn start(&mut self, i: usize, mut job: Job) {
        let media = job.params.media.take();
        let prefilled = match &media {
            Some(m) => match self.prefill_media(i, m) {
                Ok(done) => Some(done),
                Err(message) => {
                    // (The sequence may hold part of the prompt: the slot starts over.)
                    self.reset(i);
                    let _ = job.events.send(Event::Failed(message));
                    return;
                }
            },
            None => None,
        };
        let n_ctx = self.session.n_ctx();
        let mut generator = match Generator::new(self.tok, self.session.n_vocab(), job.params.sampler) {
            Ok(g) => g,
            Err(e) => {
                let _ = job.events.send(Event::Failed(e.to_string()));
                return;
            }
        };
        generator.set_ignore_eos(job.params.ignore_eos);
        // (The history then outgrows the slot's context: only the cache is shifted.)
        generator.context_shift = job.params.n_keep.map(|_| 0);
        let stops: Vec<&str> = job.params.stops.iter().map(String::as_str).collect();
        generator.set_stop_strings(&stops);
        generator.set_logit_bias(&job.params.logit_bias);
        generator.set_constraint(job.constraint.take());
        generator.set_limit(job.params.n_predict);
        generator.begin();
        let slot = &mut self.slots[i];
        let first_image = prefilled.as_ref().map(|p| p.1);
        let keep = match prefilled {
            Some((positions, _)) => {
                // Everything but the last position is in the cache already.
                job.prompt = positions;
                slot.cache.clear();
                slot.cache.extend_from_slice(&job.prompt[..job.prompt.len() - 1]);
                job.prompt.len() - 1
            }
            None => {
                // At least the last prompt token is evaluated: its logits give the first token.
                let keep = if job.params.cache_prompt {
                    common_prefix(&slot.cache, &job.prompt).min(job.prompt.len().saturating_sub(1))
                } else {
                    0
                };
                // (A model with recurrent layers keeps a slot's cache whole or not at all.)
                let keep = self.session.truncate_seq(i, keep);
                slot.cache.truncate(keep);
                keep
            }
        };
        let mut tokens = Vec::with_capacity(n_ctx + 1);
        tokens.extend_from_slice(&job.prompt);
        slot.phase = Phase::Prompt { done: keep };
        self.clock += 1;
        slot.last_used = self.clock;
        slot.run = Some(Running {
            n_prompt: job.prompt.len(),
            n_cached: if first_image.is_some() { 0 } else { keep },
            job,
            generator,
            tokens,
            n_generated: 0,
            started: Instant::now(),
            prompt_done: None,
            stop_word: None,
            guesses: Vec::with_capacity(self.lookup),
            taken: 0,
            draft_len: self.lookup,
            n_drafted: 0,
            n_accepted: 0,
            first_image,
        });
        self.stats.busy[i].store(true, Ordering::Relaxed);
        self.stats.requests_processing.fetch_add(1, Ordering::Relaxed);
    }

    /// One batch over every active slot, then sampling for the slots that got logits.
    fn step(&mut self) {
        // Clients gone: their slots are freed before the step.
        for i in 0..self.slots.len() {
            if self.slots[i].run.as_ref().is_some_and(|r| r.job.events.is_closed()) {
                self.end(i, Stop::Cancelled);
            }
        }
        self.shift_full_slots();
        let n_batch = self.session.n_batch();
        self.entries.clear();
        self.rows.clear();
        // Prompt chunks take what the generating slots' next tokens leave of the batch, and
        // guesses share the rest (so guesses never hold a prompt back).
        let generating = self.slots.iter().filter(|s| matches!(s.phase, Phase::Generating)).count();
        let most_room = n_batch - generating;
        let mut room = most_room;
        // The oldest request's prompt first: it always has the most room and moves on, so no
        // prompt waits for ever behind newer ones.
        let slots = &self.slots;
        let reading =
            |i: &usize| matches!((&slots[*i].phase, &slots[*i].run), (Phase::Prompt { .. }, Some(_)));
        self.pieces.clear();
        self.pieces.extend((0..slots.len()).filter(reading).map(|i| (i, 0)));
        self.pieces.sort_by_key(|&(i, _)| slots[i].run.as_ref().map(|r| r.started));
        for (i, take) in &mut self.pieces {
            if let (Phase::Prompt { done }, Some(run)) = (&slots[*i].phase, &slots[*i].run) {
                *take = prompt_piece(run.n_prompt - done, room, most_room);
                room -= *take;
            }
        }
        let per_slot = room.checked_div(generating).map_or(0, |room| self.lookup.min(room));
        let n_ctx = self.session.n_ctx();
        let mut guessed = 0;
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let (Phase::Generating, Some(run)) = (&slot.phase, &mut slot.run) else { continue };
            let token = run.tokens[run.tokens.len() - 1];
            let pos = self.session.seq_len(i);
            // (No more guesses than the context and the token limit leave room for.)
            let left = run.job.params.n_predict.map_or(usize::MAX, |n| n.saturating_sub(run.n_generated));
            let n =
                per_slot.min(run.draft_len).min(n_ctx.saturating_sub(pos + 1)).min(left.saturating_sub(1));
            run.guesses.clear();
            run.taken = 0;
            if n > 0 {
                pinfer::speculative::find_in_text(&run.tokens, n, &mut run.guesses);
            }
            run.n_drafted += run.guesses.len();
            guessed += run.guesses.len();
            self.entries.push(Entry { seq: i, pos, token, logits: true });
            self.rows.push(Row { slot: i, pos, guess_after: run.guesses.first().copied() });
            for (k, &g) in run.guesses.iter().enumerate() {
                let pos = pos + 1 + k;
                self.entries.push(Entry { seq: i, pos, token: g, logits: true });
                self.rows.push(Row { slot: i, pos, guess_after: run.guesses.get(k + 1).copied() });
            }
        }
        for &(i, take) in &self.pieces {
            let slot = &self.slots[i];
            if let (Phase::Prompt { done }, Some(run)) = (&slot.phase, &slot.run) {
                let end = done + take;
                let pos = self.session.seq_len(i);
                for (k, &token) in run.tokens[*done..end].iter().enumerate() {
                    let last = *done + k + 1 == run.n_prompt;
                    self.entries.push(Entry { seq: i, pos: pos + k, token, logits: last });
                    if last {
                        self.rows.push(Row { slot: i, pos: pos + k, guess_after: None });
                    }
                }
            }
        }
        if self.entries.is_empty() {
            return;
        }
        let started = Instant::now();
        if let Err(e) = self.session.decode(&self.entries) {
            // A step fails as a whole: every slot in it ends with the error, caches dropped.
            let message = e.to_string();
            let involved: Vec<usize> = {
                let mut v: Vec<usize> = self.entries.iter().map(|e| e.seq).collect();
                v.dedup();
                v
            };
            for i in involved {
                if let Some(run) = &self.slots[i].run {
                    let _ = run.job.events.send(Event::Failed(message.clone()));
                }
                self.reset(i);
            }
            return;
        }
        let elapsed = started.elapsed();
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        // Prompt progress and cache contents.
        let mut prompt_tokens = 0;
        for e in &self.entries {
            let slot = &mut self.slots[e.seq];
            slot.cache.push(e.token);
            if let Phase::Prompt { done } = &mut slot.phase {
                *done += 1;
                prompt_tokens += 1;
            }
        }
        let generated = self.entries.len() - prompt_tokens;
        let us = elapsed.as_micros() as u64;
        let share = |n: usize| us * n as u64 / self.entries.len() as u64;
        self.stats.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.stats.prompt_us.fetch_add(share(prompt_tokens), Ordering::Relaxed);
        self.stats.generate_us.fetch_add(share(generated), Ordering::Relaxed);
        let mut accepted = 0;
        // A slot's rows come one after the other: each is sampled while the token drawn from the
        // one before is the guess the batch carried after it.
        let mut dropped = None;
        for row in 0..self.rows.len() {
            let Row { slot: i, pos, guess_after } = self.rows[row];
            if dropped == Some(i) {
                continue;
            }
            let Some(logits) = self.session.logits(row) else { continue };
            let slot = &mut self.slots[i];
            let Some(run) = slot.run.as_mut() else { continue };
            if matches!(slot.phase, Phase::Prompt { .. }) {
                slot.phase = Phase::Generating;
                run.prompt_done = Some(Instant::now());
            }
            run.generator.set_logits(logits);
            let stop = sample(run, self.tok, &mut self.piece, self.session.n_ctx());
            let Some(guess) = guess_after else {
                if let Some(stop) = stop {
                    self.end(i, stop);
                }
                continue;
            };
            if stop.is_none() && run.tokens.last() == Some(&guess) {
                run.n_accepted += 1;
                run.taken += 1;
                accepted += 1;
                continue;
            }
            // The guesses after this row's token were not drawn: the cache drops them.
            dropped = Some(i);
            let kept = self.session.truncate_seq(i, pos + 1);
            slot.cache.truncate(kept);
            if let Some(stop) = stop {
                self.end(i, stop);
            }
        }
        for run in self.slots.iter_mut().filter_map(|s| s.run.as_mut()) {
            if !run.guesses.is_empty() {
                run.draft_len = next_draft_len(run.draft_len, run.guesses.len(), run.taken, self.lookup);
                run.guesses.clear();
            }
        }
        // Tokens generated: the guesses count only when taken.
        let generated = generated - guessed + accepted;
        self.stats.generated_tokens.fetch_add(generated as u64, Ordering::Relaxed);
        let kv: usize = self.slots.iter().map(|s| s.cache.len()).sum();
        self.stats.kv_tokens.store(kv, Ordering::Relaxed);
        for (i, s) in self.slots.iter().enumerate() {
            self.stats.cached[i].store(s.cache.len(), Ordering::Relaxed);
        }
    }

    /// Context shift of every generating slot whose next token would leave no free position and
    /// whose request asked for it (llama-server's rule, see `Session::shift_context`).
    fn shift_full_slots(&mut self) {
        let n_ctx = self.session.n_ctx();
        let bos = usize::from(self.tok.add_bos());
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let (Phase::Generating, Some(run)) = (&slot.phase, &slot.run) else { continue };
            let Some(n_keep) = run.job.params.n_keep else { continue };
            if self.session.seq_len(i) + 1 < n_ctx {
                continue;
            }
            let keep = usize::try_from(n_keep).unwrap_or(run.n_prompt) + bos;
            match self.session.shift_context(i, keep) {
                Ok(discard) => {
                    let keep = keep.min(n_ctx.saturating_sub(4));
                    slot.cache.drain(keep..keep + discard);
                }
                Err(e) => {
                    let _ = run.job.events.send(Event::Failed(e.to_string()));
                    self.reset(i);
                }
            }
        }
    }

    /// Ends slot `i`'s request: the text held back is passed on, then the summary.
    fn end(&mut self, i: usize, stop: Stop) {
        let slot = &mut self.slots[i];
        let Some(mut run) = slot.run.take() else { return };
        slot.phase = Phase::Idle;
        // The cache holds what was evaluated; the last sampled token may not be.
        let held = slot.cache.len();
        let events = run.job.events.clone();
        let mut pass = |text: &str| -> Result<Flow, ()> {
            if !text.is_empty() {
                let _ = events.send(Event::Token { text: text.to_string(), probs: None });
            }
            Ok(Flow::Continue)
        };
        let _ = run.generator.finish(stop, &mut pass);
        if let Some(at) = run.first_image {
            slot.cache.truncate(at);
        }
        let now = Instant::now();
        let prompt_done = run.prompt_done.unwrap_or(now);
        let summary = Summary {
            stop,
            stop_word: run.stop_word.take(),
            slot: i,
            n_prompt: run.n_prompt,
            n_cached: run.n_cached,
            n_generated: run.n_generated,
            prompt_ms: (prompt_done - run.started).as_secs_f64() * 1e3,
            generate_ms: (now - prompt_done).as_secs_f64() * 1e3,
            n_drafted: run.n_drafted,
            n_accepted: run.n_accepted,
            tokens: std::mem::take(&mut run.tokens),
        };
        debug_assert!(held <= self.session.seq_len(i));
        let _ = run.job.events.send(Event::Done(summary));
        self.stats.busy[i].store(false, Ordering::Relaxed);
        self.stats.requests_processing.fetch_sub(1, Ordering::Relaxed);
    }

    /// Empties slot `i` (after a failed step its cache is not trusted).
    fn reset(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.run.take().is_some() {
            self.stats.busy[i].store(false, Ordering::Relaxed);
            self.stats.requests_processing.fetch_sub(1, Ordering::Relaxed);
        }
        slot.phase = Phase::Idle;
        slot.cache.clear();
        let _ = self.session.truncate_seq(i, 0);
        self.stats.cached[i].store(0, Ordering::Relaxed);
    }
}

/// How many of a prompt's `left` tokens still to read a step takes when `room` rows of its batch
/// are free (`most_room` at most). A chunk of a prompt of [`TILE_MIN_TOKENS`] tokens or more has
/// that many itself and leaves that many or none, so every token of such a prompt takes the f32
/// attention tiles however the batch is shared, as when the request runs alone (the engine takes
/// them for a run of that many tokens of one sequence). When the room is too small for such a
/// chunk, none is taken (the oldest prompt of a step has the most room, so it moves on), unless
/// the most room is too small too: a prompt under that length, or one that the batch beside the
/// generating slots' next tokens cannot cut so, is cut where the room ends.
fn prompt_piece(left: usize, room: usize, most_room: usize) -> usize {
    let run = TILE_MIN_TOKENS;
    if left <= room {
        return left;
    }
    let can_wait = left >= run && (left <= most_room || most_room.min(left - run) >= run);
    if !can_wait {
        return room;
    }
    match room.min(left - run) {
        cut if cut >= run => cut,
        _ => 0,
    }
}

/// Samples the next token of `run` from its logits and passes it on; `Some` ends the stream.
/// A token that could not be evaluated in a slot of `n_ctx` positions ends it as a full context.
fn sample(run: &mut Running<'_>, tok: &Tokenizer<'_>, piece: &mut [u8], n_ctx: usize) -> Option<Stop> {
    if run.job.params.n_predict.is_some_and(|n| run.n_generated >= n) {
        return Some(Stop::Limit);
    }
    if run.job.params.n_keep.is_none() && run.tokens.len() >= n_ctx {
        return Some(Stop::ContextFull);
    }
    let events = &run.job.events;
    let n_probs = run.job.params.n_probs;
    let before = run.tokens.len();
    let mut text = String::new();
    let mut pass = |piece: &str| -> Result<Flow, ()> {
        text.push_str(piece);
        Ok(Flow::Continue)
    };
    let result = run.generator.step(&mut run.tokens, &mut pass);
    let pushed = run.tokens.len() > before;
    let probs = match (pushed, n_probs) {
        (true, n) if n > 0 => Some(token_probs(run.generator.logits(), run.tokens[before], n, tok, piece)),
        _ => None,
    };
    if pushed {
        run.n_generated += 1;
        if events.send(Event::Token { text, probs }).is_err() {
            return Some(Stop::Cancelled);
        }
    }
    match result {
        Ok(Some(Stop::StopString)) => {
            run.stop_word = run.generator.stop_string().map(String::from);
            Some(Stop::StopString)
        }
        Ok(Some(stop)) => Some(stop),
        Ok(None) if run.job.params.n_predict.is_some_and(|n| run.n_generated >= n) => Some(Stop::Limit),
        Ok(None) => None,
        Err(e) => {
            let message = match e {
                GenerateError::Sample(e) => e.to_string(),
                GenerateError::Decode(e) => e.to_string(),
                GenerateError::Session(e) => e.to_string(),
                GenerateError::Grammar(e) => e.to_string(),
                GenerateError::Output(()) => "the client went away".into(),
            };
            let _ = events.send(Event::Failed(message));
            Some(Stop::Cancelled)
        }
    }
}

/// Log-probabilities (softmax of `logits`) of token `id` and of the `n` most likely tokens.
pub fn token_probs(logits: &[f32], id: u32, n: usize, tok: &Tokenizer<'_>, piece: &mut [u8]) -> TokenProbs {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let logprob = |i: u32| (f64::from(logits[i as usize]) - log_z) as f32;
    let mut best: Vec<u32> = Vec::with_capacity(n + 1);
    for (i, &l) in logits.iter().enumerate() {
        if best.len() < n || l > logits[best[best.len() - 1] as usize] {
            let at = best.partition_point(|&b| logits[b as usize] >= l);
            best.insert(at, i as u32);
            best.truncate(n);
        }
    }
    let mut bytes_of = |i: u32| {
        let n = tok.token_to_piece(i, true, piece).unwrap_or(0);
        piece[..n].to_vec()
    };
    TokenProbs {
        id,
        bytes: bytes_of(id),
        logprob: logprob(id),
        top: best.into_iter().map(|i| (i, bytes_of(i), logprob(i))).collect(),
    }
}

/// Length of the common prefix of two token lists.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt read in steps whose free room varies (as other slots' chunks and next tokens take
    /// their share), every fourth step with the most room: its chunks.
    /// `least_room` up to `most_room`: the most room of a step varies with the slots generating.
    fn chunks(len: usize, least_room: usize, most_room: usize, seed: u64) -> Vec<usize> {
        let (mut left, mut state, mut out) = (len, seed, Vec::new());
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize
        };
        for step in 0.. {
            assert!(step < 10 * len + 10, "a prompt of {len} with room up to {most_room} is never read");
            if left == 0 {
                return out;
            }
            let most = least_room + next() % (most_room - least_room + 1);
            let room = if step % 4 == 3 { most } else { next() % (most + 1) };
            let take = prompt_piece(left, room, most);
            assert!(take <= room.min(left));
            if take > 0 {
                out.push(take);
                left -= take;
            }
        }
        unreachable!()
    }

    #[test]
    fn a_long_prompt_is_cut_only_into_chunks_that_take_the_tiles() {
        let run = TILE_MIN_TOKENS;
        let ranges =
            [(run + 1, run + 1), (2 * run - 1, 2 * run - 1), (2 * run, 2 * run), (200, 200), (511, 511)];
        // (The most room changing from step to step: other slots start and stop generating.)
        for (least, most) in ranges.into_iter().chain([(2 * run, 511), (run, 200)]) {
            for len in (1..700).step_by(7).chain([run - 1, run, run + 1, 2 * run - 1, 2 * run]) {
                for seed in 0..8 {
                    let got = chunks(len, least, most, seed);
                    assert_eq!(got.iter().sum::<usize>(), len);
                    // Every chunk takes the tiles where every step's batch can hold such chunks.
                    if len >= run && (len <= least || least >= 2 * run) {
                        assert!(got.iter().all(|&c| c >= run), "{len} in {least}..={most}: {got:?}");
                    }
                }
            }
        }
    }
}
