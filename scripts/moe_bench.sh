#!/usr/bin/env bash
# Mixture-of-experts benchmark: guest instructions per token under qemu-aarch64 (cortex-a76, one
# thread; scripts/insn_per_token.sh) of
#   1. dense-bench.gguf: qwen3, 8 layers, FFN 1024 x 5632, Q4_0;
#   2. moe-bench.gguf:   qwen3moe, 8 layers, 8 experts of 1024 x 2816, 2 used (the same active size);
#   3. moe-bench.gguf with the gather-then-matmul baseline (pinfer built with the benchmark-only
#      feature moe-gather-bench: each selected expert's slab is copied before its matmul).
# The models are written by scripts/make_moe_bench_models.py into models/bench (once).
#
#   scripts/moe_bench.sh [--gen N1,N2] [--prompt P1,P2]     (defaults 4,12 and 32,64)
set -euo pipefail
cd "$(dirname "$0")/.."
GEN=4,12
PROMPT=32,64
while [ $# -gt 0 ]; do
  case "$1" in
    --gen) GEN=${2:?}; shift 2 ;;
    --prompt) PROMPT=${2:?}; shift 2 ;;
    *) echo "moe_bench: unknown option '$1'" >&2; exit 2 ;;
  esac
done
python3 scripts/make_moe_bench_models.py models/bench >&2
MODELS=(models/bench/dense-bench.gguf models/bench/moe-bench.gguf)
echo "## in place (pinfer's mul_mat_id)"
scripts/insn_per_token.sh --gen "$GEN" --prompt "$PROMPT" "${MODELS[@]}"
GATHER_DIR=${CARGO_TARGET_DIR:-target}/moe-gather
echo "## gather-then-matmul baseline (feature moe-gather-bench)"
CARGO_TARGET_DIR=$GATHER_DIR RUSTC=/usr/bin/rustc \
  cargo build --release --target aarch64-unknown-linux-gnu --features moe-gather-bench --bin pinfer -q
CARGO_TARGET_DIR=$GATHER_DIR scripts/insn_per_token.sh --no-build --gen "$GEN" --prompt "$PROMPT" models/bench/moe-bench.gguf
