//! The engine: a model run in caller memory, `#![no_std]` and allocation-free.
//!
//! Every front end (the CLI's session, tests, a server, bare metal) runs a model through this:
//!
//! 1. [`Model::open`] parses and validates a GGUF file given as bytes.
//! 2. [`Planned::new`] builds the forward graphs into caller-provided [`GraphSlot`]s, decides
//!    where every tensor goes (repacked or read in place) and plans the exact bytes of the
//!    repacked weights, the KV cache and inputs, the activations and the kernels' work area
//!    ([`MemoryLayout`]).
//! 3. [`Planned::bind`] lays those out with [`Arena`] in caller memory; [`Engine::repack`] fills
//!    the repacked weights (the caller may spread the matrices over threads, [`Parallel`]).
//! 4. [`Engine::step`] runs one batch: entries of (sequence, position, token, want logits) from
//!    up to `n_seq` sequences at once, prompt chunks and single-token decodes mixed, each token
//!    attending only to its own sequence. [`Engine::logits`] reads the rows asked for.
//!
//! The KV cache holds `n_seq` sequences of `n_ctx` positions; sequences are cleared, truncated
//! or copied into one another ([`Engine::copy_prefix`]: a shared system prompt computed once).
//!
//! An encoder (`bert`) keeps no cache: each step holds whole sequences one after another (from
//! position 0, up to `n_seq` of them), each attending to its own tokens both ways, and gives one
//! pooled vector per sequence, or one per token asked for ([`Engine::embedding`];
//! [`EngineConfig::pooling`] overrides the file's pooling).
//!
//! [`generate`] is one generation step over it (prompt chunks, sampling, stream decoding, stop
//! tokens): every front end generates through it.

pub mod embedding;
pub mod generate;
#[cfg(feature = "std")]
pub mod heap;
pub mod mrope;
pub mod vision;

use core::fmt;
use core::ops::DerefMut;

use crate::arena::{Arena, ArenaExhausted, Region, ARENA_ALIGN};
use crate::build_config::GRAPH_CAPACITY;
use crate::exec::{work_bytes, Addressed, Bound, ExecError, MatmulOffload, PackedEntry, Step};
use crate::gguf::{Gguf, GgufError, TensorInfo};
use crate::graph::{plan, Graph, Plan, PlanError};
use crate::kernels::packed::{pack, packed_bytes, GROUP_ROWS};
use crate::kernels::KernelPath;
use crate::model::lora::{Adapter, LoraError, MAX_ADAPTERS};
use crate::model::{
    build_forward, check, context_size, Forward, HParams, KvLayout, KvTypeError, KvTypes, ModelError,
    Pooling, StepInput, Vocab,
};
use crate::placement::{self, Buffer, Placement};
use crate::quant::GgmlType;

/// Most weight matrices one model repacks (a 126-layer dense model has 882; the models boards run
/// have a few hundred). Their table is part of the engine's own size.
pub const MAX_PACKED: usize = 1024;
/// Most sequences the KV cache holds.
pub const MAX_SEQ: usize = 64;

/// How to run a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Positions per sequence (0: min(4096, the model's training context)).
    pub n_ctx: usize,
    /// Most tokens one step evaluates.
    pub n_batch: usize,
    /// Sequences the KV cache holds.
    pub n_seq: usize,
    /// Most tokens of one step whose logits are wanted (the batch, for perplexity; the number of
    /// sequences, for generation).
    pub n_outputs: usize,
    /// Repack weight matrices into the SIMD kernels' interleaved layout (`false`: run on the
    /// file's layout through the reference dots).
    pub repack: bool,
    /// Check every node's output for NaN/infinity and stop at the first.
    pub check_numerics: bool,
    /// The kernels to run (default: the fastest this CPU has; a path it lacks runs the reference).
    pub kernels: KernelPath,
    /// The KV cache's types (default F16 keys and values).
    pub kv_types: KvTypes,
    /// How an encoder pools its token vectors (`--pooling`; `None`: as its file says, else
    /// per token). A generating model gives logits and refuses one.
    pub pooling: Option<Pooling>,
    /// Steps may feed embeddings instead of token ids ([`Engine::step_embeddings`]: an image's,
    /// from a vision projector): room for a batch of them in the persistent region.
    pub embeddings_input: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            n_ctx: 0,
            n_batch: 64,
            n_seq: 1,
            n_outputs: 1,
            repack: true,
            check_numerics: false,
            kernels: KernelPath::detect(),
            kv_types: KvTypes::default(),
            pooling: None,
            embeddings_input: false,
        }
    }
}

/// Why a model could not be planned or a step could not run.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum EngineError {
    /// The bytes are not a GGUF file pinfer reads.
    Gguf(GgufError),
    /// The file is not a model pinfer runs.
    Model(ModelError),
    /// A bad configuration value.
    Config(&'static str),
    /// A KV cache type the model cannot use.
    KvType(KvTypeError),
    /// A graph could not be planned.
    Plan(PlanError),
    /// The caller's memory or graph slots are too small.
    Memory(ArenaExhausted),
    /// More weight matrices to repack than [`MAX_PACKED`].
    TooManyMatrices,
    /// A weight matrix could not be repacked (its size does not match its shape).
    Repack {
        /// Byte offset of its data in the file.
        offset: usize,
    },
    /// [`Engine::step`] before [`Engine::repack`].
    NotRepacked,
    /// A batch with no entries, more than `n_batch`, or more outputs than `n_outputs`.
    BatchSize {
        /// Entries in the batch.
        entries: usize,
        /// Entries that want logits.
        outputs: usize,
    },
    /// A sequence id outside the cache's `n_seq`.
    BadSequence {
        /// The id.
        seq: usize,
        /// Sequences the cache holds.
        n_seq: usize,
    },
    /// An entry's position is not the next one of its sequence.
    BadPosition {
        /// The sequence.
        seq: usize,
        /// The position asked for.
        pos: usize,
        /// The next position of the sequence.
        expected: usize,
    },
    /// The sequence is full: `needed` positions were asked for, `n_ctx` exist.
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
    /// Token types given, not one per entry.
    TokenTypesLength {
        /// Types given.
        types: usize,
        /// Entries of the batch.
        entries: usize,
    },
    /// A token type the model's embeddings do not have.
    BadTokenType {
        /// The entry.
        entry: usize,
        /// Its type.
        ty: u32,
        /// Token types the model has (rows of `token_types.weight`).
        n_types: usize,
    },
    /// An encoder's batch whose sequences are not each whole and consecutive (positions 0, 1, ..
    /// of one sequence after another): an encoder keeps nothing between steps.
    EncoderBatch {
        /// The first entry out of place.
        entry: usize,
    },
    /// The model gives no outputs of this kind: logits from an encoder, embeddings or a
    /// pooling from a generating model, `rank` pooling without a classifier head.
    Output(&'static str),
    /// The logits hold NaN or infinity.
    NonFiniteLogits,
    /// Running a graph failed.
    Exec(ExecError),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gguf(e) => write!(f, "{e}"),
            Self::Model(e) => write!(f, "{e}"),
            Self::Config(msg) => write!(f, "{msg}"),
            Self::KvType(e) => write!(f, "{e}"),
            Self::Plan(e) => write!(f, "planning: {e}"),
            Self::Memory(e) => write!(f, "{e}"),
            Self::TooManyMatrices => {
                write!(f, "the model has more than {MAX_PACKED} weight matrices to repack")
            }
            Self::Repack { offset } => write!(
                f,
                "repacking the weight matrix at byte {offset} failed (its size does not match its shape)"
            ),
            Self::NotRepacked => write!(f, "the engine ran before its weights were repacked"),
            Self::BatchSize { entries, outputs } => write!(
                f,
                "a batch of {entries} entries with {outputs} outputs does not fit the engine's batch and output sizes"
            ),
            Self::BadSequence { seq, n_seq } => {
                write!(f, "sequence {seq} does not exist: the cache holds {n_seq} sequences")
            }
            Self::BadPosition { seq, pos, expected } => write!(
                f,
                "sequence {seq}: position {pos} asked for, the next position is {expected} (truncate the sequence first to rewrite it)"
            ),
            Self::ContextFull { needed, n_ctx } => write!(
                f,
                "context full: {needed} positions needed, the context holds {n_ctx} (raise it with -c, up to the model's maximum)"
            ),
            Self::BadToken { id, n_vocab } => {
                write!(f, "token id {id} is outside the vocabulary of {n_vocab} tokens")
            }
            Self::TokenTypesLength { types, entries } => {
                write!(f, "{types} token types given for a batch of {entries} entries (one per entry)")
            }
            Self::BadTokenType { entry, ty, n_types } => {
                write!(f, "entry {entry}: token type {ty} given, the model has {n_types}")
            }
            Self::EncoderBatch { entry } => write!(
                f,
                "entry {entry} of an encoder's batch is out of place: each sequence must be whole (positions 0, 1, ..) and its tokens consecutive"
            ),
            Self::Output(msg) => write!(f, "{msg}"),
            Self::NonFiniteLogits => write!(
                f,
                "the model produced non-finite logits (NaN or infinity); --check-numerics finds the first op that does"
            ),
            Self::Exec(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for EngineError {}

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        Self::Model(e)
    }
}

impl From<ExecError> for EngineError {
    fn from(e: ExecError) -> Self {
        Self::Exec(e)
    }
}

/// A GGUF file that holds a model pinfer runs: parsed, its hyper-parameters and vocabulary checked.
pub struct Model<'m> {
    bytes: &'m [u8],
    gguf: Gguf<'m>,
    hp: HParams,
    vocab: Vocab<'m>,
    /// LoRA adapters whose products every graph adds (buffers 1.. of every step).
    adapters: &'m [Adapter<'m>],
}

