//! An embedding model's server: OpenAI's `/v1/embeddings`, llama.cpp's `/embeddings` (per-token
//! vectors with pooling `none`), Ollama's `/api/embed` and `/api/embeddings`, and the rerank
//! routes (`/v1/rerank`, `/rerank`: Jina/Cohere's shape, TEI's with `texts`), all through
//! `pinfer::embed` on the engine thread ([`Engine`]).
//!
//! A request's inputs are tokenized and checked here (each refusal a 400 in the route's error
//! shape), then queued whole as one [`Job`]: the engine packs its inputs into batches and runs
//! the jobs in turn, in chunks, so a client that leaves stops its work. A generating model's
//! server refuses these routes, and an encoder's refuses the generating ones
//! ([`only_what_the_model_serves`]), with llama-server's messages.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State as AxState};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use pinfer::embed::{embed_typed, EmbedError, EmbedOptions, Embeddings};
use pinfer::engine::embedding::{normalize, Normalize};
use pinfer::model::Pooling;
use pinfer::session::Session;
use serde_json::{json, Map, Value};

use super::api::{read_json, ApiError, Fields};
use super::slots::{EmbedJob as Job, Event, Request as EngineRequest, Stats};
use super::{AppState, Shared};

/// What the handlers know of the encoder being served.
pub struct Served {
    pub pooling: Pooling,
    /// Values of one vector (`n_embd`, or a reranker's labels).
    pub width: usize,
    /// The most tokens of one input: one batch, within the context.
    pub limit: usize,
    /// Token types of the model's embeddings (a reranker's pair gives its document type 1 when 2+).
    pub token_types: usize,
    /// The model's `rerank` prompt template (Qwen3-Reranker), which a pair fills instead of
    /// BERT's `[CLS] q [SEP] d [SEP]`.
    pub rerank_template: Option<String>,
}

/// Batches per chunk of a job: between chunks the engine sees a client that left, or a stop.
const CHUNK_BATCHES: usize = 4;

/// The engine thread of an encoder's server: the session and the jobs, one after another.
pub struct Engine {
    session: Session,
    stats: Arc<Stats>,
}

impl Engine {
    pub fn new(session: Session, stats: Arc<Stats>) -> Self {
        Self { session, stats }
    }

    /// What the handlers know of the model.
    pub fn served(&self) -> Served {
        let session = &self.session;
        Served {
            pooling: session.engine().pooling().unwrap_or(Pooling::Mean),
            width: session.engine().embedding_width(),
            limit: pinfer::embed::input_limit(session),
            token_types: session.engine().token_types(),
            rerank_template: pinfer::embed::rerank_template(session.gguf()).map(str::to_string),
        }
    }

    /// Runs the jobs until `jobs` is closed; a generation or slot request gets a refusal.
    pub fn serve(mut self, jobs: mpsc::Receiver<EngineRequest>, stop: &AtomicBool) {
        while let Ok(request) = jobs.recv() {
            match request {
                EngineRequest::Embed(job) => self.run(*job, stop),
                EngineRequest::Generate(job) => {
                    let _ = job.events.send(Event::Failed("the model is an embedding model".into()));
                }
                EngineRequest::Slot { reply, .. } => {
                    let _ = reply.send(Err("an embedding model's server keeps no slot caches".into()));
                }
            }
        }
    }

    fn run(&mut self, job: Job, stop: &AtomicBool) {
        let started = Instant::now();
        let chunk = CHUNK_BATCHES * self.session.n_seq().max(1);
        let pooling = self.session.engine().pooling().unwrap_or(Pooling::Mean);
        let n = job.inputs.len();
        let mut all =
            Embeddings { width: 0, pooling, rows: Vec::with_capacity(n), tokens: Vec::with_capacity(n) };
        for (c, part) in job.inputs.chunks(chunk).enumerate() {
            if job.reply.is_closed() || stop.load(Ordering::Relaxed) {
                return;
            }
            let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
            let types: Vec<&[u32]> =
                job.types.iter().skip(c * chunk).take(part.len()).map(Vec::as_slice).collect();
            match embed_typed(&mut self.session, &refs, &types, &job.opts) {
                Ok(got) => {
                    all.width = got.width;
                    all.rows.extend(got.rows);
                    all.tokens.extend(got.tokens);
                }
                Err(e) => {
                    let _ = job.reply.send(Err(offset(e, c * chunk)));
                    return;
                }
            }
        }
        let tokens: usize = all.tokens.iter().sum();
        self.stats.prompt_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.stats.prompt_us.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        let _ = job.reply.send(Ok(all));
    }
}

