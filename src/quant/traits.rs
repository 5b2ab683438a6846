//! What pinfer does with each tensor type, one row per type.
//!
//! [`GgmlType::traits`] matches every variant without a wildcard: a new type does not compile until
//! its row says how it dequantizes, quantizes, converts activations, which activation type its
//! dot product takes and what its repacked layout is. Every list of types elsewhere (what the
//! graph reads, what weights may be, what the NPU converts, what `quantize` writes) is derived
//! from these rows.

use super::blocks::{blocks_of, blocks_of_mut, F16Le};
use super::dequant::*;
use super::quantize::*;
use super::GgmlType;
use crate::kernels::dot::*;
use crate::kernels::packed::PackedFormat;

/// Reads whole blocks of raw bytes into f32 values; `false` if the bytes are not whole blocks.
pub type DequantizeFn = fn(&[u8], &mut [f32]) -> bool;
/// Writes f32 values as whole blocks of raw bytes; `false` if the sizes do not match.
pub type QuantizeFn = fn(&[f32], &mut [u8]) -> bool;
/// Dot product of one weight row and one activation row (raw bytes); 0.0 if they do not match.
pub type VecDotFn = fn(&[u8], &[u8]) -> f32;

/// One type's row.
#[derive(Clone, Copy)]
pub struct TypeTraits {
    /// The reference dequantizer: the type can be read (by `get_rows`, the NPU, `perplexity`).
    pub dequantize: Option<DequantizeFn>,
    /// The reference quantizer (`pinfer quantize` writes the type).
    pub quantize: Option<QuantizeFn>,
    /// The activation converter: the type is another type's dot-product partner.
    pub from_float: Option<QuantizeFn>,
    /// The activation type and the reference dot product: the type can be a matmul's weights.
    pub vec_dot: Option<(GgmlType, VecDotFn)>,
    /// The interleaved layout the SIMD kernels repack the type's weights into.
    pub packed: Option<PackedFormat>,
    /// The repacked layout holds the file's values exactly (same scales, same quants), so
    /// `get_rows` reads rows from it: a tied embedding keeps one resident copy.
    pub rows_from_packed: bool,
    /// The type can hold the KV cache (`-ctk/-ctv`, llama.cpp's list less iq4_nl): rows are
    /// written by its activation converter or quantizer, keys dotted with the query in its dot
    /// product, values widened by its dequantizer.
    pub kv_cache: bool,
}

const NONE: TypeTraits = TypeTraits {
    dequantize: None,
    quantize: None,
    from_float: None,
    vec_dot: None,
    packed: None,
    rows_from_packed: false,
    kv_cache: false,
};

macro_rules! dequantize {
    ($f:path) => {
        Some(|src: &[u8], out: &mut [f32]| match blocks_of(src) {
            Some(blocks) => {
                $f(blocks, out);
                true
            }
            None => false,
        })
    };
}

macro_rules! quantize {
    ($f:path) => {
        Some(|x: &[f32], out: &mut [u8]| match blocks_of_mut(out) {
            Some(blocks) => {
                $f(x, blocks);
                true
            }
            None => false,
        })
    };
}

macro_rules! dot {
    ($act:ident, $f:path) => {
        Some((GgmlType::$act, |w: &[u8], a: &[u8]| match (blocks_of(w), blocks_of(a)) {
            (Some(x), Some(y)) if x.len() == y.len() => $f(x, y),
            _ => 0.0,
        }))
    };
}

fn f32_from_float(x: &[f32], out: &mut [u8]) -> bool {
    out.chunks_exact_mut(4).zip(x).for_each(|(o, &v)| o.copy_from_slice(&v.to_le_bytes()));
    true
}

fn f16_from_float(x: &[f32], out: &mut [u8]) -> bool {
    out.chunks_exact_mut(2).zip(x).for_each(|(o, &v)| o.copy_from_slice(&F16Le::from_f32(v).0));
    true
}

fn bf16_from_float(x: &[f32], out: &mut [u8]) -> bool {
    out.chunks_exact_mut(2).zip(x).for_each(|(o, &v)| o.copy_from_slice(&f32_to_bf16_ref(v).0));
    true
}

