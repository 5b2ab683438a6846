//! Scalar reference dequantization: the ground truth the NEON kernels are tested against.
//!
//! Each function computes exactly the f32 operations, in the same order, as ggml's reference C code
//! and the `gguf` Python package (`x = (d * sc) * q - dmin * m` and so on), so results are bit-identical
//! to theirs. The typed functions trust their caller on lengths (checked by `debug_assert!`; in release
//! a short `out` just stops early); [`dequantize_row_ref`] validates raw bytes.

use core::fmt;

use super::blocks::*;
use super::{GgmlType, QK_K};

/// Why a dequantization request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuantError {
    /// The type has no reference dequantizer here (or, from
    /// [`quantize_row_ref`](super::quantize::quantize_row_ref), no reference quantizer).
    Unsupported(GgmlType),
    /// `src_bytes` of `ty` do not hold exactly `out_len` elements.
    LengthMismatch {
        /// The element type.
        ty: GgmlType,
        /// Length of the source in bytes.
        src_bytes: usize,
        /// Length of the output in elements.
        out_len: usize,
    },
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            QuantError::Unsupported(ty) => {
                write!(f, "type {ty} is not supported by the reference (de)quantizers")
            }
            QuantError::LengthMismatch { ty, src_bytes, out_len } => write!(
                f,
                "{ty}: {src_bytes} bytes do not hold exactly {out_len} elements \
                 ({} bytes per block of {})",
                ty.block_bytes(),
                ty.block_len()
            ),
        }
    }
}

impl core::error::Error for QuantError {}

#[inline]
fn check_len(blocks: usize, block_len: usize, out: usize) {
    debug_assert_eq!(Some(out), blocks.checked_mul(block_len), "output length != blocks * block length");
}

/// f32 (little-endian) to f32.
pub fn dequantize_f32_ref(src: &[F32Le], out: &mut [f32]) {
    check_len(src.len(), 1, out.len());
    for (y, x) in out.iter_mut().zip(src) {
        *y = x.get();
    }
}

/// f16 to f32 (exact).
pub fn dequantize_f16_ref(src: &[F16Le], out: &mut [f32]) {
    check_len(src.len(), 1, out.len());
    for (y, x) in out.iter_mut().zip(src) {
        *y = x.to_f32();
    }
}

/// bf16 to f32 (exact).
pub fn dequantize_bf16_ref(src: &[Bf16Le], out: &mut [f32]) {
    check_len(src.len(), 1, out.len());
    for (y, x) in out.iter_mut().zip(src) {
        *y = x.to_f32();
    }
}

/// q4_0: `x = d * (nibble - 8)`.
pub fn dequantize_q4_0_ref(blocks: &[BlockQ4_0], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
            *l = ((q & 0xF) as i32 - 8) as f32 * d;
            *h = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// q4_1: `x = d * nibble + m`.
pub fn dequantize_q4_1_ref(blocks: &[BlockQ4_1], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
            *l = d * (q & 0xF) as f32 + m;
            *h = d * (q >> 4) as f32 + m;
        }
    }
}

/// The 5-bit values of a q5_0/q5_1 block, in element order.
#[inline]
fn q5_values(qh: [u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; QK];
    for (j, &byte) in qs.iter().enumerate() {
        q[j] = (byte & 0xF) | ((((qh >> j) & 1) as u8) << 4);
        q[j + QK / 2] = (byte >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
    }
    q
}

/// q5_0: `x = d * (q - 16)`.
pub fn dequantize_q5_0_ref(blocks: &[BlockQ5_0], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (y, q) in y.iter_mut().zip(q5_values(b.qh, &b.qs)) {
            *y = (q as i32 - 16) as f32 * d;
        }
    }
}

/// q5_1: `x = d * q + m`.
pub fn dequantize_q5_1_ref(blocks: &[BlockQ5_1], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for (y, q) in y.iter_mut().zip(q5_values(b.qh, &b.qs)) {
            *y = d * q as f32 + m;
        }
    }
}