/// A chunk's error naming the input by its place in the whole job.
fn offset(e: EmbedError, first: usize) -> EmbedError {
    match e {
        EmbedError::Empty { index } => EmbedError::Empty { index: first + index },
        EmbedError::ExceedsContext { index, tokens, limit } => {
            EmbedError::ExceedsContext { index: first + index, tokens, limit }
        }
        other => other,
    }
}

/// llama-server's refusal of embeddings by a server without an embedding model (501).
fn no_embeddings(shared: &Shared) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "not_supported_error",
        format!(
            "This server does not support embeddings. Start it with `--embeddings` and an embedding model \
             ({} generates text)",
            shared.model_name
        ),
    )
}

/// The encoder being served, or the refusal of a generating model's server.
fn served(shared: &Shared) -> Result<&Served, ApiError> {
    shared.state()?.ready.embedding.as_ref().ok_or_else(|| no_embeddings(shared))
}

/// Keeps a request counted against `--queue` until it is answered.
struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Queues `inputs` on the engine thread and waits for their vectors: 503 when the queue is full
/// or the server is stopping.
async fn run_job(
    shared: &Arc<Shared>,
    (inputs, types): TypedInputs,
    opts: EmbedOptions,
) -> Result<Embeddings, ApiError> {
    let state = shared.state()?;
    if shared.stop.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    // One job runs, `--queue` wait.
    if shared.in_flight.fetch_add(1, Ordering::Relaxed) > state.opts.queue {
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::unavailable("the server is busy: the queue is full"));
    }
    let _counted = InFlight(shared.clone());
    let (reply, answer) = tokio::sync::oneshot::channel();
    state
        .ready
        .jobs
        .try_send(EngineRequest::Embed(Box::new(Job { inputs, types, opts, reply })))
        .map_err(|_| ApiError::unavailable("the server is busy: the queue is full"))?;
    match answer.await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(embed_error(shared, e)),
        Err(_) => Err(ApiError::server("the engine stopped")),
    }
}

fn embed_error(shared: &Shared, e: EmbedError) -> ApiError {
    match e {
        EmbedError::NotAnEncoder => no_embeddings(shared),
        EmbedError::Empty { index } => empty(index),
        EmbedError::ExceedsContext { tokens, limit, .. } => ApiError::exceeds_context(tokens, limit),
        other => ApiError::server(other.to_string()),
    }
}

/// Token ids of `text`, as the model adds its special tokens (`[CLS] ... [SEP]`); special-token
/// text is parsed, as llama-server does.
fn tokenize(tok: &pinfer::tokenizer::Tokenizer<'_>, text: &str) -> Result<Vec<u32>, ApiError> {
    crate::tokenize::encode(tok, text, true).map_err(|e| match e {
        crate::CliError::Message(m) => ApiError::invalid(m),
        _ => ApiError::invalid("the input cannot be tokenized"),
    })
}

/// llama-server's message for an input without tokens.
fn empty(index: usize) -> ApiError {
    ApiError::invalid(format!("Input content cannot be empty (input {index})"))
}

/// How a route takes its inputs.
#[derive(Clone, Copy)]
struct Rules {
    /// Cut an input longer than the limit instead of refusing it.
    truncate: bool,
    /// The field named in messages (`input`, `prompt`, `documents`).
    field: &'static str,
}

/// One input's token ids: text tokenized as the model says (its `[CLS] ... [SEP]`), token ids
/// taken as given; checked (not empty, ids in the vocabulary, within the limit unless truncated).
fn input_tokens(shared: &Shared, v: &Value, index: usize, rules: Rules) -> Result<Vec<u32>, ApiError> {
    let state = shared.state()?;
    let served = served(shared)?;
    let at = |what: &str| ApiError::invalid(format!("'{}[{index}]' must be {what}", rules.field));
    let ids = match v {
        Value::String(text) => {
            if text.is_empty() {
                return Err(empty(index));
            }
            tokenize(&state.ready.tok, text)?
        }
        Value::Array(list) => {
            let n_vocab = state.ready.n_vocab as u64;
            let mut ids = Vec::with_capacity(list.len());
            for (j, id) in list.iter().enumerate() {
                match id.as_u64() {
                    Some(id) if id < n_vocab => ids.push(id as u32),
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "'{}[{index}][{j}]' must be a token id below {n_vocab}",
                            rules.field
                        )))
                    }
                }
            }
            ids
        }
        _ => return Err(at("a string or an array of token ids")),
    };
    if ids.is_empty() {
        return Err(empty(index));
    }
    if ids.len() > served.limit && !rules.truncate {
        return Err(ApiError::exceeds_context(ids.len(), served.limit));
    }
    Ok(ids)
}

