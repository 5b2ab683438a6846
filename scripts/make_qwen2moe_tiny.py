#!/usr/bin/env python3
"""Tiny random-weight qwen2moe test model, deterministic from a seed, with the SmolLM2 vocabulary.

    python3 scripts/make_qwen2moe_tiny.py SMOLLM2_GGUF OUT.gguf

Same style and tokenizer metadata as tests/golden/make_test_models.py's qwen2 model (pre-tokenizer
qwen2, add_bos false, bos 1, eos 2); needs `pip install gguf==0.19.0 numpy` (another gguf version may
write different bytes). Architecture qwen2moe:
  E=128, H=4, HKV=2 (head dim 32), L=3, 8 experts with 2 used per token, expert FFN 128, shared-expert
  FFN 256, QKV biases (F32), F32 router ffn_gate_inp [E, 8] and shared-expert gate ffn_gate_inp_shexp
  [E], Q8_0 experts, shared expert, attention, token_embd and output (llama.cpp's qwen2moe needs an
  output.weight; it is drawn last, so every other tensor is as in the first, tied version).
Its greedy reference (tests/golden/qwen2moe-tiny.greedy.jsonl) is llama.cpp's (scripts/make_golden.py);
scripts/moe_reference.py's independent NumPy forward pass agrees with it to 0.0001 on three of its
four prompts (see its --compare).
Prints the sha256 of the written file.
"""
import hashlib
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

SEED = 115

E, H, HKV, L = 128, 4, 2, 3
NE, NU = 8, 2
FF_EXP = 128      # expert_feed_forward_length
FF_SHEXP = 256    # expert_shared_feed_forward_length
FF = 256          # feed_forward_length (unused by qwen2moe when the two above are set)


def vocab_from(path):
    f = gguf.GGUFReader(path).fields
    toks = f['tokenizer.ggml.tokens'].contents()
    types = f['tokenizer.ggml.token_type'].contents()
    merges = f['tokenizer.ggml.merges'].contents()
    return toks, types, merges


def build(out, toks, types, merges, seed=SEED):
    arch = 'qwen2moe'
    rng = np.random.default_rng(seed)
    V = len(toks)
    hd = E // H
    kvd = hd * HKV
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f'test-{arch}')
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(NE)
    w.add_expert_used_count(NU)
    w.add_expert_feed_forward_length(FF_EXP)
    w.add_expert_shared_feed_forward_length(FF_SHEXP)
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre('qwen2')
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def t(name, shape, scale, q=QT.F32):
        # shape in ggml order (ne0 first); numpy order is reversed
        a = (rng.standard_normal(size=shape[::-1]) * scale).astype(np.float32)
        if q == QT.F32:
            w.add_tensor(name, a)
        else:
            d = gguf.quants.quantize(a, q)
            w.add_tensor(name, d, raw_shape=d.shape, raw_dtype=q)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t('token_embd.weight', [E, V], 0.5, QT.Q8_0)
    norm('output_norm.weight', E)
    for i in range(L):
        p = f'blk.{i}.'
        norm(p + 'attn_norm.weight', E)
        norm(p + 'ffn_norm.weight', E)
        t(p + 'attn_q.weight', [E, E], 0.25, QT.Q8_0)
        t(p + 'attn_k.weight', [E, kvd], 0.25, QT.Q8_0)
        t(p + 'attn_v.weight', [E, kvd], 0.25, QT.Q8_0)
        t(p + 'attn_output.weight', [E, E], 0.25, QT.Q8_0)
        t(p + 'attn_q.bias', [E], 0.1)
        t(p + 'attn_k.bias', [kvd], 0.1)
        t(p + 'attn_v.bias', [kvd], 0.1)
        t(p + 'ffn_gate_inp.weight', [E, NE], 0.5)
        t(p + 'ffn_gate_exps.weight', [E, FF_EXP, NE], 0.25, QT.Q8_0)
        t(p + 'ffn_up_exps.weight', [E, FF_EXP, NE], 0.25, QT.Q8_0)
        t(p + 'ffn_down_exps.weight', [FF_EXP, E, NE], 0.2, QT.Q8_0)
        t(p + 'ffn_gate_inp_shexp.weight', [E], 0.2)
        t(p + 'ffn_gate_shexp.weight', [E, FF_SHEXP], 0.25, QT.Q8_0)
        t(p + 'ffn_up_shexp.weight', [E, FF_SHEXP], 0.25, QT.Q8_0)
        t(p + 'ffn_down_shexp.weight', [FF_SHEXP, E], 0.2, QT.Q8_0)
    t('output.weight', [E, V], 0.5, QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1:3]
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    toks, types, merges = vocab_from(src)
    build(out, toks, types, merges)
    with open(out, 'rb') as f:
        print(f'{hashlib.sha256(f.read()).hexdigest()}  {out}')


if __name__ == '__main__':
    main()
