//! The release archives `./x dist` writes (target/dist): what they hold, the glibc their binaries
//! need, and that they run and reproduce llama.cpp's greedy ids (the aarch64 one under qemu).
//!
//! These tests need the archives, so they are ignored by a plain `cargo test`; `./x test dist`
//! builds them and runs these with `--ignored`.

mod cli_support;
mod llama_golden;

use std::path::{Path, PathBuf};
use std::process::Command;

use cli_support::Scratch;
use serde_json::Value;

/// The newest glibc symbol version a dist binary may need: Rockchip's `librknnrt.so` needs 2.17,
/// and the oldest board images in use (Debian 11, Ubuntu 20.04) have 2.31.
const GLIBC_FLOOR: (u32, u32) = (2, 17);
/// Stripped binaries stay below this (8 MiB until the chat templates' Jinja engine and the
/// Messages/Responses APIs came in: the x86_64 binary is 8.3 MiB with them).
const MAX_BINARY_BYTES: u64 = 10 << 20;
const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const GOLDEN: &str = "smollm2.greedy.jsonl";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The archive for `arch` unpacked into `dir`; its top folder.
fn unpack(arch: &str, dir: &Scratch) -> PathBuf {
    let version = env!("CARGO_PKG_VERSION");
    let name = format!("pinfer-{version}-{arch}-linux-gnu");
    let archive = repo().join("target/dist").join(format!("{name}.tar.gz"));
    assert!(archive.exists(), "{} missing: run ./x dist", archive.display());
    let status = Command::new("tar").arg("xzf").arg(&archive).arg("-C").arg(dir.join("")).status().unwrap();
    assert!(status.success(), "tar could not unpack {}", archive.display());
    dir.join(name)
}

/// The symbol versions an ELF64 little-endian file needs, per library (its `.gnu.version_r`).
fn version_needs(elf: &[u8]) -> Vec<(String, String)> {
    let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap()) as usize;
    let u32_at = |at: usize| u32::from_le_bytes(elf[at..at + 4].try_into().unwrap()) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap()) as usize;
    assert_eq!(&elf[..6], b"\x7fELF\x02\x01", "not a little-endian ELF64 file");
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3A), u16_at(0x3C));
    let section = |i: usize| shoff + i * shentsize;
    let c_str = |at: usize| {
        let end = elf[at..].iter().position(|&b| b == 0).unwrap();
        String::from_utf8_lossy(&elf[at..at + end]).into_owned()
    };
    const SHT_GNU_VERNEED: usize = 0x6fff_fffe;
    let mut needs = Vec::new();
    for i in 0..shnum {
        let sh = section(i);
        if u32_at(sh + 4) != SHT_GNU_VERNEED {
            continue;
        }
        let (offset, link, count) = (u64_at(sh + 24), u32_at(sh + 40), u32_at(sh + 44));
        let strings = u64_at(section(link) + 24);
        let mut vn = offset;
        for _ in 0..count {
            let file = c_str(strings + u32_at(vn + 4));
            let mut aux = vn + u32_at(vn + 8);
            for _ in 0..u16_at(vn + 2) {
                needs.push((file.clone(), c_str(strings + u32_at(aux + 8))));
                aux += u32_at(aux + 12);
            }
            vn += u32_at(vn + 12);
        }
    }
    needs
}

/// `GLIBC_2.31` as (2, 31).
fn glibc_version(name: &str) -> Option<(u32, u32)> {
    let v = name.strip_prefix("GLIBC_")?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
}

/// The archive's files are there and match its SHA256SUMS; the binary is stripped, small, and
/// needs no glibc symbol above the floor.
fn check_archive(arch: &str, machine: u16, scratch: &Scratch) -> PathBuf {
    let dir = unpack(arch, scratch);
    for file in ["pinfer", "README.md", "pinfer.service", "LICENSE-MIT", "LICENSE-APACHE", "THIRD-PARTY.md"] {
        assert!(dir.join(file).is_file(), "{arch} archive lacks {file}");
    }
    let sums = Command::new("sha256sum").arg("-c").arg("SHA256SUMS").current_dir(&dir).output().unwrap();
    assert!(sums.status.success(), "{arch}: {}", String::from_utf8_lossy(&sums.stdout));
    let binary = dir.join("pinfer");
    let elf = std::fs::read(&binary).unwrap();
    assert_eq!(u16::from_le_bytes([elf[18], elf[19]]), machine, "{arch}: wrong e_machine");
    let size = elf.len() as u64;
    assert!(size < MAX_BINARY_BYTES, "{arch}: binary of {size} bytes");
    let needs = version_needs(&elf);
    let glibc: Vec<(u32, u32)> = needs.iter().filter_map(|(_, v)| glibc_version(v)).collect();
    assert!(!glibc.is_empty(), "{arch}: no GLIBC_ version needs found: {needs:?}");
    let newest = glibc.iter().max().unwrap();
    assert!(
        *newest <= GLIBC_FLOOR,
        "{arch}: needs GLIBC_{}.{} (floor {GLIBC_FLOOR:?}): {needs:?}",
        newest.0,
        newest.1
    );
    eprintln!("{arch}: {size} bytes, newest glibc need GLIBC_{}.{}", newest.0, newest.1);
    dir
}

