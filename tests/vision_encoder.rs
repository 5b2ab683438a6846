//! The vision encoder as a batch workload (tiny VLMs of scripts/make_tiny_vlm.py): its memory in
//! the session's memory plan, planned at the largest input the projector takes; with feature
//! `npu`, its qualifying matmuls on the CPU emulator of librknnrt.so (rknn-sys) through the same
//! backend as the language model's, whitelists, and the fallback when the runtime is missing.
//! Runs on x86 and under qemu-aarch64.

use std::path::PathBuf;

use pinfer::engine::vision::VisionPlanned;
use pinfer::image::{decode, preprocess, ImageLimits};
use pinfer::loader::ModelFile;
use pinfer::media::projector_memory;
use pinfer::session::{Session, SessionError, SessionOptions};

/// The families whose images pinfer encodes.
const FAMILIES: [&str; 5] = ["gemma3", "idefics3", "qwen2vl", "qwen2.5vl", "lfm2"];

#[path = "common/vision_images.rs"]
mod vision_images;
use vision_images::IMAGES;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn vlm(family: &str, file: &str) -> PathBuf {
    let path = root().join("models/tiny-vlm").join(family).join(file);
    assert!(path.exists(), "{}: run scripts/setup.sh tiny-vlm", path.display());
    path
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(root().join("tests/vision/images").join(name)).unwrap()
}

fn options() -> SessionOptions {
    SessionOptions { n_ctx: 512, embeddings_input: true, threads: 2, ..SessionOptions::default() }
}

fn try_session(family: &str, opts: &SessionOptions) -> Result<Session, Box<SessionError>> {
    Session::new(ModelFile::open_static(&vlm(family, "model.gguf")).unwrap(), opts).map_err(Box::new)
}

fn session(family: &str, opts: &SessionOptions) -> Session {
    try_session(family, opts).unwrap()
}

#[test]
fn the_memory_plan_holds_the_projector_at_its_largest_input() {
    for family in FAMILIES {
        let mmproj = vlm(family, "mmproj.gguf");
        let memory = projector_memory(&mmproj).unwrap();
        let bytes = std::fs::read(&mmproj).unwrap();
        let mut slot = pinfer::engine::heap::slots(1).unwrap();
        let largest = VisionPlanned::largest(&bytes, &mut slot[0]).unwrap();
        let vp = *largest.params();
        let (w, h) = vp.largest_input();
        assert_eq!(memory.input, (w as usize, h as usize), "{family}");
        assert_eq!(memory.arena, largest.bytes_needed(), "{family}");
        assert_eq!(memory.mapped, bytes.len(), "{family}");
        assert_eq!(memory.repacked, largest.packing().unwrap().bytes(), "{family}");
        assert!(memory.graphs > 0, "{family}: {memory:?}");
        drop(largest);
        // Every test image's encoder inputs fit the plan.
        for name in IMAGES {
            let rgb = decode(&image(name), ImageLimits::default()).unwrap();
            for input in preprocess(&rgb, &vp).unwrap().images {
                let (iw, ih) = (input.width as usize, input.height as usize);
                assert!(u64::from(input.width) * u64::from(input.height) <= u64::from(w) * u64::from(h));
                let planned = VisionPlanned::new(&bytes, &mut slot[0], iw, ih).unwrap();
                assert!(
                    planned.bytes_needed() <= memory.arena,
                    "{family} {name}: {iw}x{ih} needs {} bytes, the plan at {w}x{h} {}",
                    planned.bytes_needed(),
                    memory.arena
                );
            }
        }
    }
    // Qwen2-VL's dynamic sizes: 4096 merged tokens of 28 px at most, the squarest of them.
    let memory = projector_memory(&vlm("qwen2vl", "mmproj.gguf")).unwrap();
    assert_eq!(memory.input, (64 * 28, 64 * 28));

    // The session counts it, prints it, and refuses to load past the limit because of it.
    let memory = projector_memory(&vlm("gemma3", "mmproj.gguf")).unwrap();
    let without = session("gemma3", &options()).memory_plan();
    let opts = SessionOptions { projector: Some(memory), ..options() };
    let plan = session("gemma3", &opts).memory_plan();
    assert_eq!(plan.projector, Some(memory));
    assert_eq!(plan.total(), without.total() + memory.total());
    let text = plan.to_string();
    assert!(text.contains("+ projector") && text.contains("at 112x112 px"), "{text}");
    let limit = without.total() + memory.total() / 2;
    match try_session("gemma3", &SessionOptions { memory_limit: Some(limit), ..opts }).map_err(|e| *e) {
        Err(SessionError::OverMemory { plan: p, .. }) => assert_eq!(p.projector, Some(memory)),
        Err(e) => panic!("expected OverMemory, got {e}"),
        Ok(_) => panic!("loaded past the memory limit"),
    }
    assert!(try_session("gemma3", &SessionOptions { memory_limit: Some(limit), ..options() }).is_ok());
}

