//! The repacked-weight cache (`pinfer repack`): a cache generates the same tokens with bit-equal
//! logits as its original, and caches for another layout version or CPU, damaged or truncated
//! ones, and `--no-repack` on a cache are refused with a message (never a panic).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use pinfer::gguf::Gguf;
use pinfer::kernels::packed::LAYOUT_VERSION;
use pinfer::loader::ModelFile;
use pinfer::repack_cache::{write_cache, ARCH, KEY_ARCH, KEY_LAYOUT};
use pinfer::session::{Session, SessionOptions};

fn model_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pinfer-repack-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A file removed when dropped (mappings of it stay valid).
struct Temp(PathBuf);

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl AsRef<Path> for Temp {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl std::ops::Deref for Temp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

/// Writes the cache of `model` into the temp dir under `name`.
fn cache_of(model: &str, name: &str) -> Temp {
    let src = model_path(model);
    assert!(src.exists(), "{} missing: run scripts/setup.sh model", src.display());
    let out = temp_dir().join(name);
    let report =
        write_cache(&src, &out, 2, &AtomicBool::new(false)).unwrap_or_else(|e| panic!("{model}: {e}"));
    assert!(report.tensors > 0, "{model}: nothing repacked");
    assert!(!temp_dir().join(format!("{name}.tmp")).exists(), "the temporary file is renamed");
    Temp(out)
}

fn options(repack: bool) -> SessionOptions {
    SessionOptions { threads: 2, n_ctx: 128, repack, ..Default::default() }
}

fn session(path: &Path) -> Result<Session, String> {
    let model = ModelFile::open_static(path).map_err(|e| e.to_string())?;
    Session::new(model, &options(true)).map_err(|e| e.to_string())
}

fn argmax(logits: &[f32]) -> u32 {
    logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best }) as u32
}

/// Greedy ids and the logits of every step.
fn greedy(session: &mut Session, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut logits = session.eval(prompt).unwrap().to_vec();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for _ in 0..n {
        all.push(logits.iter().map(|v| v.to_bits()).collect());
        let id = argmax(&logits);
        ids.push(id);
        logits = session.eval(&[id]).unwrap().to_vec();
    }
    (ids, all)
}

/// The cache of `model` loads without repacking and gives the original's tokens and logits, bit
/// for bit (same kernels on the same packed bytes).
fn same_tokens(model: &str, tied: bool) {
    let cache = cache_of(model, &format!("{model}.cache.gguf").replace('/', "_"));
    let mut original = session(&model_path(model)).unwrap();
    let mut cached = session(&cache).unwrap_or_else(|e| panic!("{e}"));
    assert!(cached.from_cache() && !original.from_cache());
    let ((n0, b0, _), (n1, b1, s1)) = (original.repacked(), cached.repacked());
    assert_eq!((n0, b0), (n1, b1), "{model}: the same matrices, the same bytes");
    assert_eq!(s1, 0.0, "nothing repacked at load");
    assert_eq!(original.gguf().tensor("output.weight").is_none(), tied, "{model}: tied embedding");
    // A tied embedding whose repacked copy holds the file's values is stored once, repacked (the
    // output matmul and get_rows read it); another gets a repacked output.weight beside it.
    let embd = original.gguf().tensor("token_embd.weight").unwrap();
    let shared = tied && embd.ty.traits().rows_from_packed;
    let out = cached.gguf().tensor("output.weight").is_some();
    assert_eq!(out, !shared, "{model}: an output.weight in the cache");
    let prompt = [1u32, 504, 1797, 1918, 553];
    let (ids0, logits0) = greedy(&mut original, &prompt, 8);
    let (ids1, logits1) = greedy(&mut cached, &prompt, 8);
    assert_eq!(ids0, ids1, "{model}: greedy tokens");
    for (step, (a, b)) in logits0.iter().zip(&logits1).enumerate() {
        assert!(a == b, "{model}: logits of step {step} differ");
    }
}

#[test]
fn smollm2_cache_gives_the_same_tokens_and_logits() {
    same_tokens("SmolLM2-135M-Instruct.Q4_1.gguf", true);
}

#[test]
fn qwen3_tiny_cache_gives_the_same_tokens_and_logits() {
    same_tokens("tiny/qwen3-tiny.gguf", false);
}

#[test]
fn llama_untied_q5_cache_gives_the_same_tokens_and_logits() {
    same_tokens("tiny/llama-untied-q5.gguf", false);
}

#[test]
fn qwen3moe_tiny_cache_gives_the_same_tokens_and_logits() {
    // Expert tensors: one packed matrix of m * n_expert rows each, read slab by slab.
    same_tokens("tiny/qwen3moe-tiny.gguf", false);
}

/// `bytes` with the first occurrence of `from` (which must exist) replaced by `to` (same length).
fn replaced(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = bytes.windows(from.len()).position(|w| w == from).expect("pattern in the file");
    let mut out = bytes.to_vec();
    out[at..at + from.len()].copy_from_slice(to);
    out
}

