//! Hyper-parameters read from `{arch}.*` metadata keys, with their ranges checked.

use core::fmt::Write;

use super::{Arch, Gating, ModelError, SwaLayers};
use crate::gguf::{name_of, Gguf, GgufError, Name, ValueType};

/// Most layers accepted (llama.cpp's own limit; no public model comes close).
pub const MAX_LAYERS: u32 = 512;
/// Largest embedding / feed-forward width accepted.
const MAX_WIDTH: u32 = 1 << 18;
/// Most attention heads accepted.
const MAX_HEADS: u32 = 1024;
/// Largest head dimension accepted.
const MAX_HEAD_DIM: u32 = 1024;
/// Most experts accepted.
const MAX_EXPERTS: u32 = 1024;
/// Most taps of a short convolution accepted (LFM2 has 3).
const MAX_CONV_KERNEL: u32 = 64;

/// The hyper-parameters of a model, all validated.
#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    /// Architecture.
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layer: u32,
    /// Context length the model was trained for.
    pub n_ctx_train: u32,
    /// Embedding width.
    pub n_embd: u32,
    /// Feed-forward width (per expert width is `n_ff_expert`).
    pub n_ff: u32,
    /// Query heads.
    pub n_head: u32,
    /// Key/value heads (divides `n_head`).
    pub n_head_kv: u32,
    /// Dimension of one key head.
    pub head_dim_k: u32,
    /// Dimension of one value head.
    pub head_dim_v: u32,
    /// Dimensions rotated by RoPE (even, at most `head_dim_k`).
    pub n_rot: u32,
    /// RoPE frequency base.
    pub rope_freq_base: f32,
    /// RoPE frequency scale (1 / `rope.scaling.factor` for linear scaling).
    pub rope_freq_scale: f32,
    /// Epsilon of the norms: the RMS norms (`attention.layer_norm_rms_epsilon`), an encoder's
    /// LayerNorms (`attention.layer_norm_epsilon`).
    pub rms_eps: f32,
    /// Experts per MoE layer (0 for dense models).
    pub n_expert: u32,
    /// Experts used per token.
    pub n_expert_used: u32,
    /// Feed-forward width of one expert.
    pub n_ff_expert: u32,
    /// Feed-forward width of the shared expert (qwen2moe).
    pub n_ff_shared: u32,
    /// Sliding attention window (gemma3 local layers), 0 when none.
    pub sliding_window: u32,
    /// Multiplier of the input embeddings (granite's `embedding_scale`); 1: none.
    pub embedding_scale: f32,
    /// Multiplier of each block's attention and FFN outputs before their residual adds (granite's
    /// `residual_scale`); 1: none.
    pub residual_scale: f32,
    /// Scale of attention scores (granite's `attention.scale`); `None`: 1/sqrt(head size).
    pub attention_scale: Option<f32>,
    /// Divisor of the logits (granite's `logit_scale`); 1: none.
    pub logit_scale: f32,
    /// Multiplier of RoPE's cosines and sines (`rope.scaling.attn_factor`, LongRoPE); 1: none.
    pub rope_attn_factor: f32,
    /// M-RoPE's sections (`rope.dimension_sections`, an M-RoPE architecture's): pairs turned by
    /// the time, row and column positions (all zero for other architectures).
    pub rope_sections: [u32; 3],
    /// Context before RoPE scaling (`rope.scaling.original_context_length`, default the training
    /// context): LongRoPE takes its long factors for contexts above it; YaRN's ramp is sized by it.
    pub n_ctx_orig: u32,
    /// `rope.scaling.type` is yarn: angles blend interpolation and extrapolation per pair, and
    /// RoPE's cosines and sines grow by 1 + 0.1 ln(factor) (see `model::LayerRope`).
    pub rope_yarn: bool,
    /// Layers without attention and KV cache, carrying a recurrent state instead (LFM2's short
    /// convolutions: the layers whose `attention.head_count_kv` entry is 0).
    pub recurrent: LayerMask,
    /// Taps of the short convolution (`shortconv.l_cache`, at least 2), 0 without one.
    pub conv_kernel: u32,
    /// The gated delta rule's sizes (Qwen3.5's linear-attention layers), `None` without them.
    pub delta: Option<DeltaNet>,
    /// Leading layers with a dense FFN in a mixture-of-experts model
    /// (`leading_dense_block_count`, lfm2moe).
    pub n_dense_lead: u32,
    /// Sliding-window attention layers (Gemma 3: five of every six; Gemma 4:
    /// `attention.sliding_window_pattern`).
    pub sliding: LayerMask,
    /// Key head size of sliding-window layers (`attention.key_length_swa`, Gemma 4).
    pub head_dim_k_swa: u32,
    /// Value head size of sliding-window layers.
    pub head_dim_v_swa: u32,
    /// Dimensions rotated in sliding-window layers (`rope.dimension_count_swa`).
    pub n_rot_swa: u32,
    /// RoPE frequency base of sliding-window layers (`rope.freq_base_swa`).
    pub rope_freq_base_swa: f32,
    /// Layers from the first with a KV cache of their own; the later ones read the cache of the
    /// last such layer of their kind (Gemma 4's `attention.shared_kv_layers`). `n_layer` without
    /// sharing.
    pub n_layer_kv: u32,
    /// Width of each layer's slice of the per-layer token embeddings
    /// (`embedding_length_per_layer_input`, Gemma 4), 0 without them.
    pub n_embd_per_layer: u32,
    /// Logits become `c * tanh(logits / c)` (`final_logit_softcapping`); 0: none.
    pub final_logit_softcap: f32,
    /// Feed-forward width per layer when `feed_forward_length` is an array (Gemma 4's wider
    /// MLP in KV-sharing layers); empty: every layer has `n_ff`.
    pub n_ff_layers: heapless::Vec<u32, { MAX_LAYERS as usize }>,
    /// How the file says its embeddings are pooled (`pooling_type`), if it says.
    pub pooling: Option<Pooling>,
}

