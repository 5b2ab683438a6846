//! Flash attention over an f16 KV cache.

use core::arch::x86_64::*;
use core::ops::Range;

use crate::kernels::reference::RowSoftmax;
use crate::kernels::FLASH_ROWS;
use crate::quant::blocks::F16Le;

/// One query row of flash attention over an f16 KV cache (see
/// [`crate::kernels::reference::flash_attn_row_ref`]; the key dot is summed in f32 instead of f64).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_attn_row_avx2<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) -> RowSoftmax {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { flash_attn_impl(q, q16, keys, key, value, scale, acc16, out) }
}

// ---------------------------------------------------------------------------------------------
// Flash attention
// ---------------------------------------------------------------------------------------------

const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

/// `libm::expf` (FreeBSD's algorithm: f32 reduction by ln 2 in two parts, a rational
/// approximation with one division, `scalbnf`) on 8 lanes, bit for bit: the same f32 operations
/// in the same order, every branch computed and selected per lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn libm_expf8(x: __m256) -> __m256 {
    let f = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let i = |v: u32| _mm256_set1_epi32(v as i32);
    let xi = _mm256_castps_si256(x);
    let hx = _mm256_and_si256(xi, i(0x7fff_ffff));
    let sign = _mm256_srli_epi32::<31>(xi);
    let gt = |v: u32| _mm256_cmpgt_epi32(hx, i(v));
    // k: (INV_LN2 * x + copysign(0.5, x)) as i32 above 1.5 ln 2, +-1 above 0.5 ln 2, else 0.
    let half = _mm256_or_ps(_mm256_set1_ps(0.5), _mm256_and_ps(x, _mm256_set1_ps(-0.0)));
    let k_big = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(f(0x3fb8_aa3b), x), half));
    let k_mid = _mm256_sub_epi32(_mm256_sub_epi32(i(1), sign), sign);
    let k = _mm256_blendv_epi8(_mm256_and_si256(k_mid, gt(0x3eb1_7218)), k_big, gt(0x3f85_1592));
    let kf = _mm256_cvtepi32_ps(k);
    // With k = 0 these give hi = x, lo = 0 and leave x as is, like the scalar's middle branch.
    let hi = _mm256_sub_ps(x, _mm256_mul_ps(kf, f(0x3f31_7200)));
    let lo = _mm256_mul_ps(kf, f(0x35bf_be8e));
    let r = _mm256_sub_ps(hi, lo);
    let xx = _mm256_mul_ps(r, r);
    let p = _mm256_add_ps(_mm256_set1_ps(1.666_662_5e-1), _mm256_mul_ps(xx, _mm256_set1_ps(-2.766_733_3e-3)));
    let c = _mm256_sub_ps(r, _mm256_mul_ps(xx, p));
    let q = _mm256_div_ps(_mm256_mul_ps(r, c), _mm256_sub_ps(_mm256_set1_ps(2.0), c));
    let y = _mm256_add_ps(_mm256_set1_ps(1.0), _mm256_add_ps(_mm256_sub_ps(q, lo), hi));
    // scalbnf(y, k): y * 2^k rounded once; |k| <= 150 is split in two exact-then-rounding steps.
    let k1 = _mm256_srai_epi32::<1>(k);
    let k2 = _mm256_sub_epi32(k, k1);
    let pow2 = |k: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, i(127))));
    let mut out = _mm256_mul_ps(_mm256_mul_ps(y, pow2(k1)), pow2(k2));
    // |x| <= 2^-14: 1 + x.
    let tiny = _mm256_castsi256_ps(_mm256_cmpgt_epi32(i(0x3900_0001), hx));
    out = _mm256_blendv_ps(out, _mm256_add_ps(_mm256_set1_ps(1.0), x), tiny);
    // x <= -103.97: 0; x >= 88.72: x * 2^127 (infinity); NaN: x.
    let neg = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_setzero_si256(), xi));
    let under = _mm256_and_ps(neg, _mm256_castsi256_ps(gt(0x42cf_f1b4)));
    out = _mm256_andnot_ps(under, out);
    let over = _mm256_andnot_ps(neg, _mm256_castsi256_ps(gt(0x42b1_7217)));
    out = _mm256_blendv_ps(out, _mm256_mul_ps(x, f(0x7f00_0000)), over);
    let nan = _mm256_castsi256_ps(gt(0x7f80_0000));
    _mm256_blendv_ps(out, x, nan)
}

