//! Training in the core: reverse-mode automatic differentiation on the engine's graphs, and the
//! optimizers ([`optim`]: Adam(W), L-BFGS).
//!
//! Parameters are F32 leaves in the arena's persistent region. [`backward`] appends to the graph
//! the nodes that compute the gradient of a scalar loss with respect to each parameter, each
//! ending in a copy into a persistent buffer the caller places (so the optimizer reads every
//! gradient after the run, however many there are); the graph is then built with
//! [`Graph::build_with_roots`], planned and bound like any forward graph. Nothing allocates: the
//! bookkeeping is fixed-capacity, the gradients live in the arena.
//!
//! Ops with a gradient rule: add, sub, mul, div (second operand broadcast), scale, sqr, sqrt,
//! sum, repeat, repeat_back, silu, sigmoid, SwiGLU, rms_norm, soft_max (masked or not), flash
//! attention over a window's F32 keys and values (`attention`: the softmax recomputed),
//! cross-entropy, RoPE, copies, matmuls (F32 operands: both gradients, batched and broadcast as
//! grouped-query attention; 2-D frozen weights of any type: the input's, through the transposed
//! product), reshapes, permutes and transposes.
//! Any other op on a path from a parameter to the loss is refused by name
//! ([`TrainError::NoGradient`]); ops off those paths are free to be anything.

mod attention;
pub mod lora;
pub mod optim;

use crate::graph::{Graph, GraphError, Op};
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};

/// Why a backward graph could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TrainError {
    /// The graph's capacity or an op's shapes.
    Graph(GraphError),
    /// The loss is not an F32 scalar.
    LossNotScalar,
    /// A parameter is not an F32 leaf in the persistent region.
    BadParameter {
        /// Its name.
        name: heapless::String<40>,
    },
    /// As many gradient buffers as parameters are needed.
    GradientCount,
    /// A model or setting the training graphs do not handle yet.
    Unsupported(&'static str),
    /// An architecture with a block that has no backward yet.
    Architecture {
        /// The architecture's GGUF name.
        arch: &'static str,
        /// The block, and the op without a gradient rule.
        block: &'static str,
    },
    /// The model's forward pass could not be built (a missing or misshapen tensor, ...).
    Model(heapless::String<160>),
    /// An op on a path from a parameter to the loss has no gradient rule here.
    NoGradient {
        /// The op.
        op: &'static str,
        /// The node's name.
        name: heapless::String<40>,
    },
}

impl From<GraphError> for TrainError {
    fn from(e: GraphError) -> Self {
        Self::Graph(e)
    }
}

impl TrainError {
    /// The training error of a forward pass that could not be built.
    pub fn model(e: crate::model::ModelError) -> Self {
        match e {
            crate::model::ModelError::Graph(e) => Self::Graph(e),
            e => {
                let mut text = heapless::String::new();
                let _ = core::fmt::write(&mut text, format_args!("{e}"));
                Self::Model(text)
            }
        }
    }
}

impl core::fmt::Display for TrainError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Graph(e) => write!(f, "{e}"),
            Self::LossNotScalar => write!(f, "the loss must be an F32 tensor of one element"),
            Self::BadParameter { name } => {
                write!(f, "parameter {name:?} is not an F32 leaf in the arena's persistent region")
            }
            Self::GradientCount => write!(f, "give one gradient buffer per parameter"),
            Self::Unsupported(what) => write!(f, "not supported: {what}"),
            Self::Architecture { arch, block } => {
                write!(f, "{arch} models cannot be fine-tuned yet: the {block} has no backward")
            }
            Self::Model(e) => write!(f, "{e}"),
            Self::NoGradient { op, name } => {
                write!(f, "{op} ({name:?}) lies between a parameter and the loss and has no gradient rule")
            }
        }
    }
}

impl core::error::Error for TrainError {}

/// The gradients [`backward`] appended: `grads[i]` is parameter `i`'s, a node writing
/// `grad_offsets[i]` of the arena (build the graph with these as roots).
pub type Gradients<'a> = &'a mut [TensorId];

