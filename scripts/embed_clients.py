#!/usr/bin/env python3
"""Asks a running embedding server for all-MiniLM-L6-v2's vectors of the 50 golden sentences through the
real `openai` (`embeddings.create`) and `ollama` (`embed`) Python clients (the versions scripts/setup.sh
pins), and compares them with the float64 reference (tests/golden/embeddings/minilm-reference.json).

  python3 scripts/embed_clients.py URL [--min-cosine C] [--clients openai,ollama]

e.g. `pinfer serve --embedding -m models/all-MiniLM-L6-v2.F16.gguf --port 8080 &` then
`scripts/embed_clients.py http://127.0.0.1:8080 --min-cosine 0.9999`. Prints, per client, the minimum
cosine over all sentences and over those whose llama.cpp ids equal HF's (llama.cpp tokenizes sentence
21 differently; a server following HF has no such exception). Exit status 1 when a client's minimum over
all sentences is below C (default 0.9999), or its answer has the wrong shape.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent.parent / "tests/golden/embeddings"


def cosines(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def via_openai(url, sentences):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=sentences)
    if [d.index for d in r.data] != list(range(len(sentences))):
        sys.exit("embed_clients: openai: data not one entry per input in order")
    return [d.embedding for d in r.data]


def via_ollama(url, sentences):
    import ollama

    r = ollama.Client(host=url).embed(model="all-MiniLM-L6-v2", input=sentences)
    return r.embeddings


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--min-cosine", type=float, default=0.9999)
    ap.add_argument("--clients", default="openai,ollama")
    args = ap.parse_args()
    ref = json.loads((GOLDEN / "minilm-reference.json").read_text(encoding="utf-8"))
    llama = json.loads((GOLDEN / "minilm-f16.llama.json").read_text(encoding="utf-8"))
    same_ids = [a == b for a, b in zip(ref["ids"], llama["ids"])]
    failed = False
    for name in args.clients.split(","):
        got = {"openai": via_openai, "ollama": via_ollama}[name](args.url, ref["sentences"])
        if len(got) != len(ref["sentences"]) or any(len(v) != 384 for v in got):
            sys.exit(f"embed_clients: {name}: {len(got)} vectors, not 50 of 384")
        c = cosines(got, ref["embeddings"])
        worst = int(c.argmin())
        print(f"{name}: min cosine {c.min():.7f} (sentence {worst}), "
              f"{c[same_ids].min():.7f} over the {sum(same_ids)} with llama.cpp's ids")
        failed |= c.min() < args.min_cosine
    if failed:
        sys.exit(f"embed_clients: FAILED: a minimum below {args.min_cosine}")
    print("embed_clients: ok")


if __name__ == "__main__":
    main()
