//! The hostile-input corpus for the GGUF parser, generated here (nothing is committed but this code).
//!
//! Every attack class of `docs/gguf-hostile-input.md` that applies to the container is a named case:
//! it must be refused with `Err` (the right variant, a message naming the field), never a panic,
//! without allocating and within a time bound. Valid edge cases must load and read back exactly.
//! Then a valid file is cut at every byte, and mutated by a seeded structure-aware mutator many
//! thousands of times; every accepted mutant has all its accessors walked and its invariants checked
//! (`common::check_parsed`, shared with the cargo-fuzz target in `fuzz/`).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use common::{
    check_parsed, describe, ggml, rich_model, tag, tiny_model, vocab_only_model, Built, Bytes, GgufBuilder,
    Val,
};
use pinfer::gguf::{
    read_header, Gguf, GgufError, Value, ValueType, MAX_ARRAY_DEPTH, MAX_KEY_LEN, MAX_KV, MAX_STRING_LEN,
    MAX_TENSORS, MAX_TENSOR_NAME_LEN,
};
use pinfer::quant::GgmlType;

// ---------------------------------------------------------------------------------------------
// Harness: an allocation counter (the parser promises not to allocate, so a hostile size can
// never become a large allocation), a clock, and the expected error.

struct CountingAlloc;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    let _ = ALLOCATED.try_with(|a| a.set(a.get() + bytes));
}

// SAFETY: every method forwards to `System` unchanged; the counter is a const-initialised
// thread-local `Cell` without destructor, so touching it never allocates or recurses.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn allocated() -> usize {
    ALLOCATED.with(Cell::get)
}

/// Whether this build runs under qemu-user (the aarch64 tier), which is 10-50x slower.
const EMULATED: bool = cfg!(target_arch = "aarch64");

/// The longest one parse of a small hostile file may take (generous: they take microseconds; an
/// endless or quadratic loop takes far longer).
fn parse_limit() -> Duration {
    Duration::from_millis(if EMULATED { 10_000 } else { 1_000 })
}

/// Parses `bytes`, asserting that the parser allocated nothing and returned within the time limit.
fn parse_watched<'a>(case: &str, bytes: &'a [u8]) -> Result<Gguf<'a>, GgufError> {
    let before = allocated();
    let start = Instant::now();
    let result = Gguf::parse(bytes);
    let took = start.elapsed();
    let grew = allocated() - before;
    assert_eq!(grew, 0, "{case}: the parser allocated {grew} bytes");
    assert!(took < parse_limit(), "{case}: parse took {took:?} for {} bytes", bytes.len());
    result
}

/// Asserts that `bytes` is refused with an error `expected` accepts, whose message names the field
/// or problem; returns the error.
#[track_caller]
fn refuse(case: &str, bytes: &[u8], expected: impl Fn(&GgufError) -> bool) -> GgufError {
    let err = match parse_watched(case, bytes) {
        Ok(g) => panic!("{case}: ACCEPTED a hostile file of {} bytes: {g:?}", bytes.len()),
        Err(e) => e,
    };
    let text = describe(&err);
    assert!(expected(&err), "{case}: wrong error {err:?}\n  ({text})");
    match &err {
        GgufError::Truncated { what, .. }
        | GgufError::TooLarge { what, .. }
        | GgufError::Invalid { what, .. } => {
            assert!(text.contains(what), "{case}: message does not name the field {what:?}: {text}")
        }
        GgufError::BadKey { problem, .. } | GgufError::BadTensor { problem, .. } => {
            assert!(text.contains(problem), "{case}: message does not say {problem:?}: {text}")
        }
        _ => {}
    }
    err
}

/// Asserts that `bytes` loads, and walks every accessor of the result.
#[track_caller]
fn load<'a>(case: &str, bytes: &'a [u8]) -> Gguf<'a> {
    let g = parse_watched(case, bytes).unwrap_or_else(|e| panic!("{case}: refused a valid file: {e}"));
    check_parsed(&g, bytes);
    g
}

fn any(_: &GgufError) -> bool {
    true
}

fn truncated(field: &'static str) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::Truncated { what, .. } if *what == field)
}

fn too_large(field: &'static str) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::TooLarge { what, .. } if *what == field)
}

/// `TooLarge` for `field` holding `found`, with `max` as the limit.
fn too_large_exactly(field: &'static str, found: u64, limit: u64) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::TooLarge { what, value, max, .. } if *what == field && *value == found && *max == limit)
}

fn invalid(field: &'static str, found: u64) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::Invalid { what, value, .. } if what.starts_with(field) && *value == found)
}

fn bad_key(problem: &'static str) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::BadKey { problem: p, .. } if p.contains(problem))
}

fn bad_tensor(problem: &'static str) -> impl Fn(&GgufError) -> bool {
    move |e| matches!(e, GgufError::BadTensor { problem: p, .. } if p.contains(problem))
}

/// A file with no tensors and one metadata pair, written by `f` after the header.
fn one_kv(f: impl FnOnce(&mut Bytes)) -> Vec<u8> {
    let mut b = Bytes::header(3, 0, 1);
    f(&mut b);
    b.into_vec()
}

/// A file with `n` tensor infos written by `f`, padding to 32 and `data` bytes of data.
fn with_tensors(n: u64, data: usize, f: impl FnOnce(&mut Bytes)) -> Vec<u8> {
    let mut b = Bytes::header(3, n, 0);
    f(&mut b);
    b.pad_to(32).pattern(data, 0x5a);
    b.into_vec()
}

/// A file with one tensor info (`name`, `dims`, `ty`, `offset`) and `data` bytes of data.
fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
    with_tensors(1, data, |b| {
        b.tensor(b"t", dims, ty, offset);
    })
}

// ---------------------------------------------------------------------------------------------
// 1. Header

