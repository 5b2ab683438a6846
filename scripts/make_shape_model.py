#!/usr/bin/env python3
"""Shape models: real architectures' shapes and vocabularies with random weights of realistic scale,
for speed and memory benchmarks at real sizes (scripts/scale_bench.sh). Every tensor gets its own
random values (never tiled: identical pages would distort resident-memory figures). Written as F16
(norms F32); quantize them with llama-quantize.

Usage: make_shape_model.py SHAPE VOCAB_GGUF OUT_GGUF [--seed N]
  SHAPE: llama-3.2-1b | llama-3.2-3b | qwen2.5-1.5b | qwen3-1.7b | gemma-3-1b | lfm2-1.2b | qwen3.5-0.8b
         | gemma-4-e2b | granite-3.3-2b | smollm3-3b | phi-3.5-mini | lfm2-8b-a1b
  VOCAB_GGUF: llama.cpp's models/ggml-vocab-*.gguf of that family (llama-bpe, qwen2, gemma-3 ...);
  llama.cpp ships no LFM2 vocabulary: lfm2-1.2b takes Falcon's byte-level BPE (65024 tokens) padded
  with control tokens to LFM2's 65536, under LFM2's pre-tokenizer name; qwen3.5-0.8b pads llama.cpp's
  qwen35 vocabulary (151936 tokens) to the model's 248320 the same way; gemma-4-e2b takes llama.cpp's
  gemma-4 vocabulary as it is; granite-3.3-2b pads StarCoder's 49152 tokens to Granite's 49159;
  smollm3-3b takes llama-bpe, phi-3.5-mini phi-3 as they are, lfm2-8b-a1b Falcon's padded as lfm2-1.2b.
  (Granite, SmolLM3 and Phi ship no 1B: their smallest dense models are these.)

The weight scales follow trained models of this size: matrices N(0, 0.02) (outputs of attention and
FFN smaller), the embedding N(0, 0.02), norms around 1. The text they generate is noise, but every
byte read per token, every shape and the vocabulary are the real model's."""
import argparse
import numpy as np
import gguf

# name: (arch, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx_train, rope_base, tied, extra)
SHAPES = {
    'llama-3.2-1b': ('llama', 2048, 16, 32, 8, 64, 8192, 131072, 500000.0, True, {}),
    'llama-3.2-3b': ('llama', 3072, 28, 24, 8, 128, 8192, 131072, 500000.0, True, {}),
    'qwen2.5-1.5b': ('qwen2', 1536, 28, 12, 2, 128, 8960, 32768, 1000000.0, True, {'qkv_bias': True}),
    'qwen3-1.7b': ('qwen3', 2048, 28, 16, 8, 128, 6144, 40960, 1000000.0, True, {'qk_norm': True}),
    'gemma-3-1b': ('gemma3', 1152, 26, 4, 1, 256, 6912, 32768, 1000000.0, True, {'gemma': True}),
    # LiquidAI/LFM2-1.2B: 10 short-convolution layers (3 taps) and 6 attention layers.
    'lfm2-1.2b': ('lfm2', 2048, 16, 32, 8, 64, 8192, 128000, 1000000.0, True,
                  {'qk_norm': True, 'conv_layers': (0, 1, 3, 4, 6, 7, 9, 11, 13, 15), 'vocab': 65536,
                   'pre': 'lfm2'}),
    # Qwen/Qwen3.5-0.8B: 18 gated-delta-rule layers (16 key and 16 value heads of 128) and 6
    # gated-attention layers (8 heads of 256, 2 KV heads, a quarter of each head rotated).
    'qwen3.5-0.8b': ('qwen35', 1024, 24, 8, 2, 256, 3584, 262144, 10000000.0, True,
                     {'qk_norm': True, 'delta': (128, 16, 16), 'n_rot': 64, 'vocab': 248320}),
    # google/gemma-4-E2B: 35 layers, four sliding-window layers (heads of 256) then one full
    # (heads of 512, a quarter rotated through frequency factors), the last 20 layers reading the
    # caches of layers 13 and 14 with a twice as wide FFN, 256 per-layer embedding values per
    # layer and token.
    'gemma-4-e2b': ('gemma4', 1536, 35, 8, 1, 512, 6144, 131072, 1000000.0, True,
                    {'gemma4': dict(hd_swa=256, shared=20, ple=256, period=5)}),
    # ibm-granite/granite-3.3-2b-instruct: embedding x12, attention scale 1/64, residual x0.22,
    # logits / 8.
    'granite-3.3-2b': ('granite', 2048, 40, 32, 8, 64, 8192, 131072, 10000000.0, True,
                       {'granite': (12.0, 0.015625, 0.22, 8.0), 'vocab': 49159}),
    # HuggingFaceTB/SmolLM3-3B: every 4th layer without RoPE (the architecture's rule).
    'smollm3-3b': ('smollm3', 2048, 36, 16, 4, 128, 11008, 65536, 5000000.0, True, {}),
    # microsoft/Phi-3.5-mini-instruct: fused QKV and gate|up, an untied output, LongRoPE (48 long and
    # short factors per head, original context 4096).
    'phi-3.5-mini': ('phi3', 3072, 32, 32, 32, 96, 8192, 131072, 10000.0, False,
                     {'fused': True, 'longrope': (4096, 1.1902380714238083)}),
    # LiquidAI/LFM2-8B-A1B: 18 short-convolution and 6 attention layers, the first 2 dense (7168),
    # the others 32 experts of 1792 with 4 used, sigmoid routing with a selection bias.
    'lfm2-8b-a1b': ('lfm2moe', 2048, 24, 32, 8, 64, 7168, 128000, 1000000.0, True,
                    {'qk_norm': True, 'conv_layers': tuple(i for i in range(24) if i not in (2, 6, 10, 14, 18, 21)),
                     'vocab': 65536, 'pre': 'lfm2', 'moe': (32, 4, 1792, 2)}),
}


