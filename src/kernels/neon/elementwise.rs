//! Row kernels: RMS norm, SwiGLU, f32 to f16, RoPE.

use core::arch::aarch64::*;
use core::arch::asm;

use super::*;
use crate::kernels::reference::{f32_to_f16_ref, rope_rotate_ref, swiglu_ref};
use crate::quant::blocks::F16Le;

// ---------------------------------------------------------------------------------------------
// RMS norm, SwiGLU

/// RMS norm, bit-identical to `reference::rms_norm_ref` (squares in f32, summed in f64 in order).
pub fn rms_norm(x: &[f32], out: &mut [f32], eps: f32) {
    debug_assert_eq!(x.len(), out.len());
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rms_norm_neon(x, out, eps) }
}

#[target_feature(enable = "neon")]
fn rms_norm_neon(x: &[f32], out: &mut [f32], eps: f32) {
    let mut sum = 0f64;
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for v in [ld_f32x4(c), ld_f32x4(&c[4..])] {
            let sq = vmulq_f32(v, v);
            let (lo, hi) = (vcvt_f64_f32(vget_low_f32(sq)), vcvt_high_f64_f32(sq));
            sum += vgetq_lane_f64::<0>(lo);
            sum += vgetq_lane_f64::<1>(lo);
            sum += vgetq_lane_f64::<0>(hi);
            sum += vgetq_lane_f64::<1>(hi);
        }
    }
    for &v in tail {
        sum += f64::from(v * v);
    }
    let mean = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / libm::sqrtf(mean + eps);
    let n = x.len().min(out.len());
    let whole = n - n % 16;
    for (o, x) in out[..whole].chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        st_f32x16(o, ld_f32x16(x).map(|v| vmulq_n_f32(v, scale)));
    }
    for (o, &v) in out[whole..n].iter_mut().zip(&x[whole..n]) {
        *o = v * scale;
    }
}

/// f16 dot product of a matmul on f16 weights, bit-identical to
/// `crate::kernels::dot::vec_dot_f16_lanes` (ggml's AVX2 order): runs of 32 (a shorter last run
/// zero-padded), chunk `c` of 8 into accumulator `c` as two registers of 4 lanes; the products
/// of two f16 are exact in f32, so a fused multiply-add rounds as the twin's product then sum.
pub fn dot_f16(x: &[F16Le], y: &[F16Le]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { dot_f16_neon(x, y) }
}

#[target_feature(enable = "neon")]
fn dot_f16_neon(x: &[F16Le], y: &[F16Le]) -> f32 {
    let n = x.len().min(y.len());
    let whole = n - n % 32;
    let mut acc = [vdupq_n_f32(0.0); 8];
    for start in (0..whole).step_by(32) {
        // SAFETY: 32 values from `start`, which is at most `whole - 32`.
        unsafe { f16_group(x[start..].as_ptr(), y[start..].as_ptr(), start == 0, &mut acc) };
    }
    if whole < n {
        let (mut px, mut py) = ([F16Le::from_bits(0); 32], [F16Le::from_bits(0); 32]);
        px[..n - whole].copy_from_slice(&x[whole..n]);
        py[..n - whole].copy_from_slice(&y[whole..n]);
        // SAFETY: 32 values in each array.
        unsafe { f16_group(px.as_ptr(), py.as_ptr(), whole == 0, &mut acc) };
    }
    fold_lanes(&acc)
}

/// The sum of 4 accumulators of 8 lanes held as 8 registers (register `r`: lanes `4 (r % 2)..` of
/// accumulator `r / 2`) in the twins' order: x = (acc0 + acc2) + (acc1 + acc3) lane by lane,
/// t = x[..4] + x[4..], then (t0 + t1) + (t2 + t3).
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn fold_lanes(acc: &[float32x4_t; 8]) -> f32 {
    let lo = vaddq_f32(vaddq_f32(acc[0], acc[4]), vaddq_f32(acc[2], acc[6]));
    let hi = vaddq_f32(vaddq_f32(acc[1], acc[5]), vaddq_f32(acc[3], acc[7]));
    let t = vaddq_f32(lo, hi);
    (vgetq_lane_f32::<0>(t) + vgetq_lane_f32::<1>(t)) + (vgetq_lane_f32::<2>(t) + vgetq_lane_f32::<3>(t))
}

