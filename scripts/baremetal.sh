#!/usr/bin/env bash
# pinfer without Linux: builds the bare-metal image (boards/qemu-virt, aarch64-unknown-none) and runs
# it under qemu-system-aarch64 -M virt -cpu cortex-a76 with the model placed in RAM.
#
#   scripts/baremetal.sh build [--embed MODEL] [--prompt P]   the image (with the model inside: --embed)
#   scripts/baremetal.sh run -m MODEL [-p PROMPT] [-n N] [-c CTX] [--mem SIZE] [--count] [--el2] [--fault]
#   scripts/baremetal.sh run --embedded [--mem SIZE]          the image built with --embed
#
# run: the generated text on stdout; diagnostics (kernels, arena, boot-to-first-token time, ms per
# token, the generated ids) on stderr; the exit status is the image's (0 ok, 1 error, 2 panic,
# 3 CPU exception). --count adds the guest instructions of the whole run (QEMU's TCG plugin,
# scripts/qemu-plugin/insn_count.c) on stderr. The model goes at the top of RAM (--mem, default
# 1G), the boot header in the page below the image (docs/baremetal.md has the memory map).
# --el2 starts the image at EL2 as U-Boot does on RK3588 boards (-M virt,virtualization=on);
# --fault makes it read an unmapped address first (a test of its exception vectors).
#
# Needs: Debian's rustc-web and rust-web-src (RUSTC=/usr/bin/rustc, -Zbuild-std=core),
# binutils-aarch64-linux-gnu (the linker), qemu-system-arm; scripts/setup.sh toolchains installs them.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

die() { echo "baremetal: $*" >&2; exit 1; }
TARGET_DIR=$PWD/target/baremetal
IMAGE=$TARGET_DIR/aarch64-unknown-none/release/pinfer-baremetal
EMBED_IMAGE=$TARGET_DIR/embedded/aarch64-unknown-none/release/pinfer-baremetal
HEADER_ADDR=$((0x4007f000))
RAM_START=$((0x40000000))

build() { # TARGET_DIR [cargo args...]
  local dir=$1; shift
  # (rustc warns that it does not know -strict-align by name; it passes it to LLVM, which does:
  # the build's output is shown only when it fails.)
  local log
  log=$(cd boards/qemu-virt && env RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$dir" \
    cargo build --release -Zbuild-std=core -Zbuild-std-features=compiler-builtins-mem \
    --target aarch64-unknown-none "$@" 2>&1) || { echo "$log" >&2; die "the image did not build"; }
}

size_of() { case "$1" in *G) echo $((${1%G} << 30)) ;; *M) echo $((${1%M} << 20)) ;; *) die "--mem takes a size like 1G or 1536M (got '$1')" ;; esac; }

