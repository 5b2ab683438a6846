//! A user's file is never lost: every writer (quantize, repack, npu-plan) leaves its input's bytes
//! unchanged, never replaces a device, a FIFO, a directory or a symbolic link, never follows a
//! planted link, and two concurrent writers leave one complete valid file. Inputs that are not
//! regular files are refused before they are opened. Repack caches carry checksums.

mod cli_support;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use cli_support::{pinfer, pinfer_command, repo_file, text_of, Scratch};

/// A fresh directory for one test, removed with what the test wrote when it ends.
fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("files-{name}"))
}

/// A copy of the tiny qwen3 model at `dir/name`.
fn model_copy(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::copy(repo_file("models/tiny/qwen3-tiny.gguf"), &to).unwrap();
    to
}

/// FNV-1a of a file's bytes: enough to see any change.
fn digest(path: &Path) -> u64 {
    std::fs::read(path)
        .unwrap()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn assert_refused(out: &Output, words: &[&str]) {
    assert_eq!(out.status.code(), Some(1), "stdout {} stderr {}", text_of(&out.stdout), text_of(&out.stderr));
    let err = text_of(&out.stderr);
    for w in words {
        assert!(err.contains(w), "stderr {err:?} lacks {w:?}");
    }
}

/// No temporary file of a writer is left in `dir`.
fn no_temporaries(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(!name.contains(".pinfer-"), "{name} left");
    }
}

