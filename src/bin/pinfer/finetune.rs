//! `pinfer finetune -m MODEL -f DATA -o ADAPTER.gguf`: LoRA fine-tuning on the CPU.
//!
//! The data is a text file (cut into windows of `-c` tokens, every next token scored) or a JSONL
//! file of conversations (`{"messages": [{"role": ..., "content": ...}, ...]}` per line, the model's
//! chat template applied, only the assistant's tokens scored). `--val-split` of the windows or
//! conversations, spread evenly through the data, is held out; the rest is trained for `--epochs` in an order shuffled
//! by `--seed`, one window per step (`--grad-accum N`: N windows per update), with Adam(W) on the
//! adapters only: the base weights stay in the file's quantized layout, read in place.
//!
//! Before training the memory plan is printed; each step prints the loss, tokens/s and the time
//! left; the validation loss and perplexity are measured before the first epoch and after each.
//! Beside the adapter go `ADAPTER.csv` (the losses) and `ADAPTER.svg` (their curves). A checkpoint
//! (`ADAPTER.ckpt`: adapters, Adam's moments, the step, and fingerprints of the model, the
//! settings and the data) is written every `--save-every` steps, at the end of each epoch and on
//! Ctrl-C; `--resume` continues from it and refuses one from another run. A NaN or infinite loss
//! stops the run with the last checkpoint intact. Every file is written to a temporary file and
//! renamed, so a failed or interrupted run never leaves a truncated adapter or checkpoint.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use pinfer::chat::{ChatTemplate, Message, Role};
use pinfer::engine::{EngineConfig, Model, OnCaller};
use pinfer::exec::pool::Pool;
use pinfer::exec::{Address, Bound, Step};
use pinfer::gguf::write::{GgufWriter, TensorHeader};
use pinfer::gguf::{Gguf, Value};
use pinfer::graph::{plan, Graph, Plan};
use pinfer::loader::ModelFile;
use pinfer::model::lora::{write_adapter, PairValues};
use pinfer::model::HParams;
use pinfer::output_file::OutputFile;
use pinfer::quant::GgmlType;
use pinfer::tensor::TensorId;
use pinfer::train::lora::{build_lora_graph, LoraGraph, LoraSpec, TARGETS};
use pinfer::train::optim::{Adam, Schedule};
use pinfer::train::{arena_regions, backward};

use crate::CliError;

/// Nodes of a training graph (forward and backward of every layer at once).
const TRAIN_GRAPH_CAPACITY: usize = 32768;
type TrainGraph = Graph<TRAIN_GRAPH_CAPACITY>;

/// Short names of the adaptable projections, in [`TARGETS`] order.
const TARGET_NAMES: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// Options of `pinfer finetune`.
#[derive(Args, Debug)]
pub struct FinetuneArgs {
    /// The base model: an architecture whose blocks all have a backward (llama, qwen2, qwen3,
    /// gemma3, granite, smollm3, phi3; mixtures of experts and recurrent layers are refused).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Training data: a text file, or a JSONL file of conversations (`.jsonl`).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// The adapter to write (llama.cpp's LoRA GGUF; the CSV, SVG and checkpoint go beside it).
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// How to read the data: `text`, `chat` (JSONL conversations), or `auto` (chat for `.jsonl`).
    #[arg(long = "format", default_value = "auto", value_parser = ["auto", "text", "chat"])]
    pub format: String,
    /// The adapters' rank.
    #[arg(long = "lora-r", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub rank: u32,
    /// The adapters' alpha (their products are scaled by alpha / rank).
    #[arg(long = "lora-alpha", default_value_t = 16.0)]
    pub alpha: f32,
    /// The projections to adapt: a comma-separated list of q, k, v, o, gate, up, down (or `all`).
    #[arg(long = "lora-targets", default_value = "all")]
    pub targets: String,
    /// Passes over the training data.
    #[arg(long = "epochs", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub epochs: u32,
    /// Tokens per training window (the context of each step).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 256)]
    pub ctx: usize,
    /// Peak learning rate (linear warm-up over the first 10% of updates, cosine decay to 10%).
    #[arg(long = "lr", default_value_t = 1e-3)]
    pub lr: f32,
    /// AdamW's decoupled weight decay.
    #[arg(long = "weight-decay", default_value_t = 0.0)]
    pub weight_decay: f32,
    /// Largest gradient norm (0: no clipping).
    #[arg(long = "clip", default_value_t = 1.0)]
    pub clip: f32,
    /// Windows whose gradients are summed per update (bounds memory at one window).
    #[arg(long = "grad-accum", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub grad_accum: u32,
    /// Fraction of the windows (or conversations) held out for validation, spread evenly through
    /// the data.
    #[arg(long = "val-split", default_value_t = 0.1)]
    pub val_split: f64,
    /// Seed of the adapters' start and of the training order.
    #[arg(long = "seed", default_value_t = 42)]
    pub seed: u64,
    /// Threads.
    #[arg(short = 't', long = "threads", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Write a checkpoint every this many updates (0: only at the end of each epoch and on Ctrl-C).
    #[arg(long = "save-every", default_value_t = 50)]
    pub save_every: usize,
    /// The checkpoint file (default: ADAPTER.ckpt).
    #[arg(long = "checkpoint")]
    pub checkpoint: Option<PathBuf>,
    /// Continue from the checkpoint (it must come from the same model, settings and data).
    #[arg(long = "resume")]
    pub resume: bool,
    /// Stop after this many updates (for trials and benchmarks; the adapter is written).
    #[arg(long = "max-steps")]
    pub max_steps: Option<usize>,
    /// The chat template for JSONL data (default: the model's).
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
}

