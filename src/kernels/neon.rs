//! aarch64 NEON kernels (with and without `sdot`), twins of `packed` and `reference`.
//!
//! Placeholder bodies forward to the reference until the NEON versions land.

use core::ops::Range;

use super::packed::{matmul_ref, quantize_act_ref, ActBlock, PackedMatrix};
use super::reference::{flash_attn_row_ref, rms_norm_ref, swiglu_ref};
use crate::quant::blocks::F16Le;

/// Packed matmul without the dot-product extension (`smull`/`sadalp`).
pub fn matmul(w: &PackedMatrix<'_>, groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]) {
    matmul_ref(w, groups, acts, outs)
}

/// Packed matmul with `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
pub unsafe fn matmul_dotprod(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    matmul_ref(w, groups, acts, outs)
}

/// Activation quantization.
pub fn quantize_act(x: &[f32], out: &mut [ActBlock]) {
    quantize_act_ref(x, out)
}

/// RMS norm.
pub fn rms_norm(x: &[f32], out: &mut [f32], eps: f32) {
    rms_norm_ref(x, out, eps)
}

/// `silu(gate) * up`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_ref(gate, up, out)
}

/// One query row of flash attention over an f16 KV cache.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    flash_attn_row_ref(q, q16, keys, key, value, scale, acc16, out)
}
