//! A chat request's prompt: its messages checked, tool results and calls in the model's tool
//! format, its tools added, rendered with the model's chat template.

use pinfer::chat::Role;
use pinfer::reasoning::Markers;
use serde_json::{json, Map, Value};

use super::api::{ApiError, Fields};
use super::slots::GenParams;
use super::tools::{self, ToolFormat};
use super::State;

/// The chat messages of a request (`messages`: role and content, the content a string or a list
/// of text parts), checked.
pub fn messages(
    body: &Map<String, Value>,
    format: ToolFormat,
    images: &mut Images,
) -> Result<Vec<(Role, String)>, ApiError> {
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
        let content = message_images(m, i, images)? + &content_text(m.get("content"), i, images)?;
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
///
/// A Jinja template of a tool family pinfer parses (Hermes/Qwen `<tool_call>`, Llama 3) is given
/// the tools, the calls and the results themselves and writes them in its own words; otherwise
/// they are written into the messages as text (the built-in formats, other templates).
pub fn chat_prompt(
    state: &State<'_>,
    body: &Map<String, Value>,
    params: &mut GenParams,
) -> Result<(String, Option<tools::Tools>), ApiError> {
    let format = ToolFormat::for_prompt(&state.ready.format);
    let native = state.ready.format.jinja_source().is_some() && format != ToolFormat::Generic;
    let tools = tools::parse_request(body, format)?;
    if let Some(t) = &tools {
        if let Some(g) = tools::grammar(t) {
            if params.grammar.is_some() {
                return Err(ApiError::invalid(
                    "give one constraint: a required tool call, or 'response_format'/'format' ('grammar', 'json_schema'), not both",
                ));
            }
            params.grammar = Some(g);
        }
    }
    let kwargs = template_kwargs(state, body)?;
    let mut images = Images { media_path: state.opts.media_path.clone(), ..Default::default() };
    let prompt = if native {
        let messages = template_messages(body, &mut images)?;
        // `tool_choice: "none"` sends no tools (parse_request gave none).
        let listed = tools.as_ref().map(|_| body.get("tools").cloned().unwrap_or(Value::Null));
        render(state, &messages, listed.as_ref(), true, &kwargs)?
    } else {
        let mut turns = messages(body, format, &mut images)?;
        if let Some(t) = &tools {
            tools::add_to_messages(t, &mut turns);
        }
        render(state, &turns_json(&turns), None, true, &kwargs)?
    };
    params.media = media(state, &prompt, images)?;
    Ok((prompt, tools))
}

/// A prompt's images for the engine (None without any): a 400 naming `--mmproj` when the server
/// has no vision projector.
pub fn media(
    state: &State<'_>,
    prompt: &str,
    images: Images,
) -> Result<Option<super::slots::Media>, ApiError> {
    if images.list.is_empty() {
        return Ok(None);
    }
    if !state.ready.vision {
        return Err(ApiError::invalid(
            "this model takes no images: start the server with its vision projector (--mmproj FILE)",
        ));
    }
    Ok(Some(super::slots::Media { text: prompt.to_string(), images: images.list }))
}

/// The messages rendered with the model's chat template, the assistant's turn opened.
pub fn render_chat(state: &State<'_>, messages: &[(Role, String)]) -> Result<String, ApiError> {
    render(state, &turns_json(messages), None, true, &state.ready.template_kwargs)
}

/// `POST /apply-template`'s prompt: `messages`, `tools`, `add_generation_prompt` (default true)
/// and `chat_template_kwargs` through the chat template, as the chat routes render them.
pub fn apply_template(state: &State<'_>, body: &Map<String, Value>) -> Result<String, ApiError> {
    let f = Fields::new(body);
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    let kwargs = template_kwargs(state, body)?;
    if state.ready.format.jinja_source().is_some() {
        let tools = f.array("tools")?.map(|_| body["tools"].clone());
        render(
            state,
            &template_messages(body, &mut Images::default())?,
            tools.as_ref(),
            add_generation_prompt,
            &kwargs,
        )
    } else {
        let format = ToolFormat::for_prompt(&state.ready.format);
        let mut turns = messages(body, format, &mut Images::default())?;
        if let Some(t) = tools::parse_request(body, format)? {
            tools::add_to_messages(&t, &mut turns);
        }
        render(state, &turns_json(&turns), None, add_generation_prompt, &kwargs)
    }
}

fn render(
    state: &State<'_>,
    messages: &Value,
    tools: Option<&Value>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<String, ApiError> {
    state
        .ready
        .format
        .render(messages, tools, add_generation_prompt, Some(kwargs))
        .map_err(|e| ApiError::invalid(e.to_string()))
}

fn turns_json(turns: &[(Role, String)]) -> Value {
    crate::chat::messages_json(turns)
}

/// The server's `--chat-template-kwargs` with the request's `chat_template_kwargs` over them.
fn template_kwargs(state: &State<'_>, body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = state.ready.template_kwargs.clone();
    // Ollama's `think` is the template's thinking switch.
    match body.get("think") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(on)) => {
            kwargs.insert("enable_thinking".into(), Value::Bool(*on));
        }
        // (gpt-oss's levels: thinking on, at that effort.)
        Some(Value::String(level)) if ["low", "medium", "high"].contains(&level.as_str()) => {
            kwargs.insert("enable_thinking".into(), Value::Bool(true));
            kwargs.insert("reasoning_effort".into(), Value::String(level.clone()));
        }
        Some(_) => {
            return Err(ApiError::invalid("'think' must be true, false, \"low\", \"medium\" or \"high\""))
        }
    }
    match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(more)) => kwargs.extend(more.iter().map(|(k, v)| (k.clone(), v.clone()))),
        Some(_) => return Err(ApiError::invalid("'chat_template_kwargs' must be an object")),
    }
    Ok(kwargs)
}

