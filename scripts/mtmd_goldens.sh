#!/usr/bin/env bash
# Vision goldens: what llama.cpp's libmtmd (0c1e570, the llama-cpp-python 0.3.36 sdist) computes for
# tiny random vision-language models on the test images, one JSON per (family, image) in
# tests/golden/vision/<family>/<image>.json (preprocessed tiles, image embeddings, prompt chunk layout,
# greedy ids; see scripts/mtmd_dump.cpp for the fields).
#
# Regenerate everything (from the repo root; llama.cpp already configured and built static in
# target/llama.cpp/build, e.g. by scripts/llama_cpp_build.sh, with
# `cmake --build target/llama.cpp/build --target llama-mtmd-cli -j 2` for libmtmd.a):
#
#   pip install Pillow                       # dev-only, for the test images
#   python3 scripts/make_test_images.py      # tests/vision/images/*
#   scripts/mtmd_goldens.sh                  # models in target/tiny-vlm/<family>/, goldens, and a
#                                            # llama-mtmd-cli cross-check of the greedy text
#
#   scripts/mtmd_goldens.sh FAMILY...        # only these families (default: all of FAMILIES below)
#
# Each family's pair comes from `python3 scripts/make_tiny_vlm.py --family F --seed 1 --out
# target/tiny-vlm/F` (needs gguf==0.19.0, numpy, models/gemma-3-270m-q4_k_m.gguf and
# models/SmolLM2-135M-Instruct.Q8_0.gguf). The prompt is "describe", 8 greedy tokens, 2 threads.
#
# A golden over TRIM bytes keeps the first 4096 values of each tile ("pixels_u8_head"; the tile's
# sums still cover all of them); one still over (LFM2-VL's 3000x200: ten 512 px tiles and a
# thumbnail) keeps of each image chunk the first EMBD_HEAD embeddings ("embd_head"; "embd_sum" and
# "embd_sum_sq" still cover all of them) and no decoder positions.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_SRC=target/llama.cpp/src/vendor/llama.cpp
LLAMA_BUILD=target/llama.cpp/build
OUT_MODELS=target/tiny-vlm
GOLDEN=tests/golden/vision
IMAGES=tests/vision/images
BIN=$OUT_MODELS/mtmd_dump
FAMILIES=(gemma3 idefics3 qwen2vl qwen2.5vl lfm2)
PROMPT=describe
N_PREDICT=8
THREADS=2
SEED=1
TRIM=300000
EMBD_HEAD=8

if [ $# -gt 0 ]; then FAMILIES=("$@"); fi
mkdir -p "$OUT_MODELS" "$GOLDEN"

# 1. the dump tool, against the llama.cpp headers and static libraries
if [ ! -x "$BIN" ] || [ scripts/mtmd_dump.cpp -nt "$BIN" ] || [ "$LLAMA_BUILD/tools/mtmd/libmtmd.a" -nt "$BIN" ]; then
  g++ -std=c++17 -O2 -o "$BIN" scripts/mtmd_dump.cpp \
    -I"$LLAMA_SRC/tools/mtmd" -I"$LLAMA_SRC/include" -I"$LLAMA_SRC/ggml/include" \
    "$LLAMA_BUILD/tools/mtmd/libmtmd.a" "$LLAMA_BUILD/src/libllama.a" \
    "$LLAMA_BUILD/ggml/src/libggml.a" "$LLAMA_BUILD/ggml/src/libggml-cpu.a" "$LLAMA_BUILD/ggml/src/libggml-base.a" \
    "$LLAMA_BUILD/vendor/hash/libvendor-hash.a" \
    -lpthread -ldl -lm
fi

for fam in "${FAMILIES[@]}"; do
  dir=$OUT_MODELS/$fam
  # 2. the tiny model pair
  python3 scripts/make_tiny_vlm.py --family "$fam" --seed "$SEED" --out "$dir" | tee "$dir.sha256"
  mkdir -p "$GOLDEN/$fam"
  for img in "$IMAGES"/*; do
    name=$(basename "$img")
    out=$GOLDEN/$fam/${name%.*}.json
    cmd="$BIN --model $dir/model.gguf --mmproj $dir/mmproj.gguf --image $img --prompt $PROMPT -n $N_PREDICT -t $THREADS"
    # 3. the golden
    if ! $cmd --cmd "$cmd" --out "$out" 2> "$OUT_MODELS/$fam-${name%.*}.log"; then
      echo "mtmd_goldens: FAILED $fam $name (log: $OUT_MODELS/$fam-${name%.*}.log)" >&2
      rm -f "$out"
      continue
    fi
    # 4. cross-check: llama-mtmd-cli's greedy text must be the dump's
    cli="$LLAMA_BUILD/bin/llama-mtmd-cli -m $dir/model.gguf --mmproj $dir/mmproj.gguf --image $img -p $PROMPT -n $N_PREDICT --temp 0 -t $THREADS"
    got=$($cli 2>/dev/null || true)
    python3 - "$out" "$cli" "$got" "$TRIM" "$EMBD_HEAD" <<'EOF'
import json, sys
path, cli, got, trim, head = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
g = json.load(open(path))
want = g["greedy_text"]
ok = got.strip() == want.strip()
g["llama_mtmd_cli"] = {"command": cli, "stdout": got, "matches_greedy_text": ok}
size = lambda: len(json.dumps(g, ensure_ascii=False, separators=(",", ":")))
if size() > trim:
    for c in g["chunks"]:
        for t in c.get("tiles", []):
            for key in ("pixels_u8", "pixels"):
                if key in t:
                    t[key + "_head"] = t.pop(key)[:4096]
        if "pixels_full" in c:
            c["pixels_full"] = False
    g["trimmed"] = "pixels: the first 4096 values of each tile"
if size() > trim:
    for c in g["chunks"]:
        if c["type"] == "image":
            c["embd_head"] = c.pop("embd")[: head * g["n_embd"]]
            c.pop("decoder_pos", None)
    g["trimmed"] += f"; embeddings: the first {head} of each image chunk (embd_head); no decoder_pos"
with open(path, "w") as f:
    json.dump(g, f, ensure_ascii=False, separators=(",", ":"))
    f.write("\n")
print(f"{'ok  ' if ok else 'DIFF'} {path}: {g['greedy_ids']} {want!r}" + ("" if ok else f" (cli: {got!r})"))
EOF
  done
done
