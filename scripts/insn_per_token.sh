#!/usr/bin/env bash
# Guest instructions per token of pinfer's aarch64 release binary, counted under qemu-aarch64 with a
# TCG plugin (scripts/qemu-plugin/insn_count.c): a machine-independent measure of kernel work that
# any PC can take, to compare with llama.cpp's figures counted the same way.
#
#   scripts/insn_per_token.sh [OPTIONS] [MODEL...]     default model: models/SmolLM2-135M-Instruct.Q4_1.gguf
#
#   --cpu CPU         qemu CPU model (default cortex-a76: NEON + dotprod + FEAT_FP16; cortex-a72 has neither)
#   --gen N1,N2       generated-token counts of the two generation runs (default 8,40)
#   --prompt P1,P2    prompt lengths in tokens of the two prompt runs (default 64,128: one and two
#                     batches of 64, pinfer's batch size and the one of llama.cpp's reference figures)
#   --depth N         the generation runs start from a prompt of N tokens (decode at depth N; the
#                     prompt's cost cancels in the difference)
#   --flags "ARGS"    more pinfer flags for every run, e.g. "-ctk q8_0 -ctv q8_0"
#   --no-build        use the binary already built
#   --llama REPLAY    also count llama.cpp the same way: REPLAY is an aarch64 build of
#                     scripts/llama_replay.c (flash attention, repacked weights, one thread), fed the
#                     same prompt ids; its prompt is one batch (pinfer's: batches of 64)
#   --keep            keep the work directory (per-run stdout, stderr and counts)
#
# Each figure is a difference of two runs, so loading, repacking and start-up cancel out:
#   per generated token = (I(gen N2) - I(gen N1)) / (evals N2 - evals N1)   (-n N, greedy, -t 1)
#   per prompt token    = (I(P2 prompt) - I(P1 prompt)) / (P2 - P1)        (-n 1, -t 1)
# The prompts are fixed: the GPL-3 text of Debian's base-files, cut to the exact token counts.
# Environment variables reach pinfer, e.g. PINFER_KERNELS=ref or PINFER_NO_REPACK=1 for A/B runs.
#
# Builds: the plugin with the host gcc into target/qemu-plugin/insn_count.so; pinfer with
#   RUSTC=/usr/bin/rustc cargo build --release --target aarch64-unknown-linux-gnu --bin pinfer
# into target/aarch64-unknown-linux-gnu/release/pinfer (or under $CARGO_TARGET_DIR if set), the
# binary `./x build-arm` makes. qemu runs without -L: it finds Debian's multiarch arm64 loader itself.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

CPU=cortex-a76
GEN=(8 40)
PROMPT=(64 128)
BUILD=1
KEEP=0
DEPTH=0
EXTRA=()
MODELS=()
LLAMA=

die() { echo "insn_per_token: $*" >&2; exit 1; }
log() { echo "insn_per_token: $*" >&2; }
pair() { # "A,B" -> two positive integers, A < B
  [[ $2 =~ ^([0-9]+),([0-9]+)$ ]] || die "$1 wants N1,N2 (got '$2')"
  ((BASH_REMATCH[1] > 0 && BASH_REMATCH[1] < BASH_REMATCH[2])) || die "$1 wants 0 < N1 < N2 (got '$2')"
  echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=${2:?--cpu needs a value}; shift 2 ;;
    --gen) v=$(pair --gen "${2:-}"); read -r -a GEN <<<"$v"; shift 2 ;;
    --prompt) v=$(pair --prompt "${2:-}"); read -r -a PROMPT <<<"$v"; shift 2 ;;
    --depth) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--depth wants a token count"; DEPTH=$2; shift 2 ;;
    --flags) read -r -a EXTRA <<<"${2:-}"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --keep) KEEP=1; shift ;;
    --llama) LLAMA=${2:?--llama needs an aarch64 llama_replay binary}; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
