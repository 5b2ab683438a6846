//! std: a pool of worker threads, created once, each pinned to one core of the process's
//! affinity mask, that run graphs together with the calling thread.
//!
//! Every thread runs every computing node on its share of the rows, then waits at a barrier.
//! Waits spin briefly and then sleep on a condition variable, so a pool under SCHED_FIFO never
//! livelocks: a sleeping waiter gives its core to the thread that still has work. A pool with more
//! threads than cores does not spin at all (its waiters sleep at once), so there are never more
//! spinning threads than cores.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::vec::Vec;

use super::work::converted_input;
use super::{Bound, ExecError, Step};
use crate::board::thread::{allowed_cores, set_current_thread_fifo, try_pin_current_thread};
use crate::graph::Op;
use crate::tensor::{Storage, TensorId, MAX_SRC};

/// Spins before a waiter goes to sleep (about a few microseconds on an A76).
const SPIN_ROUNDS: u32 = 4096;

/// Longest a waiter spins before it sleeps, whatever `spin_rounds` says: x86's `pause` takes
/// about 40 ns on Zen (4096 rounds would be 100-180 us of a core taken from whoever else needs
/// it, which a pool sharing a loaded machine pays at every barrier a descheduled thread misses).
/// 200 us, not less: a decode step's matmul phases take tens of microseconds and a thread that
/// finishes one early must still be awake for the next (50 us cost Q8_0 SmolLM2 decode on a
/// 2-core x86 about 6%: 140 vs 149 tokens/s, means of 4 interleaved `bench -n 128 -r 5` runs).
const SPIN_LIMIT: std::time::Duration = std::time::Duration::from_micros(200);

/// A reusable barrier that spins, then sleeps.
pub struct Barrier {
    n: usize,
    spin_rounds: u32,
    count: AtomicUsize,
    generation: AtomicUsize,
    /// Waiters asleep (or about to be) on `cv`: the last arriver only wakes them when there are
    /// some (a condition variable's notify is a system call even when no one waits).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Barrier {
    /// A barrier for `n` threads.
    pub fn new(n: usize) -> Self {
        Self::with_spin(n, SPIN_ROUNDS)
    }

    /// A barrier for `n` threads whose waiters spin `spin_rounds` times before sleeping (0: they
    /// sleep at once, for threads that share cores).
    pub fn with_spin(n: usize, spin_rounds: u32) -> Self {
        Self {
            n,
            spin_rounds,
            count: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Blocks until all `n` threads have called `wait` for this round.
    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            // SeqCst with the sleepers' SeqCst increment and load below: either this load sees a
            // sleeper, or that sleeper's load sees the new generation and does not sleep.
            self.generation.fetch_add(1, Ordering::SeqCst);
            if self.sleepers.load(Ordering::SeqCst) != 0 {
                // Taking the lock orders this wake-up after any sleeper's check of the generation.
                drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
                self.cv.notify_all();
            }
            return;
        }
        let mut since: Option<std::time::Instant> = None;
        for i in 0..self.spin_rounds {
            if self.generation.load(Ordering::Acquire) != generation {
                return;
            }
            core::hint::spin_loop();
            if i % 256 == 255 {
                let start = *since.get_or_insert_with(std::time::Instant::now);
                if start.elapsed() > SPIN_LIMIT {
                    break;
                }
            }
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while self.generation.load(Ordering::SeqCst) == generation {
            guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
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
    pinned: bool,
    spinning: bool,
}

/// How to set a pool up.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolConfig<'a> {
    /// Threads in total, the caller included.
    pub threads: usize,
    /// Cores to pin to (`None`: the calling thread's affinity mask).
    pub cores: Option<&'a [usize]>,
    /// Pin thread `i` to `cores[i % cores.len()]`.
    pub pin: bool,
    /// Run every thread of the pool, the caller included, SCHED_FIFO at this priority (1-99).
    pub rt_priority: Option<i32>,
}

/// Why a pool could not be set up.
#[derive(Debug)]
#[non_exhaustive]
pub enum PoolError {
    /// A thread could not be started.
    Spawn(std::io::Error),
    /// `sched_setaffinity` failed.
    Pin {
        /// The core.
        core: usize,
        /// What the OS said.
        errno: nix::errno::Errno,
    },
    /// `sched_setscheduler(SCHED_FIFO)` failed.
    Realtime {
        /// The priority asked for.
        priority: i32,
        /// What the OS said.
        errno: nix::errno::Errno,
    },
}

impl core::fmt::Display for PoolError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        use nix::errno::Errno;
        match self {
            Self::Spawn(e) => write!(f, "cannot start worker threads: {e}"),
            Self::Pin { core, errno } => {
                write!(f, "cannot pin a worker to core {core}: {}", errno.desc())
            }
            Self::Realtime { priority, errno: Errno::EPERM } => write!(
                f,
                "cannot run the workers SCHED_FIFO at priority {priority}: permission denied. Run as root, give \
                 the binary the capability (`sudo setcap cap_sys_nice+ep pinfer`), raise the real-time limit \
                 (`ulimit -r {priority}`, or LimitRTPRIO={priority} in a systemd unit), or leave out \
                 --rt-priority; in a container or cgroup the group also needs a real-time budget \
                 (cpu.rt_runtime_us)"
            ),
            Self::Realtime { priority, errno } => {
                write!(f, "cannot run the workers SCHED_FIFO at priority {priority}: {}", errno.desc())
            }
        }
    }
}

