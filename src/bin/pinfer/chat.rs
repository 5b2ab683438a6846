//! `pinfer chat`: a conversation through the model's chat template, one reply per line of
//! input (llama-cli's `-cnv`), on the same generation loop as `generate`.

use std::path::Path;

use pinfer::chat::{ChatTemplate, Message, Role};
use pinfer::engine::EngineError;
use pinfer::generate::{Generator, Stop};
use pinfer::gguf::Gguf;
use pinfer::session::SessionError;

use crate::gen_args::{load, set_speculative, GenArgs};
use crate::gen_loop::{gen_error, print_piece};
use crate::runtime::CacheCheck;
use crate::signals::{take_interrupt, Polled};
use crate::text_input::process_escapes;
use crate::tokenize::{encode, encode_with};
use crate::CliError;

/// The chat template: `--chat-template` (a built-in name or a template text to recognise), else
/// the one the model file carries.
fn chat_template(args: &GenArgs, gguf: &Gguf<'_>, path: &Path) -> Result<ChatTemplate, CliError> {
    template_for(args.chat_template.as_deref(), gguf, path)
}

/// The chat template `given` (a built-in name or a template text to recognise), else the one
/// the model file `path` carries.
pub(crate) fn template_for(
    given: Option<&str>,
    gguf: &Gguf<'_>,
    path: &Path,
) -> Result<ChatTemplate, CliError> {
    let text = match given {
        Some(_) => None,
        None => gguf.get_str_opt("tokenizer.chat_template").map_err(|e| CliError::new(e.to_string()))?,
    };
    ChatTemplate::for_model(given, text).map_err(|e| match given {
        Some(given) => {
            let names: Vec<&str> = ChatTemplate::ALL.iter().map(|t| t.name()).collect();
            CliError::new(format!(
                "--chat-template {given:?}: neither a built-in name nor a template pinfer recognises ({e}); \
                 built-in: {}",
                names.join(", ")
            ))
        }
        None => CliError::new(format!("{}: {e} (--chat-template NAME picks a built-in one)", path.display())),
    })
}

