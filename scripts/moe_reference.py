#!/usr/bin/env python3
"""Independent NumPy reference forward pass (greedy decoding) for pinfer's tiny Qwen test models.

    python3 scripts/moe_reference.py MODEL.gguf PROMPTS.jsonl OUT.jsonl [options]

Architectures (chosen by general.architecture): qwen2moe, qwen3moe, and the dense qwen2 / qwen3 (same
code path without the MoE block, for cross-checking against llama.cpp's goldens).
Reads the GGUF with gguf-py's GGUFReader, dequantizes with gguf.quants.dequantize, and runs the forward
pass in float64 the way llama.cpp defines it:

  x = token_embd[id]; per layer:
    attention: RMSNorm * attn_norm; q, k, v = W x (+ bias for qwen2*); qwen3*: per-head RMSNorm *
      attn_q_norm / attn_k_norm; RoPE NeoX (pairs (i, i + n_rot/2), theta_i = p * base^(-2i/n_rot));
      causal GQA attention (head h uses KV head h // (H/HKV)), scale 1/sqrt(head_dim); attn_output;
      residual.
    FFN: RMSNorm * ffn_norm -> cur.
      dense: down(silu(gate cur) * up cur)
      MoE: probs = softmax(ffn_gate_inp cur); top-k by probability (ties to the lower index);
        weights = probs[top-k], renormalized to sum 1 for qwen3moe, not for qwen2moe;
        moe = sum_j weights_j * down_j(silu(gate_j cur) * up_j cur)
        qwen2moe shared expert: + sigmoid(ffn_gate_inp_shexp . cur) * down_sh(silu(gate_sh cur) * up_sh cur)
      residual.
  final RMSNorm * output_norm; logits = output (or the tied token_embd) @ x.

llama.cpp's arithmetic that the reference follows (each behind a flag, default on):
  --act-q8   activations multiplied by Q4_0 / Q5_0 / Q8_0 weights are first quantized to Q8_0, as
             ggml's CPU backend does (per 32-block: d = max|x|/127 stored as f16, q = round(x*127/max)
             to nearest even, as the AVX2 quantize_row_q8_0); F32 weights (router, shared-expert gate,
             norms, biases) see the float activations.
  --kv-f16   K and V are rounded to float16 when stored in the KV cache.
  --attn fa  attention as ggml's CPU flash attention with the F16 cache (llama.cpp's default, and the
             configuration of the llama.cpp goldens): Q rounded to F16 for Q.K, online softmax over
             the positions in order with the V accumulator kept in F16. --attn nofa: llama.cpp without
             flash attention (Q to F16, softmax, probabilities rounded to F16 for the product with V).
             --attn f64: exact softmax attention in float64.
Everything else is float64. Use --no-act-q8 / --no-kv-f16 / --attn f64 to switch off.

Greedy decoding: the prompt's ids are fed, then STEPS (default 24) argmax tokens are generated,
stopping early at the end-of-generation token (tokenizer.ggml.eos_token_id: not appended to
generated_ids, but its step has a margin).
Output: one JSON line per prompt with prompt, prompt_ids, generated_ids, margins (best minus second
best logit, every step) and top5 ([[id, logit], ...] of the first 8 steps), values rounded to 4
decimals, the format of tests/golden/*.greedy.jsonl.
PROMPTS.jsonl: lines with "prompt" and "prompt_ids" (e.g. tests/golden/qwen2-tiny.greedy.jsonl).

    --compare GOLDEN.jsonl   also compare the result with a golden of the same prompts and print, per
                             prompt, the generated ids that agree before the golden's first margin
                             < 0.05; and, replaying the golden's tokens (teacher forcing), the largest
                             difference of the golden's top5 logits and the steps whose argmax differs.
    --routing-check GAP      MoE: flip, one at a time, every expert choice whose router-logit gap
                             (last chosen minus runner-up) is below GAP and report the effect on the
                             logits: how fragile the result is to another implementation's rounding.
"""
import argparse
import json
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

# Weight types whose ggml CPU dot product runs against Q8_0-quantized activations.
Q8_DOT_TYPES = {QT.Q4_0, QT.Q5_0, QT.Q8_0}


