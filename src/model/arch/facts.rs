//! The table of facts: one row per architecture ([`Arch::traits`]) saying what its math is, read
//! by validation, hyper-parameter reading, the blocks' composition and every message. Below the
//! builders and the hyper-parameters, it names neither.

use core::fmt;

use crate::graph::RopeMode;

/// Declares [`Arch`], its GGUF names and [`Arch::ALL`] from one list, so a new variant is one
/// line here plus the row the exhaustive match in [`Arch::traits`] then asks for.
macro_rules! archs {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// Architectures pinfer runs (the `general.architecture` value).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Arch {
            $($(#[$doc])* $variant,)*
        }

        impl Arch {
            /// Every architecture, in the order messages list them.
            pub const ALL: [Arch; [$($name),*].len()] = [$(Arch::$variant),*];

            /// The GGUF name, also the prefix of the architecture's metadata keys.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Arch::$variant => $name,)*
                }
            }
        }
    };
}

archs! {
    /// Llama family (SmolLM2, TinyLlama, Llama 3.x).
    Llama = "llama",
    /// Qwen2 / Qwen2.5 (QKV bias).
    Qwen2 = "qwen2",
    /// Qwen2-VL / Qwen2.5-VL's language model: Qwen2 rotating by M-RoPE (an image token's
    /// pairs turned by its time, row and column positions, in `rope.dimension_sections`).
    Qwen2Vl = "qwen2vl",
    /// Qwen3 (per-head Q/K RMS norm).
    Qwen3 = "qwen3",
    /// Qwen3 mixture of experts.
    Qwen3Moe = "qwen3moe",
    /// Qwen2 mixture of experts (with a shared expert).
    Qwen2Moe = "qwen2moe",
    /// Gemma 3.
    Gemma3 = "gemma3",
    /// IBM Granite 3.x / 4.0 dense (embedding, attention, residual and logit multipliers).
    Granite = "granite",
    /// SmolLM3 (no RoPE on every fourth layer).
    SmolLm3 = "smollm3",
    /// Phi-3 / Phi-3.5 / Phi-4-mini (fused QKV and gate|up projections, LongRoPE factors).
    Phi3 = "phi3",
    /// Liquid LFM2 / LFM2.5 (short-convolution layers between attention layers).
    Lfm2 = "lfm2",
    /// Liquid LFM2 mixture of experts (LFM2-8B-A1B): dense leading layers, sigmoid routing with
    /// a selection bias.
    Lfm2Moe = "lfm2moe",
    /// Qwen3.5 / Qwen3.6 dense (three of four layers gated delta rule, gated attention).
    Qwen35 = "qwen35",
    /// Gemma 4 dense (E2B, E4B, 31B): per-layer token embeddings, sliding-window layers with
    /// their own head size, later layers reading earlier layers' KV caches, soft-capped logits.
    Gemma4 = "gemma4",
    /// BERT encoders (all-MiniLM, BGE, E5, GTE): embeddings, no generation.
    Bert = "bert",
    /// Nomic Embed encoders: BERT's post-LN blocks with a fused QKV, NeoX RoPE instead of
    /// position embeddings and a SwiGLU MLP without biases.
    NomicBert = "nomic-bert",
    /// Jina Embeddings v2 encoders: BERT's post-LN blocks with ALiBi instead of position
    /// embeddings and a GEGLU MLP from one `ffn_up` (gate rows first).
    JinaBertV2 = "jina-bert-v2",
    /// EmbeddingGemma (300M): Gemma 3 attending both ways, its sliding layers through a
    /// symmetric window, pooled embeddings through its dense head; no generation.
    GemmaEmbedding = "gemma-embedding",
}

/// How an encoder's attention knows where its tokens are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Positions {
    /// Absolute position embeddings added to the token's (`position_embd`; BERT).
    Embedded,
    /// RoPE on Q and K ([`ArchTraits::rope`]'s pairing, `rope.freq_base`; nomic-bert).
    Rotary,
    /// ALiBi: each head's scores biased by `-slope * |i - j|`, the slopes from this maximum bias
    /// (llama.cpp's fixed 8 for jina-bert-v2, which reads no key for it).
    Alibi(f32),
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
    /// All but every `n`th, `n` the file's integer `attention.sliding_window_pattern`, else the
    /// default given (EmbeddingGemma: 6, llama.cpp's `load_swa_pattern`).
    PeriodKey(u32),
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

/// The activation of a gated feed-forward block: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU).
    SwiGlu,
    /// GELU, tanh approximation (GeGLU).
    GeGlu,
}