impl std::error::Error for PoolError {}

/// Runs thread `ith`'s share of every node: see [`run_scheduled`], or, when outputs are checked
/// for non-finite values or matmuls may be offloaded, [`run_every_node`].
///
/// # Safety
/// `bound` must point to a live `Bound<'_, N>` for the whole call.
unsafe fn run_share<const N: usize>(bound: *const (), step: Step, ith: usize, nth: usize, barrier: &Barrier) {
    // SAFETY: guaranteed by the caller (Pool::run blocks until every share has returned).
    let bound = unsafe { &*(bound as *const Bound<'_, N>) };
    if bound.checks_numerics() || bound.offload.is_some() {
        run_every_node(bound, step, ith, nth, barrier);
    } else {
        run_scheduled(bound, step, ith, nth, barrier);
    }
}

/// Output elements (or, for an input conversion, input elements), weighted by cost, up to which
/// a phase runs on thread 0 alone: splitting a decode step's norms, adds, ropes, cache writes and
/// input conversions saves well under a microsecond, a barrier costs about that when both threads
/// run, and far more when one has been descheduled.
const ALONE_ELEMENTS: usize = 16 * 1024;

/// A byte range `[start, end)` a phase reads or writes.
#[derive(Clone, Copy)]
struct Access {
    start: usize,
    end: usize,
    write: bool,
    /// Whether every thread ran the phase (else thread 0 alone).
    shared: bool,
}

/// Ranges one phase touches: its sources, the converted input, its output.
const PHASE_ACCESSES: usize = MAX_SRC + 2;
/// Ranges remembered since the last barrier (a phase that would overflow them waits).
const TRACKED: usize = 32;

/// What the phases run since the last barrier touched.
struct Hazards {
    list: [Access; TRACKED],
    n: usize,
}

impl Hazards {
    /// Whether a phase touching `acc` (run by every thread when `shared`) must wait at a barrier
    /// first: it writes what an earlier phase read or wrote, or reads what one wrote, and one of
    /// the two ran on other threads than 0 (thread 0 runs its phases in order).
    fn conflict(&self, acc: &[Access], shared: bool) -> bool {
        self.n + acc.len() > TRACKED
            || self.list[..self.n].iter().any(|e| {
                (shared || e.shared)
                    && acc.iter().any(|a| (a.write || e.write) && a.start < e.end && e.start < a.end)
            })
    }

    fn push(&mut self, acc: &[Access]) {
        for a in acc {
            self.list[self.n] = *a;
            self.n += 1;
        }
    }
}

/// Byte range of tensor `id`'s data (`None` for tensors without data or in read-only buffers).
fn span_of<const N: usize>(bound: &Bound<'_, N>, id: TensorId) -> Option<(usize, usize)> {
    let t = bound.graph().tensor(id);
    if matches!(t.storage, Storage::External { .. }) {
        return None;
    }
    let ptr = Some(bound.address(id)).filter(|p| !p.is_null())? as usize;
    Some((ptr, ptr + t.span_bytes()))
}

/// The ranges phase `phase` of node `id` reads and writes (the same on every thread).
fn phase_accesses<const N: usize>(
    bound: &Bound<'_, N>,
    id: TensorId,
    phase: usize,
    shared: bool,
    out: &mut [Access; PHASE_ACCESSES],
) -> usize {
    let t = bound.graph().tensor(id);
    let converting = bound.converts_input(id);
    let splitting = t.op == Op::FlashAttn && bound.phases(id) == 2;
    let converted = bound.converted as usize;
    let work = (converted, converted + bound.converted_len);
    let mut n = 0;
    let mut add = |r: Option<(usize, usize)>, write: bool| {
        if let Some((start, end)) = r.filter(|r| r.1 > r.0) {
            out[n] = Access { start, end, write, shared };
            n += 1;
        }
    };
    if converting && phase == 0 {
        // The input conversion: reads the F32 input, writes the shared work region.
        add(t.src[1].and_then(|x| span_of(bound, x)), false);
        add(Some(work), true);
    } else if splitting {
        // An attention that may split its keys: phase 0 reads the sources and writes the parts
        // (or, unsplit, the output), phase 1 merges the parts into the output.
        if phase == 0 {
            for s in t.src.iter().flatten() {
                add(span_of(bound, *s), false);
            }
        }
        add(Some(work), phase == 0);
        add(span_of(bound, id), true);
    } else {
        for s in t.src.iter().flatten() {
            add(span_of(bound, *s), false);
        }
        if converting {
            add(Some(work), false);
        }
        add(span_of(bound, id), true);
    }
    n
}

/// Whether phase `phase` of node `id` is small enough for thread 0 alone (see
/// [`ALONE_ELEMENTS`]). Matmuls and attention always run on every thread.
fn runs_alone<const N: usize>(bound: &Bound<'_, N>, id: TensorId, phase: usize, step: Step) -> bool {
    let g = bound.graph();
    let t = g.tensor(id);
    let elements =
        |id: Option<TensorId>| id.map_or(usize::MAX, |s| g.tensor(s).ne_for(step.n_kv).iter().product());
    // Elements, weighted by their cost relative to a norm's or an add's (a rope table takes a
    // sine or a cosine per element, the cache writes, copies and row gathers go element by element).
    let work = match t.op {
        Op::MulMat | Op::MulMatId if bound.converts_input(id) && phase == 0 => elements(t.src[1]),
        Op::MulMat | Op::MulMatId | Op::FlashAttn => return false,
        // The output is the whole cache; the work is the rows written.
        Op::KvWrite => elements(t.src[0]).saturating_mul(4),
        // A table element costs a sine or a cosine.
        Op::RopeTable => elements(Some(id)).saturating_mul(16),
        Op::GetRows | Op::Cpy | Op::Concat | Op::Pool2dAvg => elements(t.src[0]).saturating_mul(4),
        // An element costs about a norm's or an add's.
        Op::None
        | Op::View
        | Op::Add
        | Op::Mul
        | Op::Sub
        | Op::Div
        | Op::Scale
        | Op::Sqr
        | Op::Sqrt
        | Op::Sum
        | Op::Repeat
        | Op::RepeatBack
        | Op::Fill
        | Op::GetRowsBack
        | Op::RmsNormBack
        | Op::SoftMaxBack
        | Op::CrossEntropy
        | Op::CrossEntropyBack
        | Op::MulMatT
        | Op::Hadamard
        | Op::RmsNorm
        | Op::LayerNorm
        | Op::Rope
        | Op::SoftMax
        | Op::Silu
        | Op::Sigmoid
        | Op::Softplus
        | Op::Tanh
        | Op::Gelu
        | Op::SwiGlu
        | Op::GeGlu
        | Op::TopK
        | Op::MoeWeights
        | Op::MoeSum
        | Op::SeqMean
        | Op::ShortConv
        | Op::GatedDeltaNet => elements(Some(id)),
    };
    work <= ALONE_ELEMENTS
}

/// Whether matmul `n`'s input conversion would write exactly what matmul `m`'s wrote: the same
/// input tensor converted to the same type and layout (Q, K and V read one normed input, so do
/// the FFN gate and up).
fn same_conversion<const N: usize>(bound: &Bound<'_, N>, m: TensorId, n: TensorId) -> bool {
    let g = bound.graph();
    let (tm, tn) = (g.tensor(m), g.tensor(n));
    let (Some(wm), Some(wn)) = (tm.src[0], tn.src[0]) else { return false };
    let (wm, wn) = (g.tensor(wm), g.tensor(wn));
    matches!(tm.op, Op::MulMat | Op::MulMatId)
        && matches!(tn.op, Op::MulMat | Op::MulMatId)
        && tm.src[1].is_some()
        && tm.src[1] == tn.src[1]
        && converted_input(tm, wm) == converted_input(tn, wn)
        && bound.packed_for(tm, wm).is_some() == bound.packed_for(tn, wn).is_some()
}

/// Runs thread `ith`'s share of every node with as few barriers as the data allow:
/// - phases of at most [`ALONE_ELEMENTS`] run on thread 0 alone (the others go on);
/// - a phase waits at a barrier only when it touches bytes that a phase run since the last
///   barrier wrote (or writes bytes one read), one of the two having run on other threads than 0;
///   the planned addresses tell (activations share memory, so the check is on byte ranges);
/// - a matmul whose input conversion would repeat the previous one's (same input, type and
///   layout, nothing written over the input or the work region since) skips it.
///
/// Every thread computes the same schedule, so all meet at the same barriers. A decode step of
/// SmolLM2 meets 14 barriers per layer instead of 26.
fn run_scheduled<const N: usize>(
    bound: &Bound<'_, N>,
    step: Step,
    ith: usize,
    nth: usize,
    barrier: &Barrier,
) {
    let none = Access { start: 0, end: 0, write: false, shared: false };
    let mut hazards = Hazards { list: [none; TRACKED], n: 0 };
    let mut acc = [none; PHASE_ACCESSES];
    let (work0, work1) = (bound.converted as usize, bound.converted as usize + bound.converted_len);
    // The matmul whose converted input the work region holds, and the input's bytes.
    let mut converted: Option<(TensorId, (usize, usize))> = None;
    for &id in bound.graph().order() {
        let phases = bound.phases(id);
        for phase in 0..phases {
            let conversion = bound.converts_input(id) && phase == 0;
            if conversion && converted.is_some_and(|(m, _)| same_conversion(bound, m, id)) {
                continue;
            }
            if !bound.phase_works(id, phase, step) {
                continue;
            }
            let alone = runs_alone(bound, id, phase, step);
            let n = phase_accesses(bound, id, phase, !alone, &mut acc);
            if hazards.conflict(&acc[..n], !alone) {
                barrier.wait();
                hazards.n = 0;
            }
            if alone {
                if ith == 0 {
                    bound.compute(id, step, phase, 0, 1);
                }
            } else if bound.graph().tensor(id).op == Op::FlashAttn {
                // Causal rows cost more the later their token, and rows are split token-major:
                // each thread takes one early and one late share of twice as many.
                bound.compute(id, step, phase, ith, 2 * nth);
                bound.compute(id, step, phase, 2 * nth - 1 - ith, 2 * nth);
            } else {
                bound.compute(id, step, phase, ith, nth);
            }
            hazards.push(&acc[..n]);
            if conversion {
                let t = bound.graph().tensor(id);
                converted = t.src[1]
                    .and_then(|x| span_of(bound, x))
                    .filter(|_| matches!(t.op, Op::MulMat | Op::MulMatId))
                    .map(|r| (id, r));
            } else if let Some((_, (start, end))) = converted {
                // Anything written over the converted input, or over the work region holding
                // its conversion, makes the conversion stale.
                let over = |a: &Access| {
                    a.write && ((a.start < end && start < a.end) || (a.start < work1 && work0 < a.end))
                };
                if acc[..n].iter().any(over) {
                    converted = None;
                }
            }
        }
    }
}

/// Runs thread `ith`'s share of every node, with a barrier after each computing phase (and
/// after each check).
fn run_every_node<const N: usize>(
    bound: &Bound<'_, N>,
    step: Step,
    ith: usize,
    nth: usize,
    barrier: &Barrier,
) {
    let check = bound.checks_numerics();
    for &id in bound.graph().order() {
        let phases = bound.phases(id);
        for phase in 0..phases {
            bound.compute(id, step, phase, ith, nth);
            barrier.wait();
        }
        if check && phases > 0 {
            bound.check_node(id, step, ith, nth);
            barrier.wait();
            // Only checks write this flag, and the next one needs every thread past the next
            // barrier: all threads read the same value here and stop together.
            if bound.found_non_finite() {
                break;
            }
        }
    }
}

impl Pool {
    /// A pool of `n_threads` threads in total: the caller and `n_threads - 1` workers. With `pin`,
    /// thread `i` is pinned to core `cores[i % cores.len()]` (the caller to `cores[0]`), where
    /// `cores` defaults to the process's affinity mask.
    pub fn new(n_threads: usize, cores: Option<&[usize]>, pin: bool) -> std::io::Result<Self> {
        Self::with_config(&PoolConfig { threads: n_threads, cores, pin, rt_priority: None }).map_err(|e| {
            match e {
                PoolError::Spawn(e) => e,
                other => std::io::Error::other(std::format!("{other}")),
            }
        })
    }

    /// A pool as `config` says. Every worker pins itself (and sets its scheduling) before this
    /// returns, so a failure is reported here rather than lost in a thread. Waits spin only when
    /// no two threads share a core.
    pub fn with_config(config: &PoolConfig<'_>) -> Result<Self, PoolError> {
        let n = config.threads.max(1);
        let pin = config.pin;
        let cores: Vec<usize> = config.cores.map(<[usize]>::to_vec).unwrap_or_else(allowed_cores);
        // Distinct cores the threads run on: the assigned ones when pinned, else the mask.
        let available = if pin && !cores.is_empty() {
            let mut used: Vec<usize> = (0..n).map(|i| cores[i % cores.len()]).collect();
            used.sort_unstable();
            used.dedup();
            used.len()
        } else {
            allowed_cores().len().max(1)
        };
        let spinning = n <= available;
        let shared = Arc::new(Shared {
            state: Mutex::new(State { round: 0, job: None, shutdown: false }),
            start: Condvar::new(),
            barrier: Barrier::with_spin(n, if spinning { SPIN_ROUNDS } else { 0 }),
            busy: AtomicUsize::new(0),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
        });
        let rt_priority = config.rt_priority;
        let setup = move |core: Option<usize>| -> Result<(), PoolError> {
            if let Some(core) = core {
                try_pin_current_thread(core).map_err(|errno| PoolError::Pin { core, errno })?;
            }
            if let Some(priority) = rt_priority {
                set_current_thread_fifo(priority).map_err(|errno| PoolError::Realtime { priority, errno })?;
            }
            Ok(())
        };
        let pinned = pin && !cores.is_empty();
        setup(pinned.then(|| cores[0]))?;
        let mut pool = Self { shared, workers: Vec::new(), cores, pinned, spinning };
        let (tx, rx) = std::sync::mpsc::channel();
        for ith in 1..n {
            let shared = Arc::clone(&pool.shared);
            let core = pinned.then(|| pool.cores[ith % pool.cores.len()]);
            let tx = tx.clone();
            // On failure, dropping `pool` stops the workers already started.
            let handle = std::thread::Builder::new()
                .name(std::format!("pinfer-worker-{ith}"))
                .spawn(move || {
                    let _ = tx.send(setup(core));
                    drop(tx);
                    worker(shared, ith)
                })
                .map_err(PoolError::Spawn)?;
            pool.workers.push(handle);
        }
        drop(tx);
        for result in rx.iter().take(n - 1) {
            result?;
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

    /// The core of each thread, the caller first, when the pool pins them.
    pub fn thread_cores(&self) -> Option<Vec<usize>> {
        self.pinned.then(|| (0..self.n_threads()).map(|i| self.cores[i % self.cores.len()]).collect())
    }

    /// Whether barrier waits spin before sleeping (no two threads share a core).
    pub fn spinning(&self) -> bool {
        self.spinning
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

fn worker(shared: Arc<Shared>, ith: usize) {
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

impl crate::engine::Runner for Pool {
    fn run<const N: usize>(&self, bound: &mut Bound<'_, N>, step: Step) -> Result<(), ExecError> {
        Pool::run(self, bound, step)
    }
}
