//! Tiled attention for prompts (`kernels::attn_tile`): query rows in the 4 lanes.

use core::arch::aarch64::*;

use super::*;

// ---------------------------------------------------------------------------------------------
// Tiled attention for prompts (`kernels::attn_tile`): query rows in the 4 lanes.

use crate::kernels::attn_tile::{tile_loop, Lanes, TileScratch, Tiles};

/// 4 f32 lanes for [`tile_loop`] (NEON is part of the aarch64 baseline).
#[derive(Clone, Copy)]
pub(super) struct F32x4(float32x4_t);

impl Lanes for F32x4 {
    const N: usize = 4;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: NEON is part of the aarch64 baseline (every method); loads and stores touch
        // the first 4 floats of slices checked to hold them.
        Self(unsafe { vdupq_n_f32(x) })
    }
    #[inline(always)]
    fn load(x: &[f32]) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { ld_f32x4(x) })
    }
    #[inline(always)]
    fn store(self, x: &mut [f32]) {
        // SAFETY: see `splat`.
        unsafe { st_f32x4(x, self.0) }
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { vfmaq_f32(c.0, self.0, b.0) })
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { vmulq_f32(self.0, b.0) })
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { vaddq_f32(self.0, b.0) })
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { vsubq_f32(self.0, b.0) })
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { vmaxq_f32(self.0, b.0) })
    }
    #[inline(always)]
    fn exp(self) -> Self {
        // SAFETY: see `splat`.
        unsafe {
            let (y, exact) = expf4(self.0);
            if vminvq_u32(exact) != 0 {
                return Self(y);
            }
            let (mut x, mut lanes, mut ok) = ([0f32; 4], [0f32; 4], [0u32; 4]);
            vst1q_f32(x.as_mut_ptr(), self.0);
            vst1q_f32(lanes.as_mut_ptr(), y);
            vst1q_u32(ok.as_mut_ptr(), exact);
            for ((l, o), x) in lanes.iter_mut().zip(ok).zip(x) {
                if o == 0 {
                    *l = libm::expf(x);
                }
            }
            Self(vld1q_f32(lanes.as_ptr()))
        }
    }
    #[inline(always)]
    fn widen_f16(row: &[u8], out: &mut [f32]) {
        kv_widen_f16(row, out);
    }
}

/// [`crate::kernels::flash_attn_tile`] on NEON: [`tile_loop`] in 4-lane vectors.
pub fn attn_tile<'k>(
    t: &Tiles<'_>,
    qs: &[&[f32]],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scratch: &mut TileScratch,
    outs: &mut [&mut [f32]],
) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { attn_tile_neon(t, qs, key, value, scratch, outs) }
}

#[target_feature(enable = "neon")]
fn attn_tile_neon<'k>(
    t: &Tiles<'_>,
    qs: &[&[f32]],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scratch: &mut TileScratch,
    outs: &mut [&mut [f32]],
) {
    tile_loop::<F32x4>(t, qs, key, value, scratch, outs)
}
