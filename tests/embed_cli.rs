//! `pinfer embed` and `pinfer rerank` on the tiny BERT (scripts/make_bert_tiny.py, written by
//! `scripts/setup.sh tiny`) from token ids, and the std helper under them (`pinfer::embed`):
//! batches filling `-b`, each input's vector as alone, over-long inputs refused or truncated;
//! generating models and encoders each refused where the other belongs.

mod cli_support;

use cli_support::{pinfer, temp_file, text_of};
use pinfer::embed::{embed, EmbedError, EmbedOptions};
use pinfer::engine::embedding::{normalize, Normalize};
use pinfer::loader::ModelFile;
use pinfer::model::Pooling;
use pinfer::session::{Session, SessionOptions};

const BERT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny/bert-tiny.gguf");
const QWEN2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny/qwen2-tiny.gguf");

fn session(n_batch: usize, n_seq: usize, pooling: Option<Pooling>) -> Session {
    let model = ModelFile::open_static(std::path::Path::new(BERT)).expect("run scripts/setup.sh tiny");
    let logits_all = pooling == Some(Pooling::None);
    let opts = SessionOptions { n_batch, n_seq, logits_all, pooling, threads: 2, ..Default::default() };
    Session::new(model, &opts).unwrap()
}

fn inputs() -> Vec<Vec<u32>> {
    vec![
        vec![2, 10, 11, 12, 3],
        vec![2, 40, 3],
        (0..30).map(|i| 5 + i % 80).collect(),
        vec![7],
        vec![2, 9, 3],
    ]
}

#[test]
fn inputs_in_batches_give_what_each_gives_alone() {
    let inputs = inputs();
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let opts = EmbedOptions::default();
    // Alone: a batch per input.
    let mut one = session(64, 1, None);
    let alone = embed(&mut one, &refs, &opts).unwrap();
    // Batches of up to 3 inputs and 40 tokens: [0, 1], [2, 3, 4]... each filled to what fits.
    let mut packed = session(40, 3, None);
    let batched = embed(&mut packed, &refs, &opts).unwrap();
    assert_eq!(alone, batched);
    assert_eq!(batched.width, 64);
    assert_eq!(batched.tokens, vec![5, 3, 30, 1, 3]);
    for i in 0..inputs.len() {
        let v = batched.row(i, 0).unwrap();
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "input {i}: Euclidean-normalised, length {norm}");
    }
    // Unnormalised, the helper gives the engine's vectors; normalised afterwards, the same.
    let raw =
        embed(&mut packed, &refs, &EmbedOptions { normalize: Normalize::None, truncate: false }).unwrap();
    let mut again = vec![0f32; 64];
    normalize(raw.row(2, 0).unwrap(), &mut again, Normalize::Euclidean);
    assert_eq!(again, batched.row(2, 0).unwrap());
    // Per token: every token's vector, in order.
    let mut per_token = session(40, 3, Some(Pooling::None));
    let tokens = embed(&mut per_token, &refs, &opts).unwrap();
    assert_eq!(tokens.rows[2].len(), 30 * 64);
    assert!(tokens.row(2, 29).is_some() && tokens.row(2, 30).is_none());
}

#[test]
fn long_inputs_are_refused_or_truncated_and_empty_ones_refused() {
    let long: Vec<u32> = (0..50).map(|i| 5 + i).collect();
    let mut s = session(32, 2, None);
    let err = embed(&mut s, &[&[2, 3], &long], &EmbedOptions::default()).unwrap_err();
    assert!(matches!(err, EmbedError::ExceedsContext { index: 1, tokens: 50, limit: 32 }), "{err}");
    assert!(err.to_string().contains("exceeds the available context size"), "{err}");
    let cut = embed(&mut s, &[&long], &EmbedOptions { truncate: true, ..Default::default() }).unwrap();
    let first = embed(&mut s, &[&long[..32]], &EmbedOptions::default()).unwrap();
    assert_eq!(cut.rows, first.rows);
    assert_eq!(cut.tokens, vec![32]);
    let err = embed(&mut s, &[&[2, 3], &[]], &EmbedOptions::default()).unwrap_err();
    assert!(matches!(err, EmbedError::Empty { index: 1 }), "{err}");
}

#[test]
fn a_generating_model_has_no_embeddings() {
    let model = ModelFile::open_static(std::path::Path::new(QWEN2)).unwrap();
    let mut s = Session::new(model, &SessionOptions::default()).unwrap();
    let err = embed(&mut s, &[&[1, 2]], &EmbedOptions::default()).unwrap_err();
    assert!(matches!(err, EmbedError::NotAnEncoder), "{err}");
}

