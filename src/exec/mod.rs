//! Running a planned graph.
//!
//! [`Bound::new`] resolves where every tensor's bytes are (model buffers, arena) and checks that
//! each lies inside its memory; after that, kernels run blind. Each computing node is run by all
//! threads, each on its share of the rows ([`Bound::compute`]), with a barrier between nodes.
//! [`Bound::run`] is the single-threaded executor of the core; `pool` (std) runs the same
//! function on pinned worker threads. Nothing here allocates.
//!
//! With [`Bound::with_numerics_check`], every node's output is checked for NaN and infinity right
//! after the node (each thread its share of the rows, then one more barrier), and the run stops at
//! the first node that produced one ([`ExecError::NonFinite`]). Off, it costs one branch per node.

mod offload;
#[cfg(feature = "std")]
pub mod pool;

pub use offload::MatmulOffload;

use core::fmt;
use core::marker::PhantomData;
use core::ops::Range;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use half::f16;

use crate::arena::Region;
use crate::graph::{Graph, Op, Plan};
use crate::kernels;
use crate::kernels::attn_tile;
use crate::kernels::dot::{from_float_ref, vec_dot_ref, vec_dot_type};
use crate::kernels::kv_attn::{KvOps, TYPED_ROWS};
use crate::kernels::packed::{act_row_bytes, ActBlock, PackedFormat, PackedMatrix, GROUP_ROWS};
use crate::kernels::reference as kref;
use crate::kernels::RowSoftmax;
use crate::quant::blocks::F16Le;
use crate::quant::{dequantize_row_ref, GgmlType};
use crate::tensor::{Storage, Tensor, TensorId};

/// Per-step values: the graph's shape is fixed, these change from one token to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Step {
    /// Tokens already in the KV cache (position of this batch's first token).
    pub n_past: usize,
    /// KV length attention reads this step (`n_past + n_tokens`).
    pub n_kv: usize,
}

/// Why a graph could not be bound to memory or run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecError {
    /// A tensor's bytes fall outside the memory it is bound to.
    OutOfBounds {
        /// The tensor.
        name: heapless::String<40>,
        /// What it is bound to.
        memory: &'static str,
    },
    /// An activation has no planned slot (the plan is for another graph).
    Unplanned {
        /// The tensor.
        name: heapless::String<40>,
    },
    /// The work region is smaller than [`work_bytes`] says the graph needs.
    WorkTooSmall {
        /// Bytes needed.
        needed: usize,
    },
    /// A row index read from a tensor (token id, expert id) is out of range.
    BadIndex {
        /// The node that read it.
        name: heapless::String<40>,
        /// The op.
        op: &'static str,
    },
    /// An MoE router produced NaN or infinity: its layer cannot pick experts.
    RouterNonFinite {
        /// The routing node (`"ffn_moe_topk-3"`: name and layer).
        name: heapless::String<40>,
    },
    /// The step writes past the end of the KV cache.
    CacheFull {
        /// The cache write node.
        name: heapless::String<40>,
    },
    /// A node produced NaN or infinity (found by the numerics check).
    NonFinite {
        /// The node (`"ffn_up-3"`: name and layer).
        name: heapless::String<40>,
        /// Its op.
        op: &'static str,
        /// Its input from the model file if it has one (the weights of a matmul, a norm's
        /// weights), else its first input.
        input: heapless::String<40>,
        /// NaN (else an infinity).
        nan: bool,
        /// Flat index of the first bad element found.
        index: u32,
    },
}

/// A node name as the model builder writes it, `"ffn_up-3"`, split into `("ffn_up", Some(3))`.
pub fn split_layer(name: &str) -> (&str, Option<u32>) {
    match name.rsplit_once('-') {
        Some((base, layer)) if !base.is_empty() => match layer.parse::<u32>() {
            Ok(il) => (base, Some(il)),
            Err(_) => (name, None),
        },
        _ => (name, None),
    }
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfBounds { name, memory } => write!(f, "tensor {name:?} lies outside its {memory}"),
            Self::Unplanned { name } => write!(f, "tensor {name:?} has no planned memory; plan this graph"),
            Self::WorkTooSmall { needed } => {
                write!(f, "work region too small: the graph needs {needed} bytes")
            }
            Self::BadIndex { name, op } => write!(f, "{op} in {name:?} read an index outside its table"),
            Self::CacheFull { name } => write!(f, "{name:?}: the KV cache is full (raise the context size)"),
            Self::RouterNonFinite { name } => {
                let layer = split_layer(name).1.map_or(-1, i64::from);
                write!(
                    f,
                    "the MoE router of layer {layer} produced a non-finite value ({name:?}): generation \
                     stopped; the model's router weights or an earlier layer are broken \
                     (run with --check-numerics to find where)"
                )
            }
            Self::NonFinite { name, op, input, nan, index } => {
                let what = if *nan { "NaN" } else { "infinity" };
                match split_layer(name) {
                    (base, Some(il)) => write!(f, "non-finite value ({what}) in {base}, layer {il}")?,
                    (base, None) => write!(f, "non-finite value ({what}) in {base}")?,
                }
                write!(f, " (op {op}, input {input}; tensor {name}, element {index})")
            }
        }
    }
}

impl core::error::Error for ExecError {}

/// The activation type a matmul converts its F32 input to, if any (F32 weights use it as is).
fn converted_input(t: &Tensor, weights: &Tensor) -> Option<GgmlType> {
    if !matches!(t.op, Op::MulMat | Op::MulMatId) {
        return None;
    }
    vec_dot_type(weights.ty).filter(|&a| a != GgmlType::F32)
}

/// Bytes of the converted input of matmul `t` (rows at their upper-bound length).
fn converted_bytes<const N: usize>(g: &Graph<N>, t: &Tensor) -> usize {
    let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { return 0 };
    let (w, x) = (g.tensor(w), g.tensor(x));
    match converted_input(t, w) {
        // Either the weights' ggml activation type or, for repacked weights, `ActBlock` rows.
        Some(act) => converted_stride(act, x.ne[0]) * x.n_rows(),
        None => 0,
    }
}

