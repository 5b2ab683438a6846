//! std layer: the repacked-weight cache (`pinfer repack IN OUT`).
//!
//! A cache is a GGUF file whose weight matrices are already in pinfer's packed layout
//! ([`crate::kernels::packed`]), so loading it only maps it: no repacking pass, no copy, no second
//! buffer. It keeps the original metadata and adds:
//!
//! - [`KEY_LAYOUT`] (u32): [`LAYOUT_VERSION`] of the packed bytes;
//! - [`KEY_ARCH`] (string): the CPU architecture it was made for (`std::env::consts::ARCH`);
//! - [`KEY_TENSORS`] (string): the names of the repacked tensors, one per line;
//! - [`KEY_NOTE`] (string): a warning for other tools;
//! - `general.alignment` = 64 (the planes are 64-byte aligned, as in the heap buffer);
//! - [`KEY_DATA_CRC`] (u32 array): the CRC-32 of every tensor's stored bytes, in file order, checked
//!   by [`verify_data`] (`pinfer verify`, and in the background while a cache runs);
//! - [`KEY_HEADER_CRC`] (u32, the last key): the CRC-32 of the bytes before the tensor data with
//!   this value's own four bytes read as zero, checked at every load ([`check_cache`]).
//!
//! Every tensor keeps its name, type and shape. A repacked tensor's data is its quant plane at the
//! tensor's offset, then its scale plane at the next 64-byte boundary; the next tensor starts after
//! that (aligned). Packed K-quants are larger than the type and shape say, so the GGUF parser's
//! extent checks do not cover the planes: [`cache_entries`] checks that both fit before the next
//! tensor (or the end of the file). Other tensors are copied unchanged. A tied embedding stays as
//! it is (for `get_rows`) and its packed form is added as `output.weight`, which the graph builder
//! prefers to the embedding for the output matmul.
//!
//! A cache made for another layout version or CPU architecture is refused with the command that
//! makes a new one; so is a cache whose repacked tensors differ from what this pinfer would repack,
//! and one whose checksums do not match (a disk or copy error: repack again, the original is fine).
//! The cache is written through [`OutputFile`]: a failed or concurrent run never leaves a partial
//! file at OUT.