impl GgmlType {
    /// What pinfer does with this type.
    pub fn traits(self) -> TypeTraits {
        use GgmlType as T;
        use PackedFormat as P;
        match self {
            T::F32 => TypeTraits {
                dequantize: dequantize!(dequantize_f32_ref),
                from_float: Some(f32_from_float),
                vec_dot: dot!(F32, vec_dot_f32_f32_ref),
                kv_cache: true,
                ..NONE
            },
            T::F16 => TypeTraits {
                dequantize: dequantize!(dequantize_f16_ref),
                from_float: Some(f16_from_float),
                vec_dot: dot!(F16, vec_dot_f16_f16_ref),
                kv_cache: true,
                ..NONE
            },
            T::BF16 => TypeTraits {
                dequantize: dequantize!(dequantize_bf16_ref),
                from_float: Some(bf16_from_float),
                vec_dot: dot!(BF16, vec_dot_bf16_bf16_ref),
                kv_cache: true,
                ..NONE
            },
            T::Q4_0 => TypeTraits {
                dequantize: dequantize!(dequantize_q4_0_ref),
                quantize: quantize!(quantize_row_q4_0_ref),
                vec_dot: dot!(Q8_0, vec_dot_q4_0_q8_0_ref),
                packed: Some(P::Q4),
                rows_from_packed: true,
                kv_cache: true,
                ..NONE
            },
            T::Q4_1 => TypeTraits {
                dequantize: dequantize!(dequantize_q4_1_ref),
                quantize: quantize!(quantize_row_q4_1_ref),
                vec_dot: dot!(Q8_1, vec_dot_q4_1_q8_1_ref),
                packed: Some(P::Q4Min),
                rows_from_packed: true,
                kv_cache: true,
                ..NONE
            },
            T::Q5_0 => TypeTraits {
                dequantize: dequantize!(dequantize_q5_0_ref),
                quantize: quantize!(quantize_row_q5_0_ref),
                vec_dot: dot!(Q8_0, vec_dot_q5_0_q8_0_ref),
                packed: Some(P::Q5),
                rows_from_packed: true,
                kv_cache: true,
                ..NONE
            },
            T::Q5_1 => TypeTraits {
                dequantize: dequantize!(dequantize_q5_1_ref),
                quantize: quantize!(quantize_row_q5_1_ref),
                vec_dot: dot!(Q8_1, vec_dot_q5_1_q8_1_ref),
                packed: Some(P::Q5Min),
                rows_from_packed: true,
                kv_cache: true,
                ..NONE
            },
            T::Q8_0 => TypeTraits {
                dequantize: dequantize!(dequantize_q8_0_ref),
                quantize: quantize!(quantize_row_q8_0_ref),
                from_float: quantize!(quantize_act_q8_0_ref),
                vec_dot: dot!(Q8_0, vec_dot_q8_0_q8_0_ref),
                packed: Some(P::Q8),
                rows_from_packed: true,
                kv_cache: true,
            },
            T::Q8_1 => TypeTraits {
                dequantize: dequantize!(dequantize_q8_1_ref),
                from_float: quantize!(quantize_act_q8_1_ref),
                ..NONE
            },
            T::Q2_K => TypeTraits {
                dequantize: dequantize!(dequantize_q2_k_ref),
                vec_dot: dot!(Q8_K, vec_dot_q2_k_q8_k_ref),
                ..NONE
            },
            T::Q3_K => TypeTraits {
                dequantize: dequantize!(dequantize_q3_k_ref),
                vec_dot: dot!(Q8_K, vec_dot_q3_k_q8_k_ref),
                ..NONE
            },
            T::Q4_K => TypeTraits {
                dequantize: dequantize!(dequantize_q4_k_ref),
                quantize: quantize!(quantize_row_q4_k_ref),
                vec_dot: dot!(Q8_K, vec_dot_q4_k_q8_k_ref),
                packed: Some(P::Q4K),
                rows_from_packed: true,
                ..NONE
            },
            T::Q5_K => TypeTraits {
                dequantize: dequantize!(dequantize_q5_k_ref),
                vec_dot: dot!(Q8_K, vec_dot_q5_k_q8_k_ref),
                packed: Some(P::Q5K),
                rows_from_packed: true,
                ..NONE
            },
            T::Q6_K => TypeTraits {
                dequantize: dequantize!(dequantize_q6_k_ref),
                quantize: quantize!(quantize_row_q6_k_ref),
                vec_dot: dot!(Q8_K, vec_dot_q6_k_q8_k_ref),
                packed: Some(P::Q6K),
                rows_from_packed: true,
                ..NONE
            },
            T::Q8_K => TypeTraits {
                dequantize: dequantize!(dequantize_q8_k_ref),
                quantize: quantize!(quantize_row_q8_k_ref),
                from_float: quantize!(quantize_row_q8_k_ref),
                ..NONE
            },
            // Types pinfer parses (sizes, names) but does not compute with.
            T::IQ2_XXS
            | T::IQ2_XS
            | T::IQ3_XXS
            | T::IQ1_S
            | T::IQ4_NL
            | T::IQ3_S
            | T::IQ2_S
            | T::IQ4_XS
            | T::IQ1_M
            | T::TQ1_0
            | T::TQ2_0
            | T::MXFP4
            | T::I8
            | T::I16
            | T::I32
            | T::I64
            | T::F64 => NONE,
        }
    }

