//! std + feature `npu`: offload of whitelisted matmuls to the three NPU cores of an RK3588, through
//! Rockchip's `librknnrt.so` (loaded at run time by `rknn-sys`; a CPU emulator stands in for tests).
//!
//! # What goes to the NPU
//!
//! A [`NpuConfig`] says which matmuls may go (the mode), in which precision, and from which batch
//! size on. [`plan`] looks at the session's forward graphs and lists the matmuls that qualify:
//!
//! * 2-D weight matrices of the model file whose type dequantizes, with a contiguous F32 input;
//! * K (elements per weight row, the input features) a multiple of 32 and N (weight rows, the output
//!   features) a multiple of 16 for fp16 / 32 for int8 (RK3588's alignment); K above 8192 is split
//!   into segments whose partial products are summed on the CPU;
//! * at least [`NpuConfig::min_batch`] input rows in some graph of the session (the output matmul of
//!   a generation graph only ever sees the last token, so it stays on the CPU unless the session
//!   scores every token);
//! * `auto`: all of those; a whitelist file: those whose (K, N) it lists.
//!
//! # The whitelist file
//!
//! The format of the earlier llama.cpp RKNN backend, in the RKNN API's own terms (A = M x K is the
//! activation, B = K x N the weight, C = M x N the result):
//!
//! ```json
//! {"pairs": [{"src0": {"row": 64, "col": 576}, "src1": {"row": 576, "col": 1536}, "name": "ffn_up-0"}]}
//! ```
//!
//! `src0` is A: `row` = M (tokens of the batch it was recorded with), `col` = K. `src1` is B: `row` =
//! K, `col` = N. For a GGUF weight tensor of shape `[ne0, ne1]` (ggml order), K = ne0 and N = ne1: a
//! pair selects every matmul whose weights have that shape. M is informative only (the batch size
//! varies per call; [`NpuConfig::min_batch`] decides which calls go), and so is `name` (a label:
//! `pinfer npu-plan` writes the node's name, one pair per distinct shape).
//!
//! # Run time
//!
//! See [`NpuBackend`]: weights converted once at load, one context per NPU core and batch bucket,
//! N split over the cores, failures logged once and answered by the CPU.

mod backend;
mod check;

use std::fmt;
use std::format;
use std::path::{Path, PathBuf};
use std::string::{String, ToString};
use std::vec::Vec;

pub use backend::{dequantize_rows, NpuBackend, NpuError, NpuStats};
pub use check::{error_bound, reference_matmul, Comparison};

use crate::graph::{Graph, Op};
use crate::quant::GgmlType;
use crate::tensor::Storage;

/// Default smallest batch (input rows) sent to the NPU: single-token decode stays on the CPU.
pub const DEFAULT_MIN_BATCH: usize = 16;
/// NPU cores of an RK3588 (one matmul context per core).
pub const RK3588_CORES: usize = 3;
/// K alignment of the RK3588 matmul (fp16 and int8).
pub const K_ALIGN: usize = 32;
/// Longest K one context takes; longer rows are split into segments summed on the CPU.
pub const K_SEGMENT: usize = 8192;
/// Widest N slice given to one context (larger slices are cut; RK3588's maximum is undocumented,
/// N = 10368 is known to work).
pub const N_MAX_PER_CONTEXT: usize = 8192;

/// Which matmuls may go to the NPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NpuMode {
    /// None.
    #[default]
    Off,
    /// Every matmul that meets the alignment and size limits.
    Auto,
    /// The shapes of a whitelist file.
    List(Whitelist),
}

impl NpuMode {
    /// Parses `off`, `auto` or the path of a whitelist file (read and checked now).
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "off" | "none" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            path => Whitelist::load(Path::new(path)).map(Self::List),
        }
    }
}

