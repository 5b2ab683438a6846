//! The training graph of LoRA fine-tuning for llama-architecture models: the whole sequence at
//! once (no KV cache), attention written out (scores, causal softmax, weighted values: each op has
//! a gradient rule), the frozen weights read from the file in their own types, and on each
//! adapted projection `W x + scale * B (A x)` with `A` (`[n_in, r]`) and `B` (`[r, n_out]`) F32
//! parameters in the arena. The loss is the mean cross-entropy of the next tokens
//! (`targets[t]` is the token after position `t`; a negative target is not scored, e.g. a prompt
//! of a chat turn).

use core::fmt::Write;

use crate::gguf::{Gguf, Name};
use crate::graph::{Graph, RopeMode};
use crate::model::{Arch, HParams, MODEL_BUFFER};
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};

use super::TrainError;

/// The projections LoRA can adapt, as llama.cpp names their weights.
pub const TARGETS: [&str; 7] =
    ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];

/// Most adapted weights (7 per layer of a 64-layer model).
pub const MAX_ADAPTED: usize = 7 * 64;

/// One adapted weight's parameters.
#[derive(Debug, Clone)]
pub struct Adapted {
    /// The base weight's name (`blk.0.attn_q.weight`).
    pub target: Name,
    /// `A`, F32 `[n_in, r]`, in the persistent region.
    pub a: TensorId,
    /// `B`, F32 `[r, n_out]`, in the persistent region.
    pub b: TensorId,
}

/// A built LoRA training graph.
#[derive(Debug, Clone)]
pub struct LoraGraph {
    /// I32 `[n_tokens]` input ids (persistent, at offset 0).
    pub ids: TensorId,
    /// I32 `[n_tokens]` next-token targets (persistent, after the ids).
    pub targets: TensorId,
    /// F32 `[n_vocab, n_tokens]` logits.
    pub logits: TensorId,
    /// The loss, F32 `[1]`.
    pub loss: TensorId,
    /// The adapted weights, layer by layer in [`TARGETS`] order.
    pub adapted: heapless::Vec<Adapted, MAX_ADAPTED>,
    /// First byte of the persistent region after the inputs and the parameters.
    pub persistent_end: usize,
}

impl LoraGraph {
    /// The parameters in order (each adapted weight's `A` then `B`).
    pub fn params(&self) -> impl Iterator<Item = TensorId> + '_ {
        self.adapted.iter().flat_map(|a| [a.a, a.b])
    }
}

/// What to adapt and how.
#[derive(Debug, Clone, Copy)]
pub struct LoraSpec {
    /// The rank `r`.
    pub rank: usize,
    /// `alpha` (the adapter's `scale = alpha / r`).
    pub alpha: f32,
    /// Bit `i` set: adapt [`TARGETS`]`[i]` in every layer.
    pub targets: u8,
}