/// Bytes per converted input row of `k` elements: room for both conversions, so a graph's work
/// region does not depend on which weights were repacked.
fn converted_stride(act: GgmlType, k: usize) -> usize {
    let ggml = act.bytes_for(k as u64).unwrap_or(0) as usize;
    let packed = if k % crate::kernels::packed::BLOCK == 0 { act_row_bytes(k) } else { 0 };
    ggml.max(packed).next_multiple_of(4)
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

/// Bytes of work region a graph needs: the largest matmul input converted once per node to the
/// weights' activation type (shared by the threads of that node), or the largest split
/// attention's parts.
pub fn work_bytes<const N: usize>(g: &Graph<N>) -> usize {
    g.order()
        .iter()
        .map(|&id| converted_bytes(g, g.tensor(id)).max(split_bytes(g, g.tensor(id))))
        .max()
        .unwrap_or(0)
        .next_multiple_of(64)
}

/// A decode step over a long context splits each query row's keys into up to [`SPLIT_PARTS`]
/// parts, merged in a second phase (llama.cpp splits a decode step's keys between its threads
/// from 512 keys on): the step's (token, KV head) units are too few to keep every thread busy, and
/// threads taking single query heads instead would read each KV head's keys once per head. The
/// parts follow the keys, not the threads, so a result does not depend on the thread count.
const SPLIT_MIN_KEYS: usize = 512;
/// Most parts per row: a multiple of twice the usual thread counts (the pool hands an
/// attention's units out in `2 nth` shares), so every thread gets as many.
const SPLIT_PARTS: usize = 16;
/// Keys per part at least: a part's fixed costs (its queries converted, its output written and
/// merged) stay small beside its keys (16 parts of 32 keys cost a single thread 10% more
/// instructions per token at depth 520).
const SPLIT_PART_KEYS: usize = 256;

/// Parts of every row when the longest sees `longest` keys: a power of two from 2 to
/// [`SPLIT_PARTS`], each part of at least [`SPLIT_PART_KEYS`] keys where it can be.
fn split_parts(longest: usize) -> usize {
    let parts = (longest / SPLIT_PART_KEYS).clamp(2, SPLIT_PARTS);
    1 << parts.ilog2()
}

/// Floats of the buffer a step that does not split sums a long row's parts in (64 KiB): all parts
/// of up to 4 heads of 256 values, or of one head of 1024.
const MERGE_FLOATS: usize = 16384;

/// The parts a row that sees `len` keys is summed in, whether or not its step splits: 0 (one pass
/// over its keys) below [`SPLIT_MIN_KEYS`], else [`split_parts`] of its own keys, each part's
/// softmax merged (`kernels::merge_attn_parts`). A row's arithmetic then depends on its keys
/// only, not on the other rows of its step: a batch of guesses (`--lookup`, `-md`) computes what
/// single tokens would, and a server's batch what each request would alone.
fn row_parts(len: usize) -> usize {
    if len >= SPLIT_MIN_KEYS {
        split_parts(len)
    } else {
        0
    }
}

/// Part `part` of `parts` of the keys `seen`: the one cut both a split step and a step summing a
/// long row in parts by itself use.
fn part_keys(seen: &Range<usize>, part: usize, parts: usize) -> Range<usize> {
    let len = seen.len();
    seen.start + len * part / parts..seen.start + len * (part + 1) / parts
}
/// Steps split when they have fewer (token, KV head) units than this.
const SPLIT_BELOW_UNITS: usize = 8;

/// The most tokens a step over `kv_heads` KV heads may have and still split its keys: the split's
/// work grows with the tokens, so the engine sizes its work region for this many too.
pub fn most_split_tokens(kv_heads: usize) -> usize {
    (SPLIT_BELOW_UNITS - 1) / kv_heads.max(1)
}

/// Floats per part of a split row in the work region: where its softmax ended (max, sum), then
/// its normalized output.
fn split_stride(dv: usize) -> usize {
    dv + 2
}

/// Bytes of work region flash attention node `t` needs for its parts; 0 if it never splits (more
/// tokens or KV heads than [`SPLIT_BELOW_UNITS`], or a cache shorter than [`SPLIT_MIN_KEYS`]).
fn split_bytes<const N: usize>(g: &Graph<N>, t: &Tensor) -> usize {
    let Some(k) = t.src[1].filter(|_| t.op == Op::FlashAttn) else { return 0 };
    let tk = g.tensor(k);
    let (dv, heads, tokens) = (t.ne[0], t.ne[1], t.ne[2]);
    if tokens.saturating_mul(tk.ne[2]) >= SPLIT_BELOW_UNITS || tk.ne[1] < SPLIT_MIN_KEYS {
        return 0;
    }
    tokens * heads * SPLIT_PARTS * split_stride(dv) * size_of::<f32>()
}

/// A graph bound to its memory, ready to run.
pub struct Bound<'a, const N: usize> {
    graph: &'a Graph<N>,
    /// Data address of each tensor (null for tensors outside the built order).
    ptrs: heapless::Vec<*mut u8, N>,
    /// Converted matmul inputs (shared by all threads of a node).
    converted: *mut u8,
    converted_len: usize,
    /// First run-time error seen by any thread (0 = none, else 1 + index into the order).
    error: AtomicU32,
    error_kind: AtomicU32,
    /// Repacked weights (sorted by `source_offset`) and the buffer holding them.
    packed: &'a [PackedEntry],
    packed_buffer: &'a [u8],
    /// Optional hook running some matmuls elsewhere (the NPU).
    offload: Option<&'a dyn MatmulOffload>,
    /// Check every node's output for NaN/infinity.
    check_numerics: bool,
    /// The kernels every node runs on.
    path: kernels::KernelPath,
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
    /// `work` are regions of it (from the plan and [`work_bytes`]).
    pub fn new(
        graph: &'a Graph<N>,
        plan: &Plan<N>,
        buffers: &[&'a [u8]],
        arena: &'a mut [u8],
        activations: Region,
        work: Region,
    ) -> Result<Self, ExecError> {
        let needed = work_bytes(graph);
        if work.len < needed || work.offset.checked_add(work.len).is_none_or(|e| e > arena.len()) {
            return Err(ExecError::WorkTooSmall { needed });
        }
        let act_end = activations.offset.checked_add(activations.len);
        if act_end.is_none_or(|e| e > arena.len()) || activations.len < plan.peak_bytes {
            return Err(ExecError::OutOfBounds {
                name: heapless::String::new(),
                memory: "arena (activation region)",
            });
        }
        let base = arena.as_mut_ptr();
        let mut ptrs: heapless::Vec<*mut u8, N> = heapless::Vec::new();
        let _ = ptrs.resize(graph.tensors().len(), core::ptr::null_mut());
        // Byte range (start, end) of each tensor within its memory, to check before any run.
        for &id in graph.order() {
            let t = graph.tensor(id);
            let out_of = |memory| ExecError::OutOfBounds { name: t.name.clone(), memory };
            let (mem_start, mem_len, start, memory): (*mut u8, usize, usize, &'static str) = match t.storage {
                Storage::External { buffer, offset } => {
                    let buf = buffers.get(buffer as usize).ok_or(out_of("buffer table"))?;
                    (buf.as_ptr() as *mut u8, buf.len(), offset, "model buffer")
                }
                Storage::Persistent { offset } => (base, arena.len(), offset, "arena"),
                Storage::Activation => {
                    let off = plan.offset(id).ok_or(ExecError::Unplanned { name: t.name.clone() })?;
                    (base, arena.len(), activations.offset + off, "arena (activation region)")
                }
                Storage::View { base: viewed, offset } => {
                    // Views are checked against the root they view, resolved below.
                    let root = root_of(graph, viewed);
                    let (root_start, root_span) = (ptrs[root.0.index()], graph.tensor(root.0).span_bytes());
                    let view_start = root.1 + offset;
                    if root_start.is_null()
                        || view_start.checked_add(t.span_bytes()).is_none_or(|e| e > root_span)
                    {
                        return Err(out_of("viewed tensor"));
                    }
                    // SAFETY: in bounds of the root's checked span.
                    ptrs[id.index()] = unsafe { root_start.add(view_start) };
                    continue;
                }
            };
            if start.checked_add(t.span_bytes()).is_none_or(|e| e > mem_len) {
                return Err(out_of(memory));
            }
            // SAFETY: start + span <= mem_len, checked just above.
            ptrs[id.index()] = unsafe { mem_start.add(start) };
        }
        Ok(Self {
            graph,
            ptrs,
            // SAFETY: the work region lies inside the arena (checked at the top).
            converted: unsafe { base.add(work.offset) },
            converted_len: work.len,
            error: AtomicU32::new(0),
            error_kind: AtomicU32::new(0),
            packed: &[],
            packed_buffer: &[],
            offload: None,
            check_numerics: false,
            path: kernels::KernelPath::detect(),
            non_finite: AtomicU32::new(0),
            non_finite_index: AtomicUsize::new(0),
            non_finite_nan: AtomicU32::new(0),
            _memory: PhantomData,
        })
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

    /// The offload hook and the weights' offset, if matmul node `t` goes to the hook this step.
    /// Every thread gets the same answer (the hook's state only changes in `begin`).
    fn offload_of(&self, t: &Tensor, step: Step) -> Option<(&'a dyn MatmulOffload, usize)> {
        let hook = self.offload?;
        let (w, x) = (self.graph.tensor(t.src[0]?), self.graph.tensor(t.src[1]?));
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        let (ne_x, ne) = (x.ne_for(step.n_kv), t.ne_for(step.n_kv));
        let (k, n, n_tokens) = (w.ne[0], w.ne[1], ne_x[1]);
        let plain = t.op == Op::MulMat
            && w.ne[2] == 1
            && w.ne[3] == 1
            && x.ty == GgmlType::F32
            && t.ty == GgmlType::F32
            && ne_x == [k, n_tokens, 1, 1]
            && ne == [n, n_tokens, 1, 1]
            && x.nb[0] == 4
            && (n_tokens == 1 || x.nb[1] == 4 * k)
            && t.nb[0] == 4
            && (n_tokens == 1 || t.nb[1] == 4 * n);
        (plain && hook.accepts(offset, k, n, n_tokens)).then_some((hook, offset))
    }

    /// Runs matmul node `id` through the offload hook if it takes it: thread 0 runs it (on the CPU
    /// alone if the hook fails), the others skip it. Returns whether the node was dealt with.
    fn offload_mul_mat(&self, id: TensorId, t: &Tensor, step: Step, ith: usize) -> bool {
        let Some((hook, offset)) = self.offload_of(t, step) else { return false };
        if ith != 0 {
            return true;
        }
        let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { return true };
        let (k, n) = (self.graph.tensor(w).ne[0], self.graph.tensor(w).ne[1]);
        let n_tokens = self.graph.tensor(x).ne_for(step.n_kv)[1];
        // SAFETY: contiguous rows (checked in `offload_of`) inside the spans checked in `new`;
        // every other thread skips this node, so thread 0 alone reads x and writes the output.
        let done = unsafe {
            let input: &[f32] = self.read(x, 0, n_tokens * k);
            let output: &mut [f32] = self.write(id, 0, n_tokens * n);
            hook.run(offset, k, n, input, output)
        };
        if !done {
            // The device failed: this thread computes the whole node, input conversion included
            // (the other threads skipped phase 0 and wait at the barrier).
            if self.converts_input(id) {
                self.convert_input(id, t, step, 0, 1);
            }
            self.mul_mat(id, t, step, 0, 1);
        }
        true
    }

    /// The repacked form of matmul weights `w` (a 2-D tensor in model buffer 0: a whole matrix,
    /// or whole row groups of one, as the parts of a fused weight), if any.
    fn packed_weights(&self, w: &Tensor) -> Option<PackedMatrix<'a>> {
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        if w.ne[2] != 1 || w.ne[3] != 1 {
            return None;
        }
        // The matrix starting at or last before `offset`.
        let at = match self.packed.binary_search_by_key(&offset, |e| e.source_offset) {
            Ok(at) => at,
            Err(after) => after.checked_sub(1)?,
        };
        let entry = &self.packed[at];
        if entry.k != w.ne[0] || PackedFormat::for_type(w.ty) != Some(entry.format) {
            return None;
        }
        let matrix = entry.matrix(self.packed_buffer)?;
        if offset == entry.source_offset && entry.rows == w.ne[1] {
            return Some(matrix);
        }
        let row_bytes = usize::try_from(w.ty.bytes_for(w.ne[0] as u64)?).ok()?;
        let first_row = (offset - entry.source_offset) / row_bytes;
        let whole_groups = (offset - entry.source_offset) % row_bytes == 0
            && first_row % GROUP_ROWS == 0
            && w.ne[1] % GROUP_ROWS == 0;
        whole_groups.then(|| matrix.row_groups(first_row / GROUP_ROWS, w.ne[1] / GROUP_ROWS)).flatten()
    }

    /// The repacked form of expert weights `w` (`[k, m, n_expert]` in model buffer 0, packed as
    /// one matrix of `m * n_expert` rows), if any: expert `e` is row groups `e * m / 4..`.
    fn packed_experts(&self, w: &Tensor) -> Option<PackedMatrix<'a>> {
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        if w.ne[3] != 1 || w.ne[1] % GROUP_ROWS != 0 {
            return None;
        }
        let at = self.packed.binary_search_by_key(&offset, |e| e.source_offset).ok()?;
        let entry = &self.packed[at];
        let rows = w.ne[1].checked_mul(w.ne[2])?;
        (entry.rows == rows && entry.k == w.ne[0] && PackedFormat::for_type(w.ty) == Some(entry.format))
            .then(|| entry.matrix(self.packed_buffer))
            .flatten()
    }

    /// The repacked weights matmul node `t` (weights `w`) runs on, if any.
    pub(crate) fn packed_for(&self, t: &Tensor, w: &Tensor) -> Option<PackedMatrix<'a>> {
        match t.op {
            Op::MulMat => self.packed_weights(w),
            Op::MulMatId => self.packed_experts(w),
            _ => None,
        }
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
        let ptr = self.ptrs.get(id.index()).copied().unwrap_or(core::ptr::null_mut());
        if ptr.is_null() {
            return &[];
        }
        // SAFETY: the span was checked in `new`; runs need `&mut self`, so nothing writes now.
        unsafe { core::slice::from_raw_parts(ptr, self.graph.tensor(id).span_bytes()) }
    }

    /// The bytes of tensor `id` to change between runs (a training step's parameters); only
    /// tensors in the arena (persistent or planned), never a caller's read-only buffer.
    pub fn data_mut(&mut self, id: TensorId) -> &mut [u8] {
        let ptr = self.ptrs.get(id.index()).copied().unwrap_or(core::ptr::null_mut());
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
    fn place(&self, table: Option<TensorId>, tok: usize) -> Option<Option<(usize, usize)>> {
        let table = table?;
        // SAFETY: the builder checked the table is contiguous I32 [2, n_tokens] and `tok` is a
        // token of the node; its span was checked in `new`; inputs are not written during a run.
        let pair: &[i32] = unsafe { self.read(table, tok * 8, 2) };
        Some(usize::try_from(pair[0]).ok().zip(usize::try_from(pair[1]).ok()))
    }

    /// Token `tok`'s (sequence, position) from places table `places`, for a recurrent state of
    /// `n_seq` sequences of `rows_per_seq` cache rows each; `None` for a place outside them.
    fn sequence_of(
        &self,
        places: TensorId,
        tok: usize,
        rows_per_seq: usize,
        n_seq: usize,
    ) -> Option<(usize, usize)> {
        let (first, pos) = self.place(Some(places), tok)??;
        let seq = first / rows_per_seq;
        (seq < n_seq).then_some((seq, pos))
    }

    fn fail(&self, id: TensorId, kind: u32) {
        if self.error.compare_exchange(0, id.0 as u32 + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            self.error_kind.store(kind, Ordering::Relaxed);
        }
    }

    /// Data of tensor `id` as elements of `T` starting `offset` bytes in.
    ///
    /// # Safety
    /// `offset + len * size_of::<T>()` must lie within the tensor's span (checked in `new`), the
    /// address must be aligned for `T`, and no thread may write these bytes during the node.
    unsafe fn read<T>(&self, id: TensorId, offset: usize, len: usize) -> &[T] {
        // SAFETY: guaranteed by the caller as documented.
        unsafe { core::slice::from_raw_parts(self.ptrs[id.index()].add(offset) as *const T, len) }
    }

    /// Mutable twin of [`Self::read`].
    ///
    /// # Safety
    /// As for `read`, and the calling thread must be the only one touching these bytes.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write<T>(&self, id: TensorId, offset: usize, len: usize) -> &mut [T] {
        // SAFETY: guaranteed by the caller as documented.
        unsafe { core::slice::from_raw_parts_mut(self.ptrs[id.index()].add(offset) as *mut T, len) }
    }

    /// How many phases node `id` runs in, with a barrier after each: 0 for leaves and views, 2
    /// for matmuls that first convert their input (once per node, split over the threads) and
    /// for attention that may split its keys (parts, then their merge), else 1.
    pub(crate) fn phases(&self, id: TensorId) -> usize {
        let t = self.graph.tensor(id);
        if !t.op.computes() {
            0
        } else if self.converts_input(id) || split_bytes(self.graph, t) > 0 {
            2
        } else {
            1
        }
    }

    /// Whether node `id` is a matmul whose phase 0 converts its input into the work region.
    pub(crate) fn converts_input(&self, id: TensorId) -> bool {
        let t = self.graph.tensor(id);
        t.src[0].is_some_and(|w| converted_input(t, self.graph.tensor(w)).is_some())
    }

    /// Whether phase `phase` of node `id` has work this step: the merge phase of an attention
    /// that does not split this step has none (the pool skips it, barrier included).
    pub(crate) fn phase_works(&self, id: TensorId, phase: usize, step: Step) -> bool {
        let t = self.graph.tensor(id);
        !(t.op == Op::FlashAttn && phase == 1) || self.split_of(t, step).is_some()
    }

    /// How many parts attention node `t` splits each row's keys into this step, if it splits
    /// (see [`SPLIT_PARTS`]): it can (its parts fit the work region) and some row sees
    /// [`SPLIT_MIN_KEYS`] keys or more.
    fn split_of(&self, t: &Tensor, step: Step) -> Option<usize> {
        let bytes = split_bytes(self.graph, t);
        let k = t.src[1]?;
        if bytes == 0 || bytes > self.converted_len || (self.converted as usize) % align_of::<f32>() != 0 {
            return None;
        }
        let n_kv = self.graph.tensor(k).ne_for(step.n_kv)[1];
        let longest =
            (0..t.ne[2]).filter_map(|tok| self.visible(t, tok, n_kv, step)).map(|r| r.len()).max()?;
        (longest >= SPLIT_MIN_KEYS).then(|| split_parts(longest))
    }

    /// Runs thread `ith` of `nth`'s share of phase `phase` of node `id`.
    pub(crate) fn compute(&self, id: TensorId, step: Step, phase: usize, ith: usize, nth: usize) {
        let t = self.graph.tensor(id);
        if !t.op.computes() {
            return;
        }
        if phase == 0 && self.converts_input(id) {
            // An offloaded matmul reads its F32 input as is (and converts it itself on failure).
            if self.offload.is_none() || self.offload_of(t, step).is_none() {
                self.convert_input(id, t, step, ith, nth);
            }
            return;
        }
        let ne = t.ne_for(step.n_kv);
        match t.op {
            Op::Scale
            | Op::Sqr
            | Op::Sqrt
            | Op::Hadamard
            | Op::RmsNorm
            | Op::LayerNorm
            | Op::Silu
            | Op::Sigmoid
            | Op::Softplus
            | Op::Tanh
            | Op::Gelu
            | Op::SoftMax => self.unary(id, t, ne, step, ith, nth),
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::SwiGlu | Op::GeGlu => {
                self.binary(id, t, ne, step, ith, nth)
            }
            Op::Sum | Op::Repeat | Op::RepeatBack | Op::Fill => self.reshape_sum(id, t, ne, step, ith, nth),
            Op::RmsNormBack | Op::SoftMaxBack | Op::CrossEntropy | Op::CrossEntropyBack => {
                self.train_rows(id, t, ne, ith, nth)
            }
            Op::MulMatT => self.mul_mat_t(id, t, ne, ith, nth),
            Op::RopeTable => self.rope_table(id, t, ne, step, ith, nth),
            Op::Rope => self.rope(id, t, ne, ith, nth),
            Op::GetRows => self.get_rows(id, t, ne, ith, nth),
            Op::GetRowsBack => self.get_rows_back(id, t, ne, ith, nth),
            Op::MulMat => {
                if !(self.offload.is_some() && self.offload_mul_mat(id, t, step, ith)) {
                    self.mul_mat(id, t, step, ith, nth)
                }
            }
            Op::MulMatId => self.mul_mat_id(id, t, step, ith, nth),
            Op::TopK => self.top_k(id, t, ne, ith, nth),
            Op::MoeWeights => self.moe_weights(id, t, ne, ith, nth),
            Op::MoeSum => self.moe_sum(id, t, ne, ith, nth),
            Op::Cpy => self.cpy(id, t, ne, step, ith, nth),
            Op::Concat => self.concat(id, t, ne, step, ith, nth),
            Op::KvWrite => self.kv_write(id, t, step, ith, nth),
            Op::ShortConv => self.short_conv(id, t, ith, nth),
            Op::GatedDeltaNet => self.gated_delta_net(id, t, ith, nth),
            Op::FlashAttn => match (phase, self.split_of(t, step)) {
                (0, None) => self.flash_attn(id, t, ne, step, ith, nth),
                (0, Some(parts)) => self.flash_attn_parts(id, t, ne, step, parts, ith, nth),
                (_, Some(parts)) => self.merge_attn_parts(id, ne, step, parts, ith, nth),
                (_, None) => {}
            },
            Op::None | Op::View => {}
        }
    }

    /// Row-wise ops of one input: scale, norms, activations, softmax.
    fn unary(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let Some((a, ta)) = src(0) else { return };
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                let p = t.params;
                match t.op {
                    Op::Scale => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * p.f[0]),
                    Op::Sqr => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * v),
                    Op::Sqrt => out.iter_mut().zip(x).for_each(|(o, &v)| *o = libm::sqrtf(v)),
                    Op::Hadamard => kref::hadamard_ref(x, out, p.i[0] as usize),
                    Op::RmsNorm => kernels::rms_norm(path, x, out, p.f[0]),
                    Op::LayerNorm => kref::layer_norm_ref(x, out, p.f[0]),
                    Op::Silu => kernels::silu(path, x, out),
                    Op::Sigmoid => kref::sigmoid_ref(x, out),
                    Op::Softplus => kref::softplus_ref(x, out),
                    Op::Tanh => out.iter_mut().zip(x).for_each(|(o, &v)| *o = libm::tanhf(v)),
                    Op::Gelu => kref::gelu_ref(x, out),
                    _ => {
                        let (start, end) =
                            visible_keys(p.i[0] != 0, p.i[1] as usize, step.n_past + i1, ne[0]);
                        kref::soft_max_ref(x, out, p.f[0], start, end);
                    }
                }
            }
        }
    }

    /// Elementwise ops of two inputs, the second broadcast: add, mul, SwiGLU, GeGLU.
    fn binary(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            let neb = tb.ne_for(step.n_kv);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let y: &[f32] = self.read(b, tb.row_offset(i1 % neb[1], i2 % neb[2], i3 % neb[3]), neb[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                if neb[0] != ne[0] {
                    // A one-element row broadcast along the row (the graph allows only that).
                    let b = y[0];
                    match t.op {
                        Op::Add => out.iter_mut().zip(x).for_each(|(o, a)| *o = a + b),
                        Op::Sub => out.iter_mut().zip(x).for_each(|(o, a)| *o = a - b),
                        Op::Div => out.iter_mut().zip(x).for_each(|(o, a)| *o = a / b),
                        _ => out.iter_mut().zip(x).for_each(|(o, a)| *o = a * b),
                    }
                    continue;
                }
                match t.op {
                    Op::Add => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a + b),
                    Op::Sub => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a - b),
                    Op::Mul => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a * b),
                    Op::Div => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a / b),
                    Op::SwiGlu => kernels::swiglu(path, x, y, out),
                    _ => kref::geglu_ref(x, y, out),
                }
            }
        }
    }

    /// RoPE's cosines and sines per token (its position from the places table, else `n_past + t`).
    fn rope_table(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            // The builder checked the factors hold at least n_rot / 2 contiguous values.
            let factors = src(1).map(|(f, tf)| self.read::<f32>(f, 0, tf.n_elements()));
            let ext_factor = t.params.f[3];
            let corr_dims = [f32::from_bits(t.params.i[1] as u32), f32::from_bits(t.params.i[2] as u32)];
            let p = kref::RopeParams {
                n_rot: ne[0],
                neox: false,
                freq_base: t.params.f[0],
                freq_scale: t.params.f[1],
                freq_factors: factors,
                yarn: (ext_factor != 0.0).then_some(kref::Yarn { ext_factor, corr_dims }),
            };
            let half = ne[0] / 2;
            for i1 in share(ne[1], ith, nth) {
                let row: &mut [f32] = self.write(id, t.row_offset(i1, 0, 0), ne[0]);
                let (cos, sin) = row.split_at_mut(half);
                let pos = match self.place(t.src[2], i1) {
                    Some(Some((_, pos))) => pos,
                    Some(None) => {
                        self.fail(id, BAD_INDEX);
                        0
                    }
                    None => step.n_past + i1,
                };
                kref::rope_table_ref(pos, &p, 0, cos, sin);
                let mscale = t.params.f[2];
                if mscale != 1.0 {
                    // ggml multiplies each cosine and sine by the attention factor.
                    cos.iter_mut().chain(sin.iter_mut()).for_each(|v| *v *= mscale);
                }
            }
        }
    }

    /// RoPE of each head row by its token's angles.
    fn rope(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((table, tt))) = (src(0), src(1)) else { return };
            let (n_rot, neox) = (tt.ne[0], t.params.i[1] == 1);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                // Token i2's angles: the builder checked the table has a row per token.
                let (cos, sin) = self.read::<f32>(table, tt.row_offset(i2, 0, 0), n_rot).split_at(n_rot / 2);
                if t.params.i[2] == 1 {
                    // The inverse rotation: the same cosines, the sines negated (the builder
                    // checked n_rot / 2 fits).
                    let mut back = [0f32; crate::graph::ROPE_BACK_MAX_PAIRS];
                    let back = &mut back[..sin.len()];
                    back.iter_mut().zip(sin).for_each(|(b, &s)| *b = -s);
                    kernels::rope_rotate(path, x, out, cos, back, neox);
                    continue;
                }
                kernels::rope_rotate(path, x, out, cos, sin, neox);
            }
        }
    }

    /// Rows of a table picked by I32 ids (embeddings, output rows).
    /// Each thread owns a share of the table's rows: it zeroes them, then adds every gradient row
    /// whose id is one of them, in the gradient's order.
    fn get_rows_back(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes were checked by the graph builder, spans by `new`; each thread writes only
        // the rows of its share.
        unsafe {
            let (Some((d, td)), Some((ids, _))) = (src(0), src(1)) else { return };
            let n = td.ne[1];
            let ids: &[i32] = self.read(ids, 0, n);
            let mine = share(ne[1], ith, nth);
            for r in mine.clone() {
                self.write::<f32>(id, t.row_offset(r, 0, 0), ne[0]).fill(0.0);
            }
            for (j, &r) in ids.iter().enumerate() {
                match usize::try_from(r).ok().filter(|&r| r < ne[1]) {
                    Some(r) if mine.contains(&r) => {
                        let row: &[f32] = self.read(d, td.row_offset(j, 0, 0), ne[0]);
                        let out: &mut [f32] = self.write(id, t.row_offset(r, 0, 0), ne[0]);
                        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
                    }
                    Some(_) => {}
                    None => self.fail(id, BAD_INDEX),
                }
            }
        }
    }

    fn get_rows(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((table, tt)), Some((ids, _))) = (src(0), src(1)) else { return };
            let ids: &[i32] = self.read(ids, 0, ne[1]);
            // The table may be a slice of a wider one: read ne[0] elements at each row's stride.
            let row_bytes = tt.ty.bytes_for(ne[0] as u64).unwrap_or(0) as usize;
            // A tied embedding whose repacked copy holds the file's values exactly: its rows are
            // read from that copy, the file's pages are never touched again.
            let packed = self
                .packed_weights(tt)
                .filter(|w| tt.ty.traits().rows_from_packed && w.k == ne[0] && ne[0] == tt.ne[0]);
            for i1 in share(ne[1], ith, nth) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, 0, 0), ne[0]);
                match (usize::try_from(ids[i1]).ok().filter(|&r| r < tt.ne[1]), &packed) {
                    (Some(r), Some(w)) => crate::kernels::packed::dequantize_packed_row(w, r, out),
                    (Some(r), None) => {
                        let bytes: &[u8] = self.read(table, r * tt.nb[1], row_bytes);
                        // Cannot fail: the builder accepted only dequantizable types.
                        let _ = dequantize_row_ref(tt.ty, bytes, out);
                    }
                    (None, _) => {
                        out.fill(0.0);
                        self.fail(id, BAD_INDEX);
                    }
                }
            }
        }
    }

    /// MoE routing: the k largest router probabilities of each token.
    fn top_k(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let Some((a, ta)) = src(0) else { return };
            let k = ne[0];
            for tok in share(ne[1], ith, nth) {
                let probs: &[f32] = self.read(a, ta.row_offset(tok, 0, 0), ta.ne[0]);
                let out: &mut [i32] = self.write(id, t.row_offset(tok, 0, 0), k);
                if !kref::top_k_ref(probs, out) {
                    self.fail(id, ROUTER_NON_FINITE);
                }
            }
        }
    }

    /// MoE expert weights, optionally normalised.
    fn moe_weights(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((ids, ti))) = (src(0), src(1)) else { return };
            for tok in share(ne[1], ith, nth) {
                let probs: &[f32] = self.read(a, ta.row_offset(tok, 0, 0), ta.ne[0]);
                let picked: &[i32] = self.read(ids, ti.row_offset(tok, 0, 0), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(tok, 0, 0), ne[0]);
                if !kref::moe_weights_ref(probs, picked, t.params.i[0] != 0, out) {
                    self.fail(id, BAD_INDEX);
                }
            }
        }
    }

    /// Weighted sum of the experts' outputs.
    fn moe_sum(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((w, tw))) = (src(0), src(1)) else { return };
            let (m, k) = (ne[0], ta.ne[1]);
            for tok in share(ne[1], ith, nth) {
                let weights: &[f32] = self.read(w, tw.row_offset(tok, 0, 0), k);
                let experts: &[f32] = self.read(a, ta.row_offset(0, tok, 0), m * k);
                let out: &mut [f32] = self.write(id, t.row_offset(tok, 0, 0), m);
                kref::moe_sum_ref(experts, weights, out);
            }
        }
    }

    /// Copy and type conversion, any strides.
    fn cpy(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let Some((a, ta)) = src(0) else { return };
            let ne_a = ta.ne_for(step.n_kv);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let row = t.row_offset(i1, i2, i3);
                for i0 in 0..ne[0] {
                    let v = self.element(a, ta, [i0, i1, i2, i3], ne_a);
                    self.put(id, t.ty, row + i0 * t.nb[0], v);
                }
            }
        }
    }

    /// Sum of all elements, tiling, summing back to a smaller shape, and constants (the training
    /// ops; sums in f64, in a fixed order, so a gradient does not depend on the thread count).
    fn reshape_sum(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let src = t.src[0].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows come
        // from `share`, which gives each thread disjoint ones.
        unsafe {
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                match (t.op, src) {
                    (Op::Fill, _) => out.fill(t.params.f[0]),
                    (Op::Sum, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        let mut total = 0f64;
                        for idx in elements_of(na) {
                            total += self.element(a, ta, idx, na) as f64;
                        }
                        out[0] = total as f32;
                    }
                    (Op::Repeat, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        for (i0, o) in out.iter_mut().enumerate() {
                            *o = self.element(a, ta, [i0 % na[0], i1 % na[1], i2 % na[2], i3 % na[3]], na);
                        }
                    }
                    (Op::RepeatBack, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        for (i0, o) in out.iter_mut().enumerate() {
                            let mut total = 0f64;
                            for j3 in (i3..na[3]).step_by(ne[3]) {
                                for j2 in (i2..na[2]).step_by(ne[2]) {
                                    for j1 in (i1..na[1]).step_by(ne[1]) {
                                        for j0 in (i0..na[0]).step_by(ne[0]) {
                                            total += self.element(a, ta, [j0, j1, j2, j3], na) as f64;
                                        }
                                    }
                                }
                            }
                            *o = total as f32;
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// The row-wise backward ops and the cross-entropy loss.
    fn train_rows(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and types were checked by the graph builder, spans by `new`; rows come
        // from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            if matches!(t.op, Op::CrossEntropy | Op::CrossEntropyBack) {
                let n = ta.ne[1];
                let targets: &[i32] = self.read(b, 0, n);
                let scored = targets.iter().filter(|&&v| v >= 0).count().max(1);
                let target_of = |r: usize| usize::try_from(targets[r]).ok();
                if t.op == Op::CrossEntropy {
                    for _ in share(1, ith, nth) {
                        let mut total = 0f64;
                        for r in 0..n {
                            let logits: &[f32] = self.read(a, ta.row_offset(r, 0, 0), ta.ne[0]);
                            match target_of(r) {
                                Some(c) if c < ta.ne[0] => total += kref::cross_entropy_ref(logits, c),
                                Some(_) => self.fail(id, BAD_INDEX),
                                None => {}
                            }
                        }
                        let out: &mut [f32] = self.write(id, 0, 1);
                        out[0] = (total / scored as f64) as f32;
                    }
                    return;
                }
                let Some((d, _)) = src(2) else { return };
                let dloss: f32 = self.read::<f32>(d, 0, 1)[0];
                for r in share(n, ith, nth) {
                    let logits: &[f32] = self.read(a, ta.row_offset(r, 0, 0), ne[0]);
                    let out: &mut [f32] = self.write(id, t.row_offset(r, 0, 0), ne[0]);
                    match target_of(r) {
                        Some(c) if c < ne[0] => {
                            kref::cross_entropy_back_ref(logits, c, dloss / scored as f32, out)
                        }
                        _ => out.fill(0.0),
                    }
                }
                return;
            }
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let dy: &[f32] = self.read(b, tb.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                match t.op {
                    Op::RmsNormBack => kref::rms_norm_back_ref(x, dy, out, t.params.f[0]),
                    _ => kref::soft_max_back_ref(x, dy, out, t.params.f[0]),
                }
            }
        }
    }

    /// A frozen weight's transposed product (a matmul's input gradient): each thread takes a
    /// share of the output rows' values (a range of `k`), dequantizes those parts of [`T_ROWS`]
    /// weight rows at a time, and adds them to every column (in row order, as one row at a time
    /// would: the blocking only saves loads and stores of the output).
    fn mul_mat_t(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        const CHUNK: usize = 256;
        const T_ROWS: usize = 8;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and types were checked by the graph builder, spans by `new`; each thread
        // writes only its own range of every output row.
        unsafe {
            let (Some((w, tw)), Some((x, tx))) = (src(0), src(1)) else { return };
            let (k, m, n) = (tw.ne[0], tw.ne[1], tx.ne[1]);
            let block = tw.ty.block_len();
            // Whole chunks of CHUNK values (a multiple of every block length), shared by thread.
            let chunks = k.div_ceil(CHUNK);
            let mine = share(chunks, ith, nth);
            for j in 0..n {
                let out: &mut [f32] = self.write(id, t.row_offset(j, 0, 0), ne[0]);
                out[mine.start * CHUNK..(mine.end * CHUNK).min(k)].fill(0.0);
            }
            let mut buf = [[0f32; CHUNK]; T_ROWS];
            for i0 in (0..m).step_by(T_ROWS) {
                let rows = T_ROWS.min(m - i0);
                for c in mine.clone() {
                    let (start, len) = (c * CHUNK, CHUNK.min(k - c * CHUNK));
                    for (r, row) in buf.iter_mut().enumerate() {
                        if r >= rows {
                            row.fill(0.0);
                            continue;
                        }
                        let offset = tw.row_offset(i0 + r, 0, 0) + start / block * tw.ty.block_bytes();
                        let bytes: &[u8] =
                            self.read(w, offset, tw.ty.bytes_for(len as u64).unwrap_or(0) as usize);
                        // Cannot fail: the builder accepted only dequantizable types.
                        let _ = dequantize_row_ref(tw.ty, bytes, &mut row[..len]);
                    }
                    for j in 0..n {
                        let mut d = [0f32; T_ROWS];
                        d[..rows].copy_from_slice(self.read::<f32>(x, tx.row_offset(j, 0, 0) + i0 * 4, rows));
                        if d.iter().all(|&v| v == 0.0) {
                            continue;
                        }
                        let out: &mut [f32] = self.write(id, t.row_offset(j, 0, 0) + start * 4, len);
                        kernels::add_scaled_rows(self.path, out, &d, &buf);
                    }
                }
            }
        }
    }

    /// Two tensors joined along one dimension.
    fn concat(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            let dim = t.params.i[0] as usize;
            let (ne_a, ne_b) = (ta.ne_for(step.n_kv), tb.ne_for(step.n_kv));
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                for (i0, o) in out.iter_mut().enumerate() {
                    let mut idx = [i0, i1, i2, i3];
                    *o = if idx[dim] < ne_a[dim] {
                        self.element(a, ta, idx, ne_a)
                    } else {
                        idx[dim] -= ne_a[dim];
                        self.element(b, tb, idx, ne_b)
                    };
                }
            }
        }
    }

    /// The short convolution (see [`Op::ShortConv`]): each thread owns a share of the channels
    /// and walks the tokens in batch order, so every channel's state moves on token by token.
    fn short_conv(&self, id: TensorId, t: &Tensor, ith: usize, nth: usize) {
        let [Some(x), Some(taps), Some(states), Some(places), ..] = t.src else { return };
        let (tx, ts) = (self.graph.tensor(x), self.graph.tensor(states));
        let (n_ch, n_tokens) = (tx.ne[0], tx.ne[1]);
        let (k, n_seq) = (self.graph.tensor(taps).ne[0], ts.ne[1]);
        let rows_per_seq = t.params.i[0] as usize;
        let channels = share(n_ch, ith, nth);
        // SAFETY: shapes were checked by the graph builder, spans by `new`; this thread reads and
        // writes only its own channels' inputs, taps, states and outputs.
        unsafe {
            let w: &[f32] = self.read(taps, channels.start * k * 4, channels.len() * k);
            for tok in 0..n_tokens {
                let Some((seq, pos)) = self.sequence_of(places, tok, rows_per_seq, n_seq) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                let input: &[f32] = self.read(x, tok * tx.nb[1] + channels.start * 4, channels.len());
                let out: &mut [f32] = self.write(id, tok * t.nb[1] + channels.start * 4, channels.len());
                let at = seq * ts.nb[1] + channels.start * (k - 1) * 4;
                let state: &mut [f32] = self.write(states, at, channels.len() * (k - 1));
                for (c, (o, &v)) in out.iter_mut().zip(input).enumerate() {
                    let window = &mut state[c * (k - 1)..(c + 1) * (k - 1)];
                    *o = kref::short_conv_step_ref(window, &w[c * k..(c + 1) * k], v, pos == 0);
                }
            }
        }
    }

    /// The gated delta rule (see [`Op::GatedDeltaNet`]): each thread owns a share of the value
    /// heads and walks the tokens in batch order, so every head's state moves on token by token.
    fn gated_delta_net(&self, id: TensorId, t: &Tensor, ith: usize, nth: usize) {
        let [Some(q), Some(k), Some(v), Some(g), Some(beta), Some(states), Some(places), _] = t.src else {
            return;
        };
        let (tq, tk, tv, ts) =
            (self.graph.tensor(q), self.graph.tensor(k), self.graph.tensor(v), self.graph.tensor(states));
        let (d, n_v, n_tokens, n_k, n_seq) = (tv.ne[0], tv.ne[1], tv.ne[2], tq.ne[1], ts.ne[1]);
        let rows_per_seq = t.params.i[0] as usize;
        // SAFETY: shapes were checked by the graph builder, spans by `new`; this thread reads and
        // writes only its own heads' states and outputs, and reads inputs nothing writes.
        unsafe {
            for tok in 0..n_tokens {
                let Some((seq, pos)) = self.sequence_of(places, tok, rows_per_seq, n_seq) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                let gs: &[f32] = self.read(g, tok * n_v * 4, n_v);
                let betas: &[f32] = self.read(beta, tok * n_v * 4, n_v);
                for h in share(n_v, ith, nth) {
                    let hk = h % n_k;
                    let qh: &[f32] = self.read(q, tq.row_offset(hk, tok, 0), d);
                    let kh: &[f32] = self.read(k, tk.row_offset(hk, tok, 0), d);
                    let vh: &[f32] = self.read(v, tv.row_offset(h, tok, 0), d);
                    let state: &mut [f32] = self.write(states, seq * ts.nb[1] + h * d * d * 4, d * d);
                    let out: &mut [f32] = self.write(id, t.row_offset(h, tok, 0), d);
                    let fresh = pos == 0;
                    kref::gated_delta_step_ref(state, qh, kh, vh, gs[h], betas[h], fresh, out);
                }
            }
        }
    }

    /// Rows written into the KV cache at each token's cache row.
    fn kv_write(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((s, ts)), Some((cache, tc))) = (src(0), src(1)) else { return };
            let transposed = t.params.i[0] == 1;
            let n_tokens = ts.ne[1];
            let capacity = if transposed { tc.ne[0] } else { tc.ne[1] };
            if t.src[2].is_none() && step.n_past + n_tokens > capacity {
                if ith == 0 {
                    self.fail(id, CACHE_FULL);
                }
                return;
            }
            let _ = cache;
            for tok in share(n_tokens, ith, nth) {
                let x: &[f32] = self.read(s, ts.row_offset(tok, 0, 0), ts.ne[0]);
                let pos = match self.place(t.src[2], tok) {
                    Some(Some((first, pos))) if first + pos < capacity => first + pos,
                    Some(_) => {
                        self.fail(id, CACHE_FULL);
                        continue;
                    }
                    None => step.n_past + tok,
                };
                if !transposed && tc.ty == GgmlType::F16 && tc.nb[0] == 2 {
                    // A contiguous f16 row: one conversion kernel.
                    let out: &mut [F16Le] = self.write(id, pos * tc.nb[1], x.len());
                    kernels::f32_to_f16(path, x, out);
                    continue;
                }
                if !transposed && tc.ty != GgmlType::F32 {
                    // Another cache type: the row converted or quantized whole (the graph
                    // checked the type; its rows are whole blocks).
                    let bytes = tc.ty.bytes_for(x.len() as u64).unwrap_or(0) as usize;
                    let out: &mut [u8] = self.write(id, pos * tc.nb[1], bytes);
                    if !tc.ty.kv_writer().is_some_and(|store| store(x, out)) {
                        self.fail(id, BAD_INDEX);
                    }
                    continue;
                }
                for (e, &v) in x.iter().enumerate() {
                    let at = if transposed {
                        e * tc.nb[1] + pos * tc.nb[0]
                    } else {
                        pos * tc.nb[1] + e * tc.nb[0]
                    };
                    self.put(id, tc.ty, at, v);
                }
            }
        }
    }

    /// Attention in one pass per (token, KV head, run of query heads).
    fn flash_attn(&self, id: TensorId, t: &Tensor, ne: [usize; 4], step: Step, ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else {
                return;
            };
            let (hd, hd_v) = (tq.ne[0], tv.ne[0]);
            let n_kv = tk.ne_for(step.n_kv)[1];
            let group = tq.ne[2] / tk.ne[2];
            let (causal, window, scale) = (t.params.i[0] != 0, t.params.i[1] as usize, t.params.f[0]);
            let mut q16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
            let mut acc16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
            // A prompt's tokens over an f16 or f32 cache take the f32 tiles (as llama.cpp's
            // batches of 64 tokens or more): the tokens of a run of that many of one sequence
            // (`in_prompt_run`), so a server slot's next token beside another slot's prompt is
            // computed as it is alone. The other tokens over a cache of other types than f16
            // keys and values take the typed kernel.
            let tiles = attn_tile::prompt_takes_tiles(path, ne[2], tk.ty, tv.ty, hd, hd_v);
            let tiled = |tok: usize| tiles && self.in_prompt_run(t, tok, ne[2]);
            if tiles {
                self.flash_attn_tiles(id, t, ne, step, TileKernel::Float(path, tk.ty), tiled, ith, nth);
                if t.src[3].is_none() {
                    return;
                }
            }
            if (tk.ty, tv.ty) != (GgmlType::F16, GgmlType::F16) {
                match KvOps::new(path, tk.ty, tv.ty) {
                    Some(ops) => {
                        let rest = |tok: usize| !tiled(tok);
                        self.flash_attn_tiles(id, t, ne, step, TileKernel::Typed(ops), rest, ith, nth)
                    }
                    None => self.fail(id, BAD_INDEX),
                }
                return;
            }
            // Work units are (token, KV head, run of its query heads): the heads of one KV
            // head share their keys and values, up to FLASH_ROWS per kernel call; single
            // heads when that leaves too few units to share between the threads.
            let group = group.max(1);
            let n_kv_heads = ne[1] / group;
            let runs = group.div_ceil(kernels::FLASH_ROWS);
            let run = if ne[2] * n_kv_heads * runs >= 2 * nth { group.div_ceil(runs) } else { 1 };
            let runs = group.div_ceil(run);
            for u in share(ne[2] * n_kv_heads * runs, ith, nth) {
                let (tok, kv_head, c) = (u / (n_kv_heads * runs), u / runs % n_kv_heads, u % runs);
                if tiled(tok) {
                    continue;
                }
                let first = kv_head * group + c * run;
                let heads = first..(first + run).min((kv_head + 1) * group);
                let (start, end) = match self.place(t.src[3], tok) {
                    // This token's sequence: its rows from `first`, up to its position.
                    Some(Some((first, pos))) if first + pos < n_kv => {
                        let (start, end) = visible_keys(causal, window, pos, pos + 1);
                        (first + start, first + end)
                    }
                    Some(_) => {
                        self.fail(id, BAD_INDEX);
                        (0, 0)
                    }
                    None => visible_keys(causal, window, step.n_past + tok, n_kv),
                };
                let mut qs: [&[f32]; kernels::FLASH_ROWS] = [&[]; kernels::FLASH_ROWS];
                let mut outs: [&mut [f32]; kernels::FLASH_ROWS] = Default::default();
                for (i, head) in heads.clone().enumerate() {
                    qs[i] = self.read(q, tq.row_offset(tok, head, 0), hd);
                    outs[i] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                }
                let n = heads.len();
                // Row j of this KV head's keys (values) is `read`'s row at base + j stride,
                // the bases hoisted out of the kernel's per-key calls.
                let kp = self.ptrs[k.index()].wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
                let vp = self.ptrs[v.index()].wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
                let (ks, vs) = (tk.nb[1], tv.nb[1]);
                let key = |j| core::slice::from_raw_parts(kp.wrapping_add(j * ks).cast::<F16Le>(), hd);
                let value = |j| core::slice::from_raw_parts(vp.wrapping_add(j * vs).cast::<F16Le>(), hd_v);
                let own = row_parts(end - start);
                if own >= 2 && own * hd_v <= MERGE_FLOATS {
                    // A long row is summed in its parts and merged, as a split step sums it (see
                    // `row_parts`): each part's keys once for the heads of a call.
                    let mut parts = [0f32; MERGE_FLOATS];
                    sum_rows_in_parts(
                        &mut parts,
                        &mut outs[..n],
                        |_| own,
                        |rows, part, o| {
                            kernels::flash_attn_rows(
                                path,
                                &qs[rows.clone()],
                                &mut q16[..rows.len() * hd],
                                part_keys(&(start..end), part, own),
                                key,
                                value,
                                scale,
                                &mut acc16[..rows.len() * hd_v],
                                o,
                            )
                        },
                    );
                    continue;
                }
                kernels::flash_attn_rows(
                    path,
                    &qs[..n],
                    &mut q16[..n * hd],
                    start..end,
                    key,
                    value,
                    scale,
                    &mut acc16[..n * hd_v],
                    &mut outs[..n],
                );
            }
        }
    }

    /// Phase 0 of a split attention (see [`SPLIT_PARTS`]): units of (token, KV head, run of its
    /// query heads, part of `parts`), each attending over its part of the token's keys into its
    /// rows' slots of the work region.
    #[allow(clippy::too_many_arguments)]
    fn flash_attn_parts(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        parts: usize,
        ith: usize,
        nth: usize,
    ) {
        const ROWS: usize = if TYPED_ROWS > kernels::FLASH_ROWS { TYPED_ROWS } else { kernels::FLASH_ROWS };
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else { return };
        let (hd, hd_v, scale) = (tq.ne[0], tv.ne[0], t.params.f[0]);
        let n_kv = tk.ne_for(step.n_kv)[1];
        let group = (tq.ne[2] / tk.ne[2]).max(1);
        let n_kv_heads = ne[1] / group;
        // An f16 cache takes the f16 kernel, any other the typed one (as `flash_attn`).
        let typed = if (tk.ty, tv.ty) == (GgmlType::F16, GgmlType::F16) {
            None
        } else {
            match KvOps::new(self.path, tk.ty, tv.ty) {
                Some(ops) => Some(ops),
                None => return self.fail(id, BAD_INDEX),
            }
        };
        let most = match typed {
            Some(ops) => match typed_rows(&ops, hd, hd_v) {
                Some(rows) => rows,
                None => return self.fail(id, BAD_INDEX),
            },
            None => kernels::FLASH_ROWS,
        };
        let run = group.min(most);
        let runs = group.div_ceil(run);
        let stride = split_stride(hd_v);
        let (kb, vb) = (
            tk.ty.bytes_for(hd as u64).unwrap_or(0) as usize,
            tv.ty.bytes_for(hd_v as u64).unwrap_or(0) as usize,
        );
        let (ks, vs) = (tk.nb[1], tv.nb[1]);
        let mut q16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
        let mut acc16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
        // The typed kernel's scratch, made once for all of this thread's units.
        let mut typed_scratch: Option<TypedScratch> = None;
        for u in share(ne[2] * n_kv_heads * runs * parts, ith, nth) {
            let part = u % parts;
            let (tok, kv_head, c) =
                (u / (parts * runs * n_kv_heads), u / (parts * runs) % n_kv_heads, u / parts % runs);
            let first = kv_head * group + c * run;
            let heads = first..(first + run).min((kv_head + 1) * group);
            let Some(seen) = self.visible(t, tok, n_kv, step) else { return self.fail(id, BAD_INDEX) };
            // The row's own parts (see `row_parts`): a row in one pass goes straight to its
            // output in its part 0 (the merge skips it); parts past its own are empty.
            let own = row_parts(seen.len());
            let direct = own == 0;
            if direct && part > 0 {
                continue;
            }
            let keys = match own {
                0 => seen.clone(),
                p if part < p => part_keys(&seen, part, p),
                _ => seen.start..seen.start,
            };
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            let mut outs: [&mut [f32]; ROWS] = Default::default();
            let mut ends: [&mut [f32]; ROWS] = Default::default();
            let n = heads.len();
            for (i, head) in heads.enumerate() {
                let slot = (tok * ne[1] + head) * SPLIT_PARTS + part;
                // SAFETY: shapes and strides were checked by the graph builder, spans by `new`;
                // the slots of rows (tok, head) at this part lie in the work region (`split_of`
                // checked its size and alignment) and belong to this unit alone, as does the
                // output row of a row in one pass.
                unsafe {
                    qs[i] = self.read(q, tq.row_offset(tok, head, 0), hd);
                    if direct {
                        outs[i] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                    } else {
                        let slot = core::slice::from_raw_parts_mut(
                            self.converted.cast::<f32>().add(slot * stride),
                            stride,
                        );
                        (ends[i], outs[i]) = slot.split_at_mut(2);
                    }
                }
            }
            // (A row in one pass keeps no softmax end: the merge skips it.)
            let mut put = |i: usize, end: RowSoftmax| {
                if !direct {
                    ends[i][0] = end.max;
                    ends[i][1] = end.sum;
                }
            };
            if keys.is_empty() && !direct {
                (0..n).for_each(|i| put(i, RowSoftmax::EMPTY));
                continue;
            }
            // Row j of this KV head's keys (values) is at base + j stride.
            let kp = self.ptrs[k.index()].wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
            let vp = self.ptrs[v.index()].wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
            match typed {
                Some(ops) => {
                    // SAFETY: rows j < n_kv of the cache views, inside their checked spans.
                    let key = |j| unsafe { core::slice::from_raw_parts(kp.wrapping_add(j * ks), kb) };
                    // SAFETY: as above.
                    let value = |j| unsafe { core::slice::from_raw_parts(vp.wrapping_add(j * vs), vb) };
                    let ranges: [Range<usize>; ROWS] = core::array::from_fn(|_| keys.clone());
                    let TypedScratch { qconv, acc, vals } =
                        typed_scratch.get_or_insert_with(TypedScratch::new);
                    let (qs, ranges, outs) = (&qs[..n], &ranges[..n], &mut outs[..n]);
                    let got = kernels::kv_attn::flash_attn_rows_typed(
                        &ops, qs, qconv, ranges, key, value, scale, acc, vals, outs,
                    );
                    (0..n).for_each(|i| put(i, got[i]));
                }
                None => {
                    // SAFETY: f16 rows j < n_kv of the cache views, inside their checked spans.
                    let key = |j| unsafe {
                        core::slice::from_raw_parts(kp.wrapping_add(j * ks).cast::<F16Le>(), hd)
                    };
                    // SAFETY: as above.
                    let value = |j| unsafe {
                        core::slice::from_raw_parts(vp.wrapping_add(j * vs).cast::<F16Le>(), hd_v)
                    };
                    let got = kernels::flash_attn_rows(
                        self.path,
                        &qs[..n],
                        &mut q16[..n * hd],
                        keys,
                        key,
                        value,
                        scale,
                        &mut acc16[..n * hd_v],
                        &mut outs[..n],
                    );
                    (0..n).for_each(|i| put(i, got[i]));
                }
            }
        }
    }

    /// Phase 1 of a split attention: each output row merged from its parts' slots (a row in one
    /// pass, see `row_parts`, has its output already).
    fn merge_attn_parts(
        &self,
        id: TensorId,
        ne: [usize; 4],
        step: Step,
        parts: usize,
        ith: usize,
        nth: usize,
    ) {
        let (dv, heads) = (ne[0], ne[1]);
        let stride = split_stride(dv);
        let t = self.graph.tensor(id);
        let Some(k) = t.src[1] else { return };
        let n_kv = self.graph.tensor(k).ne_for(step.n_kv)[1];
        for row in share(ne[2] * heads, ith, nth) {
            let (tok, head) = (row / heads, row % heads);
            let Some(seen) = self.visible(t, tok, n_kv, step) else { return self.fail(id, BAD_INDEX) };
            if row_parts(seen.len()) == 0 {
                continue;
            }
            // SAFETY: the row's slots lie in the work region (`split_of` checked it), written in
            // phase 0 a barrier ago and read-only now; output row (head, tok) is inside the
            // node's checked span and belongs to this thread.
            let (slots, out) = unsafe {
                let at = self.converted.cast::<f32>().add(row * SPLIT_PARTS * stride);
                (
                    core::slice::from_raw_parts(at, parts * stride),
                    self.write::<f32>(id, t.row_offset(head, tok, 0), dv),
                )
            };
            let ends: [RowSoftmax; SPLIT_PARTS] = core::array::from_fn(|c| {
                if c < parts {
                    RowSoftmax { max: slots[c * stride], sum: slots[c * stride + 1] }
                } else {
                    RowSoftmax::EMPTY
                }
            });
            kernels::merge_attn_parts(&ends[..parts], |c| &slots[c * stride + 2..(c + 1) * stride], out);
        }
    }

    /// Whether token `tok` of attention node `t` (of `n` tokens) is one of a run of
    /// [`attn_tile::TILE_MIN_TOKENS`] or more consecutive tokens of its sequence: a prompt's chunk,
    /// not a slot's next token and its guesses. Every token of a step without a places table is of
    /// one sequence.
    fn in_prompt_run(&self, t: &Tensor, tok: usize, n: usize) -> bool {
        let least = attn_tile::TILE_MIN_TOKENS;
        let Some(Some((first, _))) = self.place(t.src[3], tok) else { return n >= least };
        let same = |i: usize| matches!(self.place(t.src[3], i), Some(Some((f, _))) if f == first);
        let before = (1..least.min(tok + 1)).take_while(|&d| same(tok - d)).count();
        let after = (tok + 1..n.min(tok + least)).take_while(|&i| same(i)).count();
        before + 1 + after >= least
    }

    /// The keys token `tok` of an attention node sees (its sequence's rows up to its position,
    /// within the window); `None` for a bad place (the node fails).
    fn visible(&self, t: &Tensor, tok: usize, n_kv: usize, step: Step) -> Option<Range<usize>> {
        let (causal, window) = (t.params.i[0] != 0, t.params.i[1] as usize);
        match self.place(t.src[3], tok) {
            Some(Some((first, pos))) if first + pos < n_kv => {
                let (start, end) = visible_keys(causal, window, pos, pos + 1);
                Some(first + start..first + end)
            }
            Some(_) => None,
            None => {
                let (start, end) = visible_keys(causal, window, step.n_past + tok, n_kv);
                Some(start..end)
            }
        }
    }

    /// Attention of the tokens `computes` accepts in work units of (tokens, KV head, run of its
    /// query heads) by a kernel that takes rows with keys of their own (the typed kernel, the f32
    /// tiles): a prompt's tokens go in tiles, so every key and value row is read once per tile
    /// instead of once per token.
    #[allow(clippy::too_many_arguments)]
    fn flash_attn_tiles(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        kernel: TileKernel,
        computes: impl Fn(usize) -> bool,
        ith: usize,
        nth: usize,
    ) {
        const ROWS: usize = if TYPED_ROWS > attn_tile::TILE_ROWS { TYPED_ROWS } else { attn_tile::TILE_ROWS };
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else { return };
        let (hd, hd_v, scale) = (tq.ne[0], tv.ne[0], t.params.f[0]);
        let n_kv = tk.ne_for(step.n_kv)[1];
        let group = (tq.ne[2] / tk.ne[2]).max(1);
        let n_kv_heads = ne[1] / group;
        // Rows per call: what the kernel's scratch holds.
        let most = match kernel {
            TileKernel::Typed(ops) => match typed_rows(&ops, hd, hd_v) {
                Some(rows) => rows,
                None => return self.fail(id, BAD_INDEX),
            },
            TileKernel::Float(..) => attn_tile::tile_rows(hd, hd_v),
        };
        let mut run = group.min(most);
        let mut tile = (most / run).max(1);
        // Enough units for every thread: smaller tiles, then single heads (decode).
        while tile > 1 && ne[2].div_ceil(tile) * n_kv_heads * group.div_ceil(run) < 2 * nth {
            tile /= 2;
        }
        if ne[2] * n_kv_heads * group.div_ceil(run) < 2 * nth {
            run = 1;
        }
        let (runs, tiles) = (group.div_ceil(run), ne[2].div_ceil(tile));
        let (kb, vb) = (
            tk.ty.bytes_for(hd as u64).unwrap_or(0) as usize,
            tv.ty.bytes_for(hd_v as u64).unwrap_or(0) as usize,
        );
        let (ks, vs) = (tk.nb[1], tv.nb[1]);
        // The typed kernel's scratch, made once for all of this thread's units.
        let mut typed_work: Option<TypedWork> = None;
        // KV head outermost: a thread's consecutive units read the same keys and values, which
        // stay in its cache between them.
        for u in share(tiles * n_kv_heads * runs, ith, nth) {
            let (kv_head, tl, c) = (u / (tiles * runs), u / runs % tiles, u % runs);
            let first = kv_head * group + c * run;
            let heads = first..(first + run).min((kv_head + 1) * group);
            let tokens = tl * tile..((tl + 1) * tile).min(ne[2]);
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            let mut outs: [&mut [f32]; ROWS] = Default::default();
            let mut keys: [Range<usize>; ROWS] = Default::default();
            let mut n = 0;
            for tok in tokens.filter(|&tok| computes(tok)) {
                let Some(range) = self.visible(t, tok, n_kv, step) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                for head in heads.clone() {
                    // SAFETY: shapes and strides were checked by the graph builder, spans by
                    // `new`; this unit's (token, head) rows belong to this thread.
                    unsafe {
                        qs[n] = self.read(q, tq.row_offset(tok, head, 0), hd);
                        outs[n] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                    }
                    keys[n] = range.clone();
                    n += 1;
                }
            }
            // Row j of this KV head's keys (values) is at base + j stride.
            let kp = self.ptrs[k.index()].wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
            let vp = self.ptrs[v.index()].wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
            // SAFETY: rows j < n_kv of the cache views, inside their checked spans.
            let key = |j| unsafe { core::slice::from_raw_parts(kp.wrapping_add(j * ks), kb) };
            // SAFETY: as above.
            let value = |j| unsafe { core::slice::from_raw_parts(vp.wrapping_add(j * vs), vb) };
            match kernel {
                TileKernel::Typed(ops) => {
                    let work = typed_work.get_or_insert_with(TypedWork::new);
                    flash_attn_typed_rows(
                        work,
                        &ops,
                        &qs[..n],
                        &keys[..n],
                        key,
                        value,
                        scale,
                        &mut outs[..n],
                    );
                }
                TileKernel::Float(path, ty) => {
                    flash_attn_float(path, ty, &qs[..n], &keys[..n], key, value, scale, &mut outs[..n])
                }
            }
        }
    }

    /// Element `idx` of F32/F16 tensor `id` with any strides.
    ///
    /// # Safety
    /// `idx` within the tensor's effective shape.
    unsafe fn element(&self, id: TensorId, t: &Tensor, idx: [usize; 4], _ne: [usize; 4]) -> f32 {
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
    unsafe fn put(&self, id: TensorId, ty: GgmlType, offset: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            match ty {
                GgmlType::F16 => self.write::<u16>(id, offset, 1)[0] = f16::from_f32(v).to_bits(),
                _ => self.write::<f32>(id, offset, 1)[0] = v,
            }
        }
    }

    /// Phase 0 of a converting matmul: input rows to the weights' activation type, in the shared
    /// converted area at a fixed row stride (the upper-bound row length), split over the threads.
    fn convert_input(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { return };
        let (tw, tx) = (self.graph.tensor(w), self.graph.tensor(x));
        let Some(act) = converted_input(t, tw) else { return };
        let ne = tx.ne_for(step.n_kv);
        let stride = converted_stride(act, tx.ne[0]);
        let packed = self.packed_for(t, tw).is_some();
        let path = self.path;
        let len =
            if packed { act_row_bytes(ne[0]) } else { act.bytes_for(ne[0] as u64).unwrap_or(0) as usize };
        for (r, (i1, i2, i3)) in rows(ne, share(rows_of(ne), ith, nth)).enumerate() {
            let flat = share(rows_of(ne), ith, nth).start + r;
            debug_assert!((flat + 1) * stride <= self.converted_len);
            // SAFETY: row (i1, i2, i3) is inside x's checked span; converted row `flat` lies in the
            // converted area (sized by `work_bytes` for every row) and belongs to this thread.
            unsafe {
                let src: &[f32] = self.read(x, tx.row_offset(i1, i2, i3), ne[0]);
                let dst = core::slice::from_raw_parts_mut(self.converted.add(flat * stride), len);
                if packed {
                    // The converted area is 64-aligned and the stride a multiple of 4.
                    match bytemuck::try_cast_slice_mut::<u8, ActBlock>(dst) {
                        Ok(blocks) => kernels::quantize_act(path, src, blocks),
                        Err(_) => self.fail(id, BAD_INDEX),
                    }
                } else {
                    from_float_ref(act, src, dst);
                }
            }
        }
    }

    /// Converted input row `(i1, i2, i3)` of a matmul whose input has effective shape `ne`.
    /// `len` bytes of it (the ggml type's row, or the `ActBlock` row for repacked weights).
    fn converted_row(
        &self,
        act: GgmlType,
        tx: &Tensor,
        ne: [usize; 4],
        i: (usize, usize, usize),
        len: usize,
    ) -> &[u8] {
        let stride = converted_stride(act, tx.ne[0]);
        debug_assert!(len <= stride);
        let flat = i.0 + ne[1] * (i.1 + ne[2] * i.2);
        // SAFETY: written in phase 0 (a barrier ago); read-only now.
        unsafe { core::slice::from_raw_parts(self.converted.add(flat * stride), len) }
    }

    /// The operands of a matmul node at this step's shapes.
    fn operands<'t>(&'t self, t: &Tensor, step: Step) -> Option<MatOperands<'t>> {
        let (w, x) = (t.src[0]?, t.src[1]?);
        let (tw, tx) = (self.graph.tensor(w), self.graph.tensor(x));
        let (ne_w, ne_x) = (tw.ne_for(step.n_kv), tx.ne_for(step.n_kv));
        Some(MatOperands { w, tw, ne_w, x, tx, ne_x, k: ne_w[0].min(ne_x[0]), act: converted_input(t, tw) })
    }

    /// One output element: weight row `wi` times input row `xi` over `op.k` elements.
    ///
    /// # Safety
    /// Indices inside the effective shapes.
    unsafe fn dot(&self, op: &MatOperands<'_>, wi: (usize, usize, usize), xi: (usize, usize, usize)) -> f32 {
        let w_len = op.tw.ty.bytes_for(op.k as u64).unwrap_or(0) as usize;
        // SAFETY: guaranteed by the caller; F32 rows are 4-byte aligned.
        unsafe {
            let w_bytes: &[u8] = self.read(op.w, op.tw.row_offset(wi.0, wi.1, wi.2), w_len);
            match op.act {
                None => {
                    let x_row: &[f32] = self.read(op.x, op.tx.row_offset(xi.0, xi.1, xi.2), op.k);
                    if matches!(op.tw.storage, Storage::External { buffer: 0, .. }) {
                        // The model file's F32 weight: ggml's scalar dot, as the goldens were made.
                        vec_dot_ref(GgmlType::F32, w_bytes, bytemuck::cast_slice(x_row))
                    } else {
                        // An adapter's weight, or two computed tensors (training): the SIMD dot.
                        kernels::dot_f32(self.path, bytemuck::cast_slice(w_bytes), x_row)
                    }
                }
                Some(act) => {
                    let len = act.bytes_for(op.ne_x[0] as u64).unwrap_or(0) as usize;
                    let x_bytes = self.converted_row(act, op.tx, op.ne_x, xi, len);
                    if (op.tw.ty, act) == (GgmlType::F16, GgmlType::F16) {
                        // f16 weights are never repacked: this is their kernel.
                        crate::kernels::dot_f16(
                            self.path,
                            bytemuck::cast_slice(w_bytes),
                            bytemuck::cast_slice(x_bytes),
                        )
                    } else {
                        vec_dot_ref(op.tw.ty, w_bytes, x_bytes)
                    }
                }
            }
        }
    }

    fn mul_mat(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let Some(op) = self.operands(t, step) else { return };
        if let Some(w) = self.packed_weights(op.tw) {
            self.mul_mat_packed(id, t, &op, &w, ith, nth);
            return;
        }
        let (ne_w, ne_x) = (op.ne_w, op.ne_x);
        let (r2, r3) = ((ne_x[2] / ne_w[2]).max(1), (ne_x[3] / ne_w[3]).max(1));
        // Threads split the weight rows, so one token (decode) still uses every thread.
        let rows_w = share(ne_w[1], ith, nth);
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                for m in rows_w.clone() {
                    for n in 0..ne_x[1] {
                        // SAFETY: indices inside the checked shapes; each thread writes its own m.
                        unsafe {
                            let v = self.dot(&op, (m, i2 / r2, i3 / r3), (n, i2, i3));
                            self.write::<f32>(id, t.row_offset(n, i2, i3) + m * 4, 1)[0] = v;
                        }
                    }
                }
            }
        }
    }

    /// Matmul on repacked weights: threads split the row groups; tokens go to the kernel in tiles
    /// of up to [`PACKED_TOKENS`], each reading its quantized input rows from phase 0.
    fn mul_mat_packed(
        &self,
        id: TensorId,
        t: &Tensor,
        op: &MatOperands<'_>,
        w: &PackedMatrix<'_>,
        ith: usize,
        nth: usize,
    ) {
        let Some(act) = op.act else { return };
        let ne_x = op.ne_x;
        let groups = share(w.groups(), ith, nth);
        if groups.is_empty() || op.k != w.k {
            return;
        }
        let path = self.path;
        // A last group the rows do not fill (see `packed`) writes into `spare` first: only its
        // real rows reach the output.
        let full = groups.start..groups.end.min(w.rows / GROUP_ROWS).max(groups.start);
        let partial = full.end..groups.end;
        let rows = GROUP_ROWS * full.start..GROUP_ROWS * full.end;
        let tail_rows = w.rows % GROUP_ROWS;
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                let mut n = 0;
                while n < ne_x[1] {
                    let tile = (ne_x[1] - n).min(PACKED_TOKENS);
                    let mut acts: [&[ActBlock]; PACKED_TOKENS] = [&[]; PACKED_TOKENS];
                    let mut outs: [&mut [f32]; PACKED_TOKENS] = core::array::from_fn(|_| Default::default());
                    for j in 0..tile {
                        let bytes = self.converted_row(act, op.tx, ne_x, (n + j, i2, i3), act_row_bytes(w.k));
                        let Ok(blocks) = bytemuck::try_cast_slice::<u8, ActBlock>(bytes) else {
                            self.fail(id, BAD_INDEX);
                            return;
                        };
                        acts[j] = blocks;
                        // SAFETY: row n + j of the output, this thread's rows only (its groups).
                        outs[j] = unsafe {
                            self.write::<f32>(id, t.row_offset(n + j, i2, i3) + rows.start * 4, rows.len())
                        };
                    }
                    if !full.is_empty() {
                        kernels::packed_matmul(path, w, full.clone(), &acts[..tile], &mut outs[..tile]);
                    }
                    if !partial.is_empty() {
                        let mut spare = [[0f32; GROUP_ROWS]; PACKED_TOKENS];
                        let mut spare_outs: [&mut [f32]; PACKED_TOKENS] =
                            core::array::from_fn(|_| Default::default());
                        for (o, s) in spare_outs.iter_mut().zip(spare.iter_mut()) {
                            *o = s;
                        }
                        kernels::packed_matmul(
                            path,
                            w,
                            partial.clone(),
                            &acts[..tile],
                            &mut spare_outs[..tile],
                        );
                        for (j, s) in spare_outs[..tile].iter().enumerate() {
                            let at = t.row_offset(n + j, i2, i3) + GROUP_ROWS * partial.start * 4;
                            // SAFETY: the real rows of the last group, owned by this thread.
                            unsafe { self.write::<f32>(id, at, tail_rows) }.copy_from_slice(&s[..tail_rows]);
                        }
                    }
                    n += tile;
                }
            }
        }
    }

    fn mul_mat_id(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let (Some(op), Some(ids)) = (self.operands(t, step), t.src[2]) else { return };
        if let Some(w) = self.packed_experts(op.tw) {
            self.mul_mat_id_packed(id, t, step, &op, &w, ith, nth);
            return;
        }
        let ti = self.graph.tensor(ids);
        let ne = t.ne_for(step.n_kv);
        let rows_w = share(op.tw.ne[1], ith, nth);
        for tok in 0..ne[2] {
            for u in 0..ne[1] {
                // SAFETY: ids is a contiguous I32 [n_used, n_tokens] tensor (graph checked).
                let e = unsafe { self.read::<i32>(ids, ti.row_offset(tok, 0, 0) + u * 4, 1)[0] };
                let Some(e) = usize::try_from(e).ok().filter(|&e| e < op.tw.ne[2]) else {
                    self.fail(id, BAD_INDEX);
                    continue;
                };
                let xu = if op.tx.ne[1] == 1 { 0 } else { u };
                for m in rows_w.clone() {
                    // SAFETY: indices inside the checked shapes; each thread writes its own m.
                    unsafe {
                        let v = self.dot(&op, (m, e, 0), (xu, tok, 0));
                        self.write::<f32>(id, t.row_offset(u, tok, 0) + m * 4, 1)[0] = v;
                    }
                }
            }
        }
    }
}

