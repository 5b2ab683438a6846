//! The NPU on the command line: the `--npu` flags of generate/bench, `pinfer npu-plan` and
//! `pinfer selftest --npu`. Without the `npu` feature the flags exist but only accept `off`.

use std::path::PathBuf;

use clap::Args;
use pinfer::session::SessionOptions;

use crate::CliError;

/// Smallest batch sent to the NPU by default (`pinfer::npu::DEFAULT_MIN_BATCH`).
const DEFAULT_MIN_BATCH: usize = 16;
#[cfg(feature = "npu")]
const _: () = assert!(DEFAULT_MIN_BATCH == pinfer::npu::DEFAULT_MIN_BATCH);

/// The NPU options shared by the commands that evaluate a model.
#[derive(Args, Debug, Clone, Default)]
pub struct NpuArgs {
    /// Offload matmuls to the RK3588 NPU: off, auto (every aligned matmul) or a whitelist JSON file
    /// (llama.cpp RKNN format). Default: auto when the NPU runtime (librknnrt.so) is installed,
    /// else off. A bare --npu means auto.
    #[arg(long = "npu", value_name = "off|auto|FILE.json", num_args = 0..=1, default_missing_value = "auto")]
    pub npu: Option<String>,
    /// Smallest batch (tokens) sent to the NPU; smaller ones, like single-token decode, stay on the
    /// CPU (1: everything goes).
    #[arg(long = "npu-min-batch", value_name = "N", default_value_t = DEFAULT_MIN_BATCH)]
    pub min_batch: usize,
    /// NPU arithmetic: fp16 (default), or int8 with per-row weight scales and per-token input
    /// scales applied on the CPU.
    #[arg(long = "npu-precision", value_name = "fp16|int8", default_value = "fp16")]
    pub precision: String,
}

impl NpuArgs {
    /// The NPU choice for a board with `npu_cores` NPU cores (from its profile; 0: none). Without
    /// `--npu`: auto on boards with an NPU, silently off when its runtime is not installed; off
    /// elsewhere. Reads and checks a whitelist file now, before anything loads.
    pub fn resolve(&self, npu_cores: u32) -> Result<NpuChoice, CliError> {
        #[cfg(feature = "npu")]
        {
            let mut config = self.config()?;
            if self.npu.is_none() && npu_cores == 0 {
                config.mode = pinfer::npu::NpuMode::Off;
            }
            if npu_cores > 0 {
                config.cores = npu_cores as usize;
            }
            Ok(NpuChoice { config })
        }
        #[cfg(not(feature = "npu"))]
        {
            let _ = npu_cores;
            match self.npu.as_deref() {
                None | Some("off") => Ok(NpuChoice {}),
                Some(_) => Err(CliError::new(
                    "this pinfer was built without NPU support (cargo feature `npu`)".into(),
                )),
            }
        }
    }

    /// The NPU configuration these flags describe (an absent `--npu` is a quiet auto).
    #[cfg(feature = "npu")]
    pub fn config(&self) -> Result<pinfer::npu::NpuConfig, CliError> {
        use pinfer::npu::{NpuConfig, NpuMode, Precision};
        let (mode, quiet) = match self.npu.as_deref() {
            None => (NpuMode::Auto, true),
            Some(text) => (NpuMode::parse(text).map_err(CliError::new)?, false),
        };
        if self.min_batch == 0 {
            return Err(CliError::new("--npu-min-batch must be at least 1".into()));
        }
        let precision = Precision::parse(&self.precision).map_err(CliError::new)?;
        Ok(NpuConfig {
            mode,
            precision,
            min_batch: self.min_batch,
            quiet_if_missing: quiet,
            ..NpuConfig::default()
        })
    }
}

/// What [`NpuArgs::resolve`] decided, ready to go into session options.
#[derive(Debug, Clone, Default)]
pub struct NpuChoice {
    #[cfg(feature = "npu")]
    config: pinfer::npu::NpuConfig,
}

impl NpuChoice {
    /// Puts the choice into session options.
    pub fn apply(&self, opts: &mut SessionOptions) {
        #[cfg(feature = "npu")]
        {
            opts.npu = self.config.clone();
        }
        #[cfg(not(feature = "npu"))]
        let _ = opts;
    }
}

/// The backend column of `pinfer bench`: `+NPU fp16` when matmuls go to the NPU.
pub fn backend_suffix(session: &pinfer::session::Session) -> String {
    #[cfg(feature = "npu")]
    if let Some(npu) = session.npu() {
        return format!(" +NPU {}", npu.plan().precision.name());
    }
    let _ = session;
    String::new()
}

