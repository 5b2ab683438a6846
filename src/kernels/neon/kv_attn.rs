//! Row operations of attention over a quantized cache (`kernels::kv_attn`): the reference's bits.

use core::arch::aarch64::*;
use core::arch::asm;

use super::*;
use crate::kernels::reference::RowSoftmax;
use crate::quant::blocks::F16Le;

// ---------------------------------------------------------------------------------------------
// Row operations of attention over a quantized cache (`kernels::kv_attn`): the reference's bits.

/// q8_0 key row `k` times q8_0 query row `q`: `vec_dot_q8_0_q8_0_ref`'s result bit for bit (each
/// block's integer sum is exact; the f32 steps are the reference's, in its order). 0.0 if the
/// rows are not the same whole number of blocks.
fn kv_dot_q8_0(k: &[u8], q: &[u8]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { kv_dot_q8_0_neon(k, q) }
}

#[target_feature(enable = "neon")]
fn kv_dot_q8_0_neon(k: &[u8], q: &[u8]) -> f32 {
    crate::kernels::kv_attn::q8_0_q15_dot_by(k, q, crate::kernels::dot::f16, |x, hi, lo| {
        let (x0, x1) = (ld_s8x16(x), ld_s8x16(&x[16..]));
        // i8 x i8 products fit i16 (the low bytes are 0..=127); pairs of them summed into i32
        // lanes.
        let sum = |y: &[u8]| {
            let (y0, y1) = (ld_s8x16(y), ld_s8x16(&y[16..]));
            let mut s = vpaddlq_s16(vmull_s8(vget_low_s8(x0), vget_low_s8(y0)));
            s = vpadalq_s16(s, vmull_high_s8(x0, y0));
            s = vpadalq_s16(s, vmull_s8(vget_low_s8(x1), vget_low_s8(y1)));
            vpadalq_s16(s, vmull_high_s8(x1, y1))
        };
        vaddvq_s32(vaddq_s32(vshlq_n_s32::<7>(sum(hi)), sum(lo)))
    })
}

/// q8_0 row to f32 (`q * d` per element, as `dequantize_q8_0_ref`); `false` if `out` is not the
/// row's length.
fn kv_widen_q8_0(src: &[u8], out: &mut [f32]) -> bool {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { kv_widen_q8_0_neon(src, out) }
}

#[target_feature(enable = "neon")]
fn kv_widen_q8_0_neon(src: &[u8], out: &mut [f32]) -> bool {
    const B: usize = 34;
    if src.len() % B != 0 || out.len() != src.len() / B * 32 {
        return false;
    }
    for (b, o) in src.chunks_exact(B).zip(out.chunks_exact_mut(32)) {
        let d = crate::kernels::dot::f16(F16Le([b[0], b[1]]));
        for (h, o) in o.chunks_exact_mut(16).enumerate() {
            let q = ld_s8x16(&b[2 + 16 * h..]);
            let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_high_s8(q));
            let w = [
                vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                vcvtq_f32_s32(vmovl_high_s16(lo)),
                vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                vcvtq_f32_s32(vmovl_high_s16(hi)),
            ];
            st_f32x16(o, w.map(|v| vmulq_n_f32(v, d)));
        }
    }
    true
}

/// f16 row to f32 (exact); `false` if `out` is not the row's length.
pub(super) fn kv_widen_f16(src: &[u8], out: &mut [f32]) -> bool {
    if out.len() * 2 != src.len() {
        return false;
    }
    let whole = out.len() - out.len() % 4;
    for (o, h) in out[..whole].chunks_exact_mut(4).zip(src.chunks_exact(8)) {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { st_f32x4(o, f16x4_to_f32(h)) };
    }
    for (o, h) in out[whole..].iter_mut().zip(src[2 * whole..].chunks_exact(2)) {
        *o = crate::kernels::dot::f16(F16Le([h[0], h[1]]));
    }
    true
}

/// [`crate::kernels::kv_attn::update_ref`] (its bits: the same products and fused adds per
/// element) with the accumulator in registers across the chunk's keys, 64 columns at a time.
fn kv_update(acc: &mut [f32], vals: &[f32], w: &[f32], raises: &[bool]) {
    let dv = acc.len();
    if dv == 0 {
        return;
    }
    let m = w.len().min(raises.len()).min(vals.len() / dv);
    let mut c = 0;
    while c + 64 <= dv {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { update_cols::<16>(&mut acc[c..c + 64], &vals[c..], dv, &w[..m], &raises[..m]) };
        c += 64;
    }
    while c + 4 <= dv {
        // SAFETY: as above.
        unsafe { update_cols::<1>(&mut acc[c..c + 4], &vals[c..], dv, &w[..m], &raises[..m]) };
        c += 4;
    }
    crate::kernels::kv_attn::update_tail_ref(acc, &vals[..m * dv], c, &w[..m], &raises[..m]);
}