/// Appends to `g` the gradient of `loss` (an F32 scalar) with respect to each of `params` (F32
/// leaves in the persistent region). Gradient `i` is computed into the persistent bytes at
/// `grad_offsets[i]` (as many bytes as the parameter), and its node is written to `grads[i]`;
/// then `g.build_with_roots(&[loss, ...], grads)` orders the forward and backward nodes together.
/// A parameter the loss does not depend on gets a gradient of zeros.
pub fn backward<const N: usize>(
    g: &mut Graph<N>,
    loss: TensorId,
    params: &[TensorId],
    grad_offsets: &[usize],
    grads: Gradients<'_>,
) -> Result<(), TrainError> {
    if params.len() != grad_offsets.len() || params.len() != grads.len() {
        return Err(TrainError::GradientCount);
    }
    let tl = g.tensor(loss);
    if tl.ty != GgmlType::F32 || tl.n_elements() != 1 {
        return Err(TrainError::LossNotScalar);
    }
    for &p in params {
        let t = g.tensor(p);
        if t.ty != GgmlType::F32 || t.op != Op::None || !matches!(t.storage, Storage::Persistent { .. }) {
            return Err(TrainError::BadParameter { name: t.name.clone() });
        }
    }
    g.build(&[loss])?;
    let n = g.tensors().len();
    // The forward order, kept: nodes appended below are not part of it.
    let mut order: heapless::Vec<TensorId, N> = heapless::Vec::new();
    for &id in g.order() {
        let _ = order.push(id);
    }
    // Which nodes depend on a parameter (only their gradients are needed).
    let mut needs: heapless::Vec<bool, N> = heapless::Vec::new();
    let _ = needs.resize(n, false);
    for &p in params {
        needs[p.index()] = true;
    }
    for &id in &order {
        let t = g.tensor(id);
        if t.src.iter().flatten().any(|s| needs[s.index()]) {
            needs[id.index()] = true;
        }
    }
    let mut grad: heapless::Vec<Option<TensorId>, N> = heapless::Vec::new();
    let _ = grad.resize(n, None);
    grad[loss.index()] = Some(g.fill("loss.grad", [1; 4], 1.0)?);

    for &id in order.iter().rev() {
        let Some(dy) = grad[id.index()] else { continue };
        if !needs[id.index()] {
            continue;
        }
        let t = g.tensor(id).clone();
        let src = |i: usize| t.src[i].filter(|s| needs[s.index()]);
        let mut give = |g: &mut Graph<N>, to: TensorId, d: TensorId| -> Result<(), TrainError> {
            let sum = match grad[to.index()] {
                Some(prev) => g.add(prev, d)?,
                None => d,
            };
            grad[to.index()] = Some(sum);
            Ok(())
        };
        match t.op {
            Op::None | Op::Fill => {}
            Op::Add | Op::Sub => {
                if let Some(a) = src(0) {
                    give(g, a, dy)?;
                }
                if let Some(b) = src(1) {
                    let db = reduce_to(g, dy, g.tensor(b).ne)?;
                    let db = if t.op == Op::Sub { g.scale(db, -1.0)? } else { db };
                    give(g, b, db)?;
                }
            }
            Op::Mul => {
                let (a, b) = (t.src[0].unwrap_or(id), t.src[1].unwrap_or(id));
                if let Some(a) = src(0) {
                    let da = g.mul(dy, b)?;
                    give(g, a, da)?;
                }
                if let Some(b) = src(1) {
                    let prod = g.mul(dy, a)?;
                    let db = reduce_to(g, prod, g.tensor(b).ne)?;
                    give(g, b, db)?;
                }
            }
            Op::Div => {
                let b = t.src[1].unwrap_or(id);
                if let Some(a) = src(0) {
                    let da = g.div(dy, b)?;
                    give(g, a, da)?;
                }
                if let Some(bs) = src(1) {
                    // d(a/b)/db = -(a/b)/b: -dy * y / b, summed over the broadcast.
                    let dy_y = g.mul(dy, id)?;
                    let q = g.div(dy_y, b)?;
                    let q = g.scale(q, -1.0)?;
                    let db = reduce_to(g, q, g.tensor(bs).ne)?;
                    give(g, bs, db)?;
                }
            }
            Op::Scale => {
                if let Some(a) = src(0) {
                    let da = g.scale(dy, t.params.f[0])?;
                    give(g, a, da)?;
                }
            }
            Op::Sqr => {
                if let Some(a) = src(0) {
                    let prod = g.mul(dy, a)?;
                    let da = g.scale(prod, 2.0)?;
                    give(g, a, da)?;
                }
            }
            Op::Sqrt => {
                if let Some(a) = src(0) {
                    let half = g.scale(dy, 0.5)?;
                    let da = g.div(half, id)?;
                    give(g, a, da)?;
                }
            }
            Op::Sum => {
                if let Some(a) = src(0) {
                    let da = g.repeat(dy, g.tensor(a).ne)?;
                    give(g, a, da)?;
                }
            }
            Op::Repeat => {
                if let Some(a) = src(0) {
                    let da = g.repeat_back(dy, g.tensor(a).ne)?;
                    give(g, a, da)?;
                }
            }
            Op::RepeatBack => {
                if let Some(a) = src(0) {
                    let da = g.repeat(dy, g.tensor(a).ne)?;
                    give(g, a, da)?;
                }
            }
            Op::Sigmoid => {
                if let Some(a) = src(0) {
                    // s' = s (1 - s) = s - s^2.
                    let s2 = g.sqr(id)?;
                    let ds = g.sub(id, s2)?;
                    let da = g.mul(dy, ds)?;
                    give(g, a, da)?;
                }
            }
            Op::Silu => {
                if let Some(a) = src(0) {
                    // silu' = s + x s (1 - s) = s + silu - silu * s, with s = sigmoid(x).
                    let s = g.sigmoid(a)?;
                    let ys = g.mul(id, s)?;
                    let y_minus = g.sub(id, ys)?;
                    let ds = g.add(s, y_minus)?;
                    let da = g.mul(dy, ds)?;
                    give(g, a, da)?;
                }
            }
            Op::Tanh => {
                if let Some(a) = src(0) {
                    // tanh' = 1 - y^2.
                    let y2 = g.sqr(id)?;
                    let y2dy = g.mul(y2, dy)?;
                    let da = g.sub(dy, y2dy)?;
                    give(g, a, da)?;
                }
            }
            Op::Gelu => {
                if let Some(a) = src(0) {
                    let da = gelu_back(g, a, dy)?;
                    give(g, a, da)?;
                }
            }
            Op::GeGlu => {
                let (gate, up) = (t.src[0].unwrap_or(id), t.src[1].unwrap_or(id));
                // y = gelu(gate) * up.
                if let Some(u) = src(1) {
                    let act = g.gelu(gate)?;
                    let du = g.mul(dy, act)?;
                    give(g, u, du)?;
                }
                if let Some(gs) = src(0) {
                    let dy_up = g.mul(dy, up)?;
                    let dg = gelu_back(g, gate, dy_up)?;
                    give(g, gs, dg)?;
                }
            }
            Op::GetRows => {
                if src(1).is_some() {
                    return Err(TrainError::NoGradient {
                        op: "get_rows (into the ids)",
                        name: t.name.clone(),
                    });
                }
                if let (Some(table), Some(ids)) = (src(0), t.src[1]) {
                    let rows = g.tensor(table).ne[1];
                    let dy_c = contiguous(g, dy)?;
                    let dt = g.get_rows_back(dy_c, ids, rows)?;
                    give(g, table, dt)?;
                }
            }
            Op::Cpy => {
                // A copy (the gradient of a permuted or transposed view then flows through the view).
                if let Some(a) = src(0) {
                    give(g, a, dy)?;
                }
            }
            Op::Rope => {
                if let (Some(a), Some(table)) = (src(0), t.src[1]) {
                    let mode = if t.params.i[1] == 1 {
                        crate::graph::RopeMode::Neox
                    } else {
                        crate::graph::RopeMode::Normal
                    };
                    let dy_c = contiguous(g, dy)?;
                    let da = g.rope_back(dy_c, table, mode)?;
                    give(g, a, da)?;
                }
            }
            Op::RmsNorm => {
                if let Some(a) = src(0) {
                    let da = g.rms_norm_back(a, dy, t.params.f[0])?;
                    give(g, a, da)?;
                }
            }
            Op::SoftMax => {
                if let Some(a) = src(0) {
                    let da = g.soft_max_back(id, dy, t.params.f[0])?;
                    give(g, a, da)?;
                }
            }
            Op::FlashAttn => {
                let wanted = [src(0).is_some(), src(1).is_some(), src(2).is_some()];
                let ds = attention::flash_attn_back(g, id, dy, wanted)?;
                for (s, d) in t.src.iter().zip(ds) {
                    if let (Some(s), Some(d)) = (s, d) {
                        give(g, *s, d)?;
                    }
                }
            }
            Op::CrossEntropy => {
                if let (Some(a), Some(targets)) = (src(0), t.src[1]) {
                    let da = g.cross_entropy_back(a, targets, dy)?;
                    give(g, a, da)?;
                }
            }
            Op::SwiGlu => {
                let (gate, up) = (t.src[0].unwrap_or(id), t.src[1].unwrap_or(id));
                // y = silu(gate) * up.
                let act = g.silu(gate)?;
                if let Some(u) = src(1) {
                    let du = g.mul(dy, act)?;
                    give(g, u, du)?;
                }
                if let Some(gs) = src(0) {
                    let s = g.sigmoid(gate)?;
                    let act_s = g.mul(act, s)?;
                    let act_minus = g.sub(act, act_s)?;
                    let dsilu = g.add(s, act_minus)?;
                    let dy_up = g.mul(dy, up)?;
                    let dg = g.mul(dy_up, dsilu)?;
                    give(g, gs, dg)?;
                }
            }
            Op::MulMat if g.tensor(t.src[0].unwrap_or(id)).ty != GgmlType::F32 => {
                // A frozen quantized (or f16) weight: the gradient flows into the input only.
                let (w, x) = (t.src[0].unwrap_or(id), t.src[1].unwrap_or(id));
                if src(0).is_some() {
                    return Err(TrainError::NoGradient {
                        op: "mul_mat (a quantized parameter)",
                        name: t.name.clone(),
                    });
                }
                let (tw, tx) = (g.tensor(w), g.tensor(x));
                if tw.ne[2] * tw.ne[3] != 1 || tx.ne[2] * tx.ne[3] != 1 {
                    return Err(TrainError::NoGradient {
                        op: "mul_mat (a batched frozen weight)",
                        name: t.name.clone(),
                    });
                }
                if let Some(xs) = src(1) {
                    let dy_c = contiguous(g, dy)?;
                    let dx = g.mul_mat_t(w, dy_c)?;
                    give(g, xs, dx)?;
                }
            }
            Op::MulMat => {
                let (w, x) = (t.src[0].unwrap_or(id), t.src[1].unwrap_or(id));
                let (tw, tx) = (g.tensor(w).clone(), g.tensor(x).clone());
                if tw.ne[3] != tx.ne[3] {
                    return Err(TrainError::NoGradient {
                        op: "mul_mat (broadcast over dim 3)",
                        name: t.name.clone(),
                    });
                }
                // y[i, j, b] = sum_k w[k, i, b / r] x[k, j, b] (r = x's batches per w's, as
                // grouped-query attention): dx = w dy (w^T as the matmul's weights, broadcast the
                // same way), dw[k, i, c] = sum over c's r batches of sum_j x[k, j] dy[i, j].
                if let Some(xs) = src(1) {
                    let wt = g.transpose(w)?;
                    let wt = g.cpy(wt, GgmlType::F32)?;
                    let dx = g.mul_mat(wt, dy)?;
                    give(g, xs, dx)?;
                }
                if let Some(ws) = src(0) {
                    let xt = g.transpose(x)?;
                    let xt = g.cpy(xt, GgmlType::F32)?;
                    let dyt = g.transpose(dy)?;
                    let dyt = g.cpy(dyt, GgmlType::F32)?;
                    let mut dw = g.mul_mat(xt, dyt)?; // [k, m, b1, c]
                    let r = tx.ne[2] / tw.ne[2];
                    if r > 1 {
                        // Batches j * r .. j * r + r belong to w's batch j: sum each run.
                        let (k, m) = (tw.ne[0], tw.ne[1]);
                        let runs = g.reshape(dw, [k * m, r, tw.ne[2], tw.ne[3]])?;
                        let summed = g.repeat_back(runs, [k * m, 1, tw.ne[2], tw.ne[3]])?;
                        dw = g.reshape(summed, tw.ne)?;
                    }
                    give(g, ws, dw)?;
                }
            }
            Op::View => {
                let a = t.src[0].unwrap_or(id);
                let ta = g.tensor(a).clone();
                let Some(a) = src(0) else { continue };
                if ta.is_contiguous() && t.is_contiguous() {
                    // A reshape.
                    let dy_c = contiguous(g, dy)?;
                    let da = g.reshape(dy_c, ta.ne)?;
                    give(g, a, da)?;
                } else if let Some(axes) = permutation_of(&ta, &t) {
                    // A permute or transpose: dy's dimension d goes back to source dimension axes[d].
                    let dy_c = contiguous(g, dy)?;
                    let back = g.permute(dy_c, axes)?;
                    let da = g.cpy(back, GgmlType::F32)?;
                    give(g, a, da)?;
                } else {
                    return Err(TrainError::NoGradient { op: "view (a slice)", name: t.name.clone() });
                }
            }
            other => return Err(TrainError::NoGradient { op: other.name(), name: t.name.clone() }),
        }
    }

    for ((&p, &offset), out) in params.iter().zip(grad_offsets).zip(grads.iter_mut()) {
        let ne = g.tensor(p).ne;
        let d = match grad[p.index()] {
            Some(d) => d,
            None => g.fill("zero.grad", ne, 0.0)?,
        };
        let copy = g.cpy(d, GgmlType::F32)?;
        let name = g.tensor(p).name.clone();
        g.set_name(copy, format_args!("{name}.grad"));
        g.persist(copy, offset)?;
        *out = copy;
    }
    Ok(())
}

