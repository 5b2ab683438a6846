//! `pinfer doctor`: what matters on a board before a first run, each with the exact fix when it is
//! missing: glibc, kernel, board profile, big cores and their clocks, memory, the NPU runtime and
//! driver, and whether SCHED_FIFO and mlock are permitted.

use std::path::{Path, PathBuf};

use clap::Args;
use pinfer::board::runtime::{facts, mem_available, memlock_limit, ranges, resolve};

use crate::CliError;

/// Options of `pinfer doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Board profile to check against (see `pinfer boards`), or auto.
    #[arg(long, default_value = "auto")]
    pub board: String,
    /// Read /proc and /sys under this directory instead of / (tests).
    #[arg(long, default_value = "/", hide = true)]
    pub sysroot: PathBuf,
}

/// One line of the report: what was found, and the fix when something is missing.
struct Check {
    name: &'static str,
    found: String,
    fix: Option<String>,
}

fn ok(name: &'static str, found: String) -> Check {
    Check { name, found, fix: None }
}

fn fix(name: &'static str, found: String, how: String) -> Check {
    Check { name, found, fix: Some(how) }
}

fn read(root: &Path, rel: &str) -> Option<String> {
    let s = std::fs::read_to_string(root.join(rel)).ok()?;
    let s = s.trim().trim_end_matches('\0');
    (!s.is_empty()).then(|| s.to_string())
}

fn meminfo_kib(root: &Path, key: &str) -> Option<u64> {
    let text = read(root, "proc/meminfo")?;
    text.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

/// The C library's version (glibc), if it is glibc.
fn glibc_version() -> Option<String> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: gnu_get_libc_version returns a pointer to a static NUL-terminated string.
        let v = unsafe { std::ffi::CStr::from_ptr(nix::libc::gnu_get_libc_version()) };
        Some(v.to_string_lossy().into_owned())
    }
    #[cfg(not(target_env = "gnu"))]
    {
        None
    }
}

/// Whether this process may make a thread SCHED_FIFO (tried on a short-lived thread).
fn fifo_permitted() -> Result<(), String> {
    std::thread::spawn(|| pinfer::board::thread::set_current_thread_fifo(1).map_err(|e| e.desc().to_string()))
        .join()
        .unwrap_or_else(|_| Err("the probe thread failed".into()))
}

/// The NPU runtime library: where it was found, or why not.
fn npu_runtime(has_npu: bool) -> Check {
    const NAME: &str = "NPU runtime";
    if !has_npu {
        return ok(NAME, "not applicable (this board has no NPU)".into());
    }
    #[cfg(feature = "npu")]
    {
        match rknn_sys::Runtime::load() {
            Ok(rt) => {
                let path = rt.path().display().to_string();
                // The version is in the library's strings ("librknnrt version: 2.3.0 (...)").
                let version = std::fs::read(rt.path()).ok().and_then(|b| {
                    let key = b"librknnrt version: ";
                    let at = b.windows(key.len()).position(|w| w == key)? + key.len();
                    let end = b[at..].iter().position(|&c| c == 0 || c == b'\n')?;
                    Some(String::from_utf8_lossy(&b[at..at + end.min(64)]).into_owned())
                });
                ok(NAME, format!("{path}{}", version.map_or(String::new(), |v| format!(", version {v}"))))
            }
            Err(e) => fix(
                NAME,
                format!("not loaded: {e}"),
                "install Rockchip's librknnrt.so (rknn-toolkit2's runtime, aarch64) into /usr/lib, or set \
                 PINFER_RKNNRT=/path/to/librknnrt.so; without it pinfer runs on the CPU only"
                    .into(),
            ),
        }
    }
    #[cfg(not(feature = "npu"))]
    {
        ok(
            NAME,
            "not used: this pinfer was built without the npu feature (./x build-arm and ./x dist have it)"
                .into(),
        )
    }
}

/// The NPU kernel driver's version.
fn npu_driver(root: &Path, has_npu: bool) -> Check {
    const NAME: &str = "NPU driver";
    if let Some(v) = read(root, "sys/kernel/debug/rknpu/version") {
        return ok(NAME, v);
    }
    let devfreq = std::fs::read_dir(root.join("sys/class/devfreq")).ok().and_then(|d| {
        d.filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.contains("npu"))
    });
    match (devfreq, has_npu) {
        (Some(dev), _) => ok(
            NAME,
            format!(
                "present (devfreq {dev}); its version is in /sys/kernel/debug/rknpu/version, readable as root \
                 with debugfs mounted"
            ),
        ),
        (None, true) => fix(
            NAME,
            "not found (no /sys/kernel/debug/rknpu, no NPU devfreq node)".into(),
            "use the board vendor's kernel (Rockchip BSP 5.10/6.1, which has the rknpu driver) and check \
             `dmesg | grep -i rknpu`"
                .into(),
        ),
        (None, false) => ok(NAME, "not applicable (this board has no NPU)".into()),
    }
}