#[test]
fn header_magic_version_and_short_files() {
    refuse("empty file", &[], truncated("GGUF magic"));
    let header = Bytes::header(3, 0, 0).into_vec();
    assert_eq!(header.len(), 24);
    for n in 1..24 {
        let field = match n {
            0..=3 => "GGUF magic",
            4..=7 => "GGUF version",
            8..=15 => "tensor count",
            _ => "metadata count",
        };
        refuse(&format!("{n}-byte file"), &header[..n], truncated(field));
        assert!(read_header(&header[..n]).is_err());
    }
    let g = load("24-byte file: no tensors, no keys", &header);
    assert_eq!((g.tensor_count(), g.metadata().count(), g.header().version), (0, 0, 3));

    for magic in [*b"GGML", *b"FUGG", *b"gguf", *b"GGUG", [0; 4], [0xff; 4], *b"\x89PNG"] {
        let mut b = Bytes::new();
        b.raw(&magic).u32(3).u64(0).u64(0);
        let e = refuse(&format!("magic {magic:02x?}"), &b.buf, |e| matches!(e, GgufError::BadMagic { .. }));
        assert_eq!(e, GgufError::BadMagic { found: magic });
    }

    for version in
        [0, 1, 4, 5, 0x0100, 0x0003_0000, 2u32.swap_bytes(), 3u32.swap_bytes(), i32::MAX as u32, u32::MAX]
    {
        let bytes = Bytes::header(version, 0, 0).into_vec();
        let e = refuse(&format!("version {version:#x}"), &bytes, |e| {
            *e == GgufError::UnsupportedVersion { version }
        });
        assert_eq!(read_header(&bytes), Err(e.clone()));
        let text = e.to_string();
        match version {
            0x0200_0000 | 0x0300_0000 => assert!(text.contains("big-endian"), "{text}"),
            1 => assert!(text.contains("obsolete"), "{text}"),
            _ => assert!(text.contains(&version.to_string()), "{text}"),
        }
    }
    load("version 2", &Bytes::header(2, 0, 0).buf);
    // A whole big-endian file (magic bytes are the same, every number swapped).
    let mut be = Bytes::new();
    be.raw(b"GGUF").raw(&3u32.to_be_bytes()).raw(&0u64.to_be_bytes()).raw(&1u64.to_be_bytes());
    refuse("big-endian file", &be.buf, |e| {
        matches!(e, GgufError::UnsupportedVersion { version: 0x0300_0000 })
    });
}

#[test]
fn header_counts_beyond_bounds_or_the_bytes() {
    for (what, n) in [
        ("u64::MAX", u64::MAX),
        ("2^63", 1 << 63),
        ("2^63-1", i64::MAX as u64),
        ("2^32 (a u32 truncation gives 0)", 1 << 32),
        ("2^32+1 (a u32 truncation gives 1)", (1 << 32) + 1),
        ("2^40", 1 << 40),
    ] {
        refuse(&format!("tensor count {what}"), &Bytes::header(3, n, 0).buf, too_large("tensor count"));
        refuse(&format!("metadata count {what}"), &Bytes::header(3, 0, n).buf, too_large("metadata count"));
        refuse(&format!("both counts {what}"), &Bytes::header(3, n, n).buf, too_large("tensor count"));
    }

    // Just above the caps, with enough bytes after the header that only the cap can refuse them.
    let (t, k) = (MAX_TENSORS as u64, MAX_KV as u64);
    let mut b = Bytes::header(3, t + 1, 0);
    b.zeros((MAX_TENSORS + 1) * 33);
    refuse("tensor count MAX_TENSORS+1", &b.buf, too_large_exactly("tensor count", t + 1, t));
    let mut b = Bytes::header(3, 0, k + 1);
    b.zeros((MAX_KV + 1) * 14);
    refuse("metadata count MAX_KV+1", &b.buf, too_large_exactly("metadata count", k + 1, k));

    // Just above what the remaining bytes can hold: a tensor info takes >= 33 bytes, a pair >= 14.
    let mut b = Bytes::header(3, 100 / 33 + 1, 0);
    b.zeros(100);
    refuse("tensor count > remaining/33", &b.buf, too_large_exactly("tensor count", 4, 3));
    let mut b = Bytes::header(3, 0, 100 / 14 + 1);
    b.zeros(100);
    refuse("metadata count > remaining/14", &b.buf, too_large_exactly("metadata count", 8, 7));
    // Within that bound, but the records are not there (zeros: an empty key / an empty name).
    let mut b = Bytes::header(3, 0, 7);
    b.zeros(100);
    refuse("7 pairs declared, zeros follow", &b.buf, bad_key("empty key"));
    let mut b = Bytes::header(3, 3, 0);
    b.zeros(100);
    refuse("3 tensors declared, zeros follow", &b.buf, bad_tensor("empty name"));
    // One pair declared, one present, a second declared: the file ends inside the second.
    let mut b = Bytes::header(3, 0, 2);
    b.kv("a", &Val::U64(7)).lying_str(5, b"ab");
    assert_eq!(b.len() - 24, 2 * 14 + 3, "the count must pass the remaining/14 bound");
    refuse("second pair missing", &b.buf, truncated("metadata key"));
    // Two tensors declared, one info present.
    let mut b = Bytes::header(3, 2, 0);
    b.tensor(b"a", &[8], ggml::F32, 0).zeros(8);
    refuse("second tensor info missing", &b.buf, any);
}

// ---------------------------------------------------------------------------------------------
// 2. Keys and strings

#[test]
fn keys_lengths_charset_and_duplicates() {
    let key_of_len = |len: u64, present: usize| {
        one_kv(|b| {
            b.lying_str(len, &vec![b'k'; present]).u32(tag::U32).u32(1);
        })
    };
    refuse(
        "key length u64::MAX",
        &key_of_len(u64::MAX, 8),
        too_large_exactly("metadata key", u64::MAX, MAX_KEY_LEN),
    );
    refuse("key length 2^63", &key_of_len(1 << 63, 8), too_large("metadata key"));
    let over = MAX_KEY_LEN + 1;
    refuse(
        "key length MAX_KEY_LEN+1",
        &key_of_len(over, over as usize),
        too_large_exactly("metadata key", over, 256),
    );
    let g_bytes = key_of_len(MAX_KEY_LEN, MAX_KEY_LEN as usize);
    let g = load("key of exactly MAX_KEY_LEN bytes", &g_bytes);
    assert_eq!(g.get_u32(&"k".repeat(MAX_KEY_LEN as usize)).unwrap(), 1);
    // A length the bound allows but the file cannot hold.
    refuse("key length > remaining", &key_of_len(200, 10), truncated("metadata key"));

    refuse(
        "empty key",
        &one_kv(|b| {
            b.kv_head(b"", tag::U8).u8(1).zeros(8);
        }),
        bad_key("empty key"),
    );
    for key in [
        "clé".as_bytes(),
        "ключ".as_bytes(),
        b"a b",
        b"a\tb",
        b"a\nb",
        b"a\0b",
        b"\x7f",
        b"\x1b[31m",
        b"\xff\xfe",
        b"general.name\0",
    ] {
        let bytes = one_kv(|b| {
            b.kv_head(key, tag::U8).u8(1);
        });
        refuse(&format!("key {key:?}"), &bytes, bad_key("not printable ASCII"));
    }

    let mut b = Bytes::header(3, 0, 3);
    b.kv("general.name", &Val::str("a")).kv("x", &Val::U8(1)).kv("general.name", &Val::str("b"));
    let e = refuse("duplicate key", &b.buf, bad_key("twice"));
    assert!(e.to_string().contains("general.name"), "{e}");
    // The same key with another type is still a duplicate.
    let mut b = Bytes::header(3, 0, 2);
    b.kv("llama.block_count", &Val::U32(2)).kv("llama.block_count", &Val::I64(3));
    refuse("duplicate key, different types", &b.buf, bad_key("twice"));
}

