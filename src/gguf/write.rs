//! std layer: writing GGUF v3 files, the inverse of [`Gguf::parse`](super::Gguf::parse).
//!
//! Layout written: header (magic, version 3, tensor count, metadata count); the metadata pairs
//! (key string, value type, value; strings as u64 length + bytes, arrays as element type + u64
//! count + elements, nested arrays included); the tensor infos (name, dimension count, dimensions,
//! type id, data offset); zero padding to the alignment; then each tensor's data, each padded with
//! zeros to the alignment (so every offset is aligned, and the file ends aligned, as llama.cpp and
//! gguf-py write it). The alignment is the metadata's `general.alignment` or 32.
//!
//! Use: [`GgufWriter::start`] with all metadata and tensor infos, then
//! [`GgufWriter::write_tensor_data`] once per tensor in order, then [`GgufWriter::finish`].

use std::io::{self, Write};
use std::vec::Vec;

use super::{TensorInfo, Value, ValueType, ALIGNMENT_RANGE, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::quant::GgmlType;

/// What a tensor info says about a tensor to be written (its offset is computed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorHeader<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub ty: GgmlType,
    /// Number of dimensions written (1 to 4).
    pub n_dims: u32,
    /// Elements per dimension, innermost first; unused ones are 1.
    pub ne: [u64; MAX_DIMS],
}

impl<'a> TensorHeader<'a> {
    /// The header of a parsed tensor with another element type.
    pub fn retyped(info: &TensorInfo<'a>, ty: GgmlType) -> Self {
        Self { name: info.name, ty, n_dims: info.n_dims, ne: info.ne }
    }

    /// Bytes of data, or `None` when the first dimension is not a whole number of blocks or the
    /// size overflows.
    pub fn nbytes(&self) -> Option<u64> {
        if self.ne[0] % self.ty.block_len() as u64 != 0 {
            return None;
        }
        self.ne.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).and_then(|n| self.ty.bytes_for(n))
    }
}

