//! The architectures pinfer runs, one row each: what sets an architecture apart is written once,
//! in [`Arch::traits`], and validation, hyper-parameter reading, the graph builder and every
//! message read it. A new architecture is a new [`Arch`] variant; the exhaustive `match` in
//! [`Arch::traits`] then asks for its row.

mod transformer;

use core::fmt;

pub use transformer::{
    layer_rope, rope_factors_name, CacheRows, Forward, KvLayout, KvTypeError, KvTypes, LayerRope,
    MODEL_BUFFER,
};

use crate::gguf::Gguf;
use crate::graph::{Graph, RopeMode};
use crate::model::{HParams, ModelError};

/// Builds the forward pass of `hp.arch` for `n_tokens` tokens with logits for `n_outputs` of them
/// (see `transformer.rs`): the builder of each architecture, chosen by an exhaustive match.
pub fn build_forward<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[crate::model::lora::Adapter<'_>],
) -> Result<Forward, ModelError> {
    match hp.arch {
        Arch::Llama
        | Arch::Qwen2
        | Arch::Qwen3
        | Arch::Qwen3Moe
        | Arch::Qwen2Moe
        | Arch::Gemma3
        | Arch::Granite
        | Arch::SmolLm3
        | Arch::Phi3
        | Arch::Lfm2
        | Arch::Lfm2Moe
        | Arch::Qwen35
        | Arch::Gemma4 => transformer::build(g, gguf, hp, kv, n_tokens, n_outputs, adapters),
    }
}

/// Architectures pinfer runs (the `general.architecture` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama family (SmolLM2, TinyLlama, Llama 3.x).
    Llama,
    /// Qwen2 / Qwen2.5 (QKV bias).
    Qwen2,
    /// Qwen3 (per-head Q/K RMS norm).
    Qwen3,
    /// Qwen3 mixture of experts.
    Qwen3Moe,
    /// Qwen2 mixture of experts (with a shared expert).
    Qwen2Moe,
    /// Gemma 3.
    Gemma3,
    /// IBM Granite 3.x / 4.0 dense (embedding, attention, residual and logit multipliers).
    Granite,
    /// SmolLM3 (no RoPE on every fourth layer).
    SmolLm3,
    /// Phi-3 / Phi-3.5 / Phi-4-mini (fused QKV and gate|up projections, LongRoPE factors).
    Phi3,
    /// Liquid LFM2 / LFM2.5 (short-convolution layers between attention layers).
    Lfm2,
    /// Liquid LFM2 mixture of experts (LFM2-8B-A1B): dense leading layers, sigmoid routing with
    /// a selection bias.
    Lfm2Moe,
    /// Qwen3.5 / Qwen3.6 dense (three of four layers gated delta rule, gated attention).
    Qwen35,
    /// Gemma 4 dense (E2B, E4B, 31B): per-layer token embeddings, sliding-window layers with
    /// their own head size, later layers reading earlier layers' KV caches, soft-capped logits.
    Gemma4,
}

/// Which layers attend through a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwaLayers {
    /// None.
    None,
    /// All but every `n`th (Gemma 3: 6, llama.cpp's fixed pattern).
    Period(u32),
    /// Those flagged in `attention.sliding_window_pattern` (Gemma 4).
    Pattern,
}

/// The feed-forward block of an architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ffn {
    /// One gated MLP per layer.
    Dense,
    /// A mixture of experts (llama.cpp's `build_moe_ffn`).
    Experts(Experts),
}

/// How a mixture of experts routes and adds up its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    /// The top-k weights are renormalised to sum to 1.
    pub normalize_weights: bool,
    /// A shared expert scaled by its own sigmoid gate is added (qwen2moe).
    pub shared_expert: bool,
    /// How router logits become expert probabilities.
    pub gating: Gating,
    /// A per-expert bias (`exp_probs_b.bias`) is added to the probabilities for choosing the
    /// experts only; the weights are the unbiased probabilities (lfm2moe).
    pub selection_bias: bool,
}

