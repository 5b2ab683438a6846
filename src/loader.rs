//! std layer: opening model files.
//!
//! The file is mapped read-only and private; nothing is copied. Every later stage works on the
//! mapped bytes through the core parser.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::string::String;

use memmap2::{Mmap, MmapOptions};

use crate::gguf::{self, Header, HeaderError};

/// Where `scripts/setup.sh` puts the default model, relative to the repository root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The one command that fetches the default model.
pub const FETCH_MODEL_COMMAND: &str = "scripts/setup.sh model";

/// A model file mapped into memory.
pub struct ModelFile {
    path: PathBuf,
    map: Mmap,
}

/// Why a model file could not be opened.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError {
    /// The file could not be opened or mapped.
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The bytes are not an acceptable GGUF file.
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: HeaderError,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => {
                write!(f, "{}: no such file", path.display())?;
                if path.ends_with(DEFAULT_MODEL_PATH) || path == Path::new(DEFAULT_MODEL_PATH) {
                    write!(f, " (fetch the default model with `{FETCH_MODEL_COMMAND}`)")?;
                }
                Ok(())
            }
            Self::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Self::Header { path, source } => write!(f, "{}: {source}", path.display()),
        }
    }
}

impl std::error::Error for LoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Header { source, .. } => Some(source),
        }
    }
}

impl ModelFile {
    /// Maps `path` read-only and checks its GGUF header.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let io_err = |source| LoadError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and private. Another process truncating the file while we run
        // would fault on access; extents are checked against the file size before any tensor is read.
        let map = unsafe { MmapOptions::new().map_copy_read_only(&file) }.map_err(io_err)?;
        let model = Self { path: path.to_path_buf(), map };
        model.header()?;
        Ok(model)
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The file's path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checked fixed header.
    pub fn header(&self) -> Result<Header, LoadError> {
        gguf::read_header(&self.map).map_err(|source| LoadError::Header { path: self.path.clone(), source })
    }

    /// A short human summary: path, size, version and counts.
    pub fn summary(&self) -> Result<String, LoadError> {
        let h = self.header()?;
        Ok(std::format!(
            "{}: GGUF v{}, {:.1} MiB, {} tensors, {} metadata keys",
            self.path.display(),
            h.version,
            self.map.len() as f64 / (1024.0 * 1024.0),
            h.tensor_count,
            h.kv_count
        ))
    }
}
