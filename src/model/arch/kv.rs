//! The KV cache: its types (`-ctk/-ctv`) and where each layer's caches, the recurrent states and
//! the step's inputs sit in the arena's persistent region.

use crate::model::{HParams, LayerMask};
use crate::quant::{GgmlType, Lowercase};

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
    /// An encoder's inputs (none for a decoder): offset of the positions (I32 `[n_batch]`, the
    /// rows of the position embeddings), the token types (I32 `[n_batch]`) and the spans (I32
    /// `[2, n_batch]`: each token's first batch row of its sequence and the sequence's tokens,
    /// the keys its attention sees and the rows its mean pools).
    pub encoder_inputs: Option<EncoderInputs>,
    /// A decoder's embeddings input (none unless asked for, see
    /// [`KvLayout::with_embeddings_input`]): rows fed instead of token ids (an image's).
    pub embeddings_input: Option<EmbeddingsInput>,
    /// An M-RoPE model's rotary places (none for others): three tables of I32 `[2, n_batch]`,
    /// each token's (first cache row, position) by time, row and column, one after the other.
    pub mrope_places_offset: Option<usize>,
    /// Bytes of the persistent region.
    pub total_bytes: usize,
}

/// Where an encoder's own inputs sit in the persistent region (see
/// [`KvLayout::encoder_inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderInputs {
    /// I32 `[n_batch]`: each token's position in its sequence.
    pub positions_offset: usize,
    /// I32 `[n_batch]`: each token's type (its row of `token_types`).
    pub types_offset: usize,
    /// I32 `[2, n_batch]`: each token's (first batch row of its sequence, tokens of the sequence).
    pub spans_offset: usize,
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

/// Where a decoder's embeddings input sits in the persistent region (see
/// [`KvLayout::embeddings_input`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingsInput {
    /// F32 `[n_embd, n_batch]`: each token's input vector.
    pub rows_offset: usize,
    /// I32 `[2, n_batch]`: the places attention reads in a step of embeddings (a bidirectional
    /// one gives every token the batch's last position: it sees the whole batch).
    pub attn_places_offset: usize,
}

impl KvLayout {
    /// The layout with room for a step's input embeddings of `n_embd` values per token after
    /// the other inputs; `None` if the sizes overflow.
    pub fn with_embeddings_input(mut self, n_embd: usize) -> Option<Self> {
        let rows_offset = self.total_bytes;
        let attn_places_offset =
            rows_offset.checked_add(aligned(n_embd.checked_mul(self.n_batch)?.checked_mul(4)?))?;
        self.total_bytes = attn_places_offset.checked_add(aligned(self.n_batch.checked_mul(8)?))?;
        self.embeddings_input = Some(EmbeddingsInput { rows_offset, attn_places_offset });
        Some(self)
    }

    /// The layout for `hp` with `n_seq` sequences of `n_ctx` positions in a cache of `types`
    /// and batches of up to `n_batch` tokens; `None` if the sizes overflow or a type cannot
    /// hold rows of the model's width (see [`KvTypes::check`] for the reason). An encoder keeps
    /// no cache (each step attends over its own batch's keys): only the step's inputs.
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
        let encoder = hp.embeds();
        for il in (0..n_layer).filter(|&il| hp.has_own_kv(il) && !encoder) {
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
        let inputs_end = outputs_offset.checked_add(input)?;
        let (encoder_inputs, inputs_end) = if encoder {
            let types_offset = inputs_end.checked_add(input)?;
            let spans_offset = types_offset.checked_add(input)?;
            let end = spans_offset.checked_add(input.checked_mul(2)?)?;
            (Some(EncoderInputs { positions_offset: inputs_end, types_offset, spans_offset }), end)
        } else {
            (None, inputs_end)
        };
        let (mrope_places_offset, total_bytes) = if hp.arch.traits().mrope && !encoder {
            (Some(inputs_end), inputs_end.checked_add(input.checked_mul(6)?)?)
        } else {
            (None, inputs_end)
        };
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
            encoder_inputs,
            embeddings_input: None,
            mrope_places_offset,
            total_bytes,
        })
    }

    /// Offset of an M-RoPE model's rotary places of axis `axis` (0 time, 1 row, 2 column; see
    /// [`KvLayout::mrope_places_offset`]).
    pub fn mrope_places(&self, axis: usize) -> Option<usize> {
        let table = aligned(self.n_batch * 4) * 2;
        self.mrope_places_offset.filter(|_| axis < 3).map(|at| at + axis * table)
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
