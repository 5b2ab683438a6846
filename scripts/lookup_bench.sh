#!/usr/bin/env bash
# Lookup decoding (`--lookup N`) beside plain decoding on input-grounded tasks (greedy), in
# interleaved rounds: per task, decode tokens/s of both and their ratio, the share of guesses
# taken, and whether the texts are the same (they must be: a batch of guesses computes what single
# tokens would, on every kernel path).
#
#   scripts/lookup_bench.sh [-m MODEL | --wide] [-n TOKENS] [--lookup N] [-t THREADS] [--rounds R]
#
# Tasks: repeat a JSON document with one edit; copy a sentence out of a paragraph; rename a
# variable in a function. (A shape model's random weights repeat nothing: lookup needs a real
# model's text.) --wide: at a 1B model's size, SmolLM2-135M widened to Llama-3.2-1B's widths
# (1.27B weights, Q4_0, scripts/make_wide_model.py; made once into target/shape-models/ with
# llama-quantize from scripts/llama_cpp_build.sh): it writes SmolLM2's text and reads 653 MiB of
# weights per token.
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
    --wide) MODEL=target/shape-models/smollm2-wide-1b.Q4_0.gguf; shift ;;
    -n) N=$2; shift 2 ;;
    --lookup) LOOKUP=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "lookup_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ "$MODEL" = target/shape-models/smollm2-wide-1b.Q4_0.gguf ] && [ ! -f "$MODEL" ]; then
  scripts/setup.sh variants >&2  # the Q8_0 file: the widened model's source
  f16=target/shape-models/smollm2-wide-1b.f16.gguf
  mkdir -p target/shape-models
  python3 scripts/make_wide_model.py models/SmolLM2-135M-Instruct.Q8_0.gguf "$f16.tmp"
  mv "$f16.tmp" "$f16"
  "$(scripts/llama_cpp_build.sh)/llama-quantize" "$f16" "$MODEL.tmp" Q4_0 > "$MODEL.log" 2>&1
  mv "$MODEL.tmp" "$MODEL"
fi
cargo build --release --bin pinfer -q
PINFER=target/release/pinfer

chat() { printf '<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$1"; }
DOC='{"devices": [{"name": "Kitchen light", "room": "kitchen", "state": "off", "brightness": 80, "color": "warm white"}, {"name": "Hall fan", "room": "hall", "state": "on", "speed": 2}, {"name": "Desk lamp", "room": "office", "state": "off", "brightness": 40, "color": "daylight"}], "schedule": {"weekdays": {"on": "07:00", "off": "23:00"}, "weekend": {"on": "09:00", "off": "23:30"}}}'
TEXT='The Orange Pi 5 is a single-board computer built around the Rockchip RK3588S. It has four Cortex-A76 cores and four Cortex-A55 cores, a Mali G610 GPU and a neural processing unit rated at six TOPS. Memory comes in 4, 8, 16 or 32 GB of LPDDR4X, and storage is an M.2 slot for an NVMe drive or an eMMC module. The board draws power over USB-C and needs a 5 V 4 A supply under load.'
CODE='def average_speed(x, times):
    total = 0
    for t in times:
        total += x / t
    if len(times) == 0:
        return 0
    return total / len(times)'
TASKS=(json sentence code)
prompt() {
  case "$1" in
    json) chat "Repeat this JSON exactly, with the kitchen light's state set to on:
$DOC" ;;
    sentence) chat "Here is a text:
$TEXT
Copy the sentence about memory and storage exactly as it is written." ;;
    code) chat "Rename the variable x to distance in this Python function and show the whole function:
$CODE" ;;
  esac
}
tps() { sed -n 's/.* eval time .*(.*ms per token, *\([0-9.]*\) tokens per second).*/\1/p' "$1" | tail -1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((r = 0; r < ROUNDS; r++)); do
  for task in "${TASKS[@]}"; do
    p=$(prompt "$task")
    "$PINFER" generate -m "$MODEL" -p "$p" -n "$N" --temp 0 -t "$THREADS" --no-display-prompt \
      > "$out/plain.txt" 2> "$out/plain.err"
    "$PINFER" generate -m "$MODEL" -p "$p" -n "$N" --temp 0 -t "$THREADS" --no-display-prompt \
      --lookup "$LOOKUP" > "$out/lookup.txt" 2> "$out/lookup.err"
    same=$(cmp -s "$out/plain.txt" "$out/lookup.txt" && echo same || echo DIFFERENT)
    taken=$(grep -o 'lookup: .*' "$out/lookup.err" || echo "lookup: no guesses")
    a=$(tps "$out/plain.err") b=$(tps "$out/lookup.err")
    ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", b / a }')
    echo "round $r $task: plain $a tok/s, --lookup $LOOKUP $b tok/s (${ratio}x); text $same; $taken"
  done
done