/// One training or validation window: `ctx` input ids and their next-token targets (-1: not scored).
struct Window {
    ids: Vec<i32>,
    targets: Vec<i32>,
}

impl Window {
    fn scored(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }
}

/// 64-bit FNV-1a, for fingerprints.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// A small deterministic generator (splitmix64) for the adapters' start and the order.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

fn parse_targets(text: &str) -> Result<u8, CliError> {
    if text == "all" {
        return Ok((1 << TARGETS.len()) - 1);
    }
    let mut bits = 0u8;
    for part in text.split(',').map(str::trim) {
        let i = TARGET_NAMES.iter().position(|n| *n == part).ok_or_else(|| {
            CliError::new(format!(
                "--lora-targets: unknown projection {part:?} (use {})",
                TARGET_NAMES.join(", ")
            ))
        })?;
        bits |= 1 << i;
    }
    Ok(bits)
}

/// The text windows: the file's tokens (with the model's BOS) cut into windows of `ctx` tokens,
/// each scoring the next token of every position (the last window may be shorter: padded, the
/// padding unscored).
fn text_windows(tokens: &[u32], ctx: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let mut start = 0;
    while start + 1 < tokens.len() {
        let end = (start + ctx).min(tokens.len() - 1);
        let mut ids: Vec<i32> = tokens[start..end].iter().map(|&t| t as i32).collect();
        let mut targets: Vec<i32> = tokens[start + 1..end + 1].iter().map(|&t| t as i32).collect();
        ids.resize(ctx, 0);
        targets.resize(ctx, -1);
        out.push(Window { ids, targets });
        start = end;
    }
    out
}

/// Token ids of a text (with special tokens parsed when asked).
type Encode<'a> = dyn Fn(&str, bool) -> Result<Vec<u32>, CliError> + 'a;

/// The conversation windows: each line's messages rendered with the template, only the
/// assistant's replies (with their end-of-turn marker) scored; a conversation longer than `ctx`
/// is cut (with a note).
fn chat_windows(
    file: &Path,
    text: &str,
    template: ChatTemplate,
    ctx: usize,
    encode: &Encode<'_>,
) -> Result<Vec<Window>, CliError> {
    let mut out = Vec::new();
    let mut cut = 0;
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: &str| CliError::new(format!("{}: line {}: {what}", file.display(), n + 1));
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(&format!("not JSON ({e})")))?;
        let messages =
            value.get("messages").and_then(|m| m.as_array()).ok_or_else(|| at("no \"messages\" array"))?;
        let mut turns = Vec::with_capacity(messages.len());
        for m in messages {
            let role = match m.get("role").and_then(|r| r.as_str()) {
                Some("system") => Role::System,
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                other => return Err(at(&format!("role {other:?} (system, user or assistant)"))),
            };
            let content = m
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| at("a message without text content"))?;
            turns.push(Message { role, content });
        }
        if !turns.iter().any(|m| m.role == Role::Assistant) {
            return Err(at("no assistant message: nothing to learn"));
        }
        let render = |upto: usize, open: bool| -> Result<String, CliError> {
            let mut s = String::new();
            template.render(&turns[..upto], open, &mut s).map_err(|e| at(&e.to_string()))?;
            Ok(s)
        };
        let full = encode(&render(turns.len(), false)?, true)?;
        let mut scored = vec![false; full.len()];
        for (i, m) in turns.iter().enumerate() {
            if m.role != Role::Assistant {
                continue;
            }
            let before = encode(&render(i, true)?, true)?;
            let through = encode(&render(i + 1, false)?, true)?;
            if !full.starts_with(&through) || !through.starts_with(&before) {
                return Err(at(
                    "the chat template's tokens change when a turn is added: cannot mark the replies",
                ));
            }
            scored[before.len()..through.len()].fill(true);
        }
        if full.len() > ctx + 1 {
            cut += 1;
        }
        let len = full.len().min(ctx + 1);
        let mut ids: Vec<i32> = full[..len - 1].iter().map(|&t| t as i32).collect();
        let mut targets: Vec<i32> = (1..len).map(|p| if scored[p] { full[p] as i32 } else { -1 }).collect();
        ids.resize(ctx, 0);
        targets.resize(ctx, -1);
        out.push(Window { ids, targets });
    }
    if cut > 0 {
        errln!(
            "pinfer: note: {cut} conversations are longer than -c {ctx} tokens: their ends are not trained"
        );
    }
    Ok(out)
}

