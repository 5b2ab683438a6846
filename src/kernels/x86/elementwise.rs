//! Row kernels: RMS norm, SwiGLU, the f16 dot of matmuls on f16 weights, the f32 dot.

use core::arch::x86_64::*;

use crate::kernels::dot::f16_groups_of_32;
use crate::kernels::reference::swiglu_ref;
use crate::quant::blocks::F16Le;

/// f16 dot product in ggml's AVX2 order, bit-identical to
/// [`crate::kernels::dot::vec_dot_f16_lanes`] (F16C conversions instead of its bit arithmetic).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn dot_f16_avx2(x: &[F16Le], y: &[F16Le]) -> f32 {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { dot_f16_impl(x, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_impl(x: &[F16Le], y: &[F16Le]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    f16_groups_of_32(x, y, |first, gx, gy| {
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: 8 f16 (16 bytes) at 8c of the group's 32; the CPU features are this
            // function's.
            let (vx, vy) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(gx.as_ptr().add(8 * c).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(gy.as_ptr().add(8 * c).cast())),
                )
            };
            // Exact products (11-bit significands); added as the twin adds them.
            let p = _mm256_mul_ps(vx, vy);
            *a = if first { p } else { _mm256_add_ps(*a, p) };
        }
    });
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let mut lanes = [0f32; 4];
    // SAFETY: four f32 into a four-element array.
    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), t) };
    (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
}

/// f32 dot product, bit-identical to [`crate::kernels::dot::vec_dot_f32_lanes`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn dot_f32_avx2(x: &[f32], y: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { dot_f32_impl(x, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32_impl(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let whole = n - n % 32;
    let mut acc = [_mm256_setzero_ps(); 4];
    for start in (0..whole).step_by(32) {
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: 8 f32 at start + 8c < whole <= n; the CPU features are this function's.
            let (vx, vy) = unsafe {
                (
                    _mm256_loadu_ps(x.as_ptr().add(start + 8 * c)),
                    _mm256_loadu_ps(y.as_ptr().add(start + 8 * c)),
                )
            };
            // A product then a sum (no fused multiply-add), as the twin rounds.
            *a = _mm256_add_ps(*a, _mm256_mul_ps(vx, vy));
        }
    }
    if whole < n {
        // The last run, zero-padded to 32 as the twin pads it: whole vectors read in place, the
        // partial one copied (short dots, such as a LoRA B's rank, are mostly this).
        let (tx, ty) = (&x[whole..n], &y[whole..n]);
        for (c, a) in acc.iter_mut().enumerate() {
            let lo = 8 * c;
            let (vx, vy) = if lo + 8 <= tx.len() {
                // SAFETY: 8 f32 at lo inside the tail.
                unsafe { (_mm256_loadu_ps(tx.as_ptr().add(lo)), _mm256_loadu_ps(ty.as_ptr().add(lo))) }
            } else {
                let (mut px, mut py) = ([0f32; 8], [0f32; 8]);
                if lo < tx.len() {
                    px[..tx.len() - lo].copy_from_slice(&tx[lo..]);
                    py[..tx.len() - lo].copy_from_slice(&ty[lo..]);
                }
                // SAFETY: 8 f32 from 8-element arrays.
                unsafe { (_mm256_loadu_ps(px.as_ptr()), _mm256_loadu_ps(py.as_ptr())) }
            };
            *a = _mm256_add_ps(*a, _mm256_mul_ps(vx, vy));
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let mut lanes = [0f32; 4];
    // SAFETY: four f32 into a four-element array.
    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), t) };
    (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
}

/// RMS norm (see [`crate::kernels::reference::rms_norm_ref`]): squares in f32 summed in f64, in another
/// order.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn rms_norm_avx2(x: &[f32], out: &mut [f32], eps: f32) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { rms_norm_impl(x, out, eps) }
}

