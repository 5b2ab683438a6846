#!/usr/bin/env bash
# Remakes the embedding goldens in tests/golden/embeddings (README there) with llama.cpp, which CI never
# runs: llama-embedding and llama-server from scripts/llama_cpp_build.sh (LLAMA_CPP_BIN=DIR names
# another build), the models from scripts/setup.sh minilm and encoder-tiny, the float64 reference from
# scripts/bert_reference.py (pip: numpy safetensors tokenizers). The Q8_0 MiniLM is llama-quantize's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh minilm
scripts/setup.sh encoder-tiny
bin=$(scripts/llama_cpp_build.sh)
export LLAMA_CPP_BIN=$bin
G=tests/golden/embeddings
M=models/all-MiniLM-L6-v2

python3 scripts/bert_reference.py $M $G/sentences.txt $G/minilm-reference.json
python3 scripts/compare_gguf.py $M.F16.gguf --summary $G/minilm-f16.gguf-summary.json
[ -f $M.llama-q8_0.gguf ] || "$bin/llama-quantize" $M.F16.gguf $M.llama-q8_0.gguf Q8_0 >/dev/null 2>&1
python3 scripts/compare_gguf.py $M.llama-q8_0.gguf --summary $G/minilm-q8_0.gguf-summary.json
python3 scripts/llama_embed_golden.py $M.F16.gguf $G/sentences.txt $G/minilm-f16.llama.json \
  --pooling mean --embd-normalize 2
python3 scripts/llama_embed_golden.py $M.llama-q8_0.gguf $G/sentences.txt $G/minilm-q8_0.llama.json \
  --pooling mean --embd-normalize 2
python3 scripts/wpm_tokenize_golden.py $M $M.F16.gguf $G/minilm.tokenize.jsonl $G/minilm.pairs.jsonl
# Per-token vectors (no pooling, not normalised) of the first 3 sentences.
head -n 3 $G/sentences.txt > target/minilm-3.txt
python3 scripts/llama_embed_golden.py $M.F16.gguf target/minilm-3.txt $G/minilm-f16.none.llama.json \
  --pooling none --embd-normalize -1

T=models/tiny
for m in nomic-bert jina-bert-v2 qwen3-embed gemma-embed; do
  python3 scripts/llama_embed_golden.py $T/$m-tiny.gguf $G/tiny-inputs.txt $G/$m-tiny.llama.json
done
python3 scripts/llama_embed_golden.py $T/nomic-bert-tiny.gguf $G/tiny-inputs.txt $G/nomic-bert-tiny.none.llama.json \
  --pooling none --embd-normalize -1
python3 scripts/llama_embed_golden.py $T/gemma-embed-tiny.gguf $G/tiny-inputs.txt $G/gemma-embed-tiny.cls.llama.json \
  --pooling cls --embd-normalize 1
for m in bert-rerank qwen3-rerank; do
  python3 scripts/llama_embed_golden.py $T/$m-tiny.gguf $G/rerank-pairs.txt $G/$m-tiny.llama.json --embd-normalize -1
  python3 scripts/llama_rerank_golden.py $T/$m-tiny.gguf $G/rerank-requests.json $G/$m-tiny.server.json
done
python3 scripts/embed_compare.py $G/minilm-reference.json $G/minilm-f16.llama.json $G/minilm-q8_0.llama.json
python3 scripts/encoder_tiny_reference.py models/tiny $G
