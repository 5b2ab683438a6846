//! Build script: embeds the board profiles, applies the graph-capacity override and declares our cfgs.
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// Default node capacity of a computation graph; `PINFER_GRAPH_CAPACITY` overrides it for tight targets.
const DEFAULT_GRAPH_CAPACITY: usize = 4096;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=boards");
    println!("cargo::rerun-if-env-changed=PINFER_GRAPH_CAPACITY");
    export_rknn_emulator();

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));

    let capacity = match env::var("PINFER_GRAPH_CAPACITY") {
        Ok(text) => match text.trim().parse::<usize>() {
            Ok(n) if (16..=1 << 20).contains(&n) => n,
            _ => panic!("PINFER_GRAPH_CAPACITY={text:?}: expected a node count between 16 and 1048576"),
        },
        Err(_) => DEFAULT_GRAPH_CAPACITY,
    };

    let mut code = String::new();
    writeln!(code, "/// Node capacity of a computation graph (build-time `PINFER_GRAPH_CAPACITY`).").unwrap();
    writeln!(code, "pub const GRAPH_CAPACITY: usize = {capacity};").unwrap();
    write_board_table(&manifest_dir.join("boards"), &mut code);
    fs::write(out_dir.join("build_config.rs"), code).expect("write build_config.rs");
}

/// Embeds every `boards/*.toml` as `(name, text)`, sorted by name, so the binary carries its profiles.
fn write_board_table(dir: &Path, code: &mut String) {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "toml"));
    // By stem, so `orangepi-5` sorts before `orangepi-5-max` (as names, not file names).
    files.sort_by(|a, b| a.file_stem().cmp(&b.file_stem()));
    writeln!(code, "/// Board profiles embedded from `boards/*.toml`: (file stem, file text).").unwrap();
    writeln!(code, "pub static BOARD_PROFILES: &[(&str, &str)] = &[").unwrap();
    for path in &files {
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("board file names are UTF-8");
        // Relative to the crate being compiled, not this checkout's absolute path: a target
        // directory shared by two checkouts (git worktrees) may reuse this generated file.
        let file = path.file_name().and_then(|s| s.to_str()).expect("board file names are UTF-8");
        let rel = format!("/boards/{file}");
        writeln!(code, "    ({stem:?}, include_str!(concat!(env!(\"CARGO_MANIFEST_DIR\"), {rel:?}))),")
            .unwrap();
    }
    writeln!(code, "];").unwrap();
}

/// With the `npu` feature, rknn-sys builds a CPU emulator of librknnrt.so for tests and passes its
/// path to us as `DEP_RKNNRT_EMULATOR`; tests read it as `env!("PINFER_RKNN_EMULATOR")` (and point
/// `PINFER_RKNNRT` at it).
fn export_rknn_emulator() {
    println!("cargo::rerun-if-env-changed=DEP_RKNNRT_EMULATOR");
    if env::var_os("CARGO_FEATURE_NPU").is_none() {
        return;
    }
    if let Ok(path) = env::var("DEP_RKNNRT_EMULATOR") {
        println!("cargo::rustc-env=PINFER_RKNN_EMULATOR={path}");
    }
}
