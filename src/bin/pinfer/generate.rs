//! `pinfer generate`: a prompt in, the generated text streamed out, timings on stderr.
//!
//! It takes llama-cli's options ([`GenArgs`]); `generate -cnv` (or `-i`) is `chat`.

use std::time::Instant;

use pinfer::engine::EngineError;
use pinfer::generate::{Generator, Stop};
use pinfer::session::SessionError;

use crate::gen_args::{load, set_speculative, GenArgs};
use crate::gen_loop::{gen_error, print_piece};
use crate::runtime::CacheCheck;
use crate::signals::{take_interrupt, Polled};
use crate::tokenize::encode;
use crate::CliError;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// llama.cpp-style timing line: total, count, per token, per second.
fn timing(label: &str, t: f64, n: usize, unit: &str) -> String {
    let per = if n > 0 { t / n as f64 } else { 0.0 };
    let rate = if t > 0.0 { 1e3 * n as f64 / t } else { 0.0 };
    format!("pinfer: {label:>16} = {t:10.2} ms / {n:5} {unit:6} ({per:8.2} ms per token, {rate:8.2} tokens per second)")
}

/// `pinfer generate`: the prompt, then the generated text streamed to stdout; timings on stderr.
pub fn generate(args: GenArgs) -> Result<(), CliError> {
    if args.conversation {
        return crate::chat::chat(args);
    }
    let t_start = Instant::now();
    // Everything the user typed is checked before the model loads.
    let config = args.sampler()?;
    let limit = args.limit(128)?;
    let grammar = args.grammar.spec()?;
    let prompt_text = args.prompt()?.ok_or_else(|| {
        CliError::new("no prompt: give -p TEXT, -f FILE, or -p - to read it from stdin (-cnv to chat)".into())
    })?;
    args.session_options()?;
    let (path, mut session, tok) = load(&args, &config)?;
    let mut check = CacheCheck::start(&session, &path);
    let mut gen =
        Generator::new(&tok, session.n_vocab(), config).map_err(|e| CliError::new(e.to_string()))?;
    gen.set_ignore_eos(args.ignore_eos);
    let stops: Vec<&str> = args.reverse_prompt.iter().map(String::as_str).collect();
    gen.set_stop_strings(&stops);
    if let Some(spec) = &grammar {
        gen.set_constraint(Some(crate::grammar_args::compile(spec, &tok, &mut None)?));
    }
    set_speculative(&args, &session, &tok, &mut gen)?;
    // With images: the chat template around the text and the images (llama-mtmd-cli's -p).
    let media = match args.image.is_empty() {
        true => None,
        false => {
            if args.prompt_cache.is_some() || args.context_shift {
                return Err(CliError::new(
                    "--image: a prompt with images takes neither --prompt-cache nor --context-shift".into(),
                ));
            }
            Some(crate::vision::image_prompt(&args, &session, &tok, &path, &prompt_text)?)
        }
    };
    let prompt = match &media {
        Some(m) => m.text_tokens(),
        None => encode(&tok, &prompt_text, !args.no_parse_special)?,
    };
    if prompt.is_empty() {
        return Err(CliError::new("the prompt is empty after tokenization".into()));
    }
    gen.context_shift = match &media {
        Some(m) if m.positions() >= session.n_ctx() => {
            return Err(CliError::new(format!(
                "context full: the prompt and its images need {} positions, the context holds {}; raise it with -c",
                m.positions(),
                session.n_ctx()
            )))
        }
        Some(_) => None,
        None => args.shift_keep(prompt.len(), tok.add_bos(), session.n_ctx())?,
    };
    // Every token the context can hold: the generated ones are appended without allocating (past
    // a context shift the history may grow beyond it).
    let room = match (gen.context_shift, limit) {
        (Some(_), Some(n)) => prompt.len() + n,
        _ => session.n_ctx().max(prompt.len()),
    };
    let mut tokens = Vec::with_capacity(room + 1);
    tokens.extend_from_slice(&prompt);
    let t_load = t_start.elapsed();

    if !args.no_display_prompt {
        if args.color {
            out!("\x1b[33m{prompt_text}\x1b[0m")?;
        } else {
            out!("{prompt_text}")?;
        }
    }
    let polled = Polled::start();
    let t_prompt = Instant::now();
    let cache =
        args.prompt_cache.as_deref().map(|file| crate::prompt_cache::PromptCache::new(file, &session));
    let (reused, shared) = cache.as_ref().map_or((0, 0), |c| c.restore(&mut session, &prompt));
    let fed = match &media {
        Some(m) => pinfer::media::feed(&mut session, m.projector.params(), &m.parts, &m.images).map(|_| ()),
        None => gen.feed(&mut session, &prompt[reused..]),
    };
    let stop = match fed {
        Ok(()) => None,
        Err(SessionError::Engine(EngineError::ContextFull { needed, n_ctx })) => {
            return Err(CliError::new(format!(
            "context full: the prompt needs {needed} positions, the context holds {n_ctx}; raise it with -c"
        )))
        }
        Err(e) => return Err(CliError::new(e.to_string())),
    };
    if let (Some(c), false) = (&cache, args.prompt_cache_ro) {
        if stop.is_none() && shared < prompt.len() {
            c.save(&session, &prompt);
        }
    }
    let t_prompt = t_prompt.elapsed();
    let t_gen = Instant::now();
    let stop = match stop {
        Some(s) => s,
        None if take_interrupt() => Stop::Cancelled,
        None => {
            gen.run(&mut session, &mut tokens, limit, |t| print_piece(&mut check, t)).map_err(gen_error)?
        }
    };
    let t_gen = t_gen.elapsed();
    drop(polled);
    outln!()?;
    let generated = &tokens[prompt.len()..];
    if args.print_ids {
        let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
        outln!("{}", ids.join(" "))?;
    }
    crate::streams::flush_stdout()?;
    match stop {
        Stop::ContextFull => {
            errln!("pinfer: context full ({} tokens): stopped; raise it with -c", session.n_ctx())
        }
        Stop::Cancelled => errln!("pinfer: interrupted"),
        Stop::GrammarDeadEnd => {
            errln!("pinfer: stopped: no token of this model can continue the grammar here")
        }
        Stop::EndOfGeneration | Stop::Limit | Stop::StopString => {}
    }
    // The first generated token comes from the prompt's logits, like llama.cpp's count of eval runs.
    let runs = generated.len().saturating_sub(1);
    errln!();
    errln!("pinfer: {:>16} = {:10.2} ms", "load time", ms(t_load));
    if let Some(m) = &media {
        // (Decoding, preprocessing and the projector, per image: llama-mtmd-cli's "image slice
        // encoded in" is the projector's part.)
        let n = m.images.len().max(1) as f64;
        errln!(
            "pinfer: {:>16} = {:10.2} ms / {:5} images ({:8.2} ms per image)",
            "image encode time",
            ms(m.encode_time),
            m.images.len(),
            ms(m.encode_time) / n
        );
    }
    // (An image's positions count as the prompt's tokens, as llama-mtmd-cli counts them.)
    let n_prompt = media.as_ref().map_or(prompt.len(), |m| m.positions());
    errln!("{}", timing("prompt eval time", ms(t_prompt), n_prompt, "tokens"));
    errln!("{}", timing("eval time", ms(t_gen), runs, "runs"));
    errln!("pinfer: {:>16} = {:10.2} ms / {:5} tokens", "total time", ms(t_start.elapsed()), n_prompt + runs);
    let l = gen.draft_stats();
    if args.lookup.is_some() || args.model_draft.is_some() {
        let source = if args.lookup.is_some() { "lookup" } else { "draft model" };
        errln!(
            "pinfer: {source}: {} tokens guessed in {} batches, {} taken ({:.0}%)",
            l.drafted,
            l.batches,
            l.accepted,
            100.0 * l.accepted as f64 / l.drafted.max(1) as f64
        );
    }
    if let Some(c) = gen.constraint_mut() {
        let complete = c.is_accepting().unwrap_or(false) || stop == Stop::EndOfGeneration;
        if stop == Stop::Limit && !complete {
            errln!(
                "pinfer: the output ends before its grammar is complete (-n {} was too few tokens)",
                generated.len()
            );
        }
        if args.verbose > 0 {
            if let Ok(s) = c.stats() {
                errln!(
                    "pinfer: grammar: {} masks, computed in {} us (p50) / {} us (p99) / {} us (max); generation waited {:.2} ms for them",
                    s.masks, s.p50_us, s.p99_us, s.max_us, s.waited_us as f64 / 1e3
                );
            }
        }
    }
    if args.verbose > 0 {
        crate::npu::report_end(&session);
        if let Some(m) = &media {
            crate::npu::report_encoder(&m.projector);
        }
    }
    check.finish()?;
    if stop == Stop::Cancelled {
        return Err(CliError::Interrupted);
    }
    Ok(())
}
