#!/usr/bin/env python3
"""Tiny random-weight BERT encoder (llama.cpp's `bert` tensor names and keys) and its float64
NumPy forward pass as the reference of pinfer's encoder.

    python3 scripts/make_bert_tiny.py OUT.gguf [REFERENCE.json]

Deterministic from a seed (needs `pip install gguf==0.19.0 numpy`): E=64, 4 heads of 16, 2 layers,
FFN 128, 96 tokens (a WordPiece-style vocabulary: [PAD] [UNK] [CLS] [SEP] [MASK], then words),
128 positions, 2 token types, a classifier head (cls, cls.output with one label), pooling_type
mean, LayerNorm eps 1e-12, all tensors F32. The reference computes what llama.cpp's bert graph
computes (GELU as ggml's tanh approximation, token type 0 for every token, the classifier's tanh
dense then its output) in float64 for the inputs listed below, and writes each input's token
vectors (pooling none), its mean, first ([CLS]) and last token's vectors and its rank score, all
unnormalised: tests/embed_bert.rs compares pinfer's with them. Prints the sha256 of the model.
"""
import hashlib
import json
import sys

import numpy as np
import gguf

SEED = 50
E, H, L, FF, V, CTX, TYPES = 64, 4, 2, 128, 96, 128, 2
EPS = 1e-12

# Token-id inputs: [CLS] ... [SEP], of different lengths (one of a single token, one longer than
# the 64-token tiles of a prompt, so both attention kernels are exercised).
INPUTS = [
    [2, 10, 11, 12, 3],
    [2, 40, 3],
    [2] + [5 + (7 * i) % 90 for i in range(70)] + [3],
    [7],
    [2, 20, 21, 22, 23, 24, 25, 26, 3],
]


def weights(rng):
    """Every tensor, as llama.cpp names it (NumPy shapes: rows outermost)."""
    r = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)
    t = {
        'token_embd.weight': r(V, E, s=0.5),
        'token_types.weight': r(TYPES, E, s=0.5),
        'position_embd.weight': r(CTX, E, s=0.5),
        'token_embd_norm.weight': (1 + r(E, s=0.1)),
        'token_embd_norm.bias': r(E, s=0.1),
    }
    for i in range(L):
        p = f'blk.{i}.'
        for name in ('attn_q', 'attn_k', 'attn_v', 'attn_output'):
            t[p + name + '.weight'] = r(E, E, s=E ** -0.5)
            t[p + name + '.bias'] = r(E, s=0.1)
        t[p + 'attn_output_norm.weight'] = 1 + r(E, s=0.1)
        t[p + 'attn_output_norm.bias'] = r(E, s=0.1)
        t[p + 'ffn_up.weight'] = r(FF, E, s=E ** -0.5)
        t[p + 'ffn_up.bias'] = r(FF, s=0.1)
        t[p + 'ffn_down.weight'] = r(E, FF, s=FF ** -0.5)
        t[p + 'ffn_down.bias'] = r(E, s=0.1)
        t[p + 'layer_output_norm.weight'] = 1 + r(E, s=0.1)
        t[p + 'layer_output_norm.bias'] = r(E, s=0.1)
    t['cls.weight'] = r(E, E, s=E ** -0.5)
    t['cls.bias'] = r(E, s=0.1)
    t['cls.output.weight'] = r(1, E, s=E ** -0.5)
    t['cls.output.bias'] = r(1, s=0.1)
    return t


def vocab():
    # (llama.cpp's converter marks a word's start with U+2581, as its WPM tokenizer looks words up.)
    words = [f'\u2581w{i}' for i in range(V - 5)]
    return ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words


def write(out, t):
    w = gguf.GGUFWriter(out, 'bert')
    w.add_name('test-bert-tiny')
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(E)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_layer_norm_eps(EPS)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(TYPES)
    toks = vocab()
    w.add_tokenizer_model('bert')
    w.add_token_list(toks)
    w.add_token_types([3] * 5 + [1] * (V - 5))
    # (llama.cpp's WPM tokenizer starts with BOS and ends with SEP/EOS: [CLS] and [SEP].)
    for key, tok in (('unknown', 1), ('padding', 0), ('bos', 2), ('eos', 3), ('cls', 2), ('seperator', 3), ('mask', 4)):
        w.add_uint32(f'tokenizer.ggml.{key}_token_id', tok)
    for name, a in t.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + EPS) * w + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(t, ids):
    """Token vectors [n, E] of one sequence, in float64."""
    f = {k: v.astype(np.float64) for k, v in t.items()}
    n = len(ids)
    x = f['token_embd.weight'][ids] + f['token_types.weight'][0] + f['position_embd.weight'][:n]
    x = layer_norm(x, f['token_embd_norm.weight'], f['token_embd_norm.bias'])
    hd = E // H
    for i in range(L):
        p = f'blk.{i}.'
        lin = lambda name, v: v @ f[p + name + '.weight'].T + f[p + name + '.bias']
        q = lin('attn_q', x).reshape(n, H, hd).transpose(1, 0, 2)
        k = lin('attn_k', x).reshape(n, H, hd).transpose(1, 0, 2)
        v = lin('attn_v', x).reshape(n, H, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(n, E)
        x = layer_norm(lin('attn_output', a) + x, f[p + 'attn_output_norm.weight'], f[p + 'attn_output_norm.bias'])
        h = gelu(lin('ffn_up', x))
        x = layer_norm(lin('ffn_down', h) + x, f[p + 'layer_output_norm.weight'], f[p + 'layer_output_norm.bias'])
    return x


def rank(t, x):
    f = {k: v.astype(np.float64) for k, v in t.items()}
    h = np.tanh(f['cls.weight'] @ x[0] + f['cls.bias'])
    return f['cls.output.weight'] @ h + f['cls.output.bias']


def main():
    out = sys.argv[1]
    t = weights(np.random.default_rng(SEED))
    write(out, t)
    print(hashlib.sha256(open(out, 'rb').read()).hexdigest())
    if len(sys.argv) > 2:
        ref = {'inputs': INPUTS, 'none': [], 'mean': [], 'cls': [], 'last': [], 'rank': []}
        for ids in INPUTS:
            x = forward(t, ids)
            ref['none'].append(x.tolist())
            ref['mean'].append(x.mean(0).tolist())
            ref['cls'].append(x[0].tolist())
            ref['last'].append(x[-1].tolist())
            ref['rank'].append(rank(t, x).tolist())
        with open(sys.argv[2], 'w') as fh:
            json.dump(ref, fh, separators=(',', ':'))
            fh.write('\n')


if __name__ == '__main__':
    main()
