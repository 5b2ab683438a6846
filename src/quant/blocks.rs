//! On-disk block layouts of the ggml element types, as plain byte structs.
//!
//! Every struct here has alignment 1: multi-byte fields are little-endian byte arrays
//! ([`F16Le`], [`F32Le`], ...). A tensor's bytes inside an mmap'd GGUF file are therefore viewable
//! as `&[BlockX]` at any offset, with [`blocks_of`], without copying and without `unsafe`.

use bytemuck::{Pod, Zeroable};

use super::QK_K;

/// An IEEE binary16 value stored little-endian (alignment 1).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
pub struct F16Le(pub [u8; 2]);

impl F16Le {
    /// The value with raw bits `bits`.
    pub const fn from_bits(bits: u16) -> Self {
        Self(bits.to_le_bytes())
    }

    /// The raw bits.
    pub const fn to_bits(self) -> u16 {
        u16::from_le_bytes(self.0)
    }

    /// Exact widening to f32.
    #[inline]
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(self.to_bits()).to_f32()
    }

    /// Round-to-nearest-even narrowing from f32 (what ggml's `GGML_FP32_TO_FP16` does).
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        Self::from_bits(half::f16::from_f32(x).to_bits())
    }
}

/// A bfloat16 value (the upper half of an f32) stored little-endian (alignment 1).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
pub struct Bf16Le(pub [u8; 2]);

impl Bf16Le {
    /// The raw bits.
    pub const fn to_bits(self) -> u16 {
        u16::from_le_bytes(self.0)
    }

    /// Exact widening to f32.
    #[inline]
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// An f32 stored little-endian (alignment 1).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
pub struct F32Le(pub [u8; 4]);

impl F32Le {
    /// The value.
    #[inline]
    pub fn get(self) -> f32 {
        f32::from_le_bytes(self.0)
    }

    /// Stores `x`.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        Self(x.to_le_bytes())
    }
}

/// An i16 stored little-endian (alignment 1).
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Pod, Zeroable)]
pub struct I16Le(pub [u8; 2]);

impl I16Le {
    /// The value.
    #[inline]
    pub fn get(self) -> i16 {
        i16::from_le_bytes(self.0)
    }

    /// Stores `v`.
    #[inline]
    pub fn new(v: i16) -> Self {
        Self(v.to_le_bytes())
    }
}

/// Elements per block of the 32-element types.
pub const QK: usize = 32;

/// `q4_0`: 32 elements, `x = d * (nibble - 8)`; 18 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: F16Le,
    /// Element `j` in the low nibble of `qs[j]`, element `j + 16` in the high nibble.
    pub qs: [u8; QK / 2],
}

/// `q4_1`: 32 elements, `x = d * nibble + m`; 20 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: F16Le,
    /// Minimum (offset).
    pub m: F16Le,
    /// Nibbles, split-halves order as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}

/// `q5_0`: 32 elements, `x = d * (q - 16)` with 5-bit `q`; 22 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: F16Le,
    /// Fifth bits: bit `i` of this little-endian u32 belongs to element `i`.
    pub qh: [u8; 4],
    /// Low four bits, split-halves order as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}

/// `q5_1`: 32 elements, `x = d * q + m` with 5-bit `q`; 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: F16Le,
    /// Minimum (offset).
    pub m: F16Le,
    /// Fifth bits, as in [`BlockQ5_0`].
    pub qh: [u8; 4],
    /// Low four bits, as in [`BlockQ5_0`].
    pub qs: [u8; QK / 2],
}

/// `q8_0`: 32 elements, `x = d * q`; 34 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: F16Le,
    /// Quants.
    pub qs: [i8; QK],
}

/// `q8_1`: 32 elements, `x = d * q`, plus `s = d * sum(q)` for the min term of q4_1/q5_1 dots; 36 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: F16Le,
    /// `d * sum(qs)`.
    pub s: F16Le,
    /// Quants.
    pub qs: [i8; QK],
}

/// `q2_K`: 256 elements in 16 groups of 16 with 4-bit scale and min; 84 bytes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ2_K {
    /// Per group: scale in the low nibble, min in the high nibble.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants: byte `32h + l` holds elements `128h + l + 32k` at shift `2k`.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the scales.
    pub d: F16Le,
    /// Super-block scale of the mins.
    pub dmin: F16Le,
}

