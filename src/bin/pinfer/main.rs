//! The `pinfer` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pinfer::loader::DEFAULT_MODEL_PATH;
use pinfer::sampler::SamplerConfig;

// First: its macros are visible only in the modules declared after it.
#[macro_use]
mod streams;

mod bench;
mod generate;
mod info;
mod npu;
mod quantize;
mod repack;
mod runtime;
mod signals;

use runtime::RuntimeArgs;

#[derive(Parser)]
#[command(name = "pinfer", version = pinfer::VERSION, about = "Run GGUF language models fast on RK3588-class ARM boards")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streams it; timings on stderr).
    Generate {
        /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// The prompt. Special-token text such as <|im_start|> becomes the special token.
        #[arg(short = 'p', long = "prompt")]
        prompt: String,
        /// Number of tokens to generate.
        #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
        n_predict: usize,
        /// Temperature (0: greedy).
        #[arg(long = "temp", default_value_t = 0.8)]
        temp: f32,
        /// Keep the K most likely tokens (0: all).
        #[arg(long = "top-k", default_value_t = 40)]
        top_k: u32,
        /// Keep the most likely tokens up to this total probability (1: all).
        #[arg(long = "top-p", default_value_t = 0.95)]
        top_p: f32,
        /// Drop tokens less likely than this fraction of the most likely one.
        #[arg(long = "min-p", default_value_t = 0.05)]
        min_p: f32,
        /// Penalty for repeating the last 64 tokens (1: off).
        #[arg(long = "repeat-penalty", default_value_t = 1.0)]
        repeat_penalty: f32,
        /// Random seed.
        #[arg(long = "seed", default_value_t = SamplerConfig::DEFAULT_SEED)]
        seed: u64,
        /// Context size in tokens (0: min(4096, the model's maximum)).
        #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
        ctx: usize,
        #[command(flatten)]
        runtime: RuntimeArgs,
        /// Print the generated token ids, space-separated, on the last line.
        #[arg(long = "print-ids")]
        print_ids: bool,
        /// Treat special-token text in the prompt as plain text.
        #[arg(long = "no-parse-special")]
        no_parse_special: bool,
        /// Keep generating past end-of-generation tokens (benchmarks).
        #[arg(long = "ignore-eos")]
        ignore_eos: bool,
        /// Keep the file's weight layouts instead of repacking them (A/B comparisons; also
        /// PINFER_NO_REPACK=1).
        #[arg(long = "no-repack")]
        no_repack: bool,
        /// Force a kernel path: ref, neon, dotprod, fp16 (dotprod with llama.cpp's aarch64 f16
        /// attention arithmetic) or avx2 (also PINFER_KERNELS).
        #[arg(long = "kernels")]
        kernels: Option<String>,
        /// Print load details on stderr before the first token: board, workers and their cores,
        /// scheduling, memory plan, placement summary, kernels (-vv: every tensor's placement).
        #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
        verbose: u8,
    },
    /// Describe a model file: architecture, size, quant mix, hyper-parameters, tokenizer.
    Info {
        /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// Also list every tensor (name, type, shape, bytes).
        #[arg(long)]
        tensors: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Also print every tensor's placement (repacked layout, mapped, NPU) with the reason, and
        /// the bytes per buffer kind.
        #[arg(long)]
        placement: bool,
        /// Plan the placement without repacking (as `--no-repack` runs; also PINFER_NO_REPACK=1).
        #[arg(long = "no-repack")]
        no_repack: bool,
    },
    /// List the embedded board profiles, and what `--board auto` finds on this machine.
    Boards {
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Tokenize a text with a model's vocabulary (vocabulary-only files work too).
    Tokenize {
        /// Model file (GGUF).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// The text.
        #[arg(short = 'p', long = "prompt")]
        prompt: String,
        /// Print only the ids, space-separated, on one line.
        #[arg(long)]
        ids: bool,
        /// Turn special-token text such as <|im_start|> into the special token.
        #[arg(long = "parse-special")]
        parse_special: bool,
    },
    /// Chat interactively with the model's chat template (one message per line; empty line ends).
    Chat {
        /// Model file (GGUF).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// System message.
        #[arg(long)]
        system: Option<String>,
        /// Context size in tokens (0: min(4096, the model's maximum)).
        #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
        ctx: usize,
        #[command(flatten)]
        runtime: RuntimeArgs,
        /// Most tokens per reply.
        #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
        n_predict: usize,
        /// Temperature (0: greedy).
        #[arg(long = "temp", default_value_t = 0.8)]
        temp: f32,
        /// Random seed.
        #[arg(long = "seed", default_value_t = SamplerConfig::DEFAULT_SEED)]
        seed: u64,
    },
    /// Perplexity of a text file, scored like llama.cpp's perplexity tool (prints `PPL = X`).
    Perplexity {
        /// Model file (GGUF).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// The text file.
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Chunk (context) size in tokens.
        #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
        ctx: usize,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Measure prompt-processing and generation speed (llama-bench style).
    Bench(bench::BenchArgs),
    /// Show which matmuls go to the NPU (--npu auto or a whitelist), the extra memory, and write
    /// the whitelist (-o FILE).
    NpuPlan(npu::NpuPlanArgs),
    /// Check the hardware: `--npu` runs every planned matmul shape on the NPU and on the CPU and
    /// reports the error and time per call (exit status 1 past the tolerance).
    Selftest(npu::SelftestArgs),
    /// Requantize a model's weight matrices (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) into a new GGUF file.
    Quantize(quantize::QuantizeArgs),
    /// Write a repacked-weight cache: a GGUF with the weight matrices already in pinfer's packed
    /// layout for this CPU, which loads without repacking (`pinfer repack IN OUT`).
    Repack(repack::RepackArgs),
    /// Check a file pinfer wrote for itself (a repack cache) against its checksums; a plain GGUF
    /// is checked for structure and model metadata.
    Verify {
        /// The file.
        file: PathBuf,
    },
}

/// How a command failed, and the exit status that says it.
pub(crate) enum CliError {
    /// A failure the user can act on: printed as `error: ...` with exit status 1.
    Message(String),
    /// Stopped by SIGINT: exit status 130, as a shell reports a process killed by it.
    Interrupted,
    /// Standard output is a closed pipe: exit status 141 quietly, as coreutils.
    BrokenPipe,
}

impl CliError {
    pub(crate) fn new(msg: String) -> Self {
        Self::Message(msg)
    }
}

impl<E: std::error::Error> From<E> for CliError {
    fn from(e: E) -> Self {
        Self::Message(e.to_string())
    }
}

pub(crate) fn model_path(model: Option<PathBuf>) -> PathBuf {
    model.unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL_PATH))
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Info { model, tensors, json, placement, no_repack } => {
            info::run(&model_path(model), info::InfoArgs { tensors, json, placement, no_repack })
        }
        Command::Boards { runtime } => info::boards(&runtime),
        Command::Generate {
            model,
            prompt,
            n_predict,
            temp,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            seed,
            ctx,
            runtime,
            print_ids,
            no_parse_special,
            ignore_eos,
            no_repack,
            kernels,
            verbose,
        } => {
            if let Some(name) = kernels {
                force_kernels(&name)?;
            }
            let sampler = SamplerConfig {
                temperature: temp,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                seed,
                ..SamplerConfig::default()
            };
            let args = generate::GenerateArgs {
                prompt,
                n_predict,
                sampler,
                n_ctx: ctx,
                runtime,
                parse_special: !no_parse_special,
                print_ids,
                ignore_eos,
                no_repack,
                verbose,
            };
            generate::generate(&model_path(model), args)
        }
        Command::Chat { model, system, ctx, runtime, n_predict, temp, seed } => {
            let sampler = SamplerConfig { temperature: temp, seed, ..SamplerConfig::default() };
            generate::chat(&model_path(model), system, ctx, &runtime, n_predict, sampler)
        }
        Command::Perplexity { model, file, ctx, runtime } => {
            generate::perplexity(&model_path(model), &file, ctx, &runtime)
        }
        Command::Tokenize { model, prompt, ids, parse_special } => {
            generate::tokenize(&model_path(model), &prompt, ids, parse_special)
        }
        Command::Bench(args) => bench::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Repack(args) => repack::run(args),
        Command::Verify { file } => repack::verify(&file),
        Command::NpuPlan(args) => npu::plan(args),
        Command::Selftest(args) => npu::selftest(args),
    }
}