/// For a view `v` of all of contiguous `a`'s elements in another order: the source dimension
/// of each of the view's dimensions (`None` if the view is not a permutation, e.g. a slice).
fn permutation_of(a: &crate::tensor::Tensor, v: &crate::tensor::Tensor) -> Option<[usize; 4]> {
    if !a.is_contiguous()
        || a.n_elements() != v.n_elements()
        || v.storage != (Storage::View { base: v.src[0]?, offset: 0 })
    {
        return None;
    }
    let mut axes = [usize::MAX; 4];
    let mut used = [false; 4];
    // Dimensions longer than 1 first (their strides tell them apart), then the ones of length 1.
    for pass in 0..2 {
        for (d, slot) in axes.iter_mut().enumerate() {
            if *slot != usize::MAX || (pass == 0) == (v.ne[d] == 1) {
                continue;
            }
            let s =
                (0..4).find(|&s| !used[s] && a.ne[s] == v.ne[d] && (v.ne[d] == 1 || a.nb[s] == v.nb[d]))?;
            *slot = s;
            used[s] = true;
        }
    }
    Some(axes)
}

/// `d` summed down to shape `ne` (the gradient of an operand broadcast to `d`'s shape).
fn reduce_to<const N: usize>(g: &mut Graph<N>, d: TensorId, ne: [usize; 4]) -> Result<TensorId, TrainError> {
    if g.tensor(d).ne == ne {
        return Ok(d);
    }
    Ok(g.repeat_back(d, ne)?)
}

