#!/usr/bin/env python3
"""Tiny random-weight embedding and reranking models of the encoder families llama.cpp serves, with its
tensor names and keys (src/models/{bert,nomic-bert,jina-bert-v2,qwen3,gemma-embedding}.cpp), for the
goldens in tests/golden/embeddings (llama-embedding's outputs on them).

  python3 scripts/make_encoder_tiny.py WPM_GGUF BPE_GGUF OUTDIR

WPM_GGUF gives the WordPiece vocabulary of the BERT families (models/all-MiniLM-L6-v2.F16.gguf, from
scripts/convert_bert.py), BPE_GGUF the byte-level BPE vocabulary of the decoder embedders (the default
model, models/SmolLM2-135M-Instruct.Q4_1.gguf): every tokenizer.* key is copied (the chat template
aside), so the tiny models tokenize as real ones do. Weights come from a splitmix64 stream of the
model's seed (no numpy generator: the same bytes on every numpy), uniform in [-scale, scale); norms
are 1 + noise. Needs gguf==0.19.0 (another version may write other bytes) and numpy. Prints each file's
SHA-256 (scripts/setup.sh checks them).

| file | architecture | what it exercises |
|---|---|---|
| nomic-bert-tiny.gguf | nomic-bert | fused QKV, NeoX RoPE (base 1000), SwiGLU FFN without biases, Q8_0 matrices, mean pooling |
| jina-bert-v2-tiny.gguf | jina-bert-v2 | ALiBi (max bias 8, no position embeddings), GEGLU from an up matrix of 2 x n_ff (gate half first), F16, mean pooling |
| bert-rerank-tiny.gguf | bert | cross-encoder: `cls` (tanh) and `cls.output` (1 score) heads on the [CLS] row, pooling rank, one token type, F16 |
| qwen3-embed-tiny.gguf | qwen3 | causal decoder, Q/K RMS norms, GQA 4/2, last-token pooling, EOS appended, F16 |
| qwen3-rerank-tiny.gguf | qwen3 | Qwen3-Reranker: pooling rank on the last token, `cls.output` of 2 rows (yes, no) then softmax, its `rerank` chat template, F16 |
| gemma-embed-tiny.gguf | gemma-embedding | bidirectional Gemma 3: embeddings x sqrt(n_embd), sandwich RMS norms, symmetric sliding window 4 on layers 0 and 1 (pattern 3), own RoPE base there, GELU-gated FFN, mean pooling then dense_2 (64 -> 96) and dense_3 (96 -> 64), BOS and EOS added, F16 |
"""
import hashlib
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)

# Qwen3-Reranker's prompt (its model card's format): llama.cpp fills {query} and {document}.
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


class Stream:
    """Uniform values from splitmix64, counter-based: value i of the stream is a pure function of
    (seed, i), computed in uint64 arithmetic that numpy does the same everywhere."""

    def __init__(self, seed):
        self.seed = np.uint64(seed)
        self.at = 0

    def uniform(self, n):
        with np.errstate(over="ignore"):
            z = self.seed + (np.arange(self.at + 1, self.at + n + 1, dtype=np.uint64)
                             * np.uint64(0x9E3779B97F4A7C15))
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        self.at += n
        return (z >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0


class Model:
    """A GGUF being written: tensors in ggml's dimension order (ne0 first), drawn from the stream."""

    def __init__(self, out, arch, seed, qtype):
        self.w = gguf.GGUFWriter(out, arch)
        self.arch = arch
        self.rng = Stream(seed)
        self.qtype = qtype
        self.w.add_name(f"test-{arch}")

    def tensor(self, name, ne, scale, q=None):
        a = (self.rng.uniform(int(np.prod(ne))) * scale).astype(np.float32).reshape(ne[::-1])
        q = QT.F32 if len(ne) == 1 else (self.qtype if q is None else q)
        if q == QT.F32:
            self.w.add_tensor(name, a)
        elif q == QT.F16:
            self.w.add_tensor(name, a.astype(np.float16))
        else:
            d = gguf.quants.quantize(a, q)
            self.w.add_tensor(name, d, raw_shape=d.shape, raw_dtype=q)

    def norm(self, name, n, bias=True):
        a = (1.0 + 0.1 * self.rng.uniform(n)).astype(np.float32)
        self.w.add_tensor(f"{name}.weight", a)
        if bias:
            self.tensor(f"{name}.bias", [n], 0.05)

    def finish(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def copy_tokenizer(w, reader, skip=()):
    """Every tokenizer.* key of `reader` but those in `skip` and the chat templates, with its type."""
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name in skip or name.startswith("tokenizer.chat_template"):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)


def bert_hparams(m, L, E, F, H, pooling, n_ctx=128):
    w = m.w
    w.add_block_count(L)
    w.add_context_length(n_ctx)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)


