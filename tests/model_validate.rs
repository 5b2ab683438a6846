//! Model-level validation: the keys, ranges, vocabulary and tensors a runnable model needs, on the
//! real default model and on a tiny generated model with one thing wrong at a time.

// ModelError carries names and shapes by value (the core cannot box); size is irrelevant here.
#![allow(clippy::result_large_err)]

mod common;

use common::{
    ggml::{Q4_0, Q8_0, Q8_K},
    tiny_model as tiny, GgufBuilder, Val, E, VOCAB,
};
use pinfer::gguf::Gguf;
use pinfer::model::{validate_tensors, validate_vocab, Arch, HParams, ModelError};

/// Everything generation checks at load.
fn validate(b: &GgufBuilder) -> Result<HParams, ModelError> {
    let bytes = b.bytes();
    let g = Gguf::parse(&bytes).expect("the container itself is valid in these tests");
    let hp = HParams::from_gguf(&g)?;
    let vocab = validate_vocab(&g)?;
    validate_tensors(&g, &hp, vocab.n_vocab)?;
    Ok(hp)
}

fn set(mut b: GgufBuilder, key: &str, v: Val) -> GgufBuilder {
    match b.kvs.iter_mut().find(|(k, _)| k == key) {
        Some(kv) => kv.1 = v,
        None => b.kvs.push((key.to_string(), v)),
    }
    b
}

fn remove(mut b: GgufBuilder, key: &str) -> GgufBuilder {
    b.kvs.retain(|(k, _)| k != key);
    b
}

fn retype(mut b: GgufBuilder, name: &str, dims: &[u64], ty: u32) -> GgufBuilder {
    b.tensors.retain(|t| t.name != name);
    b.tensor(name, dims, ty)
}

/// The error of `b`, rendered, which must mention every one of `words`.
fn refused(what: &str, b: &GgufBuilder, words: &[&str]) {
    let err = validate(b).expect_err(what).to_string();
    for w in words {
        assert!(err.contains(w), "{what}: error {err:?} does not mention {w:?}");
    }
}

#[test]
fn the_default_model_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(path).expect("default model missing: run scripts/setup.sh model");
    let g = Gguf::parse(&bytes).unwrap();
    let hp = HParams::from_gguf(&g).unwrap();
    let vocab = validate_vocab(&g).unwrap();
    validate_tensors(&g, &hp, vocab.n_vocab).unwrap();
    assert_eq!((hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv), (Arch::Llama, 30, 576, 9, 3));
    assert_eq!(
        (vocab.model, vocab.pre, vocab.n_vocab, vocab.n_merges),
        ("gpt2", Some("smollm"), 49152, 48900)
    );
    assert_eq!(g.tensor_count(), 272);
}

