//! Several sequences in one batch: the engine's KV cache holds S sequences, one step mixes their
//! prompt chunks and single-token decodes, and each token attends only to its own sequence. The
//! greedy tokens of S = 4 sequences run together must be those of 4 separate runs, on dense, MoE
//! and untied-output models, on the worker pool.

use pinfer::engine::{
    graph_slots, Engine, EngineConfig, EngineError, Entry, GraphSlot, Model, OnCaller, Planned, Runner,
    GRAPH_SLOTS,
};
use pinfer::exec::pool::Pool;

type TestEngine<'m> = Engine<'m, Vec<GraphSlot>, Box<[u8]>>;

fn model_bytes(name: &str) -> &'static [u8] {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny").join(name);
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}: run scripts/setup.sh tiny", path.display()));
    Box::leak(bytes.into_boxed_slice())
}

fn engine(bytes: &'static [u8], n_seq: usize, n_batch: usize) -> TestEngine<'static> {
    engine_ctx(bytes, n_seq, n_batch, 96)
}

fn argmax(logits: &[f32]) -> u32 {
    logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best }) as u32
}

/// Prompts of different lengths (ids inside every tiny model's vocabulary).
fn prompts() -> [Vec<u32>; 4] {
    [
        vec![504, 3575, 282, 4649, 314],
        vec![17, 905, 33, 1200, 7, 88, 431, 2020, 61, 5, 12, 700],
        vec![3000],
        vec![42, 4242, 242, 24, 424, 2424, 1, 2, 3],
    ]
}

/// Greedy continuation of `prompt` alone in sequence 0 of a fresh engine.
fn alone(bytes: &'static [u8], prompt: &[u32], n: usize, runner: &impl Runner) -> Vec<u32> {
    let mut e = engine(bytes, 1, 8);
    let mut out = Vec::new();
    // Prompt in chunks of the batch size, as the session does.
    for (c, chunk) in prompt.chunks(8).enumerate() {
        let batch: Vec<Entry> = chunk
            .iter()
            .enumerate()
            .map(|(i, &token)| Entry { seq: 0, pos: c * 8 + i, token, logits: i + 1 == chunk.len() })
            .collect();
        e.step(&batch, runner, None).unwrap();
    }
    for _ in 0..n {
        let token = argmax(e.logits(0).unwrap());
        out.push(token);
        let pos = e.seq_len(0);
        e.step(&[Entry { seq: 0, pos, token, logits: true }], runner, None).unwrap();
    }
    out
}

