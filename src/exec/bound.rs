//! The bound graph: every tensor's address, the dispatch of a node to its op, the numerics
//! check, and the read/write helpers the ops use.

use core::marker::PhantomData;
use core::ops::Range;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use half::f16;

use crate::arena::Region;
use crate::graph::{Graph, Op, Plan};
use crate::kernels;
use crate::kernels::packed::PackedFormat;
use crate::kernels::packed::PackedMatrix;
use crate::quant::GgmlType;
use crate::tensor::{Storage, Tensor, TensorId};

use super::work::work_bytes;
use super::{ExecError, MatmulOffload};

/// Per-step values: the graph's shape is fixed, these change from one token to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Step {
    /// Tokens already in the KV cache (position of this batch's first token).
    pub n_past: usize,
    /// KV length attention reads this step (`n_past + n_tokens`).
    pub n_kv: usize,
}

/// A weight matrix repacked at load: where its planes are in the packed buffer, keyed by the
/// offset of the original tensor in the model buffer (buffer 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedEntry {
    /// Byte offset of the original tensor's data in model buffer 0.
    pub source_offset: usize,
    /// Layout of the planes.
    pub format: PackedFormat,
    /// Rows and elements per row.
    pub rows: usize,
    /// Elements per row.
    pub k: usize,
    /// Start of the quant plane in the packed buffer (its length follows from the shape).
    pub quants_at: usize,
    /// Start of the scale plane in the packed buffer.
    pub scales_at: usize,
}

impl PackedEntry {
    /// The matrix inside `buffer`, if the planes lie inside it.
    pub fn matrix<'b>(&self, buffer: &'b [u8]) -> Option<PackedMatrix<'b>> {
        let (qn, sn) = crate::kernels::packed::packed_bytes(self.format, self.rows, self.k);
        let quants = buffer.get(self.quants_at..self.quants_at.checked_add(qn)?)?;
        let scales = buffer.get(self.scales_at..self.scales_at.checked_add(sn)?)?;
        Some(PackedMatrix { format: self.format, rows: self.rows, k: self.k, quants, scales })
    }
}

/// Most caller buffers a graph reads (the model's and its adapters').
const MAX_BUFFERS: usize = 16;
/// The arena's index among the memories an [`Address`] names (the buffers are `0..MAX_BUFFERS`).
const ARENA: usize = MAX_BUFFERS;
/// How many memories an [`Address`] can name (a power of two, so a memory index from an address
/// is always inside [`Bound`]'s bases without a check); the last, never a buffer or the arena,
/// has a null base, the one [`Address::NOWHERE`] names.
const MEMORIES: usize = 32;
const NO_MEMORY: usize = MEMORIES - 1;
const _: () = assert!(ARENA < NO_MEMORY && MEMORIES.is_power_of_two());

/// Where a tensor's data starts: a memory (a caller's buffer or the arena) and a byte offset in
/// it, in one word (the memory in the top byte), so a bound graph's table is as small as a table
/// of pointers. The caller holds the table ([`Bound::new`]), so binding a graph of any capacity
/// takes no stack for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Address(u64);

impl Address {
    const OFFSET_BITS: u32 = 56;
    /// No data (a tensor outside the built order); a table's entries before binding. Offset 0
    /// in the memory with a null base: its address is null with no test.
    pub const NOWHERE: Self = Self((NO_MEMORY as u64) << Self::OFFSET_BITS);

    fn new(memory: usize, offset: usize) -> Option<Self> {
        let offset = u64::try_from(offset).ok().filter(|&o| o < 1 << Self::OFFSET_BITS)?;
        Some(Self((memory as u64) << Self::OFFSET_BITS | offset))
    }

    /// The memory (below [`MEMORIES`]) and the offset.
    fn parts(self) -> (usize, usize) {
        let memory = (self.0 >> Self::OFFSET_BITS) as usize % MEMORIES;
        (memory, (self.0 & ((1 << Self::OFFSET_BITS) - 1)) as usize)
    }

    /// The memory and the offset, or `None` for [`Self::NOWHERE`].
    fn get(self) -> Option<(usize, usize)> {
        (self != Self::NOWHERE).then(|| self.parts())
    }
}

