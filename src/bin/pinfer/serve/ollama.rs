//! The Ollama API on the same port (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`,
//! `/api/ps`, `/api/version`), so Ollama clients and Open WebUI work unchanged: newline-delimited
//! JSON streaming (on by default), durations in nanoseconds, `done_reason`.

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::Response;
use pinfer::chat::Role;
use serde_json::{json, Value};

use super::api::{gen_params, json_response, read_json, rfc3339_now, ApiError, Dialect, Fields};
use super::jobs::{collect, finish_reason, stream_events, stream_of, submit, Submitted};
use super::prompt::{chat_prompt, render_chat};
use super::slots::{Event, Summary};
use super::tokens::encode;
use super::{AppState, Shared};
use pinfer::reasoning::{split, Piece, Splitter};
use std::sync::{Arc, Mutex};

/// The version Ollama clients see (a recent Ollama's: clients check for features by it).
const OLLAMA_VERSION: &str = "0.12.0";

/// The durations and counts of a finished Ollama response.
fn done_fields(v: &mut Value, s: &Summary) {
    let ns = |ms: f64| (ms * 1e6) as u64;
    v["done"] = json!(true);
    v["done_reason"] = json!(finish_reason(s.stop));
    v["total_duration"] = json!(ns(s.prompt_ms + s.generate_ms));
    // The model stays loaded for the server's life: no request waits for a load.
    v["load_duration"] = json!(0);
    v["prompt_eval_count"] = json!(s.n_prompt - s.n_cached);
    v["prompt_eval_duration"] = json!(ns(s.prompt_ms));
    v["eval_count"] = json!(s.n_generated);
    v["eval_duration"] = json!(ns(s.generate_ms));
}

/// Streams a generation as NDJSON lines made by `line` (text) and finished by `last`.
fn ndjson(
    sub: Submitted,
    line: impl Fn(&str) -> Value + Send + 'static,
    last: impl Fn(&Summary) -> Value + Send + 'static,
) -> Response {
    stream_events(sub, "application/x-ndjson", move |event| match event {
        Event::Token { text, .. } if text.is_empty() => None,
        Event::Token { text, .. } => Some(format!("{}\n", line(&text))),
        Event::Done(s) => Some(format!("{}\n", last(&s))),
        Event::Failed(message) => Some(format!("{}\n", json!({ "error": message }))),
    })
}

/// `POST /api/chat`.
pub async fn chat(AxState(shared): AxState<AppState>, body: Body) -> Response {
    chat_inner(shared, body).await.unwrap_or_else(ApiError::ollama)
}

/// `POST /api/generate`.
pub async fn generate(AxState(shared): AxState<AppState>, body: Body) -> Response {
    generate_inner(shared, body).await.unwrap_or_else(ApiError::ollama)
}

/// `POST /api/show`.
pub async fn show(AxState(shared): AxState<AppState>, body: Body) -> Response {
    show_inner(shared, body).await.unwrap_or_else(ApiError::ollama)
}

/// `POST /api/chat` (errors in Ollama's shape by [`chat`]).
async fn chat_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    if Fields::new(&body).array("messages")?.is_none_or(Vec::is_empty) {
        // No messages only loads the model (Ollama's answer, which clients use to warm it up).
        return Ok(json_response(&json!({
            "model": shared.model_name, "created_at": rfc3339_now(),
            "message": { "role": "assistant", "content": "" }, "done": true, "done_reason": "load",
        })));
    }
    let mut params = gen_params(&state, &body, Dialect::Ollama)?;
    let stream = Fields::new(&body).bool("stream")?.unwrap_or(true);
    let (prompt, tools) = chat_prompt(&state, &body, &mut params)?;
    let reasoning = super::prompt::reasoning(&state, &body, &prompt)?;
    let sub = submit(&shared, encode(&state, &prompt, true), params)?;
    let model = shared.model_name.clone();
    let message = |content: &str| json!({ "role": "assistant", "content": content });
    // Ollama's `message.thinking` holds the reasoning.
    let whole = move |text: &str| {
        let (thought, answer) = match reasoning {
            Some((m, opened)) => split(m, opened, text),
            None => (None, text.to_string()),
        };
        (thought, answer)
    };
    if let Some(t) = tools {
        // Tool calls are known once the reply is complete: it is sent whole (one line when
        // streaming, as Ollama does for a tool call).
        let c = collect(sub).await?;
        let (thought, text, calls) = super::prompt::reply_parts(&c.text, reasoning, Some(&t));
        let mut m = message(&text);
        if let Some(thought) = thought {
            m["thinking"] = json!(thought);
        }
        if !calls.is_empty() {
            m["tool_calls"] = calls
                .iter()
                .map(|c| json!({ "function": { "name": c.name, "arguments": c.arguments } }))
                .collect();
        }
        let mut v = json!({ "model": model, "created_at": rfc3339_now(), "message": m });
        done_fields(&mut v, &c.summary);
        if !stream {
            return Ok(json_response(&v));
        }
        let first = json!({ "model": model, "created_at": rfc3339_now(), "message": v["message"].clone(), "done": false });
        v["message"] = message("");
        return Ok(stream_of("application/x-ndjson", vec![format!("{first}\n"), format!("{v}\n")]));
    }
    if !stream {
        let c = collect(sub).await?;
        let (thought, answer) = whole(&c.text);
        let mut m = message(&answer);
        if let Some(thought) = thought {
            m["thinking"] = json!(thought);
        }
        let mut v = json!({ "model": model, "created_at": rfc3339_now(), "message": m });
        done_fields(&mut v, &c.summary);
        return Ok(json_response(&v));
    }
    let m2 = model.clone();
    let splitter = Arc::new(Mutex::new(reasoning.map(|(m, opened)| Splitter::new(m, opened))));
    let splitter2 = splitter.clone();
    let with_piece = move |piece: Piece| {
        let mut m = message(&piece.content);
        if !piece.reasoning.is_empty() {
            m["thinking"] = json!(piece.reasoning);
        }
        m
    };
    Ok(ndjson(
        sub,
        move |text| {
            let piece = match splitter.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                Some(s) => s.push(text),
                None => Piece { reasoning: String::new(), content: text.to_string() },
            };
            json!({ "model": m2, "created_at": rfc3339_now(), "message": with_piece(piece), "done": false })
        },
        move |s| {
            // What the splitter still held goes out with the last line.
            let rest = splitter2.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map(Splitter::finish);
            let mut v = json!({ "model": model, "created_at": rfc3339_now(), "message": with_piece(rest.unwrap_or_default()) });
            done_fields(&mut v, s);
            v
        },
    ))
}