#[cfg(feature = "npu")]
mod npu {
    use std::path::Path;
    use std::sync::Arc;

    use pinfer::media::{EncodedImage, Projector};
    use pinfer::npu::{NpuConfig, NpuMode, Whitelist, WhitelistPair};

    use super::*;

    /// The emulator built by rknn-sys (a librknnrt.so for this target).
    fn emulator() -> &'static Path {
        Path::new(env!("PINFER_RKNN_EMULATOR"))
    }

    /// The images the NPU tests encode: a wide one (more tokens than one NPU batch for the
    /// dynamic families), a small PNG and a JPEG; under qemu (minutes per image in a debug build)
    /// the two small ones only.
    const NPU_IMAGES: &[&str] = if cfg!(target_arch = "aarch64") {
        &["rgba_41x29.png", "progressive_64x48.jpg"]
    } else {
        &["rgb_3000x200.png", "rgba_41x29.png", "progressive_64x48.jpg"]
    };

    /// Encodes the NPU tests' images with `family`'s projector opened beside `session`.
    fn encode_all(family: &str, session: &Session) -> (Projector, Vec<Arc<EncodedImage>>) {
        let mut projector = Projector::open(&vlm(family, "mmproj.gguf"), session).unwrap();
        let images = NPU_IMAGES
            .iter()
            .map(|name| {
                projector
                    .encode(&image(name), session.runner())
                    .unwrap_or_else(|e| panic!("{family} {name}: {e}"))
            })
            .collect();
        (projector, images)
    }

    /// In-process tests share the emulator's global state: one at a time.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_npu(mode: NpuMode, library: &Path) -> SessionOptions {
        let npu = NpuConfig { mode, library: Some(library.to_path_buf()), ..NpuConfig::default() };
        SessionOptions { npu, ..options() }
    }

    /// Largest relative distance |a - b| / |b| between two images' embedding vectors.
    fn worst(a: &[Arc<EncodedImage>], b: &[Arc<EncodedImage>], width: usize) -> f64 {
        let mut worst = 0f64;
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.inputs.len(), y.inputs.len());
            for (p, q) in x.inputs.iter().zip(&y.inputs) {
                assert_eq!(p.len(), q.len());
                for (u, v) in p.chunks(width).zip(q.chunks(width)) {
                    let d: f64 = u.iter().zip(v).map(|(&s, &t)| f64::from(s - t).powi(2)).sum();
                    let n: f64 = v.iter().map(|&t| f64::from(t).powi(2)).sum();
                    worst = worst.max((d / n.max(1e-30)).sqrt());
                }
            }
        }
        worst
    }

    /// Tolerance per embedding vector (|a - b| / |b|), argued: the offloaded matrices are F16
    /// (the tiny projectors' 2-D weights), so the NPU's weights are the file's; its inputs are
    /// rounded to f16 where the CPU keeps some in f32, an error of at most u·Σ|w·x| per product
    /// (u = 2^-11 ≈ 4.9e-4), then f32 sums in another order. Two layers, whose norms rescale
    /// rather than grow it, keep it near u: measured 2.0e-5 (gemma3: 2 matrices), 2.3e-4
    /// (idefics3), 4.3e-4 (qwen2vl), 3.5e-4 (qwen2.5vl) on x86. 4u = 2e-3 still catches a
    /// wrong column, row, K segment, bucket or token chunk (those give O(1) errors).
    const TOLERANCE: f64 = 2e-3;

    #[test]
    fn the_encoder_on_the_emulated_npu_gives_the_cpu_embeddings() {
        let _serial = serial();
        for family in FAMILIES {
            let cpu = session(family, &options());
            let (_, want) = encode_all(family, &cpu);
            let npu = session(family, &with_npu(NpuMode::Auto, emulator()));
            let (projector, got) = encode_all(family, &npu);
            let backend = projector.npu().unwrap_or_else(|| panic!("{family}: no encoder backend"));
            let stats = backend.stats();
            assert!(stats.matmuls > 0 && stats.calls > 0, "{family}: {stats:?}");
            // Every planned matrix is a 2-D weight of the projector's file, aligned.
            for m in &backend.plan().matmuls {
                assert!(m.k % 32 == 0 && m.n % 16 == 0 && m.weight.starts_with(['v', 'm']), "{m:?}");
            }
            let width = projector.params().n_embd_out as usize;
            let d = worst(&got, &want, width);
            eprintln!(
                "{family}: {} encoder matmuls, {} calls on the NPU; worst {d:.2e}",
                stats.matmuls, stats.calls
            );
            assert!(d <= TOLERANCE, "{family}: NPU embeddings {d:.2e} from the CPU's");
        }
    }

    #[test]
    fn a_whitelist_decides_which_encoder_matmuls_go() {
        let _serial = serial();
        let family = "qwen2vl";
        let all = session(family, &with_npu(NpuMode::Auto, emulator()));
        let (projector, want) = encode_all(family, &all);
        let plan = projector.npu().unwrap().plan().clone();
        assert!(plan.shapes().len() > 1, "{plan}");
        // One of the encoder's shapes: only its matrices go.
        let (k, n) = plan.shapes()[0];
        let one = Whitelist { pairs: vec![WhitelistPair { m: 64, k, n, name: "one".into() }] };
        let s = session(family, &with_npu(NpuMode::List(one), emulator()));
        let (projector, got) = encode_all(family, &s);
        let backend = projector.npu().unwrap();
        assert!(backend.plan().matmuls.iter().all(|m| (m.k, m.n) == (k, n)), "{}", backend.plan());
        assert_eq!(backend.stats().shapes, 1);
        assert!(backend.stats().calls > 0);
        assert!(worst(&got, &want, projector.params().n_embd_out as usize) <= TOLERANCE);
        // A whitelist of none of its shapes: nothing goes, the CPU's embeddings exactly.
        let none = Whitelist { pairs: vec![WhitelistPair { m: 64, k: 4096, n: 4096, name: "x".into() }] };
        let s = session(family, &with_npu(NpuMode::List(none), emulator()));
        let (projector, got) = encode_all(family, &s);
        assert!(projector.npu().is_none());
        let cpu = session(family, &options());
        let (_, exact) = encode_all(family, &cpu);
        assert_eq!(got, exact);
    }

    #[test]
    fn a_missing_runtime_leaves_the_encoder_on_the_cpu() {
        let _serial = serial();
        let family = "gemma3";
        let missing = Path::new("/nonexistent/librknnrt.so");
        let s = session(family, &with_npu(NpuMode::Auto, missing));
        assert!(s.npu().is_none());
        let (projector, got) = encode_all(family, &s);
        assert!(projector.npu().is_none());
        let (_, want) = encode_all(family, &session(family, &options()));
        assert_eq!(got, want);
    }

    fn pinfer(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
        let exe = env!("CARGO_BIN_EXE_pinfer");
        let direct =
            std::process::Command::new(exe).arg("--version").output().is_ok_and(|o| o.status.success());
        let mut cmd = if direct {
            std::process::Command::new(exe)
        } else {
            let mut c = std::process::Command::new("qemu-aarch64");
            c.args(["-cpu", &std::env::var("PINFER_QEMU_CPU").unwrap_or_else(|_| "cortex-a76".into()), exe]);
            c
        };
        cmd.args(args).env("PINFER_RKNNRT", emulator()).env_remove("RKNN_EMU_FAIL_CREATE");
        cmd.envs(env.iter().copied());
        cmd.output().unwrap()
    }

    #[test]
    fn cli_generate_reports_the_encoder_on_the_npu_and_falls_back_with_one_line() {
        let (model, mmproj) = (vlm("gemma3", "model.gguf"), vlm("gemma3", "mmproj.gguf"));
        let img = root().join("tests/vision/images/rgba_41x29.png");
        let args = [
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--mmproj",
            mmproj.to_str().unwrap(),
            "--image",
            img.to_str().unwrap(),
            "-p",
            "Describe.",
            "-n",
            "4",
            "--temp",
            "0",
            "-t",
            "2",
            "--npu",
            "auto",
            "-v",
        ];
        let out = pinfer(&args, &[]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{stderr}");
        let line = stderr.lines().find(|l| l.contains("npu: encoder:")).unwrap_or_else(|| panic!("{stderr}"));
        let count = |what: &str| -> u64 {
            let at = line.find(what).unwrap_or_else(|| panic!("{line}"));
            line[..at].split_whitespace().last().unwrap().parse().unwrap()
        };
        assert!(count(" matmuls (") > 0 && count(" matmul calls") > 0, "{line}");
        assert!(stderr.contains("+ projector"), "{stderr}");
        // The runtime missing: the same text as the CPU's, one line for model and encoder.
        let missing = pinfer(&args, &[("PINFER_RKNNRT", "/nonexistent/librknnrt.so")]);
        let stderr = String::from_utf8_lossy(&missing.stderr);
        assert!(missing.status.success(), "{stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("pinfer: npu")).collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(lines[0].contains("cannot load") && lines[0].contains("CPU"), "{stderr}");
        let cpu = pinfer(&args[..args.len() - 3], &[]);
        assert_eq!(String::from_utf8_lossy(&missing.stdout), String::from_utf8_lossy(&cpu.stdout));
        // (Greedy text with the encoder on the NPU: the embeddings are within 1e-4 of the CPU's,
        // far inside this tiny model's margins.)
        assert_eq!(stdout, String::from_utf8_lossy(&cpu.stdout));
    }
}
