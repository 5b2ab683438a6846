//! The transformer builder: the forward pass of the llama family (llama, qwen2, qwen3, their MoE
//! variants) and gemma3 as a graph on the engine. They differ in a few switches (biases, Q/K norms,
//! RoPE pairing, GeGLU, extra norms, embedding scale, sliding-window layers, the FFN), which
//! [`super::ArchTraits`] spells out. Weights are leaves in buffer 0 (the model file) at
//! their GGUF offsets; the KV cache and the token ids live in the arena's persistent region.
//! LoRA adapters' tensors are leaves in buffers 1.. (one per adapter, [`adapter_buffer`]).

use core::fmt::Write;

use super::{Activation, EmbedScale, Gating};
use crate::gguf::{name_of, Gguf};
use crate::graph::{Graph, GraphError, Mask};
use crate::kernels::reference::Yarn;
use crate::model::lora::{Adapter, LoraError, MAX_ADAPTERS, MAX_LORA_PAIRS};
use crate::model::{HParams, LayerMask, ModelError};
use crate::quant::{GgmlType, Lowercase};
use crate::tensor::{Storage, TensorId};

/// Index of the model file in the executor's buffer table.
pub const MODEL_BUFFER: u8 = 0;

/// Index of adapter `i`'s file in the executor's buffer table.
pub const fn adapter_buffer(i: usize) -> u8 {
    MODEL_BUFFER + 1 + i as u8
}

/// Which pairs of each adapter a graph applied, one bit per pair.
type Applied = [[u64; MAX_LORA_PAIRS / 64]; MAX_ADAPTERS];

/// `w x`, plus `scale * B (A x)` for every adapter holding a pair for `w` (llama.cpp's order:
/// the base product, then each adapter's term added in turn).
fn lora_mul_mat<const N: usize>(
    g: &mut Graph<N>,
    adapters: &[Adapter<'_>],
    applied: &mut Applied,
    w: TensorId,
    x: TensorId,
) -> Result<TensorId, GraphError> {
    let mut out = g.mul_mat(w, x)?;
    for (i, adapter) in adapters.iter().enumerate() {
        let name = g.tensor(w).name.clone();
        let Some(k) = adapter.lora.pairs.iter().position(|p| p.target == name.as_str()) else { continue };
        applied[i][k / 64] |= 1 << (k % 64);
        let pair = &adapter.lora.pairs[k];
        let leaf = |g: &mut Graph<N>, t: &crate::gguf::TensorInfo<'_>| {
            let offset = adapter.lora.data_start + t.offset as usize;
            let storage = Storage::External { buffer: adapter_buffer(i), offset };
            g.leaf(t.name, t.ty, [t.ne[0] as usize, t.ne[1] as usize, 1, 1], storage)
        };
        let (a, b) = (leaf(g, &pair.a)?, leaf(g, &pair.b)?);
        let ax = g.mul_mat(a, x)?;
        let bax = g.mul_mat(b, ax)?;
        let term = g.scale(bax, adapter.scale)?;
        out = g.add(out, term)?;
    }
    Ok(out)
}

/// The types of the KV cache (`-ctk/-ctv`): F16 by default, or any type for which
/// [`GgmlType::is_kv_cache_type`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTypes {
    /// Type of the keys.
    pub k: GgmlType,
    /// Type of the values.
    pub v: GgmlType,
}

impl Default for KvTypes {
    fn default() -> Self {
        Self { k: GgmlType::F16, v: GgmlType::F16 }
    }
}

/// Why a KV cache type cannot be used with a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTypeError {
    /// The type cannot hold a cache at all (the message lists the ones that can).
    NotACacheType(GgmlType),
    /// The head size is not a whole number of the type's blocks.
    HeadSize {
        /// The type.
        ty: GgmlType,
        /// The model's head size.
        head_dim: u32,
        /// Elements per block of the type.
        block: usize,
    },
}

impl core::fmt::Display for KvTypeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Self::NotACacheType(ty) => {
                write!(f, "{} cannot hold the KV cache (cache types:", Lowercase(ty.name()))?;
                for (i, t) in GgmlType::all().filter(|t| t.is_kv_cache_type()).enumerate() {
                    write!(f, "{}{}", if i == 0 { " " } else { ", " }, Lowercase(t.name()))?;
                }
                f.write_str(")")
            }
            Self::HeadSize { ty, head_dim, block } => write!(
                f,
                "a {} KV cache stores blocks of {block} values, and this model's heads have {head_dim} \
                 (not a multiple of {block}); use f16, bf16 or f32",
                Lowercase(ty.name())
            ),
        }
    }
}

impl KvTypes {
    /// The Walsh-Hadamard rotation of queries and keys before a quantized K cache stores them (the
    /// largest power of two from 64 up dividing the head size), as llama.cpp rotates them: dot
    /// products are unchanged and outliers are spread over the block, so quantizing loses less.
    /// `None` for f32/f16/bf16 keys or heads that are not a multiple of 64.
    pub fn k_rotation(&self, head_dim: u32) -> Option<usize> {
        let hd = head_dim as usize;
        (self.k.is_quantized() && hd % 64 == 0).then(|| 1 << hd.trailing_zeros())
    }

    /// The rotation of values before a quantized V cache stores them, undone on attention's
    /// output (runs of 64, llama.cpp's choice for V); `None` as for [`KvTypes::k_rotation`].
    pub fn v_rotation(&self, head_dim: u32) -> Option<usize> {
        (self.v.is_quantized() && head_dim % 64 == 0).then_some(64)
    }

    /// Checks that both types can hold `hp`'s cache: cache types whose blocks divide the head
    /// sizes.
    pub fn check(&self, hp: &HParams) -> Result<(), KvTypeError> {
        for (hd_k, hd_v) in [(hp.head_dim_k, hp.head_dim_v), (hp.head_dim_k_swa, hp.head_dim_v_swa)] {
            for (ty, head_dim) in [(self.k, hd_k), (self.v, hd_v)] {
                if !ty.is_kv_cache_type() {
                    return Err(KvTypeError::NotACacheType(ty));
                }
                let block = ty.block_len();
                if head_dim as usize % block != 0 || (hd_k.max(hd_v) as usize) % block != 0 {
                    return Err(KvTypeError::HeadSize { ty, head_dim, block });
                }
            }
        }
        Ok(())
    }
}