/// Every input of `v` (a string, an array of strings or token arrays, or one token array), tokenized
/// off the async threads (10 000 inputs take a while).
async fn inputs(shared: &Arc<Shared>, v: Value, rules: Rules) -> Result<Vec<Vec<u32>>, ApiError> {
    let list = match v {
        Value::Array(list) if list.is_empty() => {
            return Err(ApiError::invalid(format!("\"{}\" must not be empty", rules.field)))
        }
        // An array of numbers is one input's ids.
        Value::Array(list) if !list.iter().all(Value::is_number) => list,
        one => vec![one],
    };
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || {
        list.iter().enumerate().map(|(i, v)| input_tokens(&shared, v, i, rules)).collect()
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing the inputs: {e}")))?
}

/// `dimensions`: how many leading values each vector keeps (1 to the model's width).
fn dimensions(f: &Fields<'_>, width: usize) -> Result<usize, ApiError> {
    match f.i64("dimensions")? {
        None => Ok(width),
        Some(d) if d >= 1 && d as u64 <= width as u64 => Ok(d as usize),
        Some(d) => Err(ApiError::invalid(format!("'dimensions' {d}: give 1 to {width} (the model's width)"))),
    }
}

/// `embd_normalize` (llama.cpp's values; the server's default Euclidean).
fn normalization(f: &Fields<'_>) -> Result<Normalize, ApiError> {
    match f.i64("embd_normalize")? {
        None => Ok(Normalize::Euclidean),
        Some(v) => i32::try_from(v).ok().and_then(Normalize::from_value).ok_or_else(|| {
            ApiError::invalid(format!("'embd_normalize' {v}: the values are -1, 0, 1, 2 and above"))
        }),
    }
}

/// Input `i`'s rows cut to their first `dims` values and normalised again (Matryoshka models;
/// the normalisations are scalings, so this is the cut vector's own normalisation).
fn rows(out: &Embeddings, i: usize, dims: usize, norm: Normalize) -> Vec<Vec<f32>> {
    let width = out.width.max(1);
    out.rows[i]
        .chunks(width)
        .map(|row| {
            let mut v = vec![0f32; dims.min(row.len())];
            if v.len() == row.len() {
                v.copy_from_slice(row);
            } else {
                normalize(&row[..v.len()], &mut v, norm);
            }
            v
        })
        .collect()
}

/// A JSON array of numbers, written as f32's shortest text (null for a non-finite value, as
/// serde_json writes it); the vectors are most of a response.
fn push_floats(s: &mut String, v: &[f32]) {
    s.push('[');
    for (k, x) in v.iter().enumerate() {
        if k > 0 {
            s.push(',');
        }
        if x.is_finite() {
            let _ = write!(s, "{x:?}");
        } else {
            s.push_str("null");
        }
    }
    s.push(']');
}

/// Standard base64 (with padding) of `bytes`: OpenAI's `encoding_format: "base64"`.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                s.push(ABC[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// A JSON response from text already written.
fn json_text(text: String) -> Response {
    (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "application/json; charset=utf-8")], text)
        .into_response()
}

/// The model a response names: the request's, else the server's.
fn model_name(f: &Fields<'_>, shared: &Shared) -> Result<String, ApiError> {
    Ok(f.str("model")?.unwrap_or(&shared.model_name).to_string())
}

/// `POST /v1/embeddings` (OpenAI's shape) and `/embeddings` (llama.cpp's: every input's rows).
pub async fn openai(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    embeddings(shared, body, true).await
}

/// `POST /embeddings`: llama.cpp's own shape, `[{index, embedding: [[...]]}]` (a row per token
/// with pooling none).
pub async fn native(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    embeddings(shared, body, false).await
}