/// How an embedding output makes one vector of a sequence's token vectors (llama.cpp's
/// `pooling_type` ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// None: every token's vector.
    None = 0,
    /// The mean of the sequence's vectors.
    Mean = 1,
    /// The first token's (`[CLS]`).
    Cls = 2,
    /// The last token's.
    Last = 3,
    /// A classifier head (`cls`, `cls.output`) over the first token's: a reranker's scores.
    Rank = 4,
}

impl Pooling {
    /// Every kind, in llama.cpp's order.
    pub const ALL: [Pooling; 5] = [Pooling::None, Pooling::Mean, Pooling::Cls, Pooling::Last, Pooling::Rank];

    /// llama.cpp's name (`--pooling`).
    pub const fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether a sequence gives one vector (every kind but `none`).
    pub fn pools(self) -> bool {
        self != Pooling::None
    }
}

/// The sizes of Qwen3.5's linear-attention (gated delta rule) layers (`{arch}.ssm.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNet {
    /// Taps of the convolution over Q, K and V (`ssm.conv_kernel`).
    pub conv_kernel: u32,
    /// Size of a key, query and value head, and of each head's state (`ssm.state_size`).
    pub head_dim: u32,
    /// Query and key heads (`ssm.group_count`).
    pub n_k_heads: u32,
    /// Value heads, each with its own state (`ssm.time_step_rank`).
    pub n_v_heads: u32,
}

impl DeltaNet {
    /// Channels of the convolution: queries, keys and values together.
    pub fn conv_channels(&self) -> usize {
        (2 * self.n_k_heads as usize + self.n_v_heads as usize) * self.head_dim as usize
    }

    /// Width of all value heads together (the gate's and the output projection's).
    pub fn v_width(&self) -> usize {
        self.n_v_heads as usize * self.head_dim as usize
    }
}

/// One bit per layer, for the per-layer kinds of hybrid models.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerMask([u64; MAX_LAYERS as usize / 64]);

impl LayerMask {
    /// Whether layer `il` is in the set.
    pub fn contains(&self, il: usize) -> bool {
        self.0.get(il / 64).is_some_and(|w| (w >> (il % 64)) & 1 == 1)
    }

    /// Adds layer `il` (below [`MAX_LAYERS`]).
    pub fn insert(&mut self, il: usize) {
        if let Some(w) = self.0.get_mut(il / 64) {
            *w |= 1 << (il % 64);
        }
    }

    /// Layers in the set below layer `il` (a few popcounts: graph builds ask for every layer).
    pub fn count_below(&self, il: usize) -> usize {
        let (whole, bits) = (il / 64, il % 64);
        let below: u32 = self.0.iter().take(whole).map(|w| w.count_ones()).sum();
        let partial = self.0.get(whole).map_or(0, |w| (w & ((1u64 << bits) - 1)).count_ones());
        (below + partial) as usize
    }

    /// Layers in the set.
    pub fn count(&self) -> usize {
        self.count_below(MAX_LAYERS as usize)
    }

    /// The layers in both sets.
    pub fn and(&self, other: &Self) -> Self {
        Self(core::array::from_fn(|i| self.0[i] & other.0[i]))
    }

    /// The layers in this set and not in `other`.
    pub fn and_not(&self, other: &Self) -> Self {
        Self(core::array::from_fn(|i| self.0[i] & !other.0[i]))
    }
}

impl core::fmt::Debug for LayerMask {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_set().entries((0..MAX_LAYERS as usize).filter(|&i| self.contains(i))).finish()
    }
}

/// `{arch}.{suffix}` as a key.
pub(crate) fn arch_key(arch: Arch, suffix: &str) -> Name {
    let mut key = Name::new();
    let _ = write!(key, "{}.{}", arch.name(), suffix);
    key
}

fn bad(key: &str, value: impl Into<f64>, problem: &'static str) -> ModelError {
    ModelError::BadHParam { key: name_of(key), value: value.into(), problem }
}

/// A u32 in `range`, required or with a default.
fn u32_in(
    g: &Gguf<'_>,
    key: &str,
    default: Option<u32>,
    range: core::ops::RangeInclusive<u32>,
) -> Result<u32, ModelError> {
    let value = match (g.get_int::<u32>(key)?, default) {
        (Some(v), _) => v,
        (None, Some(d)) => d,
        (None, None) => return Err(GgufError::MissingKey { key: name_of(key) }.into()),
    };
    if !range.contains(&value) {
        return Err(bad(key, value, "out of the accepted range"));
    }
    Ok(value)
}

/// A finite float in `(lo, hi]` (required when `default` is `None`).
fn f32_in(g: &Gguf<'_>, key: &str, default: Option<f32>, lo: f32, hi: f32) -> Result<f32, ModelError> {
    let value = match (g.get_f32_opt(key)?, default) {
        (Some(v), _) => v,
        (None, Some(d)) => d,
        (None, None) => return Err(GgufError::MissingKey { key: name_of(key) }.into()),
    };
    if !(value.is_finite() && value > lo && value <= hi) {
        return Err(bad(key, value, "not a finite value in the accepted range"));
    }
    Ok(value)
}

/// What pinfer computes for a key whose value changes the math; other values are refused at load.
#[derive(Clone, Copy)]
enum Computes {
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// This number only: the value that leaves the math as pinfer computes it.
    Only(f64),
    /// This flag only.
    Flag(bool),
}

