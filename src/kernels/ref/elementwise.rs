//! Row kernels: norms, activations, softmax, MoE routing, RoPE, f32 to f16.

use core::sync::atomic::{AtomicBool, AtomicU16, Ordering};

use libm::{ceilf, cosf, floorf, logf, sinf, sqrtf, tanhf};

use crate::quant::blocks::F16Le;

/// RMS norm: `out = x / sqrt(mean(x^2) + eps)`.
pub fn rms_norm_ref(x: &[f32], out: &mut [f32], eps: f32) {
    debug_assert_eq!(x.len(), out.len());
    // Squares in f32, summed in f64, as ggml does (matching it bit for bit matters: the result is
    // quantized to Q8 next, where a last-bit difference can flip a rounding tie).
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / sqrtf(mean + eps);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * scale;
    }
}

/// Layer norm without affine part: `out = (x - mean) / sqrt(var + eps)`.
pub fn layer_norm_ref(x: &[f32], out: &mut [f32], eps: f32) {
    debug_assert_eq!(x.len(), out.len());
    let n = x.len().max(1) as f64;
    let mean = (x.iter().map(|&v| f64::from(v)).sum::<f64>() / n) as f32;
    let var = (x.iter().map(|&v| f64::from(v - mean) * f64::from(v - mean)).sum::<f64>() / n) as f32;
    let scale = 1.0 / sqrtf(var + eps);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - mean) * scale;
    }
}

/// Softmax of `x * scale` over its first `visible` elements, where elements before `first_visible`
/// are also masked; masked outputs are 0. A row with nothing visible is all zeros.
pub fn soft_max_ref(x: &[f32], out: &mut [f32], scale: f32, first_visible: usize, visible_end: usize) {
    debug_assert_eq!(x.len(), out.len());
    let end = visible_end.min(x.len());
    let start = first_visible.min(end);
    out.fill(0.0);
    if start == end {
        return;
    }
    let mut max = f32::NEG_INFINITY;
    for &v in &x[start..end] {
        max = max.max(v * scale);
    }
    let mut sum = 0.0f64;
    for (o, &v) in out[start..end].iter_mut().zip(&x[start..end]) {
        let e = ggml_expf(v * scale - max);
        *o = e;
        sum += f64::from(e);
    }
    let inv = (1.0 / sum) as f32;
    for o in &mut out[start..end] {
        *o *= inv;
    }
}

/// `x` times the orthonormal Walsh-Hadamard matrix of size `n` in each run of `n` values (`H[i][j]
/// = (-1)^popcount(i & j) / sqrt(n)`, Sylvester's order, as llama.cpp's KV cache rotation): the fast
/// transform's butterflies, then the scale. `n` a power of two; a tail shorter than `n` is copied.
pub fn hadamard_ref(x: &[f32], out: &mut [f32], n: usize) {
    let len = x.len().min(out.len());
    out[..len].copy_from_slice(&x[..len]);
    if n < 2 || !n.is_power_of_two() {
        return;
    }
    let scale = 1.0 / libm::sqrtf(n as f32);
    for run in out[..len].chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for pair in run.chunks_exact_mut(2 * h) {
                let (lo, hi) = pair.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        run.iter_mut().for_each(|v| *v *= scale);
    }
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu_ref(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = silu(v);
    }
}

/// Logistic sigmoid, `1 / (1 + exp(-x))` with libm's `expf` (as ggml's CPU sigmoid).
pub fn sigmoid_ref(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = 1.0 / (1.0 + libm::expf(-v));
    }
}

/// Indices of the `out.len()` largest values of `row`, largest first; equal values go to the lower
/// index, so routing is deterministic. Returns false (and writes `0..k`) if `row` holds a NaN or
/// an infinity: no expert choice is meaningful then.
pub fn top_k_ref(row: &[f32], out: &mut [i32]) -> bool {
    if row.iter().any(|v| !v.is_finite()) {
        out.iter_mut().enumerate().for_each(|(i, o)| *o = i as i32);
        return false;
    }
    for j in 0..out.len() {
        let mut best: Option<usize> = None;
        for (i, &v) in row.iter().enumerate() {
            if out[..j].contains(&(i as i32)) {
                continue;
            }
            if best.is_none_or(|b| v > row[b]) {
                best = Some(i);
            }
        }
        out[j] = best.unwrap_or(0) as i32;
    }
    true
}

/// Smallest sum the renormalised expert weights are divided by (llama.cpp's clamp: f16's
/// smallest normal).
pub const MOE_WEIGHT_SUM_MIN: f32 = 6.103_515_6e-5;

