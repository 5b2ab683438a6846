//! Training: every gradient rule of `pinfer::train::backward` against central finite differences
//! of an f64 reference of the same function, on shapes with odd sizes; ggml's linear regression
//! solved by Adam and by L-BFGS (t0 = 3, t1 = 2, loss 1.4), L-BFGS in fewer iterations; a small
//! MLP fitted; bad parameters and ops without a rule refused by name.

use bytemuck::Zeroable;
use pinfer::exec::{Address, Bound};
use pinfer::graph::{plan, Graph};
use pinfer::quant::GgmlType;
use pinfer::tensor::{Storage, TensorId};
use pinfer::train::optim::{Adam, Lbfgs, Objective, Outcome, Schedule};
use pinfer::train::{arena_regions, backward, GraphObjective, TrainError};

/// A small deterministic generator (values in [-1, 1)).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A loss graph over F32 parameters of the given shapes, bound to its own memory.
struct Problem {
    graph: Box<Graph>,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    loss: TensorId,
    /// Leaves with fixed values (targets, frozen weights), written after binding.
    constants: Vec<(TensorId, Vec<u8>)>,
}

/// Where constants go in the persistent region (after the parameters and gradients).
const CONSTANTS_AT: usize = 4 << 20;

/// Leaves with their bytes, and the next free offset.
type Constants = (Vec<(TensorId, Vec<u8>)>, usize);

thread_local! {
    /// The constants the graph being built asked for.
    static CONSTANTS: std::cell::RefCell<Constants> = const { std::cell::RefCell::new((Vec::new(), CONSTANTS_AT)) };
}

/// A leaf holding `bytes` (of type `ty`, shape `ne`) during the problem's runs.
fn constant(g: &mut Graph, name: &str, ty: GgmlType, ne: [usize; 4], bytes: Vec<u8>) -> TensorId {
    CONSTANTS.with(|c| {
        let mut c = c.borrow_mut();
        let offset = c.1;
        let id = g.leaf(name, ty, ne, Storage::Persistent { offset }).unwrap();
        c.1 += bytes.len().next_multiple_of(64);
        c.0.push((id, bytes));
        id
    })
}

/// Parameters of `shapes` (persistent, 64-byte aligned), `build` makes the loss from them, then
/// the backward pass; returns the problem and the bytes its persistent region takes.
fn problem(
    shapes: &[[usize; 4]],
    build: impl FnOnce(&mut Graph, &[TensorId]) -> TensorId,
) -> (Problem, usize) {
    let mut graph: Box<Graph> = Box::new(Graph::new());
    let mut offset = 0;
    let mut params = Vec::new();
    for (i, &ne) in shapes.iter().enumerate() {
        params.push(graph.leaf(&format!("p{i}"), GgmlType::F32, ne, Storage::Persistent { offset }).unwrap());
        offset += (ne.iter().product::<usize>() * 4).next_multiple_of(64);
    }
    let loss = build(&mut graph, &params);
    let mut grad_offsets = Vec::new();
    for &ne in shapes {
        grad_offsets.push(offset);
        offset += (ne.iter().product::<usize>() * 4).next_multiple_of(64);
    }
    assert!(offset <= CONSTANTS_AT);
    let mut grads = params.clone();
    backward(&mut graph, loss, &params, &grad_offsets, &mut grads).unwrap();
    graph.build_with_roots(&[loss], &grads).unwrap();
    let (constants, end) =
        CONSTANTS.with(|c| std::mem::replace(&mut *c.borrow_mut(), (Vec::new(), CONSTANTS_AT)));
    (Problem { graph, params, grads, loss, constants }, end)
}

