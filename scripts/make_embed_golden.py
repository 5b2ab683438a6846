#!/usr/bin/env python3
"""llama-embedding's vectors of the tiny BERT (scripts/make_bert_tiny.py) for each pooling, the
golden of tests/embed_bert.rs (llama.cpp is the reference, never a dependency: the golden is
committed, this script remakes it).

    python3 scripts/make_embed_golden.py LLAMA_EMBEDDING MODEL.gguf OUT.json

The texts are words of the tiny vocabulary (`wN` is token N + 5), so their ids are known without
a tokenizer: llama.cpp's WPM gives [CLS] ids [SEP], which the script checks in its
--verbose-prompt output. Vectors are unnormalised (raw output format: llama-embedding's JSON pads
a reranker's score with stale values) (--embd-normalize -1), one thread, context 128.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

TEXTS = [
    'w5 w6 w7',
    'w35',
    ' '.join(f'w{(7 * i) % 90}' for i in range(70)),
    'w15 w16 w17 w18 w19 w20 w21',
]
POOLINGS = ['mean', 'cls', 'last', 'rank', 'none']


def ids_of(text):
    return [2] + [int(w[1:]) + 5 for w in text.split()] + [3]


def run(exe, model, pooling, log):
    # (llama.cpp's log thread may not have written stdout when the process exits; its log file
    # holds every line.)
    cmd = [exe, '--log-file', log, '-m', model, '-p', '\n'.join(TEXTS), '-c', '128', '-b', '512', '-ub', '512', '-t', '1',
           '--embd-normalize', '-1', '--embd-output-format', 'raw', '--pooling', pooling, '--verbose-prompt']
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    with open(log) as f:
        text = f.read()
    # The ids llama.cpp tokenized each prompt to ("  ID -> 'piece'" lines after each prompt's line).
    seen = [int(m) for m in re.findall(r"^\s*(\d+) -> '", text, re.M)]
    want = [i for t in TEXTS for i in ids_of(t)]
    if seen[:len(want)] != want:
        sys.exit(f'llama.cpp tokenized the texts otherwise: {seen[:len(want)]} != {want}')
    # One vector per line (a reranker's: its labels' scores); the id lines start with spaces.
    number = r'-?\d+\.\d+'
    rows = [line for line in text.split('\n') if re.fullmatch(rf'{number}( {number})*', line)]
    return [[float(v) for v in line.split()] for line in rows]


def run_whole(exe, model, pooling, log):
    """`run` until every vector is there (the log thread may still lose the last lines)."""
    want = sum(len(ids_of(t)) for t in TEXTS) if pooling == 'none' else len(TEXTS)
    for _ in range(20):
        rows = run(exe, model, pooling, log)
        if len(rows) == want:
            return rows
    sys.exit(f'{pooling}: llama-embedding never printed all {want} vectors')


def main():
    exe, model, path = sys.argv[1:4]
    golden = {'inputs': [ids_of(t) for t in TEXTS]}
    with tempfile.TemporaryDirectory() as tmp:
        for pooling in POOLINGS:
            golden[pooling] = run_whole(exe, model, pooling, os.path.join(tmp, 'log.txt'))
    with open(path, 'w') as f:
        json.dump(golden, f, separators=(',', ':'))
        f.write('\n')


if __name__ == '__main__':
    main()