/// Head dimensions up to this keep the query in f32 registers' worth of stack; longer rows
/// convert it from f16 per key.
const QMAX: usize = 512;

/// The scores of up to 8 keys (`keys[i]` dotted with the query, as f32 `qf` when it fits, else
/// f16 `q16`), times `scale`: products exact, sums in f32, the 8 horizontal sums reduced together.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scores8(keys: &[&[F16Le]; 8], nk: usize, q16: &[F16Le], qf: Option<&[f32]>, scale: f32) -> [f32; 8] {
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut tail = [0f32; 8];
    for (i, (acc, tail)) in acc.iter_mut().zip(tail.iter_mut()).enumerate().take(nk) {
        let k = keys[i];
        let n = k.len().min(q16.len());
        let pk = k.as_ptr().cast::<u8>();
        // SAFETY: for both loads, elements e..e + 8 <= n of the key and of both query forms.
        let load = |e: usize| unsafe {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(pk.add(2 * e).cast()));
            let y = match qf {
                Some(qf) => _mm256_loadu_ps(qf.as_ptr().add(e)),
                None => _mm256_cvtph_ps(_mm_loadu_si128(q16.as_ptr().add(e).cast())),
            };
            (x, y)
        };
        let mut a2 = [_mm256_setzero_ps(); 2];
        let mut e = 0;
        while e + 16 <= n {
            let ((x0, y0), (x1, y1)) = (load(e), load(e + 8));
            a2 = [_mm256_fmadd_ps(x0, y0, a2[0]), _mm256_fmadd_ps(x1, y1, a2[1])];
            e += 16;
        }
        if e + 8 <= n {
            let (x, y) = load(e);
            a2[0] = _mm256_fmadd_ps(x, y, a2[0]);
            e += 8;
        }
        *acc = _mm256_add_ps(a2[0], a2[1]);
        for (x, y) in k[e..n].iter().zip(&q16[e..n]) {
            *tail += x.to_f32() * y.to_f32();
        }
    }
    let h = |a: __m256, b: __m256| _mm256_hadd_ps(a, b);
    // Lane i of the result: sum of acc[i] (hadd pairs within 128-bit halves, then the halves).
    let t = h(h(acc[0], acc[1]), h(acc[2], acc[3]));
    let u = h(h(acc[4], acc[5]), h(acc[6], acc[7]));
    let sum = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(t, u), _mm256_permute2f128_ps::<0x31>(t, u));
    // SAFETY: `tail` holds 8 f32.
    let sum = _mm256_add_ps(sum, unsafe { _mm256_loadu_ps(tail.as_ptr()) });
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sum, _mm256_set1_ps(scale))) };
    out
}

/// The reference's per-key accumulator steps in one pass: `acc = f16(acc * ms)` over all of
/// `acc` when `rescale`, then `acc = f16(fma(v, vs, acc))` over the elements `v` covers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn update_f16<const RESCALE: bool>(acc: &mut [F16Le], v: &[F16Le], vs: f32, ms: f32) {
    let n = acc.len().min(v.len());
    let (pa, pv) = (acc.as_mut_ptr().cast::<u8>(), v.as_ptr().cast::<u8>());
    let (vsv, msv) = (_mm256_set1_ps(vs), _mm256_set1_ps(ms));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i + 8 <= n of acc and v.
        unsafe {
            let mut a = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(2 * i).cast()));
            if RESCALE {
                a = _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(_mm256_mul_ps(a, msv)));
            }
            let r = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(pv.add(2 * i).cast())), vsv, a);
            _mm_storeu_si128(pa.add(2 * i).cast(), _mm256_cvtps_ph::<RNE>(r));
        }
        i += 8;
    }
    for (j, a) in acc.iter_mut().enumerate().skip(i) {
        let mut x = a.to_f32();
        if RESCALE {
            x = F16Le::from_f32(x * ms).to_f32();
        }
        if j < n {
            x = libm::fmaf(v[j].to_f32(), vs, x);
        }
        *a = F16Le::from_f32(x);
    }
}

/// `x` rounded to the nearest f16, kept as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn round_f16(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(x))
}