/// Options of `pinfer npu-plan`.
#[derive(Args, Debug)]
pub struct NpuPlanArgs {
    /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub npu: NpuArgs,
    /// Prompt batch size the plan is for (as generate's).
    #[arg(short = 'b', long = "batch-size", default_value_t = 64)]
    pub n_batch: usize,
    /// Also plan for scoring every token (perplexity): the output matmul then gets batches too.
    #[arg(long = "logits-all")]
    pub logits_all: bool,
    /// Write the whitelist (JSON, llama.cpp RKNN format) to this file.
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Print the whitelist JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Options of `pinfer selftest`.
#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// Model file (GGUF) whose matmul shapes are tested. Default: the model fetched by scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub npu: NpuArgs,
    /// Largest batch tested (the NPU's contexts are made for batches up to this).
    #[arg(short = 'b', long = "batch-size", default_value_t = 64)]
    pub n_batch: usize,
    /// Timed calls per shape and batch.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
}

#[cfg(not(feature = "npu"))]
pub fn plan(_args: NpuPlanArgs) -> Result<(), CliError> {
    Err(CliError::new("this pinfer was built without NPU support (cargo feature `npu`)".into()))
}

#[cfg(not(feature = "npu"))]
pub fn selftest(_args: SelftestArgs) -> Result<(), CliError> {
    Err(CliError::new("this pinfer was built without NPU support (cargo feature `npu`)".into()))
}

/// `pinfer npu-plan`: which matmuls go to the NPU, and the extra memory.
#[cfg(feature = "npu")]
pub fn plan(args: NpuPlanArgs) -> Result<(), CliError> {
    use pinfer::loader::ModelFile;
    let path = crate::model_path(args.model)?;
    let model = ModelFile::open(&path)?;
    // Parsed here for the error that names the file; the plan parses the bytes itself.
    model.parse()?;
    let mut config = args.npu.config()?;
    if config.mode == pinfer::npu::NpuMode::Off {
        // Planning "off" would list nothing: show what auto would do.
        config.mode = pinfer::npu::NpuMode::Auto;
    }
    let plan = pinfer::npu::plan_model(model.bytes(), &config, args.n_batch, 0, args.logits_all)
        .map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let json = plan.whitelist().to_json();
    if let Some(out) = &args.output {
        // Through OutputFile: never over the model, a device or a link's missing target.
        let mut file = pinfer::output_file::OutputFile::create(out, &[&path])?;
        std::io::Write::write_all(&mut file.file(), json.as_bytes())
            .map_err(|e| CliError::new(format!("writing {}: {e}", out.display())))?;
        file.commit()?;
    }
    if args.json {
        out!("{json}")?;
    } else {
        out!("{plan}")?;
        if let Some(out) = &args.output {
            outln!("whitelist written to {}", out.display())?;
        }
    }
    Ok(())
}

