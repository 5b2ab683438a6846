//! `pinfer serve` end to end: the real binary on a free port with the default model, spoken to
//! over plain HTTP/1.1 (the Python `openai`, `ollama` and `anthropic` clients are exercised by
//! scripts/serve_clients.py, which `./x test` runs too).

mod cli_support;
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

use cli_support::{pinfer, pinfer_command, repo_file, spawn_server, temp_file, text_of, through_qemu};
use serde_json::{json, Value};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// A running server, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    /// Starts `pinfer serve --port 0 ARGS` and waits until /health answers 200.
    fn start(args: &[&str]) -> Self {
        Self::start_with(args, &[])
    }

    /// As [`start`](Self::start) with environment variables set.
    fn start_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_model(&repo_file(MODEL), args, env)
    }

    /// As [`start_with`](Self::start_with) with the model at `model`.
    fn start_model(model: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = pinfer_command();
        cmd.envs(env.iter().copied());
        cmd.args(["serve", "-m", model, "--port", "0", "-t", "2"]).args(args);
        let (child, port) = spawn_server(cmd);
        let server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let r = server.request("GET", "/health", None, &[]);
            if r.status == 200 {
                break;
            }
            assert_eq!(r.status, 503, "health while loading: {}", r.body);
            assert!(Instant::now() < deadline, "the model did not load in time");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    /// One request on a new connection; the whole response.
    fn request(&self, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) -> Response {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        if let Some(b) = body {
            // A server that answers before reading everything (413) may close early.
            let _ = s.write_all(b);
        }
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        Response::parse(&raw)
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, Some(body.to_string().as_bytes()), &[])
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Response {
    status: u16,
    headers: String,
    body: String,
}

impl Response {
    fn parse(raw: &[u8]) -> Self {
        let text = String::from_utf8_lossy(raw);
        let (head, rest) =
            text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
        let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
        let body = if chunked { dechunk(rest) } else { rest.to_string() };
        Self { status, headers: head.to_string(), body }
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The JSON objects of an SSE stream's `data:` lines (without `[DONE]`), and whether it ended
    /// with `[DONE]`.
    fn sse(&self) -> (Vec<Value>, bool) {
        let mut events = Vec::new();
        let mut done = false;
        for line in self.body.lines() {
            if let Some(data) = line.strip_prefix("data: ") {
                if data == "[DONE]" {
                    done = true;
                } else {
                    assert!(!done, "data after [DONE]");
                    events.push(
                        serde_json::from_str(data).unwrap_or_else(|e| panic!("bad chunk ({e}): {data}")),
                    );
                }
            }
        }
        (events, done)
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// The error object of a response, checked for llama-server's shape and `status`.
fn error_of(r: &Response, status: u16, kind: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert_eq!(e["code"], json!(status), "{v}");
    assert_eq!(e["type"], json!(kind), "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    e.clone()
}

fn greedy(prompt: &str, n: usize) -> Value {
    json!({ "prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": false })
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
];

/// How much of the suite to run: under qemu every token is slow.
fn scale() -> usize {
    if through_qemu().is_some() {
        1
    } else {
        4
    }
}

/// Greedy completions of [`PROMPTS`], one after the other, then all at once.
fn sequential_and_concurrent(server: &Server, n: usize) -> (Vec<String>, Vec<String>) {
    let content = |r: Response| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["content"].as_str().unwrap().to_string()
    };
    let sequential = PROMPTS.iter().map(|p| content(server.post("/completion", &greedy(p, n)))).collect();
    let concurrent = std::thread::scope(|s| {
        let handles: Vec<_> =
            PROMPTS.iter().map(|p| s.spawn(move || server.post("/completion", &greedy(p, n)))).collect();
        handles.into_iter().map(|h| content(h.join().unwrap())).collect()
    });
    (sequential, concurrent)
}

/// Concurrent requests run as one batch per step (their prompts in one chunk, then their decode
/// steps together), each sequence attending only to its own cache: every kernel path's per-row
/// arithmetic does not depend on the batch (`tests/kernels_simd.rs` checks the matmuls bit for
/// bit), so the tokens are exactly those of sequential requests, on the default kernels.
#[test]
fn batched_decode_is_exact() {
    let server = Server::start(&["-np", "4", "-c", "2048"]);
    let (sequential, concurrent) = sequential_and_concurrent(&server, 16);
    assert_eq!(concurrent, sequential);
}

/// Lookup decoding in the server (`--lookup N`): concurrent requests carry guesses in one batch,
/// and each gets the text it gets without them, greedy and sampled (as above); the timings count
/// the guesses.
#[test]
fn lookup_gives_the_same_texts_in_a_shared_batch() {
    // A text that repeats itself: guesses from its first tokens on (12 tokens under qemu).
    let repeat = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,";
    let n = 12 * scale();
    let ok = |r: Response| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    // Two greedy requests at once, then a sampled one alone. (Sampled requests running beside
    // others do not repeat their text from run to run even without guesses: see the closing note
    // of issue 26.)
    let texts = |server: &Server| -> Vec<Value> {
        let mut out: Vec<Value> = std::thread::scope(|s| {
            let handles: Vec<_> = [repeat, PROMPTS[1]]
                .map(|p| s.spawn(move || server.post("/completion", &greedy(p, n))))
                .into_iter()
                .collect();
            handles.into_iter().map(|h| ok(h.join().unwrap())).collect()
        });
        let sampled = json!({ "prompt": repeat, "n_predict": n, "temperature": 0.9, "seed": 7 });
        out.push(ok(server.post("/completion", &sampled)));
        out
    };
    let plain = texts(&Server::start(&["-np", "2", "-c", "1024"]));
    let looked = texts(&Server::start(&["-np", "2", "-c", "1024", "--lookup", "4"]));
    for (p, l) in plain.iter().zip(&looked) {
        assert_eq!(l["content"], p["content"]);
        assert!(p["timings"].get("draft_n").is_none(), "{p}");
    }
    let t = &looked[0]["timings"];
    assert!(t["draft_n"].as_u64().unwrap() > 0 && t["draft_n_accepted"].as_u64().unwrap() > 0, "{t}");
    // A draft model is for generate and chat; a recurrent model cannot go back to a guess.
    let model = repo_file(MODEL);
    let out = pinfer(&["serve", "-m", &model, "--port", "0", "-md", &model]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert!(text_of(&out.stderr).contains("--lookup N"), "{}", text_of(&out.stderr));
}

#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn completions_match_generate_and_reuse_the_cache() {
    let n = 8 * scale();
    let server = Server::start(&["-np", "4", "-c", "2048"]);
    let first = server.post("/completion", &greedy(PROMPTS[0], n));
    assert_eq!(first.status, 200, "{}", first.body);
    let model = repo_file(MODEL);
    let out = pinfer(&[
        "generate",
        "-m",
        &model,
        "-p",
        PROMPTS[0],
        "-n",
        &n.to_string(),
        "--temp",
        "0",
        "--no-display-prompt",
        "-t",
        "2",
    ]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    assert_eq!(text_of(&out.stdout).trim_end_matches('\n'), first.json()["content"].as_str().unwrap());
    // Concurrent requests all complete, with as many tokens as asked.
    let (_, concurrent) = sequential_and_concurrent(&server, n);
    assert!(concurrent.iter().all(|t| !t.is_empty()), "{concurrent:?}");

    // A chat's next turn reuses the slot's cache: only the new tokens are evaluated.
    let chat = |messages: Value| {
        let r = server.post(
            "/v1/chat/completions",
            &json!({ "messages": messages, "temperature": 0, "max_tokens": n, "id_slot": 0 }),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let first = chat(json!([{ "role": "user", "content": "Name a fruit." }]));
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let second = chat(json!([
        { "role": "user", "content": "Name a fruit." },
        { "role": "assistant", "content": reply },
        { "role": "user", "content": "And a vegetable?" },
    ]));
    let cached = second["timings"]["cache_n"].as_u64().unwrap();
    assert!(cached >= first["usage"]["prompt_tokens"].as_u64().unwrap(), "{second}");
}

#[test]
fn openai_and_ollama_shapes() {
    let n = 6;
    let server = Server::start(&["-np", "2", "-c", "1024"]);
    let messages = json!([{ "role": "user", "content": "What is the capital of France?" }]);
    let body = json!({ "messages": messages, "temperature": 0, "max_tokens": n, "logprobs": true, "top_logprobs": 2 });
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let whole = r.json();
    assert_eq!(whole["object"], "chat.completion");
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], json!(n));
    let lp = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), n);
    for t in lp {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], t["token"]);
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }

    // Streaming: the role first, then the text, then finish_reason, usage, [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({ "include_usage": true });
    let r = server.post("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200);
    assert!(r.headers.to_ascii_lowercase().contains("text/event-stream"), "{}", r.headers);
    let (chunks, done) = r.sse();
    assert!(done);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    let last = &chunks[chunks.len() - 2];
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[chunks.len() - 1]["usage"]["completion_tokens"], json!(n));

    // A stop string ends the text before it.
    let full = choice["message"]["content"].as_str().unwrap();
    if let Some(word) = full.split_whitespace().nth(2) {
        let mut stop = body.clone();
        stop["stop"] = json!([word]);
        let r = server.post("/v1/chat/completions", &stop).json();
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        let got = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(full.starts_with(got) && !got.contains(word), "{got:?} vs {full:?} stop {word:?}");
        // The native endpoint names the stop string that ended it (first listed among others).
        let native = json!({ "prompt": "Hi", "n_predict": n, "temperature": 0 });
        let first = server.post("/completion", &native).json();
        let text = first["content"].as_str().unwrap();
        if let Some(word) = text.split_whitespace().nth(1) {
            let mut native = native.clone();
            native["stop"] = json!(["never-appears-here", word]);
            let r = server.post("/completion", &native).json();
            assert_eq!((&r["stop_type"], &r["stopping_word"]), (&json!("word"), &json!(word)), "{r}");
        }
    }

    // Legacy completions.
    let r = server
        .post("/v1/completions", &json!({ "prompt": "Hello", "max_tokens": 3, "temperature": 0 }))
        .json();
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["usage"]["completion_tokens"], json!(3));

    // Ollama: NDJSON by default, the last line done with durations.
    let r = server.post(
        "/api/chat",
        &json!({ "model": "x", "messages": messages, "options": { "temperature": 0, "num_predict": n } }),
    );
    assert_eq!(r.status, 200);
    let lines: Vec<Value> = r.body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let end = lines.last().unwrap();
    assert_eq!(end["done"], json!(true));
    assert_eq!(end["done_reason"], "length");
    assert_eq!(end["eval_count"], json!(n));
    let text: String = lines.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    assert_eq!(text, full);
    let e = server.post("/api/chat", &json!({ "messages": "hi" }));
    assert_eq!(e.status, 400);
    assert!(e.json()["error"].as_str().unwrap().contains("messages"), "{}", e.body);
    let load = server.post("/api/chat", &json!({ "model": "x", "messages": [] })).json();
    assert_eq!(load["done_reason"], "load");
    let r = server
        .post("/api/generate", &json!({ "prompt": "Hi", "stream": false, "options": { "num_predict": 2 } }))
        .json();
    assert_eq!(r["done"], json!(true));
    assert!(r["context"].as_array().is_some_and(|c| !c.is_empty()));
    for path in ["/api/tags", "/api/ps"] {
        let r = server.request("GET", path, None, &[]).json();
        assert_eq!(r["models"][0]["details"]["format"], "gguf", "{path}: {r}");
    }
    assert!(server.request("GET", "/api/version", None, &[]).json()["version"].is_string());
    assert!(server.request("GET", "/v1/models", None, &[]).json()["data"][0]["id"].is_string());

    // llama-server's extras.
    let ids = server.post("/tokenize", &json!({ "content": "Hello world" })).json()["tokens"].clone();
    assert!(ids.as_array().is_some_and(|a| !a.is_empty()));
    let text = server.post("/detokenize", &json!({ "tokens": ids })).json()["content"].clone();
    assert_eq!(text, "Hello world");
    let prompt = server.post("/apply-template", &json!({ "messages": messages })).json()["prompt"].clone();
    assert!(prompt.as_str().unwrap().contains("What is the capital of France?"));
    assert_eq!(server.request("GET", "/props", None, &[]).json()["total_slots"], json!(2));
    assert_eq!(server.request("GET", "/slots", None, &[]).json().as_array().unwrap().len(), 2);
    error_of(&server.request("GET", "/metrics", None, &[]), 501, "not_supported_error");
    error_of(&server.post("/slots/0?action=erase", &json!({})), 501, "not_supported_error");
}