/// [`update_f16`] on an accumulator of `8 * V` elements held in registers (as f32 values that are
/// f16 values): the same roundings without the store and reload between keys. `false` (nothing
/// done) when `v` is shorter than the accumulator.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn update_regs<const V: usize, const RESCALE: bool>(
    a: &mut [__m256; V],
    v: &[F16Le],
    vs: f32,
    ms: f32,
) -> bool {
    if v.len() < 8 * V {
        return false;
    }
    let (vsv, msv) = (_mm256_set1_ps(vs), _mm256_set1_ps(ms));
    for (i, a) in a.iter_mut().enumerate() {
        // SAFETY: elements 8i..8i + 8 <= 8V <= v.len().
        let x = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(v.as_ptr().add(8 * i).cast()) });
        let base = if RESCALE { round_f16(_mm256_mul_ps(*a, msv)) } else { *a };
        *a = round_f16(_mm256_fmadd_ps(x, vsv, base));
    }
    true
}

/// The key loop of [`flash_attn_impl`] over `keys`, going on from `state` and the accumulator
/// in `acc16` (so a row may take its keys in several runs, in 8-key batches from the same start:
/// the same operations as in one run). `V > 0`: the accumulator (`8 * V` elements long) lives in
/// registers and is written back to `acc16` at the end (or around a key whose value row is too
/// short); f16 values either way, so the moves are exact.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn attend<'k, const V: usize>(
    q16: &[F16Le],
    qf: Option<&[f32]>,
    keys: Range<usize>,
    key: &impl Fn(usize) -> &'k [F16Le],
    value: &impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    state: &mut RowSoftmax,
) {
    debug_assert!(V == 0 || acc16.len() == 8 * V);
    let mut regs = [_mm256_setzero_ps(); V];
    let to_memory = |regs: &[__m256; V], acc16: &mut [F16Le]| {
        for (i, r) in regs.iter().enumerate() {
            // SAFETY: elements 8i..8i + 8 <= 8V == acc16.len(); exact (f16 values).
            unsafe { _mm_storeu_si128(acc16.as_mut_ptr().add(8 * i).cast(), _mm256_cvtps_ph::<RNE>(*r)) };
        }
    };
    let from_memory = |regs: &mut [__m256; V], acc16: &[F16Le]| {
        for (i, r) in regs.iter_mut().enumerate() {
            // SAFETY: as above.
            *r = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(acc16.as_ptr().add(8 * i).cast()) });
        }
    };
    from_memory(&mut regs, acc16);
    let (mut max, mut sum) = (state.max, state.sum);
    // Keys in batches of 8: the scores, then the reference's sequential max decisions (cheap),
    // then the 8 exponentials at once, then the accumulator steps in key order.
    let mut j = keys.start;
    while j < keys.end {
        let nk = (keys.end - j).min(8);
        let mut ks: [&[F16Le]; 8] = [&[]; 8];
        for (i, k) in ks.iter_mut().enumerate().take(nk) {
            *k = key(j + i);
        }
        let scores = scores8(&ks, nk, q16, qf, scale);
        let mut arg = [0f32; 8];
        let mut rescale = [false; 8];
        for i in 0..nk {
            let s = scores[i];
            if s > max {
                // A new maximum rescales what was accumulated: by exp(old max - s).
                arg[i] = max - s;
                rescale[i] = true;
                max = s;
            } else {
                arg[i] = s - max;
            }
        }
        let mut e = [0f32; 8];
        // SAFETY: both arrays hold 8 f32.
        unsafe { _mm256_storeu_ps(e.as_mut_ptr(), libm_expf8(_mm256_loadu_ps(arg.as_ptr()))) };
        for i in 0..nk {
            let v = value(j + i);
            let (ms, vs) = if rescale[i] { (e[i], 1.0) } else { (1.0, e[i]) };
            let done = V > 0
                && if rescale[i] {
                    update_regs::<V, true>(&mut regs, v, vs, ms)
                } else {
                    update_regs::<V, false>(&mut regs, v, vs, ms)
                };
            if !done {
                to_memory(&regs, acc16);
                if rescale[i] {
                    update_f16::<true>(acc16, v, vs, ms);
                } else {
                    update_f16::<false>(acc16, v, vs, ms);
                }
                from_memory(&mut regs, acc16);
            }
            sum = sum * ms + vs;
        }
        j += nk;
    }
    to_memory(&regs, acc16);
    *state = RowSoftmax { max, sum };
}

