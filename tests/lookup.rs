//! Lookup decoding (`--lookup N`): guesses copied from earlier in the text, verified in one batch.
//! The output must be the same as plain decoding's, greedy and sampled (on the kernels whose
//! arithmetic does not depend on the batch: the reference path here, NEON on a board).

mod cli_support;

use cli_support::{pinfer_command, repo_file, text_of};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// An input-grounded prompt: the answer repeats much of it.
fn prompt() -> String {
    let doc = r#"{"name": "Kitchen light", "room": "kitchen", "state": "off", "brightness": 80, "color": "warm white", "schedule": {"on": "07:00", "off": "23:00"}}"#;
    format!("<|im_start|>user\nRepeat this JSON exactly, changing only the state to on:\n{doc}<|im_end|>\n<|im_start|>assistant\n")
}

/// stdout and stderr of `pinfer generate` with `extra` options: on x86 on the reference kernels
/// (AVX2 sums a batch in another order than a lone token), on aarch64 on NEON (the same sums).
fn run(extra: &[&str]) -> (String, String) {
    let model = repo_file(MODEL);
    let p = prompt();
    let mut args = vec!["generate", "-m", &model, "-p", &p, "-n", "48", "--no-display-prompt", "-t", "2"];
    args.extend_from_slice(extra);
    let mut cmd = pinfer_command();
    if cfg!(target_arch = "x86_64") {
        cmd.env("PINFER_KERNELS", "ref");
    }
    let out = cmd.args(&args).output().unwrap();
    assert!(out.status.success(), "{extra:?}: {}", text_of(&out.stderr));
    (text_of(&out.stdout), text_of(&out.stderr))
}

#[test]
fn lookup_gives_the_same_text_and_takes_guesses() {
    for sampling in [&["--temp", "0"][..], &["--temp", "0.9", "-s", "11"][..]] {
        let (plain, _) = run(sampling);
        let mut with = sampling.to_vec();
        with.extend_from_slice(&["--lookup", "6"]);
        let (looked, err) = run(&with);
        assert_eq!(looked, plain, "{sampling:?}");
        let line = err.lines().find(|l| l.contains("lookup:")).unwrap_or_else(|| panic!("{err}"));
        // "lookup: D tokens guessed in B batches, A taken (P%)"
        let nums: Vec<usize> =
            line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
        assert!(nums.len() >= 3 && nums[0] > 0 && nums[2] > 0, "{sampling:?}: no guess was taken: {line}");
    }
}

#[test]
fn lookup_is_refused_where_it_cannot_work() {
    let model = repo_file(MODEL);
    let out = pinfer_command().args(["generate", "-m", &model, "-p", "x", "--lookup", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert!(text_of(&out.stderr).contains("--lookup 0"), "{}", text_of(&out.stderr));
    // A model with recurrent layers: its state cannot go back to a guess's position.
    let lfm2 = repo_file("models/tiny/lfm2-tiny.gguf");
    let out = pinfer_command()
        .args(["generate", "-m", &lfm2, "-p", "x", "-n", "4", "--lookup", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert!(text_of(&out.stderr).contains("recurrent"), "{}", text_of(&out.stderr));
}
