#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf with their .inp/.out
# files) for tests/tokenizer.rs, its example grammars (grammars/*.gbnf, into DEST/grammars) for
# tests/grammar.rs, and the real chat templates it tests with (models/templates/*.jinja, into
# DEST/templates) for tests/chat_jinja.rs. They ship inside the llama-cpp-python sdist on PyPI, under vendor/llama.cpp/.
# Only the download is used: the sdist is unpacked, never built.
# Idempotent: does nothing when the files of this version are already there. Never commit them.
#
#   scripts/tokenizer_fetch_vocabs.sh [DEST]     (default: target/tokenizer-vocabs)
set -euo pipefail
cd "$(dirname "$0")/.."

DEST="${1:-target/tokenizer-vocabs}"
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PY="${PYTHON:-python3}"
STAMP="$DEST/.llama-cpp-python-$VERSION-with-templates"
# (The stamp of the fetch before templates were added; tests/tokenizer.rs and grammar.rs read it.)
OLD_STAMP="$DEST/.llama-cpp-python-$VERSION-with-grammars"

log() { printf 'tokenizer_fetch_vocabs: %s\n' "$*" >&2; }

if [ -f "$STAMP" ]; then
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# `--no-binary llama-cpp-python` fetches the sdist; pip still prepares its metadata, which installs
# the (binary) build backend in an isolated environment but compiles nothing. (`--no-binary :all:`
# would also force the backend's own dependencies, cmake among them, to be built from source.)
log "downloading llama-cpp-python==$VERSION (sdist) from PyPI"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
  -d "$tmp" "llama-cpp-python==$VERSION"
archive="$tmp/llama_cpp_python-$VERSION.tar.gz"
if ! echo "$SHA256  $archive" | sha256sum -c --status; then
  log "sha256 mismatch for $archive (expected $SHA256); refusing it"
  exit 1
fi
tar -xzf "$archive" -C "$tmp" --wildcards "llama_cpp_python-$VERSION/vendor/llama.cpp/models/ggml-vocab-*" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/grammars/*.gbnf" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates/*.jinja"
mkdir -p "$DEST/grammars" "$DEST/templates"
cp "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/models/"ggml-vocab-* "$DEST/"
cp "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/grammars/"*.gbnf "$DEST/grammars/"
cp "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates/"*.jinja "$DEST/templates/"
touch "$STAMP" "$OLD_STAMP"
log "ready: $DEST ($(ls "$DEST" | wc -l) files)"
