#!/usr/bin/env bash
# Guest instructions per image of the image encoder, pinfer's aarch64 release binary beside
# llama.cpp's llama-mtmd-cli (scripts/llama_cpp_build_arm.sh: armv8.2-a+dotprod+fp16), both
# counted under qemu-aarch64 with the TCG plugin of scripts/insn_per_token.sh, one thread each.
#
#   scripts/vision_insn.sh [--shapes S1,S2] [--types T1,T2] [--cpu CPU] [--work DIR]
#
#   --shapes  smolvlm-256m (default) and/or siglip-so400m: the shape models of
#             scripts/vision_bench.sh (target/vision-shapes/, written there when missing)
#   --types   f16,q8_0 (default both)
#   --cpu     qemu CPU model (default cortex-a76)
#
# A figure is a difference of two runs of the same program: with one image minus without it (the
# synthetic PNG of scripts/vision_shapes.sh; llama-mtmd-cli without an image is its chat mode, given
# no input), so loading and the start-up cancel. What is left is one image: decoding the PNG,
# preprocessing, the encoder and projector, and the language model's prefill of the image's
# tokens and the prompt (the tiny text model of the shape model makes those small).
# Each counted run is kept in the work directory (--work DIR): a run whose count is there is not
# run again, so an interrupted measurement goes on where it stopped.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

SHAPES=smolvlm-256m
TYPES=f16,q8_0
CPU=cortex-a76
WORK=
while [ $# -gt 0 ]; do
  case "$1" in
    --shapes) SHAPES=$2; shift 2 ;;
    --types) TYPES=$2; shift 2 ;;
    --cpu) CPU=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    *) echo "vision_insn: unknown option $1" >&2; exit 2 ;;
  esac
done
die() { echo "vision_insn: $*" >&2; exit 1; }
log() { echo "vision_insn: $*" >&2; }

PLUGIN=target/qemu-plugin/insn_count.so
mkdir -p target/qemu-plugin
if [ ! -f "$PLUGIN" ] || [ scripts/qemu-plugin/insn_count.c -nt "$PLUGIN" ]; then
  # shellcheck disable=SC2046
  gcc -O2 -Wall -Wextra -shared -fPIC -o "$PLUGIN" scripts/qemu-plugin/insn_count.c \
    $(pkg-config --cflags glib-2.0 2>/dev/null || true)
fi
log "building pinfer for aarch64"
RUSTC=/usr/bin/rustc cargo build --release --target aarch64-unknown-linux-gnu --bin pinfer -q
PINFER=target/aarch64-unknown-linux-gnu/release/pinfer
LLAMA_DIR=$(scripts/llama_cpp_build_arm.sh llama-mtmd-cli)
LLAMA=$LLAMA_DIR/llama-mtmd-cli
[ -x "$LLAMA" ] || die "$LLAMA missing"

[ -n "$WORK" ] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/vision_insn.XXXXXX")
mkdir -p "$WORK"
log "work directory: $WORK"
QEMU=(qemu-aarch64 -cpu "$CPU")

# count NAME PROGRAM ARGS...: the run's guest instructions into $COUNT (kept from an earlier run).
count() {
  local name=$1 start=$SECONDS
  shift
  if [[ -s $WORK/$name.count && $(cat "$WORK/$name.count") =~ ^[0-9]+$ ]]; then
    COUNT=$(cat "$WORK/$name.count")
    log "$(printf '%-32s %16s instructions (counted before)' "$name" "$COUNT")"
    return
  fi
  "${QEMU[@]}" -plugin "$PLUGIN,out=$WORK/$name.count" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" \
    </dev/null || { tail -20 "$WORK/$name.err" >&2; rm -f "$WORK/$name.count"; die "$name failed"; }
  COUNT=$(cat "$WORK/$name.count")
  [[ $COUNT =~ ^[0-9]+$ ]] || die "$name: no count"
  log "$(printf '%-32s %16s instructions, %5d s' "$name" "$COUNT" $((SECONDS - start)))"
}

# shellcheck source=scripts/vision_shapes.sh
source scripts/vision_shapes.sh

echo "guest instructions per image, qemu-aarch64 -cpu $CPU, one thread (G = 10^9)"
echo
echo "| encoder | type | pinfer G/image | llama-mtmd-cli G/image | pinfer / llama.cpp |"
echo "|---|---|---:|---:|---:|"
IFS=, read -ra shapes <<< "$SHAPES"
IFS=, read -ra types <<< "$TYPES"
for shape in "${shapes[@]}"; do
  image=$(shape_image "$shape")
  for ty in "${types[@]}"; do
    dir=$(shape_model "$shape" "$ty")
    m=(-m "$dir/model.gguf" --mmproj "$dir/mmproj.gguf")
    count "$shape-$ty-pinfer-0" "$PINFER" generate "${m[@]}" -p describe -n 1 --temp 0 -t 1 --no-jinja
    p0=$COUNT
    count "$shape-$ty-pinfer-1" "$PINFER" generate "${m[@]}" --image "$image" -p describe -n 1 --temp 0 -t 1 --no-jinja
    p1=$COUNT
    count "$shape-$ty-llama-0" "$LLAMA" "${m[@]}" -n 1 --temp 0 -t 1
    l0=$COUNT
    count "$shape-$ty-llama-1" "$LLAMA" "${m[@]}" --image "$image" -p describe -n 1 --temp 0 -t 1
    l1=$COUNT
    printf '| %s | %s | %.2f | %.2f | %.2f |\n' "$shape" "$ty" "$(echo "($p1 - $p0) / 10^9" | bc -l)" \
      "$(echo "($l1 - $l0) / 10^9" | bc -l)" "$(echo "($p1 - $p0) / ($l1 - $l0)" | bc -l)"
  done
done