/// The windows held out for validation: `fraction` of them (rounded up, at least one training
/// window left), spread evenly through the data (every k-th), so that validation samples the
/// whole text and not only its last part; the rest, in order, for training.
fn split(windows: Vec<Window>, fraction: f64) -> (Vec<Window>, Vec<Window>) {
    let n = windows.len();
    let n_val = if n > 1 { ((n as f64 * fraction).ceil() as usize).min(n - 1) } else { 0 };
    let held: Vec<usize> = (0..n_val).map(|i| (2 * i + 1) * n / (2 * n_val)).collect();
    let (mut train, mut val) = (Vec::with_capacity(n - n_val), Vec::with_capacity(n_val));
    for (i, w) in windows.into_iter().enumerate() {
        if held.contains(&i) {
            val.push(w);
        } else {
            train.push(w);
        }
    }
    (train, val)
}

/// The training graph with its gradients, planned.
struct Trainer {
    graph: Box<TrainGraph>,
    plan: Box<Plan<TRAIN_GRAPH_CAPACITY>>,
    lora: LoraGraph,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    /// Persistent bytes: inputs, parameters and gradients.
    persistent: usize,
}

impl Trainer {
    fn build(gguf: &Gguf<'_>, hp: &HParams, ctx: usize, spec: LoraSpec) -> Result<Self, CliError> {
        let fail = |e: pinfer::train::TrainError| CliError::new(format!("building the training graph: {e}"));
        let mut graph: Box<TrainGraph> = Box::new(Graph::new());
        let lora = build_lora_graph(&mut graph, gguf, hp, ctx, spec).map_err(fail)?;
        let params: Vec<TensorId> = lora.params().collect();
        let mut offset = lora.persistent_end;
        let grad_offsets: Vec<usize> = params
            .iter()
            .map(|&p| {
                let at = offset;
                offset += (graph.tensor(p).n_elements() * 4).next_multiple_of(64);
                at
            })
            .collect();
        let mut grads = params.clone();
        backward(&mut graph, lora.loss, &params, &grad_offsets, &mut grads).map_err(fail)?;
        graph.build_with_roots(&[lora.loss], &grads).map_err(|e| fail(e.into()))?;
        let plan =
            Box::new(plan(&graph).map_err(|e| CliError::new(format!("planning the training graph: {e}")))?);
        Ok(Self { graph, plan, lora, params, grads, persistent: offset })
    }

    fn n_params(&self) -> usize {
        self.params.iter().map(|&p| self.graph.tensor(p).n_elements()).sum()
    }
}

/// Everything a checkpoint must match to be resumed: model, settings and data.
fn fingerprint(model: &[u8], gguf: &Gguf<'_>, args: &FinetuneArgs, spec: LoraSpec, train: &[Window]) -> u64 {
    let mut h = fnv(FNV_START, &model[..gguf.data_start().min(model.len())]);
    h = fnv(h, &(model.len() as u64).to_le_bytes());
    let settings = format!(
        "r{} a{} t{} c{} lr{} wd{} clip{} acc{} e{} seed{}",
        spec.rank,
        spec.alpha,
        spec.targets,
        args.ctx,
        args.lr,
        args.weight_decay,
        args.clip,
        args.grad_accum,
        args.epochs,
        args.seed
    );
    h = fnv(h, settings.as_bytes());
    for w in train {
        h = fnv(h, bytemuck::cast_slice(&w.ids));
        h = fnv(h, bytemuck::cast_slice(&w.targets));
    }
    h
}

/// The optimizer's state between updates.
struct State {
    x: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Updates done.
    step: usize,
}

const CKPT_MAGIC: &str = "pinfer-lora-checkpoint";