/// Where the per-layer KV caches and the step's inputs sit in the arena's persistent region.
///
/// The cache holds `n_seq` sequences of `n_ctx` positions each: sequence `s` owns rows
/// `s * n_ctx..(s + 1) * n_ctx` of every layer's K and V, each row one position's keys (values)
/// of every KV head in the cache's type. Layers with a cache of their own are packed (recurrent
/// layers and KV-sharing layers take no room); a sliding-window layer's rows may be of another
/// width (Gemma 4). A step's inputs are, per token, its id, its place (first cache row of its
/// sequence, position) and, for the tokens whose logits are wanted, their index in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Positions the cache holds per sequence.
    pub n_ctx: usize,
    /// Sequences the cache holds.
    pub n_seq: usize,
    /// Most tokens one graph evaluates (size of the inputs).
    pub n_batch: usize,
    /// The cache's types.
    pub types: KvTypes,
    /// The rows of full-attention layers (`[0]`) and of sliding-window layers (`[1]`).
    pub kinds: [CacheRows; 2],
    /// Layers of the model.
    pub n_layer: usize,
    /// The layers without a KV cache, with a recurrent state per sequence instead.
    pub recurrent: LayerMask,
    /// The sliding-window layers (rows of `kinds[1]`).
    pub sliding: LayerMask,
    /// The layers with a KV cache of their own.
    pub cached: LayerMask,
    /// Bytes of one sequence's convolution state in one recurrent layer (F32).
    pub conv_state_bytes: usize,
    /// Bytes of one sequence's delta-rule state in one recurrent layer (F32; 0 without).
    pub delta_state_bytes: usize,
    /// Offset of the recurrent states: per recurrent layer, `n_seq` convolution states, then
    /// `n_seq` delta-rule states.
    pub states_offset: usize,
    /// Offset of the token-id input (I32 `[n_batch]`).
    pub ids_offset: usize,
    /// Offset of the token places (I32 `[2, n_batch]`: first cache row, position).
    pub places_offset: usize,
    /// Offset of the output rows (I32 `[n_batch]`: batch indices of the tokens with logits).
    pub outputs_offset: usize,
    /// Bytes of the persistent region.
    pub total_bytes: usize,
}

/// The cache rows of one kind of layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheRows {
    /// Elements of one cache row (every KV head of one position).
    pub row_width: usize,
    /// Bytes of one position's K row in one layer.
    pub k_row_bytes: usize,
    /// Bytes of one position's V row in one layer.
    pub v_row_bytes: usize,
    /// Bytes of one layer's K cache.
    pub k_layer_bytes: usize,
    /// Bytes of one layer's V cache.
    pub v_layer_bytes: usize,
}

/// Bytes rounded up to the arena alignment.
fn aligned(n: usize) -> usize {
    n.next_multiple_of(crate::arena::ARENA_ALIGN)
}

impl CacheRows {
    /// Rows of `n_head_kv` heads of `hd_k`-wide keys and `hd_v`-wide values, `rows` per layer.
    fn new(n_head_kv: u32, hd_k: u32, hd_v: u32, rows: usize, types: KvTypes) -> Option<Self> {
        let row_width = (n_head_kv as usize).checked_mul(hd_k.max(hd_v) as usize)?;
        let row_bytes = |ty: GgmlType| -> Option<usize> {
            if row_width % ty.block_len() != 0 {
                return None;
            }
            usize::try_from(ty.bytes_for(row_width as u64)?).ok()
        };
        let (k_row_bytes, v_row_bytes) = (row_bytes(types.k)?, row_bytes(types.v)?);
        let k_layer_bytes = aligned(k_row_bytes.checked_mul(rows)?);
        let v_layer_bytes = aligned(v_row_bytes.checked_mul(rows)?);
        Some(Self { row_width, k_row_bytes, v_row_bytes, k_layer_bytes, v_layer_bytes })
    }

    /// Bytes of one layer's K and V caches.
    fn layer_bytes(&self) -> usize {
        self.k_layer_bytes + self.v_layer_bytes
    }
}

impl KvLayout {
    /// The layout for `hp` with `n_seq` sequences of `n_ctx` positions in a cache of `types`
    /// and batches of up to `n_batch` tokens; `None` if the sizes overflow or a type cannot
    /// hold rows of the model's width (see [`KvTypes::check`] for the reason).
    pub fn new(hp: &HParams, n_ctx: usize, n_batch: usize, n_seq: usize, types: KvTypes) -> Option<Self> {
        let rows = n_ctx.checked_mul(n_seq)?;
        let kinds = [
            CacheRows::new(hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, rows, types)?,
            CacheRows::new(hp.n_head_kv, hp.head_dim_k_swa, hp.head_dim_v_swa, rows, types)?,
        ];
        let n_layer = hp.n_layer as usize;
        let recurrent = hp.recurrent;
        let mut cached = LayerMask::default();
        let mut caches = 0usize;
        for il in (0..n_layer).filter(|&il| hp.has_own_kv(il)) {
            cached.insert(il);
            caches = caches.checked_add(kinds[hp.is_sliding(il) as usize].layer_bytes())?;
        }
        let conv_state_bytes = hp.conv_state_len().checked_mul(4)?;
        let delta_state_bytes = hp.delta_state_len().checked_mul(4)?;
        let state_bytes = conv_state_bytes.checked_add(delta_state_bytes)?;
        let states = aligned(state_bytes.checked_mul(n_seq)?.checked_mul(recurrent.count())?);
        let states_offset = caches;
        let input = aligned(n_batch.checked_mul(4)?);
        let ids_offset = caches.checked_add(states)?;
        let places_offset = ids_offset.checked_add(input)?;
        let outputs_offset = places_offset.checked_add(input.checked_mul(2)?)?;
        let total_bytes = outputs_offset.checked_add(input)?;
        Some(Self {
            n_ctx,
            n_seq,
            n_batch,
            types,
            kinds,
            n_layer,
            recurrent,
            sliding: hp.sliding,
            cached,
            conv_state_bytes,
            delta_state_bytes,
            states_offset,
            ids_offset,
            places_offset,
            outputs_offset,
            total_bytes,
        })
    }

    /// Cache rows of every layer: `n_ctx` per sequence.
    pub fn cache_rows(&self) -> usize {
        self.n_ctx * self.n_seq
    }

    /// The rows of layer `layer`'s cache.
    pub fn rows_of(&self, layer: usize) -> &CacheRows {
        &self.kinds[self.sliding.contains(layer) as usize]
    }

