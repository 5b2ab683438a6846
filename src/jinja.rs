//! The model's own chat template (`tokenizer.chat_template`, Jinja), rendered as Hugging Face
//! transformers' `apply_chat_template` renders it: the way the template's authors tested it.
//!
//! The set-up is transformers' (`utils/chat_template_utils.py`), on the `minijinja` engine:
//! - `trim_blocks` and `lstrip_blocks`, loop controls (`break`, `continue`), a sandbox in which
//!   values cannot be mutated (`list.append` fails, as in jinja2's `ImmutableSandboxedEnvironment`);
//! - `{% generation %}...{% endgeneration %}` renders its body (transformers uses the block to mark
//!   the assistant's tokens; the text is the same);
//! - `tojson` is Python's `json.dumps(x, ensure_ascii=False, indent=, separators=, sort_keys=)`
//!   (no HTML escaping, `", "` and `": "` between items);
//! - globals `raise_exception(message)`, `strftime_now(format)`; Python's string, dict and list
//!   methods (`.strip()`, `.split()`, `.items()`, ...) from `minijinja-contrib`;
//! - values print as Python prints them (`None`, `True`, `['a', 1]`, `{'k': 'v'}`);
//! - render variables `messages`, `tools` and `documents` (None when absent),
//!   `add_generation_prompt`, `bos_token`, `eos_token`, and the caller's keyword arguments
//!   (`enable_thinking`, `reasoning_effort`, anything the template reads).
//!
//! A template is code from a file: every render runs on a budget ([`FUEL`] instructions and data,
//! [`RECURSION_LIMIT`] nesting, [`MAX_OUTPUT`] bytes of text) and fails with a clear error past it.
//! `tests/chat_jinja.rs` renders each of llama.cpp's 70 real templates against a set of
//! conversations and compares with Python's jinja2 byte for byte.

use std::borrow::ToOwned;
use std::fmt;
use std::format;
use std::string::{String, ToString};
use std::time::{SystemTime, UNIX_EPOCH};
use std::vec;
use std::vec::Vec;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::Value as Json;

/// Instructions and data one render may use (minijinja's fuel: about one per instruction and one
/// per 64 bytes created). A 2 KB Qwen3 template with 5 tools and 20 messages uses well under a
/// hundredth of it.
pub const FUEL: u64 = 20_000_000;
/// Nesting of loops, conditions and macro calls.
pub const RECURSION_LIMIT: usize = 200;
/// The longest prompt text a render may produce: far beyond any context pinfer plans.
pub const MAX_OUTPUT: usize = 16 << 20;

/// The name under which the template lives in its environment.
const NAME: &str = "chat_template";

/// Why a template cannot be used, or a conversation cannot be rendered with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateError {
    /// The template does not parse (its source is broken, or uses syntax minijinja lacks).
    Compile(String),
    /// The template refused the conversation with `raise_exception(message)`: the message is the
    /// template's own, for the user.
    Raised(String),
    /// Rendering failed (an unknown filter or method, a type error, an undefined attribute...).
    Render(String),
    /// The render ran out of its budget (a loop without end, unbounded recursion or text).
    Budget(String),
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Compile(m) => write!(f, "the chat template does not compile: {m}"),
            Self::Raised(m) => write!(f, "the chat template refused the conversation: {m}"),
            Self::Render(m) => write!(f, "the chat template failed: {m}"),
            Self::Budget(m) => write!(f, "the chat template exceeded its budget: {m}"),
        }
    }
}

impl std::error::Error for TemplateError {}

/// The message of `raise_exception`, carried as the source of minijinja's error so that a
/// template's own refusal is told apart from a failure of the template.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// What a render is given: the conversation in OpenAI's message shape (any extra fields, such as
/// `tool_calls` or `reasoning_content`, reach the template as they are).
#[derive(Clone, Copy, Debug)]
pub struct Conversation<'a> {
    /// The messages (a JSON array of objects).
    pub messages: &'a Json,
    /// The tools (a JSON array), or None.
    pub tools: Option<&'a Json>,
    /// Documents for retrieval templates (a JSON array), or None.
    pub documents: Option<&'a Json>,
    /// End with the header of the assistant's turn.
    pub add_generation_prompt: bool,
    /// The request's `chat_template_kwargs` (`enable_thinking`, ...): extra render variables.
    pub kwargs: Option<&'a serde_json::Map<String, Json>>,
}

/// A wall-clock instant for `strftime_now`, in UTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    /// Seconds since 1970-01-01 00:00:00 UTC.
    pub unix_seconds: i64,
}

