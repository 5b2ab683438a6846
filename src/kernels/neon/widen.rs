//! The NEON twins of `kernels::widen`: Q5 and Q6K widened to 8-bit quants, Q4K's scales decoded.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::packed::{PackedFormat, PackedMatrix, Q4K_SCALE_BYTES, SUPER_BLOCKS, SUPER_SCALE_BYTES};
use crate::kernels::widen::{q4k_lengths_match, Q4K_WIDE_UNIT};

/// [`crate::kernels::widen::widen_ref`] for Q5 and Q5Min on NEON: per output vector of 4 rows x 4 elements,
/// the high bit shifted to the top (`shl`) and the low nibble inserted below it (`sri` by 1 of the
/// nibble held at bits 4..8) make `8q`, and an arithmetic shift (`sshr`) gives `q`.
pub fn widen_q5(w: &PackedMatrix<'_>, g: usize, blocks: Range<usize>, quants: &mut [u8], scales: &mut [u8]) {
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    let (qb, sb, wq) = (w.format.quant_bytes(), w.format.scale_bytes(), PackedFormat::Q8.quant_bytes());
    // Q5Min widens to its unsigned values u = q + 16.
    let offset = if w.format == PackedFormat::Q5Min { 16 } else { 0 };
    for (i, b) in blocks.enumerate() {
        let src = &gq[b * qb..(b + 1) * qb];
        let dst = &mut quants[i * wq..(i + 1) * wq];
        // SAFETY: NEON is part of the aarch64 baseline; `src` holds 80 bytes and `dst` 128 (the
        // slices above), every load and store is inside them.
        unsafe {
            let n: [uint8x16_t; 4] = core::array::from_fn(|c| vld1q_u8(src[16 * c..].as_ptr()));
            let h = vld1q_u8(src[64..].as_ptr());
            let hi = vdupq_n_u8(0xF0);
            let lo = |c: usize| if c < 4 { vshlq_n_u8::<4>(n[c]) } else { vandq_u8(n[c - 4], hi) };
            let out = [
                vsriq_n_u8::<1>(vshlq_n_u8::<7>(h), lo(0)),
                vsriq_n_u8::<1>(vshlq_n_u8::<6>(h), lo(1)),
                vsriq_n_u8::<1>(vshlq_n_u8::<5>(h), lo(2)),
                vsriq_n_u8::<1>(vshlq_n_u8::<4>(h), lo(3)),
                vsriq_n_u8::<1>(vshlq_n_u8::<3>(h), lo(4)),
                vsriq_n_u8::<1>(vshlq_n_u8::<2>(h), lo(5)),
                vsriq_n_u8::<1>(vshlq_n_u8::<1>(h), lo(6)),
                vsriq_n_u8::<1>(h, lo(7)),
            ];
            for (c, v) in out.into_iter().enumerate() {
                let q = vaddq_s8(vshrq_n_s8::<3>(vreinterpretq_s8_u8(v)), vdupq_n_s8(offset));
                vst1q_s8(dst[16 * c..].as_mut_ptr().cast(), q);
            }
        }
        scales[i * sb..(i + 1) * sb].copy_from_slice(&gs[b * sb..(b + 1) * sb]);
    }
}

// ---------------------------------------------------------------------------------------------
// Q6K widened to Q8Sub16 (see `crate::kernels::widen`)

