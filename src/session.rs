//! std: a model ready to evaluate tokens: mapped weights, one arena (KV cache, token ids,
//! activations, work) sized before the first token, forward graphs built and planned once per
//! batch shape, and the worker pool.
//!
//! After [`Session::new`] nothing allocates per token: graphs are reused, `Bound::new` only
//! resolves addresses into the preplanned memory.

use std::boxed::Box;
use std::fmt;
use std::vec;
use std::vec::Vec;

use crate::arena::{Region, ARENA_ALIGN};
use crate::build_config::GRAPH_CAPACITY;
use crate::exec::pool::Pool;
use crate::exec::{work_bytes, Bound, ExecError, PackedEntry, Step};
use crate::gguf::Gguf;
use crate::graph::Op;
use crate::graph::{plan, Graph, Plan};
use crate::kernels::packed::{can_pack, pack, packed_bytes, PackedFormat};
use crate::loader::{LoadError, ModelFile};
use crate::model::{build_forward, validate_tensors, validate_vocab, Forward, HParams, KvLayout, ModelError};
use crate::tensor::Storage;

/// Default batch of prompt tokens evaluated by one graph.
pub const DEFAULT_BATCH: usize = 64;
/// Default context when the model allows more.
pub const DEFAULT_CTX: usize = 4096;

/// How to set a session up.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Context size in tokens (0: min(4096, the model's training context)).
    pub n_ctx: usize,
    /// Most prompt tokens per graph evaluation.
    pub n_batch: usize,
    /// Worker threads, the caller included.
    pub threads: usize,
    /// Cores to pin threads to (`None`: the process's affinity mask).
    pub cores: Option<Vec<usize>>,
    /// Pin threads to cores.
    pub pin: bool,
    /// Also plan for graphs that return logits for every token (perplexity).
    pub logits_all: bool,
    /// Repack weight matrices at load into the interleaved layout of the SIMD kernels
    /// (`false`: `--no-repack`, run on the file's layout through the reference dots).
    pub repack: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            n_ctx: 0,
            n_batch: DEFAULT_BATCH,
            threads: 1,
            cores: None,
            pin: false,
            logits_all: false,
            // PINFER_NO_REPACK=1 keeps the file's layouts everywhere (A/B comparisons).
            repack: std::env::var_os("PINFER_NO_REPACK").is_none_or(|v| v.is_empty() || v == "0"),
        }
    }
}

