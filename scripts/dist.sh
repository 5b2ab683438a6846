#!/usr/bin/env bash
# ./x dist: the release artifacts, under target/dist/:
#   pinfer-VERSION-aarch64-linux-gnu.tar.gz   boards (NEON kernels, the `npu` feature)
#   pinfer-VERSION-x86_64-linux-gnu.tar.gz    PCs (AVX2 kernels chosen at run time)
#   SHA256SUMS                                of the two archives
# Each archive holds the stripped binary, README.md (the board, serving and NPU parts of the
# project README), pinfer.service (systemd unit for `pinfer serve`), the licence files, the licences
# of the crates compiled in (THIRD-PARTY.md) and SHA256SUMS of its files.
#
# The binaries are linked through zig (cargo-zigbuild) against glibc GLIBC_FLOOR's symbols, so they
# start on every board image in use (Debian 11 and Ubuntu 20.04 have glibc 2.31; Rockchip's
# librknnrt.so itself needs 2.17). tests/dist.rs checks the floor in the ELF version needs and runs
# the aarch64 binary under qemu. The archives hold fixed owners, times and order (the same binaries
# give the same archive).
set -euo pipefail
cd "$(dirname "$0")/.."

GLIBC_FLOOR=2.17
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
OUT=target/dist
# A build directory of its own: the zig-linked objects never mix with ./x build-arm's.
export CARGO_TARGET_DIR=target/dist-build

log() { printf 'dist: %s\n' "$*" >&2; }

scripts/setup.sh toolchains
command -v cargo-zigbuild >/dev/null || {
  log "cargo-zigbuild is not on PATH after 'pip install cargo-zigbuild': add pip's script directory to PATH"
  exit 1
}

# build ARCH [ENV...]: the dist profile for ARCH-unknown-linux-gnu at the glibc floor.
build() {
  local arch=$1
  shift
  local features=()
  [ "$arch" = aarch64 ] && features=(--features npu)
  log "building $arch (glibc $GLIBC_FLOOR)"
  env "$@" cargo zigbuild -q --profile dist --target "$arch-unknown-linux-gnu.$GLIBC_FLOOR" \
    --bin pinfer "${features[@]}"
}

# package ARCH: the archive of ARCH's binary.
package() {
  local arch=$1 name="pinfer-$VERSION-$1-linux-gnu"
  local stage="$OUT/$name"
  rm -rf "$stage"
  mkdir -p "$stage"
  cp "$CARGO_TARGET_DIR/$arch-unknown-linux-gnu/dist/pinfer" "$stage/pinfer"
  cp docs/examples/pinfer.service LICENSE-MIT LICENSE-APACHE "$stage/"
  readme_excerpt >"$stage/README.md"
  third_party >"$stage/THIRD-PARTY.md"
  (cd "$stage" && sha256sum pinfer README.md pinfer.service LICENSE-MIT LICENSE-APACHE THIRD-PARTY.md >SHA256SUMS)
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$OUT" -cf - "$name" \
    | gzip -9n >"$OUT/$name.tar.gz"
  rm -rf "$stage"
  log "$OUT/$name.tar.gz: binary $(stat -c %s "$CARGO_TARGET_DIR/$arch-unknown-linux-gnu/dist/pinfer") bytes"
}

# The README's title paragraph and the sections a board user needs.
readme_excerpt() {
  printf '# pinfer %s\n\n' "$VERSION"
  awk '
    /^## / { keep = ($0 ~ /^## (Running on a board|Serving over HTTP|The NPU|Supported boards)/) }
    keep
  ' README.md
}

# Every crate compiled into the binary (normal dependencies, the board's features) with its licence.
third_party() {
  printf '# Crates compiled into pinfer %s\n\n| crate | licence |\n|---|---|\n' "$VERSION"
  cargo tree -q -e normal --target aarch64-unknown-linux-gnu --features npu --prefix none -f '| {p} | {l} |' \
    | grep -v '(/' | sort -u
}

mkdir -p "$OUT"
build aarch64 RUSTC=/usr/bin/rustc
build x86_64
package aarch64
package x86_64
(cd "$OUT" && sha256sum "pinfer-$VERSION-aarch64-linux-gnu.tar.gz" "pinfer-$VERSION-x86_64-linux-gnu.tar.gz" >SHA256SUMS)
log "done: $OUT"