/// Which architectures a row of [`MATH_KEYS`] applies to.
#[derive(Clone, Copy)]
enum ReadBy {
    /// This one.
    Arch(Arch),
    /// Those with LongRoPE (`true`: its factor tensors and attention factor are computed) or
    /// those without.
    LongRope(bool),
    /// Those attending both ways (`true`: the encoders, EmbeddingGemma) or causally.
    Bidirectional(bool),
}

impl ReadBy {
    fn applies_to(self, arch: Arch) -> bool {
        match self {
            Self::Arch(a) => a == arch,
            Self::LongRope(long) => arch.traits().long_rope == long,
            Self::Bidirectional(both) => arch.traits().bidirectional == both,
        }
    }
}

/// `{arch}.` keys whose values change the math beyond what [`HParams`] holds: the architectures
/// whose values pinfer checks (as llama.cpp's `load_hparams` reads them), what pinfer computes,
/// and that in words. A file with another value is refused naming the key, never run with wrong
/// numbers.
const MATH_KEYS: [(&str, ReadBy, Computes, &str); 9] = [
    (
        "rope.scaling.type",
        ReadBy::LongRope(false),
        Computes::OneOf(&["none", "linear", "yarn"]),
        "none, linear or yarn",
    ),
    (
        "rope.scaling.type",
        ReadBy::LongRope(true),
        Computes::OneOf(&["none", "linear", "yarn", "longrope"]),
        "none, linear, yarn or longrope",
    ),
    // LongRoPE's attention factor is computed (`HParams::rope_attn_factor`).
    ("rope.scaling.attn_factor", ReadBy::LongRope(false), Computes::Only(1.0), "1"),
    // false: Granite without RoPE on any layer.
    ("rope.scaling.finetuned", ReadBy::Arch(Arch::Granite), Computes::Flag(true), "true"),
    ("attention.causal", ReadBy::Bidirectional(false), Computes::Flag(true), "true"),
    // An encoder attends both ways within its sequence.
    ("attention.causal", ReadBy::Bidirectional(true), Computes::Flag(false), "false"),
    ("attention.sliding_window_pattern", ReadBy::Arch(Arch::Gemma3), Computes::Only(6.0), "6"),
    ("rope.freq_base_swa", ReadBy::Arch(Arch::Gemma3), Computes::Only(10000.0), "10000"),
    ("final_logit_softcapping", ReadBy::Arch(Arch::Gemma3), Computes::Only(0.0), "0 (no soft-capping)"),
];

/// Key-length keys of sliding-window layers: pinfer runs them with other sizes than the full
/// layers' only where the architecture reads them (`ArchTraits::sliding_sizes`).
const SWA_SIZE_KEYS: [(&str, &str); 3] = [
    ("attention.key_length_swa", "attention.key_length"),
    ("attention.value_length_swa", "attention.value_length"),
    ("rope.dimension_count_swa", "rope.dimension_count"),
];

/// A value as text for a message.
fn value_text(v: &crate::gguf::Value<'_>) -> Name {
    use crate::gguf::Value;
    let mut text = Name::new();
    let _ = match *v {
        Value::String(_) => write!(text, "{:?}", v.as_str().unwrap_or("(not UTF-8)")),
        Value::F32(x) => write!(text, "{x}"),
        Value::F64(x) => write!(text, "{x}"),
        Value::Bool(b) => write!(text, "{b}"),
        Value::Array(a) => write!(text, "an array of {}", a.len()),
        Value::U8(_)
        | Value::I8(_)
        | Value::U16(_)
        | Value::I16(_)
        | Value::U32(_)
        | Value::I32(_)
        | Value::U64(_)
        | Value::I64(_) => write!(text, "{}", v.as_integer().unwrap_or(0)),
    };
    text
}

/// Refuses a file whose metadata asks for math pinfer does not compute (see [`MATH_KEYS`]).
fn refuse_math_we_do_not_compute(g: &Gguf<'_>, arch: Arch, n_layer: u32) -> Result<(), ModelError> {
    use crate::gguf::Value;
    for (suffix, read_by, computes, words) in MATH_KEYS {
        if !read_by.applies_to(arch) {
            continue;
        }
        let key = arch_key(arch, suffix);
        let Some(v) = g.get(&key) else { continue };
        let number = match v {
            Value::F32(x) => Some(f64::from(x)),
            Value::F64(x) => Some(x),
            // Integers as numbers; a string, a flag or an array is no number.
            Value::U8(_)
            | Value::I8(_)
            | Value::U16(_)
            | Value::I16(_)
            | Value::U32(_)
            | Value::I32(_)
            | Value::U64(_)
            | Value::I64(_)
            | Value::Bool(_)
            | Value::String(_)
            | Value::Array(_) => v.as_integer().map(|i| i as f64),
        };
        let ok = match computes {
            Computes::OneOf(names) => v.as_str().is_some_and(|s| names.contains(&s)),
            Computes::Only(want) => number == Some(want),
            Computes::Flag(want) => v == Value::Bool(want),
        };
        if !ok {
            return Err(ModelError::Uncomputed { key, found: value_text(&v), computes: words });
        }
    }
    for (swa, full) in SWA_SIZE_KEYS.into_iter().filter(|_| !arch.traits().sliding_sizes) {
        let swa_key = arch_key(arch, swa);
        if let Some(v) = g.get(&swa_key) {
            let full_value = g.get(&arch_key(arch, full)).and_then(|f| f.as_integer());
            if v.as_integer().is_none() || v.as_integer() != full_value {
                return Err(ModelError::Uncomputed {
                    key: swa_key,
                    found: value_text(&v),
                    computes: "the same size as the full-attention layers",
                });
            }
        }
    }
    if arch.traits().delta_net {
        check_text_rope_sections(g, arch)?;
    }
    // Gemma 3 27B scales attention by 1/sqrt(n_embd/n_head), not by the head size (llama.cpp
    // tells it by its 62 layers).
    if arch == Arch::Gemma3 && n_layer == 62 {
        return Err(ModelError::Uncomputed {
            key: arch_key(arch, "block_count"),
            found: value_text(&Value::U32(n_layer)),
            computes: "Gemma 3 sizes other than 27B (62 layers: its attention scale is not implemented)",
        });
    }
    Ok(())
}

