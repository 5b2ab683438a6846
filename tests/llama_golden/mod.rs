//! llama.cpp's golden files (tests/golden) as the golden and NPU tests read them: which build's
//! goldens the running kernel path answers to, and how far that build disagrees with itself.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use pinfer::kernels::KernelPath;
use serde_json::Value;

/// The folder of llama.cpp's reference outputs (see README.md there).
pub fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// One JSON object per line of golden file `name`.
pub fn jsonl(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(golden_dir().join(name)).unwrap();
    text.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

/// The kernel path tests run sessions on: `PINFER_KERNELS=NAME` (as in the CLI), so one test
/// binary can be held to the goldens on each path the CPU has, else the fastest this CPU has. A
/// name the CPU cannot run fails the test.
pub fn kernels_from_env() -> KernelPath {
    let Ok(name) = std::env::var("PINFER_KERNELS") else { return KernelPath::detect() };
    let path =
        KernelPath::parse(&name).unwrap_or_else(|| panic!("PINFER_KERNELS={name}: no such kernel path"));
    assert!(path.is_available(), "PINFER_KERNELS={name}: not available on this CPU");
    path
}

/// The golden file the running kernel path answers to. The `fp16` path (detected on cores with
/// dotprod and FEAT_FP16, such as qemu cortex-a76) computes attention as llama.cpp's aarch64
/// build does, so it is held to that build's outputs (`NAME.arm.greedy.jsonl` and its own
/// `NAME.arm.spread.jsonl`, written by `scripts/make_golden.py --arm` and
/// `scripts/golden_spread.py --arm`); every other path to the x86 goldens.
pub fn golden_for_path(golden: &str) -> String {
    if kernels_from_env() == KernelPath::NeonFp16 {
        let arm = golden.replace(".greedy.jsonl", ".arm.greedy.jsonl");
        assert!(golden_dir().join(&arm).exists(), "{arm} missing: see scripts/make_golden.py --arm");
        arm
    } else {
        golden.to_string()
    }
}

/// llama.cpp's self-disagreement on one model, over all its golden prompts: the largest top-5 logit
/// gap between its configurations in the first steps, and the largest margin at which one of them
/// picked another greedy token. Each step's value is one sample of the same rounding noise, so the
/// model-wide maximum is the floor, not the value at that step.
pub struct Spread {
    pub logit: f64,
    pub flip_margin: f64,
}

/// The spread of `golden` (its `.spread.jsonl` twin); flips count from `near_tie` up. Without a
/// spread file (models whose llama.cpp self-disagreement was not measured), nothing beyond the base
/// tolerance is allowed.
pub fn spread(golden: &str, near_tie: f64) -> Spread {
    let name = golden.replace(".greedy.jsonl", ".spread.jsonl");
    if !golden_dir().join(&name).exists() {
        return Spread { logit: 0.0, flip_margin: near_tie };
    }
    let cases = jsonl(&name);
    let floats =
        |v: &Value| -> Vec<f64> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let logit = cases.iter().flat_map(|c| floats(&c["spread"])).fold(0.0, f64::max);
    let mut flip_margin = near_tie;
    for case in &cases {
        for flips in case["flips"].as_object().unwrap().values() {
            for flip in flips.as_array().unwrap() {
                flip_margin = flip_margin.max(flip[1].as_f64().unwrap());
            }
        }
    }
    Spread { logit, flip_margin }
}
