//! Packed matmul without `sdot` (A72/A53-class cores), and the checks every packed matmul makes.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::layout::Layout;
use crate::kernels::packed::{ActBlock, PackedFormat, PackedMatrix, GROUP_ROWS};
use crate::kernels::reference::matmul_ref;

// ---------------------------------------------------------------------------------------------
// Shared matmul plumbing

/// Checks everything the kernels rely on to stay inside the buffers (they read through raw
/// pointers); returns the token count, or `None` when there is nothing to compute.
pub(super) fn matmul_tokens(
    w: &PackedMatrix<'_>,
    groups: &Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) -> Option<usize> {
    assert!(w.is_consistent() && groups.start <= groups.end && groups.end <= w.groups(), "bad matmul shape");
    let (n, nb, rows) = (acts.len().min(outs.len()), w.blocks(), GROUP_ROWS * groups.len());
    for (a, o) in acts.iter().zip(outs.iter()) {
        assert!(a.len() >= nb && o.len() >= rows, "activation or output row too short");
    }
    if nb == 0 {
        outs.iter_mut().take(n).for_each(|o| o[..rows].fill(0.0));
        return None;
    }
    (n > 0 && rows > 0).then_some(n)
}

/// 64 zero bytes: one `ld1` of them clears up to four vector registers.
pub(super) static ZEROS: [f32; 16] = [0.0; 16];

// ---------------------------------------------------------------------------------------------
// Packed matmul without `sdot` (A72/A53-class cores)

/// Packed matmul of layout `L` without the dot-product extension: per 4 activation quants
/// broadcast over the 4 rows, `smull`/`smlal` pairs of int8 products into int16 (two products of
/// |16 q| <= 128 and |a| <= 127 fit), `sadalp` into int32. One token runs 4 groups per pass
/// (sharing the broadcasts), several run 1 group x 4 tokens (sharing the unpacked weights). `L`
/// is a 4- or 8-bit layout (a compile error otherwise: the others are widened or decoded into
/// these first, see [`crate::kernels::matmul`]); a matrix of another format runs the reference.
pub fn matmul_neon<L: Layout>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    const { assert!(reads(L::FORMAT), "matmul_neon reads the 4- and 8-bit layouts only") };
    if w.format != L::FORMAT {
        return matmul_ref(w, groups, acts, outs);
    }
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    // SAFETY: NEON is part of the aarch64 baseline (every arm).
    unsafe { matmul_tiles::<L>(w, groups, acts, outs, n) }
}

/// The layouts the plain NEON kernels read.
const fn reads(format: PackedFormat) -> bool {
    match format {
        PackedFormat::Q4
        | PackedFormat::Q4Min
        | PackedFormat::Q8
        | PackedFormat::Q8Min
        | PackedFormat::Q8Sub16 => true,
        PackedFormat::Q6K
        | PackedFormat::Q4K
        | PackedFormat::Q5
        | PackedFormat::Q5Min
        | PackedFormat::Q5K => false,
    }
}

#[target_feature(enable = "neon")]
fn matmul_tiles<L: Layout>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    n: usize,
) {
    let nb = w.blocks();
    let mut g = groups.start;
    if n == 1 {
        let (act, out) = (acts[0], &mut *outs[0]);
        while groups.end - g >= 4 {
            let planes = core::array::from_fn(|i| (w.group_quants(g + i), w.group_scales(g + i)));
            let f = groups_gemv::<L>(planes, act, nb);
            st_f32x16(&mut out[GROUP_ROWS * (g - groups.start)..], f);
            g += 4;
        }
    }
    for g in g..groups.end {
        let (q, s) = (w.group_quants(g), w.group_scales(g));
        let gi = g - groups.start;
        let mut t = 0;
        while t < n {
            if let Ok(a) = <&[&[ActBlock]; 4]>::try_from(&acts[t..n.min(t + 4)]) {
                let f = group_tokens::<L, 4>(q, s, a, nb);
                for (f, o) in f.iter().zip(outs[t..t + 4].iter_mut()) {
                    st_f32x4(&mut o[GROUP_ROWS * gi..], *f);
                }
                t += 4;
            } else {
                let [f] = group_tokens::<L, 1>(q, s, &[acts[t]], nb);
                st_f32x4(&mut outs[t][GROUP_ROWS * gi..], f);
                t += 1;
            }
        }
    }
}

