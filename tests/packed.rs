//! Repacked weights: the packed matrix dequantizes to the original rows, the reference packed
//! matmul equals an f64 dot of those rows with the quantized activations, and every SIMD path this
//! CPU has equals the reference (odd shapes, tails of token tiles, extreme values).
//!
//! Tolerances, and why:
//! * dequantized rows: exact for every type (the file's scales and integer values, the file's
//!   arithmetic).
//! * reference matmul vs f64: one f32 rounding per block product and sum: 1e-5 of `sum |w| |a|`
//!   (Q4_K, Q6_K: plus their f16-rounded `d * sc`, 2^-11 of the same sum, and Q4_K's f16-rounded
//!   `dmin * m`, 2^-11 of `sum |dmin m| |s_a|`).
//! * SIMD vs reference: the same integer block dots, float sums in another order: 1e-5 of
//!   `sum |w| |a|` (measured worst cases are ~1e-7).

#![allow(clippy::needless_range_loop)]

use pinfer::kernels::matmul::MatmulKernel;
use pinfer::kernels::packed::{
    act_row_bytes, can_pack, dequantize_packed_row, pack, packed_bytes, q4k_scales, ActBlock, PackedFormat,
    PackedMatrix, BLOCK, Q4K_SCALE_BYTES,
};
use pinfer::kernels::reference::{matmul_ref, quantize_act_ref};
use pinfer::kernels::widen::{q4k_scales_ref, widen_ref, CHUNK_BLOCKS, CHUNK_GROUPS, Q4K_WIDE_UNIT};
use pinfer::kernels::{
    decode_q4k_scales as q4k_decode, packed_matmul, quantize_act, widen_blocks as widen, KernelPath,
};
use pinfer::quant::{dequantize_row_ref, GgmlType};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Random valid blocks of `ty`: random quant bytes, f16 scale fields set to sane magnitudes
/// (`scale` sets their size: 1.0 normal, large values test the f32 range of the sums).
fn random_rows(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng, scale: f32) -> Vec<u8> {
    let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
    let mut bytes: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        let d = f16(scale * (0.001 + 0.01 * rng.f().abs()));
        let m = f16(scale * 0.05 * rng.f());
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => block[..2].copy_from_slice(&d),
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&m);
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                // d, then dmin (non-negative: the mins are subtracted).
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&f16(scale * 0.05 * rng.f().abs()));
            }
            GgmlType::Q6_K => {
                let n = block.len();
                block[n - 2..].copy_from_slice(&d);
            }
            _ => unreachable!(),
        }
    }
    bytes
}

fn packed_of(ty: GgmlType, src: &[u8], rows: usize, k: usize) -> (PackedFormat, Vec<u8>, Vec<u8>) {
    let format = PackedFormat::for_type(ty).unwrap();
    let (qn, sn) = packed_bytes(format, rows, k);
    let (mut q, mut s) = (vec![0u8; qn], vec![0u8; sn]);
    assert_eq!(pack(ty, src, rows, k, &mut q, &mut s), Ok(format));
    (format, q, s)
}

fn k_for(ty: GgmlType, i: usize) -> usize {
    if ty.block_len() == 256 {
        256 * (1 + i % 2)
    } else {
        [32, 96, 160, 576][i % 4]
    }
}

#[test]
fn packed_rows_dequantize_to_the_original_rows() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in TYPES {
        for i in 0..3 {
            // (7 and 10 rows: the last group repeats the last row.)
            let (rows, k) = (4 * (1 + i) - i, k_for(ty, i));
            let src = random_rows(ty, rows, k, &mut rng, 1.0);
            let (format, q, s) = packed_of(ty, &src, rows, k);
            let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
            assert!(w.is_consistent());
            assert_eq!(w.groups(), rows.div_ceil(4));
            let row_bytes = src.len() / rows;
            for r in 0..rows {
                let mut want = vec![0f32; k];
                dequantize_row_ref(ty, &src[r * row_bytes..(r + 1) * row_bytes], &mut want).unwrap();
                let mut got = vec![0f32; k];
                dequantize_packed_row(&w, r, &mut got);
                for (e, (&g, &v)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), v.to_bits(), "{ty:?} {rows}x{k} row {r} element {e}: {g} vs {v}");
                }
            }
        }
    }
}

