//! The register tile of the matmul on f16 weights: up to 12 weight rows (4 groups of 3) times up
//! to 4 widened tokens, every one of the 48 dots bit for bit [`super::dot_f16_avx2`]'s.
//!
//! That dot sums 4 chunks of 8 lanes (elements `32 run + 8 c + lane` into accumulator `c`), which
//! would take 4 registers per dot. Each chunk's lanes are their own chain of sums, so a group of 3
//! rows runs the chunks one after another: 12 accumulators, 3 widened weight vectors and one token
//! vector fill the 16 registers, and each step is 3 conversions and 4 loads for 12 multiply-adds
//! (the single-token dot does one conversion per multiply-add). Long rows go in segments: the
//! tokens' segment (8 KiB) is read from L2 once and stays in L1 while every group's 4 chunk
//! passes meet it, so the tokens cost a quarter of the traffic they would for one group (with one
//! group per call, the tokens' lines arrived at 32 bytes a cycle in the first and third passes:
//! the tile waited on L2). The chunk sums wait on the stack between segments.

use core::arch::x86_64::*;

use crate::kernels::{F16_TILE_ROWS, F16_TILE_TOKENS};
use crate::quant::blocks::F16Le;

/// Weight rows and tokens of one AVX2 tile.
pub const F16_TILE_AVX2: (usize, usize) = (12, 4);

/// Weight rows of a group: its accumulators and weight vectors fill the registers.
const GROUP_ROWS: usize = 3;
/// Groups of one tile.
const GROUPS: usize = F16_TILE_AVX2.0 / GROUP_ROWS;

/// Runs of 32 per segment: 4 tokens (8 KiB) and 12 weight rows (12 KiB) stay in L1.
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
        match xs.len() {
            1 => tile::<1>(ws, xs, out),
            2 => tile::<2>(ws, xs, out),
            3 => tile::<3>(ws, xs, out),
            4 => tile::<4>(ws, xs, out),
            _ => {}
        }
    }
}

/// One group's chunk sums: `[chunk][row][token]`.
type GroupSums<const T: usize> = [[[__m256; T]; GROUP_ROWS]; 4];

/// # Safety
/// Up to 12 rows of one length `n`, `T` tokens of at least `n` rounded up to 32 values; the CPU
/// features.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const T: usize>(
    ws: &[&[F16Le]],
    xs: &[&[f32]],
    out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS],
) {
    let (rows, n) = (ws.len(), ws.first().map_or(0, |w| w.len()));
    let (whole, runs) = (n / 32, n.div_ceil(32));
    // Each row's last, partial run zero-padded (the tokens are padded by the caller).
    let mut tail = [[F16Le::from_bits(0); 32]; F16_TILE_AVX2.0];
    for (t, w) in tail.iter_mut().zip(ws) {
        t[..n - 32 * whole].copy_from_slice(&w[32 * whole..]);
    }
    let x: [*const f32; T] = core::array::from_fn(|j| xs[j].as_ptr());
    let row = |r: usize| (ws[r.min(rows - 1)].as_ptr(), tail[r.min(rows - 1)].as_ptr());
    // -0.0 + p is p for every p (also -0.0): the first run's sum is its product, as the dot's.
    let mut sums: [GroupSums<T>; GROUPS] = [[[[_mm256_set1_ps(-0.0); T]; GROUP_ROWS]; 4]; GROUPS];
    let mut seg = 0;
    while seg < runs {
        let end = (seg + SEGMENT_RUNS).min(runs);
        for (g, sums) in sums.iter_mut().enumerate().take(rows.div_ceil(GROUP_ROWS)) {
            let r0 = GROUP_ROWS * g;
            let rows_here = (rows - r0).min(GROUP_ROWS);
            let (w, tail_w): ([*const F16Le; GROUP_ROWS], [*const F16Le; GROUP_ROWS]) =
                (core::array::from_fn(|r| row(r0 + r).0), core::array::from_fn(|r| row(r0 + r).1));
            let pass = Pass { w, tail_w, x, seg, end, whole };
            // SAFETY: the rows and tokens as `tile`'s caller guarantees them.
            unsafe {
                match rows_here {
                    1 => pass.run::<1>(sums),
                    2 => pass.run::<2>(sums),
                    _ => pass.run::<3>(sums),
                }
            }
        }
        seg = end;
    }
    for r in 0..rows {
        let (sums, r_in) = (&sums[r / GROUP_ROWS], r % GROUP_ROWS);
        for j in 0..T {
            let v = _mm256_add_ps(
                _mm256_add_ps(sums[0][r_in][j], sums[2][r_in][j]),
                _mm256_add_ps(sums[1][r_in][j], sums[3][r_in][j]),
            );
            let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let mut lanes = [0f32; 4];
            // SAFETY: four f32 into a four-element array.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), t) };
            out[r][j] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        }
    }
}

/// One segment of one group: its rows (and their padded tails), the tokens, the runs
/// `seg..end` of which the first `whole` are whole in the rows.
struct Pass<const T: usize> {
    w: [*const F16Le; GROUP_ROWS],
    tail_w: [*const F16Le; GROUP_ROWS],
    x: [*const f32; T],
    seg: usize,
    end: usize,
    whole: usize,
}

impl<const T: usize> Pass<T> {
    /// The segment's 4 chunk passes over the first `R` rows of the group, into `sums`.
    ///
    /// # Safety
    /// The rows hold `whole` whole runs, their tails the last partial one; the tokens hold every
    /// run up to `end`; the CPU features.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const R: usize>(&self, sums: &mut GroupSums<T>) {
        for (c, sums) in sums.iter_mut().enumerate() {
            let mut acc: [[__m256; T]; R] = core::array::from_fn(|r| sums[r]);
            for run in self.seg..self.end.min(self.whole) {
                let at = 32 * run + 8 * c;
                let w: [*const F16Le; R] = core::array::from_fn(|r| self.w[r].wrapping_add(at));
                // SAFETY: a whole run of every row; the tokens hold `at + 8` values.
                unsafe { step(&w, &self.x, at, &mut acc) };
            }
            if self.end > self.whole {
                let at = 32 * self.whole + 8 * c;
                let w: [*const F16Le; R] = core::array::from_fn(|r| self.tail_w[r].wrapping_add(8 * c));
                // SAFETY: chunk c of the padded tails; the tokens are padded past `at + 8`.
                unsafe { step(&w, &self.x, at, &mut acc) };
            }
            sums[..R].copy_from_slice(&acc);
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