impl<const N: usize> Bound<'_, N> {
    /// Expert matmul on repacked experts, reading each selected expert's slab in place. Threads
    /// split every expert's row groups the same way; for each expert, the (token, slot) pairs
    /// routed to it go to the kernel in tiles, so a prefill batch streams each slab once.
    #[allow(clippy::too_many_arguments)]
    fn mul_mat_id_packed(
        &self,
        id: TensorId,
        t: &Tensor,
        step: Step,
        op: &MatOperands<'_>,
        w: &PackedMatrix<'_>,
        ith: usize,
        nth: usize,
    ) {
        let (Some(act), Some(ids)) = (op.act, t.src[2]) else { return };
        let ti = self.graph.tensor(ids);
        let (m, n_expert) = (op.tw.ne[1], op.tw.ne[2]);
        let per_expert = m / GROUP_ROWS;
        let local = share(per_expert, ith, nth);
        if local.is_empty() || op.k != w.k {
            return;
        }
        let ne = t.ne_for(step.n_kv);
        let (n_used, n_tokens) = (ne[1], ne[2]);
        let path = self.path;
        let row_bytes = act_row_bytes(w.k);
        let out_at = local.start * GROUP_ROWS * 4;
        let out_len = local.len() * GROUP_ROWS;
        // SAFETY: ids is a contiguous I32 [n_used, n_tokens] tensor (graph checked).
        let picked: &[i32] = unsafe { self.read(ids, ti.row_offset(0, 0, 0), n_used * n_tokens) };
        if picked.iter().any(|&e| usize::try_from(e).map_or(true, |e| e >= n_expert)) {
            self.fail(id, BAD_INDEX);
            return;
        }
        let run_tile = |groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]| {
            #[cfg(feature = "moe-gather-bench")]
            gathered(w, groups.clone(), |copy| {
                kernels::packed_matmul(path, copy, 0..groups.len(), acts, outs)
            });
            #[cfg(not(feature = "moe-gather-bench"))]
            kernels::packed_matmul(path, w, groups, acts, outs);
        };
        for e in 0..n_expert {
            let groups = e * per_expert + local.start..e * per_expert + local.end;
            let mut acts: [&[ActBlock]; PACKED_TOKENS] = [&[]; PACKED_TOKENS];
            let mut outs: [&mut [f32]; PACKED_TOKENS] = core::array::from_fn(|_| Default::default());
            let mut tile = 0;
            for (slot, _) in picked.iter().enumerate().filter(|&(_, &p)| p as usize == e) {
                let (u, tok) = (slot % n_used, slot / n_used);
                let xu = if op.ne_x[1] == 1 { 0 } else { u };
                let bytes = self.converted_row(act, op.tx, op.ne_x, (xu, tok, 0), row_bytes);
                let Ok(blocks) = bytemuck::try_cast_slice::<u8, ActBlock>(bytes) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                acts[tile] = blocks;
                // SAFETY: output row (u, tok), this thread's rows of it only (its row groups).
                outs[tile] = unsafe { self.write::<f32>(id, t.row_offset(u, tok, 0) + out_at, out_len) };
                tile += 1;
                if tile == PACKED_TOKENS {
                    run_tile(groups.clone(), &acts[..tile], &mut outs[..tile]);
                    tile = 0;
                }
            }
            if tile > 0 {
                run_tile(groups, &acts[..tile], &mut outs[..tile]);
            }
        }
    }
}

