//! The register tile of the matmul on f16 weights: up to 3 weight rows times up to 4 widened
//! tokens, every one of the 12 dots bit for bit [`super::dot_f16_avx2`]'s.
//!
//! That dot sums 4 chunks of 8 lanes (elements `32 run + 8 c + lane` into accumulator `c`), which
//! would take 4 registers per dot. Each chunk's lanes are their own chain of sums, so the tile
//! runs the chunks one after another: 12 accumulators, 3 widened weight vectors and one token
//! vector fill the 16 registers, and each step is 3 conversions and 4 loads for 12 multiply-adds
//! (the single-token dot does one conversion per multiply-add). Long rows go in segments whose
//! weights and tokens stay in L1 across the 4 chunk passes; the chunk sums wait on the stack.

use core::arch::x86_64::*;

use crate::kernels::{F16_TILE_ROWS, F16_TILE_TOKENS};
use crate::quant::blocks::F16Le;

/// Weight rows and tokens of one AVX2 tile.
pub const F16_TILE_AVX2: (usize, usize) = (3, 4);

/// Runs of 32 per segment: 3 weight rows (3 KiB) and 4 tokens (8 KiB) stay in L1.
const SEGMENT_RUNS: usize = 16;

/// `out[r][j]` = the dot of weight row `ws[r]` and widened token `xs[j]` (bit for bit
/// `dot_f16_avx2(ws[r], x_j)`). The rows are of one length; each token holds at least that
/// length rounded up to 32 values, zero after it (`crate::kernels::dot::widen_f16_padded`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn dot_f16_tile_avx2(
    ws: &[&[F16Le]],
    xs: &[&[f32]],
    out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS],
) {
    let n = ws.first().map_or(0, |w| w.len());
    let padded = n.next_multiple_of(32);
    assert!(
        ws.len() <= F16_TILE_AVX2.0
            && xs.len() <= F16_TILE_AVX2.1
            && ws.iter().all(|w| w.len() == n)
            && xs.iter().all(|x| x.len() >= padded)
    );
    // SAFETY: the caller guarantees the CPU features; the lengths are checked above.
    unsafe {
        match ws.len() {
            1 => by_tokens::<1>(ws, xs, out),
            2 => by_tokens::<2>(ws, xs, out),
            3 => by_tokens::<3>(ws, xs, out),
            _ => {}
        }
    }
}

/// # Safety
/// As [`dot_f16_tile_avx2`], with `R` weight rows.
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
            _ => {}
        }
    }
}

/// # Safety
/// `R` rows of one length `n`, `T` tokens of at least `n` rounded up to 32 values; the CPU
/// features.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let mut sums = [[[_mm256_set1_ps(-0.0); T]; R]; 4];
    let mut seg = 0;
    while seg < runs {
        let end = (seg + SEGMENT_RUNS).min(runs);
        for (c, sums) in sums.iter_mut().enumerate() {
            let mut acc = *sums;
            for run in seg..end.min(whole) {
                let at = 32 * run + 8 * c;
                // SAFETY: a whole run of every row; the tokens hold `at + 8` values.
                unsafe { step(&w.map(|p| p.wrapping_add(at)), &x, at, &mut acc) };
            }
            if end > whole {
                let at = 32 * whole + 8 * c;
                // SAFETY: chunk c of the padded tails; the tokens are padded past `at + 8`.
                unsafe { step(&tail_w.map(|p| p.wrapping_add(8 * c)), &x, at, &mut acc) };
            }
            *sums = acc;
        }
        seg = end;
    }
    for r in 0..R {
        for j in 0..T {
            let v = _mm256_add_ps(
                _mm256_add_ps(sums[0][r][j], sums[2][r][j]),
                _mm256_add_ps(sums[1][r][j], sums[3][r][j]),
            );
            let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let mut lanes = [0f32; 4];
            // SAFETY: four f32 into a four-element array.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), t) };
            out[r][j] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        }
    }
}

/// 8 weights at each `w[r]` times 8 values at `at` of each token, into the tile's accumulators.
/// Exact products (11-bit significands): the fused form rounds as the twin's product then sum.
///
/// # Safety
/// 8 readable weights at each `w[r]`, 8 readable values at `at` of each token; the CPU features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn step<const R: usize, const T: usize>(
    w: &[*const F16Le; R],
    x: &[*const f32; T],
    at: usize,
    acc: &mut [[__m256; T]; R],
) {
    // SAFETY: the caller's.
    unsafe {
        let mut vw = [_mm256_setzero_ps(); R];
        for (v, &p) in vw.iter_mut().zip(w) {
            *v = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        }
        for j in 0..T {
            let vx = _mm256_loadu_ps(x[j].add(at));
            for r in 0..R {
                acc[r][j] = _mm256_fmadd_ps(vw[r], vx, acc[r][j]);
            }
        }
    }
}
