#!/usr/bin/env python3
"""gguf-py's view of pinfer's q4_K/q6_K quantizer output (tests/quantize.rs runs this).

    python3 scripts/kquant_numpy.py DIR

Reads DIR/in.f32 (the f32 input) and, for TYPE in Q4_K and Q6_K, DIR/TYPE.q (pinfer's blocks of it).
Writes, all little-endian:

  DIR/TYPE.deq.f32   gguf.quants.dequantize of pinfer's blocks (an independent reader of the layout)
  DIR/TYPE.numpy.q   gguf.quants.quantize of the input, only if the installed gguf can quantize TYPE

and prints one line per type: `TYPE quantize supported` or `TYPE quantize unsupported (REASON)`.
gguf 0.19.0 dequantizes both types but quantizes neither (NotImplementedError).
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize


def main() -> None:
    d = sys.argv[1]
    x = np.fromfile(os.path.join(d, "in.f32"), dtype="<f4")
    for name in ("Q4_K", "Q6_K"):
        qtype = T[name]
        ours = np.fromfile(os.path.join(d, f"{name}.q"), dtype=np.uint8)
        deq = dequantize(ours, qtype).astype("<f4").reshape(-1)
        assert deq.size == x.size, (name, deq.size, x.size)
        deq.tofile(os.path.join(d, f"{name}.deq.f32"))
        try:
            theirs = quantize(x.reshape(-1, 256), qtype)
        except NotImplementedError as e:
            print(f"{name} quantize unsupported (NotImplementedError: {e})")
            continue
        np.ascontiguousarray(theirs).astype(np.uint8).reshape(-1).tofile(os.path.join(d, f"{name}.numpy.q"))
        print(f"{name} quantize supported")


if __name__ == "__main__":
    main()