/// The four prompts in one engine: sequences 0-2 start together (their prompts in shared
/// batches of 8), sequence 3 joins two steps later, its prompt in the same batches as the
/// others' single-token decodes.
fn together(bytes: &'static [u8], n: usize, runner: &impl Runner) -> [Vec<u32>; 4] {
    let prompts = prompts();
    let mut e = engine(bytes, 4, 8);
    let mut out: [Vec<u32>; 4] = Default::default();
    // Per sequence: tokens still to feed (the prompt, then each generated token).
    let mut pending: [Vec<u32>; 4] = Default::default();
    let mut started = [false; 4];
    let mut round = 0;
    while out.iter().any(|o| o.len() < n) {
        for s in 0..4 {
            if !started[s] && (s < 3 || round >= 2) {
                started[s] = true;
                pending[s] = prompts[s].clone();
            }
        }
        // Fill one batch of up to 8 entries, sequences in turn; a sequence's logits are wanted
        // when its last pending token goes in.
        let mut batch = Vec::new();
        let mut taken = [0usize; 4];
        'fill: loop {
            let mut any = false;
            for s in 0..4 {
                if taken[s] < pending[s].len() {
                    if batch.len() == 8 {
                        break 'fill;
                    }
                    let pos = e.seq_len(s) + taken[s];
                    let last = taken[s] + 1 == pending[s].len();
                    batch.push(Entry { seq: s, pos, token: pending[s][taken[s]], logits: last });
                    taken[s] += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        round += 1;
        if batch.is_empty() {
            continue;
        }
        e.step(&batch, runner, None).unwrap();
        let mut row = 0;
        for entry in &batch {
            if entry.logits {
                let token = argmax(e.logits(row).unwrap());
                row += 1;
                let s = entry.seq;
                if out[s].len() < n {
                    out[s].push(token);
                    pending[s] = vec![token];
                } else {
                    pending[s].clear();
                }
                taken[s] = 0;
            }
        }
        for s in 0..4 {
            pending[s].drain(..taken[s]);
        }
    }
    out
}

fn check_model(name: &str) {
    check_model_steps(name, if cfg!(target_arch = "aarch64") { 4 } else { 10 });
}

/// As [`check_model`] for `n` generated tokens per sequence. (A batch's matmuls and attention
/// may round differently from a single token's, ~1e-6 on the logits: greedy runs agree up to
/// the first near-tie.)
fn check_model_steps(name: &str, n: usize) {
    let bytes = model_bytes(name);
    let pool = Pool::new(2, None, false).unwrap();
    let batched = together(bytes, n, &pool);
    for (s, prompt) in prompts().iter().enumerate() {
        let separate = alone(bytes, prompt, n, &OnCaller);
        assert_eq!(batched[s], separate, "{name}: sequence {s} batched differs from its separate run");
    }
}

#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_qwen3() {
    check_model("qwen3-tiny.gguf");
}

#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_moe() {
    check_model("qwen3moe-tiny.gguf");
}

#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_untied_q5() {
    check_model("llama-untied-q5.gguf");
}

/// LFM2: each sequence's short-convolution states move on only with its own tokens, whatever
/// else shares the batch.
#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_lfm2() {
    check_model("lfm2-tiny.gguf");
    check_model("lfm2moe-tiny.gguf");
}

/// Qwen3.5: each sequence's convolution and delta-rule states move on only with its own tokens.
#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_qwen35() {
    check_model("qwen35-tiny.gguf");
}

/// Gemma 4: KV-sharing layers read each sequence's rows of their source layers' caches (of two
/// widths), sliding windows and per-layer inputs per token, whatever else shares the batch.
#[test]
fn four_sequences_in_one_batch_match_four_separate_runs_gemma4() {
    // (The first sequence's ninth token is a near-tie in this model.)
    check_model_steps("gemma4-tiny.gguf", if cfg!(target_arch = "aarch64") { 4 } else { 8 });
}

/// A model with recurrent layers keeps a sequence whole or not at all: a cut empties it, a copy or
/// a save takes it whole, and what is restored or started over continues like a fresh run.
#[test]
fn a_recurrent_sequence_is_kept_whole_or_started_over() {
    let bytes = model_bytes("lfm2-tiny.gguf");
    let prompt = &prompts()[1];
    let mut e = engine(bytes, 3, 16);
    assert!(e.has_recurrent_layers());
    e.step(&batch_of(prompt), &OnCaller, None).unwrap();
    let next = alone(bytes, prompt, 2, &OnCaller);
    assert_eq!(argmax(e.logits(0).unwrap()), next[0]);

    // Part of it cannot be copied or saved; the whole can.
    assert!(matches!(e.copy_prefix(0, 1, 7), Err(EngineError::Config(_))));
    assert!(e.read_sequence(0, 7, &mut |_| {}).is_err());
    e.copy_prefix(0, 1, prompt.len()).unwrap();
    let mut saved = Vec::new();
    e.read_sequence(0, prompt.len(), &mut |b| saved.extend_from_slice(b)).unwrap();
    assert_eq!(saved.len(), e.sequence_bytes(prompt.len()));
    e.write_sequence(2, prompt.len(), &saved).unwrap();
    for seq in [0, 1, 2] {
        let pos = e.seq_len(seq);
        e.step(&[Entry { seq, pos, token: next[0], logits: true }], &OnCaller, None).unwrap();
        assert_eq!(argmax(e.logits(0).unwrap()), next[1], "sequence {seq}");
    }

    // The context shift moves the attention layers' keys; the states keep what they hold, and
    // the sequence goes on from its shortened length.
    let before = e.seq_len(2);
    e.shift_sequence(2, 2, 4).unwrap();
    assert_eq!(e.seq_len(2), before - 4);
    let pos = e.seq_len(2);
    e.step(&[Entry { seq: 2, pos, token: next[1], logits: true }], &OnCaller, None).unwrap();
    assert!(e.logits(0).unwrap().iter().all(|v| v.is_finite()));

    // A cut empties the sequence; evaluated again from 0 it is a fresh run (the states restart).
    assert_eq!(e.truncate(0, 5), 0);
    assert_eq!(e.truncate(1, 100), prompt.len() + 1, "a longer limit keeps everything");
    e.step(&batch_of(prompt), &OnCaller, None).unwrap();
    assert_eq!(argmax(e.logits(0).unwrap()), next[0]);
}

