//! `pinfer serve`: one model behind an HTTP server that speaks the OpenAI API, llama-server's own
//! endpoints and the Ollama API on one port, with parallel slots whose decode steps run as one
//! batch ([`slots`]).
//!
//! Threads: the engine thread owns the session (and is its pool's first worker); the HTTP side
//! runs on a small tokio runtime, tokenizes and renders templates, and talks to the engine through
//! a bounded queue of jobs and per-request event channels.
//!
//! Here: the options and the state the handlers share. [`start`]: start-up and stop; [`routes`]:
//! the router, the API-key check and llama-server's endpoints; [`openai`], [`ollama`]: those APIs;
//! [`embeddings`]: an encoder's embedding and rerank routes and its engine loop; [`prompt`]: a chat
//! request's prompt; [`tokens`]: text to ids and back; [`jobs`]: generations
//! submitted to the engine and their events; [`api`]: what every endpoint shares.

mod anthropic;
mod api;
mod embeddings;
mod jobs;
mod ollama;
mod openai;
mod prompt;
mod responses;
mod routes;
mod slots;
mod start;
mod tokens;
mod tool_families;
mod tool_stream;
mod tools;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use clap::Args;
use pinfer::grammar::Vocab;
use pinfer::tokenizer::OwnedTokenizer;
use serde_json::{Map, Value};

use crate::gen_args::GenArgs;
use api::ApiError;
use slots::{GenParams, Request as EngineRequest, Stats};

pub use start::run;

/// Options of `pinfer serve`, spelled as llama-server spells them; the model, sampling and board
/// options are `generate`'s (the sampling ones are the defaults of every request).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub gen: GenArgs,
    /// Address to listen on.
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// Parallel slots: requests served at once, their decode steps batched (each gets -c / N
    /// positions of context).
    #[arg(long = "parallel", value_name = "N", default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free slot; more get 503.
    #[arg(long = "queue", value_name = "N", default_value_t = 64)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` (all endpoints but /health and /v1/models).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// Read the API keys from this file (one per line).
    #[arg(long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve Prometheus metrics at /metrics.
    #[arg(long = "metrics")]
    pub metrics: bool,
    /// Seconds to read a request body before giving up (408).
    #[arg(long = "timeout", value_name = "SECONDS", default_value_t = 600)]
    pub timeout: u64,
    /// Largest request body in bytes (413 past it).
    #[arg(long = "body-limit", value_name = "BYTES", default_value_t = 8 << 20)]
    pub body_limit: usize,
    /// Directory of the files `POST /slots/{id}?action=save|restore` write and read.
    #[arg(long = "slot-save-path", value_name = "DIR")]
    pub slot_save_path: Option<PathBuf>,
    /// Directory whose images requests may name as `file://` URLs (none: such URLs are refused;
    /// remote URLs always are).
    #[arg(long = "media-path", value_name = "DIR")]
    pub media_path: Option<PathBuf>,
    /// The model's name in the APIs (default: the file's name without .gguf).
    #[arg(short = 'a', long = "alias", value_name = "NAME")]
    pub alias: Option<String>,
    /// Serve an embedding model (an encoder such as bert): /v1/embeddings, /embeddings and
    /// Ollama's /api/embed; a generating model is refused. An encoder is served so without it.
    #[arg(long = "embedding", visible_alias = "embeddings")]
    pub embedding: bool,
    /// Serve a reranker (a cross-encoder with a cls.output head) at /v1/rerank and /rerank:
    /// `--embedding --pooling rank`.
    #[arg(long = "reranking", visible_alias = "rerank")]
    pub reranking: bool,
    /// An embedding model's pooling: none (every token's vector, llama.cpp's /embeddings only),
    /// mean, cls, last, rank (default: the model's `pooling_type`).
    #[arg(long = "pooling", value_parser = parse_pooling)]
    pub pooling: Option<pinfer::model::Pooling>,
}

fn parse_pooling(name: &str) -> Result<pinfer::model::Pooling, String> {
    pinfer::model::Pooling::from_name(name)
        .ok_or_else(|| format!("{name:?}: the poolings are none, mean, cls, last and rank"))
}

/// Server settings the handlers read.
pub struct Opts {
    pub body_limit: usize,
    pub timeout: Duration,
    pub api_keys: Vec<String>,
    pub metrics: bool,
    pub queue: usize,
    pub slot_save_path: Option<PathBuf>,
    pub media_path: Option<PathBuf>,
}

/// Everything the handlers share.
pub struct Shared {
    pub opts: Opts,
    pub model_name: String,
    pub model_path: PathBuf,
    pub model_bytes: u64,
    pub stats: Arc<Stats>,
    /// Set once the model is loaded.
    pub ready: OnceLock<Ready>,
    /// Requests queued or running (the queue bound counts them).
    pub in_flight: AtomicUsize,
    /// Set when the server stops: the engine cancels what still runs.
    pub stop: AtomicBool,
    /// The Responses API's answered conversations (`previous_response_id`).
    pub responses: responses::Kept,
}

/// The loaded model, as the handlers need it.
pub struct Ready {
    /// The engine thread's scheduler borrows it too (it holds the `Shared` for its whole run).
    pub tok: OwnedTokenizer,
    /// How chats become prompts (the model's Jinja template or a built-in format).
    pub format: pinfer::prompt_format::PromptFormat,
    /// `--chat-template-kwargs`: template variables every request starts from.
    pub template_kwargs: Map<String, Value>,
    /// The reasoning markers the model's template teaches (None: `--reasoning-format none`, or a
    /// template without any).
    pub reasoning: Option<pinfer::reasoning::Markers>,
    pub jobs: mpsc::SyncSender<EngineRequest>,
    pub n_slots: usize,
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub defaults: GenParams,
    pub arch: String,
    pub quant: String,
    pub n_params: u64,
    pub n_ctx_train: u64,
    pub chat_template_text: Option<String>,
    pub empty: Map<String, Value>,
    /// What a slot file must match: the model and the cache layout.
    pub slot_identity: crate::kv_file::Identity,
    /// The vocabulary as the grammar engine sees it, built by the first request with a grammar.
    pub vocab: std::sync::OnceLock<Arc<Vocab>>,
    /// An encoder's embeddings (None: a generating model, served by the slots).
    pub embedding: Option<embeddings::Served>,
    /// Requests may carry images (`--mmproj`).
    pub vision: bool,
}

impl Shared {
    /// What the served model does, in llama-server's and Ollama's words (`completion`, `vision`,
    /// `embedding`).
    pub fn capabilities(&self) -> Vec<&'static str> {
        match self.ready.get() {
            Some(r) if r.embedding.is_some() => vec!["embedding"],
            Some(r) if r.vision => vec!["completion", "vision"],
            _ => vec!["completion"],
        }
    }
}

/// The handlers' view: the shared state with the model loaded.
pub struct State<'a> {
    pub ready: &'a Ready,
    pub opts: &'a Opts,
}

type AppState = Arc<Shared>;

impl Shared {
    /// The loaded model, or 503 while it loads.
    fn state(&self) -> Result<State<'_>, ApiError> {
        let ready = self.ready.get().ok_or_else(|| ApiError::unavailable("Loading model"))?;
        Ok(State { ready, opts: &self.opts })
    }
}