/// One token against 4 groups (their quant and scale planes): the activation broadcasts are
/// shared by the groups.
#[target_feature(enable = "neon")]
#[inline]
fn groups_gemv<L: Layout>(planes: [(&[u8], &[u8]); 4], act: &[ActBlock], nb: usize) -> [float32x4_t; 4] {
    let (qb, sb) = const { block_bytes::<L>() };
    let mut f = [vdupq_n_f32(0.0); 4];
    for (b, a) in act[..nb].iter().enumerate() {
        let x = broadcasts(a);
        for (f, (q, s)) in f.iter_mut().zip(planes) {
            let wv = weights::<L>(&q[b * qb..(b + 1) * qb]);
            let (d, m) = scales::<L>(&s[b * sb..(b + 1) * sb]);
            *f = accumulate::<L>(*f, &wv, &x, d, m, a);
        }
    }
    f
}

/// Quant and scale bytes per group and block of layout `L`.
const fn block_bytes<L: Layout>() -> (usize, usize) {
    (L::FORMAT.quant_bytes(), L::FORMAT.scale_bytes())
}

/// One group against `T` tokens: the unpacked weights are shared by the tokens.
#[target_feature(enable = "neon")]
#[inline]
fn group_tokens<L: Layout, const T: usize>(
    q: &[u8],
    s: &[u8],
    acts: &[&[ActBlock]; T],
    nb: usize,
) -> [float32x4_t; T] {
    let (qb, sb) = const { block_bytes::<L>() };
    let mut f = [vdupq_n_f32(0.0); T];
    for b in 0..nb {
        let wv = weights::<L>(&q[b * qb..(b + 1) * qb]);
        let (d, m) = scales::<L>(&s[b * sb..(b + 1) * sb]);
        for (f, act) in f.iter_mut().zip(acts) {
            let a = &act[b];
            *f = accumulate::<L>(*f, &wv, &broadcasts(a), d, m, a);
        }
    }
    f
}

/// A group's block as 8 vectors of 4 rows x 4 elements (elements 0..16, then 16..32; 4-bit
/// values x16).
#[target_feature(enable = "neon")]
#[inline]
fn weights<L: Layout>(wq: &[u8]) -> [int8x16_t; 8] {
    if const { L::FORMAT.is_4bit() } {
        let mask = vdupq_n_s8(0xF0u8 as i8);
        let x: [int8x16_t; 4] = core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]));
        core::array::from_fn(|c| if c < 4 { vshlq_n_s8::<4>(x[c]) } else { vandq_s8(x[c - 4], mask) })
    } else {
        core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]))
    }
}

/// A group's row scales `d` and second scales (`m`, `m + 8 d` for Q4Min, or the scales of
/// elements 16..32).
#[target_feature(enable = "neon")]
#[inline]
fn scales<L: Layout>(sc: &[u8]) -> (float32x4_t, float32x4_t) {
    let d = f16x4_to_f32(&sc[..8]);
    if const { !L::FORMAT.has_min() && !L::FORMAT.has_sub16() } {
        return (d, d);
    }
    let m = f16x4_to_f32(&sc[8..16]);
    // Q4Min's stored values are `nibble - 8`: its min becomes `m + 8 d`.
    (d, if const { L::FORMAT.is_4bit() } { vfmaq_n_f32(m, d, 8.0) } else { m })
}

