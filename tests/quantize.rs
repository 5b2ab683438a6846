//! The q4_K and q6_K reference quantizers: against ggml's C reference, against the `gguf` Python
//! package, and on round-trip error.
//!
//! * ggml: the quantizers follow `quantize_row_q4_K_ref` / `quantize_row_q6_K_ref` operation for
//!   operation. Their output on [`test_input`] was compared with ggml's C code (ggml-quants.c built
//!   with gcc -O2 on x86-64, no FMA) when they were written: 0 of 1088 blocks differed (and 0 of
//!   8020 blocks of Gaussian, Laplace, one-signed, edge-case and real SmolLM2 weights). The FNV-1a
//!   hashes of that output are pinned below, so any change to the bytes is caught.
//! * gguf-py 0.19.0 can dequantize Q4_K and Q6_K but not quantize them (`NotImplementedError`). So
//!   its dequantizer reads our blocks back (an independent reader of the layout: must equal ours to
//!   the bit); should a later gguf quantize them, the bytes are compared too and the mismatch rate
//!   reported (at most 1% of blocks may differ: numpy may sum in another order).
//! * Round trip: error well under the uniform-rounding estimate of the plain min/max grid, and under
//!   ggml's test-quantize-fns budget.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use pinfer::loader::ModelFile;
use pinfer::quant::quantize::{
    quantize_row_q4_1_ref, quantize_row_q4_k_ref, quantize_row_q6_k_ref, quantize_row_q8_0_ref,
    quantize_row_ref,
};
use pinfer::quant::{blocks_of_mut, dequantize_row_ref, GgmlType, QK_K};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Deterministic input without any libm call (so it is the same on every platform): 1024
/// super-blocks of sums of four uniforms from an LCG (roughly Gaussian) at magnitudes from 1e-4 to
/// 1e2, some shifted to one sign, one with a large outlier; then 64 special super-blocks (zeros,
/// -0.0, constants, integers, a zero sub-block, groups of equal values, near-denormal values).
fn test_input() -> Vec<f32> {
    let mut state = 0x2545_f491_u32;
    let mut uniform = move || {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    };
    let mut x = Vec::with_capacity(1088 * QK_K);
    for b in 0..1024 {
        let magnitude = [1e-4f32, 1e-2, 0.05, 0.3, 1.0, 7.0, 100.0][b % 7];
        let shift = match b % 5 {
            0 => 1.5 * magnitude,
            1 => -1.5 * magnitude,
            _ => 0.0,
        };
        for i in 0..QK_K {
            let g = uniform() + uniform() + uniform() + uniform();
            let mut v = g * magnitude + shift;
            if b % 11 == 3 && i == (b * 7) % QK_K {
                v = 40.0 * magnitude;
            }
            x.push(v);
        }
    }
    for b in 0..64 {
        for i in 0..QK_K {
            let u = uniform();
            x.push(match b % 8 {
                0 => 0.0,
                1 => -0.0,
                2 => 0.37,
                3 => (u * 8.0).round(),
                4 if i < 32 => 0.0,
                5 => ((i / 16) as f32 - 7.5) * 0.01,
                6 => u * 1e-30,
                _ => u,
            });
        }
    }
    x
}

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / ty.block_len() * ty.block_bytes()];
    quantize_row_ref(ty, x, &mut out).unwrap();
    out
}

fn dequantized(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize_row_ref(ty, q, &mut y).unwrap();
    y
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[test]
fn k_quants_are_byte_identical_to_ggml() {
    let x = test_input();
    let q4 = quantized(GgmlType::Q4_K, &x);
    let q6 = quantized(GgmlType::Q6_K, &x);
    assert_eq!(fnv1a64(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()), INPUT_HASH, "input");
    assert_eq!(fnv1a64(&q4), GGML_Q4_K_HASH, "q4_K bytes differ from ggml's");
    assert_eq!(fnv1a64(&q6), GGML_Q6_K_HASH, "q6_K bytes differ from ggml's");
}

/// FNV-1a of [`test_input`] as little-endian f32 (1088 super-blocks).
const INPUT_HASH: u64 = 0xb963_540a_a53b_d33f;
/// FNV-1a of ggml's `quantize_row_q4_K_ref` output on it (1088 * 144 bytes).
const GGML_Q4_K_HASH: u64 = 0x194f_39ab_4bfd_cd43;
/// FNV-1a of ggml's `quantize_row_q6_K_ref` output on it (1088 * 210 bytes).
const GGML_Q6_K_HASH: u64 = 0xc49a_c507_96e8_7c6c;

/// The first `rows` rows of a real weight matrix of the default model, dequantized.
fn model_rows(name: &str, rows: usize) -> Vec<f32> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(MODEL);
    let model =
        ModelFile::open(&path).unwrap_or_else(|e| panic!("{e} (fetch it with scripts/setup.sh model)"));
    let gguf = model.parse().unwrap();
    let t = gguf.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
    let n = t.ne[0] as usize * rows;
    let bytes = &gguf.tensor_data(&t)[..rows * t.row_bytes() as usize];
    dequantized(t.ty, bytes, n)
}

