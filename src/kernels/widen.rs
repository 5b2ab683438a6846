//! The narrow layouts widened for kernels that read a wider one.
//!
//! **Super-block scales.** [`PackedFormat::Q4K`] and [`PackedFormat::Q5K`] are the Q4Min and Q5Min
//! quant planes with the file's 6-bit super-block scales: the kernels decode a chunk of groups'
//! scales into per-block f16 `d * sc` and `-dmin * m` ([`q4k_scales`], a few vector instructions per
//! 8 blocks), into a buffer that stays in L1, and run the Q4Min / Q5Min code on the quant plane as
//! it is (x86 inside its passes, the NEON paths through [`matmul_decoded`]: a step of their
//! [`super::matmul::MatmulKernel`]).
//!
//! **Q6K and 5-bit values.** The NEON int8 kernels' prompt tiles (and the plain-NEON path; one token
//! runs their own GEMVs) read the 6-bit and 5-bit layouts widened a chunk of row groups at a time
//! ([`wide_format`]: Q6K into [`PackedFormat::Q8Sub16`], int8 values and `d * sc` rounded to f16 per
//! 16 elements; Q5 and Q5Min into Q8 and Q8Min) in a stack buffer that stays in L1/L2, then run
//! that layout's kernels on it. (The x86 kernels unpack them in registers.) Weights are read from
//! memory once, at their narrow width; the widening costs a few vector instructions per 16 weights,
//! shared by every token of a prompt tile. The reference twin
//! ([`crate::kernels::reference::matmul_ref`]) computes the same numbers from the narrow layouts
//! directly.

use core::ops::Range;

use super::packed::{
    block_scales, q6k_scales, ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS, Q4K_SCALE_BYTES,
    SUPER_BLOCKS, SUPER_SCALE_BYTES,
};
use crate::quant::blocks::F16Le;

/// Row groups widened at once: a multiple of the dot-product kernels' 4-group passes, and enough
/// to spread each kernel call's set-up over many rows.
pub const CHUNK_GROUPS: usize = 8;
/// Blocks (of 32 elements) widened at once per group: whole rows up to k = 2048.
pub const CHUNK_BLOCKS: usize = 64;
/// Tokens per kernel call on a widened chunk (the dot-product kernels' widest tile).
const TOKENS: usize = 16;

/// Bytes of one widened block: quants (int8) and scales (at most Q8Sub16's).
const WIDE_Q: usize = PackedFormat::Q8Sub16.quant_bytes();
const WIDE_S: usize = PackedFormat::Q8Sub16.scale_bytes();

/// The int8 layout a narrow format is widened into: Q6K's scales per 16 need Q8Sub16, Q5 is Q8,
/// Q5Min Q8Min (its values as the unsigned `u`).
pub const fn wide_format(format: PackedFormat) -> PackedFormat {
    match format {
        PackedFormat::Q5 => PackedFormat::Q8,
        PackedFormat::Q5Min => PackedFormat::Q8Min,
        PackedFormat::Q6K
        | PackedFormat::Q5K
        | PackedFormat::Q4
        | PackedFormat::Q4Min
        | PackedFormat::Q8
        | PackedFormat::Q8Min
        | PackedFormat::Q8Sub16
        | PackedFormat::Q4K => PackedFormat::Q8Sub16,
    }
}

/// Widens blocks `blocks` of group `g` of a Q6K, Q5 or Q5Min matrix into its [`wide_format`]
/// planes (`quants`: 128 bytes per block; `scales`: Q8Sub16's `f16(d * sc)` of both halves for
/// Q6K, the block's own scales copied for Q5 and Q5Min), the portable twin of the SIMD widenings.
pub fn widen_ref(w: &PackedMatrix<'_>, g: usize, blocks: Range<usize>, quants: &mut [u8], scales: &mut [u8]) {
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    let (qb, ws) = (w.format.quant_bytes(), wide_format(w.format).scale_bytes());
    for (i, b) in blocks.enumerate() {
        let block = &gq[b * qb..(b + 1) * qb];
        let dst = &mut quants[i * WIDE_Q..(i + 1) * WIDE_Q];
        for r in 0..GROUP_ROWS {
            for e in 0..BLOCK {
                dst[16 * (e / 4) + 4 * r + e % 4] = super::packed::value(w.format, block, r, e) as u8;
            }
        }
        let out = &mut scales[i * ws..(i + 1) * ws];
        if w.format == PackedFormat::Q6K {
            q6k_wide_scales(gs, b, out);
        } else {
            out.copy_from_slice(&gs[b * ws..(b + 1) * ws]);
        }
    }
}

/// Block `b`'s Q8Sub16 scales (`f16(d * sc)` of both halves, 4 rows each) from a group's Q6K scale
/// plane `gs`.
#[inline]
fn q6k_wide_scales(gs: &[u8], b: usize, out: &mut [u8]) {
    for r in 0..GROUP_ROWS {
        let (d, sc) = q6k_scales(gs, b, r);
        out[2 * r..2 * r + 2].copy_from_slice(&F16Le::from_f32(d * sc[0] as f32).0);
        let at = 2 * (GROUP_ROWS + r);
        out[at..at + 2].copy_from_slice(&F16Le::from_f32(d * sc[1] as f32).0);
    }
}

