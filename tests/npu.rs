//! NPU offload (feature `npu`) against the CPU emulator of librknnrt.so that rknn-sys builds:
//! offloaded matmuls against the exact product (within the fp16/int8 rounding bounds of
//! `pinfer::npu::check`), generation with the NPU against llama.cpp's greedy tokens, the fallbacks
//! (runtime missing, context creation failing), whitelists, and the `npu-plan` / `selftest`
//! commands. Runs on x86 and under qemu-aarch64 (the emulator is compiled for the target).
#![cfg(feature = "npu")]

mod llama_golden;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};

use llama_golden::jsonl;
use pinfer::exec::MatmulOffload;
use pinfer::loader::ModelFile;
use pinfer::npu::{
    buckets, Comparison, NpuBackend, NpuConfig, NpuError, NpuMode, NpuPlan, PlannedMatmul, Precision,
    Whitelist,
};
use pinfer::quant::GgmlType;
use pinfer::session::{Session, SessionOptions};
use serde_json::Value;

/// The emulator built by rknn-sys (a librknnrt.so for this target).
fn emulator() -> &'static Path {
    Path::new(env!("PINFER_RKNN_EMULATOR"))
}

/// In-process tests share the emulator's global counters: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The emulator's test hooks (the library is loaded once per process, so this is the backend's).
fn emu_symbol(name: &std::ffi::CStr) -> *mut core::ffi::c_void {
    static RT: OnceLock<rknn_sys::Runtime> = OnceLock::new();
    let rt = RT.get_or_init(|| rknn_sys::Runtime::load_from(emulator()).unwrap());
    rt.symbol(name).expect("emulator test hook").as_ptr()
}

fn run_count(core: i32) -> u64 {
    // SAFETY: the emulator defines rknn_emu_run_count as uint64_t(int).
    let f: extern "C" fn(i32) -> u64 = unsafe { std::mem::transmute(emu_symbol(c"rknn_emu_run_count")) };
    f(core)
}

fn live() -> (i32, i32) {
    // SAFETY: the emulator defines both as int(void).
    let contexts: extern "C" fn() -> i32 =
        unsafe { std::mem::transmute(emu_symbol(c"rknn_emu_live_contexts")) };
    // SAFETY: as above.
    let mems: extern "C" fn() -> i32 = unsafe { std::mem::transmute(emu_symbol(c"rknn_emu_live_mems")) };
    (contexts(), mems())
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1), with an occasional large value (activations have outliers).
    fn value(&mut self) -> f32 {
        let v = (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        if self.next() % 97 == 0 {
            v * 40.0
        } else {
            v
        }
    }
}

/// A weight matrix for the synthetic file: F32 or Q8_0 bytes, and its values.
fn weight_bytes(ty: GgmlType, k: usize, n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut values = Vec::with_capacity(k * n);
    match ty {
        GgmlType::F32 => {
            for _ in 0..k * n {
                let v = rng.value();
                bytes.extend_from_slice(&v.to_le_bytes());
                values.push(v);
            }
        }
        GgmlType::Q8_0 => {
            for _ in 0..k * n / 32 {
                let d = half::f16::from_f32(0.001 + (rng.next() % 100) as f32 * 1e-4);
                bytes.extend_from_slice(&d.to_bits().to_le_bytes());
                for _ in 0..32 {
                    let q = (rng.next() % 255) as i32 - 127;
                    bytes.push(q as i8 as u8);
                    values.push(d.to_f32() * q as f32);
                }
            }
        }
        _ => unreachable!(),
    }
    (bytes, values)
}

struct Synthetic {
    data: Vec<u8>,
    plan: NpuPlan,
    values: Vec<Vec<f32>>,
}