cmd=${1:-}
shift || true
case "$cmd" in
  build)
    embed="" prompt=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --embed) embed=${2:?--embed needs a model}; shift 2 ;;
        --prompt) prompt=${2?}; shift 2 ;;
        *) die "unknown option '$1'" ;;
      esac
    done
    if [ -n "$embed" ]; then
      [ -f "$embed" ] || die "$embed: no such model file"
      PINFER_EMBED_MODEL=$(realpath "$embed") PINFER_EMBED_PROMPT=${prompt:-The capital of France is} \
        build "$TARGET_DIR/embedded" --features embed-model
      [ -f "$EMBED_IMAGE" ] || die "the build made no image"
      echo "$EMBED_IMAGE"
    else
      build "$TARGET_DIR"
      [ -f "$IMAGE" ] || die "the build made no image"
      echo "$IMAGE"
    fi
    ;;
  run)
    model="" prompt="The capital of France is" n=32 ctx=0 mem=1G count=0 embedded=0 machine=virt flags=1
    while [ $# -gt 0 ]; do
      case "$1" in
        -m) model=${2:?-m needs a model}; shift 2 ;;
        -p) prompt=${2?-p needs a prompt}; shift 2 ;;
        -n) n=${2:?-n needs a count}; shift 2 ;;
        -c) ctx=${2:?-c needs a size}; shift 2 ;;
        --mem) mem=${2:?--mem needs a size}; shift 2 ;;
        --count) count=1; shift ;;
        --embedded) embedded=1; shift ;;
        --el2) machine=virt,virtualization=on; shift ;;
        --fault) flags=$((flags | 0x100)); shift ;;
        *) die "unknown option '$1' (see the top of scripts/baremetal.sh)" ;;
      esac
    done
    [[ $n =~ ^[0-9]+$ && $ctx =~ ^[0-9]+$ ]] || die "-n and -c take numbers"
    command -v qemu-system-aarch64 >/dev/null || die "qemu-system-aarch64 missing (apt-get install qemu-system-arm)"
    ram_end=$((RAM_START + $(size_of "$mem")))
    loaders=()
    model_addr=0 model_len=0
    if [ "$embedded" = 1 ]; then
      [ -f "$EMBED_IMAGE" ] || die "no embedded image: scripts/baremetal.sh build --embed MODEL"
      image=$EMBED_IMAGE
    else
      [ -n "$model" ] || die "run needs -m MODEL (or --embedded)"
      [ -f "$model" ] || die "$model: no such model file"
      build "$TARGET_DIR"
      image=$IMAGE
      model_len=$(stat -c %s "$model")
      # At the top of RAM, 2 MiB-aligned: the arena is everything between the image and it.
      model_addr=$(((ram_end - model_len) & ~((2 << 20) - 1)))
      ((model_addr > RAM_START + (64 << 20))) || die "$model does not fit in $mem of RAM beside the image (use --mem)"
      loaders+=(-device "loader,file=$(realpath "$model"),addr=$model_addr,force-raw=on")
    fi
    work=$(mktemp -d "${TMPDIR:-/tmp}/baremetal.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    # The boot header (platform.rs's BootHeader): magic, version 1, flags (1 = semihosting exit and
    # stderr, 0x100 = fault test), model address and length, end of RAM, tokens, context, prompt length, the prompt.
    python3 - "$work/header.bin" "$flags" "$model_addr" "$model_len" "$ram_end" "$n" "$ctx" "$prompt" <<'PY'
import struct, sys
out, flags, addr, length, ram_end, n, ctx, prompt = sys.argv[1:]
p = prompt.encode()
h = struct.pack('<8sIIQQQIIII', b'PINFBOOT', 1, int(flags), int(addr), int(length), int(ram_end), int(n), int(ctx), len(p), 0)
if len(h) + len(p) > 4096:
    sys.exit(f'baremetal: the prompt is {len(p)} bytes; the boot header page holds {4096 - len(h)}')
open(out, 'wb').write(h + p)
PY
    loaders+=(-device "loader,file=$work/header.bin,addr=$HEADER_ADDR,force-raw=on")
    plugin=()
    if [ "$count" = 1 ]; then
      so=target/qemu-plugin/insn_count.so
      if [ ! -f "$so" ] || [ scripts/qemu-plugin/insn_count.c -nt "$so" ]; then
        mkdir -p target/qemu-plugin
        # shellcheck disable=SC2046
        gcc -O2 -shared -fPIC -o "$so" scripts/qemu-plugin/insn_count.c $(pkg-config --cflags glib-2.0 2>/dev/null || true)
      fi
      plugin=(-plugin "$so,out=$work/count")
    fi
    status=0
    # -nic none: the image has no network, and the default virtio NIC wants a boot ROM
    # (efi-virtio.rom) that qemu-system-arm installed without recommends does not have.
    qemu-system-aarch64 -M "$machine" -cpu cortex-a76 -m "$mem" -nographic -monitor none -nic none \
      -semihosting-config enable=on,target=native "${plugin[@]}" \
      -kernel "$image" "${loaders[@]}" || status=$?
    [ "$count" = 0 ] || echo "pinfer: guest instructions of the whole run: $(cat "$work/count")" >&2
    exit $status
    ;;
  *) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || [ "$cmd" = help ] || exit 2 ;;
esac
