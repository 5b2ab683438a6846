//! Computation graphs with a static capacity.
//!
//! Builder methods create tensors and check shapes and types as they go (kernels run blind later);
//! [`Graph::build`] then orders the nodes that the outputs need, sources first. Nothing allocates:
//! storage is a `heapless::Vec` of capacity `N` (default [`GRAPH_CAPACITY`], set at build time).

pub mod plan;

use core::fmt::{self, Write};

pub use crate::op::{Mask, Op, OpParams, RopeMode};
pub use plan::{plan, plan_unshared, Plan, PlanError};

use crate::build_config::GRAPH_CAPACITY;
use crate::kernels::dot::vec_dot_type;
use crate::quant::GgmlType;
use crate::tensor::{contiguous_strides, Storage, Tensor, TensorId, MAX_SRC};

const _: () = assert!(GRAPH_CAPACITY <= u16::MAX as usize, "tensor ids are u16");

/// Most outputs a graph can have.
pub const MAX_OUTPUTS: usize = 8;

/// Most rotated pairs [`Graph::rope_back`] takes (its angles are negated on the stack).
pub const ROPE_BACK_MAX_PAIRS: usize = 512;

/// Why a graph could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GraphError {
    /// More tensors than the graph's capacity.
    CapacityExceeded {
        /// The capacity (`PINFER_GRAPH_CAPACITY` at build time raises it).
        capacity: usize,
    },
    /// More outputs than [`MAX_OUTPUTS`].
    TooManyOutputs {
        /// The most outputs a graph can have.
        max: usize,
    },
    /// An op's sources have shapes or types it does not accept.
    Invalid {
        /// The op.
        op: &'static str,
        /// The first source's name.
        name: heapless::String<40>,
        /// What is wrong.
        problem: &'static str,
    },
}

impl fmt::Display for GraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CapacityExceeded { capacity } => write!(
                f,
                "graph needs more than {capacity} tensors; rebuild with a larger PINFER_GRAPH_CAPACITY"
            ),
            Self::TooManyOutputs { max } => write!(f, "a graph has at most {max} outputs"),
            Self::Invalid { op, name, problem } => write!(f, "{op} on {name:?}: {problem}"),
        }
    }
}

impl core::error::Error for GraphError {}

/// Whether the reference dequantizer reads rows of `ty` (what `get_rows` needs).
fn can_dequantize(ty: GgmlType) -> bool {
    ty.traits().dequantize.is_some()
}

/// A computation graph of at most `N` tensors.
pub struct Graph<const N: usize = GRAPH_CAPACITY> {
    tensors: heapless::Vec<Tensor, N>,
    order: heapless::Vec<TensorId, N>,
    outputs: heapless::Vec<TensorId, MAX_OUTPUTS>,
}

impl<const N: usize> Default for Graph<N> {
    fn default() -> Self {
        Self::new()
    }
}

type Result<T> = core::result::Result<T, GraphError>;

fn label(name: &str) -> heapless::String<40> {
    let mut s = heapless::String::new();
    for c in name.chars() {
        if s.push(c).is_err() {
            break;
        }
    }
    s
}

impl<const N: usize> Graph<N> {
    /// An empty graph.
    pub const fn new() -> Self {
        Self { tensors: heapless::Vec::new(), order: heapless::Vec::new(), outputs: heapless::Vec::new() }
    }

    /// Forgets every tensor, keeping the storage (to rebuild the same graph for the next step).
    pub fn clear(&mut self) {
        self.tensors.clear();
        self.order.clear();
        self.outputs.clear();
    }