[ ${#MODELS[@]} -gt 0 ] || MODELS=(models/SmolLM2-135M-Instruct.Q4_1.gguf)
for m in "${MODELS[@]}"; do
  [ -f "$m" ] || die "$m: no such model file (the default one comes from: scripts/setup.sh model)"
done
command -v qemu-aarch64 >/dev/null || die "qemu-aarch64 missing (scripts/setup.sh toolchains installs qemu-user)"
command -v gcc >/dev/null || die "gcc missing (apt-get install gcc)"
TEXT_FILE=/usr/share/common-licenses/GPL-3
[ -f "$TEXT_FILE" ] || die "$TEXT_FILE missing (Debian's base-files)"

TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$TARGET_DIR/aarch64-unknown-linux-gnu/release/pinfer
PLUGIN=$TARGET_DIR/qemu-plugin/insn_count.so

# The plugin. QEMU's own <qemu-plugin.h> (not packaged in Debian 12) is used when installed; from
# QEMU 9 on it includes glib.h, hence the glib flags when pkg-config knows glib.
mkdir -p "$(dirname "$PLUGIN")"
if [ ! -f "$PLUGIN" ] || [ scripts/qemu-plugin/insn_count.c -nt "$PLUGIN" ]; then
  log "building $PLUGIN"
  # shellcheck disable=SC2046
  gcc -O2 -Wall -Wextra -shared -fPIC -o "$PLUGIN" scripts/qemu-plugin/insn_count.c \
    $(pkg-config --cflags glib-2.0 2>/dev/null || true)
fi
if [ "$BUILD" = 1 ]; then
  log "building $BIN"
  RUSTC=/usr/bin/rustc cargo build --release --target aarch64-unknown-linux-gnu --bin pinfer -q
fi
[ -x "$BIN" ] || die "$BIN missing (run without --no-build, or ./x build-arm)"
[ -z "$LLAMA" ] || [ -x "$LLAMA" ] || die "$LLAMA: not an executable (an aarch64 build of scripts/llama_replay.c)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/insn_per_token.XXXXXX")
if [ "$KEEP" = 1 ]; then log "work directory: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi

QEMU=(qemu-aarch64 -cpu "$CPU")
GENERATE_FLAGS=(--temp 0 -t 1 "${EXTRA[@]}")
if "${QEMU[@]}" "$BIN" generate --help | grep -q -- '--ignore-eos'; then
  GENERATE_FLAGS+=(--ignore-eos)
  EOS_NOTE=""
else
  EOS_NOTE="(this pinfer has no --ignore-eos: generation may stop early at an end token, checked below)"
fi

# The text after the GPL's "Preamble" heading, as words on one line.
read -r -a WORDS <<<"$(sed -n '/Preamble/,$p' "$TEXT_FILE" | tail -n +2 | tr -s ' \n\t' '   ')"

count_tokens() { # MODEL TEXT -> tokens the prompt gets (BOS included when the model adds one)
  "${QEMU[@]}" "$BIN" tokenize -m "$1" -p "$2" --ids | wc -w
}

# A prompt of exactly $2 tokens for model $1: the longest prefix of the text that fits, padded
# with " the" (one token each in the vocabularies we run) up to the count.
prompt_of() {
  local model=$1 want=$2 lo=1 hi=$2 mid n text
  while ((lo < hi)); do # the most words whose tokens fit (each word is at least one token)
    mid=$(((lo + hi + 1) / 2))
    n=$(count_tokens "$model" "${WORDS[*]:0:mid}")
    if ((n <= want)); then lo=$mid; else hi=$((mid - 1)); fi
  done
  text="${WORDS[*]:0:lo}"
  n=$(count_tokens "$model" "$text")
  while ((n < want)); do
    text+=" the"
    n=$(count_tokens "$model" "$text")
  done
  ((n == want)) || log "$model: could not make a prompt of exactly $want tokens (got $n); the counts used are the real ones"
  printf '%s' "$text"
}

# run NAME MODEL PROMPT N: sets INSNS, PTOK (prompt tokens) and RUNS (eval runs after the prompt);
# the run's output, stderr and count are in $WORK/NAME.*
run() {
  local name=$1 model=$2 prompt=$3 n=$4 start=$SECONDS
  "${QEMU[@]}" -plugin "$PLUGIN,out=$WORK/$name.count" "$BIN" generate -m "$model" -p "$prompt" -n "$n" \
    "${GENERATE_FLAGS[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err" \
    || { cat "$WORK/$name.err" >&2; die "$name: pinfer failed"; }
  INSNS=$(cat "$WORK/$name.count")
  PTOK=$(sed -n 's/.*prompt eval time = .* \/ *\([0-9]*\) tokens.*/\1/p' "$WORK/$name.err")
  RUNS=$(sed -n 's/.* eval time = .* \/ *\([0-9]*\) runs.*/\1/p' "$WORK/$name.err")
  [[ $INSNS =~ ^[0-9]+$ && $PTOK =~ ^[0-9]+$ && $RUNS =~ ^[0-9]+$ ]] \
    || die "$name: cannot read the counts (see $WORK/$name.err; run with --keep)"
  log "$(printf '%-44s %14s instructions, %4s prompt tokens, %3s eval runs, %4d s' \
    "$name" "$INSNS" "$PTOK" "$RUNS" $((SECONDS - start)))"
}

# llama_run NAME MODEL PROMPT STEPS: llama.cpp's count of the prompt as one batch and STEPS - 1
# greedy evals after it (as pinfer's -n STEPS); sets INSNS
llama_run() {
  local name=$1 model=$2 start=$SECONDS ids
  ids=$("${QEMU[@]}" "$BIN" tokenize -m "$model" -p "$3" --ids)
  printf '1\n%s 0 %s\n%s\n' "$(wc -w <<<"$ids")" "$4" "$ids" >"$WORK/$name.plan"
  "${QEMU[@]}" -plugin "$PLUGIN,out=$WORK/$name.count" "$LLAMA" "$model" 1 1 1 "$WORK/$name.f32" \
    <"$WORK/$name.plan" >"$WORK/$name.out" 2>"$WORK/$name.err" \
    || { cat "$WORK/$name.err" >&2; die "$name: llama_replay failed"; }
  rm -f "$WORK/$name.f32"
  INSNS=$(cat "$WORK/$name.count")
  [[ $INSNS =~ ^[0-9]+$ ]] || die "$name: cannot read the count (run with --keep)"
  log "$(printf '%-44s %14s instructions, %4d s' "$name" "$INSNS" $((SECONDS - start)))"
}

mega() { awk -v d="$1" -v n="$2" 'BEGIN { printf "%.2f", d / n / 1e6 }'; }

ROWS=()
for model in "${MODELS[@]}"; do
  name=$(basename "$model")
  log "$name: qemu -cpu $CPU, pinfer -t 1 ${EOS_NOTE}"
  gen_prompt="${WORDS[*]:0:12}"
  if ((DEPTH > 0)); then gen_prompt=$(prompt_of "$model" "$DEPTH"); fi
  run "$name.gen${GEN[0]}" "$model" "$gen_prompt" "${GEN[0]}"; gi1=$INSNS gr1=$RUNS
  run "$name.gen${GEN[1]}" "$model" "$gen_prompt" "${GEN[1]}"; gi2=$INSNS gr2=$RUNS
  ((gr1 == GEN[0] - 1 && gr2 == GEN[1] - 1)) \
    || log "$name: generation stopped early ($gr1 and $gr2 eval runs); the figure uses the real counts"
  ((gr2 > gr1)) || die "$name: the two generation runs made the same number of evals ($gr1)"

  p1=$(prompt_of "$model" "${PROMPT[0]}")
  p2=$(prompt_of "$model" "${PROMPT[1]}")
  run "$name.prompt${PROMPT[0]}" "$model" "$p1" 1; pi1=$INSNS pt1=$PTOK
  run "$name.prompt${PROMPT[1]}" "$model" "$p2" 1; pi2=$INSNS pt2=$PTOK
  ((pt2 > pt1)) || die "$name: the two prompts have the same length ($pt1 tokens)"

  ROWS+=("$(printf '| %-40s | %23s | %20s |' "$name" \
    "$(mega $((gi2 - gi1)) $((gr2 - gr1)))" "$(mega $((pi2 - pi1)) $((pt2 - pt1)))")")
  if [ -n "$LLAMA" ]; then
    llama_run "$name.llama.gen${GEN[0]}" "$model" "$gen_prompt" "${GEN[0]}"; li1=$INSNS
    llama_run "$name.llama.gen${GEN[1]}" "$model" "$gen_prompt" "${GEN[1]}"; li2=$INSNS
    llama_run "$name.llama.prompt${PROMPT[0]}" "$model" "$p1" 1; lp1=$INSNS
    llama_run "$name.llama.prompt${PROMPT[1]}" "$model" "$p2" 1; lp2=$INSNS
    ROWS+=("$(printf '| %-40s | %23s | %20s |' "$name (llama.cpp)" \
      "$(mega $((li2 - li1)) $((GEN[1] - GEN[0])))" "$(mega $((lp2 - lp1)) $((pt2 - pt1)))")")
  fi
done

echo
echo "guest instructions per token, qemu-aarch64 -cpu $CPU, pinfer -t 1 ${EXTRA[*]} (M = 10^6)$( ((DEPTH > 0)) && echo ", generation at depth $DEPTH")"
echo
printf '| %-40s | %23s | %20s |\n' model "per generated token (M)" "per prompt token (M)"
printf '| %-40s | %23s | %20s |\n' "$(printf -- '-%.0s' {1..40})" "----------------------:" "-------------------:"
printf '%s\n' "${ROWS[@]}"