/// The benchmark's gather-then-matmul baseline (feature `moe-gather-bench`): a copy of row groups
/// `groups` of `w` in a per-thread scratch buffer, handed to `run` as a matrix of its own.
#[cfg(feature = "moe-gather-bench")]
fn gathered<R>(w: &PackedMatrix<'_>, groups: Range<usize>, run: impl FnOnce(&PackedMatrix<'_>) -> R) -> R {
    std::thread_local! {
        static SCRATCH: core::cell::RefCell<(std::vec::Vec<u8>, std::vec::Vec<u8>)> =
            const { core::cell::RefCell::new((std::vec::Vec::new(), std::vec::Vec::new())) };
    }
    let nb = w.k / kernels::packed::BLOCK;
    let (qg, sg) = (nb * w.format.quant_bytes(), nb * w.format.scale_bytes());
    SCRATCH.with_borrow_mut(|(q, s)| {
        q.clear();
        q.extend_from_slice(&w.quants[groups.start * qg..groups.end * qg]);
        s.clear();
        s.extend_from_slice(&w.scales[groups.start * sg..groups.end * sg]);
        let copy =
            PackedMatrix { format: w.format, rows: groups.len() * GROUP_ROWS, k: w.k, quants: q, scales: s };
        run(&copy)
    })
}