/// How a mixture of experts turns router logits into probabilities
/// (`{arch}.expert_gating_func`: 1 softmax, 2 sigmoid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over the experts.
    Softmax,
    /// Each expert's own sigmoid.
    Sigmoid,
}

/// What sets an architecture apart in the shared forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchTraits {
    /// The GGUF name, also the prefix of the architecture's metadata keys.
    pub name: &'static str,
    /// How RoPE pairs dimensions.
    pub rope: RopeMode,
    /// Biases on Q, K and V.
    pub qkv_bias: bool,
    /// Per-head RMS norms of Q and K.
    pub qk_norm: bool,
    /// Gemma: GeGLU, post-attention and post-FFN norms, embeddings scaled by sqrt(n_embd),
    /// sliding-window layers.
    pub gemma: bool,
    /// The feed-forward block.
    pub ffn: Ffn,
    /// Granite's multipliers: `{arch}.embedding_scale`, `.attention.scale`, `.residual_scale`,
    /// `.logit_scale` (logits are divided by it).
    pub multipliers: bool,
    /// Every `n`th layer (the 4th, 8th, ...) runs without RoPE (SmolLM3: 4, llama.cpp's fixed
    /// interval); 0: every layer rotates.
    pub no_rope_every: u32,
    /// Gate and up projections fused in one `ffn_up` of twice the width, gate first (phi3).
    pub fused_gate_up: bool,
    /// LongRoPE: per-pair frequency divisors `rope_factors_long/short.weight`, the long ones when
    /// the context exceeds `rope.scaling.original_context_length`, and cosines and sines scaled by
    /// `rope.scaling.attn_factor` (phi3). Queries are scaled by 1/sqrt(head size) before attention.
    pub long_rope: bool,
    /// Layers whose `attention.head_count_kv` entry is 0 are short-convolution blocks (LFM2):
    /// gated causal depthwise convolution over the last `shortconv.l_cache` inputs, with a
    /// recurrent state per sequence instead of a KV cache.
    pub short_conv: bool,
    /// The final norm's tensor.
    pub output_norm: &'static str,
    /// The FFN's norm's tensor (per layer, after `blk.N.`).
    pub ffn_norm: &'static str,
    /// Layers other than every `full_attention_interval`-th are gated-delta-rule blocks
    /// (Qwen3.5's linear attention: a convolution over Q, K and V, the delta rule with a state
    /// per value head, an RMS norm gated by `attn_gate`), with recurrent states instead of a KV
    /// cache.
    pub delta_net: bool,
    /// The Q projection gives each head's queries then a gate of the same size; the attention
    /// output is multiplied by the gate's sigmoid (Qwen3.5).
    pub attn_output_gate: bool,
    /// Which layers attend through a sliding window.
    pub swa: SwaLayers,
    /// Gemma 4's layer geometry: sliding-window layers with their own head and rotation sizes
    /// and RoPE base (`*_swa` keys), per-layer FFN widths, KV-sharing layers
    /// (`attention.shared_kv_layers`), per-layer token embeddings, values RMS-normalised without
    /// a weight (and the keys' projection reused when a layer has no `attn_v`), scores scaled by
    /// 1, an optional `layer_output_scale` per layer, `rope_freqs` on full-attention layers only.
    pub swa_sizes: bool,
}