    /// Offset of layer `layer`'s K cache (the layers with one are packed).
    pub fn k_offset(&self, layer: usize) -> usize {
        let full = self.cached.and_not(&self.sliding).count_below(layer);
        let sliding = self.cached.and(&self.sliding).count_below(layer);
        full * self.kinds[0].layer_bytes() + sliding * self.kinds[1].layer_bytes()
    }

    /// The layers with a KV cache of their own, in order.
    pub fn cached_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.n_layer).filter(|&il| self.cached.contains(il))
    }

    /// Bytes of one sequence's states in one recurrent layer.
    pub fn state_bytes(&self) -> usize {
        self.conv_state_bytes + self.delta_state_bytes
    }

    /// Offset of recurrent layer `layer`'s convolution states (`n_seq` of
    /// [`Self::conv_state_bytes`]).
    pub fn conv_states_of(&self, layer: usize) -> usize {
        self.states_offset + self.recurrent.count_below(layer) * self.n_seq * self.state_bytes()
    }

    /// Offset of recurrent layer `layer`'s delta-rule states (`n_seq` of
    /// [`Self::delta_state_bytes`]).
    pub fn delta_states_of(&self, layer: usize) -> usize {
        self.conv_states_of(layer) + self.n_seq * self.conv_state_bytes
    }

    /// Each recurrent layer's states of sequence `seq`: (offset, bytes), the convolution's then
    /// the delta rule's.
    pub fn sequence_states(&self, seq: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.n_layer).filter(|&il| self.recurrent.contains(il)).flat_map(move |il| {
            let conv = (self.conv_states_of(il) + seq * self.conv_state_bytes, self.conv_state_bytes);
            let delta = (self.delta_states_of(il) + seq * self.delta_state_bytes, self.delta_state_bytes);
            [conv, delta].into_iter().filter(|&(_, bytes)| bytes > 0)
        })
    }

    /// Offset of layer `layer`'s V cache.
    pub fn v_offset(&self, layer: usize) -> usize {
        self.k_offset(layer) + self.rows_of(layer).k_layer_bytes
    }

    /// Each layer's K and V caches as (offset, bytes of one position's row), K first.
    pub fn layer_caches(&self, layer: usize) -> [(usize, usize); 2] {
        let rows = self.rows_of(layer);
        [(self.k_offset(layer), rows.k_row_bytes), (self.v_offset(layer), rows.v_row_bytes)]
    }

    /// Bytes of one position's rows in every layer with a cache (K and V).
    pub fn position_bytes(&self) -> usize {
        self.cached_layers().map(|il| self.rows_of(il).k_row_bytes + self.rows_of(il).v_row_bytes).sum()
    }
}

/// The inputs and outputs of a built forward graph.
#[derive(Debug, Clone, Copy)]
pub struct Forward {
    /// I32 token ids `[n_tokens]` (persistent storage at `KvLayout::ids_offset`).
    pub ids: TensorId,
    /// F32 logits `[n_vocab, n_outputs]`, in the order of the output rows.
    pub logits: TensorId,
    /// Tokens the graph evaluates.
    pub n_tokens: usize,
    /// Tokens whose logits it computes (all of them when equal to `n_tokens`, else the ones the
    /// output-rows input names).
    pub n_outputs: usize,
}

/// RoPE of one layer (Gemma 3 and 4: sliding-window layers with their own base, Gemma 4's also
/// with their own rotated size; SmolLM3: every fourth layer without RoPE). The forward pass and
/// the context shift (which re-rotates cached keys) read it here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerRope {
    /// Frequency base.
    pub base: f32,
    /// Frequency scale (linear position scaling).
    pub scale: f32,
    /// A sliding-window layer (its own table of angles, without the file's frequency factors:
    /// `rope_freqs` belongs to full-attention layers, as llama.cpp gives it).
    pub sliding: bool,
    /// Dimensions rotated.
    pub n_rot: usize,
    /// Whether the layer rotates queries and keys at all.
    pub rotates: bool,
    /// YaRN's blend of angles, for YaRN-scaled models.
    pub yarn: Option<Yarn>,
    /// Multiplier of the forward pass's cosines and sines (LongRoPE's attention factor, YaRN's
    /// magnitude correction); the context shift rotates by the bare angles.
    pub mscale: f32,
}

/// llama.cpp's YaRN betas for the architectures here (it reads no key for them).
const YARN_BETA_FAST: f32 = 32.0;
const YARN_BETA_SLOW: f32 = 1.0;

/// The RoPE of layer `il`.
pub fn layer_rope(hp: &HParams, il: usize) -> LayerRope {
    let traits = hp.arch.traits();
    let sliding = hp.is_sliding(il);
    let every = traits.no_rope_every;
    let rotates = every == 0 || (il as u32 + 1) % every != 0;
    let n_rot = hp.n_rot_at(il) as usize;
    let (base, scale) =
        if sliding { (hp.rope_freq_base_swa, 1.0) } else { (hp.rope_freq_base, hp.rope_freq_scale) };
    let mut mscale = hp.rope_attn_factor;
    let yarn = hp.rope_yarn.then(|| {
        // llama.cpp's float steps: the context's attention factor get_mscale(f) / (1 + 0.1 ln f)
        // (the model's factor f), then ggml's rope_yarn times 1 + 0.1 ln(1 / layer scale).
        let factor = 1.0 / hp.rope_freq_scale;
        let get_mscale = if factor <= 1.0 { 1.0 } else { 0.1 * libm::logf(factor) + 1.0 };
        let context = get_mscale * (1.0 / (1.0 + 0.1 * libm::logf(factor))) * hp.rope_attn_factor;
        mscale = context * (1.0 + 0.1 * libm::logf(1.0 / scale));
        let corr_dims = Yarn::corr_dims(n_rot, hp.n_ctx_orig, base, YARN_BETA_FAST, YARN_BETA_SLOW);
        Yarn { ext_factor: 1.0, corr_dims }
    });
    LayerRope { base, scale, sliding, n_rot, rotates, yarn, mscale }
}

/// The tensor of per-pair RoPE frequency divisors a context of `n_ctx` positions uses, if the
/// file has it: LongRoPE's long factors above the original context, else its short ones
/// (llama.cpp's choice, made once from the context size), or llama 3's `rope_freqs`.
pub fn rope_factors_name(hp: &HParams, n_ctx: usize) -> &'static str {
    if !hp.arch.traits().long_rope {
        "rope_freqs.weight"
    } else if n_ctx > hp.n_ctx_orig as usize {
        "rope_factors_long.weight"
    } else {
        "rope_factors_short.weight"
    }
}