async fn embeddings(shared: AppState, body: Body, oai: bool) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let served = served(&shared)?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    // llama.cpp: `content` instead of `input` asks for its own shape.
    let (input, oai) = match (f.get("input"), f.get("content")) {
        (Some(v), _) => (v.clone(), oai),
        (None, Some(v)) => (v.clone(), false),
        (None, None) => return Err(ApiError::invalid("\"input\" or \"content\" must be provided")),
    };
    if oai && served.pooling == Pooling::None {
        return Err(ApiError::invalid(
            "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
        ));
    }
    let base64_format = match f.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return Err(ApiError::invalid(
                "The format to return the embeddings in. Can be either float or base64",
            ))
        }
    };
    let dims = dimensions(&f, served.width)?;
    let norm = normalization(&f)?;
    let truncate = f.bool("truncate")?.unwrap_or(false);
    let model = model_name(&f, &shared)?;
    let inputs = inputs(&shared, input, Rules { truncate, field: "input" }).await?;
    let out = run_job(&shared, (inputs, Vec::new()), EmbedOptions { normalize: norm, truncate }).await?;
    let mut s = String::with_capacity(out.rows.len() * (dims * 12 + 64) + 128);
    if oai {
        let n: usize = out.tokens.iter().sum();
        let _ = write!(s, "{{\"model\":{},\"object\":\"list\",\"usage\":{{\"prompt_tokens\":{n},\"total_tokens\":{n}}},\"data\":[", json!(model));
        for i in 0..out.rows.len() {
            let v = rows(&out, i, dims, norm).swap_remove(0);
            if i > 0 {
                s.push(',');
            }
            s.push_str("{\"object\":\"embedding\",\"index\":");
            let _ = write!(s, "{i},\"embedding\":");
            if base64_format {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                let _ = write!(s, "\"{}\",\"encoding_format\":\"base64\"}}", base64(&bytes));
            } else {
                push_floats(&mut s, &v);
                s.push('}');
            }
        }
        s.push_str("]}");
    } else {
        s.push('[');
        for i in 0..out.rows.len() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{{\"index\":{i},\"embedding\":[");
            for (r, row) in rows(&out, i, dims, norm).iter().enumerate() {
                if r > 0 {
                    s.push(',');
                }
                push_floats(&mut s, row);
            }
            s.push_str("]}");
        }
        s.push(']');
    }
    Ok(json_text(s))
}

/// Ollama's refusal of a generating model's embeddings (its error shape, 400).
fn ollama_served(shared: &Shared) -> Result<&Served, ApiError> {
    served(shared).map_err(|e| match e.status {
        StatusCode::NOT_IMPLEMENTED => {
            ApiError::invalid(format!("\"{}\" does not support embeddings", shared.model_name))
        }
        _ => e,
    })
}

/// `POST /api/embed` (Ollama): `input` a string or an array, `truncate` (default true),
/// `dimensions`, `keep_alive` and `options` accepted; the vectors L2-normalised.
pub async fn ollama_embed(AxState(shared): AxState<AppState>, body: Body) -> Response {
    ollama_embed_inner(shared, body).await.unwrap_or_else(ApiError::ollama)
}

async fn ollama_embed_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let state = shared.state()?;
    let served = ollama_served(&shared)?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    ollama_common(&f)?;
    if served.pooling == Pooling::None {
        return Err(ApiError::invalid("pooling 'none' gives every token's vector: use /embeddings"));
    }
    let input = f.get("input").cloned().ok_or_else(|| ApiError::invalid("\"input\" must be provided"))?;
    let dims = dimensions(&f, served.width)?;
    let truncate = f.bool("truncate")?.unwrap_or(true);
    let model = model_name(&f, &shared)?;
    let inputs = inputs(&shared, input, Rules { truncate, field: "input" }).await?;
    let norm = Normalize::Euclidean;
    let out = run_job(&shared, (inputs, Vec::new()), EmbedOptions { normalize: norm, truncate }).await?;
    let mut s = String::with_capacity(out.rows.len() * (dims * 12 + 8) + 160);
    let _ = write!(s, "{{\"model\":{},\"embeddings\":[", json!(model));
    for i in 0..out.rows.len() {
        if i > 0 {
            s.push(',');
        }
        push_floats(&mut s, &rows(&out, i, dims, norm)[0]);
    }
    let n: usize = out.tokens.iter().sum();
    let ns = started.elapsed().as_nanos();
    let _ = write!(s, "],\"total_duration\":{ns},\"load_duration\":0,\"prompt_eval_count\":{n}}}");
    Ok(json_text(s))
}

