//! The graph engine on a real transformer block: planner, threads, steps over a KV cache.

mod engine;

use engine::{run, transformer_block, Rng, RunOpts, Setup};
use pinfer::exec::Step;

const TOKENS: [i32; 3] = [7, 3, 42];
/// A prompt of 3 tokens, then the same 3 tokens again with the first 3 in the KV cache.
const STEPS: [Step; 2] = [Step { n_past: 0, n_kv: 3 }, Step { n_past: 3, n_kv: 6 }];

fn logits(opts: RunOpts) -> (Vec<f32>, usize, usize) {
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    let (mut outs, peak) = run(&mut s, &[out], &STEPS, opts);
    let unshared = pinfer::graph::plan(&s.g).unwrap().unshared_bytes;
    (outs.remove(0), peak, unshared)
}

#[test]
fn packed_plan_uses_less_memory_and_gives_identical_results() {
    let (packed, peak, unshared) = logits(RunOpts { threads: 1, packed: true });
    let (plain, plain_peak, _) = logits(RunOpts { threads: 1, packed: false });
    assert!(peak < unshared, "packed peak {peak} should be below the sum of all activations {unshared}");
    assert_eq!(plain_peak, unshared);
    assert_eq!(packed.len(), engine::VOCAB * TOKENS.len());
    assert!(packed.iter().all(|v| v.is_finite()) && packed.iter().any(|&v| v != 0.0));
    assert_eq!(packed, plain, "packed and unshared plans must agree bit for bit");
}

#[test]
fn results_are_identical_with_1_2_and_4_threads() {
    let (one, ..) = logits(RunOpts { threads: 1, packed: true });
    for threads in [2, 4] {
        let (many, ..) = logits(RunOpts { threads, packed: true });
        assert_eq!(one, many, "{threads} threads differ from 1");
    }
}

#[test]
fn second_step_attends_to_the_cache() {
    // Running only the second step on an empty cache must differ from running both steps.
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    let (both, _) = run(&mut s, &[out], &STEPS, RunOpts { threads: 1, packed: true });
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    let (only_second, _) = run(&mut s, &[out], &STEPS[1..], RunOpts { threads: 1, packed: true });
    assert_ne!(both[0], only_second[0]);
}
