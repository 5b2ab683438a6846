//! `pinfer serve`: one model behind an HTTP server that speaks the OpenAI API, llama-server's own
//! endpoints and the Ollama API on one port, with parallel slots whose decode steps run as one
//! batch ([`slots`]).
//!
//! Threads: the engine thread owns the session (and is its pool's first worker); the HTTP side
//! runs on a small tokio runtime, tokenizes and renders templates, and talks to the engine through
//! a bounded queue of jobs and per-request event channels.

mod api;
mod ollama;
mod openai;
mod slots;
mod tools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State as AxState};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use pinfer::chat::{ChatTemplate, Message, Role};
use pinfer::grammar::{Constraint, GrammarSpec, Vocab};
use pinfer::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tools::ToolFormat;

use crate::generate::GenArgs;
use crate::CliError;
use api::{json_response, read_json, ApiError, Fields};
use slots::{Event, GenParams, Job, Request as EngineRequest, SlotAction, SlotDone, Stats};

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
    /// The model's name in the APIs (default: the file's name without .gguf).
    #[arg(short = 'a', long = "alias", value_name = "NAME")]
    pub alias: Option<String>,
}

/// Server settings the handlers read.
pub struct Opts {
    pub body_limit: usize,
    pub timeout: Duration,
    pub api_keys: Vec<String>,
    pub metrics: bool,
    pub queue: usize,
    pub slot_save_path: Option<PathBuf>,
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
}

/// The loaded model, as the handlers need it.
pub struct Ready {
    pub tok: &'static Tokenizer<'static>,
    pub template: ChatTemplate,
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

/// Token ids of `text` with the model's BOS rule; special-token text is parsed when `special`.
pub fn encode(state: &State<'_>, text: &str, special: bool) -> Vec<u32> {
    crate::generate::encode(state.ready.tok, text, special).unwrap_or_default()
}

/// Token ids of `text` without BOS/EOS (for /tokenize with add_special false, logit_bias texts).
pub fn encode_plain(tok: &Tokenizer<'static>, text: &str, special: bool) -> Vec<u32> {
    crate::generate::encode_with(tok, text, special, false).unwrap_or_default()
}

/// Text of `ids` (special tokens rendered when `special`); invalid UTF-8 becomes U+FFFD. The
/// pieces are joined as they are, as llama-server's /detokenize does: unlike
/// `Tokenizer::decode`, a leading space of the first piece is kept.
fn detokenize_text(tok: &Tokenizer<'static>, ids: &[u32], special: bool) -> String {
    let mut piece = vec![0u8; pinfer::tokenizer::StreamDecoder::buffer_len(tok)];
    let mut bytes = Vec::new();
    for &id in ids {
        if let Ok(n) = tok.token_to_piece(id, special, &mut piece) {
            bytes.extend_from_slice(&piece[..n]);
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Now as RFC 3339 in UTC with nanoseconds (Ollama's `created_at`).
pub fn rfc3339_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// The chat messages of a request (`messages`: role and content, the content a string or a list
/// of text parts), checked.
pub fn messages(body: &Map<String, Value>, format: ToolFormat) -> Result<Vec<(Role, String)>, ApiError> {
    let list =
        Fields::new(body).array("messages")?.ok_or_else(|| ApiError::invalid("'messages' is required"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(format!("'messages[{i}]' must be an object")));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            // A tool's result: a user turn in the model's tool format.
            Some("tool") => Role::User,
            Some(other) => {
                return Err(ApiError::invalid(format!(
                "'messages[{i}].role' {other:?} is not supported (system, developer, user, assistant, tool)"
            )))
            }
            None => return Err(ApiError::invalid(format!("'messages[{i}].role' must be a string"))),
        };
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(format!(
                                "'messages[{i}].content[{j}]': only text parts are supported"
                            )))
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "'messages[{i}].content' must be a string or a list of parts"
                )))
            }
        };
        let content = match (m.get("role").and_then(Value::as_str), m.get("tool_calls")) {
            (Some("tool"), _) => {
                let name = m.get("name").or_else(|| m.get("tool_name")).and_then(Value::as_str);
                tools::render_result(format, &content, name)
            }
            (Some("assistant"), Some(Value::Array(calls))) if !calls.is_empty() => {
                let calls = tools::render_calls(format, calls)
                    .map_err(|e| ApiError::invalid(format!("'messages[{i}]': {}", e.message)))?;
                if content.is_empty() {
                    calls
                } else {
                    format!("{content}\n{calls}")
                }
            }
            _ => content,
        };
        out.push((role, content));
    }
    if out.is_empty() {
        return Err(ApiError::invalid("'messages' must hold at least one message"));
    }
    Ok(out)
}

