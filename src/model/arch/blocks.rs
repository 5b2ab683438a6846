//! The named blocks of the forward pass: `embed`, `attention` (with its KV cache or a shared
//! one), `short_conv`, `delta_net`, `ffn` / `moe_ffn`, the per-layer inputs and `output_head`,
//! each a short function over a [`Builder`]. `transformer::build` composes them per layer from
//! the architecture's facts ([`ArchTraits`]). Shapes are written as ggml's, innermost first, `t`
//! the batch's tokens: `// x: [n_embd, t]`.

use core::fmt::Write;

use super::kv::KvLayout;
use super::rope::{layer_rope, rope_factors_name, LayerRope};
use super::{Activation, ArchTraits, EmbedScale, Experts, Gating, StepInput};
use crate::gguf::{name_of, Gguf, Name};
use crate::graph::{Graph, GraphError, Mask};
use crate::model::hparams::DeltaNet;
use crate::model::lora::{Adapter, LoraError, MAX_ADAPTERS, MAX_LORA_PAIRS};
use crate::model::{HParams, ModelError};
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};

/// Index of the model file in the executor's buffer table.
pub const MODEL_BUFFER: u8 = 0;

/// Index of adapter `i`'s file in the executor's buffer table.
const fn adapter_buffer(i: usize) -> u8 {
    MODEL_BUFFER + 1 + i as u8
}

/// Which pairs of each adapter a graph applied, one bit per pair.
type Applied = [[u64; MAX_LORA_PAIRS / 64]; MAX_ADAPTERS];

/// Names a computed tensor as llama.cpp names it, with the layer after a dash (`ffn_up-3`), so
/// reports and the numerics check can say where a value came from.
macro_rules! named {
    ($b:ident, $name:expr, $il:expr, $node:expr) => {{
        let id = $node?;
        $b.g.set_name(id, format_args!("{}-{}", $name, $il));
        id
    }};
    ($b:ident, $name:expr, $node:expr) => {{
        let id = $node?;
        $b.g.set_name(id, format_args!("{}", $name));
        id
    }};
}

/// What a graph computes over: generation's KV cache, or training's window.
#[derive(Clone, Copy)]
pub(super) enum Mode<'b> {
    /// Each token at its place (sequence, position) in the KV cache and recurrent states.
    Cached(&'b KvLayout),
    /// One sequence at positions 0..t and no cache (a training graph): attention is the
    /// engine's over the window's own F32 keys and values (its gradient rule is `train`'s). The
    /// token ids are at `ids_offset` of the persistent region.
    Window {
        /// Where the token ids are.
        ids_offset: usize,
    },
}

/// The F32 pair `(A, B)` and scale a trainer adapts a weight with, made as the graph is built:
/// called with each weight a matmul reads, before its adapter's term.
pub type TrainedPair<'a, const N: usize> =
    dyn FnMut(&mut Graph<N>, TensorId) -> Result<Option<(TensorId, TensorId, f32)>, ModelError> + 'a;

/// Where the adapters' pairs come from.
pub(super) enum Adapters<'b, 'm, const N: usize> {
    /// Adapter files (buffers 1 and up), their pairs matched by target name.
    Files(&'b [Adapter<'m>]),
    /// Trainable parameters, made per weight by the trainer.
    Trained(&'b mut TrainedPair<'b, N>),
}

/// The graph being built with what every block reads: the model file, its hyper-parameters and
/// facts, the cache layout (none in a window graph), the adapters, the step's inputs and the
/// weights shared by layers.
pub(super) struct Builder<'b, 'm, const N: usize> {
    pub g: &'b mut Graph<N>,
    gguf: &'b Gguf<'m>,
    pub hp: &'b HParams,
    pub traits: ArchTraits,
    kv: Option<&'b KvLayout>,
    adapters: Adapters<'b, 'm, N>,
    applied: Applied,
    /// Tokens of the batch.
    pub t: usize,
    tok_embd: TensorId,
    output_norm: TensorId,
    output: TensorId,
    rope_freqs: Option<TensorId>,
    /// I32 token ids `[t]`.
    pub ids: TensorId,
    /// I32 token places `[2, t]` (first cache row of the sequence, position); none in a window.
    /// An embedding model's places name the batch: (first batch row of the sequence, position).
    places: Option<TensorId>,
    /// An M-RoPE model's rotary places by time, row and column (see
    /// [`KvLayout::mrope_places_offset`]); none in a window, whose tokens are text.
    mrope_places: Option<[TensorId; 3]>,
    /// An embedding model's I32 spans `[2, t]` (first batch row of the token's sequence, its
    /// tokens): the keys a bidirectional query sees, the rows mean pooling averages.
    pub spans: Option<TensorId>,
    /// F32 `[n_embd, t]` input embeddings of a step of embeddings (an image's) instead of token
    /// ids; and the places its attention reads, when it attends both ways within the batch.
    embeddings: Option<(TensorId, Option<TensorId>)>,
    /// One table of angles per RoPE parameter set (full-attention, sliding-window), made by the
    /// first layer that rotates with it.
    rope_tables: [Option<TensorId>; 2],
    /// Layers whose caches KV-sharing layers read: (layer, its K and V after this step's writes,
    /// so readers run after the writes).
    shared_caches: heapless::Vec<(usize, TensorId, TensorId), 2>,
}

/// The leaf of model tensor `name` (at its offset in buffer 0), if the file has it.
pub(super) fn weight_leaf<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    name: &str,
) -> Result<Option<TensorId>, ModelError> {
    let Some(info) = gguf.tensor(name) else { return Ok(None) };
    let ne = info.ne.map(|n| n as usize);
    let offset = gguf.data_start() + info.offset as usize;
    Ok(Some(g.leaf(name, info.ty, ne, Storage::External { buffer: MODEL_BUFFER, offset })?))
}

/// The leaf of model tensor `name`, which the file must have.
pub(super) fn required<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    name: &str,
) -> Result<TensorId, ModelError> {
    weight_leaf(g, gguf, name)?.ok_or_else(|| ModelError::MissingTensor { name: name_of(name) })
}