/// The value of a layer's one-element F32 `layer_output_scale` (Gemma 4), if the file has one.
fn layer_output_scale(gguf: &Gguf<'_>, name: &str) -> Option<f32> {
    let info = gguf.tensor(name)?;
    if info.ty != GgmlType::F32 || info.ne != [1, 1, 1, 1] {
        return None;
    }
    let bytes = gguf.tensor_data(&info).get(..4)?;
    Some(f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

/// Builds the forward pass for `n_tokens` tokens, with logits for `n_outputs` of them: all
/// (`n_outputs == n_tokens`, perplexity), or the ones the output-rows input names (generation:
/// the last token of each sequence), which skips the output matmul for the others. Each token
/// takes its position and sequence from the places input. The model must have passed
/// `validate_tensors`.
pub fn build<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[Adapter<'_>],
) -> Result<Forward, ModelError> {
    g.clear();
    if adapters.len() > MAX_ADAPTERS {
        return Err(ModelError::Lora(LoraError::TooMany(adapters.len())));
    }
    let mut applied: Applied = [[0; MAX_LORA_PAIRS / 64]; MAX_ADAPTERS];
    // A weight's product, with the adapters' terms.
    macro_rules! mm {
        ($w:expr, $x:expr) => {
            lora_mul_mat(g, adapters, &mut applied, $w, $x)
        };
    }
    if n_tokens == 0 || n_tokens > kv.n_batch || n_outputs == 0 || n_outputs > n_tokens {
        return Err(ModelError::Graph(GraphError::Invalid {
            op: "forward",
            name: heapless::String::new(),
            problem: "a batch needs 1..=n_batch tokens and 1..=n_tokens outputs",
        }));
    }
    let traits = hp.arch.traits();
    let data_start = gguf.data_start();
    let weight = |g: &mut Graph<N>, name: core::fmt::Arguments<'_>| -> Result<Option<TensorId>, ModelError> {
        let mut full = crate::gguf::Name::new();
        let _ = full.write_fmt(name);
        let Some(info) = gguf.tensor(&full) else { return Ok(None) };
        let ne = info.ne.map(|n| n as usize);
        let storage = Storage::External { buffer: MODEL_BUFFER, offset: data_start + info.offset as usize };
        g.leaf(&full, info.ty, ne, storage).map(Some).map_err(ModelError::Graph)
    };
    let required =
        |w: Option<TensorId>, name: &str| w.ok_or_else(|| ModelError::MissingTensor { name: name_of(name) });
    // Rows `first..first + n` of a fused 2-D weight (Q, K, V of `attn_qkv`; gate, up of phi3's
    // `ffn_up`) as a weight of its own: the rows are contiguous in the file, and a matmul over
    // them gives the fused matmul's outputs bit for bit. `part` names it.
    let rows_of = |g: &mut Graph<N>, name: &str, part: &str, first: usize, n: usize| {
        let info = gguf.tensor(name).ok_or_else(|| ModelError::MissingTensor { name: name_of(name) })?;
        let row_bytes = info.ty.bytes_for(info.ne[0]).unwrap_or(0) as usize;
        if first + n > info.ne[1] as usize || info.ne[2] != 1 || info.ne[3] != 1 {
            let expected = [info.ne[0], (first + n) as u64, 1, 1];
            return Err(ModelError::TensorShape { name: name_of(name), expected, found: info.ne });
        }
        let offset = data_start + info.offset as usize + first * row_bytes;
        let storage = Storage::External { buffer: MODEL_BUFFER, offset };
        let mut label = crate::gguf::Name::new();
        let _ = write!(label, "{name}:{part}");
        g.leaf(&label, info.ty, [info.ne[0] as usize, n, 1, 1], storage).map_err(ModelError::Graph)
    };

    // Layer `il`'s recurrent states of one kind: F32 `[len, n_seq]` in the persistent region.
    let state_leaf = |g: &mut Graph<N>, kind: &str, il: usize, len: usize, offset: usize| {
        let mut label = crate::gguf::Name::new();
        let _ = write!(label, "{kind}.{il}");
        let storage = Storage::Persistent { offset };
        g.leaf(&label, GgmlType::F32, [len, kv.n_seq, 1, 1], storage).map_err(ModelError::Graph)
    };
    let (e, t) = (hp.n_embd as usize, n_tokens);
    let (n_head, n_head_kv) = (hp.n_head as usize, hp.n_head_kv as usize);
    // (Qwen3.5's Q projection gives a gate as wide as the queries after each head's queries.)
    let q_parts = if traits.attn_output_gate { 2 } else { 1 };
    let n_rows = kv.cache_rows();

    let tok_embd = required(weight(g, format_args!("token_embd.weight"))?, "token_embd.weight")?;
    let output_norm = required(weight(g, format_args!("{}", traits.output_norm))?, traits.output_norm)?;
    let output = weight(g, format_args!("output.weight"))?.unwrap_or(tok_embd);
    let rope_freqs = weight(g, format_args!("{}", rope_factors_name(hp, kv.n_ctx)))?;
    let ids = g
        .leaf("token_ids", GgmlType::I32, [t, 1, 1, 1], Storage::Persistent { offset: kv.ids_offset })
        .map_err(ModelError::Graph)?;
    let places = g
        .leaf("token_places", GgmlType::I32, [2, t, 1, 1], Storage::Persistent { offset: kv.places_offset })
        .map_err(ModelError::Graph)?;

    // Computed tensors are named as llama.cpp names them, with the layer after a dash
    // (`ffn_up-3`), so reports and the numerics check can say where a value came from.
    macro_rules! named {
        ($name:expr, $il:expr, $node:expr) => {{
            let id = $node.map_err(ModelError::Graph)?;
            g.set_name(id, format_args!("{}-{}", $name, $il));
            id
        }};
        ($name:expr, $node:expr) => {{
            let id = $node.map_err(ModelError::Graph)?;
            g.set_name(id, format_args!("{}", $name));
            id
        }};
    }
    let mut x = named!("inp_embd", g.get_rows(tok_embd, ids));
    if traits.embed_scale == EmbedScale::SqrtWidth {
        x = named!("inp_scaled", g.scale(x, libm::sqrtf(e as f32)));
    } else if hp.embedding_scale != 1.0 {
        x = named!("inp_scaled", g.scale(x, hp.embedding_scale));
    }
    // Gemma 4's per-layer inputs `[p, n_layer, t]`: each token's slice of every layer from
    // `per_layer_token_embd` (times sqrt(p)) plus a projection of its scaled embedding (times
    // 1/sqrt(n_embd), RMS-normed per slice), the sum times 1/sqrt(2).
    let p = hp.n_embd_per_layer as usize;
    let per_layer_inputs = if p > 0 {
        let need_global = |g: &mut Graph<N>, name: &str| required(weight(g, format_args!("{name}"))?, name);
        let table = need_global(g, "per_layer_token_embd.weight")?;
        let proj = need_global(g, "per_layer_model_proj.weight")?;
        let norm = need_global(g, "per_layer_proj_norm.weight")?;
        let n_layer = hp.n_layer as usize;
        let rows = named!("inp_per_layer_rows", g.get_rows(table, ids));
        let rows = named!("inp_per_layer_selected", g.scale(rows, libm::sqrtf(p as f32)));
        let rows = g.reshape(rows, [p, n_layer, t, 1]).map_err(ModelError::Graph)?;
        let projected = named!("per_layer_proj_raw", mm!(proj, x));
        let projected = named!("per_layer_proj_scaled", g.scale(projected, 1.0 / libm::sqrtf(e as f32)));
        let projected = g.reshape(projected, [p, n_layer, t, 1]).map_err(ModelError::Graph)?;
        let projected = named!("per_layer_proj_norm", g.rms_norm(projected, hp.rms_eps));
        let projected = named!("per_layer_proj", g.mul(projected, norm));
        let sum = named!("inp_per_layer_sum", g.add(projected, rows));
        Some(named!("inp_per_layer", g.scale(sum, 1.0 / libm::sqrtf(2.0))))
    } else {
        None
    };
    // Layers whose caches KV-sharing layers read (Gemma 4): (layer, its K and V after this
    // step's writes, so readers run after the writes).
    let mut shared_caches: heapless::Vec<(usize, TensorId, TensorId), 2> = heapless::Vec::new();
    let mut rope_tables: [Option<TensorId>; 2] = [None, None];
    for il in 0..hp.n_layer as usize {
        let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
        let kv_w = n_head_kv * hd_k.max(hd_v);
        let rows = kv.rows_of(il);
        // This layer's tensor `blk.{il}.{suffix}`: its name, and the tensor as a weight leaf.
        let layer_name = |suffix: &str| {
            let mut name = crate::gguf::Name::new();
            let _ = write!(name, "blk.{il}.{suffix}");
            name
        };
        let need = |g: &mut Graph<N>, suffix: &str| -> Result<TensorId, ModelError> {
            let name = layer_name(suffix);
            weight(g, format_args!("{name}"))?.ok_or(ModelError::MissingTensor { name })
        };
        let e_ = |r: Result<TensorId, GraphError>| r.map_err(ModelError::Graph);
        let attn_norm = need(g, "attn_norm.weight")?;
        let cur = named!("norm", il, g.rms_norm(x, hp.rms_eps));
        let cur = named!("attn_norm", il, g.mul(cur, attn_norm));
        let mut o = if let (true, Some(d)) = (hp.recurrent.contains(il), hp.delta) {
            // Qwen3.5's gated delta rule: Q, K, V through a causal convolution (its state per
            // sequence) and SiLU, L2-normalised Q and K, the delta rule (a state per value head
            // and sequence), an RMS norm gated by SiLU(attn_gate), the output projection.
            let (hd, nk, nv) = (d.head_dim as usize, d.n_k_heads as usize, d.n_v_heads as usize);
            let ch = d.conv_channels();
            let eps = hp.rms_eps;
            let (w_qkv, w_gate) = (need(g, "attn_qkv.weight")?, need(g, "attn_gate.weight")?);
            let (w_beta, w_alpha) = (need(g, "ssm_beta.weight")?, need(g, "ssm_alpha.weight")?);
            let (dt_bias, a) = (need(g, "ssm_dt.bias")?, need(g, "ssm_a")?);
            let (taps, norm, w_out) =
                (need(g, "ssm_conv1d.weight")?, need(g, "ssm_norm.weight")?, need(g, "ssm_out.weight")?);
            let qkv = named!("linear_attn_qkv_mixed", il, mm!(w_qkv, cur));
            let z = named!("z", il, mm!(w_gate, cur));
            let beta = named!("beta", il, mm!(w_beta, cur));
            let beta = named!("beta_sigmoid", il, g.sigmoid(beta));
            let alpha = named!("alpha", il, mm!(w_alpha, cur));
            let alpha = named!("alpha_biased", il, g.add(alpha, dt_bias));
            let alpha = named!("a_softplus", il, g.softplus(alpha));
            let decay = named!("gate", il, g.mul(alpha, a));
            let conv_states = state_leaf(g, "conv_state", il, hp.conv_state_len(), kv.conv_states_of(il))?;
            let delta_states =
                state_leaf(g, "delta_state", il, hp.delta_state_len(), kv.delta_states_of(il))?;
            let conv = named!("conv_output_raw", il, g.short_conv(qkv, taps, conv_states, places, kv.n_ctx));
            let conv = named!("conv_output_silu", il, g.silu(conv));
            // Q, K and V heads of each token's convolved row; Q and K L2-normalised as llama.cpp
            // does (an RMS norm with eps / d, times 1 / sqrt(d)).
            let nb = [4, hd * 4, ch * 4, ch * t * 4];
            let q = e_(g.view(conv, [hd, nk, t, 1], nb, 0, 0))?;
            let k = e_(g.view(conv, [hd, nk, t, 1], nb, nk * hd * 4, 0))?;
            let v = e_(g.view(conv, [hd, nv, t, 1], nb, 2 * nk * hd * 4, 0))?;
            let l2 = 1.0 / libm::sqrtf(hd as f32);
            let q = named!("q_conv_norm", il, g.rms_norm(q, eps / hd as f32));
            let q = named!("q_conv_predelta", il, g.scale(q, l2));
            let k = named!("k_conv_norm", il, g.rms_norm(k, eps / hd as f32));
            let k = named!("k_conv_predelta", il, g.scale(k, l2));
            let out = named!(
                "attn_output",
                il,
                g.gated_delta_net(q, k, v, decay, beta, delta_states, places, kv.n_ctx)
            );
            let out = named!("attn_output_norm", il, g.rms_norm(out, eps));
            let out = named!("attn_output_normed", il, g.mul(out, norm));
            let z = e_(g.reshape(z, [hd, nv, t, 1]))?;
            let z = named!("z_silu", il, g.silu(z));
            let out = named!("attn_out_gated", il, g.mul(out, z));
            let out = e_(g.reshape(out, [hd * nv, t, 1, 1]))?;
            named!("linear_attn_out", il, mm!(w_out, out))
        } else if hp.recurrent.contains(il) {
            // LFM2's short-convolution block: B, C and X projections (rows of one matrix), the
            // convolution of B * X over the sequence's last inputs, gated by C.
            let in_proj = layer_name("shortconv.in_proj.weight");
            let wb = rows_of(g, &in_proj, "b", 0, e)?;
            let wc = rows_of(g, &in_proj, "c", e, e)?;
            let wx = rows_of(g, &in_proj, "x", 2 * e, e)?;
            let (taps, out_proj) = (need(g, "shortconv.conv.weight")?, need(g, "shortconv.out_proj.weight")?);
            let states = state_leaf(g, "conv_state", il, hp.conv_state_len(), kv.conv_states_of(il))?;
            let b = named!("conv_b", il, mm!(wb, cur));
            let c = named!("conv_c", il, mm!(wc, cur));
            let xs = named!("conv_x", il, mm!(wx, cur));
            let bx = named!("conv_bx", il, g.mul(b, xs));
            let conv = named!("conv_conv", il, g.short_conv(bx, taps, states, places, kv.n_ctx));
            let y = named!("conv_y", il, g.mul(c, conv));
            named!("conv_out", il, mm!(out_proj, y))
        } else {
            // A KV-sharing layer (Gemma 4) computes queries only and reads its source's cache.
            let own_kv = hp.has_own_kv(il);
            let fused = layer_name("attn_qkv.weight");
            let (wq, wk, wv) = if gguf.tensor(&fused).is_some() {
                // Q, K and V in one matrix, their rows in that order (llama.cpp's build_qkv).
                let (qw, kw) = (n_head * hd_k * q_parts, n_head_kv * hd_k);
                let q = rows_of(g, &fused, "q", 0, qw)?;
                if own_kv {
                    (
                        q,
                        Some(rows_of(g, &fused, "k", qw, kw)?),
                        Some(rows_of(g, &fused, "v", qw + kw, n_head_kv * hd_v)?),
                    )
                } else {
                    (q, None, None)
                }
            } else if own_kv {
                // (Gemma 4 layers without `attn_v` take the keys' projection as values.)
                let wk = need(g, "attn_k.weight")?;
                let wv = match weight(g, format_args!("{}", layer_name("attn_v.weight")))? {
                    None if traits.values_from_keys => wk,
                    other => required(other, &layer_name("attn_v.weight"))?,
                };
                (need(g, "attn_q.weight")?, Some(wk), Some(wv))
            } else {
                (need(g, "attn_q.weight")?, None, None)
            };
            let wo = need(g, "attn_output.weight")?;
            let mut q = named!("Qcur", il, mm!(wq, cur));
            // (A KV-sharing layer's K and V stand for nothing: the cache views below replace them.)
            let mut k = match wk {
                Some(wk) => named!("Kcur", il, mm!(wk, cur)),
                None => q,
            };
            let mut v = match wv {
                Some(wv) if Some(wv) == wk => k,
                Some(wv) => named!("Vcur", il, mm!(wv, cur)),
                None => q,
            };
            if traits.qkv_bias {
                let (bq, bk, bv) =
                    (need(g, "attn_q.bias")?, need(g, "attn_k.bias")?, need(g, "attn_v.bias")?);
                q = named!("Qcur_bias", il, g.add(q, bq));
                k = named!("Kcur_bias", il, g.add(k, bk));
                v = named!("Vcur_bias", il, g.add(v, bv));
            }
            let mut output_gate = None;
            if traits.attn_output_gate {
                // Each head's queries, then its gate (Qwen3.5): two strided views of one output.
                let nb = [4, 2 * hd_k * 4, 2 * hd_k * n_head * 4, 2 * hd_k * n_head * t * 4];
                output_gate = Some(e_(g.view(q, [hd_k, n_head, t, 1], nb, hd_k * 4, 0))?);
                q = e_(g.view(q, [hd_k, n_head, t, 1], nb, 0, 0))?;
            } else {
                q = e_(g.reshape(q, [hd_k, n_head, t, 1]))?;
            }
            if own_kv {
                k = e_(g.reshape(k, [hd_k, n_head_kv, t, 1]))?;
            }
            if traits.qk_norm {
                let qn = need(g, "attn_q_norm.weight")?;
                q = named!("Qcur_norm", il, g.rms_norm(q, hp.rms_eps));
                q = named!("Qcur_normed", il, g.mul(q, qn));
                if own_kv {
                    let kn = need(g, "attn_k_norm.weight")?;
                    k = named!("Kcur_norm", il, g.rms_norm(k, hp.rms_eps));
                    k = named!("Kcur_normed", il, g.mul(k, kn));
                }
            }
            if traits.value_norm && own_kv {
                // Each value head RMS-normalised, without a weight.
                v = e_(g.reshape(v, [hd_v, n_head_kv, t, 1]))?;
                v = named!("Vcur_normed", il, g.rms_norm(v, hp.rms_eps));
            }
            let rope = layer_rope(hp, il);
            let sliding = rope.sliding;
            if rope.rotates {
                // One table of angles per parameter set (Gemma 3 and 4 have two), shared by every
                // layer; the file's frequency factors belong to full-attention layers.
                let table = match rope_tables[sliding as usize] {
                    Some(table) => table,
                    None => {
                        let name = if sliding { "rope_table_swa" } else { "rope_table" };
                        let factors = if sliding { None } else { rope_freqs };
                        let table = g.rope_table(
                            q,
                            rope.n_rot,
                            rope.base,
                            rope.scale,
                            factors,
                            rope.mscale,
                            rope.yarn,
                        );
                        let table = named!(name, table);
                        g.at_positions(table, places).map_err(ModelError::Graph)?;
                        rope_tables[sliding as usize] = Some(table);
                        table
                    }
                };
                q = named!("Qcur_rope", il, g.rope_with(q, table, traits.rope));
                if own_kv {
                    k = named!("Kcur_rope", il, g.rope_with(k, table, traits.rope));
                }
            }
            // Attention as llama.cpp's CPU flash attention computes it, so results match it closely:
            // phi3 scales the queries first and the scores by 1.
            let mut kq_scale = hp.attention_scale.unwrap_or(1.0 / libm::sqrtf(hd_k as f32));
            if traits.prescaled_queries {
                q = named!("Qcur_scaled", il, g.scale(q, kq_scale));
                kq_scale = 1.0;
            }
            if let Some(n) = kv.types.k_rotation(hd_k as u32) {
                q = named!("Qcur_rot", il, g.hadamard(q, n));
                if own_kv {
                    k = named!("Kcur_rot", il, g.hadamard(k, n));
                }
            }
            let v_rotation = kv.types.v_rotation(hd_v as u32);
            if let (Some(n), true) = (v_rotation, own_kv) {
                v = named!("Vcur_rot", il, g.hadamard(v, n));
            }

            let (k_all, v_all) = if own_kv {
                // Cache: K and V as [kv_w, n_ctx * n_seq] of the cache types, one row per
                // position of each sequence.
                let cache = |g: &mut Graph<N>, kind: &str, ty: GgmlType, offset: usize| {
                    let mut label = crate::gguf::Name::new();
                    let _ = write!(label, "cache_{kind}.{il}");
                    e_(g.leaf(&label, ty, [kv_w, n_rows, 1, 1], Storage::Persistent { offset }))
                };
                let k_cache = cache(g, "k", kv.types.k, kv.k_offset(il))?;
                let v_cache = cache(g, "v", kv.types.v, kv.v_offset(il))?;
                let k_flat = e_(g.reshape(k, [hd_k * n_head_kv, t, 1, 1]))?;
                let v_flat = e_(g.reshape(v, [hd_v * n_head_kv, t, 1, 1]))?;
                let k_all = named!("k_cache_write", il, g.kv_write(k_cache, k_flat, false));
                let v_all = named!("v_cache_write", il, g.kv_write(v_cache, v_flat, false));
                g.at_positions(k_all, places).map_err(ModelError::Graph)?;
                g.at_positions(v_all, places).map_err(ModelError::Graph)?;
                if (il + 1..hp.n_layer as usize).any(|r| !hp.has_own_kv(r) && hp.kv_source(r) == il) {
                    let _ = shared_caches.push((il, k_all, v_all));
                }
                (k_all, v_all)
            } else {
                let source = hp.kv_source(il);
                let Some(&(_, k_all, v_all)) = shared_caches.iter().find(|c| c.0 == source) else {
                    return Err(ModelError::Graph(GraphError::Invalid {
                        op: "forward",
                        name: heapless::String::new(),
                        problem: "a KV-sharing layer's source layer has no cache",
                    }));
                };
                (k_all, v_all)
            };
            // Per head: [head_dim, rows, n_kv_head]; each token reads its sequence's rows.
            let head_view = |g: &mut Graph<N>, all: TensorId, ty: GgmlType, hd: usize, row: usize| {
                let (block, head) = (ty.block_bytes(), hd / ty.block_len() * ty.block_bytes());
                e_(g.view(all, [hd, n_rows, n_head_kv, 1], [block, row, head, row * n_rows], 0, 0))
            };
            let k_view = head_view(g, k_all, kv.types.k, hd_k, rows.k_row_bytes)?;
            let v_view = head_view(g, v_all, kv.types.v, hd_v, rows.v_row_bytes)?;
            let q = e_(g.permute(q, [0, 2, 1, 3]))?;
            let mask = if sliding { Mask::SlidingWindow(hp.sliding_window) } else { Mask::Causal };
            let attn = named!("kqv_out", il, g.flash_attn(q, k_view, v_view, kq_scale, mask));
            g.at_positions(attn, places).map_err(ModelError::Graph)?;
            let mut attn = e_(g.reshape(attn, [hd_v * n_head, t, 1, 1]))?;
            if let Some(n) = v_rotation {
                // The rotation is its own inverse: the values' weighted sum rotated back.
                attn = named!("kqv_out_unrot", il, g.hadamard(attn, n));
            }
            if let Some(gate) = output_gate {
                let gate = named!("gate_sigmoid", il, g.sigmoid(gate));
                let gate = e_(g.reshape(gate, [hd_v * n_head, t, 1, 1]))?;
                attn = named!("attn_gated", il, g.mul(attn, gate));
            }
            named!("attn_out", il, mm!(wo, attn))
        };
        if traits.post_norms {
            o = named!("attn_post_norm_raw", il, g.rms_norm(o, hp.rms_eps));
            let norm = need(g, "post_attention_norm.weight")?;
            o = named!("attn_post_norm", il, g.mul(o, norm));
        }
        if hp.residual_scale != 1.0 {
            o = named!("attn_out_scaled", il, g.scale(o, hp.residual_scale));
        }
        x = named!("ffn_inp", il, g.add(x, o));

        let ffn_norm = need(g, traits.ffn_norm)?;
        let cur = named!("norm", il, g.rms_norm(x, hp.rms_eps));
        let cur = named!("ffn_norm", il, g.mul(cur, ffn_norm));
        let mut down = if let Some(route) = hp.experts_at(il) {
            // Mixture of experts, as llama.cpp's build_moe_ffn: softmax or sigmoid router (kept
            // in float on the CPU), top-k experts (chosen with lfm2moe's bias), their weights
            // (renormalised for qwen3moe and lfm2moe), SwiGLU experts through mul_mat_id,
            // weighted sum.
            let router = need(g, "ffn_gate_inp.weight")?;
            let k_used = hp.n_expert_used as usize;
            let logits = named!("ffn_moe_logits", il, mm!(router, cur));
            let probs = match route.gating {
                Gating::Softmax => named!("ffn_moe_probs", il, g.soft_max(logits, 1.0, false, 0)),
                Gating::Sigmoid => named!("ffn_moe_probs", il, g.sigmoid(logits)),
            };
            let chosen_by = if route.selection_bias {
                let bias = need(g, "exp_probs_b.bias")?;
                named!("ffn_moe_probs_biased", il, g.add(probs, bias))
            } else {
                probs
            };
            let picked = named!("ffn_moe_topk", il, g.top_k(chosen_by, k_used));
            let normalize = route.normalize_weights;
            let weights = named!("ffn_moe_weights", il, g.moe_weights(probs, picked, normalize));
            let (wg, wu, wd) = (
                need(g, "ffn_gate_exps.weight")?,
                need(g, "ffn_up_exps.weight")?,
                need(g, "ffn_down_exps.weight")?,
            );
            let x3 = e_(g.reshape(cur, [e, 1, t, 1]))?;
            let up = named!("ffn_moe_up", il, g.mul_mat_id(wu, x3, picked));
            let gate = named!("ffn_moe_gate", il, g.mul_mat_id(wg, x3, picked));
            let act = named!("ffn_moe_swiglu", il, g.swiglu(gate, up));
            let experts = named!("ffn_moe_down", il, g.mul_mat_id(wd, act, picked));
            let mut moe = named!("ffn_moe_out", il, g.moe_sum(experts, weights));
            if route.shared_expert {
                // The shared expert, scaled by its own sigmoid gate.
                let gate_inp = need(g, "ffn_gate_inp_shexp.weight")?;
                let (sg, su, sd) = (
                    need(g, "ffn_gate_shexp.weight")?,
                    need(g, "ffn_up_shexp.weight")?,
                    need(g, "ffn_down_shexp.weight")?,
                );
                let shared_gate = named!("ffn_shexp_gate_inp", il, mm!(gate_inp, cur));
                let shared_gate = named!("ffn_shexp_gate", il, g.sigmoid(shared_gate));
                let gate = named!("ffn_shexp_g", il, mm!(sg, cur));
                let up = named!("ffn_shexp_up", il, mm!(su, cur));
                let act = named!("ffn_shexp_swiglu", il, g.swiglu(gate, up));
                let shared = named!("ffn_shexp_down", il, mm!(sd, act));
                let shared = named!("ffn_shexp_out", il, g.mul(shared, shared_gate));
                moe = named!("ffn_moe_shexp", il, g.add(moe, shared));
            }
            moe
        } else {
            let (wg, wu) = if traits.fused_gate_up {
                // One `ffn_up` of 2 * n_ff rows: the gate's, then the up projection's.
                let fused = layer_name("ffn_up.weight");
                let f = hp.n_ff_at(il) as usize;
                (rows_of(g, &fused, "gate", 0, f)?, rows_of(g, &fused, "up", f, f)?)
            } else {
                (need(g, "ffn_gate.weight")?, need(g, "ffn_up.weight")?)
            };
            let wd = need(g, "ffn_down.weight")?;
            let gate = named!("ffn_gate", il, mm!(wg, cur));
            let up = named!("ffn_up", il, mm!(wu, cur));
            let act = match traits.act {
                Activation::GeGlu => named!("ffn_geglu", il, g.geglu(gate, up)),
                Activation::SwiGlu => named!("ffn_swiglu", il, g.swiglu(gate, up)),
            };
            named!("ffn_out", il, mm!(wd, act))
        };
        if traits.post_norms {
            down = named!("ffn_post_norm_raw", il, g.rms_norm(down, hp.rms_eps));
            let norm = need(g, "post_ffw_norm.weight")?;
            down = named!("ffn_post_norm", il, g.mul(down, norm));
        }
        if hp.residual_scale != 1.0 {
            down = named!("ffn_out_scaled", il, g.scale(down, hp.residual_scale));
        }
        x = named!("ffn_residual", il, g.add(x, down));
        if let Some(inputs) = per_layer_inputs {
            // Gemma 4's per-layer input: GELU of a projection to its width, times this layer's
            // slice of the inputs, projected back, RMS-normed, added.
            let (w_gate, w_proj, norm) =
                (need(g, "inp_gate.weight")?, need(g, "proj.weight")?, need(g, "post_norm.weight")?);
            // (This layer's slice of each token's inputs: rows `p * n_layer` floats apart.)
            let token = p * hp.n_layer as usize * 4;
            let slice = e_(g.view(inputs, [p, t, 1, 1], [4, token, token * t, token * t], il * p * 4, 0))?;
            let gate = named!("per_layer_gate", il, mm!(w_gate, x));
            let gate = named!("per_layer_gelu", il, g.gelu(gate));
            let gated = named!("per_layer_gated", il, g.mul(gate, slice));
            let out = named!("per_layer_out", il, mm!(w_proj, gated));
            let out = named!("per_layer_norm", il, g.rms_norm(out, hp.rms_eps));
            let out = named!("per_layer_embd_out", il, g.mul(out, norm));
            x = named!("per_layer_residual", il, g.add(x, out));
        }
        let scale = traits
            .layer_output_scale
            .then(|| layer_output_scale(gguf, &layer_name("layer_output_scale.weight")));
        if let Some(scale) = scale.flatten() {
            // (llama.cpp multiplies by the one-element tensor: the same products.)
            x = named!("out_scaled", il, g.scale(x, scale));
        }
        g.set_name(x, format_args!("l_out-{il}"));
    }
    if n_outputs < t {
        // Generation needs the logits of a few tokens only (the last of each sequence): gather
        // their rows and skip the output matmul for the others.
        let rows = g
            .leaf(
                "output_rows",
                GgmlType::I32,
                [n_outputs, 1, 1, 1],
                Storage::Persistent { offset: kv.outputs_offset },
            )
            .map_err(ModelError::Graph)?;
        x = named!("inp_out_ids", g.get_rows(x, rows));
    }
    let x = named!("result_norm_raw", g.rms_norm(x, hp.rms_eps));
    let x = named!("result_norm", g.mul(x, output_norm));
    let mut logits = mm!(output, x).map_err(ModelError::Graph)?;
    if hp.logit_scale != 1.0 {
        g.set_name(logits, format_args!("result_output_raw"));
        logits = g.scale(logits, 1.0 / hp.logit_scale).map_err(ModelError::Graph)?;
    }
    if hp.final_logit_softcap > 0.0 {
        // c * tanh(logits / c), in llama.cpp's three steps.
        let c = hp.final_logit_softcap;
        g.set_name(logits, format_args!("result_output_raw"));
        let scaled = named!("result_output_capped_in", g.scale(logits, 1.0 / c));
        let capped = named!("result_output_tanh", g.tanh(scaled));
        logits = g.scale(capped, c).map_err(ModelError::Graph)?;
    }
    g.set_name(logits, format_args!("logits"));
    // Every pair of every adapter must have found its weight.
    for (adapter, bits) in adapters.iter().zip(&applied) {
        for (k, pair) in adapter.lora.pairs.iter().enumerate() {
            if bits[k / 64] >> (k % 64) & 1 == 0 {
                return Err(ModelError::Lora(LoraError::Unapplied { name: name_of(pair.target) }));
            }
        }
    }
    g.build(&[logits]).map_err(ModelError::Graph)?;
    Ok(Forward { ids, logits, n_tokens, n_outputs })
}
