//! How close an NPU matmul must be to the exact product, and the comparison `pinfer selftest --npu`
//! and the tests make.
//!
//! The reference is exact: `Σ_i w_i·x_i` in f64 over the dequantized f32 weights and the f32 input.
//! The NPU's result differs only by the rounding of its inputs and of its sums, which can be bounded
//! per output element from the data alone (no tuned constants):
//!
//! * **fp16**: `ŵ = fp16(w)`, `x̂ = fp16(x)` are each within `u·|v| + e` of the value (`u = 2⁻¹¹`,
//!   `e = 2⁻²⁵` for subnormals); a product of two fp16 is exact in f32, and a sum of K f32 terms
//!   is within `γ ≈ (K+1)·2⁻²⁴` relative of `Σ|ŵ·x̂|`. So `|npu − exact| ≤ (2u + u²)·Σ|w·x| +
//!   e·(1+u)·(Σ|w| + Σ|x|) + K·e² + (K+1)·2⁻²⁴·(1+u)²·Σ|w·x|` — about `1e-3·Σ|w·x|` for usual K: a
//!   relative error of ~1e-3 of the sum of magnitudes, which is what fp16 can do.
//! * **int8**: with the scales `s_x = max|x|/127` (per token) and `s_w = max|w|/127` (per weight
//!   row), `|x − s_x·q_x| ≤ s_x/2` and likewise for w; the int32 sum is exact. So `|npu − exact| ≤
//!   (s_x/2)·Σ|w| + (s_w/2)·Σ|x| + K·s_x·s_w/4`, plus a few f32 roundings when the scales are
//!   applied. Coarser than fp16 (about 1/254 of the largest |x| and |w| per term, in the worst case),
//!   which is why fp16 is the default.
//!
//! The emulator must meet the bound exactly (the tests check every element); `selftest` on a board
//! allows twice the bound ([`Comparison::passes`]), as the hardware may order its f32 sums
//! differently.

use std::vec::Vec;

use super::Precision;

/// The exact product `out[t·n + j] = Σ_i w[j·k + i]·x[t·k + i]`, in f64.
pub fn reference_matmul(w: &[f32], x: &[f32], k: usize, n: usize) -> Vec<f64> {
    let rows = x.len() / k;
    let mut out = Vec::with_capacity(rows * n);
    for t in 0..rows {
        let xr = &x[t * k..(t + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            out.push(wr.iter().zip(xr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum());
        }
    }
    out
}

/// Largest |v| of a row.
pub(crate) fn abs_max(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, &x| m.max(x.abs()))
}

/// The int8 scale of a row with largest magnitude `amax` (1 for an all-zero row).
pub(crate) fn int8_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / 127.0
    } else {
        1.0
    }
}

/// Bound on `|npu − exact|` for one output element, weight row `w` and input row `x` (module docs).
pub fn error_bound(precision: Precision, w: &[f32], x: &[f32]) -> f64 {
    let k = w.len() as f64;
    let (mut swx, mut sw, mut sx) = (0f64, 0f64, 0f64);
    for (&a, &b) in w.iter().zip(x) {
        let (a, b) = (f64::from(a).abs(), f64::from(b).abs());
        swx += a * b;
        sw += a;
        sx += b;
    }
    let f32_eps = 2f64.powi(-24);
    match precision {
        Precision::Fp16 => {
            let (u, e) = (2f64.powi(-11), 2f64.powi(-25));
            (2.0 * u + u * u) * swx
                + e * (1.0 + u) * (sw + sx)
                + k * e * e
                + (k + 1.0) * f32_eps * (1.0 + u) * (1.0 + u) * swx
                + f64::from(f32::MIN_POSITIVE)
        }
        Precision::Int8 => {
            let (s_x, s_w) = (f64::from(int8_scale(abs_max(x))), f64::from(int8_scale(abs_max(w))));
            // The rounding of x / s in f32 can add 127·2⁻²³ of a step.
            let half = 0.5 + 127.0 * 2f64.powi(-23);
            let q = half * s_x * sw + half * s_w * sx + k * half * half * s_x * s_w;
            q + 16.0 * f32_eps * (swx + q) + f64::from(f32::MIN_POSITIVE)
        }
    }
}

/// How an NPU result compares with the exact product.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Comparison {
    /// Largest |npu − exact|.
    pub max_abs: f64,
    /// `max_abs` over the largest |exact| of the output.
    pub max_rel: f64,
    /// Largest `|npu − exact| / bound` over the elements (≤ 1: within the rounding bound).
    pub worst_ratio: f64,
    /// Elements compared.
    pub elements: usize,
    /// Whether every result was finite.
    pub finite: bool,
}

impl Comparison {
    /// Compares `got` (rows of `n`) with the exact product of weights `w` (`n` rows of `k`) and
    /// input `x` (rows of `k`).
    pub fn new(precision: Precision, w: &[f32], x: &[f32], k: usize, n: usize, got: &[f32]) -> Self {
        let exact = reference_matmul(w, x, k, n);
        let scale = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mut c = Self { elements: exact.len(), finite: true, ..Self::default() };
        for (i, (&e, &g)) in exact.iter().zip(got).enumerate() {
            let (t, j) = (i / n, i % n);
            if !g.is_finite() {
                c.finite = false;
                continue;
            }
            let err = (f64::from(g) - e).abs();
            let bound = error_bound(precision, &w[j * k..(j + 1) * k], &x[t * k..(t + 1) * k]);
            c.max_abs = c.max_abs.max(err);
            c.worst_ratio = c.worst_ratio.max(err / bound);
        }
        c.max_rel = if scale > 0.0 { c.max_abs / scale } else { c.max_abs };
        c
    }

    /// Whether every element is finite and within `slack` times its bound.
    pub fn passes(&self, slack: f64) -> bool {
        self.finite && self.worst_ratio <= slack && self.elements > 0
    }
}
