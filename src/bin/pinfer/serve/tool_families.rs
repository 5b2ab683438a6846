//! The call syntaxes of the tool families whose Jinja templates write the tools themselves, parsed
//! back out of a reply (each family's format as its template teaches it):
//!
//! * Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Nemo, Small 3.x), or
//!   `[TOOL_CALLS]name[ARGS]{...}` per call (Devstral, Ministral 3, Magistral).
//! * Granite 3.x and Phi-4-mini: `<|tool_call|>[{"name": ..., "arguments": {...}}]`, Phi closing
//!   with `<|/tool_call|>`.
//! * Command R7B: `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]
//!   <|END_ACTION|>`.
//! * LFM2: Python calls, `<|tool_call_start|>[get_weather(city="Paris"), f(n=1)]<|tool_call_end|>`.
//! * Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
//!   </function>\n</tool_call>`, each value text (a string where the schema says so, else JSON).
//!
//! * Functionary v3.1: `<function=NAME>{...}</function>` per call, text before the first.
//! * Functionary v3.2: the reply is `>>>`-separated parts `RECIPIENT\nBODY` (the generation
//!   prompt writes the first `>>>`): recipient `all` is text, any other a call with JSON arguments.
//! * DeepSeek R1 (and V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//!   \n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3.1 writes
//!   `NAME<｜tool▁sep｜>{...}`).
//! * gpt-oss (harmony): messages `<|start|>assistant<|channel|>CHANNEL ...<|message|>BODY<|end|>`
//!   (the generation prompt writes the first `<|start|>assistant`): a call is a commentary
//!   message `to=functions.NAME` with JSON arguments, ended by `<|call|>`; the answer is the
//!   `final` channel's.
//!
//! Each parser gives the text around the calls and the calls as (name, arguments object), or None
//! when the reply holds no well-formed call (it then stays text).

use serde_json::{Map, Value};

/// A parsed call before its tool is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct RawCall {
    pub name: String,
    pub arguments: Value,
    /// The call's id when the family writes one (Mistral's, Command R7B's).
    pub id: Option<String>,
}

fn call(name: impl Into<String>, arguments: Value) -> RawCall {
    RawCall { name: name.into(), arguments, id: None }
}

/// Mistral's `[TOOL_CALLS]`, in either of its two shapes.
pub fn mistral(text: &str) -> Option<(String, Vec<RawCall>)> {
    const MARK: &str = "[TOOL_CALLS]";
    let start = text.find(MARK)?;
    let before = text[..start].trim().to_string();
    let after = text[start + MARK.len()..].trim_start();
    if after.starts_with('[') {
        return Some((before, json_array_calls(first_json(after)?, "name", "arguments")?));
    }
    let mut calls = Vec::new();
    for part in text[start..].split(MARK).filter(|p| !p.trim().is_empty()) {
        let (name, args) = part.split_once("[ARGS]")?;
        // (Mistral Small 3.2 writes the call's id between: `NAME[CALL_ID]ID[ARGS]`.)
        let (name, id) = match name.split_once("[CALL_ID]") {
            Some((name, id)) => (name, Some(id.trim().to_string())),
            None => (name, None),
        };
        let args: Value = serde_json::from_str(first_json(args.trim())?).ok()?;
        calls.push(RawCall { id, ..call(name.trim(), args.is_object().then_some(args)?) });
    }
    (!calls.is_empty()).then_some((before, calls))
}

/// A JSON array of calls after `open` (and before `close`, when the family closes it).
pub fn marked_array(
    text: &str,
    open: &str,
    close: Option<&str>,
    name: &str,
    args: &str,
) -> Option<(String, Vec<RawCall>)> {
    let start = text.find(open)?;
    let mut body = text[start + open.len()..].trim();
    if let Some(close) = close {
        body = body.split(close).next().unwrap_or(body).trim();
    }
    let calls = json_array_calls(first_json(body)?, name, args)?;
    Some((text[..start].trim().to_string(), calls))
}

/// LFM2's Python call list.
pub fn pythonic(text: &str) -> Option<(String, Vec<RawCall>)> {
    const OPEN: &str = "<|tool_call_start|>";
    const CLOSE: &str = "<|tool_call_end|>";
    let start = text.find(OPEN)?;
    let after = &text[start + OPEN.len()..];
    let body = after.split(CLOSE).next().unwrap_or(after);
    let mut p = Py { s: body.trim().as_bytes(), at: 0 };
    let calls = p.call_list()?;
    p.space();
    (p.at == p.s.len() && !calls.is_empty()).then(|| (text[..start].trim().to_string(), calls))
}