/// Element type the NPU computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// fp16 x fp16 -> f32: weights dequantized and rounded to fp16, inputs rounded to fp16.
    #[default]
    Fp16,
    /// int8 x int8 -> int32: weights quantized per row (symmetric, one scale per output feature),
    /// inputs per token; both scales applied on the CPU to the int32 result (RK3588's own
    /// per-channel quantization modes return zeros).
    Int8,
}

impl Precision {
    /// Parses `fp16` or `int8`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "fp16" | "f16" => Ok(Self::Fp16),
            "int8" | "i8" => Ok(Self::Int8),
            other => Err(format!("unknown NPU precision {other:?} (fp16 or int8)")),
        }
    }

    /// `fp16` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp16 => "fp16",
            Self::Int8 => "int8",
        }
    }

    /// N alignment of the RK3588 matmul for this type (and of the per-core slices).
    pub fn n_align(self) -> usize {
        match self {
            Self::Fp16 => 16,
            Self::Int8 => 32,
        }
    }

    /// Bytes per weight element on the NPU.
    pub fn weight_bytes(self) -> usize {
        match self {
            Self::Fp16 => 2,
            Self::Int8 => 1,
        }
    }
}

/// How a session uses the NPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpuConfig {
    /// Which matmuls may go.
    pub mode: NpuMode,
    /// fp16 (default) or int8.
    pub precision: Precision,
    /// Smallest number of input rows (tokens) sent to the NPU; smaller batches run on the CPU.
    pub min_batch: usize,
    /// NPU cores to spread N over (RK3588: 3).
    pub cores: usize,
    /// The runtime library to load (`None`: `PINFER_RKNNRT`, then `librknnrt.so` from the loader's
    /// path; see `rknn_sys::Runtime::load`).
    pub library: Option<PathBuf>,
    /// Stay silent when the runtime library cannot be loaded (the CLI's implicit default: use the
    /// NPU when there is one). An explicit `--npu` logs why it is not used.
    pub quiet_if_missing: bool,
    /// CPU cores for the threads that drive NPU cores 1, 2, ... (`None`: not pinned). The caller
    /// drives NPU core 0; a session gives its pool's cores, idle while the NPU runs.
    pub cpu_cores: Option<Vec<usize>>,
}

impl Default for NpuConfig {
    fn default() -> Self {
        Self {
            mode: NpuMode::Off,
            precision: Precision::Fp16,
            min_batch: DEFAULT_MIN_BATCH,
            cores: RK3588_CORES,
            library: None,
            quiet_if_missing: false,
            cpu_cores: None,
        }
    }
}

impl NpuConfig {
    /// `auto` with the defaults.
    pub fn auto() -> Self {
        Self { mode: NpuMode::Auto, ..Self::default() }
    }

    /// Whether any matmul may go to the NPU.
    pub fn is_on(&self) -> bool {
        self.mode != NpuMode::Off
    }
}

/// One line of a whitelist: a matmul shape (see the module docs for the format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhitelistPair {
    /// Rows of A (tokens) it was recorded with; informative.
    pub m: usize,
    /// Input features (weight row length).
    pub k: usize,
    /// Output features (weight rows).
    pub n: usize,
    /// A label (llama.cpp's node name).
    pub name: String,
}

/// The shapes a whitelist file lets go to the NPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Whitelist {
    /// The pairs, in file order.
    pub pairs: Vec<WhitelistPair>,
}

