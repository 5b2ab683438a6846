//! What every endpoint shares: llama.cpp's error shape, the request body read with its limits,
//! typed access to JSON fields with errors that name the field, and the sampling fields common to
//! the OpenAI, llama.cpp and Ollama requests.

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use pinfer::grammar::GrammarSpec;

use super::slots::GenParams;
use super::State;

/// An error as llama-server sends it: `{"error": {"code", "message", "type"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// Extra fields of the error object (`n_prompt_tokens`, `n_ctx`).
    pub extra: Vec<(&'static str, Value)>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), extra: Vec::new() }
    }
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    /// 500 `server_error`.
    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
    /// 503 `unavailable_error`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", message)
    }
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", "File Not Found")
    }
    /// 400 `exceed_context_size_error`: the prompt does not fit a slot's context.
    pub fn exceeds_context(n_prompt: usize, n_ctx: usize) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!("the request exceeds the available context size ({n_prompt} prompt tokens, context {n_ctx}), try increasing it"),
        );
        e.extra = vec![("n_prompt_tokens", json!(n_prompt)), ("n_ctx", json!(n_ctx))];
        e
    }

    /// The error as Ollama sends it: `{"error": "message"}`.
    pub fn ollama(self) -> Response {
        let body = json!({ "error": self.message }).to_string();
        (self.status, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], body).into_response()
    }

    /// The error as Anthropic's API sends it: `{"type": "error", "error": {"type", "message"}}`.
    pub fn anthropic(self) -> Response {
        let kind = match self.status.as_u16() {
            400 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        let body = json!({ "type": "error", "error": { "type": kind, "message": self.message } }).to_string();
        (self.status, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], body).into_response()
    }

    pub fn body(&self) -> Value {
        let mut error = Map::new();
        error.insert("code".into(), json!(self.status.as_u16()));
        error.insert("message".into(), json!(self.message));
        error.insert("type".into(), json!(self.kind));
        for (k, v) in &self.extra {
            error.insert((*k).into(), v.clone());
        }
        json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], self.body().to_string())
            .into_response()
    }
}

/// A JSON response.
pub fn json_response(value: &Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], value.to_string())
        .into_response()
}

/// Reads the request body (at most the server's limit: 413 past it, 408 past the read timeout)
/// and parses it as a JSON object (400 otherwise).
pub async fn read_json(state: &State<'_>, body: Body) -> Result<Map<String, Value>, ApiError> {
    let limit = state.opts.body_limit;
    let bytes = match tokio::time::timeout(state.opts.timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout_error",
                "reading the request body timed out",
            ))
        }
        Ok(Err(e)) => {
            // `to_bytes` fails on a body over the limit or a broken connection.
            let mut over = false;
            let mut cause: Option<&dyn std::error::Error> = Some(&e);
            while let Some(c) = cause {
                over |= c.to_string().contains("length limit");
                cause = c.source();
            }
            return Err(if over {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    format!("the request body exceeds {limit} bytes"),
                )
            } else {
                ApiError::invalid(format!("reading the request body: {e}"))
            });
        }
        Ok(Ok(b)) => b,
    };
    if bytes.is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid("the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!("the request body is not valid JSON: {e}"))),
    }
}

/// Typed reads of a request's fields: a field of the wrong type is a 400 naming it; `null` is
/// the same as absent.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    /// Where these fields are (`""`, `"options."`), for messages.
    path: &'static str,
}

