#!/usr/bin/env python3
"""Runs llama.cpp's llama-server as a reranker (`--rerank`) on a model, posts each request of a JSON file
to its /rerank route (and the first one also to /v1/rerank) and writes the answers as a golden with the
command, the model's SHA-256 and each request beside its response.

  python3 scripts/llama_rerank_golden.py MODEL REQUESTS.json OUT.json

REQUESTS.json: a list of /rerank bodies ({"query", "documents", optional "top_n", "return_documents"}).
The server comes from scripts/llama_cpp_build.sh's build (LLAMA_CPP_BIN=DIR names another); it listens
on 127.0.0.1 at a free port and is stopped at the end.
"""
import hashlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_embed_golden import ROOT, llama_bin  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, route, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    model, requests_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    requests = json.loads(requests_path.read_text(encoding="utf-8"))
    port = free_port()
    args = ["-m", str(model), "--rerank", "-t", "2", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen([str(llama_bin() / "llama-server"), *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("llama-server did not come up")
        answers = [{"route": "/rerank", "request": body, "response": post(port, "/rerank", body)}
                   for body in requests]
        answers.append({"route": "/v1/rerank", "request": requests[0],
                        "response": post(port, "/v1/rerank", requests[0])})
    finally:
        server.terminate()
        server.wait(timeout=30)
    golden = {
        "llama_cpp": "0c1e570 (llama-cpp-python 0.3.36 sdist, x86_64 AVX2 build of scripts/llama_cpp_build.sh)",
        "command": "llama-server " + " ".join(args).replace(str(ROOT) + "/", "").replace(str(port), "PORT"),
        "model": model.name,
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "answers": answers,
    }
    out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(answers)} answers")


if __name__ == "__main__":
    main()