/// [`crate::kernels::widen::widen_ref`] for Q6K on NEON: per output vector of 4 rows x 4 elements,
/// the high bits shifted to the top (`shl`) and the low nibble inserted below them (`sri`) make
/// `4q`, and an arithmetic shift (`sshr`) gives `q`.
pub fn widen_q6k(w: &PackedMatrix<'_>, g: usize, blocks: Range<usize>, quants: &mut [u8], scales: &mut [u8]) {
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    let (qb, wq, ws) = (
        PackedFormat::Q6K.quant_bytes(),
        PackedFormat::Q8Sub16.quant_bytes(),
        PackedFormat::Q8Sub16.scale_bytes(),
    );
    for (i, b) in blocks.enumerate() {
        let src = &gq[b * qb..(b + 1) * qb];
        let dst = &mut quants[i * wq..(i + 1) * wq];
        // SAFETY: NEON is part of the aarch64 baseline; `src` holds 96 bytes and `dst` 128 (the
        // slices above), every load and store is inside them.
        unsafe {
            let n: [uint8x16_t; 4] = core::array::from_fn(|c| vld1q_u8(src[16 * c..].as_ptr()));
            let h = [vld1q_u8(src[64..].as_ptr()), vld1q_u8(src[80..].as_ptr())];
            let hi = vdupq_n_u8(0xF0);
            // Chunk c (elements 4c..4c + 4): low nibble of n[c] (c < 4) or high of n[c - 4]; high
            // bits at field c / 2 of h[c % 2].
            let lo = |c: usize| if c < 4 { vshlq_n_u8::<4>(n[c]) } else { vandq_u8(n[c - 4], hi) };
            let out = [
                vsriq_n_u8::<2>(vshlq_n_u8::<6>(h[0]), lo(0)),
                vsriq_n_u8::<2>(vshlq_n_u8::<6>(h[1]), lo(1)),
                vsriq_n_u8::<2>(vshlq_n_u8::<4>(h[0]), lo(2)),
                vsriq_n_u8::<2>(vshlq_n_u8::<4>(h[1]), lo(3)),
                vsriq_n_u8::<2>(vshlq_n_u8::<2>(h[0]), lo(4)),
                vsriq_n_u8::<2>(vshlq_n_u8::<2>(h[1]), lo(5)),
                vsriq_n_u8::<2>(h[0], lo(6)),
                vsriq_n_u8::<2>(h[1], lo(7)),
            ];
            for (c, v) in out.into_iter().enumerate() {
                let q = vshrq_n_s8::<2>(vreinterpretq_s8_u8(v));
                vst1q_s8(dst[16 * c..].as_mut_ptr().cast(), q);
            }
        }
        // Scales: f16(d * sc) of both halves' rows, in the order the Q6K plane keeps the int8 ones.
        let sup = &gs[(b / SUPER_BLOCKS) * SUPER_SCALE_BYTES..][..SUPER_SCALE_BYTES];
        let at = 8 + 8 * (b % SUPER_BLOCKS);
        let sc: &[u8; 8] = sup[at..at + 8].try_into().unwrap_or(&[0; 8]);
        // SAFETY: NEON is part of the aarch64 baseline; 8 bytes read from `sc`, 16 written to
        // the block's 16 scale bytes.
        unsafe {
            let d = f16x4_to_f32(&sup[..8]);
            let sc = vmovl_s8(vld1_s8(sc.as_ptr().cast()));
            let lo = vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc))));
            let hi = vmulq_f32(d, vcvtq_f32_s32(vmovl_high_s16(sc)));
            vst1q_u16(scales[i * ws..(i + 1) * ws].as_mut_ptr().cast(), f16_narrow(lo, hi));
        }
    }
}

/// [`crate::kernels::widen::q4k_scales_ref`] on NEON: the 64 6-bit fields of a unit as bytes
/// (nibble plane masked and shifted, the 2-bit plane shifted into bits 4..6), then per block the
/// 4 scales and 4 mins widened to f32, times `d` and `-dmin`, narrowed to f16. Lengths that do not
/// match write nothing.
pub fn q4k_scales(units: &[u8], out: &mut [u8]) {
    if !q4k_lengths_match(units, out) {
        return;
    }
    for (unit, out) in units.chunks_exact(Q4K_SCALE_BYTES).zip(out.chunks_exact_mut(Q4K_WIDE_UNIT)) {
        q4k_unit(unit, out);
    }
}

#[inline(always)]
fn q4k_unit(unit: &[u8], out: &mut [u8]) {
    let (Ok(unit), Ok(out)): (Result<&[u8; Q4K_SCALE_BYTES], _>, Result<&mut [u8; Q4K_WIDE_UNIT], _>) =
        (unit.try_into(), out.try_into())
    else {
        return;
    };
    // SAFETY: NEON is part of the aarch64 baseline; 48 bytes read from `unit` at 16, 128 written
    // to `out` (the arrays above).
    unsafe {
        let d = f16x4_to_f32(&unit[..8]);
        let neg_dmin = vnegq_f32(f16x4_to_f32(&unit[8..16]));
        let (lo0, lo1, hi) =
            (vld1q_u8(unit[16..].as_ptr()), vld1q_u8(unit[32..].as_ptr()), vld1q_u8(unit[48..].as_ptr()));
        let (m4, m30) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x30));
        // Scales and mins of blocks 0..4 and 4..8, one byte per row and block.
        let sc = [
            vorrq_u8(vandq_u8(lo0, m4), vandq_u8(vshlq_n_u8::<4>(hi), m30)),
            vorrq_u8(vandq_u8(lo1, m4), vandq_u8(vshlq_n_u8::<2>(hi), m30)),
        ];
        let mn = [
            vorrq_u8(vshrq_n_u8::<4>(lo0), vandq_u8(hi, m30)),
            vorrq_u8(vshrq_n_u8::<4>(lo1), vandq_u8(vshrq_n_u8::<2>(hi), m30)),
        ];
        for h in 0..2 {
            let (s16, m16) = (
                [vmovl_u8(vget_low_u8(sc[h])), vmovl_high_u8(sc[h])],
                [vmovl_u8(vget_low_u8(mn[h])), vmovl_high_u8(mn[h])],
            );
            for p in 0..4 {
                let (s, m) = (s16[p / 2], m16[p / 2]);
                let (s, m) = if p % 2 == 0 {
                    (vmovl_u16(vget_low_u16(s)), vmovl_u16(vget_low_u16(m)))
                } else {
                    (vmovl_high_u16(s), vmovl_high_u16(m))
                };
                let fs = vmulq_f32(vcvtq_f32_u32(s), d);
                let fm = vmulq_f32(vcvtq_f32_u32(m), neg_dmin);
                vst1q_u16(out[16 * (4 * h + p)..].as_mut_ptr().cast(), f16_narrow(fs, fm));
            }
        }
    }
}

