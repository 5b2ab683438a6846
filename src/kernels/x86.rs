//! x86_64 AVX2 + FMA + F16C kernels, twins of `packed` and `reference`.
//!
//! Placeholder bodies forward to the reference until the AVX2 versions land.

use core::ops::Range;

use super::packed::{matmul_ref, quantize_act_ref, ActBlock, PackedMatrix};
use super::reference::{flash_attn_row_ref, rms_norm_ref, swiglu_ref};
use crate::quant::blocks::F16Le;

/// Packed matmul.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn matmul_avx2(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    matmul_ref(w, groups, acts, outs)
}

/// Activation quantization.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn quantize_act_avx2(x: &[f32], out: &mut [ActBlock]) {
    quantize_act_ref(x, out)
}

/// RMS norm.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn rms_norm_avx2(x: &[f32], out: &mut [f32], eps: f32) {
    rms_norm_ref(x, out, eps)
}

/// `silu(gate) * up`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_ref(gate, up, out)
}

/// One query row of flash attention over an f16 KV cache.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_attn_row_avx2<'k>(
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