impl<'b, 'm, const N: usize> Builder<'b, 'm, N> {
    /// Clears `g` and makes the leaves every layer may read: the embeddings, the output head's
    /// weights, the RoPE factors and the step's inputs.
    pub fn new(
        g: &'b mut Graph<N>,
        gguf: &'b Gguf<'m>,
        hp: &'b HParams,
        mode: Mode<'b>,
        n_tokens: usize,
        adapters: Adapters<'b, 'm, N>,
    ) -> Result<Self, ModelError> {
        g.clear();
        if let Adapters::Files(files) = &adapters {
            if files.len() > MAX_ADAPTERS {
                return Err(ModelError::Lora(LoraError::TooMany(files.len())));
            }
        }
        let traits = hp.arch.traits();
        let tok_embd = required(g, gguf, "token_embd.weight")?;
        // (An encoder has no output head: its output is pooled embeddings.)
        let output_norm = if traits.encoder { tok_embd } else { required(g, gguf, traits.output_norm)? };
        let output = weight_leaf(g, gguf, "output.weight")?.unwrap_or(tok_embd);
        let (kv, n_ctx, ids_offset) = match mode {
            Mode::Cached(kv) => (Some(kv), kv.n_ctx, kv.ids_offset),
            Mode::Window { ids_offset } => (None, n_tokens, ids_offset),
        };
        let rope_freqs = weight_leaf(g, gguf, rope_factors_name(hp, n_ctx))?;
        let input = |g: &mut Graph<N>, name: &str, ne: [usize; 4], offset: usize| {
            g.leaf(name, GgmlType::I32, ne, Storage::Persistent { offset })
        };
        let ids = input(g, "token_ids", [n_tokens, 1, 1, 1], ids_offset)?;
        let places = match kv {
            Some(kv) => Some(input(g, "token_places", [2, n_tokens, 1, 1], kv.places_offset)?),
            None => None,
        };
        let spans = match kv.and_then(|kv| kv.encoder_inputs) {
            Some(at) => Some(input(g, "token_spans", [2, n_tokens, 1, 1], at.spans_offset)?),
            None => None,
        };
        let mrope_places = match kv.filter(|kv| kv.mrope_places_offset.is_some()) {
            Some(kv) => {
                let mut tables = [ids; 3];
                for (axis, (table, name)) in
                    tables.iter_mut().zip(["mrope_places_t", "mrope_places_h", "mrope_places_w"]).enumerate()
                {
                    let at = kv.mrope_places(axis).unwrap_or(0);
                    *table = input(g, name, [2, n_tokens, 1, 1], at)?;
                }
                Some(tables)
            }
            None => None,
        };
        Ok(Self {
            g,
            gguf,
            hp,
            traits,
            kv,
            adapters,
            applied: [[0; MAX_LORA_PAIRS / 64]; MAX_ADAPTERS],
            t: n_tokens,
            tok_embd,
            output_norm,
            output,
            rope_freqs,
            ids,
            places,
            mrope_places,
            spans,
            embeddings: None,
            rope_tables: [None, None],
            shared_caches: heapless::Vec::new(),
        })
    }

    /// Makes the step read input embeddings (`StepInput::Embeddings`) instead of token ids: the
    /// rows and, for a step attending both ways, the attention's own places.
    pub fn take_embeddings(&mut self, input: StepInput) -> Result<(), ModelError> {
        let StepInput::Embeddings { causal } = input else { return Ok(()) };
        let at = self.kv.and_then(|kv| kv.embeddings_input).ok_or_else(|| {
            invalid("a step of embeddings needs the engine planned with an embeddings input")
        })?;
        if self.traits.encoder || self.hp.embeds() || self.hp.n_embd_per_layer > 0 {
            return Err(invalid("this model takes token ids only (no image embeddings)"));
        }
        let (e, t) = (self.hp.n_embd as usize, self.t);
        let rows = self.g.leaf(
            "inp_embd_rows",
            GgmlType::F32,
            [e, t, 1, 1],
            Storage::Persistent { offset: at.rows_offset },
        )?;
        let places = match causal {
            true => None,
            false => Some(self.g.leaf(
                "attn_places",
                GgmlType::I32,
                [2, t, 1, 1],
                Storage::Persistent { offset: at.attn_places_offset },
            )?),
        };
        self.embeddings = Some((rows, places));
        Ok(())
    }

