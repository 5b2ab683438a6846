#!/usr/bin/env python3
"""An independent float64 numpy forward of each tiny encoder model (scripts/make_encoder_tiny.py) on
llama.cpp's token ids from its golden, compared with llama.cpp's vectors: it pins down, in a few lines
each, what the goldens hold (the facts below were read from llama.cpp's src/models/*.cpp and
llama-graph.cpp, and this script checks them against its output).

  python3 scripts/encoder_tiny_reference.py [MODELS_DIR] [GOLDENS_DIR]

Prints, per golden, the worst cosine and per-component difference. Facts:
- BERT family: x = tok + token_types[0] (every token type 0) (+ position_embd for bert); LayerNorm;
  post-LN blocks; GELU in ggml's tanh form through its F16 table (HF's MiniLM uses the erf form).
- nomic-bert: fused attn_qkv rows [q; k; v], NeoX RoPE (pairs i, i + d/2) base from the file,
  FFN down(silu(gate x) * up x) without biases.
- jina-bert-v2: ALiBi, bias -slope_h |i - j| with slope_h = (2^(-8/n))^(h+1) for n = 4 heads (n a power
  of two); GEGLU: up x split in halves [a | b] (n_ff each), down(gelu(a) * b) + bias.
- bert rank: tanh(cls [CLS-row] + b) then cls.output: the raw score.
- qwen3: causal, RMSNorm, Q/K RMSNorm per head, NeoX RoPE, GQA; last pooling = the last token; rank:
  softmax(cls.output h_last) = [p(yes), p(no)].
- gemma-embedding: x * sqrt(n_embd), bidirectional, SWA layers see |i - j| <= n_swa / 2 with their own
  RoPE base, q scaled by 1/sqrt(head dim), post-attention and post-FFN RMSNorms, down(gelu(gate x) * up x),
  output RMSNorm, mean pooling, then dense_2, dense_3 (no bias), then the L2 normalisation.
"""
import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np


def load(path):
    r = gguf.GGUFReader(path)
    t = {x.name: np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float64)
         .reshape([int(n) for n in reversed(x.shape)]) for x in r.tensors}
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "tokenizer.ggml.t",
                                                                              "tokenizer.ggml.m"))}
    return t, kv


def gelu(x):
    """ggml's GELU on the CPU: the tanh form looked up by the input rounded to F16, the result stored
    in F16 (the identity from 10 up, 0 from -10 down)."""
    h = x.astype(np.float16).astype(np.float64)
    y = (0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * h * (1.0 + 0.044715 * h * h))))
    y = y.astype(np.float16).astype(np.float64)
    return np.where(x >= 10.0, x, np.where(x <= -10.0, 0.0, y))


def silu(x):
    return x / (1.0 + np.exp(-x))


