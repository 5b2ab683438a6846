//! The packed layouts as types, for kernels generic over the one they read.
//!
//! A SIMD kernel's inner loops are compiled once per layout (`matmul_neon::<Q4Min>`, ...): the
//! layout is a type parameter whose [`Layout::FORMAT`] is a constant, so every fact the loops ask
//! (`L::FORMAT.has_min()`, `L::FORMAT.quant_bytes()`, ...) is one of [`PackedFormat`]'s exhaustive
//! matches, folded at compile time. The trait is sealed: only the formats below are layouts.
//! Q4K and Q5K have none; their kernels are Q4Min's and Q5Min's after a scale-decoding step
//! (see [`super::matmul`]).

use super::packed::PackedFormat;

/// A packed layout a kernel can be compiled for.
pub trait Layout: sealed::Sealed {
    /// The format whose planes the kernel reads.
    const FORMAT: PackedFormat;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! layouts {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        $(
            $(#[doc = $doc])*
            pub struct $name;
            impl sealed::Sealed for $name {}
            impl Layout for $name {
                const FORMAT: PackedFormat = PackedFormat::$name;
            }
        )*
    };
}

layouts! {
    /// [`PackedFormat::Q4`].
    Q4,
    /// [`PackedFormat::Q4Min`] (and Q4K's quant plane once its scales are decoded).
    Q4Min,
    /// [`PackedFormat::Q8`] (and Q5 widened).
    Q8,
    /// [`PackedFormat::Q8Min`] (and Q5Min widened).
    Q8Min,
    /// [`PackedFormat::Q8Sub16`] (and Q6K widened).
    Q8Sub16,
    /// [`PackedFormat::Q6K`] (x86 unpacks it in registers).
    Q6K,
    /// [`PackedFormat::Q5`] (x86 unpacks it in registers).
    Q5,
    /// [`PackedFormat::Q5Min`] (and Q5K's quant plane once its scales are decoded).
    Q5Min,
}