impl Whitelist {
    /// Reads and parses a whitelist file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses the JSON text of a whitelist.
    pub fn parse(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let pairs = v
            .get("pairs")
            .and_then(|p| p.as_array())
            .ok_or("expected an object with a \"pairs\" array".to_string())?;
        let dim = |p: &serde_json::Value, i: usize, m: &str, d: &str| -> Result<usize, String> {
            p.get(m)
                .and_then(|o| o.get(d))
                .and_then(serde_json::Value::as_u64)
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| format!("pair {i}: {m}.{d} must be a positive integer"))
        };
        let mut out = Vec::with_capacity(pairs.len());
        for (i, p) in pairs.iter().enumerate() {
            let (m, k) = (dim(p, i, "src0", "row")?, dim(p, i, "src0", "col")?);
            let (k1, n) = (dim(p, i, "src1", "row")?, dim(p, i, "src1", "col")?);
            if k != k1 {
                return Err(format!("pair {i}: src0.col = {k} and src1.row = {k1} differ (both are K)"));
            }
            let name = p.get("name").and_then(|n| n.as_str()).unwrap_or("").to_string();
            out.push(WhitelistPair { m, k, n, name });
        }
        Ok(Self { pairs: out })
    }

    /// The whitelist as JSON, one pair per line.
    pub fn to_json(&self) -> String {
        let mut s = String::from("{\"pairs\": [\n");
        for (i, p) in self.pairs.iter().enumerate() {
            let sep = if i + 1 < self.pairs.len() { "," } else { "" };
            s += &format!(
                "  {{\"src0\": {{\"row\": {}, \"col\": {}}}, \"src1\": {{\"row\": {}, \"col\": {}}}, \"name\": {}}}{sep}\n",
                p.m,
                p.k,
                p.k,
                p.n,
                serde_json::Value::String(p.name.clone())
            );
        }
        s + "]}\n"
    }

    /// Whether the whitelist lists shape (K, N).
    pub fn contains(&self, k: usize, n: usize) -> bool {
        self.pairs.iter().any(|p| p.k == k && p.n == n)
    }
}

/// A matmul the plan sends to the NPU: one weight matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMatmul {
    /// The node's name (`ffn_up-3`), or one derived from the weight's name.
    pub name: String,
    /// The weight tensor's name.
    pub weight: String,
    /// Byte offset of the weights in the model file.
    pub offset: usize,
    /// Their type in the file.
    pub ty: GgmlType,
    /// Input features (weight row length).
    pub k: usize,
    /// Output features (weight rows).
    pub n: usize,
    /// Most input rows the session's graphs give it.
    pub max_tokens: usize,
}

/// A matmul the plan leaves on the CPU, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedMatmul {
    /// The node's name.
    pub name: String,
    /// The weight tensor's name.
    pub weight: String,
    /// Input features.
    pub k: usize,
    /// Output features.
    pub n: usize,
    /// Why.
    pub reason: String,
}

/// Which matmuls go to the NPU, how the work is split, and what it costs in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpuPlan {
    /// Precision.
    pub precision: Precision,
    /// Cores N is spread over.
    pub cores: usize,
    /// Smallest batch sent.
    pub min_batch: usize,
    /// Batch buckets: contexts exist for these M; a batch runs in the smallest bucket that holds it.
    pub buckets: Vec<usize>,
    /// Offloaded matmuls, in graph order.
    pub matmuls: Vec<PlannedMatmul>,
    /// Matmuls left on the CPU.
    pub skipped: Vec<SkippedMatmul>,
}

/// One context's share of a shape: columns `[n0, n0 + n_len)` and rows `[k0, k0 + k_len)` of B, on
/// core `core`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// NPU core (0-based).
    pub core: usize,
    /// First output feature.
    pub n0: usize,
    /// Output features.
    pub n_len: usize,
    /// K segment index (`k0 = segment · K_SEGMENT`).
    pub segment: usize,
    /// First input feature.
    pub k0: usize,
    /// Input features.
    pub k_len: usize,
}

