//! The board runtime of the CLI: which board, which cores, real-time scheduling, memory locking
//! and the memory check, shared by every command that runs a model; and the reports `-v` prints.

use std::path::{Path, PathBuf};

use clap::Args;
use pinfer::board::runtime::{self as board, Board, WorkerPlan};
use pinfer::board::thread::{allowed_cores, current_thread_scheduler};
use pinfer::gguf::TensorInfo;
use pinfer::loader::ModelFile;
use pinfer::placement::{Placement, Reason, Summary, FORMATS};
use pinfer::session::{Session, SessionError, SessionOptions};

use crate::CliError;

const MIB: f64 = 1024.0 * 1024.0;

/// Options of the board runtime (every command that runs a model takes them).
#[derive(Args, Debug, Clone, Default)]
pub struct RuntimeArgs {
    /// Board profile (see `pinfer boards`), or auto: the device tree, then per-core capacity.
    #[arg(long = "board", value_name = "NAME", default_value = "auto")]
    pub board: String,
    /// Cores for the workers, one pinned worker each, e.g. 4-7 or 4,6 (default: the board's big
    /// cores within the affinity mask inherited from taskset/cgroups). Must lie inside that mask.
    #[arg(long = "cores", value_name = "LIST")]
    pub cores: Option<String>,
    /// Worker threads (default: one per chosen core; never more than the allowed cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Run the workers SCHED_FIFO at this priority, 1-99 (needs root or CAP_SYS_NICE).
    #[arg(long = "rt-priority", value_name = "N", value_parser = clap::value_parser!(i32).range(1..=99))]
    pub rt_priority: Option<i32>,
    /// Lock the model and the arena in RAM (mlock): no page faults or swapping while running.
    #[arg(long = "mlock")]
    pub mlock: bool,
    /// Refuse to load when the planned peak memory exceeds this many MiB (default: MemAvailable).
    #[arg(long = "mem-limit", value_name = "MIB")]
    pub mem_limit: Option<u64>,
    /// Check every op's output for NaN/infinity and stop at the first, naming op, layer and tensor.
    #[arg(long = "check-numerics")]
    pub check_numerics: bool,
    /// Force a kernel path: ref, neon, dotprod, fp16 (dotprod with llama.cpp's aarch64 f16
    /// attention arithmetic), avx2 or vnni (avx2 with AVX512-VNNI dots) (also PINFER_KERNELS).
    #[arg(long = "kernels", value_name = "PATH")]
    pub kernels: Option<String>,
    /// KV cache type of the keys (-ctk): f16 (default), f32, bf16, q8_0, q4_0, q4_1, q5_0, q5_1.
    /// q8_0 halves the cache's memory for about +0.1% perplexity.
    #[arg(long = "cache-type-k", value_name = "TYPE", value_parser = parse_kv_type)]
    pub cache_type_k: Option<pinfer::quant::GgmlType>,
    /// KV cache type of the values (-ctv): the same types as --cache-type-k.
    #[arg(long = "cache-type-v", value_name = "TYPE", value_parser = parse_kv_type)]
    pub cache_type_v: Option<pinfer::quant::GgmlType>,
    /// Read the model into memory instead of mapping it (as llama.cpp's --no-mmap).
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// llama.cpp's GPU layers (-ngl): accepted and ignored with a note (pinfer runs on the CPU
    /// and, with --npu, the RK3588 NPU).
    #[arg(
        long = "n-gpu-layers",
        visible_alias = "gpu-layers",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub n_gpu_layers: Option<String>,
    /// llama.cpp's flash attention switch (-fa [on|off|auto]): accepted with a note (pinfer's
    /// attention is always the fused flash-attention kind).
    #[arg(long = "flash-attn", value_name = "on|off|auto", num_args = 0..=1, default_missing_value = "on")]
    pub flash_attn: Option<String>,
    /// llama.cpp's NUMA strategy: accepted with a note (RK3588 boards have one memory node).
    #[arg(long = "numa", value_name = "TYPE", num_args = 0..=1, default_missing_value = "distribute")]
    pub numa: Option<String>,
    /// Apply a LoRA adapter (llama.cpp's form; repeatable).
    #[arg(long = "lora", value_name = "FILE")]
    pub lora: Vec<PathBuf>,
    /// Apply a LoRA adapter with a scale of its product (repeatable).
    #[arg(long = "lora-scaled", value_names = ["FILE", "SCALE"], num_args = 2)]
    pub lora_scaled: Vec<String>,
    #[command(flatten)]
    pub npu: crate::npu::NpuArgs,
}