/// Keys one run of [`attend`] takes when several rows share them: their K and V rows (16 KiB at
/// 64 dimensions) stay in L1 while every row goes over them, so the cache is read once per KV
/// head instead of once per query head. A multiple of 8 (the batches of `attend`).
const KEY_RUN: usize = 64;

/// The query rounded to f16 (`q16`) and, when it fits, back in f32 (`qf`, exact); the
/// accumulator zeroed.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn prepare(q: &[f32], q16: &mut [F16Le], qf: &mut [f32; QMAX], acc16: &mut [F16Le]) -> bool {
    let n = q.len().min(q16.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i + 8 < n of q and q16.
        unsafe {
            let h = _mm256_cvtps_ph::<RNE>(_mm256_loadu_ps(q.as_ptr().add(i)));
            _mm_storeu_si128(q16.as_mut_ptr().add(i).cast(), h);
        }
        i += 8;
    }
    for (h, &x) in q16[i..n].iter_mut().zip(&q[i..n]) {
        *h = F16Le::from_f32(x);
    }
    acc16.fill(F16Le::from_f32(0.0));
    // The rounded query once in f32 (exact), instead of widening it for every key.
    if q16.len() > QMAX {
        return false;
    }
    for (f, h) in qf.iter_mut().zip(q16.iter()) {
        *f = h.to_f32();
    }
    true
}

/// [`attend`] with the register accumulator for the common head sizes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn attend_any<'k>(
    q16: &[F16Le],
    qf: Option<&[f32]>,
    keys: Range<usize>,
    key: &impl Fn(usize) -> &'k [F16Le],
    value: &impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    state: &mut RowSoftmax,
) {
    match acc16.len() {
        64 => attend::<8>(q16, qf, keys, key, value, scale, acc16, state),
        128 => attend::<16>(q16, qf, keys, key, value, scale, acc16, state),
        _ => attend::<0>(q16, qf, keys, key, value, scale, acc16, state),
    }
}

/// `out = acc / sum` (0 for an empty sum).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn finish(acc16: &[F16Le], sum: f32, out: &mut [f32]) {
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    let n = out.len().min(acc16.len());
    let iv = _mm256_set1_ps(inv);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i + 8 < n of out and acc16.
        unsafe {
            let a = _mm256_cvtph_ps(_mm_loadu_si128(acc16.as_ptr().add(i).cast()));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(a, iv));
        }
        i += 8;
    }
    for (o, a) in out[i..n].iter_mut().zip(&acc16[i..n]) {
        *o = a.to_f32() * inv;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn flash_attn_impl<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) -> RowSoftmax {
    let mut qf = [0f32; QMAX];
    let fits = prepare(q, q16, &mut qf, acc16);
    let qf = fits.then(|| &qf[..q16.len()]);
    let mut state = RowSoftmax::EMPTY;
    attend_any(q16, qf, keys, &key, &value, scale, acc16, &mut state);
    finish(acc16, state.sum, out);
    state
}

/// Up to [`crate::kernels::FLASH_ROWS`] query rows over the same keys (the query heads of one
/// KV head): each row's result is [`flash_attn_row_avx2`]'s, bit for bit (the same batches of 8
/// keys, the same operations), but the rows take the keys [`KEY_RUN`] at a time in turn, so
/// each key and value row is read from memory once for all of them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_attn_rows_avx2<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { flash_attn_rows_impl(qs, q16, keys, key, value, scale, acc16, outs) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn flash_attn_rows_impl<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    const ROWS: usize = FLASH_ROWS;
    let (dk, dv) = (qs.first().map_or(0, |q| q.len()), outs.first().map_or(0, |o| o.len()));
    let (key, value) = (&key, &value);
    let mut ends = [RowSoftmax::EMPTY; FLASH_ROWS];
    // Passes of up to ROWS rows (each row's result is the same whatever the pass).
    let count = qs.len().min(outs.len());
    for (p, outs) in outs[..count].chunks_mut(ROWS).enumerate() {
        let rows = p * ROWS..p * ROWS + outs.len();
        let (Some(q16), Some(acc16)) =
            (q16.get_mut(rows.start * dk..rows.end * dk), acc16.get_mut(rows.start * dv..rows.end * dv))
        else {
            return ends;
        };
        let pass = rows_pass(&qs[rows], q16, keys.clone(), key, value, scale, acc16, outs);
        if p == 0 {
            ends = pass;
        }
    }
    ends
}