fn write_checkpoint(path: &Path, inputs: &[&Path], state: &State, print: u64) -> Result<(), CliError> {
    let n = state.x.len() as u64;
    let header = |name| TensorHeader { name, ty: GgmlType::F32, n_dims: 1, ne: [n, 1, 1, 1] };
    let tensors = [header("x"), header("m"), header("v")];
    let fp = format!("{print:016x}");
    let metadata = [
        ("general.type", Value::String(CKPT_MAGIC.as_bytes())),
        ("finetune.fingerprint", Value::String(fp.as_bytes())),
        ("finetune.step", Value::U64(state.step as u64)),
    ];
    let out = OutputFile::create(path, inputs)?;
    let io = |e: std::io::Error| CliError::new(format!("writing {}: {e}", path.display()));
    let file = out.try_clone_file()?;
    let mut w = GgufWriter::start(std::io::BufWriter::new(file), &metadata, &tensors).map_err(io)?;
    for values in [&state.x, &state.m, &state.v] {
        w.write_tensor_data(bytemuck::cast_slice(values)).map_err(io)?;
    }
    let (buf, _) = w.finish().map_err(io)?;
    buf.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)?;
    out.commit()?;
    Ok(())
}

fn read_checkpoint(path: &Path, print: u64, n: usize) -> Result<State, CliError> {
    let bad = |what: &str| CliError::new(format!("{}: {what}", path.display()));
    let file = ModelFile::open(path)?;
    let gguf = file.parse()?;
    if gguf.get_str_opt("general.type").ok().flatten() != Some(CKPT_MAGIC) {
        return Err(bad("not a pinfer finetune checkpoint"));
    }
    let fp = gguf.get_str_opt("finetune.fingerprint").ok().flatten().unwrap_or("");
    if fp != format!("{print:016x}") {
        return Err(bad(
            "the checkpoint comes from another run (another model, data or settings): not resuming; \
             remove it or give another --checkpoint to start over",
        ));
    }
    let step = gguf.get_u64("finetune.step").map_err(|e| bad(&e.to_string()))? as usize;
    let read = |name: &str| -> Result<Vec<f32>, CliError> {
        let t = gguf.tensor(name).ok_or_else(|| bad(&format!("no tensor {name}")))?;
        if t.ty != GgmlType::F32 || t.ne[0] as usize != n {
            return Err(bad(&format!("tensor {name} does not fit this run")));
        }
        let values: Vec<f32> = gguf
            .tensor_data(&t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if values.iter().any(|v| !v.is_finite()) {
            return Err(bad(&format!("tensor {name} holds NaN or infinity")));
        }
        Ok(values)
    };
    Ok(State { x: read("x")?, m: read("m")?, v: read("v")?, step })
}

/// The losses so far, for the CSV and the plot.
#[derive(Default)]
struct Curve {
    /// (update, epoch, train loss, learning rate, seconds).
    train: Vec<(usize, f64, f32, f32, f64)>,
    /// (update, epoch, validation loss).
    val: Vec<(usize, f64, f64)>,
}

impl Curve {
    fn csv(&self) -> String {
        let mut s = String::from("step,epoch,train_loss,val_loss,val_ppl,lr,seconds\n");
        let mut rows: Vec<(usize, String)> = self
            .train
            .iter()
            .map(|&(step, epoch, loss, lr, secs)| {
                (step, format!("{step},{epoch:.4},{loss:.6},,,{lr:.3e},{secs:.1}\n"))
            })
            .chain(self.val.iter().map(|&(step, epoch, loss)| {
                (step, format!("{step},{epoch:.4},,{loss:.6},{:.4},,\n", loss.exp()))
            }))
            .collect();
        rows.sort_by_key(|r| r.0);
        rows.into_iter().for_each(|(_, r)| s.push_str(&r));
        s
    }

    /// An SVG line chart: the training loss per update (and its running mean), the validation
    /// loss as points.
    fn svg(&self, title: &str) -> String {
        let (w, h, pad) = (720.0f64, 400.0f64, 50.0f64);
        let steps =
            self.train.iter().map(|t| t.0).chain(self.val.iter().map(|v| v.0)).max().unwrap_or(1).max(1)
                as f64;
        let losses = self.train.iter().map(|t| f64::from(t.2)).chain(self.val.iter().map(|v| v.2));
        let (lo, hi) = losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), l| (a.min(l), b.max(l)));
        let (lo, hi) = if lo.is_finite() && hi > lo { (lo, hi) } else { (0.0, 1.0) };
        let x = |s: f64| pad + (w - 2.0 * pad) * s / steps;
        let y = |l: f64| h - pad - (h - 2.0 * pad) * (l - lo) / (hi - lo);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{pad}\" y=\"20\">{}</text>\n",
            xml_escape(title)
        );
        let _ = writeln!(
            s,
            "<line x1=\"{pad}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/><line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{0}\" stroke=\"black\"/>",
            h - pad,
            w - pad
        );
        for i in 0..=4 {
            let l = lo + (hi - lo) * f64::from(i) / 4.0;
            let _ = writeln!(s, "<text x=\"5\" y=\"{:.1}\">{l:.2}</text>", y(l) + 4.0);
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\">update {}</text>",
            w - pad - 60.0,
            h - 15.0,
            steps as usize
        );
        let line = |points: Vec<(f64, f64)>, color: &str| {
            let pts: Vec<String> = points.iter().map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b))).collect();
            format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                pts.join(" ")
            )
        };
        s.push_str(&line(self.train.iter().map(|t| (t.0 as f64, f64::from(t.2))).collect(), "#9ecae1"));
        // The running mean over the last 10 updates.
        let mean: Vec<(f64, f64)> = (0..self.train.len())
            .map(|i| {
                let from = i.saturating_sub(9);
                let slice = &self.train[from..=i];
                (
                    self.train[i].0 as f64,
                    slice.iter().map(|t| f64::from(t.2)).sum::<f64>() / slice.len() as f64,
                )
            })
            .collect();
        s.push_str(&line(mean, "#08519c"));
        for &(step, _, loss) in &self.val {
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"#e6550d\"/>",
                x(step as f64),
                y(loss)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{0}\" y=\"{1}\" fill=\"#08519c\">training loss (mean of 10)</text><text x=\"{0}\" y=\"{2}\" fill=\"#e6550d\">validation loss</text>",
            w - pad - 200.0,
            pad + 10.0,
            pad + 26.0
        );
        s.push_str("</svg>\n");
        s
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `path` with its extension replaced by `ext`.
fn beside(path: &Path, ext: &str) -> PathBuf {
    path.with_extension(ext)
}

