#!/usr/bin/env bash
# pinfer beside llama.cpp at real sizes: shape models (real shapes and vocabularies, random weights of
# realistic scale, scripts/make_shape_model.py) quantized with llama-quantize, then `pinfer bench` and
# `llama-bench` in interleaved rounds (same threads, same prompt and generation lengths), and peak RSS
# and load time of a 16-token generation (`pinfer generate` beside `llama-simple`). Prints a Markdown
# table of pinfer/llama.cpp ratios (above 1 is pinfer faster; for RSS and load, below 1 is pinfer leaner).
#
#   scripts/scale_bench.sh [--shapes S1,S2] [--quants Q1,Q2] [-t THREADS] [--rounds N] [--svg FILE]
#
# --svg FILE: also draw the table as a chart (scripts/scale_chart.py; default target/scale-bench.svg).
#
#   --shapes   llama-3.2-1b (default), llama-3.2-3b, qwen2.5-1.5b, qwen3-1.7b, gemma-3-1b, lfm2-1.2b,
#              qwen3.5-0.8b, gemma-4-e2b, granite-3.3-2b, smollm3-3b, phi-3.5-mini, lfm2-8b-a1b
#   --quants   Q4_0,Q4_K_M,Q8_0 (default)
#   -t         threads of both programs (default 2)
#   --rounds   interleaved rounds of each bench (default 2; each round runs 3 repetitions)
#
# llama.cpp is never a dependency of pinfer or of its CI: scripts/llama_cpp_build.sh builds it for
# the instruction level pinfer's x86 kernels use (AVX2/FMA/F16C, no AVX-512) into target/llama.cpp/
# (cached), or LLAMA_CPP_BIN=DIR holds llama-bench, llama-simple and llama-quantize. Shape models
# are cached in target/shape-models/ (about 2.5 GB of F16 per 1B model).
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

SHAPES=llama-3.2-1b
QUANTS=Q4_0,Q4_K_M,Q8_0
THREADS=2
ROUNDS=2
SVG=target/scale-bench.svg
while [ $# -gt 0 ]; do
  case "$1" in
    --shapes) SHAPES=$2; shift 2 ;;
    --quants) QUANTS=$2; shift 2 ;;
    -t) THREADS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --svg) SVG=$2; shift 2 ;;
    *) echo "scale_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
log() { echo "scale_bench: $*" >&2; }


vocab_of() {
  case "$1" in
    llama-*) echo target/tokenizer-vocabs/ggml-vocab-llama-bpe.gguf ;;
    qwen3.5-*) echo target/tokenizer-vocabs/ggml-vocab-qwen35.gguf ;;
    qwen*) echo target/tokenizer-vocabs/ggml-vocab-qwen2.gguf ;;
    # (llama.cpp ships no Gemma 3 vocabulary file: the 270M model carries the family's tokenizer.)
    gemma-3-*) echo models/gemma-3-270m-q4_k_m.gguf ;;
    gemma-4-*) echo target/tokenizer-vocabs/ggml-vocab-gemma-4.gguf ;;
    # (None for LFM2 either: Falcon's byte-level BPE, padded to LFM2's 65536 tokens.)
    lfm2-*) echo target/tokenizer-vocabs/ggml-vocab-falcon.gguf ;;
    granite-*) echo target/tokenizer-vocabs/ggml-vocab-starcoder.gguf ;;
    smollm3-*) echo target/tokenizer-vocabs/ggml-vocab-llama-bpe.gguf ;;
    phi-3*) echo target/tokenizer-vocabs/ggml-vocab-phi-3.gguf ;;
    *) echo "scale_bench: no vocabulary for $1" >&2; exit 2 ;;
  esac
}

BIN=$(scripts/llama_cpp_build.sh)
[ -f target/tokenizer-vocabs/ggml-vocab-llama-bpe.gguf ] || scripts/tokenizer_fetch_vocabs.sh >&2
[[ $SHAPES != *gemma-3-* ]] || scripts/tokenizer_fetch_gemma3.sh >&2
cargo build --release --bin pinfer -q
PINFER=target/release/pinfer
MODELS=target/shape-models
mkdir -p "$MODELS"
PROMPT="The history of the printing press in Europe begins"

# median of the numbers on stdin
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

