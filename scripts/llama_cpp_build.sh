#!/usr/bin/env bash
# llama.cpp, our reference and rival, built for the benchmark scripts (never a dependency of pinfer or
# of its CI): llama-bench, llama-simple and llama-quantize for the instruction level pinfer's x86
# kernels use (AVX2/FMA/F16C, no AVX-512), from the llama-cpp-python sdist, in target/llama.cpp/
# (cached: about 15 minutes on 2 cores the first time). Prints the directory holding the programs;
# LLAMA_CPP_BIN=DIR names one instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${LLAMA_CPP_BIN:-}" ]; then
  echo "$LLAMA_CPP_BIN"; exit 0
fi
LLAMA_VERSION=0.3.36
root=target/llama.cpp
bin=$root/build/bin
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-simple" ] && [ -x "$bin/llama-quantize" ]; then
  echo "$bin"; exit 0
fi
echo "building llama.cpp (llama-cpp-python $LLAMA_VERSION sdist, AVX2/FMA/F16C) in $root: about 15 minutes" >&2
mkdir -p "$root"
# (A fresh machine has no cmake: the sdist's metadata step and the build need one, 3.21 or later.)
if ! command -v cmake >/dev/null 2>&1; then
  python3 -m pip install -q "cmake>=3.21" >&2
fi
if [ ! -d "$root/src" ]; then
  # (The sdist's metadata step needs its build backend.)
  python3 -m pip install -q scikit-build-core >&2
  python3 -m pip download --no-binary :all: --no-deps --no-build-isolation -d "$root" \
    "llama-cpp-python==$LLAMA_VERSION" >&2
  mkdir -p "$root/src"
  tar -xzf "$root/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$root/src" --strip-components=1
fi
cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$root/build" --target llama-bench llama-simple llama-quantize llama-embedding -j "$(nproc)" >&2
echo "$bin"
