//! Tool calls: OpenAI's and Ollama's `tools`, `tool_choice` and `parallel_tool_calls`, in the chat
//! format the model was trained on, and the calls parsed back out of its reply.
//!
//! * [`ToolFormat::Hermes`] (Qwen 2.5/3, SmolLM, Hermes and other ChatML models): the tools'
//!   signatures in `<tools></tools>` in the system message, each call
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, results in a user turn as
//!   `<tool_response>...</tool_response>`.
//! * [`ToolFormat::Llama3`] (Llama 3.x's JSON tool calling): the signatures in the system message,
//!   a call is the reply `{"name": ..., "parameters": {...}}`, results in an `ipython`-like user turn.
//! * [`ToolFormat::Generic`] (every other template): the reply is one JSON object
//!   `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`.
//! * Families only a Jinja template brings, which shows the tools, calls and results itself (their
//!   syntaxes in [`super::tool_families`]): [`ToolFormat::QwenXml`] (Qwen3-Coder),
//!   [`ToolFormat::Mistral`] (`[TOOL_CALLS]`), [`ToolFormat::ToolCallToken`] (Granite 3.x,
//!   Phi-4-mini: `<|tool_call|>`), [`ToolFormat::CommandR`] (`<|START_ACTION|>`) and
//!   [`ToolFormat::Pythonic`] (LFM2: `<|tool_call_start|>[f(a=1)]<|tool_call_end|>`),
//!   [`ToolFormat::FunctionaryV31`] (`<function=NAME>{...}</function>`),
//!   [`ToolFormat::FunctionaryV32`] (`>>>NAME\n{...}`) and [`ToolFormat::DeepSeek`] (R1 and V3.1:
//!   `<｜tool▁calls▁begin｜>...`) and [`ToolFormat::Harmony`] (gpt-oss: `<|channel|>commentary
//!   to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`).
//!
//! Each family's reading is checked against llama.cpp's parser on golden replies
//! (tests/golden/tool-calls, scripts/tool_call_goldens.py; the test in `golden_tests`).
//!
//! `tool_choice: "required"` or a named function constrains the reply with a grammar (each call's
//! arguments to that tool's JSON schema), so the calls always parse; `"auto"` lets the model choose
//! and parses what it wrote (text that is not a well-formed call stays text); `"none"` sends no tools.

use serde_json::{json, Map, Value};

use pinfer::chat::{ChatTemplate, Role};
use pinfer::grammar::GrammarSpec;
use pinfer::prompt_format::PromptFormat;

use super::api::{ApiError, Fields};
use super::tool_families as families;

/// How tools are shown to the model and its calls written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Generic,
    QwenXml,
    Mistral,
    ToolCallToken,
    CommandR,
    Pythonic,
    FunctionaryV31,
    FunctionaryV32,
    DeepSeek,
    Harmony,
}

impl ToolFormat {
    /// The format of a model with the built-in `template`.
    pub fn of(template: ChatTemplate) -> Self {
        match template {
            ChatTemplate::ChatMl => Self::Hermes,
            ChatTemplate::Llama3 => Self::Llama3,
            _ => Self::Generic,
        }
    }

    /// The format of a model's prompts: a Jinja template's by the call syntax it teaches (Hermes
    /// and Qwen write `<tool_call>`; Llama 3.1+ `"parameters"` JSON after an `ipython`
    /// environment line), a built-in format's by [`ToolFormat::of`].
    pub fn for_prompt(format: &PromptFormat) -> Self {
        match format {
            PromptFormat::BuiltIn(t) => Self::of(*t),
            PromptFormat::Jinja { source, .. } => Self::of_jinja(source),
        }
    }