    /// The KV layout of a graph with a KV cache (none in a window graph, nor for an embedding
    /// model, whose batch attends over its own keys and values).
    fn kv_cache(&self) -> Option<&'b KvLayout> {
        self.kv.filter(|kv| kv.encoder_inputs.is_none())
    }

    /// The KV layout, which a block with a cache or a recurrent state needs.
    pub fn cache(&self) -> Result<&'b KvLayout, ModelError> {
        self.kv.ok_or_else(|| invalid("a block with a cache or a recurrent state in a window graph"))
    }

    /// The token places input (cached graphs only).
    fn places(&self) -> Result<TensorId, ModelError> {
        self.places.ok_or_else(|| invalid("token places in a window graph"))
    }

    /// Whether the file has model tensor `name` (no leaf made).
    pub fn has(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }

    /// Model tensor `name`, if the file has it.
    pub fn optional(&mut self, name: &str) -> Result<Option<TensorId>, ModelError> {
        weight_leaf(self.g, self.gguf, name)
    }

    /// Layer `il`'s tensor `blk.{il}.{suffix}`, if the file has it.
    pub fn optional_layer(&mut self, il: usize, suffix: &str) -> Result<Option<TensorId>, ModelError> {
        self.optional(&layer_name(il, suffix))
    }

    /// Model tensor `name`, required.
    pub fn need(&mut self, name: &str) -> Result<TensorId, ModelError> {
        required(self.g, self.gguf, name)
    }

    /// Layer `il`'s tensor `blk.{il}.{suffix}`, required.
    pub fn layer(&mut self, il: usize, suffix: &str) -> Result<TensorId, ModelError> {
        self.need(&layer_name(il, suffix))
    }

    /// Rows `first..first + n` of a fused 2-D weight (Q, K, V of `attn_qkv`; gate, up of phi3's
    /// `ffn_up`) as a weight of its own: the rows are contiguous in the file, and a matmul over
    /// them gives the fused matmul's outputs bit for bit. `part` names it.
    pub(super) fn rows_of(
        &mut self,
        name: &str,
        part: &str,
        first: usize,
        n: usize,
    ) -> Result<TensorId, ModelError> {
        let info = self.gguf.tensor(name).ok_or_else(|| ModelError::MissingTensor { name: name_of(name) })?;
        let row_bytes = info.ty.bytes_for(info.ne[0]).unwrap_or(0) as usize;
        if first + n > info.ne[1] as usize || info.ne[2] != 1 || info.ne[3] != 1 {
            let expected = [info.ne[0], (first + n) as u64, 1, 1];
            return Err(ModelError::TensorShape { name: name_of(name), expected, found: info.ne });
        }
        let offset = self.gguf.data_start() + info.offset as usize + first * row_bytes;
        let storage = Storage::External { buffer: MODEL_BUFFER, offset };
        let mut label = Name::new();
        let _ = write!(label, "{name}:{part}");
        Ok(self.g.leaf(&label, info.ty, [info.ne[0] as usize, n, 1, 1], storage)?)
    }

    /// Layer `il`'s recurrent states of one kind: F32 `[len, n_seq]` in the persistent region.
    fn state_leaf(
        &mut self,
        kind: &str,
        il: usize,
        len: usize,
        offset: usize,
    ) -> Result<TensorId, ModelError> {
        let mut label = Name::new();
        let _ = write!(label, "{kind}.{il}");
        let n_seq = self.cache()?.n_seq;
        Ok(self.g.leaf(&label, GgmlType::F32, [len, n_seq, 1, 1], Storage::Persistent { offset })?)
    }

    /// `w x`, plus `scale * B (A x)` for every adapter holding a pair for `w` (llama.cpp's
    /// order: the base product, then each adapter's term added in turn).
    pub fn mm(&mut self, w: TensorId, x: TensorId) -> Result<TensorId, ModelError> {
        let g = &mut *self.g;
        let mut out = g.mul_mat(w, x)?;
        let files = match &mut self.adapters {
            Adapters::Files(files) => *files,
            Adapters::Trained(pair) => {
                let Some((a, b, scale)) = pair(g, w)? else { return Ok(out) };
                let ax = g.mul_mat(a, x)?;
                let bax = g.mul_mat(b, ax)?;
                let term = g.scale(bax, scale)?;
                return Ok(g.add(out, term)?);
            }
        };
        for (i, adapter) in files.iter().enumerate() {
            let name = g.tensor(w).name.clone();
            let Some(k) = adapter.lora.pairs.iter().position(|p| p.target == name.as_str()) else { continue };
            self.applied[i][k / 64] |= 1 << (k % 64);
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

    /// Every pair of every adapter must have found its weight.
    pub fn check_adapters(&self) -> Result<(), ModelError> {
        let Adapters::Files(files) = &self.adapters else { return Ok(()) };
        for (adapter, bits) in files.iter().zip(&self.applied) {
            for (k, pair) in adapter.lora.pairs.iter().enumerate() {
                if bits[k / 64] >> (k % 64) & 1 == 0 {
                    return Err(ModelError::Lora(LoraError::Unapplied { name: name_of(pair.target) }));
                }
            }
        }
        Ok(())
    }
}

/// `blk.{il}.{suffix}`.
pub(super) fn layer_name(il: usize, suffix: &str) -> Name {
    let mut name = Name::new();
    let _ = write!(name, "blk.{il}.{suffix}");
    name
}

/// A graph error of the forward pass itself.
fn invalid(problem: &'static str) -> ModelError {
    ModelError::Graph(GraphError::Invalid { op: "forward", name: heapless::String::new(), problem })
}

/// The token embeddings, scaled as the architecture says. Returns x: `[n_embd, t]`.
pub(super) fn embed<const N: usize>(b: &mut Builder<'_, '_, N>) -> Result<TensorId, ModelError> {
    // (Input embeddings enter as they are: llama.cpp scales token rows only.)
    if let Some((rows, _)) = b.embeddings {
        return Ok(rows);
    }
    let x = named!(b, "inp_embd", b.g.get_rows(b.tok_embd, b.ids));
    let scale = match b.traits.embed_scale {
        EmbedScale::SqrtWidth => libm::sqrtf(b.hp.n_embd as f32),
        EmbedScale::FromFile if b.hp.embedding_scale != 1.0 => b.hp.embedding_scale,
        EmbedScale::FromFile => return Ok(x),
    };
    Ok(named!(b, "inp_scaled", b.g.scale(x, scale)))
}

/// `x / rms(x) * w`, w: layer `il`'s `weight`, named `norm-{il}` and `{name}-{il}`: a block's
/// input norm.
pub(super) fn pre_norm<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    weight: &str,
    name: &str,
) -> Result<TensorId, ModelError> {
    let w = b.layer(il, weight)?;
    let x = named!(b, "norm", il, b.g.rms_norm(x, b.hp.rms_eps));
    Ok(named!(b, name, il, b.g.mul(x, w)))
}

/// `x / rms(x) * w` (w: layer `il`'s `weight`), named `{raw}-{il}` and `{name}-{il}`: a block's
/// output norm (its weight's leaf made after the norm, where the graphs have always had it).
pub(super) fn post_norm<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    weight: &str,
    (raw, name): (&str, &str),
) -> Result<TensorId, ModelError> {
    let x = named!(b, raw, il, b.g.rms_norm(x, b.hp.rms_eps));
    let w = b.layer(il, weight)?;
    Ok(named!(b, name, il, b.g.mul(x, w)))
}

/// `x + o`, o times Granite's residual scale first (`{scaled}-{il}`), named `{name}-{il}`.
pub(super) fn residual<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    o: TensorId,
    (scaled, name): (&str, &str),
) -> Result<TensorId, ModelError> {
    let scale = b.hp.residual_scale;
    let o = if scale != 1.0 { named!(b, scaled, il, b.g.scale(o, scale)) } else { o };
    Ok(named!(b, name, il, b.g.add(x, o)))
}

/// x times layer `il`'s one-element F32 `layer_output_scale` (Gemma 4), if the file has one
/// (llama.cpp multiplies by the tensor: the same products). x: `[n_embd, t]`.
pub(super) fn layer_output_scale<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
) -> Result<TensorId, ModelError> {
    let scale = b.gguf.tensor(&layer_name(il, "layer_output_scale.weight")).and_then(|info| {
        let bytes = b.gguf.tensor_data(&info).get(..4)?;
        (info.ty == GgmlType::F32 && info.ne == [1, 1, 1, 1])
            .then(|| f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    });
    Ok(match scale {
        Some(scale) => named!(b, "out_scaled", il, b.g.scale(x, scale)),
        None => x,
    })
}

/// Gemma 4's per-layer inputs, made once for every layer: each token's slice of every layer from
/// `per_layer_token_embd` (times sqrt(p)) plus a projection of its scaled embedding (times
/// 1/sqrt(n_embd), RMS-normed per slice), the sum times 1/sqrt(2). x: `[n_embd, t]` → `[p,
/// n_layer, t]`.
pub(super) fn per_layer_inputs<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    x: TensorId,
) -> Result<TensorId, ModelError> {
    let (p, e, t) = (b.hp.n_embd_per_layer as usize, b.hp.n_embd as usize, b.t);
    let table = b.need("per_layer_token_embd.weight")?;
    let proj = b.need("per_layer_model_proj.weight")?;
    let norm = b.need("per_layer_proj_norm.weight")?;
    let n_layer = b.hp.n_layer as usize;
    // rows: [p * n_layer, t]
    let rows = named!(b, "inp_per_layer_rows", b.g.get_rows(table, b.ids));
    let rows = named!(b, "inp_per_layer_selected", b.g.scale(rows, libm::sqrtf(p as f32)));
    let rows = b.g.reshape(rows, [p, n_layer, t, 1])?;
    // projected: [p * n_layer, t] → [p, n_layer, t]
    let projected = named!(b, "per_layer_proj_raw", b.mm(proj, x));
    let projected = named!(b, "per_layer_proj_scaled", b.g.scale(projected, 1.0 / libm::sqrtf(e as f32)));
    let projected = b.g.reshape(projected, [p, n_layer, t, 1])?;
    let projected = named!(b, "per_layer_proj_norm", b.g.rms_norm(projected, b.hp.rms_eps));
    let projected = named!(b, "per_layer_proj", b.g.mul(projected, norm));
    let sum = named!(b, "inp_per_layer_sum", b.g.add(projected, rows));
    Ok(named!(b, "inp_per_layer", b.g.scale(sum, 1.0 / libm::sqrtf(2.0))))
}

