#!/usr/bin/env python3
"""Writes tests/golden/smollm2.context_shift.jsonl: llama.cpp's greedy run through a context shift.

llama-server (this llama.cpp's only front end with a context shift) pads its context to 256
positions; with --context-shift it drops half of what follows n_keep when a slot's next token
would leave no free position. Each line: prompt, prompt_ids, n_ctx, n_keep, the generated ids
and, per step, the margin between the best and second-best logit (from the top-2 log-probs: a
log-probability gap is the logit gap).

  scripts/make_context_shift_golden.py LLAMA_SERVER MODEL [OUT]
"""
import json
import subprocess
import sys
import time
import urllib.request

N_CTX, N_PREDICT, PORT = 256, 320, 18777
PROMPTS = ["Once upon a time", "The history of the Roman Empire"]


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def main():
    server, model = sys.argv[1], sys.argv[2]
    out = sys.argv[3] if len(sys.argv) > 3 else "tests/golden/smollm2.context_shift.jsonl"
    proc = subprocess.Popen([server, "-m", model, "-c", str(N_CTX), "-np", "1", "--context-shift",
                             "-t", "2", "--port", str(PORT)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.5)
        lines = []
        for prompt in PROMPTS:
            ids = post("/tokenize", {"content": prompt, "add_special": True})["tokens"]
            r = post("/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                     "n_probs": 2, "cache_prompt": False, "n_keep": 0})
            assert r["truncated"], "the run did not reach a context shift"
            steps = r["completion_probabilities"]
            lines.append({
                "prompt": prompt, "prompt_ids": ids, "n_ctx": N_CTX, "n_keep": 0,
                "generated_ids": [s["id"] for s in steps],
                "margins": [round(s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"], 4)
                            for s in steps],
            })
        with open(out, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
