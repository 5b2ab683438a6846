//! The forward pass of every architecture as a graph on the engine: [`build`] composes the
//! named blocks of `blocks.rs` per layer from the architecture's facts ([`super::ArchTraits`]),
//! and [`build_window`] composes the same blocks over a training window (no cache, the adapters
//! the trainer's parameters). Here also each layer's RoPE, which the context shift reads too.
//! Weights are leaves in buffer 0 (the model file) at their GGUF offsets; the KV cache and the
//! token ids live in the arena's persistent region. LoRA adapters' tensors are leaves in buffers
//! 1.. (one per adapter).

use super::blocks::{self, Adapters, Builder, Mode, TrainedPair};
use super::kv::KvLayout;
use crate::gguf::Gguf;
use crate::graph::{Graph, GraphError, Mask};
use crate::kernels::reference::Yarn;
use crate::model::lora::Adapter;
use crate::model::{HParams, ModelError};
use crate::tensor::TensorId;

/// Index of the model file in the executor's buffer table.
pub const MODEL_BUFFER: u8 = 0;

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

/// Builds the forward pass for `n_tokens` tokens, with logits for `n_outputs` of them: all
/// (`n_outputs == n_tokens`, perplexity), or the ones the output-rows input names (generation:
/// the last token of each sequence), which skips the output matmul for the others. Each token
/// takes its position and sequence from the places input. The model must have passed
/// `validate_tensors`.
///
/// Every layer is a pre-norm residual block: a mixer (attention, a short convolution or the
/// gated delta rule), then a feed-forward block (dense or experts), each with the norms and
/// scales the architecture's facts name.
pub fn build<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[Adapter<'_>],
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
    let x = layers(&mut b)?;
    let logits = blocks::output_head(&mut b, x, n_outputs)?;
    b.check_adapters()?;
    let ids = b.ids;
    b.g.build(&[logits])?;
    Ok(Forward { ids, logits, n_tokens, n_outputs })
}

/// The forward pass of a training window: one sequence of `n_tokens` tokens at positions
/// 0..n_tokens, its ids at `ids_offset` of the persistent region, no cache (attention written out
/// in ops with gradient rules), logits for every token, and each matmul's weight adapted by the
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
                let mask =
                    if hp.is_sliding(il) { Mask::SlidingWindow(hp.sliding_window) } else { Mask::Causal };
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