/// Gemma 4's per-layer input of layer `il`, added to the residual: GELU of a projection of x to
/// the per-layer width, times this layer's slice of `inputs` (`[p, n_layer, t]`), projected
/// back, RMS-normed. x: `[n_embd, t]` → `[n_embd, t]`.
pub(super) fn per_layer_input<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    inputs: TensorId,
) -> Result<TensorId, ModelError> {
    let (p, t) = (b.hp.n_embd_per_layer as usize, b.t);
    let (w_gate, w_proj) = (b.layer(il, "inp_gate.weight")?, b.layer(il, "proj.weight")?);
    let norm = b.layer(il, "post_norm.weight")?;
    // slice: [p, t], this layer's slice of each token's inputs (rows `p * n_layer` floats apart)
    let token = p * b.hp.n_layer as usize * 4;
    let slice = b.g.view(inputs, [p, t, 1, 1], [4, token, token * t, token * t], il * p * 4, 0)?;
    let gate = named!(b, "per_layer_gate", il, b.mm(w_gate, x));
    let gate = named!(b, "per_layer_gelu", il, b.g.gelu(gate));
    let gated = named!(b, "per_layer_gated", il, b.g.mul(gate, slice));
    let out = named!(b, "per_layer_out", il, b.mm(w_proj, gated));
    let out = named!(b, "per_layer_norm", il, b.g.rms_norm(out, b.hp.rms_eps));
    let out = named!(b, "per_layer_embd_out", il, b.g.mul(out, norm));
    Ok(named!(b, "per_layer_residual", il, b.g.add(x, out)))
}

/// Layer `il`'s self-attention (llama.cpp's build_attn with flash attention) over its own KV
/// cache or, for a KV-sharing layer, its source layer's, with `mask` saying which keys each
/// query sees. cur: `[n_embd, t]` (normed) → `[n_embd, t]`.
pub(super) fn attention<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
    mask: Mask,
) -> Result<TensorId, ModelError> {
    let own_kv = b.hp.has_own_kv(il);
    let (wq, wk, wv) = qkv_weights(b, il, own_kv)?;
    let wo = b.layer(il, "attn_output.weight")?;
    let heads = project_heads(b, il, cur, (wq, wk, wv), own_kv)?;
    let (heads, kq_scale) = rotate(b, il, heads, own_kv)?;
    let attn = if b.kv_cache().is_none() {
        if !own_kv {
            return Err(invalid("a KV-sharing layer in a window graph"));
        }
        attend_window(b, il, &heads, kq_scale, mask)?
    } else {
        // k_all, v_all: the whole cache, [kv_w, n_ctx * n_seq]
        let (k_all, v_all) =
            if own_kv { kv_cache_write(b, il, heads.k, heads.v)? } else { shared_kv(b, il)? };
        attend(b, il, heads.q, (k_all, v_all), kq_scale, mask)?
    };
    // attn: [hd_v * n_head, t]
    let attn = match heads.gate {
        Some(gate) => {
            let gate = named!(b, "gate_sigmoid", il, b.g.sigmoid(gate));
            let gate =
                b.g.reshape(gate, [b.hp.head_dim_v_at(il) as usize * b.hp.n_head as usize, b.t, 1, 1])?;
            named!(b, "attn_gated", il, b.g.mul(attn, gate))
        }
        None => attn,
    };
    Ok(named!(b, "attn_out", il, b.mm(wo, attn)))
}

/// One layer's queries, keys and values split into heads: q `[hd_k, n_head, t]`, k `[hd_k,
/// n_head_kv, t]`, v `[hd_v, n_head_kv, t]` (or still `[hd_v * n_head_kv, t]`), and Qwen3.5's
/// output gate `[hd_k, n_head, t]`. A KV-sharing layer's k and v stand for nothing (its source's
/// cache replaces them).
struct Heads {
    q: TensorId,
    k: TensorId,
    v: TensorId,
    gate: Option<TensorId>,
}

/// The Q, K and V projections of cur (`[n_embd, t]`), their biases, the heads, and the norms of
/// Q and K (and of V) the architecture has.
fn project_heads<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
    (wq, wk, wv): (TensorId, Option<TensorId>, Option<TensorId>),
    own_kv: bool,
) -> Result<Heads, ModelError> {
    let (hp, traits, t) = (b.hp, b.traits, b.t);
    let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
    let (n_head, n_head_kv) = (hp.n_head as usize, hp.n_head_kv as usize);
    // q: [n_head * hd_k (* 2 with an output gate), t], k: [n_head_kv * hd_k, t],
    // v: [n_head_kv * hd_v, t]
    let mut q = named!(b, "Qcur", il, b.mm(wq, cur));
    let mut k = match wk {
        Some(wk) => named!(b, "Kcur", il, b.mm(wk, cur)),
        None => q,
    };
    let mut v = match wv {
        Some(wv) if Some(wv) == wk => k,
        Some(wv) => named!(b, "Vcur", il, b.mm(wv, cur)),
        None => q,
    };
    if traits.qkv_bias {
        let bq = b.layer(il, "attn_q.bias")?;
        let bk = b.layer(il, "attn_k.bias")?;
        let bv = b.layer(il, "attn_v.bias")?;
        q = named!(b, "Qcur_bias", il, b.g.add(q, bq));
        k = named!(b, "Kcur_bias", il, b.g.add(k, bk));
        v = named!(b, "Vcur_bias", il, b.g.add(v, bv));
    }
    let mut gate = None;
    if traits.attn_output_gate {
        // Each head's queries, then its gate (Qwen3.5): two strided views of one output.
        let nb = [4, 2 * hd_k * 4, 2 * hd_k * n_head * 4, 2 * hd_k * n_head * t * 4];
        gate = Some(b.g.view(q, [hd_k, n_head, t, 1], nb, hd_k * 4, 0)?);
        q = b.g.view(q, [hd_k, n_head, t, 1], nb, 0, 0)?;
    } else {
        q = b.g.reshape(q, [hd_k, n_head, t, 1])?;
    }
    if own_kv {
        k = b.g.reshape(k, [hd_k, n_head_kv, t, 1])?;
    }
    if traits.qk_norm {
        let qn = b.layer(il, "attn_q_norm.weight")?;
        q = named!(b, "Qcur_norm", il, b.g.rms_norm(q, hp.rms_eps));
        q = named!(b, "Qcur_normed", il, b.g.mul(q, qn));
        if own_kv {
            let kn = b.layer(il, "attn_k_norm.weight")?;
            k = named!(b, "Kcur_norm", il, b.g.rms_norm(k, hp.rms_eps));
            k = named!(b, "Kcur_normed", il, b.g.mul(k, kn));
        }
    }
    if traits.value_norm && own_kv {
        // Each value head RMS-normalised, without a weight.
        v = b.g.reshape(v, [hd_v, n_head_kv, t, 1])?;
        v = named!(b, "Vcur_normed", il, b.g.rms_norm(v, hp.rms_eps));
    }
    Ok(Heads { q, k, v, gate })
}

