//! std layer: writing a file the user named without ever losing one.
//!
//! Every file pinfer writes (quantize, repack, npu-plan) goes through [`OutputFile`]:
//!
//! - the output is checked before anything is written: it must be absent or a regular file (a
//!   symbolic link is followed to the file it names, and that file is replaced, the link kept),
//!   never a directory, device, FIFO or socket, and never one of the inputs (same device and inode,
//!   through any path, hard link or symbolic link);
//! - the bytes go to a new temporary file beside the output, created with `O_EXCL` under a name no
//!   other run uses, so a planted symbolic link or another run's file is never opened;
//! - [`OutputFile::commit`] flushes it to disk, checks the output again, and renames the temporary
//!   file over it, then flushes the directory. Until then the output is untouched; a failed or
//!   interrupted run removes its temporary file (on drop). Two concurrent runs each rename a
//!   complete file: the output is one of them, never a mix.
//!
//! Inputs are refused before they are opened when they are not regular files ([`check_input`]): a
//! FIFO would block the open forever, a device would be read as a model.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::string::String;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::{fmt, format};

/// Why an output could not be written.
#[derive(Debug)]
pub enum OutputError {
    /// The path cannot be an output as it is (a device, a directory, an input, ...).
    Refused {
        /// The path as given.
        path: PathBuf,
        /// What is wrong, in words.
        why: String,
    },
    /// The OS refused an operation on the path.
    Io {
        /// The path concerned.
        path: PathBuf,
        /// What pinfer was doing.
        doing: &'static str,
        /// What the OS said.
        source: io::Error,
    },
}

impl fmt::Display for OutputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused { path, why } => write!(f, "{}: {why}", path.display()),
            Self::Io { path, doing, source } => write!(f, "{}: {doing}: {source}", path.display()),
        }
    }
}

impl std::error::Error for OutputError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Refused { .. } => None,
        }
    }
}

/// What a non-regular file is, for messages.
fn kind_of(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// Refuses an input that is not a regular file (after following symbolic links), before it is
/// opened: opening a FIFO blocks until a writer comes, and a device is not a model.
pub fn check_input(path: &Path) -> Result<(), OutputError> {
    let meta = std::fs::metadata(path).map_err(|source| OutputError::Io {
        path: path.into(),
        doing: "reading",
        source,
    })?;
    if meta.file_type().is_file() {
        return Ok(());
    }
    Err(OutputError::Refused {
        path: path.into(),
        why: format!("is {}, not a regular file: give a model file", kind_of(meta.file_type())),
    })
}

/// The file `target` names once symbolic links are followed, and whether it exists. A dangling
/// link is refused: pinfer would have to create a file somewhere the user did not name.
fn resolve(target: &Path) -> Result<(PathBuf, Option<std::fs::Metadata>), OutputError> {
    let io_err = |source| OutputError::Io { path: target.into(), doing: "checking the output", source };
    match std::fs::symlink_metadata(target) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((target.into(), None)),
        Err(e) => Err(io_err(e)),
        Ok(m) if m.file_type().is_symlink() => match std::fs::canonicalize(target) {
            Ok(real) => {
                let meta = std::fs::symlink_metadata(&real).map_err(io_err)?;
                Ok((real, Some(meta)))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(OutputError::Refused {
                path: target.into(),
                why: "is a symbolic link to a missing file: give the path of the file to write".into(),
            }),
            Err(e) => Err(io_err(e)),
        },
        Ok(m) => Ok((target.into(), Some(m))),
    }
}

/// Checks that `real` (resolved from `target`, with its metadata) may be replaced, and is none of
/// `inputs`.
fn check_replaceable(
    target: &Path,
    meta: Option<&std::fs::Metadata>,
    inputs: &[(PathBuf, u64, u64)],
) -> Result<(), OutputError> {
    let Some(meta) = meta else { return Ok(()) };
    if !meta.file_type().is_file() {
        return Err(OutputError::Refused {
            path: target.into(),
            why: format!("is {}: pinfer writes only regular files", kind_of(meta.file_type())),
        });
    }
    if std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o222 == 0 {
        return Err(OutputError::Refused {
            path: target.into(),
            why: "is read-only: make it writable (chmod u+w) or give another output".into(),
        });
    }
    if let Some((input, _, _)) = inputs.iter().find(|(_, dev, ino)| (*dev, *ino) == (meta.dev(), meta.ino()))
    {
        return Err(OutputError::Refused {
            path: target.into(),
            why: format!("is the input {} (the same file): give another output", input.display()),
        });
    }
    Ok(())
}

/// A file being written in place of `target`: see the module documentation.
#[derive(Debug)]
pub struct OutputFile {
    /// The path as the user gave it (for messages).
    target: PathBuf,
    /// The file that will be replaced (symbolic links followed).
    real: PathBuf,
    /// The temporary file beside it.
    tmp: PathBuf,
    file: File,
    /// Device and inode of each input, to refuse replacing one.
    inputs: std::vec::Vec<(PathBuf, u64, u64)>,
    /// The slot in [`PENDING`] naming `tmp`, if one was free.
    pending: Option<usize>,
}

/// Distinguishes the temporary files of one process.
static NEXT_TMP: AtomicU32 = AtomicU32::new(0);

/// Temporary files being written, as C strings, for a signal handler to remove before the process
/// exits ([`remove_pending_temporaries`]). The strings are leaked, never freed: a handler running
/// on another thread may still read one after its file was committed (a few bytes per output).
static PENDING: [AtomicPtr<nix::libc::c_char>; 4] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 4];

