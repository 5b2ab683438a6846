//! A chat request's prompt: its messages checked, tool results and calls in the model's tool
//! format, its tools added, rendered with the model's chat template.

use pinfer::chat::{Message, Role};
use serde_json::{Map, Value};

use super::api::{ApiError, Fields};
use super::slots::GenParams;
use super::tools::{self, ToolFormat};
use super::State;

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