def layer_norm(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rope_neox(x, base):
    """x: (heads, n, d), positions 0..n-1; rotates pairs (i, i + d/2)."""
    n, d = x.shape[1], x.shape[2]
    theta = np.arange(n)[:, None] * base ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def attention(q, k, v, scale, bias=None):
    """q: (H, n, d), k/v: (HKV, n, d); bias: (H or 1, n, n) added to the scores (-inf masks)."""
    rep = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    s = q @ k.transpose(0, 2, 1) * scale
    if bias is not None:
        s = s + bias
    return softmax(s) @ v


def heads(x, h):
    n = x.shape[0]
    return x.reshape(n, h, -1).transpose(1, 0, 2)


def merge(x):
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


def bert_family(t, kv, arch, ids):
    n, E, H = len(ids), kv[f"{arch}.embedding_length"], kv[f"{arch}.attention.head_count"]
    eps = kv[f"{arch}.attention.layer_norm_epsilon"]
    lin = lambda x, name: x @ t[f"{name}.weight"].T + (t[f"{name}.bias"] if f"{name}.bias" in t else 0)  # noqa: E731
    ln = lambda x, name: layer_norm(x, t[f"{name}.weight"], t[f"{name}.bias"], eps)  # noqa: E731
    x = t["token_embd.weight"][ids] + t["token_types.weight"][0]
    if "position_embd.weight" in t:
        x = x + t["position_embd.weight"][:n]
    x = ln(x, "token_embd_norm")
    bias = None
    if arch == "jina-bert-v2":
        m0 = 2.0 ** (-8.0 / H)
        slopes = m0 ** np.arange(1, H + 1)
        pos = np.arange(n)
        bias = -slopes[:, None, None] * np.abs(pos[None, :, None] - pos[None, None, :])
    for i in range(kv[f"{arch}.block_count"]):
        p = f"blk.{i}"
        if f"{p}.attn_qkv.weight" in t:
            q, k, v = np.split(lin(x, f"{p}.attn_qkv"), 3, axis=-1)
        else:
            q, k, v = (lin(x, f"{p}.attn_{m}") for m in "qkv")
        q, k, v = heads(q, H), heads(k, H), heads(v, H)
        if arch == "nomic-bert":
            base = kv[f"{arch}.rope.freq_base"]
            q, k = rope_neox(q, base), rope_neox(k, base)
        att = merge(attention(q, k, v, 1.0 / math.sqrt(E // H), bias))
        x = ln(x + lin(att, f"{p}.attn_output"), f"{p}.attn_output_norm")
        if arch == "nomic-bert":
            h = lin(silu(lin(x, f"{p}.ffn_gate")) * lin(x, f"{p}.ffn_up"), f"{p}.ffn_down")
        elif arch == "jina-bert-v2":
            a, b = np.split(lin(x, f"{p}.ffn_up"), 2, axis=-1)
            h = lin(gelu(a) * b, f"{p}.ffn_down")
        else:
            h = lin(gelu(lin(x, f"{p}.ffn_up")), f"{p}.ffn_down")
        x = ln(x + h, f"{p}.layer_output_norm")
    return x


def qwen3(t, kv, ids):
    a = "qwen3"
    n, H, HKV, hd = len(ids), kv[f"{a}.attention.head_count"], kv[f"{a}.attention.head_count_kv"], kv[f"{a}.attention.key_length"]
    eps, base = kv[f"{a}.attention.layer_norm_rms_epsilon"], kv[f"{a}.rope.freq_base"]
    W = lambda name: t[f"{name}.weight"]  # noqa: E731
    x = t["token_embd.weight"][ids]
    causal = np.where(np.tril(np.ones((n, n))) > 0, 0.0, -np.inf)[None]
    for i in range(kv[f"{a}.block_count"]):
        p = f"blk.{i}"
        h = rms_norm(x, W(f"{p}.attn_norm"), eps)
        q = rms_norm(heads(h @ W(f"{p}.attn_q").T, H), W(f"{p}.attn_q_norm"), eps)
        k = rms_norm(heads(h @ W(f"{p}.attn_k").T, HKV), W(f"{p}.attn_k_norm"), eps)
        v = heads(h @ W(f"{p}.attn_v").T, HKV)
        att = attention(rope_neox(q, base), rope_neox(k, base), v, 1.0 / math.sqrt(hd), causal)
        x = x + merge(att) @ W(f"{p}.attn_output").T
        h = rms_norm(x, W(f"{p}.ffn_norm"), eps)
        x = x + (silu(h @ W(f"{p}.ffn_gate").T) * (h @ W(f"{p}.ffn_up").T)) @ W(f"{p}.ffn_down").T
    return rms_norm(x, W("output_norm"), eps)


def gemma_embedding(t, kv, ids):
    a = "gemma-embedding"
    n, E = len(ids), kv[f"{a}.embedding_length"]
    H, HKV, hd = kv[f"{a}.attention.head_count"], kv[f"{a}.attention.head_count_kv"], kv[f"{a}.attention.key_length"]
    eps, L, pattern = kv[f"{a}.attention.layer_norm_rms_epsilon"], kv[f"{a}.block_count"], kv[f"{a}.attention.sliding_window_pattern"]
    half = kv[f"{a}.attention.sliding_window"] // 2
    pos = np.arange(n)
    window = np.where(np.abs(pos[:, None] - pos[None, :]) <= half, 0.0, -np.inf)[None]
    W = lambda name: t[f"{name}.weight"]  # noqa: E731
    x = t["token_embd.weight"][ids] * math.sqrt(E)
    for i in range(L):
        p = f"blk.{i}"
        swa = i % pattern < pattern - 1
        base = kv[f"{a}.rope.freq_base_swa"] if swa else kv[f"{a}.rope.freq_base"]
        h = rms_norm(x, W(f"{p}.attn_norm"), eps)
        q = rope_neox(rms_norm(heads(h @ W(f"{p}.attn_q").T, H), W(f"{p}.attn_q_norm"), eps), base)
        k = rope_neox(rms_norm(heads(h @ W(f"{p}.attn_k").T, HKV), W(f"{p}.attn_k_norm"), eps), base)
        v = heads(h @ W(f"{p}.attn_v").T, HKV)
        att = attention(q / math.sqrt(hd), k, v, 1.0, window if swa else None)
        x = x + rms_norm(merge(att) @ W(f"{p}.attn_output").T, W(f"{p}.post_attention_norm"), eps)
        h = rms_norm(x, W(f"{p}.ffn_norm"), eps)
        f = (gelu(h @ W(f"{p}.ffn_gate").T) * (h @ W(f"{p}.ffn_up").T)) @ W(f"{p}.ffn_down").T
        x = x + rms_norm(f, W(f"{p}.post_ffw_norm"), eps)
    return rms_norm(x, W("output_norm"), eps)


def normalize(v, how):
    if how == -1:
        return v
    if how == 0:
        return v / (np.abs(v).max() / 32760.0)
    p = float(how)
    return v / (np.abs(v) ** p).sum() ** (1.0 / p)


def option(cmd, name, default):
    words = cmd.split()
    return words[words.index(name) + 1] if name in words else default


def vectors(t, kv, ids, cmd):
    arch = kv["general.architecture"]
    pooling = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}.get(option(cmd, "--pooling", ""), kv[f"{arch}.pooling_type"])
    h = qwen3(t, kv, ids) if arch == "qwen3" else gemma_embedding(t, kv, ids) if arch == "gemma-embedding" \
        else bert_family(t, kv, arch, ids)
    if pooling == 0:
        rows = list(h)
    elif pooling == 1:
        rows = [h.mean(0)]
    elif pooling in (2, 3):
        rows = [h[0] if pooling == 2 else h[-1]]
    else:
        last = h[-1] if arch == "qwen3" else h[0]
        if "cls.weight" in t:
            last = np.tanh(last @ t["cls.weight"].T + t["cls.bias"])
        s = last @ t["cls.output.weight"].T + (t["cls.output.bias"] if "cls.output.bias" in t else 0)
        rows = [softmax(s) if arch == "qwen3" else s]
    if "dense_2.weight" in t and pooling != 0:
        rows = [r @ t["dense_2.weight"].T @ t["dense_3.weight"].T for r in rows]
    return [normalize(r, int(option(cmd, "--embd-normalize", "2"))) for r in rows]


def main():
    models = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny")
    goldens = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/golden/embeddings")
    worst_all = 0.0
    for path in sorted(goldens.glob("*-tiny*.llama.json")):
        g = json.loads(path.read_text(encoding="utf-8"))
        t, kv = load(models / g["model"])
        ours = [r for ids in g["ids"] for r in vectors(t, kv, ids, g["command"])]
        theirs = [np.array(v) for v in g["vectors"]]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
        cos = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, theirs))
        worst_all = max(worst_all, diff)
        print(f"{path.name}: {len(ours)} vectors, max |difference| {diff:.2e}, min cosine {cos:.7f}")
    print(f"worst {worst_all:.2e}")


if __name__ == "__main__":
    main()
