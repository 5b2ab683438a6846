//! Scalar reference dot products of one weight row with one activation row, paired the way ggml
//! pairs them: the twins every NEON/AVX2 `vec_dot` kernel is tested against.
//!
//! ggml never multiplies a quantized weight row with f32 activations directly. The activation row is
//! first converted to the weight type's *vec_dot type* ([`vec_dot_type`]: q8_0, q8_1 or q8_K for the
//! quantized types, by [`from_float_ref`]); the dot product then runs on integers inside each block and
//! applies the block scales in f32, summing the blocks in f32. The kernels here use ggml's formulas and
//! order of f32 operations per block (`sumi * d_x * d_y`, `(d_x * d_y) * sumi + m_x * s_y`,
//! `dall * isum - dmin * summs`, ...), with these deliberate differences from ggml's generic C code, all
//! at f32 rounding level:
//!
//! * q3_K..q6_K: the generic C code keeps eight f32 partial sums across blocks (one per lane of its
//!   `aux32`); here each block's integer total (identical to C's) is scaled and added to one f32 sum, as
//!   ggml's NEON kernels do.
//! * q6_K is computed with signed `q - 32` (as the generic C code) rather than folding the `-32` into
//!   q8_K's `bsums` (as the NEON code); the integer result is the same.
//! * f32/f16/bf16: products in f32, sum in f64 (ggml's scalar `ggml_float` path); ggml's SIMD paths sum
//!   in f32 lanes.
//!
//! The min terms of q4_1/q5_1 use q8_1's stored `s` (`d * sum(q)` rounded to f16) and those of
//! q2_K/q4_K/q5_K use q8_K's `bsums`, so activation blocks must come from the reference quantizers (or
//! be consistent with them). No function here allocates or builds dequantized buffers.

use crate::quant::blocks::*;
use crate::quant::GgmlType;

/// Exact f16 to f32, branch-light so it stays cheap inside block loops (`half`'s software fallback,
/// used without the `std` feature or a compile-time `fp16`/`f16c` target feature, is several times
/// slower). Same values as [`F16Le::to_f32`] (a NaN stays a NaN, not necessarily a quiet one).
#[inline(always)]
pub(crate) fn f16(h: F16Le) -> f32 {
    let h = h.to_bits();
    let sign = ((h & 0x8000) as u32) << 16;
    let bits = ((h & 0x7fff) as u32) << 13;
    let v = if h & 0x7c00 == 0x7c00 {
        // Infinity or NaN: all-ones exponent, mantissa kept.
        f32::from_bits(bits | 0x7f80_0000)
    } else {
        // Normal and subnormal: exponent bias 15 -> 127 by an exact multiply with 2^112.
        f32::from_bits(bits) * f32::from_bits(0x7780_0000)
    };
    f32::from_bits(v.to_bits() | sign)
}

/// The activation type ggml converts activations to before a dot product with `weight`, or `None`
/// when there is no reference dot product for `weight`.
///
/// F32, F16 and BF16 pair with themselves; Q4_0, Q5_0, Q8_0 with Q8_0; Q4_1, Q5_1 with Q8_1;
/// Q2_K..Q6_K with Q8_K.
pub fn vec_dot_type(weight: GgmlType) -> Option<GgmlType> {
    weight.traits().vec_dot.map(|(act, _)| act)
}

/// q8_1 as ggml's `quantize_row_q8_1_ref`: `d = max|x| / 127`, `q = round(x / d)` with ties away from
/// zero, and `s = d * sum(q)` with the unrounded f32 `d`, both stored as f16.
///
/// `qs` and `d` are exactly what q8_0's reference quantizer produces. Inputs are expected finite; an
/// all-zero block gets `d = s = 0` and zero quants.
pub fn quantize_row_q8_1_ref(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let mut amax = 0.0f32;
        for &v in x {
            // C's MAX(amax, fabsf(v)).
            let a = libm::fabsf(v);
            amax = if amax > a { amax } else { a };
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            // `as i8` saturates where C's conversion would be undefined (non-finite input only).
            *q = libm::roundf(v * id) as i8;
            sum += *q as i32;
        }
        b.s = F16Le::from_f32(sum as f32 * d);
    }
}

/// f32 to bf16 as ggml's `GGML_FP32_TO_BF16`: round to nearest, ties to even; NaNs are kept and made
/// quiet; values past the largest bf16 round to infinity.
#[inline]
pub fn f32_to_bf16_ref(x: f32) -> Bf16Le {
    let u = x.to_bits();
    let bits = if u & 0x7fff_ffff > 0x7f80_0000 {
        (u >> 16) | 64
    } else {
        // No overflow: the largest non-NaN pattern is 0xff80_0000.
        (u + (0x7fff + ((u >> 16) & 1))) >> 16
    };
    Bf16Le((bits as u16).to_le_bytes())
}

/// Scale, inverse scale and rounded quants of one 32-element activation block the way llama.cpp's
/// SIMD quantizer computes them on x86 (where our golden outputs come from): `id = 127 / amax` and
/// round-half-to-even. The scalar reference (`1 / (amax / 127)`, half away from zero) gives other
/// quants on ties, and activations hit ties often enough to move logits by ~0.1.
fn quantize_act_block(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, &v| m.max(libm::fabsf(v)));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = libm::rintf(v * id) as i8;
        sum += i32::from(*q);
    }
    (d, sum)
}

/// Activations to Q8_0 as llama.cpp's SIMD path does (see [`quantize_act_block`]).
pub fn quantize_act_q8_0_ref(x: &[f32], out: &mut [BlockQ8_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (d, _) = quantize_act_block(x, &mut b.qs);
        b.d = F16Le::from_f32(d);
    }
}

/// Activations to Q8_1 as llama.cpp's SIMD path does; `s = d * sum(q)` with the f32 `d`.
pub fn quantize_act_q8_1_ref(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let (d, sum) = quantize_act_block(x, &mut b.qs);
        b.d = F16Le::from_f32(d);
        b.s = F16Le::from_f32(d * sum as f32);
    }
}

