//! `pinfer embed` (llama-embedding's options and output shapes) and `pinfer rerank`: an encoder's
//! vectors of each input line, through `pinfer::embed` (batches filling `-b`, `--pooling`,
//! `--embd-normalize`). A generating model is refused, as an encoder is by `generate` and `chat`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use pinfer::embed::{embed, embed_typed, rerank_prompt, rerank_template, EmbedOptions, Embeddings};
use pinfer::engine::embedding::{cosine, Normalize};
use pinfer::model::Pooling;
use pinfer::session::{Session, SessionOptions};

use crate::runtime::{Runtime, RuntimeArgs};
use crate::CliError;

/// Options of `pinfer embed` (llama-embedding's names).
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// Model file (GGUF): an encoder (bert).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The inputs, one per line (may start with '-').
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true, required_unless_present = "file")]
    pub prompt: Option<String>,
    /// Read the inputs from this file, one per line (`-`: stdin).
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub common: EmbedCommon,
    /// How the vectors are pooled: none (every token's), mean, cls, last, rank (default: the
    /// model's `pooling_type`).
    #[arg(long = "pooling", value_parser = parse_pooling)]
    pub pooling: Option<Pooling>,
    /// Normalisation: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, >2 p-norm.
    #[arg(long = "embd-normalize", default_value_t = 2, allow_negative_numbers = true)]
    pub normalize: i32,
    /// Output format: json, json+ (with the cosine similarity matrix), array, raw (one vector per
    /// line); default: llama-embedding's summary and, for several inputs, the similarity matrix.
    #[arg(long = "embd-output-format", value_parser = ["json", "json+", "array", "raw"])]
    pub format: Option<String>,
}