/// RoPE of q and k, phi3's query scale, and the Walsh-Hadamard rotations a quantized cache
/// asks for; returns the heads and the scores' scale.
fn rotate<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    mut h: Heads,
    own_kv: bool,
) -> Result<(Heads, f32), ModelError> {
    let (hp, traits) = (b.hp, b.traits);
    let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
    let rope = layer_rope(hp, il);
    if rope.rotates {
        let table = rope_table(b, h.q, &rope)?;
        // (`rope_by`: an M-RoPE table is joined from one table per axis.)
        h.q = named!(b, "Qcur_rope", il, b.g.rope_by(h.q, table, traits.rope));
        if own_kv {
            h.k = named!(b, "Kcur_rope", il, b.g.rope_by(h.k, table, traits.rope));
        }
    }
    // Attention as llama.cpp's CPU flash attention computes it, so results match it closely.
    let mut kq_scale = hp.attention_scale.unwrap_or(1.0 / libm::sqrtf(hd_k as f32));
    if traits.prescaled_queries {
        h.q = named!(b, "Qcur_scaled", il, b.g.scale(h.q, kq_scale));
        kq_scale = 1.0;
    }
    // (A window graph, or an embedding model's, has no cache to rotate for.)
    let types = b.kv_cache().map(|kv| kv.types);
    if let Some(n) = types.and_then(|t| t.k_rotation(hd_k as u32)) {
        h.q = named!(b, "Qcur_rot", il, b.g.hadamard(h.q, n));
        if own_kv {
            h.k = named!(b, "Kcur_rot", il, b.g.hadamard(h.k, n));
        }
    }
    if let (Some(n), true) = (types.and_then(|t| t.v_rotation(hd_v as u32)), own_kv) {
        h.v = named!(b, "Vcur_rot", il, b.g.hadamard(h.v, n));
    }
    Ok((h, kq_scale))
}

/// Flash attention of q (`[hd_k, n_head, t]`) over the caches, each token reading its
/// sequence's rows as `mask` lets it, the values' rotation undone. → `[hd_v * n_head, t]`.
fn attend<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    q: TensorId,
    (k_all, v_all): (TensorId, TensorId),
    kq_scale: f32,
    mask: Mask,
) -> Result<TensorId, ModelError> {
    let (hp, kv, t, places) = (b.hp, b.cache()?, b.t, b.places()?);
    let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
    let (n_head, n_head_kv) = (hp.n_head as usize, hp.n_head_kv as usize);
    // Per head: [hd, rows, n_head_kv].
    let (n_rows, rows) = (kv.cache_rows(), kv.rows_of(il));
    let mut head_view = |all: TensorId, ty: GgmlType, hd: usize, row: usize| {
        let (block, head) = (ty.block_bytes(), hd / ty.block_len() * ty.block_bytes());
        b.g.view(all, [hd, n_rows, n_head_kv, 1], [block, row, head, row * n_rows], 0, 0)
    };
    let k_view = head_view(k_all, kv.types.k, hd_k, rows.k_row_bytes)?;
    let v_view = head_view(v_all, kv.types.v, hd_v, rows.v_row_bytes)?;
    // q: [hd_k, t, n_head]; attn: [hd_v, n_head, t]
    let q = b.g.permute(q, [0, 2, 1, 3])?;
    let attn = named!(b, "kqv_out", il, b.g.flash_attn(q, k_view, v_view, kq_scale, mask));
    // (A step of embeddings attending both ways reads places that end at the batch's end.)
    let attn_places = b.embeddings.and_then(|(_, p)| p).unwrap_or(places);
    b.g.at_positions(attn, attn_places)?;
    let attn = b.g.reshape(attn, [hd_v * n_head, t, 1, 1])?;
    Ok(match kv.types.v_rotation(hd_v as u32) {
        // The rotation is its own inverse: the values' weighted sum rotated back.
        Some(n) => named!(b, "kqv_out_unrot", il, b.g.hadamard(attn, n)),
        None => attn,
    })
}

/// Attention of a window graph: the engine's flash attention over the window's own keys and
/// values (F32, as an F32 cache holds them), so a row's arithmetic is the one generation gives it
/// (the online softmax of ggml; a written-out softmax rounds differently, and a quantized matmul
/// downstream can turn that into a visible difference). Its gradient rule recomputes the scores
/// and the causal softmax within `mask`'s window (`train::attention`). q: `[hd_k, n_head, t]`, k:
/// `[hd_k, n_head_kv, t]`, v: `[hd_v * n_head_kv, t]` → `[hd_v * n_head, t]`.
fn attend_window<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    heads: &Heads,
    kq_scale: f32,
    mask: Mask,
) -> Result<TensorId, ModelError> {
    let (hp, t, g) = (b.hp, b.t, &mut *b.g);
    let (hd_v, n_head, n_head_kv) =
        (hp.head_dim_v_at(il) as usize, hp.n_head as usize, hp.n_head_kv as usize);
    let v = g.reshape(heads.v, [hd_v, n_head_kv, t, 1])?;
    // Heads outermost, as the cache's views: q [hd_k, t, n_head], k [hd_k, t, n_head_kv], v
    // [hd_v, t, n_head_kv].
    let q = g.permute(heads.q, [0, 2, 1, 3])?;
    let k = g.permute(heads.k, [0, 2, 1, 3])?;
    let v = g.permute(v, [0, 2, 1, 3])?;
    // kqv: [hd_v, n_head, t]
    let kqv = named!(b, "kqv_out", il, b.g.flash_attn(q, k, v, kq_scale, mask));
    // An embedding model's batch holds several sequences: a causal query sees its sequence's
    // rows up to its position (the places), a bidirectional one its sequence's span.
    let table = if mask.causal() { b.places } else { b.spans };
    if let Some(table) = table {
        b.g.at_positions(kqv, table)?;
    }
    Ok(b.g.reshape(kqv, [hd_v * n_head, t, 1, 1])?)
}

