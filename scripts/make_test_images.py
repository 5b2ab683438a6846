#!/usr/bin/env python3
"""Small test images for the vision goldens (tests/vision/images/), each exercising one decode or
preprocessing path: odd sizes, extreme aspect ratio, 1x1, grayscale, alpha, palette, JPEG baseline and
progressive. Pixel values are closed-form functions of (x, y), so the files are the same on every run
with the same Pillow (needs Pillow, a dev-only dependency: pip install Pillow; PNGs are written with
optimize off and fixed zlib settings, JPEGs at quality 90 with 4:2:0 subsampling).

  python3 scripts/make_test_images.py [OUTDIR]     (default tests/vision/images)
"""
import hashlib
import math
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def rgb_pattern(w, h, phase=0.0):
    """Smooth colour field: ramps and slow sines, varied enough that a channel or axis swap shows."""
    img = Image.new("RGB", (w, h))
    px = []
    for y in range(h):
        for x in range(w):
            u = x / max(w - 1, 1)
            v = y / max(h - 1, 1)
            r = int(round(255 * u))
            g = int(round(255 * v))
            b = int(round(127.5 + 127.5 * math.sin(2 * math.pi * (u * 1.5 + v * 0.75) + phase)))
            px.append((r, g, b))
    img.putdata(px)
    return img


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/vision/images"
    out.mkdir(parents=True, exist_ok=True)
    files = {}

    # 1x1 RGB: a single non-grey pixel
    one = Image.new("RGB", (1, 1), (200, 40, 90))
    files["rgb_1x1.png"] = (one, dict(format="PNG"))

    # 3000x200 RGB: very wide; smooth so it compresses
    files["rgb_3000x200.png"] = (rgb_pattern(3000, 200), dict(format="PNG", compress_level=9))

    # 37x53 grayscale (mode L)
    g = Image.new("L", (37, 53))
    g.putdata([(x * 7 + y * 3) % 256 for y in range(53) for x in range(37)])
    files["gray_37x53.png"] = (g, dict(format="PNG"))

    # 41x29 RGBA with varied alpha (0 .. 255 across x, colour varies too)
    a = rgb_pattern(41, 29, phase=1.0).convert("RGBA")
    a.putalpha(Image.frombytes("L", (41, 29),
                               bytes(min(255, (x * 255) // 40) if y % 7 else 0 for y in range(29) for x in range(41))))
    files["rgba_41x29.png"] = (a, dict(format="PNG"))

    # 33x47 palette (mode P) with 16 colours
    p = Image.new("P", (33, 47))
    pal = []
    for i in range(16):
        pal += [(i * 16) % 256, (255 - i * 13) % 256, (i * 37 + 20) % 256]
    p.putpalette(pal + [0, 0, 0] * (256 - 16))
    p.putdata([((x // 3) + (y // 4) * 3) % 16 for y in range(47) for x in range(33)])
    files["palette_33x47.png"] = (p, dict(format="PNG"))

    # 64x48 progressive JPEG, 200x120 baseline JPEG
    files["progressive_64x48.jpg"] = (rgb_pattern(64, 48, phase=2.0),
                                      dict(format="JPEG", quality=90, progressive=True, subsampling=2))
    files["baseline_200x120.jpg"] = (rgb_pattern(200, 120, phase=0.5),
                                     dict(format="JPEG", quality=90, progressive=False, subsampling=2))

    total = 0
    for name, (img, kw) in files.items():
        path = out / name
        img.save(path, **kw)
        data = path.read_bytes()
        total += len(data)
        print(f"{hashlib.sha256(data).hexdigest()}  {path}  {img.mode} {img.size[0]}x{img.size[1]} {len(data)} B")
    print(f"total {total} B")


if __name__ == "__main__":
    main()
