//! GGUF metadata values: a bounds-checked byte reader, and views of values that borrow from the
//! file.

use super::error::GgufError;
use super::value_type::ValueType;

/// Longest string value accepted, in bytes (chat templates are the longest real ones, ~10 KiB).
pub const MAX_STRING_LEN: u64 = 16 << 20;
/// Deepest nesting of arrays inside arrays (ggml itself accepts none).
pub const MAX_ARRAY_DEPTH: u32 = 3;

/// A cursor over the file's bytes; every read checks the bounds and names the field it reads.
#[derive(Clone)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8], pos: usize) -> Self {
        Self { bytes, pos }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let truncated = GgufError::Truncated { what, offset: self.pos as u64, needed: n };
        let n = usize::try_from(n).map_err(|_| truncated.clone())?;
        if n > self.remaining() {
            return Err(truncated);
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string (u64 length + bytes), at most `max_len` bytes long.
    pub(crate) fn string(&mut self, what: &'static str, max_len: u64) -> Result<&'a [u8], GgufError> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        if len > max_len {
            return Err(GgufError::TooLarge { what, offset, value: len, max: max_len });
        }
        self.take(len, what)
    }

    /// A count of items that each take at least `min_item` bytes: bounded by the bytes left, so a
    /// hostile count can never drive a long loop or a large allocation.
    pub(crate) fn count(&mut self, what: &'static str, min_item: usize) -> Result<u64, GgufError> {
        let offset = self.pos as u64;
        let n = self.u64(what)?;
        let max = (self.remaining() / min_item.max(1)) as u64;
        if n > max {
            return Err(GgufError::TooLarge { what, offset, value: n, max });
        }
        Ok(n)
    }

    /// A value type tag.
    pub(crate) fn value_type(&mut self, what: &'static str) -> Result<ValueType, GgufError> {
        let offset = self.pos as u64;
        let tag = self.u32(what)?;
        ValueType::from_u32(tag).ok_or(GgufError::Invalid { what, offset, value: u64::from(tag) })
    }

    /// Steps over `n` array elements of type `elem` at nesting `depth`. `n` comes from [`Self::count`],
    /// so `n * size` cannot overflow. Fixed-size elements take one bounds check; bools are also
    /// checked to be 0 or 1.
    pub(crate) fn skip_elements(&mut self, elem: ValueType, n: u64, depth: u32) -> Result<(), GgufError> {
        match elem.fixed_size() {
            Some(size) => {
                let start = self.pos;
                let data = self.take(n * size as u64, "array data")?;
                if elem == ValueType::Bool {
                    if let Some(i) = data.iter().position(|&b| b > 1) {
                        let offset = (start + i) as u64;
                        return Err(GgufError::Invalid {
                            what: "bool value",
                            offset,
                            value: u64::from(data[i]),
                        });
                    }
                }
            }
            None => {
                for _ in 0..n {
                    self.skip_value(elem, depth)?;
                }
            }
        }
        Ok(())
    }

    /// Checks and steps over one value of type `ty`; arrays nest at most `MAX_ARRAY_DEPTH` deep.
    pub(crate) fn skip_value(&mut self, ty: ValueType, depth: u32) -> Result<(), GgufError> {
        match ty {
            ValueType::Bool => {
                let offset = self.pos as u64;
                let b = self.take(1, "bool value")?[0];
                if b > 1 {
                    return Err(GgufError::Invalid { what: "bool value", offset, value: u64::from(b) });
                }
            }
            ValueType::String => {
                self.string("string value", MAX_STRING_LEN)?;
            }
            ValueType::Array => {
                let offset = self.pos as u64;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooLarge {
                        what: "array nesting depth",
                        offset,
                        value: u64::from(depth) + 1,
                        max: u64::from(MAX_ARRAY_DEPTH),
                    });
                }
                let elem = self.value_type("array element type")?;
                let n = self.count("array length", elem.min_size())?;
                self.skip_elements(elem, n, depth + 1)?;
            }
            fixed => {
                let size = fixed.fixed_size().unwrap_or(0) as u64;
                self.take(size, "metadata value")?;
            }
        }
        Ok(())
    }
}

