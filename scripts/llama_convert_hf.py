#!/usr/bin/env python3
"""Runs llama.cpp's convert_hf_to_gguf.py (the reference converter, never used by CI) under Debian's
torch 1.13, which lacks the float8 dtypes the converter's tables name: they are defined here as
placeholders that no tensor of a BERT/MiniLM checkpoint has.

  target/ref-venv/bin/python scripts/llama_convert_hf.py LLAMA_CPP_DIR MODEL_DIR --outfile OUT --outtype f16

LLAMA_CPP_DIR is the llama.cpp source (target/llama.cpp/src/vendor/llama.cpp); the rest of the
arguments go to the converter unchanged. The venv: `/usr/bin/python3 -m venv --system-site-packages
target/ref-venv && target/ref-venv/bin/pip install "transformers<5" safetensors tokenizers` beside
Debian's python3-torch.
"""
import runpy
import sys

import torch


class _MissingDtype:
    """A dtype torch 1.13 does not have: hashable, equal only to itself."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name} (placeholder)"


for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "uint16", "uint32", "uint64"):
    if not hasattr(torch, _name):
        setattr(torch, _name, _MissingDtype(_name))

llama_dir = sys.argv[1]
sys.path.insert(0, f"{llama_dir}/gguf-py")
sys.path.insert(0, llama_dir)
sys.argv = [f"{llama_dir}/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
