//! std: the engine ([`crate::engine`]) over a mapped model file, with what only an operating
//! system gives: its memory on the heap (huge pages advised), weights repacked on threads, the
//! repack cache, the pinned worker pool and the NPU. One sequence, evaluated by token lists.
//!
//! After [`Session::new`] nothing allocates per token: graphs are reused, their addresses in the
//! preplanned memory resolved once (`exec::Addressed`).

use std::boxed::Box;
use std::fmt;
use std::string::ToString;
use std::vec;
use std::vec::Vec;

use crate::arena::ARENA_ALIGN;
use crate::engine::{Engine, EngineConfig, EngineError, Entry, GraphSlot, Model, Parallel};
use crate::exec::pool::{Pool, PoolConfig};
use crate::exec::PackedEntry;
use crate::gguf::{Gguf, TensorInfo};
use crate::kernels::packed::packed_bytes;
use crate::loader::{LoadError, ModelFile};
use crate::model::lora::Adapter;
use crate::model::{HParams, ModelError};
use crate::placement::{Buffer, Placement, Reason};

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
    /// Sequences the KV cache holds, each of `n_ctx` positions (the server's slots; 1 for the
    /// CLI). A step evaluates tokens of several sequences at once ([`Session::decode`]).
    pub n_seq: usize,
    /// Also plan for graphs that return logits for every token (perplexity).
    pub logits_all: bool,
    /// Repack weight matrices at load into the interleaved layout of the SIMD kernels
    /// (`false`: `--no-repack`, run on the file's layout through the reference dots).
    pub repack: bool,
    /// Run every thread of the pool SCHED_FIFO at this priority (1-99).
    pub rt_priority: Option<i32>,
    /// Check every node's output for NaN/infinity and stop at the first (`--check-numerics`).
    pub check_numerics: bool,
    /// The kernels to run (`--kernels`; default: the fastest this CPU has).
    pub kernels: crate::kernels::KernelPath,
    /// The KV cache's types (`-ctk/-ctv`; default f16).
    pub kv_types: crate::model::KvTypes,
    /// Called from the repacking threads with (bytes repacked so far, bytes to repack), after
    /// every chunk (the CLI shows progress on a terminal when a load takes more than a second).
    pub repack_progress: Option<fn(usize, usize)>,
    /// Refuse to load when the memory plan's total exceeds this many bytes (the CLI passes
    /// MemAvailable, or `--mem-limit`).
    pub memory_limit: Option<usize>,
    /// LoRA adapters to apply (`--lora FILE`, `--lora-scaled FILE SCALE`): each file with its
    /// user scale.
    pub lora: Vec<(std::path::PathBuf, f32)>,
    /// How an encoder pools its token vectors (`--pooling`; `None`: as its file says).
    pub pooling: Option<crate::model::Pooling>,
    /// Steps may feed embeddings (an image's): see [`crate::engine::EngineConfig::embeddings_input`].
    pub embeddings_input: bool,
    /// The memory of a vision projector opened beside the model (`--mmproj`; see
    /// [`crate::media::projector_memory`]): counted in the memory plan checked at load.
    pub projector: Option<crate::engine::vision::VisionMemory>,
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
            n_seq: 1,
            logits_all: false,
            repack: true,
            rt_priority: None,
            check_numerics: false,
            kernels: crate::kernels::KernelPath::detect(),
            kv_types: crate::model::KvTypes::default(),
            repack_progress: None,
            memory_limit: None,
            lora: Vec::new(),
            pooling: None,
            embeddings_input: false,
            projector: None,
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
    /// A bad option value.
    Option(&'static str),
    /// Memory or threads could not be obtained.
    Resources(std::string::String),
    /// The worker threads could not be started, pinned or made real-time.
    Threads(crate::exec::pool::PoolError),
    /// A repacked-weight cache this pinfer cannot use (another layout version or CPU, damaged, or
    /// run without repacking), or writing one failed.
    Cache(std::string::String),
    /// Stopped on request (SIGINT) before finishing; nothing was left half-written.
    Interrupted,
    /// The engine refused a plan or a step, in its own words: the model does not plan
    /// (`EngineError::Model`), a graph failed (`Exec`), the context is full (`ContextFull`), a
    /// token is outside the vocabulary, the logits are not finite, ...
    Engine(EngineError),
    /// A LoRA adapter could not be read or does not apply to the model.
    Adapter {
        /// The adapter file.
        path: std::path::PathBuf,
        /// Why.
        error: std::string::String,
    },
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
    /// Model file pages read in place: the header and metadata, every tensor the plan keeps
    /// mapped (read through the page cache), and the LoRA adapters' files.
    pub mapped: usize,
    /// File bytes of tied embeddings: repacked, but `get_rows` still reads their rows from the
    /// file, a few per token, through the page cache. Not in [`MemoryPlan::total`]: only the rows
    /// of tokens seen are ever read (`--mlock` locks them all, and says so if that fails).
    pub mapped_rows: usize,
    /// The repacked weights (in their own buffer, or in the file when it is a repack cache).
    pub repacked: usize,
    /// Whether the repacked weights are pages of the file (a repack cache), not a buffer.
    pub repacked_in_file: bool,
    /// KV cache, recurrent states and token ids (the arena's persistent part).
    pub kv: usize,
    /// Of which the recurrent layers' states (every sequence's).
    pub recurrent_states: usize,
    /// The KV cache's types.
    pub kv_types: crate::model::KvTypes,
    /// Activations (the arena's planned part).
    pub activations: usize,
    /// Converted matmul inputs (the arena's work part).
    pub work: usize,
    /// The engine's graph slots (graphs and their plans). The logits are rows of the
    /// activations, read in place.
    pub other: usize,
    /// A vision projector beside the model: its file, repacked matrices and encoder at its
    /// largest input.
    pub projector: Option<crate::engine::vision::VisionMemory>,
}

