//! `pinfer finetune` end to end on the tiny untied llama (3 layers): the validation loss falls and
//! the adapter it writes is llama.cpp's form, read back by `--lora`; only the assistant's tokens of
//! JSONL conversations are scored; a run stopped and resumed from its checkpoint ends with the
//! adapter of a run that never stopped; a checkpoint of another run is refused; a diverging run
//! and Ctrl-C keep the last checkpoint; bad data and settings are refused by name.

mod cli_support;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use cli_support::pinfer_command;

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

fn tiny() -> String {
    model("tiny/llama-untied-q5.gguf").to_str().unwrap().to_string()
}

/// A fresh directory for one test.
fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("finetune").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pinfer(args: &[&str]) -> Output {
    pinfer_command().args(args).output().unwrap()
}

/// `pinfer finetune` of the tiny model on `data` into `out`, with `extra` options.
fn finetune(data: &Path, out: &Path, extra: &[&str]) -> Output {
    let tiny = tiny();
    let mut args = vec!["finetune", "-m", &tiny, "-f", s(data), "-o", s(out)];
    args.extend_from_slice(extra);
    pinfer(&args)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Some text to learn: a licence, as a board user's own text would be.
fn corpus(d: &Path) -> PathBuf {
    let p = d.join("data.txt");
    let licence = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("LICENSE-MIT")).unwrap();
    std::fs::write(&p, licence.repeat(3)).unwrap();
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The validation perplexities a run printed: (before, after).
fn perplexities(out: &str) -> (f64, f64) {
    let line =
        out.lines().find(|l| l.starts_with("validation perplexity")).unwrap_or_else(|| panic!("{out}"));
    let nums: Vec<f64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
    (nums[0], nums[1])
}

/// 66 updates: minutes under qemu, so the host tier runs it (under qemu the training kernels are
/// checked by kernels_simd and train_lora, and a short run by the resume test below).
#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn a_text_finetune_lowers_the_validation_loss_and_writes_a_llama_cpp_adapter() {
    let d = dir("text");
    let data = corpus(&d);
    let adapter = d.join("a.gguf");
    let out =
        finetune(&data, &adapter, &["-c", "32", "--epochs", "3", "--lr", "3e-3", "--lora-r", "4", "-t", "2"]);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("memory plan:"), "{log}");
    assert!(log.contains("tokens/s, ETA"), "{log}");
    let (before, after) = perplexities(&log);
    assert!(after < 0.8 * before, "validation perplexity {before} -> {after}");

    // llama.cpp's adapter form, for this model.
    let file = pinfer::loader::ModelFile::open(&adapter).unwrap();
    let g = file.parse().unwrap();
    assert_eq!(g.get_str_opt("general.type").unwrap(), Some("adapter"));
    assert_eq!(g.get_str_opt("adapter.type").unwrap(), Some("lora"));
    assert_eq!(g.get_f32_opt("adapter.lora.alpha").unwrap(), Some(16.0));
    let base = pinfer::loader::ModelFile::open(&model("tiny/llama-untied-q5.gguf")).unwrap();
    let bg = base.parse().unwrap();
    let hp = pinfer::model::HParams::from_gguf(&bg).unwrap();
    let lora = pinfer::model::lora::LoraAdapter::check(&g, &bg, &hp).unwrap();
    assert_eq!((lora.rank, lora.pairs.len()), (4, 21));

    // The curves beside it.
    let csv = std::fs::read_to_string(d.join("a.csv")).unwrap();
    assert!(csv.starts_with("step,epoch,train_loss,val_loss,val_ppl,lr,seconds\n"), "{csv}");
    assert!(csv.lines().count() > 4, "{csv}");
    let svg = std::fs::read_to_string(d.join("a.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.trim_end().ends_with("</svg>"));

    // It runs, and its perplexity on the data is the one training ended with.
    let out = pinfer(&["perplexity", "-m", &tiny(), "-f", s(&data), "-c", "32", "--lora", s(&adapter)]);
    assert!(out.status.success(), "{}", text(&out));
    let out = pinfer(&["generate", "-m", &tiny(), "-p", "Permission is", "-n", "4", "--lora", s(&adapter)]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn only_the_assistants_tokens_of_conversations_are_scored() {
    let d = dir("chat");
    let data = d.join("chat.jsonl");
    let reply = "The kitchen light is light.kitchen_main.";
    let line = format!(
        r#"{{"messages": [{{"role": "system", "content": "You name devices."}}, {{"role": "user", "content": "Which is the kitchen light?"}}, {{"role": "assistant", "content": "{reply}"}}]}}"#
    );
    std::fs::write(&data, format!("{line}\n\n{line}\n")).unwrap();
    let out = finetune(
        &data,
        &d.join("a.gguf"),
        &["-c", "64", "--chat-template", "chatml", "--max-steps", "1", "--val-split", "0"],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // The reply and its `<|im_end|>\n`: count them with the model's tokenizer.
    let file = pinfer::loader::ModelFile::open_static(&model("tiny/llama-untied-q5.gguf")).unwrap();
    let gguf = file.parse().unwrap();
    let mut storage = vec![0u32; pinfer::tokenizer::Tokenizer::storage_words(&gguf).unwrap()];
    let tok = pinfer::tokenizer::Tokenizer::new(&gguf, &mut storage).unwrap();
    let mut ids = [0u32; 64];
    let n = tok.encode(&format!("{reply}<|im_end|>\n"), true, false, &mut ids).unwrap();
    let want = format!("2 windows of 64 tokens for training ({} scored)", 2 * n);
    assert!(log.contains(&want), "expected {want:?} in {log}");

    // A line that is not a conversation is named.
    std::fs::write(
        &data,
        format!("{line}\n{{\"messages\": [{{\"role\": \"robot\", \"content\": \"x\"}}]}}\n"),
    )
    .unwrap();
    let out = finetune(&data, &d.join("b.gguf"), &["--chat-template", "chatml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("line 2: role Some(\"robot\")"), "{}", text(&out));
    assert!(!d.join("b.gguf").exists());
}

#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn a_resumed_run_ends_as_an_unbroken_one_and_other_runs_checkpoints_are_refused() {
    let d = dir("resume");
    let data = corpus(&d);
    let steps = |n: &'static str| ["-c", "32", "--max-steps", n, "--save-every", "1", "-t", "2"];
    let straight = d.join("straight.gguf");
    let out = finetune(&data, &straight, &steps("4"));
    assert!(out.status.success(), "{}", text(&out));

    // The same run stopped after 2 updates, then resumed to 4.
    let resumed = d.join("resumed.gguf");
    let out = finetune(&data, &resumed, &steps("2"));
    assert!(out.status.success(), "{}", text(&out));
    let out = finetune(&data, &resumed, &[&steps("4")[..], &["--resume"]].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("at update 2"), "{}", text(&out));
    assert!(
        std::fs::read(&straight).unwrap() == std::fs::read(&resumed).unwrap(),
        "the resumed adapter differs"
    );

    // Another data file's checkpoint.
    let other = d.join("other.txt");
    std::fs::write(
        &other,
        "Some other text entirely, long enough for a window or two of tokens. ".repeat(20),
    )
    .unwrap();
    let ckpt = d.join("resumed.ckpt");
    let before = std::fs::read(&ckpt).unwrap();
    let out = finetune(&other, &resumed, &["-c", "32", "--checkpoint", s(&ckpt), "--resume"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("another run"), "{}", text(&out));
    assert_eq!(std::fs::read(&ckpt).unwrap(), before, "a refused checkpoint was touched");
    // A file that is no checkpoint.
    let out = finetune(&data, &d.join("x.gguf"), &["-c", "32", "--checkpoint", &tiny(), "--resume"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_diverging_run_stops_with_the_last_checkpoint_intact() {
    let d = dir("diverge");
    let data = corpus(&d);
    let adapter = d.join("a.gguf");
    let out = finetune(
        &data,
        &adapter,
        &["-c", "32", "--lr", "1e30", "--clip", "0", "--save-every", "1", "--epochs", "3"],
    );
    let log = text(&out);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("diverged") && log.contains("a.ckpt"), "{log}");
    assert!(!adapter.exists(), "a diverged run wrote an adapter");
    // The checkpoint holds finite values (a NaN one is never saved): it resumes or refuses
    // cleanly, never with NaN weights.
    if d.join("a.ckpt").exists() {
        let file = pinfer::loader::ModelFile::open(&d.join("a.ckpt")).unwrap();
        let g = file.parse().unwrap();
        let x = g.tensor("x").unwrap();
        assert!(g
            .tensor_data(&x)
            .chunks_exact(4)
            .all(|b| f32::from_le_bytes(b.try_into().unwrap()).is_finite()));
    }
}

#[test]
fn ctrl_c_saves_a_checkpoint_and_exits() {
    use std::io::{BufRead, BufReader};
    let d = dir("interrupt");
    let data = corpus(&d);
    let adapter = d.join("a.gguf");
    let mut child = pinfer_command()
        .args([
            "finetune",
            "-m",
            &tiny(),
            "-f",
            s(&data),
            "-o",
            s(&adapter),
            "-c",
            "32",
            "--epochs",
            "50",
            "--save-every",
            "0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("update 2/") {
            break;
        }
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT)
        .unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    let log = seen + &rest.join("\n");
    assert_eq!(status.code(), Some(130), "{log}");
    assert!(log.contains("interrupted at update") && log.contains("--resume"), "{log}");
    assert!(d.join("a.ckpt").exists(), "{log}");
    assert!(!adapter.exists());
    // It resumes.
    let out = finetune(
        &data,
        &adapter,
        &["-c", "32", "--epochs", "50", "--save-every", "0", "--resume", "--max-steps", "1"],
    );
    assert!(out.status.success() || text(&out).contains("resuming"), "{}", text(&out));
}

#[test]
fn bad_data_and_settings_are_refused_by_name() {
    let d = dir("bad");
    let data = corpus(&d);
    let out_path = d.join("a.gguf");
    // Not UTF-8.
    let bin = d.join("bin.txt");
    std::fs::write(&bin, b"abc\xff\xfe").unwrap();
    let out = finetune(&bin, &out_path, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("not UTF-8"), "{}", text(&out));
    // An architecture with a block that has no backward yet.
    let out =
        pinfer(&["finetune", "-m", s(&model("tiny/qwen3moe-tiny.gguf")), "-f", s(&data), "-o", s(&out_path)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("qwen3moe") && text(&out).contains("mixture of experts"), "{}", text(&out));
    // A projection that does not exist; a window of 1 token; the output over the input.
    let out = finetune(&data, &out_path, &["--lora-targets", "q,x"]);
    assert!(text(&out).contains("unknown projection \"x\""), "{}", text(&out));
    let out = finetune(&data, &out_path, &["-c", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let out = finetune(&data, &data, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(std::fs::read_to_string(&data).unwrap().contains("Permission"), "the data was overwritten");
    // An output directory that does not exist: refused before training.
    let out = finetune(&data, &d.join("no/such/dir/a.gguf"), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!text(&out).contains("update 1"), "{}", text(&out));
    assert!(!out_path.exists());
}