/// What the token embeddings are multiplied by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedScale {
    /// `{arch}.embedding_scale` where the architecture reads it ([`ArchTraits::multipliers`]),
    /// else 1.
    FromFile,
    /// `sqrt(n_embd)` (Gemma).
    SqrtWidth,
}

/// What sets an architecture apart in the shared forward pass: one row of named facts about its
/// math, which the blocks (`blocks.rs`), hyper-parameter reading and validation read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchTraits {
    /// How RoPE pairs dimensions.
    pub rope: RopeMode,
    /// Biases on Q, K and V.
    pub qkv_bias: bool,
    /// Per-head RMS norms of Q and K.
    pub qk_norm: bool,
    /// Each value head RMS-normalised without a weight (Gemma 4).
    pub value_norm: bool,
    /// A layer without `attn_v` takes the keys' projection as its values (Gemma 4).
    pub values_from_keys: bool,
    /// RMS norms with weights on the attention's and the FFN's outputs before their residual
    /// adds (`post_attention_norm`, `post_ffw_norm`; Gemma).
    pub post_norms: bool,
    /// What the token embeddings are multiplied by.
    pub embed_scale: EmbedScale,
    /// The dense FFN's activation.
    pub act: Activation,
    /// The feed-forward block.
    pub ffn: Ffn,
    /// Granite's multipliers: `{arch}.embedding_scale`, `.attention.scale`, `.residual_scale`,
    /// `.logit_scale` (logits are divided by it).
    pub multipliers: bool,
    /// Attention scores are scaled by 1, not 1/sqrt(head size) (Gemma 4, whose Q and K norms
    /// set their size).
    pub unit_kq_scale: bool,
    /// Queries are scaled by 1/sqrt(head size) before attention, and the scores by 1 (phi3, as
    /// llama.cpp computes it).
    pub prescaled_queries: bool,
    /// Every `n`th layer (the 4th, 8th, ...) runs without RoPE (SmolLM3: 4, llama.cpp's fixed
    /// interval); 0: every layer rotates.
    pub no_rope_every: u32,
    /// Gate and up projections fused in one `ffn_up` of twice the width, gate first (phi3).
    pub fused_gate_up: bool,
    /// LongRoPE: per-pair frequency divisors `rope_factors_long/short.weight`, the long ones when
    /// the context exceeds `rope.scaling.original_context_length`, and cosines and sines scaled by
    /// `rope.scaling.attn_factor` (phi3).
    pub long_rope: bool,
    /// Full-attention layers need `rope_freqs`, one factor per pair of the head (Gemma 4).
    pub full_layer_rope_freqs: bool,
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
    /// Which layers attend through a sliding window (`attention.sliding_window` positions).
    pub swa: SwaLayers,
    /// Sliding-window layers have their own head and rotation sizes (`*_swa` keys; Gemma 4).
    pub sliding_sizes: bool,
    /// `feed_forward_length` may give each layer its own width (Gemma 4).
    pub per_layer_ffn: bool,
    /// The last `attention.shared_kv_layers` layers read earlier layers' KV caches (Gemma 4).
    pub shared_kv: bool,
    /// Per-layer token embeddings of `embedding_length_per_layer_input` values added after each
    /// layer (Gemma 4).
    pub per_layer_inputs: bool,
    /// Layers may scale their output by a one-element `layer_output_scale` (Gemma 4).
    pub layer_output_scale: bool,
    /// The logits' soft-cap when the file gives no `final_logit_softcapping` (0: none; Gemma 4:
    /// llama.cpp's 30).
    pub default_logit_softcap: f32,
    /// An encoder (BERT and its kin): token and token-type embeddings, post-LayerNorm blocks
    /// with biases and an MLP (BERT's GELU; [`ArchTraits::gated_encoder_ffn`]), positions as
    /// [`ArchTraits::positions`] says, attention both ways within a sequence
    /// (`attention.causal` false), no KV cache kept between steps, and pooled embeddings instead
    /// of logits (`encoder.rs`).
    pub encoder: bool,
    /// Attention sees every token of the sequence, before and after (`attention.causal` false):
    /// the encoders and EmbeddingGemma, whose sliding layers' window is symmetric.
    pub bidirectional: bool,
    /// An encoder's positions.
    pub positions: Positions,
    /// An encoder's MLP is gated (`act` of the gate times up, gate and up as `fused_gate_up`
    /// says), not BERT's GELU of one `ffn_up`.
    pub gated_encoder_ffn: bool,
    /// RoPE by sections of positions (llama.cpp's M-RoPE, `rope.dimension_sections`): a text
    /// token's every section takes its position, an image token's its time, row and column
    /// (the image's grid), and the text after an image goes on from its time plus its longer
    /// side, not its token count.
    pub mrope: bool,
}