fn write_text(path: &Path, inputs: &[&Path], text: &str) -> Result<(), CliError> {
    let mut out = OutputFile::create(path, inputs)?;
    out.file()
        .write_all(text.as_bytes())
        .map_err(|e| CliError::new(format!("writing {}: {e}", path.display())))?;
    out.commit()?;
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// Runs the graph on `window` with the parameters `x`; adds the gradients into `grad` and returns
/// (the window's mean loss, its scored tokens).
fn run_window(
    bound: &mut Bound<'_, TRAIN_GRAPH_CAPACITY>,
    pool: &Pool,
    trainer: &Trainer,
    window: &Window,
    x: &[f32],
    grad: Option<&mut [f32]>,
) -> Result<(f32, usize), CliError> {
    bound.data_mut(trainer.lora.ids).copy_from_slice(bytemuck::cast_slice(&window.ids));
    bound.data_mut(trainer.lora.targets).copy_from_slice(bytemuck::cast_slice(&window.targets));
    let mut at = 0;
    for &p in &trainer.params {
        let values: &mut [f32] = bytemuck::cast_slice_mut(bound.data_mut(p));
        values.copy_from_slice(&x[at..at + values.len()]);
        at += values.len();
    }
    pool.run(bound, Step::default()).map_err(|e| CliError::new(format!("training step: {e}")))?;
    if let Some(grad) = grad {
        let mut at = 0;
        for &d in &trainer.grads {
            let values: &[f32] = bytemuck::cast_slice(bound.data(d));
            grad[at..at + values.len()].iter_mut().zip(values).for_each(|(g, v)| *g += v);
            at += values.len();
        }
    }
    let loss = bound.data_f32(trainer.lora.loss).first().copied().unwrap_or(f32::NAN);
    Ok((loss, window.scored()))
}

pub fn run(args: FinetuneArgs) -> Result<(), CliError> {
    // The training graph (tens of thousands of nodes) and its plan are made on the stack before
    // they reach the heap in unoptimized builds: train on a thread with room for them.
    std::thread::Builder::new()
        .name("pinfer-finetune".into())
        .stack_size(512 << 20)
        .spawn(move || train(args))
        .map_err(|e| CliError::new(format!("starting the training thread: {e}")))?
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn train(args: FinetuneArgs) -> Result<(), CliError> {
    let start = Instant::now();
    let targets = parse_targets(&args.targets)?;
    if !(args.lr > 0.0 && args.lr.is_finite() && args.alpha > 0.0 && args.alpha.is_finite()) {
        return Err(CliError::new("--lr and --lora-alpha must be positive numbers".into()));
    }
    if !(0.0..1.0).contains(&args.val_split) {
        return Err(CliError::new("--val-split is a fraction in [0, 1)".into()));
    }
    if args.ctx < 2 {
        return Err(CliError::new("-c: a window needs at least 2 tokens".into()));
    }
    let ckpt_path = args.checkpoint.clone().unwrap_or_else(|| beside(&args.output, "ckpt"));
    let (csv_path, svg_path) = (beside(&args.output, "csv"), beside(&args.output, "svg"));
    let outputs = [&args.output, &ckpt_path, &csv_path, &svg_path];
    for (i, a) in outputs.iter().enumerate() {
        if *a == &args.model || *a == &args.file || outputs[..i].contains(a) {
            return Err(CliError::new(format!(
                "{}: an output would overwrite an input or another output",
                a.display()
            )));
        }
    }

    // Every output's directory must take it before hours of training: the adapter's temporary
    // file is made now (and renamed over the adapter at the end).
    let inputs: [&Path; 2] = [&args.model, &args.file];
    let adapter_out = OutputFile::create(&args.output, &inputs)?;
    for p in [&ckpt_path, &csv_path, &svg_path] {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !dir.is_dir() {
            return Err(CliError::new(format!("{}: no such directory", dir.display())));
        }
    }

    let model = ModelFile::open_static(&args.model)?;
    let gguf = model.parse()?;
    let model_name = args.model.display();
    if pinfer::repack_cache::is_cache(&gguf) {
        return Err(CliError::new(format!(
            "{model_name} is a pinfer repack cache (weights in pinfer's packed layout): fine-tune the original GGUF"
        )));
    }
    // (Checked as for inference: hyper-parameters, vocabulary, every tensor's shape.)
    let hp = pinfer::engine::Model::from_gguf(model.bytes(), model.parse()?)
        .map_err(|e| CliError::new(format!("{model_name}: {e}")))?
        .hparams()
        .clone();
    let spec = LoraSpec { rank: args.rank as usize, alpha: args.alpha, targets };
    if args.ctx > hp.n_ctx_train as usize {
        return Err(CliError::new(format!(
            "-c {}: the model was trained on {} tokens at most",
            args.ctx, hp.n_ctx_train
        )));
    }

    // The data.
    let text =
        std::fs::read(&args.file).map_err(|e| CliError::new(format!("{}: {e}", args.file.display())))?;
    let text = String::from_utf8(text).map_err(|e| {
        CliError::new(format!(
            "{}: not UTF-8 text (byte {})",
            args.file.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    let tok = crate::tokenize::tokenizer(&args.model, &gguf)?;
    let chat = match args.format.as_str() {
        "chat" => true,
        "text" => false,
        _ => args.file.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl")),
    };
    let encode = |s: &str, special: bool| crate::tokenize::encode_with(&tok, s, special, true);
    let windows = if chat {
        let template = crate::chat::template_for(args.chat_template.as_deref(), &gguf, &args.model)?;
        chat_windows(&args.file, &text, template, args.ctx, &encode)?
    } else {
        text_windows(&encode(&text, false)?, args.ctx)
    };
    let (train, val) = split(windows, args.val_split);
    let (train, val) = (train.as_slice(), val.as_slice());
    if train.iter().all(|w| w.scored() == 0) {
        return Err(CliError::new(format!("{}: no tokens to train on", args.file.display())));
    }
    let train_tokens: usize = train.iter().map(Window::scored).sum();
    let val_tokens: usize = val.iter().map(Window::scored).sum();
    errln!(
        "pinfer: finetune: {} windows of {} tokens for training ({train_tokens} scored), {} for validation ({val_tokens} scored), {}",
        train.len(),
        args.ctx,
        val.len(),
        if chat { "conversations, the assistant's replies scored" } else { "text" }
    );

    // The graph, its memory, the threads.
    let trainer = Trainer::build(&gguf, &hp, args.ctx, spec)?;
    let n = trainer.n_params();
    let (activations, work, total) = arena_regions(&trainer.graph, &trainer.plan, trainer.persistent);
    // The forward matmuls read the weights repacked for the SIMD kernels, as inference does (the
    // backward ones read the file's blocks): an inference engine of one token does the repacking.
    let engine_fail = |e: pinfer::engine::EngineError| CliError::new(format!("{model_name}: repacking: {e}"));
    let config = EngineConfig { n_ctx: 8, n_batch: 1, ..EngineConfig::default() };
    let planned = pinfer::engine::heap::plan(
        Model::from_gguf(model.bytes(), model.parse()?).map_err(engine_fail)?,
        &config,
    )
    .map_err(engine_fail)?;
    let mut engine_memory = vec![0u8; planned.layout().bytes_needed()];
    let mut engine = planned.bind(engine_memory.as_mut_slice()).map_err(engine_fail)?;
    engine.repack(&OnCaller, &|_| {}).map_err(engine_fail)?;
    let engine_memory_len = engine.memory().len();
    let optimizer_bytes = 4 * n * 4; // x, m, v and the accumulated gradient, beside the arena
    errln!(
        "pinfer: memory plan: {:.1} MiB = adapters and gradients {:.1} (rank {}, {} weights, {n} parameters) + activations {:.1} + work {:.1} + optimizer state {:.1} + repacked weights {:.1}; model {:.1} MiB mapped (its weights stay in {}); graph {} nodes",
        mib(total + optimizer_bytes + engine_memory_len),
        mib(trainer.persistent),
        spec.rank,
        trainer.lora.adapted.len(),
        mib(activations.len),
        mib(work.len),
        mib(optimizer_bytes),
        mib(engine_memory_len),
        mib(model.bytes().len()),
        gguf.tensor("blk.0.attn_q.weight").map_or("the file's types".to_string(), |t| format!("{} as in the file", t.ty)),
        trainer.graph.order().len()
    );

    let mut memory = vec![0u64; total.div_ceil(8)];
    let arena: &mut [u8] = bytemuck::cast_slice_mut(memory.as_mut_slice());
    let buffers = [model.bytes()];
    // The address table on the heap, one entry a tensor: binding takes no stack for it.
    let mut addresses = vec![Address::NOWHERE; trainer.graph.tensors().len()];
    let mut bound =
        Bound::new(&trainer.graph, &trainer.plan, &buffers, arena, activations, work, &mut addresses)
            .map_err(|e| CliError::new(format!("binding the training graph: {e}")))?
            .with_packed(engine.packed_buffer(), engine.planned().packed_entries());
    let threads = crate::worker_threads(args.threads);
    let pool = Pool::new(threads, None, false)
        .map_err(|e| CliError::new(format!("starting {threads} threads: {e}")))?;

    // The start: A uniform in ±1/sqrt(n_in) (as PEFT's Kaiming start), B zero: the model itself.
    let print = fingerprint(model.bytes(), &gguf, &args, spec, train);
    let updates_per_epoch = train.len().div_ceil(args.grad_accum as usize);
    let total_updates = (updates_per_epoch * args.epochs as usize).min(args.max_steps.unwrap_or(usize::MAX));
    let mut state = if args.resume {
        let s = read_checkpoint(&ckpt_path, print, n)?;
        errln!("pinfer: finetune: resuming from {} at update {}", ckpt_path.display(), s.step);
        s
    } else {
        if ckpt_path.exists() {
            errln!(
                "pinfer: note: {} exists and is replaced at the first save (--resume continues from it)",
                ckpt_path.display()
            );
        }
        let mut rng = Rng(args.seed);
        let mut x = Vec::with_capacity(n);
        for (i, &p) in trainer.params.iter().enumerate() {
            let t = trainer.graph.tensor(p);
            if i % 2 == 0 {
                let bound = 1.0 / (t.ne[0] as f32).sqrt();
                x.extend((0..t.n_elements()).map(|_| rng.uniform() * bound));
            } else {
                x.extend(std::iter::repeat_n(0.0, t.n_elements()));
            }
        }
        State { x, m: vec![0.0; n], v: vec![0.0; n], step: 0 }
    };
    let adam = Adam {
        lr: args.lr,
        weight_decay: args.weight_decay,
        clip_norm: args.clip,
        schedule: Schedule::Cosine { warmup: (total_updates / 10).max(1), min_fraction: 0.1 },
        ..Adam::default()
    };

    let save =
        |state: &State| -> Result<(), CliError> { write_checkpoint(&ckpt_path, &inputs, state, print) };
    let _polled = crate::signals::Polled::start();
    let mut curve = Curve::default();
    let mut grad = vec![0f32; n];
    let validate =
        |bound: &mut Bound<'_, TRAIN_GRAPH_CAPACITY>, x: &[f32]| -> Result<Option<f64>, CliError> {
            let (mut sum, mut count) = (0f64, 0usize);
            for w in val {
                let (loss, scored) = run_window(bound, &pool, &trainer, w, x, None)?;
                if scored > 0 {
                    sum += f64::from(loss) * scored as f64;
                    count += scored;
                }
            }
            Ok((count > 0).then(|| sum / count as f64))
        };
    let report_val = |curve: &mut Curve, step: usize, epoch: f64, loss: Option<f64>| {
        if let Some(l) = loss {
            errln!("pinfer: finetune: update {step}: validation loss {l:.4}, perplexity {:.3}", l.exp());
            curve.val.push((step, epoch, l));
        }
    };
    let first_val = validate(&mut bound, &state.x)?;
    report_val(&mut curve, state.step, state.step as f64 / updates_per_epoch as f64, first_val);

    let train_start = Instant::now();
    let mut trained_tokens = 0usize;
    let done_at_start = state.step;
    let mut order: Vec<usize> = (0..train.len()).collect();
    'epochs: for epoch in 0..args.epochs as usize {
        let mut rng = Rng(args.seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9));
        rng.shuffle(&mut order);
        for (u, group) in order.chunks(args.grad_accum as usize).enumerate() {
            let step = epoch * updates_per_epoch + u;
            if step < state.step {
                continue; // done before the checkpoint
            }
            if step >= total_updates {
                break 'epochs;
            }
            if crate::signals::take_interrupt() {
                save(&state)?;
                errln!(
                    "pinfer: finetune: interrupted at update {step}: checkpoint {} (continue with --resume)",
                    ckpt_path.display()
                );
                return Err(CliError::Interrupted);
            }
            grad.fill(0.0);
            let (mut loss_sum, mut scored_sum) = (0f64, 0usize);
            for &i in group {
                let (loss, scored) =
                    run_window(&mut bound, &pool, &trainer, &train[i], &state.x, Some(&mut grad))?;
                if !loss.is_finite() {
                    return Err(CliError::new(format!(
                        "update {step}: the loss is {loss}: training diverged (lower --lr); the last checkpoint ({}) is kept",
                        ckpt_path.display()
                    )));
                }
                loss_sum += f64::from(loss) * scored as f64;
                scored_sum += scored;
                trained_tokens += args.ctx;
            }
            // The mean of the windows' mean losses' gradients, weighted as their losses.
            let scale = 1.0 / group.len() as f32;
            grad.iter_mut().for_each(|g| *g *= scale);
            if grad.iter().any(|g| !g.is_finite()) {
                return Err(CliError::new(format!(
                    "update {step}: the gradient is not finite: training diverged (lower --lr); the last checkpoint ({}) is kept",
                    ckpt_path.display()
                )));
            }
            let State { x, m, v, .. } = &mut state;
            adam.update(step, total_updates, x, &grad, m, v);
            state.step = step + 1;
            let loss = if scored_sum > 0 { (loss_sum / scored_sum as f64) as f32 } else { 0.0 };
            let secs = train_start.elapsed().as_secs_f64();
            let rate = trained_tokens as f64 / secs.max(1e-9);
            let left = (total_updates - state.step) as f64 * secs / (state.step - done_at_start) as f64;
            let lr = args.lr * adam.schedule.factor(step, total_updates);
            errln!(
                "pinfer: finetune: epoch {}/{} update {}/{total_updates}: loss {loss:.4}, lr {lr:.2e}, {rate:.1} tokens/s, ETA {}",
                epoch + 1,
                args.epochs,
                state.step,
                duration(left)
            );
            curve.train.push((
                state.step,
                state.step as f64 / updates_per_epoch as f64,
                loss,
                lr,
                start.elapsed().as_secs_f64(),
            ));
            if args.save_every > 0 && state.step % args.save_every == 0 {
                save(&state)?;
            }
        }
        save(&state)?;
        let val_loss = validate(&mut bound, &state.x)?;
        report_val(&mut curve, state.step, state.step as f64 / updates_per_epoch as f64, val_loss);
    }
    if curve.val.last().is_none_or(|v| v.0 != state.step) {
        save(&state)?;
        let val_loss = validate(&mut bound, &state.x)?;
        report_val(&mut curve, state.step, state.step as f64 / updates_per_epoch as f64, val_loss);
    }

    // The adapter, then the curves.
    let mut pairs = Vec::with_capacity(trainer.lora.adapted.len());
    let mut at = 0;
    for a in &trainer.lora.adapted {
        let (ta, tb) = (trainer.graph.tensor(a.a), trainer.graph.tensor(a.b));
        let (na, nb) = (ta.n_elements(), tb.n_elements());
        pairs.push(PairValues {
            target: a.target.as_str(),
            n_in: ta.ne[0],
            n_out: tb.ne[1],
            a: &state.x[at..at + na],
            b: &state.x[at + na..at + na + nb],
        });
        at += na + nb;
    }
    let out = adapter_out;
    let file = out.try_clone_file()?;
    write_adapter(std::io::BufWriter::new(file), hp.arch.name(), spec.rank, spec.alpha, &pairs)
        .and_then(|w| w.into_inner().map_err(|e| e.into_error()))
        .and_then(|f| f.sync_all())
        .map_err(|e| CliError::new(format!("writing {}: {e}", args.output.display())))?;
    out.commit()?;
    write_text(&csv_path, &inputs, &curve.csv())?;
    let title = format!(
        "pinfer finetune {} on {} (rank {}, lr {})",
        model_name,
        args.file.display(),
        spec.rank,
        args.lr
    );
    write_text(&svg_path, &inputs, &curve.svg(&title))?;
    let secs = train_start.elapsed().as_secs_f64();
    outln!(
        "finetuned {model_name}: {} updates, {trained_tokens} tokens in {} ({:.1} tokens/s); adapter {} (loss curves {}, {})",
        state.step - done_at_start,
        duration(secs),
        trained_tokens as f64 / secs.max(1e-9),
        args.output.display(),
        csv_path.display(),
        svg_path.display()
    )?;
    if let (Some(first), Some(last)) = (first_val, curve.val.last()) {
        outln!("validation perplexity {:.3} -> {:.3}", first.exp(), last.2.exp())?;
    }
    Ok(())
}
