//! pinfer's reference dequantizers and quantizers against the `gguf` Python package's numpy code
//! (scripts/quant_reference.py writes the reference data), plus ggml's round-trip error budgets.
//!
//! Tolerances:
//! * Dequantization: 0 ULP (`a == b`, with -0.0 == +0.0). Both sides perform the same f32 operations in
//!   the same order (f16 -> f32 is exact; then e.g. `(d * sc) * q - dmin * m`), and neither fuses
//!   multiply-adds, so any difference is a bug, not rounding.
//! * Quantization: byte-identical, except the one documented numpy-vs-ggml difference: for a q4_0 (and q5_0)
//!   block whose elements are all zero and whose first element is -0.0, numpy takes `max = x[0] = -0.0`
//!   and stores `d = -0.0 / -8 = +0.0` (f16 bits 0x0000) where ggml's C reference (and pinfer) start from
//!   `max = 0.0` and store `d = -0.0` (0x8000). Both decode to zeros. Rounding ties agree: numpy's q8_0
//!   reproduces C's `roundf`, and q4_0/q4_1 truncate `x + 8.5` / `x + 0.5` in f32 like C.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use pinfer::quant::blocks::*;
use pinfer::quant::dequant::*;
use pinfer::quant::quantize::*;
use pinfer::quant::{blocks_of, blocks_of_mut, GgmlType};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Allowed ULP distance between our dequantization and numpy's (see the module docs).
const DEQUANT_MAX_ULP: u32 = 0;
/// At most this many mismatches are printed per case.
const SHOWN: usize = 8;

/// Every case the script must produce; a missing one is a failure, not a silent pass.
const EXPECTED_CASES: [&str; 22] = [
    "f16",
    "bf16",
    "f32",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q8_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "q8_k",
    "model_q4_1",
    "model_q8_0",
    "quant_q4_0",
    "quant_q4_1",
    "quant_q5_0",
    "quant_q5_1",
    "quant_q8_0",
];

