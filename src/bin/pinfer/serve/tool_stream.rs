//! A reply with tools, streamed: the text before a call goes out as it comes, each call once it
//! is known (its name and id, then its arguments), as llama-server streams `tool_calls` deltas.
//!
//! The reply's text is what [`tools::parse_reply`] makes of it, so the stream never says
//! otherwise than the whole reply: text is sent only up to where a call may start (the family's
//! call markers, or a part of one at the end; Llama 3's and the generic JSON calls at a leading
//! `{`), with the whitespace at its ends held back (the whole reply's text is trimmed); a call is
//! sent once the next call's marker shows it is complete, the rest when the reply ends (so a
//! call's arguments go out in one piece, not as the model writes them). Should the calls turn out
//! not to parse when the reply ends, the held-back text goes out as text (as the whole reply's
//! text is then the reply); calls already sent stay sent.

use super::tools::{self, Call, ToolFormat, Tools};

/// What the stream sends next.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// More of the reply's text.
    Content(String),
    /// Call number `index`, whole (sent as a name delta, then its arguments).
    Call { index: usize, call: Call },
}

/// The state of one streamed reply.
pub struct ToolStream {
    tools: Tools,
    text: String,
    /// The text sent so far.
    sent: String,
    /// Calls sent so far.
    calls: usize,
    /// Call markers seen so far (a call is complete when the next marker shows).
    markers: usize,
}

impl ToolStream {
    pub fn new(tools: Tools) -> Self {
        Self { tools, text: String::new(), sent: String::new(), calls: 0, markers: 0 }
    }

    /// The deltas `piece` of the reply makes known.
    pub fn push(&mut self, piece: &str) -> Vec<Delta> {
        self.text.push_str(piece);
        let mut out = Vec::new();
        if self.calls == 0 {
            let settled = settled_text(self.tools.format, &self.text);
            if let Some(more) = settled.strip_prefix(self.sent.as_str()).filter(|m| !m.is_empty()) {
                out.push(Delta::Content(more.to_string()));
                self.sent = settled.to_string();
            }
        }
        // A new marker: the calls before it are complete.
        let starts = marker_starts(self.tools.format, &self.text);
        if starts.len() > self.markers {
            self.markers = starts.len();
            if let Some(&last) = starts.last() {
                let (_, calls) = tools::parse_reply(&self.tools, &self.text[..last]);
                out.extend(self.new_calls(calls));
            }
        }
        out
    }

    /// The deltas the end of the reply makes known, and the whole reply's text and calls.
    pub fn finish(mut self) -> (Vec<Delta>, String, Vec<Call>) {
        let (text, calls) = tools::parse_reply(&self.tools, &self.text);
        let mut out = Vec::new();
        // (The sent text is always the start of the whole text, unless the calls turned out
        // not to parse, when the held-back rest is text after all.)
        if let Some(more) = text.strip_prefix(self.sent.as_str()).filter(|m| !m.is_empty()) {
            out.push(Delta::Content(more.to_string()));
        }
        out.extend(self.new_calls(calls.clone()));
        (out, text, calls)
    }

    fn new_calls(&mut self, calls: Vec<Call>) -> Vec<Delta> {
        let start = self.calls;
        self.calls = self.calls.max(calls.len());
        calls.into_iter().enumerate().skip(start).map(|(index, call)| Delta::Call { index, call }).collect()
    }
}

/// The byte offsets in `text` where a call marker starts.
fn marker_starts(format: ToolFormat, text: &str) -> Vec<usize> {
    let mut starts: Vec<usize> =
        format.call_markers().iter().flat_map(|m| text.match_indices(m).map(|(i, _)| i)).collect();
    starts.sort_unstable();
    starts
}

/// The start of the reply's text that no more of the reply can change.
fn settled_text(format: ToolFormat, text: &str) -> &str {
    if format == ToolFormat::Harmony {
        // gpt-oss's answer is the final channel's message, up to its end marker.
        const FINAL: &str = "<|channel|>final<|message|>";
        let t = text.trim_start();
        let t = t.strip_prefix("<|start|>assistant").unwrap_or(t);
        let Some(body) = t.strip_prefix(FINAL) else { return "" };
        let body = &body[..body.find("<|").unwrap_or(body.len())];
        return body.strip_suffix('<').unwrap_or(body).trim();
    }
    let mut end = text.len();
    for m in format.call_markers() {
        if let Some(at) = text.find(m) {
            end = end.min(at);
        }
        // A marker's start at the end of the text may be one yet.
        for k in (1..m.len()).rev() {
            if m.is_char_boundary(k) && text.ends_with(&m[..k]) {
                end = end.min(text.len() - k);
                break;
            }
        }
    }
    let mut settled = &text[..end];
    match format {
        // A reply that starts with `{` may be a call (all of it, or nothing).
        ToolFormat::Llama3 | ToolFormat::Generic
            if settled.trim_start().starts_with('{') || settled.trim().is_empty() =>
        {
            return ""
        }
        // Functionary v3.2's text follows `all\n`; any other recipient is a call.
        ToolFormat::FunctionaryV32 => match settled.split_once('\n') {
            Some(("all", rest)) => settled = rest,
            _ => return "",
        },
        // Command R7B's text is inside `<|START_RESPONSE|>`.
        ToolFormat::CommandR => {
            const OPEN: &str = "<|START_RESPONSE|>";
            match settled.strip_prefix(OPEN) {
                Some(rest) => settled = rest,
                None if OPEN.starts_with(settled.trim()) => return "",
                None => {}
            }
        }
        _ => {}
    }
    settled.trim()
}