#[test]
fn string_values_longer_than_the_cap_or_the_file() {
    let string_of_len = |len: u64, present: usize| {
        one_kv(|b| {
            b.kv_head(b"s", tag::STRING).lying_str(len, &vec![b's'; present]);
        })
    };
    refuse("string length u64::MAX", &string_of_len(u64::MAX, 4), too_large("string value"));
    refuse("string length 2^63", &string_of_len(1 << 63, 4), too_large("string value"));
    let over = MAX_STRING_LEN + 1;
    refuse(
        "string length MAX_STRING_LEN+1",
        &string_of_len(over, 16),
        too_large_exactly("string value", over, MAX_STRING_LEN),
    );
    refuse("string length > file", &string_of_len(1000, 10), truncated("string value"));
    refuse("string one byte short", &string_of_len(10, 9), truncated("string value"));
    let full = string_of_len(MAX_STRING_LEN, MAX_STRING_LEN as usize);
    let g = load("string of exactly MAX_STRING_LEN bytes", &full);
    assert_eq!(g.get_str("s").unwrap().len() as u64, MAX_STRING_LEN);
    // Non-UTF-8 string values parse (the format says UTF-8; as_str and get_str check it).
    let bytes = one_kv(|b| {
        b.kv_head(b"s", tag::STRING).bstr(b"\xff\xfe");
    });
    let g = load("non-UTF-8 string value", &bytes);
    assert!(matches!(g.get_str("s"), Err(GgufError::BadValue { .. })));
    assert_eq!(g.get("s"), Some(Value::String(b"\xff\xfe")));
}

// ---------------------------------------------------------------------------------------------
// 3. Value types