impl MemoryPlan {
    /// The peak: everything at once (tied embedding rows aside, see [`MemoryPlan::mapped_rows`]).
    pub fn total(&self) -> usize {
        let projector = self.projector.map_or(0, |p| p.total());
        self.mapped + self.repacked + self.kv + self.activations + self.work + self.other + projector
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
            " + KV cache {:.1} (K {}, V {}) + activations {:.1} + work {:.1} + graphs {:.1}",
            mib(self.kv),
            crate::quant::Lowercase(self.kv_types.k.name()),
            crate::quant::Lowercase(self.kv_types.v.name()),
            mib(self.activations),
            mib(self.work),
            mib(self.other)
        )?;
        if let Some(p) = &self.projector {
            write!(
                f,
                " + projector {:.1} (mapped {:.1} + repacked {:.1} + encoder {:.1} at {}x{} px + graph {:.1})",
                mib(p.total()),
                mib(p.mapped),
                mib(p.repacked),
                mib(p.arena),
                p.input.0,
                p.input.1,
                mib(p.graphs)
            )?;
        }
        if self.recurrent_states > 0 {
            let kib = self.recurrent_states as f64 / 1024.0;
            write!(f, "; the KV cache holds the recurrent layers' states ({kib:.1} KiB)")?;
        }
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
            Self::Option(msg) => write!(f, "{msg}"),
            Self::Resources(msg) => write!(f, "{msg}"),
            Self::Threads(e) => write!(f, "{e}"),
            Self::Cache(msg) => write!(f, "{msg}"),
            Self::Interrupted => write!(f, "interrupted"),
            Self::Engine(e) => write!(f, "{e}"),
            Self::Adapter { path, error } => write!(f, "LoRA adapter {}: {error}", path.display()),
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

impl From<EngineError> for SessionError {
    fn from(e: EngineError) -> Self {
        Self::Engine(e)
    }
}

/// Maps and checks the LoRA adapters `files` (path, user scale) for `base`. They stay mapped for
/// the life of the process, as the model does (`None`: no adapters).
fn open_adapters(
    base: &Model<'static>,
    files: &[(std::path::PathBuf, f32)],
) -> Result<Option<&'static [Adapter<'static>]>, SessionError> {
    if files.is_empty() {
        return Ok(None);
    }
    let mut adapters = Vec::with_capacity(files.len());
    for (path, user_scale) in files {
        let fail = |error: std::string::String| SessionError::Adapter { path: path.clone(), error };
        if !user_scale.is_finite() {
            return Err(fail(std::format!("the scale {user_scale} is not a finite number")));
        }
        let file = ModelFile::open_static(path).map_err(|e| fail(e.to_string()))?;
        let gguf = file.parse().map_err(|e| fail(e.to_string()))?;
        let adapter = Adapter::new(file.bytes(), &gguf, base.gguf(), base.hparams(), *user_scale)
            .map_err(|e| fail(e.to_string()))?;
        adapters.push(adapter);
    }
    Ok(Some(Vec::leak(adapters)))
}

