//! std: the calling thread and the OS: its affinity mask, pinning it to a core, its scheduling
//! policy. The pool, the NPU backend and the CLI's runtime use these; nothing else calls the OS
//! scheduler.

use std::vec::Vec;

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

/// Moves the calling thread to SCHED_IDLE: it then runs only when nothing else wants the core
/// (lowering a priority needs no privilege; best effort).
pub fn set_current_thread_idle() {
    use nix::libc;
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is the calling thread.
    let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
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