/// How a (K, N) matmul is cut into contexts: N into `cores` aligned slices (remainder units to the
/// first cores, slices wider than [`N_MAX_PER_CONTEXT`] cut again), K into segments of at most
/// [`K_SEGMENT`]. Parts of one core are ordered by slice, then segment.
pub fn split(k: usize, n: usize, n_align: usize, cores: usize) -> Vec<Part> {
    let cores = cores.max(1);
    let units = n / n_align;
    let mut parts = Vec::new();
    let mut n0 = 0;
    for core in 0..cores {
        let mine = (units / cores + usize::from(core < units % cores)) * n_align;
        let max = N_MAX_PER_CONTEXT / n_align * n_align;
        let mut left = mine;
        while left > 0 {
            let n_len = left.min(max);
            for (segment, k0) in (0..k).step_by(K_SEGMENT).enumerate() {
                parts.push(Part { core, n0, n_len, segment, k0, k_len: (k - k0).min(K_SEGMENT) });
            }
            n0 += n_len;
            left -= n_len;
        }
    }
    parts
}

impl NpuPlan {
    /// The distinct (K, N) shapes, in first-use order.
    pub fn shapes(&self) -> Vec<(usize, usize)> {
        let mut shapes: Vec<(usize, usize)> = Vec::new();
        for m in &self.matmuls {
            if !shapes.contains(&(m.k, m.n)) {
                shapes.push((m.k, m.n));
            }
        }
        shapes
    }

    /// Buckets a shape whose calls have at most `max_tokens` rows needs.
    pub fn buckets_for(&self, max_tokens: usize) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for &b in &self.buckets {
            out.push(b);
            if b >= max_tokens {
                break;
            }
        }
        out
    }

    /// Most rows any call of shape (K, N) has.
    pub fn max_tokens(&self, k: usize, n: usize) -> usize {
        self.matmuls.iter().filter(|m| m.k == k && m.n == n).map(|m| m.max_tokens).max().unwrap_or(0)
    }

    /// Bytes of NPU memory the weights take (plus the int8 scales kept on the CPU).
    pub fn weight_bytes(&self) -> usize {
        let scales = if self.precision == Precision::Int8 { 4 } else { 0 };
        self.matmuls.iter().map(|m| m.k * m.n * self.precision.weight_bytes() + m.n * scales).sum()
    }

    /// Bytes of NPU memory the A (inputs) and C (results) buffers take: per shape and bucket, one A
    /// per K segment and one C per context.
    pub fn buffer_bytes(&self) -> usize {
        let mut total = 0;
        for (k, n) in self.shapes() {
            let parts = split(k, n, self.precision.n_align(), self.cores);
            for m in self.buckets_for(self.max_tokens(k, n)) {
                // A: one buffer per K segment, together K wide; C: one per part, f32/i32.
                total += m * k * self.precision.weight_bytes();
                total += parts.iter().map(|p| m * p.n_len * 4).sum::<usize>();
            }
        }
        total
    }

    /// Runtime buffers (one file descriptor each on the real runtime) and matmul contexts.
    pub fn handles(&self) -> (usize, usize) {
        let (mut buffers, mut contexts) = (0, 0);
        for (k, n) in self.shapes() {
            let parts = split(k, n, self.precision.n_align(), self.cores).len();
            let weights = self.matmuls.iter().filter(|m| m.k == k && m.n == n).count();
            let buckets = self.buckets_for(self.max_tokens(k, n)).len();
            buffers += weights * parts + buckets * (k.div_ceil(K_SEGMENT) + parts);
            contexts += buckets * parts;
        }
        (buffers, contexts)
    }

    /// The whitelist this plan corresponds to: one pair per distinct shape, named after its first
    /// matmul, M = the largest batch.
    pub fn whitelist(&self) -> Whitelist {
        let m = self.buckets.last().copied().unwrap_or(self.min_batch);
        let pairs = self
            .shapes()
            .into_iter()
            .map(|(k, n)| {
                let name = self.matmuls.iter().find(|p| p.k == k && p.n == n).map(|p| p.name.clone());
                WhitelistPair { m, k, n, name: name.unwrap_or_default() }
            })
            .collect();
        Whitelist { pairs }
    }
}

