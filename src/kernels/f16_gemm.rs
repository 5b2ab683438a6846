//! The encoder's matmul on f16 weights: a GEMM whose register tile holds tokens in the vector
//! lanes and broadcasts weights, so its inner loop is loads and fused multiply-adds only.
//!
//! The per-token dot ([`super::dot_f16`]) and its tile ([`super::dot_f16_tile`]) sum each output
//! in 32 partial chains (4 chunks of 8 lanes), the order a decoded token must share with its
//! prompt. An encoder has no one-token twin, so its outputs take the plainest order instead: one
//! chain per output, `acc = x[k] * w[k] + acc` for `k` ascending. Tokens are rounded to f16 first
//! (as ggml converts activations for f16 weights), so every product is exact in f32 and a fused
//! and an unfused multiply-add give the same bits: the SIMD tiles equal [`panel_ref`] bit for bit
//! and the blocking of `k` (sums waiting in the output between chunks) changes nothing.
//!
//! Layout: a panel is [`GEMM_ROWS`] weight rows widened to f32 (`wp[r][kk]`, row-major, widened
//! once per panel and chunk of `k`), times micro-panels of [`GEMM_TOKENS`] tokens packed
//! `xt[kk][t]` by the caller. AVX2 runs 2 vectors x 6 rows (12 accumulators), NEON 4 x 6 (24).

use super::attn_tile::Lanes;
use crate::quant::blocks::F16Le;

/// Weight rows of one panel (broadcast, one accumulator vector row each).
pub const GEMM_ROWS: usize = 6;
/// Tokens of one micro-panel (the vector lanes).
pub const GEMM_TOKENS: usize = 16;
/// Most elements of `k` per chunk: a panel's widened rows (24 KiB) stay in L1.
pub const GEMM_DEPTH: usize = 1024;

/// One micro-panel's sums: `[row][token]`.
pub type GemmTile = [[f32; GEMM_TOKENS]; GEMM_ROWS];

/// Continues the sums `acc` (one tile per micro-panel of `xt`) over one chunk of `kc` elements:
/// weight rows `ws` (at most [`GEMM_ROWS`], each `kc` long; missing rows are zero) widened into
/// `wp` (at least `GEMM_ROWS * kc` floats), tokens `xt` packed `[tile][kk][t]` (`kc *`
/// [`GEMM_TOKENS`] floats per tile). In `L` with `V` vectors per micro-panel (`V * L::N ==
/// GEMM_TOKENS`); inlined into each path's kernel, which compiles it with its target features.
#[inline(always)]
pub fn panel<L: Lanes, const V: usize>(
    ws: &[&[F16Le]],
    xt: &[f32],
    kc: usize,
    wp: &mut [f32],
    acc: &mut [GemmTile],
) {
    if V * L::N != GEMM_TOKENS || ws.len() > GEMM_ROWS || wp.len() < GEMM_ROWS * kc || kc == 0 {
        return;
    }
    for (r, row) in wp.chunks_exact_mut(kc).take(GEMM_ROWS).enumerate() {
        match ws.get(r) {
            Some(w) if w.len() == kc => L::widen_f16(bytemuck::cast_slice(w), row),
            _ => row.fill(0.0),
        }
    }
    let wp = &wp[..GEMM_ROWS * kc];
    for (tile, x) in acc.iter_mut().zip(xt.chunks_exact(kc * GEMM_TOKENS)) {
        micro::<L, V>(x, wp, kc, tile);
    }
}

/// One micro-panel: `acc[r][t] = x[kk][t] * w[r][kk] + acc[r][t]` for `kk` ascending, the 6 x V
/// accumulator vectors in registers.
#[inline(always)]
fn micro<L: Lanes, const V: usize>(xt: &[f32], wp: &[f32], kc: usize, acc: &mut GemmTile) {
    let mut a: [[L; V]; GEMM_ROWS] =
        core::array::from_fn(|r| core::array::from_fn(|v| L::load(&acc[r][v * L::N..])));
    let (w0, rest) = wp.split_at(kc);
    let (w1, rest) = rest.split_at(kc);
    let (w2, rest) = rest.split_at(kc);
    let (w3, rest) = rest.split_at(kc);
    let (w4, w5) = rest.split_at(kc);
    let steps = xt.chunks_exact(GEMM_TOKENS).zip(w0).zip(w1).zip(w2).zip(w3).zip(w4).zip(w5);
    for ((((((x, &b0), &b1), &b2), &b3), &b4), &b5) in steps {
        let xv: [L; V] = core::array::from_fn(|v| L::load(&x[v * L::N..]));
        for (row, b) in a.iter_mut().zip([b0, b1, b2, b3, b4, b5]) {
            let b = L::splat(b);
            for (acc, &x) in row.iter_mut().zip(&xv) {
                *acc = x.mul_add(b, *acc);
            }
        }
    }
    for (row, out) in a.iter().zip(acc.iter_mut()) {
        for (v, acc) in row.iter().enumerate() {
            acc.store(&mut out[v * L::N..]);
        }
    }
}

/// [`panel`] in scalar code, the twin of the SIMD tiles bit for bit (the reference path's
/// kernel): each output one chain of `x * w + acc` in `kk` order.
pub fn panel_ref(ws: &[&[F16Le]], xt: &[f32], kc: usize, acc: &mut [GemmTile]) {
    if ws.len() > GEMM_ROWS || kc == 0 {
        return;
    }
    for (tile, x) in acc.iter_mut().zip(xt.chunks_exact(kc * GEMM_TOKENS)) {
        for (w, out) in ws.iter().zip(tile.iter_mut()) {
            if w.len() != kc {
                continue;
            }
            for (kk, &h) in w.iter().enumerate() {
                let w = super::dot::f16(h);
                for (t, o) in out.iter_mut().enumerate() {
                    *o += x[kk * GEMM_TOKENS + t] * w;
                }
            }
        }
    }
}
