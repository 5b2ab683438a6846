#!/usr/bin/env python3
"""Compares embedding goldens: each file's vectors against the first's (the float64 reference), by
cosine per input (min, mean, worst input) and token ids.

  python3 scripts/embed_compare.py REFERENCE.json OTHER.json...

REFERENCE.json is scripts/bert_reference.py's (`embeddings`) or another llama_embed_golden.py file
(`vectors`); so is each OTHER.
"""
import json
import sys

import numpy as np


def load(path):
    g = json.load(open(path, encoding="utf-8"))
    return g, np.array(g.get("embeddings", g.get("vectors")), dtype=np.float64)


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


ref, ref_v = load(sys.argv[1])
for path in sys.argv[2:]:
    g, v = load(path)
    c = cosines(ref_v, v)
    same_ids = sum(a == b for a, b in zip(ref["ids"], g["ids"]))
    worst = int(c.argmin())
    print(f"{path}: cosine vs {sys.argv[1]} min {c.min():.7f} (input {worst}, {len(ref['ids'][worst])} tokens) "
          f"mean {c.mean():.7f}; max |diff| {np.abs(ref_v - v).max():.2e}; ids equal {same_ids}/{len(ref['ids'])}")