/// A "model file" holding one weight matrix per shape, and a plan sending all of them to the NPU
/// for batches of `min_batch` to `n_batch` rows.
fn synthetic(
    precision: Precision,
    shapes: &[(usize, usize, GgmlType)],
    min_batch: usize,
    n_batch: usize,
) -> Synthetic {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut data = vec![0u8; 64];
    let (mut matmuls, mut values) = (Vec::new(), Vec::new());
    for (i, &(k, n, ty)) in shapes.iter().enumerate() {
        let (bytes, v) = weight_bytes(ty, k, n, &mut rng);
        let offset = data.len();
        data.extend_from_slice(&bytes);
        data.resize(data.len().next_multiple_of(64), 0);
        matmuls.push(PlannedMatmul {
            name: format!("w{i}"),
            weight: format!("w{i}.weight"),
            offset,
            ty,
            k,
            n,
            max_tokens: n_batch,
        });
        values.push(v);
    }
    let plan = NpuPlan {
        precision,
        cores: 3,
        min_batch,
        buckets: buckets(min_batch, n_batch),
        matmuls,
        skipped: Vec::new(),
    };
    Synthetic { data, plan, values }
}

fn emulator_config(precision: Precision, min_batch: usize) -> NpuConfig {
    NpuConfig {
        mode: NpuMode::Auto,
        precision,
        min_batch,
        library: Some(emulator().to_owned()),
        ..NpuConfig::default()
    }
}

/// Every shape at several batch sizes (bucket sizes, padded ones, more than the largest bucket)
/// against the exact product: each element within the rounding bound, all three cores used.
fn check_matmuls(precision: Precision, shapes: &[(usize, usize, GgmlType)]) {
    let _guard = serial();
    let before = live();
    let s = synthetic(precision, shapes, 4, 32);
    let config = emulator_config(precision, 4);
    let runs_before: Vec<u64> = (0..3).map(run_count).collect();
    {
        let backend = NpuBackend::new(&s.data, &s.plan, &config).unwrap();
        assert_eq!(backend.stats().matmuls, shapes.len());
        backend.begin();
        let mut rng = Rng(7);
        for (m, w) in s.plan.matmuls.iter().zip(&s.values) {
            assert!(!backend.accepts(m.offset, m.k, m.n, 3), "below the minimum batch");
            assert!(!backend.accepts(m.offset + 1, m.k, m.n, 8), "unknown weights");
            assert!(!backend.accepts(m.offset, m.k + 32, m.n, 8), "another shape");
            for rows in [4, 5, 32, 45] {
                assert!(backend.accepts(m.offset, m.k, m.n, rows));
                let x: Vec<f32> = (0..rows * m.k).map(|_| rng.value()).collect();
                let mut out = vec![f32::NAN; rows * m.n];
                assert!(
                    backend.run(m.offset, m.k, m.n, &x, &mut out),
                    "{} K={} N={} rows={rows}",
                    m.name,
                    m.k,
                    m.n
                );
                let c = Comparison::new(precision, w, &x, m.k, m.n, &out);
                eprintln!(
                    "{:?} K={} N={} rows={rows}: max abs {:.3e}, max rel {:.3e}, err/bound {:.3}",
                    precision, m.k, m.n, c.max_abs, c.max_rel, c.worst_ratio
                );
                assert!(c.passes(1.0), "{precision:?} K={} N={} rows={rows}: {c:?}", m.k, m.n);
            }
        }
        let stats = backend.stats();
        assert_eq!((stats.disabled, stats.calls), (0, 4 * shapes.len() as u64));
        for core in 0..3 {
            assert!(run_count(core) > runs_before[core as usize], "core {core} never ran");
        }
    }
    assert_eq!(live(), before, "dropping the backend frees every context and buffer");
}

#[test]
fn fp16_matmuls_are_within_the_rounding_bound() {
    check_matmuls(
        Precision::Fp16,
        &[
            (128, 64, GgmlType::F32),           // 32 / 16 / 16 columns per core
            (96, 48, GgmlType::Q8_0),           // 16 each
            (8256, 48, GgmlType::F32),          // two K segments, summed on the CPU
            (32, 3 * 8192 + 48, GgmlType::F32), // per-core slices above 8192 columns, cut again
        ],
    );
}

