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
use crate::exec::pool::{Pool, PoolConfig};
use crate::exec::{work_bytes, Bound, ExecError, PackedEntry, Step};
use crate::gguf::{Gguf, TensorInfo};
use crate::graph::{plan, Graph, Plan};
use crate::kernels::packed::{pack, packed_bytes};
use crate::loader::{LoadError, ModelFile};
use crate::model::{build_forward, Forward, HParams, KvLayout, ModelError};
use crate::placement::{self, Buffer, Placement, Reason};

/// Default batch of prompt tokens evaluated by one graph.
pub const DEFAULT_BATCH: usize = 64;
/// Default context when the model allows more.
pub use crate::model::DEFAULT_CTX;

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
    /// Run every thread of the pool SCHED_FIFO at this priority (1-99).
    pub rt_priority: Option<i32>,
    /// Check every node's output for NaN/infinity and stop at the first (`--check-numerics`).
    pub check_numerics: bool,
    /// Refuse to load when the memory plan's total exceeds this many bytes (the CLI passes
    /// MemAvailable, or `--mem-limit`).
    pub memory_limit: Option<usize>,
    /// Offload of matmuls to the NPU (feature `npu`; off by default).
    #[cfg(feature = "npu")]
    pub npu: crate::npu::NpuConfig,
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
            repack: true,
            rt_priority: None,
            check_numerics: false,
            memory_limit: None,
            #[cfg(feature = "npu")]
            npu: crate::npu::NpuConfig::default(),
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
    /// The worker threads could not be started, pinned or made real-time.
    Threads(crate::exec::pool::PoolError),
    /// A repacked-weight cache this pinfer cannot use (another layout version or CPU, damaged, or
    /// run without repacking), or writing one failed.
    Cache(std::string::String),
    /// Stopped on request (SIGINT) before finishing; nothing was left half-written.
    Interrupted,
    /// The memory plan exceeds the memory available (`SessionOptions::memory_limit`).
    OverMemory {
        /// The plan.
        plan: MemoryPlan,
        /// The limit, in bytes.
        limit: usize,
    },
}

/// The memory a session needs, planned before anything big is allocated and printed before the
/// first token (`-v`). Everything is bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryPlan {
    /// Model file pages read in place: the header and metadata, and every tensor the plan keeps
    /// mapped (read through the page cache).
    pub mapped: usize,
    /// File bytes of tied embeddings: repacked, but `get_rows` still reads their rows from the
    /// file, a few per token, through the page cache. Not in [`MemoryPlan::total`]: only the rows
    /// of tokens seen are ever read (`--mlock` locks them all, and says so if that fails).
    pub mapped_rows: usize,
    /// The repacked weights (in their own buffer, or in the file when it is a repack cache).
    pub repacked: usize,
    /// Whether the repacked weights are pages of the file (a repack cache), not a buffer.
    pub repacked_in_file: bool,
    /// KV cache and token ids (the arena's persistent part).
    pub kv: usize,
    /// Activations (the arena's planned part).
    pub activations: usize,
    /// Converted matmul inputs (the arena's work part).
    pub work: usize,
    /// Graphs, plans and the logits buffer.
    pub other: usize,
}

impl MemoryPlan {
    /// The peak: everything at once (tied embedding rows aside, see [`MemoryPlan::mapped_rows`]).
    pub fn total(&self) -> usize {
        self.mapped + self.repacked + self.kv + self.activations + self.work + self.other
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "{:.1} MiB = mapped model {:.1} + repacked weights {:.1}{}",
            mib(self.total()),
            mib(self.mapped),
            mib(self.repacked),
            if self.repacked_in_file { " (mapped from the repack cache)" } else { "" }
        )?;
        write!(
            f,
            " + KV cache {:.1} + activations {:.1} + work {:.1} + graphs and logits {:.1}",
            mib(self.kv),
            mib(self.activations),
            mib(self.work),
            mib(self.other)
        )?;
        if self.mapped_rows > 0 {
            write!(
                f,
                "; rows of the tied embedding ({:.1} MiB in the file) are read on demand",
                mib(self.mapped_rows)
            )?;
        }
        Ok(())
    }
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
            Self::NonFiniteLogits => write!(
                f,
                "the model produced non-finite logits (NaN or infinity); --check-numerics finds the first op that does"
            ),
            Self::Option(msg) => write!(f, "{msg}"),
            Self::Exec(e) => write!(f, "{e}"),
            Self::Resources(msg) => write!(f, "{msg}"),
            Self::Threads(e) => write!(f, "{e}"),
            Self::Cache(msg) => write!(f, "{msg}"),
            Self::Interrupted => write!(f, "interrupted"),
            Self::OverMemory { plan, limit } => write!(
                f,
                "not loading: the memory plan needs {plan}, more than the {:.1} MiB available (use a smaller \
                 model or context, -c, or free memory)",
                *limit as f64 / (1024.0 * 1024.0)
            ),
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
    /// Empty for a repack cache: the entries then point into the mapped file.
    packed: Vec<Line>,
    packed_entries: Vec<PackedEntry>,
    /// The file is a repacked-weight cache: the packed planes are read from the mapping.
    from_cache: bool,
    /// Bytes of the repacked weights (in `packed`, or in the file).
    packed_bytes: usize,
    /// Seconds spent repacking at load.
    repack_seconds: f64,
    /// Placement of every tensor of the file, in file order.
    placements: Vec<Placement>,
    /// The memory plan checked before allocating.
    memory_plan: MemoryPlan,
    /// Check every node's output for NaN/infinity.
    check_numerics: bool,
    /// The NPU backend, when matmuls go to the NPU.
    #[cfg(feature = "npu")]
    npu: Option<Box<crate::npu::NpuBackend>>,
}