/// `q3_K`: 256 elements in 16 groups of 16 with 6-bit signed scales; 110 bytes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ3_K {
    /// High bits, inverted: element `e` is bit `e / 32` of `hmask[e % 32]`.
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits, placed as in [`BlockQ2_K`].
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales, stored offset by 32.
    pub scales: [u8; 12],
    /// Super-block scale.
    pub d: F16Le,
}

/// `q4_K`: 256 elements in 8 sub-blocks of 32 with 6-bit scale and min; 144 bytes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_K {
    /// Super-block scale of the scales.
    pub d: F16Le,
    /// Super-block scale of the mins.
    pub dmin: F16Le,
    /// Eight 6-bit scales and eight 6-bit mins (see [`scale_min_k4`]).
    pub scales: [u8; 12],
    /// Chunk `c` of 64 elements: `qs[32c + l]` low nibble = element `64c + l`, high = `64c + 32 + l`.
    pub qs: [u8; QK_K / 2],
}

/// `q5_K`: as [`BlockQ4_K`] plus a fifth bit per element; 176 bytes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ5_K {
    /// Super-block scale of the scales.
    pub d: F16Le,
    /// Super-block scale of the mins.
    pub dmin: F16Le,
    /// Scales and mins, as in [`BlockQ4_K`].
    pub scales: [u8; 12],
    /// Fifth bits: sub-block `j` (32 elements) uses bit `j` of `qh[l]`.
    pub qh: [u8; QK_K / 8],
    /// Low four bits, as in [`BlockQ4_K`].
    pub qs: [u8; QK_K / 2],
}

/// `q6_K`: 256 elements in 16 groups of 16 with int8 scales; 210 bytes (the scale `d` is last).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ6_K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    /// Group scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: F16Le,
}

/// `q8_K`: 256 elements, `x = d * q` with an f32 scale, plus per-16 sums; 292 bytes. Activations only.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_K {
    /// Scale (f32, unlike the other types).
    pub d: F32Le,
    /// Quants.
    pub qs: [i8; QK_K],
    /// `bsums[g]` = sum of `qs[16g .. 16g + 16]`.
    pub bsums: [I16Le; QK_K / 16],
}

// Sizes must match ggml's static asserts (and `GgmlType::block_bytes`, checked by a test), and the
// alignment must be 1 so any byte offset of an mmap'd file can be viewed as blocks.
macro_rules! assert_layout {
    ($($t:ty => $bytes:expr),* $(,)?) => {
        $(
            const _: () = assert!(core::mem::size_of::<$t>() == $bytes);
            const _: () = assert!(core::mem::align_of::<$t>() == 1);
        )*
    };
}

assert_layout! {
    F16Le => 2,
    Bf16Le => 2,
    F32Le => 4,
    I16Le => 2,
    BlockQ4_0 => 18,
    BlockQ4_1 => 20,
    BlockQ5_0 => 22,
    BlockQ5_1 => 24,
    BlockQ8_0 => 34,
    BlockQ8_1 => 36,
    BlockQ2_K => 84,
    BlockQ3_K => 110,
    BlockQ4_K => 144,
    BlockQ5_K => 176,
    BlockQ6_K => 210,
    BlockQ8_K => 292,
}

/// `bytes` viewed as blocks, or `None` when its length is not a whole number of blocks (or, for a
/// `B` with alignment above 1, when `bytes` is misaligned; the block structs here have alignment 1).
pub fn blocks_of<B: Pod>(bytes: &[u8]) -> Option<&[B]> {
    bytemuck::try_cast_slice(bytes).ok()
}