#[test]
fn a_copied_prefix_continues_like_a_fresh_run() {
    let bytes = model_bytes("qwen2-tiny.gguf");
    let prompt = &prompts()[1];
    let mut e = engine(bytes, 2, 16);
    let batch: Vec<Entry> = prompt
        .iter()
        .enumerate()
        .map(|(pos, &token)| Entry { seq: 0, pos, token, logits: pos + 1 == prompt.len() })
        .collect();
    e.step(&batch, &OnCaller, None).unwrap();
    // Sequence 1 shares the first 7 prompt tokens, then goes its own way.
    e.copy_prefix(0, 1, 7).unwrap();
    assert_eq!((e.seq_len(0), e.seq_len(1)), (12, 7));
    let tail = [9u32, 99, 999];
    let batch: Vec<Entry> = tail
        .iter()
        .enumerate()
        .map(|(i, &token)| Entry { seq: 1, pos: 7 + i, token, logits: i == 2 })
        .collect();
    e.step(&batch, &OnCaller, None).unwrap();
    let got = argmax(e.logits(0).unwrap());
    let mut fresh: Vec<u32> = prompt[..7].to_vec();
    fresh.extend(tail);
    assert_eq!(got, alone(bytes, &fresh, 1, &OnCaller)[0]);
    // Sequence 0 was not disturbed: its next token is the one a fresh run gives.
    let pos = e.seq_len(0);
    let first = alone(bytes, prompt, 2, &OnCaller);
    let logits0 = {
        let mut e2 = engine(bytes, 1, 16);
        e2.step(&batch_of(prompt), &OnCaller, None).unwrap();
        argmax(e2.logits(0).unwrap())
    };
    assert_eq!(logits0, first[0]);
    e.step(&[Entry { seq: 0, pos, token: first[0], logits: true }], &OnCaller, None).unwrap();
    assert_eq!(argmax(e.logits(0).unwrap()), first[1]);
}

fn batch_of(prompt: &[u32]) -> Vec<Entry> {
    prompt
        .iter()
        .enumerate()
        .map(|(pos, &token)| Entry { seq: 0, pos, token, logits: pos + 1 == prompt.len() })
        .collect()
}

