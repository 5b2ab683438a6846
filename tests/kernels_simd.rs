//! Every SIMD kernel path this CPU has against the scalar twins, on odd lengths (1, 3, 17, 64,
//! 100, 257), tails and extreme values (large, tiny, subnormal, zero, infinite); plus packed
//! matmul shapes `tests/packed.rs` does not reach (one token over many groups, runs longer than a
//! kernel chunk, group sub-ranges).
//!
//! Tolerances, and why:
//! * `quantize_act`: byte-identical. Every path computes the same amax, `d`, `127 / amax`, product
//!   and ties-to-even rounding, and the same f16 roundings of `d` and `s`.
//! * `swiglu`: bit-identical (NaN-aware). The SIMD paths evaluate ggml's exp polynomial with the
//!   same fused steps and scale by 2^n exactly, and send lanes outside the exact range to the twin.
//! * `rms_norm`: 2^-21 relative (a few ulps). The f64 sum of the f32 squares may run in another
//!   order; its rounding to the f32 mean can move by one ulp, which moves the scale by about one ulp.
//! * NEON flash attention (`flash_attn_row`, `flash_attn_rows`): bit-identical (NaN-aware) to the
//!   twins `flash_attn_row_f32dot_ref` / `flash_attn_rows_f32dot_ref` (the reference's steps with the
//!   key dot summed in f32 in ggml's x86 order), on top of the checks against `flash_attn_row_ref`.
//! * `neon::flash_attn_rows_fp16` (FEAT_FP16 arithmetic as llama.cpp's aarch64 build; the `fp16`
//!   path, detected on cores with dotprod and FEAT_FP16), through the dispatch: bit-identical
//!   (NaN-aware) to the twins `flash_attn_row_f16arith_ref` /
//!   `flash_attn_rows_f16arith_ref`, which round every f16 `fmul`, `fadd` and `fmla` exactly once and
//!   keep the kernel's lane grouping and reduction order.
//! * `flash_attn_row`: `q16` identical (the same f16 rounding); outputs within 2^-7 of the largest
//!   `|v|`. A path may sum the key dot in f32 (in any order) rather than the reference's f64, so a
//!   score moves by ~1e-7 relative; that can flip an f16 rounding of the accumulator (2^-11 of it)
//!   at a key, and later keys carry the flip: a handful of f16 ulps of values bounded by `max |v|`.
//!   With queries and keys on a coarse grid the dots are exact in any order: bit-identical.
//! * attention over other cache types (`kv_attn`): the SIMD row operations (q8_0 key dots, q8_0
//!   and f16 value widening, the fused update) bit-identical to the reference operations, through
//!   the same loop; the loop itself against f64 attention over the values the cache holds.
//! * packed matmul: 1e-5 of `sum |w a| + sum |s|`, as in `tests/packed.rs` (same integer block dots,
//!   float sums in another order).

use pinfer::kernels::attn_tile::{flash_attn_tile_ref, tile_rows, TileScratch};
use pinfer::kernels::dot::vec_dot_f16_ggml_ref;
use pinfer::kernels::dot::{vec_dot_f32_f32_ref, vec_dot_f32_lanes};
use pinfer::kernels::flash_attn_tile;
use pinfer::kernels::kv_attn::{alibi_slope, Alibi};
use pinfer::kernels::kv_attn::{KvOps, KEY_CHUNK, TYPED_ROWS};
use pinfer::kernels::packed::{
    dequantize_packed_row, pack, packed_bytes, ActBlock, PackedFormat, PackedMatrix, BLOCK,
};
use pinfer::kernels::reference::{
    f32_to_f16_ref, flash_attn_row_f32dot_ref, flash_attn_row_ref, flash_attn_rows_f32dot_ref,
    flash_attn_rows_ref, matmul_ref, quantize_act_ref, rms_norm_ref, rope_ref, rope_table_ref, silu_ref,
    swiglu_ref, RopeParams, RowSoftmax,
};
use pinfer::kernels::{
    add_scaled_rows, dot_f16, dot_f32, f32_to_f16, flash_attn_row, flash_attn_rows, packed_matmul,
    quantize_act, rms_norm, rope_rotate, silu, swiglu, KernelPath, FLASH_ROWS,
};
use pinfer::kernels::{flash_attn_rows_typed, flash_attn_rows_typed_alibi};
use pinfer::quant::blocks::{F16Le, F32Le};
use pinfer::quant::GgmlType;

const LENGTHS: [usize; 6] = [1, 3, 17, 64, 100, 257];

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

fn simd_paths() -> Vec<KernelPath> {
    [KernelPath::Neon, KernelPath::NeonDotprod, KernelPath::Avx2, KernelPath::Avx2Vnni]
        .into_iter()
        .filter(|p| p.is_available())
        .collect()
}

/// Inputs of `n` values in a few regimes: ordinary, large, tiny (subnormal included), a mix with
/// zeros and infinities, and magnitudes that cross exp's overflow/underflow edges.
fn regimes(n: usize, rng: &mut Rng) -> Vec<(&'static str, Vec<f32>)> {
    let mut v = vec![
        ("ordinary", (0..n).map(|_| 6.0 * rng.f()).collect::<Vec<f32>>()),
        ("large", (0..n).map(|_| 3.0e37 * rng.f()).collect()),
        ("tiny", (0..n).map(|_| 1.0e-40 * rng.f()).collect()),
        ("exp edges", (0..n).map(|_| 80.0 + 30.0 * rng.f()).collect()),
        ("negative exp edges", (0..n).map(|_| -80.0 - 30.0 * rng.f()).collect()),
    ];
    let mut mixed: Vec<f32> = (0..n).map(|_| 50.0 * rng.f()).collect();
    for (i, x) in mixed.iter_mut().enumerate() {
        match i % 7 {
            0 => *x = 0.0,
            1 => *x = -0.0,
            3 if i % 2 == 1 => *x = f32::INFINITY,
            5 => *x = f32::MIN_POSITIVE * rng.f(),
            _ => {}
        }
    }
    if n > 2 {
        mixed[n - 1] = f32::NEG_INFINITY;
    }
    v.push(("mixed", mixed));
    v
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// GELU and GeGLU (ggml's f16 table) are the reference's bit for bit on every SIMD path: every
/// regime, the saturation edges at +-10 and the f16 rounding ties around them, infinities, NaN,
/// and tails of every length below the vector width.
#[test]
fn gelu_is_bit_identical_to_the_reference() {
    use pinfer::kernels::reference::{geglu_ref, gelu_ref};
    use pinfer::kernels::{geglu, gelu};
    let mut rng = Rng(23);
    let edges = [-10.0f32, 10.0, -9.997, 9.997, -10.003, 10.003, 0.0, -0.0, 65520.0, -65520.0, 1e-8, -1e-8];
    for path in simd_paths() {
        for n in LENGTHS.into_iter().chain([7, 8, 9, 15, 16, 31]) {
            let mut cases = regimes(n, &mut rng);
            cases.push(("edges", (0..n).map(|i| edges[i % edges.len()]).collect()));
            cases.push((
                "around 10",
                (0..n).map(|_| 10.0 * (1.0 + 0.01 * rng.f()).copysign(rng.f())).collect(),
            ));
            cases.push(("nan", (0..n).map(|i| if i % 3 == 0 { f32::NAN } else { 4.0 * rng.f() }).collect()));
            for (name, x) in cases {
                let up: Vec<f32> = (0..n).map(|_| 3.0 * rng.f()).collect();
                let (mut got, mut want) = (vec![7f32; n], vec![9f32; n]);
                gelu(path, &x, &mut got);
                gelu_ref(&x, &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        same_bits(*g, *w),
                        "{} gelu n={n} {name} [{i}] = {}: {g} vs {w}",
                        path.name(),
                        x[i]
                    );
                }
                geglu(path, &x, &up, &mut got);
                geglu_ref(&x, &up, &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(same_bits(*g, *w), "{} geglu n={n} {name} [{i}]: {g} vs {w}", path.name());
                }
            }
        }
    }
}

/// Rounding f32 activations through f16 for the f16 tiles is the reference's (and the f16
/// conversion's then widening's) bit for bit on every SIMD path, with zeros in the padding.
#[test]
fn round_f16_padded_is_the_conversion_then_widening() {
    use pinfer::kernels::reference::round_f16_ref;
    use pinfer::kernels::round_f16_padded;
    let mut rng = Rng(29);
    for path in simd_paths() {
        for n in LENGTHS.into_iter().chain([7, 8, 9, 31, 33]) {
            for (name, x) in regimes(n, &mut rng) {
                let padded = n.next_multiple_of(32) + 32;
                let mut got = vec![f32::NAN; padded];
                round_f16_padded(path, &x, &mut got);
                let mut want = vec![0f32; n];
                round_f16_ref(&x, &mut want);
                let widened: Vec<f32> = f16s(&x).iter().map(|h| h.to_f32()).collect();
                for i in 0..n {
                    assert!(
                        same_bits(got[i], want[i]),
                        "{} n={n} {name} [{i}]: {} vs {}",
                        path.name(),
                        got[i],
                        want[i]
                    );
                    assert!(
                        same_bits(got[i], widened[i]),
                        "{} n={n} {name} [{i}] vs f16 widened",
                        path.name()
                    );
                }
                assert!(got[n..].iter().all(|&v| v.to_bits() == 0), "{} n={n} {name}: padding", path.name());
            }
        }
    }
}

