//! `pinfer bench`: llama-bench-style prompt-processing and generation speed.
//!
//! Two kinds of test, each run from an empty KV cache with pseudo-random token ids (BOS first), one
//! untimed warm-up and then `-r` timed repetitions, reported as tokens per second, mean ± sample
//! standard deviation:
//!
//! - `ppN`: `N` prompt tokens in one [`Session::eval`] call (the session splits them into batches);
//! - `tgN`: `N` tokens evaluated one at a time, the loop of text generation without the sampler.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use pinfer::board::runtime::{facts, list, Facts};
use pinfer::kernels::KernelPath;
use pinfer::session::{Session, SessionOptions};
use serde_json::{json, Value as Json};

use crate::runtime::{Runtime, RuntimeArgs};
use crate::CliError;

/// Options of `pinfer bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt tokens of the prompt-processing test (0: skip it); a comma-separated list runs several.
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    pub n_prompt: Vec<usize>,
    /// Tokens of the generation test (0: skip it); a comma-separated list runs several.
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    pub n_gen: Vec<usize>,
    /// Tokens already in the cache when each test runs (llama-bench's -d: speed at depth); a
    /// comma-separated list runs every test at each depth. The cache is filled once per depth,
    /// untimed, and cut back to it before every run.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    pub n_depth: Vec<usize>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Timed repetitions of each test (after one untimed warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Output format: a Markdown table (rows printed as tests finish) or JSON.
    #[arg(short = 'o', long = "output", default_value = "md", value_parser = ["md", "json"])]
    pub output: String,
    /// Keep weight matrices in the file's layout (no repacking at load).
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    /// Also measure the machine's memory read bandwidth (a streaming read of 256 MiB on the
    /// bench's threads), so each decode figure says how close it is to the limit.
    #[arg(long = "membw")]
    pub membw: bool,
}

/// One test: prompt processing of `n_prompt` tokens or generation of `n_gen`.
#[derive(Clone, Copy)]
enum Test {
    Prompt(usize),
    Gen(usize),
}

impl Test {
    fn name(self) -> String {
        match self {
            Self::Prompt(n) => format!("pp{n}"),
            Self::Gen(n) => format!("tg{n}"),
        }
    }

    fn tokens(self) -> usize {
        match self {
            Self::Prompt(n) | Self::Gen(n) => n,
        }
    }
}

/// What the table says about the model and the setup, the same for every row.
struct Setup {
    model: String,
    model_name: Option<String>,
    size_bytes: u64,
    n_params: u64,
    kernels: KernelPath,
    repack: bool,
    threads: usize,
    n_batch: usize,
    n_ctx: usize,
    /// Weight matrices repacked at load, their bytes, and the seconds it took.
    repacked: (usize, usize, f64),
    /// Board profile id and name.
    board: (String, String),
    /// Cores the threads run on.
    cores: Vec<usize>,
    /// Governor and frequencies, read before the first test.
    facts: Facts,
    /// `" +NPU fp16"` when matmuls go to the NPU.
    npu: String,
    /// Weight bytes one decoded token reads (see [`weight_bytes_per_token`]).
    weight_bytes: u64,
    /// The measured memory read bandwidth, GB/s (`--membw`).
    membw_gbps: Option<f64>,
    /// The KV cache's types (llama-bench's `type_k`, `type_v`).
    kv_types: (String, String),
}

impl Setup {
    /// Kernels, layout and NPU; the KV cache's types when they are not f16.
    fn backend(&self) -> String {
        let repack = if self.repack { "repack" } else { "no-repack" };
        let (k, v) = &self.kv_types;
        let kv = if k == "f16" && v == "f16" { String::new() } else { format!(" kv {k}/{v}") };
        format!("CPU {} {repack}{}{kv}", self.kernels.name(), self.npu)
    }
}

/// Timed repetitions of one test at one depth.
struct Outcome {
    test: Test,
    depth: usize,
    samples_ns: Vec<u64>,
}

impl Outcome {
    /// llama-bench's name: `pp512`, `tg128 @ d4096`.
    fn name(&self) -> String {
        if self.depth == 0 {
            self.test.name()
        } else {
            format!("{} @ d{}", self.test.name(), self.depth)
        }
    }
}

impl Outcome {
    fn samples_ts(&self) -> Vec<f64> {
        let n = self.test.tokens() as f64;
        self.samples_ns.iter().map(|&ns| n * 1e9 / ns.max(1) as f64).collect()
    }
}