#[test]
fn bad_requests_get_clear_errors_and_never_hurt_the_server() {
    let server = Server::start(&["-np", "2", "-c", "256", "--body-limit", "65536", "-n", "2", "--metrics"]);
    let reference = server.post("/completion", &greedy(PROMPTS[0], 4)).json()["content"].clone();

    let e = error_of(
        &server.request("POST", "/v1/chat/completions", Some(b"{not json"), &[]),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("not valid JSON"), "{e}");
    let e = error_of(
        &server.post("/completion", &json!({ "prompt": "x", "temperature": "hot" })),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("temperature"), "{e}");
    let e = error_of(
        &server.post("/v1/chat/completions", &json!({ "messages": "hi" })),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("messages"), "{e}");
    let long = "word ".repeat(600);
    let e =
        error_of(&server.post("/completion", &json!({ "prompt": long })), 400, "exceed_context_size_error");
    assert!(e["n_prompt_tokens"].as_u64().unwrap() > 128 && e["n_ctx"] == json!(128), "{e}");
    // Grammars and schemas that cannot be used, and constraints given twice: 400s naming why.
    let bad = [
        (json!({ "prompt": "x", "grammar": "root ::= \"a\" b" }), "line 1, column 14"),
        (json!({ "prompt": "x", "json_schema": { "type": "strin" } }), "strin"),
        (json!({ "prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {} }), "one constraint"),
        (json!({ "prompt": "x", "grammar": "root ::= ((\"a\"{2000}){2000}){2000}" }), "expands"),
    ];
    for (body, needle) in bad {
        let e = error_of(&server.post("/completion", &body), 400, "invalid_request_error");
        assert!(e["message"].as_str().unwrap().contains(needle), "{body}: {e}");
    }
    let e = error_of(
        &server.post(
            "/v1/chat/completions",
            &json!({ "messages": [{"role": "user", "content": "x"}],
            "response_format": { "type": "xml" } }),
        ),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("response_format.type"), "{e}");
    let e = error_of(
        &server.post("/v1/chat/completions", &json!({ "messages": [{"role": "user", "content": "x"}],
            "tools": [{ "type": "function", "function": { "name": "f" } }], "tool_choice": { "type": "function",
            "function": { "name": "g" } } })),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("\"g\""), "{e}");
    error_of(&server.request("GET", "/no/such/path", None, &[]), 404, "not_found_error");
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(70_000));
    error_of(&server.request("POST", "/completion", Some(big.as_bytes()), &[]), 413, "invalid_request_error");
    let metrics = server.request("GET", "/metrics", None, &[]);
    assert!(metrics.body.contains("llamacpp:tokens_predicted_total"), "{}", metrics.body);

    // Random and mutated bodies: every answer is a response (never a 500 or a dropped
    // connection), and afterwards the server still gives the same greedy output.
    let seeds = [
        json!({ "prompt": "Hi", "n_predict": 1, "temperature": 0.5, "top_k": 5, "stop": ["x"], "logit_bias": { "42": -1.0 } }),
        json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 1, "logprobs": true, "top_logprobs": 1 }),
        json!({ "model": "m", "messages": [{ "role": "user", "content": "Hi" }], "options": { "num_predict": 1, "seed": 3 } }),
        json!({ "content": "Hello", "tokens": [1, 2, 3], "with_pieces": true }),
    ];
    let paths = [
        "/completion",
        "/v1/chat/completions",
        "/api/chat",
        "/tokenize",
        "/v1/completions",
        "/detokenize",
        "/api/generate",
        "/apply-template",
    ];
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let cases = 500 * scale();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..cases {
        let seed = seeds[i % seeds.len()].to_string().into_bytes();
        let body = mutate(seed, &mut next);
        let path = paths[(next() % paths.len() as u64) as usize];
        let r = server.request("POST", path, Some(&body), &[]);
        assert!(r.status < 500, "{path} {:?}: {} {}", String::from_utf8_lossy(&body), r.status, r.body);
        if r.status != 200 && path.starts_with("/api/") {
            // Ollama's shape: {"error": "message"}.
            assert!(r.json()["error"].as_str().is_some_and(|m| !m.is_empty()), "{path}: {}", r.body);
        } else if r.status != 200 {
            error_of(&r, r.status, r.json()["error"]["type"].as_str().unwrap_or("?"));
        }
        *statuses.entry(r.status).or_insert(0) += 1;
    }
    assert!(statuses.len() > 1, "the mutations never reached past the parser: {statuses:?}");
    assert_eq!(server.request("GET", "/health", None, &[]).status, 200);
    assert_eq!(server.post("/completion", &greedy(PROMPTS[0], 4)).json()["content"], reference);
}