/// `probs` at the indices `ids`; with `normalize`, divided by their sum (summed in f64, as ggml's
/// `sum_rows`). Returns false if an index is outside `probs` (its weight is then 0).
pub fn moe_weights_ref(probs: &[f32], ids: &[i32], normalize: bool, out: &mut [f32]) -> bool {
    let mut ok = true;
    for (o, &e) in out.iter_mut().zip(ids) {
        *o = match usize::try_from(e).ok().and_then(|e| probs.get(e)) {
            Some(&p) => p,
            None => {
                ok = false;
                0.0
            }
        };
    }
    if normalize {
        // ggml's sum (in double), clamped below as llama.cpp's build_moe_ffn does.
        let sum = out.iter().map(|&w| f64::from(w)).sum::<f64>() as f32;
        let sum = sum.max(MOE_WEIGHT_SUM_MIN);
        out.iter_mut().for_each(|w| *w /= sum);
    }
    ok
}

/// `sum_j experts[j] * weights[j]` over the `weights.len()` rows of `experts` (each `out.len()`
/// long): each product rounded, then added in expert order (ggml multiplies, then adds views).
pub fn moe_sum_ref(experts: &[f32], weights: &[f32], out: &mut [f32]) {
    let m = out.len();
    for (j, (&w, row)) in weights.iter().zip(experts.chunks_exact(m)).enumerate() {
        if j == 0 {
            out.iter_mut().zip(row).for_each(|(o, &x)| *o = x * w);
        } else {
            out.iter_mut().zip(row).for_each(|(o, &x)| *o += x * w);
        }
    }
}

/// One step of a channel's short convolution: the output for input `x` over the channel's
/// `state` (its last `taps.len() - 1` inputs, oldest first; zeros when `fresh`), summed from the
/// oldest tap as ggml's `ssm_conv`; the state then moves on by `x`.
pub fn short_conv_step_ref(state: &mut [f32], taps: &[f32], x: f32, fresh: bool) -> f32 {
    if fresh {
        state.fill(0.0);
    }
    let mut sum = 0.0f32;
    for (&s, &w) in state.iter().zip(taps) {
        sum += s * w;
    }
    sum += x * taps[state.len()];
    if let Some(last) = state.len().checked_sub(1) {
        state.copy_within(1.., 0);
        state[last] = x;
    }
    sum
}

/// `ln(1 + exp(x))`, and `x` itself above 20, as ggml computes it.
pub fn softplus_ref(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if v > 20.0 { v } else { libm::logf(1.0 + libm::expf(v)) };
    }
}

/// `sum_i a[i] * b[i]` in eight lanes (the shape of ggml's vectorised f32 dot, and one the
/// compiler vectorises), lanes added pairwise at the end.
pub fn dot_f32_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let quads = [lanes[0] + lanes[4], lanes[1] + lanes[5], lanes[2] + lanes[6], lanes[3] + lanes[7]];
    (quads[0] + quads[2]) + (quads[1] + quads[3]) + tail
}

/// One token of one head of the gated delta rule (see `Op::GatedDeltaNet`): `state` is the
/// head's `d x d` matrix stored transposed (`state[j * d + i] = S[i][j]`, zeros first when
/// `fresh`), decayed by `exp(g)`, written `beta * (v - S^T k)` along `k`; `out = S^T q / sqrt(d)`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_step_ref(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    fresh: bool,
    out: &mut [f32],
) {
    let d = v.len();
    if fresh {
        state.fill(0.0);
    }
    let decay = libm::expf(g);
    let scale = 1.0 / libm::sqrtf(d as f32);
    // Row j of the stored matrix (column j of S) is all that its delta, its update and its output
    // read: one pass per row while it is in cache, the same operations in the same order as
    // ggml's four passes over the whole state.
    for (j, (row, o)) in state.chunks_exact_mut(d).zip(out.iter_mut()).enumerate() {
        row.iter_mut().for_each(|s| *s *= decay);
        let delta = (v[j] - dot_f32_lanes(row, k)) * beta;
        row.iter_mut().zip(k).for_each(|(s, &ki)| *s += ki * delta);
        *o = dot_f32_lanes(row, q) * scale;
    }
}

/// GELU with the tanh approximation.
pub fn gelu_ref(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = gelu(v);
    }
}

/// `silu(gate) * up`.
pub fn swiglu_ref(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// `gelu(gate) * up`.
pub fn geglu_ref(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu(g) * u;
    }
}