/// Display: a table of the offloaded matmuls, the skipped ones, and the memory.
impl fmt::Display for NpuPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        writeln!(
            f,
            "NPU plan: {} precision, {} cores, batches of {}+ tokens (buckets {:?})",
            self.precision.name(),
            self.cores,
            self.min_batch,
            self.buckets
        )?;
        writeln!(f, "{:<18} {:<26} {:>6} {:>6} {:>6}  {:>9}", "node", "weight", "type", "K", "N", "NPU MiB")?;
        for m in &self.matmuls {
            let bytes = m.k * m.n * self.precision.weight_bytes();
            writeln!(
                f,
                "{:<18} {:<26} {:>6} {:>6} {:>6}  {:>9.2}",
                m.name,
                m.weight,
                m.ty.name(),
                m.k,
                m.n,
                mib(bytes)
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "CPU: {} ({}, K {} N {}): {}", s.name, s.weight, s.k, s.n, s.reason)?;
        }
        let (buffers, contexts) = self.handles();
        writeln!(
            f,
            "{} matmuls on the NPU ({} shapes), {} on the CPU; extra memory {:.2} MiB weights + {:.2} MiB buffers = {:.2} MiB; {} contexts, {} runtime buffers",
            self.matmuls.len(),
            self.shapes().len(),
            self.skipped.len(),
            mib(self.weight_bytes()),
            mib(self.buffer_bytes()),
            mib(self.weight_bytes() + self.buffer_bytes()),
            contexts,
            buffers
        )
    }
}

/// Whether weights of type `ty` dequantize (so they can be converted for the NPU).
fn dequantizes(ty: GgmlType) -> bool {
    ty.traits().dequantize.is_some()
}

/// A node's label: its name if it has one, else derived from the weight's (`blk.3.ffn_up.weight`
/// gives `ffn_up-3`).
fn label(node: &str, weight: &str) -> String {
    if !node.is_empty() && node != weight {
        return node.to_string();
    }
    let base = weight.strip_suffix(".weight").unwrap_or(weight);
    if let Some(rest) = base.strip_prefix("blk.") {
        if let Some((layer, what)) = rest.split_once('.') {
            return format!("{what}-{layer}");
        }
    }
    base.to_string()
}

/// Batch buckets from `min_batch` up to `n_batch`, doubling.
pub fn buckets(min_batch: usize, n_batch: usize) -> Vec<usize> {
    let (mut b, top) = (min_batch.max(1), n_batch.max(1));
    let mut out = Vec::new();
    loop {
        out.push(b.min(top));
        if b >= top {
            return out;
        }
        b *= 2;
    }
}

