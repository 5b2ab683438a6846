//! GGUF files, read over `&[u8]`.
//!
//! For now only the fixed header is read (enough for `pinfer info`); the full validating parser
//! arrives with the GGUF loader issue.

use core::fmt;

/// `GGUF` in file order, read as a little-endian u32.
pub const GGUF_MAGIC: u32 = u32::from_le_bytes(*b"GGUF");

/// The fixed-size start of a GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Format version (2 or 3 are supported).
    pub version: u32,
    /// Number of tensor infos that follow the metadata.
    pub tensor_count: u64,
    /// Number of metadata key/value pairs.
    pub kv_count: u64,
}

/// Why a file's header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// Fewer than the 24 bytes a GGUF header takes.
    TooShort {
        /// Bytes available.
        len: usize,
    },
    /// The first four bytes are not `GGUF`.
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version other than 2 or 3.
    UnsupportedVersion {
        /// The version field as read (little-endian).
        version: u32,
    },
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len } => {
                write!(f, "file is {len} bytes, too short for a GGUF header (24 bytes)")
            }
            Self::BadMagic { found } => write!(f, "not a GGUF file (magic {found:02x?}, expected \"GGUF\")"),
            Self::UnsupportedVersion { version }
                if version.swap_bytes() == 2 || version.swap_bytes() == 3 =>
            {
                write!(
                    f,
                    "big-endian GGUF files are not supported; convert the model on a little-endian machine"
                )
            }
            Self::UnsupportedVersion { version: 1 } => {
                write!(f, "GGUF version 1 is not supported; re-convert the model with a current llama.cpp")
            }
            Self::UnsupportedVersion { version } => {
                write!(f, "GGUF version {version} is not supported (2 and 3 are)")
            }
        }
    }
}

impl core::error::Error for HeaderError {}

/// Reads and checks the fixed header at the start of `bytes`.
pub fn read_header(bytes: &[u8]) -> Result<Header, HeaderError> {
    let Some(head) = bytes.get(..24) else {
        return Err(HeaderError::TooShort { len: bytes.len() });
    };
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
    if u32_at(0) != GGUF_MAGIC {
        return Err(HeaderError::BadMagic { found: [head[0], head[1], head[2], head[3]] });
    }
    let version = u32_at(4);
    if version != 2 && version != 3 {
        return Err(HeaderError::UnsupportedVersion { version });
    }
    Ok(Header { version, tensor_count: u64_at(8), kv_count: u64_at(16) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_bytes(magic: &[u8; 4], version: u32, tensors: u64, kvs: u64) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..4].copy_from_slice(magic);
        b[4..8].copy_from_slice(&version.to_le_bytes());
        b[8..16].copy_from_slice(&tensors.to_le_bytes());
        b[16..24].copy_from_slice(&kvs.to_le_bytes());
        b
    }

    #[test]
    fn reads_v3_header() {
        let b = header_bytes(b"GGUF", 3, 272, 31);
        assert_eq!(read_header(&b), Ok(Header { version: 3, tensor_count: 272, kv_count: 31 }));
    }

    #[test]
    fn refuses_short_foreign_old_and_big_endian_files() {
        assert_eq!(read_header(&[0u8; 10]), Err(HeaderError::TooShort { len: 10 }));
        assert!(matches!(read_header(&header_bytes(b"GGML", 3, 0, 0)), Err(HeaderError::BadMagic { .. })));
        let v1 = read_header(&header_bytes(b"GGUF", 1, 0, 0)).unwrap_err();
        assert_eq!(v1, HeaderError::UnsupportedVersion { version: 1 });
        let be = read_header(&header_bytes(b"GGUF", 3u32.swap_bytes(), 0, 0)).unwrap_err();
        let mut msg = heapless::String::<128>::new();
        fmt::write(&mut msg, format_args!("{be}")).unwrap();
        assert!(msg.contains("big-endian"), "{msg}");
    }
}
