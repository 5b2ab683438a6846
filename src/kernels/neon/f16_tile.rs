//! The register tile of the matmul on f16 weights: up to 4 weight rows times up to 6 widened
//! tokens, every one of the 24 dots bit for bit [`super::dot_f16`]'s.
//!
//! That dot sums 4 chunks of 8 lanes, held as 8 registers of 4 lanes (elements
//! `32 run + 4 h + lane` into register `h`), each its own chain of sums. The tile runs the 8
//! quarter-chunks one after another: 24 accumulators, 4 widened weight vectors and one token
//! vector of the 32 registers, each step 4 conversions and 6 loads for 24 multiply-adds (the
//! single-token dot widens both operands for each one). Long rows go in segments whose weights
//! and tokens stay in L1 across the 8 passes; the partial sums wait on the stack.

use core::arch::aarch64::*;
use core::arch::asm;

use super::elementwise::fold_lanes;
use crate::kernels::{F16_TILE_ROWS, F16_TILE_TOKENS};
use crate::quant::blocks::F16Le;

/// Weight rows and tokens of one NEON tile.
pub const F16_TILE_NEON: (usize, usize) = (4, 6);

/// Runs of 32 per segment: 4 weight rows (4 KiB) and 6 tokens (12 KiB) stay in L1.
const SEGMENT_RUNS: usize = 16;

/// `out[r][j]` = the dot of weight row `ws[r]` and widened token `xs[j]` (bit for bit
/// `dot_f16(ws[r], x_j)`). The rows are of one length; each token holds at least that length
/// rounded up to 32 values, zero after it (`crate::kernels::dot::widen_f16_padded`).
pub fn dot_f16_tile(ws: &[&[F16Le]], xs: &[&[f32]], out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS]) {
    let n = ws.first().map_or(0, |w| w.len());
    let padded = n.next_multiple_of(32);
    assert!(
        ws.len() <= F16_TILE_NEON.0
            && xs.len() <= F16_TILE_NEON.1
            && ws.iter().all(|w| w.len() == n)
            && xs.iter().all(|x| x.len() >= padded)
    );
    // SAFETY: NEON is part of the aarch64 baseline; the lengths are checked above.
    unsafe {
        match ws.len() {
            1 => by_tokens::<1>(ws, xs, out),
            2 => by_tokens::<2>(ws, xs, out),
            3 => by_tokens::<3>(ws, xs, out),
            4 => by_tokens::<4>(ws, xs, out),
            _ => {}
        }
    }
}

/// # Safety
/// As [`dot_f16_tile`]'s checks, with `R` weight rows.
unsafe fn by_tokens<const R: usize>(
    ws: &[&[F16Le]],
    xs: &[&[f32]],
    out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS],
) {
    // SAFETY: the caller's.
    unsafe {
        match xs.len() {
            1 => tile::<R, 1>(ws, xs, out),
            2 => tile::<R, 2>(ws, xs, out),
            3 => tile::<R, 3>(ws, xs, out),
            4 => tile::<R, 4>(ws, xs, out),
            5 => tile::<R, 5>(ws, xs, out),
            6 => tile::<R, 6>(ws, xs, out),
            _ => {}
        }
    }
}

/// # Safety
/// `R` rows of one length `n`, `T` tokens of at least `n` rounded up to 32 values.
#[target_feature(enable = "neon")]
unsafe fn tile<const R: usize, const T: usize>(
    ws: &[&[F16Le]],
    xs: &[&[f32]],
    out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS],
) {
    let n = ws[0].len();
    let (whole, runs) = (n / 32, n.div_ceil(32));
    // Each row's last, partial run zero-padded (the tokens are padded by the caller).
    let mut tail = [[F16Le::from_bits(0); 32]; R];
    for (t, w) in tail.iter_mut().zip(ws) {
        t[..n - 32 * whole].copy_from_slice(&w[32 * whole..]);
    }
    let w: [*const F16Le; R] = core::array::from_fn(|r| ws[r].as_ptr());
    let tail_w: [*const F16Le; R] = core::array::from_fn(|r| tail[r].as_ptr());
    let x: [*const f32; T] = core::array::from_fn(|j| xs[j].as_ptr());
    // -0.0 + p is p for every p (also -0.0): the first run's sum is its product, as the dot's.
    let mut sums = [[[vdupq_n_f32(-0.0); T]; R]; 8];
    let mut seg = 0;
    while seg < runs {
        let end = (seg + SEGMENT_RUNS).min(runs);
        for (h, sums) in sums.iter_mut().enumerate() {
            let mut acc = *sums;
            for run in seg..end.min(whole) {
                let at = 32 * run + 4 * h;
                // SAFETY: a whole run of every row; the tokens hold `at + 4` values.
                unsafe { step(&w.map(|p| p.wrapping_add(at)), &x, at, &mut acc) };
            }
            if end > whole {
                let at = 32 * whole + 4 * h;
                // SAFETY: quarter h of the padded tails; the tokens are padded past `at + 4`.
                unsafe { step(&tail_w.map(|p| p.wrapping_add(4 * h)), &x, at, &mut acc) };
            }
            *sums = acc;
        }
        seg = end;
    }
    for r in 0..R {
        for j in 0..T {
            out[r][j] = fold_lanes(&core::array::from_fn(|h| sums[h][r][j]));
        }
    }
}

/// 4 weights at each `w[r]` times 4 values at `at` of each token, into the tile's accumulators.
/// Exact products (11-bit significands): the fused form rounds as the twin's product then sum.
///
/// # Safety
/// 4 readable weights at each `w[r]`, 4 readable values at `at` of each token.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn step<const R: usize, const T: usize>(
    w: &[*const F16Le; R],
    x: &[*const f32; T],
    at: usize,
    acc: &mut [[float32x4_t; T]; R],
) {
    let mut vw = [vdupq_n_f32(0.0); R];
    for (v, &p) in vw.iter_mut().zip(w) {
        // SAFETY: the caller's.
        *v = unsafe { widen_f16x4(p) };
    }
    for j in 0..T {
        // SAFETY: the caller's.
        let vx = unsafe { vld1q_f32(x[j].add(at)) };
        for r in 0..R {
            acc[r][j] = vfmaq_f32(acc[r][j], vw[r], vx);
        }
    }
}

/// 4 f16 values at `p` widened to f32. (`fcvtl` in assembly: the intrinsics taking f16 vectors
/// are not stable.)
///
/// # Safety
/// `p` points at 4 readable values.
#[inline(always)]
unsafe fn widen_f16x4(p: *const F16Le) -> float32x4_t {
    let v: float32x4_t;
    // SAFETY: reads 8 bytes at `p` (the caller's contract); writes only the declared register.
    unsafe {
        asm!(
            "ldr {v:d}, [{p}]",
            "fcvtl {v:v}.4s, {v:v}.4h",
            p = in(reg) p,
            v = out(vreg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}