/// A chat request's prompt: its messages (tool results and earlier calls in the model's tool
/// format) with its tools added, rendered; a required tool call's grammar goes into `params`
/// (a 400 when the request also constrains the output otherwise).
pub fn chat_prompt(
    state: &State<'_>,
    body: &Map<String, Value>,
    params: &mut GenParams,
) -> Result<(String, Option<tools::Tools>), ApiError> {
    let format = ToolFormat::of(state.ready.template);
    let mut turns = messages(body, format)?;
    let tools = tools::parse_request(body, format)?;
    if let Some(t) = &tools {
        tools::add_to_messages(t, &mut turns);
        if let Some(g) = tools::grammar(t) {
            if params.grammar.is_some() {
                return Err(ApiError::invalid(
                    "give one constraint: a required tool call, or 'response_format'/'format' ('grammar', 'json_schema'), not both",
                ));
            }
            params.grammar = Some(g);
        }
    }
    Ok((render_chat(state, &turns)?, tools))
}

/// The messages rendered with the model's chat template, the assistant's turn opened.
pub fn render_chat(state: &State<'_>, messages: &[(Role, String)]) -> Result<String, ApiError> {
    let list: Vec<Message<'_>> =
        messages.iter().map(|(role, content)| Message { role: *role, content }).collect();
    let mut out = String::new();
    state.ready.template.render(&list, true, &mut out).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(out)
}

/// A generation submitted to the engine: its events, and the bookkeeping of the queue bound.
pub struct Submitted {
    pub events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    shared: Arc<Shared>,
    pub n_prompt: usize,
}

impl Drop for Submitted {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Queues `prompt` for generation: 400 when it is empty or does not fit a slot's context, 503
/// when the queue is full or the server is stopping.
pub fn submit(shared: &Arc<Shared>, prompt: Vec<u32>, params: GenParams) -> Result<Submitted, ApiError> {
    let state = shared.state()?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    if prompt.len() >= state.ready.n_ctx {
        return Err(ApiError::exceeds_context(prompt.len(), state.ready.n_ctx));
    }
    if shared.stop.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let constraint = params.grammar.as_ref().map(|spec| compile(state.ready, spec)).transpose()?;
    let limit = state.opts.queue + state.ready.n_slots;
    if shared.in_flight.fetch_add(1, Ordering::Relaxed) >= limit {
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::unavailable("the server is busy: every slot is taken and the queue is full"));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let n_prompt = prompt.len();
    let submitted = Submitted { events: rx, shared: shared.clone(), n_prompt };
    state
        .ready
        .jobs
        .try_send(EngineRequest::Generate(Box::new(Job { prompt, params, constraint, events: tx })))
        .map_err(|_| ApiError::unavailable("the server is busy: the queue is full"))?;
    Ok(submitted)
}

/// A request's grammar compiled against the model's vocabulary: an invalid one is a 400.
fn compile(ready: &Ready, spec: &GrammarSpec) -> Result<Constraint, ApiError> {
    let vocab = match ready.vocab.get() {
        Some(v) => v,
        None => {
            let v = Vocab::new(ready.tok).map_err(|e| ApiError::server(e.to_string()))?;
            ready.vocab.get_or_init(|| v)
        }
    };
    vocab.compile(spec).map_err(|e| ApiError::invalid(e.to_string()))
}

/// A whole generation, collected (non-streaming requests).
pub struct Collected {
    pub text: String,
    pub probs: Vec<slots::TokenProbs>,
    pub summary: slots::Summary,
}

/// Waits for the end of a submitted generation.
pub async fn collect(mut sub: Submitted) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut probs = Vec::new();
    while let Some(event) = sub.events.recv().await {
        match event {
            Event::Token { text: t, probs: p } => {
                text.push_str(&t);
                probs.extend(p);
            }
            Event::Done(summary) => return Ok(Collected { text, probs, summary }),
            Event::Failed(message) => return Err(ApiError::server(message)),
        }
    }
    Err(ApiError::server("the engine stopped"))
}

