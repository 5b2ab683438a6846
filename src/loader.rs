//! std layer: opening model files.
//!
//! The file is mapped read-only and private; nothing is copied. The core parser then validates
//! every tensor extent against the mapped length (the file size), so a truncated file is an
//! error before any tensor byte is touched, never a SIGBUS later.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::string::{String, ToString};
use std::vec::Vec;

use memmap2::{Mmap, MmapOptions};

use crate::gguf::{Gguf, GgufError};

/// Where `scripts/setup.sh` puts the default model, relative to the repository root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The one command that fetches the default model.
pub const FETCH_MODEL_COMMAND: &str = "scripts/setup.sh model";

/// The key a repack cache ([`crate::repack_cache`]) holds its packed layout version in: a file
/// that has it and does not parse is a damaged cache.
pub const KEY_LAYOUT: &str = "pinfer.repack.layout";

/// A model file mapped into memory (or read into it: [`ModelFile::read`]).
pub struct ModelFile {
    path: PathBuf,
    /// Where the model starts in the file: 0, or its offset in a bundle ([`crate::bundle`]).
    offset: u64,
    map: Bytes,
}

/// The file's bytes: a private read-only mapping, or a copy on the heap (`--no-mmap`).
enum Bytes {
    Map(Mmap),
    /// 64-byte blocks, so tensor data keeps the alignment it has in the file; `len` bytes are
    /// the file.
    Heap {
        blocks: Vec<Block>,
        len: usize,
    },
}

/// 64 bytes aligned to 64: the unit of the heap copy.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([u8; 64]);