#[test]
fn int8_matmuls_are_within_the_rounding_bound() {
    check_matmuls(
        Precision::Int8,
        &[
            (128, 64, GgmlType::F32), // 32 / 32 / nothing
            (96, 96, GgmlType::Q8_0),
            (8256, 96, GgmlType::F32),
            (32, 24640, GgmlType::F32),
        ],
    );
}

#[test]
fn a_missing_runtime_or_an_unusable_device_is_an_error_not_a_crash() {
    let s = synthetic(Precision::Fp16, &[(64, 32, GgmlType::F32)], 1, 4);
    let mut config = emulator_config(Precision::Fp16, 1);
    config.library = Some(PathBuf::from("/nonexistent/librknnrt.so"));
    match NpuBackend::new(&s.data, &s.plan, &config) {
        Err(NpuError::Missing(msg)) => assert!(msg.contains("/nonexistent/librknnrt.so"), "{msg}"),
        other => panic!("expected Missing, got {other:?}"),
    }
    // A plan with nothing in it.
    let empty = synthetic(Precision::Fp16, &[], 1, 4);
    assert!(matches!(
        NpuBackend::new(&empty.data, &empty.plan, &emulator_config(Precision::Fp16, 1)),
        Err(NpuError::Nothing(_))
    ));
}

fn model_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn argmax(logits: &[f32]) -> usize {
    logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best })
}

fn session(model: &str, config: Option<NpuConfig>) -> Session {
    let model = ModelFile::open_static(&model_path(model)).unwrap();
    let kernels = llama_golden::kernels_from_env();
    let mut opts = SessionOptions { threads: 2, n_ctx: 256, n_batch: 32, kernels, ..Default::default() };
    if let Some(c) = config {
        opts.npu = c;
    }
    Session::new(model, &opts).unwrap()
}