fn type_named(name: &str) -> GgmlType {
    (0..64).filter_map(GgmlType::from_u32).find(|t| t.name() == name).unwrap_or_else(|| panic!("type {name}"))
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Distance in representable f32 steps; +0 and -0 are the same point.
fn ulps(a: f32, b: f32) -> u32 {
    if a.is_nan() || b.is_nan() {
        return if a.is_nan() && b.is_nan() { 0 } else { u32::MAX };
    }
    let key = |v: f32| {
        let bits = v.to_bits() as i64;
        if bits & 0x8000_0000 != 0 {
            -(bits & 0x7fff_ffff)
        } else {
            bits
        }
    };
    (key(a) - key(b)).unsigned_abs().min(u32::MAX as u64) as u32
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs the reference script into a fresh directory.
fn generate(dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = root.join(MODEL);
    assert!(
        model.is_file(),
        "{} is missing: fetch it with `scripts/setup.sh model` (from {})",
        model.display(),
        root.display()
    );
    let _ = fs::remove_dir_all(dir);
    // The interpreter scripts/setup.sh installed numpy and gguf for (it honours $PYTHON too).
    let python = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(&python)
        .arg(root.join("scripts/quant_reference.py"))
        .arg(dir)
        .arg(&model)
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot start {python:?}: {e} (scripts/setup.sh installs it with numpy and gguf)")
        });
    assert!(
        out.status.success(),
        "scripts/quant_reference.py failed ({}):\n--- stderr\n{}\n--- stdout\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Our dequantization of `raw` against numpy's `expected`; returns failure descriptions.
fn check_dequant(name: &str, ty: GgmlType, raw: &[u8], expected: &[f32]) -> Vec<String> {
    let mut ours = vec![f32::NAN; expected.len()];
    if let Err(e) = dequantize_row_ref(ty, raw, &mut ours) {
        return vec![format!("{name}: {e}")];
    }
    let mut bad = Vec::new();
    let mut count = 0;
    for (i, (&a, &b)) in ours.iter().zip(expected).enumerate() {
        if ulps(a, b) > DEQUANT_MAX_ULP {
            count += 1;
            if bad.len() < SHOWN {
                let block = i / ty.block_len();
                let bytes = &raw[block * ty.block_bytes()..(block + 1) * ty.block_bytes()];
                bad.push(format!(
                    "{name} ({ty}) element {i} (block {block}, index {}): ours {a:e} numpy {b:e} \
                     ({} ulp); block bytes {}",
                    i % ty.block_len(),
                    ulps(a, b),
                    hex(bytes)
                ));
            }
        }
    }
    if count > bad.len() {
        bad.push(format!("{name}: {count} mismatching elements in all"));
    }
    bad
}

/// Our quantization of `x` against numpy's bytes; returns (failures, allowed differences).
fn check_quant(name: &str, ty: GgmlType, x: &[f32], expected: &[u8]) -> (Vec<String>, usize) {
    let mut ours = vec![0u8; expected.len()];
    match ty {
        GgmlType::Q4_0 => quantize_row_q4_0_ref(x, blocks_of_mut(&mut ours).unwrap()),
        GgmlType::Q4_1 => quantize_row_q4_1_ref(x, blocks_of_mut(&mut ours).unwrap()),
        GgmlType::Q5_0 => quantize_row_q5_0_ref(x, blocks_of_mut(&mut ours).unwrap()),
        GgmlType::Q5_1 => quantize_row_q5_1_ref(x, blocks_of_mut(&mut ours).unwrap()),
        GgmlType::Q8_0 => quantize_row_q8_0_ref(x, blocks_of_mut(&mut ours).unwrap()),
        _ => return (vec![format!("{name}: no quantizer for {ty}")], 0),
    }
    let (bb, bl) = (ty.block_bytes(), ty.block_len());
    let mut bad = Vec::new();
    let mut allowed = 0;
    for (block, (a, b)) in ours.chunks_exact(bb).zip(expected.chunks_exact(bb)).enumerate() {
        if a == b {
            continue;
        }
        let xs = &x[block * bl..(block + 1) * bl];
        let documented = matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0)
            && xs.iter().all(|&v| v == 0.0)
            && xs[0].is_sign_negative()
            && a[..2] == [0x00, 0x80]
            && b[..2] == [0x00, 0x00]
            && a[2..] == b[2..];
        if documented {
            allowed += 1;
        } else if bad.len() < SHOWN {
            bad.push(format!("{name} ({ty}) block {block}: ours {} numpy {}; input {xs:?}", hex(a), hex(b)));
        }
    }
    (bad, allowed)
}

#[test]
fn reference_code_matches_numpy() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("quant_numpy-{}", std::process::id()));
    generate(&dir);

    let manifest = String::from_utf8(read(&dir, "manifest.txt")).unwrap();
    let mut failures = Vec::new();
    let mut seen = Vec::new();
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [kind, name, ty, n, ..] = fields[..] else { panic!("bad manifest line {line:?}") };
        let ty = type_named(ty);
        let n: usize = n.parse().unwrap();
        seen.push(name.to_string());
        match kind {
            "dequant" => {
                let raw = read(&dir, &format!("{name}.raw"));
                let expected = f32s(&read(&dir, &format!("{name}.f32")));
                assert_eq!(expected.len(), n, "{name}");
                if name.starts_with("model_") {
                    // Real weights: small and finite, besides matching numpy.
                    assert!(expected.iter().all(|v| v.is_finite() && v.abs() < 100.0), "{line}");
                }
                let bad = check_dequant(name, ty, &raw, &expected);
                println!("{line}: {}", if bad.is_empty() { "ok" } else { "MISMATCH" });
                failures.extend(bad);
            }
            "quant" => {
                let x = f32s(&read(&dir, &format!("{name}.in.f32")));
                let expected = read(&dir, &format!("{name}.q"));
                assert_eq!(x.len(), n, "{name}");
                let (bad, allowed) = check_quant(name, ty, &x, &expected);
                println!(
                    "{line}: {} ({allowed} block(s) with the documented -0.0 difference)",
                    if bad.is_empty() { "ok" } else { "MISMATCH" }
                );
                failures.extend(bad);
            }
            _ => panic!("bad manifest line {line:?}"),
        }
    }
    for case in EXPECTED_CASES {
        if !seen.iter().any(|s| s == case) {
            failures.push(format!("the script produced no case {case}"));
        }
    }
    if failures.is_empty() {
        let _ = fs::remove_dir_all(&dir);
    } else {
        panic!("{} problem(s); data kept in {}:\n{}", failures.len(), dir.display(), failures.join("\n"));
    }
}

