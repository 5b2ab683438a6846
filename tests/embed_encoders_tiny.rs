//! The tiny encoders of the other BERT families (models/tiny/, scripts/make_encoder_tiny.py, written
//! by `scripts/setup.sh encoder-tiny`) against llama.cpp's vectors (tests/golden/embeddings/
//! `*-tiny*.llama.json`): a cross-encoder (`bert`, pooling rank, `cls` and `cls.output` heads),
//! `nomic-bert` (fused QKV, NeoX RoPE, SwiGLU, Q8_0) and `jina-bert-v2` (ALiBi, GEGLU from one
//! `ffn_up`). The inputs are the goldens' own ids (the WordPiece tokenizer is tested against them
//! too), one sequence each, all in one batch.
//!
//! Tolerances (tests/golden/embeddings/README.md, what the float64 forward of
//! scripts/encoder_tiny_reference.py meets against llama.cpp): raw rerank scores 5e-3; F16 files
//! 1e-3 per component; nomic-bert (Q8_0 weights, which llama.cpp multiplies with Q8_0 activations)
//! by cosine, 0.999 pooled and 0.997 per token.

use pinfer::embed::{embed, EmbedOptions, Embeddings};
use pinfer::engine::embedding::Normalize;
use pinfer::engine::{EngineError, Model};
use pinfer::loader::ModelFile;
use pinfer::model::{ModelError, Pooling};
use pinfer::session::{Session, SessionOptions};
use pinfer::tokenizer::OwnedTokenizer;
use serde_json::Value;

fn golden(name: &str) -> Value {
    let path = format!("{}/tests/golden/embeddings/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    serde_json::from_value(v.clone()).unwrap()
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum();
    let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).abs()).fold(0.0, f64::max)
}

/// Runs `f` on a thread with the server's engine stack (planning keeps static tables there).
fn on_engine_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new().stack_size(16 << 20).spawn(f).unwrap().join().unwrap();
}

fn session(file: &str, pooling: Option<Pooling>) -> Session {
    let path = format!("{}/models/tiny/{file}", env!("CARGO_MANIFEST_DIR"));
    let model = ModelFile::open_static(std::path::Path::new(&path))
        .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/setup.sh encoder-tiny)"));
    let logits_all = pooling == Some(Pooling::None);
    let opts =
        SessionOptions { n_batch: 128, n_seq: 8, threads: 2, pooling, logits_all, ..Default::default() };
    Session::new(model, &opts).unwrap()
}

/// The golden's inputs (its ids) embedded in one batch, normalised as `normalize` says.
fn embed_golden(session: &mut Session, g: &Value, normalize: Normalize) -> Embeddings {
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["ids"].clone()).unwrap();
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    embed(session, &refs, &EmbedOptions { normalize, truncate: false }).unwrap()
}