/// One run of 32: `acc[2c]`, `acc[2c + 1]` take lanes 0-3 and 4-7 of chunk `c`'s products (set
/// by the first run, added to after).
///
/// # Safety
/// `x` and `y` point at 32 readable values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn f16_group(x: *const F16Le, y: *const F16Le, first: bool, acc: &mut [float32x4_t; 8]) {
    for c in 0..4 {
        // SAFETY: chunk c's 8 values are inside the 32 the caller guarantees.
        let ((xl, xh), (yl, yh)) = unsafe { (widen_f16x8(x.add(8 * c)), widen_f16x8(y.add(8 * c))) };
        if first {
            (acc[2 * c], acc[2 * c + 1]) = (vmulq_f32(xl, yl), vmulq_f32(xh, yh));
        } else {
            (acc[2 * c], acc[2 * c + 1]) = (vfmaq_f32(acc[2 * c], xl, yl), vfmaq_f32(acc[2 * c + 1], xh, yh));
        }
    }
}

/// 8 f16 values at `p` widened to f32 (lanes 0-3, 4-7). (`fcvtl` in assembly: the intrinsics
/// taking f16 vectors are not stable.)
///
/// # Safety
/// `p` points at 8 readable values.
#[inline(always)]
unsafe fn widen_f16x8(p: *const F16Le) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: reads 16 bytes at `p` (the caller's contract); writes only the declared registers.
    unsafe {
        asm!(
            "ldr {h:q}, [{p}]",
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            p = in(reg) p,
            h = out(vreg) _,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    (lo, hi)
}

/// f32 dot product, bit-identical to `crate::kernels::dot::vec_dot_f32_lanes`: its 4 x 8 lanes
/// are 8 registers of 4 (register `r` holds lanes `4 (r % 2)..` of accumulator `r / 2`).
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { dot_f32_neon(x, y) }
}

#[target_feature(enable = "neon")]
fn dot_f32_neon(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let whole = n - n % 32;
    let mut acc = [vdupq_n_f32(0.0); 8];
    for start in (0..whole).step_by(32) {
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: 4 f32 at start + 4r < whole <= n.
            let (vx, vy) = unsafe {
                (vld1q_f32(x.as_ptr().add(start + 4 * r)), vld1q_f32(y.as_ptr().add(start + 4 * r)))
            };
            // A product then a sum (no fused multiply-add), as the twin rounds.
            *a = vaddq_f32(*a, vmulq_f32(vx, vy));
        }
    }
    if whole < n {
        // The last run, zero-padded to 32 as the twin pads it (whole registers read in place).
        let (tx, ty) = (&x[whole..n], &y[whole..n]);
        for (r, a) in acc.iter_mut().enumerate() {
            let lo = 4 * r;
            let (vx, vy) = if lo + 4 <= tx.len() {
                // SAFETY: 4 f32 at lo inside the tail.
                unsafe { (vld1q_f32(tx.as_ptr().add(lo)), vld1q_f32(ty.as_ptr().add(lo))) }
            } else {
                let (mut px, mut py) = ([0f32; 4], [0f32; 4]);
                if lo < tx.len() {
                    px[..tx.len() - lo].copy_from_slice(&tx[lo..]);
                    py[..tx.len() - lo].copy_from_slice(&ty[lo..]);
                }
                // SAFETY: 4 f32 from 4-element arrays.
                unsafe { (vld1q_f32(px.as_ptr()), vld1q_f32(py.as_ptr())) }
            };
            *a = vaddq_f32(*a, vmulq_f32(vx, vy));
        }
    }
    fold_lanes(&acc)
}

/// `silu(gate) * up`, bit-identical to `reference::swiglu_ref`: ggml's exp polynomial with the
/// same fused steps and an exact 2^n scale; chunks with an input outside `|g| <= 86.5` (where
/// 2^n could leave the normal range) or a NaN take the scalar twin.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { swiglu_neon(gate, up, out) }
}

/// GELU through ggml's f16 table, bit-identical to `reference::gelu_ref` (NaN for NaN): the
/// inputs rounded to f16 (`fcvtn`, nearest even as the reference) and the table's values widened,
/// 8 at a time; the tail takes the reference.
pub fn gelu(x: &[f32], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { gelu_neon(x, out) }
}

