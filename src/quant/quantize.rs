//! Scalar reference quantizers, following ggml's `quantize_row_*_ref` rules exactly.
//!
//! q4_0/q4_1/q5_0/q5_1/q8_0 quantize weights (and KV cache rows) (and q8_0 activations); q4_K and q6_K quantize weights with ggml's
//! searched per-group scales (what `llama-quantize` does without an importance matrix); q8_K quantizes
//! activations for the K-quant dot products. [`quantize_row_ref`] dispatches on a type over raw bytes.
//! Lengths are the caller's job in the typed functions (`debug_assert!`; in release a short `out` just
//! stops early). Inputs are expected finite; a block whose scale overflows f16 gets an infinite
//! scale, as in ggml. Nothing here allocates: scratch lives on the stack (under 1 KiB).
//!
//! Bit-exactness with ggml's C: every f32 operation is done in the same order and Rust never fuses
//! multiply-adds, so the same inputs give the same bytes.

use super::blocks::*;
use super::dequant::QuantError;
use super::{GgmlType, QK_K};

/// `(first element with the largest |x|, that |x|)`, the sign kept; `(0, 0)` for an all-zero block.
///
/// The strict `<` keeps the first of equal magnitudes, and the initial `max = 0.0` (not `x[0]`) is
/// what ggml does: a block of only -0.0 therefore yields `max = +0.0`.
#[inline]
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        let a = libm::fabsf(v);
        if amax < a {
            amax = a;
            max = v;
        }
    }
    (max, amax)
}

/// `(min, max)` of a block as ggml's `_1` quantizers find them (strict comparisons from
/// `(FLT_MAX, -FLT_MAX)`).
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// q4_0: `d = max / -8` with the signed element of largest magnitude, nibble =
/// `min(15, trunc(x / d + 8.5))`; the extreme element maps to nibble 0.
pub fn quantize_row_q4_0_ref(x: &[f32], out: &mut [BlockQ4_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (max, _) = signed_max(x);
        let d = max / -8.0;
        let id = inverse(d);
        b.d = F16Le::from_f32(d);
        let (lo, hi) = x.split_at(QK / 2);
        for ((q, &x0), &x1) in b.qs.iter_mut().zip(lo).zip(hi) {
            // `as i8` truncates like C's (int8_t) cast; the clamp only matters for non-finite input.
            let q0 = ((x0 * id + 8.5) as i8).clamp(0, 15) as u8;
            let q1 = ((x1 * id + 8.5) as i8).clamp(0, 15) as u8;
            *q = q0 | (q1 << 4);
        }
    }
}

/// q4_1: `d = (max - min) / 15`, `m = min`, nibble = `min(15, trunc((x - min) / d + 0.5))`.
pub fn quantize_row_q4_1_ref(x: &[f32], out: &mut [BlockQ4_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse(d);
        b.d = F16Le::from_f32(d);
        b.m = F16Le::from_f32(min);
        let (lo, hi) = x.split_at(QK / 2);
        for ((q, &x0), &x1) in b.qs.iter_mut().zip(lo).zip(hi) {
            let q0 = (((x0 - min) * id + 0.5) as i8).clamp(0, 15) as u8;
            let q1 = (((x1 - min) * id + 0.5) as i8).clamp(0, 15) as u8;
            *q = q0 | (q1 << 4);
        }
    }
}

/// The 5-bit quants of one block as q5_0/q5_1 store them: low nibbles in split-halves order
/// (element `j` low, `j + 16` high) and the fifth bits as a little-endian u32, bit `j` for element
/// `j`. `quant(x)` is the block's rule for one value (at most 31).
fn pack_q5(x: &[f32], quant: impl Fn(f32) -> u8, qs: &mut [u8; QK / 2], qh: &mut [u8; 4]) {
    let mut high = 0u32;
    let (lo, hi) = x.split_at(QK / 2);
    for (j, ((q, &x0), &x1)) in qs.iter_mut().zip(lo).zip(hi).enumerate() {
        let (q0, q1) = (quant(x0), quant(x1));
        *q = (q0 & 0xF) | ((q1 & 0xF) << 4);
        high |= u32::from(q0 >> 4) << j | u32::from(q1 >> 4) << (j + QK / 2);
    }
    *qh = high.to_le_bytes();
}