    /// The format a Jinja template's source teaches, by its call markers (the most specific
    /// first: Qwen3-Coder's `<tool_call>` holds `<function=`, Functionary v3.1's template holds
    /// Llama 3's `ipython`).
    pub fn of_jinja(source: &str) -> Self {
        let has = |marker: &str| source.contains(marker);
        if has("<|channel|>commentary") && has("functions.") {
            Self::Harmony
        } else if has("<tool_call>") && has("<function=") {
            Self::QwenXml
        } else if has("<tool_call>") {
            Self::Hermes
        } else if has("[TOOL_CALLS]") {
            Self::Mistral
        } else if has("<|tool_call_start|>") || has("<|tool_list_start|>") {
            // (LFM2-8B-A1B's template lists the tools in <|tool_list_start|> and leaves the call
            // syntax to the model's training.)
            Self::Pythonic
        } else if has("<|tool_call|>") {
            Self::ToolCallToken
        } else if has("<|START_ACTION|>") {
            Self::CommandR
        } else if has("tool▁calls▁begin") {
            Self::DeepSeek
        } else if has("<function=") {
            Self::FunctionaryV31
        } else if has(">>>all") {
            Self::FunctionaryV32
        } else if has("<|start_header_id|>") && has("ipython") {
            Self::Llama3
        } else {
            Self::Generic
        }
    }

    /// Where a call can start in a reply, for streaming: text before the first of these is the
    /// reply's text. (Llama 3's and the generic JSON calls start at the reply's `{`.)
    pub fn call_markers(self) -> &'static [&'static str] {
        match self {
            Self::Hermes | Self::QwenXml => &["<tool_call>"],
            Self::Llama3 => &["<|python_tag|>"],
            Self::Generic => &[],
            Self::Mistral => &["[TOOL_CALLS]"],
            Self::ToolCallToken => &["<|tool_call|>"],
            Self::CommandR => &["<|START_ACTION|>", "<|END_RESPONSE|>"],
            Self::Pythonic => &["<|tool_call_start|>"],
            Self::FunctionaryV31 => &["<function="],
            Self::FunctionaryV32 => &[">>>"],
            Self::DeepSeek => &["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"],
            Self::Harmony => &["<|start|>assistant"],
        }
    }
}

/// One tool: a function's name, description and JSON schema of its arguments.
#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

/// What the request lets the model do with its tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Required,
    Named(String),
}

/// A request's tools (none when `tool_choice` is `"none"` or no tools were given).
#[derive(Debug, Clone)]
pub struct Tools {
    pub list: Vec<Tool>,
    pub choice: Choice,
    pub parallel: bool,
    pub format: ToolFormat,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: Value,
    /// The id the model wrote for the call (Mistral, Command R7B), kept as llama.cpp keeps it
    /// (Mistral's templates want their 9-character ids back with the results).
    pub id: Option<String>,
}

/// The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; `None` without tools.
pub fn parse_request(body: &Map<String, Value>, format: ToolFormat) -> Result<Option<Tools>, ApiError> {
    let f = Fields::new(body);
    let Some(list) = f.array("tools")? else { return Ok(None) };
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = |what: &str| ApiError::invalid(format!("'tools[{i}]{what}'"));
        let func = match t.get("type").and_then(Value::as_str) {
            Some("function") | None => t.get("function").ok_or_else(|| at(".function' is required; '"))?,
            Some(other) => {
                return Err(at(&format!(".type' {other:?}: only \"function\" tools are supported; '")))
            }
        };
        let name = func
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| at(".function.name' must be a non-empty string; '"))?;
        let parameters = match func.get("parameters") {
            None | Some(Value::Null) => json!({ "type": "object", "properties": {} }),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(at(".function.parameters' must be a JSON schema object; '")),
        };
        let description = func.get("description").and_then(Value::as_str).unwrap_or("").to_string();
        tools.push(Tool { name: name.to_string(), description, parameters });
    }
    if tools.is_empty() {
        return Ok(None);
    }
    let choice = match f.get("tool_choice") {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Choice::Auto,
            "required" | "any" => Choice::Required,
            "none" => return Ok(None),
            other => {
                return Err(ApiError::invalid(format!(
                    "'tool_choice' {other:?}: give \"auto\", \"required\", \"none\" or a function"
                )))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("'tool_choice.function.name' must be a string"))?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(format!("'tool_choice': no tool is named {name:?}")));
            }
            Choice::Named(name.to_string())
        }
        Some(_) => return Err(ApiError::invalid("'tool_choice' must be a string or an object")),
    };
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    Ok(Some(Tools { list: tools, choice, parallel, format }))
}

