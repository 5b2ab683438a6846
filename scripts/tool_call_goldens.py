#!/usr/bin/env python3
"""Golden tool-call replies per tool family, parsed by llama.cpp, for tests/chat_tool_calls.rs.

For each family below: replies written in that family's own call syntax (one call, parallel calls,
text before a call, unicode and nested arguments, reasoning before a call where the template
thinks), parsed by llama.cpp's `common/chat` (scripts/llama_chat_parse.cpp: the template's format
detected with the tools present, then common_chat_parse of the whole reply). Writes
OUT/<family>.json: {"family", "template", "tools", "cases": [{"name", "reply", "llama_cpp":
{"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}}]}.

    python3 scripts/tool_call_goldens.py [TEMPLATES [OUT]]

TEMPLATES defaults to target/tokenizer-vocabs/templates (llama.cpp's models/templates), OUT to
tests/golden/tool-calls. Needs llama.cpp's build (scripts/llama_chat_parse.sh builds the parser);
the goldens are committed, so tests never need llama.cpp.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target/tokenizer-vocabs/templates"
OUT = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests/golden/tool-calls"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "save_note",
            "description": "Save a note with tags and options",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object"},
                },
                "required": ["text"],
            },
        },
    },
]

PARIS = ("get_weather", {"city": "Paris"})
TOKYO = ("get_weather", {"city": "Tokyo", "days": 3})
NOTE = (
    "save_note",
    {"text": "Café — 東京 👍 \"quoted\"", "tags": ["naïve", "日本"], "options": {"pin": True, "level": {"n": 2}}},
)
TEXT = "Let me check the weather."
THOUGHT = "The user wants Paris's weather; I call the tool."


def dumps(v):
    return json.dumps(v, ensure_ascii=False)


def py(v):
    """A value as Python source (LFM2 writes Python calls)."""
    if isinstance(v, bool):
        return "True" if v else "False"
    if v is None:
        return "None"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" if '"' in v else dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{dumps(k)}: {py(x)}" for k, x in v.items()) + "}"
    return dumps(v)


def hermes(calls):
    return "\n".join(f'<tool_call>\n{dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


def qwen_xml(calls):
    def param(k, v):
        return f"<parameter={k}>\n{v if isinstance(v, str) else dumps(v)}\n</parameter>\n"

    return "\n".join(
        f"<tool_call>\n<function={n}>\n" + "".join(param(k, v) for k, v in a.items()) + "</function>\n</tool_call>"
        for n, a in calls
    )


def llama3(calls):
    return "\n".join(dumps({"name": n, "parameters": a}) for n, a in calls)


def python_tag(calls):
    return "".join("<|python_tag|>" + dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral_array(calls):
    ids = ["abc123def", "xyz789uvw", "qrs456tuv"]
    return "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a, "id": i} for (n, a), i in zip(calls, ids)])


def mistral_args(calls):
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a)}" for n, a in calls)


def granite(calls):
    return "<|tool_call|>" + dumps([{"name": n, "arguments": a} for n, a in calls])


def pythonic(calls):
    body = ", ".join(f"{n}(" + ", ".join(f"{k}={py(v)}" for k, v in a.items()) + ")" for n, a in calls)
    return f"<|tool_call_start|>[{body}]<|tool_call_end|>"


def command_r(calls):
    items = ",\n".join(
        "    " + dumps({"tool_call_id": str(i), "tool_name": n, "parameters": a}) for i, (n, a) in enumerate(calls)
    )
    return f"<|START_ACTION|>[\n{items}\n]<|END_ACTION|>"


def functionary_v31(calls):
    return "".join(f"<function={n}>{dumps(a)}</function>" for n, a in calls)


def functionary_v32(calls):
    # The generation prompt ends with ">>>": the first recipient follows it directly.
    return ">>>".join(f"{n}\n{dumps(a)}" for n, a in calls)


def deepseek_r1(calls):
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{dumps(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def mistral_call_id(calls):
    ids = ["abc123def", "xyz789uvw"]
    return "".join(f"[TOOL_CALLS]{n}[CALL_ID]{i}[ARGS]{dumps(a)}" for (n, a), i in zip(calls, ids))


def harmony(calls):
    # The generation prompt ends with "<|start|>assistant": the first message's channel follows.
    return "<|start|>assistant".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{dumps(a)}<|call|>" for n, a in calls
    )


def generic(calls):
    return dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def think(t):
    return f"<think>\n{t}\n</think>\n\n"


# Where pinfer's reading differs from llama.cpp's on purpose (llama.cpp's is plainly short of the
# template's own syntax there): family -> case -> why. Every other case must match llama.cpp's.
NO_CALLS_LEARNT = (
    "llama.cpp's parser, learnt from how the template renders an assistant's tool calls, finds "
    "no calls here although the template's system prompt teaches this syntax; pinfer parses it"
)
GENERIC = (
    "llama.cpp has no generic JSON reply format any more; pinfer asks a template without a call "
    "syntax for {\"tool_calls\": [...]} and parses it"
)
DIFFERS = {
    "granite-3.3": {c: NO_CALLS_LEARNT for c in ("one_call", "parallel_calls", "unicode_nested", "text_before_call")},
    "smollm3": {c: GENERIC for c in ("one_call", "parallel_calls", "unicode_nested", "reasoning_and_call")},
    "generic": {c: GENERIC for c in ("one_call", "parallel_calls", "unicode_nested")},
    "llama3.1-python-tag": {
        c: "llama.cpp leaves the <|python_tag|> marker in content; pinfer never puts a marker in content"
        for c in ("one_call", "unicode_nested", "text_before_call")
    },
    "gpt-oss": {
        "parallel_calls": "llama.cpp keeps the first of two harmony calls and drops the second "
        "(each a commentary message to=functions.NAME); pinfer keeps both",
    },
    "functionary-v3.2": {
        "text_before_call": "llama.cpp keeps '>>>get_weather\\n{...}' after text as content; the template "
        "writes a call after text exactly so (>>>all\\ntext>>>name\\nargs), and pinfer parses it",
    },
}


# The ids a family's calls carry (in the order its writer above gives them).
IDS = {
    "mistral-nemo": ["abc123def", "xyz789uvw"],
    "mistral-small-3.2": ["abc123def", "xyz789uvw"],
    "command-r7b": ["0", "1"],
}


def expect(family, before, thought, calls):
    """The reading of a reply: its text, reasoning and calls (arguments as JSON values, ids when
    the family writes them)."""
    out = []
    for i, (n, a) in enumerate(calls):
        out.append({"name": n, "arguments": a})
        if family in IDS:
            out[-1]["id"] = IDS[family][i]
    return {"content": before or "", "reasoning_content": thought or "", "tool_calls": out}


# family, template, calls -> text, text before a call (None: the family writes none), reasoning
# (None: the template does not think), a reply without calls, how every reply starts.
FAMILIES = [
    ("hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", hermes, TEXT + "\n", None),
    ("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", hermes, TEXT + "\n", None),
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", hermes, TEXT + "\n", think),
    ("qwen3-coder", "Qwen3-Coder.jinja", qwen_xml, TEXT + "\n", None),
    ("llama3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", llama3, None, None),
    ("llama3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", llama3, None, None),
    ("llama3.3", "meta-llama-Llama-3.3-70B-Instruct.jinja", llama3, None, None),
    ("llama3.1-python-tag", "meta-llama-Llama-3.1-8B-Instruct.jinja", python_tag, TEXT, None),
    ("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", mistral_array, TEXT, None),
    ("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja", mistral_call_id, TEXT, None),
    ("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja", granite, TEXT, None),
    ("lfm2", "LFM2-8B-A1B.jinja", pythonic, TEXT, None),
    # (This SmolLM3 template writes no tools: the generic JSON reply, as for any such template.)
    ("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", generic, None, think),
    ("command-r7b", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", command_r, None,
     lambda t: f"<|START_THINKING|>{t}<|END_THINKING|>"),
    ("functionary-v3.1", "meetkai-functionary-medium-v3.1.jinja", functionary_v31, TEXT, None),
    ("functionary-v3.2", "meetkai-functionary-medium-v3.2.jinja", functionary_v32, "all\n" + TEXT + ">>>", None),
    ("deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", deepseek_r1, None,
     lambda t: f"{t}\n</think>\n\n"),
    ("gpt-oss", "openai-gpt-oss-120b.jinja", harmony, None,
     lambda t: f"<|channel|>analysis<|message|>{t}<|end|><|start|>assistant"),
    ("generic", "google-gemma-2-2b-it.jinja", generic, None, None),
]

# A reply without calls, per family whose plain text is not the reply as it is.
PLAIN = "It is sunny in Paris today."
NO_CALL = {
    "command-r7b": f"<|START_RESPONSE|>{PLAIN}<|END_RESPONSE|>",
    "functionary-v3.2": f"all\n{PLAIN}",
    "deepseek-r1": f"{THOUGHT}\n</think>\n\n{PLAIN}",
    "gpt-oss": f"<|channel|>final<|message|>{PLAIN}",
}
# Families whose template opens the reasoning in the generation prompt: every reply starts inside it.
OPENED = {"deepseek-r1"}


def cases(family, write, before, reason):
    lead = reason(THOUGHT) if family in OPENED else ""
    thought = THOUGHT if family in OPENED else None
    out = [
        ("one_call", lead + write([PARIS]), expect(family, None, thought, [PARIS])),
        ("parallel_calls", lead + write([PARIS, TOKYO]), expect(family, None, thought, [PARIS, TOKYO])),
        ("unicode_nested", lead + write([NOTE]), expect(family, None, thought, [NOTE])),
        ("no_call", NO_CALL.get(family, PLAIN), expect(family, PLAIN, thought, [])),
    ]
    if before is not None:
        out.append(("text_before_call", before + write([PARIS]), expect(family, TEXT, None, [PARIS])))
    if reason is not None and family not in OPENED:
        out.append(("reasoning_and_call", reason(THOUGHT) + write([PARIS]), expect(family, None, THOUGHT, [PARIS])))
    return out


def normal(parse):
    """llama.cpp's parse as compared: text trimmed (where a marker's separating newline goes is
    not part of the reading), arguments as JSON values, ids where the model wrote them (else
    the server issues its own)."""
    calls = []
    for c in parse["tool_calls"]:
        calls.append({"name": c["name"], "arguments": json.loads(c["arguments"])})
        if c["id"]:
            calls[-1]["id"] = c["id"]
    return {"content": parse["content"].strip(), "reasoning_content": parse["reasoning_content"].strip(), "tool_calls": calls}


def main():
    parser = subprocess.run([ROOT / "scripts/llama_chat_parse.sh"], check=True, capture_output=True, text=True)
    program = parser.stdout.strip()
    OUT.mkdir(parents=True, exist_ok=True)
    wrong = []
    for family, template, write, before, reason in FAMILIES:
        named = cases(family, write, before, reason)
        request = {"tools": TOOLS, "replies": [r for _, r, _ in named]}
        run = subprocess.run(
            [program, TEMPLATES / template], input=json.dumps(request), check=True, capture_output=True, text=True
        )
        parsed = json.loads(run.stdout)
        kept = []
        for (name, reply, want), got in zip(named, parsed["parses"]):
            if "error" in got:
                # (llama.cpp refuses the reply: e.g. parallel calls where its parser takes one.)
                print(f"  {family}/{name}: llama.cpp refuses it ({got['error']}); left out", file=sys.stderr)
                continue
            case = {"name": name, "reply": reply, "expect": want, "llama_cpp": got}
            why = DIFFERS.get(family, {}).get(name)
            if why and normal(got) == want:
                wrong.append(f"{family}/{name}: llama.cpp now reads it as written; drop it from DIFFERS")
            elif why:
                case["differs"] = why
            elif normal(got) != want:
                wrong.append(f"{family}/{name}: llama.cpp {normal(got)}, written {want}")
            kept.append(case)
        golden = {
            "family": family,
            "template": template,
            "llama_cpp_format": parsed["format"],
            "tools": TOOLS,
            "cases": kept,
        }
        (OUT / f"{family}.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
        print(f"{family}: {parsed['format']}, {len(kept)} cases", file=sys.stderr)
    if wrong:
        sys.exit("llama.cpp reads these otherwise than written (a new difference needs DIFFERS):\n" + "\n".join(wrong))


if __name__ == "__main__":
    main()
