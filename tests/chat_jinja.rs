//! The model's own chat templates rendered as Python's jinja2 renders them with transformers'
//! settings: every template llama.cpp tests with (its `models/templates/`, fetched by
//! scripts/tokenizer_fetch_vocabs.sh) against the conversations of
//! scripts/chat_template_goldens.py, byte for byte with the renderings it wrote into
//! tests/golden/chat-templates/. A template's own refusal (`raise_exception`) must give its
//! message; any other failure in Python must fail here too.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use pinfer::jinja::{Clock, Conversation, JinjaTemplate, TemplateError};
use serde_json::Value;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn templates_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = repo().join("target/tokenizer-vocabs");
        if !dir.join(".llama-cpp-python-0.3.36-with-templates").exists() {
            let status =
                Command::new(repo().join("scripts/tokenizer_fetch_vocabs.sh")).status().expect("run fetch");
            assert!(status.success(), "scripts/tokenizer_fetch_vocabs.sh failed");
        }
        dir.join("templates")
    })
}

fn goldens() -> PathBuf {
    repo().join("tests/golden/chat-templates")
}

/// The instant the goldens were rendered at (2026-01-15 09:30:00 UTC).
const GOLDEN_CLOCK: Clock = Clock { unix_seconds: 1_768_469_400 };

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn render(template: &JinjaTemplate, variables: &Value) -> Result<String, TemplateError> {
    let mut kwargs = variables.as_object().expect("variables").clone();
    let messages = kwargs.remove("messages").expect("messages");
    let tools = kwargs.remove("tools");
    let add_generation_prompt =
        kwargs.remove("add_generation_prompt").and_then(|v| v.as_bool()).unwrap_or(false);
    let conversation = Conversation {
        messages: &messages,
        tools: tools.as_ref(),
        documents: None,
        add_generation_prompt,
        kwargs: Some(&kwargs),
    };
    template.render_at(&conversation, GOLDEN_CLOCK)
}

/// Python failures where pinfer renders on purpose: minijinja iterates None as an empty list (a
/// `{% for tool in tools %}` without tools), and `tojson` takes a lazy sequence (the output of
/// `map`). A template that works in Python still renders the same here; one that fails there does
/// not fail here.
const RENDERS_WHERE_PYTHON_FAILS: [&str; 2] = [
    "TypeError: 'NoneType' object is not iterable",
    "TypeError: Object of type generator is not JSON serializable",
];