/// Records `tmp` for [`remove_pending_temporaries`]; its slot, if one was free.
fn register_pending(tmp: &Path) -> Option<usize> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(tmp.as_os_str().as_bytes()).ok()?;
    let ptr = c.into_raw();
    let slot = PENDING.iter().position(|p| {
        p.compare_exchange(std::ptr::null_mut(), ptr, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    });
    if slot.is_none() {
        // SAFETY: `ptr` came from `CString::into_raw` just above and was never shared.
        drop(unsafe { std::ffi::CString::from_raw(ptr) });
    }
    slot
}

/// Takes a path off [`PENDING`] (its string stays leaked: a handler may be reading it).
fn unlist(slot: Option<usize>) {
    if let Some(slot) = slot {
        PENDING[slot].store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

/// Removes every temporary file still being written. Async-signal-safe (atomics and `unlink`
/// only): a SIGINT/SIGTERM/SIGHUP handler calls it before `_exit`, which skips destructors.
pub fn remove_pending_temporaries() {
    for p in &PENDING {
        let path = p.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !path.is_null() {
            // SAFETY: `path` is a leaked, NUL-terminated CString (register_pending), never freed.
            unsafe { nix::libc::unlink(path) };
        }
    }
}

/// Most bytes of a file name (Linux's NAME_MAX).
const NAME_MAX: usize = 255;

impl OutputFile {
    /// Checks that `target` may be written and is none of `inputs`, and creates the temporary file
    /// that will replace it.
    pub fn create(target: &Path, inputs: &[&Path]) -> Result<Self, OutputError> {
        let mut ids = std::vec::Vec::new();
        for input in inputs {
            let meta = std::fs::metadata(input).map_err(|source| OutputError::Io {
                path: input.into(),
                doing: "reading",
                source,
            })?;
            ids.push((input.to_path_buf(), meta.dev(), meta.ino()));
        }
        let (real, meta) = resolve(target)?;
        check_replaceable(target, meta.as_ref(), &ids)?;
        let name = real.file_name().ok_or_else(|| OutputError::Refused {
            path: target.into(),
            why: "names no file (it ends in '..' or '/')".into(),
        })?;
        let dir = match real.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // The permissions the output has now, given to its replacement.
        let mode = meta.as_ref().map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777);
        let mut last_err = None;
        for _ in 0..16 {
            let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let suffix = format!(".pinfer-{}-{n}-{nanos:x}.tmp", std::process::id());
            // "." + as much of the name as fits + the suffix, within NAME_MAX bytes.
            use std::os::unix::ffi::OsStrExt;
            let keep = name.as_bytes().len().min(NAME_MAX - 1 - suffix.len());
            let mut tmp_name = std::ffi::OsString::from(".");
            tmp_name.push(std::ffi::OsStr::from_bytes(&name.as_bytes()[..keep]));
            tmp_name.push(&suffix);
            let tmp = dir.join(tmp_name);
            // Listed for the signal handlers before it exists: a signal arriving just after the
            // file is created must find it (CI saw one left by a SIGTERM in that window).
            let pending = register_pending(&tmp);
            // create_new is O_CREAT|O_EXCL: it never follows a symbolic link and never opens a
            // file that exists, so nothing but this run's own new file is written.
            match OpenOptions::new().read(true).write(true).create_new(true).open(&tmp) {
                Ok(file) => {
                    let out = Self { target: target.into(), real, tmp, file, inputs: ids, pending };
                    if let Some(mode) = mode {
                        let perms = std::os::unix::fs::PermissionsExt::from_mode(mode);
                        if let Err(source) = out.file.set_permissions(perms) {
                            // Dropping `out` removes the file and takes it off the list.
                            let path = out.tmp.clone();
                            drop(out);
                            return Err(OutputError::Io { path, doing: "setting permissions", source });
                        }
                    }
                    return Ok(out);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    unlist(pending);
                    last_err = Some(e);
                }
                Err(source) => {
                    unlist(pending);
                    return Err(OutputError::Io {
                        path: dir,
                        doing: "creating a temporary file in the output's directory",
                        source,
                    });
                }
            }
        }
        Err(OutputError::Io {
            path: dir,
            doing: "creating a temporary file (every name tried exists)",
            source: last_err.unwrap_or_else(|| io::Error::other("name clash")),
        })
    }

    /// The temporary file, to write to.
    pub fn file(&mut self) -> &File {
        &self.file
    }

    /// A handle of the temporary file for a buffered writer (the same open file).
    pub fn try_clone_file(&self) -> Result<File, OutputError> {
        self.file.try_clone().map_err(|source| OutputError::Io {
            path: self.tmp.clone(),
            doing: "opening",
            source,
        })
    }

    /// Where the bytes go until [`commit`](Self::commit).
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// The output as the user named it.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Flushes the written bytes to disk and replaces the output with them. The output is checked
    /// again first: if it became something that must not be replaced meanwhile, it is left alone.
    pub fn commit(mut self) -> Result<(), OutputError> {
        let io_err = |path: &Path, doing, source| OutputError::Io { path: path.into(), doing, source };
        self.file.sync_all().map_err(|e| io_err(&self.tmp, "flushing to disk", e))?;
        let (real, meta) = resolve(&self.target)?;
        if real != self.real {
            return Err(OutputError::Refused {
                path: self.target.clone(),
                why: "changed into a link to another file while pinfer wrote it: left as it is".into(),
            });
        }
        check_replaceable(&self.target, meta.as_ref(), &self.inputs)?;
        std::fs::rename(&self.tmp, &self.real).map_err(|e| io_err(&self.real, "replacing it", e))?;
        self.forget_pending();
        // The rename is durable once the directory is flushed (best effort: some filesystems
        // refuse to sync a directory).
        if let Some(dir) = self.real.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl OutputFile {
    /// Takes `tmp` off the list a signal handler removes.
    fn forget_pending(&mut self) {
        unlist(self.pending.take());
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        self.forget_pending();
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
