//! Portable scalar reference kernels: the twins every SIMD kernel is tested against.
//!
//! They work on slices whose lengths the graph builder already checked; `debug_assert!`s restate
//! those preconditions. Math follows ggml's CPU reference where it matters for matching llama.cpp
//! (RoPE angle recurrence, softmax order of operations, GELU's tanh form).

use libm::{cosf, expf, sinf, sqrtf, tanhf};

use crate::kernels::dot::vec_dot_f16_f16_ref;
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
        let sum = out.iter().map(|&w| f64::from(w)).sum::<f64>() as f32;
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
#[inline]
fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let x16 = half::f16::from_f32(x).to_f32();
        half::f16::from_f32(gelu_exact(x16)).to_f32()
    }
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
        let theta = p.freq_scale * theta_base / factor;
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
    let p = RopeParams { n_rot, neox, freq_base: 0.0, freq_scale: 0.0, freq_factors: None };
    rope_pairs_ref(x, out, 0, cos, sin, &p);
    out[n_rot..].copy_from_slice(&x[n_rot..]);
}

/// `out[i] = f16(x[i])` (round to nearest even; what the KV cache stores).
pub fn f32_to_f16_ref(x: &[f32], out: &mut [F16Le]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = F16Le::from_f32(v);
    }
}

/// One query row of ggml's CPU flash attention: `q` is rounded to F16, scored against F16 keys
/// `key(j)` for `j` in `keys` (scaled by `scale`), and F16 values `value(j)` are accumulated with an
/// online softmax in an F16 accumulator (`acc16`, `out.len()` long), then divided by the sum.
/// `q16` is scratch of `q.len()`. An empty range gives zeros.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row_ref<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    flash_attn_row_by(vec_dot_f16_f16_ref, rescale_f32, mad_f32, q, q16, keys, key, value, scale, acc16, out)
}

/// The f16 accumulator's rescale in ggml's x86 arithmetic: `acc = f16(acc ms)` in f32.
fn rescale_f32(acc16: &mut [F16Le], ms: f32) {
    for a in acc16.iter_mut() {
        *a = F16Le::from_f32(a.to_f32() * ms);
    }
}

/// The value update in ggml's x86 arithmetic: `acc = f16(fma(v, vs, acc))` in f32.
fn mad_f32(acc16: &mut [F16Le], value: &[F16Le], vs: f32) {
    for (a, v) in acc16.iter_mut().zip(value) {
        *a = F16Le::from_f32(libm::fmaf(v.to_f32(), vs, a.to_f32()));
    }
}

/// [`flash_attn_row_ref`]'s online softmax with its arithmetic given: the key dot
/// `dot(key, q16)`, the accumulator's rescale `rescale(acc16, ms)` on a new maximum and the value
/// update `mad(acc16, value, vs)`.
#[allow(clippy::too_many_arguments)]
fn flash_attn_row_by<'k>(
    dot: impl Fn(&[F16Le], &[F16Le]) -> f32,
    rescale: impl Fn(&mut [F16Le], f32),
    mad: impl Fn(&mut [F16Le], &[F16Le], f32),
    q: &[f32],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    for (h, &x) in q16.iter_mut().zip(q) {
        *h = F16Le::from_f32(x);
    }
    // The dot reads the query's own length of `q16` (the scratch may be longer).
    let q16 = &q16[..q.len().min(q16.len())];
    acc16.fill(F16Le::from_f32(0.0));
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    for j in keys {
        let s = dot(key(j), q16) * scale;
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if s > max {
            // A new maximum rescales what was accumulated.
            ms = expf(max - s);
            max = s;
            rescale(acc16, ms);
        } else {
            vs = expf(s - max);
        }
        mad(acc16, value(j), vs);
        sum = sum * ms + vs;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, a) in out.iter_mut().zip(acc16.iter()) {
        *o = a.to_f32() * inv;
    }
}

/// `row(q, q16, acc16, out)` for each query row with its slices of the rows' scratch (`dk =
/// q.len()` of `q16`, `dv = out.len()` of `acc16`): the layout of the `flash_attn_rows_*` twins.
fn each_row(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
    mut row: impl FnMut(&[f32], &mut [F16Le], &mut [F16Le], &mut [f32]),
) {
    for (r, (q, out)) in qs.iter().zip(outs.iter_mut()).enumerate() {
        let (dk, dv) = (q.len(), out.len());
        row(q, &mut q16[r * dk..(r + 1) * dk], &mut acc16[r * dv..(r + 1) * dv], out);
    }
}

