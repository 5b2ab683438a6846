//! The CLI as llama.cpp's users type it, and as scripts run it: llama-cli's flags, write errors
//! on full or closed streams, SIGINT and SIGPIPE.

mod cli_support;

use std::io::{Read, Write};
use std::process::{Child, Output, Stdio};

use cli_support::{pinfer, pinfer_command, repo_file, temp_file, text_of};

fn tiny() -> String {
    repo_file("models/tiny/qwen3-tiny.gguf")
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "status {:?} stderr {}", out.status, text_of(&out.stderr));
    text_of(&out.stdout)
}

fn failed(out: &Output, code: i32, words: &[&str]) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout {} stderr {}",
        text_of(&out.stdout),
        text_of(&out.stderr)
    );
    let err = text_of(&out.stderr);
    for w in words {
        assert!(err.contains(w), "stderr {err:?} lacks {w:?}");
    }
}

/// Values that start with '-' are values (a prompt "-5 ...", -n -1, --seed -1), and llama.cpp's
/// multi-letter flags are never read as clusters of short ones (-cnv was `-c nv`).
#[test]
fn values_may_start_with_a_dash_and_llama_spellings_are_read_whole() {
    let m = tiny();
    let out = ok(&pinfer(&["generate", "-m", &m, "-p", "-5 is negative", "-n", "3", "--temp", "0"]));
    assert!(out.starts_with("-5 is negative"), "{out}");
    let out = ok(&pinfer(&["generate", "-m", &m, "-p", "-cnv", "-n", "2", "--temp", "0"]));
    assert!(out.starts_with("-cnv"), "a prompt that looks like a flag stays the prompt: {out}");
    // The same after a cluster of short flags whose last letter takes the value.
    let out = ok(&pinfer(&["generate", "-m", &m, "-vp", "-cnv", "-n", "2", "--temp", "0"]));
    assert!(out.starts_with("-cnv"), "-vp VALUE: {out}");
    // -n -1: until end of generation or a full context (here 12 tokens).
    let out =
        pinfer(&["generate", "-m", &m, "-p", "Hello", "-n", "-1", "-c", "12", "--temp", "0", "--ignore-eos"]);
    ok(&out);
    assert!(text_of(&out.stderr).contains("context full (12 tokens)"), "{}", text_of(&out.stderr));
    failed(&pinfer(&["generate", "-m", &m, "-p", "x", "-n", "-3"]), 1, &["-n -3"]);
    // Flags that do not apply are accepted with a note, in both spellings.
    let out = pinfer(&["generate", "-m", &m, "-p", "Hi", "-n", "1", "-ngl", "99", "-fa", "on", "--numa"]);
    ok(&out);
    let err = text_of(&out.stderr);
    assert!(
        err.contains("-ngl 99 has no effect") && err.contains("-fa on") && err.contains("--numa"),
        "{err}"
    );
    ok(&pinfer(&[
        "generate",
        "-m",
        &m,
        "-p",
        "Hi",
        "-n",
        "1",
        "--n-gpu-layers",
        "33",
        "-ub",
        "8",
        "-b",
        "16",
    ]));
    // What pinfer lacks is named, not misread; a typo gets a suggestion.
    failed(&pinfer(&["generate", "-m", &m, "-p", "x", "-dkvc"]), 1, &["-dkvc", "not have yet"]);
    // KV cache types by llama.cpp's names; an unknown one lists the supported ones.
    let out = ok(&pinfer(&[
        "generate", "-m", &m, "-p", "Hi", "-n", "2", "--temp", "0", "-ctk", "q8_0", "-ctv", "Q4_0",
    ]));
    assert!(out.starts_with("Hi"), "{out}");
    failed(&pinfer(&["generate", "-m", &m, "-p", "x", "-ctk", "q4_k"]), 2, &["q4_k", "f16, q4_0", "q8_0"]);
    failed(&pinfer(&["generate", "-m", &m, "-p", "x", "--tmep", "0"]), 2, &["--temp"]);
    // llama-cli is typed without a subcommand.
    let out = ok(&pinfer(&["-m", &m, "-p", "Hi", "-n", "2", "--temp", "0"]));
    assert!(out.starts_with("Hi"), "{out}");
}

