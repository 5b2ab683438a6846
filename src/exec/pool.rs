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

use super::{Bound, ExecError, Step};

/// Spins before a waiter goes to sleep (about a few microseconds on an A76).
const SPIN_ROUNDS: u32 = 4096;

/// A reusable barrier that spins, then sleeps.
pub struct Barrier {
    n: usize,
    spin_rounds: u32,
    count: AtomicUsize,
    generation: AtomicUsize,
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
        for _ in 0..self.spin_rounds {
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
    try_pin_current_thread(core).is_ok()
}

/// Pins the calling thread to `core`.
pub fn try_pin_current_thread(core: usize) -> nix::Result<()> {
    use nix::sched::{sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(core)?;
    sched_setaffinity(Pid::from_raw(0), &set)
}

/// Makes the calling thread SCHED_FIFO at `priority` (1-99). nix has no wrapper for
/// `sched_setscheduler`, so this calls it through nix's libc.
pub fn set_current_thread_fifo(priority: i32) -> nix::Result<()> {
    use nix::libc;
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    nix::errno::Errno::result(rc).map(drop)
}

/// The calling thread's scheduling policy and priority: `("SCHED_FIFO", 10)`, `("SCHED_OTHER", 0)`.
pub fn current_thread_scheduler() -> (&'static str, i32) {
    use nix::libc;
    // SAFETY: plain queries of the calling thread (pid 0) into a local sched_param.
    let (policy, priority) = unsafe {
        let mut param = libc::sched_param { sched_priority: 0 };
        let policy = libc::sched_getscheduler(0);
        libc::sched_getparam(0, &mut param);
        (policy, param.sched_priority)
    };
    let name = match policy {
        libc::SCHED_FIFO => "SCHED_FIFO",
        libc::SCHED_RR => "SCHED_RR",
        libc::SCHED_OTHER => "SCHED_OTHER",
        libc::SCHED_BATCH => "SCHED_BATCH",
        libc::SCHED_IDLE => "SCHED_IDLE",
        _ => "unknown",
    };
    (name, priority)
}

/// Runs thread `ith`'s share of every node, with a barrier after each computing node.
///
/// # Safety
/// `bound` must point to a live `Bound<'_, N>` for the whole call.
unsafe fn run_share<const N: usize>(bound: *const (), step: Step, ith: usize, nth: usize, barrier: &Barrier) {
    // SAFETY: guaranteed by the caller (Pool::run blocks until every share has returned).
    let bound = unsafe { &*(bound as *const Bound<'_, N>) };
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