/// Why a session could not be set up or a step could not run.
#[derive(Debug)]
#[non_exhaustive]
pub enum SessionError {
    /// The model file could not be opened or parsed.
    Load(LoadError),
    /// The file is not a model pinfer runs.
    Model(ModelError),
    /// The context is full: `needed` positions were asked for, `n_ctx` exist.
    ContextFull {
        /// Positions the request needs.
        needed: usize,
        /// Context size.
        n_ctx: usize,
    },
    /// A token id outside the vocabulary.
    BadToken {
        /// The id.
        id: u32,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// The logits hold NaN or infinity.
    NonFiniteLogits,
    /// A bad option value.
    Option(&'static str),
    /// Running a graph failed.
    Exec(ExecError),
    /// Memory or threads could not be obtained.
    Resources(std::string::String),
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Load(e) => write!(f, "{e}"),
            Self::Model(e) => write!(f, "{e}"),
            Self::ContextFull { needed, n_ctx } => write!(
                f,
                "context full: {needed} positions needed, the context holds {n_ctx} (raise it with -c, up to the model's maximum)"
            ),
            Self::BadToken { id, n_vocab } => write!(f, "token id {id} is outside the vocabulary of {n_vocab} tokens"),
            Self::NonFiniteLogits => write!(f, "the model produced non-finite logits (NaN or infinity)"),
            Self::Option(msg) => write!(f, "{msg}"),
            Self::Exec(e) => write!(f, "{e}"),
            Self::Resources(msg) => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for SessionError {}

impl From<ModelError> for SessionError {
    fn from(e: ModelError) -> Self {
        Self::Model(e)
    }
}

impl From<ExecError> for SessionError {
    fn from(e: ExecError) -> Self {
        Self::Exec(e)
    }
}

/// 64 bytes, 64-aligned: the arena's backing store, so offsets never shift with the allocation.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([u8; ARENA_ALIGN]);

/// A forward graph for one batch shape, planned.
struct Prepared {
    graph: Box<Graph<GRAPH_CAPACITY>>,
    plan: Box<Plan<GRAPH_CAPACITY>>,
    fwd: Forward,
    all_logits: bool,
}

/// Graph shapes kept built at once (decode, full batch, a partial batch, one all-logits shape).
const MAX_PREPARED: usize = 4;

/// A model loaded and ready to evaluate tokens.
pub struct Session {
    model: &'static ModelFile,
    gguf: Gguf<'static>,
    hp: HParams,
    n_vocab: usize,
    kv: KvLayout,
    memory: Vec<Line>,
    activations: Region,
    work: Region,
    prepared: Vec<Prepared>,
    pool: Pool,
    n_past: usize,
    logits: Vec<f32>,
    /// Repacked weight matrices (one buffer) and where each one is, sorted by source offset.
    packed: Vec<Line>,
    packed_entries: Vec<PackedEntry>,
    /// Seconds spent repacking at load.
    repack_seconds: f64,
}

impl Session {
    /// Opens, validates and plans `model` (kept mapped for the life of the process).
    pub fn new(model: &'static ModelFile, opts: &SessionOptions) -> Result<Self, SessionError> {
        let gguf = model.parse().map_err(SessionError::Load)?;
        let hp = HParams::from_gguf(&gguf)?;
        let vocab = validate_vocab(&gguf)?;
        validate_tensors(&gguf, &hp, vocab.n_vocab)?;
        let max_ctx = hp.n_ctx_train as usize;
        let n_ctx = match opts.n_ctx {
            0 => DEFAULT_CTX.min(max_ctx),
            n if n > max_ctx => return Err(SessionError::Option("context size above the model's maximum")),
            n => n,
        };
        if opts.n_batch == 0 || opts.threads == 0 {
            return Err(SessionError::Option("batch size and thread count must be at least 1"));
        }
        let n_batch = opts.n_batch.min(n_ctx);
        let kv = KvLayout::new(&hp, n_ctx, n_batch).ok_or(SessionError::Option("context size too large"))?;

        // Size the arena from the graphs it must run, before anything is allocated for them.
        let mut prepared = Vec::new();
        let mut shapes = vec![(1, false), (n_batch, false)];
        if opts.logits_all {
            shapes.push((n_batch, true));
        }
        let (mut peak, mut work) = (0usize, 0usize);
        for (n, all) in shapes {
            let p = prepare(&gguf, &hp, &kv, n, all)?;
            peak = peak.max(p.plan.peak_bytes);
            work = work.max(work_bytes(&p.graph));
            prepared.push(p);
        }
        let activations = Region { offset: kv.total_bytes, len: peak.next_multiple_of(ARENA_ALIGN) };
        let work =
            Region { offset: activations.offset + activations.len, len: work.next_multiple_of(ARENA_ALIGN) };
        let total = work.offset + work.len;
        let mut memory = Vec::new();
        memory.try_reserve_exact(total / ARENA_ALIGN).map_err(|_| {
            SessionError::Resources(std::format!(
                "cannot allocate the {total}-byte arena (KV cache and activations)"
            ))
        })?;
        memory.resize(total / ARENA_ALIGN, Line([0; ARENA_ALIGN]));
        let pool = Pool::new(opts.threads, opts.cores.as_deref(), opts.pin)
            .map_err(|e| SessionError::Resources(std::format!("cannot start worker threads: {e}")))?;
        let started = std::time::Instant::now();
        let (packed, packed_entries) = if opts.repack {
            repack_weights(model, &prepared[0].graph, opts.threads)?
        } else {
            (Vec::new(), Vec::new())
        };
        let repack_seconds = started.elapsed().as_secs_f64();
        Ok(Self {
            model,
            gguf,
            hp,
            n_vocab: vocab.n_vocab as usize,
            kv,
            memory,
            activations,
            work,
            prepared,
            pool,
            n_past: 0,
            logits: vec![0.0; vocab.n_vocab as usize],
            packed,
            packed_entries,
            repack_seconds,
        })
    }

    /// Repacked weights: matrices, bytes of the packed buffer, and seconds spent repacking.
    pub fn repacked(&self) -> (usize, usize, f64) {
        (self.packed_entries.len(), self.packed.len() * ARENA_ALIGN, self.repack_seconds)
    }

    /// The parsed model file.
    pub fn gguf(&self) -> &Gguf<'static> {
        &self.gguf
    }

    /// The model's hyper-parameters.
    pub fn hparams(&self) -> &HParams {
        &self.hp
    }

    /// Context size in tokens.
    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }

    /// Tokens in the KV cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Bytes of the arena: KV cache and inputs, activations, work.
    pub fn arena_bytes(&self) -> (usize, usize, usize) {
        (self.kv.total_bytes, self.activations.len, self.work.len)
    }

    /// Threads evaluating each graph.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Forgets the cache from position `n` on (0: start a new sequence).
    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
    }

