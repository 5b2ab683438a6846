//! The encoder (`bert`): a tiny random BERT (scripts/make_bert_tiny.py, written by
//! `scripts/setup.sh tiny`) against its float64 NumPy forward pass (tests/golden/
//! bert-tiny.embed.json) and llama-embedding's vectors (tests/golden/
//! bert-tiny.llama-embedding.json, scripts/make_embed_golden.py) for every pooling; several sequences of different lengths in one batch
//! give each one's vectors bit for bit as alone; llama.cpp's normalisations; files with missing
//! or mis-shaped tensors and keys refused naming them.

use pinfer::engine::embedding::{cosine, normalize, Normalize};
use pinfer::engine::{
    Engine, EngineConfig, EngineError, Entry, GraphSlot, Model, OnCaller, Planned, GRAPH_SLOTS,
};
use pinfer::exec::pool::Pool;
use pinfer::model::{ModelError, Pooling};

type TestEngine<'m> = Engine<'m, Vec<GraphSlot>, Box<[u8]>>;

fn model_bytes() -> &'static [u8] {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny/bert-tiny.gguf");
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}: run scripts/setup.sh tiny", path.display()));
    Box::leak(bytes.into_boxed_slice())
}

/// The reference: the inputs and, per pooling, each input's vectors.
struct Reference {
    inputs: Vec<Vec<u32>>,
    json: serde_json::Value,
}

impl Reference {
    fn load() -> Self {
        Self::from("bert-tiny.embed.json")
    }

    fn from(name: &str) -> Self {
        let path = format!("{}/tests/golden/{name}", env!("CARGO_MANIFEST_DIR"));
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let inputs = json["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ids| ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect())
            .collect();
        Self { inputs, json }
    }

    /// Input `i`'s pooled vector (`mean`, `cls`, `last`, `rank`).
    fn pooled(&self, kind: &str, i: usize) -> Vec<f32> {
        self.json[kind][i].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
    }

    /// Input `i`'s token `j`'s vector.
    fn token(&self, i: usize, j: usize) -> Vec<f32> {
        self.json["none"][i][j].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
    }
}

fn engine(
    bytes: &'static [u8],
    pooling: Option<Pooling>,
    n_seq: usize,
    n_batch: usize,
) -> TestEngine<'static> {
    let n_outputs = if pooling == Some(Pooling::None) { n_batch } else { n_seq };
    let config = EngineConfig { n_ctx: 128, n_batch, n_seq, n_outputs, pooling, ..EngineConfig::default() };
    let slots: Vec<GraphSlot> = (0..GRAPH_SLOTS).map(|_| GraphSlot::new()).collect();
    let planned = Planned::new(Model::open(bytes).unwrap(), &config, slots).unwrap();
    let memory = vec![0u8; planned.layout().bytes_needed()].into_boxed_slice();
    let mut engine = planned.bind(memory).unwrap();
    engine.repack(&OnCaller, &|_| {}).unwrap();
    engine
}

/// The entries of `inputs` as sequences 0, 1, .. of one batch.
fn batch_of(inputs: &[&[u32]]) -> Vec<Entry> {
    let mut batch = Vec::new();
    for (seq, ids) in inputs.iter().enumerate() {
        for (pos, &token) in ids.iter().enumerate() {
            batch.push(Entry { seq, pos, token, logits: true });
        }
    }
    batch
}

/// Largest difference of two vectors.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Tolerances against the float64 reference (f32 arithmetic; measured: 0.0008 and 0.99999994).
const MAX_DIFF: f32 = 0.004;
const MIN_COSINE: f32 = 0.99999;

fn assert_close(got: &[f32], want: &[f32], what: &str) -> (f32, f32) {
    let (d, c) = (max_diff(got, want), cosine(got, want));
    assert!(d <= MAX_DIFF && c >= MIN_COSINE, "{what}: max difference {d}, cosine {c}");
    (d, c)
}