fn signature(t: &Tool) -> Value {
    json!({ "type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters } })
}

/// The instructions and signatures added to the system message.
pub fn system_text(tools: &Tools) -> String {
    let sigs: Vec<String> = tools.list.iter().map(|t| signature(t).to_string()).collect();
    match tools.format {
        ToolFormat::Hermes => format!(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
             For each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            sigs.join("\n")
        ),
        ToolFormat::Llama3 => format!(
            "Environment: ipython\n\nYou have access to the following functions. To call a function, \
             respond with only a JSON object in the format {{\"name\": function name, \"parameters\": \
             dictionary of argument name and its value}}. Do not use variables.\n\n{}",
            sigs.join("\n\n")
        ),
        // (The template-only families never get here: their templates write the tools.)
        ToolFormat::Generic
        | ToolFormat::QwenXml
        | ToolFormat::Mistral
        | ToolFormat::ToolCallToken
        | ToolFormat::CommandR
        | ToolFormat::Pythonic
        | ToolFormat::FunctionaryV31
        | ToolFormat::FunctionaryV32
        | ToolFormat::DeepSeek
        | ToolFormat::Harmony => format!(
            "You can call these tools:\n{}\n\nTo call tools, reply with only a JSON object \
             {{\"tool_calls\": [{{\"name\": <tool name>, \"arguments\": <arguments object>}}]}}. \
             To answer without a tool, reply normally.",
            sigs.join("\n")
        ),
    }
}

/// Adds the tools to the conversation: to the first system message, or as a new one first.
pub fn add_to_messages(tools: &Tools, messages: &mut Vec<(Role, String)>) {
    let text = system_text(tools);
    match messages.first_mut() {
        Some((Role::System, content)) => {
            content.push_str("\n\n");
            content.push_str(&text);
        }
        _ => messages.insert(0, (Role::System, text)),
    }
}

/// An assistant message's `tool_calls` as the text the model would have written.
pub fn render_calls(format: ToolFormat, calls: &[Value]) -> Result<String, ApiError> {
    let mut parsed = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let f = c.get("function").unwrap_or(c);
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(format!("'tool_calls[{i}].function.name' must be a string")))?;
        // OpenAI sends the arguments as a JSON string, Ollama as an object.
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
            Some(v) => v.clone(),
            None => json!({}),
        };
        parsed.push((name.to_string(), arguments));
    }
    Ok(match format {
        ToolFormat::Hermes => parsed
            .iter()
            .map(|(n, a)| format!("<tool_call>\n{}\n</tool_call>", json!({ "name": n, "arguments": a })))
            .collect::<Vec<_>>()
            .join("\n"),
        ToolFormat::Llama3 => parsed
            .iter()
            .map(|(n, a)| json!({ "name": n, "parameters": a }).to_string())
            .collect::<Vec<_>>()
            .join("\n"),
        ToolFormat::Generic => json!({ "tool_calls": parsed.iter().map(|(n, a)| json!({ "name": n, "arguments": a })).collect::<Vec<_>>() })
            .to_string(),
        ToolFormat::Mistral => format!("[TOOL_CALLS]{}", name_arguments(&parsed)),
        ToolFormat::ToolCallToken => format!("<|tool_call|>{}", name_arguments(&parsed)),
        ToolFormat::CommandR => format!(
            "<|START_ACTION|>{}<|END_ACTION|>",
            Value::Array(
                parsed
                    .iter()
                    .enumerate()
                    .map(|(i, (n, a))| json!({ "tool_call_id": i.to_string(), "tool_name": n, "parameters": a }))
                    .collect()
            )
        ),
        ToolFormat::Pythonic => {
            let calls: Vec<String> = parsed
                .iter()
                .map(|(n, a)| {
                    let args: Vec<String> = a
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    format!("{n}({})", args.join(", "))
                })
                .collect();
            format!("<|tool_call_start|>[{}]<|tool_call_end|>", calls.join(", "))
        }
        ToolFormat::FunctionaryV31 => parsed.iter().map(|(n, a)| format!("<function={n}>{a}</function>")).collect(),
        ToolFormat::FunctionaryV32 => {
            parsed.iter().map(|(n, a)| format!("{n}\n{a}")).collect::<Vec<_>>().join(">>>")
        }
        ToolFormat::DeepSeek => format!(
            "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>",
            parsed
                .iter()
                .map(|(n, a)| format!("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>"))
                .collect::<Vec<_>>()
                .join("\n")
        ),
        ToolFormat::Harmony => parsed
            .iter()
            .map(|(n, a)| format!("<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{a}<|call|>"))
            .collect::<Vec<_>>()
            .join("<|start|>assistant"),
        ToolFormat::QwenXml => parsed
            .iter()
            .map(|(n, a)| {
                let params: String = a
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| match v {
                        Value::String(s) => format!("<parameter={k}>\n{s}\n</parameter>\n"),
                        v => format!("<parameter={k}>\n{v}\n</parameter>\n"),
                    })
                    .collect();
                format!("<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
            })
            .collect::<Vec<_>>()
            .join("\n"),
    })
}