/// One pass of [`flash_attn_rows_impl`]: at most `FLASH_ROWS` rows, `q16` and `acc16` exactly
/// their size.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn rows_pass<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: &impl Fn(usize) -> &'k [F16Le],
    value: &impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    const ROWS: usize = FLASH_ROWS;
    let n = qs.len().min(outs.len()).min(ROWS);
    let (dk, dv) = (qs.first().map_or(0, |q| q.len()), outs.first().map_or(0, |o| o.len()));
    if n == 0 || q16.len() < n * dk || acc16.len() < n * dv {
        return [RowSoftmax::EMPTY; FLASH_ROWS];
    }
    let mut qf = [[0f32; QMAX]; ROWS];
    let mut fits = [false; ROWS];
    let mut states = [RowSoftmax::EMPTY; ROWS];
    for r in 0..n {
        let (q16, acc16) = (&mut q16[r * dk..(r + 1) * dk], &mut acc16[r * dv..(r + 1) * dv]);
        fits[r] = qs[r].len() == dk && prepare(qs[r], q16, &mut qf[r], acc16);
    }
    let mut j = keys.start;
    while j < keys.end {
        let run = j..(j + KEY_RUN).min(keys.end);
        for r in 0..n {
            let (q16, acc16) = (&q16[r * dk..(r + 1) * dk], &mut acc16[r * dv..(r + 1) * dv]);
            let qf = fits[r].then(|| &qf[r][..dk]);
            attend_any(q16, qf, run.clone(), key, value, scale, acc16, &mut states[r]);
        }
        j = run.end;
    }
    for r in 0..n {
        finish(&acc16[r * dv..(r + 1) * dv], states[r].sum, outs[r]);
    }
    states
}

// ---------------------------------------------------------------------------------------------
// Row operations of attention over a quantized cache (`kernels::kv_attn`): the reference's bits.

/// One block's products of a q8_0 key block (quants at `x`) and a 15-bit query block (high bytes
/// at `hi`, low at `lo`) in 8 i32 lanes: `128 * |x| * (hi with x's sign) + lo * x`, each byte
/// product pair summed to i16 by `maddubs` (at most 2 * 128 * 127, no saturation), then to i32 by
/// `madd` with 128 or 1.
///
/// # Safety
/// The CPU must have AVX2; 32 bytes readable at each pointer.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_q15_lanes(x: *const u8, hi: *const u8, lo: *const u8) -> __m256i {
    // SAFETY: the caller's 32 bytes at each pointer; unaligned loads.
    let (x, h, l) = unsafe {
        (_mm256_loadu_si256(x.cast()), _mm256_loadu_si256(hi.cast()), _mm256_loadu_si256(lo.cast()))
    };
    let ph = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(h, x));
    let pl = _mm256_maddubs_epi16(l, x);
    _mm256_add_epi32(
        _mm256_madd_epi16(ph, _mm256_set1_epi16(128)),
        _mm256_madd_epi16(pl, _mm256_set1_epi16(1)),
    )
}