impl Arch {
    /// The architecture's row.
    pub const fn traits(self) -> ArchTraits {
        const DENSE: ArchTraits = ArchTraits {
            rope: RopeMode::Neox,
            qkv_bias: false,
            qk_norm: false,
            value_norm: false,
            values_from_keys: false,
            post_norms: false,
            embed_scale: EmbedScale::FromFile,
            act: Activation::SwiGlu,
            ffn: Ffn::Dense,
            multipliers: false,
            unit_kq_scale: false,
            prescaled_queries: false,
            no_rope_every: 0,
            fused_gate_up: false,
            long_rope: false,
            full_layer_rope_freqs: false,
            short_conv: false,
            output_norm: "output_norm.weight",
            ffn_norm: "ffn_norm.weight",
            delta_net: false,
            attn_output_gate: false,
            swa: SwaLayers::None,
            sliding_sizes: false,
            per_layer_ffn: false,
            shared_kv: false,
            per_layer_inputs: false,
            layer_output_scale: false,
            default_logit_softcap: 0.0,
            encoder: false,
            bidirectional: false,
            positions: Positions::Embedded,
            gated_encoder_ffn: false,
            mrope: false,
        };
        const SOFTMAX_EXPERTS: Experts = Experts {
            normalize_weights: false,
            shared_expert: false,
            gating: Gating::Softmax,
            selection_bias: false,
        };
        const GEMMA: ArchTraits = ArchTraits {
            qk_norm: true,
            post_norms: true,
            embed_scale: EmbedScale::SqrtWidth,
            act: Activation::GeGlu,
            swa: SwaLayers::Period(6),
            ..DENSE
        };
        const BERT: ArchTraits = ArchTraits { qkv_bias: true, encoder: true, bidirectional: true, ..DENSE };
        // (llama.cpp's converter names LFM2's final norm after the embeddings.)
        const LFM2: ArchTraits =
            ArchTraits { qk_norm: true, short_conv: true, output_norm: "token_embd_norm.weight", ..DENSE };
        match self {
            Arch::Llama => ArchTraits { rope: RopeMode::Normal, ..DENSE },
            Arch::Qwen2 => ArchTraits { qkv_bias: true, ..DENSE },
            Arch::Qwen2Vl => ArchTraits { qkv_bias: true, mrope: true, ..DENSE },
            Arch::Qwen3 => ArchTraits { qk_norm: true, ..DENSE },
            Arch::Qwen3Moe => ArchTraits {
                qk_norm: true,
                ffn: Ffn::Experts(Experts { normalize_weights: true, ..SOFTMAX_EXPERTS }),
                ..DENSE
            },
            Arch::Qwen2Moe => ArchTraits {
                qkv_bias: true,
                ffn: Ffn::Experts(Experts { shared_expert: true, ..SOFTMAX_EXPERTS }),
                ..DENSE
            },
            Arch::Gemma3 => GEMMA,
            Arch::Gemma4 => ArchTraits {
                value_norm: true,
                values_from_keys: true,
                unit_kq_scale: true,
                full_layer_rope_freqs: true,
                swa: SwaLayers::Pattern,
                sliding_sizes: true,
                per_layer_ffn: true,
                shared_kv: true,
                per_layer_inputs: true,
                layer_output_scale: true,
                default_logit_softcap: 30.0,
                ..GEMMA
            },
            Arch::Granite => ArchTraits { rope: RopeMode::Normal, multipliers: true, ..DENSE },
            Arch::SmolLm3 => ArchTraits { rope: RopeMode::Normal, no_rope_every: 4, ..DENSE },
            Arch::Phi3 => {
                ArchTraits { fused_gate_up: true, long_rope: true, prescaled_queries: true, ..DENSE }
            }
            Arch::Lfm2 => LFM2,
            Arch::Qwen35 => ArchTraits {
                qk_norm: true,
                ffn_norm: "post_attention_norm.weight",
                delta_net: true,
                attn_output_gate: true,
                ..DENSE
            },
            Arch::Bert => BERT,
            Arch::GemmaEmbedding => ArchTraits { bidirectional: true, swa: SwaLayers::PeriodKey(6), ..GEMMA },
            Arch::NomicBert => {
                ArchTraits { qkv_bias: false, positions: Positions::Rotary, gated_encoder_ffn: true, ..BERT }
            }
            Arch::JinaBertV2 => ArchTraits {
                positions: Positions::Alibi(8.0),
                act: Activation::GeGlu,
                fused_gate_up: true,
                gated_encoder_ffn: true,
                ..BERT
            },
            Arch::Lfm2Moe => ArchTraits {
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
        Self::ALL.into_iter().find(|a| a.name() == name)
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
