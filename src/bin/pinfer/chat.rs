//! `pinfer chat`: a conversation through the model's chat template, one reply per line of
//! input (llama-cli's `-cnv`), on the same generation loop as `generate`.

use std::path::Path;

use pinfer::chat::{ChatTemplate, Role};
use pinfer::engine::EngineError;
use pinfer::generate::Flow;
use pinfer::generate::{Generator, Stop};
use pinfer::gguf::Gguf;
use pinfer::prompt_format::{FormatChoice, ModelTemplate, PromptFormat};
use pinfer::reasoning::{Markers, Piece, Splitter};
use pinfer::session::SessionError;
use pinfer::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use crate::gen_args::{load, set_speculative, GenArgs};
use crate::gen_loop::{gen_error, print_piece};
use crate::runtime::CacheCheck;
use crate::signals::{take_interrupt, Polled};
use crate::text_input::process_escapes;
use crate::tokenize::{encode, encode_with};
use crate::CliError;

/// The chat template `given` by `--chat-template` (a built-in name or a template text to
/// recognise), else the one the model file `path` carries, as a built-in format (`pinfer
/// finetune` writes its training texts in one).
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

/// How the conversations of a front end (chat, the server) become prompts, by
/// [`PromptFormat::choose`]'s one policy: `--chat-template` / `--chat-template-file`, `--no-jinja`,
/// else the model's own template run as Jinja.
pub(crate) fn prompt_format(
    args: &GenArgs,
    gguf: &Gguf<'_>,
    tok: &Tokenizer<'_>,
    path: &Path,
) -> Result<PromptFormat, CliError> {
    let file_text = match &args.chat_template_file {
        Some(file) => Some(
            std::fs::read_to_string(file)
                .map_err(|e| CliError::new(format!("--chat-template-file {}: {e}", file.display())))?,
        ),
        None => None,
    };
    let given = file_text.as_deref().or(args.chat_template.as_deref());
    let model_text = gguf.get_str_opt("tokenizer.chat_template").map_err(|e| CliError::new(e.to_string()))?;
    let token = |id: Option<u32>| {
        id.and_then(|id| tok.token_text(id).ok())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let (bos, eos) = (token(tok.bos()), token(tok.eos()));
    let model = ModelTemplate { text: model_text, bos_token: &bos, eos_token: &eos, adds_bos: tok.add_bos() };
    let choice = FormatChoice { no_jinja: args.no_jinja, template: given };
    PromptFormat::choose(choice, model).map_err(|e| {
        let whose = match (&args.chat_template_file, &args.chat_template) {
            (Some(file), _) => format!("--chat-template-file {}", file.display()),
            (None, Some(_)) => "--chat-template".to_string(),
            (None, None) => format!("{}: the model's chat template", path.display()),
        };
        let names: Vec<&str> = ChatTemplate::ALL.iter().map(|t| t.name()).collect();
        CliError::new(format!(
            "{whose}: {e} (--no-jinja uses a built-in format by the template's markers; --chat-template NAME \
             picks one of {})",
            names.join(", ")
        ))
    })
}

/// A piece of a reply split into reasoning (dimmed: the terminal shows it apart) and answer,
/// printed. (Not on a terminal, the reply is printed as the model wrote it.)
fn print_reasoned(check: &mut CacheCheck, piece: &Piece) -> Result<Flow, CliError> {
    if !piece.reasoning.is_empty() {
        out!("\x1b[2m{}\x1b[0m", piece.reasoning)?;
    }
    print_piece(check, &piece.content)
}

/// `--chat-template-kwargs`: a JSON object of extra template variables; `--reasoning-budget 0`
/// adds `enable_thinking: false` unless they set it.
pub(crate) fn template_kwargs(args: &GenArgs) -> Result<Map<String, Value>, CliError> {
    let mut kwargs = match &args.chat_template_kwargs {
        None => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            Ok(_) => return Err(CliError::new("--chat-template-kwargs: must be a JSON object".into())),
            Err(e) => return Err(CliError::new(format!("--chat-template-kwargs: not JSON: {e}"))),
        },
    };
    if args.reasoning_budget == 0 {
        kwargs.entry("enable_thinking").or_insert(Value::Bool(false));
    }
    Ok(kwargs)
}