/// `4 V` columns of [`kv_update`]: `acc` those columns, `vals` the values from the first of
/// them (key `i`'s at `i * dv`).
#[target_feature(enable = "neon")]
fn update_cols<const V: usize>(acc: &mut [f32], vals: &[f32], dv: usize, w: &[f32], raises: &[bool]) {
    let acc: &mut [f32] = &mut acc[..4 * V];
    let mut r: [float32x4_t; V] = core::array::from_fn(|i| ld_f32x4(&acc[4 * i..]));
    for (i, (&w, &raise)) in w.iter().zip(raises).enumerate() {
        let v = &vals[i * dv..i * dv + 4 * V];
        let s = if raise {
            r.iter_mut().for_each(|x| *x = vmulq_n_f32(*x, w));
            1.0
        } else {
            w
        };
        for (j, x) in r.iter_mut().enumerate() {
            *x = vfmaq_n_f32(*x, ld_f32x4(&v[4 * j..]), s);
        }
    }
    for (j, x) in r.iter().enumerate() {
        st_f32x4(&mut acc[4 * j..], *x);
    }
}

/// `kv_attn::attend` with the NEON operations: q8_0 key dots, q8_0 and f16 value widening and the
/// update, the exponentials 4 at a time (`expf4`, `libm::expf` where it is not exact); other key
/// and value types through `ops`' functions. The reference operations' bits.
pub fn kv_attend<'k>(
    ops: &crate::kernels::kv_attn::KvOps,
    a: &crate::kernels::kv_attn::Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
) -> [RowSoftmax; crate::kernels::kv_attn::TYPED_ROWS] {
    kv_attend_with(ops, a, key, value, acc, vals, |ks, q, out| {
        crate::kernels::kv_attn::scores_by(ks, q, out, kv_dot_q8_0)
    })
}

/// [`kv_attend`] with the q8_0 key dots in `sdot` (the same integer sums, so the same bits).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn kv_attend_dotprod<'k>(
    ops: &crate::kernels::kv_attn::KvOps,
    a: &crate::kernels::kv_attn::Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
) -> [RowSoftmax; crate::kernels::kv_attn::TYPED_ROWS] {
    // SAFETY: this function runs with FEAT_DotProd.
    kv_attend_with(ops, a, key, value, acc, vals, |ks, q, out| unsafe { kv_scores_q8_0_sdot(ks, q, out) })
}

/// q8_0 key row times 15-bit query row with `sdot`: [`kv_dot_q8_0`]'s result.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn kv_dot_q8_0_sdot(k: &[u8], q: &[u8]) -> f32 {
    crate::kernels::kv_attn::q8_0_q15_dot_by(k, q, crate::kernels::dot::f16, |x, hi, lo| {
        vaddvq_s32(sdot_q15([ld_s8x16(x), ld_s8x16(&x[16..])], &Q15Block::load(hi, lo)))
    })
}

/// A 15-bit query block's high and low bytes in registers.
struct Q15Block {
    hi: [int8x16_t; 2],
    lo: [int8x16_t; 2],
}

impl Q15Block {
    /// The block's 32 high bytes `hi` and 32 low bytes `lo`.
    #[target_feature(enable = "neon")]
    #[inline]
    fn load(hi: &[u8], lo: &[u8]) -> Self {
        Self { hi: [ld_s8x16(hi), ld_s8x16(&hi[16..])], lo: [ld_s8x16(lo), ld_s8x16(&lo[16..])] }
    }
}

