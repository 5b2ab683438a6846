//! Unit tests of the parser on small hand-built files; the hostile corpus is in tests/hostile_gguf.rs.

use std::string::ToString;
use std::vec::Vec;

use super::*;

/// Little-endian GGUF bytes written field by field, so tests can put any value in any field.
#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn header(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut b = Bytes::default();
        b.raw(b"GGUF").u32(version).u64(tensors).u64(kvs);
        b
    }
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad_to(&mut self, align: usize) -> &mut Self {
        while self.0.len() % align != 0 {
            self.0.push(0);
        }
        self
    }
}

fn small_model() -> Vec<u8> {
    let mut b = Bytes::header(3, 2, 4);
    b.str("general.architecture").u32(8).str("llama");
    b.kv_u32("llama.block_count", 2);
    b.str("general.name").u32(8).str("tiny");
    b.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(3).str("a").str("b").str("c");
    b.tensor("token_embd.weight", &[4, 3], 0, 0);
    b.tensor("blk.0.attn_q.weight", &[32, 2], 2, 64);
    b.pad_to(32);
    b.raw(&[0u8; 48]).raw(&[0u8; 16]).raw(&[0u8; 36]);
    b.0
}

#[test]
fn parses_metadata_and_tensors() {
    let bytes = small_model();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.header().version, 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 2);
    let tokens = g.get_array("tokenizer.ggml.tokens", ValueType::String).unwrap();
    let texts: Vec<&str> = tokens.iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(texts, ["a", "b", "c"]);
    assert_eq!(g.tensor_count(), 2);
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.ty, q.ne, q.nbytes, q.n_rows(), q.row_bytes()), (GgmlType::Q4_0, [32, 2, 1, 1], 36, 2, 18));
    assert_eq!(g.tensor_data(&q).len(), 36);
    assert_eq!(g.data_start() % 32, 0);
    assert_eq!(g.metadata().count(), 4);
}

#[test]
fn typed_accessors_name_the_key_and_type() {
    let bytes = small_model();
    let g = Gguf::parse(&bytes).unwrap();
    let missing = g.get_u32("llama.context_length").unwrap_err();
    assert_eq!(missing.to_string(), "metadata key \"llama.context_length\" is missing");
    let wrong = g.get_u32("general.name").unwrap_err();
    assert_eq!(wrong.to_string(), "metadata key \"general.name\" holds string, expected an integer");
    assert!(g.get_int::<u8>("llama.block_count").unwrap() == Some(2));
    let arr = g.get_array("tokenizer.ggml.tokens", ValueType::F32).unwrap_err();
    assert!(arr.to_string().contains("float32"), "{arr}");
}

#[test]
fn truncation_anywhere_is_an_error() {
    let bytes = small_model();
    for cut in 0..bytes.len() {
        assert!(Gguf::parse(&bytes[..cut]).is_err(), "accepted a file cut at {cut} of {}", bytes.len());
    }
}

#[test]
fn refuses_old_big_endian_and_foreign_files() {
    let msg = |b: &[u8]| Gguf::parse(b).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg(&Bytes::header(1, 0, 0).0).contains("version 1 is obsolete"));
    assert!(msg(&Bytes::header(3u32.swap_bytes(), 0, 0).0).contains("big-endian"));
    assert!(msg(&Bytes::header(4, 0, 0).0).contains("version 4"));
    assert!(msg(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    assert!(Gguf::parse(&Bytes::header(3, 0, 0).0).is_ok(), "an empty file with no keys is valid");
}

#[test]
fn hostile_counts_fail_before_any_loop() {
    for (tensors, kvs) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 0), (MAX_TENSORS as u64 + 1, 0)] {
        let err = Gguf::parse(&Bytes::header(3, tensors, kvs).0).unwrap_err();
        assert!(matches!(err, GgufError::TooLarge { .. }), "{err}");
    }
}

#[test]
fn alignment_must_be_u32_power_of_two_in_range() {
    for (ty, value, ok) in
        [(4u32, 64u32, true), (4, 13, false), (4, 4, false), (4, 1 << 20, false), (5, 32, false)]
    {
        let mut b = Bytes::header(3, 0, 1);
        b.str("general.alignment").u32(ty).u32(value);
        assert_eq!(Gguf::parse(&b.0).is_ok(), ok, "type {ty} value {value}");
    }
}
