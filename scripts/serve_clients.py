#!/usr/bin/env python3
"""Speaks to a running `pinfer serve` through the real `openai`, `ollama` and `anthropic` Python clients (the
versions scripts/setup.sh pins) and checks what they get back. tests/serve.rs starts the server and
runs this; by hand:

    pinfer serve -m MODEL --port 8080 -c 1024 &
    scripts/serve_clients.py http://127.0.0.1:8080

and for an embedding model (all-MiniLM-L6-v2's F16 GGUF, against llama-embedding's golden vectors):

    pinfer serve -m models/all-MiniLM-L6-v2.F16.gguf --embedding --port 8080 &
    scripts/serve_clients.py --embedding http://127.0.0.1:8080 tests/golden/embeddings/minilm-f16.llama.json

Greedy (temperature 0) everywhere, so streamed and whole answers must be the same text.
Exit status 0 and "serve_clients: ok" when every check passed.
"""
import json
import sys
import urllib.request

import anthropic
import jsonschema
import ollama
import openai

EMBEDDING = sys.argv[1:2] == ["--embedding"]
ARGS = sys.argv[2:] if EMBEDDING else sys.argv[1:]
URL = ARGS[0] if ARGS else "http://127.0.0.1:8080"
N = 8
MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def check(cond, what):
    if not cond:
        sys.exit(f"serve_clients: FAILED: {what}")


def openai_checks():
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    check(len(models.data) == 1 and models.data[0].id, f"models.list: {models}")
    model = models.data[0].id

    whole = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=N)
    choice = whole.choices[0]
    check(choice.message.role == "assistant" and choice.message.content, f"chat: {whole}")
    check(choice.finish_reason == "length", f"chat finish_reason: {choice.finish_reason}")
    check(whole.usage.completion_tokens == N and whole.usage.prompt_tokens > 0, f"chat usage: {whole.usage}")

    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=N, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check(text == choice.message.content, f"streamed {text!r} vs whole {choice.message.content!r}")
    check(finish == "length" and usage and usage.completion_tokens == N, f"stream end: {finish} {usage}")

    probs = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2)
    content = probs.choices[0].logprobs.content
    check(len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content),
          f"logprobs: {content}")

    words = choice.message.content.split()
    if len(words) > 2:
        stopped = client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_tokens=N, stop=[words[2]])
        got = stopped.choices[0].message.content
        check(stopped.choices[0].finish_reason == "stop" and words[2] not in got, f"stop: {got!r}")

    legacy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    check(legacy.choices[0].text and legacy.usage.completion_tokens == 4, f"completions: {legacy}")

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=1)
        check(False, "a prompt longer than the context was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "context" in str(e), f"too long: {e}")
    return choice.message.content


def ollama_checks(openai_text):
    client = ollama.Client(host=URL)
    listed = client.list()
    check(len(listed.models) == 1, f"list: {listed}")
    model = listed.models[0].model
    options = {"temperature": 0, "num_predict": N}
    whole = client.chat(model=model, messages=MESSAGES, options=options)
    check(whole.message.content == openai_text, f"ollama chat {whole.message.content!r} vs {openai_text!r}")
    check(whole.done and whole.done_reason == "length" and whole.eval_count == N, f"ollama chat end: {whole}")
    text = "".join(part.message.content for part in client.chat(model=model, messages=MESSAGES, options=options, stream=True))
    check(text == openai_text, f"ollama streamed {text!r}")
    gen = client.generate(model=model, prompt="Tell me a story.", options={"num_predict": 3, "temperature": 0})
    check(gen.done and 1 <= gen.eval_count <= 3 and gen.response and gen.context, f"ollama generate: {gen}")
    shown = client.show(model)
    check(shown.details.format == "gguf", f"show: {shown}")
    check(len(client.ps().models) == 1, "ps")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TOOLS = [{"type": "function", "function": {
    "name": "set_light", "description": "Switch a light on or off",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                   "required": ["room", "on"]}}}]
ASK = [{"role": "user", "content": "Describe a dragon as JSON with a very long list of tags."}]
LIGHT = [{"role": "user", "content": "Turn on the kitchen light."}]