impl Arch {
    /// Every architecture, in the order messages list them.
    pub const ALL: [Arch; 13] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Qwen2Moe,
        Arch::Gemma3,
        Arch::Granite,
        Arch::SmolLm3,
        Arch::Phi3,
        Arch::Lfm2,
        Arch::Lfm2Moe,
        Arch::Qwen35,
        Arch::Gemma4,
    ];

    /// The architecture's row.
    pub const fn traits(self) -> ArchTraits {
        const DENSE: ArchTraits = ArchTraits {
            name: "",
            rope: RopeMode::Neox,
            qkv_bias: false,
            qk_norm: false,
            gemma: false,
            ffn: Ffn::Dense,
            multipliers: false,
            no_rope_every: 0,
            fused_gate_up: false,
            long_rope: false,
            short_conv: false,
            output_norm: "output_norm.weight",
            ffn_norm: "ffn_norm.weight",
            delta_net: false,
            attn_output_gate: false,
            swa: SwaLayers::None,
            swa_sizes: false,
        };
        const SOFTMAX_EXPERTS: Experts = Experts {
            normalize_weights: false,
            shared_expert: false,
            gating: Gating::Softmax,
            selection_bias: false,
        };
        // (llama.cpp's converter names LFM2's final norm after the embeddings.)
        const LFM2: ArchTraits = ArchTraits {
            name: "lfm2",
            qk_norm: true,
            short_conv: true,
            output_norm: "token_embd_norm.weight",
            ..DENSE
        };
        match self {
            Arch::Llama => ArchTraits { name: "llama", rope: RopeMode::Normal, ..DENSE },
            Arch::Qwen2 => ArchTraits { name: "qwen2", qkv_bias: true, ..DENSE },
            Arch::Qwen3 => ArchTraits { name: "qwen3", qk_norm: true, ..DENSE },
            Arch::Qwen3Moe => ArchTraits {
                name: "qwen3moe",
                qk_norm: true,
                ffn: Ffn::Experts(Experts { normalize_weights: true, ..SOFTMAX_EXPERTS }),
                ..DENSE
            },
            Arch::Qwen2Moe => ArchTraits {
                name: "qwen2moe",
                qkv_bias: true,
                ffn: Ffn::Experts(Experts { shared_expert: true, ..SOFTMAX_EXPERTS }),
                ..DENSE
            },
            Arch::Gemma3 => {
                ArchTraits { name: "gemma3", qk_norm: true, gemma: true, swa: SwaLayers::Period(6), ..DENSE }
            }
            Arch::Gemma4 => ArchTraits {
                name: "gemma4",
                qk_norm: true,
                gemma: true,
                swa: SwaLayers::Pattern,
                swa_sizes: true,
                ..DENSE
            },
            Arch::Granite => {
                ArchTraits { name: "granite", rope: RopeMode::Normal, multipliers: true, ..DENSE }
            }
            Arch::SmolLm3 => {
                ArchTraits { name: "smollm3", rope: RopeMode::Normal, no_rope_every: 4, ..DENSE }
            }
            Arch::Phi3 => ArchTraits { name: "phi3", fused_gate_up: true, long_rope: true, ..DENSE },
            Arch::Lfm2 => LFM2,
            Arch::Qwen35 => ArchTraits {
                name: "qwen35",
                qk_norm: true,
                ffn_norm: "post_attention_norm.weight",
                delta_net: true,
                attn_output_gate: true,
                ..DENSE
            },
            Arch::Lfm2Moe => ArchTraits {
                name: "lfm2moe",
                ffn: Ffn::Experts(Experts {
                    normalize_weights: true,
                    shared_expert: false,
                    gating: Gating::Sigmoid,
                    selection_bias: true,
                }),
                ..LFM2
            },
        }
    }

    /// The architecture named `name` in GGUF metadata.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.traits().name == name)
    }

    /// The GGUF name, also the prefix of the architecture's metadata keys.
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Whether feed-forward layers are mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(self.traits().ffn, Ffn::Experts(_))
    }

    /// How the mixture of experts routes, for a mixture-of-experts architecture.
    pub fn experts(self) -> Option<Experts> {
        match self.traits().ffn {
            Ffn::Dense => None,
            Ffn::Experts(x) => Some(x),
        }
    }

    /// Whether the mixture of experts adds a shared expert.
    pub fn has_shared_expert(self) -> bool {
        self.experts().is_some_and(|x| x.shared_expert)
    }
}

/// The names of the architectures pinfer runs, for messages.
#[derive(Debug, Clone, Copy)]
pub enum Supported {
    /// Every one.
    All,
    /// The mixtures of experts.
    Moe,
}

impl fmt::Display for Supported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let listed = Arch::ALL.into_iter().filter(|a| matches!(self, Supported::All) || a.is_moe());
        for (i, a) in listed.enumerate() {
            write!(f, "{}{}", if i > 0 { ", " } else { "" }, a.name())?;
        }
        Ok(())
    }
}
