//! The one error type of the GGUF parser and its typed accessors.

use core::fmt;

use super::value_type::ValueType;

/// A key or tensor name carried by an error (truncated to fit; long names are hostile anyway).
pub type Name = heapless::String<64>;

/// Copies `text` into a [`Name`], cutting it at a character boundary if it is too long.
pub(crate) fn name_of(text: &str) -> Name {
    let mut name = Name::new();
    for c in text.chars() {
        if name.push(c).is_err() {
            break;
        }
    }
    name
}

/// Why a GGUF file or one of its values was refused.
///
/// Offsets are byte positions in the file, so a report can be checked with a hex dump.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GgufError {
    /// The first four bytes are not `GGUF`.
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version other than 2 and 3 (1 is obsolete, a byte-swapped one means big-endian).
    UnsupportedVersion {
        /// The version field as read (little-endian).
        version: u32,
    },
    /// The file ends inside a field.
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs from there.
        needed: u64,
    },
    /// A count or length beyond what the file can hold or what we accept.
    TooLarge {
        /// The field.
        what: &'static str,
        /// Where it is.
        offset: u64,
        /// The value found.
        value: u64,
        /// The largest value accepted there.
        max: u64,
    },
    /// A field holds a value the format does not allow.
    Invalid {
        /// The field.
        what: &'static str,
        /// Where it is.
        offset: u64,
        /// The value found, where it is a number.
        value: u64,
    },
    /// A metadata key appears twice, or is empty or not printable ASCII.
    BadKey {
        /// The key (lossy when not text).
        key: Name,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A tensor info or extent is invalid.
    BadTensor {
        /// Tensor name (or `#index` when the name itself is bad).
        name: Name,
        /// What is wrong.
        problem: &'static str,
        /// A number that shows the problem (a dimension, type id, offset...), 0 if none.
        value: u64,
    },
    /// A key the caller needs is absent.
    MissingKey {
        /// The key.
        key: Name,
    },
    /// A key holds another type than the caller needs.
    WrongType {
        /// The key.
        key: Name,
        /// What the caller needs.
        expected: &'static str,
        /// The type stored.
        found: ValueType,
    },
    /// A key's value does not fit what the caller needs (negative, too big, not UTF-8...).
    BadValue {
        /// The key.
        key: Name,
        /// What is wrong.
        problem: &'static str,
    },
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const CORRUPT: &str = "the file is corrupt or not a model; download it again";
        match self {
            Self::BadMagic { found } => write!(f, "not a GGUF file (magic {found:02x?}, expected \"GGUF\")"),
            Self::UnsupportedVersion { version } if matches!(version.swap_bytes(), 2 | 3) => write!(
                f,
                "big-endian GGUF file; pinfer reads little-endian files only (convert it on a little-endian machine)"
            ),
            Self::UnsupportedVersion { version: 1 } => {
                write!(f, "GGUF version 1 is obsolete; convert the model again with a current llama.cpp")
            }
            Self::UnsupportedVersion { version } => {
                write!(f, "GGUF version {version} is not supported (versions 2 and 3 are)")
            }
            Self::Truncated { what, offset, needed } => write!(
                f,
                "file ends inside {what} (needs {needed} bytes at offset {offset}); the file is truncated: download it again"
            ),
            Self::TooLarge { what, offset, value, max } => {
                write!(f, "{what} at offset {offset} is {value}, more than the {max} allowed; {CORRUPT}")
            }
            Self::Invalid { what, offset, value } => {
                write!(f, "invalid {what} at offset {offset} (value {value}); {CORRUPT}")
            }
            Self::BadKey { key, problem } => write!(f, "metadata key {key:?}: {problem}; {CORRUPT}"),
            Self::BadTensor { name, problem, value } => {
                write!(f, "tensor {name:?}: {problem} ({value}); {CORRUPT}")
            }
            Self::MissingKey { key } => write!(f, "metadata key {key:?} is missing"),
            Self::WrongType { key, expected, found } => {
                write!(f, "metadata key {key:?} holds {found}, expected {expected}")
            }
            Self::BadValue { key, problem } => write!(f, "metadata key {key:?}: {problem}"),
        }
    }
}

impl core::error::Error for GgufError {}
