//! Every graph op against a naive implementation written here (plain loops over ggml-convention
//! shapes, `ne[0]` innermost, computed in f64), on small graphs with odd shapes, several seeds and
//! strided inputs (views from `permute`, `transpose`, `slice`, `view`).
//!
//! Every graph runs twice, with 1 thread and one memory slot per activation, and with 3 threads and
//! the packed plan; the two runs must agree bit for bit (over the elements the step defines: past a
//! dynamic KV length a packed slot may hold another activation's bytes).
//!
//! Tolerances, and why:
//! * add, mul, scale: one f32 rounding per element, so 1e-6 relative (about 8 ulp) to the f64 value.
//! * get_rows, cpy, concat, kv_write: exact (values are copied, or rounded to f16 exactly once).
//! * rms_norm, layer_norm: a reduction and a square root per row: 1e-5 of the row's largest output.
//! * silu, swiglu: ggml's vector `exp` is within ~1.5 ulp: 1e-6 relative.
//! * gelu, geglu: ggml computes GELU through an f16 table (input and result rounded to f16), and so
//!   do we; the naive twin rounds the same way, in f64: equal within 1e-6 relative (the f16 rounding
//!   of a value computed in f32 and in f64 agrees except within an ulp of a rounding boundary).
//! * rope: the engine follows ggml's f32 angle recurrence, whose relative error grows with the pair
//!   index and the position: 1e-4 of the head's largest value, with positions below ~50.
//! * soft_max: `expf` and one normalisation: 1e-5 of the row's largest probability.
//! * mul_mat, mul_mat_id: 1e-5 of `sum |w| |x|` for each output (the error of an f32 dot product
//!   grows with that sum, not with the result, which may cancel). Activations are made exactly
//!   representable in q8_0/q8_1/q8_K and f16 ([`exact_acts`]), so the bound holds whether the engine
//!   multiplies the f32 input directly or first converts it as ggml does.
#![allow(clippy::needless_range_loop)]

mod engine;

use engine::{decode, encode, Rng, RunOpts, Setup};
use pinfer::arena::Arena;
use pinfer::exec::pool::Pool;
use pinfer::exec::{work_bytes, Address, Bound, ExecError, Step};
use pinfer::graph::{plan, plan_unshared, Graph, GraphError, Mask, RopeMode};
use pinfer::quant::GgmlType;
use pinfer::tensor::{Storage, TensorId};

type Ne = [usize; 4];

const F32: GgmlType = GgmlType::F32;
const F16: GgmlType = GgmlType::F16;

// ---------------------------------------------------------------------------------------------
// Shapes and reference helpers
// ---------------------------------------------------------------------------------------------

fn numel(ne: Ne) -> usize {
    ne.iter().product()
}

/// Flat index of `i` in a contiguous tensor of shape `ne`.
fn at(ne: Ne, i: [usize; 4]) -> usize {
    i[0] + ne[0] * (i[1] + ne[1] * (i[2] + ne[2] * i[3]))
}

/// Every index of shape `ne`, in memory order (`i[0]` fastest).
fn coords(ne: Ne) -> impl Iterator<Item = [usize; 4]> {
    (0..numel(ne)).map(move |f| {
        [f % ne[0], f / ne[0] % ne[1], f / (ne[0] * ne[1]) % ne[2], f / (ne[0] * ne[1] * ne[2])]
    })
}

/// The elements of shape `eff` out of contiguous data of (upper-bound) shape `ne`.
fn compact(data: &[f32], ne: Ne, eff: Ne) -> Vec<f32> {
    assert_eq!(data.len(), numel(ne), "output span");
    coords(eff).map(|i| data[at(ne, i)]).collect()
}

/// What `permute(base, axes)` shows, as contiguous data, and its shape.
fn permuted(data: &[f32], ne: Ne, axes: [usize; 4]) -> (Vec<f32>, Ne) {
    let mut vne = [0; 4];
    for d in 0..4 {
        vne[axes[d]] = ne[d];
    }
    let out = coords(vne)
        .map(|j| {
            let i = [j[axes[0]], j[axes[1]], j[axes[2]], j[axes[3]]];
            data[at(ne, i)]
        })
        .collect();
    (out, vne)
}

/// What `slice(base, dim, start, len)` shows, as contiguous data, and its shape.
fn sliced(data: &[f32], ne: Ne, dim: usize, start: usize, len: usize) -> (Vec<f32>, Ne) {
    let mut vne = ne;
    vne[dim] = len;
    let out = coords(vne)
        .map(|mut i| {
            i[dim] += start;
            data[at(ne, i)]
        })
        .collect();
    (out, vne)
}

fn f16r(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// Activation rows that every type a matmul may convert its input to represents exactly: multiples
/// of 2^-7 within ±127 * 2^-7, each 32-block holding one ±127 (so q8_0, q8_1 and q8_K scales are
/// exactly 2^-7) and summing to less than 2048 in magnitude (so q8_1's f16 `d * sum(q)` is exact);
/// all are f16 values too.
fn exact_acts(rng: &mut Rng, rows: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        for start in (0..k).step_by(32) {
            let len = (k - start).min(32);
            loop {
                let mut q: Vec<i32> = (0..len).map(|_| rng.below(255) as i32 - 127).collect();
                q[rng.below(len)] = if rng.below(2) == 0 { 127 } else { -127 };
                if q.iter().sum::<i32>().abs() < 2048 {
                    out.extend(q.iter().map(|&v| v as f32 / 128.0));
                    break;
                }
            }
        }
    }
    out
}

/// `x` as [`pinfer::kernels::kv_attn::quantize_q15`] rounds it (the query of q8_0 keys).
fn q15_rounded(x: &[f32]) -> Vec<f32> {
    use pinfer::kernels::kv_attn::{q15_scale, quantize_q15, Q15_BYTES, Q15_LEN};
    let mut b = vec![0u8; x.len() / Q15_LEN * Q15_BYTES];
    assert!(quantize_q15(x, &mut b));
    b.chunks_exact(Q15_BYTES)
        .flat_map(|b| {
            let d = q15_scale(b);
            (0..Q15_LEN)
                .map(move |i| (128 * i32::from(b[4 + i] as i8) + i32::from(b[4 + Q15_LEN + i])) as f32 * d)
        })
        .collect()
}

/// Asserts `|got - want| <= rel * |want| + abs` element by element.
fn check(what: &str, got: &[f32], want: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            g.is_finite() && err <= rel * w.abs() + abs,
            "{what}[{i}]: got {g}, want {w} (error {err:e})"
        );
    }
}

/// Asserts `|got - want| <= tol * scale[i]` element by element.
fn check_scaled(what: &str, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            g.is_finite() && err <= tol * s,
            "{what}[{i}]: got {g}, want {w} (error {err:e}, scale {s:e})"
        );
    }
}

/// Asserts bit equality (NaN-aware) with values computed in f32.
fn check_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

// ---------------------------------------------------------------------------------------------
// Running graphs
// ---------------------------------------------------------------------------------------------

/// An F32 leaf holding `data`.
fn leaf(s: &mut Setup, name: &str, ne: Ne, data: &[f32]) -> TensorId {
    assert_eq!(data.len(), numel(ne));
    s.leaf_bytes(name, F32, ne, bytemuck::cast_slice(data))
}

/// A leaf of type `ty` holding the bytes `encode` makes of `data` (random blocks for K-quants);
/// returns it and its values as the engine sees them.
fn typed_leaf(
    s: &mut Setup,
    rng: &mut Rng,
    name: &str,
    ty: GgmlType,
    ne: Ne,
    data: &[f32],
) -> (TensorId, Vec<f32>) {
    let bytes = encode(ty, data, ne[0], rng);
    let values = decode(ty, &bytes, ne[0]);
    assert_eq!(values.len(), numel(ne));
    (s.leaf_bytes(name, ty, ne, &bytes), values)
}

/// Runs the graph with 1 thread and the unshared plan, then 3 threads and the packed plan (both
/// through the harness), asserts identical bits, and returns the F32 outputs cut to their shapes
/// at the last step's KV length.
fn run_ops(s: &mut Setup, outs: &[TensorId], steps: &[Step]) -> Vec<Vec<f32>> {
    let n_kv = steps.last().map_or(0, |st| st.n_kv);
    let (one, _) = engine::run(s, outs, steps, RunOpts { threads: 1, packed: false, ..Default::default() });
    let (many, _) = engine::run(s, outs, steps, RunOpts { threads: 3, packed: true, ..Default::default() });
    let mut res = Vec::new();
    for (o, &id) in outs.iter().enumerate() {
        let t = s.g.tensor(id);
        assert!(t.ty == F32 && t.is_contiguous(), "test outputs are contiguous F32");
        let eff = t.ne_for(n_kv);
        let (a, b) = (compact(&one[o], t.ne, eff), compact(&many[o], t.ne, eff));
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "output {o} ({}): 3 threads with the packed plan differ from 1 thread", t.name);
        res.push(a);
    }
    res
}

/// Plans, binds and runs with the executor directly (errors are returned, not unwrapped); returns
/// the raw bytes of `outs` after the last step.
fn try_run(
    s: &mut Setup,
    outs: &[TensorId],
    steps: &[Step],
    threads: usize,
    packed: bool,
) -> Result<Vec<Vec<u8>>, ExecError> {
    try_run_with(s, outs, steps, threads, packed, false)
}

/// [`try_run`], with the f16 matmuls of several tokens on the encoder's GEMM if `f16_gemm`.
fn try_run_with(
    s: &mut Setup,
    outs: &[TensorId],
    steps: &[Step],
    threads: usize,
    packed: bool,
    f16_gemm: bool,
) -> Result<Vec<Vec<u8>>, ExecError> {
    s.g.build(outs).unwrap();
    let p = if packed { plan(&s.g).unwrap() } else { plan_unshared(&s.g).unwrap() };
    let work = work_bytes(&s.g);
    let mut memory = vec![0u64; Arena::bytes_for(s.persistent + p.peak_bytes + work + 256).div_ceil(8)];
    let mut arena = Arena::new(bytemuck::cast_slice_mut(&mut memory));
    let persistent = arena.alloc(s.persistent, "persistent").unwrap();
    assert_eq!(persistent.offset, 0);
    let act = arena.alloc(p.peak_bytes, "activations").unwrap();
    let work = arena.alloc(work, "work").unwrap();
    let inputs = s.inputs.bytes();
    let mut addresses = vec![Address::NOWHERE; s.g.tensors().len()];
    let mut bound = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work, &mut addresses)
        .unwrap()
        .with_f16_gemm(f16_gemm);
    let pool = (threads > 1).then(|| Pool::new(threads, None, false).unwrap());
    for &step in steps {
        match &pool {
            Some(pool) => pool.run(&mut bound, step)?,
            None => bound.run(step)?,
        }
    }
    Ok(outs.iter().map(|&id| bound.data(id).to_vec()).collect())
}

/// The run error, the same with 1 thread (unshared plan) and 3 threads (packed plan).
fn run_err(s: &mut Setup, outs: &[TensorId], steps: &[Step]) -> ExecError {
    let one = try_run(s, outs, steps, 1, false).expect_err("the run must fail");
    let many = try_run(s, outs, steps, 3, true).expect_err("the run must fail with 3 threads too");
    assert_eq!(one, many);
    one
}

fn invalid_op(r: Result<TensorId, GraphError>) -> &'static str {
    match r {
        Err(GraphError::Invalid { op, .. }) => op,
        other => panic!("expected GraphError::Invalid, got {other:?}"),
    }
}

const STEP0: [Step; 1] = [Step { n_past: 0, n_kv: 0 }];

// ---------------------------------------------------------------------------------------------
// Elementwise: add, mul, scale
// ---------------------------------------------------------------------------------------------

/// `a op b` with `b` tiled over `a` (ggml: `i1 % ne_b[1]`, ...).
fn ref_binary(a: &[f32], ane: Ne, b: &[f32], bne: Ne, op: fn(f64, f64) -> f64) -> Vec<f64> {
    coords(ane)
        .map(|i| {
            let j = [i[0], i[1] % bne[1], i[2] % bne[2], i[3] % bne[3]];
            op(f64::from(a[at(ane, i)]), f64::from(b[at(bne, j)]))
        })
        .collect()
}

#[test]
fn add_and_mul_broadcast_the_second_operand() {
    let cases: [(Ne, Ne); 8] = [
        ([7, 5, 3, 2], [7, 1, 3, 1]),
        ([7, 5, 3, 2], [7, 5, 1, 2]),
        ([7, 5, 3, 2], [7, 1, 1, 1]),
        ([7, 5, 3, 2], [7, 5, 3, 2]),
        ([1, 3, 1, 1], [1, 1, 1, 1]),
        ([33, 6, 4, 1], [33, 2, 2, 1]), // tiled, not only size-1 broadcast
        ([65, 1, 1, 3], [65, 1, 1, 3]),
        ([5, 3, 5, 7], [5, 3, 1, 7]),
    ];
    for seed in 1..=3u64 {
        for (c, &(ane, bne)) in cases.iter().enumerate() {
            let mut rng = Rng(seed * 1000 + c as u64);
            let (a, b) = (rng.vec(numel(ane)), rng.vec(numel(bne)));
            let mut s = Setup::default();
            let ta = leaf(&mut s, "a", ane, &a);
            let tb = leaf(&mut s, "b", bne, &b);
            let add = s.g.add(ta, tb).unwrap();
            let mul = s.g.mul(ta, tb).unwrap();
            let out = run_ops(&mut s, &[add, mul], &STEP0);
            let what = format!("seed {seed} {ane:?} with {bne:?}");
            check(&format!("add {what}"), &out[0], &ref_binary(&a, ane, &b, bne, |x, y| x + y), 1e-6, 0.0);
            check(&format!("mul {what}"), &out[1], &ref_binary(&a, ane, &b, bne, |x, y| x * y), 1e-6, 0.0);
        }
    }
}

#[test]
fn add_and_mul_read_strided_views() {
    for seed in 1..=3u64 {
        let mut rng = Rng(seed);
        // a: [7, 3, 5, 2] permuted to [7, 5, 3, 2]; b: dims 1..3 of a [7, 1, 5, 1] sliced to 3.
        let (base_a_ne, base_b_ne) = ([7, 3, 5, 2], [7, 1, 5, 1]);
        let (ba, bb) = (rng.vec(numel(base_a_ne)), rng.vec(numel(base_b_ne)));
        let (a, ane) = permuted(&ba, base_a_ne, [0, 2, 1, 3]);
        let (b, bne) = sliced(&bb, base_b_ne, 2, 1, 3);
        let mut s = Setup::default();
        let la = leaf(&mut s, "a", base_a_ne, &ba);
        let lb = leaf(&mut s, "b", base_b_ne, &bb);
        let va = s.g.permute(la, [0, 2, 1, 3]).unwrap();
        let vb = s.g.slice(lb, 2, 1, 3).unwrap();
        assert!(!s.g.tensor(va).is_contiguous() && !s.g.tensor(vb).is_contiguous());
        let add = s.g.add(va, vb).unwrap();
        let mul = s.g.mul(va, vb).unwrap();
        // And a strided first operand with itself (slice along dim 0).
        let half = s.g.slice(la, 0, 2, 5).unwrap();
        let sq = s.g.mul(half, half).unwrap();
        let out = run_ops(&mut s, &[add, mul, sq], &STEP0);
        check("add of views", &out[0], &ref_binary(&a, ane, &b, bne, |x, y| x + y), 1e-6, 0.0);
        check("mul of views", &out[1], &ref_binary(&a, ane, &b, bne, |x, y| x * y), 1e-6, 0.0);
        let (h, hne) = sliced(&ba, base_a_ne, 0, 2, 5);
        check("square of a slice", &out[2], &ref_binary(&h, hne, &h, hne, |x, y| x * y), 1e-6, 0.0);
    }
}

