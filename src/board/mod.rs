//! Board profiles: data embedded from `boards/*.toml` at build time, parsed with a small TOML
//! subset parser ([`toml`]), and the pure parts of board detection and core selection.
//!
//! Everything here is `no_std` and allocation-free, so every build carries its profiles. The std
//! layer ([`runtime`]) reads the device tree and sysfs, picks the worker cores and applies
//! affinity, real-time scheduling and memory locking.

pub mod toml;

#[cfg(feature = "std")]
pub mod runtime;
#[cfg(feature = "std")]
pub mod thread;

use core::fmt;

use crate::build_config::BOARD_PROFILES;
use toml::{Scalar, Value};

/// Most cores a profile or a core list names.
pub const MAX_CORES: usize = 64;
/// Most `compatible` strings or NPU matmul types in a profile.
pub const MAX_STRINGS: usize = 8;

/// Logical CPU ids, ascending and without duplicates.
pub type CoreList = heapless::Vec<u16, MAX_CORES>;

/// One board's facts, as written in its `boards/*.toml` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoardProfile<'a> {
    /// File stem, the name `--board` takes (`"orangepi-5"`).
    pub id: &'a str,
    /// Human name (`"Orange Pi 5"`).
    pub name: &'a str,
    /// The SoC (`"RK3588S"`), or `"-"` for generic profiles.
    pub soc: &'a str,
    /// Device-tree `compatible` strings that identify the board (most specific first).
    pub compatible: heapless::Vec<&'a str, MAX_STRINGS>,
    /// Performance cores (empty: classify from sysfs, or all cores).
    pub big_cores: CoreList,
    /// Efficiency cores.
    pub little_cores: CoreList,
    /// NPU cores usable for matmul offload (0: none).
    pub npu_cores: u32,
    /// Matmul types the NPU runtime accepts (`"fp16"`, `"int8"`, `"int4"`).
    pub npu_matmul_types: heapless::Vec<&'a str, MAX_STRINGS>,
    /// Default worker count (0: as many as the chosen cores).
    pub recommended_threads: u32,
    /// What the RAM tiers mean for model choice.
    pub ram_notes: &'a str,
}

/// Why a profile file does not load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileError {
    /// 1-based line (0: the whole file).
    pub line: usize,
    /// What is wrong.
    pub problem: &'static str,
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "line {}: {}", self.line, self.problem)
        }
    }
}

impl core::error::Error for ProfileError {}

impl From<toml::TomlError> for ProfileError {
    fn from(e: toml::TomlError) -> Self {
        Self { line: e.line, problem: e.problem }
    }
}

/// The keys a profile has (all required but `soc`).
const KEYS: [&str; 9] = [
    "name",
    "soc",
    "compatible",
    "big_cores",
    "little_cores",
    "npu_cores",
    "npu_matmul_types",
    "recommended_threads",
    "ram_notes",
];

