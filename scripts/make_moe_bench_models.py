#!/usr/bin/env python3
"""Synthetic models for the mixture-of-experts benchmark (scripts/moe_bench.sh).

Usage: make_moe_bench_models.py OUTDIR

Writes two random-weight Q4_0 models with the same active size per token:
- moe-bench.gguf:   qwen3moe, 8 layers, n_embd 1024, 8 experts of 1024x2816, 2 used per token;
- dense-bench.gguf: qwen3, the same but one dense FFN of width 2 x 2816 = 5632.
So a token multiplies the same number of FFN weights in both, and the experts dominate the MoE
file (8 x 3 x 1024 x 2816 per layer). The vocabulary is GPT-2's 256 byte symbols (plus one merge, BOS
and EOS), so the output matmul stays small next to the FFNs. Deterministic from a seed.
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

E, H, HKV, L = 1024, 16, 4, 8
FF_EXPERT, N_EXPERT, N_USED = 2816, 8, 2


def byte_symbols():
    """GPT-2's byte-to-unicode table: the 256 single-symbol tokens of a byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def build(path, moe, seed):
    rng = np.random.default_rng(seed)
    arch = "qwen3moe" if moe else "qwen3"
    # One merge (" t"): a BPE vocabulary needs some.
    toks = byte_symbols() + ["\u0120t", "<|bos|>", "<|eos|>"]
    types = [1] * 257 + [3, 3]
    hd = E // H
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"{arch}-bench")
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF_EXPERT if moe else N_USED * FF_EXPERT)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_USED)
        w.add_expert_feed_forward_length(FF_EXPERT)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)

    def t(name, shape, scale, q=QT.Q4_0):
        a = (rng.standard_normal(size=shape[::-1], dtype=np.float32) * scale).astype(np.float32)
        if q == QT.F32:
            w.add_tensor(name, a)
        else:
            d = gguf.quants.quantize(a, q)
            w.add_tensor(name, d, raw_shape=d.shape, raw_dtype=q)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", [E, len(toks)], 0.5, QT.Q8_0)
    norm("output_norm.weight", E)
    kvd = hd * HKV
    for i in range(L):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", E)
        norm(p + "ffn_norm.weight", E)
        t(p + "attn_q.weight", [E, E], 0.03)
        t(p + "attn_k.weight", [E, kvd], 0.03)
        t(p + "attn_v.weight", [E, kvd], 0.03)
        t(p + "attn_output.weight", [E, E], 0.03)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        if moe:
            t(p + "ffn_gate_inp.weight", [E, N_EXPERT], 0.05, QT.F32)
            t(p + "ffn_gate_exps.weight", [E, FF_EXPERT, N_EXPERT], 0.03)
            t(p + "ffn_up_exps.weight", [E, FF_EXPERT, N_EXPERT], 0.03)
            t(p + "ffn_down_exps.weight", [FF_EXPERT, E, N_EXPERT], 0.02)
        else:
            ff = N_USED * FF_EXPERT
            t(p + "ffn_gate.weight", [E, ff], 0.03)
            t(p + "ffn_up.weight", [E, ff], 0.03)
            t(p + "ffn_down.weight", [ff, E], 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name, moe, seed in (("moe-bench.gguf", True, 901), ("dense-bench.gguf", False, 902)):
        path = os.path.join(out, name)
        if os.path.exists(path):
            print(f"{path}: exists")
            continue
        build(path + ".tmp", moe, seed)
        os.replace(path + ".tmp", path)
        print(f"{path}: written")


if __name__ == "__main__":
    main()