/// Builds the training graph of `n_tokens` tokens of the llama model `gguf` (`hp`) with the
/// adapters of `spec`. The model must have passed `validate_tensors`.
pub fn build_lora_graph<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    n_tokens: usize,
    spec: LoraSpec,
) -> Result<LoraGraph, TrainError> {
    if hp.arch != Arch::Llama {
        return Err(TrainError::Unsupported("LoRA training graphs are built for llama models so far"));
    }
    if spec.rank == 0 || n_tokens == 0 {
        return Err(TrainError::Unsupported("a LoRA rank and a sequence of at least 1"));
    }
    g.clear();
    let data_start = gguf.data_start();
    let weight = |g: &mut Graph<N>, name: &str| -> Result<TensorId, TrainError> {
        let info = gguf.tensor(name).ok_or(TrainError::Unsupported("a weight the model lacks"))?;
        let storage = Storage::External { buffer: MODEL_BUFFER, offset: data_start + info.offset as usize };
        Ok(g.leaf(name, info.ty, info.ne.map(|n| n as usize), storage)?)
    };
    let align = |n: usize| n.next_multiple_of(64);
    let mut offset = 0;
    let mut persistent =
        |g: &mut Graph<N>, name: &str, ty: GgmlType, ne: [usize; 4]| -> Result<TensorId, TrainError> {
            let id = g.leaf(name, ty, ne, Storage::Persistent { offset })?;
            offset += align(g.tensor(id).span_bytes());
            Ok(id)
        };
    let ids = persistent(g, "ids", GgmlType::I32, [n_tokens, 1, 1, 1])?;
    let targets = persistent(g, "targets", GgmlType::I32, [n_tokens, 1, 1, 1])?;
    let mut adapted: heapless::Vec<Adapted, MAX_ADAPTED> = heapless::Vec::new();
    let scale = spec.alpha / spec.rank as f32;

    // `w x`, plus the adapter's `scale * B (A x)` when `w` is adapted.
    let mut project =
        |g: &mut Graph<N>, name: &str, which: usize, x: TensorId| -> Result<TensorId, TrainError> {
            let w = weight(g, name)?;
            let y = g.mul_mat(w, x)?;
            if spec.targets & (1 << which) == 0 {
                return Ok(y);
            }
            let (n_in, n_out) = (g.tensor(w).ne[0], g.tensor(w).ne[1]);
            let mut label = Name::new();
            let _ = write!(label, "{name}.lora_a");
            let a = persistent(g, &label, GgmlType::F32, [n_in, spec.rank, 1, 1])?;
            label.clear();
            let _ = write!(label, "{name}.lora_b");
            let b = persistent(g, &label, GgmlType::F32, [spec.rank, n_out, 1, 1])?;
            let mut target = Name::new();
            let _ = target.push_str(name);
            adapted
                .push(Adapted { target, a, b })
                .map_err(|_| TrainError::Unsupported("more adapted weights than MAX_ADAPTED"))?;
            let ax = g.mul_mat(a, x)?;
            let bax = g.mul_mat(b, ax)?;
            let bax = g.scale(bax, scale)?;
            Ok(g.add(y, bax)?)
        };

    let (n_embd, n_head, n_head_kv) = (hp.n_embd as usize, hp.n_head as usize, hp.n_head_kv as usize);
    let head_dim = hp.head_dim_k as usize;
    let kq_scale = hp.attention_scale.unwrap_or(1.0 / libm::sqrtf(head_dim as f32));
    let tok_embd = weight(g, "token_embd.weight")?;
    let mut x = g.get_rows(tok_embd, ids)?;
    let mut table = None;
    let mut name = Name::new();
    let mut layer = |il: usize, suffix: &str| -> Name {
        name.clear();
        let _ = write!(name, "blk.{il}.{suffix}");
        name.clone()
    };
    for il in 0..hp.n_layer as usize {
        let norm_w = weight(g, &layer(il, "attn_norm.weight"))?;
        let cur = g.rms_norm(x, hp.rms_eps)?;
        let cur = g.mul(cur, norm_w)?;
        let q = project(g, &layer(il, "attn_q.weight"), 0, cur)?;
        let k = project(g, &layer(il, "attn_k.weight"), 1, cur)?;
        let v = project(g, &layer(il, "attn_v.weight"), 2, cur)?;
        let q = g.reshape(q, [head_dim, n_head, n_tokens, 1])?;
        let k = g.reshape(k, [head_dim, n_head_kv, n_tokens, 1])?;
        let v = g.reshape(v, [head_dim, n_head_kv, n_tokens, 1])?;
        let t = match table {
            Some(t) => t,
            None => {
                let t = g.rope_table(q, hp.n_rot as usize, hp.rope_freq_base, 1.0, None, 1.0, None)?;
                table = Some(t);
                t
            }
        };
        let q = g.rope_with(q, t, RopeMode::Normal)?;
        let k = g.rope_with(k, t, RopeMode::Normal)?;
        // Heads outermost: q [hd, n, n_head], k [hd, n, n_head_kv], v^T [n, hd, n_head_kv].
        let q = g.permute(q, [0, 2, 1, 3])?;
        let q = g.cpy(q, GgmlType::F32)?;
        let k = g.permute(k, [0, 2, 1, 3])?;
        let k = g.cpy(k, GgmlType::F32)?;
        let vt = g.permute(v, [1, 2, 0, 3])?;
        let vt = g.cpy(vt, GgmlType::F32)?;
        let kq = g.mul_mat(k, q)?; // [n_kv, n, n_head]
        let kq = g.soft_max(kq, kq_scale, true, 0)?;
        let kqv = g.mul_mat(vt, kq)?; // [hd, n, n_head]
        let kqv = g.permute(kqv, [0, 2, 1, 3])?; // [hd, n_head, n]
        let kqv = g.cpy(kqv, GgmlType::F32)?;
        let attn = g.reshape(kqv, [n_embd, n_tokens, 1, 1])?;
        let attn = project(g, &layer(il, "attn_output.weight"), 3, attn)?;
        x = g.add(x, attn)?;
        let norm_w = weight(g, &layer(il, "ffn_norm.weight"))?;
        let cur = g.rms_norm(x, hp.rms_eps)?;
        let cur = g.mul(cur, norm_w)?;
        let gate = project(g, &layer(il, "ffn_gate.weight"), 4, cur)?;
        let up = project(g, &layer(il, "ffn_up.weight"), 5, cur)?;
        let act = g.swiglu(gate, up)?;
        let down = project(g, &layer(il, "ffn_down.weight"), 6, act)?;
        x = g.add(x, down)?;
    }
    let norm_w = weight(g, "output_norm.weight")?;
    let x = g.rms_norm(x, hp.rms_eps)?;
    let x = g.mul(x, norm_w)?;
    let output = if gguf.tensor("output.weight").is_some() { weight(g, "output.weight")? } else { tok_embd };
    let logits = g.mul_mat(output, x)?;
    let loss = g.cross_entropy(logits, targets)?;
    Ok(LoraGraph { ids, targets, logits, loss, adapted, persistent_end: offset })
}