impl<'a> Fields<'a> {
    pub fn new(map: &'a Map<String, Value>) -> Self {
        Self { map, path: "" }
    }
    pub fn nested(map: &'a Map<String, Value>, path: &'static str) -> Self {
        Self { map, path }
    }
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }
    fn wrong(&self, name: &str, what: &str) -> ApiError {
        ApiError::invalid(format!("'{}{name}' must be {what}", self.path))
    }
    pub fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x.abs() <= f64::from(f32::MAX) => Ok(Some(x as f32)),
                _ => Err(self.wrong(name, "a number")),
            },
        }
    }
    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_f64()) {
                (Some(x), _) => Ok(Some(x)),
                // 5.0 is accepted as 5 (JSON has one number type).
                (None, Some(x)) if x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(Some(x as i64)),
                _ => Err(self.wrong(name, "an integer")),
            },
        }
    }
    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.wrong(name, "true or false")),
        }
    }
    pub fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.wrong(name, "a string")),
        }
    }
    pub fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(_) => Err(self.wrong(name, "an object")),
        }
    }
    pub fn array(&self, name: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => Err(self.wrong(name, "an array")),
        }
    }
    /// A string or an array of strings (`stop`).
    pub fn strings(&self, name: &str) -> Result<Vec<String>, ApiError> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| self.wrong(name, "a string or an array of strings"))
                })
                .collect(),
            Some(_) => Err(self.wrong(name, "a string or an array of strings")),
        }
    }
    /// A count: an integer in `0..=max`.
    pub fn count(&self, name: &str, max: usize) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            None => Ok(None),
            Some(n) if n >= 0 && n as u64 <= max as u64 => Ok(Some(n as usize)),
            Some(_) => Err(self.wrong(name, &format!("an integer from 0 to {max}"))),
        }
    }
}

/// Which API a request came through (they spell the same settings differently).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Llama,
    Ollama,
}

/// The generation settings of a request: the server's defaults (from its command line), then the
/// request's fields. Ollama's sit under `options`.
pub fn gen_params(
    state: &State<'_>,
    body: &Map<String, Value>,
    dialect: Dialect,
) -> Result<GenParams, ApiError> {
    let top = Fields::new(body);
    let options = top.object("options")?;
    let f = match (dialect, options) {
        (Dialect::Ollama, Some(o)) => Fields::nested(o, "options."),
        (Dialect::Ollama, None) => Fields::nested(&state.ready.empty, "options."),
        (Dialect::OpenAi | Dialect::Llama, _) => Fields::new(body),
    };
    let mut p = state.ready.defaults.clone();
    let s = &mut p.sampler;
    if let Some(t) = f.f32("temperature")? {
        if t < 0.0 {
            return Err(ApiError::invalid(format!("'{}temperature' must be 0 or more", f.path)));
        }
        s.temperature = t;
    }
    if let Some(k) = f.i64("top_k")? {
        s.top_k = u32::try_from(k.max(0)).unwrap_or(u32::MAX);
    }
    for (name, field) in [("top_p", &mut s.top_p), ("min_p", &mut s.min_p)] {
        if let Some(v) = f.f32(name)? {
            if !(0.0..=1.0).contains(&v) {
                return Err(ApiError::invalid(format!("'{}{name}' must be from 0 to 1", f.path)));
            }
            *field = v;
        }
    }
    if let Some(v) = f.f32("repeat_penalty")? {
        s.repeat_penalty = v;
    }
    if let Some(n) = f.i64("repeat_last_n")? {
        // -1: the whole context, as llama.cpp.
        s.repeat_last_n = if n < 0 { u32::MAX } else { u32::try_from(n).unwrap_or(u32::MAX) };
    }
    if let Some(v) = f.f32("presence_penalty")? {
        s.presence_penalty = v;
    }
    if let Some(v) = f.f32("frequency_penalty")? {
        s.frequency_penalty = v;
    }
    if let Some(seed) = f.i64("seed")? {
        s.seed = if seed < 0 { crate::gen_args::random_seed() } else { seed as u64 };
    }
    s.validate().map_err(|e| ApiError::invalid(e.to_string()))?;
    let limit_names: &[&str] = match dialect {
        Dialect::OpenAi => &["max_completion_tokens", "max_tokens", "n_predict"],
        Dialect::Llama => &["n_predict", "max_tokens"],
        Dialect::Ollama => &["num_predict"],
    };
    for name in limit_names {
        if let Some(n) = f.i64(name)? {
            p.n_predict = if n < 0 { None } else { Some(n as usize) };
            break;
        }
    }
    let stops = f.strings("stop")?;
    if !stops.is_empty() {
        p.stops = stops;
    }
    if let Some(b) = top.bool("ignore_eos")? {
        p.ignore_eos = b;
    }
    // Tokens a context shift keeps (the server's --context-shift decides whether one happens).
    if let (Some(_), Some(n)) =
        (p.n_keep, f.i64(if dialect == Dialect::Ollama { "num_keep" } else { "n_keep" })?)
    {
        if n < -1 {
            return Err(ApiError::invalid(format!("'n_keep' {n}: give a count, or -1 (the whole prompt)")));
        }
        p.n_keep = Some(n);
    }
    if let Some(b) = top.bool("cache_prompt")? {
        p.cache_prompt = b;
    }
    if let Some(n) = top.i64("id_slot")? {
        p.id_slot = usize::try_from(n).ok();
        if let Some(i) = p.id_slot {
            if i >= state.ready.n_slots {
                return Err(ApiError::invalid(format!(
                    "'id_slot' {i}: the server has {} slots",
                    state.ready.n_slots
                )));
            }
        }
    }
    if let Some(n) = top.count("n_probs", 100)? {
        p.n_probs = n;
    }
    if dialect == Dialect::OpenAi {
        let logprobs = match top.get("logprobs") {
            // Legacy completions: an integer count.
            Some(Value::Number(_)) => top.count("logprobs", 20)?.map(|n| n.max(1)),
            _ => top.bool("logprobs")?.filter(|&b| b).map(|_| 1),
        };
        if let Some(n) = logprobs {
            p.n_probs = top.count("top_logprobs", 20)?.unwrap_or(0).max(n.min(20)).max(1);
        }
        if let Some(n) = top.i64("n")? {
            if n != 1 {
                return Err(ApiError::invalid("'n': only one choice per request is supported (n = 1)"));
            }
        }
    }
    p.logit_bias = logit_bias(state, &top)?;
    if let Some(g) = grammar(&top, dialect)? {
        p.grammar = Some(g);
    }
    if let Some(list) = top.array("samplers")? {
        apply_samplers(&mut p, list)?;
    }
    Ok(p)
}