/// q8_0: `x = d * q`.
pub fn dequantize_q8_0_ref(blocks: &[BlockQ8_0], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

/// q8_1: `x = d * q` (the sum `s` is not needed).
pub fn dequantize_q8_1_ref(blocks: &[BlockQ8_1], out: &mut [f32]) {
    check_len(blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

/// q2_K: `x = (d * scale) * q - dmin * min` per group of 16.
pub fn dequantize_q2_k_ref(blocks: &[BlockQ2_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        for (e, y) in y.iter_mut().enumerate() {
            let (half, k, l) = (e / 128, (e / 32) % 4, e % 32);
            let q = (b.qs[32 * half + l] >> (2 * k)) & 3;
            let sc = b.scales[e / 16];
            let dl = d * (sc & 0xF) as f32;
            let ml = dmin * (sc >> 4) as f32;
            *y = dl * q as f32 - ml;
        }
    }
}

/// q3_K: `x = (d * (scale - 32)) * q` with `q = low2 - (high bit clear ? 4 : 0)`.
pub fn dequantize_q3_k_ref(blocks: &[BlockQ3_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let mut dl = [0f32; QK_K / 16];
        for (i, dl) in dl.iter_mut().enumerate() {
            *dl = d * scale_q3_k(i, &b.scales) as f32;
        }
        for (e, y) in y.iter_mut().enumerate() {
            let (half, k, l) = (e / 128, (e / 32) % 4, e % 32);
            let low = ((b.qs[32 * half + l] >> (2 * k)) & 3) as i8;
            let high_set = (b.hmask[l] >> (e / 32)) & 1 != 0;
            let q = if high_set { low } else { low - 4 };
            *y = dl[e / 16] * q as f32;
        }
    }
}

/// Shared body of q4_K and q5_K: `x = (d * sc) * q - dmin * m` per sub-block of 32.
#[inline]
fn dequantize_k4(d: F16Le, dmin: F16Le, scales: &[u8; 12], q_of: impl Fn(usize) -> u8, y: &mut [f32]) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (j, sub) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        for (l, y) in sub.iter_mut().enumerate() {
            *y = d1 * q_of(32 * j + l) as f32 - m1;
        }
    }
}

/// Low nibble of element `e` in the q4_K/q5_K `qs` layout (chunks of 64, split halves).
#[inline]
fn k4_low(qs: &[u8; QK_K / 2], e: usize) -> u8 {
    let (chunk, upper, l) = (e / 64, (e / 32) % 2, e % 32);
    (qs[32 * chunk + l] >> (4 * upper)) & 0xF
}

/// q4_K: `x = (d * sc) * q - dmin * m`, 6-bit scales and mins per sub-block of 32.
pub fn dequantize_q4_k_ref(blocks: &[BlockQ4_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        dequantize_k4(b.d, b.dmin, &b.scales, |e| k4_low(&b.qs, e), y);
    }
}

/// q5_K: as q4_K with a fifth bit, bit `e / 32` of `qh[e % 32]`.
pub fn dequantize_q5_k_ref(blocks: &[BlockQ5_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let q_of = |e: usize| k4_low(&b.qs, e) | (((b.qh[e % 32] >> (e / 32)) & 1) << 4);
        dequantize_k4(b.d, b.dmin, &b.scales, q_of, y);
    }
}

/// q6_K: `x = (d * scale) * (q - 32)` per group of 16, 6-bit `q`.
pub fn dequantize_q6_k_ref(blocks: &[BlockQ6_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (e, y) in y.iter_mut().enumerate() {
            // Half h: low nibbles of ql[64h..64h+64] are elements 0..64 of the half, high nibbles
            // 64..128; qh[32h + l] holds elements l, l+32, l+64, l+96 at shifts 0, 2, 4, 6.
            let (half, i) = (e / 128, e % 128);
            let low = (b.ql[64 * half + i % 64] >> (4 * (i / 64))) & 0xF;
            let high = (b.qh[32 * half + i % 32] >> (2 * (i / 32))) & 3;
            let q = (low | (high << 4)) as i8 - 32;
            *y = d * b.scales[e / 16] as f32 * q as f32;
        }
    }
}

/// q8_K: `x = d * q` with an f32 `d`.
pub fn dequantize_q8_k_ref(blocks: &[BlockQ8_K], out: &mut [f32]) {
    check_len(blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = d * q as f32;
        }
    }
}

/// Dequantizes the raw bytes `src` of type `ty` into `out`.
///
/// `src` must hold exactly `out.len()` elements: a whole number of blocks, with `out.len()` a multiple
/// of the block length. Supports the types whose [`GgmlType::traits`] row has a dequantizer.
pub fn dequantize_row_ref(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let Some(dequantize) = ty.traits().dequantize else {
        return Err(QuantError::Unsupported(ty));
    };
    let mismatch = QuantError::LengthMismatch { ty, src_bytes: src.len(), out_len: out.len() };
    let (len, bytes) = (ty.block_len(), ty.block_bytes());
    if out.len() % len != 0 || Some(src.len()) != (out.len() / len).checked_mul(bytes) {
        return Err(mismatch);
    }
    // The lengths are consistent and every block type has alignment 1: the views cannot fail.
    if !dequantize(src, out) {
        return Err(mismatch);
    }
    Ok(())
}