/// The request's messages as a Jinja template reads them: each checked (an object with a known
/// role; content a string, text parts, or absent), the content parts joined into one string,
/// and the `arguments` of earlier tool calls as objects (OpenAI sends JSON text; templates, as
/// transformers documents them, expect a mapping). Other fields (`tool_calls`, `tool_call_id`,
/// `name`, `reasoning_content`) pass as they are.
pub fn template_messages(body: &Map<String, Value>, images: &mut Images) -> Result<Value, ApiError> {
    let list =
        Fields::new(body).array("messages")?.ok_or_else(|| ApiError::invalid("'messages' is required"))?;
    if list.is_empty() {
        return Err(ApiError::invalid("'messages' must hold at least one message"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(format!("'messages[{i}]' must be an object")));
        };
        let mut m = m.clone();
        match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer" | "user" | "assistant" | "tool") => {}
            Some(other) => {
                return Err(ApiError::invalid(format!(
                "'messages[{i}].role' {other:?} is not supported (system, developer, user, assistant, tool)"
            )))
            }
            None => return Err(ApiError::invalid(format!("'messages[{i}].role' must be a string"))),
        }
        // (Templates know `system`; OpenAI's newer name for it is `developer`.)
        if m.get("role").and_then(Value::as_str) == Some("developer") {
            m.insert("role".into(), Value::from("system"));
        }
        let content = message_images(&m, i, images)? + &content_text(m.get("content"), i, images)?;
        m.remove("images");
        m.insert("content".into(), Value::String(content));
        // (Ollama gives earlier reasoning as `thinking`; templates read `reasoning_content`.)
        if let Some(thinking) = m.get("thinking").cloned() {
            m.entry("reasoning_content").or_insert(thinking);
        }
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            for call in calls.iter_mut() {
                let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) else { continue };
                if let Some(Value::String(text)) = f.get("arguments") {
                    if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(text) {
                        f.insert("arguments".into(), parsed);
                    }
                }
            }
        }
        out.push(Value::Object(m));
    }
    Ok(Value::Array(out))
}

/// The images of a request's messages, decoded as they are read (a bad one is the request's 400).
#[derive(Default)]
pub struct Images {
    pub list: Vec<pinfer::media::DecodedImage>,
    /// `--media-path`: the directory `file://` URLs may name (none: they are refused).
    pub media_path: Option<std::path::PathBuf>,
}

impl Images {
    /// Decodes an image given as base64 (`what` names it in messages).
    fn push_base64(&mut self, data: &str, what: &str) -> Result<(), ApiError> {
        let bytes = pinfer::media::base64_decode(data)
            .map_err(|e| ApiError::invalid(format!("{what}: not base64 ({e})")))?;
        self.push_bytes(&bytes, what)
    }

    fn push_bytes(&mut self, bytes: &[u8], what: &str) -> Result<(), ApiError> {
        let image = pinfer::media::DecodedImage::decode(bytes, pinfer::image::ImageLimits::default())
            .map_err(|e| ApiError::invalid(format!("{what}: {e}")))?;
        self.list.push(image);
        Ok(())
    }

    /// An OpenAI `image_url`: a `data:` URI, raw base64, or a `file://` path under `--media-path`;
    /// remote URLs are refused (the server fetches nothing).
    fn push_url(&mut self, url: &str, what: &str) -> Result<(), ApiError> {
        if let Some(rest) = url.strip_prefix("data:") {
            let Some((_, data)) = rest.split_once(";base64,") else {
                return Err(ApiError::invalid(format!(
                    "{what}: a data: URI of an image must be base64 (data:image/png;base64,...)"
                )));
            };
            return self.push_base64(data, what);
        }
        if let Some(path) = url.strip_prefix("file://") {
            let Some(dir) = &self.media_path else {
                return Err(ApiError::invalid(format!(
                    "{what}: file:// images need the server started with --media-path DIR"
                )));
            };
            let dir = dir.canonicalize().map_err(|e| ApiError::server(format!("--media-path: {e}")))?;
            let file = dir
                .join(path.trim_start_matches('/'))
                .canonicalize()
                .map_err(|e| ApiError::invalid(format!("{what}: {path}: {e}")))?;
            if !file.starts_with(&dir) {
                return Err(ApiError::invalid(format!("{what}: {path} is outside --media-path")));
            }
            let bytes =
                std::fs::read(&file).map_err(|e| ApiError::invalid(format!("{what}: {path}: {e}")))?;
            return self.push_bytes(&bytes, what);
        }
        if url.starts_with("http://") || url.starts_with("https://") {
            return Err(ApiError::invalid(format!(
                "{what}: remote image URLs are not fetched; send the image as a data: URI (data:image/jpeg;base64,...)"
            )));
        }
        self.push_base64(url, what)
    }
}