    /// The tensor `id`.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.index()]
    }

    /// All tensors in creation order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The nodes to run, sources first (after [`Graph::build`]).
    pub fn order(&self) -> &[TensorId] {
        &self.order
    }

    /// The outputs given to [`Graph::build`].
    pub fn outputs(&self) -> &[TensorId] {
        &self.outputs
    }

    /// Renames tensor `id` (for reports and errors).
    pub fn set_name(&mut self, id: TensorId, name: fmt::Arguments<'_>) {
        let t = &mut self.tensors[id.index()];
        t.name.clear();
        let _ = t.name.write_fmt(name);
    }

    fn invalid(&self, op: Op, src: TensorId, problem: &'static str) -> GraphError {
        GraphError::Invalid { op: op.name(), name: self.tensor(src).name.clone(), problem }
    }

    fn push(&mut self, t: Tensor) -> Result<TensorId> {
        let id = TensorId(self.tensors.len() as u16);
        self.tensors.push(t).map_err(|_| GraphError::CapacityExceeded { capacity: N })?;
        Ok(id)
    }

    /// A leaf tensor of shape `ne` stored contiguously at `storage`.
    pub fn leaf(&mut self, name: &str, ty: GgmlType, ne: [usize; 4], storage: Storage) -> Result<TensorId> {
        let nb = contiguous_strides(ty, ne).ok_or(GraphError::Invalid {
            op: "leaf",
            name: label(name),
            problem: "row length is not a whole number of blocks, or the size overflows",
        })?;
        self.push(Tensor {
            ty,
            ne,
            nb,
            dyn_kv: 0,
            storage,
            op: Op::None,
            params: OpParams::default(),
            src: [None; MAX_SRC],
            name: label(name),
        })
    }

    /// A computed tensor: contiguous, in a planned activation slot.
    fn node(
        &mut self,
        op: Op,
        ty: GgmlType,
        ne: [usize; 4],
        src: &[TensorId],
        params: OpParams,
    ) -> Result<TensorId> {
        let first = src[0];
        let nb =
            contiguous_strides(ty, ne).ok_or_else(|| self.invalid(op, first, "result size overflows"))?;
        let srcs = sources(src);
        // A result depends on the KV length when a source's dimension it inherits does.
        let dyn_kv = self.tensor(first).dyn_kv;
        let name = self.tensor(first).name.clone();
        self.push(Tensor { ty, ne, nb, dyn_kv, storage: Storage::Activation, op, params, src: srcs, name })
    }

    fn f32_input(&self, op: Op, id: TensorId) -> Result<()> {
        let t = self.tensor(id);
        if t.ty != GgmlType::F32 {
            return Err(self.invalid(op, id, "needs an F32 input"));
        }
        if !t.rows_are_contiguous() {
            return Err(self.invalid(op, id, "needs rows with contiguous elements"));
        }
        Ok(())
    }

    /// Elementwise op on F32 `a` with `b` broadcast over it.
    fn binary(&mut self, op: Op, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.f32_input(op, a)?;
        self.f32_input(op, b)?;
        let (ta, tb) = (self.tensor(a), self.tensor(b));
        // A one-element row broadcasts too (a per-token gate times a row, qwen2moe's shared expert).
        if (ta.ne[0] != tb.ne[0] && tb.ne[0] != 1)
            || (1..4).any(|d| tb.ne[d] == 0 || ta.ne[d] % tb.ne[d] != 0)
        {
            return Err(self.invalid(op, a, "second operand does not broadcast over the first"));
        }
        let ne = ta.ne;
        self.node(op, GgmlType::F32, ne, &[a, b], OpParams::default())
    }

    /// `a + b` (`b` broadcast).
    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Add, a, b)
    }

    /// `a * b` elementwise (`b` broadcast).
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Mul, a, b)
    }

    /// `a - b` (`b` broadcast).
    pub fn sub(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Sub, a, b)
    }

    /// `a / b` elementwise (`b` broadcast).
    pub fn div(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Div, a, b)
    }

    /// `a * a`.
    pub fn sqr(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Sqr, a, OpParams::default())
    }

    /// `sqrt(a)`.
    pub fn sqrt(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Sqrt, a, OpParams::default())
    }

    /// The sum of all of `a`'s elements, F32 `[1, 1, 1, 1]`.
    pub fn sum(&mut self, a: TensorId) -> Result<TensorId> {
        self.f32_input(Op::Sum, a)?;
        self.node(Op::Sum, GgmlType::F32, [1; 4], &[a], OpParams::default())
    }

    /// `a` tiled to shape `ne` (each dimension a multiple of `a`'s).
    pub fn repeat(&mut self, a: TensorId, ne: [usize; 4]) -> Result<TensorId> {
        self.f32_input(Op::Repeat, a)?;
        let na = self.tensor(a).ne;
        if (0..4).any(|d| na[d] == 0 || ne[d] % na[d] != 0) {
            return Err(self.invalid(Op::Repeat, a, "the shape is not a multiple of the source's"));
        }
        self.node(Op::Repeat, GgmlType::F32, ne, &[a], OpParams::default())
    }

    /// `a` summed down to shape `ne` (each of `a`'s dimensions a multiple of it).
    pub fn repeat_back(&mut self, a: TensorId, ne: [usize; 4]) -> Result<TensorId> {
        self.f32_input(Op::RepeatBack, a)?;
        let na = self.tensor(a).ne;
        if (0..4).any(|d| ne[d] == 0 || na[d] % ne[d] != 0) {
            return Err(self.invalid(Op::RepeatBack, a, "the source's shape is not a multiple of this one"));
        }
        self.node(Op::RepeatBack, GgmlType::F32, ne, &[a], OpParams::default())
    }

    /// Makes computed tensor `id` write its result at `offset` in the arena's persistent region
    /// instead of a planned activation slot (a gradient the optimizer reads after the run).
    pub fn persist(&mut self, id: TensorId, offset: usize) -> Result<()> {
        let t = &self.tensors[id.index()];
        if !t.op.computes() || t.storage != Storage::Activation {
            return Err(self.invalid(
                t.op,
                id,
                "only a computed tensor in an activation slot can be made persistent",
            ));
        }
        self.tensors[id.index()].storage = Storage::Persistent { offset };
        Ok(())
    }

    /// RMS norm's input gradient from the input `x` and the output gradient `dy` (same shape).
    pub fn rms_norm_back(&mut self, x: TensorId, dy: TensorId, eps: f32) -> Result<TensorId> {
        self.same_shape_pair(Op::RmsNormBack, x, dy, eps)
    }

    /// Softmax's input gradient from its output `y` and the output gradient `dy`; `scale` is the
    /// softmax's input scale.
    pub fn soft_max_back(&mut self, y: TensorId, dy: TensorId, scale: f32) -> Result<TensorId> {
        self.same_shape_pair(Op::SoftMaxBack, y, dy, scale)
    }

    fn same_shape_pair(&mut self, op: Op, a: TensorId, b: TensorId, f: f32) -> Result<TensorId> {
        self.f32_input(op, a)?;
        self.f32_input(op, b)?;
        if self.tensor(a).ne != self.tensor(b).ne {
            return Err(self.invalid(op, a, "the gradient's shape differs from the input's"));
        }
        let ne = self.tensor(a).ne;
        self.node(op, GgmlType::F32, ne, &[a, b], OpParams { f: [f, 0.0, 0.0, 0.0], ..Default::default() })
    }

    /// Mean cross-entropy of `logits` (F32 `[n_vocab, n]`) against I32 `targets` (`[n]`; negative:
    /// not scored), F32 `[1]` (see [`Op::CrossEntropy`]).
    pub fn cross_entropy(&mut self, logits: TensorId, targets: TensorId) -> Result<TensorId> {
        self.check_targets(Op::CrossEntropy, logits, targets)?;
        self.node(Op::CrossEntropy, GgmlType::F32, [1; 4], &[logits, targets], OpParams::default())
    }

    /// The logits' gradient of [`Graph::cross_entropy`] given the loss's gradient `dloss` (`[1]`).
    pub fn cross_entropy_back(
        &mut self,
        logits: TensorId,
        targets: TensorId,
        dloss: TensorId,
    ) -> Result<TensorId> {
        self.check_targets(Op::CrossEntropyBack, logits, targets)?;
        self.f32_input(Op::CrossEntropyBack, dloss)?;
        if self.tensor(dloss).n_elements() != 1 {
            return Err(self.invalid(Op::CrossEntropyBack, dloss, "the loss's gradient is one value"));
        }
        let ne = self.tensor(logits).ne;
        self.node(Op::CrossEntropyBack, GgmlType::F32, ne, &[logits, targets, dloss], OpParams::default())
    }

    fn check_targets(&self, op: Op, logits: TensorId, targets: TensorId) -> Result<()> {
        self.f32_input(op, logits)?;
        let (tl, tt) = (self.tensor(logits), self.tensor(targets));
        if tt.ty != GgmlType::I32
            || !tt.is_contiguous()
            || tt.n_elements() != tl.ne[1]
            || tl.ne[2] * tl.ne[3] != 1
        {
            return Err(self.invalid(op, targets, "targets are I32, one per row of 2-D logits"));
        }
        Ok(())
    }

    /// `w` (any dequantizable type, `[k, m]`) transposed times F32 `x` (`[m, n]`) → `[k, n]`.
    pub fn mul_mat_t(&mut self, w: TensorId, x: TensorId) -> Result<TensorId> {
        self.f32_input(Op::MulMatT, x)?;
        let (tw, tx) = (self.tensor(w), self.tensor(x));
        if !can_dequantize(tw.ty) || !tw.rows_are_contiguous() {
            return Err(self.invalid(Op::MulMatT, w, "weights of a type the reference dequantizer reads"));
        }
        if tw.ne[2] * tw.ne[3] != 1 || tx.ne[2] * tx.ne[3] != 1 || tw.ne[1] != tx.ne[0] {
            return Err(self.invalid(
                Op::MulMatT,
                w,
                "2-D operands with the weight's rows as long as the input's columns",
            ));
        }
        let ne = [tw.ne[0], tx.ne[1], 1, 1];
        self.node(Op::MulMatT, GgmlType::F32, ne, &[w, x], OpParams::default())
    }

    /// An F32 tensor of shape `ne` with every element `value`.
    pub fn fill(&mut self, name: &str, ne: [usize; 4], value: f32) -> Result<TensorId> {
        let nb = contiguous_strides(GgmlType::F32, ne).ok_or(GraphError::Invalid {
            op: "fill",
            name: label(name),
            problem: "the size overflows",
        })?;
        self.push(Tensor {
            ty: GgmlType::F32,
            ne,
            nb,
            dyn_kv: 0,
            storage: Storage::Activation,
            op: Op::Fill,
            params: OpParams { f: [value, 0.0, 0.0, 0.0], ..Default::default() },
            src: [None; MAX_SRC],
            name: label(name),
        })
    }

    fn unary(&mut self, op: Op, a: TensorId, params: OpParams) -> Result<TensorId> {
        self.f32_input(op, a)?;
        let ne = self.tensor(a).ne;
        self.node(op, GgmlType::F32, ne, &[a], params)
    }

    /// `a * s`.
    pub fn scale(&mut self, a: TensorId, s: f32) -> Result<TensorId> {
        self.unary(Op::Scale, a, OpParams { f: [s, 0.0, 0.0, 0.0], ..Default::default() })
    }

    /// `a`'s rows rotated by the Walsh-Hadamard matrix of size `n` in runs of `n` values (see
    /// [`Op::Hadamard`]); `n` a power of two dividing the row length.
    pub fn hadamard(&mut self, a: TensorId, n: usize) -> Result<TensorId> {
        if !n.is_power_of_two() || n < 2 || self.tensor(a).ne[0] % n != 0 || n > i32::MAX as usize {
            return Err(self.invalid(Op::Hadamard, a, "the size must be a power of two dividing the rows"));
        }
        self.unary(Op::Hadamard, a, OpParams { i: [n as i32, 0, 0, 0], ..Default::default() })
    }

    /// RMS norm of each row.
    pub fn rms_norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.unary(Op::RmsNorm, a, OpParams { f: [eps, 0.0, 0.0, 0.0], ..Default::default() })
    }

    /// Layer norm of each row (no affine part; multiply and add for that).
    pub fn layer_norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.unary(Op::LayerNorm, a, OpParams { f: [eps, 0.0, 0.0, 0.0], ..Default::default() })
    }

    /// SiLU.
    pub fn silu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Silu, a, OpParams::default())
    }

    /// Logistic sigmoid.
    pub fn sigmoid(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Sigmoid, a, OpParams::default())
    }

    /// `tanh(x)` (final-logit soft-capping).
    pub fn tanh(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Tanh, a, OpParams::default())
    }

    /// `ln(1 + exp(x))` (see [`Op::Softplus`]).
    pub fn softplus(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Softplus, a, OpParams::default())
    }

    /// Indices of the `k` largest values of each row of F32 `probs` (`[n, n_tokens]`), as I32
    /// `[k, n_tokens]` (see [`Op::TopK`]).
    pub fn top_k(&mut self, probs: TensorId, k: usize) -> Result<TensorId> {
        let t = self.tensor(probs);
        if t.ty != GgmlType::F32 || !t.is_contiguous() || t.ne[2] != 1 || t.ne[3] != 1 {
            return Err(self.invalid(Op::TopK, probs, "needs a contiguous F32 [n, n_tokens] input"));
        }
        if k == 0 || k > t.ne[0] || k > i32::MAX as usize {
            return Err(self.invalid(Op::TopK, probs, "k must be between 1 and the row length"));
        }
        let ne = [k, t.ne[1], 1, 1];
        self.node(
            Op::TopK,
            GgmlType::I32,
            ne,
            &[probs],
            OpParams { i: [k as i32, 0, 0, 0], ..Default::default() },
        )
    }

    /// `probs` at the indices `ids`, per token, optionally divided by their sum (see
    /// [`Op::MoeWeights`]).
    pub fn moe_weights(&mut self, probs: TensorId, ids: TensorId, normalize: bool) -> Result<TensorId> {
        let (tp, ti) = (self.tensor(probs), self.tensor(ids));
        if tp.ty != GgmlType::F32 || !tp.is_contiguous() || tp.ne[2] != 1 || tp.ne[3] != 1 {
            return Err(self.invalid(Op::MoeWeights, probs, "needs a contiguous F32 [n, n_tokens] input"));
        }
        if ti.ty != GgmlType::I32 || !ti.is_contiguous() || ti.ne[1] != tp.ne[1] || ti.ne[2] != 1 {
            return Err(self.invalid(Op::MoeWeights, ids, "ids must be contiguous I32 [k, n_tokens]"));
        }
        let ne = [ti.ne[0], ti.ne[1], 1, 1];
        let params = OpParams { i: [normalize as i32, 0, 0, 0], ..Default::default() };
        self.node(Op::MoeWeights, GgmlType::F32, ne, &[probs, ids], params)
    }

    /// The expert outputs `experts` (`[m, k, n_tokens]`) weighted by `weights` (`[k, n_tokens]`)
    /// and summed over the experts (see [`Op::MoeSum`]).
    pub fn moe_sum(&mut self, experts: TensorId, weights: TensorId) -> Result<TensorId> {
        self.f32_input(Op::MoeSum, experts)?;
        let (te, tw) = (self.tensor(experts), self.tensor(weights));
        if !te.is_contiguous() || te.ne[3] != 1 {
            return Err(self.invalid(Op::MoeSum, experts, "needs contiguous F32 [m, k, n_tokens]"));
        }
        if tw.ty != GgmlType::F32 || !tw.is_contiguous() || tw.ne[0] != te.ne[1] || tw.ne[1] != te.ne[2] {
            return Err(self.invalid(Op::MoeSum, weights, "weights must be contiguous F32 [k, n_tokens]"));
        }
        let ne = [te.ne[0], te.ne[2], 1, 1];
        self.node(Op::MoeSum, GgmlType::F32, ne, &[experts, weights], OpParams::default())
    }

    /// The mean of each sequence's rows of `x` (`[m, n_tokens]`, F32): output `j` averages the
    /// rows of the span (I32 `[2, n_tokens]`: first row, rows) of token `tokens[j]` (I32
    /// `[n_out]`): see [`Op::SeqMean`]. → `[m, n_out]`.
    pub fn seq_mean(&mut self, x: TensorId, tokens: TensorId, spans: TensorId) -> Result<TensorId> {
        self.f32_input(Op::SeqMean, x)?;
        let (tx, tt, ts) = (self.tensor(x), self.tensor(tokens), self.tensor(spans));
        if !tx.is_contiguous() || tx.ne[2] * tx.ne[3] != 1 {
            return Err(self.invalid(Op::SeqMean, x, "needs contiguous F32 [m, n_tokens]"));
        }
        if tt.ty != GgmlType::I32 || !tt.is_contiguous() || tt.n_rows() != 1 {
            return Err(self.invalid(Op::SeqMean, tokens, "tokens must be one contiguous I32 row"));
        }
        if ts.ty != GgmlType::I32 || !ts.is_contiguous() || ts.ne != [2, tx.ne[1], 1, 1] {
            return Err(self.invalid(Op::SeqMean, spans, "spans must be contiguous I32 [2, n_tokens]"));
        }
        let ne = [tx.ne[0], tt.ne[0], 1, 1];
        self.node(Op::SeqMean, GgmlType::F32, ne, &[x, tokens, spans], OpParams::default())
    }

    /// GELU (tanh approximation).
    pub fn gelu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Gelu, a, OpParams::default())
    }

    fn glu(&mut self, op: Op, gate: TensorId, up: TensorId) -> Result<TensorId> {
        self.f32_input(op, gate)?;
        self.f32_input(op, up)?;
        if self.tensor(gate).ne != self.tensor(up).ne {
            return Err(self.invalid(op, gate, "gate and up shapes differ"));
        }
        let ne = self.tensor(gate).ne;
        self.node(op, GgmlType::F32, ne, &[gate, up], OpParams::default())
    }

    /// `silu(gate) * up`.
    pub fn swiglu(&mut self, gate: TensorId, up: TensorId) -> Result<TensorId> {
        self.glu(Op::SwiGlu, gate, up)
    }

    /// `gelu(gate) * up`.
    pub fn geglu(&mut self, gate: TensorId, up: TensorId) -> Result<TensorId> {
        self.glu(Op::GeGlu, gate, up)
    }

    /// Rows of `table` selected by the I32 `ids` (`[n]`), as F32 `[k, n]`.
    pub fn get_rows(&mut self, table: TensorId, ids: TensorId) -> Result<TensorId> {
        let (t, i) = (self.tensor(table), self.tensor(ids));
        if i.ty != GgmlType::I32 || !i.is_contiguous() || i.n_rows() != 1 {
            return Err(self.invalid(Op::GetRows, ids, "ids must be one contiguous I32 row"));
        }
        if t.ne[2] != 1 || t.ne[3] != 1 || !t.rows_are_contiguous() {
            return Err(self.invalid(Op::GetRows, table, "table must be a 2-D matrix of contiguous rows"));
        }
        if !can_dequantize(t.ty) {
            return Err(self.invalid(Op::GetRows, table, "no kernel reads rows of this type"));
        }
        let ne = [t.ne[0], i.ne[0], 1, 1];
        self.node(Op::GetRows, GgmlType::F32, ne, &[table, ids], OpParams::default())
    }

    /// [`Graph::get_rows`]'s gradient: `d` (F32 `[k, n]`) added into rows `ids` of a zero `[k,
    /// n_rows]` table.
    pub fn get_rows_back(&mut self, d: TensorId, ids: TensorId, n_rows: usize) -> Result<TensorId> {
        self.f32_input(Op::GetRowsBack, d)?;
        let (td, i) = (self.tensor(d), self.tensor(ids));
        if i.ty != GgmlType::I32 || !i.is_contiguous() || i.n_rows() != 1 || i.ne[0] != td.ne[1] {
            return Err(self.invalid(
                Op::GetRowsBack,
                ids,
                "ids must be one contiguous I32 row, one per gradient row",
            ));
        }
        if !td.is_contiguous() || td.ne[2] * td.ne[3] != 1 {
            return Err(self.invalid(Op::GetRowsBack, d, "the gradient must be a contiguous matrix"));
        }
        let ne = [td.ne[0], n_rows, 1, 1];
        self.node(Op::GetRowsBack, GgmlType::F32, ne, &[d, ids], OpParams::default())
    }

    /// RoPE on `x` (`[head_dim, n_head, n_tokens]`, F32): a [`Graph::rope_table`] for `x` and a
    /// [`Graph::rope_with`] by it. Graphs with several RoPEs of the same parameters (the Q and K
    /// of every layer) share one table instead.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &mut self,
        x: TensorId,
        n_rot: usize,
        mode: RopeMode,
        freq_base: f32,
        freq_scale: f32,
        freq_factors: Option<TensorId>,
    ) -> Result<TensorId> {
        let table = self.rope_table(x, n_rot, freq_base, freq_scale, freq_factors, 1.0, None)?;
        self.rope_with(x, table, mode)
    }

    /// The cosines and sines RoPE rotates by, one row per token of `x` (`[head_dim, n_head,
    /// n_tokens]`, F32; only its shape is used): `[n_rot, n_tokens]`, the `n_rot / 2` cosines
    /// then the sines at the token's position. Angles cost a `cosf` and a `sinf` each, so a
    /// graph computes them once per token, not once per head and layer. `mscale` multiplies the
    /// cosines and sines (LongRoPE's attention factor, YaRN's correction; 1: none); `yarn` blends
    /// the angles as YaRN does.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_table(
        &mut self,
        x: TensorId,
        n_rot: usize,
        freq_base: f32,
        freq_scale: f32,
        freq_factors: Option<TensorId>,
        mscale: f32,
        yarn: Option<crate::kernels::reference::Yarn>,
    ) -> Result<TensorId> {
        self.f32_input(Op::Rope, x)?;
        let t = self.tensor(x);
        if n_rot == 0 || n_rot % 2 != 0 || n_rot > t.ne[0] || t.ne[3] != 1 {
            return Err(self.invalid(Op::Rope, x, "n_rot must be even and at most the head size, input 3-D"));
        }
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !(positive(freq_base) && positive(freq_scale) && positive(mscale)) {
            return Err(self.invalid(Op::Rope, x, "frequency base, scale and mscale must be positive"));
        }
        let mut src: heapless::Vec<TensorId, 2> = heapless::Vec::new();
        let _ = src.push(x);
        if let Some(ff) = freq_factors {
            let f = self.tensor(ff);
            if f.ty != GgmlType::F32 || f.ne[0] < n_rot / 2 || f.n_rows() != 1 || !f.is_contiguous() {
                return Err(self.invalid(Op::Rope, ff, "frequency factors must be n_rot/2 contiguous F32"));
            }
            let _ = src.push(ff);
        }
        // YaRN's ramp ends travel as f32 bits in the integer slots; ext_factor 0 means no YaRN.
        let (ext, [lo, hi]) = yarn.map_or((0.0, [0.0; 2]), |y| (y.ext_factor, y.corr_dims));
        if !(ext.is_finite() && lo.is_finite() && hi.is_finite()) {
            return Err(self.invalid(Op::Rope, x, "YaRN parameters must be finite"));
        }
        let i = [n_rot as i32, lo.to_bits() as i32, hi.to_bits() as i32, 0];
        let params = OpParams { i, f: [freq_base, freq_scale, mscale, ext] };
        let ne = [n_rot, t.ne[2], 1, 1];
        self.node(Op::RopeTable, GgmlType::F32, ne, &src, params)
    }

    /// RoPE on `x` (`[head_dim, n_head, n_tokens]`, F32) by `table`, a [`Graph::rope_table`] of
    /// as many tokens; dimensions past the table's `n_rot` are copied.
    pub fn rope_with(&mut self, x: TensorId, table: TensorId, mode: RopeMode) -> Result<TensorId> {
        if self.tensor(table).op != Op::RopeTable {
            return Err(self.invalid(Op::Rope, table, "needs a rope table"));
        }
        self.rope_by(x, table, mode)
    }

    /// RoPE on `x` by a table of angles made otherwise than by one [`Graph::rope_table`] (a 2-D
    /// position's, joined from one table per axis): contiguous F32 `[n_rot, n_tokens]`, each
    /// row the `n_rot / 2` cosines then the sines.
    pub fn rope_by(&mut self, x: TensorId, table: TensorId, mode: RopeMode) -> Result<TensorId> {
        self.f32_input(Op::Rope, x)?;
        let (t, tt) = (self.tensor(x), self.tensor(table));
        let table_ok = tt.ty == GgmlType::F32 && tt.is_contiguous() && tt.ne[0] % 2 == 0 && tt.ne[0] > 0;
        if !table_ok || tt.ne[0] > t.ne[0] || tt.ne[1] != t.ne[2] || tt.ne[2] * tt.ne[3] != 1 || t.ne[3] != 1
        {
            return Err(self.invalid(
                Op::Rope,
                x,
                "needs a rope table of n_rot <= head size, one row per token",
            ));
        }
        let mode = match mode {
            RopeMode::Normal => 0,
            RopeMode::Neox => 1,
        };
        let params = OpParams { i: [tt.ne[0] as i32, mode, 0, 0], ..OpParams::default() };
        let ne = t.ne;
        self.node(Op::Rope, GgmlType::F32, ne, &[x, table], params)
    }

    /// RoPE's gradient: `dy` rotated back by the angles of `table` (the rotation's transpose).
    pub fn rope_back(&mut self, dy: TensorId, table: TensorId, mode: RopeMode) -> Result<TensorId> {
        let id = self.rope_with(dy, table, mode)?;
        if self.tensor(table).ne[0] > 2 * ROPE_BACK_MAX_PAIRS {
            return Err(self.invalid(Op::Rope, dy, "rotates more dimensions than its gradient handles"));
        }
        self.tensors[id.index()].params.i[2] = 1;
        Ok(id)
    }

    /// Softmax of each row of `x * scale`, optionally causal with a sliding window (0: none).
    pub fn soft_max(&mut self, x: TensorId, scale: f32, causal: bool, window: u32) -> Result<TensorId> {
        if window > i32::MAX as u32 {
            return Err(self.invalid(Op::SoftMax, x, "sliding window too large"));
        }
        let params = OpParams { i: [causal as i32, window as i32, 0, 0], f: [scale, 0.0, 0.0, 0.0] };
        self.unary(Op::SoftMax, x, params)
    }

    /// `w` (any type) times F32 `x`: `[k, m, b0, c0] x [k, n, b1, c1] → [m, n, b1, c1]`.
    pub fn mul_mat(&mut self, w: TensorId, x: TensorId) -> Result<TensorId> {
        self.f32_input(Op::MulMat, x)?;
        let (tw, tx) = (self.tensor(w), self.tensor(x));
        if tw.ne[0] != tx.ne[0] {
            return Err(self.invalid(Op::MulMat, w, "inner dimensions differ"));
        }
        if tx.ne[2] % tw.ne[2] != 0 || tx.ne[3] % tw.ne[3] != 0 {
            return Err(self.invalid(Op::MulMat, w, "batch dimensions do not broadcast"));
        }
        if !tw.rows_are_contiguous() {
            return Err(self.invalid(Op::MulMat, w, "weight rows must be contiguous"));
        }
        if vec_dot_type(tw.ty).is_none() {
            return Err(self.invalid(Op::MulMat, w, "no matmul kernel for this weight type"));
        }
        let ne = [tw.ne[1], tx.ne[1], tx.ne[2], tx.ne[3]];
        let id = self.node(Op::MulMat, GgmlType::F32, ne, &[w, x], OpParams::default())?;
        // The result's rows (dimension 0) follow the weight's rows: KV-length dependence comes from w.
        let dyn_w = self.tensor(w).dyn_kv;
        let dyn_x = self.tensor(x).dyn_kv;
        self.tensors[id.index()].dyn_kv = (dyn_w >> 1 & 1) | (dyn_x & !1);
        Ok(id)
    }

    /// Expert matmul (see [`Op::MulMatId`]).
    pub fn mul_mat_id(&mut self, w: TensorId, x: TensorId, ids: TensorId) -> Result<TensorId> {
        self.f32_input(Op::MulMatId, x)?;
        let (tw, tx, ti) = (self.tensor(w), self.tensor(x), self.tensor(ids));
        if tw.ne[0] != tx.ne[0] || tw.ne[3] != 1 || !tw.is_contiguous() {
            return Err(self.invalid(Op::MulMatId, w, "experts must be contiguous [k, m, n_expert]"));
        }
        if vec_dot_type(tw.ty).is_none() {
            return Err(self.invalid(Op::MulMatId, w, "no matmul kernel for this weight type"));
        }
        if ti.ty != GgmlType::I32 || !ti.is_contiguous() || ti.ne[2] != 1 || ti.ne[3] != 1 {
            return Err(self.invalid(Op::MulMatId, ids, "ids must be contiguous I32 [n_used, n_tokens]"));
        }
        if tx.ne[2] != ti.ne[1] || (tx.ne[1] != 1 && tx.ne[1] != ti.ne[0]) || tx.ne[3] != 1 {
            return Err(self.invalid(Op::MulMatId, x, "input must be [k, 1 or n_used, n_tokens]"));
        }
        let ne = [tw.ne[1], ti.ne[0], ti.ne[1], 1];
        self.node(Op::MulMatId, GgmlType::F32, ne, &[w, x, ids], OpParams::default())
    }

    /// `src` converted to `ty` (F32 or F16) in a new contiguous tensor (also makes views contiguous).
    pub fn cpy(&mut self, src: TensorId, ty: GgmlType) -> Result<TensorId> {
        let t = self.tensor(src);
        if !matches!(t.ty, GgmlType::F32 | GgmlType::F16) || !matches!(ty, GgmlType::F32 | GgmlType::F16) {
            return Err(self.invalid(Op::Cpy, src, "copies convert between F32 and F16 only"));
        }
        let ne = t.ne;
        self.node(Op::Cpy, ty, ne, &[src], OpParams::default())
    }

    /// Average pooling of `k` x `k` squares of a grid of vectors: contiguous F32 `x` (`[c, w, h]`,
    /// `w` and `h` multiples of `k`). → `[c, w / k, h / k]`.
    pub fn pool_2d_avg(&mut self, x: TensorId, k: usize) -> Result<TensorId> {
        self.f32_input(Op::Pool2dAvg, x)?;
        let t = self.tensor(x);
        if !t.is_contiguous() || t.ne[3] != 1 || k == 0 || t.ne[1] % k != 0 || t.ne[2] % k != 0 {
            return Err(self.invalid(
                Op::Pool2dAvg,
                x,
                "needs contiguous F32 [c, w, h], w and h multiples of k",
            ));
        }
        let ne = [t.ne[0], t.ne[1] / k, t.ne[2] / k, 1];
        self.node(
            Op::Pool2dAvg,
            GgmlType::F32,
            ne,
            &[x],
            OpParams { i: [k as i32, 0, 0, 0], ..Default::default() },
        )
    }

    /// `a` and `b` (F32) joined along `dim`.
    pub fn concat(&mut self, a: TensorId, b: TensorId, dim: usize) -> Result<TensorId> {
        self.f32_input(Op::Concat, a)?;
        self.f32_input(Op::Concat, b)?;
        let (ta, tb) = (self.tensor(a), self.tensor(b));
        if dim > 3 || (0..4).any(|d| d != dim && ta.ne[d] != tb.ne[d]) {
            return Err(self.invalid(Op::Concat, a, "shapes differ outside the joined dimension"));
        }
        let mut ne = ta.ne;
        ne[dim] += tb.ne[dim];
        self.node(
            Op::Concat,
            GgmlType::F32,
            ne,
            &[a, b],
            OpParams { i: [dim as i32, 0, 0, 0], ..Default::default() },
        )
    }

    /// Writes rows of F32 `src` (`[row, n_tokens]`) into `cache` at rows `n_past..`: a cache of
    /// shape `[row, n_ctx]`, or with `transposed` `[n_ctx, row]` (each element's history contiguous,
    /// as attention's V wants it). The cache is of a KV cache type ([`GgmlType::is_kv_cache_type`]:
    /// rows are converted or quantized as they are written); a transposed one is F32 or F16.
    /// Returns a view of the whole cache that depends on the write, for the attention reads to go
    /// through.
    pub fn kv_write(&mut self, cache: TensorId, src: TensorId, transposed: bool) -> Result<TensorId> {
        self.f32_input(Op::KvWrite, src)?;
        let (tc, ts) = (self.tensor(cache), self.tensor(src));
        let type_ok = if transposed {
            matches!(tc.ty, GgmlType::F32 | GgmlType::F16)
        } else {
            tc.ty.is_kv_cache_type()
        };
        if !tc.is_contiguous() || !type_ok || tc.ne[2] != 1 || tc.ne[3] != 1 {
            return Err(self.invalid(
                Op::KvWrite,
                cache,
                "cache must be a contiguous 2-D matrix of a KV cache type (F32/F16 when transposed)",
            ));
        }
        if !matches!(tc.storage, Storage::Persistent { .. }) {
            return Err(self.invalid(
                Op::KvWrite,
                cache,
                "the cache must live in the arena's persistent region",
            ));
        }
        let (row, n_ctx) = if transposed { (tc.ne[1], tc.ne[0]) } else { (tc.ne[0], tc.ne[1]) };
        if ts.ne[0] != row || ts.ne[2] != 1 || ts.ne[3] != 1 || ts.ne[1] > n_ctx {
            return Err(self.invalid(Op::KvWrite, src, "rows must match the cache rows"));
        }
        let t = Tensor {
            op: Op::KvWrite,
            params: OpParams { i: [transposed as i32, 0, 0, 0], ..Default::default() },
            src: sources(&[src, cache]),
            storage: Storage::View { base: cache, offset: 0 },
            ..tc.clone()
        };
        self.push(t)
    }

    /// The short convolution of `x` (F32 `[n_ch, n_tokens]`) by `taps` (F32 `[k, n_ch]`) with
    /// rolling `states` (F32 `[(k - 1) * n_ch, n_seq]` in the persistent region) at the tokens'
    /// `places` (I32 `[2, n_tokens]`, sequences of `rows_per_seq` cache rows): see
    /// [`Op::ShortConv`]. The result is F32 `[n_ch, n_tokens]`.
    pub fn short_conv(
        &mut self,
        x: TensorId,
        taps: TensorId,
        states: TensorId,
        places: TensorId,
        rows_per_seq: usize,
    ) -> Result<TensorId> {
        self.f32_input(Op::ShortConv, x)?;
        let (tx, tk, ts, tp) = (self.tensor(x), self.tensor(taps), self.tensor(states), self.tensor(places));
        let (n_ch, n_tokens, k) = (tx.ne[0], tx.ne[1], tk.ne[0]);
        if !tx.is_contiguous() || tx.ne[2] != 1 || tx.ne[3] != 1 {
            return Err(self.invalid(Op::ShortConv, x, "inputs must be a contiguous F32 [channels, tokens]"));
        }
        if tk.ty != GgmlType::F32 || !tk.is_contiguous() || k < 2 || tk.ne[1] != n_ch || tk.ne[2] != 1 {
            return Err(self.invalid(
                Op::ShortConv,
                taps,
                "taps must be a contiguous F32 [k >= 2, channels]",
            ));
        }
        let persistent = matches!(ts.storage, Storage::Persistent { .. });
        if ts.ty != GgmlType::F32 || !ts.is_contiguous() || !persistent || ts.ne[0] != (k - 1) * n_ch {
            return Err(self.invalid(
                Op::ShortConv,
                states,
                "states must be a persistent contiguous F32 [(k - 1) * channels, sequences]",
            ));
        }
        if tp.ty != GgmlType::I32 || !tp.is_contiguous() || tp.ne != [2, n_tokens, 1, 1] {
            return Err(self.invalid(Op::ShortConv, places, "places must be contiguous I32 [2, tokens]"));
        }
        let Ok(rows) = i32::try_from(rows_per_seq) else {
            return Err(self.invalid(Op::ShortConv, places, "too many rows per sequence"));
        };
        if rows == 0 {
            return Err(self.invalid(Op::ShortConv, places, "sequences need at least one row"));
        }
        let params = OpParams { i: [rows, 0, 0, 0], ..Default::default() };
        self.node(Op::ShortConv, GgmlType::F32, [n_ch, n_tokens, 1, 1], &[x, taps, states, places], params)
    }

    /// The gated delta rule over `q`, `k` (F32 `[d, n_k_heads, n_tokens]`, rows contiguous), `v`
    /// (F32 `[d, n_v_heads, n_tokens]`), log-decays `g` and strengths `beta` (contiguous F32
    /// `[n_v_heads, n_tokens]`) with `states` (F32 `[d * d * n_v_heads, n_seq]`, persistent) at the
    /// tokens' `places` (sequences of `rows_per_seq` cache rows): see [`Op::GatedDeltaNet`]. The
    /// result is F32 `[d, n_v_heads, n_tokens]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_net(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        g: TensorId,
        beta: TensorId,
        states: TensorId,
        places: TensorId,
        rows_per_seq: usize,
    ) -> Result<TensorId> {
        const OP: Op = Op::GatedDeltaNet;
        for x in [q, k, v, g, beta] {
            self.f32_input(OP, x)?;
        }
        let (tq, tk, tv) = (self.tensor(q), self.tensor(k), self.tensor(v));
        let (d, n_v, n_tokens) = (tv.ne[0], tv.ne[1], tv.ne[2]);
        let n_k = tq.ne[1];
        if tq.ne != tk.ne || tq.ne[0] != d || tq.ne[2] != n_tokens || n_k == 0 || n_v % n_k != 0 {
            return Err(self.invalid(
                OP,
                q,
                "q and k must be [d, n_k_heads, tokens], n_k_heads dividing v's",
            ));
        }
        if tq.ne[3] != 1 || tv.ne[3] != 1 || d == 0 || d > 1024 {
            return Err(self.invalid(OP, v, "q, k, v must be 3-D with heads of at most 1024"));
        }
        for x in [g, beta] {
            let t = self.tensor(x);
            if !t.is_contiguous() || t.ne != [n_v, n_tokens, 1, 1] {
                return Err(self.invalid(
                    OP,
                    x,
                    "decays and strengths must be contiguous [n_v_heads, tokens]",
                ));
            }
        }
        let (ts, tp) = (self.tensor(states), self.tensor(places));
        let persistent = matches!(ts.storage, Storage::Persistent { .. });
        if ts.ty != GgmlType::F32 || !ts.is_contiguous() || !persistent || ts.ne[0] != d * d * n_v {
            return Err(self.invalid(
                OP,
                states,
                "states must be a persistent contiguous F32 [d * d * n_v_heads, sequences]",
            ));
        }
        if tp.ty != GgmlType::I32 || !tp.is_contiguous() || tp.ne != [2, n_tokens, 1, 1] {
            return Err(self.invalid(OP, places, "places must be contiguous I32 [2, tokens]"));
        }
        let rows = i32::try_from(rows_per_seq).ok().filter(|&r| r > 0);
        let Some(rows) = rows else {
            return Err(self.invalid(OP, places, "sequences need 1..=i32::MAX rows"));
        };
        let params = OpParams { i: [rows, 0, 0, 0], ..Default::default() };
        self.node(OP, GgmlType::F32, [d, n_v, n_tokens, 1], &[q, k, v, g, beta, states, places], params)
    }

    /// Attention of `q` (`[head_dim, n_tokens, n_head]`, F32, rows contiguous) over keys `k`
    /// and values `v` (`[head_dim, n_kv, n_kv_head]` of KV cache types, typically views of the KV
    /// cache with a dynamic `n_kv`): see [`Op::FlashAttn`]. The result is
    /// `[head_dim_v, n_head, n_tokens]`.
    pub fn flash_attn(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        scale: f32,
        mask: Mask,
    ) -> Result<TensorId> {
        self.f32_input(Op::FlashAttn, q)?;
        let window = mask.window();
        let (tq, tk, tv) = (self.tensor(q), self.tensor(k), self.tensor(v));
        for (id, t) in [(k, tk), (v, tv)] {
            if !t.ty.is_kv_cache_type() || !t.rows_are_contiguous() || t.ne[3] != 1 {
                return Err(self.invalid(
                    Op::FlashAttn,
                    id,
                    "keys and values must be 3-D, of a KV cache type, with contiguous rows",
                ));
            }
        }
        if tq.ne[0] != tk.ne[0] || tk.ne[1] != tv.ne[1] || tk.ne[2] != tv.ne[2] || tq.ne[3] != 1 {
            return Err(self.invalid(Op::FlashAttn, q, "query, key and value shapes do not match"));
        }
        if tk.ne[2] == 0 || tq.ne[2] % tk.ne[2] != 0 || tq.ne[0] > 1024 || tv.ne[0] > 1024 {
            return Err(self.invalid(
                Op::FlashAttn,
                q,
                "heads must be a multiple of kv heads, head size at most 1024",
            ));
        }
        if window > i32::MAX as u32 || !scale.is_finite() {
            return Err(self.invalid(Op::FlashAttn, q, "bad scale or window"));
        }
        if !mask.causal() && (tk.ty, tv.ty) == (GgmlType::F16, GgmlType::F16) {
            // (The f16 kernel's loop reads causal places only.)
            return Err(self.invalid(
                Op::FlashAttn,
                k,
                "bidirectional attention reads the batch's own keys and values, not an f16 cache",
            ));
        }
        let ne = [tv.ne[0], tq.ne[2], tq.ne[1], 1];
        let one_input = (mask == Mask::OneInput) as i32;
        let params =
            OpParams { i: [mask.causal() as i32, window as i32, one_input, 0], f: [scale, 0.0, 0.0, 0.0] };
        let id = self.node(Op::FlashAttn, GgmlType::F32, ne, &[q, k, v], params)?;
        // The result has no KV-length dimension even though its inputs do.
        self.tensors[id.index()].dyn_kv = 0;
        Ok(id)
    }

    /// [`Graph::flash_attn`] over the batch's own keys (`mask` [`Mask::Bidirectional`]) with
    /// ALiBi: query head `h`'s score of key row `j` gets `slope_h * -|i - j|` (`i` the query's own
    /// row; ggml's slopes from `max_bias` and the heads, `kernels::kv_attn::alibi_slope`) after
    /// its scale. `params.f[1] = max_bias` (a plain node's 0).
    pub fn flash_attn_alibi(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        scale: f32,
        mask: Mask,
        max_bias: f32,
    ) -> Result<TensorId> {
        if mask != Mask::Bidirectional || !(max_bias.is_finite() && max_bias > 0.0) {
            return Err(self.invalid(
                Op::FlashAttn,
                q,
                "ALiBi needs a bidirectional mask (the batch's own keys) and a positive maximum bias",
            ));
        }
        let id = self.flash_attn(q, k, v, scale, mask)?;
        self.tensors[id.index()].params.f[1] = max_bias;
        Ok(id)
    }

    /// Gives a rope table, a cache write or an attention node per-token places instead of the
    /// step's `n_past + t`: `tokens` is I32 `[2, n_tokens]`, token `t`'s (first cache row of its
    /// sequence, position in the sequence). Token `t` then takes the angles of its position,
    /// writes cache row `first + position`, and attends to rows `first..=first + position`
    /// (within the window): several sequences share one batch and one cache. A bidirectional
    /// attention node (see [`Mask::Bidirectional`]) reads a table of spans instead: token `t`'s
    /// (first key row of its sequence, keys of the sequence), and attends to all of them.
    pub fn at_positions(&mut self, node: TensorId, tokens: TensorId) -> Result<()> {
        let t = self.tensor(node);
        let (slot, n_tokens) = match t.op {
            Op::RopeTable => (2, t.ne[1]),
            Op::KvWrite => (2, t.src[0].map_or(0, |s| self.tensor(s).ne[1])),
            Op::FlashAttn => (3, t.ne[2]),
            op => {
                return Err(self.invalid(
                    op,
                    node,
                    "only rope tables, cache writes and attention take positions",
                ))
            }
        };
        let p = self.tensor(tokens);
        if p.ty != GgmlType::I32 || !p.is_contiguous() || p.ne != [2, n_tokens, 1, 1] {
            return Err(self.invalid(t.op, tokens, "positions must be contiguous I32 [2, n_tokens]"));
        }
        self.tensors[node.index()].src[slot] = Some(tokens);
        Ok(())
    }

    /// A view of `base` with shape `ne`, strides `nb` and byte `offset`; `dyn_kv` marks the dims
    /// that follow the KV length of each step. The view must stay inside `base`'s span.
    pub fn view(
        &mut self,
        base: TensorId,
        ne: [usize; 4],
        nb: [usize; 4],
        offset: usize,
        dyn_kv: u8,
    ) -> Result<TensorId> {
        let b = self.tensor(base);
        let mut t = Tensor {
            ne,
            nb,
            dyn_kv,
            storage: Storage::View { base, offset },
            op: Op::View,
            params: OpParams::default(),
            src: sources(&[base]),
            ..b.clone()
        };
        let fits = ne.iter().all(|&n| n > 0)
            && (nb[0] == b.ty.block_bytes() || !b.ty.is_quantized())
            && ne[0] % b.ty.block_len() == 0
            && offset.checked_add(t.span_bytes()).is_some_and(|end| end <= b.span_bytes());
        if !fits {
            return Err(self.invalid(Op::View, base, "view outside the viewed tensor or with split blocks"));
        }
        t.dyn_kv = dyn_kv;
        self.push(t)
    }

    /// `base` (contiguous) seen with another shape of the same element count.
    pub fn reshape(&mut self, base: TensorId, ne: [usize; 4]) -> Result<TensorId> {
        let b = self.tensor(base);
        if !b.is_contiguous() || ne.iter().product::<usize>() != b.n_elements() {
            return Err(self.invalid(
                Op::View,
                base,
                "reshape needs a contiguous tensor and the same element count",
            ));
        }
        let nb = contiguous_strides(b.ty, ne).ok_or_else(|| self.invalid(Op::View, base, "bad reshape"))?;
        self.view(base, ne, nb, 0, 0)
    }

    /// `base` with its dimensions reordered: source dimension `d` becomes dimension `axes[d]`.
    pub fn permute(&mut self, base: TensorId, axes: [usize; 4]) -> Result<TensorId> {
        let b = self.tensor(base);
        let mut seen = [false; 4];
        for &a in &axes {
            if a > 3 || seen[a] {
                return Err(self.invalid(Op::View, base, "permutation axes must be 0..4, each once"));
            }
            seen[a] = true;
        }
        if axes[0] != 0 && b.ty.is_quantized() {
            return Err(self.invalid(Op::View, base, "cannot move the row dimension of a quantized tensor"));
        }
        let (mut ne, mut nb, mut dyn_kv) = ([0; 4], [0; 4], 0u8);
        for d in 0..4 {
            ne[axes[d]] = b.ne[d];
            nb[axes[d]] = b.nb[d];
            if b.dyn_kv & (1 << d) != 0 {
                dyn_kv |= 1 << axes[d];
            }
        }
        let id = self.push(Tensor {
            ne,
            nb,
            dyn_kv,
            storage: Storage::View { base, offset: 0 },
            op: Op::View,
            params: OpParams::default(),
            src: sources(&[base]),
            ..b.clone()
        })?;
        Ok(id)
    }

    /// `base` with dimensions 0 and 1 swapped.
    pub fn transpose(&mut self, base: TensorId) -> Result<TensorId> {
        self.permute(base, [1, 0, 2, 3])
    }

    /// Elements `start..start + len` of dimension `dim` of `base`.
    pub fn slice(&mut self, base: TensorId, dim: usize, start: usize, len: usize) -> Result<TensorId> {
        let b = self.tensor(base);
        let block = if dim == 0 { b.ty.block_len() } else { 1 };
        if dim > 3
            || len == 0
            || start.checked_add(len).is_none_or(|end| end > b.ne[dim])
            || start % block != 0
        {
            return Err(self.invalid(Op::View, base, "slice outside the tensor"));
        }
        let mut ne = b.ne;
        ne[dim] = len;
        let offset = if dim == 0 { start / block * b.nb[0] } else { start * b.nb[dim] };
        let (nb, dyn_kv) = (b.nb, b.dyn_kv);
        self.view(base, ne, nb, offset, dyn_kv)
    }

    /// Orders the nodes that `outputs` depend on, sources first (depth-first, iterative).
    pub fn build(&mut self, outputs: &[TensorId]) -> Result<()> {
        self.build_with_roots(outputs, &[])
    }

    /// [`Graph::build`], also computing `roots` (and what they need) without making them outputs:
    /// nodes that write persistent storage, such as a training step's gradients (any number of
    /// them, where outputs are at most [`MAX_OUTPUTS`]).
    pub fn build_with_roots(&mut self, outputs: &[TensorId], roots: &[TensorId]) -> Result<()> {
        self.order.clear();
        self.outputs.clear();
        if outputs.len() > MAX_OUTPUTS {
            return Err(GraphError::TooManyOutputs { max: MAX_OUTPUTS });
        }
        let n = self.tensors.len();
        // 0 = unvisited, 1 = on the stack, 2 = done.
        let mut state: heapless::Vec<u8, N> = heapless::Vec::new();
        let _ = state.resize(n, 0);
        let mut stack: heapless::Vec<(TensorId, u8), N> = heapless::Vec::new();
        for (i, &out) in outputs.iter().chain(roots).enumerate() {
            if i < outputs.len() {
                let _ = self.outputs.push(out);
            }
            if state[out.index()] != 0 {
                continue;
            }
            let _ = stack.push((out, 0));
            state[out.index()] = 1;
            while let Some(&mut (id, ref mut next_src)) = stack.last_mut() {
                let t = &self.tensors[id.index()];
                if let Some(src) = t.src.get(*next_src as usize) {
                    *next_src += 1;
                    // Sources are always created before their users, so ids only go down: no cycles.
                    if let Some(s) = *src {
                        if state[s.index()] == 0 {
                            state[s.index()] = 1;
                            let _ = stack.push((s, 0));
                        }
                    }
                } else {
                    state[id.index()] = 2;
                    let _ = self.order.push(id);
                    stack.pop();
                }
            }
        }
        Ok(())
    }
}

/// A node's source slots holding `ids` (at most [`MAX_SRC`]), the rest empty.
fn sources(ids: &[TensorId]) -> [Option<TensorId>; MAX_SRC] {
    let mut srcs = [None; MAX_SRC];
    for (slot, &id) in srcs.iter_mut().zip(ids) {
        *slot = Some(id);
    }
    srcs
}
