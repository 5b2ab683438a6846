//! GGUF files, parsed and validated over `&[u8]` without allocating.
//!
//! [`Gguf::parse`] walks the whole header, metadata and tensor-info section once and checks every
//! count, length, type, shape and extent against the bytes that are really there, with checked
//! arithmetic, before anything is used. What it keeps is small and fixed-size: the positions of
//! the metadata values and tensor infos. Accessors decode from the file bytes on demand.
//!
//! The rules come from the attacks listed in `docs/gguf-hostile-input.md`: counts bounded by the
//! bytes left, strings and names bounded, array nesting bounded, value and tensor types from an
//! allow-list, shapes with non-zero dims and checked products, offsets aligned, in order, not
//! overlapping and inside the file.

mod error;
mod value;
mod value_type;
#[cfg(feature = "std")]
pub mod write;

use core::str;

pub use error::{GgufError, Name};
pub use value::{ArrayIter, ArrayView, Value, MAX_ARRAY_DEPTH, MAX_STRING_LEN};
pub use value_type::ValueType;

use crate::quant::GgmlType;
pub(crate) use error::name_of;
use value::Reader;

/// `GGUF` in file order, read as a little-endian u32.
pub const GGUF_MAGIC: u32 = u32::from_le_bytes(*b"GGUF");
/// Most metadata keys accepted (real models have 20 to 60).
pub const MAX_KV: usize = 512;
/// Most tensors accepted (the largest public models have about 1500).
pub const MAX_TENSORS: usize = 8192;
/// Longest metadata key, in bytes.
pub const MAX_KEY_LEN: u64 = 256;
/// Longest tensor name, in bytes (ggml keeps names in 64-byte buffers with a NUL).
pub const MAX_TENSOR_NAME_LEN: u64 = 63;
/// Most dimensions of a tensor.
pub const MAX_DIMS: usize = 4;
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;
/// Accepted range of `general.alignment` (a power of two).
pub const ALIGNMENT_RANGE: core::ops::RangeInclusive<u32> = 8..=65536;

/// The fixed-size start of a GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Format version (2 or 3).
    pub version: u32,
    /// Number of tensor infos.
    pub tensor_count: u64,
    /// Number of metadata key/value pairs.
    pub kv_count: u64,
}

/// Reads and checks the magic and version at the start of `bytes` (the counts are checked by
/// [`Gguf::parse`]).
pub fn read_header(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut r = Reader::new(bytes, 0);
    let magic = r.take(4, "GGUF magic")?;
    if magic != b"GGUF" {
        return Err(GgufError::BadMagic { found: [magic[0], magic[1], magic[2], magic[3]] });
    }
    let version = r.u32("GGUF version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    Ok(Header { version, tensor_count: r.u64("tensor count")?, kv_count: r.u64("metadata count")? })
}

/// Where one metadata pair sits in the file.
#[derive(Debug, Clone, Copy)]
struct KvEntry {
    key_pos: u32,
    key_len: u16,
    ty: ValueType,
    value_pos: u32,
}

/// A validated tensor info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    /// Tensor name (1 to 63 bytes of UTF-8).
    pub name: &'a str,
    /// Element type.
    pub ty: GgmlType,
    /// Number of dimensions stored in the file (1 to 4).
    pub n_dims: u32,
    /// Elements per dimension, innermost first; unused dimensions are 1.
    pub ne: [u64; MAX_DIMS],
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub nbytes: u64,
}

impl TensorInfo<'_> {
    /// Total number of elements.
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time to fit in i64.
        self.ne.iter().product()
    }

    /// Number of rows (all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        self.nbytes / self.n_rows()
    }
}

/// A parsed, validated GGUF file borrowing its bytes.
pub struct Gguf<'a> {
    bytes: &'a [u8],
    header: Header,
    alignment: u32,
    data_start: usize,
    kvs: heapless::Vec<KvEntry, MAX_KV>,
    tensor_pos: heapless::Vec<u32, MAX_TENSORS>,
}

impl<'a> Gguf<'a> {
    /// Parses and validates the whole file except the tensor data itself, whose extents are
    /// checked against `bytes.len()`. `bytes` must be the complete file.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, GgufError> {
        let header = read_header(bytes)?;
        let mut r = Reader::new(bytes, 24);
        // A tensor info takes at least 33 bytes, a metadata pair 14: counts beyond what the file
        // can hold are refused before any loop runs.
        bound_count("tensor count", 8, header.tensor_count, MAX_TENSORS, r.remaining() / 33)?;
        bound_count("metadata count", 16, header.kv_count, MAX_KV, r.remaining() / 14)?;