/// q8_0 key row `k` times 15-bit query row `q`: `dot_q8_0_q15_ref`'s result bit for bit (each
/// block's integer sum is exact in any order; the f32 steps are the reference's, in its order).
/// Blocks go in pairs whose 8-lane integer sums are reduced together, which halves the
/// horizontal work of one block at a time. 0.0 if the rows are not the same whole number of
/// blocks.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_dot_q8_0_avx2(k: &[u8], q: &[u8]) -> f32 {
    use crate::kernels::kv_attn::{Q15_BYTES, Q15_LEN};
    const B: usize = 34;
    if k.len() % B != 0 || q.len() != k.len() / B * Q15_BYTES {
        return 0.0;
    }
    let lanes = |b: usize| {
        let y = Q15_BYTES * b + 4;
        // SAFETY: 32 quant bytes at 34 b + 2 of the key and the high and low bytes of the query's
        // block b (b < k.len() / 34, the query as many blocks long).
        unsafe { q8_0_q15_lanes(k.as_ptr().add(B * b + 2), q.as_ptr().add(y), q.as_ptr().add(y + Q15_LEN)) }
    };
    let scale = |b: usize| {
        let y = Q15_BYTES * b;
        f16c_to_f32(F16Le([k[B * b], k[B * b + 1]])) * crate::kernels::kv_attn::q15_scale(&q[y..])
    };
    let blocks = k.len() / B;
    let mut sumf = 0.0f32;
    let mut b = 0;
    while b + 2 <= blocks {
        // [a01, a23, b01, b23 | a45, a67, b45, b67], halves added, then pairs: [a, b, a, b].
        let h = _mm256_hadd_epi32(lanes(b), lanes(b + 1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let s = _mm_hadd_epi32(s, s);
        sumf += _mm_cvtsi128_si32(s) as f32 * scale(b);
        sumf += _mm_extract_epi32::<1>(s) as f32 * scale(b + 1);
        b += 2;
    }
    if b < blocks {
        let m = lanes(b);
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<0b01>(s2));
        sumf += _mm_cvtsi128_si32(s1) as f32 * scale(b);
    }
    sumf
}

/// The dots of q8_0 `keys` with the 15-bit query `q` into `out` ([`kv_dot_q8_0_avx2`]'s results,
/// so `dot_q8_0_q15_ref`'s bits): 8 keys at a time, one key per lane. Each block's 8 integer
/// sums are reduced together (the horizontal adds of 8 keys in 9 instructions instead of 8
/// reductions), the 8 keys' scales widened by one F16C conversion, and the f32 steps are the
/// reference's per lane (`sumf + sumi * (dk * dq)`, not fused).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn kv_scores_q8_0_avx2(keys: &[&[u8]], q: &[u8], out: &mut [f32]) {
    use crate::kernels::kv_attn::{Q15_BYTES, Q15_LEN};
    const B: usize = 34;
    let n = keys.len().min(out.len());
    let blocks = q.len() / Q15_BYTES;
    let same = q.len() % Q15_BYTES == 0 && keys[..n].iter().all(|k| k.len() == blocks * B);
    let whole = if same { n - n % 8 } else { 0 };
    for (ks, o) in keys[..whole].chunks_exact(8).zip(out[..whole].chunks_exact_mut(8)) {
        let ks: &[&[u8]; 8] = ks.try_into().unwrap();
        let mut sumf = _mm256_setzero_ps();
        for b in 0..blocks {
            let (at, y) = (B * b, Q15_BYTES * b);
            let p: [__m256i; 8] = core::array::from_fn(|j| {
                // SAFETY: 32 quant bytes at 34 b + 2 of every key (all `blocks` blocks long) and
                // the high and low bytes of the query's block b.
                unsafe {
                    q8_0_q15_lanes(
                        ks[j].as_ptr().add(at + 2),
                        q.as_ptr().add(y + 4),
                        q.as_ptr().add(y + 4 + Q15_LEN),
                    )
                }
            });
            // [k0 k1 k2 k3 (lanes 0-3) | k0 k1 k2 k3 (lanes 4-7)] sums, the same for k4-k7, then
            // the two halves added: lane j is key j's block sum.
            let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
            let sumi = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(h0123, h4567),
                _mm256_permute2x128_si256::<0x31>(h0123, h4567),
            );
            let scale = |k: &[u8]| i16::from_le_bytes([k[at], k[at + 1]]);
            let dk = _mm256_cvtph_ps(_mm_setr_epi16(
                scale(ks[0]),
                scale(ks[1]),
                scale(ks[2]),
                scale(ks[3]),
                scale(ks[4]),
                scale(ks[5]),
                scale(ks[6]),
                scale(ks[7]),
            ));
            let dq = crate::kernels::kv_attn::q15_scale(&q[y..]);
            let d = _mm256_mul_ps(dk, _mm256_set1_ps(dq));
            sumf = _mm256_add_ps(sumf, _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), d));
        }
        let o: &mut [f32; 8] = o.try_into().unwrap();
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), sumf) };
    }
    for (o, k) in out[whole..n].iter_mut().zip(&keys[whole..n]) {
        // SAFETY: this function runs with AVX2, FMA and F16C.
        *o = unsafe { kv_dot_q8_0_avx2(k, q) };
    }
}

