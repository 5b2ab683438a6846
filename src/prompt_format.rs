//! How a conversation becomes prompt text, chosen by one policy for every std front end (`chat`,
//! `generate -cnv`, the server's chat routes and `/apply-template`): the model's own Jinja
//! template ([`crate::jinja`], the default when the file has one, as llama.cpp's `--jinja`), or a
//! built-in format ([`crate::chat::ChatTemplate`]: with `--no-jinja`, for a model without a
//! template, or named by `--chat-template NAME`).
//!
//! - `--chat-template NAME` (a built-in name) always picks that built-in format.
//! - `--chat-template TEXT` or `--chat-template-file FILE` replaces the model's template text.
//! - The template text (the model's or the one given) is compiled as Jinja unless `--no-jinja`;
//!   one that does not compile is an error naming `--no-jinja` and `--chat-template` as the ways
//!   out. With `--no-jinja` it is recognised by its markers as before (refused by family name
//!   when no built-in format renders it).
//! - No template at all: ChatML, as llama.cpp. A text without any Jinja in it that is no built-in
//!   name is refused as a mistyped name.
//!
//! A Jinja template that writes the model's BOS text at the start gets it removed when the
//! tokenizer adds BOS itself, so the prompt never starts with two.

use std::borrow::ToOwned;
use std::boxed::Box;
use std::fmt;
use std::format;
use std::string::{String, ToString};
use std::vec::Vec;

use serde_json::{Map, Value};

use crate::chat::{ChatError, ChatTemplate, Message, Role};
use crate::jinja::{Conversation, JinjaTemplate, TemplateError};

/// What the user asked for on the command line (or the server's start-up flags).
#[derive(Clone, Copy, Debug, Default)]
pub struct FormatChoice<'a> {
    /// `--no-jinja`: never run a template; use the built-in formats.
    pub no_jinja: bool,
    /// `--chat-template`: a built-in name or a template text; or the text of
    /// `--chat-template-file`.
    pub template: Option<&'a str>,
}

/// The model's side of the choice.
#[derive(Clone, Copy, Debug)]
pub struct ModelTemplate<'a> {
    /// `tokenizer.chat_template`, if the file has one.
    pub text: Option<&'a str>,
    /// The texts of the model's BOS and EOS tokens (`bos_token`, `eos_token` in the template).
    pub bos_token: &'a str,
    /// See `bos_token`.
    pub eos_token: &'a str,
    /// The tokenizer adds BOS to a prompt (`tokenizer.ggml.add_bos_token`).
    pub adds_bos: bool,
}