impl RuntimeArgs {
    /// The adapters of `--lora` (scale 1) and `--lora-scaled`, in that order.
    fn adapters(&self) -> Result<Vec<(PathBuf, f32)>, CliError> {
        adapter_files(&self.lora, &self.lora_scaled)
    }

    /// One line for each llama.cpp option that has no effect here.
    fn notes(&self) {
        if let Some(n) = &self.n_gpu_layers {
            errln!("pinfer: note: -ngl {n} has no effect: pinfer has no GPU offload (it runs on the CPU, and on the RK3588 NPU with --npu)");
        }
        if let Some(v) = &self.flash_attn {
            errln!("pinfer: note: -fa {v} has no effect: pinfer's attention is always fused (flash-attention style)");
        }
        if let Some(v) = &self.numa {
            errln!("pinfer: note: --numa {v} has no effect: pinfer pins its workers to the board's big cores (one memory node)");
        }
    }
}

/// The adapter files of `--lora FILE` (scale 1) and `--lora-scaled FILE SCALE` (given as pairs),
/// in that order.
pub(crate) fn adapter_files(
    lora: &[PathBuf],
    lora_scaled: &[String],
) -> Result<Vec<(PathBuf, f32)>, CliError> {
    let mut out: Vec<(PathBuf, f32)> = lora.iter().map(|p| (p.clone(), 1.0)).collect();
    for pair in lora_scaled.chunks(2) {
        let [file, scale] = pair else {
            return Err(CliError::new("--lora-scaled needs FILE SCALE".into()));
        };
        let value: f32 = scale.parse().ok().filter(|v: &f32| v.is_finite()).ok_or_else(|| {
            CliError::new(format!("--lora-scaled {file} {scale}: the scale is not a number"))
        })?;
        out.push((PathBuf::from(file), value));
    }
    Ok(out)
}

/// A KV cache type by llama.cpp's name (`q8_0`, any case); the message lists the types there are.
pub fn parse_kv_type(name: &str) -> Result<pinfer::quant::GgmlType, String> {
    use pinfer::quant::{GgmlType, Lowercase};
    let types = || GgmlType::all().filter(|t| t.is_kv_cache_type());
    types().find(|t| t.name().eq_ignore_ascii_case(name)).ok_or_else(|| {
        let names: Vec<String> = types().map(|t| Lowercase(t.name()).to_string()).collect();
        format!("{name:?} is not a KV cache type (supported: {})", names.join(", "))
    })
}

/// The board and the worker cores, chosen before the session starts (and pins the caller).
pub struct Runtime {
    pub board: Board,
    pub workers: WorkerPlan,
    args: RuntimeArgs,
    /// The memory limit in bytes and where it comes from, read once.
    limit: Option<(u64, &'static str)>,
    /// Matmul offload to the NPU.
    npu: crate::npu::NpuChoice,
    /// The kernel path every session of this run uses.
    kernels: pinfer::kernels::KernelPath,
    /// LoRA adapters and their scales.
    lora: Vec<(PathBuf, f32)>,
}

/// When the repacking threads started (the first call), and the last percentage shown.
static PROGRESS: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
static SHOWN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Repacking progress on stderr, once a load has taken a second and only on a terminal: one line
/// rewritten in place, cleared at the end.
fn repack_progress(done: usize, total: usize) {
    use std::io::IsTerminal;
    use std::sync::atomic::Ordering;
    let started = *PROGRESS.get_or_init(std::time::Instant::now);
    if total == 0 || started.elapsed().as_secs_f64() < 1.0 || !std::io::stderr().is_terminal() {
        return;
    }
    let percent = (done * 100 / total).min(100);
    if SHOWN.fetch_max(percent + 1, Ordering::Relaxed) > percent {
        return; // another thread showed this one (or a later one) already
    }
    if percent == 100 {
        err!("\r\x1b[K");
    } else {
        err!("\rpinfer: repacking weights {percent}% ({} of {} MiB)", done >> 20, total >> 20);
    }
}

impl Runtime {
    /// Resolves the board and plans the workers; prints the notes on what was adjusted.
    pub fn new(args: &RuntimeArgs) -> Result<Self, CliError> {
        args.notes();
        let kernels = crate::chosen_kernels(args.kernels.as_deref())?;
        let root = Path::new("/");
        let board = board::resolve(&args.board, root).map_err(CliError::new)?;
        // The inherited mask, read before anything pins this thread.
        let allowed = allowed_cores();
        let cores: Option<Vec<usize>> = match &args.cores {
            Some(text) => Some(
                pinfer::board::parse_core_list(text)
                    .map_err(|e| CliError::new(format!("--cores {text}: {e}")))?
                    .iter()
                    .map(|&c| usize::from(c))
                    .collect(),
            ),
            None => None,
        };
        let workers =
            board::plan_workers(&board, &allowed, cores.as_deref(), args.threads).map_err(CliError::new)?;
        for note in &workers.notes {
            errln!("pinfer: note: {note}");
        }
        let limit = match args.mem_limit {
            Some(mib) => Some((mib.saturating_mul(1 << 20), "--mem-limit")),
            None => board::mem_available(root).map(|b| (b, "MemAvailable")),
        };
        let npu = args.npu.resolve(board.profile.npu_cores)?;
        let lora = args.adapters()?;
        Ok(Self { board, workers, args: args.clone(), limit, npu, kernels, lora })
    }