/// Converts the activation row `x` to `ty` in `out` (the bytes of one row of `ty`).
///
/// Supports the activation types F32 (copy), F16 (round to nearest even), BF16 ([`f32_to_bf16_ref`]),
/// Q8_0 and Q8_1 (llama.cpp's SIMD quantizer: [`quantize_act_q8_0_ref`]) and Q8_K (the
/// reference quantizer, which llama.cpp also uses for activations). Returns `false`, leaving `out` untouched, when `ty`
/// is not one of them or when `out.len()` is not `ty`'s size of `x.len()` elements (which also refuses
/// an `x.len()` that is not a whole number of blocks).
pub fn from_float_ref(ty: GgmlType, x: &[f32], out: &mut [u8]) -> bool {
    match ty.traits().from_float {
        Some(convert) if ty.bytes_for(x.len() as u64) == Some(out.len() as u64) => convert(x, out),
        _ => false,
    }
}

/// `sum(x[i] * y[i])` over elements widened to f32: products in f32, sum in f64, as ggml's scalar
/// float dots (for f16 and bf16 the products are exact).
fn dot_widened<T: Copy>(x: &[T], y: &[T], widen: impl Fn(T) -> f32) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f64;
    for (&a, &b) in x.iter().zip(y) {
        sum += (widen(a) * widen(b)) as f64;
    }
    sum as f32
}

/// f32 dot product (ggml's scalar `ggml_vec_dot_f32`).
pub fn vec_dot_f32_f32_ref(x: &[F32Le], y: &[F32Le]) -> f32 {
    dot_widened(x, y, F32Le::get)
}

/// f16 dot product (ggml's scalar path).
pub fn vec_dot_f16_f16_ref(x: &[F16Le], y: &[F16Le]) -> f32 {
    dot_widened(x, y, f16)
}

/// The f16 key dot as ggml's x86 build sums it (AVX2, `ggml_vec_dot_f16`): the exact f32
/// products in chunks of 8 lanes (zero-padded to a multiple of 32), chunk `c` added into
/// accumulator `c % 4` in f32; `x = (a0 + a2) + (a1 + a3)`, `t[i] = x[i] + x[i + 4]`,
/// `(t0 + t1) + (t2 + t3)`.
pub fn vec_dot_f16_ggml_ref(k: &[F16Le], q: &[F16Le]) -> f32 {
    let n = k.len().min(q.len());
    let mut acc = [[0f32; 8]; 4];
    for c in 0..n.div_ceil(32) * 4 {
        for (l, a) in acc[c % 4].iter_mut().enumerate() {
            let i = 8 * c + l;
            // Exact in f32 (11-bit significands), so `fma` is this sum.
            let p = if i < n { k[i].to_f32() * q[i].to_f32() } else { 0.0 };
            *a = if c < 4 { p } else { *a + p };
        }
    }
    let x: [f32; 8] = core::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = core::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// The f16 dot product of the matmul on f16 weights (never repacked: Gemma 4's
/// `per_layer_model_proj` stays f16 in quantized files): ggml's x86 (AVX2) summation order, the
/// numbers of [`vec_dot_f16_ggml_ref`] bit for bit, in 4 x 8 lanes of
/// f32 the compiler vectorises (the scalar path's chain of f64 additions is ~10x slower).
pub fn vec_dot_f16_lanes(x: &[F16Le], y: &[F16Le]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    f16_groups_of_32(x, y, |first, gx, gy| {
        for (c, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                // Exact in f32 (11-bit significands).
                let p = f16(gx[8 * c + l]) * f16(gy[8 * c + l]);
                *a = if first { p } else { *a + p };
            }
        }
    });
    let x: [f32; 8] = core::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = core::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// The f16 weight row `w` times each of several input rows at once, each result bit for bit
/// [`vec_dot_f16_lanes`]`(w, x)` (the same lanes, runs and folding per row: a token's numbers do
/// not depend on the tokens beside it). The inputs are f16 values widened to f32 and zero-padded
/// to a multiple of 32 ([`widen_f16_padded`]), so a tile widens each input once for every weight
/// row; `out[j]` takes row `xs[j]`'s dot.
pub fn vec_dot_f16_rows_lanes(w: &[F16Le], xs: &[&[f32]], out: &mut [f32]) {
    let n = w.len();
    let mut pw = [0f32; 32];
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        let mut acc = [[0f32; 8]; 4];
        for start in (0..n).step_by(32) {
            let end = (start + 32).min(n);
            pw.fill(0.0);
            for (p, &h) in pw.iter_mut().zip(&w[start..end]) {
                *p = f16(h);
            }
            for (c, a) in acc.iter_mut().enumerate() {
                for (l, a) in a.iter_mut().enumerate() {
                    let p = pw[8 * c + l] * x[start + 8 * c + l];
                    *a = if start == 0 { p } else { *a + p };
                }
            }
        }
        let x: [f32; 8] = core::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
        let t: [f32; 4] = core::array::from_fn(|i| x[i] + x[i + 4]);
        *o = (t[0] + t[1]) + (t[2] + t[3]);
    }
}

/// `x` widened to f32 into `out`, zeros after it up to `out`'s length (a multiple of 32 at
/// least `x.len()`: the input rows of [`vec_dot_f16_rows_lanes`] and its SIMD twins).
pub fn widen_f16_padded(x: &[F16Le], out: &mut [f32]) {
    let n = x.len().min(out.len());
    for (o, &h) in out[..n].iter_mut().zip(x) {
        *o = f16(h);
    }
    out[n..].fill(0.0);
}

/// f32 dot product in the SIMD kernels' order ([`crate::kernels::dot_f32`]): runs of 32
/// elements (a shorter last run zero-padded) into 4 x 8 lanes of f32 products summed in f32, the
/// lanes then added pairwise. The twin of the AVX2 and NEON kernels, bit for bit.
pub fn vec_dot_f32_lanes(x: &[f32], y: &[f32]) -> f32 {
    f32_lanes_sum(x.len().min(y.len()), |i| (x[i], y[i]))
}

/// [`vec_dot_f32_lanes`] of two rows of little-endian f32 bytes at any alignment (the same runs,
/// padding and sums, so the same bits): the dot of f32 attention keys.
pub fn vec_dot_f32_lanes_bytes(x: &[u8], y: &[u8]) -> f32 {
    let f = |b: &[u8], i: usize| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    f32_lanes_sum(x.len().min(y.len()) / 4, |i| (f(x, i), f(y, i)))
}