#[test]
fn value_type_tags_and_bools() {
    for t in [13, 14, 0x7fff_ffff, 0x8000_0000, u32::MAX] {
        let bytes = one_kv(|b| {
            b.kv_head(b"k", t).u64(0);
        });
        refuse(&format!("value type {t:#x}"), &bytes, invalid("metadata value type", u64::from(t)));
    }
    for byte in [2u8, 0x80, 0xff] {
        let bytes = one_kv(|b| {
            b.kv_head(b"k", tag::BOOL).u8(byte);
        });
        refuse(&format!("bool byte {byte:#x}"), &bytes, invalid("bool value", u64::from(byte)));
    }
    for (byte, value) in [(0u8, false), (1, true)] {
        let bytes = one_kv(|b| {
            b.kv_head(b"k", tag::BOOL).u8(byte);
        });
        assert_eq!(load("bool 0/1", &bytes).get_bool_opt("k").unwrap(), Some(value));
    }
    // Every fixed-size value one byte short of the end of the file.
    for t in tag::ALL {
        let Some(size) = tag::fixed_size(t) else { continue };
        let bytes = one_kv(|b| {
            b.kv_head(b"k", t).zeros(size - 1);
        });
        if size > 1 {
            refuse(&format!("type {t} value cut"), &bytes, truncated("metadata value"));
        } else {
            refuse(&format!("type {t} value missing"), &bytes, any);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Arrays

/// A pair "a" holding an array of `elem` with `count` elements, followed by `rest` zero bytes.
fn array_file(elem: u32, count: u64, rest: usize) -> Vec<u8> {
    one_kv(|b| {
        b.kv_head(b"a", tag::ARRAY).array_head(elem, count).zeros(rest);
    })
}

/// `levels` arrays nested in each other, the innermost holding one u8.
fn nested_arrays(levels: usize) -> Vec<u8> {
    one_kv(|b| {
        b.kv_head(b"deep", tag::ARRAY);
        for _ in 1..levels {
            b.array_head(tag::ARRAY, 1);
        }
        b.array_head(tag::U8, 1).u8(7);
    })
}

#[test]
fn array_counts_beyond_the_bytes() {
    for elem in tag::ALL {
        refuse(
            &format!("array<{elem}> count u64::MAX"),
            &array_file(elem, u64::MAX, 64),
            too_large("array length"),
        );
        refuse(
            &format!("array<{elem}> count 2^63"),
            &array_file(elem, 1 << 63, 64),
            too_large("array length"),
        );
        // Just above what the 40 bytes left can hold, for each element size; exactly that loads.
        let min = match elem {
            tag::STRING => 8,
            tag::ARRAY => 12,
            t => tag::fixed_size(t).unwrap(),
        };
        let fits = (40 / min) as u64;
        let case = format!("array<{elem}> count remaining/{min}+1");
        refuse(&case, &array_file(elem, fits + 1, 40), too_large_exactly("array length", fits + 1, fits));
        let bytes = array_file(elem, fits, 40);
        let g = load(&format!("array<{elem}> count remaining/{min}"), &bytes);
        let Some(Value::Array(a)) = g.get("a") else { panic!("array<{elem}> not read back") };
        assert_eq!((a.len() as u64, a.iter().count() as u64), (fits, fits));
    }
    // count * elem_size wraps u64 to 0 (or to a small number).
    refuse(
        "array<u16> count 2^63 (x2 wraps to 0)",
        &array_file(tag::U16, 1 << 63, 16),
        too_large("array length"),
    );
    refuse(
        "array<u32> count 2^62 (x4 wraps to 0)",
        &array_file(tag::U32, 1 << 62, 16),
        too_large("array length"),
    );
    refuse(
        "array<u64> count 2^61 (x8 wraps to 0)",
        &array_file(tag::U64, 1 << 61, 16),
        too_large("array length"),
    );
    refuse(
        "array<f64> count 2^61+1 (x8 wraps to 8)",
        &array_file(tag::F64, (1 << 61) + 1, 16),
        too_large("array length"),
    );
    // Strings: count > remaining/8, and count within it but every length absurd.
    refuse("array<string> count 11 in 80 bytes", &array_file(tag::STRING, 11, 80), too_large("array length"));
    let bytes = one_kv(|b| {
        b.kv_head(b"a", tag::ARRAY).array_head(tag::STRING, 10).raw(&[0xff; 80]);
    });
    refuse("array<string> of u64::MAX-long strings", &bytes, too_large("string value"));
    let bytes = one_kv(|b| {
        b.kv_head(b"a", tag::ARRAY).array_head(tag::STRING, 2).str("ok").lying_str(50, b"x");
    });
    refuse("array<string> with a string past the end", &bytes, truncated("string value"));
    // Fixed elements one byte short.
    refuse("array<u32> one byte short", &array_file(tag::U32, 3, 11), too_large("array length"));
}

#[test]
fn array_of_length_2_pow_63_is_refused_fast() {
    // gguf-py loops forever on this (llama.cpp PR 27188): magic, version, counts, a 1-byte key,
    // type ARRAY, element type, length 2^63 -- 49 bytes, nothing after.
    let bytes = array_file(tag::U8, 1 << 63, 0);
    assert_eq!(bytes.len(), 49);
    let e = refuse("49-byte file, array length 2^63", &bytes, too_large_exactly("array length", 1 << 63, 0));
    assert!(e.to_string().contains("9223372036854775808"), "{e}");
    // The same file cut to 43 bytes: the length field itself is incomplete.
    refuse("43-byte file, array length cut", &bytes[..43], truncated("array length"));
    for elem in [tag::STRING, tag::ARRAY, tag::U64] {
        refuse("array length 2^63", &array_file(elem, 1 << 63, 0), too_large("array length"));
    }
    let runs = if EMULATED { 2_000 } else { 20_000 };
    let start = Instant::now();
    for _ in 0..runs {
        assert!(Gguf::parse(&bytes).is_err());
    }
    let per = start.elapsed() / runs;
    assert!(per < Duration::from_micros(if EMULATED { 500 } else { 50 }), "{per:?} per parse");
}

#[test]
fn array_nesting_and_element_types() {
    let depth = MAX_ARRAY_DEPTH as usize;
    let bytes = nested_arrays(depth);
    let g = load("arrays nested MAX_ARRAY_DEPTH deep", &bytes);
    let mut v = g.get("deep").unwrap();
    for _ in 1..depth {
        let Value::Array(a) = v else { panic!("not an array: {v:?}") };
        assert_eq!((a.elem_type(), a.len()), (ValueType::Array, 1));
        v = a.iter().next().unwrap();
    }
    let Value::Array(inner) = v else { panic!("not an array: {v:?}") };
    assert_eq!(inner.iter().collect::<Vec<_>>(), [Value::U8(7)]);

    let too_deep = MAX_ARRAY_DEPTH + 1;
    refuse(
        "arrays nested MAX_ARRAY_DEPTH+1 deep",
        &nested_arrays(too_deep as usize),
        too_large_exactly("array nesting depth", u64::from(too_deep), u64::from(MAX_ARRAY_DEPTH)),
    );
    // 100k levels (1.2 MB): refused at the bound, no recursion to the bottom (no stack overflow).
    refuse("arrays nested 100000 deep", &nested_arrays(100_000), too_large("array nesting depth"));

    for t in [13, 0x7fff_ffff, u32::MAX] {
        refuse(
            &format!("array element type {t:#x}"),
            &array_file(t, 1, 8),
            invalid("array element type", u64::from(t)),
        );
        // An invalid element type inside a nested array.
        let bytes = one_kv(|b| {
            b.kv_head(b"a", tag::ARRAY).array_head(tag::ARRAY, 1).array_head(t, 0).zeros(8);
        });
        refuse(
            &format!("nested array element type {t:#x}"),
            &bytes,
            invalid("array element type", u64::from(t)),
        );
    }
    // Bools inside an array at the end of the file one short.
    refuse("array<bool> one short", &array_file(tag::BOOL, 3, 2), too_large("array length"));
}

#[test]
fn array_of_bools_with_byte_2_is_refused() {
    for byte in [2u8, 0xff] {
        let bytes = one_kv(|b| {
            b.kv_head(b"flags", tag::ARRAY).array_head(tag::BOOL, 2).u8(1).u8(byte);
        });
        refuse(&format!("array<bool> element {byte:#x}"), &bytes, invalid("bool value", u64::from(byte)));
    }
}

// ---------------------------------------------------------------------------------------------
// 5. general.alignment

/// A file whose `general.alignment` is `value`, padded to `pad`, with one 32-byte F32 tensor.
fn alignment_file(value: &Val, pad: usize) -> Vec<u8> {
    let mut b = Bytes::header(3, 1, 1);
    b.kv("general.alignment", value).tensor(b"t", &[8], ggml::F32, 0).pad_to(pad).pattern(32, 1);
    b.into_vec()
}

#[test]
fn alignment_values_and_types() {
    for a in [0u32, 1, 2, 4, 13, 24, 48, 1 << 17, 1 << 20, 1 << 31, u32::MAX] {
        let bytes = alignment_file(&Val::U32(a), 32);
        refuse(&format!("alignment {a}"), &bytes, invalid("general.alignment", u64::from(a)));
    }
    for a in [8u32, 16, 32, 64, 4096, 65536] {
        let bytes = alignment_file(&Val::U32(a), a as usize);
        let g = load(&format!("alignment {a}"), &bytes);
        assert_eq!((g.alignment(), g.data_start() % a as usize), (a, 0));
        assert_eq!(g.data_start() + 32, bytes.len());
    }
    for (what, v) in [
        ("int32", Val::I32(32)),
        ("uint64", Val::U64(32)),
        ("uint16", Val::U16(32)),
        ("uint8", Val::U8(32)),
        ("float32", Val::F32(32.0)),
        ("string", Val::str("32")),
        ("array", Val::Array(tag::U32, vec![Val::U32(32)])),
    ] {
        let bytes = alignment_file(&v, 32);
        refuse(&format!("alignment stored as {what}"), &bytes, bad_key("must be uint32"));
    }
    let mut b = Bytes::header(3, 0, 2);
    b.kv("general.alignment", &Val::U32(32)).kv("general.alignment", &Val::U32(64));
    refuse("alignment key twice", &b.buf, bad_key("twice"));
}

#[test]
fn inconsistent_alignment_writer_pads_to_1() {
    // The key says 32 (and without the key the default is 32), the writer padded to 1: the data
    // section then starts where the reader does not look for it.
    for with_key in [true, false] {
        let mut g = GgufBuilder::new();
        if with_key {
            g = g.kv("general.alignment", Val::U32(32));
        }
        g.pad = 1;
        let one = g.clone().tensor("a", &[3], ggml::F32).build();
        assert_ne!(one.infos_end % 32, 0, "the case needs unaligned tensor infos");
        assert_eq!(one.data_start, one.infos_end);
        refuse("pads to 1, one tensor", &one.bytes, bad_tensor("past the end"));
        // Two tensors: the second offset (12) is not a multiple of 32.
        let two = g.tensor("a", &[3], ggml::F32).tensor("b", &[3], ggml::F32).build();
        assert_eq!(two.offsets, [0, 12]);
        refuse("pads to 1, two tensors", &two.bytes, bad_tensor("not a multiple of the alignment"));
    }
    // Custom alignment 64 done right loads.
    let built =
        GgufBuilder::new().alignment(64).tensor("a", &[3], ggml::F32).tensor("b", &[5], ggml::F16).build();
    assert_eq!((built.data_start % 64, built.offsets.as_slice()), (0, [0u64, 64].as_slice()));
    let g = load("alignment 64", &built.bytes);
    assert_eq!(g.tensor("b").unwrap().offset, 64);
}

// ---------------------------------------------------------------------------------------------
// 6. Tensor infos

#[test]
fn tensor_names() {
    let named = |len: u64, name: &[u8]| {
        with_tensors(1, 32, |b| {
            b.lying_str(len, name).u32(1).u64(8).u32(0).u64(0);
        })
    };
    let n64 = [b'n'; 64];
    refuse("name length 64", &named(64, &n64), too_large_exactly("tensor name", 64, MAX_TENSOR_NAME_LEN));
    refuse("name length u64::MAX", &named(u64::MAX, &n64), too_large_exactly("tensor name", u64::MAX, 63));
    refuse("name length 2^63", &named(1 << 63, &n64), too_large("tensor name"));
    let bytes = named(63, &n64[..63]);
    let g = load("name length 63", &bytes);
    assert_eq!(g.tensors().next().unwrap().name.len(), 63);
    let mut b = Bytes::header(3, 1, 0);
    b.lying_str(40, &[b'n'; 30]);
    refuse("name past the end of the file", &b.buf, truncated("tensor name"));

    let e = refuse("empty name", &named(0, b""), bad_tensor("empty name"));
    assert!(matches!(&e, GgufError::BadTensor { name, .. } if name == "#0"), "{e:?}");
    for name in [&b"\xff\xfe"[..], b"\xc0\x80", b"\xed\xa0\x80", b"ok\x80"] {
        refuse(&format!("name {name:02x?}"), &named(name.len() as u64, name), bad_tensor("not UTF-8"));
    }

    let bytes = with_tensors(2, 64, |b| {
        b.tensor(b"w", &[8], ggml::F32, 0).tensor(b"w", &[8], ggml::F32, 32);
    });
    let e = refuse("duplicate tensor names", &bytes, bad_tensor("name used by two tensors"));
    assert!(e.to_string().contains("\"w\""), "{e}");
}

#[test]
fn tensor_dimensions() {
    for n_dims in [0u32, 5, 8, 1 << 16, u32::MAX] {
        // Write as many dims as claimed, up to 8 (Talos 2024-1914 wrote past ne[4]).
        let dims = vec![1u64; (n_dims as usize).min(8)];
        let bytes = with_tensors(1, 32, |b| {
            b.tensor_raw(b"t", n_dims, &dims, ggml::F32, 0);
        });
        refuse(&format!("n_dims {n_dims}"), &bytes, bad_tensor("dimension count"));
    }
    for dims in [[0u64].as_slice(), &[4, 0], &[4, 1, 1, 0]] {
        refuse(
            &format!("zero dimension {dims:?}"),
            &one_tensor(dims, ggml::F32, 0, 64),
            bad_tensor("dimension must be"),
        );
    }
    for d in [1u64 << 63, u64::MAX, (1 << 63) + 32] {
        refuse(
            &format!("dimension {d:#x} > i64::MAX"),
            &one_tensor(&[32, d], ggml::F32, 0, 64),
            bad_tensor("dimension must be"),
        );
    }
    let imax = i32::MAX as u64;
    for (what, dims) in [
        ("4 x i32::MAX", vec![imax; 4]),
        ("2^32 x 2^31 (exactly 2^63)", vec![1 << 32, 1 << 31]),
        ("2^62 x 2 (exactly 2^63)", vec![1 << 62, 2]),
        ("i64::MAX x 2", vec![i64::MAX as u64, 2]),
        ("2^16 x 2^16 x 2^16 x 2^16 (2^64 wraps to 0)", vec![1 << 16; 4]),
        ("3 x 2^62 (negative as i64)", vec![3, 1 << 62]),
    ] {
        refuse(
            &format!("element count {what}"),
            &one_tensor(&dims, ggml::I8, 0, 64),
            bad_tensor("element count overflows"),
        );
    }
    // Exactly i64::MAX elements of I8: the count fits, the data is not there.
    refuse(
        "i64::MAX I8 elements",
        &one_tensor(&[i64::MAX as u64], ggml::I8, 0, 64),
        bad_tensor("past the end"),
    );
    // The element count fits, the byte size does not.
    for (what, dims, ty) in [
        ("I64 x 2^61", vec![1u64 << 61], ggml::I64),
        ("I64 x (u64::MAX/8+1)", vec![u64::MAX / 8 + 1], ggml::I64),
        ("I64 2^30 x 2^31", vec![1 << 30, 1 << 31], ggml::I64),
        ("F32 x 2^62", vec![1 << 62], ggml::F32),
        ("F32 x (u64::MAX/4+1)", vec![u64::MAX / 4 + 1], ggml::F32),
    ] {
        refuse(
            &format!("byte size {what}"),
            &one_tensor(&dims, ty, 0, 64),
            bad_tensor("byte size overflows"),
        );
    }
    // Just below that: the size is representable (u64::MAX-7, u64::MAX-3) and refused by the extent
    // check; with a non-zero offset the extent itself overflows. (GGML_PAD of these wraps to 0.)
    for (dims, ty) in [(u64::MAX / 8, ggml::I64), (u64::MAX / 4, ggml::F32)] {
        refuse("size u64::MAX-k at offset 0", &one_tensor(&[dims], ty, 0, 64), bad_tensor("past the end"));
        refuse(
            "size u64::MAX-k at offset 32",
            &one_tensor(&[dims], ty, 32, 64),
            bad_tensor("extent overflows"),
        );
    }
    // Q4_0 with 2^62 elements: 18 * 2^62 wraps u64, (2^62 / 32) * 18 does not; a parser that
    // multiplies first would report an overflow (or a tiny size) instead of a truncated file.
    let e = refuse("Q4_0 x 2^62", &one_tensor(&[1 << 62], ggml::Q4_0, 0, 64), bad_tensor("past the end"));
    let GgufError::BadTensor { value, .. } = e else { unreachable!() };
    assert_eq!(value, (1u64 << 57) * 18 - 64, "the missing byte count shows the size was computed right");

    // Row length not a whole number of blocks.
    for (ty, ne0) in
        [(ggml::Q4_0, 33u64), (ggml::Q4_0, 16), (ggml::Q8_0, 1), (ggml::Q4_K, 255), (ggml::Q4_K, 32)]
    {
        let e = refuse(
            &format!("type {ty} ne0 {ne0}"),
            &one_tensor(&[ne0, 1], ty, 0, 1024),
            bad_tensor("block length"),
        );
        assert!(matches!(e, GgufError::BadTensor { value, .. } if value == ne0));
    }
    // Only ne0 must be whole blocks.
    load("Q4_0 32 x 33", &one_tensor(&[32, 33], ggml::Q4_0, 0, 18 * 33));
}

#[test]
fn tensor_type_ids() {
    let removed_or_unknown =
        [4u32, 5, 31, 32, 33, 36, 37, 38, 40, 41, 42, 43, 100, 0x7fff_ffff, 0x8000_0000, u32::MAX];
    for id in removed_or_unknown {
        let bytes = one_tensor(&[256], id, 0, 1024);
        refuse(&format!("tensor type {id}"), &bytes, invalid("tensor type id", u64::from(id)));
    }
    // Every other id up to 40 is a known type and loads with one block per row, two rows.
    for id in 0..=40u32 {
        let Some(ty) = GgmlType::from_u32(id) else {
            assert!(removed_or_unknown.contains(&id), "type {id} unexpectedly unknown");
            continue;
        };
        let (len, size) = (ty.block_len() as u64, ty.block_bytes());
        let bytes = one_tensor(&[len, 2], id, 0, 2 * size);
        let g = load(&format!("tensor type {ty}"), &bytes);
        let t = g.tensor("t").unwrap();
        assert_eq!((t.ty, t.nbytes, g.tensor_data(&t).len()), (ty, 2 * size as u64, 2 * size));
    }
}

#[test]
fn tensor_offsets_and_extents() {
    let f32x8 = |offsets: &[u64], data: usize| {
        with_tensors(offsets.len() as u64, data, |b| {
            for (i, &o) in offsets.iter().enumerate() {
                b.tensor(format!("t{i}").as_bytes(), &[8], ggml::F32, o);
            }
        })
    };
    refuse("offset u64::MAX", &f32x8(&[u64::MAX], 32), bad_tensor("not a multiple"));
    refuse("offset u64::MAX rounded down to 32", &f32x8(&[!31], 32), bad_tensor("extent overflows"));
    for o in [1u64, 8, 16, 31, 33] {
        refuse(&format!("offset {o} not aligned"), &f32x8(&[o], 96), bad_tensor("not a multiple"));
    }
    refuse("two tensors at offset 0 (aliasing)", &f32x8(&[0, 0], 64), bad_tensor("overlaps"));
    refuse("two tensors at offset 32 (aliasing)", &f32x8(&[0, 32, 32], 128), bad_tensor("overlaps"));
    let bytes = with_tensors(2, 128, |b| {
        b.tensor(b"big", &[16], ggml::F32, 0).tensor(b"b", &[8], ggml::F32, 32);
    });
    refuse("overlapping tensors", &bytes, bad_tensor("overlaps"));
    // The smallest overlap alignment allows: a 40-byte tensor at 0, the next at 32 (8 bytes shared).
    let bytes = with_tensors(2, 96, |b| {
        b.tensor(b"a", &[40], ggml::I8, 0).tensor(b"b", &[8], ggml::F32, 32);
    });
    refuse("tensors overlapping by 8 bytes", &bytes, bad_tensor("overlaps"));
    refuse("out-of-order offsets", &f32x8(&[32, 0], 64), bad_tensor("out of order"));
    refuse("out-of-order offsets, 3 tensors", &f32x8(&[0, 64, 32], 96), bad_tensor("out of order"));
    for o in [1u64 << 32, (1 << 32) - 32, 1 << 40, 1 << 62] {
        refuse(
            &format!("offset {o:#x} beyond 4 GiB / the file"),
            &f32x8(&[o], 64),
            bad_tensor("past the end"),
        );
    }
    let e = refuse("second tensor 1 GiB out", &f32x8(&[0, 1 << 30], 64), bad_tensor("past the end"));
    assert!(e.to_string().contains("\"t1\""), "{e}");

    // CVE-2026-27940 (test-gguf MEM_SIZE_OVERFLOW): two I8 tensors of 0x7FFFFFFFFFFFFFC0 elements,
    // the second right after the first, and a 32-byte blob.
    let n = 0x7FFF_FFFF_FFFF_FFC0u64;
    let bytes = with_tensors(2, 32, |b| {
        b.tensor(b"a", &[n], ggml::I8, 0).tensor(b"b", &[n], ggml::I8, n);
    });
    refuse("CVE-2026-27940 shape", &bytes, bad_tensor("past the end"));
    let bytes = with_tensors(2, 32, |b| {
        b.tensor(b"a", &[n], ggml::I8, 0).tensor(b"b", &[n], ggml::I8, 0);
    });
    refuse("CVE-2026-27940 shape, aliased", &bytes, bad_tensor("overlaps"));
    // CVE-2025-53630: padded sizes summing past u64::MAX.
    let m = 0x7FFF_FFFF_FFFF_FFE0u64;
    let bytes = with_tensors(3, 32, |b| {
        b.tensor(b"a", &[m], ggml::I8, 0).tensor(b"b", &[m], ggml::I8, m).tensor(
            b"c",
            &[64],
            ggml::I8,
            2 * m,
        );
    });
    refuse("CVE-2025-53630 shape (sizes sum past u64::MAX)", &bytes, bad_tensor("extent overflows"));
}

#[test]
fn data_section_must_reach_exactly_the_end() {
    for built in [rich_model().build(), GgufBuilder::new().tensor("t", &[8], ggml::F32).build()] {
        let last = built.offsets.last().unwrap();
        let full = built.bytes.len();
        let g = load("data ending exactly at the end of the file", &built.bytes);
        let last_info = g.tensors().last().unwrap();
        assert_eq!(g.data_start() as u64 + last + last_info.nbytes, full as u64);
        assert_eq!(g.tensor_data(&last_info).as_ptr_range().end, built.bytes.as_ptr_range().end);

        let short = &built.bytes[..full - 1];
        assert_eq!(short.len() + 1, full, "the case must really be one byte short");
        let e = refuse("data one byte short", short, bad_tensor("past the end"));
        assert!(matches!(e, GgufError::BadTensor { value: 1, .. }), "{e:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Truncation everywhere, round trip, valid edge cases

#[test]
fn truncation_at_every_byte_is_refused() {
    let built = rich_model().build();
    let bytes = &built.bytes;
    load("the complete file", bytes);
    let start = Instant::now();
    for cut in 0..bytes.len() {
        let case = format!("cut at {cut} of {}", bytes.len());
        refuse(&case, &bytes[..cut], any);
    }
    let took = start.elapsed();
    assert!(took < parse_limit() * 10, "{} truncations took {took:?}", bytes.len());
}

#[test]
fn complete_file_round_trips() {
    let spec = rich_model();
    let built = spec.build();
    for version in [3u32, 2] {
        let mut bytes = built.bytes.clone();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let g = load("rich model", &bytes);
        assert_eq!(g.header().version, version);
        assert_eq!(g.header().kv_count as usize, spec.kvs.len());
        assert_eq!(g.data_start(), built.data_start);

        let read: Vec<(&str, Value<'_>)> = g.metadata().collect();
        assert_eq!(read.len(), spec.kvs.len());
        for ((key, val), (rkey, rval)) in spec.kvs.iter().zip(&read) {
            assert_eq!(key, rkey);
            assert!(val.matches(rval), "{key}: wrote {val:?}, read {rval:?}");
            assert!(val.matches(&g.get(key).unwrap()), "{key}: get disagrees");
        }
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_str("test.scalar.8").unwrap(), "héllo wörld");
        assert_eq!(g.get_u32("llama.block_count").unwrap(), 1);
        assert_eq!(g.get_int::<i64>("test.scalar.11").unwrap(), Some(i64::MIN + 3));
        assert_eq!(g.get_u64("test.scalar.10").unwrap(), u64::MAX - 1);
        assert_eq!(g.get_f32("test.scalar.6").unwrap(), -1.5e-3);
        assert_eq!(g.get_bool_opt("test.scalar.7").unwrap(), Some(true));
        assert!(matches!(g.get_u32("test.scalar.5"), Err(GgufError::BadValue { .. })), "negative into u32");
        assert!(matches!(g.get_u32("test.scalar.8"), Err(GgufError::WrongType { .. })));
        let tokens = g.get_array("tokenizer.ggml.tokens", ValueType::String).unwrap();
        assert_eq!(tokens.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>(), ["<unk>", "a", "b", "ü"]);
        assert!(g.get_array("tokenizer.ggml.tokens", ValueType::F32).is_err());
        assert_eq!(g.get_array("test.array.empty", ValueType::F32).unwrap().len(), 0);

        assert_eq!(g.tensor_count(), spec.tensors.len());
        for ((t, info), offset) in spec.tensors.iter().zip(g.tensors()).zip(&built.offsets) {
            let mut ne = [1u64; 4];
            ne[..t.dims.len()].copy_from_slice(&t.dims);
            assert_eq!(info.name, t.name);
            assert_eq!((info.ty.id(), info.n_dims as usize, info.ne), (t.ty, t.dims.len(), ne), "{}", t.name);
            assert_eq!((info.offset, info.nbytes), (*offset, t.data.len() as u64), "{}", t.name);
            assert_eq!(g.tensor_data(&info), t.data.as_slice(), "{}: data differs", t.name);
        }
    }
}

#[test]
fn valid_edge_cases_load() {
    let header = Bytes::header(3, 0, 0);
    let g = load("zero tensors, zero keys", &header.buf);
    assert_eq!((g.tensor_count(), g.metadata().count()), (0, 0));

    let vocab = vocab_only_model().bytes();
    let g = load("vocab-only", &vocab);
    assert_eq!(g.tensor_count(), 0);
    assert_eq!(g.get_array("tokenizer.ggml.tokens", ValueType::String).unwrap().len(), 40);
    assert_eq!(g.get_array("tokenizer.ggml.scores", ValueType::F32).unwrap().len(), 40);
    assert_eq!(g.get_array("tokenizer.ggml.token_type", ValueType::I32).unwrap().iter().count(), 40);
    assert_eq!(g.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(g.get_str("tokenizer.chat_template").unwrap().starts_with("{% for"));

    let mut empty = GgufBuilder::new();
    for t in tag::ALL {
        empty = empty.kv(&format!("empty.{t}"), Val::Array(t, vec![]));
    }
    let bytes = empty.bytes();
    let g = load("empty arrays of every type", &bytes);
    for t in tag::ALL {
        let Some(Value::Array(a)) = g.get(&format!("empty.{t}")) else { panic!("empty.{t}") };
        assert!(a.is_empty() && a.iter().next().is_none());
    }

    // Exactly MAX_KV keys sharing a long prefix (the duplicate check compares them all).
    let prefix = "k".repeat(MAX_KEY_LEN as usize - 4);
    let mut many = GgufBuilder::new();
    for i in 0..MAX_KV {
        many = many.kv(&format!("{prefix}{i:04}"), Val::U8(i as u8));
    }
    let bytes = many.bytes();
    let g = load("MAX_KV keys of MAX_KEY_LEN bytes", &bytes);
    assert_eq!(g.metadata().count(), MAX_KV);
    assert_eq!(g.get_int::<u8>(&format!("{prefix}0511")).unwrap(), Some(255));

    let g_bytes = GgufBuilder::new()
        .tensor("four.dims", &[32, 2, 3, 4], ggml::Q8_0)
        .tensor(&"n".repeat(63), &[1], ggml::F32)
        .bytes();
    let g = load("4-dim tensor, 63-byte name", &g_bytes);
    let t = g.tensor("four.dims").unwrap();
    assert_eq!((t.n_rows(), t.row_bytes(), t.nbytes), (24, 34, 24 * 34));
}

/// `n` distinct 32-byte I8 tensor infos and no data section.
fn many_tensor_infos(n: u64) -> Vec<u8> {
    let mut b = Bytes::header(3, n, 0);
    for i in 0..n {
        b.tensor(format!("{i:x}").as_bytes(), &[32], ggml::I8, i * 32);
    }
    b.into_vec()
}

#[test]
fn max_tensors_infos_are_refused_in_linear_time() {
    let bytes = many_tensor_infos(MAX_TENSORS as u64);
    assert!(bytes.len() < 300_000);
    let start = Instant::now();
    let result = Gguf::parse(&bytes);
    let took = start.elapsed();
    assert!(result.is_err());
    let limit = Duration::from_millis(if EMULATED { 2_000 } else { 200 });
    assert!(took < limit, "{MAX_TENSORS} tensor infos took {took:?}");
}

// ---------------------------------------------------------------------------------------------
// 8. Seeded structure-aware mutation

/// splitmix64: a tiny deterministic PRNG (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that sit on the edges of the parser's checks.
const INTERESTING: [u64; 40] = [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    13,
    31,
    32,
    33,
    40,
    63,
    64,
    255,
    256,
    257,
    0x7fff,
    0xffff,
    65536,
    65537,
    MAX_KV as u64,
    MAX_TENSORS as u64,
    MAX_STRING_LEN,
    MAX_STRING_LEN + 1,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    (1 << 32) + 1,
    u64::MAX / 8,
    u64::MAX / 4,
    0x7FFF_FFFF_FFFF_FFC0,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
];

/// Applies 1 to 3 mutations to `base` into `out`.
fn mutate(rng: &mut Rng, base: &Built, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&base.bytes);
    for _ in 0..1 + rng.below(3) {
        let len = out.len();
        match rng.below(16) {
            // Overwrite a u32/u64 field (counts, lengths, tags, dims, offsets) with an edge value,
            // a small change of what is there, or a random value.
            0..=8 => {
                let field = base.fields[rng.below(base.fields.len())];
                let w = field.width as usize;
                if field.offset + w > len {
                    continue;
                }
                let old = {
                    let mut b = [0u8; 8];
                    b[..w].copy_from_slice(&out[field.offset..field.offset + w]);
                    u64::from_le_bytes(b)
                };
                let delta = 1 + rng.below(8) as u64;
                let new = match rng.below(10) {
                    0..=4 => INTERESTING[rng.below(INTERESTING.len())],
                    5..=6 => old.wrapping_add(delta),
                    7..=8 => old.wrapping_sub(delta),
                    _ => rng.next(),
                };
                out[field.offset..field.offset + w].copy_from_slice(&new.to_le_bytes()[..w]);
            }
            // Flip 1 to 4 bits.
            9..=10 => {
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(len);
                    if at < len {
                        out[at] ^= 1 << rng.below(8);
                    }
                }
            }
            // A random byte.
            11 => {
                let at = rng.below(len);
                if at < len {
                    out[at] = rng.next() as u8;
                }
            }
            // Truncate.
            12 => out.truncate(rng.below(len + 1)),
            // Duplicate a region somewhere (an extra tensor info, a repeated key...).
            13 => {
                let from = rng.below(len);
                let to = (from + 1 + rng.below(64)).min(len);
                let at = rng.below(len + 1);
                let region = out[from..to].to_vec();
                out.splice(at..at, region);
            }
            // Delete a region.
            14 => {
                let from = rng.below(len);
                let to = (from + 1 + rng.below(64)).min(len);
                out.drain(from..to);
            }
            // Append garbage.
            _ => {
                let n = rng.below(64);
                out.extend((0..n).map(|_| rng.next() as u8));
            }
        }
    }
}

#[test]
fn seeded_structure_aware_mutations() {
    let bases: Vec<Built> = vec![
        rich_model().build(),
        tiny_model("qwen3moe").build(),
        vocab_only_model().build(),
        GgufBuilder::new()
            .alignment(64)
            .tensor("a", &[32, 2], ggml::Q4_0)
            .tensor("b", &[3], ggml::F32)
            .build(),
        GgufBuilder::new()
            .kv("n", Val::Array(tag::ARRAY, vec![Val::Array(tag::STRING, vec![Val::str("x")])]))
            .kv("b", Val::Bool(1))
            .tensor("t", &[256], ggml::Q4_K)
            .build(),
    ];
    let iterations: u64 = std::env::var("PINFER_MUTATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if EMULATED { 30_000 } else { 200_000 });
    let seed = 0x5EED_6675_F00D_u64;
    let mut rng = Rng(seed);
    let mut input = Vec::new();
    let (mut accepted, mut kinds) = (0u64, std::collections::BTreeSet::new());
    let start = Instant::now();
    for i in 0..iterations {
        let base = &bases[i as usize % bases.len()];
        mutate(&mut rng, base, &mut input);
        let outcome = catch_unwind(AssertUnwindSafe(|| match parse_watched("mutant", &input) {
            Ok(g) => {
                check_parsed(&g, &input);
                None
            }
            Err(e) => {
                describe(&e);
                Some(error_kind(&e))
            }
        }));
        match outcome {
            Ok(None) => accepted += 1,
            Ok(Some(kind)) => {
                kinds.insert(kind);
            }
            Err(_) => {
                let path = std::env::temp_dir().join(format!("hostile_gguf_mutant_{seed:x}_{i}.gguf"));
                let _ = std::fs::write(&path, &input);
                panic!("mutation {i} (seed {seed:#x}) panicked; input saved to {}", path.display());
            }
        }
    }
    let took = start.elapsed();
    println!(
        "{iterations} mutants in {took:?} ({:.0}/s): {accepted} accepted, {} distinct errors",
        iterations as f64 / took.as_secs_f64(),
        kinds.len()
    );
    println!("errors reached: {kinds:?}");
    // The mutator must reach deep into the format, not just break the magic.
    assert!(accepted * 50 > iterations, "only {accepted} of {iterations} mutants parsed");
    assert!(kinds.len() >= 40, "only {} distinct errors reached: {kinds:?}", kinds.len());
}

/// The variant and field or problem of an error, to count how many checks the mutants reach.
fn error_kind(e: &GgufError) -> String {
    match e {
        GgufError::Truncated { what, .. } => format!("truncated {what}"),
        GgufError::TooLarge { what, .. } => format!("too large {what}"),
        GgufError::Invalid { what, .. } => format!("invalid {what}"),
        GgufError::BadKey { problem, .. } => format!("key: {problem}"),
        GgufError::BadTensor { problem, .. } => format!("tensor: {problem}"),
        GgufError::BadMagic { .. } => "bad magic".into(),
        GgufError::UnsupportedVersion { .. } => "unsupported version".into(),
        other => format!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds for the fuzzer (scripts/fuzz.sh runs this with PINFER_FUZZ_SEED_DIR set).

#[test]
#[ignore = "writes the cargo-fuzz seed corpus; run by scripts/fuzz.sh"]
fn write_fuzz_seeds() {
    let dir = std::env::var("PINFER_FUZZ_SEED_DIR").expect("set PINFER_FUZZ_SEED_DIR");
    std::fs::create_dir_all(&dir).unwrap();
    let n = 0x7FFF_FFFF_FFFF_FFC0u64;
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("empty_header", Bytes::header(3, 0, 0).into_vec()),
        ("rich_model", rich_model().bytes()),
        ("vocab_only", vocab_only_model().bytes()),
        ("align64", GgufBuilder::new().alignment(64).tensor("a", &[32, 2], ggml::Q4_0).bytes()),
        ("nested_arrays", nested_arrays(MAX_ARRAY_DEPTH as usize)),
        ("array_2pow63", array_file(tag::U8, 1 << 63, 0)),
        (
            "cve_2026_27940",
            with_tensors(2, 32, |b| {
                b.tensor(b"a", &[n], 24, 0).tensor(b"b", &[n], 24, n);
            }),
        ),
        ("many_tensors", {
            let mut g = GgufBuilder::new();
            for i in 0..64 {
                g = g.tensor(&format!("blk.{i}.w"), &[32], ggml::Q8_0);
            }
            g.bytes()
        }),
    ];
    for (name, bytes) in seeds {
        std::fs::write(std::path::Path::new(&dir).join(format!("{name}.gguf")), bytes).unwrap();
    }
}