/// A run of row groups of a packed matrix (a part of a fused weight: phi3's Q, K, V of `attn_qkv`)
/// is the packing of those rows alone, byte for byte; runs past the end are refused.
#[test]
fn row_groups_of_a_packed_matrix_are_those_rows_packed() {
    let mut rng = Rng(0x51_7cc1_b727_220a);
    for ty in TYPES {
        let (rows, k) = (16, k_for(ty, 1));
        let src = random_rows(ty, rows, k, &mut rng, 1.0);
        let (format, q, s) = packed_of(ty, &src, rows, k);
        let whole = PackedMatrix { format, rows, k, quants: &q, scales: &s };
        let row_bytes = src.len() / rows;
        for (first, n) in [(0, 1), (1, 2), (3, 1), (0, 4)] {
            let part = whole.row_groups(first, n).unwrap();
            let rows_of = &src[first * 4 * row_bytes..(first + n) * 4 * row_bytes];
            let (_, pq, ps) = packed_of(ty, rows_of, 4 * n, k);
            assert_eq!((part.rows, part.k), (4 * n, k), "{ty:?}");
            assert!(part.quants == &pq[..] && part.scales == &ps[..], "{ty:?} groups {first}+{n}");
        }
        assert!(whole.row_groups(3, 2).is_none() && whole.row_groups(5, 0).is_none(), "{ty:?}");
    }
}

#[test]
fn shapes_that_do_not_divide_are_not_packed() {
    // Rows need not fill the last group (Granite's 49155 tokens); rows need whole blocks.
    assert!(can_pack(GgmlType::Q4_0, 6, 64) && can_pack(GgmlType::Q6_K, 49155, 256));
    assert!(!can_pack(GgmlType::Q4_0, 0, 64) && !can_pack(GgmlType::Q4_0, 4, 48));
    assert!(!can_pack(GgmlType::Q4_K, 8, 128));
    assert!(!can_pack(GgmlType::F16, 8, 64));
    assert!(can_pack(GgmlType::Q6_K, 8, 512));
    let src = vec![0u8; 18 * 2 * 4];
    let (mut q, mut s) = (vec![0u8; 10], vec![0u8; 10]);
    assert!(pack(GgmlType::Q4_0, &src, 4, 64, &mut q, &mut s).is_err());
}

fn quantized_acts(rng: &mut Rng, tokens: usize, k: usize, scale: f32) -> Vec<Vec<ActBlock>> {
    (0..tokens)
        .map(|_| {
            let x: Vec<f32> = (0..k).map(|_| scale * rng.f()).collect();
            let mut a = vec![ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] }; k / BLOCK];
            quantize_act_ref(&x, &mut a);
            a
        })
        .collect()
}