impl From<crate::repack_cache::CacheError> for SessionError {
    fn from(e: crate::repack_cache::CacheError) -> Self {
        use crate::repack_cache::CacheError;
        match e {
            CacheError::Load(e) => Self::Load(e),
            CacheError::Model(e) => e.into(),
            CacheError::Interrupted => Self::Interrupted,
            e => Self::Cache(e.to_string()),
        }
    }
}

/// The engine's memory on the heap: repacked weights, KV cache, activations, work. Allocated
/// zeroed by `calloc` (fresh pages from the kernel, left untouched: the KV cache of positions never
/// reached never becomes resident), freed on drop. The engine aligns its start itself: an
/// alignment above the allocator's 16 bytes would make `alloc_zeroed` write every byte.
pub struct HeapMemory {
    ptr: core::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl HeapMemory {
    /// `len` zeroed bytes (at least one line), or `None` when the allocator refuses.
    fn zeroed(len: usize) -> Option<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(ARENA_ALIGN), 16).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = core::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self { ptr, layout })
    }
}

impl core::ops::Deref for HeapMemory {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` holds `layout.size()` initialized (zeroed) bytes owned by `self`.
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl core::ops::DerefMut for HeapMemory {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, borrowed mutably through `&mut self`.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for HeapMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the memory is owned (no aliasing handle exists elsewhere), like a `Box<[u8]>`.
unsafe impl Send for HeapMemory {}
// SAFETY: shared access only reads, like `&[u8]`.
unsafe impl Sync for HeapMemory {}

/// Repacking jobs spread over this many scoped threads (at most 8), each taking the next matrix.
pub(crate) struct Threads(pub(crate) usize);

impl Parallel for Threads {
    fn for_each(&self, n: usize, job: &(dyn Fn(usize) + Sync)) {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= n {
                break;
            }
            job(i);
        };
        std::thread::scope(|scope| {
            for _ in 1..self.0.clamp(1, 8).min(n.max(1)) {
                scope.spawn(work);
            }
            work();
        });
    }
}

/// The engine of a session: graph slots and memory on the heap.
pub type SessionEngine = Engine<'static, Vec<GraphSlot>, HeapMemory>;

/// A model loaded and ready to evaluate tokens.
pub struct Session {
    model: &'static ModelFile,
    engine: Box<SessionEngine>,
    pool: Pool,
    /// The batch being evaluated (`n_batch` entries: no allocation per token).
    entries: Vec<Entry>,
    /// The file is a repacked-weight cache: the packed planes are read from the mapping.
    from_cache: bool,
    /// Bytes of the repacked weights (in the engine's memory, or in the file).
    packed_bytes: usize,
    /// Seconds spent repacking at load.
    repack_seconds: f64,
    /// Placement of every tensor of the file, in file order.
    placements: Vec<Placement>,
    /// The memory plan checked before allocating.
    memory_plan: MemoryPlan,
    /// The NPU backend, when matmuls go to the NPU.
    #[cfg(feature = "npu")]
    npu: Option<Box<crate::npu::NpuBackend>>,
    /// The NPU configuration the session was opened with (its pool's cores filled in): a
    /// projector's encoder takes the same.
    #[cfg(feature = "npu")]
    npu_config: crate::npu::NpuConfig,
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
        if opts.threads == 0 {
            return Err(SessionError::Option("batch size and thread count must be at least 1"));
        }
        let config = EngineConfig {
            n_ctx: opts.n_ctx,
            n_batch: opts.n_batch,
            n_seq: opts.n_seq,
            n_outputs: if opts.logits_all {
                opts.n_batch.max(1)
            } else {
                opts.n_seq.clamp(1, opts.n_batch.max(1))
            },
            repack: opts.repack,
            check_numerics: opts.check_numerics,
            kernels: opts.kernels,
            kv_types: opts.kv_types,
            pooling: opts.pooling,
            embeddings_input: opts.embeddings_input,
        };
        let base = Model::from_gguf(model.bytes(), gguf)?;
        let base = match open_adapters(&base, &opts.lora)? {
            Some(adapters) => base
                .with_adapters(adapters)
                .map_err(|e| SessionError::Adapter { path: opts.lora[0].0.clone(), error: e.to_string() })?,
            None => base,
        };
        let mut planned = crate::engine::heap::plan(base, &config)?;
        let gguf = planned.model().gguf();
        // Where every tensor goes (the same decision `pinfer info --placement` prints).
        let placements: Vec<Placement> = gguf.tensors().map(|t| planned.placement_of(&t)).collect();
        let mut packed_total = planned.layout().packed;
        if from_cache {
            let (entries, total) =
                crate::repack_cache::cache_entries(gguf, model.bytes().len(), &placements, model.path())
                    .map_err(SessionError::Cache)?;
            planned = planned.with_prepacked(&entries)?;
            packed_total = total;
        }

        // The whole memory plan, checked before the engine's memory is allocated.
        let layout = planned.layout();
        let gguf = planned.model().gguf();
        let mut memory_plan = MemoryPlan {
            mapped: gguf.data_start(),
            repacked: packed_total,
            repacked_in_file: from_cache,
            kv: layout.kv,
            recurrent_states: {
                let kv = planned.kv_layout();
                kv.state_bytes() * kv.n_seq * kv.recurrent.count()
            },
            kv_types: opts.kv_types,
            activations: layout.activations,
            work: layout.work,
            other: planned.graphs().count() * size_of::<GraphSlot>(),
            projector: opts.projector,
            ..MemoryPlan::default()
        };
        for (t, p) in gguf.tensors().zip(&placements) {
            match (p.buffer, p.reason) {
                (_, Reason::Unused) => {}
                (Buffer::Repacked(_), Reason::TiedEmbedding) => memory_plan.mapped_rows += t.nbytes as usize,
                (Buffer::Mapped, _) => memory_plan.mapped += t.nbytes as usize,
                // Counted in the repacked buffer (or not at all on the NPU, never chosen yet).
                (Buffer::Repacked(_) | Buffer::Npu(_), _) => {}
            }
        }
        memory_plan.mapped += planned.model().adapters().iter().map(|a| a.bytes.len()).sum::<usize>();
        if let Some(limit) = opts.memory_limit {
            if memory_plan.total() > limit {
                return Err(SessionError::OverMemory { plan: memory_plan, limit });
            }
        }

        let total = layout.bytes_needed();
        let memory = HeapMemory::zeroed(total).ok_or_else(|| {
            SessionError::Resources(std::format!(
                "cannot allocate {total} bytes for the repacked weights, KV cache and activations"
            ))
        })?;
        let started = std::time::Instant::now();
        let mut engine = Box::new(planned.bind(memory)?);
        if !from_cache {
            // Huge pages for the repacked weights only (streamed whole every token); the KV cache
            // keeps small pages, so positions never reached never become resident.
            let packed = engine.packed_buffer();
            advise_huge_pages(packed.as_ptr().cast_mut(), packed.len());
        }
        // Each matrix's file pages are given back as soon as it is packed (they are not read
        // again, except rows of a tied embedding, which fault back in as needed).
        // Progress counts file bytes: the sources of the repacked matrices.
        let total: usize = engine
            .planned()
            .model()
            .gguf()
            .tensors()
            .zip(&placements)
            .filter(|(_, p)| matches!(p.buffer, Buffer::Repacked(_)))
            .map(|(t, _)| t.nbytes as usize)
            .sum();
        let done = std::sync::atomic::AtomicUsize::new(0);
        engine.repack(&Threads(opts.threads), &|range| {
            let so_far = done.fetch_add(range.len(), std::sync::atomic::Ordering::Relaxed) + range.len();
            model.release(range);
            if let Some(progress) = opts.repack_progress {
                progress(so_far, total);
            }
        })?;
        let repack_seconds = if from_cache { 0.0 } else { started.elapsed().as_secs_f64() };
        // After repacking, whose threads must not inherit the caller's pinning to one core.
        let config = PoolConfig {
            threads: opts.threads,
            cores: opts.cores.as_deref(),
            pin: opts.pin,
            rt_priority: opts.rt_priority,
        };
        let pool = Pool::with_config(&config).map_err(SessionError::Threads)?;
        // The pool's workers wait while the NPU runs: their cores drive NPU cores 1 and 2.
        #[cfg(feature = "npu")]
        let npu_config = crate::npu::NpuConfig { cpu_cores: pool.thread_cores(), ..opts.npu.clone() };
        #[cfg(feature = "npu")]
        let npu = {
            let graphs: Vec<&crate::graph::Graph<{ crate::build_config::GRAPH_CAPACITY }>> =
                engine.planned().graphs().collect();
            let config = &npu_config;
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
                let n_batch = engine.kv_layout().n_batch;
                crate::npu::session_backend(model, &graphs, config, n_batch, opts.repack).map(Box::new)
            }
        };
        let n_batch = engine.kv_layout().n_batch;
        Ok(Self {
            model,
            engine,
            pool,
            entries: vec![Entry { seq: 0, pos: 0, token: 0, logits: false }; n_batch],
            from_cache,
            packed_bytes: packed_total,
            repack_seconds,
            placements,
            memory_plan,
            #[cfg(feature = "npu")]
            npu,
            #[cfg(feature = "npu")]
            npu_config,
        })
    }

    /// Every tensor of the file with its placement, in file order.
    pub fn placements(&self) -> impl Iterator<Item = (TensorInfo<'static>, Placement)> + '_ {
        self.gguf().tensors().zip(self.placements.iter().copied())
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
        self.engine.planned().packed_entries()
    }

    /// The engine this session drives.
    pub fn engine(&self) -> &SessionEngine {
        &self.engine
    }

    /// The memory this session reads while it runs, for locking it in RAM (`--mlock`): the
    /// engine's memory (repacked weights, KV cache, activations) and the parts of the file read
    /// in place (header and metadata, mapped tensors, and tied embeddings, whose rows `get_rows`
    /// reads). Named regions, no overlaps.
    pub fn resident_regions(&self) -> Vec<(&'static str, &[u8])> {
        let file = self.model.bytes();
        let mut ranges: Vec<core::ops::Range<usize>> = Vec::new();
        ranges.push(0..self.gguf().data_start());
        if self.from_cache {
            // The repacked planes are pages of the file.
            for e in self.packed_entries() {
                let (_, sn) = packed_bytes(e.format, e.rows, e.k);
                ranges.push(e.quants_at..e.scales_at + sn);
            }
        }
        for (t, p) in self.placements() {
            let start = self.gguf().data_start() + t.offset as usize;
            let keep = match (p.buffer, p.reason) {
                (_, Reason::Unused) => false,
                (Buffer::Mapped, _) | (_, Reason::TiedEmbedding) => true,
                (Buffer::Repacked(_) | Buffer::Npu(_), _) => false,
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
        let mut regions: Vec<(&'static str, &[u8])> = vec![("engine memory", self.engine.memory())];
        regions.extend(merged.into_iter().map(|r| ("model file", &file[r.start..r.end.min(file.len())])));
        regions.retain(|(_, b)| !b.is_empty());
        regions
    }

    /// Repacked weights: matrices, bytes of the packed buffer (or of the planes in a repack
    /// cache), and seconds spent repacking (0 for a cache).
    pub fn repacked(&self) -> (usize, usize, f64) {
        (self.packed_entries().len(), self.packed_bytes, self.repack_seconds)
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

    /// The NPU configuration the session was opened with, its pool's cores filled in (a
    /// projector's encoder offloads by it: [`crate::media::Projector::open`]).
    #[cfg(feature = "npu")]
    pub fn npu_config(&self) -> &crate::npu::NpuConfig {
        &self.npu_config
    }

    /// The parsed model file.
    pub fn gguf(&self) -> &Gguf<'static> {
        self.engine.planned().model().gguf()
    }

    /// The model's hyper-parameters.
    pub fn hparams(&self) -> &HParams {
        self.engine.planned().model().hparams()
    }

    /// The KV cache's types.
    pub fn kv_types(&self) -> crate::model::KvTypes {
        self.engine.kv_layout().types
    }

    /// Context size in tokens.
    pub fn n_ctx(&self) -> usize {
        self.engine.kv_layout().n_ctx
    }

    /// Tokens in the KV cache (of sequence 0).
    pub fn n_past(&self) -> usize {
        self.engine.seq_len(0)
    }

    /// Sequences the KV cache holds.
    pub fn n_seq(&self) -> usize {
        self.engine.kv_layout().n_seq
    }

    /// Most tokens one [`decode`](Self::decode) step takes.
    pub fn n_batch(&self) -> usize {
        self.engine.kv_layout().n_batch
    }

    /// Most entries of one step that may want logits.
    pub fn n_outputs(&self) -> usize {
        self.engine.planned().config().n_outputs
    }

    /// Positions sequence `seq` holds.
    pub fn seq_len(&self, seq: usize) -> usize {
        self.engine.seq_len(seq)
    }

    /// Forgets sequence `seq` from position `n` on (0: empties it); returns the positions kept
    /// (see [`Engine::truncate`](crate::engine::Engine::truncate): a model with recurrent layers
    /// keeps a sequence whole or empties it).
    #[must_use = "a recurrent model may keep fewer positions than asked"]
    pub fn truncate_seq(&mut self, seq: usize, n: usize) -> usize {
        self.engine.truncate(seq, n)
    }

    /// One step over a batch of tokens from any sequences (each entry at its sequence's next
    /// position, at most [`n_batch`](Self::n_batch) of them, at most
    /// [`n_outputs`](Self::n_outputs) wanting logits); read the logits with
    /// [`logits`](Self::logits). Nothing is allocated.
    pub fn decode(&mut self, batch: &[Entry]) -> Result<(), SessionError> {
        self.decode_typed(batch, &[])
    }

    /// [`decode`](Self::decode) with each entry's token type (an encoder's; see
    /// [`Engine::step_typed`](crate::engine::Engine::step_typed)).
    pub fn decode_typed(&mut self, batch: &[Entry], token_types: &[u32]) -> Result<(), SessionError> {
        #[cfg(feature = "npu")]
        let offload = self.npu.as_deref().map(|n| n as &dyn crate::exec::MatmulOffload);
        #[cfg(not(feature = "npu"))]
        let offload = None;
        self.engine.step_typed(batch, token_types, &self.pool, offload)?;
        Ok(())
    }

    /// Feeds `rows` (`n_embd` values per position: an image's embeddings from a vision projector)
    /// to sequence `seq` at its next positions, in steps of at most [`n_batch`](Self::n_batch);
    /// with `causal` false they attend to each other both ways, so they must fit in one step.
    /// `grid` (columns, rows) is the image's token grid, in raster order, which an M-RoPE model
    /// turns its tokens by (see [`Engine::place_image`](crate::engine::Engine::place_image)).
    /// The session must be opened with [`SessionOptions::embeddings_input`]. No logits are kept.
    pub fn decode_embeddings(
        &mut self,
        seq: usize,
        rows: &[f32],
        causal: bool,
        grid: Option<(usize, usize)>,
    ) -> Result<(), SessionError> {
        let n_embd = self.hparams().n_embd as usize;
        if n_embd == 0 || rows.len() % n_embd != 0 {
            return Err(SessionError::Option("input embeddings must be n_embd values per position"));
        }
        let n = rows.len() / n_embd;
        if let Some((nx, ny)) = grid {
            if nx.checked_mul(ny) != Some(n) {
                return Err(SessionError::Option("an image's grid must hold its embeddings, one per cell"));
            }
            self.engine.place_image(seq, nx, ny)?;
        }
        let step = self.n_batch();
        if !causal && n > step {
            return Err(SessionError::Option(
                "an image attending both ways must fit in one batch: raise the batch size (-b) to its tokens",
            ));
        }
        #[cfg(feature = "npu")]
        let offload = self.npu.as_deref().map(|n| n as &dyn crate::exec::MatmulOffload);
        #[cfg(not(feature = "npu"))]
        let offload = None;
        let mut done = 0;
        while done < n {
            let len = (n - done).min(step);
            let start = self.engine.seq_len(seq);
            let mut batch: Vec<Entry> = Vec::with_capacity(len);
            batch.extend((0..len).map(|i| Entry { seq, pos: start + i, token: 0, logits: i + 1 == len }));
            let chunk = &rows[done * n_embd..(done + len) * n_embd];
            self.engine.step_embeddings(&batch, chunk, causal, &self.pool, offload)?;
            done += len;
        }
        Ok(())
    }

    /// The rotary position sequence `seq`'s next token takes (see
    /// [`Engine::next_position`](crate::engine::Engine::next_position)).
    pub fn next_position(&self, seq: usize) -> usize {
        self.engine.next_position(seq)
    }

    /// Bytes of the cache rows of `n` positions of one sequence.
    pub fn sequence_bytes(&self, n: usize) -> usize {
        self.engine.sequence_bytes(n)
    }

    /// The model file's bytes.
    pub fn model_bytes(&self) -> &[u8] {
        self.model.bytes()
    }

    /// The cache rows of sequence `seq`'s first `n` positions (a saved slot).
    pub fn save_sequence(&self, seq: usize, n: usize) -> Result<Vec<u8>, SessionError> {
        let mut out = Vec::with_capacity(self.engine.sequence_bytes(n));
        self.engine.read_sequence(seq, n, &mut |rows| out.extend_from_slice(rows))?;
        Ok(out)
    }

    /// Makes sequence `seq` hold `n` positions whose cache rows are `bytes` (from
    /// [`save_sequence`](Self::save_sequence) on the same model and layout).
    pub fn restore_sequence(&mut self, seq: usize, n: usize, bytes: &[u8]) -> Result<(), SessionError> {
        Ok(self.engine.write_sequence(seq, n, bytes)?)
    }

    /// The logits of the `i`-th entry of the last [`decode`](Self::decode) that wanted them.
    pub fn logits(&self, i: usize) -> Option<&[f32]> {
        self.engine.logits(i)
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.engine.planned().model().vocab().n_vocab as usize
    }

    /// Bytes of the engine's memory: KV cache and inputs, activations, work.
    pub fn arena_bytes(&self) -> (usize, usize, usize) {
        let layout = self.engine.planned().layout();
        (layout.kv, layout.activations, layout.work)
    }

    /// The kernels every graph runs on.
    pub fn kernels(&self) -> crate::kernels::KernelPath {
        self.engine.planned().config().kernels
    }

    /// The session's worker threads, to run another graph on (an image encoder's).
    pub fn runner(&self) -> &Pool {
        &self.pool
    }

    /// Threads evaluating each graph.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Context shift of sequence `seq` as llama.cpp's server does it when the cache is full:
    /// keeps its first `keep` positions (at most the context less 4), drops half of the rest
    /// (never all of it) and moves the others down, their keys re-rotated. Returns the positions
    /// dropped.
    pub fn shift_context(&mut self, seq: usize, keep: usize) -> Result<usize, SessionError> {
        let n = self.engine.seq_len(seq);
        let keep = keep.min(self.n_ctx().saturating_sub(4)).min(n);
        let left = n - keep;
        let discard = (left / 2).min(left.saturating_sub(1));
        self.engine.shift_sequence(seq, keep, discard)?;
        Ok(discard)
    }

    /// Forgets the cache from position `n` on (0: start a new sequence); returns the positions
    /// kept (fewer than `n` for a model with recurrent layers: see [`Self::truncate_seq`]).
    #[must_use = "a recurrent model may keep fewer positions than asked"]
    pub fn truncate(&mut self, n: usize) -> usize {
        self.engine.truncate(0, n)
    }

    /// Evaluates `tokens` after the cached ones (in steps of at most a batch, [`Engine::feed`]);
    /// returns the logits of the last one, in the engine's memory (no copy; also
    /// [`logits`](Self::logits)`(0)` until the next step). No tokens: the last step's (none
    /// before the first).
    pub fn eval(&mut self, tokens: &[u32]) -> Result<&[f32], SessionError> {
        self.check(tokens)?;
        if tokens.is_empty() {
            return Ok(self.engine.logits(0).unwrap_or_default());
        }
        #[cfg(feature = "npu")]
        let offload = self.npu.as_deref().map(|n| n as &dyn crate::exec::MatmulOffload);
        #[cfg(not(feature = "npu"))]
        let offload = None;
        self.engine.feed(0, tokens, &mut self.entries, &self.pool, offload)?;
        self.engine.logits(0).ok_or(SessionError::Engine(EngineError::NonFiniteLogits))
    }

    /// Evaluates `tokens` after the cached ones and calls `each` with every token's logits in
    /// order (for perplexity). Needs `logits_all` in the options.
    pub fn eval_all(
        &mut self,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<(), SessionError> {
        self.check(tokens)?;
        let n_batch = self.engine.kv_layout().n_batch;
        let mut index = 0;
        for chunk in tokens.chunks(n_batch) {
            self.step(chunk, true)?;
            for i in 0..chunk.len() {
                each(index, self.engine.logits(i).ok_or(SessionError::Engine(EngineError::NonFiniteLogits))?);
                index += 1;
            }
        }
        Ok(())
    }

    fn check(&self, tokens: &[u32]) -> Result<(), SessionError> {
        let needed = self.n_past() + tokens.len();
        if needed > self.n_ctx() {
            return Err(SessionError::Engine(EngineError::ContextFull { needed, n_ctx: self.n_ctx() }));
        }
        let n_vocab = self.n_vocab();
        match tokens.iter().find(|&&id| id as usize >= n_vocab) {
            Some(&id) => Err(SessionError::Engine(EngineError::BadToken { id, n_vocab })),
            None => Ok(()),
        }
    }

    /// One engine step of `tokens` (at most a batch) in sequence 0: logits for the last token,
    /// or for every token with `all`.
    fn step(&mut self, tokens: &[u32], all: bool) -> Result<(), SessionError> {
        let n_past = self.n_past();
        for (i, (e, &token)) in self.entries.iter_mut().zip(tokens).enumerate() {
            *e = Entry { seq: 0, pos: n_past + i, token, logits: all || i + 1 == tokens.len() };
        }
        let entries = core::mem::take(&mut self.entries);
        let result = self.decode(&entries[..tokens.len()]);
        self.entries = entries;
        result
    }
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