        let mut gguf = Gguf {
            bytes,
            header,
            alignment: DEFAULT_ALIGNMENT,
            data_start: 0,
            kvs: heapless::Vec::new(),
            tensor_pos: heapless::Vec::new(),
        };
        for _ in 0..header.kv_count {
            gguf.parse_kv(&mut r)?;
        }
        let mut end_of_data = 0u64;
        for index in 0..header.tensor_count {
            let pos = position(r.pos, "tensor info")?;
            let info = read_tensor_info(&mut r, index)?;
            let bad = |problem, value| GgufError::BadTensor { name: name_of(info.name), problem, value };
            if info.offset % u64::from(gguf.alignment) != 0 {
                return Err(bad("data offset not a multiple of the alignment", info.offset));
            }
            if info.offset < end_of_data {
                return Err(bad("data overlaps the previous tensor's or is out of order", info.offset));
            }
            end_of_data =
                info.offset.checked_add(info.nbytes).ok_or(bad("data extent overflows", info.offset))?;
            // Cannot fail: the count was bounded by MAX_TENSORS above.
            let _ = gguf.tensor_pos.push(pos);
        }
        gguf.check_unique_names()?;
        gguf.data_start = align_up(r.pos, gguf.alignment).ok_or(GgufError::TooLarge {
            what: "tensor data start",
            offset: r.pos as u64,
            value: r.pos as u64,
            max: usize::MAX as u64,
        })?;
        // Subtraction form: data_start + end_of_data is never formed.
        let available = bytes.len().saturating_sub(gguf.data_start) as u64;
        if header.tensor_count > 0 && end_of_data > available {
            let last = gguf.tensors().last().map(|t| name_of(t.name)).unwrap_or_default();
            return Err(GgufError::BadTensor {
                name: last,
                problem: "data extends past the end of the file: the file is truncated",
                value: end_of_data - available,
            });
        }
        Ok(gguf)
    }

    /// The name bytes of the tensor info at file position `pos` (validated when parsed).
    fn name_at(&self, pos: u32) -> &'a [u8] {
        Reader::new(self.bytes, pos as usize).string("tensor name", MAX_TENSOR_NAME_LEN).unwrap_or(&[])
    }

    /// Refuses two tensors with the same name: sorts the info positions by name (O(n log n), on a
    /// fixed-capacity copy) and compares neighbours.
    fn check_unique_names(&self) -> Result<(), GgufError> {
        let mut by_name = self.tensor_pos.clone();
        by_name.sort_unstable_by(|&a, &b| self.name_at(a).cmp(self.name_at(b)));
        for pair in by_name.windows(2) {
            let name = self.name_at(pair[0]);
            if name == self.name_at(pair[1]) {
                let name = str::from_utf8(name).map(name_of).unwrap_or_default();
                return Err(GgufError::BadTensor { name, problem: "name used by two tensors", value: 2 });
            }
        }
        Ok(())
    }

    fn parse_kv(&mut self, r: &mut Reader<'a>) -> Result<(), GgufError> {
        let key_pos = position(r.pos, "metadata key")?;
        let key_bytes = r.string("metadata key", MAX_KEY_LEN)?;
        let bad_key = |problem| GgufError::BadKey { key: lossy_name(key_bytes), problem };
        if key_bytes.is_empty() {
            return Err(bad_key("empty key"));
        }
        if !key_bytes.iter().all(|b| b.is_ascii_graphic()) {
            return Err(bad_key("key is not printable ASCII"));
        }
        if self.kvs.iter().any(|kv| self.key_of(kv).as_bytes() == key_bytes) {
            return Err(bad_key("key appears twice"));
        }
        let ty = r.value_type("metadata value type")?;
        let value_pos = position(r.pos, "metadata value")?;
        let mut value_reader = r.clone();
        r.skip_value(ty, 0)?;
        if key_bytes == b"general.alignment" {
            let value = Value::read(&mut value_reader, ty)?;
            self.alignment = match value {
                Value::U32(a) if a.is_power_of_two() && ALIGNMENT_RANGE.contains(&a) => a,
                Value::U32(a) => {
                    return Err(GgufError::Invalid {
                        what: "general.alignment (a power of two from 8 to 65536)",
                        offset: u64::from(value_pos),
                        value: u64::from(a),
                    })
                }
                _ => return Err(bad_key("general.alignment must be uint32")),
            };
        }
        // Key length fits u16: bounded by MAX_KEY_LEN. The push cannot fail: count bounded by MAX_KV.
        let _ = self.kvs.push(KvEntry { key_pos, key_len: key_bytes.len() as u16, ty, value_pos });
        Ok(())
    }

    fn key_of(&self, kv: &KvEntry) -> &'a str {
        let start = kv.key_pos as usize + 8;
        // Validated as ASCII when parsed.
        self.bytes.get(start..start + kv.key_len as usize).and_then(|b| str::from_utf8(b).ok()).unwrap_or("")
    }

    fn value_of(&self, kv: &KvEntry) -> Result<Value<'a>, GgufError> {
        Value::read(&mut Reader::new(self.bytes, kv.value_pos as usize), kv.ty)
    }

    /// The fixed header.
    pub fn header(&self) -> Header {
        self.header
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// Offset of the tensor data section from the start of the file.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata pairs in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&'a str, Value<'a>)> + '_ {
        self.kvs.iter().filter_map(move |kv| Some((self.key_of(kv), self.value_of(kv).ok()?)))
    }

    /// Where the value of `key` starts in the file (an array's: at its element type), if present:
    /// for writers that patch a fixed-size value in place (a checksum written last).
    pub fn value_offset(&self, key: &str) -> Option<usize> {
        self.kvs.iter().find(|kv| self.key_of(kv) == key).map(|kv| kv.value_pos as usize)
    }

    /// The key of the last metadata pair (where a checksum of the header goes).
    pub fn last_key(&self) -> Option<&'a str> {
        self.kvs.last().map(|kv| self.key_of(kv))
    }

    /// The whole file, as given to [`Gguf::parse`].
    pub fn file_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<Value<'a>> {
        let kv = self.kvs.iter().find(|kv| self.key_of(kv) == key)?;
        self.value_of(kv).ok()
    }

    /// The value of `key`, or [`GgufError::MissingKey`].
    pub fn require(&self, key: &str) -> Result<Value<'a>, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// An integer of any stored integer type that fits `T`; `None` when absent.
    pub fn get_int<T: TryFrom<i128>>(&self, key: &str) -> Result<Option<T>, GgufError> {
        let Some(value) = self.get(key) else { return Ok(None) };
        let wide = value.as_integer().ok_or_else(|| GgufError::WrongType {
            key: name_of(key),
            expected: "an integer",
            found: value.value_type(),
        })?;
        T::try_from(wide)
            .map(Some)
            .map_err(|_| GgufError::BadValue { key: name_of(key), problem: "integer out of range" })
    }

    /// A required `u32` (any integer type whose value fits).
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get_int(key)?.ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// A required `u64` (any integer type whose value fits).
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get_int(key)?.ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// An optional float (`float32` or `float64`).
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(v)),
            Some(Value::F64(v)) => Ok(Some(v as f32)),
            Some(other) => Err(GgufError::WrongType {
                key: name_of(key),
                expected: "float32",
                found: other.value_type(),
            }),
        }
    }

    /// A required float (`float32` or `float64`).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.get_f32_opt(key)?.ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// An optional bool.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(v)),
            Some(other) => {
                Err(GgufError::WrongType { key: name_of(key), expected: "bool", found: other.value_type() })
            }
        }
    }

    /// An optional UTF-8 string.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&'a str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::String(_)) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| GgufError::BadValue { key: name_of(key), problem: "string is not UTF-8" }),
            Some(other) => {
                Err(GgufError::WrongType { key: name_of(key), expected: "string", found: other.value_type() })
            }
        }
    }

    /// A required UTF-8 string.
    pub fn get_str(&self, key: &str) -> Result<&'a str, GgufError> {
        self.get_str_opt(key)?.ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// An optional array whose elements have type `elem`.
    pub fn get_array_opt(&self, key: &str, elem: ValueType) -> Result<Option<ArrayView<'a>>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) if a.elem_type() == elem => Ok(Some(a)),
            Some(Value::Array(_)) => Err(GgufError::BadValue {
                key: name_of(key),
                problem: match elem {
                    ValueType::String => "array elements must be strings",
                    ValueType::F32 => "array elements must be float32",
                    ValueType::I32 => "array elements must be int32",
                    ValueType::U8
                    | ValueType::I8
                    | ValueType::U16
                    | ValueType::I16
                    | ValueType::U32
                    | ValueType::Bool
                    | ValueType::Array
                    | ValueType::U64
                    | ValueType::I64
                    | ValueType::F64 => "array has the wrong element type",
                },
            }),
            Some(other) => {
                Err(GgufError::WrongType { key: name_of(key), expected: "array", found: other.value_type() })
            }
        }
    }

    /// A required array whose elements have type `elem`.
    pub fn get_array(&self, key: &str, elem: ValueType) -> Result<ArrayView<'a>, GgufError> {
        self.get_array_opt(key, elem)?.ok_or_else(|| GgufError::MissingKey { key: name_of(key) })
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.tensor_pos.len()
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorInfo<'a>> + '_ {
        self.tensor_pos.iter().enumerate().filter_map(move |(i, &pos)| {
            read_tensor_info(&mut Reader::new(self.bytes, pos as usize), i as u64).ok()
        })
    }

    /// The tensor named `name`, if present (compares names only; decodes just the match).
    pub fn tensor(&self, name: &str) -> Option<TensorInfo<'a>> {
        let (i, &pos) =
            self.tensor_pos.iter().enumerate().find(|(_, &pos)| self.name_at(pos) == name.as_bytes())?;
        read_tensor_info(&mut Reader::new(self.bytes, pos as usize), i as u64).ok()
    }

    /// The data of a tensor of this file (its extent was checked by [`Gguf::parse`]).
    pub fn tensor_data(&self, info: &TensorInfo<'_>) -> &'a [u8] {
        let start = self.data_start.saturating_add(info.offset as usize);
        let end = start.saturating_add(info.nbytes as usize);
        self.bytes.get(start..end).unwrap_or(&[])
    }
}

