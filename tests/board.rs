//! The board runtime through the CLI (host tier): workers follow the inherited affinity mask,
//! `--cores` outside it is refused, generation under SCHED_FIFO matches the golden tokens, the
//! placement plan lists every tensor, the numerics check names the op and layer of a NaN, memory
//! limits and locks explain themselves, and `bench` records the board.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long any one pinfer run may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(300);

/// `prefix` (e.g. `taskset -c 1`, empty for none) then pinfer (through qemu when needed) with
/// `args`; killed and failed after [`DEADLINE`].
fn run(prefix: &[&str], args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_pinfer");
    let mut argv: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
    if let Some(cpu) = through_qemu() {
        argv.extend(["qemu-aarch64".to_string(), "-cpu".to_string(), cpu.to_string()]);
    }
    argv.push(exe.to_string());
    argv.extend(args.iter().map(|s| s.to_string()));
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {argv:?}: {e}"));
    // Drain both pipes while waiting, so a large output cannot block the child.
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            buf
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            let err = stderr.join().unwrap();
            panic!("{argv:?} did not finish in {DEADLINE:?} (a hang?); stderr: {}", text(&err));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}

/// Under qemu-user (the cross tier) the host cannot exec the aarch64 binary: start it through
/// qemu with the CPU of `PINFER_QEMU_CPU` (as tests/cli.rs does).
fn through_qemu() -> Option<&'static str> {
    static MODE: OnceLock<Option<String>> = OnceLock::new();
    MODE.get_or_init(|| {
        let direct = Command::new(env!("CARGO_BIN_EXE_pinfer")).arg("--version").output();
        let cannot_exec = match direct {
            Ok(out) => out.status.code() == Some(127) && out.stdout.is_empty(),
            Err(e) => e.raw_os_error() == Some(8),
        };
        cannot_exec.then(|| std::env::var("PINFER_QEMU_CPU").unwrap_or_else(|_| "cortex-a76".into()))
    })
    .as_deref()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn repo_file(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    assert!(path.exists(), "{} missing: run scripts/setup.sh", path.display());
    path.to_str().unwrap().to_string()
}

fn tool_works(argv: &[&str]) -> bool {
    Command::new(argv[0]).args(&argv[1..]).output().is_ok_and(|o| o.status.success())
}

/// Cores this test process may use.
fn allowed() -> Vec<usize> {
    pinfer::board::thread::allowed_cores()
}

/// The `workers: N on cores A,B` line of `generate -v`, parsed.
fn workers(out: &Output) -> (usize, Vec<usize>) {
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    let line = stderr.lines().find_map(|l| l.split_once("workers: ").map(|(_, rest)| rest.to_string()));
    let line = line.unwrap_or_else(|| panic!("no workers line: {stderr}"));
    let (n, cores) = line.split_once(" on cores ").unwrap_or_else(|| panic!("{line}"));
    let cores: Vec<usize> = cores.split(',').map(|c| c.trim().parse().unwrap()).collect();
    (n.parse().unwrap(), cores)
}

fn tiny() -> String {
    repo_file("models/tiny/qwen3-tiny.gguf")
}

/// The first golden case of qwen3-tiny: prompt and its greedy token ids up to the first near-tie
/// (margin below 0.05, where either token may legitimately win; ARM sums differ from x86 there).
fn golden() -> (String, String) {
    let golden = std::fs::read_to_string(repo_file("tests/golden/qwen3-tiny.greedy.jsonl")).unwrap();
    let case: serde_json::Value = serde_json::from_str(golden.lines().next().unwrap()).unwrap();
    let margins = case["margins"].as_array().unwrap();
    let n = margins.iter().position(|m| m.as_f64().unwrap() < 0.05).unwrap_or(8).clamp(1, 8);
    let ids: Vec<String> =
        case["generated_ids"].as_array().unwrap().iter().take(n).map(|v| v.to_string()).collect();
    (case["prompt"].as_str().unwrap().to_string(), ids.join(" "))
}

fn generate_args<'a>(model: &'a str, prompt: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["generate", "-m", model, "-p", prompt, "-n", "8", "--temp", "0", "--print-ids", "-v"];
    args.extend_from_slice(extra);
    args
}