/// Qwen3-Coder's XML calls; `string_param(tool, key)` says whether the tool's schema types the
/// parameter as a string (its text is then the value as it is).
pub fn qwen_xml(text: &str, string_param: impl Fn(&str, &str) -> bool) -> Option<(String, Vec<RawCall>)> {
    let first = text.find("<tool_call>")?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find("<tool_call>") {
        let after = &rest[start + "<tool_call>".len()..];
        let (body, tail) = after.split_once("</tool_call>").unwrap_or((after, ""));
        let f = body.trim().strip_prefix("<function=")?;
        let (name, f) = f.split_once('>')?;
        let f = f.split("</function>").next()?;
        let mut args = Map::new();
        let mut params = f;
        while let Some(p) = params.find("<parameter=") {
            let p = &params[p + "<parameter=".len()..];
            let (key, p) = p.split_once('>')?;
            let (value, next) = p.split_once("</parameter>")?;
            // One newline after the opening tag and before the closing one belongs to the syntax.
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let parsed = if string_param(name, key) {
                Value::String(value.to_string())
            } else {
                serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()))
            };
            args.insert(key.to_string(), parsed);
            params = next;
        }
        calls.push(call(name.trim(), Value::Object(args)));
        rest = tail;
    }
    Some((text[..first].trim().to_string(), calls))
}

/// Functionary v3.1's `<function=NAME>{...}</function>` calls (the closing tag may be cut).
pub fn functionary_v31(text: &str) -> Option<(String, Vec<RawCall>)> {
    const OPEN: &str = "<function=";
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    for part in text[first..].split(OPEN).skip(1) {
        let (name, rest) = part.split_once('>')?;
        let body = rest.trim_start();
        let json = first_json(body)?;
        let tail = body[json.len()..].trim_start();
        let tail = tail.strip_prefix("</function>").unwrap_or(tail);
        if !tail.trim().is_empty() {
            return None;
        }
        calls.push(call(name.trim(), serde_json::from_str(json).ok()?));
    }
    Some((text[..first].trim().to_string(), calls))
}

/// Functionary v3.2's `>>>`-separated parts (the reply starts after the prompt's `>>>`).
pub fn functionary_v32(text: &str) -> Option<(String, Vec<RawCall>)> {
    let mut content = String::new();
    let mut calls = Vec::new();
    for part in text.split(">>>") {
        let (recipient, body) = part.split_once('\n')?;
        match recipient.trim() {
            "all" => content.push_str(body),
            name => {
                let body = body.trim();
                let json = first_json(body)?;
                if json.len() != body.len() {
                    return None;
                }
                calls.push(call(name, serde_json::from_str(json).ok()?));
            }
        }
    }
    (!calls.is_empty()).then(|| (content.trim().to_string(), calls))
}

/// Functionary v3.2's text when the reply holds no call: the `all` parts' bodies.
pub fn functionary_v32_text(text: &str) -> Option<String> {
    let mut content = String::new();
    for part in text.split(">>>") {
        content.push_str(part.strip_prefix("all\n")?);
    }
    Some(content.trim().to_string())
}

/// DeepSeek R1's (and V3.1's) calls (the closing markers may be cut).
pub fn deepseek(text: &str) -> Option<(String, Vec<RawCall>)> {
    const CALLS: &str = "<｜tool▁calls▁begin｜>";
    const CALL: &str = "<｜tool▁call▁begin｜>";
    const SEP: &str = "<｜tool▁sep｜>";
    const END: &str = "<｜tool▁call▁end｜>";
    let first = text.find(CALLS)?;
    let body = &text[first + CALLS.len()..];
    let body = body.split("<｜tool▁calls▁end｜>").next().unwrap_or(body);
    let mut calls = Vec::new();
    for part in body.split(CALL).skip(1) {
        let part = part.split(END).next().unwrap_or(part);
        let (kind, rest) = part.split_once(SEP)?;
        let (name, args) = match rest.split_once("\n```json") {
            // R1: `function<sep>NAME\n```json\n{...}\n````
            Some((name, args)) if kind.trim() == "function" => {
                let args = args.trim();
                (name.trim(), args.strip_suffix("```").unwrap_or(args).trim())
            }
            // V3.1: `NAME<sep>{...}`
            _ => (kind.trim(), rest.trim()),
        };
        let json = first_json(args)?;
        if json.len() != args.len() {
            return None;
        }
        calls.push(call(name, serde_json::from_str(json).ok()?));
    }
    (!calls.is_empty()).then(|| (text[..first].trim().to_string(), calls))
}

