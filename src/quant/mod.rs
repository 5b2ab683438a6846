//! Tensor element types of GGUF/ggml and their quantized block formats.
//!
//! [`GgmlType`] is the table every other module sizes tensors with: block length in elements and
//! block size in bytes, with checked row-size arithmetic. The block structs, the reference
//! dequantizers and quantizers live in the submodules.

use core::fmt;

pub mod blocks;
pub mod dequant;
pub mod quantize;
pub mod traits;

pub use blocks::{blocks_of, blocks_of_mut};
pub use dequant::{all_finite, dequantize_row_ref, QuantError};
pub use traits::{TypeList, TypeTraits};

/// A name shown in lower case (type names as llama.cpp's options spell them: `q8_0`).
pub struct Lowercase<'a>(pub &'a str);

impl core::fmt::Display for Lowercase<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        use core::fmt::Write;
        self.0.chars().try_for_each(|c| f.write_char(c.to_ascii_lowercase()))
    }
}

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A ggml tensor type id as stored in GGUF tensor infos.
///
/// Only types whose block layout we know are listed; the ids ggml removed (4, 5, 31-33, 36-38) and
/// unknown ids are refused by [`GgmlType::from_u32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(non_camel_case_types, missing_docs)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, ggml id, elements per block, bytes per block, name)
const TYPE_TABLE: [(GgmlType, u32, usize, usize, &str); 32] = [
    (GgmlType::F32, 0, 1, 4, "F32"),
    (GgmlType::F16, 1, 1, 2, "F16"),
    (GgmlType::Q4_0, 2, 32, 18, "Q4_0"),
    (GgmlType::Q4_1, 3, 32, 20, "Q4_1"),
    (GgmlType::Q5_0, 6, 32, 22, "Q5_0"),
    (GgmlType::Q5_1, 7, 32, 24, "Q5_1"),
    (GgmlType::Q8_0, 8, 32, 34, "Q8_0"),
    (GgmlType::Q8_1, 9, 32, 36, "Q8_1"),
    (GgmlType::Q2_K, 10, QK_K, 84, "Q2_K"),
    (GgmlType::Q3_K, 11, QK_K, 110, "Q3_K"),
    (GgmlType::Q4_K, 12, QK_K, 144, "Q4_K"),
    (GgmlType::Q5_K, 13, QK_K, 176, "Q5_K"),
    (GgmlType::Q6_K, 14, QK_K, 210, "Q6_K"),
    (GgmlType::Q8_K, 15, QK_K, 292, "Q8_K"),
    (GgmlType::IQ2_XXS, 16, QK_K, 66, "IQ2_XXS"),
    (GgmlType::IQ2_XS, 17, QK_K, 74, "IQ2_XS"),
    (GgmlType::IQ3_XXS, 18, QK_K, 98, "IQ3_XXS"),
    (GgmlType::IQ1_S, 19, QK_K, 50, "IQ1_S"),
    (GgmlType::IQ4_NL, 20, 32, 18, "IQ4_NL"),
    (GgmlType::IQ3_S, 21, QK_K, 110, "IQ3_S"),
    (GgmlType::IQ2_S, 22, QK_K, 82, "IQ2_S"),
    (GgmlType::IQ4_XS, 23, QK_K, 136, "IQ4_XS"),
    (GgmlType::I8, 24, 1, 1, "I8"),
    (GgmlType::I16, 25, 1, 2, "I16"),
    (GgmlType::I32, 26, 1, 4, "I32"),
    (GgmlType::I64, 27, 1, 8, "I64"),
    (GgmlType::F64, 28, 1, 8, "F64"),
    (GgmlType::IQ1_M, 29, QK_K, 56, "IQ1_M"),
    (GgmlType::BF16, 30, 1, 2, "BF16"),
    (GgmlType::TQ1_0, 34, QK_K, 54, "TQ1_0"),
    (GgmlType::TQ2_0, 35, QK_K, 66, "TQ2_0"),
    (GgmlType::MXFP4, 39, 32, 17, "MXFP4"),
];

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, usize, usize, &'static str) {
        // The table lists every variant exactly once (checked by a test), so the search always hits.
        let mut i = 0;
        while TYPE_TABLE[i].0 != self {
            i += 1;
        }
        &TYPE_TABLE[i]
    }

    /// The type with ggml id `id`, or `None` for unknown and removed ids.
    pub fn from_u32(id: u32) -> Option<Self> {
        TYPE_TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    /// The ggml id of this type.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_len(self) -> usize {
        self.row().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.row().3
    }

    /// ggml's name for the type (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        self.row().4
    }

    /// Whether the type is a quantized block format (more than one element per block).
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks or the size
    /// overflows. Divides before multiplying, so a large `n` cannot wrap where the result fits.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let block = self.block_len() as u64;
        if n % block != 0 {
            return None;
        }
        (n / block).checked_mul(self.block_bytes() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for (i, row) in TYPE_TABLE.iter().enumerate() {
            assert_eq!(GgmlType::from_u32(row.1), Some(row.0));
            assert_eq!(row.0.id(), row.1);
            assert!(row.2 > 0 && row.3 > 0, "{} has a zero size", row.4);
            for other in &TYPE_TABLE[i + 1..] {
                assert!(other.0 != row.0 && other.1 != row.1, "{} listed twice", row.4);
            }
        }
    }

    #[test]
    fn removed_and_unknown_ids_are_refused() {
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_u32(id), None, "id {id}");
        }
    }

    #[test]
    fn byte_sizes_divide_before_multiplying() {
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
        assert_eq!(GgmlType::Q6_K.bytes_for(512), Some(420));
        // 2^63 elements of Q4_0: the product 18 * n wraps, (n / 32) * 18 fits.
        assert_eq!(GgmlType::Q4_0.bytes_for(1 << 63), Some((1u64 << 58) * 18));
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
