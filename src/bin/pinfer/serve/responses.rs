//! OpenAI's Responses API (`POST /v1/responses`), as llama-server serves it, for the current OpenAI
//! SDKs and coding agents.
//!
//! A request is translated into the chat request the chat route takes (`instructions`, `input` as
//! a string or items: messages, `function_call` and `function_call_output`; `tools`,
//! `tool_choice`, `max_output_tokens`) and goes through the same template, tool and reasoning code;
//! the reply comes back as output items (`reasoning`, `message` with `output_text`,
//! `function_call`). `previous_response_id` continues a conversation the server answered in its
//! lifetime (the last [`KEPT`] responses are kept). Streaming sends `response.*` events: the text
//! as it is generated, or the whole reply's items at its end when it may hold calls or reasoning;
//! the last is `response.completed` also for a reply cut by `max_output_tokens` (its `status` then
//! says `incomplete`), which the OpenAI SDK's stream helpers wait for.

use std::collections::VecDeque;
use std::sync::Mutex;

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::Response;
use serde_json::{json, Map, Value};

use super::api::{gen_params, json_response, read_json, unix_now, ApiError, Dialect, Fields};
use super::jobs::{collect, stream_events, stream_of, submit};
use super::openai::response_id;
use super::prompt::{chat_prompt, chat_tools, reasoning, reply_parts};
use super::slots::{Event, Summary};
use super::tokens::encode;
use super::tools;
use super::AppState;
use pinfer::generate::Stop;

/// How many answered conversations `previous_response_id` can continue.
pub const KEPT: usize = 256;

/// The conversations of the last [`KEPT`] responses (chat messages, the reply included), by id.
#[derive(Default)]
pub struct Kept(Mutex<VecDeque<(String, Vec<Value>)>>);

impl Kept {
    fn get(&self, id: &str) -> Option<Vec<Value>> {
        let list = self.0.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().find(|(k, _)| k == id).map(|(_, v)| v.clone())
    }

    fn put(&self, id: String, conversation: Vec<Value>) {
        let mut list = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if list.len() == KEPT {
            list.pop_front();
        }
        list.push_back((id, conversation));
    }
}

/// `POST /v1/responses`.
pub async fn create(AxState(shared): AxState<AppState>, body: Body) -> Result<Response, ApiError> {
    let state = shared.state()?;
    let body = read_json(&state, body).await?;
    let f = Fields::new(&body);
    let earlier = match f.str("previous_response_id")? {
        None => Vec::new(),
        Some(id) => shared.responses.get(id).ok_or_else(|| {
            ApiError::invalid(format!("'previous_response_id' {id:?}: no such response on this server"))
        })?,
    };
    let chat = to_chat(&body, earlier)?;
    let mut params = gen_params(&state, &chat, Dialect::OpenAi)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let (prompt, tools) = chat_prompt(&state, &chat, &mut params)?;
    let reasoning = reasoning(&state, &chat, &prompt)?;
    let sub = submit(&shared, encode(&state, &prompt, true), params)?;
    let n_prompt = sub.n_prompt;
    let id = response_id("resp").replace('-', "_");
    let model = shared.model_name.clone();
    let created = unix_now();
    let conversation = chat["messages"].as_array().cloned().unwrap_or_default();
    let base = {
        let (id, model) = (id.clone(), model.clone());
        move |status: &str, output: Vec<Value>, usage: Value| {
            json!({ "id": id, "object": "response", "created_at": created, "status": status, "model": model,
                    "output": output, "error": null, "incomplete_details": null, "instructions": null,
                    "metadata": {}, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
                    "temperature": null, "top_p": null, "usage": usage })
        }
    };
    let usage = move |s: &Summary| {
        json!({ "input_tokens": n_prompt, "input_tokens_details": { "cached_tokens": s.n_cached },
                "output_tokens": s.n_generated, "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": n_prompt + s.n_generated })
    };
    let finish = move |v: &mut Value, s: &Summary| {
        if matches!(s.stop, Stop::Limit | Stop::ContextFull) {
            v["status"] = json!("incomplete");
            v["incomplete_details"] = json!({ "reason": "max_output_tokens" });
        }
    };
    if tools.is_some() || reasoning.is_some() || !stream {
        let c = collect(sub).await?;
        let (thought, text, calls) = reply_parts(&c.text, reasoning, tools.as_ref());
        let output = output_items(thought.as_deref(), &text, &calls);
        shared.responses.put(id.clone(), with_reply(conversation, thought.as_deref(), &text, &calls));
        let mut done = base("completed", output.clone(), usage(&c.summary));
        finish(&mut done, &c.summary);
        if !stream {
            return Ok(json_response(&done));
        }
        let mut seq = Sequence::default();
        let mut events = vec![
            seq.event("response.created", json!({ "response": base("in_progress", vec![], Value::Null) })),
            seq.event(
                "response.in_progress",
                json!({ "response": base("in_progress", vec![], Value::Null) }),
            ),
        ];
        for (index, item) in output.iter().enumerate() {
            events.extend(seq.whole_item(index, item));
        }
        events.push(seq.event("response.completed", json!({ "response": done })));
        return Ok(stream_of("text/event-stream", events));
    }
    // The text as it comes: one message item with one output_text part.
    let item_id = format!("msg_{id}");
    let mut seq = Sequence::default();
    let mut text = String::new();
    let mut opened = false;
    let shared2 = shared.clone();
    Ok(stream_events(sub, "text/event-stream", move |ev| {
        let mut out = String::new();
        if !opened {
            out += &seq
                .event("response.created", json!({ "response": base("in_progress", vec![], Value::Null) }));
            out += &seq.event(
                "response.in_progress",
                json!({ "response": base("in_progress", vec![], Value::Null) }),
            );
            let item = json!({ "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": [] });
            out += &seq.event("response.output_item.added", json!({ "output_index": 0, "item": item }));
            out += &seq.event(
                "response.content_part.added",
                json!({ "item_id": item_id, "output_index": 0, "content_index": 0,
                        "part": { "type": "output_text", "text": "", "annotations": [] } }),
            );
            opened = true;
        }
        match ev {
            Event::Token { text: piece, .. } => {
                if !piece.is_empty() {
                    out += &seq.event(
                        "response.output_text.delta",
                        json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": [] }),
                    );
                    text.push_str(&piece);
                }
            }
            Event::Done(summary) => {
                let part = json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] });
                out += &seq.event(
                    "response.output_text.done",
                    json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": [] }),
                );
                out += &seq.event(
                    "response.content_part.done",
                    json!({ "item_id": item_id, "output_index": 0, "content_index": 0, "part": part }),
                );
                let item = json!({ "type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": [part] });
                out += &seq.event("response.output_item.done", json!({ "output_index": 0, "item": item }));
                shared2.responses.put(id.clone(), with_reply(conversation.clone(), None, &text, &[]));
                let mut done = base("completed", vec![item], usage(&summary));
                finish(&mut done, &summary);
                out += &seq.event("response.completed", json!({ "response": done }));
            }
            Event::Failed(message) => {
                out +=
                    &seq.event("error", json!({ "code": "server_error", "message": message, "param": null }));
            }
        }
        Some(out)
    }))
}