/// The memory a graph's addresses were resolved in: each buffer's length, the arena's, and the
/// arena's activation and work regions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Memory {
    buffers: heapless::Vec<usize, MAX_BUFFERS>,
    arena: usize,
    activations: Region,
    work: Region,
}

impl Memory {
    fn of(buffers: &[&[u8]], arena: usize, activations: Region, work: Region) -> Self {
        Self {
            buffers: buffers.iter().take(MAX_BUFFERS).map(|b| b.len()).collect(),
            arena,
            activations,
            work,
        }
    }
}

/// Resolves where every tensor of `graph` lies in `memory` (model buffers, arena) into `at` (one
/// entry a tensor) and checks that each lies inside its memory; after that, kernels run blind.
fn resolve<const N: usize>(
    graph: &Graph<N>,
    plan: &Plan<N>,
    memory: &Memory,
    at: &mut [Address],
) -> Result<(), ExecError> {
    let (activations, work, arena) = (memory.activations, memory.work, memory.arena);
    let needed = work_bytes(graph);
    if work.len < needed || work.offset.checked_add(work.len).is_none_or(|e| e > arena) {
        return Err(ExecError::WorkTooSmall { needed });
    }
    let act_end = activations.offset.checked_add(activations.len);
    if act_end.is_none_or(|e| e > arena) || activations.len < plan.peak_bytes {
        return Err(ExecError::OutOfBounds {
            name: heapless::String::new(),
            memory: "arena (activation region)",
        });
    }
    let at = at
        .get_mut(..graph.tensors().len())
        .ok_or(ExecError::AddressTableTooSmall { needed: graph.tensors().len() })?;
    at.fill(Address::NOWHERE);
    for &id in graph.order() {
        let t = graph.tensor(id);
        let out_of = |memory| ExecError::OutOfBounds { name: t.name.clone(), memory };
        let (mem, mem_len, start, name): (usize, usize, usize, &'static str) = match t.storage {
            Storage::External { buffer, offset } => {
                let len = memory.buffers.get(buffer as usize).ok_or(out_of("buffer table"))?;
                (buffer as usize, *len, offset, "model buffer")
            }
            Storage::Persistent { offset } => (ARENA, arena, offset, "arena"),
            Storage::Activation => {
                let off = plan.offset(id).ok_or(ExecError::Unplanned { name: t.name.clone() })?;
                (ARENA, arena, activations.offset + off, "arena (activation region)")
            }
            Storage::View { base: viewed, offset } => {
                // Views are checked against the root they view, resolved before them.
                let root = root_of(graph, viewed);
                let (root_at, root_span) = (at[root.0.index()].get(), graph.tensor(root.0).span_bytes());
                let view_start = root.1 + offset;
                let Some((mem, root_start)) = root_at else { return Err(out_of("viewed tensor")) };
                if view_start.checked_add(t.span_bytes()).is_none_or(|e| e > root_span) {
                    return Err(out_of("viewed tensor"));
                }
                at[id.index()] = Address::new(mem, root_start + view_start).ok_or(out_of("viewed tensor"))?;
                continue;
            }
        };
        if start.checked_add(t.span_bytes()).is_none_or(|e| e > mem_len) {
            return Err(out_of(name));
        }
        at[id.index()] = Address::new(mem, start).ok_or(out_of(name))?;
    }
    Ok(())
}

/// A graph and its tensors' addresses, resolved once for the memory it runs in: each
/// [`Addressed::bind`] (a step) resolves them again only if the graph or the memory changed.
pub struct Addressed<const N: usize> {
    graph: Graph<N>,
    at: heapless::Vec<Address, N>,
    /// The memory `at` holds the addresses in (`None`: not resolved since the graph changed).
    memory: Option<Memory>,
}

impl<const N: usize> Addressed<N> {
    /// Makes the zeroed memory at `this` an empty graph in place (a graph is about a megabyte:
    /// built as a value it would pass through the stack).
    ///
    /// # Safety
    /// `this` must point to writable memory for a `Self` whose bytes are all zero.
    pub unsafe fn init_zeroed(this: *mut Self) {
        // SAFETY: the caller gives zeroed memory for a Self. Its `heapless::Vec`s (in the graph
        // too) are a length and uninitialised storage: zero bytes are an empty vector whatever
        // the field order; the one field zero may not be is written here.
        unsafe { core::ptr::addr_of_mut!((*this).memory).write(None) };
    }