/// Mutable twin of [`blocks_of`].
pub fn blocks_of_mut<B: Pod>(bytes: &mut [u8]) -> Option<&mut [B]> {
    bytemuck::try_cast_slice_mut(bytes).ok()
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of q4_K/q5_K.
///
/// j < 4: low 6 bits of bytes `j` and `j + 4`; j >= 4: a nibble of byte `j + 4` plus the top two bits
/// of bytes `j - 4` (scale) and `j` (min).
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Signed scale of group `i` (0..16) from the 12 packed bytes of q3_K (already minus 32).
#[inline]
pub fn scale_q3_k(i: usize, s: &[u8; 12]) -> i8 {
    let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
    let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use core::mem::size_of;

    #[test]
    fn sizes_match_the_type_table() {
        let table = [
            (GgmlType::Q4_0, size_of::<BlockQ4_0>(), QK),
            (GgmlType::Q4_1, size_of::<BlockQ4_1>(), QK),
            (GgmlType::Q5_0, size_of::<BlockQ5_0>(), QK),
            (GgmlType::Q5_1, size_of::<BlockQ5_1>(), QK),
            (GgmlType::Q8_0, size_of::<BlockQ8_0>(), QK),
            (GgmlType::Q8_1, size_of::<BlockQ8_1>(), QK),
            (GgmlType::Q2_K, size_of::<BlockQ2_K>(), QK_K),
            (GgmlType::Q3_K, size_of::<BlockQ3_K>(), QK_K),
            (GgmlType::Q4_K, size_of::<BlockQ4_K>(), QK_K),
            (GgmlType::Q5_K, size_of::<BlockQ5_K>(), QK_K),
            (GgmlType::Q6_K, size_of::<BlockQ6_K>(), QK_K),
            (GgmlType::Q8_K, size_of::<BlockQ8_K>(), QK_K),
            (GgmlType::F16, size_of::<F16Le>(), 1),
            (GgmlType::BF16, size_of::<Bf16Le>(), 1),
            (GgmlType::F32, size_of::<F32Le>(), 1),
        ];
        for (ty, bytes, len) in table {
            assert_eq!(ty.block_bytes(), bytes, "{ty}");
            assert_eq!(ty.block_len(), len, "{ty}");
        }
    }

    #[test]
    fn blocks_view_any_offset_and_refuse_partial_blocks() {
        let mut buf = [0u8; 1 + 2 * 18 + 5];
        buf[1] = 0x00;
        buf[2] = 0x3c; // 1.0 as f16
        buf[3] = 0x21;
        let odd = &buf[1..1 + 2 * 18];
        let blocks: &[BlockQ4_0] = blocks_of(odd).expect("two whole blocks at an odd address");
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].d.to_f32(), 1.0);
        assert_eq!(blocks[0].qs[0], 0x21);
        assert!(blocks_of::<BlockQ4_0>(&buf[1..1 + 2 * 18 + 1]).is_none());
        assert!(blocks_of::<BlockQ4_0>(&buf[1..18]).is_none());
        assert_eq!(blocks_of::<BlockQ4_0>(&[]).map(<[_]>::len), Some(0));
        assert!(blocks_of_mut::<BlockQ8_K>(&mut buf[3..7]).is_none());
    }

    #[test]
    fn scalar_fields_round_trip() {
        for bits in [0u16, 0x8000, 0x3c00, 0x7bff, 0xfbff, 0x0001, 0x03ff] {
            let v = F16Le::from_bits(bits);
            assert_eq!(F16Le::from_f32(v.to_f32()).to_bits(), bits);
        }
        assert_eq!(F16Le::from_f32(65504.0).to_bits(), 0x7bff);
        assert_eq!(F16Le([0x00, 0xc0]).to_f32(), -2.0);
        assert_eq!(Bf16Le([0x80, 0x3f]).to_f32(), 1.0);
        assert_eq!(Bf16Le([0x80, 0xbf]).to_f32(), -1.0);
        assert_eq!(F32Le::from_f32(-1.5).get(), -1.5);
        assert_eq!(I16Le::new(-300).get(), -300);
    }

    #[test]
    fn k4_scales_decode_what_the_writer_packed() {
        // Pack with the writer's rules, then read back every (scale, min) pair.
        let sc = [1u8, 63, 0, 17, 48, 5, 63, 32];
        let m = [62u8, 0, 33, 9, 63, 16, 1, 40];
        let mut s = [0u8; 12];
        s[..4].copy_from_slice(&sc[..4]);
        s[4..8].copy_from_slice(&m[..4]);
        for j in 4..8 {
            s[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &s), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q3_k_scales_decode_with_offset() {
        // All 6-bit fields zero means -32; all ones means 31.
        assert!((0..16).all(|i| scale_q3_k(i, &[0; 12]) == -32));
        assert!((0..16).all(|i| scale_q3_k(i, &[0xff; 12]) == 31));
        // Scale 9: high nibble of byte 1, bits 4-5 of byte 9.
        let mut s = [0u8; 12];
        s[1] = 0x50;
        s[9] = 0b0010_0000;
        assert_eq!(scale_q3_k(9, &s), (0x5 | (0b10 << 4)) - 32);
        assert_eq!(scale_q3_k(1, &s), -32);
    }
}
