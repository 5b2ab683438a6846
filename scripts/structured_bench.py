#!/usr/bin/env python3
"""Structured output at scale: 50 JSON schemas x prompts x greedy and sampled, through a running
`pinfer serve` (OpenAI `response_format`), every output checked with Python's `jsonschema`.

    pinfer serve -m MODEL --port 8080 -c 4096 &
    scripts/structured_bench.py http://127.0.0.1:8080 [--prompts 5] [--max-tokens 256]

Prints the share of valid outputs per sampling mode, the failures, and the mean tokens per output.
Exit status 1 when any output is invalid.
"""
import argparse
import json
import sys
import urllib.request

import jsonschema

S = {"type": "string"}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props, required=None, **extra):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **extra}


def schemas():
    """50 schemas: flat and nested objects, arrays with items and bounds, enums and consts,
    optional properties, $ref within the document, patterns and lengths, anyOf, numbers with
    bounds: what automation asks a small model for."""
    out = [
        obj({"name": S, "age": I}),
        obj({"device": {"enum": ["light", "fan", "heater", "blinds"]}, "room": S, "on": B}),
        obj({"city": S, "temperature_c": N, "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}}),
        obj({"title": S, "year": {"type": "integer", "minimum": 1800, "maximum": 2100}}),
        obj({"items": {"type": "array", "items": S, "minItems": 1, "maxItems": 5}}),
        obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
        obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "event": S}),
        obj({"email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}}),
        obj({"summary": {"type": "string", "maxLength": 80}, "keywords": {"type": "array", "items": S, "maxItems": 4}}),
        obj({"person": obj({"first": S, "last": S}), "role": S}),
        obj({"order": obj({"id": I, "lines": {"type": "array", "items": obj({"sku": S, "qty": I}), "minItems": 1}})}),
        obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
        obj({"status": {"const": "ok"}, "code": I}),
        obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}),
        obj({"name": S, "nickname": S}, required=["name"]),
        obj({"value": {"anyOf": [I, {"type": "null"}]}, "unit": S}),
        obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 3}, "maxItems": 3}}),
        {"$defs": {"pt": obj({"x": N, "y": N})}, **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
        obj({"intent": {"enum": ["play_music", "set_timer", "weather", "lights"]}, "slots": obj({"value": S}, required=[])}),
        obj({"timer": obj({"minutes": {"type": "integer", "minimum": 0, "maximum": 120}, "label": S})}),
        obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": N}),
        obj({"language": {"type": "string", "pattern": "^[a-z]{2}$"}, "text": S}),
        obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}}),
        obj({"ok": B}),
        obj({"steps": {"type": "array", "items": obj({"n": I, "action": S}), "maxItems": 6}}),
        obj({"product": S, "price": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]}}),
        obj({"question": S, "options": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}, "correct": I}),
        obj({"phone": {"type": "string", "pattern": "^\\+?[0-9 ]{6,15}$"}}),
        obj({"meta": obj({"version": I, "author": S}), "body": S}),
        obj({"scene": {"enum": ["movie", "dinner", "away", "night"]}, "dim": {"type": "integer", "minimum": 0, "maximum": 100}}),
        obj({"ids": {"type": "array", "items": I, "uniqueItems": False, "maxItems": 8}}),
        obj({"a": obj({"b": obj({"c": obj({"d": S})})})}),
        obj({"first": S, "second": S, "third": S}),
        obj({"count": {"type": "integer", "minimum": 1, "maximum": 10}}),
        obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
        obj({"list": {"type": "array", "items": {"anyOf": [S, I]}, "maxItems": 5}}),
        obj({"room": S, "devices": {"type": "array", "items": obj({"name": S, "on": B}), "maxItems": 4}}),
        obj({"task": S, "priority": {"enum": ["low", "medium", "high"]}, "due": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
        obj({"reply": {"type": "string", "minLength": 1, "maxLength": 120}}),
        obj({"x": I, "y": I, "z": I}),
        obj({"recipe": S, "ingredients": {"type": "array", "items": obj({"item": S, "grams": N}), "maxItems": 6}}),
        obj({"valid": B, "errors": {"type": "array", "items": S, "maxItems": 3}}),
        obj({"from": S, "to": S, "subject": {"type": "string", "maxLength": 60}}),
        obj({"celsius": N, "fahrenheit": N}),
        obj({"word": S, "definition": S, "synonyms": {"type": "array", "items": S, "maxItems": 3}}),
        obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}}),
        obj({"mode": {"enum": ["heat", "cool", "auto", "off"]}, "target": {"type": "number", "minimum": 10, "maximum": 30}}),
        obj({"user": obj({"name": S, "email": S}, required=["name"]), "admin": B}),
        obj({"score": {"type": "integer", "minimum": 0, "maximum": 10}, "comment": {"type": "string", "maxLength": 100}}),
        obj({"results": {"type": "array", "items": obj({"title": S, "url": S}), "minItems": 1, "maxItems": 3}}),
    ]
    assert len(out) == 50, len(out)
    return out


PROMPTS = [
    "Fill in the JSON for this request with plausible values.",
    "Describe a dragon as JSON, with as many details as you can.",
    "Turn on the kitchen light and set a timer for ten minutes. Reply as JSON.",
    "Give me the weather in Paris as JSON.",
    "Write a very long JSON document about the history of computers.",
]


def chat(url, messages, schema, temperature, max_tokens, seed):
    body = {"messages": messages, "temperature": temperature, "max_tokens": max_tokens, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        v = json.load(r)
    return v["choices"][0]["message"]["content"], v["usage"]["completion_tokens"], v["choices"][0]["finish_reason"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    failures = []
    for mode, temperature in [("greedy", 0.0), ("sampled", 0.8)]:
        valid = total = tokens = 0
        for i, schema in enumerate(schemas()):
            for j, prompt in enumerate(PROMPTS[: a.prompts]):
                text, n, finish = chat(a.url, [{"role": "user", "content": prompt}], schema, temperature,
                                       a.max_tokens, 1000 + 7 * i + j)
                total += 1
                tokens += n
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except Exception as e:  # noqa: BLE001 (any failure is a finding)
                    failures.append((mode, i, j, finish, str(e).splitlines()[0][:120], text[:200]))
        print(f"{mode}: {valid}/{total} valid ({100.0 * valid / total:.1f}%), {tokens / total:.1f} tokens per output")
    for f in failures:
        print("INVALID", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
