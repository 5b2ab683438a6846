//! `pinfer serve`'s start-up: the options checked, the HTTP listener, the engine thread loading the
//! model, and the graceful stop.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use pinfer::model::Pooling;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use serde_json::Map;

use super::embeddings;
use super::routes::router;
use super::slots::{self, GenParams, Request as EngineRequest, Stats};
use super::{Opts, Ready, ServeArgs, Shared};
use crate::gen_args::GenArgs;
use crate::CliError;

fn sampler_defaults(args: &GenArgs) -> Result<GenParams, CliError> {
    let mut sampler = args.sampler()?;
    // A request without a seed gets a new one (llama-server's default seed is random).
    if args.seed == -1 {
        sampler.seed = crate::gen_args::random_seed();
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
        media: None,
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
    let path = crate::model_path(gen.model.clone())?;
    let mut api_keys: Vec<String> = args.api_key.iter().cloned().collect();
    if let Some(file) = &args.api_key_file {
        let text = crate::text_input::read_text_file(file)?;
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
            media_path: args.media_path.clone(),
        },
        model_name,
        model_path: path.clone(),
        model_bytes,
        stats: Arc::new(Stats::new(args.parallel)),
        ready: OnceLock::new(),
        in_flight: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        responses: Default::default(),
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
    let (loaded_tx, loaded_rx) = mpsc::channel::<Result<String, CliError>>();
    let engine_shared = shared.clone();
    let n_seq = args.parallel;
    opts.n_seq = n_seq;
    let total_ctx = gen.ctx;
    let gen_args = gen.clone();
    let kind = ModelKind::asked(&args);
    let engine = std::thread::Builder::new()
        .name("pinfer-engine".into())
        .stack_size(16 << 20)
        .spawn(move || {
            let result = load_engine(&gen_args, &engine_shared, total_ctx, n_seq, kind, defaults, jobs_tx);
            match result {
                Ok(engine) => {
                    let _ = loaded_tx.send(Ok(engine.describe()));
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
        Ok(Ok(Ok(what))) => {
            errln!("pinfer: model loaded; serving {what}");
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

/// What the options ask the model to be: `--embedding`, `--reranking` or `--pooling` ask for an
/// embedding model, with that pooling (None: the file's); without them the file says.
#[derive(Debug, Clone, Copy)]
enum ModelKind {
    Either,
    Embedding(Option<Pooling>),
}

impl ModelKind {
    fn asked(args: &ServeArgs) -> Self {
        let pooling = if args.reranking { Some(Pooling::Rank) } else { args.pooling };
        if args.embedding || pooling.is_some() {
            Self::Embedding(pooling)
        } else {
            Self::Either
        }
    }
}

/// The sequences of an encoder's batch unless `--parallel` asks for more: many inputs share one
/// step (an encoder keeps no cache per sequence).
const EMBEDDING_SEQUENCES: usize = 16;

/// An encoder's batch unless -b/-ub say: llama-server's for embeddings (n_batch = n_ubatch = 512).
const EMBEDDING_BATCH: usize = 512;

/// The engine thread's work: the slots of a generating model or an encoder's jobs.
enum Loaded<'s> {
    Slots(slots::Engine<'s>, usize),
    Embeddings(embeddings::Engine),
}

impl Loaded<'_> {
    fn describe(&self) -> String {
        match self {
            Self::Slots(_, n) => format!("{n} slot(s)"),
            Self::Embeddings(e) => {
                let s = e.served();
                format!(
                    "embeddings (pooling {}, {} values, inputs up to {} tokens)",
                    s.pooling.name(),
                    s.width,
                    s.limit
                )
            }
        }
    }

    fn serve(self, jobs: mpsc::Receiver<EngineRequest>, stop: &AtomicBool) {
        match self {
            Self::Slots(engine, _) => engine.serve(jobs, stop),
            Self::Embeddings(engine) => engine.serve(jobs, stop),
        }
    }
}

/// Loads an embedding model: batches of `EMBEDDING_BATCH` tokens (unless -b/-ub) and of
/// `EMBEDDING_SEQUENCES` inputs (or --parallel), every token an output without pooling.
fn load_encoder(
    gen: &GenArgs,
    runtime: &crate::runtime::Runtime,
    path: &std::path::Path,
    n_seq: usize,
    pooling: Option<Pooling>,
) -> Result<pinfer::session::Session, CliError> {
    let mut opts = gen.session_options()?;
    if gen.batch.is_none() && gen.ubatch.is_none() {
        opts.n_batch = EMBEDDING_BATCH;
    }
    opts.n_seq = n_seq.clamp(EMBEDDING_SEQUENCES, pinfer::engine::MAX_SEQ);
    opts.pooling = pooling;
    opts.logits_all = pooling == Some(Pooling::None);
    let session = runtime.load(path, opts, gen.verbose)?;
    match session.engine().pooling() {
        None => Err(CliError::new(format!(
            "{}: --embedding: this model generates text and has no embedding output (serve an encoder such as bert)",
            path.display()
        ))),
        // The file's pooling is none: every token is an output, which the session must hold.
        Some(Pooling::None) if pooling.is_none() => load_encoder(gen, runtime, path, n_seq, Some(Pooling::None)),
        Some(_) => Ok(session),
    }
}

/// Loads the model on the engine thread and publishes what the handlers need; the scheduler
/// borrows the tokenizer from what is published.
fn load_engine<'s>(
    gen: &GenArgs,
    shared: &'s Arc<Shared>,
    total_ctx: usize,
    n_seq: usize,
    kind: ModelKind,
    defaults: GenParams,
    jobs: mpsc::SyncSender<EngineRequest>,
) -> Result<Loaded<'s>, CliError> {
    let path = crate::model_path(gen.model.clone())?;
    let mut opts = gen.session_options()?;
    opts.n_seq = n_seq;
    let runtime = crate::runtime::Runtime::new(&gen.runtime)?;
    // The context per slot: -c split between the slots (0: the default context each).
    if total_ctx > 0 {
        opts.n_ctx = (total_ctx / n_seq).max(1);
    }
    let session = match kind {
        ModelKind::Embedding(pooling) => load_encoder(gen, &runtime, &path, n_seq, pooling)?,
        ModelKind::Either => {
            let session = runtime.load(&path, opts, gen.verbose)?;
            if session.engine().gives_embeddings() {
                // An encoder is served as one without --embedding: loaded again for its batches.
                drop(session);
                load_encoder(gen, &runtime, &path, n_seq, None)?
            } else {
                session
            }
        }
    };
    let tok = crate::tokenize::tokenizer(&path, session.gguf())?;
    let gguf = session.gguf();
    let chat_template_text = gguf.get_str_opt("tokenizer.chat_template").ok().flatten().map(str::to_string);
    // The CLI's policy: a template pinfer cannot render is refused by name (no ChatML in its place).
    let format = crate::chat::prompt_format(gen, gguf, &tok, &path)?;
    let template_kwargs = crate::chat::template_kwargs(gen)?;
    let reasoning = (gen.reasoning_format != "none")
        .then(|| format.jinja_source().and_then(pinfer::reasoning::Markers::of_template))
        .flatten();
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
        format,
        template_kwargs,
        reasoning,
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
        embedding: None,
        vision: false,
    };
    let projector = match &gen.mmproj {
        Some(file) if !session.engine().gives_embeddings() => Some(Box::new(
            pinfer::media::Projector::open(file, &session).map_err(|e| CliError::new(e.to_string()))?,
        )),
        Some(_) => return Err(CliError::new("--mmproj: an embedding model takes no images".into())),
        None => None,
    };
    if !gen.image.is_empty() {
        return Err(CliError::new(
            "--image: the server takes images in its requests (image_url parts, Ollama's images)".into(),
        ));
    }
    if let Some(projector) = projector.as_deref().filter(|_| gen.verbose > 0) {
        crate::npu::report_encoder(projector);
    }
    let ready = Ready { vision: projector.is_some(), ..ready };
    if session.engine().gives_embeddings() {
        let engine = embeddings::Engine::new(session, shared.stats.clone());
        let ready = Ready { n_slots: 1, embedding: Some(engine.served()), ..ready };
        shared.ready.get_or_init(|| ready);
        return Ok(Loaded::Embeddings(engine));
    }
    // Set once, here: the engine thread loads one model.
    let ready = shared.ready.get_or_init(|| ready);
    let engine =
        slots::Engine::new(session, &ready.tok, shared.stats.clone(), gen.lookup.unwrap_or(0), projector);
    Ok(Loaded::Slots(engine, n_seq))
}
