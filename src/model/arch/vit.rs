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
use crate::op::{Mask, RopeMode};
use crate::quant::GgmlType;
use crate::tensor::{Storage, TensorId};
use core::fmt::Write;

/// Where a vision graph's inputs are in the arena's persistent region (byte offsets; the ViT's
/// rows are the patches in [`patch_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionInputs {
    /// F32 `[3 p², n_patches]`: the unfolded patches.
    pub patches_offset: usize,
    /// I32 `[n_patches]`: each patch's index in the position embedding (learned positions); or
    /// I32 `[2, n_patches]` twice, each row's (0, patch row) then (0, patch column) (2-D RoPE).
    pub positions_offset: usize,
    /// I32 `[2, n_patches]` twice: each row's span of keys (first row, rows), the whole image,
    /// then its window (window attention).
    pub spans_offset: usize,
    /// I32 `[n_tokens]`: for each merged token in raster order, its row in the merger's output
    /// (window attention reorders them).
    pub restore_offset: usize,
    /// F32 `[table, n_patches]`: per patch, the weight of each learned position in its resized
    /// one ([`resized_position_weights`]; positions resized to the grid only).
    pub pos_weights_offset: usize,
}

impl VisionInputs {
    /// The inputs of an image of `n` patches of `patch_len` values, its positions resized
    /// from a table of `table` (0: not resized), one after another from offset 0, each aligned
    /// to `align`; and the bytes they take (`None`: too many).
    pub fn packed(n: usize, patch_len: usize, table: usize, align: usize) -> Option<(Self, usize)> {
        let at = |values: usize| values.checked_mul(4)?.checked_next_multiple_of(align.max(1));
        let patches_offset = 0;
        let positions_offset = at(n.checked_mul(patch_len)?)?;
        let spans_offset = positions_offset.checked_add(at(n.checked_mul(4)?)?)?;
        let restore_offset = spans_offset.checked_add(at(n.checked_mul(4)?)?)?;
        let pos_weights_offset = restore_offset.checked_add(at(n)?)?;
        let end = pos_weights_offset.checked_add(at(n.checked_mul(table)?)?)?;
        Some((
            Self { patches_offset, positions_offset, spans_offset, restore_offset, pos_weights_offset },
            end,
        ))
    }
}

/// The side of a square table of learned positions of `rows` rows (`None`: not a square).
pub fn position_table_side(rows: usize) -> Option<usize> {
    let side = libm::sqrt(rows as f64) as usize;
    (0..=1).map(|d| side + d).find(|s| s.checked_mul(*s) == Some(rows)).filter(|&s| s > 0)
}

/// The weights that resize a `side` x `side` grid of learned positions to `gx` x `gy` patches
/// as ggml's bilinear interpolation with antialiasing does it (`ggml_interpolate`, clip's
/// `resize_position_embeddings`; PyTorch's `antialias=True`): for each patch (raster order) a
/// row of `side²` weights, the triangle filter's over the source positions, widened by the
/// scale when shrinking, normalised to sum 1. f32 as ggml computes them; the graph multiplies
/// the table by them (`out` holds `side² * gx * gy` values).
pub fn resized_position_weights(side: usize, gx: usize, gy: usize, out: &mut [f32]) {
    let table = side * side;
    out[..table * gx * gy].fill(0.0);
    let axis = |n_out: usize, i: usize| {
        let scale = n_out as f32 / side as f32;
        let support = (1.0 / scale).max(1.0);
        let center = (i as f32 + 0.5) / scale;
        // (Float to integer truncates, as C++'s conversion.)
        let first = ((center - support + 0.5) as i64).max(0) as usize;
        let end = ((center + support + 0.5) as i64).min(side as i64).max(0) as usize;
        (first, end, center, 1.0 / support)
    };
    let triangle = |x: f32| (1.0 - x.abs()).max(0.0);
    for py in 0..gy {
        let (y0, y1, cy, iy) = axis(gy, py);
        for px in 0..gx {
            let (x0, x1, cx, ix) = axis(gx, px);
            let row = &mut out[(py * gx + px) * table..][..table];
            let mut total = 0f32;
            for sy in y0..y1 {
                let wy = triangle((sy as f32 - cy + 0.5) * iy);
                for sx in x0..x1 {
                    let w = triangle((sx as f32 - cx + 0.5) * ix) * wy;
                    if w > 0.0 {
                        row[sy * side + sx] = w;
                        total += w;
                    }
                }
            }
            if total > 0.0 {
                for w in row.iter_mut() {
                    *w /= total;
                }
            }
        }
    }
}

