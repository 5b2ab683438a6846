#!/usr/bin/env python3
"""Reference data for pinfer's quantization tests (tests/quant_numpy.rs), from the gguf package's numpy code.

    python3 scripts/quant_reference.py OUTDIR [MODEL.gguf]

Writes into OUTDIR (created if needed), all little-endian:

  manifest.txt            one case per line: KIND NAME TYPE N_ELEMENTS [NOTE]
  dequant  NAME.raw       raw blocks of TYPE
           NAME.f32       their dequantization, N_ELEMENTS f32
  quant    NAME.in.f32    an f32 input vector
           NAME.q         its quantization to TYPE

Dequant cases: 64 blocks of random but valid data for every type pinfer dequantizes (finite scales,
including +-0, negative, subnormal and +-65504 ones; all-zero and all-ones blocks), dequantized by
gguf.quants.dequantize. gguf 0.19.0 has no Q8_1 or Q8_K dequantizer; for those two the expected values
come from the two-line numpy port below (marked "port" in the manifest). gguf 0.19.0 also lists Q8_1
as 40 bytes per block; ggml's block is 36 (see block_size). With MODEL.gguf, also the
first 8 rows of the model's first Q4_1 and first Q8_0 tensor.

Quant cases: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (what gguf.quants quantizes among pinfer's quantizers) of a random
vector with edge-case blocks: all zeros, all -0.0, one huge value, exact rounding ties, equal
magnitudes of opposite sign, a constant block.
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

SEED = 20240611
N_BLOCKS = 64

# Byte offsets of each type's scale fields: ("f16" | "f32", offset).
SCALE_FIELDS = {
    T.Q4_0: [("f16", 0)],
    T.Q4_1: [("f16", 0), ("f16", 2)],
    T.Q5_0: [("f16", 0)],
    T.Q5_1: [("f16", 0), ("f16", 2)],
    T.Q8_0: [("f16", 0)],
    T.Q8_1: [("f16", 0), ("f16", 2)],
    T.Q2_K: [("f16", 80), ("f16", 82)],
    T.Q3_K: [("f16", 108)],
    T.Q4_K: [("f16", 0), ("f16", 2)],
    T.Q5_K: [("f16", 0), ("f16", 2)],
    T.Q6_K: [("f16", 208)],
    T.Q8_K: [("f32", 0)],
}


def block_size(qtype: T) -> tuple[int, int]:
    """(elements, bytes) per block. gguf 0.19.0 still lists Q8_1 as 40 bytes (f32 d and s); ggml's
    block_q8_1 has f16 d and s and is 36 bytes, which is what pinfer and GGUF files use."""
    if qtype == T.Q8_1:
        return (32, 36)
    return gguf.GGML_QUANT_SIZES[qtype]


F16_SPECIAL = np.array([0.0, -0.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-14), 1.0, -1.0], dtype=np.float16)
F32_SPECIAL = np.array([0.0, -0.0, 1e30, -1e30, 1e-40, -1.0, 3.0e-8, 1.0], dtype=np.float32)


class Writer:
    def __init__(self, outdir: str):
        self.outdir = outdir
        self.lines: list[str] = []

    def write(self, fname: str, data: np.ndarray) -> None:
        with open(os.path.join(self.outdir, fname), "wb") as f:
            f.write(np.ascontiguousarray(data).tobytes())

    def dequant(self, name: str, qtype: T, raw: np.ndarray, expected: np.ndarray, note: str = "") -> None:
        expected = np.asarray(expected, dtype="<f4").reshape(-1)
        raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
        block_len, block_bytes = block_size(qtype)
        assert raw.size // block_bytes * block_len == expected.size, name
        self.write(f"{name}.raw", raw)
        self.write(f"{name}.f32", expected)
        self.lines.append(f"dequant {name} {qtype.name} {expected.size} {note}".rstrip())

    def quant(self, name: str, qtype: T, x: np.ndarray, q: np.ndarray) -> None:
        self.write(f"{name}.in.f32", np.asarray(x, dtype="<f4"))
        self.write(f"{name}.q", np.asarray(q, dtype=np.uint8))
        self.lines.append(f"quant {name} {qtype.name} {x.size}")

    def finish(self) -> None:
        with open(os.path.join(self.outdir, "manifest.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


def scales_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    # Sane magnitudes (1e-6 .. 10) of both signs, then the specials at random blocks.
    v = (10.0 ** rng.uniform(-6, 1, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
    where = rng.choice(n, size=len(F16_SPECIAL), replace=False)
    v[where] = F16_SPECIAL
    return v


def scales_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    v = (10.0 ** rng.uniform(-8, 3, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    where = rng.choice(n, size=len(F32_SPECIAL), replace=False)
    v[where] = F32_SPECIAL
    return v


def random_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    _, block_bytes = block_size(qtype)
    raw = rng.integers(0, 256, size=(N_BLOCKS, block_bytes), dtype=np.uint8)
    raw[1, :] = 0xFF  # every quant bit set, with scales 65504 (below)
    for kind, at in SCALE_FIELDS[qtype]:
        if kind == "f16":
            raw[:, at : at + 2] = scales_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
            raw[1, at : at + 2] = np.array([65504.0], dtype=np.float16).view(np.uint8)
        else:
            raw[:, at : at + 4] = scales_f32(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 4)
    raw[0, :] = 0  # all-zero block
    return raw


def port_dequantize(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Our numpy port for the types gguf.quants cannot dequantize: x = d * q."""
    if qtype == T.Q8_1:  # d f16, s f16 (unused), qs[32] int8
        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = raw[:, 4:36].copy().view(np.int8).astype(np.float32)
    elif qtype == T.Q8_K:  # d f32, qs[256] int8, bsums[16] int16 (unused)
        d = raw[:, 0:4].copy().view("<f4")
        q = raw[:, 4:260].copy().view(np.int8).astype(np.float32)
    else:
        raise ValueError(qtype)
    return d * q