#[test]
fn pinfer_embed_prints_llama_embeddings_formats() {
    let json = pinfer(&[
        "embed",
        "-m",
        BERT,
        "--token-ids",
        "-p",
        "2 10 11 12 3\n2 40 3",
        "--embd-output-format",
        "json",
    ]);
    assert!(json.status.success(), "{}", text_of(&json.stderr));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    let e: Vec<f64> = data[0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(e.len(), 64);
    assert!((e.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);

    // The same vector from the std helper, as llama-embedding prints it (%1.7f).
    let mut s = session(64, 2, None);
    let want = embed(&mut s, &[&[2, 10, 11, 12, 3]], &EmbedOptions::default()).unwrap();
    let printed: Vec<String> = want.row(0, 0).unwrap().iter().map(|x| format!("{x:.7}")).collect();
    let raw =
        pinfer(&["embed", "-m", BERT, "--token-ids", "-p", "2 10 11 12 3", "--embd-output-format", "raw"]);
    assert_eq!(text_of(&raw.stdout), printed.join(" ") + "\n");

    let array = pinfer(&[
        "embed",
        "-m",
        BERT,
        "--token-ids",
        "-p",
        "2 10 3\n2 11 3",
        "--embd-output-format",
        "array",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&array.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    // Per token: one vector per token; max-abs normalisation prints integers.
    let none = pinfer(&[
        "embed",
        "-m",
        BERT,
        "--token-ids",
        "-p",
        "2 10 3",
        "--pooling",
        "none",
        "--embd-normalize",
        "0",
        "--embd-output-format",
        "array",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&none.stdout).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows[0]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x.as_f64() == Some(32760.0) || x.as_f64() == Some(-32760.0)));
    // The default output: the vectors' first values and the similarity matrix.
    let summary = pinfer(&["embed", "-m", BERT, "--token-ids", "-p", "2 10 3\n2 11 3"]);
    let text = text_of(&summary.stdout);
    assert!(text.contains("embedding 1: ") && text.contains("cosine similarity matrix"), "{text}");
}

#[test]
fn pinfer_rerank_scores_each_document() {
    let docs = temp_file("docs.txt", b"2 11 3\n2 12 13 3\n");
    let rerank = |model: &str| {
        let out = pinfer(&[
            "rerank",
            "-m",
            model,
            "--token-ids",
            "--query",
            "2 10 3",
            "-f",
            docs.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", text_of(&out.stderr));
        text_of(&out.stdout)
    };
    // The pair [CLS] q [SEP] d [SEP], every token type 0: the score `embed --pooling rank
    // --embd-normalize -1` gives it.
    let type0 = |model: &str| {
        let args = ["embed", "-m", model, "--token-ids", "-p", "2 10 3 11 3\n2 10 3 12 13 3"];
        text_of(&pinfer(&[&args[..], &["--pooling", "rank", "--embd-normalize", "-1"]].concat()).stdout)
    };
    // A one-type cross-encoder: what llama.cpp computes.
    let one_type = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny/bert-rerank-tiny.gguf");
    let got = rerank(one_type);
    assert_eq!(got, type0(one_type));
    assert!(got.starts_with("rerank score 0: "), "{got}");
    // bert-tiny has two token types: the document's tokens are type 1 (HF's pair encoding), so
    // its scores are not the type-0 ones.
    let (got, type0) = (rerank(BERT), type0(BERT));
    assert!(got.starts_with("rerank score 0: ") && type0.starts_with("rerank score 0: "), "{got}");
    assert_ne!(got, type0, "the document's token type 1 changes the scores");
}

#[test]
fn pinfer_rerank_fills_a_rerankers_template_and_names_its_labels() {
    // Qwen3-Reranker: each pair through the model's `rerank` template, a yes and a no
    // probability per pair, printed with the labels as llama-embedding prints them; the values
    // are llama-embedding's (tests/golden/embeddings/qwen3-rerank-tiny.llama.json) to 2e-3.
    let pairs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/embeddings/rerank-pairs.txt"
    ))
    .unwrap();
    let (query, doc) = pairs.lines().next().unwrap().split_once('\t').unwrap();
    let docs = temp_file("qwen3-docs.txt", format!("{doc}\n").as_bytes());
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny/qwen3-rerank-tiny.gguf");
    let out = pinfer(&["rerank", "-m", model, "--query", query, "-f", docs.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    let text = text_of(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/golden/embeddings/qwen3-rerank-tiny.llama.json"
        ))
        .unwrap(),
    )
    .unwrap();
    for (line, (label, want)) in lines.iter().zip([("yes", 0), ("no", 1)]) {
        let rest = line.strip_prefix("rerank score 0: ").unwrap_or_else(|| panic!("{text}"));
        let (score, name) = rest.trim().split_once(' ').unwrap();
        assert_eq!(name, format!("[{label}]"), "{text}");
        let want = golden["vectors"][0][want].as_f64().unwrap();
        let got: f64 = score.parse().unwrap();
        assert!((got - want).abs() <= 2e-3, "{label}: {got} against llama-embedding's {want}");
    }
}

#[test]
fn each_kind_of_model_is_refused_where_the_other_belongs() {
    let gen = pinfer(&["generate", "-m", BERT, "-p", "hi", "-n", "2"]);
    assert!(!gen.status.success());
    assert!(text_of(&gen.stderr).contains("is an embedding model"), "{}", text_of(&gen.stderr));
    let emb = pinfer(&["embed", "-m", QWEN2, "--token-ids", "-p", "1 2"]);
    assert!(!emb.status.success());
    assert!(text_of(&emb.stderr).contains("has no embedding output"), "{}", text_of(&emb.stderr));
    let rank = pinfer(&["embed", "-m", QWEN2, "--token-ids", "-p", "1 2", "--pooling", "mean"]);
    assert!(text_of(&rank.stderr).contains("generates text"), "{}", text_of(&rank.stderr));
    let long = pinfer(&["embed", "-m", BERT, "--token-ids", "-b", "4", "-p", "2 5 5 5 5 3"]);
    assert!(
        text_of(&long.stderr).contains("exceeds the available context size"),
        "{}",
        text_of(&long.stderr)
    );
    let bad = pinfer(&["embed", "-m", BERT, "--token-ids", "-p", "2 x 3"]);
    assert!(text_of(&bad.stderr).contains("not a token id"), "{}", text_of(&bad.stderr));
}