fn assert_golden(out: &Output, want: &str, what: &str) {
    assert!(out.status.success(), "{what}: stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let got = stdout.lines().last().unwrap().trim();
    assert!(
        got == want || got.starts_with(&format!("{want} ")),
        "{what}: ids {got:?} do not start with {want:?}; stdout: {stdout}"
    );
}

#[test]
fn the_workers_follow_the_taskset_mask_exactly() {
    let cores = allowed();
    if !tool_works(&["taskset", "-c", "0", "true"]) || !cores.contains(&0) || !cores.contains(&1) {
        eprintln!("skipped: needs taskset and cores 0 and 1 in the affinity mask (have {cores:?})");
        return;
    }
    let model = tiny();
    let args = ["generate", "-m", &model, "-p", "Hello", "-n", "2", "--temp", "0", "-v"];
    assert_eq!(workers(&run(&["taskset", "-c", "1"], &args)), (1, vec![1]));
    assert_eq!(workers(&run(&["taskset", "-c", "0-1"], &args)), (2, vec![0, 1]));
    // -t picks fewer; --cores picks exactly those.
    assert_eq!(workers(&run(&["taskset", "-c", "0-1"], &[&args[..], &["-t", "1"]].concat())), (1, vec![0]));
    assert_eq!(
        workers(&run(&["taskset", "-c", "0-1"], &[&args[..], &["--cores", "1"]].concat())),
        (1, vec![1])
    );

    // --cores outside the mask is an error that names the mask.
    let out = run(&["taskset", "-c", "0"], &[&args[..], &["--cores", "1"]].concat());
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("--cores 1: core 1 is outside") && err.contains("mask (0)"), "{err}");
    let out = run(&[], &[&args[..], &["--cores", "4-x"]].concat());
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--cores 4-x"), "{}", text(&out.stderr));
}

/// `chrt -f 10 taskset -c 0-1 pinfer generate` completes with the golden tokens, also with `-t 4`
/// (one worker per allowed core, with a note) and with `--rt-priority` instead of chrt.
#[test]
fn generation_under_sched_fifo_matches_the_golden_tokens() {
    let cores = allowed();
    if !cores.contains(&0) || !cores.contains(&1) || !tool_works(&["taskset", "-c", "0", "true"]) {
        eprintln!("skipped: needs taskset and cores 0 and 1 in the affinity mask (have {cores:?})");
        return;
    }
    if !tool_works(&["chrt", "-f", "10", "true"]) {
        eprintln!(
            "skipped: `chrt -f 10` is not permitted here (needs root or CAP_SYS_NICE, and a real-time budget \
             in this cgroup); the SCHED_FIFO path is covered by the pool's own tests only"
        );
        return;
    }
    let (prompt, want) = golden();
    let model = tiny();
    let fifo = ["chrt", "-f", "10", "taskset", "-c", "0-1"];
    let out = run(&fifo, &generate_args(&model, &prompt, &[]));
    assert_golden(&out, &want, "chrt -f 10");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("SCHED_FIFO priority 10 (inherited)"), "{stderr}");
    assert_eq!(workers(&out), (2, vec![0, 1]));

    let out = run(&fifo, &generate_args(&model, &prompt, &["-t", "4"]));
    assert_golden(&out, &want, "chrt -f 10, -t 4");
    assert!(text(&out.stderr).contains("-t 4: only 2 cores allowed"), "{}", text(&out.stderr));
    assert_eq!(workers(&out).0, 2);

    let out = run(&["taskset", "-c", "0-1"], &generate_args(&model, &prompt, &["--rt-priority", "10"]));
    assert_golden(&out, &want, "--rt-priority 10");
    assert!(text(&out.stderr).contains("SCHED_FIFO priority 10 (--rt-priority)"), "{}", text(&out.stderr));
}

/// Without the privilege, `--rt-priority` and `--mlock` are clear errors saying what to change.
#[test]
fn rt_priority_and_mlock_explain_a_missing_privilege() {
    let model = tiny();
    let (prompt, want) = golden();
    // Allowed (root here): --mlock locks, and says how much.
    let out = run(&[], &generate_args(&model, &prompt, &["--mlock"]));
    if out.status.success() {
        assert_golden(&out, &want, "--mlock");
        assert!(text(&out.stderr).contains("mlock: "), "{}", text(&out.stderr));
    } else {
        assert!(text(&out.stderr).contains("RLIMIT_MEMLOCK"), "{}", text(&out.stderr));
    }
    // As nobody with a tiny memlock limit: the errors.
    let nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];
    if !tool_works(&[&nobody[..], &["true"]].concat()) || through_qemu().is_some() {
        eprintln!("skipped the unprivileged half: setpriv cannot switch to nobody here");
        return;
    }
    let out = run(
        &[&nobody[..], &["prlimit", "--memlock=65536"]].concat(),
        &generate_args(&model, &prompt, &["--mlock"]),
    );
    let err = text(&out.stderr);
    if out.status.code() == Some(1) && err.contains("Permission denied") {
        eprintln!("skipped the unprivileged half: nobody cannot read the binary or the model here");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--mlock: cannot lock") && err.contains("LimitMEMLOCK=infinity"), "{err}");
    let out = run(&nobody, &generate_args(&model, &prompt, &["--rt-priority", "5"]));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("SCHED_FIFO at priority 5: permission denied") && err.contains("cap_sys_nice"),
        "{err}"
    );
}