impl core::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Heap { blocks, len } => &bytemuck::cast_slice::<Block, u8>(blocks)[..*len],
        }
    }
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
    /// The bytes are not an acceptable GGUF file, or lack what the model needs.
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: GgufError,
    },
    /// A pinfer executable that carries no model, or a bundle that is truncated or damaged.
    Bundle {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A repack cache (a file pinfer wrote) that no longer parses: damaged after it was written.
    DamagedCache {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: GgufError,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => {
                write!(f, "{}: no such file", path.display())?;
                if path.ends_with(DEFAULT_MODEL_PATH) {
                    write!(f, " (fetch the default model with `{FETCH_MODEL_COMMAND}`)")?;
                }
                Ok(())
            }
            Self::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Self::Gguf { path, source } => write!(f, "{}: {source}", path.display()),
            Self::Bundle { path, why } => write!(f, "{}: {why}", path.display()),
            Self::DamagedCache { path, source } => {
                // The parser's advice is for downloaded models; a cache is remade, not downloaded.
                let text = source.to_string();
                let what = ["; the file is", ": download", "; download"]
                    .iter()
                    .filter_map(|cut| text.find(cut))
                    .min()
                    .map_or(text.as_str(), |at| &text[..at]);
                write!(
                    f,
                    "{}: {what}: this pinfer repack cache is damaged: run `pinfer repack ORIGINAL.gguf {}` \
                     again (the original is not affected)",
                    path.display(),
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for LoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Gguf { source, .. } | Self::DamagedCache { source, .. } => Some(source),
            Self::Bundle { .. } => None,
        }
    }
}

impl ModelFile {
    /// Maps `path` read-only: a model file, or the model a pinfer bundle carries (an executable
    /// with a model appended, [`crate::bundle`]: its trailer and header checksum are checked
    /// before any model byte is used).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io_err = |source| LoadError::Io { path: path.to_path_buf(), source };
        let not_regular =
            |what: String| LoadError::Io { path: path.to_path_buf(), source: std::io::Error::other(what) };
        // A FIFO or device is refused before it is opened (opening a FIFO waits for a writer);
        // O_NONBLOCK and the second check cover a file swapped in between.
        crate::output_file::check_input(path).map_err(|e| match e {
            crate::output_file::OutputError::Io { source, .. } => io_err(source),
            crate::output_file::OutputError::Refused { why, .. } => not_regular(why),
        })?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(path)
            .map_err(io_err)?;
        if !file.metadata().map_err(io_err)?.is_file() {
            return Err(not_regular("is not a regular file: give a model file".into()));
        }
        let bundle_err = |why: String| LoadError::Bundle { path: path.to_path_buf(), why };
        let mut file = file;
        let region =
            match crate::bundle::inspect(&mut file).map_err(bundle_err)? {
                crate::bundle::Contents::NotElf => None,
                crate::bundle::Contents::Plain => return Err(bundle_err(
                    "is a program, not a model file (a pinfer bundle carries one; this file carries none): \
                     give a GGUF model"
                        .into(),
                )),
                crate::bundle::Contents::Bundle(t) => Some(t),
            };
        let mut options = MmapOptions::new();
        if let Some(t) = &region {
            let len = usize::try_from(t.model_len)
                .map_err(|_| bundle_err("the bundled model is too large".into()))?;
            options.offset(t.model_offset).len(len);
        }
        // SAFETY: the map is read-only and private, and only ever read through `&[u8]`. If another
        // process truncates the file while we run, access faults (SIGBUS) instead of reading stale
        // data; that is the documented limit of mmap loading (download to .part, then rename).
        let map = unsafe { options.map_copy_read_only(&file) }.map_err(io_err)?;
        if let Some(t) = &region {
            crate::bundle::check_header(t, &map).map_err(bundle_err)?;
        }
        let offset = region.map_or(0, |t| t.model_offset);
        Ok(Self { path: path.to_path_buf(), offset, map: Bytes::Map(map) })
    }

    /// Reads `path` into memory instead of mapping it (llama.cpp's `--no-mmap`): no page faults
    /// into the file later, and the file may change afterwards; costs a copy at load.
    pub fn read(path: &Path) -> Result<Self, LoadError> {
        use std::io::Read;
        let mapped = Self::open(path)?; // the same checks, and the length
        let len = mapped.map.len();
        let io_err = |source| LoadError::Io { path: path.to_path_buf(), source };
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(len.div_ceil(64)).map_err(|_| {
            io_err(std::io::Error::other(std::format!("cannot allocate {len} bytes to read the model into")))
        })?;
        blocks.resize(len.div_ceil(64), Block([0; 64]));
        let mut file = File::open(path).map_err(io_err)?;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(mapped.offset)).map_err(io_err)?;
        file.read_exact(&mut bytemuck::cast_slice_mut::<Block, u8>(&mut blocks)[..len]).map_err(io_err)?;
        Ok(Self { path: path.to_path_buf(), offset: mapped.offset, map: Bytes::Heap { blocks, len } })
    }

    /// A copy of `bytes` in memory as a model named `name` (the C ABI's open-from-memory: the
    /// caller's buffer may be freed afterwards). The GGUF checks happen at [`ModelFile::parse`].
    pub fn from_bytes(bytes: &[u8], name: &Path) -> Result<Self, LoadError> {
        let len = bytes.len();
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(len.div_ceil(64)).map_err(|_| LoadError::Io {
            path: name.to_path_buf(),
            source: std::io::Error::other(std::format!("cannot allocate {len} bytes for the model")),
        })?;
        blocks.resize(len.div_ceil(64), Block([0; 64]));
        bytemuck::cast_slice_mut::<Block, u8>(&mut blocks)[..len].copy_from_slice(bytes);
        Ok(Self { path: name.to_path_buf(), offset: 0, map: Bytes::Heap { blocks, len } })
    }

    /// [`ModelFile::read`] for the rest of the process (as [`ModelFile::open_static`]).
    pub fn read_static(path: &Path) -> Result<&'static Self, LoadError> {
        Ok(std::boxed::Box::leak(std::boxed::Box::new(Self::read(path)?)))
    }

    /// Maps `path` for the rest of the process: the model, its parsed view and everything
    /// borrowing from it (tokenizer tables, graphs) then live as long as the program.
    pub fn open_static(path: &Path) -> Result<&'static Self, LoadError> {
        Ok(std::boxed::Box::leak(std::boxed::Box::new(Self::open(path)?)))
    }

    /// Parses and validates the GGUF structure (header, metadata, tensor infos and extents).
    pub fn parse(&self) -> Result<Gguf<'_>, LoadError> {
        Gguf::parse(&self.map).map_err(|source| {
            // A cache names itself in its header: the remedy is to repack, not to download.
            // (after the vocabulary: search the first 64 MiB; this is the error path only).
            let head = &self.map[..self.map.len().min(64 << 20)];
            let key = KEY_LAYOUT.as_bytes();
            if head.windows(key.len()).any(|w| w == key) {
                LoadError::DamagedCache { path: self.path.clone(), source }
            } else {
                self.error(source)
            }
        })
    }

    /// Wraps a parser or validation error with this file's path.
    pub fn error(&self, source: GgufError) -> LoadError {
        LoadError::Gguf { path: self.path.clone(), source }
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The file's path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tells the kernel the pages of `range` are not needed now (weights that were repacked into
    /// another buffer), so they leave the resident set; a later read faults them in again from
    /// the file. Best effort: errors are ignored.
    pub fn release(&self, range: core::ops::Range<usize>) {
        let page = 4096;
        let start = range.start.next_multiple_of(page);
        let end = range.end.min(self.map.len()) / page * page;
        let Bytes::Map(map) = &self.map else { return };
        if end > start {
            // SAFETY: the mapping is private and read-only (never written), so dropping its pages
            // only discards clean copies of the file; later reads see the same bytes again.
            let _ =
                unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }
}
