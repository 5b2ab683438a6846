#!/usr/bin/env python3
"""Reference renderings of real chat templates, for tests/chat_jinja.rs.

Renders every `*.jinja` in TEMPLATES (llama.cpp's models/templates, fetched by
scripts/tokenizer_fetch_vocabs.sh into target/tokenizer-vocabs/templates) against the conversations
below with Python's jinja2 set up as transformers' `apply_chat_template` sets it up
(transformers/utils/chat_template_utils.py):

- `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop controls
  extension and a `{% generation %}` block that renders its body;
- `tojson` as `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
  sort_keys=sort_keys)`;
- globals `raise_exception(message)` (a TemplateError) and `strftime_now(format)`;
- render variables `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
  and the caller's keyword arguments (`enable_thinking`, ...).

The clock is fixed (2026-01-15 09:30:00) so that templates printing today's date render the same
every time; the Rust side takes the same instant in its tests.

Writes OUT/conversations.json (the cases' names and render variables, which the Rust test reads)
and OUT/<template name>.json: {"template": file name, "cases": [{"name", "text"} or
{"name", "error", "raised"}]}, where `raised` is true when the template itself called
raise_exception (the message is then the template's own and must match) and false for any other
failure (the Rust side must fail too; its message may differ).

    python3 scripts/chat_template_goldens.py TEMPLATES OUT
"""

import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = datetime.datetime(2026, 1, 15, 9, 30, 0)
BOS, EOS = "<|bos|>", "<|eos|>"


class Raised(Exception):
    pass


class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' AssistantTracker
    also records where it was; rendering is the same)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise Raised(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return env


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": []},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
HELLO = {"role": "user", "content": "Hello! Who are you?"}
ANSWER = {"role": "assistant", "content": "I am an assistant. How can I help?"}
FOLLOW = {"role": "user", "content": "Tell me a joke."}

# (name, render variables), written beside the renderings (OUT/conversations.json) so the Rust test
# renders exactly these.
CASES = [
    ("single", {"messages": [HELLO], "add_generation_prompt": True}),
    ("system", {"messages": [SYSTEM, HELLO], "add_generation_prompt": True}),
    ("multi_turn", {"messages": [SYSTEM, HELLO, ANSWER, FOLLOW], "add_generation_prompt": True}),
    ("no_generation_prompt", {"messages": [HELLO, ANSWER], "add_generation_prompt": False}),
    (
        "prefill",
        {"messages": [HELLO, {"role": "assistant", "content": "I am"}], "add_generation_prompt": False},
    ),
    (
        "unicode",
        {
            "messages": [{"role": "user", "content": "Grüße, 世界 🌍 — \"quotes\", <tags> & 'apostrophes'\n\tend"}],
            "add_generation_prompt": True,
        },
    ),
    (
        "tools",
        {
            "messages": [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL, TIME_TOOL],
            "add_generation_prompt": True,
        },
    ),
    (
        "tool_round_trip",
        {
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp_c\": 18}"},
            ],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
        },
    ),
    (
        "reasoning_history",
        {
            "messages": [
                HELLO,
                {"role": "assistant", "content": "I am an assistant.", "reasoning_content": "The user greets me."},
                FOLLOW,
            ],
            "add_generation_prompt": True,
        },
    ),
    ("thinking_off", {"messages": [HELLO], "add_generation_prompt": True, "enable_thinking": False}),
    ("thinking_on", {"messages": [HELLO], "add_generation_prompt": True, "enable_thinking": True}),
]


def render(env, source, variables):
    template = env.from_string(source)
    full = {"tools": None, "documents": None, "bos_token": BOS, "eos_token": EOS}
    full.update(variables)
    return template.render(**full)


def main():
    templates, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    conversations = [{"name": n, "variables": v} for n, v in CASES]
    (out / "conversations.json").write_text(json.dumps(conversations, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for path in sorted(templates.glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        cases = []
        for name, variables in CASES:
            try:
                cases.append({"name": name, "text": render(env, source, variables)})
            except Raised as e:
                cases.append({"name": name, "error": str(e), "raised": True})
            except Exception as e:  # noqa: BLE001 - any other failure is recorded as such
                cases.append({"name": name, "error": f"{type(e).__name__}: {e}", "raised": False})
        doc = {"template": path.name, "cases": cases}
        (out / (path.stem + ".json")).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(list(templates.glob('*.jinja')))} templates x {len(CASES)} cases into {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