/// jinja2 escapes a plain string added to a `|safe` one (`Markup.__add__`) even with autoescaping
/// off; pinfer does not (neither does llama.cpp): the texts agree once Python's escapes are undone.
fn html_unescaped(s: &str) -> String {
    s.replace("&#34;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}
const ESCAPES_MARKUP_SUMS: [&str; 1] = ["meetkai-functionary-medium-v3.1"];

#[test]
fn every_real_template_renders_as_jinja2_does() {
    let conversations = read_json(&goldens().join("conversations.json"));
    let conversations = conversations.as_array().expect("conversations");
    let mut files: Vec<PathBuf> = std::fs::read_dir(templates_dir())
        .expect("templates")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    files.sort();
    assert!(files.len() >= 70, "expected llama.cpp's 70 templates, found {}", files.len());
    let (mut checked, mut failures) = (0, Vec::new());
    for file in &files {
        let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
        let golden = read_json(&goldens().join(format!("{stem}.json")));
        let source = std::fs::read_to_string(file).expect("template");
        let template = match JinjaTemplate::compile(&source, "<|bos|>", "<|eos|>") {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{stem}: {e}"));
                continue;
            }
        };
        for (case, conversation) in golden["cases"].as_array().expect("cases").iter().zip(conversations) {
            let name = case["name"].as_str().expect("name");
            assert_eq!(name, conversation["name"], "{stem}: cases out of order");
            let got = render(&template, &conversation["variables"]);
            checked += 1;
            match (&got, case.get("text"), case.get("raised").and_then(Value::as_bool)) {
                (Ok(text), Some(want), _) if text == want => {}
                (Ok(text), Some(want), _)
                    if ESCAPES_MARKUP_SUMS.contains(&stem.as_str())
                        && *text == html_unescaped(want.as_str().unwrap()) => {}
                (Ok(_), None, Some(false))
                    if RENDERS_WHERE_PYTHON_FAILS
                        .iter()
                        .any(|m| case["error"].as_str().unwrap().starts_with(m)) => {}
                (Ok(text), Some(want), _) => {
                    let at =
                        text.bytes().zip(want.as_str().unwrap().bytes()).take_while(|(a, b)| a == b).count();
                    let show = |s: &str| {
                        let mut from = at.saturating_sub(40);
                        while !s.is_char_boundary(from) {
                            from -= 1;
                        }
                        s[from..].chars().take(80).collect::<String>()
                    };
                    failures.push(format!(
                        "{stem}/{name}: differs at byte {at}:\n  got  {:?}\n  want {:?}",
                        show(text),
                        show(want.as_str().unwrap())
                    ));
                }
                (Err(TemplateError::Raised(m)), None, Some(true)) if m == case["error"].as_str().unwrap() => {
                }
                (Err(e), None, Some(false)) if !matches!(e, TemplateError::Raised(_)) => {}
                (got, _, _) => failures.push(format!("{stem}/{name}: got {got:?}, want {case}")),
            }
        }
    }
    assert!(failures.is_empty(), "{} of {checked} renders differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 700, "only {checked} renders checked");
}

fn hello() -> Value {
    serde_json::json!([{"role": "user", "content": "Hello"}])
}

fn render_hello(source: &str) -> Result<String, TemplateError> {
    let template = JinjaTemplate::compile(source, "<s>", "</s>")?;
    let messages = hello();
    let conversation = Conversation {
        messages: &messages,
        tools: None,
        documents: None,
        add_generation_prompt: true,
        kwargs: None,
    };
    template.render_at(&conversation, GOLDEN_CLOCK)
}

/// A template is code from a file: ones that never end, recurse, blow up their text or are broken
/// are refused with an error naming what happened, quickly.
#[test]
fn hostile_templates_are_refused_within_their_budget() {
    let started = std::time::Instant::now();
    type Expect = fn(&TemplateError) -> bool;
    let cases: [(&str, Expect); 8] = [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            |e| matches!(e, TemplateError::Budget(_)),
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", |e| matches!(e, TemplateError::Budget(_))),
        // (minijinja refuses to build the string at all: its own limit, reported as a render error.)
        ("{{ 'x' * 1000000000 }}", |e| matches!(e, TemplateError::Budget(_) | TemplateError::Render(_))),
        (
            "{% set s = namespace(t='xxxxxxxx') %}{% for i in range(60) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t }}",
            |e| matches!(e, TemplateError::Budget(_)),
        ),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", |e| matches!(e, TemplateError::Budget(_))),
        ("{{ messages | no_such_filter }}", |e| matches!(e, TemplateError::Compile(_) | TemplateError::Render(_))),
        ("{{ messages[0].content.no_such_method() }}", |e| matches!(e, TemplateError::Render(_))),
        ("{% if %}", |e| matches!(e, TemplateError::Compile(_))),
    ];
    for (source, expected) in cases {
        match render_hello(source) {
            Err(e) if expected(&e) => assert!(!e.to_string().is_empty()),
            other => panic!("{source}: {other:?}"),
        }
    }
    // Each is cut off by its budget, not run to the end (the 8 take well under a second in release).
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
}

#[test]
fn a_template_s_own_refusal_is_its_message() {
    let e = render_hello("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
        .unwrap_err();
    assert_eq!(e, TemplateError::Raised("Conversation roles must alternate user/assistant".into()));
    assert_eq!(
        e.to_string(),
        "the chat template refused the conversation: Conversation roles must alternate user/assistant"
    );
}

#[test]
fn tojson_and_printing_follow_python() {
    let out = render_hello(
        "{{ {'b': [1, 2.5, none, true], 'a': 'é\"'} | tojson }}|{{ {'b': 1, 'a': {'c': []}} | tojson(indent=2, sort_keys=true) }}|\
         {{ {'x': none, 'y': false} }}|{{ [1, 'two'] }}|{{ none }}|{{ strftime_now('%Y-%m-%d') }}|{{ bos_token }}",
    )
    .unwrap();
    assert_eq!(
        out,
        "{\"b\": [1, 2.5, null, true], \"a\": \"é\\\"\"}|{\n  \"a\": {\n    \"c\": []\n  },\n  \"b\": 1\n}|\
         {'x': None, 'y': False}|[1, 'two']|None|2026-01-15|<s>"
    );
}

/// What a render costs (a report, not a check): the Qwen3 template with 5 tools and a 6-message
/// conversation, compiled once and rendered 500 times. Run it with
/// `cargo test --release --test chat_jinja -- --ignored --nocapture render_cost`.
#[test]
#[ignore]
fn render_cost() {
    let source = std::fs::read_to_string(templates_dir().join("Qwen-Qwen3-0.6B.jinja")).expect("template");
    let started = std::time::Instant::now();
    let template = JinjaTemplate::compile(&source, "", "<|im_end|>").expect("compiles");
    let compile_us = started.elapsed().as_secs_f64() * 1e6;
    let tool = |i: usize| {
        serde_json::json!({"type": "function", "function": {"name": format!("tool_{i}"),
            "description": "Look something up in the house's systems and report it back",
            "parameters": {"type": "object", "properties": {
                "room": {"type": "string", "description": "Which room"},
                "level": {"type": "integer", "minimum": 0, "maximum": 100},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["room"]}}})
    };
    let tools = Value::Array((0..5).map(tool).collect());
    let messages = serde_json::json!([
        {"role": "system", "content": "You are the house assistant."},
        {"role": "user", "content": "How warm is the kitchen?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "tool_0", "arguments": {"room": "kitchen"}}}]},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
        {"role": "assistant", "content": "It is 21 °C in the kitchen."},
        {"role": "user", "content": "And the hall?"},
    ]);
    let conversation = Conversation {
        messages: &messages,
        tools: Some(&tools),
        documents: None,
        add_generation_prompt: true,
        kwargs: None,
    };
    let n = 500;
    let started = std::time::Instant::now();
    let mut bytes = 0;
    for _ in 0..n {
        bytes = template.render_at(&conversation, GOLDEN_CLOCK).expect("renders").len();
    }
    let render_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    println!(
        "Qwen3 template ({} bytes), 5 tools, 6 messages: compile {compile_us:.0} us, render {render_us:.1} us ({bytes} bytes of prompt)",
        source.len()
    );
}

/// A deterministic fuzz: llama.cpp's real templates cut, spliced and mutated at random, and
/// templates assembled from random Jinja pieces, each compiled and rendered against random
/// conversations. Every one must end in a text or an error, never a panic, and quickly (the
/// budgets bound each render). (`scripts/fuzz.sh` runs coverage-guided fuzzing of the GGUF
/// parser; this covers the template side in every test run.)
#[test]
fn random_and_mutated_templates_never_panic() {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let sources: Vec<String> = std::fs::read_dir(templates_dir())
        .expect("templates")
        .map(|e| std::fs::read_to_string(e.expect("entry").path()).expect("template"))
        .collect();
    const PIECES: [&str; 24] = [
        "{{ messages[0].content }}",
        "{% for m in messages %}[{{ m.role }}]{% endfor %}",
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}",
        "{{ messages | length }}",
        "{{ messages[-1]['content'].strip().split(' ') | join('|') }}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
        "{{ raise_exception('no') }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ (messages | map(attribute='role') | list)[1:] }}",
        "{{ messages[0].get('content', 'x') | upper }}",
        "{% for k, v in messages[0].items() %}{{ k }}={{ v }}{% endfor %}",
        "{{ 'a' * 100000 }}",
        "{{ strftime_now('%Y %B %A %j') }}",
        "{% generation %}{{ eos_token }}{% endgeneration %}",
        "{{ bos_token ~ (add_generation_prompt | string) }}",
        "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
        "{{ messages[0].content[::-1] }}",
        "{{ undefined_thing.attr }}",
        "{{ none | tojson }}{{ [1, 2.5, true] }}",
        "{% if messages[0].content is string and messages[0].content.startswith('H') %}y{% endif %}",
        "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}",
        "{% for m in messages %}{% if loop.first %}{{ loop.index }}{% break %}{% endif %}{% endfor %}",
        "{{ {'a': {'b': [1, {'c': none}]}} | tojson(sort_keys=true, separators=(',', ':')) }}",
        "{%- if x -%}{{- y -}}{%- endif -%}",
    ];
    let conversations = [
        serde_json::json!([{"role": "user", "content": "Hi"}]),
        serde_json::json!([{"role": "system", "content": ""}, {"role": "user", "content": "é ü 世界"}, {"role": "assistant", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": [1, null]}}}]}]),
        serde_json::json!([]),
        serde_json::json!([{"role": "tool", "content": {"nested": [1, 2]}}, {"content": null}]),
    ];
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let (mut runs, mut compiled, mut rendered) = (0, 0, 0);
    let started = std::time::Instant::now();
    for i in 0..400 {
        let source: String = if i % 2 == 0 {
            // A real template mutated: a cut, a splice of another, a few bytes changed.
            let mut s = sources[next() as usize % sources.len()].clone().into_bytes();
            let other = sources[next() as usize % sources.len()].as_bytes();
            for _ in 0..(next() % 4) {
                let at = next() as usize % (s.len() + 1);
                match next() % 4 {
                    0 => s.truncate(at),
                    1 => {
                        let from = next() as usize % (other.len() + 1);
                        let len = (next() as usize % 200).min(other.len() - from);
                        s.splice(at..at, other[from..from + len].iter().copied());
                    }
                    2 if at < s.len() => s[at] = b"{}%#-()[]'\"|.~ \n"[next() as usize % 16],
                    _ => {
                        let end = (at + next() as usize % 50).min(s.len());
                        s.drain(at..end);
                    }
                }
            }
            String::from_utf8_lossy(&s).into_owned()
        } else {
            (0..1 + next() % 5).map(|_| PIECES[next() as usize % PIECES.len()]).collect()
        };
        runs += 1;
        let outcome = std::panic::catch_unwind(|| {
            let Ok(template) = JinjaTemplate::compile(&source, "<s>", "</s>") else { return (false, 0) };
            let mut ok = 0;
            for (c, messages) in conversations.iter().enumerate() {
                let conversation = Conversation {
                    messages,
                    tools: (c % 2 == 1).then_some(&tools),
                    documents: None,
                    add_generation_prompt: c % 2 == 0,
                    kwargs: None,
                };
                ok += usize::from(template.render_at(&conversation, GOLDEN_CLOCK).is_ok());
            }
            (true, ok)
        });
        match outcome {
            Ok((c, ok)) => {
                compiled += usize::from(c);
                rendered += ok;
            }
            Err(_) => panic!("a template panicked the renderer:\n{source}"),
        }
    }
    println!(
        "{runs} templates ({compiled} compiled, {rendered} renders succeeded) in {:?}",
        started.elapsed()
    );
    assert!(
        compiled > 100 && rendered > 100,
        "the fuzz barely ran: {compiled} compiled, {rendered} rendered"
    );
}
