//! LoRA adapters (llama.cpp's GGUF form) read against their base model: a good adapter's pairs,
//! rank and scale; every way an adapter can fail to apply refused with the key or tensor named
//! (another architecture, a missing partner, shapes that do not fit, mixed ranks, a file that is
//! not an adapter).

mod common;

use common::{Bytes, Val};
use pinfer::gguf::Gguf;
use pinfer::model::lora::{LoraAdapter, LoraError};
use pinfer::model::HParams;

const F32: u32 = 0;

/// An adapter GGUF: metadata `kvs`, F32 tensors `(name, [ne0, ne1])` (zeros).
fn adapter(kvs: &[(&str, Val)], tensors: &[(&str, [u64; 2])]) -> Vec<u8> {
    let mut b = Bytes::header(3, tensors.len() as u64, kvs.len() as u64);
    for (k, v) in kvs {
        b.kv(k, v);
    }
    let mut offset = 0u64;
    for (name, ne) in tensors {
        b.tensor(name.as_bytes(), ne, F32, offset);
        offset += (ne[0] * ne[1] * 4).next_multiple_of(32);
    }
    b.pad_to(32);
    b.zeros(offset as usize);
    b.into_vec()
}

fn lora_kvs(arch: &str, alpha: f32) -> Vec<(&'static str, Val)> {
    vec![
        ("general.architecture", Val::str(arch)),
        ("general.type", Val::str("adapter")),
        ("adapter.type", Val::str("lora")),
        ("adapter.lora.alpha", Val::F32(alpha)),
    ]
}

fn with_base<R>(f: impl FnOnce(&Gguf<'_>, &HParams) -> R) -> R {
    let path = format!("{}/models/SmolLM2-135M-Instruct.Q4_1.gguf", env!("CARGO_MANIFEST_DIR"));
    let model = pinfer::loader::ModelFile::open(std::path::Path::new(&path)).expect("run scripts/setup.sh");
    let gguf = model.parse().unwrap();
    let hp = HParams::from_gguf(&gguf).unwrap();
    f(&gguf, &hp)
}

fn check(bytes: &[u8]) -> Result<(f32, u64, Vec<String>, f32), LoraError> {
    let adapter = Gguf::parse(bytes).unwrap();
    with_base(|base, hp| {
        LoraAdapter::check(&adapter, base, hp)
            .map(|a| (a.alpha, a.rank, a.pairs.iter().map(|p| p.target.to_string()).collect(), a.scale(0.5)))
    })
}

#[test]
fn a_good_adapter_is_read_with_its_pairs_rank_and_scale() {
    // SmolLM2: attn_q [576, 576], attn_k [576, 192], ffn_down [1536, 576]; rank 8, alpha 16.
    let bytes = adapter(
        &lora_kvs("llama", 16.0),
        &[
            ("blk.0.attn_q.weight.lora_a", [576, 8]),
            ("blk.0.attn_q.weight.lora_b", [8, 576]),
            ("blk.3.attn_k.weight.lora_b", [8, 192]),
            ("blk.3.attn_k.weight.lora_a", [576, 8]),
            ("blk.29.ffn_down.weight.lora_a", [1536, 8]),
            ("blk.29.ffn_down.weight.lora_b", [8, 576]),
        ],
    );
    let (alpha, rank, targets, scale) = check(&bytes).unwrap();
    assert_eq!((alpha, rank), (16.0, 8));
    assert_eq!(targets, ["blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.29.ffn_down.weight"]);
    assert_eq!(scale, 0.5 * 16.0 / 8.0, "user scale * alpha / rank");
    // Without alpha the scale is the user's.
    let mut kvs = lora_kvs("llama", 0.0);
    kvs.pop();
    let bytes =
        adapter(&kvs, &[("blk.0.attn_v.weight.lora_a", [576, 4]), ("blk.0.attn_v.weight.lora_b", [4, 192])]);
    let (alpha, rank, _, scale) = check(&bytes).unwrap();
    assert_eq!((alpha, rank, scale), (0.0, 4, 0.5));
}

#[test]
fn adapters_that_do_not_apply_are_refused_by_name() {
    let pair = |w: &'static str, a: [u64; 2], b: [u64; 2]| -> Vec<(String, [u64; 2])> {
        vec![(format!("{w}.lora_a"), a), (format!("{w}.lora_b"), b)]
    };
    let refused = |kvs: Vec<(&str, Val)>, tensors: Vec<(String, [u64; 2])>, says: &[&str]| {
        let t: Vec<(&str, [u64; 2])> = tensors.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        let e = check(&adapter(&kvs, &t)).unwrap_err();
        let msg = e.to_string();
        for s in says {
            assert!(msg.contains(s), "{msg:?} should say {s:?}");
        }
    };
    let q = "blk.0.attn_q.weight";
    let good = || pair(q, [576, 8], [8, 576]);
    // Another architecture; not an adapter at all; a bad alpha.
    refused(lora_kvs("qwen2", 16.0), good(), &["qwen2", "llama"]);
    let mut kvs = lora_kvs("llama", 16.0);
    kvs[1] = ("general.type", Val::str("model"));
    refused(kvs, good(), &["not a LoRA adapter", "model"]);
    refused(lora_kvs("llama", f32::NAN), good(), &["alpha"]);
    refused(lora_kvs("llama", -1.0), good(), &["alpha"]);
    // A missing lora_b, a missing lora_a, a tensor that is neither.
    refused(
        lora_kvs("llama", 16.0),
        vec![(format!("{q}.lora_a"), [576, 8])],
        &["blk.0.attn_q.weight.lora_a", "partner"],
    );
    refused(
        lora_kvs("llama", 16.0),
        vec![(format!("{q}.lora_b"), [8, 576])],
        &["blk.0.attn_q.weight.lora_b", "partner"],
    );
    let mut t = good();
    t.push(("blk.0.attn_q.weight".into(), [576, 576]));
    refused(lora_kvs("llama", 16.0), t, &["neither"]);
    // A weight the model does not have.
    refused(
        lora_kvs("llama", 16.0),
        pair("blk.30.attn_q.weight", [576, 8], [8, 576]),
        &["blk.30.attn_q.weight", "does not have"],
    );
    // Shapes: A's rows, B's rows, ranks that differ, B stored transposed.
    refused(lora_kvs("llama", 16.0), pair(q, [512, 8], [8, 576]), &["attn_q", "lora_a's rows"]);
    refused(lora_kvs("llama", 16.0), pair(q, [576, 8], [8, 192]), &["attn_q", "lora_b"]);
    refused(lora_kvs("llama", 16.0), pair(q, [576, 8], [4, 576]), &["attn_q", "rank"]);
    refused(lora_kvs("llama", 16.0), pair("blk.0.attn_k.weight", [576, 8], [192, 8]), &["attn_k", "lora_b"]);
    // Mixed ranks across pairs; no pairs at all.
    let mut t = good();
    t.extend(pair("blk.1.attn_q.weight", [576, 4], [4, 576]));
    refused(lora_kvs("llama", 16.0), t, &["blk.1.attn_q.weight", "rank 4", "8"]);
    refused(lora_kvs("llama", 16.0), vec![], &["0 pairs"]);
}