/// Parses profile `text` (the file `boards/{id}.toml`).
pub fn parse_profile<'a>(id: &'a str, text: &'a str) -> Result<BoardProfile<'a>, ProfileError> {
    let mut p = BoardProfile {
        id,
        name: "",
        soc: "-",
        compatible: heapless::Vec::new(),
        big_cores: CoreList::new(),
        little_cores: CoreList::new(),
        npu_cores: 0,
        npu_matmul_types: heapless::Vec::new(),
        recommended_threads: 0,
        ram_notes: "",
    };
    let mut seen = [false; KEYS.len()];
    for entry in toml::entries(text) {
        let e = entry?;
        let err = |problem| ProfileError { line: e.line, problem };
        let k = KEYS.iter().position(|&k| k == e.key).ok_or(err("unknown key"))?;
        if core::mem::replace(&mut seen[k], true) {
            return Err(err("key given twice"));
        }
        let str_of = |v: Value<'a>| match v {
            Value::Scalar(Scalar::Str(s)) => Ok(s),
            _ => Err(err("expected a string")),
        };
        let int_of = |v: Value<'a>| match v {
            Value::Scalar(Scalar::Int(n)) => u32::try_from(n).map_err(|_| err("integer too large")),
            _ => Err(err("expected an integer")),
        };
        let strings = |v: Value<'a>| -> Result<heapless::Vec<&'a str, MAX_STRINGS>, ProfileError> {
            let Value::Array(a) = v else { return Err(err("expected an array of strings")) };
            let mut out = heapless::Vec::new();
            for item in a.iter() {
                let Scalar::Str(s) = item else { return Err(err("expected an array of strings")) };
                if s.is_empty() || out.contains(&s) {
                    return Err(err("empty or repeated string"));
                }
                out.push(s).map_err(|_| err("too many strings (at most 8)"))?;
            }
            Ok(out)
        };
        let cores = |v: Value<'a>| -> Result<CoreList, ProfileError> {
            let Value::Array(a) = v else { return Err(err("expected an array of core ids")) };
            let mut out = CoreList::new();
            for item in a.iter() {
                let Scalar::Int(c) = item else { return Err(err("expected an array of core ids")) };
                let c = u16::try_from(c).map_err(|_| err("core id too large"))?;
                if out.last().is_some_and(|&last| c <= last) {
                    return Err(err("core ids must be ascending without repeats"));
                }
                out.push(c).map_err(|_| err("too many cores (at most 64)"))?;
            }
            Ok(out)
        };
        match e.key {
            "name" => p.name = str_of(e.value)?,
            "soc" => p.soc = str_of(e.value)?,
            "compatible" => p.compatible = strings(e.value)?,
            "big_cores" => p.big_cores = cores(e.value)?,
            "little_cores" => p.little_cores = cores(e.value)?,
            "npu_cores" => p.npu_cores = int_of(e.value)?,
            "npu_matmul_types" => p.npu_matmul_types = strings(e.value)?,
            "recommended_threads" => p.recommended_threads = int_of(e.value)?,
            _ => p.ram_notes = str_of(e.value)?,
        }
    }
    for (k, key) in KEYS.iter().enumerate() {
        if !seen[k] && *key != "soc" {
            return Err(ProfileError { line: 0, problem: missing(key) });
        }
    }
    if p.name.is_empty() {
        return Err(ProfileError { line: 0, problem: "name is empty" });
    }
    if p.big_cores.iter().any(|c| p.little_cores.contains(c)) {
        return Err(ProfileError { line: 0, problem: "a core is listed as both big and little" });
    }
    if p.npu_cores == 0 && !p.npu_matmul_types.is_empty() {
        return Err(ProfileError {
            line: 0,
            problem: "npu_matmul_types given for a board without NPU cores",
        });
    }
    Ok(p)
}

fn missing(key: &str) -> &'static str {
    match key {
        "name" => "missing key: name",
        "compatible" => "missing key: compatible",
        "big_cores" => "missing key: big_cores",
        "little_cores" => "missing key: little_cores",
        "npu_cores" => "missing key: npu_cores",
        "npu_matmul_types" => "missing key: npu_matmul_types",
        "recommended_threads" => "missing key: recommended_threads",
        _ => "missing key: ram_notes",
    }
}

/// The embedded profile file named `name` (file stem, e.g. `"generic-rk3588"`), if there is one.
pub fn profile_text(name: &str) -> Option<&'static str> {
    BOARD_PROFILES.iter().find(|(stem, _)| *stem == name).map(|(_, text)| *text)
}

/// Names of all embedded profiles, sorted.
pub fn profile_names() -> impl Iterator<Item = &'static str> {
    BOARD_PROFILES.iter().map(|(stem, _)| *stem)
}

/// Every embedded profile, parsed (the test suite checks they all parse).
pub fn profiles() -> impl Iterator<Item = Result<BoardProfile<'static>, ProfileError>> {
    BOARD_PROFILES.iter().map(|(stem, text)| parse_profile(stem, text))
}

/// The embedded profile `id`, parsed; `None` if there is no such file.
pub fn profile(id: &str) -> Option<Result<BoardProfile<'static>, ProfileError>> {
    BOARD_PROFILES.iter().find(|(stem, _)| *stem == id).map(|(stem, text)| parse_profile(stem, text))
}

