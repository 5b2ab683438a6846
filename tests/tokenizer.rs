//! Tokenizers against llama.cpp: the golden tokenizations of our models (tests/golden), and
//! llama.cpp's own tokenizer test vocabularies (fetched into target/ by
//! scripts/tokenizer_fetch_vocabs.sh); decoding round trips, the streaming decoder, hostile input.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{tag, GgufBuilder, Val};
use pinfer::gguf::{Gguf, Value, ValueType};
use pinfer::tokenizer::{
    OwnedTokenizer, PreTokenizer, StreamDecoder, TokError, TokenAttr, Tokenizer, VocabKind,
};
use serde_json::Value as Json;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn emulated() -> bool {
    cfg!(target_arch = "aarch64")
}

/// Runs one of our fetch scripts (host bash, also from under qemu-user).
fn run_script(script: &str) {
    let status = Command::new("bash")
        .arg(repo().join("scripts").join(script))
        .status()
        .unwrap_or_else(|e| panic!("cannot run scripts/{script}: {e}"));
    assert!(status.success(), "scripts/{script} failed; it needs PyPI (pip)");
}

/// llama.cpp's vocab test files, fetched once.
fn vocab_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = repo().join("target/tokenizer-vocabs");
        if !dir.join(".llama-cpp-python-0.3.36-with-grammars").exists() {
            run_script("tokenizer_fetch_vocabs.sh");
        }
        dir
    })
}

fn model_path(name: &str) -> PathBuf {
    let path = repo().join("models").join(name);
    if name.starts_with("gemma-3") && !path.exists() {
        run_script("tokenizer_fetch_gemma3.sh");
    }
    assert!(path.exists(), "{} missing: run scripts/setup.sh model", path.display());
    path
}

/// Builds a tokenizer over leaked file bytes and storage (tests only).
fn tokenizer_of(bytes: Vec<u8>) -> Result<&'static Tokenizer<'static>, TokError> {
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    let g = Gguf::parse(bytes).expect("test file parses");
    let words = Tokenizer::storage_words(&g)?;
    let storage: &'static mut [u32] = Box::leak(vec![0u32; words].into_boxed_slice());
    Ok(Box::leak(Box::new(Tokenizer::new(&g, storage)?)))
}

