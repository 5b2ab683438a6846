//! GGUF bytes for integration tests and the fuzz target.
//!
//! * [`Bytes`]: a little-endian byte writer that can put ANY value in ANY field (wrong counts,
//!   lengths that lie, invalid tags), and records where every u32/u64 field went so mutation tests
//!   can hit fields rather than random bytes.
//! * [`GgufBuilder`]: a convenience builder for VALID files (offsets, padding and data computed),
//!   which hostile tests then corrupt.
//! * [`check_parsed`]: walks every accessor of a parsed file and asserts the invariants the parser
//!   promises (data inside the file, sizes consistent, no overlap). Used by the mutation test and by
//!   `fuzz/fuzz_targets/gguf_parse.rs` (which includes this file by path).
#![allow(dead_code)]

use pinfer::gguf::{Gguf, GgufError, TensorInfo, Value, ValueType, ALIGNMENT_RANGE, MAX_TENSOR_NAME_LEN};
use pinfer::quant::GgmlType;

/// GGUF metadata value type tags.
pub mod tag {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
    /// Every valid tag.
    pub const ALL: [u32; 13] = [U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64];
    /// Size of a fixed-size value, `None` for strings and arrays.
    pub fn fixed_size(tag: u32) -> Option<usize> {
        match tag {
            U8 | I8 | BOOL => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            _ => None,
        }
    }
}

/// ggml tensor type ids.
pub mod ggml {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const I8: u32 = 24;
    pub const I64: u32 = 27;
    pub const Q8_K: u32 = 15;
    pub const BF16: u32 = 30;
}

/// Where a fixed-width integer field was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Byte offset in the file.
    pub offset: usize,
    /// 4 or 8.
    pub width: u8,
}

/// Little-endian GGUF bytes written field by field. Nothing is validated: any value goes anywhere.
#[derive(Debug, Clone, Default)]
pub struct Bytes {
    pub buf: Vec<u8>,
    /// Every u32/u64 written, in order (for structure-aware mutation).
    pub fields: Vec<Field>,
}

impl Bytes {
    pub fn new() -> Self {
        Self::default()
    }