/// Calls as a JSON array of `{"name", "arguments"}` objects.
fn name_arguments(calls: &[(String, Value)]) -> Value {
    Value::Array(calls.iter().map(|(n, a)| json!({ "name": n, "arguments": a })).collect())
}

/// A tool's result (a `tool` message) as the user turn the model reads it in.
pub fn render_result(format: ToolFormat, content: &str, name: Option<&str>) -> String {
    match format {
        ToolFormat::Hermes => format!("<tool_response>\n{content}\n</tool_response>"),
        ToolFormat::Llama3 => format!("Tool result: {content}"),
        ToolFormat::Generic
        | ToolFormat::QwenXml
        | ToolFormat::Mistral
        | ToolFormat::ToolCallToken
        | ToolFormat::CommandR
        | ToolFormat::Pythonic
        | ToolFormat::FunctionaryV31
        | ToolFormat::FunctionaryV32
        | ToolFormat::DeepSeek
        | ToolFormat::Harmony => match name {
            Some(n) => format!("Result of tool {n}: {content}"),
            None => format!("Tool result: {content}"),
        },
    }
}

/// The JSON schema of one call of `tool` in `format`.
fn call_schema(format: ToolFormat, tool: &Tool) -> Value {
    let (name, args) = match format {
        ToolFormat::Llama3 => ("name", "parameters"),
        ToolFormat::CommandR => ("tool_name", "parameters"),
        _ => ("name", "arguments"),
    };
    let mut properties = Map::new();
    properties.insert(name.into(), json!({ "const": tool.name }));
    properties.insert(args.into(), tool.parameters.clone());
    let mut required = vec![name, args];
    if format == ToolFormat::CommandR {
        properties.insert("tool_call_id".into(), json!({ "type": "string" }));
        required.insert(0, "tool_call_id");
    }
    json!({ "type": "object", "properties": properties, "required": required, "additionalProperties": false })
}

