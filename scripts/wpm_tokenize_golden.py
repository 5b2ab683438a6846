#!/usr/bin/env python3
"""WordPiece tokenization golden for all-MiniLM-L6-v2: each string's ids from the HF `tokenizers`
package (tokenizer.json, no padding or truncation) and from llama.cpp (llama-embedding --verbose-prompt
on the converted GGUF: llama.cpp's WPM tokenizer, special tokens parsed, [CLS] ... [SEP] added).

  python3 scripts/wpm_tokenize_golden.py MODEL_DIR MODEL.gguf OUT.jsonl [PAIRS_OUT.jsonl]

One JSON object a line: text, hf_ids, llama_ids (the two differ where llama.cpp's tokenizer does:
`same` says whether they agree). The strings are below; none holds a newline (llama-embedding's
separator). PAIRS_OUT gets HF's encoding of query/document pairs as a cross-encoder sees them:
`[CLS] q [SEP] d [SEP]` with token types 0 for the query part and 1 for the document part.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_reference import tokenizer  # noqa: E402
from llama_embed_golden import run  # noqa: E402

STRINGS = [
    "Hello, world!",
    "don't stop-believing... (really?)",
    "UPPER lower MiXeD CamelCase",
    "naïve café résumé Ångström",
    "e\u0301 (e + combining acute) vs \u00e9",
    "Ελληνικά και Русский язык",
    "中文字符和日本語のテキスト",
    "한국어 텍스트",
    "ภาษาไทย مرحبا بالعالم नमस्ते दुनिया",
    "emoji 🙂👍🏽 and symbols ©®™ § ¶ …",
    "tabs\tand  multiple   spaces",
    "a" * 120,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "12345 3.14159 1,000,000 -42 +7%",
    "e-mail: user@example.com, url: https://example.org/path?x=1&y=2#frag",
    "",
    "   ",
    "[CLS] [SEP] [MASK] [UNK] [PAD] literal specials",
    "ﬁ ligature ½ fraction ＡＢＣ fullwidth",
    "zero\u200bwidth soft\u00adhyphen bell\u0007char nbsp\u00a0space",
    "Mr. O'Neil's co-op, rock'n'roll & C++/C#",
    "¿Qué tal? ¡Muy bien! «citation» „Anführung“",
    "Ǆ ǅ ǆ İstanbul ß ẞ ﬀ",
    "αβγ ΑΒΓ ά έ ή",
]

PAIRS = [
    ("what is the capital of France?", "Paris is the capital and largest city of France."),
    ("how do plants make food", "Photosynthesis turns light, water and carbon dioxide into sugar."),
    ("café", "Crème brûlée is a dessert."),
    ("", "an empty query"),
]


def main():
    model_dir, gguf_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    tok = tokenizer(model_dir)
    inputs = Path("target/wpm-strings.txt")
    inputs.parent.mkdir(exist_ok=True)
    inputs.write_text("\n".join(STRINGS), encoding="utf-8")
    _, llama_ids, _ = run(gguf_path, inputs, ["--pooling", "mean"])
    if len(llama_ids) != len(STRINGS):
        sys.exit(f"llama-embedding saw {len(llama_ids)} strings, not {len(STRINGS)}")
    with open(out, "w", encoding="utf-8") as f:
        for text, ids in zip(STRINGS, llama_ids):
            hf = tok.encode(text).ids
            f.write(json.dumps({"text": text, "hf_ids": hf, "llama_ids": ids, "same": hf == ids},
                               ensure_ascii=False) + "\n")
    if len(sys.argv) > 4:
        with open(sys.argv[4], "w", encoding="utf-8") as f:
            for q, d in PAIRS:
                e = tok.encode(q, d)
                f.write(json.dumps({"query": q, "document": d, "ids": e.ids, "type_ids": e.type_ids},
                                   ensure_ascii=False) + "\n")
    same = sum(tok.encode(t).ids == i for t, i in zip(STRINGS, llama_ids))
    print(f"{out}: {len(STRINGS)} strings, HF and llama.cpp agree on {same}")


if __name__ == "__main__":
    main()