/// The sum of the products of `n` pairs (`pair(i)`) in the SIMD kernels' f32 order: runs of 32
/// (a shorter last run zero-padded) into 4 x 8 lanes, the lanes then added pairwise.
#[inline(always)]
fn f32_lanes_sum(n: usize, pair: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    for start in (0..n).step_by(32) {
        for (c, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                let i = start + 8 * c + l;
                let (x, y) = if i < n { pair(i) } else { (0.0, 0.0) };
                *a += x * y;
            }
        }
    }
    let x: [f32; 8] = core::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = core::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// Calls `f(first, x, y)` with each run of 32 elements of `x` and `y` in order (`first` for the
/// first run), a last run shorter than 32 zero-padded, as ggml's vector loads read it.
#[inline(always)]
pub(crate) fn f16_groups_of_32(x: &[F16Le], y: &[F16Le], mut f: impl FnMut(bool, &[F16Le], &[F16Le])) {
    let n = x.len().min(y.len());
    let (mut px, mut py) = ([F16Le::from_bits(0); 32], [F16Le::from_bits(0); 32]);
    for start in (0..n).step_by(32) {
        let end = (start + 32).min(n);
        if end - start == 32 {
            f(start == 0, &x[start..end], &y[start..end]);
        } else {
            px[..end - start].copy_from_slice(&x[start..end]);
            py[..end - start].copy_from_slice(&y[start..end]);
            f(start == 0, &px, &py);
        }
    }
}

/// bf16 dot product (ggml's scalar path).
pub fn vec_dot_bf16_bf16_ref(x: &[Bf16Le], y: &[Bf16Le]) -> f32 {
    dot_widened(x, y, Bf16Le::to_f32)
}

/// q4_0 x q8_0: per block `sumi * d_x * d_y` with `sumi = sum((nibble - 8) * q)`.
pub fn vec_dot_q4_0_q8_0_ref(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let (lo, hi) = y.qs.split_at(QK / 2);
        let mut sumi = 0i32;
        for ((&q, &a), &b) in x.qs.iter().zip(lo).zip(hi) {
            sumi += ((q & 0xF) as i32 - 8) * a as i32 + ((q >> 4) as i32 - 8) * b as i32;
        }
        sumf += sumi as f32 * f16(x.d) * f16(y.d);
    }
    sumf
}

/// q4_1 x q8_1: per block `(d_x * d_y) * sumi + m_x * s_y` with `sumi = sum(nibble * q)`.
pub fn vec_dot_q4_1_q8_1_ref(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let (lo, hi) = y.qs.split_at(QK / 2);
        let mut sumi = 0i32;
        for ((&q, &a), &b) in x.qs.iter().zip(lo).zip(hi) {
            sumi += (q & 0xF) as i32 * a as i32 + (q >> 4) as i32 * b as i32;
        }
        sumf += (f16(x.d) * f16(y.d)) * sumi as f32 + f16(x.m) * f16(y.s);
    }
    sumf
}

/// Integer dot of a q5_0/q5_1 block's 5-bit values minus `offset` with 32 int8 activations.
#[inline]
fn q5_dot(qh: [u8; 4], qs: &[u8; QK / 2], act: &[i8; QK], offset: i32) -> i32 {
    let qh = u32::from_le_bytes(qh);
    let (lo, hi) = act.split_at(QK / 2);
    let mut sumi = 0i32;
    for (j, ((&q, &a), &b)) in qs.iter().zip(lo).zip(hi).enumerate() {
        let v0 = ((q & 0xF) as u32 | ((qh >> j) & 1) << 4) as i32 - offset;
        let v1 = ((q >> 4) as u32 | ((qh >> (j + QK / 2)) & 1) << 4) as i32 - offset;
        sumi += v0 * a as i32 + v1 * b as i32;
    }
    sumi
}

/// q5_0 x q8_0: per block `(d_x * d_y) * sumi` with `sumi = sum((q5 - 16) * q)`.
pub fn vec_dot_q5_0_q8_0_ref(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let sumi = q5_dot(x.qh, &x.qs, &y.qs, 16);
        sumf += (f16(x.d) * f16(y.d)) * sumi as f32;
    }
    sumf
}

/// q5_1 x q8_1: per block `(d_x * d_y) * sumi + m_x * s_y` with `sumi = sum(q5 * q)`.
pub fn vec_dot_q5_1_q8_1_ref(x: &[BlockQ5_1], y: &[BlockQ8_1]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let sumi = q5_dot(x.qh, &x.qs, &y.qs, 0);
        sumf += (f16(x.d) * f16(y.d)) * sumi as f32 + f16(x.m) * f16(y.s);
    }
    sumf
}

/// q8_0 x q8_0: per block `sumi * (d_x * d_y)`.
pub fn vec_dot_q8_0_q8_0_ref(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let mut sumi = 0i32;
        for (&a, &b) in x.qs.iter().zip(&y.qs) {
            sumi += a as i32 * b as i32;
        }
        sumf += sumi as f32 * (f16(x.d) * f16(y.d));
    }
    sumf
}