/// The 8 groups of 4 activation quants, each broadcast over a vector.
#[target_feature(enable = "neon")]
#[inline]
fn broadcasts(a: &ActBlock) -> [int8x16_t; 8] {
    let (lo, hi) = (vreinterpretq_s32_s8(ld_i8x16(&a.qs[..16])), vreinterpretq_s32_s8(ld_i8x16(&a.qs[16..])));
    let b = |v: int32x4_t| vreinterpretq_s8_s32(v);
    [
        b(vdupq_laneq_s32::<0>(lo)),
        b(vdupq_laneq_s32::<1>(lo)),
        b(vdupq_laneq_s32::<2>(lo)),
        b(vdupq_laneq_s32::<3>(lo)),
        b(vdupq_laneq_s32::<0>(hi)),
        b(vdupq_laneq_s32::<1>(hi)),
        b(vdupq_laneq_s32::<2>(hi)),
        b(vdupq_laneq_s32::<3>(hi)),
    ]
}

/// One block of one token added to the accumulator `f`.
#[target_feature(enable = "neon")]
#[inline]
fn accumulate<L: Layout>(
    f: float32x4_t,
    w: &[int8x16_t; 8],
    x: &[int8x16_t; 8],
    d: float32x4_t,
    m: float32x4_t,
    a: &ActBlock,
) -> float32x4_t {
    // Per pair of weight vectors: rows 0, 1 (low halves) and rows 2, 3 (high halves) as int16.
    let p: [(int16x8_t, int16x8_t); 4] =
        core::array::from_fn(|i| mul_pair(w[2 * i], w[2 * i + 1], x[2 * i], x[2 * i + 1]));
    // Pairwise sums into [r0, r0, r1, r1] and [r2, r2, r3, r3], then one lane per row.
    let half = |p: &[(int16x8_t, int16x8_t)]| {
        let lo = vpadalq_s16(vpaddlq_s16(p[0].0), p[1].0);
        let hi = vpadalq_s16(vpaddlq_s16(p[0].1), p[1].1);
        (lo, hi)
    };
    if const { L::FORMAT.has_sub16() } {
        let ((l0, h0), (l1, h1)) = (half(&p[..2]), half(&p[2..]));
        let x = vmulq_f32(vcvtq_f32_s32(vpaddq_s32(l0, h0)), d);
        let x = vfmaq_f32(x, vcvtq_f32_s32(vpaddq_s32(l1, h1)), m);
        return vfmaq_n_f32(f, x, a.d);
    }
    let (lo, hi) = half(&p[..2]);
    let (lo, hi) =
        (vpadalq_s16(vpadalq_s16(lo, p[2].0), p[3].0), vpadalq_s16(vpadalq_s16(hi, p[2].1), p[3].1));
    let dot = vpaddq_s32(lo, hi);
    let dot = if const { L::FORMAT.is_4bit() } { vcvtq_n_f32_s32::<4>(dot) } else { vcvtq_f32_s32(dot) };
    let f = vfmaq_n_f32(f, vmulq_f32(dot, d), a.d);
    if const { L::FORMAT.has_min() } {
        vfmaq_n_f32(f, m, a.s)
    } else {
        f
    }
}

/// `w0 * x0 + w1 * x1` per byte lane as int16: low halves (rows 0, 1) and high halves (rows 2, 3).
#[inline(always)]
fn mul_pair(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t) -> (int16x8_t, int16x8_t) {
    let (lo, hi): (int16x8_t, int16x8_t);
    // SAFETY: register-only arithmetic (base AdvSIMD).
    unsafe {
        asm!(
            "smull {lo:v}.8h, {w0:v}.8b, {x0:v}.8b",
            "smull2 {hi:v}.8h, {w0:v}.16b, {x0:v}.16b",
            "smlal {lo:v}.8h, {w1:v}.8b, {x1:v}.8b",
            "smlal2 {hi:v}.8h, {w1:v}.16b, {x1:v}.16b",
            lo = out(vreg) lo, hi = out(vreg) hi,
            w0 = in(vreg) w0, w1 = in(vreg) w1, x0 = in(vreg) x0, x1 = in(vreg) x1,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    (lo, hi)
}
