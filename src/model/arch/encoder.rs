//! The forward pass of an encoder (llama.cpp's `bert` graph, which also runs `nomic-bert` and
//! `jina-bert-v2`): token and token-type embeddings (BERT: and absolute position embeddings) and
//! their LayerNorm, then per layer attention both ways within each sequence of the batch (over the
//! batch's own keys and values: no KV cache; nomic-bert rotates Q and K, jina-bert-v2 biases the
//! scores by ALiBi), the output projection, a residual and a LayerNorm (post-LN), the MLP (BERT's
//! GELU, or a gated one: SwiGLU, GEGLU), a residual and a LayerNorm; the token vectors are pooled
//! as `HParams::pooling` says. Every matmul and norm may have a bias. [`ArchTraits::positions`]
//! and [`ArchTraits::gated_encoder_ffn`] say which parts an architecture has.
//!
//! Each token's sequence is its span, an input of the graph (first batch row of its sequence,
//! the sequence's tokens): attention sees the span's keys, mean pooling averages its rows. A
//! sequence's tokens are consecutive in the batch.

use super::blocks::{layer_name, rope_table, Adapters, Builder, Mode};
use super::facts::{Activation, ArchTraits, Positions};
use super::kv::KvLayout;
use super::rope::layer_rope;
use core::fmt::Write;

use crate::gguf::Gguf;
use crate::graph::{Graph, GraphError, Mask};
use crate::model::lora::Adapter;
use crate::model::{HParams, ModelError, Pooling};
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};

use super::Forward;

/// Names a computed tensor as llama.cpp names it, with the layer after a dash (`ffn_up-3`).
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

/// The step's inputs an encoder reads beside the token ids.
struct Inputs {
    /// I32 `[t]`: each token's position.
    positions: TensorId,
    /// I32 `[t]`: each token's type.
    types: TensorId,
    /// I32 `[2, t]`: each token's span (first batch row of its sequence, its tokens).
    spans: TensorId,
}

/// Builds the encoder's graph for `n_tokens` tokens with `n_outputs` output rows: one per
/// sequence (pooled) or per token asked for (`Pooling::None`), each `n_embd` wide (or the
/// classifier's labels for `Pooling::Rank`), in the order of the output-rows input.
pub fn build<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[Adapter<'_>],
) -> Result<Forward, ModelError> {
    let Some(at) = kv.encoder_inputs.filter(|_| n_tokens > 0 && n_tokens <= kv.n_batch) else {
        g.clear();
        return Err(invalid("an encoder's batch needs 1..=n_batch tokens and its inputs"));
    };
    if n_outputs == 0 || n_outputs > n_tokens {
        g.clear();
        return Err(invalid("an encoder's batch needs 1..=n_tokens outputs"));
    }
    let mut b = Builder::new(g, gguf, hp, Mode::Cached(kv), n_tokens, Adapters::Files(adapters))?;
    let input = |b: &mut Builder<'_, '_, N>, name: &str, rows: usize, offset: usize| {
        b.g.leaf(name, GgmlType::I32, [rows, n_tokens, 1, 1], Storage::Persistent { offset })
    };
    let inputs = Inputs {
        positions: input(&mut b, "token_positions", 1, at.positions_offset)?,
        types: input(&mut b, "token_types_in", 1, at.types_offset)?,
        spans: input(&mut b, "token_spans", 2, at.spans_offset)?,
    };
    let positions = b.g.reshape(inputs.positions, [n_tokens, 1, 1, 1])?;
    let types = b.g.reshape(inputs.types, [n_tokens, 1, 1, 1])?;
    let mut x = embed(&mut b, positions, types)?;
    for il in 0..hp.n_layer as usize {
        x = layer(&mut b, il, x, inputs.spans)?;
        b.g.set_name(x, format_args!("l_out-{il}"));
    }
    b.g.set_name(x, format_args!("result_embd"));
    let out = pool(&mut b, x, n_outputs, inputs.spans)?;
    b.check_adapters()?;
    let ids = b.ids;
    b.g.build(&[out])?;
    Ok(Forward { ids, logits: out, n_tokens, n_outputs, input: super::StepInput::Tokens })
}

/// A graph error of the encoder itself.
fn invalid(problem: &'static str) -> ModelError {
    ModelError::Graph(GraphError::Invalid { op: "encoder", name: heapless::String::new(), problem })
}

/// `w x + bias` (the bias if the file has one).
fn linear<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    w: TensorId,
    bias: Option<TensorId>,
    x: TensorId,
) -> Result<TensorId, ModelError> {
    let y = b.mm(w, x)?;
    Ok(match bias {
        Some(bias) => b.g.add(y, bias)?,
        None => y,
    })
}

/// LayerNorm of x's rows with weight `w` and bias `bias`.
fn layer_norm<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    x: TensorId,
    (w, bias): (TensorId, TensorId),
) -> Result<TensorId, ModelError> {
    let x = b.g.layer_norm(x, b.hp.rms_eps)?;
    let x = b.g.mul(x, w)?;
    Ok(b.g.add(x, bias)?)
}

