//! Standard output and error: every write error is reported, none is silent or a panic.
//!
//! `outln!`/`out!` write to stdout and return a [`CliError`] to pass on with `?`: a closed pipe
//! (`| head -c1`) ends the program quietly with status 141, as coreutils do, and any other error
//! (`>/dev/full`) is an error naming the stream. `errln!`/`err!` write to stderr; a failure there
//! cannot be reported on stderr, so it is remembered and makes the exit status 1.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::CliError;

static STDERR_FAILED: AtomicBool = AtomicBool::new(false);

/// What a failed write to stdout means for the program.
pub(crate) fn stdout_error(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CliError::BrokenPipe
    } else {
        CliError::new(format!("writing to standard output: {e}"))
    }
}

/// Writes to stderr; a failure is remembered for the exit status.
pub(crate) fn write_stderr(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    if err.write_fmt(args).and_then(|()| err.flush()).is_err() {
        STDERR_FAILED.store(true, Ordering::Relaxed);
    }
}

/// Whether a write to stderr failed.
pub(crate) fn stderr_failed() -> bool {
    STDERR_FAILED.load(Ordering::Relaxed)
}

/// Flushes stdout at the end of the program (text without a final newline is still buffered).
pub(crate) fn flush_stdout() -> Result<(), CliError> {
    std::io::stdout().flush().map_err(stdout_error)
}

/// Writes a line to stdout: `outln!("{x}")?`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).map_err($crate::streams::stdout_error)
    }};
}

/// Writes to stdout and flushes (streamed text): `out!("{piece}")?`.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        write!(stdout, $($arg)*).and_then(|()| stdout.flush()).map_err($crate::streams::stdout_error)
    }};
}

/// Writes a line to stderr (a failure makes the exit status 1).
macro_rules! errln {
    () => { $crate::streams::write_stderr(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::streams::write_stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Writes to stderr without a newline.
macro_rules! err {
    ($($arg:tt)*) => { $crate::streams::write_stderr(format_args!($($arg)*)) };
}