impl Session {
    /// Opens, validates and plans `model` (kept mapped for the life of the process).
    pub fn new(model: &'static ModelFile, opts: &SessionOptions) -> Result<Self, SessionError> {
        let gguf = model.parse().map_err(SessionError::Load)?;
        let from_cache =
            crate::repack_cache::check_cache(&gguf, model.path()).map_err(SessionError::Cache)?;
        if from_cache && !opts.repack {
            return Err(SessionError::Cache(std::format!(
                "{} is a pinfer repack cache: its weight matrices exist only in the repacked layout, so it \
                 cannot run with repacking off (--no-repack, PINFER_NO_REPACK); load the original GGUF for that",
                model.path().display()
            )));
        }
        let crate::model::Checked { hparams: hp, vocab } = crate::model::check(&gguf)?;
        let n_ctx = crate::model::context_size(&hp, opts.n_ctx)
            .ok_or(SessionError::Option("context size above the model's maximum"))?;
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

        // Where every tensor goes (the same decision `pinfer info --placement` prints), then the
        // whole memory plan, checked before the arena and the repacked buffer are allocated.
        let placements: Vec<Placement> = gguf
            .tensors()
            .map(|t| {
                let u = placement::use_in(&prepared[0].graph, gguf.data_start() + t.offset as usize);
                placement::place(&t, u, opts.repack)
            })
            .collect();
        let (entries, sources, packed_total) = if from_cache {
            let (entries, total) =
                crate::repack_cache::cache_entries(&gguf, model.bytes().len(), &placements, model.path())
                    .map_err(SessionError::Cache)?;
            (entries, Vec::new(), total)
        } else {
            plan_repack(&gguf, &placements)
        };
        let mut memory_plan = MemoryPlan {
            mapped: gguf.data_start(),
            repacked: packed_total,
            repacked_in_file: from_cache,
            kv: kv.total_bytes,
            activations: activations.len,
            work: work.len,
            other: prepared.len() * (size_of::<Graph<GRAPH_CAPACITY>>() + size_of::<Plan<GRAPH_CAPACITY>>())
                + vocab.n_vocab as usize * 4,
            ..MemoryPlan::default()
        };
        for (t, p) in gguf.tensors().zip(&placements) {
            match (p.buffer, p.reason) {
                (_, Reason::Unused) => {}
                (Buffer::Repacked(_), Reason::TiedEmbedding) => memory_plan.mapped_rows += t.nbytes as usize,
                (Buffer::Mapped, _) => memory_plan.mapped += t.nbytes as usize,
                _ => {}
            }
        }
        if let Some(limit) = opts.memory_limit {
            if memory_plan.total() > limit {
                return Err(SessionError::OverMemory { plan: memory_plan, limit });
            }
        }

        let mut memory = Vec::new();
        memory.try_reserve_exact(total / ARENA_ALIGN).map_err(|_| {
            SessionError::Resources(std::format!(
                "cannot allocate the {total}-byte arena (KV cache and activations)"
            ))
        })?;
        memory.resize(total / ARENA_ALIGN, Line([0; ARENA_ALIGN]));
        let started = std::time::Instant::now();
        let (packed, packed_entries) = if from_cache {
            // Planes in the file, in file order: nothing to pack, copy or release.
            (Vec::new(), entries)
        } else {
            repack_weights(model, entries, &sources, packed_total, opts.threads)?
        };
        let repack_seconds = if from_cache { 0.0 } else { started.elapsed().as_secs_f64() };
        // After repacking, whose threads must not inherit the caller's pinning to one core.
        let config = PoolConfig {
            threads: opts.threads,
            cores: opts.cores.as_deref(),
            pin: opts.pin,
            rt_priority: opts.rt_priority,
        };
        let pool = Pool::with_config(&config).map_err(SessionError::Threads)?;
        #[cfg(feature = "npu")]
        let npu = {
            let graphs: Vec<&Graph<GRAPH_CAPACITY>> = prepared.iter().map(|p| &*p.graph).collect();
            // The pool's workers wait while the NPU runs: their cores drive NPU cores 1 and 2.
            let config = crate::npu::NpuConfig { cpu_cores: pool.thread_cores(), ..opts.npu.clone() };
            if from_cache && config.is_on() {
                // The NPU converts weights from the file's layout, which a cache does not hold.
                if !config.quiet_if_missing {
                    return Err(SessionError::Cache(std::format!(
                        "{}: NPU offload needs the original GGUF (a repack cache holds only the CPU layout)",
                        model.path().display()
                    )));
                }
                None
            } else {
                crate::npu::session_backend(model, &graphs, &config, n_batch, opts.repack).map(Box::new)
            }
        };
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
            from_cache,
            packed_bytes: packed_total,
            repack_seconds,
            placements,
            memory_plan,
            check_numerics: opts.check_numerics,
            #[cfg(feature = "npu")]
            npu,
        })
    }

    /// Every tensor of the file with its placement, in file order.
    pub fn placements(&self) -> impl Iterator<Item = (TensorInfo<'static>, Placement)> + '_ {
        self.gguf.tensors().zip(self.placements.iter().copied())
    }

    /// The memory plan checked at load.
    pub fn memory_plan(&self) -> MemoryPlan {
        self.memory_plan
    }

    /// The core of each thread (the caller first) when threads are pinned.
    pub fn thread_cores(&self) -> Option<Vec<usize>> {
        self.pool.thread_cores()
    }

    /// Whether the pool's barrier waits spin before sleeping (no two threads share a core).
    pub fn spinning(&self) -> bool {
        self.pool.spinning()
    }

    /// The repacked weight matrices: where each came from in the file and its layout.
    pub fn packed_entries(&self) -> &[PackedEntry] {
        &self.packed_entries
    }

    /// The memory this session reads while it runs, for locking it in RAM (`--mlock`): the arena,
    /// the repacked weights and the parts of the file read in place (header and metadata, mapped
    /// tensors, and tied embeddings, whose rows `get_rows` reads). Named regions, no overlaps.
    pub fn resident_regions(&self) -> Vec<(&'static str, &[u8])> {
        let file = self.model.bytes();
        let mut ranges: Vec<core::ops::Range<usize>> = Vec::new();
        ranges.push(0..self.gguf.data_start());
        if self.from_cache {
            // The repacked planes are pages of the file.
            for e in &self.packed_entries {
                let (_, sn) = packed_bytes(e.format, e.rows, e.k);
                ranges.push(e.quants_at..e.scales_at + sn);
            }
        }
        for (t, p) in self.placements() {
            let start = self.gguf.data_start() + t.offset as usize;
            let keep = match (p.buffer, p.reason) {
                (_, Reason::Unused) => false,
                (Buffer::Mapped, _) | (_, Reason::TiedEmbedding) => true,
                _ => false,
            };
            if keep {
                ranges.push(start..start + t.nbytes as usize);
            }
        }
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<core::ops::Range<usize>> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                // Tensors are aligned (32 bytes by default): merge across the padding.
                Some(last) if r.start <= last.end + 64 => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        let mut regions: Vec<(&'static str, &[u8])> = vec![
            ("arena", bytemuck::cast_slice(self.memory.as_slice())),
            ("repacked weights", bytemuck::cast_slice(self.packed.as_slice())),
        ];
        regions.extend(merged.into_iter().map(|r| ("model file", &file[r.start..r.end.min(file.len())])));
        regions.retain(|(_, b)| !b.is_empty());
        regions
    }

    /// Repacked weights: matrices, bytes of the packed buffer (or of the planes in a repack
    /// cache), and seconds spent repacking (0 for a cache).
    pub fn repacked(&self) -> (usize, usize, f64) {
        (self.packed_entries.len(), self.packed_bytes, self.repack_seconds)
    }

    /// Whether the model file is a repacked-weight cache (`pinfer repack`): the packed weights are
    /// read from the mapped file, nothing was repacked at load.
    pub fn from_cache(&self) -> bool {
        self.from_cache
    }

    /// The NPU backend, if matmuls go to the NPU.
    #[cfg(feature = "npu")]
    pub fn npu(&self) -> Option<&crate::npu::NpuBackend> {
        self.npu.as_deref()
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
        let packed: &[u8] =
            if self.from_cache { self.model.bytes() } else { bytemuck::cast_slice(self.packed.as_slice()) };
        let mut bound = Bound::new(&prep.graph, &prep.plan, &buffers, bytes, self.activations, self.work)?
            .with_packed(packed, &self.packed_entries)
            .with_numerics_check(self.check_numerics);
        #[cfg(feature = "npu")]
        if let Some(npu) = &self.npu {
            bound = bound.with_offload(npu.as_ref());
        }
        self.pool.run(&mut bound, step)?;
        self.n_past += tokens.len();
        Ok(())
    }
}

