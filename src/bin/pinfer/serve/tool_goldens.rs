//! Each tool family's golden replies (tests/golden/tool-calls, written and read by llama.cpp's
//! parser in scripts/tool_call_goldens.py) read by pinfer as the server reads them: the family
//! chosen from the template's source, the reasoning split by the template's markers (opened when
//! the rendered prompt opens it), the calls parsed; whole, and streamed through the reasoning
//! splitter and [`ToolStream`] in pieces of 1 to 7 bytes and at every split point of the
//! markers (a piece may end inside a marker or a UTF-8 character: the server's pieces are
//! tokens' bytes, which can). Text and reasoning compare trimmed, arguments as JSON values, ids where
//! the model wrote them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use pinfer::prompt_format::{FormatChoice, ModelTemplate, PromptFormat};
use pinfer::reasoning::{Markers, Splitter};

use super::super::tool_stream::{Delta, ToolStream};
use super::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// llama.cpp's templates, fetched as tests/chat_jinja.rs fetches them.
fn templates_dir() -> PathBuf {
    let dir = repo().join("target/tokenizer-vocabs");
    if !dir.join(".llama-cpp-python-0.3.36-with-templates").exists() {
        let status =
            Command::new(repo().join("scripts/tokenizer_fetch_vocabs.sh")).status().expect("run fetch");
        assert!(status.success(), "scripts/tokenizer_fetch_vocabs.sh failed");
    }
    dir.join("templates")
}

/// One reading of a reply: (reasoning, text, calls as {name, arguments}).
fn reading(thought: Option<String>, text: &str, calls: &[Call]) -> Value {
    json!({
        "content": text.trim(),
        "reasoning_content": thought.unwrap_or_default().trim(),
        "tool_calls": calls
            .iter()
            .map(|c| {
                let mut v = json!({"name": c.name, "arguments": c.arguments});
                if let Some(id) = &c.id {
                    v["id"] = json!(id);
                }
                v
            })
            .collect::<Vec<_>>(),
    })
}

/// The reply streamed in pieces of the given byte lengths (cycled), as the OpenAI route streams
/// it; the deltas aggregated as a client aggregates them.
fn streamed(reply: &[u8], sizes: &[usize], reasoning: Option<(Markers, bool)>, tools: &Tools) -> Value {
    let mut splitter = reasoning.map(|(m, opened)| Splitter::new(m, opened));
    let mut stream = ToolStream::new(tools.clone());
    let (mut thought, mut text, mut calls) = (String::new(), String::new(), Vec::<Call>::new());
    let mut take = |deltas: Vec<Delta>, text: &mut String| {
        for d in deltas {
            match d {
                Delta::Content(c) => {
                    assert!(calls.is_empty(), "text after a call was sent");
                    text.push_str(&c);
                }
                Delta::Call { index, call } => {
                    assert_eq!(index, calls.len(), "calls in order");
                    calls.push(call);
                }
            }
        }
    };
    // (Bytes held until they complete a character, as the server's token stream does.)
    let mut pending = Vec::new();
    let mut at = 0;
    for &n in sizes.iter().cycle() {
        if at >= reply.len() {
            break;
        }
        let end = (at + n).min(reply.len());
        pending.extend_from_slice(&reply[at..end]);
        at = end;
        let valid = match std::str::from_utf8(&pending) {
            Ok(_) => pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let piece = String::from_utf8(pending.drain(..valid).collect()).expect("valid prefix");
        let answer = match splitter.as_mut() {
            Some(s) => {
                let p = s.push(&piece);
                thought.push_str(&p.reasoning);
                p.content
            }
            None => piece,
        };
        take(stream.push(&answer), &mut text);
    }
    if let Some(s) = splitter.as_mut() {
        let p = s.finish();
        thought.push_str(&p.reasoning);
        take(stream.push(&p.content), &mut text);
    }
    let (rest, whole_text, _) = stream.finish();
    take(rest, &mut text);
    assert_eq!(text.trim(), whole_text.trim(), "the streamed text is the whole reply's");
    reading(Some(thought), &text, &calls)
}

#[test]
fn each_family_reads_golden_replies_as_llama_cpp() {
    let templates = templates_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("tests/golden/tool-calls"))
        .expect("tests/golden/tool-calls")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert!(files.len() >= 18, "expected the 18 families' goldens, found {}", files.len());
    let mut checked = 0;
    for file in files {
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("json");
        let family = golden["family"].as_str().expect("family");
        let source = std::fs::read_to_string(templates.join(golden["template"].as_str().expect("template")))
            .expect("template");
        let format = PromptFormat::choose(
            FormatChoice::default(),
            ModelTemplate { text: Some(&source), bos_token: "", eos_token: "", adds_bos: false },
        )
        .expect("template compiles");
        let body = json!({ "tools": golden["tools"] });
        let tools = parse_request(body.as_object().expect("object"), ToolFormat::for_prompt(&format))
            .expect("tools")
            .expect("some tools");
        // (Thinking on, as llama.cpp's parse had it: the R1 distills' template closes the
        // reasoning in the prompt unless enable_thinking is set.)
        let kwargs = json!({ "enable_thinking": true });
        let prompt = format
            .render(
                &json!([{"role": "user", "content": "What is the weather in Paris?"}]),
                Some(&golden["tools"]),
                true,
                kwargs.as_object(),
            )
            .expect("render");
        let reasoning = Markers::of_template(&source).map(|m| (m, m.opened_by(&prompt)));
        for case in golden["cases"].as_array().expect("cases") {
            let (name, reply) =
                (case["name"].as_str().expect("name"), case["reply"].as_str().expect("reply"));
            let want = &case["expect"];
            let (thought, text, calls) = super::super::prompt::reply_parts(reply, reasoning, Some(&tools));
            assert_eq!(&reading(thought, &text, &calls), want, "{family}/{name} ({:?}) whole", tools.format);
            for sizes in [&[1][..], &[2], &[3], &[5], &[7], &[1, 4, 2, 7, 3]] {
                let got = streamed(reply.as_bytes(), sizes, reasoning, &tools);
                assert_eq!(&got, want, "{family}/{name} streamed in pieces of {sizes:?}");
            }
            // A split at every byte of the reply (two pieces), so every marker is cut everywhere.
            for cut in 1..reply.len() {
                let got = streamed(reply.as_bytes(), &[cut, reply.len()], reasoning, &tools);
                assert_eq!(&got, want, "{family}/{name} cut at byte {cut}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 80, "{checked} golden replies");
}