/// `dy * gelu'(x)` for the tanh form of GELU (the engine's GELU is ggml's table of it):
/// `gelu'(x) = (1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2`, `t = tanh(c (x + a x^3))`.
fn gelu_back<const N: usize>(g: &mut Graph<N>, x: TensorId, dy: TensorId) -> Result<TensorId, TrainError> {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    const A: f32 = 0.044_715;
    let ne = g.tensor(x).ne;
    let one = g.fill("gelu_back.one", ne, 1.0)?;
    let x2 = g.sqr(x)?;
    let x3 = g.mul(x2, x)?;
    let ax3 = g.scale(x3, A)?;
    let inner = g.add(x, ax3)?;
    let u = g.scale(inner, C)?;
    let t = g.tanh(u)?;
    let one_t = g.add(one, t)?;
    let first = g.scale(one_t, 0.5)?;
    let t2 = g.sqr(t)?;
    let sech2 = g.sub(one, t2)?;
    let half_cx = g.scale(x, 0.5 * C)?;
    let q = g.mul(half_cx, sech2)?;
    let ax2 = g.scale(x2, 3.0 * A)?;
    let r = g.add(one, ax2)?;
    let second = g.mul(q, r)?;
    let dgelu = g.add(first, second)?;
    Ok(g.mul(dy, dgelu)?)
}

