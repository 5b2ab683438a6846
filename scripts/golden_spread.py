#!/usr/bin/env python3
"""Measures how far llama.cpp disagrees with itself, to size the golden tests' tolerances.

The shared goldens (tests/golden/*.greedy.jsonl) come from one llama.cpp configuration: x86, flash
attention on, weights repacked for AVX. llama.cpp's other standard CPU configurations (flash attention
off; repacking off) sum in other orders, and single-ulp differences flip Q8 activation rounding, so its
own logits move by several tenths and greedy tokens change at margins well above the README's 0.05.
This script replays every golden prompt with the golden tokens forced (so every step sees the same
context) under those configurations and writes, per prompt:
  spread[i]      largest gap over the golden top-5 ids between any configuration and the golden (i < 8)
  flip_margins   golden margins at steps (before the first near-tie) where a configuration's argmax
                 is not the golden token
pinfer's portable kernels are one more such configuration; tests/golden.rs allows them the same.

With --arm REPLAY, the same for llama.cpp's aarch64 build (armv8.2-a+dotprod+fp16, the build of
tests/golden/README.md's instruction counts, flash attention in FEAT_FP16 arithmetic) under
qemu-aarch64 -cpu cortex-a76, against its own golden (NAME.arm.greedy.jsonl, scripts/make_golden.py
--arm): the yardstick of pinfer's `fp16` kernel path, which computes attention that way.

Run once and commit the output (needs llama.cpp at the goldens' build 0c1e570, which
`pip install llama-cpp-python==0.3.36` compiles; never a dependency of the project or CI):
    python3 scripts/golden_spread.py MODEL.gguf tests/golden/NAME.greedy.jsonl tests/golden/NAME.spread.jsonl
    python3 scripts/golden_spread.py MODEL.gguf tests/golden/NAME.arm.greedy.jsonl tests/golden/NAME.arm.spread.jsonl --arm REPLAY
REPLAY is scripts/llama_replay.c built against an aarch64 llama.cpp from the same source:
    cmake -B build -DCMAKE_TOOLCHAIN_FILE=aarch64.cmake -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \\
      -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama
    aarch64-linux-gnu-g++ -O2 -x c scripts/llama_replay.c -x none -Iinclude -Iggml/include \\
      -Wl,--start-group build/src/libllama.a build/ggml/src/libggml*.a -Wl,--end-group -static -lpthread -o llama_replay
"""
import argparse
import json

import numpy as np

from llama_ref import logits

TOP5_STEPS = 8
NEAR_TIE = 0.05
# (label, flash attention type (1 on, 0 off), repack weights)
CONFIGS = [("golden", 1, True), ("no_flash_attn", 0, True), ("no_repack", 1, False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("golden")
    ap.add_argument("dest")
    ap.add_argument("--arm", metavar="REPLAY", help="aarch64 scripts/llama_replay.c, run under qemu: measure that build")
    args = ap.parse_args()
    prompts = [json.loads(line) for line in open(args.golden)]
    # Golden tokens forced, so every configuration sees the same context at every step.
    plans = [(g["prompt_ids"], g["generated_ids"][:-1], len(g["generated_ids"])) for g in prompts]
    runs = {label: logits(args.model, fa, rp, plans, args.arm) for label, fa, rp in CONFIGS}
    with open(args.dest, "w") as f:
        for p, g in enumerate(prompts):
            ref = runs["golden"][p]
            # The replay must reproduce the golden file itself, or the comparison means nothing.
            for i, pair in enumerate(g["top5"]):
                for tok, logit in pair:
                    assert abs(ref[i][tok] - logit) < 1e-3, (g["prompt"], i, tok, ref[i][tok], logit)
            near = next((i for i, m in enumerate(g["margins"]) if m < NEAR_TIE), len(g["margins"]))
            spread = [0.0] * min(TOP5_STEPS, len(g["top5"]))
            flips = {}
            for label, _, _ in CONFIGS[1:]:
                alt = runs[label][p]
                for i in range(len(spread)):
                    ids = [tok for tok, _ in g["top5"][i]]
                    spread[i] = max(spread[i], float(np.max(np.abs(alt[i][ids] - ref[i][ids]))))
                for i in range(min(near, len(alt))):
                    if int(np.argmax(alt[i])) != g["generated_ids"][i]:
                        flips.setdefault(label, []).append([i, g["margins"][i]])
            rec = {"prompt": g["prompt"], "spread": [round(s, 4) for s in spread], "flips": flips}
            f.write(json.dumps(rec) + "\n")
    print("wrote", args.dest)


if __name__ == "__main__":
    main()
