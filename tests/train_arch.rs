//! Fine-tuning through the inference engine's blocks, beyond llama: the LoRA training graph of
//! each tiny dense model (Q/K norms, QKV biases, multipliers, layers without RoPE, fused
//! projections with LongRoPE) and Gemma 3 computes the engine's logits with `B = 0` and trains
//! its adapters; a model with a block that has no backward yet is refused by its architecture and block.

#[path = "common/lora_graph.rs"]
mod lora_graph;

use lora_graph::{at_the_start, model_bytes, ALL_TARGETS};
use pinfer::graph::Graph;
use pinfer::model::HParams;
use pinfer::train::lora::{build_lora_graph, LoraSpec};
use pinfer::train::TrainError;

/// The training graph (of `N` nodes) of `name` over `n` tokens of its vocabulary with every
/// target adapted (A random, B zero): its logits are the engine's, and only the B's have
/// gradients. (On a thread of its own: the backward pass's fixed-capacity bookkeeping is on the
/// stack.)
fn trains_as_it_generates<const N: usize>(name: &'static str, n: u32) {
    let run = std::thread::Builder::new().stack_size(512 << 20);
    run.spawn(move || {
        let bytes = model_bytes(name);
        let gguf = pinfer::gguf::Gguf::parse(&bytes).unwrap();
        let n_vocab = gguf.tensor("token_embd.weight").unwrap().ne[1] as u32;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 7919 + 13) % n_vocab).collect();
        let targets: Vec<i32> =
            (1..=tokens.len()).map(|t| tokens.get(t).map_or(-1, |&next| next as i32)).collect();
        at_the_start::<N, _>(name, &bytes, &tokens, &targets, ALL_TARGETS, |_| ());
    })
    .unwrap()
    .join()
    .unwrap();
}

#[test]
fn qwen3_with_qk_norms_trains_through_the_blocks() {
    trains_as_it_generates::<4096>("tiny/qwen3-tiny.gguf", 12);
}

#[test]
fn qwen2_granite_smollm3_and_phi3_train_through_the_blocks() {
    for name in
        ["tiny/qwen2-tiny.gguf", "tiny/granite-tiny.gguf", "tiny/smollm3-tiny.gguf", "tiny/phi3-tiny.gguf"]
    {
        trains_as_it_generates::<4096>(name, 12);
    }
}

/// Gemma 3: GeGLU, post norms, scaled embeddings, sliding-window layers with their own RoPE.
/// (Attention must round as the engine's does here: Gemma 3's activations carry a written-out
/// softmax's last-bit differences on until they flip the 8-bit rounding of a later matmul's input,
/// which the logits showed from the 4th token on.)
#[test]
fn gemma3_trains_through_the_blocks() {
    // (18 layers and their gradients take more nodes than a forward graph.)
    trains_as_it_generates::<16384>("gemma-3-270m-q4_k_m.gguf", 12);
}

#[test]
fn a_block_without_a_backward_is_refused_by_name() {
    for (name, arch, block) in [
        ("tiny/qwen3moe-tiny.gguf", "qwen3moe", "mixture of experts"),
        ("tiny/lfm2-tiny.gguf", "lfm2", "short convolution"),
        ("tiny/qwen35-tiny.gguf", "qwen35", "gated delta rule"),
        ("tiny/gemma4-tiny.gguf", "gemma4", "per-layer inputs"),
    ] {
        let bytes = model_bytes(name);
        let gguf = pinfer::gguf::Gguf::parse(&bytes).unwrap();
        let hp = HParams::from_gguf(&gguf).unwrap();
        let spec = LoraSpec { rank: 4, alpha: 8.0, targets: 1 };
        let mut g: Box<Graph> = Box::new(Graph::new());
        let err = build_lora_graph(&mut g, &gguf, &hp, 8, spec).unwrap_err();
        assert!(matches!(err, TrainError::Architecture { .. }), "{name}: {err:?}");
        let text = err.to_string();
        assert!(text.contains(arch) && text.contains(block), "{name}: {text}");
    }
}
