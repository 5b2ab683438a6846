//! Chat prompt formats, chosen from the GGUF `tokenizer.chat_template` without running it.
//!
//! The template in a model file is Jinja. We never execute it: like llama.cpp's built-in (non-Jinja)
//! path, [`ChatTemplate::detect`] recognises the family from distinctive substrings, in the same
//! order as llama.cpp's `llm_chat_detect_template` (`src/llama-chat.cpp`), and
//! [`ChatTemplate::render`] produces exactly what llama.cpp's `llm_chat_apply_template` produces
//! for that family (checked against the expected strings of llama.cpp's
//! `tests/test-chat-template.cpp`).
//!
//! Families implemented (llama.cpp names): `chatml` (`<|im_start|>`: SmolLM2, Qwen2/2.5/3, ...),
//! `llama3` (`<|start_header_id|>`), `gemma` (`<start_of_turn>`: Gemma 1/2/3), `llama2`,
//! `llama2-sys`, `llama2-sys-bos`, `llama2-sys-strip`, `mistral-v1`, `mistral-v3`,
//! `mistral-v3-tekken`, `mistral-v7`, `mistral-v7-tekken`, `phi3`, `phi4`. A template that llama.cpp
//! maps to another family is refused naming that family; one nobody recognises is refused too.
//! Either way nothing is executed. The template text may also be one of the names above, as
//! llama.cpp accepts (a way to override a model's template).
//!
//! # No template
//!
//! A model without `tokenizer.chat_template` (`None`, or an empty string) gets ChatML, as in
//! llama.cpp (`llama_chat_apply_template` uses `"chatml"` for a null template, and
//! `common_chat_templates_init` falls back to ChatML for an empty one).
//!
//! # BOS and special tokens
//!
//! The rendered text never begins with a BOS token, for any family (llama.cpp's expected Llama 3
//! output starts at `<|start_header_id|>`, not `<|begin_of_text|>`). llama.cpp tokenizes the first
//! formatted prompt with `add_special = true`, so the *tokenizer* adds BOS when the model's
//! `tokenizer.ggml.add_bos_token` asks for it (Llama 3 `<|begin_of_text|>`, Gemma `<bos>`,
//! Llama 2 / Mistral `<s>`; SmolLM2 and Qwen say no), and with `parse_special = true`, so the markers
//! (`<|im_start|>`, ...) become their single special tokens. Follow-up turns are tokenized without
//! BOS. (`llama2-sys-bos` writes a literal `<s>` between turns; that is the template's own.)
//!
//! # Differences from running the Jinja template
//!
//! Those of llama.cpp's built-in formatter, which we reproduce: e.g. SmolLM2's Jinja template adds a
//! default system prompt when none is given, and Gemma's refuses a system message, whereas the
//! built-in ChatML adds nothing and the built-in Gemma merges the system text into the first user
//! turn. Roles are limited to system, user and assistant.
//!
//! Rendering writes into any `core::fmt::Write` (a `heapless::String`, a `String`, a counter) and
//! allocates nothing.

use core::fmt::{self, Write};

/// Who speaks a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Instructions for the assistant.
    System,
    /// The human.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role as templates spell it: `system`, `user`, `assistant`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: &'a str,
}

impl<'a> Message<'a> {
    /// A system message.
    pub fn system(content: &'a str) -> Self {
        Self { role: Role::System, content }
    }
    /// A user message.
    pub fn user(content: &'a str) -> Self {
        Self { role: Role::User, content }
    }
    /// An assistant message.
    pub fn assistant(content: &'a str) -> Self {
        Self { role: Role::Assistant, content }
    }
}

/// Why no chat format could be chosen, or rendering failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChatError {
    /// The template matches no family llama.cpp recognises.
    Unrecognized,
    /// llama.cpp recognises the template as `family`, which pinfer does not implement.
    Unsupported {
        /// llama.cpp's name for the family.
        family: &'static str,
    },
    /// The output writer refused the text (e.g. a fixed-capacity buffer is full).
    Write,
}

/// The names [`ChatTemplate::detect`] accepts, for error messages.
const SUPPORTED: &str = "chatml (<|im_start|>: Qwen, SmolLM2), llama3, gemma, llama2, llama2-sys, \
     llama2-sys-bos, llama2-sys-strip, mistral-v1, mistral-v3, mistral-v3-tekken, mistral-v7, \
     mistral-v7-tekken, phi3, phi4";