/// Runs `f` (a packed matmul) over `tokens` activation rows and all groups; returns [token][row].
fn run(
    f: impl Fn(&PackedMatrix<'_>, std::ops::Range<usize>, &[&[ActBlock]], &mut [&mut [f32]]),
    w: &PackedMatrix<'_>,
    acts: &[Vec<ActBlock>],
    groups: std::ops::Range<usize>,
) -> Vec<Vec<f32>> {
    let mut outs = vec![vec![f32::NAN; 4 * groups.len()]; acts.len()];
    let act_refs: Vec<&[ActBlock]> = acts.iter().map(|a| a.as_slice()).collect();
    let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    f(w, groups, &act_refs, &mut out_refs);
    outs
}

#[test]
fn reference_packed_matmul_equals_an_f64_dot_of_the_values() {
    let mut rng = Rng(42);
    for ty in TYPES {
        for i in 0..3 {
            let (rows, k) = (8 - i, k_for(ty, i));
            let src = random_rows(ty, rows, k, &mut rng, 1.0);
            let (format, q, s) = packed_of(ty, &src, rows, k);
            let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
            let acts = quantized_acts(&mut rng, 3, k, 4.0);
            let got = run(matmul_ref, &w, &acts, 0..rows.div_ceil(4));
            for (t, a) in acts.iter().enumerate() {
                let av: Vec<f64> =
                    a.iter().flat_map(|b| b.qs.iter().map(move |&q| f64::from(b.d) * f64::from(q))).collect();
                for r in 0..rows {
                    let mut wr = vec![0f32; k];
                    dequantize_packed_row(&w, r, &mut wr);
                    let want: f64 = wr.iter().zip(&av).map(|(&w, &a)| f64::from(w) * a).sum();
                    let size: f64 = wr.iter().zip(&av).map(|(&w, &a)| (f64::from(w) * a).abs()).sum();
                    // The min term uses s = f16(d * sum q), not the exact sum: allow that rounding
                    // times the largest weight (a bound on the min).
                    let largest = wr.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
                    let min_slack: f64 = if format.has_min() {
                        a.iter()
                            .map(|b| {
                                let exact = f64::from(b.d) * b.qs.iter().map(|&q| f64::from(q)).sum::<f64>();
                                largest * (exact - f64::from(b.s)).abs()
                            })
                            .sum()
                    } else {
                        0.0
                    };
                    // Q6K's matmul takes `d * sc` rounded to f16 (the values are exact): a
                    // relative 2^-11 per product at most.
                    let scale_slack = match format {
                        PackedFormat::Q6K => 2f64.powi(-11) * size,
                        PackedFormat::Q4K | PackedFormat::Q5K => {
                            let gs = &s[r / 4 * (k / BLOCK) * format.scale_bytes()..];
                            let mins: f64 = a
                                .iter()
                                .enumerate()
                                .map(|(b, ab)| {
                                    let sc = q4k_scales(gs, b, r % 4);
                                    f64::from(sc.dmin * f32::from(sc.m)) * f64::from(ab.s).abs()
                                })
                                .sum();
                            2f64.powi(-11) * (size + mins)
                        }
                        _ => 0.0,
                    };
                    let g = f64::from(got[t][r]);
                    assert!(
                        (g - want).abs() <= 1e-5 * size + min_slack + scale_slack + 1e-30,
                        "{ty:?} k={k} token {t} row {r}: {g} vs {want} (size {size})"
                    );
                }
            }
        }
    }
}

fn simd_paths() -> Vec<KernelPath> {
    [KernelPath::Neon, KernelPath::NeonDotprod, KernelPath::NeonFp16, KernelPath::Avx2, KernelPath::Avx2Vnni]
        .into_iter()
        .filter(|p| p.is_available())
        .collect()
}

#[test]
fn every_simd_path_equals_the_reference_matmul() {
    let mut rng = Rng(7);
    for path in simd_paths() {
        for ty in TYPES {
            for (i, tokens) in [1usize, 2, 3, 4, 5, 7, 8, 9, 13].into_iter().enumerate() {
                let groups_total = 1 + i % 5;
                // (Some with a last group the rows do not fill.)
                let (rows, k) = (4 * groups_total - i % 4, k_for(ty, i));
                let scale = if i == 8 { 1000.0 } else { 1.0 };
                let src = random_rows(ty, rows, k, &mut rng, scale);
                let (format, q, s) = packed_of(ty, &src, rows, k);
                let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
                let acts = quantized_acts(&mut rng, tokens, k, if i == 7 { 300.0 } else { 3.0 });
                // A sub-range of groups, as a thread's share.
                let groups = (groups_total / 3)..groups_total;
                let want = run(matmul_ref, &w, &acts, groups.clone());
                let got = run(|w, g, a, o| packed_matmul(path, w, g, a, o), &w, &acts, groups.clone());
                for t in 0..tokens {
                    for (j, (&g, &v)) in got[t].iter().zip(&want[t]).enumerate() {
                        let r = 4 * groups.start + j;
                        let mut wr = vec![0f32; k];
                        dequantize_packed_row(&w, r, &mut wr);
                        let size: f32 = wr
                            .iter()
                            .zip(acts[t].iter().flat_map(|b| b.qs.iter().map(move |&q| b.d * f32::from(q))))
                            .map(|(&w, a)| (w * a).abs())
                            .sum::<f32>()
                            + acts[t].iter().map(|b| b.s.abs()).sum::<f32>();
                        assert!(
                            (g - v).abs() <= 1e-5 * size,
                            "{} {ty:?} {rows}x{k} tokens {tokens} token {t} row {r}: {g} vs reference {v}",
                            path.name()
                        );
                    }
                }
            }
        }
    }
}

/// A kernel from the table reads only the layout it was chosen for: handed a matrix of another
/// format it runs the reference (the executor never does that, the check keeps the SIMD kernels'
/// raw reads inside the planes whoever calls them).
#[test]
fn a_kernel_runs_the_reference_on_a_matrix_of_another_format() {
    let mut rng = Rng(31);
    for path in KernelPath::ALL {
        for (i, ty) in TYPES.into_iter().enumerate() {
            let (rows, k, tokens) = (12, k_for(ty, i), 1 + i % 5);
            let src = random_rows(ty, rows, k, &mut rng, 1.0);
            let (format, q, s) = packed_of(ty, &src, rows, k);
            let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
            let acts = quantized_acts(&mut rng, tokens, k, 3.0);
            let want = run(matmul_ref, &w, &acts, 0..3);
            for other in PackedFormat::ALL.into_iter().filter(|&f| f != format) {
                let kernel = MatmulKernel::new(other, path);
                assert_eq!(kernel.format(), other);
                let got = run(|w, g, a, o| kernel.run(w, g, a, o), &w, &acts, 0..3);
                assert_eq!(got, want, "{} kernel of {other:?} on a {format:?} matrix", path.name());
            }
        }
    }
}

#[test]
fn every_simd_path_quantizes_activations_like_the_reference() {
    let mut rng = Rng(99);
    for path in simd_paths() {
        for n in [1usize, 2, 3, 7, 18] {
            let mut x: Vec<f32> = (0..n * BLOCK).map(|_| 5.0 * rng.f()).collect();
            // Ties: values that land exactly on .5 after scaling, an all-zero block, huge values.
            x[0] = 127.0;
            x[1] = 0.5;
            x[2] = -2.5;
            if n > 2 {
                x[BLOCK * 2..BLOCK * 3].fill(0.0);
            }
            if n > 3 {
                x[BLOCK * 3] = 3.0e38;
            }
            let mut want = vec![ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] }; n];
            let mut got = want.clone();
            quantize_act_ref(&x, &mut want);
            quantize_act(path, &x, &mut got);
            assert_eq!(got, want, "{} n={n}", path.name());
        }
    }
    assert_eq!(act_row_bytes(64), 80);
}