/// `keep_alive` and `options` are accepted (one model stays loaded); wrong types are 400s.
fn ollama_common(f: &Fields<'_>) -> Result<(), ApiError> {
    f.object("options")?;
    match f.get("keep_alive") {
        None | Some(Value::String(_) | Value::Number(_)) => Ok(()),
        Some(_) => Err(ApiError::invalid("'keep_alive' must be a duration string or a number of seconds")),
    }
}

/// `POST /api/embeddings` (Ollama's older route): `prompt` -> `{embedding}`, not normalised
/// (as Ollama answers it).
pub async fn ollama_embeddings(AxState(shared): AxState<AppState>, body: Body) -> Response {
    ollama_embeddings_inner(shared, body).await.unwrap_or_else(ApiError::ollama)
}

async fn ollama_embeddings_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let served = ollama_served(&shared)?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    ollama_common(&f)?;
    if served.pooling == Pooling::None {
        return Err(ApiError::invalid("pooling 'none' gives every token's vector: use /embeddings"));
    }
    let prompt = f.str("prompt")?.ok_or_else(|| ApiError::invalid("\"prompt\" must be provided"))?;
    let rules = Rules { truncate: true, field: "prompt" };
    let inputs = inputs(&shared, Value::String(prompt.to_string()), rules).await?;
    let out =
        run_job(&shared, (inputs, Vec::new()), EmbedOptions { normalize: Normalize::None, truncate: true })
            .await?;
    let mut s = String::from("{\"embedding\":");
    push_floats(&mut s, out.row(0, 0).unwrap_or(&[]));
    s.push('}');
    Ok(json_text(s))
}

/// `POST /v1/rerank` and `/rerank`: each document's score for the query by a cross-encoder, sorted
/// best first; Jina/Cohere's shape (`results[{index, relevance_score, document?}]`), or TEI's
/// (a bare array of `{index, score, text?}`) when the documents come as `texts`.
pub async fn rerank(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let not_a_reranker = || {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "This server does not support reranking. Start it with `--reranking`",
        )
    };
    let served = state.ready.embedding.as_ref().ok_or_else(not_a_reranker)?;
    if served.pooling != Pooling::Rank {
        return Err(not_a_reranker());
    }
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    let query = match f.get("query") {
        None => return Err(ApiError::invalid("\"query\" must be provided")),
        Some(Value::String(q)) => q.clone(),
        Some(_) => return Err(ApiError::invalid("\"query\" must be a string")),
    };
    let tei = f.get("texts").is_some();
    let docs: Vec<String> = match f.get("documents").or(f.get("texts")) {
        Some(Value::Array(list)) if !list.is_empty() => list
            .iter()
            .map(|d| match d {
                Value::String(s) => Some(s.clone()),
                // (Cohere's documents may be objects with their text.)
                Value::Object(m) => m.get("text").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::invalid("\"documents\" must be a non-empty string array"))?,
        _ => return Err(ApiError::invalid("\"documents\" must be a non-empty string array")),
    };
    let top_n = match f.i64("top_n")? {
        None => docs.len(),
        Some(n) if n >= 0 => (n as u64).min(docs.len() as u64) as usize,
        Some(n) => return Err(ApiError::invalid(format!("'top_n' {n} must not be negative"))),
    };
    let with_text = if tei { f.bool("return_text")? } else { f.bool("return_documents")? }.unwrap_or(false);
    let truncate = f.bool("truncate")?.unwrap_or(false);
    let model = model_name(&f, &shared)?;
    // Each pair tokenized whole, then checked as one input.
    let pairs = {
        let shared = shared.clone();
        let (query, docs) = (query.clone(), docs.clone());
        tokio::task::spawn_blocking(move || rerank_pairs(&shared, &query, &docs, truncate))
            .await
            .map_err(|e| ApiError::server(format!("tokenizing the documents: {e}")))??
    };
    let out = run_job(&shared, pairs, EmbedOptions { normalize: Normalize::None, truncate }).await?;
    let mut scored: Vec<(usize, f32)> = (0..docs.len())
        .map(|i| (i, out.row(i, 0).and_then(|r| r.first()).copied().unwrap_or(f32::NAN)))
        .collect();
    // Best first; equal scores keep the documents' order.
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    scored.truncate(top_n);
    let score_key = if tei { "score" } else { "relevance_score" };
    let results: Vec<Value> = scored
        .iter()
        .map(|&(i, score)| {
            let mut r = Map::new();
            r.insert("index".into(), json!(i));
            r.insert(score_key.into(), json!(score));
            if with_text && tei {
                r.insert("text".into(), json!(docs[i]));
            } else if with_text {
                r.insert("document".into(), json!({ "text": docs[i] }));
            }
            Value::Object(r)
        })
        .collect();
    if tei {
        return Ok(json_text(Value::Array(results).to_string()));
    }
    let n: usize = out.tokens.iter().sum();
    Ok(json_text(
        json!({
            "model": model,
            "object": "list",
            "usage": { "prompt_tokens": n, "total_tokens": n },
            "results": results,
        })
        .to_string(),
    ))
}

