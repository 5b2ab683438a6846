//! Flash attention: the f32 families (ggml's ARM and x86 dot orders) and FEAT_FP16 arithmetic.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::reference::{
    flash_attn_row_f32dot_ref, flash_attn_rows_f16arith_ref, flash_attn_rows_f32dot_ref, RowSoftmax,
    FLASH_ROWS,
};
use crate::quant::blocks::F16Le;

// ---------------------------------------------------------------------------------------------
// Flash attention

/// Longest query/value row of the FEAT_FP16 kernels (longer ones take the twin).
const MAX_HEAD: usize = 512;

/// Keys per chunk of the kernels' passes.
const KEY_CHUNK: usize = 32;

/// One query row of flash attention over an f16 KV cache: `reference::flash_attn_row_f32dot_ref`'s
/// results, bit for bit (the reference's steps, the key dot summed in f32 in ggml's x86 order):
/// [`flash_attn_rows`] of one row.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) -> RowSoftmax {
    let (dk, dv) = (q.len(), out.len());
    if !f32dot_fits(dk, dv) || q16.len() < dk || acc16.len() < dv {
        return flash_attn_row_f32dot_ref(q, q16, keys, key, value, scale, acc16, out);
    }
    // SAFETY: the shapes were checked above; NEON is part of the aarch64 baseline.
    unsafe { attend_rows::<F32Dot<1>>(&[q], q16, keys, key, value, scale, acc16, &mut [out])[0] }
}

/// Several query rows over the same keys (the query heads of one KV head):
/// `reference::flash_attn_rows_f32dot_ref`'s results, bit for bit (each row's is
/// [`flash_attn_row`]'s), each key and value row loaded and widened once for all rows.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    let n = qs.len().min(outs.len());
    if n == 0 {
        return [RowSoftmax::EMPTY; FLASH_ROWS];
    }
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let fits = n <= FLASH_ROWS
        && f32dot_fits(dk, dv)
        && q16.len() >= n * dk
        && acc16.len() >= n * dv
        && qs[..n].iter().all(|q| q.len() == dk)
        && outs[..n].iter().all(|o| o.len() == dv);
    if !fits {
        return flash_attn_rows_f32dot_ref(qs, q16, keys, key, value, scale, acc16, outs);
    }
    let (qs, outs) = (&qs[..n], &mut outs[..n]);
    // SAFETY: the shapes were checked above; NEON is part of the aarch64 baseline.
    unsafe {
        match n {
            1 => attend_rows::<F32Dot<1>>(qs, q16, keys, key, value, scale, acc16, outs),
            2 => attend_rows::<F32Dot<2>>(qs, q16, keys, key, value, scale, acc16, outs),
            3 => attend_rows::<F32Dot<3>>(qs, q16, keys, key, value, scale, acc16, outs),
            _ => attend_rows::<F32Dot<4>>(qs, q16, keys, key, value, scale, acc16, outs),
        }
    }
}

/// `libm::expf` for 4 lanes (the same FreeBSD steps in the same order, the final `scalbnf` as an
/// exponent add), exact on the lanes of the returned mask: `-86 <= x <= 0`, where `2^k` keeps the
/// result normal, and `x <= -103.972084`, where it is 0.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn expf4(x: float32x4_t) -> (float32x4_t, uint32x4_t) {
    const INV_LN2: f32 = f32::from_bits(0x3fb8_aa3b);
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    const P1: f32 = 1.666_662_5e-1;
    const P2: f32 = -2.766_733_3e-3;
    let one = vdupq_n_f32(1.0);
    let ax = vreinterpretq_u32_f32(vabsq_f32(x));
    // |x| > 1.5 ln2: k = trunc(x / ln2 - 0.5); 0.5 ln2 < |x| <= 1.5 ln2: k = -1; below: k = 0.
    let ka = vcvtq_s32_f32(vaddq_f32(vmulq_n_f32(x, INV_LN2), vdupq_n_f32(-0.5)));
    let k = vbslq_s32(vcgtq_u32(ax, vdupq_n_u32(0x3f85_1592)), ka, vdupq_n_s32(-1));
    let k = vandq_s32(k, vreinterpretq_s32_u32(vcgtq_u32(ax, vdupq_n_u32(0x3eb1_7218))));
    let kf = vcvtq_f32_s32(k);
    let hi = vsubq_f32(x, vmulq_n_f32(kf, LN2_HI));
    let lo = vmulq_n_f32(kf, LN2_LO);
    let r = vsubq_f32(hi, lo);
    let rr = vmulq_f32(r, r);
    let c = vsubq_f32(r, vmulq_f32(rr, vaddq_f32(vdupq_n_f32(P1), vmulq_n_f32(rr, P2))));
    let y = vdivq_f32(vmulq_f32(r, c), vsubq_f32(vdupq_n_f32(2.0), c));
    let y = vaddq_f32(one, vaddq_f32(vsubq_f32(y, lo), hi));
    let y = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(y), vshlq_n_s32::<23>(k)));
    // |x| <= 2^-14: 1 + x; x <= -103.972084 (-inf included): 0.
    let y = vbslq_f32(vcleq_u32(ax, vdupq_n_u32(0x3900_0000)), vaddq_f32(one, x), y);
    let zero = vcgeq_u32(ax, vdupq_n_u32(0x42cf_f1b5));
    let y = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), zero));
    (y, vandq_u32(vclezq_f32(x), vorrq_u32(vcaleq_f32(x, vdupq_n_f32(86.0)), zero)))
}