/// The grammar that forces a call (`tool_choice` required or named); `None` for `auto`.
pub fn grammar(tools: &Tools) -> Option<GrammarSpec> {
    let chosen: Vec<&Tool> = match &tools.choice {
        Choice::Auto => return None,
        Choice::Required => tools.list.iter().collect(),
        Choice::Named(n) => tools.list.iter().filter(|t| &t.name == n).collect(),
    };
    let one = json!({ "anyOf": chosen.iter().map(|t| call_schema(tools.format, t)).collect::<Vec<_>>() });
    let many = if tools.parallel { "+" } else { "" };
    Some(match tools.format {
        ToolFormat::Hermes => GrammarSpec::Lark(format!(
            "start: call{many}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\" \"\\n\"?\nbody: %json {one}\n"
        )),
        ToolFormat::Llama3 => GrammarSpec::JsonSchema(one.to_string()),
        // The JSON-array families: the family's marker, then an array of calls.
        ToolFormat::Mistral | ToolFormat::ToolCallToken | ToolFormat::CommandR => {
            let mut array = json!({ "type": "array", "items": one, "minItems": 1 });
            if !tools.parallel {
                array["maxItems"] = json!(1);
            }
            let (open, close) = match tools.format {
                ToolFormat::Mistral => ("[TOOL_CALLS]", ""),
                ToolFormat::CommandR => ("<|START_ACTION|>", "<|END_ACTION|>"),
                _ => ("<|tool_call|>", ""),
            };
            let close = if close.is_empty() { String::new() } else { format!(" {}", lark_literal(close)) };
            GrammarSpec::Lark(format!("start: {} body{close}\nbody: %json {array}\n", lark_literal(open)))
        }
        // The call's structure with the chosen tools' names and parameters; the values are
        // JSON (LFM2) or text (Qwen3-Coder), not checked against the schema.
        ToolFormat::Pythonic => {
            let sep = if tools.parallel { " (\", \" call)*" } else { "" };
            let names = alternatives(chosen.iter().map(|t| t.name.as_str()));
            // Each argument's value is JSON of its parameter's schema.
            let mut params: Vec<String> = chosen
                .iter()
                .flat_map(|t| t.parameters["properties"].as_object().into_iter().flatten())
                .map(|(key, schema)| format!("{} \"=\" %json {schema}", lark_literal(key)))
                .collect();
            params.sort();
            params.dedup();
            let call = if params.is_empty() {
                "call: NAME \"()\"\n".to_string()
            } else {
                let rules: String =
                    params.iter().enumerate().map(|(i, p)| format!("arg{i}: {p}\n")).collect();
                let arg = (0..params.len()).map(|i| format!("arg{i}")).collect::<Vec<_>>().join(" | ");
                format!("call: NAME \"(\" (arg (\", \" arg)*)? \")\"\narg: {arg}\n{rules}")
            };
            GrammarSpec::Lark(format!(
                "start: \"<|tool_call_start|>[\" call{sep} \"]<|tool_call_end|>\"\n{call}NAME: {}\n",
                names?
            ))
        }
        // Per tool: its name, then each of its parameters at most once in the schema's order
        // (the required ones always), each value one line of at most 120 characters, so a call
        // always ends.
        ToolFormat::QwenXml => {
            let many = if tools.parallel { "+" } else { "" };
            let mut rules = String::new();
            let mut calls = Vec::new();
            for (i, t) in chosen.iter().enumerate() {
                let required: Vec<&str> = t.parameters["required"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                let mut body = String::new();
                for (j, key) in parameter_names(t).enumerate() {
                    rules.push_str(&format!(
                        "t{i}p{j}: {} VALUE \"\\n</parameter>\\n\"\n",
                        lark_literal(&format!("<parameter={key}>\n"))
                    ));
                    body.push_str(&format!(" t{i}p{j}{}", if required.contains(&key) { "" } else { "?" }));
                }
                rules.push_str(&format!(
                    "t{i}: {}{body} \"</function>\\n</tool_call>\" \"\\n\"?\n",
                    lark_literal(&format!("<tool_call>\n<function={}>\n", t.name))
                ));
                calls.push(format!("t{i}"));
            }
            if calls.is_empty() {
                return None;
            }
            GrammarSpec::Lark(format!(
                "start: call{many}\ncall: {}\n{rules}VALUE: /[^<\\n]{{1,120}}/\n",
                calls.join(" | ")
            ))
        }
        // Per tool: the family's call with the tool's name and its arguments' schema; calls
        // joined by the family's separator.
        ToolFormat::FunctionaryV31 | ToolFormat::FunctionaryV32 | ToolFormat::DeepSeek | ToolFormat::Harmony => {
            let (open, close, sep, start, end) = match tools.format {
                ToolFormat::FunctionaryV31 => ("<function=", ">", "", "", ""),
                ToolFormat::FunctionaryV32 => ("", "\n", ">>>", "", ""),
                ToolFormat::Harmony => (
                    "<|channel|>commentary to=functions.",
                    " <|constrain|>json<|message|>",
                    "<|start|>assistant",
                    "",
                    "",
                ),
                _ => (
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                    "\n```json\n",
                    "\n",
                    "<｜tool▁calls▁begin｜>",
                    "<｜tool▁calls▁end｜>",
                ),
            };
            let after = match tools.format {
                ToolFormat::FunctionaryV31 => "</function>",
                ToolFormat::DeepSeek => "\n```<｜tool▁call▁end｜>",
                ToolFormat::Harmony => "<|call|>",
                _ => "",
            };
            let rules: String = chosen
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let tail = if after.is_empty() { String::new() } else { format!(" {}", lark_literal(after)) };
                    format!("t{i}: {} %json {}{tail}\n", lark_literal(&format!("{open}{}{close}", t.name)), t.parameters)
                })
                .collect();
            if rules.is_empty() {
                return None;
            }
            let call = (0..chosen.len()).map(|i| format!("t{i}")).collect::<Vec<_>>().join(" | ");
            let more = if tools.parallel { format!(" ({} call)*", lark_literal(sep)) } else { String::new() };
            let lit = |s: &str| if s.is_empty() { String::new() } else { format!("{} ", lark_literal(s)) };
            let end = if end.is_empty() { String::new() } else { format!(" {}", lark_literal(end)) };
            GrammarSpec::Lark(format!("start: {}call{more}{end}\ncall: {call}\n{rules}", lit(start)))
        }
        ToolFormat::Generic => {
            let mut calls = json!({ "type": "array", "items": {
                "anyOf": chosen.iter().map(|t| call_schema(ToolFormat::Generic, t)).collect::<Vec<_>>() },
                "minItems": 1 });
            if !tools.parallel {
                calls["maxItems"] = json!(1);
            }
            GrammarSpec::JsonSchema(
                json!({ "type": "object", "properties": { "tool_calls": calls },
                        "required": ["tool_calls"], "additionalProperties": false })
                .to_string(),
            )
        }
    })
}