fn load(path: &Path) -> &'static Tokenizer<'static> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    tokenizer_of(bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn encode(tok: &Tokenizer<'_>, text: &str, parse_special: bool, add_special: bool) -> Vec<u32> {
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut out = vec![0u32; text.len() + 4];
    let n = tok.encode_with_scratch(text, parse_special, add_special, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

fn decode(tok: &Tokenizer<'_>, ids: &[u32]) -> Vec<u8> {
    let mut buf = vec![0u8; ids.len() * tok.max_piece_len() + 1];
    let n = tok.decode(ids, false, &mut buf).unwrap();
    buf.truncate(n);
    buf
}

/// Checks every line of a golden `*.tokenize.jsonl` file (special tokens off, the model's BOS rule).
/// Returns the number of strings whose ids differ when `expect_all` is false.
fn check_golden(tok: &Tokenizer<'_>, golden: &str, expect_all: bool) -> usize {
    let path = repo().join("tests/golden").join(golden);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut differ = 0;
    for line in text.lines() {
        let case: Json = serde_json::from_str(line).unwrap();
        let s = case["text"].as_str().unwrap();
        let want: Vec<u32> =
            case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = encode(tok, s, false, true);
        if expect_all {
            assert_eq!(got, want, "{golden}: {s:?}");
        } else if got != want {
            differ += 1;
        }
    }
    differ
}

#[test]
fn golden_smollm2() {
    let tok = load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert_eq!(
        (tok.kind(), tok.pre_tokenizer(), tok.add_bos()),
        (VocabKind::Bpe, PreTokenizer::SmolLm, false)
    );
    check_golden(tok, "smollm2.tokenize.jsonl", true);
}

/// A vocabulary-only copy of the SmolLM2 file with another `tokenizer.ggml.pre`, as
/// make_test_models.py writes the qwen2-tiny model's (BOS 1, EOS 2, no BOS added).
fn smollm2_vocab_with_pre(pre: &str) -> &'static Tokenizer<'static> {
    let bytes = std::fs::read(model_path("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let strings = |key: &str| {
        let a = g.get_array(key, ValueType::String).unwrap();
        Val::Array(
            tag::STRING,
            a.iter()
                .map(|v| match v {
                    Value::String(s) => Val::Str(s.to_vec()),
                    _ => unreachable!(),
                })
                .collect(),
        )
    };
    let types = g.get_array("tokenizer.ggml.token_type", ValueType::I32).unwrap();
    let types =
        Val::Array(tag::I32, types.iter().map(|v| Val::I32(v.as_integer().unwrap() as i32)).collect());
    let file = GgufBuilder::new()
        .kv("general.architecture", Val::str("qwen2"))
        .kv("tokenizer.ggml.model", Val::str("gpt2"))
        .kv("tokenizer.ggml.pre", Val::str(pre))
        .kv("tokenizer.ggml.tokens", strings("tokenizer.ggml.tokens"))
        .kv("tokenizer.ggml.token_type", types)
        .kv("tokenizer.ggml.merges", strings("tokenizer.ggml.merges"))
        .kv("tokenizer.ggml.bos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(2))
        .kv("tokenizer.ggml.add_bos_token", Val::Bool(0))
        .bytes();
    tokenizer_of(file).unwrap()
}

#[test]
fn golden_qwen2_tiny() {
    let tok = smollm2_vocab_with_pre("qwen2");
    assert_eq!(tok.pre_tokenizer(), PreTokenizer::Qwen2);
    check_golden(tok, "qwen2-tiny.tokenize.jsonl", true);
}

/// GPT-4o's pre-tokenizer (Phi-4-mini, Llama 4) on the SmolLM2 vocabulary, against llama.cpp's
/// ids (scripts/tokenizer_golden_pre.py: letter case runs, contractions, `\p{N}{1,3}`, `/` after
/// punctuation).
#[test]
fn golden_gpt_4o_pre_tokenizer() {
    let tok = smollm2_vocab_with_pre("gpt-4o");
    assert_eq!(tok.pre_tokenizer(), PreTokenizer::Gpt4o);
    check_golden(tok, "gpt-4o.tokenize.jsonl", true);
    // The same texts cut as Llama 3 or GPT-2 cut them differ (BPE hides most cuts: a word's
    // merges rarely cross where the two pre-tokenizers disagree).
    for (pre, least) in [("llama-bpe", 1), ("gpt2", 5)] {
        let n = check_golden(smollm2_vocab_with_pre(pre), "gpt-4o.tokenize.jsonl", false);
        assert!(n >= least, "{pre}: {n}");
    }
}

/// The golden checks can fail: the same vocabulary with the wrong pre-tokenizer gets some strings
/// wrong (Qwen2 and Llama 3 keep "\n" apart from the indentation after it, SmolLM does not).
#[test]
fn golden_checks_catch_a_wrong_pre_tokenizer() {
    let qwen2 = smollm2_vocab_with_pre("qwen2");
    assert!(check_golden(qwen2, "smollm2.tokenize.jsonl", false) > 0);
    let smollm = smollm2_vocab_with_pre("smollm");
    assert!(check_golden(smollm, "qwen2-tiny.tokenize.jsonl", false) > 0);
    let gpt2 = smollm2_vocab_with_pre("gpt2");
    assert!(check_golden(gpt2, "qwen2-tiny.tokenize.jsonl", false) > 0);
}

#[test]
fn golden_gemma3() {
    let tok = load(&model_path("gemma-3-270m-q4_k_m.gguf"));
    assert_eq!((tok.kind(), tok.add_bos(), tok.add_space_prefix()), (VocabKind::Spm, true, false));
    check_golden(tok, "gemma3.tokenize.jsonl", true);
}

/// The prompts of the greedy references are tokenized with special-token parsing on and the
/// model's BOS rule; their ids must match too.
#[test]
fn golden_prompts_with_special_tokens() {
    let cases = [
        (load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf")), "smollm2.greedy.jsonl"),
        (load(&model_path("gemma-3-270m-q4_k_m.gguf")), "gemma3.greedy.jsonl"),
        (smollm2_vocab_with_pre("qwen2"), "qwen2-tiny.greedy.jsonl"),
    ];
    for (tok, golden) in cases {
        let text = std::fs::read_to_string(repo().join("tests/golden").join(golden)).unwrap();
        for line in text.lines() {
            let case: Json = serde_json::from_str(line).unwrap();
            let prompt = case["prompt"].as_str().unwrap();
            let want: Vec<u32> =
                case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(encode(tok, prompt, true, true), want, "{golden}: {prompt:?}");
        }
    }
}

/// The round trips of llama.cpp's test-tokenizer-1-{bpe,spm}: every code point encodes and decodes
/// back to itself (U+2581 aside, which SentencePiece reads as a space); every token's text encodes
/// (special tokens on) to tokens that decode to the same text.
#[test]
fn every_code_point_and_every_token_round_trips() {
    let step = if emulated() { 17 } else { 1 };
    // SmolLM2's vocabulary lacks the byte-level characters of some control bytes (U+0004...), which
    // llama.cpp then drops: only the token round trip applies to it.
    let models = [
        (vocab_test("llama-spm").tok, true),
        (vocab_test("gpt-2").tok, true),
        (vocab_test("llama-bpe").tok, true),
        (vocab_test("qwen2").tok, true),
        (load(&model_path("gemma-3-270m-q4_k_m.gguf")), true),
        (load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf")), false),
    ];
    let mut out = vec![0u32; 64];
    let mut scratch = vec![0u32; 4096];
    for (tok, code_points) in models {
        let mut buf = vec![0u8; 8 * tok.max_piece_len() + 64];
        for cp in (0..0x110000u32).step_by(step).filter(|_| code_points) {
            if (0xD800..=0xDFFF).contains(&cp) || (0x40000..=0xE0000).contains(&cp) || cp == 0x2581 {
                continue;
            }
            let s = char::from_u32(cp).unwrap().to_string();
            let n = tok.encode_with_scratch(&s, false, false, &mut out, &mut scratch).unwrap();
            let m = tok.decode(&out[..n], false, &mut buf).unwrap();
            assert_eq!(
                &buf[..m],
                s.as_bytes(),
                "U+{cp:04X} ({:?}) {:?} {:?}",
                tok.kind(),
                &out[..n],
                tok.pre_tokenizer()
            );
        }
        let mut piece = vec![0u8; tok.max_piece_len() + 1];
        let mut ids = vec![0u32; 8 * tok.max_piece_len() + 8];
        let mut scratch = vec![0u32; tok.scratch_words(8 * tok.max_piece_len())];
        for id in (0..tok.n_vocab()).step_by(step) {
            let n = tok.decode(&[id], true, &mut piece).unwrap();
            let Ok(text) = std::str::from_utf8(&piece[..n]) else { continue }; // llama.cpp skips these too
            let k = tok.encode_with_scratch(text, true, false, &mut ids, &mut scratch).unwrap();
            let m = tok.decode(&ids[..k], true, &mut buf).unwrap();
            assert_eq!(&buf[..m], text.as_bytes(), "token {id} {text:?} -> {:?}", &ids[..k]);
        }
    }
}

/// One of llama.cpp's test vocabularies: its inputs (separated by a marker line) and expected ids.
struct VocabTest {
    name: &'static str,
    tok: &'static Tokenizer<'static>,
    cases: Vec<(String, Vec<u32>)>,
}

fn vocab_test(name: &'static str) -> VocabTest {
    let dir = vocab_dir();
    let gguf = dir.join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read(gguf.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).unwrap();
    let sep = b"\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].windows(sep.len()).position(|w| w == sep) {
            Some(k) => {
                inputs.push(String::from_utf8(inp[pos..pos + k].to_vec()).unwrap());
                pos += k + sep.len();
            }
            None => {
                inputs.push(String::from_utf8(inp[pos..].to_vec()).unwrap());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs differ in number");
    let cases: Vec<(String, Vec<u32>)> = inputs.into_iter().zip(outputs).collect();
    VocabTest { name, tok: load(&gguf), cases }
}

/// Every input of `name` must give exactly llama.cpp's ids (no BOS, special tokens off).
fn check_vocab(name: &'static str) -> VocabTest {
    let t = vocab_test(name);
    let mut failures = Vec::new();
    for (text, want) in &t.cases {
        let got = encode(t.tok, text, false, false);
        if &got != want {
            failures.push(format!("{text:?}\n    want {want:?}\n    got  {got:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} differ:\n{}",
        failures.len(),
        t.cases.len(),
        failures.join("\n")
    );
    t
}

/// decode(encode(text)) == text wherever llama.cpp's own ids decode back to the text, and that is
/// most inputs.
fn check_round_trip(t: &VocabTest) {
    let mut checked = 0;
    for (text, want) in &t.cases {
        if decode(t.tok, want) != text.as_bytes() {
            continue; // e.g. SentencePiece drops one leading space
        }
        checked += 1;
        let got = decode(t.tok, &encode(t.tok, text, false, false));
        assert_eq!(String::from_utf8_lossy(&got), *text, "{}: round trip", t.name);
    }
    assert!(
        checked * 10 >= t.cases.len() * 8,
        "{}: only {checked} of {} inputs round-trip",
        t.name,
        t.cases.len()
    );
}

#[test]
fn llama_cpp_vocab_llama_spm() {
    let t = check_vocab("llama-spm");
    assert_eq!(t.tok.kind(), VocabKind::Spm);
    check_round_trip(&t);
}

#[test]
fn llama_cpp_vocab_phi_3() {
    let t = check_vocab("phi-3");
    check_round_trip(&t);
    // "Phi3": white space after special tokens is dropped (RSTRIP), except after <s>/<unk>/<|endoftext|>.
    let end = t.tok.token_id(b"<|end|>").unwrap();
    assert!(t.tok.attr(end).unwrap().has(TokenAttr::RSTRIP | TokenAttr::CONTROL));
    let ids = encode(t.tok, "<|end|>  x", true, false);
    assert_eq!(ids, [end, t.tok.token_id("▁x".as_bytes()).unwrap()]);
}

#[test]
fn llama_cpp_vocab_gpt_2() {
    let t = check_vocab("gpt-2");
    check_round_trip(&t);
}

#[test]
fn llama_cpp_vocab_llama_bpe() {
    let t = check_vocab("llama-bpe");
    assert_eq!(
        (t.tok.pre_tokenizer(), t.tok.add_bos(), t.tok.bos()),
        (PreTokenizer::Llama3, true, Some(128000))
    );
    check_round_trip(&t);
}

#[test]
fn llama_cpp_vocab_qwen2() {
    let t = check_vocab("qwen2");
    check_round_trip(&t);
}

/// Gemma 4: SentencePiece-style BPE (spaces as U+2581, raw UTF-8 merges, `<0xNN>` bytes), BOS
/// added whatever the file says.
#[test]
fn llama_cpp_vocab_gemma_4() {
    let t = check_vocab("gemma-4");
    assert_eq!((t.tok.kind(), t.tok.add_bos(), t.tok.bos()), (VocabKind::SpmBpe, true, Some(2)));
    check_round_trip(&t);
    // A character no token holds becomes the <0xNN> tokens of its bytes, and decodes back.
    let missing = ('\u{10000}'..'\u{10FFFF}')
        .find(|c| t.tok.token_id(c.to_string().as_bytes()).is_none())
        .expect("a character outside the vocabulary");
    let text = missing.to_string();
    let want: Vec<u32> =
        text.bytes().map(|b| t.tok.token_id(format!("<0x{b:02X}>").as_bytes()).unwrap()).collect();
    assert_eq!(encode(t.tok, &text, false, false), want, "{missing:?}");
    assert_eq!(decode(t.tok, &want), text.as_bytes());
    // Spaces are U+2581 inside tokens; a newline-only word is one token where there is one.
    let nl3 = t.tok.token_id(b"\n\n\n").unwrap();
    assert_eq!(encode(t.tok, "\n\n\n", false, false), [nl3]);
    let ids = encode(t.tok, "a  b", false, false);
    assert_eq!(decode(t.tok, &ids), b"a  b");
    assert!(ids.iter().all(|&id| !t.tok.token_text(id).unwrap().contains(&b' ')));
    // Its chat template is recognised, and the turn markers are single special tokens.
    let bytes = std::fs::read(vocab_dir().join("ggml-vocab-gemma-4.gguf")).unwrap();
    let template = Gguf::parse(&bytes).unwrap().get_str("tokenizer.chat_template").unwrap().to_string();
    let format = pinfer::chat::ChatTemplate::detect(Some(&template)).unwrap();
    assert_eq!(format, pinfer::chat::ChatTemplate::Gemma4);
    // The model loader takes this vocabulary too.
    let vocab = pinfer::model::validate_vocab(&Gguf::parse(&bytes).unwrap()).unwrap();
    assert_eq!((vocab.model, vocab.n_vocab), ("gemma4", t.tok.n_vocab()));
    let mut prompt = String::new();
    format.render(&[pinfer::chat::Message::user("Hi")], true, &mut prompt).unwrap();
    let ids = encode(t.tok, &prompt, true, true);
    let turn = t.tok.token_id(b"<|turn>").unwrap();
    let end = t.tok.token_id(format.end_of_turn().as_bytes()).unwrap();
    assert_eq!((ids[0], ids[1], ids.iter().filter(|&&i| i == end).count()), (2, turn, 1), "{ids:?}");
    assert!(t.tok.is_eog(end));
}

#[test]
fn llama_cpp_vocab_qwen35() {
    let t = check_vocab("qwen35");
    check_round_trip(&t);
}

#[test]
fn llama_cpp_vocab_starcoder_refact_command_r_mpt() {
    for name in ["starcoder", "refact", "command-r", "mpt"] {
        let t = check_vocab(name);
        check_round_trip(&t);
    }
}

#[test]
fn llama_cpp_vocabs_we_do_not_implement_are_refused_by_name() {
    for (name, what) in
        [("falcon", "falcon"), ("deepseek-coder", "deepseek-coder"), ("deepseek-llm", "deepseek-llm")]
    {
        let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
        let err = tokenizer_of(std::fs::read(&path).unwrap()).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, TokError::UnsupportedPre { .. } | TokError::UnsupportedModel { .. })
                && msg.contains(what),
            "{name}: {msg}"
        );
    }
}

#[test]
fn special_tokens_parse_only_when_asked() {
    let tok = load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let text = "<|im_start|>user\nHi<|im_end|>";
    let on = encode(tok, text, true, false);
    assert_eq!(on[0], 1);
    assert_eq!(*on.last().unwrap(), 2);
    let off = encode(tok, text, false, false);
    assert!(!off.contains(&1) && !off.contains(&2) && off.len() > on.len());
    // Control tokens render only when asked.
    assert_eq!(decode(tok, &on), b"user\nHi");
    let mut buf = vec![0u8; 256];
    let n = tok.decode(&on, true, &mut buf).unwrap();
    assert_eq!(&buf[..n], text.as_bytes());
    assert!(tok.is_eog(2) && !tok.is_eog(1));

    // Gemma 3: user-defined tokens (runs of spaces and newlines, HTML tags) are taken even without
    // parse_special, longest first; control tokens only with it.
    let gemma = load(&model_path("gemma-3-270m-q4_k_m.gguf"));
    let ids = encode(gemma, "<start_of_turn>user\n<b>x</b>", true, true);
    assert_eq!(&ids[..2], &[2, gemma.token_id(b"<start_of_turn>").unwrap()]);
    let ids_off = encode(gemma, "<start_of_turn>", false, false);
    assert!(ids_off.len() > 1);
}

#[test]
fn bos_and_eos_follow_the_vocabulary() {
    let gemma = load(&model_path("gemma-3-270m-q4_k_m.gguf"));
    assert_eq!(encode(gemma, "", false, true), [2]);
    assert_eq!(encode(gemma, "", false, false), Vec::<u32>::new());
    let smol = load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert_eq!(encode(smol, "", false, true), Vec::<u32>::new());
    assert_eq!(encode(smol, "Hi", false, true), encode(smol, "Hi", false, false));
}

/// Token-by-token streaming of multi-byte text never yields invalid UTF-8 and joins up to the text.
#[test]
fn streaming_decoder_joins_split_characters() {
    let texts = [
        "日本語のテキスト、絵文字😀👍🏽 flags 🇫🇷 and ü ñ ø",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 \u{10FFFD}",
        "Ünïcödé façade naïve café — “quotes” …",
    ];
    let models = [
        load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf")),
        load(&model_path("gemma-3-270m-q4_k_m.gguf")),
        vocab_test("llama-spm").tok,
    ];
    let mut held_back = 0;
    let mut byte_tokens = 0;
    for tok in models {
        for text in texts {
            let ids = encode(tok, text, false, false);
            let mut d = StreamDecoder::new();
            let mut out = vec![0u8; StreamDecoder::buffer_len(tok)];
            let mut joined = String::new();
            for &id in &ids {
                let piece = d.push(tok, id, false, &mut out).unwrap();
                joined.push_str(piece);
                held_back += usize::from(d.has_pending());
                byte_tokens += usize::from(tok.attr(id).unwrap().has(TokenAttr::BYTE));
            }
            joined.push_str(d.finish(&mut out));
            let expected = if tok.add_space_prefix() { format!(" {text}") } else { text.to_string() };
            assert_eq!(joined, expected);
        }
    }
    assert!(held_back > 10, "the texts must split characters over tokens ({held_back})");
    assert!(byte_tokens > 4, "the texts must use <0xNN> byte fallback ({byte_tokens})");

    // A stream of byte tokens that never completes a character ends as U+FFFD, never as invalid text.
    let spm = vocab_test("llama-spm").tok;
    let e3 = spm.token_id(b"<0xE3>").unwrap();
    let mut d = StreamDecoder::new();
    let mut out = vec![0u8; StreamDecoder::buffer_len(spm)];
    assert_eq!(d.push(spm, e3, false, &mut out).unwrap(), "");
    assert_eq!(d.push(spm, e3, false, &mut out).unwrap(), "\u{FFFD}");
    assert_eq!(d.finish(&mut out), "\u{FFFD}");
}

#[test]
fn out_of_range_ids_are_errors() {
    let tok = load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let n = tok.n_vocab();
    let bad = TokError::InvalidToken { id: n, n_vocab: n };
    let mut buf = [0u8; 64];
    assert_eq!(tok.token_to_piece(n, false, &mut buf), Err(bad.clone()));
    assert_eq!(tok.decode(&[19556, n], false, &mut buf), Err(bad.clone()));
    assert_eq!(tok.attr(u32::MAX).unwrap_err(), TokError::InvalidToken { id: u32::MAX, n_vocab: n });
    let mut d = StreamDecoder::new();
    assert_eq!(d.push(tok, n, false, &mut buf), Err(bad));
}

#[test]
fn small_buffers_report_what_they_need() {
    let tok = load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let text = "Hello, world! How are you?";
    let want = encode(tok, text, false, false);
    let mut out = vec![0u32; want.len() - 1];
    assert_eq!(
        tok.encode(text, false, false, &mut out),
        Err(TokError::OutputTooSmall { needed: want.len(), got: want.len() - 1 })
    );
    let mut out = vec![0u32; want.len()];
    assert_eq!(tok.encode(text, false, false, &mut out), Ok(want.len()));
    assert_eq!(out, want);
    let mut small = [0u8; 3];
    assert!(matches!(
        tok.decode(&want, false, &mut small),
        Err(TokError::BufferTooSmall { needed: 26, got: 3 })
    ));
    // The stack-scratch encode refuses a word too long for it, naming the way out.
    let long = "x".repeat(20_000);
    let mut out = vec![0u32; 20_000];
    match tok.encode(&long, false, false, &mut out) {
        Err(TokError::ScratchTooSmall { needed, .. }) => assert_eq!(needed, tok.scratch_words(long.len())),
        other => panic!("{other:?}"),
    }
}

/// Long input without spaces is one huge word (BPE) or fragment (SentencePiece): O(n log n), bounded.
#[test]
fn long_text_without_spaces_is_fast() {
    let limit = Duration::from_secs(if emulated() { 60 } else { 10 });
    let size = if emulated() { 30_000 } else { 100_000 };
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut random = String::new();
    while random.len() < size {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        random.push((b'a' + (rng % 26) as u8) as char);
    }
    let texts = [random, "a".repeat(size), "日".repeat(size / 3), "1".repeat(size)];
    for tok in
        [load(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf")), load(&model_path("gemma-3-270m-q4_k_m.gguf"))]
    {
        for text in &texts {
            let t0 = Instant::now();
            let ids = encode(tok, text, false, false);
            let spent = t0.elapsed();
            assert!(spent < limit, "{} bytes took {spent:?}", text.len());
            assert_eq!(String::from_utf8_lossy(&decode(tok, &ids)), *text);
        }
    }
}

/// A small SentencePiece vocabulary in a GGUF file, with `tokens` of type `types`.
fn spm_vocab(tokens: &[&str], types: &[i32]) -> Vec<u8> {
    let scores = Val::Array(tag::F32, (0..tokens.len()).map(|i| Val::F32(-(i as f32))).collect());
    GgufBuilder::new()
        .kv("tokenizer.ggml.model", Val::str("llama"))
        .kv("tokenizer.ggml.tokens", Val::strs(tokens))
        .kv("tokenizer.ggml.scores", scores)
        .kv("tokenizer.ggml.token_type", Val::Array(tag::I32, types.iter().map(|&t| Val::I32(t)).collect()))
        .bytes()
}

#[test]
fn malformed_vocabularies_are_refused() {
    let base = ["<unk>", "<s>", "</s>", "▁a", "a"];
    let types = [2, 3, 3, 1, 1];
    assert!(tokenizer_of(spm_vocab(&base, &types)).is_ok());
    // A byte token that is not <0xHH>.
    let err = tokenizer_of(spm_vocab(&[&base[..], &["<0x-1>"]].concat(), &[&types[..], &[6]].concat()))
        .unwrap_err();
    assert!(matches!(err, TokError::BadVocab { key: "tokenizer.ggml.tokens", index: 5, .. }), "{err}");
    // A duplicate token.
    let err =
        tokenizer_of(spm_vocab(&[&base[..], &["▁a"]].concat(), &[&types[..], &[1]].concat())).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
    // Token types shorter than the token list.
    let err = tokenizer_of(spm_vocab(&base, &types[..3])).unwrap_err();
    assert!(matches!(err, TokError::BadVocab { key: "tokenizer.ggml.token_type", .. }), "{err}");
    // An unknown pre-tokenizer is named.
    let bpe = GgufBuilder::new()
        .kv("tokenizer.ggml.model", Val::str("gpt2"))
        .kv("tokenizer.ggml.pre", Val::str("tekken"))
        .kv("tokenizer.ggml.tokens", Val::strs(&["a", "b"]))
        .kv("tokenizer.ggml.merges", Val::strs(&["a b"]))
        .bytes();
    let err = tokenizer_of(bpe).unwrap_err();
    assert!(err.to_string().contains("\"tekken\""), "{err}");
    // Storage too small.
    let bytes = spm_vocab(&base, &types);
    let g = Gguf::parse(&bytes).unwrap();
    let need = Tokenizer::storage_words(&g).unwrap();
    let mut storage = vec![0u32; need - 1];
    assert_eq!(
        Tokenizer::new(&g, &mut storage).unwrap_err(),
        TokError::StorageTooSmall { needed: need, got: need - 1 }
    );
}

#[test]
fn spm_without_byte_tokens_reports_the_byte() {
    // No <0xNN> tokens: a character the vocabulary lacks cannot fall back.
    let tok =
        tokenizer_of(spm_vocab(&["<unk>", "<s>", "</s>", "▁a", "a", "▁"], &[2, 3, 3, 1, 1, 1])).unwrap();
    assert_eq!(encode(tok, "a a", false, false), [3, 3]);
    let mut out = [0u32; 8];
    assert_eq!(tok.encode("é", false, false, &mut out), Err(TokError::MissingByteToken { byte: 0xC3 }));
}

/// Table build time and encode throughput (release numbers: `cargo test --release --test tokenizer
/// -- --ignored --nocapture perf`).
#[test]
#[ignore]
fn perf_report() {
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .unwrap_or_else(|_| "lorem ipsum ".repeat(3000));
    let mut big = String::new();
    while big.len() < 1 << 20 {
        big.push_str(&text);
    }
    for (name, path) in [
        ("SmolLM2 (49k, smollm)", model_path("SmolLM2-135M-Instruct.Q4_1.gguf")),
        ("Llama 3 (128k, llama-bpe)", vocab_dir().join("ggml-vocab-llama-bpe.gguf")),
        ("Qwen2 (152k, qwen2)", vocab_dir().join("ggml-vocab-qwen2.gguf")),
        ("Gemma 3 (262k, SPM)", model_path("gemma-3-270m-q4_k_m.gguf")),
    ] {
        let bytes = std::fs::read(&path).unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        let words = Tokenizer::storage_words(&g).unwrap();
        // Best of several runs: the machine is shared.
        // The storage is reused, so its pages are already mapped after the first build.
        let (mut build, mut cold) = (Duration::MAX, Duration::ZERO);
        let mut storage = vec![0u32; words];
        for i in 0..5 {
            let t0 = Instant::now();
            Tokenizer::new(&g, &mut storage).unwrap();
            let t = t0.elapsed();
            if i == 0 {
                cold = t; // includes first-touch page faults of the fresh storage
            }
            build = build.min(t);
        }
        let mut storage = vec![0u32; words];
        let tok = Tokenizer::new(&g, &mut storage).unwrap();
        let mut scratch = vec![0u32; tok.scratch_words(big.len())];
        let mut out = vec![0u32; big.len()];
        let (mut enc, mut n) = (Duration::MAX, 0);
        for _ in 0..3 {
            let t0 = Instant::now();
            n = tok.encode_with_scratch(&big, false, false, &mut out, &mut scratch).unwrap();
            enc = enc.min(t0.elapsed());
        }
        println!(
            "{name}: storage {:.1} MiB, build {:.1} ms (first {:.1} ms), encode {:.2} MB in {:.1} ms = {:.1} MB/s \
             ({n} tokens)",
            words as f64 * 4.0 / (1 << 20) as f64,
            build.as_secs_f64() * 1e3,
            cold.as_secs_f64() * 1e3,
            big.len() as f64 / 1e6,
            enc.as_secs_f64() * 1e3,
            big.len() as f64 / 1e6 / enc.as_secs_f64()
        );
    }
}

/// Text made of the bytes special tokens start and end with (Gemma 3's user-defined runs of spaces
/// and newlines, HTML tags) keeps the partition linear too.
#[test]
fn hostile_special_token_patterns_are_fast() {
    let gemma = load(&model_path("gemma-3-270m-q4_k_m.gguf"));
    let size = if emulated() { 30_000 } else { 200_000 };
    let limit = Duration::from_secs(if emulated() { 60 } else { 10 });
    for pat in ["<>", "< >", "<b>", "\n \n", " \n", "<unused1>", "<a<b>>", "\n\n\n\n\n "] {
        let text = pat.repeat(size / pat.len());
        for parse_special in [false, true] {
            let t0 = Instant::now();
            let ids = encode(gemma, &text, parse_special, false);
            assert!(t0.elapsed() < limit, "{pat:?}: {:?}", t0.elapsed());
            if !parse_special {
                assert_eq!(String::from_utf8_lossy(&decode(gemma, &ids)), text);
            }
        }
    }
}

/// Random small vocabularies (any token types, empty and non-UTF-8 texts, malformed byte tokens and
/// merges, odd special ids) and random text: building either refuses with an error or gives a
/// tokenizer that encodes and decodes anything without panicking.
#[test]
fn random_vocabularies_never_panic() {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n.max(1)
    };
    let alphabet: [&[u8]; 14] = [
        b"a",
        b"b",
        b" ",
        b"\n",
        "▁".as_bytes(),
        "é".as_bytes(),
        b"<",
        b">",
        b"<0x41>",
        b"<0x-1>",
        b"\xff",
        b"",
        "Ġ".as_bytes(),
        b"1",
    ];
    let (mut built, mut refused) = (0, 0);
    for round in 0..600 {
        let n = 1 + next(40) as usize;
        let tokens: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let mut t: Vec<u8> =
                    (0..next(4)).flat_map(|_| alphabet[next(14) as usize].to_vec()).collect();
                if next(3) == 0 {
                    t.extend_from_slice(format!("{i}").as_bytes()); // mostly unique
                }
                t
            })
            .collect();
        let mut b = GgufBuilder::new()
            .kv("tokenizer.ggml.model", Val::str(["llama", "gpt2", "gemma4", "bert"][round % 4]))
            .kv(
                "tokenizer.ggml.tokens",
                Val::Array(tag::STRING, tokens.iter().map(|t| Val::Str(t.clone())).collect()),
            )
            .kv(
                "tokenizer.ggml.token_type",
                Val::Array(tag::I32, (0..n).map(|_| Val::I32(next(8) as i32 - 1)).collect()),
            )
            .kv(
                "tokenizer.ggml.scores",
                Val::Array(tag::F32, (0..n).map(|_| Val::F32(next(100) as f32 - 50.0)).collect()),
            );
        let merges: Vec<Vec<u8>> = (0..next(30))
            .map(|_| {
                let (a, c) = (&tokens[next(n as u64) as usize], &tokens[next(n as u64) as usize]);
                [a.as_slice(), if next(5) == 0 { b"" } else { b" " }, c.as_slice()].concat()
            })
            .collect();
        b = b
            .kv("tokenizer.ggml.merges", Val::Array(tag::STRING, merges.into_iter().map(Val::Str).collect()));
        b = b.kv("tokenizer.ggml.bos_token_id", Val::U32(next(n as u64 + 3) as u32));
        // WordPiece's [SEP] and [UNK] (its defaults, 102 and 100, are outside these vocabularies).
        b = b.kv("tokenizer.ggml.seperator_token_id", Val::U32(next(n as u64 + 3) as u32));
        b = b.kv("tokenizer.ggml.unknown_token_id", Val::U32(next(n as u64 + 3) as u32));
        if next(2) == 0 {
            b = b.kv("tokenizer.ggml.add_bos_token", Val::Bool(next(2) as u8));
        }
        let tok = match tokenizer_of(b.bytes()) {
            Ok(t) => t,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
                continue;
            }
        };
        built += 1;
        for _ in 0..20 {
            let text: String = (0..next(30))
                .map(|_| {
                    ["a", "b", " ", "  ", "\n", "é", "日", "<", ">", "1", "'s", "\u{2581}"][next(12) as usize]
                })
                .collect();
            let mut out = vec![0u32; 4 * text.len() + 4];
            let mut scratch = vec![0u32; tok.scratch_words(text.len())];
            for (ps, add) in [(false, false), (true, true)] {
                match tok.encode_with_scratch(&text, ps, add, &mut out, &mut scratch) {
                    Ok(k) => {
                        let mut buf = vec![0u8; k * tok.max_piece_len() + 8];
                        tok.decode(&out[..k], true, &mut buf).unwrap();
                    }
                    Err(e) => assert!(matches!(e, TokError::MissingByteToken { .. }), "{e}"),
                }
            }
            let id = next(u64::from(tok.n_vocab()) + 2) as u32;
            let mut d = StreamDecoder::new();
            let mut buf = vec![0u8; StreamDecoder::buffer_len(tok)];
            let _ = d.push(tok, id, true, &mut buf);
            let _ = tok.token_to_piece(id, false, &mut buf);
        }
    }
    assert!(built > 50 && refused > 10, "built {built}, refused {refused}");
}

/// The std front ends' tokenizer (`OwnedTokenizer`, its tables in a buffer it owns) gives the ids
/// and the refusals the one over caller storage gives, after being moved and from another thread.
#[test]
fn an_owned_tokenizer_is_the_caller_storage_one() {
    let path = model_path("SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let borrowed = load(&path);
    let owned = vec![OwnedTokenizer::new(&g).unwrap()];
    let text = "Hello world, <|im_start|>user\nnaïve café 12345";
    let want = encode(borrowed, text, true, true);
    assert!(want.len() > 8, "{want:?}");
    let moved = std::thread::scope(|s| s.spawn(move || owned).join().unwrap());
    assert_eq!(encode(&moved[0], text, true, true), want);
    assert_eq!(moved[0].n_vocab(), borrowed.n_vocab());

    let refused = spm_vocab(&["<unk>", "<s>", "<s>"], &[2, 3, 3]);
    let g = Gguf::parse(&refused).unwrap();
    assert_eq!(OwnedTokenizer::new(&g).unwrap_err(), tokenizer_of(refused.clone()).unwrap_err());
}