/// What one flash-attention family computes its own way; [`attend_rows`] is the body they share.
trait Family {
    /// The queries as the scores kernels read them.
    type Queries;
    /// One key's softmax weights as the value kernels read them (`vs` in 0..4, `ms` in 4..8).
    type Weight: Copy;
    /// Weights before a chunk sets them.
    const NO_WEIGHT: Self::Weight;
    /// Zeroed queries (filled in place: no copy of the buffer per call).
    const NO_QUERIES: Self::Queries;
    /// Rounds the `dk`-long query rows to f16 into `q16` and packs them into `qp` for
    /// [`Family::scores`] (zero past `dk`: `qp` starts as [`Family::NO_QUERIES`]).
    fn queries(qs: &[&[f32]], q16: &mut [F16Le], dk: usize, qp: &mut Self::Queries);
    /// Every row's score for each key of `rows` into `s`.
    ///
    /// # Safety
    /// Each of `rows` (at most [`KEY_CHUNK`], at least one) points at `32 pieces` f16 values.
    unsafe fn scores(
        q: &Self::Queries,
        pieces: usize,
        rows: &[*const F16Le],
        scale: f32,
        s: &mut [[f32; 4]; KEY_CHUNK],
    );
    /// The reference's softmax steps for `s`, the rows in the lanes: per key its weights and
    /// which rows raise their maximum; `max` and `sum` carried over.
    fn softmax(
        s: &[[f32; 4]],
        max: &mut float32x4_t,
        sum: &mut float32x4_t,
        w: &mut [Self::Weight; KEY_CHUNK],
        raise: &mut [u32; KEY_CHUNK],
    );
    /// Adds each value row of `v`, weighted, to dimensions `d..d + 32` (`wide`) or `d..d + 8` of
    /// every row's f16 accumulator (`acc`, rows `dv` apart), rounding after every key.
    ///
    /// # Safety
    /// `v` (at least one) point at `dv` f16 values each; `d + 32` (wide) or `d + 8` at most `dv`;
    /// `acc` holds `R dv`; `w` and `raise` are set for every key of `v`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn values(
        acc: *mut F16Le,
        dv: usize,
        d: usize,
        wide: bool,
        v: &[*const F16Le],
        w: &[Self::Weight; KEY_CHUNK],
        raise: &[u32; KEY_CHUNK],
    );
}

/// Flash attention of `qs.len()` query rows over the same keys, in chunks of keys and three passes
/// per chunk: the scores of all rows (each key loaded once), the softmax steps of all rows at once
/// per key (the rows in the lanes, rows past the last repeating one), the value updates (each value
/// loaded once, 32 or 8 dimensions of every row's f16 accumulator in registers, rounded to f16
/// after every key as the reference does); then each row divided by its sum. Keys whose size is
/// not a multiple of 32 are copied into zeroed rows (the twins' padding).
///
/// # Safety
/// Checked shapes: `qs` and `outs` hold the family's row count of `dk` and `dv` values (the
/// family's query buffer holds `dk`), both multiples of 8 and at most [`MAX_HEAD`]; `q16` and `acc16` long enough;
/// the CPU has the family's features.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
unsafe fn attend_rows<'k, F: Family>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    let (dk, dv, n) = (qs[0].len(), outs[0].len(), qs.len());
    let pieces = dk.div_ceil(32);
    let mut qp = F::NO_QUERIES;
    F::queries(qs, q16, dk, &mut qp);
    let acc16 = &mut acc16[..n * dv];
    acc16.fill(F16Le::from_bits(0));
    let mut kpad = None;
    let (mut max, mut sum) = (vdupq_n_f32(f32::NEG_INFINITY), vdupq_n_f32(0.0));
    // Per chunk: the key and value rows, the scores, the weights and raises (set before use).
    let (mut krows, mut vrows) =
        ([core::ptr::null::<F16Le>(); KEY_CHUNK], [core::ptr::null::<F16Le>(); KEY_CHUNK]);
    let mut s = [[0f32; 4]; KEY_CHUNK];
    let (mut w, mut raise) = ([F::NO_WEIGHT; KEY_CHUNK], [0u32; KEY_CHUNK]);
    let mut j = keys.start;
    while j < keys.end {
        let m = (keys.end - j).min(KEY_CHUNK);
        if dk % 32 == 0 {
            for (i, (k, v)) in krows[..m].iter_mut().zip(&mut vrows[..m]).enumerate() {
                (*k, *v) = (key(j + i)[..dk].as_ptr(), value(j + i)[..dv].as_ptr());
            }
        } else {
            let pad = kpad.get_or_insert([[F16Le::from_bits(0); MAX_HEAD]; KEY_CHUNK]);
            for (i, ((k, v), p)) in krows[..m].iter_mut().zip(&mut vrows[..m]).zip(pad.iter_mut()).enumerate()
            {
                p[..dk].copy_from_slice(&key(j + i)[..dk]);
                (*k, *v) = (p.as_ptr(), value(j + i)[..dv].as_ptr());
            }
        }
        // SAFETY: `krows[..m]` point at `32 pieces` f16 each (keys of `dk`, padded above).
        unsafe { F::scores(&qp, pieces, &krows[..m], scale, &mut s) };
        F::softmax(&s[..m], &mut max, &mut sum, &mut w, &mut raise);
        let mut d = 0;
        while d < dv {
            let wide = dv - d >= 32;
            // SAFETY: `vrows[..m]` point at `dv` f16 each, `d + 32` (wide) or `d + 8` at most `dv`,
            // `acc16` holds `n dv`; the weights of these `m` keys were just set.
            unsafe { F::values(acc16.as_mut_ptr().add(d), dv, d, wide, &vrows[..m], &w, &raise) };
            d += if wide { 32 } else { 8 };
        }
        j += m;
    }
    let (mut sums, mut maxes) = ([0f32; 4], [0f32; 4]);
    st_f32x4(&mut sums, sum);
    st_f32x4(&mut maxes, max);
    let mut ends = [RowSoftmax::EMPTY; FLASH_ROWS];
    for (r, out) in outs.iter_mut().enumerate() {
        let inv = if sums[r] == 0.0 { 0.0 } else { 1.0 / sums[r] };
        for (o, a) in out.chunks_exact_mut(8).zip(acc16[r * dv..(r + 1) * dv].chunks_exact(8)) {
            let h = ld_f16x8(a);
            st_f32x4(o, vmulq_n_f32(f16_lo(h), inv));
            st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(h), inv));
        }
        ends[r] = RowSoftmax { max: maxes[r], sum: sums[r] };
    }
    ends
}

// ---------------------------------------------------------------------------------------------
// Flash attention with ggml's x86 key dot order

/// Longest head of the [`flash_attn_rows_f32dot`] kernels (their packed queries' buffer).
const DOT_HEAD: usize = 256;

/// Whether [`flash_attn_rows_f32dot`] takes these head sizes (the other shapes keep the f64
/// kernels).
fn f32dot_fits(dk: usize, dv: usize) -> bool {
    dk > 0 && dv > 0 && dk <= DOT_HEAD && dv <= MAX_HEAD && dk % 8 == 0 && dv % 8 == 0
}