/// The placement plan lists every tensor once; norms and biases stay mapped; the totals add up.
#[test]
fn info_placement_lists_every_tensor_of_the_default_model_and_gemma() {
    for (model, embedding_layout) in
        [("models/SmolLM2-135M-Instruct.Q4_1.gguf", "q8x4"), ("models/gemma-3-270m-q4_k_m.gguf", "q8x4")]
    {
        let model = repo_file(model);
        let out = run(&[], &["info", "-m", &model, "--json", "--tensors", "--placement"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> =
            report["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
        let placed = report["placement"]["tensors"].as_array().unwrap();
        let placed_names: Vec<&str> = placed.iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert_eq!(placed_names, names, "{model}: every tensor, in file order");
        let (mut repacked, mut mapped) = (0u64, 0u64);
        for t in placed {
            let (name, buffer) = (t["name"].as_str().unwrap(), t["buffer"].as_str().unwrap());
            let reason = t["reason"].as_str().unwrap();
            assert!(!reason.is_empty(), "{t}");
            if name.contains("norm") || name.ends_with(".bias") {
                assert_eq!(buffer, "mapped", "{model}: {t}");
            }
            if name.starts_with("blk.") && name.ends_with("attn_q.weight") {
                assert_eq!(buffer, "repacked", "{model}: {t}");
            }
            if name == "token_embd.weight" {
                assert_eq!(t["layout"], embedding_layout, "{t}");
                assert!(reason.contains("tied embedding"), "{t}");
            }
            match buffer {
                "repacked" => repacked += t["bytes"].as_u64().unwrap(),
                "mapped" => mapped += t["bytes"].as_u64().unwrap(),
                other => panic!("{model}: nothing goes to {other} yet: {t}"),
            }
        }
        let buffers = &report["placement"]["buffers"];
        assert_eq!(buffers["repacked"]["bytes"].as_u64(), Some(repacked), "{buffers}");
        assert_eq!(buffers["mapped"]["bytes"].as_u64(), Some(mapped), "{buffers}");
        assert_eq!(buffers["npu"]["tensors"].as_u64(), Some(0), "{buffers}");

        // The text form: one line per tensor plus the buffer totals, NPU listed as not planned.
        let out = run(&[], &["info", "-m", &model, "--placement"]);
        let stdout = text(&out.stdout);
        for name in &names {
            assert!(
                stdout.lines().any(|l| l.split_whitespace().next() == Some(*name)),
                "{model}: {name} missing"
            );
        }
        let totals =
            stdout.lines().find(|l| l.starts_with("buffers: ")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(
            totals.contains("repacked ")
                && totals.contains("mapped ")
                && totals.contains("nothing is planned"),
            "{totals}"
        );
    }
}

/// A NaN in one weight: `--check-numerics` stops at the op that made it and names op, layer and
/// tensor. (Here the logits stay finite without the check: the int8 activation quantization of the
/// next matmul turns the NaN into a zero, which is why the per-op check exists.)
#[test]
fn check_numerics_names_the_op_and_layer_of_a_nan() {
    let original = std::fs::read(tiny()).unwrap();
    let poisoned = |tensor: &str, whole: bool| -> PathBuf {
        let mut bytes = original.clone();
        let (start, len) = {
            let g = pinfer::gguf::Gguf::parse(&original).unwrap();
            let t = g.tensor(tensor).unwrap();
            (g.data_start() + t.offset as usize, t.nbytes as usize)
        };
        if whole {
            // F32: every value NaN.
            for v in bytes[start..start + len].chunks_mut(4) {
                v.copy_from_slice(&f32::NAN.to_le_bytes());
            }
        } else {
            // Q4_0/Q8_0: the first block's f16 scale becomes NaN.
            bytes[start..start + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
        }
        let dir = std::env::temp_dir().join(format!("pinfer-board-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{tensor}.gguf"));
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let model = poisoned("blk.2.ffn_up.weight", false);
    let model = model.to_str().unwrap();
    for threads in ["1", "2"] {
        let out =
            run(&[], &["generate", "-m", model, "-p", "Hello", "-n", "4", "--check-numerics", "-t", threads]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("non-finite value (NaN) in ffn_up, layer 2")
                && err.contains("op mul_mat, input blk.2.ffn_up.weight")
                && err.contains("tensor ffn_up-2"),
            "-t {threads}: {err}"
        );
    }

    // A NaN in the output matrix reaches the logits: always an error, pointing at --check-numerics.
    let model = poisoned("output.weight", false);
    let model = model.to_str().unwrap();
    let out = run(&[], &["generate", "-m", model, "-p", "Hello", "-n", "4"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("non-finite logits") && err.contains("--check-numerics"), "{err}");
    let out = run(&[], &["generate", "-m", model, "-p", "Hello", "-n", "4", "--check-numerics"]);
    let err = text(&out.stderr);
    assert!(err.contains("non-finite value (NaN) in logits (op mul_mat, input output.weight"), "{err}");
    // Whole NaN norm weights: the check names the norm's multiply, outside any layer.
    let model = poisoned("output_norm.weight", true);
    let out =
        run(&[], &["generate", "-m", model.to_str().unwrap(), "-p", "Hello", "-n", "4", "--check-numerics"]);
    let err = text(&out.stderr);
    assert!(err.contains("non-finite value (NaN) in result_norm (op mul, input output_norm.weight"), "{err}");
}

#[test]
fn the_memory_plan_is_printed_and_a_load_over_the_limit_is_refused() {
    let model = tiny();
    let out = run(&[], &["generate", "-m", &model, "-p", "Hello", "-n", "1", "-v"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let plan = stderr.lines().find(|l| l.contains("memory plan: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(plan.contains("repacked weights") && plan.contains("KV cache"), "{plan}");
    // Printed before the first token: the plan comes before the prompt's timing.
    assert!(stderr.find("memory plan").unwrap() < stderr.find("prompt eval time").unwrap());
    let out = run(&[], &["generate", "-m", &model, "-p", "Hello", "-n", "1", "--mem-limit", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("not loading: the memory plan needs") && err.contains("--mem-limit"), "{err}");
}

#[test]
fn bench_records_the_board_in_markdown_and_json() {
    let model = tiny();
    let args = ["bench", "-m", &model, "-p", "8", "-n", "2", "-r", "1", "-t", "1"];
    let out = run(&[], &[&args[..], &["-o", "json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for row in rows.as_array().unwrap() {
        assert!(row["board"].as_str().is_some_and(|b| !b.is_empty()), "{row}");
        assert_eq!(row["cores"].as_array().unwrap().len(), 1, "{row}");
        for key in ["cpu_governor", "cpu_freq_mhz", "ddr_freq_mhz", "ddr_governor"] {
            assert!(row.get(key).is_some(), "{key}: {row}");
        }
    }
    let out = run(&[], &[&args[..], &["-o", "md"]].concat());
    let stdout = text(&out.stdout);
    let board = stdout.lines().find(|l| l.starts_with("board: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(board.contains("cores ") && board.contains("cpu governor") && board.contains("ddr "), "{board}");
}

#[test]
fn boards_lists_every_profile_and_the_detected_board() {
    let out = run(&[], &["boards"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for id in pinfer::board::profile_names() {
        assert!(stdout.lines().any(|l| l.starts_with(id)), "{id}: {stdout}");
    }
    assert!(stdout.contains("this machine: ") && stdout.contains("workers: "), "{stdout}");
    let out = run(&[], &["generate", "-m", &tiny(), "-p", "Hi", "--board", "no-such-board"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("unknown board 'no-such-board'"), "{}", text(&out.stderr));
}

/// The library path the CLI never takes: four threads on two cores, SCHED_FIFO. The pool does not
/// spin then (its waits sleep at once), finishes, and computes the same logits as one thread.
#[test]
fn an_oversubscribed_pool_under_fifo_finishes_with_the_same_logits() {
    use pinfer::loader::ModelFile;
    use pinfer::session::{Session, SessionError, SessionOptions};
    let model = ModelFile::open_static(Path::new(&tiny())).unwrap();
    let cores: Vec<usize> = allowed().into_iter().take(2).collect();
    let tokens = [1u32, 300, 301, 302, 303];
    let reference = {
        let mut s =
            Session::new(model, &SessionOptions { threads: 1, n_ctx: 64, ..Default::default() }).unwrap();
        s.eval(&tokens).unwrap().to_vec()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut opts = SessionOptions {
            threads: 4,
            cores: Some(cores),
            pin: true,
            rt_priority: Some(10),
            n_ctx: 64,
            ..Default::default()
        };
        let mut s = match Session::new(model, &opts) {
            Err(SessionError::Threads(e)) => {
                eprintln!("SCHED_FIFO not permitted ({e}); checking the oversubscribed pool without it");
                opts.rt_priority = None;
                Session::new(model, &opts).unwrap()
            }
            other => other.unwrap(),
        };
        assert!(!s.spinning(), "4 threads on at most 2 cores must not spin");
        let mut logits = Vec::new();
        for _ in 0..3 {
            let _ = s.truncate(0);
            logits = s.eval(&tokens).unwrap().to_vec();
        }
        tx.send(logits).unwrap();
    });
    let logits = rx.recv_timeout(DEADLINE).expect("the oversubscribed FIFO pool hung");
    assert_eq!(logits, reference);
}
