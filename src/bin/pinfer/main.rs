//! The `pinfer` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pinfer::loader::{ModelFile, DEFAULT_MODEL_PATH};

mod info;

#[derive(Parser)]
#[command(name = "pinfer", version = pinfer::VERSION, about = "Run GGUF language models fast on RK3588-class ARM boards")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate {
        /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// The prompt.
        #[arg(short = 'p', long = "prompt")]
        prompt: String,
        /// Number of tokens to generate.
        #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
        n_predict: u32,
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
    },
    /// Tokenize a text with a model's vocabulary.
    Tokenize {
        /// Model file (GGUF).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// The text.
        #[arg(short = 'p', long = "prompt")]
        prompt: String,
    },
    /// Measure prompt-processing and generation speed (llama-bench style).
    Bench {
        /// Model file (GGUF).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
    },
}

/// A failure the user can act on: printed as `error: ...` with exit status 1.
pub(crate) struct CliError(pub(crate) String);

impl<E: std::error::Error> From<E> for CliError {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

fn model_path(model: Option<PathBuf>) -> PathBuf {
    model.unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL_PATH))
}

fn not_yet(what: &str) -> Result<(), CliError> {
    Err(CliError(format!("`pinfer {what}` is not yet implemented in this build")))
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Info { model, tensors, json } => info::run(&model_path(model), tensors, json),
        Command::Generate { model, .. } => {
            // Fail on a missing or malformed model before saying generation is missing.
            ModelFile::open(&model_path(model))?.parse()?;
            not_yet("generate")
        }
        Command::Tokenize { model, .. } => {
            ModelFile::open(&model_path(model))?.parse()?;
            not_yet("tokenize")
        }
        Command::Bench { model } => {
            ModelFile::open(&model_path(model))?.parse()?;
            not_yet("bench")
        }
    }
}

/// Output piped into `head` must end the program quietly, as with other Unix tools, rather than
/// panic in `println!`: restore the default SIGPIPE action that Rust's runtime replaces.
fn quiet_on_closed_pipe() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: installs the default disposition (no handler code runs), before any thread starts.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

fn main() -> ExitCode {
    quiet_on_closed_pipe();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