/// Lists the matmuls of `graphs` (a session's forward graphs, all for the same model file) that
/// `config` sends to the NPU, for batches of up to `n_batch` tokens.
pub fn plan<const N: usize>(graphs: &[&Graph<N>], config: &NpuConfig, n_batch: usize) -> NpuPlan {
    let precision = config.precision;
    let min_batch = config.min_batch.max(1);
    let mut matmuls: Vec<PlannedMatmul> = Vec::new();
    let mut skipped: Vec<SkippedMatmul> = Vec::new();
    for g in graphs {
        for &id in g.order() {
            let t = g.tensor(id);
            let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { continue };
            if t.op != Op::MulMat {
                continue;
            }
            let (w, x) = (g.tensor(w), g.tensor(x));
            let Storage::External { buffer: 0, offset } = w.storage else { continue };
            let (k, n, tokens) = (w.ne[0], w.ne[1], x.ne[1]);
            if let Some(p) = matmuls.iter_mut().find(|p| p.offset == offset) {
                p.max_tokens = p.max_tokens.max(tokens);
                continue;
            }
            let name = label(&t.name, &w.name);
            let reason = if crate::placement::role(&w.name) == crate::placement::Role::Router {
                // An accelerator's reduced precision has produced NaN routing weights elsewhere;
                // routers are tiny, and exact routing matters more than their speed.
                Some("MoE router: stays on the CPU in its own type".to_string())
            } else if w.ne[2] != 1 || w.ne[3] != 1 || x.ne[2] != 1 || x.ne[3] != 1 {
                Some("not a 2-D matmul".to_string())
            } else if x.ty != GgmlType::F32 || t.ty != GgmlType::F32 {
                Some("input or output not F32".to_string())
            } else if !dequantizes(w.ty) {
                Some(format!("weights of type {} do not dequantize", w.ty.name()))
            } else if k % K_ALIGN != 0 {
                Some(format!("K = {k} is not a multiple of {K_ALIGN}"))
            } else if n % precision.n_align() != 0 {
                Some(format!("N = {n} is not a multiple of {} ({})", precision.n_align(), precision.name()))
            } else if let NpuMode::List(list) = &config.mode {
                (!list.contains(k, n)).then(|| "shape not in the whitelist".to_string())
            } else if config.mode == NpuMode::Off {
                Some("NPU off".to_string())
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    if !skipped.iter().any(|s| s.weight == w.name.as_str()) {
                        skipped.push(SkippedMatmul { name, weight: w.name.to_string(), k, n, reason });
                    }
                }
                None => matmuls.push(PlannedMatmul {
                    name,
                    weight: w.name.to_string(),
                    offset,
                    ty: w.ty,
                    k,
                    n,
                    max_tokens: tokens,
                }),
            }
        }
    }
    // Matmuls that never see a batch of min_batch rows would only cost memory.
    let (keep, small): (Vec<_>, Vec<_>) = matmuls.into_iter().partition(|m| m.max_tokens >= min_batch);
    for m in small {
        let reason = format!("at most {} rows per call (below the NPU batch of {min_batch})", m.max_tokens);
        skipped.push(SkippedMatmul { name: m.name, weight: m.weight, k: m.k, n: m.n, reason });
    }
    NpuPlan {
        precision,
        cores: config.cores.max(1),
        min_batch,
        buckets: buckets(min_batch, n_batch.max(min_batch)),
        matmuls: keep,
        skipped,
    }
}

/// The plan for a model file without loading a session: the forward graphs of a generation
/// session (1 token and `n_batch` tokens; with `logits_all` also the perplexity graph) over a context
/// of `n_ctx` tokens (0: min(`DEFAULT_CTX`, the model's maximum)).
pub fn plan_model(
    bytes: &[u8],
    config: &NpuConfig,
    n_batch: usize,
    n_ctx: usize,
    logits_all: bool,
) -> Result<NpuPlan, crate::engine::EngineError> {
    use crate::engine::{EngineConfig, Model};
    let engine = EngineConfig {
        n_ctx,
        n_batch: n_batch.max(1),
        n_outputs: if logits_all { n_batch.max(1) } else { 1 },
        ..EngineConfig::default()
    };
    let planned = crate::engine::heap::plan(Model::open(bytes)?, &engine)?;
    let refs: Vec<&Graph<{ crate::build_config::GRAPH_CAPACITY }>> = planned.graphs().collect();
    Ok(plan(&refs, config, planned.config().n_batch))
}