impl fmt::Display for ChatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unrecognized => write!(
                f,
                "chat template not recognised (pinfer never executes the Jinja template; it recognises \
                 the formats {SUPPORTED} by their markers); name one of them to choose the format"
            ),
            Self::Unsupported { family } => write!(
                f,
                "chat template recognised as llama.cpp's '{family}' format, which pinfer does not \
                 implement (it knows {SUPPORTED}); name one of them to choose another format"
            ),
            Self::Write => write!(f, "chat prompt does not fit the output buffer"),
        }
    }
}

impl core::error::Error for ChatError {}

impl From<fmt::Error> for ChatError {
    fn from(_: fmt::Error) -> Self {
        Self::Write
    }
}

/// A chat format, as llama.cpp's built-in formatter knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChatTemplate {
    /// `<|im_start|>role\ncontent<|im_end|>\n` (SmolLM2, Qwen2/2.5/3, OpenHermes...).
    ChatMl,
    /// Llama 3.x: `<|start_header_id|>role<|end_header_id|>\n\n` + trimmed content + `<|eot_id|>`.
    Llama3,
    /// Gemma: `<start_of_turn>user|model\n` ... `<end_of_turn>\n`; system text merged into the next
    /// user turn.
    Gemma,
    /// Gemma 4: `<|turn>system|user|model\n` + trimmed content + `<turn|>\n` (a first system
    /// message opens the prompt; a model turn's thinking, `<|channel>...<channel|>`, is dropped),
    /// and the generation prompt `<|turn>model\n<|channel>thought\n<channel|>` (thinking off: an
    /// empty thought channel), as the model's own Jinja template renders a conversation without
    /// tools. llama.cpp has no built-in for it; `gemma4` is pinfer's name.
    Gemma4,
    /// Llama 2 without system support (a system message becomes a plain first line).
    Llama2,
    /// Llama 2 with `<<SYS>>` system blocks.
    Llama2Sys,
    /// Llama 2 with `<<SYS>>`, and `<s>` before every later `[INST]`.
    Llama2SysBos,
    /// Llama 2 with `<<SYS>>`, every message trimmed.
    Llama2SysStrip,
    /// Mistral's "v1" (`' [INST] '` with spaces around).
    MistralV1,
    /// Mistral's "v3" (assistant messages trimmed).
    MistralV3,
    /// Mistral's "v3-tekken" (no spaces).
    MistralV3Tekken,
    /// Mistral's "v7" (`[SYSTEM_PROMPT]`).
    MistralV7,
    /// Mistral's "v7-tekken" (v7 without the spaces; chosen by name only, as in llama.cpp).
    MistralV7Tekken,
    /// Phi-3: `<|role|>\ncontent<|end|>\n`.
    Phi3,
    /// Phi-4: `<|im_start|>role<|im_sep|>content<|im_end|>`.
    Phi4,
    /// IBM Granite 3.x and 4.x: `<|start_of_role|>role<|end_of_role|>content<|end_of_text|>\n`
    /// (llama.cpp's granite-4.0/4.1 differ only in tool-call turns, which pinfer does not write).
    Granite,
    /// SmolVLM (idefics3): `<|im_start|>User: content<end_of_utterance>\nAssistant:`, the
    /// `<|im_start|>` written once at the start (a BOS, not ChatML).
    SmolVlm,
}

/// Families llama.cpp detects after Llama 3, none implemented here: (name, markers that must all
/// appear), in llama.cpp's order.
const LATER_FAMILIES: &[(&str, &[&str])] = &[
    ("chatglm3", &["[gMASK]sop"]),
    ("minicpm", &["<用户>"]),
    ("deepseek2", &["'Assistant: ' + message['content'] + eos_token"]),
    ("deepseek3", &["<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"]),
    ("exaone", &["[|system|]", "[|assistant|]", "[|endofturn|]"]),
    ("rwkv-world", &["rwkv-world"]),
    ("rwkv-world", &["{{- 'User: ' + message['content']|trim + '\\n\\n' -}}"]),
    // (Implemented: detect returns ChatTemplate::Granite here.)
    ("granite", &["<|start_of_role|>"]),
    ("gigachat", &["additional_special_tokens[0] + message['content'] + additional_special_tokens[1]"]),
    ("megrez", &["<|role_start|>"]),
    ("yandex", &[" Ассистент:"]),
    ("bailing", &["<role>ASSISTANT</role>", "'HUMAN'"]),
    ("llama4", &["<|header_start|>", "<|header_end|>"]),
    ("dots1", &["<|endofuserprompt|>"]),
    ("hunyuan-moe", &["<|startoftext|>", "<|extra_4|>"]),
    ("hunyuan-dense", &["<｜hy_place▁holder▁no▁2｜>", "<｜hy_place▁holder▁no▁3｜>"]),
    ("kimi-k2", &["<|im_assistant|>assistant<|im_middle|>"]),
];