/// Llama 3.1's `<|python_tag|>{"name": ..., "parameters": {...}}` calls (`;` or another tag
/// between calls), text before the first.
pub fn python_tag(text: &str) -> Option<(String, Vec<RawCall>)> {
    const TAG: &str = "<|python_tag|>";
    let first = text.find(TAG)?;
    let mut calls = Vec::new();
    for part in text[first..].split(TAG).skip(1) {
        let mut rest = part.trim();
        while !rest.is_empty() {
            let json = first_json(rest)?;
            let v: Value = serde_json::from_str(json).ok()?;
            let name = v.get("name")?.as_str()?.to_string();
            let args = v.get("parameters").or_else(|| v.get("arguments"))?.clone();
            calls.push(call(name, args));
            rest = rest[json.len()..].trim_start();
            rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
        }
    }
    (!calls.is_empty()).then(|| (text[..first].trim().to_string(), calls))
}

/// gpt-oss's harmony messages: the final channel's text and the calls (none is fine: the text
/// is then the answer). An analysis message after the first (reasoning between calls) is not
/// the answer's; the first is split off as reasoning before (pinfer::reasoning).
pub fn harmony(text: &str) -> Option<(String, Vec<RawCall>)> {
    const TO: &str = "to=functions.";
    let mut content = String::new();
    let mut calls = Vec::new();
    for message in text.split("<|start|>assistant").filter(|m| !m.trim().is_empty()) {
        let (header, body) = message.split_once("<|message|>")?;
        let end = ["<|end|>", "<|call|>", "<|return|>"].iter().filter_map(|m| body.find(m)).min();
        let body = &body[..end.unwrap_or(body.len())];
        if let Some(at) = header.find(TO) {
            let name = header[at + TO.len()..].split(|c: char| c.is_whitespace() || c == '<').next()?;
            let args = body.trim();
            let json = first_json(args)?;
            if json.len() != args.len() {
                return None;
            }
            calls.push(call(name, serde_json::from_str(json).ok()?));
        } else if !header.contains("<|channel|>analysis") {
            content.push_str(body);
        }
    }
    Some((content.trim().to_string(), calls))
}

/// The first JSON value at the start of `s` (a model may write text after it).
fn first_json(s: &str) -> Option<&str> {
    let mut stream = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    stream.next()?.ok()?;
    Some(&s[..stream.byte_offset()])
}

fn json_array_calls(json: &str, name: &str, args: &str) -> Option<Vec<RawCall>> {
    let list: Vec<Value> = serde_json::from_str(json).ok()?;
    let calls: Option<Vec<RawCall>> = list
        .iter()
        .map(|c| {
            let n = c.get(name)?.as_str()?.to_string();
            let a = match c.get(args) {
                Some(Value::String(s)) => serde_json::from_str(s).ok()?,
                Some(a @ Value::Object(_)) => a.clone(),
                None => Value::Object(Map::new()),
                Some(_) => return None,
            };
            // (Mistral writes "id", Command R7B "tool_call_id".)
            let id =
                c.get("id").or_else(|| c.get("tool_call_id")).and_then(Value::as_str).map(str::to_string);
            Some(RawCall { id, ..call(n, a) })
        })
        .collect();
    calls.filter(|c| !c.is_empty())
}

/// A small reader of Python call lists and literals (strings, numbers, True/False/None, lists,
/// dicts), into JSON.
struct Py<'a> {
    s: &'a [u8],
    at: usize,
}