impl<'m> Model<'m> {
    /// Parses and validates `bytes` (the whole file).
    pub fn open(bytes: &'m [u8]) -> Result<Self, EngineError> {
        let gguf = Gguf::parse(bytes).map_err(EngineError::Gguf)?;
        Self::from_gguf(bytes, gguf)
    }

    /// Validates an already parsed file (`gguf` must be `bytes` parsed).
    pub fn from_gguf(bytes: &'m [u8], gguf: Gguf<'m>) -> Result<Self, EngineError> {
        let checked = check(&gguf)?;
        Ok(Self { bytes, gguf, hp: checked.hparams, vocab: checked.vocab, adapters: &[] })
    }

    /// Runs the model with LoRA adapters (each checked against this model by
    /// [`LoraAdapter::check`](crate::model::lora::LoraAdapter::check)): every graph adds their
    /// products to the weights they adapt. Refuses more than [`MAX_ADAPTERS`] and non-finite
    /// weights; a pair whose weight the graph does not multiply whole is refused when planning.
    pub fn with_adapters(mut self, adapters: &'m [Adapter<'m>]) -> Result<Self, EngineError> {
        if adapters.len() > MAX_ADAPTERS {
            return Err(EngineError::Model(ModelError::Lora(LoraError::TooMany(adapters.len()))));
        }
        for a in adapters {
            a.check_finite().map_err(|e| EngineError::Model(ModelError::Lora(e)))?;
        }
        self.adapters = adapters;
        Ok(self)
    }

    /// The LoRA adapters it runs with.
    pub fn adapters(&self) -> &'m [Adapter<'m>] {
        self.adapters
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &'m [u8] {
        self.bytes
    }

    /// The parsed file.
    pub fn gguf(&self) -> &Gguf<'m> {
        &self.gguf
    }

    /// The hyper-parameters.
    pub fn hparams(&self) -> &HParams {
        &self.hp
    }

    /// The vocabulary summary.
    pub fn vocab(&self) -> &Vocab<'m> {
        &self.vocab
    }

    /// Type and bytes of the tensor whose data starts at byte `offset` of the file.
    fn source(&self, offset: usize) -> Option<(GgmlType, &'m [u8])> {
        tensor_source(&self.gguf, self.bytes, offset)
    }
}

/// Type and bytes of the tensor of `gguf` (parsed from `bytes`) whose data starts at byte
/// `offset` of the file (a repack's source).
pub(crate) fn tensor_source<'m>(
    gguf: &Gguf<'m>,
    bytes: &'m [u8],
    offset: usize,
) -> Option<(GgmlType, &'m [u8])> {
    let start = gguf.data_start();
    let t = gguf.tensors().find(|t| start + t.offset as usize == offset)?;
    Some((t.ty, bytes.get(offset..offset + t.nbytes as usize)?))
}

/// A forward graph for one batch shape, and its memory plan. The caller provides the slots
/// (a `static` array on bare metal, boxed on std): each is about a megabyte.
pub struct GraphSlot {
    graph: Addressed<GRAPH_CAPACITY>,
    plan: Plan<GRAPH_CAPACITY>,
    fwd: Option<Forward>,
}

impl GraphSlot {
    /// Makes `slot` an empty slot in place, without building one on the stack (a slot is about a
    /// megabyte, a thread's stack often two).
    pub fn init(slot: &mut core::mem::MaybeUninit<GraphSlot>) {
        let p = slot.as_mut_ptr();
        // SAFETY: `p` is valid for writes of a GraphSlot. Zeroed, the plan (vectors and
        // counters) is empty and the graph becomes empty through `init_zeroed`; the forward
        // pass, which zero bytes need not be, is written.
        unsafe {
            core::ptr::write_bytes(p, 0, 1);
            Addressed::init_zeroed(core::ptr::addr_of_mut!((*p).graph));
            core::ptr::addr_of_mut!((*p).fwd).write(None);
        }
    }

    /// An empty slot.
    pub const fn new() -> Self {
        Self { graph: Addressed::new(), plan: Plan::new(), fwd: None }
    }

    /// The graph, if one was built here.
    pub fn graph(&self) -> Option<&Graph<GRAPH_CAPACITY>> {
        self.fwd.map(|_| self.graph.graph())
    }

    fn holds(&self, n_tokens: usize, n_outputs: usize, input: StepInput) -> bool {
        self.fwd.is_some_and(|f| f.n_tokens == n_tokens && f.n_outputs == n_outputs && f.input == input)
    }
}

impl Default for GraphSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// Most graph slots an engine needs: decode, a full batch, the most outputs, and one for other
/// batch shapes (a partial last chunk of a prompt). [`graph_slots`] says how many a configuration
/// needs.
pub const GRAPH_SLOTS: usize = 4;

/// The batch shapes (tokens, outputs) an engine plans for at start, without repeats.
fn fixed_shapes(n_batch: usize, n_outputs: usize) -> heapless::Vec<(usize, usize), 3> {
    let mut shapes = heapless::Vec::new();
    for shape in [(1, 1), (n_batch, 1), (n_batch, n_outputs)] {
        if !shapes.contains(&shape) {
            let _ = shapes.push(shape);
        }
    }
    shapes
}

/// Graph slots [`Planned::new`] needs for `config`: its fixed shapes and one spare (each slot is
/// about a megabyte, so a single-sequence generation session takes 3, not [`GRAPH_SLOTS`]).
pub fn graph_slots(config: &EngineConfig) -> usize {
    fixed_shapes(config.n_batch.max(1), config.n_outputs.clamp(1, config.n_batch.max(1))).len() + 1
}

/// The bytes an engine needs in caller memory, each part a multiple of [`ARENA_ALIGN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryLayout {
    /// Repacked weights (0 when they are read from the file).
    pub packed: usize,
    /// KV cache and the step's inputs.
    pub kv: usize,
    /// Activations (the largest planned graph's peak).
    pub activations: usize,
    /// The kernels' work area (converted matmul inputs).
    pub work: usize,
}