/// `d` itself when contiguous, else a contiguous copy.
fn contiguous<const N: usize>(g: &mut Graph<N>, d: TensorId) -> Result<TensorId, TrainError> {
    if g.tensor(d).is_contiguous() {
        return Ok(d);
    }
    Ok(g.cpy(d, GgmlType::F32)?)
}

/// A built, bound loss graph (forward and [`backward`] nodes) as an [`optim::Objective`]: the
/// parameters, flattened in the order given, are written into their persistent bytes, the graph
/// runs on the calling thread, and the gradients are read back.
pub struct GraphObjective<'a, const N: usize> {
    bound: crate::exec::Bound<'a, N>,
    loss: TensorId,
    params: &'a [TensorId],
    grads: &'a [TensorId],
}

impl<'a, const N: usize> GraphObjective<'a, N> {
    /// `bound` computes `loss` and, in `grads`, the gradient of each of `params`.
    pub fn new(
        bound: crate::exec::Bound<'a, N>,
        loss: TensorId,
        params: &'a [TensorId],
        grads: &'a [TensorId],
    ) -> Result<Self, TrainError> {
        if params.len() != grads.len() {
            return Err(TrainError::GradientCount);
        }
        Ok(Self { bound, loss, params, grads })
    }

    /// The graph as bound (to read other outputs after a run).
    pub fn bound(&self) -> &crate::exec::Bound<'a, N> {
        &self.bound
    }
}

