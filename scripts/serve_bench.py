#!/usr/bin/env python3
"""Load benchmark of an OpenAI-compatible server: C concurrent streaming clients, each sending
R chat requests one after another (greedy, fixed max_tokens, ignore_eos so every stream is as
long), and the figures that matter for a shared board: aggregate generated tokens/s, time to first
token p50/p99, per-stream tokens/s. scripts/serve_bench.sh runs it against `pinfer serve -np C`
and `llama-server -np C` side by side; by hand:

    scripts/serve_bench.py URL CLIENTS [REQUESTS_PER_CLIENT] [MAX_TOKENS]

Prints one JSON line: {"clients", "requests", "failed", "tokens", "seconds", "aggregate_tps",
"ttft_p50_ms", "ttft_p99_ms", "stream_tps_p50"}.
"""
import json
import sys
import threading
import time
import urllib.request

URL = sys.argv[1]
CLIENTS = int(sys.argv[2])
REQUESTS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
MAX_TOKENS = int(sys.argv[4]) if len(sys.argv) > 4 else 64
TOPICS = ["dragons", "the sea", "a city at night", "winter", "robots", "a garden", "the moon", "trains"]


def one(client, i, out):
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Tell a long story about {TOPICS[(client + i) % len(TOPICS)]}."}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        "cache_prompt": False,
    }).encode()
    req = urllib.request.Request(f"{URL}/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, n = None, 0
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    if c.get("delta", {}).get("content"):
                        n += 1
                        if first is None:
                            first = time.perf_counter()
        end = time.perf_counter()
        out.append({"ok": True, "ttft": (first or end) - start, "tokens": n, "stream": (end - (first or end))})
    except Exception as e:  # a failed request is counted, not fatal
        out.append({"ok": False, "error": str(e)})


def client(c, out):
    for i in range(REQUESTS):
        one(c, i, out)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else 0.0


def main():
    out = []
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c, out)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    ok = [r for r in out if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    streams = [(r["tokens"] - 1) / r["stream"] for r in ok if r["stream"] > 0 and r["tokens"] > 1]
    print(json.dumps({
        "clients": CLIENTS,
        "requests": len(out),
        "failed": len(out) - len(ok),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "aggregate_tps": round(tokens / seconds, 2),
        "ttft_p50_ms": round(1e3 * pct([r["ttft"] for r in ok], 50), 1),
        "ttft_p99_ms": round(1e3 * pct([r["ttft"] for r in ok], 99), 1),
        "stream_tps_p50": round(pct(streams, 50), 2),
    }))


if __name__ == "__main__":
    main()
