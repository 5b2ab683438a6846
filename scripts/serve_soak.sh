#!/usr/bin/env bash
# Soak test of `pinfer serve`: CLIENTS concurrent streaming clients (scripts/serve_bench.py) for
# MINUTES, then the figures that say whether a server can be left running: failed requests, the
# server's RSS after the first round and at the end (growth should stay under 2%), and whether it
# still answers /health and the same greedy completion as at the start.
#
#   scripts/serve_soak.sh [-m MODEL] [-t THREADS] [--clients 8] [--minutes 10]
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
THREADS=2
CLIENTS=8
MINUTES=10
while [ $# -gt 0 ]; do
  case "$1" in
    -m) MODEL=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --minutes) MINUTES=$2; shift 2 ;;
    *) echo "serve_soak: unknown option $1" >&2; exit 2 ;;
  esac
done
log() { echo "serve_soak: $*" >&2; }

cargo build --release --bin pinfer -q
PORT=18441
target/release/pinfer serve -m "$MODEL" --port $PORT -t "$THREADS" -np "$CLIENTS" -c $((1024 * CLIENTS)) 2>/dev/null &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")" = 200 ] && break
  sleep 0.2
done
greedy() {
  curl -s "http://127.0.0.1:$PORT/completion" \
    -d '{"prompt":"The capital of France is","n_predict":16,"temperature":0,"cache_prompt":false}' | jq -r .content
}
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }
before=$(greedy)
python3 scripts/serve_bench.py "http://127.0.0.1:$PORT" "$CLIENTS" 2 64 >/dev/null
rss0=$(rss)
end=$((SECONDS + 60 * MINUTES))
rounds=0 failed=0 tokens=0
while [ $SECONDS -lt $end ]; do
  r=$(python3 scripts/serve_bench.py "http://127.0.0.1:$PORT" "$CLIENTS" 4 64)
  failed=$((failed + $(jq .failed <<<"$r")))
  tokens=$((tokens + $(jq .tokens <<<"$r")))
  rounds=$((rounds + 1))
done
rss1=$(rss)
after=$(greedy)
health=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")
same=no; [ "$before" = "$after" ] && same=yes
awk -v r="$rounds" -v c="$CLIENTS" -v f="$failed" -v t="$tokens" -v a="$rss0" -v b="$rss1" -v h="$health" -v s="$same" -v m="$MINUTES" 'BEGIN {
  printf "soak: %d min, %d clients, %d rounds, %d tokens, %d failed requests; RSS %.1f -> %.1f MiB (%+.2f%%); /health %s; greedy output unchanged: %s\n",
    m, c, r, t, f, a / 1024, b / 1024, 100 * (b - a) / a, h, s }'
[ "$failed" = 0 ] && [ "$health" = 200 ] && [ "$same" = yes ]
