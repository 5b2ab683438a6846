//! The forward pass of every architecture as a graph on the engine: [`build`] composes the
//! named blocks of `blocks.rs` per layer from the architecture's facts ([`super::ArchTraits`]),
//! and [`build_window`] composes the same blocks over a training window (no cache, the adapters
//! the trainer's parameters). (Each layer's RoPE is `rope.rs`'s.) Weights are leaves in buffer 0
//! (the model file) at their GGUF offsets; the KV cache and the token ids live in the arena's
//! persistent region. LoRA adapters' tensors are leaves in buffers 1.. (one per adapter).

use super::blocks::{self, Adapters, Builder, Mode, TrainedPair};
use super::encoder;
use super::kv::KvLayout;
use super::{Forward, StepInput};
use crate::gguf::Gguf;
use crate::graph::{Graph, GraphError, Mask};
use crate::model::lora::Adapter;
use crate::model::{HParams, ModelError, Pooling};
use crate::tensor::TensorId;

/// Builds the forward pass for `n_tokens` tokens, with logits for `n_outputs` of them: all
/// (`n_outputs == n_tokens`, perplexity), or the ones the output-rows input names (generation:
/// the last token of each sequence), which skips the output matmul for the others. Each token
/// takes its position and sequence from the places input. The model must have passed
/// `validate_tensors`.
///
/// Every layer is a pre-norm residual block: a mixer (attention, a short convolution or the
/// gated delta rule), then a feed-forward block (dense or experts), each with the norms and
/// scales the architecture's facts name.
#[allow(clippy::too_many_arguments)]
pub fn build<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[Adapter<'_>],
    input: StepInput,
) -> Result<Forward, ModelError> {
    if n_tokens == 0 || n_tokens > kv.n_batch || n_outputs == 0 || n_outputs > n_tokens {
        g.clear();
        return Err(ModelError::Graph(GraphError::Invalid {
            op: "forward",
            name: heapless::String::new(),
            problem: "a batch needs 1..=n_batch tokens and 1..=n_tokens outputs",
        }));
    }
    let mut b = Builder::new(g, gguf, hp, Mode::Cached(kv), n_tokens, Adapters::Files(adapters))?;
    b.take_embeddings(input)?;
    let x = layers(&mut b)?;
    let logits = match kv.encoder_inputs {
        Some(_) => embeddings(&mut b, x, n_outputs)?,
        None => blocks::output_head(&mut b, x, n_outputs)?,
    };
    b.check_adapters()?;
    let ids = b.ids;
    b.g.build(&[logits])?;
    Ok(Forward { ids, logits, n_tokens, n_outputs, input })
}

/// The forward pass of a training window: one sequence of `n_tokens` tokens at positions
/// 0..n_tokens, its ids at `ids_offset` of the persistent region, no cache (attention over the
/// window's own keys and values, rounded as generation rounds it), logits for every token, and each matmul's weight adapted by the
/// pair `pair` makes for it. Returns the ids' leaf and the logits `[n_vocab, n_tokens]`; the graph
/// is left for the caller to add its loss to and build. The blocks with a cache or a state
/// (short convolutions, the delta rule, KV-sharing layers) are refused.
pub fn build_window<'b, const N: usize>(
    g: &'b mut Graph<N>,
    gguf: &'b Gguf<'_>,
    hp: &'b HParams,
    n_tokens: usize,
    ids_offset: usize,
    pair: &'b mut TrainedPair<'b, N>,
) -> Result<(TensorId, TensorId), ModelError> {
    if hp.arch.traits().encoder {
        g.clear();
        return Err(ModelError::Graph(GraphError::Invalid {
            op: "forward",
            name: heapless::String::new(),
            problem: "an encoder has no training window (fine-tuning runs generating models)",
        }));
    }
    let mode = Mode::Window { ids_offset };
    let mut b = Builder::new(g, gguf, hp, mode, n_tokens, Adapters::Trained(pair))?;
    let x = layers(&mut b)?;
    let logits = blocks::output_head(&mut b, x, n_tokens)?;
    Ok((b.ids, logits))
}