/// The profile matching a device tree's root `compatible` property (NUL-separated strings, most
/// specific first, as in `/proc/device-tree/compatible`): the first string some profile lists
/// decides, so a board profile wins over its SoC's generic one. Also returns the string.
pub fn match_compatible(dt: &[u8]) -> Option<(BoardProfile<'static>, &str)> {
    for entry in dt.split(|&b| b == 0) {
        let Ok(entry) = core::str::from_utf8(entry) else { continue };
        if entry.is_empty() {
            continue;
        }
        if let Some(p) = profiles().filter_map(Result::ok).find(|p| p.compatible.contains(&entry)) {
            return Some((p, entry));
        }
    }
    None
}

/// The fastest cores from per-core capacities (`cpu_capacity` or `cpuinfo_max_freq`), as
/// `(core, value)`: those within 10% of the maximum (RK3588's A76 clusters differ by a few percent,
/// its A55s by more than half). Empty when every core is within that band (a homogeneous CPU).
pub fn fast_cores(capacities: &[(u16, u64)]) -> CoreList {
    let mut out = CoreList::new();
    let Some(max) = capacities.iter().map(|&(_, v)| v).max() else { return out };
    let fast = |v: u64| u128::from(v) * 10 >= u128::from(max) * 9;
    if capacities.iter().all(|&(_, v)| fast(v)) {
        return out;
    }
    let mut cores: heapless::Vec<u16, MAX_CORES> =
        capacities.iter().filter(|&&(_, v)| fast(v)).map(|&(c, _)| c).take(MAX_CORES).collect();
    cores.sort_unstable();
    for c in cores {
        if out.last() != Some(&c) {
            let _ = out.push(c);
        }
    }
    out
}

