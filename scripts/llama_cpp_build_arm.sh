#!/usr/bin/env bash
# llama.cpp for aarch64 (armv8.2-a+dotprod+fp16, the level of the instruction counts in
# tests/golden/README.md), cross-built from the same sdist as scripts/llama_cpp_build.sh into
# target/llama.cpp/build-arm/ (static, run under qemu-aarch64 -cpu cortex-a76 without -L): its
# llama-embedding for scripts/insn_per_embed_token.sh and the static libraries scripts/llama_replay.c
# links against. Never a dependency of pinfer or of its CI. Prints the directory holding the programs.
#
#   scripts/llama_cpp_build_arm.sh [TARGET...]   default llama-embedding; llama-mtmd-cli for
#                                                 scripts/vision_insn.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=target/llama.cpp
build=$root/build-arm
targets=("${@:-llama-embedding}")
missing=0
for t in "${targets[@]}"; do [ -x "$build/bin/$t" ] || missing=1; done
if [ $missing = 0 ]; then
  echo "$build/bin"; exit 0
fi
# The sdist (unpacked by the x86 build's script, which also installs cmake).
[ -d "$root/src" ] || scripts/llama_cpp_build.sh >/dev/null
if ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  apt-get install -y -q g++-aarch64-linux-gnu >&2
fi
mkdir -p "$build"
cat >"$build/aarch64.cmake" <<'CMAKE'
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_EXE_LINKER_FLAGS "-static")
CMAKE
echo "building llama.cpp for aarch64 in $build: about 15 minutes" >&2
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root/src/vendor/llama.cpp" -B "$build" -DCMAKE_TOOLCHAIN_FILE="$PWD/$build/aarch64.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
  -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF >&2
for t in "${targets[@]}"; do cmake --build "$build" --target "$t" -j "${JOBS:-$(nproc)}" >&2; done
echo "$build/bin"