BW=$("$PINFER" bench -p 0 -n 1 -r 1 -t "$THREADS" --membw -o json 2>/dev/null | jq -r '.[0].membw_gbps')
log "memory read bandwidth: $BW GB/s ($THREADS threads)"
printf '| model | quant | file MiB | tg64 pinfer | tg64 llama.cpp | tg ratio | pinfer decode GB/s (of %.1f) | pp128 pinfer | pp128 llama.cpp | pp ratio | peak RSS MiB (pinfer / llama.cpp) | load s (pinfer / llama.cpp) |\n' "$BW"
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
RESULTS=$(mktemp)
for shape in ${SHAPES//,/ }; do
  f16=$MODELS/$shape.f16.gguf
  if [ ! -f "$f16" ]; then
    log "writing $f16"
    python3 scripts/make_shape_model.py "$shape" "$(vocab_of "$shape")" "$f16.tmp"
    mv "$f16.tmp" "$f16"
  fi
  for q in ${QUANTS//,/ }; do
    m=$MODELS/$shape.$q.gguf
    if [ ! -f "$m" ]; then
      log "quantizing $m"
      "$BIN/llama-quantize" "$f16" "$m.tmp" "$q" > "$m.log" 2>&1
      mv "$m.tmp" "$m"
    fi
    declare -a ptg=() ppp=() ltg=() lpp=() pbw=()
    for ((r = 0; r < ROUNDS; r++)); do
      out=$("$PINFER" bench -m "$m" -p 128 -n 64 -r 3 -t "$THREADS" -o json 2>/dev/null)
      ptg+=("$(jq -r '.[] | select(.n_gen > 0) | .avg_ts' <<<"$out")")
      pbw+=("$(jq -r '.[] | select(.n_gen > 0) | .decode_gbps' <<<"$out")")
      ppp+=("$(jq -r '.[] | select(.n_prompt > 0) | .avg_ts' <<<"$out")")
      out=$("$BIN/llama-bench" -m "$m" -p 128 -n 64 -r 3 -t "$THREADS" -o json 2>/dev/null)
      ltg+=("$(jq -r '.[] | select(.n_gen > 0) | .avg_ts' <<<"$out")")
      lpp+=("$(jq -r '.[] | select(.n_prompt > 0) | .avg_ts' <<<"$out")")
      log "$shape $q round $r: tg pinfer ${ptg[-1]} llama.cpp ${ltg[-1]}; pp pinfer ${ppp[-1]} llama.cpp ${lpp[-1]}"
    done
    mtg=$(printf '%s\n' "${ptg[@]}" | median); mpp=$(printf '%s\n' "${ppp[@]}" | median)
    mbw=$(printf '%s\n' "${pbw[@]}" | median)
    ltgm=$(printf '%s\n' "${ltg[@]}" | median); lppm=$(printf '%s\n' "${lpp[@]}" | median)
    # Peak RSS (KiB) of a 16-token generation, small context, and load seconds (pinfer: the wall time of
    # that run, generation included; llama.cpp: the load time it reports), each the median of 3.
    prss=(); pwall=(); lrss=(); lwall=()
    timing=$(mktemp)
    for _ in 1 2 3; do
      /usr/bin/time -o "$timing" -f '%M %e' "$PINFER" generate -m "$m" -p "$PROMPT" -n 16 -c 512 --temp 0 \
        -t "$THREADS" >/dev/null 2>&1
      read -r a b < "$timing"
      prss+=("$a"); pwall+=("$b")
      # llama-simple's wall time is mostly its slow generation: its load is the time it reports.
      /usr/bin/time -o "$timing" -f '%M' "$BIN/llama-simple" -m "$m" -n 16 "$PROMPT" >/dev/null 2>"$timing.log"
      read -r a < "$timing"
      b=$(sed -n 's/.*load time = *\([0-9.]*\) ms.*/\1/p' "$timing.log" | head -1)
      lrss+=("$a"); lwall+=("$(awk -v ms="${b:-0}" 'BEGIN { print ms / 1000 }')")
    done
    rm -f "$timing" "$timing.log"
    pr=$(printf '%s\n' "${prss[@]}" | median); lr=$(printf '%s\n' "${lrss[@]}" | median)
    pw=$(printf '%s\n' "${pwall[@]}" | median); lw=$(printf '%s\n' "${lwall[@]}" | median)
    size=$(stat -c %s "$m")
    awk -v s="$shape" -v q="$q" -v size="$size" -v a="$mtg" -v b="$ltgm" -v c="$mpp" -v d="$lppm" -v bw="$mbw" \
      -v pr="$pr" -v lr="$lr" -v pw="$pw" -v lw="$lw" 'BEGIN {
        printf "| %s | %s | %.0f | %.2f | %.2f | %.2fx | %.2f | %.1f | %.1f | %.2fx | %.0f / %.0f (%.2fx) | %.2f / %.2f |\n",
          s, q, size / 1048576, a, b, a / b, bw, c, d, c / d, pr / 1024, lr / 1024, pr / lr, pw, lw }'
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$shape" "$q" "$((size / 1048576))" "$mtg" "$ltgm" \
      "$mpp" "$lppm" "$((pr / 1024))" "$((lr / 1024))" >> "$RESULTS"
  done
done
python3 scripts/scale_chart.py "$RESULTS" "$SVG"
rm -f "$RESULTS"
log "chart: $SVG"