/// llama.cpp's built-in format names that pinfer does not implement.
const OTHER_NAMES: &[&str] = &[
    "falcon3",
    "zephyr",
    "monarch",
    "orion",
    "openchat",
    "vicuna",
    "vicuna-orca",
    "deepseek",
    "deepseek2",
    "deepseek3",
    "command-r",
    "chatglm3",
    "chatglm4",
    "glmedge",
    "minicpm",
    "exaone3",
    "exaone4",
    "rwkv-world",
    "gigachat",
    "megrez",
    "yandex",
    "bailing",
    "llama4",
    "hunyuan-moe",
    "hunyuan-dense",
    "kimi-k2",
];

/// Trims what C's `isspace` calls space (llama.cpp's `trim`): space, `\t`, `\n`, `\v`, `\f`, `\r`.
/// Unlike `str::trim`, no other Unicode space.
fn c_trim(s: &str) -> &str {
    s.trim_matches(is_c_space)
}

/// C's `isspace` in the "C" locale.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r')
}

impl ChatTemplate {
    /// Every format, in the order of [`ChatTemplate::name`]'s documentation.
    pub const ALL: [ChatTemplate; 17] = [
        Self::ChatMl,
        Self::Llama3,
        Self::Gemma,
        Self::Gemma4,
        Self::Llama2,
        Self::Llama2Sys,
        Self::Llama2SysBos,
        Self::Llama2SysStrip,
        Self::MistralV1,
        Self::MistralV3,
        Self::MistralV3Tekken,
        Self::MistralV7,
        Self::MistralV7Tekken,
        Self::Phi3,
        Self::Phi4,
        Self::Granite,
        Self::SmolVlm,
    ];