/// Layer `il`'s Q, K and V projections: one fused `attn_qkv` (rows in that order, llama.cpp's
/// build_qkv) or three matrices; a KV-sharing layer has Q only.
fn qkv_weights<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    own_kv: bool,
) -> Result<(TensorId, Option<TensorId>, Option<TensorId>), ModelError> {
    let hp = b.hp;
    let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
    let (n_head, n_head_kv) = (hp.n_head as usize, hp.n_head_kv as usize);
    // (Qwen3.5's Q projection gives a gate as wide as the queries after each head's queries.)
    let q_parts = if b.traits.attn_output_gate { 2 } else { 1 };
    let fused = layer_name(il, "attn_qkv.weight");
    if b.gguf.tensor(&fused).is_some() {
        let (qw, kw) = (n_head * hd_k * q_parts, n_head_kv * hd_k);
        let q = b.rows_of(&fused, "q", 0, qw)?;
        if !own_kv {
            return Ok((q, None, None));
        }
        let k = b.rows_of(&fused, "k", qw, kw)?;
        let v = b.rows_of(&fused, "v", qw + kw, n_head_kv * hd_v)?;
        return Ok((q, Some(k), Some(v)));
    }
    if !own_kv {
        return Ok((b.layer(il, "attn_q.weight")?, None, None));
    }
    let wk = b.layer(il, "attn_k.weight")?;
    let v_name = layer_name(il, "attn_v.weight");
    let wv = match weight_leaf(b.g, b.gguf, &v_name)? {
        None if b.traits.values_from_keys => wk,
        other => other.ok_or(ModelError::MissingTensor { name: v_name })?,
    };
    Ok((b.layer(il, "attn_q.weight")?, Some(wk), Some(wv)))
}

/// The table of RoPE angles of `rope`'s parameter set, made once and shared by every layer
/// (Gemma 3 and 4 have two); the file's frequency factors belong to full-attention layers.
/// Rows: one per token of q (`[.., .., t]`).
pub(super) fn rope_table<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    q: TensorId,
    rope: &LayerRope,
) -> Result<TensorId, ModelError> {
    let sliding = rope.sliding;
    if let Some(table) = b.rope_tables[sliding as usize] {
        return Ok(table);
    }
    let name = if sliding { "rope_table_swa" } else { "rope_table" };
    let factors = if sliding { None } else { b.rope_freqs };
    let make = |b: &mut Builder<'_, '_, N>, places: Option<TensorId>| -> Result<TensorId, ModelError> {
        let table = b.g.rope_table(q, rope.n_rot, rope.base, rope.scale, factors, rope.mscale, rope.yarn);
        let table = named!(b, name, table);
        if let Some(places) = places {
            b.g.at_positions(table, places)?;
        }
        Ok(table)
    };
    let table = match b.mrope_places {
        Some(places) if !sliding => {
            let axes = [make(b, Some(places[0]))?, make(b, Some(places[1]))?, make(b, Some(places[2]))?];
            mrope_join(b, axes, rope.n_rot, b.hp.rope_sections)?
        }
        _ => make(b, b.places)?,
    };
    b.rope_tables[sliding as usize] = Some(table);
    Ok(table)
}

/// M-RoPE's table from one table per axis (time, row, column; `[n_rot, t]`, each row the
/// cosines then the sines): pair `i` takes axis `a` of sector `i mod (s0 + s1 + s2)`, the first
/// `s0` sectors the time's, the next `s1` the row's, the rest the column's (ggml's
/// `ggml_mrope_cache_init`, whose angles run on across sections: each axis's table is an
/// ordinary one). Runs of pairs from one axis are views of its table, joined in order.
fn mrope_join<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    axes: [TensorId; 3],
    n_rot: usize,
    sections: [u32; 3],
) -> Result<TensorId, ModelError> {
    let (half, t) = (n_rot / 2, b.t);
    let total = sections.iter().sum::<u32>().max(1) as usize;
    let axis_of = |pair: usize| {
        let sector = pair % total;
        if sector < sections[0] as usize {
            0
        } else if sector < (sections[0] + sections[1]) as usize {
            1
        } else {
            2
        }
    };
    let mut joined: Option<TensorId> = None;
    let mut start = 0;
    while start < half {
        let axis = axis_of(start);
        let len = (start..half).take_while(|&p| axis_of(p) == axis).count();
        // `[len, 2, t]`: the run's cosines and sines of every token.
        let run =
            b.g.view(axes[axis], [len, 2, t, 1], [4, half * 4, n_rot * 4, n_rot * 4 * t], start * 4, 0)?;
        joined = Some(match joined {
            None => run,
            Some(j) => b.g.concat(j, run, 0)?,
        });
        start += len;
    }
    let joined = joined.ok_or_else(|| invalid("M-RoPE rotates no pairs"))?;
    if (0..half).all(|p| axis_of(p) == axis_of(0)) {
        // (One axis turns every pair: its table is the whole table.)
        return Ok(axes[axis_of(0)]);
    }
    Ok(named!(b, "rope_table_mrope", b.g.reshape(joined, [n_rot, t, 1, 1])))
}

/// Writes k (`[hd_k, n_head_kv, t]`) and v into layer `il`'s cache, K and V as `[kv_w, n_ctx *
/// n_seq]` of the cache types (one row per position of each sequence), at each token's place.
/// Returns the caches after the writes (so readers run after them).
fn kv_cache_write<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    k: TensorId,
    v: TensorId,
) -> Result<(TensorId, TensorId), ModelError> {
    let (hp, kv, t, places) = (b.hp, b.cache()?, b.t, b.places()?);
    let (hd_k, hd_v) = (hp.head_dim_k_at(il) as usize, hp.head_dim_v_at(il) as usize);
    let n_head_kv = hp.n_head_kv as usize;
    let kv_w = n_head_kv * hd_k.max(hd_v);
    let n_rows = kv.cache_rows();
    let mut cache = |kind: &str, ty: GgmlType, offset: usize| {
        let mut label = Name::new();
        let _ = write!(label, "cache_{kind}.{il}");
        b.g.leaf(&label, ty, [kv_w, n_rows, 1, 1], Storage::Persistent { offset })
    };
    let k_cache = cache("k", kv.types.k, kv.k_offset(il))?;
    let v_cache = cache("v", kv.types.v, kv.v_offset(il))?;
    let k_flat = b.g.reshape(k, [hd_k * n_head_kv, t, 1, 1])?;
    let v_flat = b.g.reshape(v, [hd_v * n_head_kv, t, 1, 1])?;
    let k_all = named!(b, "k_cache_write", il, b.g.kv_write(k_cache, k_flat, false));
    let v_all = named!(b, "v_cache_write", il, b.g.kv_write(v_cache, v_flat, false));
    b.g.at_positions(k_all, places)?;
    b.g.at_positions(v_all, places)?;
    if (il + 1..hp.n_layer as usize).any(|r| !hp.has_own_kv(r) && hp.kv_source(r) == il) {
        let _ = b.shared_caches.push((il, k_all, v_all));
    }
    Ok((k_all, v_all))
}