/// Mean and sample standard deviation (0 for fewer than two values).
fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (v.len() - 1) as f64;
    (mean, var.sqrt())
}

/// A fixed pseudo-random token sequence (xorshift64*), ids below `n_vocab`, `bos` first if given.
fn token_ids(n: usize, n_vocab: usize, bos: Option<u32>) -> Vec<u32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut ids: Vec<u32> = (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32 % n_vocab as u32
        })
        .collect();
    if let (Some(first), Some(bos)) = (ids.first_mut(), bos) {
        *first = bos;
    }
    ids
}

/// One run of `test` after the `fill` tokens of the cache (the rest dropped: a model with
/// recurrent layers, which cannot drop them, evaluates `fill` again, untimed); nanoseconds.
fn run_once(session: &mut Session, test: Test, fill: &[u32], ids: &[u32]) -> Result<u64, CliError> {
    let fail = |e: pinfer::session::SessionError| CliError::new(format!("{}: {e}", test.name()));
    let kept = session.truncate(fill.len());
    if kept < fill.len() {
        session.eval(&fill[kept..]).map_err(fail)?;
    }
    let t = Instant::now();
    match test {
        Test::Prompt(_) => {
            session.eval(ids).map_err(fail)?;
        }
        Test::Gen(_) => {
            for &id in ids {
                session.eval(&[id]).map_err(fail)?;
            }
        }
    }
    Ok(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

fn human_size(bytes: u64) -> String {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

fn human_params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

/// Columns of the Markdown table: header, width, right-aligned.
const COLUMNS: [(&str, usize, bool); 8] = [
    ("model", 32, false),
    ("size", 10, true),
    ("params", 10, true),
    ("backend", 20, false),
    ("threads", 7, true),
    ("test", 14, true),
    ("t/s", 20, true),
    ("weights GB/s", 12, true),
];

fn md_row(cells: &[String]) -> String {
    let mut line = String::from("|");
    for ((_, width, right), cell) in COLUMNS.iter().zip(cells) {
        if *right {
            line.push_str(&format!(" {cell:>width$} |"));
        } else {
            line.push_str(&format!(" {cell:<width$} |"));
        }
    }
    line
}

fn md_header() -> String {
    let names: Vec<String> = COLUMNS.iter().map(|(name, _, _)| name.to_string()).collect();
    let mut rule = String::from("|");
    for (_, width, right) in COLUMNS {
        let dashes = "-".repeat(if right { width - 1 } else { width });
        rule.push_str(&format!(" {dashes}{} |", if right { ":" } else { "" }));
    }
    format!("{}\n{rule}", md_row(&names))
}

fn md_line(setup: &Setup, o: &Outcome) -> String {
    let (mean, std) = mean_std(&o.samples_ts());
    md_row(&[
        setup.model.clone(),
        human_size(setup.size_bytes),
        human_params(setup.n_params),
        setup.backend(),
        setup.threads.to_string(),
        o.name(),
        format!("{mean:.2} ± {std:.2}"),
        match o.test {
            Test::Gen(_) => format!("{:.2}", decode_gbps(setup, mean)),
            Test::Prompt(_) => "-".into(),
        },
    ])
}

/// The weight bytes a decode at `tokens_per_s` streams per second, in GB/s.
fn decode_gbps(setup: &Setup, tokens_per_s: f64) -> f64 {
    setup.weight_bytes as f64 * tokens_per_s / 1e9
}

/// The weight bytes one decoded token reads where the session keeps them: every matrix a
/// matmul reads (its repacked copy, or the file's bytes), the used share of MoE experts; an
/// embedding table read by `get_rows` alone counts nothing (one row per token).
fn weight_bytes_per_token(session: &Session) -> u64 {
    use pinfer::placement::Reason;
    let hp = session.hparams();
    let expert_share =
        if hp.n_expert > 0 { f64::from(hp.n_expert_used) / f64::from(hp.n_expert) } else { 1.0 };
    let bytes: f64 = session
        .placements()
        .map(|(_, p)| match p.reason {
            Reason::Unused | Reason::Embedding => 0.0,
            Reason::Experts => p.bytes as f64 * expert_share,
            Reason::Repacked
            | Reason::TiedEmbedding
            | Reason::SharedEmbedding
            | Reason::Norm
            | Reason::Bias
            | Reason::Router
            | Reason::NoLayout(_)
            | Reason::Shape { .. }
            | Reason::RepackOff
            | Reason::ReadInPlace => p.bytes as f64,
        })
        .sum();
    bytes as u64
}

/// Streaming-read bandwidth of this machine in GB/s: the best of 5 reads of a 256 MiB buffer
/// (far past any cache) split over `threads` threads, each summing its share.
fn measure_membw(threads: usize) -> f64 {
    const BYTES: usize = 256 << 20;
    let buffer: Vec<u64> = (0..BYTES / 8).map(|i| i as u64 ^ 0x9e37_79b9_7f4a_7c15).collect();
    let threads = threads.max(1);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let total: u64 = std::thread::scope(|scope| {
            let handles: Vec<_> = buffer
                .chunks(buffer.len().div_ceil(threads))
                .map(|part| {
                    scope.spawn(move || {
                        // Eight independent sums keep the loads in flight.
                        let mut acc = [0u64; 8];
                        for block in part.chunks_exact(8) {
                            for (a, v) in acc.iter_mut().zip(block) {
                                *a = a.wrapping_add(*v);
                            }
                        }
                        acc.iter().fold(0u64, |s, v| s.wrapping_add(*v))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max(BYTES as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn json_row(setup: &Setup, o: &Outcome) -> Json {
    let ts = o.samples_ts();
    let (avg_ts, stddev_ts) = mean_std(&ts);
    let ns: Vec<f64> = o.samples_ns.iter().map(|&v| v as f64).collect();
    let (avg_ns, stddev_ns) = mean_std(&ns);
    let (n_prompt, n_gen) = match o.test {
        Test::Prompt(n) => (n, 0),
        Test::Gen(n) => (0, n),
    };
    json!({
        "model": setup.model,
        "model_name": setup.model_name,
        "size": human_size(setup.size_bytes),
        "model_size": setup.size_bytes,
        "params": human_params(setup.n_params),
        "model_n_params": setup.n_params,
        "backend": setup.backend(),
        "kernels": setup.kernels.name(),
        "repack": setup.repack,
        "threads": setup.threads,
        "n_batch": setup.n_batch,
        "n_ctx": setup.n_ctx,
        "type_k": setup.kv_types.0,
        "type_v": setup.kv_types.1,
        "repacked_matrices": setup.repacked.0,
        "repacked_bytes": setup.repacked.1,
        "weight_bytes_per_token": setup.weight_bytes,
        "decode_gbps": match o.test {
            Test::Gen(_) => Some(decode_gbps(setup, avg_ts)),
            Test::Prompt(_) => None,
        },
        "membw_gbps": setup.membw_gbps,
        "repack_ms": setup.repacked.2 * 1e3,
        "board": setup.board.0,
        "board_name": setup.board.1,
        "cores": setup.cores,
        "cpu_governor": setup.facts.governor,
        "cpu_freq_mhz": setup.facts.cpu_mhz,
        "cpu_max_freq_mhz": setup.facts.cpu_max_mhz,
        "ddr_freq_mhz": setup.facts.ddr_mhz,
        "ddr_governor": setup.facts.ddr_governor,
        "test": o.name(),
        "n_depth": o.depth,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "reps": o.samples_ns.len(),
        "t/s": format!("{avg_ts:.2} ± {stddev_ts:.2}"),
        "avg_ts": avg_ts,
        "stddev_ts": stddev_ts,
        "avg_ns": avg_ns.round() as u64,
        "stddev_ns": stddev_ns.round() as u64,
        "samples_ns": o.samples_ns,
        "samples_ts": ts,
        "build": pinfer::VERSION,
    })
}

/// Runs the benchmark.
pub fn run(args: BenchArgs) -> Result<(), CliError> {
    if args.reps == 0 {
        return Err(CliError::new("-r must be at least 1".into()));
    }
    let tests: Vec<Test> = args
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Test::Prompt(n))
        .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| Test::Gen(n)))
        .collect();
    if tests.is_empty() {
        return Err(CliError::new("nothing to measure: -p and -n are both 0".into()));
    }
    let path = crate::model_path(args.model)?;
    // Every test starts from the cache cut back to its depth; like llama-bench, the context holds
    // the depth, a prompt and a generation run one after the other.
    let max_p = args.n_prompt.iter().copied().max().unwrap_or(0);
    let max_n = args.n_gen.iter().copied().max().unwrap_or(0);
    let max_d = args.n_depth.iter().copied().max().unwrap_or(0);
    let n_ctx = max_d + max_p + max_n;

    let runtime = Runtime::new(&args.runtime)?;
    let mut opts = SessionOptions { n_ctx, ..Default::default() };
    opts.repack &= !args.no_repack; // the runtime also honours PINFER_NO_REPACK
    let mut session = runtime.load(&path, opts.clone(), 0).map_err(|e| match e {
        CliError::Message(m) => CliError::new(format!("{m} (context of {n_ctx} tokens for -d, -p and -n)")),
        other => other,
    })?;
    let cores = runtime.cores(&session);
    let tok = crate::tokenize::tokenizer(&path, session.gguf())?;
    let bos = tok.bos();
    let (size_bytes, n_params) =
        session.gguf().tensors().fold((0u64, 0u64), |(b, e), t| (b + t.nbytes, e + t.n_elements()));
    let model_name = session.gguf().get_str_opt("general.name").ok().flatten().map(str::to_string);
    let setup = Setup {
        model: file_name(&path),
        model_name,
        size_bytes,
        n_params,
        kernels: session.kernels(),
        repack: opts.repack,
        threads: session.threads(),
        n_batch: opts.n_batch.min(session.n_ctx()),
        n_ctx: session.n_ctx(),
        repacked: session.repacked(),
        board: (runtime.board.profile.id.to_string(), runtime.board.profile.name.to_string()),
        facts: facts(Path::new("/"), &cores),
        cores,
        npu: crate::npu::backend_suffix(&session),
        weight_bytes: weight_bytes_per_token(&session),
        membw_gbps: args.membw.then(|| measure_membw(session.threads())),
        kv_types: {
            let (t, name) = (session.kv_types(), |ty: pinfer::quant::GgmlType| {
                pinfer::quant::Lowercase(ty.name()).to_string()
            });
            (name(t.k), name(t.v))
        },
    };

    let markdown = args.output == "md";
    if markdown {
        outln!("{}", md_header())?;
    }
    let mut rows = Vec::new();
    for &depth in &args.n_depth {
        // The depth's tokens, evaluated once (untimed) in batches; every run keeps them.
        let fill = token_ids(depth, session.n_vocab(), bos);
        let _ = session.truncate(0);
        session.eval(&fill).map_err(|e| CliError::new(format!("filling the cache to depth {depth}: {e}")))?;
        for &test in &tests {
            let mut ids = token_ids(test.tokens() + 1, session.n_vocab(), None);
            // (A test at depth 0 starts with BOS, one at depth continues the text.)
            let ids =
                if depth == 0 { token_ids(test.tokens(), session.n_vocab(), bos) } else { ids.split_off(1) };
            run_once(&mut session, test, &fill, &ids)?; // warm-up: caches, page faults, lazily built graphs
            let mut samples_ns = Vec::with_capacity(args.reps);
            for _ in 0..args.reps {
                samples_ns.push(run_once(&mut session, test, &fill, &ids)?);
            }
            let outcome = Outcome { test, depth, samples_ns };
            if markdown {
                outln!("{}", md_line(&setup, &outcome))?;
            } else {
                rows.push(json_row(&setup, &outcome));
            }
        }
    }
    if markdown {
        outln!()?;
        outln!("build: pinfer {}, n_batch {}, n_ctx {}", pinfer::VERSION, setup.n_batch, setup.n_ctx)?;
        let mib = setup.weight_bytes as f64 / (1 << 20) as f64;
        match setup.membw_gbps {
            Some(bw) => outln!(
                "decode reads {mib:.1} MiB of weights per token; memory read bandwidth {bw:.2} GB/s \
                 (--membw: 256 MiB streamed on {} threads)",
                setup.threads
            )?,
            None => outln!(
                "decode reads {mib:.1} MiB of weights per token (--membw measures the machine's bandwidth)"
            )?,
        }
        let f = &setup.facts;
        outln!(
            "board: {} ({}), cores {}, cpu governor {}, cpu {}{}, ddr {}",
            setup.board.1,
            setup.board.0,
            list(&setup.cores),
            f.governor.as_deref().unwrap_or("-"),
            f.cpu_freq_text(),
            f.cpu_max_mhz.map_or(String::new(), |m| format!(" (max {m} MHz)")),
            f.ddr_mhz.map_or("-".to_string(), |m| format!(
                "{m} MHz ({})",
                f.ddr_governor.as_deref().unwrap_or("-")
            ))
        )?;
    } else {
        outln!("{}", serde_json::to_string_pretty(&Json::Array(rows)).unwrap_or_default())?;
    }
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}