/// [`crate::kernels::kv_attn::update_ref`] (its bits: the same products and fused adds per
/// element) with the accumulator in registers across the chunk's keys, 64 columns at a time.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn kv_update_avx2(acc: &mut [f32], vals: &[f32], w: &[f32], raises: &[bool]) {
    let dv = acc.len();
    if dv == 0 {
        return;
    }
    let m = w.len().min(raises.len()).min(vals.len() / dv);
    let mut c = 0;
    while c + 64 <= dv {
        update_cols::<8>(&mut acc[c..c + 64], &vals[c..], dv, &w[..m], &raises[..m]);
        c += 64;
    }
    while c + 8 <= dv {
        update_cols::<1>(&mut acc[c..c + 8], &vals[c..], dv, &w[..m], &raises[..m]);
        c += 8;
    }
    crate::kernels::kv_attn::update_tail_ref(acc, &vals[..m * dv], c, &w[..m], &raises[..m]);
}

/// `8 V` columns of [`kv_update_avx2`]: `acc` those columns, `vals` the values from the first
/// of them (key `i`'s at `i * dv`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn update_cols<const V: usize>(acc: &mut [f32], vals: &[f32], dv: usize, w: &[f32], raises: &[bool]) {
    let acc: &mut [f32] = &mut acc[..8 * V];
    // SAFETY: 8 V floats of `acc`.
    let mut r: [__m256; V] = core::array::from_fn(|i| unsafe { _mm256_loadu_ps(acc.as_ptr().add(8 * i)) });
    for (i, (&w, &raise)) in w.iter().zip(raises).enumerate() {
        let v = &vals[i * dv..i * dv + 8 * V];
        let s = if raise {
            let ms = _mm256_set1_ps(w);
            r.iter_mut().for_each(|x| *x = _mm256_mul_ps(*x, ms));
            _mm256_set1_ps(1.0)
        } else {
            _mm256_set1_ps(w)
        };
        for (j, x) in r.iter_mut().enumerate() {
            // SAFETY: 8 floats at 8 j of `v` (8 V long).
            *x = _mm256_fmadd_ps(unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * j)) }, s, *x);
        }
    }
    for (j, x) in r.iter().enumerate() {
        // SAFETY: 8 floats at 8 j of `acc` (8 V long).
        unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add(8 * j), *x) };
    }
}

/// q8_0 row to f32 (`q * d` per element, as `dequantize_q8_0_ref`); `false` if `out` is not
/// the row's length.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_widen_q8_0_avx2(src: &[u8], out: &mut [f32]) -> bool {
    const B: usize = 34;
    if src.len() % B != 0 || out.len() != src.len() / B * 32 {
        return false;
    }
    for (b, o) in src.chunks_exact(B).zip(out.chunks_exact_mut(32)) {
        let d = _mm256_set1_ps(f16c_to_f32(F16Le([b[0], b[1]])));
        for i in 0..4 {
            // SAFETY: 8 quants at 2 + 8i of a 34-byte block; 8 floats at 8i of a 32-float chunk.
            unsafe {
                let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * i).cast());
                let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), v);
            }
        }
    }
    true
}

/// f16 to f32 by F16C: exact, as the portable `dot::f16`, but without its multiply, whose
/// subnormal input (a block scale that is an f16 subnormal) costs a microcode assist on x86: at
/// depth 4096 SmolLM2's q8_0 cache spent two thirds of a decode step there.
#[inline]
#[target_feature(enable = "f16c")]
fn f16c_to_f32(h: F16Le) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
}

/// f16 row to f32 (exact); `false` if `out` is not the row's length.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_widen_f16_avx2(src: &[u8], out: &mut [f32]) -> bool {
    if out.len() * 2 != src.len() {
        return false;
    }
    let mut i = 0;
    while i + 8 <= out.len() {
        // SAFETY: elements i..i + 8 of both rows.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(2 * i).cast());
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (o, h) in out[i..].iter_mut().zip(src[2 * i..].chunks_exact(2)) {
        *o = f16c_to_f32(F16Le([h[0], h[1]]));
    }
    true
}