/// q2_K x q8_K: per super-block `dall * isum - dmin * summs`, with `dall = d_y * d_x`,
/// `dmin = d_y * dmin_x`, `isum = sum(scale_g * sum_g(q * a))` and `summs = sum(bsums_g * min_g)`.
pub fn vec_dot_q2_k_q8_k_ref(x: &[BlockQ2_K], y: &[BlockQ8_K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let mut summs = 0i32;
        for (&sc, bsum) in x.scales.iter().zip(&y.bsums) {
            summs += bsum.get() as i32 * (sc >> 4) as i32;
        }
        let dall = y.d.get() * f16(x.d);
        let dmin = y.d.get() * f16(x.dmin);
        let mut isum = 0i32;
        // Group g (16 elements) = half h, shift 2k, bytes 16 * (g % 2) .. of qs[32h ..].
        for (g, (act, &sc)) in y.qs.chunks_exact(16).zip(&x.scales).enumerate() {
            let (h, k, off) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let qs = &x.qs[32 * h + off..][..16];
            let mut s = 0i32;
            for (&q, &a) in qs.iter().zip(act) {
                s += ((q >> (2 * k)) & 3) as i32 * a as i32;
            }
            isum += (sc & 0xF) as i32 * s;
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// q3_K x q8_K: per super-block `(d_x * d_y) * isum` with `isum = sum((scale_g - 32) * sum_g(q * a))`
/// and `q = low2 - (high bit clear ? 4 : 0)`.
pub fn vec_dot_q3_k_q8_k_ref(x: &[BlockQ3_K], y: &[BlockQ8_K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let mut isum = 0i32;
        // Group g: sub-block j = g / 2 (2-bit field at shift 2 * (j % 4) of qs[32 * (j / 4) ..], high
        // bit j of hmask), bytes 16 * (g % 2) .. of both.
        for (g, act) in y.qs.chunks_exact(16).enumerate() {
            let (j, off) = (g / 2, 16 * (g % 2));
            let qs = &x.qs[32 * (j / 4) + off..][..16];
            let hm = &x.hmask[off..][..16];
            let shift = 2 * (j % 4);
            let mut s = 0i32;
            for ((&q, &h), &a) in qs.iter().zip(hm).zip(act) {
                let v = ((q >> shift) & 3) as i32 - ((((!h) >> j) & 1) as i32) * 4;
                s += v * a as i32;
            }
            isum += scale_q3_k(g, &x.scales) as i32 * s;
        }
        sumf += (f16(x.d) * y.d.get()) * isum as f32;
    }
    sumf
}

/// Shared body of q4_K and q5_K: `sub_dot(j, act)` is the integer dot of sub-block `j`'s 4- or 5-bit
/// values with its 32 activations. Returns the super-block's `(d * d_y) * isum - (dmin * d_y) * summs`.
#[inline]
fn dot_k4(
    d: F16Le,
    dmin: F16Le,
    scales: &[u8; 12],
    y: &BlockQ8_K,
    sub_dot: impl Fn(usize, &[i8]) -> i32,
) -> f32 {
    let (mut isum, mut summs) = (0i32, 0i32);
    for (j, (act, bsums)) in y.qs.chunks_exact(32).zip(y.bsums.chunks_exact(2)).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        isum += sc as i32 * sub_dot(j, act);
        summs += m as i32 * (bsums[0].get() as i32 + bsums[1].get() as i32);
    }
    let dy = y.d.get();
    (f16(d) * dy) * isum as f32 - (f16(dmin) * dy) * summs as f32
}

/// q4_K x q8_K: per super-block `(d_x * d_y) * isum - (dmin_x * d_y) * summs`, with
/// `isum = sum(sc_j * sum_j(q * a))` and `summs = sum(m_j * (bsums_2j + bsums_2j+1))`.
pub fn vec_dot_q4_k_q8_k_ref(x: &[BlockQ4_K], y: &[BlockQ8_K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        // Sub-block j: nibble j % 2 of qs[32 * (j / 2) + l].
        let sub_dot = |j: usize, act: &[i8]| {
            let (qs, shift) = (&x.qs[32 * (j / 2)..][..32], 4 * (j % 2));
            let mut s = 0i32;
            for (&q, &a) in qs.iter().zip(act) {
                s += ((q >> shift) & 0xF) as i32 * a as i32;
            }
            s
        };
        sumf += dot_k4(x.d, x.dmin, &x.scales, y, sub_dot);
    }
    sumf
}

/// q5_K x q8_K: as q4_K with the fifth bit of element `l` of sub-block `j` at bit `j` of `qh[l]`.
pub fn vec_dot_q5_k_q8_k_ref(x: &[BlockQ5_K], y: &[BlockQ8_K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let sub_dot = |j: usize, act: &[i8]| {
            let (qs, shift) = (&x.qs[32 * (j / 2)..][..32], 4 * (j % 2));
            let mut s = 0i32;
            for ((&q, &h), &a) in qs.iter().zip(&x.qh).zip(act) {
                let v = ((q >> shift) & 0xF) | (((h >> j) & 1) << 4);
                s += v as i32 * a as i32;
            }
            s
        };
        sumf += dot_k4(x.d, x.dmin, &x.scales, y, sub_dot);
    }
    sumf
}

/// q6_K x q8_K: per super-block `(d_x * d_y) * isum` with `isum = sum(scale_g * sum_g((q - 32) * a))`.
pub fn vec_dot_q6_k_q8_k_ref(x: &[BlockQ6_K], y: &[BlockQ8_K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sumf = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let mut isum = 0i32;
        // Group g: half h = g / 8, quarter k = (g / 2) % 4, bytes 16 * (g % 2) .. of the quarter.
        // Low four bits: nibble k / 2 of ql[64h + 32 (k % 2) + l]; high two: shift 2k of qh[32h + l].
        for (g, (act, &sc)) in y.qs.chunks_exact(16).zip(&x.scales).enumerate() {
            let (h, k, off) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let ql = &x.ql[64 * h + 32 * (k % 2) + off..][..16];
            let qh = &x.qh[32 * h + off..][..16];
            let (shift_l, shift_h) = (4 * (k / 2), 2 * k);
            let mut s = 0i32;
            for ((&l, &hb), &a) in ql.iter().zip(qh).zip(act) {
                let q = ((l >> shift_l) & 0xF) | (((hb >> shift_h) & 3) << 4);
                s += (q as i32 - 32) * a as i32;
            }
            isum += sc as i32 * s;
        }
        sumf += (f16(x.d) * y.d.get()) * isum as f32;
    }
    sumf
}

/// Dot product of the raw bytes of one weight row of type `weight` with one activation row of type
/// `vec_dot_type(weight)`.
///
/// Returns 0.0 when `weight` has no reference dot product or when the rows are not whole blocks of the
/// same element count; the executor only calls it for pairs it has validated.
pub fn vec_dot_ref(weight: GgmlType, w_row: &[u8], act_row: &[u8]) -> f32 {
    weight.traits().vec_dot.map_or(0.0, |(_, dot)| dot(w_row, act_row))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize::quantize_row_q8_0_ref;
    use crate::quant::quantize::{quantize_row_q4_0_ref, quantize_row_q4_1_ref};
    use crate::quant::{dequantize_row_ref, QK_K};
    use bytemuck::Zeroable;

    /// Longest row tested, and the largest byte size of such a row (f32).
    const MAX_N: usize = 512;
    const MAX_BYTES: usize = 4 * MAX_N;

    const WEIGHT_TYPES: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// xorshift32, so the tests need no dependency.
    struct Rng(u32);
    impl Rng {
        fn next(&mut self) -> u32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 17;
            self.0 ^= self.0 << 5;
            self.0
        }
        fn byte(&mut self) -> u8 {
            (self.next() >> 24) as u8
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        }
    }

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Case {
        /// Random weights and activations of varied magnitude per block.
        Random,
        /// Weight scales of +-65504 (f16 max); f32/f16/bf16 weights with +-65504 elements.
        Extreme,
        /// Some all-zero weight blocks and some all-zero activation blocks.
        ZeroBlocks,
    }

    /// Byte offsets of the f16 scale fields of a weight type's block.
    fn scale_fields(ty: GgmlType) -> &'static [usize] {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[],
        }
    }

    /// A weight row of `n` elements of `ty` in `out[..bytes]`; returns `bytes`. Q4_0/Q4_1/Q8_0 (and the
    /// float types) come from the reference quantizers, the others are random bytes with small finite
    /// random f16 scales.
    fn weight_row(ty: GgmlType, n: usize, case: Case, rng: &mut Rng, out: &mut [u8; MAX_BYTES]) -> usize {
        let bytes = ty.bytes_for(n as u64).unwrap() as usize;
        let w = &mut out[..bytes];
        let mut x = [0f32; MAX_N];
        for v in &mut x[..n] {
            *v = rng.unit() * 2.0;
        }
        match ty {
            GgmlType::Q4_0 => quantize_row_q4_0_ref(&x[..n], blocks_of_mut(w).unwrap()),
            GgmlType::Q4_1 => quantize_row_q4_1_ref(&x[..n], blocks_of_mut(w).unwrap()),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 => {
                assert!(from_float_ref(ty, &x[..n], w))
            }
            _ => {
                w.iter_mut().for_each(|b| *b = rng.byte());
                for block in w.chunks_exact_mut(ty.block_bytes()) {
                    for &at in scale_fields(ty) {
                        let mag = 0.0005 + 0.06 * libm::fabsf(rng.unit());
                        let v = if rng.next() & 1 == 0 { mag } else { -mag };
                        block[at..at + 2].copy_from_slice(&F16Le::from_f32(v).0);
                    }
                }
            }
        }
        match case {
            Case::Random => {}
            Case::Extreme if ty.is_quantized() => {
                for (i, block) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
                    let bits: u16 = if i % 2 == 0 { 0x7bff } else { 0xfbff };
                    for &at in scale_fields(ty) {
                        block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                    }
                }
            }
            Case::Extreme => {
                let size = ty.block_bytes();
                for i in (0..n).step_by(7) {
                    let v = if i % 2 == 0 { 65504.0 } else { -65504.0 };
                    assert!(from_float_ref(ty, &[v], &mut w[i * size..(i + 1) * size]));
                }
            }
            Case::ZeroBlocks => {
                // Chunks of max(32, block length) elements: every third one, from the first, is zero.
                let chunk = ty.bytes_for(ty.block_len().max(32) as u64).unwrap() as usize;
                for c in w.chunks_exact_mut(chunk).step_by(3) {
                    c.fill(0);
                }
            }
        }
        bytes
    }

    /// Activations: blocks of 32 with magnitudes from 0.01 to 30, signs mixed, one block all negative;
    /// for `ZeroBlocks`, every fourth block from the third is zero and so are elements 256..512.
    fn activations(n: usize, case: Case, rng: &mut Rng, x: &mut [f32; MAX_N]) {
        for (c, chunk) in x[..n].chunks_mut(32).enumerate() {
            let amp = [1.0, 0.01, 30.0, 0.3][(rng.next() % 4) as usize];
            for v in chunk.iter_mut() {
                *v = rng.unit() * amp;
                if c == 1 {
                    *v = -libm::fabsf(*v);
                }
            }
            if case == Case::ZeroBlocks && c % 4 == 2 {
                chunk.fill(0.0);
            }
        }
        if case == Case::ZeroBlocks && n >= 512 {
            x[256..512].fill(0.0);
        }
    }

    /// Worst-case rounding error of activation element `i` (original value `x`) converted to `ty`.
    ///
    /// Q8 types: half a quantization step `|d|/2` (plus 0.1% for the rounding of `x / d`), plus the
    /// f16 rounding of `d` (2^-11 relative, doubled since `q` is computed with the unrounded `d`) scaled
    /// by `|x|`; q8_K's `d` is f32. f16/bf16: half an ulp, 2^-11 / 2^-8 relative (+ f16 subnormal spacing).
    fn act_error(ty: GgmlType, act: &[u8], i: usize, x: f32) -> f64 {
        let x = libm::fabs(x as f64);
        match ty {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => x * 2f64.powi(-11) + 2f64.powi(-25),
            GgmlType::BF16 => x * 2f64.powi(-8),
            GgmlType::Q8_0 => {
                let d = blocks_of::<BlockQ8_0>(act).unwrap()[i / QK].d.to_f32() as f64;
                0.5005 * d.abs() + x * 2f64.powi(-10)
            }
            GgmlType::Q8_1 => {
                let d = blocks_of::<BlockQ8_1>(act).unwrap()[i / QK].d.to_f32() as f64;
                0.5005 * d.abs() + x * 2f64.powi(-10)
            }
            GgmlType::Q8_K => {
                let d = blocks_of::<BlockQ8_K>(act).unwrap()[i / 256].d.get() as f64;
                0.5005 * d.abs() + x * 2f64.powi(-20)
            }
            _ => unreachable!(),
        }
    }

    /// The min `m` of weight block `b` for the q8_1 pairs (whose kernels use the activation's stored `s`).
    fn weight_min(ty: GgmlType, w: &[u8], b: usize) -> Option<f64> {
        match ty {
            GgmlType::Q4_1 => Some(blocks_of::<BlockQ4_1>(w).unwrap()[b].m.to_f32() as f64),
            GgmlType::Q5_1 => Some(blocks_of::<BlockQ5_1>(w).unwrap()[b].m.to_f32() as f64),
            _ => None,
        }
    }

    /// Relative budget of the exactness check: the kernel's f32 scale products and block sums, relative
    /// to the sum of the magnitudes of all terms.
    const EXACT_REL: f64 = 1e-6;

    #[derive(Default, Debug)]
    struct Worst {
        /// max err / budget of the check against the original f32 activations
        vs_f32: f64,
        /// max err / sum(|w_i x_i|) of the same
        vs_f32_rel: f64,
        /// max err / magnitude of the check against dequantized activations
        vs_deq_rel: f64,
    }

    /// Runs both comparisons for one row pair; panics on failure.
    fn check(ty: GgmlType, n: usize, case: Case, seed: u32, worst: &mut Worst) {
        let ctx = (ty, n, case, seed);
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9) | 1);
        let mut w_buf = [0u8; MAX_BYTES];
        let w_bytes = weight_row(ty, n, case, &mut rng, &mut w_buf);
        let w = &w_buf[..w_bytes];
        let mut x = [0f32; MAX_N];
        activations(n, case, &mut rng, &mut x);
        let x = &x[..n];

        let at = vec_dot_type(ty).unwrap();
        let mut a_buf = [0u8; MAX_BYTES];
        let a = &mut a_buf[..at.bytes_for(n as u64).unwrap() as usize];
        assert!(from_float_ref(at, x, a), "{ctx:?}");
        let a = &*a;

        let (mut wf, mut yf) = ([0f32; MAX_N], [0f32; MAX_N]);
        dequantize_row_ref(ty, w, &mut wf[..n]).unwrap();
        dequantize_row_ref(at, a, &mut yf[..n]).unwrap();
        let (wf, yf) = (&wf[..n], &yf[..n]);

        let got = vec_dot_ref(ty, w, a) as f64;
        assert!(got.is_finite(), "{ctx:?}: {got}");

        // The q8_1 pairs use s = f16(d * sum(q)) instead of d16 * sum(q): per block, the exact value of
        // that term, its magnitude and its worst-case deviation.
        let (mut s_term, mut s_mag, mut s_err) = (0.0f64, 0.0f64, 0.0f64);
        if at == GgmlType::Q8_1 {
            for (b, blk) in blocks_of::<BlockQ8_1>(a).unwrap().iter().enumerate() {
                let m = weight_min(ty, w, b).unwrap();
                let s = blk.s.to_f32() as f64;
                let sum_y: f64 = yf[QK * b..QK * (b + 1)].iter().map(|&v| v as f64).sum();
                let abs_y: f64 = yf[QK * b..QK * (b + 1)].iter().map(|&v| libm::fabs(v as f64)).sum();
                s_term += m * (s - sum_y);
                s_mag += m.abs() * (s.abs() + abs_y);
                s_err += m.abs() * (s.abs() * 1.01 * 2f64.powi(-10) + 2f64.powi(-24));
            }
        }

        let (mut exact_x, mut exact_y, mut mag_x, mut mag_y, mut act_err) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (i, ((&wv, &xv), &yv)) in wf.iter().zip(x).zip(yf).enumerate() {
            let (wv, xv, yv) = (wv as f64, xv as f64, yv as f64);
            exact_x += wv * xv;
            exact_y += wv * yv;
            mag_x += libm::fabs(wv * xv);
            mag_y += libm::fabs(wv * yv);
            act_err += libm::fabs(wv) * act_error(at, a, i, xv as f32);
        }

        // 1. Against the dequantized activations (and q8_1's stored s): only f32 rounding
        // remains, so this checks the integer arithmetic and the bit placement exactly.
        let exact = exact_y + s_term;
        let mag = mag_y + s_mag;
        let err = libm::fabs(got - exact);
        assert!(err <= EXACT_REL * mag, "{ctx:?}: got {got}, exact {exact}, err {err}, magnitude {mag}");
        if mag > 0.0 {
            worst.vs_deq_rel = worst.vs_deq_rel.max(err / mag);
        }

        // 2. Against the original activations: the activation rounding, bounded element by element.
        let err = libm::fabs(got - exact_x);
        let budget = act_err + s_err + EXACT_REL * (mag_y + s_mag);
        assert!(err <= budget, "{ctx:?}: got {got}, f32 dot {exact_x}, err {err} > budget {budget}");
        if budget > 0.0 {
            worst.vs_f32 = worst.vs_f32.max(err / budget);
            worst.vs_f32_rel = worst.vs_f32_rel.max(err / mag_x);
        }
    }

    /// The vectorisable f16 dot gives its twin's bits on every length (tails of each size, empty
    /// rows) and on extreme values: subnormals, the largest finite, infinities, NaN.
    #[test]
    fn f16_lanes_dot_is_bit_identical_to_its_twin() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [0x0001u16, 0x03ff, 0x7bff, 0xfbff, 0x8000, 0x0000, 0x7c00, 0xfc00, 0x7e00, 0x3c00];
        for n in (0..=100).chain([255, 256, 257, 1000]) {
            for round in 0..3 {
                let row = |next: &mut dyn FnMut() -> u64| -> [F16Le; 1000] {
                    core::array::from_fn(|_| {
                        let r = next();
                        let bits = match round {
                            // Ordinary values of mixed sign and scale, no infinities or NaN.
                            0 => (r as u16) & 0xbfff,
                            1 => specials[(r % specials.len() as u64) as usize],
                            _ => r as u16,
                        };
                        F16Le::from_bits(bits)
                    })
                };
                let (x, y) = (row(&mut next), row(&mut next));
                let (x, y) = (&x[..n], &y[..n]);
                let (got, want) = (vec_dot_f16_lanes(x, y), vec_dot_f16_ggml_ref(x, y));
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "n {n} round {round}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn every_weight_type_matches_the_dequantized_dot() {
        for ty in WEIGHT_TYPES {
            let mut worst = Worst::default();
            let lengths: &[usize] = if ty.block_len() == QK_K { &[256, 512] } else { &[32, 96, 256, 512] };
            for &n in lengths {
                for case in [Case::Random, Case::Extreme, Case::ZeroBlocks] {
                    for seed in 1..=4 {
                        check(ty, n, case, seed + 100 * n as u32, &mut worst);
                    }
                }
            }
            // The simple budget holds too: within 1% of sum(|w_i x_i|) (measured: at most 0.4%, q2_K).
            assert!(worst.vs_f32_rel <= 0.01, "{ty}: {worst:?}");
            assert!(worst.vs_deq_rel <= EXACT_REL, "{ty}: {worst:?}");
            assert!(worst.vs_f32 > 0.0 || ty == GgmlType::F32, "{ty}: nothing measured");
        }
    }

    #[test]
    fn all_zero_rows_give_exact_zeros() {
        let mut rng = Rng(77);
        for ty in WEIGHT_TYPES {
            let n = 512;
            let mut w = [0u8; MAX_BYTES];
            let w_bytes = weight_row(ty, n, Case::Extreme, &mut rng, &mut w);
            let mut x = [0f32; MAX_N];
            activations(n, Case::Random, &mut rng, &mut x);
            let at = vec_dot_type(ty).unwrap();
            let a_bytes = at.bytes_for(n as u64).unwrap() as usize;
            let (mut a, zeros) = ([0u8; MAX_BYTES], [0u8; MAX_BYTES]);
            assert!(from_float_ref(at, &x[..n], &mut a[..a_bytes]));
            // Zero weights with random activations, and extreme weights with zero activations (quantized
            // from zeros, so q8_1's s and q8_K's bsums are zero too).
            assert_eq!(vec_dot_ref(ty, &zeros[..w_bytes], &a[..a_bytes]), 0.0, "{ty}");
            assert!(from_float_ref(at, &[0.0; MAX_N][..n], &mut a[..a_bytes]));
            assert_eq!(vec_dot_ref(ty, &w[..w_bytes], &a[..a_bytes]), 0.0, "{ty}");
        }
    }

    #[test]
    fn hand_computed_blocks() {
        // q4_0: d = 1, low nibbles 15 (-> 7), high nibbles 9 (-> 1); q8_0 d = 0.5, all quants 2.
        let w = [BlockQ4_0 { d: F16Le::from_f32(1.0), qs: [0x9f; 16] }];
        let a = [BlockQ8_0 { d: F16Le::from_f32(0.5), qs: [2; 32] }];
        assert_eq!(vec_dot_q4_0_q8_0_ref(&w, &a), (16 * 7 * 2 + 16 * 2) as f32 * 0.5);
        // The halves are not interchangeable: activations 1 for elements 0..16, 0 for 16..32.
        let mut half = a;
        half[0].qs = core::array::from_fn(|i| if i < 16 { 2 } else { 0 });
        assert_eq!(vec_dot_q4_0_q8_0_ref(&w, &half), 16.0 * 7.0 * 2.0 * 0.5);

        // q4_1: d = 1, m = -2, nibbles 1 (low) and 2 (high); q8_1 d = 0.5, quants 1, s = 16.
        let w = [BlockQ4_1 { d: F16Le::from_f32(1.0), m: F16Le::from_f32(-2.0), qs: [0x21; 16] }];
        let mut a = [BlockQ8_1 { d: F16Le::from_f32(0.5), s: F16Le::from_f32(16.0), qs: [1; 32] }];
        assert_eq!(vec_dot_q4_1_q8_1_ref(&w, &a), 0.5 * 48.0 - 2.0 * 16.0);
        // The min term is m * s as stored, not recomputed from the quants.
        a[0].s = F16Le::from_f32(20.0);
        assert_eq!(vec_dot_q4_1_q8_1_ref(&w, &a), 0.5 * 48.0 - 2.0 * 20.0);

        // q5_0: fifth bit set for element 0 only: element 0 is (0x10 | 1) - 16 = 1, the rest -15/-16.
        let w = [BlockQ5_0 { d: F16Le::from_f32(1.0), qh: [1, 0, 0, 0], qs: [0x01; 16] }];
        let mut a = [BlockQ8_0 { d: F16Le::from_f32(1.0), qs: [0; 32] }];
        a[0].qs[0] = 3;
        a[0].qs[16] = 1;
        assert_eq!(vec_dot_q5_0_q8_0_ref(&w, &a), 3.0 * 1.0 + 1.0 * -16.0);

        // q8_K min term of q4_K: all quants zero, sub-block 0 has min 1, dmin 2; the bsums carry it.
        let mut w = BlockQ4_K::zeroed();
        w.dmin = F16Le::from_f32(2.0);
        w.d = F16Le::from_f32(1.0);
        w.scales[4] = 1; // m[0] = 1
        let mut a = BlockQ8_K::zeroed();
        a.d = F32Le::from_f32(0.25);
        a.bsums[0] = I16Le::new(10);
        a.bsums[1] = I16Le::new(-3);
        a.bsums[2] = I16Le::new(100); // sub-block 1, min 0
        assert_eq!(vec_dot_q4_k_q8_k_ref(&[w], &[a]), -(2.0 * 0.25) * 7.0);
    }

    #[test]
    fn q8_1_matches_q8_0_and_carries_the_sum() {
        let mut rng = Rng(5);
        let mut x = [0f32; 4 * QK];
        for v in &mut x {
            *v = rng.unit() * 3.0;
        }
        x[32..64].fill(0.0);
        x[64] = 127.0; // block 2: d = 1 exactly, so ties are visible
        x[65..70].copy_from_slice(&[0.5, -0.5, 2.5, -3.5, 1.49]);
        let mut q8_0 = [BlockQ8_0::zeroed(); 4];
        let mut q8_1 = [BlockQ8_1::zeroed(); 4];
        quantize_row_q8_0_ref(&x, &mut q8_0);
        quantize_row_q8_1_ref(&x, &mut q8_1);
        for (b, (p, q)) in q8_0.iter().zip(&q8_1).enumerate() {
            assert_eq!((p.d, p.qs), (q.d, q.qs), "block {b}");
            let amax = x[QK * b..QK * (b + 1)].iter().fold(0f32, |m, v| m.max(v.abs()));
            let sum: i32 = q.qs.iter().map(|&v| v as i32).sum();
            assert_eq!(q.s, F16Le::from_f32(sum as f32 * (amax / 127.0)), "block {b}");
        }
        assert_eq!(q8_1[1], BlockQ8_1::zeroed());
        assert_eq!(&q8_1[2].qs[..6], &[127, 1, -1, 3, -4, 1], "ties away from zero");
    }

    #[test]
    fn bf16_rounds_to_nearest_even_like_ggml() {
        let bf = |bits: u32| f32_to_bf16_ref(f32::from_bits(bits)).to_bits();
        assert_eq!(bf(0x3f80_0000), 0x3f80); // 1.0
        assert_eq!(bf(0x3f80_8000), 0x3f80); // tie, even stays
        assert_eq!(bf(0x3f81_8000), 0x3f82); // tie, odd rounds up
        assert_eq!(bf(0x3f80_8001), 0x3f81); // above the tie
        assert_eq!(bf(0xbf80_7fff), 0xbf80); // below the tie, negative
        assert_eq!(bf(0x7f7f_ffff), 0x7f80); // past the largest bf16: infinity
        assert_eq!(bf(0xff80_0000), 0xff80); // -inf stays
        assert_eq!(bf(0x7f80_0001), 0x7fc0); // signalling NaN made quiet, not rounded to inf
        assert_eq!(bf(0xffc1_2345), 0xffc1);
        assert_eq!(bf(0x0000_8000), 0x0000); // subnormal tie to even zero
    }

    #[test]
    fn from_float_refuses_bad_requests() {
        let x = [0.5f32; 64];
        let mut out = [0u8; 600];
        assert!(from_float_ref(GgmlType::Q8_0, &x, &mut out[..68]));
        assert!(from_float_ref(GgmlType::Q8_1, &x, &mut out[..72]));
        assert!(from_float_ref(GgmlType::F16, &x[..3], &mut out[..6]));
        assert!(from_float_ref(GgmlType::F32, &[], &mut []));
        for (ty, n, bytes) in [
            (GgmlType::Q8_0, 64, 67),
            (GgmlType::Q8_0, 64, 69),
            (GgmlType::Q8_0, 33, 68),
            (GgmlType::Q8_K, 64, 292),
            (GgmlType::F32, 3, 11),
            (GgmlType::Q4_0, 64, 36),
            (GgmlType::Q4_K, 0, 0),
            (GgmlType::I8, 3, 3),
        ] {
            out[..bytes].fill(0xaa);
            assert!(!from_float_ref(ty, &x[..n], &mut out[..bytes]), "{ty} {n} {bytes}");
            assert!(out[..bytes].iter().all(|&b| b == 0xaa), "{ty}: output touched");
        }
        // Values round-trip through the float types.
        let v = [1.5f32, -65504.0, 3.0e-5];
        let mut f = [0u8; 12];
        assert!(from_float_ref(GgmlType::F32, &v, &mut f));
        assert_eq!(blocks_of::<F32Le>(&f).unwrap()[1].get(), -65504.0);
        assert!(from_float_ref(GgmlType::F16, &v, &mut f[..6]));
        assert_eq!(blocks_of::<F16Le>(&f[..6]).unwrap()[1].to_f32(), -65504.0);
    }

    #[test]
    fn vec_dot_type_table() {
        use GgmlType as T;
        for (w, a) in [
            (T::F32, T::F32),
            (T::F16, T::F16),
            (T::BF16, T::BF16),
            (T::Q4_0, T::Q8_0),
            (T::Q5_0, T::Q8_0),
            (T::Q8_0, T::Q8_0),
            (T::Q4_1, T::Q8_1),
            (T::Q5_1, T::Q8_1),
            (T::Q2_K, T::Q8_K),
            (T::Q3_K, T::Q8_K),
            (T::Q4_K, T::Q8_K),
            (T::Q5_K, T::Q8_K),
            (T::Q6_K, T::Q8_K),
        ] {
            assert_eq!(vec_dot_type(w), Some(a), "{w}");
            assert_eq!(w.block_len(), a.block_len(), "{w}: one activation block per weight block");
        }
        for w in [T::Q8_1, T::Q8_K, T::IQ2_XXS, T::IQ4_NL, T::I8, T::F64, T::TQ1_0, T::MXFP4] {
            assert_eq!(vec_dot_type(w), None, "{w}");
        }
    }

    #[test]
    fn vec_dot_ref_returns_zero_for_bad_pairs() {
        let mut w = [0u8; 2 * 144];
        let mut a = [0u8; 2 * 292];
        let mut rng = Rng(9);
        w.iter_mut().chain(a.iter_mut()).for_each(|b| *b = rng.byte() & 0x3f);
        let ok = vec_dot_ref(GgmlType::Q4_K, &w, &a);
        assert!(ok != 0.0 && ok.is_finite());
        assert_eq!(vec_dot_ref(GgmlType::Q4_K, &w[..144], &a), 0.0, "block counts differ");
        assert_eq!(vec_dot_ref(GgmlType::Q4_K, &w[..143], &a[..292]), 0.0, "partial weight block");
        assert_eq!(vec_dot_ref(GgmlType::Q4_K, &w[..144], &a[..291]), 0.0, "partial activation block");
        assert_eq!(vec_dot_ref(GgmlType::Q8_K, &a, &a), 0.0, "no dot for q8_K weights");
        assert_eq!(vec_dot_ref(GgmlType::IQ4_NL, &w[..36], &a[..68]), 0.0);
        assert_eq!(vec_dot_ref(GgmlType::Q4_0, &[], &[]), 0.0);
        assert_eq!(vec_dot_ref(GgmlType::F32, &w[..8], &a[..12]), 0.0);
    }

    #[test]
    fn float_dots_sum_in_f64() {
        // 65504^2 + 1 - 65504^2: an f32 sum loses the 1.
        let mut w = [0u8; 12];
        let mut a = [0u8; 12];
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let big = if ty == GgmlType::BF16 { 65536.0 } else { 65504.0 };
            let size = ty.block_bytes();
            assert!(from_float_ref(ty, &[big, 1.0, -big], &mut w[..3 * size]));
            assert!(from_float_ref(ty, &[big, 1.0, big], &mut a[..3 * size]));
            assert_eq!(vec_dot_ref(ty, &w[..3 * size], &a[..3 * size]), 1.0, "{ty}");
        }
        // Unaligned f32 rows are fine.
        let mut buf = [0u8; 13];
        assert!(from_float_ref(GgmlType::F32, &[2.0, -3.0, 0.5], &mut buf[1..13]));
        assert_eq!(vec_dot_ref(GgmlType::F32, &buf[1..13], &buf[1..13]), 4.0 + 9.0 + 0.25);
    }

    #[test]
    fn fast_f16_widening_is_exact_for_every_pattern() {
        for bits in 0..=u16::MAX {
            let h = F16Le::from_bits(bits);
            let (fast, slow) = (f16(h), h.to_f32());
            assert!(fast.to_bits() == slow.to_bits() || fast.is_nan() && slow.is_nan(), "{bits:#06x}");
        }
    }
}