impl MemoryLayout {
    /// Bytes of caller memory to give [`Planned::bind`], whatever its alignment.
    pub fn bytes_needed(&self) -> usize {
        Arena::bytes_for(self.packed + self.kv + self.activations + self.work)
    }
}

/// Why a sequence of a model with recurrent layers cannot be cut.
const RECURRENT_WHOLE: &str =
    "this model has recurrent layers: a sequence is kept, copied or saved whole, or not at all";

/// Runs a bound graph: [`OnCaller`] on the calling thread, or a pool of threads (std).
pub trait Runner {
    /// Runs every node of `bound` for `step`.
    fn run<const N: usize>(&self, bound: &mut Bound<'_, N>, step: Step) -> Result<(), ExecError>;
}

/// Spreads independent jobs over threads (repacking matrices).
pub trait Parallel {
    /// Calls `job(i)` once for every `i` in `0..n`, in any order, on any threads.
    fn for_each(&self, n: usize, job: &(dyn Fn(usize) + Sync));
}

/// Everything on the calling thread.
#[derive(Debug, Clone, Copy, Default)]
pub struct OnCaller;

impl Runner for OnCaller {
    fn run<const N: usize>(&self, bound: &mut Bound<'_, N>, step: Step) -> Result<(), ExecError> {
        bound.run(step)
    }
}

impl Parallel for OnCaller {
    fn for_each(&self, n: usize, job: &(dyn Fn(usize) + Sync)) {
        (0..n).for_each(job);
    }
}

/// A model planned for a configuration: graphs built, placements and bytes decided, no memory
/// bound yet.
pub struct Planned<'m, G> {
    model: Model<'m>,
    config: EngineConfig,
    kv: KvLayout,
    slots: G,
    /// Slots built at planning, kept for the life of the engine (the others are reused).
    fixed: usize,
    packed: heapless::Vec<PackedEntry, MAX_PACKED>,
    /// The packed planes are pages of the model file (a repack cache).
    prepacked: bool,
    layout: MemoryLayout,
}

impl<'m, G: AsMut<[GraphSlot]> + AsRef<[GraphSlot]>> Planned<'m, G> {
    /// Plans `model` for `config` in `slots` (at least [`graph_slots`]`(config)`).
    pub fn new(model: Model<'m>, config: &EngineConfig, mut slots: G) -> Result<Self, EngineError> {
        let hp = &model.hp;
        let n_ctx = context_size(hp, config.n_ctx)
            .ok_or(EngineError::Config("context size above the model's maximum"))?;
        if config.n_batch == 0 || config.n_seq == 0 || config.n_outputs == 0 {
            return Err(EngineError::Config("batch size, sequences and outputs must be at least 1"));
        }
        if config.n_seq > MAX_SEQ {
            return Err(EngineError::Config("more sequences than the engine holds (64)"));
        }
        let n_batch = config.n_batch.min(n_ctx * config.n_seq);
        let n_outputs = config.n_outputs.min(n_batch);
        let pooling = output_pooling(&model, config.pooling)?;
        let mut model = model;
        model.hp.pooling = pooling;
        let config = EngineConfig { n_ctx, n_batch, n_outputs, pooling, ..*config };
        let hp = &model.hp;
        config.kv_types.check(hp).map_err(EngineError::KvType)?;
        let kv = KvLayout::new(hp, n_ctx, n_batch, config.n_seq, config.kv_types)
            .ok_or(EngineError::Config("context size too large"))?;
        let kv = match config.embeddings_input {
            true => kv
                .with_embeddings_input(hp.n_embd as usize)
                .ok_or(EngineError::Config("context size too large"))?,
            false => kv,
        };

        // Size the activations from the graphs the engine must run: decode (slot 0, also the
        // graph placement reads), a full batch, and the most outputs a batch may ask for.
        let shapes = fixed_shapes(n_batch, n_outputs);
        if slots.as_ref().len() <= shapes.len() {
            return Err(EngineError::Config("too few graph slots (see engine::graph_slots)"));
        }
        let (mut peak, mut work) = (0usize, 0usize);
        for (slot, &(n, outputs)) in slots.as_mut().iter_mut().zip(&shapes) {
            build_into(slot, &model, &kv, n, outputs, StepInput::Tokens)?;
            peak = peak.max(slot.plan.peak_bytes);
            work = work.max(work_bytes(slot.graph.graph()));
        }
        // A step of a few tokens splits its keys (more parts per token than a decode step's
        // threads need), and that work grows with its tokens: the largest such step is sized in
        // the spare slot, which stays free.
        let n_split = crate::exec::most_split_tokens(hp.n_head_kv as usize).min(n_batch);
        if n_split > 1 && !shapes.iter().any(|&(n, _)| n == n_split) {
            let spare = &mut slots.as_mut()[shapes.len()];
            build_into(spare, &model, &kv, n_split, n_split.min(n_outputs), StepInput::Tokens)?;
            peak = peak.max(spare.plan.peak_bytes);
            work = work.max(work_bytes(spare.graph.graph()));
            spare.fwd = None;
        }
        // A full batch of embeddings attending both ways (an image) is built in the spare slot
        // as it will be, so the activations have room for it.
        if config.embeddings_input {
            let spare = &mut slots.as_mut()[shapes.len()];
            build_into(spare, &model, &kv, n_batch, 1, StepInput::Embeddings { causal: false })?;
            peak = peak.max(spare.plan.peak_bytes);
            work = work.max(work_bytes(spare.graph.graph()));
            spare.fwd = None;
        }
        let mut planned = Self {
            model,
            config,
            kv,
            slots,
            fixed: shapes.len(),
            packed: heapless::Vec::new(),
            prepacked: false,
            layout: MemoryLayout {
                packed: 0,
                kv: kv.total_bytes.next_multiple_of(ARENA_ALIGN),
                activations: peak.next_multiple_of(ARENA_ALIGN),
                work: work.next_multiple_of(ARENA_ALIGN),
            },
        };
        planned.plan_repack()?;
        Ok(planned)
    }

    /// Places every matrix the placement repacks at 64-byte aligned offsets of one buffer.
    fn plan_repack(&mut self) -> Result<(), EngineError> {
        let gguf = &self.model.gguf;
        let (packed, bytes) = plan_packed(gguf, |t| self.placement_of(t))?;
        self.packed = packed;
        self.layout.packed = bytes;
        Ok(())
    }

    /// Reads the repacked weights from the model file itself (a repack cache): `entries` give
    /// where each matrix's planes are in the file. Nothing is repacked at bind.
    pub fn with_prepacked(mut self, entries: &[PackedEntry]) -> Result<Self, EngineError> {
        self.packed.clear();
        for e in entries {
            self.packed.push(*e).map_err(|_| EngineError::TooManyMatrices)?;
        }
        self.packed.sort_unstable_by_key(|e| e.source_offset);
        self.prepacked = true;
        self.layout.packed = 0;
        Ok(self)
    }

    /// Where tensor `t` of the file goes: repacked, read in place, or unused (as the decode
    /// graph reads it).
    pub fn placement_of(&self, t: &TensorInfo<'_>) -> Placement {
        let offset = self.model.gguf.data_start() + t.offset as usize;
        let u = placement::use_in(self.slots.as_ref()[0].graph.graph(), offset);
        placement::place(t, u, self.config.repack)
    }

    /// The bytes to bind.
    pub fn layout(&self) -> MemoryLayout {
        self.layout
    }

    /// Where the KV caches, recurrent states and step inputs go.
    pub fn kv_layout(&self) -> &KvLayout {
        &self.kv
    }