/// `kv_attn::attend` with the AVX2 operations: q8_0 key dots (15-bit query) 8 keys at a time, q8_0 and f16
/// value widening, the update with the accumulator in registers, the exponentials 8 at a time (`libm_expf8`, `libm::expf`'s bits); other
/// key and value types through `ops`' functions. The reference operations' bits.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn kv_attend_avx2<'k>(
    ops: &crate::kernels::kv_attn::KvOps,
    a: &crate::kernels::kv_attn::Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
) -> [RowSoftmax; crate::kernels::kv_attn::TYPED_ROWS] {
    use crate::kernels::kv_attn::{attend, scores_by, KEY_CHUNK};
    use crate::quant::GgmlType;
    let (k_q8, v_ty, dot, widen) =
        (ops.key_type() == GgmlType::Q8_0, ops.value_type(), ops.dot(), ops.widen());
    attend(
        a,
        key,
        value,
        acc,
        vals,
        |ks, q, out| {
            if k_q8 {
                kv_scores_q8_0_avx2(ks, q, out)
            } else {
                scores_by(ks, q, out, dot)
            }
        },
        |x: &mut [f32; KEY_CHUNK]| {
            for c in x.chunks_exact_mut(8) {
                // SAFETY: 8 floats of the chunk; AVX2, FMA and F16C as above.
                unsafe { _mm256_storeu_ps(c.as_mut_ptr(), libm_expf8(_mm256_loadu_ps(c.as_ptr()))) };
            }
        },
        |v, out| {
            match v_ty {
                GgmlType::Q8_0 => {
                    // SAFETY: AVX2, FMA and F16C as above.
                    unsafe { kv_widen_q8_0_avx2(v, out) }
                }
                GgmlType::F16 => {
                    // SAFETY: AVX2, FMA and F16C as above.
                    unsafe { kv_widen_f16_avx2(v, out) }
                }
                _ => widen(v, out),
            };
        },
        |acc, vals, w, raises| kv_update_avx2(acc, vals, w, raises),
    )
}

// ---------------------------------------------------------------------------------------------
// Tiled attention for prompts (`kernels::attn_tile`): query rows in the 8 lanes.

use crate::kernels::attn_tile::{tile_loop, Lanes, TileScratch, Tiles};

/// 8 f32 lanes for [`tile_loop`] and the f16 GEMM; used only inside [`attn_tile_avx2`] and
/// `f16_gemm_panel_avx2` (AVX2, FMA and F16C).
#[derive(Clone, Copy)]
pub(super) struct Ymm(__m256);

impl Lanes for Ymm {
    const N: usize = 8;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: every method runs inlined into `attn_tile_avx2` or `f16_gemm_panel_avx2`, whose
        // CPU has AVX2, FMA and F16C; loads and stores touch the first 8 floats of slices checked to hold them.
        Self(unsafe { _mm256_set1_ps(x) })
    }
    #[inline(always)]
    fn load(x: &[f32]) -> Self {
        let x: &[f32; 8] = x[..8].try_into().unwrap();
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_loadu_ps(x.as_ptr()) })
    }
    #[inline(always)]
    fn store(self, x: &mut [f32]) {
        let x: &mut [f32; 8] = (&mut x[..8]).try_into().unwrap();
        // SAFETY: see `splat`.
        unsafe { _mm256_storeu_ps(x.as_mut_ptr(), self.0) }
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_fmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_mul_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_add_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_sub_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { _mm256_max_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn exp(self) -> Self {
        // SAFETY: see `splat`.
        Self(unsafe { libm_expf8(self.0) })
    }
    #[inline(always)]
    fn widen_f16(row: &[u8], out: &mut [f32]) {
        // SAFETY: see `splat` (the row is `out.len() * 2` bytes: `Lanes::widen_f16`).
        unsafe { kv_widen_f16_avx2(row, out) };
    }
}

/// [`crate::kernels::flash_attn_tile`] on AVX2: [`tile_loop`] in 8-lane vectors.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attn_tile_avx2<'k>(
    t: &Tiles<'_>,
    qs: &[&[f32]],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scratch: &mut TileScratch,
    outs: &mut [&mut [f32]],
) {
    tile_loop::<Ymm>(t, qs, key, value, scratch, outs)
}