def nomic_bert(out, wpm, seed=501):
    L, E, F, H = 2, 64, 128, 4
    m = Model(out, "nomic-bert", seed, QT.Q8_0)
    bert_hparams(m, L, E, F, H, gguf.PoolingType.MEAN)
    m.w.add_rope_freq_base(1000.0)
    m.w.add_token_type_count(2)
    copy_tokenizer(m.w, wpm, skip=("tokenizer.ggml.token_type_count",))
    V = len(wpm.fields["tokenizer.ggml.tokens"].data)
    m.tensor("token_embd.weight", [E, V], 1.0)
    m.tensor("token_types.weight", [E, 2], 0.5, QT.F32)
    m.norm("token_embd_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        m.tensor(f"{p}.attn_qkv.weight", [E, 3 * E], 0.4)
        m.tensor(f"{p}.attn_output.weight", [E, E], 0.3)
        m.norm(f"{p}.attn_output_norm", E)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.2)
        m.norm(f"{p}.layer_output_norm", E)
    m.finish()


def jina_bert_v2(out, wpm, seed=502):
    L, E, F, H = 2, 64, 96, 4
    m = Model(out, "jina-bert-v2", seed, QT.F16)
    bert_hparams(m, L, E, F, H, gguf.PoolingType.MEAN)
    m.w.add_token_type_count(2)
    copy_tokenizer(m.w, wpm, skip=("tokenizer.ggml.token_type_count",))
    V = len(wpm.fields["tokenizer.ggml.tokens"].data)
    m.tensor("token_embd.weight", [E, V], 1.0)
    m.tensor("token_types.weight", [E, 2], 0.5, QT.F32)
    m.norm("token_embd_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        for t in ("attn_q", "attn_k", "attn_v"):
            m.tensor(f"{p}.{t}.weight", [E, E], 0.4)
            m.tensor(f"{p}.{t}.bias", [E], 0.05)
        m.tensor(f"{p}.attn_output.weight", [E, E], 0.3)
        m.tensor(f"{p}.attn_output.bias", [E], 0.05)
        m.norm(f"{p}.attn_output_norm", E)
        m.tensor(f"{p}.ffn_up.weight", [E, 2 * F], 0.3)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.2)
        m.tensor(f"{p}.ffn_down.bias", [E], 0.05)
        m.norm(f"{p}.layer_output_norm", E)
    m.finish()


def bert_rerank(out, wpm, seed=503):
    L, E, F, H = 2, 64, 128, 4
    m = Model(out, "bert", seed, QT.F16)
    bert_hparams(m, L, E, F, H, gguf.PoolingType.RANK)
    m.w.add_token_type_count(1)
    copy_tokenizer(m.w, wpm, skip=("tokenizer.ggml.token_type_count",))
    V = len(wpm.fields["tokenizer.ggml.tokens"].data)
    m.tensor("token_embd.weight", [E, V], 1.0)
    m.tensor("token_types.weight", [E, 1], 0.5, QT.F32)
    m.tensor("position_embd.weight", [E, 128], 0.5, QT.F32)
    m.norm("token_embd_norm", E)
    for i in range(L):
        p = f"blk.{i}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            m.tensor(f"{p}.{t}.weight", [E, E], 0.4 if t != "attn_output" else 0.3)
            m.tensor(f"{p}.{t}.bias", [E], 0.05)
        m.norm(f"{p}.attn_output_norm", E)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_up.bias", [F], 0.05)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.2)
        m.tensor(f"{p}.ffn_down.bias", [E], 0.05)
        m.norm(f"{p}.layer_output_norm", E)
    m.tensor("cls.weight", [E, E], 0.3)
    m.tensor("cls.bias", [E], 0.05)
    m.tensor("cls.output.weight", [E, 1], 0.5)
    m.tensor("cls.output.bias", [1], 0.1)
    m.finish()


def qwen3_layers(m, V, L, E, F, H, HKV, hd):
    m.tensor("token_embd.weight", [E, V], 1.0)
    m.norm("output_norm", E, bias=False)
    for i in range(L):
        p = f"blk.{i}"
        m.norm(f"{p}.attn_norm", E, bias=False)
        m.tensor(f"{p}.attn_q.weight", [E, H * hd], 0.4)
        m.tensor(f"{p}.attn_k.weight", [E, HKV * hd], 0.4)
        m.tensor(f"{p}.attn_v.weight", [E, HKV * hd], 0.4)
        m.tensor(f"{p}.attn_output.weight", [H * hd, E], 0.3)
        m.norm(f"{p}.attn_q_norm", hd, bias=False)
        m.norm(f"{p}.attn_k_norm", hd, bias=False)
        m.norm(f"{p}.ffn_norm", E, bias=False)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.2)


