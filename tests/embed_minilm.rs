//! all-MiniLM-L6-v2 (issue 50's "Must show"), the F16 GGUF of scripts/convert_bert.py (byte-identical
//! to llama.cpp's converter) and its Q8_0 by `pinfer quantize` (setup.sh minilm, minilm-q8): the
//! WordPiece ids of 50 sentences are HF `tokenizers`' and the sentence embeddings (mean pooling, L2)
//! match the float64 forward of the safetensors (scripts/bert_reference.py) and llama-embedding's.
//!
//! Tolerances: F16 cosine >= 0.9999 against both. Q8_0 (weights and, as llama.cpp does, the
//! activations rounded to 8 bits in its dot products) >= 0.998 against the reference: llama.cpp's own
//! Q8_0 gives 0.99819 on the 3-token inputs (tests/golden/embeddings/README.md); from 4 tokens up
//! both clear 0.999.

use pinfer::embed::{embed, embed_typed, EmbedOptions};
use pinfer::loader::ModelFile;
use pinfer::session::{Session, SessionOptions};
use pinfer::tokenizer::OwnedTokenizer;
use serde_json::Value;

fn golden(name: &str) -> Value {
    let path = format!("{}/tests/golden/embeddings/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect()
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum();
    let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// (per sentence: pinfer's ids, its vector) for the model file `file`.
fn embed_sentences(file: &str, sentences: &[String]) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
    let model = ModelFile::open_static(std::path::Path::new(&path))
        .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/setup.sh minilm minilm-q8)"));
    let opts = SessionOptions { n_batch: 512, n_seq: 16, threads: 2, ..Default::default() };
    let mut session = Session::new(model, &opts).unwrap();
    let tok = OwnedTokenizer::new(session.gguf()).unwrap();
    let ids: Vec<Vec<u32>> = sentences
        .iter()
        .map(|s| {
            let mut out = vec![0u32; 1024];
            let mut scratch = vec![0u32; tok.scratch_words(s.len())];
            let n = tok.encode_with_scratch(s, false, true, &mut out, &mut scratch).unwrap();
            out.truncate(n);
            out
        })
        .collect();
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let out = embed(&mut session, &refs, &EmbedOptions::default()).unwrap();
    let vectors = (0..sentences.len()).map(|i| out.row(i, 0).unwrap().to_vec()).collect();
    (ids, vectors)
}

/// Runs `check` on a thread with the stack the server's engine thread has (planning the graphs
/// keeps static-capacity tables on the stack: more than a test thread's 2 MiB for this model).
fn check_on_engine_stack(file: &'static str, against: &'static str, reference_min: f64) {
    std::thread::Builder::new()
        .stack_size(16 << 20)
        .spawn(move || check(file, against, reference_min))
        .unwrap()
        .join()
        .unwrap();
}

fn check(file: &str, against: &str, reference_min: f64) {
    let reference = golden("minilm-reference.json");
    let all: Vec<String> = serde_json::from_value(reference["sentences"].clone()).unwrap();
    // A debug build under qemu (the aarch64 tier) takes minutes over all 50 on the F16 file's
    // one-element-at-a-time kernel: there, every fourth sentence and the two that matter most (10,
    // the worst; 21, Korean), the same code paths.
    let slow = cfg!(all(target_arch = "aarch64", debug_assertions));
    let picked: Vec<usize> = (0..all.len()).filter(|&i| !slow || i % 4 == 0 || i == 10 || i == 21).collect();
    let sentences: Vec<String> = picked.iter().map(|&i| all[i].clone()).collect();
    let hf_ids: Vec<Vec<u32>> = serde_json::from_value(reference["ids"].clone()).unwrap();
    let (ids, vectors) = embed_sentences(file, &sentences);
    let picked_hf: Vec<&Vec<u32>> = picked.iter().map(|&i| &hf_ids[i]).collect();
    assert_eq!(ids.iter().collect::<Vec<_>>(), picked_hf, "WordPiece ids are HF tokenizers'");
    // (sentence index, pinfer's vector) of the picked sentences.
    let vectors: Vec<(usize, Vec<f32>)> = picked.iter().copied().zip(vectors).collect();
    let ids: Vec<(usize, Vec<u32>)> = picked.iter().copied().zip(ids).collect();
    let worst = |want: &[Vec<f64>], skip: &dyn Fn(usize) -> bool| {
        let mut worst = (f64::INFINITY, 0);
        for (i, got) in vectors.iter().filter(|(i, _)| !skip(*i)) {
            let c = cosine(got, &want[*i]);
            if c < worst.0 {
                worst = (c, *i);
            }
        }
        worst
    };
    let (c, i) = worst(&rows(&reference["embeddings"]), &|_| false);
    eprintln!("{file}: min cosine vs the float64 reference {c:.7} (sentence {i})");
    assert!(c >= reference_min, "{file}: sentence {i} {:?}: cosine {c} < {reference_min}", all[i]);
    // llama-embedding's vectors, where its ids are ours (it drops Hangul jamo HF keeps).
    let llama = golden(against);
    let llama_ids: Vec<Vec<u32>> = serde_json::from_value(llama["ids"].clone()).unwrap();
    let ours = |i: usize| ids.iter().find(|(j, _)| *j == i).map(|(_, v)| v);
    let (c, i) = worst(&rows(&llama["vectors"]), &|i| ours(i) != Some(&llama_ids[i]));
    eprintln!("{file}: min cosine vs llama-embedding {c:.7} (sentence {i})");
    assert!(c >= reference_min, "{file}: sentence {i}: cosine {c} against llama-embedding");
}