/// The caches a KV-sharing layer `il` reads (Gemma 4): its source layer's, after that layer's
/// writes of this step.
fn shared_kv<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
) -> Result<(TensorId, TensorId), ModelError> {
    let source = b.hp.kv_source(il);
    let Some(&(_, k_all, v_all)) = b.shared_caches.iter().find(|c| c.0 == source) else {
        return Err(invalid("a KV-sharing layer's source layer has no cache"));
    };
    Ok((k_all, v_all))
}

/// LFM2's short-convolution block of layer `il`: B, C and X projections (rows of one matrix),
/// the convolution of B * X over the sequence's last inputs (its state per sequence), gated by C.
/// cur: `[n_embd, t]` → `[n_embd, t]`.
pub(super) fn short_conv<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
) -> Result<TensorId, ModelError> {
    let e = b.hp.n_embd as usize;
    let in_proj = layer_name(il, "shortconv.in_proj.weight");
    let wb = b.rows_of(&in_proj, "b", 0, e)?;
    let wc = b.rows_of(&in_proj, "c", e, e)?;
    let wx = b.rows_of(&in_proj, "x", 2 * e, e)?;
    let taps = b.layer(il, "shortconv.conv.weight")?;
    let out_proj = b.layer(il, "shortconv.out_proj.weight")?;
    let (kv, places) = (b.cache()?, b.places()?);
    let states = b.state_leaf("conv_state", il, b.hp.conv_state_len(), kv.conv_states_of(il))?;
    // b, c, xs, bx, conv, y: [n_embd, t]
    let bp = named!(b, "conv_b", il, b.mm(wb, cur));
    let c = named!(b, "conv_c", il, b.mm(wc, cur));
    let xs = named!(b, "conv_x", il, b.mm(wx, cur));
    let bx = named!(b, "conv_bx", il, b.g.mul(bp, xs));
    let conv = named!(b, "conv_conv", il, b.g.short_conv(bx, taps, states, places, kv.n_ctx));
    let y = named!(b, "conv_y", il, b.g.mul(c, conv));
    Ok(named!(b, "conv_out", il, b.mm(out_proj, y)))
}

/// Qwen3.5's gated delta rule of layer `il`: Q, K, V through a causal convolution (its state per
/// sequence) and SiLU, L2-normalised Q and K, the delta rule (a state per value head and
/// sequence), an RMS norm gated by SiLU(attn_gate), the output projection. cur: `[n_embd, t]` →
/// `[n_embd, t]`.
pub(super) fn delta_net<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
    d: DeltaNet,
) -> Result<TensorId, ModelError> {
    let (hd, nk, nv) = (d.head_dim as usize, d.n_k_heads as usize, d.n_v_heads as usize);
    let (ch, t, eps) = (d.conv_channels(), b.t, b.hp.rms_eps);
    let (w_qkv, w_gate) = (b.layer(il, "attn_qkv.weight")?, b.layer(il, "attn_gate.weight")?);
    let (w_beta, w_alpha) = (b.layer(il, "ssm_beta.weight")?, b.layer(il, "ssm_alpha.weight")?);
    let (dt_bias, a) = (b.layer(il, "ssm_dt.bias")?, b.layer(il, "ssm_a")?);
    let taps = b.layer(il, "ssm_conv1d.weight")?;
    let (norm, w_out) = (b.layer(il, "ssm_norm.weight")?, b.layer(il, "ssm_out.weight")?);
    // qkv: [ch, t], z: [hd * nv, t], beta, decay: [nv, t]
    let qkv = named!(b, "linear_attn_qkv_mixed", il, b.mm(w_qkv, cur));
    let z = named!(b, "z", il, b.mm(w_gate, cur));
    let beta = named!(b, "beta", il, b.mm(w_beta, cur));
    let beta = named!(b, "beta_sigmoid", il, b.g.sigmoid(beta));
    let alpha = named!(b, "alpha", il, b.mm(w_alpha, cur));
    let alpha = named!(b, "alpha_biased", il, b.g.add(alpha, dt_bias));
    let alpha = named!(b, "a_softplus", il, b.g.softplus(alpha));
    let decay = named!(b, "gate", il, b.g.mul(alpha, a));
    let (hp, kv, places) = (b.hp, b.cache()?, b.places()?);
    let conv_states = b.state_leaf("conv_state", il, hp.conv_state_len(), kv.conv_states_of(il))?;
    let delta_states = b.state_leaf("delta_state", il, hp.delta_state_len(), kv.delta_states_of(il))?;
    let conv = named!(b, "conv_output_raw", il, b.g.short_conv(qkv, taps, conv_states, places, kv.n_ctx));
    let conv = named!(b, "conv_output_silu", il, b.g.silu(conv));
    // Q, K and V heads of each token's convolved row; Q and K L2-normalised as llama.cpp does
    // (an RMS norm with eps / d, times 1 / sqrt(d)). q, k: [hd, nk, t], v: [hd, nv, t]
    let nb = [4, hd * 4, ch * 4, ch * t * 4];
    let q = b.g.view(conv, [hd, nk, t, 1], nb, 0, 0)?;
    let k = b.g.view(conv, [hd, nk, t, 1], nb, nk * hd * 4, 0)?;
    let v = b.g.view(conv, [hd, nv, t, 1], nb, 2 * nk * hd * 4, 0)?;
    let l2 = 1.0 / libm::sqrtf(hd as f32);
    let q = named!(b, "q_conv_norm", il, b.g.rms_norm(q, eps / hd as f32));
    let q = named!(b, "q_conv_predelta", il, b.g.scale(q, l2));
    let k = named!(b, "k_conv_norm", il, b.g.rms_norm(k, eps / hd as f32));
    let k = named!(b, "k_conv_predelta", il, b.g.scale(k, l2));
    // out: [hd, nv, t]
    let out = named!(
        b,
        "attn_output",
        il,
        b.g.gated_delta_net(q, k, v, decay, beta, delta_states, places, kv.n_ctx)
    );
    let out = named!(b, "attn_output_norm", il, b.g.rms_norm(out, eps));
    let out = named!(b, "attn_output_normed", il, b.g.mul(out, norm));
    let z = b.g.reshape(z, [hd, nv, t, 1])?;
    let z = named!(b, "z_silu", il, b.g.silu(z));
    let out = named!(b, "attn_out_gated", il, b.g.mul(out, z));
    let out = b.g.reshape(out, [hd * nv, t, 1, 1])?;
    Ok(named!(b, "linear_attn_out", il, b.mm(w_out, out)))
}