def structured_checks():
    """JSON schemas and tool calls through both clients: every output valid, even when the token
    limit is far below what the model would write."""
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "dragon", "schema": SCHEMA}}
    for temperature, limit in [(0, 40), (1.0, 40), (0, 200)]:
        r = client.chat.completions.create(model=model, messages=ASK, temperature=temperature, max_tokens=limit,
                                           response_format=fmt, seed=5)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=30,
                                         response_format={"type": "json_object"})
    check(isinstance(json.loads(obj.choices[0].message.content), dict), f"json_object: {obj}")
    try:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
        check(False, "an invalid schema was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "strin" in str(e), f"bad schema: {e}")

    for choice in ["required", {"type": "function", "function": {"name": "set_light"}}]:
        r = client.chat.completions.create(model=model, messages=LIGHT, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=60, parallel_tool_calls=False)
        c = r.choices[0]
        check(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, f"tool call: {r}")
        call = c.message.tool_calls[0]
        check(call.type == "function" and call.function.name == "set_light" and call.id, f"call: {call}")
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    # Streamed: a delta names each call (index, id, type, name, arguments ""), then its arguments
    # come; aggregated by index as clients do, the same calls as the whole reply's.
    ask = dict(model=model, messages=LIGHT, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**ask).choices[0].message
    stream = client.chat.completions.create(**ask, stream=True)
    calls, content, finish = {}, "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    check(c["id"] is None and d.type == "function" and d.function.name, f"call header: {d}")
                    c["id"], c["name"] = d.id, d.function.name
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    check(finish == "tool_calls" and got == want and all(c["id"] for c in calls.values()),
          f"streamed calls {got} vs whole {want} ({finish})")
    check(content == (whole.content or "") and "<tool_call>" not in content, f"streamed content {content!r}")
    # A conversation that carries a call and its result.
    follow = client.chat.completions.create(model=model, temperature=0, max_tokens=8, tools=TOOLS, messages=LIGHT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "set_light", "arguments": "{\"room\": \"kitchen\", \"on\": true}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}])
    check(follow.choices[0].message is not None, f"follow-up: {follow}")

    o = ollama.Client(host=URL)
    r = o.chat(model=model, messages=ASK, format=SCHEMA, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    r = o.chat(model=model, messages=ASK, format="json", options={"temperature": 0, "num_predict": 30})
    check(isinstance(json.loads(r.message.content), dict), f"ollama json: {r.message.content!r}")
    r = o.generate(model=model, prompt="A dragon as JSON:", format=SCHEMA, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(r.response), SCHEMA)
    # Ollama's tools: the calls' arguments as objects.
    r = o.chat(model=model, messages=LIGHT, tools=TOOLS, options={"temperature": 0, "num_predict": 60})
    for call in r.message.tool_calls or []:
        check(call.function.name == "set_light" and isinstance(call.function.arguments, dict), f"ollama call: {call}")


def anthropic_checks(openai_text):
    """Anthropic's Messages API through the real `anthropic` client: the same greedy text as the
    OpenAI route, streamed and whole, token counting, and a tool round trip."""
    client = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0)
    whole = client.messages.create(model="m", max_tokens=N, messages=MESSAGES, extra_body={"temperature": 0})
    text = "".join(b.text for b in whole.content if b.type == "text")
    check(text == openai_text, f"anthropic text {text!r} != openai {openai_text!r}")
    check(whole.stop_reason == "max_tokens" and whole.usage.output_tokens == N, f"anthropic: {whole}")
    with client.messages.stream(model="m", max_tokens=N, messages=MESSAGES, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(streamed == openai_text, f"anthropic stream {streamed!r} != {openai_text!r}")
    check(final.stop_reason == "max_tokens", f"anthropic stream final: {final}")
    count = client.messages.count_tokens(model="m", messages=MESSAGES)
    check(count.input_tokens > 0 and count.input_tokens == whole.usage.input_tokens, f"count_tokens: {count} vs {whole.usage}")

    tools = [{"name": "set_light", "description": "Switch a light on or off",
              "input_schema": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                               "required": ["room", "on"]}}]
    ask = [{"role": "user", "content": "Turn on the light in the kitchen."}]
    r = client.messages.create(model="m", max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    uses = [b for b in r.content if b.type == "tool_use"]
    check(r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "set_light", f"anthropic tool: {r}")
    jsonschema.validate(uses[0].input, tools[0]["input_schema"])
    # Streamed: the tool_use block's input comes as input_json_delta; the client's final message
    # holds the same call.
    with client.messages.stream(model="m", max_tokens=60, messages=ask, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    check(final.stop_reason == "tool_use" and "input_json_delta" in kinds
          and streamed == [(u.name, u.input) for u in uses], f"anthropic streamed tool: {final} ({kinds})")
    follow = ask + [{"role": "assistant", "content": r.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "done"}]}]
    r = client.messages.create(model="m", max_tokens=N, messages=follow, tools=tools, extra_body={"temperature": 0})
    check(r.stop_reason in ("end_turn", "max_tokens", "tool_use") and r.content, f"anthropic after tool: {r}")
    try:
        client.messages.create(model="m", max_tokens=N, messages=[{"role": "robot", "content": "x"}])
        check(False, "a bad role was accepted")
    except anthropic.BadRequestError as e:
        check("robot" in str(e), f"anthropic error: {e}")


def responses_checks(openai_text):
    """OpenAI's Responses API through the real client: the chat route's greedy text whole and
    streamed, a continuation by previous_response_id, a function call round trip."""
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="m", input=MESSAGES[0]["content"], max_output_tokens=N, temperature=0)
    check(r.output_text == openai_text, f"responses text {r.output_text!r} != {openai_text!r}")
    check(r.status == "incomplete" and r.usage.output_tokens == N, f"responses: {r}")
    with client.responses.stream(model="m", input=MESSAGES, max_output_tokens=N, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    check(deltas == openai_text and final.output_text == openai_text, f"responses stream {deltas!r}, {final}")
    more = client.responses.create(model="m", previous_response_id=r.id, input="Go on.", max_output_tokens=N,
                                   temperature=0)
    check(more.output_text and more.usage.input_tokens > r.usage.input_tokens, f"previous_response_id: {more}")
    try:
        client.responses.create(model="m", previous_response_id="resp_nope", input="x", max_output_tokens=2)
        check(False, "an unknown previous_response_id was accepted")
    except openai.BadRequestError as e:
        check("previous_response_id" in str(e), f"responses error: {e}")
    tools = [{"type": "function", "name": "set_light", "description": "Switch a light on or off",
              "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                             "required": ["room", "on"]}}]
    r = client.responses.create(model="m", input="Turn on the kitchen light.", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "set_light", f"responses call: {r}")
    jsonschema.validate(json.loads(calls[0].arguments), tools[0]["parameters"])
    back = client.responses.create(model="m", previous_response_id=r.id, tools=tools, max_output_tokens=N,
                                   temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                          "output": "done"}])
    check(back.status in ("completed", "incomplete") and back.output, f"responses after call: {back}")


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def embedding_checks(golden_path):
    """openai's embeddings.create (base64, its default, and float; token arrays; dimensions) and
    ollama's embed and embeddings, each vector within cosine 0.9999 of llama-embedding's."""
    with open(golden_path) as f:
        golden = json.load(f)
    texts, want, ids = golden["inputs"], golden["vectors"], golden["ids"]
    # Inputs pinfer tokenizes as llama.cpp does (its WordPiece splits Hangul otherwise; HF
    # tokenizers is the reference there, tests/golden/tokenizer-wpm): their vectors must agree.
    mine = [json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{URL}/tokenize", data=json.dumps({"content": t, "add_special": True}).encode(),
        headers={"Content-Type": "application/json"})).read())["tokens"] for t in texts]
    same = [i for i in range(len(texts)) if mine[i] == ids[i]]
    check(len(same) >= len(texts) - 2, f"tokenized as llama.cpp: {len(same)} of {len(texts)}")
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="none")
    for fmt in (openai.omit, "float"):
        got = client.embeddings.create(model="minilm", input=texts, encoding_format=fmt)
        check(len(got.data) == len(texts) and [d.index for d in got.data] == list(range(len(texts))),
              f"openai embeddings: one per input, in order ({fmt})")
        check(got.usage.prompt_tokens == sum(map(len, mine)), f"openai usage: {got.usage}")
        for i in same:
            c = cosine(got.data[i].embedding, want[i])
            check(c >= 0.9999, f"openai embeddings ({fmt}) input {i}: cosine {c} to llama-embedding's")
    by_ids = client.embeddings.create(model="minilm", input=ids[:3])
    check(all(cosine(d.embedding, want[i]) >= 0.9999 for i, d in enumerate(by_ids.data)), "token-array inputs")
    short = client.embeddings.create(model="minilm", input=texts[0], dimensions=128, encoding_format="float")
    v = short.data[0].embedding
    check(len(v) == 128 and abs(sum(x * x for x in v) - 1) < 1e-4, "dimensions 128: cut and normalised")
    try:
        client.embeddings.create(model="minilm", input="", encoding_format="float")
        check(False, "an empty input is refused")
    except openai.BadRequestError as e:
        check("Input content cannot be empty" in str(e), f"empty input: {e}")
    oc = ollama.Client(host=URL)
    got = oc.embed(model="minilm", input=texts[:10])
    check(len(got.embeddings) == 10 and got.prompt_eval_count == sum(map(len, mine[:10])), f"ollama embed: {got}")
    for i in (i for i in same if i < 10):
        c = cosine(got.embeddings[i], want[i])
        check(c >= 0.9999, f"ollama embed input {i}: cosine {c}")
    one = oc.embed(model="minilm", input=texts[0], dimensions=64, truncate=True, keep_alive="5m")
    check(len(one.embeddings) == 1 and len(one.embeddings[0]) == 64, "ollama embed dimensions 64")
    old = oc.embeddings(model="minilm", prompt=texts[same[1]])
    c = cosine(old.embedding, want[same[1]])
    check(c >= 0.9999, f"ollama embeddings: cosine {c}")
    try:
        oc.embed(model="minilm", input=[])
        check(False, "an empty input array is refused")
    except ollama.ResponseError as e:
        check(e.status_code == 400, f"ollama empty input: {e}")


def main():
    if EMBEDDING:
        embedding_checks(ARGS[1])
        print("serve_clients: ok")
        return
    text = openai_checks()
    responses_checks(text)
    ollama_checks(text)
    anthropic_checks(text)
    structured_checks()
    print("serve_clients: ok")


if __name__ == "__main__":
    main()