/// q5_0: `d = max / -16` with the signed element of largest magnitude, quant =
/// `min(31, trunc(x / d + 16.5))`; the extreme element maps to 0.
pub fn quantize_row_q5_0_ref(x: &[f32], out: &mut [BlockQ5_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (max, _) = signed_max(x);
        let d = max / -16.0;
        let id = inverse(d);
        b.d = F16Le::from_f32(d);
        // `as i8` truncates like C's (int8_t) cast; the clamp only matters for non-finite input.
        pack_q5(x, |v| ((v * id + 16.5) as i8).clamp(0, 31) as u8, &mut b.qs, &mut b.qh);
    }
}

/// q5_1: `d = (max - min) / 31`, `m = min`, quant = `min(31, trunc((x - min) / d + 0.5))`.
pub fn quantize_row_q5_1_ref(x: &[f32], out: &mut [BlockQ5_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse(d);
        b.d = F16Le::from_f32(d);
        b.m = F16Le::from_f32(min);
        pack_q5(x, |v| (((v - min) * id + 0.5) as i8).clamp(0, 31) as u8, &mut b.qs, &mut b.qh);
    }
}

/// q8_0: `d = max|x| / 127`, `q = round(x / d)` with ties away from zero (C's `roundf`).
pub fn quantize_row_q8_0_ref(x: &[f32], out: &mut [BlockQ8_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (_, amax) = signed_max(x);
        let d = amax / 127.0;
        let id = inverse(d);
        b.d = F16Le::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = libm::roundf(v * id) as i8;
        }
    }
}

/// ggml's `nearest_int`: round half to even through the 1.5 * 2^23 magic number. Exact for
/// |v| <= 2^22 (here |v| <= 127 plus rounding).
#[inline]
fn nearest_int(v: f32) -> i32 {
    debug_assert!(libm::fabsf(v) <= 4_194_303.0);
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// q8_K: `iscale = -127 / max` with the signed element of largest magnitude,
/// `q = min(127, nearest_int(iscale * x))` (ties to even), `d = 1 / iscale` as f32, and
/// `bsums[g]` the sum of each 16 quants.
///
/// An all-zero block gets `d = 0` and zero quants and sums (ggml leaves its `bsums` unwritten there;
/// they are multiplied by `d = 0` anyway).
pub fn quantize_row_q8_k_ref(x: &[f32], out: &mut [BlockQ8_K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (max, amax) = signed_max(x);
        if amax == 0.0 {
            *b = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, group) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *sum = I16Le::new(group.iter().map(|&q| q as i16).sum());
        }
        b.d = F32Le::from_f32(1.0 / iscale);
    }
}

/// ggml's `GROUP_MAX_EPS`: a group whose largest |x| is below this is all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// [`nearest_int`] for the K-quant searches, whose arguments are bounded for sane input but not
/// for any finite input (a sub-block far from the others can push `(x + dm) / d` past 2^22).
/// Identical to ggml inside the exact range and for NaN (0, what ggml's bit trick gives too, e.g.
/// when an f16 scale overflowed to infinity); outside the range it saturates instead of wrapping.
/// The callers clamp the result to a few bits anyway.
#[inline]
fn nearest_int_sat(v: f32) -> i32 {
    if v.is_nan() {
        return 0;
    }
    nearest_int(v.clamp(-4_194_303.0, 4_194_303.0))
}