    /// `base` with the workers, scheduling, numerics check and memory limit filled in.
    pub fn options(&self, base: SessionOptions) -> SessionOptions {
        let mut opts = SessionOptions {
            threads: self.workers.cores.len(),
            cores: Some(self.workers.cores.clone()),
            pin: true,
            rt_priority: self.args.rt_priority,
            check_numerics: self.args.check_numerics,
            kernels: self.kernels,
            kv_types: pinfer::model::KvTypes {
                k: self.args.cache_type_k.unwrap_or(base.kv_types.k),
                v: self.args.cache_type_v.unwrap_or(base.kv_types.v),
            },
            repack_progress: Some(repack_progress),
            memory_limit: self.memory_limit().map(|(b, _)| b as usize),
            lora: self.lora.clone(),
            ..base
        };
        opts.repack &= repack_allowed();
        self.npu.apply(&mut opts);
        opts
    }

    /// The memory limit and where it comes from.
    fn memory_limit(&self) -> Option<(u64, &'static str)> {
        self.limit
    }

    /// Opens `path` and sets the session up; locks its memory with `--mlock`; with `verbose`,
    /// reports board, workers, scheduling, memory plan and placement (before the first token).
    pub fn load(&self, path: &Path, base: SessionOptions, verbose: u8) -> Result<Session, CliError> {
        let model =
            if self.args.no_mmap { ModelFile::read_static(path)? } else { ModelFile::open_static(path)? };
        let opts = self.options(base);
        let session = Session::new(model, &opts).map_err(|e| match e {
            SessionError::OverMemory { .. } => {
                let source = self.memory_limit().map_or("", |(_, s)| s);
                CliError::new(format!(
                    "{}: {e} ({source}; --mem-limit MIB sets another limit)",
                    path.display()
                ))
            }
            SessionError::Threads(e) => CliError::new(e.to_string()),
            // Both name the file already.
            SessionError::Load(e) => CliError::new(e.to_string()),
            SessionError::Cache(msg) => CliError::new(msg),
            e => CliError::new(format!("{}: {e}", path.display())),
        })?;
        let locked = if self.args.mlock { Some(lock(&session)?) } else { None };
        if verbose > 0 {
            self.report(&session, &opts, locked.as_deref(), verbose);
        }
        Ok(session)
    }

    /// The cores the threads run on (the caller first).
    pub fn cores(&self, session: &Session) -> Vec<usize> {
        session.thread_cores().unwrap_or_else(|| self.workers.cores.clone())
    }

