//! With `--features regenerate` (build.rs then runs bindgen): `src/bindings.rs` must be exactly
//! what bindgen makes of `include/rknn_matmul_subset.h` now. `RKNN_SYS_BLESS=1` rewrites it
//! instead (that is what `regen.sh` does). When `RKNN_INCLUDE_DIR` pointed at a Rockchip SDK's
//! include directory at build time, our declarations are also compared with the vendor's.
#![cfg(feature = "regenerate")]

use std::collections::HashMap;
use std::path::Path;

fn committed_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bindings.rs")
}

#[test]
fn bindings_are_current() {
    let fresh = std::fs::read_to_string(env!("RKNN_SYS_REGEN_BINDINGS")).expect("regenerated bindings");
    if std::env::var_os("RKNN_SYS_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(committed_path(), &fresh).expect("write src/bindings.rs");
        eprintln!("rewrote {}", committed_path().display());
        return;
    }
    let committed = std::fs::read_to_string(committed_path()).expect("src/bindings.rs");
    if fresh != committed {
        let line = fresh
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| fresh.lines().count().min(committed.lines().count()));
        panic!(
            "src/bindings.rs is not what bindgen generates from include/rknn_matmul_subset.h \
             (first difference at line {}): run rknn-sys/regen.sh\n  generated: {:?}\n  committed: {:?}",
            line + 1,
            fresh.lines().nth(line).unwrap_or("<end>"),
            committed.lines().nth(line).unwrap_or("<end>"),
        );
    }
}

/// What a bindgen file declares, by name: struct bodies (field lines), and constants (values).
#[derive(Default)]
struct Items {
    structs: HashMap<String, Vec<String>>,
    consts: HashMap<String, String>,
}

fn items(src: &str) -> Items {
    // `pub type T = S;` and `pub use self::S as T;` name struct/enum S by its typedef T.
    let mut alias = HashMap::new();
    for line in src.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("pub type ") {
            if let Some((t, s)) = rest.trim_end_matches(';').split_once(" = ") {
                alias.insert(s.to_owned(), t.to_owned());
            }
        } else if let Some(rest) = line.strip_prefix("pub use self::") {
            if let Some((s, t)) = rest.trim_end_matches(';').split_once(" as ") {
                alias.insert(s.to_owned(), t.to_owned());
            }
        }
    }
    let canon = |s: &str| {
        s.split_inclusive(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map(|tok| {
                let word = tok.trim_end_matches(|c: char| !(c.is_alphanumeric() || c == '_'));
                let rest = &tok[word.len()..];
                format!("{}{rest}", alias.get(word).map_or(word, String::as_str))
            })
            .collect::<String>()
    };
    let mut out = Items::default();
    let mut lines = src.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if let Some(name) = line.strip_prefix("pub struct ").and_then(|r| r.strip_suffix(" {")) {
            let body = lines
                .by_ref()
                .take_while(|l| *l != "}")
                .filter(|l| !l.starts_with("///"))
                .map(&canon)
                .collect();
            out.structs.insert(canon(name), body);
        } else if let Some(start) = line.strip_prefix("pub const ") {
            // `NAME: TYPE = VALUE;` (enum newtype constants: `VALUE` = `TYPE(n)`), maybe wrapped.
            let mut rest = start.to_owned();
            while !rest.ends_with(';') {
                match lines.next() {
                    Some(more) => rest.push_str(more),
                    None => break,
                }
            }
            if let (Some((name, _)), Some((_, value))) = (rest.split_once(':'), rest.split_once(" = ")) {
                let value = value.trim_end_matches(';');
                let value = value.rsplit_once('(').map_or(value, |(_, v)| v.trim_end_matches(')'));
                out.consts.insert(name.to_owned(), value.trim().trim_end_matches(',').to_owned());
            }
        }
    }
    out
}

#[test]
fn vendor_headers_agree() {
    let Some(vendor) = option_env!("RKNN_SYS_VENDOR_BINDINGS") else {
        eprintln!("RKNN_INCLUDE_DIR was not set at build time: no vendor header to compare with");
        return;
    };
    let ours = items(&std::fs::read_to_string(env!("RKNN_SYS_REGEN_BINDINGS")).unwrap());
    let theirs = items(&std::fs::read_to_string(vendor).unwrap());
    let mut problems = Vec::new();
    for (name, fields) in &ours.structs {
        match theirs.structs.get(name) {
            None => problems.push(format!("struct {name}: not in the vendor header")),
            Some(f) if f != fields => problems.push(format!("struct {name}: ours {fields:?}, vendor {f:?}")),
            _ => {}
        }
    }
    for (name, value) in &ours.consts {
        match theirs.consts.get(name) {
            None => problems.push(format!("constant {name}: not in the vendor header")),
            Some(v) if v != value => problems.push(format!("constant {name}: ours {value}, vendor {v}")),
            _ => {}
        }
    }
    assert!(problems.is_empty(), "our header disagrees with the vendor's:\n{}", problems.join("\n"));
}
