#!/usr/bin/env bash
# The image encoder beside llama.cpp's: `pinfer generate --mmproj --image` and `llama-mtmd-cli` on
# the same files in interleaved rounds (same threads), each reporting the time it spends encoding
# one image (pinfer: decoding, preprocessing and the projector, "image encode time"; llama-mtmd-cli:
# the projector only, its "mtmd batch encoding done in" lines summed over the image's chunks).
# Prints a Markdown table, ms per image and the ratio (above 1: pinfer faster).
#
#   scripts/vision_bench.sh [--shapes S1,S2] [--types T1,T2] [-t THREADS] [--rounds N]
#
#   --shapes  smolvlm-256m (SmolVLM-256M's SigLIP-B/16 at 512 px: one tile and the overview),
#             siglip-so400m (Gemma 3's SigLIP-So400m at 896 px); default both
#   --types   f16,q8_0 (default both: the projector's matrices)
#   -t        threads of both programs (default 2)
#   --rounds  interleaved rounds (default 3; the median is reported)
#
# The projectors are shape models (scripts/make_tiny_vlm.py --shape: the released encoder's sizes,
# random weights of trained scale, a tiny text model) cached in target/vision-shapes/, with a
# synthetic PNG of the encoder's size. llama.cpp comes from scripts/llama_cpp_build.sh (AVX2, no
# AVX-512) plus `cmake --build target/llama.cpp/build --target llama-mtmd-cli`, or LLAMA_CPP_BIN=DIR.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

SHAPES=smolvlm-256m,siglip-so400m
TYPES=f16,q8_0
THREADS=2
ROUNDS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --shapes) SHAPES=$2; shift 2 ;;
    --types) TYPES=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "vision_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
log() { echo "vision_bench: $*" >&2; }

BIN=${LLAMA_CPP_BIN:-target/llama.cpp/build/bin}
if [ ! -x "$BIN/llama-mtmd-cli" ]; then
  [ -x target/llama.cpp/build/bin/llama-bench ] || scripts/llama_cpp_build.sh >&2
  cmake --build target/llama.cpp/build --target llama-mtmd-cli -j "$(nproc)" >&2
fi
cargo build --release --bin pinfer >&2
PINFER=target/release/pinfer
# shellcheck source=scripts/vision_shapes.sh
source scripts/vision_shapes.sh

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

echo "| encoder | type | pinfer ms/image | llama-mtmd-cli ms/image | ratio |"
echo "|---|---|---|---|---|"
IFS=, read -ra shapes <<< "$SHAPES"
IFS=, read -ra types <<< "$TYPES"
for shape in "${shapes[@]}"; do
  image=$(shape_image "$shape")
  for ty in "${types[@]}"; do
    dir=$(shape_model "$shape" "$ty")
    ours=() theirs=()
    for round in $(seq "$ROUNDS"); do
      log "$shape $ty round $round"
      p=$("$PINFER" generate -m "$dir/model.gguf" --mmproj "$dir/mmproj.gguf" --image "$image" -p describe \
        -n 1 --temp 0 -t "$THREADS" --no-jinja 2>&1 >/dev/null | sed -n 's/.*image encode time = *\([0-9.]*\) ms.*/\1/p')
      l=$("$BIN/llama-mtmd-cli" -m "$dir/model.gguf" --mmproj "$dir/mmproj.gguf" --image "$image" -p describe \
        -n 1 --temp 0 -t "$THREADS" 2>&1 >/dev/null | sed -n 's/.*batch encoding done in \([0-9]*\) ms.*/\1/p' \
        | awk '{s += $1} END {print s}')
      [ -n "$p" ] && [ -n "$l" ] || { log "no timing from a run ($shape $ty): pinfer '$p', llama '$l'"; exit 1; }
      ours+=("$p") theirs+=("$l")
    done
    po=$(printf '%s\n' "${ours[@]}" | median) lo=$(printf '%s\n' "${theirs[@]}" | median)
    printf '| %s | %s | %.0f | %.0f | %.2f |\n' "$shape" "$ty" "$po" "$lo" "$(echo "$lo / $po" | bc -l)"
  done
done