/// The embeddings: the token's row, the token type's row (llama.cpp gives every token type 0)
/// and (BERT) the position's row, added and LayerNormed. → x: `[n_embd, t]`.
fn embed<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    positions: TensorId,
    types: TensorId,
) -> Result<TensorId, ModelError> {
    let tok_embd = b.need("token_embd.weight")?;
    let mut x = b.g.get_rows(tok_embd, b.ids)?;
    if let Some(type_embd) = b.optional("token_types.weight")? {
        let rows = b.g.get_rows(type_embd, types)?;
        x = b.g.add(x, rows)?;
    }
    if b.traits.positions == Positions::Embedded {
        let pos_embd = b.need("position_embd.weight")?;
        let rows = b.g.get_rows(pos_embd, positions)?;
        x = b.g.add(rows, x)?;
    }
    b.g.set_name(x, format_args!("inp_embd"));
    let norm = (b.need("token_embd_norm.weight")?, b.need("token_embd_norm.bias")?);
    Ok(named!(b, "inp_norm", layer_norm(b, x, norm)))
}

/// Layer `il`: attention of every token over its sequence's tokens, the output projection,
/// residual, LayerNorm; the MLP, residual, LayerNorm. x: `[n_embd, t]` → `[n_embd, t]`.
fn layer<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    spans: TensorId,
) -> Result<TensorId, ModelError> {
    let attn = attention(b, il, x, spans)?;
    let wo = b.layer(il, "attn_output.weight")?;
    let bo = b.optional_layer(il, "attn_output.bias")?;
    let o = named!(b, "attn_out", il, linear(b, wo, bo, attn));
    let cur = named!(b, "attn_residual", il, b.g.add(o, x));
    let norm = (b.layer(il, "attn_output_norm.weight")?, b.layer(il, "attn_output_norm.bias")?);
    let ffn_inp = named!(b, "ffn_inp", il, layer_norm(b, cur, norm));

    let act = if b.traits.gated_encoder_ffn {
        gated_mlp(b, il, ffn_inp)?
    } else {
        let (w_up, b_up) = (b.layer(il, "ffn_up.weight")?, b.optional_layer(il, "ffn_up.bias")?);
        // up: [n_ff, t]
        let up = named!(b, "ffn_up", il, linear(b, w_up, b_up, ffn_inp));
        named!(b, "ffn_gelu", il, b.g.gelu(up))
    };
    let (w_down, b_down) = (b.layer(il, "ffn_down.weight")?, b.optional_layer(il, "ffn_down.bias")?);
    let down = named!(b, "ffn_out", il, linear(b, w_down, b_down, act));
    let cur = named!(b, "ffn_residual", il, b.g.add(down, ffn_inp));
    let norm = (b.layer(il, "layer_output_norm.weight")?, b.layer(il, "layer_output_norm.bias")?);
    layer_norm(b, cur, norm)
}

/// Layer `il`'s attention: Q, K and V (three matrices or rows of one `attn_qkv`, each with its
/// bias if the file has one), RoPE (nomic-bert), attention over the span's keys (ALiBi's bias on
/// jina-bert-v2). x: `[n_embd, t]` → `[hd * n_head, t]`.
fn attention<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
    spans: TensorId,
) -> Result<TensorId, ModelError> {
    let (hp, t, traits) = (b.hp, b.t, b.traits);
    let (hd, n_head, n_head_kv) = (hp.head_dim_k as usize, hp.n_head as usize, hp.n_head_kv as usize);
    let (qw, kw) = (hd * n_head, hd * n_head_kv);
    let fused = layer_name(il, "attn_qkv.weight");
    let fused = b.has(&fused).then_some(fused);
    let project = |b: &mut Builder<'_, '_, N>, part: &str, (first, n): (usize, usize), name: &str| {
        let (w, bias) = match &fused {
            // Rows of the fused matrix and of its bias (llama.cpp's views of one product).
            Some(fused) => {
                let w = b.rows_of(fused, part, first, n)?;
                (w, bias_rows(b, il, "attn_qkv.bias", first, n)?)
            }
            None => {
                let mut weight = layer_name(il, "");
                let _ = write!(weight, "attn_{part}.weight");
                let w = b.need(&weight)?;
                let mut bias = layer_name(il, "");
                let _ = write!(bias, "attn_{part}.bias");
                (w, b.optional(&bias)?)
            }
        };
        Ok::<_, ModelError>(named!(b, name, il, linear(b, w, bias, x)))
    };
    // q: [hd * n_head, t], k and v: [hd * n_head_kv, t]
    let q = project(b, "q", (0, qw), "Qcur")?;
    let k = project(b, "k", (qw, kw), "Kcur")?;
    let v = project(b, "v", (qw + kw, kw), "Vcur")?;
    let mut q = b.g.reshape(q, [hd, n_head, t, 1])?;
    let mut k = b.g.reshape(k, [hd, n_head_kv, t, 1])?;
    let v = b.g.reshape(v, [hd, n_head_kv, t, 1])?;
    if traits.positions == Positions::Rotary {
        // (The token places give each token its position in its sequence.)
        let rope = layer_rope(hp, il);
        let table = rope_table(b, q, &rope)?;
        q = named!(b, "Qcur_rope", il, b.g.rope_with(q, table, traits.rope));
        k = named!(b, "Kcur_rope", il, b.g.rope_with(k, table, traits.rope));
    }
    // Heads outermost: q [hd, t, n_head], k and v [hd, t, n_head_kv] (the batch's own keys).
    let q = b.g.permute(q, [0, 2, 1, 3])?;
    let k = b.g.permute(k, [0, 2, 1, 3])?;
    let v = b.g.permute(v, [0, 2, 1, 3])?;
    let scale = 1.0 / libm::sqrtf(hd as f32);
    // attn: [hd, n_head, t]
    let attn = match traits.positions {
        Positions::Alibi(max_bias) => b.g.flash_attn_alibi(q, k, v, scale, Mask::Bidirectional, max_bias),
        Positions::Embedded | Positions::Rotary => b.g.flash_attn(q, k, v, scale, Mask::Bidirectional),
    };
    let attn = named!(b, "kqv_out", il, attn);
    b.g.at_positions(attn, spans)?;
    Ok(b.g.reshape(attn, [hd * n_head, t, 1, 1])?)
}