/// `exp(x)` as ggml's vectorised activations compute it (the Arm optimized-routines polynomial in
/// its AVX-512 arrangement, max error ~1.5 ulp), not the correctly rounded libm one. SiLU and softmax
/// use it in llama.cpp, and a 1-ulp difference there flips Q8 rounding ties a few layers later.
#[inline]
pub fn ggml_expf(x: f32) -> f32 {
    use libm::fmaf;
    const SHIFT: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23: rounds to an integer when added
    const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
    const C1: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
    const C2: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    const C3: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    const C4: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    const C5: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
    let z = fmaf(x, LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = fmaf(-n, LN2_LO, fmaf(-n, LN2_HI, x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = fmaf(fmaf(fmaf(C5, b, C4), u, fmaf(C3, b, C2)), u, fmaf(C1, b, 1.0));
    // scalef: j * 2^n with one rounding (exact in f64, then rounded once to f32, subnormals included).
    (f64::from(j) * libm::exp2(f64::from(n))) as f32
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(-x))
}

/// GELU (tanh form) as ggml's CPU backend computes it: through a 64 Ki-entry f16 table, so the
/// input is rounded to f16 and so is the result; saturated outside (-10, 10). The rounding is
/// large enough (Gemma's step-0 logits moved by 0.36) that matching llama.cpp needs it too.
/// The table ([`gelu_table`]) holds [`gelu_f16`] of every f16 input: the same values, without a
/// `tanhf` per element (Gemma's GeGLU runs ~430 Ki of them per token at E2B's size).
#[inline]
fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let bits = half::f16::from_f32(x).to_bits();
        half::f16::from_bits(gelu_table()[bits as usize].load(Ordering::Relaxed)).to_f32()
    }
}

/// GELU of an f16 input, rounded to f16: one entry of ggml's table.
pub fn gelu_f16(x16: half::f16) -> half::f16 {
    half::f16::from_f32(gelu_exact(x16.to_f32()))
}

/// [`gelu_f16`] of every f16 bit pattern, filled on first use (a few milliseconds; threads that
/// race to fill it store the same values).
static GELU_TABLE: [AtomicU16; 1 << 16] = [const { AtomicU16::new(0) }; 1 << 16];
static GELU_READY: AtomicBool = AtomicBool::new(false);

/// The filled GELU table.
pub fn gelu_table() -> &'static [AtomicU16; 1 << 16] {
    if !GELU_READY.load(Ordering::Acquire) {
        for (bits, slot) in GELU_TABLE.iter().enumerate() {
            slot.store(gelu_f16(half::f16::from_bits(bits as u16)).to_bits(), Ordering::Relaxed);
        }
        GELU_READY.store(true, Ordering::Release);
    }
    &GELU_TABLE
}

#[inline]
fn gelu_exact(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + tanhf(SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)))
}

/// RoPE parameters shared by every row of one op.
#[derive(Debug, Clone, Copy)]
pub struct RopeParams<'a> {
    /// Leading dimensions rotated (even).
    pub n_rot: usize,
    /// Pairs are `(i, i + n_rot/2)` (NeoX) instead of `(2i, 2i+1)`.
    pub neox: bool,
    /// Frequency base.
    pub freq_base: f32,
    /// Frequency scale (linear position scaling).
    pub freq_scale: f32,
    /// Optional per-pair frequency divisors (`n_rot / 2` of them).
    pub freq_factors: Option<&'a [f32]>,
    /// YaRN's blend of interpolated and extrapolated angles, if the model scales RoPE so.
    pub yarn: Option<Yarn>,
}

/// YaRN (ggml's `rope_yarn`): pairs below `corr_dims[0]` keep their extrapolated (unscaled) angle,
/// pairs above `corr_dims[1]` the interpolated one (times the frequency scale), a linear ramp
/// between; `ext_factor` weighs the blend (1 for YaRN files).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Weight of the extrapolated angle.
    pub ext_factor: f32,
    /// First and last pair of the ramp (ggml's `ggml_rope_yarn_corr_dims`).
    pub corr_dims: [f32; 2],
}

impl Yarn {
    /// The ramp's ends for `n_rot` rotated dimensions, a model trained at `n_ctx_orig` positions,
    /// RoPE base `freq_base` and llama.cpp's beta_fast/beta_slow (32 and 1 unless a model says).
    pub fn corr_dims(
        n_rot: usize,
        n_ctx_orig: u32,
        freq_base: f32,
        beta_fast: f32,
        beta_slow: f32,
    ) -> [f32; 2] {
        let dim = |n_rotations: f32| {
            n_rot as f32 * logf(n_ctx_orig as f32 / (n_rotations * 2.0 * core::f32::consts::PI))
                / (2.0 * logf(freq_base))
        };
        let start = floorf(dim(beta_fast));
        let end = ceilf(dim(beta_slow));
        [start.max(0.0), end.min(n_rot as f32 - 1.0)]
    }

    /// The angle of pair `i` from its extrapolated angle `theta_extrap` at `freq_scale`.
    #[inline]
    fn theta(&self, i: usize, theta_extrap: f32, freq_scale: f32) -> f32 {
        let theta_interp = freq_scale * theta_extrap;
        let y = (i as f32 - self.corr_dims[0]) / (self.corr_dims[1] - self.corr_dims[0]).max(0.001);
        let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
        theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix
    }
}

