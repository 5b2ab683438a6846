#!/usr/bin/env python3
"""Cross-checks scripts/bert_reference.py's output against Hugging Face transformers' BertModel run by
torch (float32 as sentence-transformers runs it, and float64), with sentence-transformers' mean pooling
over the attention mask and L2 normalisation. Not in CI (needs torch): run it from a venv with
torch and transformers, e.g. Debian's python3-torch 1.13 and `pip install transformers==4.40.2`
(later versions refuse torch < 2.1):

  target/ref-venv-hf/bin/python scripts/bert_reference_check.py MODEL_DIR REFERENCE.json
"""
import json
import sys

import numpy as np
import torch
from transformers import AutoTokenizer, BertModel

model_dir, ref_path = sys.argv[1], sys.argv[2]
ref = json.load(open(ref_path, encoding="utf-8"))
tok = AutoTokenizer.from_pretrained(model_dir)
model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
for dtype in (torch.float32, torch.float64):
    model = model.to(dtype)
    worst_cos, worst_abs, id_mismatch = 1.0, 0.0, 0
    for s, ids, e in zip(ref["sentences"], ref["ids"], ref["embeddings"]):
        enc = tok(s, return_tensors="pt", truncation=False)
        if enc["input_ids"][0].tolist() != ids:
            id_mismatch += 1
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0]
        mask = enc["attention_mask"][0].to(dtype).unsqueeze(-1)
        pooled = (h * mask).sum(0) / mask.sum()
        v = torch.nn.functional.normalize(pooled, dim=0).numpy().astype(np.float64)
        r = np.array(e)
        worst_cos = min(worst_cos, float(v @ r / np.linalg.norm(v) / np.linalg.norm(r)))
        worst_abs = max(worst_abs, float(np.abs(v - r).max()))
    print(f"transformers BertModel {dtype}: {len(ref['sentences'])} sentences, ids differing {id_mismatch}, "
          f"min cosine {worst_cos:.10f}, max |difference| {worst_abs:.3e}")
