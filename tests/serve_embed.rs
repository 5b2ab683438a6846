//! `pinfer serve` with an embedding model end to end: the real binary on the tiny BERT
//! (scripts/make_bert_tiny.py, `scripts/setup.sh tiny`; its words are `w0`..`w90`) over plain
//! HTTP/1.1. Every route's shape, its vectors against `pinfer::embed` on the same ids (and one
//! against `pinfer embed`), the refusals in each API's error shape, and the server still serving
//! after them; a generating model refuses the embedding routes.

mod cli_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

use cli_support::{pinfer, pinfer_command, repo_file, spawn_server, text_of};
use pinfer::embed::{embed_typed, EmbedOptions};
use pinfer::engine::embedding::Normalize;
use pinfer::loader::ModelFile;
use pinfer::model::Pooling;
use pinfer::session::{Session, SessionOptions};
use serde_json::{json, Value};

const BERT: &str = "models/tiny/bert-tiny.gguf";
const QWEN2: &str = "models/tiny/qwen2-tiny.gguf";

/// A running server, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

struct Response {
    status: u16,
    body: String,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// llama-server's error object: its type and message.
    fn error(&self) -> (String, String) {
        let v = self.json();
        let e = &v["error"];
        (e["type"].as_str().unwrap_or("").into(), e["message"].as_str().unwrap_or("").into())
    }
}