/// `POST /api/generate` (see [`generate`]): the prompt through the chat template (with `system`), or as it is with
/// `raw`; an empty prompt only loads the model (answered at once, as Ollama does).
async fn generate_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    let prompt = f.str("prompt")?.unwrap_or("");
    let model = shared.model_name.clone();
    if prompt.is_empty() {
        return Ok(json_response(&json!({
            "model": model, "created_at": rfc3339_now(), "response": "", "done": true, "done_reason": "load",
        })));
    }
    let mut params = gen_params(&state, &body, Dialect::Ollama)?;
    let stream = f.bool("stream")?.unwrap_or(true);
    // (`images`: base64 strings, each a media marker before the prompt.)
    let mut images =
        super::prompt::Images { media_path: state.opts.media_path.clone(), ..Default::default() };
    let markers = super::prompt::request_images(&body, &mut images)?;
    let text = if f.bool("raw")?.unwrap_or(false) {
        markers + prompt
    } else {
        let mut turns = Vec::new();
        if let Some(system) = f.str("system")? {
            turns.push((Role::System, system.to_string()));
        }
        turns.push((Role::User, markers + prompt));
        render_chat(&state, &turns)?
    };
    params.media = super::prompt::media(&state, &text, images)?;
    let sub = submit(&shared, encode(&state, &text, true), params)?;
    if !stream {
        let c = collect(sub).await?;
        let mut v = json!({ "model": model, "created_at": rfc3339_now(), "response": c.text });
        done_fields(&mut v, &c.summary);
        v["context"] = json!(c.summary.tokens);
        return Ok(json_response(&v));
    }
    let m2 = model.clone();
    Ok(ndjson(
        sub,
        move |text| json!({ "model": m2, "created_at": rfc3339_now(), "response": text, "done": false }),
        move |s| {
            let mut v = json!({ "model": model, "created_at": rfc3339_now(), "response": "" });
            done_fields(&mut v, s);
            v["context"] = json!(s.tokens);
            v
        },
    ))
}

/// The model's entry in `/api/tags` and `/api/ps`.
fn model_entry(shared: &Shared) -> Value {
    let ready = shared.ready.get();
    let family = ready.map_or("", |r| r.arch.as_str());
    let size = ready.map_or(0, |r| r.n_params);
    let parameter_size = if size >= 1_000_000_000 {
        format!("{:.1}B", size as f64 / 1e9)
    } else {
        format!("{:.0}M", size as f64 / 1e6)
    };
    json!({
        "name": shared.model_name,
        "model": shared.model_name,
        "modified_at": rfc3339_now(),
        "size": shared.model_bytes,
        "digest": format!("{:016x}{:016x}", shared.model_bytes, fnv(&shared.model_name)),
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": parameter_size,
            "quantization_level": ready.map_or("", |r| r.quant.as_str()),
        },
    })
}

/// FNV-1a of a name (a stable stand-in digest: the file is not hashed at startup).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// `GET /api/tags`: the one model.
pub async fn tags(AxState(shared): AxState<AppState>) -> Response {
    json_response(&json!({ "models": [model_entry(&shared)] }))
}

/// `GET /api/ps`: the model, loaded for as long as the server runs.
pub async fn ps(AxState(shared): AxState<AppState>) -> Response {
    let mut entry = model_entry(&shared);
    entry["expires_at"] = json!("2318-01-01T00:00:00Z");
    entry["size_vram"] = json!(0);
    json_response(&json!({ "models": if shared.ready.get().is_some() { vec![entry] } else { vec![] } }))
}

/// `POST /api/show` (see [`show`]).
async fn show_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let _ = read_json(&state, body).await?;
    let entry = model_entry(&shared);
    let r = state.ready;
    Ok(json_response(&json!({
        "license": "",
        "modelfile": format!("FROM {}\n", shared.model_path.display()),
        "parameters": "",
        "template": r.chat_template_text.clone().unwrap_or_default(),
        "details": entry["details"],
        "model_info": {
            "general.architecture": r.arch,
            "general.parameter_count": r.n_params,
            format!("{}.context_length", r.arch): r.n_ctx_train,
        },
        "capabilities": shared.capabilities(),
        "modified_at": entry["modified_at"],
    })))
}

/// `GET /api/version`.
pub async fn version() -> Response {
    json_response(&json!({ "version": OLLAMA_VERSION }))
}