/// Most query rows one [`flash_attn_rows_ref`] call (and its SIMD twins) takes.
pub const FLASH_ROWS: usize = 4;

/// Several query rows of flash attention over the same keys and values (the query heads of one
/// KV head, GQA): row `r` is [`flash_attn_row_ref`] of `qs[r]` into `outs[r]`, its scratch
/// `q16[r dk..(r + 1) dk]` and `acc16[r dv..(r + 1) dv]` (`dk = qs[r].len()`, `dv = outs[r].len()`,
/// the same for every row). At most [`FLASH_ROWS`] rows.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows_ref<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    });
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

/// [`flash_attn_row_ref`] with the key dot summed as ggml's x86 build does
/// ([`vec_dot_f16_ggml_ref`] rather than in f64): the NEON kernels' twin.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row_f32dot_ref<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    flash_attn_row_by(vec_dot_f16_ggml_ref, rescale_f32, mad_f32, q, q16, keys, key, value, scale, acc16, out)
}

/// [`flash_attn_rows_ref`]'s layout with [`flash_attn_row_f32dot_ref`] per row.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows_f32dot_ref<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_f32dot_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    });
}

// ---------------------------------------------------------------------------------------------
// Flash attention in FEAT_FP16 arithmetic (llama.cpp's aarch64 build)

/// `f16(x)` for an f64 that is the exact result or its round-to-odd at 53 bits: rounded to odd at
/// f32 (24 bits, 2 more than f16 needs) and then to nearest even at f16, which is the correct
/// rounding of the exact value (no double-rounding error).
fn f16_from_odd(x: f64) -> F16Le {
    let f = x as f32;
    let f = if f as f64 != x && f.to_bits() & 1 == 0 && !x.is_nan() {
        // Inexact and even: the other neighbour of `x` (one step away from zero if |x| > |f|).
        if x.abs() > (f as f64).abs() {
            f32::from_bits(f.to_bits() + 1)
        } else {
            f32::from_bits(f.to_bits() - 1)
        }
    } else {
        f
    };
    F16Le::from_f32(f)
}

/// `f16(a b)` with one rounding (FEAT_FP16 `fmul`; the product of two f16 is exact in f64).
pub fn f16_mul_ref(a: F16Le, b: F16Le) -> F16Le {
    f16_from_odd(a.to_f32() as f64 * b.to_f32() as f64)
}

/// `f16(a + b)` with one rounding (FEAT_FP16 `fadd`; the sum of two f16 is exact in f64).
pub fn f16_add_ref(a: F16Le, b: F16Le) -> F16Le {
    f16_from_odd(a.to_f32() as f64 + b.to_f32() as f64)
}

/// `f16(a b + c)` with one rounding (FEAT_FP16 `fmla`): the exact product plus `c` in f64, rounded
/// to odd there (the two-sum error says which way the sum was rounded), then to f16.
pub fn f16_fma_ref(a: F16Le, b: F16Le, c: F16Le) -> F16Le {
    let (p, c) = (a.to_f32() as f64 * b.to_f32() as f64, c.to_f32() as f64);
    let s = p + c;
    if !s.is_finite() {
        return f16_from_odd(s);
    }
    let bb = s - p;
    let err = (p - (s - bb)) + (c - bb);
    let s = if err != 0.0 && s.to_bits() & 1 == 0 {
        // Round to odd: the neighbour of `s` on the side of the exact sum.
        if (err > 0.0) == (s > 0.0) || s == 0.0 {
            f64::from_bits(s.to_bits() + 1).copysign(if s == 0.0 { err } else { s })
        } else {
            f64::from_bits(s.to_bits() - 1)
        }
    } else {
        s
    };
    f16_from_odd(s)
}

