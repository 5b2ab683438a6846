//! `pinfer generate --mmproj FILE --image FILE -p TEXT`: the image and the text as one user turn
//! of the model's chat template, greedy text as llama-mtmd-cli's (tests/golden/vision); bad
//! images and projectors refused with a message naming the problem and the remedy.

mod cli_support;

use std::io::Write;
use std::process::Stdio;

use cli_support::{pinfer, pinfer_command, repo_file, temp_file, text_of};

fn golden_text(family: &str, stem: &str) -> String {
    let path = repo_file(&format!("tests/golden/vision/{family}/{stem}.json"));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    v["greedy_text"].as_str().unwrap().to_string()
}

fn vlm(family: &str, file: &str) -> String {
    repo_file(&format!("models/tiny-vlm/{family}/{file}"))
}

fn generate(family: &str, mmproj: &str, image: &str, extra: &[&str]) -> std::process::Output {
    let model = vlm(family, "model.gguf");
    let mut args = vec!["generate", "-m", &model, "--mmproj", mmproj, "--image", image];
    args.extend_from_slice(&["-p", "describe", "-n", "8", "--temp", "0", "--no-display-prompt", "-t", "2"]);
    args.extend_from_slice(extra);
    pinfer(&args)
}

/// (llama-mtmd-cli formats with llama.cpp's built-in chat formats: `--no-jinja` picks pinfer's;
/// the tiny SmolVLM's Jinja template drops the newline after each turn, the built-in keeps it;
/// the tiny Qwen2-VL's and LFM2-VL's add a system turn, the built-in ChatML does not.)
#[test]
fn generate_with_an_image_prints_what_llama_mtmd_cli_prints() {
    for (family, flags) in [
        ("gemma3", &[][..]),
        ("gemma3", &["--no-jinja"][..]),
        ("idefics3", &["--no-jinja"][..]),
        ("qwen2vl", &["--no-jinja"][..]),
        ("qwen2.5vl", &["--no-jinja"][..]),
        ("lfm2", &["--no-jinja"][..]),
    ] {
        for stem in ["rgba_41x29", "rgb_3000x200", "gray_37x53"] {
            let image = repo_file(&format!("tests/vision/images/{stem}.png"));
            let out = generate(family, &vlm(family, "mmproj.gguf"), &image, flags);
            assert!(out.status.success(), "{family} {stem}: {}", text_of(&out.stderr));
            assert_eq!(
                text_of(&out.stdout).trim_end_matches('\n'),
                golden_text(family, stem),
                "{family} {stem}"
            );
        }
    }
}

#[test]
fn bad_images_and_projectors_are_refused_by_name() {
    let image = repo_file("tests/vision/images/rgb_1x1.png");
    let model = vlm("gemma3", "model.gguf");
    let no_mmproj =
        pinfer(&["generate", "-m", &model, "--image", &image, "-p", "describe", "-n", "1", "--temp", "0"]);
    let png = std::fs::read(&image).unwrap();
    let text = temp_file("not-an-image.png", b"hello, this is text");
    let cut = temp_file("cut.png", &png[..png.len() / 2]);
    // A PNG declaring 60000 x 60000 pixels (a valid header, no data).
    let huge = cli_support::png_declaring(&png, 60000, 60000);
    let huge = temp_file("huge.png", &huge);
    let mmproj = vlm("gemma3", "mmproj.gguf");
    let cases: Vec<(&str, std::process::Output, &str)> = vec![
        ("no --mmproj", no_mmproj, "--mmproj"),
        ("text as an image", generate("gemma3", &mmproj, text.to_str().unwrap(), &[]), "not an image"),
        ("a cut PNG", generate("gemma3", &mmproj, cut.to_str().unwrap(), &[]), "truncated or corrupt"),
        ("a 60000x60000 PNG", generate("gemma3", &mmproj, huge.to_str().unwrap(), &[]), "60000x60000"),
        (
            "a missing image",
            generate("gemma3", &mmproj, "/nonexistent/image.png", &[]),
            "/nonexistent/image.png",
        ),
        (
            "another family's projector",
            generate("gemma3", &vlm("idefics3", "mmproj.gguf"), &image, &[]),
            "another language model",
        ),
        ("a model as the projector", generate("gemma3", &model, &image, &[]), "not its projector"),
        ("a batch smaller than the image", generate("gemma3", &mmproj, &image, &["-b", "8"]), "-b"),
    ];
    for (what, out, needle) in cases {
        let err = text_of(&out.stderr);
        assert!(!out.status.success(), "{what}: accepted");
        assert_eq!(out.status.code(), Some(1), "{what}: not a clean error exit: {err}");
        assert!(err.contains(needle), "{what}: {err:?} does not say {needle:?}");
    }
}

/// `pinfer chat` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> std::process::Output {
    let mut child = pinfer_command()
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// Images in `pinfer chat`, as llama-mtmd-cli's chat takes them: `--image` with the first
/// message (whose reply is then `generate`'s, the same one user turn), `/image PATH` with the
/// next; each later turn feeds only what it adds. A bad image is reported and the chat goes on;
/// `/image` without a projector names `--mmproj`.
#[test]
fn chat_takes_images_with_the_first_and_the_next_messages() {
    let first = repo_file("tests/vision/images/rgba_41x29.png");
    let second = repo_file("tests/vision/images/gray_37x53.png");
    for family in ["qwen2vl", "idefics3"] {
        let (model, mmproj) = (vlm(family, "model.gguf"), vlm(family, "mmproj.gguf"));
        let flags = ["-m", &model, "--mmproj", &mmproj, "-n", "8", "--temp", "0", "-t", "2", "--no-jinja"];
        let mut args = flags.to_vec();
        args.extend_from_slice(&["--image", &first]);
        let input = format!("describe\n/image /nonexistent.png\n/image {second}\nand this one\n");
        let out = chat(&args, &input);
        let (stdout, stderr) = (text_of(&out.stdout), text_of(&out.stderr));
        assert!(out.status.success(), "{family}: {stderr}");
        let replies: Vec<&str> = stdout.split("> ").filter(|r| !r.is_empty()).collect();
        assert_eq!(replies.len(), 2, "{family}: {stdout:?}");
        assert_eq!(
            replies[0].trim_end_matches('\n'),
            golden_text(family, "rgba_41x29"),
            "{family}: the first reply is generate's"
        );
        assert!(stderr.contains("/nonexistent.png") && stderr.contains("with the next message"), "{stderr}");
        assert!(replies[1].len() > 1, "{family}: no second reply: {stdout:?}");
    }
    let model = vlm("qwen2vl", "model.gguf");
    let out = chat(&["-m", &model, "-n", "2", "--temp", "0", "-t", "2"], &format!("/image {first}\nhi\n"));
    assert!(out.status.success());
    assert!(text_of(&out.stderr).contains("--mmproj"), "{}", text_of(&out.stderr));
    let out = chat(&["-m", &model, "--image", &first, "-n", "2"], "hi\n");
    assert!(!out.status.success() && text_of(&out.stderr).contains("--mmproj"));
}