/// `finish_reason` of a stop: "stop" or "length".
pub fn finish_reason(stop: pinfer::generate::Stop) -> &'static str {
    use pinfer::generate::Stop;
    match stop {
        Stop::Limit | Stop::ContextFull => "length",
        Stop::EndOfGeneration | Stop::StopString | Stop::Cancelled | Stop::GrammarDeadEnd => "stop",
    }
}

/// Streams a generation's events as a response body (SSE or NDJSON): `render` turns each event
/// into the text to send (`None`: nothing). The stream ends after `Done` or `Failed`, or as soon as
/// the client leaves (the body dropped), which drops `sub` and so cancels the generation, even
/// while it waits in the queue or reads its prompt.
pub fn stream_events(
    mut sub: Submitted,
    content_type: &'static str,
    mut render: impl FnMut(Event) -> Option<String> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                e = sub.events.recv() => e,
                () = tx.closed() => None,
            };
            let Some(event) = event else { break };
            let last = matches!(event, Event::Done(_) | Event::Failed(_));
            if let Some(text) = render(event) {
                if tx.send(text).is_err() {
                    break;
                }
            }
            if last {
                break;
            }
        }
    });
    streaming(content_type, rx)
}

/// A streamed response body from a stream of text chunks (SSE or NDJSON).
/// A streamed response whose chunks are all known already (a reply sent whole once complete).
pub fn stream_of(content_type: &'static str, chunks: Vec<String>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for c in chunks {
        let _ = tx.send(c);
    }
    streaming(content_type, rx)
}

fn streaming(content_type: &'static str, rx: tokio::sync::mpsc::UnboundedReceiver<String>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::server("building the response").into_response())
}

fn sampler_defaults(args: &GenArgs) -> Result<GenParams, CliError> {
    let mut sampler = args.sampler()?;
    // A request without a seed gets a new one (llama-server's default seed is random).
    if args.seed == -1 {
        sampler.seed = crate::generate::random_seed();
    }
    Ok(GenParams {
        sampler,
        n_predict: args.limit(usize::MAX)?.filter(|&n| n != usize::MAX),
        stops: args.reverse_prompt.clone(),
        ignore_eos: args.ignore_eos,
        logit_bias: Vec::new(),
        n_probs: 0,
        cache_prompt: true,
        id_slot: None,
        n_keep: (args.context_shift && !args.no_context_shift).then_some(args.keep),
        // (`serve --grammar ...`: the grammar of every request that names none.)
        grammar: args.grammar.spec()?,
    })
}