/// Runs `f` with the problem as an objective.
fn with_objective<R>(
    p: &Problem,
    persistent: usize,
    f: impl FnOnce(&mut GraphObjective<'_, { pinfer::build_config::GRAPH_CAPACITY }>) -> R,
) -> R {
    let plan = plan(&p.graph).unwrap();
    let (activations, work, bytes) = arena_regions(&p.graph, &plan, persistent);
    let mut memory = vec![0u64; bytes.div_ceil(8)];
    let arena: &mut [u8] = bytemuck::cast_slice_mut(memory.as_mut_slice());
    let mut addresses = vec![Address::NOWHERE; p.graph.tensors().len()];
    let mut bound = Bound::new(&p.graph, &plan, &[], arena, activations, work, &mut addresses).unwrap();
    for (id, bytes) in &p.constants {
        bound.data_mut(*id)[..bytes.len()].copy_from_slice(bytes);
    }
    let mut objective = GraphObjective::new(bound, p.loss, &p.params, &p.grads).unwrap();
    f(&mut objective)
}

/// The random point's values.
#[derive(Clone, Copy)]
enum Values {
    Signed,
    /// In [0.5, 1.5) (for sqrt and division).
    Positive,
    /// Values an 8-bit matmul input holds exactly (the forward pass then matches the reference).
    Q8Exact,
}

/// The graph's gradient at a random point against central differences of `reference` (f64).
fn check_gradient(
    name: &str,
    shapes: &[[usize; 4]],
    build: impl FnOnce(&mut Graph, &[TensorId]) -> TensorId,
    reference: impl Fn(&[Vec<f64>]) -> f64,
    values: Values,
) {
    check_gradient_loss_tol(name, shapes, build, reference, values, 1e-4);
}

/// [`check_gradient`] with the loss held to `reference` within `loss_tol` (relative): GELU's
/// forward is ggml's f16 table of the smooth function the reference and the gradient follow.
fn check_gradient_loss_tol(
    name: &str,
    shapes: &[[usize; 4]],
    build: impl FnOnce(&mut Graph, &[TensorId]) -> TensorId,
    reference: impl Fn(&[Vec<f64>]) -> f64,
    values: Values,
    loss_tol: f64,
) {
    let (p, persistent) = problem(shapes, build);
    let sizes: Vec<usize> = shapes.iter().map(|ne| ne.iter().product()).collect();
    let n: usize = sizes.iter().sum();
    let mut rng = Lcg(name.len() as u64 * 7919);
    let x: Vec<f32> = rng
        .vec(n)
        .into_iter()
        .enumerate()
        .map(|(i, v)| match values {
            Values::Signed => v,
            Values::Positive => 0.5 + v.abs(),
            // Multiples of 1/127 with a 1 opening every block of 32: what Q8_0 holds exactly.
            Values::Q8Exact if i % 32 == 0 => 1.0,
            Values::Q8Exact => (v * 127.0).round() / 127.0,
        })
        .collect();
    let mut grad = vec![0.0; n];
    let loss = with_objective(&p, persistent, |o| o.evaluate(&x, &mut grad).unwrap());

    let split = |x: &[f64]| -> Vec<Vec<f64>> {
        let mut at = 0;
        sizes
            .iter()
            .map(|&s| {
                let v = x[at..at + s].to_vec();
                at += s;
                v
            })
            .collect()
    };
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let f0 = reference(&split(&x64));
    assert!(
        (loss as f64 - f0).abs() <= loss_tol * f0.abs().max(1.0),
        "{name}: loss {loss} against the reference's {f0}"
    );
    let h = 1e-5;
    for i in 0..n {
        let (mut up, mut down) = (x64.clone(), x64.clone());
        up[i] += h;
        down[i] -= h;
        let fd = (reference(&split(&up)) - reference(&split(&down))) / (2.0 * h);
        let tol = 2e-3 * fd.abs().max(1.0);
        assert!(
            (grad[i] as f64 - fd).abs() <= tol,
            "{name}: d/dx[{i}] = {} against {fd} (finite differences)",
            grad[i]
        );
    }
}

#[test]
fn elementwise_gradients_match_finite_differences() {
    let ne = [7, 3, 1, 1];
    let ne_b = [7, 1, 1, 1]; // broadcast over the rows
                             // The loss 0.7 sum(y) + 0.25 sum(y^2): its gradient differs per element through y^2.
    let wsum = |g: &mut Graph, y: TensorId| -> TensorId {
        let shape = g.tensor(y).ne;
        let w = g.fill("w", shape, 0.7).unwrap();
        let yw = g.mul(y, w).unwrap();
        let s = g.sum(yw).unwrap();
        let s2 = g.sqr(y).unwrap();
        let s2 = g.sum(s2).unwrap();
        let s2 = g.scale(s2, 0.25).unwrap();
        g.add(s, s2).unwrap()
    };
    let wref =
        |v: &[f64]| v.iter().map(|a| 0.7 * a).sum::<f64>() + 0.25 * v.iter().map(|a| a * a).sum::<f64>();
    let cols = |b: &[f64], i: usize| b[i % 7];

    check_gradient(
        "add",
        &[ne, ne_b],
        |g, p| {
            let y = g.add(p[0], p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().enumerate().map(|(i, a)| a + cols(&x[1], i)).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "sub",
        &[ne, ne_b],
        |g, p| {
            let y = g.sub(p[0], p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().enumerate().map(|(i, a)| a - cols(&x[1], i)).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "mul",
        &[ne, ne_b],
        |g, p| {
            let y = g.mul(p[0], p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().enumerate().map(|(i, a)| a * cols(&x[1], i)).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "div",
        &[ne, ne_b],
        |g, p| {
            let y = g.div(p[0], p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().enumerate().map(|(i, a)| a / cols(&x[1], i)).collect::<Vec<_>>()),
        Values::Positive,
    );
    // One value broadcast along the rows too.
    check_gradient(
        "mul by a scalar",
        &[ne, [1, 1, 1, 1]],
        |g, p| {
            let y = g.mul(p[0], p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a * x[1][0]).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "scale",
        &[ne],
        |g, p| {
            let y = g.scale(p[0], -1.7).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| -1.7 * a).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "sqr",
        &[ne],
        |g, p| {
            let y = g.sqr(p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a * a).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "sqrt",
        &[ne],
        |g, p| {
            let y = g.sqrt(p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a.sqrt()).collect::<Vec<_>>()),
        Values::Positive,
    );
    check_gradient(
        "sigmoid",
        &[ne],
        |g, p| {
            let y = g.sigmoid(p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| 1.0 / (1.0 + (-a).exp())).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "silu",
        &[ne],
        |g, p| {
            let y = g.silu(p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a / (1.0 + (-a).exp())).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "tanh",
        &[ne],
        |g, p| {
            let y = g.tanh(p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a.tanh()).collect::<Vec<_>>()),
        Values::Signed,
    );
    let gelu = |a: f64| 0.5 * a * (1.0 + (0.7978845608 * (a + 0.044715 * a * a * a)).tanh());
    // Inputs out to +-4 (the random point times 4): the curve's bend and its tails.
    check_gradient_loss_tol(
        "gelu",
        &[ne],
        |g, p| {
            let x = g.scale(p[0], 4.0).unwrap();
            let y = g.gelu(x).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| gelu(4.0 * a)).collect::<Vec<_>>()),
        Values::Signed,
        2e-3,
    );
    check_gradient_loss_tol(
        "geglu",
        &[ne, ne],
        |g, p| {
            let x = g.scale(p[0], 3.0).unwrap();
            let y = g.geglu(x, p[1]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().zip(&x[1]).map(|(a, u)| gelu(3.0 * a) * u).collect::<Vec<_>>()),
        Values::Signed,
        2e-3,
    );
    // Rows of a trainable table, one of them taken twice and one never: the twice-taken row's
    // gradients add up, the other's is zero.
    check_gradient(
        "get_rows",
        &[[7, 5, 1, 1]],
        |g, p| {
            let ids: Vec<u8> = [3i32, 0, 3, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
            let ids = constant(g, "ids", GgmlType::I32, [4, 1, 1, 1], ids);
            let y = g.get_rows(p[0], ids).unwrap();
            wsum(g, y)
        },
        |x| {
            wref(&[3usize, 0, 3, 4].iter().flat_map(|&r| x[0][7 * r..7 * r + 7].to_vec()).collect::<Vec<_>>())
        },
        Values::Signed,
    );
    // A parameter used twice: its gradients add up.
    check_gradient(
        "x * x + x",
        &[ne],
        |g, p| {
            let y = g.mul(p[0], p[0]).unwrap();
            let y = g.add(y, p[0]).unwrap();
            wsum(g, y)
        },
        |x| wref(&x[0].iter().map(|a| a * a + a).collect::<Vec<_>>()),
        Values::Signed,
    );
}

#[test]
fn reduction_broadcast_reshape_and_matmul_gradients_match_finite_differences() {
    // sum(y)^2 + sum(y^2).
    let loss = |g: &mut Graph, y: TensorId| -> TensorId {
        let s = g.sum(y).unwrap();
        let s2 = g.sqr(s).unwrap();
        let q = g.sqr(y).unwrap();
        let q = g.sum(q).unwrap();
        g.add(s2, q).unwrap()
    };
    let lref = |v: &[f64]| v.iter().sum::<f64>().powi(2) + v.iter().map(|a| a * a).sum::<f64>();

    // repeat [5, 1] -> [5, 3]; repeat_back [5, 3] -> [5, 1].
    check_gradient(
        "repeat",
        &[[5, 1, 1, 1]],
        |g, p| {
            let y = g.repeat(p[0], [5, 3, 1, 1]).unwrap();
            loss(g, y)
        },
        |x| lref(&(0..15).map(|i| x[0][i % 5]).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "repeat_back",
        &[[5, 3, 1, 1]],
        |g, p| {
            let y = g.repeat_back(p[0], [5, 1, 1, 1]).unwrap();
            loss(g, y)
        },
        |x| lref(&(0..5).map(|c| (0..3).map(|r| x[0][r * 5 + c]).sum()).collect::<Vec<_>>()),
        Values::Signed,
    );
    check_gradient(
        "reshape",
        &[[6, 2, 1, 1]],
        |g, p| {
            let y = g.reshape(p[0], [3, 4, 1, 1]).unwrap();
            let y = g.repeat(y, [3, 8, 1, 1]).unwrap();
            loss(g, y)
        },
        |x| lref(&(0..24).map(|i| x[0][i % 12]).collect::<Vec<_>>()),
        Values::Signed,
    );
    // matmul: w [k=5, m=3], x [k=5, n=4] -> y [3, 4], y[i, j] = sum_k w[k, i] x[k, j].
    let (k, m, n) = (5, 3, 4);
    check_gradient(
        "mul_mat",
        &[[k, m, 1, 1], [k, n, 1, 1]],
        |g, p| {
            let y = g.mul_mat(p[0], p[1]).unwrap();
            loss(g, y)
        },
        |v| {
            let (w, x) = (&v[0], &v[1]);
            let y: Vec<f64> = (0..n)
                .flat_map(|j| (0..m).map(move |i| (0..k).map(|kk| w[i * k + kk] * x[j * k + kk]).sum()))
                .collect();
            lref(&y)
        },
        Values::Signed,
    );
}

#[test]
fn norm_softmax_loss_and_frozen_matmul_gradients_match_finite_differences() {
    let lref = |v: &[f64]| v.iter().sum::<f64>().powi(2) + v.iter().map(|a| a * a).sum::<f64>();
    let loss = |g: &mut Graph, y: TensorId| -> TensorId {
        let s = g.sum(y).unwrap();
        let s2 = g.sqr(s).unwrap();
        let q = g.sqr(y).unwrap();
        let q = g.sum(q).unwrap();
        g.add(s2, q).unwrap()
    };
    let rows = |x: &[f64], len: usize| -> Vec<Vec<f64>> { x.chunks(len).map(<[f64]>::to_vec).collect() };
    // rms_norm over rows of 9, times a weight so the loss is not scale-invariant.
    check_gradient(
        "rms_norm",
        &[[9, 3, 1, 1], [9, 1, 1, 1]],
        |g, p| {
            let y = g.rms_norm(p[0], 1e-5).unwrap();
            let y = g.mul(y, p[1]).unwrap();
            loss(g, y)
        },
        |x| {
            let y: Vec<f64> = rows(&x[0], 9)
                .into_iter()
                .flat_map(|r| {
                    let s = (r.iter().map(|v| v * v).sum::<f64>() / 9.0 + 1e-5).sqrt();
                    r.into_iter().enumerate().map(move |(i, v)| v / s * x[1][i]).collect::<Vec<_>>()
                })
                .collect();
            lref(&y)
        },
        Values::Signed,
    );
    // Softmax with a scale and the causal mask (query row t sees keys 0..=t).
    check_gradient(
        "soft_max (causal, scaled)",
        &[[5, 4, 1, 1], [5, 4, 1, 1]],
        |g, p| {
            let y = g.soft_max(p[0], 0.7, true, 0).unwrap();
            let y = g.mul(y, p[1]).unwrap();
            loss(g, y)
        },
        |x| {
            let mut y = Vec::new();
            for (t, r) in rows(&x[0], 5).into_iter().enumerate() {
                let max = r[..=t].iter().map(|v| v * 0.7).fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = r[..=t].iter().map(|v| (v * 0.7 - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..5 {
                    y.push(if i <= t { e[i] / z * x[1][t * 5 + i] } else { 0.0 });
                }
            }
            lref(&y)
        },
        Values::Signed,
    );
    // Cross-entropy over 6 rows of 11 logits, one row not scored (target -1).
    let targets = [3i32, 0, 10, -1, 7, 7];
    check_gradient(
        "cross_entropy",
        &[[11, 6, 1, 1]],
        |g, p| {
            let t =
                constant(g, "targets", GgmlType::I32, [6, 1, 1, 1], bytemuck::cast_slice(&targets).to_vec());
            let scaled = g.scale(p[0], 3.0).unwrap();
            g.cross_entropy(scaled, t).unwrap()
        },
        |x| {
            let mut total = 0.0;
            for (r, row) in rows(&x[0], 11).into_iter().enumerate() {
                if targets[r] < 0 {
                    continue;
                }
                let z: f64 = row.iter().map(|v| (3.0 * v).exp()).sum();
                total += z.ln() - 3.0 * row[targets[r] as usize];
            }
            total / 5.0
        },
        Values::Signed,
    );
    // SwiGLU of two parameters.
    check_gradient(
        "swiglu",
        &[[6, 2, 1, 1], [6, 2, 1, 1]],
        |g, p| {
            let y = g.swiglu(p[0], p[1]).unwrap();
            loss(g, y)
        },
        |x| lref(&x[0].iter().zip(&x[1]).map(|(a, b)| a / (1.0 + (-a).exp()) * b).collect::<Vec<_>>()),
        Values::Signed,
    );
    // A frozen Q8_0 weight [k = 64, m = 3] times the parameter [64, 2]: the input's gradient.
    // The loss is linear in the product (sum(y * c)): the forward pass rounds its input to 8 bits,
    // and a loss that depends on y's own values would carry that rounding into the gradient.
    let (k, m, n) = (64, 3, 2);
    let w_values = Lcg(77).vec(k * m);
    let mut blocks = vec![pinfer::quant::blocks::BlockQ8_0::zeroed(); k * m / 32];
    pinfer::quant::quantize::quantize_row_q8_0_ref(&w_values, &mut blocks);
    let w_bytes: Vec<u8> = bytemuck::cast_slice(&blocks).to_vec();
    let c_values = [0.5f32, -1.25, 2.0, 0.75, -0.3, 1.1];
    let mut w_deq = vec![0f32; k * m];
    pinfer::quant::dequantize_row_ref(GgmlType::Q8_0, &w_bytes, &mut w_deq).unwrap();
    check_gradient(
        "mul_mat (frozen Q8_0 weight)",
        &[[k, n, 1, 1]],
        |g, p| {
            let w = constant(g, "w", GgmlType::Q8_0, [k, m, 1, 1], w_bytes.clone());
            let c = constant(g, "c", GgmlType::F32, [m, n, 1, 1], bytemuck::cast_slice(&c_values).to_vec());
            let y = g.mul_mat(w, p[0]).unwrap();
            let yc = g.mul(y, c).unwrap();
            g.sum(yc).unwrap()
        },
        |x| {
            let y: Vec<f64> = (0..n)
                .flat_map(|j| {
                    let w = &w_deq;
                    (0..m).map(move |i| (0..k).map(|kk| w[i * k + kk] as f64 * x[0][j * k + kk]).sum())
                })
                .collect();
            y.iter().zip(&c_values).map(|(a, &b)| a * b as f64).sum()
        },
        Values::Q8Exact,
    );
}

#[test]
fn rope_and_permute_gradients_match_finite_differences() {
    let c_values: Vec<f32> = (0..36).map(|i| 0.3 + 0.17 * ((i * 7) % 11) as f32 - 0.9).collect();
    // sum(y * c) + sum(y^2): position-dependent, so a wrong order or rotation shows.
    let weighted_loss = |g: &mut Graph, y: TensorId, c_values: &[f32]| -> TensorId {
        let ne = g.tensor(y).ne;
        let n: usize = ne.iter().product();
        let c = constant(g, "c", GgmlType::F32, ne, bytemuck::cast_slice(&c_values[..n]).to_vec());
        let yc = g.mul(y, c).unwrap();
        let a = g.sum(yc).unwrap();
        let q = g.sqr(y).unwrap();
        let q = g.sum(q).unwrap();
        g.add(a, q).unwrap()
    };
    let lref = |y: &[f64], c: &[f32]| {
        y.iter().zip(c).map(|(a, &b)| a * b as f64).sum::<f64>() + y.iter().map(|a| a * a).sum::<f64>()
    };

    // RoPE of [6, 2, 3] (head 6, 2 heads, 3 tokens at positions 0..3), 4 of 6 dims rotated.
    for (name, mode) in
        [("rope (normal)", pinfer::graph::RopeMode::Normal), ("rope (neox)", pinfer::graph::RopeMode::Neox)]
    {
        let c = c_values.clone();
        check_gradient(
            name,
            &[[6, 2, 3, 1]],
            |g, p| {
                let y = g.rope(p[0], 4, mode, 10000.0, 1.0, None).unwrap();
                weighted_loss(g, y, &c)
            },
            |x| {
                let mut y = x[0].clone();
                for t in 0..3 {
                    for h in 0..2 {
                        let row = &mut y[(t * 2 + h) * 6..][..6];
                        let src = row.to_vec();
                        for i in 0..2 {
                            let theta = t as f64 * 10000f64.powf(-2.0 * i as f64 / 4.0);
                            let (a, b) = match mode {
                                pinfer::graph::RopeMode::Normal => (2 * i, 2 * i + 1),
                                pinfer::graph::RopeMode::Neox => (i, i + 2),
                            };
                            row[a] = src[a] * theta.cos() - src[b] * theta.sin();
                            row[b] = src[a] * theta.sin() + src[b] * theta.cos();
                        }
                    }
                }
                lref(&y, &c_values)
            },
            Values::Signed,
        );
    }
    // A permute of [4, 3, 3]: source dimension d to axes[d] = [1, 2, 0] -> [3, 4, 3], copied.
    let c = c_values.clone();
    check_gradient(
        "permute",
        &[[4, 3, 3, 1]],
        |g, p| {
            let v = g.permute(p[0], [1, 2, 0, 3]).unwrap();
            let y = g.cpy(v, GgmlType::F32).unwrap();
            weighted_loss(g, y, &c)
        },
        |x| {
            // y[i0, i1, i2] (shape [3, 4, 3]) = x[a0, a1, a2] with a0 -> dim 1, a1 -> dim 2, a2 -> dim 0.
            let mut y = vec![0.0; 36];
            for a2 in 0..3 {
                for a1 in 0..3 {
                    for a0 in 0..4 {
                        let (i0, i1, i2) = (a2, a0, a1);
                        y[i0 + 3 * (i1 + 4 * i2)] = x[0][a0 + 4 * (a1 + 3 * a2)];
                    }
                }
            }
            lref(&y, &c_values)
        },
        Values::Signed,
    );
    // A transpose of [5, 3] -> [3, 5].
    let c = c_values.clone();
    check_gradient(
        "transpose",
        &[[5, 3, 1, 1]],
        |g, p| {
            let v = g.transpose(p[0]).unwrap();
            let y = g.cpy(v, GgmlType::F32).unwrap();
            weighted_loss(g, y, &c)
        },
        |x| {
            let y: Vec<f64> = (0..5)
                .flat_map(|r| (0..3).map(move |col| (r, col)))
                .map(|(r, col)| x[0][col * 5 + r])
                .collect();
            lref(&y, &c_values)
        },
        Values::Signed,
    );
}

/// Batched matmuls, the weights broadcast over groups of the input's batches (grouped-query
/// attention: query heads 2b and 2b + 1 read key head b), both gradients.
#[test]
fn batched_broadcast_matmul_gradients_match_finite_differences() {
    let (k, m, n, b0, b1) = (4usize, 3usize, 2usize, 2usize, 4usize);
    let c_values: Vec<f32> = (0..m * n * b1).map(|i| 0.2 + 0.13 * ((i * 5) % 9) as f32 - 0.5).collect();
    check_gradient(
        "mul_mat (batched, broadcast)",
        &[[k, m, b0, 1], [k, n, b1, 1]],
        |g, p| {
            let y = g.mul_mat(p[0], p[1]).unwrap();
            let c = constant(g, "c", GgmlType::F32, [m, n, b1, 1], bytemuck::cast_slice(&c_values).to_vec());
            let yc = g.mul(y, c).unwrap();
            let a = g.sum(yc).unwrap();
            let q = g.sqr(y).unwrap();
            let q = g.sum(q).unwrap();
            g.add(a, q).unwrap()
        },
        |v| {
            let (w, x) = (&v[0], &v[1]);
            let mut total = 0.0;
            for b in 0..b1 {
                for j in 0..n {
                    for i in 0..m {
                        let y: f64 =
                            (0..k).map(|kk| w[kk + k * (i + m * (b / 2))] * x[kk + k * (j + n * b)]).sum();
                        total += y * c_values[i + m * (j + n * b)] as f64 + y * y;
                    }
                }
            }
            total
        },
        Values::Signed,
    );
}

/// Flash attention over a window's F32 queries, keys and values (a training graph's attention),
/// grouped-query (query heads 2b and 2b + 1 read KV head b), causal, with and without a sliding
/// window: the gradients of all three.
#[test]
fn flash_attention_gradients_match_finite_differences() {
    let (d, dv, t, h, hk, scale) = (4usize, 3usize, 5usize, 4usize, 2usize, 0.6f32);
    let c_values: Vec<f32> = (0..dv * h * t).map(|i| 0.25 + 0.11 * ((i * 7) % 13) as f32 - 0.7).collect();
    for window in [0u32, 3] {
        let c = c_values.clone();
        check_gradient(
            &format!("flash_attn (window {window})"),
            &[[d, t, h, 1], [d, t, hk, 1], [dv, t, hk, 1]],
            |g, p| {
                let mask = if window == 0 {
                    pinfer::graph::Mask::Causal
                } else {
                    pinfer::graph::Mask::SlidingWindow(window)
                };
                // y: [dv, h, t]
                let y = g.flash_attn(p[0], p[1], p[2], scale, mask).unwrap();
                let c = constant(g, "c", GgmlType::F32, [dv, h, t, 1], bytemuck::cast_slice(&c).to_vec());
                let yc = g.mul(y, c).unwrap();
                let a = g.sum(yc).unwrap();
                let q = g.sqr(y).unwrap();
                let q = g.sum(q).unwrap();
                g.add(a, q).unwrap()
            },
            |x| {
                let (q, k, v) = (&x[0], &x[1], &x[2]);
                let mut total = 0.0;
                for head in 0..h {
                    let kv = head / (h / hk);
                    for i in 0..t {
                        // Keys i + 1 - window..=i (all up to i without a window).
                        let first = if window == 0 { 0 } else { (i + 1).saturating_sub(window as usize) };
                        let s: Vec<f64> = (first..=i)
                            .map(|j| {
                                let dot: f64 =
                                    (0..d).map(|e| k[e + d * (j + t * kv)] * q[e + d * (i + t * head)]).sum();
                                dot * scale as f64
                            })
                            .collect();
                        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = s.iter().map(|s| (s - max).exp()).sum();
                        for e in 0..dv {
                            let y: f64 = s
                                .iter()
                                .zip(first..=i)
                                .map(|(s, j)| (s - max).exp() / z * v[e + dv * (j + t * kv)])
                                .sum();
                            total += y * c_values[e + dv * (head + h * i)] as f64 + y * y;
                        }
                    }
                }
                total
            },
            Values::Signed,
        );
    }
}

/// ggml's example: x = -2..2, y = x^2 + 2x + 1, fitted by y = t0 + t1 x.
fn linear_regression() -> (Problem, usize) {
    let xs = [-2.0f32, -1.0, 0.0, 1.0, 2.0];
    problem(&[[1, 1, 1, 1], [1, 1, 1, 1]], |g, p| {
        // The points as constants: each a fill, joined by concat.
        let mut points = g.fill("x0", [1, 1, 1, 1], xs[0]).unwrap();
        let mut targets = g.fill("y0", [1, 1, 1, 1], xs[0] * xs[0] + 2.0 * xs[0] + 1.0).unwrap();
        for &v in &xs[1..] {
            let xv = g.fill("x", [1, 1, 1, 1], v).unwrap();
            let yv = g.fill("y", [1, 1, 1, 1], v * v + 2.0 * v + 1.0).unwrap();
            points = g.concat(points, xv, 0).unwrap();
            targets = g.concat(targets, yv, 0).unwrap();
        }
        let pred = g.mul(points, p[1]).unwrap();
        let pred = g.add(pred, p[0]).unwrap();
        let diff = g.sub(pred, targets).unwrap();
        let sq = g.sqr(diff).unwrap();
        let total = g.sum(sq).unwrap();
        g.scale(total, 1.0 / 10.0).unwrap()
    })
}

#[test]
fn linear_regression_is_solved_by_adam_and_lbfgs() {
    let (p, persistent) = linear_regression();
    let adam = Adam {
        lr: 0.1,
        max_iterations: 2000,
        schedule: Schedule::Cosine { warmup: 0, min_fraction: 0.0 },
        ..Adam::default()
    };
    let (adam_report, adam_x) = with_objective(&p, persistent, |o| {
        let mut x = [0.0f32; 2];
        let mut work = vec![0.0; Adam::work_len(2)];
        (adam.minimize(o, &mut x, &mut work, &mut |_, _| {}).unwrap(), x)
    });
    let lbfgs = Lbfgs::default();
    let (lbfgs_report, lbfgs_x) = with_objective(&p, persistent, |o| {
        let mut x = [0.0f32; 2];
        let mut work = vec![0.0; lbfgs.work_len(2)];
        (lbfgs.minimize(o, &mut x, &mut work, &mut |_, _| {}).unwrap(), x)
    });
    for (name, report, x) in [("adam", adam_report, adam_x), ("lbfgs", lbfgs_report, lbfgs_x)] {
        assert_eq!(report.outcome, Outcome::Converged, "{name}: {report:?}");
        assert!((x[0] - 3.0).abs() < 1e-3 && (x[1] - 2.0).abs() < 1e-3, "{name}: t0 {} t1 {}", x[0], x[1]);
        assert!((report.loss - 1.4).abs() < 1e-3, "{name}: loss {}", report.loss);
    }
    assert!(
        lbfgs_report.iterations < adam_report.iterations,
        "L-BFGS took {} iterations, Adam {}",
        lbfgs_report.iterations,
        adam_report.iterations
    );
}

/// The example's own code (`cargo run --example linear_regression`), in process: a second cargo
/// build of it with other features than the tests' would rebuild the library.
#[path = "../examples/linear_regression.rs"]
#[allow(dead_code)]
mod linear_regression_example;

#[test]
fn the_linear_regression_example_prints_the_answer() {
    for optimizer in ["adam", "lbfgs"] {
        let mut out = Vec::new();
        linear_regression_example::fit(optimizer, &mut out).unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.contains("Final parameters: t0(bias)=3.00000") || text.contains("t0(bias)=2.99999"),
            "{text}"
        );
        assert!(text.contains("Final loss: 1.400000"), "{text}");
    }
}

/// A 2-16-1 MLP with SiLU fitted to y = sin(x0) + x1^2 / 2 on 32 points: the loss falls by 90%.
#[test]
fn a_small_mlp_is_fitted() {
    let n_pts = 32;
    let mut rng = Lcg(5);
    let inputs = rng.vec(2 * n_pts);
    let targets: Vec<f32> =
        (0..n_pts).map(|i| (inputs[2 * i] * 2.0).sin() + inputs[2 * i + 1].powi(2) / 2.0).collect();
    let h = 16;
    // Inputs and targets are parameters the optimizer never moves (a graph constant would need a
    // leaf with values; here they are the last two "parameters", held fixed below).
    let (p, persistent) = problem(
        &[[2, h, 1, 1], [h, 1, 1, 1], [h, 1, 1, 1], [1, 1, 1, 1], [2, n_pts, 1, 1], [1, n_pts, 1, 1]],
        |g, p| {
            let (w1, b1, w2, b2, x, y) = (p[0], p[1], p[2], p[3], p[4], p[5]);
            let hidden = g.mul_mat(w1, x).unwrap(); // [h, n]
            let hidden = g.add(hidden, b1).unwrap();
            let hidden = g.silu(hidden).unwrap();
            let out = g.mul_mat(w2, hidden).unwrap(); // [1, n]
            let out = g.add(out, b2).unwrap();
            let diff = g.sub(out, y).unwrap();
            let sq = g.sqr(diff).unwrap();
            let total = g.sum(sq).unwrap();
            g.scale(total, 1.0 / n_pts as f32).unwrap()
        },
    );
    let n_train = 2 * h + h + h + 1;
    struct Fixed<'o, O> {
        inner: &'o mut O,
        data: Vec<f32>,
        full: Vec<f32>,
        grad: Vec<f32>,
    }
    impl<O: Objective> Objective for Fixed<'_, O> {
        type Error = O::Error;
        fn evaluate(&mut self, x: &[f32], grad: &mut [f32]) -> Result<f32, O::Error> {
            self.full[..x.len()].copy_from_slice(x);
            self.full[x.len()..].copy_from_slice(&self.data);
            let loss = self.inner.evaluate(&self.full, &mut self.grad)?;
            grad.copy_from_slice(&self.grad[..x.len()]);
            Ok(loss)
        }
    }
    let mut data = inputs.clone();
    data.extend_from_slice(&targets);
    let mut x: Vec<f32> = Lcg(9).vec(n_train).into_iter().map(|v| v * 0.5).collect();
    let (first, report) = with_objective(&p, persistent, |o| {
        let total = n_train + data.len();
        let mut f = Fixed { inner: o, data: data.clone(), full: vec![0.0; total], grad: vec![0.0; total] };
        let mut g = vec![0.0; n_train];
        let first = f.evaluate(&x, &mut g).unwrap();
        let adam = Adam { lr: 0.02, max_iterations: 1500, ..Adam::default() };
        let mut work = vec![0.0; Adam::work_len(n_train)];
        (first, adam.minimize(&mut f, &mut x, &mut work, &mut |_, _| {}).unwrap())
    });
    assert!(report.loss < 0.1 * first, "the loss went from {first} to {}", report.loss);
}

#[test]
fn bad_parameters_and_ops_without_a_rule_are_refused() {
    let mut g: Box<Graph> = Box::new(Graph::new());
    let p = g.leaf("p", GgmlType::F32, [4, 1, 1, 1], Storage::Persistent { offset: 0 }).unwrap();
    let act = g.scale(p, 2.0).unwrap();
    let loss = g.sum(act).unwrap();
    let mut grads = [p];
    // A computed tensor as a parameter; a loss that is not a scalar; counts that differ.
    let e = backward(&mut g, loss, &[act], &[64], &mut grads).unwrap_err();
    assert!(matches!(e, TrainError::BadParameter { .. }), "{e}");
    let e = backward(&mut g, act, &[p], &[64], &mut grads).unwrap_err();
    assert_eq!(e, TrainError::LossNotScalar);
    let e = backward(&mut g, loss, &[p], &[64, 128], &mut grads).unwrap_err();
    assert_eq!(e, TrainError::GradientCount);
    // An op with no rule between the parameter and the loss: refused, named.
    let bent = g.softplus(p).unwrap();
    let loss2 = g.sum(bent).unwrap();
    let e = backward(&mut g, loss2, &[p], &[64], &mut grads).unwrap_err();
    assert!(e.to_string().contains("softplus"), "{e}");
}