#[test]
fn every_pooling_matches_the_float64_reference() {
    let (bytes, r) = (model_bytes(), Reference::load());
    let inputs: Vec<&[u32]> = r.inputs.iter().map(Vec::as_slice).collect();
    let mut worst = (0f32, 1f32);
    for (pooling, kind) in
        [(Pooling::Mean, "mean"), (Pooling::Cls, "cls"), (Pooling::Last, "last"), (Pooling::Rank, "rank")]
    {
        let mut e = engine(bytes, Some(pooling), inputs.len(), 128);
        e.step(&batch_of(&inputs), &OnCaller, None).unwrap();
        assert_eq!(e.outputs(), inputs.len());
        assert!(e.logits(0).is_none(), "an encoder gives no logits");
        for i in 0..inputs.len() {
            let (d, c) =
                assert_close(e.embedding(i).unwrap(), &r.pooled(kind, i), &format!("{kind} of input {i}"));
            worst = (worst.0.max(d), worst.1.min(c));
        }
        assert_eq!(e.embedding_width(), if pooling == Pooling::Rank { 1 } else { 64 });
        assert!(e.embedding(inputs.len()).is_none());
    }
    eprintln!("against float64: largest difference {}, smallest cosine {}", worst.0, worst.1);
}

/// Tolerances against llama.cpp, whose attention reads keys and values cast to f16 (measured:
/// 0.0011 and 0.99999994).
const LLAMA_MAX_DIFF: f32 = 0.005;
const LLAMA_MIN_COSINE: f32 = 0.99999;

#[test]
fn every_pooling_matches_llama_embedding() {
    let (bytes, r) = (model_bytes(), Reference::from("bert-tiny.llama-embedding.json"));
    let inputs: Vec<&[u32]> = r.inputs.iter().map(Vec::as_slice).collect();
    let mut worst = (0f32, 1f32);
    for (pooling, kind) in
        [(Pooling::Mean, "mean"), (Pooling::Cls, "cls"), (Pooling::Last, "last"), (Pooling::Rank, "rank")]
    {
        let mut e = engine(bytes, Some(pooling), inputs.len(), 128);
        e.step(&batch_of(&inputs), &OnCaller, None).unwrap();
        for i in 0..inputs.len() {
            let (got, want) = (e.embedding(i).unwrap(), r.pooled(kind, i));
            let (d, c) = (max_diff(got, &want), if want.len() > 1 { cosine(got, &want) } else { 1.0 });
            assert!(
                d <= LLAMA_MAX_DIFF && c >= LLAMA_MIN_COSINE,
                "{kind} of input {i}: max difference {d}, cosine {c}"
            );
            worst = (worst.0.max(d), worst.1.min(c));
        }
    }
    // Per token: llama-embedding's rows are every token of every input, in order.
    let mut e = engine(bytes, Some(Pooling::None), inputs.len(), 128);
    e.step(&batch_of(&inputs), &OnCaller, None).unwrap();
    let rows = r.json["none"].as_array().unwrap();
    assert_eq!(e.outputs(), rows.len());
    for (j, row) in rows.iter().enumerate() {
        let want: Vec<f32> = row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let got = e.embedding(j).unwrap();
        let (d, c) = (max_diff(got, &want), cosine(got, &want));
        assert!(
            d <= LLAMA_MAX_DIFF && c >= LLAMA_MIN_COSINE,
            "token row {j}: max difference {d}, cosine {c}"
        );
        worst = (worst.0.max(d), worst.1.min(c));
    }
    eprintln!("against llama-embedding: largest difference {}, smallest cosine {}", worst.0, worst.1);
}

#[test]
fn the_files_pooling_is_mean_and_none_gives_every_token() {
    let (bytes, r) = (model_bytes(), Reference::load());
    let mut e = engine(bytes, None, 2, 128);
    assert_eq!(e.pooling(), Some(Pooling::Mean));
    let inputs = [r.inputs[0].as_slice(), r.inputs[1].as_slice()];
    e.step(&batch_of(&inputs), &OnCaller, None).unwrap();
    assert_close(e.embedding(1).unwrap(), &r.pooled("mean", 1), "the file's pooling");

    let mut e = engine(bytes, Some(Pooling::None), 2, 128);
    e.step(&batch_of(&inputs), &OnCaller, None).unwrap();
    let mut row = 0;
    for (i, ids) in inputs.iter().enumerate() {
        for j in 0..ids.len() {
            assert_close(e.embedding(row).unwrap(), &r.token(i, j), &format!("token {j} of input {i}"));
            row += 1;
        }
    }
    assert_eq!(e.outputs(), row);
    // Only the tokens that ask for a vector get one.
    let mut batch = batch_of(&inputs);
    batch.iter_mut().for_each(|e| e.logits = e.pos == 1);
    e.step(&batch, &OnCaller, None).unwrap();
    assert_eq!(e.outputs(), 2);
    assert_close(e.embedding(1).unwrap(), &r.token(1, 1), "the token asked for");
}

