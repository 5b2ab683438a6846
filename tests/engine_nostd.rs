//! The engine as bare metal uses it: the library built WITHOUT its `std` feature (the host tier
//! runs `cargo test --no-default-features --test engine_nostd`), the model as bytes, the memory
//! and graph slots handed over by the caller, everything on the calling thread. Greedy tokens of
//! the tiny Qwen3 model match llama.cpp's golden ids (up to the first step where its margin is
//! small enough for llama.cpp's own configurations to disagree).
//!
//! Only this test's harness uses std (to read the files); pinfer itself is `#![no_std]` here.

use pinfer::engine::{graph_slots, Engine, EngineConfig, Entry, GraphSlot, Model, OnCaller, Planned};

/// Below this margin llama.cpp's own CPU configurations may pick the other token (its measured
/// spread on these models is at most 0.29; see tests/golden.rs).
const TRUSTED_MARGIN: f64 = 0.3;

/// The numbers of JSON array `key` in `line` (the golden files hold flat arrays of numbers).
fn numbers(line: &str, key: &str) -> Vec<f64> {
    let at = line.find(&format!("\"{key}\": [")).unwrap_or_else(|| panic!("{key} missing")) + key.len() + 5;
    let end = at + line[at..].find(']').unwrap();
    line[at..end].split(',').map(|v| v.trim().parse().unwrap()).collect()
}

fn argmax(logits: &[f32]) -> u32 {
    logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best }) as u32
}

#[test]
fn tiny_qwen3_runs_on_the_no_std_engine_and_matches_llama_cpp() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(root.join("models/tiny/qwen3-tiny.gguf")).expect("run scripts/setup.sh tiny");
    let golden = std::fs::read_to_string(root.join("tests/golden/qwen3-tiny.greedy.jsonl")).unwrap();

    let config = EngineConfig { n_ctx: 128, n_batch: 16, ..EngineConfig::default() };
    let mut slots: Vec<GraphSlot> = (0..graph_slots(&config)).map(|_| GraphSlot::new()).collect();
    let planned = Planned::new(Model::open(&bytes).unwrap(), &config, slots.as_mut_slice()).unwrap();
    let mut memory = vec![0u8; planned.layout().bytes_needed()];
    let mut engine: Engine<'_, &mut [GraphSlot], &mut [u8]> = planned.bind(memory.as_mut_slice()).unwrap();
    engine.repack(&OnCaller, &|_| {}).unwrap();
    assert!(!engine.planned().packed_entries().is_empty(), "the tiny model's matrices are repacked");

    let mut checked = 0;
    for line in golden.lines().filter(|l| !l.trim().is_empty()) {
        let prompt: Vec<u32> = numbers(line, "prompt_ids").iter().map(|&v| v as u32).collect();
        let expected: Vec<u32> = numbers(line, "generated_ids").iter().map(|&v| v as u32).collect();
        let margins = numbers(line, "margins");
        let _ = engine.truncate(0, 0);
        let batch: Vec<Entry> = prompt
            .iter()
            .enumerate()
            .map(|(pos, &token)| Entry { seq: 0, pos, token, logits: pos + 1 == prompt.len() })
            .collect();
        engine.step(&batch, &OnCaller, None).unwrap();
        for (step, &want) in expected.iter().enumerate() {
            if margins[step] < TRUSTED_MARGIN {
                break;
            }
            let got = argmax(engine.logits(0).unwrap());
            assert_eq!(got, want, "prompt {prompt:?} step {step}");
            checked += 1;
            let pos = engine.seq_len(0);
            engine.step(&[Entry { seq: 0, pos, token: got, logits: true }], &OnCaller, None).unwrap();
        }
    }
    assert!(checked >= 5, "only {checked} tokens were checked against llama.cpp");
}
