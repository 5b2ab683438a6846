#!/usr/bin/env bash
# Where a prompt token's guest instructions go, by function: pinfer's aarch64 release binary runs
# under qemu-aarch64 with the TCG plugin scripts/qemu-plugin/insn_profile.c on two prompts of P1
# and P2 tokens (-n 1, -t 1), and the per-symbol difference divided by P2 - P1 is printed in
# millions of instructions per prompt token (inlined code counts for its caller).
#
#   scripts/insn_profile.sh [--cpu CPU] [--prompt P1,P2] [MODEL]   (defaults: cortex-a76, 64,128,
#                                                                   the default model)
#
# The prompts are "Hello" and then " the" repeated: one token each in the vocabularies we run,
# which the run checks. Uses the binary scripts/insn_per_token.sh (or `./x build-arm`) built.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

CPU=cortex-a76
P=(64 128)
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
die() { echo "insn_profile: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=${2:?--cpu needs a value}; shift 2 ;;
    --prompt)
      [[ ${2:-} =~ ^([0-9]+),([0-9]+)$ ]] && ((BASH_REMATCH[1] > 1 && BASH_REMATCH[1] < BASH_REMATCH[2])) \
        || die "--prompt wants P1,P2 with 1 < P1 < P2"
      P=("${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) MODEL=$1; shift ;;
  esac
done
[ -f "$MODEL" ] || die "$MODEL: no such model file"
TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$TARGET_DIR/aarch64-unknown-linux-gnu/release/pinfer
[ -x "$BIN" ] || die "$BIN missing (./x build-arm builds it)"
PLUGIN=$TARGET_DIR/qemu-plugin/insn_profile.so
mkdir -p "$(dirname "$PLUGIN")"
if [ ! -f "$PLUGIN" ] || [ scripts/qemu-plugin/insn_profile.c -nt "$PLUGIN" ]; then
  gcc -O2 -Wall -Wextra -shared -fPIC -o "$PLUGIN" scripts/qemu-plugin/insn_profile.c
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/insn_profile.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

for n in "${P[@]}"; do
  prompt="Hello$(printf ' the%.0s' $(seq $((n - 1))))"
  got=$(qemu-aarch64 -cpu "$CPU" "$BIN" tokenize -m "$MODEL" -p "$prompt" --ids | wc -w)
  ((got == n)) || die "the $n-token prompt is $got tokens for $MODEL"
  qemu-aarch64 -cpu "$CPU" -plugin "$PLUGIN,out=$WORK/$n" "$BIN" generate -m "$MODEL" -p "$prompt" \
    -n 1 -t 1 --temp 0 >/dev/null 2>"$WORK/$n.err" || { cat "$WORK/$n.err" >&2; die "pinfer failed"; }
done

# symbol -> (instructions at P2 - at P1) / (P2 - P1), largest first, demangled.
echo "M instructions per prompt token by function, $(basename "$MODEL"), qemu $CPU, -t 1"
awk -v d=$((P[1] - P[0])) '
  FNR == NR { a[$2] += $1; next }
  { b[$2] += $1 }
  END {
    for (s in b) { v = (b[s] - a[s]) / d / 1e6; t += v; if (v > 0.01 || v < -0.01) printf "%9.3f  %s\n", v, s }
    printf "%9.3f  (total)\n", t
  }' "$WORK/${P[0]}" "$WORK/${P[1]}" | sort -rn | c++filt | sed -E 's/::h[0-9a-f]{16}$//'
