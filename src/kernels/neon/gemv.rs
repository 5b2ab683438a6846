//! Single-token matmuls of the narrow formats (Q6K, Q5), their weights unpacked in registers.

use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::packed::{ActBlock, PackedFormat, PackedMatrix, GROUP_ROWS};
use crate::kernels::reference::matmul_ref;

// ---------------------------------------------------------------------------------------------
// Q6K, one token: unpacked in registers
//
// Per pass 4 row groups; per block and group the 96 quant bytes are loaded (v0-v3 nibbles, v4-v5
// high bits) and unpacked into 8 vectors of 4 rows x 4 elements holding 4q as int8 (the stored
// high bits are XOR 2, so `shl` of the high-bit byte to bit 6 and `sri` of the nibble to bits
// 2..6 is the whole unpack), then 4 `sdot`s per half:
//     v6-v11, v4, v5   chunks 0..8 (elements 4c..4c + 4 of the 4 rows)
//     v12              nibble temporary;  v24  0xF0 mask
//     v16-v19          accumulators of groups 0..3;  v20-v23  their super-block scales d (f32)
//     v25              lane 0: the activation's d;  v26, v27  its 32 quants
//     v28, v29         the half dots;  v30, v31  the halves' scales f16(d * sc) (f32)
// With FEAT_FP16 the scales are one f16 multiply of 8 lanes (d kept twice as f16 in v20-v23).
// The scale plane of a group is read in order: d[4] at each super-block, then 8 int8 scales per
// block ([sc_lo r0..4, sc_hi r0..4]).

/// One Q6K group's block: unpack, dots, the halves' scales (`$sc`), `F += (dot_lo s_lo + dot_hi
/// s_hi) d_a`.
#[rustfmt::skip]
macro_rules! q6k_group { ($wq:ident, $ws:ident, $f:literal, $d:literal, $sc:ident) => { concat!(
    "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [", op!($wq), "], #64\n",
    "ld1 {{v4.16b, v5.16b}}, [", op!($wq), "], #32\n",
    "shl v6.16b, v4.16b, #6\n",      "shl v7.16b, v5.16b, #6\n",
    "shl v8.16b, v4.16b, #4\n",      "shl v9.16b, v5.16b, #4\n",
    "shl v10.16b, v4.16b, #2\n",     "shl v11.16b, v5.16b, #2\n",
    "and v12.16b, v0.16b, v24.16b\n", "sri v10.16b, v12.16b, #2\n",
    "and v12.16b, v1.16b, v24.16b\n", "sri v11.16b, v12.16b, #2\n",
    "and v12.16b, v2.16b, v24.16b\n", "sri v4.16b, v12.16b, #2\n",
    "and v12.16b, v3.16b, v24.16b\n", "sri v5.16b, v12.16b, #2\n",
    "shl v0.16b, v0.16b, #4\n",      "sri v6.16b, v0.16b, #2\n",
    "shl v1.16b, v1.16b, #4\n",      "sri v7.16b, v1.16b, #2\n",
    "shl v2.16b, v2.16b, #4\n",      "sri v8.16b, v2.16b, #2\n",
    "shl v3.16b, v3.16b, #4\n",      "sri v9.16b, v3.16b, #2\n",
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    "sdot v28.4s, v6.16b, v26.4b[0]\n",  "sdot v29.4s, v10.16b, v27.4b[0]\n",
    "sdot v28.4s, v7.16b, v26.4b[1]\n",  "sdot v29.4s, v11.16b, v27.4b[1]\n",
    "sdot v28.4s, v8.16b, v26.4b[2]\n",  "sdot v29.4s, v4.16b, v27.4b[2]\n",
    "sdot v28.4s, v9.16b, v26.4b[3]\n",  "sdot v29.4s, v5.16b, v27.4b[3]\n",
    $sc!($ws, $d),
    "scvtf v28.4s, v28.4s, #2\n",    "scvtf v29.4s, v29.4s, #2\n",
    "fmul v28.4s, v28.4s, v30.4s\n", "fmla v28.4s, v29.4s, v31.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
) } }