/// `fail` kinds: what [`Bound::finish`] reports. A row index (token id, expert id, position)
/// outside its table.
const BAD_INDEX: u32 = 0;
/// A cache write past the end of the KV cache.
const CACHE_FULL: u32 = 1;
/// A non-finite MoE router value.
const ROUTER_NON_FINITE: u32 = 2;

/// Most tokens (or, for `mul_mat_id`, token-expert pairs) handed to one packed-kernel call. The
/// kernels tile them further but loop over a cache-sized run of row groups outside their token
/// tiles, so a call streams its weights (an expert's slab) from memory once: with the default
/// batch, once per batch.
const PACKED_TOKENS: usize = 64; // `session::DEFAULT_BATCH`

/// A matmul's weights and input at one step's shapes, and the type the input was converted to.
struct MatOperands<'t> {
    w: TensorId,
    tw: &'t Tensor,
    ne_w: [usize; 4],
    x: TensorId,
    tx: &'t Tensor,
    ne_x: [usize; 4],
    /// Elements summed per output.
    k: usize,
    /// Type of the converted input, `None` when the F32 input is used directly.
    act: Option<GgmlType>,
}

/// The tensor a view chain ends at, and the view's byte offset from its start.
fn root_of<const N: usize>(g: &Graph<N>, mut id: TensorId) -> (TensorId, usize) {
    let mut offset = 0;
    while let Storage::View { base, offset: o } = g.tensor(id).storage {
        offset += o;
        id = base;
    }
    (id, offset)
}

