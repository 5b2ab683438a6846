#!/usr/bin/env python3
"""Compares two GGUF files key by key and tensor by tensor (names, order, types, shapes, bytes), and
prints a summary of the first: its SHA-256, the KV pairs (arrays as length + SHA-256 of their values)
and each tensor's type, shape and data SHA-256.

  python3 scripts/compare_gguf.py A.gguf|A-summary.json [B.gguf] [--summary OUT.json] [--by-name]

Exit status 1 when B is given and differs from A: the same KV pairs in the same order with the same
types and values, the same tensors in the same order with the same bytes (with --by-name the orders
do not matter). A may be a summary this script wrote. Used to check scripts/convert_bert.py against
llama.cpp's convert_hf_to_gguf.py (equal in order too), and pinfer quantize's Q8_0 against
llama-quantize's (--by-name: llama-quantize sorts tensors by block).
"""
import argparse
import hashlib
import json
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType


def field_value(field):
    """A JSON-able value of a KV field: scalars and strings as they are, arrays by length and digest."""
    types = [t.name for t in field.types]
    value = field.contents()
    if field.types[0] == GGUFValueType.ARRAY:
        digest = hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()
        return {"types": types, "len": len(value), "sha256": digest}
    if isinstance(value, float):
        value = float(np.float32(value))
    return {"types": types, "value": value}


def summary(path):
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    r = GGUFReader(path)
    with open(path, "rb") as f:
        file_sha = hashlib.sha256(f.read()).hexdigest()
    kv = [[name, field_value(f)] for name, f in r.fields.items() if not name.startswith("GGUF.")]
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "shape": [int(n) for n in t.shape],
            "sha256": hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest(),
        }
        for t in r.tensors
    ]
    return {"sha256": file_sha, "kv": kv, "tensors": tensors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b", nargs="?")
    ap.add_argument("--summary", help="write A's summary here (JSON)")
    ap.add_argument("--by-name", action="store_true", help="ignore the order of keys and tensors")
    args = ap.parse_args()
    a = summary(args.a)
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            json.dump(a, f, indent=1, ensure_ascii=False)
            f.write("\n")
    print(f"{args.a}: sha256 {a['sha256']}, {len(a['kv'])} keys, {len(a['tensors'])} tensors")
    if not args.b:
        return
    b = summary(args.b)
    print(f"{args.b}: sha256 {b['sha256']}, {len(b['kv'])} keys, {len(b['tensors'])} tensors")
    problems = []
    a_keys, b_keys = [k for k, _ in a["kv"]], [k for k, _ in b["kv"]]
    if (sorted(a_keys) != sorted(b_keys)) if args.by_name else (a_keys != b_keys):
        problems.append(f"keys differ: only in A {sorted(set(a_keys) - set(b_keys))}, "
                        f"only in B {sorted(set(b_keys) - set(a_keys))}, order equal: {a_keys == b_keys}")
    b_kv = dict((k, v) for k, v in b["kv"])
    for k, v in a["kv"]:
        if k in b_kv and b_kv[k] != v:
            problems.append(f"key {k}: {v} vs {b_kv[k]}")
    names = [[t["name"] for t in x["tensors"]] for x in (a, b)]
    if (sorted(names[0]) != sorted(names[1])) if args.by_name else (names[0] != names[1]):
        problems.append("tensor names or order differ")
    b_t = {t["name"]: t for t in b["tensors"]}
    for t in a["tensors"]:
        if t["name"] in b_t and b_t[t["name"]] != t:
            problems.append(f"tensor {t['name']}: {t} vs {b_t[t['name']]}")
    for p in problems:
        print("DIFF", p)
    if problems:
        sys.exit(1)
    same_file = "byte-identical files" if a["sha256"] == b["sha256"] else "files differ only in layout"
    print(f"equal: every KV pair and tensor ({same_file})")


if __name__ == "__main__":
    main()
