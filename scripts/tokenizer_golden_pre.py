#!/usr/bin/env python3
"""Writes tests/golden/<NAME>.tokenize.jsonl for a pre-tokenizer no test vocabulary of llama.cpp's has:
the SmolLM2 vocabulary with `tokenizer.ggml.pre` set to PRE (as tests/tokenizer.rs's
`smollm2_vocab_with_pre` builds it: architecture qwen2, BOS 1, EOS 2, no BOS added), each text
tokenized by llama.cpp's `llama-tokenize --ids --no-parse-special`.

  scripts/tokenizer_golden_pre.py PRE OUT.jsonl [--llama-tokenize PATH]

Texts: those of tests/golden/qwen2-tiny.tokenize.jsonl, then the inputs of llama.cpp's
ggml-vocab-llama-bpe.gguf.inp (target/tokenizer-vocabs), then a few letter-case cases.
"""
import argparse, json, os, subprocess, sys, tempfile

import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = [
    "HTTPServerError XMLHttpRequest getHTTPResponseCode iPhone McDonald's",
    "ÄÖÜ straße ÉCOLE Ülker DŽungla ǅuro İstanbul",
    "it's IT'S It'S they'RE WE'LL 'tis 'S",
    "paths/like/this and\r\nlines/\n/ //x",
    "1234 12345 ١٢٣٤٥ x1y22z333",
    "\u00a0 nbsp\u2003em   \t\n\n  x",
    "e\u0301cole A\u0300B combining\u0301",
]


def vocab(pre, path):
    r = gguf.GGUFReader(os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    strings = lambda k: [bytes(r.fields[k].parts[i]) for i in r.fields[k].data]
    tt = r.fields["tokenizer.ggml.token_type"]
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", strings("tokenizer.ggml.tokens"))
    w.add_array("tokenizer.ggml.token_type", [int(tt.parts[i][0]) for i in tt.data])
    w.add_array("tokenizer.ggml.merges", strings("tokenizer.ggml.merges"))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def texts():
    out = [json.loads(l)["text"] for l in open(os.path.join(ROOT, "tests/golden/qwen2-tiny.tokenize.jsonl"))]
    inp = open(os.path.join(ROOT, "target/tokenizer-vocabs/ggml-vocab-llama-bpe.gguf.inp"), encoding="utf-8").read()
    out += [t for t in inp.split("\n__ggml_vocab_test__\n") if t and t not in out]
    return out + EXTRA


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pre")
    ap.add_argument("out")
    ap.add_argument("--llama-tokenize", default=os.path.join(ROOT, "target/llama.cpp/build/bin/llama-tokenize"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "vocab.gguf")
        vocab(a.pre, path)
        lines = []
        for t in texts():
            f = os.path.join(d, "text")
            with open(f, "wb") as fh:
                fh.write(t.encode("utf-8"))
            p = subprocess.run([a.llama_tokenize, "-m", path, "-f", f, "--ids", "--no-parse-special", "--log-disable"],
                               capture_output=True, text=True, check=True)
            ids = json.loads(p.stdout.strip().splitlines()[-1])
            lines.append(json.dumps({"text": t, "ids": ids}, ensure_ascii=False))
    with open(a.out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"{a.out}: {len(lines)} texts", file=sys.stderr)


if __name__ == "__main__":
    main()
