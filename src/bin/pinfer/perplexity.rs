//! `pinfer perplexity`: scored as llama.cpp's `llama-perplexity` scores it, so the numbers compare.
//!
//! The text is tokenized as one stream (BOS first when the model adds one), cut into chunks of the
//! context size (a trailing part shorter than a chunk is dropped), and each chunk is evaluated from
//! an empty cache with its first token replaced by BOS (when the model adds one). The second half
//! of each chunk is scored: position i (from n_ctx/2 to n_ctx-2) predicts token i+1. The estimate
//! is exp(mean NLL) ± exp(mean NLL)·sqrt(var(NLL)/(count-1)), llama.cpp's formula.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use pinfer::session::{Session, SessionOptions};

use crate::kl_divergence::{KlStats, Reader, Writer};
use crate::runtime::{CacheCheck, Runtime, RuntimeArgs};
use crate::signals::{check_interrupt, Polled};
use crate::CliError;

/// Options of `pinfer perplexity` (llama-perplexity's names).
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The text file (not needed with --kl-divergence: the tokens come from the logits file).
    #[arg(short = 'f', long = "file", required_unless_present = "kl_divergence")]
    pub file: Option<PathBuf>,
    /// llama.cpp's logits file: written while scoring (as `llama-perplexity --kl-divergence-base`),
    /// or, with --kl-divergence, read and compared with this model's logits.
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    pub kl_base: Option<PathBuf>,
    /// Compare this model with the logits in --kl-divergence-base (KL divergence, top-token
    /// agreement, Δp, PPL ratio), as llama-perplexity --kl-divergence.
    #[arg(long = "kl-divergence", requires = "kl_base")]
    pub kl_divergence: bool,
    /// Chunk (context) size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks (-1: all).
    #[arg(long = "chunks", default_value_t = -1, allow_negative_numbers = true)]
    pub chunks: i64,
    /// Most tokens per graph evaluation.
    #[arg(short = 'b', long = "batch-size")]
    pub batch: Option<usize>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// The running sums of the score.
#[derive(Default)]
struct Score {
    nll: f64,
    nll2: f64,
    count: usize,
}

impl Score {
    fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// llama.cpp's ± of the estimate (None with fewer than two scored tokens).
    fn error(&self) -> Option<f64> {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (self.count > 1 && var > 0.0).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }
}

/// Negative log-likelihood of `target` under `logits` (log-softmax in f64).
fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
    sum.ln() - f64::from(logits[target] - max)
}

pub fn run(args: PerplexityArgs) -> Result<(), CliError> {
    let path = crate::model_path(args.model.clone())?;
    let runtime = Runtime::new(&args.runtime)?;
    if args.kl_divergence {
        return kl_divergence(&args, &path, &runtime);
    }
    let n_ctx = check_ctx(args.ctx)?;
    let file = args.file.as_deref().unwrap_or(std::path::Path::new("-"));
    let mut text = crate::text_input::read_text_file(file)?;
    // llama.cpp's -f drops one trailing newline.
    if text.ends_with('\n') {
        text.pop();
    }
    let mut session = load(&runtime, &path, n_ctx, args.batch)?;
    let mut check = CacheCheck::start(&session, &path);
    let tok = crate::tokenize::tokenizer(&path, session.gguf())?;
    // One stream, BOS first when the model adds one (llama-perplexity tokenizes with add_special).
    let tokens = crate::tokenize::encode(&tok, &text, false)?;
    let bos = tok.bos().filter(|_| tok.add_bos());
    if tokens.len() < 2 * n_ctx {
        return Err(CliError::new(format!(
            "{}: {} tokens; perplexity with a context of {n_ctx} needs at least {} (as llama-perplexity)",
            file.display(),
            tokens.len(),
            2 * n_ctx
        )));
    }
    let available = tokens.len() / n_ctx;
    let n_chunks = if args.chunks < 0 { available } else { available.min(args.chunks as usize) };
    let tokens = &tokens[..n_chunks * n_ctx];
    let mut logits_file = match &args.kl_base {
        Some(out) => Some(Writer::create(out, &[&path, file], n_ctx, session.n_vocab(), tokens)?),
        None => None,
    };
    errln!(
        "pinfer: {} tokens, {n_chunks} chunks of {n_ctx}, scoring the second half of each{}",
        tokens.len(),
        if bos.is_some() { " (BOS first in each chunk)" } else { "" }
    );
    let mut score = Score::default();
    let t0 = Instant::now();
    for_each_scored(&mut session, &mut check, tokens, n_ctx, bos, |event| {
        match event {
            Scored::Position { logits, target } => score.add(match logits_file.as_mut() {
                None => nll(logits, target),
                Some(w) => w.row(logits, target)?,
            }),
            Scored::ChunkDone(c) => err!("[{}]{:.4},", c + 1, score.ppl()),
        }
        Ok(())
    })?;
    errln!();
    errln!("pinfer: {n_chunks} chunks of {n_ctx} tokens in {:.2} s", t0.elapsed().as_secs_f64());
    let _polled = Polled::start();
    check.finish()?;
    if let Some(w) = logits_file {
        check_interrupt()?;
        w.commit()?;
    }
    match score.error() {
        Some(e) => outln!("Final estimate: PPL = {:.4} +/- {e:.5}", score.ppl())?,
        None => outln!("Final estimate: PPL = {:.4}", score.ppl())?,
    }
    Ok(())
}