/// Events numbered in order (`sequence_number`).
#[derive(Default)]
struct Sequence(u64);

impl Sequence {
    fn event(&mut self, kind: &str, mut data: Value) -> String {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.0);
        self.0 += 1;
        format!("event: {kind}\ndata: {data}\n\n")
    }

    /// A finished output item as its events: added, its content, done.
    fn whole_item(&mut self, index: usize, item: &Value) -> Vec<String> {
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        let mut out = Vec::new();
        match item["type"].as_str() {
            Some("message") => {
                added["content"] = json!([]);
                out.push(
                    self.event("response.output_item.added", json!({ "output_index": index, "item": added })),
                );
                let part = &item["content"][0];
                let id = &item["id"];
                let blank = json!({ "type": "output_text", "text": "", "annotations": [] });
                out.push(self.event(
                    "response.content_part.added",
                    json!({ "item_id": id, "output_index": index, "content_index": 0, "part": blank }),
                ));
                out.push(self.event("response.output_text.delta", json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": part["text"], "logprobs": [] })));
                out.push(self.event("response.output_text.done", json!({ "item_id": id, "output_index": index, "content_index": 0, "text": part["text"], "logprobs": [] })));
                out.push(self.event(
                    "response.content_part.done",
                    json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
                ));
            }
            Some("function_call") => {
                added["arguments"] = json!("");
                out.push(
                    self.event("response.output_item.added", json!({ "output_index": index, "item": added })),
                );
                let id = &item["id"];
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({ "item_id": id, "output_index": index, "delta": item["arguments"] }),
                ));
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({ "item_id": id, "output_index": index, "arguments": item["arguments"] }),
                ));
            }
            _ => out.push(
                self.event("response.output_item.added", json!({ "output_index": index, "item": added })),
            ),
        }
        out.push(self.event("response.output_item.done", json!({ "output_index": index, "item": item })));
        out
    }
}