#[test]
fn caches_for_another_layout_or_cpu_are_refused() {
    let cache = cache_of("tiny/qwen3-tiny.gguf", "qwen3-tampered.cache.gguf");
    let bytes = std::fs::read(&cache).unwrap();
    // The key, its type tag (u32 = 4) and the value.
    let key = |k: &str| {
        let mut v = (k.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(k.as_bytes());
        v
    };
    let mut layout = key(KEY_LAYOUT);
    layout.extend_from_slice(&4u32.to_le_bytes());
    let mut other_layout = layout.clone();
    layout.extend_from_slice(&LAYOUT_VERSION.to_le_bytes());
    other_layout.extend_from_slice(&(LAYOUT_VERSION + 1).to_le_bytes());
    let other_arch = "z".repeat(ARCH.len());
    let mut arch = key(KEY_ARCH);
    arch.extend_from_slice(&8u32.to_le_bytes());
    arch.extend_from_slice(&(ARCH.len() as u64).to_le_bytes());
    let mut wrong_arch = arch.clone();
    arch.extend_from_slice(ARCH.as_bytes());
    wrong_arch.extend_from_slice(other_arch.as_bytes());

    let cases = [
        (
            "layout",
            replaced(&bytes, &layout, &other_layout),
            format!("layout {} on {ARCH}", LAYOUT_VERSION + 1),
        ),
        ("arch", replaced(&bytes, &arch, &wrong_arch), format!("layout {LAYOUT_VERSION} on {other_arch}")),
    ];
    for (what, tampered, says) in cases {
        let path = Temp(temp_dir().join(format!("qwen3-other-{what}.cache.gguf")));
        std::fs::write(&path, &tampered).unwrap();
        let err = session(&path).err().unwrap_or_else(|| panic!("a cache with another {what} loaded"));
        assert!(err.contains("is a pinfer repack cache for") && err.contains(&says), "{what}: {err}");
        assert!(
            err.contains(&format!("this pinfer uses layout {LAYOUT_VERSION} on {ARCH}"))
                && err.contains("run `pinfer repack ORIGINAL.gguf"),
            "{what}: {err}"
        );
    }
}

#[test]
fn no_repack_on_a_cache_is_refused() {
    let cache = cache_of("tiny/qwen3-tiny.gguf", "qwen3-norepack.cache.gguf");
    let model = ModelFile::open_static(&cache).unwrap();
    let err =
        Session::new(model, &options(false)).err().expect("--no-repack on a cache must fail").to_string();
    assert!(err.contains("repack cache") && err.contains("--no-repack") && err.contains("original"), "{err}");
}

/// Truncated anywhere, a cache is an error: in the header, in the data (the parser), and inside the
/// planes of the last tensor past the size its type and shape give (the cache's own check, for a
/// layout wider than its file type; today's layouts are all as tight as the file, so that cut only
/// runs if one is not).
#[test]
fn truncated_caches_are_refused_not_a_panic() {
    let cache = cache_of("tiny/llama-untied-q5.gguf", "llama-truncated.cache.gguf");
    let bytes = std::fs::read(&cache).unwrap();
    let gguf = Gguf::parse(&bytes).unwrap();
    let last = gguf.tensors().last().unwrap();
    let name = last.name.to_string();
    let end_of_info = gguf.data_start() + (last.offset + last.nbytes) as usize;
    let mut cuts = vec![100, bytes.len() / 2, bytes.len() - 1];
    if end_of_info < bytes.len() {
        cuts.push(end_of_info);
    }
    for cut in cuts {
        let path = Temp(temp_dir().join(format!("llama-cut-{cut}.cache.gguf")));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = session(&path).err().unwrap_or_else(|| panic!("a cache cut at {cut} loaded"));
        assert!(err.contains(path.to_str().unwrap()), "cut at {cut}: {err}");
        if cut > 100 {
            assert!(err.contains("truncated"), "cut at {cut}: {err}");
        }
        if cut >= end_of_info {
            assert!(err.contains(&name) && err.contains("repacked planes"), "cut at {cut}: {err}");
            eprintln!("cut at {cut}: {err}");
        }
    }
}

#[test]
fn repack_refuses_its_input_as_output_and_a_cache_as_input() {
    let src = model_path("tiny/qwen3-tiny.gguf");
    let err =
        write_cache(&src, &src, 1, &AtomicBool::new(false)).expect_err("IN == OUT must fail").to_string();
    assert!(err.contains("the same file"), "{err}");
    let cache = cache_of("tiny/qwen3-tiny.gguf", "qwen3-input.cache.gguf");
    let again = Temp(temp_dir().join("again.gguf"));
    let err =
        write_cache(&cache, &again, 1, &AtomicBool::new(false)).expect_err("a cache as input").to_string();
    assert!(err.contains("already a pinfer repack cache"), "{err}");
}
