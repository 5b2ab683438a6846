#!/usr/bin/env bash
# Lookup decoding (`--lookup N`) beside plain decoding on an input-grounded task (repeat a JSON
# document with one edit, greedy), in interleaved rounds: decode tokens/s of both, the share of
# guesses taken, and whether the texts are the same.
#
#   scripts/lookup_bench.sh [-m MODEL] [-n TOKENS] [--lookup N] [-t THREADS] [--rounds R]
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
N=160
LOOKUP=8
THREADS=2
ROUNDS=3
while [ $# -gt 0 ]; do
  case "$1" in
    -m) MODEL=$2; shift 2 ;;
    -n) N=$2; shift 2 ;;
    --lookup) LOOKUP=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "lookup_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
cargo build --release --bin pinfer -q
PINFER=target/release/pinfer
DOC='{"devices": [{"name": "Kitchen light", "room": "kitchen", "state": "off", "brightness": 80, "color": "warm white"}, {"name": "Hall fan", "room": "hall", "state": "on", "speed": 2}, {"name": "Desk lamp", "room": "office", "state": "off", "brightness": 40, "color": "daylight"}], "schedule": {"weekdays": {"on": "07:00", "off": "23:00"}, "weekend": {"on": "09:00", "off": "23:30"}}}'
PROMPT="<|im_start|>user
Repeat this JSON exactly, with the kitchen light's state set to on:
$DOC<|im_end|>
<|im_start|>assistant
"
tps() { sed -n 's/.* eval time .*(.*ms per token, *\([0-9.]*\) tokens per second).*/\1/p' "$1" | tail -1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((r = 0; r < ROUNDS; r++)); do
  "$PINFER" generate -m "$MODEL" -p "$PROMPT" -n "$N" --temp 0 -t "$THREADS" --no-display-prompt \
    > "$out/plain.txt" 2> "$out/plain.err"
  "$PINFER" generate -m "$MODEL" -p "$PROMPT" -n "$N" --temp 0 -t "$THREADS" --no-display-prompt \
    --lookup "$LOOKUP" > "$out/lookup.txt" 2> "$out/lookup.err"
  same=$(cmp -s "$out/plain.txt" "$out/lookup.txt" && echo same || echo DIFFERENT)
  taken=$(grep -o 'lookup: .*' "$out/lookup.err")
  echo "round $r: plain $(tps "$out/plain.err") tok/s, --lookup $LOOKUP $(tps "$out/lookup.err") tok/s; text $same; $taken"
done
