//! x86 AVX2 kernels: checks the packed test does not reach (k cut into scratch-sized chunks, the
//! element-wise twins), and an ignored micro-benchmark of the packed matmul:
//! `cargo test --release --test x86_bench -- --ignored --nocapture`.
#![cfg(target_arch = "x86_64")]

use std::time::Instant;

use pinfer::kernels::packed::{pack, packed_bytes, ActBlock, PackedFormat, PackedMatrix, BLOCK};
use pinfer::kernels::reference::{
    flash_attn_row_ref, matmul_ref, quantize_act_ref, rms_norm_ref, swiglu_ref,
};
use pinfer::kernels::{flash_attn_row, packed_matmul, quantize_act, rms_norm, swiglu, KernelPath};
use pinfer::quant::blocks::F16Le;
use pinfer::quant::GgmlType;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn avx2() -> Option<KernelPath> {
    Some(KernelPath::Avx2).filter(|p| p.is_available())
}

/// A packed random `rows` x `k` matrix of `ty` (random quants, small positive scales).
fn matrix(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng) -> (PackedFormat, Vec<u8>, Vec<u8>) {
    let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
    let mut src: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
    for block in src.chunks_exact_mut(ty.block_bytes()) {
        let d = half::f16::from_f32(0.001 + 0.01 * rng.f().abs()).to_le_bytes();
        let m = half::f16::from_f32(0.05 * rng.f()).to_le_bytes();
        match ty {
            GgmlType::Q6_K => {
                let n = block.len();
                block[n - 2..].copy_from_slice(&d);
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&half::f16::from_f32(0.05 * rng.f().abs()).to_le_bytes());
            }
            _ => {
                block[..2].copy_from_slice(&d);
                if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    block[2..4].copy_from_slice(&m);
                }
            }
        }
    }
    let format = PackedFormat::for_type(ty).unwrap();
    let (qn, sn) = packed_bytes(format, rows, k);
    let (mut q, mut s) = (vec![0u8; qn], vec![0u8; sn]);
    pack(ty, &src, rows, k, &mut q, &mut s).unwrap();
    (format, q, s)
}

fn acts(rng: &mut Rng, tokens: usize, k: usize) -> Vec<Vec<ActBlock>> {
    (0..tokens)
        .map(|_| {
            let x: Vec<f32> = (0..k).map(|_| 3.0 * rng.f()).collect();
            let mut a = vec![ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] }; k / BLOCK];
            quantize_act_ref(&x, &mut a);
            a
        })
        .collect()
}

fn matmul(
    path: Option<KernelPath>,
    w: &PackedMatrix<'_>,
    groups: std::ops::Range<usize>,
    a: &[Vec<ActBlock>],
) -> Vec<Vec<f32>> {
    let mut outs = vec![vec![f32::NAN; 4 * groups.len()]; a.len()];
    let ar: Vec<&[ActBlock]> = a.iter().map(|a| a.as_slice()).collect();
    let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    match path {
        Some(p) => packed_matmul(p, w, groups, &ar, &mut or),
        None => matmul_ref(w, groups, &ar, &mut or),
    }
    outs
}

/// Runs `f` on the AVX2 path, then on the VNNI path (each when the CPU has it).
fn both_variants(f: impl Fn(KernelPath)) {
    for path in [KernelPath::Avx2, KernelPath::Avx2Vnni] {
        if path.is_available() {
            f(path);
        }
    }
}

#[test]
fn long_rows_cut_into_chunks_match_the_reference() {
    both_variants(long_rows);
}