use std::format;
use std::io::BufWriter;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::string::{String, ToString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::vec::Vec;

use crate::arena::ARENA_ALIGN;
use crate::engine::{EngineConfig, EngineError, Model};
use crate::exec::PackedEntry;
use crate::gguf::write::{GgufWriter, TensorHeader};
use crate::gguf::{Gguf, TensorInfo, Value};
use crate::kernels::packed::{pack, packed_bytes, PackedFormat, GROUP_ROWS, LAYOUT_VERSION};
use crate::loader::{LoadError, ModelFile};
use crate::output_file::OutputFile;
use crate::placement::{Buffer, Placement, Reason};

/// The packed layout version of a cache (u32; the loader recognises a cache by it).
pub use crate::loader::KEY_LAYOUT;
/// The CPU architecture a cache was made for (string).
pub const KEY_ARCH: &str = "pinfer.repack.arch";
/// The repacked tensors, one name per line (string).
pub const KEY_TENSORS: &str = "pinfer.repack.tensors";
/// A warning for other GGUF tools (string).
pub const KEY_NOTE: &str = "pinfer.repack.note";
/// CRC-32 of each tensor's stored bytes, in file order (u32 array).
pub const KEY_DATA_CRC: &str = "pinfer.repack.data_crc32";
/// CRC-32 of the header (u32; the last metadata key), its own value read as zero.
pub const KEY_HEADER_CRC: &str = "pinfer.repack.header_crc32";
/// The text of [`KEY_NOTE`].
pub const NOTE: &str = "pinfer repacked-weight cache: the tensors listed in pinfer.repack.tensors hold \
                        pinfer's packed layout, not their GGUF type's; other GGUF tools cannot read them \
                        (make one with `pinfer repack ORIGINAL.gguf OUT.gguf`)";

/// The architecture caches made here are for.
pub const ARCH: &str = std::env::consts::ARCH;

/// The placement of every tensor of `model` in a decode session with repacking on or off (what a
/// session decides, from the engine's decode graph): the tensors a cache repacks ([`write_cache`]),
/// and `pinfer info --placement`.
pub fn decode_placements(model: &ModelFile, repack: bool) -> Result<Vec<Placement>, EngineError> {
    let gguf = Gguf::parse(model.bytes()).map_err(EngineError::Gguf)?;
    let model = Model::from_gguf(model.bytes(), gguf)?;
    let n_ctx = (model.hparams().n_ctx_train as usize).clamp(1, 256);
    let config = EngineConfig { n_ctx, n_batch: 1, repack, ..EngineConfig::default() };
    let planned = crate::engine::heap::plan(model, &config)?;
    Ok(planned.model().gguf().tensors().map(|t| planned.placement_of(&t)).collect())
}

/// Whether `gguf` is a repacked-weight cache (of any version).
pub fn is_cache(gguf: &Gguf<'_>) -> bool {
    gguf.get(KEY_LAYOUT).is_some()
}

/// Refuses a cache made for another layout version or architecture; `Ok(false)` for a plain GGUF,
/// `Ok(true)` for a cache this pinfer reads.
pub fn check_cache(gguf: &Gguf<'_>, path: &Path) -> Result<bool, String> {
    if !is_cache(gguf) {
        return Ok(false);
    }
    let name = path.display();
    let layout = match gguf.get(KEY_LAYOUT).and_then(|v| v.as_integer()) {
        Some(v) => v.to_string(),
        None => "?".into(),
    };
    let arch = gguf.get_str_opt(KEY_ARCH).ok().flatten().unwrap_or("?");
    if layout != LAYOUT_VERSION.to_string() || arch != ARCH {
        return Err(format!(
            "{name} is a pinfer repack cache for layout {layout} on {arch}; this pinfer uses layout \
             {LAYOUT_VERSION} on {ARCH}: run `pinfer repack ORIGINAL.gguf {name}` again, or load the original"
        ));
    }
    let remake = format!("run `pinfer repack ORIGINAL.gguf {name}` again (the original is not affected)");
    let (Some(Value::U32(stored)), Some(KEY_HEADER_CRC)) = (gguf.get(KEY_HEADER_CRC), gguf.last_key()) else {
        return Err(format!(
            "{name}: a pinfer repack cache without its header checksum (made by an older pinfer): {remake}"
        ));
    };
    if header_crc(gguf) != Some(stored) {
        return Err(format!(
            "{name}: the cache's header does not match its checksum: the file is damaged: {remake}"
        ));
    }
    Ok(true)
}

/// CRC-32 of the bytes before the tensor data, the [`KEY_HEADER_CRC`] value read as zero.
fn header_crc(gguf: &Gguf<'_>) -> Option<u32> {
    let header = gguf.file_bytes().get(..gguf.data_start())?;
    let at = gguf.value_offset(KEY_HEADER_CRC)?;
    let mut h = crc32fast::Hasher::new();
    h.update(header.get(..at)?);
    h.update(&[0; 4]);
    h.update(header.get(at + 4..)?);
    Some(h.finalize())
}

/// Checks every tensor's stored bytes of cache `gguf` (read from `path`, already checked with
/// [`check_cache`]) against [`KEY_DATA_CRC`]; the error names the first damaged tensor. Reads the
/// whole file: run it off the critical path (`pinfer verify`, or a background thread).
pub fn verify_data(gguf: &Gguf<'_>, path: &Path) -> Result<usize, String> {
    let name = path.display();
    let remake = format!("run `pinfer repack ORIGINAL.gguf {name}` again (the original is not affected)");
    let crcs = gguf
        .get_array_opt(KEY_DATA_CRC, crate::gguf::ValueType::U32)
        .ok()
        .flatten()
        .filter(|a| a.len() == gguf.tensor_count())
        .ok_or_else(|| format!("{name}: the cache has no valid {KEY_DATA_CRC} list: {remake}"))?;
    let listed = gguf.get_str_opt(KEY_TENSORS).ok().flatten().unwrap_or("");
    let listed: Vec<&str> = listed.split('\n').filter(|s| !s.is_empty()).collect();
    let bytes = gguf.file_bytes();
    let mut checked = 0;
    for (i, t) in gguf.tensors().enumerate() {
        let size = if listed.contains(&t.name) {
            let format = PackedFormat::for_type(t.ty).ok_or_else(|| {
                format!("{name}: tensor {}: type {} has no packed layout: {remake}", t.name, t.ty)
            })?;
            let (k, rows) =
                matrix_shape(&t).ok_or_else(|| format!("{name}: tensor {}: shape: {remake}", t.name))?;
            planes_extent(format, rows, k).1
        } else {
            t.nbytes as usize
        };
        let start = gguf.data_start().saturating_add(t.offset as usize);
        let data = start.checked_add(size).and_then(|end| bytes.get(start..end)).ok_or_else(|| {
            format!("{name}: tensor {} runs past the end of the file: it is truncated: {remake}", t.name)
        })?;
        let want = match crcs.get_fixed(i) {
            Some(Value::U32(v)) => v,
            _ => return Err(format!("{name}: {KEY_DATA_CRC}[{i}] unreadable: {remake}")),
        };
        if crc32fast::hash(data) != want {
            return Err(format!(
                "{name}: tensor {}: its bytes do not match their checksum: the cache is damaged (a disk \
                 or copy error): {remake}",
                t.name
            ));
        }
        checked += size;
    }
    Ok(checked)
}

/// Elements per row and rows of a matrix to repack (stacked matrices count all their rows).
fn matrix_shape(t: &TensorInfo<'_>) -> Option<(usize, usize)> {
    let rows = t.ne[1].checked_mul(t.ne[2])?.checked_mul(t.ne[3])?;
    Some((usize::try_from(t.ne[0]).ok()?, usize::try_from(rows).ok()?))
}

/// Bytes from a packed tensor's start to its scale plane, and in all.
fn planes_extent(format: PackedFormat, rows: usize, k: usize) -> (usize, usize) {
    let (qn, sn) = packed_bytes(format, rows, k);
    let scales = qn.next_multiple_of(ARENA_ALIGN);
    (scales, scales + sn)
}

/// The packed matrices of cache `gguf` (checked with [`check_cache`]), in file order, pointing
/// into the file (`file_len` bytes) itself, and their bytes. `placements` are this pinfer's
/// placements of the cache's tensors: exactly the tensors it repacks must be stored repacked.
pub fn cache_entries(
    gguf: &Gguf<'_>,
    file_len: usize,
    placements: &[Placement],
    path: &Path,
) -> Result<(Vec<PackedEntry>, usize), String> {
    let name = path.display();
    let remake = format!("run `pinfer repack ORIGINAL.gguf {name}` again, or load the original");
    let again = format!("the cache was made by another pinfer version: {remake}");
    let listed =
        gguf.get_str_opt(KEY_TENSORS).ok().flatten().ok_or_else(|| {
            format!("{name}: pinfer repack cache without a valid {KEY_TENSORS} list; {again}")
        })?;
    let mut listed: Vec<&str> = listed.split('\n').filter(|s| !s.is_empty()).collect();
    listed.sort_unstable();
    let tensors: Vec<TensorInfo<'_>> = gguf.tensors().collect();
    if tensors.len() != gguf.tensor_count() || placements.len() != tensors.len() {
        return Err(format!("{name}: could not read every tensor info"));
    }
    let (mut entries, mut total, mut found) = (Vec::new(), 0usize, 0usize);
    for (i, (t, p)) in tensors.iter().zip(placements).enumerate() {
        let stored = listed.binary_search(&t.name).is_ok();
        found += usize::from(stored);
        let format = match (stored, p.buffer) {
            (false, Buffer::Repacked(_)) => {
                return Err(format!(
                    "{name}: tensor {} is not repacked in this cache, but this pinfer repacks it; {again}",
                    t.name
                ))
            }
            (false, _) => continue,
            (true, Buffer::Repacked(f)) if PackedFormat::for_type(t.ty) == Some(f) => f,
            (true, b) => {
                return Err(format!(
                    "{name}: tensor {} is stored repacked, but this pinfer places it {b} ({}); {again}",
                    t.name, p.reason
                ))
            }
        };
        let bad = |what: &str| format!("{name}: tensor {}: {what}; the cache is damaged: {remake}", t.name);
        let (k, rows) = matrix_shape(t).ok_or_else(|| bad("shape too large"))?;
        let start =
            gguf.data_start().checked_add(t.offset as usize).ok_or_else(|| bad("offset overflows"))?;
        if start % ARENA_ALIGN != 0 {
            return Err(bad("repacked planes not 64-byte aligned"));
        }
        let (scales, extent) = planes_extent(format, rows, k);
        let limit = match tensors.get(i + 1) {
            Some(next) => gguf.data_start().saturating_add(next.offset as usize).min(file_len),
            None => file_len,
        };
        if start.checked_add(extent).is_none_or(|end| end > limit) {
            let whom = if i + 1 < tensors.len() { "the next tensor's data" } else { "the end of the file" };
            return Err(format!(
                "{name}: tensor {}: its repacked planes ({extent} bytes) run past {whom}: the file is \
                 truncated or damaged; {remake}",
                t.name
            ));
        }
        entries.push(PackedEntry {
            source_offset: start,
            format,
            rows,
            k,
            quants_at: start,
            scales_at: start + scales,
        });
        total += extent;
    }
    if found != listed.len() {
        return Err(format!(
            "{name}: {KEY_TENSORS} names tensors the file lacks: the cache is damaged; {remake}"
        ));
    }
    Ok((entries, total))
}

/// What [`write_cache`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RepackReport {
    /// Matrices stored repacked.
    pub tensors: usize,
    /// Their bytes (planes and the padding between them).
    pub packed_bytes: usize,
    /// Whether a tied embedding got a repacked `output.weight`.
    pub tied_output: bool,
    /// Size of the input and of the output, in bytes.
    pub in_bytes: u64,
    /// Size of the output.
    pub out_bytes: u64,
    /// Seconds it took.
    pub seconds: f64,
}