def quant_q8_0(x):
    """Round-trip float activations through ggml's Q8_0 (x86 AVX2 quantize_row_q8_0): float32 in,
    per 32-block d = amax/127 (stored as f16), id = 127/amax, q = rint(x*id). Returns float64 d*q."""
    x32 = np.asarray(x, dtype=np.float32)
    shp = x32.shape
    assert shp[-1] % 32 == 0
    b = x32.reshape(-1, 32)
    amax = np.max(np.abs(b), axis=1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide='ignore'):
        idv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * idv).astype(np.float32)  # nearest, ties to even (_mm256_round_ps)
    d16 = d.astype(np.float16).astype(np.float64)
    return (d16 * q.astype(np.float64)).reshape(shp)


def f16(x):
    return np.asarray(x).astype(np.float16).astype(np.float64)


class Weight:
    """A weight matrix: dequantized values (float64) and how llama.cpp feeds it activations."""

    def __init__(self, t):
        self.qtype = t.tensor_type
        if self.qtype in (QT.F32, QT.F16):
            a = np.asarray(t.data)
        else:
            a = dequantize(t.data, self.qtype)
        self.shape = [int(n) for n in t.shape]   # ggml order: ne0 first
        self.w = np.asarray(a, dtype=np.float64).reshape(self.shape[::-1])

    def prep(self, x, act_q8):
        """The activation as the dot product sees it."""
        if act_q8 and self.qtype in Q8_DOT_TYPES:
            return quant_q8_0(x)
        if act_q8 and self.qtype == QT.F16:
            return f16(np.asarray(x, dtype=np.float32))
        if act_q8 and self.qtype != QT.F32:
            raise SystemExit(f'--act-q8: no activation rule for weight type {self.qtype.name}')
        return np.asarray(x, dtype=np.float64)