/// `pinfer serve`.
pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let gen = &args.gen;
    if gen.prompt.is_some() || gen.file.is_some() || gen.conversation {
        return Err(CliError::new(
            "serve takes no prompt (-p/-f) or conversation (-cnv): requests bring them".into(),
        ));
    }
    if gen.model_draft.is_some() {
        return Err(CliError::new(
            "--model-draft is for generate and chat; the server guesses with --lookup N".into(),
        ));
    }
    if args.parallel == 0 || args.parallel > pinfer::engine::MAX_SEQ {
        return Err(CliError::new(format!(
            "--parallel {}: give 1 to {}",
            args.parallel,
            pinfer::engine::MAX_SEQ
        )));
    }
    let defaults = sampler_defaults(gen)?;
    let mut opts = gen.session_options()?;
    if opts.n_batch < args.parallel {
        return Err(CliError::new(format!(
            "--parallel {} needs a batch of at least {} tokens (-b)",
            args.parallel, args.parallel
        )));
    }
    // -c is the whole cache, split between the slots (llama-server's rule).
    let path = crate::model_path(gen.model.clone());
    let mut api_keys: Vec<String> = args.api_key.iter().cloned().collect();
    if let Some(file) = &args.api_key_file {
        let text = crate::generate::read_text_file(file)?;
        api_keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string));
    }
    let model_name = args.alias.clone().unwrap_or_else(|| {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        name.strip_suffix(".gguf").unwrap_or(&name).to_string()
    });
    let model_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let shared = Arc::new(Shared {
        opts: Opts {
            body_limit: args.body_limit,
            timeout: Duration::from_secs(args.timeout.max(1)),
            api_keys,
            metrics: args.metrics,
            queue: args.queue,
            slot_save_path: args.slot_save_path.clone(),
        },
        model_name,
        model_path: path.clone(),
        model_bytes,
        stats: Arc::new(Stats::new(args.parallel)),
        ready: OnceLock::new(),
        in_flight: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });

    let addr: SocketAddr = format!("{}:{}", bracket_v6(&args.host), args.port)
        .parse()
        .map_err(|e| CliError::new(format!("--host {} --port {}: {e}", args.host, args.port)))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::new(format!("starting the HTTP runtime: {e}")))?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| CliError::new(format!("listening on {addr}: {e}")))?;
    let local = listener.local_addr().map_err(|e| CliError::new(e.to_string()))?;
    errln!("pinfer: listening on http://{local} (loading {})", path.display());

    // The engine thread loads the model (its pool's first worker is that thread), then serves.
    let (jobs_tx, jobs_rx) = mpsc::sync_channel::<EngineRequest>(args.queue + args.parallel + 8);
    let (loaded_tx, loaded_rx) = mpsc::channel::<Result<(), CliError>>();
    let engine_shared = shared.clone();
    let n_seq = args.parallel;
    opts.n_seq = n_seq;
    let total_ctx = gen.ctx;
    let gen_args = gen.clone();
    let engine = std::thread::Builder::new()
        .name("pinfer-engine".into())
        .stack_size(16 << 20)
        .spawn(move || {
            let result = load_engine(&gen_args, &engine_shared, total_ctx, n_seq, defaults, jobs_tx);
            match result {
                Ok(engine) => {
                    let _ = loaded_tx.send(Ok(()));
                    engine.serve(jobs_rx, &engine_shared.stop);
                }
                Err(e) => {
                    let _ = loaded_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| CliError::new(format!("starting the engine thread: {e}")))?;

    let app = router(shared.clone());
    crate::signals::serve_mode();
    let shutdown_shared = shared.clone();
    let server = async move {
        let stopping = async move {
            while !crate::signals::terminate_requested() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            errln!("pinfer: stopping: no new requests; finishing the ones running");
            // Requests still running after a grace period are cancelled.
            let shared = shutdown_shared;
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                shared.stop.store(true, Ordering::Relaxed);
            });
        };
        axum::serve(listener, app).with_graceful_shutdown(stopping).await
    };
    // /health answers 503 while the model loads.
    let server = runtime.spawn(server);
    let loaded = runtime.block_on(async { tokio::task::spawn_blocking(move || loaded_rx.recv()).await });
    let served = match loaded {
        Ok(Ok(Ok(()))) => {
            errln!("pinfer: model loaded; serving {n_seq} slot(s)");
            // Runs until a stop is asked for and the requests still running have ended.
            match runtime.block_on(server) {
                Ok(result) => result.map_err(|e| CliError::new(format!("serving: {e}"))),
                Err(e) => Err(CliError::new(format!("serving: {e}"))),
            }
        }
        Ok(Ok(Err(e))) => Err(e),
        _ => Err(CliError::new("the engine thread ended while loading".into())),
    };
    shared.stop.store(true, Ordering::Relaxed);
    runtime.shutdown_timeout(Duration::from_secs(2));
    // The engine thread waits for jobs that no longer come: the process ends without it.
    drop(engine);
    served
}