    fn report(&self, session: &Session, opts: &SessionOptions, locked: Option<&str>, verbose: u8) {
        let b = &self.board;
        let p = &b.profile;
        let classes = if b.big.is_empty() {
            "no big/little classes".to_string()
        } else {
            format!("big cores {}, little {}", board::ranges(&b.big), board::ranges(&b.little))
        };
        let npu = if p.npu_cores > 0 {
            format!("; NPU {} cores ({})", p.npu_cores, p.npu_matmul_types.join(", "))
        } else {
            String::new()
        };
        errln!("pinfer: board: {} ({}, {}); {classes}{npu}", p.name, p.id, b.how);
        let cores = self.cores(session);
        errln!("pinfer: workers: {} on cores {}", cores.len(), board::list(&cores));
        let (policy, priority) = current_thread_scheduler();
        let how = match (opts.rt_priority, policy) {
            (Some(_), _) => " (--rt-priority)",
            (None, "SCHED_FIFO" | "SCHED_RR") => " (inherited)",
            _ => "",
        };
        let sched = if priority > 0 {
            format!("{policy} priority {priority}{how}")
        } else {
            format!("{policy}{how}")
        };
        let waits = if session.spinning() {
            "barrier waits spin briefly, then sleep"
        } else {
            "barrier waits sleep (threads share cores)"
        };
        errln!("pinfer: scheduling: {sched}; {waits}");
        let limit = self
            .memory_limit()
            .map_or(String::new(), |(bytes, source)| format!(" ({source} {:.1} MiB)", bytes as f64 / MIB));
        errln!("pinfer: memory plan: {}{limit}", session.memory_plan());
        if let Some(locked) = locked {
            errln!("pinfer: mlock: {locked}");
        }
        errln!("pinfer: placement: {}", summary_text(&summary(session.placements())));
        crate::npu::report_load(session);
        if verbose > 1 {
            let mut text = Vec::new();
            let _ = print_placement(session.placements(), &mut text);
            err!("{}", String::from_utf8_lossy(&text));
        }
    }
}

/// Whether repacking may be on: `PINFER_NO_REPACK=1` keeps the file's layouts everywhere (A/B
/// comparisons), as `--no-repack` does for one command.
pub fn repack_allowed() -> bool {
    std::env::var_os("PINFER_NO_REPACK").is_none_or(|v| v.is_empty() || v == "0")
}

/// Locks the session's resident memory; a description of what was locked.
fn lock(session: &Session) -> Result<String, CliError> {
    let regions = session.resident_regions();
    let total: usize = regions.iter().map(|(_, b)| b.len()).sum();
    let mut by_kind: Vec<(&str, usize)> = Vec::new();
    for (kind, bytes) in &regions {
        board::lock(bytes).map_err(|errno| CliError::new(board::lock_error(total, errno)))?;
        match by_kind.iter_mut().find(|(k, _)| k == kind) {
            Some((_, n)) => *n += bytes.len(),
            None => by_kind.push((kind, bytes.len())),
        }
    }
    let parts: Vec<String> = by_kind.iter().map(|(k, n)| format!("{k} {:.1}", *n as f64 / MIB)).collect();
    Ok(format!("{:.1} MiB locked ({} MiB)", total as f64 / MIB, parts.join(", ")))
}

/// Tensors and bytes per buffer kind.
pub fn summary<'a>(rows: impl Iterator<Item = (TensorInfo<'a>, Placement)>) -> Summary {
    let mut s = Summary::default();
    for (t, p) in rows {
        s.add(t.name, &p, t.nbytes as usize);
    }
    s
}

/// File bytes beside resident bytes, per type and in total: `Q4_K 108.0 MiB in the file, 120.0
/// resident; ...; total 235.4 -> 262.7 MiB (+11.6%)`. Resident: the repacked copy or the bytes
/// read in place, plus a tied embedding's rows still read from the file; unused tensors count 0.
pub fn resident_text<'a>(rows: impl Iterator<Item = (TensorInfo<'a>, Placement)>) -> String {
    let mut by_type: Vec<(pinfer::quant::GgmlType, f64, f64)> = Vec::new();
    for (t, p) in rows {
        let resident = match p.reason {
            Reason::Unused => 0,
            Reason::TiedEmbedding => p.bytes + t.nbytes as usize,
            Reason::Repacked
            | Reason::SharedEmbedding
            | Reason::Norm
            | Reason::Bias
            | Reason::Router
            | Reason::Embedding
            | Reason::Experts
            | Reason::NoLayout(_)
            | Reason::Shape { .. }
            | Reason::RepackOff
            | Reason::ReadInPlace => p.bytes,
        };
        let at = match by_type.iter().position(|r| r.0 == t.ty) {
            Some(i) => i,
            None => {
                by_type.push((t.ty, 0.0, 0.0));
                by_type.len() - 1
            }
        };
        by_type[at].1 += t.nbytes as f64 / MIB;
        by_type[at].2 += resident as f64 / MIB;
    }
    let (file, resident) = by_type.iter().fold((0.0, 0.0), |(f, r), t| (f + t.1, r + t.2));
    let parts: Vec<String> =
        by_type.iter().map(|(ty, f, r)| format!("{ty} {f:.1} MiB in the file, {r:.1} resident")).collect();
    let change = if file > 0.0 { (resident / file - 1.0) * 100.0 } else { 0.0 };
    format!("{}; total {file:.1} -> {resident:.1} MiB ({change:+.1}%)", parts.join("; "))
}