    /// An empty graph.
    pub const fn new() -> Self {
        Self { graph: Graph::new(), at: heapless::Vec::new(), memory: None }
    }

    /// The graph.
    pub fn graph(&self) -> &Graph<N> {
        &self.graph
    }

    /// The graph to build or change; the next bind resolves its addresses again.
    pub fn graph_mut(&mut self) -> &mut Graph<N> {
        self.memory = None;
        &mut self.graph
    }

    /// [`Bound::new`] over addresses resolved once: only the first bind after the graph changed,
    /// or one to memory of other lengths or regions, resolves them (with `plan`, the graph's).
    pub fn bind<'a>(
        &'a mut self,
        plan: &Plan<N>,
        buffers: &[&'a [u8]],
        arena: &'a mut [u8],
        activations: Region,
        work: Region,
    ) -> Result<Bound<'a, N>, ExecError> {
        let memory = Memory::of(buffers, arena.len(), activations, work);
        if self.memory.as_ref() != Some(&memory) {
            self.memory = None;
            self.at.clear();
            // The graph holds at most N tensors, so the table has room for each.
            let _ = self.at.resize(self.graph.tensors().len(), Address::NOWHERE);
            resolve(&self.graph, plan, &memory, &mut self.at)?;
            self.memory = Some(memory.clone());
        }
        let this: &'a Self = self;
        Ok(Bound::over(&this.graph, &this.at, &memory, buffers, arena))
    }
}

impl<const N: usize> Default for Addressed<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// A graph bound to its memory, ready to run.
pub struct Bound<'a, const N: usize> {
    pub(super) graph: &'a Graph<N>,
    /// Each tensor's address (resolved once, when the graph was bound to memory of this shape),
    /// in the caller's table or an [`Addressed`]'s.
    at: &'a [Address],
    /// The start of each memory an address names: the caller's buffers, then the arena.
    /// ([`NO_MEMORY`]'s and the unused ones null.)
    bases: [*mut u8; MEMORIES],
    /// Converted matmul inputs (shared by all threads of a node).
    pub(super) converted: *mut u8,
    pub(super) converted_len: usize,
    /// First run-time error seen by any thread (0 = none, else 1 + index into the order).
    error: AtomicU32,
    error_kind: AtomicU32,
    /// Repacked weights (sorted by `source_offset`) and the buffer holding them.
    pub(super) packed: &'a [PackedEntry],
    pub(super) packed_buffer: &'a [u8],
    /// Optional hook running some matmuls elsewhere (the NPU).
    pub(super) offload: Option<&'a dyn MatmulOffload>,
    /// Check every node's output for NaN/infinity.
    check_numerics: bool,
    /// The kernels every node runs on.
    pub(super) path: kernels::KernelPath,
    /// f16 matmuls of several tokens run as the encoder's GEMM (`kernels::f16_gemm`: one chain
    /// of sums per output), not as tiles of the one-token dot: for graphs without a one-token
    /// twin whose numbers they must share.
    pub(super) f16_gemm: bool,
    /// The packed matmul's kernel per format on `path` (chosen once, from its table).
    pub(super) matmul: kernels::matmul::MatmulKernels,
    /// First node with a non-finite output (0 = none, else 1 + tensor id), the element's flat
    /// index and whether it is a NaN.
    non_finite: AtomicU32,
    non_finite_index: AtomicUsize,
    non_finite_nan: AtomicU32,
    _memory: PhantomData<&'a mut [u8]>,
}

// SAFETY: the raw pointers address memory borrowed for 'a (the PhantomData ties it). During
// `compute`, threads read sources (finished before the previous barrier) and each writes only its
// own share of the node's rows and its own slice of the work region; no two threads write the
// same bytes, and no thread reads bytes another writes during the same node.
unsafe impl<const N: usize> Sync for Bound<'_, N> {}
// SAFETY: as above; nothing in Bound is tied to the thread that created it.
unsafe impl<const N: usize> Send for Bound<'_, N> {}

