//! The encoder's f16 GEMM panel ([`crate::kernels::f16_gemm`]) in 8-lane vectors: 2 vectors of
//! tokens x 6 broadcast weight rows, 12 accumulators.

use super::flash_attn::Ymm;
use crate::kernels::f16_gemm::{panel, GemmTile, GEMM_TOKENS};
use crate::quant::blocks::F16Le;

/// [`crate::kernels::f16_gemm_panel`] on AVX2.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_gemm_panel_avx2(
    ws: &[&[F16Le]],
    xt: &[f32],
    kc: usize,
    wp: &mut [f32],
    acc: &mut [GemmTile],
) {
    panel::<Ymm, { GEMM_TOKENS / 8 }>(ws, xt, kc, wp, acc)
}