/// Bytes of converted queries and floats of accumulators the typed kernel's scratch holds (rows
/// per call: as many as fit, up to `TYPED_ROWS`; at least one head of up to 1024 dimensions).
const TYPED_QCONV: usize = 16384;
const TYPED_ACC: usize = 4096;
/// Floats of widened value rows the typed kernel's scratch holds: a chunk of keys for heads of up
/// to 256 dimensions, fewer keys at a time above.
const TYPED_VALS: usize = kernels::kv_attn::KEY_CHUNK * 256;

/// Query rows one typed-kernel call takes: as many as its scratch holds (converted queries of
/// `dk`, accumulators of `dv`), up to `TYPED_ROWS`; `None` for a head size the cache type cannot
/// hold.
fn typed_rows(ops: &KvOps, dk: usize, dv: usize) -> Option<usize> {
    let qb = ops.query_bytes(dk)?;
    Some(TYPED_ROWS.min(TYPED_ACC / dv.max(1)).min(TYPED_QCONV / qb.max(1)).max(1))
}

/// The typed kernel's scratch: converted queries, accumulators, widened values.
struct TypedScratch {
    qconv: [u8; TYPED_QCONV],
    acc: [f32; TYPED_ACC],
    vals: [f32; TYPED_VALS],
}

impl TypedScratch {
    fn new() -> Self {
        Self { qconv: [0; TYPED_QCONV], acc: [0.0; TYPED_ACC], vals: [0.0; TYPED_VALS] }
    }
}

