#!/usr/bin/env python3
"""Tiny random-weight vision-language model pairs (text GGUF + mmproj GGUF) in the layout llama.cpp's
libmtmd loads (tools/mtmd/clip.cpp, clip-impl.h tensor and key names), for the goldens in
tests/golden/vision (scripts/mtmd_goldens.sh runs llama.cpp on them).

  python3 scripts/make_tiny_vlm.py --family gemma3|idefics3|qwen2vl|qwen2.5vl|lfm2 --seed N --out DIR
                                   [--vocab GGUF] [--type f16|q8_0] [--shape NAME]

writes DIR/model.gguf (text model of the family's language architecture; every tokenizer.* key copied
from --vocab, extra special tokens appended where the family's image markers are missing from it) and
DIR/mmproj.gguf (general.architecture "clip"). Default vocabularies: gemma3 takes
models/gemma-3-270m-q4_k_m.gguf (which carries no chat template: a Gemma 3 style one is written), the
others models/SmolLM2-135M-Instruct.Q8_0.gguf.

Weights come from a splitmix64 counter stream of the seed (no numpy generator: the same bytes on every
numpy), uniform in [-scale, scale); norms are 1 + noise. Norms, biases and position embeddings are F32;
matrices F16, or Q8_0 with --type q8_0 (rows whose length is not a multiple of 32 stay F16; the
patch-embedding convolution is always F16, as ggml's im2col wants). Needs gguf==0.19.0 and numpy.
Prints each file's SHA-256.

| family | text arch | vision (mmproj) | image tokens (llama.cpp 0c1e570) |
|---|---|---|---|
| gemma3 | gemma3: 2 layers, E 64, FF 128, 4 heads / 2 KV of 16, SWA 512, vocab 262144 (Gemma 3) | projector gemma3: 112 px, patch 14 (8x8), E 48, FF 96, 3 heads, 2 layers, avg-pool scale_factor 2 | 16 (image fitted into 112x112, black padding) |
| idefics3 | llama: 2 layers, E 64, FF 128, 4/2 heads of 16, SmolLM2 vocab + 40 idefics3 tokens | idefics3: 64 px tiles, patch 8 (8x8), E 48, pixel shuffle 2, preproc_image_size 128 | 16 per tile: 2x2 (or 2x1) tiles + overview |
| qwen2vl | qwen2vl: as idefics3's plus Q/K/V biases, M-RoPE sections 2,3,3,0, SmolLM2 vocab + 3 tokens | qwen2vl_merger: patch 14, E 32, FF 80, 2 heads, LayerNorm, GELU, merge 2, MLP 128 -> 96 -> 64 | dynamic (8..4096) |
| qwen2.5vl | qwen2vl (same) | qwen2.5vl_merger: as qwen2vl's with RMSNorm, SiLU-gated FFN, window attention (n_wa_pattern 2, window_size 56) | dynamic |
| lfm2 | lfm2: 3 layers (shortconv L 3, attention, shortconv), E 64, SmolLM2 vocab + 104 tokens | lfm2: patch 16, E 48, pixel unshuffle 2, input LayerNorm, MLP 192 -> 80 -> 64 (image_size 64 is only the position-embedding grid: clip tiles at 512 and wants 64..256 tokens) | dynamic, tiled at 512 |

--shape gives the vision tower a released model's sizes (for speed, scripts/vision_bench.sh), its
matrices scaled as trained ones are (uniform, standard deviation 0.03), the text model staying tiny:
siglip-so400m (gemma3: Gemma 3's SigLIP-So400m, 896 px, patch 14, E 1152, FF 4304, 27 layers, 16
heads, 256 tokens) and smolvlm-256m (idefics3: SmolVLM-256M's SigLIP-B/16, 512 px, patch 16, E 768,
FF 3072, 12 layers, 12 heads, pixel shuffle 4, 64 tokens per tile).

Image mean/std differ per channel (gemma3/idefics3 0.5,0.45,0.4 / 0.5,0.55,0.6; qwen CLIP's; lfm2 0.5),
so a channel-order slip shows.
"""
import argparse
import hashlib
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parent.parent

# A Gemma 3 style chat template (system text folded into the first user turn, "model" for the
# assistant role), written for these tiny models: the 270M GGUF the vocabulary comes from has none.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# A Qwen2-VL style ChatML template (the image marker is passed through in the content).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# SmolVLM's turn format ("User:" / "Assistant:" after <|im_start|>, <end_of_utterance> closing a turn).
IDEFICS3_TEMPLATE = (
    "<|im_start|>"
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}{{ ': ' }}{{ message['content'] | trim }}<end_of_utterance>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)


