//! Fine-tuning through the inference engine's blocks, beyond llama: the LoRA training graph of
//! each tiny dense model (Q/K norms, QKV biases, multipliers, layers without RoPE, fused
//! projections with LongRoPE) and Gemma 3 computes the engine's logits with `B = 0` and trains
//! its adapters; a model with a block that has no backward yet is refused by its architecture and block.

use pinfer::engine::{graph_slots, Engine, EngineConfig, Entry, GraphSlot, Model, OnCaller, Planned};
use pinfer::exec::{Address, Bound};
use pinfer::graph::{plan, Graph};
use pinfer::model::HParams;
use pinfer::train::lora::{build_lora_graph, LoraSpec, TARGETS};
use pinfer::train::optim::Objective;
use pinfer::train::{arena_regions, backward, GraphObjective, TrainError};

fn model_bytes(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/models/{name}", env!("CARGO_MANIFEST_DIR"))).expect("run scripts/setup.sh tiny")
}

/// `n` tokens of the model's vocabulary.
fn tokens(n_vocab: usize, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 7919 + 13) % n_vocab as u32).collect()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The inference engine's logits for every token, on the reference kernels with an F32 cache.
fn engine_logits(bytes: &[u8], tokens: &[u32]) -> Vec<Vec<f32>> {
    let config = EngineConfig {
        n_ctx: 64,
        n_batch: 16,
        n_outputs: 16,
        repack: false,
        kernels: pinfer::kernels::KernelPath::Reference,
        kv_types: pinfer::model::KvTypes { k: pinfer::quant::GgmlType::F32, v: pinfer::quant::GgmlType::F32 },
        ..EngineConfig::default()
    };
    let mut slots: Vec<GraphSlot> = (0..graph_slots(&config)).map(|_| GraphSlot::new()).collect();
    let planned = Planned::new(Model::open(bytes).unwrap(), &config, slots.as_mut_slice()).unwrap();
    let mut memory = vec![0u8; planned.layout().bytes_needed()];
    let mut engine: Engine<'_, &mut [GraphSlot], &mut [u8]> = planned.bind(memory.as_mut_slice()).unwrap();
    engine.repack(&OnCaller, &|_| {}).unwrap();
    let batch: Vec<Entry> =
        tokens.iter().enumerate().map(|(pos, &token)| Entry { seq: 0, pos, token, logits: true }).collect();
    engine.step(&batch, &OnCaller, None).unwrap();
    (0..tokens.len()).map(|i| engine.logits(i).unwrap().to_vec()).collect()
}

/// The training graph (of `N` nodes) of `name` over `n` tokens with every target adapted (A
/// random, B zero): its logits are the engine's, and only the B's have gradients. (On a thread
/// of its own: the backward pass's fixed-capacity bookkeeping is on the stack.)
fn trains_as_it_generates<const N: usize>(name: &'static str, n: u32) {
    let run = std::thread::Builder::new().stack_size(512 << 20);
    run.spawn(move || check_training_graph::<N>(name, n)).unwrap().join().unwrap();
}

fn check_training_graph<const N: usize>(name: &str, n: u32) {
    let bytes = model_bytes(name);
    let gguf = pinfer::gguf::Gguf::parse(&bytes).unwrap();
    let hp = HParams::from_gguf(&gguf).unwrap();
    let tokens = tokens(gguf.tensor("token_embd.weight").unwrap().ne[1] as usize, n);
    let n = tokens.len();
    let spec = LoraSpec { rank: 4, alpha: 8.0, targets: (1 << TARGETS.len()) - 1 };
    let mut g: Box<Graph<N>> = Box::new(Graph::new());
    let lg = build_lora_graph(&mut g, &gguf, &hp, n, spec).unwrap();
    assert!(!lg.adapted.is_empty(), "{name}: nothing adapted");
    let params: Vec<_> = lg.params().collect();
    let mut offset = lg.persistent_end;
    let grad_offsets: Vec<usize> = params
        .iter()
        .map(|&p| {
            let at = offset;
            offset += (g.tensor(p).n_elements() * 4).next_multiple_of(64);
            at
        })
        .collect();
    let mut grads = params.clone();
    backward(&mut g, lg.loss, &params, &grad_offsets, &mut grads).unwrap();
    g.build_with_roots(&[lg.loss, lg.logits], &grads).unwrap();
    let plan = plan(&g).unwrap();
    let (activations, work, total) = arena_regions(&g, &plan, offset);
    let mut memory = vec![0u64; total.div_ceil(8)];
    let arena: &mut [u8] = bytemuck::cast_slice_mut(memory.as_mut_slice());
    let mut addresses = vec![Address::NOWHERE; g.tensors().len()];
    let mut bound = Bound::new(&g, &plan, &[&bytes], arena, activations, work, &mut addresses)
        .unwrap()
        .with_kernels(pinfer::kernels::KernelPath::Reference);
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let targets: Vec<i32> = (0..n).map(|t| if t + 1 == n { -1 } else { tokens[t + 1] as i32 }).collect();
    bound.data_mut(lg.ids).copy_from_slice(bytemuck::cast_slice(&ids));
    bound.data_mut(lg.targets).copy_from_slice(bytemuck::cast_slice(&targets));
    let mut objective = GraphObjective::new(bound, lg.loss, &params, &grads).unwrap();
    let sizes: Vec<usize> = params.iter().map(|&p| g.tensor(p).n_elements()).collect();
    let mut x = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        if i % 2 == 0 {
            x.extend(values(size, i as u64 + 1).into_iter().map(|v| v * 0.1));
        } else {
            x.extend(std::iter::repeat_n(0.0, size));
        }
    }
    let mut grad = vec![0.0; x.len()];
    let loss = objective.evaluate(&x, &mut grad).unwrap();
    assert!(loss.is_finite(), "{name}: loss {loss}");
    let logits = objective.bound().data_f32(lg.logits).to_vec();
    let want = engine_logits(&bytes, &tokens);
    let n_vocab = want[0].len();
    for (t, row) in want.iter().enumerate() {
        let got = &logits[t * n_vocab..(t + 1) * n_vocab];
        let range = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got.iter().zip(row).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-4 * range.max(1.0), "{name}, token {t}: logits differ by {diff} (range {range})");
    }
    let mut at = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let norm: f32 = grad[at..at + size].iter().map(|v| v * v).sum();
        assert_eq!(i % 2 == 1, norm > 0.0, "{name}, parameter {i}: gradient norm {norm}");
        at += size;
    }
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

/// Gemma 3 (GeGLU, post norms, scaled embeddings, sliding-window layers with their own RoPE) over
/// 3 tokens: the engine's attention is ggml's online softmax (a later key with a larger score
/// rescales the sum), the written-out one takes the maximum first; the same function in other
/// roundings, which Gemma 3's activations make a visible difference of the logits from the 4th
/// token on (an f16 cache moves them more).
#[test]
fn gemma3_trains_through_the_blocks() {
    // (18 layers and their gradients take more nodes than a forward graph.)
    trains_as_it_generates::<16384>("gemma-3-270m-q4_k_m.gguf", 3);
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