impl core::fmt::Debug for Gguf<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Gguf")
            .field("header", &self.header)
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish_non_exhaustive()
    }
}

/// Refuses a header count beyond our bound or beyond what the remaining bytes can hold.
fn bound_count(what: &'static str, offset: u64, n: u64, cap: usize, fits: usize) -> Result<(), GgufError> {
    let max = cap.min(fits) as u64;
    if n > max {
        return Err(GgufError::TooLarge { what, offset, value: n, max });
    }
    Ok(())
}

/// A file position stored as u32: metadata and tensor infos must lie in the first 4 GiB.
fn position(pos: usize, what: &'static str) -> Result<u32, GgufError> {
    u32::try_from(pos).map_err(|_| GgufError::TooLarge {
        what,
        offset: pos as u64,
        value: pos as u64,
        max: u64::from(u32::MAX),
    })
}

fn align_up(pos: usize, alignment: u32) -> Option<usize> {
    let a = alignment as usize;
    Some(pos.checked_add(a - 1)? & !(a - 1))
}

fn lossy_name(bytes: &[u8]) -> Name {
    let mut name = Name::new();
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if name.push(c).is_err() {
                return name;
            }
        }
        if !chunk.invalid().is_empty() && name.push(char::REPLACEMENT_CHARACTER).is_err() {
            return name;
        }
    }
    name
}