#[test]
fn minilm_f16_matches_the_float64_reference_and_llama_embedding() {
    check_on_engine_stack("all-MiniLM-L6-v2.F16.gguf", "minilm-f16.llama.json", 0.9999);
}

#[test]
fn minilm_q8_0_matches_the_float64_reference_and_llama_embedding() {
    check_on_engine_stack("all-MiniLM-L6-v2.Q8_0.gguf", "minilm-q8_0.llama.json", 0.998);
}

/// Query/document pairs (tests/golden/embeddings/minilm.pairs.jsonl: HF's pair encoding) through
/// `Tokenizer::encode_pair` and `embed_typed`: HF's ids and token types (the document type 1), and
/// the F16 vectors within cosine 0.9999 of the float64 forward with those types
/// (minilm-pairs-reference.json, scripts/bert_reference.py --pairs), which type 0 everywhere misses
/// (0.995-0.998 apart).
#[test]
fn minilm_pairs_take_their_token_types() {
    std::thread::Builder::new().stack_size(16 << 20).spawn(check_pairs).unwrap().join().unwrap();
}

fn check_pairs() {
    let reference = golden("minilm-pairs-reference.json");
    let pairs = reference["pairs"].as_array().unwrap();
    let path = format!("{}/models/all-MiniLM-L6-v2.F16.gguf", env!("CARGO_MANIFEST_DIR"));
    let model = ModelFile::open_static(std::path::Path::new(&path)).unwrap();
    let opts = SessionOptions { n_batch: 512, n_seq: 8, threads: 2, ..Default::default() };
    let mut session = Session::new(model, &opts).unwrap();
    assert_eq!(session.engine().token_types(), 2);
    let tok = OwnedTokenizer::new(session.gguf()).unwrap();
    let (mut ids, mut types) = (Vec::new(), Vec::new());
    for pair in pairs {
        let (q, d) = (pair["query"].as_str().unwrap(), pair["document"].as_str().unwrap());
        let (mut out, mut ty) = (vec![0u32; 512], vec![0u32; 512]);
        let mut scratch = vec![0u32; tok.scratch_words(q.len().max(d.len()))];
        let n = tok.encode_pair(q, d, false, &mut out, &mut ty, &mut scratch).unwrap();
        let want: Vec<u32> = serde_json::from_value(pair["ids"].clone()).unwrap();
        let want_types: Vec<u32> = serde_json::from_value(pair["type_ids"].clone()).unwrap();
        assert_eq!((&out[..n], &ty[..n]), (&want[..], &want_types[..]), "{q:?} / {d:?}");
        ids.push(want);
        types.push(want_types);
    }
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let type_refs: Vec<&[u32]> = types.iter().map(Vec::as_slice).collect();
    let typed = embed_typed(&mut session, &refs, &type_refs, &EmbedOptions::default()).unwrap();
    let untyped = embed(&mut session, &refs, &EmbedOptions::default()).unwrap();
    for (i, pair) in pairs.iter().enumerate() {
        let with_types = rows(&Value::Array(vec![pair["embedding"].clone()])).remove(0);
        let type0 = rows(&Value::Array(vec![pair["embedding_type0"].clone()])).remove(0);
        let (typed, untyped) = (typed.row(i, 0).unwrap(), untyped.row(i, 0).unwrap());
        let (c, c0) = (cosine(typed, &with_types), cosine(untyped, &type0));
        eprintln!("pair {i}: cosine {c:.7} with its types, {c0:.7} with type 0 everywhere");
        assert!(c >= 0.9999 && c0 >= 0.9999, "pair {i}: {c} / {c0}");
        assert!(cosine(typed, &type0) < 0.9995, "pair {i}: the types make no difference");
    }
    // Types not one per token, or a type the model does not have, are refused.
    let short = [&types[0][1..]];
    assert!(embed_typed(&mut session, &refs[..1], &short, &EmbedOptions::default()).is_err());
    let three = vec![2u32; ids[0].len()];
    let err = embed_typed(&mut session, &refs[..1], &[&three], &EmbedOptions::default()).unwrap_err();
    assert!(err.to_string().contains("token type 2"), "{err}");
}