/// llama.cpp's greedy tokens on every golden prompt, up to the first near-tie (margin below
/// `near_tie`), with every matmul on the (emulated) NPU, decode included (`min_batch` 1), and its
/// top-5 logits within tests/golden.rs's tolerance plus `extra_tol`.
///
/// The tiny models have random weights and are chaotic: perturbing every matmul output by a relative
/// 1e-6 moves their logits by about 0.07 (measured), so the NPU's logits differ from the CPU
/// kernels' by up to ~0.8 although each offloaded product is within its rounding bound (the tests
/// above). pinfer's CPU kernels round the inputs to Q8_0 exactly as llama.cpp does, so they stay
/// closer to llama.cpp than the NPU's fp16 inputs, which are closer to the exact product.
fn check_generation(
    model: &str,
    golden: &str,
    precision: Precision,
    extra_tol: f32,
    near_tie: f64,
    (max_prompts, max_steps): (usize, usize),
) {
    let _guard = serial();
    let mut npu = session(model, Some(emulator_config(precision, 1)));
    let mut cpu = session(model, None);
    let backend = npu.npu().expect("the NPU backend is up");
    assert!(
        backend.plan().skipped.is_empty(),
        "every matmul goes, the output included: {:?}",
        backend.plan().skipped
    );
    let (mut worst, mut cpu_worst, mut cpu_gap) = (0f32, 0f32, 0f32);
    // As tests/golden.rs: the goldens of the llama.cpp build whose attention arithmetic the CPU
    // kernel path shares, the README's tolerance plus that build's own spread on this model, and a
    // token may differ where its own configurations flip one.
    let golden = &llama_golden::golden_for_path(golden);
    let spread = llama_golden::spread(golden, near_tie);
    let (logit_tol, flip_margin) = (0.3 + spread.logit as f32 + extra_tol, spread.flip_margin);
    for case in jsonl(golden).into_iter().take(max_prompts) {
        let (prompt, expected) = (ids(&case["prompt_ids"]), ids(&case["generated_ids"]));
        let margins: Vec<f64> =
            case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
        let _ = npu.truncate(0);
        let _ = cpu.truncate(0);
        let mut logits = npu.eval(&prompt).unwrap().to_vec();
        let mut reference = cpu.eval(&prompt).unwrap().to_vec();
        for (step, &want) in expected.iter().enumerate().take(max_steps) {
            let gap = logits.iter().zip(&reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            cpu_gap = cpu_gap.max(gap);
            if let Some(top5) = case["top5"].get(step) {
                for pair in top5.as_array().unwrap() {
                    let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
                    let gap = (logits[id] - want).abs();
                    worst = worst.max(gap);
                    cpu_worst = cpu_worst.max((reference[id] - want).abs());
                    assert!(
                        gap <= logit_tol,
                        "{precision:?} {:?} step {step}: logit of {id} is {}, llama.cpp {want}",
                        case["prompt"],
                        logits[id]
                    );
                }
            }
            if margins[step] < near_tie {
                break;
            }
            let got = argmax(&logits) as u32;
            if got != want {
                assert!(
                    margins[step] <= flip_margin,
                    "{precision:?} {:?} step {step}: token {got}, llama.cpp {want} at margin {} (above {flip_margin})",
                    case["prompt"],
                    margins[step]
                );
                eprintln!(
                    "{precision:?} {:?} step {step}: flipped at margin {}",
                    case["prompt"], margins[step]
                );
                break; // the contexts differ from here on
            }
            logits = npu.eval(&[got]).unwrap().to_vec();
            reference = cpu.eval(&[got]).unwrap().to_vec();
        }
    }
    let stats = npu.npu().unwrap().stats();
    eprintln!(
        "{precision:?}: largest top-5 logit gap to llama.cpp {worst:.4} (the CPU kernels': {:.4}), \
         largest logit difference from the CPU kernels {cpu_gap:.4}; {stats:?}",
        cpu_worst
    );
    assert!(stats.calls > 0 && stats.disabled == 0, "{stats:?}");
}

/// Greedy steps per prompt: fewer under qemu.
fn steps(native: usize) -> usize {
    if cfg!(target_arch = "aarch64") {
        native.min(4)
    } else {
        native
    }
}

/// SmolLM2-135M Q4_1, the default model: all 211 matmuls (the output included) on the emulated
/// NPU. The emulator converts every B element on every call (~1 s per token here), so three steps
/// per prompt on two prompts, and not under qemu (the tiny model covers aarch64).
#[cfg(not(target_arch = "aarch64"))]
#[test]
fn default_model_fp16_generation_matches_llama_cpp() {
    check_generation(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2.greedy.jsonl",
        Precision::Fp16,
        0.0,
        0.05,
        (2, 3),
    );
}

#[test]
fn fp16_generation_matches_llama_cpp() {
    // The CPU kernels' own tolerance and near-tie.
    check_generation(
        "tiny/qwen3-tiny.gguf",
        "qwen3-tiny.greedy.jsonl",
        Precision::Fp16,
        0.0,
        0.05,
        (4, steps(16)),
    );
}

#[test]
fn int8_generation_matches_llama_cpp() {
    // One int8 scale per token (the NPU's int32 sum allows no finer one) is coarser than the CPU's
    // Q8_0 scale per 32 values: the logits move by up to ~0.7 on this chaotic model (measured), and a
    // token may flip where its margin is below 0.1.
    check_generation(
        "tiny/qwen3-tiny.gguf",
        "qwen3-tiny.greedy.jsonl",
        Precision::Int8,
        0.6,
        0.1,
        (4, steps(16)),
    );
}

#[test]
fn a_whitelist_selects_shapes_and_batches_below_the_threshold_stay_on_the_cpu() {
    let _guard = serial();
    // K = 128, N = 256: ffn_gate and ffn_up of the three layers.
    let list = Whitelist::parse(r#"{"pairs": [{"src0": {"row": 32, "col": 128}, "src1": {"row": 128, "col": 256}, "name": "ffn_up-0"}]}"#)
        .unwrap();
    let config = NpuConfig { mode: NpuMode::List(list), ..emulator_config(Precision::Fp16, 4) };
    let mut s = session("tiny/qwen3-tiny.gguf", Some(config));
    let backend = s.npu().unwrap();
    assert_eq!(backend.plan().matmuls.len(), 6);
    assert!(backend.plan().matmuls.iter().all(|m| (m.k, m.n) == (128, 256)));
    s.eval(&[1, 2, 3]).unwrap(); // 3 tokens: below the threshold of 4
    assert_eq!(s.npu().unwrap().stats().calls, 0);
    s.eval(&[4, 5, 6, 7, 8]).unwrap();
    assert_eq!(s.npu().unwrap().stats().calls, 6);
    s.eval(&[9]).unwrap();
    assert_eq!(s.npu().unwrap().stats().calls, 6, "decode stays on the CPU");
}

/// all-MiniLM-L6-v2 (Q8_0) with every encoder matmul on the emulated NPU (fp16): the 36 projections
/// of its 6 layers are planned, the batches of sentences go through them, and the sentence vectors
/// stay within cosine 0.999 of the float64 reference (the NPU multiplies fp16 inputs by the
/// dequantized weights, closer to the exact product than the CPU's Q8_0 activations).
#[test]
fn an_encoders_matmuls_run_on_the_npu() {
    let _guard = serial();
    // Planning MiniLM's graphs needs more than a test thread's stack (as the server's engine thread).
    std::thread::Builder::new().stack_size(16 << 20).spawn(check_minilm_on_the_npu).unwrap().join().unwrap();
}

fn check_minilm_on_the_npu() {
    let path = format!("{}/tests/golden/embeddings/minilm-reference.json", env!("CARGO_MANIFEST_DIR"));
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // Under qemu the emulator converts every weight on every call: a few sentences there.
    let take = if cfg!(target_arch = "aarch64") { 4 } else { 16 };
    let inputs: Vec<Vec<u32>> = reference["ids"].as_array().unwrap().iter().take(take).map(ids).collect();
    let want: Vec<Vec<f64>> = reference["embeddings"].as_array().unwrap()[..take]
        .iter()
        .map(|v| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect();
    let model = ModelFile::open_static(&model_path("all-MiniLM-L6-v2.Q8_0.gguf"))
        .unwrap_or_else(|e| panic!("{e} (run scripts/setup.sh minilm-q8)"));
    let opts = SessionOptions {
        threads: 2,
        n_batch: 128,
        n_seq: 8,
        npu: emulator_config(Precision::Fp16, 4),
        ..Default::default()
    };
    let mut session = Session::new(model, &opts).unwrap();
    let plan = session.npu().expect("the NPU backend is up").plan();
    assert_eq!(plan.matmuls.len(), 36, "q, k, v, output, up and down of 6 layers: {:?}", plan.skipped);
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let out = pinfer::embed::embed(&mut session, &refs, &pinfer::embed::EmbedOptions::default()).unwrap();
    let stats = session.npu().unwrap().stats();
    assert!(stats.calls >= 36 && stats.disabled == 0, "{stats:?}");
    for (i, want) in want.iter().enumerate() {
        let got = out.row(i, 0).unwrap();
        let dot: f64 = got.iter().zip(want).map(|(&a, &b)| a as f64 * b).sum();
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let cos = dot / (norm(&mut got.iter().map(|&x| x as f64)) * norm(&mut want.iter().copied()));
        eprintln!("sentence {i}: cosine {cos:.7} with every matmul on the NPU");
        assert!(cos >= 0.999, "sentence {i}: cosine {cos} against the float64 reference");
    }
}

// ---- the command line --------------------------------------------------------------------------

/// `pinfer` with `args`, the emulator as its NPU runtime, and `env` set (through qemu-user when the
/// tests themselves run under it, as tests/cli.rs does).
fn pinfer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let exe = env!("CARGO_BIN_EXE_pinfer");
    let mut cmd = if runs_directly() {
        Command::new(exe)
    } else {
        let mut c = Command::new("qemu-aarch64");
        c.args(["-cpu", &std::env::var("PINFER_QEMU_CPU").unwrap_or_else(|_| "cortex-a76".into()), exe]);
        c
    };
    cmd.args(args).env("PINFER_RKNNRT", emulator()).env_remove("RKNN_EMU_FAIL_CREATE");
    for (k, v) in env {
        if v.is_empty() {
            cmd.env_remove(k);
        } else {
            cmd.env(k, v);
        }
    }
    cmd.output().unwrap()
}

/// Whether the binary can be executed directly (not when these tests run under qemu-user).
fn runs_directly() -> bool {
    static DIRECT: OnceLock<bool> = OnceLock::new();
    *DIRECT.get_or_init(|| match Command::new(env!("CARGO_BIN_EXE_pinfer")).arg("--version").output() {
        Ok(out) => !(out.status.code() == Some(127) && out.stdout.is_empty()),
        Err(e) => e.raw_os_error() != Some(8),
    })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const PROMPT: &str = "1, 2, 3, 4, 5,";

/// llama.cpp's first 12 greedy tokens for [`PROMPT`], from the goldens of the build whose
/// attention arithmetic the CPU kernel path shares (the same ids in both builds' goldens, at
/// margins of at least 0.33 on x86 and 0.13 on aarch64).
fn golden_ids() -> Vec<u32> {
    let golden = llama_golden::golden_for_path("qwen3-tiny.greedy.jsonl");
    let case = jsonl(&golden).into_iter().find(|c| c["prompt"] == PROMPT).unwrap();
    ids(&case["generated_ids"])[..12].to_vec()
}

fn generate(extra: &[&str], env: &[(&str, &str)]) -> (Vec<u32>, String) {
    let model = model_path("tiny/qwen3-tiny.gguf");
    let mut args = vec!["generate", "-m", model.to_str().unwrap(), "-p", PROMPT, "-n", "12", "--temp", "0"];
    args.extend_from_slice(&["--print-ids", "-t", "2"]);
    args.extend_from_slice(extra);
    let out = pinfer(&args, env);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{args:?}: {stderr}");
    let last = stdout.lines().last().unwrap_or("");
    (last.split_whitespace().map(|t| t.parse().unwrap()).collect(), stderr)
}

fn npu_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("npu")).collect()
}

#[test]
fn cli_generate_on_the_npu_gives_llama_cpp_tokens() {
    // The 14-token prompt reaches the threshold of 8; decode stays on the CPU.
    let (ids, stderr) = generate(&["--npu", "auto", "--npu-min-batch", "8", "-v"], &[]);
    assert_eq!(ids, golden_ids());
    assert!(stderr.contains("npu: 21 matmuls"), "{stderr}");
    assert!(stderr.contains("npu: 21 matmul calls"), "{stderr}");
}

#[test]
fn cli_falls_back_to_the_cpu_with_one_line() {
    let golden = golden_ids();
    // The device fails at context creation.
    let (ids, stderr) =
        generate(&["--npu", "auto", "--npu-min-batch", "8"], &[("RKNN_EMU_FAIL_CREATE", "-3")]);
    assert_eq!(ids, golden);
    let lines = npu_lines(&stderr);
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("RKNN_ERR_DEVICE_UNAVAILABLE") && lines[0].contains("CPU"), "{stderr}");
    // Every run fails after a good set-up: one line per shape (4), then the CPU, same tokens.
    let (ids, stderr) =
        generate(&["--npu", "auto", "--npu-min-batch", "8", "-v"], &[("RKNN_EMU_FAIL_RUN", "-2")]);
    assert_eq!(ids, golden);
    let failed: Vec<&str> =
        npu_lines(&stderr).into_iter().filter(|l| l.contains("rknn_matmul_run failed")).collect();
    assert_eq!(failed.len(), 4, "{stderr}");
    assert!(
        failed.iter().all(|l| l.contains("RKNN_ERR_TIMEOUT") && l.contains("CPU from now on")),
        "{stderr}"
    );
    assert!(stderr.contains("npu: 0 matmul calls in") && stderr.contains("4 shapes fell back"), "{stderr}");
    // The runtime library is missing.
    let (ids, stderr) = generate(&["--npu", "auto"], &[("PINFER_RKNNRT", "/nonexistent/librknnrt.so")]);
    assert_eq!(ids, golden);
    let lines = npu_lines(&stderr);
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("cannot load") && lines[0].contains("CPU"), "{stderr}");
    // Without --npu, a missing runtime is not worth a line.
    let (ids, stderr) = generate(&[], &[("PINFER_RKNNRT", "/nonexistent/librknnrt.so")]);
    assert_eq!(ids, golden);
    assert!(npu_lines(&stderr).is_empty(), "{stderr}");
}

