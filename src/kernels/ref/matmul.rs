//! The packed matmul and the activation quantization it reads (the twins of `neon::matmul` and
//! `x86::matmul`).

use core::ops::Range;

use crate::kernels::packed::{
    block_scales, f16_round, value, ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS,
};

/// Quantizes one activation row (`x.len() == 32 * out.len()`): `amax / 127` scale, `127 / amax`
/// multiplier, round half to even (llama.cpp's SIMD quantizer), scale and sum rounded to f16.
pub fn quantize_act_ref(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * BLOCK);
    for (x, b) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, &v| m.max(libm::fabsf(v)));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = libm::rintf(v * id) as i8;
            sum += i32::from(*q);
        }
        b.d = f16_round(d);
        b.s = f16_round(d * sum as f32);
    }
}

/// The signed values of the 4 rows of an interleaved block, row by row.
#[inline]
fn unpack_block(format: PackedFormat, block: &[u8]) -> [[i32; BLOCK]; GROUP_ROWS] {
    let mut q = [[0i32; BLOCK]; GROUP_ROWS];
    for (i, &byte) in block.iter().enumerate() {
        let (c, r, j) = (i / 16, (i / 4) % 4, i % 4);
        if format == PackedFormat::Q6K || format.is_5bit() {
            if i < 64 {
                for e in [4 * c + j, 16 + 4 * c + j] {
                    q[r][e] = value(format, block, r, e);
                }
            }
        } else if format.is_4bit() {
            q[r][4 * c + j] = i32::from(((byte << 4) as i8) >> 4);
            q[r][16 + 4 * c + j] = i32::from((byte as i8) >> 4);
        } else {
            q[r][4 * c + j] = i32::from(byte as i8);
        }
    }
    q
}

/// Reference matmul over row groups `groups` for `acts.len()` tokens: `outs[t][4 * (g -
/// groups.start) + r]` = row `4g + r` dotted with token `t`'s activations. Per block the integer dot
/// is scaled by `d_w * d_a` in f32 and summed into an f32 accumulator, blocks in order; mins add
/// `m * s_a` (Q4Min, Q4K: `(m + 8d) * s_a`). The scales are [`block_scales`].
pub fn matmul_ref(w: &PackedMatrix<'_>, groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]) {
    const TILE: usize = 16;
    let (format, nb) = (w.format, w.blocks());
    let qb = format.quant_bytes();
    for (tile_acts, tile_outs) in acts.chunks(TILE).zip(outs.chunks_mut(TILE)) {
        for (gi, g) in groups.clone().enumerate() {
            let (gq, gs) = (w.group_quants(g), w.group_scales(g));
            let mut acc = [[0f32; GROUP_ROWS]; TILE];
            for b in 0..nb {
                let block = &gq[b * qb..(b + 1) * qb];
                let scales: [[f32; 2]; GROUP_ROWS] = core::array::from_fn(|r| block_scales(format, gs, b, r));
                // Unpack the 4 rows once per block; every token of the tile reuses them.
                let q = unpack_block(format, block);
                for (acc, act) in acc.iter_mut().zip(tile_acts.iter()) {
                    let a = &act[b];
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let dot =
                            |es: Range<usize>| -> i32 { es.map(|e| q[r][e] * i32::from(a.qs[e])).sum() };
                        let [d, m] = scales[r];
                        match format {
                            PackedFormat::Q4 | PackedFormat::Q8 | PackedFormat::Q5 => {
                                *acc += (d * a.d) * dot(0..BLOCK) as f32
                            }
                            PackedFormat::Q4Min
                            | PackedFormat::Q8Min
                            | PackedFormat::Q4K
                            | PackedFormat::Q5Min
                            | PackedFormat::Q5K => {
                                // The 4-bit formats store nibble - 8: the shift comes back through
                                // the min.
                                let m = if format.is_4bit() { m + 8.0 * d } else { m };
                                *acc += (d * a.d) * dot(0..BLOCK) as f32;
                                *acc += m * a.s;
                            }
                            PackedFormat::Q8Sub16 | PackedFormat::Q6K => {
                                *acc += (d * a.d) * dot(0..16) as f32;
                                *acc += (m * a.d) * dot(16..BLOCK) as f32;
                            }
                        }
                    }
                }
            }
            for (acc, out) in acc.iter().zip(tile_outs.iter_mut()) {
                out[GROUP_ROWS * gi..GROUP_ROWS * (gi + 1)].copy_from_slice(acc);
            }
        }
    }
}
