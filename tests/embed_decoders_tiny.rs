//! Decoder-shaped embedding models (issue 50) against llama-embedding's goldens
//! (tests/golden/embeddings/README.md, the tiny models of scripts/make_encoder_tiny.py written by
//! `scripts/setup.sh encoder-tiny`): Qwen3-Embedding's last-token pooling with the EOS appended,
//! EmbeddingGemma's bidirectional layers (symmetric windows on its sliding layers) and dense head
//! (mean pooling, and `cls` with the taxicab norm as overrides), Qwen3-Reranker's yes/no
//! probabilities from its `rerank` prompt template. The ids must equal llama.cpp's; the vectors
//! are within 1e-3 per component (F16 files, whose float64 forward llama.cpp meets within 5.3e-4),
//! the reranker's probabilities within 2e-3.

use pinfer::embed::{embed, rerank_prompt, rerank_template, EmbedOptions};
use pinfer::engine::embedding::Normalize;
use pinfer::loader::ModelFile;
use pinfer::model::Pooling;
use pinfer::session::{Session, SessionOptions};
use pinfer::tokenizer::OwnedTokenizer;
use serde_json::Value;

fn golden(name: &str) -> Value {
    let path = format!("{}/tests/golden/embeddings/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<Vec<u32>> {
    let row = |r: &Value| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    v.as_array().unwrap().iter().map(row).collect()
}

fn vectors_of(v: &Value) -> Vec<Vec<f64>> {
    let row = |r: &Value| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    v.as_array().unwrap().iter().map(row).collect()
}

fn session(file: &str, pooling: Option<Pooling>) -> Session {
    let path = format!("{}/models/tiny/{file}", env!("CARGO_MANIFEST_DIR"));
    let model = ModelFile::open_static(std::path::Path::new(&path))
        .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/setup.sh encoder-tiny)"));
    let opts = SessionOptions { n_batch: 512, n_seq: 8, threads: 2, pooling, ..Default::default() };
    Session::new(model, &opts).unwrap()
}

/// `text`'s ids as llama-embedding takes them: special tokens parsed, `add_special` as asked.
fn encode(tok: &OwnedTokenizer, text: &str, add_special: bool) -> Vec<u32> {
    let mut out = vec![0u32; 4096];
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let n = tok.encode_with_scratch(text, true, add_special, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

/// The worst per-component difference between pinfer's vectors and the golden's.
fn check_vectors(name: &str, got: &[Vec<f32>], want: &[Vec<f64>], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{name}: vectors");
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{name}: input {i}'s width");
        for (&a, &b) in g.iter().zip(w) {
            worst = worst.max((a as f64 - b).abs());
        }
    }
    eprintln!("{name}: worst |difference| {worst:.2e}");
    assert!(worst <= tolerance, "{name}: worst |difference| {worst:.2e} above {tolerance:.0e}");
}

/// Embeds the golden's inputs as llama-embedding did and compares ids and vectors.
fn check_embeddings(file: &str, golden_name: &str, pooling: Option<Pooling>, normalize: Normalize) {
    let g = golden(golden_name);
    let mut session = session(file, pooling);
    let tok = OwnedTokenizer::new(session.gguf()).unwrap();
    let inputs: Vec<&str> = g["inputs"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let ids: Vec<Vec<u32>> = inputs.iter().map(|s| encode(&tok, s, true)).collect();
    assert_eq!(ids, ids_of(&g["ids"]), "{golden_name}: token ids");
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let out = embed(&mut session, &refs, &EmbedOptions { normalize, truncate: false }).unwrap();
    let got: Vec<Vec<f32>> = (0..inputs.len()).map(|i| out.row(i, 0).unwrap().to_vec()).collect();
    check_vectors(golden_name, &got, &vectors_of(&g["vectors"]), 1e-3);
}

/// Runs `f` on a thread with the stack the server's engine thread has.
fn on_engine_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new().stack_size(16 << 20).spawn(f).unwrap().join().unwrap();
}

#[test]
fn qwen3_embedding_pools_the_appended_eos() {
    on_engine_stack(|| {
        check_embeddings("qwen3-embed-tiny.gguf", "qwen3-embed-tiny.llama.json", None, Normalize::Euclidean)
    });
}

#[test]
fn embedding_gemma_attends_both_ways_through_symmetric_windows_and_its_dense_head() {
    on_engine_stack(|| {
        check_embeddings("gemma-embed-tiny.gguf", "gemma-embed-tiny.llama.json", None, Normalize::Euclidean)
    });
}

#[test]
fn embedding_gemma_cls_pooling_with_the_taxicab_norm() {
    on_engine_stack(|| {
        check_embeddings(
            "gemma-embed-tiny.gguf",
            "gemma-embed-tiny.cls.llama.json",
            Some(Pooling::Cls),
            Normalize::Taxicab,
        )
    });
}

#[test]
fn qwen3_reranker_scores_its_templated_pairs() {
    on_engine_stack(|| {
        let g = golden("qwen3-rerank-tiny.llama.json");
        let mut session = session("qwen3-rerank-tiny.gguf", None);
        assert_eq!(session.engine().pooling(), Some(Pooling::Rank));
        let tok = OwnedTokenizer::new(session.gguf()).unwrap();
        let template = rerank_template(session.gguf()).expect("the reranker's template").to_string();
        let pairs = std::fs::read_to_string(format!(
            "{}/tests/golden/embeddings/rerank-pairs.txt",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        let ids: Vec<Vec<u32>> = pairs
            .lines()
            .map(|line| {
                let (q, d) = line.split_once('\t').unwrap();
                encode(&tok, &rerank_prompt(&template, q, d), false)
            })
            .collect();
        assert_eq!(ids, ids_of(&g["ids"]), "the templated pairs' ids");
        let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        let out = embed(&mut session, &refs, &EmbedOptions { normalize: Normalize::None, truncate: false })
            .unwrap();
        assert_eq!(out.width, 2, "yes and no");
        let got: Vec<Vec<f32>> = (0..refs.len()).map(|i| out.row(i, 0).unwrap().to_vec()).collect();
        for (i, p) in got.iter().enumerate() {
            assert!((p[0] + p[1] - 1.0).abs() < 1e-5, "pair {i}: {p:?} is not a distribution");
        }
        check_vectors("qwen3-rerank-tiny", &got, &vectors_of(&g["vectors"]), 2e-3);
    });
}

#[test]
fn a_decoder_embedder_batches_inputs_as_each_alone() {
    // Several inputs of one batch give each one's vector bit for bit as alone (each attends
    // within its own span: causal for Qwen3, both ways for Gemma).
    on_engine_stack(|| {
        for file in ["qwen3-embed-tiny.gguf", "gemma-embed-tiny.gguf"] {
            let mut session = session(file, None);
            let tok = OwnedTokenizer::new(session.gguf()).unwrap();
            let texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a"];
            let ids: Vec<Vec<u32>> = texts.iter().map(|s| encode(&tok, s, true)).collect();
            let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
            let together = embed(&mut session, &refs, &EmbedOptions::default()).unwrap();
            for (i, one) in refs.iter().enumerate() {
                let alone = embed(&mut session, &[one], &EmbedOptions::default()).unwrap();
                assert_eq!(alone.row(0, 0), together.row(i, 0), "{file}: input {i}");
            }
        }
    });
}
