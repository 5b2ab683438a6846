//! std: the board this process runs on, the cores its workers use, memory facts, and the board
//! facts a benchmark records, read from the device tree, sysfs and procfs.
//!
//! Every reader takes the filesystem root as a parameter (`/` in real use) so tests can feed a
//! fake sysfs; a file that is missing or unreadable is simply a fact that is not known.

use std::format;
use std::path::Path;
use std::string::{String, ToString};
use std::vec::Vec;

use super::{fast_cores, match_compatible, profile, profile_names, BoardProfile};

/// The board pinfer runs on: its profile, how it was chosen, and its core classes.
#[derive(Debug, Clone)]
pub struct Board {
    /// The profile.
    pub profile: BoardProfile<'static>,
    /// How the profile was chosen, for `-v` (`"auto: device tree xunlong,orangepi-5"`).
    pub how: String,
    /// Performance cores (empty: no distinction, every core counts as big).
    pub big: Vec<usize>,
    /// The other cores.
    pub little: Vec<usize>,
}

/// Picks the board: a profile name, or `"auto"` (the device tree's `compatible`, else the
/// generic profile of this architecture with cores classified by capacity). `root` is `/`.
pub fn resolve(name: &str, root: &Path) -> Result<Board, String> {
    let known = || profile_names().collect::<Vec<_>>().join(", ");
    let (profile, how) = if name == "auto" {
        let dt = ["proc/device-tree/compatible", "sys/firmware/devicetree/base/compatible"]
            .iter()
            .find_map(|p| std::fs::read(root.join(p)).ok());
        match dt.as_deref().and_then(match_compatible) {
            Some((p, hit)) => (p, format!("auto: device tree {hit}")),
            None => {
                let id = if std::env::consts::ARCH == "x86_64" { "x86_64-host" } else { "generic-aarch64" };
                let why = if dt.is_some() { "no profile matches the device tree" } else { "no device tree" };
                let p = profile(id).ok_or_else(|| format!("the {id} profile is not embedded"))?;
                (
                    p.map_err(|e| format!("boards/{id}.toml: {e}"))?,
                    format!("auto: {why}, {}", std::env::consts::ARCH),
                )
            }
        }
    } else {
        match profile(name) {
            Some(p) => (p.map_err(|e| format!("boards/{name}.toml: {e}"))?, format!("--board {name}")),
            None => return Err(format!("unknown board '{name}' (known: auto, {})", known())),
        }
    };
    let present = present_cores(root);
    let (big, how) = if profile.big_cores.is_empty() {
        let caps = core_capacities(root, &present);
        let fast: Vec<usize> = fast_cores(&caps).iter().map(|&c| usize::from(c)).collect();
        let how = if fast.is_empty() { how } else { format!("{how}; fast cores by capacity") };
        (fast, how)
    } else {
        (profile.big_cores.iter().map(|&c| usize::from(c)).collect(), how)
    };
    let little = if big.is_empty() {
        Vec::new()
    } else if profile.little_cores.is_empty() {
        present.iter().copied().filter(|c| !big.contains(c)).collect()
    } else {
        profile.little_cores.iter().map(|&c| usize::from(c)).collect()
    };
    Ok(Board { profile, how, big, little })
}

/// The cores the kernel reports present (`/sys/devices/system/cpu/present`), else none.
pub fn present_cores(root: &Path) -> Vec<usize> {
    read_string(&root.join("sys/devices/system/cpu/present"))
        .and_then(|s| super::parse_core_list(&s).ok())
        .map(|l| l.iter().map(|&c| usize::from(c)).collect())
        .unwrap_or_default()
}

