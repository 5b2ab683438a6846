#!/usr/bin/env bash
# Regenerates rknn-sys/src/bindings.rs from rknn-sys/include/rknn_matmul_subset.h with bindgen
# (the `regenerate` feature: bindgen runs in build.rs and needs libclang, from libclang-dev).
#
#   rknn-sys/regen.sh           rewrite src/bindings.rs
#   rknn-sys/regen.sh --check   only check that it is current (as `cargo test --all-features` does)
#
# With RKNN_INCLUDE_DIR=<Rockchip SDK>/rknpu2/runtime/Linux/librknn_api/include the check also
# compares our structs and constants with what bindgen makes of the vendor's rknn_matmul_api.h.
# Nothing generated from the vendor's headers is written into the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
bless=1
if [ "${1:-}" = "--check" ]; then bless=0; fi
RKNN_SYS_BLESS=$bless cargo test -p rknn-sys --features regenerate --test regenerate -- --nocapture