/// GELU through ggml's f16 table, bit-identical to [`crate::kernels::reference::gelu_ref`] (NaN
/// for NaN): F16C rounds the inputs to f16 (nearest even, as the reference) and widens the table's
/// values, 8 at a time; the tail takes the reference.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn gelu_avx2(x: &[f32], out: &mut [f32]) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { gelu_impl(x, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn gelu_impl(x: &[f32], out: &mut [f32]) {
    use core::sync::atomic::Ordering;
    let table = crate::kernels::reference::gelu_table();
    let n = x.len().min(out.len());
    let whole = n - n % 8;
    let (low, high) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
    for (x, out) in x[..whole].chunks_exact(8).zip(out[..whole].chunks_exact_mut(8)) {
        // SAFETY: 8 floats of each chunk; the CPU features are this function's.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr());
            let mut bits = [0u16; 8];
            _mm_storeu_si128(bits.as_mut_ptr().cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
            for b in &mut bits {
                *b = table[usize::from(*b)].load(Ordering::Relaxed);
            }
            let g = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr().cast()));
            // Saturated as the reference: x itself from 10 up, 0 up to -10.
            let g = _mm256_blendv_ps(g, v, _mm256_cmp_ps::<_CMP_GE_OQ>(v, high));
            let g = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(v, low), g);
            _mm256_storeu_ps(out.as_mut_ptr(), g);
        }
    }
    crate::kernels::reference::gelu_ref(&x[whole..n], &mut out[whole..n]);
}

/// Each value rounded to f16 and widened back, bit-identical to
/// [`crate::kernels::reference::round_f16_ref`] (NaN for NaN), 8 at a time (F16C).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn round_f16_avx2(x: &[f32], out: &mut [f32]) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { round_f16_impl(x, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn round_f16_impl(x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let whole = n - n % 8;
    for (x, out) in x[..whole].chunks_exact(8).zip(out[..whole].chunks_exact_mut(8)) {
        // SAFETY: 8 floats of each chunk; the CPU features are this function's.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr()));
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    crate::kernels::reference::round_f16_ref(&x[whole..n], &mut out[whole..n]);
}

/// `silu(gate) * up`, bit-identical to [`crate::kernels::reference::swiglu_ref`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { swiglu_impl(gate, up, out) }
}

// ---------------------------------------------------------------------------------------------
// RMS norm, SwiGLU
// ---------------------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
fn rms_norm_impl(x: &[f32], out: &mut [f32], eps: f32) {
    let mut acc = [_mm256_setzero_pd(); 4];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for h in 0..2 {
            // SAFETY: 8 of the chunk's 16 f32.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * h)) };
            let sq = _mm256_mul_ps(v, v);
            acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
            acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(sq)));
        }
    }
    let s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    let s = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd::<1>(s));
    let mut sum = _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    for &v in chunks.remainder() {
        sum += f64::from(v * v);
    }
    let mean = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / libm::sqrtf(mean + eps);
    let n = x.len().min(out.len());
    let sv = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n <= both lengths.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), sv))
        };
        i += 8;
    }
    for (o, &v) in out[i..n].iter_mut().zip(&x[i..n]) {
        *o = v * scale;
    }
}

/// [`crate::kernels::reference::ggml_expf`] on 8 lanes, with the same operations in the same order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn expf8(x: __m256) -> __m256 {
    let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let shift = c(0x4b40_0000);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), shift);
    let n = _mm256_sub_ps(z, shift);
    // fma(-n, hi, x) is -(n * hi) + x: fnmadd.
    let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
    );
    // j * 2^n with one rounding: n = n1 + n2, |n1|, |n2| <= 96, j * 2^n1 exact (normal), the
    // second product rounds once (to a subnormal, or to infinity, as the reference's f64 does).
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let pow2 = |k: __m256i| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))))
    };
    let r = _mm256_mul_ps(_mm256_mul_ps(j, pow2(n1)), pow2(n2));
    // |n| > 192: 0 or infinity (a NaN n compares false and stays NaN through j).
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_andnot_ps(_mm256_set1_ps(-0.0), n), _mm256_set1_ps(192.0));
    let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(n, _mm256_setzero_ps());
    let special = _mm256_and_ps(pos, _mm256_set1_ps(f32::INFINITY));
    _mm256_blendv_ps(r, special, big)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn swiglu_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let one = _mm256_set1_ps(1.0);
    let neg = _mm256_set1_ps(-0.0);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n <= all three lengths.
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = expf8(_mm256_xor_ps(g, neg));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u),
            );
        }
        i += 8;
    }
    swiglu_ref(&gate[i..n], &up[i..n], &mut out[i..n]);
}