/// An array of one u32 per block (`n_layer_all` entries), each in `range`; an entry outside it
/// is refused naming the layer.
fn per_layer_u32(
    g: &Gguf<'_>,
    key: &str,
    n_layer_all: u32,
    range: core::ops::RangeInclusive<u32>,
) -> Result<heapless::Vec<u32, { MAX_LAYERS as usize }>, ModelError> {
    use crate::gguf::Value;
    let Some(Value::Array(a)) = g.get(key) else { return Err(bad(key, 0, "is not an array")) };
    if a.len() != n_layer_all as usize {
        return Err(bad(key, a.len() as f64, "has another number of entries than block_count"));
    }
    let mut out = heapless::Vec::new();
    for (il, v) in a.iter().enumerate() {
        let n = v.as_integer().unwrap_or(-1);
        if !(i128::from(*range.start())..=i128::from(*range.end())).contains(&n) {
            return Err(ModelError::BadLayerParam {
                key: name_of(key),
                layer: il as u32,
                value: n as f64,
                problem: "is outside the accepted range",
            });
        }
        let _ = out.push(n as u32);
    }
    Ok(out)
}

/// Sliding-window layers: Gemma 3's five of every six, Gemma 4's
/// `attention.sliding_window_pattern` (one flag per block).
fn sliding_layers(g: &Gguf<'_>, arch: Arch, n_layer: u32, n_layer_all: u32) -> Result<LayerMask, ModelError> {
    let mut mask = LayerMask::default();
    match arch.traits().swa {
        SwaLayers::None => {}
        SwaLayers::Period(period) => {
            (0..n_layer).filter(|il| il % period < period - 1).for_each(|il| mask.insert(il as usize));
        }
        SwaLayers::PeriodKey(default) => {
            let key = arch_key(arch, "attention.sliding_window_pattern");
            let period = u32_in(g, &key, Some(default), 1..=MAX_LAYERS)?;
            (0..n_layer).filter(|il| il % period < period - 1).for_each(|il| mask.insert(il as usize));
        }
        SwaLayers::Pattern => {
            let key = arch_key(arch, "attention.sliding_window_pattern");
            let Some(v) = g.get(&key) else { return Err(GgufError::MissingKey { key }.into()) };
            return layer_flags(&key, v, n_layer, n_layer_all);
        }
    }
    Ok(mask)
}

/// A per-block flag array (`key`'s value `v`, one entry per block, bools or integers) as the
/// mask of the model's `n_layer` blocks flagged.
fn layer_flags(
    key: &str,
    v: crate::gguf::Value<'_>,
    n_layer: u32,
    n_layer_all: u32,
) -> Result<LayerMask, ModelError> {
    use crate::gguf::Value;
    let Value::Array(a) = v else { return Err(bad(key, 0, "is not an array of flags")) };
    if a.len() != n_layer_all as usize {
        return Err(bad(key, a.len() as f64, "has another number of entries than block_count"));
    }
    let mut mask = LayerMask::default();
    for (il, flag) in a.iter().enumerate().take(n_layer as usize) {
        let on = match flag {
            Value::Bool(b) => b,
            other => other.as_integer().ok_or_else(|| bad(key, il as f64, "entry is not a flag"))? != 0,
        };
        if on {
            mask.insert(il);
        }
    }
    Ok(mask)
}

/// The first layer reading another layer's KV cache (Gemma 4's `attention.shared_kv_layers`
/// counts them from the end), checked so that every reader's source (llama.cpp's: the last
/// layer with a cache for full attention, the one before for a sliding window) is a layer of
/// the reader's kind with a cache.
fn shared_kv_start(g: &Gguf<'_>, arch: Arch, n_layer: u32, sliding: &LayerMask) -> Result<u32, ModelError> {
    let key = arch_key(arch, "attention.shared_kv_layers");
    if !arch.traits().shared_kv {
        return Ok(n_layer);
    }
    let shared = u32_in(g, &key, Some(0), 0..=u32::MAX)?;
    if shared == 0 {
        return Ok(n_layer);
    }
    if shared > n_layer.saturating_sub(2) {
        return Err(bad(&key, shared, "leaves fewer than two layers with a KV cache to share"));
    }
    let n_kv = n_layer - shared;
    for il in n_kv..n_layer {
        let reader_sliding = sliding.contains(il as usize);
        let source = n_kv - if reader_sliding { 2 } else { 1 };
        if sliding.contains(source as usize) != reader_sliding {
            return Err(ModelError::BadLayerParam {
                key: key.clone(),
                layer: il,
                value: f64::from(source),
                problem: "would read the KV cache of a layer of the other attention kind",
            });
        }
    }
    Ok(n_kv)
}

