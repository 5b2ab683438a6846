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
use pinfer::session::SessionOptions;

use crate::runtime::{CacheCheck, Runtime, RuntimeArgs};
use crate::signals::{check_interrupt, Polled};
use crate::CliError;

/// Options of `pinfer perplexity` (llama-perplexity's names).
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The text file.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
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
    let n_ctx = args.ctx;
    // Each chunk scores positions n_ctx/2 .. n_ctx-2: fewer than 4 leaves nothing (PPL = NaN).
    if n_ctx < 4 {
        return Err(CliError::new(format!(
            "-c {n_ctx}: a chunk scores the second half of its tokens, so it needs at least 4"
        )));
    }
    let path = crate::model_path(args.model);
    let text = crate::generate::read_text_file(&args.file)?;
    let runtime = Runtime::new(&args.runtime)?;
    let n_batch = args.batch.unwrap_or(n_ctx).clamp(1, n_ctx.min(512));
    let opts = SessionOptions { n_ctx, n_batch, logits_all: true, ..Default::default() };
    let mut session = runtime.load(&path, opts, 0)?;
    let mut check = CacheCheck::start(&session, &path);
    let tok = crate::generate::tokenizer(&path, session.gguf())?;
    // One stream, BOS first when the model adds one (llama-perplexity tokenizes with add_special).
    let tokens = crate::generate::encode(&tok, &text, false)?;
    let bos = tok.bos().filter(|_| tok.add_bos());
    let available = tokens.len() / n_ctx;
    let n_chunks = if args.chunks < 0 { available } else { available.min(args.chunks as usize) };
    if tokens.len() < 2 * n_ctx {
        return Err(CliError::new(format!(
            "{}: {} tokens; perplexity with a context of {n_ctx} needs at least {} (as llama-perplexity)",
            args.file.display(),
            tokens.len(),
            2 * n_ctx
        )));
    }
    errln!(
        "pinfer: {} tokens, {n_chunks} chunks of {n_ctx}, scoring the second half of each{}",
        tokens.len(),
        if bos.is_some() { " (BOS first in each chunk)" } else { "" }
    );
    let first = n_ctx / 2;
    let mut score = Score::default();
    let _polled = Polled::start();
    let t0 = Instant::now();
    let mut chunk = vec![0u32; n_ctx];
    for c in 0..n_chunks {
        check_interrupt()?;
        check.status()?;
        chunk.copy_from_slice(&tokens[c * n_ctx..(c + 1) * n_ctx]);
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        session.truncate(0);
        session
            .eval_all(&chunk, |i, logits| {
                if i >= first && i + 1 < n_ctx {
                    score.add(nll(logits, chunk[i + 1] as usize));
                }
            })
            .map_err(|e| CliError::new(e.to_string()))?;
        err!("[{}]{:.4},", c + 1, score.ppl());
    }
    errln!();
    errln!("pinfer: {n_chunks} chunks of {n_ctx} tokens in {:.2} s", t0.elapsed().as_secs_f64());
    check.finish()?;
    match score.error() {
        Some(e) => outln!("Final estimate: PPL = {:.4} +/- {e:.5}", score.ppl())?,
        None => outln!("Final estimate: PPL = {:.4}", score.ppl())?,
    }
    Ok(())
}
