//! The executor's matmul offload hook (`Bound::with_offload`, the NPU's entry point) with mock
//! hooks on the test transformer block: accepted matmuls run once, on thread 0, with their F32
//! input; a hook that fails leaves the node to the CPU with bit-identical results; a hook that
//! accepts nothing changes nothing.

mod engine;

use std::sync::atomic::{AtomicUsize, Ordering};

use engine::{assert_close, decode, transformer_block, Rng, Setup};
use pinfer::arena::Arena;
use pinfer::exec::pool::Pool;
use pinfer::exec::{work_bytes, Address, Bound, MatmulOffload, Step};
use pinfer::graph::{plan, Op};
use pinfer::quant::GgmlType;
use pinfer::tensor::{Storage, TensorId};

const TOKENS: [i32; 3] = [7, 3, 42];
/// The 3-token graph run twice: a prompt, then 3 more tokens with the first 3 in the KV cache.
const STEPS: [Step; 2] = [Step { n_past: 0, n_kv: 3 }, Step { n_past: 3, n_kv: 6 }];

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Computes the exact product (f64 sums over the dequantized weights).
    Exact,
    /// Scribbles NaN over the output and reports failure.
    Fail,
    /// Accepts nothing.
    Refuse,
}

struct Hook {
    /// Offset, type, K, N and dequantized values of every matmul weight in buffer 0.
    weights: Vec<(usize, GgmlType, usize, usize, Vec<f32>)>,
    mode: Mode,
    min_tokens: usize,
    calls: AtomicUsize,
    begins: AtomicUsize,
    thread: std::sync::Mutex<Option<std::thread::ThreadId>>,
}

impl Hook {
    fn new(s: &Setup, mode: Mode, min_tokens: usize) -> Self {
        let mut weights = Vec::new();
        for &id in s.g.order() {
            let t = s.g.tensor(id);
            let Some(w) = t.src[0].filter(|_| t.op == Op::MulMat) else { continue };
            let w = s.g.tensor(w);
            let Storage::External { buffer: 0, offset } = w.storage else { continue };
            if weights.iter().any(|x: &(usize, GgmlType, usize, usize, Vec<f32>)| x.0 == offset) {
                continue;
            }
            let values = decode(w.ty, &s.inputs.bytes()[offset..offset + w.span_bytes()], w.ne[0]);
            weights.push((offset, w.ty, w.ne[0], w.ne[1], values));
        }
        assert!(weights.len() >= 7, "the block has seven weight matmuls and the output");
        Self {
            weights,
            mode,
            min_tokens,
            calls: AtomicUsize::new(0),
            begins: AtomicUsize::new(0),
            thread: std::sync::Mutex::new(None),
        }
    }
}

impl MatmulOffload for Hook {
    fn begin(&self) {
        self.begins.fetch_add(1, Ordering::Relaxed);
    }

    fn accepts(&self, weights: usize, k: usize, n: usize, n_tokens: usize) -> bool {
        self.mode != Mode::Refuse
            && n_tokens >= self.min_tokens
            && self.weights.iter().any(|w| w.0 == weights && (w.2, w.3) == (k, n))
    }

    fn run(&self, weights: usize, k: usize, n: usize, input: &[f32], output: &mut [f32]) -> bool {
        self.calls.fetch_add(1, Ordering::Relaxed);
        // Always the same thread (the pool's thread 0, the caller).
        let me = std::thread::current().id();
        assert_eq!(*self.thread.lock().unwrap().get_or_insert(me), me);
        assert_eq!(input.len() % k, 0);
        assert_eq!(output.len(), input.len() / k * n);
        if self.mode == Mode::Fail {
            output.fill(f32::NAN);
            return false;
        }
        let w = &self.weights.iter().find(|w| w.0 == weights).unwrap().4;
        for (x, out) in input.chunks_exact(k).zip(output.chunks_exact_mut(n)) {
            for (j, o) in out.iter_mut().enumerate() {
                *o = w[j * k..(j + 1) * k]
                    .iter()
                    .zip(x)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>() as f32;
            }
        }
        true
    }
}

/// Runs the block's two steps with `threads` threads and the hook (if any); returns the logits.
fn run(threads: usize, hook: Option<(Mode, usize)>) -> (Vec<f32>, Option<Hook>) {
    let mut s = Setup::default();
    let out: TensorId = transformer_block(&mut s, &mut Rng(1), &TOKENS);
    s.g.build(&[out]).unwrap();
    let hook = hook.map(|(mode, min)| Hook::new(&s, mode, min));
    let p = plan(&s.g).unwrap();
    let work = work_bytes(&s.g);
    let mut memory = vec![0u64; Arena::bytes_for(s.persistent + p.peak_bytes + work + 256).div_ceil(8)];
    let mut arena = Arena::new(bytemuck::cast_slice_mut(&mut memory));
    arena.alloc(s.persistent, "persistent").unwrap();
    let act = arena.alloc(p.peak_bytes, "activations").unwrap();
    let work = arena.alloc(work, "work").unwrap();
    let inputs = s.inputs.bytes();
    let mut addresses = vec![Address::NOWHERE; s.g.tensors().len()];
    let mut bound = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work, &mut addresses).unwrap();
    if let Some(h) = &hook {
        bound = bound.with_offload(h);
    }
    let pool = (threads > 1).then(|| Pool::new(threads, None, false).unwrap());
    for step in STEPS {
        match &pool {
            Some(pool) => pool.run(&mut bound, step).unwrap(),
            None => bound.run(step).unwrap(),
        }
    }
    let logits = bound.data_f32(out).to_vec();
    (logits, hook)
}

#[test]
fn a_failing_hook_leaves_identical_results() {
    let (cpu, _) = run(1, None);
    for threads in [1, 2, 3] {
        let (got, hook) = run(threads, Some((Mode::Fail, 1)));
        let hook = hook.unwrap();
        assert_eq!(got, cpu, "{threads} threads: the CPU must redo failed nodes exactly");
        // Every matmul of both steps was offered once (the block has eight).
        assert!(hook.calls.load(Ordering::Relaxed) >= 2 * 8, "{}", hook.calls.load(Ordering::Relaxed));
        assert_eq!(hook.begins.load(Ordering::Relaxed), STEPS.len());
    }
}

#[test]
fn a_refusing_hook_changes_nothing() {
    let (cpu, _) = run(2, None);
    let (got, hook) = run(2, Some((Mode::Refuse, 1)));
    assert_eq!(got, cpu);
    assert_eq!(hook.unwrap().calls.load(Ordering::Relaxed), 0);
}

#[test]
fn accepted_matmuls_run_once_on_the_hook() {
    let (cpu, _) = run(1, None);
    for threads in [1, 3] {
        // Both steps run the 3-token graph: every matmul goes to the hook, once per step.
        let (got, hook) = run(threads, Some((Mode::Exact, 3)));
        assert_eq!(hook.unwrap().calls.load(Ordering::Relaxed), 2 * 8, "eight matmuls, two steps");
        // The CPU rounds activations to Q8 for quantized weights; the hook computes exactly.
        assert_close(&format!("{threads} threads"), &got, &cpu, 0.03);
        assert_ne!(got, cpu, "the hook's results were used");
    }
    // Below the hook's batch size: nothing is offered.
    let (got, hook) = run(3, Some((Mode::Exact, 4)));
    assert_eq!(hook.unwrap().calls.load(Ordering::Relaxed), 0);
    assert_eq!(got, cpu);
}
