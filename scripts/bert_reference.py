#!/usr/bin/env python3
"""The float64 reference for a BERT sentence embedder: ids from the HF `tokenizers` package (the model's
tokenizer.json, no padding, no truncation), then a float64 numpy forward of model.safetensors written
here (word + token-type 0 + absolute position embeddings, LayerNorm, post-LN layers: self-attention
without mask, GELU with erf, mean pooling over every token of the input including [CLS]/[SEP], L2
normalisation), as sentence-transformers' all-MiniLM-L6-v2 computes it.

  python3 scripts/bert_reference.py MODEL_DIR SENTENCES.txt OUT.json [--weights MODEL.gguf]

SENTENCES.txt holds one sentence a line. OUT.json: model, sentences, ids (HF tokenizers), embeddings
(7 significant digits). With --weights the same float64 forward runs on a GGUF's weights (dequantized
by the gguf package: F16, Q8_0, ...) instead of the safetensors: the error its quantization alone
causes, whatever runs it. Needs numpy, safetensors, tokenizers and gguf (PyPI); no torch.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x):
    """GELU as BERT's `gelu` activation: x * Phi(x) with the exact erf (not the tanh approximation)."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gguf_weights(path):
    """A GGUF's tensors under their Hugging Face names (convert_bert.py's table read backwards), float64."""
    import gguf
    from convert_bert import BLOCK_TENSORS, EMBEDDING_TENSORS

    hf_name = {v: k for k, v in EMBEDDING_TENSORS.items()}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if t.name in hf_name:
            name = hf_name[t.name]
        else:
            stem = {v: k for k, v in BLOCK_TENSORS.items()}[parts[2]]
            name = f"encoder.layer.{parts[1]}.{stem}.{parts[3]}"
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        out[name] = np.asarray(data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])
    return out


class Bert:
    def __init__(self, model_dir, weights=None):
        self.hp = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        if weights is not None:
            self.t = gguf_weights(weights)
            return
        with safe_open(model_dir / "model.safetensors", framework="np") as f:
            self.t = {name.removeprefix("bert."): f.get_tensor(name).astype(np.float64) for name in f.keys()}

    def linear(self, x, name):
        return x @ self.t[f"{name}.weight"].T + self.t[f"{name}.bias"]

    def norm(self, x, name):
        return layer_norm(x, self.t[f"{name}.weight"], self.t[f"{name}.bias"], self.hp["layer_norm_eps"])

    def hidden_states(self, ids, types=None):
        """The last layer's output, one row per token (token type 0 unless `types` are given)."""
        t, n = self.t, len(ids)
        types = np.zeros(n, dtype=np.int64) if types is None else np.asarray(types)
        x = (t["embeddings.word_embeddings.weight"][ids]
             + t["embeddings.token_type_embeddings.weight"][types]
             + t["embeddings.position_embeddings.weight"][:n])
        x = self.norm(x, "embeddings.LayerNorm")
        heads = self.hp["num_attention_heads"]
        d = self.hp["hidden_size"] // heads
        for layer in range(self.hp["num_hidden_layers"]):
            p = f"encoder.layer.{layer}"
            q, k, v = (self.linear(x, f"{p}.attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            att = softmax(q @ k.transpose(0, 2, 1) / math.sqrt(d))
            ctx = (att @ v).transpose(1, 0, 2).reshape(n, heads * d)
            x = self.norm(x + self.linear(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
            h = gelu(self.linear(x, f"{p}.intermediate.dense"))
            x = self.norm(x + self.linear(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        return x

    def embed(self, ids, types=None):
        pooled = self.hidden_states(ids, types).mean(axis=0)
        return pooled / np.linalg.norm(pooled)


def tokenizer(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # (all-MiniLM's tokenizer.json pads and truncates to 128; the reference takes every token as is)
    tok.no_padding()
    tok.no_truncation()
    return tok


def sig7(v):
    return float(f"{v:.7g}")


def pairs(model_dir, pairs_path, out_path):
    """`--pairs`: each query/document pair of a JSONL file (HF's `ids` and `type_ids`) embedded
    with its token types and with type 0 everywhere (what llama.cpp gives every token)."""
    bert = Bert(model_dir)
    rows = [json.loads(line) for line in pairs_path.read_text(encoding="utf-8").splitlines() if line]
    for row in rows:
        ids = np.array(row["ids"])
        row["embedding"] = [sig7(v) for v in bert.embed(ids, row["type_ids"])]
        row["embedding_type0"] = [sig7(v) for v in bert.embed(ids)]
    out = {
        "model": model_dir.name,
        "reference": "scripts/bert_reference.py --pairs: HF's pair ids and token types, float64 forward, "
        "mean pooling, L2; embedding_type0 with every token type 0",
        "pairs": rows,
    }
    out_path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{out_path}: {len(rows)} pairs")


def main():
    if sys.argv[1] == "--pairs":
        return pairs(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    model_dir, sentences_path, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    weights = sys.argv[sys.argv.index("--weights") + 1] if "--weights" in sys.argv else None
    sentences = sentences_path.read_text(encoding="utf-8").split("\n")
    if sentences and sentences[-1] == "":
        sentences.pop()
    tok, bert = tokenizer(model_dir), Bert(model_dir, weights)
    ids = [tok.encode(s).ids for s in sentences]
    if max(map(len, ids)) > bert.hp["max_position_embeddings"]:
        sys.exit("bert_reference: a sentence is longer than the model's context")
    embeddings = [bert.embed(np.array(i)) for i in ids]
    out = {
        "model": Path(weights).name if weights else model_dir.name,
        "reference": "scripts/bert_reference.py: HF tokenizers ids, float64 numpy forward, mean pooling, L2"
        + (f" (weights of {Path(weights).name})" if weights else ""),
        "sentences": sentences,
        "ids": ids,
        "embeddings": [[sig7(v) for v in e] for e in embeddings],
    }
    out_path.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{out_path}: {len(sentences)} sentences, {sum(map(len, ids))} tokens, longest {max(map(len, ids))}")


if __name__ == "__main__":
    main()