/// The halves' scales f16(d * sc) into v30/v31 (f32), d in f32 (`v$d.4s`).
#[rustfmt::skip]
macro_rules! q6k_sc_f32 { ($ws:ident, $d:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "sxtl v30.8h, v30.8b\n",
    "sxtl2 v31.4s, v30.8h\n",        "sxtl v30.4s, v30.4h\n",
    "scvtf v30.4s, v30.4s\n",        "scvtf v31.4s, v31.4s\n",
    "fmul v30.4s, v30.4s, v", $d, ".4s\n",  "fmul v31.4s, v31.4s, v", $d, ".4s\n",
    "fcvtn v30.4h, v30.4s\n",        "fcvtn v31.4h, v31.4s\n",
    "fcvtl v30.4s, v30.4h\n",        "fcvtl v31.4s, v31.4h\n",
) } }
/// As `q6k_sc_f32` in FEAT_FP16 arithmetic (d twice in `v$d.8h`): one f16 product of the exact
/// operands is the f32 product rounded to f16, the same value.
#[rustfmt::skip]
macro_rules! q6k_sc_f16 { ($ws:ident, $d:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "sxtl v30.8h, v30.8b\n",
    "scvtf v30.8h, v30.8h\n",
    "fmul v30.8h, v30.8h, v", $d, ".8h\n",
    "fcvtl2 v31.4s, v30.8h\n",       "fcvtl v30.4s, v30.4h\n",
) } }
/// The 4 groups' super-block scales d into v20-v23: f32, or twice f16.
#[rustfmt::skip]
macro_rules! q6k_d_f32 { () => { concat!(
    "ldr d20, [{ws0}], #8\n", "ldr d21, [{ws1}], #8\n", "ldr d22, [{ws2}], #8\n", "ldr d23, [{ws3}], #8\n",
    "fcvtl v20.4s, v20.4h\n", "fcvtl v21.4s, v21.4h\n", "fcvtl v22.4s, v22.4h\n", "fcvtl v23.4s, v23.4h\n",
) } }
#[rustfmt::skip]
macro_rules! q6k_d_f16 { () => { concat!(
    "ldr d20, [{ws0}], #8\n", "ldr d21, [{ws1}], #8\n", "ldr d22, [{ws2}], #8\n", "ldr d23, [{ws3}], #8\n",
    "dup v20.2d, v20.d[0]\n", "dup v21.2d, v21.d[0]\n", "dup v22.2d, v22.d[0]\n", "dup v23.2d, v23.d[0]\n",
) } }