/// Parses a core list as `taskset -c` takes it: `"4-7"`, `"0,2,4-5"`. Sorted, without repeats.
pub fn parse_core_list(text: &str) -> Result<CoreList, &'static str> {
    let mut out = CoreList::new();
    let text = text.trim();
    if text.is_empty() {
        return Err("empty core list");
    }
    for part in text.split(',') {
        let part = part.trim();
        let num = |s: &str| s.trim().parse::<u16>().map_err(|_| "expected core ids like 4-7 or 0,2,4-5");
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if lo > hi {
            return Err("a core range runs backwards");
        }
        for c in lo..=hi {
            if out.contains(&c) {
                return Err("a core is listed twice");
            }
            out.push(c).map_err(|_| "too many cores (at most 64)")?;
        }
    }
    out.sort_unstable();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generic_profiles_are_embedded_and_sorted() {
        let text = profile_text("generic-rk3588").expect("boards/generic-rk3588.toml is embedded");
        assert!(text.contains("big_cores = [4, 5, 6, 7]"));
        assert!(profile_text("generic-aarch64").is_some());
        assert!(profile_text("no-such-board").is_none());
        let names: heapless::Vec<&str, 64> = profile_names().collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "profiles sorted by name: {names:?}");
    }

    #[test]
    fn every_embedded_profile_parses_and_compatibles_are_unambiguous() {
        let mut n = 0;
        let mut all: heapless::Vec<&str, 128> = heapless::Vec::new();
        for p in profiles() {
            let p = p.unwrap_or_else(|e| panic!("a board profile does not parse: {e}"));
            for c in &p.compatible {
                assert!(!all.contains(c), "{}: compatible {c:?} is listed by two profiles", p.id);
                all.push(c).unwrap();
            }
            if p.npu_cores > 0 {
                assert!(!p.npu_matmul_types.is_empty(), "{}", p.id);
            }
            n += 1;
        }
        for id in [
            "orangepi-5",
            "orangepi-5b",
            "orangepi-5-plus",
            "orangepi-5-pro",
            "orangepi-5-max",
            "orangepi-5-ultra",
            "rock-5b",
            "rock-5b-plus",
            "generic-rk3588",
            "generic-rk3576",
            "generic-aarch64",
            "x86_64-host",
        ] {
            let p = profile(id).unwrap_or_else(|| panic!("no profile {id}")).unwrap();
            assert_eq!(p.id, id);
        }
        assert!(n >= 12);
        let rk = profile("orangepi-5").unwrap().unwrap();
        assert_eq!((&rk.big_cores[..], &rk.little_cores[..]), (&[4, 5, 6, 7][..], &[0, 1, 2, 3][..]));
        assert_eq!((rk.npu_cores, rk.recommended_threads), (3, 4));
    }

    #[test]
    fn profile_errors_name_the_problem() {
        let ok = "name = \"X\"\ncompatible = []\nbig_cores = [4]\nlittle_cores = [0]\nnpu_cores = 0\n\
                  npu_matmul_types = []\nrecommended_threads = 1\nram_notes = \"\"\n";
        assert!(parse_profile("x", ok).is_ok());
        // The base file with one line replaced (or, for a new key, added).
        let with = |line: &str| {
            let key = line.split(' ').next().unwrap();
            let mut text = heapless::String::<512>::new();
            for l in ok.lines().filter(|l| !l.starts_with(key)) {
                text.push_str(l).unwrap();
                text.push('\n').unwrap();
            }
            text.push_str(line).unwrap();
            text
        };
        for (line, problem) in [
            ("colour = \"red\"\n", "unknown key"),
            ("name = \"Y\"\nname = \"Z\"\n", "twice"),
            ("big_cores = [5, 4]\n", "ascending"),
            ("little_cores = [4]\n", "both big and little"),
            ("npu_matmul_types = [\"fp16\"]\n", "without NPU cores"),
            ("compatible = [\"a\", \"a\"]\n", "repeated"),
        ] {
            let err = parse_profile("x", &with(line)).unwrap_err();
            assert!(err.problem.contains(problem), "{line:?}: {err}");
        }
        let err = parse_profile("x", "name = \"X\"\n").unwrap_err();
        assert_eq!((err.line, err.problem), (0, "missing key: compatible"));
    }

    #[test]
    fn device_tree_compatible_picks_the_board_before_the_soc() {
        let (p, hit) = match_compatible(b"xunlong,orangepi-5-plus\0rockchip,rk3588\0").unwrap();
        assert_eq!((p.id, hit), ("orangepi-5-plus", "xunlong,orangepi-5-plus"));
        let (p, _) = match_compatible(b"radxa,rock-5b\0rockchip,rk3588\0").unwrap();
        assert_eq!(p.id, "rock-5b");
        // An unknown RK3588S board falls back to the SoC profile; an RK3576 one to its own.
        let (p, hit) = match_compatible(b"vendor,new-board\0rockchip,rk3588s\0").unwrap();
        assert_eq!((p.id, hit), ("generic-rk3588", "rockchip,rk3588s"));
        assert_eq!(match_compatible(b"armsom,sige5\0rockchip,rk3576\0").unwrap().0.id, "generic-rk3576");
        assert!(match_compatible(b"raspberrypi,5-model-b\0brcm,bcm2712\0").is_none());
        assert!(match_compatible(b"").is_none());
    }

    #[test]
    fn fast_cores_splits_big_and_little_but_not_a_homogeneous_cpu() {
        // RK3588: A55 capacity 414, A76 1024 (two clusters binned slightly apart by frequency).
        let rk = [(0, 414), (1, 414), (2, 414), (3, 414), (4, 1024), (5, 1024), (6, 980), (7, 980)];
        assert_eq!(&fast_cores(&rk)[..], &[4, 5, 6, 7]);
        let freq = [(0, 1_800_000), (1, 1_800_000), (4, 2_400_000), (5, 2_256_000)];
        assert_eq!(&fast_cores(&freq)[..], &[4, 5]);
        assert!(fast_cores(&[(0, 1024), (1, 1024)]).is_empty());
        assert!(fast_cores(&[]).is_empty());
    }

    #[test]
    fn core_lists_parse_like_taskset() {
        assert_eq!(&parse_core_list("4-7").unwrap()[..], &[4, 5, 6, 7]);
        assert_eq!(&parse_core_list(" 6,0, 2-3 ").unwrap()[..], &[0, 2, 3, 6]);
        for bad in ["", "a", "3-1", "1,1", "1-", "-1"] {
            assert!(parse_core_list(bad).is_err(), "{bad:?}");
        }
    }
}
