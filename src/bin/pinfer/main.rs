//! The `pinfer` command line.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pinfer::loader::DEFAULT_MODEL_PATH;

// First: its macros are visible only in the modules declared after it.
#[macro_use]
mod streams;

mod bench;
mod bundle;
mod chat;
mod chat_media;
mod doctor;
mod embed;
mod export_lora;
mod finetune;
mod gen_args;
mod gen_loop;
mod generate;
mod grammar_args;
mod info;
mod kl_divergence;
mod kv_file;
mod llama_flags;
mod npu;
mod perplexity;
mod prompt_cache;
mod quantize;
mod repack;
mod runtime;
mod serve;
mod signals;
mod store;
mod text_input;
mod tokenize;
mod vision;

use runtime::RuntimeArgs;

#[derive(Parser)]
#[command(name = "pinfer", version = pinfer::VERSION, about = "Run GGUF language models fast on RK3588-class ARM boards")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streams it; timings on stderr). llama-cli's options; with
    /// -cnv or -i, a conversation (as `chat`).
    Generate(gen_args::GenArgs),
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
        /// The text (may start with '-').
        #[arg(short = 'p', long = "prompt", allow_hyphen_values = true, required_unless_present = "file")]
        prompt: Option<String>,
        /// Read the text from this file (`-`: stdin).
        #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
        file: Option<PathBuf>,
        /// Print only the ids, space-separated, on one line.
        #[arg(long)]
        ids: bool,
        /// Turn special-token text such as <|im_start|> into the special token.
        #[arg(long = "parse-special")]
        parse_special: bool,
    },
    /// An encoder's embeddings of each input line (llama-embedding's options and output formats).
    Embed(embed::EmbedArgs),
    /// A reranker's score of each document line for a query (`--query Q -f DOCS`).
    Rerank(embed::RerankArgs),
    /// Chat interactively with the model's chat template (one message per line; empty line ends;
    /// Ctrl-C stops a reply). Takes generate's options.
    Chat(gen_args::GenArgs),
    /// Perplexity of a text file, scored as llama.cpp's llama-perplexity scores it (prints
    /// `Final estimate: PPL = X +/- E`); with --kl-divergence, compared with llama.cpp's logits.
    Perplexity(perplexity::PerplexityArgs),
    /// Measure prompt-processing and generation speed (llama-bench style).
    Bench(bench::BenchArgs),
    /// Show which matmuls go to the NPU (--npu auto or a whitelist), the extra memory, and write
    /// the whitelist (-o FILE).
    NpuPlan(npu::NpuPlanArgs),
    /// Check the hardware: `--npu` runs every planned matmul shape on the NPU and on the CPU and
    /// reports the error and time per call (exit status 1 past the tolerance).
    Selftest(npu::SelftestArgs),
    /// Requantize a model's weight matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) into a new GGUF file.
    Quantize(quantize::QuantizeArgs),
    /// LoRA fine-tuning on a text file or JSONL conversations: writes a llama.cpp LoRA adapter
    /// (`-m BASE -f DATA -o ADAPTER.gguf`), its loss curves and a checkpoint to resume from.
    Finetune(finetune::FinetuneArgs),
    /// Merge LoRA adapters into a new GGUF (llama-export-lora): `-m BASE --lora FILE -o OUT`.
    ExportLora(export_lora::ExportLoraArgs),
    /// Write a repacked-weight cache: a GGUF with the weight matrices already in pinfer's packed
    /// layout for this CPU, which loads without repacking (`pinfer repack IN OUT`).
    Repack(repack::RepackArgs),
    /// Write one executable that carries a model (`./NAME generate -p ...`, `./NAME serve`, bare
    /// `./NAME` chats): the model is mapped from the executable's own file.
    Bundle(bundle::BundleArgs),
    /// Check this machine before a first run: glibc, kernel, board, big cores and clocks, memory,
    /// NPU runtime and driver, SCHED_FIFO and mlock permissions, each with the fix when missing.
    Doctor(doctor::DoctorArgs),
    /// Serve the model over HTTP: the OpenAI API, llama-server's endpoints and the Ollama API on
    /// one port, with parallel slots whose decode steps run as one batch.
    Serve(serve::ServeArgs),
    /// The models of the store: Hugging Face's hub cache (what `hf download` and llama.cpp's
    /// `-hf` fetched) and Ollama's models, read in place; run one with `-m hf:USER/REPO:QUANT`
    /// or `-m ollama:NAME:TAG`.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One stored model: its files, size, architecture, context and capabilities.
    Show {
        /// `hf:USER/REPO[:QUANT]` or `ollama:NAME[:TAG]`.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a model of the Hugging Face cache (its files, and each blob nothing else links to).
    /// Ollama's models are Ollama's to delete.
    Rm {
        /// `hf:USER/REPO[:QUANT]`.
        name: String,
    },
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
    /// A command line clap could not read (its message is printed): clap's exit status.
    Usage(i32),
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

/// Threads for a conversion (quantize, repack): `-t N`, else every core this process may use.
pub(crate) fn worker_threads(asked: Option<u16>) -> usize {
    asked.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), usize::from)
}