/// Qwen3.5's linear-attention layers: `attention.recurrent_layers` (one flag per block), else
/// all but every `full_attention_interval`-th (default 4).
fn delta_net_layers(
    g: &Gguf<'_>,
    arch: Arch,
    n_layer: u32,
    n_layer_all: u32,
) -> Result<LayerMask, ModelError> {
    let key = arch_key(arch, "attention.recurrent_layers");
    if let Some(v) = g.get(&key) {
        return layer_flags(&key, v, n_layer, n_layer_all);
    }
    let mut mask = LayerMask::default();
    let interval = u32_in(g, &arch_key(arch, "full_attention_interval"), Some(4), 1..=n_layer)?;
    for il in 0..n_layer {
        if (il + 1) % interval != 0 {
            mask.insert(il as usize);
        }
    }
    Ok(mask)
}

/// The sizes of the gated delta rule (`{arch}.ssm.*`), checked against each other.
fn delta_net_sizes(g: &Gguf<'_>, arch: Arch) -> Result<DeltaNet, ModelError> {
    let k = |suffix| arch_key(arch, suffix);
    let conv_kernel = u32_in(g, &k("ssm.conv_kernel"), None, 2..=MAX_CONV_KERNEL)?;
    let head_dim = u32_in(g, &k("ssm.state_size"), None, 1..=MAX_HEAD_DIM)?;
    let n_k_heads = u32_in(g, &k("ssm.group_count"), None, 1..=MAX_HEADS)?;
    let n_v_heads = u32_in(g, &k("ssm.time_step_rank"), None, 1..=MAX_HEADS)?;
    if n_v_heads % n_k_heads != 0 {
        return Err(bad(&k("ssm.time_step_rank"), n_v_heads, "is not a multiple of ssm.group_count"));
    }
    let inner = u32_in(g, &k("ssm.inner_size"), None, 1..=MAX_WIDTH)?;
    if u64::from(inner) != u64::from(n_v_heads) * u64::from(head_dim) {
        return Err(bad(&k("ssm.inner_size"), inner, "is not ssm.time_step_rank x ssm.state_size"));
    }
    Ok(DeltaNet { conv_kernel, head_dim, n_k_heads, n_v_heads })
}

/// `attention.head_count_kv`, one value or one per layer: the attention layers' count (they must
/// agree and divide `head_count`) and the layers with 0, which hybrid architectures run as
/// recurrent blocks (any other refuses a 0, naming the layer).
fn kv_heads_per_layer(
    g: &Gguf<'_>,
    arch: Arch,
    n_layer: u32,
    n_head: u32,
) -> Result<(u32, LayerMask), ModelError> {
    use crate::gguf::Value;
    let key = arch_key(arch, "attention.head_count_kv");
    let mut recurrent = LayerMask::default();
    let layer_err = |layer: usize, value: i128, problem| ModelError::BadLayerParam {
        key: key.clone(),
        layer: layer as u32,
        value: value as f64,
        problem,
    };
    let n_head_kv = match g.get(&key) {
        Some(Value::Array(a)) => {
            if a.len() != n_layer as usize {
                return Err(bad(&key, a.len() as f64, "has another number of entries than block_count"));
            }
            let mut common = None;
            for (il, v) in a.iter().enumerate() {
                let n = v.as_integer().ok_or_else(|| layer_err(il, -1, "is not an integer"))?;
                if n == 0 && arch.traits().short_conv {
                    recurrent.insert(il);
                    continue;
                }
                if !(1..=i128::from(MAX_HEADS)).contains(&n) {
                    return Err(layer_err(il, n, "is outside 1..=1024 on an attention layer"));
                }
                match common {
                    None => common = Some(n as u32),
                    Some(c) if i128::from(c) != n => {
                        return Err(layer_err(
                            il,
                            n,
                            "differs from the other attention layers' (per-layer KV head counts are not supported)",
                        ))
                    }
                    Some(_) => {}
                }
            }
            common.unwrap_or(n_head)
        }
        _ => u32_in(g, &key, Some(n_head), 1..=MAX_HEADS)?,
    };
    if n_head % n_head_kv != 0 {
        return Err(bad(&key, n_head_kv, "does not divide head_count"));
    }
    Ok((n_head_kv, recurrent))
}

/// M-RoPE's sections (Qwen2-VL: 16, 24, 24, 0 pairs): three or four non-negative counts, the
/// fourth (positions no image of the families here has) zero, together at most `n_rot` (ggml's
/// bound; pair `i` falls in sector `i` mod their sum).
fn mrope_sections(g: &Gguf<'_>, arch: Arch, n_rot: u32) -> Result<[u32; 3], ModelError> {
    use crate::gguf::Value;
    let key = arch_key(arch, "rope.dimension_sections");
    let v = g.require(&key).map_err(ModelError::Metadata)?;
    let refuse = |computes| ModelError::Uncomputed { key: key.clone(), found: value_text(&v), computes };
    let Value::Array(a) = v else { return Err(refuse("an array of 4 section sizes")) };
    let values: heapless::Vec<i128, 4> = a.iter().take(4).map(|x| x.as_integer().unwrap_or(-1)).collect();
    if !(3..=4).contains(&a.len()) || values.iter().any(|&s| !(0..=i128::from(n_rot)).contains(&s)) {
        return Err(refuse("3 or 4 section sizes of rotated pairs"));
    }
    if values.get(3).is_some_and(|&s| s != 0) {
        return Err(refuse("no fourth section (positions no image here carries)"));
    }
    let sections = [values[0] as u32, values[1] as u32, values[2] as u32];
    let total: u32 = sections.iter().sum();
    if total == 0 || total > n_rot {
        return Err(refuse("sections of 1 to rope.dimension_count pairs in all"));
    }
    Ok(sections)
}