#[test]
fn gguf_py_reads_our_k_quants_back_identically() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kquant_numpy-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let mut x = test_input();
    x.extend(model_rows("blk.0.ffn_down.weight", 64));
    x.extend(model_rows("blk.3.ffn_gate.weight", 64)[..64 * 512].iter());
    assert_eq!(x.len() % QK_K, 0);
    fs::write(dir.join("in.f32"), x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()).unwrap();
    let types = [GgmlType::Q4_K, GgmlType::Q6_K];
    let ours: Vec<Vec<u8>> = types.iter().map(|&ty| quantized(ty, &x)).collect();
    for (ty, q) in types.iter().zip(&ours) {
        fs::write(dir.join(format!("{ty}.q")), q).unwrap();
    }

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
    let out =
        Command::new(&python).arg(root.join("scripts/kquant_numpy.py")).arg(&dir).output().unwrap_or_else(
            |e| panic!("cannot start {python:?}: {e} (scripts/setup.sh installs it with gguf)"),
        );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "scripts/kquant_numpy.py failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{stdout}");

    for (ty, q) in types.iter().zip(&ours) {
        let mine = dequantized(*ty, q, x.len());
        let numpy: Vec<f32> = fs::read(dir.join(format!("{ty}.deq.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(numpy.len(), mine.len());
        let bad = mine.iter().zip(&numpy).filter(|(a, b)| a.to_bits() != b.to_bits() && a != b).count();
        assert_eq!(bad, 0, "{ty}: gguf-py dequantizes {bad} of our elements differently");

        let theirs = dir.join(format!("{ty}.numpy.q"));
        if theirs.exists() {
            let theirs = fs::read(theirs).unwrap();
            let bb = ty.block_bytes();
            let differing = q.chunks_exact(bb).zip(theirs.chunks_exact(bb)).filter(|(a, b)| a != b).count();
            let blocks = q.len() / bb;
            println!("{ty}: {differing} of {blocks} blocks differ from gguf-py's quantizer");
            assert!(differing * 100 <= blocks, "{ty}: {differing} of {blocks} blocks differ from gguf-py");
        } else {
            println!("{ty}: gguf-py cannot quantize it; layout checked through its dequantizer only");
        }
    }
    let _ = fs::remove_dir_all(&dir);
}

/// sqrt(mean (x - y)²).
fn rmse(x: &[f32], y: &[f32]) -> f64 {
    let sum: f64 = x.iter().zip(y).map(|(&a, &b)| f64::from(a - b) * f64::from(a - b)).sum();
    (sum / x.len() as f64).sqrt()
}

/// Round-trip RMSE of q4_K and q6_K on real (Q8_0) weights and on ggml's synthetic test vector:
/// * below the uniform-rounding estimate `step / sqrt(12)` of the plain grid over each group's
///   range (range / 15 per 32 for q4_K, 2 max|x| / 63 per 16 for q6_K), thanks to the searched scales;
/// * q4_K below q4_1 (same 4.5-5 bits, but fitted scales), q6_K between q4_K and q8_0;
/// * ggml's test-quantize-fns metric (sqrt(sum of squares) / n) under its budget of 0.002.
#[test]
fn k_quant_round_trip_error_beats_the_plain_grid() {
    let synthetic: Vec<f32> =
        (0..32 * 128).map(|i| (0.1 + 2.0 * f64::from((i as f32).cos())) as f32).collect();
    // The Q8_0 embedding (the model's Q4_1 matrices would requantize to Q4_1 losslessly).
    let real = model_rows("token_embd.weight", 128);
    for (name, x) in [("synthetic", &synthetic), ("token_embd", &real)] {
        let err = |ty| rmse(x, &dequantized(ty, &quantized(ty, x), x.len()));
        let (q4k, q6k, q41, q80) =
            (err(GgmlType::Q4_K), err(GgmlType::Q6_K), err(GgmlType::Q4_1), err(GgmlType::Q8_0));
        let uniform = |group: usize, levels: f64, signed: bool| {
            let sq: f64 = x
                .chunks(group)
                .map(|g| {
                    let (lo, hi) = g.iter().fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                    let range = if signed { 2.0 * f64::from(hi.max(-lo)) } else { f64::from(hi - lo) };
                    (range / levels).powi(2) / 12.0
                })
                .sum();
            (sq / x.chunks(group).count() as f64).sqrt()
        };
        let (u4, u6) = (uniform(32, 15.0, false), uniform(16, 63.0, true));
        println!(
            "{name}: RMSE q4_K {q4k:.3e} (plain grid {u4:.3e}, q4_1 {q41:.3e}), \
             q6_K {q6k:.3e} (plain grid {u6:.3e}, q8_0 {q80:.3e})"
        );
        assert!(q4k < u4 && q4k < q41, "{name}: q4_K RMSE {q4k} vs plain {u4}, q4_1 {q41}");
        assert!(q6k < u6 && q6k < q4k && q6k > q80, "{name}: q6_K RMSE {q6k} vs plain {u6}");
        let ggml_metric = |r: f64| r * (x.len() as f64).sqrt() / x.len() as f64;
        assert!(ggml_metric(q4k) < 0.002 && ggml_metric(q6k) < 0.002);
    }
}

/// The typed entry points and the byte dispatch agree, and all quantized types share one contract.
#[test]
fn typed_and_dispatched_quantizers_agree() {
    let x = test_input();
    let x = &x[..8 * QK_K];
    let mut q4 = vec![0u8; 8 * 144];
    quantize_row_q4_k_ref(x, blocks_of_mut(&mut q4).unwrap());
    assert_eq!(q4, quantized(GgmlType::Q4_K, x));
    let mut q6 = vec![0u8; 8 * 210];
    quantize_row_q6_k_ref(x, blocks_of_mut(&mut q6).unwrap());
    assert_eq!(q6, quantized(GgmlType::Q6_K, x));
    let mut q41 = vec![0u8; 64 * 20];
    quantize_row_q4_1_ref(x, blocks_of_mut(&mut q41).unwrap());
    assert_eq!(q41, quantized(GgmlType::Q4_1, x));
    let mut q8 = vec![0u8; 64 * 34];
    quantize_row_q8_0_ref(x, blocks_of_mut(&mut q8).unwrap());
    assert_eq!(q8, quantized(GgmlType::Q8_0, x));
}