/// Defines a single-token pass of Q6K ([`Gemv4`]): 4 groups (quant and scale planes at `wq`, `ws`, block 0)
/// against one activation row `a` of `8 nsup` blocks; writes 16 floats at `o`.
#[rustfmt::skip]
macro_rules! q6k_gemv_kernel { ($name:ident, $features:literal, $dl:ident, $sc:ident) => {
    /// # Safety
    /// Each `wq[i]` readable for `96 * 8 nsup` bytes and `ws[i]` for `72 nsup`, `a` for `8 nsup`
    /// blocks, `o` writable for 16 floats, `nsup > 0`; the CPU has the target features.
    #[target_feature(enable = $features)]
    pub(super) unsafe fn $name(wq: [*const u8; 4], ws: [*const u8; 4], a: *const ActBlock, nsup: usize, o: *mut f32) {
        // SAFETY: by the contract every load stays inside the planes and the row, the store
        // inside `o`; every register written is declared clobbered.
        unsafe {
            asm!(
                "movi v24.16b, #0xf0",
                "movi v16.4s, #0", "movi v17.4s, #0", "movi v18.4s, #0", "movi v19.4s, #0",
                "1:",
                $dl!(),
                "mov {k}, #8",
                "2:",
                "ldr s25, [{a}], #8",
                "ld1 {{v26.16b, v27.16b}}, [{a}], #32",
                q6k_group!(wq0, ws0, "16", "20", $sc),
                q6k_group!(wq1, ws1, "17", "21", $sc),
                q6k_group!(wq2, ws2, "18", "22", $sc),
                q6k_group!(wq3, ws3, "19", "23", $sc),
                "subs {k}, {k}, #1",
                "b.ne 2b",
                "subs {nsup}, {nsup}, #1",
                "b.ne 1b",
                "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o}]",
                wq0 = inout(reg) wq[0] => _, wq1 = inout(reg) wq[1] => _,
                wq2 = inout(reg) wq[2] => _, wq3 = inout(reg) wq[3] => _,
                ws0 = inout(reg) ws[0] => _, ws1 = inout(reg) ws[1] => _,
                ws2 = inout(reg) ws[2] => _, ws3 = inout(reg) ws[3] => _,
                a = inout(reg) a => _,
                nsup = inout(reg) nsup => _,
                k = out(reg) _,
                o = in(reg) o,
                zp = in(reg) ZEROS.as_ptr(),
                out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v12") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    }
} }

q6k_gemv_kernel!(q6k_gemv4, "dotprod", q6k_d_f32, q6k_sc_f32);
q6k_gemv_kernel!(q6k_gemv4_fp16, "dotprod,fp16", q6k_d_f16, q6k_sc_f16);

/// One token of a Q6K matrix, unpacked in registers (the contract of
/// [`crate::kernels::reference::matmul_ref`]; another format or token count runs the reference).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn gemv_q6k(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    // SAFETY: the CPU has dotprod (our contract).
    unsafe { narrow_gemv(PackedFormat::Q6K, q6k_gemv4, w, groups, acts, outs) }
}

/// [`gemv_q6k`] with the scales in FEAT_FP16 arithmetic (the same values, fewer instructions).
///
/// # Safety
/// The CPU must have FEAT_DotProd and FEAT_FP16.
#[target_feature(enable = "dotprod,fp16")]
pub unsafe fn gemv_q6k_fp16(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    // SAFETY: the CPU has dotprod and FEAT_FP16 (our contract).
    unsafe { narrow_gemv(PackedFormat::Q6K, q6k_gemv4_fp16, w, groups, acts, outs) }
}

/// One token of a Q5 matrix, unpacked in registers (as [`gemv_q6k`]).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn gemv_q5(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    // SAFETY: the CPU has dotprod (our contract).
    unsafe { narrow_gemv(PackedFormat::Q5, q5_gemv4, w, groups, acts, outs) }
}

/// One token of a Q5Min matrix (and of Q5K's once its scales are decoded), unpacked in
/// registers (as [`gemv_q6k`]).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn gemv_q5min(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    // SAFETY: the CPU has dotprod (our contract).
    unsafe { narrow_gemv(PackedFormat::Q5Min, q5m_gemv4, w, groups, acts, outs) }
}

/// `kernel`'s passes, the single-token pass of `format`, over `w` when it is one token of that
/// format; anything else runs the reference.
///
/// # Safety
/// The CPU has `kernel`'s features.
#[inline(always)]
unsafe fn narrow_gemv(
    format: PackedFormat,
    kernel: Gemv4,
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    if w.format != format || acts.len().min(outs.len()) != 1 {
        return matmul_ref(w, groups, acts, outs);
    }
    // SAFETY: `kernel` is `format`'s pass and its loop count is the blocks (Q5) or super-blocks
    // (Q6K) of a row; the CPU has its features (our contract).
    unsafe { gemv_passes(w, groups, acts, outs, kernel, w.blocks() / format.blocks_per_unit()) }
}

/// A single-token pass over 4 row groups of a narrow format (`q6k_gemv4`, `q5_gemv4`, ...): the
/// groups' quant and scale planes, the activation row, the kernel's loop count (blocks, or
/// super-blocks for Q6K) and 16 output floats.
pub(super) type Gemv4 = unsafe fn([*const u8; 4], [*const u8; 4], *const ActBlock, usize, *mut f32);

