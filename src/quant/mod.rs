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

/// Declares [`GgmlType`] and every fact of a type that is a number or a name, one line per type:
/// `Name = ggml id, elements per block, bytes per block, llama.cpp file type`. The enum, its
/// [`GgmlType::ALL`] list and the id lookup are generated from the same lines, so a type cannot be
/// declared without its sizes, and a repeated id is an unreachable pattern (a compile error under
/// `-D warnings`).
macro_rules! ggml_types {
    ($($ty:ident = $id:literal, $block:expr, $bytes:literal, $ftype:expr;)*) => {
        /// A ggml tensor type id as stored in GGUF tensor infos.
        ///
        /// Only types whose block layout we know are listed; the ids ggml removed (4, 5, 31-33,
        /// 36-38) and unknown ids are refused by [`GgmlType::from_u32`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        #[allow(non_camel_case_types, missing_docs)]
        pub enum GgmlType {
            $($ty,)*
        }

        impl GgmlType {
            /// Every type, in ggml's id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$ty,)*];

            fn row(self) -> TypeRow {
                match self {
                    $(GgmlType::$ty => TypeRow {
                        id: $id,
                        block_len: $block,
                        block_bytes: $bytes,
                        name: stringify!($ty),
                        file_type: $ftype,
                    },)*
                }
            }

            /// The type with ggml id `id`, or `None` for unknown and removed ids.
            pub fn from_u32(id: u32) -> Option<Self> {
                match id {
                    $($id => Some(GgmlType::$ty),)*
                    _ => None,
                }
            }
        }
    };
}

/// The numbers and the name of one type (see [`ggml_types`]).
struct TypeRow {
    id: u32,
    block_len: usize,
    block_bytes: usize,
    name: &'static str,
    file_type: Option<u32>,
}

// File types are llama.cpp's `LLAMA_FTYPE_MOSTLY_*` of a file whose matrices all have the type
// (the K-quants' `_S` mixes); `None` where llama.cpp has none.
ggml_types! {
    F32 = 0, 1, 4, Some(0);
    F16 = 1, 1, 2, Some(1);
    Q4_0 = 2, 32, 18, Some(2);
    Q4_1 = 3, 32, 20, Some(3);
    Q5_0 = 6, 32, 22, Some(8);
    Q5_1 = 7, 32, 24, Some(9);
    Q8_0 = 8, 32, 34, Some(7);
    Q8_1 = 9, 32, 36, None;
    Q2_K = 10, QK_K, 84, Some(10);
    Q3_K = 11, QK_K, 110, Some(11);
    Q4_K = 12, QK_K, 144, Some(14);
    Q5_K = 13, QK_K, 176, Some(16);
    Q6_K = 14, QK_K, 210, Some(18);
    Q8_K = 15, QK_K, 292, None;
    IQ2_XXS = 16, QK_K, 66, Some(19);
    IQ2_XS = 17, QK_K, 74, Some(20);
    IQ3_XXS = 18, QK_K, 98, Some(23);
    IQ1_S = 19, QK_K, 50, Some(24);
    IQ4_NL = 20, 32, 18, Some(25);
    IQ3_S = 21, QK_K, 110, Some(26);
    IQ2_S = 22, QK_K, 82, Some(28);
    IQ4_XS = 23, QK_K, 136, Some(30);
    I8 = 24, 1, 1, None;
    I16 = 25, 1, 2, None;
    I32 = 26, 1, 4, None;
    I64 = 27, 1, 8, None;
    F64 = 28, 1, 8, None;
    IQ1_M = 29, QK_K, 56, Some(31);
    BF16 = 30, 1, 2, Some(32);
    TQ1_0 = 34, QK_K, 54, Some(36);
    TQ2_0 = 35, QK_K, 66, Some(37);
    MXFP4 = 39, 32, 17, None; // (llama.cpp's 38 is a mixture-of-experts mix)
}

impl GgmlType {
    /// The ggml id of this type.
    pub fn id(self) -> u32 {
        self.row().id
    }

    /// Elements per block (1 for plain types).
    pub fn block_len(self) -> usize {
        self.row().block_len
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.row().block_bytes
    }

    /// ggml's name for the type (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// llama.cpp's file type (`general.file_type`, `LLAMA_FTYPE_MOSTLY_*`) of a file whose
    /// matrices all have this type, or `None` where llama.cpp has none.
    pub fn file_type(self) -> Option<u32> {
        self.row().file_type
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
        for (i, &ty) in GgmlType::ALL.iter().enumerate() {
            assert_eq!(GgmlType::from_u32(ty.id()), Some(ty));
            assert!(ty.block_len() > 0 && ty.block_bytes() > 0, "{ty} has a zero size");
            assert!(!GgmlType::ALL[i + 1..].contains(&ty), "{ty} listed twice");
            let same_file_type = GgmlType::ALL[i + 1..]
                .iter()
                .find(|t| t.file_type().is_some() && t.file_type() == ty.file_type());
            assert!(same_file_type.is_none(), "{ty} and {same_file_type:?} share a file type");
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