impl<'a, const N: usize> Bound<'a, N> {
    /// Binds a built, planned graph: `buffers` back `Storage::External` tensors (read-only: model
    /// weights, token ids), `arena` holds persistent tensors at their offsets, `activations` and
    /// `work` are regions of it (from the plan and [`work_bytes`]). Every address is resolved
    /// here, into `addresses`: the caller's table of at least one [`Address`] a tensor
    /// (`graph.tensors().len()`; a `Vec` in std, a static or arena carving on bare metal), so a
    /// graph of any capacity binds on any stack. [`Addressed::bind`] resolves them once for many
    /// steps.
    pub fn new(
        graph: &'a Graph<N>,
        plan: &Plan<N>,
        buffers: &[&'a [u8]],
        arena: &'a mut [u8],
        activations: Region,
        work: Region,
        addresses: &'a mut [Address],
    ) -> Result<Self, ExecError> {
        let memory = Memory::of(buffers, arena.len(), activations, work);
        resolve(graph, plan, &memory, addresses)?;
        Ok(Self::over(graph, &addresses[..graph.tensors().len()], &memory, buffers, arena))
    }

    /// The bound graph over addresses `at`, resolved in `memory`: the lengths and regions of
    /// `buffers` and `arena`.
    fn over(
        graph: &'a Graph<N>,
        at: &'a [Address],
        memory: &Memory,
        buffers: &[&'a [u8]],
        arena: &'a mut [u8],
    ) -> Self {
        let mut bases = [core::ptr::null_mut(); MEMORIES];
        for (base, buffer) in bases[..MAX_BUFFERS].iter_mut().zip(buffers) {
            *base = buffer.as_ptr() as *mut u8;
        }
        bases[ARENA] = arena.as_mut_ptr();
        Self {
            graph,
            at,
            bases,
            // The work region lies inside the arena (checked by `resolve`).
            converted: bases[ARENA].wrapping_add(memory.work.offset),
            converted_len: memory.work.len,
            error: AtomicU32::new(0),
            error_kind: AtomicU32::new(0),
            packed: &[],
            packed_buffer: &[],
            offload: None,
            check_numerics: false,
            path: kernels::KernelPath::detect(),
            f16_gemm: false,
            matmul: kernels::matmul::MatmulKernels::new(kernels::KernelPath::detect()),
            non_finite: AtomicU32::new(0),
            non_finite_index: AtomicUsize::new(0),
            non_finite_nan: AtomicU32::new(0),
            _memory: PhantomData,
        }
    }

    /// Where tensor `id`'s data starts (null for a tensor without data).
    /// (The ops ask for every row they read or write: a load, a shift and an add.)
    #[inline]
    pub(super) fn address(&self, id: TensorId) -> *mut u8 {
        let Some(&at) = self.at.get(id.index()) else { return core::ptr::null_mut() };
        // Inside the memory's checked length (see `resolve`); NOWHERE's base is null.
        let (memory, offset) = at.parts();
        self.bases[memory].wrapping_add(offset)
    }

    /// Checks every node's output for NaN and infinity and stops the run at the first node that
    /// has one (an [`ExecError::NonFinite`] naming it). Off by default; when off it costs nothing
    /// but a branch per node.
    pub fn with_numerics_check(mut self, on: bool) -> Self {
        self.check_numerics = on;
        self
    }
    /// Runs the kernels of `path` (default: [`kernels::KernelPath::detect`]); a path this CPU
    /// lacks runs the reference kernels.
    pub fn with_kernels(mut self, path: kernels::KernelPath) -> Self {
        self.path = path;
        self.matmul = kernels::matmul::MatmulKernels::new(path);
        self
    }
    /// Runs the f16 matmuls of several tokens as the encoder's GEMM (`kernels::f16_gemm`), whose
    /// sums are not in the one-token dot's order: for an encoder's graph, never for a decoder's
    /// (a prompt's tokens must give what they would give one at a time).
    pub fn with_f16_gemm(mut self, on: bool) -> Self {
        self.f16_gemm = on;
        self
    }
    /// The kernel path nodes run on.
    pub fn kernels(&self) -> kernels::KernelPath {
        self.path
    }
    /// Whether runs check every node's output.
    pub fn checks_numerics(&self) -> bool {
        self.check_numerics
    }
    /// Whether a check found a non-finite value in this run.
    pub(crate) fn found_non_finite(&self) -> bool {
        self.non_finite.load(Ordering::Acquire) != 0
    }
    /// Thread `ith` of `nth` checks its share of node `id`'s output (the rows the node wrote this
    /// step) and records the node if a value is NaN or infinite.
    pub(crate) fn check_node(&self, id: TensorId, step: Step, ith: usize, nth: usize) {
        let t = self.graph.tensor(id);
        if !t.op.computes() || !matches!(t.ty, GgmlType::F32 | GgmlType::F16) {
            return;
        }
        let bad = |v: f32| !v.is_finite();
        // SAFETY: every offset below lies in the node's span (checked in `new`), in rows that the
        // node wrote a barrier ago; nothing writes during the check.
        unsafe {
            if t.op == Op::KvWrite {
                // The cache rows of this step's tokens.
                let (Some(s), Some(_)) = (t.src[0], t.src[1]) else { return };
                let ts = self.graph.tensor(s);
                let transposed = t.params.i[0] == 1;
                let capacity = if transposed { t.ne[0] } else { t.ne[1] };
                let n_tokens = if t.src[2].is_some() {
                    ts.ne[1]
                } else {
                    ts.ne[1].min(capacity.saturating_sub(step.n_past))
                };
                for tok in share(n_tokens, ith, nth) {
                    let pos = match self.place(t.src[2], tok) {
                        Some(Some((first, pos))) if first + pos < capacity => first + pos,
                        Some(_) => continue,
                        None => step.n_past + tok,
                    };
                    for e in 0..ts.ne[0] {
                        let at = if transposed {
                            e * t.nb[1] + pos * t.nb[0]
                        } else {
                            pos * t.nb[1] + e * t.nb[0]
                        };
                        let v = self.value(id, t.ty, at);
                        if bad(v) {
                            self.record_non_finite(id, tok * ts.ne[0] + e, v.is_nan());
                            return;
                        }
                    }
                }
                return;
            }
            let ne = t.ne_for(step.n_kv);
            let flat = share(rows_of(ne), ith, nth);
            for (r, (i1, i2, i3)) in rows(ne, flat.clone()).enumerate() {
                let row = t.row_offset(i1, i2, i3);
                for i0 in 0..ne[0] {
                    let v = self.value(id, t.ty, row + i0 * t.nb[0]);
                    if bad(v) {
                        self.record_non_finite(id, (flat.start + r) * ne[0] + i0, v.is_nan());
                        return;
                    }
                }
            }
        }
    }
    fn record_non_finite(&self, id: TensorId, index: usize, nan: bool) {
        if self.non_finite.compare_exchange(0, id.0 as u32 + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            self.non_finite_index.store(index, Ordering::Relaxed);
            self.non_finite_nan.store(nan as u32, Ordering::Relaxed);
        }
    }
    /// The F32/F16 value at byte `offset` of tensor `id`.
    ///
    /// # Safety
    /// Inside the span, aligned, and not written by any thread now.
    unsafe fn value(&self, id: TensorId, ty: GgmlType, offset: usize) -> f32 {
        // SAFETY: guaranteed by the caller.
        unsafe {
            match ty {
                GgmlType::F16 => f16::from_bits(self.read::<u16>(id, offset, 1)[0]).to_f32(),
                _ => self.read::<f32>(id, offset, 1)[0],
            }
        }
    }
    /// Uses repacked weights: matmuls whose weights are the model-buffer tensors listed in
    /// `entries` (sorted by `source_offset`, planes inside `buffer`) run the packed kernels.
    /// Entries whose planes do not fit `buffer` or whose shape differs from the graph's are ignored.
    pub fn with_packed(mut self, buffer: &'a [u8], entries: &'a [PackedEntry]) -> Self {
        self.packed = entries;
        self.packed_buffer = buffer;
        self
    }
    /// Offers 2-D matmuls on model-buffer weights to `hook` (see [`MatmulOffload`]): the ones it
    /// accepts run on thread 0 through the hook, the other threads skip them.
    pub fn with_offload(mut self, hook: &'a dyn MatmulOffload) -> Self {
        self.offload = Some(hook);
        self
    }
    /// The graph.
    pub fn graph(&self) -> &'a Graph<N> {
        self.graph
    }
    /// Runs the whole graph on the calling thread. (`&mut self`: no one reads [`Bound::data`]
    /// while nodes are written.)
    pub fn run(&mut self, step: Step) -> Result<(), ExecError> {
        self.begin();
        for &id in self.graph.order() {
            let phases = self.phases(id);
            for phase in (0..phases).filter(|&phase| self.phase_works(id, phase, step)) {
                self.compute(id, step, phase, 0, 1);
            }
            if self.check_numerics && phases > 0 {
                self.check_node(id, step, 0, 1);
                if self.found_non_finite() {
                    break;
                }
            }
        }
        self.finish()
    }
    /// The bytes of tensor `id` (its whole span) as the last run left them.
    pub fn data(&self, id: TensorId) -> &[u8] {
        let ptr = self.address(id);
        if ptr.is_null() {
            return &[];
        }
        // SAFETY: the span was checked in `new`; runs need `&mut self`, so nothing writes now.
        unsafe { core::slice::from_raw_parts(ptr, self.graph.tensor(id).span_bytes()) }
    }
    /// The bytes of tensor `id` to change between runs (a training step's parameters); only
    /// tensors in the arena (persistent or planned), never a caller's read-only buffer.
    pub fn data_mut(&mut self, id: TensorId) -> &mut [u8] {
        let ptr = self.address(id);
        let in_arena =
            matches!(self.graph.tensor(id).storage, Storage::Persistent { .. } | Storage::Activation);
        if ptr.is_null() || !in_arena {
            return &mut [];
        }
        // SAFETY: the span was checked in `new`; `&mut self` excludes runs and other borrows of
        // the memory the graph was bound to.
        unsafe { core::slice::from_raw_parts_mut(ptr, self.graph.tensor(id).span_bytes()) }
    }
    /// Tensor `id`'s data as F32 values (empty for other types), e.g. the logits.
    pub fn data_f32(&self, id: TensorId) -> &[f32] {
        if self.graph.tensor(id).ty != GgmlType::F32 {
            return &[];
        }
        bytemuck::try_cast_slice(self.data(id)).unwrap_or(&[])
    }
    /// Clears the error state before a run.
    pub(crate) fn begin(&self) {
        self.error.store(0, Ordering::Relaxed);
        if let Some(hook) = self.offload {
            hook.begin();
        }
        self.non_finite.store(0, Ordering::Relaxed);
    }
    /// The run's result: the first error any thread recorded.
    pub(crate) fn finish(&self) -> Result<(), ExecError> {
        let bad = self.non_finite.load(Ordering::Acquire);
        if bad != 0 {
            let t = self.graph.tensor(TensorId((bad - 1) as u16));
            let sources = t.src.iter().flatten().map(|&s| self.graph.tensor(s));
            let weight = sources.clone().find(|s| matches!(s.storage, Storage::External { .. }));
            let input = weight.or(sources.clone().next()).map(|s| s.name.clone()).unwrap_or_default();
            return Err(ExecError::NonFinite {
                name: t.name.clone(),
                op: t.op.name(),
                input,
                nan: self.non_finite_nan.load(Ordering::Relaxed) != 0,
                index: u32::try_from(self.non_finite_index.load(Ordering::Relaxed)).unwrap_or(u32::MAX),
            });
        }
        let at = self.error.load(Ordering::Acquire);
        if at == 0 {
            return Ok(());
        }
        let t = self.graph.tensor(TensorId((at - 1) as u16));
        Err(match self.error_kind.load(Ordering::Relaxed) {
            ROUTER_NON_FINITE => ExecError::RouterNonFinite { name: t.name.clone() },
            CACHE_FULL => ExecError::CacheFull { name: t.name.clone() },
            _ => ExecError::BadIndex { name: t.name.clone(), op: t.op.name() },
        })
    }
    /// Token `tok`'s (first cache row of its sequence, position) from positions table `table`
    /// (see [`Graph::at_positions`]): `None` without a table (the step's `n_past + tok` then),
    /// `Some(None)` for a negative entry.
    pub(super) fn place(&self, table: Option<TensorId>, tok: usize) -> Option<Option<(usize, usize)>> {
        let table = table?;
        // SAFETY: the builder checked the table is contiguous I32 [2, n_tokens] and `tok` is a
        // token of the node; its span was checked in `new`; inputs are not written during a run.
        let pair: &[i32] = unsafe { self.read(table, tok * 8, 2) };
        Some(usize::try_from(pair[0]).ok().zip(usize::try_from(pair[1]).ok()))
    }
    pub(super) fn fail(&self, id: TensorId, kind: u32) {
        if self.error.compare_exchange(0, id.0 as u32 + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            self.error_kind.store(kind, Ordering::Relaxed);
        }
    }
    /// Data of tensor `id` as elements of `T` starting `offset` bytes in.
    ///
    /// # Safety
    /// `offset + len * size_of::<T>()` must lie within the tensor's span (checked in `new`), the
    /// address must be aligned for `T`, and no thread may write these bytes during the node.
    pub(super) unsafe fn read<T>(&self, id: TensorId, offset: usize, len: usize) -> &[T] {
        // SAFETY: guaranteed by the caller as documented.
        unsafe { core::slice::from_raw_parts(self.address(id).add(offset) as *const T, len) }
    }
    /// Mutable twin of [`Self::read`].
    ///
    /// # Safety
    /// As for `read`, and the calling thread must be the only one touching these bytes.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn write<T>(&self, id: TensorId, offset: usize, len: usize) -> &mut [T] {
        // SAFETY: guaranteed by the caller as documented.
        unsafe { core::slice::from_raw_parts_mut(self.address(id).add(offset) as *mut T, len) }
    }
    /// Element `idx` of F32/F16 tensor `id` with any strides.
    ///
    /// # Safety
    /// `idx` within the tensor's effective shape.
    pub(super) unsafe fn element(&self, id: TensorId, t: &Tensor, idx: [usize; 4], _ne: [usize; 4]) -> f32 {
        let off = idx[0] * t.nb[0] + t.row_offset(idx[1], idx[2], idx[3]);
        // SAFETY: inside the span checked in `new`; F32/F16 elements are aligned (graph checks).
        unsafe {
            match t.ty {
                GgmlType::F16 => f16::from_bits(self.read::<u16>(id, off, 1)[0]).to_f32(),
                _ => self.read::<f32>(id, off, 1)[0],
            }
        }
    }
    /// Stores `v` as type `ty` at byte `offset` of tensor `id`.
    ///
    /// # Safety
    /// Inside the span, and owned by the calling thread for this node.
    pub(super) unsafe fn put(&self, id: TensorId, ty: GgmlType, offset: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            match ty {
                GgmlType::F16 => self.write::<u16>(id, offset, 1)[0] = f16::from_f32(v).to_bits(),
                _ => self.write::<f32>(id, offset, 1)[0] = v,
            }
        }
    }
}