/// `::1` as `[::1]` for the socket address parser.
fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Loads the model on the engine thread and publishes what the handlers need.
fn load_engine(
    gen: &GenArgs,
    shared: &Arc<Shared>,
    total_ctx: usize,
    n_seq: usize,
    defaults: GenParams,
    jobs: mpsc::SyncSender<EngineRequest>,
) -> Result<slots::Engine, CliError> {
    let path = crate::model_path(gen.model.clone());
    let mut opts = gen.session_options()?;
    opts.n_seq = n_seq;
    let runtime = crate::runtime::Runtime::new(&gen.runtime)?;
    // The context per slot: -c split between the slots (0: the default context each).
    if total_ctx > 0 {
        opts.n_ctx = (total_ctx / n_seq).max(1);
    }
    let session = runtime.load(&path, opts, gen.verbose)?;
    let tok: &'static Tokenizer<'static> =
        Box::leak(Box::new(crate::generate::tokenizer(&path, session.gguf())?));
    let gguf = session.gguf();
    let chat_template_text = gguf.get_str_opt("tokenizer.chat_template").ok().flatten().map(str::to_string);
    // The CLI's policy: a template pinfer cannot render is refused by name (no ChatML in its place).
    let template = crate::chat::template_for(gen.chat_template.as_deref(), gguf, &path)?;
    let hp = session.hparams();
    if gen.lookup.is_some() && session.engine().has_recurrent_layers() {
        return Err(CliError::new(
            "--lookup: this model has recurrent layers, whose state cannot go back to a guess's position"
                .into(),
        ));
    }
    let arch = gguf.get_str_opt("general.architecture").ok().flatten().unwrap_or("").to_string();
    let n_params: u64 = gguf.tensors().map(|t| t.n_elements()).sum();
    // The type holding the most bytes (Ollama's `quantization_level`).
    let mut by_type: Vec<(&str, u64)> = Vec::new();
    for t in gguf.tensors() {
        match by_type.iter_mut().find(|(name, _)| *name == t.ty.name()) {
            Some(e) => e.1 += t.nbytes,
            None => by_type.push((t.ty.name(), t.nbytes)),
        }
    }
    let quant = by_type.iter().max_by_key(|e| e.1).map_or("", |e| e.0).to_string();
    let ready = Ready {
        tok,
        template,
        jobs,
        n_slots: n_seq,
        n_ctx: session.n_ctx(),
        n_vocab: session.n_vocab(),
        defaults,
        arch,
        quant,
        n_params,
        n_ctx_train: u64::from(hp.n_ctx_train),
        chat_template_text,
        empty: Map::new(),
        slot_identity: crate::kv_file::Identity::of(&session),
        vocab: std::sync::OnceLock::new(),
    };
    let engine = slots::Engine::new(session, tok, shared.stats.clone(), gen.lookup.unwrap_or(0));
    let _ = shared.ready.set(ready);
    Ok(engine)
}

/// Every route, behind the API-key check.
fn router(shared: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/completions", post(openai::completions))
        .route("/completion", post(openai::native_completion))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/props", get(props))
        .route("/slots", get(slots_list))
        .route("/slots/{id}", post(slot_action))
        .route("/metrics", get(metrics))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(shared.clone(), auth))
        .with_state(shared)
}

/// The API-key check (public: /health, /v1/models, /models).
async fn auth(AxState(shared): AxState<AppState>, req: Request, next: Next) -> Response {
    let public = matches!(req.uri().path(), "/health" | "/v1/health" | "/v1/models" | "/models");
    if shared.opts.api_keys.is_empty() || public {
        return next.run(req).await;
    }
    let given = bearer(req.headers());
    if given.is_some_and(|k| shared.opts.api_keys.iter().any(|key| key == k)) {
        next.run(req).await
    } else {
        ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "Invalid API Key").into_response()
    }
}

/// The key a request gives: `Authorization: Bearer KEY` (any case of "bearer"), or `x-api-key`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let auth = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, key) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
    });
    auth.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

async fn not_found() -> Response {
    ApiError::not_found().into_response()
}

async fn health(AxState(shared): AxState<AppState>) -> Response {
    match shared.state() {
        Ok(_) => json_response(&json!({ "status": "ok" })),
        Err(e) => e.into_response(),
    }
}

async fn models(AxState(shared): AxState<AppState>) -> Response {
    let meta = shared.ready.get().map(|r| {
        json!({
            "n_vocab": r.n_vocab,
            "n_ctx_train": r.n_ctx_train,
            "n_params": r.n_params,
            "size": shared.model_bytes,
        })
    });
    json_response(&json!({
        "object": "list",
        "data": [{
            "id": shared.model_name,
            "object": "model",
            "created": unix_now(),
            "owned_by": "pinfer",
            "meta": meta,
        }],
        "models": [{ "name": shared.model_name, "model": shared.model_name, "type": "model" }],
    }))
}