/// Sampler options are checked before the model is loaded (so before a long load, and even when
/// the model is missing).
#[test]
fn bad_sampler_options_are_refused_before_loading() {
    let out = pinfer(&["generate", "-m", "/nonexistent.gguf", "-p", "x", "--temp", "-1"]);
    failed(&out, 1, &["temperature"]);
    assert!(!text_of(&out.stderr).contains("nonexistent"), "{}", text_of(&out.stderr));
    failed(&pinfer(&["generate", "-m", "/nonexistent.gguf", "-p", "x", "--top-p", "1.5"]), 1, &["top_p"]);
    failed(&pinfer(&["generate", "-m", "/nonexistent.gguf", "-p", "x", "-s", "-7"]), 1, &["--seed -7"]);
}

/// `--seed -1` (the default) draws a seed, so sampling differs between runs; a given seed repeats.
#[test]
fn the_default_seed_is_random_and_a_given_seed_repeats() {
    let m = tiny();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            &m,
            "-p",
            "Hello",
            "-n",
            "24",
            "--temp",
            "1.5",
            "--top-k",
            "0",
            "--min-p",
            "0",
            "--print-ids",
            "--ignore-eos",
            "-v",
        ];
        args.extend_from_slice(extra);
        let out = pinfer(&args);
        (ok(&out).lines().last().unwrap().to_string(), text_of(&out.stderr))
    };
    let (a, err) = run(&[]);
    let (b, _) = run(&["--seed", "-1"]);
    assert_ne!(a, b, "two random seeds gave the same 24 tokens");
    let seed = err.lines().find_map(|l| l.strip_prefix("pinfer: seed ")).expect("-v prints the seed");
    let seed = seed.split(' ').next().unwrap();
    let (again, _) = run(&["-s", seed]);
    assert_eq!(a, again, "the printed seed repeats the run");
}

/// The prompt from a file, from stdin, with llama-cli's escapes (on by default), and without the
/// echo: stdout then holds only the generated text.
#[test]
fn prompts_from_files_stdin_and_escapes() {
    let m = tiny();
    let file = temp_file("prompt.txt", b"a\\tb");
    let out = ok(&pinfer(&["generate", "-m", &m, "-f", file.to_str().unwrap(), "-n", "1", "--temp", "0"]));
    assert!(out.starts_with("a\tb"), "{out:?}");
    // One trailing newline of a file is dropped (llama-cli's rule): -f gives what -p gives.
    let args = |prompt: &[&str]| {
        let mut a =
            vec!["generate", "-m", &m, "-n", "4", "--temp", "0", "--print-ids", "--no-display-prompt"];
        a.extend_from_slice(prompt);
        ok(&pinfer(&a))
    };
    let with_newline = temp_file("prompt-nl.txt", b"Once upon a time\n");
    assert_eq!(args(&["-f", with_newline.to_str().unwrap()]), args(&["-p", "Once upon a time"]));
    let out = ok(&pinfer(&["generate", "-m", &m, "-p", "a\\nb\\\\", "-n", "1", "--temp", "0"]));
    assert!(out.starts_with("a\nb\\"), "{out:?}");
    let out = ok(&pinfer(&["generate", "-m", &m, "-p", "a\\nb", "--no-escape", "-n", "1", "--temp", "0"]));
    assert!(out.starts_with("a\\nb"), "{out:?}");
    let mut child = spawn(&[
        "generate",
        "-m",
        &m,
        "-p",
        "-",
        "-n",
        "3",
        "--temp",
        "0",
        "--no-display-prompt",
        "--print-ids",
    ]);
    child.stdin.take().unwrap().write_all(b"PromptFromStdin").unwrap();
    let out = ok(&child.wait_with_output().unwrap());
    assert!(!out.contains("PromptFromStdin"), "--no-display-prompt: {out:?}");
    assert_eq!(out.lines().last().unwrap().split(' ').count(), 3, "{out:?}");
    failed(&pinfer(&["generate", "-m", &m]), 1, &["no prompt"]);
    let bad = temp_file("latin1.txt", b"caf\xe9");
    failed(&pinfer(&["generate", "-m", &m, "-f", bad.to_str().unwrap()]), 1, &["UTF-8"]);
}