/// The SIMD widenings of the 6-bit layout give the reference's bytes (values and f16 scales).
#[test]
fn every_simd_path_widens_q6k_like_the_reference() {
    let mut rng = Rng(0x6b);
    let (rows, k) = (8, 512);
    for scale in [1.0, 1000.0] {
        let src = random_rows(GgmlType::Q6_K, rows, k, &mut rng, scale);
        let (format, q, s) = packed_of(GgmlType::Q6_K, &src, rows, k);
        let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
        let nb = k / BLOCK;
        for g in 0..rows / 4 {
            // A block range that starts inside a super-block.
            let blocks = 3..nb;
            let (qn, sn) = (blocks.len() * 128, blocks.len() * 16);
            let (mut wq, mut ws) = (vec![0u8; qn], vec![0u8; sn]);
            widen_ref(&w, g, blocks.clone(), &mut wq, &mut ws);
            for path in simd_paths() {
                let (mut pq, mut ps) = (vec![1u8; qn], vec![1u8; sn]);
                widen(path, &w, g, blocks.clone(), &mut pq, &mut ps);
                assert!(pq == wq && ps == ws, "{} group {g} scale {scale}", path.name());
            }
        }
    }
}

/// The SIMD widenings of the 5-bit layouts give the reference's bytes (values and scales), and
/// those hold the packed values.
#[test]
fn every_simd_path_widens_q5_like_the_reference() {
    let mut rng = Rng(0x55);
    let (rows, k) = (8, 320);
    for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
        let src = random_rows(ty, rows, k, &mut rng, 1.0);
        let (format, q, s) = packed_of(ty, &src, rows, k);
        let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
        let (nb, sb) = (k / BLOCK, format.scale_bytes());
        for g in 0..rows / 4 {
            let blocks = 3..nb;
            let (qn, sn) = (blocks.len() * 128, blocks.len() * sb);
            let (mut wq, mut ws) = (vec![0u8; qn], vec![0u8; sn]);
            widen_ref(&w, g, blocks.clone(), &mut wq, &mut ws);
            let mut row = vec![0f32; k];
            dequantize_packed_row(&w, 4 * g, &mut row);
            for (i, b) in blocks.clone().enumerate() {
                let f16 =
                    |at: usize| half::f16::from_le_bytes([ws[sb * i + at], ws[sb * i + at + 1]]).to_f32();
                let (d, m) = (f16(0), if sb > 8 { f16(8) } else { 0.0 });
                for e in 0..BLOCK {
                    let v = f32::from(wq[128 * i + 16 * (e / 4) + e % 4] as i8);
                    assert_eq!(d * v + m, row[BLOCK * b + e], "{ty:?} block {b} element {e}");
                }
            }
            for path in simd_paths() {
                let (mut pq, mut ps) = (vec![1u8; qn], vec![1u8; sn]);
                widen(path, &w, g, blocks.clone(), &mut pq, &mut ps);
                assert!(pq == wq && ps == ws, "{} {ty:?} group {g}", path.name());
            }
        }
    }
}

