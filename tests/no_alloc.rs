//! Computing a token allocates nothing: a counting global allocator watches a real graph run,
//! single-threaded and on the worker pool. (Its own test binary: the allocator is process-wide.)

mod engine;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use engine::{transformer_block, Rng, Setup};
use pinfer::arena::Arena;
use pinfer::exec::pool::Pool;
use pinfer::exec::{work_bytes, Address, Bound, Step};
use pinfer::graph::plan;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

/// Counts an allocation unless it is made on the process's main thread: libtest's harness runs
/// there and allocates when it reports a test running for over 60 seconds (as these do under a
/// busy qemu), while the tests run on threads of their own and so do the pool's workers. (Each
/// test checks that its own allocations are counted.)
fn count() {
    if nix::unistd::gettid() != nix::unistd::getpid() {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The counter is process-wide: the tests run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn running_a_planned_graph_allocates_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Setup::default();
    let out = transformer_block(&mut s, &mut Rng(5), &[1, 2, 3]);
    s.g.build(&[out]).unwrap();
    let p = plan(&s.g).unwrap();
    let threads = 3;
    let work = work_bytes(&s.g);
    let mut memory = vec![0u64; Arena::bytes_for(s.persistent + p.peak_bytes + work + 256).div_ceil(8)];
    let mut arena = Arena::new(bytemuck::cast_slice_mut(&mut memory));
    arena.alloc(s.persistent, "kv cache").unwrap();
    let act = arena.alloc(p.peak_bytes, "activations").unwrap();
    let work = arena.alloc(work, "work").unwrap();
    let inputs = s.inputs.bytes();
    let mut addresses = vec![Address::NOWHERE; s.g.tensors().len()];
    let mut bound = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work, &mut addresses).unwrap();
    let pool = Pool::new(threads, None, false).unwrap();
    // Warm up once (thread start-up may allocate inside std), then count.
    pool.run(&mut bound, Step { n_past: 0, n_kv: 3 }).unwrap();

    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for n_past in [3, 6, 9] {
        pool.run(&mut bound, Step { n_past, n_kv: n_past + 3 }).unwrap();
        bound.run(Step { n_past, n_kv: n_past + 3 }).unwrap();
    }
    let during = ALLOCATIONS.load(Ordering::SeqCst) - before;
    assert!(bound.data_f32(out).iter().all(|v| v.is_finite()));
    assert_eq!(during, 0, "heap allocations while computing tokens");

    // The counter works: an allocation outside the run is seen.
    let v: Vec<u8> = Vec::with_capacity(16);
    assert!(ALLOCATIONS.load(Ordering::SeqCst) > before, "{}", v.capacity());
}

/// The server's step: several sequences in one batch (prompt tokens and single-token decodes
/// mixed), on the real model and the worker pool, with every kind of KV cache (f16; quantized
/// keys and values; f32 and bf16).
#[test]
fn a_decode_step_over_several_sequences_allocates_nothing() {
    use pinfer::quant::GgmlType as T;
    for (k, v) in [(T::F16, T::F16), (T::Q8_0, T::Q8_0), (T::Q4_0, T::Q5_1), (T::F32, T::BF16)] {
        decode_steps_allocate_nothing(pinfer::model::KvTypes { k, v });
    }
}

fn decode_steps_allocate_nothing(kv_types: pinfer::model::KvTypes) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use pinfer::engine::Entry;
    use pinfer::loader::ModelFile;
    use pinfer::session::{Session, SessionOptions};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} missing: run scripts/setup.sh", path.display());
    let model = ModelFile::open_static(&path).unwrap();
    let opts = SessionOptions { n_ctx: 64, n_seq: 3, threads: 2, kv_types, ..Default::default() };
    let mut session = Session::new(model, &opts).unwrap();
    // Prompts of 3, 2 and 1 tokens; then every sequence decodes one token per step.
    let prompt = [
        Entry { seq: 0, pos: 0, token: 1, logits: false },
        Entry { seq: 0, pos: 1, token: 2, logits: false },
        Entry { seq: 0, pos: 2, token: 3, logits: true },
        Entry { seq: 1, pos: 0, token: 4, logits: false },
        Entry { seq: 1, pos: 1, token: 5, logits: true },
        Entry { seq: 2, pos: 0, token: 6, logits: true },
    ];
    session.decode(&prompt).unwrap();
    let mut batch = [Entry { seq: 0, pos: 0, token: 7, logits: true }; 3];
    let step = |session: &mut Session, batch: &mut [Entry; 3]| {
        for (seq, e) in batch.iter_mut().enumerate() {
            *e = Entry { seq, pos: session.seq_len(seq), token: 7 + seq as u32, logits: true };
        }
        session.decode(&batch[..]).unwrap();
        assert!((0..3).all(|i| session.logits(i).is_some_and(|l| l.iter().all(|v| v.is_finite()))));
    };
    // Warm up: the first step of this shape builds its graph.
    step(&mut session, &mut batch);

    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for _ in 0..4 {
        step(&mut session, &mut batch);
    }
    assert_eq!(
        ALLOCATIONS.load(Ordering::SeqCst) - before,
        0,
        "heap allocations in a batched decode step ({kv_types:?})"
    );
    let v: Vec<u8> = Vec::with_capacity(16);
    assert!(ALLOCATIONS.load(Ordering::SeqCst) > before, "the counter misses this thread: {}", v.capacity());
}

/// A context shift of a quantized, rotated K cache (q8_0 keys are Walsh-Hadamard rotated before
/// they are stored; the shift rotates them back, re-applies RoPE, rotates and quantizes again)
/// continues like the f16 cache's shift: the next token's logits agree within q8_0's noise (0.42
/// without a shift, 0.62 after it; a shift that skips the rotation scrambles the kept keys: 6.4).
/// Here because it runs the real model once per cache type, like the test above.
#[test]
fn a_context_shift_of_a_quantized_cache_matches_the_f16_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use pinfer::engine::Entry;
    use pinfer::loader::ModelFile;
    use pinfer::quant::GgmlType as T;
    use pinfer::session::{Session, SessionOptions};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = ModelFile::open_static(&path).unwrap();
    let run = |k, v| {
        let kv_types = pinfer::model::KvTypes { k, v };
        let opts = SessionOptions { n_ctx: 48, threads: 2, kv_types, ..Default::default() };
        let mut session = Session::new(model, &opts).unwrap();
        let prompt: Vec<Entry> = (0..46)
            .map(|pos| Entry { seq: 0, pos, token: 100 + 37 * pos as u32 % 900, logits: pos == 45 })
            .collect();
        session.decode(&prompt).unwrap();
        let dropped = session.shift_context(0, 4).unwrap();
        assert!(dropped > 0);
        let pos = session.seq_len(0);
        session.decode(&[Entry { seq: 0, pos, token: 42, logits: true }]).unwrap();
        session.logits(0).unwrap().to_vec()
    };
    let f16 = run(T::F16, T::F16);
    let argmax = |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b });
    for (k, v) in [(T::Q8_0, T::Q8_0), (T::Q8_0, T::F16)] {
        let q = run(k, v);
        let worst = f16.iter().zip(&q).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert_eq!(argmax(&q), argmax(&f16), "K {k} V {v}: top token");
        assert!(worst < 1.5, "K {k} V {v}: logits differ by up to {worst}");
    }
}