/// Runs every check and prints the report.
pub fn run(args: DoctorArgs) -> Result<(), CliError> {
    let root = args.sysroot.as_path();
    let mut checks = Vec::new();

    checks.push(match glibc_version() {
        Some(v) => ok("glibc", v),
        None => ok("glibc", "not glibc (a static or musl build)".into()),
    });
    checks.push(match read(root, "proc/sys/kernel/osrelease") {
        Some(r) => ok("kernel", format!("Linux {r}")),
        None => ok("kernel", "unknown (no /proc/sys/kernel/osrelease)".into()),
    });

    let board = resolve(&args.board, root).map_err(CliError::new)?;
    let p = &board.profile;
    let generic = p.id.starts_with("generic") || p.id.ends_with("-host");
    checks.push(if generic && cfg!(target_arch = "aarch64") {
        fix(
            "board",
            format!("{} ({})", p.name, board.how),
            "no board profile matched: pass --board NAME (see `pinfer boards`) so pinfer takes the big cores"
                .into(),
        )
    } else {
        ok("board", format!("{} ({})", p.name, board.how))
    });

    let cores =
        if board.big.is_empty() { pinfer::board::runtime::present_cores(root) } else { board.big.clone() };
    let f = facts(root, &cores);
    let clocks = format!(
        "cores {} ({}), governor {}, now {}, max {}",
        ranges(&cores),
        if board.big.is_empty() { "all" } else { "big" },
        f.governor.as_deref().unwrap_or("-"),
        f.cpu_freq_text(),
        f.cpu_max_mhz.map_or("-".into(), |m| format!("{m} MHz"))
    );
    checks.push(match f.governor.as_deref() {
        Some("performance") | None => ok("big cores", clocks),
        Some(_) => fix(
            "big cores",
            clocks,
            "for steady speed: echo performance | sudo tee /sys/devices/system/cpu/cpufreq/policy*/scaling_governor"
                .into(),
        ),
    });
    if let Some(g) = &f.ddr_governor {
        let found = format!("governor {g}, now {}", f.ddr_mhz.map_or("-".into(), |m| format!("{m} MHz")));
        checks.push(if g == "performance" {
            ok("DDR clock", found)
        } else {
            fix(
                "DDR clock",
                found,
                "decode is bound by memory: echo performance | sudo tee /sys/class/devfreq/dmc/governor (up to 2x)"
                    .into(),
            )
        });
    }

    let mib = |kib: u64| kib / 1024;
    checks.push(match (meminfo_kib(root, "MemTotal:"), mem_available(root)) {
        (Some(total), Some(avail)) => {
            let found = format!("{} MiB, {} MiB available", mib(total), avail >> 20);
            if avail < 1 << 30 {
                fix(
                    "memory",
                    found,
                    "under 1 GiB free: stop other services, or pick a smaller model or quant".into(),
                )
            } else {
                ok("memory", found)
            }
        }
        _ => ok("memory", "unknown (no /proc/meminfo)".into()),
    });

    checks.push(npu_runtime(p.npu_cores > 0));
    checks.push(npu_driver(root, p.npu_cores > 0));

    checks.push(match fifo_permitted() {
        Ok(()) => ok("SCHED_FIFO", "permitted (--rt-priority works)".into()),
        Err(e) => fix(
            "SCHED_FIFO",
            format!("not permitted ({e})"),
            "run with sudo (sudo chrt -f 90 taskset -c 4-7 ./pinfer ...), or `sudo setcap cap_sys_nice+ep pinfer`, \
             or LimitRTPRIO=90 in a systemd unit"
                .into(),
        ),
    });
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root_user = unsafe { nix::libc::geteuid() } == 0;
    checks.push(match memlock_limit() {
        None => ok("mlock", "permitted (no locked-memory limit; --mlock works)".into()),
        Some(_) if root_user => ok("mlock", "permitted (root)".into()),
        Some(limit) => fix(
            "mlock",
            format!("limited to {} KiB (--mlock of a model fails)", limit / 1024),
            "ulimit -l unlimited (in /etc/security/limits.conf: `USER - memlock unlimited`), or \
             LimitMEMLOCK=infinity in a systemd unit, or run as root"
                .into(),
        ),
    });

    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in &checks {
        outln!("{} {:<width$}  {}", if c.fix.is_some() { "FIX" } else { " ok" }, c.name, c.found)?;
        if let Some(how) = &c.fix {
            outln!("    {:<width$}  -> {how}", "")?;
        }
    }
    let n = checks.iter().filter(|c| c.fix.is_some()).count();
    outln!()?;
    if n == 0 {
        outln!("everything pinfer needs is in place")?;
    } else {
        outln!(
            "{n} thing{} to fix (pinfer still runs; each costs speed or a feature)",
            if n == 1 { "" } else { "s" }
        )?;
    }
    Ok(())
}
