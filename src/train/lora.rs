//! The training graph of LoRA fine-tuning: the inference engine's blocks composed as for
//! generation, over a window (the whole sequence at once, no KV cache, the engine's flash
//! attention over the window's keys and values, differentiated through its recomputed causal
//! softmax: each op has a gradient rule, and the logits are generation's), the frozen weights read
//! from the file in their own types, and on each adapted projection `W x + scale * B (A x)` with
//! `A` (`[n_in, r]`) and `B` (`[r, n_out]`) F32 parameters in the arena. The loss is the mean
//! cross-entropy of the next tokens (`targets[t]` is the token after position `t`; a negative
//! target is not scored, e.g. a prompt of a chat turn). An architecture with a block that has no
//! backward yet is refused by name.

use core::fmt::Write;

use crate::gguf::{Gguf, Name};
use crate::graph::{Graph, GraphError};
use crate::model::{build_window, Arch, HParams, ModelError};
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

/// The block of `arch` with no backward yet (its op), if any: the architectures whose blocks all
/// have gradient rules train.
pub fn untrainable_block(arch: Arch) -> Option<&'static str> {
    let t = arch.traits();
    if arch.is_moe() {
        Some("mixture of experts (mul_mat_id, top_k, moe_weights, moe_sum)")
    } else if t.short_conv {
        Some("short convolution (short_conv)")
    } else if t.delta_net {
        Some("gated delta rule (gated_delta_net)")
    } else if t.attn_output_gate {
        Some("attention output gate (a strided view)")
    } else if t.per_layer_inputs {
        Some("per-layer inputs (a strided view)")
    } else if t.shared_kv {
        Some("KV-sharing layers (a cache read)")
    } else {
        None
    }
}

/// Builds the training graph of `n_tokens` tokens of the model `gguf` (`hp`) with the adapters of
/// `spec`, through the inference engine's blocks. The model must have passed `validate_tensors`.
pub fn build_lora_graph<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    n_tokens: usize,
    spec: LoraSpec,
) -> Result<LoraGraph, TrainError> {
    if let Some(block) = untrainable_block(hp.arch) {
        return Err(TrainError::Architecture { arch: hp.arch.name(), block });
    }
    if spec.rank == 0 || n_tokens == 0 {
        return Err(TrainError::Unsupported("a LoRA rank and a sequence of at least 1"));
    }
    // Persistent: the ids, the targets, then each adapted weight's A and B.
    let align = |n: usize| n.next_multiple_of(64);
    let ids_bytes = align(n_tokens * 4);
    let mut offset = 2 * ids_bytes;
    let mut adapted: heapless::Vec<Adapted, MAX_ADAPTED> = heapless::Vec::new();
    let scale = spec.alpha / spec.rank as f32;
    let mut pair = |g: &mut Graph<N>, w: TensorId| -> Result<Option<(TensorId, TensorId, f32)>, ModelError> {
        let name = g.tensor(w).name.clone();
        let Some(which) = target_of(&name) else { return Ok(None) };
        if spec.targets & (1 << which) == 0 {
            return Ok(None);
        }
        let (n_in, n_out) = (g.tensor(w).ne[0], g.tensor(w).ne[1]);
        let mut param = |suffix: &str, ne: [usize; 4]| -> Result<TensorId, GraphError> {
            let mut label = Name::new();
            let _ = write!(label, "{name}.{suffix}");
            let id = g.leaf(&label, GgmlType::F32, ne, Storage::Persistent { offset })?;
            offset += align(g.tensor(id).span_bytes());
            Ok(id)
        };
        let a = param("lora_a", [n_in, spec.rank, 1, 1])?;
        let b = param("lora_b", [spec.rank, n_out, 1, 1])?;
        let mut target = Name::new();
        let _ = target.push_str(&name);
        adapted.push(Adapted { target, a, b }).map_err(|_| too_many())?;
        Ok(Some((a, b, scale)))
    };
    let (ids, logits) = build_window(g, gguf, hp, n_tokens, 0, &mut pair).map_err(TrainError::model)?;
    let targets =
        g.leaf("targets", GgmlType::I32, [n_tokens, 1, 1, 1], Storage::Persistent { offset: ids_bytes })?;
    let loss = g.cross_entropy(logits, targets)?;
    Ok(LoraGraph { ids, targets, logits, loss, adapted, persistent_end: offset })
}

/// Which of [`TARGETS`] weight `name` is (`blk.{il}.{target}.weight`).
fn target_of(name: &str) -> Option<usize> {
    let mut parts = name.split('.');
    let (blk, il, target, weight) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let layer = blk == "blk" && il.bytes().all(|c| c.is_ascii_digit()) && weight == "weight";
    if !layer || parts.next().is_some() {
        return None;
    }
    TARGETS.iter().position(|&t| t == target)
}

/// More adapted weights than [`MAX_ADAPTED`].
fn too_many() -> ModelError {
    ModelError::Graph(GraphError::Invalid {
        op: "lora",
        name: heapless::String::new(),
        problem: "more adapted weights than MAX_ADAPTED",
    })
}