#[test]
fn sequences_batched_give_the_vectors_they_give_alone() {
    let (bytes, r) = (model_bytes(), Reference::load());
    let inputs: Vec<&[u32]> = r.inputs.iter().map(Vec::as_slice).collect();
    let pool = Pool::new(2, None, false).unwrap();
    for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Last, Pooling::Rank] {
        let mut together = engine(bytes, Some(pooling), inputs.len(), 128);
        together.step(&batch_of(&inputs), &pool, None).unwrap();
        // Alone, in a fresh engine and in one that ran other batches before (nothing is kept).
        let mut reused = engine(bytes, Some(pooling), 1, 128);
        for (i, ids) in inputs.iter().enumerate() {
            let mut alone = engine(bytes, Some(pooling), 1, 128);
            alone.step(&batch_of(&[ids]), &OnCaller, None).unwrap();
            reused.step(&batch_of(&[ids]), &OnCaller, None).unwrap();
            let want = together.embedding(i).unwrap();
            assert_eq!(alone.embedding(0).unwrap(), want, "{pooling:?}: input {i} alone");
            assert_eq!(reused.embedding(0).unwrap(), want, "{pooling:?}: input {i} after others");
        }
        // The same batch in another order.
        let reversed: Vec<&[u32]> = inputs.iter().rev().copied().collect();
        let mut e = engine(bytes, Some(pooling), inputs.len(), 128);
        e.step(&batch_of(&reversed), &OnCaller, None).unwrap();
        for i in 0..inputs.len() {
            assert_eq!(e.embedding(inputs.len() - 1 - i), together.embedding(i), "{pooling:?}: reversed");
        }
    }
}

#[test]
fn an_encoders_batch_holds_whole_sequences_one_after_another() {
    let bytes = model_bytes();
    let mut e = engine(bytes, Some(Pooling::Mean), 2, 16);
    let entry = |seq, pos| Entry { seq, pos, token: 5, logits: true };
    // Not from position 0; a gap; a sequence split by another; a sequence outside n_seq.
    for (batch, bad) in [
        (vec![entry(0, 1)], 0),
        (vec![entry(0, 0), entry(0, 2)], 1),
        (vec![entry(0, 0), entry(1, 0), entry(0, 1)], 2),
    ] {
        assert_eq!(e.step(&batch, &OnCaller, None), Err(EngineError::EncoderBatch { entry: bad }));
    }
    assert_eq!(e.step(&[entry(2, 0)], &OnCaller, None), Err(EngineError::BadSequence { seq: 2, n_seq: 2 }));
    let bad_token = Entry { token: 96, ..entry(0, 0) };
    assert_eq!(e.step(&[bad_token], &OnCaller, None), Err(EngineError::BadToken { id: 96, n_vocab: 96 }));
    // The same sequence in two consecutive steps starts at 0 each time (no cache between them).
    e.step(&[entry(0, 0), entry(0, 1)], &OnCaller, None).unwrap();
    e.step(&[entry(0, 0)], &OnCaller, None).unwrap();
    assert_eq!(e.seq_len(0), 0);
}

#[test]
fn normalisations_are_llama_cpps() {
    let x = [3.0f32, -4.0, 0.0, 1.0];
    let mut out = [0f32; 4];
    let cases: [(i32, f64); 5] = [
        (-1, 1.0),
        (0, 4.0 / 32760.0),
        (1, 8.0),
        (2, 26f64.sqrt()),
        (3, (27.0f64 + 64.0 + 1.0).powf(1.0 / 3.0)),
    ];
    for (value, norm) in cases {
        let how = Normalize::from_value(value).unwrap();
        assert_eq!(how.value(), value);
        normalize(&x, &mut out, how);
        let scale = (1.0 / norm) as f32;
        let want: Vec<f32> = x.iter().map(|v| v * scale).collect();
        assert_eq!(out.to_vec(), want, "--embd-normalize {value}");
    }
    // Max-abs scales to the int16 range.
    normalize(&x, &mut out, Normalize::MaxAbs);
    assert!((out[1] + 32760.0).abs() < 0.01);
    assert_eq!(Normalize::from_value(-2), None);
    // A zero vector stays zero; cosines as llama.cpp's.
    normalize(&[0.0; 4], &mut out, Normalize::Euclidean);
    assert_eq!(out, [0.0; 4]);
    assert_eq!(cosine(&[0.0; 2], &[0.0; 2]), 1.0);
    assert_eq!(cosine(&[1.0, 0.0], &[0.0; 2]), 0.0);
    assert!((cosine(&[1.0, 2.0], &[2.0, 4.0]) - 1.0).abs() < 1e-6);
}

