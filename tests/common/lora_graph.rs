//! A model's LoRA training graph set up as fine-tuning runs it, checked against the inference
//! engine: built through the engine's blocks with every target adapted, its backward pass, planned
//! and bound on the reference kernels, the token ids and targets written; at the usual start (A
//! random, B zero) its logits are the engine's (reference kernels, F32 cache) and only the B's
//! have gradients. Used by `train_lora.rs` and `train_arch.rs` (`#[path]`).
#![allow(dead_code)]

use pinfer::engine::{EngineConfig, Entry, Model, OnCaller};
use pinfer::exec::{Address, Bound};
use pinfer::graph::{plan, Graph};
use pinfer::model::HParams;
use pinfer::train::lora::{build_lora_graph, LoraGraph, LoraSpec, TARGETS};
use pinfer::train::optim::Objective;
use pinfer::train::{arena_regions, backward, GraphObjective};

/// The bytes of `models/{name}`.
pub fn model_bytes(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/models/{name}", env!("CARGO_MANIFEST_DIR"))).expect("run scripts/setup.sh tiny")
}

/// Deterministic values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every target in every layer, rank 4, alpha 8.
pub const ALL_TARGETS: LoraSpec = LoraSpec { rank: 4, alpha: 8.0, targets: (1 << TARGETS.len()) - 1 };

/// The inference engine's logits for every token of `tokens` (one sequence from position 0), on
/// the reference kernels with an F32 cache.
pub fn engine_logits(bytes: &[u8], tokens: &[u32]) -> Vec<Vec<f32>> {
    let config = EngineConfig {
        n_ctx: 64,
        n_batch: 16,
        n_outputs: 16,
        repack: false,
        kernels: pinfer::kernels::KernelPath::Reference,
        kv_types: pinfer::model::KvTypes { k: pinfer::quant::GgmlType::F32, v: pinfer::quant::GgmlType::F32 },
        ..EngineConfig::default()
    };
    // The graph slots on the heap (about a megabyte each), as every std front end plans.
    let planned = pinfer::engine::heap::plan(Model::open(bytes).unwrap(), &config).unwrap();
    let mut memory = vec![0u8; planned.layout().bytes_needed()];
    let mut engine = planned.bind(memory.as_mut_slice()).unwrap();
    engine.repack(&OnCaller, &|_| {}).unwrap();
    let batch: Vec<Entry> =
        tokens.iter().enumerate().map(|(pos, &token)| Entry { seq: 0, pos, token, logits: true }).collect();
    engine.step(&batch, &OnCaller, None).unwrap();
    (0..tokens.len()).map(|i| engine.logits(i).unwrap().to_vec()).collect()
}

/// The training graph at its start, evaluated once and checked.
pub struct Start<'o, 'a, const N: usize> {
    /// The bound loss graph, as the optimizer takes it.
    pub objective: &'o mut GraphObjective<'a, N>,
    /// The graph's parameters and inputs.
    pub lora: &'o LoraGraph,
    /// The parameters (each adapted weight's A, then B, flattened): A random, B zero.
    pub x: Vec<f32>,
    /// The loss at `x`.
    pub loss: f32,
}

/// The LoRA training graph (of `N` nodes) of model `name` (its file's `bytes`) over `tokens`
/// with next-token `targets` (negative: not scored) and adapters `spec`, evaluated at the start:
/// the logits must be the engine's within 1e-4 of their range, and only the B's have gradients.
/// Then `then` gets the start (to train from it).
pub fn at_the_start<const N: usize, R>(
    name: &str,
    bytes: &[u8],
    tokens: &[u32],
    targets: &[i32],
    spec: LoraSpec,
    then: impl FnOnce(Start<'_, '_, N>) -> R,
) -> R {
    let gguf = pinfer::gguf::Gguf::parse(bytes).unwrap();
    let hp = HParams::from_gguf(&gguf).unwrap();
    let n = tokens.len();
    let mut g: Box<Graph<N>> = Box::new(Graph::new());
    let lg = build_lora_graph(&mut g, &gguf, &hp, n, spec).unwrap();
    assert!(!lg.adapted.is_empty(), "{name}: nothing adapted");
    // The gradients after the persistent inputs and parameters, one buffer each.
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
    let mut bound = Bound::new(&g, &plan, &[bytes], arena, activations, work, &mut addresses)
        .unwrap()
        .with_kernels(pinfer::kernels::KernelPath::Reference);
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    bound.data_mut(lg.ids).copy_from_slice(bytemuck::cast_slice(&ids));
    bound.data_mut(lg.targets).copy_from_slice(bytemuck::cast_slice(targets));
    let mut objective = GraphObjective::new(bound, lg.loss, &params, &grads).unwrap();

    // The usual start: A random, B zero; the adapted model is the model.
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
    let want = engine_logits(bytes, tokens);
    let n_vocab = want[0].len();
    for (t, row) in want.iter().enumerate() {
        let got = &logits[t * n_vocab..(t + 1) * n_vocab];
        let range = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got.iter().zip(row).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-4 * range.max(1.0), "{name}, token {t}: logits differ by {diff} (range {range})");
    }
    // With B = 0 only B's gradients can be non-zero.
    let mut at = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let norm: f32 = grad[at..at + size].iter().map(|v| v * v).sum();
        assert_eq!(i % 2 == 1, norm > 0.0, "{name}, parameter {i}: gradient norm {norm}");
        at += size;
    }
    then(Start { objective: &mut objective, lora: &lg, x, loss })
}
