#!/usr/bin/env python3
"""Writes a llama.cpp greedy golden file (the format of tests/golden/*.greedy.jsonl): for a model the
shared goldens do not cover, or (--arm) from llama.cpp's aarch64 build, with the host's llama.cpp at the goldens' build (0c1e570, from
`pip install llama-cpp-python==0.3.36`) in the goldens' configuration: flash attention on, weights
repacked, 2 threads, n_ctx 256.

    python3 scripts/make_golden.py MODEL.gguf PROMPTS.jsonl OUT.greedy.jsonl [--steps 24] [--arm REPLAY]

With --arm, the same from llama.cpp's aarch64 build (scripts/llama_replay.c under qemu-aarch64 -cpu
cortex-a76; see scripts/golden_spread.py for building it).

PROMPTS.jsonl: lines with "prompt" and "prompt_ids" (e.g. another model's golden of the same
vocabulary). Greedy decoding stops early at an end-of-generation token (tokenizer.ggml.eos_token_id,
eot_token_id or eom_token_id: not appended to generated_ids, but its step has a margin). Run once and commit the output; never a
dependency of pinfer or its CI.
"""
import argparse
import json

import gguf
import numpy as np

from llama_ref import logits

TOP5_STEPS = 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("dest")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--arm", metavar="REPLAY", help="aarch64 scripts/llama_replay.c, run under qemu")
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.model)
    eog = {int(reader.fields[k].parts[-1][0]) for k in
           ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if k in reader.fields}
    prompts = [json.loads(line) for line in open(args.prompts)]
    plans = [(p["prompt_ids"], [], args.steps) for p in prompts]
    runs = logits(args.model, 1, True, plans, args.arm)
    with open(args.dest, "w") as f:
        for p, steps in zip(prompts, runs):
            ids, margins, top5 = [], [], []
            for i, row in enumerate(steps):
                order = np.argsort(-row, kind="stable")
                margins.append(round(float(row[order[0]] - row[order[1]]), 4))
                if i < TOP5_STEPS:
                    top5.append([[int(t), round(float(row[t]), 4)] for t in order[:5]])
                if int(order[0]) in eog:
                    break
                ids.append(int(order[0]))
            rec = {"prompt": p["prompt"], "prompt_ids": p["prompt_ids"], "generated_ids": ids,
                   "margins": margins, "top5": top5}
            f.write(json.dumps(rec) + "\n")
    print("wrote", args.dest)


if __name__ == "__main__":
    main()
