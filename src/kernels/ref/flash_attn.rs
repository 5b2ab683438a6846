//! Flash attention: ggml's CPU order, the x86 key dot order, and FEAT_FP16 arithmetic.

use libm::expf;

use crate::kernels::dot::{vec_dot_f16_f16_ref, vec_dot_f16_ggml_ref};
use crate::quant::blocks::F16Le;

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
) -> RowSoftmax {
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
) -> RowSoftmax {
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
    RowSoftmax { max, sum }
}

/// `row(q, q16, acc16, out)` for each query row with its slices of the rows' scratch (`dk =
/// q.len()` of `q16`, `dv = out.len()` of `acc16`): the layout of the `flash_attn_rows_*` twins.
fn each_row(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
    mut row: impl FnMut(&[f32], &mut [F16Le], &mut [F16Le], &mut [f32]) -> RowSoftmax,
) -> [RowSoftmax; FLASH_ROWS] {
    let mut ends = [RowSoftmax::EMPTY; FLASH_ROWS];
    for (r, (q, out)) in qs.iter().zip(outs.iter_mut()).enumerate() {
        let (dk, dv) = (q.len(), out.len());
        let end = row(q, &mut q16[r * dk..(r + 1) * dk], &mut acc16[r * dv..(r + 1) * dv], out);
        if let Some(e) = ends.get_mut(r) {
            *e = end;
        }
    }
    ends
}

/// Most query rows one [`flash_attn_rows_ref`] call (and its SIMD twins) takes.
pub const FLASH_ROWS: usize = 4;

/// Where one row's online softmax ended: its largest score and its sum of `exp(score - max)`
/// (`-inf` and 0 over no keys). A row's results over disjoint key ranges merge by these
/// ([`merge_attn_parts`]): the decode of a long context splits its keys between threads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSoftmax {
    /// The largest scaled score.
    pub max: f32,
    /// Sum of `exp(score - max)` over the keys.
    pub sum: f32,
}

impl RowSoftmax {
    /// No keys.
    pub const EMPTY: Self = Self { max: f32::NEG_INFINITY, sum: 0.0 };
}

/// One attention row from its results over disjoint key ranges: part `c` is a normalized
/// output `outs(c)` and where its softmax ended, `ends[c]`. Each part weighs `sum exp(max - M)`
/// (`M` the largest `max`), which turns its normalized output back into its share of the whole
/// softmax; parts without keys weigh nothing. No keys at all gives zeros, as the kernels do.
pub fn merge_attn_parts<'p>(ends: &[RowSoftmax], outs: impl Fn(usize) -> &'p [f32], out: &mut [f32]) {
    let top = ends.iter().filter(|e| e.sum > 0.0).map(|e| e.max).fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut total = 0.0f32;
    for (c, e) in ends.iter().enumerate() {
        if e.sum > 0.0 {
            let w = e.sum * expf(e.max - top);
            total += w;
            for (o, &x) in out.iter_mut().zip(outs(c)) {
                *o += w * x;
            }
        }
    }
    let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
    out.iter_mut().for_each(|o| *o *= inv);
}

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
) -> [RowSoftmax; FLASH_ROWS] {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    })
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
) -> RowSoftmax {
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
) -> [RowSoftmax; FLASH_ROWS] {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_f32dot_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    })
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
) -> RowSoftmax {
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
) -> [RowSoftmax; FLASH_ROWS] {
    each_row(qs, q16, acc16, outs, |q, q16, acc16, out| {
        flash_attn_row_f16arith_ref(q, q16, keys.clone(), &key, &value, scale, acc16, out)
    })
}