/// The calls in a reply, and the text around them; `text` is left whole when it holds no
/// well-formed call of a known tool.
pub fn parse_reply(tools: &Tools, text: &str) -> (String, Vec<Call>) {
    let known = |name: &str| tools.list.iter().any(|t| t.name == name);
    // The template-only families: their parsers give raw calls, checked against the tools here.
    let checked = |parsed: Option<(String, Vec<families::RawCall>)>| match parsed {
        Some((rest, raw)) if raw.iter().all(|c| known(&c.name) && c.arguments.is_object()) => {
            (rest, raw.into_iter().map(|c| Call { name: c.name, arguments: c.arguments, id: c.id }).collect())
        }
        _ => (text.to_string(), Vec::new()),
    };
    match tools.format {
        ToolFormat::Mistral => return checked(families::mistral(text)),
        ToolFormat::ToolCallToken => {
            return checked(families::marked_array(
                text,
                "<|tool_call|>",
                Some("<|/tool_call|>"),
                "name",
                "arguments",
            ))
        }
        ToolFormat::CommandR => {
            let (rest, calls) = checked(families::marked_array(
                text,
                "<|START_ACTION|>",
                Some("<|END_ACTION|>"),
                "tool_name",
                "parameters",
            ));
            // Command R7B's answer is `<|START_RESPONSE|>...<|END_RESPONSE|>`: the text between.
            let answer = rest.split_once("<|START_RESPONSE|>").map_or(rest.as_str(), |(_, a)| a);
            let answer = answer.split("<|END_RESPONSE|>").next().unwrap_or(answer);
            return (answer.trim().to_string(), calls);
        }
        ToolFormat::Pythonic => return checked(families::pythonic(text)),
        ToolFormat::QwenXml => {
            let string_param = |tool: &str, key: &str| {
                tools.list.iter().find(|t| t.name == tool).is_some_and(|t| {
                    t.parameters["properties"][key]["type"].as_str().is_none_or(|ty| ty == "string")
                })
            };
            return checked(families::qwen_xml(text, string_param));
        }
        ToolFormat::FunctionaryV31 => return checked(families::functionary_v31(text)),
        ToolFormat::FunctionaryV32 => {
            return match checked(families::functionary_v32(text)) {
                (_, calls) if calls.is_empty() => {
                    (families::functionary_v32_text(text).unwrap_or_else(|| text.to_string()), calls)
                }
                parsed => parsed,
            }
        }
        ToolFormat::DeepSeek => return checked(families::deepseek(text)),
        ToolFormat::Harmony => return checked(families::harmony(text)),
        ToolFormat::Llama3 if text.contains("<|python_tag|>") => return checked(families::python_tag(text)),
        ToolFormat::Hermes | ToolFormat::Llama3 | ToolFormat::Generic => {}
    }
    let call_of = |v: &Value, args: &str| -> Option<Call> {
        let name = v.get("name")?.as_str()?;
        let arguments = match v.get(args)? {
            Value::String(s) => serde_json::from_str(s).ok()?,
            a @ Value::Object(_) => a.clone(),
            _ => return None,
        };
        known(name).then(|| Call { name: name.to_string(), arguments, id: None })
    };
    let mut calls = Vec::new();
    match tools.format {
        // (Returned above.)
        ToolFormat::QwenXml
        | ToolFormat::Mistral
        | ToolFormat::ToolCallToken
        | ToolFormat::CommandR
        | ToolFormat::Pythonic
        | ToolFormat::FunctionaryV31
        | ToolFormat::FunctionaryV32
        | ToolFormat::DeepSeek
        | ToolFormat::Harmony => (text.to_string(), Vec::new()),
        ToolFormat::Hermes => {
            let mut rest = String::new();
            let mut s = text;
            while let Some(start) = s.find("<tool_call>") {
                let after = &s[start + "<tool_call>".len()..];
                let (body, tail) = match after.find("</tool_call>") {
                    Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
                    None => (after, ""),
                };
                match serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| call_of(&v, "arguments")) {
                    Some(c) => calls.push(c),
                    None => return (text.to_string(), Vec::new()),
                }
                rest.push_str(&s[..start]);
                s = tail;
            }
            rest.push_str(s);
            (rest.trim().to_string(), calls)
        }
        ToolFormat::Llama3 => {
            for line in text.trim().lines().filter(|l| !l.trim().is_empty()) {
                let v: Option<Value> = serde_json::from_str(line.trim()).ok();
                match v.as_ref().and_then(|v| call_of(v, "parameters").or_else(|| call_of(v, "arguments"))) {
                    Some(c) => calls.push(c),
                    None => return (text.to_string(), Vec::new()),
                }
            }
            (String::new(), calls)
        }
        ToolFormat::Generic => {
            let v: Option<Value> = serde_json::from_str(text.trim()).ok();
            let Some(list) = v.as_ref().and_then(|v| v.get("tool_calls")).and_then(Value::as_array) else {
                if let Some(r) = v.as_ref().and_then(|v| v.get("response")).and_then(Value::as_str) {
                    return (r.to_string(), Vec::new());
                }
                return (text.to_string(), Vec::new());
            };
            for c in list {
                match call_of(c, "arguments") {
                    Some(c) => calls.push(c),
                    None => return (text.to_string(), Vec::new()),
                }
            }
            (String::new(), calls)
        }
    }
}