impl Py<'_> {
    fn space(&mut self) {
        while self.s.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn eat(&mut self, b: u8) -> bool {
        self.space();
        if self.s.get(self.at) == Some(&b) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Option<String> {
        self.space();
        let start = self.at;
        while self
            .s
            .get(self.at)
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
        {
            self.at += 1;
        }
        (self.at > start).then(|| String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }

    fn call_list(&mut self) -> Option<Vec<RawCall>> {
        let bracketed = self.eat(b'[');
        let mut calls = Vec::new();
        loop {
            let name = self.ident()?;
            if !self.eat(b'(') {
                return None;
            }
            let mut args = Map::new();
            if !self.eat(b')') {
                loop {
                    let key = self.ident()?;
                    if !self.eat(b'=') {
                        return None;
                    }
                    args.insert(key, self.value(0)?);
                    if self.eat(b')') {
                        break;
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            calls.push(call(name, Value::Object(args)));
            if !self.eat(b',') {
                break;
            }
        }
        if bracketed && !self.eat(b']') {
            return None;
        }
        Some(calls)
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 64 {
            return None;
        }
        self.space();
        match *self.s.get(self.at)? {
            q @ (b'"' | b'\'') => self.string(q).map(Value::String),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Some(Value::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.eat(b']') {
                        return Some(Value::Array(items));
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            b'{' => {
                self.at += 1;
                let mut map = Map::new();
                if self.eat(b'}') {
                    return Some(Value::Object(map));
                }
                loop {
                    self.space();
                    let key = match self.value(depth + 1)? {
                        Value::String(k) => k,
                        other => other.to_string(),
                    };
                    if !self.eat(b':') {
                        return None;
                    }
                    map.insert(key, self.value(depth + 1)?);
                    if self.eat(b'}') {
                        return Some(Value::Object(map));
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            _ => {
                let start = self.at;
                while self.s.get(self.at).is_some_and(|c| {
                    !matches!(c, b',' | b')' | b']' | b'}' | b':') && !c.is_ascii_whitespace()
                }) {
                    self.at += 1;
                }
                match std::str::from_utf8(&self.s[start..self.at]).ok()? {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    word => serde_json::from_str::<serde_json::Number>(word).ok().map(Value::Number),
                }
            }
        }
    }

    /// A quoted string with Python's common escapes.
    fn string(&mut self, quote: u8) -> Option<String> {
        self.at += 1;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.at)?;
            self.at += 1;
            match c {
                c if c == quote => return String::from_utf8(out).ok(),
                b'\\' => {
                    let e = *self.s.get(self.at)?;
                    self.at += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A parse's calls as (name, arguments).
    fn plain(parsed: Option<(String, Vec<RawCall>)>) -> Option<(String, Vec<(String, Value)>)> {
        parsed.map(|(text, calls)| (text, calls.into_iter().map(|c| (c.name, c.arguments)).collect()))
    }

    #[test]
    fn each_family_s_syntax_parses() {
        // The ids the families write are kept.
        let ids = |p: Option<(String, Vec<RawCall>)>| {
            p.map(|(_, c)| c.into_iter().map(|c| c.id).collect::<Vec<_>>())
        };
        assert_eq!(
            ids(mistral(r#"[TOOL_CALLS]f[CALL_ID]abc123def[ARGS]{}[TOOL_CALLS]g[ARGS]{}"#)),
            Some(vec![Some("abc123def".into()), None])
        );
        assert_eq!(
            ids(mistral(r#"[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "xyz789uvw"}]"#)),
            Some(vec![Some("xyz789uvw".into())])
        );
        let paris = ("get_weather".to_string(), json!({"city": "Paris"}));
        assert_eq!(
            plain(mistral(
                r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]"#
            )),
            Some((String::new(), vec![paris.clone()]))
        );
        assert_eq!(
            plain(mistral(
                r#"Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}"#
            )),
            Some(("Let me check.".into(), vec![paris.clone(), ("f".into(), json!({}))]))
        );
        assert_eq!(
            plain(marked_array(
                r#"<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
                "<|tool_call|>",
                None,
                "name",
                "arguments"
            )),
            Some((String::new(), vec![paris.clone()]))
        );
        assert_eq!(
            plain(marked_array(
                r#"<|tool_call|>[{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}]<|/tool_call|>"#,
                "<|tool_call|>",
                Some("<|/tool_call|>"),
                "name",
                "arguments"
            )),
            Some((String::new(), vec![paris.clone()]))
        );
        assert_eq!(
            plain(marked_array(
                r#"<|START_THINKING|>I look it up.<|END_THINKING|><|START_ACTION|>[
    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
]<|END_ACTION|>"#,
                "<|START_ACTION|>",
                Some("<|END_ACTION|>"),
                "tool_name",
                "parameters"
            )),
            Some(("<|START_THINKING|>I look it up.<|END_THINKING|>".into(), vec![paris.clone()]))
        );
        assert_eq!(
            plain(pythonic(
                r#"<|tool_call_start|>[get_weather(city="Paris"), set(n=1.5, on=True, tags=['a', "b"], x=None, m={'k': 2})]<|tool_call_end|>Checking."#
            )),
            Some((
                String::new(),
                vec![
                    paris.clone(),
                    (
                        "set".into(),
                        json!({"n": 1.5, "on": true, "tags": ["a", "b"], "x": null, "m": {"k": 2}})
                    )
                ]
            ))
        );
        let xml = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                   <parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            plain(qwen_xml(xml, |_, key| key != "days")),
            Some((
                "Sure.".into(),
                vec![("get_weather".into(), json!({"city": "Paris", "days": 3, "zip": "75001"}))]
            ))
        );
        // Broken calls are no calls.
        assert_eq!(plain(mistral("[TOOL_CALLS][{\"name\": 3}]")), None);
        assert_eq!(plain(pythonic("<|tool_call_start|>[get_weather(city=)]<|tool_call_end|>")), None);
        assert_eq!(plain(pythonic("<|tool_call_start|>[f(a=1) junk]<|tool_call_end|>")), None);
        assert_eq!(plain(qwen_xml("<tool_call>{\"name\": \"f\"}</tool_call>", |_, _| true)), None);
    }
}