    /// llama.cpp's name for the format (`chatml`, `llama3`, `gemma`, `llama2-sys`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatMl => "chatml",
            Self::Llama3 => "llama3",
            Self::Gemma => "gemma",
            Self::Gemma4 => "gemma4",
            Self::Llama2 => "llama2",
            Self::Llama2Sys => "llama2-sys",
            Self::Llama2SysBos => "llama2-sys-bos",
            Self::Llama2SysStrip => "llama2-sys-strip",
            Self::MistralV1 => "mistral-v1",
            Self::MistralV3 => "mistral-v3",
            Self::MistralV3Tekken => "mistral-v3-tekken",
            Self::MistralV7 => "mistral-v7",
            Self::MistralV7Tekken => "mistral-v7-tekken",
            Self::Phi3 => "phi3",
            Self::Phi4 => "phi4",
            Self::Granite => "granite",
            Self::SmolVlm => "smolvlm",
        }
    }

    /// The format called `name` (exactly, as llama.cpp's names).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The format a front end renders a model's chats in, by one policy everywhere (CLI, server,
    /// C ABI): the caller's choice `given` (a format name or a template's text), else the model's
    /// `tokenizer.chat_template` (`model_text`; none gives ChatML). A template pinfer cannot
    /// render is an error naming its family, never another format in its place.
    pub fn for_model(given: Option<&str>, model_text: Option<&str>) -> Result<Self, ChatError> {
        match given {
            Some(name) => Self::from_name(name).map_or_else(|| Self::detect(Some(name)), Ok),
            None => Self::detect(model_text),
        }
    }

    /// Chooses the format for a model's `tokenizer.chat_template` (or a format name), without
    /// executing it. `None` or `""` (the model has no template) gives ChatML, as llama.cpp does.
    pub fn detect(template_text: Option<&str>) -> Result<Self, ChatError> {
        use ChatTemplate::*;
        let t = match template_text {
            None | Some("") => return Ok(ChatMl),
            Some(t) => t,
        };
        if let Some(known) = Self::from_name(t) {
            return Ok(known);
        }
        if let Some(&family) = OTHER_NAMES.iter().find(|&&n| n == t) {
            return Err(ChatError::Unsupported { family });
        }
        let has = |marker: &str| t.contains(marker);
        let other = |family| Err(ChatError::Unsupported { family });

        // The order of these checks is llama.cpp's: a template can hold several markers.
        if has("<|im_start|>") {
            return if has("<|im_sep|>") {
                Ok(Phi4)
            } else if has("<end_of_utterance>") {
                Ok(SmolVlm)
            } else {
                Ok(ChatMl)
            };
        }
        if t.starts_with("mistral") || has("[INST]") {
            if has("[SYSTEM_PROMPT]") {
                return Ok(MistralV7);
            }
            if has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]") {
                return Ok(if has(" [INST]") {
                    MistralV1
                } else if has("\"[INST]\"") {
                    MistralV3Tekken
                } else {
                    MistralV3
                });
            }
            return Ok(if has("content.strip()") {
                Llama2SysStrip
            } else if has("bos_token + '[INST]") {
                Llama2SysBos
            } else if has("<<SYS>>") {
                Llama2Sys
            } else {
                Llama2
            });
        }
        if has("<|assistant|>") && has("<|end|>") {
            return Ok(Phi3);
        }
        if has("[gMASK]<sop>") {
            return other("chatglm4");
        }
        if has("<|assistant|>") && has("<|user|>") {
            return other(if has("</s>") { "falcon3" } else { "glmedge" });
        }
        if has("<|{{ item['role'] }}|>") && has("<|begin_of_image|>") {
            return other("glmedge");
        }
        if has("<|user|>") && has("<|endoftext|>") {
            return other("zephyr");
        }
        if has("bos_token + message['role']") {
            return other("monarch");
        }
        // Gemma 4 (llama.cpp leaves it to its Jinja engine).
        if has("<|turn>") && has("<turn|>") {
            return Ok(Gemma4);
        }
        if has("<start_of_turn>") {
            return Ok(Gemma);
        }
        if has("'\\n\\nAssistant: ' + eos_token") {
            return other("orion");
        }
        if has("GPT4 Correct ") {
            return other("openchat");
        }
        if has("USER: ") && has("ASSISTANT: ") {
            return other(if has("SYSTEM: ") { "vicuna-orca" } else { "vicuna" });
        }
        if has("### Instruction:") && has("<|EOT|>") {
            return other("deepseek");
        }
        if has("<|START_OF_TURN_TOKEN|>") && has("<|USER_TOKEN|>") {
            return other("command-r");
        }
        if has("<|start_header_id|>") && has("<|end_header_id|>") {
            return Ok(Llama3);
        }
        for &(family, markers) in LATER_FAMILIES {
            if markers.iter().all(|m| has(m)) {
                return if family == "granite" { Ok(Granite) } else { other(family) };
            }
        }
        Err(ChatError::Unrecognized)
    }

    /// The text that ends a turn of the model: generation should stop when it produces it (as a
    /// special token; the vocabulary's EOS/EOG tokens stop generation as well).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            Self::ChatMl | Self::Phi4 => "<|im_end|>",
            Self::Llama3 => "<|eot_id|>",
            Self::Gemma => "<end_of_turn>",
            Self::Gemma4 => "<turn|>",
            Self::Phi3 => "<|end|>",
            Self::Granite => "<|end_of_text|>",
            Self::SmolVlm => "<end_of_utterance>",
            Self::Llama2
            | Self::Llama2Sys
            | Self::Llama2SysBos
            | Self::Llama2SysStrip
            | Self::MistralV1
            | Self::MistralV3
            | Self::MistralV3Tekken
            | Self::MistralV7
            | Self::MistralV7Tekken => "</s>",
        }
    }

    /// Writes the prompt for `messages`, ending with the assistant's opening when
    /// `add_generation_prompt` (the Llama 2 and Mistral formats have none: their last `[/INST]` is
    /// the opening). Exactly llama.cpp's `llm_chat_apply_template` output; no BOS (see the module
    /// documentation). Allocates nothing; the only error is the writer's.
    pub fn render(
        &self,
        messages: &[Message<'_>],
        add_generation_prompt: bool,
        out: &mut impl Write,
    ) -> Result<(), ChatError> {
        let gen = add_generation_prompt;
        match *self {
            Self::ChatMl => {
                for m in messages {
                    write!(out, "<|im_start|>{}\n{}<|im_end|>\n", m.role.as_str(), m.content)?;
                }
                if gen {
                    out.write_str("<|im_start|>assistant\n")?;
                }
            }
            Self::Llama3 => {
                for m in messages {
                    write!(
                        out,
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        m.role.as_str(),
                        c_trim(m.content)
                    )?;
                }
                if gen {
                    out.write_str("<|start_header_id|>assistant<|end_header_id|>\n\n")?;
                }
            }
            Self::Gemma => render_gemma(messages, gen, out)?,
            Self::Gemma4 => {
                for m in messages {
                    let role = match m.role {
                        Role::System => "system",
                        Role::User => "user",
                        Role::Assistant => "model",
                    };
                    writeln!(out, "<|turn>{role}")?;
                    if m.role == Role::Assistant {
                        write_without_thinking(m.content, out)?;
                    } else {
                        out.write_str(c_trim(m.content))?;
                    }
                    out.write_str("<turn|>\n")?;
                }
                if gen {
                    out.write_str("<|turn>model\n<|channel>thought\n<channel|>")?;
                }
            }
            Self::Llama2 | Self::Llama2Sys | Self::Llama2SysBos | Self::Llama2SysStrip => {
                render_llama2(*self, messages, out)?
            }
            Self::MistralV1 | Self::MistralV3 | Self::MistralV3Tekken => {
                render_mistral(*self, messages, out)?
            }
            Self::MistralV7 | Self::MistralV7Tekken => {
                let space = if *self == Self::MistralV7 { " " } else { "" };
                for m in messages {
                    match m.role {
                        Role::System => write!(out, "[SYSTEM_PROMPT]{space}{}[/SYSTEM_PROMPT]", m.content)?,
                        Role::User => write!(out, "[INST]{space}{}[/INST]", m.content)?,
                        Role::Assistant => write!(out, "{space}{}</s>", m.content)?,
                    }
                }
            }
            Self::Phi3 => {
                for m in messages {
                    write!(out, "<|{}|>\n{}<|end|>\n", m.role.as_str(), m.content)?;
                }
                if gen {
                    out.write_str("<|assistant|>\n")?;
                }
            }
            Self::Phi4 => {
                for m in messages {
                    write!(out, "<|im_start|>{}<|im_sep|>{}<|im_end|>", m.role.as_str(), m.content)?;
                }
                if gen {
                    out.write_str("<|im_start|>assistant<|im_sep|>")?;
                }
            }
            Self::Granite => {
                for m in messages {
                    let role = m.role.as_str();
                    writeln!(out, "<|start_of_role|>{role}<|end_of_role|>{}<|end_of_text|>", m.content)?;
                }
                if gen {
                    out.write_str("<|start_of_role|>assistant<|end_of_role|>")?;
                }
            }
            Self::SmolVlm => {
                out.write_str("<|im_start|>")?;
                for m in messages {
                    match m.role {
                        Role::System => write!(out, "{}\n\n", m.content)?,
                        Role::User => writeln!(out, "User: {}<end_of_utterance>", m.content)?,
                        Role::Assistant => writeln!(out, "Assistant: {}<end_of_utterance>", m.content)?,
                    }
                }
                if gen {
                    out.write_str("Assistant:")?;
                }
            }
        }
        Ok(())
    }
}

