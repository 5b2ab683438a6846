//! The forward pass of a vision projector (llama.cpp's clip graphs): the image's patches, each
//! unfolded to `3 p²` values (channel, row, column: the order of the patch convolution's taps),
//! times the patch embedding; the learned position of each patch; per layer (pre-norm) attention
//! of every patch over every patch and an FFN, each with a residual; the post-norm; then the
//! family's merge ([`Merge`]) into the language model's embeddings.

use super::blocks::{required, weight_leaf};
use crate::gguf::{name_of, Gguf};
use crate::graph::{Graph, GraphError};
use crate::model::vision::{Merge, PatchPositions, VisionFfn, VisionNorm, VisionParams};
use crate::model::ModelError;
use crate::op::Mask;
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};
use core::fmt::Write;

/// Where a vision graph's inputs are in the arena's persistent region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionInputs {
    /// F32 `[3 p², n_patches]`: the unfolded patches.
    pub patches_offset: usize,
    /// I32 `[n_patches]`: each patch's index in the position embedding.
    pub positions_offset: usize,
    /// I32 `[2, n_patches]`: each patch's span of keys (first row, rows): the whole image.
    pub spans_offset: usize,
}

/// The inputs and output of a built vision graph.
#[derive(Debug, Clone, Copy)]
pub struct VisionForward {
    /// F32 `[n_embd_out, n_tokens]`: the embeddings for the language model.
    pub embeddings: TensorId,
    /// Patches per row and per column of the input image.
    pub grid: (usize, usize),
    /// Embeddings it gives.
    pub n_tokens: usize,
}

fn invalid(problem: &'static str) -> ModelError {
    ModelError::Graph(GraphError::Invalid { op: "vision", name: heapless::String::new(), problem })
}

fn name(args: core::fmt::Arguments<'_>) -> heapless::String<64> {
    let mut n = heapless::String::new();
    let _ = n.write_fmt(args);
    n
}

