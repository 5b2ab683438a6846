#!/usr/bin/env bash
# Guest instructions per input token of an embedding model under qemu-aarch64 (the TCG plugin of
# scripts/insn_per_token.sh): pinfer's aarch64 release `embed` and, with --llama, llama.cpp's
# aarch64 llama-embedding (scripts/llama_cpp_build_arm.sh) on the same sentences, one thread each.
# Not in CI (minutes per model).
#
#   scripts/insn_per_embed_token.sh [--llama LLAMA_EMBEDDING] [--cpu CPU] [--no-build] [MODEL...]
#     default model: models/all-MiniLM-L6-v2.Q8_0.gguf; inputs: the first 8 and the first 24 lines of
#     tests/golden/embeddings/sentences.txt
#
# Each figure is a difference of two runs (8 and 24 sentences), so loading and start-up cancel:
#   per input token = (I(24 sentences) - I(8 sentences)) / (tokens of the 24 - tokens of the 8)
# the tokens counted by pinfer's tokenizer ([CLS] and [SEP] included), which gives llama.cpp's ids
# on these sentences (tests/golden/embeddings/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=cortex-a76
BUILD=1
LLAMA=""
MODELS=()
die() { echo "insn_per_embed_token: $*" >&2; exit 1; }
log() { echo "insn_per_embed_token: $*" >&2; }
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) CPU=${2:?}; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --llama) LLAMA=${2:?--llama needs an aarch64 llama-embedding}; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
[ ${#MODELS[@]} -gt 0 ] || MODELS=(models/all-MiniLM-L6-v2.Q8_0.gguf)
TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$TARGET_DIR/aarch64-unknown-linux-gnu/release/pinfer
PLUGIN=$TARGET_DIR/qemu-plugin/insn_count.so
mkdir -p "$(dirname "$PLUGIN")"
if [ ! -f "$PLUGIN" ] || [ scripts/qemu-plugin/insn_count.c -nt "$PLUGIN" ]; then
  # shellcheck disable=SC2046
  gcc -O2 -Wall -Wextra -shared -fPIC -o "$PLUGIN" scripts/qemu-plugin/insn_count.c \
    $(pkg-config --cflags glib-2.0 2>/dev/null || true)
fi
if [ "$BUILD" = 1 ]; then
  log "building $BIN"
  RUSTC=/usr/bin/rustc cargo build --release --target aarch64-unknown-linux-gnu --bin pinfer -q
fi
[ -x "$BIN" ] || die "$BIN missing"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/insn_per_embed.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
QEMU=(qemu-aarch64 -cpu "$CPU")
SENTENCES=tests/golden/embeddings/sentences.txt
head -n 8 "$SENTENCES" >"$WORK/small.txt"
head -n 24 "$SENTENCES" >"$WORK/large.txt"

tokens_of() { # MODEL FILE -> tokens of all its lines
  local n=0 line
  while IFS= read -r line; do
    n=$((n + $("${QEMU[@]}" "$BIN" tokenize -m "$1" -p "$line" --ids | wc -w)))
  done <"$2"
  echo "$n"
}
count() { # OUT COMMAND... -> instructions
  "${QEMU[@]}" -plugin "$PLUGIN,out=$WORK/count" "${@:2}" >"$WORK/$1.out" 2>"$WORK/$1.err" \
    || { cat "$WORK/$1.err" >&2; die "$1 failed"; }
  cat "$WORK/count"
}
per_token() { awk -v d="$1" -v n="$2" 'BEGIN { printf "%.3f", d / n / 1e6 }'; }

echo "| model | program | M instructions per input token |"
echo "|---|---|---|"
for model in "${MODELS[@]}"; do
  [ -f "$model" ] || die "$model: no such file"
  t1=$(tokens_of "$model" "$WORK/small.txt")
  t2=$(tokens_of "$model" "$WORK/large.txt")
  ((t2 > t1)) || die "$model: no tokens"
  i1=$(count pinfer1 "$BIN" embed -m "$model" -f "$WORK/small.txt" -t 1)
  i2=$(count pinfer2 "$BIN" embed -m "$model" -f "$WORK/large.txt" -t 1)
  echo "| $(basename "$model") | pinfer | $(per_token $((i2 - i1)) $((t2 - t1))) |"
  if [ -n "$LLAMA" ]; then
    l1=$(count llama1 "$LLAMA" -m "$model" -f "$WORK/small.txt" -t 1 --pooling mean)
    l2=$(count llama2 "$LLAMA" -m "$model" -f "$WORK/large.txt" -t 1 --pooling mean)
    echo "| $(basename "$model") | llama.cpp | $(per_token $((l2 - l1)) $((t2 - t1))) |"
  fi
done
echo
echo "qemu-aarch64 -cpu $CPU, one thread; tokens: $t1 and $t2 (the first 8 and 24 sentences)"