/// Whether every value of the raw bytes `src` of type `ty` is finite (`false` also when `src`
/// is not whole blocks or the type has no dequantizer). Reads in chunks of 256 values.
pub fn all_finite(ty: GgmlType, src: &[u8]) -> bool {
    let (len, bytes) = (ty.block_len(), ty.block_bytes());
    let per_chunk = (256 / len).max(1);
    if src.len() % bytes != 0 {
        return false;
    }
    let mut out = [0f32; 256];
    src.chunks(per_chunk * bytes).all(|chunk| {
        let values = &mut out[..chunk.len() / bytes * len];
        dequantize_row_ref(ty, chunk, values).is_ok() && values.iter().all(|v| v.is_finite())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::Zeroable;

    const SUPPORTED: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];

    /// Largest block (292 bytes) times 4 blocks; outputs up to 4 * 256 elements.
    const BUF: usize = 4 * 292;

    /// xorshift32, so the tests need no dependency.
    struct Rng(u32);
    impl Rng {
        fn byte(&mut self) -> u8 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 17;
            self.0 ^= self.0 << 5;
            (self.0 >> 24) as u8
        }
    }

    /// Byte offsets of a type's f16 (or, for q8_K, f32) scale fields.
    fn scale_fields(ty: GgmlType) -> &'static [usize] {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[],
        }
    }

    fn dequant(ty: GgmlType, src: &[u8], out: &mut [f32; 4 * QK_K]) -> usize {
        let n = src.len() / ty.block_bytes() * ty.block_len();
        dequantize_row_ref(ty, src, &mut out[..n]).unwrap();
        n
    }

    #[test]
    fn all_zero_blocks_give_zeros() {
        for ty in SUPPORTED {
            let src = [0u8; BUF];
            let bytes = 3 * ty.block_bytes();
            let mut out = [f32::NAN; 4 * QK_K];
            let n = dequant(ty, &src[..bytes], &mut out);
            assert!(n > 0);
            assert!(out[..n].iter().all(|&v| v == 0.0), "{ty}: {:?}", &out[..n]);
        }
    }

    #[test]
    fn extreme_finite_scales_give_finite_values() {
        // Random quants with scales of +-65504 (f16 max), +-0 and the smallest subnormal: no NaN, no inf.
        let mut rng = Rng(0x1234_5678);
        for ty in SUPPORTED.into_iter().filter(|t| t.is_quantized()) {
            for scale_bits in [0x7bffu16, 0xfbff, 0x0000, 0x8000, 0x0001, 0x3c00] {
                let mut src = [0u8; BUF];
                let bytes = 4 * ty.block_bytes();
                for (i, b) in src[..bytes].iter_mut().enumerate() {
                    *b = if i % 3 == 0 { 0xff } else { rng.byte() };
                }
                for block in src[..bytes].chunks_exact_mut(ty.block_bytes()) {
                    if ty == GgmlType::Q8_K {
                        let d = f32::from(half::f16::from_bits(scale_bits)) * 1e30;
                        block[..4].copy_from_slice(&d.to_le_bytes());
                    }
                    for &at in scale_fields(ty) {
                        block[at..at + 2].copy_from_slice(&scale_bits.to_le_bytes());
                    }
                }
                let mut out = [f32::NAN; 4 * QK_K];
                let n = dequant(ty, &src[..bytes], &mut out);
                assert!(out[..n].iter().all(|v| v.is_finite()), "{ty} with scale bits {scale_bits:#06x}");
            }
        }
    }

    #[test]
    fn q4_0_uses_split_halves_and_negative_scales() {
        let mut b = BlockQ4_0 { d: F16Le::from_f32(-0.5), qs: [0; 16] };
        for j in 0..16 {
            b.qs[j] = j as u8 | ((15 - j as u8) << 4);
        }
        let mut out = [0f32; 32];
        dequantize_q4_0_ref(&[b], &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * -0.5, "low nibble of byte {j}");
            assert_eq!(out[j + 16], (7.0 - j as f32) * -0.5, "high nibble of byte {j}");
        }
    }

    #[test]
    fn q4_1_adds_the_min() {
        let mut b = BlockQ4_1 { d: F16Le::from_f32(2.0), m: F16Le::from_f32(-3.0), qs: [0; 16] };
        b.qs[0] = 0xF1;
        let mut out = [0f32; 32];
        dequantize_q4_1_ref(&[b], &mut out);
        assert_eq!((out[0], out[16], out[1]), (-1.0, 27.0, -3.0));
    }

    #[test]
    fn q5_high_bits_come_from_the_u32() {
        // qh bit 0 -> element 0, bit 16 -> element 16, bit 31 -> element 31.
        let qh = (1u32 | (1 << 16) | (1 << 31)).to_le_bytes();
        let b = BlockQ5_0 { d: F16Le::from_f32(1.0), qh, qs: [0x11; 16] };
        let mut out = [0f32; 32];
        dequantize_q5_0_ref(&[b], &mut out);
        assert_eq!((out[0], out[1], out[16], out[17], out[31]), (1.0, -15.0, 1.0, -15.0, 1.0));
        let b1 = BlockQ5_1 { d: F16Le::from_f32(1.0), m: F16Le::from_f32(0.5), qh, qs: [0x11; 16] };
        dequantize_q5_1_ref(&[b1], &mut out);
        assert_eq!((out[0], out[1], out[31]), (17.5, 1.5, 17.5));
    }

    #[test]
    fn q3_k_high_bit_is_inverted() {
        let mut b = BlockQ3_K::zeroed();
        b.d = F16Le::from_f32(1.0);
        b.scales = [0x11; 12]; // groups 0-3: 6-bit 0x11 - 32 = -15; groups 4-7: 0x01 - 32 = -31
        b.hmask[5] = 1 << 2; // element 2*32 + 5 = 69 has its high bit set: q = 0, others q = -4
        let mut out = [0f32; QK_K];
        dequantize_q3_k_ref(&[b], &mut out);
        assert_eq!(out[69], 0.0);
        assert_eq!(out[0], 60.0);
        assert_eq!(out[5], 60.0);
    }

    #[test]
    fn q6_k_reads_d_last_and_its_bit_layout() {
        let mut b = BlockQ6_K::zeroed();
        b.d = F16Le::from_f32(0.25);
        b.scales = [4; 16];
        b.ql[64 + 33] = 0x2A; // half 1: element 128+33 low nibble 0xA, element 128+96+1 high nibble 2
        b.qh[32 + 1] = 0b11_00_00_01; // element 128+1: hi 1; element 128+96+1: hi 3
        let mut out = [0f32; QK_K];
        dequantize_q6_k_ref(&[b], &mut out);
        assert_eq!(out[128 + 1], (16 - 32) as f32); // q = 16
        assert_eq!(out[128 + 33], (10 - 32) as f32); // q = 10
        assert_eq!(out[128 + 97], (50 - 32) as f32); // q = 2 | 3 << 4
        assert_eq!(out[0], -32.0);
    }

    #[test]
    fn q2_k_and_q8_k_layouts() {
        let mut b = BlockQ2_K::zeroed();
        b.d = F16Le::from_f32(1.0);
        b.dmin = F16Le::from_f32(0.5);
        b.scales[6] = 0x23; // group 6 = elements 96..112: scale 3, min 2
        b.qs[32] = 0b11_00_00_00; // half 1, l = 0, shift 6: element 128 + 96
        b.qs[0] = 0b10_00_00_00; // half 0, shift 6: element 96
        let mut out = [0f32; QK_K];
        dequantize_q2_k_ref(&[b], &mut out);
        assert_eq!(out[96], 3.0 * 2.0 - 1.0);
        assert_eq!(out[97], -1.0);
        assert_eq!(out[128 + 96], 0.0);

        let mut k = BlockQ8_K::zeroed();
        k.d = F32Le::from_f32(-1e-3);
        k.qs[255] = -128;
        let mut out = [1f32; QK_K];
        dequantize_q8_k_ref(&[k], &mut out);
        assert_eq!(out[255], -1e-3 * -128.0);
        assert_eq!(out[0], 0.0);
    }

    #[test]
    fn dispatcher_checks_lengths_and_types() {
        let src = [0u8; 40];
        let mut out = [0f32; 64];
        assert_eq!(dequantize_row_ref(GgmlType::Q4_0, &src[..36], &mut out), Ok(()));
        for (bytes, n) in [(35, 64), (36, 63), (36, 32), (18, 0), (0, 32)] {
            assert_eq!(
                dequantize_row_ref(GgmlType::Q4_0, &src[..bytes], &mut out[..n]),
                Err(QuantError::LengthMismatch { ty: GgmlType::Q4_0, src_bytes: bytes, out_len: n })
            );
        }
        assert_eq!(dequantize_row_ref(GgmlType::F16, &src[..6], &mut out[..3]), Ok(()));
        assert_eq!(dequantize_row_ref(GgmlType::Q4_0, &[], &mut []), Ok(()));
        let err = dequantize_row_ref(GgmlType::IQ2_XXS, &src, &mut out).unwrap_err();
        assert_eq!(err, QuantError::Unsupported(GgmlType::IQ2_XXS));
        let mut text = heapless::String::<128>::new();
        core::fmt::write(&mut text, format_args!("{err}")).unwrap();
        assert!(text.contains("IQ2_XXS"), "{text}");
    }
}