#[test]
fn a_short_address_table_is_refused_and_one_entry_a_tensor_binds() {
    let mut s = Setup::default();
    let tx = leaf(&mut s, "x", [4, 2, 1, 1], &[1.0; 8]);
    let y = s.g.scale(tx, 2.0).unwrap();
    s.g.build(&[y]).unwrap();
    let p = plan(&s.g).unwrap();
    let work = work_bytes(&s.g);
    let mut memory = vec![0u64; Arena::bytes_for(p.peak_bytes + work + 256).div_ceil(8)];
    let mut arena = Arena::new(bytemuck::cast_slice_mut(&mut memory));
    let act = arena.alloc(p.peak_bytes, "activations").unwrap();
    let work = arena.alloc(work, "work").unwrap();
    let inputs = s.inputs.bytes();
    let n = s.g.tensors().len();
    let mut short = vec![Address::NOWHERE; n - 1];
    let err = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work, &mut short).err();
    assert_eq!(err, Some(ExecError::AddressTableTooSmall { needed: n }));
    let mut addresses = vec![Address::NOWHERE; n];
    let mut bound = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work, &mut addresses).unwrap();
    bound.run(STEP0[0]).unwrap();
    assert_eq!(bound.data_f32(y), &[2.0; 8]);
}

#[test]
fn scale_multiplies_every_element() {
    for (seed, &(ne, f)) in
        [([7, 5, 3, 2], -0.37f32), ([1, 1, 1, 1], 3.5), ([33, 3, 1, 1], 0.0), ([65, 2, 3, 1], 1e-3)]
            .iter()
            .enumerate()
    {
        let mut rng = Rng(seed as u64 + 40);
        let x = rng.vec(numel(ne));
        let mut s = Setup::default();
        let tx = leaf(&mut s, "x", ne, &x);
        let y = s.g.scale(tx, f).unwrap();
        // Strided: scale a transposed-then-permuted-back view of dims 1 and 2.
        let v = s.g.permute(tx, [0, 2, 1, 3]).unwrap();
        let yv = s.g.scale(v, f).unwrap();
        let out = run_ops(&mut s, &[y, yv], &STEP0);
        let want: Vec<f64> = x.iter().map(|&v| f64::from(v) * f64::from(f)).collect();
        check("scale", &out[0], &want, 1e-6, 0.0);
        let (xv, _) = permuted(&x, ne, [0, 2, 1, 3]);
        let want: Vec<f64> = xv.iter().map(|&v| f64::from(v) * f64::from(f)).collect();
        check("scale of a view", &out[1], &want, 1e-6, 0.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Norms and activations
// ---------------------------------------------------------------------------------------------

fn ref_rows(x: &[f32], ne: Ne, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    x.chunks(ne[0]).flat_map(|row| f(&row.iter().map(|&v| f64::from(v)).collect::<Vec<_>>())).collect()
}

fn ref_rms_norm(row: &[f64], eps: f64) -> Vec<f64> {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
    row.iter().map(|v| v / (ms + eps).sqrt()).collect()
}

fn ref_layer_norm(row: &[f64], eps: f64) -> Vec<f64> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    row.iter().map(|v| (v - mean) / (var + eps).sqrt()).collect()
}

/// Per-row comparison against the row's largest |want|.
fn check_rows(what: &str, got: &[f32], want: &[f64], row: usize, tol: f64) {
    for (r, (g, w)) in got.chunks(row).zip(want.chunks(row)).enumerate() {
        check(&format!("{what} row {r}"), g, w, 0.0, tol * max_abs(w).max(1e-30));
    }
}

#[test]
fn rms_norm_and_layer_norm_on_odd_rows() {
    for (c, &row) in [1usize, 3, 5, 7, 33, 65, 127].iter().enumerate() {
        for seed in 1..=2u64 {
            let mut rng = Rng(seed * 100 + c as u64);
            let ne = [row, 3, 2, 1];
            // An offset and a spread, so layer norm must subtract the mean.
            let x: Vec<f32> = rng.vec(numel(ne)).iter().map(|v| 2.0 + 3.0 * v).collect();
            let eps = if seed == 1 { 1e-5 } else { 1e-6 };
            let mut s = Setup::default();
            let tx = leaf(&mut s, "x", ne, &x);
            let rms = s.g.rms_norm(tx, eps).unwrap();
            let ln = s.g.layer_norm(tx, eps).unwrap();
            // Strided input: dims 1 and 2 swapped.
            let v = s.g.permute(tx, [0, 2, 1, 3]).unwrap();
            let rms_v = s.g.rms_norm(v, eps).unwrap();
            let out = run_ops(&mut s, &[rms, ln, rms_v], &STEP0);
            let e = f64::from(eps);
            let what = format!("row {row} seed {seed}");
            check_rows(
                &format!("rms_norm {what}"),
                &out[0],
                &ref_rows(&x, ne, |r| ref_rms_norm(r, e)),
                row,
                1e-5,
            );
            let want = ref_rows(&x, ne, |r| ref_layer_norm(r, e));
            check_rows(&format!("layer_norm {what}"), &out[1], &want, row, 1e-5);
            let (xv, vne) = permuted(&x, ne, [0, 2, 1, 3]);
            let want = ref_rows(&xv, vne, |r| ref_rms_norm(r, e));
            check_rows(&format!("rms_norm of a view {what}"), &out[2], &want, row, 1e-5);
        }
    }
}

#[test]
fn layer_norm_output_has_zero_mean_and_unit_variance() {
    // Independent of the reference above: properties of the engine's result alone.
    let ne = [65, 4, 1, 1];
    let x: Vec<f32> = Rng(9).vec(numel(ne)).iter().map(|v| 10.0 + v).collect();
    let mut s = Setup::default();
    let tx = leaf(&mut s, "x", ne, &x);
    let ln = s.g.layer_norm(tx, 0.0).unwrap();
    let out = run_ops(&mut s, &[ln], &STEP0);
    for row in out[0].chunks(65) {
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / 65.0;
        let var = row.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / 65.0;
        assert!(mean.abs() < 1e-4 && (var - 1.0).abs() < 1e-3, "mean {mean}, variance {var}");
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// GELU the way ggml's CPU backend evaluates it: f16 input, f16 result, saturated outside (-10, 10).
fn gelu(x: f64) -> f64 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let r = |v: f64| f64::from(half::f16::from_f64(v).to_f32());
        r(gelu_tanh(r(x)))
    }
}

#[test]
fn silu_gelu_swiglu_geglu() {
    for (c, &ne) in [[1usize, 1, 1, 1], [7, 5, 3, 1], [33, 3, 1, 2], [65, 2, 2, 1]].iter().enumerate() {
        for seed in 1..=2u64 {
            let mut rng = Rng(seed * 10 + c as u64);
            let x: Vec<f32> = rng.vec(numel(ne)).iter().map(|v| 6.0 * v).collect();
            let u: Vec<f32> = rng.vec(numel(ne)).iter().map(|v| 2.0 * v).collect();
            let mut s = Setup::default();
            let tx = leaf(&mut s, "x", ne, &x);
            let tu = leaf(&mut s, "u", ne, &u);
            let si = s.g.silu(tx).unwrap();
            let ge = s.g.gelu(tx).unwrap();
            let sw = s.g.swiglu(tx, tu).unwrap();
            let gg = s.g.geglu(tx, tu).unwrap();
            // Strided gate and up (dims 1 and 2 swapped on both).
            let (vx, vu) = (s.g.permute(tx, [0, 2, 1, 3]).unwrap(), s.g.permute(tu, [0, 2, 1, 3]).unwrap());
            let swv = s.g.swiglu(vx, vu).unwrap();
            let ggv = s.g.geglu(vx, vu).unwrap();
            let out = run_ops(&mut s, &[si, ge, sw, gg, swv, ggv], &STEP0);
            let xd: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            let ud: Vec<f64> = u.iter().map(|&v| f64::from(v)).collect();
            let what = format!("{ne:?} seed {seed}");
            check(
                &format!("silu {what}"),
                &out[0],
                &xd.iter().map(|&v| silu(v)).collect::<Vec<_>>(),
                1e-6,
                1e-7,
            );
            check(
                &format!("gelu {what}"),
                &out[1],
                &xd.iter().map(|&v| gelu(v)).collect::<Vec<_>>(),
                1e-6,
                1e-6,
            );
            let want: Vec<f64> = xd.iter().zip(&ud).map(|(&g, &u)| silu(g) * u).collect();
            check(&format!("swiglu {what}"), &out[2], &want, 1e-6, 1e-7);
            let want: Vec<f64> = xd.iter().zip(&ud).map(|(&g, &u)| gelu(g) * u).collect();
            check(&format!("geglu {what}"), &out[3], &want, 1e-6, 2e-6);
            let (xv, _) = permuted(&x, ne, [0, 2, 1, 3]);
            let (uv, _) = permuted(&u, ne, [0, 2, 1, 3]);
            let want: Vec<f64> = xv.iter().zip(&uv).map(|(&g, &u)| silu(g.into()) * f64::from(u)).collect();
            check(&format!("swiglu of views {what}"), &out[4], &want, 1e-6, 1e-7);
            let want: Vec<f64> = xv.iter().zip(&uv).map(|(&g, &u)| gelu(g.into()) * f64::from(u)).collect();
            check(&format!("geglu of views {what}"), &out[5], &want, 1e-6, 2e-6);
        }
    }
}

#[test]
fn gelu_is_the_tanh_approximation_not_erf() {
    // For negative inputs the result is small, so f16 resolves the 1e-4..3e-4 gap between the tanh
    // and the erf forms (there an f16 ulp is 1e-5..3e-5).
    let x = [-2.5f32, -2.0, -1.5];
    let mut s = Setup::default();
    let tx = leaf(&mut s, "x", [3, 1, 1, 1], &x);
    let ge = s.g.gelu(tx).unwrap();
    let out = run_ops(&mut s, &[ge], &STEP0).remove(0);
    check("gelu", &out, &x.iter().map(|&v| gelu(v.into())).collect::<Vec<_>>(), 1e-6, 0.0);
    for (&g, &v) in out.iter().zip(&x) {
        let v = f64::from(v);
        let erf_form = 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
        assert!((f64::from(g) - erf_form).abs() > 5e-5, "gelu({v}) = {g} is the erf form {erf_form}");
    }
}

#[test]
fn ggml_expf_stays_within_three_ulp_of_exp() {
    let mut rng = Rng(7);
    let xs: Vec<f32> = (0..20_000).map(|_| 87.0 * rng.vec(1)[0]).chain([0.0, -0.0, 88.0, -87.0]).collect();
    for x in xs {
        let got = pinfer::kernels::reference::ggml_expf(x);
        let want = f64::from(x).exp();
        let ulp = f64::from(f32::from_bits((want as f32).to_bits() + 1) - want as f32);
        // Documented bound: 1.45 ulp plus the final rounding.
        assert!((f64::from(got) - want).abs() <= 3.0 * ulp, "exp({x}) = {got}, want {want}");
    }
    assert_eq!(pinfer::kernels::reference::ggml_expf(-200.0), 0.0);
    assert_eq!(pinfer::kernels::reference::ggml_expf(200.0), f32::INFINITY);
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

struct RopeCase {
    head: usize,
    n_rot: usize,
    mode: RopeMode,
    base: f32,
    scale: f32,
    factors: bool,
    heads: usize,
    tokens: usize,
    n_past: usize,
    /// Input as a permuted view of `[head, tokens, heads]`.
    strided: bool,
}

/// theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i, all in f64.
fn ref_rope(x: &[f32], ne: Ne, c: &RopeCase, factors: Option<&[f32]>, n_past: usize) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let half = c.n_rot / 2;
    for t in 0..ne[2] {
        let pos = (n_past + t) as f64;
        for h in 0..ne[1] {
            let row = at(ne, [0, h, t, 0]);
            for i in 0..half {
                let factor = factors.map_or(1.0, |f| f64::from(f[i]));
                let theta =
                    pos * f64::from(c.scale) * f64::from(c.base).powf(-2.0 * i as f64 / c.n_rot as f64)
                        / factor;
                let (a, b) = match c.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (f64::from(x[row + a]), f64::from(x[row + b]));
                out[row + a] = x0 * theta.cos() - x1 * theta.sin();
                out[row + b] = x0 * theta.sin() + x1 * theta.cos();
            }
        }
    }
    out
}

fn rope_cases() -> Vec<RopeCase> {
    use RopeMode::{Neox, Normal};
    let c = |head, n_rot, mode, base, scale, factors, heads, tokens, n_past, strided| RopeCase {
        head,
        n_rot,
        mode,
        base,
        scale,
        factors,
        heads,
        tokens,
        n_past,
        strided,
    };
    vec![
        c(8, 8, Normal, 10000.0, 1.0, false, 2, 3, 0, false),
        c(8, 8, Neox, 10000.0, 1.0, false, 2, 3, 0, false),
        c(64, 64, Neox, 10000.0, 1.0, false, 3, 5, 7, true),
        c(64, 64, Normal, 10000.0, 1.0, false, 3, 5, 7, false),
        c(64, 32, Normal, 500000.0, 0.25, true, 2, 3, 11, false),
        c(64, 32, Neox, 500000.0, 0.25, true, 2, 3, 11, true),
        c(6, 4, Neox, 10000.0, 0.5, true, 1, 1, 30, false),
        c(33, 16, Neox, 1e6, 1.0, true, 3, 2, 5, true),
        c(33, 16, Normal, 1e6, 1.0, false, 3, 2, 5, false),
        c(128, 128, Neox, 1e6, 1.0, false, 1, 4, 20, false),
        c(128, 96, Normal, 10000.0, 2.0, true, 2, 2, 9, true),
    ]
}

/// Builds the rope graph of case `c`; returns (setup, output, input data as the op sees it,
/// its shape, factors).
fn rope_graph(c: &RopeCase, seed: u64) -> (Setup, TensorId, Vec<f32>, Ne, Option<Vec<f32>>) {
    let mut rng = Rng(seed);
    let mut s = Setup::default();
    let ne = [c.head, c.heads, c.tokens, 1];
    let (x, tx) = if c.strided {
        let base_ne = [c.head, c.tokens, c.heads, 1];
        let base = rng.vec(numel(base_ne));
        let lb = leaf(&mut s, "x", base_ne, &base);
        let v = s.g.permute(lb, [0, 2, 1, 3]).unwrap();
        (permuted(&base, base_ne, [0, 2, 1, 3]).0, v)
    } else {
        let x = rng.vec(numel(ne));
        let tx = leaf(&mut s, "x", ne, &x);
        (x, tx)
    };
    let factors =
        c.factors.then(|| (0..c.n_rot / 2).map(|_| 1.0 + 7.0 * rng.f32().abs()).collect::<Vec<_>>());
    let tf = factors.as_ref().map(|f| leaf(&mut s, "rope_freqs", [f.len(), 1, 1, 1], f));
    let y = s.g.rope(tx, c.n_rot, c.mode, c.base, c.scale, tf).unwrap();
    (s, y, x, ne, factors)
}

#[test]
fn rope_matches_the_rotation_formula() {
    for (ci, c) in rope_cases().iter().enumerate() {
        for seed in 1..=2u64 {
            let (mut s, y, x, ne, factors) = rope_graph(c, seed * 100 + ci as u64);
            let step = Step { n_past: c.n_past, n_kv: c.n_past + c.tokens };
            let out = run_ops(&mut s, &[y], &[step]).remove(0);
            let want = ref_rope(&x, ne, c, factors.as_deref(), c.n_past);
            let what = format!("rope case {ci} seed {seed}");
            for (r, (g, w)) in out.chunks(c.head).zip(want.chunks(c.head)).enumerate() {
                check(&format!("{what} row {r}"), g, w, 0.0, 1e-4 * max_abs(w));
                // Dimensions past n_rot are copied bit for bit.
                let src = &x[r * c.head..(r + 1) * c.head];
                check_exact(&format!("{what} row {r} tail"), &g[c.n_rot..], &src[c.n_rot..]);
            }
        }
    }
}

#[test]
fn rope_reference_notices_a_wrong_position_or_mode() {
    // Sanity: the comparison above can fail. The engine at n_past = 3 matches the reference at
    // position 3, and clearly differs from it at positions 2 or 4, and in the other mode.
    let c = &rope_cases()[3];
    let (mut s, y, x, ne, _) = rope_graph(c, 5);
    let out = run_ops(&mut s, &[y], &[Step { n_past: 3, n_kv: 8 }]).remove(0);
    let dist =
        |want: &[f64]| out.iter().zip(want).fold(0.0f64, |m, (&g, &w)| m.max((f64::from(g) - w).abs()));
    let scale = max_abs(&x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
    assert!(dist(&ref_rope(&x, ne, c, None, 3)) <= 1e-4 * scale);
    assert!(dist(&ref_rope(&x, ne, c, None, 2)) > 1e-2 * scale, "position n_past - 1 must not match");
    assert!(dist(&ref_rope(&x, ne, c, None, 4)) > 1e-2 * scale, "position n_past + 1 must not match");
    let neox = RopeCase { mode: RopeMode::Neox, ..rope_cases().swap_remove(3) };
    assert!(dist(&ref_rope(&x, ne, &neox, None, 3)) > 1e-2 * scale, "the other pairing must not match");
}

#[test]

fn rope_freq_factors_of_any_contiguous_shape() {
    // Graph::rope accepts frequency factors with n_elements() >= n_rot/2 and contiguous; the
    // executor reads only ne[0] of them (`self.read::<f32>(f, 0, tf.ne[0])`), so a [1, 4] tensor
    // passes the builder and rope_ref then indexes past the slice. Either the builder must refuse
    // the shape or the engine must read n_rot/2 values.
    let c = RopeCase {
        head: 8,
        n_rot: 8,
        mode: RopeMode::Normal,
        base: 10000.0,
        scale: 1.0,
        factors: true,
        heads: 1,
        tokens: 2,
        n_past: 1,
        strided: false,
    };
    let mut rng = Rng(3);
    let mut s = Setup::default();
    let ne = [8, 1, 2, 1];
    let x = rng.vec(numel(ne));
    let factors = [1.0f32, 2.0, 3.0, 4.0];
    let tx = leaf(&mut s, "x", ne, &x);
    let tf = leaf(&mut s, "rope_freqs", [1, 4, 1, 1], &factors);
    match s.g.rope(tx, 8, RopeMode::Normal, 10000.0, 1.0, Some(tf)) {
        Err(GraphError::Invalid { .. }) => {}
        Err(e) => panic!("unexpected {e:?}"),
        Ok(y) => {
            let out = try_run(&mut s, &[y], &[Step { n_past: 1, n_kv: 3 }], 1, false).unwrap();
            let got: Vec<f32> =
                out[0].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            let want = ref_rope(&x, ne, &c, Some(&factors), 1);
            check("rope with [1, 4] factors", &got, &want, 0.0, 1e-4);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

/// Softmax of `row[start..end] * scale` in f64; zeros elsewhere.
fn ref_softmax(row: &[f32], scale: f64, start: usize, end: usize) -> Vec<f64> {
    let mut out = vec![0.0; row.len()];
    if start >= end {
        return out;
    }
    let max = row[start..end].iter().map(|&v| f64::from(v) * scale).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row[start..end].iter().map(|&v| (f64::from(v) * scale - max).exp()).sum();
    for j in start..end {
        out[j] = (f64::from(row[j]) * scale - max).exp() / sum;
    }
    out
}

/// Visible keys `[start, end)` of `n_kv` for a query at `pos`.
fn visible(causal: bool, window: usize, pos: usize, n_kv: usize) -> (usize, usize) {
    if !causal {
        return (0, n_kv);
    }
    let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    (start.min(n_kv), (pos + 1).min(n_kv))
}

#[test]
fn soft_max_plain_causal_and_windowed() {
    // (n_kv, tokens, heads, scale, causal, window, n_past)
    let cases = [
        (1usize, 1usize, 1usize, 1.0f32, false, 0u32, 0usize),
        (5, 3, 2, 0.125, false, 0, 0),
        (33, 2, 3, 2.0, false, 0, 0),
        (7, 3, 2, 1.0, true, 0, 4),
        (7, 7, 1, 0.5, true, 0, 0),
        (12, 4, 2, 1.0, true, 3, 8),
        (65, 5, 2, 0.3, true, 16, 60),
        (9, 3, 2, 1.0, true, 1, 6), // window 1: each query sees only itself
    ];
    for (ci, &(n_kv, tokens, heads, scale, causal, window, n_past)) in cases.iter().enumerate() {
        for seed in 1..=2u64 {
            let mut rng = Rng(seed * 77 + ci as u64);
            let ne = [n_kv, tokens, heads, 1];
            let x: Vec<f32> = rng.vec(numel(ne)).iter().map(|v| 8.0 * v).collect();
            let mut s = Setup::default();
            let tx = leaf(&mut s, "kq", ne, &x);
            let y = s.g.soft_max(tx, scale, causal, window).unwrap();
            // Strided input: a [n_kv, heads, tokens] leaf with dims 1 and 2 swapped.
            let base_ne = [n_kv, heads, tokens, 1];
            let base: Vec<f32> = rng.vec(numel(base_ne)).iter().map(|v| 8.0 * v).collect();
            let lb = leaf(&mut s, "kq_t", base_ne, &base);
            let v = s.g.permute(lb, [0, 2, 1, 3]).unwrap();
            let yv = s.g.soft_max(v, scale, causal, window).unwrap();
            let out = run_ops(&mut s, &[y, yv], &[Step { n_past, n_kv: n_past + tokens }]);
            let (xv, _) = permuted(&base, base_ne, [0, 2, 1, 3]);
            for (o, data) in [(0, &x), (1, &xv)] {
                for r in 0..tokens * heads {
                    let t = r % tokens;
                    let (start, end) = visible(causal, window as usize, n_past + t, n_kv);
                    let row = &data[r * n_kv..(r + 1) * n_kv];
                    let want = ref_softmax(row, scale.into(), start, end);
                    let got = &out[o][r * n_kv..(r + 1) * n_kv];
                    let what = format!("soft_max case {ci} seed {seed} output {o} row {r}");
                    check(&what, got, &want, 0.0, 1e-5);
                    let total: f32 = got.iter().sum();
                    assert!((total - 1.0).abs() < 1e-5, "{what}: sums to {total}");
                }
            }
        }
    }
}

#[test]
fn soft_max_over_a_dynamic_kv_length_ignores_masked_and_stale_keys() {
    const UB: usize = 16;
    let (tokens, heads) = (3, 2);
    for (n_past, window) in [(0usize, 0u32), (4, 0), (9, 4), (13, 0)] {
        let n_kv = n_past + tokens;
        let mut rng = Rng(n_past as u64 + 1);
        let ne = [UB, tokens, heads, 1];
        // Visible scores random; causally masked ones (inside n_kv) huge, so they would dominate;
        // past n_kv NaN, so any read of them poisons the row.
        let mut x = vec![0.0f32; numel(ne)];
        for i in coords(ne) {
            let (start, end) = visible(true, window as usize, n_past + i[1], n_kv);
            x[at(ne, i)] = if i[0] >= n_kv {
                f32::NAN
            } else if i[0] < start || i[0] >= end {
                1e4
            } else {
                4.0 * rng.f32()
            };
        }
        let mut s = Setup::default();
        let tx = leaf(&mut s, "kq", ne, &x);
        let nb = s.g.tensor(tx).nb;
        let dynv = s.g.view(tx, ne, nb, 0, 0b1).unwrap();
        let y = s.g.soft_max(dynv, 0.5, true, window).unwrap();
        assert_eq!(s.g.tensor(y).dyn_kv, 1, "the result follows the KV length");
        let out = run_ops(&mut s, &[y], &[Step { n_past, n_kv }]).remove(0);
        assert_eq!(out.len(), n_kv * tokens * heads);
        for r in 0..tokens * heads {
            let t = r % tokens;
            let (start, end) = visible(true, window as usize, n_past + t, n_kv);
            let row = &x[r * UB..r * UB + n_kv];
            let want = ref_softmax(row, 0.5, start, end);
            let what = format!("dyn soft_max n_past {n_past} window {window} row {r}");
            check(&what, &out[r * n_kv..(r + 1) * n_kv], &want, 0.0, 1e-5);
            // Sanity: without the mask, the huge masked scores would take the mass.
            if start > 0 || end < n_kv {
                let unmasked = ref_softmax(row, 0.5, 0, n_kv);
                let diff: f64 = out[r * n_kv..(r + 1) * n_kv]
                    .iter()
                    .zip(&unmasked)
                    .map(|(&g, &w)| (f64::from(g) - w).abs())
                    .sum();
                assert!(diff > 1.0, "{what}: masking must matter");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// get_rows
// ---------------------------------------------------------------------------------------------

#[test]
fn get_rows_of_every_table_type() {
    use GgmlType as T;
    // (type, row lengths)
    let cases: [(GgmlType, &[usize]); 7] = [
        (T::F32, &[1, 7, 33]),
        (T::F16, &[3, 65]),
        (T::Q4_0, &[32, 96]),
        (T::Q4_1, &[64]),
        (T::Q8_0, &[32, 160]),
        (T::Q4_K, &[256]),
        (T::Q6_K, &[256, 512]),
    ];
    for (ty, ks) in cases {
        for (ki, &k) in ks.iter().enumerate() {
            let mut rng = Rng(ty.id() as u64 * 10 + ki as u64);
            let n_rows = 5 + ki * 2;
            let data = rng.vec(k * n_rows);
            let mut s = Setup::default();
            let (table, values) = typed_leaf(&mut s, &mut rng, "table", ty, [k, n_rows, 1, 1], &data);
            let ids = [n_rows as i32 - 1, 0, 2, 2, n_rows as i32 - 1, 1];
            let tid = s.ids("ids", [ids.len(), 1, 1, 1], &ids);
            let y = s.g.get_rows(table, tid).unwrap();
            // Rows 1.. of the table through a slice along dim 1 (an offset view).
            let sub = s.g.slice(table, 1, 1, n_rows - 1).unwrap();
            let ids2 = [0i32, n_rows as i32 - 2];
            let tid2 = s.ids("ids2", [2, 1, 1, 1], &ids2);
            let y2 = s.g.get_rows(sub, tid2).unwrap();
            let out = run_ops(&mut s, &[y, y2], &STEP0);
            let want: Vec<f32> = ids.iter().flat_map(|&r| values[r as usize * k..][..k].to_vec()).collect();
            check_exact(&format!("get_rows {ty} k {k}"), &out[0], &want);
            let want: Vec<f32> =
                ids2.iter().flat_map(|&r| values[(r as usize + 1) * k..][..k].to_vec()).collect();
            check_exact(&format!("get_rows {ty} k {k} of a slice"), &out[1], &want);
            // Independently of the dequantizer, plain types give back the data (f16-rounded).
            match ty {
                T::F32 => check_exact("f32 table", &out[0][..k], &data[(n_rows - 1) * k..][..k]),
                T::F16 => {
                    let want: Vec<f32> = data[(n_rows - 1) * k..][..k].iter().map(|&v| f16r(v)).collect();
                    check_exact("f16 table", &out[0][..k], &want)
                }
                _ => {}
            }
        }
    }
}

#[test]
fn get_rows_with_an_index_outside_the_table_is_bad_index() {
    for (ty, k) in [(GgmlType::F32, 7usize), (GgmlType::Q8_0, 32)] {
        for bad in [5i32, 6, -1, i32::MIN] {
            let mut rng = Rng(1);
            let mut s = Setup::default();
            let (table, _) = {
                let data = rng.vec(k * 5);
                typed_leaf(&mut s, &mut rng, "token_embd", ty, [k, 5, 1, 1], &data)
            };
            let tid = s.ids("ids", [3, 1, 1, 1], &[0, bad, 4]);
            let y = s.g.get_rows(table, tid).unwrap();
            let err = run_err(&mut s, &[y], &STEP0);
            assert!(matches!(err, ExecError::BadIndex { op: "get_rows", .. }), "id {bad}: {err:?}");
        }
    }
}

#[test]

fn get_rows_of_a_table_sliced_along_its_rows() {
    // Graph::get_rows accepts any 2-D table with contiguous rows, including a slice along dim 0
    // (ne[0] = 32 of 64, nb[1] = 256). The executor reads `row_bytes = tt.nb[1]` bytes per row and
    // calls dequantize_row_ref with 256 bytes for 32 outputs: it returns LengthMismatch, the result
    // is ignored (`let _ =`) and the output rows are never written. Expected: elements 32..64 of the
    // selected rows (reading `bytes_for(ne[0])` bytes at `r * nb[1]`).
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let mut rng = Rng(2);
        let data = rng.vec(64 * 4);
        let mut s = Setup::default();
        let (table, values) = typed_leaf(&mut s, &mut rng, "table", ty, [64, 4, 1, 1], &data);
        let right = s.g.slice(table, 0, 32, 32).unwrap();
        let tid = s.ids("ids", [2, 1, 1, 1], &[3, 1]);
        let y = s.g.get_rows(right, tid).unwrap();
        let out = run_ops(&mut s, &[y], &STEP0).remove(0);
        let want: Vec<f32> =
            [3usize, 1].iter().flat_map(|&r| values[r * 64 + 32..r * 64 + 64].to_vec()).collect();
        check_exact(&format!("get_rows of a {ty} dim-0 slice"), &out, &want);
    }
}

#[test]

fn ops_refuse_weight_types_without_a_kernel() {
    // The builder promises shape/type checks so that "kernels run blind later"; mul_mat and
    // get_rows take "any type", but dequantize_row_ref (and the dot kernels) have no IQ4_NL, and
    // the executor ignores that error and leaves the output unwritten. Expected: Invalid at build.
    let mut s = Setup::default();
    let w = s.leaf_bytes("w", GgmlType::IQ4_NL, [32, 2, 1, 1], &[0x11; 36]);
    let x = leaf(&mut s, "x", [32, 1, 1, 1], &[1.0; 32]);
    assert_eq!(invalid_op(s.g.mul_mat(w, x)), "mul_mat");
    let ids = s.ids("ids", [1, 1, 1, 1], &[0]);
    assert_eq!(invalid_op(s.g.get_rows(w, ids)), "get_rows");
}

// ---------------------------------------------------------------------------------------------
// mul_mat
// ---------------------------------------------------------------------------------------------

/// `out[m, n, b, c] = sum_k w[k, m, b / (b1 / b0), c / (c1 / c0)] * x[k, n, b, c]` in f64, and the
/// matching `sum |w| |x|` for the tolerance.
fn ref_mul_mat(w: &[f32], wne: Ne, x: &[f32], xne: Ne) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(wne[0], xne[0]);
    let (r2, r3) = (xne[2] / wne[2], xne[3] / wne[3]);
    let one = [wne[1], xne[1], xne[2], xne[3]];
    let (mut out, mut scale) = (Vec::new(), Vec::new());
    for i in coords(one) {
        let wrow = at(wne, [0, i[0], i[2] / r2, i[3] / r3]);
        let xrow = at(xne, [0, i[1], i[2], i[3]]);
        let (mut sum, mut abs) = (0.0f64, 0.0f64);
        for k in 0..wne[0] {
            let p = f64::from(w[wrow + k]) * f64::from(x[xrow + k]);
            sum += p;
            abs += p.abs();
        }
        out.push(sum);
        scale.push(abs);
    }
    (out, scale)
}

const MATMUL_TOL: f64 = 1e-5;

#[test]
fn mul_mat_every_weight_type_with_1_3_and_7_tokens() {
    use GgmlType as T;
    let types = [
        T::F32,
        T::F16,
        T::Q4_0,
        T::Q4_1,
        T::Q8_0,
        T::Q5_0,
        T::Q5_1,
        T::Q2_K,
        T::Q3_K,
        T::Q4_K,
        T::Q5_K,
        T::Q6_K,
    ];
    for ty in types {
        // (k, m) per block size; odd sizes where the type allows.
        let shapes: &[(usize, usize)] = match ty.block_len() {
            1 => &[(33, 7), (65, 5), (1, 3)],
            32 => &[(64, 7), (96, 5), (32, 1)],
            _ => &[(256, 7), (512, 3)],
        };
        let cases = shapes.iter().enumerate().flat_map(|(si, sh)| (1..=2u64).map(move |seed| (si, sh, seed)));
        for (si, &(k, m), seed) in cases {
            let mut rng = Rng(seed * 7919 + ty.id() as u64 * 31 + si as u64);
            let mut s = Setup::default();
            let wdata: Vec<f32> = rng.vec(k * m);
            let (w, wv) = typed_leaf(&mut s, &mut rng, "w", ty, [k, m, 1, 1], &wdata);
            let mut outs = Vec::new();
            let mut xs = Vec::new();
            for n in [1usize, 3, 7] {
                let x = exact_acts(&mut rng, n, k);
                let tx = leaf(&mut s, "x", [k, n, 1, 1], &x);
                outs.push(s.g.mul_mat(w, tx).unwrap());
                xs.push((x, n));
            }
            let got = run_ops(&mut s, &outs, &STEP0);
            for ((x, n), got) in xs.iter().zip(&got) {
                let (want, scale) = ref_mul_mat(&wv, [k, m, 1, 1], x, [k, *n, 1, 1]);
                check_scaled(
                    &format!("mul_mat {ty} k {k} m {m} n {n} seed {seed}"),
                    got,
                    &want,
                    &scale,
                    MATMUL_TOL,
                );
            }
        }
    }
}

/// The encoder's f16 GEMM (`Bound::with_f16_gemm`) gives each output one chain of sums in `k`
/// order over the f16-rounded input, bit for bit, with 1, 2 and 3 threads: two chunks of `k`
/// (the sums wait in the output between them), a block of 64 tokens and a short one, micro-panel
/// and panel tails, and a weight matrix shared by two input batches.
#[test]
fn f16_gemm_is_one_chain_of_sums_per_output() {
    let (k, m, n) = (1500, 13, 70);
    let mut rng = Rng(41);
    let mut s = Setup::default();
    let wdata: Vec<f32> = rng.vec(k * m);
    let (w, wv) = typed_leaf(&mut s, &mut rng, "w", F16, [k, m, 1, 1], &wdata);
    // Not f16 values: the GEMM rounds them.
    let x: Vec<f32> = (0..k * n * 2).map(|_| 3.0 * rng.f32()).collect();
    let tx = leaf(&mut s, "x", [k, n, 2, 1], &x);
    let out = s.g.mul_mat(w, tx).unwrap();
    let mut want = vec![0f32; m * n * 2];
    for (row, xr) in x.chunks_exact(k).enumerate() {
        for (j, wr) in wv.chunks_exact(k).enumerate() {
            want[row * m + j] = xr.iter().zip(wr).fold(0f32, |acc, (&a, &b)| f16r(a) * b + acc);
        }
    }
    let (exact, scale) =
        ref_mul_mat(&wv, [k, m, 1, 1], &x.iter().map(|&v| f16r(v)).collect::<Vec<_>>(), [k, n, 2, 1]);
    for threads in 1..=3 {
        let got = try_run_with(&mut s, &[out], &STEP0, threads, threads == 3, true).unwrap();
        let got: &[f32] = bytemuck::cast_slice(&got[0]);
        check_exact(&format!("f16 GEMM, {threads} threads"), got, &want);
        check_scaled("f16 GEMM", got, &exact, &scale, MATMUL_TOL);
    }
    // Without the flag the same node keeps the one-token dot's order (other bits).
    let dots = try_run_with(&mut s, &[out], &STEP0, 1, false, false).unwrap();
    let dots: &[f32] = bytemuck::cast_slice(&dots[0]);
    assert!(
        dots.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()),
        "the dot tiles sum in k order too"
    );
}

#[test]
fn mul_mat_broadcasts_batches_like_grouped_query_attention() {
    use GgmlType as T;
    // (type, k, m, weight batch, input batch, n)
    let cases = [
        (T::F16, 33, 5, [2, 1], [4, 1], 3),
        (T::F32, 7, 3, [2, 3], [4, 3], 2),
        (T::Q8_0, 64, 5, [1, 1], [2, 2], 3),
        (T::Q4_K, 256, 3, [2, 1], [4, 1], 2),
        (T::Q5_1, 32, 4, [1, 2], [3, 4], 1),
    ];
    for (ci, &(ty, k, m, wb, xb, n)) in cases.iter().enumerate() {
        let mut rng = Rng(500 + ci as u64);
        let wne = [k, m, wb[0], wb[1]];
        let xne = [k, n, xb[0], xb[1]];
        let mut s = Setup::default();
        let (w, wv) = {
            let data = rng.vec(numel(wne));
            typed_leaf(&mut s, &mut rng, "w", ty, wne, &data)
        };
        let x = exact_acts(&mut rng, numel(xne) / k, k);
        let tx = leaf(&mut s, "x", xne, &x);
        let y = s.g.mul_mat(w, tx).unwrap();
        assert_eq!(s.g.tensor(y).ne, [m, n, xb[0], xb[1]]);
        let got = run_ops(&mut s, &[y], &STEP0).remove(0);
        let (want, scale) = ref_mul_mat(&wv, wne, &x, xne);
        check_scaled(&format!("mul_mat broadcast case {ci} ({ty})"), &got, &want, &scale, MATMUL_TOL);
        // Sanity: pairing input batch b with weight batch b % b0 (instead of b / r) is caught.
        if wb[0] > 1 {
            let mut tiled = vec![0.0f32; numel(wne) / wb[0] * xb[0]];
            let wbne = [k, m, xb[0], wb[1]];
            for i in coords(wbne) {
                tiled[at(wbne, i)] = wv[at(wne, [i[0], i[1], i[2] % wb[0], i[3]])];
            }
            let (wrong, _) = ref_mul_mat(&tiled, wbne, &x, xne);
            let worst = got
                .iter()
                .zip(&wrong)
                .zip(&scale)
                .fold(0.0f64, |m, ((&g, &w), &s)| m.max((f64::from(g) - w).abs() / s));
            assert!(worst > 1e-2, "case {ci}: batch pairing is not tested");
        }
    }
}

#[test]
fn mul_mat_reads_strided_weights_and_inputs() {
    use GgmlType as T;
    for (ci, ty) in [T::F32, T::F16, T::Q4_0, T::Q8_0, T::Q6_K].into_iter().enumerate() {
        let mut rng = Rng(700 + ci as u64);
        let k = if ty.block_len() == 256 {
            256
        } else if ty.is_quantized() {
            64
        } else {
            33
        };
        let (heads, n, m) = (4usize, 3usize, 5usize);
        let mut s = Setup::default();
        // Input: a [k, heads, n] leaf permuted to [k, n, heads] (src1 as a permuted view).
        let xbase_ne = [k, heads, n, 1];
        let xbase = exact_acts(&mut rng, heads * n, k);
        let lx = leaf(&mut s, "x", xbase_ne, &xbase);
        let vx = s.g.permute(lx, [0, 2, 1, 3]).unwrap();
        let (x, xne) = permuted(&xbase, xbase_ne, [0, 2, 1, 3]);
        // Weights: rows 2..2+m of a [k, m+3, 2] tensor (a slice along dim 1: strided batches).
        let wbase_ne = [k, m + 3, 2, 1];
        let (lw, wbase) = {
            let data = rng.vec(numel(wbase_ne));
            typed_leaf(&mut s, &mut rng, "w", ty, wbase_ne, &data)
        };
        let vw = s.g.slice(lw, 1, 2, m).unwrap();
        let (wv, wne) = sliced(&wbase, wbase_ne, 1, 2, m);
        let y = s.g.mul_mat(vw, vx).unwrap();
        let mut outs = vec![y];
        // F32 weights may also be permuted in their batch dims: [k, 2, m] -> [k, m, 2].
        let mut permuted_w = None;
        if ty == T::F32 {
            let pne = [k, 2, m, 1];
            let pdata = rng.vec(numel(pne));
            let lp = leaf(&mut s, "wp", pne, &pdata);
            let vp = s.g.permute(lp, [0, 2, 1, 3]).unwrap();
            outs.push(s.g.mul_mat(vp, vx).unwrap());
            permuted_w = Some(permuted(&pdata, pne, [0, 2, 1, 3]));
        }
        let got = run_ops(&mut s, &outs, &STEP0);
        let (want, scale) = ref_mul_mat(&wv, wne, &x, xne);
        check_scaled(&format!("mul_mat strided {ty}"), &got[0], &want, &scale, MATMUL_TOL);
        if let Some((pw, pne)) = permuted_w {
            let (want, scale) = ref_mul_mat(&pw, pne, &x, xne);
            check_scaled("mul_mat with permuted F32 weights", &got[1], &want, &scale, MATMUL_TOL);
        }
    }
}

/// KV cache geometry of the attention tests.
const CTX: usize = 16;
const HD: usize = 8;
const KVH: usize = 2;
const HEADS: usize = 4;

#[test]
fn mul_mat_over_a_kv_cache_view_with_dynamic_length() {
    let kv_w = HD * KVH;
    for (n_past, tokens) in [(0usize, 3usize), (4, 1), (9, 4), (12, 4)] {
        let n_kv = n_past + tokens;
        let mut rng = Rng(n_kv as u64);
        let mut s = Setup::default();
        // K cache F16 [kv_w, CTX]: positions >= n_kv hold NaN, so reading them poisons the result.
        let mut kc: Vec<f32> = rng.vec(kv_w * CTX);
        kc[n_kv * kv_w..].fill(f32::NAN);
        let (kcache, kvals) = typed_leaf(&mut s, &mut rng, "k_cache", F16, [kv_w, CTX, 1, 1], &kc);
        // K as [HD, CTX (dyn), KVH] with strides into the cache.
        let k_ne = [HD, CTX, KVH, 1];
        let k_view = s.g.view(kcache, k_ne, [2, kv_w * 2, HD * 2, kv_w * 2 * CTX], 0, 0b10).unwrap();
        // q [HD, tokens, HEADS] as a permuted view of [HD, HEADS, tokens], f16-exact values.
        let qbase_ne = [HD, HEADS, tokens, 1];
        let qbase: Vec<f32> = exact_acts(&mut rng, HEADS * tokens, HD);
        let lq = leaf(&mut s, "q", qbase_ne, &qbase);
        let q = s.g.permute(lq, [0, 2, 1, 3]).unwrap();
        let (qv, qne) = permuted(&qbase, qbase_ne, [0, 2, 1, 3]);
        let kq = s.g.mul_mat(k_view, q).unwrap();
        assert_eq!(s.g.tensor(kq).dyn_kv, 0b1, "rows of K q follow the KV length");

        // V cache F16 transposed [CTX, kv_w]; V as [CTX (dyn), HD, KVH]; probabilities p as a
        // [CTX (dyn), tokens, HEADS] view of a leaf; both NaN past n_kv.
        let mut vc: Vec<f32> = rng.vec(CTX * kv_w);
        for e in 0..kv_w {
            vc[e * CTX + n_kv..(e + 1) * CTX].fill(f32::NAN);
        }
        let (vcache, vvals) = typed_leaf(&mut s, &mut rng, "v_cache", F16, [CTX, kv_w, 1, 1], &vc);
        let v_ne = [CTX, HD, KVH, 1];
        let v_view = s.g.view(vcache, v_ne, [2, CTX * 2, HD * CTX * 2, kv_w * CTX * 2], 0, 0b1).unwrap();
        let p_ne = [CTX, tokens, HEADS, 1];
        let mut p = exact_acts(&mut rng, tokens * HEADS, CTX);
        for r in 0..tokens * HEADS {
            p[r * CTX + n_kv..(r + 1) * CTX].fill(f32::NAN);
        }
        let lp = leaf(&mut s, "p", p_ne, &p);
        let p_nb = s.g.tensor(lp).nb;
        let p_view = s.g.view(lp, p_ne, p_nb, 0, 0b1).unwrap();
        let kqv = s.g.mul_mat(v_view, p_view).unwrap();
        assert_eq!(s.g.tensor(kqv).dyn_kv, 0, "K-length reduction gives a static result");

        let step = Step { n_past, n_kv };
        let got = run_ops(&mut s, &[kq, kqv], &[step]);
        // References over the effective shapes only.
        let kcut: Vec<f32> =
            coords([HD, n_kv, KVH, 1]).map(|i| kvals[i[0] + i[2] * HD + i[1] * kv_w]).collect();
        let (want, scale) = ref_mul_mat(&kcut, [HD, n_kv, KVH, 1], &qv, qne);
        check_scaled(&format!("K q n_past {n_past}"), &got[0], &want, &scale, MATMUL_TOL);
        let vcut: Vec<f32> =
            coords([n_kv, HD, KVH, 1]).map(|i| vvals[(i[1] + i[2] * HD) * CTX + i[0]]).collect();
        let pcut = compact(&p, p_ne, [n_kv, tokens, HEADS, 1]);
        let (want, scale) = ref_mul_mat(&vcut, [n_kv, HD, KVH, 1], &pcut, [n_kv, tokens, HEADS, 1]);
        check_scaled(&format!("V p n_past {n_past}"), &got[1], &want, &scale, MATMUL_TOL);
    }
}

#[test]
fn attention_chain_over_a_dynamic_kv_length() {
    // K q -> causal soft_max -> V p, on F16 caches with NaN past n_kv, against naive attention.
    let kv_w = HD * KVH;
    for (n_past, tokens, window) in [(0usize, 4usize, 0u32), (5, 3, 0), (10, 2, 4)] {
        let n_kv = n_past + tokens;
        let mut rng = Rng(900 + n_kv as u64);
        let mut s = Setup::default();
        let mut kc = rng.vec(kv_w * CTX);
        kc[n_kv * kv_w..].fill(f32::NAN);
        let (kcache, kvals) = typed_leaf(&mut s, &mut rng, "k_cache", F16, [kv_w, CTX, 1, 1], &kc);
        let mut vc = rng.vec(CTX * kv_w);
        for e in 0..kv_w {
            vc[e * CTX + n_kv..(e + 1) * CTX].fill(f32::NAN);
        }
        let (vcache, vvals) = typed_leaf(&mut s, &mut rng, "v_cache", F16, [CTX, kv_w, 1, 1], &vc);
        let q: Vec<f32> = exact_acts(&mut rng, tokens * HEADS, HD);
        let tq = leaf(&mut s, "q", [HD, tokens, HEADS, 1], &q);
        let g = &mut s.g;
        let k_view =
            g.view(kcache, [HD, CTX, KVH, 1], [2, kv_w * 2, HD * 2, kv_w * 2 * CTX], 0, 0b10).unwrap();
        let v_view =
            g.view(vcache, [CTX, HD, KVH, 1], [2, CTX * 2, HD * CTX * 2, kv_w * CTX * 2], 0, 1).unwrap();
        let kq = g.mul_mat(k_view, tq).unwrap();
        let scale = 1.0 / (HD as f32).sqrt();
        let p = g.soft_max(kq, scale, true, window).unwrap();
        let kqv = g.mul_mat(v_view, p).unwrap();
        let got = run_ops(&mut s, &[kqv], &[Step { n_past, n_kv }]).remove(0);
        // Naive attention in f64.
        let mut want = Vec::new();
        let mut bound = Vec::new();
        for h in 0..HEADS {
            let kh = h / (HEADS / KVH);
            for t in 0..tokens {
                let scores: Vec<f32> = (0..n_kv)
                    .map(|j| {
                        let dot: f64 = (0..HD)
                            .map(|d| {
                                f64::from(q[at([HD, tokens, HEADS, 1], [d, t, h, 0])])
                                    * f64::from(kvals[j * kv_w + kh * HD + d])
                            })
                            .sum();
                        dot as f32
                    })
                    .collect();
                let (start, end) = visible(true, window as usize, n_past + t, n_kv);
                let probs = ref_softmax(&scores, scale.into(), start, end);
                for d in 0..HD {
                    let v = |j: usize| f64::from(vvals[(kh * HD + d) * CTX + j]);
                    want.push((start..end).map(|j| probs[j] * v(j)).sum::<f64>());
                    bound.push((start..end).map(|j| probs[j] * v(j).abs()).sum::<f64>());
                }
            }
        }
        // Output is [HD, tokens, HEADS]; the loops above produce (h, t, d) order = memory order.
        // Tolerance: soft_max's 1e-5, and the probabilities may be converted to f16 (2^-11 relative)
        // before the V product, as ggml does for F16 weights.
        check_scaled(&format!("attention n_past {n_past} window {window}"), &got, &want, &bound, 1e-3);
    }
}

#[test]
fn random_shapes_through_elementwise_norm_softmax_and_matmul() {
    // Shapes drawn at random: odd row lengths, broadcast dims drawn among the divisors.
    const ROWS: [usize; 6] = [1, 3, 5, 7, 33, 65];
    let divisors = |n: usize| (1..=n).filter(|d| n % d == 0).collect::<Vec<_>>();
    for seed in 1..=12u64 {
        let mut rng = Rng(seed * 0x5eed);
        let mut pick = |v: &[usize]| v[rng.below(v.len())];
        let ne: Ne = [pick(&ROWS), pick(&[1, 2, 3, 4, 6]), pick(&[1, 2, 3]), pick(&[1, 2])];
        let bne: Ne = [ne[0], pick(&divisors(ne[1])), pick(&divisors(ne[2])), pick(&divisors(ne[3]))];
        let (m, n) = (pick(&[1, 2, 5, 7]), pick(&[1, 3, 4]));
        let wb = [pick(&divisors(ne[2])), pick(&divisors(ne[3]))];
        let ty = [F32, F16, GgmlType::Q8_0][rng.below(3)];
        let k = if ty == GgmlType::Q8_0 { 32 * (1 + rng.below(3)) } else { ne[0] };
        let (a, b) = (rng.vec(numel(ne)), rng.vec(numel(bne)));
        let wne = [k, m, wb[0], wb[1]];
        let xne = [k, n, ne[2], ne[3]];
        let x = exact_acts(&mut rng, numel(xne) / k, k);
        let mut s = Setup::default();
        let ta = leaf(&mut s, "a", ne, &a);
        let tb = leaf(&mut s, "b", bne, &b);
        let wdata = rng.vec(numel(wne));
        let (tw, wv) = typed_leaf(&mut s, &mut rng, "w", ty, wne, &wdata);
        let tx = leaf(&mut s, "x", xne, &x);
        let add = s.g.add(ta, tb).unwrap();
        let mul = s.g.mul(ta, tb).unwrap();
        let rms = s.g.rms_norm(add, 1e-6).unwrap();
        let sm = s.g.soft_max(mul, 0.7, false, 0).unwrap();
        let mm = s.g.mul_mat(tw, tx).unwrap();
        let out = run_ops(&mut s, &[add, mul, rms, sm, mm], &STEP0);
        let what = format!("seed {seed}: {ne:?} with {bne:?}, {ty} weights {wne:?} x {xne:?}");
        let want_add = ref_binary(&a, ne, &b, bne, |x, y| x + y);
        check(&format!("add {what}"), &out[0], &want_add, 1e-6, 0.0);
        let want_mul = ref_binary(&a, ne, &b, bne, |x, y| x * y);
        check(&format!("mul {what}"), &out[1], &want_mul, 1e-6, 0.0);
        // Norm and softmax of the engine's own add/mul results (so only the op itself is tested).
        let want = ref_rows(&out[0], ne, |r| ref_rms_norm(r, 1e-6));
        check_rows(&format!("rms_norm {what}"), &out[2], &want, ne[0], 1e-5);
        let want = ref_rows(&out[1], ne, |r| {
            ref_softmax(&r.iter().map(|&v| v as f32).collect::<Vec<_>>(), 0.7, 0, r.len())
        });
        check(&format!("soft_max {what}"), &out[3], &want, 0.0, 1e-5);
        let (want, scale) = ref_mul_mat(&wv, wne, &x, xne);
        check_scaled(&format!("mul_mat {what}"), &out[4], &want, &scale, MATMUL_TOL);
    }
}

// ---------------------------------------------------------------------------------------------
// mul_mat_id
// ---------------------------------------------------------------------------------------------

/// Exact expert products for `mul_mat_id`: weights `w` (`[k, m, n_expert]`) times input `x` (`[k,
/// 1 or n_used, tokens]`) for the experts `ids` (`[n_used, tokens]`); values and sums of |products|.
fn ref_mul_mat_id(
    w: &[f32],
    wne: Ne,
    x: &[f32],
    xne: Ne,
    ids: &[i32],
    n_used: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (k, m) = (wne[0], wne[1]);
    let (mut want, mut scale) = (Vec::new(), Vec::new());
    for t in 0..xne[2] {
        for u in 0..n_used {
            let e = ids[t * n_used + u] as usize;
            let xu = if xne[1] == 1 { 0 } else { u };
            for r in 0..m {
                let wrow = &w[at(wne, [0, r, e, 0])..][..k];
                let xrow = &x[at(xne, [0, xu, t, 0])..][..k];
                let p: Vec<f64> = wrow.iter().zip(xrow).map(|(&a, &b)| f64::from(a) * f64::from(b)).collect();
                want.push(p.iter().sum());
                scale.push(p.iter().map(|v| v.abs()).sum());
            }
        }
    }
    (want, scale)
}

#[test]
fn mul_mat_id_selects_experts_per_token() {
    let (m, n_exp, tokens, n_used) = (5usize, 4usize, 3usize, 2usize);
    // Experts per (token, slot), with a token using the same expert twice.
    let ids: [i32; 6] = [1, 1, 3, 0, 2, 3];
    for (ty, k) in [(GgmlType::Q4_0, 64usize), (GgmlType::F32, 33), (GgmlType::Q4_K, 256)] {
        for shared_input in [true, false] {
            let mut rng = Rng(ty.id() as u64 + shared_input as u64);
            let mut s = Setup::default();
            let wne = [k, m, n_exp, 1];
            let (w, wv) = {
                let data = rng.vec(numel(wne));
                typed_leaf(&mut s, &mut rng, "experts", ty, wne, &data)
            };
            let x_rows = if shared_input { 1 } else { n_used };
            let x = exact_acts(&mut rng, x_rows * tokens, k);
            let tx = leaf(&mut s, "x", [k, x_rows, tokens, 1], &x);
            let tid = s.ids("ids", [n_used, tokens, 1, 1], &ids);
            let y = s.g.mul_mat_id(w, tx, tid).unwrap();
            assert_eq!(s.g.tensor(y).ne, [m, n_used, tokens, 1]);
            let got = run_ops(&mut s, &[y], &STEP0).remove(0);
            let (want, scale) = ref_mul_mat_id(&wv, wne, &x, [k, x_rows, tokens, 1], &ids, n_used);
            let what = format!("mul_mat_id {ty} shared input {shared_input}");
            check_scaled(&what, &got, &want, &scale, MATMUL_TOL);
        }
    }
}

/// Repacked experts: every packed format, with more (token, slot) pairs per expert than one
/// kernel tile holds, 1 and 3 threads, within the matmul tolerance of the exact products. The
/// harness overwrites the original expert bytes after repacking, so only the packed slabs can
/// have produced these results.
/// Repacked weights whose rows do not fill the last group of 4 (Granite's 49155-token output):
/// the last group repeats the last row, only the real rows reach the output, on 1 and 3 threads
/// (the partial group on the last thread's share) and for tokens past one kernel tile.
#[test]
fn mul_mat_on_repacked_weights_with_a_partial_last_group_matches_the_reference() {
    let types =
        [(GgmlType::Q4_0, 64usize), (GgmlType::Q8_0, 32), (GgmlType::Q4_K, 256), (GgmlType::Q6_K, 256)];
    for (ty, k) in types {
        for (m, tokens) in [(1usize, 1usize), (5, 3), (7, 1), (50, 9), (6, 20)] {
            let mut rng = Rng(7 + ty.id() as u64 + m as u64);
            let mut s = Setup::default();
            let wne = [k, m, 1, 1];
            let data = rng.vec(numel(wne));
            let (w, wv) = typed_leaf(&mut s, &mut rng, "w", ty, wne, &data);
            let x = exact_acts(&mut rng, tokens, k);
            let xne = [k, tokens, 1, 1];
            let tx = leaf(&mut s, "x", xne, &x);
            let y = s.g.mul_mat(w, tx).unwrap();
            let opts = |threads, repack| RunOpts { threads, packed: true, repack, ..Default::default() };
            let (one, _) = engine::run(&mut s, &[y], &STEP0, opts(1, true));
            let (three, _) = engine::run(&mut s, &[y], &STEP0, opts(3, true));
            assert!(one[0].iter().zip(&three[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {m} rows");
            let (want, scale) = ref_mul_mat(&wv, wne, &x, xne);
            let tol = if ty.block_len() == 32 { MATMUL_TOL } else { 4e-3 };
            check_scaled(&format!("repacked mul_mat {ty} {m} rows x {tokens}"), &one[0], &want, &scale, tol);
        }
    }
}

#[test]
fn mul_mat_id_on_repacked_experts_matches_the_reference() {
    let (m, n_exp, tokens, n_used) = (12usize, 5usize, 37usize, 3usize);
    let types = [
        (GgmlType::Q4_0, 64usize),
        (GgmlType::Q4_1, 96),
        (GgmlType::Q8_0, 32),
        (GgmlType::Q5_0, 64),
        (GgmlType::Q4_K, 256),
        (GgmlType::Q5_K, 256),
        (GgmlType::Q6_K, 256),
    ];
    for (ty, k) in types {
        for shared_input in [true, false] {
            let mut rng = Rng(100 + ty.id() as u64 + shared_input as u64);
            let mut s = Setup::default();
            let wne = [k, m, n_exp, 1];
            let data = rng.vec(numel(wne));
            let (w, wv) = typed_leaf(&mut s, &mut rng, "experts", ty, wne, &data);
            let x_rows = if shared_input { 1 } else { n_used };
            let x = exact_acts(&mut rng, x_rows * tokens, k);
            let tx = leaf(&mut s, "x", [k, x_rows, tokens, 1], &x);
            // Distinct experts per token (top-k never repeats one), expert 4 never used.
            let ids: Vec<i32> = (0..tokens)
                .flat_map(|t| {
                    let first = (t * 7 + 3) % 4;
                    (0..n_used).map(move |u| ((first + u) % 4) as i32)
                })
                .collect();
            let tid = s.ids("ids", [n_used, tokens, 1, 1], &ids);
            let y = s.g.mul_mat_id(w, tx, tid).unwrap();
            let opts = |threads, repack| RunOpts { threads, packed: true, repack, ..Default::default() };
            let (plain, _) = engine::run(&mut s, &[y], &STEP0, opts(1, false));
            let (one, _) = engine::run(&mut s, &[y], &STEP0, opts(1, true));
            let (three, _) = engine::run(&mut s, &[y], &STEP0, opts(3, true));
            assert!(one[0].iter().zip(&three[0]).all(|(a, b)| a.to_bits() == b.to_bits()));
            let (want, scale) = ref_mul_mat_id(&wv, wne, &x, [k, x_rows, tokens, 1], &ids, n_used);
            let what = format!("repacked mul_mat_id {ty} shared input {shared_input}");
            // Packed K-quants fold `d * sc` and `dmin * m` into f16 per 32 values (each rounded
            // once, 2^-11 relative, and a value can be the difference of the two).
            let tol = if ty.block_len() == 32 { MATMUL_TOL } else { 4e-3 };
            check_scaled(&what, &one[0], &want, &scale, tol);
            check_scaled(&format!("unpacked {what}"), &plain[0], &want, &scale, MATMUL_TOL);
        }
    }
}

#[test]
fn mul_mat_id_with_an_expert_outside_the_table_is_bad_index() {
    for bad in [4i32, -1, 1000] {
        let mut rng = Rng(3);
        let mut s = Setup::default();
        let wne = [32, 3, 4, 1];
        let (w, _) = {
            let data = rng.vec(numel(wne));
            typed_leaf(&mut s, &mut rng, "experts", GgmlType::Q4_0, wne, &data)
        };
        let x = exact_acts(&mut rng, 2, 32);
        let tx = leaf(&mut s, "x", [32, 1, 2, 1], &x);
        let tid = s.ids("ids", [2, 2, 1, 1], &[0, 1, 2, bad]);
        let y = s.g.mul_mat_id(w, tx, tid).unwrap();
        let err = run_err(&mut s, &[y], &STEP0);
        assert!(matches!(err, ExecError::BadIndex { op: "mul_mat_id", .. }), "expert {bad}: {err:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// MoE routing: top_k, moe_weights, moe_sum, sigmoid, a one-element row broadcast
// ---------------------------------------------------------------------------------------------

/// Router probabilities of 3 tokens over 6 experts, with a tie (token 1: experts 2 and 4).
const PROBS: [f32; 18] = [
    0.05, 0.40, 0.10, 0.20, 0.15, 0.10, //
    0.10, 0.10, 0.30, 0.05, 0.30, 0.15, //
    0.01, 0.02, 0.03, 0.04, 0.05, 0.85,
];

#[test]
fn top_k_picks_the_largest_first_and_ties_go_to_the_lower_index() {
    let mut s = Setup::default();
    let p = leaf(&mut s, "probs", [6, 3, 1, 1], &PROBS);
    let top = s.g.top_k(p, 3).unwrap();
    assert_eq!(s.g.tensor(top).ne, [3, 3, 1, 1]);
    for threads in [1, 3] {
        let raw = try_run(&mut s, &[top], &STEP0, threads, threads > 1).unwrap().remove(0);
        let ids: Vec<i32> =
            raw.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(ids, [1, 3, 4, 2, 4, 5, 5, 4, 3]);
    }
    assert_eq!(invalid_op(s.g.top_k(p, 7)), "top_k");
    assert_eq!(invalid_op(s.g.top_k(p, 0)), "top_k");
}

#[test]
fn a_non_finite_router_value_stops_the_run_naming_the_layer() {
    for bad in [f32::NAN, f32::INFINITY] {
        let mut probs = PROBS;
        probs[9] = bad;
        let mut s = Setup::default();
        let p = leaf(&mut s, "probs", [6, 3, 1, 1], &probs);
        let top = s.g.top_k(p, 2).unwrap();
        s.g.set_name(top, format_args!("ffn_moe_topk-7"));
        let err = run_err(&mut s, &[top], &STEP0);
        assert!(matches!(err, ExecError::RouterNonFinite { .. }), "{bad}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("router of layer 7") && msg.contains("ffn_moe_topk-7"), "{msg}");
    }
}

#[test]
fn moe_weights_gather_and_renormalize() {
    let ids: [i32; 6] = [1, 3, 2, 4, 5, 0];
    for normalize in [false, true] {
        let mut s = Setup::default();
        let p = leaf(&mut s, "probs", [6, 3, 1, 1], &PROBS);
        let tid = s.ids("ids", [2, 3, 1, 1], &ids);
        let w = s.g.moe_weights(p, tid, normalize).unwrap();
        let got = run_ops(&mut s, &[w], &STEP0).remove(0);
        for t in 0..3 {
            let picked: Vec<f32> = (0..2).map(|u| PROBS[t * 6 + ids[t * 2 + u] as usize]).collect();
            let sum = picked.iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
            for u in 0..2 {
                let want = if normalize { picked[u] / sum } else { picked[u] };
                assert_eq!(
                    got[t * 2 + u].to_bits(),
                    want.to_bits(),
                    "token {t} slot {u} normalize {normalize}"
                );
            }
        }
    }
    let mut s = Setup::default();
    let p = leaf(&mut s, "probs", [6, 3, 1, 1], &PROBS);
    let tid = s.ids("ids", [2, 3, 1, 1], &[1, 3, 2, 6, 5, 0]);
    let w = s.g.moe_weights(p, tid, true).unwrap();
    assert!(matches!(run_err(&mut s, &[w], &STEP0), ExecError::BadIndex { op: "moe_weights", .. }));
}

#[test]
fn moe_sum_weights_each_expert_then_adds_in_order() {
    let (m, k, tokens) = (37usize, 3usize, 4usize);
    let mut rng = Rng(77);
    let experts = rng.vec(m * k * tokens);
    let weights: Vec<f32> = rng.vec(k * tokens).iter().map(|v| v.abs()).collect();
    let mut s = Setup::default();
    let te = leaf(&mut s, "experts", [m, k, tokens, 1], &experts);
    let tw = leaf(&mut s, "weights", [k, tokens, 1, 1], &weights);
    let y = s.g.moe_sum(te, tw).unwrap();
    assert_eq!(s.g.tensor(y).ne, [m, tokens, 1, 1]);
    let got = run_ops(&mut s, &[y], &STEP0).remove(0);
    for t in 0..tokens {
        for i in 0..m {
            // ggml's order: each product rounded to f32, then the views added left to right.
            let mut want = experts[(t * k) * m + i] * weights[t * k];
            for j in 1..k {
                want += experts[(t * k + j) * m + i] * weights[t * k + j];
            }
            assert_eq!(got[t * m + i].to_bits(), want.to_bits(), "token {t} element {i}");
        }
    }
    let bad = leaf(&mut s, "w2", [k + 1, tokens, 1, 1], &vec![0.0; (k + 1) * tokens]);
    assert_eq!(invalid_op(s.g.moe_sum(te, bad)), "moe_sum");
}

#[test]
fn sigmoid_gate_broadcast_over_a_row() {
    let mut rng = Rng(78);
    let (e, tokens) = (19usize, 3usize);
    let x: Vec<f32> = rng.vec(e * tokens).iter().map(|v| v * 4.0).collect();
    let g: Vec<f32> = rng.vec(tokens).iter().map(|v| v * 6.0).collect();
    let mut s = Setup::default();
    let tx = leaf(&mut s, "x", [e, tokens, 1, 1], &x);
    let tg = leaf(&mut s, "gate", [1, tokens, 1, 1], &g);
    let sg = s.g.sigmoid(tg).unwrap();
    let y = s.g.mul(tx, sg).unwrap();
    let z = s.g.add(tx, tg).unwrap();
    let out = run_ops(&mut s, &[sg, y, z], &STEP0);
    for t in 0..tokens {
        let sig = 1.0 / (1.0 + (-f64::from(g[t])).exp());
        assert!((f64::from(out[0][t]) - sig).abs() <= 1e-6, "sigmoid({})", g[t]);
        for i in 0..e {
            assert_eq!(out[1][t * e + i].to_bits(), (x[t * e + i] * out[0][t]).to_bits());
            assert_eq!(out[2][t * e + i].to_bits(), (x[t * e + i] + g[t]).to_bits());
        }
    }
    // Only a one-element row broadcasts along the row.
    let two = leaf(&mut s, "two", [2, tokens, 1, 1], &vec![1.0; 2 * tokens]);
    assert_eq!(invalid_op(s.g.mul(tx, two)), "mul");
}

// ---------------------------------------------------------------------------------------------
// cpy, concat
// ---------------------------------------------------------------------------------------------

#[test]
fn cpy_f32_f16_f32_round_trip_of_a_transposed_view() {
    for (ci, &ne) in [[5usize, 7, 3, 1], [1, 33, 1, 2], [65, 3, 2, 1]].iter().enumerate() {
        let mut rng = Rng(40 + ci as u64);
        // Values across f16's range, including ones that round.
        let x: Vec<f32> = rng.vec(numel(ne)).iter().map(|v| v * 300.0).collect();
        let mut s = Setup::default();
        let tx = leaf(&mut s, "x", ne, &x);
        let t = s.g.transpose(tx).unwrap();
        assert!(ne[0] == 1 || !s.g.tensor(t).rows_are_contiguous());
        let h = s.g.cpy(t, F16).unwrap();
        let back = s.g.cpy(h, F32).unwrap();
        let direct = s.g.cpy(t, F32).unwrap();
        // A permuted (not transposed) view of the F16 copy, back to F32.
        let hp = s.g.permute(h, [0, 2, 1, 3]).unwrap();
        let back_p = s.g.cpy(hp, F32).unwrap();
        let out = run_ops(&mut s, &[back, direct, back_p], &STEP0);
        let (xt, tne) = permuted(&x, ne, [1, 0, 2, 3]);
        let rounded: Vec<f32> = xt.iter().map(|&v| f16r(v)).collect();
        check_exact("f32 -> f16 -> f32 of a transposed view", &out[0], &rounded);
        check_exact("f32 -> f32 of a transposed view", &out[1], &xt);
        let (want, _) = permuted(&rounded, tne, [0, 2, 1, 3]);
        check_exact("f16 permuted view -> f32", &out[2], &want);
        assert!(rounded != xt, "the data must exercise f16 rounding");
        // The F16 bytes themselves.
        let raw = try_run(&mut s, &[h], &STEP0, 1, false).unwrap().remove(0);
        let bits: Vec<u16> = raw.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        let want: Vec<u16> = xt.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        assert_eq!(bits, want, "F16 copy bits");
    }
}

#[test]
fn concat_along_each_dimension() {
    let a_ne = [3usize, 4, 2, 2];
    for dim in 0..4 {
        for seed in 1..=2u64 {
            let mut rng = Rng(seed * 10 + dim as u64);
            let mut b_ne = a_ne;
            b_ne[dim] = [5, 1, 3, 1][dim];
            let a = rng.vec(numel(a_ne));
            let b = rng.vec(numel(b_ne));
            let mut s = Setup::default();
            let ta = leaf(&mut s, "a", a_ne, &a);
            let tb = leaf(&mut s, "b", b_ne, &b);
            let y = s.g.concat(ta, tb, dim).unwrap();
            // Strided operands: both given as permuted views of dims 1 and 2, swapped back.
            let (pa, pa_ne) = permuted(&a, a_ne, [0, 2, 1, 3]);
            let (pb, pb_ne) = permuted(&b, b_ne, [0, 2, 1, 3]);
            let la = leaf(&mut s, "pa", pa_ne, &pa);
            let lb = leaf(&mut s, "pb", pb_ne, &pb);
            let va = s.g.permute(la, [0, 2, 1, 3]).unwrap();
            let vb = s.g.permute(lb, [0, 2, 1, 3]).unwrap();
            let yv = s.g.concat(va, vb, dim).unwrap();
            let out = run_ops(&mut s, &[y, yv], &STEP0);
            let mut ne = a_ne;
            ne[dim] += b_ne[dim];
            let want: Vec<f32> = coords(ne)
                .map(|mut i| {
                    if i[dim] < a_ne[dim] {
                        a[at(a_ne, i)]
                    } else {
                        i[dim] -= a_ne[dim];
                        b[at(b_ne, i)]
                    }
                })
                .collect();
            check_exact(&format!("concat dim {dim}"), &out[0], &want);
            check_exact(&format!("concat of views dim {dim}"), &out[1], &want);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// kv_write
// ---------------------------------------------------------------------------------------------

#[test]
fn kv_write_normal_and_transposed_into_f16_and_f32_caches() {
    let (n_ctx, tokens) = (10usize, 3usize);
    for ty in [F32, F16] {
        for transposed in [false, true] {
            for &row in &[7usize, 33] {
                let mut rng = Rng(row as u64 + transposed as u64 * 7 + (ty == F16) as u64 * 3);
                let mut s = Setup::default();
                let cache_ne = if transposed { [n_ctx, row, 1, 1] } else { [row, n_ctx, 1, 1] };
                let cache = s.persistent("cache", ty, cache_ne);
                // Source rows: columns 1..1+row of a wider [row + 2, tokens] leaf (strided rows).
                let base_ne = [row + 2, tokens, 1, 1];
                let base: Vec<f32> = rng.vec(numel(base_ne)).iter().map(|v| v * 50.0).collect();
                let lb = leaf(&mut s, "k", base_ne, &base);
                let src = s.g.slice(lb, 0, 1, row).unwrap();
                let (x, _) = sliced(&base, base_ne, 0, 1, row);
                let written = s.g.kv_write(cache, src, transposed).unwrap();
                let all = s.g.cpy(written, F32).unwrap();
                // Two steps (the arena persists): positions 0..3, then 5..8 (same source rows).
                let steps = [Step { n_past: 0, n_kv: 3 }, Step { n_past: 5, n_kv: 8 }];
                let mut outs = vec![all];
                if ty == F32 {
                    outs.push(written);
                }
                let got = run_ops(&mut s, &outs, &steps);
                let mut want = vec![0.0f32; n_ctx * row];
                for pos in (0..3).chain(5..8) {
                    let t = pos % 5;
                    for e in 0..row {
                        let v = x[t * row + e];
                        let v = if ty == F16 { f16r(v) } else { v };
                        want[if transposed { e * n_ctx + pos } else { pos * row + e }] = v;
                    }
                }
                let what = format!("kv_write {ty} transposed {transposed} row {row}");
                check_exact(&what, &got[0], &want);
                if ty == F32 {
                    check_exact(&format!("{what} (the written view)"), &got[1], &want);
                }
            }
        }
    }
}

#[test]
fn kv_write_then_read_through_a_view_of_the_written_cache() {
    // The readers of the cache depend on the write: K q at step 2 sees both steps' rows.
    let (row, n_ctx, tokens) = (8usize, 6usize, 2usize);
    let mut rng = Rng(12);
    let mut s = Setup::default();
    let cache = s.persistent("k_cache", F16, [row, n_ctx, 1, 1]);
    let k = exact_acts(&mut rng, tokens, row);
    let tk = leaf(&mut s, "k", [row, tokens, 1, 1], &k);
    let written = s.g.kv_write(cache, tk, false).unwrap();
    let kv =
        s.g.view(written, [row, n_ctx, 1, 1], [2, row * 2, row * 2 * n_ctx, row * 2 * n_ctx], 0, 0b10)
            .unwrap();
    let q = exact_acts(&mut rng, 1, row);
    let tq = leaf(&mut s, "q", [row, 1, 1, 1], &q);
    let kq = s.g.mul_mat(kv, tq).unwrap();
    let steps = [Step { n_past: 0, n_kv: 2 }, Step { n_past: 2, n_kv: 4 }];
    let got = run_ops(&mut s, &[kq], &steps).remove(0);
    let want: Vec<f64> =
        (0..4).map(|j| (0..row).map(|e| f64::from(k[(j % 2) * row + e]) * f64::from(q[e])).sum()).collect();
    check("K q after two writes", &got, &want, 1e-6, 1e-6);
}

#[test]
fn kv_write_past_the_end_of_the_cache_is_cache_full() {
    for transposed in [false, true] {
        let (row, n_ctx, tokens) = (5usize, 8usize, 3usize);
        let mut s = Setup::default();
        let cache_ne = if transposed { [n_ctx, row, 1, 1] } else { [row, n_ctx, 1, 1] };
        let cache = s.persistent("v_cache", F16, cache_ne);
        let tk = leaf(&mut s, "v", [row, tokens, 1, 1], &Rng(1).vec(row * tokens));
        let written = s.g.kv_write(cache, tk, transposed).unwrap();
        // Filling the cache exactly is fine.
        let ok = Step { n_past: n_ctx - tokens, n_kv: n_ctx };
        for (threads, packed) in [(1, false), (3, true)] {
            try_run(&mut s, &[written], &[ok], threads, packed).expect("the last rows fit");
        }
        // One past: an error, whichever step it happens in.
        let full = Step { n_past: n_ctx - tokens + 1, n_kv: n_ctx + 1 };
        let err = run_err(&mut s, &[written], &[full]);
        assert!(matches!(&err, ExecError::CacheFull { name } if name.as_str() == "v_cache"), "{err:?}");
        let err =
            run_err(&mut s, &[written], &[Step { n_past: 0, n_kv: 3 }, Step { n_past: 100, n_kv: 103 }]);
        assert!(matches!(err, ExecError::CacheFull { .. }), "{err:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Builder checks
// ---------------------------------------------------------------------------------------------

#[test]
fn invalid_views_and_shapes_are_graph_errors() {
    let mut s = Setup::default();
    let x = leaf(&mut s, "x", [4, 6, 2, 1], &[0.5; 48]);
    let q = s.leaf_bytes("wq", GgmlType::Q4_0, [64, 2, 1, 1], &[0; 72]);
    let g = &mut s.g;
    let nb = g.tensor(x).nb;

    // Views outside their base, or with split blocks.
    assert_eq!(invalid_op(g.view(x, [4, 6, 2, 1], nb, 4, 0)), "view", "one element too far");
    assert_eq!(invalid_op(g.view(x, [4, 7, 2, 1], nb, 0, 0)), "view", "a row too many");
    assert_eq!(invalid_op(g.view(x, [4, 6, 2, 1], [4, 16, 100, 192], 0, 0)), "view", "stride past the end");
    assert_eq!(invalid_op(g.view(x, [4, 0, 1, 1], nb, 0, 0)), "view", "an empty dimension");
    // Strided elements are fine for plain types (every other float of each row); ops that need
    // contiguous rows refuse such views themselves.
    let every_other = g.view(x, [2, 6, 2, 1], [8, 16, 96, 192], 0, 0).unwrap();
    assert_eq!(invalid_op(g.rms_norm(every_other, 1e-5)), "rms_norm");
    assert_eq!(invalid_op(g.view(x, [4, 6, 2, 1], nb, usize::MAX, 0)), "view", "offset overflow");
    assert_eq!(invalid_op(g.view(q, [16, 2, 1, 1], [18, 36, 72, 72], 0, 0)), "view", "half a q4_0 block");
    assert!(g.view(x, [4, 6, 2, 1], nb, 0, 0).is_ok());

    // Slices past the end.
    assert_eq!(invalid_op(g.slice(x, 1, 3, 4)), "view");
    assert_eq!(invalid_op(g.slice(x, 1, 6, 1)), "view");
    assert_eq!(invalid_op(g.slice(x, 1, usize::MAX, 2)), "view", "start + len overflows");
    assert_eq!(invalid_op(g.slice(x, 0, 0, 0)), "view", "empty");
    assert_eq!(invalid_op(g.slice(x, 4, 0, 1)), "view", "no dimension 4");
    assert_eq!(invalid_op(g.slice(q, 0, 16, 32)), "view", "not at a block boundary");
    assert!(g.slice(x, 1, 3, 3).is_ok() && g.slice(q, 0, 32, 32).is_ok());

    // Permutations with repeated or missing axes; moving a quantized row dimension.
    assert_eq!(invalid_op(g.permute(x, [0, 1, 1, 3])), "view");
    assert_eq!(invalid_op(g.permute(x, [0, 0, 0, 0])), "view");
    assert_eq!(invalid_op(g.permute(x, [0, 1, 2, 4])), "view");
    assert_eq!(invalid_op(g.transpose(q)), "view");
    // Reshapes that change the element count or need a contiguous base.
    assert_eq!(invalid_op(g.reshape(x, [4, 6, 3, 1])), "view");
    let t = g.transpose(x).unwrap();
    assert_eq!(invalid_op(g.reshape(t, [48, 1, 1, 1])), "view");

    // Binary ops whose second operand does not broadcast.
    let y = leaf(&mut s, "y", [4, 4, 2, 1], &[0.5; 32]);
    let z = leaf(&mut s, "z", [5, 6, 2, 1], &[0.5; 60]);
    let w = leaf(&mut s, "w", [4, 12, 2, 1], &[0.5; 96]);
    let u = leaf(&mut s, "u", [6, 1, 2, 1], &[0.5; 12]);
    let v4 = leaf(&mut s, "v4", [4, 4, 1, 1], &[0.5; 16]);
    let g = &mut s.g;
    assert_eq!(invalid_op(g.add(x, y)), "add", "6 rows over 4");
    assert_eq!(invalid_op(g.mul(x, z)), "mul", "rows of different lengths");
    assert_eq!(invalid_op(g.add(x, w)), "add", "the larger operand second");
    assert_eq!(invalid_op(g.add(x, q)), "add", "a quantized operand");
    assert_eq!(invalid_op(g.add(t, x)), "add", "a transposed operand");
    assert_eq!(invalid_op(g.swiglu(x, w)), "swiglu");

    // Matmuls with mismatched inner or batch dimensions.
    assert_eq!(invalid_op(g.mul_mat(x, z)), "mul_mat", "inner 4 vs 5");
    assert_eq!(invalid_op(g.mul_mat(q, x)), "mul_mat", "inner 64 vs 4");
    let b3 = leaf(&mut s, "b3", [4, 1, 3, 1], &[0.5; 12]);
    let leaf_row5 = leaf(&mut s, "r5", [5, 2, 4, 1], &[0.5; 40]);
    let g = &mut s.g;
    assert_eq!(invalid_op(g.mul_mat(x, b3)), "mul_mat", "3 batches over 2");
    assert_eq!(invalid_op(g.mul_mat(x, t)), "mul_mat", "transposed input");
    assert_eq!(invalid_op(g.mul_mat(t, u)), "mul_mat", "transposed weights");
    assert!(g.mul_mat(x, y).is_ok() && g.mul_mat(z, leaf_row5).is_ok());

    // Other ops' checks.
    assert_eq!(invalid_op(g.concat(x, z, 1)), "concat");
    assert_eq!(invalid_op(g.concat(x, x, 4)), "concat");
    assert_eq!(invalid_op(g.rope(x, 3, RopeMode::Normal, 1e4, 1.0, None)), "rope", "odd n_rot");
    assert_eq!(invalid_op(g.rope(x, 6, RopeMode::Normal, 1e4, 1.0, None)), "rope", "n_rot > head");
    assert_eq!(invalid_op(g.rope(x, 4, RopeMode::Neox, 0.0, 1.0, None)), "rope", "zero base");
    assert_eq!(invalid_op(g.rope(x, 4, RopeMode::Neox, 1e4, f32::NAN, None)), "rope", "NaN scale");
    // A shared table must suit the rope it serves: a table, one row per token, n_rot <= head size.
    let (table_1_token, table_6_rot) = (
        g.rope_table(v4, 4, 1e4, 1.0, None, 1.0, None).unwrap(),
        g.rope_table(u, 6, 1e4, 1.0, None, 1.0, None).unwrap(),
    );
    assert_eq!(invalid_op(g.rope_with(x, table_1_token, RopeMode::Neox)), "rope", "1 row for 2 tokens");
    assert_eq!(invalid_op(g.rope_with(x, table_6_rot, RopeMode::Neox)), "rope", "table n_rot > head");
    assert_eq!(invalid_op(g.rope_with(x, y, RopeMode::Neox)), "rope", "not a rope table");
    let shared = g.rope_table(z, 4, 1e4, 1.0, None, 1.0, None).unwrap();
    assert!(
        g.rope_with(x, shared, RopeMode::Normal).is_ok() && g.rope_with(w, shared, RopeMode::Neox).is_ok()
    );
    assert_eq!(invalid_op(g.cpy(q, F32)), "cpy");
    assert_eq!(invalid_op(g.cpy(x, GgmlType::Q8_0)), "cpy");
    assert_eq!(invalid_op(g.get_rows(x, x)), "get_rows", "F32 ids");
    assert_eq!(invalid_op(g.soft_max(x, 1.0, true, u32::MAX)), "soft_max");
    assert_eq!(invalid_op(g.silu(q)), "silu");
    assert_eq!(invalid_op(g.rms_norm(t, 1e-5)), "rms_norm");
    let cache = s.persistent("cache", F16, [4, 3, 1, 1]);
    let g = &mut s.g;
    assert_eq!(invalid_op(g.kv_write(cache, v4, false)), "kv_write", "4 tokens > 3 positions");
    assert_eq!(invalid_op(g.kv_write(cache, x, false)), "kv_write", "3-D rows");
    assert_eq!(invalid_op(g.kv_write(cache, z, true)), "kv_write", "row 5 vs 3");
    assert_eq!(invalid_op(g.kv_write(x, y, false)), "kv_write", "a 3-D cache");

    // A leaf whose row is not whole blocks.
    let e = s.g.leaf("bad", GgmlType::Q4_0, [33, 1, 1, 1], Storage::Activation).unwrap_err();
    assert!(matches!(e, GraphError::Invalid { op: "leaf", .. }), "{e:?}");
}

#[test]
fn mul_mat_id_shape_checks() {
    let mut s = Setup::default();
    let w = s.leaf_bytes("experts", GgmlType::Q4_0, [32, 3, 4, 1], &[0; 216]);
    let x1 = leaf(&mut s, "x", [32, 1, 2, 1], &[0.0; 64]);
    let x3 = leaf(&mut s, "x3", [32, 3, 2, 1], &[0.0; 192]);
    let ids = s.ids("ids", [2, 2, 1, 1], &[0; 4]);
    let ids_tok3 = s.ids("ids3", [2, 3, 1, 1], &[0; 6]);
    let g = &mut s.g;
    assert!(g.mul_mat_id(w, x1, ids).is_ok());
    assert_eq!(invalid_op(g.mul_mat_id(w, x3, ids)), "mul_mat_id", "3 input rows for 2 experts");
    assert_eq!(invalid_op(g.mul_mat_id(w, x1, ids_tok3)), "mul_mat_id", "2 tokens vs 3");
    assert_eq!(invalid_op(g.mul_mat_id(w, x1, x1)), "mul_mat_id", "F32 ids");
}

#[test]
fn graph_capacity_is_enforced() {
    let mut g: Graph<8> = Graph::new();
    let st = |i: usize| Storage::External { buffer: 0, offset: i * 64 };
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(g.leaf("t", F32, [4, 1, 1, 1], st(i)).unwrap());
    }
    ids.push(g.add(ids[0], ids[1]).unwrap());
    assert_eq!(g.tensors().len(), 8);
    assert_eq!(g.leaf("ninth", F32, [4, 1, 1, 1], st(8)), Err(GraphError::CapacityExceeded { capacity: 8 }));
    assert_eq!(g.add(ids[7], ids[2]), Err(GraphError::CapacityExceeded { capacity: 8 }));
    assert_eq!(g.permute(ids[0], [1, 0, 2, 3]), Err(GraphError::CapacityExceeded { capacity: 8 }));
    assert_eq!(g.tensors().len(), 8, "failed pushes leave the graph as it was");
    // Cleared, it takes 8 again.
    g.clear();
    for i in 0..8 {
        g.leaf("t", F32, [4, 1, 1, 1], st(i)).unwrap();
    }
    assert!(matches!(g.leaf("t", F32, [4, 1, 1, 1], st(9)), Err(GraphError::CapacityExceeded { .. })));
}

// ---------------------------------------------------------------------------------------------
// flash_attn
// ---------------------------------------------------------------------------------------------

/// Flash attention over F16 K/V views of a cache with a run-time KV length, grouped-query heads,
/// causal masking with n_past > 0 and a sliding window, against softmax attention in f64 on the
/// F16-rounded inputs. A few tokens take the f16 kernels, which round the query to F16 and
/// accumulate values in F16 like ggml, hence the tolerance; a prompt of 64 tokens or more takes
/// the f32 tiles where the path has them (f32 query and accumulators: 1e-5).
/// Causal softmax attention in f64: `t` query tokens at positions `n_past..` (token `tok`'s row
/// of head `h` is `query(tok, h)`, rounded as the kernel rounds it), each seeing the keys up to
/// its position (within `window` if not 0) of caches `k` and `v` laid out `[hd * n_kv_head, rows]`;
/// the output is `[hd, n_head, t]`.
#[allow(clippy::too_many_arguments)]
fn attention_f64(
    (hd, n_head, n_kv_head): (usize, usize, usize),
    t: usize,
    n_past: usize,
    n_kv: usize,
    window: u32,
    scale: f32,
    query: impl Fn(usize, usize) -> Vec<f32>,
    k: &[f32],
    v: &[f32],
) -> Vec<f64> {
    let mut want = vec![0f64; hd * n_head * t];
    for tok in 0..t {
        let pos = n_past + tok;
        let start = if window > 0 { (pos + 1).saturating_sub(window as usize) } else { 0 };
        for h in 0..n_head {
            let kh = h / (n_head / n_kv_head);
            let qv = query(tok, h);
            let kk = |j: usize, d: usize| f64::from(k[j * hd * n_kv_head + kh * hd + d]);
            let vk = |j: usize, d: usize| f64::from(v[j * hd * n_kv_head + kh * hd + d]);
            let keys = start..(pos + 1).min(n_kv);
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| (0..hd).map(|d| f64::from(qv[d]) * kk(j, d)).sum::<f64>() * f64::from(scale))
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..hd {
                want[d + hd * (h + n_head * tok)] =
                    keys.clone().zip(&e).map(|(j, p)| p / sum * vk(j, d)).sum();
            }
        }
    }
    want
}

#[test]
fn flash_attn_matches_softmax_attention() {
    let (hd, n_head, n_kv_head) = (16usize, 4usize, 2usize);
    for (seed, window, t, n_past, ctx) in
        [(1u64, 0u32, 3usize, 6usize, 12usize), (2, 4, 3, 6, 12), (3, 0, 70, 30, 112), (4, 37, 70, 30, 112)]
    {
        let path = pinfer::kernels::KernelPath::detect();
        let tiles =
            pinfer::kernels::attn_tile::prompt_takes_tiles(path, t, GgmlType::F16, GgmlType::F16, hd, hd);
        let qr = |x: f32| if tiles { x } else { f16r(x) };
        let mut rng = Rng(seed);
        let mut s = Setup::default();
        let q_data = rng.vec(hd * t * n_head);
        let k_data: Vec<f32> = rng.vec(hd * n_kv_head * ctx).into_iter().map(f16r).collect();
        let v_data: Vec<f32> = rng.vec(hd * n_kv_head * ctx).into_iter().map(f16r).collect();
        // Caches as [hd * n_kv_head, ctx] F16 (one row per position), viewed per head.
        let kb: Vec<u8> =
            k_data.iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect();
        let vb: Vec<u8> =
            v_data.iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect();
        let kc = s.leaf_bytes("k", GgmlType::F16, [hd * n_kv_head, ctx, 1, 1], &kb);
        let vc = s.leaf_bytes("v", GgmlType::F16, [hd * n_kv_head, ctx, 1, 1], &vb);
        let q = leaf(&mut s, "q", [hd, t, n_head, 1], &q_data);
        let row = hd * n_kv_head * 2;
        let kv = s.g.view(kc, [hd, ctx, n_kv_head, 1], [2, row, hd * 2, row * ctx], 0, 0b10).unwrap();
        let vv = s.g.view(vc, [hd, ctx, n_kv_head, 1], [2, row, hd * 2, row * ctx], 0, 0b10).unwrap();
        let scale = 0.37;
        let out = s.g.flash_attn(q, kv, vv, scale, Mask::SlidingWindow(window)).unwrap();
        let n_kv = n_past + t;
        let got = run_ops(&mut s, &[out], &[Step { n_past, n_kv }]).remove(0);
        let query = |tok: usize, h: usize| (0..hd).map(|d| qr(q_data[d + hd * (tok + t * h)])).collect();
        let heads = (hd, n_head, n_kv_head);
        let want = attention_f64(heads, t, n_past, n_kv, window, scale, query, &k_data, &v_data);
        check("flash_attn", &got, &want, 0.0, if tiles { 1e-5 } else { 2e-3 });
        // Positions past n_kv and outside the window must not count: a wrong n_past differs.
        let wrong = run_ops(&mut s, &[out], &[Step { n_past: n_past - 1, n_kv }]).remove(0);
        assert!(wrong.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-2));
    }
}

/// Bidirectional attention with ALiBi (jina-bert-v2's): two sequences in one batch, each token
/// over its own sequence's keys (a table of spans), query head `h`'s scores biased by
/// `slope_h * -|i - j|` after the scale (ggml's slopes for max bias 8; grouped heads take their
/// query head's slope) against a float64 softmax; the 530-token sequence's rows are summed in
/// parts (512 keys or more) and merged. ALiBi needs a bidirectional mask and a positive bias.
#[test]
fn bidirectional_attention_with_alibi_matches_the_biased_softmax() {
    use pinfer::kernels::kv_attn::alibi_slope;
    let (hd, n_head, n_kv_head) = (32usize, 4usize, 2usize);
    let lens = [530usize, 7];
    let t: usize = lens.iter().sum();
    let mut rng = Rng(53);
    let mut s = Setup::default();
    let q_data = rng.vec(hd * t * n_head);
    let k_data = rng.vec(hd * t * n_kv_head);
    let v_data = rng.vec(hd * t * n_kv_head);
    let q = leaf(&mut s, "q", [hd, t, n_head, 1], &q_data);
    let k = leaf(&mut s, "k", [hd, t, n_kv_head, 1], &k_data);
    let v = leaf(&mut s, "v", [hd, t, n_kv_head, 1], &v_data);
    let mut spans = Vec::new();
    let mut first = 0;
    for &n in &lens {
        (0..n).for_each(|_| spans.extend([first as i32, n as i32]));
        first += n;
    }
    let spans = s.ids("spans", [2, t, 1, 1], &spans);
    let scale = 0.31;
    assert_eq!(invalid_op(s.g.flash_attn_alibi(q, k, v, scale, Mask::Causal, 8.0)), "flash_attn");
    assert_eq!(invalid_op(s.g.flash_attn_alibi(q, k, v, scale, Mask::Bidirectional, 0.0)), "flash_attn");
    let out = s.g.flash_attn_alibi(q, k, v, scale, Mask::Bidirectional, 8.0).unwrap();
    s.g.at_positions(out, spans).unwrap();
    let plain = s.g.flash_attn(q, k, v, scale, Mask::Bidirectional).unwrap();
    s.g.at_positions(plain, spans).unwrap();
    let got = run_ops(&mut s, &[out, plain], &[Step { n_past: 0, n_kv: t }]);
    let mut want = vec![0f64; hd * n_head * t];
    let mut first = 0;
    for &n in &lens {
        for tok in first..first + n {
            for h in 0..n_head {
                let kh = h / (n_head / n_kv_head);
                let slope = f64::from(alibi_slope(8.0, n_head, h));
                let at = |x: &[f32], j: usize, d: usize| f64::from(x[d + hd * (j + t * kh)]);
                let scores: Vec<f64> = (first..first + n)
                    .map(|j| {
                        let dot: f64 = (0..hd)
                            .map(|d| f64::from(q_data[d + hd * (tok + t * h)]) * at(&k_data, j, d))
                            .sum();
                        dot * f64::from(scale) - slope * (tok as f64 - j as f64).abs()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    want[d + hd * (h + n_head * tok)] =
                        (first..first + n).zip(&e).map(|(j, p)| p / sum * at(&v_data, j, d)).sum();
                }
            }
        }
        first += n;
    }
    check("alibi", &got[0], &want, 0.0, 2e-5);
    // The bias matters: the same node without it is another attention.
    assert!(got[1].iter().zip(&got[0]).any(|(a, b)| (a - b).abs() > 1e-2));
}

/// Bidirectional attention without a table of spans (one sequence: a vision encoder's patches)
/// sees every key of the batch: the same as with the span (0, t) for every token, and the float64
/// softmax; a prompt-sized batch (the f32 tiles' size) as well as a few tokens; and so does one
/// input's (a vision encoder's), in tiles where a prompt takes them.
#[test]
fn bidirectional_attention_without_spans_sees_every_key() {
    let (hd, n_head) = (16usize, 3usize);
    for t in [5usize, 70] {
        let mut rng = Rng(7 + t as u64);
        let mut s = Setup::default();
        let q_data = rng.vec(hd * t * n_head);
        let k_data = rng.vec(hd * t * n_head);
        let v_data = rng.vec(hd * t * n_head);
        let q = leaf(&mut s, "q", [hd, t, n_head, 1], &q_data);
        let k = leaf(&mut s, "k", [hd, t, n_head, 1], &k_data);
        let v = leaf(&mut s, "v", [hd, t, n_head, 1], &v_data);
        let spans: Vec<i32> = (0..t).flat_map(|_| [0, t as i32]).collect();
        let spans = s.ids("spans", [2, t, 1, 1], &spans);
        let scale = 0.4;
        let bare = s.g.flash_attn(q, k, v, scale, Mask::Bidirectional).unwrap();
        let spanned = s.g.flash_attn(q, k, v, scale, Mask::Bidirectional).unwrap();
        s.g.at_positions(spanned, spans).unwrap();
        // One input (a vision encoder's image): the prompt tiles from 64 tokens on.
        let one = s.g.flash_attn(q, k, v, scale, Mask::OneInput).unwrap();
        s.g.at_positions(one, spans).unwrap();
        let got = run_ops(&mut s, &[bare, spanned, one], &[Step { n_past: 0, n_kv: t }]);
        let mut want = vec![0f64; hd * n_head * t];
        for tok in 0..t {
            for h in 0..n_head {
                let at = |x: &[f32], j: usize, d: usize| f64::from(x[d + hd * (j + t * h)]);
                let scores: Vec<f64> = (0..t)
                    .map(|j| {
                        (0..hd).map(|d| at(&q_data, tok, d) * at(&k_data, j, d)).sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    want[d + hd * (h + n_head * tok)] =
                        (0..t).zip(&e).map(|(j, p)| p / sum * at(&v_data, j, d)).sum();
                }
            }
        }
        check("no spans", &got[0], &want, 0.0, 2e-5);
        check("spans", &got[1], &want, 0.0, 2e-5);
        check("one input", &got[2], &want, 0.0, 2e-5);
        // (The tiles sum in another order than the row kernel: not the same bits where they are
        // taken, from 64 tokens on every path but FEAT_FP16's.)
        let path = pinfer::kernels::KernelPath::detect();
        let tiles = pinfer::kernels::attn_tile::prompt_takes_tiles(path, t, F32, F32, hd, hd);
        assert_eq!(got[2] == got[1], !tiles, "{t} tokens on {}: the tiles were (not) taken", path.name());
    }
}

/// A decode step over a long cache splits each row's keys into parts that threads share, merged
/// in a second phase: the result is still the attention over the row's keys (f16, q8_0 and q4_0
/// caches; one token and two; 2, 4 and 16 parts), the same bits on 1 and 3 threads (`run_ops`).
/// A window shorter than the split's minimum keeps the one-pass kernel, and so does a graph with
/// many heads.
#[test]
fn long_decode_splits_its_keys_and_stays_attention() {
    let (hd, n_head, n_kv_head, ctx) = (32usize, 6usize, 2usize, 4352usize);
    let q8 = GgmlType::Q8_0;
    // 2 parts up to 767 keys, 4 at 1100, 16 at 4200.
    for (seed, ty, t, n_past, window) in [
        (1u64, F16, 1usize, 900usize, 0u32),
        (7, q8, 1, 4200, 0),
        (8, F16, 1, 1100, 0),
        (2, q8, 1, 1000, 0),
        (3, GgmlType::Q4_0, 1, 700, 0),
        (4, F16, 2, 600, 0),
        (5, F16, 1, 900, 100),
        (6, q8, 1, 511, 0),
    ] {
        let mut rng = Rng(seed);
        let mut s = Setup::default();
        let q_data = rng.vec(hd * t * n_head);
        let (k_data, v_data) = (rng.vec(hd * n_kv_head * ctx), rng.vec(hd * n_kv_head * ctx));
        let (kc, k_vals) = typed_leaf(&mut s, &mut rng, "k", ty, [hd * n_kv_head, ctx, 1, 1], &k_data);
        let (vc, v_vals) = typed_leaf(&mut s, &mut rng, "v", ty, [hd * n_kv_head, ctx, 1, 1], &v_data);
        let q = leaf(&mut s, "q", [hd, t, n_head, 1], &q_data);
        let (block, row) = (ty.block_bytes(), hd * n_kv_head / ty.block_len() * ty.block_bytes());
        let head = hd / ty.block_len() * ty.block_bytes();
        let kv = s.g.view(kc, [hd, ctx, n_kv_head, 1], [block, row, head, row * ctx], 0, 0).unwrap();
        let vv = s.g.view(vc, [hd, ctx, n_kv_head, 1], [block, row, head, row * ctx], 0, 0).unwrap();
        let scale = 0.43;
        let out = s.g.flash_attn(q, kv, vv, scale, Mask::SlidingWindow(window)).unwrap();
        let n_kv = n_past + t;
        let got = run_ops(&mut s, &[out], &[Step { n_past, n_kv }]).remove(0);
        assert!(work_bytes(&s.g) > 0, "seed {seed}: a decode graph over {ctx} rows can split");
        // The query as the kernel rounds it: to f16, to 15-bit blocks for q8_0 keys, to q8_0
        // for q4_0 keys.
        let query = |x: &[f32]| -> Vec<f32> {
            match ty {
                F16 => x.iter().map(|&v| f16r(v)).collect(),
                GgmlType::Q8_0 => q15_rounded(x),
                _ => decode(q8, &encode(q8, x, hd, &mut Rng(0)), hd),
            }
        };
        let query = |tok: usize, h: usize| {
            query(&(0..hd).map(|d| q_data[d + hd * (tok + t * h)]).collect::<Vec<_>>())
        };
        let heads = (hd, n_head, n_kv_head);
        let want = attention_f64(heads, t, n_past, n_kv, window, scale, query, &k_vals, &v_vals);
        // f16 caches accumulate in f16 (as ggml's kernel), the others in f32.
        check(&format!("seed {seed} ({ty:?})"), &got, &want, 0.0, if ty == F16 { 2e-3 } else { 2e-5 });
    }
    // Eight KV heads keep every thread busy without a split.
    let mut s = Setup::default();
    let kc = s.leaf_bytes("k", F16, [32 * 8, 1024, 1, 1], &vec![0u8; 32 * 8 * 1024 * 2]);
    let q = leaf(&mut s, "q", [32, 1, 8, 1], &[0.5; 32 * 8]);
    let kv = s.g.view(kc, [32, 1024, 8, 1], [2, 512, 64, 512 * 1024], 0, 0).unwrap();
    let out = s.g.flash_attn(q, kv, kv, 1.0, Mask::Causal).unwrap();
    s.g.build(&[out]).unwrap();
    assert_eq!(work_bytes(&s.g), 0);
}

/// The short convolution against an f64 model of it: odd channel count, four taps, three
/// sequences interleaved in one batch (one starting at position 0), two steps so the states carry
/// over; 1 and 3 threads give the same bits (`run_ops`).
#[test]
fn short_conv_carries_each_sequence_state_and_restarts_at_position_zero() {
    let (n_ch, k, n_seq, rows) = (13usize, 4usize, 3usize, 10usize);
    // (sequence, position) of each token; sequence 0 starts fresh in the batch.
    let places = [(1, 5), (0, 0), (1, 6), (2, 2), (0, 1), (1, 7), (1, 8)];
    let n_tok = places.len();
    let mut rng = Rng(41);
    let x: Vec<f32> = (0..n_ch * n_tok).map(|_| rng.f32() * 4.0).collect();
    let taps: Vec<f32> = rng.vec(k * n_ch);
    let mut s = Setup::default();
    let xs = leaf(&mut s, "x", [n_ch, n_tok, 1, 1], &x);
    let ws = leaf(&mut s, "taps", [k, n_ch, 1, 1], &taps);
    let states = s.persistent("states", F32, [(k - 1) * n_ch, n_seq, 1, 1]);
    let flat: Vec<i32> = places.iter().flat_map(|&(q, p)| [(q * rows) as i32, p]).collect();
    let pl = s.ids("places", [2, n_tok, 1, 1], &flat);
    let out = s.g.short_conv(xs, ws, states, pl, rows).unwrap();
    let step = Step { n_past: 0, n_kv: 1 };
    let got = run_ops(&mut s, &[out], &[step, step]);

    // The model: each (sequence, channel) keeps its last k - 1 inputs; two runs of the batch.
    let mut state = vec![vec![vec![0f64; k - 1]; n_ch]; n_seq];
    let mut want = vec![0f64; n_ch * n_tok];
    for _ in 0..2 {
        for (t, &(q, p)) in places.iter().enumerate() {
            for c in 0..n_ch {
                let w = &mut state[q][c];
                if p == 0 {
                    w.fill(0.0);
                }
                let v = f64::from(x[t * n_ch + c]);
                let tap = |j: usize| f64::from(taps[c * k + j]);
                want[t * n_ch + c] = (0..k - 1).map(|j| w[j] * tap(j)).sum::<f64>() + v * tap(k - 1);
                w.rotate_left(1);
                w[k - 2] = v;
            }
        }
    }
    check("short_conv", &got[0], &want, 1e-5, 1e-5);

    // The scalar twin on its own: a fresh window, then one that holds inputs.
    let mut window = [5.0f32, 6.0, 7.0];
    let taps1 = [1.0f32, 10.0, 100.0, 1000.0];
    assert_eq!(pinfer::kernels::reference::short_conv_step_ref(&mut window, &taps1, 2.0, true), 2000.0);
    assert_eq!(window, [0.0, 0.0, 2.0]);
    assert_eq!(pinfer::kernels::reference::short_conv_step_ref(&mut window, &taps1, 3.0, false), 3200.0);
    assert_eq!(window, [0.0, 2.0, 3.0]);
}

#[test]
fn short_conv_refuses_bad_shapes_and_sequences_past_its_states() {
    let mut s = Setup::default();
    let x = leaf(&mut s, "x", [6, 2, 1, 1], &[0.5; 12]);
    let taps = leaf(&mut s, "taps", [3, 6, 1, 1], &[1.0; 18]);
    let one_tap = leaf(&mut s, "one", [1, 6, 1, 1], &[1.0; 6]);
    let states = s.persistent("states", F32, [12, 2, 1, 1]);
    let short_states = s.persistent("short", F32, [6, 2, 1, 1]);
    let not_persistent = leaf(&mut s, "np", [12, 2, 1, 1], &[0.0; 24]);
    let places = s.ids("places", [2, 2, 1, 1], &[0, 0, 10, 0]);
    let places_3 = s.ids("places3", [2, 3, 1, 1], &[0; 6]);
    let past = s.ids("past", [2, 2, 1, 1], &[0, 0, 20, 0]);
    let g = &mut s.g;
    assert_eq!(invalid_op(g.short_conv(x, one_tap, states, places, 10)), "short_conv", "one tap");
    assert_eq!(invalid_op(g.short_conv(x, taps, short_states, places, 10)), "short_conv", "state size");
    assert_eq!(invalid_op(g.short_conv(x, taps, not_persistent, places, 10)), "short_conv", "not persistent");
    assert_eq!(invalid_op(g.short_conv(x, taps, states, places_3, 10)), "short_conv", "3 places");
    assert_eq!(invalid_op(g.short_conv(x, taps, states, places, 0)), "short_conv", "0 rows");
    // Sequence 2 of 2 states: the run stops with a bad index, not a write past the states.
    let out = s.g.short_conv(x, taps, states, past, 10).unwrap();
    let e = run_err(&mut s, &[out], &[Step { n_past: 0, n_kv: 1 }]);
    assert!(matches!(e, ExecError::BadIndex { op: "short_conv", .. }), "{e:?}");
}

/// The gated delta rule against an f64 model of it: heads of 12 (not a multiple of the 8-lane
/// dot), 2 query/key heads shared by 4 value heads (value head h reads query/key head h % 2, as
/// ggml's), two sequences interleaved in one batch (one starting at position 0), two steps so the
/// states carry over; 1 and 3 threads give the same bits (`run_ops`).
#[test]
fn gated_delta_net_carries_each_head_state_and_restarts_at_position_zero() {
    let (d, nk, nv, n_seq, rows) = (12usize, 2usize, 4usize, 2usize, 16usize);
    let places = [(1, 3), (0, 0), (1, 4), (0, 1), (0, 2)];
    let n_tok = places.len();
    let mut rng = Rng(77);
    let unit = |rng: &mut Rng, n: usize| -> Vec<f32> {
        // L2-normalised rows of d, as the model gives the op.
        let mut x = rng.vec(n);
        for row in x.chunks_mut(d) {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v /= norm);
        }
        x
    };
    let q = unit(&mut rng, d * nk * n_tok);
    let k = unit(&mut rng, d * nk * n_tok);
    let v: Vec<f32> = rng.vec(d * nv * n_tok).iter().map(|x| x * 3.0).collect();
    let g: Vec<f32> = rng.vec(nv * n_tok).iter().map(|x| -0.5 - x.abs()).collect();
    let beta: Vec<f32> = rng.vec(nv * n_tok).iter().map(|x| 0.5 + 0.5 * x).collect();
    let mut s = Setup::default();
    let qs = leaf(&mut s, "q", [d, nk, n_tok, 1], &q);
    let ks = leaf(&mut s, "k", [d, nk, n_tok, 1], &k);
    let vs = leaf(&mut s, "v", [d, nv, n_tok, 1], &v);
    let gs = leaf(&mut s, "g", [nv, n_tok, 1, 1], &g);
    let bs = leaf(&mut s, "beta", [nv, n_tok, 1, 1], &beta);
    let states = s.persistent("states", F32, [d * d * nv, n_seq, 1, 1]);
    let flat: Vec<i32> = places.iter().flat_map(|&(q, p)| [(q * rows) as i32, p]).collect();
    let pl = s.ids("places", [2, n_tok, 1, 1], &flat);
    let out = s.g.gated_delta_net(qs, ks, vs, gs, bs, states, pl, rows).unwrap();
    let step = Step { n_past: 0, n_kv: 1 };
    let got = run_ops(&mut s, &[out], &[step, step]);

    // The model: S[seq][h] is d x d, S[i][j]; decay, write along k, read along q.
    let mut st = vec![vec![vec![0f64; d * d]; nv]; n_seq];
    let mut want = vec![0f64; d * nv * n_tok];
    for _ in 0..2 {
        for (t, &(sq, p)) in places.iter().enumerate() {
            for h in 0..nv {
                let m = &mut st[sq][h];
                if p == 0 {
                    m.fill(0.0);
                }
                let at =
                    |x: &[f32], heads: usize, hh: usize, i: usize| f64::from(x[(t * heads + hh) * d + i]);
                let decay = f64::from(g[t * nv + h]).exp();
                m.iter_mut().for_each(|x| *x *= decay);
                let b = f64::from(beta[t * nv + h]);
                let delta: Vec<f64> = (0..d)
                    .map(|j| {
                        (at(&v, nv, h, j) - (0..d).map(|i| m[i * d + j] * at(&k, nk, h % nk, i)).sum::<f64>())
                            * b
                    })
                    .collect();
                for i in 0..d {
                    for j in 0..d {
                        m[i * d + j] += at(&k, nk, h % nk, i) * delta[j];
                    }
                }
                for j in 0..d {
                    let o: f64 = (0..d).map(|i| m[i * d + j] * at(&q, nk, h % nk, i)).sum();
                    want[(t * nv + h) * d + j] = o / (d as f64).sqrt();
                }
            }
        }
    }
    check("gated_delta_net", &got[0], &want, 1e-4, 1e-5);
}

#[test]
fn gated_delta_net_refuses_bad_shapes_and_softplus_is_ggml_s() {
    let mut s = Setup::default();
    let q = leaf(&mut s, "q", [8, 2, 3, 1], &[0.1; 48]);
    let q3 = leaf(&mut s, "q3", [8, 3, 3, 1], &[0.1; 72]);
    let v = leaf(&mut s, "v", [8, 4, 3, 1], &[0.1; 96]);
    let g = leaf(&mut s, "g", [4, 3, 1, 1], &[0.1; 12]);
    let g_short = leaf(&mut s, "g2", [3, 3, 1, 1], &[0.1; 9]);
    let states = s.persistent("states", F32, [8 * 8 * 4, 2, 1, 1]);
    let small = s.persistent("small", F32, [8 * 8 * 2, 2, 1, 1]);
    let places = s.ids("places", [2, 3, 1, 1], &[0; 6]);
    let gg = &mut s.g;
    assert!(gg.gated_delta_net(q, q, v, g, g, states, places, 8).is_ok());
    assert_eq!(
        invalid_op(gg.gated_delta_net(q3, q3, v, g, g, states, places, 8)),
        "gated_delta_net",
        "3 of 4"
    );
    assert_eq!(invalid_op(gg.gated_delta_net(q, q, v, g_short, g, states, places, 8)), "gated_delta_net");
    assert_eq!(invalid_op(gg.gated_delta_net(q, q, v, g, g, small, places, 8)), "gated_delta_net", "states");
    assert_eq!(invalid_op(gg.gated_delta_net(q, q, v, g, g, states, places, 0)), "gated_delta_net", "rows");

    let x = [-30.0f32, -1.0, 0.0, 0.5, 19.9, 20.0, 20.5, 100.0];
    let mut out = [0f32; 8];
    pinfer::kernels::reference::softplus_ref(&x, &mut out);
    for (&xi, &o) in x.iter().zip(&out) {
        let want = if xi > 20.0 { f64::from(xi) } else { (1.0 + f64::from(xi).exp()).ln() };
        assert!((f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1e-6) + 1e-12, "softplus({xi}) = {o}");
    }
}
