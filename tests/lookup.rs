//! Speculative decoding: guesses copied from earlier in the text (`--lookup N`) or made by a
//! draft model (`-md FILE`), verified in one batch. The output must be the same as plain
//! decoding's, greedy and sampled, on the default kernels (every kernel path computes a token the
//! same whatever else is in its batch: `tests/kernels_simd.rs`).

mod cli_support;

use cli_support::{pinfer_command, repo_file, text_of, through_qemu};
use pinfer::loader::ModelFile;
use pinfer::model::KvTypes;
use pinfer::quant::GgmlType;
use pinfer::session::{Session, SessionOptions};
use pinfer::speculative::MOST_GUESSES;

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// An input-grounded prompt: the answer repeats much of it.
fn prompt() -> String {
    let doc = r#"{"name": "Kitchen light", "room": "kitchen", "state": "off", "brightness": 80, "color": "warm white", "schedule": {"on": "07:00", "off": "23:00"}}"#;
    format!("<|im_start|>user\nRepeat this JSON exactly, changing only the state to on:\n{doc}<|im_end|>\n<|im_start|>assistant\n")
}

/// stdout and stderr of `pinfer generate` with `extra` options.
fn run(extra: &[&str]) -> (String, String) {
    run_model(MODEL, extra)
}

fn run_model(model: &str, extra: &[&str]) -> (String, String) {
    let model = repo_file(model);
    let p = prompt();
    let mut args = vec!["generate", "-m", &model, "-p", &p, "-n", "48", "--no-display-prompt", "-t", "2"];
    args.extend_from_slice(extra);
    let out = pinfer_command().args(&args).output().unwrap();
    assert!(out.status.success(), "{extra:?}: {}", text_of(&out.stderr));
    (text_of(&out.stdout), text_of(&out.stderr))
}

