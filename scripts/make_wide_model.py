#!/usr/bin/env python3
"""A 1B-class model that writes SmolLM2-135M's text: for measuring at a real size what depends on
the text a model writes (lookup decoding takes guesses from it), which a shape model's random
weights cannot show.

SmolLM2-135M's 30 layers are widened to Llama-3.2-1B's widths: a residual of 2048 (SmolLM2 576),
32 query heads and 8 KV heads of 64 (9 and 3), an FFN of 4096 (1536), 1.17B weights in all. The
residual is SmolLM2's turned into 2048 dimensions by a random matrix P with orthonormal columns
(r' = P r), so the RMS norm of r' is the norm of r up to the width (its gains and that factor are
folded into the matrices that read it) and every matrix is dense. The added query heads, KV heads
and FFN units have random weights of the real ones' scale; only the columns of the attention output
and FFN down matrices that would add their results to the residual are zero (the blocks they fill
are interleaved with real ones: no zero pages). Computed in float64, written as F16 (norms F32);
quantize with llama-quantize. The text differs from SmolLM2's by the quantization's rounding.

Usage: make_wide_model.py SMOLLM2_GGUF OUT_GGUF [--seed N]"""
import argparse
import numpy as np
import gguf

WIDE_EMBD, WIDE_HEADS, WIDE_KV, WIDE_FF = 2048, 32, 8, 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('smollm2')
    ap.add_argument('out')
    ap.add_argument('--seed', type=int, default=1)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.smollm2)
    f = r.fields
    val = lambda k: f[k].contents()
    assert val('general.architecture') == 'llama'
    E, L, H, HKV, F = (val(f'llama.{k}') for k in ('embedding_length', 'block_count', 'attention.head_count',
                                                   'attention.head_count_kv', 'feed_forward_length'))
    HD = E // H
    group, wide_group = H // HKV, WIDE_HEADS // WIDE_KV
    assert (E, HD, F) == (576, 64, 1536) and group <= wide_group and HKV <= WIDE_KV
    t = {x.name: x for x in r.tensors}
    load = lambda name: gguf.quants.dequantize(t[name].data, t[name].tensor_type).astype(np.float64)
    rng = np.random.default_rng(a.seed)
    P = np.linalg.qr(rng.standard_normal((WIDE_EMBD, E)))[0]  # 2048 x 576, orthonormal columns
    width = np.sqrt(E / WIDE_EMBD)  # RMS over 2048 of r' = RMS over 576 of r times this

    def reading(w, gain):  # a matrix that reads the normed residual: W diag(g) P^T / (the width's factor)
        return (w * gain) @ P.T * width

    def rows(real, n_rows, real_at, scale):  # real rows at their places, random rows elsewhere
        out = rng.normal(0.0, scale, (n_rows, WIDE_EMBD))
        for src, dst in real_at:
            out[dst * HD:(dst + 1) * HD] = real[src * HD:(src + 1) * HD]
        return out

    # SmolLM2's query head i (KV head i // group) is wide head (i // group) * wide_group + i % group.
    q_at = [(i, (i // group) * wide_group + i % group) for i in range(H)]
    kv_at = [(j, j) for j in range(HKV)]

    w = gguf.GGUFWriter(a.out, 'llama')
    w.add_name('smollm2-wide-1b')
    w.add_block_count(L)
    w.add_context_length(val('llama.context_length'))
    w.add_embedding_length(WIDE_EMBD)
    w.add_feed_forward_length(WIDE_FF)
    w.add_head_count(WIDE_HEADS)
    w.add_head_count_kv(WIDE_KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(val('llama.rope.freq_base'))
    w.add_layer_norm_rms_eps(val('llama.attention.layer_norm_rms_epsilon'))
    w.add_vocab_size(val('llama.vocab_size'))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for k, field in f.items():
        if k.startswith('tokenizer.'):
            vt = field.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(k, field.contents(), vt, sub_type=field.types[-1])
            else:
                w.add_key_value(k, field.contents(), vt)
    f16 = lambda x: x.astype(np.float16)
    ones = np.ones(WIDE_EMBD, dtype=np.float32)
    emb = load('token_embd.weight')
    w.add_tensor('token_embd.weight', f16(emb @ P.T))
    w.add_tensor('output_norm.weight', ones)
    w.add_tensor('output.weight', f16(reading(emb, load('output_norm.weight'))))
    for i in range(L):
        b = f'blk.{i}.'
        g = load(b + 'attn_norm.weight')
        for name, real, n_heads, at in [('attn_q', load(b + 'attn_q.weight'), WIDE_HEADS, q_at),
                                        ('attn_k', load(b + 'attn_k.weight'), WIDE_KV, kv_at),
                                        ('attn_v', load(b + 'attn_v.weight'), WIDE_KV, kv_at)]:
            real = reading(real, g)
            w.add_tensor(b + name + '.weight', f16(rows(real, n_heads * HD, at, real.std())))
        wo = load(b + 'attn_output.weight')  # [E out, E in]
        out = np.zeros((WIDE_EMBD, WIDE_HEADS * HD))
        for src, dst in q_at:
            out[:, dst * HD:(dst + 1) * HD] = P @ wo[:, src * HD:(src + 1) * HD]
        w.add_tensor(b + 'attn_output.weight', f16(out))
        g = load(b + 'ffn_norm.weight')
        for name in ('ffn_gate', 'ffn_up'):
            real = reading(load(b + name + '.weight'), g)
            w.add_tensor(b + name + '.weight',
                         f16(np.vstack([real, rng.normal(0.0, real.std(), (WIDE_FF - F, WIDE_EMBD))])))
        down = np.zeros((WIDE_EMBD, WIDE_FF))
        down[:, :F] = P @ load(b + 'ffn_down.weight')
        w.add_tensor(b + 'ffn_down.weight', f16(down))
        w.add_tensor(b + 'attn_norm.weight', ones)
        w.add_tensor(b + 'ffn_norm.weight', ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == '__main__':
    main()