/// Qwen3.5 rotates by interleaved M-RoPE (`rope.dimension_sections`); for text every rotated
/// pair takes the token's position, which is plain NeoX RoPE, unless a section layout leaves pairs
/// to the fourth (image) position, which text holds at 0: such a file is refused.
fn check_text_rope_sections(g: &Gguf<'_>, arch: Arch) -> Result<(), ModelError> {
    use crate::gguf::Value;
    let key = arch_key(arch, "rope.dimension_sections");
    let Some(v) = g.get(&key) else { return Ok(()) };
    let mut sections = [0i128; 4];
    if let Value::Array(a) = v {
        for (s, x) in sections.iter_mut().zip(a.iter()) {
            *s = x.as_integer().unwrap_or(-1);
        }
    }
    let head_dim = g.get_int::<u32>(&arch_key(arch, "attention.key_length"))?;
    let n_rot = g.get_int::<u32>(&arch_key(arch, "rope.dimension_count"))?.or(head_dim).unwrap_or(0);
    let total: i128 = sections.iter().sum();
    let refuse = || ModelError::Uncomputed {
        key: key.clone(),
        found: value_text(&v),
        computes: "sections giving every rotated pair of a text token its position",
    };
    if sections.iter().any(|&s| s < 0) || total <= 0 {
        return Err(refuse());
    }
    // ggml's interleaved assignment: pair i falls in sector i mod total; sectors 3k+1 below
    // 3 * sections[1] rotate by the height position, 3k+2 below 3 * sections[2] by the width,
    // 3k below 3 * sections[0] by the time; any other by the fourth.
    for pair in 0..i128::from(n_rot / 2) {
        let s = pair % total;
        let text = (s % 3 == 1 && s < 3 * sections[1])
            || (s % 3 == 2 && s < 3 * sections[2])
            || (s % 3 == 0 && s < 3 * sections[0]);
        if !text {
            return Err(refuse());
        }
    }
    Ok(())
}

impl HParams {
    /// Reads the architecture and its hyper-parameters, refusing unsupported architectures by name
    /// and values outside sane ranges.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self, ModelError> {
        let arch_name = g.get_str("general.architecture")?;
        let Some(arch) = Arch::from_name(arch_name) else {
            if Arch::OTHER_MOE.contains(&arch_name) {
                return Err(ModelError::UnsupportedMoe { name: name_of(arch_name), experts: 0 });
            }
            return Err(ModelError::UnsupportedArch { name: name_of(arch_name) });
        };
        let k = |suffix| arch_key(arch, suffix);
        if !arch.is_moe() {
            if let Some(experts) = g.get_int::<u32>(&k("expert_count"))?.filter(|&n| n > 0) {
                return Err(ModelError::UnsupportedMoe { name: name_of(arch_name), experts });
            }
        }

        let n_layer_all = u32_in(g, &k("block_count"), None, 1..=MAX_LAYERS)?;
        // Multi-token-prediction blocks follow the model's own (llama.cpp runs them only to draft).
        let n_nextn = u32_in(g, &k("nextn_predict_layers"), Some(0), 0..=n_layer_all - 1)?;
        let n_layer = n_layer_all - n_nextn;
        let n_embd = u32_in(g, &k("embedding_length"), None, 1..=MAX_WIDTH)?;
        let n_ctx_train = u32_in(g, &k("context_length"), None, 1..=u32::MAX)?;
        let n_head = u32_in(g, &k("attention.head_count"), None, 1..=MAX_HEADS)?;
        let (n_head_kv, mut recurrent) = kv_heads_per_layer(g, arch, n_layer_all, n_head)?;
        let delta = if arch.traits().delta_net {
            recurrent = delta_net_layers(g, arch, n_layer, n_layer_all)?;
            Some(delta_net_sizes(g, arch)?)
        } else {
            None
        };
        let default_head_dim = (n_embd % n_head == 0).then_some(n_embd / n_head);
        let head_dim_k = u32_in(g, &k("attention.key_length"), default_head_dim, 1..=MAX_HEAD_DIM)?;
        let head_dim_v = u32_in(g, &k("attention.value_length"), Some(head_dim_k), 1..=MAX_HEAD_DIM)?;
        let n_rot = u32_in(g, &k("rope.dimension_count"), Some(head_dim_k), 2..=head_dim_k)?;
        if n_rot % 2 != 0 {
            return Err(bad(&k("rope.dimension_count"), n_rot, "must be even"));
        }
        let rope_freq_base = f32_in(g, &k("rope.freq_base"), Some(10000.0), 0.0, 1e12)?;
        // llama.cpp's older files name the factor `rope.scale_linear`; 0 means no scaling.
        let factor_key = if g.get(&k("rope.scaling.factor")).is_some() {
            "rope.scaling.factor"
        } else {
            "rope.scale_linear"
        };
        let scaling = match g.get_f32_opt(&k(factor_key))? {
            Some(0.0) => 1.0,
            _ => f32_in(g, &k(factor_key), Some(1.0), 0.0, 1e6)?,
        };
        // llama.cpp scales positions only for a scaling type other than "none".
        let scaling_type = g.get_str_opt(&k("rope.scaling.type"))?;
        let scaling = if scaling_type == Some("none") { 1.0 } else { scaling };
        let rope_yarn = scaling_type == Some("yarn");
        let eps_key = if arch.traits().encoder {
            "attention.layer_norm_epsilon"
        } else {
            "attention.layer_norm_rms_epsilon"
        };
        let rms_eps = f32_in(g, &k(eps_key), None, 0.0, 1.0)?;
        let pooling =
            match g.get_int::<u32>(&k("pooling_type"))? {
                None => None,
                Some(id) => Some(Pooling::ALL.into_iter().find(|p| *p as u32 == id).ok_or_else(|| {
                    bad(&k("pooling_type"), id, "is not a pooling type (0 none .. 4 rank)")
                })?),
            };

