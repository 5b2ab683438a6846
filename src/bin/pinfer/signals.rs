//! SIGINT, SIGTERM, SIGHUP and SIGPIPE.
//!
//! SIGPIPE is ignored, so a write to a closed pipe returns an error that ends the program quietly
//! with status 141 (`streams`), after temporary files are removed and the timing lines written.
//!
//! SIGINT (Ctrl-C) exits at once with status 130, unless a command that can stop cleanly has said
//! it polls ([`Polled`]): then the first SIGINT only sets a flag the command checks between tokens
//! or tensors (generation stops after the current token and prints its timings; a writer removes
//! its temporary file; chat abandons the reply and returns to the prompt), and a second one before
//! the command took the first exits at once. Every exit from a handler first removes the temporary
//! files of writers in progress (`pinfer::output_file::remove_pending_temporaries`).

use std::sync::atomic::{AtomicBool, Ordering};

use nix::libc;

use crate::CliError;

/// Set by the first SIGINT while a command polls.
pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Whether the running command polls [`INTERRUPTED`].
static POLLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    // Only async-signal-safe work here: atomics, unlink and _exit.
    if SERVING.load(Ordering::SeqCst) && !TERMINATE.swap(true, Ordering::SeqCst) {
        return;
    }
    if POLLED.load(Ordering::SeqCst) && !INTERRUPTED.swap(true, Ordering::SeqCst) {
        return;
    }
    exit_now(130);
}

/// Set by the first SIGTERM or SIGINT in serve mode: the server stops accepting requests,
/// finishes (or after a grace period cancels) the running ones and exits 0.
static TERMINATE: AtomicBool = AtomicBool::new(false);
/// Whether the server runs ([`serve_mode`]).
static SERVING: AtomicBool = AtomicBool::new(false);

/// SIGTERM and SIGHUP (a closed SSH session) end the process at once, as by default, but
/// without leaving a writer's temporary file behind; a server stops gracefully on the first one.
extern "C" fn on_terminate(signal: libc::c_int) {
    if SERVING.load(Ordering::SeqCst) && signal != libc::SIGHUP && !TERMINATE.swap(true, Ordering::SeqCst) {
        return;
    }
    exit_now(128 + signal);
}

/// Removes the temporary files being written and exits with `status`, running no destructors.
fn exit_now(status: libc::c_int) {
    pinfer::output_file::remove_pending_temporaries();
    // SAFETY: _exit is async-signal-safe and ends the process without running any other code.
    unsafe { libc::_exit(status) }
}

/// Installs the handlers; call once, before any thread starts.
pub(crate) fn install() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let int = SigAction::new(SigHandler::Handler(on_sigint), SaFlags::SA_RESTART, SigSet::empty());
    let term = SigAction::new(SigHandler::Handler(on_terminate), SaFlags::empty(), SigSet::empty());
    let ignore = SigAction::new(SigHandler::SigIgn, SaFlags::empty(), SigSet::empty());
    // SAFETY: the handlers do only async-signal-safe work; ignoring SIGPIPE runs no code. Errors
    // (impossible for these signals) leave the default actions.
    unsafe {
        let _ = sigaction(Signal::SIGINT, &int);
        let _ = sigaction(Signal::SIGTERM, &term);
        let _ = sigaction(Signal::SIGHUP, &term);
        let _ = sigaction(Signal::SIGPIPE, &ignore);
    }
}

/// While alive, the first SIGINT sets [`INTERRUPTED`] instead of exiting.
pub(crate) struct Polled(());

impl Polled {
    pub(crate) fn start() -> Self {
        INTERRUPTED.store(false, Ordering::SeqCst);
        POLLED.store(true, Ordering::SeqCst);
        Self(())
    }
}

impl Drop for Polled {
    fn drop(&mut self) {
        POLLED.store(false, Ordering::SeqCst);
    }
}

/// Whether a SIGINT came; clears it (the next one is again a first one).
pub(crate) fn take_interrupt() -> bool {
    INTERRUPTED.swap(false, Ordering::SeqCst)
}

/// `Err(Interrupted)` if a SIGINT came (for loops that stop by returning).
pub(crate) fn check_interrupt() -> Result<(), CliError> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(CliError::Interrupted)
    } else {
        Ok(())
    }
}

/// From now on the first SIGTERM or SIGINT asks the server to stop ([`terminate_requested`]); a
/// second one exits at once.
pub(crate) fn serve_mode() {
    SERVING.store(true, Ordering::SeqCst);
}

/// Whether a SIGTERM or SIGINT asked the server to stop.
pub(crate) fn terminate_requested() -> bool {
    TERMINATE.load(Ordering::SeqCst)
}