/// The grammar a request asks for: OpenAI's `response_format` (`json_object`, `json_schema`),
/// llama-server's `grammar` (GBNF) and `json_schema` fields (every dialect but Ollama's), Ollama's
/// `format` (`"json"` or a schema). Compiled when the request is submitted.
fn grammar(f: &Fields<'_>, dialect: Dialect) -> Result<Option<GrammarSpec>, ApiError> {
    let schema = |v: &Value| GrammarSpec::JsonSchema(v.to_string());
    let mut found = Vec::new();
    if dialect == Dialect::Ollama {
        match f.get("format") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(Value::String(s)) if s == "json" => found.push(GrammarSpec::JsonObject),
            Some(v @ Value::Object(_)) => found.push(schema(v)),
            Some(_) => return Err(ApiError::invalid("'format' must be \"json\" or a JSON schema object")),
        }
    } else {
        if let Some(g) = f.str("grammar")? {
            if !g.trim().is_empty() {
                found.push(GrammarSpec::Gbnf(g.to_string()));
            }
        }
        match f.get("json_schema") {
            None | Some(Value::Null) => {}
            Some(v @ (Value::Object(_) | Value::Bool(_))) => found.push(schema(v)),
            Some(_) => return Err(ApiError::invalid("'json_schema' must be a JSON schema object")),
        }
    }
    if dialect == Dialect::OpenAi {
        if let Some(rf) = f.object("response_format")? {
            let rf = Fields::nested(rf, "response_format.");
            match rf.str("type")? {
                None | Some("text") => {}
                Some("json_object") => match rf.get("schema") {
                    // (llama-server also takes a schema here.)
                    Some(v @ Value::Object(_)) => found.push(schema(v)),
                    _ => found.push(GrammarSpec::JsonObject),
                },
                Some("json_schema") => {
                    let js = rf.object("json_schema")?;
                    let v = js.and_then(|o| o.get("schema")).or_else(|| rf.get("schema"));
                    match v {
                        Some(v @ (Value::Object(_) | Value::Bool(_))) => found.push(schema(v)),
                        _ => {
                            return Err(ApiError::invalid(
                                "'response_format.json_schema.schema' must be a JSON schema object",
                            ))
                        }
                    }
                }
                Some(t) => {
                    return Err(ApiError::invalid(format!(
                        "'response_format.type' {t:?}: give \"text\", \"json_object\" or \"json_schema\""
                    )))
                }
            }
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            "give one constraint: 'grammar', 'json_schema' or 'response_format', not several",
        ));
    }
    Ok(found.pop())
}