/// `fail` kinds: what [`Bound::finish`] reports. A row index (token id, expert id, position)
/// outside its table.
pub(super) const BAD_INDEX: u32 = 0;
/// A cache write past the end of the KV cache.
pub(super) const CACHE_FULL: u32 = 1;
/// A non-finite MoE router value.
pub(super) const ROUTER_NON_FINITE: u32 = 2;

/// The tensor a view chain ends at, and the view's byte offset from its start.
fn root_of<const N: usize>(g: &Graph<N>, mut id: TensorId) -> (TensorId, usize) {
    let mut offset = 0;
    while let Storage::View { base, offset: o } = g.tensor(id).storage {
        offset += o;
        id = base;
    }
    (id, offset)
}

/// Thread `ith` of `nth`'s share of `n` items.
pub fn share(n: usize, ith: usize, nth: usize) -> Range<usize> {
    let nth = nth.max(1);
    (n * ith / nth)..(n * (ith + 1) / nth)
}

pub(super) fn rows_of(ne: [usize; 4]) -> usize {
    ne[1] * ne[2] * ne[3]
}

/// Row indices `(i1, i2, i3)` for flat rows `range` of shape `ne`.
pub(super) fn rows(ne: [usize; 4], range: Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> {
    range.map(move |r| (r % ne[1], (r / ne[1]) % ne[2], r / (ne[1] * ne[2])))
}