    /// Magic `GGUF`, then version, tensor count and metadata count.
    pub fn header(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut b = Self::new();
        b.raw(b"GGUF").u32(version).u64(tensors).u64(kvs);
        b
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self
    }

    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf.resize(self.buf.len() + n, 0);
        self
    }

    /// `n` bytes of a deterministic pattern.
    pub fn pattern(&mut self, n: usize, seed: u8) -> &mut Self {
        self.buf.extend((0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
        self
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.raw(&[v])
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.fields.push(Field { offset: self.buf.len(), width: 4 });
        self.raw(&v.to_le_bytes())
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.fields.push(Field { offset: self.buf.len(), width: 8 });
        self.raw(&v.to_le_bytes())
    }

    /// A GGUF string whose length field says `len`, followed by `bytes` (which may be shorter or
    /// longer than `len`).
    pub fn lying_str(&mut self, len: u64, bytes: &[u8]) -> &mut Self {
        self.u64(len).raw(bytes)
    }

    /// A GGUF string of arbitrary bytes.
    pub fn bstr(&mut self, bytes: &[u8]) -> &mut Self {
        self.lying_str(bytes.len() as u64, bytes)
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bstr(s.as_bytes())
    }

    /// Key and value type tag of a metadata pair (the value is written next, by the caller).
    pub fn kv_head(&mut self, key: &[u8], tag: u32) -> &mut Self {
        self.bstr(key).u32(tag)
    }

    /// A whole metadata pair.
    pub fn kv(&mut self, key: &str, v: &Val) -> &mut Self {
        self.kv_head(key.as_bytes(), v.tag()).value(v)
    }

    /// An array header: element type and count (the elements are written by the caller).
    pub fn array_head(&mut self, elem: u32, count: u64) -> &mut Self {
        self.u32(elem).u64(count)
    }

    /// The encoding of `v` without its type tag.
    pub fn value(&mut self, v: &Val) -> &mut Self {
        match v {
            Val::U8(x) => self.u8(*x),
            Val::I8(x) => self.u8(*x as u8),
            Val::U16(x) => self.u16(*x),
            Val::I16(x) => self.u16(*x as u16),
            Val::U32(x) => self.u32(*x),
            Val::I32(x) => self.u32(*x as u32),
            Val::F32(x) => self.raw(&x.to_le_bytes()),
            Val::Bool(x) => self.u8(*x),
            Val::Str(s) => self.bstr(s),
            Val::Array(elem, items) => {
                self.array_head(*elem, items.len() as u64);
                for item in items {
                    self.value(item);
                }
                self
            }
            Val::U64(x) => self.u64(*x),
            Val::I64(x) => self.u64(*x as u64),
            Val::F64(x) => self.raw(&x.to_le_bytes()),
        }
    }

    /// A tensor info whose `n_dims` field is `dims.len()`.
    pub fn tensor(&mut self, name: &[u8], dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.tensor_raw(name, dims.len() as u32, dims, ty, offset)
    }

    /// A tensor info with any `n_dims` value and any number of dimension fields after it.
    pub fn tensor_raw(&mut self, name: &[u8], n_dims: u32, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.bstr(name).u32(n_dims);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }

    /// Zero bytes up to the next multiple of `align`.
    pub fn pad_to(&mut self, align: usize) -> &mut Self {
        let rem = self.buf.len() % align;
        if rem != 0 {
            self.zeros(align - rem);
        }
        self
    }

    pub fn patch_u32(&mut self, at: usize, v: u32) -> &mut Self {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }

    pub fn patch_u64(&mut self, at: usize, v: u64) -> &mut Self {
        self.buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

/// A metadata value to write. `Bool` holds the raw byte (so 2 can be written); `Array` holds its
/// element type tag explicitly (so it can disagree with the elements).
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(u8),
    Str(Vec<u8>),
    Array(u32, Vec<Val>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Val {
    pub fn str(s: &str) -> Self {
        Val::Str(s.as_bytes().to_vec())
    }

    pub fn strs(items: &[&str]) -> Self {
        Val::Array(tag::STRING, items.iter().map(|s| Val::str(s)).collect())
    }

    pub fn tag(&self) -> u32 {
        match self {
            Val::U8(_) => tag::U8,
            Val::I8(_) => tag::I8,
            Val::U16(_) => tag::U16,
            Val::I16(_) => tag::I16,
            Val::U32(_) => tag::U32,
            Val::I32(_) => tag::I32,
            Val::F32(_) => tag::F32,
            Val::Bool(_) => tag::BOOL,
            Val::Str(_) => tag::STRING,
            Val::Array(..) => tag::ARRAY,
            Val::U64(_) => tag::U64,
            Val::I64(_) => tag::I64,
            Val::F64(_) => tag::F64,
        }
    }

    /// Whether the parsed `value` is exactly this value (floats compared bit for bit, arrays
    /// element by element to the end).
    pub fn matches(&self, value: &Value<'_>) -> bool {
        match (self, value) {
            (Val::U8(a), Value::U8(b)) => a == b,
            (Val::I8(a), Value::I8(b)) => a == b,
            (Val::U16(a), Value::U16(b)) => a == b,
            (Val::I16(a), Value::I16(b)) => a == b,
            (Val::U32(a), Value::U32(b)) => a == b,
            (Val::I32(a), Value::I32(b)) => a == b,
            (Val::F32(a), Value::F32(b)) => a.to_bits() == b.to_bits(),
            (Val::Bool(a), Value::Bool(b)) => (*a != 0) == *b && *a <= 1,
            (Val::Str(a), Value::String(b)) => a.as_slice() == *b,
            (Val::U64(a), Value::U64(b)) => a == b,
            (Val::I64(a), Value::I64(b)) => a == b,
            (Val::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
            (Val::Array(elem, items), Value::Array(view)) => {
                let mut iter = view.iter();
                value_type_tag(view.elem_type()) == *elem
                    && view.len() == items.len()
                    && items.iter().all(|item| iter.next().is_some_and(|v| item.matches(&v)))
                    && iter.next().is_none()
            }
            _ => false,
        }
    }
}

/// The GGUF tag of a parsed value type.
pub fn value_type_tag(ty: ValueType) -> u32 {
    (0..13).find(|&t| ValueType::from_u32(t) == Some(ty)).expect("every value type has a tag")
}

/// A tensor to write with [`GgufBuilder`].
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

/// Builds VALID GGUF files: tensor offsets are the running padded sum, the data section starts
/// aligned and the last tensor's data ends exactly at the end of the file.
#[derive(Debug, Clone)]
pub struct GgufBuilder {
    pub version: u32,
    pub kvs: Vec<(String, Val)>,
    pub tensors: Vec<TensorSpec>,
    /// Alignment the writer pads with (the key, if any, is written separately by `alignment`).
    pub pad: u64,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        Self { version: 3, kvs: Vec::new(), tensors: Vec::new(), pad: 32 }
    }
}

/// A built file and where its parts are.
#[derive(Debug, Clone)]
pub struct Built {
    pub bytes: Vec<u8>,
    /// Every u32/u64 field written.
    pub fields: Vec<Field>,
    /// Where the tensor infos end (the data section starts at the next aligned offset).
    pub infos_end: usize,
    pub data_start: usize,
    /// Offset of each tensor's data from `data_start`.
    pub offsets: Vec<u64>,
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn kv(mut self, key: &str, v: Val) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// Sets `general.alignment` (as uint32) and pads with it.
    pub fn alignment(mut self, a: u32) -> Self {
        self.pad = u64::from(a);
        self.kv("general.alignment", Val::U32(a))
    }

    /// A tensor of type `ty` (a ggml id) with patterned data of the right size.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32) -> Self {
        let t = GgmlType::from_u32(ty).expect("builder tensors have a valid type");
        let n: u64 = dims.iter().product();
        let nbytes = t.bytes_for(n).expect("builder tensors have a whole number of blocks");
        let seed = self.tensors.len() as u8;
        let data = (0..nbytes).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect();
        self.tensors.push(TensorSpec { name: name.to_string(), dims: dims.to_vec(), ty, data });
        self
    }

    pub fn build(&self) -> Built {
        let mut b = Bytes::header(self.version, self.tensors.len() as u64, self.kvs.len() as u64);
        for (key, v) in &self.kvs {
            b.kv(key, v);
        }
        let pad = self.pad.max(1);
        let mut offsets = Vec::new();
        let mut next = 0u64;
        for t in &self.tensors {
            offsets.push(next);
            b.tensor(t.name.as_bytes(), &t.dims, t.ty, next);
            next = (next + t.data.len() as u64).div_ceil(pad) * pad;
        }
        let infos_end = b.len();
        b.pad_to(pad as usize);
        let data_start = b.len();
        for (i, t) in self.tensors.iter().enumerate() {
            let at = data_start + offsets[i] as usize;
            b.zeros(at - b.len()).raw(&t.data);
        }
        Built { bytes: b.buf, fields: b.fields, infos_end, data_start, offsets }
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.build().bytes
    }
}

/// A value of each of the 13 types, arrays of each element type (nested ones within the depth
/// bound, empty ones, strings with non-ASCII text) and several tensors of different types: the
/// file the truncation, round-trip and mutation tests start from.
pub fn rich_model() -> GgufBuilder {
    let scalars = [
        Val::U8(0xfe),
        Val::I8(-7),
        Val::U16(0xbeef),
        Val::I16(-12345),
        Val::U32(0xdead_beef),
        Val::I32(-123_456_789),
        Val::F32(-1.5e-3),
        Val::Bool(1),
        Val::str("héllo wörld"),
        Val::Array(tag::U8, vec![Val::U8(1)]),
        Val::U64(u64::MAX - 1),
        Val::I64(i64::MIN + 3),
        Val::F64(std::f64::consts::PI),
    ];
    let mut g = GgufBuilder::new().kv("general.architecture", Val::str("llama"));
    for v in &scalars {
        g = g.kv(&format!("test.scalar.{}", v.tag()), v.clone());
    }
    for v in &scalars {
        let elem = v.tag();
        let items = match v {
            Val::Array(..) => vec![v.clone(), Val::Array(tag::STRING, vec![Val::str("x"), Val::str("")])],
            Val::Bool(_) => vec![Val::Bool(0), Val::Bool(1), Val::Bool(1)],
            _ => vec![v.clone(); 3],
        };
        g = g.kv(&format!("test.array.{elem}"), Val::Array(elem, items));
    }
    g.kv("test.array.empty", Val::Array(tag::F32, vec![]))
        .kv("test.array.empty_of_arrays", Val::Array(tag::ARRAY, vec![]))
        .kv(
            "test.array.nested3",
            Val::Array(
                tag::ARRAY,
                vec![Val::Array(tag::ARRAY, vec![Val::Array(tag::I32, vec![Val::I32(1), Val::I32(-1)])])],
            ),
        )
        .kv("tokenizer.ggml.tokens", Val::strs(&["<unk>", "a", "b", "ü"]))
        .kv("tokenizer.ggml.scores", Val::Array(tag::F32, (0..4).map(|i| Val::F32(i as f32)).collect()))
        .kv("llama.block_count", Val::U32(1))
        .tensor("token_embd.weight", &[8, 4], ggml::F32)
        .tensor("blk.0.attn_q.weight", &[64, 2], ggml::Q4_0)
        .tensor("blk.0.attn_k.weight", &[32, 3], ggml::Q8_0)
        .tensor("blk.0.ffn_up.weight", &[256, 1, 1, 2], ggml::Q4_K)
        .tensor("blk.0.attn_norm.weight", &[5], ggml::F16)
        .tensor("blk.0.i8", &[3, 1, 1], ggml::I8)
        .tensor("output.weight", &[7, 2], ggml::BF16)
}

/// A vocab-only file: tokenizer keys, no tensors (llama.cpp ships such files for tokenizer tests).
pub fn vocab_only_model() -> GgufBuilder {
    let tokens: Vec<String> = (0..40).map(|i| format!("tok{i}")).collect();
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    GgufBuilder::new()
        .kv("general.architecture", Val::str("llama"))
        .kv("general.name", Val::str("vocab-only"))
        .kv("tokenizer.ggml.model", Val::str("llama"))
        .kv("tokenizer.ggml.tokens", Val::strs(&refs))
        .kv("tokenizer.ggml.scores", Val::Array(tag::F32, (0..40).map(|i| Val::F32(-(i as f32))).collect()))
        .kv("tokenizer.ggml.token_type", Val::Array(tag::I32, (0..40).map(|i| Val::I32(1 + i % 6)).collect()))
        .kv("tokenizer.ggml.merges", Val::strs(&["t o", "to k"]))
        .kv("tokenizer.ggml.bos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(2))
        .kv("tokenizer.ggml.add_bos_token", Val::Bool(1))
        .kv("tokenizer.chat_template", Val::str("{% for m in messages %}{{ m.content }}{% endfor %}"))
}

/// Equality of scalar values with floats compared bit for bit (NaN payloads included).
pub fn same_value(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

/// Walks one value to its end (arrays iterated fully, fixed elements also by index) and returns
/// the number of values visited.
fn walk_value(v: &Value<'_>, depth: u32) -> usize {
    let _ = (v.value_type(), v.as_integer(), v.as_str());
    match v {
        Value::Array(a) => {
            assert!(depth < 8, "array nesting beyond any sane bound was accepted");
            let mut n = 0;
            for (i, item) in a.iter().enumerate() {
                assert_eq!(item.value_type(), a.elem_type(), "array element of the wrong type");
                if a.elem_type().fixed_size().is_some() {
                    let fixed = a.get_fixed(i).expect("get_fixed of an element that iteration read");
                    assert!(same_value(&fixed, &item), "get_fixed({i}) = {fixed:?}, iteration read {item:?}");
                }
                n += 1 + walk_value(&item, depth + 1);
                if n > 1 << 24 {
                    panic!("array iteration does not end");
                }
            }
            assert_eq!(a.iter().count(), a.len(), "array iteration ended early");
            assert_eq!(a.is_empty(), a.iter().next().is_none());
            assert!(a.get_fixed(a.len()).is_none());
            n
        }
        _ => 0,
    }
}

/// Runs the model-level validation generation does at load; the error text on failure.
pub fn model_verdict(g: &Gguf<'_>) -> Result<(), String> {
    use pinfer::model::{validate_tensors, validate_vocab, HParams};
    let hp = HParams::from_gguf(g).map_err(|e| e.to_string())?;
    let vocab = validate_vocab(g).map_err(|e| e.to_string())?;
    validate_tensors(g, &hp, vocab.n_vocab).map_err(|e| e.to_string())
}

/// Exercises every accessor of a successfully parsed file and checks what the parser guarantees:
/// every value readable and arrays iterable to their end; every tensor valid, its data inside
/// `bytes` with exactly `nbytes` bytes at `data_start + offset`, `nbytes` consistent with the
/// element count and type, offsets aligned, tensors not overlapping.
pub fn check_parsed(g: &Gguf<'_>, bytes: &[u8]) {
    let header = g.header();
    assert!(matches!(header.version, 2 | 3));
    let align = g.alignment();
    assert!(align.is_power_of_two() && ALIGNMENT_RANGE.contains(&align), "alignment {align}");
    assert_eq!(g.data_start() % align as usize, 0);
    let _ = format!("{g:?}");

    // Model-level validation must refuse or accept, never panic, on whatever parsed.
    let _ = model_verdict(g);

    let mut n_kv = 0u64;
    for (key, value) in g.metadata() {
        n_kv += 1;
        assert!(!key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic()), "bad key {key:?}");
        walk_value(&value, 0);
        let again = g.get(key).expect("metadata key not found by get");
        assert_eq!(again.value_type(), value.value_type());
        // The typed accessors may refuse a value, never panic.
        let _ = g.get_int::<i64>(key);
        let _ = g.get_int::<u8>(key);
        let _ = g.get_u32(key).map_err(|e| e.to_string());
        let _ = g.get_u64(key);
        let _ = g.get_f32(key).map_err(|e| e.to_string());
        let _ = g.get_f32_opt(key);
        let _ = g.get_bool_opt(key);
        let _ = g.get_str(key).map_err(|e| e.to_string());
        let _ = g.get_str_opt(key);
        let _ = g.require(key);
        for elem in [ValueType::String, ValueType::F32, ValueType::I32, ValueType::U8, ValueType::Array] {
            if let Ok(a) = g.get_array(key, elem) {
                assert_eq!(a.elem_type(), elem);
            }
            let _ = g.get_array_opt(key, elem).map_err(|e| e.to_string());
        }
    }
    assert_eq!(n_kv, header.kv_count, "metadata() lost pairs");
    assert!(g.get("no.such.key").is_none());
    assert!(matches!(g.get_u32("no.such.key"), Err(GgufError::MissingKey { .. })));

    let tensors: Vec<TensorInfo<'_>> = g.tensors().collect();
    assert_eq!(tensors.len(), g.tensor_count());
    assert_eq!(tensors.len() as u64, header.tensor_count, "tensors() lost infos");
    let base = bytes.as_ptr() as usize;
    let mut extents = Vec::new();
    for t in &tensors {
        assert!(!t.name.is_empty() && t.name.len() as u64 <= MAX_TENSOR_NAME_LEN, "name {:?}", t.name);
        assert!((1..=4).contains(&t.n_dims), "n_dims {}", t.n_dims);
        assert!(t.ne.iter().all(|d| (1..=i64::MAX as u64).contains(d)), "ne {:?}", t.ne);
        assert!(t.ne[t.n_dims as usize..].iter().all(|&d| d == 1), "unused dims not 1: {:?}", t.ne);
        let n: u128 = t.ne.iter().map(|&d| u128::from(d)).product();
        assert!(n <= i64::MAX as u128, "element count {n} > i64::MAX");
        assert_eq!(u128::from(t.n_elements()), n);
        let (blk, bb) = (t.ty.block_len() as u128, t.ty.block_bytes() as u128);
        assert!(blk > 0 && bb > 0);
        assert_eq!(u128::from(t.ne[0]) % blk, 0, "{}: ne0 {} not whole blocks", t.name, t.ne[0]);
        assert_eq!(n * bb / blk, u128::from(t.nbytes), "{}: nbytes {} for {n} x {}", t.name, t.nbytes, t.ty);
        assert_eq!(t.offset % u64::from(align), 0, "{}: offset {} unaligned", t.name, t.offset);
        assert_eq!(u128::from(t.row_bytes()) * u128::from(t.n_rows()), u128::from(t.nbytes));
        assert_eq!(g.tensor(t.name).as_ref(), Some(t), "tensor(name) finds another info");

        let data = g.tensor_data(t);
        assert_eq!(data.len() as u64, t.nbytes, "{}: tensor_data has the wrong length", t.name);
        let start = data.as_ptr() as usize - base;
        assert!(
            start <= bytes.len() && data.len() <= bytes.len() - start,
            "{}: data outside the file",
            t.name
        );
        assert_eq!(
            start as u128,
            g.data_start() as u128 + u128::from(t.offset),
            "{}: data not at offset",
            t.name
        );
        extents.push((start, start + data.len(), t.name));
    }
    assert!(g.tensor("no.such.tensor").is_none());
    extents.sort_unstable();
    for pair in extents.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "tensors {} and {} overlap", pair[0].2, pair[1].2);
    }
}

/// An error's text, which must not be empty (formatting it must not panic either).
pub fn describe(e: &GgufError) -> String {
    let text = e.to_string();
    assert!(!text.is_empty());
    let _ = format!("{e:?}");
    text
}

/// Width of the tiny test models.
pub const E: u64 = 64;
const HEADS: u32 = 4;
const KV_HEADS: u32 = 2;
const FF: u64 = 96;
/// Vocabulary of the tiny test models.
pub const VOCAB: usize = 40;

fn tokens() -> Vec<String> {
    (0..VOCAB).map(|i| format!("t{i}")).collect()
}

/// A complete, valid tiny model of `arch` (any supported architecture; lfm2's layer 0 is a
/// short-convolution block).
pub fn tiny_model(arch: &str) -> GgufBuilder {
    let k = |s: &str| format!("{arch}.{s}");
    let toks = tokens();
    let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
    let mut b = GgufBuilder::new()
        .kv("general.architecture", Val::str(arch))
        .kv(&k("block_count"), Val::U32(2))
        .kv(&k("context_length"), Val::U32(128))
        .kv(&k("embedding_length"), Val::U32(E as u32))
        .kv(&k("feed_forward_length"), Val::U32(FF as u32))
        .kv(&k("attention.head_count"), Val::U32(HEADS))
        .kv(&k("attention.head_count_kv"), Val::U32(KV_HEADS))
        .kv(&k("attention.layer_norm_rms_epsilon"), Val::F32(1e-6))
        .kv(&k("rope.freq_base"), Val::F32(10000.0))
        .kv("tokenizer.ggml.model", Val::str("gpt2"))
        .kv("tokenizer.ggml.tokens", Val::strs(&refs))
        .kv("tokenizer.ggml.token_type", Val::Array(5, vec![Val::I32(1); VOCAB]))
        .kv("tokenizer.ggml.merges", Val::strs(&["t1 t2", "t3 t4"]))
        .kv("tokenizer.ggml.bos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(2));
    if arch == "gemma3" {
        b = b.kv(&k("attention.sliding_window"), Val::U32(32));
    }
    if arch == "granite" {
        b = b.kv(&k("logit_scale"), Val::F32(8.0)).kv(&k("residual_scale"), Val::F32(0.22));
    }
    if arch == "qwen2vl" {
        // M-RoPE over the 8 rotated pairs of a head of 16: 2 by time, 3 by row, 3 by column.
        let sections = [2, 3, 3, 0].map(Val::U32).to_vec();
        b = b.kv(&k("rope.dimension_sections"), Val::Array(4, sections));
    }
    let lfm2 = arch.starts_with("lfm2");
    // Qwen3.5: layer 0 runs the gated delta rule (heads of 16: 2 query/key, 4 value), layer 1
    // attends with an output gate.
    let qwen35 = arch == "qwen35";
    let (dk, nk, nv) = (16u64, 2u64, 4u64);
    if qwen35 {
        b = b
            .kv(&k("full_attention_interval"), Val::U32(2))
            .kv(&k("ssm.conv_kernel"), Val::U32(4))
            .kv(&k("ssm.state_size"), Val::U32(dk as u32))
            .kv(&k("ssm.group_count"), Val::U32(nk as u32))
            .kv(&k("ssm.time_step_rank"), Val::U32(nv as u32))
            .kv(&k("ssm.inner_size"), Val::U32((nv * dk) as u32));
    }
    if lfm2 {
        b.kvs.retain(|(key, _)| *key != k("attention.head_count_kv"));
        b = b
            .kv(&k("attention.head_count_kv"), Val::Array(4, vec![Val::U32(0), Val::U32(KV_HEADS)]))
            .kv(&k("shortconv.l_cache"), Val::U32(3));
    }
    let moe = arch.ends_with("moe");
    if moe {
        b = b
            .kv(&k("expert_count"), Val::U32(4))
            .kv(&k("expert_used_count"), Val::U32(2))
            .kv(&k("expert_feed_forward_length"), Val::U32(FF as u32));
        if arch == "qwen2moe" {
            b = b.kv(&k("expert_shared_feed_forward_length"), Val::U32(64));
        }
        if arch == "lfm2moe" {
            // Layer 0 dense, layer 1 experts chosen by biased sigmoid scores.
            b = b.kv(&k("leading_dense_block_count"), Val::U32(1)).kv(&k("expert_gating_func"), Val::U32(2));
        }
    }
    let (v, hd) = (VOCAB as u64, E / u64::from(HEADS));
    let kvw = hd * u64::from(KV_HEADS);
    let output_norm = if lfm2 { "token_embd_norm.weight" } else { "output_norm.weight" };
    b = b.tensor("token_embd.weight", &[E, v], ggml::Q8_0).tensor(output_norm, &[E], ggml::F32);
    for i in 0..2 {
        let t = |b: GgufBuilder, n: &str, dims: &[u64], ty| b.tensor(&format!("blk.{i}.{n}"), dims, ty);
        b = t(b, "attn_norm.weight", &[E], ggml::F32);
        if qwen35 && i == 0 {
            let ch = (2 * nk + nv) * dk;
            b = t(b, "attn_qkv.weight", &[E, ch], ggml::Q4_0);
            b = t(b, "attn_gate.weight", &[E, nv * dk], ggml::Q4_0);
            b = t(b, "ssm_conv1d.weight", &[4, ch], ggml::F32);
            b = t(b, "ssm_dt.bias", &[nv], ggml::F32);
            b = t(b, "ssm_a", &[nv], ggml::F32);
            b = t(b, "ssm_beta.weight", &[E, nv], ggml::F32);
            b = t(b, "ssm_alpha.weight", &[E, nv], ggml::F32);
            b = t(b, "ssm_norm.weight", &[dk], ggml::F32);
            b = t(b, "ssm_out.weight", &[nv * dk, E], ggml::Q4_0);
        } else if qwen35 {
            b = t(b, "attn_q.weight", &[E, 2 * E], ggml::Q4_0);
            b = t(b, "attn_k.weight", &[E, kvw], ggml::Q4_0);
            b = t(b, "attn_v.weight", &[E, kvw], ggml::Q4_0);
        } else if lfm2 && i == 0 {
            b = t(b, "shortconv.in_proj.weight", &[E, 3 * E], ggml::Q4_0);
            b = t(b, "shortconv.conv.weight", &[3, E], ggml::F32);
            b = t(b, "shortconv.out_proj.weight", &[E, E], ggml::Q4_0);
        } else if arch == "phi3" {
            b = t(b, "attn_qkv.weight", &[E, E + 2 * kvw], ggml::Q4_0);
        } else {
            b = t(b, "attn_q.weight", &[E, E], ggml::Q4_0);
            b = t(b, "attn_k.weight", &[E, kvw], ggml::Q4_0);
            b = t(b, "attn_v.weight", &[E, kvw], ggml::Q4_0);
        }
        if !((lfm2 || qwen35) && i == 0) {
            b = t(b, "attn_output.weight", &[E, E], ggml::Q4_0);
        }
        b = t(b, if qwen35 { "post_attention_norm.weight" } else { "ffn_norm.weight" }, &[E], ggml::F32);
        if arch.starts_with("qwen2") {
            b = t(b, "attn_q.bias", &[E], ggml::F32);
            b = t(b, "attn_k.bias", &[kvw], ggml::F32);
            b = t(b, "attn_v.bias", &[kvw], ggml::F32);
        }
        if matches!(arch, "qwen3" | "qwen3moe" | "gemma3") || ((lfm2 || qwen35) && i == 1) {
            b = t(b, "attn_q_norm.weight", &[hd], ggml::F32);
            b = t(b, "attn_k_norm.weight", &[hd], ggml::F32);
        }
        if arch == "gemma3" {
            b = t(b, "post_attention_norm.weight", &[E], ggml::F32);
            b = t(b, "post_ffw_norm.weight", &[E], ggml::F32);
        }
        if moe && !(arch == "lfm2moe" && i == 0) {
            if arch == "lfm2moe" {
                b = t(b, "exp_probs_b.bias", &[4], ggml::F32);
            }
            b = t(b, "ffn_gate_inp.weight", &[E, 4], ggml::F32);
            b = t(b, "ffn_gate_exps.weight", &[E, FF, 4], ggml::Q4_0);
            b = t(b, "ffn_up_exps.weight", &[E, FF, 4], ggml::Q4_0);
            b = t(b, "ffn_down_exps.weight", &[FF, E, 4], ggml::Q4_0);
        } else if arch == "phi3" {
            b = t(b, "ffn_up.weight", &[E, 2 * FF], ggml::Q4_0);
            b = t(b, "ffn_down.weight", &[FF, E], ggml::Q4_0);
        } else {
            b = t(b, "ffn_gate.weight", &[E, FF], ggml::Q4_0);
            b = t(b, "ffn_up.weight", &[E, FF], ggml::Q4_0);
            b = t(b, "ffn_down.weight", &[FF, E], ggml::Q4_0);
        }
        if arch == "qwen2moe" {
            b = t(b, "ffn_gate_inp_shexp.weight", &[E], ggml::F32);
            b = t(b, "ffn_gate_shexp.weight", &[E, 64], ggml::Q4_0);
            b = t(b, "ffn_up_shexp.weight", &[E, 64], ggml::Q4_0);
            b = t(b, "ffn_down_shexp.weight", &[64, E], ggml::Q4_0);
        }
    }
    b
}