def write_gemma4(w, rng, V, E, L, H, HKV, HD, F, g4, mat, vec):
    """Gemma 4's keys and tensors (see the 'gemma-4-e2b' row)."""
    hd_swa, shared, P, period = g4['hd_swa'], g4['shared'], g4['ple'], g4['period']
    swa = [i % period != period - 1 for i in range(L)]
    n_ff = [F if i < L - shared else 2 * F for i in range(L)]
    w.add_array('gemma4.feed_forward_length', n_ff)
    w.add_uint32('gemma4.attention.key_length_swa', hd_swa)
    w.add_uint32('gemma4.attention.value_length_swa', hd_swa)
    w.add_rope_dimension_count(HD)
    w.add_uint32('gemma4.rope.dimension_count_swa', hd_swa)
    w.add_float32('gemma4.rope.freq_base_swa', 10000.0)
    w.add_sliding_window(512)
    w.add_array('gemma4.attention.sliding_window_pattern', swa)
    w.add_uint32('gemma4.attention.shared_kv_layers', shared)
    w.add_uint32('gemma4.embedding_length_per_layer_input', P)
    w.add_float32('gemma4.final_logit_softcapping', 30.0)
    # A quarter of each full head's pairs rotate; the rest are held still by huge divisors.
    rot = HD // 8
    w.add_tensor('rope_freqs.weight', np.concatenate([np.ones(rot), np.full(HD // 2 - rot, 1e30)]).astype(np.float32))
    # The per-layer table is the model's largest tensor (V x L*P): filled in row chunks.
    table = np.empty((V, L * P), dtype=np.float16)
    for r in range(0, V, 8192):
        n = min(8192, V - r)
        table[r:r + n] = rng.standard_normal(size=(n, L * P), dtype=np.float32) * 0.02
    w.add_tensor('per_layer_token_embd.weight', table)
    mat('per_layer_model_proj.weight', L * P, E, 0.02)
    vec('per_layer_proj_norm.weight', P, 1.0, 0.05)
    for i in range(L):
        p = f'blk.{i}.'
        d = hd_swa if swa[i] else HD
        vec(p + 'attn_norm.weight', E, 1.0, 0.05)
        mat(p + 'attn_q.weight', H * d, E, 0.02)
        vec(p + 'attn_q_norm.weight', d, 1.0, 0.05)
        if i < L - shared:
            mat(p + 'attn_k.weight', HKV * d, E, 0.02)
            mat(p + 'attn_v.weight', HKV * d, E, 0.02)
            vec(p + 'attn_k_norm.weight', d, 1.0, 0.05)
        mat(p + 'attn_output.weight', E, H * d, 0.02 / np.sqrt(2 * L))
        vec(p + 'post_attention_norm.weight', E, 1.0, 0.05)
        vec(p + 'ffn_norm.weight', E, 1.0, 0.05)
        mat(p + 'ffn_gate.weight', n_ff[i], E, 0.02)
        mat(p + 'ffn_up.weight', n_ff[i], E, 0.02)
        mat(p + 'ffn_down.weight', E, n_ff[i], 0.02 / np.sqrt(2 * L))
        vec(p + 'post_ffw_norm.weight', E, 1.0, 0.05)
        mat(p + 'inp_gate.weight', P, E, 0.02)
        mat(p + 'proj.weight', E, P, 0.02)
        vec(p + 'post_norm.weight', E, 1.0, 0.05)
        vec(p + 'layer_output_scale.weight', 1, 0.5, 0.1)


def copy_vocab(w, path, pad_to=None, pre=None):
    r = gguf.GGUFReader(path)
    f = r.fields
    w.add_tokenizer_model(f['tokenizer.ggml.model'].contents())
    if pre or 'tokenizer.ggml.pre' in f:
        w.add_tokenizer_pre(pre or f['tokenizer.ggml.pre'].contents())
    toks = list(f['tokenizer.ggml.tokens'].contents())
    types = list(f['tokenizer.ggml.token_type'].contents()) if 'tokenizer.ggml.token_type' in f else None
    if pad_to and len(toks) < pad_to:
        # Control tokens up to the model's vocabulary size (never produced by the tokenizer).
        extra = pad_to - len(toks)
        toks += [f'<|pad_{i}|>' for i in range(extra)]
        types = (types or [1] * (pad_to - extra)) + [3] * extra
    w.add_token_list(toks)
    if types is not None:
        w.add_token_types(types)
    if 'tokenizer.ggml.scores' in f:
        w.add_token_scores(f['tokenizer.ggml.scores'].contents())
    if 'tokenizer.ggml.merges' in f:
        w.add_token_merges(f['tokenizer.ggml.merges'].contents())
    for key, add in [('tokenizer.ggml.bos_token_id', w.add_bos_token_id),
                     ('tokenizer.ggml.eos_token_id', w.add_eos_token_id),
                     ('tokenizer.ggml.padding_token_id', w.add_pad_token_id),
                     ('tokenizer.ggml.add_bos_token', w.add_add_bos_token)]:
        if key in f:
            add(f[key].contents())
    return len(toks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('shape', choices=sorted(SHAPES))
    ap.add_argument('vocab')
    ap.add_argument('out')
    ap.add_argument('--seed', type=int, default=1)
    a = ap.parse_args()
    arch, E, L, H, HKV, HD, F, CTX, BASE, tied, extra = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    # (Tensors spool to a temporary file as they are made: an 8B model never sits in memory.)
    w = gguf.GGUFWriter(a.out, arch, use_temp_file=True)
    w.add_name(f'shape-{a.shape}')
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(E)
    if 'gemma4' not in extra:
        w.add_feed_forward_length(F)
    w.add_head_count(H)
    conv = extra.get('conv_layers', ())
    w.add_head_count_kv([0 if i in conv else HKV for i in range(L)] if conv else HKV)
    if conv:
        w.add_shortconv_l_cache(3)
    moe = extra.get('moe')
    delta = extra.get('delta')
    if delta:
        dk, nk, nv = delta
        w.add_full_attention_interval(4)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(nv * dk)
        w.add_rope_dimension_count(extra['n_rot'])
        w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(BASE)
    w.add_layer_norm_rms_eps(1e-6 if arch not in ('llama', 'lfm2', 'lfm2moe', 'phi3', 'granite') else 1e-5)
    if arch == 'llama':
        w.add_rope_dimension_count(HD)
    if extra.get('gemma'):
        w.add_sliding_window(512)
    if 'granite' in extra:
        emb, att, res, logit = extra['granite']
        w.add_embedding_scale(emb)
        w.add_float32(f'{arch}.attention.scale', att)
        w.add_residual_scale(res)
        w.add_logit_scale(logit)
    if 'longrope' in extra:
        orig, attn_factor = extra['longrope']
        w.add_rope_dimension_count(HD)
        w.add_uint32(f'{arch}.rope.scaling.original_context_length', orig)
        w.add_float32(f'{arch}.rope.scaling.attn_factor', attn_factor)
        # (Phi-3.5's factors: the short ones near 1, the long ones growing from 1 to about 60.)
        w.add_tensor('rope_factors_short.weight', (1.0 + 0.1 * rng.random(HD // 2)).astype(np.float32))
        w.add_tensor('rope_factors_long.weight', np.geomspace(1.0, 60.0, HD // 2).astype(np.float32))
    if moe:
        n_exp, n_used, ff_exp, lead = moe
        w.add_expert_count(n_exp)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(ff_exp)
        w.add_leading_dense_block_count(lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
    V = copy_vocab(w, a.vocab, extra.get('vocab'), extra.get('pre'))
    if arch == 'llama':
        w.add_vocab_size(V)

    def mat(name, rows, cols, scale):
        x = rng.standard_normal(size=(rows, cols), dtype=np.float32) * scale
        w.add_tensor(name, x.astype(np.float16))

    def vec(name, n, mean, scale):
        w.add_tensor(name, (mean + rng.standard_normal(size=n, dtype=np.float32) * scale).astype(np.float32))

    def ffn(p):
        if moe and int(p.split('.')[1]) >= moe[3]:
            n_exp, _, ff_exp, _ = moe
            mat(p + 'ffn_gate_inp.weight', n_exp, E, 0.02)
            vec(p + 'exp_probs_b.bias', n_exp, 0.0, 0.1)
            for name, rows, cols, scale in (('ffn_gate_exps', ff_exp, E, 0.02), ('ffn_up_exps', ff_exp, E, 0.02),
                                            ('ffn_down_exps', E, ff_exp, 0.02 / np.sqrt(2 * L))):
                x = rng.standard_normal(size=(n_exp, rows, cols), dtype=np.float32) * scale
                w.add_tensor(p + name + '.weight', x.astype(np.float16))
            return
        if extra.get('fused'):
            mat(p + 'ffn_up.weight', 2 * F, E, 0.02)  # gate rows, then up rows
        else:
            mat(p + 'ffn_gate.weight', F, E, 0.02)
            mat(p + 'ffn_up.weight', F, E, 0.02)
        mat(p + 'ffn_down.weight', E, F, 0.02 / np.sqrt(2 * L))

    mat('token_embd.weight', V, E, 0.02)
    if 'gemma4' in extra:
        write_gemma4(w, rng, V, E, L, H, HKV, HD, F, extra['gemma4'], mat, vec)
        L = 0  # (its layers are written)
    for i in range(L):
        p = f'blk.{i}.'
        vec(p + 'attn_norm.weight', E, 1.0, 0.05)
        if delta and (i + 1) % 4 != 0:
            # Q, K, V in one matrix, the output gate, 4 taps per channel (f32), the decay's bias
            # and -exp(A), the strength and decay projections, the gated norm, the output.
            ch = (2 * nk + nv) * dk
            mat(p + 'attn_qkv.weight', ch, E, 0.02)
            mat(p + 'attn_gate.weight', nv * dk, E, 0.02)
            w.add_tensor(p + 'ssm_conv1d.weight',
                         (rng.standard_normal(size=(ch, 4), dtype=np.float32) * 0.3).astype(np.float32))
            vec(p + 'ssm_dt.bias', nv, 0.0, 0.5)
            w.add_tensor(p + 'ssm_a', (-np.exp(rng.standard_normal(size=nv, dtype=np.float32))).astype(np.float32))
            mat(p + 'ssm_beta.weight', nv, E, 0.02)
            mat(p + 'ssm_alpha.weight', nv, E, 0.02)
            vec(p + 'ssm_norm.weight', dk, 1.0, 0.05)
            mat(p + 'ssm_out.weight', E, nv * dk, 0.02 / np.sqrt(2 * L))
            vec(p + 'post_attention_norm.weight', E, 1.0, 0.05)
            mat(p + 'ffn_gate.weight', F, E, 0.02)
            mat(p + 'ffn_up.weight', F, E, 0.02)
            mat(p + 'ffn_down.weight', E, F, 0.02 / np.sqrt(2 * L))
            continue
        if i in conv:
            # B, C and X projections in one matrix, 3 taps per channel (kept f32), the output.
            mat(p + 'shortconv.in_proj.weight', 3 * E, E, 0.02)
            w.add_tensor(p + 'shortconv.conv.weight',
                         (rng.standard_normal(size=(E, 3), dtype=np.float32) * 0.3).astype(np.float32))
            mat(p + 'shortconv.out_proj.weight', E, E, 0.02 / np.sqrt(2 * L))
            vec(p + 'ffn_norm.weight', E, 1.0, 0.05)
            ffn(p)
            continue
        if extra.get('fused'):
            mat(p + 'attn_qkv.weight', (H + 2 * HKV) * HD, E, 0.02)
        else:
            mat(p + 'attn_q.weight', H * HD * (2 if delta else 1), E, 0.02)
            mat(p + 'attn_k.weight', HKV * HD, E, 0.02)
            mat(p + 'attn_v.weight', HKV * HD, E, 0.02)
        mat(p + 'attn_output.weight', E, H * HD, 0.02 / np.sqrt(2 * L))
        if extra.get('qkv_bias'):
            vec(p + 'attn_q.bias', H * HD, 0.0, 0.02)
            vec(p + 'attn_k.bias', HKV * HD, 0.0, 0.02)
            vec(p + 'attn_v.bias', HKV * HD, 0.0, 0.02)
        if extra.get('qk_norm') or extra.get('gemma'):
            vec(p + 'attn_q_norm.weight', HD, 1.0, 0.05)
            vec(p + 'attn_k_norm.weight', HD, 1.0, 0.05)
        if extra.get('gemma'):
            vec(p + 'post_attention_norm.weight', E, 1.0, 0.05)
            vec(p + 'post_ffw_norm.weight', E, 1.0, 0.05)
        vec(p + ('post_attention_norm.weight' if delta else 'ffn_norm.weight'), E, 1.0, 0.05)
        ffn(p)
    vec('token_embd_norm.weight' if arch.startswith('lfm2') else 'output_norm.weight', E, 1.0, 0.05)
    if not tied:
        mat('output.weight', V, E, 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == '__main__':
    main()