fn invalid(msg: std::string::String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The GGUF tag of a value type.
fn tag(ty: ValueType) -> u32 {
    use ValueType::*;
    match ty {
        U8 => 0,
        I8 => 1,
        U16 => 2,
        I16 => 3,
        U32 => 4,
        I32 => 5,
        F32 => 6,
        Bool => 7,
        String => 8,
        Array => 9,
        U64 => 10,
        I64 => 11,
        F64 => 12,
    }
}

/// A GGUF file being written: the header part is done, tensor data goes next.
pub struct GgufWriter<W: Write> {
    out: W,
    /// Bytes written so far.
    pos: u64,
    alignment: u64,
    /// Expected data size of each tensor, in order.
    sizes: Vec<u64>,
    /// Tensors whose data has been written.
    written: usize,
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header, `metadata` (in order) and the infos of `tensors` (in order, offsets
    /// computed), then pads to the alignment.
    ///
    /// Refuses an invalid `general.alignment`, a tensor without 1 to 4 dimensions, and sizes that
    /// overflow. Keys and names are written as given: it is the caller's job to keep them unique.
    pub fn start(out: W, metadata: &[(&str, Value<'_>)], tensors: &[TensorHeader<'_>]) -> io::Result<Self> {
        Self::start_sized(out, metadata, tensors, &[])
    }

    /// As [`GgufWriter::start`], with `data_sizes[i]` bytes of data for tensor `i` instead of the
    /// size its type and shape give (at least that size: the data may carry more, as pinfer's
    /// repacked-weight cache does; offsets and padding follow the sizes given). An empty
    /// `data_sizes` means every tensor's own size.
    pub fn start_sized(
        mut out: W,
        metadata: &[(&str, Value<'_>)],
        tensors: &[TensorHeader<'_>],
        data_sizes: &[u64],
    ) -> io::Result<Self> {
        if !data_sizes.is_empty() && data_sizes.len() != tensors.len() {
            return Err(invalid(std::format!(
                "{} data sizes for {} tensors",
                data_sizes.len(),
                tensors.len()
            )));
        }
        let alignment = match metadata.iter().find(|(k, _)| *k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() && ALIGNMENT_RANGE.contains(a) => *a,
            Some((_, v)) => return Err(invalid(std::format!("bad general.alignment {v:?}"))),
        };
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_str(&mut head, key.as_bytes());
            head.extend_from_slice(&tag(value.value_type()).to_le_bytes());
            put_value(&mut head, value)?;
        }
        let mut offset = 0u64;
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.n_dims == 0 || t.n_dims as usize > MAX_DIMS {
                return Err(invalid(std::format!("{}: {} dimensions", t.name, t.n_dims)));
            }
            let own = t.nbytes().ok_or_else(|| {
                invalid(std::format!("{}: shape {:?} does not fit type {}", t.name, t.ne, t.ty))
            })?;
            let size = match data_sizes.get(sizes.len()) {
                None => own,
                Some(&n) if n >= own => n,
                Some(&n) => {
                    return Err(invalid(std::format!(
                        "{}: {n} bytes of data, fewer than its type and shape need ({own})",
                        t.name
                    )))
                }
            };
            put_str(&mut head, t.name.as_bytes());
            head.extend_from_slice(&t.n_dims.to_le_bytes());
            for d in &t.ne[..t.n_dims as usize] {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = align_up(offset.checked_add(size), alignment.into())
                .ok_or_else(|| invalid(std::format!("{}: data offsets overflow", t.name)))?;
            sizes.push(size);
        }
        out.write_all(&head)?;
        let mut writer = Self { out, pos: head.len() as u64, alignment: alignment.into(), sizes, written: 0 };
        writer.pad()?;
        Ok(writer)
    }

    /// Writes the data of the next tensor (exactly its size) and pads to the alignment.
    pub fn write_tensor_data(&mut self, data: &[u8]) -> io::Result<()> {
        let Some(&size) = self.sizes.get(self.written) else {
            return Err(invalid(std::format!(
                "data for tensor {} of {}",
                self.written + 1,
                self.sizes.len()
            )));
        };
        if data.len() as u64 != size {
            return Err(invalid(std::format!(
                "tensor {}: {} bytes of data, its info says {size}",
                self.written,
                data.len()
            )));
        }
        self.out.write_all(data)?;
        self.pos += size;
        self.written += 1;
        self.pad()
    }

    /// Checks every tensor got its data, flushes, and returns the output and its length in bytes.
    pub fn finish(mut self) -> io::Result<(W, u64)> {
        if self.written != self.sizes.len() {
            return Err(invalid(std::format!(
                "only {} of {} tensors written",
                self.written,
                self.sizes.len()
            )));
        }
        self.out.flush()?;
        Ok((self.out, self.pos))
    }

    fn pad(&mut self) -> io::Result<()> {
        const ZEROS: [u8; 256] = [0; 256];
        let mut n = align_up(Some(self.pos), self.alignment).unwrap_or(self.pos) - self.pos;
        self.pos += n;
        while n > 0 {
            let k = n.min(ZEROS.len() as u64) as usize;
            self.out.write_all(&ZEROS[..k])?;
            n -= k as u64;
        }
        Ok(())
    }
}

fn align_up(n: Option<u64>, alignment: u64) -> Option<u64> {
    Some(n?.checked_add(alignment - 1)? & !(alignment - 1))
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// Appends a value without its type tag (array elements carry none).
fn put_value(out: &mut Vec<u8>, value: &Value<'_>) -> io::Result<()> {
    match *value {
        Value::U8(v) => out.push(v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_bits().to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(v)),
        Value::String(s) => put_str(out, s),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_bits().to_le_bytes()),
        Value::Array(a) => {
            out.extend_from_slice(&tag(a.elem_type()).to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            let mut n = 0;
            for element in a.iter() {
                put_value(out, &element)?;
                n += 1;
            }
            if n != a.len() {
                return Err(invalid(std::format!("array of {} elements yielded {n}", a.len())));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Gguf;
    use super::*;

    /// A file with every value type (and nested arrays) and three tensors; written, parsed, and
    /// written again from the parse: byte-identical, with every value read back.
    #[test]
    fn round_trips_every_value_type_through_the_parser() {
        // Arrays are views into file bytes, so build them by parsing a first file made of scalars.
        let scalars: Vec<(&str, Value<'_>)> = std::vec![
            ("general.alignment", Value::U32(64)),
            ("u8", Value::U8(200)),
            ("i8", Value::I8(-5)),
            ("u16", Value::U16(65000)),
            ("i16", Value::I16(-30000)),
            ("u32", Value::U32(4_000_000_000)),
            ("i32", Value::I32(-2_000_000_000)),
            ("f32", Value::F32(-1.5)),
            ("f32.nan", Value::F32(f32::from_bits(0x7fc0_1234))),
            ("bool", Value::Bool(true)),
            ("string", Value::String("héllo".as_bytes())),
            ("u64", Value::U64(u64::MAX)),
            ("i64", Value::I64(i64::MIN)),
            ("f64", Value::F64(core::f64::consts::PI)),
        ];
        let tensors = [
            TensorHeader { name: "a", ty: GgmlType::F32, n_dims: 1, ne: [3, 1, 1, 1] },
            TensorHeader { name: "b", ty: GgmlType::Q8_0, n_dims: 2, ne: [64, 2, 1, 1] },
            TensorHeader { name: "c", ty: GgmlType::Q4_K, n_dims: 3, ne: [256, 1, 2, 1] },
        ];
        let data: Vec<Vec<u8>> =
            tensors.iter().map(|t| (0..t.nbytes().unwrap()).map(|i| (i * 7 % 251) as u8).collect()).collect();
        let write = |meta: &[(&str, Value<'_>)]| {
            let mut w = GgufWriter::start(Vec::new(), meta, &tensors).unwrap();
            for d in &data {
                w.write_tensor_data(d).unwrap();
            }
            let (bytes, len) = w.finish().unwrap();
            assert_eq!(bytes.len() as u64, len);
            assert_eq!(len % 64, 0, "the file ends aligned");
            bytes
        };
        let first = write(&scalars);
        let parsed = Gguf::parse(&first).unwrap();
        assert_eq!(parsed.alignment(), 64);
        let meta: Vec<_> = parsed.metadata().collect();
        // NaN != NaN: compare its bits, the rest by value.
        let not_nan = |kv: &&(&str, Value<'_>)| kv.0 != "f32.nan";
        assert!(meta.iter().filter(not_nan).eq(scalars.iter().filter(not_nan)), "scalars read back");
        assert!(matches!(parsed.get("f32.nan"), Some(Value::F32(v)) if v.to_bits() == 0x7fc0_1234));

        // Now arrays: of scalars, of strings, nested, and empty, taken from a crafted file.
        let mut arrays_file = Vec::new();
        arrays_file.extend_from_slice(b"GGUF");
        arrays_file.extend_from_slice(&3u32.to_le_bytes());
        arrays_file.extend_from_slice(&0u64.to_le_bytes());
        arrays_file.extend_from_slice(&4u64.to_le_bytes());
        let kv = |f: &mut Vec<u8>, key: &str, body: &[u8]| {
            put_str(f, key.as_bytes());
            f.extend_from_slice(&9u32.to_le_bytes());
            f.extend_from_slice(body);
        };
        let mut ints = std::vec![5u8, 0, 0, 0]; // int32 elements
        ints.extend_from_slice(&3u64.to_le_bytes());
        for v in [1i32, -2, 3] {
            ints.extend_from_slice(&v.to_le_bytes());
        }
        kv(&mut arrays_file, "arr.i32", &ints);
        let mut strs = std::vec![8u8, 0, 0, 0];
        strs.extend_from_slice(&2u64.to_le_bytes());
        put_str(&mut strs, b"x");
        put_str(&mut strs, b"");
        kv(&mut arrays_file, "arr.str", &strs);
        let mut nested = std::vec![9u8, 0, 0, 0];
        nested.extend_from_slice(&2u64.to_le_bytes());
        nested.extend_from_slice(&ints);
        nested.extend_from_slice(&strs);
        kv(&mut arrays_file, "arr.nested", &nested);
        let mut empty = std::vec![7u8, 0, 0, 0];
        empty.extend_from_slice(&0u64.to_le_bytes());
        kv(&mut arrays_file, "arr.empty", &empty);
        let arrays = Gguf::parse(&arrays_file).unwrap();
        let mut all = meta.clone();
        all.extend(arrays.metadata());

        let second = write(&all);
        let reparsed = Gguf::parse(&second).unwrap();
        let again: Vec<_> = reparsed.metadata().collect();
        assert!(again.iter().filter(not_nan).eq(all.iter().filter(not_nan)));
        assert_eq!(again.len(), 18);
        // Written from the parse, the file is the same again, byte for byte.
        assert_eq!(write(&reparsed.metadata().collect::<Vec<_>>()), second);
        for (t, d) in tensors.iter().zip(&data) {
            let info = reparsed.tensor(t.name).unwrap();
            assert_eq!((info.ty, info.n_dims, info.ne), (t.ty, t.n_dims, t.ne));
            assert_eq!(info.offset % 64, 0);
            assert_eq!(reparsed.tensor_data(&info), &d[..], "{}", t.name);
        }
    }

    /// Data larger than the tensor's own size leaves a gap the parser accepts; smaller is refused.
    #[test]
    fn larger_data_sizes_leave_gaps_the_parser_accepts() {
        let t = [
            TensorHeader { name: "a", ty: GgmlType::Q4_0, n_dims: 2, ne: [32, 2, 1, 1] },
            TensorHeader { name: "b", ty: GgmlType::F32, n_dims: 1, ne: [3, 1, 1, 1] },
        ];
        let meta = [("general.alignment", Value::U32(64))];
        let mut w = GgufWriter::start_sized(Vec::new(), &meta, &t, &[100, 12]).unwrap();
        assert!(w.write_tensor_data(&[1; 36]).is_err(), "the size given, not the tensor's");
        w.write_tensor_data(&[1; 100]).unwrap();
        w.write_tensor_data(&[2; 12]).unwrap();
        let (bytes, _) = w.finish().unwrap();
        let parsed = Gguf::parse(&bytes).unwrap();
        let b = parsed.tensor("b").unwrap();
        assert_eq!(b.offset, 128);
        assert_eq!(parsed.tensor_data(&b), &[2; 12]);
        assert!(GgufWriter::start_sized(Vec::new(), &meta, &t, &[35, 12]).is_err());
        assert!(GgufWriter::start_sized(Vec::new(), &meta, &t, &[36]).is_err());
    }

    #[test]
    fn refuses_wrong_sizes_and_bad_alignment() {
        let t = [TensorHeader { name: "w", ty: GgmlType::Q4_0, n_dims: 2, ne: [32, 2, 1, 1] }];
        let mut w = GgufWriter::start(Vec::new(), &[], &t).unwrap();
        assert!(w.write_tensor_data(&[0; 35]).is_err());
        w.write_tensor_data(&[0; 36]).unwrap();
        assert!(w.write_tensor_data(&[0; 36]).is_err(), "one tensor only");
        let (bytes, _) = w.finish().unwrap();
        assert_eq!(Gguf::parse(&bytes).unwrap().alignment(), 32);

        let unfinished = GgufWriter::start(Vec::new(), &[], &t).unwrap();
        assert!(unfinished.finish().is_err());
        let bad_shape = [TensorHeader { name: "w", ty: GgmlType::Q4_0, n_dims: 2, ne: [16, 2, 1, 1] }];
        assert!(GgufWriter::start(Vec::new(), &[], &bad_shape).is_err());
        for a in [Value::U32(48), Value::U32(4), Value::U64(32)] {
            assert!(GgufWriter::start(Vec::new(), &[("general.alignment", a)], &t).is_err(), "{a:?}");
        }
    }
}