/// Each input of `g` tokenized by the model's tokenizer: llama-embedding's ids (a rerank pair
/// `[CLS] q [SEP] d [SEP]`, every token type 0).
fn check_tokenizer(session: &Session, g: &Value) {
    let tok = OwnedTokenizer::new(session.gguf()).unwrap();
    let inputs: Vec<String> = serde_json::from_value(g["inputs"].clone()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(g["ids"].clone()).unwrap();
    for (text, want) in inputs.iter().zip(&want) {
        let mut out = vec![0u32; 1024];
        let mut scratch = vec![0u32; tok.scratch_words(text.len())];
        let n = match text.split_once('\t') {
            Some((q, d)) => {
                let mut types = vec![0u32; 1024];
                tok.encode_pair(q, d, false, &mut out, &mut types, &mut scratch).unwrap()
            }
            None => tok.encode_with_scratch(text, false, true, &mut out, &mut scratch).unwrap(),
        };
        assert_eq!(&out[..n], &want[..], "ids of {text:?}");
    }
}

/// `bert-rerank-tiny.gguf`: each pair's raw score (`--embd-normalize -1`), the [CLS] row through
/// `cls` and tanh, then `cls.output`, within 5e-3 of llama-embedding's.
#[test]
fn bert_reranker_scores_match_llama_embedding() {
    on_engine_stack(|| {
        let g = golden("bert-rerank-tiny.llama.json");
        let mut s = session("bert-rerank-tiny.gguf", None);
        check_tokenizer(&s, &g);
        let out = embed_golden(&mut s, &g, Normalize::None);
        assert_eq!((out.pooling, out.width), (Pooling::Rank, 1));
        let want = rows(&g["vectors"]);
        let mut worst = 0f64;
        for (i, want) in want.iter().enumerate() {
            let d = max_diff(out.row(i, 0).unwrap(), want);
            assert!(d <= 5e-3, "pair {i}: score {:?} against {want:?}", out.row(i, 0));
            worst = worst.max(d);
        }
        eprintln!("bert rerank: largest score difference {worst:.2e}");
    });
}

/// `nomic-bert-tiny.gguf` (Q8_0): the mean-pooled, L2-normalised vectors within cosine 0.999 of
/// llama-embedding's, and with `--pooling none` every token's raw vector within 0.997.
#[test]
fn nomic_bert_matches_llama_embedding() {
    on_engine_stack(|| {
        let g = golden("nomic-bert-tiny.llama.json");
        let mut s = session("nomic-bert-tiny.gguf", None);
        check_tokenizer(&s, &g);
        let out = embed_golden(&mut s, &g, Normalize::Euclidean);
        assert_eq!((out.pooling, out.width), (Pooling::Mean, 64));
        let mut worst = 1f64;
        for (i, want) in rows(&g["vectors"]).iter().enumerate() {
            let c = cosine(out.row(i, 0).unwrap(), want);
            assert!(c >= 0.999, "input {i}: cosine {c}");
            worst = worst.min(c);
        }
        eprintln!("nomic-bert mean: smallest cosine {worst:.7}");

        let g = golden("nomic-bert-tiny.none.llama.json");
        let mut s = session("nomic-bert-tiny.gguf", Some(Pooling::None));
        let out = embed_golden(&mut s, &g, Normalize::None);
        assert_eq!(out.pooling, Pooling::None);
        // llama-embedding's rows: every token of every input, in order.
        let want = rows(&g["vectors"]);
        let got: Vec<&[f32]> = (0..out.rows.len())
            .flat_map(|i| (0..out.tokens[i]).map(move |r| (i, r)))
            .map(|(i, r)| out.row(i, r).unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        let mut worst = 1f64;
        for (t, (got, want)) in got.iter().zip(&want).enumerate() {
            let c = cosine(got, want);
            assert!(c >= 0.997, "token {t}: cosine {c}");
            worst = worst.min(c);
        }
        eprintln!("nomic-bert per token: smallest cosine {worst:.7}");
    });
}

/// `jina-bert-v2-tiny.gguf` (F16, ALiBi, GEGLU): the mean-pooled, L2-normalised vectors within
/// 1e-3 per component of llama-embedding's.
#[test]
fn jina_bert_v2_matches_llama_embedding() {
    on_engine_stack(|| {
        let g = golden("jina-bert-v2-tiny.llama.json");
        let mut s = session("jina-bert-v2-tiny.gguf", None);
        check_tokenizer(&s, &g);
        let out = embed_golden(&mut s, &g, Normalize::Euclidean);
        assert_eq!((out.pooling, out.width), (Pooling::Mean, 64));
        let mut worst = 0f64;
        for (i, want) in rows(&g["vectors"]).iter().enumerate() {
            let d = max_diff(out.row(i, 0).unwrap(), want);
            assert!(d <= 1e-3, "input {i}: largest difference {d}");
            worst = worst.max(d);
        }
        eprintln!("jina-bert-v2: largest difference {worst:.2e}");
    });
}

fn model_bytes(file: &str) -> Vec<u8> {
    let path = format!("{}/models/tiny/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e} (run scripts/setup.sh encoder-tiny)"))
}

/// `file` with the first `from` in its header replaced by `to` (same length).
fn patched(file: &str, from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut bytes = model_bytes(file);
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the header holds it");
    bytes[at..at + to.len()].copy_from_slice(to);
    bytes
}

/// A tensor's header entry: its name, 2 dimensions and their sizes.
fn header(name: &str, ne: [u64; 2]) -> Vec<u8> {
    let mut out = name.as_bytes().to_vec();
    out.extend_from_slice(&2u32.to_le_bytes());
    ne.iter().for_each(|n| out.extend_from_slice(&n.to_le_bytes()));
    out
}

fn open_error(bytes: &[u8]) -> ModelError {
    match Model::open(bytes) {
        Ok(_) => panic!("the file was accepted"),
        Err(EngineError::Model(e)) => e,
        Err(e) => panic!("not a model error: {e}"),
    }
}

fn assert_missing(bytes: &[u8], want: &str) {
    match open_error(bytes) {
        ModelError::MissingTensor { name } => assert_eq!(name.as_str(), want),
        e => panic!("{want}: {e}"),
    }
}

fn assert_shape(bytes: &[u8], want: &str) {
    match open_error(bytes) {
        ModelError::TensorShape { name, .. } => assert_eq!(name.as_str(), want),
        e => panic!("{want}: {e}"),
    }
}

/// The new families' files load (no position table needed) and a missing or mis-shaped tensor is
/// refused at load, named: nomic-bert's fused QKV and SwiGLU gate, jina-bert-v2's GEGLU `ffn_up`
/// (twice n_ff rows) and its Q/K/V.
#[test]
fn bad_encoder_files_are_refused_naming_the_tensor() {
    for file in ["nomic-bert-tiny.gguf", "jina-bert-v2-tiny.gguf"] {
        let bytes = model_bytes(file);
        Model::open(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let nomic = "nomic-bert-tiny.gguf";
    let qkv = "blk.1.attn_qkv.weight";
    assert_shape(&patched(nomic, &header(qkv, [64, 192]), &header(qkv, [64, 128])), qkv);
    // Without the fused matrix, the three it stands for.
    assert_missing(&patched(nomic, qkv.as_bytes(), b"blk.1.attn_qkx.weight"), "blk.1.attn_q.weight");
    assert_missing(
        &patched(nomic, b"blk.0.ffn_gate.weight", b"blk.0.ffn_gatx.weight"),
        "blk.0.ffn_gate.weight",
    );
    let jina = "jina-bert-v2-tiny.gguf";
    let up = "blk.1.ffn_up.weight";
    assert_shape(&patched(jina, &header(up, [64, 192]), &header(up, [64, 96])), up);
    assert_missing(&patched(jina, b"blk.0.attn_k.weight", b"blk.0.attn_x.weight"), "blk.0.attn_k.weight");
    let bias = "blk.0.attn_v.bias";
    let mut from = bias.as_bytes().to_vec();
    from.extend_from_slice(&1u32.to_le_bytes());
    from.extend_from_slice(&64u64.to_le_bytes());
    let mut to = bias.as_bytes().to_vec();
    to.extend_from_slice(&1u32.to_le_bytes());
    to.extend_from_slice(&32u64.to_le_bytes());
    assert_shape(&patched(jina, &from, &to), bias);
    // A norm the encoder does not compute (jina's code models' Q LayerNorm) is refused, not skipped.
    let q_norm = patched(jina, b"blk.1.attn_output.weight", b"blk.1.attn_q_norm.weight");
    match open_error(&q_norm) {
        ModelError::Uncomputed { key, .. } => assert_eq!(key.as_str(), "blk.1.attn_q_norm.weight"),
        e => panic!("{e}"),
    }
}

/// Each input of a batch gets the bits it gets alone (RoPE's positions from the token places,
/// ALiBi's distances between the batch's rows of one sequence), with and without pooling.
#[test]
fn a_batch_gives_each_input_its_bits_alone() {
    on_engine_stack(|| {
        for (file, golden_name) in [
            ("nomic-bert-tiny.gguf", "nomic-bert-tiny.llama.json"),
            ("jina-bert-v2-tiny.gguf", "jina-bert-v2-tiny.llama.json"),
        ] {
            let g = golden(golden_name);
            let ids: Vec<Vec<u32>> = serde_json::from_value(g["ids"].clone()).unwrap();
            for pooling in [None, Some(Pooling::None)] {
                let mut s = session(file, pooling);
                let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
                let opts = EmbedOptions { normalize: Normalize::None, truncate: false };
                let batch = embed(&mut s, &refs, &opts).unwrap();
                for (i, input) in refs.iter().enumerate() {
                    let alone = embed(&mut s, &[input], &opts).unwrap();
                    assert_eq!(alone.rows[0], batch.rows[i], "{file} {pooling:?}: input {i}");
                }
            }
        }
    });
}