#[test]
fn bad_batches_are_refused_with_what_is_wrong() {
    let bytes = model_bytes("qwen3-tiny.gguf");
    let mut e = engine(bytes, 2, 8);
    let entry = |seq, pos, token| Entry { seq, pos, token, logits: true };
    let err = e.step(&[entry(2, 0, 1)], &OnCaller, None).unwrap_err();
    assert_eq!(err, EngineError::BadSequence { seq: 2, n_seq: 2 });
    let err = e.step(&[entry(0, 1, 1)], &OnCaller, None).unwrap_err();
    assert_eq!(err, EngineError::BadPosition { seq: 0, pos: 1, expected: 0 });
    let err = e.step(&[entry(0, 0, u32::MAX)], &OnCaller, None).unwrap_err();
    assert!(matches!(err, EngineError::BadToken { id: u32::MAX, .. }), "{err:?}");
    let err = e.step(&[], &OnCaller, None).unwrap_err();
    assert!(matches!(err, EngineError::BatchSize { entries: 0, .. }), "{err:?}");
    let three = [entry(0, 0, 1), entry(0, 1, 2), entry(1, 0, 3)];
    let err = e.step(&three, &OnCaller, None).unwrap_err();
    assert_eq!(err, EngineError::BatchSize { entries: 3, outputs: 3 }, "more outputs than n_outputs (2)");
    // A refused step changes nothing; a sequence fills up alone.
    assert_eq!((e.seq_len(0), e.seq_len(1)), (0, 0));
    let n_ctx = e.kv_layout().n_ctx;
    for pos in 0..n_ctx {
        e.step(&[Entry { seq: 1, pos, token: 5, logits: false }], &OnCaller, None).unwrap();
    }
    let err = e.step(&[entry(1, n_ctx, 1)], &OnCaller, None).unwrap_err();
    assert_eq!(err, EngineError::ContextFull { needed: n_ctx + 1, n_ctx });
    e.step(&[entry(0, 0, 1)], &OnCaller, None).unwrap();
    assert!(e.logits(0).is_some() && e.logits(1).is_none());
    assert_eq!(e.truncate(1, 3), 3);
    assert_eq!(e.seq_len(1), 3);
    too_few_graph_slots_are_refused(bytes);
}

/// Too few graph slots for the configuration: refused at planning, with the function to ask.
/// (A function of its own: a release build inlines the engines above into one frame, and a
/// second plan in it overflowed the test thread's 2 MiB stack.)
#[inline(never)]
fn too_few_graph_slots_are_refused(bytes: &'static [u8]) {
    let config = EngineConfig { n_ctx: 64, n_batch: 8, ..EngineConfig::default() };
    let slots: Vec<GraphSlot> = (0..graph_slots(&config) - 1).map(|_| GraphSlot::new()).collect();
    let err = Planned::new(Model::open(bytes).unwrap(), &config, slots).err().unwrap();
    assert!(err.to_string().contains("graph_slots"), "{err}");
}

#[test]
fn another_sequence_in_the_batch_changes_nothing() {
    let bytes = model_bytes("qwen2-tiny.gguf");
    let p0 = &prompts()[0];
    let mut e1 = engine(bytes, 1, 16);
    e1.step(&batch_of(p0), &OnCaller, None).unwrap();
    let b = argmax(e1.logits(0).unwrap());
    // Sequence 0's prompt with a token of sequence 1 after it, before it, wanting logits or not.
    let mut e = engine(bytes, 2, 16);
    let mut batch = batch_of(p0);
    batch.push(Entry { seq: 1, pos: 0, token: 5, logits: false });
    e.step(&batch, &OnCaller, None).unwrap();
    let a1 = argmax(e.logits(0).unwrap());
    let mut e = engine(bytes, 2, 16);
    let mut batch = vec![Entry { seq: 1, pos: 0, token: 5, logits: false }];
    batch.extend(batch_of(p0));
    e.step(&batch, &OnCaller, None).unwrap();
    let a2 = argmax(e.logits(0).unwrap());
    let mut e = engine(bytes, 2, 16);
    let mut batch = batch_of(p0);
    batch.push(Entry { seq: 1, pos: 0, token: 5, logits: true });
    e.step(&batch, &OnCaller, None).unwrap();
    let a3 = argmax(e.logits(0).unwrap());
    assert_eq!((a1, a2, a3), (b, b, b));
}