#[target_feature(enable = "neon")]
fn gelu_neon(x: &[f32], out: &mut [f32]) {
    use core::sync::atomic::Ordering;
    let table = crate::kernels::reference::gelu_table();
    let n = x.len().min(out.len());
    let whole = n - n % 8;
    let (low, high, zero) = (vdupq_n_f32(-10.0), vdupq_n_f32(10.0), vdupq_n_f32(0.0));
    for (x, out) in x[..whole].chunks_exact(8).zip(out[..whole].chunks_exact_mut(8)) {
        let (a, b) = (ld_f32x4(x), ld_f32x4(&x[4..]));
        let mut bits = [F16Le::from_bits(0); 8];
        st_f16x8(&mut bits, f16_narrow(a, b));
        for h in &mut bits {
            *h = F16Le::from_bits(table[usize::from(h.to_bits())].load(Ordering::Relaxed));
        }
        // SAFETY: 8 values in `bits`.
        let (ga, gb) = unsafe { widen_f16x8(bits.as_ptr()) };
        for (i, (v, g)) in [(a, ga), (b, gb)].into_iter().enumerate() {
            // Saturated as the reference: x itself from 10 up, 0 up to -10.
            let g = vbslq_f32(vcgeq_f32(v, high), v, g);
            let g = vbslq_f32(vcleq_f32(v, low), zero, g);
            // SAFETY: 4 of the chunk's 8 floats.
            unsafe { vst1q_f32(out.as_mut_ptr().add(4 * i), g) };
        }
    }
    crate::kernels::reference::gelu_ref(&x[whole..n], &mut out[whole..n]);
}

/// Each value rounded to f16 and widened back, bit-identical to `reference::round_f16_ref` (NaN
/// for NaN), 8 at a time.
pub fn round_f16(x: &[f32], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { round_f16_neon(x, out) }
}

#[target_feature(enable = "neon")]
fn round_f16_neon(x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let whole = n - n % 8;
    for (x, out) in x[..whole].chunks_exact(8).zip(out[..whole].chunks_exact_mut(8)) {
        let h = f16_narrow(ld_f32x4(x), ld_f32x4(&x[4..]));
        // SAFETY: the chunk's 8 floats.
        unsafe {
            vst1q_f32(out.as_mut_ptr(), f16_lo(h));
            vst1q_f32(out.as_mut_ptr().add(4), f16_hi(h));
        }
    }
    crate::kernels::reference::round_f16_ref(&x[whole..n], &mut out[whole..n]);
}

#[target_feature(enable = "neon")]
fn swiglu_neon(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let whole = n - n % 16;
    swiglu_chunks(&gate[..whole], &up[..whole], &mut out[..whole]);
    if whole < n {
        // The tail padded to 16 lanes; every lane is computed on its own.
        let (mut g, mut u, mut o) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        g[..n - whole].copy_from_slice(&gate[whole..n]);
        u[..n - whole].copy_from_slice(&up[whole..n]);
        swiglu_chunks(&g, &u, &mut o);
        out[whole..n].copy_from_slice(&o[..n - whole]);
    }
}

/// The constants of `reference::ggml_expf`, and the fast-path bound.
struct ExpConsts {
    shift: float32x4_t,
    log2e: float32x4_t,
    ln2_hi: float32x4_t,
    ln2_lo: float32x4_t,
    c: [float32x4_t; 5],
    one: float32x4_t,
    bound: float32x4_t,
}

/// SwiGLU over whole chunks of 16.
#[target_feature(enable = "neon")]
fn swiglu_chunks(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let k = |bits: u32| vdupq_n_f32(f32::from_bits(bits));
    let e = ExpConsts {
        shift: k(0x4b40_0000),
        log2e: k(0x3fb8_aa3b),
        ln2_hi: k(0x3f31_7200),
        ln2_lo: k(0x35bf_be8e),
        c: [k(0x3f7f_fff6), k(0x3eff_fedb), k(0x3e2a_af33), k(0x3d2b_9f17), k(0x3c07_2010)],
        one: vdupq_n_f32(1.0),
        // |g| <= 86.5 keeps |n| <= 125: j * 2^n stays normal, so adding n to j's exponent is exact.
        bound: vdupq_n_f32(86.5),
    };
    // Every chunk on the fast path (no calls in the loop: the constants stay in registers), then
    // the rare chunks with an input outside the bound again through the twin.
    let mut all = vdupq_n_u32(u32::MAX);
    for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
        let (gv, uv) = (ld_f32x16(g), ld_f32x16(u));
        let ok = vandq_u32(
            vandq_u32(vcaleq_f32(gv[0], e.bound), vcaleq_f32(gv[1], e.bound)),
            vandq_u32(vcaleq_f32(gv[2], e.bound), vcaleq_f32(gv[3], e.bound)),
        );
        all = vandq_u32(all, ok);
        // (Written out, not `[0, 1, 2, 3].map(..)`: array::map's closure is not always inlined,
        // and then each chunk pays a call per lane group.)
        let lanes = [
            silu_mul(&e, gv[0], uv[0]),
            silu_mul(&e, gv[1], uv[1]),
            silu_mul(&e, gv[2], uv[2]),
            silu_mul(&e, gv[3], uv[3]),
        ];
        st_f32x16(o, lanes);
    }
    if vminvq_u32(all) == 0 {
        for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
            if g.iter().any(|g| g.is_nan() || g.abs() > 86.5) {
                swiglu_ref(g, u, o);
            }
        }
    }
}

