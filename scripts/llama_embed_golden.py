#!/usr/bin/env python3
"""Runs llama.cpp's llama-embedding on a model for the inputs of a text file (one a line) and writes
its output as a golden: the command, the model's SHA-256, llama.cpp's token ids per input (from
--verbose-prompt) and its vectors (as llama-embedding prints them: 7 decimals).

  python3 scripts/llama_embed_golden.py MODEL INPUTS.txt OUT.json [LLAMA_EMBEDDING_ARGS...]

e.g. `--pooling mean --embd-normalize 2`. Always added: `-t 2 --embd-output-format json
--verbose-prompt -f INPUTS.txt`. With `--pooling none` the vectors are one per token (all inputs'
tokens in order); with `--pooling rank` one score row per input (inputs as `query\\tdocument`, llama.cpp's
default --cls-separator). llama-embedding comes from scripts/llama_cpp_build.sh's build
(LLAMA_CPP_BIN=DIR names another).
"""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parent.parent


def llama_bin():
    if os.environ.get("LLAMA_CPP_BIN"):
        return Path(os.environ["LLAMA_CPP_BIN"])
    out = subprocess.run([str(ROOT / "scripts/llama_cpp_build.sh")], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def run(model, inputs, extra):
    exe = llama_bin() / "llama-embedding"
    args = ["-m", str(model), "-f", str(inputs), "-t", "2", "--embd-output-format", "json", "--verbose-prompt",
            *extra]
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, encoding="utf-8", errors="replace")
    if p.returncode != 0:
        sys.exit(f"llama-embedding failed ({p.returncode}):\n{p.stderr[-3000:]}")
    counts = [int(n) for n in re.findall(r"number of tokens in prompt = (\d+)", p.stderr)]
    start = p.stdout.index('{\n  "object": "list"')
    token_lines = re.findall(r"^ *(-?\d+) -> '", p.stdout[:start], flags=re.M)
    flat = [int(t) for t in token_lines]
    if sum(counts) != len(flat):
        sys.exit(f"token listing has {len(flat)} ids, the prompts {sum(counts)}")
    ids, at = [], 0
    for n in counts:
        ids.append(flat[at:at + n])
        at += n
    # (for rank pooling llama-embedding prints n_embd values of which only the first n_cls_out are
    # written: the rest is whatever the buffer held, nan included)
    printed = re.sub(r"-?\b(nan|inf)\b", "0", p.stdout[start:])
    data = json.JSONDecoder().raw_decode(printed)[0]["data"]
    vectors = [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]
    if rank_outputs(model, extra):
        vectors = [v[:rank_outputs(model, extra)] for v in vectors]
    return "llama-embedding " + " ".join(args), ids, vectors


def rank_outputs(model, extra):
    """n_cls_out when the run pools by rank (--pooling rank, or the file's pooling_type 4), else 0."""
    fields = gguf.GGUFReader(model).fields
    arch = fields["general.architecture"].contents()
    pooling = fields[f"{arch}.pooling_type"].contents() if f"{arch}.pooling_type" in fields else 0
    if "--pooling" in extra:
        pooling = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}[extra[extra.index("--pooling") + 1]]
    if pooling != 4:
        return 0
    labels = f"{arch}.classifier.output_labels"
    return len(fields[labels].contents()) if labels in fields else 1


def main():
    model, inputs, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    command, ids, vectors = run(model, inputs, sys.argv[4:])
    lines = inputs.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # (llama.cpp's -f drops one trailing newline)
    if len(ids) != len(lines):
        sys.exit(f"llama-embedding saw {len(ids)} inputs, the file has {len(lines)} lines")
    golden = {
        "llama_cpp": "0c1e570 (llama-cpp-python 0.3.36 sdist, x86_64 AVX2 build of scripts/llama_cpp_build.sh)",
        "command": command.replace(str(ROOT) + "/", ""),
        "model": model.name,
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "inputs": lines,
        "ids": ids,
        "vectors": vectors,
    }
    out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{out}: {len(lines)} inputs, {len(vectors)} vectors of {len(vectors[0])}")


if __name__ == "__main__":
    main()