    /// Evaluates `tokens` after the cached ones; returns the logits of the last one.
    pub fn eval(&mut self, tokens: &[u32]) -> Result<&[f32], SessionError> {
        self.check(tokens)?;
        for chunk in tokens.chunks(self.kv.n_batch) {
            let p = self.prepared_index(chunk.len(), false)?;
            self.run(p, chunk)?;
            let logits = output(&self.prepared[p], &self.memory, self.activations);
            self.logits.copy_from_slice(&logits[logits.len() - self.n_vocab..]);
        }
        if self.logits.iter().any(|v| !v.is_finite()) {
            return Err(SessionError::NonFiniteLogits);
        }
        Ok(&self.logits)
    }

    /// Evaluates `tokens` after the cached ones and calls `each` with every token's logits in
    /// order (for perplexity). Needs `logits_all` in the options.
    pub fn eval_all(
        &mut self,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<(), SessionError> {
        self.check(tokens)?;
        let mut index = 0;
        for chunk in tokens.chunks(self.kv.n_batch) {
            let p = self.prepared_index(chunk.len(), true)?;
            self.run(p, chunk)?;
            let logits = output(&self.prepared[p], &self.memory, self.activations);
            if logits.iter().any(|v| !v.is_finite()) {
                return Err(SessionError::NonFiniteLogits);
            }
            for row in logits.chunks(self.n_vocab) {
                each(index, row);
                index += 1;
            }
        }
        Ok(())
    }

    fn check(&self, tokens: &[u32]) -> Result<(), SessionError> {
        let needed = self.n_past + tokens.len();
        if needed > self.kv.n_ctx {
            return Err(SessionError::ContextFull { needed, n_ctx: self.kv.n_ctx });
        }
        match tokens.iter().find(|&&id| id as usize >= self.n_vocab) {
            Some(&id) => Err(SessionError::BadToken { id, n_vocab: self.n_vocab }),
            None => Ok(()),
        }
    }

    /// The prepared graph for `n` tokens, building (and planning) it if needed. A shape whose
    /// plan does not fit the arena sized at start is refused; callers split the batch.
    fn prepared_index(&mut self, n: usize, all_logits: bool) -> Result<usize, SessionError> {
        if let Some(i) = self.prepared.iter().position(|p| p.fwd.n_tokens == n && p.all_logits == all_logits)
        {
            return Ok(i);
        }
        let p = prepare(&self.gguf, &self.hp, &self.kv, n, all_logits)?;
        if p.plan.peak_bytes > self.activations.len || work_bytes(&p.graph) > self.work.len {
            return Err(SessionError::Option("this batch shape does not fit the planned arena"));
        }
        if self.prepared.len() >= MAX_PREPARED {
            // Keep the two shapes sized at start (decode and full batch); replace the others.
            self.prepared.truncate(MAX_PREPARED - 1);
        }
        self.prepared.push(p);
        Ok(self.prepared.len() - 1)
    }

    fn run(&mut self, p: usize, tokens: &[u32]) -> Result<(), SessionError> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(self.memory.as_mut_slice());
        let ids: &mut [i32] = bytemuck::cast_slice_mut(&mut bytes[self.kv.ids_offset..][..tokens.len() * 4]);
        for (dst, &t) in ids.iter_mut().zip(tokens) {
            *dst = t as i32;
        }
        let prep = &self.prepared[p];
        let step = Step { n_past: self.n_past, n_kv: self.n_past + tokens.len() };
        let buffers = [self.model.bytes()];
        let packed: &[u8] = bytemuck::cast_slice(self.packed.as_slice());
        let mut bound = Bound::new(&prep.graph, &prep.plan, &buffers, bytes, self.activations, self.work)?
            .with_packed(packed, &self.packed_entries);
        self.pool.run(&mut bound, step)?;
        self.n_past += tokens.len();
        Ok(())
    }
}