/// Greedy and sampled; under qemu greedy only (the sampler's side of verification is the same
/// code on every CPU, and each run there takes half a minute).
fn samplings<'a>(sampled: &'a [&'a str]) -> Vec<&'a [&'a str]> {
    let mut all = vec![&["--temp", "0"][..]];
    if through_qemu().is_none() {
        all.push(sampled);
    }
    all
}

#[test]
fn lookup_gives_the_same_text_and_takes_guesses() {
    for sampling in samplings(&["--temp", "0.9", "-s", "11"]) {
        let (plain, _) = run(sampling);
        let mut with = sampling.to_vec();
        with.extend_from_slice(&["--lookup", "6"]);
        let (looked, err) = run(&with);
        assert_eq!(looked, plain, "{sampling:?}");
        assert_guesses_taken(&err, "lookup:", sampling);
    }
}

/// The "SOURCE: D tokens guessed in B batches, A taken (P%)" line of `err` says guesses were taken.
fn assert_guesses_taken(err: &str, source: &str, sampling: &[&str]) {
    let line = err.lines().find(|l| l.contains(source)).unwrap_or_else(|| panic!("{err}"));
    let nums: Vec<usize> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    assert!(nums.len() >= 3 && nums[0] > 0 && nums[2] > 0, "{sampling:?}: no guess was taken: {line}");
}

/// The Q4_0 file of the same model drafts for the Q8_0 one: the same text as without it, and
/// most guesses taken.
#[test]
fn a_draft_model_gives_the_same_text_and_its_guesses_are_taken() {
    let target = "models/SmolLM2-135M-Instruct.Q8_0.gguf";
    let draft = repo_file("models/SmolLM2-135M-Instruct.Q4_0.gguf");
    for sampling in samplings(&["--temp", "0.9", "-s", "5"]) {
        let (plain, _) = run_model(target, sampling);
        // (An unsure draft guesses too: every step then carries guesses.)
        let mut with = sampling.to_vec();
        with.extend_from_slice(&["-md", &draft, "--draft-max", "5", "--draft-p-min", "0"]);
        let (drafted, err) = run_model(target, &with);
        assert_eq!(drafted, plain, "{sampling:?}");
        assert_guesses_taken(&err, "draft model:", sampling);
    }
}

/// Draft models that cannot draft: another vocabulary, recurrent layers; bad counts.
#[test]
fn draft_models_that_cannot_draft_are_refused() {
    let model = repo_file(MODEL);
    let refused = |args: &[&str], says: &str| {
        let mut all = vec!["generate", "-m", &model, "-p", "x", "-n", "4"];
        all.extend_from_slice(args);
        let out = pinfer_command().args(&all).output().unwrap();
        let err = text_of(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: wanted {says:?} in: {err}");
    };
    let gemma = repo_file("models/gemma-3-270m-q4_k_m.gguf");
    refused(&["-md", &gemma], "vocabulary is not the model's");
    let lfm2 = repo_file("models/tiny/lfm2-tiny.gguf");
    refused(&["-md", &lfm2], "draft model has recurrent layers");
    refused(&["-md", &model, "--draft-max", "0"], "--draft-max 0");
    refused(&["-md", &model, "--draft-p-min", "2"], "--draft-p-min 2");
    refused(&["-md", "/nonexistent/draft.gguf"], "/nonexistent/draft.gguf");
}

#[test]
fn lookup_is_refused_where_it_cannot_work() {
    let model = repo_file(MODEL);
    let out = pinfer_command().args(["generate", "-m", &model, "-p", "x", "--lookup", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert!(text_of(&out.stderr).contains("--lookup 0"), "{}", text_of(&out.stderr));
    // More guesses than a batch of them may carry (the batch would take a prompt's kernels), even
    // where the batch holds them.
    let too_many = (MOST_GUESSES + 1).to_string();
    for flag in [["--lookup", &too_many], ["--draft-max", &too_many]] {
        let mut args = vec!["generate", "-m", &model, "-p", "x", "-b", "512"];
        args.extend(flag);
        if flag[0] == "--draft-max" {
            args.extend(["-md", &model]);
        }
        let out = pinfer_command().args(&args).output().unwrap();
        let err = text_of(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("{} {too_many}: give 1 to {MOST_GUESSES}", flag[0])), "{err}");
    }
    // A model with recurrent layers: its state cannot go back to a guess's position.
    let lfm2 = repo_file("models/tiny/lfm2-tiny.gguf");
    let out = pinfer_command()
        .args(["generate", "-m", &lfm2, "-p", "x", "-n", "4", "--lookup", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert!(text_of(&out.stderr).contains("recurrent"), "{}", text_of(&out.stderr));
}

/// What makes the texts the same: a token's logits are the same bits alone as in a batch of
/// guesses, also past 512 cached keys, where a step of one or two tokens on SmolLM2's 3 KV heads
/// splits its keys between the threads and a batch does not (every long row is summed in the same
/// parts either way), over an f16 cache and a quantized one (q8_0 keys, q4_0 values: the typed
/// kernel). Batches of 3, 9 and the most a batch of guesses holds after 500 cached positions (crossing 512) and, but under
/// qemu, 1010 (crossing 1024, where rows take 4 parts).
#[test]
fn a_token_computes_the_same_alone_and_in_a_batch_of_guesses() {
    let ids: Vec<u32> = (0..1100u32).map(|i| (i * 7919 + 13) % 40000 + 100).collect();
    let starts: &[usize] = if through_qemu().is_some() { &[500] } else { &[500, 1010] };
    // (Made-up quantized blocks take values near 0.01: their scales are such f16s, their quants
    // the f16s' bytes, so keys stay within about +-1 and no single key takes a row's softmax whole.)
    for (k, v, size) in [(GgmlType::F16, GgmlType::F16, 1.0), (GgmlType::Q8_0, GgmlType::Q4_0, 0.01)] {
        let model = ModelFile::open_static(std::path::Path::new(&repo_file(MODEL))).unwrap();
        let kv_types = KvTypes { k, v };
        let opts =
            SessionOptions { threads: 2, n_ctx: 1100, logits_all: true, kv_types, ..Default::default() };
        let mut session = Session::new(model, &opts).unwrap();
        for &start in starts {
            // The cached positions before `start` hold made-up keys and values (every two bytes an
            // f16 in [-size, size], so also every block's scale): any will do, and a prompt of
            // 1010 tokens would take minutes under qemu.
            let len = session.sequence_bytes(start);
            let rows: Vec<u8> = (0..len / 2)
                .flat_map(|i| {
                    half::f16::from_f32(size * ((i * 7919 % 2001) as f32 / 1000.0 - 1.0)).to_le_bytes()
                })
                .collect();
            session.restore_sequence(0, start, &rows).unwrap();
            // Tokens one by one, then the cache cut back and the same tokens in batches: the
            // largest a batch of guesses can be (the token and MOST_GUESSES) but under qemu.
            let n = if through_qemu().is_some() { 27 } else { MOST_GUESSES + 1 };
            let singles: Vec<Vec<f32>> =
                (start..start + n).map(|i| session.eval(&ids[i..i + 1]).unwrap().to_vec()).collect();
            for batch in [3, 9, n] {
                assert_eq!(session.truncate(start), start);
                let mut rows = Vec::new();
                for at in (start..start + n).step_by(batch) {
                    session.eval_all(&ids[at..at + batch], |_, l| rows.push(l.to_vec())).unwrap();
                }
                for (j, (a, b)) in singles.iter().zip(&rows).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "K {k:?}, V {v:?}, batch of {batch}: the logits of position {} differ from the token's alone",
                        start + j
                    );
                }
            }
        }
    }
}