/// `repacked 80.1 MiB (211 tensors: q4mx4 210, q8x4 1); mapped ...; npu ...`.
pub fn summary_text(s: &Summary) -> String {
    let (n, bytes) = s.repacked_total();
    let layouts: Vec<String> = FORMATS
        .iter()
        .zip(&s.repacked)
        .filter(|(_, (n, _))| *n > 0)
        .map(|(f, (n, _))| format!("{} {n}", f.name()))
        .collect();
    let layouts = if layouts.is_empty() { String::new() } else { format!(": {}", layouts.join(", ")) };
    let mut text = format!(
        "repacked {:.1} MiB ({n} tensors{layouts}); mapped {:.1} MiB ({} tensors)",
        bytes as f64 / MIB,
        s.mapped.1 as f64 / MIB,
        s.mapped.0
    );
    if s.mapped_rows.0 > 0 {
        text += &format!(
            ", plus rows of {} tied embedding(s) read from the file ({:.1} MiB)",
            s.mapped_rows.0,
            s.mapped_rows.1 as f64 / MIB
        );
    }
    if s.routers.0 > 0 {
        let part = |(n, b): (usize, usize)| match b as f64 {
            b if b >= MIB => format!("{:.1} MiB ({n} tensors)", b / MIB),
            b => format!("{:.1} KiB ({n} tensors)", b / 1024.0),
        };
        text += &format!(
            "; of these, MoE experts {}, shared experts {}, routers {}",
            part(s.experts),
            part(s.shared_experts),
            part(s.routers)
        );
    }
    text += &format!(
        "; npu {:.1} MiB ({} tensors: nothing is planned for it here; NPU copies of matmul weights, kept \
         next to their CPU copies, are listed by `pinfer npu-plan`)",
        s.npu.1 as f64 / MIB,
        s.npu.0
    );
    text
}

/// One line per tensor: name, type, placement, bytes in that buffer, reason.
pub fn print_placement<'a>(
    rows: impl Iterator<Item = (TensorInfo<'a>, Placement)>,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    writeln!(out, "{:<40} {:>6}  {:<16} {:>12}  reason", "tensor", "type", "placement", "bytes")?;
    for (t, p) in rows {
        writeln!(
            out,
            "{:<40} {:>6}  {:<16} {:>12}  {}",
            t.name,
            t.ty.name(),
            p.buffer.to_string(),
            p.bytes,
            p.reason
        )?;
    }
    Ok(())
}

/// A repack cache's tensor data checked against its checksums on a background thread while the
/// model runs: a damaged cache would otherwise give wrong text silently. The thread runs at
/// SCHED_IDLE priority, so it takes only time the workers leave.
pub struct CacheCheck(Option<std::sync::mpsc::Receiver<Result<(), String>>>);

impl CacheCheck {
    /// Starts the check when `session` runs from a repack cache (else does nothing).
    pub fn start(session: &Session, path: &Path) -> Self {
        if !session.from_cache() {
            return Self(None);
        }
        let bytes: &'static [u8] = session.gguf().file_bytes();
        let path = path.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().name("pinfer-verify".into()).spawn(move || {
            pinfer::board::thread::set_current_thread_idle();
            let checked = pinfer::gguf::Gguf::parse(bytes)
                .map_err(|e| format!("{}: {e}", path.display()))
                .and_then(|gguf| pinfer::repack_cache::verify_data(&gguf, &path));
            let _ = tx.send(checked.map(|_| ()));
        });
        Self(spawned.ok().map(|_| rx))
    }

    /// An error once the check found damage; `Ok` while it runs and after it passed.
    pub fn status(&mut self) -> Result<(), CliError> {
        match self.0.as_ref().map(|rx| rx.try_recv()) {
            Some(Ok(Err(msg))) => {
                self.0 = None;
                Err(CliError::new(msg))
            }
            Some(Ok(Ok(()))) => {
                self.0 = None;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Waits for the check to end: an error if it found damage.
    pub fn finish(mut self) -> Result<(), CliError> {
        match self.0.take().map(|rx| rx.recv()) {
            Some(Ok(Err(msg))) => Err(CliError::new(msg)),
            _ => Ok(()),
        }
    }
}