/// A patch's place in the ViT's rows: `row` holds patch (`x`, `y`) of the grid, and its
/// window's keys are rows `window.0..window.0 + window.1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchSlot {
    /// The ViT's row.
    pub row: usize,
    /// The patch's column.
    pub x: usize,
    /// The patch's row.
    pub y: usize,
    /// First row and rows of its attention window (the whole image without windows).
    pub window: (usize, usize),
}

impl VisionForward {
    /// [`patch_order`] of the graph's grid.
    pub fn patch_order(&self, vp: &VisionParams, f: impl FnMut(PatchSlot)) {
        patch_order(vp, self.grid.0, self.grid.1, f);
    }
}

/// Visits the patches of a `gx` x `gy` grid in the order the ViT holds them: raster order, but
/// for a spatial merge (Qwen2-VL) each `s` x `s` square of patches contiguous (the squares in
/// raster order, the patches within each too), and for window attention (Qwen2.5-VL) the
/// squares of each window contiguous (windows in raster order, clip's `window_idx`). Merging
/// and the per-patch steps are unchanged by the order, so clip's reorderings of the patch
/// vectors happen here, on the input, instead.
pub fn patch_order(vp: &VisionParams, gx: usize, gy: usize, mut f: impl FnMut(PatchSlot)) {
    let traits = vp.traits();
    let s = if traits.merge == Merge::SpatialMlp { vp.n_merge as usize } else { 1 };
    let (mx, my) = (gx / s, gy / s);
    let merged_patch = vp.patch_size as usize * s;
    let win = if vp.n_wa_pattern > 0 { vp.window_size as usize / merged_patch } else { mx.max(my) };
    let win = win.max(1);
    let mut row = 0;
    for wy in (0..my).step_by(win) {
        for wx in (0..mx).step_by(win) {
            let (wh, ww) = (win.min(my - wy), win.min(mx - wx));
            let window = (row, wh * ww * s * s);
            for ty in wy..wy + wh {
                for tx in wx..wx + ww {
                    for sy in 0..s {
                        for sx in 0..s {
                            f(PatchSlot { row, x: tx * s + sx, y: ty * s + sy, window });
                            row += 1;
                        }
                    }
                }
            }
        }
    }
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
        PatchPositions::LearnedResized => {
            // The table times each patch's weights: the table resized to the grid.
            let table = w(g, format_args!("v.position_embd.weight"))?;
            let rows = g.tensor(table).ne[1];
            if position_table_side(rows).is_none() {
                return Err(invalid("a square table of learned positions"));
            }
            let weights = g.leaf(
                "inp_pos_weights",
                GgmlType::F32,
                [rows, n, 1, 1],
                Storage::Persistent { offset: inputs.pos_weights_offset },
            )?;
            let resized = g.mul_mat_t(table, weights)?;
            g.set_name(resized, format_args!("pos_embd"));
            x = g.add(x, resized)?;
        }
        PatchPositions::Rope2d => {}
    }
    let i32_leaf = |g: &mut Graph<N>, label: &str, ne: [usize; 4], offset: usize| {
        g.leaf(label, GgmlType::I32, ne, Storage::Persistent { offset })
    };
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
    let spans = i32_leaf(g, "inp_spans", [2, n, 1, 1], inputs.spans_offset)?;
    let window_spans = match vp.n_wa_pattern {
        0 => None,
        _ => Some(i32_leaf(g, "inp_window_spans", [2, n, 1, 1], inputs.spans_offset + 8 * n)?),
    };
    let (n_head, hd) = (vp.n_head as usize, vp.head_dim() as usize);
    let scale = 1.0 / libm::sqrtf(hd as f32);
    let mut angles = None;
    for il in 0..vp.n_layer as usize {
        let cur = norm(g, x, format_args!("v.blk.{il}.ln1"))?;
        let q = linear(g, cur, il, "attn_q")?;
        let k = linear(g, cur, il, "attn_k")?;
        let v = linear(g, cur, il, "attn_v")?;
        let (mut q, mut k, v) = (
            g.reshape(q, [hd, n_head, n, 1])?,
            g.reshape(k, [hd, n_head, n, 1])?,
            g.reshape(v, [hd, n_head, n, 1])?,
        );
        if traits.positions == PatchPositions::Rope2d {
            let table = match angles {
                Some(t) => t,
                None => {
                    let t = rope_2d_table(g, q, hd, n, inputs.positions_offset)?;
                    angles = Some(t);
                    t
                }
            };
            q = g.rope_by(q, table, RopeMode::Neox)?;
            k = g.rope_by(k, table, RopeMode::Neox)?;
        }
        // Heads outermost: [hd, n, n_head].
        let (q, k, v) =
            (g.permute(q, [0, 2, 1, 3])?, g.permute(k, [0, 2, 1, 3])?, g.permute(v, [0, 2, 1, 3])?);
        let attn = g.flash_attn(q, k, v, scale, Mask::OneInput)?;
        // Qwen2.5-VL: every n_wa_pattern-th layer over the whole image, the others in windows.
        let windowed = window_spans.filter(|_| (il + 1) % vp.n_wa_pattern.max(1) as usize != 0);
        g.at_positions(attn, windowed.unwrap_or(spans))?;
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
            (VisionFfn::GeluQuick, false) => {
                // x * sigmoid(1.702 x), as ggml's gelu_quick.
                let z = g.scale(up, 1.702)?;
                let z = g.sigmoid(z)?;
                g.mul(up, z)?
            }
            (VisionFfn::GeluQuick, true) | (VisionFfn::Gelu, true) => {
                return Err(invalid("gated GELU ViT FFNs are not built yet"));
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
        Merge::SpatialMlp => {
            // patch_order made each s x s square contiguous: one vector of e s² per token.
            if gx % s != 0 || gy % s != 0 {
                return Err(invalid("a spatial merge of whole squares of patches"));
            }
            let m = n / (s * s);
            let t = g.reshape(x, [e * s * s, m, 1, 1])?;
            let mut t = mlp(g, gguf, t, "mm.0", "mm.2")?;
            if vp.n_wa_pattern > 0 {
                // Back from window order to raster order.
                let restore = i32_leaf(g, "inp_restore", [m, 1, 1, 1], inputs.restore_offset)?;
                t = g.get_rows(t, restore)?;
            }
            (t, m)
        }
        Merge::ShuffleMlp => {
            let (mut t, m) = pixel_shuffle(g, x, e, gx, gy, s)?;
            // An optional LayerNorm (PyTorch's default epsilon, as clip), then the MLP.
            if let Some(wt) = opt(g, format_args!("mm.input_norm.weight"))? {
                t = g.layer_norm(t, 1e-5)?;
                t = g.mul(t, wt)?;
            }
            if let Some(b) = opt(g, format_args!("mm.input_norm.bias"))? {
                t = g.add(t, b)?;
            }
            (mlp(g, gguf, t, "mm.1", "mm.2")?, m)
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

/// clip's pixel shuffle (`build_patch_merge_permute`): the `[e, gx, gy]` grid of patch vectors,
/// padded with zero vectors on the right and bottom to whole squares, becomes
/// `ceil(gx / s) * ceil(gy / s)` vectors of `e s²`, each an `s` x `s` square of patches, the
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
    if s < 2 {
        return Err(invalid("a pixel shuffle of at least 2 x 2 patches"));
    }
    let mut x = g.reshape(x, [e, gx, gy, 1])?;
    let (px, py) = (gx.next_multiple_of(s) - gx, gy.next_multiple_of(s) - gy);
    if px > 0 {
        let zeros = g.fill("shuffle_pad_x", [e, px, gy, 1], 0.0)?;
        x = g.concat(x, zeros, 1)?;
    }
    if py > 0 {
        let zeros = g.fill("shuffle_pad_y", [e, gx + px, py, 1], 0.0)?;
        x = g.concat(x, zeros, 2)?;
    }
    let (gx, gy) = (gx + px, gy + py);
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

/// `second(gelu(first(x)))`, each a matmul and its optional bias (clip's `build_ffn` with GELU).
fn mlp<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    x: TensorId,
    first: &str,
    second: &str,
) -> Result<TensorId, ModelError> {
    let mut t = x;
    for (i, layer) in [first, second].into_iter().enumerate() {
        let wt = required(g, gguf, &name(format_args!("{layer}.weight")))?;
        t = g.mul_mat(wt, t)?;
        if let Some(b) = weight_leaf(g, gguf, &name(format_args!("{layer}.bias")))? {
            t = g.add(t, b)?;
        }
        if i == 0 {
            t = g.gelu(t)?;
        }
    }
    Ok(t)
}

/// The angles of ggml's vision RoPE (`ggml_rope_multi`, `GGML_ROPE_TYPE_VISION`, sections of a
/// quarter head each) for `[hd, n_head, n]` heads like `like`: pairs `(i, i + hd / 2)`, the
/// first `hd / 4` turned by the patch's row, the next `hd / 4` by its column, each quarter's
/// frequencies starting again at base 10000 (ggml resets them per section, in vision mode).
/// That is two ordinary tables of `hd / 2` dimensions, one per axis (positions from the inputs
/// at `offset`), their cosines and sines interleaved: `[cos_y, cos_x, sin_y, sin_x]` per row.
fn rope_2d_table<const N: usize>(
    g: &mut Graph<N>,
    like: TensorId,
    hd: usize,
    n: usize,
    offset: usize,
) -> Result<TensorId, ModelError> {
    if hd % 4 != 0 {
        return Err(invalid("2-D RoPE needs heads of a multiple of 4"));
    }
    let mut halves = [like; 2];
    for (axis, half) in halves.iter_mut().enumerate() {
        let places = g.leaf(
            if axis == 0 { "inp_pos_rows" } else { "inp_pos_cols" },
            GgmlType::I32,
            [2, n, 1, 1],
            Storage::Persistent { offset: offset + axis * 8 * n },
        )?;
        let t = g.rope_table(like, hd / 2, 10000.0, 1.0, None, 1.0, None)?;
        g.at_positions(t, places)?;
        *half = g.reshape(t, [hd / 4, 2, n, 1])?;
    }
    let joined = g.concat(halves[0], halves[1], 0)?;
    Ok(g.reshape(joined, [hd, n, 1, 1])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resized_positions_keep_the_grid_of_the_table_and_average_elsewhere() {
        let mut w = [0f32; 16 * 16];
        resized_position_weights(4, 4, 4, &mut w);
        for (j, row) in w.chunks(16).enumerate() {
            assert!(row.iter().enumerate().all(|(i, &v)| v == if i == j { 1.0 } else { 0.0 }), "{row:?}");
        }
        // Shrunk to 2 x 1: the triangle filter widened to 2 columns and 4 rows, mirrored.
        let mut w = [0f32; 16 * 2];
        resized_position_weights(4, 2, 1, &mut w);
        let (left, right) = w.split_at(16);
        for y in 0..4 {
            for x in 0..4 {
                assert_eq!(left[y * 4 + x], right[y * 4 + 3 - x]);
            }
        }
        assert!((left.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(left[3], 0.0, "beyond the widened filter");
        assert!(left[0] == left[1] && left[1] > left[2], "{left:?}");
        assert_eq!(position_table_side(256), Some(16));
        assert_eq!(position_table_side(255), None);
    }
}