/// The scratch of [`flash_attn_typed_rows`]: the kernel's, and the parts of long rows. Made once
/// per node and thread (zeroing it for every unit cost prompts over a quantized cache 5%).
struct TypedWork {
    scratch: TypedScratch,
    parts: [f32; MERGE_FLOATS],
}

impl TypedWork {
    fn new() -> Self {
        Self { scratch: TypedScratch::new(), parts: [0.0; MERGE_FLOATS] }
    }
}

/// [`kernels::kv_attn::flash_attn_rows_typed`] for rows of a step that does not split: a row that sees
/// [`SPLIT_MIN_KEYS`] keys or more is summed in its own parts and merged, as a split step sums it
/// (see `row_parts`), so a token computes the same over a quantized cache alone and in a batch.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn flash_attn_typed_rows<'k>(
    work: &mut TypedWork,
    ops: &KvOps,
    qs: &[&[f32]],
    keys: &[Range<usize>],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(keys.len()).min(outs.len()).min(TYPED_ROWS);
    let Some(dv) = outs.first().map(|o| o.len()) else { return };
    let TypedWork { scratch: TypedScratch { qconv, acc, vals }, parts } = work;
    let mut typed = |qs: &[&[f32]], keys: &[Range<usize>], outs: &mut [&mut [f32]]| {
        kernels::kv_attn::flash_attn_rows_typed(ops, qs, qconv, keys, &key, &value, scale, acc, vals, outs)
    };
    // Row r's parts, if it is summed in parts (as the f16 path: parts that would not fit the
    // buffer leave a row in one pass).
    let own = |r: usize| Some(row_parts(keys[r].len())).filter(|&p| p >= 2 && p * dv <= MERGE_FLOATS);
    // Rows in one pass go in one call; long rows are gathered for their parts.
    let (mut one, mut long) = (0, 0);
    let mut one_qs: [&[f32]; TYPED_ROWS] = [&[]; TYPED_ROWS];
    let mut one_keys: [Range<usize>; TYPED_ROWS] = Default::default();
    let mut one_outs: [&mut [f32]; TYPED_ROWS] = Default::default();
    let mut long_rows = [0usize; TYPED_ROWS];
    let mut long_outs: [&mut [f32]; TYPED_ROWS] = Default::default();
    for (r, out) in outs[..n].iter_mut().enumerate() {
        if own(r).is_none() {
            (one_qs[one], one_keys[one], one_outs[one]) = (qs[r], keys[r].clone(), &mut **out);
            one += 1;
        } else {
            (long_rows[long], long_outs[long]) = (r, &mut **out);
            long += 1;
        }
    }
    if one > 0 {
        typed(&one_qs[..one], &one_keys[..one], &mut one_outs[..one]);
    }
    // Each call sums one part of the long rows it takes (a row's parts past its own are empty).
    let long_rows = &long_rows[..long];
    sum_rows_in_parts(
        parts,
        &mut long_outs[..long],
        |i| own(long_rows[i]).unwrap_or(0),
        |rows, part, o| {
            let rows = &long_rows[rows];
            let part_qs: [&[f32]; TYPED_ROWS] =
                core::array::from_fn(|i| rows.get(i).map_or(&[][..], |&r| qs[r]));
            let ranges: [Range<usize>; TYPED_ROWS] =
                core::array::from_fn(|i| match rows.get(i).and_then(|&r| own(r).map(|p| (r, p))) {
                    Some((r, p)) if part < p => part_keys(&keys[r], part, p),
                    _ => 0..0,
                });
            typed(&part_qs[..rows.len()], &ranges[..rows.len()], o)
        },
    );
}

