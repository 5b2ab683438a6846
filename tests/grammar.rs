//! Constrained sampling: GBNF, JSON Schema, regex grammars compiled against real vocabularies.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pinfer::gguf::Gguf;
use pinfer::grammar::{GrammarSpec, Vocab};
use pinfer::tokenizer::Tokenizer;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tokenizer(path: &Path) -> &'static Tokenizer<'static> {
    let bytes: &'static [u8] = Box::leak(std::fs::read(path).unwrap().into_boxed_slice());
    let g = Gguf::parse(bytes).unwrap();
    let words = Tokenizer::storage_words(&g).unwrap();
    let storage: &'static mut [u32] = Box::leak(vec![0u32; words].into_boxed_slice());
    Box::leak(Box::new(Tokenizer::new(&g, storage).unwrap()))
}

fn encode(tok: &Tokenizer<'_>, text: &str) -> Vec<u32> {
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut out = vec![0u32; text.len() + 8];
    let n = tok.encode_with_scratch(text, false, false, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

#[test]
fn explore() {
    let tok = tokenizer(&repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let t0 = std::time::Instant::now();
    let vocab = Vocab::new(tok).unwrap();
    eprintln!("vocab {:?}", t0.elapsed());
    let json = std::fs::read_to_string(repo().join("target/llama.cpp/src/vendor/llama.cpp/grammars/json.gbnf")).unwrap();
    let t0 = std::time::Instant::now();
    let mut c = vocab.compile(&GrammarSpec::Gbnf(json)).unwrap();
    eprintln!("compile {:?}", t0.elapsed());
    let text = "{\"name\": \"Ada\", \"tags\": [1, 2.5, true, null]}";
    let toks = encode(tok, text);
    for &t in &toks {
        let t0 = std::time::Instant::now();
        assert!(c.allows(t).unwrap(), "token {t}");
        eprintln!("mask wait {:?}", t0.elapsed());
        c.commit(t).unwrap();
    }
    assert!(c.is_accepting().unwrap());
    let mut c = vocab.compile(&GrammarSpec::JsonSchema(r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}"#.into())).unwrap();
    for &t in &encode(tok, "{\"name\": \"Al") {
        assert!(c.allows(t).unwrap());
        c.commit(t).unwrap();
    }
    let t0 = std::time::Instant::now();
    let cl = c.closing().unwrap();
    let mut buf = vec![0u8; 256];
    let n = tok.decode(cl.as_ref().unwrap(), false, &mut buf).unwrap();
    eprintln!("closing text {:?}", String::from_utf8_lossy(&buf[..n]));
    let mut c = vocab.compile(&GrammarSpec::JsonSchema(r#"{"type":"object","properties":{"name":{"type":"string"},"tags":{"type":"array"}},"required":["name","tags"]}"#.into())).unwrap();
    for &t in &toks {
        let t0 = std::time::Instant::now();
        assert!(c.allows(t).unwrap(), "token {t}");
        eprintln!("schema mask wait {:?}", t0.elapsed());
        c.commit(t).unwrap();
    }
    eprintln!("closing {:?} {:?}", t0.elapsed(), cl);
    let _ = Arc::clone(&vocab);
}