/// The model with the first `from` in its header replaced by `to` (same length).
fn patched(from: &[u8], to: &[u8]) -> &'static [u8] {
    assert_eq!(from.len(), to.len());
    let mut bytes = model_bytes().to_vec();
    let at = bytes.windows(from.len()).position(|w| w == from).expect("the header holds it");
    bytes[at..at + to.len()].copy_from_slice(to);
    Box::leak(bytes.into_boxed_slice())
}

fn open_error(bytes: &[u8]) -> String {
    match Model::open(bytes) {
        Ok(_) => panic!("the file was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_files_are_refused_naming_the_tensor_or_key() {
    // A missing LayerNorm weight.
    let missing = patched(b"blk.1.attn_output_norm.weight", b"blk.1.attn_output_norx.weight");
    assert!(open_error(missing).contains("blk.1.attn_output_norm.weight"), "{}", open_error(missing));
    // A missing position table.
    let missing = patched(b"position_embd.weight", b"position_embx.weight");
    assert!(open_error(missing).contains("position_embd.weight"));
    // Position embeddings of another length than the context (dims [64, 128] → [64, 100]).
    let mut name = b"position_embd.weight".to_vec();
    name.extend_from_slice(&2u32.to_le_bytes());
    name.extend_from_slice(&64u64.to_le_bytes());
    let mut shaped = name.clone();
    name.extend_from_slice(&128u64.to_le_bytes());
    shaped.extend_from_slice(&100u64.to_le_bytes());
    let bad = patched(&name, &shaped);
    let Err(EngineError::Model(ModelError::TensorShape { name, .. })) = Model::open(bad) else {
        panic!("a mis-shaped tensor was accepted")
    };
    assert_eq!(name.as_str(), "position_embd.weight");
    // A causal encoder is not what pinfer computes.
    let mut key = b"bert.attention.causal".to_vec();
    key.extend_from_slice(&7u32.to_le_bytes());
    let (mut off, mut on) = (key.clone(), key);
    off.push(0);
    on.push(1);
    let causal = patched(&off, &on);
    assert!(open_error(causal).contains("bert.attention.causal"), "{}", open_error(causal));
    // A pooling type llama.cpp does not have.
    let mut key = b"bert.pooling_type".to_vec();
    key.extend_from_slice(&4u32.to_le_bytes());
    let (mut mean, mut nine) = (key.clone(), key);
    mean.extend_from_slice(&1u32.to_le_bytes());
    nine.extend_from_slice(&9u32.to_le_bytes());
    let pooling = patched(&mean, &nine);
    assert!(open_error(pooling).contains("bert.pooling_type"), "{}", open_error(pooling));
}

#[test]
fn rank_pooling_needs_a_classifier_head() {
    let no_head = {
        let once = patched(b"cls.weight", b"cls.wEight");
        let mut bytes = once.to_vec();
        let from = b"cls.output.weight";
        let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
        bytes[at..at + from.len()].copy_from_slice(b"cls.output.wEight");
        Box::leak(bytes.into_boxed_slice())
    };
    let model = Model::open(no_head).unwrap();
    let config = EngineConfig { pooling: Some(Pooling::Rank), ..EngineConfig::default() };
    let slots: Vec<GraphSlot> = (0..GRAPH_SLOTS).map(|_| GraphSlot::new()).collect();
    let Err(EngineError::Output(msg)) = Planned::new(model, &config, slots) else {
        panic!("rank pooling without a head was planned")
    };
    assert!(msg.contains("cls.output.weight"), "{msg}");
}

#[test]
fn a_generating_model_refuses_a_pooling() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny/qwen2-tiny.gguf");
    let bytes: &'static [u8] = Box::leak(std::fs::read(path).unwrap().into_boxed_slice());
    let config = EngineConfig { pooling: Some(Pooling::Mean), ..EngineConfig::default() };
    let slots: Vec<GraphSlot> = (0..GRAPH_SLOTS).map(|_| GraphSlot::new()).collect();
    let Err(EngineError::Output(msg)) = Planned::new(Model::open(bytes).unwrap(), &config, slots) else {
        panic!("a generating model was planned with a pooling")
    };
    assert!(msg.contains("generates text"), "{msg}");
}