/// `-cnv` and `-i` are chat; `--chat-template` takes a built-in name, or refuses an unknown one.
#[test]
fn conversation_flags_and_chat_templates() {
    let m = tiny();
    for flag in ["-cnv", "-i", "--conversation"] {
        let mut child =
            spawn(&["generate", "-m", &m, flag, "-n", "3", "--temp", "0", "--chat-template", "llama3"]);
        child.stdin.take().unwrap().write_all(b"Hello\n\n").unwrap();
        let out = child.wait_with_output().unwrap();
        ok(&out);
        assert!(text_of(&out.stderr).contains("llama3 template"), "{flag}: {}", text_of(&out.stderr));
    }
    failed(&pinfer(&["chat", "-m", &m, "--chat-template", "no-such-template"]), 1, &["chatml", "built-in"]);
}

/// A full stdout is an error naming the stream (it was exit 0 with the text lost, or a panic);
/// a full stderr makes the exit status 1 where something had to be written there, and never aborts.
#[test]
fn full_streams_are_errors_never_silence_or_panics() {
    let m = tiny();
    let full = || std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let runs: [&[&str]; 5] = [
        &["generate", "-m", &m, "-p", "Hello", "-n", "4"],
        &["info", "-m", &m],
        &["tokenize", "-m", &m, "-p", "Hello world"],
        &["boards"],
        &["verify", &m],
    ];
    for args in runs {
        let out = pinfer_command().args(args).stdout(full()).stderr(Stdio::piped()).output().unwrap();
        failed(&out, 1, &["writing to standard output", "No space left"]);
        // Commands that write to stderr (generate's timings) fail when it is full; none aborts.
        let out = pinfer_command().args(args).stdout(Stdio::null()).stderr(full()).output().unwrap();
        let writes_stderr = args[0] == "generate";
        assert_eq!(
            out.status.code(),
            Some(i32::from(writes_stderr)),
            "{args:?} with stderr full: {:?}",
            out.status
        );
    }
}

/// Output into a pipe that closes (`| head -c1`) ends quietly with status 141, as coreutils.
#[test]
fn a_closed_pipe_ends_quietly_with_141() {
    let mut child = spawn(&["generate", "-m", &smollm2(), "-p", "Hello", "-n", "-1", "--ignore-eos"]);
    let mut first = [0u8; 1];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap(); // then the pipe closes
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(141), "stderr {}", text_of(&out.stderr));
    assert!(!text_of(&out.stderr).contains("error"), "{}", text_of(&out.stderr));
}

/// Starts `pinfer ARGS` with stdin, stdout and stderr piped.
fn spawn(args: &[&str]) -> Child {
    pinfer_command()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The default model: real text, and slow enough to interrupt.
fn smollm2() -> String {
    repo_file("models/SmolLM2-135M-Instruct.Q4_0.gguf")
}

fn interrupt(child: &Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
}

/// Reads `child`'s stdout until `want` has appeared.
fn read_until(out: &mut impl Read, want: &str) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains(want) {
        assert_eq!(out.read(&mut byte).unwrap(), 1, "stdout ended before {want:?}: {}", text_of(&seen));
        seen.push(byte[0]);
    }
    text_of(&seen)
}