/// Per-core `(core, capacity)`: `cpu_capacity`, else `cpufreq/cpuinfo_max_freq`; cores with
/// neither are left out.
pub fn core_capacities(root: &Path, cores: &[usize]) -> Vec<(u16, u64)> {
    let cpu = |c: usize, file: &str| read_u64(&root.join(format!("sys/devices/system/cpu/cpu{c}/{file}")));
    let by = |file: &str| -> Vec<(u16, u64)> {
        cores.iter().filter_map(|&c| Some((u16::try_from(c).ok()?, cpu(c, file)?))).collect()
    };
    let caps = by("cpu_capacity");
    if caps.len() == cores.len() && !caps.is_empty() {
        return caps;
    }
    by("cpufreq/cpuinfo_max_freq")
}

/// The worker cores, one worker per core, and what was adjusted along the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPlan {
    /// Cores, one worker each (the calling thread on the first).
    pub cores: Vec<usize>,
    /// Adjustments worth telling the user (printed on stderr).
    pub notes: Vec<String>,
}

/// Chooses the worker cores: `--cores` if given (each must be in `allowed`, the inherited
/// affinity mask), else the board's big cores in `allowed` (all of `allowed` when the board has
/// no core classes, the little ones when no big core is allowed), as many as the profile
/// recommends. `-t N` picks the first N, adding other allowed cores when N exceeds the big ones.
/// Never more workers than cores: N beyond the allowed cores is cut, with a note.
pub fn plan_workers(
    board: &Board,
    allowed: &[usize],
    cores: Option<&[usize]>,
    threads: Option<usize>,
) -> Result<WorkerPlan, String> {
    let mut notes = Vec::new();
    if threads == Some(0) {
        return Err("-t 0: at least one thread is needed".into());
    }
    if allowed.is_empty() {
        return Err("cannot read this process's CPU affinity mask (sched_getaffinity)".into());
    }
    if let Some(list) = cores {
        if let Some(&c) = list.iter().find(|c| !allowed.contains(c)) {
            return Err(format!(
                "--cores {}: core {c} is outside this process's affinity mask ({}); taskset, cgroups or \
                 systemd's CPUAffinity= allow only those",
                ranges(list),
                ranges(allowed)
            ));
        }
        let mut chosen = list.to_vec();
        if let Some(n) = threads {
            if n > chosen.len() {
                notes.push(format!(
                    "-t {n} with --cores {}: one worker per core, so {} workers",
                    ranges(list),
                    chosen.len()
                ));
            }
            chosen.truncate(n);
        }
        return Ok(WorkerPlan { cores: chosen, notes });
    }
    let mut preferred: Vec<usize> = if board.big.is_empty() {
        allowed.to_vec()
    } else {
        allowed.iter().copied().filter(|c| board.big.contains(c)).collect()
    };
    if preferred.is_empty() {
        notes.push(format!(
            "none of {}'s big cores ({}) is in the affinity mask ({}): running on those cores",
            board.profile.name,
            ranges(&board.big),
            ranges(allowed)
        ));
        preferred = allowed.to_vec();
    }
    let recommended = board.profile.recommended_threads as usize;
    let n = match threads {
        Some(n) => n,
        None if recommended > 0 => recommended.min(preferred.len()),
        None => preferred.len(),
    };
    let mut chosen: Vec<usize> = preferred.iter().copied().take(n).collect();
    if n > chosen.len() {
        let extra: Vec<usize> =
            allowed.iter().copied().filter(|c| !chosen.contains(c)).take(n - chosen.len()).collect();
        if !extra.is_empty() {
            notes.push(format!(
                "-t {n}: adding cores {} beyond the big ones ({}); a slow core holds every op back to its pace",
                ranges(&extra),
                ranges(&preferred)
            ));
        }
        // Big cores first: the calling thread runs on the first core.
        chosen.extend(extra);
    }
    if n > chosen.len() {
        notes.push(format!(
            "-t {n}: only {} cores allowed ({}); one worker per core, so {} workers",
            allowed.len(),
            ranges(allowed),
            chosen.len()
        ));
    }
    Ok(WorkerPlan { cores: chosen, notes })
}