/// `silu(g) * u` for 4 lanes with `|g| <= 86.5`: the steps of `reference::ggml_expf` (fused where
/// it uses fmaf) for `exp(-g)`.
#[target_feature(enable = "neon")]
#[inline]
fn silu_mul(e: &ExpConsts, g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let x = vnegq_f32(g);
    let z = vfmaq_f32(e.shift, x, e.log2e);
    let n = vsubq_f32(z, e.shift);
    let b = vfmsq_f32(vfmsq_f32(x, n, e.ln2_hi), n, e.ln2_lo);
    let uu = vmulq_f32(b, b);
    let p = vfmaq_f32(e.c[3], e.c[4], b);
    let q = vfmaq_f32(e.c[1], e.c[2], b);
    let r = vfmaq_f32(e.one, e.c[0], b);
    let j = vfmaq_f32(r, vfmaq_f32(q, p, uu), uu);
    // z = 1.5 * 2^23 + n, so z's bits shifted left by 23 are n << 23: add it to j's exponent.
    let ex = vaddq_u32(vreinterpretq_u32_f32(j), vshlq_n_u32::<23>(vreinterpretq_u32_f32(z)));
    vmulq_f32(vdivq_f32(g, vaddq_f32(e.one, vreinterpretq_f32_u32(ex))), u)
}

// ---------------------------------------------------------------------------------------------
// f32 -> f16 rows

/// `reference::f32_to_f16_ref` 8 values at a time (`fcvtn` rounds to nearest even, like it).
pub fn f32_to_f16(x: &[f32], out: &mut [F16Le]) {
    let n = x.len().min(out.len());
    let n8 = n - n % 8;
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { f32_to_f16_neon(&x[..n8], &mut out[..n8]) };
    f32_to_f16_ref(&x[n8..n], &mut out[n8..n]);
}

#[target_feature(enable = "neon")]
fn f32_to_f16_neon(x: &[f32], out: &mut [F16Le]) {
    for (x, o) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
        st_f16x8(o, f16_narrow(ld_f32x4(x), ld_f32x4(&x[4..])));
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE

/// `reference::rope_rotate_ref` four pairs at a time (the same products and sums, unfused).
pub fn rope_rotate(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    if sin.len() != half || x.len() < 2 * half || out.len() != x.len() {
        return rope_rotate_ref(x, out, cos, sin, neox);
    }
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rope_rotate_neon(x, out, cos, sin, neox) }
}

#[target_feature(enable = "neon")]
fn rope_rotate_neon(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    let n4 = half - half % 4;
    for i in (0..n4).step_by(4) {
        let (c, s) = (ld_f32x4(&cos[i..]), ld_f32x4(&sin[i..]));
        if neox {
            let (x0, x1) = (ld_f32x4(&x[i..]), ld_f32x4(&x[half + i..]));
            st_f32x4(&mut out[i..], vsubq_f32(vmulq_f32(x0, c), vmulq_f32(x1, s)));
            st_f32x4(&mut out[half + i..], vaddq_f32(vmulq_f32(x0, s), vmulq_f32(x1, c)));
        } else {
            let xs: &[f32; 8] = x[2 * i..2 * i + 8].try_into().unwrap();
            // SAFETY: reads the 8 floats of `xs`.
            let v = unsafe { vld2q_f32(xs.as_ptr()) };
            let r = float32x4x2_t(
                vsubq_f32(vmulq_f32(v.0, c), vmulq_f32(v.1, s)),
                vaddq_f32(vmulq_f32(v.0, s), vmulq_f32(v.1, c)),
            );
            let o: &mut [f32; 8] = (&mut out[2 * i..2 * i + 8]).try_into().unwrap();
            // SAFETY: writes the 8 floats of `o`.
            unsafe { vst2q_f32(o.as_mut_ptr(), r) };
        }
    }
    for i in n4..half {
        let (c, s) = (cos[i], sin[i]);
        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        out[a] = x0 * c - x1 * s;
        out[b] = x0 * s + x1 * c;
    }
    out[2 * half..].copy_from_slice(&x[2 * half..]);
}