    /// The model.
    pub fn model(&self) -> &Model<'m> {
        &self.model
    }

    /// The configuration, with the context size resolved and sizes clamped.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The repacked matrices: where each comes from and where its planes go.
    pub fn packed_entries(&self) -> &[PackedEntry] {
        &self.packed
    }

    /// The built graphs.
    pub fn graphs(&self) -> impl Iterator<Item = &Graph<GRAPH_CAPACITY>> {
        self.slots.as_ref().iter().filter_map(GraphSlot::graph)
    }

    /// Lays the plan out in `memory` (at least [`MemoryLayout::bytes_needed`] bytes, any
    /// contents: every byte the engine reads it wrote first, so fresh pages stay untouched until
    /// used). The repacked weights are filled by [`Engine::repack`].
    pub fn bind<B: DerefMut<Target = [u8]>>(self, mut memory: B) -> Result<Engine<'m, G, B>, EngineError> {
        let skip = memory.as_ptr().align_offset(ARENA_ALIGN);
        let layout = self.layout;
        let mut arena = Arena::new(&mut memory);
        let packed = arena.alloc_unzeroed(layout.packed, "repacked weights").map_err(EngineError::Memory)?;
        let kv = arena.alloc_unzeroed(layout.kv, "KV cache").map_err(EngineError::Memory)?;
        let activations =
            arena.alloc_unzeroed(layout.activations, "activations").map_err(EngineError::Memory)?;
        let work = arena.alloc_unzeroed(layout.work, "work").map_err(EngineError::Memory)?;
        let mut seq_len = heapless::Vec::new();
        let _ = seq_len.resize(self.config.n_seq, 0);
        let mut images = heapless::Vec::new();
        let _ = images.resize(self.config.n_seq, mrope::ImageSpans::default());
        let repacked = self.prepacked || self.packed.is_empty();
        Ok(Engine {
            planned: self,
            memory,
            skip,
            packed,
            kv,
            activations,
            work,
            seq_len,
            images,
            last: None,
            repacked,
        })
    }
}

/// The pooling `model` runs with: an embedding model's `asked` (else its file's, else per
/// token); a generating model has none (it gives logits) and refuses one; `rank` needs a
/// classifier head.
fn output_pooling(model: &Model<'_>, asked: Option<Pooling>) -> Result<Option<Pooling>, EngineError> {
    if !model.hp.embeds() {
        return match asked {
            None => Ok(None),
            Some(_) => Err(EngineError::Output(
                "this model generates text: it has no embedding output to pool (embedding models are encoders such as bert)",
            )),
        };
    }
    let pooling = asked.or(model.hp.pooling).unwrap_or(Pooling::None);
    let has = |name: &str| model.gguf.tensor(name).is_some();
    if pooling == Pooling::Rank && !has("cls.output.weight") && !has("cls.weight") {
        return Err(EngineError::Output(
            "rank pooling needs a classifier head (cls.weight or cls.output.weight), which this model does not have",
        ));
    }
    Ok(Some(pooling))
}

/// Builds and plans the forward graph for `n` tokens and `outputs` logits rows into `slot`.
fn build_into(
    slot: &mut GraphSlot,
    model: &Model<'_>,
    kv: &KvLayout,
    n: usize,
    outputs: usize,
    input: StepInput,
) -> Result<(), EngineError> {
    slot.fwd = None;
    let fwd =
        build_forward(slot.graph.graph_mut(), &model.gguf, &model.hp, kv, n, outputs, model.adapters, input)?;
    slot.plan = plan(slot.graph.graph()).map_err(EngineError::Plan)?;
    slot.fwd = Some(fwd);
    Ok(())
}

/// One token of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Its sequence.
    pub seq: usize,
    /// Its position in the sequence: the sequence's next one.
    pub pos: usize,
    /// The token id.
    pub token: u32,
    /// Whether [`Engine::logits`] returns its logits after the step.
    pub logits: bool,
}

/// A model bound to memory, running steps.
pub struct Engine<'m, G, B> {
    planned: Planned<'m, G>,
    memory: B,
    /// Bytes skipped at the start of `memory` to align the arena (checked at every step: the
    /// memory must not move, which `DerefMut` owners such as boxes and slices guarantee).
    skip: usize,
    packed: Region,
    kv: Region,
    activations: Region,
    work: Region,
    seq_len: heapless::Vec<usize, MAX_SEQ>,
    /// An M-RoPE model's images in each sequence (see [`Engine::place_image`]).
    images: heapless::Vec<mrope::ImageSpans, MAX_SEQ>,
    /// The slot and output count of the last step.
    last: Option<(usize, usize)>,
    repacked: bool,
}

impl<'m, G: AsMut<[GraphSlot]> + AsRef<[GraphSlot]>, B: DerefMut<Target = [u8]>> Engine<'m, G, B> {
    /// Repacks the weight matrices into the bound memory, `jobs` spreading them over threads, and
    /// calls `done` with each matrix's file range as soon as it is packed (the std layer gives
    /// those pages back at once, so the load never holds the file and its repacked copy whole).
    /// (A repack cache, or an engine that repacks nothing, needs no call.)
    pub fn repack(
        &mut self,
        jobs: &impl Parallel,
        done: &(dyn Fn(core::ops::Range<usize>) + Sync),
    ) -> Result<(), EngineError> {
        if self.repacked {
            return Ok(());
        }
        let model = &self.planned.model;
        let region = self.packed;
        let buffer = &mut self.memory[self.skip..][region.offset..region.offset + region.len];
        repack_entries(&self.planned.packed, &|offset| model.source(offset), buffer, jobs, done)?;
        self.repacked = true;
        Ok(())
    }

