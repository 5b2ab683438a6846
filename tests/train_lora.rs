//! The LoRA training graph of a llama model (`pinfer::train::lora`): with `B = 0` its logits are
//! the inference engine's (the same function, written out for training: equal on the reference
//! kernels with an F32 cache), only `B` has a gradient then, and Adam on the adapters alone fits a
//! sequence (the loss halves) while the frozen weights stay as they are in the file.

use pinfer::engine::{EngineConfig, Entry, Model, OnCaller};
use pinfer::exec::{Address, Bound};
use pinfer::graph::{plan, Graph};
use pinfer::model::HParams;
use pinfer::train::lora::{build_lora_graph, LoraSpec, TARGETS};
use pinfer::train::optim::{Adam, Objective};
use pinfer::train::{arena_regions, backward, GraphObjective};

const TOKENS: [u32; 12] = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 1797, 1918, 553];

fn model_bytes() -> Vec<u8> {
    std::fs::read(format!("{}/models/tiny/llama-untied-q5.gguf", env!("CARGO_MANIFEST_DIR")))
        .expect("run scripts/setup.sh tiny")
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

/// The inference engine's logits for every token of TOKENS, on the reference kernels with an F32
/// cache (so its attention is the written-out one too, and both sides compute the same numbers).
fn engine_logits(bytes: &[u8]) -> Vec<Vec<f32>> {
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
        TOKENS.iter().enumerate().map(|(pos, &token)| Entry { seq: 0, pos, token, logits: true }).collect();
    engine.step(&batch, &OnCaller, None).unwrap();
    (0..TOKENS.len()).map(|i| engine.logits(i).unwrap().to_vec()).collect()
}

// On the test thread's default stack: the address table and the graph are on the heap.
#[test]
fn the_lora_graph_computes_the_model_and_adam_fits_the_adapters() {
    let bytes = model_bytes();
    let gguf = pinfer::gguf::Gguf::parse(&bytes).unwrap();
    let hp = HParams::from_gguf(&gguf).unwrap();
    let n = TOKENS.len();
    let spec = LoraSpec { rank: 4, alpha: 8.0, targets: (1 << TARGETS.len()) - 1 };
    let mut g: Box<Graph> = Box::new(Graph::new());
    let lg = build_lora_graph(&mut g, &gguf, &hp, n, spec).unwrap();
    assert_eq!(lg.adapted.len(), 7 * hp.n_layer as usize);
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
    let ids: Vec<i32> = TOKENS.iter().map(|&t| t as i32).collect();
    // Next-token targets; the first two positions are not scored (a prompt), nor the last.
    let targets: Vec<i32> =
        (0..n).map(|t| if t < 2 || t + 1 == n { -1 } else { TOKENS[t + 1] as i32 }).collect();
    bound.data_mut(lg.ids).copy_from_slice(bytemuck::cast_slice(&ids));
    bound.data_mut(lg.targets).copy_from_slice(bytemuck::cast_slice(&targets));
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
    let first = objective.evaluate(&x, &mut grad).unwrap();
    let logits = objective.bound().data_f32(lg.logits).to_vec();
    let want = engine_logits(&bytes);
    let n_vocab = want[0].len();
    for (t, row) in want.iter().enumerate() {
        let got = &logits[t * n_vocab..(t + 1) * n_vocab];
        let range = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got.iter().zip(row).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-4 * range.max(1.0), "token {t}: logits differ by {diff} (range {range})");
    }
    // With B = 0 only B's gradients can be non-zero.
    let mut at = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let norm: f32 = grad[at..at + size].iter().map(|v| v * v).sum();
        assert_eq!(i % 2 == 1, norm > 0.0, "parameter {i}: gradient norm {norm}");
        at += size;
    }

    // Adam on the adapters: the loss on this sequence falls.
    let adam = Adam { lr: 1e-2, max_iterations: 12, grad_tolerance: 0.0, ..Adam::default() };
    let mut work = vec![0.0; Adam::work_len(x.len())];
    let report = adam.minimize(&mut objective, &mut x, &mut work, &mut |_, _| {}).unwrap();
    eprintln!("loss {first} -> {} in {} Adam steps", report.loss, report.iterations);
    assert!(report.loss < 0.5 * first, "the loss went from {first} to {}", report.loss);
}
