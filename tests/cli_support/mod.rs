//! Running the built `pinfer` binary from integration tests (directly, or through qemu-user in the
//! cross tier), and the files those tests use.
#![allow(dead_code)] // each test binary uses its own part

use std::io::Write;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

/// Runs the built `pinfer` binary.
pub fn pinfer(args: &[&str]) -> Output {
    pinfer_in(Path::new("."), args)
}

/// Runs `pinfer` with `dir` as its working directory.
pub fn pinfer_in(dir: &Path, args: &[&str]) -> Output {
    let mut cmd = pinfer_command();
    cmd.args(args).current_dir(dir).output().unwrap_or_else(|e| panic!("cannot start pinfer: {e}"))
}

/// A command that starts the built `pinfer` (through qemu when needed, see [`through_qemu`]).
pub fn pinfer_command() -> Command {
    let exe = env!("CARGO_BIN_EXE_pinfer");
    match through_qemu() {
        Some(cpu) => {
            let mut c = Command::new("qemu-aarch64");
            c.args(["-cpu", cpu, exe]);
            c
        }
        None => Command::new(exe),
    }
}

/// When these tests run under qemu-user (the cross tier), the host kernel cannot exec the aarch64
/// binary, and qemu's emulated vfork turns that into a child exiting with 127 and no output (pinfer
/// itself never exits 127). Then the binary is started through qemu, with the CPU of `PINFER_QEMU_CPU`.
pub fn through_qemu() -> Option<&'static str> {
    static MODE: OnceLock<Option<String>> = OnceLock::new();
    MODE.get_or_init(|| {
        let direct = Command::new(env!("CARGO_BIN_EXE_pinfer")).arg("--version").output();
        let cannot_exec = match direct {
            Ok(out) => out.status.code() == Some(127) && out.stdout.is_empty(),
            Err(e) => e.raw_os_error() == Some(8), // ENOEXEC
        };
        cannot_exec.then(|| std::env::var("PINFER_QEMU_CPU").unwrap_or_else(|_| "cortex-a76".into()))
    })
    .as_deref()
}

pub fn text_of(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A file holding `bytes` in the test process's temporary directory, removed when dropped (and
/// the directory with its last file).
pub fn temp_file(name: &str, bytes: &[u8]) -> TempFile {
    let dir = std::env::temp_dir().join(format!("pinfer-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
    TempFile(path)
}

/// See [`temp_file`].
pub struct TempFile(PathBuf);

impl std::ops::Deref for TempFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempFile {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        if let Some(dir) = self.0.parent() {
            // Only succeeds once the directory is empty: the last test's file takes it along.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

pub fn repo_file(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    assert!(path.exists(), "{} missing: run scripts/setup.sh", path.display());
    path.to_str().unwrap().to_string()
}

/// A fresh directory for one test, removed with everything in it when dropped (also when the
/// test fails): tests that write models and executables leave nothing behind.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("pinfer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.0.join(rel)
    }
}

/// A scratch directory is its path wherever one is wanted.
impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Spawns `cmd` (a `pinfer serve --port 0 ...` command) and returns it with the port it printed
/// (`listening on http://ADDR:PORT`); its stderr is drained from then on, so the server never blocks
/// on a full pipe.
pub fn spawn_server(mut cmd: Command) -> (Child, u16) {
    let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("starting pinfer serve");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let port = loop {
        let line = lines.next().expect("pinfer serve ended before listening").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap();
            break addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, port)
}

/// `png` (a valid PNG) with its header declaring `width` x `height` pixels (its CRC mended): an
/// image that claims more than it holds, for the size checks made before decoding.
pub fn png_declaring(png: &[u8], width: u32, height: u32) -> Vec<u8> {
    let mut out = png[..16].to_vec();
    out.extend_from_slice(&width.to_be_bytes());
    out.extend_from_slice(&height.to_be_bytes());
    out.extend_from_slice(&png[24..29]);
    out.extend_from_slice(&crc32fast::hash(&out[12..29]).to_be_bytes());
    out.extend_from_slice(&png[33..]);
    out
}