/// One token against a narrow format (the contract of [`crate::kernels::reference::matmul_ref`]):
/// passes of 4 groups of `kernel`; a tail of 1 to 3 groups runs as a pass with its last group
/// repeated, into a spare.
///
/// # Safety
/// The CPU has `kernel`'s features; `kernel` is the single-token pass of `w`'s format and `count`
/// its loop count for `w`'s rows.
unsafe fn gemv_passes(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    kernel: Gemv4,
    count: usize,
) {
    let Some(_) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (act, out) = (acts[0], &mut *outs[0]);
    let mut g = groups.start;
    while g < groups.end {
        let n = (groups.end - g).min(4);
        let pick = |i: usize| g + i.min(n - 1);
        let wq = core::array::from_fn(|i| w.group_quants(pick(i)).as_ptr());
        let ws = core::array::from_fn(|i| w.group_scales(pick(i)).as_ptr());
        let mut spare = [0f32; 16];
        // SAFETY: `matmul_tokens` checked the planes (consistent: every group has the blocks,
        // units and bytes `kernel` reads for `count`), the activation row (>= nb blocks) and the
        // output row; `spare` holds 16 floats; the CPU has the kernel's features (our contract).
        unsafe { kernel(wq, ws, act.as_ptr(), count, spare.as_mut_ptr()) };
        let at = GROUP_ROWS * (g - groups.start);
        out[at..at + GROUP_ROWS * n].copy_from_slice(&spare[..GROUP_ROWS * n]);
        g += n;
    }
}

// ---------------------------------------------------------------------------------------------
// Q5, one token: unpacked in registers
//
// Per pass 4 row groups; per block and group the 80 quant bytes are loaded (v0-v3 nibbles, v4 the
// bit plane) and unpacked into 8 vectors of 4 rows x 4 elements holding 8q as int8 (the stored bit
// is XOR 1, so `shl` of the bit byte to bit 7 and `sri` by 1 of the nibble held at bits 4..8 is the
// whole unpack), then 8 `sdot`s:
//     v5-v11, v4       chunks 0..8 (elements 4c..4c + 4 of the 4 rows)
//     v12              nibble temporary;  v24  0xF0 mask
//     v16-v19          accumulators of groups 0..3
//     v25              lane 0: the activation's d;  v26, v27  its 32 quants
//     v28              the block dot;  v30  the group's row scales d (f32)

/// One Q5 group's block: unpack, dots, `F += (dot / 8 * d_w) * d_a`. The scale piece `$sc` loads
/// the row scales (v30; Q5Min: mins in v31) and turns the dot of `8q` into that of the format's
/// values (Q5Min: `8u = 8q + 128`, v29 holding `128 sum(a)`).
#[rustfmt::skip]
macro_rules! q5_group { ($wq:ident, $ws:ident, $f:literal, $sc:ident) => { concat!(
    "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [", op!($wq), "], #64\n",
    "ldr q4, [", op!($wq), "], #16\n",
    "shl v5.16b, v4.16b, #7\n",      "shl v12.16b, v0.16b, #4\n",    "sri v5.16b, v12.16b, #1\n",
    "shl v6.16b, v4.16b, #6\n",      "shl v12.16b, v1.16b, #4\n",    "sri v6.16b, v12.16b, #1\n",
    "shl v7.16b, v4.16b, #5\n",      "shl v12.16b, v2.16b, #4\n",    "sri v7.16b, v12.16b, #1\n",
    "shl v8.16b, v4.16b, #4\n",      "shl v12.16b, v3.16b, #4\n",    "sri v8.16b, v12.16b, #1\n",
    "shl v9.16b, v4.16b, #3\n",      "and v12.16b, v0.16b, v24.16b\n", "sri v9.16b, v12.16b, #1\n",
    "shl v10.16b, v4.16b, #2\n",     "and v12.16b, v1.16b, v24.16b\n", "sri v10.16b, v12.16b, #1\n",
    "shl v11.16b, v4.16b, #1\n",     "and v12.16b, v2.16b, v24.16b\n", "sri v11.16b, v12.16b, #1\n",
    "and v12.16b, v3.16b, v24.16b\n", "sri v4.16b, v12.16b, #1\n",
    "movi v28.4s, #0\n",
    "sdot v28.4s, v5.16b, v26.4b[0]\n",  "sdot v28.4s, v6.16b, v26.4b[1]\n",
    "sdot v28.4s, v7.16b, v26.4b[2]\n",  "sdot v28.4s, v8.16b, v26.4b[3]\n",
    "sdot v28.4s, v9.16b, v27.4b[0]\n",  "sdot v28.4s, v10.16b, v27.4b[1]\n",
    "sdot v28.4s, v11.16b, v27.4b[2]\n", "sdot v28.4s, v4.16b, v27.4b[3]\n",
    $sc!($ws, $f),
) } }

