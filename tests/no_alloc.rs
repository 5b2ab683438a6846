//! Computing a token allocates nothing: a counting global allocator watches a real graph run,
//! single-threaded and on the worker pool. (Its own test binary: the allocator is process-wide.)

mod engine;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use engine::{transformer_block, Rng, Setup};
use pinfer::arena::Arena;
use pinfer::exec::pool::Pool;
use pinfer::exec::{work_bytes, Bound, Step};
use pinfer::graph::plan;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn running_a_planned_graph_allocates_nothing() {
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
    let mut bound = Bound::new(&s.g, &p, &[inputs], arena.memory(), act, work).unwrap();
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
