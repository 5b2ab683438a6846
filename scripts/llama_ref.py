"""llama.cpp's logits for golden prompts, from the two builds the golden files speak of (build 0c1e570):

- x86: the host's llama.cpp through `llama_cpp` (`pip install llama-cpp-python==0.3.36` compiles it),
  or, when that is not installed, scripts/llama_replay.c built natively against the same source and named
  by LLAMA_REPLAY (`g++ -O2 -x c scripts/llama_replay.c -x none -I$L/include -I$L/ggml/include
  -Wl,--start-group build/src/libllama.a build/ggml/src/libggml*.a -Wl,--end-group -lpthread`, with
  L=src/vendor/llama.cpp in scripts/scale_bench.sh's target/llama.cpp build);
- arm: an aarch64 build (armv8.2-a+dotprod+fp16, as tests/golden/README.md's instruction counts) running
  scripts/llama_replay.c under `qemu-aarch64 -cpu cortex-a76`; see scripts/golden_spread.py for how to
  build it.

A plan is (prompt_ids, forced_ids, n_steps): the prompt is decoded as one batch, the forced ids are fed
one by one, then argmax ids (greedy). `logits` runs either build and returns, per plan, an array
[n_steps, n_vocab] of logits.
Tools for producing committed golden files only; never a dependency of pinfer or its CI.
"""
import os
import subprocess
import tempfile

import numpy as np


def x86_logits(path, fa, repack, plans):
    try:
        import llama_cpp
    except ImportError:
        replay = os.environ.get("LLAMA_REPLAY")
        if not replay:
            raise SystemExit("llama_ref: neither the llama_cpp module nor LLAMA_REPLAY (a native llama_replay)")
        return replay_logits([replay], path, fa, repack, plans)

    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch, cp.flash_attn_type = 256, 2, 2, fa
    ctx = llama_cpp.llama_init_from_model(model, cp)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    mem = llama_cpp.llama_get_memory(ctx)
    runs = []
    for prompt_ids, forced, n_steps in plans:
        llama_cpp.llama_memory_clear(mem, True)
        feed, steps = list(prompt_ids), []
        for step in range(n_steps):
            arr = (llama_cpp.llama_token * len(feed))(*feed)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(feed))) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            steps.append(logits)
            feed = [forced[step] if step < len(forced) else int(np.argmax(logits))]
        runs.append(np.array(steps))
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return runs


def logits(path, fa, repack, plans, arm=None):
    """The x86 build's logits, or with `arm` (the aarch64 llama_replay binary) that build's."""
    if arm:
        return replay_logits(["qemu-aarch64", "-cpu", "cortex-a76", arm], path, fa, repack, plans)
    return x86_logits(path, fa, repack, plans)


def replay_logits(command, path, fa, repack, plans):
    """The logits of a llama_replay binary run as `command` (with its runner, if any)."""
    import gguf

    n_vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    lines = [str(len(plans))]
    for prompt_ids, forced, n_steps in plans:
        lines.append(f"{len(prompt_ids)} {len(forced)} {n_steps}")
        lines.append(" ".join(map(str, prompt_ids)))
        lines.append(" ".join(map(str, forced)))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.f32")
        cmd = command + [path, str(fa), str(int(repack)), "2", out]
        subprocess.run(cmd, input="\n".join(lines) + "\n", text=True, check=True, stdout=subprocess.DEVNULL)
        flat = np.fromfile(out, dtype=np.float32).reshape(-1, n_vocab)
    runs, at = [], 0
    for _, _, n_steps in plans:
        runs.append(flat[at : at + n_steps].astype(np.float64))
        at += n_steps
    assert at == len(flat), "llama_replay wrote an unexpected number of rows"
    return runs