/// The embeddings and every layer: each a pre-norm residual block of a mixer, then one of a
/// feed-forward block, with the norms and scales the facts name. Returns x: `[n_embd, t]`.
fn layers<const N: usize>(b: &mut Builder<'_, '_, N>) -> Result<TensorId, ModelError> {
    let (hp, traits) = (b.hp, b.traits);
    // x: [n_embd, t]
    let mut x = blocks::embed(b)?;
    // inputs: [n_embd_per_layer, n_layer, t]
    let per_layer_inputs = if hp.n_embd_per_layer > 0 { Some(blocks::per_layer_inputs(b, x)?) } else { None };
    for il in 0..hp.n_layer as usize {
        // cur: [n_embd, t]
        let cur = blocks::pre_norm(b, il, x, "attn_norm.weight", "attn_norm")?;
        let mut o = match (hp.recurrent.contains(il), hp.delta) {
            (true, Some(d)) => blocks::delta_net(b, il, cur, d)?,
            (true, None) => blocks::short_conv(b, il, cur)?,
            (false, _) => {
                let mask = match (traits.bidirectional, hp.is_sliding(il)) {
                    (false, false) => Mask::Causal,
                    (false, true) => Mask::SlidingWindow(hp.sliding_window),
                    (true, false) => Mask::Bidirectional,
                    (true, true) => Mask::Symmetric(hp.sliding_window),
                };
                blocks::attention(b, il, cur, mask)?
            }
        };
        if traits.post_norms {
            o = blocks::post_norm(
                b,
                il,
                o,
                "post_attention_norm.weight",
                ("attn_post_norm_raw", "attn_post_norm"),
            )?;
        }
        x = blocks::residual(b, il, x, o, ("attn_out_scaled", "ffn_inp"))?;

        let cur = blocks::pre_norm(b, il, x, traits.ffn_norm, "ffn_norm")?;
        let mut down = match hp.experts_at(il) {
            Some(route) => blocks::moe_ffn(b, il, cur, route)?,
            None => blocks::ffn(b, il, cur)?,
        };
        if traits.post_norms {
            down = blocks::post_norm(
                b,
                il,
                down,
                "post_ffw_norm.weight",
                ("ffn_post_norm_raw", "ffn_post_norm"),
            )?;
        }
        x = blocks::residual(b, il, x, down, ("ffn_out_scaled", "ffn_residual"))?;
        if let Some(inputs) = per_layer_inputs {
            x = blocks::per_layer_input(b, il, x, inputs)?;
        }
        if traits.layer_output_scale {
            x = blocks::layer_output_scale(b, il, x)?;
        }
        b.g.set_name(x, format_args!("l_out-{il}"));
    }
    Ok(x)
}

/// A decoder-shaped embedding model's output (Qwen3-Embedding, Qwen3-Reranker, EmbeddingGemma,
/// as llama.cpp's build_pooling and build_dense_out): the final norm of every token, pooled as
/// the encoders pool (`encoder::pool`), a causal model's `rank` scores as the softmax of its
/// labels (Qwen3-Reranker's yes/no rows of the language-model head), then the dense head the
/// file has (`dense_2`, `dense_3`). x: `[n_embd, t]` → `[width, n_outputs]`.
fn embeddings<const N: usize>(
    b: &mut Builder<'_, '_, N>,
    x: TensorId,
    n_outputs: usize,
) -> Result<TensorId, ModelError> {
    let output_norm = b.need(b.traits.output_norm)?;
    let x = b.g.rms_norm(x, b.hp.rms_eps)?;
    b.g.set_name(x, format_args!("result_norm_raw"));
    let x = b.g.mul(x, output_norm)?;
    b.g.set_name(x, format_args!("result_norm"));
    let spans = b.spans.ok_or(ModelError::Graph(GraphError::Invalid {
        op: "forward",
        name: heapless::String::new(),
        problem: "an embedding model's batch needs its spans",
    }))?;
    let mut out = encoder::pool(b, x, n_outputs, spans)?;
    if b.hp.pooling == Some(Pooling::Rank) && !b.traits.bidirectional {
        out = b.g.soft_max(out, 1.0, false, 0)?;
    }
    for dense in ["dense_2.weight", "dense_3.weight"] {
        if let Some(w) = b.optional(dense)? {
            out = b.mm(w, out)?;
        }
    }
    b.g.set_name(out, format_args!("result_embd_pooled"));
    Ok(out)
}