/// Builds the projector's graph for an input image of `width` x `height` pixels (multiples of
/// the patch size).
pub fn build_vision<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    vp: &VisionParams,
    inputs: VisionInputs,
    width: usize,
    height: usize,
) -> Result<VisionForward, ModelError> {
    g.clear();
    let traits = vp.traits();
    let p = vp.patch_size as usize;
    if width == 0 || height == 0 || width % p != 0 || height % p != 0 {
        return Err(invalid("an image of whole patches"));
    }
    let (gx, gy) = (width / p, height / p);
    let n = gx * gy;
    let e = vp.n_embd as usize;
    let eps = vp.eps;
    let w = |g: &mut Graph<N>, args: core::fmt::Arguments<'_>| required(g, gguf, &name(args));
    let opt = |g: &mut Graph<N>, args: core::fmt::Arguments<'_>| weight_leaf(g, gguf, &name(args));

    let patches = g.leaf(
        "inp_patches",
        GgmlType::F32,
        [3 * p * p, n, 1, 1],
        Storage::Persistent { offset: inputs.patches_offset },
    )?;
    // The patch convolution as a matrix: a row of 3 p² taps per output channel.
    let conv = |g: &mut Graph<N>, tensor: &str| -> Result<TensorId, ModelError> {
        let k = required(g, gguf, tensor)?;
        Ok(g.reshape(k, [3 * p * p, e, 1, 1])?)
    };
    let k0 = conv(g, "v.patch_embd.weight")?;
    let mut x = g.mul_mat(k0, patches)?;
    if traits.two_patch_convs {
        let k1 = conv(g, "v.patch_embd.weight.1")?;
        let x1 = g.mul_mat(k1, patches)?;
        x = g.add(x, x1)?;
    }
    if let Some(bias) = opt(g, format_args!("v.patch_embd.bias"))? {
        x = g.add(x, bias)?;
    }
    g.set_name(x, format_args!("inp_embd"));
    match traits.positions {
        PatchPositions::Learned => {
            if gx * gy != vp.patches_per_side() as usize * vp.patches_per_side() as usize {
                return Err(invalid("learned positions for another grid"));
            }
            let table = w(g, format_args!("v.position_embd.weight"))?;
            let positions = g.leaf(
                "inp_positions",
                GgmlType::I32,
                [n, 1, 1, 1],
                Storage::Persistent { offset: inputs.positions_offset },
            )?;
            let rows = g.get_rows(table, positions)?;
            x = g.add(x, rows)?;
        }
        PatchPositions::LearnedResized | PatchPositions::Rope2d => {
            return Err(invalid("this projector family's patch positions are not built yet"));
        }
    }
    let norm =
        |g: &mut Graph<N>, x: TensorId, prefix: core::fmt::Arguments<'_>| -> Result<TensorId, ModelError> {
            let base = name(prefix);
            let wt = required(g, gguf, &name(format_args!("{base}.weight")))?;
            let y = match traits.norm {
                VisionNorm::Layer => g.layer_norm(x, eps)?,
                VisionNorm::Rms => g.rms_norm(x, eps)?,
            };
            let y = g.mul(y, wt)?;
            Ok(match weight_leaf(g, gguf, &name(format_args!("{base}.bias")))? {
                Some(b) => g.add(y, b)?,
                None => y,
            })
        };
    let linear = |g: &mut Graph<N>, x: TensorId, il: usize, m: &str| -> Result<TensorId, ModelError> {
        let wt = required(g, gguf, &name(format_args!("v.blk.{il}.{m}.weight")))?;
        let y = g.mul_mat(wt, x)?;
        Ok(match weight_leaf(g, gguf, &name(format_args!("v.blk.{il}.{m}.bias")))? {
            Some(b) => g.add(y, b)?,
            None => y,
        })
    };
    if gguf.tensor("v.pre_ln.weight").is_some() {
        x = norm(g, x, format_args!("v.pre_ln"))?;
    }
    let spans = g.leaf(
        "inp_spans",
        GgmlType::I32,
        [2, n, 1, 1],
        Storage::Persistent { offset: inputs.spans_offset },
    )?;
    let (n_head, hd) = (vp.n_head as usize, vp.head_dim() as usize);
    let scale = 1.0 / libm::sqrtf(hd as f32);
    for il in 0..vp.n_layer as usize {
        let cur = norm(g, x, format_args!("v.blk.{il}.ln1"))?;
        let q = linear(g, cur, il, "attn_q")?;
        let k = linear(g, cur, il, "attn_k")?;
        let v = linear(g, cur, il, "attn_v")?;
        // Heads outermost: [hd, n, n_head].
        let heads = |g: &mut Graph<N>, t: TensorId| -> Result<TensorId, ModelError> {
            let t = g.reshape(t, [hd, n_head, n, 1])?;
            Ok(g.permute(t, [0, 2, 1, 3])?)
        };
        let (q, k, v) = (heads(g, q)?, heads(g, k)?, heads(g, v)?);
        let attn = g.flash_attn(q, k, v, scale, Mask::Bidirectional)?;
        g.at_positions(attn, spans)?;
        g.set_name(attn, format_args!("kqv_out-{il}"));
        let attn = g.reshape(attn, [hd * n_head, n, 1, 1])?;
        let o = linear(g, attn, il, "attn_out")?;
        x = g.add(o, x)?;
        g.set_name(x, format_args!("ffn_inp-{il}"));
        let cur = norm(g, x, format_args!("v.blk.{il}.ln2"))?;
        let up = linear(g, cur, il, "ffn_up")?;
        let act = match (vp.ffn, gguf.tensor(&name(format_args!("v.blk.{il}.ffn_gate.weight"))).is_some()) {
            (VisionFfn::Gelu, false) => g.gelu(up)?,
            (VisionFfn::Silu, true) => {
                let gate = linear(g, cur, il, "ffn_gate")?;
                g.swiglu(gate, up)?
            }
            (VisionFfn::Silu, false) => g.silu(up)?,
            (VisionFfn::GeluQuick, _) | (VisionFfn::Gelu, true) => {
                return Err(invalid("GELU-quick and gated GELU ViT FFNs are not built yet"));
            }
        };
        let down = linear(g, act, il, "ffn_down")?;
        x = g.add(x, down)?;
        g.set_name(x, format_args!("layer_out-{il}"));
    }
    if gguf.tensor("v.post_ln.weight").is_some() {
        x = norm(g, x, format_args!("v.post_ln"))?;
    }
    let s = vp.n_merge as usize;
    let (out, n_tokens) = match traits.merge {
        Merge::PoolNormProject => {
            // [e, gx, gy] averaged over s x s squares, RMSNormed, scaled, projected (the file
            // keeps the projection as [n_embd_out, e]: its transpose multiplies).
            let grid = g.reshape(x, [e, gx, gy, 1])?;
            let pooled = g.pool_2d_avg(grid, s)?;
            let m = (gx / s) * (gy / s);
            let pooled = g.reshape(pooled, [e, m, 1, 1])?;
            let normed = g.rms_norm(pooled, eps)?;
            let soft = w(g, format_args!("mm.soft_emb_norm.weight"))?;
            let normed = g.mul(normed, soft)?;
            let proj = w(g, format_args!("mm.input_projection.weight"))?;
            (g.mul_mat_t(proj, normed)?, m)
        }
        Merge::ShuffleLinear => {
            let (shuffled, m) = pixel_shuffle(g, x, e, gx, gy, s)?;
            let fc = w(g, format_args!("mm.model.fc.weight"))?;
            (g.mul_mat(fc, shuffled)?, m)
        }
        Merge::ShuffleMlp | Merge::SpatialMlp => {
            return Err(invalid("this projector family's merge is not built yet"));
        }
    };
    g.set_name(out, format_args!("embeddings"));
    if g.tensor(out).ne[0] != vp.n_embd_out as usize {
        return Err(ModelError::TensorShape {
            name: name_of("embeddings"),
            expected: [u64::from(vp.n_embd_out), n_tokens as u64, 1, 1],
            found: [g.tensor(out).ne[0] as u64, n_tokens as u64, 1, 1],
        });
    }
    g.build(&[out])?;
    Ok(VisionForward { embeddings: out, grid: (gx, gy), n_tokens })
}