/// The key dot of the FEAT_FP16 flash attention: dimensions in chunks of 8 lanes (zero-padded to a
/// multiple of 32), chunk `c` into accumulator `c % 4` (`f16(k q)` for chunks 0..4, then
/// `f16(fma)`); the accumulators added in f16 as `(a0 + a2) + (a1 + a3)`, the 8 lanes widened to f32
/// and summed as `t[i] = x[i] + x[i + 4]`, `(t0 + t1) + (t2 + t3)`.
pub fn vec_dot_f16arith_ref(k: &[F16Le], q: &[F16Le]) -> f32 {
    let n = k.len().min(q.len());
    let zero = F16Le::from_bits(0);
    let mut acc = [[zero; 8]; 4];
    for c in 0..n.div_ceil(32) * 4 {
        for (l, a) in acc[c % 4].iter_mut().enumerate() {
            let i = 8 * c + l;
            let (x, y) = if i < n { (k[i], q[i]) } else { (zero, zero) };
            *a = if c < 4 { f16_mul_ref(x, y) } else { f16_fma_ref(x, y, *a) };
        }
    }
    let mut x = [0f32; 8];
    for (l, x) in x.iter_mut().enumerate() {
        let (a, b) = (f16_add_ref(acc[0][l], acc[2][l]), f16_add_ref(acc[1][l], acc[3][l]));
        *x = f16_add_ref(a, b).to_f32();
    }
    let t: [f32; 4] = core::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// One query row of flash attention in FEAT_FP16 vector arithmetic, as llama.cpp's aarch64 build
/// does it (the NEON path's twin on CPUs with FEAT_FP16): `q` rounded to f16 (into `q16`), scores
/// by [`vec_dot_f16arith_ref`] times `scale`, the softmax steps of [`flash_attn_row_ref`] in f32,
/// but the f16 accumulator updated in f16: `acc = f16(acc f16(ms))` on a new maximum, then
/// `acc = f16(fma(v, f16(vs), acc))`. The output is `acc / sum` in f32. An empty range gives zeros.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row_f16arith_ref<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    let rescale = |acc16: &mut [F16Le], ms: f32| {
        let m16 = F16Le::from_f32(ms);
        for a in acc16.iter_mut() {
            *a = f16_mul_ref(*a, m16);
        }
    };
    let mad = |acc16: &mut [F16Le], value: &[F16Le], vs: f32| {
        let v16 = F16Le::from_f32(vs);
        for (a, &v) in acc16.iter_mut().zip(value) {
            *a = f16_fma_ref(v, v16, *a);
        }
    };
    flash_attn_row_by(vec_dot_f16arith_ref, rescale, mad, q, q16, keys, key, value, scale, acc16, out)
}

/// [`flash_attn_rows_ref`]'s layout with [`flash_attn_row_f16arith_ref`] per row.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows_f16arith_ref<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: core::ops::Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_f16arith_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_masks_and_normalises() {
        let x = [1.0, 2.0, 3.0, 100.0];
        let mut out = [9.0; 4];
        soft_max_ref(&x, &mut out, 1.0, 0, 3);
        let total: f32 = out.iter().sum();
        assert!((total - 1.0).abs() < 1e-6 && out[3] == 0.0 && out[2] > out[1]);
        soft_max_ref(&x, &mut out, 1.0, 2, 2);
        assert_eq!(out, [0.0; 4], "a row with nothing visible is zeros, not NaN");
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let x: [f32; 8] = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0];
        for neox in [false, true] {
            let p = RopeParams { n_rot: 6, neox, freq_base: 10000.0, freq_scale: 1.0, freq_factors: None };
            let mut out = [0.0; 8];
            rope_ref(&x, &mut out, 0, &p);
            assert_eq!(out, x);
            rope_ref(&x, &mut out, 17, &p);
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&out) - norm(&x)).abs() < 1e-4);
            assert_eq!(out[6..], x[6..], "dimensions past n_rot are copied");
        }
    }

    #[test]
    fn activations_match_their_definitions() {
        let x = [-3.0f32, -0.5, 0.0, 0.5, 3.0];
        let mut s = [0.0; 5];
        let mut g = [0.0; 5];
        silu_ref(&x, &mut s);
        gelu_ref(&x, &mut g);
        for i in 0..5 {
            assert!((s[i] - x[i] / (1.0 + (-x[i]).exp())).abs() < 1e-6);
            let erf_gelu = 0.5 * x[i] * (1.0 + libm::erff(x[i] / core::f32::consts::SQRT_2));
            assert!((g[i] - erf_gelu).abs() < 1e-3, "tanh GELU is close to the erf form");
        }
    }
}