async fn tokenize(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    let content = f.str("content")?.unwrap_or("");
    let add_special = f.bool("add_special")?.unwrap_or(false);
    let parse_special = f.bool("parse_special")?.unwrap_or(true);
    let with_pieces = f.bool("with_pieces")?.unwrap_or(false);
    let tok = state.ready.tok;
    let ids = if add_special {
        crate::generate::encode(tok, content, parse_special).unwrap_or_default()
    } else {
        encode_plain(tok, content, parse_special)
    };
    let tokens: Vec<Value> = if with_pieces {
        let mut piece = vec![0u8; pinfer::tokenizer::StreamDecoder::buffer_len(tok)];
        ids.iter()
            .map(|&id| {
                let n = tok.token_to_piece(id, true, &mut piece).unwrap_or(0);
                match std::str::from_utf8(&piece[..n]) {
                    Ok(s) => json!({ "id": id, "piece": s }),
                    Err(_) => json!({ "id": id, "piece": piece[..n].to_vec() }),
                }
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json_response(&json!({ "tokens": tokens })))
}

async fn detokenize(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let list = Fields::new(&body).array("tokens")?.map(Vec::as_slice).unwrap_or(&[]);
    let mut ids = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        match v.as_u64() {
            Some(id) if id < state.ready.n_vocab as u64 => ids.push(id as u32),
            _ => {
                return Err(ApiError::invalid(format!(
                    "'tokens[{i}]' must be a token id below {}",
                    state.ready.n_vocab
                )))
            }
        }
    }
    Ok(json_response(&json!({ "content": detokenize_text(state.ready.tok, &ids, true) })))
}

async fn apply_template(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let prompt = render_chat(&state, &messages(&body, ToolFormat::of(state.ready.template))?)?;
    Ok(json_response(&json!({ "prompt": prompt })))
}

fn settings(state: &State<'_>) -> Value {
    let s = &state.ready.defaults.sampler;
    json!({
        "n_ctx": state.ready.n_ctx,
        "n_predict": state.ready.defaults.n_predict.map_or(-1, |n| n as i64),
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repeat_penalty,
        "repeat_last_n": s.repeat_last_n,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "seed": s.seed,
        "stop": state.ready.defaults.stops,
        "ignore_eos": state.ready.defaults.ignore_eos,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
    })
}

async fn props(AxState(shared): AxState<AppState>) -> Result<Response, ApiError> {
    let state = shared.state()?;
    Ok(json_response(&json!({
        "default_generation_settings": settings(&state),
        "total_slots": state.ready.n_slots,
        "model_path": shared.model_path.display().to_string(),
        "model_alias": shared.model_name,
        "chat_template": state.ready.chat_template_text.clone().unwrap_or_default(),
        "chat_template_name": state.ready.template.name(),
        "build_info": format!("pinfer {}", pinfer::VERSION),
        "modalities": { "vision": false, "audio": false },
    })))
}

async fn slots_list(AxState(shared): AxState<AppState>) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let stats = &shared.stats;
    let list: Vec<Value> = (0..state.ready.n_slots)
        .map(|i| {
            json!({
                "id": i,
                "n_ctx": state.ready.n_ctx,
                "is_processing": stats.busy[i].load(Ordering::Relaxed),
                "n_cached": stats.cached[i].load(Ordering::Relaxed),
                "params": settings(&state),
            })
        })
        .collect();
    Ok(json_response(&Value::Array(list)))
}