def float_cases(rng: np.random.Generator, w: Writer) -> None:
    n = N_BLOCKS * 32
    # F16: random finite bit patterns (exponent 0x1f is inf/NaN) plus specials.
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    bits[: len(F16_SPECIAL)] = F16_SPECIAL.view(np.uint16)
    bits[len(F16_SPECIAL) : len(F16_SPECIAL) + 3] = [0x0001, 0x03FF, 0x0400]
    raw = bits.view(np.uint8)
    w.dequant("f16", T.F16, raw, dequantize(raw, T.F16))
    # BF16: exponent 0xff excluded the same way.
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits).astype(np.uint16)
    bits[:6] = [0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x0001, 0x3F80]
    raw = bits.view(np.uint8)
    w.dequant("bf16", T.BF16, raw, dequantize(raw, T.BF16))
    # F32: finite random bit patterns.
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint32)
    bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0x807FFFFF, bits).astype(np.uint32)
    raw = bits.view(np.uint8)
    w.dequant("f32", T.F32, raw, dequantize(raw, T.F32))


def block_cases(rng: np.random.Generator, w: Writer) -> None:
    for qtype in SCALE_FIELDS:
        raw = random_blocks(rng, qtype)
        if qtype in (T.Q8_1, T.Q8_K):
            w.dequant(qtype.name.lower(), qtype, raw, port_dequantize(raw, qtype), "port")
        else:
            w.dequant(qtype.name.lower(), qtype, raw, dequantize(raw, qtype))


def model_cases(path: str, w: Writer) -> None:
    reader = gguf.GGUFReader(path)
    for qtype in (T.Q4_1, T.Q8_0):
        tensor = next((t for t in reader.tensors if t.tensor_type == qtype), None)
        if tensor is None:
            raise SystemExit(f"{path}: no {qtype.name} tensor")
        rows = np.array(tensor.data[:8], dtype=np.uint8)  # (rows, bytes per row)
        expected = dequantize(rows, qtype)
        w.dequant(f"model_{qtype.name.lower()}", qtype, rows, expected, f"tensor={tensor.name}")


def quant_input(rng: np.random.Generator) -> np.ndarray:
    blocks = rng.standard_normal((N_BLOCKS, 32)) * (10.0 ** rng.uniform(-3, 3, (N_BLOCKS, 1)))
    blocks = blocks.astype(np.float32)
    blocks[0] = 0.0
    blocks[1] = -0.0  # numpy and ggml differ on Q4_0's sign of d here (see tests/quant_numpy.rs)
    blocks[2] = 1e-6
    blocks[2, 7] = 60000.0  # one huge value
    # Exact ties: Q8_0 has d = 1 (x.5 rounds away from zero), Q4_0 d = 1 (x + 8.5 integral).
    blocks[3] = np.arange(32) - 15.5
    blocks[3, 0] = 127.0
    blocks[4] = (np.arange(32) % 16) - 7.5
    blocks[4, 0] = -8.0
    # Values where C rounds the sum in f32 before truncating: trunc(f32(x + 8.5)) = 8, round(x) + 8 = 7.
    blocks[4, 5] = np.float32(-0.50000006)
    # Q4_1: min 0, max 15 so d = 1 and (x - min) + 0.5 is integral.
    blocks[5] = (np.arange(32) % 15) + 0.5
    blocks[5, 0], blocks[5, 1] = 0.0, 15.0
    blocks[5, 2] = np.float32(0.49999997)  # f32(x + 0.5) = 1.0: q = 1, not round(x) = 0
    blocks[6] = 0.25
    blocks[6, 3], blocks[6, 9] = -3.0, 3.0  # equal magnitudes: the first one sets the sign
    blocks[7] = 1.5  # constant block: Q4_1 d = 0
    return blocks.reshape(-1)


def quant_cases(rng: np.random.Generator, w: Writer) -> None:
    x = quant_input(rng)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        w.quant(f"quant_{qtype.name.lower()}", qtype, x, quantize(x, qtype))


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    w = Writer(outdir)
    float_cases(rng, w)
    block_cases(rng, w)
    if len(sys.argv) == 3:
        model_cases(sys.argv[2], w)
    quant_cases(rng, w)
    w.finish()


if __name__ == "__main__":
    main()
