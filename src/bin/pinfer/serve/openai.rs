//! The OpenAI endpoints (`/v1/chat/completions`, `/v1/completions`) and llama-server's native
//! `/completion`, streaming by server-sent events.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::Response;
use pinfer::generate::Stop;
use serde_json::{json, Map, Value};

use super::api::{gen_params, json_response, read_json, unix_now, ApiError, Dialect, Fields};
use super::jobs::{collect, finish_reason, stream_events, submit, Submitted};
use super::prompt::chat_prompt;
use super::slots::{Event, Summary, TokenProbs};
use super::tokens::encode;
use super::tool_stream::{Delta, ToolStream};
use super::tools;
use super::{AppState, State};
use pinfer::reasoning::{split, Markers, Piece, Splitter};
use std::sync::{Arc, Mutex};

/// A response id: a prefix, the process's start and a counter.
pub(super) fn response_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("{prefix}-{:x}{:06x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The prompt of a completion request: a string, token ids, or a list of one of them.
fn prompt_tokens(state: &State<'_>, body: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let bad = || ApiError::invalid("'prompt' must be a string, a list of token ids, or a list of one string");
    let ids_of = |list: &[Value]| -> Result<Vec<u32>, ApiError> {
        list.iter()
            .map(|v| {
                v.as_u64().filter(|&id| id < state.ready.n_vocab as u64).map(|id| id as u32).ok_or_else(bad)
            })
            .collect()
    };
    match body.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::invalid("'prompt' is required")),
        Some(Value::String(s)) => Ok(encode(state, s, true)),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => ids_of(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(encode(state, s, true)),
            Value::Array(ids) => ids_of(ids),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

fn usage(n_prompt: usize, n_generated: usize) -> Value {
    json!({
        "prompt_tokens": n_prompt,
        "completion_tokens": n_generated,
        "total_tokens": n_prompt + n_generated,
    })
}

/// A stream's last chunks: `end`, then with `include_usage` the usage chunk (`usage_head`: a chunk
/// with no choices).
fn closing(end: Value, mut usage_head: Value, s: &Summary, include_usage: bool) -> Vec<Value> {
    if !include_usage {
        return vec![end];
    }
    usage_head["usage"] = usage(s.n_prompt, s.n_generated);
    vec![end, usage_head]
}

/// llama-server's `timings` object.
fn timings(s: &Summary) -> Value {
    let n_prompt = s.n_prompt - s.n_cached;
    let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let rate = |ms: f64, n: usize| if ms > 0.0 { 1e3 * n as f64 / ms } else { 0.0 };
    let mut t = json!({
        "cache_n": s.n_cached,
        "prompt_n": n_prompt,
        "prompt_ms": s.prompt_ms,
        "prompt_per_token_ms": per(s.prompt_ms, n_prompt),
        "prompt_per_second": rate(s.prompt_ms, n_prompt),
        "predicted_n": s.n_generated,
        "predicted_ms": s.generate_ms,
        "predicted_per_token_ms": per(s.generate_ms, s.n_generated),
        "predicted_per_second": rate(s.generate_ms, s.n_generated),
    });
    // (As llama-server: only when guesses were made.)
    if s.n_drafted > 0 {
        t["draft_n"] = json!(s.n_drafted);
        t["draft_n_accepted"] = json!(s.n_accepted);
    }
    t
}

fn bytes_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// OpenAI chat logprobs of one token (`top` alternatives).
fn chat_logprob(p: &TokenProbs, top: usize) -> Value {
    json!({
        "token": bytes_text(&p.bytes),
        "logprob": p.logprob,
        "bytes": p.bytes,
        "top_logprobs": p.top.iter().take(top).map(|(_, b, lp)| json!({
            "token": bytes_text(b), "logprob": lp, "bytes": b,
        })).collect::<Vec<_>>(),
    })
}

/// OpenAI legacy completion logprobs of a list of tokens.
fn completion_logprobs(probs: &[TokenProbs], top: usize) -> Value {
    json!({
        "tokens": probs.iter().map(|p| bytes_text(&p.bytes)).collect::<Vec<_>>(),
        "token_logprobs": probs.iter().map(|p| p.logprob).collect::<Vec<_>>(),
        "top_logprobs": probs.iter().map(|p| {
            let m: Map<String, Value> = p.top.iter().take(top).map(|(_, b, lp)| (bytes_text(b), json!(lp))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
    })
}

/// llama-server's `completion_probabilities` entry.
fn native_prob(p: &TokenProbs) -> Value {
    json!({
        "id": p.id,
        "token": bytes_text(&p.bytes),
        "logprob": p.logprob,
        "bytes": p.bytes,
        "top_logprobs": p.top.iter().map(|(id, b, lp)| json!({
            "id": id, "token": bytes_text(b), "logprob": lp, "bytes": b,
        })).collect::<Vec<_>>(),
    })
}

/// Whether and how a request asked for logprobs: (wanted, top alternatives).
fn logprobs_asked(body: &Map<String, Value>) -> Result<(bool, usize), ApiError> {
    let f = Fields::new(body);
    Ok(match body.get("logprobs") {
        Some(Value::Number(_)) => (true, f.count("logprobs", 20)?.unwrap_or(0)),
        _ => (f.bool("logprobs")?.unwrap_or(false), f.count("top_logprobs", 20)?.unwrap_or(0)),
    })
}

/// The SSE line of a JSON value.
fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// Streams a generation as SSE chunks made by `chunk` (text, probs) and `last` (the summary),
/// then `[DONE]` when `done_marker`.
fn sse_stream(
    sub: Submitted,
    mut chunk: impl FnMut(&str, Option<&TokenProbs>) -> Option<Value> + Send + 'static,
    mut last: impl FnMut(&Summary) -> Vec<Value> + Send + 'static,
    done_marker: bool,
) -> Response {
    stream_events(sub, "text/event-stream", move |event| match event {
        Event::Token { text, probs } => chunk(&text, probs.as_ref()).map(|v| sse(&v)),
        Event::Done(summary) => {
            let mut out: String = last(&summary).iter().map(sse).collect();
            if done_marker {
                out.push_str("data: [DONE]\n\n");
            }
            Some(out)
        }
        // A `data:` line: the OpenAI client raises on an `error` object there.
        Event::Failed(message) => Some(sse(&ApiError::server(message).body())),
    })
}

/// The fields both OpenAI endpoints read.
struct Common {
    params: super::slots::GenParams,
    want_logprobs: bool,
    /// Alternatives per token in `logprobs`.
    top: usize,
    stream: bool,
    include_usage: bool,
}

fn common(state: &State<'_>, body: &Map<String, Value>) -> Result<Common, ApiError> {
    let params = gen_params(state, body, Dialect::OpenAi)?;
    let (want_logprobs, top) = logprobs_asked(body)?;
    let f = Fields::new(body);
    let include_usage = f
        .object("stream_options")?
        .map(|o| Fields::nested(o, "stream_options.").bool("include_usage"))
        .transpose()?
        .flatten()
        .unwrap_or(false);
    Ok(Common { params, want_logprobs, top, stream: f.bool("stream")?.unwrap_or(false), include_usage })
}

/// A call's id in a reply: the one the model wrote, else the response's and the call's number.
fn call_id(id: &str, i: usize, call: &tools::Call) -> String {
    call.id.clone().unwrap_or_else(|| format!("call_{}_{i}", &id[id.len().saturating_sub(12)..]))
}

/// A chat completion whose request has tools: the reply is parsed for calls once complete, calls
/// as `message.tool_calls` with their arguments as a JSON string and `finish_reason`
/// "tool_calls". Streamed as llama-server streams it ([`tool_stream`]): the text before a call
/// as `delta.content` as it comes, each call as a delta with its index, id, type and name
/// (arguments ""), then one with its arguments.
#[allow(clippy::too_many_arguments)]
async fn tool_reply(
    sub: Submitted,
    t: &tools::Tools,
    reasoning: Option<(Markers, bool)>,
    id: String,
    created: u64,
    model: String,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(tool_stream(sub, t.clone(), reasoning, id, created, model, include_usage));
    }
    let n_prompt = sub.n_prompt;
    let c = collect(sub).await?;
    let (thought, text, calls) = super::prompt::reply_parts(&c.text, reasoning, Some(t));
    let calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            json!({ "index": i, "id": call_id(&id, i, call), "type": "function",
                    "function": { "name": call.name, "arguments": call.arguments.to_string() } })
        })
        .collect();
    let reason = if calls.is_empty() { finish_reason(c.summary.stop) } else { "tool_calls" };
    let content = if text.is_empty() && !calls.is_empty() { Value::Null } else { json!(text) };
    let head = |choices: Value, object: &str| {
        json!({ "id": id, "object": object, "created": created, "model": model,
                "system_fingerprint": format!("pinfer-{}", pinfer::VERSION), "choices": choices })
    };
    let mut message = json!({ "role": "assistant", "content": content });
    if let Some(thought) = &thought {
        message["reasoning_content"] = json!(thought);
    }
    if !calls.is_empty() {
        // (The non-streaming form carries no index.)
        message["tool_calls"] = calls
            .iter()
            .map(|c| {
                let mut c = c.clone();
                c.as_object_mut().map(|o| o.remove("index"));
                c
            })
            .collect();
    }
    let mut v = head(
        json!([{ "index": 0, "message": message, "logprobs": null, "finish_reason": reason }]),
        "chat.completion",
    );
    v["usage"] = usage(n_prompt, c.summary.n_generated);
    v["timings"] = timings(&c.summary);
    Ok(json_response(&v))
}

/// The streamed form of [`tool_reply`].
fn tool_stream(
    sub: Submitted,
    tools: tools::Tools,
    reasoning: Option<(Markers, bool)>,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
) -> Response {
    let head = move |id: &str, delta: Value, finish: Value| {
        json!({ "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": format!("pinfer-{}", pinfer::VERSION),
                "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }] })
    };
    let (end_head, end_id) = (head.clone(), id.clone());
    let mut splitter = reasoning.map(|(m, opened)| Splitter::new(m, opened));
    let mut calls = Some(ToolStream::new(tools));
    let mut first = true;
    let mut n_calls = 0;
    // One event's chunks: its reasoning, then what its text makes known.
    let mut chunks = move |piece: Piece, deltas: Vec<Delta>, out: &mut String| {
        let mut list = Vec::new();
        if !piece.reasoning.is_empty() {
            list.push(json!({ "reasoning_content": piece.reasoning }));
        }
        for d in deltas {
            match d {
                Delta::Content(text) => list.push(json!({ "content": text })),
                Delta::Call { index, call } => {
                    n_calls += 1;
                    list.push(json!({ "tool_calls": [{ "index": index, "id": call_id(&id, index, &call), "type": "function",
                                      "function": { "name": call.name, "arguments": "" } }] }));
                    list.push(json!({ "tool_calls": [{ "index": index,
                                      "function": { "arguments": call.arguments.to_string() } }] }));
                }
            }
        }
        if first && list.is_empty() {
            // (The first chunk carries the role even when the text so far is held back.)
            list.push(json!({ "content": "" }));
        }
        for mut delta in list {
            if first {
                delta["role"] = json!("assistant");
                first = false;
            }
            out.push_str(&sse(&head(&id, delta, Value::Null)));
        }
        n_calls
    };
    stream_events(sub, "text/event-stream", move |event| {
        let mut out = String::new();
        match event {
            Event::Token { text, .. } => {
                let piece = match splitter.as_mut() {
                    Some(s) => s.push(&text),
                    None => Piece { reasoning: String::new(), content: text },
                };
                let deltas = calls.as_mut().map(|c| c.push(&piece.content)).unwrap_or_default();
                chunks(Piece { content: String::new(), ..piece }, deltas, &mut out);
            }
            Event::Done(summary) => {
                let piece = splitter.as_mut().map(Splitter::finish).unwrap_or_default();
                let mut stream = calls.take()?;
                let mut deltas = stream.push(&piece.content);
                deltas.extend(stream.finish().0);
                let sent = chunks(Piece { content: String::new(), ..piece }, deltas, &mut out);
                let reason = if sent > 0 { "tool_calls" } else { finish_reason(summary.stop) };
                let mut end = end_head(&end_id, json!({}), json!(reason));
                end["timings"] = timings(&summary);
                let mut usage_head = end.clone();
                usage_head["choices"] = json!([]);
                usage_head.as_object_mut().map(|o| o.remove("timings"));
                for v in closing(end, usage_head, &summary, include_usage) {
                    out.push_str(&sse(&v));
                }
                out.push_str("data: [DONE]\n\n");
            }
            Event::Failed(message) => out.push_str(&sse(&ApiError::server(message).body())),
        }
        (!out.is_empty()).then_some(out)
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let Common { mut params, want_logprobs, top, stream, include_usage } = common(&state, &body)?;
    let (prompt, tools) = chat_prompt(&state, &body, &mut params)?;
    let reasoning = super::prompt::reasoning(&state, &body, &prompt)?;
    let tokens = encode(&state, &prompt, true);
    let model = shared.model_name.clone();
    let sub = submit(&shared, tokens, params)?;
    let (id, created) = (response_id("chatcmpl"), unix_now());
    if let Some(t) = tools {
        return tool_reply(sub, &t, reasoning, id, created, model, stream, include_usage).await;
    }
    if !stream {
        let n_prompt = sub.n_prompt;
        let c = collect(sub).await?;
        let logprobs = want_logprobs
            .then(|| json!({ "content": c.probs.iter().map(|p| chat_logprob(p, top)).collect::<Vec<_>>() }));
        let mut message = json!({ "role": "assistant", "content": c.text });
        if let Some((m, opened)) = reasoning {
            let (thought, answer) = split(m, opened, &c.text);
            message["content"] = json!(answer);
            if let Some(thought) = thought {
                message["reasoning_content"] = json!(thought);
            }
        }
        return Ok(json_response(&json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": format!("pinfer-{}", pinfer::VERSION),
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(c.summary.stop),
            }],
            "usage": usage(n_prompt, c.summary.n_generated),
            "timings": timings(&c.summary),
        })));
    }
    let head = move |id: &str, model: &str, choices: Value| {
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": format!("pinfer-{}", pinfer::VERSION),
            "choices": choices,
        })
    };
    let (id2, model2) = (id.clone(), model.clone());
    let mut first = true;
    // The reasoning goes out as `delta.reasoning_content` (llama-server's streamed form); what the
    // splitter still holds at the end goes out before the finish.
    let splitter = Arc::new(Mutex::new(reasoning.map(|(m, opened)| Splitter::new(m, opened))));
    let (splitter2, id3, model3) = (splitter.clone(), id.clone(), model.clone());
    let delta_of = |piece: Piece, delta: &mut Map<String, Value>| {
        if !piece.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), json!(piece.reasoning));
        }
        if !piece.content.is_empty() || !delta.contains_key("reasoning_content") {
            delta.insert("content".into(), json!(piece.content));
        }
    };
    let chunk = move |text: &str, probs: Option<&TokenProbs>| {
        let mut delta = Map::new();
        let piece = match splitter.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(s) => s.push(text),
            None => Piece { reasoning: String::new(), content: text.to_string() },
        };
        let empty = piece.reasoning.is_empty() && piece.content.is_empty();
        if first {
            delta.insert("role".into(), json!("assistant"));
            first = false;
        } else if empty && probs.is_none() {
            return None;
        }
        delta_of(piece, &mut delta);
        let logprobs = match (want_logprobs, probs) {
            (true, Some(p)) => json!({ "content": [chat_logprob(p, top)] }),
            _ => Value::Null,
        };
        Some(head(
            &id2,
            &model2,
            json!([{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null }]),
        ))
    };
    let last = move |s: &Summary| {
        let rest = splitter2.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map(Splitter::finish);
        let mut out = Vec::new();
        if let Some(piece) = rest.filter(|p| !p.reasoning.is_empty() || !p.content.is_empty()) {
            let mut delta = Map::new();
            delta_of(piece, &mut delta);
            out.push(head(
                &id3,
                &model3,
                json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": null }]),
            ));
        }
        let mut end = head(
            &id,
            &model,
            json!([{ "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(s.stop) }]),
        );
        end["timings"] = timings(s);
        out.extend(closing(end, head(&id, &model, json!([])), s, include_usage));
        out
    };
    Ok(sse_stream(sub, chunk, last, true))
}

/// `POST /v1/completions`.
pub async fn completions(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let Common { params, want_logprobs, top, stream, include_usage } = common(&state, &body)?;
    let tokens = prompt_tokens(&state, &body)?;
    let model = shared.model_name.clone();
    let sub = submit(&shared, tokens, params)?;
    let (id, created) = (response_id("cmpl"), unix_now());
    if !stream {
        let n_prompt = sub.n_prompt;
        let c = collect(sub).await?;
        return Ok(json_response(&json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{
                "text": c.text,
                "index": 0,
                "logprobs": if want_logprobs { completion_logprobs(&c.probs, top) } else { Value::Null },
                "finish_reason": finish_reason(c.summary.stop),
            }],
            "usage": usage(n_prompt, c.summary.n_generated),
            "timings": timings(&c.summary),
        })));
    }
    let head = move |id: &str, model: &str, choices: Value| json!({ "id": id, "object": "text_completion", "created": created, "model": model, "choices": choices });
    let (id2, model2) = (id.clone(), model.clone());
    let chunk = move |text: &str, probs: Option<&TokenProbs>| {
        if text.is_empty() && probs.is_none() {
            return None;
        }
        let logprobs = match (want_logprobs, probs) {
            (true, Some(p)) => completion_logprobs(std::slice::from_ref(p), top),
            _ => Value::Null,
        };
        Some(head(
            &id2,
            &model2,
            json!([{ "text": text, "index": 0, "logprobs": logprobs, "finish_reason": null }]),
        ))
    };
    let last = move |s: &Summary| {
        let end = head(
            &id,
            &model,
            json!([{ "text": "", "index": 0, "logprobs": null, "finish_reason": finish_reason(s.stop) }]),
        );
        closing(end, head(&id, &model, json!([])), s, include_usage)
    };
    Ok(sse_stream(sub, chunk, last, true))
}