def decoder_hparams(m, bpe, L, E, F, H, HKV, hd, pooling, pre, add_eos, eos=None):
    w = m.w
    w.add_block_count(L)
    w.add_context_length(1024)  # (a reranker's templated pair is about 100 tokens)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_pooling_type(pooling)
    skip = {"tokenizer.ggml.pre", "tokenizer.ggml.add_eos_token"} | ({"tokenizer.ggml.eos_token_id"} if eos is not None else set())
    copy_tokenizer(w, bpe, skip=skip)
    w.add_tokenizer_pre(pre)
    w.add_add_eos_token(add_eos)
    if eos is not None:
        w.add_eos_token_id(eos)
    return len(bpe.fields["tokenizer.ggml.tokens"].data)


def qwen3_embed(out, bpe, seed=504):
    L, E, F, H, HKV, hd = 2, 64, 128, 4, 2, 16
    m = Model(out, "qwen3", seed, QT.F16)
    # Qwen3-Embedding appends <|endoftext|> (id 0 here) and pools its row
    V = decoder_hparams(m, bpe, L, E, F, H, HKV, hd, gguf.PoolingType.LAST, "qwen2", True, eos=0)
    qwen3_layers(m, V, L, E, F, H, HKV, hd)
    m.finish()


def qwen3_rerank(out, bpe, seed=505):
    L, E, F, H, HKV, hd = 2, 64, 128, 4, 2, 16
    m = Model(out, "qwen3", seed, QT.F16)
    V = decoder_hparams(m, bpe, L, E, F, H, HKV, hd, gguf.PoolingType.RANK, "qwen2", False)
    m.w.add_array("qwen3.classifier.output_labels", ["yes", "no"])
    m.w.add_string("tokenizer.chat_template.rerank", QWEN3_RERANK_TEMPLATE)
    qwen3_layers(m, V, L, E, F, H, HKV, hd)
    m.tensor("cls.output.weight", [E, 2], 0.3)
    m.finish()


def gemma_embed(out, bpe, seed=506):
    L, E, F, H, HKV, hd, D = 3, 64, 128, 4, 2, 16, 96
    m = Model(out, "gemma-embedding", seed, QT.F16)
    w = m.w
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_float32("gemma-embedding.rope.freq_base_swa", 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(4)
    w.add_uint32("gemma-embedding.attention.sliding_window_pattern", 3)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_uint32("gemma-embedding.dense_2_feat_in", E)
    w.add_uint32("gemma-embedding.dense_2_feat_out", D)
    w.add_uint32("gemma-embedding.dense_3_feat_in", D)
    w.add_uint32("gemma-embedding.dense_3_feat_out", E)
    copy_tokenizer(w, bpe, skip={"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"})
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    V = len(bpe.fields["tokenizer.ggml.tokens"].data)
    m.tensor("token_embd.weight", [E, V], 0.15)
    m.norm("output_norm", E, bias=False)
    m.tensor("dense_2.weight", [E, D], 0.3)
    m.tensor("dense_3.weight", [D, E], 0.3)
    for i in range(L):
        p = f"blk.{i}"
        m.norm(f"{p}.attn_norm", E, bias=False)
        m.tensor(f"{p}.attn_q.weight", [E, H * hd], 0.4)
        m.tensor(f"{p}.attn_k.weight", [E, HKV * hd], 0.4)
        m.tensor(f"{p}.attn_v.weight", [E, HKV * hd], 0.4)
        m.tensor(f"{p}.attn_output.weight", [H * hd, E], 0.3)
        m.norm(f"{p}.post_attention_norm", E, bias=False)
        m.norm(f"{p}.attn_q_norm", hd, bias=False)
        m.norm(f"{p}.attn_k_norm", hd, bias=False)
        m.norm(f"{p}.ffn_norm", E, bias=False)
        m.tensor(f"{p}.ffn_gate.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_up.weight", [E, F], 0.3)
        m.tensor(f"{p}.ffn_down.weight", [F, E], 0.2)
        m.norm(f"{p}.post_ffw_norm", E, bias=False)
    m.finish()


# file -> (writer, vocabulary kind)
MODELS = {
    "nomic-bert-tiny.gguf": (nomic_bert, "wpm"),
    "jina-bert-v2-tiny.gguf": (jina_bert_v2, "wpm"),
    "bert-rerank-tiny.gguf": (bert_rerank, "wpm"),
    "qwen3-embed-tiny.gguf": (qwen3_embed, "bpe"),
    "qwen3-rerank-tiny.gguf": (qwen3_rerank, "bpe"),
    "gemma-embed-tiny.gguf": (gemma_embed, "bpe"),
}


def main():
    vocabs = {"wpm": gguf.GGUFReader(sys.argv[1]), "bpe": gguf.GGUFReader(sys.argv[2])}
    outdir = Path(sys.argv[3])
    outdir.mkdir(parents=True, exist_ok=True)
    for name, (write, vocab) in MODELS.items():
        path = outdir / name
        part = path.with_suffix(".gguf.part")
        write(part, vocabs[vocab])
        part.replace(path)
        print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")


if __name__ == "__main__":
    main()
