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
    let (packed, peak, unshared) = logits(RunOpts { threads: 1, packed: true, ..Default::default() });
    let (plain, plain_peak, _) = logits(RunOpts { threads: 1, packed: false, ..Default::default() });
    assert!(peak < unshared, "packed peak {peak} should be below the sum of all activations {unshared}");
    assert_eq!(plain_peak, unshared);
    assert_eq!(packed.len(), engine::VOCAB * TOKENS.len());
    assert!(packed.iter().all(|v| v.is_finite()) && packed.iter().any(|&v| v != 0.0));
    assert_eq!(packed, plain, "packed and unshared plans must agree bit for bit");
}

#[test]
fn results_are_identical_with_1_2_and_4_threads() {
    let (one, ..) = logits(RunOpts { threads: 1, packed: true, ..Default::default() });
    for threads in [2, 4] {
        let (many, ..) = logits(RunOpts { threads, packed: true, ..Default::default() });
        assert_eq!(one, many, "{threads} threads differ from 1");
    }
}

#[test]
fn second_step_attends_to_the_cache() {
    // Running only the second step on an empty cache must differ from running both steps.
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    let (both, _) = run(&mut s, &[out], &STEPS, RunOpts { threads: 1, packed: true, ..Default::default() });
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    let (only_second, _) =
        run(&mut s, &[out], &STEPS[1..], RunOpts { threads: 1, packed: true, ..Default::default() });
    assert_ne!(both[0], only_second[0]);
}

/// The same block computed with plain loops on dequantized weights (K/V rounded to F16 like
/// the cache), step by step.
fn naive_logits(s: &Setup, tokens: &[i32], steps: &[Step]) -> Vec<f32> {
    use engine::{CTX, E, FF, HEADS, HEAD_DIM, KV_HEADS, VOCAB};
    let w = |name| engine::leaf_values(s, name);
    let (embd, attn_norm, ffn_norm) = (w("token_embd"), w("attn_norm"), w("ffn_norm"));
    let (wq, wk, wv, wo, wg, wu, wd) = (w("wq"), w("wk"), w("wv"), w("wo"), w("wg"), w("wu"), w("wd"));
    // y[m] = sum_k W[m][k] x[k] for W stored as rows of len x.len().
    let matvec = |wt: &[f32], x: &[f32]| -> Vec<f32> {
        wt.chunks(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
    };
    let rms = |x: &[f32], g: &[f32]| -> Vec<f32> {
        let s = 1.0 / ((x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32) + 1e-5).sqrt();
        x.iter().zip(g).map(|(v, g)| v * s * g).collect()
    };
    let rope = |x: &mut [f32], pos: usize| {
        for head in x.chunks_mut(HEAD_DIM) {
            for i in 0..HEAD_DIM / 2 {
                let theta = pos as f64 * 10000f64.powf(-2.0 * i as f64 / HEAD_DIM as f64);
                let (c, s) = (theta.cos() as f32, theta.sin() as f32);
                let (a, b) = (head[i], head[i + HEAD_DIM / 2]);
                head[i] = a * c - b * s;
                head[i + HEAD_DIM / 2] = a * s + b * c;
            }
        }
    };
    let f16 = |v: Vec<f32>| v.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>();
    let mut k_cache = vec![vec![0.0f32; KV_HEADS * HEAD_DIM]; CTX];
    let mut v_cache = k_cache.clone();
    let mut logits = Vec::new();
    for step in steps {
        let xs: Vec<Vec<f32>> = tokens.iter().map(|&id| embd[id as usize * E..][..E].to_vec()).collect();
        let mut qs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let h = rms(x, &attn_norm);
            let (mut q, mut k) = (matvec(&wq, &h), matvec(&wk, &h));
            rope(&mut q, step.n_past + t);
            rope(&mut k, step.n_past + t);
            k_cache[step.n_past + t] = f16(k);
            v_cache[step.n_past + t] = f16(matvec(&wv, &h));
            qs.push(q);
        }
        logits.clear();
        for (t, x) in xs.iter().enumerate() {
            let pos = step.n_past + t;
            let mut attn = vec![0.0f32; HEADS * HEAD_DIM];
            for h in 0..HEADS {
                let kvh = h / (HEADS / KV_HEADS);
                let q = &qs[t][h * HEAD_DIM..][..HEAD_DIM];
                let scores: Vec<f32> = (0..=pos)
                    .map(|j| {
                        q.iter().zip(&k_cache[j][kvh * HEAD_DIM..]).map(|(a, b)| a * b).sum::<f32>()
                            / (HEAD_DIM as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f32 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for d in 0..HEAD_DIM {
                        attn[h * HEAD_DIM + d] += p / sum * v_cache[j][kvh * HEAD_DIM + d];
                    }
                }
            }
            let x2: Vec<f32> = x.iter().zip(matvec(&wo, &attn)).map(|(a, b)| a + b).collect();
            let h2 = rms(&x2, &ffn_norm);
            let (gate, up) = (matvec(&wg, &h2), matvec(&wu, &h2));
            let ff: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            assert_eq!(ff.len(), FF);
            let out: Vec<f32> = x2.iter().zip(matvec(&wd, &ff)).map(|(a, b)| a + b).collect();
            let out = rms(&out, &vec![1.0; E]);
            logits.extend(matvec(&embd, &out));
        }
        assert_eq!(logits.len(), VOCAB * tokens.len());
    }
    logits
}

/// Engine logits and naive logits (after all steps and after the first step only).
fn engine_and_naive(all_f32: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut s = Setup::default();
    let out = engine::transformer_block_typed(&mut s, &mut Rng(1), &TOKENS, all_f32);
    let (mut got, _) =
        run(&mut s, &[out], &STEPS, RunOpts { threads: 2, packed: true, ..Default::default() });
    (got.remove(0), naive_logits(&s, &TOKENS, &STEPS), naive_logits(&s, &TOKENS, &STEPS[..1]))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn f32_block_matches_a_naive_implementation() {
    let (got, want, first_only) = engine_and_naive(true);
    // Only f32 summation order and libm vs std transcendental functions differ.
    let tol = 2e-3;
    engine::assert_close("logits", &got, &want, tol);
    // The comparison can fail: logits from the first step alone are far outside the tolerance.
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max_diff(&got, &first_only) > 10.0 * tol * scale);
}

#[test]
fn quantized_block_stays_close_to_naive_f32() {
    let (got, want, first_only) = engine_and_naive(false);
    // Like llama.cpp, matmul inputs are quantized to Q8_0/Q8_1/Q8_K (F16 for F16 weights); that
    // rounding, compounded over eight matmuls and a softmax, stays within 3% of the largest logit.
    let tol = 3e-2;
    engine::assert_close("logits", &got, &want, tol);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max_diff(&got, &first_only) > 3.0 * tol * scale);
}

#[test]
fn more_threads_than_cores_finishes_with_the_same_result() {
    // Six threads pinned to one core: spinning waiters must yield (sleep) for the others to run.
    let core = pinfer::board::thread::allowed_cores().first().copied().unwrap_or(0);
    let (reference, ..) = logits(RunOpts { threads: 1, packed: true, ..Default::default() });
    let (crowded, ..) = logits(RunOpts { threads: 6, packed: true, pin_to: Some(core), repack: false });
    assert_eq!(crowded, reference);
}