        let (n_expert, n_expert_used, n_ff_expert, n_ff_shared) = if arch.is_moe() {
            let n_expert = u32_in(g, &k("expert_count"), None, 2..=MAX_EXPERTS)?;
            let used = u32_in(g, &k("expert_used_count"), None, 1..=n_expert)?;
            let ff_expert = u32_in(g, &k("expert_feed_forward_length"), None, 1..=MAX_WIDTH)?;
            let ff_shared = if arch.has_shared_expert() {
                u32_in(g, &k("expert_shared_feed_forward_length"), None, 1..=MAX_WIDTH)?
            } else {
                0
            };
            (n_expert, used, ff_expert, ff_shared)
        } else {
            (0, 0, 0, 0)
        };
        // MoE models may omit the dense width; dense ones need it. Gemma 4 may give one per layer.
        let mut n_ff_layers = heapless::Vec::new();
        let n_ff = match g.get(&k("feed_forward_length")) {
            Some(crate::gguf::Value::Array(_)) if arch.traits().per_layer_ffn => {
                let widths = per_layer_u32(g, &k("feed_forward_length"), n_layer_all, 1..=MAX_WIDTH)?;
                n_ff_layers.extend(widths.iter().copied().take(n_layer as usize));
                n_ff_layers.iter().copied().max().unwrap_or(1)
            }
            _ => u32_in(g, &k("feed_forward_length"), arch.is_moe().then_some(n_ff_expert), 1..=MAX_WIDTH)?,
        };
        let sliding_window = u32_in(g, &k("attention.sliding_window"), Some(0), 0..=u32::MAX)?;
        if arch.traits().swa != SwaLayers::None && sliding_window == 0 {
            return Err(bad(&k("attention.sliding_window"), 0, "gemma3 needs a sliding window"));
        }
        refuse_math_we_do_not_compute(g, arch, n_layer)?;
        let n_dense_lead =
            if arch.is_moe() { u32_in(g, &k("leading_dense_block_count"), Some(0), 0..=n_layer)? } else { 0 };
        if let Some(x) = arch.experts() {
            // llama.cpp's gating functions: 1 softmax, 2 sigmoid.
            let want = match x.gating {
                Gating::Softmax => 1,
                Gating::Sigmoid => 2,
            };
            let key = k("expert_gating_func");
            match g.get_int::<u32>(&key)? {
                None if x.gating == Gating::Softmax => {}
                Some(v) if v == want => {}
                other => {
                    let found = other.map_or(-1.0, f64::from);
                    return Err(bad(&key, found, "is not this architecture's gating (1 softmax, 2 sigmoid)"));
                }
            }
        }
        let conv_kernel = if arch.traits().short_conv {
            u32_in(g, &k("shortconv.l_cache"), None, 2..=MAX_CONV_KERNEL)?
        } else {
            0
        };
        let rope_attn_factor = if arch.traits().long_rope {
            f32_in(g, &k("rope.scaling.attn_factor"), Some(1.0), 0.0, 100.0)?
        } else {
            1.0
        };
        let n_ctx_orig =
            u32_in(g, &k("rope.scaling.original_context_length"), Some(n_ctx_train), 1..=u32::MAX)?;
        let rope_sections = if arch.traits().mrope { mrope_sections(g, arch, n_rot)? } else { [0; 3] };
        // Granite's multipliers: 0 (or absent) means none, as in llama.cpp; the logit scale is
        // required there.
        let multiplier = |suffix: &'static str, required: bool| -> Result<Option<f32>, ModelError> {
            if !arch.traits().multipliers {
                return Ok(None);
            }
            let key = k(suffix);
            match g.get_f32_opt(&key)? {
                None if required => Err(GgufError::MissingKey { key }.into()),
                None | Some(0.0) => Ok(None),
                Some(_) => f32_in(g, &key, None, 0.0, 1e6).map(Some),
            }
        };
        let embedding_scale = multiplier("embedding_scale", false)?.unwrap_or(1.0);
        let residual_scale = multiplier("residual_scale", false)?.unwrap_or(1.0);
        let attention_scale = multiplier("attention.scale", false)?;
        let logit_scale = multiplier("logit_scale", true)?.unwrap_or(1.0);
        // A model that stores a per-layer array for one of these is a variant we do not run.
        for suffix in ["attention.head_count", "feed_forward_length"] {
            if matches!(g.get(&k(suffix)), Some(v) if v.value_type() == ValueType::Array)
                && !(suffix == "feed_forward_length" && arch.traits().per_layer_ffn)
            {
                return Err(bad(&k(suffix), 0, "per-layer values are not supported"));
            }
        }
        let sliding = sliding_layers(g, arch, n_layer, n_layer_all)?;
        // Sliding-window layers' own sizes and RoPE base (Gemma 4; Gemma 3's equal the full
        // layers' but for the base, which MATH_KEYS pins to 10000).
        let (head_dim_k_swa, head_dim_v_swa, n_rot_swa) = if arch.traits().sliding_sizes {
            let hk = u32_in(g, &k("attention.key_length_swa"), Some(head_dim_k), 1..=MAX_HEAD_DIM)?;
            let hv = u32_in(g, &k("attention.value_length_swa"), Some(head_dim_v), 1..=MAX_HEAD_DIM)?;
            let rot = u32_in(g, &k("rope.dimension_count_swa"), Some(n_rot.min(hk)), 2..=hk)?;
            if rot % 2 != 0 {
                return Err(bad(&k("rope.dimension_count_swa"), rot, "must be even"));
            }
            (hk, hv, rot)
        } else {
            (head_dim_k, head_dim_v, n_rot)
        };
        let rope_freq_base_swa = f32_in(g, &k("rope.freq_base_swa"), Some(10000.0), 0.0, 1e12)?;
        let n_layer_kv = shared_kv_start(g, arch, n_layer, &sliding)?;
        let n_embd_per_layer = if arch.traits().per_layer_inputs {
            u32_in(g, &k("embedding_length_per_layer_input"), None, 0..=MAX_WIDTH)?
        } else {
            0
        };
        // (llama.cpp's default for Gemma 4 is 30; an explicit 0 turns it off.)
        let final_logit_softcap = match g.get_f32_opt(&k("final_logit_softcapping"))? {
            None => arch.traits().default_logit_softcap,
            Some(0.0) => 0.0,
            Some(_) => f32_in(g, &k("final_logit_softcapping"), None, 0.0, 1e6)?,
        };
        let attention_scale = if arch.traits().unit_kq_scale { Some(1.0) } else { attention_scale };
        Ok(HParams {
            arch,
            n_layer,
            n_ctx_train,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_rot,
            rope_freq_base,
            rope_freq_scale: 1.0 / scaling,
            rms_eps,
            n_expert,
            n_expert_used,
            n_ff_expert,
            n_ff_shared,
            sliding_window,
            embedding_scale,
            residual_scale,
            attention_scale,
            logit_scale,
            rope_attn_factor,
            rope_sections,
            n_ctx_orig,
            rope_yarn,
            recurrent,
            conv_kernel,
            delta,
            n_dense_lead,
            sliding,
            head_dim_k_swa,
            head_dim_v_swa,
            n_rot_swa,
            rope_freq_base_swa,
            n_layer_kv,
            n_embd_per_layer,
            final_logit_softcap,
            n_ff_layers,
            pooling,
        })
    }

    /// Whether the model gives embeddings, not logits: an encoder, an architecture attending both
    /// ways (EmbeddingGemma), or a decoder whose file names a pooling (Qwen3-Embedding,
    /// Qwen3-Reranker). Such a model runs each input within one batch and keeps no KV cache.
    pub fn embeds(&self) -> bool {
        let traits = self.arch.traits();
        traits.encoder || traits.bidirectional || self.pooling.is_some()
    }

    /// Whether layer `il` attends through a sliding window.
    pub fn is_sliding(&self, il: usize) -> bool {
        self.sliding.contains(il)
    }

    /// Key head size of layer `il`.
    pub fn head_dim_k_at(&self, il: usize) -> u32 {
        if self.is_sliding(il) {
            self.head_dim_k_swa
        } else {
            self.head_dim_k
        }
    }

    /// Value head size of layer `il`.
    pub fn head_dim_v_at(&self, il: usize) -> u32 {
        if self.is_sliding(il) {
            self.head_dim_v_swa
        } else {
            self.head_dim_v
        }
    }

    /// Dimensions RoPE rotates in layer `il`.
    pub fn n_rot_at(&self, il: usize) -> u32 {
        if self.is_sliding(il) {
            self.n_rot_swa
        } else {
            self.n_rot
        }
    }

    /// Feed-forward width of layer `il`.
    pub fn n_ff_at(&self, il: usize) -> u32 {
        self.n_ff_layers.get(il).copied().unwrap_or(self.n_ff)
    }

    /// The layer whose KV cache layer `il` reads: its own, or for a KV-sharing layer (Gemma 4)
    /// llama.cpp's choice, the last layer with a cache for a full-attention reader and the one
    /// before it for a sliding one (checked at load to be of the reader's kind).
    pub fn kv_source(&self, il: usize) -> usize {
        let n_kv = self.n_layer_kv as usize;
        if il < n_kv {
            il
        } else {
            n_kv - if self.is_sliding(il) { 2 } else { 1 }
        }
    }

    /// Whether layer `il` writes a KV cache of its own (attention layers before the KV-sharing
    /// ones).
    pub fn has_own_kv(&self, il: usize) -> bool {
        il < self.n_layer_kv as usize && !self.recurrent.contains(il)
    }

    /// Width of all query heads of layer `il` together.
    pub fn q_width(&self, il: usize) -> u64 {
        u64::from(self.n_head) * u64::from(self.head_dim_k_at(il))
    }

    /// Width of all key heads of layer `il` together.
    pub fn k_width(&self, il: usize) -> u64 {
        u64::from(self.n_head_kv) * u64::from(self.head_dim_k_at(il))
    }

    /// Width of all value heads of layer `il` together.
    pub fn v_width(&self, il: usize) -> u64 {
        u64::from(self.n_head_kv) * u64::from(self.head_dim_v_at(il))
    }

    /// How layer `il`'s FFN routes its experts, if it is a mixture of experts (the leading dense
    /// layers of lfm2moe are not).
    pub fn experts_at(&self, il: usize) -> Option<crate::model::Experts> {
        self.arch.experts().filter(|_| il >= self.n_dense_lead as usize)
    }

    /// F32 values of one sequence's convolution state in one recurrent layer: the last
    /// `taps - 1` inputs of every channel (LFM2's short convolution, Qwen3.5's over Q, K, V).
    pub fn conv_state_len(&self) -> usize {
        match self.delta {
            Some(d) => (d.conv_kernel as usize - 1) * d.conv_channels(),
            None => self.conv_kernel.saturating_sub(1) as usize * self.n_embd as usize,
        }
    }

    /// F32 values of one sequence's delta-rule state in one recurrent layer (a `d x d` matrix
    /// per value head; 0 without the delta rule).
    pub fn delta_state_len(&self) -> usize {
        self.delta.map_or(0, |d| d.head_dim as usize * d.head_dim as usize * d.n_v_heads as usize)
    }
}