/// Rotates one head vector `x` at position `pos` into `out`; dimensions past `n_rot` are copied.
pub fn rope_ref(x: &[f32], out: &mut [f32], pos: usize, p: &RopeParams<'_>) {
    debug_assert!(p.n_rot % 2 == 0 && p.n_rot <= x.len() && x.len() == out.len());
    let half = p.n_rot / 2;
    let (mut cos, mut sin) = ([0f32; 64], [0f32; 64]);
    for i in (0..half).step_by(64) {
        let n = (half - i).min(64);
        rope_table_ref(pos, p, i, &mut cos[..n], &mut sin[..n]);
        rope_pairs_ref(x, out, i, &cos[..n], &sin[..n], p);
    }
    out[p.n_rot..].copy_from_slice(&x[p.n_rot..]);
}

/// The cosines and sines of RoPE's angles at position `pos` for pairs `first..first + cos.len()`
/// (`sin` as long): what every head at that position rotates by.
pub fn rope_table_ref(pos: usize, p: &RopeParams<'_>, first: usize, cos: &mut [f32], sin: &mut [f32]) {
    debug_assert!(cos.len() == sin.len() && first + cos.len() <= p.n_rot / 2);
    let theta_scale = libm::powf(p.freq_base, -2.0 / p.n_rot as f32);
    // ggml's recurrence: theta_i = pos * theta_scale^i, multiplied up pair by pair.
    let mut theta_base = pos as f32;
    for _ in 0..first {
        theta_base *= theta_scale;
    }
    for (i, (c, s)) in cos.iter_mut().zip(sin.iter_mut()).enumerate() {
        let factor = p.freq_factors.map_or(1.0, |f| f[first + i]);
        let theta = match &p.yarn {
            // ggml's order: the extrapolated angle first, then scaled.
            Some(yarn) => yarn.theta(first + i, theta_base / factor, p.freq_scale),
            None => p.freq_scale * theta_base / factor,
        };
        (*c, *s) = (cosf(theta), sinf(theta));
        theta_base *= theta_scale;
    }
}

/// Rotates pairs `first..first + cos.len()` of `x` into `out` by the angles of
/// [`rope_table_ref`] (dimensions past `n_rot` are left alone).
pub fn rope_pairs_ref(
    x: &[f32],
    out: &mut [f32],
    first: usize,
    cos: &[f32],
    sin: &[f32],
    p: &RopeParams<'_>,
) {
    let half = p.n_rot / 2;
    for (i, (&c, &s)) in (first..).zip(cos.iter().zip(sin)) {
        let (a, b) = if p.neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        out[a] = x0 * c - x1 * s;
        out[b] = x0 * s + x1 * c;
    }
}

/// Rotates the first `2 cos.len()` dimensions of `x` into `out` by a [`rope_table_ref`] table of
/// all `n_rot / 2` pairs (NeoX pairs when `neox`) and copies the rest: [`rope_ref`]'s result.
pub fn rope_rotate_ref(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let n_rot = 2 * cos.len();
    let p = RopeParams { n_rot, neox, freq_base: 0.0, freq_scale: 0.0, freq_factors: None, yarn: None };
    rope_pairs_ref(x, out, 0, cos, sin, &p);
    out[n_rot..].copy_from_slice(&x[n_rot..]);
}

/// `out[i] = f16(x[i])` (round to nearest even; what the KV cache stores).
pub fn f32_to_f16_ref(x: &[f32], out: &mut [F16Le]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = F16Le::from_f32(v);
    }
}

/// Each value rounded to f16 (nearest even) and widened back to f32.
pub fn round_f16_ref(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = F16Le::from_f32(v).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table gives what computing each value does: the input rounded to f16, GELU, rounded
    /// to f16 (every f16 input inside (-10, 10), and values between them), saturated outside.
    #[test]
    fn gelu_by_table_is_gelu_of_the_f16_input() {
        let direct = |x: f32| {
            if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                half::f16::from_f32(gelu_exact(half::f16::from_f32(x).to_f32())).to_f32()
            }
        };
        let mut checked = 0;
        for bits in 0..=u16::MAX {
            let x = half::f16::from_bits(bits).to_f32();
            if !x.is_finite() {
                continue;
            }
            for v in [x, x * 1.000_3, -x * 0.999_7, x + 0.01] {
                let (mut out, want) = ([0f32], direct(v));
                gelu_ref(&[v], &mut out);
                assert_eq!(out[0].to_bits(), want.to_bits(), "gelu({v})");
                checked += 1;
            }
        }
        assert!(checked > 200_000);
    }
}