/// Flash attention of `R` query rows over the same keys with the key dots summed in f32 in
/// ggml's x86 order (`reference::flash_attn_row_f32dot_ref`'s results, bit for bit), in chunks of
/// keys and three passes per chunk: the scores of all rows (`asm!`, each key loaded and widened
/// once), the softmax steps of all rows at once per key (the rows in the lanes, rows past `R`
/// repeating one), the value updates (`asm!`, each value widened once, 32 or 8 dimensions of every
/// row's f16 accumulator in registers, rounded to f16 after every key as the reference does).
/// Checked shapes: [`f32dot_fits`], `R` rows of `dk` and `dv`, scratch long enough.
/// The f32-dot family for `R` rows: queries rounded to f16 and widened back, packed per 32
/// dimensions, per 16 of them, row 0's, row 1's, ... (zero past `dk`); weights in f32.
struct F32Dot<const R: usize>;

impl<const R: usize> Family for F32Dot<R> {
    type Queries = [[f32; DOT_HEAD]; R];
    type Weight = [f32; 8];
    const NO_WEIGHT: [f32; 8] = [0.0; 8];

    const NO_QUERIES: Self::Queries = [[0f32; DOT_HEAD]; R];

    fn queries(qs: &[&[f32]], q16: &mut [F16Le], dk: usize, qp: &mut Self::Queries) {
        let packed = qp.as_flattened_mut();
        for (r, q) in qs.iter().enumerate() {
            let h = &mut q16[r * dk..(r + 1) * dk];
            for (i, (q, h)) in q.chunks_exact(8).zip(h.chunks_exact_mut(8)).enumerate() {
                // SAFETY: NEON is part of the aarch64 baseline.
                unsafe {
                    let x = f16_narrow(ld_f32x4(q), ld_f32x4(&q[4..]));
                    st_f16x8(h, x);
                    let at = i / 4 * 32 * R + i % 4 / 2 * 16 * R + r * 16 + i % 2 * 8;
                    st_f32x4(&mut packed[at..], f16_lo(x));
                    st_f32x4(&mut packed[at + 4..], f16_hi(x));
                }
            }
        }
    }

    unsafe fn scores(
        q: &Self::Queries,
        pieces: usize,
        rows: &[*const F16Le],
        scale: f32,
        s: &mut [[f32; 4]; KEY_CHUNK],
    ) {
        let (q, o) = (q.as_flattened().as_ptr(), s.as_mut_ptr());
        // SAFETY: in every arm, `rows` point at `32 pieces` f16 each (the caller's contract); the
        // kernels read the `32 R pieces` packed floats of `q` (a 2-row kernel rows 0, 1 or 2, 3 of
        // each 16 dimensions, skipping the other two: 128 bytes) and write `rows.len()` entries of
        // `s` (2 lanes each from byte 0 or 8 for the 2-row kernel).
        unsafe {
            match R {
                1 => dscores1(q, pieces, rows, scale, o, 0),
                2 => dscores2(q, pieces, rows, scale, o, 0),
                3 => dscores3(q, pieces, rows, scale, o, 0),
                _ => {
                    dscores_pair(q, pieces, rows, scale, o, 128);
                    dscores_pair(q.add(32), pieces, rows, scale, o.cast::<f32>().add(2).cast(), 128);
                }
            }
        }
    }

    fn softmax(
        s: &[[f32; 4]],
        max: &mut float32x4_t,
        sum: &mut float32x4_t,
        w: &mut [[f32; 8]; KEY_CHUNK],
        raise: &mut [u32; KEY_CHUNK],
    ) {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { softmax_rows(s, max, sum, w, raise) }
    }

    unsafe fn values(
        acc: *mut F16Le,
        dv: usize,
        d: usize,
        wide: bool,
        v: &[*const F16Le],
        w: &[[f32; 8]; KEY_CHUNK],
        raise: &[u32; KEY_CHUNK],
    ) {
        // SAFETY: the caller's contract, which every kernel shares.
        unsafe {
            match (R, wide) {
                (1, true) => dvalues1w(acc, dv, d, v, w, raise),
                (1, false) => dvalues1n(acc, dv, d, v, w, raise),
                (2, true) => dvalues2w(acc, dv, d, v, w, raise),
                (2, false) => dvalues2n(acc, dv, d, v, w, raise),
                (3, true) => dvalues3w(acc, dv, d, v, w, raise),
                (3, false) => dvalues3n(acc, dv, d, v, w, raise),
                (_, true) => dvalues4w(acc, dv, d, v, w, raise),
                (_, false) => dvalues4n(acc, dv, d, v, w, raise),
            }
        }
    }
}

/// The reference's softmax steps for a chunk of keys, the rows in the lanes (`s[i]`: key `i`'s
/// scores): per key, the weights (`vs` in lanes 0..4 of `w[i]`, `ms` in 4..8) and which rows raise
/// their maximum (`raise[i]`: bit `r` for row `r`); `max` and `sum` carried over. A first pass
/// uses [`expf4`] alone (no calls, so its constants stay in registers); if any lane fell outside
/// its exact range the chunk is redone with `libm::expf` there.
#[target_feature(enable = "neon")]
#[inline(never)]
fn softmax_rows(
    s: &[[f32; 4]],
    max: &mut float32x4_t,
    sum: &mut float32x4_t,
    w: &mut [[f32; 8]; KEY_CHUNK],
    raise: &mut [u32; KEY_CHUNK],
) {
    let (mx, total) = (*max, *sum);
    if !softmax_pass::<false>(s, max, sum, w, raise) {
        (*max, *sum) = (mx, total);
        softmax_pass::<true>(s, max, sum, w, raise);
    }
}