/// Elements `first..first + n` of layer `il`'s 1-D tensor `suffix` (a fused projection's bias), if
/// the file has it.
fn bias_rows<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    suffix: &str,
    first: usize,
    n: usize,
) -> Result<Option<TensorId>, ModelError> {
    let Some(bias) = b.optional_layer(il, suffix)? else { return Ok(None) };
    let size = b.g.tensor(bias).ty.block_bytes();
    let nb = [size, size * n, size * n, size * n];
    Ok(Some(b.g.view(bias, [n, 1, 1, 1], nb, first * size, 0)?))
}

/// Layer `il`'s gated MLP before its down projection: `act(gate x + bias) * (up x + bias)`, gate
/// and up two matrices (`ffn_gate`, `ffn_up`) or the halves of one `ffn_up` of `2 n_ff` rows,
/// gate first (jina-bert-v2's GEGLU). x: `[n_embd, t]` → `[n_ff, t]`.
fn gated_mlp<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    il: usize,
    x: TensorId,
) -> Result<TensorId, ModelError> {
    let (traits, f): (ArchTraits, usize) = (b.traits, b.hp.n_ff_at(il) as usize);
    let ((wg, bg), (wu, bu)) = if traits.fused_gate_up {
        let fused = layer_name(il, "ffn_up.weight");
        let gate = (b.rows_of(&fused, "gate", 0, f)?, bias_rows(b, il, "ffn_up.bias", 0, f)?);
        (gate, (b.rows_of(&fused, "up", f, f)?, bias_rows(b, il, "ffn_up.bias", f, f)?))
    } else {
        let gate = (b.layer(il, "ffn_gate.weight")?, b.optional_layer(il, "ffn_gate.bias")?);
        (gate, (b.layer(il, "ffn_up.weight")?, b.optional_layer(il, "ffn_up.bias")?))
    };
    let gate = named!(b, "ffn_gate", il, linear(b, wg, bg, x));
    let up = named!(b, "ffn_up", il, linear(b, wu, bu, x));
    Ok(match traits.act {
        Activation::GeGlu => named!(b, "ffn_geglu", il, b.g.geglu(gate, up)),
        Activation::SwiGlu => named!(b, "ffn_swiglu", il, b.g.swiglu(gate, up)),
    })
}

/// The output rows: per token (`none`: the tokens the output-rows input names), one per sequence
/// from the token the output-rows input names (its first for `mean`, `cls` and `rank`, its
/// last for `last`), `rank` through the classifier head (`cls` dense and tanh, then
/// `cls.output`, as llama.cpp's). x: `[n_embd, t]` → `[width, n_outputs]`.
pub(super) fn pool<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    x: TensorId,
    n_outputs: usize,
    spans: TensorId,
) -> Result<TensorId, ModelError> {
    let pooling = b.hp.pooling.unwrap_or(Pooling::None);
    if pooling == Pooling::None && n_outputs == b.t {
        return Ok(x);
    }
    let storage = Storage::Persistent { offset: b.cache()?.outputs_offset };
    let rows = b.g.leaf("output_rows", GgmlType::I32, [n_outputs, 1, 1, 1], storage)?;
    let out = match pooling {
        Pooling::Mean => named!(b, "result_embd_pooled", b.g.seq_mean(x, rows, spans)),
        Pooling::None | Pooling::Cls | Pooling::Last => {
            named!(b, "result_embd_pooled", b.g.get_rows(x, rows))
        }
        Pooling::Rank => {
            let mut cur = b.g.get_rows(x, rows)?;
            if let Some(cls) = b.optional("cls.weight")? {
                let bias = b.optional("cls.bias")?;
                cur = linear(b, cls, bias, cur)?;
                cur = b.g.tanh(cur)?;
            }
            if let Some(out) = b.optional("cls.output.weight")? {
                let bias = b.optional("cls.output.bias")?;
                cur = linear(b, out, bias, cur)?;
            }
            b.g.set_name(cur, format_args!("result_embd_pooled"));
            cur
        }
    };
    Ok(out)
}
