//! The 13 GGUF metadata value types (the values' tags), below both the reader and its errors.

use core::fmt;

/// The type tag of a metadata value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with GGUF tag `tag`, or `None` for tags outside 0..=12.
    pub fn from_u32(tag: u32) -> Option<Self> {
        use ValueType::*;
        const ALL: [ValueType; 13] = [U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64];
        ALL.get(tag as usize).copied()
    }

    /// Size in bytes of a value of fixed-size type, `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The smallest encoding of one value of this type: a string needs its 8-byte length, an
    /// array its 4-byte element type and 8-byte count.
    pub(crate) fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }

    /// The type's name as in the GGUF spec.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
