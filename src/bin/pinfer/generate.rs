//! `pinfer generate` and `pinfer tokenize`: text in, tokens and text out.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use pinfer::gguf::Gguf;
use pinfer::loader::ModelFile;
use pinfer::sampler::{Candidate, Sampler, SamplerConfig};
use pinfer::session::{SessionError, SessionOptions};
use pinfer::tokenizer::{StreamDecoder, Tokenizer};

use crate::runtime::{Runtime, RuntimeArgs};
use crate::CliError;

/// What `generate` needs besides the model.
pub struct GenerateArgs {
    pub prompt: String,
    pub n_predict: usize,
    pub sampler: SamplerConfig,
    pub n_ctx: usize,
    pub runtime: RuntimeArgs,
    pub parse_special: bool,
    pub print_ids: bool,
    pub ignore_eos: bool,
    pub no_repack: bool,
    pub verbose: u8,
}

/// The model's tokenizer, its tables in memory kept for the whole process (like the model).
pub fn tokenizer(path: &Path, gguf: &Gguf<'static>) -> Result<Tokenizer<'static>, CliError> {
    let fail = |e: pinfer::tokenizer::TokError| CliError::new(format!("{}: {e}", path.display()));
    let words = Tokenizer::storage_words(gguf).map_err(fail)?;
    let storage: &'static mut [u32] = Box::leak(vec![0u32; words].into_boxed_slice());
    Tokenizer::new(gguf, storage).map_err(fail)
}

/// Token ids of `text` (BOS/EOS as the model says).
pub fn encode(tok: &Tokenizer<'_>, text: &str, parse_special: bool) -> Result<Vec<u32>, CliError> {
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    // About one token per byte at most, plus BOS, EOS and a space prefix; the tokenizer says how
    // many it needs if that is not enough.
    let mut ids = vec![0u32; text.len() + 4];
    let n = match tok.encode_with_scratch(text, parse_special, true, &mut ids, &mut scratch) {
        Err(pinfer::tokenizer::TokError::OutputTooSmall { needed, .. }) => {
            ids.resize(needed, 0);
            tok.encode_with_scratch(text, parse_special, true, &mut ids, &mut scratch)
        }
        other => other,
    }
    .map_err(|e| CliError::new(format!("tokenizing the prompt: {e}")))?;
    ids.truncate(n);
    Ok(ids)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// llama.cpp-style timing line: total, count, per token, per second.
fn timing(label: &str, t: f64, n: usize, unit: &str) -> String {
    let per = if n > 0 { t / n as f64 } else { 0.0 };
    let rate = if t > 0.0 { 1e3 * n as f64 / t } else { 0.0 };
    format!("pinfer: {label:>16} = {t:10.2} ms / {n:5} {unit:6} ({per:8.2} ms per token, {rate:8.2} tokens per second)")
}

pub fn generate(path: &Path, args: GenerateArgs) -> Result<(), CliError> {
    let t_start = Instant::now();
    let runtime = Runtime::new(&args.runtime)?;
    let mut opts = SessionOptions { n_ctx: args.n_ctx, ..Default::default() };
    opts.repack &= !args.no_repack;
    let mut session = runtime.load(path, opts, args.verbose)?;
    if args.verbose > 0 {
        let (n, bytes, secs) = session.repacked();
        let how = if session.from_cache() { "mapped from the repack cache" } else { "repacked" };
        errln!(
            "pinfer: kernels {}, {} threads, {n} weight matrices {how} ({:.1} MiB) in {:.0} ms",
            pinfer::kernels::path().name(),
            session.threads(),
            bytes as f64 / (1 << 20) as f64,
            secs * 1e3
        );
    }
    let tok = tokenizer(path, session.gguf())?;
    let mut sampler = Sampler::new(args.sampler).map_err(|e| CliError::new(e.to_string()))?;
    let prompt = encode(&tok, &args.prompt, args.parse_special)?;
    if prompt.is_empty() {
        return Err(CliError::new("the prompt is empty after tokenization".into()));
    }
    let mut candidates = vec![Candidate::default(); session.n_vocab()];
    let mut piece = vec![0u8; StreamDecoder::buffer_len(&tok)];
    let mut decoder = StreamDecoder::new();
    let t_load = t_start.elapsed();

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = write!(out, "{}", args.prompt);
    let _ = out.flush();

    let t_prompt = Instant::now();
    let mut logits = session.eval(&prompt).map_err(|e| CliError::new(e.to_string()))?.to_vec();
    let t_prompt = t_prompt.elapsed();

    let mut recent: Vec<u32> = prompt.clone();
    let mut generated = Vec::new();
    let mut stop_note = None;
    let t_gen = Instant::now();
    while generated.len() < args.n_predict {
        let window = recent.len().saturating_sub(args.sampler.repeat_last_n as usize);
        let id = sampler
            .sample(&logits, &recent[window..], &mut candidates)
            .map_err(|e| CliError::new(e.to_string()))?;
        if tok.is_eog(id) && !args.ignore_eos {
            break;
        }
        generated.push(id);
        recent.push(id);
        let text = decoder.push(&tok, id, false, &mut piece).map_err(|e| CliError::new(e.to_string()))?;
        let _ = write!(out, "{text}");
        let _ = out.flush();
        if generated.len() == args.n_predict {
            break;
        }
        match session.eval(&[id]) {
            Ok(l) => logits.copy_from_slice(l),
            Err(SessionError::ContextFull { n_ctx, .. }) => {
                stop_note = Some(format!("context full ({n_ctx} tokens): stopped; raise it with -c"));
                break;
            }
            Err(e) => return Err(CliError::new(e.to_string())),
        }
    }
    let t_gen = t_gen.elapsed();
    let _ = writeln!(out, "{}", decoder.finish(&mut piece));
    if args.print_ids {
        let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
        let _ = writeln!(out, "{}", ids.join(" "));
    }
    drop(out);
    if let Some(note) = stop_note {
        errln!("pinfer: {note}");
    }
    // The first generated token comes from the prompt's logits, like llama.cpp's count of eval runs.
    let runs = generated.len().saturating_sub(1);
    errln!();
    errln!("pinfer: {:>16} = {:10.2} ms", "load time", ms(t_load));
    errln!("{}", timing("prompt eval time", ms(t_prompt), prompt.len(), "tokens"));
    errln!("{}", timing("eval time", ms(t_gen), runs, "runs"));
    errln!(
        "pinfer: {:>16} = {:10.2} ms / {:5} tokens",
        "total time",
        ms(t_start.elapsed()),
        prompt.len() + runs
    );
    if args.verbose > 0 {
        crate::npu::report_end(&session);
    }
    Ok(())
}

/// `pinfer tokenize`: ids of a text; works on vocabulary-only files (no tensors are touched).
pub fn tokenize(path: &Path, text: &str, ids_only: bool, parse_special: bool) -> Result<(), CliError> {
    let model = ModelFile::open_static(path)?;
    let gguf = model.parse()?;
    pinfer::model::validate_vocab(&gguf).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let tok = tokenizer(path, &gguf)?;
    let ids = encode(&tok, text, parse_special)?;
    if ids_only {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        outln!("{}", list.join(" "))?;
        return Ok(());
    }
    let mut piece = vec![0u8; StreamDecoder::buffer_len(&tok)];
    for id in ids {
        let n = tok.token_to_piece(id, true, &mut piece).map_err(|e| CliError::new(e.to_string()))?;
        outln!("{id:6} -> '{}'", String::from_utf8_lossy(&piece[..n]))?;
    }
    Ok(())
}

/// `pinfer perplexity`: the text split into chunks of the context size, each evaluated from an
/// empty cache (BOS first where the model adds one) and scored on its second half, like
/// llama.cpp's perplexity tool.
pub fn perplexity(path: &Path, file: &Path, n_ctx: usize, runtime: &RuntimeArgs) -> Result<(), CliError> {
    let text = std::fs::read(file).map_err(|e| CliError::new(format!("{}: {e}", file.display())))?;
    let text = String::from_utf8_lossy(&text);
    let runtime = Runtime::new(runtime)?;
    let n_ctx = if n_ctx == 0 { 512 } else { n_ctx };
    let opts = SessionOptions { n_ctx, n_batch: n_ctx.min(512), logits_all: true, ..Default::default() };
    let mut session = runtime.load(path, opts, 0)?;
    let tok = tokenizer(path, session.gguf())?;
    let mut scratch = vec![0u32; tok.scratch_words(text.len())];
    let mut tokens = vec![0u32; text.len() + 4];
    let n = tok
        .encode_with_scratch(&text, false, false, &mut tokens, &mut scratch)
        .map_err(|e| CliError::new(format!("tokenizing {}: {e}", file.display())))?;
    tokens.truncate(n);
    let n_chunks = tokens.len() / n_ctx;
    if n_chunks == 0 {
        return Err(CliError::new(format!(
            "{}: {} tokens, fewer than one chunk of {n_ctx}",
            file.display(),
            n
        )));
    }
    let first = n_ctx / 2;
    let (mut nll, mut count) = (0f64, 0usize);
    let t0 = Instant::now();
    for c in 0..n_chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if tok.add_bos() {
            if let Some(bos) = tok.bos() {
                chunk[0] = bos;
            }
        }
        session.truncate(0);
        session
            .eval_all(&chunk, |i, logits| {
                if i >= first && i + 1 < n_ctx {
                    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let sum: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
                    let target = chunk[i + 1] as usize;
                    nll += sum.ln() - f64::from(logits[target] - max);
                    count += 1;
                }
            })
            .map_err(|e| CliError::new(e.to_string()))?;
        err!("[{}]{:.4} ", c + 1, (nll / count as f64).exp());
    }
    errln!();
    errln!("pinfer: {n_chunks} chunks of {n_ctx} tokens in {:.2} s", t0.elapsed().as_secs_f64());
    outln!("PPL = {:.4}", (nll / count as f64).exp())?;
    Ok(())
}

/// `pinfer chat`: an interactive conversation on stdin/stdout using the model's chat template. The
/// KV cache is kept across turns: each turn evaluates only what the cache does not hold yet.
pub fn chat(
    path: &Path,
    system: Option<String>,
    n_ctx: usize,
    runtime: &RuntimeArgs,
    n_reply: usize,
    sampler: SamplerConfig,
) -> Result<(), CliError> {
    use pinfer::chat::{ChatTemplate, Message, Role};
    use std::io::BufRead;
    let runtime = Runtime::new(runtime)?;
    let opts = SessionOptions { n_ctx, ..Default::default() };
    let mut session = runtime.load(path, opts, 0)?;
    let tok = tokenizer(path, session.gguf())?;
    let template_text =
        session.gguf().get_str_opt("tokenizer.chat_template").map_err(|e| CliError::new(e.to_string()))?;
    let template =
        ChatTemplate::detect(template_text).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    let mut sampler = Sampler::new(sampler).map_err(|e| CliError::new(e.to_string()))?;
    let mut candidates = vec![Candidate::default(); session.n_vocab()];
    let mut piece = vec![0u8; StreamDecoder::buffer_len(&tok)];
    let mut turns: Vec<(Role, String)> = system.into_iter().map(|s| (Role::System, s)).collect();
    let mut cached: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    errln!(
        "pinfer: chat with {} ({} template); an empty line or end of input ends it",
        path.display(),
        template.name()
    );
    loop {
        let _ = write!(out, "> ");
        let _ = out.flush();
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).map_err(|e| CliError::new(format!("reading stdin: {e}")))? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            break;
        }
        turns.push((Role::User, line.to_string()));
        let messages: Vec<Message<'_>> =
            turns.iter().map(|(role, text)| Message { role: *role, content: text }).collect();
        let mut rendered = String::new();
        template.render(&messages, true, &mut rendered).map_err(|e| CliError::new(e.to_string()))?;
        let tokens = encode(&tok, &rendered, true)?;
        // Reuse the cache for the part of the conversation it already holds.
        let keep = cached.iter().zip(&tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
        session.truncate(keep);
        cached.truncate(keep);
        let mut logits = match session.eval(&tokens[keep..]) {
            Ok(l) => l.to_vec(),
            Err(SessionError::ContextFull { n_ctx, .. }) => {
                return Err(CliError::new(format!(
                    "context full ({n_ctx} tokens): the conversation no longer fits; raise it with -c"
                )))
            }
            Err(e) => return Err(CliError::new(e.to_string())),
        };
        cached.extend_from_slice(&tokens[keep..]);
        let mut reply = String::new();
        let mut decoder = StreamDecoder::new();
        for _ in 0..n_reply {
            let window = cached.len().saturating_sub(64);
            let id = sampler
                .sample(&logits, &cached[window..], &mut candidates)
                .map_err(|e| CliError::new(e.to_string()))?;
            if tok.is_eog(id) {
                break;
            }
            let text = decoder.push(&tok, id, false, &mut piece).map_err(|e| CliError::new(e.to_string()))?;
            reply.push_str(text);
            let _ = write!(out, "{text}");
            let _ = out.flush();
            match session.eval(&[id]) {
                Ok(l) => logits.copy_from_slice(l),
                Err(SessionError::ContextFull { .. }) => {
                    errln!("\npinfer: context full: reply cut short");
                    break;
                }
                Err(e) => return Err(CliError::new(e.to_string())),
            }
            cached.push(id);
        }
        reply.push_str(decoder.finish(&mut piece));
        let _ = writeln!(out);
        turns.push((Role::Assistant, reply));
    }
    Ok(())
}