/// A mutation of a JSON body: byte flips, cuts, insertions of JSON fragments, or a field's value
/// replaced by one of another type.
fn mutate(mut b: Vec<u8>, next: &mut impl FnMut() -> u64) -> Vec<u8> {
    const FRAGMENTS: [&str; 14] = [
        "null",
        "-1",
        "1e309",
        "\"\"",
        "[]",
        "{}",
        "true",
        "\"\\ud800\"",
        "9999999999999999999",
        "[[1,false]]",
        "{\"a\":",
        "\u{fffd}",
        "0.5",
        "\"stop\"",
    ];
    for _ in 0..=(next() % 3) {
        let at = if b.is_empty() { 0 } else { (next() % b.len() as u64) as usize };
        match next() % 5 {
            0 if !b.is_empty() => b[at] ^= 1 << (next() % 8),
            1 => b.truncate(at),
            2 => {
                let f = FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize].as_bytes();
                b.splice(at..at, f.iter().copied());
            }
            3 => {
                // Replace the value after a colon.
                if let Some(colon) = b[at..].iter().position(|&c| c == b':').map(|p| at + p + 1) {
                    let end = b[colon..]
                        .iter()
                        .position(|&c| c == b',' || c == b'}')
                        .map_or(b.len(), |p| colon + p);
                    let f = FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize].as_bytes();
                    b.splice(colon..end, f.iter().copied());
                }
            }
            _ => b.insert(at, (next() % 256) as u8),
        }
    }
    b
}