/// [`q4k_scales`] in FEAT_FP16 arithmetic: per pair of blocks the 16 fields widen to f16 in one
/// `ucvtf` each half and one f16 multiply by `[d, -dmin]` gives both blocks' 8 scales (one
/// product of exact operands, rounded once: the f32 product rounded to f16, the same bytes). About
/// half the instructions of the f32 decoder. Lengths that do not match write nothing.
///
/// # Safety
/// The CPU must have FEAT_FP16.
#[target_feature(enable = "neon,fp16")]
pub unsafe fn q4k_scales_fp16(units: &[u8], out: &mut [u8]) {
    let n = units.len() / Q4K_SCALE_BYTES;
    if !q4k_lengths_match(units, out) || n == 0 {
        return;
    }
    // SAFETY: 64 bytes read from `units` and 128 written to `out` per unit, `n` units (the lengths
    // checked above); FEAT_FP16 is the caller's contract; every register written is declared
    // clobbered.
    unsafe {
        asm!(
            "movi v5.16b, #0x0f",
            "movi v6.16b, #0x30",
            "2:",
            // v0 = [d x4, -dmin x4] (f16); v1, v2 nibble planes; v3 2-bit plane.
            "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [{u}], #64",
            "fneg v4.8h, v0.8h",
            "mov v0.d[1], v4.d[1]",
            // Scales (v7: blocks 0..4, v17: 4..8) and mins (v18, v19), a byte per row and block:
            // the nibble, and the 2-bit field moved to bits 4..6 and inserted there (`bit`).
            "and v7.16b, v1.16b, v5.16b",   "shl v16.16b, v3.16b, #4",  "bit v7.16b, v16.16b, v6.16b",
            "and v17.16b, v2.16b, v5.16b",  "shl v16.16b, v3.16b, #2",  "bit v17.16b, v16.16b, v6.16b",
            "ushr v18.16b, v1.16b, #4",     "bit v18.16b, v3.16b, v6.16b",
            "ushr v19.16b, v2.16b, #4",     "ushr v16.16b, v3.16b, #2", "bit v19.16b, v16.16b, v6.16b",
            // [sc, m] of blocks (0, 1), (2, 3), (4, 5), (6, 7).
            "zip1 v20.4s, v7.4s, v18.4s",   "zip2 v21.4s, v7.4s, v18.4s",
            "zip1 v22.4s, v17.4s, v19.4s",  "zip2 v23.4s, v17.4s, v19.4s",
            "uxtl v24.8h, v20.8b",  "uxtl2 v25.8h, v20.16b",
            "uxtl v26.8h, v21.8b",  "uxtl2 v27.8h, v21.16b",
            "uxtl v28.8h, v22.8b",  "uxtl2 v29.8h, v22.16b",
            "uxtl v30.8h, v23.8b",  "uxtl2 v31.8h, v23.16b",
            "ucvtf v24.8h, v24.8h", "ucvtf v25.8h, v25.8h",
            "ucvtf v26.8h, v26.8h", "ucvtf v27.8h, v27.8h",
            "ucvtf v28.8h, v28.8h", "ucvtf v29.8h, v29.8h",
            "ucvtf v30.8h, v30.8h", "ucvtf v31.8h, v31.8h",
            "fmul v24.8h, v24.8h, v0.8h", "fmul v25.8h, v25.8h, v0.8h",
            "fmul v26.8h, v26.8h, v0.8h", "fmul v27.8h, v27.8h, v0.8h",
            "fmul v28.8h, v28.8h, v0.8h", "fmul v29.8h, v29.8h, v0.8h",
            "fmul v30.8h, v30.8h, v0.8h", "fmul v31.8h, v31.8h, v0.8h",
            "st1 {{v24.8h, v25.8h, v26.8h, v27.8h}}, [{o}], #64",
            "st1 {{v28.8h, v29.8h, v30.8h, v31.8h}}, [{o}], #64",
            "subs {n}, {n}, #1",
            "b.ne 2b",
            u = inout(reg) units.as_ptr() => _,
            o = inout(reg) out.as_mut_ptr() => _,
            n = inout(reg) n => _,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
            out("v6") _, out("v7") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
            out("v20") _, out("v21") _, out("v22") _, out("v23") _, out("v24") _, out("v25") _,
            out("v26") _, out("v27") _, out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            options(nostack),
        );
    }
}