#[test]
fn the_batch_size_changes_nothing() {
    let bytes = model_bytes("qwen2-tiny.gguf");
    let p = &prompts()[1];
    let mut e1 = engine(bytes, 1, 16);
    e1.step(&batch_of(p), &OnCaller, None).unwrap();
    let b = argmax(e1.logits(0).unwrap());
    let a = alone(bytes, p, 1, &OnCaller)[0];
    let mut e2 = engine(bytes, 1, 8);
    e2.step(&batch_of(&p[..8]), &OnCaller, None).unwrap();
    let c1 = argmax(e2.logits(0).unwrap());
    let mut e3 = engine(bytes, 1, 16);
    e3.step(&batch_of(&p[..8]), &OnCaller, None).unwrap();
    let c2 = argmax(e3.logits(0).unwrap());
    assert_eq!(c1, c2, "n_batch 8 vs 16 same tokens");
    assert_eq!(a, b);
}

fn engine_ctx(bytes: &'static [u8], n_seq: usize, n_batch: usize, n_ctx: usize) -> TestEngine<'static> {
    let config = EngineConfig { n_ctx, n_batch, n_seq, n_outputs: n_seq, ..EngineConfig::default() };
    let slots: Vec<GraphSlot> = (0..GRAPH_SLOTS).map(|_| GraphSlot::new()).collect();
    let planned = Planned::new(Model::open(bytes).unwrap(), &config, slots).unwrap();
    let memory = vec![0u8; planned.layout().bytes_needed()].into_boxed_slice();
    let mut engine = planned.bind(memory).unwrap();
    engine.repack(&OnCaller, &|_| {}).unwrap();
    engine
}

/// A batch of 64 tokens or more takes the f32 attention tiles (as llama.cpp's), each row with its
/// own keys: a second sequence's prompt in the same batch (its rows in the same tiles, before
/// and after the first's) and two worker threads instead of one change none of the first
/// sequence's bits. (`graph_ops` checks the tiles' attention against f64.)
#[test]
fn a_long_prompt_in_tiles_ignores_other_sequences_and_threads() {
    let bytes = model_bytes("qwen2-tiny.gguf");
    let p: Vec<u32> = (0..100).map(|i| (i * 7919 + 13) % 4000 + 5).collect();
    let other: Vec<u32> = (0..70).map(|i| (i * 104_729 + 3) % 4000 + 5).collect();
    let mut e1 = engine_ctx(bytes, 1, 128, 256);
    e1.step(&batch_of(&p), &OnCaller, None).unwrap();
    let alone = e1.logits(0).unwrap().to_vec();
    let other_seq = |range: std::ops::Range<usize>| -> Vec<Entry> {
        range.map(|pos| Entry { seq: 1, pos, token: other[pos], logits: false }).collect()
    };
    let pool = Pool::new(2, None, false).unwrap();
    let mut e2 = engine_ctx(bytes, 2, 256, 256);
    let mut batch = other_seq(0..30);
    batch.extend(batch_of(&p));
    batch.extend(other_seq(30..70));
    e2.step(&batch, &pool, None).unwrap();
    let mixed = e2.logits(0).unwrap();
    for (i, (a, b)) in mixed.iter().zip(&alone).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "logit {i}: {a} beside another sequence, {b} alone");
    }
}

/// Only a run of 64 tokens or more of one sequence takes the tiles: a sequence's next token in a
/// batch with another sequence's long prompt (a server slot generating while another reads its
/// prompt) is computed with the kernel it takes alone, to the bit, with the prompt before it or
/// after it in the batch.
#[test]
fn a_next_token_beside_another_sequences_long_prompt_is_computed_as_alone() {
    let bytes = model_bytes("qwen2-tiny.gguf");
    let p = &prompts()[1];
    let next = 77u32;
    let long: Vec<u32> = (0..100).map(|i| (i * 104_729 + 3) % 4000 + 5).collect();
    let mut e1 = engine_ctx(bytes, 1, 128, 256);
    e1.step(&batch_of(p), &OnCaller, None).unwrap();
    e1.step(&[Entry { seq: 0, pos: p.len(), token: next, logits: true }], &OnCaller, None).unwrap();
    let alone = e1.logits(0).unwrap().to_vec();
    for prompt_first in [false, true] {
        let mut e2 = engine_ctx(bytes, 2, 128, 256);
        e2.step(&batch_of(p), &OnCaller, None).unwrap();
        let mut batch: Vec<Entry> = long
            .iter()
            .enumerate()
            .map(|(pos, &token)| Entry { seq: 1, pos, token, logits: false })
            .collect();
        let token = Entry { seq: 0, pos: p.len(), token: next, logits: true };
        if prompt_first {
            batch.push(token);
        } else {
            batch.insert(0, token);
        }
        e2.step(&batch, &OnCaller, None).unwrap();
        let mixed = e2.logits(0).unwrap();
        for (i, (a, b)) in mixed.iter().zip(&alone).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "logit {i}: {a} beside a long prompt, {b} alone");
        }
    }
}