#[test]
fn cli_npu_plan_lists_tensors_and_memory_and_writes_a_whitelist() {
    let model = model_path("tiny/qwen3-tiny.gguf");
    let dir = std::env::temp_dir().join(format!("pinfer-npu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let list = dir.join("whitelist.json");
    let out = pinfer(&["npu-plan", "-m", model.to_str().unwrap(), "-o", list.to_str().unwrap()], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for want in
        ["blk.0.ffn_up.weight", "blk.2.ffn_down.weight", "21 matmuls on the NPU (4 shapes)", "extra memory"]
    {
        assert!(stdout.contains(want), "npu-plan lacks {want:?}:\n{stdout}");
    }
    assert!(stdout.contains("output.weight") && stdout.contains("below the NPU batch"), "{stdout}");
    let written = Whitelist::load(&list).unwrap();
    assert_eq!(written.pairs.len(), 4);
    assert!(written.contains(128, 256) && written.contains(256, 128));
    // Generation with that whitelist does what auto does.
    let (ids, stderr) = generate(&["--npu", list.to_str().unwrap(), "--npu-min-batch", "8", "-v"], &[]);
    assert_eq!(ids, golden_ids());
    assert!(stderr.contains("npu: 21 matmul calls"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_selftest_passes_on_the_emulator_and_fails_without_a_device() {
    let model = model_path("tiny/qwen3-tiny.gguf");
    let m = model.to_str().unwrap();
    for precision in ["fp16", "int8"] {
        let out = pinfer(&["selftest", "--npu", "-m", m, "--npu-precision", precision, "-r", "1"], &[]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{precision}: {stdout}{}", text(&out.stderr));
        assert_eq!(
            stdout.lines().filter(|l| l.ends_with(" ok")).count(),
            8,
            "4 shapes x 2 batch sizes:\n{stdout}"
        );
        assert!(stdout.contains("NPU selftest passed"), "{stdout}");
    }
    let out = pinfer(&["selftest", "--npu", "-m", m], &[("RKNN_EMU_FAIL_CREATE", "-3")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("RKNN_ERR_DEVICE_UNAVAILABLE"));
}

/// A router whose shape the NPU would take (K 128, N 16) stays on the CPU: routing must be exact.
#[test]
fn moe_routers_are_never_offloaded() {
    use pinfer::graph::Graph;
    use pinfer::tensor::Storage;
    let mut g: Box<Graph<64>> = Box::new(Graph::new());
    let ext = |offset| Storage::External { buffer: 0, offset };
    let router = g.leaf("blk.0.ffn_gate_inp.weight", GgmlType::F32, [128, 16, 1, 1], ext(0)).unwrap();
    let dense = g.leaf("blk.0.ffn_up.weight", GgmlType::F32, [128, 16, 1, 1], ext(8192)).unwrap();
    let x = g.leaf("x", GgmlType::F32, [128, 32, 1, 1], ext(16384)).unwrap();
    let logits = g.mul_mat(router, x).unwrap();
    let up = g.mul_mat(dense, x).unwrap();
    g.build(&[logits, up]).unwrap();
    let plan = pinfer::npu::plan(&[&*g], &emulator_config(Precision::Fp16, 16), 32);
    assert_eq!(plan.matmuls.iter().map(|m| m.weight.as_str()).collect::<Vec<_>>(), ["blk.0.ffn_up.weight"]);
    let skipped = plan.skipped.iter().find(|s| s.weight == "blk.0.ffn_gate_inp.weight").unwrap();
    assert!(skipped.reason.contains("MoE router"), "{}", skipped.reason);
}