/// llama-server's `stop_type`.
fn stop_type(stop: Stop) -> &'static str {
    match stop {
        Stop::EndOfGeneration => "eos",
        Stop::Limit | Stop::ContextFull => "limit",
        Stop::StopString => "word",
        Stop::Cancelled | Stop::GrammarDeadEnd => "none",
    }
}

/// `POST /completion` (llama-server's native endpoint).
pub async fn native_completion(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let params = gen_params(&state, &body, Dialect::Llama)?;
    let stream = Fields::new(&body).bool("stream")?.unwrap_or(false);
    let tokens = prompt_tokens(&state, &body)?;
    let model = shared.model_name.clone();
    let want_probs = params.n_probs > 0;
    let sub = submit(&shared, tokens, params)?;
    let end = move |s: &Summary, content: &str, probs: &[TokenProbs]| {
        let mut v = json!({
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": s.slot,
            "stop": true,
            "model": model,
            "tokens_predicted": s.n_generated,
            "tokens_evaluated": s.n_prompt,
            "tokens_cached": s.n_cached,
            "truncated": false,
            "stop_type": stop_type(s.stop),
            "stopping_word": s.stop_word.clone().unwrap_or_default(),
            "timings": timings(s),
        });
        if want_probs {
            v["completion_probabilities"] = Value::Array(probs.iter().map(native_prob).collect());
        }
        v
    };
    if !stream {
        let c = collect(sub).await?;
        return Ok(json_response(&end(&c.summary, &c.text, &c.probs)));
    }
    let chunk = move |text: &str, probs: Option<&TokenProbs>| {
        if text.is_empty() && probs.is_none() {
            return None;
        }
        let mut v = json!({ "index": 0, "content": text, "tokens": [], "stop": false });
        if let Some(p) = probs {
            v["completion_probabilities"] = json!([native_prob(p)]);
        }
        Some(v)
    };
    let last = move |s: &Summary| vec![end(s, "", &[])];
    Ok(sse_stream(sub, chunk, last, false))
}