/// A request's top-level `images` (Ollama's `/api/generate`), each as a media marker.
pub fn request_images(body: &Map<String, Value>, images: &mut Images) -> Result<String, ApiError> {
    let mut markers = String::new();
    match body.get("images") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (j, v) in list.iter().enumerate() {
                let Some(data) = v.as_str() else {
                    return Err(ApiError::invalid(format!("'images[{j}]' must be a base64 string")));
                };
                images.push_base64(data, &format!("'images[{j}]'"))?;
                markers.push_str(pinfer::media::MEDIA_MARKER);
            }
        }
        Some(_) => return Err(ApiError::invalid("'images' must be a list of base64 strings")),
    }
    Ok(markers)
}

/// A message's images (Ollama's `images`: base64 strings), each as a media marker before the text.
fn message_images(m: &Map<String, Value>, i: usize, images: &mut Images) -> Result<String, ApiError> {
    let mut markers = String::new();
    match m.get("images") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (j, v) in list.iter().enumerate() {
                let Some(data) = v.as_str() else {
                    return Err(ApiError::invalid(format!(
                        "'messages[{i}].images[{j}]' must be a base64 string"
                    )));
                };
                images.push_base64(data, &format!("'messages[{i}].images[{j}]'"))?;
                markers.push_str(pinfer::media::MEDIA_MARKER);
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(format!("'messages[{i}].images' must be a list of base64 strings")))
        }
    }
    Ok(markers)
}

/// A message's content as one text: a string, a list of text and image parts joined (each image
/// a media marker), or nothing.
fn content_text(content: Option<&Value>, i: usize, images: &mut Images) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let what = format!("'messages[{i}].content[{j}]'");
                let url = match p.get("image_url") {
                    Some(Value::String(u)) => Some(u.as_str()),
                    Some(v) => v.get("url").and_then(Value::as_str),
                    None => None,
                };
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("image_url"), _) => {
                        let url = url.ok_or_else(|| {
                            ApiError::invalid(format!("{what}: an image_url part needs image_url.url"))
                        })?;
                        images.push_url(url, &what)?;
                        text.push_str(pinfer::media::MEDIA_MARKER);
                    }
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "{what}: only text and image_url parts are supported"
                        )))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => {
            Err(ApiError::invalid(format!("'messages[{i}].content' must be a string or a list of parts")))
        }
    }
}

/// How a request's reply is split into reasoning and answer: the model template's markers and
/// whether the prompt opened the reasoning, or None (`reasoning_format: "none"`, or no markers).
pub fn reasoning(
    state: &State<'_>,
    body: &Map<String, Value>,
    prompt: &str,
) -> Result<Option<(Markers, bool)>, ApiError> {
    let on = match Fields::new(body).str("reasoning_format")? {
        None | Some("auto" | "deepseek" | "deepseek-legacy") => true,
        Some("none") => false,
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "'reasoning_format' {other:?} is not one of \"auto\", \"deepseek\", \"none\""
            )))
        }
    };
    Ok(state.ready.reasoning.filter(|_| on).map(|m| (m, m.opened_by(prompt))))
}

/// A whole reply taken apart: its reasoning (when the template teaches markers), its answer text,
/// and the tool calls parsed from the answer (a model may reason before it calls).
pub fn reply_parts(
    text: &str,
    reasoning: Option<(Markers, bool)>,
    tools: Option<&tools::Tools>,
) -> (Option<String>, String, Vec<tools::Call>) {
    let (thought, answer) = match reasoning {
        Some((m, opened)) => pinfer::reasoning::split(m, opened, text),
        None => (None, text.to_string()),
    };
    let (answer, calls) = match tools {
        Some(t) => tools::parse_reply(t, &answer),
        None => (answer, Vec::new()),
    };
    (thought, answer, calls)
}

/// Tools given flat (`{"name", "description", SCHEMA_KEY}`: Anthropic's `input_schema`, the
/// Responses API's `parameters`) as the chat request's `{"type": "function", "function": ...}`.
pub fn chat_tools(list: &[Value], schema_key: &str) -> Value {
    list.iter()
        .map(|t| {
            json!({ "type": "function", "function": { "name": t.get("name").cloned().unwrap_or(Value::Null),
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "parameters": t.get(schema_key).cloned().unwrap_or(json!({"type": "object"})) } })
        })
        .collect()
}