/// Gemma 4's context shift re-rotates each layer's cached keys with that layer's RoPE (a full
/// layer: its head size, base and frequency factors, some pairs left unrotated). The first layer
/// (full attention) sees only the token, so after dropping positions its keys and values must be
/// those of a fresh run over the tokens left, to the cache's f16 rounding.
#[test]
fn a_gemma4_context_shift_rotates_keys_as_a_fresh_run_would() {
    let bytes = model_bytes("gemma4-tiny.gguf");
    let tokens = &prompts()[1];
    let (keep, discard) = (2, 5);
    let mut e = engine(bytes, 1, 16);
    e.step(&batch_of(tokens), &OnCaller, None).unwrap();
    e.shift_sequence(0, keep, discard).unwrap();
    let left: Vec<u32> = tokens[..keep].iter().chain(&tokens[keep + discard..]).copied().collect();
    assert_eq!(e.seq_len(0), left.len());
    let mut fresh = engine(bytes, 1, 16);
    fresh.step(&batch_of(&left), &OnCaller, None).unwrap();
    let first_layer = |e: &TestEngine<'_>| {
        let mut chunks: Vec<Vec<f32>> = Vec::new();
        e.read_sequence(0, left.len(), &mut |b| {
            let halves: &[half::f16] = bytemuck::cast_slice(b);
            chunks.push(halves.iter().map(|h| h.to_f32()).collect());
        })
        .unwrap();
        chunks.truncate(2); // layer 0's K, then its V
        chunks
    };
    let (shifted, want) = (first_layer(&e), first_layer(&fresh));
    for (what, (a, b)) in ["keys", "values"].iter().zip(shifted.iter().zip(&want)) {
        assert_eq!(a.len(), b.len());
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= 4e-3, "layer 0 {what} after the shift differ from a fresh run's by {worst}");
    }
    // The sequence goes on from its shortened length.
    let pos = e.seq_len(0);
    e.step(&[Entry { seq: 0, pos, token: 7, logits: true }], &OnCaller, None).unwrap();
    assert!(e.logits(0).unwrap().iter().all(|v| v.is_finite()));
}

/// Every step size up to the batch runs in the memory planned for it: a step of a few tokens over
/// a long cache splits its keys, and that work grows with its tokens beyond a decode step's and
/// the full batch's (a batch of 9 once refused prompts of 2 to 7 tokens: "this batch shape does
/// not fit the planned memory").
#[test]
fn every_step_size_fits_the_planned_memory() {
    for (name, n_batch) in [("gemma4-tiny.gguf", 9), ("qwen2-tiny.gguf", 9), ("qwen2-tiny.gguf", 3)] {
        // (4 sequences of 256: the steps see 1024 cache rows, enough to split.)
        let mut e = engine_ctx(model_bytes(name), 4, n_batch, 256);
        for n in 1..=n_batch {
            assert_eq!(e.truncate(0, 0), 0);
            let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + 7 * i).collect();
            e.step(&batch_of(&tokens), &OnCaller, None)
                .unwrap_or_else(|err| panic!("{name}, batch {n_batch}: a step of {n} tokens: {err}"));
        }
    }
}
