//! `generate --prompt-cache FILE` (llama-cli's): the processed prompt's KV cache is kept in a file
//! and reused by a later prompt that starts with the same tokens, giving exactly the tokens of a
//! run without it; a file that does not match or is damaged gives a note and a normal run, and a
//! file that is not a prompt cache is never overwritten.

mod cli_support;

use std::path::Path;

use cli_support::{pinfer, repo_file, text_of, Scratch};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const PROMPT: &str = "The capital of France is";
const LONGER: &str = "The capital of France is a city that";

/// Greedy ids of `prompt` (with `--prompt-cache cache` when given, plus `extra`); the ids and
/// stderr.
fn run(prompt: &str, cache: Option<&Path>, extra: &[&str]) -> (String, String) {
    run_model(MODEL, prompt, cache, extra)
}

/// As [`run`] with another model.
fn run_model(model: &str, prompt: &str, cache: Option<&Path>, extra: &[&str]) -> (String, String) {
    let model = repo_file(model);
    let mut args =
        vec!["generate", "-m", &model, "-p", prompt, "-n", "6", "--temp", "0", "--print-ids", "-t", "2"];
    let cache_arg;
    if let Some(c) = cache {
        cache_arg = c.to_str().unwrap().to_string();
        args.extend_from_slice(&["--prompt-cache", &cache_arg]);
    }
    args.extend_from_slice(extra);
    let out = pinfer(&args);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    (text_of(&out.stdout).lines().last().unwrap().trim().to_string(), text_of(&out.stderr))
}

#[test]
fn a_prompt_cache_reuses_the_shared_prefix_and_changes_no_token() {
    let (want, _) = run(PROMPT, None, &[]);
    let (want_longer, _) = run(LONGER, None, &[]);
    let dir = Scratch::new("prompt-cache-reuse");
    let cache = dir.join("reuse.bin");
    let (ids, err) = run(PROMPT, Some(&cache), &[]);
    assert_eq!(ids, want);
    assert!(err.contains("not found") && err.contains("saved 5 tokens"), "{err}");
    // The same prompt: all but its last token come from the file, which is not rewritten.
    let before = std::fs::read(&cache).unwrap();
    let (ids, err) = run(PROMPT, Some(&cache), &[]);
    assert_eq!(ids, want);
    assert!(err.contains("reused 4 of the prompt's 5 tokens") && !err.contains("saved"), "{err}");
    // A longer prompt: the shared prefix is reused; the file then holds the longer prompt.
    let (ids, err) = run(LONGER, Some(&cache), &[]);
    assert_eq!(ids, want_longer);
    assert!(err.contains("reused 5 of the prompt's"), "{err}");
    assert_ne!(std::fs::read(&cache).unwrap(), before);
    // Read-only: used, never written.
    let now = std::fs::read(&cache).unwrap();
    let (ids, err) = run(PROMPT, Some(&cache), &["--prompt-cache-ro"]);
    assert_eq!(ids, want);
    assert!(err.contains("reused 4 of the prompt's 5 tokens") && !err.contains("saved"), "{err}");
    assert_eq!(std::fs::read(&cache).unwrap(), now);
}

/// A model with recurrent layers (LFM2) reuses a saved prompt only whole (its states cannot be
/// cut back): a longer prompt continues from the file; a prompt sharing part of it runs normally
/// with a note. The tokens are those of runs without the file either way.
#[test]
fn a_recurrent_model_reuses_a_saved_prompt_only_whole() {
    const LFM2: &str = "models/tiny/lfm2-tiny.gguf";
    let (want, _) = run_model(LFM2, PROMPT, None, &[]);
    let (want_longer, _) = run_model(LFM2, LONGER, None, &[]);
    let dir = Scratch::new("prompt-cache-recurrent");
    let cache = dir.join("lfm2.bin");
    let (ids, err) = run_model(LFM2, PROMPT, Some(&cache), &[]);
    assert!(ids == want && err.contains("saved 5 tokens"), "{err}");
    let (ids, err) = run_model(LFM2, LONGER, Some(&cache), &[]);
    assert_eq!(ids, want_longer);
    assert!(err.contains("reused 5 of the prompt's"), "{err}");
    let (ids, err) = run_model(LFM2, PROMPT, Some(&cache), &[]);
    assert_eq!(ids, want);
    assert!(err.contains("recurrent layers cannot be cut; not used"), "{err}");
}

#[test]
fn bad_prompt_cache_files_give_a_note_and_a_normal_run() {
    let (want, _) = run(PROMPT, None, &[]);
    let dir = Scratch::new("prompt-cache-bad");
    let good = dir.join("good.bin");
    run(PROMPT, Some(&good), &[]);
    let bytes = std::fs::read(&good).unwrap();
    let put = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    // Truncated, or with a flipped bit: refused, then replaced by a good cache.
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 1;
    for (name, b) in [("truncated.bin", &bytes[..bytes.len() / 2]), ("flipped.bin", &flipped[..])] {
        let p = put(name, b);
        let (ids, err) = run(PROMPT, Some(&p), &[]);
        assert_eq!(ids, want, "{name}");
        assert!(err.contains("not used") && err.contains("saved 5 tokens"), "{name}: {err}");
        assert_eq!(std::fs::read(&p).unwrap(), bytes, "{name}");
    }
    // From another model: refused by its identity.
    let tiny = repo_file("models/tiny/qwen3-tiny.gguf");
    let other = dir.join("other.bin");
    let out = pinfer(&[
        "generate",
        "-m",
        &tiny,
        "-p",
        PROMPT,
        "-n",
        "2",
        "--prompt-cache",
        other.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    let (ids, err) = run(PROMPT, Some(&other), &["--prompt-cache-ro"]);
    assert_eq!(ids, want);
    assert!(err.contains("another model") && err.contains("not used"), "{err}");
    // Saved with another KV cache type: named, not used (the rows would be read as q8_0).
    let (want_q8, _) = run(PROMPT, None, &["-ctk", "q8_0"]);
    let (ids, err) = run(PROMPT, Some(&good), &["-ctk", "q8_0", "--prompt-cache-ro"]);
    assert_eq!(ids, want_q8);
    assert!(err.contains("another KV cache type (K f16, V f16; this run uses K q8_0, V f16)"), "{err}");
    // Not a prompt cache at all (zeros, a model, a directory): a note, and never overwritten.
    let zeros = put("zeros.bin", &vec![0u8; bytes.len()]);
    let model_copy = put("model-copy.gguf", &std::fs::read(repo_file(MODEL)).unwrap()[..4096]);
    let directory = dir.join("a-directory");
    std::fs::create_dir_all(&directory).unwrap();
    for p in [&zeros, &model_copy, &directory] {
        let before = if p.is_file() { std::fs::read(p).unwrap() } else { Vec::new() };
        let (ids, err) = run(PROMPT, Some(p), &[]);
        assert_eq!(ids, want, "{}", p.display());
        assert!(err.contains("not used") && err.contains("not overwritten"), "{}: {err}", p.display());
        if p.is_file() {
            assert_eq!(std::fs::read(p).unwrap(), before, "{}", p.display());
        }
    }
    // An unwritable place.
    let nowhere = dir.join("no-such-dir/cache.bin");
    let (ids, err) = run(PROMPT, Some(&nowhere), &[]);
    assert_eq!(ids, want);
    assert!(err.contains("not written"), "{err}");
}