/// `-m`, else the model this executable carries (a bundle: `pinfer bundle`), else the default
/// model's path.
/// The model file `-m` names: a path, or a store name (`hf:USER/REPO[:QUANT]`,
/// `ollama:NAME[:TAG]`; a file of that name wins); without `-m`, the bundled or default model.
pub(crate) fn model_path(model: Option<PathBuf>) -> Result<PathBuf, CliError> {
    let Some(model) = model else {
        return Ok(bundled_model().unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL_PATH)));
    };
    let named = model.to_str().filter(|_| !model.exists()).and_then(pinfer::store::ModelRef::parse);
    match named {
        None => Ok(model),
        Some(r) => Ok(store::resolve(&r?)?.files[0].clone()),
    }
}

/// This executable's path when it carries a model (or bytes after its image: a damaged bundle,
/// which loading then refuses by name).
fn bundled_model() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    pinfer::bundle::carries_model(&exe).then_some(exe)
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Info { model, tensors, json, placement, no_repack } => {
            info::run(&model_path(model)?, info::InfoArgs { tensors, json, placement, no_repack })
        }
        Command::Boards { runtime } => info::boards(&runtime),
        Command::Generate(args) => generate::generate(args),
        Command::Chat(args) => chat::chat(gen_args::GenArgs { conversation: true, ..args }),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Embed(args) => embed::run(args),
        Command::Rerank(args) => embed::rerank(args),
        Command::Tokenize { model, prompt, file, ids, parse_special } => {
            let text = match (prompt, file) {
                (Some(p), _) => p,
                (None, Some(f)) if f.as_os_str() == "-" => text_input::read_stdin()?,
                (None, Some(f)) => text_input::read_text_file(&f)?,
                (None, None) => return Err(CliError::new("give the text with -p TEXT or -f FILE".into())),
            };
            tokenize::tokenize(&model_path(model)?, &text, ids, parse_special)
        }
        Command::Bench(args) => bench::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::ExportLora(args) => export_lora::run(args),
        Command::Finetune(args) => finetune::run(args),
        Command::Repack(args) => repack::run(args),
        Command::Bundle(args) => bundle::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Verify { file } => repack::verify(&file),
        Command::List { json } => store::list(json),
        Command::Show { name, json } => store::show(&name, json),
        Command::Rm { name } => store::remove(&name),
        Command::Serve(args) => serve::run(args),
        Command::NpuPlan(args) => npu::plan(args),
        Command::Selftest(args) => npu::selftest(args),
    }
}

/// `PINFER_KERNELS=ref|neon|dotprod|fp16|avx2|vnni` forces a kernel path (A/B comparisons):
/// checked before anything runs.
fn kernels_from_env() -> Result<(), CliError> {
    chosen_kernels(None).map(|_| ())
}

/// The kernel path a run uses: `--kernels NAME`, else `PINFER_KERNELS`, else the fastest this
/// CPU has; a name this CPU lacks is an error that lists what it offers.
pub(crate) fn chosen_kernels(flag: Option<&str>) -> Result<pinfer::kernels::KernelPath, CliError> {
    use pinfer::kernels::KernelPath;
    let env = std::env::var("PINFER_KERNELS").ok();
    let Some(name) = flag.or(env.as_deref()) else { return Ok(KernelPath::detect()) };
    match KernelPath::parse(name) {
        Some(p) if p.is_available() => Ok(p),
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

/// What clap has to say instead of a command (help, version, a bad command line), written
/// through the checked streams: `--help >/dev/full` is an error, `| head -c1` exits 141.
fn clap_exit(e: &clap::Error) -> Result<(), CliError> {
    let text = e.render().to_string();
    if e.use_stderr() {
        err!("{text}");
        return Err(CliError::Usage(e.exit_code()));
    }
    out!("{text}")
}

/// A bundle run without arguments chats with its model.
fn bare_bundle_chats(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if args.len() == 1 && bundled_model().is_some() {
        args.push("chat".into());
    }
    args
}

fn main() -> ExitCode {
    signals::install();
    let result = kernels_from_env()
        .and_then(|()| llama_flags::rewrite(bare_bundle_chats(std::env::args_os().collect())))
        .and_then(|args| match Cli::try_parse_from(args) {
            Ok(cli) => run(cli),
            Err(e) => clap_exit(&e),
        })
        .and_then(|()| streams::flush_stdout());
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
        Err(CliError::Usage(code)) => ExitCode::from(u8::try_from(code).unwrap_or(2)),
    }
}
