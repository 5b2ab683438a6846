//! The gradient of flash attention over a window (a training graph's attention: the engine's
//! online softmax in the forward pass, so its logits are generation's bit for bit). The backward
//! pass recomputes what the online softmax never holds, the scores and their causal softmax
//! within the window, and differentiates the written-out form of the same function:
//!
//! ```text
//! S = K^T Q, P = softmax(scale S) (masked), O = V P
//! dP = V^T dO, dS = softmax_back(P, dP), dQ = K dS, dK = Q dS^T, dV = dO P^T
//! ```
//!
//! per query head, a KV head's keys and values shared by its group of query heads (grouped-query
//! attention: dK and dV summed over the group).

use crate::graph::Graph;
use crate::quant::GgmlType;
use crate::tensor::TensorId;

use super::TrainError;

/// The gradients of a flash-attention node's query, keys and values (each in its source's shape,
/// `None` where `wanted` says it is not needed), given `dy`, the gradient of its output.
pub(super) fn flash_attn_back<const N: usize>(
    g: &mut Graph<N>,
    node: TensorId,
    dy: TensorId,
    wanted: [bool; 3],
) -> Result<[Option<TensorId>; 3], TrainError> {
    let t = g.tensor(node).clone();
    let (Some(q), Some(k), Some(v)) = (t.src[0], t.src[1], t.src[2]) else {
        return Err(no_gradient("flash_attn (without its inputs)", &t));
    };
    if t.src[3].is_some() {
        // Places mean a KV cache: rows of other steps and sequences, no window of one sequence.
        return Err(no_gradient("flash_attn (over a KV cache)", &t));
    }
    if t.params.f[1] != 0.0 {
        return Err(no_gradient("flash_attn (with ALiBi)", &t));
    }
    if [k, v].iter().any(|&s| g.tensor(s).ty != GgmlType::F32) {
        return Err(no_gradient("flash_attn (keys or values not F32)", &t));
    }
    let (causal, window, scale) = (t.params.i[0] != 0, t.params.i[1] as u32, t.params.f[0]);
    // q: [dk, t, n_head], k: [dk, t, n_head_kv], v: [dv, t, n_head_kv], contiguous.
    let q = g.cpy(q, GgmlType::F32)?;
    let k = g.cpy(k, GgmlType::F32)?;
    let v = g.cpy(v, GgmlType::F32)?;
    // The forward's scores and weights. s, p: [t_keys, t_queries, n_head]
    let s = g.mul_mat(k, q)?;
    let p = g.soft_max(s, scale, causal, window)?;
    // dy: [dv, n_head, t] → d_out: [dv, t, n_head]
    let d_out = g.permute(dy, [0, 2, 1, 3])?;
    let d_out = g.cpy(d_out, GgmlType::F32)?;
    // dp, ds: [t_keys, t_queries, n_head]
    let dp = g.mul_mat(v, d_out)?;
    let ds = g.soft_max_back(p, dp, scale)?;
    let [want_q, want_k, want_v] = wanted;
    let dq = if want_q {
        // kt: [t_keys, dk, n_head_kv] → dq: [dk, t_queries, n_head]
        let kt = transposed(g, k)?;
        Some(g.mul_mat(kt, ds)?)
    } else {
        None
    };
    let dk = if want_k {
        // qt: [t_queries, dk, n_head], dst: [t_queries, t_keys, n_head] → [dk, t_keys, n_head]
        let (qt, dst) = (transposed(g, q)?, transposed(g, ds)?);
        let per_head = g.mul_mat(qt, dst)?;
        Some(sum_groups(g, per_head, g.tensor(k).ne)?)
    } else {
        None
    };
    let dv = if want_v {
        // d_out_t: [t_queries, dv, n_head], pt: [t_queries, t_keys, n_head] → [dv, t_keys, n_head]
        let (d_out_t, pt) = (transposed(g, d_out)?, transposed(g, p)?);
        let per_head = g.mul_mat(d_out_t, pt)?;
        Some(sum_groups(g, per_head, g.tensor(v).ne)?)
    } else {
        None
    };
    Ok([dq, dk, dv])
}

/// A contiguous copy of `x` with its first two dimensions swapped.
fn transposed<const N: usize>(g: &mut Graph<N>, x: TensorId) -> Result<TensorId, TrainError> {
    let xt = g.transpose(x)?;
    Ok(g.cpy(xt, GgmlType::F32)?)
}

/// `per_head` (`[a, b, n_head]`) summed over each KV head's group of query heads (consecutive
/// heads `j * r .. j * r + r` for KV head `j`) into `ne` (`[a, b, n_head_kv]`).
fn sum_groups<const N: usize>(
    g: &mut Graph<N>,
    per_head: TensorId,
    ne: [usize; 4],
) -> Result<TensorId, TrainError> {
    let n_head = g.tensor(per_head).ne[2];
    let r = n_head / ne[2].max(1);
    if r <= 1 {
        return Ok(per_head);
    }
    let runs = g.reshape(per_head, [ne[0] * ne[1], r, ne[2], 1])?;
    let summed = g.repeat_back(runs, [ne[0] * ne[1], 1, ne[2], 1])?;
    Ok(g.reshape(summed, ne)?)
}

/// The refusal of a flash-attention node this rule cannot differentiate.
fn no_gradient(op: &'static str, t: &crate::tensor::Tensor) -> TrainError {
    TrainError::NoGradient { op, name: t.name.clone() }
}