/// The writer's adapter is read back as it was written: names, rank, alpha, values.
#[test]
fn written_adapters_are_read_back() {
    use pinfer::model::lora::{write_adapter, PairValues};
    let a: Vec<f32> = (0..576 * 4).map(|i| i as f32 * 0.001).collect();
    let b: Vec<f32> = (0..4 * 192).map(|i| -(i as f32) * 0.002).collect();
    let pairs = [PairValues { target: "blk.2.attn_v.weight", n_in: 576, n_out: 192, a: &a, b: &b }];
    let bytes = write_adapter(Vec::new(), "llama", 4, 8.0, &pairs).unwrap();
    let (alpha, rank, targets, scale) = check(&bytes).unwrap();
    assert_eq!((alpha, rank, targets, scale), (8.0, 4, vec!["blk.2.attn_v.weight".to_string()], 1.0));
    let gguf = Gguf::parse(&bytes).unwrap();
    let data = |name: &str| {
        let t = gguf.tensor(name).unwrap();
        let start = gguf.data_start() + t.offset as usize;
        let raw = &bytes[start..start + t.nbytes as usize];
        raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<f32>>()
    };
    assert_eq!(data("blk.2.attn_v.weight.lora_a"), a);
    assert_eq!(data("blk.2.attn_v.weight.lora_b"), b);
    // Values that do not match the rank are refused before anything is written.
    let short = [PairValues { target: "blk.2.attn_v.weight", n_in: 576, n_out: 192, a: &a[..100], b: &b }];
    assert!(write_adapter(Vec::new(), "llama", 4, 8.0, &short).unwrap_err().to_string().contains("rank 4"));
}