/// Greedy ids of the first golden case without near-ties in its first 8 steps, through
/// `command` (the binary, possibly behind qemu; with `-m MODEL` unless it is a bundle), against
/// llama.cpp's.
fn check_greedy(command: Command, golden: &str) {
    let model = repo().join(MODEL);
    assert!(model.exists(), "{} missing: run scripts/setup.sh model", model.display());
    check_greedy_with(command, golden, Some(&model));
}

fn check_greedy_with(mut command: Command, golden: &str, model: Option<&Path>) {
    let case = llama_golden::jsonl(golden)
        .into_iter()
        .find(|c| c["margins"].as_array().unwrap().iter().take(8).all(|m| m.as_f64().unwrap() >= 0.3))
        .expect("a golden case without near-ties in its first 8 steps");
    let want: Vec<String> =
        case["generated_ids"].as_array().unwrap().iter().take(8).map(Value::to_string).collect();
    command.arg("generate");
    if let Some(model) = model {
        command.arg("-m").arg(model);
    }
    let out = command
        .args(["-p", case["prompt"].as_str().unwrap(), "-n", "8", "--temp", "0", "--print-ids", "-t", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().last().unwrap().trim(), want.join(" "), "stdout: {stdout}");
}

#[test]
#[ignore = "needs ./x dist; run by ./x test dist"]
fn aarch64_archive_has_the_glibc_floor_and_runs_under_qemu() {
    const EM_AARCH64: u16 = 183;
    let scratch = Scratch::new("dist-aarch64");
    let dir = check_archive("aarch64", EM_AARCH64, &scratch);
    // qemu's cortex-a76 has FEAT_FP16: the binary takes the fp16 path, held to llama.cpp's
    // aarch64 outputs.
    let mut qemu = Command::new("qemu-aarch64");
    qemu.args(["-cpu", "cortex-a76"]).arg(dir.join("pinfer"));
    check_greedy(qemu, &GOLDEN.replace(".greedy.jsonl", ".arm.greedy.jsonl"));
}

/// A PC makes the board's one-file bundle: the aarch64 binary with the model repacked for it
/// (the target binary repacks under qemu); the bundle runs with no `-m`.
#[test]
#[ignore = "needs ./x dist; run by ./x test dist"]
fn a_board_bundle_made_on_the_pc_runs_under_qemu() {
    let scratch = Scratch::new("dist-bundle");
    let dir = unpack("aarch64", &scratch);
    let out = dir.join("smollm2-board");
    let made = Command::new(env!("CARGO_BIN_EXE_pinfer"))
        .args(["bundle", "--repacked", "-m"])
        .arg(repo().join(MODEL))
        .arg("--target-binary")
        .arg(dir.join("pinfer"))
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let mut qemu = Command::new("qemu-aarch64");
    qemu.args(["-cpu", "cortex-a76"]).arg(&out);
    check_greedy_with(qemu, &GOLDEN.replace(".greedy.jsonl", ".arm.greedy.jsonl"), None);
}

#[test]
#[ignore = "needs ./x dist; run by ./x test dist"]
fn x86_64_archive_has_the_glibc_floor_and_runs() {
    const EM_X86_64: u16 = 62;
    let scratch = Scratch::new("dist-x86_64");
    let dir = check_archive("x86_64", EM_X86_64, &scratch);
    check_greedy(Command::new(dir.join("pinfer")), GOLDEN);
}

#[test]
fn version_needs_reads_this_test_binary() {
    // The test executable itself (linked against the build machine's glibc) needs some GLIBC_
    // versions: the reader finds them.
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let needs = version_needs(&exe);
    assert!(needs.iter().any(|(_, v)| glibc_version(v).is_some()), "{needs:?}");
    assert_eq!(glibc_version("GLIBC_2.31"), Some((2, 31)));
    assert_eq!(glibc_version("GLIBC_2.2.5"), Some((2, 2)));
    assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
}