impl<const N: usize> optim::Objective for GraphObjective<'_, N> {
    type Error = crate::exec::ExecError;

    fn evaluate(&mut self, x: &[f32], grad: &mut [f32]) -> Result<f32, Self::Error> {
        let mut at = 0;
        for &p in self.params {
            let values: &mut [f32] = bytemuck::try_cast_slice_mut(self.bound.data_mut(p)).unwrap_or(&mut []);
            let end = (at + values.len()).min(x.len());
            values[..end - at].copy_from_slice(&x[at..end]);
            at = end;
        }
        self.bound.run(crate::exec::Step::default())?;
        let mut at = 0;
        for &d in self.grads {
            let values: &[f32] = bytemuck::try_cast_slice(self.bound.data(d)).unwrap_or(&[]);
            let end = (at + values.len()).min(grad.len());
            grad[at..end].copy_from_slice(&values[..end - at]);
            at = end;
        }
        Ok(self.bound.data_f32(self.loss).first().copied().unwrap_or(f32::NAN))
    }
}

/// Where a training graph's activations and work area go in an arena whose persistent region
/// (parameters, inputs, gradients) ends at `persistent_end`: (activations, work, arena bytes).
pub fn arena_regions<const N: usize>(
    g: &Graph<N>,
    plan: &crate::graph::Plan<N>,
    persistent_end: usize,
) -> (crate::arena::Region, crate::arena::Region, usize) {
    let align = |n: usize| n.next_multiple_of(crate::graph::plan::ACTIVATION_ALIGN);
    let activations = crate::arena::Region { offset: align(persistent_end), len: align(plan.peak_bytes) };
    let work = crate::arena::Region {
        offset: activations.offset + activations.len,
        len: align(crate::exec::work_bytes(g)),
    };
    (activations, work, work.offset + work.len)
}
