//! Scalar reference quantizers, following ggml's `quantize_row_*_ref` rules exactly.
//!
//! q4_0/q4_1/q8_0 quantize weights (and q8_0 activations); q8_K quantizes activations for the
//! K-quant dot products. Lengths are the caller's job (`debug_assert!`; in release a short `out` just
//! stops early). Inputs are expected finite; a block whose scale overflows f16 gets an infinite
//! scale, as in ggml.

use super::blocks::*;
use super::QK_K;

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
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
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
}