/// ggml's `make_qkx2_quants` without mean-absolute-deviation: fits `x ≈ scale * q - min_out` with
/// `q` in `0..=nmax` to one group, minimising the `weights`-weighted squared error. Starts from the
/// plain min/max grid, then tries `nstep + 1` grids of `rmin + rdelta * is + nmax` steps over the
/// range, each refined by a weighted least-squares fit of scale and min (the min kept <= 0).
///
/// Writes the group's quants into `l` and returns `(scale, min_out)`, `min_out = -min >= 0`. A
/// constant group (after the min is raised to 0) gets `(0, -min)` and zero quants.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    const N: usize = 32;
    debug_assert!(x.len() <= N && weights.len() == x.len() && l.len() == x.len());
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let quant = |iscale: f32, v: f32, min: f32| nearest_int_sat(iscale * (v - min)).clamp(0, nmax);

    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for ((q, &v), &w) in l.iter_mut().zip(x).zip(weights) {
        let lv = quant(iscale, v, min);
        *q = lv as u8;
        let diff = scale * lv as f32 + min - v;
        best_error += w * (diff * diff);
    }
    let mut laux = [0u8; N];
    let laux = &mut laux[..x.len()];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for ((q, &v), &w) in laux.iter_mut().zip(x).zip(weights) {
            let lv = quant(iscale, v, min);
            *q = lv as u8;
            let lf = lv as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for ((&q, &v), &w) in laux.iter().zip(x).zip(weights) {
                let diff = this_scale * q as f32 + this_min - v;
                cur_error += w * (diff * diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// q4_K: for each of the 8 sub-blocks of 32, a weighted (scale, min) fit ([`make_qkx2_quants`] with
/// 15 levels, weights `rms(sub-block) + |x|`, 21 grids from 14 to 16 steps); the scales and mins
/// are then quantized to 6 bits against their super-block maxima (`d = max_scale / 63`,
/// `dmin = max_min / 63`), and every element is requantized with the stored values:
/// `q = clamp(nearest((x + dmin * m) / (d * sc)), 0, 15)`. A sub-block whose stored scale is 0 keeps
/// the quants of its fit, as in ggml.
pub fn quantize_row_q4_k_ref(x: &[f32], out: &mut [BlockQ4_K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 32];
        let mut mins = [0f32; QK_K / 32];
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for (j, (xs, ls)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
            let mut sum_x2 = 0.0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = libm::sqrtf(sum_x2 / 32.0);
            let weights: [f32; 32] = core::array::from_fn(|i| av_x + libm::fabsf(xs[i]));
            (scales[j], mins[j]) = make_qkx2_quants(15, xs, &weights, ls, -1.0, 0.1, 20);
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }

        let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        b.scales = [0; 12];
        for j in 0..QK_K / 32 {
            // `as u8` wraps like C's conversion to uint8_t; the fit's scales are never negative in
            // practice, and the min(63) then bounds what a wrapped value could be.
            let ls = (nearest_int_sat(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int_sat(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                b.scales[j] = ls;
                b.scales[j + 4] = lm;
            } else {
                b.scales[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                b.scales[j - 4] |= (ls >> 4) << 6;
                b.scales[j] |= (lm >> 4) << 6;
            }
        }
        b.d = F16Le::from_f32(max_scale / 63.0);
        b.dmin = F16Le::from_f32(max_min / 63.0);

        let (d_all, dmin_all) = (b.d.to_f32(), b.dmin.to_f32());
        for (j, (xs, ls)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
            let (sc, m) = scale_min_k4(j, &b.scales);
            let d = d_all * sc as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * m as f32;
            for (q, &v) in ls.iter_mut().zip(xs) {
                *q = nearest_int_sat((v + dm) / d).clamp(0, 15) as u8;
            }
        }

        // Chunk c of 64 elements: low nibbles from sub-block 2c, high nibbles from 2c + 1.
        for (qs, lc) in b.qs.chunks_exact_mut(32).zip(l.chunks_exact(64)) {
            for (i, q) in qs.iter_mut().enumerate() {
                *q = lc[i] | (lc[i + 32] << 4);
            }
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights: fits `x ≈ scale * q`
/// with `q` in `-nmax..nmax` to one group, minimising the `x²`-weighted squared error over 19 grids
/// (`nmax + 0.1 * is` steps from the signed extreme, `is` in -9..=9).
///
/// Writes the quants offset by `nmax` (so `0..2 * nmax`) into `l` and returns the scale; an
/// all-zero group (max |x| below [`GROUP_MAX_EPS`]) gets scale 0 and quants 0.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    debug_assert_eq!(x.len(), l.len());
    let (max, amax) = {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in x {
            let a = libm::fabsf(v);
            if a > amax {
                amax = a;
                max = v;
            }
        }
        (max, amax)
    };
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int_sat(iscale * v).clamp(-nmax, nmax - 1);
    // sum(w * x * q) and sum(w * q²) with w = x², in ggml's operation order.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, l: &mut [u8]| {
        for (q, &v) in l.iter_mut().zip(x) {
            *q = (quant(iscale, v) + nmax) as u8;
        }
    };

    let iscale = -(nmax as f32) / max;
    store(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// q6_K: each of the 16 groups of 16 gets a scale from [`make_qx_quants`] (32 levels each side);
/// the signed scale of largest magnitude sets `iscale = -128 / max_scale`, `d = 1 / iscale` (f16)
/// and the int8 group scales `min(127, nearest(iscale * scale))`; then every element is
/// requantized with the stored values: `q = clamp(nearest(x / (d * scale)), -32, 31) + 32`. A
/// super-block whose group scales are all below [`GROUP_MAX_EPS`] is all zero bytes.
pub fn quantize_row_q6_k_ref(x: &[f32], out: &mut [BlockQ6_K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for ((xs, ls), scale) in x.chunks_exact(16).zip(l.chunks_exact_mut(16)).zip(scales.iter_mut()) {
            *scale = make_qx_quants(32, xs, ls);
            let abs_scale = libm::fabsf(*scale);
            if abs_scale > max_abs_scale {
                max_abs_scale = abs_scale;
                max_scale = *scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = bytemuck::Zeroable::zeroed();
            continue;
        }

        let iscale = -128.0 / max_scale;
        b.d = F16Le::from_f32(1.0 / iscale);
        for (s, &scale) in b.scales.iter_mut().zip(&scales) {
            // Within -128..=128 by construction; `as i8` wraps like C's int8_t store.
            *s = nearest_int_sat(iscale * scale).min(127) as i8;
        }
        let d_all = b.d.to_f32();
        for ((xs, ls), &s) in x.chunks_exact(16).zip(l.chunks_exact_mut(16)).zip(&b.scales) {
            let d = d_all * s as f32;
            if d == 0.0 {
                continue;
            }
            for (q, &v) in ls.iter_mut().zip(xs) {
                *q = (nearest_int_sat(v / d).clamp(-32, 31) + 32) as u8;
            }
        }

        // Half h (128 elements): ql[64h + i] holds elements i (low) and i + 64 (high) of the half,
        // ql[64h + 32 + i] elements i + 32 and i + 96; qh[32h + i] their top two bits at 0, 2, 4, 6.
        for ((ql, qh), lh) in
            b.ql.chunks_exact_mut(64).zip(b.qh.chunks_exact_mut(32)).zip(l.chunks_exact(128))
        {
            for i in 0..32 {
                let (q1, q2, q3, q4) = (lh[i], lh[i + 32], lh[i + 64], lh[i + 96]);
                ql[i] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}

/// Whether [`quantize_row_ref`] can produce type `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    ty.traits().quantize.is_some()
}

/// Quantizes `x` into the raw bytes `out` of type `ty` (the types whose [`GgmlType::traits`] row has
/// a quantizer; see [`can_quantize`]): the twin of [`dequantize_row_ref`](super::dequantize_row_ref).
///
/// `x.len()` must be a multiple of the block length and `out` exactly the bytes of that many blocks.
pub fn quantize_row_ref(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let mismatch = QuantError::LengthMismatch { ty, src_bytes: out.len(), out_len: x.len() };
    let (len, bytes) = (ty.block_len(), ty.block_bytes());
    if x.len() % len != 0 || Some(out.len()) != (x.len() / len).checked_mul(bytes) {
        return Err(mismatch);
    }
    // Lengths are consistent and the blocks have alignment 1: the views cannot fail.
    match ty.traits().quantize {
        Some(quantize) if quantize(x, out) => {}
        Some(_) => return Err(mismatch),
        None => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequant::*;
    use bytemuck::Zeroable;

    /// 0.1 + 2 cos(i + offset), ggml's synthetic test data.
    fn synthetic<const N: usize>(offset: f32) -> [f32; N] {
        core::array::from_fn(|i| (0.1 + 2.0 * libm::cosf(i as f32 + offset) as f64) as f32)
    }

    #[test]
    fn all_zero_blocks() {
        let x = [0f32; QK_K];
        let mut q4 = [BlockQ4_0::zeroed(); 8];
        quantize_row_q4_0_ref(&x, &mut q4);
        // 0 / -8 is -0.0, as in ggml; nibble 8 means zero.
        assert!(q4.iter().all(|b| b.d.to_f32() == 0.0 && b.qs == [0x88; 16]));
        let mut q41 = [BlockQ4_1::zeroed(); 8];
        quantize_row_q4_1_ref(&x, &mut q41);
        assert!(q41.iter().all(|b| b.d.to_bits() == 0 && b.m.to_bits() == 0 && b.qs == [0; 16]));
        let mut q8 = [BlockQ8_0::zeroed(); 8];
        quantize_row_q8_0_ref(&x, &mut q8);
        assert!(q8.iter().all(|b| b.d.to_bits() == 0 && b.qs == [0; 32]));
        let mut k = [BlockQ8_K { d: F32Le::from_f32(9.0), qs: [5; QK_K], bsums: [I16Le::new(3); 16] }];
        quantize_row_q8_k_ref(&x, &mut k);
        assert_eq!(k[0], BlockQ8_K::zeroed());

        let mut y = [1f32; QK_K];
        dequantize_q4_0_ref(&q4, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn single_huge_value() {
        // One large element among tiny ones: it is reproduced within half a step, the rest go to ~0.
        let mut x = [1e-6f32; QK_K];
        x[37] = -30000.0;
        let mut y = [0f32; QK_K];

        let mut q4 = [BlockQ4_0::zeroed(); 8];
        quantize_row_q4_0_ref(&x, &mut q4);
        assert_eq!(q4[1].qs[5] & 0xF, 0, "the extreme element maps to nibble 0");
        dequantize_q4_0_ref(&q4, &mut y);
        assert!((y[37] - x[37]).abs() <= 1.0, "{}", y[37]);
        assert!(y.iter().enumerate().all(|(i, &v)| i == 37 || v.abs() < 1e-5));

        let mut q8 = [BlockQ8_0::zeroed(); 8];
        quantize_row_q8_0_ref(&x, &mut q8);
        assert_eq!(q8[1].qs[5], -127);
        dequantize_q8_0_ref(&q8, &mut y);
        assert!((y[37] - x[37]).abs() <= 16.0, "{}", y[37]);

        x[37] = 1e30; // fits q8_K's f32 scale
        let mut k = [BlockQ8_K::zeroed()];
        quantize_row_q8_k_ref(&x, &mut k);
        assert_eq!(k[0].qs[37], -127);
        assert_eq!(k[0].bsums[2].get(), -127);
        dequantize_q8_k_ref(&k, &mut y);
        assert!(((y[37] - 1e30) / 1e30).abs() < 1e-6);
        assert!(y.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn sign_of_the_extreme_sets_the_sign_of_d() {
        let mut x = [0.25f32; QK];
        x[3] = 4.0;
        let mut b = [BlockQ4_0::zeroed()];
        quantize_row_q4_0_ref(&x, &mut b);
        assert_eq!(b[0].d.to_f32(), -0.5, "positive max gives a negative scale");
        x[3] = -4.0;
        quantize_row_q4_0_ref(&x, &mut b);
        assert_eq!(b[0].d.to_f32(), 0.5);
        // Equal magnitudes: the first one wins, as in ggml.
        x[3] = -4.0;
        x[9] = 4.0;
        quantize_row_q4_0_ref(&x, &mut b);
        assert_eq!(b[0].d.to_f32(), 0.5);
        // Its opposite maps to 16, clamped to 15: the format's known asymmetry.
        assert_eq!(b[0].qs[9] & 0xF, 15);
    }

    #[test]
    fn ties_round_like_ggml() {
        // q8_0 with amax 127 has d = 1: x.5 rounds away from zero.
        let mut x = [0f32; QK];
        x[0] = 127.0;
        x[1..5].copy_from_slice(&[0.5, -0.5, 2.5, -3.5]);
        let mut b = [BlockQ8_0::zeroed()];
        quantize_row_q8_0_ref(&x, &mut b);
        assert_eq!(&b[0].qs[..5], &[127, 1, -1, 3, -4]);
        // q8_K with max 127 has iscale -1: ties go to even.
        let mut xk = [0f32; QK_K];
        xk[0] = 127.0;
        xk[1..5].copy_from_slice(&[0.5, -0.5, 2.5, -3.5]);
        let mut k = [BlockQ8_K::zeroed()];
        quantize_row_q8_k_ref(&xk, &mut k);
        assert_eq!(&k[0].qs[..5], &[-127, 0, 0, -2, 4]);
        assert_eq!(k[0].d.get(), -1.0);
        assert_eq!(k[0].bsums[0].get(), -127 - 2 + 4);
    }

    #[test]
    fn round_trip_errors_are_within_half_a_step() {
        let x: [f32; 4 * QK_K] = synthetic(0.0);
        let mut y = [0f32; 4 * QK_K];

        let mut q8 = [BlockQ8_0::zeroed(); 32];
        quantize_row_q8_0_ref(&x, &mut q8);
        dequantize_q8_0_ref(&q8, &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            // Half a step, plus the f16 rounding of d (2^-11 relative) times 127 steps.
            let d = q8[i / QK].d.to_f32();
            assert!((a - b).abs() <= d * (0.5 + 127.0 / 2048.0), "{i}: {a} vs {b}");
        }

        let mut k = [BlockQ8_K::zeroed(); 4];
        quantize_row_q8_k_ref(&x, &mut k);
        dequantize_q8_k_ref(&k, &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let d = k[i / QK_K].d.get().abs();
            assert!((a - b).abs() <= d * 0.5001, "{i}: {a} vs {b}");
        }
        for b in &k {
            for (g, s) in b.bsums.iter().enumerate() {
                assert_eq!(s.get(), b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum::<i16>());
            }
        }

        let mut q4 = [BlockQ4_0::zeroed(); 32];
        quantize_row_q4_0_ref(&x, &mut q4);
        dequantize_q4_0_ref(&q4, &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            // A full step: the clamp to 15 costs the opposite extreme one step.
            let d = q4[i / QK].d.to_f32().abs();
            assert!((a - b).abs() <= d * 1.01, "{i}: {a} vs {b}");
        }

        let mut q41 = [BlockQ4_1::zeroed(); 32];
        quantize_row_q4_1_ref(&x, &mut q41);
        dequantize_q4_1_ref(&q41, &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let d = q41[i / QK].d.to_f32();
            assert!((a - b).abs() <= d * 0.51 + 2e-3, "{i}: {a} vs {b}");
            assert!(b.is_finite());
        }
    }

    /// Dequantizes `n` K-quant blocks of raw type `ty` from `bytes`.
    fn dequant(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
        crate::quant::dequantize_row_ref(ty, bytes, out).unwrap();
    }

    /// max |x - y| and sqrt(mean (x - y)²).
    fn errors(x: &[f32], y: &[f32]) -> (f32, f32) {
        let max = x.iter().zip(y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        let sq: f32 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
        (max, libm::sqrtf(sq / x.len() as f32))
    }

    #[test]
    fn k_quants_of_zeros_and_constants() {
        let mut q4 = [BlockQ4_K::zeroed(); 2];
        let mut q6 = [BlockQ6_K::zeroed(); 2];
        let mut y = [1f32; 2 * QK_K];
        // All zeros (and all -0.0): zero scales, zero output.
        let mut x = [0f32; 2 * QK_K];
        x[QK_K..].fill(-0.0);
        quantize_row_q4_k_ref(&x, &mut q4);
        assert!(q4.iter().all(|b| b.d.to_f32() == 0.0 && b.dmin.to_f32() == 0.0 && b.scales == [0; 12]));
        quantize_row_q6_k_ref(&x, &mut q6);
        assert!(q6.iter().all(|b| *b == BlockQ6_K::zeroed()), "all-zero q6_K blocks are zero bytes");
        dequant(GgmlType::Q4_K, bytemuck::cast_slice(&q4), &mut y);
        assert!(y.iter().all(|&v| v == 0.0));

        // A constant positive block: the min is raised to 0, so one scale step carries the value.
        let x = [0.75f32; 2 * QK_K];
        quantize_row_q4_k_ref(&x, &mut q4);
        dequant(GgmlType::Q4_K, bytemuck::cast_slice(&q4), &mut y);
        let (max, _) = errors(&x, &y);
        assert!(max < 0.75 * 2e-3, "constant block off by {max}");
        quantize_row_q6_k_ref(&x, &mut q6);
        dequant(GgmlType::Q6_K, bytemuck::cast_slice(&q6), &mut y);
        let (max, _) = errors(&x, &y);
        assert!(max < 0.75 * 2e-3, "constant block off by {max}");
    }

    #[test]
    fn k_quants_round_trip_within_their_steps() {
        let x: [f32; 4 * QK_K] = synthetic(0.0);
        let mut y = [0f32; 4 * QK_K];

        let mut q4 = [BlockQ4_K::zeroed(); 4];
        quantize_row_q4_k_ref(&x, &mut q4);
        dequant(GgmlType::Q4_K, bytemuck::cast_slice(&q4), &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let blk = &q4[i / QK_K];
            let (sc, _) = scale_min_k4((i % QK_K) / 32, &blk.scales);
            let step = blk.d.to_f32() * sc as f32;
            // Half a step, plus the 6-bit rounding of the min (half a dmin step).
            assert!((a - b).abs() <= 0.5 * step + 0.5 * blk.dmin.to_f32() + 1e-6, "{i}: {a} vs {b}");
        }

        let mut q6 = [BlockQ6_K::zeroed(); 4];
        quantize_row_q6_k_ref(&x, &mut q6);
        dequant(GgmlType::Q6_K, bytemuck::cast_slice(&q6), &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let blk = &q6[i / QK_K];
            let step = (blk.d.to_f32() * blk.scales[(i % QK_K) / 16] as f32).abs();
            // The search may shrink the grid so the extreme lands a little past the last level.
            assert!((a - b).abs() <= 0.75 * step, "{i}: {a} vs {b} (step {step})");
        }
    }

    #[test]
    fn q6_k_follows_the_sign_of_the_extreme_scale() {
        // One group with a large positive extreme: the largest group scale is negative (nmax / -max),
        // so iscale = -128 / max_scale is positive and that group's int8 scale is -128.
        let mut x: [f32; QK_K] = synthetic(1.0);
        x[40] = 50.0;
        let mut q6 = [BlockQ6_K::zeroed()];
        quantize_row_q6_k_ref(&x, &mut q6);
        assert_eq!(q6[0].scales[2], -128);
        let mut y = [0f32; QK_K];
        dequant(GgmlType::Q6_K, bytemuck::cast_slice(&q6), &mut y);
        assert!((y[40] - 50.0).abs() < 50.0 / 32.0 / 2.0 + 0.1, "{}", y[40]);
    }

    #[test]
    fn k_quants_survive_wild_dynamic_range() {
        // Sub-blocks 40 orders of magnitude apart: no panic (debug asserts on), finite output, and
        // the large sub-blocks still reproduced.
        let mut x: [f32; QK_K] = synthetic(2.0);
        for (i, v) in x.iter_mut().enumerate() {
            let sub = i / 32;
            *v *= if sub % 2 == 0 { 1e20 } else { 1e-20 };
            if sub == 3 {
                *v -= 1e19;
            }
        }
        let mut y = [0f32; QK_K];
        let mut q4 = [BlockQ4_K::zeroed()];
        quantize_row_q4_k_ref(&x, &mut q4);
        let mut q6 = [BlockQ6_K::zeroed()];
        quantize_row_q6_k_ref(&x, &mut q6);
        // As in ggml: q4_K's super-block scale overflows f16; q6_K's x² weights overflow f32, the
        // large groups' fits come out NaN and the block is stored as zeros.
        assert_eq!(q4[0].d.to_f32(), f32::INFINITY);
        assert_eq!(q6[0], BlockQ6_K::zeroed());
        let small: [f32; QK_K] = core::array::from_fn(|i| x[i] * 1e-18);
        quantize_row_q4_k_ref(&small, &mut q4);
        dequant(GgmlType::Q4_K, bytemuck::cast_slice(&q4), &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
        let (max, _) = errors(&small[..32], &y[..32]);
        assert!(max < 0.2 * 2.1 * 100.0, "{max}");
        quantize_row_q6_k_ref(&small, &mut q6);
        dequant(GgmlType::Q6_K, bytemuck::cast_slice(&q6), &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn row_dispatch_checks_lengths_and_types() {
        let x = [0.5f32; QK_K];
        let mut out = [0u8; 144];
        assert_eq!(quantize_row_ref(GgmlType::Q4_K, &x, &mut out), Ok(()));
        let mut typed = [BlockQ4_K::zeroed()];
        quantize_row_q4_k_ref(&x, &mut typed);
        assert_eq!(&out[..], bytemuck::cast_slice::<_, u8>(&typed));
        assert!(matches!(
            quantize_row_ref(GgmlType::Q4_K, &x[..32], &mut out),
            Err(QuantError::LengthMismatch { .. })
        ));
        assert!(matches!(
            quantize_row_ref(GgmlType::Q6_K, &x, &mut out),
            Err(QuantError::LengthMismatch { .. })
        ));
        assert_eq!(
            quantize_row_ref(GgmlType::Q5_K, &x, &mut out),
            Err(QuantError::Unsupported(GgmlType::Q5_K))
        );
        let mut out8 = [0u8; 8 * 34];
        assert_eq!(quantize_row_ref(GgmlType::Q8_0, &x, &mut out8), Ok(()));
        for ty in
            [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_K]
        {
            assert!(can_quantize(ty), "{ty}");
        }
    }
}