impl Clock {
    /// Now.
    pub fn now() -> Self {
        let unix_seconds = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        Self { unix_seconds }
    }
}

/// A compiled chat template with the model's special tokens.
pub struct JinjaTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JinjaTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl JinjaTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts of the model's BOS and EOS
    /// tokens (empty when it has none).
    pub fn compile(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TemplateError::Compile(e.to_string()))?,
        );
        env.set_fuel(Some(FUEL));
        env.set_recursion_limit(RECURSION_LIMIT);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            let mut text = String::new();
            python_str(&mut text, value);
            out.write_str(&text).map_err(|_| Error::new(ErrorKind::WriteFailure, "output"))
        });
        env.add_filter("tojson", tojson);
        // Python: None, numbers and booleans are not iterable; jinja2's Undefined is (as empty).
        env.add_test("iterable", |v: &Value| {
            !matches!(v.kind(), ValueKind::None | ValueKind::Bool | ValueKind::Number) && v.try_iter().is_ok()
        });
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, without_generation_blocks(source))
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        Ok(Self { env, bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned() })
    }

    /// Renders a conversation, with `strftime_now` reading the wall clock.
    pub fn render(&self, conversation: &Conversation<'_>) -> Result<String, TemplateError> {
        self.render_at(conversation, Clock::now())
    }

    /// Renders a conversation with `strftime_now` reading `clock` (tests fix it).
    pub fn render_at(&self, conversation: &Conversation<'_>, clock: Clock) -> Result<String, TemplateError> {
        let template = self.env.get_template(NAME).map_err(|e| TemplateError::Compile(describe(&e)))?;
        let mut vars: Vec<(String, Value)> = vec![
            ("messages".into(), from_json(conversation.messages)),
            ("tools".into(), conversation.tools.map_or(Value::from(()), from_json)),
            ("documents".into(), conversation.documents.map_or(Value::from(()), from_json)),
            ("add_generation_prompt".into(), Value::from(conversation.add_generation_prompt)),
            ("bos_token".into(), Value::from(self.bos_token.as_str())),
            ("eos_token".into(), Value::from(self.eos_token.as_str())),
            (
                "strftime_now".into(),
                Value::from_function(move |format: &str| strftime(format, clock.unix_seconds)),
            ),
        ];
        // The caller's keyword arguments come last and win, as in transformers (`**kwargs`).
        for (k, v) in conversation.kwargs.into_iter().flatten() {
            vars.retain(|(name, _)| name != k);
            vars.push((k.clone(), from_json(v)));
        }
        let context = Value::from_pairs(vars);
        let mut out = CappedWriter { text: Vec::new(), full: false };
        match template.render_captured_to(context, &mut out) {
            Ok(_) => {
                String::from_utf8(out.text).map_err(|_| TemplateError::Render("output is not UTF-8".into()))
            }
            Err(_) if out.full => {
                Err(TemplateError::Budget(format!("the prompt text passed {MAX_OUTPUT} bytes")))
            }
            Err(e) => Err(classify(&e)),
        }
    }
}

/// Collects the output and refuses past [`MAX_OUTPUT`].
struct CappedWriter {
    text: Vec<u8>,
    full: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > MAX_OUTPUT {
            self.full = true;
            return Err(std::io::Error::other("chat template output too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error as the user should read it: minijinja's kind and detail, and the template's line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    // minijinja's Display already names the template and line ("... (in chat_template:12)").
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

fn classify(e: &Error) -> TemplateError {
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        if let Some(raised) = inner.downcast_ref::<Raised>() {
            return TemplateError::Raised(raised.0.clone());
        }
        source = inner.source();
    }
    match e.kind() {
        ErrorKind::OutOfFuel => {
            TemplateError::Budget(format!("more than {FUEL} steps (a loop without end?)"))
        }
        // minijinja reports its recursion limit as an invalid operation naming it.
        _ if e.to_string().contains("recursion limit") => {
            TemplateError::Budget(format!("nesting deeper than {RECURSION_LIMIT}"))
        }
        _ => TemplateError::Render(describe(e)),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, "raise_exception").with_source(Raised(message)))
}

/// `{% generation %}` and `{% endgeneration %}` (transformers' extension) become an always-true
/// `if` block with the same whitespace control, so the body renders exactly as it would there.
fn without_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // (The close is searched after the opening: `{%}` opens without closing.)
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            break;
        };
        let inner = &tag[2..end];
        let (left, body) = inner.strip_prefix(['-', '+']).map_or(("", inner), |b| (&inner[..1], b));
        let (body, right) =
            body.strip_suffix(['-', '+']).map_or((body, ""), |b| (b, &body[body.len() - 1..]));
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{left} if true {right}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{left} endif {right}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// JSON as minijinja values; objects keep their key order (Python dicts do).
fn from_json(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(from_json).collect::<Vec<_>>()),
        Json::Object(map) => Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), from_json(v)))),
    }
}