/// Q5: `F += (dot / 8 * d) * d_a`.
#[rustfmt::skip]
macro_rules! q5_sc { ($ws:ident, $f:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "fcvtl v30.4s, v30.4h\n",
    "scvtf v28.4s, v28.4s, #3\n",
    "fmul v28.4s, v28.4s, v30.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
) } }
/// Q5Min: `F += (dot(u) * d) * d_a + m * s_a`.
#[rustfmt::skip]
macro_rules! q5m_sc { ($ws:ident, $f:literal) => { concat!(
    "ldr q30, [", op!($ws), "], #16\n",
    "add v28.4s, v28.4s, v29.4s\n",
    "fcvtl2 v31.4s, v30.8h\n",      "fcvtl v30.4s, v30.4h\n",
    "scvtf v28.4s, v28.4s, #3\n",
    "fmul v28.4s, v28.4s, v30.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
    "fmla v", $f, ".4s, v31.4s, v25.s[1]\n",
) } }

/// Per block before the groups: Q5 nothing; Q5Min `128 sum(a)` in every lane of v29 (two `sdot`s
/// with ones in v23, an across-lanes add).
#[rustfmt::skip]
macro_rules! q5_head { () => { "" } }
#[rustfmt::skip]
macro_rules! q5m_head { () => { concat!(
    "movi v29.4s, #0\n",
    "sdot v29.4s, v26.16b, v23.16b\n",  "sdot v29.4s, v27.16b, v23.16b\n",
    "addv s29, v29.4s\n",
    "shl v29.4s, v29.4s, #7\n",
    "dup v29.4s, v29.s[0]\n",
) } }

/// Defines a single-token pass of Q5 or Q5Min ([`Gemv4`]): 4 groups (quant and scale planes at `wq`, `ws`, block 0) against
/// one activation row `a` of `nb` blocks; writes 16 floats at `o`.
#[rustfmt::skip]
macro_rules! q5_gemv_kernel { ($name:ident, $head:ident, $sc:ident) => {
    /// # Safety
    /// Each `wq[i]` readable for `80 nb` bytes and `ws[i]` for the format's scale bytes of `nb`
    /// blocks, `a` for `nb` blocks, `o` writable for 16 floats, `nb > 0`; the CPU has dotprod.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn $name(wq: [*const u8; 4], ws: [*const u8; 4], a: *const ActBlock, nb: usize, o: *mut f32) {
        // SAFETY: by the contract every load stays inside the planes and the row, the store
        // inside `o`; every register written is declared clobbered.
        unsafe {
            asm!(
                "movi v24.16b, #0xf0",
                "movi v23.16b, #1",
                "movi v16.4s, #0", "movi v17.4s, #0", "movi v18.4s, #0", "movi v19.4s, #0",
                "2:",
                "ldr d25, [{a}], #8",
                "ld1 {{v26.16b, v27.16b}}, [{a}], #32",
                $head!(),
                q5_group!(wq0, ws0, "16", $sc),
                q5_group!(wq1, ws1, "17", $sc),
                q5_group!(wq2, ws2, "18", $sc),
                q5_group!(wq3, ws3, "19", $sc),
                "subs {nb}, {nb}, #1",
                "b.ne 2b",
                "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o}]",
                wq0 = inout(reg) wq[0] => _, wq1 = inout(reg) wq[1] => _,
                wq2 = inout(reg) wq[2] => _, wq3 = inout(reg) wq[3] => _,
                ws0 = inout(reg) ws[0] => _, ws1 = inout(reg) ws[1] => _,
                ws2 = inout(reg) ws[2] => _, ws3 = inout(reg) ws[3] => _,
                a = inout(reg) a => _,
                nb = inout(reg) nb => _,
                o = in(reg) o,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v12") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v23") _, out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    }
} }

q5_gemv_kernel!(q5_gemv4, q5_head, q5_sc);
q5_gemv_kernel!(q5m_gemv4, q5m_head, q5m_sc);
