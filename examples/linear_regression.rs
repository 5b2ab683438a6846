//! ggml's canonical training example on pinfer's graphs: fit y = t0 + t1 x to the points
//! x = -2..2, y = x^2 + 2x + 1 by least squares (loss = sum (t0 + t1 x - y)^2 / 2n), with Adam
//! or L-BFGS, gradients from the automatic differentiation of `pinfer::train`. The answer is
//! t0 = 3, t1 = 2, loss 1.4.
//!
//!   cargo run --release --example linear_regression -- --optimizer adam|lbfgs

use pinfer::exec::{Address, Bound};
use pinfer::graph::{plan, Graph};
use pinfer::quant::GgmlType;
use pinfer::tensor::Storage;
use pinfer::train::optim::{Adam, Lbfgs, Report, Schedule};
use pinfer::train::{arena_regions, backward, GraphObjective};

use std::io::Write;

fn main() {
    let optimizer = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => "adam".to_string(),
        [flag, name] if flag == "--optimizer" && (name == "adam" || name == "lbfgs") => name.clone(),
        _ => {
            eprintln!("usage: linear_regression [--optimizer adam|lbfgs]");
            std::process::exit(2);
        }
    };
    fit(&optimizer, &mut std::io::stdout().lock()).unwrap();
}

/// Fits the line with `optimizer` ("adam" or "lbfgs"), writing its progress and answer to `out`.
/// (`tests/train.rs` runs it too.)
pub fn fit(optimizer: &str, out: &mut impl Write) -> std::io::Result<()> {
    // The persistent region: t0, t1, the five x and y values, then the two gradients.
    let xs = [-2.0f32, -1.0, 0.0, 1.0, 2.0];
    let ys: Vec<f32> = xs.iter().map(|x| x * x + 2.0 * x + 1.0).collect();
    let n = xs.len();
    let mut g: Box<Graph> = Box::new(Graph::new());
    let leaf = |g: &mut Graph, name: &str, len: usize, offset: usize| {
        g.leaf(name, GgmlType::F32, [len, 1, 1, 1], Storage::Persistent { offset }).unwrap()
    };
    let t0 = leaf(&mut g, "t0", 1, 0);
    let t1 = leaf(&mut g, "t1", 1, 64);
    let x = leaf(&mut g, "x", n, 128);
    let y = leaf(&mut g, "y", n, 192);
    let pred = g.mul(x, t1).unwrap();
    let pred = g.add(pred, t0).unwrap();
    let diff = g.sub(pred, y).unwrap();
    let sq = g.sqr(diff).unwrap();
    let total = g.sum(sq).unwrap();
    let loss = g.scale(total, 1.0 / (2.0 * n as f32)).unwrap();
    let params = [t0, t1];
    let mut grads = [t0; 2];
    backward(&mut g, loss, &params, &[256, 320], &mut grads).unwrap();
    g.build_with_roots(&[loss], &grads).unwrap();
    let plan = plan(&g).unwrap();
    let (activations, work, bytes) = arena_regions(&g, &plan, 384);
    let mut memory = vec![0u64; bytes.div_ceil(8)];
    let arena: &mut [u8] = bytemuck::cast_slice_mut(memory.as_mut_slice());
    let mut addresses = vec![Address::NOWHERE; g.tensors().len()];
    let mut bound = Bound::new(&g, &plan, &[], arena, activations, work, &mut addresses).unwrap();
    bytemuck::cast_slice_mut::<u8, f32>(bound.data_mut(x)).copy_from_slice(&xs);
    bytemuck::cast_slice_mut::<u8, f32>(bound.data_mut(y)).copy_from_slice(&ys);
    let mut objective = GraphObjective::new(bound, loss, &params, &grads).unwrap();

    let mut theta = [0.0f32; 2];
    let mut lines = Vec::new();
    let mut show = |k: usize, l: f32| {
        if k < 10 || k % 100 == 0 {
            lines.push(format!("iteration {k:4}: loss {l:.6}"));
        }
    };
    let report: Report = if optimizer == "adam" {
        let adam = Adam {
            lr: 0.1,
            max_iterations: 2000,
            schedule: Schedule::Cosine { warmup: 0, min_fraction: 0.0 },
            grad_tolerance: 1e-5,
            ..Adam::default()
        };
        writeln!(
            out,
            "optimizer: Adam (lr {}, cosine decay, at most {} iterations)",
            adam.lr, adam.max_iterations
        )?;
        let mut work = vec![0.0; Adam::work_len(2)];
        adam.minimize(&mut objective, &mut theta, &mut work, &mut show).unwrap()
    } else {
        let lbfgs = Lbfgs::default();
        writeln!(
            out,
            "optimizer: L-BFGS (history {}, at most {} iterations)",
            lbfgs.history, lbfgs.max_iterations
        )?;
        let mut work = vec![0.0; lbfgs.work_len(2)];
        lbfgs.minimize(&mut objective, &mut theta, &mut work, &mut show).unwrap()
    };
    for line in &lines {
        writeln!(out, "{line}")?;
    }
    writeln!(
        out,
        "{:?} after {} iterations ({} loss evaluations)",
        report.outcome, report.iterations, report.evaluations
    )?;
    writeln!(out, "Final parameters: t0(bias)={:.6}, t1(weight)={:.6}", theta[0], theta[1])?;
    writeln!(out, "Final loss: {:.6}", report.loss)
}