/// Options `embed` and `rerank` share.
#[derive(Args, Debug)]
pub struct EmbedCommon {
    /// Most tokens per batch: several inputs share one, each whole (an input longer than it, or
    /// than the context, is refused unless --truncate).
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch: usize,
    /// Context per input (0: the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx: usize,
    /// Most inputs per batch (sequences).
    #[arg(long = "parallel", short = 'n', default_value_t = 16)]
    pub parallel: usize,
    /// Cut an input longer than the batch or the context to its first tokens instead of refusing it.
    #[arg(long = "truncate")]
    pub truncate: bool,
    /// The inputs are token ids (space-separated on each line), not text.
    #[arg(long = "token-ids")]
    pub token_ids: bool,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// Options of `pinfer rerank`: a cross-encoder's score of each document for the query.
#[derive(Args, Debug)]
pub struct RerankArgs {
    /// Model file (GGUF): a reranker (bert with a cls.output head).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The query.
    #[arg(long = "query", allow_hyphen_values = true)]
    pub query: String,
    /// The documents, one per line (`-`: stdin).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    #[command(flatten)]
    pub common: EmbedCommon,
}

fn parse_pooling(name: &str) -> Result<Pooling, String> {
    Pooling::from_name(name)
        .ok_or_else(|| format!("{name:?}: the poolings are none, mean, cls, last and rank"))
}

/// The lines of `-p` or `-f` (llama-embedding splits its prompt at newlines; a file's last
/// newline ends its last line).
fn input_lines(prompt: Option<&str>, file: Option<&Path>) -> Result<Vec<String>, CliError> {
    let text = match (prompt, file) {
        (Some(p), _) => p.to_string(),
        (None, Some(f)) => crate::text_input::read_text_file(f)?,
        (None, None) => return Err(CliError::new("give the inputs with -p TEXT or -f FILE".into())),
    };
    let text = text.strip_suffix('\n').unwrap_or(&text);
    Ok(text.split('\n').map(str::to_string).collect())
}

fn load(args: &EmbedCommon, path: &Path, pooling: Option<Pooling>) -> Result<Session, CliError> {
    if args.batch == 0 || args.parallel == 0 {
        return Err(CliError::new("-b and --parallel must be at least 1".into()));
    }
    let runtime = Runtime::new(&args.runtime)?;
    // Without pooling every token's vector is an output.
    let per_token = pooling == Some(Pooling::None);
    let opts = SessionOptions {
        n_ctx: args.ctx,
        n_batch: args.batch,
        n_seq: args.parallel.min(pinfer::engine::MAX_SEQ),
        logits_all: per_token,
        pooling,
        ..Default::default()
    };
    let session = runtime.load(path, opts, 0)?;
    if session.engine().pooling().is_none() {
        return Err(CliError::new(format!(
            "{}: this model generates text and has no embedding output (pinfer embed runs encoders such as bert)",
            path.display()
        )));
    }
    if session.engine().pooling() == Some(Pooling::None) && !per_token {
        // The file's pooling is none: every token is an output, which the session must hold.
        return load(args, path, Some(Pooling::None));
    }
    Ok(session)
}

/// Each line's token ids: parsed (`--token-ids`) or tokenized with the model's tokenizer.
fn tokens_of(
    args: &EmbedCommon,
    path: &Path,
    session: &Session,
    lines: &[String],
) -> Result<Vec<Vec<u32>>, CliError> {
    if args.token_ids {
        return lines
            .iter()
            .enumerate()
            .map(|(i, line)| {
                line.split_whitespace()
                    .map(|w| {
                        w.parse::<u32>()
                            .map_err(|_| CliError::new(format!("input {i}: {w:?} is not a token id")))
                    })
                    .collect()
            })
            .collect();
    }
    let tok = crate::tokenize::tokenizer(path, session.gguf())?;
    lines.iter().map(|line| crate::tokenize::encode(&tok, line, false)).collect()
}

pub fn run(args: EmbedArgs) -> Result<(), CliError> {
    let normalize = Normalize::from_value(args.normalize).ok_or_else(|| {
        CliError::new(format!("--embd-normalize {}: the values are -1, 0, 1, 2 and above", args.normalize))
    })?;
    let path = crate::model_path(args.model.clone())?;
    let lines = input_lines(args.prompt.as_deref(), args.file.as_deref())?;
    let mut session = load(&args.common, &path, args.pooling)?;
    let inputs = tokens_of(&args.common, &path, &session, &lines)?;
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let opts = EmbedOptions { normalize, truncate: args.common.truncate };
    let out = embed(&mut session, &refs, &opts)?;
    let text = match args.format.as_deref() {
        None => summary(&out, &lines, normalize),
        Some(format) => formatted(&out, format, normalize),
    };
    out!("{text}")?;
    Ok(())
}

pub fn rerank(args: RerankArgs) -> Result<(), CliError> {
    let path = crate::model_path(args.model.clone())?;
    let docs = input_lines(None, Some(&args.file))?;
    let mut session = load(&args.common, &path, Some(Pooling::Rank))?;
    let template = rerank_template(session.gguf()).filter(|_| !args.common.token_ids);
    let (pairs, types): (Vec<Vec<u32>>, Vec<Option<Vec<u32>>>) = match template {
        Some(template) => {
            let tok = crate::tokenize::tokenizer(&path, session.gguf())?;
            let pair = |d: &String| templated_pair(&tok, template, &args.query, d).map(|ids| (ids, None));
            docs.iter()
                .map(pair)
                .collect::<Result<Vec<_>, String>>()
                .map_err(CliError::new)?
                .into_iter()
                .unzip()
        }
        None => {
            let query =
                tokens_of(&args.common, &path, &session, std::slice::from_ref(&args.query))?.remove(0);
            let docs = tokens_of(&args.common, &path, &session, &docs)?;
            let n_types = session.engine().token_types();
            docs.iter().map(|d| rerank_pair(&query, d, n_types)).unzip()
        }
    };
    let refs: Vec<&[u32]> = pairs.iter().map(Vec::as_slice).collect();
    let type_refs: Vec<&[u32]> = types.iter().flatten().map(Vec::as_slice).collect();
    let opts = EmbedOptions { normalize: Normalize::None, truncate: args.common.truncate };
    let out = embed_typed(&mut session, &refs, &type_refs, &opts)?;
    // One score per pair, or per label with the labels' names (Qwen3-Reranker's yes and no),
    // as llama-embedding prints them.
    let labels = output_labels(session.gguf());
    let mut text = String::new();
    for i in 0..pairs.len() {
        let row = out.row(i, 0).unwrap_or(&[]);
        if labels.is_empty() {
            let score = row.first().copied().unwrap_or(f32::NAN);
            let _ = writeln!(text, "rerank score {i}: {score:8.3}");
        }
        for (label, score) in labels.iter().zip(row) {
            let _ = writeln!(text, "rerank score {i}: {score:8.3} [{label}]");
        }
    }
    out!("{text}")?;
    Ok(())
}

/// A reranker's input: the query's tokens then the document's without its first
/// (`[CLS] q [SEP] d [SEP]`, [`Tokenizer::encode_pair`](pinfer::tokenizer::Tokenizer::encode_pair)'s
/// ids), as `pinfer rerank` and the server's /rerank build it; and, for a model with `n_types` of
/// two or more, its token types as HF's pair encoding gives them (0 up to the query's `[SEP]`, 1
/// after; llama.cpp gives every token type 0, all a one-type model has).
pub fn rerank_pair(query: &[u32], doc: &[u32], n_types: usize) -> (Vec<u32>, Option<Vec<u32>>) {
    let ids: Vec<u32> = query.iter().chain(doc.iter().skip(1)).copied().collect();
    let types = (n_types >= 2).then(|| (0..ids.len()).map(|i| u32::from(i >= query.len())).collect());
    (ids, types)
}

/// A reranker's input from the model's `rerank` prompt template (Qwen3-Reranker's): the template
/// with `{query}` and `{document}` filled, tokenized with its special tokens parsed and nothing
/// added (llama.cpp's format_prompt_rerank).
pub fn templated_pair(
    tok: &pinfer::tokenizer::Tokenizer<'_>,
    template: &str,
    query: &str,
    doc: &str,
) -> Result<Vec<u32>, String> {
    crate::tokenize::encode_with(tok, &rerank_prompt(template, query, doc), true, false).map_err(
        |e| match e {
            CliError::Message(m) => m,
            _ => "the pair cannot be tokenized".to_string(),
        },
    )
}

/// The names of a classifier's labels (`{arch}.classifier.output_labels`), empty without them.
fn output_labels(gguf: &pinfer::gguf::Gguf<'_>) -> Vec<String> {
    let arch = gguf.get_str_opt("general.architecture").ok().flatten().unwrap_or("");
    let key = format!("{arch}.classifier.output_labels");
    match gguf.get(&key) {
        Some(pinfer::gguf::Value::Array(a)) => {
            a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
        }
        _ => Vec::new(),
    }
}

/// Every vector, in input order (one per input, or one per token without pooling).
fn vectors(out: &Embeddings) -> Vec<&[f32]> {
    out.rows.iter().flat_map(|rows| rows.chunks(out.width.max(1))).collect()
}

/// A value as llama-embedding prints it in its formats.
fn value(v: f32, normalize: Normalize) -> String {
    if normalize == Normalize::MaxAbs {
        format!("{v:.0}")
    } else {
        format!("{v:.7}")
    }
}

/// llama-embedding's default output: the first values of each vector and, for several inputs,
/// their cosine similarities.
fn summary(out: &Embeddings, lines: &[String], normalize: Normalize) -> String {
    let cell =
        |v: f32| if normalize == Normalize::MaxAbs { format!("{v:6.0} ") } else { format!("{v:9.6} ") };
    let all = vectors(out);
    let mut s = String::new();
    if out.pooling == Pooling::Rank {
        for (j, v) in all.iter().enumerate() {
            let _ = writeln!(s, "rerank score {j}: {:8.3}", v.first().copied().unwrap_or(f32::NAN));
        }
        return s;
    }
    for (j, v) in all.iter().enumerate() {
        let _ = write!(s, "embedding {j}: ");
        if out.pooling == Pooling::None {
            v.iter().take(3).for_each(|&x| s.push_str(&cell(x)));
            s.push_str(" ... ");
            v.iter().skip(v.len().saturating_sub(3)).for_each(|&x| s.push_str(&cell(x)));
        } else {
            let n = if all.len() > 1 { v.len().min(16) } else { v.len() };
            v.iter().take(n).for_each(|&x| s.push_str(&cell(x)));
        }
        s.push('\n');
    }
    if out.pooling != Pooling::None && all.len() > 1 {
        s.push_str("\ncosine similarity matrix:\n\n");
        for line in lines {
            let _ = write!(s, "{:>6.6} ", line);
        }
        s.push('\n');
        for (i, a) in all.iter().enumerate() {
            for b in &all {
                let _ = write!(s, "{:6.2} ", cosine(a, b));
            }
            let _ = writeln!(s, "{:.10}", lines.get(i).map_or("", String::as_str));
        }
    }
    s
}

/// `--embd-output-format`: llama-embedding's json, json+, array and raw.
fn formatted(out: &Embeddings, format: &str, normalize: Normalize) -> String {
    let all = vectors(out);
    let join = |v: &[f32], sep: &str| v.iter().map(|&x| value(x, normalize)).collect::<Vec<_>>().join(sep);
    let mut s = String::new();
    match format {
        "raw" => {
            // (A reranker's vector is its labels' scores.)
            for v in &all {
                let _ = writeln!(s, "{}", join(v, " "));
            }
        }
        "array" => {
            let rows: Vec<String> = all.iter().map(|v| format!("[{}]", join(v, ","))).collect();
            let _ = writeln!(s, "[{}]", rows.join(","));
        }
        _ => {
            s.push_str("{\n  \"object\": \"list\",\n  \"data\": [\n");
            let items: Vec<String> = all
                .iter()
                .enumerate()
                .map(|(j, v)| {
                    format!(
                        "    {{\n      \"object\": \"embedding\",\n      \"index\": {j},\n      \"embedding\": [{}]\n    }}",
                        join(v, ",")
                    )
                })
                .collect();
            s.push_str(&items.join(",\n"));
            s.push_str("\n  ]");
            if format == "json+" && all.len() > 1 {
                s.push_str(",\n  \"cosineSimilarity\": [\n");
                let rows: Vec<String> = all
                    .iter()
                    .map(|a| {
                        let cells: Vec<String> =
                            all.iter().map(|b| format!("{:6.2}", cosine(a, b))).collect();
                        format!("    [{} ]", cells.join(", "))
                    })
                    .collect();
                s.push_str(&rows.join(",\n"));
                s.push_str("\n  ]");
            }
            s.push_str("\n}\n");
        }
    }
    s
}