/// SiLU through SwiGLU's kernels (an up projection of ones) is the reference's bit for bit.
#[test]
fn silu_is_bit_identical() {
    let mut rng = Rng(2);
    for path in simd_paths() {
        for n in LENGTHS.into_iter().chain([64, 65, 200]) {
            for (name, x) in regimes(n, &mut rng) {
                let (mut want, mut got) = (vec![0f32; n], vec![f32::NAN; n]);
                silu_ref(&x, &mut want);
                silu(path, &x, &mut got);
                for i in 0..n {
                    assert!(
                        same_bits(got[i], want[i]),
                        "{} n={n} {name} [{i}]: silu({}) = {} vs {}",
                        path.name(),
                        x[i],
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

#[test]
fn swiglu_is_bit_identical() {
    let mut rng = Rng(1);
    for path in simd_paths() {
        for n in LENGTHS {
            for (name, gate) in regimes(n, &mut rng) {
                let up: Vec<f32> = (0..n).map(|i| if i % 5 == 4 { 1.0e30 } else { 2.0 * rng.f() }).collect();
                let mut want = vec![0f32; n];
                let mut got = vec![f32::NAN; n];
                swiglu_ref(&gate, &up, &mut want);
                swiglu(path, &gate, &up, &mut got);
                for i in 0..n {
                    assert!(
                        same_bits(got[i], want[i]),
                        "{} n={n} {name} [{i}]: silu({}) * {} = {} vs reference {}",
                        path.name(),
                        gate[i],
                        up[i],
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

/// The f16 dot of matmuls on f16 weights is its twin's (ggml's AVX2 order) bit for bit on every
/// path, every tail length and every regime (f16 overflow to infinity, subnormals, NaN from inf * 0).
#[test]
fn f16_dot_is_bit_identical_to_its_twin() {
    let mut rng = Rng(9);
    let mut paths = simd_paths();
    paths.push(KernelPath::Reference);
    for path in paths {
        for n in LENGTHS.into_iter().chain([31, 32, 33, 64, 65, 200, 1536]) {
            for (name, a) in regimes(n, &mut rng) {
                let b: Vec<f32> = (0..n).map(|_| 4.0 * rng.f()).collect();
                let (a, b) = (f16s(&a), f16s(&b));
                let (got, want) = (dot_f16(path, &a, &b), vec_dot_f16_ggml_ref(&a, &b));
                assert!(same_bits(got, want), "{} n={n} {name}: {got} vs twin {want}", path.name());
            }
        }
    }
}

/// The register tiles of the matmul on f16 weights (up to `f16_tile_shape` weight rows times
/// widened tokens) give each (row, token) the per-token f16 dot's bits, on every path, tile shape,
/// tail, segment count (rows past 512 values) and regime: a token's numbers do not depend on the
/// tokens beside it, nor a row's on the rows beside it.
#[test]
fn f16_tiles_give_each_token_its_own_dot() {
    use pinfer::kernels::dot::widen_f16_padded;
    use pinfer::kernels::{dot_f16_tile, f16_tile_shape, F16_TILE_ROWS, F16_TILE_TOKENS};
    let mut rng = Rng(19);
    let mut paths = simd_paths();
    paths.push(KernelPath::Reference);
    for path in paths {
        let (max_rows, max_tokens) = f16_tile_shape(path);
        assert!(max_rows <= F16_TILE_ROWS && max_tokens <= F16_TILE_TOKENS);
        for n in LENGTHS.into_iter().chain([31, 32, 33, 65, 200, 512, 513, 1536]) {
            for (name, w) in regimes(n, &mut rng) {
                // Row 0 in the regime, the others ordinary or the regime reversed.
                let ws: Vec<Vec<_>> = (0..max_rows)
                    .map(|r| match r % 2 {
                        0 if r == 0 => f16s(&w),
                        0 => f16s(&w.iter().rev().copied().collect::<Vec<f32>>()),
                        _ => f16s(&(0..n).map(|_| 6.0 * rng.f()).collect::<Vec<f32>>()),
                    })
                    .collect();
                let xs: Vec<Vec<_>> = (0..max_tokens)
                    .map(|j| match j {
                        1 => f16s(&w),
                        _ => f16s(&(0..n).map(|_| 4.0 * rng.f()).collect::<Vec<f32>>()),
                    })
                    .collect();
                let padded = n.next_multiple_of(32);
                // (Garbage past the padding: the kernel must read only what it is given.)
                let widened: Vec<Vec<f32>> = xs
                    .iter()
                    .map(|x| {
                        let mut row = vec![f32::NAN; padded + 8];
                        widen_f16_padded(x, &mut row[..padded]);
                        row
                    })
                    .collect();
                for rows in 1..=max_rows {
                    for tokens in 1..=max_tokens {
                        let w_refs: Vec<&[_]> = ws[..rows].iter().map(|w| &w[..]).collect();
                        let x_refs: Vec<&[f32]> = widened[..tokens].iter().map(|r| &r[..padded]).collect();
                        let mut out = [[f32::NAN; F16_TILE_TOKENS]; F16_TILE_ROWS];
                        dot_f16_tile(path, &w_refs, &x_refs, &mut out);
                        for r in 0..rows {
                            for j in 0..tokens {
                                let (got, want) = (out[r][j], dot_f16(path, &ws[r], &xs[j]));
                                assert!(
                                    same_bits(got, want),
                                    "{} n={n} {name} tile {rows}x{tokens} ({r}, {j}): {got} vs the dot {want}",
                                    path.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The encoder's f16 GEMM panel is its scalar twin's bit for bit on every SIMD path: every depth
/// (tails of every vector width, one chunk's most), 1 to 6 weight rows, 1 to 3 micro-panels,
/// every regime (f16's infinities and subnormals after rounding), sums continued from non-zero
/// values; the twin is the matmul (within f32 rounding of the f64 sums) and split into chunks of
/// `k` it gives the same bits (one chain per output, whatever the blocking).
#[test]
fn f16_gemm_panels_are_their_twins_bit_for_bit() {
    use pinfer::kernels::f16_gemm::{panel_ref, GemmTile, GEMM_DEPTH, GEMM_ROWS, GEMM_TOKENS};
    use pinfer::kernels::f16_gemm_panel;
    let mut rng = Rng(23);
    let widen = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| F16Le::from_f32(x).to_f32()).collect() };
    for kc in LENGTHS.into_iter().chain([8, 15, 16, 33, 1000, GEMM_DEPTH]) {
        for (name, w) in regimes(kc, &mut rng) {
            let ws: Vec<Vec<F16Le>> = (0..GEMM_ROWS)
                .map(|r| match r {
                    0 => f16s(&w),
                    _ => f16s(&(0..kc).map(|_| 2.0 * rng.f()).collect::<Vec<f32>>()),
                })
                .collect();
            // Three micro-panels `[tile][kk][t]` of f16-exact tokens; token 1 of tile 0 in the regime.
            let mut xt = widen(&(0..3 * kc * GEMM_TOKENS).map(|_| 3.0 * rng.f()).collect::<Vec<f32>>());
            let regime = widen(&w.iter().rev().copied().collect::<Vec<f32>>());
            for (kk, &v) in regime.iter().enumerate() {
                xt[kk * GEMM_TOKENS + 1] = v;
            }
            let start: GemmTile = core::array::from_fn(|_| core::array::from_fn(|_| 0.5 * rng.f()));
            for rows in 1..=GEMM_ROWS {
                let w_refs: Vec<&[F16Le]> = ws[..rows].iter().map(|w| &w[..]).collect();
                for tiles in 1..=3 {
                    let mut want = vec![start; tiles];
                    panel_ref(&w_refs, &xt[..tiles * kc * GEMM_TOKENS], kc, &mut want);
                    for &path in &simd_paths() {
                        let mut got = vec![start; tiles];
                        let mut wp = vec![f32::NAN; GEMM_ROWS * kc];
                        f16_gemm_panel(path, &w_refs, &xt[..tiles * kc * GEMM_TOKENS], kc, &mut wp, &mut got);
                        for (p, (g, e)) in got.iter().zip(&want).enumerate() {
                            for r in 0..rows {
                                for t in 0..GEMM_TOKENS {
                                    assert!(
                                        same_bits(g[r][t], e[r][t]),
                                        "{} kc={kc} {name} rows={rows} tile {p} ({r}, {t}): {} vs {}",
                                        path.name(),
                                        g[r][t],
                                        e[r][t]
                                    );
                                }
                            }
                        }
                    }
                }
            }
            if name != "ordinary" {
                continue;
            }
            // The twin is the matmul, and chunks of k continue its chains exactly.
            let refs: Vec<&[F16Le]> = ws.iter().map(|w| &w[..]).collect();
            let mut whole = [[[0f32; GEMM_TOKENS]; GEMM_ROWS]];
            panel_ref(&refs, &xt[..kc * GEMM_TOKENS], kc, &mut whole);
            for r in 0..GEMM_ROWS {
                let wr: Vec<f32> = ws[r].iter().map(|h| h.to_f32()).collect();
                for t in 0..GEMM_TOKENS {
                    let (exact, scale) = (0..kc).fold((0f64, 0f64), |(s, a), kk| {
                        let p = f64::from(xt[kk * GEMM_TOKENS + t]) * f64::from(wr[kk]);
                        (s + p, a + p.abs())
                    });
                    let err = (f64::from(whole[0][r][t]) - exact).abs();
                    assert!(
                        err <= kc as f64 * 6e-8 * scale + 1e-30,
                        "kc={kc} ({r}, {t}): {} vs {exact}",
                        whole[0][r][t]
                    );
                }
            }
            let cut = kc / 3;
            if cut > 0 {
                let mut split = [[[0f32; GEMM_TOKENS]; GEMM_ROWS]];
                let head: Vec<&[F16Le]> = ws.iter().map(|w| &w[..cut]).collect();
                let tail: Vec<&[F16Le]> = ws.iter().map(|w| &w[cut..]).collect();
                let xt_head: Vec<f32> = xt[..cut * GEMM_TOKENS].to_vec();
                let xt_tail: Vec<f32> = xt[cut * GEMM_TOKENS..kc * GEMM_TOKENS].to_vec();
                panel_ref(&head, &xt_head, cut, &mut split);
                panel_ref(&tail, &xt_tail, kc - cut, &mut split);
                assert_eq!(split, whole, "kc={kc}: chunks of k change the sums");
            }
        }
    }
}

/// The f32 dot of computed tensors (training) is its twin's bit for bit on every SIMD path, every
/// tail length and every regime, and within f32 rounding of ggml's f64-summed scalar dot (the
/// reference path's, which it is on that path).
#[test]
fn f32_dot_is_bit_identical_to_its_twin() {
    let mut rng = Rng(10);
    for path in simd_paths() {
        for n in LENGTHS.into_iter().chain([31, 32, 33, 63, 64, 65, 200, 1536]) {
            for (name, a) in regimes(n, &mut rng) {
                let b: Vec<f32> = (0..n).map(|_| 4.0 * rng.f()).collect();
                let (got, want) = (dot_f32(path, &a, &b), vec_dot_f32_lanes(&a, &b));
                assert!(same_bits(got, want), "{} n={n} {name}: {got} vs twin {want}", path.name());
                let exact: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
                let scale: f64 = a.iter().zip(&b).map(|(x, y)| (f64::from(*x) * f64::from(*y)).abs()).sum();
                if scale < f64::from(f32::MAX) {
                    let err = (f64::from(got) - exact).abs();
                    assert!(
                        err <= 1e-6 * scale * (n as f64).sqrt() + 1e-30,
                        "{} n={n} {name}: {got} vs {exact}",
                        path.name()
                    );
                }
            }
        }
    }
    let a: Vec<f32> = (0..77).map(|i| i as f32 * 0.37).collect();
    let b: Vec<f32> = (0..77).map(|i| 1.0 - i as f32 * 0.11).collect();
    let f32le = |v: &[f32]| -> Vec<F32Le> { bytemuck::cast_slice(v).to_vec() };
    assert!(same_bits(dot_f32(KernelPath::Reference, &a, &b), vec_dot_f32_f32_ref(&f32le(&a), &f32le(&b))));
}

/// `mul_mat_t`'s row accumulation on AVX2 is the scalar loop's, bit for bit.
#[test]
fn scaled_rows_add_bit_identically() {
    let mut rng = Rng(11);
    let rows: [[f32; 37]; 8] = core::array::from_fn(|_| core::array::from_fn(|_| 8.0 * rng.f()));
    let d: [f32; 8] = core::array::from_fn(|_| rng.f());
    let start: Vec<f32> = (0..37).map(|_| rng.f()).collect();
    let mut want = start.clone();
    add_scaled_rows(KernelPath::Reference, &mut want, &d, &rows);
    for path in simd_paths() {
        for len in [37, 36, 1] {
            let mut got = start.clone();
            add_scaled_rows(path, &mut got[..len], &d, &rows);
            for e in 0..37 {
                let expect = if e < len { want[e] } else { start[e] };
                assert!(same_bits(got[e], expect), "{} len {len} [{e}]: {} vs {expect}", path.name(), got[e]);
            }
        }
    }
    // The scalar loop adds the terms one at a time in row order.
    let mut one = start.clone();
    add_scaled_rows(KernelPath::Reference, &mut one, &d, &rows);
    let mut acc = start[5];
    for r in 0..8 {
        acc += d[r] * rows[r][5];
    }
    assert!(same_bits(one[5], acc));
}

#[test]
fn rms_norm_matches_within_ulps() {
    let mut rng = Rng(2);
    for path in simd_paths() {
        for n in LENGTHS {
            for (name, x) in regimes(n, &mut rng) {
                if x.iter().any(|v| v.is_infinite()) {
                    continue; // inf / inf: NaN either way
                }
                for eps in [1e-5f32, 1e-6] {
                    let mut want = vec![0f32; n];
                    let mut got = vec![f32::NAN; n];
                    rms_norm_ref(&x, &mut want, eps);
                    rms_norm(path, &x, &mut got, eps);
                    for i in 0..n {
                        let tol = 2f32.powi(-21) * want[i].abs();
                        assert!(
                            same_bits(got[i], want[i]) || (got[i] - want[i]).abs() <= tol,
                            "{} n={n} {name} [{i}]: {} vs reference {}",
                            path.name(),
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn quantize_act_is_byte_identical() {
    let mut rng = Rng(3);
    for path in simd_paths() {
        for n in LENGTHS {
            let k = n * BLOCK;
            for (name, mut x) in regimes(k, &mut rng) {
                // Ties: values landing on .5 after scaling by 127 / amax (amax 127 in the block).
                if k >= BLOCK {
                    x[0] = 127.0;
                    x[1] = 0.5;
                    x[2] = -2.5;
                    x[3] = 126.5;
                }
                if name == "mixed" {
                    // Infinite amax: d = inf, multiplier 0 (inf * 0 = NaN quantizes to 0).
                    x.iter_mut().filter(|v| v.is_infinite()).for_each(|v| *v = 1.0e38);
                    if n > 1 {
                        x[BLOCK..2 * BLOCK].fill(0.0);
                        x[BLOCK + 5] = f32::INFINITY;
                    }
                }
                let empty = ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] };
                let mut want = vec![empty; n];
                let mut got = vec![ActBlock { d: 7.0, s: 7.0, qs: [7; BLOCK] }; n];
                quantize_act_ref(&x, &mut want);
                quantize_act(path, &x, &mut got);
                for (b, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.qs == w.qs && same_bits(g.d, w.d) && same_bits(g.s, w.s),
                        "{} blocks={n} {name} block {b}: {g:?} vs reference {w:?}",
                        path.name()
                    );
                }
            }
        }
    }
}

fn f16s(v: &[f32]) -> Vec<F16Le> {
    v.iter().map(|&x| F16Le::from_f32(x)).collect()
}

#[test]
fn flash_attn_row_matches_within_f16_rounding() {
    let mut rng = Rng(4);
    for path in simd_paths() {
        for dim in [1, 3, 8, 17, 64, 100, 128, 256, 257] {
            for n_keys in [0usize, 1, 3, 17, 64, 100] {
                // Query size: ordinary, and large (scores of hundreds: most weights underflow).
                for q_size in [1.0f32, 40.0] {
                    let q: Vec<f32> = (0..dim).map(|_| q_size * rng.f()).collect();
                    let k = f16s(&(0..dim * n_keys).map(|_| rng.f()).collect::<Vec<f32>>());
                    // Values: ordinary with a few large and tiny (f16 subnormal) entries.
                    let vf: Vec<f32> = (0..dim * n_keys)
                        .map(|i| match i % 11 {
                            3 => 3000.0 * rng.f(),
                            7 => 1.0e-6 * rng.f(),
                            _ => 4.0 * rng.f(),
                        })
                        .collect();
                    let v = f16s(&vf);
                    let vmax = v.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()));
                    let keys = n_keys / 3..n_keys;
                    let scale = 1.0 / (dim as f32).sqrt();
                    let key = |j: usize| &k[j * dim..(j + 1) * dim];
                    let value = |j: usize| &v[j * dim..(j + 1) * dim];
                    let (want_q16, want, _) = flash_run(dim, |q16, acc, out| {
                        flash_attn_row_ref(&q, q16, keys.clone(), key, value, scale, acc, out)
                    });
                    let (got_q16, got, _) = flash_run(dim, |q16, acc, out| {
                        flash_attn_row(path, &q, q16, keys.clone(), key, value, scale, acc, out)
                    });
                    assert_eq!(got_q16, want_q16, "{} dim={dim} keys={n_keys}: q16", path.name());
                    for i in 0..dim {
                        assert!(
                            (got[i] - want[i]).abs() <= 2f32.powi(-7) * vmax,
                            "{} dim={dim} keys={n_keys} q x{q_size} [{i}]: {} vs reference {}",
                            path.name(),
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

/// With queries and keys on a grid of 1/8 the key dots are exact in any summation order, so the
/// scores, and with them every softmax step and f16 rounding, must match the reference exactly.
#[test]
fn flash_attn_row_with_exact_scores_is_bit_identical() {
    let mut rng = Rng(6);
    let grid = |rng: &mut Rng| (16.0 * rng.f()).round() / 8.0;
    for path in simd_paths() {
        for dim in [8, 64, 128, 256] {
            for n_keys in [1usize, 5, 33, 70] {
                let q: Vec<f32> = (0..dim).map(|_| grid(&mut rng)).collect();
                let k = f16s(&(0..dim * n_keys).map(|_| grid(&mut rng)).collect::<Vec<f32>>());
                let v = f16s(&(0..dim * n_keys).map(|_| 4.0 * rng.f()).collect::<Vec<f32>>());
                let key = |j: usize| &k[j * dim..(j + 1) * dim];
                let value = |j: usize| &v[j * dim..(j + 1) * dim];
                let (_, want, want_end) = flash_run(dim, |q16, acc, out| {
                    flash_attn_row_ref(&q, q16, 0..n_keys, key, value, 0.3, acc, out)
                });
                let (_, got, got_end) = flash_run(dim, |q16, acc, out| {
                    flash_attn_row(path, &q, q16, 0..n_keys, key, value, 0.3, acc, out)
                });
                assert!(
                    same_end(got_end, want_end),
                    "{} dim={dim} keys={n_keys}: {got_end:?} vs {want_end:?}",
                    path.name()
                );
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        same_bits(g, w),
                        "{} dim={dim} keys={n_keys} [{i}]: {g} vs reference {w}",
                        path.name()
                    );
                }
            }
        }
    }
}

/// Several query rows over the same keys (`flash_attn_rows`): on every path, each row's `q16` and
/// output are bit-identical to that path's `flash_attn_row` of the row alone (so within the
/// tolerance of the reference above), for 1 to `FLASH_ROWS` rows, head sizes that take the
/// kernels' fast, general and fallback shapes, and key counts across chunk edges; the reference
/// twin is checked against `flash_attn_row_ref` the same way.
#[test]
fn flash_attn_rows_match_single_rows_bit_for_bit() {
    let mut rng = Rng(8);
    let mut paths = simd_paths();
    paths.push(KernelPath::Reference);
    for path in paths {
        // (520: past the 512 dimensions the x86 kernel keeps the query in f32 for.)
        for dim in [8, 16, 17, 24, 48, 64, 72, 128, 136, 256, 520] {
            for n_keys in [0usize, 1, 3, 31, 33, 64, 100, 200, 300, 700] {
                for rows in 1..=FLASH_ROWS {
                    let q_size = if n_keys % 2 == 0 { 1.0 } else { 40.0 };
                    let qs: Vec<Vec<f32>> =
                        (0..rows).map(|_| (0..dim).map(|_| q_size * rng.f()).collect()).collect();
                    let k = f16s(&(0..dim * n_keys).map(|_| rng.f()).collect::<Vec<f32>>());
                    let vf: Vec<f32> = (0..dim * n_keys)
                        .map(|i| match i % 11 {
                            3 => 3000.0 * rng.f(),
                            7 => 1.0e-6 * rng.f(),
                            _ => 4.0 * rng.f(),
                        })
                        .collect();
                    let v = f16s(&vf);
                    let keys = n_keys / 4..n_keys;
                    let scale = 1.0 / (dim as f32).sqrt();
                    let key = |j: usize| &k[j * dim..(j + 1) * dim];
                    let value = |j: usize| &v[j * dim..(j + 1) * dim];
                    let qrefs: Vec<&[f32]> = qs.iter().map(|q| q.as_slice()).collect();
                    let (mut q16, mut acc) =
                        (vec![F16Le::from_f32(9.0); rows * dim], vec![F16Le::from_f32(9.0); rows * dim]);
                    let mut outs = vec![vec![9.0f32; dim]; rows];
                    let mut orefs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    let ends = if path == KernelPath::Reference {
                        flash_attn_rows_ref(
                            &qrefs,
                            &mut q16,
                            keys.clone(),
                            key,
                            value,
                            scale,
                            &mut acc,
                            &mut orefs,
                        )
                    } else {
                        flash_attn_rows(
                            path,
                            &qrefs,
                            &mut q16,
                            keys.clone(),
                            key,
                            value,
                            scale,
                            &mut acc,
                            &mut orefs,
                        )
                    };
                    for (r, q) in qs.iter().enumerate() {
                        let (want_q16, want, want_end) = flash_run(dim, |q16, acc, out| {
                            if path == KernelPath::Reference {
                                flash_attn_row_ref(q, q16, keys.clone(), key, value, scale, acc, out)
                            } else {
                                flash_attn_row(path, q, q16, keys.clone(), key, value, scale, acc, out)
                            }
                        });
                        let what = format!("{} dim={dim} keys={n_keys} rows={rows} row {r}", path.name());
                        assert_eq!(&q16[r * dim..(r + 1) * dim], &want_q16[..], "{what}: q16");
                        assert!(
                            same_end(ends[r], want_end),
                            "{what}: {:?} vs single row {want_end:?}",
                            ends[r]
                        );
                        for (i, (&g, &w)) in outs[r].iter().zip(&want).enumerate() {
                            assert!(same_bits(g, w), "{what} [{i}]: {g} vs single row {w}");
                        }
                    }
                }
            }
        }
    }
}

/// Paths in FEAT_FP16 arithmetic (the `fp16` path, through the dispatch, so it must reach the
/// FEAT_FP16 kernels) against their twins `flash_attn_row(s)_f16arith_ref`, which round every f16
/// operation exactly once: see [`check_flash_paths_against_twin`] for the cases.
#[cfg(target_arch = "aarch64")]
#[test]
fn flash_attn_f16_arith_is_bit_identical_to_its_twin() {
    check_flash_paths_against_twin(&[KernelPath::NeonFp16], FlashTwin::F16Arith, 10);
}

/// The NEON paths against their twin `flash_attn_row(s)_f32dot_ref` (key dots in f32 in ggml's
/// x86 order): see [`check_flash_paths_against_twin`] for the cases.
#[test]
fn flash_attn_neon_is_bit_identical_to_its_f32dot_twin() {
    check_flash_paths_against_twin(&[KernelPath::Neon, KernelPath::NeonDotprod], FlashTwin::F32Dot, 12);
}

/// The scalar twin a flash-attention path must equal bit for bit.
#[derive(Clone, Copy, Debug)]
enum FlashTwin {
    F32Dot,
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    F16Arith,
}

/// Each available path of `paths` against `twin`, bit for bit (NaN-aware), single rows and 1 to
/// `FLASH_ROWS` rows: head sizes that are multiples of 32 (the kernels' pieces), of 8 only
/// (zero-padded keys and queries, 8-dimension value slices), not of 8 and past 256 (the twin
/// itself); key counts 0, 1, 2 and across chunk edges; queries ordinary and large (most weights
/// underflow); values with large, tiny (f16 subnormal) and overflowing entries; keys large enough
/// for the f16 products, sums and accumulators to overflow.
fn check_flash_paths_against_twin(paths: &[KernelPath], twin: FlashTwin, seed: u64) {
    use pinfer::kernels::reference::{flash_attn_row_f16arith_ref, flash_attn_rows_f16arith_ref};
    let mut rng = Rng(seed);
    for &path in paths.iter().filter(|p| p.is_available()) {
        for dim in [3, 8, 16, 17, 24, 32, 40, 64, 72, 96, 128, 136, 200, 256, 264] {
            for n_keys in [0usize, 1, 2, 3, 31, 32, 33, 64, 100] {
                for regime in 0..4 {
                    let rows = 1 + (n_keys + regime + dim) % FLASH_ROWS;
                    let q_size = [1.0f32, 40.0, 4.0, 300.0][regime];
                    let k_size = [1.0f32, 1.0, 250.0, 8.0][regime];
                    let qs: Vec<Vec<f32>> =
                        (0..rows).map(|_| (0..dim).map(|_| q_size * rng.f()).collect()).collect();
                    let k = f16s(&(0..dim * n_keys).map(|_| k_size * rng.f()).collect::<Vec<f32>>());
                    let vf: Vec<f32> = (0..dim * n_keys)
                        .map(|i| match (i % 13, regime) {
                            (3, _) => 3000.0 * rng.f(),
                            (7, _) => 1.0e-6 * rng.f(),
                            (5, 3) => 65000.0 * rng.f().signum(),
                            _ => 4.0 * rng.f(),
                        })
                        .collect();
                    let v = f16s(&vf);
                    let keys = n_keys / 4..n_keys;
                    let scale = 1.0 / (dim as f32).sqrt();
                    let key = |j: usize| &k[j * dim..(j + 1) * dim];
                    let value = |j: usize| &v[j * dim..(j + 1) * dim];
                    let what = format!("{} dim={dim} keys={n_keys} rows={rows} regime {regime}", path.name());
                    // Single rows.
                    let (want_q16, want, want_end) = flash_run(dim, |q16, acc, out| {
                        let (q, k) = (&qs[0], keys.clone());
                        match twin {
                            FlashTwin::F32Dot => {
                                flash_attn_row_f32dot_ref(q, q16, k, key, value, scale, acc, out)
                            }
                            FlashTwin::F16Arith => {
                                flash_attn_row_f16arith_ref(q, q16, k, key, value, scale, acc, out)
                            }
                        }
                    });
                    let (got_q16, got, got_end) = flash_run(dim, |q16, acc, out| {
                        flash_attn_row(path, &qs[0], q16, keys.clone(), key, value, scale, acc, out)
                    });
                    assert_eq!(got_q16, want_q16, "{what}: single row q16");
                    assert!(same_end(got_end, want_end), "{what}: single row {got_end:?} vs {want_end:?}");
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        assert!(same_bits(g, w), "{what} single row [{i}]: {g} vs {twin:?} twin {w}");
                    }
                    // Several rows.
                    let qrefs: Vec<&[f32]> = qs.iter().map(|q| q.as_slice()).collect();
                    let run = |use_twin: bool| {
                        let (mut q16, mut acc) =
                            (vec![F16Le::from_f32(9.0); rows * dim], vec![F16Le::from_f32(9.0); rows * dim]);
                        let mut outs = vec![vec![9.0f32; dim]; rows];
                        let mut orefs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                        let (q, k, o) = (&qrefs[..], keys.clone(), &mut orefs[..]);
                        let ends = match (use_twin, twin) {
                            (false, _) => {
                                flash_attn_rows(path, q, &mut q16, k, key, value, scale, &mut acc, o)
                            }
                            (true, FlashTwin::F32Dot) => {
                                flash_attn_rows_f32dot_ref(q, &mut q16, k, key, value, scale, &mut acc, o)
                            }
                            (true, FlashTwin::F16Arith) => {
                                flash_attn_rows_f16arith_ref(q, &mut q16, k, key, value, scale, &mut acc, o)
                            }
                        };
                        (q16, outs, ends)
                    };
                    let ((want_q16, want, want_ends), (got_q16, got, got_ends)) = (run(true), run(false));
                    assert_eq!(got_q16, want_q16, "{what}: q16");
                    for r in 0..rows {
                        assert!(
                            same_end(got_ends[r], want_ends[r]),
                            "{what} row {r}: {:?} vs {:?}",
                            got_ends[r],
                            want_ends[r]
                        );
                    }
                    for r in 0..rows {
                        for (i, (&g, &w)) in got[r].iter().zip(&want[r]).enumerate() {
                            assert!(same_bits(g, w), "{what} row {r} [{i}]: {g} vs {twin:?} twin {w}");
                        }
                    }
                }
            }
        }
    }
}

/// RoPE by a per-position table (`rope_table_ref` once, `rope_rotate` per head) is bit-identical to
/// `rope_ref` on every path: odd pair counts (vector tails), rows longer than `n_rot`, both pair
/// layouts, frequency factors and scales, large positions.
#[test]
fn rope_by_table_is_bit_identical() {
    let mut rng = Rng(10);
    let mut paths = simd_paths();
    paths.push(KernelPath::Reference);
    let factors: Vec<f32> = (0..200).map(|_| 1.0 + 4.0 * rng.f().abs()).collect();
    for path in paths {
        for (n_rot, len) in [(2, 2), (6, 9), (8, 8), (14, 20), (64, 64), (96, 128), (128, 128), (400, 401)] {
            for neox in [false, true] {
                for (pos, scaled) in [(0, false), (1, true), (17, false), (1000, true), (123_456, false)] {
                    let p = RopeParams {
                        n_rot,
                        neox,
                        freq_base: if scaled { 500_000.0 } else { 10_000.0 },
                        freq_scale: if scaled { 0.25 } else { 1.0 },
                        freq_factors: scaled.then_some(&factors[..]),
                        yarn: None,
                    };
                    let x: Vec<f32> = (0..len).map(|_| 3.0 * rng.f()).collect();
                    let mut want = vec![9.0f32; len];
                    rope_ref(&x, &mut want, pos, &p);
                    let half = n_rot / 2;
                    let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
                    rope_table_ref(pos, &p, 0, &mut cos, &mut sin);
                    let mut got = vec![9.0f32; len];
                    rope_rotate(path, &x, &mut got, &cos, &sin, neox);
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            same_bits(g, w),
                            "{} n_rot={n_rot} len={len} neox={neox} pos={pos} [{i}]: {g} vs {w}",
                            path.name()
                        );
                    }
                }
            }
        }
    }
}

/// f32 -> f16 rows (the KV cache writes): bit-identical to the reference on every regime (ties,
/// overflow to infinity, f16 subnormals and underflow to zero), NaNs staying NaNs.
#[test]
fn f32_to_f16_is_bit_identical() {
    let mut rng = Rng(12);
    for path in simd_paths() {
        for n in LENGTHS {
            let mut cases = regimes(n, &mut rng);
            // Exact f16 ties (halfway between neighbours) and values near the f16 range's edges.
            cases.push(("ties", (0..n).map(|i| 1.0 + (2 * i + 1) as f32 * 2f32.powi(-11)).collect()));
            cases.push((
                "edges",
                (0..n).map(|i| [65_520.0, 65_519.0, 6.0e-8, 2.9e-8, -1.0e-5, f32::NAN][i % 6]).collect(),
            ));
            for (what, x) in cases {
                let mut want = vec![F16Le::from_bits(7); n];
                let mut got = vec![F16Le::from_bits(7); n];
                f32_to_f16_ref(&x, &mut want);
                f32_to_f16(path, &x, &mut got);
                for i in 0..n {
                    let (g, w) = (got[i].to_f32(), want[i].to_f32());
                    assert!(
                        got[i] == want[i] || (g.is_nan() && w.is_nan()),
                        "{} {what} n={n} [{i}] f16({}): {g} vs {w}",
                        path.name(),
                        x[i]
                    );
                }
            }
        }
    }
}

/// Runs one flash attention row into fresh buffers (holding junk first); returns `(q16, out)`.
fn flash_run(
    dim: usize,
    f: impl Fn(&mut [F16Le], &mut [F16Le], &mut [f32]) -> RowSoftmax,
) -> (Vec<F16Le>, Vec<f32>, RowSoftmax) {
    let (mut q16, mut acc, mut out) =
        (vec![F16Le::from_f32(9.0); dim], vec![F16Le::from_f32(9.0); dim], vec![9.0; dim]);
    let end = f(&mut q16, &mut acc, &mut out);
    (q16, out, end)
}

/// Two softmax ends with the same bits.
fn same_end(a: RowSoftmax, b: RowSoftmax) -> bool {
    same_bits(a.max, b.max) && same_bits(a.sum, b.sum)
}

/// A packed random `rows` x `k` matrix of `ty` (random quants, small scales).
fn matrix(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng) -> (PackedFormat, Vec<u8>, Vec<u8>) {
    let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
    let mut src: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for block in src.chunks_exact_mut(ty.block_bytes()) {
        let d = f16(0.001 + 0.01 * rng.f().abs());
        match ty {
            GgmlType::Q6_K => {
                let n = block.len();
                block[n - 2..].copy_from_slice(&d);
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&f16(0.05 * rng.f().abs()));
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&f16(0.05 * rng.f()));
            }
            _ => block[..2].copy_from_slice(&d),
        }
    }
    let format = PackedFormat::for_type(ty).unwrap();
    let (qn, sn) = packed_bytes(format, rows, k);
    let (mut q, mut s) = (vec![0u8; qn], vec![0u8; sn]);
    assert_eq!(pack(ty, &src, rows, k, &mut q, &mut s), Ok(format));
    (format, q, s)
}

#[test]
fn packed_matmul_over_many_groups() {
    let mut rng = Rng(5);
    let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_1, GgmlType::Q6_K];
    for path in simd_paths() {
        for ty in types {
            // Block counts 1, 2, 3, 5 (and 8, 16): the kernels peel block 0 and pair the rest.
            let ks: &[usize] = if ty == GgmlType::Q6_K { &[256, 512] } else { &[32, 64, 96, 160] };
            for (&k, tokens) in ks.iter().cycle().zip([1usize, 2, 5, 16, 35, 1, 1]) {
                let rows = 4 * 75;
                let (format, q, s) = matrix(ty, rows, k, &mut rng);
                let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
                let acts = random_acts(tokens, k, &mut rng);
                let act_refs: Vec<&[ActBlock]> = acts.iter().map(|a| a.as_slice()).collect();
                // Whole runs of 4 and 2 groups, odd remainders, runs past 32 groups, odd starts.
                for groups in [0..75, 1..75, 3..70, 0..5, 2..3, 40..47] {
                    let rows = 4 * groups.len();
                    let want = matmul_run(&act_refs, rows, |a, o| matmul_ref(&w, groups.clone(), a, o));
                    let got =
                        matmul_run(&act_refs, rows, |a, o| packed_matmul(path, &w, groups.clone(), a, o));
                    for t in 0..tokens {
                        for (j, (&g, &v)) in got[t].iter().zip(&want[t]).enumerate() {
                            let r = 4 * groups.start + j;
                            let mut wr = vec![0f32; k];
                            dequantize_packed_row(&w, r, &mut wr);
                            let a =
                                acts[t].iter().flat_map(|b| b.qs.iter().map(move |&q| b.d * f32::from(q)));
                            let size = wr.iter().zip(a).map(|(&w, a)| (w * a).abs()).sum::<f32>()
                                + acts[t].iter().map(|b| b.s.abs()).sum::<f32>();
                            assert!(
                                (g - v).abs() <= 1e-5 * size,
                                "{} {ty:?} groups {groups:?} tokens {tokens} token {t} row {r}: {g} vs reference {v}",
                                path.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `tokens` activation rows of `k` values in [-3, 3), quantized.
fn random_acts(tokens: usize, k: usize, rng: &mut Rng) -> Vec<Vec<ActBlock>> {
    (0..tokens)
        .map(|_| {
            let x: Vec<f32> = (0..k).map(|_| 3.0 * rng.f()).collect();
            let mut a = vec![ActBlock { d: 0.0, s: 0.0, qs: [0; BLOCK] }; k / BLOCK];
            quantize_act_ref(&x, &mut a);
            a
        })
        .collect()
}

/// Runs a packed matmul over `acts` into fresh rows of `rows` NaNs; returns them.
fn matmul_run(
    acts: &[&[ActBlock]],
    rows: usize,
    f: impl Fn(&[&[ActBlock]], &mut [&mut [f32]]),
) -> Vec<Vec<f32>> {
    let mut outs = vec![vec![f32::NAN; rows]; acts.len()];
    let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    f(acts, &mut out_refs);
    outs
}

/// A server batches the decode steps of several users into one matmul: on the board's kernel
/// paths (and the reference) a token's results must not depend on what else is in the batch, or
/// the same greedy request would give another text under load, and a batch of guesses (`--lookup`,
/// `-md`) would decode another text than single tokens. Each token of a batch of `n` is compared
/// bit for bit with the same token alone, over whole matrices and the group ranges the worker
/// threads take (odd starts and remainders), on every path.
#[test]
fn packed_matmul_is_batch_invariant() {
    let mut rng = Rng(11);
    let paths: Vec<KernelPath> = KernelPath::ALL.into_iter().filter(|p| p.is_available()).collect();
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    for path in paths {
        for ty in types {
            // Within the kernels' chunking and well past it; odd and partial segments of blocks.
            let super_blocks = matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K);
            let ks: &[usize] = if super_blocks { &[256, 768, 2048] } else { &[256, 576, 2080] };
            for &k in ks {
                let rows = 4 * 21;
                let (format, q, s) = matrix(ty, rows, k, &mut rng);
                let w = PackedMatrix { format, rows, k, quants: &q, scales: &s };
                let acts = random_acts(20, k, &mut rng);
                let act_refs: Vec<&[ActBlock]> = acts.iter().map(|a| a.as_slice()).collect();
                for groups in [0..21, 1..21, 3..8, 5..6] {
                    let n_rows = 4 * groups.len();
                    let run = |a: &[&[ActBlock]]| {
                        matmul_run(a, n_rows, |a, o| packed_matmul(path, &w, groups.clone(), a, o))
                    };
                    let alone: Vec<Vec<f32>> = act_refs.iter().map(|a| run(&[a]).remove(0)).collect();
                    for n in [2, 3, 4, 5, 7, 16, 17, 20] {
                        let batch = run(&act_refs[..n]);
                        for (t, (got, want)) in batch.iter().zip(&alone).enumerate() {
                            let differs = got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits());
                            assert!(
                                differs.is_none(),
                                "{} {ty:?} k {k} groups {groups:?}: token {t} of {n} differs from the same token alone at row {:?}: {} vs {}",
                                path.name(),
                                differs,
                                got[differs.unwrap()],
                                want[differs.unwrap()]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The cache types attention reads (`-ctk/-ctv`).
fn kv_cache_types() -> Vec<GgmlType> {
    (0..64).filter_map(GgmlType::from_u32).filter(|t| t.is_kv_cache_type()).collect()
}

/// `rows` rows of `dim` values stored as cache type `ty` (as a cache write stores them).
fn cache_rows(ty: GgmlType, rows: &[f32], dim: usize) -> Vec<u8> {
    let row_bytes = ty.bytes_for(dim as u64).unwrap() as usize;
    let mut out = vec![0u8; rows.len() / dim * row_bytes];
    for (x, o) in rows.chunks_exact(dim).zip(out.chunks_exact_mut(row_bytes)) {
        assert!(ty.kv_writer().unwrap()(x, o), "{ty}");
    }
    out
}

/// Runs the typed attention kernel with `ops` on up to FLASH_ROWS queries, with value scratch for
/// `chunk` keys (the kernel takes that many at a time).
#[allow(clippy::too_many_arguments)]
fn typed_run(
    ops: &KvOps,
    qs: &[Vec<f32>],
    keys: &[std::ops::Range<usize>],
    k: &[u8],
    kb: usize,
    v: &[u8],
    vb: usize,
    dim: usize,
    scale: f32,
    chunk: usize,
) -> (Vec<Vec<f32>>, Vec<RowSoftmax>) {
    let mut outs: Vec<Vec<f32>> = qs.iter().map(|_| vec![f32::NAN; dim]).collect();
    let mut qconv = vec![0u8; qs.len() * 4 * dim];
    let (mut acc, mut vals) = (vec![0f32; qs.len() * dim], vec![0f32; chunk * dim]);
    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
    let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
    let ends = flash_attn_rows_typed(
        ops,
        &q_refs,
        &mut qconv,
        keys,
        |j| &k[j * kb..(j + 1) * kb],
        |j| &v[j * vb..(j + 1) * vb],
        scale,
        &mut acc,
        &mut vals,
        &mut out_refs,
    );
    (outs, ends[..qs.len()].to_vec())
}

/// Attention over a quantized (or f32/bf16) KV cache: every SIMD path's row operations give the
/// reference operations' bits (integer block sums, the same f32 products, fused updates), for
/// every pair of cache types, 1 to FLASH_ROWS rows, odd key counts and sizes, ordinary, large and
/// tiny values.
#[test]
fn kv_cache_attention_is_bit_identical_to_reference_ops() {
    let mut rng = Rng(11);
    let types = kv_cache_types();
    for path in simd_paths() {
        for &kt in &types {
            for &vt in &types {
                for dim in [32, 64, 96, 256] {
                    for (n_keys, n_rows, size) in
                        [(1usize, 1usize, 1.0f32), (17, 3, 1.0), (100, 4, 300.0), (64, 2, 1e-3)]
                    {
                        let qs: Vec<Vec<f32>> =
                            (0..n_rows).map(|_| (0..dim).map(|_| 3.0 * rng.f()).collect()).collect();
                        let kf: Vec<f32> = (0..dim * n_keys).map(|_| size * rng.f()).collect();
                        let vf: Vec<f32> = (0..dim * n_keys).map(|_| size * rng.f()).collect();
                        let (k, v) = (cache_rows(kt, &kf, dim), cache_rows(vt, &vf, dim));
                        let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
                        let scale = 1.0 / (dim as f32).sqrt();
                        let keys = n_keys / 4..n_keys;
                        let reference = KvOps::reference(kt, vt).unwrap();
                        let simd = KvOps::new(path, kt, vt).unwrap();
                        let keys = vec![keys; n_rows];
                        // The reference key by key; the SIMD path a chunk at a time, and 3 keys
                        // at a time (value scratch for 3).
                        let (want, want_ends) =
                            typed_run(&reference, &qs, &keys, &k, kb, &v, vb, dim, scale, 1);
                        let chunk = [KEY_CHUNK, 3][(n_keys + dim) % 2];
                        let (got, got_ends) = typed_run(&simd, &qs, &keys, &k, kb, &v, vb, dim, scale, chunk);
                        for (r, (g, w)) in got_ends.iter().zip(&want_ends).enumerate() {
                            assert!(
                                same_end(*g, *w),
                                "{} K {kt} V {vt} dim={dim} keys={n_keys} row {r}: {g:?} vs {w:?}",
                                path.name()
                            );
                        }
                        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                            for i in 0..dim {
                                assert!(
                                    same_bits(g[i], w[i]),
                                    "{} K {kt} V {vt} dim={dim} keys={n_keys} row {r} [{i}]: {} vs reference {}",
                                    path.name(),
                                    g[i],
                                    w[i]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// ALiBi (jina-bert-v2's bidirectional attention): ggml's slopes; each row's scores biased by
/// `slope * -|query - j|` after the scale, as a float64 softmax with that bias computes it; every
/// SIMD path the reference's bits; slopes of 0 the unbiased kernel's bits.
#[test]
fn kv_cache_attention_with_alibi_matches_the_biased_softmax_on_every_path() {
    // 4 heads: 2^-2, 2^-4, 2^-6, 2^-8; 12 heads: the first 8 2^-(h + 1), then 2^-0.5, 2^-1.5.
    let slopes: Vec<f32> = (0..4).map(|h| alibi_slope(8.0, 4, h)).collect();
    assert_eq!(slopes, [0.25, 0.0625, 0.015625, 0.00390625]);
    assert_eq!(alibi_slope(8.0, 12, 7), 2f32.powi(-8));
    assert!((alibi_slope(8.0, 12, 8) - 0.5f32.sqrt()).abs() < 1e-6);
    assert!((alibi_slope(8.0, 12, 9) - 2f32.powf(-1.5)).abs() < 1e-6);
    assert_eq!(alibi_slope(0.0, 4, 2), 1.0);
    let mut rng = Rng(29);
    let (dim, n_keys) = (64, 37);
    for (kt, vt) in
        [(GgmlType::F32, GgmlType::F32), (GgmlType::F16, GgmlType::F16), (GgmlType::Q8_0, GgmlType::F32)]
    {
        let qs: Vec<Vec<f32>> = (0..8).map(|_| (0..dim).map(|_| 3.0 * rng.f()).collect()).collect();
        let kf: Vec<f32> = (0..dim * n_keys).map(|_| rng.f()).collect();
        let vf: Vec<f32> = (0..dim * n_keys).map(|_| rng.f()).collect();
        let (k, v) = (cache_rows(kt, &kf, dim), cache_rows(vt, &vf, dim));
        let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
        let scale = 1.0 / (dim as f32).sqrt();
        // Rows: 4 heads of a token at key row 3 and of one at row 30, over keys 2..35.
        let alibi: Vec<Alibi> =
            (0..8).map(|r| Alibi { slope: slopes[r % 4], query: if r < 4 { 3 } else { 30 } }).collect();
        let keys = vec![2..35; 8];
        let run = |ops: &KvOps, alibi: Option<&[Alibi]>, chunk: usize| {
            let mut outs: Vec<Vec<f32>> = qs.iter().map(|_| vec![f32::NAN; dim]).collect();
            let mut qconv = vec![0u8; qs.len() * 4 * dim];
            let (mut acc, mut vals) = (vec![0f32; qs.len() * dim], vec![0f32; chunk * dim]);
            let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
            let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            flash_attn_rows_typed_alibi(
                ops,
                &q_refs,
                &mut qconv,
                &keys,
                alibi,
                |j| &k[j * kb..(j + 1) * kb],
                |j| &v[j * vb..(j + 1) * vb],
                scale,
                &mut acc,
                &mut vals,
                &mut out_refs,
            );
            outs
        };
        let reference = KvOps::reference(kt, vt).unwrap();
        let want = run(&reference, Some(&alibi), 1);
        if kt == GgmlType::F32 {
            // The float64 softmax with the bias.
            for (r, got) in want.iter().enumerate() {
                let s: Vec<f64> = (2..35)
                    .map(|j| {
                        let dot: f64 = (0..dim).map(|i| qs[r][i] as f64 * kf[j * dim + i] as f64).sum();
                        dot * scale as f64 - alibi[r].slope as f64 * (alibi[r].query as f64 - j as f64).abs()
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for i in 0..dim {
                    let exact: f64 = (2..35).map(|j| w[j - 2] * vf[j * dim + i] as f64).sum::<f64>() / sum;
                    assert!((got[i] as f64 - exact).abs() < 1e-5, "row {r} [{i}]: {} vs {exact}", got[i]);
                }
            }
        }
        // Slopes of 0 add nothing: the unbiased kernel's bits.
        let flat: Vec<Alibi> = alibi.iter().map(|a| Alibi { slope: 0.0, ..*a }).collect();
        let unbiased = run(&reference, None, 1);
        assert_eq!(run(&reference, Some(&flat), 1), unbiased, "{kt}: slopes of 0");
        assert_ne!(want, unbiased, "{kt}: ALiBi changes the rows");
        for path in simd_paths() {
            let simd = KvOps::new(path, kt, vt).unwrap();
            for chunk in [KEY_CHUNK, 3] {
                let got = run(&simd, Some(&alibi), chunk);
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    let differs = (0..dim).find(|&i| !same_bits(g[i], w[i]));
                    assert!(
                        differs.is_none(),
                        "{} {kt}/{vt} chunk {chunk} row {r}: {differs:?}",
                        path.name()
                    );
                }
            }
        }
    }
}

/// A prompt's tokens in one call (TYPED_ROWS rows, each with its own keys: causal ends, a window's
/// starts, an empty row, two sequences' disjoint rows) give every row the bits it gets alone, on
/// every path.
#[test]
fn kv_cache_attention_rows_with_their_own_keys_match_single_rows() {
    let mut rng = Rng(13);
    let (dim, n_keys) = (64, 300);
    for path in [KernelPath::Reference].into_iter().chain(simd_paths()) {
        for (kt, vt) in [
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::Q4_0, GgmlType::F16),
            (GgmlType::F32, GgmlType::Q5_1),
        ] {
            let ops = KvOps::new(path, kt, vt).unwrap();
            let n = TYPED_ROWS;
            let qs: Vec<Vec<f32>> = (0..n).map(|_| (0..dim).map(|_| 2.0 * rng.f()).collect()).collect();
            let kf: Vec<f32> = (0..dim * n_keys).map(|_| rng.f()).collect();
            let vf: Vec<f32> = (0..dim * n_keys).map(|_| 3.0 * rng.f()).collect();
            let (k, v) = (cache_rows(kt, &kf, dim), cache_rows(vt, &vf, dim));
            let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
            let keys: Vec<std::ops::Range<usize>> = (0..n)
                .map(|r| match r {
                    0 => 5..5,
                    1..=8 => 0..100 + 7 * r,
                    9..=12 => (30 * r - 250)..(30 * r - 100),
                    _ => 200..200 + 17 * (r - 12),
                })
                .collect();
            let (together, ends) = typed_run(&ops, &qs, &keys, &k, kb, &v, vb, dim, 0.125, KEY_CHUNK);
            for r in 0..n {
                let (alone, end) =
                    typed_run(&ops, &qs[r..r + 1], &keys[r..r + 1], &k, kb, &v, vb, dim, 0.125, KEY_CHUNK);
                assert!(
                    same_end(ends[r], end[0]),
                    "{} K {kt} V {vt} row {r}: {:?} together, {:?} alone",
                    path.name(),
                    ends[r],
                    end[0]
                );
                for i in 0..dim {
                    assert!(
                        same_bits(together[r][i], alone[0][i]),
                        "{} K {kt} V {vt} row {r} ({:?}) [{i}]: {} together, {} alone",
                        path.name(),
                        keys[r],
                        together[r][i],
                        alone[0][i]
                    );
                }
            }
            assert!(together[0].iter().all(|&x| x == 0.0), "no keys: zeros");
        }
    }
}

/// The typed kernel computes attention: against softmax(q k / sqrt(d)) v in f64 over the values
/// the cache holds, within what the query's conversion costs (exact for f32 keys: 1e-5 of
/// max |v|; a q8_0/q8_1 query, about 1/254 of each query value, moves scores by up to ~1%: 3e-2;
/// q8_0 keys' 15-bit query, 1/32512 of the block's largest value: 1e-3).
#[test]
fn kv_cache_attention_is_attention() {
    let mut rng = Rng(12);
    let dim = 64;
    let n_keys = 50;
    for &kt in &kv_cache_types() {
        for vt in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0] {
            let qs: Vec<Vec<f32>> = (0..3).map(|_| (0..dim).map(|_| 2.0 * rng.f()).collect()).collect();
            let kf: Vec<f32> = (0..dim * n_keys).map(|_| rng.f()).collect();
            let vf: Vec<f32> = (0..dim * n_keys).map(|_| 4.0 * rng.f()).collect();
            let (k, v) = (cache_rows(kt, &kf, dim), cache_rows(vt, &vf, dim));
            let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
            let widen = |ty: GgmlType, bytes: &[u8]| {
                let mut out = vec![0f32; bytes.len() / ty.bytes_for(dim as u64).unwrap() as usize * dim];
                pinfer::quant::dequantize_row_ref(ty, bytes, &mut out).unwrap();
                out
            };
            let (kx, vx) = (widen(kt, &k), widen(vt, &v));
            let vmax = vx.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = 1.0 / (dim as f32).sqrt();
            let (got, ends) = typed_run(
                &KvOps::reference(kt, vt).unwrap(),
                &qs,
                &vec![0..n_keys; 3],
                &k,
                kb,
                &v,
                vb,
                dim,
                scale,
                KEY_CHUNK,
            );
            for ((q, g), end) in qs.iter().zip(&got).zip(&ends) {
                let s: Vec<f64> = (0..n_keys)
                    .map(|j| {
                        (0..dim).map(|i| f64::from(q[i]) * f64::from(kx[j * dim + i])).sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                // Where the softmax ended: the log of its total, `max + ln sum`, is the scores'.
                let smax = s.iter().fold(0f64, |a, x| a.max(x.abs()));
                let lse = f64::from(end.max) + f64::from(end.sum).ln();
                let rel = match kt {
                    GgmlType::F32 => 1e-5,
                    GgmlType::Q8_0 => 1e-3,
                    _ => 3e-2,
                };
                let lse_tol = rel * smax.max(1.0);
                assert!(
                    (lse - (m + total.ln())).abs() <= lse_tol,
                    "K {kt} V {vt}: {end:?} vs max {m} sum {total}"
                );
                let tol = rel * f64::from(vmax);
                for i in 0..dim {
                    let want: f64 =
                        (0..n_keys).map(|j| w[j] * f64::from(vx[j * dim + i])).sum::<f64>() / total;
                    assert!(
                        (f64::from(g[i]) - want).abs() <= tol,
                        "K {kt} V {vt} [{i}]: {} vs {want} (tolerance {tol})",
                        g[i]
                    );
                }
            }
        }
    }
}

/// Runs the tiled prompt attention on `path` (rows of `dk`, outputs of `dv`).
#[allow(clippy::too_many_arguments)]
fn tile_run(
    path: KernelPath,
    ty: GgmlType,
    qs: &[Vec<f32>],
    keys: &[std::ops::Range<usize>],
    k: &[u8],
    kb: usize,
    v: &[u8],
    vb: usize,
    dv: usize,
    scale: f32,
) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = qs.iter().map(|_| vec![f32::NAN; dv]).collect();
    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
    let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
    let mut scratch = Box::new(TileScratch::new());
    flash_attn_tile(
        path,
        ty,
        &q_refs,
        keys,
        |j| &k[j * kb..(j + 1) * kb],
        |j| &v[j * vb..(j + 1) * vb],
        scale,
        &mut scratch,
        &mut out_refs,
    );
    outs
}

/// The tiled prompt attention (f16 and f32 caches) on every path gives each row the bits
/// `flash_attn_tile_ref` gives it alone: 1 to tile_rows rows (lane tails), head sizes that are
/// and are not multiples of the vectors, keys of their own per row (causal ends, a window's
/// starts inside a tile, an empty row, two sequences' disjoint rows, tile-aligned and not),
/// ordinary, large and tiny values.
#[test]
fn prompt_tiles_are_bit_identical_to_the_reference() {
    let mut rng = Rng(21);
    let n_keys = 300;
    for path in [KernelPath::Reference].into_iter().chain(simd_paths()) {
        for ty in [GgmlType::F16, GgmlType::F32] {
            for (dk, dv) in [(64, 64), (96, 96), (256, 256), (40, 24), (7, 9), (128, 64)] {
                for (n, size) in [(1usize, 1.0f32), (3, 1.0), (9, 30.0), (32, 1e-3), (tile_rows(dk, dv), 2.0)]
                {
                    let n = n.min(tile_rows(dk, dv));
                    let qs: Vec<Vec<f32>> =
                        (0..n).map(|_| (0..dk).map(|_| 2.0 * rng.f()).collect()).collect();
                    let kf: Vec<f32> = (0..dk * n_keys).map(|_| size * rng.f()).collect();
                    let vf: Vec<f32> = (0..dv * n_keys).map(|_| size * rng.f()).collect();
                    let (k, v) = (cache_rows(ty, &kf, dk), cache_rows(ty, &vf, dv));
                    let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
                    let keys: Vec<std::ops::Range<usize>> = (0..n)
                        .map(|r| match r % 6 {
                            0 if r > 0 => 5..5,
                            1 => 0..100 + 7 * r,
                            2 => (13 + 9 * r)..(150 + r),
                            3 => 200..(200 + 17 * r).min(n_keys),
                            4 => 64..96,
                            _ => (r % 5)..(250 + r % 40),
                        })
                        .map(|k| k.start.min(n_keys)..k.end.min(n_keys))
                        .collect();
                    let scale = 1.0 / (dk as f32).sqrt();
                    let got = tile_run(path, ty, &qs, &keys, &k, kb, &v, vb, dv, scale);
                    for r in 0..n {
                        let mut want = vec![f32::NAN; dv];
                        flash_attn_tile_ref(
                            ty,
                            &qs[r],
                            keys[r].clone(),
                            |j| &k[j * kb..(j + 1) * kb],
                            |j| &v[j * vb..(j + 1) * vb],
                            scale,
                            &mut want,
                        );
                        for i in 0..dv {
                            assert!(
                                same_bits(got[r][i], want[i]),
                                "{} {ty} dk={dk} dv={dv} rows={n} row {r} ({:?}) [{i}]: {} vs reference {}",
                                path.name(),
                                keys[r],
                                got[r][i],
                                want[i]
                            );
                        }
                        if keys[r].is_empty() {
                            assert!(got[r].iter().all(|&x| x == 0.0), "no keys: zeros");
                        }
                    }
                }
            }
        }
    }
}

/// The tiles compute attention: against softmax(q k / sqrt(d)) v in f64 over the cached values
/// (f32 sums of f32 products: 1e-5 of max |v|), for keys that start and end inside tiles.
#[test]
fn prompt_tiles_are_attention() {
    let mut rng = Rng(22);
    let (dk, dv, n_keys) = (64, 48, 200);
    for ty in [GgmlType::F16, GgmlType::F32] {
        let qs: Vec<Vec<f32>> = (0..5).map(|_| (0..dk).map(|_| 2.0 * rng.f()).collect()).collect();
        let kf: Vec<f32> = (0..dk * n_keys).map(|_| rng.f()).collect();
        let vf: Vec<f32> = (0..dv * n_keys).map(|_| 4.0 * rng.f()).collect();
        let (k, v) = (cache_rows(ty, &kf, dk), cache_rows(ty, &vf, dv));
        let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
        let widen = |bytes: &[u8], d: usize| {
            let mut out = vec![0f32; bytes.len() / ty.bytes_for(d as u64).unwrap() as usize * d];
            pinfer::quant::dequantize_row_ref(ty, bytes, &mut out).unwrap();
            out
        };
        let (kx, vx) = (widen(&k, dk), widen(&v, dv));
        let vmax = vx.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = 1.0 / (dk as f32).sqrt();
        let keys = [0..n_keys, 3..77, 40..41, 31..33, 100..200];
        for path in [KernelPath::Reference].into_iter().chain(simd_paths()) {
            let got = tile_run(path, ty, &qs, &keys, &k, kb, &v, vb, dv, scale);
            for ((q, g), ks) in qs.iter().zip(&got).zip(&keys) {
                let s: Vec<f64> = ks
                    .clone()
                    .map(|j| {
                        (0..dk).map(|i| f64::from(q[i]) * f64::from(kx[j * dk + i])).sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                let tol = 1e-5 * f64::from(vmax);
                for i in 0..dv {
                    let want: f64 =
                        ks.clone().zip(&w).map(|(j, w)| w * f64::from(vx[j * dv + i])).sum::<f64>() / total;
                    assert!(
                        (f64::from(g[i]) - want).abs() <= tol,
                        "{} {ty} keys {ks:?} [{i}]: {} vs {want} (tolerance {tol})",
                        path.name(),
                        g[i]
                    );
                }
            }
        }
    }
}

/// A row's attention over disjoint parts of its keys, merged by where each part's softmax ended
/// (`merge_attn_parts`, the split decode's second phase), is its attention over all of them:
/// parts of any sizes, empty parts among them, large scores; no keys at all gives zeros.
#[test]
fn merged_key_parts_are_the_whole_rows_attention() {
    use pinfer::kernels::merge_attn_parts;
    let mut rng = Rng(21);
    let (dim, n_keys) = (64usize, 301usize);
    let ops = KvOps::reference(GgmlType::F32, GgmlType::F32).unwrap();
    for q_size in [1.0f32, 30.0] {
        let qs = vec![(0..dim).map(|_| q_size * rng.f()).collect::<Vec<f32>>()];
        let kf: Vec<f32> = (0..dim * n_keys).map(|_| rng.f()).collect();
        let vf: Vec<f32> = (0..dim * n_keys).map(|_| 3.0 * rng.f()).collect();
        let (k, v) = (cache_rows(GgmlType::F32, &kf, dim), cache_rows(GgmlType::F32, &vf, dim));
        let (kb, vb) = (k.len() / n_keys, v.len() / n_keys);
        let (whole, _) =
            typed_run(&ops, &qs, core::slice::from_ref(&(0..n_keys)), &k, kb, &v, vb, dim, 0.125, KEY_CHUNK);
        for cuts in [vec![0, 150, 301], vec![0, 0, 1, 37, 37, 200, 301, 301], vec![0, 301]] {
            let parts: Vec<(Vec<f32>, RowSoftmax)> = cuts
                .windows(2)
                .map(|w| {
                    let (o, e) = typed_run(
                        &ops,
                        &qs,
                        core::slice::from_ref(&(w[0]..w[1])),
                        &k,
                        kb,
                        &v,
                        vb,
                        dim,
                        0.125,
                        KEY_CHUNK,
                    );
                    (o[0].clone(), e[0])
                })
                .collect();
            let ends: Vec<RowSoftmax> = parts.iter().map(|p| p.1).collect();
            let mut got = vec![f32::NAN; dim];
            merge_attn_parts(&ends, |c| &parts[c].0, &mut got);
            for i in 0..dim {
                let (g, w) = (got[i], whole[0][i]);
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "q x{q_size} cuts {cuts:?} [{i}]: {g} vs {w}"
                );
            }
        }
    }
    let mut none = vec![f32::NAN; dim];
    merge_attn_parts(&[RowSoftmax::EMPTY; 3], |_| &[], &mut none);
    assert!(none.iter().all(|&x| x == 0.0));
}
