# Shape models of released image encoders for scripts/vision_bench.sh and scripts/vision_insn.sh
# (sourced): scripts/make_tiny_vlm.py --shape writes them, with a synthetic PNG of each encoder's
# size, into target/vision-shapes/ (kept between runs). The sourcing script defines log().
#
#   shape_model SHAPE TYPE   the directory holding model.gguf and mmproj.gguf (written when missing)
#   shape_image SHAPE        the PNG of the encoder's size

OUT=target/vision-shapes
mkdir -p "$OUT"

family_of() { case "$1" in smolvlm-256m) echo idefics3 ;; siglip-so400m) echo gemma3 ;; *) log "no shape $1"; exit 2 ;; esac; }
side_of() { case "$1" in smolvlm-256m) echo 512 ;; siglip-so400m) echo 896 ;; esac; }
vocab_of() {
  case "$1" in
    gemma3) scripts/tokenizer_fetch_gemma3.sh >&2; echo models/gemma-3-270m-q4_k_m.gguf ;;
    *) scripts/setup.sh variants >&2; echo models/SmolLM2-135M-Instruct.Q8_0.gguf ;;
  esac
}

# A synthetic PNG of the encoder's size: gradients and noise (no file of the repo is that large).
shape_image() {
  local side
  side=$(side_of "$1")
  local path=$OUT/image-$side.png
  [ -f "$path" ] || python3 - "$side" "$path" <<'EOF'
import struct, sys, zlib
import numpy as np
side, path = int(sys.argv[1]), sys.argv[2]
y, x = np.mgrid[0:side, 0:side]
img = np.stack([x * 255 // (side - 1), y * 255 // (side - 1), (x ^ y) & 255], -1)
img = np.clip(img + np.random.default_rng(side).integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
raw = b"".join(b"\x00" + img[r].tobytes() for r in range(side))
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
with open(path + ".part", "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
EOF
  [ -f "$path" ] || mv "$path.part" "$path"
  echo "$path"
}

shape_model() {
  local shape=$1 ty=$2 family dir
  family=$(family_of "$shape")
  dir=$OUT/$shape-$ty
  if [ ! -f "$dir/mmproj.gguf" ]; then
    log "writing the $shape shape model ($ty) to $dir"
    python3 scripts/make_tiny_vlm.py --family "$family" --shape "$shape" --seed 3 --type "$ty" \
      --vocab "$(vocab_of "$family")" --out "$dir" >&2
  fi
  echo "$dir"
}