/// A Gemma 4 model turn as its template's `strip_thinking` writes it: of each part of the text
/// between `<channel|>` markers, what comes before a `<|channel>` (all of a part without one),
/// the parts joined, then trimmed (leading white space skipped until text starts, the joined
/// text cut after the last part with text).
fn write_without_thinking(text: &str, out: &mut impl Write) -> Result<(), ChatError> {
    let parts = || text.split("<channel|>").map(|part| part.split("<|channel>").next().unwrap_or(""));
    let Some(last) = parts().enumerate().filter(|(_, k)| !c_trim(k).is_empty()).map(|(i, _)| i).last() else {
        return Ok(());
    };
    let mut started = false;
    for (i, mut k) in parts().enumerate().take(last + 1) {
        if !started {
            k = k.trim_start_matches(is_c_space);
            started = !k.is_empty();
        }
        if i == last {
            k = k.trim_end_matches(is_c_space);
        }
        out.write_str(k)?;
    }
    Ok(())
}

/// Gemma has no system role: system texts (trimmed, concatenated) open the next user turn, followed
/// by a blank line; assistant is "model"; every content is trimmed.
fn render_gemma(messages: &[Message<'_>], gen: bool, out: &mut impl Write) -> Result<(), ChatError> {
    // Index of the first system message not yet written (the pending system prompt starts there;
    // the model turns in between are skipped when it is written).
    let mut pending: Option<usize> = None;
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role {
            Role::System => {
                pending.get_or_insert(i);
                continue;
            }
            Role::User => "user",
            Role::Assistant => "model",
        };
        writeln!(out, "<start_of_turn>{role}")?;
        if let (Some(start), Role::User) = (pending, m.role) {
            let systems = messages[start..i].iter().filter(|m| m.role == Role::System);
            if systems.clone().any(|m| !c_trim(m.content).is_empty()) {
                for s in systems {
                    out.write_str(c_trim(s.content))?;
                }
                out.write_str("\n\n")?;
            }
            pending = None;
        }
        writeln!(out, "{}<end_of_turn>", c_trim(m.content))?;
    }
    if gen {
        out.write_str("<start_of_turn>model\n")?;
    }
    Ok(())
}