/// A conversation as the template sees it: OpenAI's message objects.
pub(crate) fn messages_json(turns: &[(Role, String)]) -> Value {
    Value::Array(turns.iter().map(|(role, text)| json!({"role": role.as_str(), "content": text})).collect())
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
    let format = prompt_format(&args, session.gguf(), &tok, &path)?;
    let kwargs = template_kwargs(&args)?;
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
            let system = messages_json(&[(Role::System, text.clone())]);
            let rendered = format
                .render(&system, None, false, Some(&kwargs))
                .map_err(|e| CliError::new(e.to_string()))?;
            encode_with(&tok, &rendered, true, false)?.len()
        }
        None => 0,
    };
    gen.context_shift = args.shift_keep(system_tokens, tok.add_bos(), session.n_ctx())?;
    let mut cached: Vec<u32> = Vec::with_capacity(session.n_ctx() + 1);
    // Images (--mmproj, --image, `/image PATH`): each turn feeds what its rendering adds.
    let mut media = match &args.mmproj {
        Some(mmproj) => {
            if gen.context_shift.is_some() {
                return Err(CliError::new("--mmproj: a chat with images takes no --context-shift".into()));
            }
            let mut media = crate::chat_media::ChatMedia::open(&session, mmproj)?;
            for file in &args.image {
                let n = media.attach(&session, file)?;
                errln!("pinfer: image {}: {n} positions, with the first message", file.display());
            }
            Some(media)
        }
        None if !args.image.is_empty() => {
            return Err(CliError::new(
                "--image needs the model's vision projector: give it with --mmproj FILE".into(),
            ))
        }
        None => None,
    };
    errln!(
        "pinfer: chat with {} ({} template); an empty line or end of input ends it, Ctrl-C stops a reply",
        path.display(),
        format.name()
    );
    let markers = (args.reasoning_format != "none")
        .then(|| format.jinja_source().and_then(Markers::of_template))
        .flatten();
    let dim = std::io::IsTerminal::is_terminal(&std::io::stdout());
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
        if let Some(file) = line.strip_prefix("/image ") {
            // (llama-mtmd-cli's command: the image goes with the next message.)
            let file = Path::new(file.trim());
            match media.as_mut().map(|m| m.attach(&session, file)) {
                Some(Ok(n)) => {
                    errln!("pinfer: image {}: {n} positions, with the next message", file.display())
                }
                Some(Err(crate::CliError::Message(e))) => errln!("pinfer: {e}"),
                Some(Err(e)) => return Err(e),
                None => errln!(
                    "pinfer: /image needs the model's vision projector: start the chat with --mmproj FILE"
                ),
            }
            continue;
        }
        let line = match media.as_mut() {
            Some(m) => m.message(&line),
            None => line,
        };
        turns.push((Role::User, line));
        let render = |turns: &[(Role, String)]| -> Result<(Vec<u32>, String), CliError> {
            let rendered = format
                .render(&messages_json(turns), None, true, Some(&kwargs))
                .map_err(|e| CliError::new(e.to_string()))?;
            Ok((encode(&tok, &rendered, true)?, rendered))
        };
        let (mut tokens, mut rendered) = render(&turns)?;
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
                (tokens, rendered) = render(&turns)?;
            }
            if dropped > 0 {
                errln!(
                    "pinfer: context shift: dropped the {dropped} oldest message(s); the conversation is now {} tokens",
                    tokens.len()
                );
            }
        }
        let polled = Polled::start();
        let prompt_len = match media.as_mut() {
            Some(m) => {
                m.feed_turn(&mut session, &tok, &rendered, &mut cached)?;
                Some((cached.len(), session.n_past()))
            }
            None => None,
        };
        if prompt_len.is_none() {
            feed_text(&mut session, &mut gen, &mut cached, &tokens)?;
        }
        let mut reply = String::new();
        // A thinking model's reasoning is shown dimmed on a terminal and kept out of the
        // conversation's history (the answer alone is the assistant's turn).
        let mut splitter = markers.map(|m| Splitter::new(m, m.opened_by(&rendered)));
        // Every reply matches the grammar, from its start.
        if let Some(spec) = &grammar {
            gen.set_constraint(Some(crate::grammar_args::compile(spec, &tok, &mut vocab)?));
        }
        let stop = if take_interrupt() {
            Stop::Cancelled
        } else {
            gen.run(&mut session, &mut cached, limit, |text| match splitter.as_mut() {
                Some(s) => {
                    let piece = s.push(text);
                    reply.push_str(&piece.content);
                    if dim {
                        print_reasoned(&mut check, &piece)
                    } else {
                        print_piece(&mut check, text) // (markers and all, as the model wrote it)
                    }
                }
                None => {
                    reply.push_str(text);
                    print_piece(&mut check, text)
                }
            })
            .map_err(gen_error)?
        };
        if let Some(piece) = splitter.as_mut().map(Splitter::finish) {
            reply.push_str(&piece.content);
            if dim {
                print_reasoned(&mut check, &piece)?;
            }
        }
        drop(polled);
        outln!()?;
        match stop {
            Stop::ContextFull => errln!("pinfer: context full: reply cut short"),
            Stop::Cancelled => errln!("pinfer: reply interrupted"),
            Stop::GrammarDeadEnd => errln!("pinfer: no token of this model can continue the grammar here"),
            Stop::EndOfGeneration | Stop::Limit | Stop::StopString => {}
        }
        // The cache holds what was evaluated: a last sampled token may not be.
        match (prompt_len, media.as_mut()) {
            (Some((text, past)), Some(m)) => {
                let evaluated = (text + session.n_past().saturating_sub(past)).min(cached.len());
                m.replied(&tok, &cached[text..evaluated]);
                cached.truncate(evaluated);
            }
            _ => cached.truncate(session.n_past()),
        }
        turns.push((Role::Assistant, reply));
    }
    check.finish()
}

/// Feeds a text conversation's `tokens` after the part of them the cache holds (`cached`).
fn feed_text(
    session: &mut pinfer::session::Session,
    gen: &mut Generator<'_>,
    cached: &mut Vec<u32>,
    tokens: &[u32],
) -> Result<(), CliError> {
    // Reuse the cache for the part of the conversation it already holds.
    let keep = cached.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
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
    match gen.feed(session, &tokens[keep..]) {
        Ok(()) => {}
        Err(SessionError::Engine(EngineError::ContextFull { n_ctx, .. })) => {
            return Err(CliError::new(format!(
                "context full ({n_ctx} tokens): the conversation no longer fits; raise it with -c{}",
                if gen.context_shift.is_some() { "" } else { " or drop old messages with --context-shift" }
            )))
        }
        Err(e) => return Err(CliError::new(e.to_string())),
    }
    cached.extend_from_slice(&tokens[keep..]);
    Ok(())
}
