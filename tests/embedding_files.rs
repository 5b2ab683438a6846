//! The embedding models setup writes (issue 50), read with pinfer's own GGUF parser: all-MiniLM-L6-v2's
//! F16 GGUF (scripts/convert_bert.py, byte-identical to llama.cpp's converter) and the tiny encoder
//! models (scripts/make_encoder_tiny.py) have the keys and tensors llama.cpp's loader reads, as the
//! goldens in tests/golden/embeddings were made from them. Checks only these files; what the engine
//! computes from them is checked against the goldens by the engine's tests.

use pinfer::gguf::{Gguf, Value};
use pinfer::quant::GgmlType;

fn read(rel: &str) -> Vec<u8> {
    let path = format!("{}/{rel}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{path}: {e} (run scripts/setup.sh minilm and encoder-tiny)"))
}

fn uint(g: &Gguf<'_>, key: &str) -> u32 {
    g.get_u32(key).unwrap_or_else(|e| panic!("{key}: {e}"))
}

fn flag(g: &Gguf<'_>, key: &str) -> bool {
    g.get_bool_opt(key).unwrap().unwrap_or_else(|| panic!("{key} missing"))
}

/// (name, type, ne) of a tensor, or a panic naming it.
fn tensor(g: &Gguf<'_>, name: &str) -> (GgmlType, Vec<u64>) {
    let t = g.tensor(name).unwrap_or_else(|| panic!("tensor {name} missing"));
    (t.ty, t.ne[..t.n_dims as usize].to_vec())
}

#[test]
fn minilm_f16_has_llama_cpps_bert_keys_and_tensors() {
    let bytes = read("models/all-MiniLM-L6-v2.F16.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "bert");
    let hp: Vec<u32> = ["block_count", "context_length", "embedding_length", "feed_forward_length"]
        .iter()
        .map(|k| uint(&g, &format!("bert.{k}")))
        .collect();
    assert_eq!(hp, [6, 512, 384, 1536]);
    assert_eq!(uint(&g, "bert.attention.head_count"), 12);
    assert_eq!(g.get_f32("bert.attention.layer_norm_epsilon").unwrap(), 1e-12);
    assert!(!flag(&g, "bert.attention.causal"));
    assert_eq!(uint(&g, "bert.pooling_type"), 1, "mean pooling");
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "bert");
    assert_eq!(uint(&g, "tokenizer.ggml.token_type_count"), 2);
    let specials: Vec<u32> = ["bos", "eos", "unknown", "seperator", "padding", "mask"]
        .iter()
        .map(|k| uint(&g, &format!("tokenizer.ggml.{k}_token_id")))
        .collect();
    assert_eq!(specials, [101, 102, 100, 102, 0, 103]);
    assert!(flag(&g, "tokenizer.ggml.add_bos_token") && flag(&g, "tokenizer.ggml.add_eos_token"));
    assert!(!flag(&g, "tokenizer.ggml.add_sep_token"));
    assert!(flag(&g, "tokenizer.ggml.normalizer.lowercase"));
    let Some(Value::Array(tokens)) = g.get("tokenizer.ggml.tokens") else { panic!("no token list") };
    assert_eq!(tokens.len(), 30522);

    let (f16, f32) = (GgmlType::F16, GgmlType::F32);
    assert_eq!(tensor(&g, "token_embd.weight"), (f16, vec![384, 30522]));
    assert_eq!(tensor(&g, "position_embd.weight"), (f32, vec![384, 512]));
    assert_eq!(tensor(&g, "token_types.weight"), (f32, vec![384, 2]));
    assert_eq!(tensor(&g, "token_embd_norm.weight"), (f32, vec![384]));
    assert_eq!(tensor(&g, "token_embd_norm.bias"), (f32, vec![384]));
    for i in 0..6 {
        for (name, ne) in [
            ("attn_q", [384, 384]),
            ("attn_k", [384, 384]),
            ("attn_v", [384, 384]),
            ("attn_output", [384, 384]),
            ("ffn_up", [384, 1536]),
            ("ffn_down", [1536, 384]),
        ] {
            assert_eq!(tensor(&g, &format!("blk.{i}.{name}.weight")), (f16, ne.to_vec()));
            assert_eq!(tensor(&g, &format!("blk.{i}.{name}.bias")), (f32, vec![ne[1]]));
        }
        for norm in ["attn_output_norm", "layer_output_norm"] {
            for part in ["weight", "bias"] {
                assert_eq!(tensor(&g, &format!("blk.{i}.{norm}.{part}")), (f32, vec![384]));
            }
        }
    }
    assert_eq!(g.tensor_count(), 5 + 6 * 16);
}

/// The tiny encoder models: file, architecture, pooling type (0 none .. 4 rank), tensors each must have.
const TINY: &[(&str, &str, u32, &[&str])] = &[
    (
        "nomic-bert-tiny.gguf",
        "nomic-bert",
        1,
        &[
            "token_types.weight",
            "blk.1.attn_qkv.weight",
            "blk.1.ffn_gate.weight",
            "blk.1.layer_output_norm.bias",
        ],
    ),
    (
        "jina-bert-v2-tiny.gguf",
        "jina-bert-v2",
        1,
        &["token_types.weight", "blk.1.attn_q.bias", "blk.1.ffn_down.bias"],
    ),
    (
        "bert-rerank-tiny.gguf",
        "bert",
        4,
        &["position_embd.weight", "cls.weight", "cls.bias", "cls.output.bias"],
    ),
    ("qwen3-embed-tiny.gguf", "qwen3", 3, &["output_norm.weight", "blk.1.attn_k_norm.weight"]),
    ("qwen3-rerank-tiny.gguf", "qwen3", 4, &["cls.output.weight", "blk.1.attn_q_norm.weight"]),
    (
        "gemma-embed-tiny.gguf",
        "gemma-embedding",
        1,
        &[
            "dense_2.weight",
            "dense_3.weight",
            "blk.2.post_attention_norm.weight",
            "blk.2.post_ffw_norm.weight",
        ],
    ),
];

#[test]
fn tiny_encoder_models_have_their_familys_keys_and_tensors() {
    for &(file, arch, pooling, names) in TINY {
        let bytes = read(&format!("models/tiny/{file}"));
        let g = Gguf::parse(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(g.get_str("general.architecture").unwrap(), arch, "{file}");
        assert_eq!(uint(&g, &format!("{arch}.pooling_type")), pooling, "{file}");
        for name in names {
            assert!(g.tensor(name).is_some(), "{file}: tensor {name} missing");
        }
    }
    // GEGLU: jina's up matrix holds gate and up (2 x n_ff rows); Qwen3-Reranker's head scores yes, no.
    let bytes = read("models/tiny/jina-bert-v2-tiny.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(
        tensor(&g, "blk.0.ffn_up.weight").1,
        [64, 2 * uint(&g, "jina-bert-v2.feed_forward_length") as u64]
    );
    let bytes = read("models/tiny/qwen3-rerank-tiny.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(tensor(&g, "cls.output.weight").1, [64, 2]);
    assert!(g.get_str("tokenizer.chat_template.rerank").unwrap().contains("{document}"));
    let bytes = read("models/tiny/gemma-embed-tiny.gguf");
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(uint(&g, "gemma-embedding.attention.sliding_window"), 4);
    assert_eq!(tensor(&g, "dense_2.weight").1, [64, 96]);
}