/// What [`for_each_scored`] reports.
enum Scored<'a> {
    /// A scored position: its logits and the true next token.
    Position { logits: &'a [f32], target: usize },
    /// Chunk `c` (from 0) is done.
    ChunkDone(usize),
}

/// Evaluates each chunk of `n_ctx` of `tokens` from an empty cache (BOS first when `bos`) and
/// reports every scored position (n_ctx/2 .. n_ctx-2) and the end of each chunk to `each`.
/// SIGINT and a damaged repack cache stop it between chunks.
fn for_each_scored(
    session: &mut Session,
    check: &mut CacheCheck,
    tokens: &[u32],
    n_ctx: usize,
    bos: Option<u32>,
    mut each: impl FnMut(Scored<'_>) -> Result<(), CliError>,
) -> Result<(), CliError> {
    let first = n_ctx / 2;
    let _polled = Polled::start();
    let mut input = vec![0u32; n_ctx];
    for (c, chunk) in tokens.chunks_exact(n_ctx).enumerate() {
        check_interrupt()?;
        check.status()?;
        input.copy_from_slice(chunk);
        if let Some(bos) = bos {
            input[0] = bos;
        }
        let _ = session.truncate(0);
        let mut failed = Ok(());
        session
            .eval_all(&input, |i, logits| {
                if i >= first && i + 1 < n_ctx && failed.is_ok() {
                    failed = each(Scored::Position { logits, target: chunk[i + 1] as usize });
                }
            })
            .map_err(|e| CliError::new(e.to_string()))?;
        failed?;
        each(Scored::ChunkDone(c))?;
    }
    Ok(())
}

/// Each chunk scores positions n_ctx/2 .. n_ctx-2: fewer than 4 leaves nothing (PPL = NaN).
fn check_ctx(n_ctx: usize) -> Result<usize, CliError> {
    if n_ctx < 4 {
        return Err(CliError::new(format!(
            "-c {n_ctx}: a chunk scores the second half of its tokens, so it needs at least 4"
        )));
    }
    Ok(n_ctx)
}

fn load(
    runtime: &Runtime,
    path: &std::path::Path,
    n_ctx: usize,
    batch: Option<usize>,
) -> Result<Session, CliError> {
    let n_batch = batch.unwrap_or(n_ctx).clamp(1, n_ctx.min(512));
    let opts = SessionOptions { n_ctx, n_batch, logits_all: true, ..Default::default() };
    runtime.load(path, opts, 0)
}

/// `--kl-divergence`: this model against the logits file, chunk by chunk, as llama-perplexity.
fn kl_divergence(args: &PerplexityArgs, path: &std::path::Path, runtime: &Runtime) -> Result<(), CliError> {
    let Some(base) = args.kl_base.as_deref() else {
        return Err(CliError::new(
            "--kl-divergence compares with --kl-divergence-base FILE: give the file".into(),
        ));
    };
    // The vocabulary size is checked against the model's before any logit is computed.
    let n_vocab = {
        let model = pinfer::loader::ModelFile::open(path)?;
        let gguf = model.parse()?;
        pinfer::model::validate_vocab(&gguf)
            .map_err(|e| CliError::new(format!("{}: {e}", path.display())))?
            .n_vocab
    };
    let mut reader = Reader::open(base, n_vocab as usize)?;
    let n_ctx = check_ctx(reader.n_ctx)?;
    if args.ctx != n_ctx && args.ctx != 512 {
        errln!("pinfer: note: the logits file was made with -c {n_ctx}: using it (not -c {})", args.ctx);
    }
    let mut session = load(runtime, path, n_ctx, args.batch)?;
    let mut check = CacheCheck::start(&session, path);
    let tok = crate::tokenize::tokenizer(path, session.gguf())?;
    let bos = tok.bos().filter(|_| tok.add_bos());
    let available = reader.n_chunk;
    let n_chunks = if args.chunks < 0 { available } else { available.min(args.chunks as usize) };
    errln!("pinfer: kl_divergence: {n_chunks} chunks of {n_ctx} from {}", base.display());
    let mut stats = KlStats::default();
    outln!(
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
    )?;
    let tokens = std::mem::take(&mut reader.tokens);
    for_each_scored(
        &mut session,
        &mut check,
        &tokens[..n_chunks * n_ctx],
        n_ctx,
        bos,
        |event| match event {
            Scored::Position { logits, target } => stats.add(logits, &mut reader, target),
            Scored::ChunkDone(c) => outln!("{}", stats.chunk_line(c + 1)),
        },
    )?;
    check.finish()?;
    outln!()?;
    out!("{}", stats.summary())?;
    Ok(())
}
