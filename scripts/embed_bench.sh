#!/usr/bin/env bash
# Embedding throughput, side by side (not in CI): N sentences through llama-server --embedding's
# /v1/embeddings and through pinfer serve --embedding's, same GGUF, same threads, one client sending
# BATCH inputs per request; prints inputs/s, the server's CPU time per input and its peak RSS (VmHWM).
#
#   scripts/embed_bench.sh [MODEL] [N] [BATCH]
#     MODEL  default models/all-MiniLM-L6-v2.F16.gguf (scripts/setup.sh minilm)
#     N      sentences, default 200 (tests/golden/embeddings/sentences.txt, numbered so none repeats)
#     BATCH  inputs per request, default 8
#   THREADS=2 (both servers), LLAMA_CPP_BIN=DIR (llama.cpp's build, else scripts/llama_cpp_build.sh),
#   PINFER_CMD='target/release/pinfer serve --embedding -m {model} --host 127.0.0.1 --port {port} -t {threads}'
#   ({model}, {port}, {threads} are filled in). pinfer's side is skipped, with a note, when it does not
#   start or its /v1/embeddings answers 404 (before pinfer has the route).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/all-MiniLM-L6-v2.F16.gguf}
N=${2:-200}
BATCH=${3:-8}
THREADS=${THREADS:-2}
PINFER_CMD=${PINFER_CMD:-'target/release/pinfer serve --embedding -m {model} --host 127.0.0.1 --port {port} -t {threads}'}
[ -f "$MODEL" ] || scripts/setup.sh minilm
bin=$(scripts/llama_cpp_build.sh)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# bench NAME PORT PID: waits for the server, runs the client, prints the result line; status 2 = no route.
bench() {
  local name=$1 port=$2 pid=$3
  python3 - "$name" "$port" "$pid" "$N" "$BATCH" "$MODEL" <<'PYEOF'
import json, os, sys, time, urllib.error, urllib.request
name, port, pid, n, batch, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
base = f"http://127.0.0.1:{port}"
lines = [l for l in open("tests/golden/embeddings/sentences.txt", encoding="utf-8").read().split("\n") if l]
inputs = [f"{i}. {lines[i % len(lines)]}" for i in range(n)]

def post(body):
    req = urllib.request.Request(base + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())

def alive():
    try:
        open(f"/proc/{pid}/status").close()
        return True
    except OSError:
        return False

for _ in range(1200):
    if not alive():
        print(f"{name}: the server exited before it answered"); sys.exit(2)
    try:
        post({"input": ["warm up"], "model": model})
        break
    except urllib.error.HTTPError as e:
        if e.code == 404:
            print(f"{name}: /v1/embeddings answers 404, skipped"); sys.exit(2)
        time.sleep(0.1)
    except OSError:
        time.sleep(0.1)
else:
    print(f"{name}: no answer from {base}"); sys.exit(2)
def cpu_seconds():
    """The server's user + system CPU time so far (a figure less sensitive than wall time to other
    load on the machine; llama.cpp's spinning threads count in it)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

start, cpu0 = time.perf_counter(), cpu_seconds()
tokens = 0
for i in range(0, n, batch):
    out = post({"input": inputs[i:i + batch], "model": model})
    assert len(out["data"]) == len(inputs[i:i + batch]), out
    tokens += out.get("usage", {}).get("prompt_tokens", 0)
dt, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
hwm = next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM"))
print(f"{name}: {n} inputs ({tokens} tokens) in {dt:.2f} s = {n / dt:.1f} inputs/s, server CPU {cpu:.2f} s "
      f"({1000 * cpu / n:.1f} ms/input), peak RSS {int(hwm) / 1024:.1f} MiB")
PYEOF
}

run_server() { # NAME CMD...: starts the server, benches it, stops it
  local name=$1; shift
  local port=$1; shift
  "$@" >/dev/null 2>"target/embed_bench.$name.log" &
  local pid=$!
  local rc=0
  bench "$name" "$port" "$pid" || rc=$?
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  [ $rc -eq 2 ] && echo "($name's log: target/embed_bench.$name.log)"
  return 0
}

mkdir -p target
echo "model $MODEL, $N inputs, $BATCH per request, $THREADS threads"
port=$(free_port)
run_server llama-server "$port" "$bin/llama-server" -m "$MODEL" --embedding --pooling mean -t "$THREADS" \
  --host 127.0.0.1 --port "$port"
port=$(free_port)
cmd=${PINFER_CMD//\{model\}/$MODEL}
cmd=${cmd//\{port\}/$port}
cmd=${cmd//\{threads\}/$THREADS}
# shellcheck disable=SC2086 # the command is words by design
run_server pinfer "$port" $cmd