/// Rows each summed in its own parts (`own(i)` of row i: 2 to [`SPLIT_PARTS`], see `row_parts`)
/// and merged, as a split step sums them: `sum_part(rows, part, outs)` sums part `part` of the
/// rows `rows` (of `outs`) into `outs`, returning their softmax ends; each call takes as many rows
/// as `buf` holds all parts of. (Callers leave a row in one pass whose parts `buf` cannot hold.)
fn sum_rows_in_parts<const K: usize>(
    buf: &mut [f32; MERGE_FLOATS],
    outs: &mut [&mut [f32]],
    own: impl Fn(usize) -> usize,
    mut sum_part: impl FnMut(Range<usize>, usize, &mut [&mut [f32]]) -> [RowSoftmax; K],
) {
    debug_assert!(outs.len() <= K, "more rows than a kernel call takes");
    let n = outs.len().min(K);
    let Some(dv) = outs.first().map(|o| o.len()) else { return };
    let most = (0..n).map(&own).max().unwrap_or(0).min(SPLIT_PARTS);
    debug_assert!(most * dv <= MERGE_FLOATS, "a row's parts do not fit the buffer");
    if most == 0 || most * dv > MERGE_FLOATS {
        return;
    }
    let per_call = (MERGE_FLOATS / (most * dv)).min(K);
    let mut r0 = 0;
    while r0 < n {
        let hn = per_call.min(n - r0);
        let mut ends = [[RowSoftmax::EMPTY; SPLIT_PARTS]; K];
        for part in 0..most {
            let mut o: [&mut [f32]; K] = core::array::from_fn(|_| Default::default());
            for (o, row) in o.iter_mut().zip(buf[part * hn * dv..(part + 1) * hn * dv].chunks_mut(dv)) {
                *o = row;
            }
            let got = sum_part(r0..r0 + hn, part, &mut o[..hn]);
            for (ends, got) in ends.iter_mut().zip(got).take(hn) {
                ends[part] = got;
            }
        }
        for (i, out) in outs[r0..r0 + hn].iter_mut().enumerate() {
            let part_row = |c: usize| &buf[(c * hn + i) * dv..(c * hn + i + 1) * dv];
            kernels::merge_attn_parts(&ends[i][..own(r0 + i).min(SPLIT_PARTS)], part_row, out);
        }
        r0 += hn;
    }
}

/// [`kernels::attn_tile::flash_attn_tile`] with its scratch on this frame.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn flash_attn_float<'k>(
    path: kernels::KernelPath,
    ty: GgmlType,
    qs: &[&[f32]],
    keys: &[Range<usize>],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    let mut scratch = attn_tile::TileScratch::new();
    attn_tile::flash_attn_tile(path, ty, qs, keys, key, value, scale, &mut scratch, outs);
}

/// The kernel of [`Bound::flash_attn_tiles`]: the typed kernel (any cache types), or the f32
/// tiles of a prompt over an f16 or f32 cache.
#[derive(Clone, Copy)]
enum TileKernel {
    Typed(KvOps),
    Float(kernels::KernelPath, GgmlType),
}

/// Keys a query at position `pos` sees: `[start, end)` of `n_kv`.
fn visible_keys(causal: bool, window: usize, pos: usize, n_kv: usize) -> (usize, usize) {
    if !causal {
        return (0, n_kv);
    }
    let end = (pos + 1).min(n_kv);
    let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    (start, end)
}

/// Every index of shape `ne`, innermost first.
fn elements_of(ne: [usize; 4]) -> impl Iterator<Item = [usize; 4]> {
    let n = ne.iter().product::<usize>();
    (0..n).map(move |i| {
        [i % ne[0], i / ne[0] % ne[1], i / (ne[0] * ne[1]) % ne[2], i / (ne[0] * ne[1] * ne[2])]
    })
}

/// Thread `ith` of `nth`'s share of `n` items.
pub fn share(n: usize, ith: usize, nth: usize) -> Range<usize> {
    let nth = nth.max(1);
    (n * ith / nth)..(n * (ith + 1) / nth)
}

fn rows_of(ne: [usize; 4]) -> usize {
    ne[1] * ne[2] * ne[3]
}

/// Row indices `(i1, i2, i3)` for flat rows `range` of shape `ne`.
fn rows(ne: [usize; 4], range: Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> {
    range.map(move |r| (r % ne[1], (r / ne[1]) % ne[2], r / (ne[1] * ne[2])))
}
