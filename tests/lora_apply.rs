//! LoRA adapters applied at inference (`--lora`, `--lora-scaled`, `SessionOptions::lora`) and merged
//! (`pinfer export-lora`): an adapter whose `B` is zero changes no logit by a bit; an adapted F32
//! model gives the logits of the same adapter merged into its weights; adapters that cannot apply
//! (a fused weight, NaN values, a bad scale, a missing file) are refused with the tensor or file
//! named. (llama.cpp's greedy tokens with an adapter: tests/golden.rs.)

mod cli_support;

use cli_support::pinfer_command;
use std::path::{Path, PathBuf};

use pinfer::gguf::Gguf;
use pinfer::loader::ModelFile;
use pinfer::model::lora::{write_adapter, PairValues};
use pinfer::session::{Session, SessionOptions};

const TOKENS: [u32; 10] = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 1797];
const TARGETS: [&str; 7] = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("lora_apply");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
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

/// Writes an adapter of rank 4 for `base`'s `weights` (A of scale 1/sqrt(n_in), B of `b_scale`).
fn write_test_adapter(base: &Path, weights: &[String], b_scale: f32, out: &Path) {
    let file = ModelFile::open(base).unwrap();
    let gguf = file.parse().unwrap();
    let arch = gguf.get_str_opt("general.architecture").unwrap().unwrap().to_string();
    let rank = 4;
    let mut owned = Vec::new();
    for (i, name) in weights.iter().enumerate() {
        let t = gguf.tensor(name).unwrap_or_else(|| panic!("{name} not in the model"));
        let (n_in, n_out) = (t.ne[0] as usize, t.ne[1] as usize);
        let a: Vec<f32> =
            values(n_in * rank, 2 * i as u64 + 1).iter().map(|v| v / (n_in as f32).sqrt()).collect();
        let b: Vec<f32> = values(rank * n_out, 2 * i as u64 + 2).iter().map(|v| v * b_scale).collect();
        owned.push((name.clone(), n_in, n_out, a, b));
    }
    let pairs: Vec<PairValues<'_>> = owned
        .iter()
        .map(|(target, n_in, n_out, a, b)| PairValues { target, n_in: *n_in, n_out: *n_out, a, b })
        .collect();
    let f = std::fs::File::create(out).unwrap();
    write_adapter(std::io::BufWriter::new(f), &arch, rank, 8.0, &pairs).unwrap();
}

fn projections(n_layer: usize) -> Vec<String> {
    (0..n_layer).flat_map(|il| TARGETS.iter().map(move |t| format!("blk.{il}.{t}.weight"))).collect()
}

fn session(path: &Path, lora: &[(PathBuf, f32)]) -> Result<Session, String> {
    let file = ModelFile::open_static(path).unwrap();
    let opts =
        SessionOptions { n_ctx: 64, threads: 2, logits_all: true, lora: lora.to_vec(), ..Default::default() };
    Session::new(file, &opts).map_err(|e| e.to_string())
}

fn all_logits(s: &mut Session) -> Vec<Vec<f32>> {
    let _ = s.truncate(0);
    TOKENS.iter().map(|&t| s.eval(&[t]).unwrap().to_vec()).collect()
}

fn pinfer(args: &[&str]) -> std::process::Output {
    pinfer_command().args(args).output().unwrap()
}