    /// Runs one batch. Each entry's position must be the next of its sequence (entries of one
    /// sequence in order); logits of the entries that want them are read with [`Self::logits`].
    pub fn step(
        &mut self,
        batch: &[Entry],
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError> {
        self.step_typed(batch, &[], runner, offload)
    }

    /// [`Self::step`] with each entry's token type (a BERT pair's second part is type 1), each
    /// below [`Self::token_types`]; empty: type 0 for every entry, as llama.cpp gives.
    pub fn step_typed(
        &mut self,
        batch: &[Entry],
        token_types: &[u32],
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError> {
        self.run_step(batch, token_types, None, runner, offload)
    }

    /// Evaluates a batch of input embeddings instead of token ids (an image's, from a vision
    /// projector: `rows` holds `n_embd` values per entry; the entries' tokens are not read). With
    /// `causal` false every entry also sees the batch's later entries (Gemma 3's image tokens),
    /// so a bidirectional image must fit in one step. The engine must be planned with
    /// [`EngineConfig::embeddings_input`].
    pub fn step_embeddings(
        &mut self,
        batch: &[Entry],
        rows: &[f32],
        causal: bool,
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError> {
        let n_embd = self.planned.model.hp.n_embd as usize;
        if self.planned.kv.embeddings_input.is_none() {
            return Err(EngineError::Config("this engine was planned without an embeddings input"));
        }
        if rows.len() != batch.len() * n_embd {
            return Err(EngineError::Config("input embeddings must be n_embd values per entry"));
        }
        if rows.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::Config("input embeddings must be finite"));
        }
        self.run_step(batch, &[], Some((rows, causal)), runner, offload)
    }

    fn run_step(
        &mut self,
        batch: &[Entry],
        token_types: &[u32],
        embeddings: Option<(&[f32], bool)>,
        runner: &impl Runner,
        offload: Option<&dyn MatmulOffload>,
    ) -> Result<(), EngineError> {
        let input = match embeddings {
            Some((_, causal)) => StepInput::Embeddings { causal },
            None => StepInput::Tokens,
        };
        // (Only a typed batch looks the types up: the file's tensor table is searched by name.)
        if !token_types.is_empty() {
            if token_types.len() != batch.len() {
                return Err(EngineError::TokenTypesLength { types: token_types.len(), entries: batch.len() });
            }
            let n_types = self.token_types();
            if let Some(entry) = token_types.iter().position(|&t| t as usize >= n_types) {
                return Err(EngineError::BadTokenType { entry, ty: token_types[entry], n_types });
            }
        }
        if !self.repacked {
            return Err(EngineError::NotRepacked);
        }
        let config = self.planned.config;
        let n_vocab = self.planned.model.vocab.n_vocab as usize;
        let pooling = self.planned.model.hp.pooling;
        let wanted = match pooling {
            // An encoder gives one row per sequence when it pools.
            Some(p) if p.pools() => check_encoder_batch(batch, &config, n_vocab)?,
            Some(_) => {
                check_encoder_batch(batch, &config, n_vocab)?;
                batch.iter().filter(|e| e.logits).count()
            }
            None => batch.iter().filter(|e| e.logits).count(),
        };
        if batch.is_empty() || batch.len() > config.n_batch || wanted > config.n_outputs {
            return Err(EngineError::BatchSize { entries: batch.len(), outputs: wanted });
        }
        let mut next = self.seq_len.clone();
        for e in batch.iter().filter(|_| pooling.is_none()) {
            let len =
                next.get_mut(e.seq).ok_or(EngineError::BadSequence { seq: e.seq, n_seq: config.n_seq })?;
            if e.pos != *len {
                return Err(EngineError::BadPosition { seq: e.seq, pos: e.pos, expected: *len });
            }
            if e.pos >= config.n_ctx {
                return Err(EngineError::ContextFull { needed: e.pos + 1, n_ctx: config.n_ctx });
            }
            if embeddings.is_none() && e.token as usize >= n_vocab {
                return Err(EngineError::BadToken { id: e.token, n_vocab });
            }
            *len += 1;
        }
        if embeddings.is_none() && self.planned.kv.mrope_places_offset.is_some() {
            // Text where an image's rows were to go cuts the image short (M-RoPE only: no other
            // model places images).
            for e in batch {
                self.images[e.seq].cut(e.pos);
            }
        }
        // With no logits wanted the graph still computes one row (the last entry's).
        let outputs = if wanted == batch.len() { batch.len() } else { wanted.max(1) };
        let slot = self.slot_for(batch.len(), outputs, input)?;

        let kv = self.planned.kv;
        let (packed_region, arena_start) = (self.packed, self.kv.offset);
        let arena_len = self.work.offset + self.work.len - arena_start;
        let at = |r: Region| Region { offset: r.offset - arena_start, len: r.len };
        let (activations, work) = (at(self.activations), at(self.work));
        let aligned = &mut self.memory[self.skip..];
        let (before, arena) = aligned.split_at_mut(arena_start);
        let arena = &mut arena[..arena_len];
        {
            let (ids, rest) =
                arena[kv.ids_offset..kv.total_bytes].split_at_mut(kv.places_offset - kv.ids_offset);
            let (places, rest) = rest.split_at_mut(kv.outputs_offset - kv.places_offset);
            let rows_len = kv.encoder_inputs.map_or(rest.len(), |e| e.positions_offset - kv.outputs_offset);
            let (rows, encoder) = rest.split_at_mut(rows_len);
            let ids: &mut [i32] = bytemuck::cast_slice_mut(ids);
            let places: &mut [i32] = bytemuck::cast_slice_mut(places);
            let rows: &mut [i32] = bytemuck::cast_slice_mut(rows);
            let mut out = 0;
            for (i, e) in batch.iter().enumerate() {
                ids[i] = e.token as i32;
                places[2 * i] = (e.seq * kv.n_ctx) as i32;
                places[2 * i + 1] = e.pos as i32;
                if pooling.is_none_or(|p| !p.pools()) && (e.logits || (wanted == 0 && i + 1 == batch.len())) {
                    rows[out] = i as i32;
                    out += 1;
                }
            }
            if let (Some(pooling), Some(inputs)) = (pooling, kv.encoder_inputs) {
                let encoder: &mut [i32] = bytemuck::cast_slice_mut(encoder);
                let (positions, rest) =
                    encoder.split_at_mut((inputs.types_offset - inputs.positions_offset) / 4);
                let (types, spans) = rest.split_at_mut((inputs.spans_offset - inputs.types_offset) / 4);
                // Each sequence's span; a pooled output row per sequence (its first token, its
                // last for `last` and for a causal model's `rank`: only the last token has seen
                // the whole input, as llama.cpp picks it).
                let causal = !self.planned.model.hp.arch.traits().bidirectional;
                let last_pooled = pooling == Pooling::Last || (pooling == Pooling::Rank && causal);
                let mut start = 0;
                while start < batch.len() {
                    let len = batch[start..].iter().take_while(|e| e.seq == batch[start].seq).count();
                    for (i, e) in batch.iter().enumerate().skip(start).take(len) {
                        positions[i] = e.pos as i32;
                        types[i] = token_types.get(i).map_or(0, |&t| t as i32);
                        spans[2 * i] = start as i32;
                        spans[2 * i + 1] = len as i32;
                        // (The places of an encoder's tokens name the batch, not a cache.)
                        places[2 * i] = start as i32;
                    }
                    if pooling.pools() {
                        rows[out] = if last_pooled { start + len - 1 } else { start } as i32;
                        out += 1;
                    }
                    start += len;
                }
            }
        }
        if kv.mrope_places_offset.is_some() {
            for axis in 0..3 {
                let at = kv.mrope_places(axis).unwrap_or(0);
                let table: &mut [i32] = bytemuck::cast_slice_mut(&mut arena[at..at + 8 * batch.len()]);
                for (i, e) in batch.iter().enumerate() {
                    table[2 * i] = (e.seq * kv.n_ctx) as i32;
                    table[2 * i + 1] = self.images[e.seq].positions(e.pos)[axis] as i32;
                }
            }
        }
        if let (Some((values, causal)), Some(at)) = (embeddings, kv.embeddings_input) {
            let (rows_end, places_end) = (at.attn_places_offset, at.attn_places_offset + 8 * batch.len());
            let (head, attn_places) = arena.split_at_mut(at.attn_places_offset);
            let dst: &mut [f32] =
                bytemuck::cast_slice_mut(&mut head[at.rows_offset..rows_end][..values.len() * 4]);
            dst.copy_from_slice(values);
            if !causal {
                // Every entry of a sequence attends up to the sequence's last entry of the batch.
                let attn: &mut [i32] =
                    bytemuck::cast_slice_mut(&mut attn_places[..places_end - at.attn_places_offset]);
                for (i, e) in batch.iter().enumerate() {
                    let last = batch.iter().filter(|o| o.seq == e.seq).map(|o| o.pos).max().unwrap_or(e.pos);
                    attn[2 * i] = (e.seq * kv.n_ctx) as i32;
                    attn[2 * i + 1] = last as i32;
                }
            }
        }
        let model = self.planned.model.bytes;
        let packed: &[u8] = if self.planned.prepacked {
            model
        } else {
            &before[packed_region.offset..packed_region.offset + packed_region.len]
        };
        let s = &mut self.planned.slots.as_mut()[slot];
        let mut buffers: heapless::Vec<&[u8], { MAX_ADAPTERS + 1 }> = heapless::Vec::new();
        let _ = buffers.push(model);
        for a in self.planned.model.adapters {
            let _ = buffers.push(a.bytes);
        }
        let mut bound = s
            .graph
            .bind(&s.plan, &buffers, arena, activations, work)?
            .with_packed(packed, &self.planned.packed)
            .with_numerics_check(config.check_numerics)
            .with_kernels(config.kernels);
        if let Some(hook) = offload {
            bound = bound.with_offload(hook);
        }
        let result = runner.run(&mut bound, Step { n_past: 0, n_kv: kv.cache_rows() });
        self.last = None;
        if result.is_err() && self.has_recurrent_layers() {
            // The batch's recurrent states may have moved on: its sequences start over.
            for e in batch {
                self.seq_len[e.seq] = 0;
                self.images[e.seq].cut(0);
            }
        }
        result?;
        self.seq_len = next;
        self.last = Some((slot, if wanted == 0 { 0 } else { outputs }));
        let rows = self.outputs();
        if (0..rows).any(|i| self.output_row(i).is_none_or(|l| l.iter().any(|v| !v.is_finite()))) {
            return Err(EngineError::NonFiniteLogits);
        }
        Ok(())
    }

    /// Whether the model gives embeddings (an encoder), not logits.
    pub fn gives_embeddings(&self) -> bool {
        self.planned.model.hp.pooling.is_some()
    }

    /// Token types the model's embeddings have: the rows of `token_types.weight`, 1 without it.
    pub fn token_types(&self) -> usize {
        self.planned.model.gguf.tensor("token_types.weight").map_or(1, |t| t.ne[1].max(1) as usize)
    }

    /// The pooling of the embeddings, `None` for a generating model.
    pub fn pooling(&self) -> Option<Pooling> {
        self.planned.model.hp.pooling
    }

    /// The `i`-th embedding of the last step of an encoder: the `i`-th sequence's (in batch
    /// order) when it pools, else the `i`-th token's that asked for one. Read in place: `n_embd`
    /// values, or one score per label of a `rank` classifier. `None` for a generating model.
    pub fn embedding(&self, i: usize) -> Option<&[f32]> {
        self.gives_embeddings().then(|| self.output_row(i)).flatten()
    }

    /// Values of each embedding (`n_embd`, or a classifier's labels); 0 for a generating model.
    pub fn embedding_width(&self) -> usize {
        let Some(s) = self.planned.slots.as_ref().first() else { return 0 };
        match (self.gives_embeddings(), s.fwd) {
            (true, Some(fwd)) => s.graph.graph().tensor(fwd.logits).ne[0],
            _ => 0,
        }
    }

    /// Row `i` of the last step's output (logits or embeddings), its width the output's.
    fn output_row(&self, i: usize) -> Option<&[f32]> {
        let (slot, n) = self.last?;
        if i >= n {
            return None;
        }
        let s = &self.planned.slots.as_ref()[slot];
        let fwd = s.fwd?;
        let width = s.graph.graph().tensor(fwd.logits).ne[0];
        let offset = self.skip + self.activations.offset + s.plan.offset(fwd.logits)?;
        let bytes = self.memory.get(offset + i * width * 4..offset + (i + 1) * width * 4)?;
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// The slot holding the graph for `n` tokens and `outputs` logits rows, building it into a
    /// spare slot if needed.
    fn slot_for(&mut self, n: usize, outputs: usize, input: StepInput) -> Result<usize, EngineError> {
        let slots = self.planned.slots.as_mut();
        if let Some(i) = slots.iter().position(|s| s.holds(n, outputs, input)) {
            return Ok(i);
        }
        // The first spare slot that is empty, else the last one (rebuilt).
        let fixed = self.planned.fixed;
        let spare =
            slots[fixed..].iter().position(|s| s.fwd.is_none()).map_or(slots.len() - 1, |i| fixed + i);
        let slot = &mut slots[spare];
        build_into(slot, &self.planned.model, &self.planned.kv, n, outputs, input)?;
        if slot.plan.peak_bytes > self.activations.len || work_bytes(slot.graph.graph()) > self.work.len {
            slot.fwd = None;
            return Err(EngineError::Config("this batch shape does not fit the planned memory"));
        }
        Ok(spare)
    }

    /// Logits rows the last step computed (0 after a failed step or when none was wanted).
    pub fn outputs(&self) -> usize {
        self.last.map_or(0, |(_, n)| n)
    }

    /// The logits of the `i`-th entry of the last step that wanted them (in batch order); `None`
    /// for an encoder (see [`Self::embedding`]).
    pub fn logits(&self, i: usize) -> Option<&[f32]> {
        if self.gives_embeddings() {
            return None;
        }
        self.output_row(i)
    }

    /// Positions sequence `seq` holds.
    pub fn seq_len(&self, seq: usize) -> usize {
        self.seq_len.get(seq).copied().unwrap_or(0)
    }

    /// The rotary position sequence `seq`'s next token takes: its length, but for an M-RoPE
    /// model after an image (which takes its longer side in positions, not its token count).
    pub fn next_position(&self, seq: usize) -> usize {
        let n = self.seq_len(seq);
        self.images.get(seq).map_or(n, |spans| spans.next_position(n))
    }

    /// Says that the next `nx * ny` positions of sequence `seq` will be an image's embeddings
    /// over a grid of `nx` columns and `ny` rows (in raster order), which an M-RoPE model
    /// (Qwen2-VL) turns by their row and column; other models take images as text positions,
    /// and this does nothing for them. Text fed where the image was to go cuts it short.
    pub fn place_image(&mut self, seq: usize, nx: usize, ny: usize) -> Result<(), EngineError> {
        let n_seq = self.planned.config.n_seq;
        if seq >= n_seq {
            return Err(EngineError::BadSequence { seq, n_seq });
        }
        if !self.planned.model.hp.arch.traits().mrope {
            return Ok(());
        }
        if nx == 0 || ny == 0 || nx.checked_mul(ny).is_none() {
            return Err(EngineError::Config("an image's grid needs at least one row and one column"));
        }
        let start = self.seq_len[seq];
        if !self.images[seq].place(start, nx, ny) {
            return Err(EngineError::Config("a sequence of an M-RoPE model holds at most 16 images"));
        }
        Ok(())
    }

    /// Forgets sequence `seq` from position `n` on (0: empties it) and returns the positions it
    /// keeps: `n` or fewer. A model with recurrent layers keeps no earlier state than its last, so
    /// cutting a sequence short empties it (llama.cpp's recurrent memory refuses the same cut and
    /// its callers start over): the caller evaluates from the returned position.
    #[must_use = "a recurrent model may keep fewer positions than asked"]
    pub fn truncate(&mut self, seq: usize, n: usize) -> usize {
        let recurrent = self.has_recurrent_layers();
        let Some(len) = self.seq_len.get_mut(seq) else { return 0 };
        if n < *len {
            *len = if recurrent { 0 } else { n };
        }
        self.images[seq].cut(*len);
        *len
    }

    /// Whether some layers carry a recurrent state instead of a KV cache (whose sequences can
    /// only be kept whole or emptied).
    pub fn has_recurrent_layers(&self) -> bool {
        self.planned.kv.recurrent.count() > 0
    }

    /// Makes sequence `dst` the first `n` positions of sequence `src` (a prompt computed once,
    /// continued in several sequences). Copies the cache rows of every layer.
    pub fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<(), EngineError> {
        let n_seq = self.planned.config.n_seq;
        for seq in [src, dst] {
            if seq >= n_seq {
                return Err(EngineError::BadSequence { seq, n_seq });
            }
        }
        let have = self.seq_len[src];
        if n > have {
            return Err(EngineError::BadPosition { seq: src, pos: n, expected: have });
        }
        if self.has_recurrent_layers() && n != have && n != 0 {
            return Err(EngineError::Config(RECURRENT_WHOLE));
        }
        if src != dst {
            let kv = self.planned.kv;
            let cache = &mut self.memory[self.skip + self.kv.offset..][..kv.total_bytes];
            for layer in kv.cached_layers() {
                for (base, row) in kv.layer_caches(layer) {
                    let from = base + src * kv.n_ctx * row;
                    cache.copy_within(from..from + n * row, base + dst * kv.n_ctx * row);
                }
            }
            for ((from, bytes), (to, _)) in kv.sequence_states(src).zip(kv.sequence_states(dst)) {
                cache.copy_within(from..from + bytes, to);
            }
        }
        self.seq_len[dst] = n;
        let mut images = self.images[src].clone();
        images.cut(n);
        self.images[dst] = images;
        Ok(())
    }

    /// Context shift (llama.cpp's): drops positions `keep..keep + discard` of sequence `seq` and
    /// moves the later ones down by `discard`, re-rotating their cached keys by `-discard`
    /// positions (RoPE of a position difference composes), so the sequence goes on as if those
    /// tokens had never been there. The keys are rotated in f32 from their cached copies and
    /// stored in the cache's type again, as llama.cpp's K-shift does. Recurrent states are kept
    /// as they are (they hold what they have seen, as in llama.cpp).
    pub fn shift_sequence(&mut self, seq: usize, keep: usize, discard: usize) -> Result<(), EngineError> {
        let n = self.seq_len(seq);
        self.check_sequence(seq, n, n)?;
        if keep.checked_add(discard).is_none_or(|end| end > n) {
            return Err(EngineError::Config("the context shift drops positions the sequence does not hold"));
        }
        if discard == 0 {
            return Ok(());
        }
        if !self.images[seq].is_empty() {
            // (llama.cpp shifts no M-RoPE cache at all; text alone rotates by its rows here.)
            return Err(EngineError::Config(
                "the context shift cannot move an image's M-RoPE positions: start a new conversation",
            ));
        }
        let kv = self.planned.kv;
        let hp = &self.planned.model.hp;
        let n_head_kv = hp.n_head_kv as usize;
        let k_ty = kv.types.k;
        let (Some(widen), Some(store)) = (k_ty.traits().dequantize, k_ty.kv_writer()) else {
            return Err(EngineError::Config("the context shift cannot rewrite this cache type"));
        };
        let neox = matches!(hp.arch.traits().rope, crate::graph::RopeMode::Neox);
        let gguf = &self.planned.model.gguf;
        let all_factors: Option<&[f32]> = gguf
            .tensor(crate::model::rope_factors_name(hp, kv.n_ctx))
            .and_then(|t| bytemuck::try_cast_slice(gguf.tensor_data(&t)).ok());
        let moved = keep..n - discard;
        let cache = &mut self.memory[self.skip + self.kv.offset..][..kv.total_bytes];
        let (mut cos, mut sin) = ([0f32; 256], [0f32; 256]);
        let (mut x, mut y) = ([0f32; 512], [0f32; 512]);
        for layer in kv.cached_layers() {
            for (base, row) in kv.layer_caches(layer) {
                let at = base + seq * kv.n_ctx * row;
                cache.copy_within(at + (keep + discard) * row..at + n * row, at + keep * row);
            }
            let rope = crate::model::layer_rope(hp, layer);
            if !rope.rotates {
                // Keys stored without RoPE stay as they are (their rows moved above).
                continue;
            }
            let (hd, n_rot) = (hp.head_dim_k_at(layer) as usize, rope.n_rot);
            if n_rot / 2 > cos.len() || hd > x.len() || n_rot > hd {
                return Err(EngineError::Config("the context shift supports heads of up to 512 dimensions"));
            }
            let head_bytes = k_ty.bytes_for(hd as u64).unwrap_or(0) as usize;
            let rotation = kv.types.k_rotation(hd as u32);
            // (The file's frequency factors belong to full-attention layers.)
            let factors = all_factors.filter(|f| !rope.sliding && f.len() >= n_rot / 2);
            let p = crate::kernels::reference::RopeParams {
                n_rot,
                neox,
                freq_base: rope.base,
                freq_scale: rope.scale,
                freq_factors: factors,
                yarn: rope.yarn,
            };
            // The angles of position `discard`, negated: cos is even, sin odd.
            crate::kernels::reference::rope_table_ref(
                discard,
                &p,
                0,
                &mut cos[..n_rot / 2],
                &mut sin[..n_rot / 2],
            );
            sin[..n_rot / 2].iter_mut().for_each(|s| *s = -*s);
            let row = kv.rows_of(layer).k_row_bytes;
            let keys = kv.k_offset(layer) + seq * kv.n_ctx * row;
            for r in moved.clone() {
                for h in 0..n_head_kv {
                    let head = &mut cache[keys + r * row + h * head_bytes..][..head_bytes];
                    if !widen(head, &mut x[..hd]) {
                        return Err(EngineError::Config("the context shift cannot rewrite this cache type"));
                    }
                    if let Some(n) = rotation {
                        // Rotated keys: back to RoPE's basis first (the rotation is its own inverse).
                        crate::kernels::reference::hadamard_ref(&x[..hd], &mut y[..hd], n);
                        x[..hd].copy_from_slice(&y[..hd]);
                    }
                    crate::kernels::reference::rope_pairs_ref(
                        &x[..hd],
                        &mut y[..hd],
                        0,
                        &cos[..n_rot / 2],
                        &sin[..n_rot / 2],
                        &p,
                    );
                    // Dimensions past the rotated ones keep their values; a head is stored
                    // whole (a quantized one is quantized again, as llama.cpp's K-shift does).
                    y[n_rot..hd].copy_from_slice(&x[n_rot..hd]);
                    if let Some(n) = rotation {
                        crate::kernels::reference::hadamard_ref(&y[..hd], &mut x[..hd], n);
                        y[..hd].copy_from_slice(&x[..hd]);
                    }
                    store(&y[..hd], head);
                }
            }
        }
        self.seq_len[seq] = n - discard;
        Ok(())
    }

    /// Bytes [`read_sequence`](Self::read_sequence) gives for `n` positions: the cache rows, and
    /// the recurrent states when `n > 0`.
    pub fn sequence_bytes(&self, n: usize) -> usize {
        let kv = &self.planned.kv;
        let rows = n * kv.position_bytes();
        rows + if n > 0 { kv.sequence_states(0).map(|(_, bytes)| bytes).sum() } else { 0 }
    }

    /// Calls `each` with the cache rows of the first `n` positions of sequence `seq`, layer by
    /// layer, K then V, then each recurrent layer's state (what a saved slot holds). A model with
    /// recurrent layers gives whole sequences only.
    pub fn read_sequence(
        &self,
        seq: usize,
        n: usize,
        each: &mut dyn FnMut(&[u8]),
    ) -> Result<(), EngineError> {
        self.check_sequence(seq, n, self.seq_len(seq))?;
        if self.has_recurrent_layers() && n != self.seq_len(seq) && n != 0 {
            return Err(EngineError::Config(RECURRENT_WHOLE));
        }
        if self.images[seq].starts_before(n) {
            return Err(EngineError::Config(
                "the cache rows of an M-RoPE model's image are not saved (their positions are not in them)",
            ));
        }
        let kv = self.planned.kv;
        let cache = &self.memory[self.skip + self.kv.offset..][..kv.total_bytes];
        for layer in kv.cached_layers() {
            for (base, row) in kv.layer_caches(layer) {
                let from = base + seq * kv.n_ctx * row;
                each(&cache[from..from + n * row]);
            }
        }
        if n > 0 {
            for (from, bytes) in kv.sequence_states(seq) {
                each(&cache[from..from + bytes]);
            }
        }
        Ok(())
    }

    /// Makes sequence `seq` hold `n` positions whose cache rows are `bytes`, as
    /// [`read_sequence`](Self::read_sequence) gave them.
    pub fn write_sequence(&mut self, seq: usize, n: usize, bytes: &[u8]) -> Result<(), EngineError> {
        self.check_sequence(seq, n, self.planned.kv.n_ctx)?;
        if bytes.len() != self.sequence_bytes(n) {
            return Err(EngineError::Config("the saved cache rows do not match this model's cache"));
        }
        let kv = self.planned.kv;
        self.images[seq] = mrope::ImageSpans::default();
        if n == 0 {
            self.seq_len[seq] = 0;
            return Ok(());
        }
        let cache = &mut self.memory[self.skip + self.kv.offset..][..kv.total_bytes];
        let mut rest = bytes;
        for layer in kv.cached_layers() {
            for (base, row) in kv.layer_caches(layer) {
                let from = base + seq * kv.n_ctx * row;
                let (chunk, after) = rest.split_at(n * row);
                cache[from..from + n * row].copy_from_slice(chunk);
                rest = after;
            }
        }
        for (from, bytes) in kv.sequence_states(seq) {
            let (chunk, after) = rest.split_at(bytes);
            cache[from..from + bytes].copy_from_slice(chunk);
            rest = after;
        }
        self.seq_len[seq] = n;
        Ok(())
    }

    /// `seq` is a sequence and `n` at most `limit` positions.
    fn check_sequence(&self, seq: usize, n: usize, limit: usize) -> Result<(), EngineError> {
        let n_seq = self.planned.config.n_seq;
        if seq >= n_seq {
            return Err(EngineError::BadSequence { seq, n_seq });
        }
        if n > limit {
            return Err(EngineError::ContextFull { needed: n, n_ctx: limit });
        }
        Ok(())
    }

    /// The plan this engine runs.
    pub fn planned(&self) -> &Planned<'m, G> {
        &self.planned
    }

    /// The KV layout (context per sequence, sequences, batch).
    pub fn kv_layout(&self) -> &KvLayout {
        &self.planned.kv
    }

    /// The bound memory (the arena, the repacked weights among it), for locking it in RAM.
    pub fn memory(&self) -> &[u8] {
        &self.memory
    }

    /// The repacked weights: the bound buffer, or the model file for a repack cache.
    pub fn packed_buffer(&self) -> &[u8] {
        if self.planned.prepacked {
            return self.planned.model.bytes;
        }
        let r = self.packed;
        &self.memory[self.skip + r.offset..self.skip + r.offset + r.len]
    }
}

/// Checks an encoder's batch (each sequence whole from position 0, its tokens consecutive, no
/// sequence twice, positions within the context, tokens in the vocabulary) and returns its
/// sequences.
fn check_encoder_batch(batch: &[Entry], config: &EngineConfig, n_vocab: usize) -> Result<usize, EngineError> {
    let mut seen = [false; MAX_SEQ];
    let mut sequences = 0;
    for (i, e) in batch.iter().enumerate() {
        let starts = i == 0 || batch[i - 1].seq != e.seq;
        let in_place = if starts { e.pos == 0 } else { e.pos == batch[i - 1].pos + 1 };
        let Some(seen_before) = seen.get_mut(e.seq).filter(|_| e.seq < config.n_seq) else {
            return Err(EngineError::BadSequence { seq: e.seq, n_seq: config.n_seq });
        };
        if !in_place || (starts && *seen_before) {
            return Err(EngineError::EncoderBatch { entry: i });
        }
        if e.pos >= config.n_ctx {
            return Err(EngineError::ContextFull { needed: e.pos + 1, n_ctx: config.n_ctx });
        }
        if e.token as usize >= n_vocab {
            return Err(EngineError::BadToken { id: e.token, n_vocab });
        }
        *seen_before = true;
        sequences += starts as usize;
    }
    Ok(sequences)
}

/// Bytes of a matrix's source packed at a time: its pages can be given back after each chunk,
/// so a load never holds much more than the repacked weights.
const REPACK_CHUNK_BYTES: usize = 4 << 20;

/// Packs matrix `e` (source `src`, type `ty`) into its planes a chunk of row groups at a time
/// (groups are contiguous in both planes), calling `done` with each chunk's range in `src`.
fn pack_in_chunks(
    ty: GgmlType,
    src: &[u8],
    e: &PackedEntry,
    quants: &mut [u8],
    scales: &mut [u8],
    done: &dyn Fn(core::ops::Range<usize>),
) -> bool {
    let row_bytes = src.len() / e.rows.max(1);
    if row_bytes == 0 || row_bytes * e.rows != src.len() {
        return false;
    }
    let chunk = (REPACK_CHUNK_BYTES / row_bytes / GROUP_ROWS).max(1) * GROUP_ROWS;
    let mut r0 = 0;
    while r0 < e.rows {
        let r1 = (r0 + chunk).min(e.rows);
        let (q0, s0) = packed_bytes(e.format, r0, e.k);
        let (qn, sn) = packed_bytes(e.format, r1 - r0, e.k);
        let (Some(src_rows), Some(q), Some(s)) = (
            src.get(r0 * row_bytes..r1 * row_bytes),
            quants.get_mut(q0..q0 + qn),
            scales.get_mut(s0..s0 + sn),
        ) else {
            return false;
        };
        if pack(ty, src_rows, r1 - r0, e.k, q, s).is_err() {
            return false;
        }
        done(r0 * row_bytes..r1 * row_bytes);
        r0 = r1;
    }
    true
}

/// The repacked-weight buffer shared by repacking jobs, each writing its own planes.
/// The matrices of `gguf` that `placement` repacks, at 64-byte aligned offsets of one buffer
/// (sorted by their offset in the file), and the buffer's bytes.
pub(crate) fn plan_packed(
    gguf: &Gguf<'_>,
    placement: impl Fn(&TensorInfo<'_>) -> Placement,
) -> Result<(heapless::Vec<PackedEntry, MAX_PACKED>, usize), EngineError> {
    let mut packed = heapless::Vec::new();
    let mut at = 0usize;
    for t in gguf.tensors() {
        let Buffer::Repacked(format) = placement(&t).buffer else { continue };
        // Experts `[k, m, n_expert]` are one matrix of m * n_expert rows.
        let (k, rows) = (t.ne[0] as usize, (t.ne[1] * t.ne[2] * t.ne[3]) as usize);
        let offset = gguf.data_start() + t.offset as usize;
        let (qn, sn) = packed_bytes(format, rows, k);
        let quants_at = at;
        let scales_at = (quants_at + qn).next_multiple_of(ARENA_ALIGN);
        at = (scales_at + sn).next_multiple_of(ARENA_ALIGN);
        let entry = PackedEntry { source_offset: offset, format, rows, k, quants_at, scales_at };
        packed.push(entry).map_err(|_| EngineError::TooManyMatrices)?;
    }
    packed.sort_unstable_by_key(|e| e.source_offset);
    Ok((packed, at))
}

/// Repacks the matrices `entries` name into `buffer` (as [`plan_packed`] placed them), each
/// from `source(offset)` (its type and file bytes), `jobs` spreading them over threads; `done`
/// gets each matrix's file range as soon as it is packed.
pub(crate) fn repack_entries<'s>(
    entries: &[PackedEntry],
    source: &(dyn Fn(usize) -> Option<(GgmlType, &'s [u8])> + Sync),
    buffer: &mut [u8],
    jobs: &impl Parallel,
    done: &(dyn Fn(core::ops::Range<usize>) + Sync),
) -> Result<(), EngineError> {
    let planes = Planes { ptr: buffer.as_mut_ptr(), len: buffer.len() };
    let failed = core::sync::atomic::AtomicUsize::new(usize::MAX);
    jobs.for_each(entries.len(), &|i| {
        let e = &entries[i];
        let (qn, sn) = packed_bytes(e.format, e.rows, e.k);
        // Entries are planned at disjoint ranges, in order: job i owns its two planes.
        let ok = match (source(e.source_offset), planes.get(e.quants_at, qn), planes.get(e.scales_at, sn)) {
            (Some((ty, src)), Some(quants), Some(scales)) => {
                pack_in_chunks(ty, src, e, quants, scales, &|r: core::ops::Range<usize>| {
                    done(e.source_offset + r.start..e.source_offset + r.end)
                })
            }
            _ => false,
        };
        if !ok {
            failed.fetch_min(e.source_offset, core::sync::atomic::Ordering::Relaxed);
        }
    });
    match failed.into_inner() {
        usize::MAX => Ok(()),
        offset => Err(EngineError::Repack { offset }),
    }
}

struct Planes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: jobs write disjoint ranges (one matrix's planes each, planned apart), so sharing the
// pointer between threads races on nothing.
unsafe impl Sync for Planes {}

impl Planes {
    /// The `len` bytes at `at`.
    #[allow(clippy::mut_from_ref)]
    fn get(&self, at: usize, len: usize) -> Option<&mut [u8]> {
        if at.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds (checked above) of a buffer borrowed mutably for the whole repack;
        // only the job that owns this matrix asks for its planes, once.
        Some(unsafe { core::slice::from_raw_parts_mut(self.ptr.add(at), len) })
    }
}
