//! Anthropic's Messages API on the same port (`POST /v1/messages`, `/v1/messages/count_tokens`),
//! as llama-server serves it, for Claude-style agents and the `anthropic` SDK.
//!
//! A request is translated into the chat request the OpenAI route takes (`system`, content
//! blocks, `tool_use` / `tool_result`, `thinking`, `tools` with `input_schema`, `tool_choice`,
//! `stop_sequences`, `max_tokens`) and goes through the same template, tool and reasoning code;
//! the reply comes back as content blocks (`thinking`, `text`, `tool_use`) with `stop_reason`,
//! streamed as `message_start` ... `message_stop` events.

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::Response;
use serde_json::{json, Map, Value};

use super::api::{gen_params, json_response, read_json, ApiError, Dialect, Fields};
use super::jobs::{collect, stream_events, submit};
use super::openai::response_id;
use super::prompt::{chat_prompt, chat_tools, reasoning, reply_parts};
use super::slots::{Event, Summary};
use super::tokens::encode;
use super::tool_stream::{Delta, ToolStream};
use super::AppState;
use pinfer::generate::Stop;
use pinfer::reasoning::Splitter;

/// `POST /v1/messages`.
pub async fn messages(AxState(shared): AxState<AppState>, body: Body) -> Response {
    messages_inner(shared, body).await.unwrap_or_else(ApiError::anthropic)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, `{"input_tokens": N}`.
pub async fn count_tokens(AxState(shared): AxState<AppState>, body: Body) -> Response {
    async {
        let state = shared.state()?;
        let body = read_json(&state, body).await?;
        let chat = to_chat(&body)?;
        let mut params = gen_params(&state, &chat, Dialect::OpenAi)?;
        let (prompt, _) = chat_prompt(&state, &chat, &mut params)?;
        Ok(json_response(&json!({ "input_tokens": encode(&state, &prompt, true).len() })))
    }
    .await
    .unwrap_or_else(ApiError::anthropic)
}

async fn messages_inner(shared: AppState, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    if Fields::new(&body).i64("max_tokens")?.is_none() {
        return Err(ApiError::invalid("'max_tokens' is required"));
    }
    let chat = to_chat(&body)?;
    let mut params = gen_params(&state, &chat, Dialect::OpenAi)?;
    let stream = Fields::new(&body).bool("stream")?.unwrap_or(false);
    let (prompt, tools) = chat_prompt(&state, &chat, &mut params)?;
    let reasoning = reasoning(&state, &chat, &prompt)?;
    let sub = submit(&shared, encode(&state, &prompt, true), params)?;
    let n_prompt = sub.n_prompt;
    let id = response_id("msg").replace('-', "_");
    let model = shared.model_name.clone();
    let head = move |content: Value| {
        json!({ "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": n_prompt, "output_tokens": 0 } })
    };
    if !stream {
        let c = collect(sub).await?;
        let (thought, text, calls) = reply_parts(&c.text, reasoning, tools.as_ref());
        let mut blocks = Vec::new();
        if let Some(thought) = thought {
            blocks.push(json!({ "type": "thinking", "thinking": thought, "signature": "" }));
        }
        if !text.is_empty() || calls.is_empty() {
            blocks.push(json!({ "type": "text", "text": text }));
        }
        for (i, call) in calls.iter().enumerate() {
            blocks.push(json!({ "type": "tool_use", "id": call.id.clone().unwrap_or_else(|| format!("toolu_{i}_{}", response_id("call").replace('-', "_"))),
                                "name": call.name, "input": call.arguments }));
        }
        let (reason, word) = stop_reason(&c.summary, !calls.is_empty());
        let mut v = head(Value::Array(blocks));
        v["stop_reason"] = json!(reason);
        v["stop_sequence"] = json!(word);
        v["usage"]["output_tokens"] = json!(c.summary.n_generated);
        return Ok(json_response(&v));
    }
    // Streamed text (and reasoning): a thinking block while the model reasons, then a text block;
    // with tools, the text up to a call and each call as a tool_use block once known (its input
    // as one input_json_delta), as serve/tool_stream.rs finds them.
    let mut splitter = reasoning.map(|(m, opened)| Splitter::new(m, opened));
    let mut calls = tools.map(ToolStream::new);
    let mut blocks = Blocks::default();
    let mut started = false;
    let mut called = false;
    let mut answer = move |out: &mut String, blocks: &mut Blocks, deltas: Vec<Delta>| {
        for d in deltas {
            match d {
                Delta::Content(text) => blocks.write(out, "text", &text),
                Delta::Call { call, .. } => {
                    blocks.close(out);
                    let index = blocks.next;
                    blocks.next += 1;
                    let id = call.id.clone().unwrap_or_else(|| {
                        format!("toolu_{index}_{}", response_id("call").replace('-', "_"))
                    });
                    let block =
                        json!({ "type": "tool_use", "id": id, "name": call.name, "input": call.arguments });
                    out.push_str(&whole_block(index, &block).concat());
                    called = true;
                }
            }
        }
        called
    };
    Ok(stream_events(sub, "text/event-stream", move |ev| {
        let mut out = String::new();
        if !started {
            out.push_str(&event(
                "message_start",
                json!({ "type": "message_start", "message": head(json!([])) }),
            ));
            started = true;
        }
        match ev {
            Event::Token { text, .. } => {
                let piece = match splitter.as_mut() {
                    Some(s) => s.push(&text),
                    None => pinfer::reasoning::Piece { reasoning: String::new(), content: text },
                };
                blocks.write(&mut out, "thinking", &piece.reasoning);
                match calls.as_mut() {
                    Some(c) => _ = answer(&mut out, &mut blocks, c.push(&piece.content)),
                    None => blocks.write(&mut out, "text", &piece.content),
                }
            }
            Event::Done(summary) => {
                let piece = splitter.as_mut().map(Splitter::finish).unwrap_or_default();
                blocks.write(&mut out, "thinking", &piece.reasoning);
                let deltas = match calls.take() {
                    Some(mut c) => {
                        let mut deltas = c.push(&piece.content);
                        deltas.extend(c.finish().0);
                        deltas
                    }
                    None => vec![Delta::Content(piece.content)],
                };
                let called = answer(&mut out, &mut blocks, deltas);
                if blocks.open.is_none() && blocks.next == 0 {
                    blocks.write(&mut out, "text", "");
                    blocks.open = Some(("text", 0));
                }
                blocks.close(&mut out);
                let (reason, word) = stop_reason(&summary, called);
                out.push_str(&message_end(reason, word, summary.n_generated));
            }
            Event::Failed(message) => {
                out.push_str(&event(
                    "error",
                    json!({ "type": "error", "error": { "type": "api_error", "message": message } }),
                ));
            }
        }
        (!out.is_empty()).then_some(out)
    }))
}