async fn metrics(AxState(shared): AxState<AppState>) -> Result<Response, ApiError> {
    let state = shared.state()?;
    if !state.opts.metrics {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "This server does not support metrics endpoint. Start it with `--metrics`",
        ));
    }
    let s = &shared.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (pt, pus, gt, gus) =
        (load(&s.prompt_tokens), load(&s.prompt_us), load(&s.generated_tokens), load(&s.generate_us));
    let rate = |n: u64, us: u64| if us > 0 { n as f64 * 1e6 / us as f64 } else { 0.0 };
    let kv = s.kv_tokens.load(Ordering::Relaxed);
    let capacity = state.ready.n_ctx * state.ready.n_slots;
    let rows: [(&str, &str, &str, f64); 10] = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", pt as f64),
        ("prompt_seconds_total", "counter", "Prompt process time", pus as f64 / 1e6),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", gt as f64),
        ("tokens_predicted_seconds_total", "counter", "Predict process time", gus as f64 / 1e6),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", rate(pt, pus)),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", rate(gt, gus)),
        (
            "kv_cache_usage_ratio",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            kv as f64 / capacity.max(1) as f64,
        ),
        ("kv_cache_tokens", "gauge", "KV-cache tokens.", kv as f64),
        (
            "requests_processing",
            "gauge",
            "Number of requests processing.",
            s.requests_processing.load(Ordering::Relaxed) as f64,
        ),
        (
            "requests_deferred",
            "gauge",
            "Number of requests deferred.",
            s.requests_deferred.load(Ordering::Relaxed) as f64,
        ),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in rows {
        // llama-server's metric names, so its dashboards work unchanged.
        text.push_str(&format!(
            "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
        ));
    }
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// `POST /slots/{id}?action=save|restore|erase` (`{"filename": NAME}` for save and restore,
/// a plain file name inside `--slot-save-path`).
async fn slot_action(
    AxState(shared): AxState<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    body: Body,
) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let Some(dir) = state.opts.slot_save_path.clone() else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "This server does not support slots action. Start it with `--slot-save-path`",
        ));
    };
    let slot: usize = id.parse().map_err(|_| ApiError::invalid(format!("slot id {id:?} is not a number")))?;
    let action =
        query.as_deref().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("action=")).unwrap_or("");
    let body = read_json(&state, body).await?;
    let file = || -> Result<PathBuf, ApiError> {
        let name =
            Fields::new(&body).str("filename")?.ok_or_else(|| ApiError::invalid("'filename' is required"))?;
        let plain = !name.is_empty()
            && name.len() <= 255
            && !name.contains(['/', '\\', '\0'])
            && name != "."
            && name != "..";
        if !plain {
            return Err(ApiError::invalid(format!("'filename' {name:?} must be a plain file name")));
        }
        Ok(dir.join(name))
    };
    let started = std::time::Instant::now();
    let ms = move || started.elapsed().as_secs_f64() * 1e3;
    let blocking = |e: tokio::task::JoinError| ApiError::server(format!("slot file task failed: {e}"));
    let (action, path) = match action {
        "save" => (SlotAction::Save, Some(file()?)),
        "restore" => {
            let path = file()?;
            let (id, n_ctx) = (state.ready.slot_identity, state.ready.n_ctx);
            let read = {
                let path = path.clone();
                tokio::task::spawn_blocking(move || crate::kv_file::read(&path, &id, n_ctx))
            };
            let (tokens, rows) = read.await.map_err(blocking)?.map_err(ApiError::invalid)?;
            (SlotAction::Restore { tokens, rows }, Some(path))
        }
        "erase" => (SlotAction::Erase, None),
        other => return Err(ApiError::invalid(format!("action {other:?}: give save, restore or erase"))),
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    state
        .ready
        .jobs
        .try_send(EngineRequest::Slot { slot, action, reply })
        .map_err(|_| ApiError::unavailable("the server is busy: the queue is full"))?;
    let done = match answer.await {
        Ok(Ok(done)) => done,
        Ok(Err(message)) => return Err(ApiError::invalid(message)),
        Err(_) => return Err(ApiError::server("the engine stopped")),
    };
    let filename = path.as_deref().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned());
    let v = match done {
        SlotDone::Erased { n_tokens } => json!({ "id_slot": slot, "n_erased": n_tokens }),
        SlotDone::Restored { n_tokens } => json!({
            "id_slot": slot, "filename": filename, "n_restored": n_tokens,
            "n_read": crate::kv_file::encoded_len(n_tokens, &state.ready.slot_identity),
            "timings": { "restore_ms": ms() },
        }),
        SlotDone::Saved { tokens, rows } => {
            let (id, path) = (state.ready.slot_identity, path.unwrap_or_default());
            let write = tokio::task::spawn_blocking(move || {
                let bytes = crate::kv_file::encode(&id, &tokens, &rows);
                crate::kv_file::write(&path, &bytes).map(|()| (tokens.len(), bytes.len()))
            });
            let (n_saved, n_written) = write.await.map_err(blocking)?.map_err(ApiError::invalid)?;
            json!({
                "id_slot": slot, "filename": filename, "n_saved": n_saved,
                "n_written": n_written, "timings": { "save_ms": ms() },
            })
        }
    };
    Ok(json_response(&v))
}