/// Reads and validates one tensor info (everything but its place among the others).
fn read_tensor_info<'a>(r: &mut Reader<'a>, index: u64) -> Result<TensorInfo<'a>, GgufError> {
    // Only formatted on the error paths: a name that is not one cannot be shown.
    let numbered = || {
        let mut n = Name::new();
        let _ = core::fmt::write(&mut n, format_args!("#{index}"));
        n
    };
    let name_bytes = r.string("tensor name", MAX_TENSOR_NAME_LEN)?;
    let name = match str::from_utf8(name_bytes) {
        Ok(n) if !n.is_empty() => n,
        Ok(_) => return Err(GgufError::BadTensor { name: numbered(), problem: "empty name", value: 0 }),
        Err(_) => {
            return Err(GgufError::BadTensor { name: numbered(), problem: "name is not UTF-8", value: 0 })
        }
    };
    let bad = |problem, value| GgufError::BadTensor { name: name_of(name), problem, value };
    let n_dims = r.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad("dimension count must be 1 to 4", u64::from(n_dims)));
    }
    let mut ne = [1u64; MAX_DIMS];
    let mut n_elements = 1u64;
    for d in ne.iter_mut().take(n_dims as usize) {
        *d = r.u64("tensor dimension")?;
        if *d == 0 || *d > i64::MAX as u64 {
            return Err(bad("dimension must be 1 to 2^63-1", *d));
        }
        n_elements = n_elements
            .checked_mul(*d)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or(bad("element count overflows", *d))?;
    }
    let type_offset = r.pos as u64;
    let type_id = r.u32("tensor type")?;
    let ty = GgmlType::from_u32(type_id).ok_or(GgufError::Invalid {
        what: "tensor type id",
        offset: type_offset,
        value: u64::from(type_id),
    })?;
    if ne[0] % ty.block_len() as u64 != 0 {
        return Err(bad("row length is not a multiple of the type's block length", ne[0]));
    }
    let nbytes = ty.bytes_for(n_elements).ok_or(bad("byte size overflows", n_elements))?;
    let offset = r.u64("tensor data offset")?;
    Ok(TensorInfo { name, ty, n_dims, ne, offset, nbytes })
}

#[cfg(all(test, feature = "std"))]
mod tests;
