//! x86_64 AVX2 + FMA + F16C kernels, twins of `packed` and `reference`.
//!
//! Placeholder bodies forward to the reference until the AVX2 versions land.

use core::ops::Range;

use super::packed::{matmul_ref, quantize_act_ref, ActBlock, PackedMatrix};

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
