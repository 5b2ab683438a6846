//! `pinfer generate` and `pinfer tokenize`: text in, tokens and text out.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use pinfer::gguf::Gguf;
use pinfer::loader::ModelFile;
use pinfer::sampler::{Candidate, Sampler, SamplerConfig};
use pinfer::session::{Session, SessionError, SessionOptions};
use pinfer::tokenizer::{StreamDecoder, Tokenizer};

use crate::CliError;

/// What `generate` needs besides the model.
pub struct GenerateArgs {
    pub prompt: String,
    pub n_predict: usize,
    pub sampler: SamplerConfig,
    pub n_ctx: usize,
    pub threads: usize,
    pub parse_special: bool,
    pub print_ids: bool,
}

/// The model's tokenizer, its tables in memory kept for the whole process (like the model).
pub fn tokenizer(path: &Path, gguf: &Gguf<'static>) -> Result<Tokenizer<'static>, CliError> {
    let fail = |e: pinfer::tokenizer::TokError| CliError(format!("{}: {e}", path.display()));
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
    .map_err(|e| CliError(format!("tokenizing the prompt: {e}")))?;
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
    let model = ModelFile::open_static(path)?;
    let opts = SessionOptions { n_ctx: args.n_ctx, threads: args.threads, ..Default::default() };
    let mut session = Session::new(model, &opts).map_err(|e| CliError(format!("{}: {e}", path.display())))?;
    let tok = tokenizer(path, session.gguf())?;
    let mut sampler = Sampler::new(args.sampler).map_err(|e| CliError(e.to_string()))?;
    let prompt = encode(&tok, &args.prompt, args.parse_special)?;
    if prompt.is_empty() {
        return Err(CliError("the prompt is empty after tokenization".into()));
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
    let mut logits = session.eval(&prompt).map_err(|e| CliError(e.to_string()))?.to_vec();
    let t_prompt = t_prompt.elapsed();

    let mut recent: Vec<u32> = prompt.clone();
    let mut generated = Vec::new();
    let mut stop_note = None;
    let t_gen = Instant::now();
    while generated.len() < args.n_predict {
        let window = recent.len().saturating_sub(args.sampler.repeat_last_n as usize);
        let id = sampler
            .sample(&logits, &recent[window..], &mut candidates)
            .map_err(|e| CliError(e.to_string()))?;
        if tok.is_eog(id) {
            break;
        }
        generated.push(id);
        recent.push(id);
        let text = decoder.push(&tok, id, false, &mut piece).map_err(|e| CliError(e.to_string()))?;
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
            Err(e) => return Err(CliError(e.to_string())),
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
        eprintln!("pinfer: {note}");
    }
    // The first generated token comes from the prompt's logits, like llama.cpp's count of eval runs.
    let runs = generated.len().saturating_sub(1);
    eprintln!();
    eprintln!("pinfer: {:>16} = {:10.2} ms", "load time", ms(t_load));
    eprintln!("{}", timing("prompt eval time", ms(t_prompt), prompt.len(), "tokens"));
    eprintln!("{}", timing("eval time", ms(t_gen), runs, "runs"));
    eprintln!(
        "pinfer: {:>16} = {:10.2} ms / {:5} tokens",
        "total time",
        ms(t_start.elapsed()),
        prompt.len() + runs
    );
    Ok(())
}

/// `pinfer tokenize`: ids of a text; works on vocabulary-only files (no tensors are touched).
pub fn tokenize(path: &Path, text: &str, ids_only: bool, parse_special: bool) -> Result<(), CliError> {
    let model = ModelFile::open_static(path)?;
    let gguf = model.parse()?;
    pinfer::model::validate_vocab(&gguf).map_err(|e| CliError(format!("{}: {e}", path.display())))?;
    let tok = tokenizer(path, &gguf)?;
    let ids = encode(&tok, text, parse_special)?;
    if ids_only {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", list.join(" "));
        return Ok(());
    }
    let mut piece = vec![0u8; StreamDecoder::buffer_len(&tok)];
    for id in ids {
        let n = tok.token_to_piece(id, true, &mut piece).map_err(|e| CliError(e.to_string()))?;
        println!("{id:6} -> '{}'", String::from_utf8_lossy(&piece[..n]));
    }
    Ok(())
}