/// `pinfer chat` (and `generate -cnv`): a conversation on stdin/stdout with the model's chat
/// template, one message per line, an empty line or end of input ends it. The KV cache is kept
/// across turns: each turn evaluates only what the cache does not hold yet. With
/// `--context-shift` a conversation outgrowing the context drops its oldest exchanges. Ctrl-C
/// stops the reply and returns to the prompt; at the prompt it exits.
pub fn chat(args: GenArgs) -> Result<(), CliError> {
    use std::io::BufRead;
    let config = args.sampler()?;
    let limit = args.limit(512)?;
    let grammar = args.grammar.spec()?;
    let first = args.prompt()?;
    let system =
        args.system.as_deref().map(|s| if args.escape() { process_escapes(s) } else { s.to_string() });
    args.session_options()?;
    let (path, mut session, tok) = load(&args, &config)?;
    let mut check = CacheCheck::start(&session, &path);
    let template = chat_template(&args, session.gguf(), &path)?;
    let mut gen =
        Generator::new(&tok, session.n_vocab(), config).map_err(|e| CliError::new(e.to_string()))?;
    let stops: Vec<&str> = args.reverse_prompt.iter().map(String::as_str).collect();
    gen.set_ignore_eos(args.ignore_eos);
    gen.set_stop_strings(&stops);
    set_speculative(&args, &session, &tok, &mut gen)?;
    let mut vocab = None;
    let mut turns: Vec<(Role, String)> = system.into_iter().map(|s| (Role::System, s)).collect();
    // --context-shift: `--keep -1` keeps the system message's tokens through a shift inside a
    // reply (N keeps N tokens, the default only BOS).
    let system_tokens = match turns.first() {
        Some((_, text)) => {
            let mut rendered = String::new();
            template
                .render(&[Message { role: Role::System, content: text }], false, &mut rendered)
                .map_err(|e| CliError::new(e.to_string()))?;
            encode_with(&tok, &rendered, true, false)?.len()
        }
        None => 0,
    };
    gen.context_shift = args.shift_keep(system_tokens, tok.add_bos(), session.n_ctx())?;
    let mut cached: Vec<u32> = Vec::with_capacity(session.n_ctx() + 1);
    errln!(
        "pinfer: chat with {} ({} template); an empty line or end of input ends it, Ctrl-C stops a reply",
        path.display(),
        template.name()
    );
    let mut pending = first;
    let stdin = std::io::stdin();
    loop {
        let line = match pending.take() {
            Some(text) => {
                outln!("> {text}")?;
                text
            }
            None => {
                out!("> ")?;
                let mut line = String::new();
                let n = stdin
                    .lock()
                    .read_line(&mut line)
                    .map_err(|e| CliError::new(format!("reading stdin: {e}")))?;
                if n == 0 {
                    break;
                }
                line.trim_end_matches(['\n', '\r']).to_string()
            }
        };
        if line.is_empty() {
            break;
        }
        turns.push((Role::User, line));
        let render = |turns: &[(Role, String)]| -> Result<Vec<u32>, CliError> {
            let messages: Vec<Message<'_>> =
                turns.iter().map(|(role, text)| Message { role: *role, content: text }).collect();
            let mut rendered = String::new();
            template.render(&messages, true, &mut rendered).map_err(|e| CliError::new(e.to_string()))?;
            encode(&tok, &rendered, true)
        };
        let mut tokens = render(&turns)?;
        if gen.context_shift.is_some() {
            // A context shift between turns drops the oldest exchanges (the system message
            // stays) until the conversation leaves a quarter of the context for the reply;
            // within a reply the generator shifts token by token.
            let room = session.n_ctx() / 4;
            let mut dropped = 0;
            while tokens.len() + room > session.n_ctx() {
                let Some(first) = turns.iter().position(|(role, _)| *role != Role::System) else { break };
                if first + 1 >= turns.len() {
                    break; // only the new message is left
                }
                turns.remove(first);
                dropped += 1;
                if turns.get(first).is_some_and(|(role, _)| *role == Role::Assistant)
                    && first + 1 < turns.len()
                {
                    turns.remove(first);
                    dropped += 1;
                }
                tokens = render(&turns)?;
            }
            if dropped > 0 {
                errln!(
                    "pinfer: context shift: dropped the {dropped} oldest message(s); the conversation is now {} tokens",
                    tokens.len()
                );
            }
        }
        // Reuse the cache for the part of the conversation it already holds.
        let keep = cached.iter().zip(&tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
        // (A model with recurrent layers keeps the cache whole or not at all.)
        let keep = session.truncate(keep);
        cached.truncate(keep);
        if tokens.len() >= cached.capacity() {
            return Err(CliError::new(format!(
                "context full ({} tokens): the conversation no longer fits; raise it with -c{}",
                session.n_ctx(),
                if gen.context_shift.is_some() { "" } else { " or drop old messages with --context-shift" }
            )));
        }
        let polled = Polled::start();
        match gen.feed(&mut session, &tokens[keep..]) {
            Ok(()) => {}
            Err(SessionError::Engine(EngineError::ContextFull { n_ctx, .. })) => {
                return Err(CliError::new(format!(
                    "context full ({n_ctx} tokens): the conversation no longer fits; raise it with -c{}",
                    if gen.context_shift.is_some() {
                        ""
                    } else {
                        " or drop old messages with --context-shift"
                    }
                )))
            }
            Err(e) => return Err(CliError::new(e.to_string())),
        }
        cached.extend_from_slice(&tokens[keep..]);
        let mut reply = String::new();
        // Every reply matches the grammar, from its start.
        if let Some(spec) = &grammar {
            gen.set_constraint(Some(crate::grammar_args::compile(spec, &tok, &mut vocab)?));
        }
        let stop = if take_interrupt() {
            Stop::Cancelled
        } else {
            gen.run(&mut session, &mut cached, limit, |text| {
                reply.push_str(text);
                print_piece(&mut check, text)
            })
            .map_err(gen_error)?
        };
        drop(polled);
        outln!()?;
        match stop {
            Stop::ContextFull => errln!("pinfer: context full: reply cut short"),
            Stop::Cancelled => errln!("pinfer: reply interrupted"),
            Stop::GrammarDeadEnd => errln!("pinfer: no token of this model can continue the grammar here"),
            Stop::EndOfGeneration | Stop::Limit | Stop::StopString => {}
        }
        // The cache holds what was evaluated: a last sampled token may not be.
        cached.truncate(session.n_past());
        turns.push((Role::Assistant, reply));
    }
    check.finish()
}
