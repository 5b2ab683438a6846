#!/usr/bin/env python3
"""Converts a Hugging Face BERT embedder (sentence-transformers folder: config.json, model.safetensors,
tokenizer.json, modules.json + the pooling module's config.json) to GGUF, without torch or llama.cpp.

  python3 scripts/convert_bert.py MODEL_DIR OUT.gguf [--outtype f16|f32]

It writes what llama.cpp's convert_hf_to_gguf.py writes for the same folder (architecture `bert`, the
same keys in the same order, llama.cpp's tensor names, its vocabulary with the phantom-space prefix),
so that its F16 output is byte-identical to llama.cpp's: scripts/compare_gguf.py checks it and
tests/golden/embeddings/README.md holds the SHA-256 both give. Needs PyPI `gguf` (0.19.0: another
version may order or spell keys differently), `safetensors` and numpy.
"""
import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

# Hugging Face tensor name -> llama.cpp's (blocks as "encoder.layer.{bid}.", "blk.{bid}.").
EMBEDDING_TENSORS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
BLOCK_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
# Checkpoint tensors an embedder does not use (the pooler and the pre-training heads), as llama.cpp drops them.
DROPPED_PREFIXES = ("embeddings.position_ids", "pooler.", "cls.predictions", "cls.seq_relationship")
# Matrices llama.cpp keeps in F32 whatever the output type (they are looked up, not multiplied).
KEPT_F32 = ("position_embd.weight", "token_types.weight")
# sentence-transformers' pooling modes -> GGUF `pooling_type` (checked in this order, as llama.cpp does).
POOLING_MODES = [
    ("pooling_mode_mean_tokens", gguf.PoolingType.MEAN),
    ("pooling_mode_cls_token", gguf.PoolingType.CLS),
    ("pooling_mode_lasttoken", gguf.PoolingType.LAST),
]
# tokenizer.ggml.pre llama.cpp's converter records, by a hash of how the tokenizer splits its test text;
# llama.cpp's loader ignores it for WordPiece vocabularies. Keyed here by the vocabulary's first
# and last tokens and size, the vocabularies this script has been checked on.
KNOWN_PRE = {("[PAD]", "##～", 30522): "jina-v2-en"}  # bert-base-uncased's (all-MiniLM-L6-v2)


def hf_to_gguf_name(name):
    if name in EMBEDDING_TENSORS:
        return EMBEDDING_TENSORS[name]
    parts = name.split(".")
    if parts[:2] == ["encoder", "layer"] and parts[2].isdecimal():
        stem, suffix = ".".join(parts[3:-1]), parts[-1]
        if stem in BLOCK_TENSORS and suffix in ("weight", "bias"):
            return f"blk.{parts[2]}.{BLOCK_TENSORS[stem]}.{suffix}"
    sys.exit(f"convert_bert: no GGUF name for tensor {name!r}")


def load_tensors(model_dir):
    """(gguf name, float32 array) in the checkpoint's name order, as llama.cpp's converter visits them."""
    out = []
    with safe_open(model_dir / "model.safetensors", framework="np") as f:
        for name in sorted(f.keys()):
            short = name[5:] if name.startswith("bert.") else name
            if short.startswith(DROPPED_PREFIXES):
                continue
            out.append((hf_to_gguf_name(short), f.get_tensor(name).astype(np.float32)))
    return out


def stored(name, data, outtype):
    if outtype == "f16" and data.ndim >= 2 and name.endswith(".weight") and name not in KEPT_F32:
        return data.astype(np.float16)
    return data


def pooling_type(model_dir):
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    for module in json.loads(modules_path.read_text(encoding="utf-8")):
        if module["type"].endswith("Pooling"):
            config = json.loads((model_dir / module["path"] / "config.json").read_text(encoding="utf-8"))
            for key, value in POOLING_MODES:
                if config.get(key):
                    return value
            sys.exit("convert_bert: the pooling module is neither mean, cls nor last-token")
    return None


def vocabulary(model_dir, vocab_size):
    """Tokens (with llama.cpp's phantom space: a word-initial piece gets U+2581, `##x` becomes `x`)
    and token types from tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if tok["model"]["type"] != "WordPiece":
        sys.exit(f"convert_bert: tokenizer model {tok['model']['type']}, not WordPiece")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for a in added.values():
        by_id[a["id"]] = a["content"]
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"\u2581[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = by_id[i]
        if i in added:
            kind = gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED
        else:
            kind = gguf.TokenType.NORMAL
        types.append(kind)
        if kind == gguf.TokenType.CONTROL:
            tokens.append(t)
        elif t.startswith("##"):
            tokens.append(t[2:])
        else:
            tokens.append("\u2581" + t)
    key = (by_id.get(0), by_id.get(vocab_size - 1), vocab_size)
    if key not in KNOWN_PRE:
        sys.exit(f"convert_bert: unknown vocabulary {key}: add the pre-tokenizer name llama.cpp gives it")
    lowercase = tok.get("normalizer", {}).get("lowercase") if tok.get("normalizer") else None
    return tokens, types, KNOWN_PRE[key], lowercase


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", choices=["f16", "f32"], default="f16")
    args = ap.parse_args()
    model_dir = args.model_dir
    hp = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if hp.get("architectures") not in (["BertModel"], None) or hp.get("model_type") != "bert":
        sys.exit(f"convert_bert: {hp.get('architectures')} is not a plain BertModel")
    if hp.get("position_embedding_type", "absolute") != "absolute":
        sys.exit("convert_bert: only absolute position embeddings")
    file_type = gguf.LlamaFileType.MOSTLY_F16 if args.outtype == "f16" else gguf.LlamaFileType.ALL_F32

    w = gguf.GGUFWriter(args.out, "bert")
    for name, data in load_tensors(model_dir):
        w.add_tensor(name, stored(name, data, args.outtype))

    # general.*: gguf's own model-card heuristics (names from config.json's _name_or_path and the
    # folder), as llama.cpp's converter calls them.
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, model_dir, None, total)
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)

    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_layer_norm_eps(hp["layer_norm_eps"])
    w.add_file_type(file_type)
    w.add_causal_attention(False)
    pooling = pooling_type(model_dir)
    if pooling is not None:
        w.add_pooling_type(pooling)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, pre, lowercase = vocabulary(model_dir, hp["vocab_size"])
    w.add_token_type_count(hp.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    if lowercase is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
