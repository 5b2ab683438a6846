//! The bare-metal image (boards/qemu-virt) under qemu-system-aarch64 -M virt -cpu cortex-a76,
//! through scripts/baremetal.sh: SmolLM2's greedy ids match llama.cpp's golden ones, with the model
//! loaded beside the image and embedded in it, started at EL1 and at EL2; a bad model, a small
//! arena and a CPU fault each end with their message and status.
//!
//! Run by `./x test nostd` (`cargo test --test baremetal -- --ignored`): each test builds or boots
//! an image (Debian's rustc-web with -Zbuild-std, qemu-system-arm; scripts/setup.sh installs them).

use std::path::PathBuf;
use std::process::{Command, Output};

/// Below this margin llama.cpp's own CPU configurations may pick the other token (tests/golden.rs).
const TRUSTED_MARGIN: f64 = 0.3;
const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn baremetal(args: &[&str]) -> Output {
    let out = Command::new(root().join("scripts/baremetal.sh"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("scripts/baremetal.sh runs");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// The numbers of JSON array `key` in `line`.
fn numbers(line: &str, key: &str) -> Vec<f64> {
    let at = line.find(&format!("\"{key}\": [")).unwrap_or_else(|| panic!("{key} missing")) + key.len() + 5;
    let end = at + line[at..].find(']').unwrap();
    line[at..end].split(',').map(|v| v.trim().parse().unwrap()).collect()
}

/// The golden run of "The capital of France is" of llama.cpp's aarch64 build (the image runs the
/// fp16 path, which answers to it): its ids up to the first near-tie.
fn trusted_golden_ids() -> Vec<u32> {
    let golden = std::fs::read_to_string(root().join("tests/golden/smollm2.arm.greedy.jsonl")).unwrap();
    let line = golden.lines().find(|l| l.contains("\"prompt\": \"The capital of France is\"")).unwrap();
    let ids = numbers(line, "generated_ids");
    let margins = numbers(line, "margins");
    ids.iter().zip(&margins).take_while(|(_, &m)| m >= TRUSTED_MARGIN).map(|(&id, _)| id as u32).collect()
}

/// The ids the image printed on stderr.
fn printed_ids(out: &Output) -> Vec<u32> {
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find_map(|l| l.strip_prefix("pinfer: ids")).expect("the image prints its ids");
    line.split_whitespace().map(|v| v.parse().unwrap()).collect()
}

fn assert_matches_golden(out: &Output) {
    assert!(out.status.success(), "the image failed: {:?}", out.status);
    let want = trusted_golden_ids();
    assert!(want.len() >= 4, "the golden file has {} trusted tokens", want.len());
    let got = printed_ids(out);
    assert_eq!(&got[..want.len()], &want[..], "greedy ids against llama.cpp's");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(" Paris."), "the text on the UART: {text:?}");
}

fn model_present() {
    assert!(root().join(MODEL).exists(), "{MODEL} missing: run scripts/setup.sh model");
}

#[test]
#[ignore = "boots a bare-metal image: ./x test nostd"]
fn smollm2_on_bare_metal_matches_llama_cpp() {
    model_present();
    let out = baremetal(&["run", "-m", MODEL, "-p", "The capital of France is", "-n", "8"]);
    assert_matches_golden(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("started at EL1") && err.contains("boot to first token"), "{err}");
    assert!(err.contains("fp16 kernels"), "the image runs the dotprod/fp16 kernels: {err}");
}

/// U-Boot on RK3588 boards jumps to an image at EL2: the start-up code drops to EL1.
#[test]
#[ignore = "boots a bare-metal image: ./x test nostd"]
fn the_image_started_at_el2_drops_to_el1() {
    model_present();
    let out = baremetal(&["run", "-m", MODEL, "-n", "6", "--el2"]);
    assert_matches_golden(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("started at EL2, running at EL1"));
}

/// The one-file form: the model inside the image, no header beyond the run's flags.
#[test]
#[ignore = "boots a bare-metal image: ./x test nostd"]
fn the_image_with_the_model_inside_runs_it() {
    model_present();
    let built = baremetal(&["build", "--embed", MODEL, "--prompt", "The capital of France is"]);
    assert!(built.status.success());
    let image = PathBuf::from(String::from_utf8_lossy(&built.stdout).trim());
    let size = std::fs::metadata(&image).unwrap().len();
    let model = std::fs::metadata(root().join(MODEL)).unwrap().len();
    assert!(size > model, "the image ({size} bytes) holds the model ({model} bytes)");
    let out = baremetal(&["run", "--embedded", "-n", "6"]);
    assert_matches_golden(&out);
}

#[test]
#[ignore = "boots a bare-metal image: ./x test nostd"]
fn bad_models_small_arenas_and_faults_are_reported() {
    model_present();
    let dir = std::env::temp_dir().join(format!("pinfer-baremetal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let check = |args: &[&str], status: i32, says: &[&str]| {
        let out = baremetal(args);
        // Errors are on the UART (stdout); the runner's own refusals on stderr.
        let err = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(status), "{args:?}: {err}");
        for s in says {
            assert!(err.contains(s), "{args:?} should say {s:?}: {err}");
        }
    };
    // Not a GGUF file, and a model cut short: the loader's error, status 1.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a model at all").unwrap();
    check(&["run", "-m", junk.to_str().unwrap(), "-n", "2"], 1, &["pinfer: error: not a GGUF file"]);
    let cut = dir.join("cut.gguf");
    let bytes = std::fs::read(root().join(MODEL)).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    check(&["run", "-m", cut.to_str().unwrap(), "-n", "2"], 1, &["pinfer: error:"]);
    // Too little RAM for the arena: the bytes it needs.
    check(&["run", "-m", MODEL, "-n", "2", "--mem", "200M"], 1, &["the arena is too small: the model needs"]);
    // A context too small for the prompt and the tokens asked for.
    check(&["run", "-m", MODEL, "-n", "20", "-c", "16"], 1, &["do not fit the context"]);
    // A CPU exception: the vectors print what the CPU says on the UART, status 3.
    let out = baremetal(&["run", "-m", MODEL, "-n", "2", "--fault"]);
    let uart = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{uart}");
    assert!(uart.contains("exception: synchronous") && uart.contains("FAR_EL1 0x4000000000"), "{uart}");
    std::fs::remove_dir_all(&dir).unwrap();
}