class Model:
    def __init__(self, path, act_q8=True, kv_f16=True, attn='fa'):
        r = gguf.GGUFReader(path)
        self.fields = r.fields
        self.arch = self.get('general.architecture')
        if self.arch not in ('qwen2', 'qwen3', 'qwen2moe', 'qwen3moe'):
            raise SystemExit(f'unsupported architecture {self.arch}')
        a = self.arch
        self.E = self.get(f'{a}.embedding_length')
        self.L = self.get(f'{a}.block_count')
        self.H = self.get(f'{a}.attention.head_count')
        self.HKV = self.get(f'{a}.attention.head_count_kv')
        self.eps = self.get(f'{a}.attention.layer_norm_rms_epsilon')
        self.base = self.get(f'{a}.rope.freq_base', 10000.0)
        self.hd = self.get(f'{a}.attention.key_length', self.E // self.H)
        self.n_rot = self.get(f'{a}.rope.dimension_count', self.hd)
        self.moe = a.endswith('moe')
        if self.moe:
            self.NE = self.get(f'{a}.expert_count')
            self.NU = self.get(f'{a}.expert_used_count')
        self.norm_w = (a == 'qwen3moe')          # qwen3moe renormalizes the top-k weights; qwen2moe not
        self.qk_norm = a in ('qwen3', 'qwen3moe')
        self.eos = self.get('tokenizer.ggml.eos_token_id', None)
        self.t = {t.name: t for t in r.tensors}
        self.act_q8, self.kv_f16, self.attn = act_q8, kv_f16, attn
        self.cache = {}
        self.flip = set()          # (position, layer) routing decisions to flip (--routing-check)

    def get(self, key, default=KeyError):
        if key not in self.fields:
            if default is KeyError:
                raise KeyError(key)
            return default
        v = self.fields[key].contents()
        return v

    def W(self, name):
        if name not in self.cache:
            self.cache[name] = Weight(self.t[name])
        return self.cache[name]

    def vec(self, name):
        return self.W(name).w.reshape(-1)

    def has(self, name):
        return name in self.t

    def mv(self, name, x):
        """y = W x for a 2-D weight [ne1 rows of ne0]."""
        w = self.W(name)
        return w.w @ w.prep(x, self.act_q8)

    def mv_expert(self, name, e, x):
        w = self.W(name)
        return w.w[e] @ w.prep(x, self.act_q8)

    def rms(self, x, wname):
        x = np.asarray(x, dtype=np.float64)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.vec(wname)

    def rms_w(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """NeoX RoPE on [heads, hd]: pairs (i, i + n_rot/2) for i < n_rot/2."""
        n = self.n_rot
        half = n // 2
        i = np.arange(half, dtype=np.float64)
        theta = pos * self.base ** (-2.0 * i / n)
        c, s = np.cos(theta), np.sin(theta)
        y = x.copy()
        x0, x1 = x[:, :half], x[:, half:n]
        y[:, :half] = x0 * c - x1 * s
        y[:, half:n] = x0 * s + x1 * c
        return y

    def reset(self):
        self.kc = [[] for _ in range(self.L)]
        self.vc = [[] for _ in range(self.L)]
        self.router_gaps = []      # (position, layer, gap) for every MoE routing decision

    def attention(self, il, cur, pos):
        p = f'blk.{il}.'
        H, HKV, hd = self.H, self.HKV, self.hd
        q = self.mv(p + 'attn_q.weight', cur)
        k = self.mv(p + 'attn_k.weight', cur)
        v = self.mv(p + 'attn_v.weight', cur)
        if self.has(p + 'attn_q.bias'):
            q = q + self.vec(p + 'attn_q.bias')
            k = k + self.vec(p + 'attn_k.bias')
            v = v + self.vec(p + 'attn_v.bias')
        q = q.reshape(H, hd)
        k = k.reshape(HKV, hd)
        v = v.reshape(HKV, hd)
        if self.qk_norm:
            q = self.rms_w(q, self.vec(p + 'attn_q_norm.weight'))
            k = self.rms_w(k, self.vec(p + 'attn_k_norm.weight'))
        q = self.rope(q, pos)
        k = self.rope(k, pos)
        if self.kv_f16:
            k, v = f16(k), f16(v)
        self.kc[il].append(k)
        self.vc[il].append(v)
        K = np.stack(self.kc[il])      # [T, HKV, hd]
        Vv = np.stack(self.vc[il])
        g = H // HKV
        out = np.empty((H, hd))
        scale = 1.0 / np.sqrt(hd)
        # ggml converts Q to the K cache's type (F16) for the Q.K dot products
        qd = f16(q) if (self.kv_f16 and self.attn != 'f64') else q
        for h in range(H):
            kh = h // g
            s = K[:, kh, :] @ qd[h] * scale
            if self.attn == 'fa' and self.kv_f16:
                out[h] = self.fa_f16(s, Vv[:, kh, :])
                continue
            s = np.exp(s - s.max())
            s /= s.sum()
            if self.attn == 'nofa' and self.kv_f16:
                s = f16(s)          # kq converted to F16 for the product with the F16 V cache
            out[h] = s @ Vv[:, kh, :]
        return self.mv(p + 'attn_output.weight', out.reshape(-1))

    @staticmethod
    def fa_f16(s, V):
        """ggml's CPU flash attention for one head with an F16 V cache: online softmax over the KV
        positions in order, the V accumulator kept in F16 (ggml_vec_scale_f16 / ggml_vec_mad_f16)."""
        M, S = -np.inf, 0.0
        acc = np.zeros(V.shape[1])
        for t in range(len(s)):
            st = float(np.float32(s[t]))
            ms, vs = 1.0, 1.0
            if st > M:
                ms = np.exp(M - st) if M != -np.inf else 0.0
                M = st
                acc = f16(acc * ms)
            else:
                vs = np.exp(st - M)
            acc = f16(acc + V[t] * vs)
            S = S * ms + vs
        return acc / S

    def ffn(self, il, cur):
        p = f'blk.{il}.'
        silu = lambda z: z / (1.0 + np.exp(-z))
        if not self.moe:
            h = silu(self.mv(p + 'ffn_gate.weight', cur)) * self.mv(p + 'ffn_up.weight', cur)
            return self.mv(p + 'ffn_down.weight', h)
        # router (F32 weights: float activations)
        logits = self.W(p + 'ffn_gate_inp.weight').w @ cur
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind='stable')
        sel = order[: self.NU]
        if (self.pos, il) in self.flip:     # diagnostics: take the runner-up expert instead of the last chosen
            sel = np.concatenate([order[: self.NU - 1], order[self.NU: self.NU + 1]])
        # how close the expert choice was: router logit gap between the last chosen and the next one
        self.router_gaps.append((self.pos, il, float(logits[order[self.NU - 1]] - logits[order[self.NU]])))
        wts = probs[sel]
        if self.norm_w:
            wts = wts / wts.sum()
        out = np.zeros(self.E)
        for e, we in zip(sel, wts):
            h = silu(self.mv_expert(p + 'ffn_gate_exps.weight', e, cur)) * \
                self.mv_expert(p + 'ffn_up_exps.weight', e, cur)
            out += we * self.mv_expert(p + 'ffn_down_exps.weight', e, h)
        if self.has(p + 'ffn_gate_inp_shexp.weight'):
            sh = silu(self.mv(p + 'ffn_gate_shexp.weight', cur)) * self.mv(p + 'ffn_up_shexp.weight', cur)
            sh = self.mv(p + 'ffn_down_shexp.weight', sh)
            gate = 1.0 / (1.0 + np.exp(-float(self.vec(p + 'ffn_gate_inp_shexp.weight') @ cur)))
            out += gate * sh
        return out

    def step(self, tok, pos):
        self.pos = pos
        x = self.W('token_embd.weight').w[tok].copy()
        for il in range(self.L):
            p = f'blk.{il}.'
            x = x + self.attention(il, self.rms(x, p + 'attn_norm.weight'), pos)
            x = x + self.ffn(il, self.rms(x, p + 'ffn_norm.weight'))
        x = self.rms(x, 'output_norm.weight')
        out = 'output.weight' if self.has('output.weight') else 'token_embd.weight'
        return self.mv(out, x)

    def greedy(self, ids, steps):
        self.reset()
        pos = 0
        for t in ids[:-1]:
            self.step(t, pos)
            pos += 1
        logits = self.step(ids[-1], pos)
        pos += 1
        gen, margins, top5 = [], [], []
        for i in range(steps):
            order = np.argsort(-logits, kind='stable')
            best = int(order[0])
            margins.append(round(float(logits[order[0]] - logits[order[1]]), 4))
            if i < 8:
                top5.append([[int(j), round(float(logits[j]), 4)] for j in order[:5]])
            if self.eos is not None and best == self.eos:
                break
            gen.append(best)
            if i + 1 == steps:
                break
            logits = self.step(best, pos)
            pos += 1
        return gen, margins, top5


def forced(m, g):
    """Logits at every golden step with the golden tokens fed (teacher forcing), so each step sees
    the golden's context even after a divergence."""
    m.reset()
    ids = g['prompt_ids']
    for pos, t in enumerate(ids):
        logits = m.step(t, pos)
    out = [logits]
    for t in g['generated_ids'][:-1]:
        pos += 1
        out.append(m.step(t, pos))
    return out


def compare(m, results, golden_path):
    """Free-running agreement and teacher-forced logit differences against a llama.cpp golden."""
    gold = [json.loads(l) for l in open(golden_path) if l.strip()]
    worst = 0.0
    for r, g in zip(results, gold):
        assert r['prompt_ids'] == g['prompt_ids'], 'prompts differ'
        near = next((i for i, v in enumerate(g['margins']) if v < 0.05), len(g['margins']))
        agree = 0
        for a, b in zip(r['generated_ids'][:near], g['generated_ids'][:near]):
            if a != b:
                break
            agree += 1
        fl = forced(m, g)
        d = 0.0
        per_step = []
        for i, pairs in enumerate(g['top5']):
            ds = max(abs(fl[i][j] - v) for j, v in pairs)
            per_step.append(round(float(ds), 3))
            d = max(d, ds)
        flips = [[i, g['margins'][i]] for i in range(min(near, len(fl)))
                 if int(np.argmax(fl[i])) != g['generated_ids'][i]]
        worst = max(worst, d)
        print(f'  {g["prompt"][:32]!r}: golden near-tie (<0.05) at step {near}; free-running agree '
              f'{agree}/{near} before it; forced: top5 |diff| max {d:.4f} per step {per_step}, '
              f'argmax flips [step, golden margin] {flips}')
    print(f'  largest top5 logit difference (forced): {worst:.4f}')
    return worst


def routing_check(m, results, max_gap):
    """Expert choices decided by a router-logit gap below max_gap could go the other way in another
    implementation's rounding. Flip each one (teacher-forced on the result) and report the effect."""
    print(f'routing decisions with a router gap < {max_gap} (flipped one at a time, teacher-forced):')
    for r in results:
        base = forced(m, r)
        n = len(r['prompt_ids'])
        ties = [(p, il, gap) for p, il, gap in m.router_gaps if gap < max_gap]
        for p, il, gap in ties:
            m.flip = {(p, il)}
            alt = forced(m, r)
            m.flip = set()
            first = max(0, p - n + 1)      # first step whose logits can change
            dmax = max(float(np.max(np.abs(alt[i] - base[i]))) for i in range(first, len(base)))
            t5 = [max(abs(float(alt[i][j] - base[i][j])) for j, _ in r['top5'][i])
                  for i in range(first, len(r['top5']))]
            t5 = max(t5) if t5 else 0.0
            changed = [[i, r['margins'][i]] for i in range(len(base))
                       if int(np.argmax(alt[i])) != r['generated_ids'][i]]
            where = f'prompt position {p}' if p < n - 1 else f'step {p - n + 1}'
            print(f'  {r["prompt"][:32]!r}: {where}, layer {il}, gap {gap:.4f}: max |logit change| '
                  f'{dmax:.4f}, of the top5 (first 8 steps) {t5:.4f}; argmax changes [step, margin] {changed}')


def spread(m, golden_path, name, out_path):
    """How far this configuration of the reference (e.g. --attn nofa, llama.cpp's flash-attention-off
    arithmetic) moves from the golden, teacher-forced: per prompt, the largest top-5 logit change of
    each of the first 8 steps and the steps whose argmax changes (with the golden's margin there),
    in the format of tests/golden/*.spread.jsonl (which golden.rs adds to its tolerances)."""
    gold = [json.loads(l) for l in open(golden_path) if l.strip()]
    with open(out_path, 'w') as f:
        for g in gold:
            fl = forced(m, g)
            per_step = [round(float(max(abs(fl[i][j] - v) for j, v in pairs)), 4)
                        for i, pairs in enumerate(g['top5'])]
            flips = [[i, g['margins'][i]] for i in range(len(fl))
                     if int(np.argmax(fl[i])) != g['generated_ids'][i]][:1]
            f.write(json.dumps({'prompt': g['prompt'], 'spread': per_step, 'flips': {name: flips}}) + '\n')
    print(f'wrote {out_path}')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('model')
    ap.add_argument('prompts')
    ap.add_argument('out')
    ap.add_argument('--steps', type=int, default=24)
    ap.add_argument('--act-q8', action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument('--kv-f16', action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument('--attn', choices=['fa', 'nofa', 'f64'], default='fa')
    ap.add_argument('--compare', metavar='GOLDEN.jsonl')
    ap.add_argument('--routing-check', metavar='GAP', type=float, default=None)
    ap.add_argument('--spread-of', metavar='GOLDEN.jsonl',
                    help='write OUT as a spread file: this configuration against GOLDEN, teacher-forced')
    args = ap.parse_args()
    m = Model(args.model, act_q8=args.act_q8, kv_f16=args.kv_f16, attn=args.attn)
    if args.spread_of:
        spread(m, args.spread_of, f'attn_{args.attn}', args.out)
        return
    results = []
    for line in open(args.prompts):
        if not line.strip():
            continue
        pr = json.loads(line)
        gen, margins, top5 = m.greedy(pr['prompt_ids'], args.steps)
        results.append({'prompt': pr['prompt'], 'prompt_ids': pr['prompt_ids'], 'generated_ids': gen,
                        'margins': margins, 'top5': top5})
    with open(args.out, 'w') as f:
        for r in results:
            f.write(json.dumps(r) + '\n')
    print(f'{args.model} ({m.arch}): wrote {len(results)} prompts to {args.out}')
    for r in results:
        small = [i for i, v in enumerate(r['margins']) if v < 0.05]
        print(f'  {r["prompt"][:40]!r}: min margin {min(r["margins"]):.4f}, steps with margin < 0.05: {small}')
    if args.compare:
        compare(m, results, args.compare)
    if args.routing_check is not None and m.moe:
        routing_check(m, results, args.routing_check)


if __name__ == '__main__':
    main()