/// clip's pixel shuffle (`build_patch_merge_permute`): the `[e, gx, gy]` grid of patch vectors
/// becomes `(gx / s) * (gy / s)` vectors of `e s²`, each an `s` x `s` square of patches, the
/// squares in raster order. Within a vector, as clip orders it: the square's column outer, then
/// its row, then the `e` features. Returns the vectors and their count.
fn pixel_shuffle<const N: usize>(
    g: &mut Graph<N>,
    x: TensorId,
    e: usize,
    gx: usize,
    gy: usize,
    s: usize,
) -> Result<(TensorId, usize), ModelError> {
    if s < 2 || gx % s != 0 || gy % s != 0 {
        return Err(invalid("a pixel shuffle of whole squares of patches"));
    }
    // s patches of a row joined, then rows and columns of those swapped...
    let t = g.reshape(x, [e * s, gx / s, gy, 1])?;
    let t = g.permute(t, [0, 2, 1, 3])?;
    let t = g.cpy(t, GgmlType::F32)?;
    // ...so that s of them down a column join too, and the grid is swapped back.
    let t = g.reshape(t, [e * s * s, gy / s, gx / s, 1])?;
    let t = g.permute(t, [0, 2, 1, 3])?;
    let t = g.cpy(t, GgmlType::F32)?;
    let m = (gx / s) * (gy / s);
    Ok((g.reshape(t, [e * s * s, m, 1, 1])?, m))
}
