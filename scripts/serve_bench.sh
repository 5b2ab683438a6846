#!/usr/bin/env bash
# `pinfer serve` beside `llama-server` under load: for 1, 4 and 8 concurrent streaming clients
# (scripts/serve_bench.py: greedy chats of a fixed length), each server started with -np CLIENTS,
# the same model, threads and context per slot, the two run alternately. Prints a Markdown table:
# aggregate generated tokens/s, time to first token p50/p99, per-stream tokens/s, failures.
#
#   scripts/serve_bench.sh [-m MODEL] [-t THREADS] [--clients 1,4,8] [--requests N] [--tokens N]
#
# llama-server comes from the llama.cpp build of scripts/scale_bench.sh (target/llama.cpp/build/bin,
# built here if missing: AVX2/FMA/F16C) or LLAMA_CPP_BIN=DIR. Never a dependency of pinfer or its CI.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
THREADS=2
CLIENTS=1,4,8
REQUESTS=3
TOKENS=64
CTX_PER_SLOT=1024
while [ $# -gt 0 ]; do
  case "$1" in
    -m) MODEL=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    *) echo "serve_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
log() { echo "serve_bench: $*" >&2; }

BIN=${LLAMA_CPP_BIN:-target/llama.cpp/build/bin}
if [ ! -x "$BIN/llama-server" ]; then
  [ -d target/llama.cpp/build ] || { log "no llama.cpp build: run scripts/scale_bench.sh once (it builds llama.cpp)"; exit 1; }
  log "building llama-server"
  cmake --build target/llama.cpp/build --target llama-server -j "$(nproc)" >&2
fi
cargo build --release --bin pinfer -q
PORT=18431
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# wait_ready PORT: until /health answers 200
wait_ready() {
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health")" = 200 ] && return 0
    sleep 0.2
  done
  log "server on port $1 did not become ready"; exit 1
}

printf '| server | clients | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | per-stream tok/s | failed |\n'
printf '|---|---:|---:|---:|---:|---:|---:|\n'
for c in ${CLIENTS//,/ }; do
  ctx=$((CTX_PER_SLOT * c))
  target/release/pinfer serve -m "$MODEL" --port $PORT -t "$THREADS" -np "$c" -c "$ctx" 2>/dev/null &
  PIDS+=($!); pinfer_pid=$!
  wait_ready $PORT
  "$BIN/llama-server" -m "$MODEL" --port $((PORT + 1)) -t "$THREADS" -np "$c" -c "$ctx" >/dev/null 2>&1 &
  PIDS+=($!); llama_pid=$!
  wait_ready $((PORT + 1))
  # Warm-up, then alternate: pinfer, llama-server, pinfer, llama-server.
  python3 scripts/serve_bench.py "http://127.0.0.1:$PORT" 1 1 8 >/dev/null
  python3 scripts/serve_bench.py "http://127.0.0.1:$((PORT + 1))" 1 1 8 >/dev/null
  for round in 1 2; do
    for who in pinfer llama-server; do
      port=$PORT; [ $who = llama-server ] && port=$((PORT + 1))
      r=$(python3 scripts/serve_bench.py "http://127.0.0.1:$port" "$c" "$REQUESTS" "$TOKENS")
      log "$who clients $c round $round: $r"
      jq -r --arg who "$who" '"| \($who) | \(.clients) | \(.aggregate_tps) | \(.ttft_p50_ms) | \(.ttft_p99_ms) | \(.stream_tps_p50) | \(.failed) |"' <<<"$r"
    done
  done
  kill "$pinfer_pid" "$llama_pid" 2>/dev/null || true
  wait "$pinfer_pid" "$llama_pid" 2>/dev/null || true
done