/// The content blocks of a streamed reply: which one is open, and the next index.
#[derive(Default)]
struct Blocks {
    open: Option<(&'static str, usize)>,
    next: usize,
}

impl Blocks {
    /// Writes `text` into a block of `kind`, opening it (and closing another) first.
    fn write(&mut self, out: &mut String, kind: &'static str, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.open.map(|(k, _)| k) != Some(kind) {
            self.close(out);
            let index = self.next;
            self.next += 1;
            let block = if kind == "thinking" {
                json!({ "type": "thinking", "thinking": "", "signature": "" })
            } else {
                json!({ "type": "text", "text": "" })
            };
            out.push_str(&event(
                "content_block_start",
                json!({ "type": "content_block_start", "index": index, "content_block": block }),
            ));
            self.open = Some((kind, index));
        }
        let index = self.open.map_or(0, |(_, i)| i);
        let delta = if kind == "thinking" {
            json!({ "type": "thinking_delta", "thinking": text })
        } else {
            json!({ "type": "text_delta", "text": text })
        };
        out.push_str(&event(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": index, "delta": delta }),
        ));
    }

    fn close(&mut self, out: &mut String) {
        if let Some((_, index)) = self.open.take() {
            out.push_str(&event(
                "content_block_stop",
                json!({ "type": "content_block_stop", "index": index }),
            ));
        }
    }
}

/// One server-sent event.
fn event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// A finished block sent as its start, one delta and its stop.
fn whole_block(index: usize, block: &Value) -> Vec<String> {
    let (start, delta) = match block["type"].as_str() {
        Some("thinking") => (
            json!({ "type": "thinking", "thinking": "", "signature": "" }),
            json!({ "type": "thinking_delta", "thinking": block["thinking"] }),
        ),
        Some("tool_use") => (
            json!({ "type": "tool_use", "id": block["id"], "name": block["name"], "input": {} }),
            json!({ "type": "input_json_delta", "partial_json": block["input"].to_string() }),
        ),
        _ => (json!({ "type": "text", "text": "" }), json!({ "type": "text_delta", "text": block["text"] })),
    };
    vec![
        event(
            "content_block_start",
            json!({ "type": "content_block_start", "index": index, "content_block": start }),
        ),
        event(
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": index, "delta": delta }),
        ),
        event("content_block_stop", json!({ "type": "content_block_stop", "index": index })),
    ]
}

fn message_end(reason: &str, word: Option<String>, output_tokens: usize) -> String {
    event(
        "message_delta",
        json!({ "type": "message_delta", "delta": { "stop_reason": reason, "stop_sequence": word },
                "usage": { "output_tokens": output_tokens } }),
    ) + &event("message_stop", json!({ "type": "message_stop" }))
}

