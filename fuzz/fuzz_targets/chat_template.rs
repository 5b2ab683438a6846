//! Fuzzes pinfer's Jinja chat templates (`pinfer::jinja`, with its fuel, recursion and output
//! limits): an input is a template's source, a 0xFF byte, then a conversation as JSON (the
//! messages, or an object with `messages`, `tools`, `add_generation_prompt` and template keyword
//! arguments); a conversation that is not JSON renders one of a few fixed ones. The template is
//! compiled and, if it compiles, rendered: a refusal is fine, a panic, a sanitizer report, an
//! allocation over the limit or a render over the time limit is a finding. Seeds: llama.cpp's
//! 70 templates with a conversation each (scripts/fuzz.sh writes them).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinfer::jinja::{Clock, Conversation, JinjaTemplate};
use serde_json::{json, Value};

/// Conversations for inputs whose second part is not JSON, chosen by its length.
fn fixed(n: usize) -> Value {
    match n % 4 {
        0 => json!({ "messages": [{"role": "user", "content": "Hi"}] }),
        1 => json!({ "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris? 東京 👍"},
            {"role": "assistant", "content": null, "reasoning_content": "look it up",
             "tool_calls": [{"id": "abc123def", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "enable_thinking": false }),
        2 => {
            json!({ "messages": [{"role": "assistant", "content": "prefill"}], "add_generation_prompt": false })
        }
        _ => json!({ "messages": [] }),
    }
}

fuzz_target!(|data: &[u8]| {
    let (source, rest) = match data.iter().position(|&b| b == 0xFF) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(source) = std::str::from_utf8(source) else { return };
    let Ok(template) = JinjaTemplate::compile(source, "<s>", "</s>") else { return };
    let mut request = serde_json::from_slice::<Value>(rest).unwrap_or_else(|_| fixed(rest.len()));
    if request.is_array() {
        request = json!({ "messages": request });
    }
    let Some(fields) = request.as_object() else { return };
    let messages = fields.get("messages").cloned().unwrap_or(Value::Null);
    let tools = fields.get("tools").cloned();
    let add_generation_prompt = fields.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
    let mut kwargs = fields.clone();
    for key in ["messages", "tools", "add_generation_prompt"] {
        kwargs.remove(key);
    }
    let conversation = Conversation {
        messages: &messages,
        tools: tools.as_ref(),
        documents: None,
        add_generation_prompt,
        kwargs: Some(&kwargs),
    };
    if let Ok(text) = template.render_at(&conversation, Clock { unix_seconds: 1_768_469_400 }) {
        assert!(text.len() <= pinfer::jinja::MAX_OUTPUT, "a render over the output limit");
    }
});