/// ggml's synthetic data, `0.1 + 2 cos(i + offset)` (computed in double, stored as float).
fn synthetic(n: usize, offset: f32) -> Vec<f32> {
    (0..n).map(|i| (0.1 + 2.0 * f64::from((i as f32 + offset).cos())) as f32).collect()
}

/// ggml's test-quantize-fns "rmse": sqrt(sum of squares) / n, which is the true RMSE / sqrt(n).
fn ggml_rmse(a: &[f32], b: &[f32]) -> f32 {
    let sum: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x - y) * f64::from(x - y)).sum();
    (sum.sqrt() as f32) / a.len() as f32
}

fn true_rmse(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x - y) * f64::from(x - y)).sum();
    (sum / a.len() as f64).sqrt()
}

/// Quantize -> dequantize on ggml's test input (32 * 128 values, offset 0) stays within ggml's budget
/// MAX_QUANTIZATION_TOTAL_ERROR = 0.002 in its own metric, for q4_0, q4_1, q8_0 and (ggml tests it with
/// the same budget) q8_K. As that metric divides by sqrt(n) = 64 it is loose, so the true RMSE is also
/// held to 1.15x of the uniform-rounding estimate step / sqrt(12) (steps about 2.1/8, 4.2/15, 2.1/127).
#[test]
fn round_trip_error_within_ggml_budget() {
    const N: usize = 32 * 128;
    const GGML_BUDGET: f32 = 0.002;
    let x = synthetic(N, 0.0);
    let mut y = vec![0f32; N];
    let mut report = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q8_K]
    {
        let mut q = vec![0u8; N / ty.block_len() * ty.block_bytes()];
        let step = match ty {
            GgmlType::Q4_0 => 2.1 / 8.0,
            GgmlType::Q4_1 => 4.2 / 15.0,
            GgmlType::Q5_0 => 2.1 / 16.0,
            GgmlType::Q5_1 => 4.2 / 31.0,
            _ => 2.1 / 127.0,
        };
        match ty {
            GgmlType::Q4_0 => quantize_row_q4_0_ref(&x, blocks_of_mut(&mut q).unwrap()),
            GgmlType::Q4_1 => quantize_row_q4_1_ref(&x, blocks_of_mut(&mut q).unwrap()),
            GgmlType::Q5_0 => quantize_row_q5_0_ref(&x, blocks_of_mut(&mut q).unwrap()),
            GgmlType::Q5_1 => quantize_row_q5_1_ref(&x, blocks_of_mut(&mut q).unwrap()),
            GgmlType::Q8_0 => quantize_row_q8_0_ref(&x, blocks_of_mut(&mut q).unwrap()),
            _ => quantize_row_q8_k_ref(&x, blocks_of_mut(&mut q).unwrap()),
        }
        dequantize_row_ref(ty, &q, &mut y).unwrap();
        let (ggml, rmse) = (ggml_rmse(&x, &y), true_rmse(&x, &y));
        let bound = 1.15 * step / 12f64.sqrt();
        report.push(format!("{ty}: ggml metric {ggml:.6} (< {GGML_BUDGET}), RMSE {rmse:.5} (< {bound:.5})"));
        assert!(ggml < GGML_BUDGET && rmse < bound, "{}", report.join("\n"));
    }
    println!("{}", report.join("\n"));
    // The q8_K blocks really carry their sums (the K-quant dots use them).
    let mut q = vec![0u8; N / 256 * 292];
    quantize_row_q8_k_ref(&x, blocks_of_mut(&mut q).unwrap());
    let blocks: &[BlockQ8_K] = blocks_of(&q).unwrap();
    assert!(blocks.iter().all(|b| b
        .bsums
        .iter()
        .enumerate()
        .all(|(g, s)| s.get() == b.qs[16 * g..16 * g + 16].iter().map(|&v| i16::from(v)).sum::<i16>())));
}