/// SIGINT stops generation after the current token, prints the timing lines and exits 130.
#[test]
fn sigint_stops_generation_with_timings() {
    let mut child =
        spawn(&["generate", "-m", &smollm2(), "-p", "Once upon a time", "-n", "-1", "--ignore-eos"]);
    let mut stdout = child.stdout.take().unwrap();
    read_until(&mut stdout, "Once upon a time");
    let mut more = [0u8; 8];
    stdout.read_exact(&mut more).unwrap(); // generating
    interrupt(&child);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text_of(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted") && err.contains("eval time") && err.contains("total time"), "{err}");
}

/// In chat, SIGINT stops the reply and returns to the prompt; at the prompt it exits (130).
#[test]
fn sigint_in_chat_stops_the_reply_then_exits_at_the_prompt() {
    // --ignore-eos: a reply cannot end by itself before the interrupt reaches it.
    let mut child = spawn(&["chat", "-m", &smollm2(), "-n", "-1", "-c", "4096", "--ignore-eos"]);
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    read_until(&mut stdout, "> ");
    stdin.write_all(b"Write a very long story about a dragon, in many chapters.\n").unwrap();
    stdin.flush().unwrap();
    let mut reply = [0u8; 4];
    stdout.read_exact(&mut reply).unwrap(); // the reply streams
    interrupt(&child);
    read_until(&mut stdout, "\n> "); // back at the prompt
    stdin.write_all(b"Thanks\n").unwrap();
    stdin.flush().unwrap();
    stdout.read_exact(&mut reply).unwrap(); // a second reply: the session goes on
    interrupt(&child);
    read_until(&mut stdout, "\n> ");
    interrupt(&child); // at the prompt: exits
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text_of(&out.stderr));
    assert_eq!(text_of(&out.stderr).matches("reply interrupted").count(), 2, "{}", text_of(&out.stderr));
}

/// Generation allocates nothing per token: valgrind counts the same heap allocations for 8 and
/// for 40 generated tokens (x86 hosts; valgrind does not run the aarch64 binary under qemu).
#[test]
#[cfg(target_arch = "x86_64")]
fn generation_allocates_nothing_per_token() {
    let allocs = |n: &str| {
        let out = std::process::Command::new("valgrind")
            .args([
                env!("CARGO_BIN_EXE_pinfer"),
                "generate",
                "-m",
                &tiny(),
                "-p",
                "Hello there",
                "-n",
                n,
                "--ignore-eos",
                "--temp",
                "0.7",
                "-s",
                "1",
                "-t",
                "1",
            ])
            .output()
            .expect("valgrind (scripts/setup.sh installs it)");
        let err = text_of(&out.stderr);
        let line = err.lines().find(|l| l.contains("total heap usage")).unwrap_or_else(|| panic!("{err}"));
        line.split("usage:").nth(1).unwrap().split(" allocs").next().unwrap().trim().to_string()
    };
    assert_eq!(allocs("8"), allocs("40"));
}

/// `-r TEXT` (llama-cli's reverse prompt) ends generation where the text appears, without
/// printing it, also when it arrives split over several tokens.
#[test]
fn reverse_prompts_stop_generation_unprinted() {
    let m = smollm2();
    let prompt = "The capital of France is";
    let base = ["generate", "-m", &m, "-p", prompt, "-n", "30", "--temp", "0", "--ignore-eos"];
    let full = ok(&pinfer(&base));
    // Six characters from the middle of the greedy text (whatever the kernel path made of it).
    let generated: Vec<char> = full[prompt.len()..].chars().collect();
    assert!(generated.len() > 30, "{full:?}");
    let stop: String = generated[20..26].iter().collect();
    let cut = ok(&pinfer(&[&base[..], &["-r", &stop, "-r", "never appears"]].concat()));
    let at = prompt.len() + full[prompt.len()..].find(&stop).unwrap();
    assert_eq!(cut.trim_end(), full[..at].trim_end(), "stopped before {stop:?}");
}