fn long_rows(path: KernelPath) {
    let mut rng = Rng(3);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_1, GgmlType::Q6_K] {
        // 96 and 160 blocks: several chunks for every tile size, uneven splits.
        for (k, tokens) in [(3072usize, 6usize), (5120, 1), (5120, 3)] {
            let rows = 24;
            let (format, q, s) = matrix(ty, rows, k, &mut rng);
            let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
            let a = acts(&mut rng, tokens, k);
            for groups in [0..6, 1..6, 2..3] {
                let want = matmul(None, &w, groups.clone(), &a);
                let got = matmul(Some(path), &w, groups.clone(), &a);
                for (t, (g, v)) in got.iter().zip(&want).enumerate() {
                    for (r, (g, v)) in g.iter().zip(v).enumerate() {
                        assert!(
                            (g - v).abs() <= 1e-5 * (1.0 + v.abs()) * 50.0,
                            "{ty:?} k {k} t {t} row {r}: {g} vs {v}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn small_shapes_and_token_tails_match_the_reference() {
    both_variants(small_shapes);
}

fn small_shapes(path: KernelPath) {
    let mut rng = Rng(17);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q6_K]
    {
        for tokens in 1..=9 {
            for groups_total in 1..=9 {
                let k =
                    if ty == GgmlType::Q4_K || ty == GgmlType::Q6_K { 256 } else { 32 * (1 + tokens % 5) };
                let rows = 4 * groups_total;
                let (format, q, s) = matrix(ty, rows, k, &mut rng);
                let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
                let a = acts(&mut rng, tokens, k);
                let groups = groups_total / 3..groups_total;
                let want = matmul(None, &w, groups.clone(), &a);
                let got = matmul(Some(path), &w, groups.clone(), &a);
                for (t, (g, v)) in got.iter().zip(&want).enumerate() {
                    for (r, (g, v)) in g.iter().zip(v).enumerate() {
                        let tol = 1e-5 * (1.0 + v.abs()) * 50.0;
                        assert!(
                            (g - v).abs() <= tol,
                            "{ty:?} {rows}x{k} tokens {tokens} t {t} row {r}: {g} vs {v}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn quantize_handles_extremes_like_the_reference() {
    let Some(path) = avx2() else { return };
    let mut x = vec![0f32; 6 * BLOCK];
    x[0] = f32::NAN;
    x[1] = 1.0;
    x[BLOCK] = f32::INFINITY;
    x[BLOCK + 1] = -2.0;
    x[2 * BLOCK] = 1e-40;
    x[2 * BLOCK + 1] = -1e-40;
    x[3 * BLOCK] = f32::NEG_INFINITY;
    x[4 * BLOCK..5 * BLOCK].fill(f32::NAN);
    x[5 * BLOCK] = -f32::MAX;
    x[5 * BLOCK + 3] = 1.5 * f32::MAX / 127.0;
    let mut want = vec![ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] }; 6];
    let mut got = want.clone();
    quantize_act_ref(&x, &mut want);
    quantize_act(path, &x, &mut got);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.qs, w.qs);
        assert_eq!(g.d.to_bits(), w.d.to_bits());
        assert!(g.s.to_bits() == w.s.to_bits() || (g.s.is_nan() && w.s.is_nan()));
    }
}

#[test]
fn swiglu_is_bit_identical_and_rms_norm_is_close() {
    let Some(path) = avx2() else { return };
    let mut rng = Rng(11);
    let n = 4099;
    let mut gate: Vec<f32> = (0..n).map(|i| rng.f() * [1.0, 8.0, 40.0, 120.0][i % 4]).collect();
    // Both tails of exp: overflow, subnormal results, the |n| > 192 cut, non-finite inputs.
    let edges = [88.0f32, 89.0, -88.0, -87.0, -100.0, -103.0, -104.0, -150.0, -200.0, 200.0, 1e30, -1e30];
    gate[..edges.len()].copy_from_slice(&edges);
    gate[20] = f32::INFINITY;
    gate[21] = f32::NEG_INFINITY;
    gate[22] = f32::NAN;
    for i in 0..2000 {
        gate[100 + i] = -150.0 + 0.15 * i as f32 + 0.001 * rng.f();
    }
    let up: Vec<f32> = (0..n).map(|_| rng.f() * 3.0).collect();
    let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
    swiglu_ref(&gate, &up, &mut want);
    swiglu(path, &gate, &up, &mut got);
    for i in 0..n {
        assert!(
            got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan()),
            "{i}: gate {} {} vs {}",
            gate[i],
            got[i],
            want[i]
        );
    }
    for len in [1usize, 7, 8, 15, 16, 17, 576, 1000] {
        let x: Vec<f32> = (0..len).map(|_| rng.f() * 10.0).collect();
        let (mut want, mut got) = (vec![0f32; len], vec![0f32; len]);
        rms_norm_ref(&x, &mut want, 1e-5);
        rms_norm(path, &x, &mut got, 1e-5);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "{len}: {g} vs {w}");
        }
    }
}

#[test]
fn flash_attention_matches_the_reference() {
    let Some(path) = avx2() else { return };
    let mut rng = Rng(5);
    for exact in [false, true] {
        for (hd, n_kv) in [(64usize, 40usize), (13, 9), (128, 3), (64, 0), (600, 5), (24, 300)] {
            let f16 = |v: f32| F16Le::from_f32(v);
            // `exact`: quarter-integers, so every key dot is exact in f32 as in f64 and the
            // results must be bit-identical.
            let mut val = |m: f32| if exact { (rng.f() * 4.0).round() / 4.0 } else { rng.f() * m };
            let q: Vec<f32> = (0..hd).map(|_| val(2.0)).collect();
            let k: Vec<Vec<F16Le>> = (0..n_kv).map(|_| (0..hd).map(|_| f16(val(2.0))).collect()).collect();
            let v: Vec<Vec<F16Le>> =
                (0..n_kv).map(|_| (0..hd).map(|_| f16(rng.f() * 2.0)).collect()).collect();
            let run = |p: KernelPath| {
                let (mut q16, mut acc16, mut out) = (vec![f16(0.0); hd], vec![f16(0.0); hd], vec![0f32; hd]);
                if p == KernelPath::Reference {
                    flash_attn_row_ref(
                        &q,
                        &mut q16,
                        0..n_kv,
                        |j| &k[j],
                        |j| &v[j],
                        0.125,
                        &mut acc16,
                        &mut out,
                    );
                } else {
                    flash_attn_row(
                        p,
                        &q,
                        &mut q16,
                        0..n_kv,
                        |j| &k[j],
                        |j| &v[j],
                        0.125,
                        &mut acc16,
                        &mut out,
                    );
                }
                out
            };
            let (want, got) = (run(KernelPath::Reference), run(path));
            for (g, w) in got.iter().zip(&want) {
                if exact {
                    assert_eq!(g.to_bits(), w.to_bits(), "hd {hd} n_kv {n_kv}: {g} vs {w}");
                } else {
                    // The key dot sums in f32: the softmax weights move by ~1e-7, acc16 rounding
                    // can then differ by an f16 ulp.
                    assert!((g - w).abs() <= 2e-3 * (1.0 + w.abs()), "hd {hd}: {g} vs {w}");
                }
            }
        }
    }
}

/// A spin barrier for the benchmark's two threads (a futex wake costs as much as a small matmul).
struct Spin(std::sync::atomic::AtomicUsize, usize);

impl Spin {
    fn wait(&self, round: usize) {
        use std::sync::atomic::Ordering;
        self.0.fetch_add(1, Ordering::AcqRel);
        while self.0.load(Ordering::Acquire) < round * self.1 {
            std::hint::spin_loop();
        }
    }
}

/// GMAC/s of the packed matmul on this machine (best of several runs: the machine is shared),
/// `BENCH_THREADS` threads (default 1) splitting the row groups as the executor does.
#[test]
#[ignore]
fn bench_packed_matmul() {
    let Some(avx2) = avx2() else { return };
    // BENCH_VNNI=0: the plain AVX2 code on a CPU that has VNNI.
    let vnni = std::env::var("BENCH_VNNI").map_or(true, |v| v != "0") && KernelPath::Avx2Vnni.is_available();
    let path = if vnni { KernelPath::Avx2Vnni } else { avx2 };
    let mut rng = Rng(1);
    let threads: usize = std::env::var("BENCH_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let only = std::env::var("BENCH_TYPES").unwrap_or_default();
    println!("kernels: {}", path.name());
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q6_K] {
        if !only.is_empty() && !only.split(',').any(|t| t.eq_ignore_ascii_case(&format!("{ty:?}"))) {
            continue;
        }
        let shapes: &[(usize, usize)] = if let Ok(v) = std::env::var("BENCH_BIG") {
            if v == "mid" {
                &[(2048, 8192)]
            } else {
                &[(16384, 4096)]
            }
        } else {
            &[(1536, 576), (576, 1536)]
        };
        for &(rows, k) in shapes {
            let k = if ty == GgmlType::Q6_K { k.div_ceil(256) * 256 } else { k };
            let (format, q, s) = matrix(ty, rows, k, &mut rng);
            let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
            let mut line = format!("{:<5} {rows:>4}x{k:<4} {threads}T:", format!("{ty:?}"));
            let bytes = (q.len() + s.len()) as f64;
            for tokens in [1usize, 2, 4, 8, 16, 64] {
                let a = acts(&mut rng, tokens, k);
                let ar: Vec<&[ActBlock]> = a.iter().map(|a| a.as_slice()).collect();
                let mut outs = vec![vec![0f32; rows]; tokens];
                let iters = (2e7 / (rows * k * tokens) as f64).ceil() as usize;
                let (trials, ng) = (15, rows / 4);
                let mut parts: Vec<Vec<&mut [f32]>> = (0..threads).map(|_| Vec::new()).collect();
                for o in outs.iter_mut() {
                    let mut rest: &mut [f32] = o;
                    for (i, p) in parts.iter_mut().enumerate() {
                        let g = ng * (i + 1) / threads - ng * i / threads;
                        let (a, b) = rest.split_at_mut(4 * g);
                        p.push(a);
                        rest = b;
                    }
                }
                let barrier = Spin(Default::default(), threads);
                let best = std::thread::scope(|sc| {
                    let mut handles = Vec::new();
                    let mut mine = None;
                    for (i, mut p) in parts.into_iter().enumerate() {
                        let (w, ar, barrier) = (&w, &ar, &barrier);
                        let groups = ng * i / threads..ng * (i + 1) / threads;
                        let f = move || {
                            let mut best = f64::INFINITY;
                            for trial in 0..trials {
                                barrier.wait(trial + 1);
                                let t0 = Instant::now();
                                for _ in 0..iters {
                                    packed_matmul(path, w, groups.clone(), ar, &mut p);
                                }
                                best = best.min(t0.elapsed().as_secs_f64());
                            }
                            best
                        };
                        if i == 0 {
                            mine = Some(f);
                        } else {
                            handles.push(sc.spawn(f));
                        }
                    }
                    let mut best = mine.unwrap()();
                    for h in handles {
                        best = best.max(h.join().unwrap());
                    }
                    best
                });
                let gmac = (rows * k * tokens * iters) as f64 / best / 1e9;
                line += &format!("  t{tokens}: {gmac:5.1}");
                if tokens == 1 {
                    line += &format!(" ({:.1} GB/s)", bytes * iters as f64 / best / 1e9);
                }
            }
            println!("{line}  GMAC/s");
        }
    }
}

/// ns per key of one flash-attention query row (head dim 64, 256 keys), reference and AVX2.
#[test]
#[ignore]
fn bench_flash_attention() {
    let Some(path) = avx2() else { return };
    let mut rng = Rng(9);
    let (hd, n_kv) = (64usize, 256usize);
    let f16 = F16Le::from_f32;
    let q: Vec<f32> = (0..hd).map(|_| rng.f()).collect();
    let k: Vec<Vec<F16Le>> = (0..n_kv).map(|_| (0..hd).map(|_| f16(rng.f())).collect()).collect();
    let v: Vec<Vec<F16Le>> = (0..n_kv).map(|_| (0..hd).map(|_| f16(rng.f())).collect()).collect();
    let paths = if std::env::var_os("BENCH_NO_REF").is_some() {
        vec![path]
    } else {
        vec![KernelPath::Reference, path]
    };
    for p in paths {
        let (mut q16, mut acc16, mut out) = (vec![f16(0.0); hd], vec![f16(0.0); hd], vec![0f32; hd]);
        let mut best = f64::INFINITY;
        for _ in 0..20 {
            let t0 = Instant::now();
            for _ in 0..50 {
                flash_attn_row(p, &q, &mut q16, 0..n_kv, |j| &k[j], |j| &v[j], 0.125, &mut acc16, &mut out);
            }
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("flash attention {}: {:.1} ns/key", p.name(), best / (50 * n_kv) as f64 * 1e9);
    }
}