/// The input of quantize and repack keeps its bytes whatever its name (the old writers truncated
/// `X.part` and `X.tmp` inputs), and the outputs are valid.
#[test]
fn inputs_named_like_temporaries_are_untouched() {
    let d = dir("tmpnames");
    let part = model_copy(&d, "dl.gguf.part");
    let before = digest(&part);
    let out = pinfer(&["quantize", s(&part), s(&d.join("dl.gguf")), "Q8_0"]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    assert_eq!(digest(&part), before);
    let tmp = model_copy(&d, "m.gguf.tmp");
    let before = digest(&tmp);
    let out = pinfer(&["repack", s(&tmp), s(&d.join("m.gguf"))]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    assert_eq!(digest(&tmp), before);
    assert!(pinfer(&["verify", s(&d.join("m.gguf"))]).status.success());
    no_temporaries(&d);
}

/// A symbolic link planted where the old writers put their temporary file is never followed.
#[test]
fn planted_links_are_never_followed() {
    let d = dir("planted");
    let input = model_copy(&d, "in.gguf");
    let victim = d.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    for name in ["out.gguf.part", "out.gguf.tmp", "cache.gguf.tmp", "cache.gguf.part"] {
        std::os::unix::fs::symlink(&victim, d.join(name)).unwrap();
    }
    assert!(pinfer(&["quantize", s(&input), s(&d.join("out.gguf")), "Q8_0"]).status.success());
    assert!(pinfer(&["repack", s(&input), s(&d.join("cache.gguf"))]).status.success());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

/// The output may not be the input, through the same path, a hard link or a symbolic link.
#[test]
fn the_input_is_never_the_output() {
    let d = dir("same");
    let input = model_copy(&d, "m.gguf");
    let before = digest(&input);
    std::fs::hard_link(&input, d.join("hard.gguf")).unwrap();
    std::os::unix::fs::symlink(&input, d.join("soft.gguf")).unwrap();
    for out in ["m.gguf", "hard.gguf", "soft.gguf"] {
        let out = s(&d.join(out)).to_string();
        assert_refused(&pinfer(&["quantize", s(&input), &out, "Q8_0"]), &["the same file"]);
        assert_refused(&pinfer(&["repack", s(&input), &out]), &["the same file"]);
        if cfg!(feature = "npu") {
            assert_refused(&pinfer(&["npu-plan", "-m", s(&input), "-o", &out]), &["the same file"]);
        }
    }
    assert_eq!(digest(&input), before);
    no_temporaries(&d);
}

/// Devices, FIFOs and directories are never replaced; a dangling link is refused; a link to a file
/// stays a link and the file it names gets the output.
#[test]
fn only_regular_files_are_replaced() {
    let d = dir("kinds");
    let input = model_copy(&d, "m.gguf");
    let fifo = d.join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let sub = d.join("subdir");
    std::fs::create_dir(&sub).unwrap();
    let mut targets = vec![(fifo.clone(), "FIFO"), (sub.clone(), "directory")];
    // A device of our own (the same as /dev/full), where we may create one: never the system's.
    let dev = d.join("full");
    let made = std::process::Command::new("mknod").args([s(&dev), "c", "1", "7"]).output();
    if made.is_ok_and(|o| o.status.success()) {
        targets.push((dev.clone(), "device"));
    } else {
        eprintln!("note: cannot mknod here (not root): the device case runs as root only");
    }
    for (target, kind) in &targets {
        assert_refused(&pinfer(&["repack", s(&input), s(target)]), &[kind]);
        assert_refused(&pinfer(&["quantize", s(&input), s(target), "Q8_0"]), &[kind]);
    }
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(std::fs::symlink_metadata(&sub).unwrap().is_dir());
    if targets.len() == 3 {
        assert!(std::fs::symlink_metadata(&dev).unwrap().file_type().is_char_device());
    }

    let dangling = d.join("dangling.gguf");
    std::os::unix::fs::symlink(d.join("nowhere"), &dangling).unwrap();
    assert_refused(&pinfer(&["repack", s(&input), s(&dangling)]), &["symbolic link to a missing file"]);

    let real = d.join("real.gguf");
    std::fs::write(&real, b"old").unwrap();
    let link = d.join("link.gguf");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(pinfer(&["repack", s(&input), s(&link)]).status.success());
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert!(pinfer(&["verify", s(&real)]).status.success(), "the file the link names holds the cache");
    no_temporaries(&d);
}

/// Model inputs that are not regular files are refused at once: a FIFO used to hang forever.
#[test]
fn a_fifo_or_directory_model_is_refused_without_waiting() {
    let d = dir("fifo-in");
    let fifo = d.join("model.gguf");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for args in [
        vec!["info", "-m", s(&fifo)],
        vec!["generate", "-m", s(&fifo), "-p", "hi"],
        vec!["repack", s(&fifo), "out.gguf"],
        vec!["generate", "-m", s(&d), "-p", "hi"],
    ] {
        let mut child = pinfer_command().args(&args).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if started.elapsed().as_secs() > 60 {
                let _ = child.kill();
                panic!("{args:?} still waits on the input");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let out = child.wait_with_output().unwrap();
        assert_eq!(status.code(), Some(1), "{args:?}");
        assert!(text_of(&out.stderr).contains("not a regular file"), "{args:?}: {}", text_of(&out.stderr));
    }
}

/// Two repack runs to one output at once: both finish, and the output is one complete cache that
/// verifies (they used to share OUT.tmp and leave zero pages).
#[test]
fn concurrent_writers_leave_one_complete_file() {
    let d = dir("concurrent");
    let input = repo_file("models/SmolLM2-135M-Instruct.Q4_0.gguf");
    let out = d.join("cache.gguf");
    for _ in 0..2 {
        let children: Vec<_> = (0..2)
            .map(|_| {
                pinfer_command()
                    .args(["repack", &input, s(&out)])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", text_of(&o.stderr));
        }
        let v = pinfer(&["verify", s(&out)]);
        assert!(v.status.success(), "{}", text_of(&v.stderr));
    }
    no_temporaries(&d);
}

/// Flipped bytes in a cache's tensor data are found by `pinfer verify` (naming the tensor) and
/// stop a run from it; a damaged header is refused at load. Both say to repack, not to download.
#[test]
fn damaged_caches_are_caught_and_say_to_repack() {
    let d = dir("damaged");
    let input = model_copy(&d, "m.gguf");
    let cache = d.join("c.gguf");
    assert!(pinfer(&["repack", s(&input), s(&cache)]).status.success());
    let bytes = std::fs::read(&cache).unwrap();
    let data_flip = d.join("data.gguf");
    let mut b = bytes.clone();
    let at = b.len() - 100; // inside the last tensor's data
    b[at] ^= 0x10;
    std::fs::write(&data_flip, &b).unwrap();
    let v = pinfer(&["verify", s(&data_flip)]);
    assert_refused(&v, &["tensor", "checksum", "pinfer repack"]);
    let g = pinfer(&["generate", "-m", s(&data_flip), "-p", "Hello", "-n", "4", "--temp", "0"]);
    assert_refused(&g, &["checksum", "pinfer repack"]);

    // A byte of the header's metadata (the architecture's name is near the start).
    let header_flip = d.join("header.gguf");
    let mut b = bytes;
    let at = b.windows(5).position(|w| w == b"qwen3").unwrap();
    b[at] ^= 0x01;
    std::fs::write(&header_flip, &b).unwrap();
    let g = pinfer(&["generate", "-m", s(&header_flip), "-p", "Hello", "-n", "4"]);
    assert_refused(&g, &["pinfer repack"]);
    assert!(!text_of(&g.stderr).contains("download"), "{}", text_of(&g.stderr));
}

/// Interrupting a writer removes its temporary file and leaves the output as it was: one SIGINT
/// (the writer stops between tensors), two at once (the handler exits at once), SIGTERM and
/// SIGHUP (a closed SSH session).
#[test]
fn an_interrupted_writer_leaves_nothing_behind() {
    use nix::sys::signal::Signal::{SIGHUP, SIGINT, SIGTERM};
    let d = dir("interrupt");
    let input = repo_file("models/SmolLM2-135M-Instruct.Q8_0.gguf");
    let out = d.join("q.gguf");
    for (signals, code) in
        [(&[SIGINT][..], 130), (&[SIGINT, SIGINT][..], 130), (&[SIGTERM][..], 143), (&[SIGHUP][..], 129)]
    {
        std::fs::write(&out, b"previous").unwrap();
        let child = pinfer_command()
            .args(["quantize", &input, s(&out), "Q4_K"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        for &sig in signals {
            let _ = nix::sys::signal::kill(pid, sig);
        }
        let status = child.wait_with_output().unwrap().status;
        eprintln!("quantize after {signals:?} ended with {status}");
        match status.code() {
            Some(c) if c == code => assert_eq!(std::fs::read(&out).unwrap(), b"previous", "{signals:?}"),
            // It finished first: then the output is complete.
            Some(0) => assert!(pinfer(&["info", "-m", s(&out)]).status.success()),
            other => panic!("quantize after {signals:?} ended with {other:?}"),
        }
        no_temporaries(&d);
    }
}

/// `pinfer_command()` run as `nobody` through setpriv (when this test runs as root).
fn as_nobody(args: &[&str]) -> Option<Output> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { nix::libc::geteuid() } != 0 {
        eprintln!("note: not root: the unprivileged cases run as root only (they switch to nobody)");
        return None;
    }
    let base = pinfer_command();
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
        .arg(base.get_program())
        .args(base.get_args());
    Some(cmd.args(args).output().unwrap())
}

/// A full disk is an error naming the output, with the old output kept and no temporary left
/// (a 1 MiB tmpfs, where root may mount one); unprivileged, a directory it cannot write and a
/// device are refused the same way, and the input is unchanged.
#[test]
fn full_disks_and_unwritable_places_fail_cleanly() {
    let d = dir("full");
    let input = model_copy(&d, "m.gguf");
    let before = digest(&input);
    let small = d.join("small");
    std::fs::create_dir(&small).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs", s(&small)])
        .output()
        .is_ok_and(|o| o.status.success());
    if mounted {
        let out = small.join("cache.gguf");
        std::fs::write(&out, b"old").unwrap();
        assert_refused(&pinfer(&["repack", s(&input), s(&out)]), &["No space left"]);
        assert_refused(&pinfer(&["quantize", s(&input), s(&out), "Q8_0"]), &["No space left"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        no_temporaries(&small);
        let _ = std::process::Command::new("umount").arg(&small).status();
    } else {
        eprintln!("note: cannot mount a tmpfs here: the full-disk case needs root with mount rights");
    }

    // Unprivileged: the model is readable, its directory is not writable by nobody.
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    if let Some(out) = as_nobody(&["repack", s(&input), s(&d.join("c.gguf"))]) {
        assert_refused(&out, &["Permission denied"]);
        let out = as_nobody(&["quantize", s(&input), "/dev/full", "Q8_0"]).unwrap();
        assert_refused(&out, &["is a device"]);
        let out = as_nobody(&["generate", "-m", s(&input), "-p", "Hello", "-n", "4", "--temp", "0"]).unwrap();
        assert!(out.status.success(), "nobody can run the model: {}", text_of(&out.stderr));
    }
    assert_eq!(digest(&input), before);
    no_temporaries(&d);
}

/// A replaced output keeps its permissions; a read-only one is refused; a name near the 255-byte
/// limit still gets a temporary file beside it.
#[test]
fn permissions_and_long_names() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir("perms");
    let input = model_copy(&d, "m.gguf");
    let out = d.join("private.gguf");
    std::fs::write(&out, b"old").unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(pinfer(&["repack", s(&input), s(&out)]).status.success());
    assert_eq!(std::fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o444)).unwrap();
    let before = digest(&out);
    assert_refused(&pinfer(&["repack", s(&input), s(&out)]), &["read-only"]);
    assert_eq!(digest(&out), before);
    let long = d.join(format!("{}.gguf", "a".repeat(245)));
    let o = pinfer(&["repack", s(&input), s(&long)]);
    assert!(o.status.success(), "{}", text_of(&o.stderr));
    no_temporaries(&d);
}
