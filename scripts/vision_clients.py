#!/usr/bin/env python3
"""Sends images to a running `pinfer serve --mmproj` through the real `openai` and `ollama` Python
clients (the versions scripts/setup.sh pins): the openai client's `image_url` with a data: URI,
streamed and whole, and the ollama client's `images` (a path it reads and encodes itself) on chat
and generate; each reply must be llama-mtmd-cli's greedy text for the image (tests/golden/vision).
tests/serve.rs runs it against the tiny Gemma 3 VLM; by hand:

    pinfer serve -m models/tiny-vlm/gemma3/model.gguf --mmproj models/tiny-vlm/gemma3/mmproj.gguf --port 8080 &
    scripts/vision_clients.py http://127.0.0.1:8080 tests/vision/images/rgba_41x29.png tests/golden/vision/gemma3/rgba_41x29.json

Exit status 0 and "vision_clients: ok" when every check passed.
"""
import base64
import json
import sys

import ollama
import openai

URL, IMAGE, GOLDEN = sys.argv[1:4]
WANT = json.load(open(GOLDEN))["greedy_text"]
N = len(json.load(open(GOLDEN))["greedy_ids"])


def check(got, what):
    if got != WANT:
        sys.exit(f"vision_clients: FAILED: {what}: {got!r} is not llama-mtmd-cli's {WANT!r}")


def main():
    data = base64.b64encode(open(IMAGE, "rb").read()).decode()
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0)
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "describe"},
    ]
    messages = [{"role": "user", "content": content}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=N, temperature=0)
    check(r.choices[0].message.content, "openai chat")
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=N, temperature=0, stream=True)
    check("".join(c.choices[0].delta.content or "" for c in stream if c.choices), "openai chat, streamed")

    o = ollama.Client(host=URL)
    options = {"temperature": 0, "num_predict": N}
    r = o.chat(model="m", messages=[{"role": "user", "content": "describe", "images": [IMAGE]}], options=options)
    check(r["message"]["content"], "ollama chat")
    r = o.generate(model="m", prompt="describe", images=[IMAGE], options=options)
    check(r["response"], "ollama generate")
    shown = o.show("m")
    if "vision" not in (shown.get("capabilities") or []):
        sys.exit(f"vision_clients: FAILED: /api/show capabilities {shown.get('capabilities')}")
    print("vision_clients: ok")


main()