class Stream:
    """splitmix64 outputs as uniforms in [-1, 1): value i is a pure function of (seed, i), in uint64
    arithmetic numpy does identically everywhere."""

    def __init__(self, seed):
        self.seed = np.uint64(seed)
        self.at = 0

    def uniform(self, n):
        with np.errstate(over="ignore"):
            z = self.seed + np.arange(self.at + 1, self.at + n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        self.at += n
        return (z >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0


class Writer:
    """A GGUF being written. Shapes are given in ggml order (ne0 first)."""

    def __init__(self, path, arch, rng, qtype, matrix_scale=None):
        self.w = gguf.GGUFWriter(path, arch)
        self.rng = rng
        self.qtype = qtype
        self.matrix_scale = matrix_scale

    def tensor(self, name, ne, scale, kind=None):
        if self.matrix_scale is not None and len(ne) > 1 and "position_embd" not in name:
            scale = self.matrix_scale
        a = (self.rng.uniform(int(np.prod(ne))) * scale).astype(np.float32).reshape(ne[::-1])
        if kind is None:
            kind = QT.F32 if len(ne) == 1 else self.qtype
        if kind == QT.Q8_0 and ne[0] % 32 != 0:
            kind = QT.F16
        if kind == QT.F32:
            self.w.add_tensor(name, a)
        elif kind == QT.F16:
            self.w.add_tensor(name, a.astype(np.float16))
        else:
            d = gguf.quants.quantize(a, kind)
            self.w.add_tensor(name, d, raw_shape=d.shape, raw_dtype=kind)

    def norm(self, name, n, bias=False):
        self.w.add_tensor(f"{name}.weight", (1.0 + 0.1 * self.rng.uniform(n)).astype(np.float32))
        if bias:
            self.tensor(f"{name}.bias", [n], 0.05)

    def finish(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


# ---------------------------------------------------------------------------------------------------
# vocabularies

def copy_tokenizer(w, reader, extra=(), skip=(), template=None):
    """Every tokenizer.* key of `reader` but those in `skip`; `extra` tokens (control, score 0) are
    appended to tokens/scores/token_type. A template replaces the vocabulary's chat template (or is
    added when it has none). Returns the vocabulary size."""
    fields = reader.fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    have = set(tokens)
    new = [t for t in extra if t not in have]
    for name, field in fields.items():
        if not name.startswith("tokenizer.") or name in skip:
            continue
        if name.startswith("tokenizer.chat_template") and template is not None:
            continue
        if name == "tokenizer.ggml.tokens":
            w.add_token_list(tokens + new)
        elif name == "tokenizer.ggml.scores":
            w.add_token_scores(list(field.contents()) + [0.0] * len(new))
        elif name == "tokenizer.ggml.token_type":
            w.add_token_types(list(field.contents()) + [int(gguf.TokenType.CONTROL)] * len(new))
        else:
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    if template is not None:
        w.add_chat_template(template)
    return len(tokens) + len(new)


# ---------------------------------------------------------------------------------------------------
# text models

def text_common(w, L, E, F, H, HKV, hd, n_ctx, rope_base, eps):
    w.add_block_count(L)
    w.add_context_length(n_ctx)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)  # an int, or a per-layer list (lfm2)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)


def text_gemma3(m, V, T):
    L, E, F, H, HKV, hd = T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"]
    m.tensor("token_embd.weight", [E, V], 0.05, QT.F16)
    m.norm("output_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        m.norm(f"{p}.attn_norm", E)
        m.tensor(f"{p}.attn_q.weight", [E, H * hd], 0.2)
        m.tensor(f"{p}.attn_k.weight", [E, HKV * hd], 0.2)
        m.tensor(f"{p}.attn_v.weight", [E, HKV * hd], 0.2)
        m.tensor(f"{p}.attn_output.weight", [H * hd, E], 0.15)
        m.norm(f"{p}.post_attention_norm", E)
        m.norm(f"{p}.attn_q_norm", hd)
        m.norm(f"{p}.attn_k_norm", hd)
        m.norm(f"{p}.ffn_norm", E)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.1)
        m.norm(f"{p}.post_ffw_norm", E)


def text_llama(m, V, T, qkv_bias=False):
    L, E, F, H, HKV, hd = T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"]
    m.tensor("token_embd.weight", [E, V], 0.05, QT.F16)
    m.norm("output_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        m.norm(f"{p}.attn_norm", E)
        m.tensor(f"{p}.attn_q.weight", [E, H * hd], 0.2)
        m.tensor(f"{p}.attn_k.weight", [E, HKV * hd], 0.2)
        m.tensor(f"{p}.attn_v.weight", [E, HKV * hd], 0.2)
        if qkv_bias:
            m.tensor(f"{p}.attn_q.bias", [H * hd], 0.05)
            m.tensor(f"{p}.attn_k.bias", [HKV * hd], 0.05)
            m.tensor(f"{p}.attn_v.bias", [HKV * hd], 0.05)
        m.tensor(f"{p}.attn_output.weight", [H * hd, E], 0.15)
        m.norm(f"{p}.ffn_norm", E)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.1)


def text_lfm2(m, V, T):
    L, E, F, H, HKV, hd, K = T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"], T["conv_L"]
    m.tensor("token_embd.weight", [E, V], 0.05, QT.F16)
    m.norm("token_embd_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        m.norm(f"{p}.attn_norm", E)
        if T["kv"][i]:
            m.tensor(f"{p}.attn_q.weight", [E, H * hd], 0.2)
            m.tensor(f"{p}.attn_k.weight", [E, HKV * hd], 0.2)
            m.tensor(f"{p}.attn_v.weight", [E, HKV * hd], 0.2)
            m.tensor(f"{p}.attn_output.weight", [H * hd, E], 0.15)
            m.norm(f"{p}.attn_q_norm", hd)
            m.norm(f"{p}.attn_k_norm", hd)
        else:
            m.tensor(f"{p}.shortconv.conv.weight", [K, E], 0.3, QT.F32)
            m.tensor(f"{p}.shortconv.in_proj.weight", [E, 3 * E], 0.2)
            m.tensor(f"{p}.shortconv.out_proj.weight", [E, E], 0.15)
        m.norm(f"{p}.ffn_norm", E)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.1)


# ---------------------------------------------------------------------------------------------------
# vision towers

def clip_common(w, proj_type, P):
    w.add_string("clip.projector_type", proj_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", False)
    if P.get("gelu"):
        w.add_bool("clip.use_gelu", True)
    if P.get("silu"):
        w.add_bool("clip.use_silu", True)
    w.add_uint32("clip.vision.image_size", P["image"])
    w.add_uint32("clip.vision.patch_size", P["patch"])
    w.add_uint32("clip.vision.embedding_length", P["E"])
    w.add_uint32("clip.vision.feed_forward_length", P["F"])
    w.add_uint32("clip.vision.block_count", P["L"])
    w.add_uint32("clip.vision.attention.head_count", P["H"])
    w.add_uint32("clip.vision.projection_dim", P["proj"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", P["eps"])
    w.add_array("clip.vision.image_mean", P["mean"])
    w.add_array("clip.vision.image_std", P["std"])


def vit_blocks(m, P, norm_bias=True, gated=False):
    E, F = P["E"], P["F"]
    for i in range(P["L"]):
        p = f"v.blk.{i}"
        m.norm(f"{p}.ln1", E, bias=norm_bias)
        for t in ("attn_q", "attn_k", "attn_v"):
            m.tensor(f"{p}.{t}.weight", [E, E], 0.2)
            m.tensor(f"{p}.{t}.bias", [E], 0.05)
        m.tensor(f"{p}.attn_out.weight", [E, E], 0.15)
        m.tensor(f"{p}.attn_out.bias", [E], 0.05)
        m.norm(f"{p}.ln2", E, bias=norm_bias)
        if gated:
            m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.15)
            m.tensor(f"{p}.ffn_gate.bias", [F], 0.05)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.15)
        m.tensor(f"{p}.ffn_up.bias", [F], 0.05)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.1)
        m.tensor(f"{p}.ffn_down.bias", [E], 0.05)


def siglip_stem(m, P, n_pos):
    E, p = P["E"], P["patch"]
    m.tensor("v.patch_embd.weight", [p, p, 3, E], 0.1, QT.F16)
    m.tensor("v.patch_embd.bias", [E], 0.05)
    m.tensor("v.position_embd.weight", [E, n_pos], 0.2, QT.F32)


def vision_gemma3(m, P):
    E = P["E"]
    clip_common(m.w, "gemma3", P)
    m.w.add_uint32("clip.vision.projector.scale_factor", P["merge"])
    siglip_stem(m, P, (P["image"] // P["patch"]) ** 2)
    vit_blocks(m, P)
    m.norm("v.post_ln", E, bias=True)
    m.norm("mm.soft_emb_norm", E)
    m.tensor("mm.input_projection.weight", [P["proj"], E], 0.2)


def vision_idefics3(m, P):
    E = P["E"]
    clip_common(m.w, "idefics3", P)
    m.w.add_uint32("clip.vision.projector.scale_factor", P["merge"])
    m.w.add_uint32("clip.vision.preproc_image_size", P["longest_edge"])
    siglip_stem(m, P, (P["image"] // P["patch"]) ** 2)
    vit_blocks(m, P)
    m.norm("v.post_ln", E, bias=True)
    m.tensor("mm.model.fc.weight", [E * P["merge"] ** 2, P["proj"]], 0.1)


def vision_lfm2(m, P):
    E = P["E"]
    clip_common(m.w, "lfm2", P)
    m.w.add_uint32("clip.vision.projector.scale_factor", P["merge"])
    siglip_stem(m, P, (P["image"] // P["patch"]) ** 2)
    vit_blocks(m, P)
    m.norm("v.post_ln", E, bias=True)
    Ein = E * P["merge"] ** 2
    m.norm("mm.input_norm", Ein, bias=True)
    m.tensor("mm.1.weight", [Ein, P["mm_hidden"]], 0.1)
    m.tensor("mm.1.bias", [P["mm_hidden"]], 0.05)
    m.tensor("mm.2.weight", [P["mm_hidden"], P["proj"]], 0.1)
    m.tensor("mm.2.bias", [P["proj"]], 0.05)


def vision_qwen2vl(m, P, v25):
    E, p = P["E"], P["patch"]
    clip_common(m.w, "qwen2.5vl_merger" if v25 else "qwen2vl_merger", P)
    if v25:
        m.w.add_uint32("clip.vision.n_wa_pattern", P["wa_pattern"])
        m.w.add_uint32("clip.vision.window_size", P["window"])
    m.tensor("v.patch_embd.weight", [p, p, 3, E], 0.1, QT.F16)
    m.tensor("v.patch_embd.weight.1", [p, p, 3, E], 0.1, QT.F16)
    vit_blocks(m, P, norm_bias=not v25, gated=v25)
    m.norm("v.post_ln", E, bias=not v25)
    m.tensor("mm.0.weight", [4 * E, P["mm_hidden"]], 0.1)
    m.tensor("mm.0.bias", [P["mm_hidden"]], 0.05)
    m.tensor("mm.2.weight", [P["mm_hidden"], P["proj"]], 0.1)
    m.tensor("mm.2.bias", [P["proj"]], 0.05)


# ---------------------------------------------------------------------------------------------------
# families

TEXT = dict(L=2, E=64, F=128, H=4, HKV=2, hd=16)
MEAN = [0.48145466, 0.4578275, 0.40821073]   # distinct per channel, so channel order matters
STD = [0.26862954, 0.26130258, 0.27577711]


SHAPES = {
    "siglip-so400m": ("gemma3", dict(image=896, patch=14, E=1152, F=4304, L=27, H=16, merge=4)),
    "smolvlm-256m": ("idefics3", dict(image=512, patch=16, E=768, F=3072, L=12, H=12, merge=4, longest_edge=512)),
}
# Uniform in [-a, a) has standard deviation a / sqrt(3): 0.052 gives 0.03.
SHAPE_MATRIX_SCALE = 0.052


def family_params(family):
    if family == "gemma3":
        P = dict(image=112, patch=14, E=48, F=96, L=2, H=3, merge=2, eps=1e-6, gelu=True,
                 mean=[0.5, 0.45, 0.4], std=[0.5, 0.55, 0.6])
    elif family == "idefics3":
        P = dict(image=64, patch=8, E=48, F=96, L=2, H=3, merge=2, eps=1e-6, gelu=True,
                 longest_edge=128, mean=[0.5, 0.45, 0.4], std=[0.5, 0.55, 0.6])
    elif family in ("qwen2vl", "qwen2.5vl"):
        P = dict(image=112, patch=14, E=32, F=80, L=2, H=2, eps=1e-6, mm_hidden=96,
                 mean=MEAN, std=STD, wa_pattern=2, window=56)
        if family == "qwen2.5vl":
            P["silu"] = True
        else:
            P["gelu"] = True  # Qwen2-VL's ViT uses quick_gelu, but exact GELU is set here: clip's default is gelu_quick
    elif family == "lfm2":
        P = dict(image=64, patch=16, E=48, F=96, L=2, H=3, merge=2, eps=1e-6, gelu=True, mm_hidden=80,
                 mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    else:
        raise SystemExit(f"unknown family {family}")
    P["proj"] = TEXT["E"]
    return P


def write_text(path, family, vocab, rng, qtype):
    T = dict(TEXT)
    if family == "gemma3":
        m = Writer(path, "gemma3", rng, qtype)
        m.w.add_name("tiny-vlm-gemma3")
        text_common(m.w, T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"], 4096, 1000000.0, 1e-6)
        m.w.add_sliding_window(512)
        V = copy_tokenizer(m.w, vocab, template=GEMMA3_TEMPLATE)
        text_gemma3(m, V, T)
    elif family == "idefics3":
        m = Writer(path, "llama", rng, qtype)
        m.w.add_name("tiny-vlm-idefics3")
        text_common(m.w, T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"], 4096, 100000.0, 1e-5)
        m.w.add_rope_dimension_count(T["hd"])
        extra = ["<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>"]
        extra += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
        V = copy_tokenizer(m.w, vocab, extra=extra, template=IDEFICS3_TEMPLATE)
        m.w.add_vocab_size(V)
        text_llama(m, V, T)
    elif family in ("qwen2vl", "qwen2.5vl"):
        m = Writer(path, "qwen2vl", rng, qtype)
        m.w.add_name(f"tiny-vlm-{family}")
        text_common(m.w, T["L"], T["E"], T["F"], T["H"], T["HKV"], T["hd"], 4096, 1000000.0, 1e-6)
        m.w.add_rope_dimension_sections([2, 3, 3, 0])
        extra = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
        V = copy_tokenizer(m.w, vocab, extra=extra, template=CHATML_TEMPLATE)
        text_llama(m, V, T, qkv_bias=True)
    elif family == "lfm2":
        T.update(L=3, conv_L=3, kv=[False, True, False])
        m = Writer(path, "lfm2", rng, qtype)
        m.w.add_name("tiny-vlm-lfm2")
        text_common(m.w, T["L"], T["E"], T["F"], T["H"], [T["HKV"] if k else 0 for k in T["kv"]], T["hd"],
                    4096, 1000000.0, 1e-5)
        m.w.add_uint32("lfm2.shortconv.l_cache", T["conv_L"])
        extra = ["<|image_start|>", "<|image_end|>", "<|img_thumbnail|>", "<image>"]
        extra += [f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)]
        V = copy_tokenizer(m.w, vocab, extra=extra, template=CHATML_TEMPLATE)
        text_lfm2(m, V, T)
    m.finish()
    return T


def write_mmproj(path, family, rng, qtype, shape=None):
    P = family_params(family)
    scale = None
    if shape is not None:
        P.update(SHAPES[shape][1])
        scale = SHAPE_MATRIX_SCALE
    m = Writer(path, "clip", rng, qtype, scale)
    m.w.add_name(f"tiny-vlm-{family}-mmproj")
    if family == "gemma3":
        vision_gemma3(m, P)
    elif family == "idefics3":
        vision_idefics3(m, P)
    elif family in ("qwen2vl", "qwen2.5vl"):
        vision_qwen2vl(m, P, family == "qwen2.5vl")
    elif family == "lfm2":
        vision_lfm2(m, P)
    m.finish()
    return P


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True, choices=["gemma3", "idefics3", "qwen2vl", "qwen2.5vl", "lfm2"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab")
    ap.add_argument("--type", default="f16", choices=["f16", "q8_0"])
    ap.add_argument("--shape", choices=sorted(SHAPES))
    a = ap.parse_args()
    if a.shape and SHAPES[a.shape][0] != a.family:
        raise SystemExit(f"--shape {a.shape} is a {SHAPES[a.shape][0]} vision tower, not {a.family}")
    vocab = a.vocab or str(ROOT / ("models/gemma-3-270m-q4_k_m.gguf" if a.family == "gemma3"
                                   else "models/SmolLM2-135M-Instruct.Q8_0.gguf"))
    qtype = QT.F16 if a.type == "f16" else QT.Q8_0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(vocab)
    # two streams: the text model's weights do not shift when the vision tower changes, and back
    for name, seed_mix, write in (("model.gguf", 0x7E47, lambda p, r: write_text(p, a.family, reader, r, qtype)),
                                  ("mmproj.gguf", 0x1A6E, lambda p, r: write_mmproj(p, a.family, r, qtype, a.shape))):
        path = out / name
        part = path.with_suffix(".gguf.part")
        write(part, Stream((a.seed * 0x10001 + seed_mix) & 0xFFFFFFFFFFFFFFFF))
        part.replace(path)
        print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")


if __name__ == "__main__":
    main()