/// The SIMD decoders of Q4K's scale units give the reference's bytes (scales of every size: f16
/// overflow, subnormals).
#[test]
fn every_simd_path_decodes_q4k_scales_like_the_reference() {
    let mut rng = Rng(0x4b);
    for scale in [1.0, 1000.0, 1e-5] {
        let src = random_rows(GgmlType::Q4_K, 8, 512, &mut rng, scale);
        let (_, _, s) = packed_of(GgmlType::Q4_K, &src, 8, 512);
        // One unit, and runs of units (a group's row, then the whole plane).
        for units in [&s[..Q4K_SCALE_BYTES], &s[..s.len() / 2], &s[..]] {
            let n = units.len() / Q4K_SCALE_BYTES * Q4K_WIDE_UNIT;
            let mut want = vec![0u8; n];
            q4k_scales_ref(units, &mut want);
            for path in simd_paths() {
                let mut got = vec![1u8; n];
                q4k_decode(path, units, &mut got);
                assert_eq!(got, want, "{} scale {scale}", path.name());
            }
            // A length that does not match writes nothing.
            let mut short = vec![1u8; n - 1];
            for path in simd_paths() {
                q4k_decode(path, units, &mut short);
                assert!(short.iter().all(|&b| b == 1), "{}", path.name());
            }
        }
    }
}

/// Q6_K, Q5_0, Q5_1, Q5_K and Q4_K matrices wider than one widening chunk (groups and blocks; Q4_K: rows so wide that
/// fewer groups fit the decoded-scale scratch, and more groups than one strip's decoded scales)
/// and token counts past one kernel tile: the chunks add up to the reference.
#[test]
fn narrow_chunks_add_up_to_the_reference() {
    let mut rng = Rng(0x6c);
    let groups = 2 * CHUNK_GROUPS + 3;
    // (Q4_K with a short row and many groups: more groups than x86 decodes scales for at once.)
    let cases = [
        (GgmlType::Q6_K, groups, BLOCK * (CHUNK_BLOCKS + 8 * 3)),
        (GgmlType::Q4_K, groups, 256 * 40),
        (GgmlType::Q4_K, 1100, 256),
        (GgmlType::Q5_0, groups, BLOCK * (CHUNK_BLOCKS + 5)),
        (GgmlType::Q5_1, groups, BLOCK * (CHUNK_BLOCKS + 5)),
        (GgmlType::Q5_K, groups, 256 * 3),
    ];
    for (ty, groups_total, k) in cases {
        let rows = 4 * groups_total;
        let src = random_rows(ty, rows, k, &mut rng, 1.0);
        let (format, q, s) = packed_of(ty, &src, rows, k);
        let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
        for path in simd_paths() {
            for tokens in [1usize, 3, 17] {
                let acts = quantized_acts(&mut rng, tokens, k, 3.0);
                let groups = 1..groups_total;
                let want = run(matmul_ref, &w, &acts, groups.clone());
                let got = run(|w, g, a, o| packed_matmul(path, w, g, a, o), &w, &acts, groups.clone());
                for t in 0..tokens {
                    let size: f32 = acts[t]
                        .iter()
                        .map(|b| b.d * b.qs.iter().map(|&q| f32::from(q).abs()).sum::<f32>() + b.s.abs())
                        .sum();
                    for (j, (&g, &v)) in got[t].iter().zip(&want[t]).enumerate() {
                        // |w| <= 63 * 32 * 0.011 (Q4_K: 63 * 15 * 0.011 + 63 * 0.05; the scales
                        // random_rows writes): a bound on sum |w a| and the min terms.
                        assert!(
                            (g - v).abs() <= 1e-5 * 45.0 * size,
                            "{} {ty:?} tokens {tokens} token {t} row {j}: {g} vs {v}",
                            path.name()
                        );
                    }
                }
            }
        }
    }
}