/// `PINFER_KERNELS=ref|neon|dotprod|fp16|avx2` forces a kernel path (A/B comparisons).
fn kernels_from_env() -> Result<(), CliError> {
    let Ok(name) = std::env::var("PINFER_KERNELS") else { return Ok(()) };
    force_kernels(&name)
}

/// Forces kernel path `name`, or explains what this CPU offers.
pub(crate) fn force_kernels(name: &str) -> Result<(), CliError> {
    use pinfer::kernels::{set_path, KernelPath};
    match KernelPath::parse(name) {
        Some(p) if set_path(p) => Ok(()),
        _ => Err(CliError::new(format!(
            "kernel path {name:?} is not available on this CPU (this one supports: {})",
            KernelPath::ALL
                .into_iter()
                .filter(|p| p.is_available())
                .map(KernelPath::name)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn main() -> ExitCode {
    signals::install();
    let result = kernels_from_env().and_then(|()| run(Cli::parse())).and_then(|()| streams::flush_stdout());
    match result {
        Ok(()) if streams::stderr_failed() => ExitCode::FAILURE,
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Message(msg)) => {
            // Text still buffered for stdout goes first, so the error ends the output.
            let _ = streams::flush_stdout();
            errln!("error: {msg}");
            ExitCode::FAILURE
        }
        Err(CliError::Interrupted) => {
            let _ = streams::flush_stdout();
            ExitCode::from(130)
        }
        Err(CliError::BrokenPipe) => ExitCode::from(141),
    }
}
