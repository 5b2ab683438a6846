//! std: a pool of worker threads, created once, each pinned to one core of the process's
//! affinity mask, that run graphs together with the calling thread.
//!
//! Every thread runs every computing node on its share of the rows, then waits at a barrier.
//! Waits spin briefly and then sleep on a condition variable, so a pool with more threads than
//! cores (or under SCHED_FIFO) never livelocks: a sleeping waiter gives its core to the thread
//! that still has work.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::vec::Vec;

use super::{Bound, ExecError, Step};

/// Spins before a waiter goes to sleep (about a few microseconds on an A76).
const SPIN_ROUNDS: u32 = 4096;

/// A reusable barrier that spins, then sleeps.
pub struct Barrier {
    n: usize,
    count: AtomicUsize,
    generation: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Barrier {
    /// A barrier for `n` threads.
    pub fn new(n: usize) -> Self {
        Self {
            n,
            count: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Blocks until all `n` threads have called `wait` for this round.
    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::AcqRel);
            // Taking the lock orders this wake-up after any sleeper's check of the generation.
            drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
            self.cv.notify_all();
            return;
        }
        for _ in 0..SPIN_ROUNDS {
            if self.generation.load(Ordering::Acquire) != generation {
                return;
            }
            core::hint::spin_loop();
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.generation.load(Ordering::Acquire) == generation {
            guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// One run handed to the workers: a type-erased `&Bound` and the function that runs a share of it.
#[derive(Clone, Copy)]
struct Job {
    bound: *const (),
    run_share: unsafe fn(*const (), Step, usize, usize, &Barrier),
    step: Step,
    nth: usize,
}

// SAFETY: the pointer is only dereferenced while `Pool::run` blocks, and `Bound` is Sync.
unsafe impl Send for Job {}

struct State {
    /// Incremented for each job; workers run a job when they see a new number.
    round: u64,
    job: Option<Job>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    start: Condvar,
    barrier: Barrier,
    /// Workers still running the current job.
    busy: AtomicUsize,
    done_lock: Mutex<()>,
    done: Condvar,
}

/// Worker threads plus the caller, running graphs together.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    cores: Vec<usize>,
}

/// Cores of the calling thread's affinity mask, in order.
pub fn allowed_cores() -> Vec<usize> {
    use nix::sched::{sched_getaffinity, CpuSet};
    use nix::unistd::Pid;
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect(),
        Err(_) => Vec::new(),
    }
}

/// Pins the calling thread to `core`; returns whether it worked.
pub fn pin_current_thread(core: usize) -> bool {
    use nix::sched::{sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(core).is_ok() && sched_setaffinity(Pid::from_raw(0), &set).is_ok()
}

/// Runs thread `ith`'s share of every node, with a barrier after each computing node.
///
/// # Safety
/// `bound` must point to a live `Bound<'_, N>` for the whole call.
unsafe fn run_share<const N: usize>(bound: *const (), step: Step, ith: usize, nth: usize, barrier: &Barrier) {
    // SAFETY: guaranteed by the caller (Pool::run blocks until every share has returned).
    let bound = unsafe { &*(bound as *const Bound<'_, N>) };
    for &id in bound.graph().order() {
        for phase in 0..bound.phases(id) {
            bound.compute(id, step, phase, ith, nth);
            barrier.wait();
        }
    }
}

impl Pool {
    /// A pool of `n_threads` threads in total: the caller and `n_threads - 1` workers. With `pin`,
    /// thread `i` is pinned to core `cores[i % cores.len()]` (the caller to `cores[0]`), where
    /// `cores` defaults to the process's affinity mask.
    pub fn new(n_threads: usize, cores: Option<&[usize]>, pin: bool) -> std::io::Result<Self> {
        let n = n_threads.max(1);
        let cores: Vec<usize> = cores.map(<[usize]>::to_vec).unwrap_or_else(allowed_cores);
        let shared = Arc::new(Shared {
            state: Mutex::new(State { round: 0, job: None, shutdown: false }),
            start: Condvar::new(),
            barrier: Barrier::new(n),
            busy: AtomicUsize::new(0),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
        });
        if pin && !cores.is_empty() {
            pin_current_thread(cores[0]);
        }
        let mut pool = Self { shared, workers: Vec::new(), cores };
        for ith in 1..n {
            let shared = Arc::clone(&pool.shared);
            let core = (pin && !pool.cores.is_empty()).then(|| pool.cores[ith % pool.cores.len()]);
            // On failure, dropping `pool` stops the workers already started.
            let handle = std::thread::Builder::new()
                .name(std::format!("pinfer-worker-{ith}"))
                .spawn(move || worker(shared, ith, core))?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Threads in the pool, the caller included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Cores threads are pinned to (the caller first).
    pub fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// Runs `bound` with every thread of the pool; returns when all are done.
    pub fn run<const N: usize>(&self, bound: &mut Bound<'_, N>, step: Step) -> Result<(), ExecError> {
        let nth = self.n_threads();
        if nth == 1 {
            return bound.run(step);
        }
        bound.begin();
        let job =
            Job { bound: bound as *const Bound<'_, N> as *const (), run_share: run_share::<N>, step, nth };
        self.shared.busy.store(self.workers.len(), Ordering::Release);
        {
            let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            state.round += 1;
            state.job = Some(job);
        }
        self.shared.start.notify_all();
        // SAFETY: `bound` outlives this call, and we wait below until every worker is done with it.
        unsafe { run_share::<N>(job.bound, step, 0, nth, &self.shared.barrier) };
        let mut guard = self.shared.done_lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.shared.busy.load(Ordering::Acquire) != 0 {
            guard = self.shared.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        drop(guard);
        bound.finish()
    }
}

fn worker(shared: Arc<Shared>, ith: usize, core: Option<usize>) {
    if let Some(core) = core {
        pin_current_thread(core);
    }
    let mut seen = 0u64;
    loop {
        let job = {
            let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            while state.round == seen && !state.shutdown {
                state = shared.start.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.shutdown {
                return;
            }
            seen = state.round;
            state.job
        };
        if let Some(job) = job {
            // SAFETY: Pool::run keeps the Bound alive until `busy` drops to zero below.
            unsafe { (job.run_share)(job.bound, job.step, ith, job.nth, &shared.barrier) };
        }
        if shared.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            drop(shared.done_lock.lock().unwrap_or_else(|e| e.into_inner()));
            shared.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).shutdown = true;
        self.shared.start.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