/// Why a conversation cannot be formatted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FormatError {
    /// No built-in format renders this template (`--no-jinja`).
    BuiltIn(ChatError),
    /// The Jinja template does not compile, or refused or failed on this conversation.
    Template(TemplateError),
    /// A message the built-in formats cannot take (a role other than system, user, assistant).
    Message(String),
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BuiltIn(e) => write!(f, "{e}"),
            Self::Template(e) => write!(f, "{e}"),
            Self::Message(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for FormatError {}

/// A chosen prompt format.
#[derive(Debug)]
pub enum PromptFormat {
    /// The template's own Jinja, run.
    Jinja {
        /// The compiled template (boxed: an environment is large beside a format's name).
        template: Box<JinjaTemplate>,
        /// The template's source (reported by `/props`, searched for tool-call markers).
        source: String,
        /// Remove a leading BOS text the tokenizer would add again.
        strip_bos: Option<String>,
    },
    /// One of the built-in formats.
    BuiltIn(ChatTemplate),
}

impl PromptFormat {
    /// Chooses the format by the policy in the module's documentation.
    pub fn choose(choice: FormatChoice<'_>, model: ModelTemplate<'_>) -> Result<Self, FormatError> {
        if let Some(name) = choice.template.and_then(ChatTemplate::from_name) {
            return Ok(Self::BuiltIn(name));
        }
        let text = choice.template.or(model.text).filter(|t| !t.is_empty());
        match text {
            None => Ok(Self::BuiltIn(ChatTemplate::ChatMl)),
            // (A given text with no Jinja in it is a mistyped name, not a template that prints
            // itself.)
            Some(text) if choice.no_jinja || !(text.contains("{{") || text.contains("{%")) => {
                ChatTemplate::detect(Some(text)).map(Self::BuiltIn).map_err(FormatError::BuiltIn)
            }
            Some(text) => {
                let template = JinjaTemplate::compile(text, model.bos_token, model.eos_token)
                    .map_err(FormatError::Template)?;
                let strip_bos =
                    (model.adds_bos && !model.bos_token.is_empty()).then(|| model.bos_token.to_owned());
                Ok(Self::Jinja { template: Box::new(template), source: text.to_owned(), strip_bos })
            }
        }
    }

    /// A short name for messages: `jinja` or the built-in format's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Jinja { .. } => "jinja",
            Self::BuiltIn(t) => t.name(),
        }
    }

    /// The built-in format, if this is one.
    pub fn built_in(&self) -> Option<ChatTemplate> {
        match self {
            Self::BuiltIn(t) => Some(*t),
            Self::Jinja { .. } => None,
        }
    }

    /// The Jinja template's source, if this is one.
    pub fn jinja_source(&self) -> Option<&str> {
        match self {
            Self::Jinja { source, .. } => Some(source),
            Self::BuiltIn(_) => None,
        }
    }

    /// Renders `messages` (OpenAI's shape: objects with `role` and `content`, and whatever else
    /// the template reads) with `tools` (a JSON array, or None) and the request's template
    /// keyword arguments.
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        kwargs: Option<&Map<String, Value>>,
    ) -> Result<String, FormatError> {
        match self {
            Self::Jinja { template, strip_bos, .. } => {
                let conversation =
                    Conversation { messages, tools, documents: None, add_generation_prompt, kwargs };
                let text = template.render(&conversation).map_err(FormatError::Template)?;
                Ok(match strip_bos {
                    Some(bos) => text.strip_prefix(bos.as_str()).map_or(text.clone(), str::to_owned),
                    None => text,
                })
            }
            Self::BuiltIn(t) => {
                let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
                let mut turns = Vec::with_capacity(list.len());
                for (i, m) in list.iter().enumerate() {
                    let role = match m.get("role").and_then(Value::as_str) {
                        Some("system") => Role::System,
                        Some("user") => Role::User,
                        Some("assistant") => Role::Assistant,
                        other => {
                            return Err(FormatError::Message(format!(
                                "messages[{i}]: the built-in '{}' format takes system, user and assistant \
                                 messages, not {}",
                                t.name(),
                                other.map_or("a message without a role".to_string(), |r| format!("{r:?}"))
                            )))
                        }
                    };
                    turns.push(Message {
                        role,
                        content: m.get("content").and_then(Value::as_str).unwrap_or(""),
                    });
                }
                let mut out = String::new();
                t.render(&turns, add_generation_prompt, &mut out).map_err(FormatError::BuiltIn)?;
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3_LIKE: &str =
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\
                               {% if add_generation_prompt %}<|assistant|>{% endif %}";

    fn model(text: Option<&str>, adds_bos: bool) -> ModelTemplate<'_> {
        ModelTemplate { text, bos_token: "<|begin_of_text|>", eos_token: "<|eot_id|>", adds_bos }
    }

    #[test]
    fn one_policy_for_every_front_end() {
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        // The model's template runs; the BOS it writes is left to the tokenizer.
        let f = PromptFormat::choose(FormatChoice::default(), model(Some(LLAMA3_LIKE), true)).unwrap();
        assert_eq!(f.render(&msgs, None, true, None).unwrap(), "<|user|>hi<|assistant|>");
        let f = PromptFormat::choose(FormatChoice::default(), model(Some(LLAMA3_LIKE), false)).unwrap();
        assert_eq!(f.render(&msgs, None, true, None).unwrap(), "<|begin_of_text|><|user|>hi<|assistant|>");
        // A built-in name wins; --no-jinja recognises the text; no template is ChatML.
        let chatml = FormatChoice { no_jinja: false, template: Some("chatml") };
        assert_eq!(PromptFormat::choose(chatml, model(Some(LLAMA3_LIKE), true)).unwrap().name(), "chatml");
        let no_jinja = FormatChoice { no_jinja: true, template: None };
        assert!(matches!(
            PromptFormat::choose(no_jinja, model(Some(LLAMA3_LIKE), true)),
            Err(FormatError::BuiltIn(ChatError::Unrecognized))
        ));
        assert_eq!(
            PromptFormat::choose(FormatChoice::default(), model(None, true)).unwrap().name(),
            "chatml"
        );
        // A template that does not compile is an error, never another format in its place.
        assert!(matches!(
            PromptFormat::choose(FormatChoice::default(), model(Some("{% if %}"), true)),
            Err(FormatError::Template(TemplateError::Compile(_)))
        ));
        // The built-in formats refuse roles they cannot write.
        let tool = serde_json::json!([{"role": "tool", "content": "18"}]);
        let f = PromptFormat::choose(chatml, model(None, true)).unwrap();
        assert!(matches!(f.render(&tool, None, true, None), Err(FormatError::Message(_))));
    }
}