/// [`softmax_rows`]' steps; `EXACT`: lanes outside [`expf4`]'s exact range take `libm::expf`,
/// else they are left wrong and `false` is returned.
#[target_feature(enable = "neon")]
#[inline]
fn softmax_pass<const EXACT: bool>(
    s: &[[f32; 4]],
    max: &mut float32x4_t,
    sum: &mut float32x4_t,
    w: &mut [[f32; 8]; KEY_CHUNK],
    raise: &mut [u32; KEY_CHUNK],
) -> bool {
    let one = vdupq_n_f32(1.0);
    // SAFETY: reads the 4 lanes of the array.
    let bits = unsafe { vld1q_u32([1u32, 2, 4, 8].as_ptr()) };
    let (mut mx, mut total) = (*max, *sum);
    let mut all = vdupq_n_u32(u32::MAX);
    for ((s, w), raise) in s.iter().zip(w.iter_mut()).zip(raise.iter_mut()) {
        let s = ld_f32x4(s);
        let up = vcgtq_f32(s, mx);
        let x = vbslq_f32(up, vsubq_f32(mx, s), vsubq_f32(s, mx));
        mx = vbslq_f32(up, s, mx);
        let (mut e, ok) = expf4(x);
        if EXACT {
            if vminvq_u32(ok) == 0 {
                let mut a = [0f32; 4];
                st_f32x4(&mut a, x);
                e = ld_f32x4(&a.map(libm::expf));
            }
        } else {
            all = vandq_u32(all, ok);
        }
        let (ms, vs) = (vbslq_f32(up, e, one), vbslq_f32(up, one, e));
        total = vaddq_f32(vmulq_f32(total, ms), vs);
        st_f32x4(w, vs);
        st_f32x4(&mut w[4..], ms);
        *raise = vaddvq_u32(vandq_u32(up, bits));
    }
    (*max, *sum) = (mx, total);
    vminvq_u32(all) != 0
}

/// 16 dimensions of one query row (`{qp}`, f32) times the key's (v0-v3, widened), into the row's
/// accumulators `v$l0, v$h0` (8 lanes of one ggml accumulator) and `v$l1, v$h1` (the next).
#[rustfmt::skip]
macro_rules! drow16 { ($op:literal, $l0:literal, $h0:literal, $l1:literal, $h1:literal) => { concat!(
    "ld1 {{v4.4s, v5.4s, v6.4s, v7.4s}}, [{qp}], #64\n",
    $op, " v", $l0, ".4s, v0.4s, v4.4s\n",   $op, " v", $h0, ".4s, v1.4s, v5.4s\n",
    $op, " v", $l1, ".4s, v2.4s, v6.4s\n",   $op, " v", $h1, ".4s, v3.4s, v7.4s\n",
) } }

/// 16 dimensions of the key (`{p}`, f16) widened to f32 into v0-v3.
#[rustfmt::skip]
macro_rules! dkey16 { () => { concat!(
    "ld1 {{v0.8h, v1.8h}}, [{p}], #32\n",
    "fcvtl2 v3.4s, v1.8h\n",     "fcvtl v2.4s, v1.4h\n",
    "fcvtl2 v1.4s, v0.8h\n",     "fcvtl v0.4s, v0.4h\n",
) } }

/// A row's four 8-lane accumulators (`v$a..`: lo, hi of accumulator 0, 1, 2, 3) folded as ggml's
/// x86 reduction: `x = (a0 + a2) + (a1 + a3)`, `t[i] = x[i] + x[i + 4]`, into `v$a0.4s`.
#[rustfmt::skip]
macro_rules! dfold { ($a0:literal, $b0:literal, $a1:literal, $b1:literal,
                      $a2:literal, $b2:literal, $a3:literal, $b3:literal) => { concat!(
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $a2, ".4s\n",
    "fadd v", $b0, ".4s, v", $b0, ".4s, v", $b2, ".4s\n",
    "fadd v", $a1, ".4s, v", $a1, ".4s, v", $a3, ".4s\n",
    "fadd v", $b1, ".4s, v", $b1, ".4s, v", $b3, ".4s\n",
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $a1, ".4s\n",
    "fadd v", $b0, ".4s, v", $b0, ".4s, v", $b1, ".4s\n",
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $b0, ".4s\n",
) } }