/// `0,1,2`: a core list as the `workers:` line prints it.
pub fn list(cores: &[usize]) -> String {
    cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// `0-3,6`: a core list as taskset writes it.
pub fn ranges(cores: &[usize]) -> String {
    let mut sorted = cores.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}-{}", sorted[i], sorted[j]) } else { sorted[i].to_string() });
        i = j + 1;
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(",")
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available(root: &Path) -> Option<u64> {
    let text = read_string(&root.join("proc/meminfo"))?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The soft `RLIMIT_MEMLOCK` in bytes (`None`: unlimited or unknown).
pub fn memlock_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft != RLIM_INFINITY => Some(soft),
        _ => None,
    }
}

/// Locks `bytes` in RAM (`mlock`): they are faulted in now and never paged out.
pub fn lock(bytes: &[u8]) -> nix::Result<()> {
    let Some(ptr) = core::ptr::NonNull::new(bytes.as_ptr() as *mut core::ffi::c_void) else { return Ok(()) };
    if bytes.is_empty() {
        return Ok(());
    }
    // SAFETY: the range is memory this process owns for at least as long as the lock matters
    // (mlock does not write to it; the lock goes away with the mapping).
    unsafe { nix::sys::mman::mlock(ptr, bytes.len()) }
}

/// The message for a failed `mlock` of `total` bytes: what to change.
pub fn lock_error(total: usize, errno: nix::errno::Errno) -> String {
    let limit = match memlock_limit() {
        Some(b) => format!("{:.1} MiB", b as f64 / MIB),
        None => "unlimited".into(),
    };
    format!(
        "--mlock: cannot lock {:.1} MiB in RAM: {} (RLIMIT_MEMLOCK is {limit}). Raise the limit: `ulimit -l \
         unlimited` in the shell (as root), `LimitMEMLOCK=infinity` in the systemd unit, or a `memlock` line in \
         /etc/security/limits.conf; or run as root (CAP_IPC_LOCK); or leave out --mlock",
        total as f64 / MIB,
        errno.desc()
    )
}

const MIB: f64 = 1024.0 * 1024.0;

/// What a benchmark row should say about the machine, so published numbers can be compared.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Facts {
    /// The CPU frequency governor of the worker cores (`"performance"`; `"a/b"` if they differ).
    pub governor: Option<String>,
    /// Current frequency of each worker core in MHz, when readable.
    pub cpu_mhz: Vec<Option<u64>>,
    /// Highest frequency of the worker cores in MHz (`cpuinfo_max_freq`).
    pub cpu_max_mhz: Option<u64>,
    /// The DDR controller's (`/sys/class/devfreq/*dmc*`) current frequency in MHz.
    pub ddr_mhz: Option<u64>,
    /// Its governor (`"dmc_ondemand"`, `"performance"`).
    pub ddr_governor: Option<String>,
}

impl Facts {
    /// `1800-2400 MHz`, `2400 MHz` or `-`.
    pub fn cpu_freq_text(&self) -> String {
        let known: Vec<u64> = self.cpu_mhz.iter().flatten().copied().collect();
        match (known.iter().min(), known.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!("{lo} MHz"),
            (Some(lo), Some(hi)) => format!("{lo}-{hi} MHz"),
            _ => "-".into(),
        }
    }
}

/// Reads the facts for worker `cores`.
pub fn facts(root: &Path, cores: &[usize]) -> Facts {
    let cpu = |c: usize, file: &str| root.join(format!("sys/devices/system/cpu/cpu{c}/cpufreq/{file}"));
    let mut governors: Vec<String> =
        cores.iter().filter_map(|&c| read_string(&cpu(c, "scaling_governor"))).collect();
    governors.sort();
    governors.dedup();
    let cpu_mhz =
        cores.iter().map(|&c| read_u64(&cpu(c, "scaling_cur_freq")).map(|khz| khz / 1000)).collect();
    let cpu_max_mhz =
        cores.iter().filter_map(|&c| read_u64(&cpu(c, "cpuinfo_max_freq"))).max().map(|k| k / 1000);
    let dmc = std::fs::read_dir(root.join("sys/class/devfreq")).ok().and_then(|entries| {
        let mut dirs: Vec<_> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains("dmc"))
            .map(|e| e.path())
            .collect();
        dirs.sort();
        dirs.into_iter().next()
    });
    let (ddr_mhz, ddr_governor) = match dmc {
        Some(d) => (read_u64(&d.join("cur_freq")).map(|hz| hz / 1_000_000), read_string(&d.join("governor"))),
        None => (None, None),
    };
    Facts {
        governor: (!governors.is_empty()).then(|| governors.join("/")),
        cpu_mhz,
        cpu_max_mhz,
        ddr_mhz,
        ddr_governor,
    }
}