/// Python's `str(value)`: strings as they are, everything else as `repr`.
fn python_str(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(v.as_str().unwrap_or_default()),
        _ => python_repr(out, v),
    }
}

/// Python's `repr(value)` for the values JSON and templates make.
fn python_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => match v.as_i64() {
            Some(i) if !is_float(v) => out.push_str(&i.to_string()),
            _ => out.push_str(&python_float(f64::try_from(v.clone()).unwrap_or(f64::NAN))),
        },
        ValueKind::String => python_quote(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key);
                out.push_str(": ");
                python_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

fn is_float(v: &Value) -> bool {
    v.as_i64().is_none() || v.to_string().contains(['.', 'e', 'E', 'i', 'n'])
}

/// Python's float repr: the shortest digits that read back, `1.0` for integral values,
/// exponents as `1e-05`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let exp = if x == 0.0 { 0 } else { x.abs().log10().floor() as i32 };
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        // Rust writes 1e-5 / 1.5e20; Python 1e-05 / 1.5e+20.
        let s = format!("{x:e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
        format!("{mantissa}e{sign}{digits:0>2}")
    }
}

/// Python's string repr: single quotes unless the text has a single quote and no double one.
fn python_quote(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(state: &State, value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be a pair")),
            }
        }
        // Python's defaults: ", " without indentation, "," with it.
        _ => (if indent.is_some() { "," } else { ", " }.to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&mut out, value, 0)?;
    // Charge the text's size: a template looping over tojson of a large value pays for it.
    state.consume_fuel((out.len() / 64) as u64)?;
    Ok(Value::from(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        if depth > RECURSION_LIMIT {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: value nested too deep"));
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if is_float(v) {
                    let x = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&match python_float(x).as_str() {
                        "nan" => "NaN".to_owned(),
                        "inf" => "Infinity".to_owned(),
                        "-inf" => "-Infinity".to_owned(),
                        s => s.to_owned(),
                    });
                } else {
                    out.push_str(&v.to_string());
                }
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1)?;
                }
                self.newline(out, depth);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    match key.as_str() {
                        Some(k) => self.string(out, k),
                        None => self.string(out, &key.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, depth + 1)?;
                }
                self.newline(out, depth);
                out.push('}');
            }
            _ => self.string(out, &v.to_string()),
        }
        Ok(())
    }

    /// A JSON string as Python's json module writes it.
    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `datetime.strftime` for the directives chat templates use (`%d %b %Y`, `%B`, `%A`,
/// `%H:%M`, ...), in UTC; an unknown directive is written as it is, as glibc does.
fn strftime(format: &str, unix_seconds: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        match d {
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:>2}")),
            'm' => out.push_str(&format!("{month:02}")),
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'b' | 'h' => out.push_str(&MONTHS[month as usize - 1][..3]),
            'B' => out.push_str(MONTHS[month as usize - 1]),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'F' => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            'T' => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(month) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day counted from 1970-01-01 (the inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_and_print_as_python_does() {
        for days in [-800_000, -1, 0, 59, 60, 365, 10_957, 20_468, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        // 2026-01-15 09:30:00 UTC, a Thursday.
        let t = days_from_civil(2026, 1, 15) * 86_400 + 9 * 3600 + 30 * 60;
        assert_eq!(strftime("%d %b %Y", t), "15 Jan 2026");
        assert_eq!(strftime("%A, %B %d, %Y %H:%M:%S %j %%", t), "Thursday, January 15, 2026 09:30:00 015 %");
    }

    #[test]
    fn python_reprs() {
        let mut s = String::new();
        python_repr(&mut s, &from_json(&serde_json::json!({"a": [1, 2.5, true, null], "b": "it's"})));
        assert_eq!(s, r#"{'a': [1, 2.5, True, None], 'b': "it's"}"#);
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(1.5e20), "1.5e+20");
    }

    #[test]
    fn generation_blocks_keep_their_whitespace_control() {
        assert_eq!(
            without_generation_blocks("a{%- generation -%}b{% endgeneration %}{{ x }}{%+ if y %}"),
            "a{%- if true -%}b{% endif %}{{ x }}{%+ if y %}"
        );
        // A tag that opens and closes in three characters is no tag (found by the fuzz test).
        assert_eq!(without_generation_blocks("{%} endif %}"), "{%} endif %}");
    }
}
