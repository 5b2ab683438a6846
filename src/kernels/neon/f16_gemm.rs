//! The encoder's f16 GEMM panel ([`crate::kernels::f16_gemm`]) in 4-lane vectors: 4 vectors of
//! tokens x 6 broadcast weight rows, 24 accumulators.

use super::attn_tile::F32x4;
use crate::kernels::f16_gemm::{panel, GemmTile, GEMM_TOKENS};
use crate::quant::blocks::F16Le;

/// [`crate::kernels::f16_gemm_panel`] on NEON.
pub fn f16_gemm_panel(ws: &[&[F16Le]], xt: &[f32], kc: usize, wp: &mut [f32], acc: &mut [GemmTile]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { f16_gemm_panel_neon(ws, xt, kc, wp, acc) }
}

#[target_feature(enable = "neon")]
fn f16_gemm_panel_neon(ws: &[&[F16Le]], xt: &[f32], kc: usize, wp: &mut [f32], acc: &mut [GemmTile]) {
    panel::<F32x4, { GEMM_TOKENS / 4 }>(ws, xt, kc, wp, acc)
}
