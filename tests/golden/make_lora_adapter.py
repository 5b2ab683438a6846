#!/usr/bin/env python3
"""A random LoRA adapter in llama.cpp's GGUF form for a llama-family base model, deterministic from a
seed (the adapter the LoRA goldens were made with).

    make_lora_adapter.py BASE_GGUF OUT [--rank 8] [--alpha 16] [--seed 7]

Pairs for attn_q/k/v/output and ffn_gate/up/down of every layer: `W.lora_a` [n_in, r] of N(0, 1/n_in)
values and `W.lora_b` [r, n_out] of N(0, 0.04) values (F32), large enough that the adapted model's
greedy tokens differ from the base's."""
import argparse

import gguf
import numpy as np

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    reader = gguf.GGUFReader(a.base)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ggml order: [n_in, n_out]
    counter = [a.seed * 1000003]

    def uniform(shape):
        # splitmix64 of consecutive counters, top 24 bits -> [-1, 1)
        n = int(np.prod(shape))
        x = (np.arange(n, dtype=np.uint64) + np.uint64(counter[0])) * np.uint64(0x9E3779B97F4A7C15)
        counter[0] += n
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return ((x >> np.uint64(40)).astype(np.float64) / float(1 << 24) * 2.0 - 1.0).reshape(shape)

    w = gguf.GGUFWriter(a.out, arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", a.alpha)
    n_layer = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blk."))
    for il in range(n_layer):
        for target in TARGETS:
            name = f"blk.{il}.{target}.weight"
            n_in, n_out = shapes[name][:2]
            lora_a = (uniform((a.rank, n_in)) * np.sqrt(3.0 / n_in)).astype(np.float32)
            lora_b = (uniform((n_out, a.rank)) * 0.04 * np.sqrt(3.0)).astype(np.float32)
            w.add_tensor(name + ".lora_a", lora_a)
            w.add_tensor(name + ".lora_b", lora_b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