/// What goes into the cache for one tensor.
#[derive(Clone, Copy)]
enum Data<'a> {
    /// The original bytes.
    Copy(&'a TensorInfo<'a>),
    /// The packed planes of this tensor.
    Packed(&'a TensorInfo<'a>, PackedFormat),
}

/// Why a repack cache could not be written or used.
#[derive(Debug)]
#[non_exhaustive]
pub enum CacheError {
    /// The input could not be opened or parsed.
    Load(LoadError),
    /// The input is not a model pinfer runs.
    Model(EngineError),
    /// The cache does not fit this pinfer (layout, CPU, tensors), is damaged, or could not be
    /// written: the message says which and what to do.
    Invalid(String),
    /// Stopped on request (SIGINT) before finishing; the output was left untouched.
    Interrupted,
}

impl std::fmt::Display for CacheError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Load(e) => write!(f, "{e}"),
            Self::Model(e) => write!(f, "{e}"),
            Self::Invalid(msg) => write!(f, "{msg}"),
            Self::Interrupted => write!(f, "interrupted"),
        }
    }
}

impl std::error::Error for CacheError {}

fn cache_error(msg: String) -> CacheError {
    CacheError::Invalid(msg)
}

/// Writes the repacked-weight cache of `input` to `output` (through [`OutputFile`]), packing each
/// matrix on up to `threads` threads. When `stop` becomes true (SIGINT), the run ends between two
/// tensors with [`CacheError::Interrupted`] and `output` untouched.
pub fn write_cache(
    input: &Path,
    output: &Path,
    threads: usize,
    stop: &AtomicBool,
) -> Result<RepackReport, CacheError> {
    let started = std::time::Instant::now();
    let model = ModelFile::open(input).map_err(CacheError::Load)?;
    // Checked before any work: the output must not be the input, a device, a directory, ...
    let mut out = OutputFile::create(output, &[input]).map_err(|e| cache_error(e.to_string()))?;
    let gguf = model.parse().map_err(CacheError::Load)?;
    let in_name = input.display();
    if is_cache(&gguf) {
        return Err(cache_error(format!(
            "{in_name} is already a pinfer repack cache: repack the original GGUF instead"
        )));
    }
    let placements = decode_placements(&model, true).map_err(CacheError::Model)?;
    let tensors: Vec<TensorInfo<'_>> = gguf.tensors().collect();
    if tensors.len() != gguf.tensor_count() {
        return Err(cache_error(format!("{in_name}: could not read every tensor info")));
    }

    let mut plan: Vec<(TensorHeader<'_>, Data<'_>)> = Vec::new();
    let mut tied = None;
    for (t, p) in tensors.iter().zip(&placements) {
        let header = TensorHeader { name: t.name, ty: t.ty, n_dims: t.n_dims, ne: t.ne };
        match (p.buffer, p.reason) {
            (Buffer::Repacked(f), Reason::TiedEmbedding) => {
                tied = Some((t, f));
                plan.push((header, Data::Copy(t)));
            }
            (Buffer::Repacked(f), _) => plan.push((header, Data::Packed(t, f))),
            (Buffer::Mapped | Buffer::Npu(_), _) => plan.push((header, Data::Copy(t))),
        }
    }
    if let Some((t, f)) = tied {
        if tensors.iter().any(|t| t.name == "output.weight") {
            return Err(cache_error(format!("{in_name}: a tied embedding and an output.weight")));
        }
        let header = TensorHeader { name: "output.weight", ty: t.ty, n_dims: t.n_dims, ne: t.ne };
        plan.push((header, Data::Packed(t, f)));
    }
    let mut sizes = Vec::with_capacity(plan.len());
    let mut names = String::new();
    let (mut n_packed, mut packed_total) = (0, 0);
    for (h, d) in &plan {
        sizes.push(match *d {
            Data::Copy(t) => t.nbytes,
            Data::Packed(t, f) => {
                let (k, rows) = matrix_shape(t).ok_or_else(|| cache_error(format!("{}: shape", t.name)))?;
                let (_, extent) = planes_extent(f, rows, k);
                names.push_str(h.name);
                names.push('\n');
                n_packed += 1;
                packed_total += extent;
                extent as u64
            }
        });
    }

    let mut metadata: Vec<(&str, Value<'_>)> = gguf.metadata().collect();
    if metadata.len() as u64 != gguf.header().kv_count {
        return Err(cache_error(format!("{in_name}: could not read every metadata value")));
    }
    let alignment = Value::U32(ARENA_ALIGN as u32);
    match metadata.iter_mut().find(|(k, _)| *k == "general.alignment") {
        Some(kv) => kv.1 = alignment,
        None => metadata.push(("general.alignment", alignment)),
    }
    metadata.push((KEY_LAYOUT, Value::U32(LAYOUT_VERSION)));
    metadata.push((KEY_ARCH, Value::String(ARCH.as_bytes())));
    metadata.push((KEY_TENSORS, Value::String(names.as_bytes())));
    metadata.push((KEY_NOTE, Value::String(NOTE.as_bytes())));
    // Placeholders, patched once the data is written; the header checksum must be the last key.
    let zeros = std::vec![0u8; 4 * plan.len()];
    let crc_array = Value::Array(crate::gguf::ArrayView::of_u32(&zeros));
    metadata.push((KEY_DATA_CRC, crc_array));
    metadata.push((KEY_HEADER_CRC, Value::U32(0)));

    let headers: Vec<TensorHeader<'_>> = plan.iter().map(|(h, _)| *h).collect();
    let out_bytes = write_file(&mut out, &model, &gguf, &plan, &headers, &sizes, &metadata, threads, stop)?;
    // A stop during the flush and the check still leaves the output as it was.
    if stop.load(Ordering::Relaxed) {
        return Err(CacheError::Interrupted);
    }
    out.commit().map_err(|e| cache_error(e.to_string()))?;
    Ok(RepackReport {
        tensors: n_packed,
        packed_bytes: packed_total,
        tied_output: tied.is_some(),
        in_bytes: model.bytes().len() as u64,
        out_bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Writes the cache to `out`'s temporary file with its checksums, then checks it reads back as a
/// cache with these tensors and these bytes.
#[allow(clippy::too_many_arguments)]
fn write_file(
    out: &mut OutputFile,
    model: &ModelFile,
    gguf: &Gguf<'_>,
    plan: &[(TensorHeader<'_>, Data<'_>)],
    headers: &[TensorHeader<'_>],
    sizes: &[u64],
    metadata: &[(&str, Value<'_>)],
    threads: usize,
    stop: &AtomicBool,
) -> Result<u64, CacheError> {
    let path = out.tmp_path().to_path_buf();
    let target = out.target().display().to_string();
    let io_err = |e: std::io::Error| cache_error(format!("writing {target}: {e}"));
    let file = out.try_clone_file().map_err(|e| cache_error(e.to_string()))?;
    let buffered = BufWriter::with_capacity(1 << 20, file);
    let mut writer = GgufWriter::start_sized(buffered, metadata, headers, sizes).map_err(io_err)?;
    let mut crcs = Vec::with_capacity(plan.len());
    for ((_, data), &size) in plan.iter().zip(sizes) {
        if stop.load(Ordering::Relaxed) {
            return Err(CacheError::Interrupted);
        }
        match *data {
            Data::Copy(t) => {
                let bytes = gguf.tensor_data(t);
                crcs.push(crc32fast::hash(bytes));
                writer.write_tensor_data(bytes).map_err(io_err)?
            }
            Data::Packed(t, format) => {
                let bytes = pack_planes(t, gguf.tensor_data(t), format, size as usize, threads)
                    .ok_or_else(|| cache_error(format!("{target}: tensor {}: repacking failed", t.name)))?;
                crcs.push(crc32fast::hash(&bytes));
                writer.write_tensor_data(&bytes).map_err(io_err)?;
            }
        }
        // Read once: give the source pages back (a board may not hold input and output at once).
        let (Data::Copy(t) | Data::Packed(t, _)) = *data;
        let start = gguf.data_start() + t.offset as usize;
        model.release(start..start + t.nbytes as usize);
    }
    let (buf, len) = writer.finish().map_err(io_err)?;
    let file = buf.into_inner().map_err(|e| io_err(e.into_error()))?;
    patch_checksums(&file, &path, &crcs).map_err(io_err)?;
    file.sync_all().map_err(io_err)?;

    let back = ModelFile::open(&path).map_err(CacheError::Load)?;
    let check = back.parse().map_err(CacheError::Load)?;
    let ok = check_cache(&check, &path).map_err(cache_error)?
        && check.tensor_count() == headers.len()
        && check.tensors().zip(headers).all(|(t, h)| t.name == h.name && t.ty == h.ty && t.ne == h.ne);
    if !ok {
        return Err(cache_error(format!("{target}: the written file does not read back as planned")));
    }
    verify_data(&check, &path).map_err(cache_error)?;
    Ok(len)
}

/// Writes the data checksums and then the header checksum into their placeholders in `file`
/// (the cache at `path`, complete but for them).
fn patch_checksums(file: &std::fs::File, path: &Path, crcs: &[u32]) -> std::io::Result<()> {
    let bad = || std::io::Error::other("the written header does not read back");
    let (data_at, header_at, header_len) = {
        let written = ModelFile::open(path).map_err(|e| std::io::Error::other(e.to_string()))?;
        let g = written.parse().map_err(|e| std::io::Error::other(e.to_string()))?;
        // An array value starts with its element type (4 bytes) and length (8).
        let data_at = g.value_offset(KEY_DATA_CRC).ok_or_else(bad)? + 12;
        (data_at, g.value_offset(KEY_HEADER_CRC).ok_or_else(bad)?, g.data_start())
    };
    let crc_bytes: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
    file.write_all_at(&crc_bytes, data_at as u64)?;
    let mut header = std::vec![0u8; header_len];
    file.read_exact_at(&mut header, 0)?;
    header.get_mut(header_at..header_at + 4).ok_or_else(bad)?.fill(0);
    file.write_all_at(&crc32fast::hash(&header).to_le_bytes(), header_at as u64)
}

/// The planes of `t` (data `src`) packed as `format`: quants, zeros up to 64-byte alignment,
/// scales (`size` bytes in all). Threads take whole row groups.
fn pack_planes(
    t: &TensorInfo<'_>,
    src: &[u8],
    format: PackedFormat,
    size: usize,
    threads: usize,
) -> Option<Vec<u8>> {
    let (k, rows) = matrix_shape(t)?;
    let (scales_at, extent) = planes_extent(format, rows, k);
    if extent != size {
        return None;
    }
    let row_bytes = t.ty.bytes_for(k as u64)? as usize;
    if src.len() != row_bytes.checked_mul(rows)? {
        return None;
    }
    let mut out = std::vec![0u8; size];
    let (quants, scales) = out.split_at_mut(scales_at);
    let (qn, _) = packed_bytes(format, rows, k);
    let groups = rows.div_ceil(GROUP_ROWS);
    let chunk_rows = groups.div_ceil(threads.clamp(1, 64)).max(1) * GROUP_ROWS;
    let (qc, sc) = packed_bytes(format, chunk_rows, k);
    let ok = std::thread::scope(|s| {
        let workers: Vec<_> = src
            .chunks(chunk_rows * row_bytes)
            .zip(quants[..qn].chunks_mut(qc))
            .zip(scales.chunks_mut(sc))
            .map(|((src, q), sc)| {
                let n = src.len() / row_bytes;
                s.spawn(move || pack(t.ty, src, n, k, q, sc).is_ok())
            })
            .collect();
        workers.into_iter().all(|w| w.join().unwrap_or(false))
    });
    ok.then_some(out)
}