/// Plans and builds the NPU backend of a session or of a vision projector: `graphs` are its
/// forward graphs (a projector's: its encoder's at the largest input), `model` the mapped file
/// their weights are read from. Every way this can fail ends in one log line (none when the runtime is missing and
/// `config.quiet_if_missing`) and `None`: the session runs on the CPU. With `release`, the pages of
/// the uploaded weights are given back afterwards (the CPU reads its repacked copy).
pub fn session_backend<const N: usize>(
    model: &crate::loader::ModelFile,
    graphs: &[&Graph<N>],
    config: &NpuConfig,
    n_batch: usize,
    release: bool,
) -> Option<NpuBackend> {
    if !config.is_on() {
        return None;
    }
    let plan = plan(graphs, config, n_batch);
    match NpuBackend::new(model.bytes(), &plan, config) {
        Ok(backend) => {
            if release {
                for m in &plan.matmuls {
                    let bytes = m.ty.bytes_for(m.k as u64).unwrap_or(0) as usize * m.n;
                    model.release(m.offset..m.offset + bytes);
                }
            }
            Some(backend)
        }
        Err(NpuError::Missing(_) | NpuError::Nothing(_)) if config.quiet_if_missing => None,
        Err(e @ (NpuError::Missing(_) | NpuError::Failed(_))) => {
            // Once per process: a projector's encoder meets the runtime the model met.
            static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
            let message = e.message();
            let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
            if !said.contains(&message) {
                backend::log(&message);
                said.push(message);
            }
            None
        }
        Err(e) => {
            backend::log(&e.message());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_spreads_aligned_slices_over_the_cores() {
        let parts = split(576, 1536, 16, 3);
        assert_eq!(
            parts.iter().map(|p| (p.core, p.n0, p.n_len)).collect::<Vec<_>>(),
            [(0, 0, 512), (1, 512, 512), (2, 1024, 512)]
        );
        // 4 units of 16: 32, 16, 16.
        let parts = split(128, 64, 16, 3);
        assert_eq!(parts.iter().map(|p| p.n_len).collect::<Vec<_>>(), [32, 16, 16]);
        // int8, 2 units of 32: the third core gets nothing.
        let parts = split(128, 64, 32, 3);
        assert_eq!(parts.iter().map(|p| (p.core, p.n_len)).collect::<Vec<_>>(), [(0, 32), (1, 32)]);
        // Wide N is cut per context, long K in segments.
        let parts = split(8192 + 64, 3 * 10000 / 16 * 16, 16, 3);
        assert!(parts.iter().all(|p| p.n_len <= N_MAX_PER_CONTEXT && p.n_len % 16 == 0));
        assert_eq!(parts.iter().filter(|p| p.segment == 1).count() * 2, parts.len());
        assert!(parts.iter().filter(|p| p.segment == 1).all(|p| p.k0 == 8192 && p.k_len == 64));
        let covered: usize = parts.iter().filter(|p| p.segment == 0).map(|p| p.n_len).sum();
        assert_eq!(covered, 3 * 10000 / 16 * 16);
    }

    #[test]
    fn whitelist_round_trips() {
        let text = r#"{"pairs": [{"src0": {"row": 64, "col": 576}, "src1": {"row": 576, "col": 1536}, "name": "ffn_up-0"},
                      {"src0": {"row": 1, "col": 1536}, "src1": {"row": 1536, "col": 576}}]}"#;
        let list = Whitelist::parse(text).unwrap();
        assert_eq!(list.pairs.len(), 2);
        assert_eq!(list.pairs[0], WhitelistPair { m: 64, k: 576, n: 1536, name: "ffn_up-0".into() });
        assert!(list.contains(1536, 576) && !list.contains(576, 576));
        assert_eq!(Whitelist::parse(&list.to_json()).unwrap(), list);
        let bad = r#"{"pairs": [{"src0": {"row": 1, "col": 64}, "src1": {"row": 32, "col": 16}}]}"#;
        assert!(Whitelist::parse(bad).unwrap_err().contains("differ"));
        assert!(Whitelist::parse("{}").is_err());
    }

    #[test]
    fn buckets_double_up_to_the_batch() {
        assert_eq!(buckets(16, 64), [16, 32, 64]);
        assert_eq!(buckets(1, 8), [1, 2, 4, 8]);
        assert_eq!(buckets(5, 64), [5, 10, 20, 40, 64]);
        assert_eq!(buckets(64, 64), [64]);
    }

    #[test]
    fn labels_follow_llama_cpp() {
        assert_eq!(label("", "blk.3.ffn_up.weight"), "ffn_up-3");
        assert_eq!(label("", "output.weight"), "output");
        assert_eq!(label("Qcur-0", "blk.0.attn_q.weight"), "Qcur-0");
    }
}