/// Layer `il`'s gated MLP: `down(act(gate cur) * up cur)`, gate and up as two matrices or rows of
/// one fused `ffn_up` (gate first). cur: `[n_embd, t]` → `[n_embd, t]`.
pub(super) fn ffn<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
) -> Result<TensorId, ModelError> {
    let (wg, wu) = if b.traits.fused_gate_up {
        let fused = layer_name(il, "ffn_up.weight");
        let f = b.hp.n_ff_at(il) as usize;
        (b.rows_of(&fused, "gate", 0, f)?, b.rows_of(&fused, "up", f, f)?)
    } else {
        (b.layer(il, "ffn_gate.weight")?, b.layer(il, "ffn_up.weight")?)
    };
    let wd = b.layer(il, "ffn_down.weight")?;
    // gate, up, act: [n_ff, t]
    let gate = named!(b, "ffn_gate", il, b.mm(wg, cur));
    let up = named!(b, "ffn_up", il, b.mm(wu, cur));
    let act = match b.traits.act {
        Activation::GeGlu => named!(b, "ffn_geglu", il, b.g.geglu(gate, up)),
        Activation::SwiGlu => named!(b, "ffn_swiglu", il, b.g.swiglu(gate, up)),
    };
    Ok(named!(b, "ffn_out", il, b.mm(wd, act)))
}

/// Layer `il`'s mixture of experts, as llama.cpp's build_moe_ffn: softmax or sigmoid router
/// (kept in float on the CPU), top-k experts (chosen with lfm2moe's bias), their weights
/// (renormalised for qwen3moe and lfm2moe), SwiGLU experts through mul_mat_id, weighted sum,
/// plus qwen2moe's shared expert. cur: `[n_embd, t]` → `[n_embd, t]`.
pub(super) fn moe_ffn<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    cur: TensorId,
    route: Experts,
) -> Result<TensorId, ModelError> {
    let (e, t, k_used) = (b.hp.n_embd as usize, b.t, b.hp.n_expert_used as usize);
    let router = b.layer(il, "ffn_gate_inp.weight")?;
    // logits, probs: [n_expert, t]
    let logits = named!(b, "ffn_moe_logits", il, b.mm(router, cur));
    let probs = match route.gating {
        Gating::Softmax => named!(b, "ffn_moe_probs", il, b.g.soft_max(logits, 1.0, false, 0)),
        Gating::Sigmoid => named!(b, "ffn_moe_probs", il, b.g.sigmoid(logits)),
    };
    let chosen_by = if route.selection_bias {
        let bias = b.layer(il, "exp_probs_b.bias")?;
        named!(b, "ffn_moe_probs_biased", il, b.g.add(probs, bias))
    } else {
        probs
    };
    // picked, weights: [k_used, t]
    let picked = named!(b, "ffn_moe_topk", il, b.g.top_k(chosen_by, k_used));
    let weights = named!(b, "ffn_moe_weights", il, b.g.moe_weights(probs, picked, route.normalize_weights));
    let wg = b.layer(il, "ffn_gate_exps.weight")?;
    let wu = b.layer(il, "ffn_up_exps.weight")?;
    let wd = b.layer(il, "ffn_down_exps.weight")?;
    // x3: [n_embd, 1, t]; up, gate, act: [n_ff_expert, k_used, t]; experts: [n_embd, k_used, t]
    let x3 = b.g.reshape(cur, [e, 1, t, 1])?;
    let up = named!(b, "ffn_moe_up", il, b.g.mul_mat_id(wu, x3, picked));
    let gate = named!(b, "ffn_moe_gate", il, b.g.mul_mat_id(wg, x3, picked));
    let act = named!(b, "ffn_moe_swiglu", il, b.g.swiglu(gate, up));
    let experts = named!(b, "ffn_moe_down", il, b.g.mul_mat_id(wd, act, picked));
    let moe = named!(b, "ffn_moe_out", il, b.g.moe_sum(experts, weights));
    if !route.shared_expert {
        return Ok(moe);
    }
    // The shared expert, scaled by its own sigmoid gate. shared_gate: [1, t]
    let gate_inp = b.layer(il, "ffn_gate_inp_shexp.weight")?;
    let sg = b.layer(il, "ffn_gate_shexp.weight")?;
    let su = b.layer(il, "ffn_up_shexp.weight")?;
    let sd = b.layer(il, "ffn_down_shexp.weight")?;
    let shared_gate = named!(b, "ffn_shexp_gate_inp", il, b.mm(gate_inp, cur));
    let shared_gate = named!(b, "ffn_shexp_gate", il, b.g.sigmoid(shared_gate));
    let gate = named!(b, "ffn_shexp_g", il, b.mm(sg, cur));
    let up = named!(b, "ffn_shexp_up", il, b.mm(su, cur));
    let act = named!(b, "ffn_shexp_swiglu", il, b.g.swiglu(gate, up));
    let shared = named!(b, "ffn_shexp_down", il, b.mm(sd, act));
    let shared = named!(b, "ffn_shexp_out", il, b.g.mul(shared, shared_gate));
    Ok(named!(b, "ffn_moe_shexp", il, b.g.add(moe, shared)))
}

/// The output head: the rows of the `n_outputs` tokens whose logits are wanted (all when it is
/// `t`, else those the output-rows input names, which skips the output matmul for the others),
/// the final norm, the output matrix, Granite's logit scale and the soft-cap. x: `[n_embd, t]` →
/// logits `[n_vocab, n_outputs]`.
pub(super) fn output_head<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    mut x: TensorId,
    n_outputs: usize,
) -> Result<TensorId, ModelError> {
    let hp = b.hp;
    if n_outputs < b.t {
        let storage = Storage::Persistent { offset: b.cache()?.outputs_offset };
        let rows = b.g.leaf("output_rows", GgmlType::I32, [n_outputs, 1, 1, 1], storage)?;
        // x: [n_embd, n_outputs]
        x = named!(b, "inp_out_ids", b.g.get_rows(x, rows));
    }
    let x = named!(b, "result_norm_raw", b.g.rms_norm(x, hp.rms_eps));
    let x = named!(b, "result_norm", b.g.mul(x, b.output_norm));
    let mut logits = b.mm(b.output, x)?;
    if hp.logit_scale != 1.0 {
        b.g.set_name(logits, format_args!("result_output_raw"));
        logits = b.g.scale(logits, 1.0 / hp.logit_scale)?;
    }
    if hp.final_logit_softcap > 0.0 {
        // c * tanh(logits / c), in llama.cpp's three steps.
        let c = hp.final_logit_softcap;
        b.g.set_name(logits, format_args!("result_output_raw"));
        let scaled = named!(b, "result_output_capped_in", b.g.scale(logits, 1.0 / c));
        let capped = named!(b, "result_output_tanh", b.g.tanh(scaled));
        logits = b.g.scale(capped, c)?;
    }
    b.g.set_name(logits, format_args!("logits"));
    Ok(logits)
}