/// The reply as output items: its reasoning, its text, its calls.
fn output_items(thought: Option<&str>, text: &str, calls: &[tools::Call]) -> Vec<Value> {
    let mut items = Vec::new();
    let n = response_id("item").replace('-', "_");
    if let Some(thought) = thought {
        items.push(
            json!({ "type": "reasoning", "id": format!("rs_{n}"), "status": "completed", "summary": [],
                           "content": [{ "type": "reasoning_text", "text": thought }] }),
        );
    }
    if !text.is_empty() || calls.is_empty() {
        items.push(json!({ "type": "message", "id": format!("msg_{n}"), "status": "completed", "role": "assistant",
                           "content": [{ "type": "output_text", "text": text, "annotations": [], "logprobs": [] }] }));
    }
    for (i, c) in calls.iter().enumerate() {
        items.push(
            json!({ "type": "function_call", "id": format!("fc_{i}_{n}"), "call_id": c.id.clone().unwrap_or_else(|| format!("call_{i}_{n}")),
                           "name": c.name, "arguments": c.arguments.to_string(), "status": "completed" }),
        );
    }
    items
}

/// The conversation with the reply appended as the chat route reads it (kept for
/// `previous_response_id`); the calls keep the ids the output items gave them.
fn with_reply(
    mut conversation: Vec<Value>,
    thought: Option<&str>,
    text: &str,
    calls: &[tools::Call],
) -> Vec<Value> {
    let mut m = json!({ "role": "assistant", "content": text });
    if let Some(t) = thought {
        m["reasoning_content"] = json!(t);
    }
    if !calls.is_empty() {
        m["tool_calls"] = calls
            .iter()
            .map(|c| json!({ "type": "function", "function": { "name": c.name, "arguments": c.arguments } }))
            .collect();
    }
    conversation.push(m);
    conversation
}

/// The Responses request as the chat request the shared code reads.
fn to_chat(body: &Map<String, Value>, earlier: Vec<Value>) -> Result<Map<String, Value>, ApiError> {
    let f = Fields::new(body);
    let mut messages = earlier;
    if let Some(instructions) = f.str("instructions")? {
        // (Instructions hold for this response only: they replace an earlier system message.)
        messages.retain(|m| m["role"] != "system");
        messages.insert(0, json!({ "role": "system", "content": instructions }));
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({ "role": "user", "content": s })),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                match kind {
                    "message" => {
                        let role = match item.get("role").and_then(Value::as_str) {
                            Some(r @ ("user" | "assistant" | "system")) => r,
                            Some("developer") => "system",
                            other => return Err(ApiError::invalid(format!("'input[{i}].role' {other:?} is not user, assistant, system or developer"))),
                        };
                        let content = match item.get("content") {
                            Some(Value::String(s)) => s.clone(),
                            Some(Value::Array(parts)) => {
                                let mut text = String::new();
                                for (j, p) in parts.iter().enumerate() {
                                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                                        (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                                        _ => return Err(ApiError::invalid(format!("'input[{i}].content[{j}]': only text parts are supported"))),
                                    }
                                }
                                text
                            }
                            _ => return Err(ApiError::invalid(format!("'input[{i}].content' must be a string or a list of parts"))),
                        };
                        messages.push(json!({ "role": role, "content": content }));
                    }
                    "function_call" => {
                        let call = json!({ "id": item.get("call_id").cloned().unwrap_or(Value::Null), "type": "function",
                            "function": { "name": item.get("name").cloned().unwrap_or(Value::Null),
                                          "arguments": item.get("arguments").cloned().unwrap_or(json!("{}")) } });
                        // Consecutive calls are one assistant turn.
                        match messages.last_mut() {
                            Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                                if let Some(list) = m["tool_calls"].as_array_mut() {
                                    list.push(call);
                                }
                            }
                            _ => messages.push(json!({ "role": "assistant", "content": "", "tool_calls": [call] })),
                        }
                    }
                    "function_call_output" => {
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        };
                        messages.push(json!({ "role": "tool", "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null), "content": output }));
                    }
                    // Earlier reasoning items: the templates that keep reasoning read it from the
                    // assistant messages, which these requests do not carry; it is left out.
                    "reasoning" => {}
                    other => return Err(ApiError::invalid(format!("'input[{i}].type' {other:?} is not supported (message, function_call, function_call_output, reasoning)"))),
                }
            }
        }
        _ => return Err(ApiError::invalid("'input' must be a string or a list of items")),
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(n) = f.i64("max_output_tokens")? {
        chat.insert("max_tokens".into(), json!(n));
    }
    for key in ["temperature", "top_p", "stop", "seed", "tool_choice", "parallel_tool_calls"] {
        if let Some(v) = body.get(key) {
            let v = match (key, v) {
                // Responses names a function choice without the `function` wrapper.
                ("tool_choice", Value::Object(o))
                    if o.get("type").and_then(Value::as_str) == Some("function") =>
                {
                    json!({ "type": "function", "function": { "name": o.get("name").cloned().unwrap_or(Value::Null) } })
                }
                _ => v.clone(),
            };
            chat.insert(key.into(), v);
        }
    }
    if let Some(list) = f.array("tools")? {
        chat.insert("tools".into(), chat_tools(list, "parameters"));
    }
    Ok(chat)
}
