#!/usr/bin/env python3
"""Draws scripts/scale_bench.sh's results as an SVG chart (no dependencies).

    scripts/scale_chart.py RESULTS.tsv OUT.svg

RESULTS.tsv has one line per model and quant, tab-separated: model, quant, file MiB, tg64 pinfer,
tg64 llama.cpp, pp128 pinfer, pp128 llama.cpp, peak RSS MiB pinfer, peak RSS MiB llama.cpp. Three
panels of paired bars (pinfer above llama.cpp): decode and prefill tokens/s, and peak RSS.
"""
import sys
from xml.sax.saxutils import escape


def main(src, dst):
    rows = []
    with open(src) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) != 9:
                continue
            rows.append((f"{p[0]} {p[1]}", *map(float, p[2:])))
    if not rows:
        sys.exit(f"scale_chart: no rows in {src}")
    panels = [
        ("decode tg64, tokens/s", 2, 3),
        ("prefill pp128, tokens/s", 4, 5),
        ("peak RSS, MiB (lower is better)", 6, 7),
    ]
    label_w, panel_w, gap, bar_h, row_gap, top = 190, 230, 30, 9, 8, 48
    row_h = 2 * bar_h + row_gap
    width = label_w + len(panels) * (panel_w + gap)
    height = top + len(rows) * row_h + 40
    colors = ("#1f77b4", "#bbbbbb")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for i, (label, *_rest) in enumerate(rows):
        y = top + i * row_h + bar_h + 3
        out.append(f'<text x="{label_w - 8}" y="{y}" text-anchor="end">{escape(label)}</text>')
    for k, (title, a, b) in enumerate(panels):
        x0 = label_w + k * (panel_w + gap)
        top_v = max(max(r[a], r[b]) for r in rows) or 1.0
        out.append(f'<text x="{x0}" y="{top - 20}" font-weight="bold">{escape(title)}</text>')
        for i, r in enumerate(rows):
            for j, col in enumerate((a, b)):
                v = r[col]
                w = panel_w * 0.8 * v / top_v
                y = top + i * row_h + j * bar_h
                out.append(f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="{bar_h - 1}" fill="{colors[j]}"/>')
                out.append(f'<text x="{x0 + w + 3:.1f}" y="{y + bar_h - 2}" font-size="9">{v:.1f}</text>')
    ly = height - 16
    for j, name in enumerate(("pinfer", "llama.cpp")):
        x = label_w + j * 110
        out.append(f'<rect x="{x}" y="{ly - 9}" width="12" height="10" fill="{colors[j]}"/>')
        out.append(f'<text x="{x + 16}" y="{ly}">{name}</text>')
    out.append("</svg>")
    with open(dst + ".tmp", "w") as f:
        f.write("\n".join(out) + "\n")
    import os

    os.replace(dst + ".tmp", dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
