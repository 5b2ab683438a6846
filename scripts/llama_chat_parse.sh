#!/usr/bin/env bash
# Builds scripts/llama_chat_parse.cpp (llama.cpp's chat-format detection and reply parser, for the
# tool-call goldens) against the llama.cpp build of scripts/llama_cpp_build.sh, adding its
# `llama-common` library there. Prints the program's path. A reference tool: never used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
bin_dir=$(scripts/llama_cpp_build.sh)
build=$(cd "$bin_dir/.." && pwd)
root=$(cd "$build/.." && pwd)/src/vendor/llama.cpp
out=$build/bin/llama-chat-parse
cmake --build "$build" --target llama-common -j "$(nproc)" >&2
if [ ! -x "$out" ] || [ scripts/llama_chat_parse.cpp -nt "$out" ]; then
  c++ -std=c++17 -O1 -I"$root/common" -I"$root/include" -I"$root/ggml/include" -I"$root/vendor" \
    scripts/llama_chat_parse.cpp -o "$out" \
    "$build/common/libllama-common.a" "$build/common/libllama-common-base.a" "$build/src/libllama.a" \
    "$build/ggml/src/libggml.a" "$build/ggml/src/libggml-cpu.a" "$build/ggml/src/libggml-base.a" \
    "$build/vendor/cpp-httplib/libcpp-httplib.a" -lpthread -ldl >&2
fi
echo "$out"