/// Defines a scores kernel for `R` rows (at most 3: 8 accumulator registers a row): per key, each
/// 32 dimensions as two steps of 16 (accumulators 0, 1 then 2, 3: dimension chunk `c` of 8 into
/// ggml's accumulator `c % 4`; `fmul` for the first 32 dimensions, then `fmla`), the rows folded
/// ([`dfold`]), each row's four lanes summed as `(t0 + t1) + (t2 + t3)` by `faddp`, times the
/// scale, stored (`$store`: a whole 4-lane entry, or 2 lanes at `$lane_off` bytes).
#[rustfmt::skip]
macro_rules! dscores_kernel {
    ($name:ident, $r:literal, [$( ($a0:literal, $b0:literal, $a1:literal, $b1:literal,
                                   $a2:literal, $b2:literal, $a3:literal, $b3:literal) ),+],
     [$( $fin:literal ),+], $store:literal) => {
        /// # Safety
        /// Each row points at `32 pieces` f16 values (`pieces > 0`, `rows.len() > 0`); from `qp`,
        /// per 16 dimensions, `16 R` floats are read, then `stride` bytes skipped; `s` has room for
        /// `rows.len()` entries of 16 bytes.
        #[target_feature(enable = "neon")]
        unsafe fn $name(qp: *const f32, pieces: usize, rows: &[*const F16Le], scale: f32, s: *mut [f32; 4],
                        stride: usize) {
            debug_assert!(!rows.is_empty() && pieces > 0);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "mov {qp}, {qd}",
                    dkey16!(),
                    $( drow16!("fmul", $a0, $b0, $a1, $b1), )+
                    "add {qp}, {qp}, {stride}",
                    dkey16!(),
                    $( drow16!("fmul", $a2, $b2, $a3, $b3), )+
                    "add {qp}, {qp}, {stride}",
                    "subs {c}, {pieces}, #1",
                    "b.eq 4f",
                    "3:",
                    dkey16!(),
                    $( drow16!("fmla", $a0, $b0, $a1, $b1), )+
                    "add {qp}, {qp}, {stride}",
                    dkey16!(),
                    $( drow16!("fmla", $a2, $b2, $a3, $b3), )+
                    "add {qp}, {qp}, {stride}",
                    "subs {c}, {c}, #1",
                    "b.ne 3b",
                    "4:",
                    $( dfold!($a0, $b0, $a1, $b1, $a2, $b2, $a3, $b3), )+
                    $( $fin, )+
                    "dup v4.4s, {sc:w}",
                    "fmul v8.4s, v8.4s, v4.4s",
                    $store,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    out = inout(reg) s => _,
                    qd = in(reg) qp,
                    pieces = in(reg) pieces,
                    stride = in(reg) stride,
                    sc = in(reg) scale.to_bits(),
                    qp = out(reg) _,
                    p = out(reg) _,
                    c = out(reg) _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

dscores_kernel!(
    dscores1,
    1,
    [("8", "9", "10", "11", "12", "13", "14", "15")],
    ["faddp v8.4s, v8.4s, v8.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores2,
    2,
    [("8", "9", "10", "11", "12", "13", "14", "15"), ("16", "17", "18", "19", "20", "21", "22", "23")],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores3,
    3,
    [
        ("8", "9", "10", "11", "12", "13", "14", "15"),
        ("16", "17", "18", "19", "20", "21", "22", "23"),
        ("24", "25", "26", "27", "28", "29", "30", "31")
    ],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v24.4s, v24.4s, v24.4s", "faddp v8.4s, v8.4s, v24.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores_pair,
    2,
    [("8", "9", "10", "11", "12", "13", "14", "15"), ("16", "17", "18", "19", "20", "21", "22", "23")],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str d8, [{out}]\nadd {out}, {out}, #16"
);

/// `acc = f16(fma(v, vs, f32(acc)))` for the f16 accumulator `v$a` (8 lanes), the value widened in
/// `v$lo`, `v$hi` and the row's weight in lane `$l` of v4 (v0, v1 scratch).
#[rustfmt::skip]
macro_rules! dmad8 { ($a:literal, $lo:literal, $hi:literal, $l:literal) => { concat!(
    "fcvtl v0.4s, v", $a, ".4h\n",               "fcvtl2 v1.4s, v", $a, ".8h\n",
    "fmla v0.4s, v", $lo, ".4s, v4.s[", $l, "]\n", "fmla v1.4s, v", $hi, ".4s, v4.s[", $l, "]\n",
    "fcvtn v", $a, ".4h, v0.4s\n",               "fcvtn2 v", $a, ".8h, v1.4s\n",
) } }

/// `acc = f16(f32(acc) ms)` for the f16 accumulator `v$a`, the row's `ms` in lane `$l` of v5.
#[rustfmt::skip]
macro_rules! dscale8 { ($a:literal, $l:literal) => { concat!(
    "fcvtl v0.4s, v", $a, ".4h\n",               "fcvtl2 v1.4s, v", $a, ".8h\n",
    "fmul v0.4s, v0.4s, v5.s[", $l, "]\n",       "fmul v1.4s, v1.4s, v5.s[", $l, "]\n",
    "fcvtn v", $a, ".4h, v0.4s\n",               "fcvtn2 v", $a, ".8h, v1.4s\n",
) } }

/// Defines the value-update kernel for `R` rows and 32 dimensions (`w`: row `r`'s f16
/// accumulators in 4 registers, the value widened into v6-v13) or 8 (`n`: one register, v6, v7):
/// the accumulators loaded from `acc`, then per key the reference's steps with the weights of
/// all rows (`vs` in lanes 0..4 of v4, `ms` in v5): `acc = f16(acc ms)` for each row that raises
/// its maximum (bit `r` of the key's `raise`), then `acc = f16(fma(v, vs, acc))`; the accumulators
/// stored back.
#[rustfmt::skip]
macro_rules! dvalues_kernel {
    ($name:ident, w, [$( ($l:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        dvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldp q", $a0, ", q", $a1, ", [{t}]\n", "ldp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "stp q", $a0, ", q", $a1, ", [{t}]\n", "stp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}]\n",
                    "fcvtl v6.4s, v0.4h\n", "fcvtl2 v7.4s, v0.8h\n", "fcvtl v8.4s, v1.4h\n", "fcvtl2 v9.4s, v1.8h\n",
                    "fcvtl v10.4s, v2.4h\n", "fcvtl2 v11.4s, v2.8h\n", "fcvtl v12.4s, v3.4h\n", "fcvtl2 v13.4s, v3.8h\n"),
            concat!($( dmad8!($a0, "6", "7", $l), dmad8!($a1, "8", "9", $l),
                       dmad8!($a2, "10", "11", $l), dmad8!($a3, "12", "13", $l), )+),
            concat!($( "tbz {f:w}, #", $l, ", 7f\n",
                       dscale8!($a0, $l), dscale8!($a1, $l), dscale8!($a2, $l), dscale8!($a3, $l), "7:\n", )+));
    };
    ($name:ident, n, [$( ($l:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        dvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldr q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "str q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("ldr q2, [{p}]\n", "fcvtl v6.4s, v2.4h\n", "fcvtl2 v7.4s, v2.8h\n"),
            concat!($( dmad8!($a0, "6", "7", $l), )+),
            concat!($( "tbz {f:w}, #", $l, ", 7f\n", dscale8!($a0, $l), "7:\n", )+));
    };
    (@def $name:ident, $load:expr, $store:expr, $vload:expr, $mad:expr, $rescale:expr) => {
        /// # Safety
        /// `acc` points at row 0's accumulators of the slice (`R` rows `dv` f16 apart), each of
        /// `rows` at `dv` f16 values of which `d..` hold the slice; `w` and `raise` have at least
        /// `rows.len() > 0` entries.
        #[target_feature(enable = "neon")]
        unsafe fn $name(
            acc: *mut F16Le,
            dv: usize,
            d: usize,
            rows: &[*const F16Le],
            w: &[[f32; 8]; KEY_CHUNK],
            raise: &[u32; KEY_CHUNK],
        ) {
            debug_assert!(!rows.is_empty() && rows.len() <= KEY_CHUNK);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $load,
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "ldp q4, q5, [{w}], #32",
                    "ldr {f:w}, [{raise}], #4",
                    "add {p}, {p}, {off}",
                    "cbnz {f:w}, 5f",
                    "3:",
                    $vload,
                    $mad,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "b 6f",
                    "5:",
                    $rescale,
                    "b 3b",
                    "6:",
                    $store,
                    a = in(reg) acc,
                    t = out(reg) _,
                    stride = in(reg) 2 * dv,
                    off = in(reg) 2 * d,
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    w = inout(reg) w.as_ptr() => _,
                    raise = inout(reg) raise.as_ptr() => _,
                    p = out(reg) _,
                    f = out(reg) _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
                    out("v6") _, out("v7") _, out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

dvalues_kernel!(dvalues1w, w, [("0", "16", "17", "18", "19")]);
dvalues_kernel!(dvalues1n, n, [("0", "16", "17", "18", "19")]);
dvalues_kernel!(dvalues2w, w, [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23")]);
dvalues_kernel!(dvalues2n, n, [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23")]);
dvalues_kernel!(
    dvalues3w,
    w,
    [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23"), ("2", "24", "25", "26", "27")]
);
dvalues_kernel!(
    dvalues3n,
    n,
    [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23"), ("2", "24", "25", "26", "27")]
);
dvalues_kernel!(
    dvalues4w,
    w,
    [
        ("0", "16", "17", "18", "19"),
        ("1", "20", "21", "22", "23"),
        ("2", "24", "25", "26", "27"),
        ("3", "28", "29", "30", "31")
    ]
);
dvalues_kernel!(
    dvalues4n,
    n,
    [
        ("0", "16", "17", "18", "19"),
        ("1", "20", "21", "22", "23"),
        ("2", "24", "25", "26", "27"),
        ("3", "28", "29", "30", "31")
    ]
);

// ---------------------------------------------------------------------------------------------
// Flash attention in FEAT_FP16 arithmetic

/// Flash attention of up to [`FLASH_ROWS`] query rows over the same keys in FEAT_FP16 vector
/// arithmetic (`fmla .8h`), as llama.cpp's aarch64 build computes it:
/// `reference::flash_attn_rows_f16arith_ref`'s results, bit for bit. Shapes the kernels do not
/// take (head sizes not multiples of 8 or past `MAX_HEAD`, ragged rows) go to that twin.
///
/// Runs on the `fp16` path (`KernelPath::NeonFp16`), detected wherever the CPU has dotprod and
/// FEAT_FP16 (Cortex-A76 and A55): the same numerics as llama.cpp on the board. The tests hold it
/// to llama.cpp's aarch64 build (tests/golden/*.arm.greedy.jsonl and *.arm.spread.jsonl, written
/// by `scripts/make_golden.py --arm` and `scripts/golden_spread.py --arm`); its f16 scores and
/// f16-rounded weights move the tiny random MoE models' routing away from the x86 build's
/// (qwen3moe-tiny step 0: a top-5 logit 0.92 off), as llama.cpp's own aarch64 build does. The
/// `dotprod` path keeps the x86 arithmetic.
///
/// # Safety
/// The CPU has FEAT_FP16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,fp16")]
pub unsafe fn flash_attn_rows_fp16<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    let n = qs.len().min(outs.len());
    if n == 0 {
        return [RowSoftmax::EMPTY; FLASH_ROWS];
    }
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let fits = n <= FLASH_ROWS
        && dk > 0
        && dv > 0
        && dk <= MAX_HEAD
        && dv <= MAX_HEAD
        && dk % 8 == 0
        && dv % 8 == 0
        && q16.len() >= n * dk
        && acc16.len() >= n * dv
        && qs[..n].iter().all(|q| q.len() == dk)
        && outs[..n].iter().all(|o| o.len() == dv);
    if !fits {
        return flash_attn_rows_f16arith_ref(qs, q16, keys, key, value, scale, acc16, outs);
    }
    let (qs, outs) = (&qs[..n], &mut outs[..n]);
    // SAFETY: the shapes were checked above; the CPU has FEAT_FP16 (this function's contract).
    unsafe {
        match n {
            1 => attend_rows::<Fp16<1>>(qs, q16, keys, key, value, scale, acc16, outs),
            2 => attend_rows::<Fp16<2>>(qs, q16, keys, key, value, scale, acc16, outs),
            3 => attend_rows::<Fp16<3>>(qs, q16, keys, key, value, scale, acc16, outs),
            _ => attend_rows::<Fp16<4>>(qs, q16, keys, key, value, scale, acc16, outs),
        }
    }
}

/// One query row of [`flash_attn_rows_fp16`] (`reference::flash_attn_row_f16arith_ref`).
///
/// # Safety
/// The CPU has FEAT_FP16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,fp16")]
pub unsafe fn flash_attn_row_fp16<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) -> RowSoftmax {
    // SAFETY: the CPU has FEAT_FP16 (this function's contract).
    unsafe { flash_attn_rows_fp16(&[q], q16, keys, key, value, scale, acc16, &mut [out])[0] }
}

/// The FEAT_FP16 family for `R` rows: queries rounded to f16, packed per 32 dimensions (row 0's,
/// row 1's, ...), zero past `dk`; scores and weights in f16 arithmetic.
struct Fp16<const R: usize>;

impl<const R: usize> Family for Fp16<R> {
    type Queries = [F16Le; FLASH_ROWS * MAX_HEAD];
    type Weight = [u16; 8];
    const NO_WEIGHT: [u16; 8] = [0; 8];

    const NO_QUERIES: Self::Queries = [F16Le::from_bits(0); FLASH_ROWS * MAX_HEAD];

    fn queries(qs: &[&[f32]], q16: &mut [F16Le], dk: usize, qp: &mut Self::Queries) {
        for (r, q) in qs.iter().enumerate() {
            let h = &mut q16[r * dk..(r + 1) * dk];
            for (q, h) in q.chunks_exact(8).zip(h.chunks_exact_mut(8)) {
                // SAFETY: NEON is part of the aarch64 baseline.
                unsafe { st_f16x8(h, f16_narrow(ld_f32x4(q), ld_f32x4(&q[4..]))) };
            }
            for (c, piece) in h.chunks(32).enumerate() {
                qp[(c * R + r) * 32..][..piece.len()].copy_from_slice(piece);
            }
        }
    }

    unsafe fn scores(
        q: &Self::Queries,
        pieces: usize,
        rows: &[*const F16Le],
        scale: f32,
        s: &mut [[f32; 4]; KEY_CHUNK],
    ) {
        // SAFETY: in every arm, `rows` point at `32 pieces` f16 each (the caller's contract), `q`
        // holds `32 R pieces`, `s` has `rows.len()` entries; the CPU has FEAT_FP16 (the family's
        // entry points' contract).
        unsafe {
            match R {
                1 => hscores1(q, pieces, rows, scale, s),
                2 => hscores2(q, pieces, rows, scale, s),
                3 => hscores3(q, pieces, rows, scale, s),
                _ => hscores4(q, pieces, rows, scale, s),
            }
        }
    }

    /// Per key, the rows in the lanes (rows past `R` repeat a row): the reference's softmax step,
    /// the weights rounded to f16 (`vs` in halves 0..4, `ms` in 4..8) and whether any row raises
    /// its maximum.
    fn softmax(
        s: &[[f32; 4]],
        max: &mut float32x4_t,
        sum: &mut float32x4_t,
        w: &mut [[u16; 8]; KEY_CHUNK],
        raise: &mut [u32; KEY_CHUNK],
    ) {
        // SAFETY: NEON is part of the aarch64 baseline; the store writes the 8 halves of `w`.
        unsafe {
            let one = vdupq_n_f32(1.0);
            for ((s, w), raise) in s.iter().zip(w.iter_mut()).zip(raise.iter_mut()) {
                let s = ld_f32x4(s);
                let up = vcgtq_f32(s, *max);
                let x = vbslq_f32(up, vsubq_f32(*max, s), vsubq_f32(s, *max));
                *max = vbslq_f32(up, s, *max);
                let (mut e, ok) = expf4(x);
                if vminvq_u32(ok) == 0 {
                    let mut a = [0f32; 4];
                    st_f32x4(&mut a, x);
                    let a = a.map(libm::expf);
                    e = ld_f32x4(&a);
                }
                let (ms, vs) = (vbslq_f32(up, e, one), vbslq_f32(up, one, e));
                *sum = vaddq_f32(vmulq_f32(*sum, ms), vs);
                vst1q_u16(w.as_mut_ptr(), f16_narrow(vs, ms));
                *raise = vmaxvq_u32(up);
            }
        }
    }

    unsafe fn values(
        acc: *mut F16Le,
        dv: usize,
        d: usize,
        wide: bool,
        v: &[*const F16Le],
        w: &[[u16; 8]; KEY_CHUNK],
        raise: &[u32; KEY_CHUNK],
    ) {
        // SAFETY: the caller's contract, which every kernel shares; the CPU has FEAT_FP16.
        unsafe {
            match (R, wide) {
                (1, true) => hvalues1w(acc, dv, d, v, w, raise),
                (1, false) => hvalues1n(acc, dv, d, v, w, raise),
                (2, true) => hvalues2w(acc, dv, d, v, w, raise),
                (2, false) => hvalues2n(acc, dv, d, v, w, raise),
                (3, true) => hvalues3w(acc, dv, d, v, w, raise),
                (3, false) => hvalues3n(acc, dv, d, v, w, raise),
                (_, true) => hvalues4w(acc, dv, d, v, w, raise),
                (_, false) => hvalues4n(acc, dv, d, v, w, raise),
            }
        }
    }
}

/// 32 dimensions of one query row (`{qp}`) times the key's in v0-v3, into the row's f16
/// accumulators `v$a0..v$a3` (`$op`: `fmul` for the first 32, else `fmla`).
#[rustfmt::skip]
macro_rules! hrow32 { ($op:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "ld1 {{v4.8h, v5.8h, v6.8h, v7.8h}}, [{qp}], #64\n",
    $op, " v", $a0, ".8h, v0.8h, v4.8h\n",   $op, " v", $a1, ".8h, v1.8h, v5.8h\n",
    $op, " v", $a2, ".8h, v2.8h, v6.8h\n",   $op, " v", $a3, ".8h, v3.8h, v7.8h\n",
) } }

/// A row's accumulators folded as the twin does: `(a0 + a2) + (a1 + a3)` in f16, the halves
/// widened and added (`t[i] = x[i] + x[i + 4]`), into `v$a0.4s`.
#[rustfmt::skip]
macro_rules! hfold { ($a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "fadd v", $a0, ".8h, v", $a0, ".8h, v", $a2, ".8h\n",
    "fadd v", $a1, ".8h, v", $a1, ".8h, v", $a3, ".8h\n",
    "fadd v", $a0, ".8h, v", $a0, ".8h, v", $a1, ".8h\n",
    "fcvtl v", $a1, ".4s, v", $a0, ".4h\n",
    "fcvtl2 v", $a2, ".4s, v", $a0, ".8h\n",
    "fadd v", $a0, ".4s, v", $a1, ".4s, v", $a2, ".4s\n",
) } }

/// Defines the scores kernel for `R` rows: per key, each 32 dimensions loaded once for every row
/// ([`hrow32`], the queries packed per 32 dimensions), the rows folded ([`hfold`]), the four
/// lanes `t` of each row summed pairwise as `(t0 + t1) + (t2 + t3)` by `faddp` (rows past `R`
/// repeat one), times the scale, stored as one 4-lane entry per key.
#[rustfmt::skip]
macro_rules! hscores_kernel {
    ($name:ident, $r:literal, [$( ($a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+],
     [$( $fin:literal ),+]) => {
        /// # Safety
        /// Each row points at `32 pieces` f16 values (`pieces > 0`); `qp` holds `32 R pieces`;
        /// `0 < rows.len() <= s.len()`; the CPU has FEAT_FP16.
        #[target_feature(enable = "neon,fp16")]
        unsafe fn $name(qp: &[F16Le], pieces: usize, rows: &[*const F16Le], scale: f32, s: &mut [[f32; 4]]) {
            debug_assert!(!rows.is_empty() && rows.len() <= s.len() && pieces > 0);
            debug_assert!(qp.len() >= 32 * $r * pieces);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "mov {qp}, {qd}",
                    "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}], #64",
                    $( hrow32!("fmul", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {pieces}, #1",
                    "b.eq 4f",
                    "3:",
                    "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}], #64",
                    $( hrow32!("fmla", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {c}, #1",
                    "b.ne 3b",
                    "4:",
                    $( hfold!($a0, $a1, $a2, $a3), )+
                    $( $fin, )+
                    "fmul v16.4s, v16.4s, v8.s[0]",
                    "str q16, [{out}], #16",
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    out = inout(reg) s.as_mut_ptr() => _,
                    qd = in(reg) qp.as_ptr(),
                    pieces = in(reg) pieces,
                    qp = out(reg) _,
                    p = out(reg) _,
                    c = out(reg) _,
                    in("v8") scale,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

hscores_kernel!(
    hscores1,
    1,
    [("16", "17", "18", "19")],
    ["faddp v16.4s, v16.4s, v16.4s", "faddp v16.4s, v16.4s, v16.4s"]
);
hscores_kernel!(
    hscores2,
    2,
    [("16", "17", "18", "19"), ("20", "21", "22", "23")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v16.4s, v16.4s, v16.4s"]
);
hscores_kernel!(
    hscores3,
    3,
    [("16", "17", "18", "19"), ("20", "21", "22", "23"), ("24", "25", "26", "27")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v24.4s, v24.4s, v24.4s", "faddp v16.4s, v16.4s, v24.4s"]
);
hscores_kernel!(
    hscores4,
    4,
    [("16", "17", "18", "19"), ("20", "21", "22", "23"), ("24", "25", "26", "27"), ("28", "29", "30", "31")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v24.4s, v24.4s, v28.4s", "faddp v16.4s, v16.4s, v24.4s"]
);

/// Defines the value-update kernel for `R` rows and 32 dimensions (`w`, the accumulators of row `r`
/// in 4 registers) or 8 (`n`, one register): the accumulators loaded from `acc`, then per key a
/// rescale by the `ms` halves (4..8 of the weights) when any row raises its maximum, the
/// `fmla .8h` of the value times the `vs` halves (0..4), and the accumulators stored back.
#[rustfmt::skip]
macro_rules! hvalues_kernel {
    ($name:ident, w, [$( ($lane:literal, $ml:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        hvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldp q", $a0, ", q", $a1, ", [{t}]\n", "ldp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "stp q", $a0, ", q", $a1, ", [{t}]\n", "stp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}]",
            concat!($( "fmla v", $a0, ".8h, v0.8h, v4.h[", $lane, "]\n", "fmla v", $a1, ".8h, v1.8h, v4.h[", $lane, "]\n",
                       "fmla v", $a2, ".8h, v2.8h, v4.h[", $lane, "]\n", "fmla v", $a3, ".8h, v3.8h, v4.h[", $lane, "]\n", )+),
            concat!($( "fmul v", $a0, ".8h, v", $a0, ".8h, v4.h[", $ml, "]\n", "fmul v", $a1, ".8h, v", $a1, ".8h, v4.h[", $ml, "]\n",
                       "fmul v", $a2, ".8h, v", $a2, ".8h, v4.h[", $ml, "]\n", "fmul v", $a3, ".8h, v", $a3, ".8h, v4.h[", $ml, "]\n", )+));
    };
    ($name:ident, n, [$( ($lane:literal, $ml:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        hvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldr q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "str q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            "ldr q0, [{p}]",
            concat!($( "fmla v", $a0, ".8h, v0.8h, v4.h[", $lane, "]\n", )+),
            concat!($( "fmul v", $a0, ".8h, v", $a0, ".8h, v4.h[", $ml, "]\n", )+));
    };
    (@def $name:ident, $load:expr, $store:expr, $vload:expr, $mad:expr, $rescale:expr) => {
        /// # Safety
        /// `acc` points at row 0's accumulators of the slice (`R` rows `dv` f16 apart), each of
        /// `rows` at `dv` f16 values of which `d..` hold the slice; `w` and `raise` have at least
        /// `rows.len() > 0` entries; the CPU has FEAT_FP16.
        #[target_feature(enable = "neon,fp16")]
        unsafe fn $name(
            acc: *mut F16Le,
            dv: usize,
            d: usize,
            rows: &[*const F16Le],
            w: &[[u16; 8]; KEY_CHUNK],
            raise: &[u32; KEY_CHUNK],
        ) {
            debug_assert!(!rows.is_empty() && rows.len() <= KEY_CHUNK);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $load,
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "ldr q4, [{w}], #16",
                    "ldr {f:w}, [{raise}], #4",
                    "add {p}, {p}, {off}",
                    "cbnz {f:w}, 5f",
                    "3:",
                    $vload,
                    $mad,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "b 6f",
                    "5:",
                    $rescale,
                    "b 3b",
                    "6:",
                    $store,
                    a = in(reg) acc,
                    t = out(reg) _,
                    stride = in(reg) 2 * dv,
                    off = in(reg) 2 * d,
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    w = inout(reg) w.as_ptr() => _,
                    raise = inout(reg) raise.as_ptr() => _,
                    p = out(reg) _,
                    f = out(reg) _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

hvalues_kernel!(hvalues1w, w, [("0", "4", "16", "17", "18", "19")]);
hvalues_kernel!(hvalues1n, n, [("0", "4", "16", "17", "18", "19")]);
hvalues_kernel!(hvalues2w, w, [("0", "4", "16", "17", "18", "19"), ("1", "5", "20", "21", "22", "23")]);
hvalues_kernel!(hvalues2n, n, [("0", "4", "16", "17", "18", "19"), ("1", "5", "20", "21", "22", "23")]);
hvalues_kernel!(
    hvalues3w,
    w,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27")
    ]
);
hvalues_kernel!(
    hvalues3n,
    n,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27")
    ]
);
hvalues_kernel!(
    hvalues4w,
    w,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27"),
        ("3", "7", "28", "29", "30", "31")
    ]
);
hvalues_kernel!(
    hvalues4n,
    n,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27"),
        ("3", "7", "28", "29", "30", "31")
    ]
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// `expf4` against `libm::expf` on every 61st f32 in [-110, 0] and the mask's edges.
    #[test]
    fn expf4_is_bit_identical_where_it_says_so() {
        let mut xs: Vec<f32> = (0..=110f32.to_bits()).step_by(61).map(|b| -f32::from_bits(b)).collect();
        xs.extend([0.0, -0.0, -86.0, -85.99999, -86.00001, -90.0, 1.0, f32::NEG_INFINITY, f32::NAN, -1e30]);
        xs.extend([0x42cf_f1b4u32, 0x42cf_f1b5, 0x42cf_f1b6].map(|b| -f32::from_bits(b)));
        xs.extend(
            [0x3f85_1592u32, 0x3f85_1593, 0x3eb1_7218, 0x3eb1_7219, 0x3900_0000, 0x3900_0001]
                .map(|b| -f32::from_bits(b)),
        );
        while xs.len() % 4 != 0 {
            xs.push(-1.0);
        }
        for x in xs.chunks_exact(4) {
            // SAFETY: NEON is part of the aarch64 baseline.
            let (e, ok) = unsafe { expf4(vld1q_f32(x.as_ptr())) };
            let (mut got, mut mask) = ([0f32; 4], [0u32; 4]);
            // SAFETY: writes 4 lanes each.
            unsafe {
                vst1q_f32(got.as_mut_ptr(), e);
                vst1q_u32(mask.as_mut_ptr(), ok);
            }
            for i in 0..4 {
                let want = libm::expf(x[i]);
                let exact = mask[i] != 0;
                let flushed = x[i] <= -f32::from_bits(0x42cf_f1b5);
                assert_eq!(exact, (-86.0..=0.0).contains(&x[i]) || flushed, "mask of {}", x[i]);
                assert!(
                    !exact || got[i].to_bits() == want.to_bits(),
                    "expf({}) = {} vs {}",
                    x[i],
                    got[i],
                    want
                );
            }
        }
    }
}