/// `128 * (x . hi) + x . lo` of a key block `x` and a query block in 4 i32 lanes: two `sdot`
/// into the high sums, a shift by 7, two more into the same lanes (each lane at most 16 products
/// of 128 * 127 before the shift: no overflow).
#[target_feature(enable = "neon,dotprod")]
#[inline]
fn sdot_q15(x: [int8x16_t; 2], y: &Q15Block) -> int32x4_t {
    let mut s = vdupq_n_s32(0);
    // SAFETY: register-only dot products and a shift (this function's CPU has FEAT_DotProd).
    unsafe {
        asm!(
            "sdot {s:v}.4s, {x0:v}.16b, {h0:v}.16b",
            "sdot {s:v}.4s, {x1:v}.16b, {h1:v}.16b",
            "shl {s:v}.4s, {s:v}.4s, #7",
            "sdot {s:v}.4s, {x0:v}.16b, {l0:v}.16b",
            "sdot {s:v}.4s, {x1:v}.16b, {l1:v}.16b",
            s = inout(vreg) s,
            x0 = in(vreg) x[0],
            x1 = in(vreg) x[1],
            h0 = in(vreg) y.hi[0],
            h1 = in(vreg) y.hi[1],
            l0 = in(vreg) y.lo[0],
            l1 = in(vreg) y.lo[1],
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    s
}

/// The dots of q8_0 `keys` with the 15-bit query `q` into `out` ([`kv_dot_q8_0_sdot`]'s results,
/// so `dot_q8_0_q15_ref`'s bits): 4 keys at a time, one per lane, the query's block loaded once
/// for them, their integer sums reduced by two pairwise adds and their scales widened by one
/// conversion; the f32 steps are the reference's per lane (`sumf + sumi * (dk * dq)`, not fused).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "neon,dotprod")]
unsafe fn kv_scores_q8_0_sdot(keys: &[&[u8]], q: &[u8], out: &mut [f32]) {
    use crate::kernels::kv_attn::{Q15_BYTES, Q15_LEN};
    const B: usize = 34;
    let n = keys.len().min(out.len());
    let blocks = q.len() / Q15_BYTES;
    let same = q.len() % Q15_BYTES == 0 && keys[..n].iter().all(|k| k.len() == blocks * B);
    let whole = if same { n - n % 4 } else { 0 };
    for (ks, o) in keys[..whole].chunks_exact(4).zip(out[..whole].chunks_exact_mut(4)) {
        let mut sumf = vdupq_n_f32(0.0);
        for (b, y) in q.chunks_exact(Q15_BYTES).enumerate() {
            let at = B * b;
            let (hi, lo) = (&y[4..4 + Q15_LEN], &y[4 + Q15_LEN..]);
            let yb = Q15Block::load(hi, lo);
            let s: [int32x4_t; 4] = core::array::from_fn(|j| {
                let x = &ks[j][at + 2..at + B];
                sdot_q15([ld_s8x16(x), ld_s8x16(&x[16..])], &yb)
            });
            let sumi = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]));
            let mut h = [0u8; 8];
            for (h, k) in h.chunks_exact_mut(2).zip(ks) {
                h.copy_from_slice(&k[at..at + 2]);
            }
            let d = vmulq_n_f32(f16x4_to_f32(&h), crate::kernels::kv_attn::q15_scale(y));
            sumf = vaddq_f32(sumf, vmulq_f32(vcvtq_f32_s32(sumi), d));
        }
        st_f32x4(o, sumf);
    }
    for (o, k) in out[whole..n].iter_mut().zip(&keys[whole..n]) {
        // SAFETY: FEAT_DotProd as above.
        *o = unsafe { kv_dot_q8_0_sdot(k, q) };
    }
}

/// The body of [`kv_attend`] and [`kv_attend_dotprod`], the q8_0 keys' scores given.
#[inline(always)]
fn kv_attend_with<'k>(
    ops: &crate::kernels::kv_attn::KvOps,
    a: &crate::kernels::kv_attn::Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
    scores_q8: impl Fn(&[&'k [u8]], &[u8], &mut [f32]),
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
        |ks, q, out| if k_q8 { scores_q8(ks, q, out) } else { scores_by(ks, q, out, dot) },
        |x: &mut [f32; KEY_CHUNK]| {
            for c in x.chunks_exact_mut(4) {
                // SAFETY: NEON is part of the aarch64 baseline.
                let (y, exact) = unsafe { expf4(ld_f32x4(c)) };
                // SAFETY: as above.
                if unsafe { vminvq_u32(exact) } != 0 {
                    // SAFETY: as above.
                    unsafe { st_f32x4(c, y) };
                    continue;
                }
                let mut lanes = [0f32; 4];
                let mut ok = [0u32; 4];
                // SAFETY: as above; 4 lanes each.
                unsafe {
                    vst1q_f32(lanes.as_mut_ptr(), y);
                    vst1q_u32(ok.as_mut_ptr(), exact);
                }
                for ((v, l), o) in c.iter_mut().zip(lanes).zip(ok) {
                    *v = if o != 0 { l } else { libm::expf(*v) };
                }
            }
        },
        |v, out| {
            match v_ty {
                GgmlType::Q8_0 => kv_widen_q8_0(v, out),
                GgmlType::F16 => kv_widen_f16(v, out),
                _ => widen(v, out),
            };
        },
        kv_update,
    )
}