/// Anthropic's `stop_reason` (and the stop sequence that ended the reply).
fn stop_reason(s: &Summary, called: bool) -> (&'static str, Option<String>) {
    if called {
        return ("tool_use", None);
    }
    match s.stop {
        Stop::StopString => ("stop_sequence", s.stop_word.clone()),
        Stop::Limit | Stop::ContextFull => ("max_tokens", None),
        Stop::EndOfGeneration | Stop::Cancelled | Stop::GrammarDeadEnd => ("end_turn", None),
    }
}

/// The Messages request as the OpenAI chat request the shared code reads.
fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let f = Fields::new(body);
    let mut messages = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({ "role": "system", "content": s })),
        Some(Value::Array(blocks)) => {
            messages.push(json!({ "role": "system", "content": text_of_blocks(blocks, "system")? }))
        }
        Some(_) => return Err(ApiError::invalid("'system' must be a string or a list of text blocks")),
    }
    let list = f.array("messages")?.ok_or_else(|| ApiError::invalid("'messages' is required"))?;
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content");
        match (role, content) {
            (Some(role @ ("user" | "assistant")), Some(Value::String(s))) => {
                messages.push(json!({ "role": role, "content": s }));
            }
            (Some("user"), Some(Value::Array(blocks))) => {
                let mut text = String::new();
                for (j, b) in blocks.iter().enumerate() {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                        Some("tool_result") => {
                            let content = match b.get("content") {
                                Some(Value::String(s)) => s.clone(),
                                Some(Value::Array(inner)) => text_of_blocks(inner, "tool_result")?,
                                None | Some(Value::Null) => String::new(),
                                Some(_) => return Err(ApiError::invalid(format!("'messages[{i}].content[{j}].content' must be text"))),
                            };
                            let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                            messages.push(json!({ "role": "tool", "tool_call_id": id, "content": content }));
                        }
                        other => {
                            return Err(ApiError::invalid(format!(
                                "'messages[{i}].content[{j}]': block type {other:?} is not supported (text, tool_result)"
                            )))
                        }
                    }
                }
                if !text.is_empty() {
                    messages.push(json!({ "role": "user", "content": text }));
                }
            }
            (Some("assistant"), Some(Value::Array(blocks))) => {
                let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
                for (j, b) in blocks.iter().enumerate() {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                        Some("thinking") => {
                            thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
                        }
                        Some("redacted_thinking") => {}
                        Some("tool_use") => calls.push(json!({ "id": b.get("id").cloned().unwrap_or(Value::Null),
                            "type": "function", "function": { "name": b.get("name").cloned().unwrap_or(Value::Null),
                            "arguments": b.get("input").cloned().unwrap_or(json!({})) } })),
                        other => {
                            return Err(ApiError::invalid(format!(
                                "'messages[{i}].content[{j}]': block type {other:?} is not supported (text, thinking, tool_use)"
                            )))
                        }
                    }
                }
                let mut m = json!({ "role": "assistant", "content": text });
                if !thinking.is_empty() {
                    m["reasoning_content"] = json!(thinking);
                }
                if !calls.is_empty() {
                    m["tool_calls"] = Value::Array(calls);
                }
                messages.push(m);
            }
            (Some(other), _) if other != "user" && other != "assistant" => {
                return Err(ApiError::invalid(format!(
                    "'messages[{i}].role' {other:?} is not user or assistant"
                )))
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "'messages[{i}]' needs a role and a string or block list content"
                )))
            }
        }
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    // (Required by `/v1/messages`, which checks it; `count_tokens` has none.)
    if let Some(max_tokens) = f.i64("max_tokens")? {
        chat.insert("max_tokens".into(), json!(max_tokens));
    }
    for key in ["temperature", "top_p", "top_k"] {
        if let Some(v) = body.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(stops) = body.get("stop_sequences") {
        chat.insert("stop".into(), stops.clone());
    }
    if let Some(list) = f.array("tools")? {
        chat.insert("tools".into(), chat_tools(list, "input_schema"));
    }
    if let Some(choice) = f.object("tool_choice")? {
        let c = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                json!({ "type": "function", "function": { "name": choice.get("name").cloned().unwrap_or(Value::Null) } })
            }
            _ => return Err(ApiError::invalid("'tool_choice.type' must be auto, any, tool or none")),
        };
        chat.insert("tool_choice".into(), c);
        if choice.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    if let Some(thinking) = f.object("thinking")? {
        let on = match thinking.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => true,
            Some("disabled") => false,
            _ => return Err(ApiError::invalid("'thinking.type' must be enabled or disabled")),
        };
        chat.insert("chat_template_kwargs".into(), json!({ "enable_thinking": on }));
    }
    Ok(chat)
}

/// The text of a list of text blocks.
fn text_of_blocks(blocks: &[Value], what: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for b in blocks {
        match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => text.push_str(t),
            _ => return Err(ApiError::invalid(format!("'{what}': only text blocks are supported"))),
        }
    }
    Ok(text)
}