/// `pinfer selftest --npu`: every planned shape on the NPU against the exact product on the CPU.
#[cfg(feature = "npu")]
pub fn selftest(args: SelftestArgs) -> Result<(), CliError> {
    use pinfer::exec::MatmulOffload;
    use pinfer::loader::ModelFile;
    use pinfer::npu::{dequantize_rows, Comparison, NpuBackend, NpuMode};
    use std::time::Instant;

    if args.npu.npu.is_none() {
        return Err(CliError::new("nothing to test: pass --npu (auto, or a whitelist file)".into()));
    }
    let path = crate::model_path(args.model)?;
    let model = ModelFile::open(&path)?;
    // Parsed here for the error that names the file; the plan parses the bytes itself.
    model.parse()?;
    let config = args.npu.config()?;
    if config.mode == NpuMode::Off {
        return Err(CliError::new("--npu off: nothing to test".into()));
    }
    let plan = pinfer::npu::plan_model(model.bytes(), &config, args.n_batch, 0, false)
        .map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let backend = NpuBackend::new(model.bytes(), &plan, &config).map_err(|e| CliError::new(e.message()))?;
    outln!(
        "NPU selftest: {} ({} precision, {} shapes, runtime {})",
        path.display(),
        config.precision.name(),
        plan.shapes().len(),
        backend.library().display()
    )?;
    outln!(
        "{:>6} {:>6} {:>4}  {:>10} {:>10} {:>9}  {:>10} {:>8}  result",
        "K",
        "N",
        "M",
        "max abs",
        "max rel",
        "err/bound",
        "us/call",
        "GFLOP/s"
    )?;
    // Twice the rounding bound: the hardware may sum in another order than the emulator.
    const SLACK: f64 = 2.0;
    let mut failures = 0;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Uniform in [-2, 2).
        (rng >> 40) as f32 / (1u64 << 22) as f32 - 2.0
    };
    for (k, n) in plan.shapes() {
        let Some(m) = plan.matmuls.iter().find(|m| m.k == k && m.n == n) else { continue };
        let mut w = vec![0f32; k * n];
        dequantize_rows(m.ty, &model.bytes()[m.offset..], k, 0..n, &mut w).map_err(CliError::new)?;
        let largest = *plan.buckets_for(plan.max_tokens(k, n)).last().unwrap_or(&1);
        let mut rows_list = vec![plan.min_batch, largest];
        rows_list.dedup();
        for rows in rows_list {
            let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
            let mut out = vec![0f32; rows * n];
            backend.begin();
            let ok = backend.accepts(m.offset, k, n, rows) && backend.run(m.offset, k, n, &x, &mut out);
            if !ok {
                outln!("{k:>6} {n:>6} {rows:>4}  the NPU did not run it  FAIL")?;
                failures += 1;
                continue;
            }
            let c = Comparison::new(config.precision, &w, &x, k, n, &out);
            let mut times = Vec::new();
            for _ in 0..args.reps.max(1) {
                let t = Instant::now();
                backend.run(m.offset, k, n, &x, &mut out);
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            let gflops = 2.0 * (rows * k * n) as f64 / median / 1e9;
            let pass = c.passes(SLACK);
            failures += usize::from(!pass);
            outln!(
                "{k:>6} {n:>6} {rows:>4}  {:>10.3e} {:>10.3e} {:>9.3}  {:>10.1} {gflops:>8.2}  {}",
                c.max_abs,
                c.max_rel,
                c.worst_ratio,
                median * 1e6,
                if pass { "ok" } else { "FAIL" }
            )?;
        }
    }
    let stats = backend.stats();
    outln!(
        "{} matmuls, {:.2} MiB on the NPU, weights converted in {:.0} ms",
        stats.matmuls,
        stats.bytes as f64 / (1 << 20) as f64,
        stats.load_seconds * 1e3
    )?;
    if failures > 0 {
        return Err(CliError::new(format!(
            "NPU selftest failed: {failures} case(s) past {SLACK} x the {} rounding bound",
            config.precision.name()
        )));
    }
    outln!(
        "NPU selftest passed: every result within {SLACK} x the {} rounding bound",
        config.precision.name()
    )?;
    Ok(())
}

/// `-v`: what went to the NPU at load (nothing without the feature).
pub fn report_load(session: &pinfer::session::Session) {
    #[cfg(feature = "npu")]
    if let Some(npu) = session.npu() {
        let s = npu.stats();
        errln!(
            "pinfer: npu: {} matmuls ({} shapes, {:.1} MiB) on {} in {} precision, batches of {}+ tokens; converted in {:.0} ms",
            s.matmuls,
            s.shapes,
            s.bytes as f64 / (1 << 20) as f64,
            npu.library().display(),
            npu.plan().precision.name(),
            npu.plan().min_batch,
            s.load_seconds * 1e3
        );
    }
    #[cfg(not(feature = "npu"))]
    let _ = session;
}

/// `-v`: what the NPU did (nothing without the feature).
pub fn report_end(session: &pinfer::session::Session) {
    #[cfg(feature = "npu")]
    if let Some(npu) = session.npu() {
        let s = npu.stats();
        errln!("pinfer: npu: {}", calls(&s));
    }
    #[cfg(not(feature = "npu"))]
    let _ = session;
}

/// `-v`: what the projector's encoder sent to the NPU (nothing without the feature or a backend).
pub fn report_encoder(projector: &pinfer::media::Projector) {
    #[cfg(feature = "npu")]
    if let Some(npu) = projector.npu() {
        let s = npu.stats();
        errln!(
            "pinfer: npu: encoder: {} matmuls ({} shapes, {:.1} MiB) on {} in {} precision; {}",
            s.matmuls,
            s.shapes,
            s.bytes as f64 / (1 << 20) as f64,
            npu.library().display(),
            npu.plan().precision.name(),
            calls(&s)
        );
    }
    #[cfg(not(feature = "npu"))]
    let _ = projector;
}

/// The calls an NPU backend answered and how long they took, and the shapes that fell back.
#[cfg(feature = "npu")]
fn calls(s: &pinfer::npu::NpuStats) -> String {
    let fell_back = match s.disabled {
        0 => String::new(),
        n => format!(", {n} shapes fell back to the CPU"),
    };
    format!("{} matmul calls in {:.2} ms{fell_back}", s.calls, s.seconds * 1e3)
}
