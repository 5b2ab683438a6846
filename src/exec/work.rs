//! The work region: what the ops' first phases need of it (a matmul's input converted once per
//! node, a split attention's parts), so the binding can check it and the engine size it without
//! naming the ops.

use crate::graph::{Graph, Op};
use crate::kernels::dot::vec_dot_type;
use crate::kernels::packed::act_row_bytes;
use crate::quant::GgmlType;
use crate::tensor::Tensor;

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

/// The activation type a matmul converts its F32 input to, if any (F32 weights use it as is).
pub(in crate::exec) fn converted_input(t: &Tensor, weights: &Tensor) -> Option<GgmlType> {
    if !matches!(t.op, Op::MulMat | Op::MulMatId) {
        return None;
    }
    vec_dot_type(weights.ty).filter(|&a| a != GgmlType::F32)
}

/// Bytes of the converted input of matmul `t` (rows at their upper-bound length).
pub(in crate::exec) fn converted_bytes<const N: usize>(g: &Graph<N>, t: &Tensor) -> usize {
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
pub(in crate::exec) fn converted_stride(act: GgmlType, k: usize) -> usize {
    let ggml = act.bytes_for(k as u64).unwrap_or(0) as usize;
    let packed = if k % crate::kernels::packed::BLOCK == 0 { act_row_bytes(k) } else { 0 };
    ggml.max(packed).next_multiple_of(4)
}

/// A decode step over a long context splits each query row's keys into up to [`SPLIT_PARTS`]
/// parts, merged in a second phase (llama.cpp splits a decode step's keys between its threads
/// from 512 keys on): the step's (token, KV head) units are too few to keep every thread busy, and
/// threads taking single query heads instead would read each KV head's keys once per head. The
/// parts follow the keys, not the threads, so a result does not depend on the thread count.
pub(in crate::exec) const SPLIT_MIN_KEYS: usize = 512;

/// Most parts per row: a multiple of twice the usual thread counts (the pool hands an
/// attention's units out in `2 nth` shares), so every thread gets as many.
pub(in crate::exec) const SPLIT_PARTS: usize = 16;

/// Steps split when they have fewer (token, KV head) units than this.
pub(in crate::exec) const SPLIT_BELOW_UNITS: usize = 8;

/// The most tokens a step over `kv_heads` KV heads may have and still split its keys: the split's
/// work grows with the tokens, so the engine sizes its work region for this many too.
pub fn most_split_tokens(kv_heads: usize) -> usize {
    (SPLIT_BELOW_UNITS - 1) / kv_heads.max(1)
}

/// Floats per part of a split row in the work region: where its softmax ended (max, sum), then
/// its normalized output.
pub(in crate::exec) fn split_stride(dv: usize) -> usize {
    dv + 2
}

/// Bytes of work region flash attention node `t` needs for its parts; 0 if it never splits (more
/// tokens or KV heads than [`SPLIT_BELOW_UNITS`], or a cache shorter than [`SPLIT_MIN_KEYS`]).
pub(in crate::exec) fn split_bytes<const N: usize>(g: &Graph<N>, t: &Tensor) -> usize {
    let Some(k) = t.src[1].filter(|_| t.op == Op::FlashAttn) else { return 0 };
    let tk = g.tensor(k);
    let (dv, heads, tokens) = (t.ne[0], t.ne[1], t.ne[2]);
    if tokens.saturating_mul(tk.ne[2]) >= SPLIT_BELOW_UNITS || tk.ne[1] < SPLIT_MIN_KEYS {
        return 0;
    }
    tokens * heads * SPLIT_PARTS * split_stride(dv) * size_of::<f32>()
}