/// Where each matrix placed in the repacked buffer goes: its entry (planes at 64-byte aligned
/// offsets), its source `(type, file offset, bytes)`, and the buffer's total size.
fn plan_repack(gguf: &Gguf<'_>, placements: &[Placement]) -> (Vec<PackedEntry>, Vec<Source>, usize) {
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    let mut at = 0usize;
    for (t, p) in gguf.tensors().zip(placements) {
        let Buffer::Repacked(format) = p.buffer else { continue };
        // Experts `[k, m, n_expert]` are one matrix of m * n_expert rows.
        let (k, rows) = (t.ne[0] as usize, (t.ne[1] * t.ne[2] * t.ne[3]) as usize);
        let offset = gguf.data_start() + t.offset as usize;
        let (qn, sn) = packed_bytes(format, rows, k);
        let quants_at = at;
        let scales_at = (quants_at + qn).next_multiple_of(ARENA_ALIGN);
        at = (scales_at + sn).next_multiple_of(ARENA_ALIGN);
        entries.push(PackedEntry { source_offset: offset, format, rows, k, quants_at, scales_at });
        sources.push((t.ty, offset, t.nbytes as usize));
    }
    (entries, sources, at)
}

/// Asks for transparent huge pages over the 2 MiB-aligned part of `len` bytes at `ptr`, a fresh
/// allocation not yet touched (so its first writes fault in huge pages). Every decoded token
/// streams the whole repacked buffer: with 4 KiB pages that is a TLB miss, and under
/// virtualization a two-level page walk, every 4 KiB, and the hardware prefetchers stop at each
/// page boundary. Only an advice: where THP is off (or the kernel lacks it) nothing changes.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        const HUGE: usize = 2 << 20;
        let addr = ptr as usize;
        let (start, end) = (addr.next_multiple_of(HUGE), (addr + len) / HUGE * HUGE);
        if end > start {
            // `start - addr < len`: inside the allocation.
            if let Some(p) = core::ptr::NonNull::new(ptr.wrapping_add(start - addr)) {
                // SAFETY: the range lies inside a live allocation this function's caller owns;
                // MADV_HUGEPAGE changes how its pages are backed, never their contents.
                let _ = unsafe {
                    nix::sys::mman::madvise(p.cast(), end - start, nix::sys::mman::MmapAdvise::MADV_HUGEPAGE)
                };
            }
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = (ptr, len);
}

/// A repacked matrix's source: type, offset in the file, bytes.
type Source = (crate::quant::GgmlType, usize, usize);

/// Repacks the matrices `plan_repack` placed into one buffer of `at` bytes, using up to `threads`
/// threads; the original pages are released (they are no longer read, except rows of a tied
/// embedding, which fault back in as needed).
fn repack_weights(
    model: &ModelFile,
    mut entries: Vec<PackedEntry>,
    sources: &[Source],
    at: usize,
    threads: usize,
) -> Result<(Vec<Line>, Vec<PackedEntry>), SessionError> {
    if entries.is_empty() {
        return Ok((Vec::new(), entries));
    }
    let mut buffer: Vec<Line> = Vec::new();
    buffer.try_reserve_exact(at / ARENA_ALIGN).map_err(|_| {
        SessionError::Resources(std::format!("cannot allocate {at} bytes for the repacked weights"))
    })?;
    advise_huge_pages(buffer.as_mut_ptr().cast(), at);
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
    for (_, offset, len) in sources {
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