/// A Lark string literal.
fn lark_literal(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// A Lark terminal matching exactly one of `words`; None when there are none.
fn alternatives<'a>(words: impl Iterator<Item = &'a str>) -> Option<String> {
    let mut list: Vec<String> = words.map(lark_literal).collect();
    list.sort();
    list.dedup();
    (!list.is_empty()).then(|| list.join(" | "))
}

/// The names of a tool's parameters (its schema's `properties`).
fn parameter_names(t: &Tool) -> impl Iterator<Item = &str> {
    t.parameters["properties"].as_object().into_iter().flat_map(|p| p.keys().map(String::as_str))
}

#[cfg(test)]
#[path = "tool_goldens.rs"]
mod golden_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(format: ToolFormat, choice: Choice) -> Tools {
        let t = Tool {
            name: "set_light".into(),
            description: "Switch a light".into(),
            parameters: json!({"type":"object","properties":{"room":{"type":"string"},"on":{"type":"boolean"}},"required":["room","on"]}),
        };
        Tools { list: vec![t], choice, parallel: true, format }
    }

    #[test]
    fn replies_parse_into_calls_in_every_format() {
        let h = tools(ToolFormat::Hermes, Choice::Auto);
        let (text, calls) = parse_reply(
            &h,
            "Sure.\n<tool_call>\n{\"name\": \"set_light\", \"arguments\": {\"room\": \"hall\", \"on\": true}}\n</tool_call>",
        );
        assert_eq!(text, "Sure.");
        assert_eq!(
            calls,
            vec![Call { name: "set_light".into(), arguments: json!({"room": "hall", "on": true}), id: None }]
        );
        // An unknown tool or broken JSON: the reply stays text.
        let bad = "<tool_call>\n{\"name\": \"oven\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(parse_reply(&h, bad), (bad.to_string(), vec![]));
        let l = tools(ToolFormat::Llama3, Choice::Auto);
        let (_, calls) =
            parse_reply(&l, "{\"name\": \"set_light\", \"parameters\": {\"room\": \"a\", \"on\": false}}");
        assert_eq!(calls.len(), 1);
        assert_eq!(parse_reply(&l, "It is dark.").1, vec![]);
        let g = tools(ToolFormat::Generic, Choice::Auto);
        let (_, calls) = parse_reply(
            &g,
            r#"{"tool_calls": [{"name": "set_light", "arguments": {"room": "b", "on": true}}]}"#,
        );
        assert_eq!(calls[0].arguments["room"], "b");
        assert_eq!(parse_reply(&g, r#"{"response": "hello"}"#), ("hello".to_string(), vec![]));
    }

    /// Every format; `covered` does not compile when a format is added and not listed.
    const ALL: [ToolFormat; 12] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Generic,
        ToolFormat::QwenXml,
        ToolFormat::Mistral,
        ToolFormat::ToolCallToken,
        ToolFormat::CommandR,
        ToolFormat::Pythonic,
        ToolFormat::FunctionaryV31,
        ToolFormat::FunctionaryV32,
        ToolFormat::DeepSeek,
        ToolFormat::Harmony,
    ];
    #[allow(dead_code)]
    fn covered(f: ToolFormat) {
        match f {
            ToolFormat::Hermes
            | ToolFormat::Llama3
            | ToolFormat::Generic
            | ToolFormat::QwenXml
            | ToolFormat::Mistral
            | ToolFormat::ToolCallToken
            | ToolFormat::CommandR
            | ToolFormat::Pythonic
            | ToolFormat::FunctionaryV31
            | ToolFormat::FunctionaryV32
            | ToolFormat::DeepSeek
            | ToolFormat::Harmony => {}
        }
    }

    #[test]
    fn rendered_calls_parse_back() {
        for format in ALL {
            let t = tools(format, Choice::Auto);
            let text = render_calls(
                format,
                &[json!({"function": {"name": "set_light", "arguments": "{\"room\":\"x\",\"on\":true}"}})],
            )
            .unwrap();
            let (_, calls) = parse_reply(&t, &text);
            assert_eq!(calls.len(), 1, "{format:?}: {text}");
            assert_eq!(calls[0].arguments, json!({"room": "x", "on": true}));
        }
    }

    #[test]
    fn only_required_and_named_choices_constrain() {
        assert!(grammar(&tools(ToolFormat::Hermes, Choice::Auto)).is_none());
        assert!(matches!(grammar(&tools(ToolFormat::Hermes, Choice::Required)), Some(GrammarSpec::Lark(_))));
        assert!(matches!(
            grammar(&tools(ToolFormat::Generic, Choice::Named("set_light".into()))),
            Some(GrammarSpec::JsonSchema(_))
        ));
    }
}