/// Packed matmul of a Q6K or Q5 matrix (the contract of [`crate::kernels::reference::matmul_ref`]):
/// chunks of up to [`CHUNK_GROUPS`] groups are widened by `widen` (a twin of [`widen_ref`]) into
/// their [`wide_format`], then every token tile runs `kernel`, that layout's matmul, on the chunk.
/// Chunks are whole rows (fewer groups the longer the rows, within the scratch of
/// `CHUNK_GROUPS x CHUNK_BLOCKS` blocks), so a row is summed in one pass as a lone token's
/// kernel sums it: a token's results do not depend on the batch it is in. Only rows longer than
/// the scratch (k > 16384) are cut along `k`, the chunks adding up.
pub fn matmul_widened(
    mut widen: impl FnMut(&PackedMatrix<'_>, usize, Range<usize>, &mut [u8], &mut [u8]),
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    mut kernel: impl FnMut(&PackedMatrix<'_>, Range<usize>, &[&[ActBlock]], &mut [&mut [f32]]),
) {
    let n = acts.len().min(outs.len());
    let nb = w.blocks();
    let sane = matches!(w.format, PackedFormat::Q6K | PackedFormat::Q5 | PackedFormat::Q5Min)
        && shapes_fit(w, &groups, &acts[..n], &outs[..n]);
    if !sane || nb == 0 {
        // The reference's own checks and messages (and its handling of empty rows).
        return super::reference::matmul_ref(w, groups, acts, outs);
    }
    let mut quants = [0u8; CHUNK_GROUPS * CHUNK_BLOCKS * WIDE_Q];
    let mut scales = [0u8; CHUNK_GROUPS * CHUNK_BLOCKS * WIDE_S];
    let mut part = [[0f32; GROUP_ROWS * CHUNK_GROUPS]; TOKENS];
    let wide = wide_format(w.format);
    let ws = wide.scale_bytes();
    // Whole rows, as many groups as the scratch holds; past one group, equal chunks along k (so
    // a k of 2.5 chunks does not end in a sliver).
    const SCRATCH_BLOCKS: usize = CHUNK_GROUPS * CHUNK_BLOCKS;
    let (kc, chunk_groups) = if nb <= SCRATCH_BLOCKS {
        (nb, (SCRATCH_BLOCKS / nb).min(CHUNK_GROUPS))
    } else {
        (nb.div_ceil(nb.div_ceil(SCRATCH_BLOCKS)), 1)
    };
    let mut g0 = groups.start;
    while g0 < groups.end {
        let gn = chunk_groups.min(groups.end - g0);
        let out0 = GROUP_ROWS * (g0 - groups.start);
        let rows = GROUP_ROWS * gn;
        let mut c0 = 0;
        while c0 < nb {
            let kn = kc.min(nb - c0);
            let (q, s) = (&mut quants[..gn * kn * WIDE_Q], &mut scales[..gn * kn * ws]);
            for gi in 0..gn {
                let (qg, sg) = (&mut q[gi * kn * WIDE_Q..][..kn * WIDE_Q], &mut s[gi * kn * ws..][..kn * ws]);
                widen(w, g0 + gi, c0..c0 + kn, qg, sg);
            }
            let view = PackedMatrix { format: wide, rows, k: BLOCK * kn, quants: q, scales: s };
            let mut t0 = 0;
            while t0 < n {
                let tn = TOKENS.min(n - t0);
                let mut a: [&[ActBlock]; TOKENS] = [&[]; TOKENS];
                for (a, act) in a.iter_mut().zip(&acts[t0..t0 + tn]) {
                    *a = &act[c0..c0 + kn];
                }
                let mut o: [&mut [f32]; TOKENS] = Default::default();
                if c0 == 0 {
                    for (o, out) in o.iter_mut().zip(outs[t0..t0 + tn].iter_mut()) {
                        *o = &mut out[out0..out0 + rows];
                    }
                    kernel(&view, 0..gn, &a[..tn], &mut o[..tn]);
                } else {
                    for (o, p) in o.iter_mut().zip(part.iter_mut()) {
                        *o = &mut p[..rows];
                    }
                    kernel(&view, 0..gn, &a[..tn], &mut o[..tn]);
                    for (out, p) in outs[t0..t0 + tn].iter_mut().zip(&part) {
                        for (y, &v) in out[out0..out0 + rows].iter_mut().zip(p) {
                            *y += v;
                        }
                    }
                }
                t0 += tn;
            }
            c0 += kn;
        }
        g0 += gn;
    }
}

/// Bytes of one Q4K scale unit decoded: 8 blocks of Q4Min scales.
pub const Q4K_WIDE_UNIT: usize = SUPER_BLOCKS * PackedFormat::Q4Min.scale_bytes();

/// Decodes [`PackedFormat::Q4K`] scale units (each a group's super-block, [`Q4K_SCALE_BYTES`]) into
/// the Q4Min scales of their 8 blocks ([`Q4K_WIDE_UNIT`] bytes per unit: per block `f16(d * sc)` of
/// the 4 rows, then `f16(-dmin * m)`), the portable twin of the SIMD decoders. Lengths that are not
/// whole units, or do not match, write nothing.
pub fn q4k_scales_ref(units: &[u8], out: &mut [u8]) {
    if !q4k_lengths_match(units, out) {
        return;
    }
    for (unit, out) in units.chunks_exact(Q4K_SCALE_BYTES).zip(out.chunks_exact_mut(Q4K_WIDE_UNIT)) {
        for (p, dst) in out.chunks_exact_mut(PackedFormat::Q4Min.scale_bytes()).enumerate() {
            for r in 0..GROUP_ROWS {
                let [d, m] = block_scales(PackedFormat::Q4K, unit, p, r);
                dst[2 * r..2 * r + 2].copy_from_slice(&F16Le::from_f32(d).0);
                dst[2 * (GROUP_ROWS + r)..2 * (GROUP_ROWS + r) + 2].copy_from_slice(&F16Le::from_f32(m).0);
            }
        }
    }
}

/// Whether `units` is whole Q4K scale units and `out` their decoded size.
#[inline]
pub fn q4k_lengths_match(units: &[u8], out: &[u8]) -> bool {
    units.len() % Q4K_SCALE_BYTES == 0 && out.len() == units.len() / Q4K_SCALE_BYTES * Q4K_WIDE_UNIT
}

/// Bytes of decoded scales [`matmul_decoded`] holds at once.
pub const Q4K_SCRATCH: usize = 32 << 10;

/// Packed matmul of a Q4K or Q5K matrix through the kernels of its [`PackedFormat::decoded`]
/// format, Q4Min or Q5Min (the contract of [`crate::kernels::reference::matmul_ref`]): per chunk of
/// up to [`CHUNK_GROUPS`] groups (whole rows, as many as [`Q4K_SCRATCH`] holds), the scales are
/// decoded by `decode` (a twin of [`q4k_scales_ref`]) and `kernel`, the decoded format's matmul,
/// runs on the quant plane's groups as they are, per tile of up to 16 tokens.
pub fn matmul_decoded(
    mut decode: impl FnMut(&[u8], &mut [u8]),
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    mut kernel: impl FnMut(&PackedMatrix<'_>, Range<usize>, &[&[ActBlock]], &mut [&mut [f32]]),
) {
    let n = acts.len().min(outs.len());
    let nb = w.blocks();
    let wide_row = nb * PackedFormat::Q4Min.scale_bytes();
    let chunk = Q4K_SCRATCH.checked_div(wide_row).unwrap_or(0).min(CHUNK_GROUPS);
    let sane = matches!(w.format, PackedFormat::Q4K | PackedFormat::Q5K)
        && shapes_fit(w, &groups, &acts[..n], &outs[..n]);
    // (No chunk: rows wider than the scratch, k > 2^16, which no model has: the reference.)
    if !sane || chunk == 0 {
        return super::reference::matmul_ref(w, groups, acts, outs);
    }
    let mut scales = [0u8; Q4K_SCRATCH];
    let qrow = nb * w.format.quant_bytes();
    let mut g0 = groups.start;
    while g0 < groups.end {
        let gn = chunk.min(groups.end - g0);
        let s = &mut scales[..gn * wide_row];
        // The chunk's groups are one run of the scale plane.
        let units = &w.scales[g0 * w.group_scales(0).len()..(g0 + gn) * w.group_scales(0).len()];
        decode(units, s);
        let view = PackedMatrix {
            format: w.format.decoded(),
            rows: GROUP_ROWS * gn,
            k: w.k,
            quants: &w.quants[g0 * qrow..(g0 + gn) * qrow],
            scales: s,
        };
        let out0 = GROUP_ROWS * (g0 - groups.start);
        let mut t0 = 0;
        while t0 < n {
            let tn = TOKENS.min(n - t0);
            let mut o: [&mut [f32]; TOKENS] = Default::default();
            for (o, out) in o.iter_mut().zip(outs[t0..t0 + tn].iter_mut()) {
                *o = &mut out[out0..out0 + GROUP_ROWS * gn];
            }
            kernel(&view, 0..gn, &acts[t0..t0 + tn], &mut o[..tn]);
            t0 += tn;
        }
        g0 += gn;
    }
}

/// Whether the planes, the groups, the activation rows and the output rows fit each other (what the
/// chunked drivers rely on; anything else goes to the reference, with its own checks).
fn shapes_fit(
    w: &PackedMatrix<'_>,
    groups: &Range<usize>,
    acts: &[&[ActBlock]],
    outs: &[&mut [f32]],
) -> bool {
    w.is_consistent()
        && groups.start <= groups.end
        && groups.end <= w.groups()
        && acts.iter().all(|a| a.len() >= w.blocks())
        && outs.iter().all(|o| o.len() >= GROUP_ROWS * groups.len())
}

// The super-block constants the layout relies on.
const _: () = assert!(SUPER_SCALE_BYTES == 72 && Q4K_SCALE_BYTES == 64 && SUPER_BLOCKS == 8);
