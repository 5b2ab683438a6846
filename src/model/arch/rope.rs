//! Each layer's RoPE: the forward pass's blocks and the context shift (which re-rotates cached
//! keys) read it here.

use crate::kernels::reference::Yarn;
use crate::model::HParams;

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