/// One metadata value, borrowing strings and arrays from the file.
#[derive(Debug, Clone, Copy, PartialEq)]
#[allow(missing_docs)]
pub enum Value<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    /// Raw bytes; the format says UTF-8, and [`Value::as_str`] checks it.
    String(&'a [u8]),
    Array(ArrayView<'a>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl<'a> Value<'a> {
    /// Decodes a value of type `ty` at the reader's position. The bytes were validated by
    /// `skip_value` during parsing, so this only fails on a file changed since.
    pub(crate) fn read(r: &mut Reader<'a>, ty: ValueType) -> Result<Self, GgufError> {
        let mut fixed = |n: usize| -> Result<[u8; 8], GgufError> {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(r.take(n as u64, "metadata value")?);
            Ok(b)
        };
        Ok(match ty {
            ValueType::U8 => Value::U8(fixed(1)?[0]),
            ValueType::I8 => Value::I8(fixed(1)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(first(fixed(2)?))),
            ValueType::I16 => Value::I16(i16::from_le_bytes(first(fixed(2)?))),
            ValueType::U32 => Value::U32(u32::from_le_bytes(first(fixed(4)?))),
            ValueType::I32 => Value::I32(i32::from_le_bytes(first(fixed(4)?))),
            ValueType::F32 => Value::F32(f32::from_le_bytes(first(fixed(4)?))),
            ValueType::Bool => Value::Bool(fixed(1)?[0] != 0),
            ValueType::U64 => Value::U64(u64::from_le_bytes(fixed(8)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(fixed(8)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(fixed(8)?)),
            ValueType::String => Value::String(r.string("string value", MAX_STRING_LEN)?),
            ValueType::Array => {
                let elem = r.value_type("array element type")?;
                let len = r.count("array length", elem.min_size())?;
                let start = r.pos;
                r.skip_elements(elem, len, 1)?;
                let bytes = &r.bytes[start..r.pos];
                Value::Array(ArrayView { elem, len: len as usize, bytes })
            }
        })
    }

    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value widened to i128 (exact for every GGUF integer type).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            Value::F32(_) | Value::Bool(_) | Value::String(_) | Value::Array(_) | Value::F64(_) => {
                return None
            }
        })
    }

    /// The value as text, if it is a UTF-8 string.
    pub fn as_str(&self) -> Option<&'a str> {
        match self {
            Value::String(b) => core::str::from_utf8(b).ok(),
            _ => None,
        }
    }
}

fn first<const N: usize>(b: [u8; 8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[..N]);
    out
}

/// An array value: element type, length and the bytes of its elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrayView<'a> {
    elem: ValueType,
    len: usize,
    bytes: &'a [u8],
}

impl<'a> ArrayView<'a> {
    /// Element type.
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// An array of u32 over `bytes` (little-endian, four per element; a trailing part is
    /// ignored): for writers.
    pub fn of_u32(bytes: &'a [u8]) -> Self {
        let len = bytes.len() / 4;
        ArrayView { elem: ValueType::U32, len, bytes: &bytes[..len * 4] }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements in order.
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter { elem: self.elem, left: self.len, reader: Reader::new(self.bytes, 0) }
    }

    /// Element `i` of an array of fixed-size elements, in O(1); `None` for strings, arrays or `i`
    /// out of range.
    pub fn get_fixed(&self, i: usize) -> Option<Value<'a>> {
        let size = self.elem.fixed_size()?;
        if i >= self.len {
            return None;
        }
        Value::read(&mut Reader::new(self.bytes, i * size), self.elem).ok()
    }
}

/// Iterator over an array's elements.
pub struct ArrayIter<'a> {
    elem: ValueType,
    left: usize,
    reader: Reader<'a>,
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Value<'a>;

    fn next(&mut self) -> Option<Value<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The array was validated when the file was parsed; a failure here ends the iteration.
        match Value::read(&mut self.reader, self.elem) {
            Ok(v) => Some(v),
            Err(_) => {
                self.left = 0;
                None
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.left))
    }
}
