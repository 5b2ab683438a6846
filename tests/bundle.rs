//! `pinfer bundle`: one executable carrying its model. A bundle runs as pinfer with its own model
//! (the same tokens as `-m`), and a truncated, altered or model-less one is refused by name
//! before any model byte is used. (tests/dist.rs bundles the aarch64 dist binary and runs the
//! bundle under qemu against llama.cpp's ids.)

mod cli_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cli_support::{pinfer, repo_file, text_of, through_qemu, Scratch};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const PROMPT: &str = "The capital of France is";

/// Runs the executable at `exe` (through qemu when the tests do) with `args`.
fn run(exe: &Path, args: &[&str]) -> Output {
    let mut cmd = match through_qemu() {
        Some(cpu) => {
            let mut c = Command::new("qemu-aarch64");
            c.args(["-cpu", cpu]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(args);
    // A file this process just wrote can be "busy" for a moment: another test thread's fork may
    // still hold its write descriptor until that child execs (close-on-exec). Retry briefly.
    for _ in 0..100 {
        match cmd.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            other => return other.unwrap(),
        }
    }
    cmd.output().unwrap()
}

fn greedy_ids(out: &Output) -> String {
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    text_of(&out.stdout).lines().last().unwrap().trim().to_string()
}

const GREEDY: [&str; 8] = ["generate", "-p", PROMPT, "-n", "6", "--temp", "0", "--print-ids"];

fn bundle(dir: &Scratch, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let model = repo_file(MODEL);
    let mut args = vec!["bundle", "-m", &model, "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let r = pinfer(&args);
    assert!(r.status.success(), "{}", text_of(&r.stderr));
    out
}

#[test]
fn a_bundle_runs_its_own_model_like_dash_m() {
    let dir = Scratch::new("bundle-runs");
    let model = repo_file(MODEL);
    let mut with_m = GREEDY.to_vec();
    with_m.extend_from_slice(&["-m", &model]);
    let want = greedy_ids(&pinfer(&with_m));
    let exe = bundle(&dir, "plain", &[]);
    assert_eq!(greedy_ids(&run(&exe, &GREEDY)), want);
    // Repacked: the weights stored in this CPU's layout.
    let repacked = bundle(&dir, "repacked", &["--repacked"]);
    assert_eq!(greedy_ids(&run(&repacked, &GREEDY)), want);
    // `-m BUNDLE` reads the model a bundle carries; bundling a bundle keeps one executable image.
    let mut via_m = GREEDY.to_vec();
    via_m.extend_from_slice(&["-m", exe.to_str().unwrap()]);
    assert_eq!(greedy_ids(&pinfer(&via_m)), want);
    let again = dir.join("again");
    let r = pinfer(&[
        "bundle",
        "-m",
        &model,
        "--target-binary",
        exe.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", text_of(&r.stderr));
    assert_eq!(std::fs::metadata(&again).unwrap().len(), std::fs::metadata(&exe).unwrap().len());
}

#[test]
fn damaged_bundles_and_wrong_inputs_are_refused_by_name() {
    let dir = Scratch::new("bundle-damaged");
    let exe = bundle(&dir, "to-damage", &[]);
    let bytes = std::fs::read(&exe).unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        p
    };
    let refused = |exe: &Path, why: &str| {
        let out = run(exe, &GREEDY);
        assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
        assert!(text_of(&out.stderr).contains(why), "{}", text_of(&out.stderr));
    };
    // Truncated: the trailer is gone, bytes follow the ELF image.
    refused(&write("truncated", &bytes[..bytes.len() - 1000]), "truncated or damaged");
    // The trailer altered.
    let mut t = bytes.clone();
    let n = t.len();
    t[n - 30] ^= 1;
    refused(&write("trailer", &t), "trailer is damaged");
    // The model's header altered (its first metadata bytes, after the alignment padding).
    let trailer = &bytes[n - 48..];
    let offset = u64::from_le_bytes(trailer[16..24].try_into().unwrap()) as usize;
    let mut h = bytes.clone();
    h[offset + 40] ^= 1;
    refused(&write("header", &h), "header does not match its checksum");
    // A plain pinfer given itself as the model.
    let out = pinfer(&["generate", "-m", env!("CARGO_BIN_EXE_pinfer"), "-p", "x", "-n", "1"]);
    assert!(text_of(&out.stderr).contains("is a program, not a model file"), "{}", text_of(&out.stderr));
    // Bundling something that is not a pinfer.
    let model = repo_file(MODEL);
    let out =
        pinfer(&["bundle", "-m", &model, "--target-binary", &model, "-o", dir.join("x").to_str().unwrap()]);
    assert!(text_of(&out.stderr).contains("not an executable"), "{}", text_of(&out.stderr));
    // The output may not be an input.
    let out = pinfer(&["bundle", "-m", &model, "-o", &model]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text_of(&out.stderr).contains("the same file"), "{}", text_of(&out.stderr));
}