    /// Whether the type can hold the KV cache (see [`TypeTraits::kv_cache`]).
    pub fn is_kv_cache_type(self) -> bool {
        let t = self.traits();
        t.kv_cache && self.kv_writer().is_some() && t.vec_dot.is_some() && t.dequantize.is_some()
    }

    /// How a KV cache of this type stores f32 rows: the activation converter where there is one
    /// (f32, f16, bf16, and q8_0 rounding as llama.cpp's SIMD `from_float`), else the reference
    /// quantizer (q4_0, q4_1, q5_0, q5_1, as ggml's `set_rows`).
    pub fn kv_writer(self) -> Option<QuantizeFn> {
        let t = self.traits();
        t.from_float.or(t.quantize)
    }

    /// Every type, in the table's order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.iter().copied()
    }
}

/// The names of the types `has` selects, comma-separated, in the table's order (for messages).
pub struct TypeList(pub fn(GgmlType) -> bool);

impl core::fmt::Display for TypeList {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut first = true;
        for ty in GgmlType::all().filter(|&t| (self.0)(t)) {
            if !first {
                f.write_str(", ")?;
            }
            f.write_str(ty.name())?;
            first = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_types_are_llama_cpps() {
        let mut list = heapless::String::<128>::new();
        core::fmt::write(&mut list, format_args!("{}", TypeList(GgmlType::is_kv_cache_type))).unwrap();
        assert_eq!(list, "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16");
    }

    #[test]
    fn every_row_is_consistent() {
        for ty in GgmlType::all() {
            let t = ty.traits();
            if let Some((act, _)) = t.vec_dot {
                assert!(act.traits().from_float.is_some(), "{ty}: its activation type {act} cannot be made");
                assert!(t.dequantize.is_some(), "{ty}: a weight type that does not dequantize");
            }
            if let Some(format) = t.packed {
                assert!(t.vec_dot.is_some(), "{ty}: repacked but without a reference dot product");
                // The packer reads the type: 4 rows of 256 zeros pack.
                let (rows, k) = (4, 256);
                let mut src = [0u8; 4 * 292];
                let src = &mut src[..rows * ty.bytes_for(k as u64).unwrap() as usize];
                let (qn, sn) = crate::kernels::packed::packed_bytes(format, rows, k);
                let (mut quants, mut scales) = ([0u8; 1024], [0u8; 256]);
                let packed =
                    crate::kernels::packed::pack(ty, src, rows, k, &mut quants[..qn], &mut scales[..sn]);
                assert_eq!(packed.ok(), Some(format), "{ty}");
            }
            if t.quantize.is_some() {
                assert!(t.dequantize.is_some(), "{ty}: written but not read back");
            }
        }
    }

    /// Where rows are read from the repacked copy, they are the file's rows bit for bit.
    #[test]
    fn rows_from_packed_copies_are_exact() {
        let (rows, k) = (4, 256);
        let mut seed = 0x9e37_79b9_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for ty in GgmlType::all().filter(|t| t.traits().rows_from_packed) {
            let format = ty.traits().packed.unwrap();
            let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
            let mut src = [0u8; 4 * 272];
            let src = &mut src[..rows * row_bytes];
            src.iter_mut().for_each(|b| *b = next() as u8);
            // Finite scales (and mins) in the f16 fields of every block (Q6_K's `d` is last).
            let fields: &[usize] = if ty == GgmlType::Q6_K { &[208] } else { &[0, 2] };
            for block in src.chunks_exact_mut(ty.block_bytes()) {
                for &field in fields {
                    let v = (next() % 2000) as f32 / 1e5 - 0.01;
                    block[field..field + 2].copy_from_slice(&F16Le::from_f32(v).0);
                }
            }
            let (qn, sn) = crate::kernels::packed::packed_bytes(format, rows, k);
            let (mut quants, mut scales) = ([0u8; 1024], [0u8; 256]);
            crate::kernels::packed::pack(ty, src, rows, k, &mut quants[..qn], &mut scales[..sn]).unwrap();
            let w = crate::kernels::packed::PackedMatrix {
                format,
                rows,
                k,
                quants: &quants[..qn],
                scales: &scales[..sn],
            };
            let dequantize = ty.traits().dequantize.unwrap();
            for r in 0..rows {
                let (mut want, mut got) = ([0f32; 256], [0f32; 256]);
                assert!(dequantize(&src[r * row_bytes..(r + 1) * row_bytes], &mut want));
                crate::kernels::packed::dequantize_packed_row(&w, r, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{ty} row {r} [{i}]: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn lists_come_from_the_rows() {
        let mut weights: heapless::String<200> = heapless::String::new();
        core::fmt::write(&mut weights, format_args!("{}", TypeList(|t| t.traits().vec_dot.is_some())))
            .unwrap();
        assert_eq!(
            weights.as_str(),
            "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"
        );
    }
}