impl Server {
    fn start(model: &str, args: &[&str]) -> Self {
        let mut cmd = pinfer_command();
        cmd.args(["serve", "-m", &repo_file(model), "--port", "0", "-t", "2"]).args(args);
        let (child, port) = spawn_server(cmd);
        let server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(300);
        while server.request("GET", "/health", None).status != 200 {
            assert!(Instant::now() < deadline, "the model did not load in time");
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> Response {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        if let Some(b) = body {
            head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        if let Some(b) = body {
            let _ = s.write_all(b);
        }
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let text = String::from_utf8_lossy(&raw);
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not HTTP: {text:?}"));
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
        assert!(!head.to_ascii_lowercase().contains("chunked"), "a whole body: {head}");
        Response { status, body: rest.to_string() }
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, Some(body.to_string().as_bytes()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pinfer::embed` of `inputs` on the tiny BERT, in process.
fn reference(
    inputs: &[Vec<u32>],
    pooling: Option<Pooling>,
    normalize: Normalize,
) -> pinfer::embed::Embeddings {
    typed_reference(inputs, &[], pooling, normalize)
}

/// [`reference`] with each input's token types.
fn typed_reference(
    inputs: &[Vec<u32>],
    types: &[Vec<u32>],
    pooling: Option<Pooling>,
    normalize: Normalize,
) -> pinfer::embed::Embeddings {
    let model =
        ModelFile::open_static(std::path::Path::new(&repo_file(BERT))).expect("run scripts/setup.sh tiny");
    let logits_all = pooling == Some(Pooling::None);
    let opts =
        SessionOptions { n_batch: 128, n_seq: 4, logits_all, pooling, threads: 2, ..Default::default() };
    let mut session = Session::new(model, &opts).unwrap();
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let types: Vec<&[u32]> = types.iter().map(Vec::as_slice).collect();
    embed_typed(&mut session, &refs, &types, &EmbedOptions { normalize, truncate: false }).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (k, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= 1e-5, "{what}[{k}]: {a} vs {b}");
    }
}

/// "w1 w2" is [CLS] w1 w2 [SEP]: ids 2, 6, 7, 3.
fn ids(words: &[u32]) -> Vec<u32> {
    std::iter::once(2).chain(words.iter().map(|w| w + 5)).chain(std::iter::once(3)).collect()
}

#[test]
fn openai_and_llama_routes_give_the_vectors_of_embed() {
    let server = Server::start(BERT, &["--embedding"]);
    let inputs = vec![ids(&[1, 2]), ids(&[40]), vec![2, 10, 11, 12, 3]];
    let want = reference(&inputs, None, Normalize::Euclidean);
    let r = server
        .post("/v1/embeddings", &json!({ "input": ["w1 w2", "w40", [2, 10, 11, 12, 3]], "model": "m" }));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "m");
    assert_eq!(v["usage"]["prompt_tokens"], 4 + 3 + 5);
    assert_eq!(v["usage"]["total_tokens"], 12);
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        assert_close(&floats(&d["embedding"]), want.row(i, 0).unwrap(), &format!("input {i}"));
    }
    // One string, one token array: the same vectors; base64 is the floats' little-endian bytes.
    let one = server.post("/v1/embeddings", &json!({ "input": "w1 w2" })).json();
    let text = floats(&one["data"][0]["embedding"]);
    assert_close(&text, want.row(0, 0).unwrap(), "one string");
    let tokens = server.post("/v1/embeddings", &json!({ "input": ids(&[1, 2]) })).json();
    assert_eq!(floats(&tokens["data"][0]["embedding"]), text);
    let b64 = server.post("/v1/embeddings", &json!({ "input": "w1 w2", "encoding_format": "base64" })).json();
    assert_eq!(b64["data"][0]["encoding_format"], "base64");
    let bytes = base64_decode(b64["data"][0]["embedding"].as_str().unwrap());
    let decoded: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(decoded, text, "base64 and float agree bit for bit");
    // dimensions: the first values, normalised again (from the unnormalised vector).
    let raw = reference(&inputs[..1], None, Normalize::None);
    let cut = &raw.row(0, 0).unwrap()[..8];
    let norm = cut.iter().map(|x| x * x).sum::<f32>().sqrt();
    let short: Vec<f32> = cut.iter().map(|x| x / norm).collect();
    let d8 = server.post("/v1/embeddings", &json!({ "input": "w1 w2", "dimensions": 8 })).json();
    assert_close(&floats(&d8["data"][0]["embedding"]), &short, "dimensions 8");
    // embd_normalize -1: the engine's vector as it is.
    let none = server.post("/v1/embeddings", &json!({ "input": "w1 w2", "embd_normalize": -1 })).json();
    assert_close(&floats(&none["data"][0]["embedding"]), raw.row(0, 0).unwrap(), "embd_normalize -1");
    // llama.cpp's own shape: every input's rows.
    let native = server.post("/embeddings", &json!({ "content": ["w1 w2", "w40"] })).json();
    let list = native.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[1]["index"], 1);
    assert_eq!(list[1]["embedding"].as_array().unwrap().len(), 1, "one pooled row");
    assert_close(&floats(&list[1]["embedding"][0]), want.row(1, 0).unwrap(), "/embeddings");
    // The same vector as `pinfer embed` prints (7 decimals).
    let out = pinfer(&["embed", "-m", &repo_file(BERT), "-p", "w40", "--embd-output-format", "array"]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    let cli: Value = serde_json::from_str(text_of(&out.stdout).trim()).unwrap();
    let got = floats(&list[1]["embedding"][0]);
    for (a, b) in got.iter().zip(floats(&cli[0])) {
        assert!((a - b).abs() < 2e-7, "pinfer embed: {a} vs {b}");
    }
    // The server's other endpoints work for an encoder.
    assert_eq!(server.request("GET", "/v1/models", None).status, 200);
    let props = server.request("GET", "/props", None);
    assert_eq!(props.status, 200, "{}", props.body);
    assert_eq!(server.request("GET", "/health", None).json()["status"], "ok");
}

fn base64_decode(s: &str) -> Vec<u8> {
    let abc = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in s.bytes().filter(|&c| c != b'=') {
        bits = bits << 6 | abc.iter().position(|&a| a == c).expect("base64 alphabet") as u32;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    out
}

#[test]
fn pooling_none_gives_every_tokens_vector_on_the_llama_route_only() {
    let server = Server::start(BERT, &["--embedding", "--pooling", "none"]);
    let inputs = vec![ids(&[1, 2, 3]), ids(&[7])];
    let want = reference(&inputs, Some(Pooling::None), Normalize::Euclidean);
    let r = server.post("/embeddings", &json!({ "input": ["w1 w2 w3", "w7"] }));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    for (i, input) in inputs.iter().enumerate() {
        let rows = v[i]["embedding"].as_array().unwrap();
        assert_eq!(rows.len(), input.len(), "a row per token");
        for (t, row) in rows.iter().enumerate() {
            assert_close(&floats(row), want.row(i, t).unwrap(), &format!("input {i} token {t}"));
        }
    }
    let r = server.post("/v1/embeddings", &json!({ "input": "w1" }));
    assert_eq!(r.status, 400);
    assert!(r.error().1.contains("Pooling type 'none' is not OAI compatible"), "{}", r.body);
}

#[test]
fn ollama_routes() {
    let server = Server::start(BERT, &[]);
    let want = reference(&[ids(&[1, 2]), ids(&[40])], None, Normalize::Euclidean);
    let r = server.post(
        "/api/embed",
        &json!({ "model": "tiny", "input": ["w1 w2", "w40"], "keep_alive": "5m",
        "options": { "num_ctx": 128 } }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["model"], "tiny");
    assert_eq!(v["prompt_eval_count"], 7);
    assert!(v["total_duration"].as_u64().unwrap() > 0);
    assert_eq!(v["load_duration"], 0);
    for i in 0..2 {
        assert_close(&floats(&v["embeddings"][i]), want.row(i, 0).unwrap(), "/api/embed");
    }
    let one = server.post("/api/embed", &json!({ "input": "w40", "dimensions": 5 })).json();
    assert_eq!(one["embeddings"][0].as_array().unwrap().len(), 5);
    // The older route answers the vector unnormalised, as Ollama does.
    let raw = reference(&[ids(&[1, 2])], None, Normalize::None);
    let old = server.post("/api/embeddings", &json!({ "model": "tiny", "prompt": "w1 w2" })).json();
    assert_close(&floats(&old["embedding"]), raw.row(0, 0).unwrap(), "/api/embeddings");
    // truncate (default true) cuts an input longer than the model's 128 positions.
    let long: String = (0..200).map(|i| format!("w{} ", i % 90)).collect();
    let cut = server.post("/api/embed", &json!({ "input": long }));
    assert_eq!(cut.status, 200, "{}", cut.body);
    assert_eq!(cut.json()["prompt_eval_count"], 128);
    let refused = server.post("/api/embed", &json!({ "input": long, "truncate": false }));
    assert_eq!(refused.status, 400);
    assert!(
        refused.json()["error"].as_str().unwrap().contains("exceeds the available context size"),
        "{}",
        refused.body
    );
    // Errors in Ollama's shape.
    for body in [
        json!({ "input": "" }),
        json!({ "input": [] }),
        json!({ "input": [{ "a": 1 }] }),
        json!({}),
        json!({ "input": "w1", "dimensions": 0 }),
        json!({ "input": "w1", "keep_alive": [] }),
    ] {
        let r = server.post("/api/embed", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(r.json()["error"].is_string(), "{body}: {}", r.body);
    }
    let r = server.post("/api/embeddings", &json!({ "prompt": "" }));
    assert_eq!(r.status, 400, "{}", r.body);
    // The generating routes refuse an encoder.
    let chat =
        server.post("/api/chat", &json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] }));
    assert_eq!(chat.status, 400);
    assert!(chat.json()["error"].as_str().unwrap().ends_with("does not support chat"), "{}", chat.body);
    let gen = server.post("/api/generate", &json!({ "model": "m", "prompt": "hi" }));
    assert!(gen.json()["error"].as_str().unwrap().ends_with("does not support generate"), "{}", gen.body);
}

#[test]
fn rerank_scores_the_pairs_and_sorts_them() {
    let server = Server::start(BERT, &["--reranking"]);
    let docs = ["w3 w4", "w50", "w1 w2 w7", "w88"];
    let pairs: Vec<Vec<u32>> = [&[3u32, 4][..], &[50], &[1, 2, 7], &[88]]
        .iter()
        .map(|d| ids(&[1, 2]).into_iter().chain(ids(d).into_iter().skip(1)).collect())
        .collect();
    // bert-tiny has two token types: the document's tokens (after the query's [SEP]) are type 1.
    let query_len = ids(&[1, 2]).len();
    let types: Vec<Vec<u32>> =
        pairs.iter().map(|p| (0..p.len()).map(|i| u32::from(i >= query_len)).collect()).collect();
    let want = typed_reference(&pairs, &types, Some(Pooling::Rank), Normalize::None);
    let type0 = reference(&pairs, Some(Pooling::Rank), Normalize::None);
    assert!((0..4).any(|i| (want.row(i, 0).unwrap()[0] - type0.row(i, 0).unwrap()[0]).abs() > 1e-4));
    let score = |i: usize| want.row(i, 0).unwrap()[0];
    let r = server.post("/v1/rerank", &json!({ "model": "r", "query": "w1 w2", "documents": docs }));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "r");
    let n: usize = pairs.iter().map(Vec::len).sum();
    assert_eq!(v["usage"]["prompt_tokens"], n);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
    for (k, res) in results.iter().enumerate() {
        assert_eq!(res["index"], order[k], "sorted best first");
        let got = res["relevance_score"].as_f64().unwrap() as f32;
        assert!((got - score(order[k])).abs() < 1e-5, "{got} vs {}", score(order[k]));
        assert!(res.get("document").is_none());
    }
    // top_n, return_documents, the /rerank spelling; TEI's shape with `texts`.
    let top = server.post(
        "/rerank",
        &json!({ "query": "w1 w2", "documents": docs, "top_n": 2, "return_documents": true }),
    );
    let top = top.json();
    assert_eq!(top["results"].as_array().unwrap().len(), 2);
    assert_eq!(top["results"][0]["document"]["text"], docs[order[0]]);
    let tei = server.post("/rerank", &json!({ "query": "w1 w2", "texts": docs, "return_text": true })).json();
    assert_eq!(tei[0]["index"], order[0]);
    assert_eq!(tei[0]["text"], docs[order[0]]);
    assert!(tei[0]["score"].is_number());
    // A reranker without documents, or without a query, or with an empty one.
    for body in [
        json!({ "query": "w1" }),
        json!({ "query": "w1", "documents": [] }),
        json!({ "documents": ["w1"] }),
        json!({ "query": 3, "documents": ["w1"] }),
        json!({ "query": "w1", "documents": [1] }),
        json!({ "query": "w1", "documents": [""] }),
        json!({ "query": "w1", "documents": ["w2"], "top_n": -1 }),
    ] {
        let r = server.post("/v1/rerank", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.error().0, "invalid_request_error", "{body}");
    }
    assert_eq!(server.request("GET", "/health", None).status, 200);
}

#[test]
fn bad_input_is_a_400_and_the_server_keeps_serving() {
    let server = Server::start(BERT, &["--embedding", "--body-limit", "200000"]);
    let cases = [
        (json!({ "input": "" }), "Input content cannot be empty"),
        (json!({ "input": ["w1", ""] }), "Input content cannot be empty"),
        (json!({ "input": [] }), "must not be empty"),
        (json!({ "input": [[2, 3], []] }), "Input content cannot be empty"),
        (json!({ "input": [2, 96, 3] }), "must be a token id below 96"),
        (json!({ "input": [[2, -1, 3]] }), "must be a token id"),
        (json!({ "input": [[2, 1.5]] }), "must be a token id"),
        (json!({ "input": [{ "text": "w1" }] }), "must be a string or an array of token ids"),
        (json!({ "input": ["w1", 5] }), "must be a string or an array of token ids"),
        (json!({ "input": true }), "must be a string or an array of token ids"),
        (json!({ "input": "w1", "dimensions": 0 }), "'dimensions' 0"),
        (json!({ "input": "w1", "dimensions": 65 }), "'dimensions' 65"),
        (json!({ "input": "w1", "encoding_format": "int8" }), "either float or base64"),
        (json!({ "input": "w1", "embd_normalize": "x" }), "'embd_normalize'"),
        (json!({ "model": "m" }), "\"input\" or \"content\" must be provided"),
    ];
    for (body, message) in &cases {
        let r = server.post("/v1/embeddings", body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let (kind, got) = r.error();
        assert_eq!(kind, "invalid_request_error", "{body}");
        assert!(got.contains(message), "{body}: {got}");
    }
    let long: Vec<u32> = (0..129).map(|i| 5 + i % 90).collect();
    let r = server.post("/v1/embeddings", &json!({ "input": [long] }));
    assert_eq!(r.status, 400);
    assert_eq!(r.error().0, "exceed_context_size_error", "{}", r.body);
    // Not UTF-8, not JSON.
    let r = server.request("POST", "/v1/embeddings", Some(b"{\"input\": \"w1 \xff\xfe\"}"));
    assert_eq!(r.status, 400, "{}", r.body);
    // 10 000 inputs in one request: packed into batches, every one answered in order.
    let many: Vec<&str> = (0..10_000).map(|i| if i % 2 == 0 { "w1" } else { "w2 w3" }).collect();
    let r = server.post("/v1/embeddings", &json!({ "input": many }));
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(300)]);
    let v = r.json();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 10_000);
    assert_eq!(data[9_999]["index"], 9_999);
    assert_eq!(data[9_999]["embedding"], data[1]["embedding"]);
    assert_eq!(v["usage"]["prompt_tokens"], 5_000 * 3 + 5_000 * 4);
    // Past --body-limit: 413.
    let huge: Vec<&str> = vec!["w1 w2 w3"; 30_000];
    let r = server.post("/v1/embeddings", &json!({ "input": huge }));
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(server.request("GET", "/health", None).status, 200);
    let ok = server.post("/v1/embeddings", &json!({ "input": "w1" }));
    assert_eq!(ok.status, 200, "still serving: {}", ok.body);
    // The generating routes refuse an encoder in their API's shape.
    let r =
        server.post("/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "hi" }] }));
    assert_eq!(r.status, 501);
    assert_eq!(r.error().0, "not_supported_error");
    assert!(r.error().1.starts_with("This server does not support completions"), "{}", r.body);
    assert_eq!(server.post("/v1/completions", &json!({ "prompt": "hi" })).status, 501);
    let r = server.post("/v1/messages", &json!({ "model": "m", "max_tokens": 4, "messages": [] }));
    assert_eq!(r.status, 501);
    assert_eq!(r.json()["type"], "error");
    // Reranking needs --reranking.
    let r = server.post("/v1/rerank", &json!({ "query": "w1", "documents": ["w2"] }));
    assert_eq!(r.status, 501);
    assert!(r.error().1.contains("Start it with `--reranking`"), "{}", r.body);
}

#[test]
fn requests_past_the_queue_get_503() {
    // --queue 0: one request at a time; the others, while it runs, are turned away.
    let server = std::sync::Arc::new(Server::start(BERT, &["--queue", "0"]));
    let many: Vec<&str> = vec!["w1 w2 w3 w4 w5 w6 w7 w8"; 6_000];
    let body = json!({ "input": many });
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (server, body) = (server.clone(), body.clone());
            std::thread::spawn(move || server.post("/v1/embeddings", &body).status)
        })
        .collect();
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(statuses.iter().all(|&s| s == 200 || s == 503), "{statuses:?}");
    assert!(statuses.contains(&200) && statuses.contains(&503), "{statuses:?}");
    assert_eq!(server.post("/v1/embeddings", &json!({ "input": "w1" })).status, 200);
}

#[test]
fn a_generating_model_refuses_embeddings_and_is_refused_by_embedding() {
    let server = Server::start(QWEN2, &[]);
    let r = server.post("/v1/embeddings", &json!({ "input": "hi" }));
    assert_eq!(r.status, 501, "{}", r.body);
    assert_eq!(r.error().0, "not_supported_error");
    assert!(r.error().1.starts_with("This server does not support embeddings."), "{}", r.body);
    assert_eq!(server.post("/embeddings", &json!({ "input": "hi" })).status, 501);
    let r = server.post("/api/embed", &json!({ "input": "hi" }));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"].as_str().unwrap().contains("does not support embeddings"), "{}", r.body);
    assert_eq!(server.post("/v1/rerank", &json!({ "query": "a", "documents": ["b"] })).status, 501);
    drop(server);
    let out = pinfer(&["serve", "-m", &repo_file(QWEN2), "--port", "0", "--embedding"]);
    assert!(!out.status.success());
    assert!(text_of(&out.stderr).contains("generates text"), "{}", text_of(&out.stderr));
}

#[test]
fn the_python_clients_embed_through_the_server() {
    if cli_support::through_qemu().is_some() {
        return; // the protocol is the same on every CPU: checked on the host tier
    }
    // all-MiniLM-L6-v2 (scripts/setup.sh minilm), against llama-embedding's vectors.
    let server = Server::start("models/all-MiniLM-L6-v2.F16.gguf", &["--embedding"]);
    let out = std::process::Command::new("python3")
        .arg(repo_file("scripts/serve_clients.py"))
        .arg("--embedding")
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg(repo_file("tests/golden/embeddings/minilm-f16.llama.json"))
        .output()
        .expect("running python3 (scripts/setup.sh installs it and the pinned clients)");
    assert!(
        out.status.success() && text_of(&out.stdout).contains("serve_clients: ok"),
        "stdout: {}\nstderr: {}",
        text_of(&out.stdout),
        text_of(&out.stderr)
    );
}

/// llama-server's answers on a reranker (tests/golden/embeddings/*-rerank-tiny.server.json):
/// the same documents in the same order (its scores have no near ties), each score within
/// `tolerance`, the same prompt tokens; pinfer also gives the documents' text when asked
/// (Jina's and Cohere's `return_documents`, which llama-server ignores).
fn check_rerank_golden(model: &str, golden: &str, tolerance: f64) {
    let path = format!("{}/tests/golden/embeddings/{golden}", env!("CARGO_MANIFEST_DIR"));
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let server = Server::start(model, &["--reranking"]);
    for answer in golden["answers"].as_array().unwrap() {
        let (route, request, want) =
            (answer["route"].as_str().unwrap(), &answer["request"], &answer["response"]);
        let r = server.post(route, request);
        assert_eq!(r.status, 200, "{route}: {}", r.body);
        let got = r.json();
        assert_eq!(got["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"], "{route}: prompt tokens");
        let (got_results, want_results) =
            (got["results"].as_array().unwrap(), want["results"].as_array().unwrap());
        let order = |rs: &[Value]| rs.iter().map(|r| r["index"].as_u64().unwrap()).collect::<Vec<_>>();
        assert_eq!(order(got_results), order(want_results), "{route}: the documents' order");
        for (g, w) in got_results.iter().zip(want_results) {
            let (g, w) = (g["relevance_score"].as_f64().unwrap(), w["relevance_score"].as_f64().unwrap());
            assert!((g - w).abs() <= tolerance, "{route}: score {g} against llama-server's {w}");
        }
        if request["return_documents"] == json!(true) {
            let docs = request["documents"].as_array().unwrap();
            for r in got_results {
                assert_eq!(r["document"]["text"], docs[r["index"].as_u64().unwrap() as usize], "{route}");
            }
        }
    }
}

#[test]
fn qwen3_reranker_answers_as_llama_server() {
    // Qwen3-Reranker: the pairs through its `rerank` template, the yes probability.
    check_rerank_golden("models/tiny/qwen3-rerank-tiny.gguf", "qwen3-rerank-tiny.server.json", 2e-3);
}

#[test]
fn bert_cross_encoder_answers_as_llama_server() {
    // A one-type BERT cross-encoder: `[CLS] q [SEP] d [SEP]`, the raw score of its cls head.
    check_rerank_golden("models/tiny/bert-rerank-tiny.gguf", "bert-rerank-tiny.server.json", 5e-3);
}