#[test]
fn api_keys_guard_everything_but_health_and_models() {
    let server = Server::start(&["--api-key", "sesame", "-n", "2"]);
    assert_eq!(server.request("GET", "/health", None, &[]).status, 200);
    assert_eq!(server.request("GET", "/v1/models", None, &[]).status, 200);
    let body = greedy("Hi", 2).to_string();
    error_of(&server.request("POST", "/completion", Some(body.as_bytes()), &[]), 401, "authentication_error");
    let wrong = [("Authorization", "Bearer open")];
    error_of(
        &server.request("POST", "/completion", Some(body.as_bytes()), &wrong),
        401,
        "authentication_error",
    );
    let right = [("Authorization", "Bearer sesame")];
    assert_eq!(server.request("POST", "/completion", Some(body.as_bytes()), &right).status, 200);
    let header = [("x-api-key", "sesame")];
    assert_eq!(server.request("POST", "/completion", Some(body.as_bytes()), &header).status, 200);
}

#[test]
fn sigterm_stops_the_server_cleanly() {
    let mut server = Server::start(&[]);
    let pid = server.child.id() as i32;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { kill(pid, 15) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        assert!(Instant::now() < deadline, "pinfer serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn the_openai_ollama_and_anthropic_python_clients_work_unchanged() {
    if through_qemu().is_some() {
        return; // the protocol is the same on every CPU: checked on the host tier
    }
    let server = Server::start(&["-c", "1024"]);
    let out = std::process::Command::new("python3")
        .arg(repo_file("scripts/serve_clients.py"))
        .arg(format!("http://127.0.0.1:{}", server.port))
        .output()
        .expect("running python3 (scripts/setup.sh installs it and the pinned clients)");
    assert!(
        out.status.success() && text_of(&out.stdout).contains("serve_clients: ok"),
        "stdout: {}\nstderr: {}",
        text_of(&out.stdout),
        text_of(&out.stderr)
    );
}

#[test]
fn slots_are_saved_restored_and_erased() {
    let dir = std::env::temp_dir().join(format!("pinfer-slots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = Server::start(&["-np", "2", "-c", "1024", "--slot-save-path", dir.to_str().unwrap()]);
    // An empty slot saves and restores as empty.
    let empty = server.post("/slots/0?action=save", &json!({ "filename": "empty.bin" })).json();
    assert_eq!(empty["n_saved"], json!(0), "{empty}");
    let back = server.post("/slots/0?action=restore", &json!({ "filename": "empty.bin" })).json();
    assert_eq!(back["n_restored"], json!(0), "{back}");
    let ask = |slot: usize| {
        let body = json!({ "prompt": PROMPTS[1], "n_predict": 6, "temperature": 0, "id_slot": slot });
        let r = server.post("/completion", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let first = ask(0);
    let saved = server.post("/slots/0?action=save", &json!({ "filename": "s0.bin" })).json();
    assert!(saved["n_saved"].as_u64().unwrap() > 0, "{saved}");
    assert!(dir.join("s0.bin").exists());
    let erased = server.post("/slots/0?action=erase", &json!({})).json();
    assert_eq!(erased["n_erased"], saved["n_saved"]);
    let restored = server.post("/slots/1?action=restore", &json!({ "filename": "s0.bin" })).json();
    assert_eq!(restored["n_restored"], saved["n_saved"], "{restored}");
    // The restored cache serves the same prompt: all but its last token come from it.
    let again = ask(1);
    assert_eq!(again["content"], first["content"]);
    assert!(
        again["tokens_cached"].as_u64().unwrap() + 1 >= again["tokens_evaluated"].as_u64().unwrap(),
        "{again}"
    );

    let mut bytes = std::fs::read(dir.join("s0.bin")).unwrap();
    bytes[50] ^= 1;
    std::fs::write(dir.join("bad.bin"), &bytes).unwrap();
    let e = error_of(
        &server.post("/slots/0?action=restore", &json!({ "filename": "bad.bin" })),
        400,
        "invalid_request_error",
    );
    assert!(e["message"].as_str().unwrap().contains("checksum"), "{e}");
    error_of(
        &server.post("/slots/0?action=save", &json!({ "filename": "../escape.bin" })),
        400,
        "invalid_request_error",
    );
    error_of(&server.post("/slots/9?action=erase", &json!({})), 400, "invalid_request_error");
    error_of(&server.post("/slots/0?action=fly", &json!({})), 400, "invalid_request_error");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve --context-shift`: a request runs past its slot's full context as `generate
/// --context-shift` does (the same tokens); without it, it ends there with finish_reason length.
#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn context_shift_lets_a_request_outrun_its_slot() {
    let n = 100;
    let server = Server::start(&["-np", "1", "-c", "64", "--context-shift"]);
    let r = server.post("/completion", &greedy(PROMPTS[1], n));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["tokens_predicted"], json!(n), "{}", r.body);
    let model = repo_file(MODEL);
    let args =
        ["generate", "-m", &model, "-p", PROMPTS[1], "-n", "100", "--temp", "0", "--no-display-prompt"];
    let out = pinfer(&[&args[..], &["-t", "2", "-c", "64", "--context-shift"]].concat());
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    let content = r.json()["content"].as_str().unwrap().to_string();
    assert_eq!(text_of(&out.stdout).trim_end_matches('\n'), content.trim_end_matches('\n'));
    drop(server);
    let server = Server::start(&["-np", "1", "-c", "64"]);
    let r =
        server.post("/v1/completions", &json!({ "prompt": PROMPTS[1], "max_tokens": n, "temperature": 0 }));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length", "{}", r.body);
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() < n as u64, "{}", r.body);
}

/// With `--no-jinja`, a model whose chat template no built-in format renders is refused at
/// start-up, the template's family named, with a non-zero exit (it was served as ChatML without a
/// word); `--chat-template chatml` serves it, and so does its own template run as Jinja (the
/// default). The one policy is `PromptFormat::choose`, as the CLI's.
#[test]
fn an_unrenderable_chat_template_is_refused_at_start_unless_one_is_named() {
    // A template llama.cpp recognises as zephyr's by its markers; pinfer does not render it.
    let zephyr = "{% for m in messages %}<|user|>\n{{ m.content }}<|endoftext|>\n{% endfor %}";
    let bytes = common::tiny_model("qwen3").kv("tokenizer.chat_template", common::Val::str(zephyr)).bytes();
    let model = temp_file("zephyr-template.gguf", &bytes);
    let model = model.to_str().unwrap();

    let out = pinfer_command()
        .args(["serve", "-m", model, "--port", "0", "-t", "2", "--no-jinja"])
        .output()
        .unwrap();
    let err = text_of(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for words in [model, "'zephyr' format", "does not implement", "--chat-template"] {
        assert!(err.contains(words), "the refusal should say {words:?}: {err}");
    }
    assert!(!err.contains("model loaded"), "{err}");

    let server = Server::start_model(model, &["--no-jinja", "--chat-template", "chatml"], &[]);
    assert_eq!(server.request("GET", "/health", None, &[]).status, 200);
    drop(server);
    let server = Server::start_model(model, &[], &[]);
    let r = server.post("/apply-template", &json!({ "messages": [{"role": "user", "content": "Hi"}] }));
    assert_eq!(r.json()["prompt"], "<|user|>\nHi<|endoftext|>\n", "{}", r.body);
}

/// The model's own Jinja template renders the chats (SmolLM2's adds its default system message),
/// with the request's `chat_template_kwargs`; a template's refusal is a 400 with its message and
/// the server keeps serving; `--no-jinja` keeps the built-in format; a template that does not
/// compile stops the server at start-up naming the ways out.
#[test]
fn chats_render_through_the_model_s_jinja_template() {
    let user = json!([{"role": "user", "content": "Hi"}]);
    let server = Server::start(&[]);
    let r = server.post("/apply-template", &json!({ "messages": user }));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["prompt"],
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let r = server.post("/apply-template", &json!({ "messages": user, "add_generation_prompt": false }));
    assert!(!r.json()["prompt"].as_str().unwrap().ends_with("assistant\n"), "{}", r.body);
    let props = server.request("GET", "/props", None, &[]).json();
    assert_eq!(props["chat_template_name"], "jinja");
    // SmolLM2's template writes a system message, and knows nothing of tools.
    assert_eq!(
        props["chat_template_caps"],
        json!({ "supports_system_role": true, "supports_tools": false, "supports_tool_calls": false,
                "supports_thinking": false })
    );
    drop(server);

    let server = Server::start(&["--no-jinja"]);
    let r = server.post("/apply-template", &json!({ "messages": user }));
    assert_eq!(r.json()["prompt"], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "{}", r.body);
    drop(server);

    let template = temp_file(
        "strict.jinja",
        b"{% if messages[0].role != 'system' %}{{ raise_exception('start with a system message') }}{% endif %}\
          {% for m in messages %}[{{ m.role }}:{{ m.content }}\
          {% if m.tool_calls %} calls {{ m.tool_calls[0].function.arguments | tojson }}{% endif %}]{% endfor %}\
          {{ mood | default('') }}",
    );
    let server = Server::start(&["--chat-template-file", template.to_str().unwrap(), "-n", "4"]);
    let r = server.post("/v1/chat/completions", &json!({ "messages": user }));
    let e = error_of(&r, 400, "invalid_request_error");
    assert!(e["message"].as_str().unwrap().contains("start with a system message"), "{e}");
    let conversation = json!([
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}}
        ]},
    ]);
    let r = server.post(
        "/apply-template",
        &json!({ "messages": conversation, "chat_template_kwargs": { "mood": "calm" } }),
    );
    // OpenAI's JSON-text arguments reach the template as an object.
    assert_eq!(r.json()["prompt"], "[system:S][assistant: calls {\"city\": \"Paris\"}]calm", "{}", r.body);
    let r = server.post("/v1/chat/completions", &json!({ "messages": [{"role": "system", "content": "S"}] }));
    assert_eq!(r.status, 200, "the server keeps serving: {}", r.body);
    drop(server);

    let broken = temp_file("broken.jinja", b"{% if %}");
    let model = repo_file(MODEL);
    let out =
        pinfer(&["serve", "-m", &model, "--port", "0", "--chat-template-file", broken.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text_of(&out.stderr);
    assert!(stderr.contains("does not compile") && stderr.contains("--no-jinja"), "{stderr}");
}

/// A thinking template's reasoning goes to `reasoning_content` (OpenAI, whole and streamed) and
/// Ollama's `thinking`, the same text `reasoning_format: "none"` leaves in the content. The
/// template here opens the reasoning in its generation prompt (as DeepSeek R1's does), so
/// SmolLM2's whole greedy reply, which never closes it, is reasoning.
#[test]
fn thinking_is_split_out_of_the_reply() {
    let template = temp_file(
        "thinking.jinja",
        b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
          {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}{# closed by </think> #}",
    );
    let server =
        Server::start(&["--chat-template-file", template.to_str().unwrap(), "--temp", "0", "-n", "12"]);
    let messages = json!([{"role": "user", "content": "Why is the sky blue?"}]);
    let plain =
        server.post("/v1/chat/completions", &json!({ "messages": messages, "reasoning_format": "none" }));
    let text = plain.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty() && !text.contains("</think>"), "{text:?}");
    let r = server.post("/v1/chat/completions", &json!({ "messages": messages }));
    let m = &r.json()["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], text.trim(), "{m}");
    assert_eq!(m["content"], "", "{m}");
    let r = server.post("/v1/chat/completions", &json!({ "messages": messages, "stream": true }));
    let (events, done) = r.sse();
    assert!(done);
    let streamed: String =
        events.iter().filter_map(|e| e["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    assert_eq!(streamed, text);
    assert!(events.iter().all(|e| e["choices"][0]["delta"]["content"].as_str().is_none_or(str::is_empty)));
    let r = server.post("/api/chat", &json!({ "model": "m", "messages": messages, "stream": false }));
    assert_eq!(r.json()["message"]["thinking"], text.trim(), "{}", r.body);
    let r = server.post("/api/chat", &json!({ "model": "m", "messages": messages, "think": "maybe" }));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"].as_str().is_some_and(|e| e.contains("'think'")), "{}", r.body);
}

/// `tool_choice: "required"` in each tool family's own syntax: a template that teaches the
/// family's marker makes the server constrain SmolLM2's reply to that syntax from its first token,
/// and parse the call back into OpenAI's `tool_calls`.
#[test]
fn required_tool_calls_in_every_family_s_syntax() {
    // (Each family's template is a small ChatML one naming its marker, which is how the family is
    // recognised; whole and streamed replies must give the same call.)
    let tools = json!([{ "type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": { "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] } } }]);
    let families = [
        ("<tool_call>", "hermes"),
        ("<tool_call><function=", "qwen3-coder"),
        ("[TOOL_CALLS]", "mistral"),
        ("<|tool_call|>", "granite"),
        ("<|START_ACTION|>", "command-r7b"),
        ("<|tool_call_start|>", "lfm2"),
        ("<function=", "functionary-v3.1"),
        (">>>all", "functionary-v3.2"),
        ("<｜tool▁calls▁begin｜>", "deepseek-r1"),
        ("<|channel|>commentary to=functions.", "gpt-oss"),
    ];
    for (marker, family) in families {
        let text = format!(
            "{{% for m in messages %}}<|im_start|>{{{{ m.role }}}}\n{{{{ m.content }}}}<|im_end|>\n{{% endfor %}}\
             {{% if tools %}}<|im_start|>system\nTools: {{{{ tools | tojson }}}}; call them with {marker}<|im_end|>\n{{% endif %}}\
             <|im_start|>assistant\n"
        );
        let template = temp_file(&format!("{family}.jinja"), text.as_bytes());
        // (DeepSeek's full-width markers are many SmolLM2 tokens each.)
        let limit = if family == "deepseek-r1" { "160" } else { "64" };
        let server = Server::start(&["--chat-template-file", template.to_str().unwrap(), "-n", limit]);
        let r = server.post(
            "/v1/chat/completions",
            &json!({ "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                     "tool_choice": "required", "parallel_tool_calls": false, "temperature": 0 }),
        );
        let m = &r.json()["choices"][0]["message"];
        let call = &m["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather", "{family}: {}", r.body);
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{family}: {args}");
        assert_eq!(r.json()["choices"][0]["finish_reason"], "tool_calls", "{family}");
        // Streamed: the call's deltas (a header with its id and name, then its arguments) give the
        // same call, and no marker reaches the content.
        let r = server.post(
            "/v1/chat/completions",
            &json!({ "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                     "tool_choice": "required", "parallel_tool_calls": false, "temperature": 0, "stream": true }),
        );
        let (chunks, done) = r.sse();
        let (mut name, mut arguments, mut content, mut finish) = (None, String::new(), String::new(), None);
        for c in &chunks {
            let choice = &c["choices"][0];
            content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
                assert_eq!(d["index"], 0, "{family}: {d}");
                if let Some(id) = d["id"].as_str() {
                    assert!(name.is_none() && !id.is_empty() && d["type"] == "function", "{family}: {d}");
                    name = d["function"]["name"].as_str().map(str::to_string);
                }
                arguments.push_str(d["function"]["arguments"].as_str().unwrap_or(""));
            }
            finish = choice["finish_reason"].as_str().map(str::to_string).or(finish);
        }
        assert!(done, "{family}: {}", r.body);
        assert_eq!(name.as_deref(), Some("get_weather"), "{family}: {}", r.body);
        assert_eq!(serde_json::from_str::<Value>(&arguments).unwrap(), args, "{family}: {}", r.body);
        assert_eq!((content.as_str(), finish.as_deref()), ("", Some("tool_calls")), "{family}: {}", r.body);
    }
}

/// Conversations a template cannot take are 400s with the reason, on every chat route, and a
/// 10 MB message is refused (beyond the body limit, or the context), never a crash: the server
/// keeps serving.
#[test]
fn chat_messages_templates_cannot_take_are_refused() {
    let server = Server::start(&[]);
    let bad = [
        json!([{ "content": "no role" }]),
        json!([{ "role": "user", "content": 5 }]),
        json!([{ "role": "wizard", "content": "x" }]),
        json!([{ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": "x" } }] }]),
        json!("not a list"),
    ];
    for messages in bad {
        for route in ["/v1/chat/completions", "/apply-template", "/api/chat"] {
            let r = server.post(route, &json!({ "model": "m", "messages": messages, "stream": false }));
            assert_eq!(r.status, 400, "{route} {messages}: {}", r.body);
        }
        let r = server.post("/v1/messages", &json!({ "max_tokens": 4, "messages": messages }));
        assert_eq!(r.status, 400, "/v1/messages {messages}: {}", r.body);
    }
    let huge = "word ".repeat(2_000_000);
    let r =
        server.post("/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": huge }] }));
    assert!(matches!(r.status, 400 | 413), "{}", &r.body[..r.body.len().min(300)]);
    assert_eq!(server.request("GET", "/health", None, &[]).status, 200);
}

/// Standard base64 of `bytes` (the tests' images in requests).
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            out.push(if k <= c.len() { ABC[(n >> (18 - 6 * k) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

fn vision_golden_text(stem: &str) -> String {
    let path = repo_file(&format!("tests/golden/vision/gemma3/{stem}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    v["greedy_text"].as_str().unwrap().to_string()
}

/// A tiny Gemma 3 with its projector: an OpenAI `image_url` (a data: URI or raw base64) and
/// Ollama's `images` on /api/chat and /api/generate give llama-mtmd-cli's text for the image;
/// `/props`, `/v1/models` and `/api/show` say the model takes images.
#[test]
fn images_in_openai_and_ollama_requests_give_llama_mtmd_cli_s_text() {
    let model = repo_file("models/tiny-vlm/gemma3/model.gguf");
    let mmproj = repo_file("models/tiny-vlm/gemma3/mmproj.gguf");
    let server = Server::start_model(&model, &["--mmproj", &mmproj, "-c", "1024", "--parallel", "2"], &[]);
    for stem in ["rgba_41x29", "gray_37x53"] {
        let png = base64(&std::fs::read(repo_file(&format!("tests/vision/images/{stem}.png"))).unwrap());
        let want = vision_golden_text(stem);
        for url in [format!("data:image/png;base64,{png}"), png.clone()] {
            let r = server.post(
                "/v1/chat/completions",
                &json!({ "messages": [{ "role": "user", "content": [
                    { "type": "image_url", "image_url": { "url": url } },
                    { "type": "text", "text": "describe" },
                ] }], "max_tokens": 8, "temperature": 0 }),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(r.json()["choices"][0]["message"]["content"], want, "{stem}: openai");
        }
        let r = server.post(
            "/api/chat",
            &json!({ "model": "m", "stream": false, "options": { "temperature": 0, "num_predict": 8 },
                "messages": [{ "role": "user", "content": "describe", "images": [png] }] }),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["message"]["content"], want, "{stem}: ollama chat");
        let r = server.post(
            "/api/generate",
            &json!({ "model": "m", "stream": false, "prompt": "describe", "images": [png],
                "options": { "temperature": 0, "num_predict": 8 } }),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["response"], want, "{stem}: ollama generate");
    }
    // A text turn after an image keeps working (the slot's cache is kept only before the image).
    let r = server.post(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "describe" }], "max_tokens": 4, "temperature": 0 }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(server.request("GET", "/props", None, &[]).json()["modalities"]["vision"], true);
    let shown = server.post("/api/show", &json!({ "model": "m" })).json();
    assert!(shown["capabilities"].as_array().unwrap().contains(&json!("vision")), "{shown}");
    if through_qemu().is_some() {
        return; // the protocol is the same on every CPU: the clients run on the host tier
    }
    let out = std::process::Command::new("python3")
        .arg(repo_file("scripts/vision_clients.py"))
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg(repo_file("tests/vision/images/rgba_41x29.png"))
        .arg(repo_file("tests/golden/vision/gemma3/rgba_41x29.json"))
        .output()
        .expect("running python3 (scripts/setup.sh installs it and the pinned clients)");
    assert!(
        out.status.success() && text_of(&out.stdout).contains("vision_clients: ok"),
        "stdout: {}\nstderr: {}",
        text_of(&out.stdout),
        text_of(&out.stderr)
    );
}

/// Images the server cannot take get a 400 naming the problem (remote URLs, bad base64, not an
/// image, a 60000 x 60000 PNG, an image for a model served without a projector), and it keeps
/// serving.
#[test]
fn bad_images_get_clear_errors_and_never_hurt_the_server() {
    let model = repo_file("models/tiny-vlm/gemma3/model.gguf");
    let mmproj = repo_file("models/tiny-vlm/gemma3/mmproj.gguf");
    let png = std::fs::read(repo_file("tests/vision/images/rgb_1x1.png")).unwrap();
    let huge = cli_support::png_declaring(&png, 60000, 60000);
    let chat = |url: &str| {
        json!({ "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": url } }, { "type": "text", "text": "hi" } ] }],
            "max_tokens": 2 })
    };
    let with = Server::start_model(&model, &["--mmproj", &mmproj, "-c", "512"], &[]);
    let cases = [
        ("https://example.com/cat.jpg".to_string(), "data: URI"),
        ("file:///etc/passwd".to_string(), "--media-path"),
        ("data:image/png;base64,%%%".to_string(), "not base64"),
        (format!("data:image/png;base64,{}", base64(b"this is not an image")), "not an image"),
        (format!("data:image/png;base64,{}", base64(&png[..png.len() / 2])), "truncated or corrupt"),
        (format!("data:image/png;base64,{}", base64(&huge)), "60000x60000"),
    ];
    for (url, needle) in cases {
        let r = with.post("/v1/chat/completions", &chat(&url));
        assert_eq!(r.status, 400, "{needle}: {}", r.body);
        assert!(r.body.contains(needle), "{needle}: {}", r.body);
    }
    let r = with.post(
        "/api/chat",
        &json!({ "model": "m", "stream": false,
        "messages": [{ "role": "user", "content": "hi", "images": [7] }] }),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(with.request("GET", "/health", None, &[]).status, 200);
    let without = Server::start_model(&model, &["-c", "512"], &[]);
    let r = without.post("/v1/chat/completions", &chat(&format!("data:image/png;base64,{}", base64(&png))));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("--mmproj"), "{}", r.body);
    assert_eq!(without.request("GET", "/props", None, &[]).json()["modalities"]["vision"], false);
}
