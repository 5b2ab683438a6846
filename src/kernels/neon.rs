//! aarch64 NEON kernels (with and without `sdot`), twins of `packed` and `reference`.
//!
//! Placeholder bodies forward to the reference until the NEON versions land.

use core::ops::Range;

use super::packed::{matmul_ref, quantize_act_ref, ActBlock, PackedMatrix};

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