/// The four Llama 2 variants. The opening `[INST] ` is written up front (llama.cpp: "skip BOS at
/// the beginning"); a later turn reopens with `[INST] ` (or `<s>[INST] `).
fn render_llama2(t: ChatTemplate, messages: &[Message<'_>], out: &mut impl Write) -> Result<(), ChatError> {
    let system_blocks = t != ChatTemplate::Llama2;
    let bos_inside = t == ChatTemplate::Llama2SysBos;
    let strip = t == ChatTemplate::Llama2SysStrip;
    out.write_str("[INST] ")?;
    let mut inside_turn = true;
    for m in messages {
        let content = if strip { c_trim(m.content) } else { m.content };
        if !inside_turn {
            inside_turn = true;
            out.write_str(if bos_inside { "<s>[INST] " } else { "[INST] " })?;
        }
        match m.role {
            Role::System if system_blocks => write!(out, "<<SYS>>\n{content}\n<</SYS>>\n\n")?,
            Role::System => writeln!(out, "{content}")?,
            Role::User => write!(out, "{content} [/INST]")?,
            Role::Assistant => {
                write!(out, "{content}</s>")?;
                inside_turn = false;
            }
        }
    }
    Ok(())
}

/// Mistral v1, v3 and v3-tekken: a system message opens the first `[INST]` block.
fn render_mistral(t: ChatTemplate, messages: &[Message<'_>], out: &mut impl Write) -> Result<(), ChatError> {
    let leading = if t == ChatTemplate::MistralV1 { " " } else { "" };
    let trailing = if t == ChatTemplate::MistralV3Tekken { "" } else { " " };
    let trim_assistant = t == ChatTemplate::MistralV3;
    let mut inside_turn = false;
    for m in messages {
        if !inside_turn {
            write!(out, "{leading}[INST]{trailing}")?;
            inside_turn = true;
        }
        match m.role {
            Role::System => write!(out, "{}\n\n", m.content)?,
            Role::User => write!(out, "{}{leading}[/INST]", m.content)?,
            Role::Assistant => {
                let content = if trim_assistant { c_trim(m.content) } else { m.content };
                write!(out, "{trailing}{content}</s>")?;
                inside_turn = false;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Buf = heapless::String<1024>;

    fn render(t: ChatTemplate, messages: &[Message<'_>], gen: bool) -> Buf {
        let mut s = Buf::new();
        t.render(messages, gen, &mut s).unwrap();
        s
    }

    fn message(e: ChatError) -> heapless::String<600> {
        let mut s = heapless::String::new();
        write!(s, "{e}").unwrap();
        s
    }

    #[test]
    fn names_round_trip_and_are_accepted_by_detect() {
        for t in ChatTemplate::ALL {
            assert_eq!(ChatTemplate::from_name(t.name()), Some(t));
            assert_eq!(ChatTemplate::detect(Some(t.name())), Ok(t));
        }
        assert_eq!(ChatTemplate::detect(Some("zephyr")), Err(ChatError::Unsupported { family: "zephyr" }));
    }

    #[test]
    fn one_policy_for_a_model_s_format_the_choice_first_and_no_fallback() {
        let zephyr = Err(ChatError::Unsupported { family: "zephyr" });
        assert_eq!(ChatTemplate::for_model(Some("llama3"), Some("zephyr")), Ok(ChatTemplate::Llama3));
        assert_eq!(ChatTemplate::for_model(Some("<|im_start|>"), None), Ok(ChatTemplate::ChatMl));
        assert_eq!(ChatTemplate::for_model(Some("zephyr"), Some("<|im_start|>")), zephyr);
        assert_eq!(ChatTemplate::for_model(None, Some("zephyr")), zephyr);
        assert_eq!(ChatTemplate::for_model(None, Some("{{ messages }}")), Err(ChatError::Unrecognized));
        assert_eq!(ChatTemplate::for_model(None, None), Ok(ChatTemplate::ChatMl));
    }

    #[test]
    fn missing_template_is_chatml() {
        assert_eq!(ChatTemplate::detect(None), Ok(ChatTemplate::ChatMl));
        assert_eq!(ChatTemplate::detect(Some("")), Ok(ChatTemplate::ChatMl));
    }

    #[test]
    fn markers_choose_the_family_in_llama_cpp_order() {
        let cases = [
            ("{{'<|im_start|>' + m['role']}}", ChatTemplate::ChatMl),
            ("<|im_start|>{{role}}<|im_sep|>", ChatTemplate::Phi4),
            ("{{ '<|start_header_id|>' + r + '<|end_header_id|>' }}", ChatTemplate::Llama3),
            ("{{ '<start_of_turn>' + role }}", ChatTemplate::Gemma),
            ("{{ '[INST] ' + c + ' [/INST]' }}", ChatTemplate::Llama2),
            ("[INST] <<SYS>>", ChatTemplate::Llama2Sys),
            ("<<SYS>> {{ bos_token + '[INST] ' }}", ChatTemplate::Llama2SysBos),
            ("[INST] {{ content.strip() }}", ChatTemplate::Llama2SysStrip),
            ("mistral", ChatTemplate::Llama2),
            ("{{- ' [INST] ' + system_message }}", ChatTemplate::MistralV1),
            ("[AVAILABLE_TOOLS] {{ '[INST] ' }}", ChatTemplate::MistralV3),
            ("[AVAILABLE_TOOLS] {{ \"[INST]\" }}", ChatTemplate::MistralV3Tekken),
            ("[SYSTEM_PROMPT] [INST]", ChatTemplate::MistralV7),
            ("<|user|>x<|end|>\n<|assistant|>", ChatTemplate::Phi3),
            ("{{'<|start_of_role|>' + m['role'] + '<|end_of_role|>'}}", ChatTemplate::Granite),
            ("<|start_of_role|>{% if tools %}<tools>{% endif %}", ChatTemplate::Granite),
            // <|im_start|> wins over a Llama 3 header, as in llama.cpp.
            ("<|im_start|><|start_header_id|><|end_header_id|>", ChatTemplate::ChatMl),
        ];
        for (text, want) in cases {
            assert_eq!(ChatTemplate::detect(Some(text)), Ok(want), "{text}");
        }
        let others = [
            ("<|user|>\n{{c}}<|assistant|>", "glmedge"),
            ("<|user|>{{c}}</s><|assistant|>", "falcon3"),
            ("<|user|>{{c}}<|endoftext|>", "zephyr"),
            ("USER: {{c}} ASSISTANT: ", "vicuna"),
            ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "command-r"),
            ("<|header_start|>user<|header_end|>", "llama4"),
        ];
        for (text, family) in others {
            assert_eq!(ChatTemplate::detect(Some(text)), Err(ChatError::Unsupported { family }), "{text}");
        }
    }

    #[test]
    fn unknown_templates_are_refused_naming_the_options() {
        let e = ChatTemplate::detect(Some("{{ messages }}")).unwrap_err();
        assert_eq!(e, ChatError::Unrecognized);
        let m = message(e);
        assert!(m.contains("not recognised") && m.contains("never executes"), "{m}");
        for name in ["chatml", "llama3", "gemma"] {
            assert!(m.contains(name), "{m}");
        }
        let m = message(ChatError::Unsupported { family: "zephyr" });
        assert!(m.contains("'zephyr'") && m.contains("chatml"), "{m}");
    }

    #[test]
    fn end_of_turn_markers() {
        assert_eq!(ChatTemplate::ChatMl.end_of_turn(), "<|im_end|>");
        assert_eq!(ChatTemplate::Llama3.end_of_turn(), "<|eot_id|>");
        assert_eq!(ChatTemplate::Gemma.end_of_turn(), "<end_of_turn>");
        assert_eq!(ChatTemplate::Phi3.end_of_turn(), "<|end|>");
        assert_eq!(ChatTemplate::Granite.end_of_turn(), "<|end_of_text|>");
        assert_eq!(ChatTemplate::MistralV7.end_of_turn(), "</s>");
    }

    #[test]
    fn chatml_single_turn_and_no_generation_prompt() {
        let s = render(ChatTemplate::ChatMl, &[Message::user("Hi")], true);
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        let s = render(ChatTemplate::ChatMl, &[Message::user("Hi")], false);
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n");
        assert_eq!(render(ChatTemplate::Llama3, &[], false), "");
    }

    /// llama.cpp's granite output (LLM_CHAT_TEMPLATE_GRANITE_3_X), contents untrimmed.
    #[test]
    fn granite_roles_and_generation_prompt() {
        let m = [
            Message::system("Be brief."),
            Message::user(" Hi"),
            Message::assistant("Hello"),
            Message::user("Q"),
        ];
        let s = render(ChatTemplate::SmolVlm, &m, true);
        assert_eq!(
            s,
            "<|im_start|>Be brief.\n\nUser:  Hi<end_of_utterance>\nAssistant: Hello<end_of_utterance>\n\
             User: Q<end_of_utterance>\nAssistant:"
        );
        assert_eq!(
            ChatTemplate::detect(Some("<|im_start|>User:<end_of_utterance>")),
            Ok(ChatTemplate::SmolVlm)
        );
        let s = render(ChatTemplate::Granite, &m, true);
        assert_eq!(
            s,
            "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n\
             <|start_of_role|>user<|end_of_role|> Hi<|end_of_text|>\n\
             <|start_of_role|>assistant<|end_of_role|>Hello<|end_of_text|>\n\
             <|start_of_role|>user<|end_of_role|>Q<|end_of_text|>\n\
             <|start_of_role|>assistant<|end_of_role|>"
        );
    }

    /// The output of Gemma 4's own Jinja template (jinja2 3.1, `bos_token` empty, no tools, thinking
    /// off) for the same messages.
    #[test]
    fn gemma4_renders_as_its_jinja_template() {
        let m = [
            Message::system(" Be brief. "),
            Message::user(" Hi "),
            Message::assistant("  <|channel>thought\nhmm<channel|>Hello <|channel>x<channel|> there \n"),
            Message::user("Q"),
        ];
        let want =
            "<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello  there<turn|>\n\
                    <|turn>user\nQ<turn|>\n";
        assert_eq!(render(ChatTemplate::Gemma4, &m, false), want);
        let gen = render(ChatTemplate::Gemma4, &m, true);
        assert_eq!(gen.strip_prefix(want), Some("<|turn>model\n<|channel>thought\n<channel|>"));
        let m = [
            Message::user("Hi"),
            Message::assistant("<|channel>only thinking<channel|>  "),
            Message::system("Later"),
            Message::user("Q"),
        ];
        assert_eq!(
            render(ChatTemplate::Gemma4, &m, false),
            "<|turn>user\nHi<turn|>\n<|turn>model\n<turn|>\n<|turn>system\nLater<turn|>\n<|turn>user\nQ<turn|>\n"
        );
        assert_eq!(ChatTemplate::Gemma4.end_of_turn(), "<turn|>");
        let t = "{{ '<|turn>' + role + '\\n' }}{{ '<turn|>\\n' }}<start_of_turn>";
        assert_eq!(ChatTemplate::detect(Some(t)), Ok(ChatTemplate::Gemma4));
    }

    #[test]
    fn trimming_is_c_isspace_only() {
        assert_eq!(c_trim(" \t\n\x0B\x0Cx y\r\n"), "x y");
        assert_eq!(c_trim("\u{a0}x\u{2003}"), "\u{a0}x\u{2003}");
        let s = render(ChatTemplate::Llama3, &[Message::user("\u{a0}hi \n")], false);
        assert_eq!(s, "<|start_header_id|>user<|end_header_id|>\n\n\u{a0}hi<|eot_id|>");
    }

    #[test]
    fn gemma_merges_system_text_into_the_next_user_turn_only() {
        let m = [
            Message::system(" Be brief. "),
            Message::system("Be kind."),
            Message::assistant("Hello"),
            Message::user("Q"),
            Message::user("R"),
        ];
        let s = render(ChatTemplate::Gemma, &m, false);
        assert_eq!(
            s,
            "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBe brief.Be kind.\n\nQ<end_of_turn>\n\
             <start_of_turn>user\nR<end_of_turn>\n"
        );
        // An empty system text adds nothing, not even the blank line.
        let s = render(ChatTemplate::Gemma, &[Message::system("  "), Message::user("Q")], true);
        assert_eq!(s, "<start_of_turn>user\nQ<end_of_turn>\n<start_of_turn>model\n");
    }

    #[test]
    fn a_full_buffer_is_a_write_error() {
        let mut small = heapless::String::<8>::new();
        let e = ChatTemplate::ChatMl.render(&[Message::user("Hello")], true, &mut small).unwrap_err();
        assert_eq!(e, ChatError::Write);
    }
}