#[test]
fn every_supported_architecture_validates() {
    for arch in [
        "llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "granite", "smollm3", "phi3", "lfm2",
        "lfm2moe", "qwen35", "qwen2vl",
    ] {
        let hp = validate(&tiny(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(hp.arch.name(), arch);
        assert_eq!((hp.head_dim_k, hp.n_expert_used), (16, if arch.ends_with("moe") { 2 } else { 0 }));
    }
}

#[test]
fn unsupported_architectures_are_refused_by_name() {
    refused(
        "arch",
        &set(tiny("llama"), "general.architecture", Val::str("mamba")),
        &["\"mamba\"", "not supported"],
    );
    refused("no arch", &remove(tiny("llama"), "general.architecture"), &["general.architecture", "missing"]);
    for moe in ["deepseek2", "mixtral", "gpt-oss", "llama4"] {
        refused(
            moe,
            &set(tiny("llama"), "general.architecture", Val::str(moe)),
            &[moe, "mixture-of-experts", "qwen3moe, qwen2moe"],
        );
    }
    // Mixtral's files say `llama` and carry experts.
    refused(
        "mixtral as llama",
        &set(tiny("llama"), "llama.expert_count", Val::U32(8)),
        &["\"llama\"", "8 experts", "qwen3moe, qwen2moe"],
    );
}

#[test]
fn hyper_parameters_must_be_present_typed_and_sane() {
    let b = || tiny("llama");
    refused("missing", &remove(b(), "llama.block_count"), &["llama.block_count", "missing"]);
    refused("type", &set(b(), "llama.block_count", Val::str("2")), &["llama.block_count", "string"]);
    refused("zero layers", &set(b(), "llama.block_count", Val::U32(0)), &["llama.block_count", "range"]);
    refused("too many layers", &set(b(), "llama.block_count", Val::U32(100_000)), &["llama.block_count"]);
    refused("negative", &set(b(), "llama.embedding_length", Val::I32(-64)), &["llama.embedding_length"]);
    refused(
        "kv heads",
        &set(b(), "llama.attention.head_count_kv", Val::U32(3)),
        &["head_count_kv", "divide"],
    );
    refused("zero heads", &set(b(), "llama.attention.head_count", Val::U32(0)), &["head_count"]);
    refused("eps", &set(b(), "llama.attention.layer_norm_rms_epsilon", Val::F32(f32::NAN)), &["epsilon"]);
    refused("rope base", &set(b(), "llama.rope.freq_base", Val::F32(-1.0)), &["freq_base"]);
    refused("odd rope", &set(b(), "llama.rope.dimension_count", Val::U32(7)), &["dimension_count"]);
    refused(
        "per-layer",
        &set(b(), "llama.attention.head_count", Val::Array(4, vec![Val::U32(4); 2])),
        &["head_count"],
    );
    refused("embedding vs shapes", &set(b(), "llama.embedding_length", Val::U32(32)), &["shape"]);
    refused("vocab size", &set(b(), "llama.vocab_size", Val::U32(41)), &["vocab_size"]);
    let moe = || tiny("qwen3moe");
    refused("experts used", &set(moe(), "qwen3moe.expert_used_count", Val::U32(0)), &["expert_used_count"]);
    refused(
        "more used than experts",
        &set(moe(), "qwen3moe.expert_used_count", Val::U32(5)),
        &["expert_used_count"],
    );
    refused(
        "gemma window",
        &set(tiny("gemma3"), "gemma3.attention.sliding_window", Val::U32(0)),
        &["sliding_window"],
    );
}

#[test]
fn vocabulary_must_be_consistent() {
    let b = || tiny("llama");
    refused("tokenizer kind", &set(b(), "tokenizer.ggml.model", Val::str("rwkv")), &["tokenizer.ggml.model"]);
    refused(
        "tokens type",
        &set(b(), "tokenizer.ggml.tokens", Val::Array(5, vec![Val::I32(0); VOCAB])),
        &["tokens", "strings"],
    );
    refused("empty vocab", &set(b(), "tokenizer.ggml.tokens", Val::Array(8, vec![])), &["tokens"]);
    // The scores-as-int8 confusion of the hostile-input sheet: right length, wrong element type.
    refused(
        "scores type",
        &set(b(), "tokenizer.ggml.scores", Val::Array(1, vec![Val::I8(0); VOCAB])),
        &["scores", "float32"],
    );
    refused(
        "scores length",
        &set(b(), "tokenizer.ggml.scores", Val::Array(6, vec![Val::F32(0.0); 3])),
        &["scores", "length"],
    );
    refused(
        "types length",
        &set(b(), "tokenizer.ggml.token_type", Val::Array(5, vec![Val::I32(1); 5])),
        &["token_type"],
    );
    refused(
        "type value",
        &set(b(), "tokenizer.ggml.token_type", Val::Array(5, vec![Val::I32(9); VOCAB])),
        &["token_type"],
    );
    let mut bad_byte = vec![Val::I32(1); VOCAB];
    bad_byte[3] = Val::I32(6);
    refused("byte token", &set(b(), "tokenizer.ggml.token_type", Val::Array(5, bad_byte)), &["<0xHH>", "3"]);
    refused("merges", &set(b(), "tokenizer.ggml.merges", Val::strs(&["t1t2"])), &["merges"]);
    refused("no merges", &remove(b(), "tokenizer.ggml.merges"), &["merges"]);
    refused("eos", &set(b(), "tokenizer.ggml.eos_token_id", Val::U32(VOCAB as u32)), &["eos_token_id", "40"]);
    refused("eos type", &set(b(), "tokenizer.ggml.eos_token_id", Val::str("2")), &["eos_token_id"]);
    refused("pad", &set(b(), "tokenizer.ggml.padding_token_id", Val::I32(-5)), &["padding_token_id"]);
    // "-1" means "no such token" and is accepted.
    validate(&set(b(), "tokenizer.ggml.padding_token_id", Val::I32(-1))).unwrap();
    // SentencePiece defaults (unk 0, bos 1, eos 2) are checked when the keys are absent.
    let spm = |n: usize| {
        let toks: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
        let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
        let b = set(b(), "tokenizer.ggml.model", Val::str("llama"));
        let b = set(b, "tokenizer.ggml.tokens", Val::strs(&refs));
        let b = remove(b, "tokenizer.ggml.token_type");
        let b = remove(b, "tokenizer.ggml.eos_token_id");
        remove(b, "tokenizer.ggml.bos_token_id")
    };
    let bytes = spm(2).bytes();
    let g = Gguf::parse(&bytes).unwrap();
    let err = validate_vocab(&g).unwrap_err().to_string();
    assert!(err.contains("eos_token_id") && err.contains("default"), "{err}");
    let bytes = spm(3).bytes();
    validate_vocab(&Gguf::parse(&bytes).unwrap()).unwrap();
}

#[test]
fn tensors_must_be_present_with_the_right_shape_and_type() {
    let b = || tiny("llama");
    let mut missing = b();
    missing.tensors.retain(|t| t.name != "blk.1.ffn_down.weight");
    refused("missing", &missing, &["blk.1.ffn_down.weight", "missing"]);
    refused(
        "shape",
        &retype(b(), "blk.0.attn_k.weight", &[E, E], Q4_0),
        &["blk.0.attn_k.weight", "[64, 64]", "[64, 32]"],
    );
    refused(
        "norm type",
        &retype(b(), "blk.0.attn_norm.weight", &[E], Q8_0),
        &["blk.0.attn_norm.weight", "Q8_0"],
    );
    refused("weight type", &retype(b(), "blk.0.attn_q.weight", &[E * 4, E], Q8_K), &["blk.0.attn_q.weight"]);
    refused("embedding rows", &retype(b(), "token_embd.weight", &[E, 41], Q8_0), &["token_embd.weight"]);
    let mut router = tiny("qwen3moe");
    router = retype(router, "blk.0.ffn_gate_inp.weight", &[E, 4], Q8_0);
    refused("quantized router", &router, &["ffn_gate_inp", "Q8_0"]);
    // An untied output matrix is optional but must have the right shape when present.
    validate(&b().tensor("output.weight", &[E, VOCAB as u64], Q8_0)).unwrap();
    refused("output", &b().tensor("output.weight", &[E, 8], Q8_0), &["output.weight"]);
}

/// The forward graph computes RoPE's angles once per parameter set, not per head and layer: one
/// table shared by the Q and K RoPEs of SmolLM2's 30 layers, two for Gemma 3 (its sliding-window
/// layers rotate with another base than its global ones).
#[test]
fn forward_graphs_share_one_rope_table_per_parameter_set() {
    use pinfer::graph::{Graph, Op};
    use pinfer::model::{build_forward, KvLayout};
    for (file, n_tables, n_ropes) in
        [("SmolLM2-135M-Instruct.Q4_1.gguf", 1, 60), ("gemma-3-270m-q4_k_m.gguf", 2, 36)]
    {
        let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
        let model =
            pinfer::loader::ModelFile::open(std::path::Path::new(&path)).expect("run scripts/setup.sh");
        let gguf = model.parse().unwrap();
        let hp = HParams::from_gguf(&gguf).unwrap();
        let mut graph: Box<Graph> = Box::new(Graph::new());
        let kv = KvLayout::new(&hp, 64, 8, 1, Default::default()).unwrap();
        build_forward(&mut graph, &gguf, &hp, &kv, 8, 1, &[], Default::default()).unwrap();
        let nodes: Vec<_> = graph.order().iter().map(|&id| (id, graph.tensor(id))).collect();
        let tables: Vec<_> = nodes.iter().filter(|(_, t)| t.op == Op::RopeTable).map(|(id, _)| *id).collect();
        let ropes: Vec<_> = nodes.iter().filter(|(_, t)| t.op == Op::Rope).collect();
        assert_eq!((tables.len(), ropes.len()), (n_tables, n_ropes), "{file}");
        for (_, rope) in ropes {
            assert!(tables.contains(&rope.src[1].unwrap()), "{file}: a rope without a shared table");
        }
        for &table in &tables {
            assert_eq!(graph.tensor(table).ne[..2], [hp.n_rot as usize, 8], "{file}: one row per token");
        }
    }
}

/// KV cache types (`-ctk/-ctv`): a q8_0 cache takes exactly 8.5/16 of an f16 one (34-byte
/// blocks of 32 values against 2 bytes a value), q4_0 4.5/16; a type the heads cannot hold
/// (block size does not divide the head size) and a type that is no cache type are refused
/// with the reason.
#[test]
fn kv_cache_types_are_planned_and_checked() {
    use pinfer::model::{KvLayout, KvTypeError, KvTypes};
    use pinfer::quant::GgmlType;
    let path = format!("{}/models/SmolLM2-135M-Instruct.Q4_1.gguf", env!("CARGO_MANIFEST_DIR"));
    let model = pinfer::loader::ModelFile::open(std::path::Path::new(&path)).expect("run scripts/setup.sh");
    let gguf = model.parse().unwrap();
    let mut hp = HParams::from_gguf(&gguf).unwrap();
    let layout = |k, v| KvLayout::new(&hp, 4096, 8, 1, KvTypes { k, v }).unwrap();
    let f16 = layout(GgmlType::F16, GgmlType::F16);
    let q8 = layout(GgmlType::Q8_0, GgmlType::Q8_0);
    let q4 = layout(GgmlType::Q4_0, GgmlType::F16);
    // SmolLM2: 3 KV heads of 64 dimensions.
    let (f16, q8, q4) = (f16.kinds[0], q8.kinds[0], q4.kinds[0]);
    assert_eq!((f16.k_row_bytes, q8.k_row_bytes, q8.v_row_bytes), (384, 204, 204));
    assert_eq!(q8.k_layer_bytes * 16, f16.k_layer_bytes * 17 / 2);
    assert_eq!((q4.k_row_bytes * 16, q4.v_row_bytes), (384 * 9 / 2, 384));
    let cache = |k, v| layout(k, v).ids_offset;
    assert_eq!(
        cache(GgmlType::Q8_0, GgmlType::Q8_0) * 32,
        cache(GgmlType::F16, GgmlType::F16) * 17,
        "q8_0 K and V: 8.5/16 of f16"
    );
    for ty in [GgmlType::F32, GgmlType::BF16, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1] {
        KvTypes { k: ty, v: ty }.check(&hp).unwrap();
    }

    let e = KvTypes { k: GgmlType::Q4_K, v: GgmlType::F16 }.check(&hp).unwrap_err();
    assert_eq!(e, KvTypeError::NotACacheType(GgmlType::Q4_K));
    let msg = e.to_string();
    assert!(msg.contains("q4_k cannot hold") && msg.contains("q8_0, bf16"), "{msg}");
    hp.head_dim_k = 48;
    hp.head_dim_v = 48;
    let e = KvTypes { k: GgmlType::F16, v: GgmlType::Q8_0 }.check(&hp).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("q8_0") && msg.contains("48") && msg.contains("32"), "{msg}");
    KvTypes { k: GgmlType::F16, v: GgmlType::BF16 }.check(&hp).unwrap();
}

/// granite, smollm3 and phi3: their keys are read, and what pinfer does not compute (or a file that
/// lacks what the architecture needs) is refused naming the key or tensor.
#[test]
fn granite_smollm3_phi3_files_are_read_and_checked() {
    let granite = validate(&tiny("granite")).unwrap();
    assert_eq!((granite.logit_scale, granite.residual_scale, granite.embedding_scale), (8.0, 0.22, 1.0));
    assert_eq!(granite.attention_scale, None, "absent: 1/sqrt(head size)");
    refused("no logit scale", &remove(tiny("granite"), "granite.logit_scale"), &["granite.logit_scale"]);
    refused(
        "granite without RoPE",
        &set(tiny("granite"), "granite.rope.scaling.finetuned", Val::Bool(0)),
        &["granite.rope.scaling.finetuned", "false"],
    );
    refused(
        "nan scale",
        &set(tiny("granite"), "granite.residual_scale", Val::F32(f32::NAN)),
        &["residual_scale"],
    );
    // A zero multiplier is none, as in llama.cpp.
    let zero = validate(&set(tiny("granite"), "granite.embedding_scale", Val::F32(0.0))).unwrap();
    assert_eq!(zero.embedding_scale, 1.0);

    let phi = || tiny("phi3");
    let hp = validate(&set(phi(), "phi3.rope.scaling.attn_factor", Val::F32(1.19))).unwrap();
    assert_eq!((hp.rope_attn_factor, hp.n_ctx_orig), (1.19, 128));
    validate(&set(phi(), "phi3.rope.scaling.type", Val::str("longrope"))).unwrap();
    refused("phi3 su", &set(phi(), "phi3.rope.scaling.type", Val::str("su")), &["rope.scaling.type", "su"]);
    // The fused matrices must hold every part.
    refused("short qkv", &retype(phi(), "blk.1.attn_qkv.weight", &[E, E], Q4_0), &["blk.1.attn_qkv.weight"]);
    refused("short gate|up", &retype(phi(), "blk.0.ffn_up.weight", &[E, 64], Q4_0), &["blk.0.ffn_up.weight"]);
    let no_down = {
        let mut b = phi();
        b.tensors.retain(|t| t.name != "blk.0.attn_qkv.weight");
        b
    };
    refused("no qkv at all", &no_down, &["blk.0.attn_q.weight"]);
    refused(
        "bad factors",
        &phi().tensor("rope_factors_long.weight", &[3], common::ggml::F32),
        &["rope_factors_long.weight"],
    );
    // A llama file may store Q, K and V fused too (llama.cpp reads either).
    let mut fused = tiny("llama");
    fused.tensors.retain(|t| {
        !matches!(t.name.as_str(), "blk.0.attn_q.weight" | "blk.0.attn_k.weight" | "blk.0.attn_v.weight")
    });
    let kvw = E / 4 * 2;
    validate(&fused.tensor("blk.0.attn_qkv.weight", &[E, E + 2 * kvw], Q4_0)).unwrap();
}

/// Keys whose values change the math are read, and values pinfer does not compute are refused by
/// key and value (a YaRN file run with linear scaling gives every position wrong, silently).
/// LFM2: per-layer KV head counts (0: a short-convolution layer), the convolution's taps, and
/// what is wrong with them refused naming the key and the layer.
#[test]
fn lfm2_layers_and_per_layer_head_counts_are_read_and_checked() {
    let hp = validate(&tiny("lfm2")).unwrap();
    assert!(hp.recurrent.contains(0) && !hp.recurrent.contains(1));
    assert_eq!((hp.n_head_kv, hp.conv_kernel, hp.recurrent.count()), (2, 3, 1));
    let kv_heads = |arch: &str, v: &[u32]| {
        let key = format!("{arch}.attention.head_count_kv");
        set(tiny(arch), &key, Val::Array(4, v.iter().map(|&n| Val::U32(n)).collect()))
    };
    refused("3 entries for 2 layers", &kv_heads("lfm2", &[0, 2, 2]), &["head_count_kv", "block_count"]);
    refused("0 on an attention layer", &kv_heads("llama", &[0, 2]), &["head_count_kv", "layer 0"]);
    refused("counts that differ", &kv_heads("llama", &[2, 1]), &["head_count_kv", "layer 1", "differs"]);
    refused("a count that divides nothing", &kv_heads("lfm2", &[0, 3]), &["head_count_kv", "divide"]);
    // The same count on every layer, as an array, is read as the one value.
    assert_eq!(validate(&kv_heads("llama", &[2, 2])).unwrap().n_head_kv, 2);
    for taps in [0, 1] {
        let b = set(tiny("lfm2"), "lfm2.shortconv.l_cache", Val::U32(taps));
        refused("a convolution of 0 or 1 taps", &b, &["lfm2.shortconv.l_cache"]);
    }
    refused("no taps key", &remove(tiny("lfm2"), "lfm2.shortconv.l_cache"), &["lfm2.shortconv.l_cache"]);
    let f16_taps = retype(tiny("lfm2"), "blk.0.shortconv.conv.weight", &[3, E], common::ggml::F16);
    refused("f16 taps", &f16_taps, &["blk.0.shortconv.conv.weight", "accepted: F32"]);
    let mut no_in_proj = tiny("lfm2");
    no_in_proj.tensors.retain(|t| t.name != "blk.0.shortconv.in_proj.weight");
    refused("no in_proj", &no_in_proj, &["blk.0.shortconv.in_proj.weight", "missing"]);
    let wrong = retype(tiny("lfm2"), "blk.0.shortconv.conv.weight", &[4, E], common::ggml::F32);
    refused("4 taps for l_cache 3", &wrong, &["blk.0.shortconv.conv.weight", "[3, 64]"]);
    // lfm2moe: a dense lead, then experts with a selection bias, under sigmoid gating only.
    let moe = validate(&tiny("lfm2moe")).unwrap();
    assert!(moe.experts_at(0).is_none() && moe.experts_at(1).is_some_and(|x| x.selection_bias));
    let mut no_bias = tiny("lfm2moe");
    no_bias.tensors.retain(|t| t.name != "blk.1.exp_probs_b.bias");
    refused("no selection bias", &no_bias, &["blk.1.exp_probs_b.bias", "missing"]);
    let softmax = set(tiny("lfm2moe"), "lfm2moe.expert_gating_func", Val::U32(1));
    refused("softmax gating", &softmax, &["lfm2moe.expert_gating_func"]);
    refused("no gating", &remove(tiny("lfm2moe"), "lfm2moe.expert_gating_func"), &["expert_gating_func"]);
    let lead = set(tiny("lfm2moe"), "lfm2moe.leading_dense_block_count", Val::U32(3));
    refused("3 dense layers of 2", &lead, &["leading_dense_block_count"]);
    // An attention layer of an lfm2 file needs its attention tensors.
    let mut no_q = tiny("lfm2");
    no_q.tensors.retain(|t| t.name != "blk.1.attn_q.weight");
    refused("no attn_q", &no_q, &["blk.1.attn_q.weight"]);
}

/// Qwen3.5: the gated delta rule's sizes, which layers run it, its tensors, the multi-token
/// prediction blocks left out, and M-RoPE sections that would leave text pairs unrotated refused.
#[test]
fn qwen35_layers_sizes_and_sections_are_read_and_checked() {
    let hp = validate(&tiny("qwen35")).unwrap();
    let d = hp.delta.unwrap();
    assert!(hp.recurrent.contains(0) && !hp.recurrent.contains(1));
    assert_eq!((d.conv_kernel, d.head_dim, d.n_k_heads, d.n_v_heads, d.conv_channels()), (4, 16, 2, 4, 128));
    assert_eq!((hp.conv_state_len(), hp.delta_state_len()), (3 * 128, 16 * 16 * 4));
    let q = |key: &str, v: Val| set(tiny("qwen35"), &format!("qwen35.{key}"), v);
    refused("3 value heads for 2 key heads", &q("ssm.time_step_rank", Val::U32(3)), &["ssm.time_step_rank"]);
    refused("inner size", &q("ssm.inner_size", Val::U32(60)), &["ssm.inner_size"]);
    refused("conv kernel 0", &q("ssm.conv_kernel", Val::U32(0)), &["ssm.conv_kernel"]);
    refused("no state size", &remove(tiny("qwen35"), "qwen35.ssm.state_size"), &["ssm.state_size"]);
    refused("interval 0", &q("full_attention_interval", Val::U32(0)), &["full_attention_interval"]);
    // Every layer attends with interval 1: layer 0's Q, K, V matrix is read as attention's.
    refused(
        "interval 1",
        &q("full_attention_interval", Val::U32(1)),
        &["blk.0.attn_qkv.weight", "[64, 192]"],
    );
    let flags =
        |v: &[u8]| q("attention.recurrent_layers", Val::Array(7, v.iter().map(|&b| Val::Bool(b)).collect()));
    assert!(validate(&flags(&[1, 0])).unwrap().recurrent.contains(0));
    refused("3 flags for 2 layers", &flags(&[1, 0, 0]), &["attention.recurrent_layers"]);
    let mut no_a = tiny("qwen35");
    no_a.tensors.retain(|t| t.name != "blk.0.ssm_a");
    refused("no ssm_a", &no_a, &["blk.0.ssm_a", "missing"]);
    let narrow_q = retype(tiny("qwen35"), "blk.1.attn_q.weight", &[E, E], Q4_0);
    refused("Q without its gate", &narrow_q, &["blk.1.attn_q.weight", "[64, 128]"]);
    // A multi-token-prediction block after the model's own is not run (nor checked).
    let mtp = set(q("nextn_predict_layers", Val::U32(1)), "qwen35.block_count", Val::U32(3));
    assert_eq!(validate(&mtp).unwrap().n_layer, 2);
    // Sections: [3, 3, 3, 0] cover 8 rotated pairs; [3, 3, 1, 0] leave pair 5 to the image position.
    let sections =
        |v: [u32; 4]| q("rope.dimension_sections", Val::Array(4, v.iter().map(|&n| Val::U32(n)).collect()));
    let with_rot = |b: GgufBuilder| set(b, "qwen35.rope.dimension_count", Val::U32(16));
    validate(&with_rot(sections([3, 3, 3, 0]))).unwrap();
    refused("sections", &with_rot(sections([3, 3, 1, 0])), &["rope.dimension_sections"]);
}

/// Qwen2-VL's language model: M-RoPE sections read, and ones pinfer cannot place refused by key.
#[test]
fn qwen2vl_sections_are_read_and_checked() {
    assert_eq!(validate(&tiny("qwen2vl")).unwrap().rope_sections, [2, 3, 3]);
    let sections = |v: &[u32]| {
        set(
            tiny("qwen2vl"),
            "qwen2vl.rope.dimension_sections",
            Val::Array(4, v.iter().map(|&n| Val::U32(n)).collect()),
        )
    };
    assert_eq!(validate(&sections(&[8, 0, 0])).unwrap().rope_sections, [8, 0, 0]);
    for (what, v) in [
        ("a fourth section", &[2, 3, 2, 1][..]),
        ("no pairs", &[0, 0, 0, 0][..]),
        ("more pairs than rotated dimensions", &[8, 8, 1, 0][..]),
        ("two sections", &[4, 4][..]),
        ("five sections", &[2, 2, 2, 2, 0][..]),
    ] {
        refused(what, &sections(v), &["qwen2vl.rope.dimension_sections"]);
    }
    let text = set(tiny("qwen2vl"), "qwen2vl.rope.dimension_sections", Val::str("16,24,24"));
    refused("text", &text, &["qwen2vl.rope.dimension_sections"]);
    refused("none", &remove(tiny("qwen2vl"), "qwen2vl.rope.dimension_sections"), &["dimension_sections"]);
}

#[test]
fn math_pinfer_does_not_compute_is_refused_by_key() {
    let b = || tiny("llama");
    for ty in ["longrope", "llama3", "something-new"] {
        refused(ty, &set(b(), "llama.rope.scaling.type", Val::str(ty)), &["llama.rope.scaling.type", ty]);
    }
    refused(
        "attn factor",
        &set(b(), "llama.rope.scaling.attn_factor", Val::F32(1.2)),
        &["attn_factor", "1.2"],
    );
    refused("not causal", &set(b(), "llama.attention.causal", Val::Bool(0)), &["attention.causal", "false"]);
    let g = || tiny("gemma3");
    refused("swa pattern", &set(g(), "gemma3.attention.sliding_window_pattern", Val::U32(4)), &["pattern"]);
    refused("swa base", &set(g(), "gemma3.rope.freq_base_swa", Val::F32(1e6)), &["freq_base_swa"]);
    refused("softcap", &set(g(), "gemma3.final_logit_softcapping", Val::F32(30.0)), &["softcapping"]);
    refused("27B", &set(g(), "gemma3.block_count", Val::U32(62)), &["block_count", "27B"]);
    refused("swa head", &set(g(), "gemma3.attention.key_length_swa", Val::U32(3)), &["key_length_swa"]);

    // What pinfer computes passes, and the old name of the linear factor is read.
    for (key, v) in [
        ("llama.rope.scaling.type", Val::str("linear")),
        ("llama.rope.scaling.type", Val::str("none")),
        ("llama.rope.scaling.type", Val::str("yarn")),
        ("llama.rope.scaling.attn_factor", Val::F32(1.0)),
        ("llama.attention.causal", Val::Bool(1)),
    ] {
        validate(&set(b(), key, v)).unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    // YaRN: the factor, the flag, the original context (default: the training context).
    let yarn = set(
        set(
            set(b(), "llama.rope.scaling.type", Val::str("yarn")),
            "llama.rope.scaling.factor",
            Val::F32(4.0),
        ),
        "llama.rope.scaling.original_context_length",
        Val::U32(32),
    );
    let hp = validate(&yarn).unwrap();
    assert_eq!((hp.rope_yarn, hp.rope_freq_scale, hp.n_ctx_orig), (true, 0.25, 32));
    assert!(!validate(&b()).unwrap().rope_yarn);
    let old = validate(&set(b(), "llama.rope.scale_linear", Val::F32(4.0))).unwrap();
    assert_eq!(old.rope_freq_scale, 0.25);
    let zero = validate(&set(b(), "llama.rope.scaling.factor", Val::F32(0.0))).unwrap();
    assert_eq!(zero.rope_freq_scale, 1.0);
    // Type "none" never scales, whatever the factor (as llama.cpp).
    let none = set(
        set(b(), "llama.rope.scaling.type", Val::str("none")),
        "llama.rope.scaling.factor",
        Val::F32(4.0),
    );
    assert_eq!(validate(&none).unwrap().rope_freq_scale, 1.0);
    let linear = set(
        set(b(), "llama.rope.scaling.type", Val::str("linear")),
        "llama.rope.scaling.factor",
        Val::F32(4.0),
    );
    assert_eq!(validate(&linear).unwrap().rope_freq_scale, 0.25);
    let gemma = validate(&set(g(), "gemma3.rope.freq_base_swa", Val::F32(10000.0)));
    gemma.expect("the base pinfer uses");
}

/// Gemma 4's three layers in small: a sliding layer (heads of 16) and a full one (heads of 32)
/// with caches of their own, then a sliding layer reading layer 0's cache with an FFN twice as
/// wide; per-layer token embeddings of 32 per layer.
fn gemma4() -> GgufBuilder {
    use common::ggml::F32;
    let k = |s: &str| format!("gemma4.{s}");
    let toks: Vec<String> = (0..VOCAB).map(|i| format!("t{i}")).collect();
    let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
    let u32s = |v: &[u32]| Val::Array(4, v.iter().map(|&n| Val::U32(n)).collect());
    let mut b = GgufBuilder::new()
        .kv("general.architecture", Val::str("gemma4"))
        .kv(&k("block_count"), Val::U32(3))
        .kv(&k("context_length"), Val::U32(128))
        .kv(&k("embedding_length"), Val::U32(E as u32))
        .kv(&k("feed_forward_length"), u32s(&[96, 96, 192]))
        .kv(&k("attention.head_count"), Val::U32(4))
        .kv(&k("attention.head_count_kv"), Val::U32(2))
        .kv(&k("attention.key_length"), Val::U32(32))
        .kv(&k("attention.value_length"), Val::U32(32))
        .kv(&k("attention.key_length_swa"), Val::U32(16))
        .kv(&k("attention.value_length_swa"), Val::U32(16))
        .kv(&k("rope.dimension_count_swa"), Val::U32(16))
        .kv(&k("attention.layer_norm_rms_epsilon"), Val::F32(1e-6))
        .kv(&k("attention.sliding_window"), Val::U32(8))
        .kv(
            &k("attention.sliding_window_pattern"),
            Val::Array(7, vec![Val::Bool(1), Val::Bool(0), Val::Bool(1)]),
        )
        .kv(&k("attention.shared_kv_layers"), Val::U32(1))
        .kv(&k("embedding_length_per_layer_input"), Val::U32(32))
        .kv("tokenizer.ggml.model", Val::str("gpt2"))
        .kv("tokenizer.ggml.tokens", Val::strs(&refs))
        .kv("tokenizer.ggml.token_type", Val::Array(5, vec![Val::I32(1); VOCAB]))
        .kv("tokenizer.ggml.merges", Val::strs(&["t1 t2", "t3 t4"]))
        .kv("tokenizer.ggml.bos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(2));
    let v = VOCAB as u64;
    b = b
        .tensor("token_embd.weight", &[E, v], Q8_0)
        .tensor("output_norm.weight", &[E], F32)
        .tensor("rope_freqs.weight", &[16], F32)
        .tensor("per_layer_token_embd.weight", &[96, v], Q8_0)
        .tensor("per_layer_model_proj.weight", &[E, 96], Q8_0)
        .tensor("per_layer_proj_norm.weight", &[32], F32);
    for (i, (hd, ff)) in [(16u64, 96u64), (32, 96), (16, 192)].into_iter().enumerate() {
        let t = |b: GgufBuilder, n: &str, dims: &[u64], ty| b.tensor(&format!("blk.{i}.{n}"), dims, ty);
        b = t(b, "attn_norm.weight", &[E], F32);
        b = t(b, "attn_q.weight", &[E, 4 * hd], Q8_0);
        b = t(b, "attn_q_norm.weight", &[hd], F32);
        if i < 2 {
            b = t(b, "attn_k.weight", &[E, 2 * hd], Q8_0);
            b = t(b, "attn_v.weight", &[E, 2 * hd], Q8_0);
            b = t(b, "attn_k_norm.weight", &[hd], F32);
        }
        b = t(b, "attn_output.weight", &[4 * hd, E], Q8_0);
        for norm in ["post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"] {
            b = t(b, &format!("{norm}.weight"), &[E], F32);
        }
        b = t(b, "ffn_gate.weight", &[E, ff], Q8_0);
        b = t(b, "ffn_up.weight", &[E, ff], Q8_0);
        b = t(b, "ffn_down.weight", &[ff, E], F32);
        b = t(b, "inp_gate.weight", &[E, 32], Q8_0);
        b = t(b, "proj.weight", &[32, E], Q8_0);
        b = t(b, "layer_output_scale.weight", &[1], F32);
    }
    b
}

/// Gemma 4: per-layer head sizes, FFN widths and sliding flags, which layers share whose KV
/// cache, the per-layer embeddings' tensors, and what is wrong with them refused naming the key,
/// the layer or the tensor.
#[test]
fn gemma4_layers_are_read_and_checked() {
    use pinfer::model::KvLayout;
    let hp = validate(&gemma4()).unwrap();
    assert!(hp.is_sliding(0) && !hp.is_sliding(1) && hp.is_sliding(2));
    assert_eq!((hp.head_dim_k_at(0), hp.head_dim_k_at(1), hp.n_rot_at(0), hp.n_rot_at(1)), (16, 32, 16, 32));
    assert_eq!((hp.n_ff_at(0), hp.n_ff_at(2), hp.n_ff), (96, 192, 192));
    assert_eq!((hp.n_layer_kv, hp.kv_source(2), hp.has_own_kv(2)), (2, 0, false));
    assert_eq!((hp.n_embd_per_layer, hp.final_logit_softcap, hp.attention_scale), (32, 30.0, Some(1.0)));
    // Caches for layers 0 and 1 only, each as wide as its heads.
    let kv = KvLayout::new(&hp, 64, 8, 1, Default::default()).unwrap();
    assert_eq!(kv.cached_layers().collect::<Vec<_>>(), [0, 1]);
    assert_eq!((kv.rows_of(0).row_width, kv.rows_of(1).row_width), (32, 64));
    assert_eq!(kv.k_offset(1), kv.rows_of(0).k_layer_bytes + kv.rows_of(0).v_layer_bytes);
    assert_eq!(kv.position_bytes(), 2 * (32 + 64) * 2);

    let g = |key: &str, v: Val| set(gemma4(), &format!("gemma4.{key}"), v);
    let flags = |v: &[u8]| Val::Array(7, v.iter().map(|&b| Val::Bool(b)).collect());
    let u32s = |v: &[u32]| Val::Array(4, v.iter().map(|&n| Val::U32(n)).collect());
    refused(
        "2 flags for 3 layers",
        &g("attention.sliding_window_pattern", flags(&[1, 0])),
        &["sliding_window_pattern", "block_count"],
    );
    refused(
        "no pattern",
        &remove(gemma4(), "gemma4.attention.sliding_window_pattern"),
        &["sliding_window_pattern"],
    );
    refused("sharing past the model", &g("attention.shared_kv_layers", Val::U32(2)), &["shared_kv_layers"]);
    refused(
        "a full layer's cache read by a sliding one",
        &g("attention.sliding_window_pattern", flags(&[0, 1, 1])),
        &["shared_kv_layers", "layer 2", "other attention kind"],
    );
    refused(
        "2 widths for 3 layers",
        &g("feed_forward_length", u32s(&[96, 96])),
        &["feed_forward_length", "block_count"],
    );
    refused(
        "a width of 0",
        &g("feed_forward_length", u32s(&[96, 0, 96])),
        &["feed_forward_length", "layer 1"],
    );
    refused("sliding heads of 0", &g("attention.key_length_swa", Val::U32(0)), &["key_length_swa"]);
    refused("odd sliding rotation", &g("rope.dimension_count_swa", Val::U32(7)), &["dimension_count_swa"]);
    refused("experts", &g("expert_count", Val::U32(8)), &["gemma4", "8 experts"]);
    refused(
        "layer 2's FFN",
        &retype(gemma4(), "blk.2.ffn_up.weight", &[E, 96], Q8_0),
        &["blk.2.ffn_up.weight", "[64, 192]"],
    );
    refused(
        "layer 1's heads",
        &retype(gemma4(), "blk.1.attn_q.weight", &[E, 64], Q8_0),
        &["blk.1.attn_q.weight", "[64, 128]"],
    );
    let mut no_factors = gemma4();
    no_factors.tensors.retain(|t| t.name != "rope_freqs.weight");
    refused("no rope_freqs", &no_factors, &["rope_freqs.weight", "missing"]);
    let mut no_k = gemma4();
    no_k.tensors.retain(|t| t.name != "blk.1.attn_k.weight");
    refused("no attn_k on a layer with a cache", &no_k, &["blk.1.attn_k.weight", "missing"]);
    refused(
        "per-layer table for 2 layers",
        &retype(gemma4(), "per_layer_token_embd.weight", &[64, VOCAB as u64], Q8_0),
        &["per_layer_token_embd.weight"],
    );
    let f16_scale = retype(gemma4(), "blk.0.layer_output_scale.weight", &[1], common::ggml::F16);
    refused("an f16 output scale", &f16_scale, &["blk.0.layer_output_scale.weight"]);
    // A layer without attn_v takes its values from the keys' projection; a layer that shares
    // needs no K or V at all (checked above: layer 2 has none).
    let mut no_v = gemma4();
    no_v.tensors.retain(|t| t.name != "blk.1.attn_v.weight");
    validate(&no_v).unwrap();
    // An explicit 0 turns the soft-capping off.
    assert_eq!(validate(&g("final_logit_softcapping", Val::F32(0.0))).unwrap().final_logit_softcap, 0.0);
}

/// Layer sets count by popcount: every count below a layer agrees with counting the layers one by
/// one, across the 64-layer words, and intersections keep the layers in both sets only.
#[test]
fn layer_masks_count_across_words() {
    use pinfer::model::{LayerMask, MAX_LAYERS};
    let (mut a, mut b) = (LayerMask::default(), LayerMask::default());
    for il in (0..MAX_LAYERS as usize).filter(|i| i % 3 == 0 || i % 64 == 63) {
        a.insert(il);
    }
    for il in (0..MAX_LAYERS as usize).filter(|i| i % 2 == 0) {
        b.insert(il);
    }
    for il in 0..=MAX_LAYERS as usize + 3 {
        let naive = |m: &LayerMask| (0..il).filter(|&i| m.contains(i)).count();
        assert_eq!(a.count_below(il), naive(&a), "below {il}");
        assert_eq!(a.and(&b).count_below(il), (0..il).filter(|&i| a.contains(i) && b.contains(i)).count());
        assert_eq!(
            a.and_not(&b).count_below(il),
            (0..il).filter(|&i| a.contains(i) && !b.contains(i)).count()
        );
    }
    assert_eq!(a.count(), (0..MAX_LAYERS as usize).filter(|i| i % 3 == 0 || i % 64 == 63).count());
}

/// The forward graph of each architecture, counted by op (7 tokens of one sequence, the last
/// one's logits, an f16 cache): the blocks it is composed of are the same nodes as before a
/// change of the builder, or the change says here which nodes it adds or drops. The models are
/// the tiny ones of scripts/setup.sh, llama's, gemma3's and qwen2vl's generated.
#[test]
fn forward_graphs_keep_their_nodes() {
    use pinfer::graph::Graph;
    use pinfer::model::{build_forward, KvLayout};
    let golden = [
        ("llama", "add 4, flash_attn 2, get_rows 2, kv_write 4, mul 5, mul_mat 15, none 27, rms_norm 5, rope 4, rope_table 1, swiglu 2, view 16"),
        ("qwen2", "add 15, flash_attn 3, get_rows 2, kv_write 6, mul 7, mul_mat 22, none 48, rms_norm 7, rope 6, rope_table 1, swiglu 3, view 24"),
        // (M-RoPE: a table per axis, runs of pairs viewed and joined.)
        ("qwen2vl", "add 10, concat 2, flash_attn 2, get_rows 2, kv_write 4, mul 5, mul_mat 15, none 36, rms_norm 5, rope 4, rope_table 3, swiglu 2, view 20"),
        ("qwen3", "add 6, flash_attn 3, get_rows 2, kv_write 6, mul 13, mul_mat 22, none 45, rms_norm 13, rope 6, rope_table 1, swiglu 3, view 24"),
        ("qwen3moe", "add 6, flash_attn 3, get_rows 2, kv_write 6, moe_sum 3, moe_weights 3, mul 13, mul_mat 16, mul_mat_id 9, none 48, rms_norm 13, rope 6, rope_table 1, soft_max 3, swiglu 3, top_k 3, view 27"),
        ("qwen2moe", "add 18, flash_attn 3, get_rows 2, kv_write 6, moe_sum 3, moe_weights 3, mul 10, mul_mat 28, mul_mat_id 9, none 63, rms_norm 7, rope 6, rope_table 1, sigmoid 3, soft_max 3, swiglu 6, top_k 3, view 27"),
        ("gemma3", "add 4, flash_attn 2, geglu 2, get_rows 2, kv_write 4, mul 13, mul_mat 15, none 35, rms_norm 13, rope 4, rope_table 1, scale 1, view 16"),
        ("granite", "add 6, flash_attn 3, get_rows 2, kv_write 6, mul 7, mul_mat 22, none 39, rms_norm 7, rope 6, rope_table 1, scale 8, swiglu 3, view 24"),
        ("smollm3", "add 8, flash_attn 4, get_rows 2, kv_write 8, mul 9, mul_mat 29, none 49, rms_norm 9, rope 6, rope_table 1, swiglu 4, view 32"),
        ("phi3", "add 6, flash_attn 3, get_rows 2, kv_write 6, mul 7, mul_mat 22, none 40, rms_norm 7, rope 6, rope_table 1, scale 3, swiglu 3, view 24"),
        ("lfm2", "add 8, flash_attn 1, get_rows 2, kv_write 2, mul 17, mul_mat 29, none 51, rms_norm 11, rope 2, rope_table 1, short_conv 3, swiglu 4, view 8"),
        ("lfm2moe", "add 11, flash_attn 1, get_rows 2, kv_write 2, moe_sum 3, moe_weights 3, mul 17, mul_mat 23, mul_mat_id 9, none 57, rms_norm 11, rope 2, rope_table 1, short_conv 3, sigmoid 3, swiglu 4, top_k 3, view 11"),
        ("qwen35", "add 10, flash_attn 2, gated_delta_net 2, get_rows 2, kv_write 4, mul 21, mul_mat 31, none 64, rms_norm 19, rope 4, rope_table 1, scale 4, short_conv 2, sigmoid 4, silu 4, softplus 2, swiglu 4, view 30"),
        ("gemma4", "add 19, flash_attn 6, geglu 6, gelu 6, get_rows 3, kv_write 6, mul 47, mul_mat 49, none 102, rms_norm 44, rope 9, rope_table 2, scale 12, tanh 1, view 50"),
        ("bert", "add 23, flash_attn 2, gelu 2, get_rows 3, layer_norm 5, mul 5, mul_mat 12, none 42, seq_mean 1, view 16"),
        ("nomic-bert", "add 10, flash_attn 2, get_rows 2, layer_norm 5, mul 5, mul_mat 14, none 31, rope 4, rope_table 1, seq_mean 1, swiglu 2, view 15"),
        ("jina-bert-v2", "add 20, flash_attn 2, geglu 2, get_rows 2, layer_norm 5, mul 5, mul_mat 14, none 40, seq_mean 1, view 15"),
        ("gemma-embedding", "add 6, flash_attn 3, geglu 3, get_rows 1, mul 19, mul_mat 23, none 47, rms_norm 19, rope 6, rope_table 2, scale 1, seq_mean 1, view 21"),
    ];
    let mut graph: Box<Graph> = Box::new(Graph::new());
    let mut got = String::new();
    for arch in Arch::ALL {
        let file = match arch {
            Arch::GemmaEmbedding => "gemma-embed",
            _ => arch.name(),
        };
        let path = format!("{}/models/tiny/{file}-tiny.gguf", env!("CARGO_MANIFEST_DIR"));
        let bytes = match arch {
            Arch::Llama | Arch::Gemma3 | Arch::Qwen2Vl => tiny(arch.name()).bytes(),
            _ => std::fs::read(&path).expect("run scripts/setup.sh"),
        };
        let gguf = Gguf::parse(&bytes).unwrap();
        let hp = HParams::from_gguf(&gguf).unwrap();
        let kv = KvLayout::new(&hp, 64, 8, 1, Default::default()).unwrap();
        build_forward(&mut graph, &gguf, &hp, &kv, 7, 1, &[], Default::default()).unwrap();
        let mut counts = std::collections::BTreeMap::new();
        for &id in graph.order() {
            *counts.entry(graph.tensor(id).op.name()).or_insert(0) += 1;
        }
        let line: Vec<String> = counts.iter().map(|(op, n)| format!("{op} {n}")).collect();
        got += &format!("    (\"{}\", \"{}\"),\n", arch.name(), line.join(", "));
    }
    let want: String = golden.iter().map(|(a, l)| format!("    (\"{a}\", \"{l}\"),\n")).collect();
    assert_eq!(got, want, "the forward graphs changed; if meant, the new table:\n{got}");
}