fn read_string(path: &Path) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

fn read_u64(path: &Path) -> Option<u64> {
    read_string(path)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::vec;

    /// A fake filesystem root with `files` (path, contents).
    fn fake_root(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("pinfer-board-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    fn rk3588_files() -> Vec<(String, String)> {
        let mut files = vec![
            ("proc/device-tree/compatible".to_string(), "xunlong,orangepi-5\0rockchip,rk3588s\0".to_string()),
            ("sys/devices/system/cpu/present".into(), "0-7\n".into()),
            ("sys/class/devfreq/dmc/cur_freq".into(), "2112000000\n".into()),
            ("sys/class/devfreq/dmc/governor".into(), "dmc_ondemand\n".into()),
            ("sys/class/devfreq/fb000000.gpu/cur_freq".into(), "300000000\n".into()),
        ];
        for c in 0..8 {
            let (cap, max) = if c < 4 { (414, 1_800_000) } else { (1024, 2_400_000) };
            let dir = format!("sys/devices/system/cpu/cpu{c}");
            files.push((format!("{dir}/cpu_capacity"), format!("{cap}\n")));
            files.push((format!("{dir}/cpufreq/cpuinfo_max_freq"), format!("{max}\n")));
            files.push((format!("{dir}/cpufreq/scaling_cur_freq"), format!("{max}\n")));
            files.push((format!("{dir}/cpufreq/scaling_governor"), "performance\n".into()));
        }
        files
    }

    fn root_of(tag: &str, files: &[(String, String)]) -> PathBuf {
        let refs: Vec<(&str, &str)> = files.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        fake_root(tag, &refs)
    }

    #[test]
    fn an_orange_pi_is_recognised_and_uses_its_big_cores() {
        let root = root_of("opi5", &rk3588_files());
        let board = resolve("auto", &root).unwrap();
        assert_eq!(board.profile.id, "orangepi-5");
        assert_eq!(board.how, "auto: device tree xunlong,orangepi-5");
        assert_eq!((board.big.as_slice(), board.little.as_slice()), (&[4, 5, 6, 7][..], &[0, 1, 2, 3][..]));
        let all: Vec<usize> = (0..8).collect();
        let plan = plan_workers(&board, &all, None, None).unwrap();
        assert_eq!((plan.cores.as_slice(), plan.notes.len()), (&[4, 5, 6, 7][..], 0));
        // taskset -c 4-5: exactly those.
        assert_eq!(plan_workers(&board, &[4, 5], None, None).unwrap().cores, [4, 5]);
        // taskset -c 0-3: no big core allowed, so the little ones, with a note.
        let little = plan_workers(&board, &[0, 1, 2, 3], None, None).unwrap();
        assert_eq!(little.cores, [0, 1, 2, 3]);
        assert!(little.notes[0].contains("big cores (4-7)"), "{:?}", little.notes);
        // -t 6 adds two little cores and says so; -t 12 stops at 8.
        let six = plan_workers(&board, &all, None, Some(6)).unwrap();
        assert_eq!(six.cores, [4, 5, 6, 7, 0, 1]);
        assert!(six.notes[0].contains("adding cores 0-1"), "{:?}", six.notes);
        let twelve = plan_workers(&board, &all, None, Some(12)).unwrap();
        assert_eq!(twelve.cores.len(), 8);
        assert!(twelve.notes.last().unwrap().contains("so 8 workers"), "{:?}", twelve.notes);
        // --cores inside the mask is taken as is; outside it is an error naming the mask.
        assert_eq!(plan_workers(&board, &all, Some(&[6, 7]), None).unwrap().cores, [6, 7]);
        let err = plan_workers(&board, &[4, 5], Some(&[6, 7]), None).unwrap_err();
        assert!(err.contains("core 6 is outside") && err.contains("(4-5)"), "{err}");
        assert!(plan_workers(&board, &all, None, Some(0)).is_err());

        let facts = facts(&root, &[4, 5, 6, 7]);
        assert_eq!(facts.governor.as_deref(), Some("performance"));
        assert_eq!(facts.cpu_freq_text(), "2400 MHz");
        assert_eq!((facts.cpu_max_mhz, facts.ddr_mhz), (Some(2400), Some(2112)));
        assert_eq!(facts.ddr_governor.as_deref(), Some("dmc_ondemand"));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn an_unknown_board_classifies_cores_by_capacity() {
        let mut files = rk3588_files();
        files[0].1 = "vendor,unknown\0".into();
        let root = root_of("unknown", &files);
        let board = resolve("auto", &root).unwrap();
        let generic = if std::env::consts::ARCH == "x86_64" { "x86_64-host" } else { "generic-aarch64" };
        assert_eq!(board.profile.id, generic);
        assert!(
            board.how.contains("no profile matches") && board.how.contains("by capacity"),
            "{}",
            board.how
        );
        assert_eq!((board.big.as_slice(), board.little.as_slice()), (&[4, 5, 6, 7][..], &[0, 1, 2, 3][..]));
        // Without cpu_capacity, cpuinfo_max_freq decides the same way.
        let files: Vec<_> = files.into_iter().filter(|(p, _)| !p.ends_with("cpu_capacity")).collect();
        let root2 = root_of("freq", &files);
        assert_eq!(resolve("auto", &root2).unwrap().big, [4, 5, 6, 7]);
        // A homogeneous machine: every allowed core.
        let root3 = fake_root("flat", &[("sys/devices/system/cpu/present", "0-1")]);
        let flat = resolve("auto", &root3).unwrap();
        assert!(flat.big.is_empty());
        assert_eq!(plan_workers(&flat, &[0, 1], None, None).unwrap().cores, [0, 1]);
        assert_eq!(plan_workers(&flat, &[1], None, None).unwrap().cores, [1]);
        let four = plan_workers(&flat, &[0, 1], None, Some(4)).unwrap();
        assert_eq!(four.cores, [0, 1]);
        assert!(four.notes[0].contains("only 2 cores allowed"), "{:?}", four.notes);
        assert!(facts(&root3, &[0, 1]) == Facts { cpu_mhz: vec![None, None], ..Facts::default() });
        for r in [root, root2, root3] {
            let _ = std::fs::remove_dir_all(r);
        }
    }

    #[test]
    fn named_boards_and_unknown_names() {
        let root = fake_root("named", &[]);
        let b = resolve("rock-5b", &root).unwrap();
        assert_eq!((b.profile.id, b.how.as_str(), b.big.len()), ("rock-5b", "--board rock-5b", 4));
        let err = resolve("pi5", &root).unwrap_err();
        assert!(err.contains("unknown board 'pi5'") && err.contains("orangepi-5-plus"), "{err}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn core_ranges_print_like_taskset() {
        assert_eq!(ranges(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(ranges(&[5]), "5");
        assert_eq!(ranges(&[]), "none");
        assert_eq!(list(&[4, 5]), "4,5");
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let root = fake_root("mem", &[("proc/meminfo", "MemTotal: 100 kB\nMemAvailable:    2048 kB\n")]);
        assert_eq!(mem_available(&root), Some(2048 * 1024));
        let _ = std::fs::remove_dir_all(root);
    }
}