/// `pinfer export-lora` of `base` with `adapter` at `scale` into `out`, with `extra` options; it must
/// succeed.
fn export(base: &Path, adapter: &str, scale: &str, extra: &[&str], out: &Path) -> std::process::Output {
    let mut args = vec!["export-lora", "-m", base.to_str().unwrap(), "--lora-scaled", adapter, scale, "-o"];
    args.push(out.to_str().unwrap());
    args.extend_from_slice(extra);
    let o = pinfer(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

#[test]
fn an_adapter_with_zero_b_changes_no_logit() {
    // Every projection of SmolLM2's 30 layers (210 pairs): the graphs hold them all.
    let base = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let adapter = scratch("zero-b.gguf");
    write_test_adapter(&base, &projections(30), 0.0, &adapter);
    let plain = all_logits(&mut session(&base, &[]).unwrap());
    let adapted = all_logits(&mut session(&base, &[(adapter.clone(), 1.0)]).unwrap());
    assert_eq!(plain, adapted);
    // And a real one moves them.
    let strong = scratch("strong.gguf");
    write_test_adapter(&base, &projections(30), 0.05, &strong);
    let moved = all_logits(&mut session(&base, &[(strong, 1.0)]).unwrap());
    let gap =
        plain.iter().flatten().zip(moved.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(gap > 0.1, "the adapter moved no logit by more than {gap}");
}

#[test]
fn an_adapted_model_computes_its_merged_weights() {
    // An F32 copy of the untied tiny llama (export-lora at scale 0 dequantizes every adapted
    // weight), adapted at run time and merged: the same function, summed in another order.
    let tiny = model("tiny/llama-untied-q5.gguf");
    let hp_layers = {
        let file = ModelFile::open(&tiny).unwrap();
        let gguf: Gguf<'_> = file.parse().unwrap();
        gguf.get_u32("llama.block_count").unwrap() as usize
    };
    let mut weights = projections(hp_layers);
    weights.push("output.weight".into());
    let adapter = scratch("tiny.gguf");
    write_test_adapter(&tiny, &weights, 0.5, &adapter);
    let (a, base32, merged32) = (adapter.to_str().unwrap(), scratch("base32.gguf"), scratch("merged32.gguf"));
    export(&tiny, a, "0", &["--type", "f32"], &base32);
    let out = export(&base32, a, "0.75", &[], &merged32);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("{} weights merged (F32)", weights.len())));

    let adapted = all_logits(&mut session(&base32, &[(adapter.clone(), 0.75)]).unwrap());
    let merged = all_logits(&mut session(&merged32, &[]).unwrap());
    let plain = all_logits(&mut session(&base32, &[]).unwrap());
    let (mut gap, mut moved) = (0f32, 0f32);
    for ((a, m), p) in adapted.iter().flatten().zip(merged.iter().flatten()).zip(plain.iter().flatten()) {
        gap = gap.max((a - m).abs() / (1.0 + m.abs()));
        moved = moved.max((a - p).abs());
    }
    assert!(moved > 0.5, "the adapter moved the logits by only {moved}");
    assert!(gap < 1e-3, "adapted and merged logits differ by {gap}");

    // Two adapters add their terms: the same adapter at 0.25 and 0.5 is the one at 0.75.
    let twice =
        all_logits(&mut session(&base32, &[(adapter.clone(), 0.25), (adapter.clone(), 0.5)]).unwrap());
    let gap = twice
        .iter()
        .flatten()
        .zip(merged.iter().flatten())
        .map(|(a, m)| (a - m).abs() / (1.0 + m.abs()))
        .fold(0f32, f32::max);
    assert!(gap < 1e-3, "two adapters differ from their merge by {gap}");

    // A quantized merge runs and stays close.
    let q8 = scratch("merged-q8.gguf");
    export(&base32, a, "0.75", &["--type", "q8_0"], &q8);
    let quantized = all_logits(&mut session(&q8, &[]).unwrap());
    // (Q8_0's rounding of the tiny model's peaked weights moves its logits by up to a tenth of their
    // range; the merged values themselves are within half a Q8_0 step of the F32 merge.)
    let spread = merged.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let gap = quantized
        .iter()
        .flatten()
        .zip(merged.iter().flatten())
        .map(|(a, m)| (a - m).abs())
        .fold(0f32, f32::max);
    assert!(gap < 0.2 * spread, "the Q8_0 merge is {gap} away (logits up to {spread})");
}

#[test]
fn adapters_that_cannot_apply_are_refused_by_name() {
    // phi3 reads its fused QKV weight in parts: an adapter of it cannot be added.
    let phi3 = model("tiny/phi3-tiny.gguf");
    let fused = scratch("phi3-qkv.gguf");
    write_test_adapter(&phi3, &["blk.0.attn_qkv.weight".into()], 0.1, &fused);
    let err = session(&phi3, &[(fused, 1.0)]).err().expect("a fused weight's adapter was applied");
    assert!(err.contains("blk.0.attn_qkv.weight") && err.contains("fused"), "{err}");

    // NaN in B.
    let base = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let nan = scratch("nan.gguf");
    write_test_adapter(&base, &["blk.3.attn_v.weight".into()], f32::NAN, &nan);
    let err = session(&base, &[(nan.clone(), 1.0)]).err().expect("NaN weights were applied");
    assert!(err.contains("blk.3.attn_v.weight.lora_b") && err.contains("NaN"), "{err}");
    assert!(err.contains("nan.gguf"), "the file is not named: {err}");

    // Another model's adapter (the tiny llama's shapes).
    let tiny_adapter = scratch("for-tiny.gguf");
    write_test_adapter(
        &model("tiny/llama-untied-q5.gguf"),
        &["blk.0.attn_q.weight".into()],
        0.1,
        &tiny_adapter,
    );
    let err = session(&base, &[(tiny_adapter, 1.0)]).err().expect("another model's adapter applied");
    assert!(err.contains("blk.0.attn_q.weight"), "{err}");

    // A missing file, a scale that is not a number, through the CLI.
    let m = base.to_str().unwrap();
    let out = pinfer(&["generate", "-m", m, "-p", "x", "-n", "1", "--lora", "/nonexistent/a.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/a.gguf"));
    let out = pinfer(&["generate", "-m", m, "-p", "x", "-n", "1", "--lora-scaled", "a.gguf", "half"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the scale is not a number"));
    // The base model given as an adapter.
    let out = pinfer(&["generate", "-m", m, "-p", "x", "-n", "1", "--lora", m]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a LoRA adapter"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // export-lora without an adapter, and onto its own input.
    let out = pinfer(&["export-lora", "-m", m, "-o", scratch("x.gguf").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let adapter = scratch("self.gguf");
    write_test_adapter(&base, &["blk.0.attn_q.weight".into()], 0.1, &adapter);
    let before = std::fs::metadata(&base).unwrap().len();
    let out = pinfer(&["export-lora", "-m", m, "--lora", adapter.to_str().unwrap(), "-o", m]);
    assert_eq!(out.status.code(), Some(1), "export-lora overwrote its input");
    assert_eq!(std::fs::metadata(&base).unwrap().len(), before);
}

#[test]
fn a_prompt_cache_saved_with_an_adapter_is_not_used_without_it() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let adapter = model("tiny/smollm2-lora.gguf");
    assert!(adapter.exists(), "{} missing: run scripts/setup.sh tiny", adapter.display());
    let cache = scratch("prompt.cache");
    let _ = std::fs::remove_file(&cache);
    let run = |lora: bool| {
        let mut args =
            vec!["generate", "-m", m.to_str().unwrap(), "-p", "The capital of France is", "-n", "2"];
        args.extend(["--temp", "0", "--prompt-cache", cache.to_str().unwrap()]);
        if lora {
            args.extend(["--lora", adapter.to_str().unwrap()]);
        }
        let out = pinfer(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(true).contains("saved 5 tokens"));
    // Without the adapter the cached rows are another function's: refused, then rewritten.
    let err = run(false);
    assert!(err.contains("LoRA adapters") && err.contains("not used"), "{err}");
    // With it again: the other file is refused the same way; the same adapter reuses its own.
    assert!(run(true).contains("not used"));
    let err = run(true);
    assert!(!err.contains("not used"), "{err}");
}
