//! The routes (OpenAI, llama-server and Ollama endpoints on one port) behind the API-key check (and,
//! for an embedding model, the refusal of the generating ones),
//! and llama-server's own endpoints: health, models, tokenize, templates, props, slots, metrics.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::extract::{Request, State as AxState};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use super::api::{json_response, read_json, unix_now, ApiError, Fields};
use super::slots::{Request as EngineRequest, SlotAction, SlotDone};
use super::tokens::{detokenize_text, encode_plain};
use super::{anthropic, embeddings, ollama, openai, responses, AppState, State};

/// Every route, behind the API-key check.
pub fn router(shared: AppState) -> Router {
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
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/v1/embeddings", post(embeddings::openai))
        .route("/embeddings", post(embeddings::native))
        .route("/api/embed", post(embeddings::ollama_embed))
        .route("/api/embeddings", post(embeddings::ollama_embeddings))
        .route("/v1/rerank", post(embeddings::rerank))
        .route("/rerank", post(embeddings::rerank))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(shared.clone(), embeddings::only_what_the_model_serves))
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
        "models": [{
            "name": shared.model_name,
            "model": shared.model_name,
            "type": "model",
            "capabilities": shared.capabilities(),
        }],
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
    let tok = &state.ready.tok;
    let ids = if add_special {
        crate::tokenize::encode(tok, content, parse_special).unwrap_or_default()
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
    Ok(json_response(&json!({ "content": detokenize_text(&state.ready.tok, &ids, true) })))
}

async fn apply_template(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let prompt = super::prompt::apply_template(&state, &body)?;
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

/// What the chat template supports, found by rendering probes (as llama-server's
/// `chat_template_caps`): tools (a tool's name reaches the prompt), a system role (its text does),
/// tool calls, and thinking (the template teaches reasoning markers).
fn template_caps(state: &State<'_>) -> Value {
    let format = &state.ready.format;
    let renders = |messages: Value, tools: Option<Value>, needle: &str| {
        format.render(&messages, tools.as_ref(), true, None).is_ok_and(|text| text.contains(needle))
    };
    let user = json!({ "role": "user", "content": "hi" });
    let tool = json!([{ "type": "function", "function": { "name": "probe_tool_x", "description": "",
                        "parameters": { "type": "object", "properties": {} } } }]);
    let call = json!({ "role": "assistant", "content": "", "tool_calls": [
        { "id": "c1", "type": "function", "function": { "name": "probe_call_y", "arguments": {} } }] });
    json!({
        "supports_system_role": renders(json!([{ "role": "system", "content": "probe_system_z" }, user]), None, "probe_system_z"),
        "supports_tools": renders(json!([user]), Some(tool.clone()), "probe_tool_x"),
        "supports_tool_calls": renders(json!([user, call]), Some(tool), "probe_call_y"),
        "supports_thinking": state.ready.reasoning.is_some(),
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
        "chat_template_name": state.ready.format.name(),
        "chat_template_caps": template_caps(&state),
        "build_info": format!("pinfer {}", pinfer::VERSION),
        "modalities": { "vision": state.ready.vision, "audio": false },
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