/// `logit_bias`: OpenAI's object `{"id": bias}`, or llama.cpp's list `[[id, bias], [id, false]]`
/// (`false` bans the token); a key may also be a token's text.
fn logit_bias(state: &State<'_>, f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "'logit_bias' must map token ids (or texts) to numbers, or be a list of [id, bias] pairs",
        )
    };
    // OpenAI's range is -100..100; `false` bans the token.
    let bias_of = |v: &Value| match v {
        Value::Bool(false) => Ok(f32::NEG_INFINITY),
        v => v.as_f64().filter(|x| x.is_finite()).map(|x| x.clamp(-100.0, 100.0) as f32).ok_or_else(bad),
    };
    let n_vocab = state.ready.n_vocab;
    let ids_of = |key: &Value| -> Result<Vec<u32>, ApiError> {
        match key {
            Value::Number(n) => {
                let id = n.as_u64().filter(|&i| i < n_vocab as u64).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "'logit_bias': token id {n} is outside the vocabulary ({n_vocab} tokens)"
                    ))
                })?;
                Ok(vec![id as u32])
            }
            Value::String(s) => match s.parse::<u64>() {
                Ok(id) if id < n_vocab as u64 => Ok(vec![id as u32]),
                Ok(id) => Err(ApiError::invalid(format!(
                    "'logit_bias': token id {id} is outside the vocabulary ({n_vocab} tokens)"
                ))),
                Err(_) => Ok(super::tokens::encode_plain(&state.ready.tok, s, false)),
            },
            _ => Err(bad()),
        }
    };
    let mut out = Vec::new();
    match f.get("logit_bias") {
        None => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let b = bias_of(v)?;
                for id in ids_of(&Value::String(k.clone()))? {
                    out.push((id, b));
                }
            }
        }
        Some(Value::Array(a)) => {
            for pair in a {
                let Some([k, v]) =
                    pair.as_array().map(Vec::as_slice).and_then(|s| <&[Value; 2]>::try_from(s).ok())
                else {
                    return Err(bad());
                };
                let b = bias_of(v)?;
                for id in ids_of(k)? {
                    out.push((id, b));
                }
            }
        }
        Some(_) => return Err(bad()),
    }
    Ok(out)
}

/// llama.cpp's `samplers`: the stages to run. pinfer's chain has a fixed order (penalties, top-k,
/// top-p, min-p, temperature); a stage left out of the list is turned off.
fn apply_samplers(p: &mut GenParams, list: &[Value]) -> Result<(), ApiError> {
    const KNOWN: [&str; 12] = [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "typical_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
        "infill",
        "k",
    ];
    let mut names = Vec::new();
    for v in list {
        let name =
            v.as_str().ok_or_else(|| ApiError::invalid("'samplers' must be an array of sampler names"))?;
        if !KNOWN.contains(&name) {
            return Err(ApiError::invalid(format!(
                "'samplers': unknown sampler {name:?} (known: penalties, top_k, top_p, min_p, temperature, ...)"
            )));
        }
        names.push(name);
    }
    let has = |n: &str| names.contains(&n);
    let s = &mut p.sampler;
    if !has("penalties") {
        (s.repeat_penalty, s.frequency_penalty, s.presence_penalty) = (1.0, 0.0, 0.0);
    }
    if !has("top_k") && !has("k") {
        s.top_k = 0;
    }
    if !has("top_p") {
        s.top_p = 1.0;
    }
    if !has("min_p") {
        s.min_p = 0.0;
    }
    if !has("temperature") {
        s.temperature = 1.0;
    }
    Ok(())
}

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Now as RFC 3339 in UTC with nanoseconds (Ollama's `created_at`).
pub fn rfc3339_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}