/// Repacks every weight matrix of `graph` that has a packed format into one buffer, using up to
/// `threads` threads; the original pages are released (they are no longer read, except rows of a
/// tied embedding, which fault back in as needed).
fn repack_weights(
    model: &ModelFile,
    graph: &Graph<GRAPH_CAPACITY>,
    threads: usize,
) -> Result<(Vec<Line>, Vec<PackedEntry>), SessionError> {
    let mut entries: Vec<PackedEntry> = Vec::new();
    let mut sources = Vec::new();
    let mut at = 0usize;
    for &id in graph.order() {
        let t = graph.tensor(id);
        let Some(w) = t.src[0].filter(|_| t.op == Op::MulMat) else { continue };
        let w = graph.tensor(w);
        let Storage::External { buffer: 0, offset } = w.storage else { continue };
        let (k, rows) = (w.ne[0], w.ne[1]);
        if w.ne[2] != 1
            || w.ne[3] != 1
            || !can_pack(w.ty, rows, k)
            || entries.iter().any(|e| e.source_offset == offset)
        {
            continue;
        }
        let Some(format) = PackedFormat::for_type(w.ty) else { continue };
        let (qn, sn) = packed_bytes(format, rows, k);
        let quants_at = at;
        let scales_at = (quants_at + qn).next_multiple_of(ARENA_ALIGN);
        at = (scales_at + sn).next_multiple_of(ARENA_ALIGN);
        entries.push(PackedEntry { source_offset: offset, format, rows, k, quants_at, scales_at });
        sources.push((w.ty, offset, w.n_rows() * (w.ty.bytes_for(k as u64).unwrap_or(0) as usize)));
    }
    let mut buffer = Vec::new();
    buffer.try_reserve_exact(at / ARENA_ALIGN).map_err(|_| {
        SessionError::Resources(std::format!("cannot allocate {at} bytes for the repacked weights"))
    })?;
    buffer.resize(at / ARENA_ALIGN, Line([0; ARENA_ALIGN]));
    // Hand each thread whole matrices: split the buffer at entry boundaries.
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(buffer.as_mut_slice());
    let mut jobs: Vec<(usize, &mut [u8])> = Vec::new();
    let mut rest = bytes;
    let mut consumed = 0;
    for i in 0..entries.len() {
        let end = entries.get(i + 1).map_or(at, |n| n.quants_at);
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - consumed);
        jobs.push((i, mine));
        rest = tail;
        consumed = end;
    }
    let failed = std::sync::atomic::AtomicBool::new(false);
    let threads = threads.clamp(1, 8);
    let mut per_thread: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (n, job) in jobs.into_iter().enumerate() {
        per_thread[n % threads].push(job);
    }
    let data = model.bytes();
    std::thread::scope(|scope| {
        for work in per_thread {
            let (entries, sources, failed) = (&entries, &sources, &failed);
            scope.spawn(move || {
                for (i, chunk) in work {
                    let (e, (ty, offset, len)) = (&entries[i], sources[i]);
                    let (qn, sn) = packed_bytes(e.format, e.rows, e.k);
                    let (quants, tail) = chunk.split_at_mut(e.scales_at - e.quants_at);
                    let src = &data[offset..offset + len];
                    if pack(ty, src, e.rows, e.k, &mut quants[..qn], &mut tail[..sn]).is_err() {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    if failed.into_inner() {
        return Err(SessionError::Resources(
            "repacking a weight matrix failed (inconsistent tensor size)".into(),
        ));
    }
    for (_, offset, len) in &sources {
        model.release(*offset..offset + len);
    }
    entries.sort_by_key(|e| e.source_offset);
    Ok((buffer, entries))
}

/// The logits of prepared graph `prep` after its run.
fn output<'m>(prep: &Prepared, memory: &'m [Line], activations: Region) -> &'m [f32] {
    let off = prep.plan.offset(prep.fwd.logits).unwrap_or(0) + activations.offset;
    let len = prep.graph.tensor(prep.fwd.logits).n_elements();
    let bytes: &[u8] = bytemuck::cast_slice(memory);
    bytemuck::cast_slice(&bytes[off..off + len * 4])
}

fn prepare(
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n: usize,
    all: bool,
) -> Result<Prepared, SessionError> {
    let mut graph = Box::new(Graph::new());
    let fwd = build_forward(&mut graph, gguf, hp, kv, n, all)?;
    let plan = Box::new(plan(&graph).map_err(|e| SessionError::Resources(std::format!("planning: {e}")))?);
    Ok(Prepared { graph, plan, fwd, all_logits: all })
}
