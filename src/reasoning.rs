//! A thinking model's reasoning split out of its reply, as llama-server's `--reasoning-format
//! deepseek` splits it: text between the family's markers at the start of the reply
//! (`<think>`...`</think>`: Qwen3, DeepSeek R1 and its distills, SmolLM3, Granite; `<seed:think>`:
//! Seed-OSS; `<|START_THINKING|>`: Command R7B; `<|channel|>analysis<|message|>`...`<|end|>`:
//! gpt-oss; `[THINK]`: Magistral and Ministral reasoning models) is the reasoning, the rest the
//! answer. A template that opens the thinking itself (its generation prompt ends with the opening
//! marker) starts the reply inside it. Markers later in the answer are the answer's text. A reply
//! cut inside the reasoning (a token limit) is all reasoning and an empty answer.
//!
//! [`Splitter`] works on a stream of pieces: text that may still turn out to be (part of) a
//! marker is held back until it is known, so no marker ever reaches either side.

use std::string::String;

/// A family's opening and closing markers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Markers {
    /// Opens the reasoning.
    pub open: &'static str,
    /// Closes it.
    pub close: &'static str,
}

/// Every family's markers, the most specific first (a template holding `<seed:think>` also
/// holds `think>`).
pub const MARKERS: [Markers; 5] = [
    Markers { open: "<|channel|>analysis<|message|>", close: "<|end|>" },
    Markers { open: "<seed:think>", close: "</seed:think>" },
    Markers { open: "<|START_THINKING|>", close: "<|END_THINKING|>" },
    Markers { open: "[THINK]", close: "[/THINK]" },
    Markers { open: "<think>", close: "</think>" },
];

impl Markers {
    /// The markers a chat template teaches its model, if it teaches any.
    pub fn of_template(source: &str) -> Option<Self> {
        MARKERS.into_iter().find(|m| source.contains(m.open) && source.contains(m.close))
    }

    /// Whether a rendered prompt leaves the reply inside the reasoning (the template wrote the
    /// opening marker as the last thing of its generation prompt).
    pub fn opened_by(self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.open)
    }
}

/// What one step of the split gives each side.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Piece {
    /// New reasoning text.
    pub reasoning: String,
    /// New answer text.
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// At the start of the reply: an opening marker may come (after whitespace).
    Start,
    /// In the reasoning.
    Reasoning,
    /// Just after the closing marker: whitespace before the answer is dropped.
    Closed,
    /// In the answer.
    Answer,
}

/// Splits a streamed reply into reasoning and answer.
#[derive(Clone, Debug)]
pub struct Splitter {
    markers: Markers,
    phase: Phase,
    held: String,
}

impl Splitter {
    /// A splitter for a reply with `markers`; `opened` when the prompt already opened the
    /// reasoning ([`Markers::opened_by`]).
    pub fn new(markers: Markers, opened: bool) -> Self {
        Self { markers, phase: if opened { Phase::Reasoning } else { Phase::Start }, held: String::new() }
    }

    /// Takes the next piece of the reply and gives what is known of each side.
    pub fn push(&mut self, text: &str) -> Piece {
        self.held.push_str(text);
        let mut out = Piece::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let rest = self.held.trim_start();
                    if let Some(after) = rest.strip_prefix(self.markers.open) {
                        self.held = after.into();
                        self.phase = Phase::Reasoning;
                    } else if self.markers.open.starts_with(rest) {
                        return out; // still possibly the marker
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Reasoning => match self.held.find(self.markers.close) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + self.markers.close.len()..].into();
                        self.phase = Phase::Closed;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, self.markers.close);
                        let cut = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                Phase::Closed => {
                    let rest = self.held.trim_start();
                    if rest.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = rest.into();
                    self.phase = Phase::Answer;
                }
                Phase::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The end of the reply: what was held back goes to its side.
    pub fn finish(&mut self) -> Piece {
        let held = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Reasoning => Piece { reasoning: held, content: String::new() },
            Phase::Start | Phase::Answer => Piece { reasoning: String::new(), content: held },
            Phase::Closed => Piece::default(),
        }
    }
}

/// A whole reply split: the reasoning (None when there was none; trimmed) and the answer.
pub fn split(markers: Markers, opened: bool, text: &str) -> (Option<String>, String) {
    let mut s = Splitter::new(markers, opened);
    let (a, b) = (s.push(text), s.finish());
    let reasoning = a.reasoning + &b.reasoning;
    let content = a.content + &b.content;
    let had = opened || text.trim_start().starts_with(markers.open);
    (had.then(|| reasoning.trim().into()), content)
}

/// The length of the longest end of `text` that is a beginning of `marker` (held back: the
/// marker may be completed by the next piece).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    const THINK: Markers = MARKERS[4];

    /// Every way of cutting the reply into pieces gives the same two sides as the whole.
    fn streamed(opened: bool, text: &str) -> (String, String) {
        let whole = {
            let mut s = Splitter::new(THINK, opened);
            let (a, b) = (s.push(text), s.finish());
            (a.reasoning + &b.reasoning, a.content + &b.content)
        };
        let chars: Vec<char> = text.chars().collect();
        for size in 1..=4 {
            let mut s = Splitter::new(THINK, opened);
            let (mut r, mut c) = (String::new(), String::new());
            for piece in chars.chunks(size) {
                let p = s.push(&piece.iter().collect::<String>());
                r += &p.reasoning;
                c += &p.content;
            }
            let p = s.finish();
            assert_eq!((r + &p.reasoning, c + &p.content), whole, "pieces of {size} chars: {text:?}");
        }
        whole
    }

    #[test]
    fn reasoning_at_the_start_is_split_out_in_any_pieces() {
        assert_eq!(
            streamed(false, "<think>\nWhy?\n</think>\n\nBecause."),
            ("\nWhy?\n".into(), "Because.".into())
        );
        assert_eq!(streamed(false, "  <think>a</think>b"), ("a".into(), "b".into()));
        // A template that opened the reasoning: the reply starts inside it.
        assert_eq!(streamed(true, "plan</think>answer"), ("plan".into(), "answer".into()));
        // Markers later in the answer, or text that only begins like one, are answer text.
        assert_eq!(streamed(false, "Use <think> tags"), (String::new(), "Use <think> tags".into()));
        assert_eq!(streamed(false, "<thin"), (String::new(), "<thin".into()));
        assert_eq!(streamed(false, "<b>bold</b>"), (String::new(), "<b>bold</b>".into()));
        // Cut inside the reasoning: all of it is reasoning, a partial close included.
        assert_eq!(streamed(false, "<think>still going</thi"), ("still going</thi".into(), String::new()));
        assert_eq!(streamed(false, "<think>é</think>ü"), ("é".into(), "ü".into()));
    }

    #[test]
    fn whole_replies() {
        assert_eq!(split(THINK, false, "<think>\n x \n</think>\n\nA"), (Some("x".into()), "A".into()));
        assert_eq!(split(THINK, false, "A"), (None, "A".into()));
        assert_eq!(split(THINK, true, "r</think>A"), (Some("r".into()), "A".into()));
        assert_eq!(Markers::of_template("{{ '<think>\\n' }}...</think>"), Some(THINK));
        assert_eq!(Markers::of_template("<seed:think></seed:think>"), Some(MARKERS[1]));
        assert_eq!(Markers::of_template("<|im_start|>"), None);
        assert!(THINK.opened_by("<|im_start|>assistant\n<think>\n"));
    }
}