/// Inputs of a job (token ids each) and their token types (one list per input, or none).
type TypedInputs = (Vec<Vec<u32>>, Vec<Vec<u32>>);

/// The query paired with each document as `pinfer rerank` pairs them (the model's `rerank`
/// template filled, else `[CLS] q [SEP] d [SEP]`), and the pairs' token types (empty for a
/// one-type model).
fn rerank_pairs(
    shared: &Shared,
    query: &str,
    docs: &[String],
    truncate: bool,
) -> Result<TypedInputs, ApiError> {
    let state = shared.state()?;
    let served = served(shared)?;
    let tok = &state.ready.tok;
    let encode = |text: &str, what: &str| {
        if text.is_empty() {
            return Err(ApiError::invalid(format!("Input content cannot be empty ({what})")));
        }
        tokenize(tok, text)
    };
    // (A templated pair tokenizes the filled prompt: the query alone only for BERT's pairs.)
    let q = match served.rerank_template {
        Some(_) if query.is_empty() => {
            return Err(ApiError::invalid("Input content cannot be empty (the query)"))
        }
        Some(_) => Vec::new(),
        None => encode(query, "the query")?,
    };
    let (mut pairs, mut types) = (Vec::with_capacity(docs.len()), Vec::new());
    for (i, d) in docs.iter().enumerate() {
        let (pair, pair_types) = match &served.rerank_template {
            Some(template) => {
                if d.is_empty() {
                    return Err(ApiError::invalid(format!("Input content cannot be empty (document {i})")));
                }
                (crate::embed::templated_pair(tok, template, query, d).map_err(ApiError::invalid)?, None)
            }
            None => crate::embed::rerank_pair(&q, &encode(d, &format!("document {i}"))?, served.token_types),
        };
        if pair.len() > served.limit && !truncate {
            return Err(ApiError::exceeds_context(pair.len(), served.limit));
        }
        pairs.push(pair);
        if let Some(t) = pair_types {
            types.push(t);
        }
    }
    Ok((pairs, types))
}

/// The routes that generate text.
const GENERATING: [&str; 9] = [
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/completion",
    "/v1/responses",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
];

/// An embedding model's server refuses the routes that generate, each in its API's error shape:
/// llama-server's 501 (`not_supported_error`), Ollama's 400 "does not support chat/generate",
/// Anthropic's error object.
pub async fn only_what_the_model_serves(
    AxState(shared): AxState<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    let encoder = shared.ready.get().is_some_and(|r| r.embedding.is_some());
    if !encoder || !GENERATING.contains(&path) {
        return next.run(req).await;
    }
    let name = &shared.model_name;
    match path {
        "/api/chat" => ApiError::invalid(format!("\"{name}\" does not support chat")).ollama(),
        "/api/generate" => ApiError::invalid(format!("\"{name}\" does not support generate")).ollama(),
        _ => {
            let e = ApiError::new(
                StatusCode::NOT_IMPLEMENTED,
                "not_supported_error",
                format!(
                    "This server does not support completions: {name} is an embedding model \
                     (it serves /v1/embeddings{})",
                    if shared
                        .ready
                        .get()
                        .and_then(|r| r.embedding.as_ref())
                        .is_some_and(|s| s.pooling == Pooling::Rank)
                    {
                        " and /v1/rerank"
                    } else {
                        ""
                    }
                ),
            );
            if path == "/v1/messages" {
                e.anthropic()
            } else {
                e.into_response()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_pads_as_the_standard_says() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }
}
